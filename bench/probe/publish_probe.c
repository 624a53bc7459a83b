/* publish_probe: the host cost of skv_kv_publish alone, for perf (issue 21). One PE, the host
 * backend, 512-byte pages (a copy costs next to nothing), a pool of POOL pages filled first, then
 * CALLS publishes of 1024 fresh keys each: every call claims 1024 index slots, evicts 1024 least
 * recently used pages (index erases included) and finishes 1024 pages, the work a GPU publish
 * does on the host. Prints the median, 10th percentile and mean per call.
 *   symkv-run -n 1 -- symkv-publish-probe [CALLS [POOL]]        (default 3000 3072)
 *   perf record -g -- symkv-run -n 1 -- symkv-publish-probe 3000 8192
 * .gpubin/x21c.sh ran it under perf on the GPU host
 * (bench/results/e2e21_claims_nvidia-h100-x1.txt). */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "symkv.h"
#include "probe.h"

enum { N = 1024, BLOCKS = 2048 };

#define CHECK(call)                                                        \
  do {                                                                     \
    int rc_ = (call);                                                      \
    if (rc_) {                                                             \
      fprintf(stderr, "publish_probe: %s: %s\n", #call, skv_last_error()); \
      return 1;                                                            \
    }                                                                      \
  } while (0)

int main(int argc, char **argv) {
  const long calls = argc > 1 ? strtol(argv[1], NULL, 10) : 3000;
  const long pool = argc > 2 ? strtol(argv[2], NULL, 10) : 3072;
  if (calls < 10 || calls > 1000000 || pool < 2 * N || pool > (1l << 24)) {
    fprintf(stderr, "usage: %s [CALLS (10..1e6) [POOL pages (%d..2^24)]]\n", argv[0], 2 * N);
    return 2;
  }
  skv_ctx_t *ctx;
  CHECK(skv_init(NULL, &ctx));
  skv_geometry_t g = SKV_GEOMETRY_INIT; /* 16 tokens x 1 head x 8 x 2 bytes, K and V: 512 B */
  g.kv_kind = SKV_KV_SPLIT;
  g.num_layers = 1;
  g.num_kv_heads = 1;
  g.head_dim = 8;
  g.elem_bytes = 2;
  g.page_tokens = 16;
  skv_kv_opts_t o = SKV_KV_OPTS_INIT;
  o.backend = SKV_BACKEND_HOST;
  o.pages_per_pe = (uint64_t)pool;
  skv_kv_t *kv;
  CHECK(skv_kv_create(ctx, &g, &o, &kv));
  skv_namespace_t *ns;
  CHECK(skv_namespace_create("publish-probe", &g, NULL, 0, "probe", 5, &ns));
  uint64_t lb = 0;
  CHECK(skv_layout_get_preset_layer_bytes(&g, SKV_LAYOUT_VLLM_FLASH_NHD, 16, BLOCKS, &lb));
  void *layer = aligned_alloc(4096, (lb + 4095) & ~4095ull);
  skv_key_t *keys = malloc(N * sizeof *keys);
  uint64_t *blocks = malloc(N * sizeof *blocks);
  const long fill = pool / N + 2; /* calls that fill the pool first, not timed */
  double *t = malloc((size_t)calls * sizeof *t);
  if (!layer || !keys || !blocks || !t) {
    fprintf(stderr, "publish_probe: out of memory\n");
    return 1;
  }
  memset(layer, 1, lb);
  skv_layout_t *lay;
  CHECK(skv_layout_create_preset(&g, SKV_LAYOUT_VLLM_FLASH_NHD, 16, BLOCKS, &layer, -1, &lay));
  uint64_t next = 0;
  double sum = 0;
  for (long c = 0; c < fill + calls; c++) {
    for (int q = 0; q < N; q++) {
      const uint64_t id = next++;
      skv_namespace_hash_bytes(ns, &id, sizeof id, &keys[q]);
      blocks[q] = (uint64_t)q;
    }
    size_t ins = 0;
    const double t0 = probe_now();
    CHECK(skv_kv_publish(kv, ns, keys, N, lay, blocks, NULL, &ins));
    const double dt = probe_now() - t0;
    if (ins != N) {
      fprintf(stderr, "publish_probe: call %ld inserted %zu of %d keys\n", c, ins, N);
      return 1;
    }
    if (c >= fill) t[c - fill] = dt, sum += dt;
  }
  qsort(t, (size_t)calls, sizeof *t, probe_cmp_double);
  printf("publish_probe: %d fresh keys of 512 B pages per call into a full pool of %ld pages, %ld "
         "calls: median %.1f us, p10 %.1f us, mean %.1f us (%.1f ns per page)\n",
         N, pool, calls, t[calls / 2] * 1e6, t[calls / 10] * 1e6, sum / (double)calls * 1e6,
         sum / (double)calls / N * 1e9);
  skv_layout_destroy(lay);
  skv_namespace_destroy(ns);
  CHECK(skv_kv_destroy(kv));
  CHECK(skv_finalize(ctx));
  free(layer);
  free(keys);
  free(blocks);
  free(t);
  return 0;
}
