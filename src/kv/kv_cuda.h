/* The CUDA copy backend of the KV cache (kv_cuda*.c): moves pages between the cache's heap and
 * engine blocks, synchronously (staged through host memory) or stream-ordered with a completion.
 * It knows nothing of pins, keys or the index: kv.c owns that protocol and drives this (a
 * publish's keys and their index claims only ride along to its completion). */
#ifndef SKV_KV_CUDA_H
#define SKV_KV_CUDA_H

#include "bootstrap/ctx.h"
#include "heap/heap.h"
#include "index/index.h"
#include "kv/layout.h"

#include "kernels/kv_copy.h"
#include "kv/kv_prof.h"

/* A batch of pages: page i is (pe[i * pe_step], page[i * page_step]) (a step of 0 repeats one
 * value: publish passes its own PE so). What a stream-ordered copy hands back to the protocol
 * once it completed is such a batch too. */
typedef struct skv__kv_batch {
  int dir; /* SKV__KV_FETCH (pages -> blocks) or SKV__KV_PUBLISH (blocks -> pages) */
  size_t n;
  const uint32_t *pe;
  size_t pe_step;
  const uint32_t *page;
  size_t page_step;
  const skv_key_t *keys;            /* publish: keys[i] is page i's key */
  bool unpin_caller;                /* fetch: the completion also releases the caller's pins */
  const skv__index_claim_t *claims; /* publish: claims[i] is keys[i]'s (NULL: insert them) */
  /* publish: launched right behind this publish's previous launch on its stream, and another
   * launch of it to come (skv__kv_copy_desc_t.follows, .precedes) */
  bool follows, precedes;
} skv__kv_batch_t;

enum { SKV__KV_FETCH = 0, SKV__KV_PUBLISH = 1 }; /* = SKV_KV_COPY_FETCH, _PUBLISH */
/* Publishing in parts (skv_kv_reserve / _write / _commit / _abort): WRITE copies blocks into
 * reserved pages and completes with nothing to do; COMMIT and ABORT copy nothing, they complete
 * (index the pages, or free them) once what the stream held before them completed. */
enum { SKV__KV_WRITE = 2, SKV__KV_COMMIT = 3, SKV__KV_ABORT = 4 };

/* The protocol's step after a stream-ordered copy completed (release the fetch's pins, or make
 * the published pages READY and index them). Called once per launch, without the backend's
 * lock, from the completion thread or a caller's thread (two launches' steps may run at once);
 * returns 0 or the first failure (kept for skv__kvc_sync). Never called after skv__kvc_destroy
 * began. */
typedef int (*skv__kv_done_cb)(void *arg, const skv__kv_batch_t *done);

typedef struct skv__kvc skv__kvc_t;

typedef struct skv__kvc_params {
  skv_ctx_t *ctx;         /* the PE's device and timeout */
  const skv_heap_t *heap; /* the pages' heap (cuda or cuda_host backend) */
  const skv_geometry_t *geom;
  uint64_t page_bytes;  /* bytes of page data */
  uint64_t page_stride; /* distance between pages in the heap's data area */
  uint32_t pages_per_pe;
  skv__kv_done_cb done;
  void *done_arg;
  skv__kv_prof_t *prof; /* the cache's phase counters */
} skv__kvc_params_t;

/* Argument slots, the completion thread, the kernels loaded. */
int skv__kvc_create(const skv__kvc_params_t *p, skv__kvc_t **out);
/* Stops the completion thread; slots of copies still pending on a stuck stream are leaked. */
void skv__kvc_destroy(skv__kvc_t *kc);
/* Every call's first step: the PE's device current on this thread, whether `stream` is being
 * captured into a CUDA graph, and (when not, with `reap`: publish) the completion of what has
 * completed. A fetch leaves that to the completion thread: the previous fetch's unpins (1024
 * pages: tens of us) were paid by the next call in a loop of fetches. */
int skv__kvc_begin(skv__kvc_t *kc, void *stream, bool *capturing, bool reap);
/* Can `lay` be copied to (dir SKV__KV_PUBLISH) or from with the kernels? Checked before any pin
 * is taken or page allocated (a layout on another GPU, too many blocks per page...). */
int skv__kvc_check(skv__kvc_t *kc, const skv_layout_t *lay, int dir, const char *fn);

/* Stream-ordered: the copy of `b` on `stream` (a device layout on the PE's GPU; page i's blocks
 * are block_ids[idx[i] * m ...], idx NULL meaning i), and `done` once it completed. *queued
 * counts the leading pages whose completion now belongs to the backend (all on success); on a
 * failure the others are the caller's to undo. */
int skv__kvc_copy(skv__kvc_t *kc, const skv__kv_batch_t *b, const skv_layout_t *lay,
                  const uint64_t *block_ids, const size_t *idx, void *stream, size_t *queued,
                  const char *fn);
/* A gated fetch (kernels/kv_copy.h): the copy of `b` launched on `stream` before any of its
 * pages is pinned, behind its gate (shut); *slot is the launch's, for skv__kvc_gate_open and
 * skv__kvc_gate_close, which the caller must call next, making no CUDA call before it (the copy
 * waits for the close; its event is recorded then). Returns 1 when the batch is not one launch
 * of the kernels (nothing done: copy it the usual way), 0, or a failure (nothing enqueued). */
struct skv__kvc_slot;
#define SKV__KVC_MAX_PAGES 4096u /* pages of one launch, at most */
int skv__kvc_copy_gated(skv__kvc_t *kc, const skv__kv_batch_t *b, const skv_layout_t *lay,
                        const uint64_t *block_ids, void *stream, struct skv__kvc_slot **slot,
                        const char *fn);
/* Tests: a gated copy's longest wait for its pins, in ms (0: SKV_TIMEOUT_MS). */
extern int skv__kvc_gate_ms;
/* Pages [0, pinned) of a gated fetch are pinned: the copy may read them. */
void skv__kvc_gate_open(struct skv__kvc_slot *s, size_t pinned);
/* The last step of a gated fetch: pages [0, pinned) are pinned (all of them, or those before
 * the first stale reference's run); the copy reads these and skips the others, and its
 * completion releases them (and the caller's with unpin_caller). Then the copy's event and its
 * hand-off to the completion thread (skv__kvc_handoff: SKV_ECUDA when the event could not be
 * recorded, the copy waited for and completed here). */
int skv__kvc_gate_close(struct skv__kvc_slot *s, size_t pinned, bool unpin_caller, void *stream,
                        const char *fn);

/* A fetch while `stream` is captured: no completion (a graph may be replayed at any time); its
 * arguments take graph slots for the cache's lifetime. */
int skv__kvc_capture_fetch(skv__kvc_t *kc, const skv__kv_batch_t *b, const skv_layout_t *lay,
                           const uint64_t *block_ids, void *stream, const char *fn);

/* COMMIT or ABORT `b` (this PE's pages) once what `stream` held before completed: no copy, an
 * event; `done` runs then. *queued as for skv__kvc_copy. */
int skv__kvc_mark(skv__kvc_t *kc, const skv__kv_batch_t *b, void *stream, size_t *queued,
                  const char *fn);

/* Synchronous staging for host layouts over GPU pages: bytes [off, off + len) of each page of
 * `b` into / from a host buffer of b->n * len (DMA on `stream`, then a wait for it). */
int skv__kvc_read_pages(skv__kvc_t *kc, const skv__kv_batch_t *b, uint64_t off, uint64_t len,
                        void *buf, void *stream, const char *fn);
int skv__kvc_write_pages(skv__kvc_t *kc, const skv__kv_batch_t *b, uint64_t off, uint64_t len,
                         const void *buf, void *stream, const char *fn);
/* Pages one staging round moves (a bounded host buffer). */
size_t skv__kvc_stage_pages(const skv__kvc_t *kc);

/* Pages from outside the heap (a peer node's, read over the network): n pages at `src`,
 * `stride` bytes apart, each holding the layout's layers only, into their blocks of `lay` (page
 * i's at block_ids[idx[i] * m ...]), on `stream`, and a wait for the copy (bounded by the
 * timeout). `src` is device memory (src_dev, from skv__kvc_dev_alloc) or host memory registered
 * with skv__kvc_host_register (the kernels then read it over PCIe). No pins, no completion step.
 * SKV_ETIMEDOUT: the copy may still run and read `src` (the caller must not reuse nor free it);
 * its argument slot goes back once it completes. While it waits, idle(idle_arg) is called when
 * set (the network's progress: what it returns is how much it did; 0 yields the core). */
int skv__kvc_copy_in(skv__kvc_t *kc, const skv_layout_t *lay, const void *src, bool src_dev,
                     uint64_t stride, size_t n, const uint64_t *block_ids, const size_t *idx,
                     void *stream, unsigned (*idle)(void *), void *idle_arg, const char *fn);
/* The same copies, stream-ordered: launched on `stream` and left to it (their argument slots go
 * back once they completed); `src` must stay until then (an event recorded after them says). */
int skv__kvc_copy_in_async(skv__kvc_t *kc, const skv_layout_t *lay, const void *src,
                           uint64_t stride, size_t n, const uint64_t *block_ids, void *stream,
                           const char *fn);
/* Gates (stream-ordered remote fetches): `stream` held (cuStreamWaitValue64, GEQ: the GPU's front
 * end waits, no SM) until the host stores a value >= ticket into *word. A word comes from a page
 * of the process that is never freed (skv__kvc_gate_word; its value is where its new owner
 * counts on from). SKV_ENOTSUP when the driver cannot hold a stream so. Events: recorded on a
 * stream, asked whether done (1, 0, or a failure), freed. */
int skv__kvc_gate_word(uint64_t **word);
void skv__kvc_gate_word_put(uint64_t *word);
int skv__kvc_gate(void *stream, uint64_t *word, uint64_t ticket, const char *fn);
int skv__kvc_event(void *stream, void **ev, const char *fn);
int skv__kvc_event_done(void *ev);
void skv__kvc_event_free(void *ev);
/* Register [p, p + len) of host memory with CUDA, mapped for the device (add), or unregister.
 * SKV__KVC_REGISTERED_ELSEWHERE (> 0, no error set): it was registered already (by UCX), and
 * the caller must not unregister it. */
int skv__kvc_host_register(void *p, size_t len, bool add);
#define SKV__KVC_REGISTERED_ELSEWHERE 1
/* Device memory of the current device for staging (cudaMalloc; a remote fetch made the PE's
 * device current first, skv__kvc_begin), and its release. */
int skv__kvc_dev_alloc(size_t len, void **p);
void skv__kvc_dev_free(void *p);

/* Wait until every stream-ordered copy completed and its `done` ran (bounded by the timeout);
 * returns the first failure since the last sync, or a reference a kernel refused. */
int skv__kvc_sync(skv__kvc_t *kc);
/* No launch of this cache is waiting for its completion (a look, not a wait; true for NULL). */
bool skv__kvc_idle(skv__kvc_t *kc);
/* The device-side error word (tests): 4 words of pinned host memory, mapped for the device. */
uint32_t *skv__kvc_err_word(skv__kvc_t *kc);

/* ---- kv_cuda_variant.c: the copy kernels' process-wide variant ------------------------------ */

/* Kernel SKV_KV_KERNEL_AUTO, _VEC, _BULK or _CE, 16-byte loads in flight per thread (VEC: 4 or 8),
 * CTAs per multiprocessor (1..32, fewer when the kernel's occupancy allows fewer), threads per CTA
 * (VEC: 128, 256 or 512), where the arguments travel (SKV_KV_ARGS_*) and the L2 hint. Read once
 * from SKV_FETCH_KERNEL, _UNROLL, _CTAS and _THREADS; set here to compare variants in one run. */
typedef struct skv__kv_variant {
  int kernel, unroll, ctas_per_sm, threads, args, l2_256;
} skv__kv_variant_t;
int skv__kv_variant_set(const skv__kv_variant_t *v);
void skv__kv_variant_get(skv__kv_variant_t *v);
/* "vec_u8_c4_t256_auto", "bulk_c1_auto", "auto_u4_c4_t256_auto": `v`, or the variant in use
 * when NULL. */
const char *skv__kv_variant_name(const skv__kv_variant_t *v, char *buf, size_t cap);
/* The launch configuration of the variant in use, for a device of `sms` multiprocessors. */
skv__kv_copy_cfg_t skv__kv_variant_cfg(int sms);

#endif
