/* Launches of the CUDA copy backend: the plan of a batch (descriptor, vector width, pages per
 * launch), its arguments in a slot, and the copy itself (a kernel, or the copy engines). */
#define _GNU_SOURCE
#include "kv/kv_cuda_int.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* How it works
 * ------------
 * A launch's arguments (the engine's tensor bases, the (pe, page) pairs and the block ids) are
 * written into an argument slot of pinned, device-mapped host memory: nothing to allocate per
 * call. Small batches (up to SKV_KV_COPY_INLINE_BYTES of arguments, e.g. 300 pages of one
 * block) travel in the kernel's parameters, and up to SKV_KV_COPY_INLINE_BIG (1300 pages) in the
 * larger parameters of the bulk and 16-byte vec kernels where the driver has them. Larger ones of a
 * batch that reads a peer's pages are read by the kernels from the slot over PCIe, a few bytes per
 * 8 KiB chunk, which the NVLink transfer hides; a batch that stays in this GPU (publish; a fetch of
 * this PE's own pages, or of pages of PEs sharing this GPU) would wait on those reads instead, so
 * its arguments are first copied to the slot's device mirror, one DMA on the caller's stream
 * (docs/gpu.md has the measurements behind both choices). Batches larger than a slot (beyond
 * SKV__KVC_MAX_PAGES pages, or fewer when pages have many blocks) are split into several launches
 * by the caller.
 *
 * The copy is the process-wide variant's (kv_cuda_variant.c): "auto" (default), "bulk" for
 * fetches of SKV_KV_BULK_MIN_BYTES and more, else "vec"; "bulk", the TMA kernel for 16-byte
 * aligned runs of 128 bytes and more, else the vec kernel; "vec"; or "ce",
 * the copy engines through cudaMemcpyBatchAsync, one copy per run, for runs of CE_MIN_RUN bytes
 * and more and at most CE_MAX_COPIES copies, else the vec kernel. The copy engines leave the SMs
 * to the engine but cost the host time per copy (docs/gpu.md compares them).
 *
 * What can go wrong
 * -----------------
 * - A launch whose event cannot be recorded after the copy was enqueued: the call waits for the
 *   stream and completes the launch itself, so pins never leak.
 * - cudaMemcpyBatchAsync missing or refusing (an older driver): the kernels take over for good. */

#define CE_MIN_RUN    (8u << 10) /* copy-engine fetch: runs of at least this many bytes */
#define CE_MAX_COPIES 8192u      /* and at most this many copies per cudaMemcpyBatchAsync */

/* The vector width: every row, stride and base a multiple of it. */
static uint32_t vec_width(const skv__kv_copy_desc_t *d, const skv_layout_t *lay) {
  uint64_t acc = d->row_bytes | d->heap | d->pe_stride | d->page_stride |
                 (uint64_t)d->stride_block | (uint64_t)d->stride_token | (uint64_t)d->stride_head;
  for (uint32_t t = 0; t < d->ntensors; t++) acc |= (uint64_t)(uintptr_t)lay->base[t];
  uint32_t w = 16;
  while (w > 1 && (acc & (w - 1))) w >>= 1;
  return w;
}

/* Describe copies between this cache's pages and `lay` (a device layout on this PE's GPU). */
int skv__kvc_plan(skv__kvc_t *kc, const skv_layout_t *lay, int dir, skv__kvc_plan_t *pl,
                  const char *fn) {
  const skv_geometry_t *g = &kc->geom;
  const skv_heap_info_t *hi = &kc->p.heap->info;
  if (lay->device != kc->device)
    return SKV_FAIL(
        SKV_EINVAL, SKV_SUBSYS_KV,
        "%s: the layout describes memory of GPU %d but this PE uses GPU %d (config.device / "
        "SKV_DEVICE): the copy kernels run on the PE's GPU, so its engine cache must be there",
        fn, lay->device, kc->device);
  memset(pl, 0, sizeof *pl);
  skv__kv_copy_desc_t *d = &pl->d;
  const uint64_t e = g->elem_bytes;
  d->dir = dir;
  /* a layout of some layers copies from their offset in each page on (pages are
   * [layer][k|v][token][head][dim]: the layers' bytes are one run of each page) */
  d->heap = (uint64_t)(uintptr_t)hi->base + hi->data_offset + lay->page_off;
  d->pe_stride = hi->stride;
  d->page_stride = kc->p.page_stride;
  d->npes = kc->npes;
  d->pages_per_pe = kc->p.pages_per_pe;
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
  d->width = vec_width(d, lay);
  pl->cfg = skv__kv_variant_cfg(kc->sms);
  pl->bases_bytes = (uint32_t)SKV_ALIGN_UP((uint64_t)d->ntensors * 8, 16);
  pl->bid_bytes = d->bid64 ? 8 : 4;
  uint64_t per = 8 + (uint64_t)d->blocks_per_page * pl->bid_bytes;
  if (pl->bases_bytes + per > SKV__KVC_SLOT_BYTES)
    return SKV_FAIL(
        SKV_ENOTSUP, SKV_SUBSYS_KV,
        "%s: the arguments of one page (%u block ids) do not fit a %u KiB argument slot: use "
        "fewer blocks per page (a larger block_tokens)",
        fn, d->blocks_per_page, SKV__KVC_SLOT_BYTES >> 10);
  uint64_t kmax = skv__kv_copy_max_pages(d, &pl->cfg);
  if (kmax == 0)
    return SKV_FAIL(
        SKV_ENOTSUP, SKV_SUBSYS_KV,
        "%s: one layer's K or V of a page is 2 GiB or more, beyond what the copy kernels address: "
        "lower page_tokens",
        fn);
  uint64_t ppl =
      SKV_MIN((uint64_t)SKV__KVC_MAX_PAGES, (SKV__KVC_SLOT_BYTES - pl->bases_bytes) / per);
  pl->ppl = (uint32_t)SKV_MIN(ppl, kmax);
  /* the copy engines: dense runs only (enqueue also caps the copies of one launch) */
  pl->ce = pl->cfg.kernel == SKV_KV_KERNEL_CE && dir == SKV_KV_COPY_FETCH &&
           d->run_bytes >= CE_MIN_RUN && !__atomic_load_n(&kc->ce_off, __ATOMIC_RELAXED);
  return 0;
}

int skv__kvc_plan_src(skv__kvc_t *kc, const skv_layout_t *lay, uint64_t src, uint64_t stride,
                      uint32_t n, skv__kvc_plan_t *pl, const char *fn) {
  SKV_CHECK(skv__kvc_plan(kc, lay, SKV__KV_FETCH, pl, fn));
  skv__kv_copy_desc_t *d = &pl->d;
  d->heap = src;
  d->pe_stride = 0;
  d->page_stride = stride;
  d->npes = 1;
  d->pages_per_pe = n;
  d->width = vec_width(d, lay);
  pl->ce = false;
  return 0;
}

void skv__kvc_fill(skv__kvc_slot_t *s, skv__kvc_plan_t *pl, const skv_layout_t *lay,
                   const skv__kv_batch_t *b, size_t off, uint32_t k, const uint64_t *bids,
                   const size_t *idx) {
  uint64_t *bases = (uint64_t *)s->args;
  for (uint32_t t = 0; t < pl->d.ntensors; t++) bases[t] = (uint64_t)(uintptr_t)lay->base[t];
  uint32_t *pp = (uint32_t *)(s->args + pl->bases_bytes);
  const uint64_t here = s->kc->this_gpu;
  uint64_t pes = 0;
  for (uint32_t q = 0; q < k; q++) {
    const uint32_t pe = b->pe[(off + q) * b->pe_step];
    pp[2 * q] = pe;
    pp[2 * q + 1] = b->page[(off + q) * b->page_step];
    pes |= 1ull << (pe & 63);
  }
  /* pages of PEs on this GPU only (its own, or of PEs sharing it): nothing crosses NVLink to
   * hide the kernel's argument reads over PCIe behind, so they go to the device mirror */
  const bool local = (pes & ~here) == 0;
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
  s->dir = b->dir;
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
int skv__kvc_launch(skv__kvc_slot_t *s, skv__kvc_plan_t *pl, void *stream, const char *fn) {
  int e = 0;
  const int mode = pl->cfg.args;
  if (!skv__kv_copy_args_inline(&pl->d, &pl->cfg) &&
      (mode == SKV_KV_ARGS_DEVICE || (mode == SKV_KV_ARGS_AUTO && pl->local))) {
    e = (int)cudaMemcpyAsync(s->mirror, s->args, pl->d.args_bytes, cudaMemcpyHostToDevice,
                             (cudaStream_t)stream);
    pl->d.args_dev = s->mirror;
    pl->d.follows = 0; /* its arguments' copy comes between: the launch waits for it */
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
static int ce_copy(skv__kvc_t *kc, skv__kvc_slot_t *s, const skv__kvc_plan_t *pl, void *stream,
                   bool *started, const char *fn) {
  const skv__kv_copy_desc_t *d = &pl->d;
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
int skv__kvc_enqueue(skv__kvc_t *kc, skv__kvc_slot_t *s, skv__kvc_plan_t *pl, void *stream,
                     bool *consumed, const char *fn) {
  *consumed = false;
  int rc = 0;
  bool started = false;
  skv__kv_prof_t *P = kc->p.prof;
  uint64_t t = skv__kp_now(P);
  /* Beyond CE_MAX_COPIES copies the kernels do it all: the copy engines cost the host time per
   * copy and lose to the kernels on large random batches (docs/gpu.md). */
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
  if (!pl->ce) SKV_CHECK(skv__kvc_launch(s, pl, stream, fn));
  *consumed = true;
  (void)skv__kp_lap(P, SKV__KP_LAUNCH, t);
  const int r2 = skv__kvc_handoff(kc, s, stream, fn);
  return rc ? rc : r2;
}

int skv__kvc_handoff(skv__kvc_t *kc, skv__kvc_slot_t *s, void *stream, const char *fn) {
  skv__kv_prof_t *P = kc->p.prof;
  const uint64_t t = skv__kp_now(P);
  cudaError_t e = cudaEventRecord(s->done, (cudaStream_t)stream);
  if (e == cudaSuccess) {
    skv__kvc_slot_pending(kc, s);
    (void)skv__kp_lap(P, SKV__KP_HANDOFF, t);
    return 0;
  }
  /* the copy is enqueued but nothing marks its end: complete it here */
  (void)cudaGetLastError();
  const int rc = SKV_FAIL(SKV_ECUDA, SKV_SUBSYS_KV,
                          "%s: recording the event that marks the end of a copy failed: %s (%s); "
                          "waited for the stream instead",
                          fn, cudaGetErrorString(e), cudaGetErrorName(e));
  if (cudaStreamSynchronize((cudaStream_t)stream) != cudaSuccess) (void)cudaGetLastError();
  skv__kvc_slot_done(s);
  return rc;
}
