/* symkv-bench: the benchmark driver. Each command measures its baselines in the same run and
 * prints a table, or with --json one object in the format of docs/benchmarks.md. */
#define _GNU_SOURCE
#include "bench.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <sys/socket.h>
#include <unistd.h>
#include <stdlib.h>
#include <string.h>

typedef struct command {
  const char *name;
  int (*run)(bench_t *b);
  const char *help;
} command_t;

static const command_t commands[] = {
    {"heap", bench_heap,
     "each PE's write and read bandwidth into peers' heap segments vs a local memcpy\n"
     "      [--bytes N (64M)] [--reps N (5)] [--backend host]"},
    {"micro", bench_micro,
     "index lookup/insert rates, page alloc/free, host fetch bandwidth vs memcpy\n"
     "      [--keys N (1M)] [--seconds S (1)] [--batch-bytes N (64M)] [--reps N (5)]"},
    {"fetch", bench_fetch,
     "GPU fetch of random peer pages (GB/s) vs the copy engine's contiguous copy, a per-page\n"
     "      cudaMemcpyAsync loop and a local gather; 1 MiB latency; kernel variants\n"
     "      [--quick] [--page-sizes 16K,...,4M] [--batches 1,...,4096] [--max-batch-bytes 1G]\n"
     "      [--reps N (15)] [--layout nhd|hnd|flashinfer] [--no-variants]"},
    {"trace", bench_trace,
     "replay a Mooncake JSONL trace (request i on PE i mod N); policies none, per_pe, shared\n"
     "      FILE [--model tiny|llama-3-8b|llama-3-70b|qwen2.5-32b|deepseek-v3] [--tp N]\n"
     "      [--capacity-pages N|unbounded | --capacity-fraction F] [--ordered | --realtime --speed "
     "X]\n"
     "      [--backend host|cuda|cuda_host] [--prefill-tflops T] [--requests N] [--plot FILE.png]\n"
     "      (docs/workloads.md has every option)"},
    {"longdoc", bench_longdoc,
     "D documents of L tokens queried repeatedly; same policies and options as trace\n"
     "      [--docs 16] [--doc-tokens 32768] [--repeats 4] [--order random|tile|interleave]\n"
     "      [--question-tokens 64]"},
    {"multiround", bench_multiround,
     "U users x R rounds of a conversation with growing histories; same policies and options\n"
     "      [--users 10] [--rounds 8] [--system-tokens 2048] [--message-tokens 640]\n"
     "      [--answer-tokens 320]"},
    {"allreduce", bench_allreduce,
     "skv_comm_allreduce latency in CUDA graphs per algorithm and AUTO vs ncclAllReduce (same "
     "run),\n"
     "      measured crossovers, barrier latency, signal ping-pong round trips\n"
     "      [--sizes 1K,4K,...|--min 1K --max 64M] [--calls 100] [--reps 7] [--dtype bf16]\n"
     "      [--no-signals] [--backend host]"},
};

static void usage(FILE *f) {
  fprintf(
      f,
      "usage: symkv-bench COMMAND [options] [--json] [--json-out FILE] [--quiet]\n"
      "Run under symkv-run (e.g. symkv-run -n 4 -- symkv-bench heap); a single process runs as a\n"
      "1-PE job. Every command measures its baselines in the same run.\n\ncommands:\n");
  for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
    fprintf(f, "  %-8s %s\n", commands[i].name, commands[i].help);
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
  int fd = socket(AF_INET, SOCK_STREAM, 0), port = 0;
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t len = sizeof a;
  if (fd >= 0 && bind(fd, (struct sockaddr *)&a, sizeof a) == 0 &&
      getsockname(fd, (struct sockaddr *)&a, &len) == 0)
    port = ntohs(a.sin_port);
  if (fd >= 0) close(fd);
  char addr[64];
  snprintf(addr, sizeof addr, "tcp://127.0.0.1:%d", port ? port : 29517);
  setenv("SKV_BOOTSTRAP", addr, 1);
}

int main(int argc, char **argv) {
  if (argc < 2 || strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0) {
    usage(argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  const command_t *cmd = NULL;
  for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
    if (strcmp(argv[1], commands[i].name) == 0) cmd = &commands[i];
  if (!cmd) {
    fprintf(stderr, "symkv-bench: unknown command '%s'\n", argv[1]);
    usage(stderr);
    return 2;
  }
  bench_t b;
  memset(&b, 0, sizeof b);
  b.cmd = cmd->name;
  b.argc = argc - 2;
  b.argv = argv + 2;
  size_t o = 0;
  for (int i = 0; i < argc && o + 2 < sizeof b.command; i++)
    o += (size_t)snprintf(b.command + o, sizeof b.command - o, "%s%s", i ? " " : "", argv[i]);
  b.json = bench_flag(&b, "--json");
  b.json_out = bench_opt(&b, "--json-out");
  b.quiet = bench_flag(&b, "--quiet");
  default_single_pe();
  int rc = cmd->run(&b);
  if (rc != 0) {
    fprintf(stderr, "symkv-bench %s failed: %s\n", cmd->name,
            skv_last_error()[0] ? skv_last_error() : skv_strerror(rc));
    return 1;
  }
  return 0;
}
