/* The CUDA copy backend of the KV cache: its set-up, the entry points kv.c calls (stream-ordered
 * copies split into launches, captured fetches, staging through host memory) and sync. */
#define _GNU_SOURCE
#include "kv/kv_cuda_int.h"

#include <inttypes.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* How it works
 * ------------
 * kv.c owns the protocol (pins, page allocation, the index); this backend only copies. A
 * stream-ordered copy is split into launches of at most a slot's pages; each launch is the
 * copy on the caller's stream and an event recorded after it, and once the event completed the
 * completion (kv_cuda_ring.c) hands the launch's pages back to kv.c through `done`. So pins are
 * released, and published keys inserted, only once the copy is complete.
 *
 * Graph capture. While the caller's stream is being captured a fetch leaves nothing to
 * complete (the graph may be replayed any number of times, much later): kv.c has checked that
 * this PE holds pins on every page, and they stay while the graph is replayed. Its arguments
 * go to slots of a separate pool, dedicated to that graph for the cache's lifetime.
 *
 * Host layouts over GPU pages (cuda backend) are staged: pages are copied to or from a host
 * buffer with DMAs on the caller's stream, which is then waited for; kv.c does the host side. */

#define STAGE_BYTES (64ull << 20) /* host layouts over GPU pages: bytes per staging round */
#define ERR_BYTES   256u
#define GATE_BYTES  (64u * SKV__KVC_NSLOTS) /* gate words (host), mirrors and locks (device) */

static void kc_free(skv__kvc_t *kc) {
  skv__kvc_ring_stop(kc);
  for (int i = 0; i < SKV__KVC_NSLOTS; i++) {
    if (kc->slots[i].done) cudaEventDestroy(kc->slots[i].done);
    free(kc->slots[i].keys);
    free(kc->slots[i].claims);
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

int skv__kvc_create(const skv__kvc_params_t *p, skv__kvc_t **out) {
  *out = NULL;
  SKV_CHECK(skv__cuda_use(p->ctx));
  skv__kvc_t *kc = calloc(1, sizeof *kc);
  if (!kc) return SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_KV, "skv_kv_create: out of memory");
  int rc = 0;
  kc->p = *p;
  kc->geom = *p->geom;
  kc->p.geom = &kc->geom;
  kc->device = p->ctx->device;
  kc->npes = (uint32_t)p->heap->info.npes;
  kc->me = (uint32_t)p->heap->info.my_pe;
  kc->this_gpu = p->heap->gpu_same_pes | 1ull << kc->me;
  SKV_CUDA_CHECK_GOTO(cudaDeviceGetAttribute(&kc->sms, cudaDevAttrMultiProcessorCount, kc->device),
                      SKV_SUBSYS_KV, rc, fail);
  SKV_CUDA_CHECK_GOTO((cudaError_t)skv__kv_copy_preload(), SKV_SUBSYS_KV, rc, fail);
  size_t bytes = (size_t)SKV__KVC_NSLOTS * SKV__KVC_SLOT_BYTES + ERR_BYTES + GATE_BYTES;
  SKV_CUDA_CHECK_GOTO(
      cudaHostAlloc((void **)&kc->pinned, bytes, cudaHostAllocMapped | cudaHostAllocPortable),
      SKV_SUBSYS_KV, rc, fail);
  void *dev = NULL;
  SKV_CUDA_CHECK_GOTO(cudaHostGetDevicePointer(&dev, kc->pinned, 0), SKV_SUBSYS_KV, rc, fail);
  kc->pinned_dev = dev;
  SKV_CUDA_CHECK_GOTO(
      cudaMalloc((void **)&kc->mirrors, (size_t)SKV__KVC_NSLOTS * SKV__KVC_SLOT_BYTES + GATE_BYTES),
      SKV_SUBSYS_KV, rc, fail);
  SKV_CUDA_CHECK_GOTO(
      cudaMemset(kc->mirrors + (size_t)SKV__KVC_NSLOTS * SKV__KVC_SLOT_BYTES, 0, GATE_BYTES),
      SKV_SUBSYS_KV, rc, fail);
  /* landed before any kernel reads a lock (cudaMemset may return before it did) */
  SKV_CUDA_CHECK_GOTO(cudaStreamSynchronize(0), SKV_SUBSYS_KV, rc, fail);
  memset(kc->pinned, 0, bytes);
  kc->err = (uint32_t *)(kc->pinned + (size_t)SKV__KVC_NSLOTS * SKV__KVC_SLOT_BYTES);
  kc->err_dev = (uint32_t *)(kc->pinned_dev + (size_t)SKV__KVC_NSLOTS * SKV__KVC_SLOT_BYTES);
  for (int i = 0; i < SKV__KVC_NSLOTS; i++) {
    skv__kvc_slot_t *s = &kc->slots[i];
    s->kc = kc;
    s->args = kc->pinned + (size_t)i * SKV__KVC_SLOT_BYTES;
    s->args_dev = kc->pinned_dev + (size_t)i * SKV__KVC_SLOT_BYTES;
    s->mirror = kc->mirrors + (size_t)i * SKV__KVC_SLOT_BYTES;
    const size_t g = (size_t)SKV__KVC_NSLOTS * SKV__KVC_SLOT_BYTES + ERR_BYTES + (size_t)i * 64;
    s->gate = (uint64_t *)(kc->pinned + g); /* a line each, and a line of device memory */
    s->gate_dev = (const uint64_t *)(kc->pinned_dev + g);
    uint8_t *gm = kc->mirrors + (size_t)SKV__KVC_NSLOTS * SKV__KVC_SLOT_BYTES + (size_t)i * 64;
    s->gate_mirror = (uint64_t *)gm;
    s->gate_lock = (uint32_t *)(gm + 8);
    if (i < SKV__KVC_RING_SLOTS) {
      SKV_CUDA_CHECK_GOTO(cudaEventCreateWithFlags(&s->done, cudaEventDisableTiming), SKV_SUBSYS_KV,
                          rc, fail);
      s->keys = malloc(SKV__KVC_MAX_PAGES * sizeof *s->keys);
      s->claims = malloc(SKV__KVC_MAX_PAGES * sizeof *s->claims);
      if (!s->keys || !s->claims) {
        rc = SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_KV, "skv_kv_create: out of memory");
        goto fail;
      }
    }
  }
  SKV_CHECK_GOTO(skv__kvc_ring_init(kc), rc, fail);
  char vb[32];
  SKV_INFO(SKV_SUBSYS_KV,
           "CUDA data path on GPU %d (%d SMs): %d + %d argument slots of %u KiB, kernel variant %s",
           kc->device, kc->sms, SKV__KVC_RING_SLOTS, SKV__KVC_GRAPH_SLOTS,
           SKV__KVC_SLOT_BYTES >> 10, skv__kv_variant_name(NULL, vb, sizeof vb));
  *out = kc;
  return 0;
fail:
  kc_free(kc);
  return rc;
}

void skv__kvc_destroy(skv__kvc_t *kc) {
  if (!kc) return;
  (void)skv__cuda_use(kc->p.ctx);
  skv__kvc_ring_stop(kc);
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

int skv__kvc_begin(skv__kvc_t *kc, void *stream, bool *capturing, bool reap) {
  SKV_CHECK(skv__cuda_use(kc->p.ctx));
  *capturing = false;
  SKV_CHECK(skv__cuda_capturing(stream, capturing));
  /* a publish completes what completed since the last call first: keys published now are
   * found by its claims (skipped, not claimed again), and pages freed now are fewer to evict */
  if (reap && !*capturing) skv__kvc_reap(kc);
  return 0;
}

int skv__kvc_check(skv__kvc_t *kc, const skv_layout_t *lay, int dir, const char *fn) {
  skv__kvc_plan_t pl;
  return skv__kvc_plan(kc, lay, dir, &pl, fn);
}

uint32_t *skv__kvc_err_word(skv__kvc_t *kc) {
  return kc ? kc->err : NULL;
}

/* ---- stream-ordered copies ------------------------------------------------------------------ */

/* A ring slot (waited for, bounded) holding the arguments of pages [off, off + k) of `b`, and
 * their keys and claims for a publish; the wait and the staging timed. */
static int slot_take(skv__kvc_t *kc, skv__kvc_plan_t *pl, const skv_layout_t *lay,
                     const skv__kv_batch_t *b, size_t off, uint32_t k, const uint64_t *bids,
                     const size_t *idx, skv__kvc_slot_t **out, const char *fn) {
  skv__kv_prof_t *P = kc->p.prof;
  uint64_t t = skv__kp_now(P);
  skv__kvc_slot_t *s;
  SKV_CHECK(skv__kvc_slot_get(kc, &s, fn));
  t = skv__kp_lap(P, SKV__KP_SLOT, t);
  s->unpin_caller = b->unpin_caller;
  if (b->keys) memcpy(s->keys, b->keys + off, k * sizeof *s->keys);
  s->has_claims = b->claims != NULL;
  if (b->claims) memcpy(s->claims, b->claims + off, k * sizeof *s->claims);
  skv__kvc_fill(s, pl, lay, b, off, k, bids, idx);
  (void)skv__kp_lap(P, SKV__KP_STAGE, t);
  *out = s;
  return 0;
}

int skv__kvc_copy(skv__kvc_t *kc, const skv__kv_batch_t *b, const skv_layout_t *lay,
                  const uint64_t *block_ids, const size_t *idx, void *stream, size_t *queued,
                  const char *fn) {
  *queued = 0;
  skv__kvc_plan_t pl;
  SKV_CHECK(
      skv__kvc_plan(kc, lay, b->dir == SKV__KV_FETCH ? SKV__KV_FETCH : SKV__KV_PUBLISH, &pl, fn));
  const uint32_t m = lay->blocks_per_page;
  for (size_t off = 0; off < b->n; off += pl.ppl) {
    uint32_t k = (uint32_t)SKV_MIN((size_t)pl.ppl, b->n - off);
    skv__kvc_slot_t *s;
    SKV_CHECK(slot_take(kc, &pl, lay, b, off, k, idx ? block_ids : block_ids + off * m,
                        idx ? idx + off : NULL, &s, fn));
    bool consumed;
    /* a publish's launches after its first follow one another (only their events between):
     * programmatic dependent launches (kernels/kv_copy.h, skv__kv_copy_desc_t.follows) */
    const bool pdl =
        b->dir == SKV__KV_PUBLISH && skv__env_switch(SKV_ENV_PUBLISH_PDL, true, SKV_SUBSYS_KV);
    pl.d.follows = pdl && (b->follows || off > 0);
    pl.d.precedes = pdl && (b->precedes || off + k < b->n);
    int rc = skv__kvc_enqueue(kc, s, &pl, stream, &consumed, fn); /* laps launch, handoff */
    if (consumed) *queued = off + k;
    if (rc) {
      if (!consumed) skv__kvc_slot_put(kc, s);
      return rc;
    }
  }
  return 0;
}

int skv__kvc_gate_ms = 0;

int skv__kvc_copy_gated(skv__kvc_t *kc, const skv__kv_batch_t *b, const skv_layout_t *lay,
                        const uint64_t *block_ids, void *stream, struct skv__kvc_slot **slot,
                        const char *fn) {
  skv__kvc_plan_t pl;
  SKV_CHECK(skv__kvc_plan(kc, lay, SKV__KV_FETCH, &pl, fn));
  if (b->n > pl.ppl || pl.ce) return 1;
  skv__kvc_slot_t *s;
  SKV_CHECK(slot_take(kc, &pl, lay, b, 0, (uint32_t)b->n, block_ids, NULL, &s, fn));
  if (++s->gate_epoch == 0) s->gate_epoch = 1; /* 0: what a mirror holds at first */
  /* shut: the launch comes after this store */
  __atomic_store_n(s->gate, (uint64_t)s->gate_epoch << 32, __ATOMIC_RELAXED);
  pl.d.gate = s->gate_dev;
  pl.d.gate_mirror = s->gate_mirror;
  pl.d.gate_lock = s->gate_lock;
  pl.d.gate_epoch = s->gate_epoch;
  const int ms = __atomic_load_n(&skv__kvc_gate_ms, __ATOMIC_RELAXED);
  pl.d.gate_ms = (uint32_t)(ms > 0 ? ms : kc->p.ctx->cfg.timeout_ms);
  skv__kv_prof_t *P = kc->p.prof;
  const uint64_t t = skv__kp_now(P);
  /* the kernel only: its event and hand-off come with the close (skv__kvc_gate_close), so that
   * no CUDA call, which could wait for room in a stream queued behind this kernel, comes before */
  const int rc = skv__kvc_launch(s, &pl, stream, fn);
  (void)skv__kp_lap(P, SKV__KP_LAUNCH, t);
  if (rc) {
    skv__kvc_slot_put(kc, s);
    return rc;
  }
  *slot = s;
  return 0;
}

void skv__kvc_gate_open(struct skv__kvc_slot *s, size_t pinned) {
  __atomic_store_n(s->gate, (uint64_t)s->gate_epoch << 32 | pinned, __ATOMIC_RELEASE);
}

int skv__kvc_gate_close(struct skv__kvc_slot *s, size_t pinned, bool unpin_caller, void *stream,
                        const char *fn) {
  s->unpin_caller = unpin_caller; /* what the completion releases */
  s->n = (uint32_t)pinned;
  __atomic_store_n(s->gate, (uint64_t)s->gate_epoch << 32 | SKV_KV_GATE_CLOSED | pinned,
                   __ATOMIC_RELEASE);
  return skv__kvc_handoff(s->kc, s, stream, fn);
}

int skv__kvc_capture_fetch(skv__kvc_t *kc, const skv__kv_batch_t *b, const skv_layout_t *lay,
                           const uint64_t *block_ids, void *stream, const char *fn) {
  skv__kvc_plan_t pl;
  SKV_CHECK(skv__kvc_plan(kc, lay, SKV__KV_FETCH, &pl, fn));
  size_t need = (b->n + pl.ppl - 1) / pl.ppl;
  pthread_mutex_lock(&kc->mu);
  int first = kc->graph_used;
  bool ok = first + (int)need <= SKV__KVC_GRAPH_SLOTS;
  if (ok) kc->graph_used += (int)need;
  pthread_mutex_unlock(&kc->mu);
  if (!ok)
    return SKV_FAIL(
        SKV_ECAPTURE, SKV_SUBSYS_KV,
        "%s: this capture needs %zu graph argument slot(s) but %d of this cache's %d are taken by "
        "earlier captures (each captured fetch keeps its slot for the cache's lifetime): capture "
        "fewer fetches, or larger ones (up to %u pages per slot)",
        fn, need, first, SKV__KVC_GRAPH_SLOTS, pl.ppl);
  const uint32_t m = lay->blocks_per_page;
  for (size_t off = 0, q = 0; off < b->n; off += pl.ppl, q++) {
    uint32_t k = (uint32_t)SKV_MIN((size_t)pl.ppl, b->n - off);
    skv__kvc_slot_t *s = &kc->slots[SKV__KVC_RING_SLOTS + first + (int)q];
    skv__kvc_fill(s, &pl, lay, b, off, k, block_ids + off * m, NULL);
    SKV_CHECK(skv__kvc_launch(s, &pl, stream, fn));
  }
  return 0;
}

int skv__kvc_mark(skv__kvc_t *kc, const skv__kv_batch_t *b, void *stream, size_t *queued,
                  const char *fn) {
  *queued = 0;
  for (size_t off = 0; off < b->n; off += SKV__KVC_MAX_PAGES) {
    const uint32_t k = (uint32_t)SKV_MIN((size_t)SKV__KVC_MAX_PAGES, b->n - off);
    skv__kvc_slot_t *s;
    SKV_CHECK(skv__kvc_slot_get(kc, &s, fn));
    uint32_t *pp = (uint32_t *)s->args;
    for (uint32_t q = 0; q < k; q++) {
      pp[2 * q] = b->pe[(off + q) * b->pe_step];
      pp[2 * q + 1] = b->page[(off + q) * b->page_step];
    }
    if (b->keys) memcpy(s->keys, b->keys + off, k * sizeof *s->keys);
    s->has_claims = false; /* a commit inserts its keys */
    s->dir = b->dir;
    s->n = k;
    s->refs_off = 0;
    s->unpin_caller = false;
    cudaError_t e = cudaEventRecord(s->done, (cudaStream_t)stream);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      skv__kvc_slot_put(kc, s);
      return SKV_FAIL(SKV_ECUDA, SKV_SUBSYS_KV,
                      "%s: recording the event that orders the step after the stream failed: %s "
                      "(%s)",
                      fn, cudaGetErrorString(e), cudaGetErrorName(e));
    }
    skv__kvc_slot_pending(kc, s);
    *queued = off + k;
  }
  return 0;
}

/* ---- staging through host memory ------------------------------------------------------------ */

size_t skv__kvc_stage_pages(const skv__kvc_t *kc) {
  return (size_t)SKV_MAX(1, STAGE_BYTES / kc->p.page_bytes);
}

static void *page_addr(const skv__kvc_t *kc, uint32_t pe, uint32_t page) {
  const skv_heap_info_t *hi = &kc->p.heap->info;
  return (char *)hi->base + (uint64_t)pe * hi->stride + hi->data_offset +
         (uint64_t)page * kc->p.page_stride;
}

/* One DMA per page of `b` between bytes [off, off + len) of the pages and `buf`, then a wait for
 * the stream. */
static int stage(skv__kvc_t *kc, const skv__kv_batch_t *b, uint64_t off, uint64_t len, char *buf,
                 bool to_host, void *stream, const char *fn) {
  cudaError_t e = cudaSuccess;
  for (size_t q = 0; q < b->n && e == cudaSuccess; q++) {
    char *page = (char *)page_addr(kc, b->pe[q * b->pe_step], b->page[q * b->page_step]) + off;
    e = to_host ? cudaMemcpyAsync(buf + q * len, page, len, cudaMemcpyDeviceToHost,
                                  (cudaStream_t)stream)
                : cudaMemcpyAsync(page, buf + q * len, len, cudaMemcpyHostToDevice,
                                  (cudaStream_t)stream);
  }
  if (e == cudaSuccess) e = cudaStreamSynchronize((cudaStream_t)stream);
  if (e == cudaSuccess) return 0;
  (void)cudaGetLastError();
  return SKV_FAIL(SKV_ECUDA, SKV_SUBSYS_KV, "%s: copying pages %s the GPU failed: %s (%s)", fn,
                  to_host ? "from" : "to", cudaGetErrorString(e), cudaGetErrorName(e));
}

int skv__kvc_read_pages(skv__kvc_t *kc, const skv__kv_batch_t *b, uint64_t off, uint64_t len,
                        void *buf, void *stream, const char *fn) {
  return stage(kc, b, off, len, buf, true, stream, fn);
}

int skv__kvc_write_pages(skv__kvc_t *kc, const skv__kv_batch_t *b, uint64_t off, uint64_t len,
                         const void *buf, void *stream, const char *fn) {
  return stage(kc, b, off, len, (char *)buf, false, stream, fn);
}

/* ---- pages from outside the heap ------------------------------------------------------------ */

int skv__kvc_host_register(void *p, size_t len, bool add) {
  cudaError_t e = add ? cudaHostRegister(p, len, cudaHostRegisterMapped | cudaHostRegisterPortable)
                      : cudaHostUnregister(p);
  if (e == cudaSuccess) return 0;
  (void)cudaGetLastError();
  /* registered already, by UCX (its cuda_copy registers the host memory it maps): usable as
   * it is, and UCX unregisters it */
  if (add && e == cudaErrorHostMemoryAlreadyRegistered) return SKV__KVC_REGISTERED_ELSEWHERE;
  return SKV_FAIL(SKV_ECUDA, SKV_SUBSYS_KV, "cudaHost%sregister of %zu bytes of staging failed: %s",
                  add ? "R" : "Unr", len, cudaGetErrorString(e));
}

int skv__kvc_dev_alloc(size_t len, void **p) {
  cudaError_t e = cudaMalloc(p, len);
  if (e == cudaSuccess) return 0;
  (void)cudaGetLastError();
  *p = NULL;
  return SKV_FAIL(SKV_ECUDA, SKV_SUBSYS_KV, "cudaMalloc of %zu bytes of staging failed: %s", len,
                  cudaGetErrorString(e));
}

void skv__kvc_dev_free(void *p) {
  if (p && cudaFree(p) != cudaSuccess) (void)cudaGetLastError();
}

/* ---- gates: a stream held until the host opens it ------------------------------------------ */

/* The gate words of the process: one page of pinned host memory, mapped for every device,
 * allocated once and never freed (a stream may still wait on a word after its owner left). A
 * word taken again keeps its value: its new owner counts on from it, so an old wait still
 * queued is never opened early, nor held for good. */
#define GATE_WORDS 512u
static pthread_mutex_t gate_mu = PTHREAD_MUTEX_INITIALIZER;
static uint64_t *gate_page;
static uint64_t gate_used[GATE_WORDS / 64];

int skv__kvc_gate_word(uint64_t **word) {
  *word = NULL;
  pthread_mutex_lock(&gate_mu);
  if (!gate_page) {
    void *p = NULL;
    cudaError_t e = cudaHostAlloc(&p, GATE_WORDS * sizeof(uint64_t),
                                  cudaHostAllocMapped | cudaHostAllocPortable);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      pthread_mutex_unlock(&gate_mu);
      return SKV_FAIL(SKV_ECUDA, SKV_SUBSYS_KV, "cudaHostAlloc of the gate words failed: %s",
                      cudaGetErrorString(e));
    }
    memset(p, 0, GATE_WORDS * sizeof(uint64_t));
    gate_page = p;
  }
  for (unsigned i = 0; i < GATE_WORDS && !*word; i++)
    if (!(gate_used[i / 64] >> (i % 64) & 1)) {
      gate_used[i / 64] |= 1ull << (i % 64);
      *word = &gate_page[i];
    }
  pthread_mutex_unlock(&gate_mu);
  if (!*word)
    return SKV_FAIL(SKV_ENOSPC, SKV_SUBSYS_KV, "all %u gate words of the process are taken",
                    GATE_WORDS);
  return 0;
}

void skv__kvc_gate_word_put(uint64_t *word) {
  if (!word) return;
  pthread_mutex_lock(&gate_mu);
  const size_t i = (size_t)(word - gate_page);
  gate_used[i / 64] &= ~(1ull << (i % 64));
  pthread_mutex_unlock(&gate_mu);
}

int skv__kvc_gate(void *stream, uint64_t *word, uint64_t ticket, const char *fn) {
  void *dev = NULL;
  cudaError_t e = cudaHostGetDevicePointer(&dev, word, 0);
  CUresult r = CUDA_ERROR_INVALID_VALUE;
  if (e == cudaSuccess)
    r = skv__cu.cuStreamWaitValue64((CUstream)stream, (CUdeviceptr)(uintptr_t)dev, ticket,
                                    CU_STREAM_WAIT_VALUE_GEQ);
  if (e == cudaSuccess && r == CUDA_SUCCESS) return 0;
  (void)cudaGetLastError();
  const char *name = "?";
  if (r != CUDA_SUCCESS) skv__cu.cuGetErrorName(r, &name);
  return SKV_FAIL(SKV_ENOTSUP, SKV_SUBSYS_KV, "%s: cannot hold the stream on a host word (%s)", fn,
                  e != cudaSuccess ? cudaGetErrorString(e) : name);
}

int skv__kvc_event(void *stream, void **ev, const char *fn) {
  cudaEvent_t e0 = NULL;
  cudaError_t e = cudaEventCreateWithFlags(&e0, cudaEventDisableTiming);
  if (e == cudaSuccess) e = cudaEventRecord(e0, (cudaStream_t)stream);
  *ev = e == cudaSuccess ? e0 : NULL;
  if (e == cudaSuccess) return 0;
  (void)cudaGetLastError();
  if (e0) cudaEventDestroy(e0);
  return SKV_FAIL(SKV_ECUDA, SKV_SUBSYS_KV, "%s: an event on the stream failed: %s", fn,
                  cudaGetErrorString(e));
}

int skv__kvc_event_done(void *ev) {
  const enum cudaStreamCaptureMode m = skv__kvc_relax();
  const cudaError_t e = cudaEventQuery((cudaEvent_t)ev);
  skv__kvc_unrelax(m);
  if (e == cudaSuccess) return 1;
  if (e == cudaErrorNotReady) return 0;
  (void)cudaGetLastError();
  return SKV_FAIL(SKV_ECUDA, SKV_SUBSYS_KV, "an event of a remote fetch failed: %s",
                  cudaGetErrorString(e));
}

void skv__kvc_event_free(void *ev) {
  if (ev && cudaEventDestroy((cudaEvent_t)ev) != cudaSuccess) (void)cudaGetLastError();
}

static int copy_in(skv__kvc_t *kc, const skv_layout_t *lay, const void *src, bool src_dev,
                   uint64_t stride, size_t n, const uint64_t *block_ids, const size_t *idx,
                   void *stream, bool wait, unsigned (*idle)(void *), void *idle_arg,
                   const char *fn);

int skv__kvc_copy_in(skv__kvc_t *kc, const skv_layout_t *lay, const void *src, bool src_dev,
                     uint64_t stride, size_t n, const uint64_t *block_ids, const size_t *idx,
                     void *stream, unsigned (*idle)(void *), void *idle_arg, const char *fn) {
  return copy_in(kc, lay, src, src_dev, stride, n, block_ids, idx, stream, true, idle, idle_arg,
                 fn);
}

int skv__kvc_copy_in_async(skv__kvc_t *kc, const skv_layout_t *lay, const void *src,
                           uint64_t stride, size_t n, const uint64_t *block_ids, void *stream,
                           const char *fn) {
  return copy_in(kc, lay, src, false, stride, n, block_ids, NULL, stream, false, NULL, NULL, fn);
}

static int copy_in(skv__kvc_t *kc, const skv_layout_t *lay, const void *src, bool src_dev,
                   uint64_t stride, size_t n, const uint64_t *block_ids, const size_t *idx,
                   void *stream, bool wait, unsigned (*idle)(void *), void *idle_arg,
                   const char *fn) {
  void *dev = (void *)src;
  cudaError_t e = src_dev ? cudaSuccess : cudaHostGetDevicePointer(&dev, (void *)src, 0);
  struct cudaPointerAttributes pa;
  if (e != cudaSuccess && cudaPointerGetAttributes(&pa, src) == cudaSuccess && pa.devicePointer) {
    (void)cudaGetLastError(); /* registered without the mapped flag (by UCX): UVA maps it */
    dev = pa.devicePointer;
    e = cudaSuccess;
  }
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return SKV_FAIL(SKV_ECUDA, SKV_SUBSYS_KV,
                    "%s: the staging buffer has no device address (%s): not registered?", fn,
                    cudaGetErrorString(e));
  }
  skv__kvc_plan_t pl;
  SKV_CHECK(skv__kvc_plan_src(kc, lay, (uint64_t)(uintptr_t)dev, stride, (uint32_t)n, &pl, fn));
  uint32_t *seq = malloc(n * sizeof *seq);
  if (!seq) return SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_KV, "%s: out of memory", fn);
  for (size_t i = 0; i < n; i++) seq[i] = (uint32_t)i;
  const uint32_t zero = 0;
  const skv__kv_batch_t b = {
      .dir = SKV__KV_FETCH, .n = n, .pe = &zero, .page = seq, .page_step = 1};
  int rc = 0;
  for (size_t off = 0; off < n && !rc; off += pl.ppl) {
    const uint32_t k = (uint32_t)SKV_MIN((size_t)pl.ppl, n - off);
    skv__kvc_slot_t *s;
    if ((rc = skv__kvc_slot_get(kc, &s, fn)) != 0) break;
    skv__kvc_fill(s, &pl, lay, &b, off, k, idx ? block_ids : block_ids + off * lay->blocks_per_page,
                  idx ? idx + off : NULL);
    if ((rc = skv__kvc_launch(s, &pl, stream, fn)) != 0) {
      skv__kvc_slot_put(kc, s);
      break;
    }
    e = cudaEventRecord(s->done, (cudaStream_t)stream);
    if (!wait && e == cudaSuccess) { /* the completion thread takes the slot back */
      s->dir = SKV__KV_WRITE;
      s->n = 0;
      s->unpin_caller = false;
      skv__kvc_slot_pending(kc, s);
      continue;
    }
    /* the slot's arguments and the staging are read by the kernel: wait for it, bounded */
    const uint64_t dl = skv__now_ns() + (uint64_t)kc->p.ctx->cfg.timeout_ms * 1000000u;
    for (unsigned spins = 0; e == cudaSuccess; spins++) {
      const enum cudaStreamCaptureMode m = skv__kvc_relax();
      const cudaError_t q = cudaEventQuery(s->done);
      skv__kvc_unrelax(m);
      if (q != cudaErrorNotReady || skv__now_ns() >= dl) {
        e = q; /* cudaErrorNotReady: the time ran out */
        break;
      }
      if ((!idle || idle(idle_arg) == 0) && spins > 64) sched_yield();
    }
    if (e == cudaSuccess) {
      skv__kvc_slot_put(kc, s);
    } else if (e == cudaErrorNotReady) {
      /* the kernel may still run: the completion thread takes the slot back once its event
       * completes (a step with nothing to do), and the caller leaves the staging to it */
      s->dir = SKV__KV_WRITE;
      s->n = 0;
      s->unpin_caller = false;
      skv__kvc_slot_pending(kc, s);
      rc = SKV_FAIL(SKV_ETIMEDOUT, SKV_SUBSYS_KV,
                    "%s: the copy of %u remote pages into the engine's blocks did not complete "
                    "within %d ms (is the stream blocked?)",
                    fn, k, kc->p.ctx->cfg.timeout_ms);
    } else {
      (void)cudaGetLastError();
      (void)cudaStreamSynchronize((cudaStream_t)stream);
      skv__kvc_slot_put(kc, s);
      rc = SKV_FAIL(SKV_ECUDA, SKV_SUBSYS_KV, "%s: copying remote pages to the GPU failed: %s (%s)",
                    fn, cudaGetErrorString(e), cudaGetErrorName(e));
    }
  }
  free(seq);
  return rc;
}

/* ---- sync ----------------------------------------------------------------------------------- */

bool skv__kvc_idle(skv__kvc_t *kc) {
  if (!kc) return true;
  pthread_mutex_lock(&kc->mu);
  const bool idle = kc->inflight == 0;
  pthread_mutex_unlock(&kc->mu);
  return idle;
}

int skv__kvc_sync(skv__kvc_t *kc) {
  if (!kc) return 0;
  int ms = kc->p.ctx->cfg.timeout_ms;
  const uint64_t dl = skv__now_ns() + (uint64_t)ms * 1000000u;
  pthread_mutex_lock(&kc->mu);
  /* look at the events every 20 us (the completion thread may be napping longer) */
  while (kc->inflight > 0 && (skv__kvc_reap_locked(kc), kc->inflight > 0)) {
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
    return SKV_FAIL(SKV_ETIMEDOUT, SKV_SUBSYS_KV,
                    "skv_kv_sync: %" PRIu64
                    " stream-ordered fetches or publishes of this cache did not complete "
                    "within %d ms: is one of their streams blocked (an event that never fires, a "
                    "hung kernel)?",
                    pending, ms);
  volatile uint32_t *e = kc->err;
  uint32_t code = e[0];
  if (code) {
    uint32_t i = e[1], t = e[2], v = e[3];
    e[1] = e[2] = e[3] = 0;
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    e[0] = 0;
    if (code == SKV_KV_DEVERR_GATE)
      return SKV_FAIL(SKV_ETIMEDOUT, SKV_SUBSYS_KV,
                      "skv_kv_sync: a gated fetch's copy waited longer than SKV_TIMEOUT_MS for its "
                      "pins and gave up at page %u (%u pinned by then): the blocks of that page "
                      "and later ones were not written. The host thread stopped between the "
                      "launch and the pins: CUDA_LAUNCH_BLOCKING, or a debugger or profiler that "
                      "runs each launch to its end (set SKV_FETCH_GATE_PAGES=0 under Nsight "
                      "Compute or cuda-gdb)",
                      i, v & ~SKV_KV_GATE_CLOSED);
    const char *what = code == SKV_KV_DEVERR_PE     ? "PE"
                       : code == SKV_KV_DEVERR_PAGE ? "page"
                                                    : "block id";
    return SKV_FAIL(
        code == SKV_KV_DEVERR_BLOCK ? SKV_EINVAL : SKV_ERANGE, SKV_SUBSYS_KV,
        "skv_kv_sync: a copy kernel refused page %u of its batch (tensor %u): %s %u is out of "
        "range, so that data was not copied and nothing outside the heap and the engine's blocks "
        "was touched. The host had checked the arguments: they changed afterwards (a captured "
        "graph replayed with its pages unpinned, or memory corruption); please report it with "
        "the SKV_DEBUG=INFO log",
        i, t, what, v);
  }
  if (cb_err)
    return SKV_FAIL(cb_err, SKV_SUBSYS_KV, "skv_kv_sync: a stream-ordered step failed: %s", msg);
  return 0;
}
