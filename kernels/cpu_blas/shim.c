/* LD_PRELOAD shim: route MLX's CPU BLAS calls to OpenBLAS.
 *
 * The mlx[cpu] Linux wheel links netlib reference BLAS and imports exactly
 * cblas_sgemm / cblas_dgemm / cblas_cgemm (float32 / float64 / complex64
 * matmul; fp16/bf16 and quantized matmuls never reach BLAS). libmlx.so binds
 * them through the PLT without -Bsymbolic, so a preloaded definition wins.
 * pip's scipy-openblas32 exports the same functions with a `scipy_` prefix
 * (so it never clashes with another BLAS in-process); we forward to those.
 *
 * Built by kernels/cpu_blas.py, linked against libscipy_openblas.so with an
 * rpath, so preloading this one file pulls OpenBLAS in.
 *
 * CBLAS enums are passed as int: their values (101/102, 111/112/113) are
 * fixed by the CBLAS standard, identical in both libraries. */

#include <stdlib.h>

typedef int blasint; /* scipy-openblas32: 32-bit integer interface */

void scipy_cblas_sgemm(int order, int ta, int tb, blasint m, blasint n,
                       blasint k, float alpha, const float *a, blasint lda,
                       const float *b, blasint ldb, float beta, float *c,
                       blasint ldc);
void scipy_cblas_sgemv(int order, int trans, blasint m, blasint n, float alpha,
                       const float *a, blasint lda, const float *x, blasint incx,
                       float beta, float *y, blasint incy);
void scipy_cblas_dgemm(int order, int ta, int tb, blasint m, blasint n,
                       blasint k, double alpha, const double *a, blasint lda,
                       const double *b, blasint ldb, double beta, double *c,
                       blasint ldc);
void scipy_cblas_cgemm(int order, int ta, int tb, blasint m, blasint n,
                       blasint k, const void *alpha, const void *a,
                       blasint lda, const void *b, blasint ldb,
                       const void *beta, void *c, blasint ldc);

int scipy_openblas_get_num_threads(void);
void lockstep_split_init(const char *loadavg); /* split_gemm.c */
void lockstep_split_sgemm(int threads, int ta, int tb, int m, int n, int k, float alpha,
                          const float *a, int lda, const float *b, int ldb, float beta,
                          float *c, int ldc);

void lockstep_split_invariant_sgemm(int threads, int ta, int tb, int m, int n, int k,
                                    float alpha, const float *a, int lda, const float *b,
                                    int ldb, float beta, float *c, int ldc); /* split_gemm.c */

#define EXPORT __attribute__((visibility("default")))

/* Deterministic mode's L when the `cpu_kernel` strategy is installed (set through
 * ctypes by kernels/cpu_blas.py, 0 = off): sgemm calls of m <= L rows, m = 1 decode
 * included, run lockstep_invariant_sgemm, whose rows do not depend on m; with
 * LOCKSTEP_BLAS_LARGE_THREADS > 1, in column blocks on idle cores (split_gemm.c). */
EXPORT int lockstep_cpu_kernel_limit = 0;

/* Marker symbol: lets a process (or a test) confirm the shim is the loaded
 * definition, not just mapped. */
EXPORT const char lockstep_cpu_blas_shim[] = "openblas";

/* Calls of at least lockstep_blas_large_rows rows (prefill chunks and passes of several
 * rows, row-major) run in lockstep_blas_large_threads fixed column blocks, on as many cores as are idle
 * (split_gemm.c: the bits depend on the shape alone); 0 or 1 = off. Every other call
 * runs on OpenBLAS's own threads (OPENBLAS_NUM_THREADS: 1 on 2 cores, where a second
 * OpenBLAS thread stalls every call while another process holds a core). Read from LOCKSTEP_BLAS_LARGE_THREADS /
 * LOCKSTEP_BLAS_LARGE_ROWS at load (set by kernels/cpu_blas.py). */
EXPORT int lockstep_blas_small_threads = 1;
EXPORT int lockstep_blas_large_threads = 0;
EXPORT int lockstep_blas_large_rows = 2;

static int env_int(const char *name, int fallback) {
  const char *v = getenv(name);
  if (v == NULL || *v == '\0')
    return fallback;
  char *end;
  long x = strtol(v, &end, 10);
  return (*end == '\0' && x >= 0 && x <= 1024) ? (int)x : fallback;
}

/* Runs after OpenBLAS's own initializer (it is a dependency of this object). */
__attribute__((constructor)) static void read_thread_settings(void) {
  lockstep_blas_small_threads = scipy_openblas_get_num_threads();
  lockstep_blas_large_threads = env_int("LOCKSTEP_BLAS_LARGE_THREADS", 0);
  lockstep_blas_large_rows = env_int("LOCKSTEP_BLAS_LARGE_ROWS", 2);
  if (lockstep_blas_large_threads > 1) /* LOCKSTEP_BLAS_LOADAVG: tests' fake load */
    lockstep_split_init(getenv("LOCKSTEP_BLAS_LOADAVG"));
}

EXPORT void cblas_sgemm(int order, int ta, int tb, blasint m, blasint n,
                        blasint k, float alpha, const float *a, blasint lda,
                        const float *b, blasint ldb, float beta, float *c,
                        blasint ldc) {
  if (m <= lockstep_cpu_kernel_limit) {
    int threads = lockstep_blas_large_threads;
    if (order == 101)
      lockstep_split_invariant_sgemm(threads, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta,
                                     c, ldc);
    else /* column-major C = op(A) op(B) is row-major C^T = op(B)^T op(A)^T */
      lockstep_split_invariant_sgemm(threads, tb, ta, n, m, k, alpha, b, ldb, a, lda, beta,
                                     c, ldc);
    return;
  }
  if (order == 101 && lockstep_blas_large_threads > 1 && m >= lockstep_blas_large_rows) {
    lockstep_split_sgemm(lockstep_blas_large_threads, ta, tb, m, n, k, alpha, a, lda, b,
                         ldb, beta, c, ldc);
    return;
  }
  /* One row (decode) is a matrix-vector product: OpenBLAS's sgemv is faster for it than
   * its sgemm at M = 1 (docs/BENCHMARKS.md, CPU BLAS). Row-major only. */
  if (order == 101 && m == 1) {
    blasint incx = ta == 111 ? 1 : lda; /* op(A) = the row, or A's column of stride lda */
    if (tb == 111) /* y = x B, B k x n: y = B^T x */
      scipy_cblas_sgemv(101, 112, k, n, alpha, b, ldb, a, incx, beta, c, 1);
    else /* y = x B^T, B n x k: y = B x */
      scipy_cblas_sgemv(101, 111, n, k, alpha, b, ldb, a, incx, beta, c, 1);
    return;
  }
  scipy_cblas_sgemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c,
                    ldc);
}

EXPORT void cblas_dgemm(int order, int ta, int tb, blasint m, blasint n,
                        blasint k, double alpha, const double *a, blasint lda,
                        const double *b, blasint ldb, double beta, double *c,
                        blasint ldc) {
  scipy_cblas_dgemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c,
                    ldc);
}

EXPORT void cblas_cgemm(int order, int ta, int tb, blasint m, blasint n,
                        blasint k, const void *alpha, const void *a,
                        blasint lda, const void *b, blasint ldb,
                        const void *beta, void *c, blasint ldc) {
  scipy_cblas_cgemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c,
                    ldc);
}
