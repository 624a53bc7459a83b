/* Internal API of the cluster layer: a node's pages exported over UCX (xfer.c), the Redis
 * directory of which node holds which key (dir.c), and the handle that joins them (cluster.c). */
#ifndef SKV_CLUSTER_H
#define SKV_CLUSTER_H

#include "core/core.h"

#include <pthread.h>

#define SKV__CL_NAME_CAP 64 /* node and cluster names: 1..63 characters */

/* A directory entry's value: where the page is. Binary, fixed size, compared byte for byte by
 * the conditional delete (so a node removes only the entry it wrote). */
typedef struct skv__dir_val {
  char node[SKV__CL_NAME_CAP];
  uint64_t nonce; /* the node's incarnation (its record says the same, else the entry is old) */
  uint32_t pe, page, gen, pad;
} skv__dir_val_t;

/* ---- xfer.c: UCX ------------------------------------------------------------------------- */

typedef struct skv__xfer skv__xfer_t;

/* What a node exports: its page area (host or GPU memory) and the records of those pages
 * (8-byte state words, `meta_stride` apart, host memory) of this process. pages == 0: nothing
 * (a reader). */
typedef struct skv__export {
  void *pages_base;
  uint64_t page_stride, page_bytes, pages;
  void *meta_base;
  uint64_t meta_stride;
  uint32_t rpins_off; /* offset of the remote pin word in a record (skv__page_meta_t.rpins) */
  uint32_t pe;        /* the slot (or local PE) the pages belong to */
  bool pages_gpu;     /* the page area is GPU memory (needs a UCX with CUDA) */
} skv__export_t;

/* Create a UCX context, a serving worker (with its progress thread) and a fetching worker;
 * register `ex` and pack the node record (*blob, *blob_len; freed with the xfer). */
int skv__xfer_create(const skv__export_t *ex, uint64_t nonce, int timeout_ms, skv__xfer_t **out,
                     const void **blob, size_t *blob_len);
void skv__xfer_destroy(skv__xfer_t *x);

/* Peers: a node's record becomes a peer number (connected lazily). Same name and nonce: the same
 * number. SKV_EPROTO for a record that does not parse. */
int skv__xfer_peer(skv__xfer_t *x, const char *name, const void *blob, size_t len, uint32_t *peer);
const char *skv__xfer_peer_name(const skv__xfer_t *x, uint32_t peer);
/* Is the peer known to have failed (its endpoint broke or timed out)? */
bool skv__xfer_peer_failed(const skv__xfer_t *x, uint32_t peer);
uint32_t skv__xfer_npeers(const skv__xfer_t *x);
/* Forget a peer's failure (its record is still renewed): the next get connects again. */
void skv__xfer_peer_retry(skv__xfer_t *x, uint32_t peer);
uint64_t skv__xfer_peer_nonce(const skv__xfer_t *x, uint32_t peer);

/* Pages read by skv__xfer_get_pages and checked: pages [first, first + count) of the call are
 * at `bytes`, `len` bytes apart (valid during the callback only). Non-zero: a failure (set
 * with SKV_FAIL) that ends the call, returned by it; SKV_ETIMEDOUT says that a copy out of
 * `bytes` may still be running, and the staging buffer is then left to it (never reused). */
typedef int (*skv__xfer_deliver_fn)(void *arg, size_t first, size_t count, const void *bytes);

/* Where a get's pages land before they are delivered: host staging (registered with CUDA by
 * host_register when set, so that GPU kernels read it; > 0: registered already, by UCX, which
 * then unregisters it), or GPU staging (gpu_alloc / gpu_free: UCX then writes GPU memory itself;
 * needs skv__xfer_cuda). A failure of host_register or gpu_alloc fails the get that needed the
 * buffer. */
typedef struct skv__xfer_mem_ops {
  int (*host_register)(void *p, size_t len, bool add);
  int (*gpu_alloc)(size_t len, void **p);
  void (*gpu_free)(void *p);
} skv__xfer_mem_ops_t;
void skv__xfer_set_mem_ops(skv__xfer_t *x, const skv__xfer_mem_ops_t *ops);
/* Does this UCX read and write GPU memory (a build with CUDA, cuda_copy in UCX_TLS)? */
bool skv__xfer_cuda(const skv__xfer_t *x);
/* Does UCX move GPU memory from `peer` without host buffers of its own, so that reading pages
 * straight into GPU staging pays? From the endpoint's transports (connecting it first; UCX 1.14
 * on, else false), kept per peer: skv__xfer_gpu_direct_lanes of their names, with whether the
 * NICs can register GPU memory (GPUDirect RDMA). */
bool skv__xfer_peer_gpu_direct(skv__xfer_t *x, uint32_t peer);
/* Do reads from `peer` into host memory make no CUDA call in this process (a UCX without CUDA,
 * or no CUDA transport among the endpoint's, such as cuda_ipc)? *host_only false where UCX
 * cannot tell. Connects the peer first (its failure returned, nothing kept). */
int skv__xfer_peer_host_only(skv__xfer_t *x, uint32_t peer, bool *host_only);
/* cuda_ipc or gdr_copy among names[0..n), or an RDMA transport (rc_*, dc_*, ud_*) with nic_gpu;
 * not TCP nor shared memory, over which UCX bounces GPU memory through host buffers of its own
 * (slower than symkv's pinned staging: docs/cluster.md). */
bool skv__xfer_gpu_direct_lanes(const char *const *names, size_t n, bool nic_gpu);

/* Read bytes [off, off + len) of pages page[i] (whose directory generation is gen[i]) of
 * `peer`, i < n, in a pipeline of sub-batches: each sub-batch's pages go into a registered
 * staging slot (GPU staging when to_gpu), then their state words into host memory; while later
 * sub-batches are in flight, a sub-batch whose state words all say READY with the generation
 * asked for goes to `deliver` (`bytes` is then GPU memory when to_gpu), in order.
 * SKV_ESTALE (*bad: the first stale page; the pages before its sub-batch were delivered, none
 * of its own or after) when a page is not READY with its generation after its bytes were read;
 * SKV_EPEERDEAD when the peer failed or did not answer within the timeout (each wait is bounded
 * by it; the endpoint is then closed, so nothing lands in the staging later). Not thread-safe
 * (the caller serialises). */
typedef struct skv__xfer_into {
  void *buf;  /* host memory: page i of the call at buf + i * len */
  void *memh; /* its UCX registration (skv__xfer_map) */
} skv__xfer_into_t;
int skv__xfer_get_pages(skv__xfer_t *x, uint32_t peer, const uint32_t *page, const uint32_t *gen,
                        size_t n, uint64_t off, uint64_t len, bool to_gpu,
                        const skv__xfer_into_t *into, skv__xfer_deliver_fn deliver, void *arg,
                        size_t *bad);
/* With `into`, the pages land in the caller's registered buffer instead of the staging slots
 * (each sub-batch at its own place: nothing is reused), and `bytes` of the deliveries point
 * into it. skv__xfer_into_left: the last such call left the buffer to a transfer that did not
 * complete after a forced close (it may still be written: never reuse it). */
bool skv__xfer_into_left(const skv__xfer_t *x);
/* Host memory registered with UCX for gets (*memh), and its release. */
int skv__xfer_map(skv__xfer_t *x, void *p, size_t len, void **memh);
void skv__xfer_unmap(skv__xfer_t *x, void *memh);
/* Pin pages page[i] of `peer` (src/pool/pool.h, "Remote pins"): a message to the peer, whose
 * serving thread adds to each page's rpins word and answers with the state words read after;
 * *held: how many leading pages are READY with gen[i] and stay pinned (the pins of the others
 * are given back). SKV_EPEERDEAD as for a get (no pin is then held: those taken lapse with the
 * owner's lease). */
int skv__xfer_pin_pages(skv__xfer_t *x, uint32_t peer, const uint32_t *page, const uint32_t *gen,
                        size_t n, size_t *held);
/* Give back pins of pages page[0..n) of `peer` (a message, its answer awaited, bounded). */
int skv__xfer_unpin_pages(skv__xfer_t *x, uint32_t peer, const uint32_t *page, size_t n);
uint64_t skv__xfer_page_bytes(const skv__xfer_t *x, uint32_t peer);
/* Progress the fetching worker once (from a deliver callback, while a copy is awaited: the
 * later sub-batches keep moving); how many events it handled. `x` is a skv__xfer_t. */
unsigned skv__xfer_progress(void *x);

/* ---- dir.c: the Redis directory --------------------------------------------------------- */

typedef struct skv__dir skv__dir_t;

typedef struct skv__dir_params {
  const char *url, *prefix, *node;
  uint64_t nonce;
  int timeout_ms, lease_ms;
  const void *blob; /* the node record (UCX address and memory keys) */
  size_t blob_len;
  uint64_t pages;              /* pages this node exports (tracked by page number) */
  const uint64_t *state_words; /* &meta[0].state of those pages, `state_stride` bytes apart */
  uint64_t state_stride;
  uint32_t pe;
} skv__dir_params_t;

/* Connect (SKV_ECONN naming the URL when Redis does not answer), write the node record under
 * its lease and start the background thread (batched writes, lease renewal, eviction scan,
 * reconnection and republication). */
int skv__dir_create(const skv__dir_params_t *p, skv__dir_t **out);
/* Remove this node's entries and record (best effort, bounded), stop the thread. */
void skv__dir_destroy(skv__dir_t *d);
/* Queue page `page` (now holding `key` at generation `gen`) for the directory. */
void skv__dir_track(skv__dir_t *d, uint32_t page, skv_key_t key, uint32_t gen);
/* Queue a conditional delete of an entry found stale by a reader. */
void skv__dir_forget(skv__dir_t *d, skv_key_t key, const skv__dir_val_t *val);
/* Wait until what was queued before the call is in Redis (bounded). */
int skv__dir_flush(skv__dir_t *d);
/* Entries of keys[0..n): vals[i] filled and found[i] set for the keys present (one MGET). */
int skv__dir_mget(skv__dir_t *d, const skv_key_t *keys, size_t n, skv__dir_val_t *vals,
                  bool *found);
/* A node's record: *blob (malloc'd, caller frees) and its length; SKV_ENOTFOUND when absent
 * (the node left or its lease ran out). */
int skv__dir_node(skv__dir_t *d, const char *node, void **blob, size_t *len);

typedef struct skv__dir_counters {
  uint64_t exported, puts, dels, errors, reconnects;
} skv__dir_counters_t;
void skv__dir_counters(const skv__dir_t *d, skv__dir_counters_t *c);

#endif
