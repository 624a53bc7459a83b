/* symkv-bench output: rows with baselines measured in the same run, a table for people and
 * one JSON object (jansson) in the format DESIGN.md gives; options, statistics, progress. */
#define _GNU_SOURCE
#include "bench.h"

#include <jansson.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

bench_row_t *bench_row(bench_t *b, const char *name, double value, const char *unit,
                       const char *better, const char *baseline_name, double baseline) {
  if (b->nrows == b->cap) {
    b->cap = b->cap ? 2 * b->cap : 32;
    b->rows = realloc(b->rows, b->cap * sizeof *b->rows);
  }
  bench_row_t *r = &b->rows[b->nrows++];
  memset(r, 0, sizeof *r);
  snprintf(r->name, sizeof r->name, "%s", name);
  r->value = value;
  snprintf(r->unit, sizeof r->unit, "%s", unit);
  snprintf(r->better, sizeof r->better, "%s", better);
  snprintf(r->baseline_name, sizeof r->baseline_name, "%s", baseline_name ? baseline_name : "");
  r->baseline = baseline_name ? baseline : -1;
  return r;
}

static json_t *config_obj(bench_t *b) {
  if (!b->config) b->config = json_object();
  return b->config;
}
void bench_config_str(bench_t *b, const char *key, const char *val) {
  json_object_set_new(config_obj(b), key, json_string(val));
}
void bench_config_int(bench_t *b, const char *key, long long val) {
  json_object_set_new(config_obj(b), key, json_integer(val));
}
void bench_config_real(bench_t *b, const char *key, double val) {
  json_object_set_new(config_obj(b), key, json_real(val));
}

static json_t *to_json(bench_t *b) {
  char date[64];
  time_t t = time(NULL);
  strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", gmtime(&t));
  json_t *o = json_object();
  json_object_set_new(o, "bench", json_string(b->cmd));
  json_object_set_new(o, "host", json_string(skv__hostname()));
  json_object_set_new(o, "date", json_string(date));
  json_object_set_new(o, "command", json_string(b->command));
  json_object_set(o, "config", config_obj(b));
  json_t *rows = json_array();
  for (size_t i = 0; i < b->nrows; i++) {
    bench_row_t *r = &b->rows[i];
    json_t *jr = json_object();
    json_object_set_new(jr, "name", json_string(r->name));
    json_object_set_new(jr, "value", isfinite(r->value) ? json_real(r->value) : json_null());
    json_object_set_new(jr, "unit", json_string(r->unit));
    json_object_set_new(jr, "better", json_string(r->better));
    if (r->baseline >= 0) {
      json_object_set_new(jr, "baseline_name", json_string(r->baseline_name));
      json_object_set_new(jr, "baseline", json_real(r->baseline));
      json_object_set_new(jr, "ratio",
                          r->baseline > 0 ? json_real(r->value / r->baseline) : json_null());
    }
    json_array_append_new(rows, jr);
  }
  json_object_set_new(o, "rows", rows);
  return o;
}

int bench_report(bench_t *b) {
  json_t *o = to_json(b);
  int rc = 0;
  if (b->json_out) {
    if (json_dump_file(o, b->json_out, JSON_INDENT(1) | JSON_REAL_PRECISION(10)) != 0) {
      fprintf(stderr, "symkv-bench: cannot write %s\n", b->json_out);
      rc = 1;
    }
  }
  if (b->json) {
    json_dumpf(o, stdout, JSON_COMPACT | JSON_REAL_PRECISION(10));
    fputc('\n', stdout);
  } else {
    printf("%-40s %14s %-6s  %-34s %14s %8s\n", "name", "value", "unit", "baseline", "baseline",
           "ratio");
    for (size_t i = 0; i < b->nrows; i++) {
      bench_row_t *r = &b->rows[i];
      if (r->baseline >= 0)
        printf("%-40s %14.4g %-6s  %-34s %14.4g %8.3f\n", r->name, r->value, r->unit,
               r->baseline_name, r->baseline, r->baseline > 0 ? r->value / r->baseline : NAN);
      else
        printf("%-40s %14.4g %-6s\n", r->name, r->value, r->unit);
    }
    printf("(ratio = value / baseline; every baseline was measured in this run)\n");
  }
  fflush(stdout);
  json_decref(o);
  return rc;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

double bench_percentile(double *v, size_t n, double p) {
  if (n == 0) return NAN;
  qsort(v, n, sizeof *v, cmp_double);
  double idx = p * (double)(n - 1);
  size_t lo = (size_t)idx;
  if (lo + 1 >= n) return v[n - 1];
  double f = idx - (double)lo;
  return v[lo] * (1 - f) + v[lo + 1] * f;
}

double bench_median(double *v, size_t n) {
  return bench_percentile(v, n, 0.5);
}

const char *bench_opt(bench_t *b, const char *name) {
  size_t n = strlen(name);
  for (int i = 0; i < b->argc; i++) {
    const char *a = b->argv[i];
    if (strncmp(a, name, n) == 0) {
      if (a[n] == '=') return a + n + 1;
      if (a[n] == '\0' && i + 1 < b->argc) return b->argv[i + 1];
    }
  }
  return NULL;
}

bool bench_flag(bench_t *b, const char *name) {
  for (int i = 0; i < b->argc; i++)
    if (strcmp(b->argv[i], name) == 0) return true;
  return false;
}

long long bench_opt_int(bench_t *b, const char *name, long long def) {
  const char *v = bench_opt(b, name);
  long long x;
  if (!v) return def;
  if (!skv__parse_int(v, 0, 1LL << 50, true, &x)) {
    fprintf(stderr, "symkv-bench: %s %s is not a non-negative integer (suffixes K, M, G allowed)\n",
            name, v);
    exit(2);
  }
  return x;
}

double bench_opt_real(bench_t *b, const char *name, double def) {
  const char *v = bench_opt(b, name);
  if (!v) return def;
  char *end;
  double x = strtod(v, &end);
  if (*end || !(x >= 0)) {
    fprintf(stderr, "symkv-bench: %s %s is not a non-negative number\n", name, v);
    exit(2);
  }
  return x;
}

static double last_progress;

void bench_progress(bench_t *b, const char *what, double done, double total) {
  if (b->quiet || !isatty(2)) return;
  double now = bench_now();
  if (now - last_progress < 0.1 && done < total) return;
  last_progress = now;
  int width = 30, fill = total > 0 ? (int)(width * done / total) : 0;
  if (fill > width) fill = width;
  fprintf(stderr, "\r%-16s [%.*s%*s] %5.1f%%", what, fill, "##############################",
          width - fill, "", total > 0 ? 100.0 * done / total : 0.0);
  fflush(stderr);
}

void bench_progress_end(bench_t *b) {
  if (b->quiet || !isatty(2)) return;
  fprintf(stderr, "\r%*s\r", 60, "");
}
