/* symkv-bench heap: every PE in turn writes to and reads from each peer's heap segment
 * through symmetric addresses; the baseline is a local memcpy of the same bytes, same run. */
#define _GNU_SOURCE
#include "bench.h"

#include "heap/heap.h"

#include <stdlib.h>
#include <string.h>

typedef struct pe_result {
  double local_gbps, write_gbps, read_gbps; /* write/read: mean over peers */
} pe_result_t;

/* Median GB/s of `reps` copies of `bytes` from src to dst. */
static double copy_gbps(void *dst, const void *src, size_t bytes, int reps) {
  double t[64];
  memcpy(dst, src, bytes); /* warm-up: fault the pages in */
  for (int i = 0; i < reps; i++) {
    double t0 = bench_now();
    memcpy(dst, src, bytes);
    t[i] = bench_now() - t0;
  }
  return (double)bytes / bench_median(t, (size_t)reps) / 1e9;
}

static int bench_heap(bench_t *b) {
  uint64_t bytes = (uint64_t)bench_opt_int(b, "--bytes", 64 << 20);
  int reps = (int)bench_opt_int(b, "--reps", 5);
  const char *bk = bench_opt(b, "--backend");
  if (!bk) bk = getenv("SKV_HEAP_BACKEND");
  if (bk && strcmp(bk, "host") != 0)
    return SKV_FAIL(SKV_ENOTSUP, SKV_SUBSYS_BENCH,
                    "symkv-bench heap measures the host backend (got --backend %s); "
                    "GPU bandwidth is measured by symkv-bench fetch",
                    bk);
  skv_ctx_t *ctx;
  SKV_CHECK(skv_init(NULL, &ctx));
  int rank = skv_ctx_get_rank(ctx), npes = skv_ctx_get_world_size(ctx);
  skv_heap_t *heap;
  int rc = skv_heap_create(ctx, bytes, SKV_BACKEND_HOST, &heap);
  if (rc) {
    skv_finalize(ctx);
    return rc;
  }
  char *local = malloc(bytes), *local2 = malloc(bytes);
  uint64_t seed = 0x1234 + (uint64_t)rank;
  uint64_t *w = (uint64_t *)local;
  for (uint64_t i = 0; i < bytes / 8; i++) w[i] = bench_rand(&seed);
  memset(local2, 0, bytes);
  uint64_t off = heap->info.data_offset;
  pe_result_t me = {0};
  /* One PE measures at a time, so that PEs do not compete for memory bandwidth or cores. */
  for (int turn = 0; turn < npes; turn++) {
    if (turn == rank) {
      me.local_gbps = copy_gbps(local2, local, bytes, reps);
      for (int pe = 0; pe < npes; pe++) {
        if (pe == rank && npes > 1) continue;
        char *seg = skv_heap_get_ptr(heap, pe, off);
        me.write_gbps += copy_gbps(seg, local, bytes, reps);
        me.read_gbps += copy_gbps(local2, seg, bytes, reps);
      }
      int peers = npes > 1 ? npes - 1 : 1;
      me.write_gbps /= peers;
      me.read_gbps /= peers;
      bench_progress(b, "heap", turn + 1, npes);
    }
    if ((rc = skv_ctx_barrier(ctx)) != 0) break;
  }
  bench_progress_end(b);
  pe_result_t *all = calloc((size_t)npes, sizeof *all);
  if (rc == 0) rc = skv_ctx_allgather(ctx, &me, all, sizeof me);
  if (rc == 0 && rank == 0) {
    char name[128];
    bench_config_int(b, "pes", npes);
    bench_config_int(b, "bytes", (long long)bytes);
    bench_config_int(b, "reps", reps);
    bench_config_str(b, "backend", "host");
    for (int r = 0; r < npes; r++) {
      snprintf(name, sizeof name, "heap/write_peer/pe%d", r);
      bench_row(b, name, all[r].write_gbps, "GB/s", "higher", "local memcpy", all[r].local_gbps);
      snprintf(name, sizeof name, "heap/read_peer/pe%d", r);
      bench_row(b, name, all[r].read_gbps, "GB/s", "higher", "local memcpy", all[r].local_gbps);
    }
    bench_report(b);
  }
  free(all);
  free(local);
  free(local2);
  int rc2 = skv_heap_destroy(heap);
  int rc3 = skv_finalize(ctx);
  return rc ? rc : rc2 ? rc2 : rc3;
}

static const bench_optspec_t heap_opts[] = {
    {"--bytes", BENCH_INT, "N", "64M", "bytes copied into and out of each peer's segment", 4096,
     1ll << 40, NULL},
    {"--reps", BENCH_INT, "N", "5", "repetitions, the median is reported", 1, 64, NULL},
    {"--backend", BENCH_CHOICE, "B", "host", "heap backend", 0, 0, "host"},
    BENCH_OPTS_END,
};

const bench_cmd_t bench_cmd_heap = {
    .name = "heap",
    .run = bench_heap,
    .summary = "each PE's write and read bandwidth into peers' heap segments vs a local memcpy",
    .opts = heap_opts,
};
