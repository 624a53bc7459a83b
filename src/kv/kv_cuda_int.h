/* Internals shared by the files of the CUDA copy backend: the backend's state, its argument
 * slots (kv_cuda_ring.c hands them out and completes them) and launch plans (kv_cuda_launch.c). */
#ifndef SKV_KV_CUDA_INT_H
#define SKV_KV_CUDA_INT_H

#include "cuda/device.h"
#include "kernels/kv_copy.h"
#include "kv/kv_cuda.h"

#include <pthread.h>

/* Event queries (the completion thread's, and a call's waiting for a launch) are made in the
 * relaxed capture mode: an engine thread capturing a CUDA graph in the default, global, mode
 * forbids such calls to every other thread, and one made anyway invalidates its graph
 * (cudaErrorStreamCaptureInvalidated at its end). Ours never look at a stream being captured,
 * nor at an event recorded in one. skv__kvc_relax returns the mode to restore. */
static inline enum cudaStreamCaptureMode skv__kvc_relax(void) {
  enum cudaStreamCaptureMode m = cudaStreamCaptureModeRelaxed;
  if (cudaThreadExchangeStreamCaptureMode(&m) != cudaSuccess) m = cudaStreamCaptureModeRelaxed;
  return m;
}
static inline void skv__kvc_unrelax(enum cudaStreamCaptureMode m) {
  if (m != cudaStreamCaptureModeRelaxed) (void)cudaThreadExchangeStreamCaptureMode(&m);
}

#define SKV__KVC_SLOT_BYTES  (512u << 10)
#define SKV__KVC_RING_SLOTS  8
#define SKV__KVC_GRAPH_SLOTS 8
#define SKV__KVC_NSLOTS      (SKV__KVC_RING_SLOTS + SKV__KVC_GRAPH_SLOTS)

/* One launch's arguments (pinned, device-mapped host memory) and what completing it takes. */
typedef struct skv__kvc_slot {
  struct skv__kvc *kc;
  uint8_t *args;     /* SKV__KVC_SLOT_BYTES of pinned host memory */
  uint8_t *args_dev; /* its device address */
  uint8_t *mirror;   /* SKV__KVC_SLOT_BYTES of device memory: a copy of args for local batches */
  cudaEvent_t done;  /* recorded after the copy on the caller's stream */
  int dir;           /* SKV__KV_FETCH or _PUBLISH */
  uint32_t n;        /* pages of the launch */
  uint32_t refs_off; /* byte offset of the (pe, page) pairs in args */
  bool unpin_caller; /* SKV_FETCH_UNPIN */
  uint64_t *gate;    /* its gate word (pinned, device-mapped: a gated fetch, kernels/kv_copy.h) */
  const uint64_t *gate_dev;
  uint64_t *gate_mirror; /* device memory: the word's mirror, and the lock of who reads it */
  uint32_t *gate_lock;
  uint32_t gate_epoch;        /* uses of the gate */
  skv_key_t *keys;            /* publish: the pages' keys (ring slots only) */
  skv__index_claim_t *claims; /* publish: their index claims (ring slots only) */
  bool has_claims;
  struct skv__kvc_slot *next; /* in the free ring, or in the pending list */
  uint64_t seq;               /* uses of the slot: a completion names the use it saw */
} skv__kvc_slot_t;

struct skv__kvc {
  skv__kvc_params_t p;
  skv_geometry_t geom;
  int device, sms;
  uint32_t npes, me;
  uint64_t this_gpu; /* bit i: PE i's pages are in this GPU's memory (this PE's, and sharers') */
  uint8_t *pinned;   /* the slots, then the error word */
  uint8_t *pinned_dev;
  uint8_t *mirrors; /* device memory: one argument mirror per slot */
  uint32_t *err, *err_dev;
  skv__kvc_slot_t slots[SKV__KVC_NSLOTS];
  pthread_mutex_t mu;  /* free ring, pending list, inflight, graph slots, errors, closed, stop */
  pthread_cond_t cv;   /* a slot was handed back */
  pthread_cond_t work; /* the completion thread: a launch is pending, or stop */
  bool sync_init;
  skv__kvc_slot_t *free_ring;
  skv__kvc_slot_t *pending; /* ring slots whose launch was enqueued, not yet completed */
  pthread_t reaper;         /* the completion thread */
  bool reaper_on, stop;
  int graph_used;
  uint64_t inflight; /* ring slots taken and not yet handed back */
  int cb_err;        /* first failure while completing a launch */
  char cb_msg[384];
  bool closed;
  int ce_off; /* the copy-engine path failed once (driver without cudaMemcpyBatchAsync) */
};

/* ---- kv_cuda_ring.c: argument slots and their completion ---------------------------------- */

/* The free ring, the completion thread and its lock (after the slots' memory exists). */
int skv__kvc_ring_init(skv__kvc_t *kc);
/* Stop the completion thread (waits for it). */
void skv__kvc_ring_stop(skv__kvc_t *kc);
/* Take a ring slot, waiting (bounded by the timeout) while all are in flight. */
int skv__kvc_slot_get(skv__kvc_t *kc, skv__kvc_slot_t **out, const char *fn);
/* Hand a slot back unused (its launch was never enqueued). */
void skv__kvc_slot_put(skv__kvc_t *kc, skv__kvc_slot_t *s);
/* The slot's launch and its event are enqueued: the completion thread takes it from here. */
void skv__kvc_slot_pending(skv__kvc_t *kc, skv__kvc_slot_t *s);
/* Complete a launch now (it was enqueued but its event could not be recorded, and the stream
 * was waited for). */
void skv__kvc_slot_done(skv__kvc_slot_t *s);
/* Complete the launches that have completed (a caller's first step, so that the previous
 * step's pins go now rather than at the completion thread's next look). */
void skv__kvc_reap(skv__kvc_t *kc);
/* The same with kc->mu held (it drops it around the event queries); returns how many. */
int skv__kvc_reap_locked(skv__kvc_t *kc);

/* ---- kv_cuda_launch.c: launch plans -------------------------------------------------------- */

typedef struct skv__kvc_plan {
  skv__kv_copy_desc_t d;
  skv__kv_copy_cfg_t cfg;
  uint32_t bases_bytes; /* offset of the (pe, page) pairs in a slot */
  uint32_t bid_bytes;   /* 4 or 8 */
  uint32_t ppl;         /* pages per launch */
  bool ce;              /* fetch with the copy engines (dense runs, not capturing) */
  bool local;           /* the launch's pages are all in this GPU's memory (set by skv__kvc_fill) */
} skv__kvc_plan_t;

/* Describe copies between the cache's pages and `lay` (a device layout on this PE's GPU). */
int skv__kvc_plan(skv__kvc_t *kc, const skv_layout_t *lay, int dir, skv__kvc_plan_t *pl,
                  const char *fn);
/* A plan for pages that are not the heap's: n pages at device-readable address `src`,
 * `stride` bytes apart, holding the layout's layers only (refs (0, i), i < n), into `lay`. */
int skv__kvc_plan_src(skv__kvc_t *kc, const skv_layout_t *lay, uint64_t src, uint64_t stride,
                      uint32_t n, skv__kvc_plan_t *pl, const char *fn);
/* Write the arguments of pages [off, off + k) of `b` into slot `s`; page q's block ids are
 * bids[(idx ? idx[q] : q) * m ...] with idx and bids already offset to the batch's page off. */
void skv__kvc_fill(skv__kvc_slot_t *s, skv__kvc_plan_t *pl, const skv_layout_t *lay,
                   const skv__kv_batch_t *b, size_t off, uint32_t k, const uint64_t *bids,
                   const size_t *idx);
/* Launch the kernel of slot `s` (graph slots too: no event). */
int skv__kvc_launch(skv__kvc_slot_t *s, skv__kvc_plan_t *pl, void *stream, const char *fn);
/* Record the end of ring slot `s`'s copy (enqueued on `stream`) and hand the slot to the
 * completion thread; when the event cannot be recorded, wait for the stream and complete it
 * here (SKV_ECUDA). */
int skv__kvc_handoff(skv__kvc_t *kc, skv__kvc_slot_t *s, void *stream, const char *fn);
/* Start the copy of ring slot `s` (copy engines or kernel) and hand it to the completion thread.
 * *consumed: the slot (and the launch's pins or pages) now belong to its completion. */
int skv__kvc_enqueue(skv__kvc_t *kc, skv__kvc_slot_t *s, skv__kvc_plan_t *pl, void *stream,
                     bool *consumed, const char *fn);

#endif
