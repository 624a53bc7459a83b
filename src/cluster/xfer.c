/* The cluster's data path over UCX: this node's pages registered for one-sided reads, a
 * serving worker progressed by its own thread, and batched gets from peer nodes. */
#define _GNU_SOURCE
#include "cluster/cluster.h"
#include "pool/pool.h"

#include <poll.h>
#include <sched.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <ucp/api/ucp.h>

/* How it works
 * ------------
 * One UCX context per handle, two workers: the serving worker, whose address goes into the
 * node record and which a thread progresses (TCP emulates a get with messages that the target
 * must answer; shared-memory and RDMA transports need nothing from it), and the fetching
 * worker, used by the caller (serialised by the handle's lock). The page area and the page
 * records are registered with ucp_mem_map and their memory keys packed into the node record:
 *
 *   [ record header | worker address | rkey of the pages | rkey of the records ]
 *
 * A get of n pages from one peer is a pipeline of sub-batches of about XFER_SUB_BYTES, at most
 * XFER_DEPTH of them in flight, each in a slot of a registered staging buffer: its pages'
 * ucp_get_nbx, a fence (ucp_worker_fence: what follows starts after they completed), one 8-byte
 * get per page of its state word. The oldest sub-batch is waited for, checked and handed to the
 * caller (who copies it into engine blocks) while the next ones are on the wire, and its slot
 * takes the next sub-batch: the network does not wait for the copies, nor for the checks (the
 * state words travel behind the pages, not in a round trip of their own). An owner bumps a
 * page's generation before it writes new bytes into it, so a state word read after the bytes
 * that still says READY with the generation the directory gave means the bytes read are that
 * page's (a seqlock whose reader checks once, after); a sub-batch with a page that fails the
 * check is not handed over.
 *
 * What can go wrong
 * -----------------
 * - The peer dies or the network breaks: the endpoint (error mode PEER) reports it, the
 *   requests fail: SKV_EPEERDEAD; nothing is copied out of the buffer.
 * - The peer hangs: every wait is bounded by the timeout (a sub-batch that makes no progress for
 *   that long: a large fetch may take longer as a whole); then the endpoint is closed with
 *   UCP_EP_CLOSE_MODE_FORCE, which cancels its operations, before the buffer is given back.
 * - Cancelled operations that never complete (a transport that does not honour the forced
 *   close): the wait for them is bounded too; then the buffers they may still write are left to
 *   them (never freed nor used again: the next call takes new ones) and a warning says so.
 * - A peer restarts under the same name: its record has another nonce, so it becomes another
 *   peer number and entries of the old incarnation end the lookup's prefix. */

#define XFER_MAGIC     0x736b76636c757332ull /* "skvclus2": records carry rpins_off */
#define XFER_MAX_PEERS 1024
#define SERVE_SPIN_NS  (2 * 1000 * 1000) /* the serving thread polls 2 ms after a request */
#define SERVE_POLL_MS  20                /* and then sleeps at most this long (see serve_main) */
#define XFER_SUB_BYTES (4ull << 20)      /* bytes of a sub-batch of a get (one page at least) */
#define XFER_DEPTH     3                 /* sub-batches in flight */

typedef struct xfer_rec {
  uint64_t magic, nonce;
  uint64_t page_bytes, page_stride, pages, pages_base, meta_base, meta_stride;
  uint32_t addr_len, rk_pages_len, rk_meta_len, rpins_off;
} xfer_rec_t;

typedef struct xfer_peer {
  char name[SKV__CL_NAME_CAP];
  xfer_rec_t rec;
  void *blob; /* the record, for connecting */
  size_t blob_len;
  ucp_ep_h ep;
  ucp_rkey_h rk_pages, rk_meta;
  volatile int failed; /* ucs_status_t of the endpoint's error, 0 while good */
} xfer_peer_t;

struct skv__xfer {
  ucp_context_h ctx;
  ucp_worker_h serve, fetch;
  ucp_mem_h mh_pages, mh_meta;
  void *blob;
  size_t blob_len;
  int timeout_ms;
  pthread_t thr;
  bool thr_started;
  volatile int stop;
  xfer_peer_t *peers[XFER_MAX_PEERS];
  uint32_t npeers;
  void **reqs; /* requests in flight of a get_pages: XFER_DEPTH slots of 2 x pages */
  size_t reqs_cap;
  uint64_t *words; /* state words read back, one per page of the call */
  size_t words_cap;
  char *staging; /* XFER_DEPTH slots that pages are read into: registered, so that UCX reads
                  * zero-copy where the transport can */
  size_t staging_cap;
  ucp_mem_h staging_mh;
  skv__xfer_mem_fn staging_hook; /* registers the staging buffer with CUDA, when set */
  void *staging_hook_arg;
};

static int ucx_fail(ucs_status_t st, const char *what) {
  return SKV_FAIL(SKV_ECONN, SKV_SUBSYS_KV,
                  "cluster: %s failed: %s (UCX; check UCX_TLS and UCX_NET_DEVICES)", what,
                  ucs_status_string(st));
}

static void staging_free(skv__xfer_t *x);

static void *serve_main(void *arg) {
  skv__xfer_t *x = arg;
  int efd = -1;
  if (ucp_worker_get_efd(x->serve, &efd) != UCS_OK) efd = -1;
  uint64_t busy_until = 0;
  while (!__atomic_load_n(&x->stop, __ATOMIC_ACQUIRE)) {
    /* Stay awake while requests come (a TCP get is several messages that each wait for this
     * thread: sleeping between them costs a wake-up each), yielding the core between polls
     * (on a busy host the fetcher may need it: pure spinning halved the bandwidth with both
     * sides on one core), and sleep after SPIN_NS of quiet. */
    if (ucp_worker_progress(x->serve)) {
      while (ucp_worker_progress(x->serve)) {
      }
      busy_until = skv__now_ns() + SERVE_SPIN_NS;
      continue;
    }
    if (skv__now_ns() < busy_until) {
      sched_yield(); /* not a pause: a fetcher on this core may have to run first */
      continue;
    }
    if (efd < 0) {
      struct timespec ts = {0, 200000};
      nanosleep(&ts, NULL);
      continue;
    }
    ucs_status_t st = ucp_worker_arm(x->serve);
    if (st == UCS_ERR_BUSY) continue;
    struct pollfd pfd = {.fd = efd, .events = POLLIN};
    (void)poll(&pfd, 1, SERVE_POLL_MS);
  }
  return NULL;
}

int skv__xfer_create(const skv__export_t *ex, uint64_t nonce, int timeout_ms, skv__xfer_t **out,
                     const void **blob, size_t *blob_len) {
  *out = NULL;
  skv__xfer_t *x = calloc(1, sizeof(*x));
  if (!x) return SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_KV, "cluster: out of memory");
  x->timeout_ms = timeout_ms;
  int rc = 0;
  ucs_status_t st;
  ucp_config_t *cfg = NULL;
  void *rkp = NULL, *rkm = NULL;
  size_t rkp_len = 0, rkm_len = 0;
  ucp_address_t *addr = NULL;
  size_t addr_len = 0;
  if ((st = ucp_config_read(NULL, NULL, &cfg)) != UCS_OK) {
    rc = ucx_fail(st, "ucp_config_read");
    goto fail;
  }
  ucp_params_t pp = {.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED,
                     .features = UCP_FEATURE_RMA | UCP_FEATURE_AMO64 | UCP_FEATURE_WAKEUP,
                     .mt_workers_shared = 1};
  st = ucp_init(&pp, cfg, &x->ctx);
  ucp_config_release(cfg);
  if (st != UCS_OK) {
    rc = ucx_fail(st, "ucp_init");
    goto fail;
  }
  ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
                            .thread_mode = UCS_THREAD_MODE_SINGLE};
  if ((st = ucp_worker_create(x->ctx, &wp, &x->serve)) != UCS_OK ||
      (st = ucp_worker_create(x->ctx, &wp, &x->fetch)) != UCS_OK) {
    rc = ucx_fail(st, "ucp_worker_create");
    goto fail;
  }
  if ((st = ucp_worker_get_address(x->serve, &addr, &addr_len)) != UCS_OK) {
    rc = ucx_fail(st, "ucp_worker_get_address");
    goto fail;
  }
  if (ex->pages) {
    ucp_mem_map_params_t mp = {.field_mask =
                                   UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH,
                               .address = ex->pages_base,
                               .length = ex->pages * ex->page_stride};
    if ((st = ucp_mem_map(x->ctx, &mp, &x->mh_pages)) != UCS_OK) {
      rc = ucx_fail(st, "ucp_mem_map of the pages");
      goto fail;
    }
    mp.address = ex->meta_base;
    mp.length = ex->pages * ex->meta_stride;
    if ((st = ucp_mem_map(x->ctx, &mp, &x->mh_meta)) != UCS_OK) {
      rc = ucx_fail(st, "ucp_mem_map of the page records");
      goto fail;
    }
    if ((st = ucp_rkey_pack(x->ctx, x->mh_pages, &rkp, &rkp_len)) != UCS_OK ||
        (st = ucp_rkey_pack(x->ctx, x->mh_meta, &rkm, &rkm_len)) != UCS_OK) {
      rc = ucx_fail(st, "ucp_rkey_pack");
      goto fail;
    }
  }
  xfer_rec_t r = {.magic = XFER_MAGIC,
                  .nonce = nonce,
                  .page_bytes = ex->page_bytes,
                  .page_stride = ex->page_stride,
                  .pages = ex->pages,
                  .pages_base = (uint64_t)(uintptr_t)ex->pages_base,
                  .meta_base = (uint64_t)(uintptr_t)ex->meta_base,
                  .meta_stride = ex->meta_stride,
                  .addr_len = (uint32_t)addr_len,
                  .rk_pages_len = (uint32_t)rkp_len,
                  .rk_meta_len = (uint32_t)rkm_len,
                  .rpins_off = ex->rpins_off};
  x->blob_len = sizeof(r) + addr_len + rkp_len + rkm_len;
  x->blob = malloc(x->blob_len);
  if (!x->blob) {
    rc = SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_KV, "cluster: out of memory");
    goto fail;
  }
  char *b = x->blob;
  memcpy(b, &r, sizeof(r));
  memcpy(b + sizeof(r), addr, addr_len);
  if (rkp_len) memcpy(b + sizeof(r) + addr_len, rkp, rkp_len);
  if (rkm_len) memcpy(b + sizeof(r) + addr_len + rkp_len, rkm, rkm_len);
  /* a node without pages (a reader) serves nothing: no thread */
  if (ex->pages && pthread_create(&x->thr, NULL, serve_main, x) != 0) {
    rc = SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_KV, "cluster: cannot start the UCX progress thread");
    goto fail;
  }
  x->thr_started = ex->pages != 0;
  SKV_INFO(SKV_SUBSYS_KV,
           "cluster: UCX %s, exporting %" PRIu64 " pages of %" PRIu64
           " bytes, node record %zu bytes",
           ucp_get_version_string(), ex->pages, ex->page_bytes, x->blob_len);
fail:
  if (rkp) ucp_rkey_buffer_release(rkp);
  if (rkm) ucp_rkey_buffer_release(rkm);
  if (addr) ucp_worker_release_address(x->serve, addr);
  if (rc) {
    skv__xfer_destroy(x);
    return rc;
  }
  *out = x;
  *blob = x->blob;
  *blob_len = x->blob_len;
  return 0;
}

/* Progress the fetching worker until `req` is no longer in flight or `deadline_ms` passed; true
 * when it completed. Requests of a force-closed endpoint complete as the worker progresses;
 * the deadline only guards against a transport that never completes them. */
static bool settle(skv__xfer_t *x, void *req, uint64_t deadline_ms) {
  unsigned spins = 0;
  while (ucp_request_check_status(req) == UCS_INPROGRESS)
    if (ucp_worker_progress(x->fetch) == 0 && ++spins % 1024 == 0 && skv__now_ms() >= deadline_ms)
      return false;
  return true;
}

/* Some cancelled request did not complete in time: it may still write into the staging buffer
 * or the state words, so both are left to it (leaked, never reused; the next call allocates new
 * ones). Its request is freed (UCX releases it once it completes). */
static void abandon_buffers(skv__xfer_t *x, const char *who) {
  SKV_WARN(SKV_SUBSYS_KV,
           "cluster: %s did not complete within %d ms; leaving the buffers (%zu bytes) to them "
           "and taking new ones",
           who, x->timeout_ms, x->staging_cap + x->words_cap * sizeof(uint64_t));
  x->staging = NULL;
  x->staging_mh = NULL;
  x->staging_cap = 0;
  x->words = NULL;
  x->words_cap = 0;
}

/* Wait for a request of the fetching worker, bounded; 0, or the failure (request freed). */
static ucs_status_t wait_req(skv__xfer_t *x, void *req, uint64_t deadline_ms, bool *timed_out) {
  *timed_out = false;
  if (req == NULL) return UCS_OK;
  if (UCS_PTR_IS_ERR(req)) return UCS_PTR_STATUS(req);
  ucs_status_t st;
  unsigned spins = 0;
  while ((st = ucp_request_check_status(req)) == UCS_INPROGRESS) {
    if (ucp_worker_progress(x->fetch) == 0 && ++spins % 1024 == 0 && skv__now_ms() >= deadline_ms) {
      *timed_out = true;
      break;
    }
  }
  if (*timed_out) {
    ucp_request_cancel(x->fetch, req);
    (void)settle(x, req, skv__now_ms() + (uint64_t)x->timeout_ms);
    st = UCS_ERR_TIMED_OUT;
  }
  ucp_request_free(req);
  return st;
}

/* Close a peer's endpoint (forcibly: outstanding operations are cancelled), bounded. */
static void peer_close(skv__xfer_t *x, xfer_peer_t *p) {
  if (p->rk_pages) ucp_rkey_destroy(p->rk_pages);
  if (p->rk_meta) ucp_rkey_destroy(p->rk_meta);
  p->rk_pages = p->rk_meta = NULL;
  if (p->ep) {
    ucp_request_param_t rp = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS,
                              .flags = UCP_EP_CLOSE_FLAG_FORCE};
    void *req = ucp_ep_close_nbx(p->ep, &rp);
    bool to;
    (void)wait_req(x, req, skv__now_ms() + 2000, &to);
    p->ep = NULL;
  }
}

void skv__xfer_destroy(skv__xfer_t *x) {
  if (!x) return;
  if (x->thr_started) {
    __atomic_store_n(&x->stop, 1, __ATOMIC_RELEASE);
    ucp_worker_signal(x->serve);
    pthread_join(x->thr, NULL);
  }
  for (uint32_t i = 0; i < x->npeers; i++) {
    if (x->fetch) peer_close(x, x->peers[i]);
    free(x->peers[i]->blob);
    free(x->peers[i]);
  }
  staging_free(x);
  if (x->mh_pages) ucp_mem_unmap(x->ctx, x->mh_pages);
  if (x->mh_meta) ucp_mem_unmap(x->ctx, x->mh_meta);
  if (x->fetch) ucp_worker_destroy(x->fetch);
  if (x->serve) ucp_worker_destroy(x->serve);
  if (x->ctx) ucp_cleanup(x->ctx);
  free(x->reqs);
  free(x->words);
  free(x->blob);
  free(x);
}

int skv__xfer_peer(skv__xfer_t *x, const char *name, const void *blob, size_t len, uint32_t *peer) {
  xfer_rec_t r;
  if (len < sizeof(r))
    return SKV_FAIL(SKV_EPROTO, SKV_SUBSYS_KV, "cluster: node '%s' has a record of %zu bytes", name,
                    len);
  memcpy(&r, blob, sizeof(r));
  if (r.magic != XFER_MAGIC ||
      len != sizeof(r) + (size_t)r.addr_len + r.rk_pages_len + r.rk_meta_len || !r.addr_len)
    return SKV_FAIL(SKV_EPROTO, SKV_SUBSYS_KV,
                    "cluster: node '%s' has a record this symkv cannot read (another version?)",
                    name);
  for (uint32_t i = 0; i < x->npeers; i++)
    if (x->peers[i]->rec.nonce == r.nonce && strcmp(x->peers[i]->name, name) == 0) {
      *peer = i;
      return 0;
    }
  if (x->npeers == XFER_MAX_PEERS)
    return SKV_FAIL(SKV_ENOSPC, SKV_SUBSYS_KV, "cluster: more than %d peer incarnations",
                    XFER_MAX_PEERS);
  xfer_peer_t *p = calloc(1, sizeof(*p));
  if (!p || !(p->blob = malloc(len))) {
    free(p);
    return SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_KV, "cluster: out of memory");
  }
  snprintf(p->name, sizeof(p->name), "%s", name);
  p->rec = r;
  memcpy(p->blob, blob, len);
  p->blob_len = len;
  *peer = x->npeers;
  x->peers[x->npeers++] = p;
  return 0;
}

const char *skv__xfer_peer_name(const skv__xfer_t *x, uint32_t peer) {
  return peer < x->npeers ? x->peers[peer]->name : NULL;
}
bool skv__xfer_peer_failed(const skv__xfer_t *x, uint32_t peer) {
  return peer >= x->npeers || x->peers[peer]->failed;
}
uint32_t skv__xfer_npeers(const skv__xfer_t *x) {
  return x->npeers;
}
uint64_t skv__xfer_peer_nonce(const skv__xfer_t *x, uint32_t peer) {
  return peer < x->npeers ? x->peers[peer]->rec.nonce : 0;
}
void skv__xfer_peer_retry(skv__xfer_t *x, uint32_t peer) {
  if (peer < x->npeers && x->peers[peer]->failed && !x->peers[peer]->ep) x->peers[peer]->failed = 0;
}
uint64_t skv__xfer_page_bytes(const skv__xfer_t *x, uint32_t peer) {
  return peer < x->npeers ? x->peers[peer]->rec.page_bytes : 0;
}

static void ep_error(void *arg, ucp_ep_h ep, ucs_status_t status) {
  xfer_peer_t *p = arg;
  p->failed = status ? (int)status : -1;
  SKV_INFO_RL(SKV_SUBSYS_KV, "cluster: endpoint to node '%s' failed: %s", p->name,
              ucs_status_string(status));
}

static int peer_connect(skv__xfer_t *x, xfer_peer_t *p) {
  if (p->ep) return 0;
  const char *b = p->blob;
  ucp_ep_params_t ep = {.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS |
                                      UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                                      UCP_EP_PARAM_FIELD_ERR_HANDLER,
                        .address = (const ucp_address_t *)(b + sizeof(xfer_rec_t)),
                        .err_mode = UCP_ERR_HANDLING_MODE_PEER,
                        .err_handler = {.cb = ep_error, .arg = p}};
  ucs_status_t st = ucp_ep_create(x->fetch, &ep, &p->ep);
  if (st != UCS_OK) {
    p->ep = NULL;
    p->failed = (int)st;
    return SKV_FAIL(SKV_EPEERDEAD, SKV_SUBSYS_KV, "cluster: cannot reach node '%s': %s", p->name,
                    ucs_status_string(st));
  }
  const char *rk = b + sizeof(xfer_rec_t) + p->rec.addr_len;
  if (!p->rec.pages || (st = ucp_ep_rkey_unpack(p->ep, rk, &p->rk_pages)) != UCS_OK ||
      (st = ucp_ep_rkey_unpack(p->ep, rk + p->rec.rk_pages_len, &p->rk_meta)) != UCS_OK) {
    peer_close(x, p);
    p->failed = -1;
    return SKV_FAIL(SKV_EPROTO, SKV_SUBSYS_KV, "cluster: node '%s' exports no readable pages%s%s",
                    p->name, p->rec.pages ? ": " : "", p->rec.pages ? ucs_status_string(st) : "");
  }
  return 0;
}

/* Requests of a closed endpoint: they complete (cancelled) as the worker progresses, within
 * the timeout; freed. Buffers that one still in flight may write are abandoned. */
static void drain_reqs(skv__xfer_t *x, void **reqs, size_t k) {
  const uint64_t deadline_ms = skv__now_ms() + (uint64_t)x->timeout_ms;
  bool stuck = false;
  for (size_t i = 0; i < k; i++) {
    if (!stuck && !settle(x, reqs[i], deadline_ms)) stuck = true;
    ucp_request_free(reqs[i]);
  }
  if (stuck) abandon_buffers(x, "reads of a closed endpoint");
}

/* Wait for reqs[0..k) (requests of `p`), bounded, and free them; SKV_EPEERDEAD (the endpoint
 * closed, so that nothing lands in the buffer later: the caller then drains its other requests)
 * when one failed, the peer failed or time ran out. */
static int wait_reqs(skv__xfer_t *x, xfer_peer_t *p, void **reqs, size_t k) {
  const uint64_t deadline_ms = skv__now_ms() + (uint64_t)x->timeout_ms;
  ucs_status_t bad = UCS_OK;
  bool to = false;
  size_t done = 0;
  while (done < k) {
    ucs_status_t st = ucp_request_check_status(reqs[done]);
    if (st != UCS_INPROGRESS) {
      if (st != UCS_OK && bad == UCS_OK) bad = st;
      ucp_request_free(reqs[done]);
      done++;
      continue;
    }
    if (ucp_worker_progress(x->fetch) != 0) continue;
    /* nothing came: give the core away rather than spin (over TCP what is awaited is made by
     * the owner's progress thread, which may be waiting for this very core) */
    sched_yield();
    if (skv__now_ms() >= deadline_ms) {
      to = true;
      break;
    }
  }
  if (!to && bad == UCS_OK && !p->failed) return 0;
  if (!p->failed) p->failed = bad != UCS_OK ? (int)bad : -1;
  peer_close(x, p); /* cancels what is still in flight */
  drain_reqs(x, reqs + done, k - done);
  if (to)
    return SKV_FAIL(SKV_EPEERDEAD, SKV_SUBSYS_KV,
                    "cluster: node '%s' did not answer a read of pages within %d ms (timeout; "
                    "its endpoint is closed, the pages are not copied)",
                    p->name, x->timeout_ms);
  return SKV_FAIL(SKV_EPEERDEAD, SKV_SUBSYS_KV,
                  "cluster: node '%s' failed during a read of pages: %s (it died or the network "
                  "broke; the pages are not copied)",
                  p->name, ucs_status_string(bad != UCS_OK ? bad : UCS_ERR_ENDPOINT_TIMEOUT));
}

void skv__xfer_set_staging_hook(skv__xfer_t *x, skv__xfer_mem_fn fn, void *arg) {
  x->staging_hook = fn;
  x->staging_hook_arg = arg;
}

static void staging_free(skv__xfer_t *x) {
  if (x->staging_mh) ucp_mem_unmap(x->ctx, x->staging_mh);
  if (x->staging && x->staging_hook)
    (void)x->staging_hook(x->staging_hook_arg, x->staging, x->staging_cap, false);
  free(x->staging);
  x->staging = NULL;
  x->staging_mh = NULL;
  x->staging_cap = 0;
}

/* A registered buffer of at least `bytes` (grown, never shrunk; registered with CUDA too
 * when a hook is set and it was not yet). */
static int staging(skv__xfer_t *x, size_t bytes) {
  if (x->staging_cap >= bytes) return 0;
  staging_free(x);
  if (posix_memalign((void **)&x->staging, 4096, bytes) != 0) {
    x->staging = NULL;
    return SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_KV, "cluster: out of memory (%zu bytes of staging)",
                    bytes);
  }
  ucp_mem_map_params_t mp = {.field_mask =
                                 UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH,
                             .address = x->staging,
                             .length = bytes};
  ucs_status_t st = ucp_mem_map(x->ctx, &mp, &x->staging_mh);
  if (st != UCS_OK) {
    x->staging_mh = NULL;
    free(x->staging);
    x->staging = NULL;
    return ucx_fail(st, "ucp_mem_map of the staging buffer");
  }
  x->staging_cap = bytes;
  if (x->staging_hook) {
    int rc = x->staging_hook(x->staging_hook_arg, x->staging, bytes, true);
    if (rc) {
      ucp_mem_unmap(x->ctx, x->staging_mh);
      free(x->staging);
      x->staging = NULL;
      x->staging_mh = NULL;
      x->staging_cap = 0;
      return rc;
    }
  }
  return 0;
}

/* Put pages [first, first + c) of the call on the wire into `buf`, then their state words
 * (after a fence): their requests into reqs, *k of them. A failure to post marks the peer. */
static void issue_sub(skv__xfer_t *x, xfer_peer_t *p, const uint32_t *page, size_t first, size_t c,
                      uint64_t off, uint64_t len, char *buf, void **reqs, size_t *k) {
  ucp_request_param_t rp = {.op_attr_mask = UCP_OP_ATTR_FIELD_MEMH, .memh = x->staging_mh};
  *k = 0;
  for (size_t i = first; i < first + c && !p->failed; i++) {
    void *req =
        ucp_get_nbx(p->ep, buf + (i - first) * len, len,
                    p->rec.pages_base + page[i] * p->rec.page_stride + off, p->rk_pages, &rp);
    if (UCS_PTR_IS_ERR(req))
      p->failed = (int)UCS_PTR_STATUS(req);
    else if (req)
      reqs[(*k)++] = req;
  }
  ucs_status_t st = p->failed ? UCS_OK : ucp_worker_fence(x->fetch);
  if (st != UCS_OK) p->failed = (int)st;
  rp.op_attr_mask = 0;
  for (size_t i = first; i < first + c && !p->failed; i++) {
    void *req = ucp_get_nbx(p->ep, &x->words[i], sizeof(uint64_t),
                            p->rec.meta_base + page[i] * p->rec.meta_stride, p->rk_meta, &rp);
    if (UCS_PTR_IS_ERR(req))
      p->failed = (int)UCS_PTR_STATUS(req);
    else if (req)
      reqs[(*k)++] = req;
  }
}

/* The peer of a call, connected, with pages page[0..n) in its range and room for n state
 * words. */
static int call_begin(skv__xfer_t *x, uint32_t peer, const uint32_t *page, size_t n,
                      xfer_peer_t **out, size_t *bad) {
  if (peer >= x->npeers) return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_KV, "cluster: no peer %u", peer);
  xfer_peer_t *p = x->peers[peer];
  if (p->failed)
    return SKV_FAIL(SKV_EPEERDEAD, SKV_SUBSYS_KV,
                    "cluster: node '%s' failed earlier (look the keys up again)", p->name);
  SKV_CHECK(peer_connect(x, p));
  for (size_t i = 0; i < n; i++)
    if (page[i] >= p->rec.pages) {
      *bad = i;
      return SKV_FAIL(SKV_ERANGE, SKV_SUBSYS_KV,
                      "cluster: page %u of node '%s' (it has %" PRIu64 ")", page[i], p->name,
                      p->rec.pages);
    }
  if (n > x->words_cap) {
    uint64_t *w = realloc(x->words, n * sizeof(*w));
    if (!w) return SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_KV, "cluster: out of memory");
    x->words = w;
    x->words_cap = n;
  }
  *out = p;
  return 0;
}

int skv__xfer_get_pages(skv__xfer_t *x, uint32_t peer, const uint32_t *page, const uint32_t *gen,
                        size_t n, uint64_t off, uint64_t len, skv__xfer_deliver_fn deliver,
                        void *arg, size_t *bad) {
  *bad = 0;
  xfer_peer_t *p = NULL;
  SKV_CHECK(call_begin(x, peer, page, n, &p, bad));
  if (len == 0 || off + len > p->rec.page_bytes)
    return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_KV,
                    "cluster: bytes [%" PRIu64 ", %" PRIu64
                    ") of pages of node '%s' (they have %" PRIu64 ")",
                    off, off + len, p->name, p->rec.page_bytes);
  if (n == 0) return 0;
  const uint64_t pb = len;
  const size_t sub = (size_t)SKV_MAX(1, SKV_MIN((uint64_t)n, XFER_SUB_BYTES / pb));
  const size_t nsub = (n + sub - 1) / sub, depth = SKV_MIN(nsub, (size_t)XFER_DEPTH);
  SKV_CHECK(staging(x, depth * sub * pb));
  if (depth * 2 * sub > x->reqs_cap) {
    void **r = realloc(x->reqs, depth * 2 * sub * sizeof(*r));
    if (!r) return SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_KV, "cluster: out of memory");
    x->reqs = r;
    x->reqs_cap = depth * 2 * sub;
  }
  size_t k[XFER_DEPTH] = {0};
  size_t head = 0, tail = 0; /* sub-batches [tail, head) are in flight, slot = index % depth */
  size_t stale = n;          /* the first stale page, n while none */
  bool copy_stuck = false;
  int rc = 0;
  while (tail < nsub) {
    for (; head < nsub && head - tail < depth && !p->failed; head++) {
      const size_t s = head % depth, first = head * sub;
      issue_sub(x, p, page, first, SKV_MIN(sub, n - first), off, len, x->staging + s * sub * pb,
                x->reqs + s * 2 * sub, &k[s]);
    }
    if (tail == head) { /* nothing in flight: the peer failed before a post */
      rc = SKV_FAIL(SKV_EPEERDEAD, SKV_SUBSYS_KV,
                    "cluster: node '%s' failed during a read of pages", p->name);
      break;
    }
    const size_t s = tail % depth, first = tail * sub, c = SKV_MIN(sub, n - first);
    tail++;
    if ((rc = wait_reqs(x, p, x->reqs + s * 2 * sub, k[s])) != 0) break;
    for (size_t i = first; i < first + c && stale == n; i++)
      if ((uint32_t)x->words[i] != 2u /* SKV_PAGE_READY */ ||
          (uint32_t)(x->words[i] >> 32) != gen[i])
        stale = i;
    if (stale < n) break;
    if ((rc = deliver(arg, first, c, x->staging + s * sub * pb)) != 0) {
      copy_stuck = rc == SKV_ETIMEDOUT; /* the copy out of the slot may still read it */
      break;
    }
  }
  /* after a failure: what is still in flight lands in the staging slots, never later (a
   * failed delivery leaves the endpoint open: its reads are waited for) */
  for (; tail < head; tail++) {
    const size_t s = tail % depth;
    if (rc && !p->ep)
      drain_reqs(x, x->reqs + s * 2 * sub, k[s]);
    else if (rc)
      (void)wait_reqs(x, p, x->reqs + s * 2 * sub, k[s]);
    else
      rc = wait_reqs(x, p, x->reqs + s * 2 * sub, k[s]);
  }
  if (copy_stuck) abandon_buffers(x, "a copy out of the staging buffer");
  if (rc) return rc;
  if (stale < n) {
    const uint64_t w = x->words[stale];
    *bad = stale;
    return SKV_FAIL(SKV_ESTALE, SKV_SUBSYS_KV,
                    "cluster: page %u of node '%s' is no longer generation %u (now %u, state "
                    "%u): evicted or reused, not copied; look the keys up again",
                    page[stale], p->name, gen[stale], (uint32_t)(w >> 32), (uint32_t)w & 0xff);
  }
  return 0;
}

/* ---- remote pins ---------------------------------------------------------------------------- */

static const uint64_t rpin_add = SKV_RPIN_ADD, rpin_sub = SKV_RPIN_SUB;

/* Post one atomic add of *val to the rpins word of pages page[0..n) of p: requests into reqs,
 * *k of them. A failure to post marks the peer. */
static void post_rpins(skv__xfer_t *x, xfer_peer_t *p, const uint32_t *page, size_t n,
                       const uint64_t *val, void **reqs, size_t *k) {
  (void)x;
  ucp_request_param_t rp = {.op_attr_mask = UCP_OP_ATTR_FIELD_DATATYPE,
                            .datatype = ucp_dt_make_contig(sizeof(uint64_t))};
  for (size_t i = 0; i < n && !p->failed; i++) {
    void *req = ucp_atomic_op_nbx(
        p->ep, UCP_ATOMIC_OP_ADD, val, 1,
        p->rec.meta_base + page[i] * p->rec.meta_stride + p->rec.rpins_off, p->rk_meta, &rp);
    if (UCS_PTR_IS_ERR(req))
      p->failed = (int)UCS_PTR_STATUS(req);
    else if (req)
      reqs[(*k)++] = req;
  }
}

/* Post a flush of p's endpoint behind what was posted on it (its request into x->reqs[*k]). */
static void post_flush(skv__xfer_t *x, xfer_peer_t *p, size_t *k) {
  if (p->failed) return;
  ucp_request_param_t rp = {.op_attr_mask = 0};
  void *req = ucp_ep_flush_nbx(p->ep, &rp);
  if (UCS_PTR_IS_ERR(req))
    p->failed = (int)UCS_PTR_STATUS(req);
  else if (req)
    x->reqs[(*k)++] = req;
}

static int reqs_room(skv__xfer_t *x, size_t need) {
  if (need <= x->reqs_cap) return 0;
  void **r = realloc(x->reqs, need * sizeof(*r));
  if (!r) return SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_KV, "cluster: out of memory");
  x->reqs = r;
  x->reqs_cap = need;
  return 0;
}

int skv__xfer_pin_pages(skv__xfer_t *x, uint32_t peer, const uint32_t *page, const uint32_t *gen,
                        size_t n, size_t *held) {
  *held = 0;
  size_t bad = 0;
  xfer_peer_t *p = NULL;
  SKV_CHECK(call_begin(x, peer, page, n, &p, &bad));
  if (n == 0) return 0;
  if (!p->rec.rpins_off)
    return SKV_FAIL(SKV_EPROTO, SKV_SUBSYS_KV, "cluster: node '%s' takes no remote pins", p->name);
  SKV_CHECK(reqs_room(x, n + 1));
  /* the adds, landed (a flush: a fence only orders each lane of the endpoint, and the adds and
   * the reads may take different lanes on some transports), then the state words: the Dekker
   * pair of a local pin (pool.h) */
  size_t k = 0;
  post_rpins(x, p, page, n, &rpin_add, x->reqs, &k);
  post_flush(x, p, &k);
  SKV_CHECK(wait_reqs(x, p, x->reqs, k));
  k = 0;
  ucp_request_param_t rp = {.op_attr_mask = 0};
  for (size_t i = 0; i < n && !p->failed; i++) {
    void *req = ucp_get_nbx(p->ep, &x->words[i], sizeof(uint64_t),
                            p->rec.meta_base + page[i] * p->rec.meta_stride, p->rk_meta, &rp);
    if (UCS_PTR_IS_ERR(req))
      p->failed = (int)UCS_PTR_STATUS(req);
    else if (req)
      x->reqs[k++] = req;
  }
  int rc = wait_reqs(x, p, x->reqs, k);
  if (rc) return rc;
  size_t h = 0;
  while (h < n && (uint32_t)x->words[h] == 2u /* SKV_PAGE_READY */ &&
         (uint32_t)(x->words[h] >> 32) == gen[h])
    h++;
  *held = h;
  /* a page evicted (or being evicted) ends the prefix: the pins from there on go back */
  return h < n ? skv__xfer_unpin_pages(x, peer, page + h, n - h) : 0;
}

int skv__xfer_unpin_pages(skv__xfer_t *x, uint32_t peer, const uint32_t *page, size_t n) {
  size_t bad = 0;
  xfer_peer_t *p = NULL;
  SKV_CHECK(call_begin(x, peer, page, n, &p, &bad));
  if (n == 0) return 0;
  SKV_CHECK(reqs_room(x, n + 1));
  size_t k = 0;
  post_rpins(x, p, page, n, &rpin_sub, x->reqs, &k);
  post_flush(x, p, &k); /* the adds are posted, not done: the flush completes once they landed */
  return wait_reqs(x, p, x->reqs, k);
}
