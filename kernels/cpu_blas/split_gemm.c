/* sgemm calls on several cores, with bits that do not depend on how many ran.
 *
 * A row-major call of M >= lockstep_blas_large_rows rows (a prefill chunk) is cut into
 * fixed column blocks of C (2 per thread, boundaries at multiples of 16, set by N alone),
 * and each block is one single-threaded OpenBLAS sgemm. Calls of the invariant kernel
 * (M <= L, invariant_gemm.c) are cut the same way, each block one kernel call: a column's
 * order there depends on K alone, so the blocks change no bit of it. Helper threads (threads - 1 of
 * them) are woken only when /proc/loadavg says a core is idle; the caller and the helpers
 * claim blocks from a counter, so blocks a late or descheduled helper never started are
 * run by the caller. Who runs a block never changes its bits: the result depends on the
 * call's shape only, whatever the machine's load. (OpenBLAS's own threads give other bits
 * with 1 and 2 threads, and one worker that must share its core stalls the whole call:
 * docs/BENCHMARKS.md, the CPU default.) Split calls are serialized (one job at a time); MLX's CPU stream
 * is their one caller in lockstep. */

#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))
#define MAX_THREADS 8
#define BLOCKS_PER_THREAD 2
/* The invariant kernel's calls are short (tens of microseconds): finer blocks, so a helper
 * that joins late still takes its share. */
#define INVARIANT_BLOCKS_PER_THREAD 8
#define MAX_PIECES (MAX_THREADS * INVARIANT_BLOCKS_PER_THREAD)
#define ALIGN_N 16
#define MIN_WORK 4e6 /* multiply-adds: 128 x 128 x 64 (attention of 128 rows) is 1e6 */
/* The invariant kernel's calls are decode and verification rows, bound by reading the
 * weights: worth a second core from a 192 x 576 layer of one row (a sleeping helper is
 * not woken for less; a spinning one picks the call up within microseconds). */
#define INVARIANT_MIN_WORK 1e5

typedef int blasint;
typedef void (*row_major_sgemm)(int ta, int tb, int m, int n, int k, float alpha,
                                const float *a, int lda, const float *b, int ldb,
                                float beta, float *c, int ldc);
void lockstep_invariant_sgemm(int ta, int tb, int m, int n, int k, float alpha,
                              const float *a, int lda, const float *b, int ldb,
                              float beta, float *c, int ldc); /* invariant_gemm.c */
void scipy_cblas_sgemm(int order, int ta, int tb, blasint m, blasint n,
                       blasint k, float alpha, const float *a, blasint lda,
                       const float *b, blasint ldb, float beta, float *c,
                       blasint ldc);

/* Counters for tests and benches: large calls, and the blocks helpers ran. */
EXPORT long lockstep_blas_split_calls = 0;
EXPORT long lockstep_blas_split_helper_pieces = 0;

static struct {
  row_major_sgemm gemm;
  int ta, tb, m, k, ldb, ldc, lda, pieces, threads;
  float alpha, beta;
  const float *a, *b;
  float *c;
  int bounds[MAX_PIECES + 1];
} job;
static int next_piece, pieces_done, job_open, helpers_inside; /* __atomic, seq_cst */
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;     /* guards generation */
static pthread_mutex_t one_job = PTHREAD_MUTEX_INITIALIZER;  /* one split call at a time */
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER;
static unsigned long generation;   /* written under `lock`, read by spinners without */
static int helpers_spinning;        /* helpers polling `generation` (runnable in loadavg) */
static int helpers_started, online_cpus, loadavg_fd = -1;

#define LOAD(x) __atomic_load_n(&(x), __ATOMIC_SEQ_CST)
#define STORE(x, v) __atomic_store_n(&(x), (v), __ATOMIC_SEQ_CST)
#define ADD(x, v) __atomic_fetch_add(&(x), (v), __ATOMIC_SEQ_CST)
/* A helper polls this long for the next call before it sleeps: a prefill's large calls
 * come close together, and waking a sleeping thread costs tens of microseconds. */
#define SPIN_NS 2000000L

static long now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec * 1000000000L + t.tv_nsec;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

static void openblas_sgemm(int ta, int tb, int m, int n, int k, float alpha,
                           const float *a, int lda, const float *b, int ldb, float beta,
                           float *c, int ldc) {
  scipy_cblas_sgemm(101, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

static void run_piece(int i) {
  int n0 = job.bounds[i], n1 = job.bounds[i + 1];
  const float *b = job.b + (job.tb == 111 ? (size_t)n0 : (size_t)n0 * job.ldb);
  job.gemm(job.ta, job.tb, job.m, n1 - n0, job.k, job.alpha, job.a, job.lda, b, job.ldb,
           job.beta, job.c + n0, job.ldc);
}

/* Claim and run blocks until none is left; returns how many this thread ran. */
static long claim_pieces(void) {
  long ran = 0;
  for (int i; (i = ADD(next_piece, 1)) < job.pieces; ran++) {
    run_piece(i);
    ADD(pieces_done, 1);
  }
  return ran;
}

static void *helper(void *arg) {
  (void)arg;
  unsigned long seen = 0;
  for (;;) {
    ADD(helpers_spinning, 1);
    long deadline = now_ns() + SPIN_NS;
    for (unsigned spins = 1; LOAD(generation) == seen; spins++)
      if (spins % 256 == 0 && now_ns() > deadline)
        break;
      else
        cpu_relax();
    pthread_mutex_lock(&lock);
    ADD(helpers_spinning, -1);
    while (generation == seen)
      pthread_cond_wait(&wake, &lock);
    seen = generation;
    pthread_mutex_unlock(&lock);
    ADD(helpers_inside, 1);
    if (LOAD(job_open))
      ADD(lockstep_blas_split_helper_pieces, claim_pieces());
    ADD(helpers_inside, -1);
  }
  return NULL;
}

/* Threads runnable on the machine now, the caller included ("0.52 0.58 0.95 2/345 1234":
 * the 4th field's numerator); -1 where unknown. */
static int running_now(void) {
  char buf[128];
  if (loadavg_fd < 0)
    return -1;
  ssize_t len = pread(loadavg_fd, buf, sizeof buf - 1, 0);
  if (len <= 0)
    return -1;
  buf[len] = '\0';
  char *p = buf;
  for (int field = 0; field < 3 && p != NULL; field++)
    if ((p = strchr(p, ' ')) != NULL)
      p++;
  return p != NULL ? atoi(p) : -1;
}

/* running_now(), read at most every 5 ms: decode makes a call every few tens of
 * microseconds, and the load changes more slowly than that. */
static int running_recently(void) {
  static long read_at;
  static int value = -1;
  long t = now_ns();
  if (value < 0 || t - read_at > 5000000L) {
    value = running_now();
    read_at = t;
  }
  return value;
}

/* A forked child has none of the helpers (nor maybe a sane lock): it starts afresh. */
static void after_fork_in_child(void) {
  pthread_mutex_t fresh_lock = PTHREAD_MUTEX_INITIALIZER;
  pthread_cond_t fresh_wake = PTHREAD_COND_INITIALIZER;
  lock = fresh_lock, one_job = fresh_lock, wake = fresh_wake;
  helpers_started = 0, helpers_inside = 0, helpers_spinning = 0, job_open = 0, generation = 0;
}

/* loadavg: the file to read (tests pass a fake one); NULL = /proc/loadavg. */
void lockstep_split_init(const char *loadavg) {
  long n = sysconf(_SC_NPROCESSORS_ONLN);
  online_cpus = n > 0 ? (int)n : 1;
  loadavg_fd = open(loadavg ? loadavg : "/proc/loadavg", O_RDONLY | O_CLOEXEC);
  pthread_atfork(NULL, NULL, after_fork_in_child);
}

static void start_helpers(int count) {
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
  for (; helpers_started < count; helpers_started++) {
    pthread_t t;
    if (pthread_create(&t, &attr, helper, NULL) != 0)
      break;
  }
  pthread_attr_destroy(&attr);
}

/* Fixed column blocks of C for n columns: how many there are (1 = no split). */
static int cut(int n, int pieces, int *bounds) {
  int count = 0;
  bounds[0] = 0;
  for (int i = 1; i <= pieces; i++) {
    long edge = i == pieces ? n : ((long)n * i / pieces + ALIGN_N - 1) / ALIGN_N * ALIGN_N;
    if (edge > n)
      edge = n;
    if (edge > bounds[count])
      bounds[++count] = (int)edge;
  }
  return count;
}

/* Row-major `gemm` in fixed column blocks on up to `threads` threads (see the top of this
 * file): BLOCKS_PER_THREAD blocks per thread, so a late helper leaves its share to the
 * caller (the invariant kernel's: INVARIANT_BLOCKS_PER_THREAD). Calls under `min_work`
 * multiply-adds run whole. */
static void split(row_major_sgemm gemm, double min_work, int blocks_per_thread, int join_spinning,
                  int threads,
                  int ta, int tb, int m, int n, int k, float alpha, const float *a, int lda,
                  const float *b, int ldb, float beta, float *c, int ldc) {
  if ((double)m * n * k < min_work || threads < 2) {
    gemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    return;
  }
  threads = threads > MAX_THREADS ? MAX_THREADS : threads;
  pthread_mutex_lock(&one_job);
  job.gemm = gemm;
  job.threads = threads;
  job.pieces = cut(n, threads * blocks_per_thread, job.bounds);
  job.ta = ta, job.tb = tb, job.m = m, job.k = k, job.alpha = alpha, job.beta = beta;
  job.a = a, job.lda = lda, job.b = b, job.ldb = ldb, job.c = c, job.ldc = ldc;
  lockstep_blas_split_calls++;
  STORE(pieces_done, 0);
  STORE(next_piece, 0);
  STORE(job_open, 1);
  /* idle cores: all but those running something, the caller and spinning helpers aside.
   * Short calls (join_spinning) also let a spinning helper join while one more thread than
   * the cores left runs: lockstep's own Python thread, building the next ops while the
   * stream runs these; with any other process busy the helpers stay out. */
  int spinning = LOAD(helpers_spinning), running = running_recently();
  int idle = running < 0 ? job.pieces - 1 : online_cpus - running + spinning;
  if (join_spinning && spinning > 0 && running >= 0 && running - spinning - 1 <= online_cpus - spinning)
    idle = 1;
  if (idle > 0 && job.pieces > 1) {
    start_helpers(job.threads - 1);
    pthread_mutex_lock(&lock);
    STORE(generation, generation + 1);
    pthread_cond_broadcast(&wake);
    pthread_mutex_unlock(&lock);
  }
  claim_pieces();
  while (LOAD(pieces_done) < job.pieces) /* a helper is finishing a block */
    sched_yield();
  STORE(job_open, 0);
  while (LOAD(helpers_inside) > 0) /* none may still read `job` when we return */
    sched_yield();
  pthread_mutex_unlock(&one_job);
}

/* Large OpenBLAS calls (prefill chunks); small ones (a short prompt's attention) run whole. */
void lockstep_split_sgemm(int threads, int ta, int tb, int m, int n, int k, float alpha,
                          const float *a, int lda, const float *b, int ldb, float beta,
                          float *c, int ldc) {
  split(openblas_sgemm, MIN_WORK, BLOCKS_PER_THREAD, 0, threads, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c,
        ldc);
}

/* The invariant kernel's calls (M <= L), row-major. */
void lockstep_split_invariant_sgemm(int threads, int ta, int tb, int m, int n, int k,
                                    float alpha, const float *a, int lda, const float *b,
                                    int ldb, float beta, float *c, int ldc) {
  split(lockstep_invariant_sgemm, INVARIANT_MIN_WORK, INVARIANT_BLOCKS_PER_THREAD, 1, threads, ta, tb, m, n, k, alpha, a,
        lda, b, ldb, beta, c, ldc);
}
