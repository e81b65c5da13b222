// Batch-invariant skinny matmul for MLX's Metal backend (mx.fast.metal_kernel): the same
// loop order as skinny_matmul.cu, written for a SIMD group of 32 lanes.
//
//   y[m, n] = sum_k x[m, k] * W[n, k]      x: (M, K), W: (N, K) as nn.Linear stores it, M <= 64
//
// Order of every output element (the NumPy model kernels/custom/loop_order.py is the
// specification), fixed by K alone:
//   - one SIMD group computes NC whole output columns for all M rows; K is never split;
//   - K is cut into units of 16 bytes of weight (8 bf16/fp16, 4 fp32, 32 four-bit codes);
//     unit u is run by lane u % 32, in increasing u, elements in increasing k; the partial
//     last unit (K tail) is unit K / V under the same rule;
//   - acc = fma(x, w, acc) in float per lane, then an xor butterfly (16, 8, 4, 2, 1);
//   - quantized weights dequantized per element (affine fma(scale, q, bias); nvfp4
//     e2m1(q) * e4m3(scale), exact).
// Metal cannot be run where lockstep is developed; the startup self-test proves (or
// rejects) these kernels on a Mac before they are used.
//
// MSL is C++14: no `if constexpr` or lambdas; constant conditions fold at compile time.

namespace lockstep {

constant constexpr int LANES = 32;

template <typename T, int M, int NC>
void reduce_and_store(thread float (&acc)[NC][M], int n0, uint lane, device T* y, int N) {
  for (int c = 0; c < NC; ++c) {
    for (int m = 0; m < M; ++m) {
      float v = acc[c][m];
      for (ushort s = 16; s >= 1; s >>= 1) v += simd_shuffle_xor(v, s);
      acc[c][m] = v;  // every lane holds the same bits (a + b == b + a)
    }
  }
  for (int c = 0; c < NC; ++c) {
    const int n = n0 + c;
    for (int m = 0; m < M; ++m) {
      if (n < N && uint((c * M + m) & 31) == lane) y[m * N + n] = static_cast<T>(acc[c][m]);
    }
  }
}

template <typename T, int M, int NC, int K>
void skinny_dense(const device T* x, const device T* w, device T* y, int N, uint gid, uint lane) {
  constexpr int V = 16 / sizeof(T);  // elements per unit
  constexpr int UNITS = K / V;       // full units
  constexpr int TAIL = K % V;        // elements of the partial last unit
  const int n0 = int(gid / LANES) * NC;
  if (n0 >= N) return;  // the whole SIMD group leaves together

  float acc[NC][M];
  for (int c = 0; c < NC; ++c)
    for (int m = 0; m < M; ++m) acc[c][m] = 0.0f;

  for (int u = int(lane); u < UNITS; u += LANES) {
    const int k = u * V;
    float wv[NC][V];
    for (int c = 0; c < NC; ++c) {
      const int n = min(n0 + c, N - 1);  // a column past N is computed, never stored
      for (int i = 0; i < V; ++i) wv[c][i] = float(w[size_t(n) * K + k + i]);
    }
    for (int m = 0; m < M; ++m) {
      float xv[V];
      for (int i = 0; i < V; ++i) xv[i] = float(x[size_t(m) * K + k + i]);
      for (int c = 0; c < NC; ++c)
        for (int i = 0; i < V; ++i) acc[c][m] = fma(xv[i], wv[c][i], acc[c][m]);
    }
  }
  if (TAIL > 0 && int(lane) == UNITS % LANES) {
    for (int i = 0; i < TAIL; ++i) {
      const int k = UNITS * V + i;
      for (int c = 0; c < NC; ++c) {
        const float wk = float(w[size_t(min(n0 + c, N - 1)) * K + k]);
        for (int m = 0; m < M; ++m) acc[c][m] = fma(float(x[size_t(m) * K + k]), wk, acc[c][m]);
      }
    }
  }
  reduce_and_store<T, M, NC>(acc, n0, lane, y, N);
}

// FP8 E4M3 (bias 7, no infinities) to float, exactly.
inline float e4m3_to_float(uint8_t b) {
  const int e = (b >> 3) & 0xF, mant = b & 0x7;
  const float mag = e == 0 ? float(mant) * 0x1p-9f : float(8 + mant) * as_type<float>(uint(e - 10 + 127) << 23);
  return (b & 0x80) ? -mag : mag;
}

// FP4 E2M1 code (low 4 bits of q) to float, built bit by bit: sign bit 3, exponent bits
// 2-1 (bias 1; 0 = subnormal 0 or 0.5), mantissa bit 0.
inline float e2m1_to_float(uint q) {
  const uint e = (q >> 1) & 3u, m = q & 1u;
  const uint mag = e == 0 ? (m ? 0x3F000000u : 0u) : ((e + 126u) << 23) | (m << 22);
  return as_type<float>(mag | ((q & 8u) << 28));
}

// 4-bit codes packed 8 per uint32, lowest nibble first: W (N, K / 8). SCALE_KIND 0: affine,
// scales and biases (N, K / GROUP) of type T; 1: nvfp4, scales (N, K / 16) uint8 E4M3.
template <typename T, int M, int NC, int K, int GROUP, int SCALE_KIND>
void skinny_quantized(const device T* x, const device uint32_t* w, const device T* scales_affine,
                      const device uint8_t* scales_fp8, const device T* biases, device T* y,
                      int N, uint gid, uint lane) {
  constexpr int WORDS = K / 8;           // per row
  constexpr int UNITS = WORDS / 4;       // full 16-byte units (32 codes)
  constexpr int TAIL_WORDS = WORDS % 4;  // words of the partial last unit
  constexpr int GROUPS = K / GROUP;
  const int n0 = int(gid / LANES) * NC;
  if (n0 >= N) return;

  float acc[NC][M];
  for (int c = 0; c < NC; ++c)
    for (int m = 0; m < M; ++m) acc[c][m] = 0.0f;

  const int last = UNITS + (TAIL_WORDS > 0 ? 1 : 0);
  for (int u = int(lane); u < last; u += LANES) {
    const int words = u < UNITS ? 4 : TAIL_WORDS;
    for (int j = 0; j < words; ++j) {
      const int wi = u * 4 + j;
      const int k0 = wi * 8;
      float wd[NC][8];
      for (int c = 0; c < NC; ++c) {
        const int n = min(n0 + c, N - 1);
        const uint32_t word = w[size_t(n) * WORDS + wi];
        const size_t g = size_t(n) * GROUPS + k0 / GROUP;
        if (SCALE_KIND == 1) {
          const float s = e4m3_to_float(scales_fp8[g]);
          for (int i = 0; i < 8; ++i) wd[c][i] = e2m1_to_float(word >> (4 * i)) * s;
        } else {
          const float s = float(scales_affine[g]);
          const float b = float(biases[g]);
          for (int i = 0; i < 8; ++i) wd[c][i] = fma(s, float((word >> (4 * i)) & 0xF), b);
        }
      }
      for (int m = 0; m < M; ++m) {
        float xv[8];
        for (int i = 0; i < 8; ++i) xv[i] = float(x[size_t(m) * K + k0 + i]);
        for (int c = 0; c < NC; ++c)
          for (int i = 0; i < 8; ++i) acc[c][m] = fma(xv[i], wd[c][i], acc[c][m]);
      }
    }
  }
  reduce_and_store<T, M, NC>(acc, n0, lane, y, N);
}

template <typename T, int M, int NC, int K, int GROUP>
void skinny_affine(const device T* x, const device uint32_t* w, const device T* scales,
                   const device T* biases, device T* y, int N, uint gid, uint lane) {
  skinny_quantized<T, M, NC, K, GROUP, 0>(x, w, scales, (const device uint8_t*)nullptr, biases, y, N, gid, lane);
}

template <typename T, int M, int NC, int K>
void skinny_nvfp4(const device T* x, const device uint32_t* w, const device uint8_t* scales,
                  device T* y, int N, uint gid, uint lane) {
  skinny_quantized<T, M, NC, K, 16, 1>(x, w, (const device T*)nullptr, scales, (const device T*)nullptr, y, N, gid, lane);
}

}  // namespace lockstep
