/* The CUDA data path of the KV cache: fetch into and publish from engine blocks in GPU memory
 * (pages on any PE), one kernel launch per batch on the caller's stream, pins released and keys
 * inserted by the cache's completion thread once the copy is complete; host layouts over GPU
 * pages. */
#define _GNU_SOURCE
#include "kv/kv_cuda.h"

#include "kernels/kv_copy.h"
#include "cuda/device.h"

#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* How it works
 * ------------
 * Arguments. A launch's arguments (the engine's tensor bases, the (pe, page) pairs and the
 * block ids) are written into an argument slot of pinned, device-mapped host memory owned by the
 * cache: nothing to allocate per call. Small batches (up to 3.4 KiB of arguments, e.g. 300
 * pages of one block) travel in the kernel's parameters (no memory round trip before the first
 * page load). Larger ones of a batch that reads a peer's pages are read by the kernels from the
 * slot over PCIe, a few bytes per 8 KiB chunk: the NVLink transfer hides those reads (measured
 * faster than copying the arguments to device memory first). A batch that stays in this GPU
 * (publish; a fetch of this PE's own pages) would wait on them instead, a copy within HBM
 * running five times faster than NVLink: its arguments are copied to the slot's device mirror
 * first, one DMA on the caller's stream (measured on 2 H200, batches of 64 MiB to 1 GiB: local
 * fetches 1.06-2.4x and publishes 0.99-2.2x the speed with the arguments read over PCIe;
 * docs/gpu.md).
 * RING_SLOTS slots serve ordinary calls; a slot is handed back once the launch that used it
 * completed, and a call that finds none free waits for one, bounded by the context's timeout.
 * Batches larger than a slot (beyond 4096 pages, or fewer when pages have many blocks) are split
 * into several launches.
 *
 * Fetch. Every reference is pinned on the host first (the generation check): a stale one
 * fails with SKV_ESTALE before anything is enqueued. Then, per launch: the copy on the caller's
 * stream and an event recorded after it. The cache's completion thread watches the events of
 * the launches in flight (cudaEventQuery, sleeping 2 us doubling to 100 us while any is
 * pending, on a condition variable while none is) and, once a launch's event has completed,
 * releases its pins (and the caller's, with SKV_FETCH_UNPIN) and hands its slot back. Callers
 * do the same for what has completed: each fetch and publish first (the previous step's pins go
 * at once, not at the thread's next look), a call waiting for a slot, and skv_kv_sync (every
 * 20 us); each use of a slot has a sequence number, so one completion never counts twice. Pins
 * are thus released only once the copy is complete, and the caller's stream carries nothing but
 * the copy and an event. (The first version enqueued cudaLaunchHostFunc on a side stream
 * waiting for the event: measured on 2 H200, that callback cost the caller's stream 2-3 us per
 * launch, even on another stream of another priority; the event and the wait alone cost
 * nothing. bench/gpu/latency_probe.cu shows it.)
 *
 * The copy (the process-wide variant, SKV_FETCH_KERNEL): "bulk" (default), the TMA kernel for
 * 16-byte aligned runs of 128 bytes and more, else the vec kernel; "vec"; or "ce", the copy
 * engines through cudaMemcpyBatchAsync, one copy per run, for runs of 8 KiB and more and at
 * most 8192 copies, else the vec kernel. Measured on 2 H200 (NV18): the SM kernels pull about
 * 372 GB/s from a peer (vec and bulk alike, 0.94 of the contiguous copy-engine copy), the copy
 * engines 389 GB/s for 64-256 MiB batches but cost the host ~0.5 us per copy (a 64 MiB batch
 * of 32 KiB runs: 56 GB/s end to end against 246 GB/s for the kernel) and slow down past ~8k
 * copies; they leave the SMs to the engine, which is why they stay an option.
 *
 * Publish. The host allocates the pages (WRITING: no one can pin or evict them), launches the
 * blocks -> pages kernel, and once it completed the completion thread makes each page READY
 * and inserts its key, then commits it (LRU) or frees it (key present: deduplicated; no index
 * slot), exactly the steps the host path takes synchronously. *ninserted counts the pages
 * queued; skv_kv_sync waits for the launches to be completed and the stats count what was
 * inserted.
 *
 * Graph capture. While the caller's stream is being captured a fetch takes no pins and
 * leaves nothing to complete (the graph may be replayed any number of times, much later): every
 * reference must already be pinned by this PE (skv_lookup with SKV_LOOKUP_PIN), and stays so
 * while the graph is replayed. Its arguments go to a slot of a separate pool, dedicated to
 * that graph for the cache's lifetime. Publish is refused while capturing: a replay would
 * write into pages that may have been evicted and reused since.
 *
 * Host layouts over GPU pages (cuda backend; cuda_host pages take the host path in kv.c): the
 * call is synchronous, like the host path: pages go through a host staging buffer (a DMA on the
 * caller's stream, then the host copy of copy_host.c), pins and index steps as on the host.
 *
 * What can go wrong
 * -----------------
 * - A stream that never completes (blocked on an event, a hung kernel): calls that need a slot
 *   and skv_kv_sync time out with SKV_ETIMEDOUT; at destroy the completion thread is stopped
 *   and the slots of launches still pending are leaked (a kernel may still read them).
 * - The completion thread queries events without the lock and completes launches with it; no
 *   thread holds the lock across a CUDA call. A query failing with an error other than "not
 *   ready" (a broken context) completes the launch anyway and records the error for
 *   skv_kv_sync: the pins go, since no copy will ever run again.
 * - A launch whose event cannot be recorded after the kernel was enqueued: the call waits for
 *   the stream and completes the launch itself, so pins never leak.
 * - A kernel refusing corrupted arguments (device-side checks) sets the cache's error word;
 *   skv_kv_sync reports it. */

#define SLOT_BYTES       (512u << 10)
#define RING_SLOTS       8
#define GRAPH_SLOTS      8
#define NSLOTS           (RING_SLOTS + GRAPH_SLOTS)
#define MAX_LAUNCH_PAGES 4096u
#define ERR_BYTES        256u
#define STAGE_BYTES      (64ull << 20) /* host layouts over GPU pages: bytes per bounce */
#define CE_MIN_RUN       (8u << 10)    /* copy-engine fetch: runs of at least this many bytes */
#define CE_MAX_COPIES    8192u         /* and at most this many copies per cudaMemcpyBatchAsync */

enum { SLOT_FETCH = 1, SLOT_PUBLISH = 2 };
#define REF_STEP                                                                  \
  (sizeof(skv_page_ref_t) / sizeof(uint32_t)) /* uint32s from one ref to the next \
                                               */

typedef struct slot {
  struct kv_cuda *kc;
  uint8_t *args;     /* SLOT_BYTES of pinned host memory */
  uint8_t *args_dev; /* its device address */
  uint8_t *mirror;   /* SLOT_BYTES of device memory: a copy of args for large batches */
  cudaEvent_t done;  /* recorded after the kernel on the caller's stream */
  int kind;
  uint32_t n;        /* pages of the launch */
  uint32_t refs_off; /* byte offset of the (pe, page) pairs in args */
  bool unpin_caller; /* SKV_FETCH_UNPIN */
  skv_key_t *keys;   /* publish: the pages' keys (ring slots only) */
  struct slot *next; /* in the free ring, or in the pending list */
  uint64_t seq;      /* uses of the slot: a completion names the use it saw */
} slot_t;

typedef struct kv_cuda {
  skv_kv_t *kv;
  int device, sms;
  uint8_t *pinned; /* the slots, then the error word */
  uint8_t *pinned_dev;
  uint8_t *mirrors; /* device memory: one argument mirror per slot */
  uint32_t *err, *err_dev;
  slot_t slots[NSLOTS];
  pthread_mutex_t mu;  /* free ring, pending list, inflight, graph slots, errors, closed, stop */
  pthread_cond_t cv;   /* a slot was handed back */
  pthread_cond_t work; /* the completion thread: a launch is pending, or stop */
  bool sync_init;
  slot_t *free_ring;
  slot_t *pending;  /* ring slots whose launch was enqueued, not yet completed */
  pthread_t reaper; /* the completion thread */
  bool reaper_on, stop;
  int graph_used;
  uint64_t inflight; /* ring slots taken and not yet handed back */
  int cb_err;        /* first failure while completing a launch */
  char cb_msg[384];
  bool closed;
  int ce_off; /* the copy-engine path failed once (driver without cudaMemcpyBatchAsync) */
} kv_cuda_t;

/* ---- the kernel variant ------------------------------------------------------------------- */

static pthread_once_t var_once = PTHREAD_ONCE_INIT;
static skv_kv_variant_t var = {SKV_KV_KERNEL_BULK, 4, 4, 256, SKV_KV_ARGS_AUTO, 0};
static pthread_mutex_t var_mu = PTHREAD_MUTEX_INITIALIZER;

static void var_load(void) {
  long long v;
  if (skv__env_int(SKV_ENV_FETCH_UNROLL, 4, 8, 4, &v) == 0 && (v == 4 || v == 8))
    var.unroll = (int)v;
  else
    SKV_WARN(SKV_SUBSYS_KV, "SKV_FETCH_UNROLL must be 4 or 8; using %d", var.unroll);
  if (skv__env_int(SKV_ENV_FETCH_CTAS, 1, 32, 4, &v) == 0)
    var.ctas_per_sm = (int)v;
  else
    SKV_WARN(SKV_SUBSYS_KV, "SKV_FETCH_CTAS must be in 1..32; using %d", var.ctas_per_sm);
  if (skv__env_int(SKV_ENV_FETCH_THREADS, 128, 512, 256, &v) == 0 &&
      (v == 128 || v == 256 || v == 512))
    var.threads = (int)v;
  else
    SKV_WARN(SKV_SUBSYS_KV, "SKV_FETCH_THREADS must be 128, 256 or 512; using %d", var.threads);
  const char *k = skv__env(SKV_ENV_FETCH_KERNEL);
  static const char *const kinds[] = {"vec", "bulk", "ce"};
  for (int i = 0; k && i < 3; i++)
    if (strcmp(k, kinds[i]) == 0) var.kernel = i, k = NULL;
  if (k)
    SKV_WARN(SKV_SUBSYS_KV, "SKV_FETCH_KERNEL=%s is not vec, bulk or ce; using %s", k,
             kinds[var.kernel]);
}

int skv__kv_cuda_variant_set(const skv_kv_variant_t *v) {
  pthread_once(&var_once, var_load);
  SKV_ARG_CHECK(v, SKV_SUBSYS_KV, "kernel variant: NULL");
  SKV_ARG_CHECK(v->kernel >= SKV_KV_KERNEL_VEC && v->kernel <= SKV_KV_KERNEL_CE, SKV_SUBSYS_KV,
                "kernel variant: kernel %d is not vec (0), bulk (1) or ce (2)", v->kernel);
  SKV_ARG_CHECK(v->unroll == 4 || v->unroll == 8, SKV_SUBSYS_KV,
                "kernel variant: unroll %d is not 4 or 8", v->unroll);
  SKV_ARG_CHECK(v->ctas_per_sm >= 1 && v->ctas_per_sm <= 32, SKV_SUBSYS_KV,
                "kernel variant: %d CTAs per SM is not in 1..32", v->ctas_per_sm);
  SKV_ARG_CHECK(v->threads == 128 || v->threads == 256 || v->threads == 512, SKV_SUBSYS_KV,
                "kernel variant: %d threads per CTA is not 128, 256 or 512", v->threads);
  SKV_ARG_CHECK(v->args >= SKV_KV_ARGS_AUTO && v->args <= SKV_KV_ARGS_DEVICE, SKV_SUBSYS_KV,
                "kernel variant: argument mode %d is not auto (0), mapped (1) or device (2)",
                v->args);
  pthread_mutex_lock(&var_mu);
  var = *v;
  pthread_mutex_unlock(&var_mu);
  return 0;
}

void skv__kv_cuda_variant_get(skv_kv_variant_t *v) {
  pthread_once(&var_once, var_load);
  pthread_mutex_lock(&var_mu);
  *v = var;
  pthread_mutex_unlock(&var_mu);
}

const char *skv__kv_cuda_variant_name(const skv_kv_variant_t *v, char *buf, size_t cap) {
  skv_kv_variant_t cur;
  if (!v) {
    skv__kv_cuda_variant_get(&cur);
    v = &cur;
  }
  static const char *const args[] = {"auto", "mapped", "device"};
  if (v->kernel == SKV_KV_KERNEL_CE)
    snprintf(buf, cap, "ce+vec_u%d_c%d_t%d_%s", v->unroll, v->ctas_per_sm, v->threads,
             args[v->args]);
  else if (v->kernel == SKV_KV_KERNEL_BULK)
    snprintf(buf, cap, "bulk_c%d_%s", v->ctas_per_sm, args[v->args]);
  else
    snprintf(buf, cap, "vec_u%d_c%d_t%d_%s%s", v->unroll, v->ctas_per_sm, v->threads, args[v->args],
             v->l2_256 ? "_p256" : "");
  return buf;
}

static skv_kv_copy_cfg_t variant_cfg(const kv_cuda_t *kc) {
  skv_kv_variant_t v;
  skv__kv_cuda_variant_get(&v);
  skv_kv_copy_cfg_t c = {v.kernel, v.unroll, v.ctas_per_sm, v.threads, v.args, v.l2_256, kc->sms};
  return c;
}

uint32_t *skv__kv_cuda_err_word(skv_kv_t *kv) {
  kv_cuda_t *kc = kv ? kv->cuda : NULL;
  return kc ? kc->err : NULL;
}

/* ---- set-up --------------------------------------------------------------------------------- */

static void reaper_stop(kv_cuda_t *kc) {
  if (!kc->reaper_on) return;
  pthread_mutex_lock(&kc->mu);
  kc->stop = true;
  pthread_cond_broadcast(&kc->work);
  pthread_mutex_unlock(&kc->mu);
  pthread_join(kc->reaper, NULL);
  kc->reaper_on = false;
}

static void kc_free(kv_cuda_t *kc) {
  reaper_stop(kc);
  for (int i = 0; i < NSLOTS; i++) {
    if (kc->slots[i].done) cudaEventDestroy(kc->slots[i].done);
    free(kc->slots[i].keys);
  }
  if (kc->pinned) cudaFreeHost(kc->pinned);
  if (kc->mirrors) cudaFree(kc->mirrors);
  (void)cudaGetLastError();
  if (kc->sync_init) {
    pthread_mutex_destroy(&kc->mu);
    pthread_cond_destroy(&kc->cv);
    pthread_cond_destroy(&kc->work);
  }
  free(kc);
}

static void *reaper_main(void *arg);

int skv__kv_cuda_init(skv_kv_t *kv) {
  kv->cuda = NULL;
  if (kv->data->info.backend == SKV_BACKEND_HOST) return 0; /* no GPU involved, none touched */
  SKV_CHECK(skv__cuda_use(kv->ctx));
  pthread_once(&var_once, var_load);
  kv_cuda_t *kc = calloc(1, sizeof *kc);
  if (!kc) return SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_KV, "skv_kv_create: out of memory");
  int rc = 0;
  kc->kv = kv;
  kc->device = kv->ctx->device;
  SKV_CUDA_CHECK_GOTO(cudaDeviceGetAttribute(&kc->sms, cudaDevAttrMultiProcessorCount, kc->device),
                      SKV_SUBSYS_KV, rc, fail);
  SKV_CUDA_CHECK_GOTO((cudaError_t)skv__kv_copy_preload(), SKV_SUBSYS_KV, rc, fail);
  size_t bytes = (size_t)NSLOTS * SLOT_BYTES + ERR_BYTES;
  SKV_CUDA_CHECK_GOTO(
      cudaHostAlloc((void **)&kc->pinned, bytes, cudaHostAllocMapped | cudaHostAllocPortable),
      SKV_SUBSYS_KV, rc, fail);
  void *dev = NULL;
  SKV_CUDA_CHECK_GOTO(cudaHostGetDevicePointer(&dev, kc->pinned, 0), SKV_SUBSYS_KV, rc, fail);
  kc->pinned_dev = dev;
  SKV_CUDA_CHECK_GOTO(cudaMalloc((void **)&kc->mirrors, (size_t)NSLOTS * SLOT_BYTES), SKV_SUBSYS_KV,
                      rc, fail);
  memset(kc->pinned, 0, bytes);
  kc->err = (uint32_t *)(kc->pinned + (size_t)NSLOTS * SLOT_BYTES);
  kc->err_dev = (uint32_t *)(kc->pinned_dev + (size_t)NSLOTS * SLOT_BYTES);
  for (int i = 0; i < NSLOTS; i++) {
    slot_t *s = &kc->slots[i];
    s->kc = kc;
    s->args = kc->pinned + (size_t)i * SLOT_BYTES;
    s->args_dev = kc->pinned_dev + (size_t)i * SLOT_BYTES;
    s->mirror = kc->mirrors + (size_t)i * SLOT_BYTES;
    if (i < RING_SLOTS) {
      SKV_CUDA_CHECK_GOTO(cudaEventCreateWithFlags(&s->done, cudaEventDisableTiming), SKV_SUBSYS_KV,
                          rc, fail);
      s->keys = malloc(MAX_LAUNCH_PAGES * sizeof *s->keys);
      if (!s->keys) {
        rc = SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_KV, "skv_kv_create: out of memory");
        goto fail;
      }
      s->next = kc->free_ring;
      kc->free_ring = s;
    }
  }
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_mutex_init(&kc->mu, NULL);
  pthread_cond_init(&kc->cv, &ca);
  pthread_cond_init(&kc->work, &ca);
  pthread_condattr_destroy(&ca);
  kc->sync_init = true;
  /* the completion thread takes no signals: they stay the engine's threads' */
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  int te = pthread_create(&kc->reaper, NULL, reaper_main, kc);
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  if (te) {
    rc = SKV_FAIL(-te, SKV_SUBSYS_KV, "skv_kv_create: starting the completion thread failed: %s",
                  strerror(te));
    goto fail;
  }
  kc->reaper_on = true;
  kv->cuda = kc;
  char vb[32];
  SKV_INFO(SKV_SUBSYS_KV,
           "CUDA data path on GPU %d (%d SMs): %d + %d argument slots of %u KiB, kernel variant %s",
           kc->device, kc->sms, RING_SLOTS, GRAPH_SLOTS, SLOT_BYTES >> 10,
           skv__kv_cuda_variant_name(NULL, vb, sizeof vb));
  return 0;
fail:
  kc_free(kc);
  return rc;
}

void skv__kv_cuda_fini(skv_kv_t *kv) {
  kv_cuda_t *kc = kv->cuda;
  if (!kc) return;
  kv->cuda = NULL;
  (void)skv__cuda_use(kv->ctx);
  reaper_stop(kc);
  pthread_mutex_lock(&kc->mu);
  uint64_t busy = kc->inflight;
  kc->closed = true;
  pthread_mutex_unlock(&kc->mu);
  if (busy) {
    SKV_WARN(SKV_SUBSYS_KV,
             "skv_kv_destroy: %" PRIu64 " stream-ordered fetches or publishes never completed; "
             "their argument slots are leaked, since their kernels may still read them (the "
             "streams must be stuck)",
             busy);
    return;
  }
  kc_free(kc);
}

/* ---- slots and their completion ------------------------------------------------------------- */

static int reap_locked(kv_cuda_t *kc);

static int slot_get(kv_cuda_t *kc, slot_t **out, const char *fn) {
  int ms = kc->kv->ctx->cfg.timeout_ms;
  const struct timespec dl = skv__ts_at(skv__now_ns() + (uint64_t)ms * 1000000u);
  pthread_mutex_lock(&kc->mu);
  if (!kc->free_ring) (void)reap_locked(kc);
  while (!kc->free_ring) {
    if (pthread_cond_timedwait(&kc->cv, &kc->mu, &dl) == ETIMEDOUT && !kc->free_ring) {
      pthread_mutex_unlock(&kc->mu);
      return SKV_FAIL(
          SKV_ETIMEDOUT, SKV_SUBSYS_KV,
          "%s: all %d argument slots of this cache stayed in use for %d ms: earlier fetches or "
          "publishes have not completed on their streams (is a stream blocked, or waiting for "
          "something this thread would do next?)",
          fn, RING_SLOTS, ms);
    }
  }
  slot_t *s = kc->free_ring;
  kc->free_ring = s->next;
  kc->inflight++;
  pthread_mutex_unlock(&kc->mu);
  *out = s;
  return 0;
}

/* Hand a ring slot back (kc->mu held). */
static void slot_put_locked(kv_cuda_t *kc, slot_t *s) {
  s->kind = 0;
  s->next = kc->free_ring;
  kc->free_ring = s;
  kc->inflight--;
  pthread_cond_broadcast(&kc->cv);
}

static void slot_put(kv_cuda_t *kc, slot_t *s) {
  pthread_mutex_lock(&kc->mu);
  slot_put_locked(kc, s);
  pthread_mutex_unlock(&kc->mu);
}

static void note_err_locked(kv_cuda_t *kc, int err) {
  if (kc->cb_err) return;
  kc->cb_err = err;
  snprintf(kc->cb_msg, sizeof kc->cb_msg, "%s", skv_last_error());
}

/* The host path's last steps for a page of `key` just written: READY, index insert, then LRU
 * (inserted) or free (deduplicated, or no index slot). Returns 1 when inserted. */
static int publish_finish(skv_kv_t *kv, uint32_t page, skv_key_t key) {
  int me = kv->pool.me;
  skv__pool_ready(&kv->pool, page, key.hi, key.lo);
  uint32_t gen = skv__st_gen(__atomic_load_n(&kv->pool.meta[me][page].state, __ATOMIC_ACQUIRE));
  int r = skv__index_insert(&kv->index, key, skv__val_pack((uint32_t)me, page, gen), me);
  if (r == 0) {
    skv__pool_commit(&kv->pool, page);
    __atomic_add_fetch(&kv->published, 1, __ATOMIC_RELAXED);
    return 1;
  }
  skv__pool_release(&kv->pool, page);
  if (r == SKV_EEXIST) {
    __atomic_add_fetch(&kv->deduplicated, 1, __ATOMIC_RELAXED);
  } else if (__atomic_fetch_add(&kv->index_full, 1, __ATOMIC_RELAXED) == 0) {
    SKV_WARN(SKV_SUBSYS_KV,
             "skv_publish: a key found no free index slot near its home and was not cached; "
             "if this happens often, create the cache with more index_slots");
  }
  return 0;
}

/* A launch completed, with kc->mu held: release pins or finish the pages. */
static void slot_complete_locked(kv_cuda_t *kc, slot_t *s) {
  if (kc->closed) return; /* the cache is gone: nothing left to update */
  skv_kv_t *kv = kc->kv;
  const uint32_t *pp = (const uint32_t *)(s->args + s->refs_off);
  for (uint32_t k = 0; k < s->n; k++) {
    uint32_t pe = pp[2 * k], page = pp[2 * k + 1];
    if (s->kind == SLOT_FETCH) {
      int r = skv__pool_unpin(&kv->pool, pe, page);
      if (r == 0 && s->unpin_caller) r = skv__pool_unpin(&kv->pool, pe, page);
      if (r) note_err_locked(kc, r);
    } else {
      publish_finish(kv, page, s->keys[k]);
    }
  }
}

/* Complete a launch that is in no list (its enqueue failed half way). */
static void slot_done(slot_t *s) {
  kv_cuda_t *kc = s->kc;
  pthread_mutex_lock(&kc->mu);
  slot_complete_locked(kc, s);
  slot_put_locked(kc, s);
  pthread_mutex_unlock(&kc->mu);
}

/* Hand a launch whose event was recorded to the completion thread. */
static void slot_pending(kv_cuda_t *kc, slot_t *s) {
  pthread_mutex_lock(&kc->mu);
  s->seq++;
  s->next = kc->pending;
  kc->pending = s;
  pthread_cond_signal(&kc->work);
  pthread_mutex_unlock(&kc->mu);
}

/* Complete the pending launches whose events have completed (in any order: they may be on
 * different streams). Called with kc->mu held, which it drops around the event queries; a
 * launch whose slot left the list or was used again meanwhile (another thread completed it) is
 * left alone: each use of a slot has its own sequence number. Returns how many it completed. */
static int reap_locked(kv_cuda_t *kc) {
  slot_t *snap[RING_SLOTS];
  uint64_t seq[RING_SLOTS];
  int n = 0;
  for (slot_t *s = kc->pending; s && n < RING_SLOTS; s = s->next) snap[n] = s, seq[n++] = s->seq;
  if (n == 0) return 0;
  pthread_mutex_unlock(&kc->mu);
  cudaError_t st[RING_SLOTS];
  bool any = false;
  for (int i = 0; i < n; i++) {
    st[i] = cudaEventQuery(snap[i]->done);
    if (st[i] != cudaErrorNotReady) any = true;
  }
  if (any) (void)cudaGetLastError();
  pthread_mutex_lock(&kc->mu);
  int done = 0;
  for (int i = 0; i < n && any; i++) {
    if (st[i] == cudaErrorNotReady) continue;
    slot_t **pp = &kc->pending;
    while (*pp && *pp != snap[i]) pp = &(*pp)->next;
    if (!*pp || snap[i]->seq != seq[i]) continue; /* completed by another thread */
    *pp = snap[i]->next;
    if (st[i] != cudaSuccess && !kc->cb_err) {
      kc->cb_err = SKV_ECUDA;
      snprintf(kc->cb_msg, sizeof kc->cb_msg,
               "a fetch or publish could not be confirmed complete: %s (%s); its pins were "
               "released",
               cudaGetErrorString(st[i]), cudaGetErrorName(st[i]));
    }
    slot_complete_locked(kc, snap[i]);
    slot_put_locked(kc, snap[i]);
    done++;
  }
  return done;
}

/* What a caller does first: complete what has completed (e.g. the previous step's fetch), so
 * that its pins go now rather than at the completion thread's next look. */
static void reap(kv_cuda_t *kc) {
  pthread_mutex_lock(&kc->mu);
  if (kc->pending) (void)reap_locked(kc);
  pthread_mutex_unlock(&kc->mu);
}

/* The completion thread: sleeps 2 us doubling to 100 us while launches are pending and none
 * completed; waits for work when none is pending. */
static void *reaper_main(void *arg) {
  kv_cuda_t *kc = arg;
  (void)cudaSetDevice(kc->device);
  long nap_ns = 2000;
  pthread_mutex_lock(&kc->mu);
  while (!kc->stop) {
    if (!kc->pending) {
      pthread_cond_wait(&kc->work, &kc->mu);
      nap_ns = 2000;
      continue;
    }
    if (reap_locked(kc) > 0) {
      nap_ns = 2000;
      continue;
    }
    pthread_mutex_unlock(&kc->mu);
    struct timespec ts = {0, nap_ns};
    nanosleep(&ts, NULL);
    nap_ns = nap_ns * 2 > 100000 ? 100000 : nap_ns * 2;
    pthread_mutex_lock(&kc->mu);
  }
  pthread_mutex_unlock(&kc->mu);
  return NULL;
}

/* ---- launches ------------------------------------------------------------------------------- */

typedef struct plan {
  skv_kv_copy_desc_t d;
  skv_kv_copy_cfg_t cfg;
  uint32_t bases_bytes; /* offset of the (pe, page) pairs in a slot */
  uint32_t bid_bytes;   /* 4 or 8 */
  uint32_t ppl;         /* pages per launch */
  bool ce;              /* fetch with the copy engines (dense runs, not capturing) */
  bool local;           /* the launch's pages are all this PE's (set by slot_fill) */
} plan_t;

/* Describe copies between this cache's pages and `lay` (a device layout on this PE's GPU). */
static int plan_make(kv_cuda_t *kc, const skv_layout_t *lay, int dir, plan_t *pl, const char *fn) {
  skv_kv_t *kv = kc->kv;
  const skv_geometry_t *g = &kv->geom;
  if (lay->device != kc->device)
    return SKV_FAIL(
        SKV_EINVAL, SKV_SUBSYS_KV,
        "%s: the layout describes memory of GPU %d but this PE uses GPU %d (config.device / "
        "SKV_DEVICE): the copy kernels run on the PE's GPU, so its engine cache must be there",
        fn, lay->device, kc->device);
  memset(pl, 0, sizeof *pl);
  skv_kv_copy_desc_t *d = &pl->d;
  const uint64_t e = g->elem_bytes;
  d->dir = dir;
  d->heap = (uint64_t)(uintptr_t)kv->data->info.base + kv->data->info.data_offset;
  d->pe_stride = kv->data->info.stride;
  d->page_stride = kv->page_stride;
  d->npes = (uint32_t)kv->pool.npes;
  d->pages_per_pe = (uint32_t)kv->pool.pages;
  d->ntensors = lay->num_layers * lay->kvn;
  d->heads = g->num_kv_heads;
  d->row_bytes = g->head_dim * g->elem_bytes;
  d->page_tokens = g->page_tokens;
  d->block_tokens = lay->block_tokens;
  d->blocks_per_page = lay->blocks_per_page;
  d->num_blocks = lay->num_blocks;
  d->stride_block = lay->stride_block * (int64_t)e;
  d->stride_token = lay->stride_token * (int64_t)e;
  d->stride_head = lay->stride_head * (int64_t)e;
  d->run_bytes = (uint32_t)SKV_MIN(lay->run_bytes, skv__geometry_slab_bytes(g));
  d->bid64 = lay->num_blocks > UINT32_MAX;
  d->err = kc->err_dev;
  /* the vector width: every row, stride and base a multiple of it */
  uint64_t acc = d->row_bytes | d->heap | d->pe_stride | d->page_stride |
                 (uint64_t)d->stride_block | (uint64_t)d->stride_token | (uint64_t)d->stride_head;
  for (uint32_t t = 0; t < d->ntensors; t++) acc |= (uint64_t)(uintptr_t)lay->base[t];
  uint32_t w = 16;
  while (w > 1 && (acc & (w - 1))) w >>= 1;
  d->width = w;
  pl->cfg = variant_cfg(kc);
  pl->bases_bytes = (uint32_t)SKV_ALIGN_UP((uint64_t)d->ntensors * 8, 16);
  pl->bid_bytes = d->bid64 ? 8 : 4;
  uint64_t per = 8 + (uint64_t)d->blocks_per_page * pl->bid_bytes;
  if (pl->bases_bytes + per > SLOT_BYTES)
    return SKV_FAIL(
        SKV_ENOTSUP, SKV_SUBSYS_KV,
        "%s: the arguments of one page (%u block ids) do not fit a %u KiB argument slot: use "
        "fewer blocks per page (a larger block_tokens)",
        fn, d->blocks_per_page, SLOT_BYTES >> 10);
  uint64_t kmax = skv__kv_copy_max_pages(d, &pl->cfg);
  if (kmax == 0)
    return SKV_FAIL(
        SKV_ENOTSUP, SKV_SUBSYS_KV,
        "%s: one layer's K or V of a page is 2 GiB or more, beyond what the copy kernels address: "
        "lower page_tokens",
        fn);
  uint64_t ppl = SKV_MIN((uint64_t)MAX_LAUNCH_PAGES, (SLOT_BYTES - pl->bases_bytes) / per);
  pl->ppl = (uint32_t)SKV_MIN(ppl, kmax);
  /* the copy engines: dense runs only (enqueue also caps the copies of one launch) */
  pl->ce = pl->cfg.kernel == SKV_KV_KERNEL_CE && dir == SKV_KV_COPY_FETCH &&
           d->run_bytes >= CE_MIN_RUN && !__atomic_load_n(&kc->ce_off, __ATOMIC_RELAXED);
  return 0;
}

/* Write the arguments of pages [0, k) into slot `s`: (pe[q * pe_step], page[q * page_step])
 * pairs, and block ids taken from `bids` (m per page) at page indices idx[q] (idx NULL: q). */
static void slot_fill(slot_t *s, plan_t *pl, const skv_layout_t *lay, uint32_t k,
                      const uint32_t *pe, size_t pe_step, const uint32_t *page, size_t page_step,
                      const uint64_t *bids, const size_t *idx) {
  uint64_t *bases = (uint64_t *)s->args;
  for (uint32_t t = 0; t < pl->d.ntensors; t++) bases[t] = (uint64_t)(uintptr_t)lay->base[t];
  uint32_t *pp = (uint32_t *)(s->args + pl->bases_bytes);
  const uint32_t me = (uint32_t)s->kc->kv->pool.me;
  bool local = true;
  for (uint32_t q = 0; q < k; q++) {
    pp[2 * q] = pe[q * pe_step];
    pp[2 * q + 1] = page[q * page_step];
    local = local && pe[q * pe_step] == me;
  }
  pl->local = local;
  const uint32_t m = pl->d.blocks_per_page;
  uint8_t *bp = s->args + pl->bases_bytes + 8 * (size_t)k;
  for (uint32_t q = 0; q < k; q++) {
    const uint64_t *src = bids + (idx ? idx[q] : q) * (size_t)m;
    if (pl->bid_bytes == 8)
      memcpy(bp + (size_t)q * m * 8, src, (size_t)m * 8);
    else
      for (uint32_t j = 0; j < m; j++) ((uint32_t *)bp)[(size_t)q * m + j] = (uint32_t)src[j];
  }
  s->n = k;
  s->refs_off = pl->bases_bytes;
  pl->d.n = k;
  pl->d.refs_off = pl->bases_bytes;
  pl->d.bids_off = pl->bases_bytes + 8 * k;
  pl->d.args_bytes = pl->d.bids_off + k * m * pl->bid_bytes;
  pl->d.args_host = s->args;
  pl->d.args_dev = s->args_dev;
}

/* Launch the batch of slot `s`: its arguments go in the kernel parameters when they fit, else
 * they are read in place (mapped) when the batch reads a peer's pages, or copied to the slot's
 * device mirror first (one DMA on the stream) when it stays in this GPU, or with
 * SKV_KV_ARGS_DEVICE. */
static int launch_kernel(slot_t *s, plan_t *pl, void *stream, const char *fn) {
  int e = 0;
  const int mode = pl->cfg.args;
  if (!skv__kv_copy_args_inline(&pl->d, &pl->cfg) &&
      (mode == SKV_KV_ARGS_DEVICE || (mode == SKV_KV_ARGS_AUTO && pl->local))) {
    e = (int)cudaMemcpyAsync(s->mirror, s->args, pl->d.args_bytes, cudaMemcpyHostToDevice,
                             (cudaStream_t)stream);
    pl->d.args_dev = s->mirror;
  }
  if (e == 0) e = skv__kv_copy_launch(&pl->d, &pl->cfg, stream);
  if (e == 0) return 0;
  (void)cudaGetLastError();
  return SKV_FAIL(SKV_ECUDA, SKV_SUBSYS_KV, "%s: launching %s (%u pages) failed: %s (%s)", fn,
                  skv__kv_copy_kernel_name(&pl->d, &pl->cfg), pl->d.n,
                  cudaGetErrorString((cudaError_t)e), cudaGetErrorName((cudaError_t)e));
}

/* The copy engines instead of a kernel: one copy per run (bytes contiguous in the page and in a
 * block, e.g. a whole block's K of one layer), the slot's batch in cudaMemcpyBatchAsync calls of
 * at most CE_MAX_COPIES. The copy engines pull from the peer at the contiguous copy's bandwidth,
 * which SM loads (vec or bulk) stay about 6% under, and leave the SMs to the engine's kernels.
 * *started: some copies were enqueued. */
static int ce_copy(kv_cuda_t *kc, slot_t *s, const plan_t *pl, void *stream, bool *started,
                   const char *fn) {
  const skv_kv_copy_desc_t *d = &pl->d;
  const uint64_t slab = (uint64_t)d->page_tokens * d->heads * d->row_bytes, run = d->run_bytes;
  const uint64_t per_slab = slab / run, count = (uint64_t)d->n * d->ntensors * per_slab;
  const size_t cap = (size_t)SKV_MIN(count, (uint64_t)CE_MAX_COPIES);
  void **dst = malloc(cap * sizeof *dst), **src = malloc(cap * sizeof *src);
  size_t *sz = malloc(cap * sizeof *sz);
  int rc = 0;
  if (!dst || !src || !sz) {
    rc = SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_KV, "%s: out of memory", fn);
    goto out;
  }
  const uint64_t *bases = (const uint64_t *)s->args;
  const uint32_t *pp = (const uint32_t *)(s->args + d->refs_off);
  const uint8_t *bids = s->args + d->bids_off;
  const uint64_t H = d->heads, row = d->row_bytes, bt = d->block_tokens, m = d->blocks_per_page;
  struct cudaMemcpyAttributes at;
  memset(&at, 0, sizeof at);
  at.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  size_t zero = 0, c = 0;
  for (uint32_t i = 0; i < d->n && rc == 0; i++) {
    const uint64_t page = d->heap + pp[2 * i] * d->pe_stride + pp[2 * i + 1] * d->page_stride;
    for (uint32_t t = 0; t < d->ntensors && rc == 0; t++)
      for (uint64_t r = 0; r < per_slab && rc == 0; r++) {
        const uint64_t o = r * run, rw = o / row, tok = rw / H, j = tok / bt;
        const uint64_t bid =
            d->bid64 ? ((const uint64_t *)bids)[i * m + j] : ((const uint32_t *)bids)[i * m + j];
        src[c] = (void *)(uintptr_t)(page + t * slab + o);
        dst[c] = (void *)(uintptr_t)(bases[t] + bid * (uint64_t)d->stride_block +
                                     (tok % bt) * (uint64_t)d->stride_token +
                                     (rw % H) * (uint64_t)d->stride_head + o % row);
        sz[c] = run;
        if (++c < cap && !(i + 1 == d->n && t + 1 == d->ntensors && r + 1 == per_slab)) continue;
        cudaError_t e = cudaMemcpyBatchAsync((void *const *)dst, (const void *const *)src, sz, c,
                                             &at, &zero, 1, (cudaStream_t)stream);
        if (e == cudaSuccess) {
          *started = true;
        } else {
          (void)cudaGetLastError();
          if (!*started && __atomic_exchange_n(&kc->ce_off, 1, __ATOMIC_RELAXED) == 0)
            SKV_WARN(SKV_SUBSYS_KV,
                     "%s: cudaMemcpyBatchAsync failed (%s): fetching with the copy "
                     "kernels from now on",
                     fn, cudaGetErrorString(e));
          rc = SKV_FAIL(SKV_ECUDA, SKV_SUBSYS_KV,
                        "%s: cudaMemcpyBatchAsync of %zu copies failed: %s "
                        "(%s)",
                        fn, c, cudaGetErrorString(e), cudaGetErrorName(e));
        }
        c = 0;
      }
  }
out:
  free(dst);
  free(src);
  free(sz);
  return rc;
}

/* Start the copy of ring slot `s` (copy engines or kernel), and record its event for the
 * completion thread. *consumed: the slot (and the launch's pins or pages) now belong to its
 * completion, which ran or will run. */
static int enqueue(kv_cuda_t *kc, slot_t *s, plan_t *pl, void *stream, bool *consumed,
                   const char *fn) {
  *consumed = false;
  int rc = 0;
  bool started = false;
  /* Copies cost the host about half a microsecond each in cudaMemcpyBatchAsync, and beyond ~8k
   * copies (1 GiB of random pages) the copy engines were measured slower than the kernels. */
  const uint64_t slab = (uint64_t)pl->d.page_tokens * pl->d.heads * pl->d.row_bytes;
  if (pl->ce && (uint64_t)pl->d.n * pl->d.ntensors * (slab / pl->d.run_bytes) > CE_MAX_COPIES)
    pl->ce = false;
  if (pl->ce) {
    rc = ce_copy(kc, s, pl, stream, &started, fn);
    if (rc && !started) {
      if (!__atomic_load_n(&kc->ce_off, __ATOMIC_RELAXED)) return rc;
      rc = 0; /* the copy engines refused the first copies: the kernel does it all */
      pl->ce = false;
    }
  }
  if (!pl->ce) SKV_CHECK(launch_kernel(s, pl, stream, fn));
  *consumed = true;
  cudaError_t e = cudaEventRecord(s->done, (cudaStream_t)stream);
  if (e == cudaSuccess) {
    slot_pending(kc, s);
    return rc;
  }
  /* the copy is enqueued but nothing marks its end: complete it here */
  (void)cudaGetLastError();
  int r2 = SKV_FAIL(SKV_ECUDA, SKV_SUBSYS_KV,
                    "%s: recording the event that marks the end of a copy failed: %s (%s); "
                    "waited for the stream instead",
                    fn, cudaGetErrorString(e), cudaGetErrorName(e));
  if (cudaStreamSynchronize((cudaStream_t)stream) != cudaSuccess) (void)cudaGetLastError();
  slot_done(s);
  return rc ? rc : r2;
}

/* ---- host layouts over GPU pages: bounce through host memory -------------------------------- */

static int pin_all(skv_kv_t *kv, const skv_page_ref_t *refs, size_t n, const char *fn) {
  for (size_t i = 0; i < n; i++) {
    if (skv__pool_pin(&kv->pool, refs[i].pe, refs[i].page, refs[i].gen) != 0) {
      for (size_t j = 0; j < i; j++) skv__pool_unpin(&kv->pool, refs[j].pe, refs[j].page);
      __atomic_add_fetch(&kv->stale, 1, __ATOMIC_RELAXED);
      return SKV_FAIL(
          SKV_ESTALE, SKV_SUBSYS_KV,
          "%s: reference %zu (PE %u, page %u, generation %u) is stale: the page was evicted or "
          "reused; nothing was copied. Look the keys up again (pin them to keep them)",
          fn, i, refs[i].pe, refs[i].page, refs[i].gen);
    }
  }
  return 0;
}

static void unpin_range(skv_kv_t *kv, const skv_page_ref_t *refs, size_t from, size_t to,
                        bool twice) {
  for (size_t i = from; i < to; i++) {
    skv__pool_unpin(&kv->pool, refs[i].pe, refs[i].page);
    if (twice) skv__pool_unpin(&kv->pool, refs[i].pe, refs[i].page);
  }
}

static int bounce_fetch(skv_kv_t *kv, const skv_page_ref_t *refs, size_t n, const skv_layout_t *dst,
                        const uint64_t *block_ids, uint32_t flags, void *stream) {
  const char *fn = "skv_fetch";
  const uint64_t pb = kv->page_bytes;
  const size_t per = (size_t)SKV_MAX(1, STAGE_BYTES / pb), m = dst->blocks_per_page;
  char *buf = malloc(SKV_MIN(n, per) * pb);
  if (!buf)
    return SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_KV, "%s: out of memory for a staging buffer", fn);
  int rc = pin_all(kv, refs, n, fn);
  for (size_t off = 0; rc == 0 && off < n; off += per) {
    size_t k = SKV_MIN(per, n - off);
    for (size_t q = 0; q < k && rc == 0; q++)
      SKV_CUDA_CHECK_GOTO(cudaMemcpyAsync(buf + q * pb,
                                          skv__kv_page(kv, refs[off + q].pe, refs[off + q].page),
                                          pb, cudaMemcpyDeviceToHost, (cudaStream_t)stream),
                          SKV_SUBSYS_KV, rc, copied);
    SKV_CUDA_CHECK_GOTO(cudaStreamSynchronize((cudaStream_t)stream), SKV_SUBSYS_KV, rc, copied);
    for (size_t q = 0; q < k; q++)
      skv__copy_page_to_blocks(dst, buf + q * pb, block_ids + (off + q) * m, false);
  }
copied:
  if (rc == 0) {
    unpin_range(kv, refs, 0, n, false);
    if (flags & SKV_FETCH_UNPIN) rc = skv_unpin(kv, refs, n);
  } else if (rc != SKV_ESTALE) {
    unpin_range(kv, refs, 0, n, false);
  }
  free(buf);
  return rc;
}

static int bounce_publish(skv_kv_t *kv, const skv_key_t *keys, size_t n, const skv_layout_t *src,
                          const uint64_t *block_ids, void *stream, size_t *ninserted) {
  const char *fn = "skv_publish";
  const uint64_t pb = kv->page_bytes;
  const size_t per = (size_t)SKV_MAX(1, STAGE_BYTES / pb), m = src->blocks_per_page;
  char *buf = malloc(SKV_MIN(n, per) * pb);
  uint32_t *pages = malloc(SKV_MIN(n, per) * sizeof *pages);
  size_t *idx = malloc(SKV_MIN(n, per) * sizeof *idx);
  if (!buf || !pages || !idx) {
    free(buf);
    free(pages);
    free(idx);
    return SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_KV, "%s: out of memory for a staging buffer", fn);
  }
  const uint32_t me = (uint32_t)kv->pool.me;
  size_t inserted = 0, i = 0;
  int rc = 0;
  while (i < n && rc == 0) {
    size_t k = 0;
    for (; i < n && k < per; i++) {
      uint64_t val;
      if (skv__index_lookup(&kv->index, keys[i], &val) == 0) continue; /* cached already */
      uint32_t gen;
      uint64_t ev = 0;
      rc = skv__pool_alloc(&kv->pool, skv__kv_evict_cb, kv, &pages[k], &gen, &ev);
      if (rc) break;
      skv__copy_blocks_to_page(src, buf + k * pb, block_ids + i * m, false);
      idx[k++] = i;
    }
    int crc = 0;
    for (size_t q = 0; q < k && crc == 0; q++) {
      cudaError_t e = cudaMemcpyAsync(skv__kv_page(kv, me, pages[q]), buf + q * pb, pb,
                                      cudaMemcpyHostToDevice, (cudaStream_t)stream);
      if (e == cudaSuccess) e = cudaStreamSynchronize((cudaStream_t)stream);
      if (e != cudaSuccess) {
        (void)cudaGetLastError();
        crc = SKV_FAIL(SKV_ECUDA, SKV_SUBSYS_KV, "%s: copying a page to the GPU failed: %s", fn,
                       cudaGetErrorString(e));
      }
    }
    for (size_t q = 0; q < k; q++) {
      if (crc)
        skv__pool_release(&kv->pool, pages[q]);
      else
        inserted += (size_t)publish_finish(kv, pages[q], keys[idx[q]]);
    }
    if (crc) rc = crc;
  }
  if (ninserted) *ninserted = inserted;
  free(buf);
  free(pages);
  free(idx);
  return rc;
}

/* ---- fetch ---------------------------------------------------------------------------------- */

static int capture_fetch(kv_cuda_t *kc, const skv_page_ref_t *refs, size_t n,
                         const skv_layout_t *dst, const uint64_t *block_ids, uint32_t flags,
                         void *stream) {
  const char *fn = "skv_fetch";
  skv_kv_t *kv = kc->kv;
  skv_pool_t *p = &kv->pool;
  if (flags & SKV_FETCH_UNPIN)
    return SKV_FAIL(
        SKV_ECAPTURE, SKV_SUBSYS_KV,
        "%s: SKV_FETCH_UNPIN cannot be captured in a CUDA graph (every replay would release the "
        "pins "
        "again): keep the pins while the graph is replayed and release them with skv_unpin after",
        fn);
  pthread_mutex_lock(&p->pin_mu);
  for (size_t i = 0; i < n; i++) {
    uint32_t c = p->pins[(uint64_t)refs[i].pe * p->pages + refs[i].page];
    uint32_t gen =
        skv__st_gen(__atomic_load_n(&p->meta[refs[i].pe][refs[i].page].state, __ATOMIC_ACQUIRE));
    if (c == 0 || gen != refs[i].gen) {
      pthread_mutex_unlock(&p->pin_mu);
      return SKV_FAIL(SKV_ECAPTURE, SKV_SUBSYS_KV,
                      "%s: reference %zu (PE %u, page %u, generation %u) is %s this PE while the "
                      "stream is being "
                      "captured: a captured fetch takes no pins (the graph may be replayed at any "
                      "time), so look "
                      "the pages up with SKV_LOOKUP_PIN before capturing and keep them pinned "
                      "while the graph is "
                      "replayed",
                      fn, i, refs[i].pe, refs[i].page, refs[i].gen,
                      c == 0 ? "not pinned by" : "stale for");
    }
  }
  pthread_mutex_unlock(&p->pin_mu);
  plan_t pl;
  SKV_CHECK(plan_make(kc, dst, SKV_KV_COPY_FETCH, &pl, fn));
  size_t need = (n + pl.ppl - 1) / pl.ppl;
  pthread_mutex_lock(&kc->mu);
  int first = kc->graph_used;
  bool ok = first + (int)need <= GRAPH_SLOTS;
  if (ok) kc->graph_used += (int)need;
  pthread_mutex_unlock(&kc->mu);
  if (!ok)
    return SKV_FAIL(
        SKV_ECAPTURE, SKV_SUBSYS_KV,
        "%s: this capture needs %zu graph argument slot(s) but %d of this cache's %d are taken by "
        "earlier captures (each captured fetch keeps its slot for the cache's lifetime): capture "
        "fewer fetches, or larger ones (up to %u pages per slot)",
        fn, need, first, GRAPH_SLOTS, pl.ppl);
  for (size_t off = 0, q = 0; off < n; off += pl.ppl, q++) {
    uint32_t k = (uint32_t)SKV_MIN((size_t)pl.ppl, n - off);
    slot_t *s = &kc->slots[RING_SLOTS + first + (int)q];
    s->kind = SLOT_FETCH;
    slot_fill(s, &pl, dst, k, &refs[off].pe, REF_STEP, &refs[off].page, REF_STEP,
              block_ids + off * dst->blocks_per_page, NULL);
    SKV_CHECK(launch_kernel(s, &pl, stream, fn));
  }
  return 0;
}

int skv__kv_cuda_fetch(skv_kv_t *kv, const skv_page_ref_t *refs, size_t n, const skv_layout_t *dst,
                       const uint64_t *block_ids, uint32_t flags, void *stream) {
  const char *fn = "skv_fetch";
  kv_cuda_t *kc = kv->cuda;
  if (!kc) return SKV_FAIL(SKV_EINTERNAL, SKV_SUBSYS_KV, "%s: the cache has no CUDA data path", fn);
  SKV_CHECK(skv__cuda_use(kv->ctx));
  bool capturing = false;
  SKV_CHECK(skv__cuda_capturing(stream, &capturing));
  if (dst->device < 0) {
    if (capturing)
      return SKV_FAIL(
          SKV_ECAPTURE, SKV_SUBSYS_KV,
          "%s: a layout in host memory is copied synchronously, which a CUDA graph cannot capture; "
          "fetch into a GPU layout",
          fn);
    return bounce_fetch(kv, refs, n, dst, block_ids, flags, stream);
  }
  if (capturing) return capture_fetch(kc, refs, n, dst, block_ids, flags, stream);
  reap(kc);
  plan_t pl;
  SKV_CHECK(plan_make(kc, dst, SKV_KV_COPY_FETCH, &pl, fn));
  SKV_CHECK(pin_all(kv, refs, n, fn));
  const bool unpin = (flags & SKV_FETCH_UNPIN) != 0;
  const uint32_t m = dst->blocks_per_page;
  for (size_t off = 0; off < n; off += pl.ppl) {
    uint32_t k = (uint32_t)SKV_MIN((size_t)pl.ppl, n - off);
    slot_t *s;
    int rc = slot_get(kc, &s, fn);
    if (rc) {
      /* nothing enqueued: the caller keeps its pins; after a partial enqueue they all go */
      unpin_range(kv, refs, off, n, unpin && off > 0);
      return rc;
    }
    s->kind = SLOT_FETCH;
    s->unpin_caller = unpin;
    slot_fill(s, &pl, dst, k, &refs[off].pe, REF_STEP, &refs[off].page, REF_STEP,
              block_ids + off * m, NULL);
    bool consumed;
    rc = enqueue(kc, s, &pl, stream, &consumed, fn);
    if (rc) {
      if (!consumed) slot_put(kc, s);
      size_t from = consumed ? off + k : off;
      unpin_range(kv, refs, from, n, unpin && (consumed || off > 0));
      return rc;
    }
  }
  return 0;
}

/* ---- publish -------------------------------------------------------------------------------- */

int skv__kv_cuda_publish(skv_kv_t *kv, const skv_key_t *keys, size_t n, const skv_layout_t *src,
                         const uint64_t *block_ids, void *stream, size_t *ninserted) {
  const char *fn = "skv_publish";
  kv_cuda_t *kc = kv->cuda;
  if (!kc) return SKV_FAIL(SKV_EINTERNAL, SKV_SUBSYS_KV, "%s: the cache has no CUDA data path", fn);
  SKV_CHECK(skv__cuda_use(kv->ctx));
  bool capturing = false;
  SKV_CHECK(skv__cuda_capturing(stream, &capturing));
  if (capturing)
    return SKV_FAIL(
        SKV_ECAPTURE, SKV_SUBSYS_KV,
        "%s cannot be captured in a CUDA graph: a replay would write into pages that may have been "
        "evicted and reused since; publish outside the capture (it is stream-ordered)",
        fn);
  if (src->device < 0) return bounce_publish(kv, keys, n, src, block_ids, stream, ninserted);
  reap(kc); /* pages that completed launches free go back first */
  plan_t pl;
  SKV_CHECK(plan_make(kc, src, SKV_KV_COPY_PUBLISH, &pl, fn));
  uint32_t *pages = malloc(n * sizeof *pages);
  size_t *idx = malloc(n * sizeof *idx);
  if (!pages || !idx) {
    free(pages);
    free(idx);
    return SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_KV, "%s: out of memory", fn);
  }
  /* Allocate first (evicting LRU pages as the host path does); stop at the first failure and
   * still publish what was allocated, as the host path does. */
  size_t q = 0;
  int rc = 0;
  for (size_t i = 0; i < n; i++) {
    uint64_t val;
    if (skv__index_lookup(&kv->index, keys[i], &val) == 0) continue; /* cached already */
    uint32_t gen;
    uint64_t ev = 0;
    rc = skv__pool_alloc(&kv->pool, skv__kv_evict_cb, kv, &pages[q], &gen, &ev);
    if (rc) break;
    idx[q++] = i;
  }
  const uint32_t me = (uint32_t)kv->pool.me;
  size_t queued = 0;
  for (size_t off = 0; off < q; off += pl.ppl) {
    uint32_t k = (uint32_t)SKV_MIN((size_t)pl.ppl, q - off);
    slot_t *s;
    int r = slot_get(kc, &s, fn);
    if (r == 0) {
      s->kind = SLOT_PUBLISH;
      s->unpin_caller = false;
      for (uint32_t j = 0; j < k; j++) s->keys[j] = keys[idx[off + j]];
      slot_fill(s, &pl, src, k, &me, 0, pages + off, 1, block_ids, idx + off);
      bool consumed;
      r = enqueue(kc, s, &pl, stream, &consumed, fn);
      if (consumed)
        queued += k;
      else if (r)
        slot_put(kc, s);
    }
    if (r) {
      for (size_t j = queued; j < q; j++) skv__pool_release(&kv->pool, pages[j]);
      rc = r;
      break;
    }
  }
  if (ninserted) *ninserted = queued;
  free(pages);
  free(idx);
  return rc;
}

/* ---- sync ----------------------------------------------------------------------------------- */

int skv__kv_cuda_sync(skv_kv_t *kv) {
  kv_cuda_t *kc = kv->cuda;
  if (!kc) return 0;
  int ms = kv->ctx->cfg.timeout_ms;
  const uint64_t dl = skv__now_ns() + (uint64_t)ms * 1000000u;
  pthread_mutex_lock(&kc->mu);
  /* look at the events every 20 us (the completion thread may be napping longer) */
  while (kc->inflight > 0 && (reap_locked(kc), kc->inflight > 0)) {
    const uint64_t now = skv__now_ns();
    if (now >= dl) break;
    const struct timespec t = skv__ts_at(SKV_MIN(now + 20000u, dl));
    (void)pthread_cond_timedwait(&kc->cv, &kc->mu, &t);
  }
  uint64_t pending = kc->inflight;
  int cb_err = kc->cb_err;
  char msg[sizeof kc->cb_msg];
  memcpy(msg, kc->cb_msg, sizeof msg);
  kc->cb_err = 0;
  kc->cb_msg[0] = '\0';
  pthread_mutex_unlock(&kc->mu);
  if (pending)
    return SKV_FAIL(
        SKV_ETIMEDOUT, SKV_SUBSYS_KV,
        "skv_kv_sync: %" PRIu64
        " stream-ordered fetches or publishes of this cache did not complete "
        "within %d ms: is one of their streams blocked (an event that never fires, a hung kernel)?",
        pending, ms);
  volatile uint32_t *e = kc->err;
  uint32_t code = e[0];
  if (code) {
    uint32_t i = e[1], t = e[2], v = e[3];
    e[1] = e[2] = e[3] = 0;
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    e[0] = 0;
    const char *what = code == SKV_KV_DEVERR_PE     ? "PE"
                       : code == SKV_KV_DEVERR_PAGE ? "page"
                                                    : "block id";
    return SKV_FAIL(
        code == SKV_KV_DEVERR_BLOCK ? SKV_EINVAL : SKV_ERANGE, SKV_SUBSYS_KV,
        "skv_kv_sync: a copy kernel refused page %u of its batch (tensor %u): %s %u is out of "
        "range, "
        "so that data was not copied and nothing outside the heap and the engine's blocks was "
        "touched. "
        "The host had checked the arguments: they changed afterwards (a captured graph replayed "
        "with "
        "its pages unpinned, or memory corruption); please report it with the SKV_DEBUG=INFO log",
        i, t, what, v);
  }
  if (cb_err)
    return SKV_FAIL(cb_err, SKV_SUBSYS_KV, "skv_kv_sync: a stream-ordered step failed: %s", msg);
  return 0;
}
