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
#include <unistd.h>

/* How it works
 * ------------
 * One UCX context per handle, two workers: the serving worker, whose address goes into the
 * node record and which a thread progresses (TCP emulates a get with messages that the target
 * must answer; shared-memory and RDMA transports need nothing from it; pins are messages it
 * answers), and the fetching worker, used by the caller (serialised by the handle's lock). The
 * page area (host memory, or GPU memory where UCX has CUDA) and the page records (host memory)
 * are registered with ucp_mem_map and their memory keys packed into the node record:
 *
 *   [ record header | worker address | rkey of the pages | rkey of the records ]
 *
 * A get of n pages from one peer is a pipeline of sub-batches of about XFER_SUB_BYTES, at most
 * XFER_DEPTH of them in flight, each in a slot of a registered staging buffer (host memory, or
 * GPU memory for SKV_CLUSTER_GPU_DIRECT): its pages' ucp_get_nbx, then one 8-byte get per page
 * of its state word, read after the pages' bytes. Where ucp_worker_fence costs nothing (its
 * weak and ep_based modes: fence_setup) the state words go right behind a fence; otherwise
 * (a strong fence would wait for everything in flight) they are read on a second endpoint once
 * the sub-batch's bytes landed. The oldest sub-batch is waited for, checked and handed to the
 * caller (who copies it into engine blocks) while the next ones are on the wire, and its slot
 * takes the next sub-batch: the network does not wait for the copies, nor for the checks. An
 * owner bumps a page's generation before it writes new bytes into it, so a state word read
 * after the bytes that still says READY with the generation the directory gave means the bytes
 * read are that page's (a seqlock whose reader checks once, after); a sub-batch with a page
 * that fails the check is not handed over.
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

/* ucp_ep_query's list of an endpoint's transports (UCX 1.14 on) */
#define XFER_EP_TRANSPORTS (UCP_API_MAJOR > 1 || UCP_API_MINOR >= 14)

#define XFER_MAGIC     0x736b76636c757333ull /* "skvclus3": pins are active messages */
#define XFER_MAX_PEERS 1024
#define SERVE_SPIN_NS  (2 * 1000 * 1000) /* the serving thread polls 2 ms after a request */
#define SERVE_POLL_MS  20                /* and then sleeps at most this long (see serve_main) */
#define XFER_SUB_BYTES (4ull << 20)      /* bytes of a sub-batch of a get (one page at least) */
#define XFER_DEPTH     3                 /* sub-batches in flight */
#define XFER_PIN_BATCH 1024              /* pages per pin message (4 KiB; its answer 8 KiB) */
#define XFER_AM_PIN    1                 /* active message ids: a pin or unpin request */
#define XFER_AM_ANSWER 2                 /* and its answer */

typedef struct xfer_pin_hdr {
  uint64_t token; /* echoed by the answer */
  uint32_t op;    /* 0: pin, 1: unpin */
  uint32_t n;     /* pages (uint32_t each) in the message's data */
} xfer_pin_hdr_t;

typedef struct xfer_rec {
  uint64_t magic, nonce;
  uint64_t page_bytes, page_stride, pages, pages_base, meta_base, meta_stride;
  uint32_t addr_len, rk_pages_len, rk_meta_len, rpins_off;
  uint32_t flags, pad; /* XFER_REC_GPU: the pages are GPU memory */
} xfer_rec_t;

#define XFER_REC_GPU 1u

typedef struct xfer_peer {
  char name[SKV__CL_NAME_CAP];
  xfer_rec_t rec;
  void *blob; /* the record, for connecting */
  size_t blob_len;
  ucp_ep_h ep;  /* the pages' bytes, and their state words where a fence orders them */
  ucp_ep_h ep2; /* pins, and state words read once the bytes landed: a connection of their own,
                 * so that over TCP they do not queue behind megabytes of pages in flight */
  ucp_rkey_h rk_pages, rk_meta, rk_meta2; /* rk_meta2: the records', unpacked for ep2 */
  volatile int failed;                    /* ucs_status_t of the endpoint's error, 0 while good */
  int8_t direct; /* UCX moves GPU memory to here without host buffers: 1, 0, -1 not known yet */
  int8_t cuda;   /* a CUDA transport among the endpoint's (cuda_ipc...): 1, 0, -1 not known */
} xfer_peer_t;

typedef struct xfer_staging {
  char *buf;
  size_t cap;
  ucp_mem_h mh;
  bool registered; /* host staging registered with CUDA by mem.host_register (not by UCX) */
} xfer_staging_t;

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
  /* XFER_DEPTH slots that pages are read into, in host memory [0] or GPU memory [1]:
   * registered, so that UCX reads zero-copy where the transport can */
  xfer_staging_t stg[2];
  skv__xfer_mem_ops_t mem; /* CUDA registration of [0], allocation of [1] */
  bool cuda;               /* UCX reads and writes GPU memory */
  bool fence;              /* state words behind a fence (else once the bytes landed) */
  /* the exported page records, for pins (serving thread) */
  char *ex_meta;
  uint64_t ex_meta_stride, ex_pages;
  uint32_t ex_rpins_off;
  /* the pin call in flight (caller, under the handle's lock) */
  uint64_t pin_seq, pin_token;
  uint64_t *pin_out;
  size_t pin_n;
  int pin_answered; /* 1: answered, -1: an answer that did not parse */
  /* a pin message's header and pages, kept until its send completed (or is left to it) */
  xfer_pin_hdr_t *pin_msg;
  int cur_stg;    /* the staging of the get in progress (0 host, 1 GPU, 2 the caller's buffer), -1
                   * outside one */
  bool into_left; /* the caller's buffer was left to a stuck transfer (skv__xfer_get_pages) */
};

/* An answer sent later than its handler returned: the request and the answer go (a request
 * freed while in flight would get no callback, and the answer would leak). */
static void ans_sent(void *req, ucs_status_t st, void *user_data) {
  (void)st;
  ucp_request_free(req);
  free(user_data);
}

static int ucx_fail(ucs_status_t st, const char *what) {
  return SKV_FAIL(SKV_ECONN, SKV_SUBSYS_KV,
                  "cluster: %s failed: %s (UCX; check UCX_TLS and UCX_NET_DEVICES)", what,
                  ucs_status_string(st));
}

static void staging_free(skv__xfer_t *x, xfer_staging_t *sg, bool gpu);
static ucs_status_t pin_am(void *arg, const void *header, size_t hlen, void *data, size_t len,
                           const ucp_am_recv_param_t *param);
static ucs_status_t answer_am(void *arg, const void *header, size_t hlen, void *data, size_t len,
                              const ucp_am_recv_param_t *param);

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

/* Does ucp_worker_fence order a get after the gets before it without waiting for them? In its
 * weak mode it does on one RMA lane (TCP: one connection, in order); its strong mode waits for
 * everything in flight, which would stall the pipeline. UCX's "auto" is weak with the old
 * protocols (UCX 1.13 has nothing else) and strong with the new ones (the default since about
 * 1.16); its "ep_based" mode (1.22 has it) fences weakly where the operations share one lane and
 * strongly only where they do not. So: ep_based where the new protocols run and UCX_FENCE_MODE
 * is not set (by the caller, in `cfg`); the state words go behind the fence in weak and
 * ep_based modes, and are read once the bytes landed otherwise. The settings are read from the
 * configuration UCX prints. */
static bool fence_setup(ucp_config_t *cfg) {
  char *text = NULL;
  size_t len = 0;
  FILE *f = open_memstream(&text, &len);
  if (!f) return false;
  ucp_config_print(cfg, f, NULL, UCS_CONFIG_PRINT_CONFIG);
  fclose(f);
  char mode[16] = "", proto[8] = "n";
  long lanes = 1;
  for (char *l = text; l && *l; l = strchr(l, '\n') ? strchr(l, '\n') + 1 : NULL) {
    (void)(sscanf(l, "UCX_FENCE_MODE=%15[a-z_]", mode) ||
           sscanf(l, "UCX_PROTO_ENABLE=%7s", proto) || sscanf(l, "UCX_MAX_RMA_RAILS=%ld", &lanes));
  }
  free(text);
  if (!*mode) return lanes <= 1; /* a UCX without the setting: weak */
  if (strcmp(mode, "auto") == 0 && !getenv("UCX_FENCE_MODE") && proto[0] == 'y' &&
      ucp_config_modify(cfg, "FENCE_MODE", "ep_based") == UCS_OK)
    snprintf(mode, sizeof(mode), "ep_based");
  /* ep_based with several lanes may fence strongly: a flush UCX waits for without a deadline */
  return lanes <= 1 && (strcmp(mode, "ep_based") == 0 || strcmp(mode, "weak") == 0 ||
                        (strcmp(mode, "auto") == 0 && proto[0] == 'n'));
}

int skv__xfer_create(const skv__export_t *ex, uint64_t nonce, int timeout_ms, skv__xfer_t **out,
                     const void **blob, size_t *blob_len) {
  *out = NULL;
  skv__xfer_t *x = calloc(1, sizeof(*x));
  if (!x) return SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_KV, "cluster: out of memory");
  x->timeout_ms = timeout_ms;
  x->cur_stg = -1;
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
                     .features = UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP,
                     .mt_workers_shared = 1};
  x->fence = fence_setup(cfg);
  st = ucp_init(&pp, cfg, &x->ctx);
  ucp_config_release(cfg);
  if (st != UCS_OK) {
    rc = ucx_fail(st, "ucp_init");
    goto fail;
  }
  ucp_context_attr_t ca = {.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES};
  x->cuda =
      ucp_context_query(x->ctx, &ca) == UCS_OK && (ca.memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA));
  if (ex->pages && ex->pages_gpu && !x->cuda) {
    const char *tls = getenv("UCX_TLS");
    rc = SKV_FAIL(SKV_ENOTSUP, SKV_SUBSYS_KV,
                  "skv_cluster_join: this cache's pages are in GPU memory, but UCX %s reads no "
                  "GPU memory (built without CUDA, as Debian's is, or UCX_TLS=%s without "
                  "cuda_copy): use a UCX built with CUDA (the libucx-cu12 wheel's, "
                  "docs/cluster.md), or join with opts.flags = SKV_CLUSTER_NO_EXPORT to read "
                  "other nodes' pages without exporting these",
                  ucp_get_version_string(), tls ? tls : "(unset)");
    goto fail;
  }
  ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
                            .thread_mode = UCS_THREAD_MODE_SINGLE};
  if ((st = ucp_worker_create(x->ctx, &wp, &x->serve)) != UCS_OK ||
      (st = ucp_worker_create(x->ctx, &wp, &x->fetch)) != UCS_OK) {
    rc = ucx_fail(st, "ucp_worker_create");
    goto fail;
  }
  x->ex_meta = ex->meta_base;
  x->ex_meta_stride = ex->meta_stride;
  x->ex_pages = ex->pages;
  x->ex_rpins_off = ex->rpins_off;
  ucp_am_handler_param_t hp = {.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID |
                                             UCP_AM_HANDLER_PARAM_FIELD_CB |
                                             UCP_AM_HANDLER_PARAM_FIELD_ARG,
                               .id = XFER_AM_ANSWER,
                               .cb = answer_am,
                               .arg = x};
  if ((st = ucp_worker_set_am_recv_handler(x->fetch, &hp)) != UCS_OK ||
      (ex->pages && ex->rpins_off &&
       (hp.id = XFER_AM_PIN, hp.cb = pin_am,
        (st = ucp_worker_set_am_recv_handler(x->serve, &hp)) != UCS_OK))) {
    rc = ucx_fail(st, "ucp_worker_set_am_recv_handler");
    goto fail;
  }
  if ((st = ucp_worker_get_address(x->serve, &addr, &addr_len)) != UCS_OK) {
    rc = ucx_fail(st, "ucp_worker_get_address");
    goto fail;
  }
  if (ex->pages) {
    ucp_mem_map_params_t mp = {
        .field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                      UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE,
        .address = ex->pages_base,
        .length = ex->pages * ex->page_stride,
        .memory_type = ex->pages_gpu ? UCS_MEMORY_TYPE_CUDA : UCS_MEMORY_TYPE_HOST};
    if ((st = ucp_mem_map(x->ctx, &mp, &x->mh_pages)) != UCS_OK) {
      rc = ucx_fail(st, ex->pages_gpu ? "ucp_mem_map of the pages (GPU memory)"
                                      : "ucp_mem_map of the pages");
      goto fail;
    }
    mp.memory_type = UCS_MEMORY_TYPE_HOST;
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
                  .rpins_off = ex->rpins_off,
                  .flags = ex->pages && ex->pages_gpu ? XFER_REC_GPU : 0};
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
           "cluster: UCX %s (GPU memory: %s; state words %s), exporting %" PRIu64
           " pages of %" PRIu64 " bytes%s, node record %zu bytes",
           ucp_get_version_string(), x->cuda ? "yes" : "no",
           x->fence ? "behind a fence between host memories" : "read once the bytes landed",
           ex->pages, ex->page_bytes, ex->pages_gpu ? " in GPU memory" : "", x->blob_len);
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
  xfer_staging_t *sg = x->cur_stg >= 0 && x->cur_stg < 2 ? &x->stg[x->cur_stg] : NULL;
  if (x->cur_stg == 2) x->into_left = true;
  SKV_WARN(SKV_SUBSYS_KV,
           "cluster: %s did not complete within %d ms; leaving the buffers (%zu bytes) to them "
           "and taking new ones",
           who, x->timeout_ms, (sg ? sg->cap : 0) + x->words_cap * sizeof(uint64_t));
  if (sg) memset(sg, 0, sizeof(*sg));
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
  if (p->rk_meta2) ucp_rkey_destroy(p->rk_meta2);
  p->rk_pages = p->rk_meta = p->rk_meta2 = NULL;
  ucp_ep_h *eps[2] = {&p->ep, &p->ep2};
  for (int i = 0; i < 2; i++) {
    if (!*eps[i]) continue;
    ucp_request_param_t rp = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS,
                              .flags = UCP_EP_CLOSE_FLAG_FORCE};
    void *req = ucp_ep_close_nbx(*eps[i], &rp);
    bool to;
    (void)wait_req(x, req, skv__now_ms() + 2000, &to);
    *eps[i] = NULL;
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
  staging_free(x, &x->stg[0], false);
  staging_free(x, &x->stg[1], true);
  if (x->mh_pages) ucp_mem_unmap(x->ctx, x->mh_pages);
  if (x->mh_meta) ucp_mem_unmap(x->ctx, x->mh_meta);
  if (x->fetch) ucp_worker_destroy(x->fetch);
  if (x->serve) ucp_worker_destroy(x->serve);
  if (x->ctx) ucp_cleanup(x->ctx);
  free(x->reqs);
  free(x->words);
  free(x->pin_msg);
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
  p->direct = p->cuda = -1;
  p->rec = r;
  memcpy(p->blob, blob, len);
  p->blob_len = len;
  *peer = x->npeers;
  x->peers[x->npeers] = p;
  /* published after the peer: skv__xfer_npeers and skv__xfer_peer_name need no lock */
  __atomic_store_n(&x->npeers, x->npeers + 1, __ATOMIC_RELEASE);
  return 0;
}

const char *skv__xfer_peer_name(const skv__xfer_t *x, uint32_t peer) {
  return peer < skv__xfer_npeers(x) ? x->peers[peer]->name : NULL;
}
bool skv__xfer_peer_failed(const skv__xfer_t *x, uint32_t peer) {
  return peer >= x->npeers || x->peers[peer]->failed;
}
uint32_t skv__xfer_npeers(const skv__xfer_t *x) {
  return __atomic_load_n(&x->npeers, __ATOMIC_ACQUIRE);
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
  if (st == UCS_OK && (st = ucp_ep_create(x->fetch, &ep, &p->ep2)) != UCS_OK) peer_close(x, p);
  if (st != UCS_OK) {
    p->ep = p->ep2 = NULL;
    p->failed = (int)st;
    return SKV_FAIL(SKV_EPEERDEAD, SKV_SUBSYS_KV, "cluster: cannot reach node '%s': %s", p->name,
                    ucs_status_string(st));
  }
  const char *rk = b + sizeof(xfer_rec_t) + p->rec.addr_len;
  if (!p->rec.pages || (st = ucp_ep_rkey_unpack(p->ep, rk, &p->rk_pages)) != UCS_OK ||
      (st = ucp_ep_rkey_unpack(p->ep, rk + p->rec.rk_pages_len, &p->rk_meta)) != UCS_OK ||
      (st = ucp_ep_rkey_unpack(p->ep2, rk + p->rec.rk_pages_len, &p->rk_meta2)) != UCS_OK) {
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

#if XFER_EP_TRANSPORTS
/* Can the NICs read and write GPU memory themselves (GPUDirect RDMA: the nvidia_peermem module,
 * whose memory peer the kernel lists)? What UCX's InfiniBand transports need to register it. */
static bool nic_reads_gpu(void) {
  return access("/sys/kernel/mm/memory_peers/nv_mem/version", F_OK) == 0 ||
         access("/sys/module/nvidia_peermem", F_OK) == 0;
}
#endif

bool skv__xfer_gpu_direct_lanes(const char *const *names, size_t n, bool nic_gpu) {
  for (size_t i = 0; i < n; i++) {
    const char *t = names[i];
    if (!t) continue;
    if (strcmp(t, "cuda_ipc") == 0 || strcmp(t, "gdr_copy") == 0) return true;
    if (nic_gpu &&
        (strncmp(t, "rc_", 3) == 0 || strncmp(t, "dc_", 3) == 0 || strncmp(t, "ud_", 3) == 0))
      return true;
  }
  return false;
}

/* The endpoint's transports, once (connected): p->direct and p->cuda; left at -1 where UCX
 * cannot tell (before 1.14). */
static void peer_lanes(xfer_peer_t *p) {
  if (p->direct >= 0) return;
#if XFER_EP_TRANSPORTS
  ucp_transport_entry_t e[16];
  ucp_ep_attr_t a = {.field_mask = UCP_EP_ATTR_FIELD_TRANSPORTS};
  a.transports.entries = e;
  a.transports.num_entries = SKV_ARRAY_LEN(e);
  a.transports.entry_size = sizeof(e[0]);
  if (ucp_ep_query(p->ep, &a) != UCS_OK) return;
  const unsigned n = SKV_MIN(a.transports.num_entries, (unsigned)SKV_ARRAY_LEN(e));
  const char *names[SKV_ARRAY_LEN(e)];
  char list[256] = "";
  size_t at = 0;
  bool cuda = false;
  for (unsigned i = 0; i < n; i++) {
    const char *t = e[i].transport_name ? e[i].transport_name : "?";
    names[i] = e[i].transport_name;
    cuda |= strstr(t, "cuda") != NULL || strstr(t, "gdr") != NULL;
    if (at < sizeof list)
      at += (size_t)snprintf(list + at, sizeof list - at, "%s%s/%s", i ? " " : "", t,
                             e[i].device_name ? e[i].device_name : "?");
  }
  const bool nic = nic_reads_gpu();
  p->cuda = cuda;
  p->direct = skv__xfer_gpu_direct_lanes(names, n, nic);
  SKV_INFO(SKV_SUBSYS_KV,
           "cluster: node '%s' over %s (GPUDirect RDMA %s): pages for GPU layouts go %s", p->name,
           list, nic ? "present" : "absent",
           p->direct ? "straight into GPU memory" : "through pinned host memory");
#else
  (void)p;
#endif
}

bool skv__xfer_peer_gpu_direct(skv__xfer_t *x, uint32_t peer) {
  if (!x->cuda || peer >= x->npeers) return false;
  xfer_peer_t *p = x->peers[peer];
  if (p->direct < 0 && (p->failed || peer_connect(x, p) != 0)) return false; /* the get says why */
  peer_lanes(p);
  return p->direct > 0;
}

int skv__xfer_peer_host_only(skv__xfer_t *x, uint32_t peer, bool *host_only) {
  *host_only = false;
  if (peer >= x->npeers) return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_KV, "cluster: no peer %u", peer);
  xfer_peer_t *p = x->peers[peer];
  if (!x->cuda) { /* a UCX without CUDA makes no CUDA call */
    *host_only = true;
    return 0;
  }
  if (p->failed)
    return SKV_FAIL(SKV_EPEERDEAD, SKV_SUBSYS_KV, "cluster: node '%s' failed earlier", p->name);
  SKV_CHECK(peer_connect(x, p));
  peer_lanes(p);
  *host_only = p->cuda == 0; /* not known (UCX before 1.14): not sure */
  return 0;
}

void skv__xfer_set_mem_ops(skv__xfer_t *x, const skv__xfer_mem_ops_t *ops) {
  x->mem = *ops;
}

bool skv__xfer_cuda(const skv__xfer_t *x) {
  return x->cuda;
}

/* [p, p + len) of host or GPU memory registered with UCX (*mh; NULL on a failure, set by name). */
static int mem_map(skv__xfer_t *x, void *p, size_t len, bool gpu, ucp_mem_h *mh, const char *what) {
  ucp_mem_map_params_t mp = {.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS |
                                           UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                                           UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE,
                             .address = p,
                             .length = len,
                             .memory_type = gpu ? UCS_MEMORY_TYPE_CUDA : UCS_MEMORY_TYPE_HOST};
  ucs_status_t st = ucp_mem_map(x->ctx, &mp, mh);
  if (st == UCS_OK) return 0;
  *mh = NULL;
  return ucx_fail(st, what);
}

int skv__xfer_map(skv__xfer_t *x, void *p, size_t len, void **memh) {
  ucp_mem_h mh = NULL;
  const int rc = mem_map(x, p, len, false, &mh, "ucp_mem_map of the fetch ring");
  *memh = mh;
  return rc;
}

void skv__xfer_unmap(skv__xfer_t *x, void *memh) {
  if (memh) ucp_mem_unmap(x->ctx, memh);
}

bool skv__xfer_into_left(const skv__xfer_t *x) {
  return x->into_left;
}

unsigned skv__xfer_progress(void *x) {
  return ucp_worker_progress(((skv__xfer_t *)x)->fetch);
}

static void staging_free(skv__xfer_t *x, xfer_staging_t *sg, bool gpu) {
  if (sg->mh) ucp_mem_unmap(x->ctx, sg->mh);
  if (sg->buf && gpu)
    x->mem.gpu_free(sg->buf);
  else if (sg->buf) {
    if (sg->registered) (void)x->mem.host_register(sg->buf, sg->cap, false);
    free(sg->buf);
  }
  memset(sg, 0, sizeof(*sg));
}

/* A registered buffer of at least `bytes` in host memory (registered with CUDA too when
 * host_register is set) or GPU memory: grown, never shrunk. */
static int staging(skv__xfer_t *x, bool gpu, size_t bytes) {
  xfer_staging_t *sg = &x->stg[gpu];
  if (sg->cap >= bytes) return 0;
  staging_free(x, sg, gpu);
  if (gpu && (!x->cuda || !x->mem.gpu_alloc))
    return SKV_FAIL(SKV_ENOTSUP, SKV_SUBSYS_KV,
                    "cluster: GPU staging needs a UCX with CUDA and a cache with the CUDA backend");
  if (gpu) {
    SKV_CHECK(x->mem.gpu_alloc(bytes, (void **)&sg->buf));
  } else if (posix_memalign((void **)&sg->buf, 4096, bytes) != 0) {
    sg->buf = NULL;
    return SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_KV, "cluster: out of memory (%zu bytes of staging)",
                    bytes);
  }
  sg->cap = bytes;
  int rc = mem_map(x, sg->buf, bytes, gpu, &sg->mh, "ucp_mem_map of the staging buffer");
  if (!rc && !gpu && x->mem.host_register) {
    rc = x->mem.host_register(sg->buf, bytes, true);
    sg->registered = rc == 0;
    if (rc > 0) rc = 0; /* registered already (UCX's cuda_copy does it): UCX undoes it */
  }
  if (rc) staging_free(x, sg, gpu); /* unregisters only what this registered (none) */
  return rc;
}

/* Put pages [first, first + c) of the call on the wire into `buf`: their requests into reqs,
 * *k of them. A failure to post marks the peer. */
static void issue_sub(xfer_peer_t *p, const uint32_t *page, size_t first, size_t c, uint64_t off,
                      uint64_t len, char *buf, ucp_mem_h mh, void **reqs, size_t *k) {
  ucp_request_param_t rp = {.op_attr_mask = UCP_OP_ATTR_FIELD_MEMH, .memh = mh};
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
}

/* Read the state words of pages [first, first + c) of the call into x->words: on the pages'
 * endpoint behind a fence (fenced), or on the second one once the bytes landed. Requests into
 * reqs, *k of them. */
static void issue_states(skv__xfer_t *x, xfer_peer_t *p, bool fenced, const uint32_t *page,
                         size_t first, size_t c, void **reqs, size_t *k) {
  ucp_request_param_t rp = {.op_attr_mask = 0};
  *k = 0;
  for (size_t i = first; i < first + c && !p->failed; i++) {
    void *req = ucp_get_nbx(fenced ? p->ep : p->ep2, &x->words[i], sizeof(uint64_t),
                            p->rec.meta_base + page[i] * p->rec.meta_stride,
                            fenced ? p->rk_meta : p->rk_meta2, &rp);
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
                        size_t n, uint64_t off, uint64_t len, bool to_gpu,
                        const skv__xfer_into_t *into, skv__xfer_deliver_fn deliver, void *arg,
                        size_t *bad) {
  *bad = 0;
  if (into) x->into_left = false;
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
  if (!into) SKV_CHECK(staging(x, to_gpu, depth * sub * pb));
  xfer_staging_t *sg = &x->stg[to_gpu];
  /* where sub-batch h lands: its slot of the staging, or its place in the caller's buffer */
#define XFER_LAND(h) (into ? (char *)into->buf + (h)*sub * pb : sg->buf + ((h) % depth) * sub * pb)
  /* a fence orders the state words behind the bytes where both go host memory to host memory
   * (one lane: fence_setup); GPU memory on either side may take another transport's lane */
  const bool fenced = x->fence && !to_gpu && !(p->rec.flags & XFER_REC_GPU);
  x->cur_stg = into ? 2 : to_gpu; /* the one abandon_buffers leaves to a stuck transfer */
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
      const size_t c = SKV_MIN(sub, n - first);
      issue_sub(p, page, first, c, off, len, XFER_LAND(head), into ? into->memh : sg->mh,
                x->reqs + s * 2 * sub, &k[s]);
      if (fenced) { /* the state words right behind, in order */
        ucs_status_t st = p->failed ? UCS_OK : ucp_worker_fence(x->fetch);
        if (st != UCS_OK) p->failed = (int)st;
        size_t ks = 0;
        issue_states(x, p, true, page, first, c, x->reqs + s * 2 * sub + k[s], &ks);
        k[s] += ks;
      }
    }
    if (tail == head) { /* nothing in flight: the peer failed before a post */
      rc = SKV_FAIL(SKV_EPEERDEAD, SKV_SUBSYS_KV,
                    "cluster: node '%s' failed during a read of pages", p->name);
      break;
    }
    const size_t s = tail % depth, first = tail * sub, c = SKV_MIN(sub, n - first);
    tail++;
    if ((rc = wait_reqs(x, p, x->reqs + s * 2 * sub, k[s])) != 0) break;
    if (!fenced) { /* the bytes are here: their state words now (the next sub-batches stay on
                    * the wire meanwhile) */
      issue_states(x, p, false, page, first, c, x->reqs + s * 2 * sub, &k[s]);
      if ((rc = wait_reqs(x, p, x->reqs + s * 2 * sub, k[s])) != 0) break;
    }
    for (size_t i = first; i < first + c && stale == n; i++)
      if ((uint32_t)x->words[i] != 2u /* SKV_PAGE_READY */ ||
          (uint32_t)(x->words[i] >> 32) != gen[i])
        stale = i;
    if (stale < n) break;
    if ((rc = deliver(arg, first, c, XFER_LAND(tail - 1))) != 0) {
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
#undef XFER_LAND
  x->cur_stg = -1;
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

/* A pin or unpin is an active message to the owner's serving worker, whose handler adds to the
 * pages' rpins words and answers with their state words, read after the adds (the Dekker pair
 * of a local pin, pool.h). Not UCX atomics: UCX 1.22 fails its software atomics (those of TCP)
 * on endpoints with error handling ("cannot find remote protocol"; ucx_perftest -t ucp_add -e
 * shows it too), and one round trip answers both the adds and the reads. */
static ucs_status_t pin_am(void *arg, const void *header, size_t hlen, void *data, size_t len,
                           const ucp_am_recv_param_t *param) {
  skv__xfer_t *x = arg;
  xfer_pin_hdr_t h;
  if (hlen != sizeof(h) || (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) ||
      !(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP))
    return UCS_OK; /* not a request of this version: dropped (its sender times out) */
  memcpy(&h, header, sizeof(h));
  if (len != (size_t)h.n * sizeof(uint32_t) || h.n > XFER_PIN_BATCH || h.op > 1) return UCS_OK;
  /* the answer: the token (its header), then the state words; kept until it is sent */
  uint64_t *ans = malloc((1 + (size_t)h.n) * sizeof(uint64_t));
  if (!ans) return UCS_OK;
  ans[0] = h.token;
  for (uint32_t i = 0; i < h.n; i++) {
    uint32_t page;
    memcpy(&page, (const char *)data + i * sizeof(page), sizeof(page));
    ans[1 + i] = 0; /* not READY: a page this node does not have */
    if (page >= x->ex_pages) continue;
    char *rec = x->ex_meta + page * x->ex_meta_stride;
    __atomic_add_fetch((uint64_t *)(rec + x->ex_rpins_off), h.op ? SKV_RPIN_SUB : SKV_RPIN_ADD,
                       __ATOMIC_SEQ_CST);
    ans[1 + i] = __atomic_load_n((uint64_t *)rec, __ATOMIC_SEQ_CST); /* the state word */
  }
  ucp_request_param_t rp = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK |
                                            UCP_OP_ATTR_FIELD_USER_DATA,
                            .flags = UCP_AM_SEND_FLAG_EAGER,
                            .cb.send = ans_sent,
                            .user_data = ans};
  void *req = ucp_am_send_nbx(param->reply_ep, XFER_AM_ANSWER, ans, sizeof(uint64_t), ans + 1,
                              h.n * sizeof(uint64_t), &rp);
  if (req == NULL || UCS_PTR_IS_ERR(req)) free(ans); /* sent at once (no callback), or not */
  return UCS_OK;                                     /* else ans_sent frees both */
}

/* The answer to the pin call in flight (fetching worker); a late one (of a call that gave up)
 * carries an older token and is dropped. */
static ucs_status_t answer_am(void *arg, const void *header, size_t hlen, void *data, size_t len,
                              const ucp_am_recv_param_t *param) {
  skv__xfer_t *x = arg;
  uint64_t token;
  if (hlen != sizeof(token) || (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV)) return UCS_OK;
  memcpy(&token, header, sizeof(token));
  if (token != x->pin_token || x->pin_answered) return UCS_OK;
  if (len == x->pin_n * sizeof(uint64_t)) {
    memcpy(x->pin_out, data, len);
    x->pin_answered = 1;
  } else {
    x->pin_answered = -1;
  }
  return UCS_OK;
}

/* Pins (op 0) or unpins (op 1) of pages page[0..n) of p, in messages of XFER_PIN_BATCH pages,
 * each waited for (bounded); the state words after the adds into states[0..n). SKV_EPEERDEAD
 * (the endpoint closed) when the peer fails or does not answer in time. */
static int pin_call(skv__xfer_t *x, xfer_peer_t *p, uint32_t op, const uint32_t *page, size_t n,
                    uint64_t *states) {
  const size_t cap = sizeof(xfer_pin_hdr_t) + XFER_PIN_BATCH * sizeof(uint32_t);
  if (!x->pin_msg && !(x->pin_msg = malloc(cap)))
    return SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_KV, "cluster: out of memory");
  for (size_t done = 0; done < n;) {
    const size_t c = SKV_MIN(n - done, (size_t)XFER_PIN_BATCH);
    /* the message (header, pages) stays in x->pin_msg until its send completed */
    xfer_pin_hdr_t *h = x->pin_msg;
    *h = (xfer_pin_hdr_t){.token = ++x->pin_seq, .op = op, .n = (uint32_t)c};
    memcpy(h + 1, page + done, c * sizeof(uint32_t));
    x->pin_token = h->token, x->pin_out = states + done, x->pin_n = c, x->pin_answered = 0;
    ucp_request_param_t rp = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS,
                              .flags = UCP_AM_SEND_FLAG_EAGER | UCP_AM_SEND_FLAG_REPLY};
    void *req =
        ucp_am_send_nbx(p->ep2, XFER_AM_PIN, h, sizeof(*h), h + 1, c * sizeof(uint32_t), &rp);
    ucs_status_t st = UCS_PTR_IS_ERR(req) ? UCS_PTR_STATUS(req) : UCS_OK;
    if (UCS_PTR_IS_ERR(req)) req = NULL;
    const uint64_t deadline_ms = skv__now_ms() + (uint64_t)x->timeout_ms;
    bool to = false;
    while (st == UCS_OK && !p->failed && (req || !x->pin_answered)) {
      if (req && (st = ucp_request_check_status(req)) != UCS_INPROGRESS) {
        ucp_request_free(req);
        req = NULL;
        continue;
      }
      st = UCS_OK;
      if (ucp_worker_progress(x->fetch) != 0) continue;
      sched_yield(); /* the owner's serving thread may need this core (as in wait_reqs) */
      if ((to = skv__now_ms() >= deadline_ms)) break;
    }
    x->pin_token = 0; /* an answer from now on is late */
    if (st == UCS_OK && !p->failed && !to && x->pin_answered == 1) {
      done += c;
      continue;
    }
    const int failed = p->failed;
    if (!p->failed) p->failed = st != UCS_OK ? (int)st : -1;
    peer_close(x, p); /* cancels the send, if it is still in flight */
    if (req && !settle(x, req, skv__now_ms() + (uint64_t)x->timeout_ms)) {
      SKV_WARN(SKV_SUBSYS_KV,
               "cluster: a cancelled pin message did not complete within %d ms; leaving its "
               "buffer to it",
               x->timeout_ms);
      x->pin_msg = NULL; /* the send may still read it */
    }
    if (req) ucp_request_free(req);
    const char *why = to                          ? "no answer within the timeout"
                      : st != UCS_OK              ? ucs_status_string(st)
                      : failed > 0 || failed < -1 ? ucs_status_string((ucs_status_t)failed)
                      : x->pin_answered < 0       ? "its answer did not parse"
                                                  : "its endpoint failed";
    return SKV_FAIL(SKV_EPEERDEAD, SKV_SUBSYS_KV, "cluster: node '%s' failed a %s of %zu pages: %s",
                    p->name, op ? "unpin" : "pin", c, why);
  }
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
  SKV_CHECK(pin_call(x, p, 0, page, n, x->words));
  size_t h = 0;
  while (h < n && (uint32_t)x->words[h] == 2u /* SKV_PAGE_READY */ &&
         (uint32_t)(x->words[h] >> 32) == gen[h])
    h++;
  *held = h;
  /* a page evicted (or being evicted) ends the prefix: the pins from there on go back */
  return h < n ? pin_call(x, p, 1, page + h, n - h, x->words + h) : 0;
}

int skv__xfer_unpin_pages(skv__xfer_t *x, uint32_t peer, const uint32_t *page, size_t n) {
  size_t bad = 0;
  xfer_peer_t *p = NULL;
  SKV_CHECK(call_begin(x, peer, page, n, &p, &bad));
  return n ? pin_call(x, p, 1, page, n, x->words) : 0;
}
