/* Multi-PE tests of the KV core on the host backend: publish/lookup/fetch round trips for
 * every layout preset and random geometries, deduplication, LRU eviction, pins (also of a PE
 * that died), stale references, bad input, and a long concurrent stress with invariants. */
#define _GNU_SOURCE
#include "skv_test.h"

#include "kv/kv.h"

#include <criterion/criterion.h>
#include <criterion/parameterized.h>
#include <errno.h>
#include <fcntl.h>
#include <malloc.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <stddef.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

TestSuite(kv, .timeout = 240);

/* ---- an engine cache in host memory, and an independent reference of its layout ---- */

typedef struct engine {
  skv_geometry_t g;
  int preset;
  uint32_t bt; /* block tokens */
  uint64_t nb; /* blocks */
  uint64_t layer_bytes;
  uint8_t **layers; /* [num_layers] (CONTIGUOUS: [0] only) */
  skv_layout_t *lay;
} engine_t;

static skv_geometry_t geom_make(uint32_t kind, uint32_t layers, uint32_t heads, uint32_t dim,
                                uint32_t eb, uint32_t pt) {
  skv_geometry_t g = SKV_GEOMETRY_INIT;
  g.kv_kind = kind;
  g.num_layers = layers;
  g.num_kv_heads = heads;
  g.head_dim = dim;
  g.elem_bytes = eb;
  g.page_tokens = pt;
  return g;
}

static int engine_new(engine_t *e, const skv_geometry_t *g, int preset, uint32_t bt, uint64_t nb) {
  memset(e, 0, sizeof *e);
  e->g = *g;
  e->preset = preset;
  e->bt = bt;
  e->nb = nb;
  if (skv_layout_get_preset_layer_bytes(g, preset, bt, nb, &e->layer_bytes) != 0) return -1;
  uint32_t nl = preset == SKV_LAYOUT_CONTIGUOUS ? 1 : g->num_layers;
  e->layers = calloc(g->num_layers, sizeof *e->layers);
  for (uint32_t l = 0; l < nl; l++)
    e->layers[l] = aligned_alloc(64, SKV_ALIGN_UP(e->layer_bytes, 64));
  return skv_layout_create_preset(g, preset, bt, nb, (void *const *)e->layers, -1, &e->lay);
}

static void engine_free(engine_t *e) {
  skv_layout_destroy(e->lay);
  uint32_t nl = e->preset == SKV_LAYOUT_CONTIGUOUS ? 1 : e->g.num_layers;
  for (uint32_t l = 0; l < nl; l++) free(e->layers[l]);
  free(e->layers);
}

static void engine_fill(engine_t *e, uint64_t seed) {
  uint32_t nl = e->preset == SKV_LAYOUT_CONTIGUOUS ? 1 : e->g.num_layers;
  for (uint32_t l = 0; l < nl; l++) {
    uint64_t s = seed + l;
    skv_test_fill_random(e->layers[l], e->layer_bytes, &s);
  }
}

static void engine_poison(engine_t *e) {
  uint32_t nl = e->preset == SKV_LAYOUT_CONTIGUOUS ? 1 : e->g.num_layers;
  for (uint32_t l = 0; l < nl; l++) memset(e->layers[l], 0xA5, e->layer_bytes);
}

/* Address of the vector (layer, kv, block, token, head) straight from the preset's shape. */
static uint8_t *ref_vec(const engine_t *e, uint32_t l, uint32_t kv, uint64_t b, uint32_t t,
                        uint32_t h) {
  const skv_geometry_t *g = &e->g;
  uint64_t H = g->num_kv_heads, D = g->head_dim, T = e->bt, NB = e->nb, eb = g->elem_bytes, idx;
  switch (e->preset) {
  case SKV_LAYOUT_VLLM_FLASH_NHD:
    idx = ((kv * NB + b) * T + t) * H + h;
    break;
  case SKV_LAYOUT_VLLM_FLASH_HND:
    idx = ((kv * NB + b) * H + h) * T + t;
    break;
  case SKV_LAYOUT_FLASHINFER_NHD:
    idx = ((b * 2 + kv) * T + t) * H + h;
    break;
  case SKV_LAYOUT_FLASHINFER_HND:
    idx = ((b * 2 + kv) * H + h) * T + t;
    break;
  case SKV_LAYOUT_MLA:
    idx = b * T + t;
    break;
  default: { /* CONTIGUOUS: blocks stored as pages */
    uint64_t kvn = g->kv_kind == SKV_KV_MLA ? 1 : 2;
    uint64_t block_vecs = g->num_layers * kvn * T * H;
    idx = b * block_vecs + ((l * kvn + kv) * T + t) * H + h;
    return e->layers[0] + idx * D * eb;
  }
  }
  return e->layers[l] + idx * D * eb;
}

/* Do page i of `src` (blocks sb[]) and of `dst` (blocks db[]) hold the same vectors? */
static int pages_equal(const engine_t *src, const uint64_t *sb, const engine_t *dst,
                       const uint64_t *db) {
  const skv_geometry_t *g = &src->g;
  uint32_t kvn = g->kv_kind == SKV_KV_MLA ? 1 : 2;
  size_t vb = (size_t)g->head_dim * g->elem_bytes;
  for (uint32_t l = 0; l < g->num_layers; l++)
    for (uint32_t kv = 0; kv < kvn; kv++)
      for (uint32_t t = 0; t < g->page_tokens; t++)
        for (uint32_t h = 0; h < g->num_kv_heads; h++)
          if (memcmp(ref_vec(src, l, kv, sb[t / src->bt], t % src->bt, h),
                     ref_vec(dst, l, kv, db[t / dst->bt], t % dst->bt, h), vb) != 0)
            return 0;
  return 1;
}

/* Are all vectors of blocks not in `used` still poison? */
static int untouched_outside(const engine_t *e, const uint8_t *used) {
  const skv_geometry_t *g = &e->g;
  uint32_t kvn = g->kv_kind == SKV_KV_MLA ? 1 : 2;
  size_t vb = (size_t)g->head_dim * g->elem_bytes;
  for (uint64_t b = 0; b < e->nb; b++) {
    if (used[b]) continue;
    for (uint32_t l = 0; l < g->num_layers; l++)
      for (uint32_t kv = 0; kv < kvn; kv++)
        for (uint32_t t = 0; t < e->bt; t++)
          for (uint32_t h = 0; h < g->num_kv_heads; h++) {
            const uint8_t *v = ref_vec(e, l, kv, b, t, h);
            for (size_t i = 0; i < vb; i++)
              if (v[i] != 0xA5) return 0;
          }
  }
  return 1;
}

static void pick_blocks(uint64_t nb, size_t n, uint64_t *out, uint64_t *s) {
  /* n distinct random block ids in [0, nb) */
  uint8_t *taken = calloc(nb, 1);
  for (size_t i = 0; i < n; i++) {
    uint64_t b;
    do b = skv_test_rand(s) % nb;
    while (taken[b]);
    taken[b] = 1;
    out[i] = b;
  }
  free(taken);
}

/* ---- round trips ---- */

typedef struct rt_param {
  int preset;
  uint32_t kind, layers, heads, dim, eb, pt, bt;
} rt_param_t;

static int pe_round_trip(int rank, int npes, void *arg) {
  rt_param_t *p = arg;
  skv_ctx_t *ctx;
  PE_CHECK(skv_test_init(&ctx, 30000) == 0, "init");
  skv_geometry_t g = geom_make(p->kind, p->layers, p->heads, p->dim, p->eb, p->pt);
  enum { NPAGES = 6 };
  uint32_t m = p->pt / p->bt;
  uint64_t nb = NPAGES * m * 3;
  skv_kv_opts_t o = SKV_KV_OPTS_INIT;
  o.pages_per_pe = 16;
  skv_kv_t *kv;
  PE_CHECK(skv_kv_create(ctx, &g, &o, &kv) == 0, "kv create");
  skv_namespace_t *ns;
  PE_CHECK(skv_namespace_create("test-model", &g, "tenant", 6, "secret", 6, &ns) == 0, "ns");
  engine_t src, dst;
  PE_CHECK(engine_new(&src, &g, p->preset, p->bt, nb) == 0, "src engine: %s", skv_last_error());
  PE_CHECK(engine_new(&dst, &g, p->preset, p->bt, nb) == 0, "dst engine");
  uint64_t seed = skv_test_seed(), seeds[SKV_TEST_MAX_PES];
  PE_CHECK(skv_ctx_allgather(ctx, &seed, seeds, sizeof seed) == 0, "seeds");
  engine_fill(&src, seed);
  /* tokens: distinct per PE, so every PE publishes its own chain */
  uint32_t tokens[NPAGES * 64];
  uint32_t ntok = NPAGES * p->pt;
  PE_CHECK(ntok <= sizeof tokens / sizeof tokens[0], "too many tokens");
  for (uint32_t i = 0; i < ntok; i++) tokens[i] = (uint32_t)(rank * 100000 + i);
  skv_key_t keys[NPAGES];
  size_t nk;
  PE_CHECK(skv_namespace_hash_tokens(ns, tokens, ntok, NULL, keys, NPAGES, &nk) == 0 &&
               nk == NPAGES,
           "hash");
  uint64_t sblocks[NPAGES * 8];
  uint64_t s = seed ^ 0x55;
  pick_blocks(nb, NPAGES * m, sblocks, &s);
  size_t ins;
  PE_CHECK(skv_kv_publish(kv, ns, keys, NPAGES, src.lay, sblocks, NULL, &ins) == 0 && ins == NPAGES,
           "publish");
  uint64_t all_blocks[SKV_TEST_MAX_PES][NPAGES * 8];
  PE_CHECK(skv_ctx_allgather(ctx, sblocks, all_blocks, sizeof sblocks) == 0, "blocks");
  /* fetch every other PE's chain (and our own) */
  for (int from = 0; from < npes; from++) {
    for (uint32_t i = 0; i < ntok; i++) tokens[i] = (uint32_t)(from * 100000 + i);
    skv_key_t fk[NPAGES + 1];
    PE_CHECK(skv_namespace_hash_tokens(ns, tokens, ntok, NULL, fk, NPAGES, &nk) == 0, "hash");
    fk[NPAGES] = fk[0];
    fk[NPAGES].lo ^= 1; /* a key nobody published ends the prefix */
    skv_page_ref_t refs[NPAGES + 1];
    size_t nhit;
    PE_CHECK(skv_kv_lookup(kv, ns, fk, NPAGES + 1, SKV_LOOKUP_PIN, refs, &nhit) == 0 &&
                 nhit == NPAGES,
             "lookup hit %zu", nhit);
    for (int i = 0; i < NPAGES; i++)
      PE_CHECK(refs[i].pe == (uint32_t)from, "page %d is on PE %u", i, refs[i].pe);
    engine_poison(&dst);
    uint64_t dblocks[NPAGES * 8];
    s = skv_test_seed();
    pick_blocks(nb, NPAGES * m, dblocks, &s);
    PE_CHECK(skv_kv_fetch(kv, refs, NPAGES, dst.lay, dblocks, SKV_FETCH_UNPIN, NULL) == 0, "fetch");
    engine_t ref;
    PE_CHECK(engine_new(&ref, &g, p->preset, p->bt, nb) == 0, "ref engine");
    engine_fill(&ref, seeds[from]);
    for (int i = 0; i < NPAGES; i++)
      PE_CHECK(pages_equal(&ref, &all_blocks[from][i * m], &dst, &dblocks[i * m]),
               "page %d from PE %d differs", i, from);
    uint8_t *used = calloc(nb, 1);
    for (uint32_t i = 0; i < NPAGES * m; i++) used[dblocks[i]] = 1;
    PE_CHECK(untouched_outside(&dst, used), "fetch wrote outside its blocks");
    free(used);
    engine_free(&ref);
  }
  PE_CHECK(skv_ctx_barrier(ctx) == 0, "barrier");
  skv_kv_stats_t st = SKV_KV_STATS_INIT;
  PE_CHECK(skv_kv_get_stats(kv, &st) == 0, "stats");
  skv_kv_stats_t unsized = {0};
  PE_CHECK(skv_kv_get_stats(kv, &unsized) == SKV_EINVAL &&
               strstr(skv_last_error(), "SKV_KV_STATS_INIT") && unsized.page_bytes == 0,
           "unsized stats: %s", skv_last_error());
  PE_CHECK(st.pages_pinned == 0 && st.pages_used == NPAGES, "pinned %llu used %llu",
           (unsigned long long)st.pages_pinned, (unsigned long long)st.pages_used);
  PE_CHECK(st.index_entries == (uint64_t)npes * NPAGES, "entries %llu",
           (unsigned long long)st.index_entries);
  engine_free(&src);
  engine_free(&dst);
  skv_namespace_destroy(ns);
  PE_CHECK(skv_kv_destroy(kv) == 0, "destroy");
  PE_CHECK(skv_finalize(ctx) == 0, "finalize");
  return 0;
}

ParameterizedTestParameters(kv, round_trip_every_preset) {
  static rt_param_t p[] = {
      {SKV_LAYOUT_VLLM_FLASH_NHD, SKV_KV_SPLIT, 3, 4, 64, 2, 32, 16},
      {SKV_LAYOUT_VLLM_FLASH_HND, SKV_KV_SPLIT, 2, 3, 128, 2, 16, 16},
      {SKV_LAYOUT_FLASHINFER_NHD, SKV_KV_SPLIT, 2, 2, 32, 4, 32, 8},
      {SKV_LAYOUT_FLASHINFER_HND, SKV_KV_SPLIT, 4, 1, 8, 1, 16, 4},
      {SKV_LAYOUT_MLA, SKV_KV_MLA, 3, 1, 576, 2, 16, 16},
      {SKV_LAYOUT_CONTIGUOUS, SKV_KV_SPLIT, 2, 2, 16, 2, 32, 32},
      {SKV_LAYOUT_CONTIGUOUS, SKV_KV_MLA, 2, 1, 72, 2, 16, 8},
  };
  return cr_make_param_array(rt_param_t, p, sizeof p / sizeof p[0]);
}

ParameterizedTest(rt_param_t *p, kv, round_trip_every_preset) {
  skv_test_job_t job;
  int bad = skv_test_run(&job, 3, pe_round_trip, p, 120000);
  cr_assert_eq(bad, 0, "PEs failed: %s", skv_test_statuses(&job));
}

Test(kv, round_trip_random_geometries) {
  uint64_t s = skv_test_seed();
  static const uint32_t dims[] = {1, 3, 8, 64, 128};
  for (int iter = 0; iter < 6; iter++) {
    rt_param_t p;
    p.preset = 1 + (int)(skv_test_rand(&s) % 6);
    p.kind = p.preset == SKV_LAYOUT_MLA                                     ? SKV_KV_MLA
             : (p.preset == SKV_LAYOUT_CONTIGUOUS && skv_test_rand(&s) % 2) ? SKV_KV_MLA
                                                                            : SKV_KV_SPLIT;
    p.layers = 1 + (uint32_t)(skv_test_rand(&s) % 4);
    p.heads = p.kind == SKV_KV_MLA ? 1 : 1 + (uint32_t)(skv_test_rand(&s) % 4);
    p.dim = dims[skv_test_rand(&s) % 5];
    p.eb = 1u << (skv_test_rand(&s) % 3);
    p.bt = 1u << (skv_test_rand(&s) % 4);
    p.pt = p.bt * (1 + (uint32_t)(skv_test_rand(&s) % 4));
    skv_test_job_t job;
    int bad = skv_test_run(&job, 2, pe_round_trip, &p, 120000);
    cr_assert_eq(bad, 0, "preset %d kind %u L%u H%u D%u eb%u pt%u bt%u: %s", p.preset, p.kind,
                 p.layers, p.heads, p.dim, p.eb, p.pt, p.bt, skv_test_statuses(&job));
  }
}

/* ---- a small shared fixture for the behaviour tests: CONTIGUOUS layout, 1 block = 1 page ---- */

typedef struct fix {
  skv_ctx_t *ctx;
  skv_kv_t *kv;
  skv_namespace_t *ns;
  skv_geometry_t g;
  engine_t eng;
  uint64_t page_bytes;
} fix_t;

static int fix_init(fix_t *f, uint64_t pages, uint64_t nb, int timeout_ms) {
  memset(f, 0, sizeof *f);
  if (skv_test_init(&f->ctx, timeout_ms)) return -1;
  f->g = geom_make(SKV_KV_SPLIT, 2, 2, 64, 2, 16); /* 8 KiB pages */
  skv_geometry_get_page_bytes(&f->g, &f->page_bytes);
  skv_kv_opts_t o = SKV_KV_OPTS_INIT;
  o.pages_per_pe = pages;
  if (skv_kv_create(f->ctx, &f->g, &o, &f->kv)) return -2;
  if (skv_namespace_create("fixture", &f->g, NULL, 0, "s3cret", 6, &f->ns)) return -3;
  return engine_new(&f->eng, &f->g, SKV_LAYOUT_CONTIGUOUS, 16, nb);
}

static void fix_fini(fix_t *f) {
  engine_free(&f->eng);
  skv_namespace_destroy(f->ns);
  skv_kv_destroy(f->kv);
  skv_finalize(f->ctx);
}

static skv_key_t key_of(const fix_t *f, uint64_t id) {
  skv_key_t k;
  skv_namespace_hash_bytes(f->ns, &id, sizeof id, &k);
  return k;
}

/* Block b holds a pattern derived from key id (so any reader can verify what it fetched). */
static void fill_block(fix_t *f, uint64_t b, uint64_t id) {
  uint64_t *w = (uint64_t *)(f->eng.layers[0] + b * f->page_bytes);
  for (uint64_t i = 0; i < f->page_bytes / 8; i++) w[i] = id * 0x9e3779b97f4a7c15ull + i;
}
static int block_holds(fix_t *f, uint64_t b, uint64_t id) {
  const uint64_t *w = (const uint64_t *)(f->eng.layers[0] + b * f->page_bytes);
  for (uint64_t i = 0; i < f->page_bytes / 8; i++)
    if (w[i] != id * 0x9e3779b97f4a7c15ull + i) return 0;
  return 1;
}

static int publish_ids(fix_t *f, const uint64_t *ids, size_t n, size_t *ins) {
  skv_key_t keys[64];
  uint64_t blocks[64];
  for (size_t i = 0; i < n; i++) {
    keys[i] = key_of(f, ids[i]);
    blocks[i] = i;
    fill_block(f, i, ids[i]);
  }
  return skv_kv_publish(f->kv, f->ns, keys, n, f->eng.lay, blocks, NULL, ins);
}

static int pe_dedup(int rank, int npes, void *arg) {
  fix_t f;
  PE_CHECK(fix_init(&f, 64, 64, 30000) == 0, "fixture: %s", skv_last_error());
  uint64_t ids[32];
  for (int i = 0; i < 32; i++) ids[i] = 1000 + (uint64_t)i;
  PE_CHECK(skv_ctx_barrier(f.ctx) == 0, "barrier");
  size_t ins = 0;
  PE_CHECK(publish_ids(&f, ids, 32, &ins) == 0, "publish");
  size_t all[SKV_TEST_MAX_PES];
  PE_CHECK(skv_ctx_allgather(f.ctx, &ins, all, sizeof ins) == 0, "ag");
  size_t total = 0;
  for (int r = 0; r < npes; r++) total += all[r];
  PE_CHECK(total == 32, "every key inserted exactly once in all: %zu", total);
  skv_kv_stats_t st = SKV_KV_STATS_INIT;
  skv_kv_get_stats(f.kv, &st);
  PE_CHECK(st.pages_used == ins, "losers freed their pages: used %llu inserted %zu",
           (unsigned long long)st.pages_used, ins);
  PE_CHECK(st.index_entries == 32, "entries %llu", (unsigned long long)st.index_entries);
  PE_CHECK(skv__index_check(&f.kv->index) == 32, "index walker");
  /* and every key reads back its own data wherever it lives */
  skv_key_t keys[32];
  for (int i = 0; i < 32; i++) keys[i] = key_of(&f, ids[i]);
  skv_page_ref_t refs[32];
  size_t nhit;
  PE_CHECK(skv_kv_lookup(f.kv, f.ns, keys, 32, 0, refs, &nhit) == 0 && nhit == 32, "lookup");
  uint64_t blocks[32];
  for (int i = 0; i < 32; i++) blocks[i] = 32 + (uint64_t)i;
  PE_CHECK(skv_kv_fetch(f.kv, refs, 32, f.eng.lay, blocks, 0, NULL) == 0, "fetch");
  for (int i = 0; i < 32; i++) PE_CHECK(block_holds(&f, blocks[i], ids[i]), "key %d content", i);
  PE_CHECK(skv_ctx_barrier(f.ctx) == 0, "barrier");
  fix_fini(&f);
  return 0;
}

Test(kv, concurrent_publish_of_the_same_keys_is_deduplicated) {
  skv_test_job_t job;
  int bad = skv_test_run(&job, 4, pe_dedup, NULL, 120000);
  cr_assert_eq(bad, 0, "PEs failed: %s", skv_test_statuses(&job));
}

/* Publishes of more than one window (256 keys): a helper thread claims the next window's keys
 * while this window's pages are taken and copied (SKV_PUBLISH_HELPER). */
enum { WIN_N = 700 };

static int publish_many(fix_t *f, const uint64_t *ids, size_t n, size_t *ins) {
  static skv_key_t keys[WIN_N];
  static uint64_t blocks[WIN_N];
  for (size_t i = 0; i < n; i++) {
    keys[i] = key_of(f, ids[i]);
    blocks[i] = i;
    fill_block(f, i, ids[i]);
  }
  return skv_kv_publish(f->kv, f->ns, keys, n, f->eng.lay, blocks, NULL, ins);
}

/* How many of ids[0..n) are found, and whether each found one reads back its own bytes. */
static size_t found_intact(fix_t *f, const uint64_t *ids, size_t n, bool *intact) {
  static skv_key_t keys[WIN_N];
  static skv_page_ref_t refs[WIN_N];
  static uint64_t blocks[WIN_N];
  static uint64_t hit_ids[WIN_N];
  size_t nhit = 0, h = 0;
  for (size_t i = 0; i < n; i++) keys[i] = key_of(f, ids[i]);
  *intact = skv_kv_lookup(f->kv, f->ns, keys, n, SKV_LOOKUP_PIN, refs, &nhit) == 0;
  /* refs are the hits in key order: match them back through the pages' keys */
  for (size_t i = 0; i < n && *intact; i++) {
    size_t one = 0;
    skv_page_ref_t r;
    if (skv_kv_lookup(f->kv, f->ns, &keys[i], 1, 0, &r, &one) != 0) *intact = false;
    if (one) hit_ids[h++] = ids[i];
  }
  *intact = *intact && h == nhit;
  for (size_t i = 0; i < nhit; i++) blocks[i] = (uint64_t)i;
  if (*intact && nhit)
    *intact = skv_kv_fetch(f->kv, refs, nhit, f->eng.lay, blocks, SKV_FETCH_UNPIN, NULL) == 0;
  for (size_t i = 0; i < nhit && *intact; i++) *intact = block_holds(f, blocks[i], hit_ids[i]);
  return nhit;
}

static int pe_windows(int rank, int npes, void *arg) {
  (void)rank, (void)npes, (void)arg;
  fix_t f;
  static uint64_t ids[WIN_N];
  size_t ins = 0;
  bool intact;
  skv_kv_stats_t st = SKV_KV_STATS_INIT;
  /* 1. keys repeated across windows (id i % 500) and a second publish of them all */
  PE_CHECK(fix_init(&f, 2000, WIN_N, 30000) == 0, "fixture: %s", skv_last_error());
  for (size_t i = 0; i < WIN_N; i++) ids[i] = 5000 + i % 500;
  PE_CHECK(publish_many(&f, ids, WIN_N, &ins) == 0 && ins == 500,
           "700 keys of 500 distinct ones: %zu inserted (%s)", ins, skv_last_error());
  PE_CHECK(publish_many(&f, ids, WIN_N, &ins) == 0 && ins == 0, "again: %zu inserted", ins);
  skv_kv_get_stats(f.kv, &st);
  PE_CHECK(st.index_entries == 500 && st.pages_used == 500, "entries %llu, pages %llu",
           (unsigned long long)st.index_entries, (unsigned long long)st.pages_used);
  /* a repeat of a key of the window before is cached by then, as without the helper: not a
   * publish that lost a race (deduplicated counts those) */
  PE_CHECK(st.deduplicated == 0, "deduplicated %llu", (unsigned long long)st.deduplicated);
  PE_CHECK(found_intact(&f, ids, 500, &intact) == 500 && intact, "the 500 keys read back");
  fix_fini(&f);
  /* 2. a window that finds too few pages (200 of 300 pinned): the publish goes back to the keys
   * it had no page for, and the claims the helper made meanwhile for the window after it are
   * given back; every key is inserted in turn, the last 100 stay */
  PE_CHECK(fix_init(&f, 300, WIN_N, 30000) == 0, "fixture: %s", skv_last_error());
  static uint64_t pinned[200];
  for (size_t i = 0; i < 200; i++) pinned[i] = 100 + i;
  PE_CHECK(publish_many(&f, pinned, 200, &ins) == 0 && ins == 200, "200: %zu", ins);
  static skv_key_t pk[200];
  static skv_page_ref_t prefs[200];
  size_t nhit = 0;
  for (size_t i = 0; i < 200; i++) pk[i] = key_of(&f, pinned[i]);
  PE_CHECK(skv_kv_lookup(f.kv, f.ns, pk, 200, SKV_LOOKUP_PIN, prefs, &nhit) == 0 && nhit == 200,
           "pin 200: %zu", nhit);
  for (size_t i = 0; i < WIN_N; i++) ids[i] = 10000 + i;
  PE_CHECK(publish_many(&f, ids, WIN_N, &ins) == 0 && ins == WIN_N,
           "700 keys through 100 pages: %zu inserted (%s)", ins, skv_last_error());
  skv_kv_get_stats(f.kv, &st);
  PE_CHECK(st.index_entries == 300 && st.pages_used == 300, "entries %llu, pages %llu",
           (unsigned long long)st.index_entries, (unsigned long long)st.pages_used);
  PE_CHECK(found_intact(&f, ids + 600, 100, &intact) == 100 && intact, "the last 100 stay");
  PE_CHECK(found_intact(&f, ids, 600, &intact) == 0 && intact, "the others went");
  PE_CHECK(skv_kv_unpin(f.kv, prefs, 200) == 0, "unpin: %s", skv_last_error());
  /* a claim left behind would keep its key out of the cache (an older live claim wins) */
  PE_CHECK(publish_many(&f, ids + 256, 200, &ins) == 0 && ins == 200,
           "keys of the window claimed meanwhile, again: %zu inserted", ins);
  PE_CHECK(skv__index_check(&f.kv->index) == 300, "index walker");
  /* 3. no page at all (every page pinned): the publish stops at its first window, and the claims
   * of the second, made meanwhile, are given back */
  static skv_page_ref_t all[300];
  static skv_key_t allk[300];
  for (size_t i = 0; i < 300; i++) /* what is cached now: the last two publishes' keys */
    allk[i] = key_of(&f, i < 200 ? ids[256 + i] : ids[600 + i - 200]);
  size_t nhit2 = 0; /* a lookup finds a prefix: the two runs apart */
  PE_CHECK(skv_kv_lookup(f.kv, f.ns, allk, 200, SKV_LOOKUP_PIN, all, &nhit) == 0 &&
               skv_kv_lookup(f.kv, f.ns, allk + 200, 100, SKV_LOOKUP_PIN, all + 200, &nhit2) == 0,
           "pin all: %s", skv_last_error());
  PE_CHECK(nhit == 200 && nhit2 == 100, "300 pinned: %zu + %zu", nhit, nhit2);
  for (size_t i = 0; i < WIN_N; i++) ids[i] = 50000 + i;
  PE_CHECK(publish_many(&f, ids, WIN_N, &ins) == SKV_ENOSPC && ins == 0,
           "no page: %zu inserted (%s)", ins, skv_last_error());
  PE_CHECK(skv_kv_unpin(f.kv, all, 300) == 0, "unpin: %s", skv_last_error());
  PE_CHECK(publish_many(&f, ids + 256, 256, &ins) == 0 && ins == 256,
           "the second window's keys, again: %zu inserted", ins);
  fix_fini(&f);
  /* 4. keys cached at the back of the batch, on the least recently used pages: the first
   * window's allocation evicts them, and they are cached again by the batch, as when each
   * window's claims came after the allocation before (a helper claims them meanwhile and may
   * find them still cached: in the opposite order of their eviction, so that it does) */
  PE_CHECK(fix_init(&f, 512, WIN_N, 30000) == 0, "fixture: %s", skv_last_error());
  static uint64_t b_ids[256];
  for (size_t i = 0; i < 256; i++) b_ids[i] = 60000 + i;
  PE_CHECK(publish_many(&f, b_ids, 256, &ins) == 0 && ins == 256, "B: %zu", ins);
  for (int round = 0; round < 4; round++) {
    for (size_t i = 0; i < 256; i++) ids[i] = 70000 + 1000 * (uint64_t)round + i;
    PE_CHECK(publish_many(&f, ids, 256, &ins) == 0 && ins == 256, "C: %zu", ins); /* B older */
    for (size_t i = 0; i < 512; i++)
      ids[i] = i < 256 ? 80000 + 1000 * (uint64_t)round + i : b_ids[511 - i];
    PE_CHECK(publish_many(&f, ids, 512, &ins) == 0 && ins == 512,
             "round %d: 256 new keys and B: %zu inserted", round, ins);
    PE_CHECK(found_intact(&f, ids, 256, &intact) == 256 && intact, "round %d: the new keys", round);
    PE_CHECK(found_intact(&f, b_ids, 256, &intact) == 256 && intact,
             "round %d: B is cached after its publish", round); /* and the most recent */
  }
  fix_fini(&f);
  return 0;
}

Test(kv, publishes_of_several_windows_insert_every_key_once) {
  skv_test_job_t job;
  int bad = skv_test_run(&job, 1, pe_windows, NULL, 120000);
  cr_assert_eq(bad, 0, "PEs failed: %s", skv_test_statuses(&job));
}

/* A publish of a key already cached is a use of its page, as a lookup hit is: the publish's own
 * allocation evicts the least recently used page it was not given the key of, not the page of
 * the key the caller just published. The same for skv_kv_reserve. */
static bool cached_intact(fix_t *f, uint64_t id) {
  bool intact;
  return found_intact(f, &id, 1, &intact) == 1 && intact; /* a hit: a use */
}

static int pe_publish_uses(int rank, int npes, void *arg) {
  (void)rank, (void)npes, (void)arg;
  fix_t f;
  static uint64_t ids[8];
  size_t ins = 0;
  PE_CHECK(fix_init(&f, 8, WIN_N, 30000) == 0, "fixture: %s", skv_last_error());
  for (size_t i = 0; i < 8; i++) ids[i] = 100 + i; /* the pool full */
  PE_CHECK(publish_many(&f, ids, 8, &ins) == 0 && ins == 8, "8 keys: %zu", ins);
  /* 101 the least recently used, on a page other than 0 (a touch that missed its page would
   * land on page 0, where 100 lives): every other key used after it, one call each */
  skv_key_t k = key_of(&f, 101);
  skv_page_ref_t ref;
  size_t nhit = 0;
  PE_CHECK(skv_kv_lookup(f.kv, f.ns, &k, 1, 0, &ref, &nhit) == 0 && nhit == 1 && ref.page != 0,
           "101 is cached on a page other than 0: %zu hit, page %u", nhit, ref.page);
  for (uint64_t id = 102; id <= 108; id++)
    PE_CHECK(cached_intact(&f, id == 108 ? 100 : id), "%llu is cached",
             (unsigned long long)(id == 108 ? 100 : id));
  ids[0] = 101, ids[1] = 200; /* cached on the LRU page, and a new key: one page to take */
  PE_CHECK(publish_many(&f, ids, 2, &ins) == 0 && ins == 1, "101 and 200: %zu inserted", ins);
  PE_CHECK(cached_intact(&f, 101), "101, published again, was evicted by its own publish");
  PE_CHECK(cached_intact(&f, 200), "200, new, is cached");
  bool intact;
  uint64_t gone = 102;
  PE_CHECK(found_intact(&f, &gone, 1, &intact) == 0 && intact,
           "102, the next least recently used, is still cached");
  /* now 103 is the least recently used: a reservation of a new key and of it (in that order)
   * takes 104's page */
  skv_key_t keys[2] = {key_of(&f, 300), key_of(&f, 103)};
  skv_page_ref_t refs[2];
  size_t nres = 0;
  PE_CHECK(skv_kv_reserve(f.kv, f.ns, keys, 2, refs, &nres) == 0 && nres == 1 && refs[1].gen == 0,
           "reserve: %zu (%s)", nres, skv_last_error());
  PE_CHECK(skv_kv_abort(f.kv, refs, 2, NULL) == 0, "abort: %s", skv_last_error());
  PE_CHECK(cached_intact(&f, 103), "103, reserved again, was evicted by its own reservation");
  gone = 104;
  PE_CHECK(found_intact(&f, &gone, 1, &intact) == 0 && intact,
           "104, the next least recently used, is still cached");
  fix_fini(&f);
  return 0;
}

Test(kv, a_publish_of_a_cached_key_is_a_use_of_its_page) {
  skv_test_job_t job;
  int bad = skv_test_run(&job, 1, pe_publish_uses, NULL, 60000);
  cr_assert_eq(bad, 0, "PEs failed: %s", skv_test_statuses(&job));
}

/* skv_kv_set_free_reserve: after a publish, the helper thread evicts the least recently used
 * pages until the reserve is free; publishes coming while it runs stop it and lose nothing. */
static bool helper_can_run(void) { /* kv.c's helper: on, and a thread allowed on 2 CPUs */
  const char *e = getenv("SKV_PUBLISH_HELPER");
  if (e && strcmp(e, "0") == 0) return false;
  cpu_set_t cs;
  CPU_ZERO(&cs);
  return sched_getaffinity(0, sizeof cs, &cs) != 0 || CPU_COUNT(&cs) >= 2;
}

/* This PE's pages in use once they reach `want` (or 5 s passed). */
static uint64_t used_reaching(fix_t *f, uint64_t want) {
  skv_kv_stats_t st = SKV_KV_STATS_INIT;
  for (int i = 0; i < 5000; i++) {
    skv_kv_get_stats(f->kv, &st);
    if (st.pages_used == want) break;
    usleep(1000);
  }
  return st.pages_used;
}

static size_t hits_of(fix_t *f, uint64_t first, size_t n) {
  skv_key_t keys[64];
  skv_page_ref_t refs[64];
  size_t nhit = 0, hits = 0;
  for (size_t i = 0; i < n; i++) {
    keys[0] = key_of(f, first + i);
    if (skv_kv_lookup(f->kv, f->ns, keys, 1, 0, refs, &nhit) == 0) hits += nhit;
  }
  return hits;
}

static int pe_free_reserve(int rank, int npes, void *arg) {
  (void)rank, (void)npes, (void)arg;
  fix_t f;
  PE_CHECK(fix_init(&f, 64, 64, 30000) == 0, "fixture: %s", skv_last_error());
  PE_CHECK(skv_kv_set_free_reserve(NULL, 1) == SKV_EINVAL, "NULL cache refused");
  PE_CHECK(skv_kv_set_free_reserve(f.kv, 33) == SKV_EINVAL && strstr(skv_last_error(), "half"),
           "over half the pool refused: %s", skv_last_error());
  uint64_t ids[64];
  size_t ins = 0;
  skv_kv_stats_t st = SKV_KV_STATS_INIT;
  /* 1. no reserve: the pool stays full, a publish evicts what it needs */
  for (int i = 0; i < 64; i++) ids[i] = 100 + (uint64_t)i;
  PE_CHECK(publish_ids(&f, ids, 64, &ins) == 0 && ins == 64, "fill: %zu", ins);
  for (int i = 0; i < 32; i++) ids[i] = 200 + (uint64_t)i;
  PE_CHECK(publish_ids(&f, ids, 32, &ins) == 0 && ins == 32, "32 more: %zu", ins);
  usleep(20000);
  skv_kv_get_stats(f.kv, &st);
  PE_CHECK(st.pages_used == 64 && st.evicted == 32, "no reserve: used %llu, evicted %llu",
           (unsigned long long)st.pages_used, (unsigned long long)st.evicted);
  /* 2. a reserve of 16: after the next publish (which evicts 32 itself), 16 more go */
  const bool ahead = helper_can_run();
  const uint64_t kept = ahead ? 48 : 64; /* without a helper nothing is evicted ahead */
  PE_CHECK(skv_kv_set_free_reserve(f.kv, 16) == 0, "reserve 16: %s", skv_last_error());
  for (int i = 0; i < 32; i++) ids[i] = 300 + (uint64_t)i;
  PE_CHECK(publish_ids(&f, ids, 32, &ins) == 0 && ins == 32, "publish with a reserve: %zu", ins);
  PE_CHECK(used_reaching(&f, kept) == kept, "pages used: %llu, want %llu (helper %d)",
           (unsigned long long)used_reaching(&f, kept), (unsigned long long)kept, (int)ahead);
  usleep(20000); /* and no further */
  skv_kv_get_stats(f.kv, &st);
  PE_CHECK(st.pages_used == kept && st.evicted == 64 + (64 - kept) && st.index_entries == kept &&
               skv__index_check(&f.kv->index) == (int64_t)kept,
           "settled: used %llu, evicted %llu, entries %llu", (unsigned long long)st.pages_used,
           (unsigned long long)st.evicted, (unsigned long long)st.index_entries);
  /* the least recently used went: the batch of 300s stays whole, 16 of the 200s go */
  PE_CHECK(hits_of(&f, 300, 32) == 32 && hits_of(&f, 200, 32) == kept - 32 &&
               hits_of(&f, 100, 64) == 0,
           "LRU: 300s %zu, 200s %zu, 100s %zu", hits_of(&f, 300, 32), hits_of(&f, 200, 32),
           hits_of(&f, 100, 64));
  /* 3. publishes back to back, each stopping the eviction the one before posted: every key
   * inserted once, found at once and read back intact */
  for (uint64_t r = 0; r < 40; r++) {
    for (int i = 0; i < 16; i++) ids[i] = 1000 + 16 * r + (uint64_t)i;
    PE_CHECK(publish_ids(&f, ids, 16, &ins) == 0 && ins == 16, "round %llu: %zu inserted (%s)",
             (unsigned long long)r, ins, skv_last_error());
    PE_CHECK(hits_of(&f, 1000 + 16 * r, 16) == 16, "round %llu: keys found", (unsigned long long)r);
  }
  bool intact = false;
  for (int i = 0; i < 16; i++) ids[i] = 1000 + 16 * 39 + (uint64_t)i;
  PE_CHECK(found_intact(&f, ids, 16, &intact) == 16 && intact, "the last round reads back");
  PE_CHECK(used_reaching(&f, kept) == kept, "settled again: %llu",
           (unsigned long long)used_reaching(&f, kept));
  skv_kv_get_stats(f.kv, &st);
  PE_CHECK(st.index_entries == kept && skv__index_check(&f.kv->index) == (int64_t)kept &&
               st.published == 64 + 32 + 32 + 40 * 16,
           "entries %llu, published %llu", (unsigned long long)st.index_entries,
           (unsigned long long)st.published);
  /* 4. a reserve of 0 stops evicting ahead */
  PE_CHECK(skv_kv_set_free_reserve(f.kv, 0) == 0, "reserve 0");
  for (int i = 0; i < 32; i++) ids[i] = 5000 + (uint64_t)i;
  PE_CHECK(publish_ids(&f, ids, 32, &ins) == 0 && ins == 32, "publish without: %zu", ins);
  usleep(20000);
  skv_kv_get_stats(f.kv, &st);
  PE_CHECK(st.pages_used == 64, "reserve 0: the pool fills again: %llu",
           (unsigned long long)st.pages_used);
  /* 5. a publish in parts (reserve, write, commit) ends with the eviction ahead too */
  PE_CHECK(skv_kv_set_free_reserve(f.kv, 16) == 0, "reserve 16 again");
  skv_key_t rk[8];
  skv_page_ref_t rr[8];
  uint64_t rb[8];
  size_t nres = 0;
  for (int i = 0; i < 8; i++) {
    rk[i] = key_of(&f, 6000 + (uint64_t)i);
    rb[i] = (uint64_t)i;
    fill_block(&f, (uint64_t)i, 6000 + (uint64_t)i);
  }
  PE_CHECK(skv_kv_reserve(f.kv, f.ns, rk, 8, rr, &nres) == 0 && nres == 8, "reserve 8: %zu", nres);
  PE_CHECK(skv_kv_write(f.kv, rr, 8, f.eng.lay, rb, NULL) == 0, "write: %s", skv_last_error());
  PE_CHECK(skv_kv_commit(f.kv, f.ns, rk, 8, rr, NULL, &ins) == 0 && ins == 8, "commit: %zu", ins);
  PE_CHECK(used_reaching(&f, kept) == kept, "after a commit: %llu",
           (unsigned long long)used_reaching(&f, kept));
  PE_CHECK(hits_of(&f, 6000, 8) == 8, "the committed keys stay");
  fix_fini(&f);
  return 0;
}

Test(kv, a_free_reserve_is_evicted_ahead_and_publishes_meanwhile_lose_nothing) {
  skv_test_job_t job;
  int bad = skv_test_run(&job, 1, pe_free_reserve, NULL, 120000);
  cr_assert_eq(bad, 0, "PEs failed: %s", skv_test_statuses(&job));
}

/* The eviction ahead stops between two runs of evictions: a callback that asks it to stop at
 * the 64th eviction (the first run's last) ends it with one run done. */
typedef struct stop_after {
  skv_kv_t *kv;
  int stop;
  uint64_t calls, at;
} stop_after_t;

static void evict_then_stop(void *arg, uint32_t page, uint32_t gen, uint64_t hi, uint64_t lo) {
  stop_after_t *s = arg;
  skv__kv_evict_cb(s->kv, page, gen, hi, lo);
  if (++s->calls == s->at) __atomic_store_n(&s->stop, 1, __ATOMIC_RELEASE);
}

/* Forks while the helper evicts ahead: no child inherits the pool's lock held (each child reads
 * the cache's stats, which takes it, within 5 s). */
static int pe_reserve_stop_and_fork(int rank, int npes, void *arg) {
  (void)rank, (void)npes, (void)arg;
  fix_t f;
  static uint64_t ids[WIN_N];
  size_t ins = 0;
  PE_CHECK(fix_init(&f, 2048, WIN_N, 30000) == 0, "fixture: %s", skv_last_error());
  uint64_t next = 1;
  for (int q = 0; q < 3; q++) { /* fill: 2100 keys into 2048 pages */
    for (size_t i = 0; i < WIN_N; i++) ids[i] = next++;
    PE_CHECK(publish_many(&f, ids, WIN_N, &ins) == 0 && ins == WIN_N, "fill: %zu", ins);
  }
  /* 1. a reclaim of 300 pages asked to stop at its 64th eviction stops after that run (the
   * pool's hint and flush take the cache as their argument: off meanwhile; the next pass counts
   * what these evictions erased) */
  skv__pool_t *pool = &f.kv->pool;
  const skv__pool_hint_fn hint = pool->evict_hint;
  void (*const flush)(void *) = pool->evict_flush;
  pool->evict_hint = NULL, pool->evict_flush = NULL;
  stop_after_t sa = {f.kv, 0, 0, 64};
  const uint64_t want = 300;
  skv_kv_stats_t st = SKV_KV_STATS_INIT;
  uint64_t got = skv__pool_reclaim(&f.kv->pool, &want, evict_then_stop, &sa, &sa.stop);
  skv_kv_get_stats(f.kv, &st);
  PE_CHECK(got == 64 && sa.calls == 64 && st.pages_used == 2048 - 64,
           "stopped reclaim: %llu evicted, %llu calls, %llu used", (unsigned long long)got,
           (unsigned long long)sa.calls, (unsigned long long)st.pages_used);
  sa.stop = 0, sa.at = 0;
  got = skv__pool_reclaim(&f.kv->pool, &want, evict_then_stop, &sa, &sa.stop);
  skv_kv_get_stats(f.kv, &st);
  PE_CHECK(got == 300 - 64 && st.pages_used == 2048 - 300, "the rest: %llu, used %llu",
           (unsigned long long)got, (unsigned long long)st.pages_used);
  pool->evict_hint = hint, pool->evict_flush = flush;
  /* 2. forks right after publishes that leave the helper a reclaim of 1024 pages */
  int hung = 0;
  for (int round = 0; round < 30; round++) {
    PE_CHECK(skv_kv_set_free_reserve(f.kv, 0) == 0, "reserve 0");
    for (int q = 0; q < 2; q++) { /* the pool full again */
      for (size_t i = 0; i < WIN_N; i++) ids[i] = next++;
      PE_CHECK(publish_many(&f, ids, WIN_N, &ins) == 0 && ins == WIN_N, "refill: %zu", ins);
    }
    PE_CHECK(skv_kv_set_free_reserve(f.kv, 1024) == 0, "reserve 1024");
    for (size_t i = 0; i < 64; i++) ids[i] = next++;
    PE_CHECK(publish_many(&f, ids, 64, &ins) == 0 && ins == 64, "publish: %zu", ins);
    pid_t pid = fork();
    PE_CHECK(pid >= 0, "fork");
    if (pid == 0) { /* no Criterion call here */
      alarm(5);
      skv_kv_stats_t cs = SKV_KV_STATS_INIT;
      _exit(skv_kv_get_stats(f.kv, &cs) == 0 ? 0 : 3);
    }
    int ws = 0;
    PE_CHECK(waitpid(pid, &ws, 0) == pid, "waitpid");
    hung += !(WIFEXITED(ws) && WEXITSTATUS(ws) == 0);
  }
  PE_CHECK(hung == 0, "%d of 30 children could not take the pool's lock", hung);
  fix_fini(&f);
  return 0;
}

Test(kv, an_eviction_ahead_stops_between_runs_and_forks_never_inherit_its_lock, .timeout = 120) {
  skv_test_job_t job;
  int bad = skv_test_run(&job, 1, pe_reserve_stop_and_fork, NULL, 110000);
  cr_assert_eq(bad, 0, "PEs failed: %s", skv_test_statuses(&job));
}

static int pe_lru_and_pins(int rank, int npes, void *arg) {
  fix_t f;
  PE_CHECK(fix_init(&f, 8, 64, 30000) == 0, "fixture: %s", skv_last_error());
  size_t ins;
  skv_page_ref_t refs[8];
  size_t nhit;
  if (rank == 0) {
    uint64_t ids[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    PE_CHECK(publish_ids(&f, ids, 8, &ins) == 0 && ins == 8, "fill");
  }
  PE_CHECK(skv_ctx_barrier(f.ctx) == 0, "barrier");
  if (rank == 1) {
    /* touch key 1 (so 2 becomes the LRU) and pin key 3 */
    skv_key_t k1 = key_of(&f, 1), k3 = key_of(&f, 3);
    PE_CHECK(skv_kv_lookup(f.kv, f.ns, &k1, 1, 0, refs, &nhit) == 0 && nhit == 1, "touch 1");
    PE_CHECK(skv_kv_lookup(f.kv, f.ns, &k3, 1, SKV_LOOKUP_PIN, &refs[3], &nhit) == 0 && nhit == 1,
             "pin 3");
  }
  PE_CHECK(skv_ctx_barrier(f.ctx) == 0, "barrier");
  if (rank == 0) {
    /* publishing 3 more pages evicts the 3 least recently used unpinned ones: 2, 4, 5 */
    uint64_t more[3] = {9, 10, 11};
    PE_CHECK(publish_ids(&f, more, 3, &ins) == 0 && ins == 3, "publish beyond capacity: %s",
             skv_last_error());
    skv_kv_stats_t st = SKV_KV_STATS_INIT;
    skv_kv_get_stats(f.kv, &st);
    PE_CHECK(st.evicted == 3, "evicted %llu", (unsigned long long)st.evicted);
  }
  PE_CHECK(skv_ctx_barrier(f.ctx) == 0, "barrier");
  int want[12] = {0, 1, 0, 1, 0, 0, 1, 1, 1, 1, 1, 1};
  for (uint64_t id = 1; id <= 11; id++) {
    skv_key_t k = key_of(&f, id);
    PE_CHECK(skv_kv_lookup(f.kv, f.ns, &k, 1, 0, refs, &nhit) == 0, "lookup");
    PE_CHECK((int)nhit == want[id], "key %llu: hit %zu, expected %d", (unsigned long long)id, nhit,
             want[id]);
  }
  PE_CHECK(skv_ctx_barrier(f.ctx) == 0, "barrier");
  if (rank == 1) {
    /* our pin kept page 3; fetch it, then release */
    PE_CHECK(skv_kv_fetch(f.kv, &refs[3], 1, f.eng.lay, (uint64_t[]){40}, SKV_FETCH_UNPIN, NULL) ==
                 0,
             "fetch pinned");
    PE_CHECK(block_holds(&f, 40, 3), "pinned page content");
    PE_CHECK(skv_kv_unpin(f.kv, &refs[3], 1) == SKV_EINVAL, "double unpin is refused");
  }
  PE_CHECK(skv_ctx_barrier(f.ctx) == 0, "barrier");
  if (rank == 0) {
    uint64_t n;
    PE_CHECK(skv_kv_evict(f.kv, 100, &n) == 0 && n == 8, "all pages evictable once unpinned: %llu",
             (unsigned long long)n);
    skv_kv_stats_t st = SKV_KV_STATS_INIT;
    skv_kv_get_stats(f.kv, &st);
    PE_CHECK(st.pages_used == 0 && st.index_entries == 0, "empty after evicting all");
  }
  PE_CHECK(skv_ctx_barrier(f.ctx) == 0, "barrier");
  fix_fini(&f);
  return 0;
}

Test(kv, lru_eviction_respects_pins) {
  skv_test_job_t job;
  int bad = skv_test_run(&job, 2, pe_lru_and_pins, NULL, 120000);
  cr_assert_eq(bad, 0, "PEs failed: %s", skv_test_statuses(&job));
}

/* The batched pool steps of the data path (issue 21): pins of a batch all or none, allocation
 * of n pages stopping at the first that fails, commits of n pages to the LRU. */
static int pe_batched_pool_steps(int rank, int npes, void *arg) {
  (void)rank, (void)npes, (void)arg;
  fix_t f;
  PE_CHECK(fix_init(&f, 8, 64, 30000) == 0, "fixture: %s", skv_last_error());
  skv__pool_t *p = &f.kv->pool;
  uint64_t ids[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  size_t ins, nhit, bad = 99;
  PE_CHECK(publish_ids(&f, ids, 8, &ins) == 0 && ins == 8, "fill");
  skv_key_t k3 = key_of(&f, 3);
  skv_page_ref_t r[2];
  PE_CHECK(skv_kv_lookup(f.kv, f.ns, &k3, 1, SKV_LOOKUP_PIN, r, &nhit) == 0 && nhit == 1, "pin 3");
  /* all or none: the second reference is stale, the first keeps only the lookup's pin */
  r[1] = r[0];
  r[1].gen++;
  PE_CHECK(skv__pool_pin_n(p, &r[0].pe, 4, &r[0].page, 4, &r[0].gen, 4, 2, &bad) == SKV_ESTALE &&
               bad == 1,
           "stale pin in a batch: bad %zu", bad);
  PE_CHECK(skv__pool_pinned_own(p) == 1, "pins after the failed batch: %llu",
           (unsigned long long)skv__pool_pinned_own(p));
  PE_CHECK(skv__pool_pin_n(p, &r[0].pe, 4, &r[0].page, 4, &r[0].gen, 4, 1, &bad) == 0, "pin");
  /* 10 pages asked of 8, one pinned: 7 come (each evicting), then SKV_ENOSPC */
  uint32_t pages[10];
  size_t got = 0;
  uint64_t ev = 0;
  PE_CHECK(skv__pool_alloc_n(p, skv__kv_evict_cb, f.kv, pages, 10, &got, &ev) == SKV_ENOSPC &&
               got == 7 && ev == 7,
           "alloc_n: got %zu evicted %llu", got, (unsigned long long)ev);
  for (size_t i = 0; i < got; i++) {
    PE_CHECK(pages[i] != r[0].page, "the pinned page was allocated");
    for (size_t j = 0; j < i; j++) PE_CHECK(pages[i] != pages[j], "page %u twice", pages[i]);
  }
  PE_CHECK(skv_kv_lookup(f.kv, f.ns, &k3, 1, 0, r + 1, &nhit) == 0 && nhit == 1, "3 stays");
  /* 3 of them READY, indexed and committed together: the LRU has exactly those to evict */
  for (size_t i = 0; i < 3; i++) {
    skv_key_t k = key_of(&f, 100 + i);
    skv__pool_ready(p, pages[i], k.hi, k.lo);
    uint32_t gen = skv__pool_gen(p, (uint32_t)p->me, pages[i]);
    PE_CHECK(skv__index_insert(&f.kv->index, k, skv__val_pack((uint32_t)p->me, pages[i], gen),
                               p->me) == 0,
             "insert");
  }
  skv__pool_commit_n(p, pages, 3);
  for (size_t i = 3; i < got; i++) skv__pool_release(p, pages[i]);
  uint64_t n = 0;
  PE_CHECK(skv_kv_evict(f.kv, 100, &n) == 0 && n == 3, "evicted %llu, expected the 3 committed",
           (unsigned long long)n);
  PE_CHECK(skv__pool_unpin_n(p, &r[0].pe, 4, &r[0].page, 4, 1, 2) == 0, "unpin both pins");
  PE_CHECK(skv__pool_unpin_n(p, &r[0].pe, 4, &r[0].page, 4, 1, 1) == SKV_EINVAL,
           "a third unpin is refused");
  PE_CHECK(skv_kv_evict(f.kv, 100, &n) == 0 && n == 1, "page 3 evictable once unpinned");
  fix_fini(&f);
  return 0;
}

Test(kv, batched_pool_steps_keep_the_protocol) {
  skv_test_job_t job;
  int bad = skv_test_run(&job, 1, pe_batched_pool_steps, NULL, 60000);
  cr_assert_eq(bad, 0, "PEs failed: %s", skv_test_statuses(&job));
}

/* PEs 0-7 pin with a byte of the page record each, PEs from 8 with a bit (pool.h). 10 PEs pin
 * PE 0's pages: each pins a batch [1, 2, 1, 3 stale, 2, 4] as a lookup does (the prefix before
 * the stale page: 1 twice and 2 stay pinned, 3 and 4 are given back), and the owner's eviction
 * takes only what no PE pins, whichever way each pins. */
static int pe_pins_by_bytes_and_bits(int rank, int npes, void *arg) {
  (void)arg;
  fix_t f;
  PE_CHECK(fix_init(&f, 8, 64, 60000) == 0, "fixture: %s", skv_last_error());
  skv__pool_t *p = &f.kv->pool;
  size_t ins, nhit;
  if (rank == 0) {
    uint64_t ids[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    PE_CHECK(publish_ids(&f, ids, 8, &ins) == 0 && ins == 8, "fill");
  }
  PE_CHECK(skv_ctx_barrier(f.ctx) == 0, "barrier");
  skv_key_t keys[4];
  skv_page_ref_t refs[4];
  for (int i = 0; i < 4; i++) keys[i] = key_of(&f, 1 + (uint64_t)i);
  PE_CHECK(skv_kv_lookup(f.kv, f.ns, keys, 4, 0, refs, &nhit) == 0 && nhit == 4, "lookup");
  const int order[6] = {0, 1, 0, 2, 1, 3};
  uint32_t pe[6], page[6], gen[6];
  for (int i = 0; i < 6; i++) {
    pe[i] = refs[order[i]].pe, page[i] = refs[order[i]].page, gen[i] = refs[order[i]].gen;
    if (order[i] == 2) gen[i]++; /* key 3's page at a generation it has not reached: stale */
  }
  if (rank > 0) {
    PE_CHECK(skv__pool_pin_prefix(p, pe, page, gen, 6) == 3, "the prefix before the stale page");
    const int held[4] = {0, 0, SKV_ENOTFOUND, SKV_ENOTFOUND};
    for (int i = 0; i < 4; i++) {
      const int r = skv__pool_held(p, refs[i].pe, refs[i].page, refs[i].gen);
      PE_CHECK(r == held[i], "key %d: held %s", i + 1, skv_err_name(r));
      skv__page_meta_t *m = &p->meta[refs[i].pe][refs[i].page];
      PE_CHECK(skv__page_pinned_by(m, rank) == (held[i] == 0), "key %d: pin of PE %d", i + 1, rank);
    }
    PE_CHECK(skv__pool_pinned_own(p) == 0 && p->pinned_pages == 2, "pinned pages: %llu",
             (unsigned long long)p->pinned_pages);
  }
  PE_CHECK(skv_ctx_barrier(f.ctx) == 0, "barrier");
  uint64_t n = 0;
  if (rank == 0) {
    skv__page_meta_t *m = &p->meta[0][refs[0].page];
    PE_CHECK(skv__page_pins(m) == ((1ull << npes) - 2), "key 1 pinned by PEs 1-%d: %#llx", npes - 1,
             (unsigned long long)skv__page_pins(m));
    PE_CHECK(__atomic_load_n(&m->pinmask, __ATOMIC_SEQ_CST) == ((1ull << npes) - 256) &&
                 __atomic_load_n(&m->pinbytes, __ATOMIC_SEQ_CST) == 0x0101010101010100ull,
             "bytes for PEs 1-7, bits from 8");
    PE_CHECK(skv_kv_evict(f.kv, 100, &n) == 0 && n == 6, "evicted %llu, expected 6 (1, 2 pinned)",
             (unsigned long long)n);
  }
  PE_CHECK(skv_ctx_barrier(f.ctx) == 0, "barrier");
  /* every PE but the last gives its pins back (key 1 twice, key 2 once) */
  skv_page_ref_t mine[3] = {refs[0], refs[0], refs[1]};
  if (rank > 0 && rank < npes - 1)
    PE_CHECK(skv_kv_unpin(f.kv, mine, 3) == 0, "unpin: %s", skv_last_error());
  PE_CHECK(skv_ctx_barrier(f.ctx) == 0, "barrier");
  if (rank == 0)
    PE_CHECK(skv_kv_evict(f.kv, 100, &n) == 0 && n == 0, "PE %d's bits keep 1 and 2: %llu went",
             npes - 1, (unsigned long long)n);
  PE_CHECK(skv_ctx_barrier(f.ctx) == 0, "barrier");
  if (rank == npes - 1) PE_CHECK(skv_kv_unpin(f.kv, mine, 3) == 0, "unpin: %s", skv_last_error());
  PE_CHECK(skv_ctx_barrier(f.ctx) == 0, "barrier");
  if (rank == 0)
    PE_CHECK(skv_kv_evict(f.kv, 100, &n) == 0 && n == 2, "1 and 2 go once unpinned: %llu",
             (unsigned long long)n);
  PE_CHECK(skv_ctx_barrier(f.ctx) == 0, "barrier");
  fix_fini(&f);
  return 0;
}

/* Pins in runs of 64 with one fence (pool.c, pin_bytes_run), PE 0 pinning its own pages: a batch
 * of 70 references to 8 pages whose reference 64 (the first of the second run) is stale pins the
 * 64 before it, each page as often as listed; a page held already and listed again at a later
 * generation stops a batch there and keeps its pin; a stale first reference pins nothing. */
static int pe_pin_runs(int rank, int npes, void *arg) {
  (void)npes, (void)arg;
  fix_t f;
  PE_CHECK(fix_init(&f, 8, 64, 30000) == 0, "fixture: %s", skv_last_error());
  skv__pool_t *p = &f.kv->pool;
  uint64_t ids[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  size_t ins, nhit;
  PE_CHECK(publish_ids(&f, ids, 8, &ins) == 0 && ins == 8, "fill");
  skv_key_t keys[8];
  skv_page_ref_t r[8];
  for (int i = 0; i < 8; i++) keys[i] = key_of(&f, ids[i]);
  PE_CHECK(skv_kv_lookup(f.kv, f.ns, keys, 8, 0, r, &nhit) == 0 && nhit == 8, "lookup");
  enum { N = 70, BAD = 64 };
  uint32_t pe[N], page[N], gen[N], cnt[8] = {0};
  for (int i = 0; i < N; i++) {
    const int k = (i * 3) % 8;
    pe[i] = r[k].pe, page[i] = r[k].page, gen[i] = r[k].gen + (i == BAD);
    if (i < BAD) cnt[k]++;
  }
  PE_CHECK(skv__pool_pin_prefix(p, pe, page, gen, N) == BAD, "the pins before reference %d", BAD);
  for (int k = 0; k < 8; k++) {
    const uint32_t c = p->pins[(uint64_t)r[k].pe * p->pages + r[k].page];
    PE_CHECK(c == cnt[k], "page of key %d: %u pins, listed %u times", k + 1, c, cnt[k]);
    PE_CHECK(skv__page_pinned_by(&p->meta[r[k].pe][r[k].page], rank) == (cnt[k] > 0),
             "page of key %d: pin byte", k + 1);
  }
  PE_CHECK(skv__pool_unpin_n(p, pe, 1, page, 1, BAD, 1) == 0, "unpin: %s", skv_last_error());
  PE_CHECK(skv__pool_pinned_own(p) == 0 && p->pinned_pages == 0, "pins left: %llu",
           (unsigned long long)skv__pool_pinned_own(p));
  /* X held, then [X, X one generation on]: the second fails, X keeps exactly its first pin */
  PE_CHECK(skv__pool_pin(p, r[0].pe, r[0].page, r[0].gen) == 0, "pin X");
  uint32_t xpe[2] = {r[0].pe, r[0].pe}, xpg[2] = {r[0].page, r[0].page},
           xgen[2] = {r[0].gen, r[0].gen + 1};
  PE_CHECK(skv__pool_pin_prefix(p, xpe, xpg, xgen, 2) == 1, "[X, X stale]: one pinned");
  PE_CHECK(p->pins[(uint64_t)r[0].pe * p->pages + r[0].page] == 2 &&
               skv__page_pinned_by(&p->meta[r[0].pe][r[0].page], rank),
           "X pinned twice");
  PE_CHECK(skv__pool_unpin_n(p, xpe, 0, xpg, 0, 1, 2) == 0, "unpin X twice");
  /* a stale first reference: nothing pinned, its page's byte and the next page's untouched */
  uint32_t ype[2] = {r[1].pe, r[2].pe}, ypg[2] = {r[1].page, r[2].page},
           ygen[2] = {r[1].gen + 1, r[2].gen};
  PE_CHECK(skv__pool_pin_prefix(p, ype, ypg, ygen, 2) == 0, "a stale first reference");
  for (int k = 0; k < 3; k++)
    PE_CHECK(!skv__page_pinned_by(&p->meta[r[k].pe][r[k].page], rank) &&
                 p->pins[(uint64_t)r[k].pe * p->pages + r[k].page] == 0,
             "page of key %d still pinned", k + 1);
  uint64_t n = 0;
  PE_CHECK(skv_kv_evict(f.kv, 100, &n) == 0 && n == 8, "every page evictable: %llu",
           (unsigned long long)n);
  fix_fini(&f);
  return 0;
}

Test(kv, pin_runs_stop_at_the_first_stale_reference_with_exact_counts) {
  skv_test_job_t job;
  int bad = skv_test_run(&job, 1, pe_pin_runs, NULL, 60000);
  cr_assert_eq(bad, 0, "PEs failed: %s", skv_test_statuses(&job));
}

Test(kv, pins_by_bytes_and_bits_hold_and_a_stale_page_gives_back_the_rest, .timeout = 120) {
  skv_test_job_t job;
  int bad = skv_test_run(&job, 10, pe_pins_by_bytes_and_bits, NULL, 100000);
  cr_assert_eq(bad, 0, "PEs failed: %s", skv_test_statuses(&job));
}

/* One publish of more keys than the pool has unpinned pages: the host path works in runs of
 * pages, and a run that finds too few pages publishes what it got and goes on (the next run
 * evicts this call's own earlier pages), as one page at a time did: every key is inserted, the
 * last ones stay, the pinned page is kept, and the keys read back byte-exact. */
static int pe_publish_more_than_the_pool(int rank, int npes, void *arg) {
  (void)rank, (void)npes, (void)arg;
  fix_t f;
  enum { PAGES = 8, MORE = 40 };
  PE_CHECK(fix_init(&f, PAGES, 64, 30000) == 0, "fixture: %s", skv_last_error());
  uint64_t ids[MORE];
  size_t ins = 0, nhit = 0;
  ids[0] = 7;
  PE_CHECK(publish_ids(&f, ids, 1, &ins) == 0 && ins == 1, "first key");
  skv_key_t k7 = key_of(&f, 7);
  skv_page_ref_t pinned;
  PE_CHECK(skv_kv_lookup(f.kv, f.ns, &k7, 1, SKV_LOOKUP_PIN, &pinned, &nhit) == 0 && nhit == 1,
           "pin");
  for (uint64_t i = 0; i < MORE; i++) ids[i] = 100 + i;
  int rc = publish_ids(&f, ids, MORE, &ins);
  PE_CHECK(rc == 0 && ins == MORE,
           "publish of %d keys into %d pages (one pinned): %s, %zu inserted", MORE, PAGES,
           skv_err_name(rc), ins);
  skv_kv_stats_t st = SKV_KV_STATS_INIT;
  skv_kv_get_stats(f.kv, &st);
  PE_CHECK(st.published == MORE + 1 && st.evicted == MORE + 1 - PAGES && st.pages_used == PAGES,
           "published %llu evicted %llu used %llu", (unsigned long long)st.published,
           (unsigned long long)st.evicted, (unsigned long long)st.pages_used);
  /* the pinned key and the last PAGES - 1 keys are cached, and hold their bytes */
  skv_key_t keys[PAGES];
  uint64_t want[PAGES], blocks[PAGES];
  want[0] = 7;
  for (int i = 1; i < PAGES; i++) want[i] = 100 + MORE - PAGES + (uint64_t)i;
  for (int i = 0; i < PAGES; i++) keys[i] = key_of(&f, want[i]), blocks[i] = 32 + (uint64_t)i;
  skv_page_ref_t refs[PAGES];
  PE_CHECK(skv_kv_lookup(f.kv, f.ns, keys, PAGES, 0, refs, &nhit) == 0 && nhit == PAGES,
           "found %zu of the %d expected keys", nhit, PAGES);
  PE_CHECK(skv_kv_fetch(f.kv, refs, PAGES, f.eng.lay, blocks, 0, NULL) == 0, "fetch: %s",
           skv_last_error());
  for (int i = 0; i < PAGES; i++)
    PE_CHECK(block_holds(&f, blocks[i], want[i]), "key %llu read back wrong",
             (unsigned long long)want[i]);
  PE_CHECK(skv__index_check(&f.kv->index) == PAGES, "index walker");
  PE_CHECK(skv_kv_unpin(f.kv, &pinned, 1) == 0, "unpin");
  fix_fini(&f);
  return 0;
}

Test(kv, one_publish_of_more_keys_than_the_pool_keeps_the_last) {
  skv_test_job_t job;
  int bad = skv_test_run(&job, 1, pe_publish_more_than_the_pool, NULL, 60000);
  cr_assert_eq(bad, 0, "PEs failed: %s", skv_test_statuses(&job));
}

/* A lookup with SKV_LOOKUP_PIN pins its hits together (pool.c, skv__pool_pin_prefix): a page
 * that went stale between the index read and its pin (here: its record moved on to the next
 * generation behind the index's back) ends the prefix; the hits before it stay pinned, it and
 * those after are not pinned, and one stale lookup is counted. Then unpin of them all in one call
 * releases every pin, and a second unpin fails naming the reference. */
static int pe_lookup_pins_a_prefix(int rank, int npes, void *arg) {
  (void)rank, (void)npes, (void)arg;
  fix_t f;
  enum { K = 6, BAD = 3 };
  PE_CHECK(fix_init(&f, 16, 64, 30000) == 0, "fixture: %s", skv_last_error());
  skv__pool_t *p = &f.kv->pool;
  uint64_t ids[K];
  skv_key_t keys[K];
  skv_page_ref_t refs[K];
  size_t ins = 0, nhit = 0;
  for (int i = 0; i < K; i++) ids[i] = 50 + (uint64_t)i, keys[i] = key_of(&f, ids[i]);
  PE_CHECK(publish_ids(&f, ids, K, &ins) == 0 && ins == K, "publish");
  PE_CHECK(skv_kv_lookup(f.kv, f.ns, keys, K, 0, refs, &nhit) == 0 && nhit == K, "lookup");
  skv__page_meta_t *m = &p->meta[refs[BAD].pe][refs[BAD].page];
  const uint64_t st = m->state;
  __atomic_store_n(&m->state, skv__st_make(skv__st_gen(st) + 1, SKV_PAGE_READY), __ATOMIC_SEQ_CST);
  skv_page_ref_t pinned[K];
  memset(pinned, 0xee, sizeof pinned);
  PE_CHECK(skv_kv_lookup(f.kv, f.ns, keys, K, SKV_LOOKUP_PIN, pinned, &nhit) == 0 && nhit == BAD,
           "pinned lookup: %zu hits, expected %d", nhit, BAD);
  for (int i = 0; i < K; i++) {
    const int r = skv__pool_held(p, refs[i].pe, refs[i].page, refs[i].gen);
    PE_CHECK(i < BAD ? r == 0 : r == SKV_ENOTFOUND, "reference %d: held %s", i, skv_err_name(r));
  }
  PE_CHECK(pinned[BAD].pe == 0xeeeeeeee, "refs past the hits were written");
  skv_kv_stats_t s = SKV_KV_STATS_INIT;
  skv_kv_get_stats(f.kv, &s);
  PE_CHECK(s.stale == 1 && s.lookup_hits == K + BAD, "stale %llu hits %llu",
           (unsigned long long)s.stale, (unsigned long long)s.lookup_hits);
  PE_CHECK(skv_kv_unpin(f.kv, pinned, BAD) == 0, "unpin: %s", skv_last_error());
  PE_CHECK(skv__pool_pinned_own(p) == 0, "pins left: %llu",
           (unsigned long long)skv__pool_pinned_own(p));
  PE_CHECK(skv_kv_unpin(f.kv, pinned, BAD) == SKV_EINVAL && strstr(skv_last_error(), "page"),
           "a second unpin: %s", skv_last_error());
  __atomic_store_n(&m->state, st, __ATOMIC_SEQ_CST);
  fix_fini(&f);
  return 0;
}

Test(kv, a_pinned_lookup_keeps_the_pins_of_the_hits_before_a_stale_page) {
  skv_test_job_t job;
  int bad = skv_test_run(&job, 1, pe_lookup_pins_a_prefix, NULL, 60000);
  cr_assert_eq(bad, 0, "PEs failed: %s", skv_test_statuses(&job));
}

/* An eviction pass pops candidates ahead of the one it decides on (pool.c, evict_lru_n): the
 * pages it evicts must still be exactly the least recently used ones, also when a page used
 * again sorts between candidates already popped. Pages 0..15 published in order (page i's
 * time t_i); page 0 used again at a time between t_2 and t_3, page 5 just now; an allocation of
 * 5 pages must evict pages 1, 2, 0, 3 and 4 (the heap had 0 at t_0: a pass that kept its popped
 * candidates would evict 1, 2, 3, 4 and 6, keeping 0). */
static int pe_batched_eviction_is_exact_lru(int rank, int npes, void *arg) {
  (void)rank, (void)npes, (void)arg;
  fix_t f;
  enum { PAGES = 16 };
  PE_CHECK(fix_init(&f, PAGES, 64, 30000) == 0, "fixture: %s", skv_last_error());
  skv__pool_t *p = &f.kv->pool;
  uint64_t ids[PAGES];
  size_t ins = 0, nhit = 0;
  for (uint64_t i = 0; i < PAGES; i++) {
    ids[i] = 1 + i;
    PE_CHECK(publish_ids(&f, &ids[i], 1, &ins) == 0 && ins == 1, "publish %llu",
             (unsigned long long)i);
  }
  skv_page_ref_t refs[PAGES];
  skv_key_t keys[PAGES];
  for (int i = 0; i < PAGES; i++) keys[i] = key_of(&f, ids[i]);
  PE_CHECK(skv_kv_lookup(f.kv, f.ns, keys, PAGES, 0, refs, &nhit) == 0 && nhit == PAGES, "all");
  /* the lookup touched every page: put the times back as published, spaced, then use 0 and 5 */
  for (int i = 0; i < PAGES; i++)
    __atomic_store_n(&p->meta[p->me][refs[i].page].last_use, 1000 + 100 * (uint64_t)i,
                     __ATOMIC_RELAXED);
  /* the LRU's snapshots are the publish times: move them onto the spaced times too (in the
   * queue, where a publish's entries are, and in the heap) */
  PE_CHECK(p->q_len + p->nheap == p->nlru, "queue %llu + heap %llu != %llu",
           (unsigned long long)p->q_len, (unsigned long long)p->nheap, (unsigned long long)p->nlru);
  for (uint64_t i = 0; i < p->q_len + p->nheap; i++) {
    skv__lru_ent_t *e =
        i < p->q_len ? &p->lru_q[(p->q_head + i) % p->pages] : &p->lru[i - p->q_len];
    for (int j = 0; j < PAGES; j++)
      if (e->page == refs[j].page) e->stamp = 1000 + 100 * (uint64_t)j;
  }
  for (int i = 0; i < PAGES; i++) /* each record says where its index entry is (evictions) */
    PE_CHECK(__atomic_load_n(&p->meta[p->me][refs[i].page].islot, __ATOMIC_RELAXED) != 0,
             "page %d: no islot", i);
  skv__pool_touch(p, (uint32_t)p->me, refs[0].page, 1000 + 250); /* between pages 2 and 3 */
  skv__pool_touch(p, (uint32_t)p->me, refs[5].page, skv__now_ns());
  uint32_t pages[5];
  size_t got = 0;
  uint64_t ev = 0;
  PE_CHECK(skv__pool_alloc_n(p, skv__kv_evict_cb, f.kv, pages, 5, &got, &ev) == 0 && got == 5 &&
               ev == 5,
           "alloc_n: got %zu evicted %llu", got, (unsigned long long)ev);
  for (size_t i = 0; i < got; i++) skv__pool_release(p, pages[i]);
  PE_CHECK(skv_kv_lookup(f.kv, f.ns, keys, PAGES, 0, refs, &nhit) == 0, "lookup");
  static const int gone[] = {0, 1, 2, 3, 4};
  for (int i = 0; i < PAGES; i++) {
    bool evicted = false;
    for (size_t j = 0; j < SKV_ARRAY_LEN(gone); j++) evicted |= gone[j] == i;
    size_t h = 0;
    skv_page_ref_t r;
    PE_CHECK(skv_kv_lookup(f.kv, f.ns, &keys[i], 1, 0, &r, &h) == 0, "lookup %d", i);
    PE_CHECK(h == (evicted ? 0u : 1u), "page %d (last use %s) %s", i,
             i == 0   ? "between 2 and 3"
             : i == 5 ? "now"
                      : "as published",
             evicted ? "was kept, it should have gone" : "was evicted, it should have stayed");
  }
  fix_fini(&f);
  return 0;
}

Test(kv, batched_eviction_is_exact_lru) {
  skv_test_job_t job;
  int bad = skv_test_run(&job, 1, pe_batched_eviction_is_exact_lru, NULL, 60000);
  cr_assert_eq(bad, 0, "PEs failed: %s", skv_test_statuses(&job));
}

typedef struct toucher {
  skv__pool_t *pool;
  uint64_t pages;
  int stop;
  uint64_t rounds;
} toucher_t;

/* Another PE's readers, as fast as they go: every page used again, over and over. */
static void *touch_all(void *a) {
  toucher_t *t = a;
  while (!__atomic_load_n(&t->stop, __ATOMIC_ACQUIRE)) {
    uint64_t now = skv__now_ns();
    for (uint64_t pg = 0; pg < t->pages; pg++) skv__pool_touch(t->pool, 0, (uint32_t)pg, now);
    __atomic_fetch_add(&t->rounds, 1, __ATOMIC_RELEASE);
  }
  return NULL;
}

/* A full pool of unpinned pages whose every page is touched again while publishes evict: each
 * publish must still find a page (the eviction pass used to give up, a spurious ENOSPC). */
static int pe_evict_under_touches(int rank, int npes, void *arg) {
  (void)rank, (void)npes, (void)arg;
  fix_t f;
  enum { PAGES = 64, MORE = 2000 };
  PE_CHECK(fix_init(&f, PAGES, 64, 20000) == 0, "fixture: %s", skv_last_error());
  uint64_t ids[PAGES];
  size_t ins;
  for (uint64_t i = 0; i < PAGES; i++) ids[i] = 1 + i;
  PE_CHECK(publish_ids(&f, ids, PAGES, &ins) == 0 && ins == PAGES, "fill: %s", skv_last_error());
  toucher_t t = {&f.kv->pool, PAGES, 0, 0};
  pthread_t th;
  PE_CHECK(pthread_create(&th, NULL, touch_all, &t) == 0, "thread");
  while (__atomic_load_n(&t.rounds, __ATOMIC_ACQUIRE) < 1000) sched_yield(); /* it runs */
  const uint64_t r0 = __atomic_load_n(&t.rounds, __ATOMIC_ACQUIRE);
  int nospace = 0, other = 0, done = 0;
  const uint64_t t_end = skv__now_ms() + 500; /* long enough to overlap the toucher's time slices */
  for (uint64_t i = 0; i < MORE || skv__now_ms() < t_end; i++, done++) {
    uint64_t id = 1000 + i;
    int rc = publish_ids(&f, &id, 1, &ins);
    nospace += rc == SKV_ENOSPC;
    other += rc != 0 && rc != SKV_ENOSPC;
  }
  const uint64_t rounds = __atomic_load_n(&t.rounds, __ATOMIC_ACQUIRE) - r0;
  __atomic_store_n(&t.stop, 1, __ATOMIC_RELEASE);
  pthread_join(th, NULL);
  /* the touches went on all along (else this test shows nothing) */
  PE_CHECK(rounds >= MORE, "only %llu touch rounds during %d publishes", (unsigned long long)rounds,
           done);
  PE_CHECK(nospace == 0 && other == 0,
           "%d of %d publishes found no page (ENOSPC), %d failed otherwise", nospace, done, other);
  skv_kv_stats_t st = SKV_KV_STATS_INIT;
  skv_kv_get_stats(f.kv, &st);
  PE_CHECK(st.evicted == (uint64_t)done && st.pages_used == PAGES, "evicted %llu of %d, used %llu",
           (unsigned long long)st.evicted, done, (unsigned long long)st.pages_used);
  fix_fini(&f);
  return 0;
}

Test(kv, eviction_finds_a_page_while_every_page_is_being_touched) {
  skv_test_job_t job;
  int bad = skv_test_run(&job, 1, pe_evict_under_touches, NULL, 60000);
  cr_assert_eq(bad, 0, "PEs failed: %s", skv_test_statuses(&job));
}

#if defined(__SANITIZE_ADDRESS__)
/* Under ASan a failed allocation returns NULL, as without it (pe_kv_create_fails_on_one runs
 * a PE out of address space); ASan's default is to abort. */
const char *__asan_default_options(void);
const char *__asan_default_options(void) {
  return "allocator_may_return_null=1";
}
#endif

/* PE 1 has the address space for the cache's heaps but not for its page pool's private tables:
 * its skv_kv_create fails after the heaps exist. Every PE must fail at once with its error (not
 * with mismatched collectives), tear down in step, and create the cache again afterwards. */
static int pe_kv_create_fails_on_one(int rank, int npes, void *arg) {
  (void)arg;
  /* a fixed threshold: large blocks are mapped and unmapped (glibc would otherwise raise it
   * after the first free and keep the next tables in its heap, inside the VmSize measured) */
  mallopt(M_MMAP_THRESHOLD, 128 << 10);
  skv_ctx_t *ctx;
  PE_CHECK(skv_test_init(&ctx, 20000) == 0, "init");
  skv_geometry_t g = geom_make(SKV_KV_SPLIT, 1, 1, 8, 1, 16); /* 256-byte pages */
  skv_kv_opts_t o = SKV_KV_OPTS_INIT;
  o.pages_per_pe = 4u << 20; /* the pool's tables: 64 MiB of LRU, 16 MiB of free stack, ... */
  skv_kv_t *kv;
  PE_CHECK(skv_kv_create(ctx, &g, &o, &kv) == 0, "create");
  const size_t need = (size_t)(kv->data->info.stride + kv->meta->info.stride) * (size_t)npes;
  PE_CHECK(skv_kv_destroy(kv) == 0, "destroy");
  malloc_trim(0);
  struct rlimit was;
  PE_CHECK(getrlimit(RLIMIT_AS, &was) == 0, "getrlimit");
  if (rank == 1) {
    struct rlimit lim = was;
    lim.rlim_cur = skv_test_vm_bytes() + need + (8u << 20);
    PE_CHECK(setrlimit(RLIMIT_AS, &lim) == 0, "setrlimit");
  }
  kv = (skv_kv_t *)1;
  uint64_t t0 = skv__now_ms();
  int rc = skv_kv_create(ctx, &g, &o, &kv);
  uint64_t took = skv__now_ms() - t0;
  if (rank == 1) PE_CHECK(setrlimit(RLIMIT_AS, &was) == 0, "restore the limit");
  PE_CHECK(rc == SKV_ENOMEM && kv == NULL, "create: %s", skv_err_name(rc));
  PE_CHECK(strstr(skv_last_error(), "page pool"), "the error says why: %s", skv_last_error());
  char name[96] = "";
  if (rank != 1) {
    PE_CHECK(strstr(skv_last_error(), "rank 1 failed"), "the error names rank 1: %s",
             skv_last_error());
    const char *at = strstr(skv_last_error(), "skv_kv_create(");
    PE_CHECK(at && sscanf(at + strlen("skv_kv_create("), "%95[^)]", name) == 1, "heap name in: %s",
             skv_last_error());
  }
  PE_CHECK(took < 5000, "failing took %llu ms (the timeout is 20 s)", (unsigned long long)took);
  PE_CHECK(skv_kv_create(ctx, &g, &o, &kv) == 0, "create after the failure");
  PE_CHECK(skv_kv_destroy(kv) == 0, "destroy");
  PE_CHECK(skv_ctx_barrier(ctx) == 0, "barrier");
  for (int r = 0; rank == 0 && r < npes;
       r++) { /* the failed step's keys went with the checks since */
    char key[160];
    snprintf(key, sizeof key, "%s/kv-ready/%d", name, r);
    void *v = NULL;
    size_t len = 0;
    int got = skv__store_try_get(ctx->store, key, &v, &len);
    free(v);
    PE_CHECK(got == SKV_ENOTFOUND, "store key %s left after the failed create: %s", key,
             skv_err_name(got));
  }
  PE_CHECK(skv_ctx_barrier(ctx) == 0, "barrier");
  PE_CHECK(skv_finalize(ctx) == 0, "finalize");
  return 0;
}

Test(kv, a_create_failing_on_one_pe_fails_every_pe_in_step) {
  skv_test_job_t job;
  int bad = skv_test_run(&job, 2, pe_kv_create_fails_on_one, NULL, 90000);
  cr_assert_eq(bad, 0, "PEs failed: %s", skv_test_statuses(&job));
}

static int pe_stale(int rank, int npes, void *arg) {
  fix_t f;
  PE_CHECK(fix_init(&f, 8, 16, 30000) == 0, "fixture: %s", skv_last_error());
  skv_page_ref_t ref;
  size_t nhit, ins;
  skv_key_t k = key_of(&f, 77);
  if (rank == 0) PE_CHECK(publish_ids(&f, (uint64_t[]){77}, 1, &ins) == 0 && ins == 1, "publish");
  PE_CHECK(skv_ctx_barrier(f.ctx) == 0, "barrier");
  PE_CHECK(skv_kv_lookup(f.kv, f.ns, &k, 1, 0, &ref, &nhit) == 0 && nhit == 1, "lookup");
  PE_CHECK(skv_ctx_barrier(f.ctx) == 0, "barrier");
  if (rank == 0) {
    uint64_t n;
    PE_CHECK(skv_kv_evict(f.kv, 1, &n) == 0 && n == 1, "evict");
    /* and reuse the page for another key */
    PE_CHECK(publish_ids(&f, (uint64_t[]){78}, 1, &ins) == 0 && ins == 1, "reuse");
  }
  PE_CHECK(skv_ctx_barrier(f.ctx) == 0, "barrier");
  engine_poison(&f.eng);
  int rc = skv_kv_fetch(f.kv, &ref, 1, f.eng.lay, (uint64_t[]){9}, 0, NULL);
  PE_CHECK(rc == SKV_ESTALE, "stale reference gives %s", skv_err_name(rc));
  PE_CHECK(strstr(skv_last_error(), "stale") != NULL, "message: %s", skv_last_error());
  uint8_t used[16] = {0};
  PE_CHECK(untouched_outside(&f.eng, used), "a stale fetch wrote something");
  rc = skv_kv_lookup(f.kv, f.ns, &k, 1, 0, &ref, &nhit);
  PE_CHECK(rc == 0 && nhit == 0, "evicted key is gone");
  PE_CHECK(skv_ctx_barrier(f.ctx) == 0, "barrier");
  fix_fini(&f);
  return 0;
}

Test(kv, stale_references_are_reported_not_read) {
  skv_test_job_t job;
  int bad = skv_test_run(&job, 2, pe_stale, NULL, 120000);
  cr_assert_eq(bad, 0, "PEs failed: %s", skv_test_statuses(&job));
}

static int pe_dead_pinner(int rank, int npes, void *arg) {
  fix_t f;
  PE_CHECK(fix_init(&f, 8, 16, 4000) == 0, "fixture: %s", skv_last_error());
  size_t ins, nhit;
  uint64_t ids[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  if (rank == 0) PE_CHECK(publish_ids(&f, ids, 8, &ins) == 0 && ins == 8, "publish");
  PE_CHECK(skv_ctx_barrier(f.ctx) == 0, "barrier");
  if (rank == 2) {
    skv_key_t keys[8];
    skv_page_ref_t refs[8];
    for (int i = 0; i < 8; i++) keys[i] = key_of(&f, ids[i]);
    PE_CHECK(skv_kv_lookup(f.kv, f.ns, keys, 8, SKV_LOOKUP_PIN, refs, &nhit) == 0 && nhit == 8,
             "pin all");
    PE_CHECK(skv_ctx_barrier(f.ctx) == 0, "barrier");
    PE_CHECK(skv_ctx_barrier(f.ctx) == 0, "barrier"); /* rank 0 has seen our pins hold */
    raise(SIGKILL);
  }
  PE_CHECK(skv_ctx_barrier(f.ctx) == 0, "barrier");
  if (rank == 0) {
    uint64_t n;
    PE_CHECK(skv_kv_evict(f.kv, 8, &n) == 0 && n == 0,
             "pinned by a live PE: nothing evictable (%llu)", (unsigned long long)n);
  }
  PE_CHECK(skv_ctx_barrier(f.ctx) == 0, "barrier");
  /* rank 2 dies now; wait until its process is gone */
  usleep(300000);
  if (rank == 0) {
    uint64_t n;
    PE_CHECK(skv_kv_evict(f.kv, 8, &n) == 0 && n == 8,
             "a dead PE's pins are released: evicted %llu", (unsigned long long)n);
  }
  /* the job is broken now (a PE died): collectives fail, cleanup does not hang */
  skv_kv_destroy(f.kv);
  engine_free(&f.eng);
  skv_namespace_destroy(f.ns);
  skv_finalize(f.ctx);
  return 0;
}

Test(kv, pins_of_a_dead_pe_are_released) {
  skv_test_job_t job;
  skv_test_spawn(&job, 3, pe_dead_pinner, NULL);
  skv_test_wait(&job, 90000);
  cr_assert_eq(job.status[2], 128 + SIGKILL, "%s", skv_test_statuses(&job));
  cr_assert(job.status[0] == 0 && job.status[1] == 0, "survivors: %s", skv_test_statuses(&job));
}

/* A live PE's pins hold whatever /proc says meanwhile: the owner runs out of descriptors (it
 * cannot read /proc/<pid>/stat) while it evicts, which is no evidence of death. */
static int pe_pinner_while_proc_unreadable(int rank, int npes, void *arg) {
  fix_t f;
  PE_CHECK(fix_init(&f, 8, 16, 20000) == 0, "fixture: %s", skv_last_error());
  size_t ins, nhit;
  uint64_t ids[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  skv_key_t keys[8];
  skv_page_ref_t refs[8];
  for (int i = 0; i < 8; i++) keys[i] = key_of(&f, ids[i]);
  if (rank == 0) PE_CHECK(publish_ids(&f, ids, 8, &ins) == 0 && ins == 8, "publish");
  PE_CHECK(skv_ctx_barrier(f.ctx) == 0, "barrier");
  if (rank == 1)
    PE_CHECK(skv_kv_lookup(f.kv, f.ns, keys, 8, SKV_LOOKUP_PIN, refs, &nhit) == 0 && nhit == 8,
             "pin all");
  PE_CHECK(skv_ctx_barrier(f.ctx) == 0, "barrier");
  if (rank == 0) {
    struct rlimit old;
    PE_CHECK(skv_test_limit_fds(0, &old) == 0, "limit"); /* every open() fails with EMFILE now */
    FILE *probe = fopen("/proc/self/stat", "r");
    bool emfile = probe == NULL && errno == EMFILE;
    if (probe) fclose(probe);
    usleep(30000); /* past the liveness cache */
    uint64_t n = 99;
    int rc = skv_kv_evict(f.kv, 8, &n);
    setrlimit(RLIMIT_NOFILE, &old);
    PE_CHECK(emfile, "the descriptor limit did not take");
    PE_CHECK(rc == 0 && n == 0, "evicted %llu pages a live PE pins (rc %d)", (unsigned long long)n,
             rc);
    usleep(30000);
    PE_CHECK(skv_kv_evict(f.kv, 8, &n) == 0 && n == 0, "later: evicted %llu pinned pages",
             (unsigned long long)n);
  }
  PE_CHECK(skv_ctx_barrier(f.ctx) == 0, "barrier");
  if (rank == 1) {
    PE_CHECK(skv_kv_fetch(f.kv, refs, 8, f.eng.lay, ids, SKV_FETCH_UNPIN, NULL) == 0,
             "fetch of pinned pages: %s", skv_last_error());
  }
  PE_CHECK(skv_ctx_barrier(f.ctx) == 0, "barrier");
  if (rank == 0) {
    uint64_t n;
    PE_CHECK(skv_kv_evict(f.kv, 8, &n) == 0 && n == 8, "unpinned: evicted %llu of 8",
             (unsigned long long)n);
  }
  PE_CHECK(skv_ctx_barrier(f.ctx) == 0, "barrier");
  fix_fini(&f);
  return 0;
}

Test(kv, pins_hold_while_the_owner_cannot_read_proc) {
  skv_test_job_t job;
  int bad = skv_test_run(&job, 2, pe_pinner_while_proc_unreadable, NULL, 60000);
  cr_assert_eq(bad, 0, "PEs failed: %s", skv_test_statuses(&job));
}

/* A pin that meets the evictor between its CAS and its pins read (EVICTING, same generation)
 * waits for the verdict instead of reporting the page stale: here the "evictor" reads the
 * pins, finds the pin and puts the page back to READY, as try_evict does. One that never
 * resolves is stale. */
typedef struct evicting_arg {
  skv__page_meta_t *m;
  uint64_t ready, bit;
} evicting_arg_t;

static void *restore_ready(void *a) {
  evicting_arg_t *e = a;
  while (!(skv__page_pins(e->m) & e->bit)) sched_yield();
  __atomic_store_n(&e->m->state, e->ready, __ATOMIC_SEQ_CST);
  return NULL;
}

static int pe_pin_meets_evicting(int rank, int npes, void *arg) {
  fix_t f;
  PE_CHECK(fix_init(&f, 8, 16, 20000) == 0, "fixture: %s", skv_last_error());
  size_t ins;
  uint64_t id = 3;
  PE_CHECK(publish_ids(&f, &id, 1, &ins) == 0 && ins == 1, "publish");
  skv_key_t k = key_of(&f, id);
  skv_page_ref_t ref;
  size_t nhit;
  PE_CHECK(skv_kv_lookup(f.kv, f.ns, &k, 1, 0, &ref, &nhit) == 0 && nhit == 1, "lookup");
  skv__page_meta_t *m = &f.kv->pool.meta[ref.pe][ref.page];
  uint64_t ready = skv__st_make(ref.gen, SKV_PAGE_READY),
           evicting = skv__st_make(ref.gen, SKV_PAGE_EVICTING);
  PE_CHECK(__atomic_load_n(&m->state, __ATOMIC_SEQ_CST) == ready, "page READY");
  evicting_arg_t e = {m, ready, 1ull << rank};
  __atomic_store_n(&m->state, evicting, __ATOMIC_SEQ_CST);
  pthread_t t;
  PE_CHECK(pthread_create(&t, NULL, restore_ready, &e) == 0, "thread");
  int rc = skv__pool_pin(&f.kv->pool, ref.pe, ref.page, ref.gen);
  pthread_join(t, NULL);
  PE_CHECK(rc == 0, "pin while the evictor decides: %s", skv_err_name(rc));
  PE_CHECK(skv__pool_unpin(&f.kv->pool, ref.pe, ref.page) == 0, "unpin");
  /* an evictor that stopped in EVICTING: the pin gives up (bounded) and reports stale */
  __atomic_store_n(&m->state, evicting, __ATOMIC_SEQ_CST);
  uint64_t t0 = skv__now_ms();
  PE_CHECK(skv__pool_pin(&f.kv->pool, ref.pe, ref.page, ref.gen) == SKV_ESTALE,
           "stuck EVICTING is stale");
  PE_CHECK(skv__now_ms() - t0 < 1000, "the pin waited %llu ms",
           (unsigned long long)(skv__now_ms() - t0));
  PE_CHECK(skv__page_pins(m) == 0, "pin cleared");
  __atomic_store_n(&m->state, ready, __ATOMIC_SEQ_CST);
  fix_fini(&f);
  return 0;
}

Test(kv, a_pin_waits_for_the_evictor_s_verdict) {
  skv_test_job_t job;
  int bad = skv_test_run(&job, 1, pe_pin_meets_evicting, NULL, 30000);
  cr_assert_eq(bad, 0, "PEs failed: %s", skv_test_statuses(&job));
}

/* The owner of a page dies inside its own eviction, between its CAS to EVICTING and the end
 * (forged in the shared records, as try_evict leaves them): key 1 died before the index erase,
 * key 2 after it. The state is not broken for the cache's life: a pin that meets EVICTING of a
 * dead owner puts the page back to READY (its bytes are intact), so pinned and unpinned
 * lookups of key 1 hit and fetch the right bytes, and key 2 is published again. */
static int pe_owner_dies_evicting(int rank, int npes, void *arg) {
  fix_t f;
  PE_CHECK(fix_init(&f, 8, 16, 8000) == 0, "fixture: %s", skv_last_error());
  size_t ins, nhit;
  uint64_t ids[4] = {11, 12, 13, 14};
  skv_key_t k1 = key_of(&f, 11), k2 = key_of(&f, 12);
  if (rank == 1) PE_CHECK(publish_ids(&f, ids, 4, &ins) == 0 && ins == 4, "publish");
  PE_CHECK(skv_ctx_barrier(f.ctx) == 0, "barrier");
  skv_page_ref_t r1, r2;
  PE_CHECK(skv_kv_lookup(f.kv, f.ns, &k1, 1, 0, &r1, &nhit) == 0 && nhit == 1, "lookup 1");
  PE_CHECK(skv_kv_lookup(f.kv, f.ns, &k2, 1, 0, &r2, &nhit) == 0 && nhit == 1, "lookup 2");
  PE_CHECK(r1.pe == 1 && r2.pe == 1, "rank 1 owns the pages");
  PE_CHECK(skv_ctx_barrier(f.ctx) == 0, "barrier");
  if (rank == 1) { /* the evictor's steps, then death */
    for (int i = 0; i < 2; i++) {
      const skv_page_ref_t *r = i == 0 ? &r1 : &r2;
      uint64_t st = skv__st_make(r->gen, SKV_PAGE_READY);
      PE_CHECK(__atomic_compare_exchange_n(&f.kv->pool.meta[1][r->page].state, &st,
                                           skv__st_make(r->gen, SKV_PAGE_EVICTING), false,
                                           __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST),
               "CAS to EVICTING");
    }
    PE_CHECK(skv__index_erase(&f.kv->index, k2, skv__val_pack(1, r2.page, r2.gen)) == 0,
             "erase key 2");
    raise(SIGKILL);
  }
  uint64_t t0 = skv__now_ms();
  while (skv__pool_alive(&f.kv->pool, 1) && skv__now_ms() - t0 < 5000) usleep(10000);
  PE_CHECK(!skv__pool_alive(&f.kv->pool, 1), "rank 1 is gone");
  PE_CHECK(skv_ctx_barrier(f.ctx) != 0, "the job is broken (a PE died)"); /* no hang either */
  uint64_t blk = 3 + (uint64_t)rank;
  skv_page_ref_t ref;
  /* key 1, the index still names it: a pinned lookup hits and the fetch is right */
  PE_CHECK(skv_kv_lookup(f.kv, f.ns, &k1, 1, SKV_LOOKUP_PIN, &ref, &nhit) == 0, "pinned lookup: %s",
           skv_last_error());
  PE_CHECK(nhit == 1, "a pinned lookup of a key whose dead owner was evicting it misses");
  engine_poison(&f.eng);
  int rc = skv_kv_fetch(f.kv, &ref, 1, f.eng.lay, &blk, SKV_FETCH_UNPIN, NULL);
  PE_CHECK(rc == 0 && block_holds(&f, blk, 11), "pinned fetch of key 1: %s", skv_err_name(rc));
  /* an unpinned lookup and fetch, and a publish of the same key (deduplicated: it is cached) */
  PE_CHECK(skv_kv_lookup(f.kv, f.ns, &k1, 1, 0, &ref, &nhit) == 0 && nhit == 1, "lookup 1");
  engine_poison(&f.eng);
  rc = skv_kv_fetch(f.kv, &ref, 1, f.eng.lay, &blk, 0, NULL);
  PE_CHECK(rc == 0 && block_holds(&f, blk, 11), "fetch of key 1: %s", skv_err_name(rc));
  uint64_t st = __atomic_load_n(&f.kv->pool.meta[1][r1.page].state, __ATOMIC_SEQ_CST);
  PE_CHECK(st == skv__st_make(r1.gen, SKV_PAGE_READY), "page of key 1 is READY again");
  /* key 2, erased before the owner died: a miss, and published again by a survivor */
  if (rank == 0) {
    PE_CHECK(skv_kv_lookup(f.kv, f.ns, &k2, 1, 0, &ref, &nhit) == 0 && nhit == 0, "key 2 gone");
    fill_block(&f, 7, 12);
    rc = skv_kv_publish(f.kv, f.ns, &k2, 1, f.eng.lay, (uint64_t[]){7}, NULL, &ins);
    PE_CHECK(rc == 0 && ins == 1, "republish of key 2: %s, %zu inserted", skv_err_name(rc), ins);
    PE_CHECK(skv_kv_lookup(f.kv, f.ns, &k2, 1, SKV_LOOKUP_PIN, &ref, &nhit) == 0 && nhit == 1,
             "key 2 found again");
    engine_poison(&f.eng);
    rc = skv_kv_fetch(f.kv, &ref, 1, f.eng.lay, &blk, SKV_FETCH_UNPIN, NULL);
    PE_CHECK(rc == 0 && block_holds(&f, blk, 12), "fetch of key 2: %s", skv_err_name(rc));
  }
  skv_kv_destroy(f.kv); /* the job is broken: these fail, and must not hang */
  engine_free(&f.eng);
  skv_namespace_destroy(f.ns);
  skv_finalize(f.ctx);
  return 0;
}

Test(kv, owner_dying_inside_its_eviction_leaves_the_key_usable) {
  skv_test_job_t job;
  skv_test_spawn(&job, 3, pe_owner_dies_evicting, NULL);
  skv_test_wait(&job, 90000);
  cr_assert_eq(job.status[1], 128 + SIGKILL, "%s", skv_test_statuses(&job));
  cr_assert(job.status[0] == 0 && job.status[2] == 0, "survivors: %s", skv_test_statuses(&job));
}

/* A reader stopped (SIGSTOP) while it holds pins: before leases nothing reclaimed the pins of a
 * PE that lives, so the owner could never evict those pages (0 of 4 in 20 s). With leases
 * (SKV_PIN_LEASE_MS, 1 s here) the owner evicts them once the lease ran out, reuses them, and
 * the reader, continued, gets SKV_ESTALE from its fetch and no bytes (never the new ones). */
#define LEASE_WAIT_MS 20000 /* how long the owner tries (longer than the lease) */

static int pe_stopped_reader(int rank, int npes, void *arg) {
  fix_t f;
  PE_CHECK(fix_init(&f, 4, 16, 60000) == 0, "fixture: %s", skv_last_error());
  size_t ins, nhit;
  uint64_t ids[4] = {21, 22, 23, 24};
  skv_key_t keys[4];
  for (int i = 0; i < 4; i++) keys[i] = key_of(&f, ids[i]);
  if (rank == 0) PE_CHECK(publish_ids(&f, ids, 4, &ins) == 0 && ins == 4, "publish");
  PE_CHECK(skv_ctx_barrier(f.ctx) == 0, "barrier");
  skv_page_ref_t refs[4];
  if (rank == 1) {
    PE_CHECK(skv_kv_lookup(f.kv, f.ns, keys, 4, SKV_LOOKUP_PIN, refs, &nhit) == 0 && nhit == 4,
             "pin all four");
    PE_CHECK(skv_store_set(f.ctx, "pinned", "1", 1) == 0, "tell the owner");
    raise(SIGSTOP); /* the owner continues us once it evicted and reused the pages */
    engine_poison(&f.eng);
    uint64_t blocks[4] = {4, 5, 6, 7};
    int rc = skv_kv_fetch(f.kv, refs, 4, f.eng.lay, blocks, SKV_FETCH_UNPIN, NULL);
    PE_CHECK(rc == SKV_ESTALE, "the fetch of a reader whose pins expired gives %s",
             skv_err_name(rc));
    uint8_t used[16] = {0};
    PE_CHECK(untouched_outside(&f.eng, used), "an expired fetch wrote bytes");
    PE_CHECK(skv_kv_unpin(f.kv, refs, 4) == 0, "unpinning revoked pins: %s", skv_last_error());
  } else {
    char v[4];
    size_t n = 0;
    PE_CHECK(skv_store_get(f.ctx, "pinned", v, sizeof v, &n) == 0, "reader pinned");
    uint64_t t0 = skv__now_ms(), evicted = 0, e = 0;
    while (evicted < 4 && skv__now_ms() - t0 < LEASE_WAIT_MS) {
      PE_CHECK(skv_kv_evict(f.kv, 4 - evicted, &e) == 0, "evict");
      evicted += e;
      usleep(50000);
    }
    int64_t reader = __atomic_load_n(&f.kv->pool.hdr[1]->pid, __ATOMIC_ACQUIRE);
    if (evicted == 4) { /* reuse the pages with other keys */
      uint64_t other[4] = {31, 32, 33, 34};
      PE_CHECK(publish_ids(&f, other, 4, &ins) == 0 && ins == 4, "reuse");
    }
    uint64_t took = skv__now_ms() - t0;
    kill((pid_t)reader, SIGCONT);
    PE_CHECK(took >= 900 || evicted < 4, "evicted within %llu ms, before the 1 s lease ran out",
             (unsigned long long)took);
    PE_CHECK(evicted == 4,
             "the owner evicted %llu of 4 pages pinned by a stopped reader in %d ms: its pins "
             "never expire",
             (unsigned long long)evicted, LEASE_WAIT_MS);
  }
  PE_CHECK(skv_ctx_barrier(f.ctx) == 0, "barrier");
  fix_fini(&f);
  return 0;
}

Test(kv, pins_of_a_stopped_reader_expire, .timeout = 120) {
  setenv("SKV_PIN_LEASE_MS", "1000", 1); /* read by the PEs forked below */
  skv_test_job_t job;
  int bad = skv_test_run(&job, 2, pe_stopped_reader, NULL, 90000);
  cr_assert_eq(bad, 0, "PEs failed: %s", skv_test_statuses(&job));
}

/* The other side of leases: a reader that keeps calling (lookups of other keys every 100 ms)
 * keeps its pins past many leases (1 s), the owner evicts none of its pinned pages in 3 s, and
 * the reader's fetch then copies the right bytes. */
static int pe_busy_reader(int rank, int npes, void *arg) {
  SKV_UNUSED(arg);
  SKV_UNUSED(npes);
  fix_t f;
  PE_CHECK(fix_init(&f, 4, 16, 60000) == 0, "fixture: %s", skv_last_error());
  size_t ins, nhit;
  uint64_t ids[4] = {41, 42, 43, 44};
  skv_key_t keys[4];
  for (int i = 0; i < 4; i++) keys[i] = key_of(&f, ids[i]);
  if (rank == 0) PE_CHECK(publish_ids(&f, ids, 4, &ins) == 0 && ins == 4, "publish");
  PE_CHECK(skv_ctx_barrier(f.ctx) == 0, "barrier");
  if (rank == 1) {
    skv_page_ref_t refs[4], other[1];
    PE_CHECK(skv_kv_lookup(f.kv, f.ns, keys, 4, SKV_LOOKUP_PIN, refs, &nhit) == 0 && nhit == 4,
             "pin all four");
    PE_CHECK(skv_store_set(f.ctx, "pinned", "1", 1) == 0, "tell the owner");
    skv_key_t none = key_of(&f, 999);
    for (uint64_t t0 = skv__now_ms(); skv__now_ms() - t0 < 3500;) {
      PE_CHECK(skv_kv_lookup(f.kv, f.ns, &none, 1, 0, other, &nhit) == 0, "lookup");
      usleep(100000);
    }
    char v[4];
    size_t n = 0;
    PE_CHECK(skv_store_get(f.ctx, "tried", v, sizeof v, &n) == 0, "the owner tried");
    engine_poison(&f.eng);
    uint64_t blocks[4] = {4, 5, 6, 7};
    PE_CHECK(skv_kv_fetch(f.kv, refs, 4, f.eng.lay, blocks, SKV_FETCH_UNPIN, NULL) == 0,
             "fetch with pins kept alive: %s", skv_last_error());
    for (int i = 0; i < 4; i++)
      PE_CHECK(block_holds(&f, blocks[i], ids[i]), "block %d has the wrong bytes", i);
  } else {
    char v[4];
    size_t n = 0;
    PE_CHECK(skv_store_get(f.ctx, "pinned", v, sizeof v, &n) == 0, "reader pinned");
    uint64_t t0 = skv__now_ms(), evicted = 0, e = 0;
    while (skv__now_ms() - t0 < 3000) {
      PE_CHECK(skv_kv_evict(f.kv, 4, &e) == 0, "evict");
      evicted += e;
      usleep(50000);
    }
    PE_CHECK(evicted == 0, "the owner evicted %llu pages a busy reader pinned",
             (unsigned long long)evicted);
    PE_CHECK(skv_store_set(f.ctx, "tried", "1", 1) == 0, "tell the reader");
  }
  PE_CHECK(skv_ctx_barrier(f.ctx) == 0, "barrier");
  fix_fini(&f);
  return 0;
}

Test(kv, pins_of_a_busy_reader_outlive_their_lease, .timeout = 120) {
  setenv("SKV_PIN_LEASE_MS", "1000", 1);
  skv_test_job_t job;
  int bad = skv_test_run(&job, 2, pe_busy_reader, NULL, 90000);
  cr_assert_eq(bad, 0, "PEs failed: %s", skv_test_statuses(&job));
}

/* SKV_FETCH_UNPIN releases the caller's pins: a fetch with it of references the caller has not
 * pinned (or pinned fewer times than they appear) fails with SKV_EINVAL before anything is copied,
 * and takes nobody's pins. */
static int pe_unpin_without_pins(int rank, int npes, void *arg) {
  fix_t f;
  PE_CHECK(fix_init(&f, 8, 16, 30000) == 0, "fixture: %s", skv_last_error());
  size_t ins, nhit;
  uint64_t ids[2] = {41, 42};
  PE_CHECK(publish_ids(&f, ids, 2, &ins) == 0 && ins == 2, "publish");
  skv_key_t keys[2] = {key_of(&f, 41), key_of(&f, 42)};
  skv_page_ref_t refs[2], twice[2];
  PE_CHECK(skv_kv_lookup(f.kv, f.ns, keys, 2, 0, refs, &nhit) == 0 && nhit == 2, "lookup");
  uint64_t blocks[2] = {5, 6};
  uint8_t used[16] = {0};
  engine_poison(&f.eng);
  int rc = skv_kv_fetch(f.kv, refs, 2, f.eng.lay, blocks, SKV_FETCH_UNPIN, NULL);
  PE_CHECK(rc == SKV_EINVAL && strstr(skv_last_error(), "not pinned"),
           "unpinned references with SKV_FETCH_UNPIN: %s (%s)", skv_err_name(rc), skv_last_error());
  PE_CHECK(untouched_outside(&f.eng, used), "the refused fetch copied bytes");
  /* pinned once, listed twice: refused as well, and the pin is still there */
  PE_CHECK(skv_kv_lookup(f.kv, f.ns, keys, 1, SKV_LOOKUP_PIN, refs, &nhit) == 0 && nhit == 1,
           "pin");
  twice[0] = twice[1] = refs[0];
  rc = skv_kv_fetch(f.kv, twice, 2, f.eng.lay, blocks, SKV_FETCH_UNPIN, NULL);
  PE_CHECK(rc == SKV_EINVAL, "a reference pinned once, listed twice: %s", skv_err_name(rc));
  PE_CHECK(untouched_outside(&f.eng, used), "the refused fetch copied bytes");
  rc = skv_kv_fetch(f.kv, refs, 1, f.eng.lay, blocks, SKV_FETCH_UNPIN, NULL);
  PE_CHECK(rc == 0 && block_holds(&f, 5, 41), "the pinned fetch: %s", skv_err_name(rc));
  PE_CHECK(skv_kv_unpin(f.kv, refs, 1) == SKV_EINVAL, "the fetch released the pin");
  fix_fini(&f);
  return 0;
}

Test(kv, fetch_unpin_without_pins_copies_nothing) {
  skv_test_job_t job;
  int bad = skv_test_run(&job, 1, pe_unpin_without_pins, NULL, 30000);
  cr_assert_eq(bad, 0, "PEs failed: %s", skv_test_statuses(&job));
}

static int pe_bad_input(int rank, int npes, void *arg) {
  fix_t f;
  PE_CHECK(fix_init(&f, 8, 16, 30000) == 0, "fixture: %s", skv_last_error());
  skv_key_t k = key_of(&f, 5);
  skv_page_ref_t ref = {0, 0, 1, 0};
  size_t nhit;
  uint64_t blk = 0;
  PE_CHECK(skv_kv_lookup(NULL, f.ns, &k, 1, 0, &ref, &nhit) == SKV_EINVAL, "NULL kv");
  PE_CHECK(skv_kv_lookup(f.kv, f.ns, NULL, 1, 0, &ref, &nhit) == SKV_EINVAL, "NULL keys");
  PE_CHECK(skv_kv_lookup(f.kv, f.ns, &k, 1, 0x80, &ref, &nhit) == SKV_EINVAL, "bad flags");
  skv_key_t zero = {0, 5};
  PE_CHECK(skv_kv_lookup(f.kv, f.ns, &zero, 1, 0, &ref, &nhit) == SKV_EINVAL, "reserved key");
  /* a namespace of another geometry is the wrong namespace */
  skv_geometry_t g2 = f.g;
  g2.page_tokens = 32;
  skv_namespace_t *ns2;
  PE_CHECK(skv_namespace_create("fixture", &g2, NULL, 0, "s3cret", 6, &ns2) == 0, "ns2");
  PE_CHECK(skv_kv_lookup(f.kv, ns2, &k, 1, 0, &ref, &nhit) == SKV_EINVAL &&
               strstr(skv_last_error(), "namespace"),
           "wrong namespace: %s", skv_last_error());
  PE_CHECK(skv_kv_publish(f.kv, ns2, &k, 1, f.eng.lay, &blk, NULL, NULL) == SKV_EINVAL,
           "publish wrong namespace");
  skv_namespace_destroy(ns2);
  skv_page_ref_t bad_pe = {(uint32_t)npes, 0, 1, 0}, bad_page = {0, 8, 1, 0},
                 bad_gen = {0, 0, 0, 0};
  PE_CHECK(skv_kv_fetch(f.kv, &bad_pe, 1, f.eng.lay, &blk, 0, NULL) == SKV_ERANGE,
           "PE out of range");
  PE_CHECK(skv_kv_fetch(f.kv, &bad_page, 1, f.eng.lay, &blk, 0, NULL) == SKV_ERANGE,
           "page out of range");
  PE_CHECK(skv_kv_fetch(f.kv, &bad_gen, 1, f.eng.lay, &blk, 0, NULL) == SKV_EINVAL, "generation 0");
  uint64_t big = 16;
  PE_CHECK(skv_kv_fetch(f.kv, &ref, 1, f.eng.lay, &big, 0, NULL) == SKV_EINVAL,
           "block id out of range");
  PE_CHECK(skv_kv_fetch(f.kv, &ref, 1, NULL, &blk, 0, NULL) == SKV_EINVAL, "NULL layout");
  PE_CHECK(skv_kv_fetch(f.kv, &ref, 1, f.eng.lay, NULL, 0, NULL) == SKV_EINVAL, "NULL block ids");
  PE_CHECK(skv_kv_fetch(f.kv, &ref, 1, f.eng.lay, &blk, 0, NULL) == SKV_ESTALE,
           "never-published page is stale");
  PE_CHECK(skv_kv_publish(f.kv, f.ns, &k, 1, f.eng.lay, &big, NULL, NULL) == SKV_EINVAL,
           "publish bad block");
  PE_CHECK(skv_kv_unpin(f.kv, &ref, 1) == SKV_EINVAL, "unpin of an unpinned page");
  skv_kv_opts_t o = SKV_KV_OPTS_INIT;
  skv_kv_t *kv2;
  PE_CHECK(skv_kv_create(f.ctx, &f.g, &o, &kv2) == SKV_EINVAL, "0 pages");
  o.pages_per_pe = 1ull << 40;
  PE_CHECK(skv_kv_create(f.ctx, &f.g, &o, &kv2) == SKV_EINVAL, "too many pages");
  o.pages_per_pe = 4;
  o.size = 3;
  PE_CHECK(skv_kv_create(f.ctx, &f.g, &o, &kv2) == SKV_EINVAL, "bad opts size");
  skv_geometry_t bad = f.g;
  bad.head_dim = 0;
  o = (skv_kv_opts_t)SKV_KV_OPTS_INIT;
  o.pages_per_pe = 4;
  PE_CHECK(skv_kv_create(f.ctx, &bad, &o, &kv2) == SKV_EINVAL &&
               strstr(skv_last_error(), "head_dim"),
           "bad geometry named: %s", skv_last_error());
  PE_CHECK(skv_ctx_barrier(f.ctx) == 0, "barrier");
  fix_fini(&f);
  return 0;
}

Test(kv, bad_input_gives_clear_errors) {
  skv_test_job_t job;
  int bad = skv_test_run(&job, 2, pe_bad_input, NULL, 60000);
  cr_assert_eq(bad, 0, "PEs failed: %s", skv_test_statuses(&job));
}

/* ---- stress: PEs publish, look up, fetch, verify, unpin and evict overlapping keys ---- */

static int pe_stress(int rank, int npes, void *arg) {
  int seconds = *(int *)arg;
  fix_t f;
  PE_CHECK(fix_init(&f, 48, 64, 60000) == 0, "fixture: %s", skv_last_error());
  uint64_t s = skv_test_seed() + (uint64_t)rank;
  uint64_t t_end = skv__now_ms() + (uint64_t)seconds * 1000;
  uint64_t ops = 0, fetched = 0, stale = 0;
  PE_CHECK(skv_ctx_barrier(f.ctx) == 0, "barrier");
  while (skv__now_ms() < t_end) {
    ops++;
    uint64_t base = skv_test_rand(&s) % 200; /* overlapping key space: chains of ids */
    size_t n = 1 + skv_test_rand(&s) % 8;
    uint64_t ids[8];
    skv_key_t keys[8];
    for (size_t i = 0; i < n; i++) ids[i] = base + i, keys[i] = key_of(&f, ids[i]);
    switch (skv_test_rand(&s) % 4) {
    case 0: {
      size_t ins;
      int rc = publish_ids(&f, ids, n, &ins);
      PE_CHECK(rc == 0 || rc == SKV_ENOSPC, "publish: %s", skv_err_name(rc));
      break;
    }
    case 1:
    case 2: {
      skv_page_ref_t refs[8];
      size_t nhit;
      PE_CHECK(skv_kv_lookup(f.kv, f.ns, keys, n, SKV_LOOKUP_PIN, refs, &nhit) == 0, "lookup");
      if (nhit == 0) break;
      uint64_t blocks[8];
      for (size_t i = 0; i < nhit; i++) blocks[i] = 16 + i;
      int rc = skv_kv_fetch(f.kv, refs, nhit, f.eng.lay, blocks, SKV_FETCH_UNPIN, NULL);
      PE_CHECK(rc == 0, "fetch of pinned pages: %s", skv_err_name(rc));
      for (size_t i = 0; i < nhit; i++)
        PE_CHECK(block_holds(&f, blocks[i], ids[i]),
                 "fetched page of key %llu holds other data (freed or reused?)",
                 (unsigned long long)ids[i]);
      fetched += nhit;
      break;
    }
    default: {
      if (skv_test_rand(&s) % 4 == 0) {
        uint64_t ne;
        skv_kv_evict(f.kv, 1 + skv_test_rand(&s) % 4, &ne);
      } else {
        /* unpinned lookup then fetch: may be stale, never wrong */
        skv_page_ref_t refs[8];
        size_t nhit;
        PE_CHECK(skv_kv_lookup(f.kv, f.ns, keys, n, 0, refs, &nhit) == 0, "lookup");
        if (nhit == 0) break;
        uint64_t blocks[8];
        for (size_t i = 0; i < nhit; i++) blocks[i] = 32 + i;
        int rc = skv_kv_fetch(f.kv, refs, nhit, f.eng.lay, blocks, 0, NULL);
        if (rc == SKV_ESTALE) {
          stale++;
          break;
        }
        PE_CHECK(rc == 0, "fetch: %s", skv_err_name(rc));
        for (size_t i = 0; i < nhit; i++)
          PE_CHECK(block_holds(&f, blocks[i], ids[i]), "unpinned fetch content");
      }
    }
    }
  }
  PE_CHECK(skv_ctx_barrier(f.ctx) == 0, "barrier after %llu ops", (unsigned long long)ops);
  /* invariants: pins balanced, at most one VALID copy per key, every entry names a READY page
   * holding that key, and every READY page of ours is indexed (no lost entries) */
  skv_kv_stats_t st = SKV_KV_STATS_INIT;
  skv_kv_get_stats(f.kv, &st);
  PE_CHECK(st.pages_pinned == 0, "%llu pages still pinned", (unsigned long long)st.pages_pinned);
  int64_t entries = skv__index_check(&f.kv->index);
  PE_CHECK(entries >= 0, "index check: %s", skv_last_error());
  uint64_t ready = 0;
  for (uint64_t pg = 0; pg < f.kv->pool.pages; pg++) {
    skv__page_meta_t *m = &f.kv->pool.meta[rank][pg];
    if (skv__st_state(m->state) != SKV_PAGE_READY) continue;
    ready++;
    skv_key_t k = {m->key_hi, m->key_lo};
    uint64_t v;
    PE_CHECK(skv__index_lookup(&f.kv->index, k, &v) == 0, "READY page %llu is not indexed",
             (unsigned long long)pg);
    PE_CHECK(skv__val_pe(v) == (uint32_t)rank && skv__val_page(v) == pg &&
                 skv__val_gen(v) == skv__st_gen(m->state),
             "index entry of page %llu names another page", (unsigned long long)pg);
  }
  /* and every VALID entry naming one of our pages names a READY page holding that key */
  skv__index_t *ix = &f.kv->index;
  for (int sh = 0; sh < ix->nshards; sh++)
    for (uint64_t i = 0; i < ix->slots_per_shard; i++) {
      skv__index_slot_t *sl = &ix->slots[sh][i];
      uint64_t v = sl->val;
      if (sl->key.p.hi == 0 || !(v & SKV_VAL_VALID) || skv__val_pe(v) != (uint32_t)rank) continue;
      skv__page_meta_t *m = &f.kv->pool.meta[rank][skv__val_page(v)];
      PE_CHECK(skv__st_state(m->state) == SKV_PAGE_READY &&
                   skv__st_gen(m->state) == skv__val_gen(v) && m->key_hi == sl->key.p.hi &&
                   m->key_lo == sl->key.p.lo,
               "orphan entry shard %d slot %llu -> page %u gen %u; page state %u gen %u, key %s, "
               "ticket %llu",
               sh, (unsigned long long)i, skv__val_page(v), skv__val_gen(v),
               skv__st_state(m->state), skv__st_gen(m->state),
               m->key_hi == sl->key.p.hi && m->key_lo == sl->key.p.lo ? "same" : "differs",
               (unsigned long long)sl->ticket);
    }
  uint64_t all_ready[SKV_TEST_MAX_PES];
  PE_CHECK(skv_ctx_allgather(f.ctx, &ready, all_ready, sizeof ready) == 0, "ag");
  uint64_t total = 0;
  for (int r = 0; r < npes; r++) total += all_ready[r];
  PE_CHECK((uint64_t)entries == total, "index has %lld entries, PEs hold %llu READY pages",
           (long long)entries, (unsigned long long)total);
  PE_CHECK(st.pages_used == ready, "used %llu ready %llu", (unsigned long long)st.pages_used,
           (unsigned long long)ready);
  fprintf(stderr, "rank %d: %llu ops, %llu pages fetched and verified, %llu stale\n", rank,
          (unsigned long long)ops, (unsigned long long)fetched, (unsigned long long)stale);
  PE_CHECK(fetched > 0, "the stress test fetched nothing");
  PE_CHECK(skv_ctx_barrier(f.ctx) == 0, "barrier");
  fix_fini(&f);
  return 0;
}

Test(kv, concurrent_stress_keeps_invariants) {
  int seconds = 20;
  const char *e = getenv("SKV_TEST_STRESS_SECONDS");
  if (e && atoi(e) > 0) seconds = atoi(e);
  skv_test_job_t job;
  int bad = skv_test_run(&job, 4, pe_stress, &seconds, (seconds + 60) * 1000);
  cr_assert_eq(bad, 0, "PEs failed: %s", skv_test_statuses(&job));
}

/* ---- a local attacker squatting the fd exchange's socket names ---- */

static volatile sig_atomic_t squat_stop;
static void squat_term(int sig) {
  squat_stop = 1;
}

/* Accept what PEs send to the squatter's sockets; returns the descriptors received. */
static uint64_t squat_drain(const int *socks, size_t n) {
  uint64_t got = 0;
  for (size_t i = 0; i < n; i++) {
    int c;
    while ((c = accept4(socks[i], NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC)) >= 0) {
      char hdr[64];
      union {
        char buf[CMSG_SPACE(sizeof(int) * 8)];
        struct cmsghdr align;
      } u;
      struct iovec iov = {.iov_base = hdr, .iov_len = sizeof hdr};
      struct msghdr m = {
          .msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf, .msg_controllen = sizeof u.buf};
      for (int tries = 0;
           tries < 100 && recvmsg(c, &m, MSG_DONTWAIT | MSG_CMSG_CLOEXEC) < 0 && errno == EAGAIN;
           tries++)
        usleep(100);
      for (struct cmsghdr *cm = CMSG_FIRSTHDR(&m); cm; cm = CMSG_NXTHDR(&m, cm)) {
        if (cm->cmsg_level != SOL_SOCKET || cm->cmsg_type != SCM_RIGHTS) continue;
        size_t k = (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t j = 0; j < k; j++) {
          int fd;
          memcpy(&fd, CMSG_DATA(cm) + j * sizeof(int), sizeof fd);
          close(fd);
          got++;
        }
      }
      close(c);
    }
  }
  return got;
}

/* A local user (`nobody` when the tests run as root) that watches /proc/net/unix, where every
 * user sees the names of bound abstract sockets, and binds every symkv name it can guess from
 * those: for a name "@symkv/<x>/<i>" (a visible hash and an index) the same hash with indexes 0
 * to 15. It listens on what it bound and takes whatever descriptors PEs send there. Writes one
 * byte to `ready_fd` once running (1 when it runs as another user); on SIGTERM writes the names
 * it bound and the descriptors it received (two uint64) to `out_fd` and exits. */
static void squatter(int ready_fd, int out_fd) {
  char why[160];
  uint8_t other = skv_test_become_other_user(4096, why, sizeof why) == 1;
  signal(SIGTERM, squat_term);
  (void)!write(ready_fd, &other, 1);
  close(ready_fd);
  enum { CAP = 1 << 20, MAXS = 2048 };
  char *buf = malloc(CAP);
  static int socks[MAXS];
  static char seen[MAXS][64];
  size_t nsocks = 0, nseen = 0;
  uint64_t bound = 0, stolen = 0;
  while (!squat_stop && buf) {
    int f = open("/proc/net/unix", O_RDONLY | O_CLOEXEC);
    ssize_t n = 0, r;
    while (f >= 0 && n < CAP - 1 && (r = read(f, buf + n, (size_t)(CAP - 1 - n))) > 0) n += r;
    if (f >= 0) close(f);
    buf[n > 0 ? n : 0] = '\0';
    for (char *line = buf; line && *line;) {
      char *nl = strchr(line, '\n');
      if (nl) *nl = '\0';
      char *at = strstr(line, " @symkv/");
      char *slash = at ? strrchr(at + 8, '/') : NULL;
      size_t plen = slash ? (size_t)(slash - (at + 2)) + 1 : 0; /* "symkv/<x>/" */
      if (slash && plen < 60) {
        bool known = false;
        for (size_t i = 0; i < nseen && !known; i++)
          known = strncmp(seen[i], at + 2, plen) == 0 && seen[i][plen] == '\0';
        if (!known && nseen < MAXS) {
          memcpy(seen[nseen], at + 2, plen);
          seen[nseen++][plen] = '\0';
          for (int j = 0; j < 16 && nsocks < MAXS; j++) {
            struct sockaddr_un a;
            memset(&a, 0, sizeof a);
            a.sun_family = AF_UNIX;
            int k = snprintf(a.sun_path + 1, sizeof a.sun_path - 1, "%s%d", seen[nseen - 1], j);
            int s = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
            socklen_t alen = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + (size_t)k);
            if (s >= 0 && bind(s, (struct sockaddr *)&a, alen) == 0 && listen(s, 64) == 0) {
              socks[nsocks++] = s;
              bound++;
            } else if (s >= 0) {
              close(s);
            }
          }
        }
      }
      line = nl ? nl + 1 : NULL;
    }
    stolen += squat_drain(socks, nsocks);
  }
  stolen += squat_drain(socks, nsocks);
  uint64_t res[2] = {bound, stolen};
  (void)!write(out_fd, res, sizeof res); /* one write: the parent reads both at once */
  _exit(0);
}

static int pe_squatted(int rank, int npes, void *arg) {
  int rounds = *(int *)arg;
  skv_ctx_t *ctx = NULL;
  PE_CHECK(skv_test_init(&ctx, 20000) == 0, "init: %s", skv_last_error());
  skv_log_set_level(SKV_LOG_NONE, SKV_SUBSYS_ALL);
  skv_geometry_t g = geom_make(SKV_KV_SPLIT, 1, 1, 64, 2, 16);
  skv_kv_opts_t o = SKV_KV_OPTS_INIT;
  o.pages_per_pe = 4;
  int failed = 0;
  char first[600] = "";
  for (int i = 0; i < rounds; i++) {
    skv_kv_t *kv = NULL;
    int rc = skv_kv_create(ctx, &g, &o, &kv);
    if (rc != 0) {
      if (!failed++) snprintf(first, sizeof first, "%s: %s", skv_err_name(rc), skv_last_error());
      continue;
    }
    PE_CHECK(skv_kv_destroy(kv) == 0, "destroy: %s", skv_last_error());
  }
  PE_CHECK(failed == 0, "%d of %d skv_kv_create failed with the squatter running; first: %s",
           failed, rounds, first);
  PE_CHECK(skv_finalize(ctx) == 0, "finalize: %s", skv_last_error());
  return 0;
}

/* Abstract unix sockets have no permission check and their names are visible to every user:
 * the fd exchange's names are random and known only through the store (which needs the job's
 * token), and a PE sends its descriptor only to a listener of its own user. With the squatter
 * running, every create succeeds and the squatter never receives a descriptor. */
Test(kv, create_survives_socket_name_squatting, .timeout = 180) {
  int pfd[2], ofd[2];
  cr_assert(pipe(pfd) == 0 && pipe(ofd) == 0);
  fflush(stdout);
  fflush(stderr);
  pid_t att = fork();
  if (att == 0) { /* no Criterion call in the child: it would talk to the runner */
    close(pfd[0]);
    close(ofd[0]);
    squatter(pfd[1], ofd[1]);
  }
  cr_assert_geq(att, 0, "fork: %s", strerror(errno));
  close(pfd[1]);
  close(ofd[1]);
  uint8_t other = 0;
  cr_assert_eq(read(pfd[0], &other, 1), 1, "the squatter never started");
  close(pfd[0]);
  cr_log_info("squatter running %s", other ? "as user 'nobody'" : "as this user (cannot switch)");
  int rounds = 15;
  skv_test_job_t job;
  int bad = skv_test_run(&job, 4, pe_squatted, &rounds, 150000);
  kill(att, SIGTERM);
  uint64_t res[2] = {0, 0};
  ssize_t got = 0, r;
  while (got < (ssize_t)sizeof res && (r = read(ofd[0], (char *)res + got, sizeof res - got)) > 0)
    got += r;
  cr_assert_eq(got, (ssize_t)sizeof res, "no report from the squatter");
  close(ofd[0]);
  waitpid(att, NULL, 0);
  cr_log_info("the squatter bound %llu names and received %llu descriptors",
              (unsigned long long)res[0], (unsigned long long)res[1]);
  cr_assert_eq(bad, 0, "PEs failed: %s", skv_test_statuses(&job));
  cr_assert_eq(res[1], 0, "the squatter received %llu descriptors", (unsigned long long)res[1]);
}

/* The cluster handle without Redis (no opts.redis_url, no SKV_REDIS_URL) is node-local in every
 * build: lookup, fetch and publish are the skv_kv_* calls. A Redis URL that cannot be served
 * fails clearly: SKV_ECONN naming it where the cluster layer is built, SKV_ENOTSUP saying how to
 * build it where it is not. */
Test(kv, cluster_handle_without_redis_is_node_local, .timeout = 60) {
  unsetenv("SKV_REDIS_URL");
  skv_geometry_t g = SKV_GEOMETRY_INIT;
  g.num_layers = 2, g.num_kv_heads = 2, g.head_dim = 32, g.elem_bytes = 2, g.page_tokens = 16;
  uint64_t pb;
  cr_assert_eq(skv_geometry_get_page_bytes(&g, &pb), 0);
  enum { NB = 8 };
  uint8_t *mem = malloc(pb * NB);
  void *base[1] = {mem};
  skv_layout_t *lay;
  skv_namespace_t *ns;
  cr_assert_eq(skv_layout_create_preset(&g, SKV_LAYOUT_CONTIGUOUS, 16, NB, base, -1, &lay), 0);
  cr_assert_eq(skv_namespace_create("m", &g, NULL, 0, "s", 1, &ns), 0);
  char name[64];
  snprintf(name, sizeof name, "t%d-cl", (int)getpid());
  skv_attach_opts_t ao = SKV_ATTACH_OPTS_INIT;
  ao.pages_per_pe = 16;
  ao.max_slots = 2;
  skv_kv_t *kv;
  cr_assert_eq(skv_kv_attach(name, &g, &ao, &kv), 0, "%s", skv_last_error());
  skv_cluster_t *cl;
  cr_assert_eq(skv_cluster_join(kv, NULL, &cl), 0, "%s", skv_last_error());
  skv_key_t keys[NB];
  uint64_t ids[NB];
  for (uint32_t i = 0; i < NB; i++) {
    cr_assert_eq(skv_namespace_hash_bytes(ns, &i, sizeof i, &keys[i]), 0);
    ids[i] = i;
  }
  for (uint64_t j = 0; j < pb * NB; j++) mem[j] = (uint8_t)(j * 13 + 5);
  size_t ins = 0;
  cr_assert_eq(skv_cluster_publish(cl, ns, keys, 5, lay, ids, NULL, &ins), 0);
  cr_assert_eq(ins, 5);
  cr_assert_eq(skv_cluster_flush(cl), 0);
  skv_cluster_ref_t refs[NB];
  size_t nl = 9, nh = 9;
  cr_assert_eq(skv_cluster_lookup(cl, ns, keys, NB, 0, refs, &nl, &nh), 0);
  cr_assert_eq(nl, 5);
  cr_assert_eq(nh, 5);
  for (size_t i = 0; i < nh; i++) cr_assert_eq(refs[i].node, SKV_NODE_LOCAL);
  memset(mem, 0xEE, pb * NB);
  cr_assert_eq(skv_cluster_fetch(cl, refs, nh, lay, ids, 0, NULL), 0, "%s", skv_last_error());
  for (uint64_t j = 0; j < pb * 5; j++) cr_assert_eq(mem[j], (uint8_t)(j * 13 + 5), "byte %lu", j);
  for (uint64_t j = pb * 5; j < pb * NB; j++) cr_assert_eq(mem[j], 0xEE);
  refs[0].node = 0; /* no peer nodes here */
  cr_assert_eq(skv_cluster_fetch(cl, refs, 1, lay, ids, 0, NULL), SKV_EINVAL);
  cr_assert_eq(skv_cluster_leave(cl), 0);
  /* a Redis URL where nothing listens (port 1) */
  skv_cluster_opts_t o = SKV_CLUSTER_OPTS_INIT;
  o.redis_url = "redis://127.0.0.1:1";
  o.timeout_ms = 2000;
  int rc = skv_cluster_join(kv, &o, &cl);
  cr_assert(rc == SKV_ECONN || rc == SKV_ENOTSUP, "%s", skv_err_name(rc));
  cr_assert(strstr(skv_last_error(), rc == SKV_ECONN ? "redis://127.0.0.1:1" : "libhiredis-dev"),
            "%s", skv_last_error());
  cr_assert_eq(skv_kv_detach(kv), 0);
  skv_layout_destroy(lay);
  skv_namespace_destroy(ns);
  free(mem);
}

/* ---- layer by layer: layouts of some layers, reserve / write / commit ---- */

/* Do layers [l0, l1) of page `src` (blocks sb[]) and of `dst` (blocks db[]) hold the same
 * vectors, and every other layer of `dst`'s blocks still poison? */
static int layers_equal_rest_poison(const engine_t *src, const uint64_t *sb, const engine_t *dst,
                                    const uint64_t *db, uint32_t l0, uint32_t l1) {
  const skv_geometry_t *g = &src->g;
  uint32_t kvn = g->kv_kind == SKV_KV_MLA ? 1 : 2;
  size_t vb = (size_t)g->head_dim * g->elem_bytes;
  for (uint32_t l = 0; l < g->num_layers; l++)
    for (uint32_t kv = 0; kv < kvn; kv++)
      for (uint32_t t = 0; t < g->page_tokens; t++)
        for (uint32_t h = 0; h < g->num_kv_heads; h++) {
          const uint8_t *d = ref_vec(dst, l, kv, db[t / dst->bt], t % dst->bt, h);
          if (l >= l0 && l < l1) {
            if (memcmp(ref_vec(src, l, kv, sb[t / src->bt], t % src->bt, h), d, vb) != 0) return 0;
          } else {
            for (size_t i = 0; i < vb; i++)
              if (d[i] != 0xA5) return 0;
          }
        }
  return 1;
}

typedef struct layers_param {
  int preset;
  uint32_t kind, layers;
} layers_param_t;

/* PE 0 saves a chain layer by layer (reserve, write layers in several calls, commit); PE 1 looks
 * it up between the writes (never a hit before the commit), then loads it layer by layer into
 * poisoned blocks, byte-exact against the writer's seed, layers not yet loaded still poison. */
/* One thread of two committing the same reservations at once. */
typedef struct race_commit {
  skv_kv_t *kv;
  skv_namespace_t *ns;
  const skv_key_t *keys;
  const skv_page_ref_t *refs;
  int rc;
  size_t ins;
} race_commit_t;

static void *race_commit(void *arg) {
  race_commit_t *r = arg;
  r->rc = skv_kv_commit(r->kv, r->ns, r->keys, 2, r->refs, NULL, &r->ins);
  return NULL;
}

/* Commit and abort claim each reserved page once: a reference listed twice is refused with
 * nothing done, and of two threads committing the same references one wins (rank 0's pages). */
static int reservations_finish_once(skv_kv_t *kv, skv_namespace_t *ns, const skv_layout_t *lay,
                                    const uint64_t *sb, skv_key_t k2) {
  size_t nres, nhit;
  skv_page_ref_t found[2];
  skv_kv_stats_t st0 = SKV_KV_STATS_INIT, st1 = SKV_KV_STATS_INIT;
  /* a reference listed twice is refused and nothing of the call is done: both pages stay
   * reservations, which a correct commit then publishes */
  skv_key_t kd[2] = {k2, k2};
  kd[0].lo ^= 0x5a5a;
  kd[1].lo ^= 0xa5a5;
  skv_page_ref_t rd[2], twice[2];
  PE_CHECK(skv_kv_reserve(kv, ns, kd, 2, rd, &nres) == 0 && nres == 2, "reserve 2");
  PE_CHECK(skv_kv_write(kv, rd, 2, lay, sb, NULL) == 0, "write 2: %s", skv_last_error());
  twice[0] = twice[1] = rd[0];
  size_t ins2 = 99;
  int rc2 = skv_kv_commit(kv, ns, kd, 2, twice, NULL, &ins2);
  PE_CHECK(rc2 == SKV_ESTATE && strstr(skv_last_error(), "twice"), "a reference listed twice: %s",
           skv_last_error());
  PE_CHECK(skv_kv_lookup(kv, ns, kd, 2, 0, found, &nhit) == 0 && nhit == 0,
           "%zu keys of a refused commit found", nhit);
  PE_CHECK(skv_kv_commit(kv, ns, kd, 2, rd, NULL, &ins2) == 0 && ins2 == 2,
           "commit after the refused one: %zu: %s", ins2, skv_last_error());
  PE_CHECK(skv_kv_lookup(kv, ns, kd, 2, 0, found, &nhit) == 0 && nhit == 2, "committed %zu", nhit);
  /* two threads committing the same references: one wins, the other is refused, every page
   * is finished once (the pool's count of used pages grows by exactly what was committed) */
  for (int round = 0; round < 50; round++) {
    race_commit_t rcx[2];
    skv_key_t kr[2] = {k2, k2};
    kr[0].hi ^= 0x1000u + (uint64_t)round;
    kr[1].hi ^= 0x2000u + (uint64_t)round;
    skv_page_ref_t rr[2];
    PE_CHECK(skv_kv_reserve(kv, ns, kr, 2, rr, &nres) == 0 && nres == 2, "race reserve");
    PE_CHECK(skv_kv_get_stats(kv, &st0) == 0, "stats");
    pthread_t th[2];
    for (int t = 0; t < 2; t++) {
      rcx[t] = (race_commit_t){kv, ns, kr, rr, 0, 0};
      PE_CHECK(pthread_create(&th[t], NULL, race_commit, &rcx[t]) == 0, "thread");
    }
    for (int t = 0; t < 2; t++) pthread_join(th[t], NULL);
    const int wins = (rcx[0].rc == 0) + (rcx[1].rc == 0);
    PE_CHECK(wins == 1 && (rcx[0].rc == SKV_ESTATE || rcx[1].rc == SKV_ESTATE),
             "round %d: rc %d and %d", round, rcx[0].rc, rcx[1].rc);
    PE_CHECK(rcx[rcx[0].rc == 0 ? 0 : 1].ins == 2, "round %d: the winner inserted %zu", round,
             rcx[rcx[0].rc == 0 ? 0 : 1].ins);
    PE_CHECK(skv_kv_get_stats(kv, &st1) == 0 && st1.pages_used == st0.pages_used,
             "round %d: pages used %llu -> %llu", round, (unsigned long long)st0.pages_used,
             (unsigned long long)st1.pages_used);
    PE_CHECK(skv_kv_lookup(kv, ns, kr, 2, 0, found, &nhit) == 0 && nhit == 2, "round %d: %zu found",
             round, nhit);
  }
  return 0;
}

static int pe_layers(int rank, int npes, void *arg) {
  SKV_UNUSED(npes);
  const layers_param_t *p = arg;
  skv_ctx_t *ctx;
  PE_CHECK(skv_test_init(&ctx, 30000) == 0, "init");
  const uint32_t L = p->layers, bt = 8;
  skv_geometry_t g = geom_make(p->kind, L, p->kind == SKV_KV_MLA ? 1 : 2, 16, 2, 16);
  enum { NPAGES = 5 };
  const uint32_t m = g.page_tokens / bt;
  const uint64_t nb = NPAGES * m * 3;
  skv_kv_opts_t o = SKV_KV_OPTS_INIT;
  o.pages_per_pe = 8;
  skv_kv_t *kv;
  PE_CHECK(skv_kv_create(ctx, &g, &o, &kv) == 0, "kv create");
  skv_namespace_t *ns;
  PE_CHECK(skv_namespace_create("layers", &g, NULL, 0, "s", 1, &ns) == 0, "ns");
  engine_t src, dst;
  PE_CHECK(engine_new(&src, &g, p->preset, bt, nb) == 0, "src engine: %s", skv_last_error());
  PE_CHECK(engine_new(&dst, &g, p->preset, bt, nb) == 0, "dst engine");
  uint64_t seed = skv_test_seed(), seeds[SKV_TEST_MAX_PES];
  PE_CHECK(skv_ctx_allgather(ctx, &seed, seeds, sizeof seed) == 0, "seeds");
  engine_fill(&src, seeds[0]);
  uint32_t tokens[NPAGES * 16];
  for (uint32_t i = 0; i < NPAGES * 16; i++) tokens[i] = 7000 + i;
  skv_key_t keys[NPAGES];
  size_t nk, nhit;
  PE_CHECK(skv_namespace_hash_tokens(ns, tokens, NPAGES * 16, NULL, keys, NPAGES, &nk) == 0,
           "hash");
  uint64_t sb[NPAGES * 2], db[NPAGES * 2];
  uint64_t s = seeds[0] ^ 0x77;
  pick_blocks(nb, NPAGES * m, sb, &s);
  skv_page_ref_t refs[NPAGES];
  /* the layer ranges: [0, 1), then [1, L - 1), then [L - 1, L) */
  skv_layout_t *first, *mid = NULL, *last;
  PE_CHECK(skv_layout_create_layers(src.lay, 0, 1, &first) == 0, "sub 0: %s", skv_last_error());
  if (L > 2) PE_CHECK(skv_layout_create_layers(src.lay, 1, L - 2, &mid) == 0, "sub mid");
  PE_CHECK(skv_layout_create_layers(src.lay, L - 1, 1, &last) == 0, "sub last");
  skv_page_ref_t found[NPAGES];
  if (rank == 0) {
    size_t nres;
    PE_CHECK(skv_kv_reserve(kv, ns, keys, NPAGES, refs, &nres) == 0 && nres == NPAGES,
             "reserve: %zu: %s", nres, skv_last_error());
    PE_CHECK(skv_kv_write(kv, refs, NPAGES, first, sb, NULL) == 0, "write 0: %s", skv_last_error());
    if (mid) PE_CHECK(skv_kv_write(kv, refs, NPAGES, mid, sb, NULL) == 0, "write mid");
  }
  PE_CHECK(skv_ctx_barrier(ctx) == 0, "barrier");
  /* a partly written page is never found, by anyone */
  PE_CHECK(skv_kv_lookup(kv, ns, keys, NPAGES, SKV_LOOKUP_PIN, found, &nhit) == 0 && nhit == 0,
           "partly written pages were found (%zu)", nhit);
  PE_CHECK(skv_ctx_barrier(ctx) == 0, "barrier");
  if (rank == 0) {
    PE_CHECK(skv_kv_write(kv, refs, NPAGES, last, sb, NULL) == 0, "write last");
    /* a reserved page is not evictable: nothing else to evict, nothing evicted */
    uint64_t nev;
    PE_CHECK(skv_kv_evict(kv, NPAGES, &nev) == 0 && nev == 0, "evicted %llu reserved pages",
             (unsigned long long)nev);
  }
  PE_CHECK(skv_ctx_barrier(ctx) == 0, "barrier");
  PE_CHECK(skv_kv_lookup(kv, ns, keys, NPAGES, 0, found, &nhit) == 0 && nhit == 0,
           "written but uncommitted pages were found (%zu)", nhit);
  PE_CHECK(skv_ctx_barrier(ctx) == 0, "barrier");
  if (rank == 0) {
    size_t ins;
    PE_CHECK(skv_kv_commit(kv, ns, keys, NPAGES, refs, NULL, &ins) == 0 && ins == NPAGES,
             "commit: %zu: %s", ins, skv_last_error());
    /* committed: no longer reserved */
    int rc = skv_kv_write(kv, refs, NPAGES, last, sb, NULL);
    PE_CHECK(rc == SKV_ESTATE && strstr(skv_last_error(), "reserved"), "write after commit: %s %s",
             skv_err_name(rc), skv_last_error());
    rc = skv_kv_commit(kv, ns, keys, NPAGES, refs, NULL, &ins);
    PE_CHECK(rc == SKV_ESTATE, "second commit: %s", skv_err_name(rc));
    /* a key cached already reserves nothing */
    skv_page_ref_t again[NPAGES];
    size_t nres = 99;
    PE_CHECK(skv_kv_reserve(kv, ns, keys, NPAGES, again, &nres) == 0 && nres == 0, "re-reserve");
    for (int i = 0; i < NPAGES; i++) PE_CHECK(again[i].gen == 0, "ref %d of a cached key", i);
    PE_CHECK(skv_kv_write(kv, again, NPAGES, src.lay, sb, NULL) == 0, "writing nothing");
    /* abort: the page goes back, its key never appears */
    skv_key_t k2 = keys[0];
    k2.lo ^= 0x1234;
    skv_page_ref_t r2;
    skv_kv_stats_t st0 = SKV_KV_STATS_INIT, st1 = SKV_KV_STATS_INIT;
    PE_CHECK(skv_kv_get_stats(kv, &st0) == 0, "stats");
    PE_CHECK(skv_kv_reserve(kv, ns, &k2, 1, &r2, &nres) == 0 && nres == 1 && r2.gen, "reserve 1");
    PE_CHECK(skv_kv_write(kv, &r2, 1, first, sb, NULL) == 0, "write 1");
    PE_CHECK(skv_kv_abort(kv, &r2, 1, NULL) == 0, "abort: %s", skv_last_error());
    PE_CHECK(skv_kv_abort(kv, &r2, 1, NULL) == SKV_ESTATE, "second abort");
    PE_CHECK(skv_kv_get_stats(kv, &st1) == 0 && st1.pages_used == st0.pages_used, "pages used");
    PE_CHECK(skv_kv_lookup(kv, ns, &k2, 1, 0, &r2, &nhit) == 0 && nhit == 0, "aborted key found");
  }
  PE_CHECK(skv_ctx_barrier(ctx) == 0, "barrier");
  if (rank == 1) {
    /* publish refuses a layout of some layers; a reader's reference to another PE's page is no
     * reservation of its own */
    int rc = skv_kv_publish(kv, ns, keys, 1, first, sb, NULL, NULL);
    PE_CHECK(rc == SKV_EINVAL && strstr(skv_last_error(), "skv_kv_reserve"), "publish part: %s",
             skv_last_error());
    PE_CHECK(skv_kv_lookup(kv, ns, keys, NPAGES, SKV_LOOKUP_PIN, found, &nhit) == 0 &&
                 nhit == NPAGES,
             "committed pages: %zu", nhit);
    rc = skv_kv_write(kv, found, 1, first, sb, NULL);
    PE_CHECK(rc == SKV_ESTATE, "write into a peer's page: %s", skv_err_name(rc));
    engine_poison(&dst);
    s = skv_test_seed();
    pick_blocks(nb, NPAGES * m, db, &s);
    skv_layout_t *dfirst, *drest;
    PE_CHECK(skv_layout_create_layers(dst.lay, 0, 1, &dfirst) == 0, "dst sub 0");
    PE_CHECK(skv_layout_create_layers(dst.lay, 1, L - 1, &drest) == 0, "dst sub rest");
    /* layer 0 only: the rest stay poison */
    PE_CHECK(skv_kv_fetch(kv, found, NPAGES, dfirst, db, 0, NULL) == 0, "fetch layer 0: %s",
             skv_last_error());
    for (int i = 0; i < NPAGES; i++)
      PE_CHECK(layers_equal_rest_poison(&src, &sb[i * m], &dst, &db[i * m], 0, 1),
               "page %d after loading layer 0", i);
    /* a layout of one layer of a sub-layout, by its own layer number */
    skv_layout_t *one;
    PE_CHECK(skv_layout_create_layers(drest, L - 1, 1, &one) == 0, "sub of sub");
    PE_CHECK(skv_kv_fetch(kv, found, NPAGES, one, db, 0, NULL) == 0, "fetch last layer");
    if (L > 2)
      for (int i = 0; i < NPAGES; i++)
        PE_CHECK(!layers_equal_rest_poison(&src, &sb[i * m], &dst, &db[i * m], 0, 1),
                 "page %d: the last layer was not loaded", i);
    skv_layout_destroy(one);
    PE_CHECK(skv_kv_fetch(kv, found, NPAGES, drest, db, SKV_FETCH_UNPIN, NULL) == 0, "fetch rest");
    for (int i = 0; i < NPAGES; i++)
      PE_CHECK(layers_equal_rest_poison(&src, &sb[i * m], &dst, &db[i * m], 0, L),
               "page %d after loading every layer", i);
    uint8_t *used = calloc(nb, 1);
    for (uint32_t i = 0; i < NPAGES * m; i++) used[db[i]] = 1;
    PE_CHECK(untouched_outside(&dst, used), "a layer fetch wrote outside its blocks");
    free(used);
    skv_layout_destroy(dfirst);
    skv_layout_destroy(drest);
  }
  PE_CHECK(skv_ctx_barrier(ctx) == 0, "barrier");
  if (rank == 0) {
    skv_key_t k2 = keys[0];
    k2.lo ^= 0x4321;
    PE_CHECK(reservations_finish_once(kv, ns, src.lay, sb, k2) == 0, "finished once");
  }
  skv_layout_destroy(first);
  skv_layout_destroy(mid);
  skv_layout_destroy(last);
  engine_free(&src);
  engine_free(&dst);
  skv_namespace_destroy(ns);
  PE_CHECK(skv_kv_destroy(kv) == 0, "destroy");
  PE_CHECK(skv_finalize(ctx) == 0, "finalize");
  return 0;
}

ParameterizedTestParameters(kv, layer_by_layer_save_and_load) {
  static layers_param_t params[] = {
      {SKV_LAYOUT_VLLM_FLASH_NHD, SKV_KV_SPLIT, 4},
      {SKV_LAYOUT_FLASHINFER_HND, SKV_KV_SPLIT, 3},
      {SKV_LAYOUT_MLA, SKV_KV_MLA, 5},
  };
  return cr_make_param_array(layers_param_t, params, sizeof params / sizeof params[0]);
}

ParameterizedTest(layers_param_t *p, kv, layer_by_layer_save_and_load) {
  skv_test_job_t job;
  int bad = skv_test_run(&job, 2, pe_layers, p, 120000);
  cr_assert_eq(bad, 0, "PEs failed: %s", skv_test_statuses(&job));
}

/* Layer ranges outside the layout, and the calls' argument checks. */
Test(kv, layer_ranges_and_reservations_are_checked) {
  skv_geometry_t g = geom_make(SKV_KV_SPLIT, 4, 2, 16, 2, 16);
  engine_t e;
  cr_assert_eq(engine_new(&e, &g, SKV_LAYOUT_VLLM_FLASH_NHD, 16, 4), 0);
  skv_layout_t *sub = (skv_layout_t *)0x1, *sub2;
  const struct {
    uint32_t first, n;
  } bad[] = {{0, 0}, {4, 1}, {3, 2}, {0, 5}, {UINT32_MAX, 2}, {1, UINT32_MAX}};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    cr_expect_eq(skv_layout_create_layers(e.lay, bad[i].first, bad[i].n, &sub), SKV_EINVAL,
                 "layers [%u, +%u)", bad[i].first, bad[i].n);
    cr_expect_null(sub, "no layout on failure");
    cr_expect(strstr(skv_last_error(), "range"), "message: %s", skv_last_error());
  }
  cr_expect_eq(skv_layout_create_layers(NULL, 0, 1, &sub), SKV_EINVAL);
  cr_expect_eq(skv_layout_create_layers(e.lay, 0, 1, NULL), SKV_EINVAL);
  cr_assert_eq(skv_layout_create_layers(e.lay, 1, 2, &sub), 0);
  /* a sub-layout's range counts the geometry's layers and stays inside [1, 3) */
  cr_expect_eq(skv_layout_create_layers(sub, 0, 1, &sub2), SKV_EINVAL);
  cr_expect_eq(skv_layout_create_layers(sub, 2, 2, &sub2), SKV_EINVAL);
  cr_assert_eq(skv_layout_create_layers(sub, 2, 1, &sub2), 0);
  skv_layout_destroy(sub2);
  skv_layout_destroy(sub);
  cr_expect_eq(skv_kv_reserve(NULL, NULL, NULL, 0, NULL, NULL), SKV_EINVAL);
  cr_expect_eq(skv_kv_write(NULL, NULL, 0, e.lay, NULL, NULL), SKV_EINVAL);
  cr_expect_eq(skv_kv_commit(NULL, NULL, NULL, 0, NULL, NULL, NULL), SKV_EINVAL);
  cr_expect_eq(skv_kv_abort(NULL, NULL, 0, NULL), SKV_EINVAL);
  engine_free(&e);
}
