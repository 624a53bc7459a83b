/* Symmetric heap front end: argument checks, the [signal | scratch | data] layout, the
 * collective check, and dispatch to the host or CUDA backend. */
#define _GNU_SOURCE
#include "heap/heap.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define DEFAULT_SIGNAL_BYTES       (64u << 10)
#define DEFAULT_CUDA_SCRATCH_BYTES (8u << 20)
#define MAX_HEAP_BYTES             (1ull << 40) /* 1 TiB per PE */

const char *skv__backend_name(int backend) {
  switch (backend) {
  case SKV_BACKEND_HOST:
    return "host";
  case SKV_BACKEND_CUDA:
    return "cuda";
  case SKV_BACKEND_CUDA_HOST:
    return "cuda_host";
  default:
    return "unknown";
  }
}

int skv__heap_agree(skv_heap_t *heap, const char *step, int rc) {
  char what[sizeof heap->name + 32];
  snprintf(what, sizeof what, "skv_heap_create(%s)", heap->name);
  return skv__coll_agree(&heap->op, step, rc, what);
}

static const skv__heap_backend_t *backend_of(int backend) {
  switch (backend) {
  case SKV_BACKEND_HOST:
    return &skv__heap_host;
#ifdef SKV_WITH_CUDA
  case SKV_BACKEND_CUDA:
    return &skv__heap_cuda;
  case SKV_BACKEND_CUDA_HOST:
    return &skv__heap_cuda_host;
#endif
  default:
    return NULL;
  }
}

int skv_heap_create(skv_ctx_t *ctx, uint64_t data_bytes, skv_backend_t backend, skv_heap_t **heap) {
  skv_heap_opts_t o = SKV_HEAP_OPTS_INIT;
  o.backend = backend;
  o.data_bytes = data_bytes;
  return skv_heap_create_ex(ctx, &o, heap);
}

int skv_heap_create_ex(skv_ctx_t *ctx, const skv_heap_opts_t *opts, skv_heap_t **out) {
  SKV_ARG_CHECK(ctx && opts && out, SKV_SUBSYS_HEAP,
                "skv_heap_create: ctx, opts and heap must be non-NULL");
  *out = NULL;
  SKV_ARG_CHECK(
      opts->size >= sizeof(skv_heap_opts_t) && opts->version >= 1 &&
          opts->version <= SKV_HEAP_OPTS_VERSION,
      SKV_SUBSYS_HEAP,
      "skv_heap_create: opts.size=%zu / opts.version=%u: initialise with SKV_HEAP_OPTS_INIT",
      opts->size, opts->version);
  const skv__heap_backend_t *be = backend_of(opts->backend);
  if (!be) {
    if (opts->backend == SKV_BACKEND_CUDA || opts->backend == SKV_BACKEND_CUDA_HOST)
      return SKV_FAIL(
          SKV_ENOTSUP, SKV_SUBSYS_HEAP,
          "skv_heap_create: backend %s needs a build with CUDA (configure with -DSKV_CUDA=ON)",
          skv__backend_name(opts->backend));
    return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_HEAP,
                    "skv_heap_create: backend %d is not SKV_BACKEND_HOST, _CUDA or _CUDA_HOST",
                    opts->backend);
  }
  SKV_ARG_CHECK(opts->data_bytes > 0 && opts->data_bytes <= MAX_HEAP_BYTES, SKV_SUBSYS_HEAP,
                "skv_heap_create: data_bytes=%" PRIu64 " is not in 1..%" PRIu64, opts->data_bytes,
                (uint64_t)MAX_HEAP_BYTES);
  SKV_ARG_CHECK(opts->signal_bytes <= (64ull << 20) && opts->scratch_bytes <= (4ull << 30),
                SKV_SUBSYS_HEAP,
                "skv_heap_create: signal_bytes=%" PRIu64 " (max 64 MiB) or scratch_bytes=%" PRIu64
                " (max 4 GiB) too large",
                opts->signal_bytes, opts->scratch_bytes);

  skv_heap_t *h = calloc(1, sizeof *h);
  if (!h) return SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_HEAP, "skv_heap_create: out of memory");
  h->ctx = ctx;
  h->be = be;
  h->gpu_shared_with = -1;
  h->gpu_sharers = 1;
  skv_heap_info_t *in = &h->info;
  in->size = sizeof *in;
  in->backend = opts->backend;
  in->npes = ctx->nlocal;
  in->my_pe = ctx->local_index;
  in->device = -1;
  in->signal_offset = 0;
  in->signal_bytes =
      SKV_ALIGN_UP(opts->signal_bytes ? opts->signal_bytes : DEFAULT_SIGNAL_BYTES, 256);
  in->scratch_offset = in->signal_offset + in->signal_bytes;
  uint64_t scratch = opts->scratch_bytes;
  if (!scratch && opts->backend == SKV_BACKEND_CUDA) scratch = DEFAULT_CUDA_SCRATCH_BYTES;
  in->scratch_bytes = SKV_ALIGN_UP(scratch, 256);
  in->data_offset = SKV_ALIGN_UP(in->scratch_offset + in->scratch_bytes, 4096);
  in->data_bytes = opts->data_bytes;
  int rc = skv__coll_begin(ctx, &h->op, "heap",
                           "skv_heap_create(backend=%s, data_bytes=%" PRIu64
                           ", signal_bytes=%" PRIu64 ", scratch_bytes=%" PRIu64 ")",
                           be->name, in->data_bytes, in->signal_bytes, in->scratch_bytes);
  if (rc < 0) {
    free(h);
    return rc;
  }
  snprintf(h->name, sizeof h->name, "%s", h->op.name);
  uint64_t gran = be->granularity(h);
  in->segment_bytes = SKV_ALIGN_UP(in->data_offset + in->data_bytes, gran);
  in->stride = in->segment_bytes;
  rc = be->create(h);
  /* All or nothing: a PE whose backend failed (out of GPU memory, a mapping refused...) fails
   * the create on every PE with its message, and the others release what they made, instead of
   * going on with a heap that one PE lacks (and waiting for it until the timeout). */
  int agreed = skv__heap_agree(h, "made", rc);
  if (agreed < 0) {
    if (rc == 0) {
      char saved[1024];
      snprintf(saved, sizeof saved, "%s", skv_last_error());
      (void)be->destroy(h);
      skv__error_restore(saved);
    }
    skv__coll_forget(&h->op); /* the failed create's keys go after the next collective check */
    free(h);
    return agreed;
  }
  /* Every PE has contributed to "made", so has read our keys of the steps before it ("dev",
   * "prep"); the "made" key stays until skv_heap_destroy (docs/bootstrap.md, "Key lifetime"). */
  skv__coll_settle(&h->op);
  char b1[32], b2[32];
  SKV_INFO(SKV_SUBSYS_HEAP,
           "heap %s: backend %s, %d PEs, segment %s (data %s at +%" PRIu64
           "), base %p stride %" PRIu64,
           h->name, be->name, in->npes, skv__fmt_bytes(in->segment_bytes, b1, sizeof b1),
           skv__fmt_bytes(in->data_bytes, b2, sizeof b2), in->data_offset, in->base, in->stride);
  *out = h;
  return 0;
}

void *skv_heap_get_ptr(const skv_heap_t *heap, int pe, uint64_t offset) {
  if (!heap) {
    SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_HEAP, "skv_heap_get_ptr: heap is NULL");
    return NULL;
  }
  if (pe < 0 || pe >= heap->info.npes) {
    SKV_FAIL(SKV_ERANGE, SKV_SUBSYS_HEAP, "skv_heap_get_ptr: PE %d is not in 0..%d", pe,
             heap->info.npes - 1);
    return NULL;
  }
  if (offset >= heap->info.segment_bytes) {
    SKV_FAIL(SKV_ERANGE, SKV_SUBSYS_HEAP,
             "skv_heap_get_ptr: offset %" PRIu64 " is beyond the %" PRIu64 "-byte segment", offset,
             heap->info.segment_bytes);
    return NULL;
  }
  return skv__heap_addr(heap, pe, offset);
}

int skv_heap_get_info(const skv_heap_t *heap, skv_heap_info_t *info) {
  SKV_ARG_CHECK(heap && info, SKV_SUBSYS_HEAP, "skv_heap_get_info: heap and info must be non-NULL");
  SKV_ARG_CHECK(info->size >= sizeof *info, SKV_SUBSYS_HEAP,
                "skv_heap_get_info: info.size=%zu, this library writes %zu bytes: initialise the "
                "struct with SKV_HEAP_INFO_INIT",
                info->size, sizeof *info);
  const size_t size = info->size;
  *info = heap->info;
  info->size = size;
  return 0;
}

int skv_heap_destroy(skv_heap_t *heap) {
  if (!heap) return 0;
  /* Collective so that no PE unmaps while a peer may still be reading its segment through
   * a kernel; bounded by the timeout, and the memory is released even when it fails. */
  int rc = skv__coll_check(heap->ctx, NULL, "skv_heap_destroy(%s)", heap->name);
  /* The heap's keys ("made", and those of steps taken on it: kv-ready, the NCCL set-up): every
   * PE has read them once it passed the check. */
  if (rc == 0)
    skv__coll_end(&heap->op);
  else
    skv__coll_forget(&heap->op);
  int rc2 = heap->be->destroy(heap);
  SKV_INFO(SKV_SUBSYS_HEAP, "heap %s destroyed%s", heap->name,
           rc ? " (peers did not all arrive)" : "");
  free(heap);
  return rc ? rc : rc2;
}
