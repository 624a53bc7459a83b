/* symkv device API for users' own CUDA kernels: peer addresses, puts, signals, waits with a
 * timeout, and block- and grid-level barriers across PEs. Header-only (CUDA C++, sm_70+). */
#ifndef SYMKV_DEVICE_CUH
#define SYMKV_DEVICE_CUH

#include "symkv.h"

#include <stddef.h>
#include <stdint.h>

/* What a kernel needs to reach every PE's signal pad and heap: fill it on the host with
 * skv_dev_comm_init() and pass it to the kernel by value. Slots are the comm's user signal
 * slots (0 .. nslots-1), the same ones skv_comm_signal() and skv_comm_wait() use. */
typedef struct skv_dev_comm {
  char *base; /* PE 0's segment; PE p's is at base + p * stride */
  uint64_t stride;
  uint64_t signal_offset; /* offset of slot 0 in a segment */
  uint32_t nslots;
  int32_t my_pe;
  int32_t npes;
  uint32_t reserved;
  uint64_t timeout_ns; /* bound of every wait */
} skv_dev_comm_t;

/* Host side: describe `comm` for kernels; timeout_ms <= 0 means 60 s. */
static inline int skv_dev_comm_init(const skv_comm_t *comm, int timeout_ms, skv_dev_comm_t *dc) {
  skv_heap_info_t in;
  int rc = skv_heap_get_info(skv_comm_get_heap(comm), &in);
  if (rc != 0) return rc;
  int slots = skv_comm_get_signal_slots(comm);
  if (slots < 0) return slots;
  dc->base = (char *)in.base;
  dc->stride = in.stride;
  dc->signal_offset = in.signal_offset;
  dc->nslots = (uint32_t)slots;
  dc->my_pe = in.my_pe;
  dc->npes = in.npes;
  dc->reserved = 0;
  dc->timeout_ns = (uint64_t)(timeout_ms > 0 ? timeout_ms : 60000) * 1000000ull;
  return 0;
}

#if defined(__CUDACC__)

#define SKV_DEV static __device__ __forceinline__

/* ---- ordering primitives (system scope: peers are other GPUs) ----------------------------- */

SKV_DEV uint64_t skv_dev_globaltimer(void) {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
/* Orders this thread's earlier memory operations (and those it observed) before its later ones
 * for every GPU and the CPU. */
SKV_DEV void skv_dev_fence(void) {
  asm volatile("fence.acq_rel.sys;" ::: "memory");
}
SKV_DEV uint64_t skv_dev_load_acquire(const uint64_t *p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
SKV_DEV void skv_dev_store_release(uint64_t *p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
SKV_DEV void skv_dev_add_release(uint64_t *p, uint64_t v) {
  asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

/* ---- addresses ---------------------------------------------------------------------------- */

/* The address on PE `pe` of `local`, an address inside this PE's segment (symmetric heap). */
template <typename T> SKV_DEV T *skv_dev_peer_ptr(const skv_dev_comm_t &c, T *local, int pe) {
  return (T *)((char *)local + ((int64_t)pe - (int64_t)c.my_pe) * (int64_t)c.stride);
}
SKV_DEV uint64_t *skv_dev_signal_ptr(const skv_dev_comm_t &c, int pe, uint32_t slot) {
  return (uint64_t *)(c.base + (uint64_t)pe * c.stride + c.signal_offset + (uint64_t)slot * 8u);
}

/* ---- puts --------------------------------------------------------------------------------- */

/* Copy `bytes` from `src` (any device-readable memory) to `dst_local`'s counterpart on PE pe,
 * using the calling threads `rank` of `nthreads` (16-byte stores where both are aligned). */
SKV_DEV void skv_dev__copy(char *dst, const char *src, size_t bytes, unsigned rank,
                           unsigned nthreads) {
  if ((((uintptr_t)dst | (uintptr_t)src) & 15u) == 0) {
    size_t nv = bytes / 16;
    for (size_t i = rank; i < nv; i += nthreads) ((uint4 *)dst)[i] = ((const uint4 *)src)[i];
    for (size_t i = nv * 16 + rank; i < bytes; i += nthreads) dst[i] = src[i];
  } else {
    for (size_t i = rank; i < bytes; i += nthreads) dst[i] = src[i];
  }
}
SKV_DEV unsigned skv_dev__block_rank(void) {
  return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
}
SKV_DEV unsigned skv_dev__block_size(void) {
  return blockDim.x * blockDim.y * blockDim.z;
}

/* One thread. */
SKV_DEV void skv_dev_put(const skv_dev_comm_t &c, int pe, void *dst_local, const void *src,
                         size_t bytes) {
  skv_dev__copy(skv_dev_peer_ptr(c, (char *)dst_local, pe), (const char *)src, bytes, 0, 1);
}
/* Every thread of the block calls it with the same arguments. */
SKV_DEV void skv_dev_put_block(const skv_dev_comm_t &c, int pe, void *dst_local, const void *src,
                               size_t bytes) {
  skv_dev__copy(skv_dev_peer_ptr(c, (char *)dst_local, pe), (const char *)src, bytes,
                skv_dev__block_rank(), skv_dev__block_size());
}

/* ---- signals ------------------------------------------------------------------------------ */

/* Set / add `value` to slot `slot` of PE pe, with release semantics: this thread's earlier
 * writes (to any PE) are visible to whoever observes the signal. */
SKV_DEV void skv_dev_signal_set(const skv_dev_comm_t &c, int pe, uint32_t slot, uint64_t value) {
  skv_dev_store_release(skv_dev_signal_ptr(c, pe, slot), value);
}
SKV_DEV void skv_dev_signal_add(const skv_dev_comm_t &c, int pe, uint32_t slot, uint64_t value) {
  skv_dev_add_release(skv_dev_signal_ptr(c, pe, slot), value);
}
/* Block-wide put, then one signal (op SKV_SIGNAL_SET or SKV_SIGNAL_ADD) once every thread's
 * part of the data is visible on PE pe. Every thread of the block calls it. */
SKV_DEV void skv_dev_put_signal_block(const skv_dev_comm_t &c, int pe, void *dst_local,
                                      const void *src, size_t bytes, uint32_t slot, uint64_t value,
                                      int op) {
  skv_dev_put_block(c, pe, dst_local, src, bytes);
  __syncthreads();
  if (skv_dev__block_rank() == 0) {
    skv_dev_fence();
    if (op == SKV_SIGNAL_ADD)
      skv_dev_signal_add(c, pe, slot, value);
    else
      skv_dev_signal_set(c, pe, slot, value);
  }
}

SKV_DEV bool skv_dev_cmp(uint64_t have, int cmp, uint64_t want) {
  switch (cmp) {
  case SKV_CMP_EQ:
    return have == want;
  case SKV_CMP_NE:
    return have != want;
  case SKV_CMP_GE:
    return have >= want;
  case SKV_CMP_GT:
    return have > want;
  case SKV_CMP_LT:
    return have < want;
  default:
    return have <= want;
  }
}

/* Wait (one thread) until this PE's slot compares true (SKV_CMP_*) with `value`, with acquire
 * semantics. Returns 0, or SKV_ETIMEDOUT after c.timeout_ns; *observed (may be NULL) gets the
 * last value read. */
SKV_DEV int skv_dev_wait_until(const skv_dev_comm_t &c, uint32_t slot, int cmp, uint64_t value,
                               uint64_t *observed) {
  const uint64_t *p = skv_dev_signal_ptr(c, c.my_pe, slot);
  uint64_t have = skv_dev_load_acquire(p), t0 = 0;
  uint32_t spins = 0;
  int rc = 0;
  while (!skv_dev_cmp(have, cmp, value)) {
    if ((++spins & 63u) == 0) {
      uint64_t now = skv_dev_globaltimer();
      if (t0 == 0) {
        t0 = now;
      } else if (now - t0 > c.timeout_ns) {
        rc = SKV_ETIMEDOUT;
        break;
      }
    }
    have = skv_dev_load_acquire(p);
  }
  if (observed) *observed = have;
  return rc;
}

/* ---- barriers ----------------------------------------------------------------------------- */

/* One block on every PE: returns when the block of every PE has arrived; the writes each block
 * made before are visible to every other block after. Every thread of the block calls it.
 * Uses slots [slot_base, slot_base + npes + 1) (zero at first use; reuse them only for this
 * barrier). Returns 0 or SKV_ETIMEDOUT (on every thread). */
SKV_DEV int skv_dev_barrier_block(const skv_dev_comm_t &c, uint32_t slot_base) {
  __shared__ uint64_t skv_round;
  __shared__ int skv_rc;
  const unsigned t = skv_dev__block_rank(), nt = skv_dev__block_size();
  __syncthreads();
  if (t == 0) {
    uint64_t *ctr = skv_dev_signal_ptr(c, c.my_pe, slot_base + (uint32_t)c.npes);
    skv_round = *(volatile uint64_t *)ctr + 1;
    *(volatile uint64_t *)ctr = skv_round;
    skv_rc = 0;
  }
  __syncthreads();
  const uint64_t r = skv_round;
  for (unsigned pe = t; pe < (unsigned)c.npes; pe += nt) {
    skv_dev_fence();
    skv_dev_signal_set(c, (int)pe, slot_base + (uint32_t)c.my_pe, r);
  }
  for (unsigned pe = t; pe < (unsigned)c.npes; pe += nt)
    if (skv_dev_wait_until(c, slot_base + pe, SKV_CMP_GE, r, NULL) != 0) skv_rc = SKV_ETIMEDOUT;
  __syncthreads();
  return skv_rc;
}

/* Every block of the grid on every PE (grids may differ in size between PEs). All blocks of a
 * grid must be resident at once (a cooperative launch, or no more blocks than fit on the GPU
 * together). Uses slots [slot_base, slot_base + npes + 2) (zero at first use; reuse them only
 * for this barrier). Returns 0 or SKV_ETIMEDOUT (every thread); after a timeout the slots are
 * inconsistent and every later call on them fails at once. */
SKV_DEV int skv_dev_barrier_grid(const skv_dev_comm_t &c, uint32_t slot_base) {
  __shared__ int skv_rc;
  const unsigned long long nblocks = (unsigned long long)gridDim.x * gridDim.y * gridDim.z;
  const uint64_t kErr = 1ull << 63;
  __syncthreads();
  if (skv_dev__block_rank() == 0) {
    uint64_t *arrive = skv_dev_signal_ptr(c, c.my_pe, slot_base + (uint32_t)c.npes);
    uint64_t *gen = skv_dev_signal_ptr(c, c.my_pe, slot_base + (uint32_t)c.npes + 1);
    int rc = 0;
    uint64_t g = skv_dev_load_acquire(gen);
    if (g & kErr) {
      rc = SKV_ETIMEDOUT;
    } else {
      skv_dev_fence(); /* this block's writes (ordered by the __syncthreads above) go first */
      unsigned long long old = atomicAdd((unsigned long long *)arrive, 1ull);
      if (old == nblocks - 1) { /* last block of this PE: meet the other PEs */
        *(volatile uint64_t *)arrive = 0;
        const uint64_t r = g + 1;
        for (int pe = 0; pe < c.npes; pe++)
          skv_dev_signal_set(c, pe, slot_base + (uint32_t)c.my_pe, r);
        for (int pe = 0; pe < c.npes && rc == 0; pe++)
          rc = skv_dev_wait_until(c, slot_base + (uint32_t)pe, SKV_CMP_GE, r, NULL);
        skv_dev_store_release(gen, rc ? (r | kErr) : r);
      } else {
        uint64_t now = g;
        rc = skv_dev_wait_until(c, slot_base + (uint32_t)c.npes + 1, SKV_CMP_NE, g, &now);
        if (now & kErr) rc = SKV_ETIMEDOUT;
      }
    }
    skv_rc = rc;
  }
  __syncthreads();
  return skv_rc;
}

#endif /* __CUDACC__ */
#endif /* SYMKV_DEVICE_CUH */
