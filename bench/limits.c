// This machine's ceilings that Python cannot measure: the FMA peak, load bandwidth at a working-set
// size, STREAM's copy and triad, a read-modify-write stream, random row gathers. bench/limits.py
// compiles it at run time (cc -O2 -march=native -fopenmp) and reads one JSON line per measurement:
//
//   limits fma THREADS                      GFLOP/s of independent FMA chains in registers
//   limits read BYTES THREADS               GB/s summing a private BYTES buffer per thread, again and again
//   limits update BYTES THREADS             GB/s of y += a * x over private buffers of BYTES (x and y) per thread
//   limits gather BYTES ROW THREADS         GB/s of ROW-byte rows read at random from a private BYTES buffer
//   limits stream BYTES THREADS             STREAM copy and triad, GB/s, arrays of BYTES each, shared
//
// Every figure is the best of several trials (a ceiling: what the machine reaches, not a typical run).
// -march=native picks the vector width: 16 floats where the compiler targets AVX-512, else 8 (AVX2).
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__)
#define LANES 16
typedef __m512 vec;
#define VLOAD(p) _mm512_load_ps(p)
#define VADD(a, b) _mm512_add_ps(a, b)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VSET(x) _mm512_set1_ps(x)
#define VSTORE(p, v) _mm512_store_ps(p, v)
#define ISA "avx512"
#define CHAINS 16  // of 32 registers: twice the 2 FMA ports x 4 cycles of latency in flight
#else
#define LANES 8
typedef __m256 vec;
#define VLOAD(p) _mm256_load_ps(p)
#define VADD(a, b) _mm256_add_ps(a, b)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VSET(x) _mm256_set1_ps(x)
#define VSTORE(p, v) _mm256_store_ps(p, v)
#define ISA "avx2"
#define CHAINS 12  // of 16 registers
#endif

static volatile float sink;  // results go here so that the compiler keeps the loops

static float* buffer(size_t bytes) {
  float* p = aligned_alloc(64, (bytes + 63) / 64 * 64);
  if (p == NULL) {
    fprintf(stderr, "error: limits: cannot allocate %zu bytes\n", bytes);
    exit(1);
  }
  for (size_t i = 0; i < bytes / sizeof(float); i++) p[i] = (float)(i % 7) * 0.125f;  // pages touched
  return p;
}

// One thread's FMA chains: CHAINS independent accumulators, each acc = acc * m + a.
static void fma_chains(long iterations) {
  vec acc[CHAINS];
  const vec m = VSET(0.9999999f), a = VSET(1e-7f);
  for (int j = 0; j < CHAINS; j++) acc[j] = VSET((float)j);
  for (long i = 0; i < iterations; i++) {
#pragma GCC unroll 16
    for (int j = 0; j < CHAINS; j++) acc[j] = VFMA(acc[j], m, a);
  }
  float out[LANES] __attribute__((aligned(64)));
  vec total = acc[0];
  for (int j = 1; j < CHAINS; j++) total = VADD(total, acc[j]);
  VSTORE(out, total);
  sink = out[0];
}

// The best of `trials` of `body` on every thread at once: seconds.
#define BEST_OF(trials, body)                                 \
  double best = 1e30;                                         \
  for (int trial = 0; trial < (trials); trial++) {            \
    double start = omp_get_wtime();                           \
    _Pragma("omp parallel") { body; }                         \
    double took = omp_get_wtime() - start;                    \
    if (took < best) best = took;                             \
  }

static void run_fma(int threads) {
  const long iterations = 20000000;  // about 0.1 s a trial
  omp_set_num_threads(threads);
  BEST_OF(9, fma_chains(iterations));
  double flop = threads * 2.0 * LANES * CHAINS * (double)iterations;
  printf("{\"what\": \"fma\", \"threads\": %d, \"isa\": \"%s\", \"chains\": %d, \"gflops\": %.2f}\n", threads, ISA,
         CHAINS, flop / best / 1e9);
}

// Sums a buffer with 8 vector accumulators: loads only, the adds' latency hidden.
static void read_sum(const float* p, size_t n) {
  vec s[8];
  for (int j = 0; j < 8; j++) s[j] = VSET(0.0f);
  for (size_t i = 0; i + 8 * LANES <= n; i += 8 * LANES) {
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++) s[j] = VADD(s[j], VLOAD(p + i + j * LANES));
  }
  for (int j = 1; j < 8; j++) s[0] = VADD(s[0], s[j]);
  float out[LANES] __attribute__((aligned(64)));
  VSTORE(out, s[0]);
  sink = out[0];
}

static void run_read(size_t bytes, int threads) {
  omp_set_num_threads(threads);
  size_t n = bytes / sizeof(float) / (8 * LANES) * (8 * LANES);
  long sweeps = (long)(4e8 / (n * sizeof(float))) + 1;  // about 0.4 GB a thread a trial
  float* mine[256];
#pragma omp parallel
  mine[omp_get_thread_num()] = buffer(n * sizeof(float));
  BEST_OF(11, for (long r = 0; r < sweeps; r++) read_sum(mine[omp_get_thread_num()], n));
  printf("{\"what\": \"read\", \"bytes\": %zu, \"threads\": %d, \"gbs\": %.2f}\n", bytes, threads,
         (double)threads * sweeps * n * sizeof(float) / best / 1e9);
}

static void update(float* y, const float* x, size_t n) {
  const vec a = VSET(1e-3f);
  for (size_t i = 0; i + LANES <= n; i += LANES) VSTORE(y + i, VFMA(a, VLOAD(x + i), VLOAD(y + i)));
}

static void run_update(size_t bytes, int threads) {
  omp_set_num_threads(threads);
  size_t n = bytes / 2 / sizeof(float) / LANES * LANES;  // x and y share the BYTES
  long sweeps = (long)(4e8 / (2 * n * sizeof(float))) + 1;
  float* xs[256];
  float* ys[256];
#pragma omp parallel
  {
    xs[omp_get_thread_num()] = buffer(n * sizeof(float));
    ys[omp_get_thread_num()] = buffer(n * sizeof(float));
  }
  BEST_OF(11, for (long r = 0; r < sweeps; r++) update(ys[omp_get_thread_num()], xs[omp_get_thread_num()], n));
  // 3 floats an element: x and y read, y written
  printf("{\"what\": \"update\", \"bytes\": %zu, \"threads\": %d, \"gbs\": %.2f}\n", bytes, threads,
         (double)threads * sweeps * 3 * n * sizeof(float) / best / 1e9);
}

static void gather_rows(const float* p, const uint32_t* rows, size_t count, int row_floats) {
  vec s[4];
  for (int j = 0; j < 4; j++) s[j] = VSET(0.0f);
  for (size_t i = 0; i < count; i++) {
    const float* r = p + (size_t)rows[i] * row_floats;
    for (int c = 0; c < row_floats; c += LANES) s[(c / LANES) & 3] = VADD(s[(c / LANES) & 3], VLOAD(r + c));
  }
  for (int j = 1; j < 4; j++) s[0] = VADD(s[0], s[j]);
  float out[LANES] __attribute__((aligned(64)));
  VSTORE(out, s[0]);
  sink = out[0];
}

static void run_gather(size_t bytes, int row_bytes, int threads) {
  omp_set_num_threads(threads);
  int row_floats = row_bytes / (int)sizeof(float);
  size_t rows = bytes / row_bytes, count = 4000000;
  float* mine[256];
  uint32_t* picks[256];
#pragma omp parallel
  {
    int t = omp_get_thread_num();
    mine[t] = buffer(rows * row_bytes);
    picks[t] = malloc(count * sizeof(uint32_t));
    uint64_t state = 0x9E3779B97F4A7C15ull * (t + 1);
    for (size_t i = 0; i < count; i++) {  // xorshift64: rows at random
      state ^= state << 13, state ^= state >> 7, state ^= state << 17;
      picks[t][i] = (uint32_t)(state % rows);
    }
  }
  BEST_OF(7, gather_rows(mine[omp_get_thread_num()], picks[omp_get_thread_num()], count, row_floats));
  printf("{\"what\": \"gather\", \"bytes\": %zu, \"row\": %d, \"threads\": %d, \"gbs\": %.2f}\n", bytes, row_bytes,
         threads, (double)threads * count * row_bytes / best / 1e9);
}

static void run_stream(size_t bytes, int threads) {
  omp_set_num_threads(threads);
  size_t n = bytes / sizeof(float);
  float *a = aligned_alloc(64, n * 4), *b = aligned_alloc(64, n * 4), *c = aligned_alloc(64, n * 4);
  if (!a || !b || !c) {
    fprintf(stderr, "error: limits: cannot allocate 3 x %zu bytes\n", bytes);
    exit(1);
  }
#pragma omp parallel for schedule(static)  // first touch by the thread that uses the pages
  for (size_t i = 0; i < n; i++) a[i] = 1.0f, b[i] = 2.0f, c[i] = 0.0f;
  double copy = 1e30, triad = 1e30;
  for (int trial = 0; trial < 7; trial++) {
    double start = omp_get_wtime();
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) c[i] = a[i];
    double mid = omp_get_wtime();
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) a[i] = b[i] + 3.0f * c[i];
    double end = omp_get_wtime();
    if (mid - start < copy) copy = mid - start;
    if (end - mid < triad) triad = end - mid;
  }
  sink = a[n / 2] + c[n / 3];
  // STREAM's counts: copy 2 arrays, triad 3 (the write-allocate reads not counted)
  printf("{\"what\": \"stream\", \"bytes\": %zu, \"threads\": %d, \"copy_gbs\": %.2f, \"triad_gbs\": %.2f}\n", bytes,
         threads, 2.0 * n * 4 / copy / 1e9, 3.0 * n * 4 / triad / 1e9);
}

int main(int argc, char** argv) {
  const char* what = argc > 1 ? argv[1] : "";
  int last = argc > 2 ? atoi(argv[argc - 1]) : 0;  // threads, always last
  if (last < 1 || last > 256) {
    fprintf(stderr, "error: limits: expected a measurement and a thread count (1-256) last, got %d arguments\n",
            argc - 1);
    return 2;
  }
  if (!strcmp(what, "fma")) run_fma(last);
  else if (!strcmp(what, "read") && argc == 4) run_read(strtoull(argv[2], NULL, 10), last);
  else if (!strcmp(what, "update") && argc == 4) run_update(strtoull(argv[2], NULL, 10), last);
  else if (!strcmp(what, "gather") && argc == 5) run_gather(strtoull(argv[2], NULL, 10), atoi(argv[3]), last);
  else if (!strcmp(what, "stream") && argc == 4) run_stream(strtoull(argv[2], NULL, 10), last);
  else {
    fprintf(stderr, "error: limits: unknown measurement %s or wrong arguments\n", what);
    return 2;
  }
  return 0;
}
