// Attention of a plain pass over the shared KV pool, for MLX's CUDA backend
// (mx.fast.cuda_kernel): every query row of every request in one launch, as pooled_attention.cu
// computes it, but with a (head, row)'s keys spread over all the warps of a block at once.
//
//   out[h, r, :] = softmax(scale * q[h, r, :] . K[kvh, base_r + j, :], j < len_r) @ V[kvh, base_r + j, :]
//
// pooled_attention.cu's order is shared with its Metal twin and proven by the self-tests; a
// plain pass promises no bits, so this kernel takes another order, built for one row: each lane
// reads 16 contiguous bytes of a key (a key is D * sizeof(T) / 16 lanes, so loads coalesce), a
// warp issues all its loads of K and V for a pass before any arithmetic, and every (head, row)
// has SPLIT_WARPS warps. The order (the NumPy model kernels/custom/split_attention_order.py is
// the specification) depends on len_r alone, never on R or the other rows:
//   - keys go in passes of KEYS_PER_PASS = (32 / LANES_PER_KEY) * SPLIT_LOADS; warp w runs the
//     passes p = w, w + SPLIT_WARPS, ... in increasing p; in a pass, load i of lane slot s
//     (s = lane / LANES_PER_KEY) is key p * KEYS_PER_PASS + i * (32 / LANES_PER_KEY) + s;
//   - a key's score: each lane an fmaf chain over its E = 16 / sizeof(T) dims in increasing d,
//     then an xor butterfly over the key's lanes (LANES_PER_KEY / 2, ..., 1), times scale;
//   - per pass: m_new = max(m, the pass's scores), p = expf(s - m_new), corr = expf(m - m_new);
//     l = l * corr + (each slot's sum of its p in load order, then an xor butterfly over slots);
//     acc[e] = acc[e] * corr, then fmaf(p_i, V[key i][e], acc[e]) in load order, per slot;
//   - after the passes, the slots' acc are summed by an xor butterfly (16, ..., LANES_PER_KEY);
//   - the warps' (m, l, acc) are combined in warp order 0 .. SPLIT_WARPS - 1.
//
// Template arguments (set by kernels/custom/split_attention.py): T (element type), D (head dim;
// D * sizeof(T) 64, 128, 256 or 512 bytes), HG (query heads of one KV head a block takes: each
// key and value is loaded once for all of them; each head's work is in the order above, so HG
// changes no bits).

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace lockstep {

constexpr int SPLIT_WARPS = 16;
constexpr int SPLIT_LOADS = 8;  // 16-byte loads of K, and as many of V, a lane has in flight
constexpr unsigned SPLIT_MASK = 0xffffffffu;

__device__ __forceinline__ float split_float(float v) { return v; }
__device__ __forceinline__ float split_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float split_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T split_store(float v);
template <> __device__ __forceinline__ float split_store<float>(float v) { return v; }
template <> __device__ __forceinline__ __half split_store<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 split_store<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

template <typename T, int D, int HG>
__device__ void split_attention(const T* q, const T* k, const T* v, const int* row_base,
                                const int* row_len, const float* scale_in, T* out,
                                int heads, int rows, int kv_heads, int slots) {
  constexpr int E = 16 / sizeof(T);
  constexpr int LANES_PER_KEY = D / E;
  static_assert(D % E == 0 && (LANES_PER_KEY == 4 || LANES_PER_KEY == 8 || LANES_PER_KEY == 16 || LANES_PER_KEY == 32),
                "D * sizeof(T) must be 64, 128, 256 or 512 bytes");
  constexpr int SLOTS = 32 / LANES_PER_KEY;  // keys a load instruction of the warp covers
  constexpr int KEYS_PER_PASS = SLOTS * SPLIT_LOADS;
  __shared__ float m_s[HG][SPLIT_WARPS];
  __shared__ float l_s[HG][SPLIT_WARPS];
  __shared__ float acc_s[HG][SPLIT_WARPS][D];

  // A block: HG query heads of one KV head (each read once for all of them), one row.
  const int h0 = (blockIdx.x / rows) * HG;
  const int r = blockIdx.x % rows;
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int slot = lane / LANES_PER_KEY;
  const int d0 = (lane % LANES_PER_KEY) * E;  // this lane's dims: d0 .. d0 + E - 1
  const int kvh = h0 / (heads / kv_heads);
  const int len = row_len[r];
  const long base = row_base[r];
  const float scale = scale_in[0];

  // The heads' queries as float: in registers for one head, else in shared memory, each
  // head's read in its turn (registers run short)
  __shared__ float q_s[HG > 1 ? HG : 1][HG > 1 ? D : 1];
  float qv[E];
  if constexpr (HG == 1) {
    const uint4 raw = *reinterpret_cast<const uint4*>(q + ((long)h0 * rows + r) * D + d0);
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < E; ++i) qv[i] = split_float(e[i]);
  } else {
    for (int gd = threadIdx.x; gd < HG * D; gd += blockDim.x)
      q_s[gd / D][gd % D] = split_float(q[((long)(h0 + gd / D) * rows + r) * D + gd % D]);
    __syncthreads();
  }
  const T* kh = k + ((long)kvh * slots + base) * D + d0;
  const T* vh = v + ((long)kvh * slots + base) * D + d0;
  float m[HG], l[HG];
  float acc[HG][E];
#pragma unroll
  for (int g = 0; g < HG; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.f;
#pragma unroll
    for (int i = 0; i < E; ++i) acc[g][i] = 0.f;
  }

  const int passes = (len + KEYS_PER_PASS - 1) / KEYS_PER_PASS;
  for (int p = warp; p < passes; p += SPLIT_WARPS) {
    const int j0 = p * KEYS_PER_PASS + slot;  // this lane's key of load 0
    uint4 kr[SPLIT_LOADS], vr[SPLIT_LOADS];
#pragma unroll
    for (int i = 0; i < SPLIT_LOADS; ++i) {
      const int j = j0 + i * SLOTS;
      if (j < len) {
        kr[i] = __ldg(reinterpret_cast<const uint4*>(kh + (long)j * D));
        vr[i] = __ldg(reinterpret_cast<const uint4*>(vh + (long)j * D));
      } else {
        kr[i] = make_uint4(0, 0, 0, 0);
        vr[i] = make_uint4(0, 0, 0, 0);
      }
    }
    // each head in turn, in the same order as a block of one head
#pragma unroll
    for (int g = 0; g < HG; ++g) {
      if constexpr (HG > 1) {
#pragma unroll
        for (int c = 0; c < E; ++c) qv[c] = q_s[g][d0 + c];
      }
      float s[SPLIT_LOADS];
#pragma unroll
      for (int i = 0; i < SPLIT_LOADS; ++i) {
        const T* e = reinterpret_cast<const T*>(&kr[i]);
        float dot = 0.f;
#pragma unroll
        for (int c = 0; c < E; ++c) dot = fmaf(qv[c], split_float(e[c]), dot);
        s[i] = dot;
      }
#pragma unroll
      for (int off = LANES_PER_KEY / 2; off > 0; off >>= 1)
#pragma unroll
        for (int i = 0; i < SPLIT_LOADS; ++i) s[i] += __shfl_xor_sync(SPLIT_MASK, s[i], off);
      float pass_max = -INFINITY;
#pragma unroll
      for (int i = 0; i < SPLIT_LOADS; ++i) {
        s[i] = j0 + i * SLOTS < len ? s[i] * scale : -INFINITY;
        pass_max = fmaxf(pass_max, s[i]);
      }
#pragma unroll
      for (int off = 16; off >= LANES_PER_KEY; off >>= 1)
        pass_max = fmaxf(pass_max, __shfl_xor_sync(SPLIT_MASK, pass_max, off));
      const float m_new = fmaxf(m[g], pass_max);  // finite: the pass's first key is valid
      const float corr = expf(m[g] - m_new);      // 0 on the first pass (m = -inf)
      float sum = 0.f;
#pragma unroll
      for (int i = 0; i < SPLIT_LOADS; ++i) {
        s[i] = j0 + i * SLOTS < len ? expf(s[i] - m_new) : 0.f;  // s now holds p
        sum += s[i];
      }
#pragma unroll
      for (int off = 16; off >= LANES_PER_KEY; off >>= 1) sum += __shfl_xor_sync(SPLIT_MASK, sum, off);
      l[g] = l[g] * corr + sum;
#pragma unroll
      for (int c = 0; c < E; ++c) acc[g][c] *= corr;
#pragma unroll
      for (int i = 0; i < SPLIT_LOADS; ++i) {
        const T* e = reinterpret_cast<const T*>(&vr[i]);
#pragma unroll
        for (int c = 0; c < E; ++c) acc[g][c] = fmaf(s[i], split_float(e[c]), acc[g][c]);
      }
      m[g] = m_new;
    }
  }
#pragma unroll
  for (int g = 0; g < HG; ++g) {
#pragma unroll
    for (int off = 16; off >= LANES_PER_KEY; off >>= 1)
#pragma unroll
      for (int c = 0; c < E; ++c) acc[g][c] += __shfl_xor_sync(SPLIT_MASK, acc[g][c], off);
    if (lane == 0) {
      m_s[g][warp] = m[g];
      l_s[g][warp] = l[g];
    }
    if (slot == 0) {
#pragma unroll
      for (int c = 0; c < E; ++c) acc_s[g][warp][d0 + c] = acc[g][c];
    }
  }
  __syncthreads();

  for (int gd = threadIdx.x; gd < HG * D; gd += blockDim.x) {
    const int g = gd / D, d = gd % D;
    float m_all = -INFINITY;
#pragma unroll
    for (int w = 0; w < SPLIT_WARPS; ++w) m_all = fmaxf(m_all, m_s[g][w]);
    float a = 0.f, total = 0.f;
#pragma unroll
    for (int w = 0; w < SPLIT_WARPS; ++w) {
      if (l_s[g][w] > 0.f) {  // a warp with no pass holds nothing
        const float f = expf(m_s[g][w] - m_all);
        a = fmaf(acc_s[g][w][d], f, a);
        total = fmaf(l_s[g][w], f, total);
      }
    }
    out[((long)(h0 + g) * rows + r) * D + d] = split_store<T>(a / total);
  }
}

}  // namespace lockstep
