/* CUDA heap backends. `cuda`: each PE's segment is device memory from cuMemCreate, exported as
 * a POSIX fd, passed to the local peers, and mapped with every peer's segment into one reserved
 * virtual range at base + pe * stride. `cuda_host`: the host backend's memfd segments,
 * registered with the PE's GPU so that kernels read them at the same addresses. */
#define _GNU_SOURCE
#include "cuda/vmm.h"
#include "heap/heap.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

typedef struct cuda_impl {
  CUdeviceptr base;
  size_t reserved;
  size_t seg;
  CUmemGenericAllocationHandle *handles; /* [npes], 0 when not held */
  uint8_t *mapped;                       /* [npes]: segment mapped at base + pe * seg */
} cuda_impl_t;

static uint64_t cuda_granularity(skv_heap_t *heap) {
  /* Called after create's checks: failures here fall back to 2 MiB and surface in create. */
  if (skv__cuda_use(heap->ctx) != 0) return 2ull << 20;
  return skv__vmm_granularity(heap->ctx->device);
}

static void cuda_release(cuda_impl_t *im, int npes) {
  if (im->base) {
    /* One unmap per mapping: cuMemUnmap takes whole mapped ranges, and after a failed create
     * only some segments are mapped. */
    for (int i = 0; i < npes && im->mapped; i++)
      if (im->mapped[i]) skv__cu.cuMemUnmap(im->base + (CUdeviceptr)i * im->seg, im->seg);
    skv__cu.cuMemAddressFree(im->base, im->reserved);
  }
  for (int i = 0; i < npes && im->handles; i++)
    if (im->handles[i]) skv__cu.cuMemRelease(im->handles[i]);
  free(im->handles);
  free(im->mapped);
  free(im);
}

/* Map PE i's segment into the range and give this PE's GPU access to it. */
static int map_segment(cuda_impl_t *im, int i, int dev) {
  SKV_CHECK(skv__vmm_map(im->base + (CUdeviceptr)i * im->seg, im->seg, im->handles[i], dev));
  im->mapped[i] = 1;
  return 0;
}

/* Each PE's GPU by PCI address (device ordinals differ between processes that see different
 * CUDA_VISIBLE_DEVICES); ok = 0 when the PE has no usable GPU. */
typedef struct dev_rec {
  int32_t ok;
  int32_t pci[3]; /* domain, bus, device */
} dev_rec_t;

/* Every PE contributes its GPU, also one that failed to set its GPU up (ok = 0), so that the
 * gathering never waits for a PE that has failed; one that cannot gather (out of memory) still
 * contributes, and its failure goes through the "prep" agreement. */
static int gather_devices(skv_heap_t *heap, int dev, dev_rec_t *devs) {
  skv_ctx_t *ctx = heap->ctx;
  dev_rec_t mine = {0, {0, 0, 0}};
  if (dev >= 0 &&
      cudaDeviceGetAttribute(&mine.pci[0], cudaDevAttrPciDomainId, dev) == cudaSuccess &&
      cudaDeviceGetAttribute(&mine.pci[1], cudaDevAttrPciBusId, dev) == cudaSuccess &&
      cudaDeviceGetAttribute(&mine.pci[2], cudaDevAttrPciDeviceId, dev) == cudaSuccess)
    mine.ok = 1;
  (void)cudaGetLastError();
  dev_rec_t *all = calloc((size_t)ctx->cfg.world_size, sizeof *all);
  if (!all) {
    (void)skv__coll_contribute(&heap->op, "dev", &mine, sizeof mine);
    return SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_HEAP, "out of memory");
  }
  int rc = skv__coll_allgather(&heap->op, "dev", &mine, all, sizeof mine);
  for (int i = 0; rc == 0 && i < heap->info.npes; i++) devs[i] = all[ctx->local_ranks[i]];
  free(all);
  return rc;
}

/* Every PE must be able to reach every other PE's GPU (NVLink or PCIe peer access). A peer GPU
 * that this process cannot see (CUDA_VISIBLE_DEVICES) cannot be asked about: mapping its
 * segment then says whether it works. */
static int check_peer_access(skv_heap_t *heap, const dev_rec_t *devs) {
  int me = heap->ctx->device, mine = heap->info.my_pe;
  for (int i = 0; i < heap->info.npes; i++) {
    if (i != mine && devs[i].ok && memcmp(devs[i].pci, devs[mine].pci, sizeof devs[i].pci) == 0) {
      if (heap->gpu_shared_with < 0) heap->gpu_shared_with = i;
      heap->gpu_sharers++;
      heap->gpu_same_pes |= 1ull << i;
    }
    if (i == mine || !devs[i].ok || memcmp(devs[i].pci, devs[mine].pci, sizeof devs[i].pci) == 0)
      continue;
    char bus[32];
    snprintf(bus, sizeof bus, "%04x:%02x:%02x.0", (unsigned)devs[i].pci[0],
             (unsigned)devs[i].pci[1], (unsigned)devs[i].pci[2]);
    int peer = -1, can = 0;
    if (cudaDeviceGetByPCIBusId(&peer, bus) != cudaSuccess) {
      (void)cudaGetLastError();
      continue;
    }
    SKV_CUDA_CHECK(cudaDeviceCanAccessPeer(&can, me, peer), SKV_SUBSYS_HEAP);
    if (!can)
      return SKV_FAIL(
          SKV_ENOTSUP, SKV_SUBSYS_HEAP,
          "GPU %d cannot access GPU %d (%s, PE %d) as a peer: the cuda backend needs NVLink "
          "or PCIe peer access between all local GPUs; use SKV_BACKEND_CUDA_HOST instead",
          me, peer, bus, i);
  }
  return 0;
}

/* This PE's part before the exchange: its segment allocated, mapped, zeroed and exported. */
static int prepare_segment(skv_heap_t *heap, cuda_impl_t *im, int *my_fd) {
  int me = heap->info.my_pe, dev = heap->ctx->device, rc = 0;
  SKV_CHECK(skv__vmm_check_export(dev));
  CUmemAllocationProp prop = skv__vmm_prop(dev);
  size_t seg = heap->info.segment_bytes;
  SKV_CU_CHECK_GOTO(skv__cu.cuMemCreate(&im->handles[me], seg, &prop, 0), SKV_SUBSYS_HEAP, rc, out);
  im->seg = seg;
  im->reserved = seg * (size_t)heap->info.npes;
  SKV_CU_CHECK_GOTO(skv__cu.cuMemAddressReserve(&im->base, im->reserved, 0, 0, 0), SKV_SUBSYS_HEAP,
                    rc, out);
  /* Fresh segments read as zero, like the host backend's. Zero ours before handing it out: a
   * peer may write into it as soon as its create returns, which can be before ours does. */
  SKV_CHECK_GOTO(map_segment(im, me, dev), rc, out);
  SKV_CUDA_CHECK_GOTO(cudaMemset((void *)(im->base + (CUdeviceptr)me * seg), 0, seg),
                      SKV_SUBSYS_HEAP, rc, out);
  SKV_CUDA_CHECK_GOTO(cudaDeviceSynchronize(), SKV_SUBSYS_HEAP, rc, out);
  SKV_CU_CHECK_GOTO(skv__cu.cuMemExportToShareableHandle(
                        my_fd, im->handles[me], CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
                    SKV_SUBSYS_HEAP, rc, out);
out:
  return rc;
}

static int cuda_create(skv_heap_t *heap) {
  skv_ctx_t *ctx = heap->ctx;
  int n = heap->info.npes, me = heap->info.my_pe;
  int rc = skv__cuda_use(ctx);
  const int dev = rc == 0 ? ctx->device : -1;
  heap->info.device = dev;
  dev_rec_t devs[SKV_MAX_LOCAL_PES];
  int g = gather_devices(heap, dev, devs);
  if (g < 0 && skv__is_bootstrap_failure(g)) return g;
  if (rc == 0) rc = g;
  if (rc == 0) rc = check_peer_access(heap, devs);
  int my_fd = -1;
  int *fds = malloc(sizeof(int) * (size_t)n);
  cuda_impl_t *im = calloc(1, sizeof *im);
  if (!im || !fds || !(im->handles = calloc((size_t)n, sizeof *im->handles)) ||
      !(im->mapped = calloc((size_t)n, 1))) {
    if (rc == 0) rc = SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_HEAP, "out of memory");
  } else if (rc == 0) {
    rc = prepare_segment(heap, im, &my_fd);
  }
  for (int i = 0; fds && i < n; i++) fds[i] = -1;
  /* No PE goes into the exchange unless every PE has its segment ready to hand out. */
  SKV_CHECK_GOTO(skv__heap_agree(heap, "prep", rc), rc, fail);
  SKV_CHECK_GOTO(skv__fd_exchange(ctx->store, heap->name, ctx->local_ranks, n, me, my_fd, fds,
                                  ctx->cfg.timeout_ms),
                 rc, fail);
  for (int i = 0; i < n; i++) {
    if (i == me) continue;
    SKV_CU_CHECK_GOTO(
        skv__cu.cuMemImportFromShareableHandle(&im->handles[i], (void *)(uintptr_t)fds[i],
                                               CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
        SKV_SUBSYS_HEAP, rc, fail);
    SKV_CHECK_GOTO(map_segment(im, i, dev), rc, fail);
  }
  heap->info.base = (void *)im->base;
  heap->info.stride = im->seg;
  heap->impl = im;
  im = NULL;
fail:
  for (int i = 0; fds && i < n; i++)
    if (fds[i] >= 0) close(fds[i]);
  if (my_fd >= 0) close(my_fd);
  free(fds);
  if (im) cuda_release(im, n);
  return rc;
}

static int cuda_destroy(skv_heap_t *heap) {
  cuda_impl_t *im = heap->impl;
  if (!im) return 0;
  int rc = 0;
  if (skv__cuda_use(heap->ctx) == 0 && cudaDeviceSynchronize() != cudaSuccess) {
    (void)cudaGetLastError();
    rc = SKV_FAIL(SKV_ECUDA, SKV_SUBSYS_HEAP,
                  "a kernel using the heap failed before it was destroyed");
  }
  cuda_release(im, heap->info.npes);
  heap->impl = NULL;
  return rc;
}

const skv__heap_backend_t skv__heap_cuda = {
    .name = "cuda",
    .granularity = cuda_granularity,
    .create = cuda_create,
    .destroy = cuda_destroy,
};

/* ---- cuda_host: host memfd segments registered with the GPU ----------------------------- */

extern const skv__heap_backend_t skv__heap_host;

static int cuda_host_create(skv_heap_t *heap) {
  int rc = skv__cuda_use(heap->ctx);
  heap->info.device = rc == 0 ? heap->ctx->device : -1;
  SKV_CHECK(skv__heap_host_create(heap, rc));
  size_t total = (size_t)heap->info.stride * (size_t)heap->info.npes;
  cudaError_t e =
      cudaHostRegister(heap->info.base, total, cudaHostRegisterPortable | cudaHostRegisterMapped);
  void *dptr = NULL;
  const bool registered = e == cudaSuccess;
  if (e == cudaSuccess) e = cudaHostGetDevicePointer(&dptr, heap->info.base, 0);
  if (e != cudaSuccess || dptr != heap->info.base) {
    (void)cudaGetLastError();
    if (registered) cudaHostUnregister(heap->info.base);
    skv__heap_host.destroy(heap);
    if (e != cudaSuccess)
      return SKV_FAIL(SKV_ECUDA, SKV_SUBSYS_HEAP,
                      "registering the host heap with GPU %d failed: %s", heap->ctx->device,
                      cudaGetErrorString(e));
    return SKV_FAIL(
        SKV_ENOTSUP, SKV_SUBSYS_HEAP,
        "GPU %d maps registered host memory at another address; the cuda_host backend needs "
        "the same addresses on host and device",
        heap->ctx->device);
  }
  return 0;
}

static int cuda_host_destroy(skv_heap_t *heap) {
  int rc = 0;
  if (heap->impl && skv__cuda_use(heap->ctx) == 0) {
    if (cudaDeviceSynchronize() != cudaSuccess ||
        cudaHostUnregister(heap->info.base) != cudaSuccess) {
      (void)cudaGetLastError();
      rc = SKV_FAIL(SKV_ECUDA, SKV_SUBSYS_HEAP, "unregistering the host heap failed");
    }
  }
  int r2 = skv__heap_host.destroy(heap);
  return rc ? rc : r2;
}

static uint64_t cuda_host_granularity(skv_heap_t *heap) {
  return skv__heap_host.granularity(heap);
}

const skv__heap_backend_t skv__heap_cuda_host = {
    .name = "cuda_host",
    .granularity = cuda_host_granularity,
    .create = cuda_host_create,
    .destroy = cuda_host_destroy,
};
