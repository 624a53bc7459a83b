/* symkv-bench: the benchmark driver. Each command measures its baselines in the same run and
 * prints a table, or with --json one object in the format of docs/benchmarks.md. */
#define _GNU_SOURCE
#include "bench.h"

#include <stdio.h>
#include <unistd.h>
#include <stdlib.h>
#include <string.h>

static const bench_cmd_t *const commands[] = {
    &bench_cmd_heap,      &bench_cmd_micro,   &bench_cmd_fetch,
    &bench_cmd_trace,     &bench_cmd_longdoc, &bench_cmd_multiround,
    &bench_cmd_allreduce, &bench_cmd_domain,  &bench_cmd_cluster,
};

static void usage(FILE *f) {
  fprintf(f, "usage: symkv-bench COMMAND [options]    (symkv-bench COMMAND --help: its options)\n"
             "Run under symkv-run for N PEs (symkv-run -n 4 --prefix others -- symkv-bench heap);\n"
             "alone it runs as a 1-PE job. Every command measures its baselines in the same run\n"
             "and prints one table (docs/benchmarks.md), or with --json one JSON object.\n\n"
             "commands:\n");
  for (size_t i = 0; i < SKV_ARRAY_LEN(commands); i++)
    fprintf(f, "  %-11s %s\n", commands[i]->name, commands[i]->summary);
}

/* Outside symkv-run, run as a single PE with a private store. */
static void default_single_pe(void) {
  if (getenv("SKV_RANK") || getenv("SKV_BOOTSTRAP")) return;
  setenv("SKV_RANK", "0", 1);
  setenv("SKV_WORLD_SIZE", "1", 1);
  char tok[40];
  uint8_t r[16];
  skv__random_bytes(r, sizeof r);
  for (int i = 0; i < 16; i++) snprintf(tok + 2 * i, 3, "%02x", r[i]);
  setenv("SKV_TOKEN", tok, 1);
  /* a free loopback port for the private store */
  int port = bench_free_port();
  char addr[64];
  snprintf(addr, sizeof addr, "tcp://127.0.0.1:%d", port ? port : 29517);
  setenv("SKV_BOOTSTRAP", addr, 1);
}

int main(int argc, char **argv) {
  const char *r = getenv("SKV_RANK");
  bool rank0 = !r || !*r || strcmp(r, "0") == 0; /* messages about the command line: rank 0 */
  if (argc < 2 || strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0) {
    if (rank0) usage(argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  const bench_cmd_t *cmd = NULL;
  for (size_t i = 0; i < SKV_ARRAY_LEN(commands); i++)
    if (strcmp(argv[1], commands[i]->name) == 0) cmd = commands[i];
  if (!cmd) {
    if (rank0) {
      fprintf(stderr, "symkv-bench: unknown command '%s'\n\n", argv[1]);
      usage(stderr);
    } else {
      sleep(2); /* rank 0 prints it and exits first (bench_exit_after_rank0) */
    }
    return 2;
  }
  static bench_t b;
  size_t o = 0;
  for (int i = 0; i < argc && o + 2 < sizeof b.command; i++)
    o += (size_t)snprintf(b.command + o, sizeof b.command - o, "%s%s", i ? " " : "", argv[i]);
  bench_parse(&b, cmd, argc - 1, argv + 1);
  default_single_pe();
  int rc = cmd->run(&b);
  if (rc != 0) {
    /* A PE that stops because another one failed says nothing: that one's message says why
     * (symkv-run names a PE that died without one). */
    if (!b.failed_elsewhere)
      fprintf(stderr, "symkv-bench %s failed: %s\n", cmd->name,
              skv_last_error()[0] ? skv_last_error() : skv_strerror(rc));
    else
      bench_exit_after_rank0(&b, 1);
    return 1;
  }
  return 0;
}
