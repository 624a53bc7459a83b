/* The node-wide KV cache: collective creation of the page heap and the shared metadata,
 * lookup with pins, publish with deduplication and LRU eviction, fetch (host path here; the
 * CUDA path is kv_cuda.c), stats. */
#define _GNU_SOURCE
#include "kv/kv.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define KV_CHECK_NULL(kv, fn)                                                 \
  do {                                                                        \
    if (!(kv)) return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_KV, fn ": kv is NULL"); \
  } while (0)

static uint64_t next_pow2(uint64_t x) {
  uint64_t p = 1;
  while (p < x) p <<= 1;
  return p;
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
  if (skv__index_erase(&kv->index, k, val) != 0)
    SKV_WARN(SKV_SUBSYS_KV,
             "evicting page %u (generation %u): its index entry was not found; please report "
             "this with the SKV_DEBUG=INFO log",
             page, gen);
  __atomic_add_fetch(&kv->evicted, 1, __ATOMIC_RELAXED);
}

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
  uint64_t stride =
      page_bytes >= 4096 ? SKV_ALIGN_UP(page_bytes, 4096) : SKV_ALIGN_UP(page_bytes, 256);
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
  rc = skv__pool_init(&kv->pool, npes, ctx->local_index, pages, pool_seg);
  if (rc == 0) {
    kv->index.hdr = kv->shard_hdr;
    kv->index.slots = kv->shard_slots;
    skv__index_bind(&kv->index, npes, sps, shard_seg, kv_alive, kv);
  }
#ifdef SKV_WITH_CUDA
  if (rc == 0) rc = skv__kv_cuda_init(kv);
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
  skv__kv_cuda_fini(kv);
#endif
  if (kv->pool.hdr) skv__pool_fini(&kv->pool);
  if (kv->meta) skv_heap_destroy(kv->meta);
  if (kv->data) skv_heap_destroy(kv->data);
  free(kv);
  return rc;
}

int skv_kv_destroy(skv_kv_t *kv) {
  if (!kv) return 0;
  int rc = 0;
#ifdef SKV_WITH_CUDA
  rc = skv__kv_cuda_sync(kv);
  skv__kv_cuda_fini(kv);
#endif
  skv__pool_fini(&kv->pool);
  int r1 = skv_heap_destroy(kv->meta);
  int r2 = skv_heap_destroy(kv->data); /* with the keys of its kv-ready agreement */
  free(kv);
  return rc ? rc : r1 ? r1 : r2;
}

skv_heap_t *skv_kv_heap(const skv_kv_t *kv) {
  return kv ? kv->data : NULL;
}

int skv_kv_get_stats(const skv_kv_t *kv, skv_kv_stats_t *st) {
  KV_CHECK_NULL(kv, "skv_kv_get_stats");
  SKV_ARG_CHECK(st, SKV_SUBSYS_KV, "skv_kv_get_stats: stats is NULL");
  skv_kv_t *k = (skv_kv_t *)kv;
  memset(st, 0, sizeof *st);
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
  if (!skv__geometry_equal(&ns->geom, &kv->geom))
    return SKV_FAIL(
        SKV_EINVAL, SKV_SUBSYS_KV,
        "%s: wrong namespace: it was made for a geometry (layers=%u heads=%u dim=%u elem=%u "
        "page_tokens=%u) other than this cache's (layers=%u heads=%u dim=%u elem=%u "
        "page_tokens=%u)",
        fn, ns->geom.num_layers, ns->geom.num_kv_heads, ns->geom.head_dim, ns->geom.elem_bytes,
        ns->geom.page_tokens, kv->geom.num_layers, kv->geom.num_kv_heads, kv->geom.head_dim,
        kv->geom.elem_bytes, kv->geom.page_tokens);
  return 0;
}

static int check_keys(const skv_key_t *keys, size_t n, const char *fn) {
  if (n && !keys) return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_KV, "%s: keys is NULL with n=%zu", fn, n);
  if (n > (1u << 30))
    return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_KV, "%s: n=%zu keys is unreasonably large", fn, n);
  for (size_t i = 0; i < n; i++)
    if (keys[i].hi == 0)
      return SKV_FAIL(
          SKV_EINVAL, SKV_SUBSYS_KV,
          "%s: key %zu has hi == 0, which no symkv hash produces (use skv_hash_tokens or "
          "skv_key_from_bytes)",
          fn, i);
  return 0;
}

int skv__kv_check_refs(const skv_kv_t *kv, const skv_page_ref_t *refs, size_t n, const char *fn) {
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

int skv_lookup(skv_kv_t *kv, const skv_namespace_t *ns, const skv_key_t *keys, size_t n,
               uint32_t flags, skv_page_ref_t *refs, size_t *nhit) {
  KV_CHECK_NULL(kv, "skv_lookup");
  SKV_ARG_CHECK(nhit, SKV_SUBSYS_KV, "skv_lookup: nhit is NULL");
  *nhit = 0;
  SKV_CHECK(check_ns(kv, ns, "skv_lookup"));
  SKV_CHECK(check_keys(keys, n, "skv_lookup"));
  SKV_ARG_CHECK(refs || n == 0, SKV_SUBSYS_KV, "skv_lookup: refs is NULL with n=%zu", n);
  SKV_ARG_CHECK((flags & ~(uint32_t)SKV_LOOKUP_PIN) == 0, SKV_SUBSYS_KV,
                "skv_lookup: unknown flags 0x%x", flags);
  uint64_t now = skv__now_ns();
  uint64_t vals[256];
  size_t done = 0, stale = 0;
  while (done < n) {
    size_t m = SKV_MIN(n - done, SKV_ARRAY_LEN(vals)), h = 0;
    skv__index_lookup_prefix(&kv->index, keys + done, m, vals, &h);
    size_t j = 0;
    for (; j < h; j++) {
      uint32_t pe = skv__val_pe(vals[j]), page = skv__val_page(vals[j]),
               gen = skv__val_gen(vals[j]);
      if ((flags & SKV_LOOKUP_PIN) && skv__pool_pin(&kv->pool, pe, page, gen) != 0) {
        stale++; /* evicted between the index read and the pin: a miss */
        break;
      }
      skv__pool_touch(&kv->pool, pe, page, now);
      refs[done + j] = (skv_page_ref_t){pe, page, gen, 0};
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

int skv_unpin(skv_kv_t *kv, const skv_page_ref_t *refs, size_t n) {
  KV_CHECK_NULL(kv, "skv_unpin");
  SKV_CHECK(skv__kv_check_refs(kv, refs, n, "skv_unpin"));
  int rc = 0;
  for (size_t i = 0; i < n; i++) {
    int r = skv__pool_unpin(&kv->pool, refs[i].pe, refs[i].page);
    if (r && !rc) rc = r;
  }
  return rc;
}

static int check_layout(const skv_kv_t *kv, const skv_layout_t *lay, const uint64_t *block_ids,
                        size_t n, const char *fn) {
  if (!lay) return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_KV, "%s: layout is NULL", fn);
  if (!skv__geometry_equal(&lay->geom, &kv->geom))
    return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_KV,
                    "%s: the layout was made for another geometry than this cache's", fn);
  return skv__check_block_ids(lay, block_ids, n, fn);
}

static bool needs_cuda(const skv_kv_t *kv, const skv_layout_t *lay) {
  return lay->device >= 0 || kv->data->info.backend == SKV_BACKEND_CUDA;
}

static int no_cuda_path(const skv_kv_t *kv, const skv_layout_t *lay, const char *fn) {
  if (kv->data->info.backend == SKV_BACKEND_HOST)
    return SKV_FAIL(SKV_ENOTSUP, SKV_SUBSYS_KV,
                    "%s: a GPU layout cannot use pages of the host backend; create the cache with "
                    "SKV_BACKEND_CUDA_HOST to keep pages in host memory that GPUs can read",
                    fn);
  return SKV_FAIL(SKV_ENOTSUP, SKV_SUBSYS_KV, "%s: GPU pages or layouts need a build with CUDA",
                  fn);
}

int skv_fetch(skv_kv_t *kv, const skv_page_ref_t *refs, size_t n, const skv_layout_t *dst,
              const uint64_t *block_ids, uint32_t flags, void *stream) {
  KV_CHECK_NULL(kv, "skv_fetch");
  SKV_CHECK(skv__kv_check_refs(kv, refs, n, "skv_fetch"));
  SKV_CHECK(check_layout(kv, dst, block_ids, n, "skv_fetch"));
  SKV_ARG_CHECK((flags & ~(uint32_t)SKV_FETCH_UNPIN) == 0, SKV_SUBSYS_KV,
                "skv_fetch: unknown flags 0x%x", flags);
  if (n == 0) return 0;
  if (needs_cuda(kv, dst) &&
      !(dst->device < 0 && kv->data->info.backend == SKV_BACKEND_CUDA_HOST)) {
#ifdef SKV_WITH_CUDA
    if (kv->data->info.backend != SKV_BACKEND_HOST)
      return skv__kv_cuda_fetch(kv, refs, n, dst, block_ids, flags, stream);
#endif
    return no_cuda_path(kv, dst, "skv_fetch");
  }
  /* Host path: pin everything first so that a stale reference fails before any write. */
  for (size_t i = 0; i < n; i++) {
    if (skv__pool_pin(&kv->pool, refs[i].pe, refs[i].page, refs[i].gen) != 0) {
      for (size_t j = 0; j < i; j++) skv__pool_unpin(&kv->pool, refs[j].pe, refs[j].page);
      __atomic_add_fetch(&kv->stale, 1, __ATOMIC_RELAXED);
      return SKV_FAIL(
          SKV_ESTALE, SKV_SUBSYS_KV,
          "skv_fetch: reference %zu (PE %u, page %u, generation %u) is stale: the page was evicted "
          "or reused; nothing was copied. Look the keys up again (pin them to keep them)",
          i, refs[i].pe, refs[i].page, refs[i].gen);
    }
  }
  uint32_t m = dst->blocks_per_page;
  bool nt = (uint64_t)n * kv->page_bytes >= SKV_COPY_STREAM_BYTES;
  for (size_t i = 0; i < n; i++)
    skv__copy_page_to_blocks(dst, skv__kv_page(kv, refs[i].pe, refs[i].page), block_ids + i * m,
                             nt);
  if (nt) skv__copy_stream_fence();
  for (size_t i = 0; i < n; i++) skv__pool_unpin(&kv->pool, refs[i].pe, refs[i].page);
  if (flags & SKV_FETCH_UNPIN) SKV_CHECK(skv_unpin(kv, refs, n));
  return 0;
}

int skv_publish(skv_kv_t *kv, const skv_namespace_t *ns, const skv_key_t *keys, size_t n,
                const skv_layout_t *src, const uint64_t *block_ids, void *stream,
                size_t *ninserted) {
  KV_CHECK_NULL(kv, "skv_publish");
  if (ninserted) *ninserted = 0;
  SKV_CHECK(check_ns(kv, ns, "skv_publish"));
  SKV_CHECK(check_keys(keys, n, "skv_publish"));
  SKV_CHECK(check_layout(kv, src, block_ids, n, "skv_publish"));
  if (n == 0) return 0;
  if (needs_cuda(kv, src) &&
      !(src->device < 0 && kv->data->info.backend == SKV_BACKEND_CUDA_HOST)) {
#ifdef SKV_WITH_CUDA
    if (kv->data->info.backend != SKV_BACKEND_HOST)
      return skv__kv_cuda_publish(kv, keys, n, src, block_ids, stream, ninserted);
#endif
    return no_cuda_path(kv, src, "skv_publish");
  }
  uint32_t m = src->blocks_per_page;
  bool nt = (uint64_t)n * kv->page_bytes >= SKV_COPY_STREAM_BYTES;
  int me = kv->pool.me;
  size_t inserted = 0;
  int rc = 0;
  for (size_t i = 0; i < n && rc == 0; i++) {
    uint64_t val;
    if (skv__index_lookup(&kv->index, keys[i], &val) == 0) continue; /* cached already */
    uint32_t page, gen;
    uint64_t ev = 0;
    rc = skv__pool_alloc(&kv->pool, skv__kv_evict_cb, kv, &page, &gen, &ev);
    if (rc) break;
    skv__copy_blocks_to_page(src, skv__kv_page(kv, (uint32_t)me, page), block_ids + i * m, nt);
    if (nt) skv__copy_stream_fence(); /* the page must be complete before it is indexed */
    skv__pool_ready(&kv->pool, page, keys[i].hi, keys[i].lo);
    int r = skv__index_insert(&kv->index, keys[i], skv__val_pack((uint32_t)me, page, gen), me);
    if (r == 0) {
      skv__pool_commit(&kv->pool, page);
      inserted++;
    } else {
      skv__pool_release(&kv->pool, page);
      if (r == SKV_EEXIST) {
        __atomic_add_fetch(&kv->deduplicated, 1, __ATOMIC_RELAXED);
      } else {
        /* No free slot in the key's window: the page is simply not cached (a cache may drop
         * entries); counted, and explained once. */
        if (__atomic_fetch_add(&kv->index_full, 1, __ATOMIC_RELAXED) == 0)
          SKV_WARN(SKV_SUBSYS_KV,
                   "skv_publish: a key found no free index slot near its home and was not cached; "
                   "if this happens often, create the cache with more index_slots");
      }
    }
  }
  __atomic_add_fetch(&kv->published, inserted, __ATOMIC_RELAXED);
  if (ninserted) *ninserted = inserted;
  return rc;
}

int skv_evict(skv_kv_t *kv, uint64_t npages, uint64_t *nevicted) {
  KV_CHECK_NULL(kv, "skv_evict");
  uint64_t n = skv__pool_evict(&kv->pool, npages, skv__kv_evict_cb, kv);
  if (nevicted) *nevicted = n;
  return 0;
}

int skv_kv_sync(skv_kv_t *kv) {
  KV_CHECK_NULL(kv, "skv_kv_sync");
#ifdef SKV_WITH_CUDA
  return skv__kv_cuda_sync(kv);
#else
  return 0;
#endif
}
