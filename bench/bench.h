/* symkv-bench internals: result rows with in-run baselines, the table and the JSON object of
 * DESIGN.md, timing helpers, and the commands' entry points. */
#ifndef SKV_BENCH_H
#define SKV_BENCH_H

#include "core/core.h"

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

typedef struct bench_row {
  char name[128];
  double value;
  char unit[16];
  char better[8]; /* "higher" or "lower" */
  char baseline_name[96];
  double baseline; /* < 0: none */
} bench_row_t;

typedef struct bench {
  const char *cmd;    /* "heap", "micro", ... */
  char command[1024]; /* the command line, as run */
  int argc;
  char **argv;
  bool json;            /* --json: the JSON object on stdout instead of the table */
  const char *json_out; /* --json-out FILE: the JSON object into FILE as well */
  bool quiet;
  void *config; /* json_t * object of the command's settings */
  bench_row_t *rows;
  size_t nrows, cap;
} bench_t;

/* Add a row; baseline < 0 means none. Returns the row. */
bench_row_t *bench_row(bench_t *b, const char *name, double value, const char *unit,
                       const char *better, const char *baseline_name, double baseline);
void bench_config_str(bench_t *b, const char *key, const char *val);
void bench_config_int(bench_t *b, const char *key, long long val);
void bench_config_real(bench_t *b, const char *key, double val);
/* Print the table (or JSON) and write --json-out. */
int bench_report(bench_t *b);

/* Wall-clock seconds (monotonic). */
static inline double bench_now(void) {
  return (double)skv__now_ns() * 1e-9;
}
/* splitmix64 */
static inline uint64_t bench_rand(uint64_t *s) {
  uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
/* Median of n doubles (sorts in place). */
double bench_median(double *v, size_t n);
double bench_percentile(double *v, size_t n, double p);
/* Option parsing helpers: "--name VALUE" or "--name=VALUE"; removes nothing. */
const char *bench_opt(bench_t *b, const char *name);
bool bench_flag(bench_t *b, const char *name);
long long bench_opt_int(bench_t *b, const char *name, long long def);
double bench_opt_real(bench_t *b, const char *name, double def);
/* Progress on a terminal (stderr), rate-limited; nothing when not a tty or quiet. */
void bench_progress(bench_t *b, const char *what, double done, double total);
void bench_progress_end(bench_t *b);

int bench_heap(bench_t *b);
int bench_micro(bench_t *b);
/* GPU fetch bandwidth and latency vs the copy engine (bench_fetch.c). */
int bench_fetch(bench_t *b);
/* Workloads (bench_workload.c, docs/workloads.md): trace replay and synthetic long-context. */
int bench_trace(bench_t *b);
int bench_longdoc(bench_t *b);
int bench_multiround(bench_t *b);
/* All-reduce latency in CUDA graphs vs NCCL, crossovers, barrier, signals (bench_allreduce.c). */
int bench_allreduce(bench_t *b);

#endif
