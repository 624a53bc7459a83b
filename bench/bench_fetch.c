/* symkv-bench fetch: GB/s of skv_kv_fetch of random pages of a peer into engine blocks, against the
 * copy engine's contiguous copy of the same bytes, a per-page cudaMemcpyAsync loop and the same
 * kernel gathering local pages, all in this run; the latency of a 1 MiB batch; kernel variants;
 * skv_kv_publish of random engine blocks into new pages, against the contiguous local copy. */
#define _GNU_SOURCE
#include "bench.h"

#include "kv/kv.h"

#include <stdlib.h>
#include <string.h>

/* ---- where an end-to-end call's time goes (both backends) ----------------------------------- */

/* The phases of `reps` profiled calls (the cache's counters, kv_prof.h), plus what the bench
 * itself saw (`extra`, seconds summed over the calls: -1 for none): one row per phase that ran,
 * in us per call, against the whole call. */
typedef struct breakdown {
  double ns[SKV__KP_N], n[SKV__KP_N];
  double gpu_wait, completion_wait; /* seconds per call: stream sync, skv_kv_sync after it */
  int calls;
} breakdown_t;

static void breakdown_take(const skv_kv_t *kv, breakdown_t *bd, int calls) {
  for (int i = 0; i < SKV__KP_N; i++) {
    bd->ns[i] = (double)__atomic_load_n(&kv->prof.ns[i], __ATOMIC_RELAXED);
    bd->n[i] = (double)__atomic_load_n(&kv->prof.n[i], __ATOMIC_RELAXED);
  }
  bd->calls = calls;
}

static void breakdown_rows(bench_t *b, const char *row, const breakdown_t *bd) {
  if (bd->calls <= 0 || bd->n[SKV__KP_CALL] <= 0) return;
  char name[160];
  const double call_us = bd->ns[SKV__KP_CALL] / bd->calls / 1e3;
  for (int i = 0; i < SKV__KP_N; i++) {
    if (bd->n[i] <= 0) continue;
    snprintf(name, sizeof name, "breakdown/%s/%s", row, skv__kp_name(i));
    bench_row(b, name, bd->ns[i] / bd->calls / 1e3, "us", "lower",
              i == SKV__KP_CALL ? NULL : "the whole call", i == SKV__KP_CALL ? -1 : call_us);
  }
  if (bd->gpu_wait >= 0) {
    snprintf(name, sizeof name, "breakdown/%s/gpu_wait", row);
    bench_row(b, name, bd->gpu_wait * 1e6, "us", "lower", "the whole call", call_us);
  }
  if (bd->completion_wait >= 0) {
    snprintf(name, sizeof name, "breakdown/%s/completion_wait", row);
    bench_row(b, name, bd->completion_wait * 1e6, "us", "lower", "the whole call", call_us);
  }
}

/* Host backend, end to end: rank 0 fetches random 64 KiB pages of PE 1 (or its own with one
 * PE) into random blocks of a host engine layout, and publishes random blocks under fresh keys
 * into a full pool (every page allocated evicts one), wall time of each call against memcpy of
 * the same number of bytes between the same buffers, interleaved in this run. Then the same
 * calls again with the cache's phase counters on, for the breakdown. */
#define HE_POOL   3072u /* pages per PE: 192 MiB */
#define HE_BLOCKS 2048u

typedef struct host_e2e {
  double fetch, fetch_mc, lat, lat_mc, pub, pub_mc; /* seconds, medians */
  breakdown_t bd_fetch, bd_lat, bd_pub;
} host_e2e_t;

static void he_shuffle(uint64_t *v, uint64_t n, uint64_t k, uint64_t *s) {
  for (uint64_t i = 0; i < k && i + 1 < n; i++) {
    uint64_t j = i + bench_rand(s) % (n - i), t = v[i];
    v[i] = v[j];
    v[j] = t;
  }
}

static int host_e2e(bench_t *b, skv_ctx_t *ctx, int reps, host_e2e_t *res) {
  const int rank = skv_ctx_get_rank(ctx), npes = skv_ctx_get_world_size(ctx);
  const int peer = npes > 1 ? (rank + 1) % npes : rank;
  skv_geometry_t g = SKV_GEOMETRY_INIT; /* 64 KiB: 16 tokens x 8 heads x 128 x bf16, 1 layer */
  g.kv_kind = SKV_KV_SPLIT;
  g.num_layers = 1;
  g.num_kv_heads = 8;
  g.head_dim = 128;
  g.elem_bytes = 2;
  g.page_tokens = 16;
  const uint64_t ps = 64u << 10, big = 1024, small = 16;
  skv_kv_opts_t o = SKV_KV_OPTS_INIT;
  o.backend = SKV_BACKEND_HOST;
  o.pages_per_pe = HE_POOL;
  skv_kv_t *kv;
  SKV_CHECK(skv_kv_create(ctx, &g, &o, &kv));
  skv_namespace_t *ns = NULL;
  skv_layout_t *lay = NULL;
  void *layer = NULL;
  skv_key_t *keys = malloc(HE_POOL * sizeof *keys);
  uint64_t *blocks = malloc(HE_POOL * sizeof *blocks), *pi = malloc(HE_POOL * sizeof *pi);
  uint64_t *bi = malloc(HE_BLOCKS * sizeof *bi);
  skv_page_ref_t *refs = malloc(HE_POOL * sizeof *refs), *sel = malloc(big * sizeof *sel);
  uint64_t lb = 0, rng = 0x40e2e000ull + (uint64_t)rank, pub_next = 0;
  int rc = keys && blocks && pi && bi && refs && sel
               ? 0
               : SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_BENCH, "fetch: out of memory");
  if (rc == 0) rc = skv_namespace_create("bench-fetch-host", &g, NULL, 0, "bench", 5, &ns);
  if (rc == 0)
    rc = skv_layout_get_preset_layer_bytes(&g, SKV_LAYOUT_VLLM_FLASH_NHD, 16, HE_BLOCKS, &lb);
  if (rc == 0) {
    layer = aligned_alloc(4096, SKV_ALIGN_UP(lb, 4096));
    if (!layer) rc = SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_BENCH, "fetch: out of memory");
  }
  if (rc == 0) {
    for (uint64_t i = 0; i < lb / 8; i++) ((uint64_t *)layer)[i] = bench_rand(&rng) | 1;
    rc = skv_layout_create_preset(&g, SKV_LAYOUT_VLLM_FLASH_NHD, 16, HE_BLOCKS, &layer, -1, &lay);
  }
  /* every PE fills its pool */
  for (uint64_t i = 0; i < HE_POOL && rc == 0; i++) {
    const uint64_t id = ((uint64_t)rank << 40) | i;
    skv_namespace_hash_bytes(ns, &id, sizeof id, &keys[i]);
    blocks[i] = i % HE_BLOCKS;
  }
  size_t got = 0;
  if (rc == 0) rc = skv_kv_publish(kv, ns, keys, HE_POOL, lay, blocks, NULL, &got);
  if (rc == 0) rc = skv_ctx_barrier(ctx);
  for (uint64_t i = 0; i < HE_POOL && rc == 0; i++) {
    const uint64_t id = ((uint64_t)peer << 40) | i;
    skv_namespace_hash_bytes(ns, &id, sizeof id, &keys[i]);
  }
  if (rc == 0) rc = skv_kv_lookup(kv, ns, keys, HE_POOL, 0, refs, &got);
  if (rc == 0 && got != HE_POOL)
    rc = SKV_FAIL(SKV_EINTERNAL, SKV_SUBSYS_BENCH, "fetch: PE %d's pool: found %zu of %u pages",
                  peer, got, HE_POOL);
  for (uint64_t i = 0; i < HE_POOL; i++) pi[i] = i;
  for (uint64_t i = 0; i < HE_BLOCKS; i++) bi[i] = i;
    /* One call of `what` (0 fetch 1024, 1 fetch 16, 2 publish 1024) on fresh random pages and
     * blocks, and the memcpy of its bytes; seconds of each. */
#define HE_PICK(n)                                                              \
  do {                                                                          \
    he_shuffle(pi, HE_POOL, (n), &rng);                                         \
    he_shuffle(bi, HE_BLOCKS, (n), &rng);                                       \
    for (uint64_t q = 0; q < (n); q++) sel[q] = refs[pi[q]], blocks[q] = bi[q]; \
  } while (0)
  double t[3][64], m[3][64];
  const int nrep[3] = {reps, 4 * reps > 64 ? 64 : 4 * reps, reps};
  breakdown_t *bds[3] = {&res->bd_fetch, &res->bd_lat, &res->bd_pub};
  /* fetches first: the publishes evict pages (with one PE, the pages fetched) */
  for (int what = 0; what < 3 && rc == 0; what++)
    for (int prof = 0; prof < 2 && rc == 0; prof++) {
      if (rank == 0) skv__kp_reset(&kv->prof, prof == 1);
      const uint64_t n = what == 1 ? small : big;
      const char *peer_pages = skv__kv_page(kv, (uint32_t)peer, 0);
      char *own = skv__kv_page(kv, (uint32_t)rank, 0);
      for (int r = 0; r < 2 + nrep[what] && rc == 0 && rank == 0; r++) {
        HE_PICK(n);
        double t0 = bench_now();
        if (what < 2) {
          rc = skv_kv_fetch(kv, sel, n, lay, blocks, 0, NULL);
        } else {
          for (uint64_t q = 0; q < n; q++) {
            const uint64_t id = ((uint64_t)rank << 40) | (1ull << 39) | pub_next++;
            skv_namespace_hash_bytes(ns, &id, sizeof id, &keys[q]);
          }
          size_t ins = 0;
          rc = skv_kv_publish(kv, ns, keys, n, lay, blocks, NULL, &ins);
          if (rc == 0 && ins != n)
            rc = SKV_FAIL(SKV_EINTERNAL, SKV_SUBSYS_BENCH, "publish: %zu of %llu inserted", ins,
                          (unsigned long long)n);
        }
        double t1 = bench_now();
        /* the same bytes, contiguous, between the same two buffers (random places) */
        char *eng = (char *)layer + (bi[0] % (HE_BLOCKS - n)) * ps;
        if (what < 2)
          memcpy(eng, peer_pages + (pi[0] % (HE_POOL - n)) * kv->page_stride, n * ps);
        else
          memcpy(own + (pi[0] % (HE_POOL - n)) * kv->page_stride, eng, n * ps);
        double t2 = bench_now();
        if (r >= 2 && !prof) t[what][r - 2] = t1 - t0, m[what][r - 2] = t2 - t1;
        if (r == 1 && prof) skv__kp_reset(&kv->prof, true); /* the warm-ups do not count */
      }
      if (rank == 0 && prof) {
        breakdown_take(kv, bds[what], nrep[what]);
        bds[what]->gpu_wait = bds[what]->completion_wait = -1;
        skv__kp_reset(&kv->prof, false);
      }
    }
#undef HE_PICK
  if (rc == 0 && rank == 0) {
    res->fetch = bench_median(t[0], (size_t)nrep[0]);
    res->fetch_mc = bench_median(m[0], (size_t)nrep[0]);
    res->lat = bench_median(t[1], (size_t)nrep[1]);
    res->lat_mc = bench_median(m[1], (size_t)nrep[1]);
    res->pub = bench_median(t[2], (size_t)nrep[2]);
    res->pub_mc = bench_median(m[2], (size_t)nrep[2]);
  }
  int r2 = skv_ctx_barrier(ctx);
  if (rc == 0) rc = r2;
  SKV_UNUSED(b);
  skv_layout_destroy(lay);
  free(layer);
  free(keys);
  free(blocks);
  free(pi);
  free(bi);
  free(refs);
  free(sel);
  skv_namespace_destroy(ns);
  r2 = skv_kv_destroy(kv);
  return rc ? rc : r2;
}

static void host_e2e_rows(bench_t *b, const host_e2e_t *h) {
  const double big = 64.0 * 1024 * 1024;
  bench_row(b, "fetch_e2e_host/64KiB/x1024", big / h->fetch / 1e9, "GB/s", "higher",
            "memcpy of 64 MiB, peer's heap to the engine's, wall", big / h->fetch_mc / 1e9);
  bench_row(b, "fetch_latency_e2e_host/64KiB/x16", h->lat * 1e6, "us", "lower",
            "memcpy of 1 MiB, peer's heap to the engine's, wall", h->lat_mc * 1e6);
  bench_row(b, "publish_e2e_host/64KiB/x1024", big / h->pub / 1e9, "GB/s", "higher",
            "memcpy of 64 MiB, the engine's to own heap, wall", big / h->pub_mc / 1e9);
  breakdown_rows(b, "fetch_e2e_host/64KiB/x1024", &h->bd_fetch);
  breakdown_rows(b, "fetch_latency_e2e_host/64KiB/x16", &h->bd_lat);
  breakdown_rows(b, "publish_e2e_host/64KiB/x1024", &h->bd_pub);
}

#ifndef SKV_WITH_CUDA

static int bench_fetch(bench_t *b) {
  const char *be = bench_opt(b, "--backend");
  if (be && strcmp(be, "cuda") == 0)
    return SKV_FAIL(SKV_ENOTSUP, SKV_SUBSYS_BENCH,
                    "symkv-bench fetch --backend cuda needs a build with CUDA (configure with "
                    "-DSKV_CUDA=ON); --backend host runs without");
  skv_ctx_t *ctx;
  SKV_CHECK(skv_init(NULL, &ctx));
  host_e2e_t h;
  memset(&h, 0, sizeof h);
  const int reps = (int)bench_opt_int(b, "--reps", bench_flag(b, "--quick") ? 10 : 15);
  int rc = host_e2e(b, ctx, reps, &h);
  if (rc == 0 && skv_ctx_get_rank(ctx) == 0) {
    bench_config_int(b, "pes", skv_ctx_get_world_size(ctx));
    bench_config_int(b, "reps", reps);
    bench_config_str(b, "timing_host",
                     "wall time of each call, memcpy of the same bytes after it, fresh random "
                     "pages and blocks each repetition; median");
    host_e2e_rows(b, &h);
    rc = bench_report(b);
  }
  int r2 = skv_finalize(ctx);
  return rc ? rc : r2;
}

#else

#include "kernels/kv_copy.h"
#include "cuda/device.h"
#include "kv/kv_cuda.h"

#include <cuda_runtime_api.h>

/* How it is measured: rank 0 reads pages of PE 1 (on another GPU when there are two) while the
 * other PEs wait. Every timed operation is enqueued behind a gate kernel that holds the stream
 * until the host has enqueued everything, then events around the operation give the GPU time
 * alone (no host enqueue time, no launch gaps of the host). Each repetition reads other random
 * pages and writes other random blocks, out of a pool of at least 512 MiB per PE (well beyond
 * the 50 MB L2), so no repetition reads what a previous one left in a cache. The median of
 * --reps repetitions after 2 warm-ups is reported. */

#define GATE_NS     (100ull * 1000 * 1000) /* a gate opens by itself after 100 ms */
#define GATE_MIN_NS (1000ull * 1000)       /* and holds 1 ms at least: the GPU's clocks come up */
#define WARM        2
#define MAX_REPS    64
/* The engine's work between two publishes in the *_gap and *_reserve rows: a forward pass takes
 * milliseconds; 1 ms keeps the run short. */
#define PUB_GAP_US  1000.0

enum {
  M_FETCH,
  M_CE,
  M_LOOP,
  M_LOCAL,
  M_CE_LOCAL,
  M_CE_BATCH,
  M_CE_COLD,       /* M_CE and M_CE_LOCAL into a destination drawn afresh each repetition (cold */
  M_CE_LOCAL_COLD, /* in the L2, as the engine's blocks of a fetch or publish are) */
  M_COUNT,
  M_EMPTY = M_COUNT,
  M_PUBLISH
};

typedef struct fb {
  bench_t *b;
  skv_ctx_t *ctx;
  int rank, npes, peer, dev;
  skv_kv_t *kv;
  skv_namespace_t *ns;
  skv_geometry_t g;
  int preset;
  uint64_t ps, pool, nb, max_batch;
  void *layers[64];
  skv_layout_t *lay;
  char *dst;                            /* contiguous destination of the copy-engine baselines */
  skv_page_ref_t *peer_refs, *own_refs; /* [pool] */
  cudaStream_t st;
  cudaEvent_t e0, e1;
  volatile uint32_t *flag, *open_flag;
  uint64_t rng;
  void **bdst, **bsrc; /* cudaMemcpyBatchAsync: one copy per (page, tensor, block) */
  size_t *bsize;
  skv_key_t *pkeys;  /* publish: fresh keys for a batch */
  uint64_t pub_next; /* publish: the next fresh page id */
} fb_t;

#define BCUDA(call) SKV_CUDA_CHECK((call), SKV_SUBSYS_BENCH)

/* ---- one page size: the cache, a pool of published pages on every PE, the engine ---------- */

/* Pages of `ps` bytes: 16 tokens x 8 KV heads x 128 x bf16 (Llama-3-8B's shape), as many layers
 * as fit (16 KiB: 2 heads, 1 layer). */
static skv_geometry_t geom_for(uint64_t ps) {
  skv_geometry_t g = SKV_GEOMETRY_INIT;
  g.kv_kind = SKV_KV_SPLIT;
  g.head_dim = 128;
  g.elem_bytes = 2;
  g.page_tokens = 16;
  g.num_kv_heads = ps < (64u << 10) ? (uint32_t)(ps / (16 * 2 * 128 * 2)) : 8;
  g.num_layers = ps < (64u << 10) ? 1 : (uint32_t)(ps / (64u << 10));
  return g;
}

static void shuffle_prefix(uint64_t *v, uint64_t n, uint64_t k, uint64_t *s) {
  for (uint64_t i = 0; i < k && i + 1 < n; i++) {
    uint64_t j = i + bench_rand(s) % (n - i), t = v[i];
    v[i] = v[j];
    v[j] = t;
  }
}

static int fb_setup(fb_t *f, uint64_t ps, uint64_t max_batch_bytes) {
  f->g = geom_for(ps);
  uint64_t pb;
  SKV_CHECK(skv_geometry_get_page_bytes(&f->g, &pb));
  if (pb != ps)
    return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_BENCH,
                    "page size %llu is not 16 KiB or a multiple of 64 KiB", (unsigned long long)ps);
  f->ps = ps;
  f->max_batch = SKV_MIN(4096, SKV_MAX(1, max_batch_bytes / ps));
  f->pool = SKV_MAX(2 * f->max_batch, ((512ull << 20) + ps - 1) / ps);
  f->nb = SKV_MAX(2 * f->max_batch, SKV_MIN(4096, f->pool));
  skv_kv_opts_t o = SKV_KV_OPTS_INIT;
  o.backend = SKV_BACKEND_CUDA;
  o.pages_per_pe = f->pool;
  SKV_CHECK(skv_kv_create(f->ctx, &f->g, &o, &f->kv));
  SKV_CHECK(skv_namespace_create("bench-fetch", &f->g, NULL, 0, "bench", 5, &f->ns));
  uint64_t lb;
  SKV_CHECK(skv_layout_get_preset_layer_bytes(&f->g, f->preset, 16, f->nb, &lb));
  /* fresh random bytes (never zeros), repeated over the engine */
  const size_t rb = 64u << 20;
  uint8_t *rnd = malloc(rb);
  if (!rnd) return SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_BENCH, "out of memory");
  for (size_t i = 0; i < rb / 8; i++) ((uint64_t *)rnd)[i] = bench_rand(&f->rng);
  memset(f->layers, 0, sizeof f->layers);
  for (uint32_t l = 0; l < f->g.num_layers; l++) {
    BCUDA(cudaMalloc(&f->layers[l], lb));
    for (uint64_t o2 = 0; o2 < lb; o2 += rb / 2) /* rotated windows of the random bytes */
      BCUDA(cudaMemcpy((char *)f->layers[l] + o2, rnd + (o2 / (rb / 2) * 4096 + l * 64) % (rb / 2),
                       SKV_MIN(rb / 2, lb - o2), cudaMemcpyHostToDevice));
  }
  free(rnd);
  SKV_CHECK(skv_layout_create_preset(&f->g, f->preset, 16, f->nb, f->layers, f->dev, &f->lay));
  BCUDA(cudaMalloc((void **)&f->dst, f->max_batch * ps));
  const size_t ncopies = f->max_batch * f->g.num_layers * 2;
  f->bdst = malloc(ncopies * sizeof *f->bdst);
  f->bsrc = malloc(ncopies * sizeof *f->bsrc);
  f->bsize = malloc(ncopies * sizeof *f->bsize);
  f->pkeys = malloc(f->max_batch * sizeof *f->pkeys);
  /* every PE publishes its pool (the GPU path), page i from block i % nb */
  skv_key_t *keys = malloc(4096 * sizeof *keys);
  uint64_t *blocks = malloc(4096 * sizeof *blocks);
  f->peer_refs = malloc(f->pool * sizeof *f->peer_refs);
  f->own_refs = malloc(f->pool * sizeof *f->own_refs);
  if (!keys || !blocks || !f->peer_refs || !f->own_refs || !f->pkeys)
    return SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_BENCH, "out of memory");
  for (uint64_t i = 0; i < f->pool; i += 4096) {
    uint64_t n = SKV_MIN(4096, f->pool - i);
    for (uint64_t j = 0; j < n; j++) {
      uint64_t id = ((uint64_t)f->rank << 40) | (i + j);
      skv_namespace_hash_bytes(f->ns, &id, sizeof id, &keys[j]);
      blocks[j] = (i + j) % f->nb;
    }
    size_t ins;
    SKV_CHECK(skv_kv_publish(f->kv, f->ns, keys, n, f->lay, blocks, f->st, &ins));
  }
  SKV_CHECK(skv_kv_sync(f->kv));
  SKV_CHECK(skv_ctx_barrier(f->ctx));
  for (int who = 0; who < 2; who++) {
    int pe = who ? f->rank : f->peer;
    skv_page_ref_t *refs = who ? f->own_refs : f->peer_refs;
    for (uint64_t i = 0; i < f->pool; i += 4096) {
      uint64_t n = SKV_MIN(4096, f->pool - i);
      for (uint64_t j = 0; j < n; j++) {
        uint64_t id = ((uint64_t)pe << 40) | (i + j);
        skv_namespace_hash_bytes(f->ns, &id, sizeof id, &keys[j]);
      }
      size_t nhit;
      SKV_CHECK(skv_kv_lookup(f->kv, f->ns, keys, n, 0, refs + i, &nhit));
      if (nhit != n)
        return SKV_FAIL(SKV_EINTERNAL, SKV_SUBSYS_BENCH, "PE %d's pool: found %zu of %llu pages",
                        pe, nhit, (unsigned long long)n);
    }
  }
  free(keys);
  free(blocks);
  return 0;
}

static int fb_teardown(fb_t *f) {
  skv_layout_destroy(f->lay);
  for (uint32_t l = 0; l < f->g.num_layers; l++)
    if (f->layers[l]) cudaFree(f->layers[l]);
  if (f->dst) cudaFree(f->dst);
  free(f->peer_refs);
  free(f->own_refs);
  free(f->bdst);
  free(f->bsrc);
  free(f->bsize);
  free(f->pkeys);
  f->bdst = f->bsrc = NULL;
  f->bsize = NULL;
  f->pkeys = NULL;
  skv_namespace_destroy(f->ns);
  int rc = skv_kv_destroy(f->kv);
  f->kv = NULL;
  f->lay = NULL;
  f->dst = NULL;
  f->peer_refs = f->own_refs = NULL;
  return rc;
}

/* ---- timing --------------------------------------------------------------------------------- */

typedef struct batch {
  uint32_t n;
  skv_page_ref_t *refs[WARM + MAX_REPS];  /* peer pages */
  skv_page_ref_t *local[WARM + MAX_REPS]; /* own pages */
  uint64_t *blocks[WARM + MAX_REPS];
  uint64_t off[WARM + MAX_REPS];  /* contiguous copies: byte offset in the pool */
  uint64_t doff[WARM + MAX_REPS]; /* and in the destination (the _COLD methods) */
} batch_t;

static void batch_free(batch_t *bt, int reps) {
  for (int r = 0; r < WARM + reps; r++) {
    free(bt->refs[r]);
    free(bt->local[r]);
    free(bt->blocks[r]);
  }
}

/* Random distinct pages and blocks for every repetition. */
static int batch_make(fb_t *f, batch_t *bt, uint32_t n, int reps) {
  memset(bt, 0, sizeof *bt);
  bt->n = n;
  uint64_t *pi = malloc(f->pool * sizeof *pi), *bi = malloc(f->nb * sizeof *bi);
  if (!pi || !bi) return SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_BENCH, "out of memory");
  for (uint64_t i = 0; i < f->pool; i++) pi[i] = i;
  for (uint64_t i = 0; i < f->nb; i++) bi[i] = i;
  for (int r = 0; r < WARM + reps; r++) {
    bt->refs[r] = malloc(n * sizeof(skv_page_ref_t));
    bt->local[r] = malloc(n * sizeof(skv_page_ref_t));
    bt->blocks[r] = malloc(n * sizeof(uint64_t));
    if (!bt->refs[r] || !bt->local[r] || !bt->blocks[r])
      return SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_BENCH, "out of memory");
    shuffle_prefix(pi, f->pool, n, &f->rng);
    for (uint32_t i = 0; i < n; i++) bt->refs[r][i] = f->peer_refs[pi[i]];
    shuffle_prefix(pi, f->pool, n, &f->rng);
    for (uint32_t i = 0; i < n; i++) bt->local[r][i] = f->own_refs[pi[i]];
    shuffle_prefix(bi, f->nb, n, &f->rng);
    memcpy(bt->blocks[r], bi, n * sizeof(uint64_t));
    uint64_t span = f->pool - n + 1;
    bt->off[r] = (bench_rand(&f->rng) % span) * f->kv->page_stride;
    bt->doff[r] = (bench_rand(&f->rng) % (f->max_batch - n + 1)) * f->ps;
  }
  free(pi);
  free(bi);
  return 0;
}

static int run_op(fb_t *f, int method, const batch_t *bt, int r) {
  const uint64_t bytes = (uint64_t)bt->n * f->ps;
  skv_kv_t *kv = f->kv;
  switch (method) {
  case M_FETCH:
    return skv_kv_fetch(kv, bt->refs[r], bt->n, f->lay, bt->blocks[r], 0, f->st);
  case M_LOCAL:
    return skv_kv_fetch(kv, bt->local[r], bt->n, f->lay, bt->blocks[r], 0, f->st);
  case M_CE:
  case M_CE_LOCAL:
  case M_CE_COLD:
  case M_CE_LOCAL_COLD: {
    const bool peer = method == M_CE || method == M_CE_COLD;
    const bool cold = method == M_CE_COLD || method == M_CE_LOCAL_COLD;
    const char *src =
        (const char *)skv__kv_page(kv, (uint32_t)(peer ? f->peer : f->rank), 0) + bt->off[r];
    BCUDA(cudaMemcpyAsync(f->dst + (cold ? bt->doff[r] : 0), src, bytes, cudaMemcpyDeviceToDevice,
                          f->st));
    return 0;
  }
  case M_PUBLISH: { /* pages never published before (ids past the pool's), LRU pages evicted */
    for (uint32_t i = 0; i < bt->n; i++) {
      const uint64_t id = ((uint64_t)f->rank << 40) | (1ull << 39) | f->pub_next++;
      skv_namespace_hash_bytes(f->ns, &id, sizeof id, &f->pkeys[i]);
    }
    size_t ins = 0;
    SKV_CHECK(skv_kv_publish(kv, f->ns, f->pkeys, bt->n, f->lay, bt->blocks[r], f->st, &ins));
    if (ins != bt->n)
      return SKV_FAIL(SKV_EINTERNAL, SKV_SUBSYS_BENCH, "publish: %zu of %u pages queued", ins,
                      bt->n);
    return 0;
  }
  case M_EMPTY: /* a kernel that does nothing: the floor of these measurements */
    BCUDA((cudaError_t)skv__kv_gate_launch(f->st, f->open_flag, 0, 0));
    return 0;
  case M_CE_BATCH: { /* the copy engines on the same runs, one call (blocks dense in pages) */
    const skv_layout_t *l = f->lay;
    const uint64_t part = l->run_bytes, slab = (uint64_t)l->blocks_per_page * part;
    const uint32_t nt = l->num_layers * l->kvn, m = l->blocks_per_page;
    size_t c = 0;
    for (uint32_t i = 0; i < bt->n; i++) {
      const char *pg = skv__kv_page(kv, bt->refs[r][i].pe, bt->refs[r][i].page);
      for (uint32_t t = 0; t < nt; t++)
        for (uint32_t j = 0; j < m; j++, c++) {
          f->bsrc[c] = (void *)(pg + t * slab + j * part);
          f->bdst[c] = l->base[t] + bt->blocks[r][i * m + j] * l->stride_block * l->geom.elem_bytes;
          f->bsize[c] = part;
        }
    }
    struct cudaMemcpyAttributes at;
    memset(&at, 0, sizeof at);
    at.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    size_t zero = 0;
    BCUDA(cudaMemcpyBatchAsync((void *const *)f->bdst, (const void *const *)f->bsrc, f->bsize, c,
                               &at, &zero, 1, f->st));
    return 0;
  }
  default:
    for (uint32_t i = 0; i < bt->n; i++)
      BCUDA(cudaMemcpyAsync(f->dst + (uint64_t)i * f->ps,
                            skv__kv_page(kv, bt->refs[r][i].pe, bt->refs[r][i].page), f->ps,
                            cudaMemcpyDeviceToDevice, f->st));
    return 0;
  }
}

/* GPU time (seconds) of operations first..first+k-1 of `method`, enqueued behind one gate with
 * an event before the first and after the last. */
static int time_gated(fb_t *f, int method, const batch_t *bt, int first, int k, double *sec) {
  *f->flag = 0;
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
  BCUDA((cudaError_t)skv__kv_gate_launch(f->st, f->flag, GATE_MIN_NS, GATE_NS));
  BCUDA(cudaEventRecord(f->e0, f->st));
  double h0 = bench_now();
  int rc = 0;
  for (int i = 0; i < k && rc == 0; i++) rc = run_op(f, method, bt, first + i);
  double h1 = bench_now();
  BCUDA(cudaEventRecord(f->e1, f->st));
  __atomic_store_n((uint32_t *)f->flag, 1, __ATOMIC_SEQ_CST);
  BCUDA(cudaEventSynchronize(f->e1));
  if (rc) return rc;
  float ms;
  BCUDA(cudaEventElapsedTime(&ms, f->e0, f->e1));
  if (h1 - h0 > 0.5 * (double)GATE_NS * 1e-9)
    fprintf(stderr,
            "symkv-bench fetch: enqueueing took %.0f ms, longer than the gate holds: that time "
            "counts\n",
            (h1 - h0) * 1e3);
  *sec = (double)ms * 1e-3;
  return 0;
}

/* Median GPU time (seconds) of `method` over the repetitions, each behind a gate. */
static int time_op(fb_t *f, int method, const batch_t *bt, int reps, double *sec) {
  double t[MAX_REPS], x = 0;
  for (int r = 0; r < WARM + reps; r++) {
    SKV_CHECK(time_gated(f, method, bt, r, 1, &x));
    if (r >= WARM) t[r - WARM] = x;
  }
  *sec = bench_median(t, (size_t)reps);
  return 0;
}

/* time_op with kernel variant `v`; the variant `def` is restored afterwards, whatever happened,
 * and the cache synchronised. */
static int time_variant(fb_t *f, const skv__kv_variant_t *v, const skv__kv_variant_t *def,
                        int method, const batch_t *bt, int reps, double *sec) {
  int rc = skv__kv_variant_set(v);
  if (rc == 0) rc = time_op(f, method, bt, reps, sec);
  int r2 = skv__kv_variant_set(def);
  if (rc == 0) rc = r2;
  if (rc == 0) rc = skv_kv_sync(f->kv);
  return rc;
}

/* Back to back: B2B_K operations behind one gate; the time per operation (seconds, median over
 * groups). What an operation costs a stream that the host keeps fed, as in an engine's step:
 * launch processing overlaps the previous operation, the wait for that operation to complete
 * does not. Every operation reads batch r's own random pages (bt made with MAX_REPS
 * repetitions: 66 MiB of distinct 1 MiB batches, beyond the L2). B2B_K stays within the cache's
 * ring of argument slots, which the gate holds. */
#define B2B_K       8
static int time_b2b(fb_t *f, int method, const batch_t *bt, int reps, double *sec) {
  double t[MAX_REPS], x = 0;
  const int groups = (WARM + reps) / B2B_K;
  int ng = 0;
  for (int g = 0; g < groups; g++) {
    SKV_CHECK(skv_kv_sync(f->kv)); /* every slot back in the ring */
    SKV_CHECK(time_gated(f, method, bt, g * B2B_K, B2B_K, &x));
    if (g > 0) t[ng++] = x / B2B_K; /* group 0 warms up */
  }
  *sec = bench_median(t, (size_t)ng);
  return 0;
}

/* Wall time (seconds) of a call and its completion (host enqueue, GPU, stream synchronised;
 * for publish, the keys inserted too). */
/* The engine's work between two calls (a forward pass): the calling thread busy for `us`. */
static void busy_gap(double us) {
  const double end = bench_now() + us * 1e-6;
  while (us > 0 && bench_now() < end) {
  }
}

/* Calls to completion, wall time (median), with `gap_us` of busy work after each (untimed), and
 * each behind a kernel of `behind_ns` enqueued on the stream just before it (an engine's earlier
 * work still running; 0: none), timed from that kernel's enqueueing. */
static int time_e2e_at(fb_t *f, int method, const batch_t *bt, int reps, double gap_us,
                       uint64_t behind_ns, double *sec) {
  double t[MAX_REPS];
  for (int r = 0; r < WARM + reps; r++) {
    BCUDA(cudaStreamSynchronize(f->st));
    double h0 = bench_now();
    if (behind_ns)
      BCUDA((cudaError_t)skv__kv_gate_launch(f->st, f->open_flag, behind_ns, behind_ns));
    SKV_CHECK(run_op(f, method, bt, r));
    BCUDA(cudaStreamSynchronize(f->st));
    if (method == M_PUBLISH) SKV_CHECK(skv_kv_sync(f->kv)); /* the keys are in the index */
    if (r >= WARM) t[r - WARM] = bench_now() - h0;
    busy_gap(gap_us);
  }
  *sec = bench_median(t, (size_t)reps);
  return 0;
}

static int time_e2e_gap(fb_t *f, int method, const batch_t *bt, int reps, double gap_us,
                        double *sec) {
  return time_e2e_at(f, method, bt, reps, gap_us, 0, sec);
}

static int time_e2e(fb_t *f, int method, const batch_t *bt, int reps, double *sec) {
  return time_e2e_at(f, method, bt, reps, 0, 0, sec);
}

/* time_e2e's calls again (the same pages; for publish, fresh keys) with the cache's phase
 * counters on: where the time of a call and its completion goes, per call. */
static int breakdown_e2e_gap(fb_t *f, int method, const batch_t *bt, int reps, double gap_us,
                             breakdown_t *bd) {
  double gpu = 0, comp = 0;
  SKV_CHECK(skv_kv_sync(f->kv));
  for (int r = 0; r < WARM + reps; r++) {
    if (r == WARM) skv__kp_reset(&f->kv->prof, true), gpu = comp = 0;
    BCUDA(cudaStreamSynchronize(f->st));
    SKV_CHECK(run_op(f, method, bt, r));
    double h1 = bench_now();
    BCUDA(cudaStreamSynchronize(f->st));
    double h2 = bench_now();
    if (method == M_PUBLISH) SKV_CHECK(skv_kv_sync(f->kv));
    gpu += h2 - h1;
    comp += bench_now() - h2;
    busy_gap(gap_us);
  }
  breakdown_take(f->kv, bd, reps);
  skv__kp_reset(&f->kv->prof, false);
  bd->gpu_wait = gpu / reps;
  bd->completion_wait = method == M_PUBLISH ? comp / reps : -1;
  return skv_kv_sync(f->kv);
}

static int breakdown_e2e(fb_t *f, int method, const batch_t *bt, int reps, breakdown_t *bd) {
  return breakdown_e2e_gap(f, method, bt, reps, 0, bd);
}

/* ---- the command ---------------------------------------------------------------------------- */

static void size_name(uint64_t bytes, char *buf, size_t cap) {
  if (bytes >= (1u << 20) && bytes % (1u << 20) == 0)
    snprintf(buf, cap, "%lluMiB", (unsigned long long)(bytes >> 20));
  else
    snprintf(buf, cap, "%lluKiB", (unsigned long long)(bytes >> 10));
}

typedef struct cell {
  uint64_t ps;
  uint32_t n;
  double t[M_COUNT];
  double t_pub;                        /* skv_kv_publish of n pages (GPU time) */
  double t_local_mapped, t_pub_mapped; /* the same with arguments read over PCIe (>= 64 MiB) */
  double e2e_fetch, e2e_ce;            /* --e2e-cells: wall time of the fetch, of the CE copy */
} cell_t;

#define VEC  SKV_KV_KERNEL_VEC
#define BULK SKV_KV_KERNEL_BULK
#define CE   SKV_KV_KERNEL_CE
/* Kernel variants compared on a few cases; the first is the baseline of the others. */
static const skv__kv_variant_t variants_list[] = {
    {BULK, 4, 1, 128, SKV_KV_ARGS_AUTO, 0},  {VEC, 4, 4, 256, SKV_KV_ARGS_AUTO, 0},
    {CE, 4, 4, 256, SKV_KV_ARGS_AUTO, 0},    {VEC, 8, 4, 256, SKV_KV_ARGS_AUTO, 0},
    {VEC, 4, 4, 256, SKV_KV_ARGS_AUTO, 1},   {VEC, 4, 4, 256, SKV_KV_ARGS_MAPPED, 0},
    {VEC, 4, 4, 256, SKV_KV_ARGS_DEVICE, 0}, {VEC, 4, 8, 128, SKV_KV_ARGS_AUTO, 0},
};

/* Row KIND/SZ/xN of a cell: GB/s of `bytes` in t seconds, against `bytes` in tb seconds. */
static void cell_row(bench_t *b, const char *kind, const char *sz, unsigned n, double bytes,
                     double t, const char *baseline, double tb) {
  char name[128];
  snprintf(name, sizeof name, "%s/%s/x%u", kind, sz, n);
  bench_row(b, name, bytes / t / 1e9, "GB/s", "higher", baseline, bytes / tb / 1e9);
}

static int bench_fetch(bench_t *b) {
  const bool quick = bench_flag(b, "--quick");
  uint64_t sizes[16], batches[16];
  int nsizes = 0, nbatches = 0;
  const char *ss = bench_opt(b, "--page-sizes"), *bs = bench_opt(b, "--batches");
  if (bench_parse_list(ss      ? ss
                       : quick ? "64K,1M"
                               : "16K,64K,256K,1M,4M",
                       sizes, 16, &nsizes) ||
      nsizes == 0 ||
      bench_parse_list(bs      ? bs
                       : quick ? "1,16,1024"
                               : "1,4,16,64,256,1024,4096",
                       batches, 16, &nbatches) ||
      nbatches == 0)
    return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_BENCH,
                    "fetch: --page-sizes / --batches take comma lists (16K,64K,...)");
  const uint64_t max_bytes = (uint64_t)bench_opt_int(b, "--max-batch-bytes", 1ll << 30);
  const int reps = (int)bench_opt_int(b, "--reps", quick ? 10 : 15); /* 10..MAX_REPS */
  const char *layout = bench_opt(b, "--layout");
  int preset = SKV_LAYOUT_VLLM_FLASH_NHD;
  if (layout && strcmp(layout, "hnd") == 0)
    preset = SKV_LAYOUT_VLLM_FLASH_HND;
  else if (layout && strcmp(layout, "flashinfer") == 0)
    preset = SKV_LAYOUT_FLASHINFER_NHD;
  const bool variants = !bench_flag(b, "--no-variants");
  const bool e2e_cells = bench_flag(b, "--e2e-cells");

  skv_ctx_t *ctx;
  SKV_CHECK(skv_init(NULL, &ctx));
  const char *be = bench_opt(b, "--backend");
  const bool want_host = !be || strcmp(be, "cuda") != 0, want_cuda = !be || strcmp(be, "host") != 0;
  host_e2e_t he;
  memset(&he, 0, sizeof he);
  if (want_host) {
    int hr = host_e2e(b, ctx, reps, &he);
    if (hr == 0 && !want_cuda && skv_ctx_get_rank(ctx) == 0) {
      bench_config_int(b, "pes", skv_ctx_get_world_size(ctx));
      bench_config_int(b, "reps", reps);
      host_e2e_rows(b, &he);
      hr = bench_report(b);
    }
    if (hr || !want_cuda) {
      int r2 = skv_finalize(ctx);
      return hr ? hr : r2;
    }
  }
  fb_t f;
  memset(&f, 0, sizeof f);
  f.b = b;
  f.ctx = ctx;
  f.rank = skv_ctx_get_rank(ctx);
  f.npes = skv_ctx_get_world_size(ctx);
  f.peer = f.npes > 1 ? (f.rank + 1) % f.npes : f.rank;
  f.preset = preset;
  f.rng = 0x5eed0000ull + (uint64_t)f.rank;
  int rc = skv_ctx_set_timeout_ms(ctx, 900000); /* PEs other than 0 wait while it measures */
  f.dev = rc == 0 ? skv_ctx_get_device(ctx) : rc;
  if (f.dev < 0) {
    skv_finalize(ctx);
    return f.dev;
  }
  BCUDA(cudaStreamCreateWithFlags(&f.st, cudaStreamNonBlocking));
  BCUDA(cudaEventCreate(&f.e0));
  BCUDA(cudaEventCreate(&f.e1));
  uint32_t *flag;
  BCUDA(cudaHostAlloc((void **)&flag, 64, cudaHostAllocMapped));
  f.flag = flag;
  f.open_flag = flag + 8;
  flag[8] = 1;
  struct cudaDeviceProp prop;
  BCUDA(cudaGetDeviceProperties(&prop, f.dev));
  /* PEs on one GPU (fewer GPUs than PEs): the "peer" rows then read this GPU's own memory. */
  char bus[32] = "";
  int same_gpu = 0;
  BCUDA(cudaDeviceGetPCIBusId(bus, (int)sizeof bus, f.dev));
  char *buses = calloc((size_t)f.npes, sizeof bus);
  if (!buses) rc = SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_BENCH, "fetch: out of memory");
  if (rc == 0) rc = skv_ctx_allgather(ctx, bus, buses, sizeof bus);
  if (rc == 0 && f.peer != f.rank) same_gpu = strcmp(buses + (size_t)f.peer * sizeof bus, bus) == 0;
  free(buses);
  if (same_gpu && f.rank == 0)
    fprintf(stderr,
            "symkv-bench fetch: PE %d is on this PE's GPU (%s): the peer rows read this GPU's own "
            "memory, not NVLink; run with one GPU per PE\n",
            f.peer, bus);
  skv__kv_variant_t def_var;
  skv__kv_variant_get(&def_var);

  cell_t cells[16 * 16];
  int ncells = 0;
  double ce_large[16] = {0}; /* per page size: copy-engine bandwidth of its largest batch */
  /* variants: (page size, batch) cases x variants, the time of each */
  const uint64_t var_cases[][2] = {{64u << 10, 16},    {64u << 10, 1024}, {16u << 10, 4096},
                                   {256u << 10, 4096}, {1u << 20, 256},   {4u << 20, 256}};
  enum { NCASES = sizeof var_cases / sizeof var_cases[0] };
  const int nvar = variants ? (quick ? 4 : (int)SKV_ARRAY_LEN(variants_list)) : 0;
  double var_t[NCASES][SKV_ARRAY_LEN(variants_list)];
  memset(var_t, 0, sizeof var_t);
  /* fetch_e2e behind a kernel of BEHIND_US[k] (shorter and longer than the pins of 1024 pages) */
  static const unsigned behind_us[] = {5, 20, 100};
  enum { NBEHIND = sizeof behind_us / sizeof behind_us[0] };
  double e2e_behind[NBEHIND] = {0}, e2e_behind_ce[NBEHIND] = {0};
  double e2e_fetch = 0, e2e_ce = 0, floor_empty = 0, e2e_big_fetch = 0, e2e_big_ce = 0,
         e2e_big_batch = 0, b2b_fetch = 0, b2b_ce = 0, b2b_empty = 0, e2e_big_pub = 0,
         e2e_big_ce_local = 0, e2e_big_ce_cold = 0, e2e_big_ce_local_cold = 0;
  int have_lat = 0;
  breakdown_t bd_big_fetch, bd_fetch, bd_big_pub;
  double e2e_big_pub_one = 0, t_pub_one = 0; /* publish of 64 KiB x1024 as one launch */
  /* the same publish with PUB_GAP_US of the engine's work after each call, without and with a
   * free reserve of its pages (skv_kv_set_free_reserve) */
  double e2e_pub_gap = 0, e2e_pub_reserve = 0;
  breakdown_t bd_pub_gap, bd_pub_reserve;
  memset(&bd_pub_gap, 0, sizeof bd_pub_gap);
  memset(&bd_pub_reserve, 0, sizeof bd_pub_reserve);
  memset(&bd_big_fetch, 0, sizeof bd_big_fetch);
  memset(&bd_fetch, 0, sizeof bd_fetch);
  memset(&bd_big_pub, 0, sizeof bd_big_pub);

  for (int si = 0; si < nsizes && rc == 0; si++) {
    rc = fb_setup(&f, sizes[si], max_bytes);
    const int first_cell = ncells;
    for (int bi = 0; bi < nbatches && rc == 0; bi++) {
      if (batches[bi] > f.max_batch || batches[bi] == 0) continue;
      cell_t *c = &cells[ncells];
      memset(c, 0, sizeof *c);
      c->ps = sizes[si];
      c->n = (uint32_t)batches[bi];
      if (f.rank == 0) {
        batch_t bt;
        rc = batch_make(&f, &bt, c->n, reps);
        for (int m = 0; m < M_COUNT && rc == 0; m++) {
          rc = time_op(&f, m, &bt, reps, &c->t[m]);
          if (rc && m == M_CE_BATCH) { /* a baseline this driver may not have */
            fprintf(stderr, "symkv-bench fetch: cudaMemcpyBatchAsync: %s\n", skv_last_error());
            c->t[m] = -1;
            rc = 0;
          }
        }
        if (rc == 0 && e2e_cells && !(c->ps == (64u << 10) && c->n == 1024)) {
          rc = time_e2e(&f, M_FETCH, &bt, reps, &c->e2e_fetch);
          if (rc == 0) rc = time_e2e(&f, M_CE, &bt, reps, &c->e2e_ce);
        }
        if (rc == 0 && c->ps == (64u << 10) && c->n == 1024) {
          rc = time_e2e(&f, M_FETCH, &bt, reps, &e2e_big_fetch);
          if (rc == 0) rc = breakdown_e2e(&f, M_FETCH, &bt, reps, &bd_big_fetch);
          if (rc == 0) rc = time_e2e(&f, M_CE, &bt, reps, &e2e_big_ce);
          if (rc == 0) rc = time_e2e(&f, M_CE_COLD, &bt, reps, &e2e_big_ce_cold);
          if (rc == 0 && time_e2e(&f, M_CE_BATCH, &bt, reps, &e2e_big_batch) != 0)
            e2e_big_batch = 0;
          for (int k = 0; k < NBEHIND && rc == 0; k++) {
            const uint64_t ns = behind_us[k] * 1000ull;
            rc = time_e2e_at(&f, M_FETCH, &bt, reps, 0, ns, &e2e_behind[k]);
            if (rc == 0) rc = time_e2e_at(&f, M_CE, &bt, reps, 0, ns, &e2e_behind_ce[k]);
          }
        }
        if (rc == 0 && c->ps == (64u << 10) && c->n == 16) {
          rc = time_op(&f, M_EMPTY, &bt, reps, &floor_empty);
          if (rc == 0) rc = time_e2e(&f, M_FETCH, &bt, reps, &e2e_fetch);
          if (rc == 0) rc = breakdown_e2e(&f, M_FETCH, &bt, reps, &bd_fetch);
          if (rc == 0) rc = time_e2e(&f, M_CE, &bt, reps, &e2e_ce);
          batch_t bb; /* back to back: fresh pages, MAX_REPS batches */
          if (rc == 0) rc = batch_make(&f, &bb, c->n, MAX_REPS);
          if (rc == 0) rc = time_b2b(&f, M_FETCH, &bb, MAX_REPS, &b2b_fetch);
          if (rc == 0) rc = time_b2b(&f, M_CE, &bb, MAX_REPS, &b2b_ce);
          if (rc == 0) rc = time_b2b(&f, M_EMPTY, &bb, MAX_REPS, &b2b_empty);
          batch_free(&bb, MAX_REPS);
          have_lat = 1;
        }
        batch_free(&bt, reps);
        if (rc == 0) rc = skv_kv_sync(f.kv);
        bench_progress(b, "fetch", si * nbatches + bi + 1, nsizes * nbatches);
      }
      ncells++;
      if (rc == 0 && f.rank == 0 && c->n * c->ps >= (16u << 20))
        ce_large[si] = (double)c->n * c->ps / c->t[M_CE];
    }
    /* kernel variants on a few cases of this page size */
    for (int k = 0; k < NCASES && rc == 0 && f.rank == 0; k++) {
      if (var_cases[k][0] != sizes[si] || var_cases[k][1] > f.max_batch) continue;
      batch_t bt;
      rc = batch_make(&f, &bt, (uint32_t)var_cases[k][1], reps);
      for (int v = 0; v < nvar && rc == 0; v++)
        rc = time_variant(&f, &variants_list[v], &def_var, M_FETCH, &bt, reps, &var_t[k][v]);
      batch_free(&bt, reps);
    }
    /* Local batches of >= 64 MiB read their arguments from a device copy (the default): the
     * same fetch with them read over PCIe (mapped), for comparison. */
    skv__kv_variant_t mapped = def_var;
    mapped.args = SKV_KV_ARGS_MAPPED;
    for (int i = first_cell; i < ncells && rc == 0 && f.rank == 0; i++) {
      cell_t *c = &cells[i];
      if ((uint64_t)c->n * c->ps < (64u << 20)) continue;
      batch_t bt;
      rc = batch_make(&f, &bt, c->n, reps);
      if (rc == 0) rc = time_variant(&f, &mapped, &def_var, M_LOCAL, &bt, reps, &c->t_local_mapped);
      batch_free(&bt, reps);
    }
    /* publish last: its new pages evict the pool's (fetches of this page size are done) */
    for (int i = first_cell; i < ncells && rc == 0 && f.rank == 0; i++) {
      cell_t *c = &cells[i];
      batch_t bt;
      rc = batch_make(&f, &bt, c->n, reps);
      if (rc == 0) rc = time_op(&f, M_PUBLISH, &bt, reps, &c->t_pub);
      if (rc == 0) rc = skv_kv_sync(f.kv);
      if (rc == 0 && (uint64_t)c->n * c->ps >= (64u << 20))
        rc = time_variant(&f, &mapped, &def_var, M_PUBLISH, &bt, reps, &c->t_pub_mapped);
      if (rc == 0 && c->ps == (64u << 10) && c->n == 1024) {
        rc = time_e2e(&f, M_PUBLISH, &bt, reps, &e2e_big_pub);
        if (rc == 0) rc = breakdown_e2e(&f, M_PUBLISH, &bt, reps, &bd_big_pub);
        /* the same as one launch (as before publishes were split): e2e and GPU time */
        const int split = skv__kv_pub_split;
        skv__kv_pub_split = 1;
        if (rc == 0) rc = time_e2e(&f, M_PUBLISH, &bt, reps, &e2e_big_pub_one);
        if (rc == 0) rc = skv_kv_sync(f.kv);
        if (rc == 0) rc = time_op(&f, M_PUBLISH, &bt, reps, &t_pub_one);
        if (rc == 0) rc = skv_kv_sync(f.kv);
        skv__kv_pub_split = split;
        if (rc == 0) rc = time_e2e_gap(&f, M_PUBLISH, &bt, reps, PUB_GAP_US, &e2e_pub_gap);
        if (rc == 0) rc = breakdown_e2e_gap(&f, M_PUBLISH, &bt, reps, PUB_GAP_US, &bd_pub_gap);
        if (rc == 0) rc = skv_kv_set_free_reserve(f.kv, c->n);
        if (rc == 0) rc = time_e2e_gap(&f, M_PUBLISH, &bt, reps, PUB_GAP_US, &e2e_pub_reserve);
        if (rc == 0) rc = breakdown_e2e_gap(&f, M_PUBLISH, &bt, reps, PUB_GAP_US, &bd_pub_reserve);
        if (rc == 0) rc = skv_kv_set_free_reserve(f.kv, 0);
        if (rc == 0) rc = time_e2e(&f, M_CE_LOCAL, &bt, reps, &e2e_big_ce_local);
        if (rc == 0) rc = time_e2e(&f, M_CE_LOCAL_COLD, &bt, reps, &e2e_big_ce_local_cold);
      }
      batch_free(&bt, reps);
    }
    int b2 = skv_ctx_barrier(ctx);
    if (f.kv) {
      int r2 = fb_teardown(&f);
      if (rc == 0) rc = r2;
    }
    if (rc == 0) rc = b2;
  }
  bench_progress_end(b);

  if (rc == 0 && f.rank == 0) {
    char vb[32];
    bench_config_int(b, "pes", f.npes);
    bench_config_str(b, "device", prop.name);
    bench_config_int(b, "sms", prop.multiProcessorCount);
    bench_config_int(b, "peer_on_same_gpu", same_gpu);
    bench_config_str(b, "variant", skv__kv_variant_name(NULL, vb, sizeof vb));
    bench_config_str(b, "layout",
                     preset == SKV_LAYOUT_VLLM_FLASH_HND   ? "vllm_flash_hnd"
                     : preset == SKV_LAYOUT_FLASHINFER_NHD ? "flashinfer_nhd"
                                                           : "vllm_flash_nhd");
    bench_config_int(b, "reps", reps);
    bench_config_int(b, "max_batch_bytes", (long long)max_bytes);
    bench_config_str(b, "timing",
                     "GPU time between events, each operation enqueued behind a gate kernel; "
                     "random pages and blocks each repetition from a pool of >= 512 MiB; median");
    bench_config_str(b, "ce_batch",
                     "cudaMemcpyBatchAsync of the same (page, tensor, block) runs "
                     "(a copy-engine scatter; rows only where blocks are dense)");
    bench_config_str(b, "ce_copy",
                     "cudaMemcpyAsync device-to-device of n x page bytes, contiguous, from the "
                     "peer's heap through its symmetric address (the copy engines over NVLink)");
    fprintf(
        stderr,
        "symkv-bench fetch: %s, %d PEs, kernel variant %s (SKV_FETCH_UNROLL / _CTAS / _THREADS)\n",
        prop.name, f.npes, vb);
    char name[128], sz[32];
    for (int i = 0; i < ncells; i++) {
      cell_t *c = &cells[i];
      const double by = (double)c->n * (double)c->ps;
      size_name(c->ps, sz, sizeof sz);
      const char *peer = "copy-engine contiguous peer", *local = "copy-engine contiguous local";
      const char *peer_cold = "copy-engine contiguous peer, cold destination";
      const char *local_cold = "copy-engine contiguous local, cold destination";
      cell_row(b, "fetch", sz, c->n, by, c->t[M_FETCH], peer, c->t[M_CE]);
      cell_row(b, "fetch_vs_cold", sz, c->n, by, c->t[M_FETCH], peer_cold, c->t[M_CE_COLD]);
      cell_row(b, "memcpy_loop", sz, c->n, by, c->t[M_LOOP], peer, c->t[M_CE]);
      if (c->e2e_fetch > 0) /* fetch_e2e/64KiB/x1024 is printed below, whatever the flag */
        cell_row(b, "fetch_e2e", sz, c->n, by, c->e2e_fetch,
                 "cudaMemcpyAsync contiguous + sync, wall", c->e2e_ce);
      cell_row(b, "fetch_local", sz, c->n, by, c->t[M_LOCAL], local, c->t[M_CE_LOCAL]);
      cell_row(b, "ce_local_cold", sz, c->n, by, c->t[M_CE_LOCAL_COLD], local, c->t[M_CE_LOCAL]);
      cell_row(b, "fetch_local_vs_cold", sz, c->n, by, c->t[M_LOCAL], local_cold,
               c->t[M_CE_LOCAL_COLD]);
      if (c->t[M_CE_BATCH] > 0)
        cell_row(b, "ce_batch", sz, c->n, by, c->t[M_CE_BATCH], peer, c->t[M_CE]);
      if (c->t_pub > 0) {
        cell_row(b, "publish", sz, c->n, by, c->t_pub, local, c->t[M_CE_LOCAL]);
        cell_row(b, "publish_vs_cold", sz, c->n, by, c->t_pub, local_cold, c->t[M_CE_LOCAL_COLD]);
      }
      if (c->t_local_mapped > 0)
        cell_row(b, "fetch_local_mapped_args", sz, c->n, by, c->t_local_mapped,
                 "fetch_local (arguments copied to the GPU first)", c->t[M_LOCAL]);
      if (c->t_pub_mapped > 0)
        cell_row(b, "publish_mapped_args", sz, c->n, by, c->t_pub_mapped,
                 "publish (arguments copied to the GPU first)", c->t_pub);
    }
    /* the latency target: 1 MiB of 64 KiB pages within 1.5 x bytes / CE bandwidth + 5 us */
    double ce_bw = 0;
    for (int si = 0; si < nsizes; si++)
      if (sizes[si] == (64u << 10)) ce_bw = ce_large[si];
    for (int i = 0; i < ncells && have_lat; i++) {
      cell_t *c = &cells[i];
      if (c->ps != (64u << 10) || c->n != 16) continue;
      if (ce_bw > 0)
        bench_row(b, "fetch_latency/64KiB/x16", c->t[M_FETCH] * 1e6, "us", "lower",
                  "target 1.5 x bytes / CE bandwidth + 5 us", 1.5 * (1 << 20) / ce_bw * 1e6 + 5);
      bench_row(b, "fetch_latency_vs_ce/64KiB/x16", c->t[M_FETCH] * 1e6, "us", "lower",
                "copy-engine contiguous 1 MiB", c->t[M_CE] * 1e6);
      bench_row(b, "fetch_latency_e2e/64KiB/x16", e2e_fetch * 1e6, "us", "lower",
                "cudaMemcpyAsync 1 MiB + sync, wall", e2e_ce * 1e6);
      bench_row(b, "gpu_floor/empty_kernel", floor_empty * 1e6, "us", "lower",
                "fetch of 1 MiB of 64 KiB pages", c->t[M_FETCH] * 1e6);
      if (ce_bw > 0)
        bench_row(b, "fetch_latency_b2b/64KiB/x16", b2b_fetch * 1e6, "us", "lower",
                  "target 1.5 x bytes / CE bandwidth + 5 us", 1.5 * (1 << 20) / ce_bw * 1e6 + 5);
      bench_row(b, "fetch_latency_b2b_vs_ce/64KiB/x16", b2b_fetch * 1e6, "us", "lower",
                "copy-engine contiguous 1 MiB, back to back", b2b_ce * 1e6);
      bench_row(b, "gpu_floor_b2b/empty_kernel", b2b_empty * 1e6, "us", "lower",
                "fetch of 1 MiB of 64 KiB pages, back to back", b2b_fetch * 1e6);
    }
    if (e2e_big_fetch > 0)
      bench_row(b, "fetch_e2e/64KiB/x1024", (64.0 * 1024 * 1024) / e2e_big_fetch / 1e9, "GB/s",
                "higher", "cudaMemcpyAsync 64 MiB contiguous + sync, wall",
                (64.0 * 1024 * 1024) / e2e_big_ce / 1e9);
    if (e2e_big_fetch > 0 && e2e_big_ce_cold > 0)
      bench_row(b, "fetch_e2e_vs_cold/64KiB/x1024", (64.0 * 1024 * 1024) / e2e_big_fetch / 1e9,
                "GB/s", "higher",
                "cudaMemcpyAsync 64 MiB contiguous, cold destination + sync, wall",
                (64.0 * 1024 * 1024) / e2e_big_ce_cold / 1e9);
    for (int k = 0; k < NBEHIND; k++) {
      if (e2e_behind[k] <= 0) continue;
      char bn[96], bb[96];
      snprintf(bn, sizeof bn, "fetch_e2e_behind_%uus/64KiB/x1024", behind_us[k]);
      snprintf(bb, sizeof bb, "cudaMemcpyAsync 64 MiB behind the same %u us kernel + sync, wall",
               behind_us[k]);
      bench_row(b, bn, e2e_behind[k] * 1e6, "us", "lower", bb, e2e_behind_ce[k] * 1e6);
    }
    if (e2e_big_batch > 0)
      bench_row(b, "ce_batch_e2e/64KiB/x1024", (64.0 * 1024 * 1024) / e2e_big_batch / 1e9, "GB/s",
                "higher", "cudaMemcpyAsync 64 MiB contiguous + sync, wall",
                (64.0 * 1024 * 1024) / e2e_big_ce / 1e9);
    if (e2e_big_pub > 0)
      bench_row(b, "publish_e2e/64KiB/x1024", (64.0 * 1024 * 1024) / e2e_big_pub / 1e9, "GB/s",
                "higher", "cudaMemcpyAsync 64 MiB contiguous local + sync, wall",
                (64.0 * 1024 * 1024) / e2e_big_ce_local / 1e9);
    if (e2e_big_pub > 0 && e2e_big_ce_local_cold > 0)
      bench_row(b, "publish_e2e_vs_cold/64KiB/x1024", (64.0 * 1024 * 1024) / e2e_big_pub / 1e9,
                "GB/s", "higher",
                "cudaMemcpyAsync 64 MiB contiguous local, cold destination + sync, wall",
                (64.0 * 1024 * 1024) / e2e_big_ce_local_cold / 1e9);
    if (e2e_big_pub_one > 0 && e2e_big_pub > 0)
      bench_row(b, "publish_e2e_one_launch/64KiB/x1024",
                (64.0 * 1024 * 1024) / e2e_big_pub_one / 1e9, "GB/s", "higher",
                "publish_e2e (split into launches)", (64.0 * 1024 * 1024) / e2e_big_pub / 1e9);
    if (e2e_pub_gap > 0)
      bench_row(b, "publish_e2e_gap/64KiB/x1024", (64.0 * 1024 * 1024) / e2e_pub_gap / 1e9, "GB/s",
                "higher", "cudaMemcpyAsync 64 MiB contiguous local + sync, wall",
                (64.0 * 1024 * 1024) / e2e_big_ce_local / 1e9);
    if (e2e_pub_reserve > 0)
      bench_row(b, "publish_e2e_reserve/64KiB/x1024", (64.0 * 1024 * 1024) / e2e_pub_reserve / 1e9,
                "GB/s", "higher", "cudaMemcpyAsync 64 MiB contiguous local + sync, wall",
                (64.0 * 1024 * 1024) / e2e_big_ce_local / 1e9);
    for (int i = 0; i < ncells && t_pub_one > 0; i++)
      if (cells[i].ps == (64u << 10) && cells[i].n == 1024 && cells[i].t_pub > 0)
        bench_row(b, "publish_one_launch/64KiB/x1024", (64.0 * 1024 * 1024) / t_pub_one / 1e9,
                  "GB/s", "higher", "publish (split into launches)",
                  (64.0 * 1024 * 1024) / cells[i].t_pub / 1e9);
    if (want_host) host_e2e_rows(b, &he);
    breakdown_rows(b, "fetch_e2e/64KiB/x1024", &bd_big_fetch);
    breakdown_rows(b, "fetch_latency_e2e/64KiB/x16", &bd_fetch);
    breakdown_rows(b, "publish_e2e/64KiB/x1024", &bd_big_pub);
    breakdown_rows(b, "publish_e2e_gap/64KiB/x1024", &bd_pub_gap);
    breakdown_rows(b, "publish_e2e_reserve/64KiB/x1024", &bd_pub_reserve);
    char base[64], vn[48];
    snprintf(base, sizeof base, "variant %s",
             skv__kv_variant_name(&variants_list[0], vn, sizeof vn));
    for (int k = 0; k < NCASES && nvar > 0; k++) {
      if (var_t[k][0] <= 0) continue;
      double bytes = (double)var_cases[k][0] * (double)var_cases[k][1];
      size_name(var_cases[k][0], sz, sizeof sz);
      for (int v = 0; v < nvar; v++) {
        skv__kv_variant_name(&variants_list[v], vn, sizeof vn);
        snprintf(name, sizeof name, "variant/%s/%s/x%llu", vn, sz,
                 (unsigned long long)var_cases[k][1]);
        bench_row(b, name, bytes / var_t[k][v] / 1e9, "GB/s", "higher", base,
                  bytes / var_t[k][0] / 1e9);
      }
    }
    bench_report(b);
  }
  cudaFreeHost(flag);
  cudaEventDestroy(f.e0);
  cudaEventDestroy(f.e1);
  cudaStreamDestroy(f.st);
  int rc2 = skv_finalize(ctx);
  return rc ? rc : rc2;
}

#endif

static const bench_optspec_t fetch_opts[] = {
    {"--quick", BENCH_FLAG, NULL, NULL, "64K,1M x 1,16,1024, 10 repetitions, 4 variants", 0, 0,
     NULL},
    {"--page-sizes", BENCH_LIST, "LIST", "16K,64K,256K,1M,4M", "page sizes", 16384, 1ll << 30,
     NULL},
    {"--batches", BENCH_LIST, "LIST", "1,4,16,64,256,1024,4096", "pages per fetch", 1, 1 << 20,
     NULL},
    {"--max-batch-bytes", BENCH_INT, "N", "1G", "larger batches are skipped", 4096, 1ll << 40,
     NULL},
    {"--reps", BENCH_INT, "N", "15", "repetitions, the median is reported", 10, 64, NULL},
    {"--layout", BENCH_CHOICE, "L", "nhd", "the engine's layout", 0, 0, "nhd,hnd,flashinfer"},
    {"--no-variants", BENCH_FLAG, NULL, NULL, "skip the kernel variants", 0, 0, NULL},
    {"--e2e-cells", BENCH_FLAG, NULL, NULL,
     "fetch_e2e (call to synchronised, wall) of every page size and batch, not only 64K x1024", 0,
     0, NULL},
    {"--backend", BENCH_CHOICE, "B", "both",
     "host: the host backend's e2e rows only; cuda: the GPU "
     "rows only",
     0, 0, "host,cuda,both"},
    BENCH_OPTS_END,
};

const bench_cmd_t bench_cmd_fetch = {
    .name = "fetch",
    .run = bench_fetch,
    .summary =
        "GPU fetch of random peer pages (GB/s) vs the copy engine, a per-page cudaMemcpyAsync "
        "loop\n"
        "              and a local gather; 1 MiB latency; kernel variants (a build with CUDA)",
    .opts = fetch_opts,
};
