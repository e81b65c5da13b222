// Dense rows in the order of MLX's own single-row GEMV, for MLX's CUDA backend
// (mx.fast.cuda_kernel).
//
//   y[m, n] = sum_k x[m, k] * W[n, k]    x: (M, K), W: (N, K) as nn.Linear stores it, one
//                                        type T (float32, float16, bfloat16)
//
// A plain decode step (M = 1) runs MLX's GEMV (mlx/backend/cuda/gemms/gemv.cu): one warp per
// output column; lane l takes NPT consecutive elements at k = NPT * l + 32 * NPT * i for
// i = 0, 1, .. in turn, doing acc = fma(float(w), float(x), acc) from 0; the 32 lanes are
// then summed by a butterfly (offsets 16, 8, 4, 2, 1; lane 0 keeps the result). NPT is 4
// where K % 128 == 0, 2 where K % 64 == 0, else 1 (for aligned pointers, as MLX's arrays are).
// This kernel computes every row of a block of M rows in exactly that order, so each row has
// the bits of the single-row call, while a warp's weight loads serve all of its rows: W is
// read once per row group (MR rows), not once per row. The index model is
// kernels/custom/gemv_order.py; the startup self-test proves the bits on the running GPU.
//
// Template arguments (set by kernels/custom/gemv_rows.py): T, NPT, R (output columns per
// warp), MR (rows per warp; grid.y runs the row groups). R and MR choose which warp computes
// an output, never the order of its sum.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace lockstep_gemv {

template <typename T> __device__ __forceinline__ float to_float(T v) { return static_cast<float>(v); }
template <> __device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T from_float(float v) { return static_cast<T>(v); }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// NPT consecutive values in one aligned load (as MLX's unsafe_load_vector).
template <typename T, int NPT>
struct alignas(sizeof(T) * NPT) Vec { T v[NPT]; };

template <typename T, int NPT>
__device__ __forceinline__ void load(const T* p, float (&out)[NPT]) {
  const Vec<T, NPT> raw = *reinterpret_cast<const Vec<T, NPT>*>(p);
#pragma unroll
  for (int j = 0; j < NPT; ++j) out[j] = to_float(raw.v[j]);
}

template <typename T, int NPT, int R, int MR>
__device__ void gemv_rows(const T* x, const T* w, T* y, int M, int N, int K) {
  const int lane = threadIdx.x & 31;
  const int warp = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const int n0 = warp * R;
  const int m0 = blockIdx.y * MR;
  if (n0 >= N) return;

  const T* wrow[R];
#pragma unroll
  for (int r = 0; r < R; ++r) wrow[r] = w + (size_t)min(n0 + r, N - 1) * K;  // past N: never stored
  const T* xrow[MR];
#pragma unroll
  for (int m = 0; m < MR; ++m) xrow[m] = x + (size_t)min(m0 + m, M - 1) * K;  // past M: never stored

  float acc[MR][R];
#pragma unroll
  for (int m = 0; m < MR; ++m)
#pragma unroll
    for (int r = 0; r < R; ++r) acc[m][r] = 0.0f;

#pragma unroll 2
  for (int k = NPT * lane; k < K; k += 32 * NPT) {
    float wv[R][NPT], xv[MR][NPT];
#pragma unroll
    for (int r = 0; r < R; ++r) load<T, NPT>(wrow[r] + k, wv[r]);
#pragma unroll
    for (int m = 0; m < MR; ++m) load<T, NPT>(xrow[m] + k, xv[m]);
#pragma unroll
    for (int m = 0; m < MR; ++m)
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int j = 0; j < NPT; ++j) acc[m][r] = __fmaf_rn(wv[r][j], xv[m][j], acc[m][r]);
  }

#pragma unroll
  for (int m = 0; m < MR; ++m)
#pragma unroll
    for (int r = 0; r < R; ++r) {
      float s = acc[m][r];
#pragma unroll
      for (int offset = 16; offset > 0; offset >>= 1) s += __shfl_xor_sync(0xffffffffu, s, offset);
      if (lane == 0 && m0 + m < M && n0 + r < N) y[(size_t)(m0 + m) * N + n0 + r] = from_float<T>(s);
    }
}

}  // namespace lockstep_gemv
