// Quantized rows in the order of MLX's own quantized GEMV, for MLX's CUDA backend.
//
//   y[m, n] = sum_k x[m, k] * W[n, k]    x: (M, K) of T (float16, bfloat16); W: (N, K) codes
//                                        packed in uint32 words, lowest bits first
//
// A plain decode step (M = 1) of a quantized linear runs MLX's qmv
// (mlx/backend/cuda/quantized/qmm/qmv.cu; MLX takes it for fewer than 8 rows on sm80/sm90):
// one warp per output column; lane l takes EPT consecutive elements at
// idx = EPT * l + 32 * EPT * t, t = 0, 1, .., then a tail tile where K % (32 * EPT) != 0;
// each weight is dequantized in T; with 4-bit weights EPT accumulators of type T take
// fma(x, w, acc) (one rounding to T), with 8-bit weights float32 ones; then
// s = 0 + acc[0] + .. + acc[EPT - 1] in float32 and the xor butterfly over the lanes
// (cooperative_groups::reduce). This kernel computes every row of a block of M rows in
// exactly that order, so each row has the bits of the single-row call, while a warp's weight
// loads and dequantization serve MR rows. Index model: kernels/custom/qmv_order.py; the
// startup self-test proves the bits on the running GPU.
//
// Template arguments (set by kernels/custom/qmv_rows.py): T; FMT: 0 affine (BITS-bit
// unsigned codes, a T scale and bias per GROUP), 1 nvfp4 (e2m1 codes, an e4m3 scale per 16),
// 2 mxfp4 (e2m1, a ue8m0 scale per 32), 3 mxfp8 (e4m3 codes, ue8m0 per 32); BITS; GROUP;
// FUSED (affine: code * scale + bias rounded once, else after each step: MLX's build
// decides, the loader's smoke test finds which); R output columns and MR rows per warp
// (which warp computes an output, never the order of its sum); TILES, the full tiles a warp
// loads before computing them (at most K's: each one more copy of the tile's code in the
// cubin, whose bytes MLX hashes at every launch; never the order of a sum).

namespace lockstep_qmv {

using namespace lockstep_quant;

// Codes to T through a table in shared memory, filled once per block: a 4-bit table maps a
// byte to its two codes' values (low nibble first), an 8-bit table a byte to one value. The
// values are exact in T, so the table changes no bits, only the instructions per weight.
template <typename T, int FMT, int BITS>
__device__ __forceinline__ void fill_table(typename Pair<T>::type* table) {
  for (int i = threadIdx.x; i < 256; i += blockDim.x) {
    if constexpr (BITS == 4)
      table[i] = make_pair(from_float<T>(code_value<FMT>(i & 15)), from_float<T>(code_value<FMT>(i >> 4)));
    else
      table[i] = make_pair(from_float<T>(code_value<FMT>(i)), from_float<T>(0.0f));
  }
  __syncthreads();
}

// Two adjacent weights j = 0 .. EPT / 2 - 1 of a tile's 64 packed bits, as codes in T.
template <typename T, int BITS>
__device__ __forceinline__ typename Pair<T>::type code_pair(const typename Pair<T>::type* table, uint2 packed,
                                                            int j) {
  if constexpr (BITS == 4) {
    return table[((j < 4 ? packed.x : packed.y) >> (8 * (j & 3))) & 0xFFu];
  } else {
    const uint32_t word = j < 2 ? packed.x : packed.y;
    const int shift = 16 * (j & 1);
    return make_pair(low_half(table[(word >> shift) & 0xFFu]),
                     low_half(table[(word >> (shift + 8)) & 0xFFu]));
  }
}

// The scaled pair: code * scale (+ bias) in T. The _rn operations are never fused by the
// assembler; FUSED rounds once.
template <typename T, int FMT, int FUSED>
__device__ __forceinline__ typename Pair<T>::type scaled(typename Pair<T>::type c, T s, T b) {
  const auto s2 = make_pair(s, s);
  if constexpr (FMT == 0) {
    const auto b2 = make_pair(b, b);
    if constexpr (FUSED) return __hfma2(c, s2, b2);
    else return __hadd2_rn(__hmul2_rn(c, s2), b2);
  } else {
    return __hmul2_rn(c, s2);
  }
}

template <typename T, int FMT, int BITS, int GROUP, int FUSED, int R, int MR, int TILES>
__device__ void qmv_rows(const T* x, const uint32_t* w, const T* scales_t, const uint8_t* scales_u8,
                         const T* biases, T* y, int M, int N, int K) {
  using T2 = typename Pair<T>::type;
  constexpr int EPT = BITS <= 4 ? 16 : 8;  // MLX's elems_per_thread for 16-bit x
  constexpr bool ACC_IN_T = BITS <= 4;     // else float32 accumulators
  constexpr int PAIRS = EPT / 2;
  __shared__ T2 table[256];
  fill_table<T, FMT, BITS>(table);  // before any warp returns (a block barrier)

  const int lane = threadIdx.x & 31;
  const int warp = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const int n0 = warp * R;
  const int m0 = blockIdx.y * MR;
  if (n0 >= N) return;
  const int words_per_row = K / (32 / BITS);
  const int groups = K / GROUP;

  int col[R];
#pragma unroll
  for (int r = 0; r < R; ++r) col[r] = min(n0 + r, N - 1);  // past N: never stored
  const T* xrow[MR];
#pragma unroll
  for (int m = 0; m < MR; ++m) xrow[m] = x + (size_t)min(m0 + m, M - 1) * K;  // past M: never stored

  T2 acc_t[MR][R][PAIRS];
  float acc_f[MR][R][EPT];
#pragma unroll
  for (int m = 0; m < MR; ++m)
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
      for (int j = 0; j < PAIRS; ++j) acc_t[m][r][j] = make_pair(from_float<T>(0.0f), from_float<T>(0.0f));
#pragma unroll
      for (int i = 0; i < EPT; ++i) acc_f[m][r][i] = 0.0f;
    }

  // A tile's weights: EPT codes in 64 bits, and their group's scale and bias.
  struct Weights { uint2 packed[R]; T s[R]; T b[R]; };
  auto load = [&](int idx) {
    Weights v;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      v.packed[r] = *reinterpret_cast<const uint2*>(w + (size_t)col[r] * words_per_row + idx / (32 / BITS));
      const int g = col[r] * groups + idx / GROUP;
      v.s[r] = scale_value<T, FMT>(scales_t, scales_u8, g);
      v.b[r] = from_float<T>(0.0f);
      if constexpr (FMT == 0) v.b[r] = biases[g];
    }
    return v;
  };
  auto compute = [&](int idx, const Weights& v) {
    T2 wd[R][PAIRS];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int j = 0; j < PAIRS; ++j)
        wd[r][j] = scaled<T, FMT, FUSED>(code_pair<T, BITS>(table, v.packed[r], j), v.s[r], v.b[r]);
#pragma unroll
    for (int m = 0; m < MR; ++m) {
      T2 xv[PAIRS];
      const uint4* src = reinterpret_cast<const uint4*>(xrow[m] + idx);
#pragma unroll
      for (int u = 0; u < PAIRS / 4; ++u) {
        const uint4 raw = src[u];
        xv[4 * u + 0] = *reinterpret_cast<const T2*>(&raw.x);
        xv[4 * u + 1] = *reinterpret_cast<const T2*>(&raw.y);
        xv[4 * u + 2] = *reinterpret_cast<const T2*>(&raw.z);
        xv[4 * u + 3] = *reinterpret_cast<const T2*>(&raw.w);
      }
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int j = 0; j < PAIRS; ++j) {
          if constexpr (ACC_IN_T) {
            acc_t[m][r][j] = __hfma2(xv[j], wd[r][j], acc_t[m][r][j]);
          } else {
            const float2 xf = to_float2(xv[j]), wf = to_float2(wd[r][j]);
            acc_f[m][r][2 * j] = __fmaf_rn(xf.x, wf.x, acc_f[m][r][2 * j]);
            acc_f[m][r][2 * j + 1] = __fmaf_rn(xf.y, wf.y, acc_f[m][r][2 * j + 1]);
          }
        }
    }
  };

  // The warp's tiles in order, the tail tile last where K % (32 * EPT) != 0 (a lane takes it
  // where its idx < K, as MLX's loop does), their weights loaded TILES at a time before any is
  // computed (more bytes in flight per warp; loads may go in any order, the sums may not).
  constexpr int PER_WARP = 32 * EPT;
  const int tiles = (K + PER_WARP - 1) / PER_WARP;
#pragma unroll 1
  for (int t0 = 0; t0 < tiles; t0 += TILES) {
    Weights v[TILES];
#pragma unroll
    for (int u = 0; u < TILES; ++u) {
      const int idx = lane * EPT + (t0 + u) * PER_WARP;
      if (t0 + u < tiles && idx < K) v[u] = load(idx);
    }
#pragma unroll
    for (int u = 0; u < TILES; ++u) {
      const int idx = lane * EPT + (t0 + u) * PER_WARP;
      if (t0 + u < tiles && idx < K) compute(idx, v[u]);
    }
  }

#pragma unroll
  for (int m = 0; m < MR; ++m)
#pragma unroll
    for (int r = 0; r < R; ++r) {
      float s = 0.0f;
      if constexpr (ACC_IN_T) {
#pragma unroll
        for (int j = 0; j < PAIRS; ++j) {
          const float2 f = to_float2(acc_t[m][r][j]);
          s += f.x;
          s += f.y;
        }
      } else {
#pragma unroll
        for (int i = 0; i < EPT; ++i) s += acc_f[m][r][i];
      }
#pragma unroll
      for (int offset = 16; offset > 0; offset >>= 1) s += __shfl_xor_sync(0xffffffffu, s, offset);
      if (lane == 0 && m0 + m < M && n0 + r < N) y[(size_t)(m0 + m) * N + n0 + r] = from_float<T>(s);
    }
}

}  // namespace lockstep_qmv
