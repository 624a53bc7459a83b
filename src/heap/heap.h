/* Internal view of a symmetric heap: layout, the backend that maps the segments, and the
 * hooks the CUDA backend plugs in. Every PE's segment is mapped at base + pe * stride. */
#ifndef SKV_HEAP_H
#define SKV_HEAP_H

#include "bootstrap/ctx.h"
#include "core/core.h"

typedef struct skv__heap_backend skv__heap_backend_t;

struct skv_heap {
  skv_ctx_t *ctx;
  const skv__heap_backend_t *be;
  skv_heap_info_t info; /* layout, base, stride, npes, my_pe */
  skv__coll_op_t op;    /* its collective operation: the store keys of create and of the steps
                           taken on the heap later, deleted by skv_heap_destroy */
  char name[SKV_COLL_NAME_CAP]; /* unique: op's name (store keys, fd exchange tag) */
  void *impl;                   /* backend state */
  int gpu_shared_with;          /* cuda: a local PE whose GPU is this PE's too, else -1 */
  int gpu_sharers;              /* cuda: PEs on this PE's GPU, itself included (1: alone) */
  uint64_t gpu_same_pes;        /* cuda: bit i when local PE i (not this one) uses this GPU */
};

struct skv__heap_backend {
  const char *name;
  /* Alignment of segments and of the stride. */
  uint64_t (*granularity)(skv_heap_t *heap);
  /* Allocate this PE's segment, exchange handles with the local PEs and map every segment at
   * info.base + pe * info.stride (sets info.base and impl). Called by every PE together; passes
   * the result of its local preparation through skv__heap_agree(heap, "prep", rc) before the
   * handle exchange, so that no PE waits in the exchange for one that has already failed. (The
   * front end agrees on the result of create itself.) */
  int (*create)(skv_heap_t *heap);
  /* Unmap and release everything; tolerate peers that died. */
  int (*destroy)(skv_heap_t *heap);
};

extern const skv__heap_backend_t skv__heap_host;
#ifdef SKV_WITH_CUDA
extern const skv__heap_backend_t skv__heap_cuda;
extern const skv__heap_backend_t skv__heap_cuda_host;
#endif

const char *skv__backend_name(int backend);

/* The host backend's create after a step of the caller's that gave `rc` (cuda_host: setting the
 * GPU up): a failure there goes through the "prep" agreement like one of the host backend's. */
int skv__heap_host_create(skv_heap_t *heap, int rc);

/* Host segments (memfds) lie in one reserved range, each on 2 MiB boundaries when its size is a
 * multiple of 2 MiB, so that transparent huge pages can back it where the node lets shared memory
 * have them (/sys/kernel/mm/transparent_hugepage/shmem_enabled "advise" or "always"): a copy
 * of random 4 KiB parts then costs no TLB miss per part. skv__host_reserve reserves `bytes` of
 * address space (PROT_NONE) on a 2 MiB boundary; skv__host_advise_huge asks for huge pages on
 * a segment just mapped (a hint: nothing fails without them). */
void *skv__host_reserve(size_t bytes);
void skv__host_advise_huge(void *at, size_t bytes);
/* The node's setting for shared memory's huge pages: the selected value of shmem_enabled
 * ("never", "advise", "always", ...) copied into buf, "unknown" when it cannot be read; true when
 * it gives advised mappings huge pages. */
bool skv__host_shmem_thp(char *buf, size_t cap);

/* All-or-nothing step `step` of skv_heap_create (skv__coll_agree in the heap's operation, keys
 * "<heap name>/<step>/<rank>"): 0 when every PE's rc was 0, else this PE's failure or the first
 * failing rank's. */
int skv__heap_agree(skv_heap_t *heap, const char *step, int rc);

/* Address of byte `off` of PE `pe` without checks (hot paths that checked already). */
static inline void *skv__heap_addr(const skv_heap_t *h, int pe, uint64_t off) {
  return (char *)h->info.base + (uint64_t)pe * h->info.stride + off;
}

#endif
