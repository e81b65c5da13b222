// Decode / verification attention over a shared KV pool, for MLX's CUDA backend
// (mx.fast.cuda_kernel): every query row of every request in a pass, in one launch.
//
//   out[h, r, :] = softmax(scale * q[h, r, :] . K[kvh, base_r + j, :], j < len_r) @ V[kvh, base_r + j, :]
//
//   q: (HQ, R, D) query rows;  k, v: (HKV, S, D) the pool (S token slots);  kvh = h / (HQ / HKV)
//   row_base[r]: the pool slot of key 0 of row r's request;  row_len[r]: keys row r sees
//
// One block of ATT_WARPS warps computes one (head, row). Its order of arithmetic depends on
// len_r alone (the NumPy model kernels/custom/attention_order.py is the specification):
//   - keys are cut into tiles of 32, tile t = keys 32t .. 32t + 31; warp w runs the tiles
//     t = w, w + ATT_WARPS, ... in increasing t; within a tile, lane i owns key 32t + i;
//   - a key's score is one lane's fmaf chain over d = 0 .. D - 1 in increasing d, times scale;
//   - per tile: max over lanes (exact in any order), p = expf(s - m_new), the tile's sum of p
//     by an xor butterfly (16, 8, 4, 2, 1) taken from lane 0, l = l * corr + sum;
//     acc[d] = acc[d] * corr, then fmaf(p_i, V[key i][d], acc[d]) for i = 0 .. 31 in order;
//   - the warps' (m, l, acc) are combined in warp order 0 .. ATT_WARPS - 1.
// Nothing depends on R, on the other rows, or on where the request's keys sit in the pool,
// so a row gets the same bits alone and beside any other rows.
//
// Template arguments (set by kernels/custom/attention.py): T (element type), D (head dim, a
// multiple of 32, at most 256).

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace lockstep {

constexpr int ATT_WARPS = 8;
constexpr int V_AHEAD = 8;  // V rows in flight per lane (registers: V_AHEAD * D / 32)
constexpr unsigned FULL_MASK = 0xffffffffu;

__device__ __forceinline__ float att_float(float v) { return v; }
__device__ __forceinline__ float att_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float att_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T att_store(float v);
template <> __device__ __forceinline__ float att_store<float>(float v) { return v; }
template <> __device__ __forceinline__ __half att_store<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 att_store<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// q_s . key (D elements from `key`, 16-byte aligned), one fmaf chain in increasing d.
template <typename T, int D>
__device__ __forceinline__ float key_dot(const float* q_s, const T* key) {
  constexpr int PER = 16 / sizeof(T);
  float dot = 0.f;
#pragma unroll 8  // loads issued ahead of the chain; the chain's order is unchanged
  for (int d0 = 0; d0 < D; d0 += PER) {
    const uint4 raw = __ldg(reinterpret_cast<const uint4*>(key + d0));
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < PER; ++i) dot = fmaf(q_s[d0 + i], att_float(e[i]), dot);
  }
  return dot;
}

template <typename T, int D>
__device__ void pooled_attention(const T* q, const T* k, const T* v, const int* row_base,
                                 const int* row_len, const float* scale_in, T* out,
                                 int heads, int rows, int kv_heads, int slots) {
  static_assert(D % 32 == 0 && D <= 256, "head dim must be a multiple of 32, at most 256");
  constexpr int PER_LANE = D / 32;
  __shared__ float q_s[D];
  __shared__ float m_s[ATT_WARPS];
  __shared__ float l_s[ATT_WARPS];
  __shared__ float acc_s[ATT_WARPS][D];

  const int h = blockIdx.x / rows;
  const int r = blockIdx.x % rows;
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  const int kvh = h / (heads / kv_heads);
  const int len = row_len[r];
  const long base = row_base[r];
  const float scale = scale_in[0];

  for (int d = threadIdx.x; d < D; d += blockDim.x) q_s[d] = att_float(q[((long)h * rows + r) * D + d]);
  __syncthreads();

  const T* kh = k + (long)kvh * slots * D;
  const T* vh = v + (long)kvh * slots * D;
  float m = -INFINITY, l = 0.f;
  float acc[PER_LANE];
#pragma unroll
  for (int i = 0; i < PER_LANE; ++i) acc[i] = 0.f;

  const int tiles = (len + 31) / 32;
  for (int t = warp; t < tiles; t += ATT_WARPS) {
    const int j = t * 32 + lane;
    const bool valid = j < len;
    const float s = valid ? key_dot<T, D>(q_s, kh + (base + j) * D) * scale : -INFINITY;
    float tile_max = s;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) tile_max = fmaxf(tile_max, __shfl_xor_sync(FULL_MASK, tile_max, off));
    const float m_new = fmaxf(m, tile_max);  // finite: every tile holds a valid key
    const float p = valid ? expf(s - m_new) : 0.f;
    const float corr = expf(m - m_new);      // 0 on the first tile (m = -inf)
    float sum = p;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(FULL_MASK, sum, off);
    sum = __shfl_sync(FULL_MASK, sum, 0);    // one lane's order for every lane
    l = l * corr + sum;
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) acc[i] *= corr;
    const int in_tile = min(32, len - t * 32);
    const T* vtile = vh + (base + t * 32) * D + lane;
    if (in_tile == 32) {
      // A full tile: V rows loaded V_AHEAD keys at a time before their fmafs (a key per
      // iteration waited on each load); same fmafs in the same order as below.
#pragma unroll
      for (int i0 = 0; i0 < 32; i0 += V_AHEAD) {
        float vv[V_AHEAD][PER_LANE];
#pragma unroll
        for (int i = 0; i < V_AHEAD; ++i)
#pragma unroll
          for (int c = 0; c < PER_LANE; ++c) vv[i][c] = att_float(vtile[(i0 + i) * D + 32 * c]);
#pragma unroll
        for (int i = 0; i < V_AHEAD; ++i) {
          const float p_i = __shfl_sync(FULL_MASK, p, i0 + i);
#pragma unroll
          for (int c = 0; c < PER_LANE; ++c) acc[c] = fmaf(p_i, vv[i][c], acc[c]);
        }
      }
    } else {
      for (int i = 0; i < in_tile; ++i) {
        const float p_i = __shfl_sync(FULL_MASK, p, i);
#pragma unroll
        for (int c = 0; c < PER_LANE; ++c) acc[c] = fmaf(p_i, att_float(vtile[i * D + 32 * c]), acc[c]);
      }
    }
    m = m_new;
  }

  if (lane == 0) {
    m_s[warp] = m;
    l_s[warp] = l;
  }
#pragma unroll
  for (int c = 0; c < PER_LANE; ++c) acc_s[warp][lane + 32 * c] = acc[c];
  __syncthreads();

  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float m_all = -INFINITY;
#pragma unroll
    for (int w = 0; w < ATT_WARPS; ++w) m_all = fmaxf(m_all, m_s[w]);
    float a = 0.f, total = 0.f;
#pragma unroll
    for (int w = 0; w < ATT_WARPS; ++w) {
      if (l_s[w] > 0.f) {  // a warp with no tile holds nothing
        const float f = expf(m_s[w] - m_all);
        a = fmaf(acc_s[w][d], f, a);
        total = fmaf(l_s[w], f, total);
      }
    }
    out[((long)h * rows + r) * D + d] = att_store<T>(a / total);
  }
}

}  // namespace lockstep
