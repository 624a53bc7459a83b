/* The cluster handle: a node's cache joined to other nodes through a Redis directory and UCX
 * (or node-local when no Redis is configured, or the build has no cluster layer). */
#define _GNU_SOURCE
#include "cluster/cluster.h"
#include "kv/kv.h"
#include "pool/pool.h"
#ifdef SKV_WITH_CUDA
#include "kv/kv_cuda.h"
#endif

#include <stddef.h>
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
  bool exporting; /* this process's pages are in the directory (not SKV_CLUSTER_NO_EXPORT) */
  int gpu_mode;   /* pages for GPU layouts: 1 UCX reads them into GPU memory, 0 into pinned host
                   * memory, -1 as UCX's transports to the peer can (skv__xfer_peer_gpu_direct) */
  uint64_t nonce;
  pthread_mutex_t mu; /* lookups and fetches (the fetching worker and its buffer) */
  uint64_t lookups, local_hits, remote_hits, remote_pages, remote_bytes, remote_stale,
      peer_failures, remote_pins, remote_direct_pages;
#if SKV_WITH_CLUSTER
  skv__xfer_t *x;
  skv__dir_t *dir;
  uint64_t *peer_checked_ms; /* [XFER peers]: when the peer's record was last read */
  /* the remote pins this handle holds, per (peer, page): so that an unpin of a page it does
   * not pin is refused (it would take another node's pin away), under mu. Open addressing,
   * key (peer + 1) << 32 | page, 0 empty; a slot whose count went to 0 keeps its key. */
  uint64_t *pin_key;
  uint32_t *pin_cnt;
  size_t pin_cap, pin_used;
  uint8_t *peer_async; /* [XFER peers]: 0 not known yet, 1 its pages for GPU layouts can be read
                        * by the handle's thread (no CUDA call), 2 they are read by the caller */
  /* stream-ordered remote fetches into GPU layouts ("Stream-ordered remote fetches" below) */
  pthread_mutex_t enq_mu; /* callers enqueueing on their streams, in ticket order (then job_mu) */
  pthread_mutex_t job_mu;
  pthread_cond_t job_cv, job_done_cv;
  pthread_t job_thr;
  bool job_started, job_stop;
  bool job_off; /* synchronous from now on (a driver that cannot hold a stream...) */
  struct cl_job *job_head, *job_tail;
  uint64_t *gate;                           /* the word the callers' streams wait on */
  uint64_t gate_base, job_issued, job_done; /* tickets: the gate says gate_base + job_done */
  int job_rc;                               /* the first failure since skv_cluster_sync */
  char job_msg[512];
  char *ring; /* where the queued fetches' pages land: pinned host memory, CL_RING_BYTES */
  void *ring_mh;
  bool ring_cuda;                /* registered with CUDA here (else by UCX) */
  bool ring_left;                /* left to a read that did not end: never freed */
  uint64_t ring_head, ring_tail; /* [tail, head) of the ring is in use (wrapping) */
  struct cl_region *reg;         /* [CL_JOBS_MAX] the fetches' runs of the ring, oldest first */
  size_t reg0, nreg;
#endif
  pthread_mutex_t pin_mu; /* the pin table: counted without waiting for a read under mu */
};

#define CL_JOBS_MAX   64            /* stream-ordered fetches in flight per handle */
#define CL_RING_BYTES (64ull << 20) /* their pages (a larger fetch is synchronous) */

/* A run of the ring that a queued fetch's pages land in, free once its copies completed. */
typedef struct cl_region {
  uint64_t off, len;
  void *done; /* an event recorded after the copies */
} cl_region_t;

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

static void cl_init_locks(skv_cluster_t *cl) {
  pthread_mutex_init(&cl->mu, NULL);
  pthread_mutex_init(&cl->pin_mu, NULL);
#if SKV_WITH_CLUSTER
  pthread_mutex_init(&cl->enq_mu, NULL);
  pthread_mutex_init(&cl->job_mu, NULL);
  pthread_cond_init(&cl->job_cv, NULL);
  pthread_cond_init(&cl->job_done_cv, NULL);
#endif
}

#if SKV_WITH_CLUSTER
static void jobs_stop(skv_cluster_t *cl);
#endif

/* Everything the handle holds: the queued fetches run first (each wait bounded), so that no
 * stream stays held; then the directory, UCX and the handle. */
static void cl_free(skv_cluster_t *cl) {
#if SKV_WITH_CLUSTER
  jobs_stop(cl);
  if (cl->dir) skv__dir_destroy(cl->dir);
  if (cl->x) skv__xfer_destroy(cl->x);
  free(cl->peer_checked_ms), free(cl->peer_async), free(cl->reg);
  free(cl->pin_key), free(cl->pin_cnt);
  pthread_mutex_destroy(&cl->enq_mu);
  pthread_mutex_destroy(&cl->job_mu);
  pthread_cond_destroy(&cl->job_cv);
  pthread_cond_destroy(&cl->job_done_cv);
#endif
  pthread_mutex_destroy(&cl->pin_mu);
  pthread_mutex_destroy(&cl->mu);
  free(cl);
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
  SKV_ARG_CHECK((o.flags & ~(uint32_t)(SKV_CLUSTER_NO_EXPORT | SKV_CLUSTER_GPU_DIRECT |
                                       SKV_CLUSTER_HOST_STAGING)) == 0,
                SKV_SUBSYS_KV,
                "skv_cluster_join: opts.flags=0x%x has unknown bits (SKV_CLUSTER_NO_EXPORT is "
                "0x%x, SKV_CLUSTER_GPU_DIRECT 0x%x, SKV_CLUSTER_HOST_STAGING 0x%x)",
                o.flags, (unsigned)SKV_CLUSTER_NO_EXPORT, (unsigned)SKV_CLUSTER_GPU_DIRECT,
                (unsigned)SKV_CLUSTER_HOST_STAGING);
  SKV_ARG_CHECK((o.flags & SKV_CLUSTER_GPU_DIRECT) == 0 ||
                    (o.flags & SKV_CLUSTER_HOST_STAGING) == 0,
                SKV_SUBSYS_KV,
                "skv_cluster_join: opts.flags has both SKV_CLUSTER_GPU_DIRECT and "
                "SKV_CLUSTER_HOST_STAGING (at most one; neither: chosen per peer node)");
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
  cl_init_locks(cl);
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
  cl_free(cl);
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
                         !(kv->domain && skv__domain_role(kv->domain) != SKV_ROLE_OWNER) &&
                         !(o.flags & SKV_CLUSTER_NO_EXPORT);
  cl->exporting = has_pages;
  ex.pages_gpu = backend == SKV_BACKEND_CUDA; /* xfer refuses it with a UCX without CUDA */
  if (has_pages) {
    ex.pe = (uint32_t)kv->pool.me;
    ex.pages = kv->pool.pages;
    ex.pages_base = skv__kv_page(kv, ex.pe, 0);
    ex.page_stride = kv->page_stride;
    ex.page_bytes = kv->page_bytes;
    ex.meta_base = &kv->pool.meta[ex.pe][0];
    ex.meta_stride = sizeof(skv__page_meta_t);
    ex.rpins_off = (uint32_t)offsetof(skv__page_meta_t, rpins);
  } else {
    ex.page_bytes = kv->page_bytes;
  }
  const void *blob;
  size_t blob_len;
  SKV_CHECK_GOTO(skv__xfer_create(&ex, cl->nonce, cl->timeout_ms, &cl->x, &blob, &blob_len), rc,
                 fail);
#ifdef SKV_WITH_CUDA
  /* remote pages go to GPU layouts through a staging buffer that the copy kernels read: host
   * memory registered with CUDA, or GPU memory that UCX writes (SKV_CLUSTER_GPU_DIRECT) */
  if (kv->cuda) {
    const skv__xfer_mem_ops_t ops = {.host_register = skv__kvc_host_register,
                                     .gpu_alloc = skv__kvc_dev_alloc,
                                     .gpu_free = skv__kvc_dev_free};
    skv__xfer_set_mem_ops(cl->x, &ops);
  }
#endif
  if (o.flags & SKV_CLUSTER_GPU_DIRECT) {
    if (!kv->cuda || !skv__xfer_cuda(cl->x)) {
      rc = SKV_FAIL(SKV_ENOTSUP, SKV_SUBSYS_KV, "skv_cluster_join: SKV_CLUSTER_GPU_DIRECT needs %s",
                    !kv->cuda ? "a cache with the CUDA backend"
                              : "a UCX that reads GPU memory (built with CUDA, cuda_copy in "
                                "UCX_TLS; docs/cluster.md)");
      goto fail;
    }
    cl->gpu_mode = 1;
  } else {
    /* by default per peer, where pages can be read into GPU memory at all */
    cl->gpu_mode =
        (o.flags & SKV_CLUSTER_HOST_STAGING) || !kv->cuda || !skv__xfer_cuda(cl->x) ? 0 : -1;
  }
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
  cl->peer_async = calloc(1024, 1);
  cl->reg = calloc(CL_JOBS_MAX, sizeof *cl->reg);
  if (!cl->peer_checked_ms || !cl->peer_async || !cl->reg) {
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
  cl_free(cl);
  return rc;
#endif
}

int skv_cluster_leave(skv_cluster_t *cl) {
  CL_CHECK_NULL(cl, "skv_cluster_leave");
  cl_free(cl);
  return 0;
}

int skv_cluster_publish(skv_cluster_t *cl, const skv_namespace_t *ns, const skv_key_t *keys,
                        size_t n, const skv_layout_t *src, const uint64_t *block_ids, void *stream,
                        size_t *ninserted) {
  CL_CHECK_NULL(cl, "skv_cluster_publish");
  SKV_CHECK(skv_kv_publish(cl->kv, ns, keys, n, src, block_ids, stream, ninserted));
#if SKV_WITH_CLUSTER
  if (!cl->remote || !cl->dir || !cl->exporting) return 0;
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

/* Pages of peer `peer` among refs[0..n) (positions into pos[], their pages and generations);
 * how many. */
static size_t refs_of_peer(const skv_cluster_ref_t *refs, size_t n, uint32_t peer, size_t *pos,
                           uint32_t *pages, uint32_t *gens) {
  size_t k = 0;
  for (size_t i = 0; i < n; i++)
    if (refs[i].node == peer) {
      pos[k] = i;
      pages[k] = refs[i].page;
      if (gens) gens[k] = refs[i].gen;
      k++;
    }
  return k;
}

/* The slot of (peer, page) in the pin table, or of where it would go (the table exists). */
static size_t pin_slot(const skv_cluster_t *cl, uint64_t key) {
  size_t i = (size_t)((key * 0x9e3779b97f4a7c15ull) >> 20) & (cl->pin_cap - 1), free_at = SIZE_MAX;
  for (;; i = (i + 1) & (cl->pin_cap - 1)) {
    if (cl->pin_key[i] == key) return i;
    if (cl->pin_key[i] == 0) return free_at != SIZE_MAX ? free_at : i;
    if (cl->pin_cnt[i] == 0 && free_at == SIZE_MAX) free_at = i;
  }
}

static uint64_t pin_key_of(const skv_cluster_ref_t *r) {
  return ((uint64_t)r->node + 1) << 32 | r->page;
}

/* pins_add, under cl->pin_mu. */
static int pins_add_locked(skv_cluster_t *cl, const skv_cluster_ref_t *refs, size_t n) {
  if ((cl->pin_used + n) * 2 > cl->pin_cap) { /* grow: keep the live entries */
    size_t cap = 64;
    while (cap < (cl->pin_used + n) * 4) cap *= 2;
    uint64_t *ok = cl->pin_key;
    uint32_t *oc = cl->pin_cnt;
    const size_t ocap = cl->pin_cap;
    cl->pin_key = calloc(cap, sizeof *cl->pin_key);
    cl->pin_cnt = calloc(cap, sizeof *cl->pin_cnt);
    if (!cl->pin_key || !cl->pin_cnt) {
      free(cl->pin_key), free(cl->pin_cnt);
      cl->pin_key = ok, cl->pin_cnt = oc;
      return SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_KV, "cluster: out of memory for the pin table");
    }
    cl->pin_cap = cap;
    cl->pin_used = 0;
    for (size_t i = 0; i < ocap; i++)
      if (oc[i]) {
        size_t j = pin_slot(cl, ok[i]);
        cl->pin_key[j] = ok[i], cl->pin_cnt[j] = oc[i];
        cl->pin_used++;
      }
    free(ok), free(oc);
  }
  for (size_t i = 0; i < n; i++) {
    if (refs[i].node == SKV_NODE_LOCAL) continue;
    const uint64_t key = pin_key_of(&refs[i]);
    size_t j = pin_slot(cl, key);
    if (cl->pin_key[j] != key) {
      if (cl->pin_key[j] == 0) cl->pin_used++;
      cl->pin_key[j] = key, cl->pin_cnt[j] = 0;
    }
    cl->pin_cnt[j]++;
  }
  return 0;
}

/* Count one more pin of each remote reference of refs[0..n). */
static int pins_add(skv_cluster_t *cl, const skv_cluster_ref_t *refs, size_t n) {
  pthread_mutex_lock(&cl->pin_mu);
  const int rc = pins_add_locked(cl, refs, n);
  pthread_mutex_unlock(&cl->pin_mu);
  return rc;
}

/* Count one pin less of each remote reference of refs[0..n): all, or none and SKV_EINVAL
 * naming a reference this handle does not pin (as often as it is listed). */
static int pins_take(skv_cluster_t *cl, const skv_cluster_ref_t *refs, size_t n, const char *fn) {
  pthread_mutex_lock(&cl->pin_mu);
  size_t i = 0;
  for (; i < n; i++) {
    if (refs[i].node == SKV_NODE_LOCAL) continue;
    size_t j = cl->pin_cap ? pin_slot(cl, pin_key_of(&refs[i])) : 0;
    if (!cl->pin_cap || cl->pin_key[j] != pin_key_of(&refs[i]) || cl->pin_cnt[j] == 0) break;
    cl->pin_cnt[j]--;
  }
  if (i == n) {
    pthread_mutex_unlock(&cl->pin_mu);
    return 0;
  }
  const size_t bad = i;
  while (i-- > 0) /* undo */
    if (refs[i].node != SKV_NODE_LOCAL) cl->pin_cnt[pin_slot(cl, pin_key_of(&refs[i]))]++;
  pthread_mutex_unlock(&cl->pin_mu);
  return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_KV,
                  "%s: refs[%zu] (node '%s', page %u) is not pinned by this handle (pin it with "
                  "skv_cluster_lookup(SKV_LOOKUP_PIN); unpin each pin once): nothing released",
                  fn, bad, skv__xfer_peer_name(cl->x, refs[bad].node), refs[bad].page);
}

/* Every remote reference of refs[0..n) names a peer this handle knows; else SKV_EINVAL naming
 * the first that does not (peers are only ever added: no lock needed). */
static int check_nodes(skv_cluster_t *cl, const skv_cluster_ref_t *refs, size_t n, const char *fn) {
  const uint32_t np = skv__xfer_npeers(cl->x);
  for (size_t i = 0; i < n; i++)
    if (refs[i].node != SKV_NODE_LOCAL && refs[i].node >= np)
      return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_KV,
                      "%s: refs[%zu] names node %u, this handle knows %u", fn, i, refs[i].node, np);
  return 0;
}

/* Send the unpins of the remote references among refs[0..n) (one batch per peer). A peer
 * that cannot be reached keeps them until its lease lapses (pool.h, "Remote pins"). Returns
 * the first failure. Under cl->mu. */
static int unpin_remote(skv_cluster_t *cl, const skv_cluster_ref_t *refs, size_t n) {
  size_t *pos = malloc((n ? n : 1) * sizeof *pos);
  uint32_t *pages = malloc((n ? n : 1) * sizeof *pages);
  int rc = 0;
  if (!pos || !pages) {
    rc = SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_KV, "cluster: out of memory for unpins");
  } else {
    const uint32_t np = skv__xfer_npeers(cl->x);
    for (uint32_t p = 0; p < np; p++) {
      size_t k = refs_of_peer(refs, n, p, pos, pages, NULL);
      int r = k ? skv__xfer_unpin_pages(cl->x, p, pages, k) : 0;
      if (r && !rc) rc = r;
    }
  }
  free(pos), free(pages);
  return rc;
}

/* Pin the remote references refs[0..r) (a lookup's prefix from the directory), one batch per
 * peer; *held: how many leading ones are pinned (a page found evicted, or a peer that cannot
 * be reached, ends the prefix; the pins taken beyond it are given back). Under cl->mu. */
static int pin_remote(skv_cluster_t *cl, const skv_cluster_ref_t *refs, size_t r, size_t *held) {
  *held = 0;
  size_t *pos = malloc(r * sizeof *pos);
  uint32_t *pages = malloc(r * sizeof *pages), *gens = malloc(r * sizeof *gens);
  bool *pinned = calloc(r, sizeof *pinned);
  skv_cluster_ref_t *beyond = malloc(r * sizeof *beyond);
  if (!pos || !pages || !gens || !pinned || !beyond) {
    free(pos), free(pages), free(gens), free(pinned), free(beyond);
    return SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_KV, "skv_cluster_lookup: out of memory");
  }
  int rc = 0;
  size_t cut = r; /* the prefix pinned so far: later peers pin only before it */
  const uint32_t np = skv__xfer_npeers(cl->x);
  for (uint32_t p = 0; p < np && cut > 0; p++) {
    size_t k = refs_of_peer(refs, cut, p, pos, pages, gens);
    if (!k) continue;
    size_t h = 0;
    int prc = skv__xfer_pin_pages(cl->x, p, pages, gens, k, &h);
    if (prc == SKV_EPEERDEAD || prc == SKV_EPROTO) {
      if (prc == SKV_EPEERDEAD) __atomic_add_fetch(&cl->peer_failures, 1, __ATOMIC_RELAXED);
      h = 0; /* a miss from its first page on, as in the lookup itself */
    } else if (prc) {
      if (!rc) rc = prc;
      h = 0;
    }
    for (size_t q = 0; q < h; q++) pinned[pos[q]] = true;
    if (h < k) cut = pos[h];
  }
  /* pins that earlier peers took beyond the final cut */
  size_t nb = 0;
  for (size_t i = cut; i < r; i++)
    if (pinned[i]) beyond[nb++] = refs[i];
  if (nb) (void)unpin_remote(cl, beyond, nb);
  int arc = pins_add(cl, refs, cut);
  if (arc) { /* not counted: not kept either */
    (void)unpin_remote(cl, refs, cut);
    cut = 0;
    if (!rc) rc = arc;
  }
  __atomic_add_fetch(&cl->remote_pins, cut, __ATOMIC_RELAXED);
  free(pos), free(pages), free(gens), free(pinned), free(beyond);
  *held = cut;
  return rc;
}
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
    if (rc) r = 0; /* Redis failed part-way: the node-local hits only (as promised) */
    if (r > 0 && (flags & SKV_LOOKUP_PIN)) {
      size_t held = 0;
      int prc = pin_remote(cl, refs + h, r, &held);
      if (prc && !rc) rc = prc;
      r = held;
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
  uint64_t len;      /* bytes read of each page: the layers of `dst` */
  bool nt;
  void *stream;     /* a GPU layout: the copies' stream */
  bool to_gpu;      /* UCX reads the pages into GPU staging */
  bool landed;      /* the pages land where copies enqueued before wait for them: nothing to copy */
  size_t delivered; /* pages of this peer checked and delivered */
} fetch_sink_t;

/* A checked sub-batch, in the staging buffer: into the blocks, with the host copy of local
 * fetches, or, for a GPU layout, with the copy kernels reading the (CUDA-registered) staging
 * over PCIe, waited for before the slot takes the next sub-batch. */
static int fetch_deliver(void *arg, size_t first, size_t count, const void *bytes) {
  fetch_sink_t *f = arg;
  const uint32_t m = f->dst->blocks_per_page;
  if (f->landed) {
    (void)bytes;
  } else if (f->dst->device >= 0) {
#ifdef SKV_WITH_CUDA
    SKV_CHECK(skv__kvc_copy_in(f->cl->kv->cuda, f->dst, bytes, f->to_gpu, f->len, count,
                               f->block_ids, f->idx + first, f->stream, skv__xfer_progress,
                               f->cl->x, "skv_cluster_fetch"));
#else
    return SKV_FAIL(SKV_ENOTSUP, SKV_SUBSYS_KV, "skv_cluster_fetch: built without CUDA");
#endif
  } else {
    for (size_t j = 0; j < count; j++)
      skv__copy_page_to_blocks(f->dst, (const char *)bytes + j * f->len,
                               f->block_ids + f->idx[first + j] * m, f->nt);
  }
  __atomic_add_fetch(&f->cl->remote_pages, count, __ATOMIC_RELAXED);
  __atomic_add_fetch(&f->cl->remote_bytes, count * f->len, __ATOMIC_RELAXED);
  if (f->to_gpu) __atomic_add_fetch(&f->cl->remote_direct_pages, count, __ATOMIC_RELAXED);
  f->delivered += count;
  return 0;
}

/* Does UCX read the pages of `peer` bound for `dst` into GPU staging? Under cl->mu. */
static bool peer_to_gpu(skv_cluster_t *cl, uint32_t peer, const skv_layout_t *dst) {
  return dst->device >= 0 &&
         (cl->gpu_mode == 1 || (cl->gpu_mode < 0 && skv__xfer_peer_gpu_direct(cl->x, peer)));
}

/* Remote pages of one peer: a pipeline of gets into the staging slots (xfer.c), each checked
 * sub-batch copied into its blocks while the next ones are on the wire. */
static int fetch_peer(skv_cluster_t *cl, uint32_t peer, const skv_cluster_ref_t *refs,
                      const size_t *idx, size_t k, const skv_layout_t *dst,
                      const uint64_t *block_ids, void *stream, const skv__xfer_into_t *into,
                      size_t *delivered) {
  const uint64_t pb = skv__xfer_page_bytes(cl->x, peer);
  if (pb != cl->kv->page_bytes)
    return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_KV,
                    "skv_cluster_fetch: node '%s' has pages of %" PRIu64
                    " bytes, this cache %" PRIu64 " (another geometry)",
                    skv__xfer_peer_name(cl->x, peer), pb, cl->kv->page_bytes);
  uint32_t pages[256], gens[256];
  const uint64_t len = skv__layout_page_bytes(dst); /* only the bytes of dst's layers */
  fetch_sink_t f = {.cl = cl,
                    .dst = dst,
                    .block_ids = block_ids,
                    .len = len,
                    .nt = dst->device < 0 && k * len >= SKV_COPY_STREAM_BYTES,
                    .stream = stream,
                    .to_gpu = !into && peer_to_gpu(cl, peer, dst),
                    .landed = into != NULL};
  int rc = 0;
  for (size_t done = 0; done < k && !rc;) {
    size_t c = SKV_MIN(k - done, SKV_ARRAY_LEN(pages));
    for (size_t j = 0; j < c; j++) {
      pages[j] = refs[idx[done + j]].page;
      gens[j] = refs[idx[done + j]].gen;
    }
    size_t bad = 0;
    f.idx = idx + done;
    const skv__xfer_into_t at = {into ? (char *)into->buf + done * len : NULL,
                                 into ? into->memh : NULL};
    rc = skv__xfer_get_pages(cl->x, peer, pages, gens, c, dst->page_off, len, f.to_gpu,
                             into ? &at : NULL, fetch_deliver, &f, &bad);
    if (rc == SKV_ESTALE) __atomic_add_fetch(&cl->remote_stale, 1, __ATOMIC_RELAXED);
    if (rc == SKV_EPEERDEAD) __atomic_add_fetch(&cl->peer_failures, 1, __ATOMIC_RELAXED);
    done += c;
  }
  if (f.nt) skv__copy_stream_fence();
  if (delivered) *delivered = f.delivered;
  return rc;
}
#endif

#if SKV_WITH_CLUSTER
/* Can remote pages go into `dst`? Its geometry must be the cache's (the bytes read are the
 * cache's page format), and a GPU layout needs the CUDA copy path, on a stream not captured. */
static int remote_dst_check(skv_cluster_t *cl, const skv_layout_t *dst, void *stream) {
  if (!skv__geometry_equal(&dst->geom, &cl->kv->geom))
    return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_KV,
                    "skv_cluster_fetch: the layout was made for another geometry than the "
                    "cache's: remote pages are in the cache's page format");
  if (dst->device < 0) return 0;
#ifdef SKV_WITH_CUDA
  skv__kvc_t *kc = cl->kv->cuda;
  if (!kc)
    return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_KV,
                    "skv_cluster_fetch: remote pages into a GPU layout need a cache with the CUDA "
                    "backend (this one keeps host pages and has no GPU copy path): attach with "
                    "SKV_BACKEND_CUDA, or fetch into a host layout");
  SKV_CHECK(skv__kvc_check(kc, dst, SKV__KV_FETCH, "skv_cluster_fetch"));
  bool capturing = false;
  SKV_CHECK(skv__kvc_begin(kc, stream, &capturing, false));
  if (capturing)
    return SKV_FAIL(SKV_ECAPTURE, SKV_SUBSYS_KV,
                    "skv_cluster_fetch: remote pages cannot be fetched while the stream is being "
                    "captured (they are read over the network when the call runs): fetch them "
                    "before the capture");
  return 0;
#else
  (void)stream;
  return SKV_FAIL(SKV_ENOTSUP, SKV_SUBSYS_KV,
                  "skv_cluster_fetch: a GPU layout, but this symkv was built without CUDA");
#endif
}

/* Release the remote pins among refs[0..n) that this handle holds: every one, or none and
 * SKV_EINVAL (pins_take). Under cl->mu. */
static int release_remote(skv_cluster_t *cl, const skv_cluster_ref_t *refs, size_t n,
                          const char *fn) {
  SKV_CHECK(pins_take(cl, refs, n, fn));
  return unpin_remote(cl, refs, n);
}

/* The remote references of refs[0..n), a batch per peer node, into their blocks (for a GPU
 * layout with the copy kernels on `stream`, each waited for). Under cl->mu. */
static int fetch_remote(skv_cluster_t *cl, const skv_cluster_ref_t *refs, size_t n,
                        const skv_layout_t *dst, const uint64_t *block_ids, void *stream) {
  size_t *idx = malloc(n * sizeof *idx);
  if (!idx) return SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_KV, "skv_cluster_fetch: out of memory");
  int rc = 0;
  const uint32_t np = skv__xfer_npeers(cl->x);
  for (uint32_t p = 0; p < np && !rc; p++) {
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
      if (refs[i].node == p) idx[k++] = i;
    if (k) rc = fetch_peer(cl, p, refs, idx, k, dst, block_ids, stream, NULL, NULL);
  }
  free(idx);
  return rc;
}

/* The pins of the remote references of refs[0..n) given back after their reads
 * (SKV_FETCH_UNPIN), also when they failed with `rc`, whose message stays. Under cl->mu. */
static int unpin_after(skv_cluster_t *cl, const skv_cluster_ref_t *refs, size_t n, int rc) {
  char saved[512];
  snprintf(saved, sizeof(saved), "%s", skv_last_error());
  const int urc = unpin_remote(cl, refs, n);
  if (!rc) return urc;
  skv__error_restore(saved);
  return rc;
}

/* The local references of refs[0..n): one skv_kv_fetch, in the order given; after a failure
 * `rc` of the rest of the call, only their pins released (SKV_FETCH_UNPIN, as promised). */
static int fetch_local(skv_cluster_t *cl, const skv_cluster_ref_t *refs, size_t n,
                       const skv_layout_t *dst, const uint64_t *block_ids, uint32_t flags,
                       void *stream, int rc) {
  const uint32_t m = dst->blocks_per_page;
  size_t nl = 0;
  for (size_t i = 0; i < n; i++) nl += refs[i].node == SKV_NODE_LOCAL;
  if (nl == 0 || (rc && !(flags & SKV_FETCH_UNPIN))) return rc;
  skv_page_ref_t *lrefs = malloc(nl * sizeof(*lrefs));
  uint64_t *lblocks = malloc(nl * m * sizeof(*lblocks));
  if (!lrefs || !lblocks) {
    free(lrefs), free(lblocks);
    return rc ? rc : SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_KV, "skv_cluster_fetch: out of memory");
  }
  size_t j = 0;
  for (size_t i = 0; i < n; i++)
    if (refs[i].node == SKV_NODE_LOCAL) {
      lrefs[j] = (skv_page_ref_t){refs[i].pe, refs[i].page, refs[i].gen, 0};
      memcpy(lblocks + j * m, block_ids + i * m, m * sizeof(*lblocks));
      j++;
    }
  if (!rc) {
    rc = skv_kv_fetch(cl->kv, lrefs, nl, dst, lblocks, flags, stream);
  } else {
    char saved[512];
    snprintf(saved, sizeof(saved), "%s", skv_last_error());
    (void)skv_kv_unpin(cl->kv, lrefs, nl);
    skv__error_restore(saved);
  }
  free(lrefs), free(lblocks);
  return rc;
}

#ifdef SKV_WITH_CUDA
/* ---- Stream-ordered remote fetches ---------------------------------------------------------- */

/* How it works: a fetch into a GPU layout takes a run of the handle's ring (pinned host memory,
 * registered with UCX and CUDA once), and enqueues on the caller's stream, after the local
 * pages' copy: a wait until the handle's gate word reaches the fetch's ticket
 * (cuStreamWaitValue64: the GPU's front end waits, no SM), the copy kernels from the run into
 * the blocks (remote pages grouped by node), and an event that frees the run. The handle's
 * thread reads the pages into the run, as a synchronous fetch would (under mu, a batch per
 * node, each page checked after its bytes), and stores the ticket, whatever happened. It makes
 * no CUDA call, and holds no lock while it stores the ticket: a thread of the caller blocked in
 * CUDA (a cudaMemcpy behind the held stream) can hold what a CUDA call needs, and a first try
 * that copied from this thread deadlocked so. Nodes whose reads could make CUDA calls (UCX
 * writing GPU memory, a CUDA transport such as cuda_ipc, or a UCX with CUDA that cannot tell)
 * are read by the caller, synchronously, as are fetches larger than the ring. The pages that
 * were not read or not found good are filled with 0xFF bytes (NaN in 16-bit floats) before the
 * ticket is stored, so the kernels copy those into their blocks, and skv_cluster_sync returns
 * the failure. Callers enqueue under enq_mu, so that tickets follow the order of the waits on
 * each stream; the job is queued before its copies are enqueued (they may need argument slots
 * that only earlier gates give back). */

typedef struct cl_job {
  struct cl_job *next;
  uint64_t ticket;
  skv_layout_t lay;        /* the caller's layout's scalars (no pointer of it is used) */
  skv_cluster_ref_t *refs; /* the call's remote references, grouped by node */
  size_t n;
  char *run;    /* their pages' place in the ring, page i at run + i * len */
  uint64_t len; /* bytes read of a page: the layers of the layout */
  bool unpin;   /* SKV_FETCH_UNPIN: their pins are given back after the reads */
} cl_job_t;

static void job_free(cl_job_t *j) {
  if (j) free(j->refs), free(j);
}

static int job_run(skv_cluster_t *cl, cl_job_t *j) {
  int rc = 0;
  size_t *idx = malloc(j->n * sizeof *idx);
  if (!idx) rc = SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_KV, "skv_cluster_fetch: out of memory");
  size_t good = 0; /* pages [0, good) of the run are read and checked */
  bool left = false;
  pthread_mutex_lock(&cl->mu);
  for (size_t s = 0; s < j->n && !rc;) {
    const uint32_t p = j->refs[s].node;
    size_t k = 0;
    while (s + k < j->n && j->refs[s + k].node == p) idx[k] = s + k, k++;
    const skv__xfer_into_t into = {j->run + s * j->len, cl->ring_mh};
    size_t got = 0;
    rc = fetch_peer(cl, p, j->refs, idx, k, &j->lay, NULL, NULL, &into, &got);
    left |= skv__xfer_into_left(cl->x);
    good = s + got;
    s += k;
  }
  if (j->unpin) rc = unpin_after(cl, j->refs, j->n, rc);
  pthread_mutex_unlock(&cl->mu);
  free(idx);
  if (good < j->n) memset(j->run + good * j->len, 0xFF, (j->n - good) * j->len);
  if (left) { /* a transfer may still write into the ring: it is left to it */
    pthread_mutex_lock(&cl->job_mu);
    cl->ring_left = true;
    __atomic_store_n(&cl->job_off, true, __ATOMIC_RELAXED);
    pthread_mutex_unlock(&cl->job_mu);
    SKV_WARN(SKV_SUBSYS_KV, "cluster: a read into the fetch ring did not end after a forced "
                            "close; remote fetches are synchronous from now on");
  }
  return rc;
}

static void *job_main(void *arg) {
  skv_cluster_t *cl = arg;
  pthread_mutex_lock(&cl->job_mu);
  for (;;) {
    while (!cl->job_head && !cl->job_stop) pthread_cond_wait(&cl->job_cv, &cl->job_mu);
    cl_job_t *j = cl->job_head;
    if (!j) break; /* stopped, and every queued fetch ran */
    pthread_mutex_unlock(&cl->job_mu);
    const int rc = job_run(cl, j);
    char msg[512] = "";
    if (rc) snprintf(msg, sizeof msg, "%s", skv_last_error());
    /* the streams go on; no lock held (a caller may wait in CUDA under job_mu for what this
     * releases) */
    __atomic_store_n(cl->gate, cl->gate_base + j->ticket, __ATOMIC_RELEASE);
    pthread_mutex_lock(&cl->job_mu);
    if (rc && !cl->job_rc) {
      cl->job_rc = rc;
      memcpy(cl->job_msg, msg, sizeof msg);
    }
    cl->job_head = j->next;
    if (!cl->job_head) cl->job_tail = NULL;
    cl->job_done = j->ticket;
    pthread_cond_broadcast(&cl->job_done_cv);
    job_free(j);
  }
  pthread_mutex_unlock(&cl->job_mu);
  return NULL;
}

/* The gate word, the ring and the thread, once (the caller's device is current). Under
 * enq_mu. */
static int jobs_start(skv_cluster_t *cl) {
  if (cl->job_started) return 0;
  if (!cl->gate) {
    SKV_CHECK(skv__kvc_gate_word(&cl->gate));
    cl->gate_base = __atomic_load_n(cl->gate, __ATOMIC_ACQUIRE);
  }
  if (!cl->ring) {
    char *r = NULL;
    if (posix_memalign((void **)&r, 4096, CL_RING_BYTES) != 0)
      return SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_KV, "cluster: no memory for the fetch ring");
    pthread_mutex_lock(&cl->mu);
    int rc = skv__xfer_map(cl->x, r, CL_RING_BYTES, &cl->ring_mh);
    pthread_mutex_unlock(&cl->mu);
    int hr = rc ? 0 : skv__kvc_host_register(r, CL_RING_BYTES, true);
    if (rc || hr < 0) {
      pthread_mutex_lock(&cl->mu);
      skv__xfer_unmap(cl->x, cl->ring_mh);
      pthread_mutex_unlock(&cl->mu);
      cl->ring_mh = NULL;
      free(r);
      return rc ? rc : hr;
    }
    cl->ring_cuda = hr == 0; /* > 0: UCX registered it, and unregisters it */
    cl->ring = r;
  }
  if (pthread_create(&cl->job_thr, NULL, job_main, cl) != 0)
    return SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_KV, "cluster: no thread for remote fetches");
  cl->job_started = true;
  return 0;
}

/* Runs of the ring whose copies completed go back (in the order they were taken). Under
 * job_mu. */
static void ring_reclaim(skv_cluster_t *cl) {
  while (cl->nreg > 0) {
    cl_region_t *g = &cl->reg[cl->reg0];
    const int d = skv__kvc_event_done(g->done);
    if (d < 0) { /* the event cannot say: the ring is kept, fetches synchronous from now on */
      __atomic_store_n(&cl->job_off, true, __ATOMIC_RELAXED);
      cl->ring_left = true;
    }
    if (d != 1) break;
    skv__kvc_event_free(g->done);
    cl->ring_tail = g->off + g->len;
    cl->reg0 = (cl->reg0 + 1) % CL_JOBS_MAX;
    cl->nreg--;
  }
  if (cl->nreg == 0) cl->ring_head = cl->ring_tail = 0;
}

/* A run of `len` bytes of the ring: its offset, or UINT64_MAX while there is no room. Under
 * job_mu. */
static uint64_t ring_take(skv_cluster_t *cl, uint64_t len) {
  if (cl->nreg == CL_JOBS_MAX) return UINT64_MAX;
  if (cl->nreg == 0) return 0;
  if (cl->ring_head > cl->ring_tail) {
    if (CL_RING_BYTES - cl->ring_head >= len) return cl->ring_head;
    return cl->ring_tail >= len ? 0 : UINT64_MAX; /* wrap */
  }
  return cl->ring_tail - cl->ring_head >= len ? cl->ring_head : UINT64_MAX;
}

/* Can the handle's thread read the remote references of refs[0..n) for `dst` (see above)? Each
 * node's answer is kept once known. false also when a node cannot be reached now (the caller's
 * read then says so). */
static bool fetch_async_ok(skv_cluster_t *cl, const skv_cluster_ref_t *refs, size_t n,
                           const skv_layout_t *dst) {
  bool ok = true;
  for (size_t i = 0; i < n && ok; i++) {
    const uint32_t p = refs[i].node;
    if (p == SKV_NODE_LOCAL) continue;
    uint8_t a = __atomic_load_n(&cl->peer_async[p], __ATOMIC_ACQUIRE);
    if (a == 0) {
      bool host_only = false;
      pthread_mutex_lock(&cl->mu);
      const bool gpu = peer_to_gpu(cl, p, dst);
      const int rc = skv__xfer_peer_host_only(cl->x, p, &host_only);
      pthread_mutex_unlock(&cl->mu);
      if (rc) return false; /* not kept: it may come back */
      a = !gpu && host_only ? 1 : 2;
      __atomic_store_n(&cl->peer_async[p], a, __ATOMIC_RELEASE);
    }
    ok = a == 1;
  }
  return ok;
}

/* Queue the remote references of refs[0..n) for the handle's thread: the gate and the copies
 * on `stream`. *queued false: nothing done, the caller reads them itself. */
static int fetch_queue(skv_cluster_t *cl, const skv_cluster_ref_t *refs, size_t n,
                       const skv_layout_t *dst, const uint64_t *block_ids, bool unpin, void *stream,
                       bool *queued) {
  *queued = false;
  const uint32_t m = dst->blocks_per_page;
  const uint64_t len = skv__layout_page_bytes(dst);
  size_t nr = 0;
  for (size_t i = 0; i < n; i++) nr += refs[i].node != SKV_NODE_LOCAL;
  if (nr * len > CL_RING_BYTES || !fetch_async_ok(cl, refs, n, dst)) return 0;
  /* the remote references grouped by node (stable), their blocks in the same order */
  cl_job_t *j = calloc(1, sizeof *j);
  uint64_t *blocks = malloc(nr * m * sizeof *blocks);
  if (j) j->refs = malloc(nr * sizeof *j->refs);
  if (!j || !j->refs || !blocks) {
    job_free(j), free(blocks);
    return SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_KV, "skv_cluster_fetch: out of memory");
  }
  const uint32_t np = skv__xfer_npeers(cl->x);
  for (uint32_t p = 0; p < np && j->n < nr; p++)
    for (size_t i = 0; i < n; i++)
      if (refs[i].node == p) {
        j->refs[j->n] = refs[i];
        memcpy(blocks + j->n * m, block_ids + i * m, m * sizeof *blocks);
        j->n++;
      }
  j->lay = *dst;
  j->len = len;
  j->unpin = unpin;
  int rc = 0;
  pthread_mutex_lock(&cl->enq_mu);
  if (!cl->job_off && (rc = jobs_start(cl)) != 0) {
    __atomic_store_n(&cl->job_off, true, __ATOMIC_RELAXED);
    SKV_WARN(SKV_SUBSYS_KV, "cluster: remote fetches are synchronous from now on: %s",
             skv_last_error());
    rc = 0;
  }
  /* room in the ring (bounded) and a ticket */
  uint64_t off = UINT64_MAX;
  pthread_mutex_lock(&cl->job_mu);
  const uint64_t dl = skv__now_ns() + (uint64_t)cl->timeout_ms * 1000000u;
  while (!cl->job_off) {
    ring_reclaim(cl);
    if ((off = ring_take(cl, nr * len)) != UINT64_MAX || skv__now_ns() >= dl) break;
    const struct timespec t = skv__ts_at(SKV_MIN(skv__now_ns() + 50000u, dl));
    (void)pthread_cond_timedwait(&cl->job_done_cv, &cl->job_mu, &t);
  }
  const bool go = !cl->job_off && off != UINT64_MAX;
  if (!cl->job_off && off == UINT64_MAX)
    rc = SKV_FAIL(SKV_ETIMEDOUT, SKV_SUBSYS_KV,
                  "skv_cluster_fetch: no room for the pages in the fetch ring after %d ms (the "
                  "copies of earlier fetches did not complete: is a stream blocked?)",
                  cl->timeout_ms);
  if (go) {
    j->ticket = cl->job_issued + 1;
    j->run = cl->ring + off;
  }
  pthread_mutex_unlock(&cl->job_mu);
  if (go) {
    rc = skv__kvc_gate(stream, cl->gate, cl->gate_base + j->ticket, "skv_cluster_fetch");
    if (rc == SKV_ENOTSUP) {
      __atomic_store_n(&cl->job_off, true, __ATOMIC_RELAXED);
      SKV_WARN(SKV_SUBSYS_KV, "cluster: remote fetches are synchronous from now on: %s",
               skv_last_error());
      rc = 0;
    } else if (!rc) {
      /* the job first (only it opens the gate, and the copies may need argument slots that
       * only earlier gates give back), then the copies behind the wait, then the run's event */
      pthread_mutex_lock(&cl->job_mu);
      cl->job_issued = j->ticket;
      cl->ring_head = off + nr * len;
      if (cl->job_tail)
        cl->job_tail->next = j;
      else
        cl->job_head = j;
      cl->job_tail = j;
      pthread_cond_signal(&cl->job_cv);
      pthread_mutex_unlock(&cl->job_mu);
      *queued = true;
      rc = skv__kvc_copy_in_async(cl->kv->cuda, dst, cl->ring + off, len, nr, blocks, stream,
                                  "skv_cluster_fetch");
      void *done = NULL;
      const int erc = skv__kvc_event(stream, &done, "skv_cluster_fetch");
      pthread_mutex_lock(&cl->job_mu);
      if (!erc) {
        cl->reg[(cl->reg0 + cl->nreg) % CL_JOBS_MAX] = (cl_region_t){off, nr * len, done};
        cl->nreg++;
      } else { /* the run cannot be known free again: the ring is kept, fetches synchronous */
        __atomic_store_n(&cl->job_off, true, __ATOMIC_RELAXED);
        cl->ring_left = true;
        if (!rc) rc = erc;
      }
      pthread_mutex_unlock(&cl->job_mu);
    }
  }
  pthread_mutex_unlock(&cl->enq_mu);
  free(blocks);
  if (!*queued) job_free(j);
  return rc;
}
#endif

/* Stop the thread once the queued fetches ran (so that no stream stays held); the ring goes
 * once its copies completed (bounded: else it is left, with a warning). */
static void jobs_stop(skv_cluster_t *cl) {
#ifdef SKV_WITH_CUDA
  if (cl->job_started) {
    pthread_mutex_lock(&cl->job_mu);
    cl->job_stop = true;
    pthread_cond_signal(&cl->job_cv);
    pthread_mutex_unlock(&cl->job_mu);
    pthread_join(cl->job_thr, NULL);
    cl->job_started = false;
  }
  const uint64_t dl = skv__now_ns() + (uint64_t)cl->timeout_ms * 1000000u;
  while (cl->nreg > 0 && !cl->ring_left && skv__now_ns() < dl) {
    ring_reclaim(cl);
    if (cl->nreg > 0) usleep(1000);
  }
  const bool busy = cl->nreg > 0 || cl->ring_left;
  for (; cl->nreg > 0; cl->nreg--, cl->reg0 = (cl->reg0 + 1) % CL_JOBS_MAX)
    skv__kvc_event_free(cl->reg[cl->reg0].done);
  if (cl->ring && !busy) {
    skv__xfer_unmap(cl->x, cl->ring_mh);
    if (cl->ring_cuda) (void)skv__kvc_host_register(cl->ring, CL_RING_BYTES, false);
    free(cl->ring);
  } else if (cl->ring) {
    SKV_WARN(SKV_SUBSYS_KV,
             "cluster: the fetch ring may still be read or written (copies that did not "
             "complete within %d ms, or a read that did not end); leaving it (%llu MiB)",
             cl->timeout_ms, (unsigned long long)(CL_RING_BYTES >> 20));
  }
  cl->ring = NULL;
  skv__kvc_gate_word_put(cl->gate);
  cl->gate = NULL;
#else
  (void)cl;
#endif
}
#endif

#if SKV_WITH_CLUSTER
/* Wait (bounded) until the queued fetches ran (skv_cluster_sync; a synchronous read into a GPU
 * layout, whose copies on the stream may wait for their gates). */
static int jobs_drain(skv_cluster_t *cl) {
  int rc = 0;
  pthread_mutex_lock(&cl->job_mu);
  const uint64_t dl = skv__now_ns() + (uint64_t)cl->timeout_ms * 1000000u;
  while (cl->job_done < cl->job_issued && skv__now_ns() < dl) {
    const struct timespec t = skv__ts_at(dl);
    (void)pthread_cond_timedwait(&cl->job_done_cv, &cl->job_mu, &t);
  }
  if (cl->job_done < cl->job_issued)
    rc = SKV_FAIL(SKV_ETIMEDOUT, SKV_SUBSYS_KV,
                  "cluster: %" PRIu64 " remote fetches of this handle still running after %d ms",
                  cl->job_issued - cl->job_done, cl->timeout_ms);
  pthread_mutex_unlock(&cl->job_mu);
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
  size_t nr = 0;
  for (size_t i = 0; i < n; i++) nr += refs[i].node != SKV_NODE_LOCAL;
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
  SKV_ARG_CHECK((flags & ~(uint32_t)SKV_FETCH_UNPIN) == 0, SKV_SUBSYS_KV,
                "skv_cluster_fetch: unknown flags 0x%x", flags);
  SKV_CHECK(skv__check_block_ids(dst, block_ids, n, "skv_cluster_fetch"));
  /* from here on a failure still releases the pins of SKV_FETCH_UNPIN */
  int rc = remote_dst_check(cl, dst, stream);
  const int nrc = check_nodes(cl, refs, n, "skv_cluster_fetch");
  const bool bad_node = nrc != 0; /* then no pin of the call is taken nor released */
  if (bad_node) rc = nrc;
  /* SKV_FETCH_UNPIN: the remote pins are taken off this handle's count first (a reference it
   * does not pin fails the call before anything is read), and given back after the reads, also
   * when they failed */
  bool taken = false;
  if ((flags & SKV_FETCH_UNPIN) && !bad_node) {
    char saved[512];
    snprintf(saved, sizeof(saved), "%s", skv_last_error());
    int trc = pins_take(cl, refs, n, "skv_cluster_fetch");
    taken = trc == 0;
    if (rc)
      skv__error_restore(saved);
    else
      rc = trc;
  }
  bool queued = false, local_done = false;
#ifdef SKV_WITH_CUDA
  /* a GPU layout: stream-ordered. The local pages first (they copy while the network reads),
   * then the remote ones queued for the handle's thread */
  if (!rc && dst->device >= 0 && !__atomic_load_n(&cl->job_off, __ATOMIC_RELAXED)) {
    rc = fetch_local(cl, refs, n, dst, block_ids, flags, stream, 0);
    local_done = true;
    if (!rc) rc = fetch_queue(cl, refs, n, dst, block_ids, taken, stream, &queued);
  }
#endif
  if (!queued) { /* the remote pages read here, a batch per peer node, then the local ones */
#ifdef SKV_WITH_CUDA
    /* a GPU layout: the copies wait on the stream, maybe behind gates of queued fetches */
    if (!rc && dst->device >= 0) rc = jobs_drain(cl);
#endif
    pthread_mutex_lock(&cl->mu);
    if (!rc) rc = fetch_remote(cl, refs, n, dst, block_ids, stream);
    if (taken) rc = unpin_after(cl, refs, n, rc);
    pthread_mutex_unlock(&cl->mu);
  }
  if (!local_done) rc = fetch_local(cl, refs, n, dst, block_ids, flags, stream, rc);
  return rc;
#endif
}

int skv_cluster_sync(skv_cluster_t *cl) {
  CL_CHECK_NULL(cl, "skv_cluster_sync");
  int rc = 0;
#if SKV_WITH_CLUSTER
  SKV_CHECK(jobs_drain(cl));
  pthread_mutex_lock(&cl->job_mu);
  if (cl->job_rc) {
    rc = cl->job_rc;
    skv__error_restore(cl->job_msg);
    cl->job_rc = 0;
    cl->job_msg[0] = '\0';
  }
  pthread_mutex_unlock(&cl->job_mu);
#endif
  if (rc) return rc;
  return skv_kv_sync(cl->kv);
}

int skv_cluster_unpin(skv_cluster_t *cl, const skv_cluster_ref_t *refs, size_t n) {
  CL_CHECK_NULL(cl, "skv_cluster_unpin");
  SKV_ARG_CHECK(refs || n == 0, SKV_SUBSYS_KV, "skv_cluster_unpin: refs is NULL with n=%zu", n);
  size_t nl = 0;
  for (size_t i = 0; i < n; i++) nl += refs[i].node == SKV_NODE_LOCAL;
  int rc = 0;
  if (nl < n) {
#if SKV_WITH_CLUSTER
    if (!cl->remote)
      return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_KV,
                      "skv_cluster_unpin: a reference names a peer node, but this handle is "
                      "node-local (no Redis URL)");
    pthread_mutex_lock(&cl->mu);
    rc = check_nodes(cl, refs, n, "skv_cluster_unpin");
    if (!rc) rc = release_remote(cl, refs, n, "skv_cluster_unpin");
    pthread_mutex_unlock(&cl->mu);
#else
    return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_KV,
                    "skv_cluster_unpin: a reference names a peer node, but this build is "
                    "node-local");
#endif
  }
  if (nl) {
    skv_page_ref_t small[64], *lr = nl <= 64 ? small : malloc(nl * sizeof(*lr));
    if (!lr) return SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_KV, "skv_cluster_unpin: out of memory");
    size_t j = 0;
    for (size_t i = 0; i < n; i++)
      if (refs[i].node == SKV_NODE_LOCAL)
        lr[j++] = (skv_page_ref_t){refs[i].pe, refs[i].page, refs[i].gen, 0};
    int lrc = skv_kv_unpin(cl->kv, lr, nl);
    if (!rc) rc = lrc;
    if (lr != small) free(lr);
  }
  return rc;
}

int skv_cluster_get_stats(const skv_cluster_t *cl, skv_cluster_stats_t *st) {
  CL_CHECK_NULL(cl, "skv_cluster_get_stats");
  /* callers built before remote_pins or remote_direct_pages existed pass the size they know:
   * that much is written */
  const size_t v1 = offsetof(skv_cluster_stats_t, remote_pins),
               v2 = offsetof(skv_cluster_stats_t, remote_direct_pages);
  SKV_ARG_CHECK(
      st && (st->size == sizeof(*st) || st->size == v1 || st->size == v2), SKV_SUBSYS_KV,
      "skv_cluster_get_stats: stats is NULL or its size is not sizeof(skv_cluster_stats_t) "
      "(start from SKV_CLUSTER_STATS_INIT)");
  const size_t size = st->size;
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
  s.remote_pins = cl->remote_pins;
  s.remote_direct_pages = cl->remote_direct_pages;
  s.size = size;
  memcpy(st, &s, size);
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
