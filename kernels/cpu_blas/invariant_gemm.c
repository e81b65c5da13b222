/* Batch-invariant float32 GEMM for the shim: every output element's reduction over K
 * runs in one order that depends on K alone, never on M, N, the tiling or the ISA.
 *
 * The canonical order for C[m][n] = sum_k A(m,k) B(k,n), K8 = K - K % 8:
 *   lane j (0..7) = fma chain over k = j, j+8, ..., < K8, starting from 0.0f;
 *   s = ((l0+l4) + (l2+l6)) + ((l1+l5) + (l3+l7))    (halves, then quarters, then pair);
 *   s = fma(A(m,k), B(k,n), s) for k = K8 .. K-1, in order;
 *   C = alpha == 1 ? s : alpha * s;  then, if beta != 0, C = fma(beta, C_old, C).
 * The AVX2 paths hold the eight lanes in one register (B transposed: along K) or as eight
 * registers (B not transposed: along N), and the portable path emulates the lanes with
 * fmaf, so all three give the same bits; the self-test proves it on the running machine.
 * Built with -ffp-contract=off: no compiler-made FMA may change that order. */

#include <math.h>
#include <stddef.h>

#define NO_TRANS 111
#define LANES 8

#define EXPORT __attribute__((visibility("default")))

/* Force the portable path (tests compare it bitwise against the vector path). */
EXPORT int lockstep_cpu_kernel_portable = 0;

static inline float finish(float s, float alpha, float beta, const float *c) {
  if (alpha != 1.0f)
    s = alpha * s;
  return beta != 0.0f ? fmaf(beta, *c, s) : s;
}

/* One output in the canonical order; A(m, k) = a[k * sa], B(k, n) = b[k * sb]. */
static float dot_portable(int k, const float *a, ptrdiff_t sa, const float *b,
                          ptrdiff_t sb) {
  float lane[LANES] = {0};
  int k8 = k - k % LANES;
  for (int p = 0; p < k8; p += LANES)
    for (int j = 0; j < LANES; j++)
      lane[j] = fmaf(a[(p + j) * sa], b[(p + j) * sb], lane[j]);
  float s = ((lane[0] + lane[4]) + (lane[2] + lane[6])) +
            ((lane[1] + lane[5]) + (lane[3] + lane[7]));
  for (int p = k8; p < k; p++)
    s = fmaf(a[p * sa], b[p * sb], s);
  return s;
}

/* Strides of A(m, k) and B(k, n) for a row-major call. */
static inline void strides(int ta, int tb, int lda, int ldb, ptrdiff_t *a_m,
                           ptrdiff_t *a_k, ptrdiff_t *b_k, ptrdiff_t *b_n) {
  *a_m = ta == NO_TRANS ? lda : 1;
  *a_k = ta == NO_TRANS ? 1 : lda;
  *b_k = tb == NO_TRANS ? ldb : 1;
  *b_n = tb == NO_TRANS ? 1 : ldb;
}

static void gemm_portable(int ta, int tb, int m, int n, int k, float alpha,
                          const float *a, int lda, const float *b, int ldb,
                          float beta, float *c, int ldc) {
  ptrdiff_t a_m, a_k, b_k, b_n;
  strides(ta, tb, lda, ldb, &a_m, &a_k, &b_k, &b_n);
  for (int i = 0; i < m; i++)
    for (int j = 0; j < n; j++) {
      float *out = c + (ptrdiff_t)i * ldc + j;
      *out = finish(dot_portable(k, a + i * a_m, a_k, b + j * b_n, b_k), alpha,
                    beta, out);
    }
}

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

#define AVX2 __attribute__((target("avx2,fma")))
#define TILE AVX2 __attribute__((always_inline)) static inline
/* How far ahead of its loads a multi-row tile prefetches weights (prefetch never faults, so
 * past the matrix's end is harmless); loads only, the arithmetic is untouched. */
#define PREFETCH_FLOATS 1024

TILE float reduce8(__m256 v) {
  /* lanes i + (i+4), then + (i+2), then pair: the canonical tree */
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_shuffle_ps(h, h, 1));
  return _mm_cvtss_f32(h);
}

/* B transposed (nn.Linear's x @ W.T: B(k, n) = b[n * ldb + k]), A not: R rows x C
 * columns of C per tile; each weight vector loaded once serves all R rows. */
TILE void tile_nt(int R, int C, int k, float alpha, const float *a, int lda,
                  const float *b, int ldb, float beta, float *c, int ldc) {
  __m256 acc[4][8];
#pragma GCC unroll 8
  for (int r = 0; r < R; r++)
#pragma GCC unroll 8
    for (int j = 0; j < C; j++)
      acc[r][j] = _mm256_setzero_ps();
  int k8 = k - k % LANES;
  for (int p = 0; p < k8; p += LANES) {
    __m256 av[4];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
      av[r] = _mm256_loadu_ps(a + (ptrdiff_t)r * lda + p);
#pragma GCC unroll 8
    for (int j = 0; j < C; j++) {
      /* Multi-row tiles read only C weight rows at a time, too few streams for the hardware
       * prefetcher to keep ahead; one tile's rows ahead is still within the weights' next tile. */
      if (R > 1)
        _mm_prefetch((const char *)(b + (ptrdiff_t)j * ldb + p + PREFETCH_FLOATS), _MM_HINT_T0);
      __m256 bv = _mm256_loadu_ps(b + (ptrdiff_t)j * ldb + p);
#pragma GCC unroll 8
      for (int r = 0; r < R; r++)
        acc[r][j] = _mm256_fmadd_ps(av[r], bv, acc[r][j]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; r++)
#pragma GCC unroll 8
    for (int j = 0; j < C; j++) {
      const float *ar = a + (ptrdiff_t)r * lda, *bj = b + (ptrdiff_t)j * ldb;
      float s = reduce8(acc[r][j]);
      for (int p = k8; p < k; p++)
        s = fmaf(ar[p], bj[p], s);
      float *out = c + (ptrdiff_t)r * ldc + j;
      *out = finish(s, alpha, beta, out);
    }
}

#define NT_COLS(R, C)                                                          \
  AVX2 static void nt_##R##x##C(int k, float alpha, const float *a, int lda,   \
                                const float *b, int ldb, float beta, float *c, \
                                int ldc) {                                     \
    tile_nt(R, C, k, alpha, a, lda, b, ldb, beta, c, ldc);                     \
  }
NT_COLS(1, 8) NT_COLS(2, 4) NT_COLS(3, 4) NT_COLS(1, 3) NT_COLS(2, 3)
NT_COLS(3, 3) NT_COLS(4, 3) NT_COLS(1, 1) NT_COLS(2, 1) NT_COLS(3, 1)
NT_COLS(4, 1)

typedef void (*nt_tile)(int, float, const float *, int, const float *, int,
                        float, float *, int);

AVX2 static void gemm_nt_avx2(int m, int n, int k, float alpha, const float *a,
                              int lda, const float *b, int ldb, float beta,
                              float *c, int ldc) {
  /* Columns outer, rows inner: a column tile's weights (cols x K floats) stay in L1
   * while every row chunk uses them, so weights come from memory once per call.
   * Tile widths keep R x C accumulators + R row vectors within AVX2's 16 registers. */
  static const nt_tile wide8[5] = {0, nt_1x8, 0, 0, 0};
  static const nt_tile wide4[5] = {0, 0, nt_2x4, nt_3x4, 0};
  static const nt_tile wide3[5] = {0, nt_1x3, nt_2x3, nt_3x3, nt_4x3};
  static const nt_tile narrow[5] = {0, nt_1x1, nt_2x1, nt_3x1, nt_4x1};
  int cols = m == 1 ? 8 : m <= 3 ? 4 : 3;
  const nt_tile *wide = cols == 8 ? wide8 : cols == 4 ? wide4 : wide3;
  for (int j = 0; j < n;) {
    int take = n - j >= cols ? cols : 1;
    for (int i = 0; i < m;) {
      int rows = m - i >= 4 ? 4 : m - i;
      nt_tile f = take == cols ? wide[rows] : narrow[rows];
      f(k, alpha, a + (ptrdiff_t)i * lda, lda, b + (ptrdiff_t)j * ldb, ldb, beta,
        c + (ptrdiff_t)i * ldc + j, ldc);
      i += rows;
    }
    j += take;
  }
}

/* B not transposed (B(k, n) = b[k * ldb + n], e.g. attention weights @ V): lane j of
 * column n lives in register j, lane n; A read by broadcast, any transpose. */
AVX2 static void gemm_nn_avx2(int m, int n, int k, float alpha, const float *a,
                              ptrdiff_t a_m, ptrdiff_t a_k, const float *b,
                              int ldb, float beta, float *c, int ldc) {
  int k8 = k - k % LANES;
  for (int i = 0; i < m; i++) {
    const float *ar = a + i * a_m;
    float *cr = c + (ptrdiff_t)i * ldc;
    int j = 0;
    for (; j + 8 <= n; j += 8) {
      __m256 l[8];
      for (int q = 0; q < 8; q++)
        l[q] = _mm256_setzero_ps();
      for (int p = 0; p < k8; p += LANES)
#pragma GCC unroll 8
        for (int q = 0; q < 8; q++)
          l[q] = _mm256_fmadd_ps(_mm256_set1_ps(ar[(p + q) * a_k]),
                                 _mm256_loadu_ps(b + (ptrdiff_t)(p + q) * ldb + j), l[q]);
      __m256 s = _mm256_add_ps(
          _mm256_add_ps(_mm256_add_ps(l[0], l[4]), _mm256_add_ps(l[2], l[6])),
          _mm256_add_ps(_mm256_add_ps(l[1], l[5]), _mm256_add_ps(l[3], l[7])));
      float out[8];
      _mm256_storeu_ps(out, s);
      for (int q = 0; q < 8; q++) {
        float t = out[q];
        for (int p = k8; p < k; p++)
          t = fmaf(ar[p * a_k], b[(ptrdiff_t)p * ldb + j + q], t);
        cr[j + q] = finish(t, alpha, beta, cr + j + q);
      }
    }
    for (; j < n; j++)
      cr[j] = finish(dot_portable(k, ar, a_k, b + j, ldb), alpha, beta, cr + j);
  }
}

static int has_avx2(void) {
  static int known = -1;
  if (known < 0) {
    __builtin_cpu_init();
    known = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }
  return known;
}
#else
static int has_avx2(void) { return 0; }
#endif

/* Which path serves calls here: "avx2+fma" or "portable" (no such ISA, or forced). */
EXPORT const char *lockstep_cpu_kernel_isa(void) {
  return has_avx2() && !lockstep_cpu_kernel_portable ? "avx2+fma" : "portable";
}

/* Row-major C (m x n) = alpha op(A) op(B) + beta C, in the canonical order. */
void lockstep_invariant_sgemm(int ta, int tb, int m, int n, int k, float alpha,
                              const float *a, int lda, const float *b, int ldb,
                              float beta, float *c, int ldc) {
#if defined(__x86_64__) || defined(__i386__)
  if (has_avx2() && !lockstep_cpu_kernel_portable) {
    ptrdiff_t a_m, a_k, b_k, b_n;
    strides(ta, tb, lda, ldb, &a_m, &a_k, &b_k, &b_n);
    if (tb != NO_TRANS && ta == NO_TRANS) {
      gemm_nt_avx2(m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
      return;
    }
    if (tb == NO_TRANS) {
      gemm_nn_avx2(m, n, k, alpha, a, a_m, a_k, b, ldb, beta, c, ldc);
      return;
    }
  }
#endif
  gemm_portable(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
