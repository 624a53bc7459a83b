/* KV copy kernels: one launch moves a batch of pages between the symmetric heap (pages of any
 * PE, over NVLink) and an engine's paged KV cache, 16-byte vectors or TMA bulk copies. */
#include "kernels/kv_copy.h"

#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* How it works
 * ------------
 * VEC kernels. Work is split into items of one warp each: (page i, tensor t, chunk c), a chunk
 * being 32 x U vectors of W bytes of the tensor's slab in the page (contiguous there). A chunk
 * inside one run (bytes contiguous in the page and in a block, e.g. NHD's whole block parts)
 * takes one engine address for the warp; otherwise each vector finds its own, as follows. Lane l
 * takes vectors c*32U + k*32 + l for k < U, so every warp-wide load reads 32 x W contiguous bytes
 * of the page and each lane has U loads in flight before its first store. A vector's slab offset
 * o gives its row r = o / row_bytes, token r / heads, head r % heads, engine block
 * block_ids[i*m + token / block_tokens] and the engine address; divisions by those invariants
 * are multiply-shifts (Granlund-Montgomery, operands < 2^31). The block ids a chunk touches
 * (usually one or two) are loaded once per chunk, one per lane, and shuffled to the lanes that
 * need them; a chunk spanning more than 32 blocks (tiny blocks) loads them per vector. Page
 * loads are ld.global.nc.L1::no_allocate: the pages are pinned (read-only while the kernel
 * runs) and read once. W is the largest power of two up to 16 dividing every row, stride and
 * base; rows of odd sizes take the narrow instantiations.
 *
 * BULK kernel (fetch, 16-byte aligned runs of at least 128 bytes). Each warp runs its own
 * pipeline of BK_STAGES shared-memory buffers: lane 0 loads a chunk of BK_CHUNK bytes of a slab
 * with one cp.async.bulk (the SM's TMA engine, completing on an mbarrier), and once it landed
 * the lanes write its runs (bytes contiguous in the page and in a block: a row, a token's heads
 * or a whole block part) with cp.async.bulk shared -> global, while the next chunks' loads are
 * in flight. The data never passes through registers.
 *
 * Both: the grid is persistent (at most ctas_per_sm resident CTAs per multiprocessor walk the
 * items with a stride of the whole grid). Arguments come from the kernel parameters when they
 * fit (small batches: no memory round trip before the first page load), else over PCIe from the
 * caller's pinned host memory (SKV_KV_ARGS_MAPPED; a few bytes per chunk, issued with the block
 * ids), or from a device copy (SKV_KV_ARGS_DEVICE).
 *
 * What can go wrong
 * -----------------
 * - Corrupted arguments (a graph replayed after its pages were released, a bug): every reference
 *   and block id is checked on the device before an address is formed from it; a bad one sets
 *   the error word (first writer wins, racy but every value is an error) and its data is
 *   skipped, so nothing outside the heap and the engine's blocks is touched.
 * - A bulk store still reading a buffer when the next load overwrites it: each lane waits for
 *   its stores to have read the buffer (wait_group.read) before lane 0 reuses it.
 */

namespace {

const unsigned FULL = 0xffffffffu;

constexpr uint32_t BK_WARPS = 4, BK_STAGES = 4, BK_CHUNK = 8192;
constexpr size_t BK_SMEM = (size_t)BK_WARPS * BK_STAGES * BK_CHUNK;

struct fdiv_t {
  uint32_t d, mul, shr;
};

/* n / d for n < 2^31 (CUTLASS's FastDivmod): mul = ceil(2^(31+l) / d), l = ceil(log2 d). */
fdiv_t fdiv_make(uint32_t d) {
  fdiv_t f = {d, 0, 0};
  if (d > 1) {
    uint32_t l = 32u - (uint32_t)__builtin_clz(d - 1);
    uint32_t p = 31u + l;
    f.mul = (uint32_t)(((1ull << p) + d - 1) / d);
    f.shr = p - 32u;
  }
  return f;
}

__device__ __forceinline__ uint32_t fdiv(uint32_t n, const fdiv_t &f) {
  return f.d == 1 ? n : (__umulhi(n, f.mul) >> f.shr);
}

template <uint32_t INL> struct kp_t {
  char *heap;
  uint64_t pe_stride, page_stride;
  const uint8_t *args; /* argument block, unless inline */
  int64_t sb, st, sh;
  uint64_t num_blocks;
  uint32_t *err;
  const uint64_t *gate;  /* a gated fetch's word in host memory (kv_copy.h), or NULL */
  uint64_t *gate_mirror; /* its mirror in device memory */
  uint32_t *gate_lock;   /* who reads the host's word */
  uint32_t gate_epoch, gate_ms;
  uint32_t npes, pages, m, slab, items, bid64, refs_off, bids_off, ninl, l2_256;
  uint32_t precede; /* publish: the next launch of the publish may begin early (desc.precedes) */
  fdiv_t cpu, nt, row, heads, bt, run;
  alignas(16) uint8_t inl[INL];
};
/* Two sizes of parameters: what every launch copies, and what a launch of a large batch copies
 * where the driver takes more than 4 KiB (CUDA 12.1 on): kernels of each. */
typedef kp_t<SKV_KV_COPY_INLINE_BYTES> kps_t;
typedef kp_t<SKV_KV_COPY_INLINE_BIG> kpb_t;
typedef kp_t<SKV_KV_COPY_INLINE_TINY> kpt_t; /* a few pages: a launch copies less */
static_assert(sizeof(kps_t) <= 4096, "kernel parameters over 4 KiB");
static_assert(sizeof(kpb_t) <= 16384, "large kernel parameters over 16 KiB");
/* The three sizes of parameters: small (every kernel), big (BULK and the 16-byte VEC kernels),
 * tiny (the 16-byte VEC kernels); the tier indexes resident_ctas' cache. */
template <class P> constexpr int tier_of() {
  return sizeof(P) == sizeof(kps_t) ? 0 : sizeof(P) == sizeof(kpb_t) ? 1 : 2;
}

template <class P> __device__ __forceinline__ const uint8_t *args_of(const P &p) {
  return p.ninl ? p.inl : p.args;
}

template <int W> struct vec;
template <> struct vec<16> { typedef uint4 T; };
template <> struct vec<8> { typedef uint2 T; };
template <> struct vec<4> { typedef uint32_t T; };
template <> struct vec<2> { typedef uint16_t T; };
template <> struct vec<1> { typedef uint8_t T; };

/* Read-once loads of data that no one writes while the kernel runs. */
__device__ __forceinline__ uint4 ld_once(const uint4 *p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}
__device__ __forceinline__ uint4 ld_once_256(const uint4 *p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}
__device__ __forceinline__ uint2 ld_once(const uint2 *p) {
  uint2 v;
  asm("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
  return v;
}
__device__ __forceinline__ uint32_t ld_once(const uint32_t *p) {
  uint32_t v;
  asm("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}
__device__ __forceinline__ uint16_t ld_once(const uint16_t *p) {
  return __ldg(p);
}
__device__ __forceinline__ uint8_t ld_once(const uint8_t *p) {
  return __ldg(p);
}
/* A page load: read-once, with the 256-byte L2 hint for 16-byte vectors when asked. */
template <typename T> __device__ __forceinline__ T ld_page(const T *p, bool) {
  return ld_once(p);
}
template <> __device__ __forceinline__ uint4 ld_page<uint4>(const uint4 *p, bool l2_256) {
  return l2_256 ? ld_once_256(p) : ld_once(p);
}

/* Stores to global memory (device, peer or mapped host), named as such: the pointers are
 * computed, so the compiler would otherwise emit generic stores. */
__device__ __forceinline__ void st_global(uint4 *p, uint4 v) {
  asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z),
               "r"(v.w)
               : "memory");
}
__device__ __forceinline__ void st_global(uint2 *p, uint2 v) {
  asm volatile("st.global.v2.u32 [%0], {%1, %2};" ::"l"(p), "r"(v.x), "r"(v.y) : "memory");
}
__device__ __forceinline__ void st_global(uint32_t *p, uint32_t v) {
  asm volatile("st.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void st_global(uint16_t *p, uint16_t v) {
  asm volatile("st.global.u16 [%0], %1;" ::"l"(p), "h"(v) : "memory");
}
__device__ __forceinline__ void st_global(uint8_t *p, uint8_t v) {
  asm volatile("st.global.u8 [%0], %1;" ::"l"(p), "h"((uint16_t)v) : "memory");
}

template <class P>
__device__ __forceinline__ uint64_t ld_bid(const P &p, const uint8_t *a, uint64_t idx) {
  return p.bid64 ? reinterpret_cast<const uint64_t *>(a + p.bids_off)[idx]
                 : reinterpret_cast<const uint32_t *>(a + p.bids_off)[idx];
}

/* Record a violation; the first value written to err[0] wins in practice (racy on purpose). */
__device__ __noinline__ void report(uint32_t *err, uint32_t code, uint32_t a, uint32_t b,
                                    uint64_t c) {
  volatile uint32_t *e = err;
  if (e[0] == 0) {
    e[1] = a;
    e[2] = b;
    e[3] = (uint32_t)(c > 0xffffffffull ? 0xffffffffull : c);
    __threadfence_system();
    e[0] = code;
  }
}

/* Engine byte offset (without the block) of slab offset o: token % bt, head, byte in the row;
 * j = the page's block index. */
template <class P> __device__ __forceinline__ int64_t eng_off(const P &p, uint32_t o, uint32_t *j) {
  const uint32_t r = fdiv(o, p.row), c = o - r * p.row.d;
  const uint32_t tok = fdiv(r, p.heads), h = r - tok * p.heads.d;
  const uint32_t jj = fdiv(tok, p.bt), tt = tok - jj * p.bt.d;
  *j = jj;
  return (int64_t)tt * p.st + (int64_t)h * p.sh + (int64_t)c;
}

/* A gated fetch (kv_copy.h): may page i of the batch be read? `seen` is the last gate value this
 * thread knows (0 at first): the count of pages opened, with SKV_KV_GATE_CLOSED. Reads of one
 * word of host memory are served one at a time across the GPU, about 1 us each on an H100
 * (bench/gpu/gate_probe.cu: 4224 warps reading it once took 4.3 ms), so one thread of the grid
 * at a time reads the host's word (whoever takes the lock) and mirrors it into device memory.
 * In the vec kernels (up to 16 warps a CTA) one warp of each CTA at a time reads the mirror
 * (whoever takes the CTA's flag) and relays it through shared memory (gate_cta_t) to the CTA's
 * other warps: with all 4224 warps of the grid polling the mirror word while the first host
 * read was pending, a gated 64 MiB fetch ran at 0.69x the copy engine on an H200 against 0.83x
 * ungated; relayed, at 0.75-0.76x, as the bulk kernel does (4 warps a CTA, which read the mirror
 * themselves: relayed in a first form, whose poller read the host's word holding the CTA's flag,
 * bulk lost 0.01; bench/results/gate_relay_nvidia-h200.txt). Mirror and host word carry the
 * use's epoch in their upper 32 bits: a mirror of an earlier use reads as nothing opened. One
 * thread's call. */
__device__ __forceinline__ uint64_t ld_acq_gpu(const uint64_t *a) {
  uint64_t v;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(a) : "memory");
  return v;
}
__device__ __forceinline__ uint64_t ld_host(const uint64_t *a) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(a) : "memory");
  return v;
}
template <class P> __device__ __forceinline__ uint32_t gate_of(const P &p, uint64_t v) {
  return (uint32_t)(v >> 32) == p.gate_epoch ? (uint32_t)v : 0u;
}
__device__ __forceinline__ uint64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
/* A CTA's gate state in shared memory: the latest gate value one of its warps read (never going
 * back: a closed gate's value is above every open count, so the largest is the latest), and the
 * flag of the warp reading the mirror for the CTA. Zeroed by the CTA before its first item. */
struct gate_cta_t {
  uint32_t seen, busy;
};
__device__ __forceinline__ void gate_cta_init(gate_cta_t *g) {
  if (threadIdx.x == 0) g->seen = 0, g->busy = 0;
  __syncthreads();
}
/* Does gate value v leave page i waiting (neither opened to it nor closed)? */
__device__ __forceinline__ bool gate_pending(uint32_t v, uint32_t i) {
  return i >= (v & ~SKV_KV_GATE_CLOSED) && !(v & SKV_KV_GATE_CLOSED);
}
/* The mirror's value (0 while it holds an earlier use's). */
template <class P> __device__ __forceinline__ uint32_t gate_mirror(const P &p) {
  return gate_of(p, ld_acq_gpu(p.gate_mirror));
}
/* v, or the host's word read into the mirror when v does not open page i (one thread of the
 * grid at a time: the lock's holder; the others keep v). */
template <class P> __device__ uint32_t gate_host(const P &p, uint32_t i, uint32_t v) {
  if (gate_pending(v, i) && *(volatile uint32_t *)p.gate_lock == 0 &&
      atomicCAS(p.gate_lock, 0u, 1u) == 0u) {
    __threadfence(); /* the lock taken before the host's word is read (acquire) */
    const uint64_t h = ld_host(p.gate);
    if (gate_of(p, h) != 0u) {
      asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(p.gate_mirror), "l"(h) : "memory");
      v = gate_of(p, h);
    }
    __threadfence();
    atomicExch(p.gate_lock, 0u);
  }
  return v;
}
/* The CTA's value (g: the vec kernels, many warps a CTA) or the mirror's (g NULL: the bulk
 * kernel, 4 warps a CTA, reads the mirror itself), then the host's word as above. With g, one
 * warp of the CTA at a time reads the mirror for the others, and lets another do so again before
 * it reads the host's word (a CTA-mate does not wait for that read when another CTA's already
 * reached the mirror). */
template <class P> __device__ uint32_t gate_read(const P &p, uint32_t i, gate_cta_t *g) {
  if (!g) return gate_host(p, i, gate_mirror(p));
  uint32_t v = *(volatile uint32_t *)&g->seen;
  if (gate_pending(v, i) && atomicCAS(&g->busy, 0u, 1u) == 0u) {
    const uint32_t m = gate_mirror(p);
    __threadfence_block(); /* what the read acquired, before the CTA sees the value */
    v = max(atomicMax(&g->seen, m), m);
    atomicExch(&g->busy, 0u);
    const uint32_t h = gate_host(p, i, v);
    if (h != v) {
      __threadfence_block();
      v = max(atomicMax(&g->seen, h), h);
    }
  }
  return v;
}
template <class P>
__device__ bool gate_wait(const P &p, uint32_t i, uint32_t &seen, gate_cta_t *g) {
  uint64_t t0 = 0;
  for (unsigned spin = 0; i >= (seen & ~SKV_KV_GATE_CLOSED); spin++) {
    if (seen & SKV_KV_GATE_CLOSED) return false;
    if (spin) {
      /* bounded: a host that never closes (its thread stopped between the launch and the pins:
       * CUDA_LAUNCH_BLOCKING, a debugger) costs gate_ms, then this page and the rest go */
      const uint64_t t = now_ns();
      if (!t0) t0 = t;
      if (t - t0 > (uint64_t)p.gate_ms * 1000000u) {
        report(p.err, SKV_KV_DEVERR_GATE, i, 0, seen);
        seen = (seen & ~SKV_KV_GATE_CLOSED) | SKV_KV_GATE_CLOSED;
        return false;
      }
      __nanosleep(256);
    }
    const uint32_t v = gate_read(p, i, g);
    if ((v & ~SKV_KV_GATE_CLOSED) >= (seen & ~SKV_KV_GATE_CLOSED)) seen = v; /* never back */
  }
  if (g) __threadfence_block(); /* the pages read after the value that opened them (acquire) */
  return true;
}
/* The same for a warp (uniform i and seen): lane 0 waits, every lane gets the answer. The
 * __syncwarp orders memory among the lanes, so their later accesses come after lane 0's acquire
 * as far as the memory model reaches (the shuffles carry only the value). It does not reach the
 * page loads themselves: they are ld.global.nc, which the model does not cover, and are safe
 * because a page the gate opened is not written while the kernel runs. */
template <class P>
__device__ __forceinline__ bool gate_pass_warp(const P &p, uint32_t i, uint32_t &seen,
                                               gate_cta_t *g) {
  if (i < (seen & ~SKV_KV_GATE_CLOSED)) return true;
  uint32_t ok = 0, s2 = seen;
  if ((threadIdx.x & 31u) == 0) ok = gate_wait(p, i, s2, g) ? 1u : 0u;
  __syncwarp();
  seen = __shfl_sync(FULL, s2, 0);
  return __shfl_sync(FULL, ok, 0) != 0u;
}

template <int W, int U, int DIR, class P> __device__ __forceinline__ void copy_vec(const P &p) {
#if __CUDA_ARCH__ >= 900
  /* a publish's next launch (skv__kv_copy_desc_t.precedes) may begin on the multiprocessors
   * this one's CTAs leave: it writes other pages */
  if (DIR == SKV_KV_COPY_PUBLISH && p.precede)
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
  typedef typename vec<W>::T T;
  constexpr uint32_t CH = 32u * U * W;
  const uint8_t *a = args_of(p);
  const uint64_t *bases = reinterpret_cast<const uint64_t *>(a);
  const uint2 *refs = reinterpret_cast<const uint2 *>(a + p.refs_off);
  const uint32_t lane = threadIdx.x & 31u;
  const uint32_t wpc = blockDim.x >> 5;
  const uint32_t nw = gridDim.x * wpc;
  uint32_t seen = 0; /* the gate word this warp last read (a gated fetch) */
  __shared__ gate_cta_t gcta;
  if (DIR == SKV_KV_COPY_FETCH && p.gate) gate_cta_init(&gcta);
  for (uint32_t item = blockIdx.x * wpc + (threadIdx.x >> 5); item < p.items; item += nw) {
    const uint32_t u = fdiv(item, p.cpu), ch = item - u * p.cpu.d;
    const uint32_t i = fdiv(u, p.nt), t = u - i * p.nt.d;
    if (DIR == SKV_KV_COPY_FETCH && p.gate && !gate_pass_warp(p, i, seen, &gcta))
      continue; /* the host closed the gate before page i: not pinned, not read */
    const uint32_t o0 = ch * CH;
    const uint32_t olast = min(o0 + CH, p.slab) - 1u;
    /* block ids of the chunk, page reference and tensor base: one round of loads */
    const uint32_t j0 = fdiv(fdiv(fdiv(o0, p.row), p.heads), p.bt);
    const uint32_t j1 = fdiv(fdiv(fdiv(olast, p.row), p.heads), p.bt);
    const uint32_t span = j1 - j0 + 1u;
    const uint64_t bbase = (uint64_t)i * p.m;
    uint64_t mybid = 0;
    if (span <= 32u && lane < span) mybid = ld_bid(p, a, bbase + j0 + lane);
    const uint2 ref = refs[i];
    const uint64_t tb = bases[t];
    if (ref.x >= p.npes || ref.y >= p.pages) { /* warp-uniform */
      if (lane == 0)
        report(p.err, ref.x >= p.npes ? SKV_KV_DEVERR_PE : SKV_KV_DEVERR_PAGE, i, t,
               ref.x >= p.npes ? ref.x : ref.y);
      continue;
    }
    char *page = p.heap + ref.x * p.pe_stride + ref.y * p.page_stride + (uint64_t)t * p.slab;
    T v[U];
    if (fdiv(o0, p.run) == fdiv(olast, p.run)) { /* warp-uniform */
      /* The chunk lies in one run (bytes contiguous in the page and in one block: NHD layouts'
       * runs are whole block parts): one engine address for the warp, none per vector. */
      uint32_t j;
      const int64_t eo = eng_off(p, o0, &j);
      const uint64_t bid = __shfl_sync(FULL, mybid, 0); /* span is 1: lane 0 loaded it */
      if (bid >= p.num_blocks) {
        if (lane == 0) report(p.err, SKV_KV_DEVERR_BLOCK, i, t, bid);
        continue;
      }
      char *eng = (char *)tb + (int64_t)bid * p.sb + eo;
      const char *src = DIR == SKV_KV_COPY_FETCH ? page + o0 : eng;
      char *dst = DIR == SKV_KV_COPY_FETCH ? eng : page + o0;
      const uint32_t len = olast - o0 + 1u;
#pragma unroll
      for (int k = 0; k < U; k++) {
        const uint32_t o = (uint32_t)(k * 32 + lane) * W;
        if (o < len) v[k] = ld_page(reinterpret_cast<const T *>(src + o), p.l2_256 != 0);
      }
#pragma unroll
      for (int k = 0; k < U; k++) {
        const uint32_t o = (uint32_t)(k * 32 + lane) * W;
        if (o < len) st_global(reinterpret_cast<T *>(dst + o), v[k]);
      }
      continue;
    }
    char *dp[U];
    uint64_t badbid = ~0ull;
#pragma unroll
    for (int k = 0; k < U; k++) {
      const uint32_t o = o0 + (uint32_t)(k * 32 + lane) * W;
      const bool in = o < p.slab;
      uint32_t j;
      const int64_t eo = eng_off(p, in ? o : olast, &j);
      uint64_t bid;
      if (span <= 32u)
        bid = __shfl_sync(FULL, mybid, (int)(j - j0));
      else
        bid = in ? ld_bid(p, a, bbase + j) : 0;
      const bool ok = in && bid < p.num_blocks;
      if (in && !ok) badbid = bid;
      char *eng = (char *)tb + (int64_t)bid * p.sb + eo;
      char *pg = page + o;
      const T *s = reinterpret_cast<const T *>(DIR == SKV_KV_COPY_FETCH ? pg : eng);
      dp[k] = ok ? (DIR == SKV_KV_COPY_FETCH ? eng : pg) : nullptr;
      if (ok) v[k] = ld_page(s, p.l2_256 != 0);
    }
#pragma unroll
    for (int k = 0; k < U; k++)
      if (dp[k]) st_global(reinterpret_cast<T *>(dp[k]), v[k]);
    if (badbid != ~0ull) report(p.err, SKV_KV_DEVERR_BLOCK, i, t, badbid);
  }
}

/* ---- TMA bulk copies ---- */

__device__ __forceinline__ uint32_t smem_u32(const void *p) {
  return (uint32_t)__cvta_generic_to_shared(p);
}
__device__ __forceinline__ void mbar_init(uint64_t *bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(bar)) : "memory");
}
__device__ __forceinline__ void bulk_load(void *dst, const void *src, uint32_t bytes,
                                          uint64_t *bar) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)),
               "r"(bytes)
               : "memory");
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, "
               "[%3];" ::"r"(smem_u32(dst)),
               "l"(src), "r"(bytes), "r"(smem_u32(bar))
               : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t *bar, uint32_t parity) {
  uint32_t done = 0;
  while (!done)
    asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                 " selp.u32 %0, 1, 0, p;\n}"
                 : "=r"(done)
                 : "r"(smem_u32(bar)), "r"(parity)
                 : "memory");
}
__device__ __forceinline__ void bulk_store(void *dst, const void *src, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst),
               "r"(smem_u32(src)), "r"(bytes)
               : "memory");
}

/* Where item `it` of a fetch is read from: its page i (in the batch) and its source and length;
 * false for a refused reference (reported by the item's own turn, not read). No page is read. */
template <class P>
__device__ __forceinline__ bool bulk_src(const P &p, const uint8_t *a, uint32_t it, uint32_t *i,
                                         const char **src, uint32_t *len) {
  const uint32_t u = fdiv(it, p.cpu), ch = it - u * p.cpu.d;
  *i = fdiv(u, p.nt);
  const uint32_t t = u - *i * p.nt.d;
  const uint2 ref = reinterpret_cast<const uint2 *>(a + p.refs_off)[*i];
  if (ref.x >= p.npes || ref.y >= p.pages) return false;
  const uint32_t o0 = ch * BK_CHUNK;
  *len = min(BK_CHUNK, p.slab - o0);
  *src = p.heap + ref.x * p.pe_stride + ref.y * p.page_stride + (uint64_t)t * p.slab + o0;
  return true;
}

/* Lane 0: start loading `len` bytes at `src` (bulk_src's, of page i) into a stage, once the gate
 * opened page i; 1 when it did, 0 for a page past a closed gate (`seen`: gate_wait's). */
template <class P>
__device__ __forceinline__ uint32_t bulk_start(const P &p, uint32_t i, const char *src,
                                               uint32_t len, uint8_t *buf, uint64_t *bar,
                                               uint32_t &seen) {
  if (p.gate && i >= (seen & ~SKV_KV_GATE_CLOSED)) {
    if (!gate_wait(p, i, seen, nullptr)) return 0; /* 4 warps a CTA: each reads the mirror */
    /* the bulk copy (the async proxy) after the gate's acquire (the generic proxy) */
    asm volatile("fence.proxy.async.global;" ::: "memory");
  }
  bulk_load(buf, src, len, bar);
  return 1;
}

/* How a stage turns over
 * ----------------------
 * Stage s holds the warp's k-th items for k = s, s + BK_STAGES, ...: wait for the chunk, store
 * it (a bulk store per run, one run per lane), wait until the stores have read the buffer, load
 * the stage's next item into it. Lane 0 works out that next load (reference, source) while the
 * stores read the buffer, so that it is issued as soon as they have. On one H200, in seven
 * alternated pairs, this took a gated local 64 MiB fetch of 64 KiB pages from 0.753-0.760 of the
 * copy engine to 0.761-0.779 and fetch_e2e from 0.57-0.63 to 0.61-0.63; 16 MiB and 1 GiB batches
 * moved by less than 0.02 either way. Working each lane's store out before the chunk lands cost
 * 0.01-0.02, and 0.02-0.05 with the next load also before it
 * (bench/results/bulk_turnover_nvidia-h200.txt). */
template <class P>
__device__ __forceinline__ void fetch_bulk(const P &p, uint8_t *smem, uint64_t *bars) {
  const uint8_t *a = args_of(p);
  const uint32_t lane = threadIdx.x & 31u, wid = threadIdx.x >> 5;
  const uint32_t nw = gridDim.x * BK_WARPS, gw = blockIdx.x * BK_WARPS + wid;
  uint8_t *buf = smem + (size_t)wid * BK_STAGES * BK_CHUNK;
  uint64_t *bar = bars + wid * BK_STAGES;
  uint32_t issued = 0, seen = 0; /* lane 0: bit s, stage s is loading; the gate word it read */
  if (lane == 0) {
    for (uint32_t s = 0; s < BK_STAGES; s++) mbar_init(&bar[s]);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    for (uint32_t s = 0; s < BK_STAGES; s++) {
      const uint32_t it = gw + s * nw;
      uint32_t i, len;
      const char *src;
      if (it < p.items && bulk_src(p, a, it, &i, &src, &len))
        issued |= bulk_start(p, i, src, len, buf + s * BK_CHUNK, &bar[s], seen) << s;
    }
  }
  __syncwarp();
  uint32_t phase = 0;
  for (uint32_t k = 0;; k++) {
    const uint32_t it = gw + k * nw;
    if (it >= p.items) break;
    const uint32_t s = k % BK_STAGES;
    const uint32_t u = fdiv(it, p.cpu), ch = it - u * p.cpu.d;
    const uint32_t i = fdiv(u, p.nt), t = u - i * p.nt.d;
    const uint2 ref = reinterpret_cast<const uint2 *>(a + p.refs_off)[i];
    const bool loading = (__shfl_sync(FULL, issued, 0) >> s) & 1u;
    /* lane 0: the stage's next load (known: worked out already; ok: to be read) */
    const uint32_t next = gw + (k + BK_STAGES) * nw;
    uint32_t ni = 0, nlen = 0;
    const char *nsrc = nullptr;
    bool nknown = false, nok = false;
    if (ref.x >= p.npes || ref.y >= p.pages) {
      if (lane == 0)
        report(p.err, ref.x >= p.npes ? SKV_KV_DEVERR_PE : SKV_KV_DEVERR_PAGE, i, t,
               ref.x >= p.npes ? ref.x : ref.y);
    } else if (loading) { /* else past a closed gate: not read */
      const uint32_t o0 = ch * BK_CHUNK, end = min(o0 + BK_CHUNK, p.slab);
      const uint8_t *sb = buf + s * BK_CHUNK;
      const uint64_t tb = reinterpret_cast<const uint64_t *>(a)[t];
      mbar_wait(&bar[s], (phase >> s) & 1u);
      phase ^= 1u << s;
      /* the chunk's runs: [r * run, (r + 1) * run) clipped to the chunk, one per lane */
      const uint32_t r0 = fdiv(o0, p.run), r1 = fdiv(end - 1u, p.run);
      uint64_t badbid = ~0ull;
      for (uint32_t r = r0 + lane; r <= r1; r += 32) {
        const uint32_t s0 = max(o0, r * p.run.d), s1 = min(end, (r + 1u) * p.run.d);
        uint32_t j;
        const int64_t eo = eng_off(p, s0, &j);
        const uint64_t bid = ld_bid(p, a, (uint64_t)i * p.m + j);
        if (bid >= p.num_blocks) {
          badbid = bid;
          continue;
        }
        bulk_store((char *)tb + (int64_t)bid * p.sb + eo, sb + (s0 - o0), s1 - s0);
      }
      asm volatile("cp.async.bulk.commit_group;" ::: "memory");
      if (lane == 0 && next < p.items) nok = bulk_src(p, a, next, &ni, &nsrc, &nlen);
      nknown = true;
      asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
      if (badbid != ~0ull) report(p.err, SKV_KV_DEVERR_BLOCK, i, t, badbid);
    }
    __syncwarp();
    if (lane == 0 && next < p.items) {
      if (!nknown) nok = bulk_src(p, a, next, &ni, &nsrc, &nlen);
      issued = (issued & ~(1u << s)) |
               (nok ? bulk_start(p, ni, nsrc, nlen, buf + s * BK_CHUNK, &bar[s], seen) : 0u) << s;
    }
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

} // namespace

template <int W, int U, class P>
__global__ void __launch_bounds__(512) skv_k_fetch_vec(const __grid_constant__ P p) {
  copy_vec<W, U, SKV_KV_COPY_FETCH>(p);
}

template <int W, int U, class P>
__global__ void __launch_bounds__(512) skv_k_publish_vec(const __grid_constant__ P p) {
  copy_vec<W, U, SKV_KV_COPY_PUBLISH>(p);
}

template <class P>
__global__ void __launch_bounds__(BK_WARPS * 32) skv_k_fetch_bulk(const __grid_constant__ P p) {
  extern __shared__ __align__(128) uint8_t skv_bulk_smem[];
  __shared__ uint64_t bars[BK_WARPS * BK_STAGES];
  fetch_bulk(p, skv_bulk_smem, bars);
}

__global__ void skv_k_stream_gate(const volatile uint32_t *flag, uint64_t min_ns, uint64_t max_ns) {
  uint64_t t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  for (;;) {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    if (t - t0 >= max_ns || (t - t0 >= min_ns && *flag != 0)) break;
    __nanosleep(500);
  }
}

namespace {

/* The VEC kernel of a direction, width and unroll; with big or tiny parameters only the 16-byte
 * one exists (NULL for the others: inline_kind keeps their arguments in the small ones). */
template <int U, class P> const void *pick(int dir, uint32_t w) {
  const bool f = dir == SKV_KV_COPY_FETCH;
  if (tier_of<P>() != 0 && w != 16) return nullptr;
  switch (w) {
  case 16:
    return f ? (const void *)skv_k_fetch_vec<16, U, P> : (const void *)skv_k_publish_vec<16, U, P>;
  case 8:
    return f ? (const void *)skv_k_fetch_vec<8, U, kps_t>
             : (const void *)skv_k_publish_vec<8, U, kps_t>;
  case 4:
    return f ? (const void *)skv_k_fetch_vec<4, U, kps_t>
             : (const void *)skv_k_publish_vec<4, U, kps_t>;
  case 2:
    return f ? (const void *)skv_k_fetch_vec<2, U, kps_t>
             : (const void *)skv_k_publish_vec<2, U, kps_t>;
  case 1:
    return f ? (const void *)skv_k_fetch_vec<1, U, kps_t>
             : (const void *)skv_k_publish_vec<1, U, kps_t>;
  default:
    return nullptr;
  }
}

/* CTAs of `threads` that fit one multiprocessor (a persistent grid larger than what is resident
 * would leave its last CTAs to run alone at the end). Cached: the same for every device here. */
int resident_ctas(const void *fn, int slot, int threads, size_t smem) {
  static int cache[192];
  int *c = &cache[slot % 192];
  int v = __atomic_load_n(c, __ATOMIC_RELAXED);
  if (v > 0) return v;
  if (smem > 48 * 1024 && cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               (int)smem) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&v, fn, threads, smem) != cudaSuccess ||
      v < 1) {
    (void)cudaGetLastError();
    return 0;
  }
  __atomic_store_n(c, v, __ATOMIC_RELAXED);
  return v;
}

int wi_of(uint32_t w) {
  return w == 16 ? 0 : w == 8 ? 1 : w == 4 ? 2 : w == 2 ? 3 : 4;
}
int ti_of(int threads) {
  return threads == 128 ? 0 : threads == 256 ? 1 : 2;
}
/* resident_ctas' cache: slots 0-59 the VEC kernels, 60 BULK; 64 more per tier of parameters */
int vec_slot(int dir, int unroll, uint32_t w, int threads, int tier) {
  return tier * 64 + ((dir == SKV_KV_COPY_PUBLISH) * 2 + (unroll == 8)) * 15 + wi_of(w) * 3 +
         ti_of(threads);
}
int bulk_slot(int tier) {
  return tier * 64 + 60;
}

bool valid_cfg(const skv__kv_copy_cfg_t *c) {
  return c->kernel >= SKV_KV_KERNEL_VEC && c->kernel <= SKV_KV_KERNEL_AUTO &&
         (c->unroll == 4 || c->unroll == 8) && c->ctas_per_sm >= 1 && c->ctas_per_sm <= 32 &&
         (c->threads == 128 || c->threads == 256 || c->threads == 512) && c->args >= 0 &&
         c->args <= 2 && c->sms >= 1;
}

uint64_t slab_bytes(const skv__kv_copy_desc_t *d) {
  return (uint64_t)d->page_tokens * d->heads * d->row_bytes;
}

bool use_bulk(const skv__kv_copy_desc_t *d, const skv__kv_copy_cfg_t *cfg) {
  if (cfg->kernel == SKV_KV_KERNEL_AUTO &&
      (uint64_t)d->n * d->ntensors * slab_bytes(d) < SKV_KV_BULK_MIN_BYTES)
    return false;
  return (cfg->kernel == SKV_KV_KERNEL_BULK || cfg->kernel == SKV_KV_KERNEL_AUTO) &&
         d->dir == SKV_KV_COPY_FETCH && d->width == 16 && d->run_bytes >= 128 &&
         d->run_bytes % d->row_bytes == 0;
}

/* A VEC item's chunk: 32 lanes x unroll vectors of the batch's width. */
uint64_t vec_chunk(const skv__kv_copy_desc_t *d, const skv__kv_copy_cfg_t *cfg) {
  return 32ull * (uint64_t)cfg->unroll * (d->width ? d->width : 1);
}

uint64_t chunk_bytes(const skv__kv_copy_desc_t *d, const skv__kv_copy_cfg_t *cfg) {
  return use_bulk(d, cfg) ? BK_CHUNK : vec_chunk(d, cfg);
}

/* Does the driver take kernel parameters over 4 KiB (CUDA 12.1 on)? Asked once. */
bool big_params() {
  static int ok = -1;
  int v = __atomic_load_n(&ok, __ATOMIC_RELAXED);
  if (v < 0) {
    int drv = 0;
    v = cudaDriverGetVersion(&drv) == cudaSuccess && drv >= 12010;
    __atomic_store_n(&ok, v, __ATOMIC_RELAXED);
  }
  return v != 0;
}

/* Can this batch's arguments go in large parameters? A kernel with them exists for BULK and the
 * 16-byte VEC kernels (the others keep small ones). */
bool big_ok(const skv__kv_copy_desc_t *d, const skv__kv_copy_cfg_t *cfg) {
  return (use_bulk(d, cfg) || d->width == 16) && big_params();
}

/* Where the arguments go: args_dev, or the parameters of a tier (IN_SMALL + tier_of<P>()); the
 * tiny ones for a few pages of the 16-byte VEC kernels (a launch copies 512 bytes, not 3.7 KiB). */
enum { IN_DEV = 0, IN_SMALL = 1, IN_BIG = 2, IN_TINY = 3 };
int inline_kind(const skv__kv_copy_desc_t *d, const skv__kv_copy_cfg_t *cfg) {
  if (cfg->args != SKV_KV_ARGS_AUTO || !d->args_host) return IN_DEV;
  if (d->args_bytes <= SKV_KV_COPY_INLINE_TINY && d->width == 16 && !use_bulk(d, cfg))
    return IN_TINY;
  if (d->args_bytes <= SKV_KV_COPY_INLINE_BYTES) return IN_SMALL;
  return d->args_bytes <= SKV_KV_COPY_INLINE_BIG && big_ok(d, cfg) ? IN_BIG : IN_DEV;
}

} // namespace

extern "C" int skv__kv_copy_args_inline(const skv__kv_copy_desc_t *d,
                                        const skv__kv_copy_cfg_t *cfg) {
  return inline_kind(d, cfg) != IN_DEV;
}

extern "C" uint64_t skv__kv_copy_max_pages(const skv__kv_copy_desc_t *d,
                                           const skv__kv_copy_cfg_t *cfg) {
  const uint64_t slab = slab_bytes(d);
  /* under AUTO the kernel depends on the batch's size, which a plan does not know yet (n = 0):
   * the bound holds for either kernel (VEC's chunk is the smaller, BULK's the larger), so a
   * plan's launches never exceed it */
  const bool either = cfg->kernel == SKV_KV_KERNEL_AUTO;
  const uint64_t chunk = either ? vec_chunk(d, cfg) : chunk_bytes(d, cfg);
  const uint64_t largest = either ? BK_CHUNK : chunk;
  if (slab == 0 || slab >= (1ull << 31) - largest || d->ntensors == 0) return 0;
  const uint64_t per_page = (uint64_t)d->ntensors * ((slab + chunk - 1) / chunk);
  return ((1ull << 31) - 1) / per_page;
}

namespace {

/* Fill the parameters of P and launch (skv__kv_copy_launch, once the descriptor is checked). */
template <class P>
int launch(const skv__kv_copy_desc_t *d, const skv__kv_copy_cfg_t *cfg, bool inl, void *stream) {
  const int tier = tier_of<P>();
  const bool bulk = use_bulk(d, cfg);
  const uint64_t slab = slab_bytes(d);
  const uint32_t chunk = (uint32_t)chunk_bytes(d, cfg);
  const uint32_t cpu = (uint32_t)((slab + chunk - 1) / chunk);
  static thread_local P p; /* up to 16 KiB: not on the stack; copied by the launch */
  p.heap = reinterpret_cast<char *>(d->heap);
  p.pe_stride = d->pe_stride;
  p.page_stride = d->page_stride;
  p.args = static_cast<const uint8_t *>(d->args_dev);
  p.sb = d->stride_block;
  p.st = d->stride_token;
  p.sh = d->stride_head;
  p.num_blocks = d->num_blocks;
  p.err = d->err;
  p.gate = d->gate;
  p.gate_mirror = d->gate_mirror;
  p.gate_lock = d->gate_lock;
  p.gate_epoch = d->gate_epoch;
  p.gate_ms = d->gate_ms;
  p.npes = d->npes;
  p.pages = d->pages_per_pe;
  p.m = d->blocks_per_page;
  p.slab = (uint32_t)slab;
  p.items = (uint32_t)((uint64_t)d->n * d->ntensors * cpu);
  p.bid64 = d->bid64 ? 1u : 0u;
  p.refs_off = d->refs_off;
  p.bids_off = d->bids_off;
  p.ninl = inl ? d->args_bytes : 0;
  p.l2_256 = cfg->l2_256 ? 1u : 0u;
  p.precede = d->precedes && d->dir == SKV_KV_COPY_PUBLISH ? 1u : 0u;
  if (inl) memcpy(p.inl, d->args_host, d->args_bytes);
  p.cpu = fdiv_make(cpu);
  p.nt = fdiv_make(d->ntensors);
  p.row = fdiv_make(d->row_bytes);
  p.heads = fdiv_make(d->heads);
  p.bt = fdiv_make(d->block_tokens);
  p.run = fdiv_make(d->run_bytes);
  const void *fn;
  int threads, per_sm;
  size_t smem = 0;
  if (bulk) {
    fn = (const void *)skv_k_fetch_bulk<P>;
    threads = BK_WARPS * 32;
    smem = BK_SMEM;
    per_sm = resident_ctas(fn, bulk_slot(tier), threads, smem);
  } else {
    fn = cfg->unroll == 8 ? pick<8, P>(d->dir, d->width) : pick<4, P>(d->dir, d->width);
    threads = cfg->threads;
    per_sm =
        fn ? resident_ctas(fn, vec_slot(d->dir, cfg->unroll, d->width, threads, tier), threads, 0)
           : 0;
  }
  if (!fn || per_sm <= 0) return (int)cudaErrorInvalidValue;
  const uint32_t wpc = (uint32_t)threads / 32u;
  uint64_t grid = ((uint64_t)p.items + wpc - 1) / wpc;
  const uint64_t cap =
      (uint64_t)cfg->sms * (uint64_t)(cfg->ctas_per_sm < per_sm ? cfg->ctas_per_sm : per_sm);
  if (grid > cap) grid = cap;
  void *args[] = {&p};
  cudaLaunchConfig_t lc = {};
  lc.gridDim = dim3((unsigned)grid);
  lc.blockDim = dim3((unsigned)threads);
  lc.dynamicSmemBytes = smem;
  lc.stream = (cudaStream_t)stream;
  cudaLaunchAttribute at[1];
  at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  at[0].val.programmaticStreamSerializationAllowed = 1;
  lc.attrs = at;
  lc.numAttrs = d->follows && d->dir == SKV_KV_COPY_PUBLISH && !bulk ? 1 : 0;
  cudaError_t e = cudaLaunchKernelExC(&lc, fn, args);
  if (e != cudaSuccess && lc.numAttrs) { /* nothing enqueued: launched plainly instead */
    (void)cudaGetLastError();
    lc.numAttrs = 0;
    e = cudaLaunchKernelExC(&lc, fn, args);
  }
  return (int)e;
}

} // namespace

extern "C" int skv__kv_copy_launch(const skv__kv_copy_desc_t *d, const skv__kv_copy_cfg_t *cfg,
                                   void *stream) {
  if (!d || !cfg || !valid_cfg(cfg)) return (int)cudaErrorInvalidValue;
  if (d->n == 0) return 0;
  const uint32_t w = d->width;
  if (w != 16 && w != 8 && w != 4 && w != 2 && w != 1) return (int)cudaErrorInvalidValue;
  if (d->row_bytes == 0 || d->row_bytes % w || d->heads == 0 || d->block_tokens == 0 ||
      d->page_tokens % d->block_tokens || d->blocks_per_page != d->page_tokens / d->block_tokens ||
      d->run_bytes == 0 || d->run_bytes % d->row_bytes || d->heap % w || d->pe_stride % w ||
      d->page_stride % w || d->stride_block % w || d->stride_token % w || d->stride_head % w ||
      !d->err || (d->refs_off & 7) || (d->bids_off & 7) || d->refs_off < 8ull * d->ntensors ||
      d->bids_off < d->refs_off + 8ull * d->n)
    return (int)cudaErrorInvalidValue;
  const int kind = inline_kind(d, cfg);
  if (!kind && !d->args_dev) return (int)cudaErrorInvalidValue;
  const uint64_t maxp = skv__kv_copy_max_pages(d, cfg);
  if (maxp == 0 || d->n > maxp) return (int)cudaErrorInvalidValue;
  if (kind == IN_BIG) return launch<kpb_t>(d, cfg, true, stream);
  if (kind == IN_TINY) return launch<kpt_t>(d, cfg, true, stream);
  return launch<kps_t>(d, cfg, kind == IN_SMALL, stream);
}

extern "C" int skv__kv_copy_preload(void) {
  static const uint32_t widths[] = {16, 8, 4, 2, 1};
  static const int threads[] = {128, 256, 512};
  for (int dir = 0; dir < 2; dir++)
    for (int u = 4; u <= 8; u += 4)
      for (uint32_t w : widths)
        for (int t : threads) {
          const void *fn = u == 8 ? pick<8, kps_t>(dir, w) : pick<4, kps_t>(dir, w);
          if (resident_ctas(fn, vec_slot(dir, u, w, t, 0), t, 0) < 1)
            return (int)cudaErrorInvalidValue;
          if (w != 16) continue;
          fn = u == 8 ? pick<8, kpt_t>(dir, w) : pick<4, kpt_t>(dir, w);
          if (resident_ctas(fn, vec_slot(dir, u, w, t, 2), t, 0) < 1)
            return (int)cudaErrorInvalidValue;
          if (big_params()) {
            fn = u == 8 ? pick<8, kpb_t>(dir, w) : pick<4, kpb_t>(dir, w);
            if (resident_ctas(fn, vec_slot(dir, u, w, t, 1), t, 0) < 1)
              return (int)cudaErrorInvalidValue;
          }
        }
  if (resident_ctas((const void *)skv_k_fetch_bulk<kps_t>, bulk_slot(0), BK_WARPS * 32, BK_SMEM) <
          1 ||
      (big_params() && resident_ctas((const void *)skv_k_fetch_bulk<kpb_t>, bulk_slot(1),
                                     BK_WARPS * 32, BK_SMEM) < 1))
    return (int)cudaErrorInvalidValue;
  cudaFuncAttributes fa;
  return (int)cudaFuncGetAttributes(&fa, (const void *)skv_k_stream_gate);
}

extern "C" const char *skv__kv_copy_kernel_name(const skv__kv_copy_desc_t *d,
                                                const skv__kv_copy_cfg_t *cfg) {
  static const char *const names[2][2][5] = {
      {{"skv_k_fetch_vec16<u4>", "skv_k_fetch_vec8<u4>", "skv_k_fetch_vec4<u4>",
        "skv_k_fetch_vec2<u4>", "skv_k_fetch_vec1<u4>"},
       {"skv_k_fetch_vec16<u8>", "skv_k_fetch_vec8<u8>", "skv_k_fetch_vec4<u8>",
        "skv_k_fetch_vec2<u8>", "skv_k_fetch_vec1<u8>"}},
      {{"skv_k_publish_vec16<u4>", "skv_k_publish_vec8<u4>", "skv_k_publish_vec4<u4>",
        "skv_k_publish_vec2<u4>", "skv_k_publish_vec1<u4>"},
       {"skv_k_publish_vec16<u8>", "skv_k_publish_vec8<u8>", "skv_k_publish_vec4<u8>",
        "skv_k_publish_vec2<u8>", "skv_k_publish_vec1<u8>"}}};
  static const char *const tier_names[2][2][2] = {
      {{"skv_k_fetch_vec16<u4, 16 KiB parameters>", "skv_k_fetch_vec16<u8, 16 KiB parameters>"},
       {"skv_k_publish_vec16<u4, 16 KiB parameters>",
        "skv_k_publish_vec16<u8, 16 KiB parameters>"}},
      {{"skv_k_fetch_vec16<u4, 512 B parameters>", "skv_k_fetch_vec16<u8, 512 B parameters>"},
       {"skv_k_publish_vec16<u4, 512 B parameters>", "skv_k_publish_vec16<u8, 512 B parameters>"}}};
  const int kind = inline_kind(d, cfg);
  if (use_bulk(d, cfg))
    return kind == IN_BIG ? "skv_k_fetch_bulk<16 KiB parameters>" : "skv_k_fetch_bulk";
  if (kind == IN_BIG || kind == IN_TINY)
    return tier_names[kind == IN_TINY][d->dir == SKV_KV_COPY_PUBLISH][cfg->unroll == 8];
  return names[d->dir == SKV_KV_COPY_PUBLISH][cfg->unroll == 8][wi_of(d->width)];
}

extern "C" int skv__kv_gate_launch(void *stream, const volatile uint32_t *flag, uint64_t min_ns,
                                   uint64_t max_ns) {
  skv_k_stream_gate<<<1, 1, 0, (cudaStream_t)stream>>>(flag, min_ns, max_ns);
  return (int)cudaGetLastError();
}
