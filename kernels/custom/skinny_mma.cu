// Batch-invariant skinny matmul on tensor cores (sm_80+), for MLX's CUDA backend
// (mx.fast.cuda_kernel).
//
//   y[m, n] = sum_k x[m, k] * W[n, k]    x: (M, K) bf16 / fp16, M <= 64;
//                                        W: (N, K) as nn.Linear stores it, dense in x's type,
//                                        or 4-bit (affine g32/64/128, nvfp4 g16) packed 8 per uint32
//
// Every output element is reduced in one order that depends on K alone (the index model is
// kernels/custom/mma_order.py):
//   - a block of WARPS warps computes 8 * NT output columns for all M rows with m16n8k16
//     MMAs (float32 accumulators); rows are taken in tiles of 16, rows past M are zeros;
//   - K is cut into chunks of 4 * U elements (U = 8 for 16-bit weights, one 16-byte load per
//     lane; U = 16 for 4-bit, one 8-byte load); chunk c is run by warp c % WARPS, in
//     increasing c, for all NT column tiles of the block;
//   - in a chunk, lane group q = lane % 4 holds elements q * U .. q * U + U - 1 of column
//     lane / 4 (B) and of rows lane / 4, lane / 4 + 8 (A); MMA j (0 .. U / 4 - 1) gives
//     its logical k slots 2q, 2q + 1 the elements q * U + 4j, + 1 and slots 2q + 8, 2q + 9
//     the elements q * U + 4j + 2, + 3 — in A and B alike, so each MMA is a plain 16-term
//     dot product over its own 16 elements of K;
//   - the last partial chunk is zero-padded (x and W), which adds exact zeros;
//   - warps are combined in shared memory in the order 0, 1, .., WARPS - 1.
// A row's MMA result depends only on that row of A, so row m gets the same bits at M = 1
// and beside 63 other rows; each weight byte is loaded once for all M rows, and a lane's x
// loads serve NT column tiles. NT (column tiles per block) only picks which block computes a
// column, never the order of its sum.
// 4-bit weights are dequantized into x's type before the MMA (affine: fmaf(scale, q, bias)
// rounded once; nvfp4: e2m1(q) * e4m3(scale), exact in bf16 and fp16).
//
// Template arguments (set by kernels/custom/skinny.py): T (x / y type), R8 (row groups of 8:
// ceil(M / 8)), NT, and for the 4-bit kernel GROUP and NVFP4. M, N and K are read from the
// shapes at run time. A lane loads its x rows together with its weights, DEPTH chunks ahead.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace lockstep_mma {

constexpr int WARPS = 4;  // K split of a block: fixed, so a function of K alone

template <bool B> struct bool_c { static constexpr bool value = B; };
template <typename T> struct is_half { static constexpr bool value = false; };
template <> struct is_half<__half> { static constexpr bool value = true; };

__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// Two values packed into one 32-bit MMA operand register, lower k in the low half.
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  const T a = from_float<T>(lo), b = from_float<T>(hi);
  const uint16_t ua = *reinterpret_cast<const uint16_t*>(&a), ub = *reinterpret_cast<const uint16_t*>(&b);
  return (uint32_t)ua | ((uint32_t)ub << 16);
}

// d += A (16 x 16, row) * B (16 x 8, col), float32 accumulators.
template <typename T>
__device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (is_half<T>::value) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// U consecutive 16-bit values of `row` from k as U / 2 packed registers; values at or past
// `limit` are zero. VEC: row + k is 16-byte aligned and the whole run lies below limit.
template <typename T, int U, bool VEC>
__device__ __forceinline__ void load_pairs(const T* row, int k, int limit, uint32_t* out) {
  if constexpr (VEC) {
#pragma unroll
    for (int v = 0; v < U / 8; ++v) {
      const uint4 raw = __ldg(reinterpret_cast<const uint4*>(row + k) + v);
      out[4 * v] = raw.x; out[4 * v + 1] = raw.y; out[4 * v + 2] = raw.z; out[4 * v + 3] = raw.w;
    }
  } else {
    const uint16_t* r = reinterpret_cast<const uint16_t*>(row);
#pragma unroll
    for (int i = 0; i < U / 2; ++i) {
      const uint32_t lo = k + 2 * i < limit ? r[k + 2 * i] : 0u;
      const uint32_t hi = k + 2 * i + 1 < limit ? r[k + 2 * i + 1] : 0u;
      out[i] = lo | (hi << 16);
    }
  }
}

// e4m3 scales and e2m1 codes: fp_formats.cuh (the loader puts it before this file)
using lockstep_fp::e2m1_to_float;
using lockstep_fp::e4m3_to_float;

// One block's share of the result: each warp's float32 fragments, summed in warp order and
// stored for rows < M, columns < N.
template <typename T, int MT, int NT>
__device__ __forceinline__ void combine_and_store(float (&acc)[MT][NT][4], int warp, int lane, int n0,
                                                  T* y, int M, int N) {
  __shared__ float partial[WARPS][MT][NT][32][4];
#pragma unroll
  for (int t = 0; t < MT; ++t)
#pragma unroll
    for (int c = 0; c < NT; ++c)
#pragma unroll
      for (int i = 0; i < 4; ++i) partial[warp][t][c][lane][i] = acc[t][c][i];
  __syncthreads();
  if (warp != 0) return;
  const int g = lane >> 2, q = lane & 3;
#pragma unroll
  for (int t = 0; t < MT; ++t)
#pragma unroll
    for (int c = 0; c < NT; ++c)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        float v = partial[0][t][c][lane][i];
#pragma unroll
        for (int w = 1; w < WARPS; ++w) v += partial[w][t][c][lane][i];
        const int m = 16 * t + g + (i >= 2 ? 8 : 0);
        const int n = n0 + 8 * c + 2 * q + (i & 1);
        if (m < M && n < N) y[(size_t)m * N + n] = from_float<T>(v);
      }
}

// This lane's x rows (8r + g for r < R8) at elements k .. k + U - 1 as packed pairs; rows
// past M are zeros.
template <typename T, int R8, int U, bool VEC>
__device__ __forceinline__ void load_x(const T* x, int M, int K, int k, int g, uint32_t (&xr)[R8][U / 2]) {
#pragma unroll
  for (int r = 0; r < R8; ++r) {
    const int m = 8 * r + g;
    if (m < M) {
      load_pairs<T, U, VEC>(x + (size_t)m * K, k, K, xr[r]);
    } else {
#pragma unroll
      for (int i = 0; i < U / 2; ++i) xr[r][i] = 0u;
    }
  }
}

// The MMAs of one chunk: MMA j takes pairs 2j, 2j + 1 of the lane's run (elements 4j .. 4j + 3)
// from x (rows g, g + 8 of each 16-row tile) and from each column tile's weights.
template <typename T, int R8, int NT, int PAIRS>
__device__ __forceinline__ void mma_chunk(float (&acc)[(R8 + 1) / 2][NT][4], const uint32_t (&wr)[NT][PAIRS],
                                          const uint32_t (&xr)[R8][PAIRS]) {
#pragma unroll
  for (int j = 0; j < PAIRS / 2; ++j)
#pragma unroll
    for (int t = 0; t < (R8 + 1) / 2; ++t) {
      const bool upper = 2 * t + 1 < R8;
      const uint32_t a[4] = {xr[2 * t][2 * j], upper ? xr[2 * t + 1][2 * j] : 0u,
                             xr[2 * t][2 * j + 1], upper ? xr[2 * t + 1][2 * j + 1] : 0u};
#pragma unroll
      for (int c = 0; c < NT; ++c) mma<T>(acc[t][c], a, wr[c][2 * j], wr[c][2 * j + 1]);
    }
}

template <typename T, int R8, int NT>
__device__ void skinny_mma_dense(const T* x, const T* w, T* y, int M, int N, int K) {
  constexpr int U = 8, CHUNK = 4 * U, MT = (R8 + 1) / 2;
  // chunks loaded ahead (latency hiding, never order), fewer where registers run short
  constexpr int DEPTH = R8 <= 2 ? (NT >= 4 ? 2 : 4) : (NT >= 2 ? 1 : 2);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, q = lane & 3;
  const int n0 = blockIdx.x * 8 * NT;
  const T* wrow[NT];
#pragma unroll
  for (int c = 0; c < NT; ++c) wrow[c] = w + (size_t)min(n0 + 8 * c + g, N - 1) * K;  // past N: never stored
  const int full = K / CHUNK;

  float acc[MT][NT][4] = {};  // float32 MMA accumulators, from +0

  auto load_chunk = [&](int ch, auto vec, uint32_t (&wr)[NT][U / 2], uint32_t (&xr)[R8][U / 2]) {
    constexpr bool V = decltype(vec)::value;
    const int k = ch * CHUNK + q * U;
#pragma unroll
    for (int c = 0; c < NT; ++c) load_pairs<T, U, V>(wrow[c], k, K, wr[c]);
    load_x<T, R8, U, V>(x, M, K, k, g, xr);
  };

  if (K % 8 == 0) {  // every row 16-byte aligned
    for (int c0 = warp; c0 < full; c0 += WARPS * DEPTH) {
      uint32_t wr[DEPTH][NT][U / 2], xr[DEPTH][R8][U / 2];
#pragma unroll
      for (int d = 0; d < DEPTH; ++d)
        if (c0 + d * WARPS < full) load_chunk(c0 + d * WARPS, bool_c<true>{}, wr[d], xr[d]);
#pragma unroll
      for (int d = 0; d < DEPTH; ++d)
        if (c0 + d * WARPS < full) mma_chunk<T, R8, NT, U / 2>(acc, wr[d], xr[d]);
    }
  } else {
    for (int ch = warp; ch < full; ch += WARPS) {
      uint32_t wr[NT][U / 2], xr[R8][U / 2];
      load_chunk(ch, bool_c<false>{}, wr, xr);
      mma_chunk<T, R8, NT, U / 2>(acc, wr, xr);
    }
  }
  if (K % CHUNK != 0 && warp == full % WARPS) {  // the partial chunk, zero-padded
    uint32_t wr[NT][U / 2], xr[R8][U / 2];
    load_chunk(full, bool_c<false>{}, wr, xr);
    mma_chunk<T, R8, NT, U / 2>(acc, wr, xr);
  }
  combine_and_store<T, MT, NT>(acc, warp, lane, n0, y, M, N);
}

// The scale (and affine bias) of the 16-element run of column n from element k (k % 16 == 0;
// nvfp4 groups are 16, affine groups 32 or more: one group per run). Past K: zeros.
template <typename T, int GROUP, int NVFP4>
__device__ __forceinline__ void run_scale(const T* scales_affine, const uint8_t* scales_fp8,
                                          const T* biases, size_t n, int k, int K, float& s, float& b) {
  s = b = 0.0f;
  if (k >= K) return;
  const size_t gi = n * (K / GROUP) + k / GROUP;
  if constexpr (NVFP4) {
    s = e4m3_to_float(scales_fp8[gi]);
  } else {
    s = to_float(scales_affine[gi]);
    b = to_float(biases[gi]);
  }
}

// Two words (16 codes, lowest nibble first) dequantized into 8 packed registers of T.
template <typename T, int NVFP4>
__device__ __forceinline__ void dequant16(uint2 words, float s, float b, uint32_t (&out)[8]) {
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const uint32_t word = i < 4 ? words.x : words.y;
    float e[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint32_t code = (word >> (4 * ((2 * i + h) % 8))) & 0xFu;
      if constexpr (NVFP4) e[h] = __fmul_rn(e2m1_to_float(code), s);
      else e[h] = fmaf(s, (float)code, b);
    }
    out[i] = pack2<T>(e[0], e[1]);
  }
}

// 4-bit weights packed 8 per uint32, lowest nibble first: W (N, K / 8); affine scales and
// biases (N, K / GROUP) of type T; nvfp4 scales (N, K / 16) of uint8 (E4M3), no biases.
// K % 16 == 0, so every row and every run is 8-byte aligned; a run past K is all zeros.
template <typename T, int R8, int NT, int GROUP, int NVFP4>
__device__ void skinny_mma_quantized(const T* x, const uint32_t* w, const T* scales_affine,
                                     const uint8_t* scales_fp8, const T* biases, T* y,
                                     int M, int N, int K) {
  constexpr int U = 16, CHUNK = 4 * U, MT = (R8 + 1) / 2;
  constexpr int DEPTH = R8 <= 2 ? (NT >= 4 ? 2 : 4) : (R8 <= 4 && NT < 4 ? 2 : 1);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, q = lane & 3;
  const int n0 = blockIdx.x * 8 * NT;
  size_t col[NT];
#pragma unroll
  for (int c = 0; c < NT; ++c) col[c] = (size_t)min(n0 + 8 * c + g, N - 1);
  const int chunks = (K + CHUNK - 1) / CHUNK;  // the last may be partial (runs past K: zeros)

  float acc[MT][NT][4] = {};  // float32 MMA accumulators, from +0

  for (int c0 = warp; c0 < chunks; c0 += WARPS * DEPTH) {
    uint2 words[DEPTH][NT];
    uint32_t xr[DEPTH][R8][U / 2];
#pragma unroll
    for (int d = 0; d < DEPTH; ++d) {
      const int k = (c0 + d * WARPS) * CHUNK + q * U;
      if (c0 + d * WARPS >= chunks) continue;
#pragma unroll
      for (int c = 0; c < NT; ++c)
        words[d][c] = k < K ? __ldg(reinterpret_cast<const uint2*>(w + col[c] * (K / 8) + k / 8))
                            : make_uint2(0u, 0u);
      if (k < K) load_x<T, R8, U, true>(x, M, K, k, g, xr[d]);
      else load_x<T, R8, U, false>(x, M, K, k, g, xr[d]);  // all zeros
    }
#pragma unroll
    for (int d = 0; d < DEPTH; ++d) {
      const int k = (c0 + d * WARPS) * CHUNK + q * U;
      if (c0 + d * WARPS >= chunks) continue;
      uint32_t wr[NT][U / 2];
#pragma unroll
      for (int c = 0; c < NT; ++c) {
        float s, b;
        run_scale<T, GROUP, NVFP4>(scales_affine, scales_fp8, biases, col[c], k, K, s, b);
        dequant16<T, NVFP4>(words[d][c], s, b, wr[c]);
      }
      mma_chunk<T, R8, NT, U / 2>(acc, wr, xr[d]);
    }
  }
  combine_and_store<T, MT, NT>(acc, warp, lane, n0, y, M, N);
}

}  // namespace lockstep_mma
