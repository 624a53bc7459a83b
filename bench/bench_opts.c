/* symkv-bench options: one getopt_long parser for every command, values checked against their
 * kind before the command runs, --help from the same tables. */
#define _GNU_SOURCE
#include "bench.h"

#include <getopt.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* Options every command takes. */
static const bench_optspec_t common_opts[] = {
    {"--json", BENCH_FLAG, NULL, NULL,
     "print the JSON object (docs/benchmarks.md) instead of the table", 0, 0, NULL},
    {"--json-out", BENCH_STR, "FILE", NULL, "write the JSON object to FILE as well", 0, 0, NULL},
    {"--quiet", BENCH_FLAG, NULL, NULL, "no progress", 0, 0, NULL},
    {"--progress-every", BENCH_REAL, "S", "5",
     "seconds between progress lines when stderr is not a terminal", 0.1, 86400, NULL},
    {"--help", BENCH_FLAG, NULL, NULL, "print this help and exit", 0, 0, NULL},
    BENCH_OPTS_END,
};

static bool on_rank0(const bench_t *b) {
  return b->rank == 0;
}

_Noreturn void bench_exit_after_rank0(const bench_t *b, int status) {
  if (!on_rank0(b)) {
    struct timespec ts = {2, 0};
    nanosleep(&ts, NULL);
  }
  exit(status);
}

_Noreturn void bench_usage_error(const bench_t *b, const char *fmt, ...) {
  if (on_rank0(b)) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "symkv-bench %s: ", b->cmd);
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, " (symkv-bench %s --help lists the options)\n", b->cmd);
    va_end(ap);
  }
  bench_exit_after_rank0(b, 2);
}

static void print_opts(FILE *f, const bench_optspec_t *o) {
  for (; o->name; o++) {
    char left[64];
    snprintf(left, sizeof left, "%s%s%s", o->name, o->arg ? " " : "", o->arg ? o->arg : "");
    fprintf(f, "  %-24s %s", left, o->help);
    if (o->kind == BENCH_CHOICE && o->choices) fprintf(f, ": %s", o->choices);
    if (o->def) fprintf(f, " (%s)", o->def);
    fputc('\n', f);
  }
}

static void help(const bench_cmd_t *cmd) {
  printf("usage: symkv-bench %s%s%s [options]\n%s\n", cmd->name, cmd->positional ? " " : "",
         cmd->positional ? cmd->positional : "", cmd->summary);
  if (cmd->more) printf("%s\n", cmd->more);
  printf("\noptions:\n");
  print_opts(stdout, cmd->opts);
  if (cmd->opts2) print_opts(stdout, cmd->opts2);
  printf("\nevery command:\n");
  print_opts(stdout, common_opts);
  printf("\nRun under symkv-run for N PEs (symkv-run -n 4 --prefix others -- symkv-bench %s ...);\n"
         "alone it runs as one PE. docs/benchmarks.md explains the table; exit status 2 on a\n"
         "usage error, 1 when the run fails.\n",
         cmd->name);
}

static bool in_choices(const char *v, const char *choices) {
  size_t n = strlen(v);
  for (const char *c = choices; c && *c;) {
    const char *e = strchr(c, ',');
    size_t len = e ? (size_t)(e - c) : strlen(c);
    if (len == n && strncmp(c, v, n) == 0) return true;
    c = e ? e + 1 : NULL;
  }
  return false;
}

static bool int_ok(const bench_optspec_t *o, const char *v) {
  long long lo = (long long)o->lo, hi = o->hi > 0 ? (long long)o->hi : 1ll << 50, x;
  return skv__parse_int(v, lo, hi, true, &x);
}

/* Check a value against the option's kind; exits 2 with what was wrong. */
static void check_value(const bench_t *b, const bench_optspec_t *o, const char *v) {
  char range[96] = "";
  if (o->hi > 0) snprintf(range, sizeof range, " in %.15g..%.15g", o->lo, o->hi);
  switch (o->kind) {
  case BENCH_INT:
    if (!int_ok(o, v))
      bench_usage_error(b, "%s %s: want an integer%s (suffixes K, M, G allowed)", o->name, v,
                        range[0] ? range : " >= 0");
    break;
  case BENCH_REAL: {
    char *end;
    double x = strtod(v, &end);
    if (!*v || *end || !isfinite(x) || x < o->lo || (o->hi > 0 && x > o->hi))
      bench_usage_error(b, "%s %s: want a number%s", o->name, v, range[0] ? range : " >= 0");
    break;
  }
  case BENCH_CHOICE:
    if (!in_choices(v, o->choices))
      bench_usage_error(b, "%s %s: want one of %s", o->name, v, o->choices);
    break;
  case BENCH_LIST: {
    char tmp[512];
    snprintf(tmp, sizeof tmp, "%s", v);
    int n = 0;
    for (char *save = NULL, *t = strtok_r(tmp, ",", &save); t; t = strtok_r(NULL, ",", &save), n++)
      if (!int_ok(o, t))
        bench_usage_error(b, "%s %s: '%s' is not an integer%s (suffixes K, M, G allowed)", o->name,
                          v, t, range[0] ? range : " >= 0");
    if (n == 0 || strlen(v) >= sizeof tmp)
      bench_usage_error(b, "%s %s: want a comma list of sizes", o->name, v);
    break;
  }
  case BENCH_STR:
    if (!*v) bench_usage_error(b, "%s needs a value", o->name);
    break;
  case BENCH_FLAG:
    break;
  }
}

void bench_parse(bench_t *b, const bench_cmd_t *cmd, int argc, char **argv) {
  const char *r = getenv("SKV_RANK");
  b->rank = r && *r ? atoi(r) : 0;
  b->cmd = cmd->name;
  b->nspecs = 0;
  for (const bench_optspec_t *o = common_opts; o->name; o++) b->specs[b->nspecs++] = o;
  for (int t = 0; t < 2; t++)
    for (const bench_optspec_t *o = t ? cmd->opts2 : cmd->opts; o && o->name; o++) {
      if (b->nspecs >= BENCH_MAX_OPTS) abort();
      b->specs[b->nspecs++] = o;
    }
  struct option lo[BENCH_MAX_OPTS + 1];
  for (int i = 0; i < b->nspecs; i++)
    lo[i] = (struct option){b->specs[i]->name + 2,
                            b->specs[i]->kind == BENCH_FLAG ? no_argument : required_argument, NULL,
                            1000 + i};
  lo[b->nspecs] = (struct option){NULL, 0, NULL, 0};
  opterr = 0;
  optind = 1;
  for (;;) {
    int li = -1, c = getopt_long(argc, argv, ":h", lo, &li);
    if (c == -1) break;
    if (c == 'h') {
      if (on_rank0(b)) help(cmd);
      exit(0);
    }
    const char *text = argv[optind - 1];
    if (c == ':') { /* a value is missing */
      bench_usage_error(b, "%s needs a value", text);
    } else if (c == '?') {
      char name[64];
      snprintf(name, sizeof name, "%.*s", (int)strcspn(text, "="), text);
      for (int i = 0; i < b->nspecs; i++)
        if (strcmp(name, b->specs[i]->name) == 0 && b->specs[i]->kind == BENCH_FLAG)
          bench_usage_error(b, "%s takes no value", name);
      bench_usage_error(b, "unknown option '%s'", name);
    }
    int i = c - 1000;
    const bench_optspec_t *o = b->specs[i];
    /* getopt_long takes unique abbreviations ("--byt" for --bytes): symkv-bench does not, so
     * that a misspelt option never stands for another one. */
    if (optarg && optarg == argv[optind - 1]) text = argv[optind - 2];
    size_t len = strcspn(text, "=");
    if (len != strlen(o->name) || strncmp(text, o->name, len) != 0)
      bench_usage_error(b, "unknown option '%.*s' (did you mean %s?)", (int)len, text, o->name);
    const char *v = o->kind == BENCH_FLAG ? "" : optarg;
    check_value(b, o, v);
    b->vals[i] = v;
  }
  if (bench_flag(b, "--help")) {
    if (on_rank0(b)) help(cmd);
    exit(0);
  }
  for (int i = optind; i < argc; i++) {
    if (b->npos >= cmd->max_pos || b->npos >= (int)SKV_ARRAY_LEN(b->pos))
      bench_usage_error(b, "unexpected argument '%s'", argv[i]);
    b->pos[b->npos++] = argv[i];
  }
  b->json = bench_flag(b, "--json");
  b->json_out = bench_opt(b, "--json-out");
  b->quiet = bench_flag(b, "--quiet");
  b->progress_every = bench_opt_real(b, "--progress-every", 5);
}

static int find(const bench_t *b, const char *name) {
  for (int i = 0; i < b->nspecs; i++)
    if (strcmp(b->specs[i]->name, name) == 0) return i;
  fprintf(stderr, "symkv-bench %s: option %s is read but not declared (a bug)\n", b->cmd, name);
  abort();
}

const char *bench_opt(const bench_t *b, const char *name) {
  return b->vals[find(b, name)];
}

bool bench_flag(const bench_t *b, const char *name) {
  return b->vals[find(b, name)] != NULL;
}

long long bench_opt_int(const bench_t *b, const char *name, long long def) {
  const char *v = bench_opt(b, name);
  long long x;
  if (!v) return def;
  if (!skv__parse_int(v, LLONG_MIN, LLONG_MAX, true, &x)) abort(); /* checked by bench_parse */
  return x;
}

double bench_opt_real(const bench_t *b, const char *name, double def) {
  const char *v = bench_opt(b, name);
  return v ? strtod(v, NULL) : def;
}
