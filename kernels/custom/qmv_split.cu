// A few rows of x times a 4-bit quantized weight, K split across a block, for MLX's CUDA
// backend: lockstep's own order (not MLX's), made to read the weights at HBM speed.
//
//   y[m, n] = sum_k x[m, k] * W[n, k]    x: (M, K) of T (float16, bfloat16); W: (N, K) 4-bit
//                                        codes packed in uint32 words, lowest bits first
//
// MLX's quantized GEMV gives each output a warp that walks K eight bytes a lane at a time;
// a decode step's 4-bit linears read their weights at ~20 % of the H200's bandwidth that way.
// Here a block of 128 threads takes C outputs at a time: K is cut into chunks of 32 codes (16
// bytes, one load), thread t takes chunks t, t + 128, t + 256, ...; a thread loads its next
// chunk of each output (or of the block's next C outputs) before it computes the current one.
//
// The order, for every output alike (index model: kernels/custom/qmv_split_order.py):
// - a weight is code * scale in T (affine: code * scale, then + bias, each rounded to T);
// - a chunk's 16 pairs of products go into two T pairs with fma (pairs 0-7 into A, 8-15
//   into B: eight terms each, one rounding to T per fma);
// - the thread's float32 sum s takes A.x, A.y, B.x, B.y in that order, chunk after chunk;
// - the xor butterfly over a warp's lanes (offsets 16, 8, 4, 2, 1), then the four warps'
//   sums added in warp order, rounded to T.
// Nothing depends on M, N, C or MR: a row's bits are a function of its own x row, the
// weight and K, so a row alone and a row among others are equal (the startup self-test
// proves it on the running GPU).
//
// Template arguments (set by kernels/custom/qmv_split.py): T; FMT: 0 affine (4-bit codes, a
// T scale and bias per GROUP of 32, 64 or 128), 1 nvfp4 (e2m1 codes, an e4m3 scale per 16),
// 2 mxfp4 (e2m1, a ue8m0 scale per 32); GROUP; C outputs a block at a time; MR rows a block.

namespace lockstep_qsplit {

using namespace lockstep_quant;

// A byte's two codes (low nibble first) as a T pair. Affine codes are placed by their bits
// (quant_values.cuh's codes_as_pair: a few integer operations and one add, where e2m1's
// placement needs a multiply too and was slower than the table). e2m1 codes go through a
// table in shared memory: the values are exact in T either way, so neither changes a bit.
constexpr bool by_bits(int fmt) { return fmt == 0; }

// The table: each of the 256 entries is stored
// once per lane (entry e of lane l at e * 32 + l): a lane reads only its own bank, where one
// shared copy had the warp's random bytes collide on banks. A thread makes an entry and
// writes its 32 copies 16 bytes at a time.
template <typename T, int FMT>
__device__ __forceinline__ void fill_table(typename Pair<T>::type* table) {
  for (int e = threadIdx.x; e < 256; e += blockDim.x) {
    const auto v = make_pair(from_float<T>(code_value<FMT>(e & 15)), from_float<T>(code_value<FMT>(e >> 4)));
    const uint32_t bits = *reinterpret_cast<const uint32_t*>(&v);
    uint4* dst = reinterpret_cast<uint4*>(table + e * 32);
#pragma unroll
    for (int q = 0; q < 8; ++q) dst[q] = make_uint4(bits, bits, bits, bits);
  }
  __syncthreads();
}

// The pair of byte j of `word`, from this lane's copy: lane_base is the 32-bit shared address
// of the lane's word of entry 0 (entries are 128 bytes apart), so a pair's address is a byte
// permute and one shifted add, where a generic pointer cost two instructions more. Volatile:
// the load must stay after the fill's barrier.
template <typename T2>
__device__ __forceinline__ T2 table_pair(uint32_t lane_base, uint32_t word, int j) {
  uint32_t bits;
  asm volatile("ld.shared.b32 %0, [%1];" : "=r"(bits) : "r"(lane_base + (__byte_perm(word, 0, 0x4440 | j) << 7)));
  return *reinterpret_cast<const T2*>(&bits);
}

// One thread's chunk of each of C outputs: its codes, scales and biases.
template <typename T, int C, int SCALES>
struct Chunk {
  uint4 codes[C];
  T scale[C][SCALES];
  T bias[C];
};

template <typename T, int FMT, int GROUP, int C, int MR>
__device__ void qmv_split(const T* x, const uint32_t* w, const T* scales_t, const uint8_t* scales_u8,
                          const T* biases, T* y, int M, int N, int K) {
  using T2 = typename Pair<T>::type;
  constexpr int THREADS = 128;
  constexpr int WARPS = THREADS / 32;
  constexpr int SCALES = GROUP == 16 ? 2 : 1;  // groups a 32-code chunk spans
  constexpr bool BY_BITS = by_bits(FMT);
  __shared__ __align__(16) T2 table[BY_BITS ? 1 : 256 * 32];
  __shared__ float partial[WARPS][MR][C];
  if constexpr (!BY_BITS) fill_table<T, FMT>(table);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const uint32_t lane_base = (uint32_t)__cvta_generic_to_shared(table) + 4 * lane;
  const int m0 = blockIdx.y * MR;
  const int chunks = K >> 5;
  const int rounds = (chunks + THREADS - 1) / THREADS;  // chunk rounds of one output
  const int groups = K / GROUP;
  const int stride = gridDim.x * C;
  const T* xrow[MR];
#pragma unroll
  for (int m = 0; m < MR; ++m) xrow[m] = x + (size_t)min(m0 + m, M - 1) * K;  // past M: never stored

  // Steps (n0, r): the block's column groups n0 = blockIdx.x * C, + stride, ..., each in
  // rounds r of chunks; the next step's weights are loaded before this one's are used.
  auto load = [&](int n0, int r) {
    Chunk<T, C, SCALES> v;
    const int idx = r * THREADS + tid;
    if (n0 < N && idx < chunks) {
#pragma unroll
      for (int c = 0; c < C; ++c) {
        const int col = min(n0 + c, N - 1);  // past N: never stored
        v.codes[c] = __ldg(reinterpret_cast<const uint4*>(w + (size_t)col * (K >> 3)) + idx);
        const int g = col * groups + idx * 32 / GROUP;
        scale_values<T, FMT, SCALES>(v.scale[c], scales_t, scales_u8, g);
        if constexpr (FMT == 0) v.bias[c] = biases[g];
      }
    }
    return v;
  };

  float acc[MR][C];
#pragma unroll
  for (int m = 0; m < MR; ++m)
#pragma unroll
    for (int c = 0; c < C; ++c) acc[m][c] = 0.0f;

  int n0 = blockIdx.x * C, r = 0;
  Chunk<T, C, SCALES> now = load(n0, r);
  T2 xv[MR][16];  // x's chunk of this step, kept in registers across steps of one round
  bool x_ready = false;
#pragma unroll 1
  while (n0 < N) {
    const bool last = r + 1 == rounds;
    const int n1 = last ? n0 + stride : n0, r1 = last ? 0 : r + 1;
    const Chunk<T, C, SCALES> next = load(n1, r1);
    const int idx = r * THREADS + tid;
    if (idx < chunks) {
      if (rounds > 1 || !x_ready) {  // one round (K <= 4096): the same chunk of x every step
        x_ready = true;
#pragma unroll
        for (int m = 0; m < MR; ++m) {
          const uint4* src = reinterpret_cast<const uint4*>(xrow[m] + idx * 32);
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            const uint4 raw = src[q];
            xv[m][4 * q + 0] = *reinterpret_cast<const T2*>(&raw.x);
            xv[m][4 * q + 1] = *reinterpret_cast<const T2*>(&raw.y);
            xv[m][4 * q + 2] = *reinterpret_cast<const T2*>(&raw.z);
            xv[m][4 * q + 3] = *reinterpret_cast<const T2*>(&raw.w);
          }
        }
      }
#pragma unroll
      for (int c = 0; c < C; ++c) {
        const uint32_t words[4] = {now.codes[c].x, now.codes[c].y, now.codes[c].z, now.codes[c].w};
        T2 wd[16];
#pragma unroll
        for (int j = 0; j < 16; ++j) {
          const T s = now.scale[c][SCALES == 2 ? j / 8 : 0];
          T2 code;
          if constexpr (BY_BITS) code = codes_as_pair<T, FMT>(words[j >> 2] >> (8 * (j & 3)));
          else code = table_pair<T2>(lane_base, words[j >> 2], j & 3);
          if constexpr (FMT == 0) wd[j] = __hadd2_rn(__hmul2_rn(code, make_pair(s, s)), make_pair(now.bias[c], now.bias[c]));
          else wd[j] = __hmul2_rn(code, make_pair(s, s));
        }
#pragma unroll
        for (int m = 0; m < MR; ++m) {
          T2 a = make_pair(from_float<T>(0.0f), from_float<T>(0.0f)), b = a;
#pragma unroll
          for (int j = 0; j < 8; ++j) a = __hfma2(xv[m][j], wd[j], a);
#pragma unroll
          for (int j = 8; j < 16; ++j) b = __hfma2(xv[m][j], wd[j], b);
          const float2 fa = to_float2(a), fb = to_float2(b);
          float s = acc[m][c];
          s = __fadd_rn(s, fa.x);
          s = __fadd_rn(s, fa.y);
          s = __fadd_rn(s, fb.x);
          s = __fadd_rn(s, fb.y);
          acc[m][c] = s;
        }
      }
    }
    if (last) {  // the group's sums: each warp's butterfly, then the warps in order
#pragma unroll
      for (int m = 0; m < MR; ++m)
#pragma unroll
        for (int c = 0; c < C; ++c) {
          float s = acc[m][c];
#pragma unroll
          for (int offset = 16; offset > 0; offset >>= 1) s = __fadd_rn(s, __shfl_xor_sync(0xffffffffu, s, offset));
          if (lane == 0) partial[warp][m][c] = s;
          acc[m][c] = 0.0f;
        }
      __syncthreads();
      if (tid < MR * C) {
        const int m = tid / C, c = tid % C;
        float s = partial[0][m][c];
#pragma unroll
        for (int v = 1; v < WARPS; ++v) s = __fadd_rn(s, partial[v][m][c]);
        if (m0 + m < M && n0 + c < N) y[(size_t)(m0 + m) * N + n0 + c] = from_float<T>(s);
      }
      __syncthreads();  // partial is read before the next group writes it
    }
    now = next;
    n0 = n1;
    r = r1;
  }
}

}  // namespace lockstep_qsplit
