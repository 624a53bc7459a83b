/* Internal interface of the KV copy kernels (kernels/kv_copy.cu): a plain-C description of one
 * batch moved between heap pages and engine blocks, the kernel variants, and launch wrappers. */
#ifndef SKV_KV_COPY_H
#define SKV_KV_COPY_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum { SKV_KV_COPY_FETCH = 0, SKV_KV_COPY_PUBLISH = 1 };

/* Device-side violations (err[0], the first one a thread saw; err[1..3]: page index in the
 * batch, tensor, and the offending value). The host checked everything before the launch:
 * these only fire for corrupted arguments, and then nothing outside the heap is touched. */
enum { SKV_KV_DEVERR_PE = 1, SKV_KV_DEVERR_PAGE = 2, SKV_KV_DEVERR_BLOCK = 3 };
/* A gated fetch's copy that waited gate_ms for its pins gave up (err[1]: the page it waited for,
 * err[3]: the gate it saw); the pages from there on are not read. */
enum { SKV_KV_DEVERR_GATE = 4 };

/* Argument bytes a launch can carry inside its kernel parameters: every kernel takes this many,
 * and BULK and the 16-byte VEC kernels also the larger amount where the driver takes kernel
 * parameters over 4 KiB (CUDA 12.1 on): 1024 pages of one block each need 12 KiB. A batch's
 * argument block copied to the GPU before its kernel cost 6-7 us of GPU time at 64 MiB on an
 * H100 (bench/gpu/page_probe.cu: 0.80x the copy engine against 0.90x with them in the
 * parameters). */
#define SKV_KV_COPY_INLINE_BYTES 3456u
#define SKV_KV_COPY_INLINE_TINY                              \
  512u /* the 16-byte VEC kernels' tiny parameters: a launch \
          of up to ~40 pages copies 512 bytes, not 3.7 KiB */
#define SKV_KV_COPY_INLINE_BIG 16128u

/* One batch: pages (pe, page) of the heap <-> engine blocks, m = blocks_per_page per page.
 * A page holds ntensors slabs of page_tokens x heads rows of row_bytes, contiguous; row (token
 * tok, head h) of slab t goes to bases[t] + block_ids[i*m + tok / block_tokens] * stride_block
 * + (tok % block_tokens) * stride_token + h * stride_head.
 * The argument block is [bases: ntensors x uint64][refs: n x (uint32 pe, uint32 page)]
 * [block ids: n x m, uint32 or uint64 (bid64)], refs at refs_off, ids at bids_off (8-byte
 * aligned). The kernels read it from args_dev (device-readable: device memory, or pinned host
 * memory mapped for the device), or from their parameters when the variant allows it and it
 * fits (copied from args_host at launch). */
typedef struct skv__kv_copy_desc {
  int32_t dir;    /* SKV_KV_COPY_FETCH (page -> blocks) or SKV_KV_COPY_PUBLISH */
  uint32_t width; /* vector bytes: 16, 8, 4, 2 or 1; divides every address and stride */
  /* the heap */
  uint64_t heap;        /* device address of PE 0's page 0 */
  uint64_t pe_stride;   /* bytes between PEs' segments */
  uint64_t page_stride; /* bytes between pages */
  uint32_t npes, pages_per_pe;
  /* the page format */
  uint32_t ntensors; /* layers x (2 or 1) */
  uint32_t heads;
  uint32_t row_bytes; /* head_dim x elem_bytes */
  uint32_t page_tokens;
  /* the engine */
  uint32_t block_tokens;
  uint32_t blocks_per_page; /* m */
  uint32_t run_bytes; /* bytes contiguous both in a page and in a block (a multiple of rows) */
  uint32_t bid64;
  uint64_t num_blocks;
  int64_t stride_block, stride_token, stride_head; /* bytes */
  /* the batch */
  uint32_t n;
  uint32_t args_bytes, refs_off, bids_off;
  const void *args_dev;  /* device-readable argument block, or NULL */
  const void *args_host; /* host-readable copy of it, or NULL */
  uint32_t *err;         /* [4], device-writable (host-mapped), 0 when clean */
  /* a gated fetch (below), else gate NULL: the gate word (host memory, device-mapped), its mirror
   * and lock (device memory, 0 at first), and the use's epoch (the word's upper 32 bits, not 0) */
  const uint64_t *gate;
  uint64_t *gate_mirror;
  uint32_t *gate_lock;
  uint32_t gate_epoch;
  uint32_t gate_ms; /* the longest wait for the host, then SKV_KV_DEVERR_GATE */
  /* publish: the launch follows the previous launch of the same publish on its stream, with
   * nothing enqueued between them but that launch's event: it may begin while that launch's last
   * CTAs run (programmatic dependent launch; the two write other pages and only read the
   * engine's blocks). An event recorded after a launch waits for it and every launch before it
   * (not for a later one that began early). precedes: another launch of the same publish is
   * meant to follow this one so; its kernel then lets the stream's next kernel begin as soon as
   * it starts. What follows a publish on the stream: a kernel launched plainly waits for all of
   * it; one launched as a programmatic dependent may begin before the publish's earlier launches
   * ended (as after any launches of that kind), and must wait for its prerequisites
   * (cudaGridDependencySynchronize) before it touches memory they use, the engine's blocks
   * included. If the launch with the attribute fails, it is launched again without it. */
  uint32_t follows, precedes;
} skv__kv_copy_desc_t;

/* A gated fetch is launched before its pages are pinned: the host pins them in order and stores
 * in the gate word (epoch << 32 | count) how many are pinned (pages [0, count) may be read), then
 * count | SKV_KV_GATE_CLOSED once it is done, with the pages it pinned in all (fewer than n when
 * a reference was stale). The kernels read page i once the count passed it, and skip it when the
 * gate closed before it. Device-side, page data is only ever read behind the count. */
#define SKV_KV_GATE_CLOSED 0x80000000u

enum {
  SKV_KV_ARGS_AUTO =
      0,                  /* in the kernel parameters when they fit, else as MAPPED (the
                             caller, src/kv/kv_cuda_launch.c, makes a device copy of a local batch's) */
  SKV_KV_ARGS_MAPPED = 1, /* read args_dev, pinned host memory, over PCIe (zero copy) */
  SKV_KV_ARGS_DEVICE = 2, /* read args_dev, a device copy the caller made */
};
/* SKV_KV_KERNEL_CE is carried out by the caller (src/kv/kv_cuda_launch.c: the copy engines, through
 * cudaMemcpyBatchAsync, for dense runs); the kernels treat it as VEC. SKV_KV_KERNEL_AUTO runs
 * BULK for fetches of SKV_KV_BULK_MIN_BYTES and more, VEC for smaller ones: a smaller batch has
 * few of BULK's 8 KiB chunks to spread over the warps, where VEC's are 2 KiB (one H100 under MPS,
 * alternated: VEC 0.81-0.83x the copy engine against BULK's 0.75-0.79x at 64 KiB x1 and x16, even
 * at 4 MiB, BULK 0.73x against 0.68-0.70x at 16 MiB;
 * bench/results/e2e21_params_nvidia-h100-x1.txt). */
enum {
  SKV_KV_KERNEL_VEC = 0,
  SKV_KV_KERNEL_BULK = 1,
  SKV_KV_KERNEL_CE = 2,
  SKV_KV_KERNEL_AUTO = 3
};
#define SKV_KV_BULK_MIN_BYTES (8ull << 20)

/* Kernel variant and grid shape. */
typedef struct skv__kv_copy_cfg {
  int32_t kernel;      /* SKV_KV_KERNEL_*: BULK fetches 16-byte aligned runs of 128 bytes and more
                          through TMA bulk copies (AUTO: batches of SKV_KV_BULK_MIN_BYTES and more);
                          other batches, and CE, run VEC */
  int32_t unroll;      /* VEC: 16-byte loads in flight per thread, 4 or 8 */
  int32_t ctas_per_sm; /* persistent grid: at most this many CTAs per multiprocessor, 1..32 */
  int32_t threads;     /* VEC: threads per CTA, 128, 256 or 512 (BULK: 4 warps) */
  int32_t args;        /* SKV_KV_ARGS_* */
  int32_t l2_256;      /* VEC: 16-byte page loads hint the L2 to fetch 256-byte sectors */
  int32_t sms;         /* multiprocessors of the device */
} skv__kv_copy_cfg_t;

/* ---- kv_copy.cu: launches ------------------------------------------------------------------- */

/* Will this launch carry its arguments in its parameters (no args_dev needed)? */
int skv__kv_copy_args_inline(const skv__kv_copy_desc_t *d, const skv__kv_copy_cfg_t *cfg);
/* The largest number of pages one launch may carry (work items stay below 2^31); 0 when the
 * geometry does not fit the kernels (a slab of 2 GiB or more). */
uint64_t skv__kv_copy_max_pages(const skv__kv_copy_desc_t *d, const skv__kv_copy_cfg_t *cfg);
/* Launch one batch on `stream` (a cudaStream_t). Returns a cudaError_t: 0, or
 * cudaErrorInvalidValue for a descriptor the kernels cannot take (bad width, too many pages,
 * no argument block), or the launch error. */
int skv__kv_copy_launch(const skv__kv_copy_desc_t *d, const skv__kv_copy_cfg_t *cfg, void *stream);
/* Load every kernel variant now and cache its occupancy (modules load lazily; doing it up
 * front keeps the first launch out of a graph capture). Returns a cudaError_t. */
int skv__kv_copy_preload(void);
/* Name of the kernel a descriptor and variant run ("skv_k_fetch_vec16<u8>"), for logs. */
const char *skv__kv_copy_kernel_name(const skv__kv_copy_desc_t *d, const skv__kv_copy_cfg_t *cfg);

/* Hold `stream` until *flag (host-mapped) is non-zero and at least min_ns passed, at most
 * max_ns (benchmarks: the GPU stays busy, so its clocks are up, while the host enqueues work
 * behind the gate; events then time the GPU alone). Returns a cudaError_t. */
int skv__kv_gate_launch(void *stream, const volatile uint32_t *flag, uint64_t min_ns,
                        uint64_t max_ns);

#ifdef __cplusplus
}
#endif
#endif
