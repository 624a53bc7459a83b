/* symkv-bench micro: prefix lookup and publish (insert) rates, one PE and all PEs at once,
 * page alloc/free, and host fetch bandwidth against memcpy of the same bytes in this run. */
#define _GNU_SOURCE
#include "bench.h"

#include "heap/heap.h"
#include "kv/kv.h"

#include <stdlib.h>
#include <string.h>

#define CHAIN 64 /* keys per prefix lookup */

static skv_geometry_t geom(uint32_t heads, uint32_t dim, uint32_t page_tokens) {
  skv_geometry_t g = SKV_GEOMETRY_INIT;
  g.kv_kind = SKV_KV_SPLIT;
  g.num_layers = 1;
  g.num_kv_heads = heads;
  g.head_dim = dim;
  g.elem_bytes = 2;
  g.page_tokens = page_tokens;
  return g;
}

/* A private open-addressing table of 64-bit keys: the baseline for the shared index. */
typedef struct priv_table {
  uint64_t *k, *v, mask;
} priv_table_t;

static void priv_insert(priv_table_t *t, uint64_t k, uint64_t v) {
  uint64_t h = k & t->mask;
  while (t->k[h]) h = (h + 1) & t->mask;
  t->k[h] = k;
  t->v[h] = v;
}
static uint64_t priv_lookup(const priv_table_t *t, uint64_t k) {
  uint64_t h = k & t->mask;
  while (t->k[h] && t->k[h] != k) h = (h + 1) & t->mask;
  return t->v[h];
}

typedef struct idx_result {
  double publish_kps, lookup_kps, lookup_all_kps, priv_kps, alloc_ops, malloc_ops;
} idx_result_t;

static int bench_index(bench_t *b, skv_ctx_t *ctx, idx_result_t *res) {
  int rank = skv_ctx_get_rank(ctx), npes = skv_ctx_get_world_size(ctx);
  uint64_t keys_per_pe = (uint64_t)bench_opt_int(b, "--keys", 1 << 20) / (uint64_t)npes;
  double seconds = bench_opt_real(b, "--seconds", 1.0);
  keys_per_pe = SKV_ALIGN_UP(SKV_MAX(keys_per_pe, CHAIN), CHAIN);
  skv_geometry_t g = geom(1, 16, 4); /* 256-byte pages: the index dominates */
  skv_kv_opts_t o = SKV_KV_OPTS_INIT;
  o.pages_per_pe = keys_per_pe;
  skv_kv_t *kv;
  SKV_CHECK(skv_kv_create(ctx, &g, &o, &kv));
  skv_namespace_t *ns;
  skv_namespace_create("bench-micro", &g, NULL, 0, "bench", 5, &ns);
  skv_layout_t *lay;
  uint64_t lb;
  skv_layout_get_preset_layer_bytes(&g, SKV_LAYOUT_CONTIGUOUS, 4, CHAIN, &lb);
  void *eng = calloc(1, lb);
  skv_layout_create_preset(&g, SKV_LAYOUT_CONTIGUOUS, 4, CHAIN, &eng, -1, &lay);
  /* keys: one long chain per PE */
  uint64_t ntok = keys_per_pe * 4;
  uint32_t *tokens = malloc(ntok * sizeof *tokens);
  uint64_t s = 7 + (uint64_t)rank;
  for (uint64_t i = 0; i < ntok; i++) tokens[i] = (uint32_t)bench_rand(&s);
  skv_key_t *keys = malloc(keys_per_pe * sizeof *keys);
  size_t nk;
  skv_namespace_hash_tokens(ns, tokens, ntok, NULL, keys, keys_per_pe, &nk);
  uint64_t blocks[CHAIN];
  for (int i = 0; i < CHAIN; i++) blocks[i] = (uint64_t)i;
  /* publish (index insert + a 256-byte copy + page allocation) */
  SKV_CHECK(skv_ctx_barrier(ctx));
  double t0 = bench_now();
  for (uint64_t i = 0; i < keys_per_pe; i += CHAIN) {
    size_t ins;
    int rc = skv_kv_publish(kv, ns, keys + i, CHAIN, lay, blocks, NULL, &ins);
    if (rc) return rc;
    if ((i / CHAIN) % 256 == 0) bench_progress(b, "publish", (double)i, (double)keys_per_pe);
  }
  res->publish_kps = (double)keys_per_pe / (bench_now() - t0);
  bench_progress_end(b);
  SKV_CHECK(skv_ctx_barrier(ctx));
  /* every PE looks up the chains of the next PE (remote shards and pages) */
  skv_key_t *peer_keys = malloc(keys_per_pe * sizeof *peer_keys);
  s = 7 + (uint64_t)((rank + 1) % npes);
  for (uint64_t i = 0; i < ntok; i++) tokens[i] = (uint32_t)bench_rand(&s);
  skv_namespace_hash_tokens(ns, tokens, ntok, NULL, peer_keys, keys_per_pe, &nk);
  skv_page_ref_t refs[CHAIN];
  uint64_t nchains = keys_per_pe / CHAIN;
  double lookup_rate[2] = {0, 0};
  for (int mode = 0; mode < 2; mode++) { /* 0: one PE at a time, 1: all at once */
    for (int turn = 0; turn < (mode ? 1 : npes); turn++) {
      SKV_CHECK(skv_ctx_barrier(ctx));
      if (mode == 0 && turn != rank) continue;
      uint64_t done = 0, c = 0;
      t0 = bench_now();
      double t1;
      do {
        for (int rep = 0; rep < 64; rep++, c++) {
          size_t nhit;
          skv_kv_lookup(kv, ns, peer_keys + (c % nchains) * CHAIN, CHAIN, 0, refs, &nhit);
          if (nhit != CHAIN)
            return SKV_FAIL(SKV_EINTERNAL, SKV_SUBSYS_BENCH, "lookup found %zu of %d keys", nhit,
                            CHAIN);
          done += CHAIN;
        }
        t1 = bench_now();
      } while (t1 - t0 < seconds);
      lookup_rate[mode] = (double)done / (t1 - t0);
    }
  }
  res->lookup_kps = lookup_rate[0];
  res->lookup_all_kps = lookup_rate[1];
  SKV_CHECK(skv_ctx_barrier(ctx));
  /* baseline: a private table of 64-bit keys of the same size, same probe pattern */
  priv_table_t pt;
  uint64_t slots = 1;
  while (slots < 2 * keys_per_pe) slots <<= 1;
  pt.k = calloc(slots, 8);
  pt.v = calloc(slots, 8);
  pt.mask = slots - 1;
  for (uint64_t i = 0; i < keys_per_pe; i++) priv_insert(&pt, peer_keys[i].lo | 1, i + 1);
  uint64_t done = 0, sink = 0, c = 0;
  t0 = bench_now();
  double t1;
  do {
    for (int rep = 0; rep < 64; rep++, c++) {
      const skv_key_t *k = peer_keys + (c % nchains) * CHAIN;
      for (int j = 0; j < CHAIN; j++) sink += priv_lookup(&pt, k[j].lo | 1);
      done += CHAIN;
    }
    t1 = bench_now();
  } while (t1 - t0 < seconds);
  res->priv_kps = (double)done / (t1 - t0) + (double)(sink & 0);
  free(pt.k);
  free(pt.v);
  /* page alloc/free on the owner vs malloc/free of a page */
  skv_kv_evict(kv, keys_per_pe, NULL);
  uint64_t nops = 0, ev = 0;
  t0 = bench_now();
  do {
    for (int i = 0; i < 1024; i++, nops++) {
      uint32_t page, gen;
      SKV_CHECK(skv__pool_alloc(&kv->pool, skv__kv_evict_cb, kv, &page, &gen, &ev));
      skv__pool_release(&kv->pool, page);
    }
    t1 = bench_now();
  } while (t1 - t0 < seconds / 2);
  res->alloc_ops = (double)nops / (t1 - t0);
  nops = 0;
  t0 = bench_now();
  do {
    for (int i = 0; i < 1024; i++, nops++) {
      void *p = malloc(kv->page_bytes);
      __asm__ __volatile__("" : : "r"(p) : "memory");
      free(p);
    }
    t1 = bench_now();
  } while (t1 - t0 < seconds / 2);
  res->malloc_ops = (double)nops / (t1 - t0);
  free(tokens);
  free(keys);
  free(peer_keys);
  skv_layout_destroy(lay);
  free(eng);
  skv_namespace_destroy(ns);
  return skv_kv_destroy(kv);
}

typedef struct fetch_result {
  double fetch_gbps, memcpy_gbps;
} fetch_result_t;

/* Fetch `batch` random pages of `page_bytes` from the next PE into random engine blocks. */
static int bench_fetch_host(bench_t *b, skv_ctx_t *ctx, uint64_t page_bytes, int preset,
                            fetch_result_t *res) {
  int rank = skv_ctx_get_rank(ctx), npes = skv_ctx_get_world_size(ctx);
  uint64_t batch_bytes = (uint64_t)bench_opt_int(b, "--batch-bytes", 64 << 20);
  int reps = (int)bench_opt_int(b, "--reps", 5);
  /* 16 tokens, 8 heads, bf16, 2 layers: the page size sets head_dim */
  uint32_t heads = 8, pt = 16, layers = 2;
  uint64_t per_dim = 2ull * pt * heads * 2 * layers;
  uint32_t dim = (uint32_t)SKV_MAX(1, page_bytes / per_dim);
  skv_geometry_t g = geom(heads, dim, pt);
  g.num_layers = layers;
  uint64_t pb;
  skv_geometry_get_page_bytes(&g, &pb);
  uint64_t batch = SKV_MAX(1, batch_bytes / pb);
  uint64_t pages = batch + 8, nb = 2 * batch;
  skv_kv_opts_t o = SKV_KV_OPTS_INIT;
  o.pages_per_pe = pages;
  skv_kv_t *kv;
  SKV_CHECK(skv_kv_create(ctx, &g, &o, &kv));
  skv_namespace_t *ns;
  skv_namespace_create("bench-fetch", &g, NULL, 0, "bench", 5, &ns);
  uint64_t lb;
  skv_layout_get_preset_layer_bytes(&g, preset, pt, nb, &lb);
  uint32_t nl = preset == SKV_LAYOUT_CONTIGUOUS ? 1 : layers;
  void *eng[2];
  for (uint32_t l = 0; l < nl; l++) {
    eng[l] = aligned_alloc(4096, SKV_ALIGN_UP(lb, 4096));
    memset(eng[l], 1 + (int)l, lb);
  }
  skv_layout_t *lay;
  SKV_CHECK(skv_layout_create_preset(&g, preset, pt, nb, eng, -1, &lay));
  /* every PE publishes `batch` pages under keys from its own id */
  skv_key_t *keys = malloc(batch * sizeof *keys);
  uint64_t *blocks = malloc(batch * sizeof *blocks);
  for (uint64_t i = 0; i < batch; i++) {
    uint64_t id = ((uint64_t)rank << 40) | i;
    skv_namespace_hash_bytes(ns, &id, sizeof id, &keys[i]);
    blocks[i] = i;
  }
  size_t ins;
  SKV_CHECK(skv_kv_publish(kv, ns, keys, batch, lay, blocks, NULL, &ins));
  SKV_CHECK(skv_ctx_barrier(ctx));
  int from = (rank + 1) % npes;
  for (uint64_t i = 0; i < batch; i++) {
    uint64_t id = ((uint64_t)from << 40) | i;
    skv_namespace_hash_bytes(ns, &id, sizeof id, &keys[i]);
  }
  skv_page_ref_t *refs = malloc(batch * sizeof *refs);
  size_t nhit;
  SKV_CHECK(skv_kv_lookup(kv, ns, keys, batch, 0, refs, &nhit));
  if (nhit != batch)
    return SKV_FAIL(SKV_EINTERNAL, SKV_SUBSYS_BENCH, "lookup found %zu of %llu pages", nhit,
                    (unsigned long long)batch);
  /* random page order and random destination blocks */
  uint64_t s = 99 + (uint64_t)rank;
  for (uint64_t i = batch - 1; i > 0; i--) {
    uint64_t j = bench_rand(&s) % (i + 1);
    skv_page_ref_t t = refs[i];
    refs[i] = refs[j];
    refs[j] = t;
  }
  for (uint64_t i = 0; i < batch; i++) blocks[i] = (i * 2 + (bench_rand(&s) & 1)) % nb;
  double tf[64], tm[64];
  char *src = malloc(pb * batch), *dst = malloc(pb * batch);
  memset(src, 3, pb * batch);
  memset(dst, 4, pb * batch);
  for (int turn = 0; turn < npes; turn++) { /* one PE at a time: 2 cores here */
    SKV_CHECK(skv_ctx_barrier(ctx));
    if (turn != rank) continue;
    SKV_CHECK(skv_kv_fetch(kv, refs, batch, lay, blocks, 0, NULL)); /* warm-up */
    memcpy(dst, src, pb * batch);
    for (int r = 0; r < reps; r++) {
      double t0 = bench_now();
      SKV_CHECK(skv_kv_fetch(kv, refs, batch, lay, blocks, 0, NULL));
      tf[r] = bench_now() - t0;
      t0 = bench_now();
      memcpy(dst, src, pb * batch);
      tm[r] = bench_now() - t0;
    }
  }
  SKV_CHECK(skv_ctx_barrier(ctx));
  res->fetch_gbps = (double)(pb * batch) / bench_median(tf, (size_t)reps) / 1e9;
  res->memcpy_gbps = (double)(pb * batch) / bench_median(tm, (size_t)reps) / 1e9;
  free(src);
  free(dst);
  free(refs);
  free(keys);
  free(blocks);
  skv_layout_destroy(lay);
  for (uint32_t l = 0; l < nl; l++) free(eng[l]);
  skv_namespace_destroy(ns);
  return skv_kv_destroy(kv);
}

static int bench_micro(bench_t *b) {
  skv_ctx_t *ctx;
  SKV_CHECK(skv_init(NULL, &ctx));
  int rank = skv_ctx_get_rank(ctx), npes = skv_ctx_get_world_size(ctx);
  idx_result_t ir;
  memset(&ir, 0, sizeof ir);
  int rc = bench_index(b, ctx, &ir);
  idx_result_t *iall = calloc((size_t)npes, sizeof *iall);
  if (rc == 0) rc = skv_ctx_allgather(ctx, &ir, iall, sizeof ir);
  static const uint64_t page_sizes[] = {16 << 10, 64 << 10, 256 << 10, 1 << 20, 2 << 20};
  static const int presets[] = {SKV_LAYOUT_VLLM_FLASH_NHD, SKV_LAYOUT_VLLM_FLASH_HND};
  static const char *preset_names[] = {"nhd", "hnd"};
  enum { NPS = sizeof page_sizes / sizeof page_sizes[0] };
  fetch_result_t fr[2][NPS];
  for (int p = 0; p < 2 && rc == 0; p++)
    for (int i = 0; i < NPS && rc == 0; i++) {
      fetch_result_t mine;
      rc = bench_fetch_host(b, ctx, page_sizes[i], presets[p], &mine);
      fetch_result_t *fall = calloc((size_t)npes, sizeof *fall);
      if (rc == 0) rc = skv_ctx_allgather(ctx, &mine, fall, sizeof mine);
      fr[p][i] = fall[0];
      free(fall);
      bench_progress(b, "fetch", p * NPS + i + 1, 2 * NPS);
    }
  bench_progress_end(b);
  if (rc == 0 && rank == 0) {
    bench_config_int(b, "pes", npes);
    bench_config_int(b, "keys", bench_opt_int(b, "--keys", 1 << 20));
    bench_config_int(b, "chain", CHAIN);
    bench_config_int(b, "batch_bytes", bench_opt_int(b, "--batch-bytes", 64 << 20));
    /* whether the host heap can be on huge pages (docs/reference.md, Symmetric heap) */
    char thp[32];
    (void)skv__host_shmem_thp(thp, sizeof thp);
    bench_config_str(b, "shmem_enabled", thp);
    double sum = 0;
    for (int r = 0; r < npes; r++) sum += iall[r].lookup_all_kps;
    bench_row(b, "index/prefix_lookup/one_pe", iall[0].lookup_kps, "keys/s", "higher",
              "private 64-bit hash table lookup", iall[0].priv_kps);
    bench_row(b, "index/prefix_lookup/all_pes", sum, "keys/s", "higher", "one PE x PEs",
              iall[0].lookup_kps * npes);
    bench_row(b, "index/publish_256B/one_pe", iall[0].publish_kps, "keys/s", "higher", NULL, 0);
    bench_row(b, "pool/alloc_free", iall[0].alloc_ops, "ops/s", "higher", "malloc+free of a page",
              iall[0].malloc_ops);
    char name[96];
    for (int p = 0; p < 2; p++)
      for (int i = 0; i < NPS; i++) {
        char sz[32];
        snprintf(name, sizeof name, "fetch_host/%s/%s", preset_names[p],
                 skv__fmt_bytes(page_sizes[i], sz, sizeof sz));
        for (char *c = name; *c; c++)
          if (*c == ' ') *c = '_';
        bench_row(b, name, fr[p][i].fetch_gbps, "GB/s", "higher", "memcpy of the same bytes",
                  fr[p][i].memcpy_gbps);
      }
    bench_report(b);
  }
  free(iall);
  int rc2 = skv_finalize(ctx);
  return rc ? rc : rc2;
}

static const bench_optspec_t micro_opts[] = {
    {"--keys", BENCH_INT, "N", "1M", "keys published and looked up, over all PEs", 1, 1ll << 32,
     NULL},
    {"--seconds", BENCH_REAL, "S", "1", "time of each rate measurement", 0.01, 3600, NULL},
    {"--batch-bytes", BENCH_INT, "N", "64M", "bytes of each host fetch batch", 4096, 1ll << 36,
     NULL},
    {"--reps", BENCH_INT, "N", "5", "fetch repetitions, the median is reported", 1, 64, NULL},
    BENCH_OPTS_END,
};

const bench_cmd_t bench_cmd_micro = {
    .name = "micro",
    .run = bench_micro,
    .summary = "index lookup/insert rates, page alloc/free, host fetch bandwidth vs memcpy",
    .opts = micro_opts,
};
