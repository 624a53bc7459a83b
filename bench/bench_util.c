/* symkv-bench output: rows with baselines measured in the same run, a table for people and
 * one JSON object (jansson) in the format docs/benchmarks.md gives; statistics; the option
 * helpers the commands share (size lists, a free port). */
#define _GNU_SOURCE
#include "bench.h"

#include <arpa/inet.h>
#include <jansson.h>
#include <math.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
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

/* ---- tables ---------------------------------------------------------------------------------- */

void bench_table(FILE *f, int ncols, const char *const *head, const char *align,
                 const char *const *cells, size_t nrows) {
  size_t w[16] = {0};
  if (ncols > 16) ncols = 16;
  for (int c = 0; c < ncols; c++) w[c] = strlen(head[c]);
  for (size_t r = 0; r < nrows; r++)
    for (int c = 0; c < ncols; c++) w[c] = SKV_MAX(w[c], strlen(cells[r * (size_t)ncols + c]));
  for (size_t r = 0; r <= nrows; r++) {
    const char *const *row = r == 0 ? head : cells + (r - 1) * (size_t)ncols;
    char line[1024];
    size_t o = 0;
    for (int c = 0; c < ncols && o < sizeof line; c++)
      o += (size_t)snprintf(line + o, sizeof line - o, align[c] == 'r' ? "%s%*s" : "%s%-*s",
                            c ? "  " : "", (int)w[c], row[c]);
    while (o > 0 && line[o - 1] == ' ') o--; /* no trailing blanks */
    fprintf(f, "%.*s\n", (int)o, line);
  }
}

void bench_wrap(FILE *f, const char *text, int width, int indent) {
  const char *p = text;
  int col = 0;
  while (*p) {
    size_t n = strcspn(p, " ");
    if (col > 0 && col + 1 + (int)n > width) {
      fprintf(f, "\n%*s", indent, "");
      col = indent;
    } else if (col > 0) {
      fputc(' ', f);
      col++;
    }
    fprintf(f, "%.*s", (int)n, p);
    col += (int)n;
    p += n;
    while (*p == ' ') p++;
  }
  fputc('\n', f);
}

static void fmt_value(double v, char *buf, size_t cap) {
  if (!isfinite(v))
    snprintf(buf, cap, "-");
  else
    snprintf(buf, cap, "%.4g", v);
}

/* The results table: a row per measurement; a baseline's name once, in the key under it. */
static void print_rows(bench_t *b) {
  enum { NC = 7 };
  static const char *const head[NC] = {"name",     "value", "unit", "better",
                                       "baseline", "ratio", "vs"};
  char(*txt)[NC][136] = calloc(b->nrows ? b->nrows : 1, sizeof *txt);
  const char **cells = calloc((b->nrows ? b->nrows : 1) * NC, sizeof *cells);
  const char *keys[52];
  int nkeys = 0;
  for (size_t i = 0; i < b->nrows; i++) {
    bench_row_t *r = &b->rows[i];
    snprintf(txt[i][0], 136, "%s", r->name);
    fmt_value(r->value, txt[i][1], 48);
    snprintf(txt[i][2], 136, "%s", r->unit);
    snprintf(txt[i][3], 136, "%s", r->better);
    snprintf(txt[i][4], 136, "-");
    snprintf(txt[i][5], 136, "-");
    txt[i][6][0] = '\0';
    if (r->baseline >= 0) {
      fmt_value(r->baseline, txt[i][4], 48);
      if (r->baseline > 0 && isfinite(r->value))
        snprintf(txt[i][5], 136, "%.3f", r->value / r->baseline);
      int k = 0;
      while (k < nkeys && strcmp(keys[k], r->baseline_name) != 0) k++;
      if (k == nkeys && nkeys < 52) keys[nkeys++] = r->baseline_name;
      if (k < 52) snprintf(txt[i][6], 136, "%c", k < 26 ? 'a' + k : 'A' + k - 26);
    }
    for (int c = 0; c < NC; c++) cells[i * NC + c] = txt[i][c];
  }
  bench_table(stdout, NC, head, "lrllrrl", cells, b->nrows);
  if (nkeys) {
    printf("vs: the baseline, measured in this run; ratio = value / baseline\n");
    for (int k = 0; k < nkeys; k++) printf("  %c  %s\n", k < 26 ? 'a' + k : 'A' + k - 26, keys[k]);
  }
  printf("better: the direction in which a value (and its ratio) is better\n");
  free(txt);
  free(cells);
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
    print_rows(b);
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

int bench_parse_list(const char *s, uint64_t *out, int cap, int *n) {
  *n = 0;
  while (s && *s && *n < cap) {
    char *end;
    unsigned long long v = strtoull(s, &end, 10);
    if (end == s) return -1;
    if (*end == 'K' || *end == 'k')
      v <<= 10, end++;
    else if (*end == 'M' || *end == 'm')
      v <<= 20, end++;
    else if (*end == 'G' || *end == 'g')
      v <<= 30, end++;
    out[(*n)++] = v;
    s = *end == ',' ? end + 1 : end;
    if (*end && *end != ',') return -1;
  }
  return 0;
}

int bench_free_port(void) {
  int fd = socket(AF_INET, SOCK_STREAM, 0), port = 0;
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t len = sizeof a;
  if (fd >= 0 && bind(fd, (struct sockaddr *)&a, sizeof a) == 0 &&
      getsockname(fd, (struct sockaddr *)&a, &len) == 0)
    port = ntohs(a.sin_port);
  if (fd >= 0) close(fd);
  return port;
}
