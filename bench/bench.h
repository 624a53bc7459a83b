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

/* One option of a command (bench_opts.c parses them with getopt_long). */
typedef enum bench_opt_kind {
  BENCH_FLAG,   /* no value */
  BENCH_INT,    /* an integer in [lo, hi], K/M/G/T suffixes allowed */
  BENCH_REAL,   /* a number in [lo, hi] */
  BENCH_STR,    /* any text (the command checks it) */
  BENCH_CHOICE, /* one of the comma-separated words in `choices` */
  BENCH_LIST,   /* a comma list of integers in [lo, hi] (suffixes allowed) */
} bench_opt_kind_t;

typedef struct bench_optspec {
  const char *name; /* "--bytes" */
  bench_opt_kind_t kind;
  const char *arg;  /* the value's name in the help ("N"), NULL for flags */
  const char *def;  /* the default, as the help shows it (NULL: none) */
  const char *help; /* one line */
  double lo, hi;    /* BENCH_INT, BENCH_REAL, BENCH_LIST (0, 0: non-negative, any size) */
  const char *choices;
} bench_optspec_t;
#define BENCH_OPTS_END \
  { NULL, BENCH_FLAG, NULL, NULL, NULL, 0, 0, NULL }

#define BENCH_MAX_OPTS 64

typedef struct bench {
  const char *cmd;    /* "heap", "micro", ... */
  char command[1024]; /* the command line, as run */
  int rank;           /* SKV_RANK (0 when unset): messages about the command line on rank 0 only */
  const bench_optspec_t *specs[BENCH_MAX_OPTS]; /* the common options, then the command's */
  const char *vals[BENCH_MAX_OPTS];             /* given values ("" for a flag), NULL if not */
  int nspecs;
  const char *pos[4]; /* positional arguments */
  int npos;
  bool json;            /* --json: the JSON object on stdout instead of the table */
  const char *json_out; /* --json-out FILE: the JSON object into FILE as well */
  bool quiet;
  double progress_every; /* seconds between progress lines when not on a terminal */
  bool failed_elsewhere; /* this PE stopped because another one failed, which says why */
  void *config;          /* json_t * object of the command's settings */
  bench_row_t *rows;
  size_t nrows, cap;
} bench_t;

/* A command: its entry point, a one-line summary, what follows its name, its options. */
typedef struct bench_cmd {
  const char *name;
  int (*run)(bench_t *b);
  const char *summary;
  const char *positional; /* "FILE" or NULL */
  int max_pos;
  const bench_optspec_t *opts, *opts2; /* opts2: a second table (shared by commands), or NULL */
  const char *more;                    /* a paragraph for --help, or NULL */
} bench_cmd_t;

/* Parse argv (argv[0] is the command's name) with getopt_long into b. Returns 0, or exits: 0
 * after --help, 2 with a message on an unknown option, a missing value, a bad value or an
 * unexpected argument. Messages go to stderr on rank 0 only (every rank exits the same). */
void bench_parse(bench_t *b, const bench_cmd_t *cmd, int argc, char **argv);
/* Exit with `status`; a PE other than rank 0 waits 2 s first, so that rank 0, which prints the
 * message (the same on every PE), exits first: symkv-run then stops the others and reports
 * rank 0's status, and a PE that exits early never stops rank 0 before it has printed. */
_Noreturn void bench_exit_after_rank0(const bench_t *b, int status);
/* A usage error found by a command after parsing: the message on rank 0, exit 2. */
_Noreturn void bench_usage_error(const bench_t *b, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* Add a row; baseline < 0 means none. Returns the row. */
bench_row_t *bench_row(bench_t *b, const char *name, double value, const char *unit,
                       const char *better, const char *baseline_name, double baseline);
void bench_config_str(bench_t *b, const char *key, const char *val);
void bench_config_int(bench_t *b, const char *key, long long val);
void bench_config_real(bench_t *b, const char *key, double val);
/* Print the table (or JSON) and write --json-out. */
int bench_report(bench_t *b);
/* One table format for every table: `ncols` columns two blanks apart, each as wide as its
 * widest cell, `align` 'l' or 'r' per column; cells row after row. */
void bench_table(FILE *f, int ncols, const char *const *head, const char *align,
                 const char *const *cells, size_t nrows);
/* Print `text` wrapped at blanks to `width` columns, continuation lines indented. */
void bench_wrap(FILE *f, const char *text, int width, int indent);

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
/* A comma list of counts or sizes with an optional K, M or G suffix ("64K,1M"): up to `cap`
 * into out, *n of them; -1 on anything else. */
int bench_parse_list(const char *s, uint64_t *out, int cap, int *n);
/* A loopback TCP port free at the time of the call (0 if none could be had). */
int bench_free_port(void);
/* The parsed options (bench_parse checked every value against its kind): the value of
 * `name` or NULL when not given; a flag given; the value as a number, or `def`. Asking for an
 * option the command did not declare aborts (a programming error). */
const char *bench_opt(const bench_t *b, const char *name);
bool bench_flag(const bench_t *b, const char *name);
long long bench_opt_int(const bench_t *b, const char *name, long long def);
double bench_opt_real(const bench_t *b, const char *name, double def);
/* Progress of rank 0 (bench_progress.c): a bar on its terminal (or the launcher's), else a
 * line every --progress-every seconds on stderr; nothing with --quiet. `extra` (may be NULL)
 * follows the figures ("block hits: shared 0.612 per_pe 0.351"). */
void bench_progress(bench_t *b, const char *what, double done, double total);
void bench_progress_x(bench_t *b, const char *what, double done, double total, const char *unit,
                      const char *extra, bool force);
/* Whether a progress call now would draw (to skip formatting `extra` otherwise). */
bool bench_progress_due(bench_t *b);
void bench_progress_end(bench_t *b);

/* The commands, each with its options next to its code. */
extern const bench_cmd_t bench_cmd_heap, bench_cmd_micro;
/* GPU fetch bandwidth and latency vs the copy engine (bench_fetch.c). */
extern const bench_cmd_t bench_cmd_fetch;
/* Workloads (bench_workload.c, docs/workloads.md): trace replay and synthetic long-context. */
extern const bench_cmd_t bench_cmd_trace, bench_cmd_longdoc, bench_cmd_multiround;
/* All-reduce latency in CUDA graphs vs NCCL, crossovers, barrier, signals (bench_allreduce.c). */
extern const bench_cmd_t bench_cmd_allreduce;
/* The elastic domain: attach/detach latency, data path vs collective, trace replay with churn
 * (bench_domain.c). */
extern const bench_cmd_t bench_cmd_domain;
/* Across nodes: remote fetch over UCX vs ucx_perftest, lookups with the Redis directory
 * (bench_cluster.c). */
extern const bench_cmd_t bench_cmd_cluster;

#endif
