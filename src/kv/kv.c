/* The node-wide KV cache: collective creation of the page heap and the shared metadata,
 * lookup with pins, publish with deduplication and LRU eviction, fetch (host path here; the
 * CUDA path is kv_cuda.c), stats. */
#define _GNU_SOURCE
#include "kv/kv.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>
#include <time.h>

#define KV_CHECK_NULL(kv, fn)                                                 \
  do {                                                                        \
    if (!(kv)) return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_KV, fn ": kv is NULL"); \
  } while (0)

static void reclaim_end(skv_kv_t *kv);
static void forker_remove(skv_kv_t *kv);

static uint64_t next_pow2(uint64_t x) {
  uint64_t p = 1;
  while (p < x) p <<= 1;
  return p;
}

/* Distance between pages in a heap: whole 4 KiB pages from 4 KiB up, 256-byte aligned below. */
static uint64_t page_stride_of(uint64_t page_bytes) {
  return page_bytes >= 4096 ? SKV_ALIGN_UP(page_bytes, 4096) : SKV_ALIGN_UP(page_bytes, 256);
}

static int check_ns_geometry(const skv_namespace_t *ns, const skv_geometry_t *g, const char *fn) {
  if (skv__geometry_equal(&ns->geom, g)) return 0;
  return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_KV,
                  "%s: wrong namespace: it was made for a geometry (layers=%u heads=%u dim=%u "
                  "elem=%u page_tokens=%u) other than this cache's (layers=%u heads=%u dim=%u "
                  "elem=%u page_tokens=%u)",
                  fn, ns->geom.num_layers, ns->geom.num_kv_heads, ns->geom.head_dim,
                  ns->geom.elem_bytes, ns->geom.page_tokens, g->num_layers, g->num_kv_heads,
                  g->head_dim, g->elem_bytes, g->page_tokens);
}

static uint64_t meta_pool_bytes(uint64_t pages) {
  return SKV_ALIGN_UP(skv__pool_meta_bytes(pages), 64);
}

static bool kv_alive(void *arg, int pe) {
  return skv__pool_alive(&((skv_kv_t *)arg)->pool, pe);
}

void skv__kv_evict_cb(void *arg, uint32_t page, uint32_t gen, uint64_t key_hi, uint64_t key_lo) {
  skv_kv_t *kv = arg;
  skv_key_t k = {key_hi, key_lo};
  uint64_t val = skv__val_pack((uint32_t)kv->pool.me, page, gen);
  const uint64_t islot = __atomic_load_n(&kv->pool.meta[kv->pool.me][page].islot, __ATOMIC_RELAXED);
  /* under the pool's mu (every eviction is): the counts wait for the pass's end (kv_evict_flush),
   * one atomic add each where there were two per page */
  if (skv__index_erase_at(&kv->index, k, val, islot, false) == 0)
    kv->erased_backlog++;
  else if (skv__index_erase(&kv->index, k, val) != 0)
    SKV_WARN_RL(SKV_SUBSYS_KV,
                "evicting page %u (generation %u): its index entry was not found; please report "
                "this with the SKV_DEBUG=INFO log",
                page, gen);
  kv->evicted_backlog++;
}

/* An eviction pass ended (under the pool's mu): count what its callbacks kept back. */
static void kv_evict_flush(void *arg) {
  skv_kv_t *kv = arg;
  if (kv->erased_backlog) skv__index_count(&kv->index, kv->pool.me, -(int64_t)kv->erased_backlog);
  if (kv->evicted_backlog) __atomic_add_fetch(&kv->evicted, kv->evicted_backlog, __ATOMIC_RELAXED);
  kv->erased_backlog = kv->evicted_backlog = 0;
}

/* An eviction pass will erase this key's index entry soon: bring its slot in (its home slot
 * where the record does not say where it is). */
static void kv_evict_hint(void *arg, uint64_t key_hi, uint64_t key_lo, uint64_t islot) {
  if (islot)
    skv__index_islot_prefetch(&((skv_kv_t *)arg)->index, islot);
  else
    skv__index_prefetch_w(&((skv_kv_t *)arg)->index, (skv_key_t){key_hi, key_lo});
}

#ifdef SKV_WITH_CUDA
static int batch_done(void *arg, const skv__kv_batch_t *b);

/* The CUDA copy backend, for pages in GPU memory or host memory GPUs read (cuda_host). */
static int backend_init(skv_kv_t *kv) {
  if (kv->data->info.backend == SKV_BACKEND_HOST) return 0; /* no GPU involved, none touched */
  skv__kvc_params_t p = {
      kv->ctx,    kv->data, &kv->geom, kv->page_bytes, kv->page_stride, (uint32_t)kv->pool.pages,
      batch_done, kv,       &kv->prof};
  return skv__kvc_create(&p, &kv->cuda);
}
#endif

int skv_kv_create(skv_ctx_t *ctx, const skv_geometry_t *geom, const skv_kv_opts_t *opts,
                  skv_kv_t **out) {
  SKV_ARG_CHECK(ctx && geom && opts && out, SKV_SUBSYS_KV,
                "skv_kv_create: ctx, geom, opts and kv must be non-NULL");
  *out = NULL;
  uint64_t page_bytes;
  SKV_CHECK(skv__geometry_check(geom, "geom", &page_bytes));
  SKV_ARG_CHECK(opts->size >= sizeof(skv_kv_opts_t) && opts->version >= 1 &&
                    opts->version <= SKV_KV_OPTS_VERSION,
                SKV_SUBSYS_KV,
                "skv_kv_create: opts.size=%zu / opts.version=%u: initialise with SKV_KV_OPTS_INIT",
                opts->size, opts->version);
  SKV_ARG_CHECK(opts->pages_per_pe >= 1 && opts->pages_per_pe <= SKV_INDEX_MAX_PAGES, SKV_SUBSYS_KV,
                "skv_kv_create: opts.pages_per_pe=%" PRIu64 " is not in 1..%u", opts->pages_per_pe,
                SKV_INDEX_MAX_PAGES);
  SKV_ARG_CHECK(opts->index_slots <= (1ull << 32), SKV_SUBSYS_KV,
                "skv_kv_create: opts.index_slots=%" PRIu64 " is over 2^32", opts->index_slots);
  SKV_ARG_CHECK(opts->backend == SKV_BACKEND_HOST || opts->backend == SKV_BACKEND_CUDA ||
                    opts->backend == SKV_BACKEND_CUDA_HOST,
                SKV_SUBSYS_KV,
                "skv_kv_create: opts.backend=%d is not SKV_BACKEND_HOST, _CUDA or _CUDA_HOST",
                opts->backend);
  int npes = ctx->nlocal;
  uint64_t pages = opts->pages_per_pe;
  uint64_t stride = page_stride_of(page_bytes);
  SKV_ARG_CHECK(pages <= (1ull << 40) / stride, SKV_SUBSYS_KV,
                "skv_kv_create: %" PRIu64 " pages of %" PRIu64 " bytes exceed the 1 TiB heap limit",
                pages, stride);
  uint64_t total_slots = opts->index_slots ? opts->index_slots : 4 * pages * (uint64_t)npes;
  uint64_t sps =
      next_pow2(SKV_MAX((total_slots + (uint64_t)npes - 1) / (uint64_t)npes, 2 * SKV_INDEX_WINDOW));

  skv_kv_t *kv = calloc(1, sizeof *kv);
  if (!kv) return SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_KV, "skv_kv_create: out of memory");
  kv->ctx = ctx;
  kv->geom = *geom;
  kv->page_bytes = page_bytes;
  kv->page_stride = stride;
  int rc;
  SKV_CHECK_GOTO(skv__coll_check(
                     ctx, NULL,
                     "skv_kv_create(kind=%u, layers=%u, heads=%u, dim=%u, elem=%u, page_tokens=%u, "
                     "backend=%s, pages_per_pe=%" PRIu64 ", index_slots=%" PRIu64 ")",
                     geom->kv_kind, geom->num_layers, geom->num_kv_heads, geom->head_dim,
                     geom->elem_bytes, geom->page_tokens, skv__backend_name(opts->backend), pages,
                     opts->index_slots),
                 rc, fail);
  /* the pages only: no collectives' scratch (a cuda heap's default is 8 MiB) */
  skv_heap_opts_t ho = SKV_HEAP_OPTS_INIT;
  ho.backend = opts->backend;
  ho.data_bytes = pages * stride;
  ho.scratch_bytes = 256;
  SKV_CHECK_GOTO(skv_heap_create_ex(ctx, &ho, &kv->data), rc, fail);
  uint64_t meta_bytes = meta_pool_bytes(pages) + skv__index_shard_bytes(sps);
  SKV_CHECK_GOTO(skv_heap_create(ctx, meta_bytes, SKV_BACKEND_HOST, &kv->meta), rc, fail);

  void *pool_seg[SKV_MAX_LOCAL_PES], *shard_seg[SKV_MAX_LOCAL_PES];
  for (int pe = 0; pe < npes; pe++) {
    char *seg = skv__heap_addr(kv->meta, pe, kv->meta->info.data_offset);
    pool_seg[pe] = seg;
    shard_seg[pe] = seg + meta_pool_bytes(pages);
  }
  rc = skv__pool_init(&kv->pool, npes, ctx->local_index, pages, pool_seg, 0);
  if (rc == 0) {
    kv->index.hdr = kv->shard_hdr;
    kv->index.slots = kv->shard_slots;
    skv__index_bind(&kv->index, npes, sps, shard_seg, kv_alive, kv);
    skv__pool_set_evict_hint(&kv->pool, kv_evict_hint);
    skv__pool_set_evict_flush(&kv->pool, kv_evict_flush);
  }
#ifdef SKV_WITH_CUDA
  if (rc == 0) rc = backend_init(kv);
#endif
  /* Every PE's records are initialised before anyone looks at a peer's; and a PE that failed
   * here (out of memory) fails every PE at once, naming it, so that all tear down together.
   * The agreement is a step of the data heap's operation: its keys go with the heap's. */
  char what[sizeof kv->data->name + 32];
  snprintf(what, sizeof what, "skv_kv_create(%s)", kv->data->name);
  rc = skv__coll_agree(&kv->data->op, "kv-ready", rc, what);
  if (rc < 0) {
    skv__coll_forget(&kv->data->op); /* the failed create's keys go after the next check */
    goto fail;
  }
  if (!kv->pool.my_pidns)
    SKV_WARN(SKV_SUBSYS_KV,
             "skv_kv_create: /proc/self/ns/pid cannot be read: no PE is ever judged dead, so "
             "a dead PE's pins and index claims are not released (its pages stay pinned)");
  for (int pe = 0; pe < npes; pe++)
    if (kv->pool.my_pidns && kv->pool.hdr[pe]->pidns != kv->pool.my_pidns) {
      SKV_WARN(SKV_SUBSYS_KV,
               "skv_kv_create: local PE %d runs in another PID namespace (another container?): "
               "if it dies, its pins and index claims are not released (its pages stay pinned)",
               pe);
      break;
    }
  char b[32];
  SKV_INFO(SKV_SUBSYS_KV,
           "kv cache: %d PEs x %" PRIu64 " pages of %s (%s backend), index %d x %" PRIu64 " slots",
           npes, pages, skv__fmt_bytes(page_bytes, b, sizeof b), skv__backend_name(opts->backend),
           npes, sps);
  *out = kv;
  return 0;
fail:
#ifdef SKV_WITH_CUDA
  skv__kvc_destroy(kv->cuda);
#endif
  if (kv->pool.hdr) skv__pool_fini(&kv->pool);
  if (kv->meta) skv_heap_destroy(kv->meta);
  if (kv->data) skv_heap_destroy(kv->data);
  free(kv);
  return rc;
}

int skv_kv_destroy(skv_kv_t *kv) {
  if (!kv) return 0;
  if (kv->domain) return skv_kv_detach(kv);
  reclaim_end(kv);
  skv__helper_destroy(kv->helper);
  forker_remove(kv);
  int rc = 0;
#ifdef SKV_WITH_CUDA
  rc = skv__kvc_sync(kv->cuda);
  skv__kvc_destroy(kv->cuda);
#endif
  skv__pool_fini(&kv->pool);
  int r1 = skv_heap_destroy(kv->meta);
  int r2 = skv_heap_destroy(kv->data); /* with the keys of its kv-ready agreement */
  free(kv);
  return rc ? rc : r1 ? r1 : r2;
}

/* Wait until this process's stream-ordered copies completed (none still reads a mapping). */
static void quiesce(void *arg) {
#ifdef SKV_WITH_CUDA
  skv_kv_t *kv = arg;
  if (kv->cuda) (void)skv__kvc_sync(kv->cuda);
#else
  SKV_UNUSED(arg);
#endif
}

/* ---- an elastic domain's attachment -------------------------------------------------------- */

int skv_kv_attach(const char *name, const skv_geometry_t *geom, const skv_attach_opts_t *opts,
                  skv_kv_t **out) {
  SKV_ARG_CHECK(out, SKV_SUBSYS_KV, "skv_kv_attach: kv (the result pointer) is NULL");
  *out = NULL;
  SKV_ARG_CHECK(name, SKV_SUBSYS_KV, "skv_kv_attach: name is NULL");
  uint64_t page_bytes;
  SKV_CHECK(skv__geometry_check(geom, "skv_kv_attach: geom", &page_bytes));
  skv_attach_opts_t o = SKV_ATTACH_OPTS_INIT;
  if (opts) {
    SKV_ARG_CHECK(opts->size >= sizeof(skv_attach_opts_t) && opts->version >= 1 &&
                      opts->version <= SKV_ATTACH_OPTS_VERSION,
                  SKV_SUBSYS_KV,
                  "skv_kv_attach: opts.size=%zu / opts.version=%u: initialise with "
                  "SKV_ATTACH_OPTS_INIT",
                  opts->size, opts->version);
    o = *opts;
  }
  SKV_ARG_CHECK(o.role == SKV_ROLE_OWNER || o.role == SKV_ROLE_READER, SKV_SUBSYS_KV,
                "skv_kv_attach: opts.role=%d is not SKV_ROLE_OWNER or SKV_ROLE_READER", o.role);
  SKV_ARG_CHECK(o.backend == SKV_BACKEND_HOST || o.backend == SKV_BACKEND_CUDA, SKV_SUBSYS_KV,
                "skv_kv_attach: opts.backend=%d: a domain keeps its pages in host memory "
                "(SKV_BACKEND_HOST) or GPU memory (SKV_BACKEND_CUDA)",
                o.backend);
  SKV_ARG_CHECK(o.max_slots <= SKV__DOM_MAX_SLOTS, SKV_SUBSYS_KV,
                "skv_kv_attach: opts.max_slots=%u is over %d", o.max_slots, SKV__DOM_MAX_SLOTS);
  SKV_ARG_CHECK(o.pages_per_pe <= SKV_INDEX_MAX_PAGES, SKV_SUBSYS_KV,
                "skv_kv_attach: opts.pages_per_pe=%" PRIu64 " is over %u", o.pages_per_pe,
                SKV_INDEX_MAX_PAGES);
  SKV_ARG_CHECK(o.index_slots <= (1ull << 32), SKV_SUBSYS_KV,
                "skv_kv_attach: opts.index_slots=%" PRIu64 " is over 2^32", o.index_slots);
  SKV_ARG_CHECK(o.flags == 0, SKV_SUBSYS_KV, "skv_kv_attach: opts.flags=0x%x: must be 0", o.flags);
  SKV_ARG_CHECK(o.timeout_ms == -1 || (o.timeout_ms >= 1 && o.timeout_ms <= 86400000),
                SKV_SUBSYS_KV, "skv_kv_attach: opts.timeout_ms=%d is not -1 or 1..86400000",
                o.timeout_ms);
  if (o.ns) SKV_CHECK(check_ns_geometry(o.ns, geom, "skv_kv_attach"));
  const uint64_t stride = page_stride_of(page_bytes);
  skv_kv_t *kv = calloc(1, sizeof *kv);
  if (!kv) return SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_KV, "skv_kv_attach: out of memory");
  kv->geom = *geom;
  kv->page_bytes = page_bytes;
  kv->page_stride = stride;
  int rc = skv__ctx_solo(o.timeout_ms, o.device, &kv->ctx);
  if (rc == 0) {
    kv->index.hdr = kv->shard_hdr;
    kv->index.slots = kv->shard_slots;
    skv__dom_params_t p = {0};
    p.name = name;
    p.geom = *geom;
    p.role = o.role;
    p.backend = o.backend;
    p.pages_per_slot = o.pages_per_pe;
    p.max_slots = o.max_slots;
    p.index_slots = o.index_slots;
    p.page_bytes = page_bytes;
    p.page_stride = stride;
    p.timeout_ms = kv->ctx->cfg.timeout_ms;
    p.group = o.group;
    if (o.ns) p.ns_hi = o.ns->id.hi, p.ns_lo = o.ns->id.lo;
    p.ctx = kv->ctx;
    p.pool = &kv->pool;
    p.index = &kv->index;
    rc = skv__domain_attach(&p, &kv->domain);
  }
  if (rc == 0) {
    skv__pool_set_evict_hint(&kv->pool, kv_evict_hint);
    skv__pool_set_evict_flush(&kv->pool, kv_evict_flush);
    kv->data = skv__domain_heap(kv->domain);
#ifdef SKV_WITH_CUDA
    /* a GPU-less reader of GPU pages has no copy backend: it looks pages up */
    if (kv->data->info.backend != SKV_BACKEND_HOST && kv->data->info.base) rc = backend_init(kv);
#endif
  }
  if (rc < 0) {
    char saved[1024];
    snprintf(saved, sizeof saved, "%s", skv_last_error());
    if (kv->domain) (void)skv__domain_detach(kv->domain, skv__kv_evict_cb, kv, NULL, NULL);
    skv__ctx_solo_free(kv->ctx);
    free(kv);
    skv__error_restore(saved);
    return rc;
  }
  *out = kv;
  return 0;
}

int skv_kv_detach(skv_kv_t *kv) {
  if (!kv) return 0;
  SKV_ARG_CHECK(kv->domain, SKV_SUBSYS_KV,
                "skv_kv_detach: this cache was made by skv_kv_create (collective): destroy it "
                "with skv_kv_destroy");
  reclaim_end(kv);
  skv__helper_destroy(kv->helper);
  forker_remove(kv);
  int rc = 0;
#ifdef SKV_WITH_CUDA
  rc = skv__kvc_sync(kv->cuda); /* this owner's publishes are indexed, its fetches done */
#endif
  int r2 = skv__domain_detach(kv->domain, skv__kv_evict_cb, kv, quiesce, kv);
#ifdef SKV_WITH_CUDA
  skv__kvc_destroy(kv->cuda);
#endif
  skv__ctx_solo_free(kv->ctx);
  free(kv);
  return rc ? rc : r2;
}

skv_heap_t *skv_kv_get_heap(const skv_kv_t *kv) {
  return kv ? kv->data : NULL;
}

int skv_kv_get_stats(const skv_kv_t *kv, skv_kv_stats_t *st) {
  KV_CHECK_NULL(kv, "skv_kv_get_stats");
  SKV_ARG_CHECK(st, SKV_SUBSYS_KV, "skv_kv_get_stats: stats is NULL");
  SKV_ARG_CHECK(st->size >= sizeof *st, SKV_SUBSYS_KV,
                "skv_kv_get_stats: stats.size=%zu, this library writes %zu bytes: initialise the "
                "struct with SKV_KV_STATS_INIT",
                st->size, sizeof *st);
  skv_kv_t *k = (skv_kv_t *)kv;
  const size_t size = st->size;
  memset(st, 0, sizeof *st);
  st->size = size;
  st->page_bytes = kv->page_bytes;
  st->pages_per_pe = kv->pool.pages;
  st->pages_used = skv__pool_used(&k->pool);
  st->pages_pinned = skv__pool_pinned_own(&k->pool);
  st->index_slots = kv->index.slots_per_shard * (uint64_t)kv->index.nshards;
  st->index_entries = skv__index_entries(&kv->index);
  st->lookups = __atomic_load_n(&kv->lookups, __ATOMIC_RELAXED);
  st->lookup_hits = __atomic_load_n(&kv->lookup_hits, __ATOMIC_RELAXED);
  st->published = __atomic_load_n(&kv->published, __ATOMIC_RELAXED);
  st->deduplicated = __atomic_load_n(&kv->deduplicated, __ATOMIC_RELAXED);
  st->evicted = __atomic_load_n(&kv->evicted, __ATOMIC_RELAXED);
  st->stale = __atomic_load_n(&kv->stale, __ATOMIC_RELAXED);
  st->index_full = __atomic_load_n(&kv->index_full, __ATOMIC_RELAXED);
  return 0;
}

static int check_ns(const skv_kv_t *kv, const skv_namespace_t *ns, const char *fn) {
  if (!ns) return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_KV, "%s: namespace is NULL", fn);
  return check_ns_geometry(ns, &kv->geom, fn);
}

static int check_keys(const skv_key_t *keys, size_t n, const char *fn) {
  if (n && !keys) return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_KV, "%s: keys is NULL with n=%zu", fn, n);
  if (n > (1u << 30))
    return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_KV, "%s: n=%zu keys is unreasonably large", fn, n);
  for (size_t i = 0; i < n; i++)
    if (keys[i].hi == 0)
      return SKV_FAIL(
          SKV_EINVAL, SKV_SUBSYS_KV,
          "%s: key %zu has hi == 0, which no symkv hash produces (use skv_namespace_hash_tokens or "
          "skv_namespace_hash_bytes)",
          fn, i);
  return 0;
}

static int check_refs(const skv_kv_t *kv, const skv_page_ref_t *refs, size_t n, const char *fn) {
  if (n && !refs) return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_KV, "%s: refs is NULL with n=%zu", fn, n);
  for (size_t i = 0; i < n; i++) {
    if (refs[i].pe >= (uint32_t)kv->pool.npes)
      return SKV_FAIL(SKV_ERANGE, SKV_SUBSYS_KV,
                      "%s: reference %zu names PE %u; this node has PEs 0..%d", fn, i, refs[i].pe,
                      kv->pool.npes - 1);
    if (refs[i].page >= kv->pool.pages)
      return SKV_FAIL(SKV_ERANGE, SKV_SUBSYS_KV,
                      "%s: reference %zu names page %u; PEs have pages 0..%" PRIu64, fn, i,
                      refs[i].page, kv->pool.pages - 1);
    if (refs[i].gen == 0)
      return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_KV,
                      "%s: reference %zu has generation 0, which no lookup returns", fn, i);
  }
  return 0;
}

/* An attached cache drops its mappings of departed owners' slots on every lookup and publish
 * too (skv__domain_tidy), not only when it fetches. */
static void tidy(skv_kv_t *kv) {
  if (kv->domain) skv__domain_tidy(kv->domain, quiesce, kv);
  (void)skv__pool_renew(&kv->pool); /* this PE makes progress: its pins' lease goes on */
}

int skv_kv_lookup(skv_kv_t *kv, const skv_namespace_t *ns, const skv_key_t *keys, size_t n,
                  uint32_t flags, skv_page_ref_t *refs, size_t *nhit) {
  KV_CHECK_NULL(kv, "skv_kv_lookup");
  SKV_ARG_CHECK(nhit, SKV_SUBSYS_KV, "skv_kv_lookup: nhit is NULL");
  *nhit = 0;
  SKV_CHECK(check_ns(kv, ns, "skv_kv_lookup"));
  SKV_CHECK(check_keys(keys, n, "skv_kv_lookup"));
  SKV_ARG_CHECK(refs || n == 0, SKV_SUBSYS_KV, "skv_kv_lookup: refs is NULL with n=%zu", n);
  SKV_ARG_CHECK((flags & ~(uint32_t)SKV_LOOKUP_PIN) == 0, SKV_SUBSYS_KV,
                "skv_kv_lookup: unknown flags 0x%x", flags);
  tidy(kv);
  uint64_t now = skv__now_ns();
  uint64_t vals[256], asked = 0, live = 0;
  uint32_t pe[SKV_ARRAY_LEN(vals)], page[SKV_ARRAY_LEN(vals)], gen[SKV_ARRAY_LEN(vals)];
  size_t done = 0, stale = 0;
  while (done < n) {
    size_t m = SKV_MIN(n - done, SKV_ARRAY_LEN(vals)), h = 0;
    skv__index_lookup_prefix(&kv->index, keys + done, m, vals, &h);
    size_t j = 0;
    for (; j < h; j++) {
      pe[j] = skv__val_pe(vals[j]), page[j] = skv__val_page(vals[j]),
      gen[j] = skv__val_gen(vals[j]);
      /* a domain's dead owner: its pages cannot be read any more (the next attacher takes them
       * out of the index): a miss. Asked once per owner and call. */
      if (kv->domain && !(asked >> pe[j] & 1)) {
        asked |= 1ull << pe[j];
        if (skv__domain_alive(kv->domain, (int)pe[j])) live |= 1ull << pe[j];
      }
      if (kv->domain && !(live >> pe[j] & 1)) break;
    }
    /* the hits pinned together (one lock per run, where it was one per page); one evicted
     * between the index read and its pin is a miss, and ends the prefix */
    const size_t hv = j;
    if (flags & SKV_LOOKUP_PIN) j = skv__pool_pin_prefix(&kv->pool, pe, page, gen, hv);
    stale += j < hv;
    for (size_t q = 0; q < j; q++) {
      skv__pool_touch(&kv->pool, pe[q], page[q], now);
      refs[done + q] = (skv_page_ref_t){pe[q], page[q], gen[q], 0};
    }
    done += j;
    if (j < m) break;
  }
  __atomic_add_fetch(&kv->lookups, n, __ATOMIC_RELAXED);
  __atomic_add_fetch(&kv->lookup_hits, done, __ATOMIC_RELAXED);
  if (stale) __atomic_add_fetch(&kv->stale, stale, __ATOMIC_RELAXED);
  *nhit = done;
  return 0;
}

int skv_kv_unpin(skv_kv_t *kv, const skv_page_ref_t *refs, size_t n) {
  KV_CHECK_NULL(kv, "skv_kv_unpin");
  SKV_CHECK(check_refs(kv, refs, n, "skv_kv_unpin"));
  (void)skv__pool_renew(&kv->pool);
  if (n == 0) return 0;
  /* every reference tried, the first failure returned (one lock per run of pages) */
  return skv__pool_unpin_n(&kv->pool, &refs[0].pe, 4, &refs[0].page, 4, n, 1);
}

/* ---- the data path: one protocol, three ways to copy -------------------------------------- */

/* How it works
 * ------------
 * Fetch. Every reference is pinned first (its generation checked), all or none: a stale one
 * fails with SKV_ESTALE before any byte is written. The pages are then copied, and the pins are
 * released once the copy is complete (with the caller's, for SKV_FETCH_UNPIN).
 * Publish. Batch by batch: each key's index slot is claimed (skv__index_claim_n: PENDING, a
 * miss to readers; a key cached already, or claimed first by another publish, is skipped; one
 * cached on a page of this PE is a use of that page, touch_cached), a
 * page is allocated for each key claimed (WRITING: no one can pin or evict it; the least
 * recently used unpinned page is evicted when none is free; the first failure stops the
 * allocation, what was allocated is still published and the other claims are released), the
 * blocks are copied in, and once the copy is complete each page becomes READY and its claim is
 * published (finish_pages): the page joins the LRU, and its record keeps where its index entry
 * is (islot: its eviction erases it there). A claim whose page was not allocated, whose copy
 * was not queued, or whose synchronous copy failed is released; a queued copy is published
 * once its launch completes (a CUDA error there is reported by skv__kvc_sync, as before).
 * A batch of several windows (over PUB_CHUNK keys, or over one launch's) has its next window's
 * keys claimed by the cache's helper thread (core/helper.c, SKV_PUBLISH_HELPER) while this
 * window's pages are allocated and copied; the caller, once this window is launched, claims
 * the groups of 32 keys the helper has not come to yet from the window's back (claim_job_take),
 * and gives them back when it goes back to keys it found no page for (claim_job_drop). The
 * first window's claims are shared so too. The claims of one batch still come window after
 * window.
 * The copy is one of three, by where the pages and the engine's blocks are:
 *  - host: memcpy between host blocks and host pages (host or cuda_host backend), runs of
 *    PUB_CHUNK pages, synchronous;
 *  - staged: host blocks and GPU pages, through a host buffer (skv__kvc_read_pages and
 *    _write_pages), one buffer per batch, synchronous;
 *  - device: GPU blocks, stream-ordered copies of the CUDA backend (skv__kvc_copy), one batch;
 *    the backend calls batch_done once a launch completed, which takes the steps the
 *    synchronous copies take at once. Only the leading pages the backend accepted are its to
 *    complete; a failure leaves the others to this file, which undoes them.
 * Graph capture. While the caller's stream is being captured, a fetch takes no pins (a graph
 * may be replayed at any time, much later): every reference must already be pinned by this PE
 * (checked here), and stays so while the graph is replayed. Publish is refused: a replay would
 * write into pages that may have been evicted and reused since.
 *
 * What can go wrong
 * -----------------
 * - A reference goes stale between lookup and fetch: SKV_ESTALE, nothing copied.
 * - A copy fails half way (CUDA error, timeout waiting for a slot): the pins of what was not
 *   queued are released (the caller's too once part of the batch was queued, since then the
 *   completion releases them for the queued part), the pages not queued are freed. */

enum { PATH_HOST, PATH_STAGED, PATH_DEVICE };

/* Device publish: pages per launch, PUB_CHUNK or a quarter of the batch, whichever is more. A
 * larger batch is published launch by launch: the pages of the next launch are looked up and
 * allocated (the caller's thread) while the previous launches copy (the GPU) and are completed,
 * their keys inserted (the completion thread), where one launch of the whole batch did the three
 * one after the other (publish_e2e/64KiB/x1024 on one H100 was 0.088 x cudaMemcpyAsync + sync,
 * nearly all of it host work per page). At most 4 launches more than one per argument slot's
 * worth of pages: a publish takes few of the 8 ring slots, so it does not wait for the stream
 * where it did not before. The launches after the first begin while the one before ends
 * (skv__kv_batch_t.follows: programmatic dependent launch), so that the split costs the GPU no
 * more than one launch (launches of 256 pages filled and drained the GPU each: 0.72x the local
 * copy engine against 0.91x; bench/results/split_probe_nvidia-h100-x1.txt). */
#define PUB_CHUNK 256
int skv__kv_pub_split = 4;
int skv__kv_gate_delay_us = 0;
/* Keys ahead whose index home slot is prefetched while one is looked up (misses of a
 * publish's keys are independent: their memory latencies overlap). */
#define PUB_AHEAD 8

/* A fetch's batch reads (pe, page) straight from the caller's references, 4 words apart. */
_Static_assert(sizeof(skv_page_ref_t) == 4 * sizeof(uint32_t), "a reference is 4 words");

static int check_layout(const skv_kv_t *kv, const skv_layout_t *lay, const uint64_t *block_ids,
                        size_t n, const char *fn) {
  if (!lay) return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_KV, "%s: layout is NULL", fn);
  if (!skv__geometry_equal(&lay->geom, &kv->geom))
    return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_KV,
                    "%s: the layout was made for another geometry than this cache's", fn);
  return skv__check_block_ids(lay, block_ids, n, fn);
}

/* A layout of every layer: what skv_kv_publish needs (a key is inserted only with its whole
 * page written). */
static int check_whole(const skv_layout_t *lay, const char *fn) {
  if (lay->num_layers == lay->geom.num_layers) return 0;
  return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_KV,
                  "%s: the layout covers layers [%u, %u) of %u, part of each page, and a key is "
                  "inserted only once its whole page is written: publish with a layout of every "
                  "layer, or write the layers with skv_kv_write between skv_kv_reserve and "
                  "skv_kv_commit",
                  fn, lay->first_layer, lay->first_layer + lay->num_layers, lay->geom.num_layers);
}

/* How pages of this cache and blocks of `lay` are copied. */
static int choose_path(const skv_kv_t *kv, const skv_layout_t *lay, int *path, const char *fn) {
  const int be = kv->data->info.backend;
  *path = PATH_HOST; /* set on failure too (the Release build warned of it unset) */
  if (lay->device < 0 && be != SKV_BACKEND_CUDA) return 0;
  if (be == SKV_BACKEND_HOST)
    return SKV_FAIL(SKV_ENOTSUP, SKV_SUBSYS_KV,
                    "%s: a GPU layout cannot use pages of the host backend; create the cache with "
                    "SKV_BACKEND_CUDA_HOST to keep pages in host memory that GPUs can read",
                    fn);
#ifdef SKV_WITH_CUDA
  if (!kv->cuda)
    return SKV_FAIL(SKV_ENOTSUP, SKV_SUBSYS_KV,
                    "%s: the pages are in GPU memory and this process has no usable GPU: it can "
                    "look them up but not fetch them",
                    fn);
  *path = lay->device < 0 ? PATH_STAGED : PATH_DEVICE;
  return 0;
#else
  return SKV_FAIL(SKV_ENOTSUP, SKV_SUBSYS_KV, "%s: GPU pages or layouts need a build with CUDA",
                  fn);
#endif
}

/* Page i of a batch. */
static inline uint32_t b_pe(const skv__kv_batch_t *b, size_t i) {
  return b->pe[i * b->pe_step];
}
static inline uint32_t b_page(const skv__kv_batch_t *b, size_t i) {
  return b->page[i * b->page_step];
}

/* Pin every page of the batch, or none: SKV_ESTALE naming the first stale reference. */
static int pin_all(skv_kv_t *kv, const skv__kv_batch_t *b, const skv_page_ref_t *refs,
                   const char *fn) {
  size_t i = 0;
  if (skv__pool_pin_n(&kv->pool, b->pe, b->pe_step, b->page, b->page_step, &refs[0].gen, 4, b->n,
                      &i) != 0) {
    __atomic_add_fetch(&kv->stale, 1, __ATOMIC_RELAXED);
    return SKV_FAIL(SKV_ESTALE, SKV_SUBSYS_KV,
                    "%s: reference %zu (PE %u, page %u, generation %u) is stale: the page was "
                    "evicted or reused; nothing was copied. Look the keys up again (pin them to "
                    "keep them)",
                    fn, i, refs[i].pe, refs[i].page, refs[i].gen);
  }
  return 0;
}

#ifdef SKV_WITH_CUDA
/* Fetches of this many pages or more into GPU blocks are gated (SKV_FETCH_GATE_PAGES; 0: none),
 * whatever their stream holds. The gate costs the copy about 0.06 of its speed on the GPU
 * (fetch_local/64KiB/x1024 on one H100: 0.84 gated against 0.90 ungated); behind work pending
 * on the stream, pinning first and copying ungated saved about 4 us behind 100 us of work but
 * cost 10-20 us behind 5-20 us of it, and pinning ahead only while the stream stayed busy did
 * no better (bench/results/gate_behind_nvidia-h100-x1.txt). */
static size_t gate_pages(void) {
  static size_t pages = SIZE_MAX; /* not read yet */
  size_t v = __atomic_load_n(&pages, __ATOMIC_RELAXED);
  if (v == SIZE_MAX) {
    long long x = 256;
    if (skv__env_int(SKV_ENV_FETCH_GATE_PAGES, 0, SKV__KVC_MAX_PAGES, 256, &x) != 0)
      SKV_WARN(SKV_SUBSYS_KV, "SKV_FETCH_GATE_PAGES must be in 0..%u; using 256",
               SKV__KVC_MAX_PAGES);
    /* launches that return once their kernel ended would end a gated one by its time limit */
    const char *lb = getenv("CUDA_LAUNCH_BLOCKING");
    if (lb && strcmp(lb, "0") != 0) x = 0;
    v = x == 0 ? SIZE_MAX - 1 : (size_t)x;
    __atomic_store_n(&pages, v, __ATOMIC_RELAXED);
  }
  return v;
}

/* Pages a gated fetch pins between two openings of its gate. */
#define GATE_RUN 64

/* A gated fetch's pins (kernels/kv_copy.h: its copy is launched and waits): in runs of
 * GATE_RUN pages, each run opened to the copy once it is pinned. The gate closes with every
 * page pinned, or, at the first stale reference, with the pages of the runs before its run:
 * those are copied (their blocks written), its run's pins are given back and nothing after it
 * is read. */
static int pin_gated(skv_kv_t *kv, const skv__kv_batch_t *b, const skv_page_ref_t *refs,
                     struct skv__kvc_slot *s, void *stream, const char *fn) {
  size_t done = 0, bad = 0;
  int rc = 0;
  while (done < b->n) {
    const size_t k = SKV_MIN(b->n - done, (size_t)GATE_RUN);
    rc = skv__pool_pin_n(&kv->pool, b->pe + done * b->pe_step, b->pe_step,
                         b->page + done * b->page_step, b->page_step, &refs[done].gen, 4, k, &bad);
    if (rc) break;
    done += k;
    if (done < b->n) skv__kvc_gate_open(s, done);
    const int delay = __atomic_load_n(&skv__kv_gate_delay_us, __ATOMIC_RELAXED);
    if (SKV_UNLIKELY(delay > 0)) {
      const struct timespec ts = {0, (long)delay * 1000};
      nanosleep(&ts, NULL);
    }
  }
  /* failed: the caller keeps its pins */
  const int rc2 = skv__kvc_gate_close(s, done, b->unpin_caller && rc == 0, stream, fn);
  if (rc == 0) return rc2;
  __atomic_add_fetch(&kv->stale, 1, __ATOMIC_RELAXED);
  const size_t i = done + bad;
  return SKV_FAIL(SKV_ESTALE, SKV_SUBSYS_KV,
                  "%s: reference %zu (PE %u, page %u, generation %u) is stale: the page was "
                  "evicted or reused; the blocks of references %zu and later were not written "
                  "(of the %zu before, they were). Look the keys up again (pin them to keep them)",
                  fn, i, refs[i].pe, refs[i].page, refs[i].gen, done, done);
}
#endif

/* Release the fetch's pins of pages [from, to) of the batch, and the caller's with `caller`. */
static int release(skv_kv_t *kv, const skv__kv_batch_t *b, size_t from, size_t to, bool caller) {
  if (from >= to) return 0;
  return skv__pool_unpin_n(&kv->pool, b->pe + from * b->pe_step, b->pe_step,
                           b->page + from * b->page_step, b->page_step, to - from, caller ? 2 : 1);
}

/* A key this PE could not cache: no free slot near its home. Counted, and explained once. */
static void note_index_full(skv_kv_t *kv) {
  if (__atomic_fetch_add(&kv->index_full, 1, __ATOMIC_RELAXED) == 0)
    SKV_WARN(SKV_SUBSYS_KV,
             "skv_kv_publish: a key found no free index slot near its home and was not cached; "
             "if this happens often, create the cache with more index_slots");
}

/* The last steps for one of this PE's pages just written with `key`'s data: READY (last used at
 * `now`), then the key's claim `cl` published (or, without one, the key inserted), then free the
 * page (deduplicated, or no index slot) or return 1: inserted, for the caller to count in
 * published and commit to the LRU. */
static int publish_index(skv_kv_t *kv, uint32_t page, skv_key_t key, uint64_t now,
                         const skv__index_claim_t *cl) {
  const int me = kv->pool.me;
  skv__pool_ready_at(&kv->pool, page, key.hi, key.lo, now);
  uint32_t gen = skv__pool_gen(&kv->pool, (uint32_t)me, page);
  const uint64_t val = skv__val_pack((uint32_t)me, page, gen);
  skv__index_claim_t own;
  bool raced;
  int r = cl ? 0 : skv__index_claim(&kv->index, key, me, &own, &raced);
  if (r == 0) r = skv__index_publish(&kv->index, cl ? cl : &own, val);
  if (r == 0) { /* the caller counts it in published; the eviction erases it there */
    __atomic_store_n(&kv->pool.meta[me][page].islot, skv__index_islot(cl ? cl : &own),
                     __ATOMIC_RELAXED);
    return 1;
  }
  skv__pool_release(&kv->pool, page);
  if (r == SKV_EEXIST)
    __atomic_add_fetch(&kv->deduplicated, 1, __ATOMIC_RELAXED);
  else
    note_index_full(kv);
  return 0;
}

/* The last steps for pages[i * page_step] (this PE's, just written) with key keys[idx ? idx[i] :
 * i], i < n, and that key's index claim cl[i] (NULL: the keys are inserted now): publish_index
 * each, and the inserted ones to the LRU 64 at a time (one lock). The pages' records and the
 * keys' index slots are prefetched PUB_AHEAD pages ahead (cold: perf put most of publish_index
 * on their first loads). Returns how many were inserted. */
static size_t finish_pages(skv_kv_t *kv, const uint32_t *pages, size_t page_step,
                           const skv_key_t *keys, const size_t *idx, const skv__index_claim_t *cl,
                           size_t n) {
  const skv__page_meta_t *meta = kv->pool.meta[kv->pool.me];
  /* one clock read for the batch (it was one per page): page i last used at now + i ns, so the
   * batch keeps its order in the LRU and no time lies ahead of the clock (a page takes > 1 ns) */
  const uint64_t now = skv__now_ns();
  uint32_t ins[64];
  size_t nins = 0, inserted = 0;
  for (size_t i = 0; i < n; i++) {
    if (i + PUB_AHEAD < n) {
      SKV_PREFETCH_W(&meta[pages[(i + PUB_AHEAD) * page_step]]);
      if (cl)
        skv__index_claim_prefetch(&kv->index, &cl[i + PUB_AHEAD]);
      else
        skv__index_prefetch(&kv->index, keys[idx ? idx[i + PUB_AHEAD] : i + PUB_AHEAD]);
    }
    const uint32_t pg = pages[i * page_step];
    if (publish_index(kv, pg, keys[idx ? idx[i] : i], now + i, cl ? &cl[i] : NULL))
      ins[nins++] = pg;
    if (nins == SKV_ARRAY_LEN(ins) || (i + 1 == n && nins)) {
      skv__pool_commit_n(&kv->pool, ins, nins);
      inserted += nins;
      nins = 0;
    }
  }
  if (inserted) {
    skv__index_count(&kv->index, kv->pool.me, inserted);
    __atomic_add_fetch(&kv->published, inserted, __ATOMIC_RELAXED);
  }
  return inserted;
}

/* A key a publish (or reserve) found cached on a page of this PE: a use of that page, as a lookup
 * hit's, so that the call's own allocation does not evict the key the caller just published
 * (it would when the page was the least recently used). Pages of other PEs are not this call's
 * to evict. */
static void touch_val(skv_kv_t *kv, uint64_t v, uint64_t now) {
  const uint32_t me = (uint32_t)kv->pool.me;
  if (skv__val_pe(v) == me) skv__pool_touch(&kv->pool, me, skv__val_page(v), now);
}

/* touch_val of key's VALID value, if it is cached. */
static void touch_cached(skv_kv_t *kv, skv_key_t key, uint64_t now) {
  uint64_t v;
  if (skv__index_lookup(&kv->index, key, &v) == 0) touch_val(kv, v, now);
}

/* Give up the claims cl[0..n) of keys keys[idx[i]] (their pages were not written). */
static void release_claims(skv_kv_t *kv, const skv_key_t *keys, const size_t *idx,
                           const skv__index_claim_t *cl, size_t n) {
  for (size_t i = 0; i < n; i++) skv__index_release(&kv->index, keys[idx[i]], &cl[i]);
}

#ifdef SKV_WITH_CUDA
/* A stream-ordered copy completed: the steps the synchronous copies take at once. */
static int batch_done(void *arg, const skv__kv_batch_t *b) {
  skv_kv_t *kv = arg;
  const uint64_t t = skv__kp_now(&kv->prof);
  if (b->dir == SKV__KV_FETCH) {
    int rc = release(kv, b, 0, b->n, b->unpin_caller);
    (void)skv__kp_lap(&kv->prof, SKV__KP_RELEASE, t);
    return rc;
  }
  if (b->dir == SKV__KV_WRITE) return 0; /* the pages stay reserved until committed */
  if (b->dir == SKV__KV_ABORT) {
    for (size_t i = 0; i < b->n; i++) skv__pool_release(&kv->pool, b_page(b, i));
    return 0;
  }
  /* SKV__KV_PUBLISH and SKV__KV_COMMIT: make the pages READY, index them */
  (void)finish_pages(kv, b->page, b->page_step, b->keys, NULL, b->claims, b->n);
  (void)skv__kp_lap(&kv->prof, SKV__KP_FINISH, t);
  return 0;
}

/* A captured fetch: every page must be pinned by this PE already, at the reference's
 * generation; the copy is recorded into the graph and nothing completes. */
static int capture_fetch(skv_kv_t *kv, const skv__kv_batch_t *b, const skv_page_ref_t *refs,
                         int path, uint32_t flags, const skv_layout_t *dst,
                         const uint64_t *block_ids, void *stream, const char *fn) {
  if (path == PATH_STAGED)
    return SKV_FAIL(SKV_ECAPTURE, SKV_SUBSYS_KV,
                    "%s: a layout in host memory is copied synchronously, which a CUDA graph "
                    "cannot capture; fetch into a GPU layout",
                    fn);
  if (flags & SKV_FETCH_UNPIN)
    return SKV_FAIL(SKV_ECAPTURE, SKV_SUBSYS_KV,
                    "%s: SKV_FETCH_UNPIN cannot be captured in a CUDA graph (every replay would "
                    "release the pins again): keep the pins while the graph is replayed and "
                    "release them with skv_kv_unpin after",
                    fn);
  for (size_t i = 0; i < b->n; i++) {
    int r = skv__pool_held(&kv->pool, refs[i].pe, refs[i].page, refs[i].gen);
    if (r)
      return SKV_FAIL(SKV_ECAPTURE, SKV_SUBSYS_KV,
                      "%s: reference %zu (PE %u, page %u, generation %u) is %s this PE while the "
                      "stream is being captured: a captured fetch takes no pins (the graph may "
                      "be replayed at any time), so look the pages up with SKV_LOOKUP_PIN before "
                      "capturing and keep them pinned while the graph is replayed",
                      fn, i, refs[i].pe, refs[i].page, refs[i].gen,
                      r == SKV_ENOTFOUND ? "not pinned by" : "stale for");
  }
  return skv__kvc_capture_fetch(kv->cuda, b, dst, block_ids, stream, fn);
}
#endif

/* The pinned pages of `b` into the blocks: host and staged copies (synchronous). */
static int copy_sync_fetch(skv_kv_t *kv, const skv__kv_batch_t *b, int path,
                           const skv_layout_t *dst, const uint64_t *block_ids, void *stream,
                           const char *fn) {
  const uint32_t m = dst->blocks_per_page;
  if (path == PATH_HOST) {
    const bool nt = (uint64_t)b->n * kv->page_bytes >= SKV_COPY_STREAM_BYTES;
    for (size_t i = 0; i < b->n; i++) {
      if (nt && i + 1 < b->n)
        skv__copy_page_prefetch(
            dst, (char *)skv__kv_page(kv, b_pe(b, i + 1), b_page(b, i + 1)) + dst->page_off,
            block_ids + (i + 1) * m);
      skv__copy_page_to_blocks(dst,
                               (char *)skv__kv_page(kv, b_pe(b, i), b_page(b, i)) + dst->page_off,
                               block_ids + i * m, nt);
    }
    if (nt) skv__copy_stream_fence();
    return 0;
  }
#ifdef SKV_WITH_CUDA
  /* only the bytes of the layers `dst` covers */
  const uint64_t pb = skv__layout_page_bytes(dst);
  const size_t per = skv__kvc_stage_pages(kv->cuda);
  char *buf = malloc(SKV_MIN(b->n, per) * pb);
  if (!buf)
    return SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_KV, "%s: out of memory for a staging buffer", fn);
  int rc = 0;
  for (size_t off = 0; rc == 0 && off < b->n; off += per) {
    skv__kv_batch_t part = *b;
    part.n = SKV_MIN(per, b->n - off);
    part.pe = b->pe + off * b->pe_step;
    part.page = b->page + off * b->page_step;
    rc = skv__kvc_read_pages(kv->cuda, &part, dst->page_off, pb, buf, stream, fn);
    for (size_t q = 0; rc == 0 && q < part.n; q++)
      skv__copy_page_to_blocks(dst, buf + q * pb, block_ids + (off + q) * m, false);
  }
  free(buf);
  return rc;
#else
  SKV_UNUSED(stream);
  return SKV_FAIL(SKV_EINTERNAL, SKV_SUBSYS_KV, "%s: staged copy without CUDA", fn);
#endif
}

/* An attached cache maps the segments of the pages it reads first, and keeps them mapped until
 * the copy is done (host) or enqueued (GPU: a later remap waits for the copies, quiesce). */
static int map_begin(skv_kv_t *kv, const skv__kv_batch_t *b) {
  return kv->domain ? skv__domain_map_begin(kv->domain, b->pe, b->pe_step, b->n, quiesce, kv) : 0;
}

static void map_end(skv_kv_t *kv) {
  if (kv->domain) skv__domain_map_end(kv->domain);
}

static int fetch_mapped(skv_kv_t *kv, const skv__kv_batch_t *b, const skv_page_ref_t *refs,
                        int path, uint32_t flags, const skv_layout_t *dst,
                        const uint64_t *block_ids, void *stream, const char *fn) {
  const size_t n = b->n;
  skv__kv_prof_t *P = &kv->prof;
  uint64_t t = skv__kp_now(P);
#ifdef SKV_WITH_CUDA
  if (path != PATH_HOST) {
    bool capturing;
    SKV_CHECK(skv__kvc_begin(kv->cuda, stream, &capturing, false));
    if (capturing) return capture_fetch(kv, b, refs, path, flags, dst, block_ids, stream, fn);
    if (path == PATH_DEVICE) SKV_CHECK(skv__kvc_check(kv->cuda, dst, SKV__KV_FETCH, fn));
    t = skv__kp_lap(P, SKV__KP_BEGIN, t);
  }
#else
  SKV_UNUSED(flags);
#endif
  size_t bad = 0;
  /* one pass over the caller's pins (it was made twice when they were all held) */
  const bool unheld = b->unpin_caller && skv__pool_held_refs(&kv->pool, refs, n, &bad) != 0;
  if (unheld && kv->pool.lease_lost)
    return SKV_FAIL(SKV_ESTALE, SKV_SUBSYS_KV,
                    "%s: reference %zu (PE %u, page %u) is no longer pinned by this PE: this "
                    "PE's pins were revoked when it made no call for longer than its lease "
                    "(SKV_PIN_LEASE_MS, %llu ms) while other PEs needed the pages; nothing was "
                    "copied. Look the keys up again",
                    fn, bad, refs[bad].pe, refs[bad].page, (unsigned long long)kv->pool.lease_ms);
  if (unheld)
    return SKV_FAIL(
        SKV_EINVAL, SKV_SUBSYS_KV,
        "%s: reference %zu (PE %u, page %u) is not pinned by this PE (or is listed more "
        "times than it is pinned), but SKV_FETCH_UNPIN releases the caller's pins; "
        "nothing was copied. Pin with skv_kv_lookup(SKV_LOOKUP_PIN) first, or fetch "
        "without SKV_FETCH_UNPIN",
        fn, bad, refs[bad].pe, refs[bad].page);
#ifdef SKV_WITH_CUDA
  if (path == PATH_DEVICE && n >= gate_pages()) { /* the copy first, the pins while it waits */
    struct skv__kvc_slot *s = NULL;
    const int g = skv__kvc_copy_gated(kv->cuda, b, dst, block_ids, stream, &s, fn);
    if (g < 0) return g; /* nothing enqueued, nothing pinned */
    if (g == 0) {
      t = skv__kp_now(P);
      const int rc = pin_gated(kv, b, refs, s, stream, fn);
      (void)skv__kp_lap(P, SKV__KP_PIN, t);
      return rc;
    }
  }
#endif
  const uint64_t revoked0 = skv__pool_revoked(&kv->pool);
  SKV_CHECK(pin_all(kv, b, refs, fn));
  t = skv__kp_lap(P, SKV__KP_PIN, t);
#ifdef SKV_WITH_CUDA
  if (path == PATH_DEVICE) {
    size_t queued = 0;
    int rc = skv__kvc_copy(kv->cuda, b, dst, block_ids, NULL, stream, &queued, fn);
    if (rc) (void)release(kv, b, queued, n, b->unpin_caller && queued > 0);
    return rc;
  }
#endif
  int rc = copy_sync_fetch(kv, b, path, dst, block_ids, stream, fn);
  t = skv__kp_lap(P, SKV__KP_COPY, t);
  /* This process stopped inside the copy for longer than its lease and an evictor revoked pins
   * of ours meanwhile: a page may have been rewritten under the copy (pool.h, Leases). */
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
  if (rc == 0 && skv__pool_revoked(&kv->pool) != revoked0)
    rc = SKV_FAIL(SKV_ESTALE, SKV_SUBSYS_KV,
                  "%s: this PE's pin lease ran out during the copy (it made no progress for "
                  "longer than SKV_PIN_LEASE_MS, %llu ms) and pages it pinned may have been "
                  "reused: the destination's contents are undefined; look the keys up again",
                  fn, (unsigned long long)kv->pool.lease_ms);
  int r2 = release(kv, b, 0, n, b->unpin_caller && rc == 0);
  (void)skv__kp_lap(P, SKV__KP_RELEASE, t);
  return rc ? rc : r2;
}

int skv_kv_fetch(skv_kv_t *kv, const skv_page_ref_t *refs, size_t n, const skv_layout_t *dst,
                 const uint64_t *block_ids, uint32_t flags, void *stream) {
  const char *fn = "skv_kv_fetch";
  KV_CHECK_NULL(kv, "skv_kv_fetch");
  const uint64_t t0 = skv__kp_now(&kv->prof);
  SKV_CHECK(check_refs(kv, refs, n, fn));
  SKV_CHECK(check_layout(kv, dst, block_ids, n, fn));
  SKV_ARG_CHECK((flags & ~(uint32_t)SKV_FETCH_UNPIN) == 0, SKV_SUBSYS_KV,
                "skv_kv_fetch: unknown flags 0x%x", flags);
  if (n == 0) return 0;
  (void)skv__pool_renew(&kv->pool);
  int path;
  SKV_CHECK(choose_path(kv, dst, &path, fn));
  const bool unpin = (flags & SKV_FETCH_UNPIN) != 0;
  const skv__kv_batch_t b = {.dir = SKV__KV_FETCH,
                             .n = n,
                             .pe = &refs[0].pe,
                             .pe_step = 4,
                             .page = &refs[0].page,
                             .page_step = 4,
                             .unpin_caller = unpin};
  SKV_CHECK(map_begin(kv, &b));
  (void)skv__kp_lap(&kv->prof, SKV__KP_CHECK, t0);
  int rc = fetch_mapped(kv, &b, refs, path, flags, dst, block_ids, stream, fn);
  map_end(kv);
  (void)skv__kp_lap(&kv->prof, SKV__KP_CALL, t0);
  return rc;
}

/* Copy the blocks of keys idx[0..k) into this PE's pages[0..k) and finish them (host and staged
 * copies); *inserted counts the keys inserted. */
static int copy_sync_publish(skv_kv_t *kv, const skv_key_t *keys, const uint32_t *pages,
                             const size_t *idx, const skv__index_claim_t *cl, size_t k, int path,
                             bool nt, char *buf, const skv_layout_t *src, const uint64_t *block_ids,
                             void *stream, size_t *inserted, const char *fn) {
  const uint32_t me = (uint32_t)kv->pool.me, m = src->blocks_per_page;
  const uint64_t pb = kv->page_bytes;
  int rc = 0;
  uint64_t t = skv__kp_now(&kv->prof);
  for (size_t q = 0; q < k; q++) {
    void *to = path == PATH_HOST ? skv__kv_page(kv, me, pages[q]) : buf + q * pb;
    skv__copy_blocks_to_page(src, to, block_ids + idx[q] * m, nt);
  }
  if (nt) skv__copy_stream_fence(); /* the pages must be complete before they are indexed */
#ifdef SKV_WITH_CUDA
  if (path == PATH_STAGED) {
    const skv__kv_batch_t b = {
        .dir = SKV__KV_PUBLISH, .n = k, .pe = &me, .page = pages, .page_step = 1};
    rc = skv__kvc_write_pages(kv->cuda, &b, 0, pb, buf, stream, fn);
  }
#else
  SKV_UNUSED(stream), SKV_UNUSED(fn);
#endif
  t = skv__kp_lap(&kv->prof, SKV__KP_COPY, t);
  if (rc) {
    release_claims(kv, keys, idx, cl, k);
    for (size_t q = 0; q < k; q++) skv__pool_release(&kv->pool, pages[q]);
  } else {
    *inserted += finish_pages(kv, pages, 1, keys, idx, cl, k);
  }
  (void)skv__kp_lap(&kv->prof, SKV__KP_FINISH, t);
  return rc;
}

/* ---- publish's helper: the next window's claims while this one is allocated and copied ---- */

/* A window's claims (skv__index_claim_n's arguments), in groups of CLAIM_SHARE keys that the
 * helper takes from the front and the caller from the back once it has nothing else to do
 * (span: the groups not taken yet, the first in the low 32 bits, the end in the high 32). A key
 * listed twice in one window, in two groups, is claimed by both at once: exactly one claim wins
 * (the older ticket), not always the first in the list (the blocks of one key are the same
 * bytes). */
#define CLAIM_SHARE 32
typedef struct claim_job {
  skv__index_t *ix;
  const skv_key_t *keys;
  size_t n;
  int me;
  skv__index_claim_t *cl;
  int *crc;
  bool *craced;
  uint64_t span;        /* atomic */
  pthread_t caller;     /* the publishing thread (the helper is any other) */
  skv__kv_prof_t *prof; /* the helper's share is timed (SKV__KP_HELPER) */
} claim_job_t;

static claim_job_t claim_job_make(skv_kv_t *kv, const skv_key_t *keys, size_t n,
                                  skv__index_claim_t *cl, int *crc, bool *craced) {
  const uint64_t groups = (n + CLAIM_SHARE - 1) / CLAIM_SHARE;
  return (claim_job_t){&kv->index,   keys,           n,        kv->pool.me, cl, crc, craced,
                       groups << 32, pthread_self(), &kv->prof};
}

/* Claim the groups not taken yet, from the front (the helper) or the back (the caller). */
static void claim_job_take(claim_job_t *j, bool back) {
  uint64_t s = __atomic_load_n(&j->span, __ATOMIC_ACQUIRE);
  for (;;) {
    const uint64_t f = (uint32_t)s, b = s >> 32;
    if (f >= b) return;
    const uint64_t g = back ? b - 1 : f, ns = back ? (g << 32) | f : (b << 32) | (f + 1);
    if (!__atomic_compare_exchange_n(&j->span, &s, ns, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
      continue; /* s is the new span */
    const size_t a = (size_t)g * CLAIM_SHARE, z = SKV_MIN(j->n, a + CLAIM_SHARE);
    skv__index_claim_n(j->ix, j->keys + a, z - a, j->me, j->cl + a, j->crc + a, j->craced + a);
    s = __atomic_load_n(&j->span, __ATOMIC_ACQUIRE);
  }
}

static void claim_job_run(void *arg) {
  claim_job_t *j = arg;
  const bool helper = !pthread_equal(pthread_self(), j->caller); /* not taken back */
  const uint64_t t = helper ? skv__kp_now(j->prof) : 0;
  claim_job_take(j, false);
  (void)skv__kp_lap(j->prof, SKV__KP_HELPER, t);
}

/* The caller's share of a posted window, then its wait for the helper's. */
static void claim_job_finish(skv__helper_t *h, claim_job_t *j) {
  claim_job_take(j, true); /* the groups the helper has not come to yet: ours */
  const uint64_t t = skv__kp_now(j->prof);
  skv__helper_join(h);
  (void)skv__kp_lap(j->prof, SKV__KP_JOIN, t);
}

/* Give up a window's claims that were made and not used (the publish stopped before it, or went
 * back to an earlier key). */
static void claim_job_drop(skv_kv_t *kv, const claim_job_t *j) {
  for (size_t q = 0; q < j->n; q++)
    if (j->crc[q] == 0) skv__index_release(&kv->index, j->keys[q], &j->cl[q]);
}

/* A window claimed while the one before was allocated and copied, made what claiming it after
 * them would have made: a key found cached may have been evicted by that allocation (evicted),
 * and a key that lost to the window before's own claim is cached by now when that window was
 * copied synchronously (synced): these keys are claimed again. */
static void claim_job_redo(const claim_job_t *j, bool evicted, bool synced) {
  for (size_t q = 0; q < j->n; q++)
    if (j->crc[q] == SKV_EEXIST && (j->craced[q] ? synced : evicted))
      skv__index_claim_n(j->ix, &j->keys[q], 1, j->me, &j->cl[q], &j->crc[q], &j->craced[q]);
}

/* ---- the free reserve: evicting ahead on the helper, between publishes --------------------- */

/* How it works
 * ------------
 * With skv_kv_set_free_reserve(kv, R), each publish (and commit) ends by posting a job to its
 * helper: evict least recently used unpinned pages until R are free (skv__pool_reclaim: runs of
 * a few dozen, the pool's lock released between runs). The publish does not wait for it; the next
 * user of the helper (a publish, a detach) stops it first (reclaim_end: the job checks the flag
 * before each run, so the wait is one run at most, or none when the helper had not begun it). The
 * next publish then takes its pages from the free stack, without an index erase per page.
 *
 * What can go wrong
 * -----------------
 * - Publishes back to back leave the job no time: each stops the one before, and allocation
 *   evicts the rest itself, as without a reserve.
 * - No helper (switched off, one CPU, a forked child): nothing is posted, nothing evicted ahead.
 * - The reserve costs its pages: up to R fewer pages cached (the least recently used).
 * - A fork while it runs: the fork waits for the pool's lock (fork_prepare below). */

static void reclaim_run(void *arg) {
  skv_kv_t *kv = arg;
  if (!__atomic_load_n(&kv->free_reserve, __ATOMIC_RELAXED)) return;
#ifdef SKV_WITH_CUDA
  /* After the publish's completion, not beside it: its inserts and LRU pushes (the completion
   * thread) and these evictions would take the pool's lock in turns, and the publish, timed to
   * its completion, took twice as long so on one H100. Looked at every 5 us or so for 1 ms,
   * then every 100 us (fetches may keep the cache busy a long time). */
  for (unsigned polls = 0; !skv__kvc_idle(kv->cuda); polls++) {
    for (int i = 0; i < 100; i++) {
      if (__atomic_load_n(&kv->reclaim_stop, __ATOMIC_ACQUIRE)) return;
      if (polls < 200) SKV_CPU_RELAX();
    }
    if (polls >= 200) nanosleep(&(struct timespec){0, 100000}, NULL);
  }
#endif
  (void)skv__pool_reclaim(&kv->pool, &kv->free_reserve, skv__kv_evict_cb, kv, &kv->reclaim_stop);
}

/* A fork while a helper evicts ahead would copy its pool's lock held, in a child without that
 * thread: every cache with a helper is listed, and a fork takes their pool locks first
 * (pthread_atfork), so each pool is between two runs of evictions when the child is made. */
static pthread_mutex_t forkers_mu = PTHREAD_MUTEX_INITIALIZER;
static skv_kv_t *forkers;
static pthread_once_t forkers_once = PTHREAD_ONCE_INIT;

static void fork_prepare(void) {
  pthread_mutex_lock(&forkers_mu);
  for (skv_kv_t *k = forkers; k; k = k->fork_next) pthread_mutex_lock(&k->pool.mu);
}

static void fork_done(void) { /* in the parent and in the child (the thread that forked) */
  for (skv_kv_t *k = forkers; k; k = k->fork_next) pthread_mutex_unlock(&k->pool.mu);
  pthread_mutex_unlock(&forkers_mu);
}

static void forkers_init(void) {
  (void)pthread_atfork(fork_prepare, fork_done, fork_done);
}

static void forker_add(skv_kv_t *kv) {
  pthread_once(&forkers_once, forkers_init);
  pthread_mutex_lock(&forkers_mu);
  kv->fork_next = forkers;
  forkers = kv;
  pthread_mutex_unlock(&forkers_mu);
}

/* Off the list (at destroy and detach, once the helper is gone: kv->helper still says whether
 * one was made, and so listed). */
static void forker_remove(skv_kv_t *kv) {
  if (!kv->helper) return;
  pthread_mutex_lock(&forkers_mu);
  for (skv_kv_t **pp = &forkers; *pp; pp = &(*pp)->fork_next)
    if (*pp == kv) {
      *pp = kv->fork_next;
      break;
    }
  pthread_mutex_unlock(&forkers_mu);
}

/* Stop the helper's eviction ahead, if one was posted (by the holder of helper_busy, or at a
 * detach). */
static void reclaim_end(skv_kv_t *kv) {
  if (!kv->reclaim_pending) return;
  __atomic_store_n(&kv->reclaim_stop, 1, __ATOMIC_RELEASE);
  skv__helper_join(kv->helper);
  __atomic_store_n(&kv->reclaim_stop, 0, __ATOMIC_RELAXED);
  kv->reclaim_pending = false;
}

int skv_kv_set_free_reserve(skv_kv_t *kv, uint64_t npages) {
  KV_CHECK_NULL(kv, "skv_kv_set_free_reserve");
  if (kv->domain && skv__domain_role(kv->domain) != SKV_ROLE_OWNER)
    return SKV_FAIL(SKV_ESTATE, SKV_SUBSYS_KV,
                    "skv_kv_set_free_reserve: a reader of a domain publishes nothing; attach as "
                    "SKV_ROLE_OWNER");
  SKV_ARG_CHECK(npages <= kv->pool.pages / 2, SKV_SUBSYS_KV,
                "skv_kv_set_free_reserve: npages=%" PRIu64 " is over half of this PE's %" PRIu64
                " pages",
                npages, kv->pool.pages);
  __atomic_store_n(&kv->free_reserve, npages, __ATOMIC_RELAXED);
  return 0;
}

/* The cache's helper for one publish, its burst on when the publish has several windows to
 * claim; NULL (the caller claims every window itself, nothing is evicted ahead) when switched
 * off, another publish of this cache uses it, or it cannot be started (warned once). Started at
 * the first publish that wants it. An eviction ahead still running is stopped first. */
static skv__helper_t *helper_take(skv_kv_t *kv, bool burst) {
  if (!skv__env_switch(SKV_ENV_PUBLISH_HELPER, true, SKV_SUBSYS_KV)) return NULL;
  int expect = 0;
  if (!__atomic_compare_exchange_n(&kv->helper_busy, &expect, 1, false, __ATOMIC_ACQUIRE,
                                   __ATOMIC_RELAXED))
    return NULL;
  reclaim_end(kv);
  if (!kv->helper && !kv->helper_off) {
    if (skv__helper_create(SKV_SUBSYS_KV, "skv_kv_publish", &kv->helper) == 0) {
      forker_add(kv);
    } else {
      SKV_WARN(SKV_SUBSYS_KV, "%s; publishes claim their keys without it", skv_last_error());
      kv->helper_off = true;
    }
  }
  if (!skv__helper_usable(kv->helper)) {
    __atomic_store_n(&kv->helper_busy, 0, __ATOMIC_RELEASE);
    return NULL;
  }
  if (burst) skv__helper_burst(kv->helper, true);
  return kv->helper;
}

static void helper_give(skv_kv_t *kv, skv__helper_t *h) {
  if (!h) return;
  skv__helper_burst(h, false);
  __atomic_store_n(&kv->helper_busy, 0, __ATOMIC_RELEASE);
}

/* After a commit (the layer-by-layer publish's end): the eviction ahead, as after a publish. */
static void reclaim_ahead(skv_kv_t *kv) {
  if (!__atomic_load_n(&kv->free_reserve, __ATOMIC_RELAXED)) return;
  skv__helper_t *h = helper_take(kv, false);
  if (!h) return;
  kv->reclaim_pending = skv__helper_post(h, reclaim_run, kv);
  helper_give(kv, h);
}

int skv_kv_publish(skv_kv_t *kv, const skv_namespace_t *ns, const skv_key_t *keys, size_t n,
                   const skv_layout_t *src, const uint64_t *block_ids, void *stream,
                   size_t *ninserted) {
  const char *fn = "skv_kv_publish";
  KV_CHECK_NULL(kv, "skv_kv_publish");
  skv__kv_prof_t *P = &kv->prof;
  const uint64_t t0 = skv__kp_now(P);
  if (ninserted) *ninserted = 0;
  SKV_CHECK(check_ns(kv, ns, fn));
  SKV_CHECK(check_keys(keys, n, fn));
  SKV_CHECK(check_layout(kv, src, block_ids, n, fn));
  SKV_CHECK(check_whole(src, fn));
  if (kv->domain && skv__domain_role(kv->domain) != SKV_ROLE_OWNER)
    return SKV_FAIL(SKV_ESTATE, SKV_SUBSYS_KV,
                    "%s: a reader of a domain has no pages to publish into; attach as "
                    "SKV_ROLE_OWNER to publish",
                    fn);
  if (n == 0) return 0;
  tidy(kv);
  int path;
  SKV_CHECK(choose_path(kv, src, &path, fn));
  uint64_t t = skv__kp_lap(P, SKV__KP_CHECK, t0);
  /* pages looked up, allocated, copied and finished together: host copies in runs of
   * PUB_CHUNK (the bookkeeping of one page at a time was a lookup, an allocation and an index
   * insert each on a cold line, one after the other; in runs their misses overlap) */
  size_t chunk = SKV_MIN(n, (size_t)PUB_CHUNK);
#ifdef SKV_WITH_CUDA
  if (path != PATH_HOST) {
    bool capturing;
    SKV_CHECK(skv__kvc_begin(kv->cuda, stream, &capturing, true));
    if (capturing)
      return SKV_FAIL(SKV_ECAPTURE, SKV_SUBSYS_KV,
                      "%s cannot be captured in a CUDA graph: a replay would write into pages "
                      "that may have been evicted and reused since; publish outside the capture "
                      "(it is stream-ordered)",
                      fn);
    if (path == PATH_DEVICE) SKV_CHECK(skv__kvc_check(kv->cuda, src, SKV__KV_PUBLISH, fn));
    const size_t split = (size_t)SKV_MAX(1, __atomic_load_n(&skv__kv_pub_split, __ATOMIC_RELAXED));
    chunk = SKV_MIN(n, path != PATH_DEVICE ? skv__kvc_stage_pages(kv->cuda)
                       : split == 1        ? n
                                           : SKV_MAX((size_t)PUB_CHUNK, (n + split - 1) / split));
    t = skv__kp_lap(P, SKV__KP_BEGIN, t);
  }
#endif
  uint32_t pages_s[PUB_CHUNK];
  size_t idx_s[PUB_CHUNK];
  skv_key_t pkeys_s[PUB_CHUNK];
  /* claims, their results and races: two sets with a helper (it fills the next window's) */
  skv__index_claim_t cl_s[2][PUB_CHUNK];
  int crc_s[2][PUB_CHUNK];
  bool craced_s[2][PUB_CHUNK];
  const bool on_stack = chunk <= PUB_CHUNK; /* no allocation per call */
  const bool reserve = __atomic_load_n(&kv->free_reserve, __ATOMIC_RELAXED) > 0;
  skv__helper_t *helper = n > chunk || reserve ? helper_take(kv, n > chunk) : NULL;
  const bool sharing = helper && n > chunk; /* several windows: claims shared with the helper */
  const int nsets = sharing ? 2 : 1;
  uint32_t *pages = on_stack ? pages_s : malloc(chunk * sizeof *pages);
  size_t *idx = on_stack ? idx_s : malloc(chunk * sizeof *idx);
  skv__index_claim_t *cls[2] = {NULL, NULL};
  int *crcs[2] = {NULL, NULL};
  bool *raceds[2] = {NULL, NULL};
  bool sets_ok = true;
  for (int q = 0; q < nsets; q++) {
    cls[q] = on_stack ? cl_s[q] : malloc(chunk * sizeof *cls[q]);
    crcs[q] = on_stack ? crc_s[q] : malloc(chunk * sizeof *crcs[q]);
    raceds[q] = on_stack ? craced_s[q] : malloc(chunk * sizeof *raceds[q]);
    sets_ok = sets_ok && cls[q] && crcs[q] && raceds[q];
  }
  skv_key_t *pkeys = path != PATH_DEVICE ? NULL
                     : on_stack          ? pkeys_s
                                         : malloc(chunk * sizeof *pkeys);
  char *buf = path == PATH_STAGED ? malloc(chunk * kv->page_bytes) : NULL;
  int rc = 0;
  if (!pages || !idx || !sets_ok || (path == PATH_DEVICE && !pkeys) ||
      (path == PATH_STAGED && !buf))
    rc = SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_KV, "%s: out of memory for %zu pages", fn, chunk);
  const bool nt = path == PATH_HOST && (uint64_t)n * kv->page_bytes >= SKV_COPY_STREAM_BYTES;
  const int me = kv->pool.me;
  size_t inserted = 0;
  uint64_t lost = 0;
  /* with a helper: the claims of the window after this one, in the other set, while this one is
   * allocated and copied (pending: posted, not joined yet) */
  claim_job_t job = claim_job_make(kv, NULL, 0, NULL, NULL, NULL);
  bool pending = false;
  int set = 0;
  uint64_t ev_last = 0; /* pages the last window's allocation evicted */
#ifdef SKV_WITH_CUDA
  bool launched = false; /* a window's copy is on the stream (the next one follows it) */
#endif
  for (size_t i = 0; i < n && rc == 0;) {
    size_t k = 0, got = 0;
    t = skv__kp_now(P);
    /* each key's index slot claimed (PENDING: readers miss it until the copy is complete, and
     * another PE's publish of the key loses to it): a key cached already, or whose copy by
     * another publish is older, is skipped before anything is allocated or copied */
    const size_t w = SKV_MIN(chunk, n - i), i0 = i;
    skv__index_claim_t *cl = cls[set];
    int *crc = crcs[set];
    bool *craced = raceds[set];
    bool claimed = false; /* by the helper, while the window before was allocated and copied */
    if (pending) {
      claim_job_finish(helper, &job);
      pending = false;
      claimed = job.keys == keys + i && job.n == w;
      if (claimed)
        claim_job_redo(&job, ev_last > 0, path != PATH_DEVICE);
      else /* the publish went back (no pages): not these */
        claim_job_drop(kv, &job);
    }
    if (!claimed && sharing) { /* the first window: its claims shared with the helper */
      job = claim_job_make(kv, keys + i, w, cl, crc, craced);
      if (skv__helper_post(helper, claim_job_run, &job)) {
        claim_job_finish(helper, &job);
        claimed = true;
      }
    }
    if (!claimed) skv__index_claim_n(&kv->index, keys + i, w, me, cl, crc, craced);
    if (sharing && i + w < n) { /* the next window's claims meanwhile (in the other set) */
      set ^= 1;
      job = claim_job_make(kv, keys + i + w, SKV_MIN(chunk, n - i - w), cls[set], crcs[set],
                           raceds[set]);
      pending = skv__helper_post(helper, claim_job_run, &job);
      if (i + w + job.n >= n) skv__helper_burst(helper, false); /* the last job: stop spinning */
    }
    uint64_t now = 0; /* read at the first key found cached */
    for (size_t q = 0; q < w; q++) {
      if (crc[q] == 0) {
        cl[k] = cl[q];    /* k <= q: the claims packed in place */
        idx[k++] = i + q; /* ours to copy */
      } else if (crc[q] == SKV_EEXIST && !craced[q]) {
        if (!now) now = skv__now_ns();
        touch_val(kv, cl[q].valid, now); /* the VALID value the claim found */
      }
    }
    i += w;
    t = skv__kp_lap(P, SKV__KP_LOOKUP, t);
    uint64_t ev = 0;
    rc = skv__pool_alloc_n(&kv->pool, skv__kv_evict_cb, kv, pages, k, &got, &ev);
    ev_last = ev;
    /* on a failure, what was allocated is still published */
    t = skv__kp_lap(P, SKV__KP_ALLOC, t);
    release_claims(kv, keys, idx + got, cl + got, k - got); /* no page for these */
    if (rc && got > 0 && path != PATH_DEVICE) {
      /* A synchronous copy finishes these pages before the next run, which may then evict
       * them: the keys left over go to the next run (as one page at a time did: a publish of
       * more keys than the pool has unpinned pages keeps the last ones). */
      i = idx[got];
      rc = 0;
    }
    for (size_t q = 0; q < i - i0 && q < w; q++) { /* the keys of the window decided on */
      if (crc[q] == SKV_ENOSPC)
        note_index_full(kv);
      else if (crc[q] != 0 && craced[q])
        lost++; /* another publish's copy of the key won (deduplicated) */
    }
    k = got;
    if (k == 0) continue; /* every key of the window cached (or no page: rc ends the loop) */
    int r = 0;
    if (path != PATH_DEVICE) {
      r = copy_sync_publish(kv, keys, pages, idx, cl, k, path, nt, buf, src, block_ids, stream,
                            &inserted, fn);
    } else {
#ifdef SKV_WITH_CUDA
      const uint32_t ume = (uint32_t)me;
      for (size_t q = 0; q < k; q++) pkeys[q] = keys[idx[q]];
      /* after the first window's launch the windows follow one another on the stream */
      const skv__kv_batch_t b = {.dir = SKV__KV_PUBLISH,
                                 .n = k,
                                 .pe = &ume,
                                 .page = pages,
                                 .page_step = 1,
                                 .keys = pkeys,
                                 .claims = cl,
                                 .follows = launched,
                                 .precedes = i < n};
      size_t queued = 0;
      r = skv__kvc_copy(kv->cuda, &b, src, block_ids, idx, stream, &queued, fn);
      launched = launched || queued > 0;
      release_claims(kv, keys, idx + queued, cl + queued, k - queued);
      for (size_t q = queued; q < k; q++) skv__pool_release(&kv->pool, pages[q]);
      inserted += queued; /* queued: the completion publishes them (skv_kv_sync waits for it) */
#endif
    }
    if (r) rc = r;
  }
  if (pending) { /* stopped before the window claimed meanwhile */
    skv__helper_join(helper);
    claim_job_drop(kv, &job);
  }
  if (helper && reserve) /* the next publish's pages freed meanwhile */
    kv->reclaim_pending = skv__helper_post(helper, reclaim_run, kv);
  helper_give(kv, helper);
  if (lost) __atomic_add_fetch(&kv->deduplicated, lost, __ATOMIC_RELAXED);
  if (!on_stack) {
    free(pages);
    free(idx);
    for (int q = 0; q < nsets; q++) {
      free(cls[q]);
      free(crcs[q]);
      free(raceds[q]);
    }
    free(pkeys);
  }
  free(buf);
  if (ninserted) *ninserted = inserted;
  (void)skv__kp_lap(P, SKV__KP_CALL, t0);
  return rc;
}

/* ---- publishing in parts: reserve, write (layer by layer), commit --------------------------- */

/* How it works
 * ------------
 * skv_kv_reserve takes pages as a publish does (WRITING: no one pins, reads or evicts them) and
 * hands their references to the caller instead of copying at once; skv_kv_write copies any
 * layers into them, as often as the caller likes; skv_kv_commit then takes the publish's last
 * step (READY, index insert, LRU; freed when deduplicated), so a key is found only once the
 * caller wrote its whole page. For GPU pages the writes are stream-ordered and the commit (or
 * abort) is an event on the caller's stream: the completion thread indexes (or frees) the pages
 * once everything enqueued before it completed, exactly as it finishes a publish's copy.
 *
 * What can go wrong
 * -----------------
 * - A reference that is not a page this PE reserved (another PE's, a stale generation, one
 *   committed or aborted already): SKV_ESTATE before anything is copied or indexed.
 * - The caller commits a page some of whose layers it never wrote: the page is served with
 *   whatever the page held (symkv cannot tell written bytes from old ones); the engine's
 *   connector writes every layer it did not write layer by layer before it commits.
 * - An owner that never commits or aborts: its reserved pages stay WRITING (not evictable) until
 *   it detaches or dies (the domain frees them then).
 * - A second commit or abort of a page (a caller's mistake) would index or free it twice: every
 *   call checks that the page is still WRITING, and a stream-ordered commit or abort makes its
 *   pages READY-but-not-indexed at once (nobody finds, pins or evicts such a page), so the second
 *   call fails with SKV_ESTATE. A stream-ordered step that cannot be queued gives its pages back.
 */

/* Give claimed pages[0..k) of generations gens[] back to the caller: READY (claimed, nothing
 * done with them yet) -> WRITING, so that they are still its reservations to commit or abort. */
static void unclaim(skv_kv_t *kv, const uint32_t *pages, const uint32_t *gens, size_t k) {
  const uint32_t me = (uint32_t)kv->pool.me;
  for (size_t q = 0; q < k; q++) {
    uint64_t want = skv__st_make(gens[q], SKV_PAGE_READY);
    (void)__atomic_compare_exchange_n(&kv->pool.meta[me][pages[q]].state, &want,
                                      skv__st_make(gens[q], SKV_PAGE_WRITING), false,
                                      __ATOMIC_ACQ_REL, __ATOMIC_RELAXED);
  }
}

/* The reserved pages of refs[0..n) (generation 0 skipped): pages[*k] and idx[*k] get them and
 * their places in refs. With `gens` (a commit or an abort) each is also claimed: WRITING ->
 * READY(gen) with a compare-and-swap, so a page is finished once even when two threads commit or
 * abort the same references, or a reference is listed twice (the second fails); READY but
 * neither indexed nor in the LRU, it is still unreachable; gens get the generations. On a
 * refused reference nothing stays claimed. */
static int reserved_refs(skv_kv_t *kv, const skv_page_ref_t *refs, size_t n, uint32_t *pages,
                         size_t *idx, uint32_t *gens, size_t *k, const char *fn) {
  *k = 0;
  if (n && !refs) return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_KV, "%s: refs is NULL with n=%zu", fn, n);
  const uint32_t me = (uint32_t)kv->pool.me;
  for (size_t i = 0; i < n; i++) {
    if (refs[i].gen == 0) continue;
    int rc = 0;
    if (refs[i].pe != me || refs[i].page >= kv->pool.pages) {
      rc = SKV_FAIL(SKV_ESTATE, SKV_SUBSYS_KV,
                    "%s: reference %zu (PE %u, page %u) is not a page of this PE (PE %u): pass "
                    "the references skv_kv_reserve filled",
                    fn, i, refs[i].pe, refs[i].page, me);
    } else {
      uint64_t *state = &kv->pool.meta[me][refs[i].page].state;
      uint64_t want = skv__st_make(refs[i].gen, SKV_PAGE_WRITING);
      const bool ok = gens ? __atomic_compare_exchange_n(state, &want,
                                                         skv__st_make(refs[i].gen, SKV_PAGE_READY),
                                                         false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)
                           : __atomic_load_n(state, __ATOMIC_ACQUIRE) == want;
      if (!ok)
        rc = SKV_FAIL(SKV_ESTATE, SKV_SUBSYS_KV,
                      "%s: reference %zu (page %u, generation %u) is not a page this PE reserved "
                      "and still holds (it was committed or aborted already, is listed twice, "
                      "or is not skv_kv_reserve's); nothing was done",
                      fn, i, refs[i].page, refs[i].gen);
    }
    if (rc) {
      if (gens) unclaim(kv, pages, gens, *k);
      *k = 0;
      return rc;
    }
    pages[*k] = refs[i].page;
    if (gens) gens[*k] = refs[i].gen;
    idx[(*k)++] = i;
  }
  return 0;
}

static int check_owner(const skv_kv_t *kv, const char *fn) {
  if (kv->domain && skv__domain_role(kv->domain) != SKV_ROLE_OWNER)
    return SKV_FAIL(SKV_ESTATE, SKV_SUBSYS_KV,
                    "%s: a reader of a domain has no pages to publish into; attach as "
                    "SKV_ROLE_OWNER to publish",
                    fn);
  return 0;
}

int skv_kv_reserve(skv_kv_t *kv, const skv_namespace_t *ns, const skv_key_t *keys, size_t n,
                   skv_page_ref_t *refs, size_t *nreserved) {
  const char *fn = "skv_kv_reserve";
  KV_CHECK_NULL(kv, "skv_kv_reserve");
  if (nreserved) *nreserved = 0;
  SKV_CHECK(check_ns(kv, ns, fn));
  SKV_CHECK(check_keys(keys, n, fn));
  SKV_ARG_CHECK(refs || n == 0, SKV_SUBSYS_KV, "%s: refs is NULL with n=%zu", fn, n);
  SKV_CHECK(check_owner(kv, fn));
  const uint32_t me = (uint32_t)kv->pool.me;
  for (size_t i = 0; i < n; i++) refs[i] = (skv_page_ref_t){me, 0, 0, 0};
  if (n == 0) return 0;
  tidy(kv);
  size_t got = 0;
  bool full = false;
  /* the keys cached already are a use of their pages, all before the first allocation, so that
   * none of this call's evictions takes one of them, whatever the keys' order */
  const uint64_t now = skv__now_ns();
  for (size_t i = 0; i < n; i++) {
    if (i + PUB_AHEAD < n) skv__index_prefetch(&kv->index, keys[i + PUB_AHEAD]);
    touch_cached(kv, keys[i], now);
  }
  for (size_t i = 0; i < n && !full; i++) {
    uint64_t val;
    if (i + PUB_AHEAD < n) skv__index_prefetch(&kv->index, keys[i + PUB_AHEAD]);
    if (skv__index_lookup(&kv->index, keys[i], &val) == 0) continue; /* cached already */
    uint32_t page, gen;
    uint64_t ev = 0;
    if (skv__pool_alloc(&kv->pool, skv__kv_evict_cb, kv, &page, &gen, &ev) != 0) {
      full = true; /* every page pinned or being written: the rest stay unreserved */
      SKV_INFO(SKV_SUBSYS_KV, "%s: no page for key %zu of %zu (all pinned or being written)", fn, i,
               n);
      break;
    }
    refs[i] = (skv_page_ref_t){me, page, skv__pool_gen(&kv->pool, me, page), 0};
    got++;
  }
  if (nreserved) *nreserved = got;
  return 0;
}

int skv_kv_write(skv_kv_t *kv, const skv_page_ref_t *refs, size_t n, const skv_layout_t *src,
                 const uint64_t *block_ids, void *stream) {
  const char *fn = "skv_kv_write";
  KV_CHECK_NULL(kv, "skv_kv_write");
  SKV_CHECK(check_layout(kv, src, block_ids, n, fn));
  SKV_CHECK(check_owner(kv, fn));
  if (n == 0) return 0;
  int path;
  SKV_CHECK(choose_path(kv, src, &path, fn));
#ifdef SKV_WITH_CUDA
  if (path != PATH_HOST) {
    bool capturing;
    SKV_CHECK(skv__kvc_begin(kv->cuda, stream, &capturing, false));
    if (capturing)
      return SKV_FAIL(SKV_ECAPTURE, SKV_SUBSYS_KV,
                      "%s cannot be captured in a CUDA graph: a replay would write into pages "
                      "that may have been committed, evicted and reused since",
                      fn);
    if (path == PATH_DEVICE) SKV_CHECK(skv__kvc_check(kv->cuda, src, SKV__KV_PUBLISH, fn));
  }
#endif
  uint32_t *pages = malloc(n * sizeof *pages);
  size_t *idx = malloc(n * sizeof *idx);
  int rc = 0;
  size_t k = 0;
  if (!pages || !idx)
    rc = SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_KV, "%s: out of memory for %zu pages", fn, n);
  if (rc == 0) rc = reserved_refs(kv, refs, n, pages, idx, NULL, &k, fn);
  const uint32_t me = (uint32_t)kv->pool.me, m = src->blocks_per_page;
  if (rc == 0 && k > 0 && path == PATH_HOST) {
    const bool nt = (uint64_t)k * skv__layout_page_bytes(src) >= SKV_COPY_STREAM_BYTES;
    for (size_t q = 0; q < k; q++)
      skv__copy_blocks_to_page(src, (char *)skv__kv_page(kv, me, pages[q]) + src->page_off,
                               block_ids + idx[q] * m, nt);
    if (nt) skv__copy_stream_fence();
  }
#ifdef SKV_WITH_CUDA
  if (rc == 0 && k > 0 && path == PATH_STAGED) {
    const uint64_t lb = skv__layout_page_bytes(src);
    const size_t per = skv__kvc_stage_pages(kv->cuda);
    char *buf = malloc(SKV_MIN(k, per) * lb);
    if (!buf)
      rc = SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_KV, "%s: out of memory for a staging buffer", fn);
    for (size_t off = 0; rc == 0 && off < k; off += per) {
      const size_t c = SKV_MIN(per, k - off);
      for (size_t q = 0; q < c; q++)
        skv__copy_blocks_to_page(src, buf + q * lb, block_ids + idx[off + q] * m, false);
      const skv__kv_batch_t b = {
          .dir = SKV__KV_WRITE, .n = c, .pe = &me, .page = pages + off, .page_step = 1};
      rc = skv__kvc_write_pages(kv->cuda, &b, src->page_off, lb, buf, stream, fn);
    }
    free(buf);
  }
  if (rc == 0 && k > 0 && path == PATH_DEVICE) {
    const skv__kv_batch_t b = {
        .dir = SKV__KV_WRITE, .n = k, .pe = &me, .page = pages, .page_step = 1};
    size_t queued = 0;
    rc = skv__kvc_copy(kv->cuda, &b, src, block_ids, idx, stream, &queued, fn);
  }
#else
  SKV_UNUSED(stream);
#endif
  free(pages);
  free(idx);
  return rc;
}

/* Commit (keys) or abort (keys NULL) reserved pages. */
static int finish_reserved(skv_kv_t *kv, const skv_key_t *keys, const skv_page_ref_t *refs,
                           size_t n, void *stream, size_t *ninserted, const char *fn) {
  SKV_CHECK(check_owner(kv, fn));
  if (n == 0) return 0;
  uint32_t *pages = malloc(n * sizeof *pages), *gens = malloc(n * sizeof *gens);
  size_t *idx = malloc(n * sizeof *idx);
  skv_key_t *pk = keys ? malloc(n * sizeof *pk) : NULL;
  int rc = 0;
  size_t k = 0;
  if (!pages || !gens || !idx || (keys && !pk))
    rc = SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_KV, "%s: out of memory for %zu pages", fn, n);
  if (rc == 0) rc = reserved_refs(kv, refs, n, pages, idx, gens, &k, fn);
  for (size_t q = 0; rc == 0 && keys && q < k; q++) pk[q] = keys[idx[q]];
  bool done = false;
#ifdef SKV_WITH_CUDA
  /* pages a GPU may still be writing (cuda, or cuda_host pages written by the kernels):
   * ordered after what the stream holds */
  if (rc == 0 && k > 0 && kv->cuda) {
    bool capturing;
    rc = skv__kvc_begin(kv->cuda, stream, &capturing, true);
    if (rc == 0 && capturing)
      rc = SKV_FAIL(SKV_ECAPTURE, SKV_SUBSYS_KV, "%s cannot be captured in a CUDA graph", fn);
    if (rc == 0) {
      /* READY but not indexed (no one can find, pin or evict them; a second commit, abort or
       * write is refused) until the completion indexes or frees them */
      for (size_t q = 0; q < k; q++)
        skv__pool_ready(&kv->pool, pages[q], keys ? pk[q].hi : 0, keys ? pk[q].lo : 0);
      const uint32_t me = (uint32_t)kv->pool.me;
      const skv__kv_batch_t b = {.dir = keys ? SKV__KV_COMMIT : SKV__KV_ABORT,
                                 .n = k,
                                 .pe = &me,
                                 .page = pages,
                                 .page_step = 1,
                                 .keys = pk};
      size_t queued = 0;
      rc = skv__kvc_mark(kv->cuda, &b, stream, &queued, fn);
      /* pages not queued may still be written by work on the stream: not freed here, but
       * given back as reservations (commit or abort them again; a detach frees them) */
      unclaim(kv, pages + queued, gens + queued, k - queued);
      if (ninserted) *ninserted = queued;
    } else {
      unclaim(kv, pages, gens, k);
    }
    done = true;
  }
#else
  SKV_UNUSED(stream);
#endif
  if (rc == 0 && !done) {
    size_t ins = 0;
    if (keys)
      ins = finish_pages(kv, pages, 1, pk, NULL, NULL, k);
    else
      for (size_t q = 0; q < k; q++) skv__pool_release(&kv->pool, pages[q]);
    if (ninserted) *ninserted = ins;
  }
  free(pages);
  free(gens);
  free(idx);
  free(pk);
  return rc;
}

int skv_kv_commit(skv_kv_t *kv, const skv_namespace_t *ns, const skv_key_t *keys, size_t n,
                  const skv_page_ref_t *refs, void *stream, size_t *ninserted) {
  const char *fn = "skv_kv_commit";
  KV_CHECK_NULL(kv, "skv_kv_commit");
  if (ninserted) *ninserted = 0;
  SKV_CHECK(check_ns(kv, ns, fn));
  SKV_CHECK(check_keys(keys, n, fn));
  int rc = finish_reserved(kv, keys, refs, n, stream, ninserted, fn);
  reclaim_ahead(kv);
  return rc;
}

int skv_kv_abort(skv_kv_t *kv, const skv_page_ref_t *refs, size_t n, void *stream) {
  KV_CHECK_NULL(kv, "skv_kv_abort");
  return finish_reserved(kv, NULL, refs, n, stream, NULL, "skv_kv_abort");
}

int skv_kv_evict(skv_kv_t *kv, uint64_t npages, uint64_t *nevicted) {
  KV_CHECK_NULL(kv, "skv_kv_evict");
  uint64_t n = skv__pool_evict(&kv->pool, npages, skv__kv_evict_cb, kv);
  if (nevicted) *nevicted = n;
  return 0;
}

int skv_kv_sync(skv_kv_t *kv) {
  KV_CHECK_NULL(kv, "skv_kv_sync");
#ifdef SKV_WITH_CUDA
  const uint64_t t = skv__kp_now(&kv->prof);
  int rc = skv__kvc_sync(kv->cuda);
  (void)skv__kp_lap(&kv->prof, SKV__KP_SYNC, t);
  return rc;
#else
  return 0;
#endif
}
