/* Slots' segments in this process: the reserved range (host or device), an owner's own segment,
 * mapping a slot the first time it is read and dropping mappings of slots that are gone. */
#define _GNU_SOURCE
#include "domain/domain_int.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#ifdef SKV_WITH_CUDA
#include "cuda/vmm.h"
#endif

static bool is_cuda(const skv__domain_t *d) {
  return d->hdr->backend == SKV_BACKEND_CUDA;
}

static char *slot_addr(const skv__domain_t *d, int s) {
  return (char *)d->heap.info.base + (uint64_t)s * d->heap.info.stride;
}

int skv__dom_reserve(skv__domain_t *d) {
  const skv__dom_hdr_t *h = d->hdr;
  skv_heap_info_t *in = &d->heap.info;
  memset(&d->heap, 0, sizeof d->heap);
  in->size = sizeof *in;
  in->backend = h->backend;
  in->npes = (int32_t)h->max_slots;
  in->my_pe = d->slot;
  in->device = -1;
  in->stride = h->slot_bytes;
  in->segment_bytes = h->slot_bytes;
  in->data_offset = 0;
  in->data_bytes = h->pages_per_slot * h->page_stride;
  d->heap.ctx = d->ctx;
  snprintf(d->heap.name, sizeof d->heap.name, "domain/%s", d->name);
  const size_t total = (size_t)h->slot_bytes * h->max_slots;
  if (h->backend == SKV_BACKEND_HOST) {
    void *r = skv__host_reserve(total); /* slots on 2 MiB boundaries (heap.h) */
    if (!r) {
      char b[32];
      return SKV_FAIL(-errno, SKV_SUBSYS_KV, "reserving %s of address space failed: %s",
                      skv__fmt_bytes(total, b, sizeof b), strerror(errno));
    }
    d->reserved = r;
    in->base = r;
    return 0;
  }
#ifdef SKV_WITH_CUDA
  if (h->backend == SKV_BACKEND_CUDA) {
    int rc = skv__cuda_use(d->ctx);
    if (rc < 0 && d->role == SKV_ROLE_READER) {
      /* a reader without a GPU: lookups work, fetches of GPU pages say why they cannot */
      SKV_INFO(SKV_SUBSYS_KV,
               "domain '%s': this reader has no usable GPU: it can look pages up, not fetch them",
               d->name);
      skv_clear_error();
      return 0;
    }
    SKV_CHECK(rc);
    in->device = d->ctx->device;
    CUdeviceptr base = 0;
    int r2 = 0;
    SKV_CU_CHECK_GOTO(skv__cu.cuMemAddressReserve(&base, total, SKV__DOM_SLOT_ALIGN, 0, 0),
                      SKV_SUBSYS_KV, r2, out);
    d->cuda_base = base;
    in->base = (void *)(uintptr_t)base;
  out:
    return r2;
  }
#endif
  return SKV_FAIL(SKV_ENOTSUP, SKV_SUBSYS_KV,
                  "domain '%s': pages in %s memory are not supported by elastic domains%s", d->name,
                  skv__backend_name(h->backend),
                  h->backend == SKV_BACKEND_CUDA ? " in a build without CUDA" : " (host or cuda)");
}

static void set_mapped(skv__domain_t *d, int s, uint64_t epoch) {
  d->mapped[s] = epoch;
  __atomic_fetch_or(&d->slots[s].mapped_by, 1ull << d->slot, __ATOMIC_SEQ_CST);
}

int skv__dom_own_segment(skv__domain_t *d) {
  const uint64_t bytes = d->hdr->slot_bytes;
  char *at = slot_addr(d, d->slot);
  if (!is_cuda(d)) {
    char name[96];
    snprintf(name, sizeof name, "symkv-dom-%s-%d", d->name, d->slot);
    int fd = memfd_create(name, MFD_CLOEXEC);
    if (fd < 0) return SKV_FAIL(-errno, SKV_SUBSYS_KV, "memfd_create failed: %s", strerror(errno));
    if (ftruncate(fd, (off_t)bytes) != 0 ||
        mmap(at, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0) == MAP_FAILED) {
      int e = errno;
      close(fd);
      char b[32];
      return SKV_FAIL(-e, SKV_SUBSYS_KV, "making this owner's %s segment failed: %s",
                      skv__fmt_bytes(bytes, b, sizeof b), strerror(e));
    }
    skv__host_advise_huge(at, bytes);
    d->seg_fd = fd;
    set_mapped(d, d->slot, d->epoch);
    return 0;
  }
#ifdef SKV_WITH_CUDA
  int rc = 0, dev = d->ctx->device;
  SKV_CHECK(skv__vmm_check_export(dev));
  CUmemAllocationProp prop = skv__vmm_prop(dev);
  CUmemGenericAllocationHandle hnd = 0;
  SKV_CU_CHECK_GOTO(skv__cu.cuMemCreate(&hnd, bytes, &prop, 0), SKV_SUBSYS_KV, rc, fail);
  d->own_handle = hnd;
  SKV_CHECK_GOTO(skv__vmm_map((CUdeviceptr)(uintptr_t)at, bytes, hnd, dev), rc, fail);
  set_mapped(d, d->slot, d->epoch);
  SKV_CU_CHECK_GOTO(skv__cu.cuMemExportToShareableHandle(
                        &d->seg_fd, hnd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
                    SKV_SUBSYS_KV, rc, fail);
  return 0;
fail:
  return rc;
#else
  return SKV_FAIL(SKV_ENOTSUP, SKV_SUBSYS_KV, "GPU pages need a build with CUDA");
#endif
}

void skv__dom_release_own(skv__domain_t *d) {
  if (d->seg_fd >= 0) close(d->seg_fd);
  d->seg_fd = -1;
#ifdef SKV_WITH_CUDA
  if (d->own_handle) skv__cu.cuMemRelease((CUmemGenericAllocationHandle)d->own_handle);
#endif
  d->own_handle = 0;
}

static void unmap_one(skv__domain_t *d, int s) {
  const uint64_t bytes = d->hdr->slot_bytes;
  char *at = slot_addr(d, s);
  if (!is_cuda(d)) {
    /* back to reserved address space, never a hole another mapping could land in */
    (void)mmap(at, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1,
               0);
  } else {
#ifdef SKV_WITH_CUDA
    skv__cu.cuMemUnmap((CUdeviceptr)(uintptr_t)at, bytes);
#endif
  }
  d->mapped[s] = 0;
  __atomic_fetch_and(&d->slots[s].mapped_by, ~(1ull << d->slot), __ATOMIC_SEQ_CST);
}

void skv__dom_unmap_all(skv__domain_t *d) {
  if (!d->hdr || d->slot < 0) return;
  if (is_cuda(d) && d->cuda_base) {
#ifdef SKV_WITH_CUDA
    if (skv__cuda_use(d->ctx) == 0 && cudaDeviceSynchronize() != cudaSuccess)
      (void)cudaGetLastError();
#endif
  }
  for (uint32_t s = 0; s < d->max_slots; s++)
    if (d->mapped[s]) unmap_one(d, (int)s);
  const size_t total = (size_t)d->hdr->slot_bytes * d->max_slots;
  if (d->reserved) munmap(d->reserved, total);
  d->reserved = NULL;
#ifdef SKV_WITH_CUDA
  if (d->cuda_base) skv__cu.cuMemAddressFree((CUdeviceptr)d->cuda_base, total);
#endif
  d->cuda_base = 0;
  d->heap.info.base = NULL;
}

/* Map slot s's current incarnation (write lock held). Our bit in its mapped_by goes first: from
 * then on the slot keeps this incarnation (no one reuses a slot a live participant maps), so
 * every page of it that we pin afterwards lies in the memory we map. */
static int map_one(skv__domain_t *d, int s) {
  skv__dom_slot_t *rec = &d->slots[s];
  __atomic_fetch_or(&rec->mapped_by, 1ull << d->slot, __ATOMIC_SEQ_CST);
  uint64_t epoch = __atomic_load_n(&rec->epoch, __ATOMIC_ACQUIRE);
  int fd = -1, rc = 0;
  if (__atomic_load_n(&rec->state, __ATOMIC_ACQUIRE) != SKV__DOM_ACTIVE ||
      !skv__domain_alive(d, s)) {
    rc = SKV_FAIL(SKV_ESTALE, SKV_SUBSYS_KV,
                  "domain '%s': slot %d has no live owner now: its pages are stale; look the "
                  "keys up again",
                  d->name, s);
    goto fail;
  }
  SKV_CHECK_GOTO(skv__dom_handoff_get(d, s, epoch, &fd), rc, fail);
  const uint64_t bytes = d->hdr->slot_bytes;
  char *at = slot_addr(d, s);
  if (!is_cuda(d)) {
    if (mmap(at, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0) == MAP_FAILED) {
      rc = SKV_FAIL(-errno, SKV_SUBSYS_KV, "mapping slot %d's segment failed: %s", s,
                    strerror(errno));
      goto fail;
    }
    skv__host_advise_huge(at, bytes);
  } else {
#ifdef SKV_WITH_CUDA
    if (!d->cuda_base) {
      rc = SKV_FAIL(SKV_ENOTSUP, SKV_SUBSYS_KV,
                    "domain '%s': its pages are in GPU memory and this reader has no usable "
                    "GPU: it can look pages up but not fetch them",
                    d->name);
      goto fail;
    }
    CUmemGenericAllocationHandle h = 0;
    SKV_CU_CHECK_GOTO(skv__cu.cuMemImportFromShareableHandle(
                          &h, (void *)(uintptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
                      SKV_SUBSYS_KV, rc, fail);
    rc = skv__vmm_map((CUdeviceptr)(uintptr_t)at, bytes, h, d->ctx->device);
    skv__cu.cuMemRelease(h); /* the mapping holds the memory now */
    if (rc < 0) goto fail;
#endif
  }
  close(fd);
  d->mapped[s] = epoch;
  return 0;
fail:
  if (fd >= 0) close(fd);
  __atomic_fetch_and(&rec->mapped_by, ~(1ull << d->slot), __ATOMIC_SEQ_CST);
  return rc;
}

/* Mappings of slots whose owner left or died go (write lock held), so that the slot can serve
 * a new owner; our pins on them go with them (their pages are stale already). */
static void drop_gone(skv__domain_t *d, void (*quiesce)(void *), void *arg) {
  bool quiet = false;
  for (uint32_t s = 0; s < d->max_slots; s++) {
    if (!d->mapped[s] || (int)s == d->slot) continue;
    skv__dom_slot_t *rec = &d->slots[s];
    if (__atomic_load_n(&rec->state, __ATOMIC_ACQUIRE) == SKV__DOM_ACTIVE &&
        __atomic_load_n(&rec->epoch, __ATOMIC_ACQUIRE) == d->mapped[s] &&
        skv__domain_alive(d, (int)s))
      continue;
    if (!quiet && quiesce) quiesce(arg); /* none of our copies reads it any more */
    quiet = true;
    skv__pool_forget_pe(d->pool, (int)s);
    unmap_one(d, (int)s);
    SKV_INFO(SKV_SUBSYS_KV, "domain '%s': slot %u's owner is gone; its segment is unmapped here",
             d->name, s);
  }
}

int skv__domain_map_begin(skv__domain_t *d, const uint32_t *pe, size_t step, size_t n,
                          void (*quiesce)(void *arg), void *arg) {
  for (int round = 0;; round++) {
    pthread_rwlock_rdlock(&d->map_rw);
    bool all = __atomic_load_n(&d->hdr->gen, __ATOMIC_ACQUIRE) == d->seen_gen;
    for (size_t i = 0; all && i < n; i++) all = d->mapped[pe[i * step]] != 0;
    if (all) return 0; /* held until skv__domain_map_end */
    pthread_rwlock_unlock(&d->map_rw);
    if (round == 2)
      return SKV_FAIL(SKV_ESTALE, SKV_SUBSYS_KV,
                      "domain '%s': the owners of these pages keep changing; look the keys up "
                      "again",
                      d->name);
    pthread_rwlock_wrlock(&d->map_rw);
    int rc = 0;
    uint64_t gen = __atomic_load_n(&d->hdr->gen, __ATOMIC_ACQUIRE);
    if (gen != d->seen_gen) drop_gone(d, quiesce, arg);
    __atomic_store_n(&d->seen_gen, gen, __ATOMIC_RELAXED);
    for (size_t i = 0; rc == 0 && i < n; i++) {
      uint32_t s = pe[i * step];
      if (!d->mapped[s]) rc = map_one(d, (int)s);
    }
    pthread_rwlock_unlock(&d->map_rw);
    if (rc < 0) return rc;
  }
}

void skv__domain_tidy(skv__domain_t *d, void (*quiesce)(void *arg), void *arg) {
  if (__atomic_load_n(&d->hdr->gen, __ATOMIC_ACQUIRE) ==
      __atomic_load_n(&d->seen_gen, __ATOMIC_RELAXED))
    return;
  pthread_rwlock_wrlock(&d->map_rw);
  uint64_t gen = __atomic_load_n(&d->hdr->gen, __ATOMIC_ACQUIRE);
  if (gen != d->seen_gen) drop_gone(d, quiesce, arg);
  __atomic_store_n(&d->seen_gen, gen, __ATOMIC_RELAXED);
  pthread_rwlock_unlock(&d->map_rw);
}

void skv__domain_map_end(skv__domain_t *d) {
  pthread_rwlock_unlock(&d->map_rw);
}
