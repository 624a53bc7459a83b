/* CUDA kernels of the collectives: Lamport one-shot and two-shot all-reduce, barrier, signal and
 * wait, and the device-API self-test and ping-pong; launch wrappers for src/comm/comm_cuda.c. */
#include "kernels/comm_proto.h"

#include "symkv.h"
#include "symkv_device.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

/* The flag protocols are described in kernels/comm_proto.h ("How the flag protocols work"); the
 * host backend (src/comm/comm_host.c) runs the same index math from there with the CPU. */

namespace {

constexpr int kThreads = SKV__COMM_THREADS;
constexpr int kMinBlocksPerSm = SKV__COMM_MIN_BLOCKS_PER_SM; /* register cap (85), no spills */

/* ---- memory access ------------------------------------------------------------------------ */

/* Lamport slots: volatile (strong, system scope) so that a poll never hits a stale L1 line and
 * is never hoisted out of its loop. No "memory" clobber: the data is its own flag. */
__device__ __forceinline__ uint4 ld_slot(const char *p) {
  uint4 v;
  asm volatile("ld.volatile.global.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}
__device__ __forceinline__ void st_slot(char *p, uint4 v) {
  asm volatile("st.volatile.global.v4.u32 [%0], {%1,%2,%3,%4};" ::"l"(p), "r"(v.x), "r"(v.y),
               "r"(v.z), "r"(v.w));
}
__device__ __forceinline__ uint32_t ld_volatile_u32(const uint32_t *p) {
  return *(const volatile uint32_t *)p;
}
__device__ __forceinline__ uint64_t ld_volatile_u64(const uint64_t *p) {
  return *(const volatile uint64_t *)p;
}

__device__ __forceinline__ uint4 sentinel() {
  return make_uint4(SKV__SENT32, SKV__SENT32, SKV__SENT32, SKV__SENT32);
}

/* ---- element types ------------------------------------------------------------------------ */

template <int DT> struct Dt;

template <> struct Dt<SKV_DTYPE_BF16> {
  static constexpr int kLanes = 8;
  static constexpr uint32_t kEs = 2;
  static __device__ __forceinline__ void to_float(uint32_t w, float &lo, float &hi) {
    lo = __uint_as_float(w << 16);
    hi = __uint_as_float(w & 0xffff0000u);
  }
  static __device__ __forceinline__ uint32_t from_float(float lo, float hi) {
    __nv_bfloat162 t = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&t);
  }
};

template <> struct Dt<SKV_DTYPE_FP16> {
  static constexpr int kLanes = 8;
  static constexpr uint32_t kEs = 2;
  static __device__ __forceinline__ void to_float(uint32_t w, float &lo, float &hi) {
    __half2 h = *reinterpret_cast<__half2 *>(&w);
    float2 f = __half22float2(h);
    lo = f.x;
    hi = f.y;
  }
  static __device__ __forceinline__ uint32_t from_float(float lo, float hi) {
    __half2 t = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t *>(&t);
  }
};

template <> struct Dt<SKV_DTYPE_FP32> {
  static constexpr int kLanes = 4;
  static constexpr uint32_t kEs = 4;
};

/* Any element equal to the sentinel (not yet delivered)? */
template <int DT> __device__ __forceinline__ bool has_sent(uint4 v) {
  if constexpr (Dt<DT>::kEs == 4) {
    return (v.x == SKV__SENT32) | (v.y == SKV__SENT32) | (v.z == SKV__SENT32) |
           (v.w == SKV__SENT32);
  } else {
    return (__vcmpeq2(v.x, SKV__SENT32) | __vcmpeq2(v.y, SKV__SENT32) |
            __vcmpeq2(v.z, SKV__SENT32) | __vcmpeq2(v.w, SKV__SENT32)) != 0u;
  }
}

/* An element carrying the sentinel's pattern gets its lowest bit flipped (it stays a NaN). */
template <int DT> __device__ __forceinline__ uint4 canon(uint4 v) {
  if constexpr (Dt<DT>::kEs == 4) {
    v.x ^= (uint32_t)(v.x == SKV__SENT32);
    v.y ^= (uint32_t)(v.y == SKV__SENT32);
    v.z ^= (uint32_t)(v.z == SKV__SENT32);
    v.w ^= (uint32_t)(v.w == SKV__SENT32);
  } else {
    v.x ^= __vcmpeq2(v.x, SKV__SENT32) & 0x00010001u;
    v.y ^= __vcmpeq2(v.y, SKV__SENT32) & 0x00010001u;
    v.z ^= __vcmpeq2(v.z, SKV__SENT32) & 0x00010001u;
    v.w ^= __vcmpeq2(v.w, SKV__SENT32) & 0x00010001u;
  }
  return v;
}

template <int OP> __device__ __forceinline__ float op_apply(float a, float b) {
  if constexpr (OP == SKV_OP_SUM) return a + b;
  if constexpr (OP == SKV_OP_MAX) return fmaxf(a, b);
  return fminf(a, b);
}

/* acc op= v in float32; `first` initialises. Called in PE order 0..n-1 on every PE. */
template <int DT, int OP>
__device__ __forceinline__ void accumulate(float (&acc)[8], uint4 v, bool first) {
  float f[8];
  if constexpr (Dt<DT>::kEs == 4) {
    f[0] = __uint_as_float(v.x);
    f[1] = __uint_as_float(v.y);
    f[2] = __uint_as_float(v.z);
    f[3] = __uint_as_float(v.w);
    f[4] = f[5] = f[6] = f[7] = 0.f;
  } else {
    Dt<DT>::to_float(v.x, f[0], f[1]);
    Dt<DT>::to_float(v.y, f[2], f[3]);
    Dt<DT>::to_float(v.z, f[4], f[5]);
    Dt<DT>::to_float(v.w, f[6], f[7]);
  }
#pragma unroll
  for (int i = 0; i < Dt<DT>::kLanes; i++) acc[i] = first ? f[i] : op_apply<OP>(acc[i], f[i]);
}

template <int DT> __device__ __forceinline__ uint4 pack(const float (&acc)[8]) {
  if constexpr (Dt<DT>::kEs == 4) {
    return make_uint4(__float_as_uint(acc[0]), __float_as_uint(acc[1]), __float_as_uint(acc[2]),
                      __float_as_uint(acc[3]));
  } else {
    return make_uint4(Dt<DT>::from_float(acc[0], acc[1]), Dt<DT>::from_float(acc[2], acc[3]),
                      Dt<DT>::from_float(acc[4], acc[5]), Dt<DT>::from_float(acc[6], acc[7]));
  }
}

/* Vector v of a user buffer of `count` elements: one 16-byte access when aligned and whole,
 * else element by element with the part beyond the end reading as zero. */
template <int DT>
__device__ __forceinline__ uint4 load_in(const void *in, uint64_t v, uint64_t count, int aligned) {
  constexpr int L = Dt<DT>::kLanes;
  const uint64_t e0 = v * L;
  if ((aligned & 1) && e0 + L <= count)
    return (aligned & 2) ? __ldcs(reinterpret_cast<const uint4 *>(in) + v)
                         : reinterpret_cast<const uint4 *>(in)[v];
  uint32_t w[4] = {0u, 0u, 0u, 0u};
  if constexpr (Dt<DT>::kEs == 4) {
    const uint32_t *p = reinterpret_cast<const uint32_t *>(in);
#pragma unroll
    for (int i = 0; i < 4; i++)
      if (e0 + i < count) w[i] = p[e0 + i];
  } else {
    const uint16_t *p = reinterpret_cast<const uint16_t *>(in);
#pragma unroll
    for (int i = 0; i < 8; i++)
      if (e0 + i < count) w[i / 2] |= (uint32_t)p[e0 + i] << (16 * (i & 1));
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

template <int DT>
__device__ __forceinline__ void store_out(void *out, uint64_t v, uint64_t count, int aligned,
                                          uint4 x) {
  constexpr int L = Dt<DT>::kLanes;
  const uint64_t e0 = v * L;
  if ((aligned & 1) && e0 + L <= count) {
    if (aligned & 2)
      __stcs(reinterpret_cast<uint4 *>(out) + v, x);
    else
      reinterpret_cast<uint4 *>(out)[v] = x;
    return;
  }
  const uint32_t w[4] = {x.x, x.y, x.z, x.w};
  if constexpr (Dt<DT>::kEs == 4) {
    uint32_t *p = reinterpret_cast<uint32_t *>(out);
#pragma unroll
    for (int i = 0; i < 4; i++)
      if (e0 + i < count) p[e0 + i] = w[i];
  } else {
    uint16_t *p = reinterpret_cast<uint16_t *>(out);
#pragma unroll
    for (int i = 0; i < 8; i++)
      if (e0 + i < count) p[e0 + i] = (uint16_t)(w[i / 2] >> (16 * (i & 1)));
  }
}

/* ---- waiting with a timeout --------------------------------------------------------------- */

/* Spins are free until they last: the timer is read every 128 spins; a wait gives up after
 * the context's timeout, or at once once another thread gave up (`broken`). */
struct Waiter {
  uint64_t t0 = 0;
  uint32_t spins = 0;
  __device__ __forceinline__ bool keep(const skv__comm_dev_t &d) {
    if ((++spins & 127u) != 0u) return true;
    const uint64_t now = skv_dev_globaltimer();
    if (t0 == 0) {
      t0 = now;
      return true;
    }
    if (now - t0 > d.timeout_ns) return false;
    return ld_volatile_u32(d.broken) == 0u;
  }
  __device__ __forceinline__ uint64_t waited() const { return t0 ? skv_dev_globaltimer() - t0 : 0; }
};

/* Record the first failure of the comm (later ones only see `broken`). */
__device__ __noinline__ void report_impl(uint32_t *broken, skv__comm_err_t *e, int kind,
                                         int channel, int peer, int phase, int cmp, uint64_t slot,
                                         uint64_t epoch, uint64_t value, uint64_t observed,
                                         uint64_t waited) {
  if (atomicCAS(broken, 0u, 1u) != 0u) return;
  e->kind = kind;
  e->channel = channel;
  e->peer = peer;
  e->phase = phase;
  e->cmp = cmp;
  e->slot = slot;
  e->epoch = epoch;
  e->value = value;
  e->observed = observed;
  e->waited_ns = waited;
  __threadfence_system();
  e->code = SKV_ETIMEDOUT;
  __threadfence_system();
}
/* (Out of line and without the descriptor's address: the kernels keep no stack frame.) */
#define report(d, ...) report_impl((d).broken, (d).err, __VA_ARGS__)

/* Wait until no element of the slot is the sentinel; false on timeout. */
template <int DT>
__device__ __forceinline__ bool poll(const char *slot, uint4 &x, Waiter &w,
                                     const skv__comm_dev_t &d) {
  while (has_sent<DT>(x)) {
    if (!w.keep(d)) return false;
    x = ld_slot(slot);
  }
  return true;
}

/* Programmatic dependent launch: the next kernel of the stream may be scheduled now (it waits
 * for this one's completion in pdl_wait before touching memory), and this one waits for the
 * previous kernel's completion and memory flush. Without the launch attribute both are no-ops. */
__device__ __forceinline__ void pdl_start() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  asm volatile("griddepcontrol.wait;" ::: "memory");
}

/* Every thread reads its block's epoch lane (one broadcast load per warp) and the broken flag;
 * both loads overlap with the first input loads. */
__device__ __forceinline__ uint64_t read_epoch(const skv__chan_state_t *st) {
  return ld_volatile_u64(&st->epoch[blockIdx.x]);
}

/* Advance the epoch: block b writes lanes b, b+G, ... once all its threads read lane b. No
 * lane moves when a thread of the block failed (the comm is broken then anyway). */
__device__ __forceinline__ void block_finish(skv__chan_state_t *st, uint64_t e, bool failed) {
  if (__syncthreads_or(failed)) return;
  for (uint32_t i = blockIdx.x + threadIdx.x * gridDim.x; i < SKV__EPOCH_LANES;
       i += blockDim.x * gridDim.x)
    *(volatile uint64_t *)&st->epoch[i] = e + 1;
}

/* Poll peers' slots p = 0..n-1 (skipping `me`) at base + slot_off(p) and reduce them with
 * `own` in PE order. Up to SKV__MAX_UNROLL_PES PEs have all loads in flight at once. */
template <int DT, int OP, typename SlotOff>
__device__ __forceinline__ bool gather_reduce(const skv__comm_dev_t &d, const char *base,
                                              SlotOff slot_off, uint4 own, float (&acc)[8],
                                              Waiter &w, int &bad_pe) {
  const int n = d.npes, me = d.me;
  if (n <= SKV__MAX_UNROLL_PES) {
    uint4 y[SKV__MAX_UNROLL_PES];
#pragma unroll
    for (int p = 0; p < SKV__MAX_UNROLL_PES; p++)
      if (p < n && p != me) y[p] = ld_slot(base + slot_off(p));
#pragma unroll
    for (int p = 0; p < SKV__MAX_UNROLL_PES; p++) {
      if (p >= n) break;
      if (p == me) {
        accumulate<DT, OP>(acc, own, p == 0);
        continue;
      }
      const char *s = base + slot_off(p);
      if (!poll<DT>(s, y[p], w, d)) {
        bad_pe = p;
        return false;
      }
      st_slot(const_cast<char *>(s), sentinel());
      accumulate<DT, OP>(acc, y[p], p == 0);
    }
    return true;
  }
  for (int p = 0; p < n; p++) {
    uint4 y = own;
    if (p != me) {
      const char *s = base + slot_off(p);
      y = ld_slot(s);
      if (!poll<DT>(s, y, w, d)) {
        bad_pe = p;
        return false;
      }
      st_slot(const_cast<char *>(s), sentinel());
    }
    accumulate<DT, OP>(acc, y, p == 0);
  }
  return true;
}

/* ---- all-reduce --------------------------------------------------------------------------- */

template <int DT, int OP>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm)
    skv_k_allreduce_oneshot(skv__comm_dev_t d, int ch, const void *in, void *out, uint64_t count,
                            int aligned) {
  pdl_start();
  skv__chan_state_t *st = d.chan + ch;
  const uint64_t e = read_epoch(st);
  bool failed = ld_volatile_u32(d.broken) != 0u;
  const int n = d.npes, me = d.me;
  const uint64_t nvec = skv__nvec(count, Dt<DT>::kEs);
  const uint64_t roff = skv__region_off(d.scratch_off, d.chan_bytes, d.region_bytes, ch, e);
  const char *mine = d.base + (uint64_t)me * d.stride + roff;
  const uint64_t G = (uint64_t)gridDim.x * blockDim.x,
                 t = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
  /* push my vectors into slot `me` of every peer */
  for (uint64_t v = t; !failed && v < nvec; v += G) {
    const uint4 x = canon<DT>(load_in<DT>(in, v, count, aligned));
    for (int k = 1; k < n; k++) {
      const int p = me + k < n ? me + k : me + k - n;
      st_slot(d.base + (uint64_t)p * d.stride + roff + skv__os_slot(nvec, me, v), x);
    }
  }
  /* take every peer's vectors, clear their slots, reduce in PE order */
  Waiter w;
  for (uint64_t v = t; !failed && v < nvec; v += G) {
    const uint4 own = canon<DT>(load_in<DT>(in, v, count, aligned));
    float acc[8];
    int bad = -1;
    if (!gather_reduce<DT, OP>(
            d, mine, [&](int p) { return skv__os_slot(nvec, p, v); }, own, acc, w, bad)) {
      report(d, SKV__ERR_ALLREDUCE, ch, bad, SKV__PHASE_ONESHOT, -1, v, e, 0, 0, w.waited());
      failed = true;
      break;
    }
    store_out<DT>(out, v, count, aligned, pack<DT>(acc));
  }
  block_finish(st, e, failed);
}

/* Two-shot, one pass. Thread t takes vectors v = t, t + G, ... of every PE's range; each step
 * pushes the next vector's ranges (reduce-scatter), reduces this vector of my range and pushes
 * the result (all-gather), and writes out the previous vector's ranges from their owners'
 * all-gather slots: the NVLink pushes of one step overlap the local copies of the one before,
 * instead of all pushes, then all reductions, then all copies (which left NVLink idle while the
 * last copies ran). A wait depends only on a peer's earlier steps (the push of vector v comes a
 * step before its reduction, the all-gather of v a step before its copy), and the data is its
 * own flag, so steps need no barrier and any grid shape works on any PE. */
template <int DT, int OP>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm)
    skv_k_allreduce_twoshot(skv__comm_dev_t d, int ch, const void *in, void *out, uint64_t count,
                            int aligned) {
  pdl_start();
  skv__chan_state_t *st = d.chan + ch;
  const uint64_t e = read_epoch(st);
  bool failed = ld_volatile_u32(d.broken) != 0u;
  const int n = d.npes, me = d.me;
  const uint64_t nvec = skv__nvec(count, Dt<DT>::kEs), cv = skv__ts_cv(nvec, n);
  const uint64_t roff = skv__region_off(d.scratch_off, d.chan_bytes, d.region_bytes, ch, e);
  const char *mine = d.base + (uint64_t)me * d.stride + roff;
  const uint64_t G = (uint64_t)gridDim.x * blockDim.x,
                 t = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
  const uint64_t mv = skv__ts_valid(nvec, cv, me);
  /* 1: range j's vector v of my input into PE j's reduce-scatter slot `me` */
  auto scatter = [&](uint64_t v) {
    for (int k = 1; k < n; k++) {
      const int j = me + k < n ? me + k : me + k - n;
      if (v >= skv__ts_valid(nvec, cv, j)) continue;
      const uint4 x = canon<DT>(load_in<DT>(in, (uint64_t)j * cv + v, count, aligned));
      st_slot(d.base + (uint64_t)j * d.stride + roff + skv__ts_rs(cv, me, v), x);
    }
  };
  Waiter w;
  if (!failed && t < cv) scatter(t);
  for (uint64_t v = t; !failed && v < cv + G; v += G) {
    if (v + G < cv) scatter(v + G);
    /* 2: reduce my range's vector v in PE order; write it out and into every peer's all-gather
     * slot `me` */
    if (v < mv) {
      const uint64_t gv = (uint64_t)me * cv + v;
      const uint4 own = canon<DT>(load_in<DT>(in, gv, count, aligned));
      float acc[8];
      int bad = -1;
      if (!gather_reduce<DT, OP>(
              d, mine, [&](int p) { return skv__ts_rs(cv, p, v); }, own, acc, w, bad)) {
        report(d, SKV__ERR_ALLREDUCE, ch, bad, SKV__PHASE_RS, -1, gv, e, 0, 0, w.waited());
        failed = true;
        break;
      }
      const uint4 r = canon<DT>(pack<DT>(acc));
      store_out<DT>(out, gv, count, aligned, r);
      for (int k = 1; k < n; k++) {
        const int p = me + k < n ? me + k : me + k - n;
        st_slot(d.base + (uint64_t)p * d.stride + roff + skv__ts_ag(cv, n, me, v), r);
      }
    }
    /* 3: the previous vector of every other range, from its owner's all-gather slot */
    if (v < G) continue;
    const uint64_t u = v - G;
    for (int k = 1; k < n; k++) {
      const int j = me + k < n ? me + k : me + k - n;
      if (u >= skv__ts_valid(nvec, cv, j)) continue;
      const char *s = mine + skv__ts_ag(cv, n, j, u);
      uint4 y = ld_slot(s);
      if (!poll<DT>(s, y, w, d)) {
        report(d, SKV__ERR_ALLREDUCE, ch, j, SKV__PHASE_AG, -1, (uint64_t)j * cv + u, e, 0, 0,
               w.waited());
        failed = true;
        break;
      }
      st_slot(const_cast<char *>(s), sentinel());
      store_out<DT>(out, (uint64_t)j * cv + u, count, aligned, y);
    }
  }
  block_finish(st, e, failed);
}

/* ---- barrier, signal, wait ---------------------------------------------------------------- */

/* One block; thread q < npes exchanges with PE q. */
__global__ void skv_k_barrier(skv__comm_dev_t d, int ch) {
  pdl_start();
  skv__chan_state_t *st = d.chan + ch;
  const uint64_t e = ld_volatile_u64(&st->barrier_epoch) + 1;
  bool failed = ld_volatile_u32(d.broken) != 0u;
  const int q = threadIdx.x;
  if (!failed && q < d.npes && q != d.me) {
    skv_dev_store_release((uint64_t *)(d.base + (uint64_t)q * d.stride +
                                       skv__flag_off(d.flag_off, d.flag_chan_bytes, ch, d.me)),
                          e);
    const uint64_t *f = (const uint64_t *)(d.base + (uint64_t)d.me * d.stride +
                                           skv__flag_off(d.flag_off, d.flag_chan_bytes, ch, q));
    Waiter w;
    uint64_t have;
    while ((have = skv_dev_load_acquire(f)) < e) {
      if (!w.keep(d)) {
        report(d, SKV__ERR_BARRIER, ch, q, 0, SKV_CMP_GE, 0, e, e, have, w.waited());
        failed = true;
        break;
      }
    }
  }
  if (!__syncthreads_or(failed) && threadIdx.x == 0) *(volatile uint64_t *)&st->barrier_epoch = e;
}

/* Checking mode ("Checking mode" in kernels/comm_proto.h): one block; thread q < npes posts
 * this PE's call into its check slot on PE q and compares PE q's call with it. A mismatch is
 * recorded with code SKV_EMISMATCH (`phase`: 0 another call, 1 more calls on this channel, 2
 * waiting on another channel) and sets `broken`, so the call's own kernel, next on the stream,
 * does nothing. */
__device__ __noinline__ void report_check(uint32_t *broken, skv__comm_err_t *e, int channel,
                                          int peer, int how, uint64_t seq, uint64_t desc,
                                          uint64_t count, uint64_t peer_desc, uint64_t peer_count) {
  if (atomicCAS(broken, 0u, 1u) != 0u) return;
  e->kind = SKV__ERR_CHECK;
  e->channel = channel;
  e->peer = peer;
  e->phase = how;
  e->cmp = 0;
  e->slot = count;
  e->epoch = seq;
  e->value = peer_desc;
  e->observed = desc;
  e->waited_ns = peer_count;
  __threadfence_system();
  e->code = SKV_EMISMATCH;
  __threadfence_system();
}

__global__ void skv_k_check(skv__comm_dev_t d, int ch, uint64_t desc, uint64_t count) {
  pdl_start();
  skv__chan_state_t *st = d.chan + ch;
  const uint64_t s = ld_volatile_u64(&st->check_seq) + 1;
  bool failed = ld_volatile_u32(d.broken) != 0u;
  const int q = threadIdx.x;
  if (!failed && q < d.npes && q != d.me) {
    uint64_t *post = (uint64_t *)(d.base + (uint64_t)q * d.stride +
                                  skv__check_off(d.check_off, d.npes, ch, d.me));
    *(volatile uint64_t *)&post[1] = desc;
    *(volatile uint64_t *)&post[2] = count;
    skv_dev_store_release(&post[0], s);
    const uint64_t *slot = (const uint64_t *)(d.base + (uint64_t)d.me * d.stride +
                                              skv__check_off(d.check_off, d.npes, ch, q));
    Waiter w;
    const uint64_t t0 = skv_dev_globaltimer();
    for (;;) {
      const uint64_t seq = skv_dev_load_acquire(slot);
      if (seq >= s) {
        const uint64_t pd = ld_volatile_u64(&slot[1]), pc = ld_volatile_u64(&slot[2]);
        skv_dev_fence();
        if (ld_volatile_u64(&slot[0]) != seq) continue; /* posted again meanwhile */
        if (seq > s || pd != desc || pc != count) {
          report_check(d.broken, d.err, ch, q, seq > s ? 1 : 0, s, desc, count, pd, pc);
          failed = true;
        }
        break;
      }
      if ((w.spins & 1023u) == 1023u &&
          skv_dev_globaltimer() - t0 > (uint64_t)SKV__CHECK_CHANNEL_MS * 1000000ull) {
        bool other = false; /* has PE q posted a call on a channel this PE has not reached? */
        for (int c2 = 0; c2 < d.channels && !other; c2++) {
          if (c2 == ch) continue;
          const uint64_t *o = (const uint64_t *)(d.base + (uint64_t)d.me * d.stride +
                                                 skv__check_off(d.check_off, d.npes, c2, q));
          if (skv_dev_load_acquire(o) > ld_volatile_u64(&d.chan[c2].check_seq)) {
            report_check(d.broken, d.err, ch, q, 2, s, desc, count, ld_volatile_u64(&o[1]),
                         ld_volatile_u64(&o[2]));
            other = true;
          }
        }
        if (other) {
          failed = true;
          break;
        }
      }
      if (!w.keep(d)) {
        report(d, SKV__ERR_CHECK, ch, q, 0, 0, count, s, 0, desc, w.waited());
        failed = true;
        break;
      }
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) *(volatile uint64_t *)&st->check_seq = s;
}

__global__ void skv_k_signal(skv__comm_dev_t d, int pe, uint32_t slot, uint64_t value, int op) {
  pdl_start();
  uint64_t *p = (uint64_t *)(d.base + (uint64_t)pe * d.stride + d.signal_off + (uint64_t)slot * 8u);
  if (op == SKV_SIGNAL_ADD)
    skv_dev_add_release(p, value);
  else
    skv_dev_store_release(p, value);
}

__global__ void skv_k_wait(skv__comm_dev_t d, uint32_t slot, int cmp, uint64_t value) {
  pdl_start();
  const uint64_t *p =
      (const uint64_t *)(d.base + (uint64_t)d.me * d.stride + d.signal_off + (uint64_t)slot * 8u);
  Waiter w;
  uint64_t have;
  while (!skv_dev_cmp(have = skv_dev_load_acquire(p), cmp, value)) {
    if (!w.keep(d)) {
      report(d, SKV__ERR_WAIT, -1, -1, 0, cmp, slot, 0, value, have, w.waited());
      return;
    }
  }
}

/* ---- device API self-test and ping-pong --------------------------------------------------- */

__device__ __forceinline__ skv_dev_comm_t dev_comm(const skv__comm_dev_t &d) {
  skv_dev_comm_t c;
  c.base = d.base;
  c.stride = d.stride;
  c.signal_offset = d.signal_off;
  c.nslots = d.user_slots;
  c.my_pe = d.me;
  c.npes = d.npes;
  c.reserved = 0;
  c.timeout_ns = d.timeout_ns;
  return c;
}

__device__ __forceinline__ uint32_t pattern(int pe, int it, unsigned b, uint64_t i) {
  return (uint32_t)pe * 0x9e3779b1u ^ (uint32_t)it * 0x85ebca77u ^ b * 0xc2b2ae3du ^ (uint32_t)i;
}

/* buf: [blocks x bpb received][blocks x bpb to send]. Slots: puts arrived (slot_base), block
 * barrier (+1 .. +npes+1), grid barrier (+npes+2 .. +2*npes+3). */
__global__ void skv_k_devapi_selftest(skv__comm_dev_t d, uint32_t slot_base, int iters, char *buf,
                                      uint64_t bpb, int *errors) {
  const skv_dev_comm_t c = dev_comm(d);
  const int n = c.npes, me = c.my_pe, next = (me + 1) % n, prev = (me + n - 1) % n;
  const unsigned b = blockIdx.x, nb = gridDim.x;
  const uint32_t s_put = slot_base, s_blk = slot_base + 1, s_grid = slot_base + 2 + (uint32_t)n;
  char *recv = buf + (uint64_t)b * bpb, *send = buf + ((uint64_t)nb + b) * bpb;
  const uint64_t words = bpb / 4;
  for (int it = 0; it < iters; it++) {
    for (uint64_t i = threadIdx.x; i < words; i += blockDim.x)
      ((uint32_t *)send)[i] = pattern(me, it, b, i);
    __syncthreads();
    skv_dev_put_signal_block(c, next, recv, send, bpb, s_put, 1, SKV_SIGNAL_ADD);
    __shared__ int s_rc;
    if (threadIdx.x == 0) {
      uint64_t seen = 0;
      s_rc = skv_dev_wait_until(c, s_put, SKV_CMP_GE, (uint64_t)nb * (uint64_t)(it + 1), &seen);
      if (s_rc) atomicAdd(&errors[1], 1);
    }
    __syncthreads();
    if (s_rc) return;
    int bad = 0;
    for (uint64_t i = threadIdx.x; i < words; i += blockDim.x)
      bad += ((volatile uint32_t *)recv)[i] != pattern(prev, it, b, i);
    if (bad) atomicAdd(&errors[0], bad);
    if (b == 0 && skv_dev_barrier_block(c, s_blk) != 0) {
      if (threadIdx.x == 0) atomicAdd(&errors[1], 1);
      return;
    }
    if (skv_dev_barrier_grid(c, s_grid) != 0) {
      if (threadIdx.x == 0) atomicAdd(&errors[1], 1);
      return;
    }
  }
}

__global__ void skv_k_pingpong(skv__comm_dev_t d, int partner, uint32_t slot, uint64_t base,
                               int iters, unsigned long long *ns) {
  const skv_dev_comm_t c = dev_comm(d);
  const bool first = c.my_pe < partner;
  uint64_t t0 = 0;
  int fail = 0;
  for (int i = 1; i <= iters; i++) {
    const uint64_t v = base + (uint64_t)i;
    if (first) {
      skv_dev_signal_set(c, partner, slot, v);
      fail = skv_dev_wait_until(c, slot, SKV_CMP_GE, v, NULL);
    } else {
      fail = skv_dev_wait_until(c, slot, SKV_CMP_GE, v, NULL);
      if (!fail) skv_dev_signal_set(c, partner, slot, v);
    }
    if (fail) break;
    if (i == 1) t0 = skv_dev_globaltimer();
  }
  ns[0] = skv_dev_globaltimer() - t0;
  ns[1] = (unsigned long long)fail;
}

/* ---- launch ------------------------------------------------------------------------------- */

typedef void (*ar_kernel_t)(skv__comm_dev_t, int, const void *, void *, uint64_t, int);

template <int DT> ar_kernel_t pick(int alg, int op) {
  if (alg == SKV__ALG_ONESHOT) {
    if (op == SKV_OP_SUM) return skv_k_allreduce_oneshot<DT, SKV_OP_SUM>;
    if (op == SKV_OP_MAX) return skv_k_allreduce_oneshot<DT, SKV_OP_MAX>;
    return skv_k_allreduce_oneshot<DT, SKV_OP_MIN>;
  }
  if (op == SKV_OP_SUM) return skv_k_allreduce_twoshot<DT, SKV_OP_SUM>;
  if (op == SKV_OP_MAX) return skv_k_allreduce_twoshot<DT, SKV_OP_MAX>;
  return skv_k_allreduce_twoshot<DT, SKV_OP_MIN>;
}

ar_kernel_t pick_kernel(int alg, int dtype, int op) {
  switch (dtype) {
  case SKV_DTYPE_BF16:
    return pick<SKV_DTYPE_BF16>(alg, op);
  case SKV_DTYPE_FP16:
    return pick<SKV_DTYPE_FP16>(alg, op);
  default:
    return pick<SKV_DTYPE_FP32>(alg, op);
  }
}

/* Launch with the programmatic-stream-serialization attribute when d->pdl (kept in captures as
 * a programmatic edge), else as a plain stream-ordered launch. */
template <typename... Params, typename... Args>
int launch(const skv__comm_dev_t *d, void (*k)(Params...), dim3 grid, dim3 block, void *stream,
           Args... args) {
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute attr[1];
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = 0;
  cfg.stream = (cudaStream_t)stream;
  if (d->pdl && stream != NULL) { /* the default streams keep their plain semantics */
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
  }
  cudaError_t e = cudaLaunchKernelEx(&cfg, k, args...);
  if (e == cudaSuccess) e = cudaGetLastError();
  return (int)e;
}

} // namespace

extern "C" int skv__k_allreduce(const skv__comm_dev_t *d, int alg, int dtype, int op, int channel,
                                const void *in, void *out, uint64_t count, void *stream) {
  const uint32_t es = dtype == SKV_DTYPE_FP32 ? 4u : 2u;
  const uint64_t nvec = skv__nvec(count, es);
  const uint64_t work = alg == SKV__ALG_ONESHOT ? nvec : skv__ts_cv(nvec, d->npes);
  const int block = work >= (uint64_t)kThreads ? kThreads : (int)((work + 31) / 32 * 32);
  uint64_t grid = (work + (uint64_t)block - 1) / (uint64_t)block;
  const int32_t gc = count * es >= SKV__COMM_LARGE_BYTES ? d->grid_cap_large : d->grid_cap;
  uint64_t cap = (uint64_t)(gc > 0 ? gc : 1);
  if (cap > SKV__EPOCH_LANES) cap = SKV__EPOCH_LANES;
  if (grid > cap) grid = cap;
  if (grid < 1) grid = 1;
  /* bit 0: 16-byte aligned; bit 1: stream the caller's buffers past L2 (evict first), which
   * leaves L2 to the slots the peers write and this PE reads next */
  const int aligned = (((((uintptr_t)in) | ((uintptr_t)out)) & 15u) == 0) |
                      (d->stream_hints && count * es >= SKV__COMM_LARGE_BYTES ? 2 : 0);
  return launch(d, pick_kernel(alg, dtype, op), dim3((unsigned)grid), dim3(block), stream, *d,
                channel, in, out, count, aligned);
}

extern "C" int skv__k_barrier(const skv__comm_dev_t *d, int channel, void *stream) {
  const int threads = (d->npes + 31) / 32 * 32;
  return launch(d, skv_k_barrier, dim3(1), dim3(threads), stream, *d, channel);
}

extern "C" int skv__k_check(const skv__comm_dev_t *d, int channel, uint64_t desc, uint64_t count,
                            void *stream) {
  const int threads = (d->npes + 31) / 32 * 32;
  return launch(d, skv_k_check, dim3(1), dim3(threads), stream, *d, channel, desc, count);
}

extern "C" int skv__k_signal(const skv__comm_dev_t *d, int pe, uint32_t slot, uint64_t value,
                             int op, void *stream) {
  return launch(d, skv_k_signal, dim3(1), dim3(1), stream, *d, pe, slot, value, op);
}

extern "C" int skv__k_wait(const skv__comm_dev_t *d, uint32_t slot, int cmp, uint64_t value,
                           void *stream) {
  return launch(d, skv_k_wait, dim3(1), dim3(1), stream, *d, slot, cmp, value);
}

extern "C" int skv__k_preload(void) {
  const void *fns[] = {
      (const void *)pick_kernel(SKV__ALG_ONESHOT, SKV_DTYPE_BF16, SKV_OP_SUM),
      (const void *)pick_kernel(SKV__ALG_ONESHOT, SKV_DTYPE_BF16, SKV_OP_MAX),
      (const void *)pick_kernel(SKV__ALG_ONESHOT, SKV_DTYPE_BF16, SKV_OP_MIN),
      (const void *)pick_kernel(SKV__ALG_ONESHOT, SKV_DTYPE_FP16, SKV_OP_SUM),
      (const void *)pick_kernel(SKV__ALG_ONESHOT, SKV_DTYPE_FP16, SKV_OP_MAX),
      (const void *)pick_kernel(SKV__ALG_ONESHOT, SKV_DTYPE_FP16, SKV_OP_MIN),
      (const void *)pick_kernel(SKV__ALG_ONESHOT, SKV_DTYPE_FP32, SKV_OP_SUM),
      (const void *)pick_kernel(SKV__ALG_ONESHOT, SKV_DTYPE_FP32, SKV_OP_MAX),
      (const void *)pick_kernel(SKV__ALG_ONESHOT, SKV_DTYPE_FP32, SKV_OP_MIN),
      (const void *)pick_kernel(SKV__ALG_TWOSHOT, SKV_DTYPE_BF16, SKV_OP_SUM),
      (const void *)pick_kernel(SKV__ALG_TWOSHOT, SKV_DTYPE_BF16, SKV_OP_MAX),
      (const void *)pick_kernel(SKV__ALG_TWOSHOT, SKV_DTYPE_BF16, SKV_OP_MIN),
      (const void *)pick_kernel(SKV__ALG_TWOSHOT, SKV_DTYPE_FP16, SKV_OP_SUM),
      (const void *)pick_kernel(SKV__ALG_TWOSHOT, SKV_DTYPE_FP16, SKV_OP_MAX),
      (const void *)pick_kernel(SKV__ALG_TWOSHOT, SKV_DTYPE_FP16, SKV_OP_MIN),
      (const void *)pick_kernel(SKV__ALG_TWOSHOT, SKV_DTYPE_FP32, SKV_OP_SUM),
      (const void *)pick_kernel(SKV__ALG_TWOSHOT, SKV_DTYPE_FP32, SKV_OP_MAX),
      (const void *)pick_kernel(SKV__ALG_TWOSHOT, SKV_DTYPE_FP32, SKV_OP_MIN),
      (const void *)skv_k_barrier,
      (const void *)skv_k_check,
      (const void *)skv_k_signal,
      (const void *)skv_k_wait,
      (const void *)skv_k_devapi_selftest,
      (const void *)skv_k_pingpong,
  };
  for (size_t i = 0; i < sizeof fns / sizeof fns[0]; i++) {
    cudaFuncAttributes a;
    cudaError_t e = cudaFuncGetAttributes(&a, fns[i]);
    if (e != cudaSuccess) return (int)e;
  }
  return 0;
}

extern "C" int skv__k_devapi_selftest(const skv__comm_dev_t *d, uint32_t slot_base, int iters,
                                      int blocks, void *buf, uint64_t bytes_per_block, int *errors,
                                      void *stream) {
  skv_k_devapi_selftest<<<blocks, 256, 0, (cudaStream_t)stream>>>(*d, slot_base, iters, (char *)buf,
                                                                  bytes_per_block, errors);
  return (int)cudaGetLastError();
}

extern "C" int skv__k_pingpong(const skv__comm_dev_t *d, int partner, uint32_t slot, uint64_t base,
                               int iters, unsigned long long *ns, void *stream) {
  skv_k_pingpong<<<1, 1, 0, (cudaStream_t)stream>>>(*d, partner, slot, base, iters, ns);
  return (int)cudaGetLastError();
}
