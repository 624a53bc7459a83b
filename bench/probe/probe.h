/* What the host probes of bench/probe share: a monotonic clock, a seeded random stream and a
 * comparison for qsort of timings. */
#ifndef SKV_BENCH_PROBE_H
#define SKV_BENCH_PROBE_H

#include <stdint.h>
#include <time.h>

/* Seconds, monotonic. */
static inline double probe_now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* splitmix64: the next number of the stream whose state is *s. */
static inline uint64_t probe_rand(uint64_t *s) {
  uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

/* qsort's comparison of doubles, ascending. */
static inline int probe_cmp_double(const void *a, const void *b) {
  const double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

#endif
