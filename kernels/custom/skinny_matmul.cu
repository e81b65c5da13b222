// Batch-invariant skinny matmul for MLX's CUDA backend (mx.fast.cuda_kernel).
//
//   y[m, n] = sum_k x[m, k] * W[n, k]      x: (M, K), W: (N, K) as nn.Linear stores it, M <= 64
//
// Every output element is reduced in one order that depends on K alone (the NumPy model
// kernels/custom/loop_order.py is the specification):
//   - one warp computes NC whole output columns for all M rows; K is never split across warps;
//   - K is cut into units of 16 bytes of weight (8 bf16/fp16, 4 fp32, 32 four-bit codes);
//     unit u is run by lane u % 32, in increasing u, elements in increasing k; the partial
//     last unit (K tail) is unit K / V under the same rule;
//   - acc = fmaf(x, w, acc) in float32 per lane, then an xor butterfly (16, 8, 4, 2, 1);
//   - quantized weights are dequantized per element (affine: fmaf(scale, q, bias);
//     nvfp4: e2m1(q) * e4m3(scale), exact).
// M and NC only choose how many accumulators a lane holds, never the order of any of them,
// so row m gets the same bits at M = 1 and beside 63 other rows. Each weight unit is loaded
// once per warp and used for all M rows.
//
// Template arguments (set by kernels/custom/skinny.py): T (x / output type), M, NC, K, and
// for the quantized kernel GROUP and NVFP4 (0: affine 4-bit, 1: nvfp4); N (output columns)
// is read from the weight's shape at run time.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace lockstep {

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// COUNT consecutive values of `row` from element k, as floats. ALIGNED: row + k is 16-byte
// aligned and COUNT values are whole 16-byte vectors, so vector loads are used.
template <typename T, int COUNT, bool ALIGNED>
__device__ __forceinline__ void load_run(const T* row, int k, float* out) {
  if constexpr (ALIGNED) {
    constexpr int PER = 16 / sizeof(T);
#pragma unroll
    for (int v = 0; v < COUNT / PER; ++v) {
      const uint4 raw = __ldg(reinterpret_cast<const uint4*>(row + k) + v);
      const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int i = 0; i < PER; ++i) out[v * PER + i] = to_float(e[i]);
    }
  } else {
#pragma unroll
    for (int i = 0; i < COUNT; ++i) out[i] = to_float(row[k + i]);
  }
}

// One warp's columns n0 .. n0 + NC - 1 with their acc[c][m] lane partials reduced and stored.
template <typename T, int M, int NC>
__device__ __forceinline__ void reduce_and_store(float (&acc)[NC][M], int n0, int lane, T* y, int N) {
#pragma unroll
  for (int c = 0; c < NC; ++c) {
#pragma unroll
    for (int m = 0; m < M; ++m) {
      float v = acc[c][m];
#pragma unroll
      for (int s = 16; s >= 1; s >>= 1) v += __shfl_xor_sync(0xffffffffu, v, s);
      acc[c][m] = v;  // every lane holds the same bits (a + b == b + a)
    }
  }
#pragma unroll
  for (int c = 0; c < NC; ++c) {
    const int n = n0 + c;
#pragma unroll
    for (int m = 0; m < M; ++m) {
      if (n < N && ((c * M + m) & 31) == lane) y[m * N + n] = from_float<T>(acc[c][m]);
    }
  }
}

template <typename T, int M, int NC, int K>
__device__ void skinny_dense(const T* x, const T* w, T* y, int N) {
  constexpr int V = 16 / sizeof(T);  // elements per unit
  constexpr int UNITS = K / V;       // full units
  constexpr int TAIL = K % V;        // elements of the partial last unit
  constexpr bool ALIGNED = TAIL == 0;
  const int lane = threadIdx.x & 31;
  const int n0 = ((blockIdx.x * blockDim.x + threadIdx.x) >> 5) * NC;
  if (n0 >= N) return;  // the whole warp leaves together

  float acc[NC][M];
#pragma unroll
  for (int c = 0; c < NC; ++c)
#pragma unroll
    for (int m = 0; m < M; ++m) acc[c][m] = 0.0f;

  for (int u = lane; u < UNITS; u += 32) {
    const int k = u * V;
    float wv[NC][V];
#pragma unroll
    for (int c = 0; c < NC; ++c) {
      const int n = min(n0 + c, N - 1);  // a column past N is computed, never stored
      load_run<T, V, ALIGNED>(w + (size_t)n * K, k, wv[c]);
    }
#pragma unroll
    for (int m = 0; m < M; ++m) {
      float xv[V];
      load_run<T, V, ALIGNED>(x + (size_t)m * K, k, xv);
#pragma unroll
      for (int c = 0; c < NC; ++c)
#pragma unroll
        for (int i = 0; i < V; ++i) acc[c][m] = fmaf(xv[i], wv[c][i], acc[c][m]);
    }
  }
  if constexpr (TAIL > 0) {
    if (lane == UNITS % 32) {
#pragma unroll
      for (int i = 0; i < TAIL; ++i) {
        const int k = UNITS * V + i;
#pragma unroll
        for (int c = 0; c < NC; ++c) {
          const float wk = to_float(w[(size_t)min(n0 + c, N - 1) * K + k]);
#pragma unroll
          for (int m = 0; m < M; ++m) acc[c][m] = fmaf(to_float(x[(size_t)m * K + k]), wk, acc[c][m]);
        }
      }
    }
  }
  reduce_and_store<T, M, NC>(acc, n0, lane, y, N);
}

// e4m3 scales and e2m1 codes: fp_formats.cuh (the loader puts it before this file)
using lockstep_fp::e2m1_to_float;
using lockstep_fp::e4m3_to_float;

// Eight weights of word `word` (element k0 = 8 * word_index) of column n, dequantized.
template <typename T, int K, int GROUP, int NVFP4>
__device__ __forceinline__ void dequant8(uint32_t word, int n, int k0, const T* scales_affine,
                                         const uint8_t* scales_fp8, const T* biases, float out[8]) {
  constexpr int GROUPS = K / GROUP;
  const size_t g = (size_t)n * GROUPS + k0 / GROUP;
  if constexpr (NVFP4) {
    const float s = e4m3_to_float(scales_fp8[g]);
#pragma unroll
    for (int i = 0; i < 8; ++i) out[i] = __fmul_rn(e2m1_to_float(word >> (4 * i)), s);
  } else {
    const float s = to_float(scales_affine[g]);
    const float b = to_float(biases[g]);
#pragma unroll
    for (int i = 0; i < 8; ++i) out[i] = fmaf(s, (float)((word >> (4 * i)) & 0xF), b);
  }
}

// 4-bit weights packed 8 per uint32, lowest nibble first: W (N, K / 8); affine scales and
// biases (N, K / GROUP) of type T; nvfp4 scales (N, K / 16) of uint8 (E4M3), no biases.
template <typename T, int M, int NC, int K, int GROUP, int NVFP4>
__device__ void skinny_quantized(const T* x, const uint32_t* w, const T* scales_affine,
                                 const uint8_t* scales_fp8, const T* biases, T* y, int N) {
  constexpr int WORDS = K / 8;             // per row
  constexpr int UNITS = WORDS / 4;         // full 16-byte units (32 codes)
  constexpr int TAIL_WORDS = WORDS % 4;    // words of the partial last unit
  constexpr bool ALIGNED = TAIL_WORDS == 0;
  constexpr bool X_ALIGNED = (K * sizeof(T)) % 16 == 0;
  const int lane = threadIdx.x & 31;
  const int n0 = ((blockIdx.x * blockDim.x + threadIdx.x) >> 5) * NC;
  if (n0 >= N) return;

  float acc[NC][M];
#pragma unroll
  for (int c = 0; c < NC; ++c)
#pragma unroll
    for (int m = 0; m < M; ++m) acc[c][m] = 0.0f;

  // One unit = `words` consecutive words starting at word index `wi`, same order everywhere.
  auto run_unit = [&](int wi, const uint32_t (&wq)[NC][4], int words) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if (j >= words) break;
      const int k0 = (wi + j) * 8;
      float wd[NC][8];
#pragma unroll
      for (int c = 0; c < NC; ++c)
        dequant8<T, K, GROUP, NVFP4>(wq[c][j], min(n0 + c, N - 1), k0, scales_affine, scales_fp8,
                                     biases, wd[c]);
#pragma unroll
      for (int m = 0; m < M; ++m) {
        float xv[8];
        load_run<T, 8, X_ALIGNED>(x + (size_t)m * K, k0, xv);
#pragma unroll
        for (int c = 0; c < NC; ++c)
#pragma unroll
          for (int i = 0; i < 8; ++i) acc[c][m] = fmaf(xv[i], wd[c][i], acc[c][m]);
      }
    }
  };

  for (int u = lane; u < UNITS; u += 32) {
    uint32_t wq[NC][4];
#pragma unroll
    for (int c = 0; c < NC; ++c) {
      const uint32_t* row = w + (size_t)min(n0 + c, N - 1) * WORDS + u * 4;
      if constexpr (ALIGNED) {
        const uint4 raw = __ldg(reinterpret_cast<const uint4*>(row));
        wq[c][0] = raw.x; wq[c][1] = raw.y; wq[c][2] = raw.z; wq[c][3] = raw.w;
      } else {
#pragma unroll
        for (int j = 0; j < 4; ++j) wq[c][j] = __ldg(row + j);
      }
    }
    run_unit(u * 4, wq, 4);
  }
  if constexpr (TAIL_WORDS > 0) {
    if (lane == UNITS % 32) {
      uint32_t wq[NC][4];
#pragma unroll
      for (int c = 0; c < NC; ++c)
#pragma unroll
        for (int j = 0; j < 4; ++j)
          wq[c][j] = j < TAIL_WORDS ? w[(size_t)min(n0 + c, N - 1) * WORDS + UNITS * 4 + j] : 0u;
      run_unit(UNITS * 4, wq, TAIL_WORDS);
    }
  }
  reduce_and_store<T, M, NC>(acc, n0, lane, y, N);
}

}  // namespace lockstep
