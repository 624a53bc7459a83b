/* spin_probe: a thread pinned to one CPU running `pause` for a while, as a helper spinning for
 * work does (bench/results/cpu_spin_probe_nvidia-h200.txt).
 *
 *   symkv-spin-probe CPU SECONDS */
#define _GNU_SOURCE
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

int main(int argc, char **argv) {
  if (argc != 3) {
    fprintf(stderr, "usage: symkv-spin-probe CPU SECONDS\n");
    return 2;
  }
  const int cpu = atoi(argv[1]);
  const double secs = atof(argv[2]);
  cpu_set_t s;
  CPU_ZERO(&s);
  CPU_SET(cpu, &s);
  if (sched_setaffinity(0, sizeof s, &s) != 0) {
    perror("sched_setaffinity");
    return 1;
  }
  struct timespec t0, t;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  for (unsigned long i = 0;; i++) {
    __builtin_ia32_pause();
    if ((i & 4095) != 0) continue;
    clock_gettime(CLOCK_MONOTONIC, &t);
    if ((double)(t.tv_sec - t0.tv_sec) + (double)(t.tv_nsec - t0.tv_nsec) * 1e-9 > secs) break;
  }
  return 0;
}
