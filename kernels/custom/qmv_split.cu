// A few rows of x times a 4-bit quantized weight, K split across a block, for MLX's CUDA
// backend: lockstep's own order (not MLX's), made to read the weights at HBM speed.
//
//   y[m, n] = sum_k x[m, k] * W[n, k]    x: (M, K) of T (float16, bfloat16); W: (N, K) 4-bit
//                                        codes packed in uint32 words, lowest bits first
//
// MLX's quantized GEMV gives each output a warp that walks K eight bytes a lane at a time;
// a decode step's 4-bit linears read their weights at ~20 % of the H200's bandwidth that way.
// Here a block of 128 threads takes C outputs at a time: K is cut into chunks of 32 codes (16
// bytes, one load), thread t takes chunks t, t + 128, t + 256, ..., and loads U of them for
// each of its C outputs before it computes any (bytes in flight).
//
// The order, for every output alike (index model: kernels/custom/qmv_split_order.py):
// - a weight is code * scale in T (affine: code * scale, then + bias, each rounded to T);
// - a chunk's 16 pairs of products go into two T pairs with fma (pairs 0-7 into A, 8-15
//   into B: eight terms each, one rounding to T per fma);
// - the thread's float32 sum s takes A.x, A.y, B.x, B.y in that order, chunk after chunk;
// - the xor butterfly over a warp's lanes (offsets 16, 8, 4, 2, 1), then the four warps'
//   sums added in warp order, rounded to T.
// Nothing depends on M, N, C, U or MR: a row's bits are a function of its own x row, the
// weight and K, so a row alone and a row among others are equal (the startup self-test
// proves it on the running GPU).
//
// Template arguments (set by kernels/custom/qmv_split.py): T; FMT: 0 affine (4-bit codes, a
// T scale and bias per GROUP of 32, 64 or 128), 1 nvfp4 (e2m1 codes, an e4m3 scale per 16),
// 2 mxfp4 (e2m1, a ue8m0 scale per 32); GROUP; C outputs a block; MR rows a block; U chunks
// loaded ahead per output.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace lockstep_qsplit {

template <typename T> struct Pair;
template <> struct Pair<__half> { using type = __half2; };
template <> struct Pair<__nv_bfloat16> { using type = __nv_bfloat162; };

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

__device__ __forceinline__ __half2 make_pair(__half a, __half b) { return __halves2half2(a, b); }
__device__ __forceinline__ __nv_bfloat162 make_pair(__nv_bfloat16 a, __nv_bfloat16 b) { return __halves2bfloat162(a, b); }
__device__ __forceinline__ float2 to_float2(__half2 v) { return __half22float2(v); }
__device__ __forceinline__ float2 to_float2(__nv_bfloat162 v) { return __bfloat1622float2(v); }

// 2^(e - 127); e = 0 is a float32 subnormal.
__device__ __forceinline__ float ue8m0_to_float(uint32_t e) {
  return e == 0 ? 0x1p-127f : __uint_as_float(e << 23);
}

template <int FMT>
__device__ __forceinline__ float code_value(uint32_t q) {
  if constexpr (FMT == 0) return (float)q;
  else return lockstep_fp::e2m1_to_float(q);
}

// A byte's two codes (low nibble first) as a T pair, through a table in shared memory: the
// values are exact in T, so the table changes no bits. Each of the 256 entries is stored
// once per lane (entry e of lane l at e * 32 + l): a lane reads only its own bank, where one
// shared copy had the warp's random bytes collide on banks.
template <typename T, int FMT>
__device__ __forceinline__ void fill_table(typename Pair<T>::type* table) {
  for (int i = threadIdx.x; i < 256 * 32; i += blockDim.x) {
    const int e = i >> 5;
    table[i] = make_pair(from_float<T>(code_value<FMT>(e & 15)), from_float<T>(code_value<FMT>(e >> 4)));
  }
  __syncthreads();
}

template <typename T, int FMT>
__device__ __forceinline__ T scale_value(const T* scales_t, const uint8_t* scales_u8, int g) {
  if constexpr (FMT == 0) return scales_t[g];
  else if constexpr (FMT == 1) return from_float<T>(lockstep_fp::e4m3_to_float(scales_u8[g]));
  else return from_float<T>(ue8m0_to_float(scales_u8[g]));
}

template <typename T, int FMT, int GROUP, int C, int MR, int U>
__device__ void qmv_split(const T* x, const uint32_t* w, const T* scales_t, const uint8_t* scales_u8,
                          const T* biases, T* y, int M, int N, int K) {
  using T2 = typename Pair<T>::type;
  constexpr int THREADS = 128;
  constexpr int WARPS = THREADS / 32;
  constexpr int SCALES = GROUP == 16 ? 2 : 1;  // groups a 32-code chunk spans
  __shared__ T2 table[256 * 32];
  __shared__ float partial[WARPS][MR][C];
  fill_table<T, FMT>(table);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int m0 = blockIdx.y * MR;
  const int chunks = K >> 5;
  const int groups = K / GROUP;
  // Blocks walk the column groups (the table is filled once per block, not once per group).
#pragma unroll 1
  for (int n0 = blockIdx.x * C; n0 < N; n0 += gridDim.x * C) {
    const uint4* wrow[C];
    int col[C];
#pragma unroll
    for (int c = 0; c < C; ++c) {
      col[c] = min(n0 + c, N - 1);  // past N: never stored
      wrow[c] = reinterpret_cast<const uint4*>(w + (size_t)col[c] * (K >> 3));
    }
    const T* xrow[MR];
#pragma unroll
    for (int m = 0; m < MR; ++m) xrow[m] = x + (size_t)min(m0 + m, M - 1) * K;  // past M: never stored

    float acc[MR][C];
#pragma unroll
    for (int m = 0; m < MR; ++m)
#pragma unroll
      for (int c = 0; c < C; ++c) acc[m][c] = 0.0f;

  #pragma unroll 1
    for (int base = tid; base < chunks; base += THREADS * U) {
      uint4 wv[U][C];
      T sv[U][C][SCALES];
      T bv[U][C];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int idx = base + u * THREADS;
        if (idx < chunks) {
#pragma unroll
          for (int c = 0; c < C; ++c) {
            wv[u][c] = __ldg(wrow[c] + idx);
            const int g = col[c] * groups + idx * 32 / GROUP;
#pragma unroll
            for (int h = 0; h < SCALES; ++h) sv[u][c][h] = scale_value<T, FMT>(scales_t, scales_u8, g + h);
            if constexpr (FMT == 0) bv[u][c] = biases[g];
          }
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int idx = base + u * THREADS;
        if (idx < chunks) {
          T2 xv[MR][16];
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
#pragma unroll
          for (int c = 0; c < C; ++c) {
            const uint32_t words[4] = {wv[u][c].x, wv[u][c].y, wv[u][c].z, wv[u][c].w};
            T2 wd[16];
#pragma unroll
            for (int j = 0; j < 16; ++j) {
              const T s = sv[u][c][SCALES == 2 ? j / 8 : 0];
              const T2 code = table[(((words[j >> 2] >> (8 * (j & 3))) & 0xFFu) << 5) | lane];
              if constexpr (FMT == 0) wd[j] = __hadd2_rn(__hmul2_rn(code, make_pair(s, s)), make_pair(bv[u][c], bv[u][c]));
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
      }
    }

#pragma unroll
    for (int m = 0; m < MR; ++m)
#pragma unroll
      for (int c = 0; c < C; ++c) {
        float s = acc[m][c];
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) s = __fadd_rn(s, __shfl_xor_sync(0xffffffffu, s, offset));
        if (lane == 0) partial[warp][m][c] = s;
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
}

}  // namespace lockstep_qsplit
