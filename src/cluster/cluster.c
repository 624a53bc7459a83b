/* The cluster handle: a node's cache joined to other nodes through a Redis directory and UCX
 * (or node-local when no Redis is configured, or the build has no cluster layer). */
#define _GNU_SOURCE
#include "cluster/cluster.h"
#include "kv/kv.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

struct skv_cluster {
  skv_kv_t *kv;
  int timeout_ms, lease_ms;
  char node[SKV__CL_NAME_CAP], prefix[SKV__CL_NAME_CAP];
  bool remote;
  uint64_t nonce;
  pthread_mutex_t mu; /* lookups and fetches (the fetching worker and its buffer) */
  uint64_t lookups, local_hits, remote_hits, remote_pages, remote_bytes, remote_stale,
      peer_failures;
#if SKV_WITH_CLUSTER
  skv__xfer_t *x;
  skv__dir_t *dir;
  uint64_t *peer_checked_ms; /* [XFER peers]: when the peer's record was last read */
#endif
};

static bool good_name(const char *s) {
  size_t n = strlen(s);
  if (n == 0 || n >= SKV__CL_NAME_CAP) return false;
  for (size_t i = 0; i < n; i++) {
    char c = s[i];
    if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
          c == '_' || c == '-' || c == ':'))
      return false;
  }
  return true;
}

#define CL_CHECK_NULL(cl, fn)                                                 \
  do {                                                                        \
    if (!(cl)) return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_KV, fn ": cl is NULL"); \
  } while (0)

int skv_cluster_join(skv_kv_t *kv, const skv_cluster_opts_t *opts, skv_cluster_t **out) {
  SKV_ARG_CHECK(out, SKV_SUBSYS_KV, "skv_cluster_join: cl is NULL");
  *out = NULL;
  SKV_ARG_CHECK(kv, SKV_SUBSYS_KV, "skv_cluster_join: kv is NULL");
  skv_cluster_opts_t o = SKV_CLUSTER_OPTS_INIT;
  if (opts) {
    SKV_ARG_CHECK(opts->size == sizeof(o) && opts->version == SKV_CLUSTER_OPTS_VERSION,
                  SKV_SUBSYS_KV,
                  "skv_cluster_join: opts has size %zu version %u, this library wants %zu and %u "
                  "(start from SKV_CLUSTER_OPTS_INIT)",
                  opts->size, opts->version, sizeof(o), SKV_CLUSTER_OPTS_VERSION);
    o = *opts;
  }
  SKV_ARG_CHECK(o.flags == 0, SKV_SUBSYS_KV, "skv_cluster_join: opts.flags=0x%x (reserved, 0)",
                o.flags);
  SKV_ARG_CHECK(o.timeout_ms == -1 || (o.timeout_ms >= 1 && o.timeout_ms <= 86400000),
                SKV_SUBSYS_KV, "skv_cluster_join: opts.timeout_ms=%d is not -1 or 1..86400000",
                o.timeout_ms);
  SKV_ARG_CHECK(o.lease_ms == -1 || (o.lease_ms >= 200 && o.lease_ms <= 86400000), SKV_SUBSYS_KV,
                "skv_cluster_join: opts.lease_ms=%d is not -1 or 200..86400000", o.lease_ms);
  SKV_ARG_CHECK(!o.node || good_name(o.node), SKV_SUBSYS_KV,
                "skv_cluster_join: opts.node '%s' is not 1..63 of [A-Za-z0-9._:-]", o.node);
  SKV_ARG_CHECK(!o.cluster || good_name(o.cluster), SKV_SUBSYS_KV,
                "skv_cluster_join: opts.cluster '%s' is not 1..63 of [A-Za-z0-9._:-]", o.cluster);
  long long lease = o.lease_ms;
  if (lease == -1) SKV_CHECK(skv__env_int(SKV_ENV_CLUSTER_LEASE_MS, 200, 86400000, 10000, &lease));
  const char *url = o.redis_url ? o.redis_url : skv__env(SKV_ENV_REDIS_URL);
  if (url && !*url) url = NULL;

  skv_cluster_t *cl = calloc(1, sizeof(*cl));
  if (!cl) return SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_KV, "skv_cluster_join: out of memory");
  cl->kv = kv;
  cl->timeout_ms = o.timeout_ms > 0 ? o.timeout_ms : skv_ctx_get_timeout_ms(kv->ctx);
  if (cl->timeout_ms <= 0) cl->timeout_ms = 60000;
  cl->lease_ms = (int)lease;
  pthread_mutex_init(&cl->mu, NULL);
  if (o.node)
    snprintf(cl->node, sizeof(cl->node), "%s", o.node);
  else
    snprintf(cl->node, sizeof(cl->node), "%.50s:%d", skv__hostname(), (int)getpid());
  for (char *c = cl->node; *c; c++)
    if (!good_name((char[]){*c, 0})) *c = '_';
  snprintf(cl->prefix, sizeof(cl->prefix), "%s", o.cluster ? o.cluster : "symkv");
  if (!url) {
    SKV_INFO(SKV_SUBSYS_KV,
             "cluster: no Redis URL (opts.redis_url, SKV_REDIS_URL): node '%s' "
             "stays node-local",
             cl->node);
    *out = cl;
    return 0;
  }
#if !SKV_WITH_CLUSTER
  pthread_mutex_destroy(&cl->mu);
  free(cl);
  return SKV_FAIL(SKV_ENOTSUP, SKV_SUBSYS_KV,
                  "skv_cluster_join: a Redis URL (%s) was given, but this symkv was built without "
                  "the cluster layer (SKV_CLUSTER=OFF, or UCX and hiredis were not found: install "
                  "libucx-dev and libhiredis-dev and configure again)",
                  url);
#else
  int rc = 0;
  if (skv__random_bytes(&cl->nonce, sizeof(cl->nonce)) != 0) cl->nonce = skv__now_ns();
  skv__export_t ex = {0};
  const int backend = kv->data->info.backend;
  const bool has_pages = kv->pool.hdr && kv->pool.meta[kv->pool.me] &&
                         !(kv->domain && skv__domain_role(kv->domain) != SKV_ROLE_OWNER);
  if (has_pages && backend == SKV_BACKEND_CUDA) {
    rc = SKV_FAIL(SKV_ENOTSUP, SKV_SUBSYS_KV,
                  "skv_cluster_join: pages in GPU memory are not exported yet (UCX's CUDA "
                  "transports are not used by this version): use SKV_BACKEND_HOST or "
                  "SKV_BACKEND_CUDA_HOST pages, or join as a reader");
    goto fail;
  }
  if (has_pages) {
    ex.pe = (uint32_t)kv->pool.me;
    ex.pages = kv->pool.pages;
    ex.pages_base = skv__kv_page(kv, ex.pe, 0);
    ex.page_stride = kv->page_stride;
    ex.page_bytes = kv->page_bytes;
    ex.meta_base = &kv->pool.meta[ex.pe][0];
    ex.meta_stride = sizeof(skv__page_meta_t);
  } else {
    ex.page_bytes = kv->page_bytes;
  }
  const void *blob;
  size_t blob_len;
  SKV_CHECK_GOTO(skv__xfer_create(&ex, cl->nonce, cl->timeout_ms, &cl->x, &blob, &blob_len), rc,
                 fail);
  skv__dir_params_t dp = {.url = url,
                          .prefix = cl->prefix,
                          .node = cl->node,
                          .nonce = cl->nonce,
                          .timeout_ms = cl->timeout_ms,
                          .lease_ms = cl->lease_ms,
                          .blob = blob,
                          .blob_len = blob_len,
                          .pages = ex.pages,
                          .state_words = ex.pages ? &kv->pool.meta[ex.pe][0].state : NULL,
                          .state_stride = sizeof(skv__page_meta_t),
                          .pe = ex.pe};
  SKV_CHECK_GOTO(skv__dir_create(&dp, &cl->dir), rc, fail);
  cl->peer_checked_ms = calloc(1024, sizeof(uint64_t));
  if (!cl->peer_checked_ms) {
    rc = SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_KV, "skv_cluster_join: out of memory");
    goto fail;
  }
  cl->remote = true;
  SKV_INFO(SKV_SUBSYS_KV,
           "cluster: node '%s' joined '%s' at %s (lease %d ms, %" PRIu64 " pages exported)",
           cl->node, cl->prefix, url, cl->lease_ms, ex.pages);
  *out = cl;
  return 0;
fail:
  if (cl->dir) skv__dir_destroy(cl->dir);
  if (cl->x) skv__xfer_destroy(cl->x);
  free(cl->peer_checked_ms);
  pthread_mutex_destroy(&cl->mu);
  free(cl);
  return rc;
#endif
}

int skv_cluster_leave(skv_cluster_t *cl) {
  CL_CHECK_NULL(cl, "skv_cluster_leave");
#if SKV_WITH_CLUSTER
  if (cl->dir) skv__dir_destroy(cl->dir);
  if (cl->x) skv__xfer_destroy(cl->x);
  free(cl->peer_checked_ms);
#endif
  pthread_mutex_destroy(&cl->mu);
  free(cl);
  return 0;
}

int skv_cluster_publish(skv_cluster_t *cl, const skv_namespace_t *ns, const skv_key_t *keys,
                        size_t n, const skv_layout_t *src, const uint64_t *block_ids, void *stream,
                        size_t *ninserted) {
  CL_CHECK_NULL(cl, "skv_cluster_publish");
  SKV_CHECK(skv_kv_publish(cl->kv, ns, keys, n, src, block_ids, stream, ninserted));
#if SKV_WITH_CLUSTER
  if (!cl->remote || !cl->dir) return 0;
  skv_kv_t *kv = cl->kv;
  if (src && src->device >= 0) SKV_CHECK(skv_kv_sync(kv)); /* inserts of stream-ordered copies */
  const uint32_t me = (uint32_t)kv->pool.me;
  for (size_t i = 0; i < n; i++) {
    uint64_t val;
    size_t h = 0;
    skv__index_lookup_prefix(&kv->index, &keys[i], 1, &val, &h);
    if (h == 1 && skv__val_pe(val) == me)
      skv__dir_track(cl->dir, skv__val_page(val), keys[i], skv__val_gen(val));
  }
#endif
  return 0;
}

int skv_cluster_flush(skv_cluster_t *cl) {
  CL_CHECK_NULL(cl, "skv_cluster_flush");
#if SKV_WITH_CLUSTER
  if (cl->dir) return skv__dir_flush(cl->dir);
#endif
  return 0;
}

#if SKV_WITH_CLUSTER
/* The peer number of an entry's node, reading its record when unknown or when it was read more
 * than a third of a lease ago (a node that left or restarted is noticed). false: no live node
 * of that incarnation (the prefix ends there). Under cl->mu. */
static int resolve_peer(skv_cluster_t *cl, const skv__dir_val_t *v, uint32_t *peer) {
  const uint32_t np = skv__xfer_npeers(cl->x);
  uint64_t now = skv__now_ms();
  for (uint32_t i = 0; i < np; i++) {
    /* a peer is identified by name and nonce; the record's nonce is checked by xfer_peer */
    const char *name = skv__xfer_peer_name(cl->x, i);
    if (strcmp(name, v->node) != 0 || skv__xfer_peer_nonce(cl->x, i) != v->nonce) continue;
    if (now - cl->peer_checked_ms[i] < (uint64_t)cl->lease_ms / 3) {
      /* known, and its record was there a moment ago; one that failed is a miss until then */
      *peer = i;
      return skv__xfer_peer_failed(cl->x, i) ? 0 : 1;
    }
  }
  void *blob = NULL;
  size_t len = 0;
  int rc = skv__dir_node(cl->dir, v->node, &blob, &len);
  if (rc == SKV_ENOTFOUND) return 0;
  if (rc) return rc;
  uint32_t p;
  rc = skv__xfer_peer(cl->x, v->node, blob, len, &p);
  free(blob);
  if (rc) return rc;
  if (p < 1024) cl->peer_checked_ms[p] = now;
  /* the record is being renewed: a peer that failed earlier may be tried again */
  if (skv__xfer_peer_nonce(cl->x, p) == v->nonce) skv__xfer_peer_retry(cl->x, p);
  *peer = p;
  return 1;
}

static uint64_t peer_nonce_of(skv_cluster_t *cl, uint32_t peer);
#endif

int skv_cluster_lookup(skv_cluster_t *cl, const skv_namespace_t *ns, const skv_key_t *keys,
                       size_t n, uint32_t flags, skv_cluster_ref_t *refs, size_t *nlocal,
                       size_t *nhit) {
  CL_CHECK_NULL(cl, "skv_cluster_lookup");
  SKV_ARG_CHECK(nlocal && nhit, SKV_SUBSYS_KV, "skv_cluster_lookup: nlocal or nhit is NULL");
  *nlocal = *nhit = 0;
  SKV_ARG_CHECK(refs || n == 0, SKV_SUBSYS_KV, "skv_cluster_lookup: refs is NULL with n=%zu", n);
  /* the node's own index first; refs doubles as skv_page_ref_t storage (same size and order) */
  _Static_assert(sizeof(skv_cluster_ref_t) == sizeof(skv_page_ref_t), "ref sizes");
  size_t h = 0;
  SKV_CHECK(skv_kv_lookup(cl->kv, ns, keys, n, flags, (skv_page_ref_t *)refs, &h));
  for (size_t i = 0; i < h; i++) {
    skv_page_ref_t r;
    memcpy(&r, &refs[i], sizeof(r));
    refs[i] = (skv_cluster_ref_t){SKV_NODE_LOCAL, r.pe, r.page, r.gen};
  }
  *nlocal = *nhit = h;
  __atomic_add_fetch(&cl->lookups, n, __ATOMIC_RELAXED);
  __atomic_add_fetch(&cl->local_hits, h, __ATOMIC_RELAXED);
#if SKV_WITH_CLUSTER
  if (!cl->remote || h == n) return 0;
  size_t m = n - h;
  skv__dir_val_t *vals = malloc(m * sizeof(*vals));
  bool *found = malloc(m * sizeof(*found));
  if (!vals || !found) {
    free(vals), free(found);
    return SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_KV, "skv_cluster_lookup: out of memory");
  }
  int rc = skv__dir_mget(cl->dir, keys + h, m, vals, found);
  size_t r = 0;
  if (!rc) {
    pthread_mutex_lock(&cl->mu);
    for (; r < m && found[r]; r++) {
      if (strcmp(vals[r].node, cl->node) == 0) break; /* ours, evicted here: a miss */
      uint32_t peer = UINT32_MAX;
      int ok = resolve_peer(cl, &vals[r], &peer);
      if (ok < 0) {
        if (ok == SKV_ECONN) rc = ok;
        break;
      }
      if (ok == 0 && skv__xfer_npeers(cl->x) > 0 && peer < skv__xfer_npeers(cl->x) &&
          skv__xfer_peer_failed(cl->x, peer) && peer_nonce_of(cl, peer) == vals[r].nonce)
        break; /* a peer that failed a moment ago: a miss, the entry stays (it may come back) */
      if (ok == 0 || peer_nonce_of(cl, peer) != vals[r].nonce) {
        /* the node left (no record) or restarted (another nonce): the entry is old */
        skv__dir_forget(cl->dir, keys[h + r], &vals[r]);
        break;
      }
      refs[h + r] = (skv_cluster_ref_t){peer, vals[r].pe, vals[r].page, vals[r].gen};
    }
    pthread_mutex_unlock(&cl->mu);
  }
  free(vals), free(found);
  *nhit = h + r;
  __atomic_add_fetch(&cl->remote_hits, r, __ATOMIC_RELAXED);
  return rc;
#else
  return 0;
#endif
}

#if SKV_WITH_CLUSTER
/* The nonce a peer's record carries (xfer keeps the record). */
static uint64_t peer_nonce_of(skv_cluster_t *cl, uint32_t peer) {
  return skv__xfer_peer_nonce(cl->x, peer);
}

/* Where the pages of a peer's batch go: their blocks in `dst`. */
typedef struct fetch_sink {
  skv_cluster_t *cl;
  const skv_layout_t *dst;
  const uint64_t *block_ids;
  const size_t *idx; /* refs of this peer (of the chunk being read) */
  uint64_t pb;
  bool nt;
} fetch_sink_t;

static void fetch_deliver(void *arg, size_t first, size_t count, const void *bytes) {
  const fetch_sink_t *f = arg;
  const uint32_t m = f->dst->blocks_per_page;
  for (size_t j = 0; j < count; j++)
    skv__copy_page_to_blocks(f->dst, (const char *)bytes + j * f->pb,
                             f->block_ids + f->idx[first + j] * m, f->nt);
  __atomic_add_fetch(&f->cl->remote_pages, count, __ATOMIC_RELAXED);
  __atomic_add_fetch(&f->cl->remote_bytes, count * f->pb, __ATOMIC_RELAXED);
}

/* Remote pages of one peer: a pipeline of gets into the staging slots (xfer.c), each checked
 * sub-batch copied into its blocks while the next ones are on the wire. */
static int fetch_peer(skv_cluster_t *cl, uint32_t peer, const skv_cluster_ref_t *refs,
                      const size_t *idx, size_t k, const skv_layout_t *dst,
                      const uint64_t *block_ids) {
  const uint64_t pb = skv__xfer_page_bytes(cl->x, peer);
  if (pb != cl->kv->page_bytes)
    return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_KV,
                    "skv_cluster_fetch: node '%s' has pages of %" PRIu64
                    " bytes, this cache %" PRIu64 " (another geometry)",
                    skv__xfer_peer_name(cl->x, peer), pb, cl->kv->page_bytes);
  uint32_t pages[256], gens[256];
  fetch_sink_t f = {.cl = cl,
                    .dst = dst,
                    .block_ids = block_ids,
                    .pb = pb,
                    .nt = k * pb >= SKV_COPY_STREAM_BYTES};
  int rc = 0;
  for (size_t done = 0; done < k && !rc;) {
    size_t c = SKV_MIN(k - done, SKV_ARRAY_LEN(pages));
    for (size_t j = 0; j < c; j++) {
      pages[j] = refs[idx[done + j]].page;
      gens[j] = refs[idx[done + j]].gen;
    }
    size_t bad = 0;
    f.idx = idx + done;
    rc = skv__xfer_get_pages(cl->x, peer, pages, gens, c, fetch_deliver, &f, &bad);
    if (rc == SKV_ESTALE) __atomic_add_fetch(&cl->remote_stale, 1, __ATOMIC_RELAXED);
    if (rc == SKV_EPEERDEAD) __atomic_add_fetch(&cl->peer_failures, 1, __ATOMIC_RELAXED);
    done += c;
  }
  if (f.nt) skv__copy_stream_fence();
  return rc;
}
#endif

int skv_cluster_fetch(skv_cluster_t *cl, const skv_cluster_ref_t *refs, size_t n,
                      const skv_layout_t *dst, const uint64_t *block_ids, uint32_t flags,
                      void *stream) {
  CL_CHECK_NULL(cl, "skv_cluster_fetch");
  SKV_ARG_CHECK(refs || n == 0, SKV_SUBSYS_KV, "skv_cluster_fetch: refs is NULL with n=%zu", n);
  SKV_ARG_CHECK(dst && (block_ids || n == 0), SKV_SUBSYS_KV,
                "skv_cluster_fetch: dst or block_ids is NULL");
  if (n == 0) return 0;
  /* local references: one skv_kv_fetch, in the order given */
  size_t nl = 0, nr = 0;
  for (size_t i = 0; i < n; i++) {
    if (refs[i].node == SKV_NODE_LOCAL)
      nl++;
    else
      nr++;
  }
  if (nr == 0) { /* node-local: skv_kv_fetch as it is */
    skv_page_ref_t small[64], *lr = n <= 64 ? small : malloc(n * sizeof(*lr));
    if (!lr) return SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_KV, "skv_cluster_fetch: out of memory");
    for (size_t i = 0; i < n; i++)
      lr[i] = (skv_page_ref_t){refs[i].pe, refs[i].page, refs[i].gen, 0};
    int rc = skv_kv_fetch(cl->kv, lr, n, dst, block_ids, flags, stream);
    if (lr != small) free(lr);
    return rc;
  }
#if !SKV_WITH_CLUSTER
  return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_KV,
                  "skv_cluster_fetch: a reference names node %u, but this build is node-local",
                  refs[0].node == SKV_NODE_LOCAL ? 0u : refs[0].node);
#else
  if (!cl->remote)
    return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_KV,
                    "skv_cluster_fetch: a reference names a peer node, but this handle is "
                    "node-local (no Redis URL)");
  const uint32_t m = dst->blocks_per_page;
  SKV_ARG_CHECK(dst->num_layers == dst->geom.num_layers, SKV_SUBSYS_KV,
                "skv_cluster_fetch: remote pages into a layout of layers [%u, %u) of %u are not "
                "supported yet: fetch them with a layout of every layer",
                dst->first_layer, dst->first_layer + dst->num_layers, dst->geom.num_layers);
  SKV_ARG_CHECK(dst->device < 0, SKV_SUBSYS_KV,
                "skv_cluster_fetch: remote pages into a GPU layout are not supported yet (UCX's "
                "CUDA transports are not used by this version): fetch into a host layout");
  SKV_ARG_CHECK((flags & ~(uint32_t)SKV_FETCH_UNPIN) == 0, SKV_SUBSYS_KV,
                "skv_cluster_fetch: unknown flags 0x%x", flags);
  SKV_CHECK(skv__check_block_ids(dst, block_ids, n, "skv_cluster_fetch"));
  size_t *idx = malloc(n * sizeof(*idx));
  skv_page_ref_t *lrefs = malloc((nl ? nl : 1) * sizeof(*lrefs));
  uint64_t *lblocks = malloc((nl ? nl : 1) * m * sizeof(*lblocks));
  if (!idx || !lrefs || !lblocks) {
    free(idx), free(lrefs), free(lblocks);
    return SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_KV, "skv_cluster_fetch: out of memory");
  }
  int rc = 0;
  pthread_mutex_lock(&cl->mu);
  for (size_t i = 0; i < n; i++)
    if (refs[i].node != SKV_NODE_LOCAL && refs[i].node >= skv__xfer_npeers(cl->x)) {
      rc = SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_KV,
                    "skv_cluster_fetch: refs[%zu] names node %u, this handle knows %u", i,
                    refs[i].node, skv__xfer_npeers(cl->x));
      goto out;
    }
  /* remote pages first, a batch per peer node, then the local ones (their pins are released by
   * skv_kv_fetch, also when a remote batch failed: see below) */
  {
    uint32_t np = skv__xfer_npeers(cl->x);
    for (uint32_t p = 0; p < np && !rc; p++) {
      size_t k = 0;
      for (size_t i = 0; i < n; i++)
        if (refs[i].node == p) idx[k++] = i;
      if (k) rc = fetch_peer(cl, p, refs, idx, k, dst, block_ids);
    }
  }
out:
  pthread_mutex_unlock(&cl->mu);
  if (nl) {
    size_t j = 0;
    for (size_t i = 0; i < n; i++)
      if (refs[i].node == SKV_NODE_LOCAL) {
        lrefs[j] = (skv_page_ref_t){refs[i].pe, refs[i].page, refs[i].gen, 0};
        memcpy(lblocks + j * m, block_ids + i * m, m * sizeof(*lblocks));
        j++;
      }
    if (!rc) {
      rc = skv_kv_fetch(cl->kv, lrefs, nl, dst, lblocks, flags, stream);
    } else if (flags & SKV_FETCH_UNPIN) {
      char saved[512];
      snprintf(saved, sizeof(saved), "%s", skv_last_error());
      (void)skv_kv_unpin(cl->kv, lrefs, nl); /* the caller's pins go as promised */
      skv__error_restore(saved);
    }
  }
  free(idx), free(lrefs), free(lblocks);
  return rc;
#endif
}

int skv_cluster_get_stats(const skv_cluster_t *cl, skv_cluster_stats_t *st) {
  CL_CHECK_NULL(cl, "skv_cluster_get_stats");
  SKV_ARG_CHECK(
      st && st->size == sizeof(*st), SKV_SUBSYS_KV,
      "skv_cluster_get_stats: stats is NULL or its size is not sizeof(skv_cluster_stats_t) "
      "(start from SKV_CLUSTER_STATS_INIT)");
  skv_cluster_stats_t s = SKV_CLUSTER_STATS_INIT;
#if SKV_WITH_CLUSTER
  if (cl->dir) {
    skv__dir_counters_t c;
    skv__dir_counters(cl->dir, &c);
    s.exported_pages = c.exported;
    s.dir_puts = c.puts;
    s.dir_dels = c.dels;
    s.dir_errors = c.errors;
    s.dir_reconnects = c.reconnects;
  }
#endif
  s.lookups = cl->lookups;
  s.local_hits = cl->local_hits;
  s.remote_hits = cl->remote_hits;
  s.remote_pages = cl->remote_pages;
  s.remote_bytes = cl->remote_bytes;
  s.remote_stale = cl->remote_stale;
  s.peer_failures = cl->peer_failures;
  *st = s;
  return 0;
}

const char *skv_cluster_node_name(const skv_cluster_t *cl, uint32_t node) {
  if (!cl) return NULL;
  if (node == SKV_NODE_LOCAL) return cl->node;
#if SKV_WITH_CLUSTER
  if (cl->x) return skv__xfer_peer_name(cl->x, node);
#endif
  return NULL;
}
