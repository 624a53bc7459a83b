/* Tensor-parallel collectives: the public API, argument checks, the algorithm choice, and the
 * host backend, which runs the GPU's flag protocols with the CPU over a host heap. */
#define _GNU_SOURCE
#include "comm/comm.h"

#include <inttypes.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define DEFAULT_CHANNELS  4u
#define DEFAULT_MAX_BYTES (64ull << 20)
#define MAX_MAX_BYTES     (16ull << 30)
#define CUDA_CHUNK_BYTES  (4ull << 20) /* most bytes one Lamport launch carries (two-shot) */
#define HOST_CHUNK_BYTES  (1ull << 20)
#define MIN_REGION_BYTES  (64ull << 10)

/* ---- names -------------------------------------------------------------------------------- */

const char *skv__dtype_name(int dtype) {
  switch (dtype) {
  case SKV_DTYPE_BF16:
    return "bf16";
  case SKV_DTYPE_FP16:
    return "fp16";
  case SKV_DTYPE_FP32:
    return "fp32";
  default:
    return "?";
  }
}
const char *skv__op_name(int op) {
  switch (op) {
  case SKV_OP_SUM:
    return "sum";
  case SKV_OP_MAX:
    return "max";
  case SKV_OP_MIN:
    return "min";
  default:
    return "?";
  }
}
const char *skv__algo_name(int algo) {
  switch (algo) {
  case SKV_ALGO_AUTO:
    return "auto";
  case SKV_ALGO_ONESHOT:
    return "oneshot";
  case SKV_ALGO_TWOSHOT:
    return "twoshot";
  case SKV_ALGO_NCCL:
    return "nccl";
  default:
    return "?";
  }
}

/* ---- half-precision conversions ---------------------------------------------------------- */

float skv__bf16_to_float(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

uint16_t skv__float_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fffu; /* NaN: the GPU's canonical one */
  u += 0x7fffu + ((u >> 16) & 1u);                     /* round to nearest, ties to even */
  return (uint16_t)(u >> 16);
}

float skv__fp16_to_float(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, u;
  if (exp == 0) {
    if (man == 0) {
      u = sign;
    } else { /* subnormal: normalise */
      uint32_t e = 127 - 15 + 1;
      while (!(man & 0x400u)) {
        man <<= 1;
        e--;
      }
      u = sign | (e << 23) | ((man & 0x3ffu) << 13);
    }
  } else if (exp == 31) {
    u = sign | 0x7f800000u | (man << 13);
  } else {
    u = sign | ((exp + 112u) << 23) | (man << 13);
  }
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

uint16_t skv__float_to_fp16(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return 0x7fffu;                     /* NaN: the GPU's canonical one */
  if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* 65520 and up round to infinity */
  if (a < 0x38800000u) {                                   /* below 2^-14: subnormal or zero */
    uint32_t exp = a >> 23;
    if (exp < 102) return sign; /* below 2^-25 */
    uint32_t man = (a & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126 - exp, r = man >> shift, rem = man & ((1u << shift) - 1),
             half = 1u << (shift - 1);
    if (rem > half || (rem == half && (r & 1u))) r++;
    return (uint16_t)(sign | r);
  }
  uint32_t r = a + 0xfffu + ((a >> 13) & 1u);
  return (uint16_t)(sign | ((r - 0x38000000u) >> 13));
}

/* ---- algorithm choice --------------------------------------------------------------------- */

/* Crossovers of the CUDA backend by PE count, from symkv-bench allreduce on the GPU hosts (it
 * prints the measured values as "crossover" rows). A count between rows uses the row below.
 * 2 PEs: measured on nvidia-h200-x2 (bench/results/allreduce_nvidia-h200-x2.json). 4 and 8 PEs:
 * not measured (no 4- or 8-GPU host was lent), a conservative guess that keeps one-shot, whose
 * traffic grows with the PE count, to small messages. */
static const struct {
  int npes;
  uint64_t oneshot_max, twoshot_max;
} cuda_crossovers[] = {
    {2, 2ull << 20, 32ull << 20},
    {4, 256ull << 10, 4ull << 20},
    {8, 64ull << 10, 2ull << 20},
};

static int env_bytes(skv__env_id_t id, uint64_t *v) {
  const char *name = skv__env_name(id);
  const char *s = skv__env(id);
  if (!s || !*s) return 0;
  long long x;
  if (!skv__parse_int(s, 0, 1ll << 40, true, &x))
    return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_COMM, "%s=%s is not a byte count (e.g. 256K, 4M)", name,
                    s);
  *v = (uint64_t)x;
  SKV_INFO(SKV_SUBSYS_COMM, "%s=%s: AUTO crossover overridden", name, s);
  return 0;
}

static int crossovers(skv_comm_t *c) {
  if (c->backend == SKV_BACKEND_HOST) {
    c->oneshot_max = 32ull << 10;
    c->twoshot_max = UINT64_MAX;
  } else {
    size_t row = 0;
    for (size_t i = 0; i < SKV_ARRAY_LEN(cuda_crossovers); i++)
      if (cuda_crossovers[i].npes <= c->npes) row = i;
    c->oneshot_max = cuda_crossovers[row].oneshot_max;
    c->twoshot_max = cuda_crossovers[row].twoshot_max;
  }
  SKV_CHECK(env_bytes(SKV_ENV_ALLREDUCE_ONESHOT_MAX, &c->oneshot_max));
  SKV_CHECK(env_bytes(SKV_ENV_ALLREDUCE_TWOSHOT_MAX, &c->twoshot_max));
  return 0;
}

int skv__comm_choose(const skv_comm_t *c, uint64_t bytes) {
  if (bytes <= c->oneshot_max && bytes <= c->max_bytes) return SKV_ALGO_ONESHOT;
  if (c->has_nccl && (bytes > c->twoshot_max || bytes > c->max_bytes)) return SKV_ALGO_NCCL;
  return SKV_ALGO_TWOSHOT;
}

/* ---- create / destroy --------------------------------------------------------------------- */

int skv_comm_create(skv_ctx_t *ctx, const skv_comm_opts_t *opts, skv_comm_t **out) {
  SKV_ARG_CHECK(ctx && out, SKV_SUBSYS_COMM, "skv_comm_create: ctx and comm must be non-NULL");
  *out = NULL;
  skv_comm_opts_t o = SKV_COMM_OPTS_INIT;
  if (opts) {
    SKV_ARG_CHECK(
        opts->size >= sizeof(skv_comm_opts_t) && opts->version >= 1 &&
            opts->version <= SKV_COMM_OPTS_VERSION,
        SKV_SUBSYS_COMM,
        "skv_comm_create: opts.size=%zu / opts.version=%u: initialise with SKV_COMM_OPTS_INIT",
        opts->size, opts->version);
    o = *opts;
  }
  if (o.backend == SKV_BACKEND_CUDA) {
#ifndef SKV_WITH_CUDA
    return SKV_FAIL(
        SKV_ENOTSUP, SKV_SUBSYS_COMM,
        "skv_comm_create: backend cuda needs a build with CUDA (configure with -DSKV_CUDA=ON); "
        "SKV_BACKEND_HOST runs the same protocols on the CPU");
#endif
  } else if (o.backend != SKV_BACKEND_HOST) {
    return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_COMM,
                    "skv_comm_create: opts.backend=%d is not SKV_BACKEND_CUDA or SKV_BACKEND_HOST",
                    o.backend);
  }
  if (o.channels == 0) o.channels = DEFAULT_CHANNELS;
  SKV_ARG_CHECK(o.channels <= SKV_COMM_MAX_CHANNELS, SKV_SUBSYS_COMM,
                "skv_comm_create: opts.channels=%u is not in 1..%d", o.channels,
                SKV_COMM_MAX_CHANNELS);
  SKV_ARG_CHECK(
      (o.flags & ~(uint32_t)SKV_COMM_NO_NCCL) == 0, SKV_SUBSYS_COMM,
      "skv_comm_create: opts.flags=0x%x has unknown bits (only SKV_COMM_NO_NCCL is defined)",
      o.flags);
  if (o.max_bytes == 0) o.max_bytes = DEFAULT_MAX_BYTES;
  SKV_ARG_CHECK(o.max_bytes >= 16 && o.max_bytes <= MAX_MAX_BYTES, SKV_SUBSYS_COMM,
                "skv_comm_create: opts.max_bytes=%" PRIu64 " is not in 16..%" PRIu64, o.max_bytes,
                (uint64_t)MAX_MAX_BYTES);
  if (ctx->nlocal != ctx->cfg.world_size)
    return SKV_FAIL(
        SKV_ENOTSUP, SKV_SUBSYS_COMM,
        "skv_comm_create: the job spans %d PEs but only %d are on this node; the symmetric "
        "collectives work within one node (use NCCL across nodes)",
        ctx->cfg.world_size, ctx->nlocal);

  skv_comm_t *c = calloc(1, sizeof *c);
  if (!c) return SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_COMM, "skv_comm_create: out of memory");
  c->ctx = ctx;
  c->backend = o.backend;
  c->npes = ctx->nlocal;
  c->me = ctx->local_index;
  c->channels = o.channels;
  c->flags = o.flags;
  c->max_bytes = o.max_bytes;
  /* A bad SKV_ALLREDUCE_*_MAX on one PE goes into the collective check below, so that the
   * others fail with it at once instead of waiting there for the timeout. */
  int rc = crossovers(c);
  char env_err[400] = "";
  if (rc < 0) snprintf(env_err, sizeof env_err, "%s", skv_last_error());
  /* Layout: [user slots | barrier flags per channel] in the signal pad, two Lamport regions
   * per channel in the scratch, max_bytes of data for buffers used in place. */
  c->user_slots = SKV__USER_SLOTS;
  c->flag_chan_bytes = SKV_ALIGN_UP((uint64_t)c->npes * 8u, 128u);
  uint64_t chunk =
      SKV_MIN(c->max_bytes, c->backend == SKV_BACKEND_HOST ? HOST_CHUNK_BYTES : CUDA_CHUNK_BYTES);
  c->region_bytes = SKV_ALIGN_UP(SKV_MAX(2 * chunk, MIN_REGION_BYTES), 4096u);
  c->chan_bytes = SKV__LAMPORT_REGIONS * c->region_bytes;
  skv_heap_opts_t ho = SKV_HEAP_OPTS_INIT;
  ho.backend = c->backend;
  ho.data_bytes = c->max_bytes;
  ho.signal_bytes =
      SKV_ALIGN_UP((uint64_t)c->user_slots * 8u + c->channels * c->flag_chan_bytes, 256u);
  ho.scratch_bytes = c->channels * c->chan_bytes;
  bool want_nccl = c->backend == SKV_BACKEND_CUDA && !(c->flags & SKV_COMM_NO_NCCL);
  const char *ne = skv__env(SKV_ENV_NCCL_ALLREDUCE);
  if (ne && strcmp(ne, "0") == 0) want_nccl = false;
#ifdef SKV_WITH_CUDA
  if (rc == 0 && c->backend == SKV_BACKEND_CUDA && (rc = skv__comm_cuda_precheck(ctx)) < 0) {
    free(c);
    return rc;
  }
#endif
  int rc_env = rc;
  rc =
      skv__coll_check(ctx, NULL,
                      "skv_comm_create(backend=%s, channels=%u, max_bytes=%" PRIu64
                      ", nccl=%d, oneshot_max=%" PRIu64 ", twoshot_max=%" PRIu64 "%s%s)",
                      skv__backend_name(c->backend), c->channels, c->max_bytes, (int)want_nccl,
                      c->oneshot_max, c->twoshot_max, rc_env < 0 ? ", failed here: " : "", env_err);
  if (rc_env < 0 || rc < 0) {
    free(c);
    return rc_env < 0 ? SKV_FAIL(rc_env, SKV_SUBSYS_COMM, "%s", env_err) : rc;
  }
  if (!want_nccl) c->flags |= SKV_COMM_NO_NCCL;
  rc = skv_heap_create_ex(ctx, &ho, &c->heap);
  if (rc < 0) {
    free(c);
    return rc;
  }
  c->flag_off = c->heap->info.signal_offset + (uint64_t)c->user_slots * 8u;
  c->scratch_off = c->heap->info.scratch_offset;
  if (c->backend == SKV_BACKEND_HOST) {
    /* Every Lamport slot starts out as the sentinel; the pad starts at zero (fresh memfd). */
    memset(skv__comm_addr(c, c->me, c->scratch_off), 0xff, c->channels * c->chan_bytes);
    c->hchan = calloc(c->channels, sizeof *c->hchan);
    if (!c->hchan) rc = SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_COMM, "skv_comm_create: out of memory");
  } else {
#ifdef SKV_WITH_CUDA
    rc = skv__comm_cuda_create(c);
#endif
  }
  /* Every PE learns whether every PE is ready (so that all keep or all drop the comm), and no
   * PE pushes into a peer's regions before that peer has filled them with the sentinel. */
  char why[512];
  snprintf(why, sizeof why, "%s", rc < 0 ? skv_last_error() : "");
  int32_t mine = rc, all[SKV_MAX_LOCAL_PES];
  int rc2 = skv_ctx_allgather(ctx, &mine, all, sizeof mine);
  if (rc == 0 && rc2 < 0) {
    rc = rc2;
    snprintf(why, sizeof why, "%s", skv_last_error());
  }
  for (int r = 0; rc == 0 && r < c->npes; r++)
    if (all[r] < 0) {
      rc = all[r];
      snprintf(why, sizeof why, "PE %d failed to set up its part (%s); its log says why", r,
               skv_err_name(all[r]));
    }
  if (rc < 0) {
#ifdef SKV_WITH_CUDA
    if (c->backend == SKV_BACKEND_CUDA) skv__comm_cuda_destroy(c);
#endif
    skv_heap_destroy(c->heap);
    free(c->hchan);
    free(c);
    return SKV_FAIL(rc, SKV_SUBSYS_COMM, "skv_comm_create failed: %s", why);
  }
  char b1[32], b2[32];
  SKV_INFO(SKV_SUBSYS_COMM,
           "comm: backend %s, %d PEs, %u channels, regions of %s, max message %s, nccl %s, AUTO "
           "one-shot <= %" PRIu64 " B, two-shot <= %" PRIu64 " B",
           skv__backend_name(c->backend), c->npes, c->channels,
           skv__fmt_bytes(c->region_bytes, b1, sizeof b1),
           skv__fmt_bytes(c->max_bytes, b2, sizeof b2), c->has_nccl ? "yes" : "no", c->oneshot_max,
           c->twoshot_max);
  *out = c;
  return 0;
}

int skv_comm_destroy(skv_comm_t *comm) {
  if (!comm) return 0;
  int rc = 0;
#ifdef SKV_WITH_CUDA
  if (comm->backend == SKV_BACKEND_CUDA) rc = skv__comm_cuda_destroy(comm);
  if (rc == SKV_ECAPTURE) return rc; /* nothing was freed: the caller may retry after the capture */
#endif
  int rc2 = skv_heap_destroy(comm->heap);
  free(comm->hchan);
  free(comm);
  return rc ? rc : rc2;
}

skv_heap_t *skv_comm_get_heap(const skv_comm_t *comm) {
  if (!comm) {
    SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_COMM, "skv_comm_get_heap: comm is NULL");
    return NULL;
  }
  return comm->heap;
}

int skv_comm_get_signal_slots(const skv_comm_t *comm) {
  SKV_ARG_CHECK(comm, SKV_SUBSYS_COMM, "skv_comm_get_signal_slots: comm is NULL");
  return (int)comm->user_slots;
}

/* ---- the host backend --------------------------------------------------------------------- */

/* How the flag protocols work (the same on the GPU, kernels/comm.cu; here with one CPU thread
 * per PE and 16-byte vectors written as two 8-byte atomic words):
 *
 * All-reduce (Lamport, no barrier). Each channel has two regions of Lamport slots in every
 * PE's scratch, used by epoch parity; the epoch counts the channel's all-reduce launches and
 * lives with the PE (device memory on the GPU, advanced by the kernel itself). Every slot
 * holds the sentinel (all bits set in every element) unless it carries data of the current
 * epoch.
 *  - One-shot: PE p stores its input vector v, canonicalised (an element equal to the sentinel
 *    gets its lowest bit flipped: still a NaN), into slot (p, v) of region e%2 of every peer.
 *    Each PE polls its own slots (q, v) until no element is the sentinel, puts the sentinel
 *    back (clear after read), and reduces the n vectors in PE order 0..n-1 in float32.
 *  - Two-shot: vector range j of the message belongs to PE j. PE p pushes range j to PE j's
 *    reduce-scatter slot (p, v); PE j polls those, reduces in PE order, canonicalises the
 *    result, writes its own output and pushes the result to every PE's all-gather slot (j, v);
 *    every PE polls the all-gather slots and writes them out.
 *  Every slot a peer writes into my region is read and cleared by me in the same epoch, so a
 *  region is clean when the epoch ends. A peer is at most one epoch ahead of me (finishing
 *  epoch e needs my epoch-e data), so while I run epoch e peers write only regions e%2 and
 *  (e+1)%2, and (e+1)%2 was cleared during my epoch e-1, which completed before I pushed any
 *  data of epoch e. Hence two regions suffice and no flag ever needs resetting.
 *  Every PE reduces the same values in the same order (two-shot: one PE reduces, everyone
 *  copies), so the results are bitwise identical everywhere.
 *
 * Barrier: PE p stores the channel's barrier epoch e into flag (c, p) of every peer with
 * release semantics, then waits (acquire) until its own flags (c, q) are >= e for every q.
 * Flags only grow, so nothing is reset; a PE cannot reach e+1 before every PE reached e.
 *
 * What can go wrong:
 *  - A peer that never arrives: every wait gives up after the context's timeout and fails
 *    with SKV_ETIMEDOUT naming the PE and slot. Slots may then hold data that nobody clears,
 *    so the comm is marked broken: later calls fail with SKV_ESTATE; destroy it everywhere.
 *  - PEs that call with different counts, dtypes or channels: slots are polled that nobody
 *    writes (timeout) or data is left behind. The collectives are not checked on the fast
 *    path; every PE must make the same calls in the same order on a channel.
 *  - Two threads on one channel at once: they share the epoch; use one channel per thread
 *    (GPU: per stream).
 *  - The sentinel changes inputs that carry exactly its pattern (a NaN stays a NaN). */

typedef union hvec {
  uint64_t w[2];
  uint32_t s[4];
  uint16_t h[8];
} hvec_t;

typedef struct host_wait {
  uint64_t deadline_ns;
  uint32_t spins;
} host_wait_t;

static host_wait_t host_wait_start(const skv_comm_t *c) {
  host_wait_t w = {skv__now_ns() + (uint64_t)c->ctx->cfg.timeout_ms * 1000000ull, 0};
  return w;
}

/* false once the deadline passed. Spinning PEs may outnumber the cores: yield often. */
static bool host_keep_waiting(host_wait_t *w) {
  w->spins++;
  if ((w->spins & 15u) == 0) sched_yield();
  if ((w->spins & 255u) == 0 && skv__now_ns() > w->deadline_ns) return false;
  return true;
}

static bool hvec_has_sent(const hvec_t *x, uint32_t es) {
  if (es == 4)
    return x->s[0] == SKV__SENT32 || x->s[1] == SKV__SENT32 || x->s[2] == SKV__SENT32 ||
           x->s[3] == SKV__SENT32;
  for (int i = 0; i < 8; i++)
    if (x->h[i] == 0xffffu) return true;
  return false;
}

static void hvec_canon(hvec_t *x, uint32_t es) {
  if (es == 4) {
    for (int i = 0; i < 4; i++) x->s[i] ^= (uint32_t)(x->s[i] == SKV__SENT32);
  } else {
    for (int i = 0; i < 8; i++) x->h[i] ^= (uint16_t)(x->h[i] == 0xffffu);
  }
}

/* Vector v of a buffer of `count` elements; the part beyond the end reads as zero. */
static void hvec_load(hvec_t *x, const void *buf, uint64_t v, uint64_t count, uint32_t es) {
  uint64_t off = v * SKV__VEC, end = count * es;
  x->w[0] = x->w[1] = 0;
  memcpy(x, (const char *)buf + off, end - off < SKV__VEC ? end - off : SKV__VEC);
}

static void hvec_store(void *buf, const hvec_t *x, uint64_t v, uint64_t count, uint32_t es) {
  uint64_t off = v * SKV__VEC, end = count * es;
  memcpy((char *)buf + off, x, end - off < SKV__VEC ? end - off : SKV__VEC);
}

/* Pushes release and polls acquire: a peer that took my epoch-e data also sees every clear I
 * made before, so its epoch e+1 writes into a region come after my clears there. (The GPU gets
 * the same order from the kernel boundary between epochs.) */
static void slot_put(char *slot, const hvec_t *x) {
  uint64_t *w = (uint64_t *)slot;
  __atomic_store_n(&w[0], x->w[0], __ATOMIC_RELEASE);
  __atomic_store_n(&w[1], x->w[1], __ATOMIC_RELEASE);
}

/* Wait until slot holds no sentinel element, take it, and put the sentinel back. */
static bool slot_take(char *slot, hvec_t *x, uint32_t es, host_wait_t *w) {
  uint64_t *p = (uint64_t *)slot;
  for (;;) {
    x->w[0] = __atomic_load_n(&p[0], __ATOMIC_ACQUIRE);
    x->w[1] = __atomic_load_n(&p[1], __ATOMIC_ACQUIRE);
    if (!hvec_has_sent(x, es)) break;
    if (!host_keep_waiting(w)) return false;
  }
  __atomic_store_n(&p[0], UINT64_MAX, __ATOMIC_RELAXED);
  __atomic_store_n(&p[1], UINT64_MAX, __ATOMIC_RELAXED);
  return true;
}

/* acc (lanes as float) op= x, in PE order; `first` initialises. */
static void hvec_accumulate(float *acc, const hvec_t *x, int dtype, int op, bool first) {
  int lanes = dtype == SKV_DTYPE_FP32 ? 4 : 8;
  for (int i = 0; i < lanes; i++) {
    float y;
    if (dtype == SKV_DTYPE_FP32)
      memcpy(&y, &x->s[i], sizeof y);
    else if (dtype == SKV_DTYPE_BF16)
      y = skv__bf16_to_float(x->h[i]);
    else
      y = skv__fp16_to_float(x->h[i]);
    if (first)
      acc[i] = y;
    else if (op == SKV_OP_SUM)
      acc[i] = acc[i] + y;
    else if (op == SKV_OP_MAX) /* like fmaxf / fminf: a NaN operand loses */
      acc[i] = (y > acc[i] || acc[i] != acc[i]) ? y : acc[i];
    else
      acc[i] = (y < acc[i] || acc[i] != acc[i]) ? y : acc[i];
  }
}

static void hvec_from_acc(hvec_t *x, const float *acc, int dtype) {
  if (dtype == SKV_DTYPE_FP32) {
    memcpy(x->s, acc, 16);
  } else {
    for (int i = 0; i < 8; i++)
      x->h[i] = dtype == SKV_DTYPE_BF16 ? skv__float_to_bf16(acc[i]) : skv__float_to_fp16(acc[i]);
  }
}

static int host_timeout(skv_comm_t *c, const char *what, int channel, uint64_t epoch, int peer,
                        uint64_t v) {
  __atomic_store_n(&c->broken, true, __ATOMIC_RELAXED);
  return SKV_FAIL(
      SKV_ETIMEDOUT, SKV_SUBSYS_COMM,
      "skv_comm_allreduce (%s, channel %d, epoch %" PRIu64 "): PE %d did not deliver vector %" PRIu64
      " within %d ms; is it alive and making the same calls (count, dtype, channel)? The comm is "
      "unusable now: destroy it on every PE",
      what, channel, epoch, peer, v, c->ctx->cfg.timeout_ms);
}

static int host_oneshot(skv_comm_t *c, const void *in, void *out, uint64_t count, int dtype, int op,
                        int ch) {
  uint32_t es = skv__dtype_size(dtype);
  int n = c->npes, me = c->me;
  uint64_t e = c->hchan[ch].epoch, nvec = skv__nvec(count, es);
  uint64_t roff = c->scratch_off + (uint64_t)ch * c->chan_bytes + (e & 1u) * c->region_bytes;
  char *mine = skv__comm_addr(c, me, roff);
  hvec_t x;
  for (uint64_t v = 0; v < nvec; v++) {
    hvec_load(&x, in, v, count, es);
    hvec_canon(&x, es);
    for (int k = 1; k < n; k++) {
      int p = (me + k) % n;
      slot_put(skv__comm_addr(c, p, roff + skv__os_slot(nvec, me, v)), &x);
    }
  }
  host_wait_t w = host_wait_start(c);
  float acc[8];
  for (uint64_t v = 0; v < nvec; v++) {
    for (int j = 0; j < n; j++) {
      if (j == me) {
        hvec_load(&x, in, v, count, es);
        hvec_canon(&x, es);
      } else if (!slot_take(mine + skv__os_slot(nvec, j, v), &x, es, &w)) {
        return host_timeout(c, "one-shot", ch, e, j, v);
      }
      hvec_accumulate(acc, &x, dtype, op, j == 0);
    }
    hvec_from_acc(&x, acc, dtype);
    hvec_store(out, &x, v, count, es);
  }
  c->hchan[ch].epoch = e + 1;
  return 0;
}

static int host_twoshot(skv_comm_t *c, const void *in, void *out, uint64_t count, int dtype, int op,
                        int ch) {
  uint32_t es = skv__dtype_size(dtype);
  int n = c->npes, me = c->me;
  uint64_t e = c->hchan[ch].epoch, nvec = skv__nvec(count, es), cv = skv__ts_cv(nvec, n);
  uint64_t roff = c->scratch_off + (uint64_t)ch * c->chan_bytes + (e & 1u) * c->region_bytes;
  char *mine = skv__comm_addr(c, me, roff);
  hvec_t x;
  /* 1: push range j to PE j's reduce-scatter slots */
  for (int k = 1; k < n; k++) {
    int j = (me + k) % n;
    uint64_t valid = skv__ts_valid(nvec, cv, j);
    for (uint64_t v = 0; v < valid; v++) {
      hvec_load(&x, in, (uint64_t)j * cv + v, count, es);
      hvec_canon(&x, es);
      slot_put(skv__comm_addr(c, j, roff + skv__ts_rs(cv, me, v)), &x);
    }
  }
  /* 2: reduce my range in PE order, write it out, push it to every PE's all-gather slots */
  host_wait_t w = host_wait_start(c);
  float acc[8];
  uint64_t mv = skv__ts_valid(nvec, cv, me);
  for (uint64_t v = 0; v < mv; v++) {
    uint64_t gv = (uint64_t)me * cv + v;
    for (int p = 0; p < n; p++) {
      if (p == me) {
        hvec_load(&x, in, gv, count, es);
        hvec_canon(&x, es);
      } else if (!slot_take(mine + skv__ts_rs(cv, p, v), &x, es, &w)) {
        return host_timeout(c, "two-shot reduce-scatter", ch, e, p, gv);
      }
      hvec_accumulate(acc, &x, dtype, op, p == 0);
    }
    hvec_from_acc(&x, acc, dtype);
    hvec_canon(&x, es);
    hvec_store(out, &x, gv, count, es);
    for (int k = 1; k < n; k++)
      slot_put(skv__comm_addr(c, (me + k) % n, roff + skv__ts_ag(cv, n, me, v)), &x);
  }
  /* 3: every other range from its owner's all-gather slots */
  for (int k = 1; k < n; k++) {
    int j = (me + k) % n;
    uint64_t valid = skv__ts_valid(nvec, cv, j);
    for (uint64_t v = 0; v < valid; v++) {
      if (!slot_take(mine + skv__ts_ag(cv, n, j, v), &x, es, &w))
        return host_timeout(c, "two-shot all-gather", ch, e, j, (uint64_t)j * cv + v);
      hvec_store(out, &x, (uint64_t)j * cv + v, count, es);
    }
  }
  c->hchan[ch].epoch = e + 1;
  return 0;
}

static int host_allreduce(skv_comm_t *c, const void *in, void *out, uint64_t count, int dtype,
                          int op, int algo, int ch) {
  uint32_t es = skv__dtype_size(dtype);
  uint64_t chunk = algo == SKV_ALGO_ONESHOT ? skv__oneshot_chunk_bytes(c->region_bytes, c->npes)
                                            : skv__twoshot_chunk_bytes(c->region_bytes, c->npes);
  uint64_t per = chunk / es;
  for (uint64_t off = 0; off < count; off += per) {
    uint64_t m = SKV_MIN(per, count - off);
    const char *i = (const char *)in + off * es;
    char *o = (char *)out + off * es;
    int rc = algo == SKV_ALGO_ONESHOT ? host_oneshot(c, i, o, m, dtype, op, ch)
                                      : host_twoshot(c, i, o, m, dtype, op, ch);
    if (rc < 0) return rc;
  }
  return 0;
}

static uint64_t *host_slot(const skv_comm_t *c, int pe, uint64_t off) {
  return (uint64_t *)skv__comm_addr(c, pe, off);
}

static bool cmp_true(uint64_t have, int cmp, uint64_t want) {
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

static const char *cmp_name(int cmp) {
  static const char *names[] = {"==", "!=", ">=", ">", "<", "<="};
  return cmp >= 0 && cmp < 6 ? names[cmp] : "?";
}

static int host_barrier(skv_comm_t *c, int ch) {
  uint64_t e = c->hchan[ch].barrier_epoch + 1;
  uint64_t base = c->flag_off + (uint64_t)ch * c->flag_chan_bytes;
  for (int k = 1; k < c->npes; k++)
    __atomic_store_n(host_slot(c, (c->me + k) % c->npes, base + (uint64_t)c->me * 8u), e,
                     __ATOMIC_RELEASE);
  host_wait_t w = host_wait_start(c);
  for (int k = 1; k < c->npes; k++) {
    int q = (c->me + k) % c->npes;
    uint64_t *f = host_slot(c, c->me, base + (uint64_t)q * 8u);
    uint64_t have;
    while ((have = __atomic_load_n(f, __ATOMIC_ACQUIRE)) < e) {
      if (!host_keep_waiting(&w)) {
        __atomic_store_n(&c->broken, true, __ATOMIC_RELAXED);
        return SKV_FAIL(SKV_ETIMEDOUT, SKV_SUBSYS_COMM,
                        "skv_comm_barrier (channel %d, epoch %" PRIu64
                        "): PE %d did not arrive within %d ms (its flag "
                        "reads %" PRIu64
                        "); is it alive and calling skv_comm_barrier on the same channel? The comm is "
                        "unusable now: destroy it on every PE",
                        ch, e, q, c->ctx->cfg.timeout_ms, have);
      }
    }
  }
  c->hchan[ch].barrier_epoch = e;
  return 0;
}

static int host_wait(skv_comm_t *c, uint32_t slot, int cmp, uint64_t value) {
  uint64_t *s = host_slot(c, c->me, c->heap->info.signal_offset + (uint64_t)slot * 8u);
  host_wait_t w = host_wait_start(c);
  uint64_t have;
  while (!cmp_true(have = __atomic_load_n(s, __ATOMIC_ACQUIRE), cmp, value)) {
    if (!host_keep_waiting(&w))
      return SKV_FAIL(SKV_ETIMEDOUT, SKV_SUBSYS_COMM,
                      "skv_comm_wait: slot %u still reads %" PRIu64
                      " after %d ms, waiting for %s %" PRIu64
                      "; did the peer that should signal it run?",
                      slot, have, c->ctx->cfg.timeout_ms, cmp_name(cmp), value);
  }
  return 0;
}

/* ---- public entry points ------------------------------------------------------------------ */

#define COMM_CHECK(c, fn)                                                                     \
  do {                                                                                        \
    SKV_ARG_CHECK((c), SKV_SUBSYS_COMM, "%s: comm is NULL", fn);                              \
    if (SKV_UNLIKELY(__atomic_load_n(&(c)->broken, __ATOMIC_RELAXED)))                        \
      return SKV_FAIL(                                                                        \
          SKV_ESTATE, SKV_SUBSYS_COMM,                                                        \
          "%s: an earlier collective or barrier of this comm timed out, so its flags are no " \
          "longer consistent; destroy the comm on every PE and create a new one",             \
          fn);                                                                                \
  } while (0)

int skv_comm_allreduce(skv_comm_t *comm, const void *in, void *out, size_t count, int dtype, int op,
                  int algo, int channel, void *stream) {
  COMM_CHECK(comm, "skv_comm_allreduce");
  uint32_t es = skv__dtype_size(dtype);
  SKV_ARG_CHECK(es != 0, SKV_SUBSYS_COMM,
                "skv_comm_allreduce: dtype %d is not SKV_DTYPE_BF16, _FP16 or _FP32", dtype);
  SKV_ARG_CHECK(op >= SKV_OP_SUM && op <= SKV_OP_MIN, SKV_SUBSYS_COMM,
                "skv_comm_allreduce: op %d is not SKV_OP_SUM, _MAX or _MIN", op);
  SKV_ARG_CHECK(algo >= SKV_ALGO_AUTO && algo <= SKV_ALGO_NCCL, SKV_SUBSYS_COMM,
                "skv_comm_allreduce: algo %d is not SKV_ALGO_AUTO, _ONESHOT, _TWOSHOT or _NCCL", algo);
  SKV_ARG_CHECK(channel >= 0 && (uint32_t)channel < comm->channels, SKV_SUBSYS_COMM,
                "skv_comm_allreduce: channel %d is not in 0..%u (opts.channels)", channel,
                comm->channels - 1);
  SKV_ARG_CHECK(count > 0, SKV_SUBSYS_COMM, "skv_comm_allreduce: count is 0");
  SKV_ARG_CHECK(count <= (UINT64_MAX >> 8) / es, SKV_SUBSYS_COMM,
                "skv_comm_allreduce: count %zu times the element size overflows", count);
  SKV_ARG_CHECK(in && out, SKV_SUBSYS_COMM, "skv_comm_allreduce: in (%p) and out (%p) must be non-NULL",
                in, out);
  uint64_t bytes = (uint64_t)count * es;
  if (algo == SKV_ALGO_AUTO) algo = skv__comm_choose(comm, bytes);
  if (algo == SKV_ALGO_NCCL && !comm->has_nccl)
    return SKV_FAIL(SKV_ENOTSUP, SKV_SUBSYS_COMM,
                    "skv_comm_allreduce: SKV_ALGO_NCCL needs the CUDA backend with an NCCL "
                    "communicator; this comm has "
                    "none (%s)",
                    comm->backend == SKV_BACKEND_HOST ? "host backend"
                    : (comm->flags & SKV_COMM_NO_NCCL)
                        ? "SKV_COMM_NO_NCCL or SKV_NCCL_ALLREDUCE=0"
                        : "libnccl.so.2 missing, or PEs share a GPU; see the INFO log");
  if (algo != SKV_ALGO_NCCL && bytes > comm->max_bytes)
    return SKV_FAIL(SKV_ERANGE, SKV_SUBSYS_COMM,
                    "skv_comm_allreduce: %" PRIu64 " bytes exceed the comm's max_bytes (%" PRIu64
                    ") for the symmetric algorithms; raise opts.max_bytes%s",
                    bytes, comm->max_bytes, comm->has_nccl ? " or use SKV_ALGO_NCCL / AUTO" : "");
  SKV_TRACE(SKV_SUBSYS_COMM, "allreduce %zu x %s %s, %s, channel %d", count, skv__dtype_name(dtype),
            skv__op_name(op), skv__algo_name(algo), channel);
  if (comm->backend == SKV_BACKEND_HOST) {
    SKV_ARG_CHECK(stream == NULL, SKV_SUBSYS_COMM,
                  "skv_comm_allreduce: the host backend is synchronous, stream must be NULL (got %p)",
                  stream);
    return host_allreduce(comm, in, out, count, dtype, op, algo, channel);
  }
#ifdef SKV_WITH_CUDA
  return skv__comm_cuda_allreduce(comm, in, out, count, dtype, op, algo, channel, stream);
#else
  return SKV_FAIL(SKV_EINTERNAL, SKV_SUBSYS_COMM,
                  "skv_comm_allreduce: CUDA comm in a build without CUDA");
#endif
}

int skv_comm_signal(skv_comm_t *comm, int pe, uint32_t slot, uint64_t value, int op, void *stream) {
  COMM_CHECK(comm, "skv_comm_signal");
  SKV_ARG_CHECK(pe >= 0 && pe < comm->npes, SKV_SUBSYS_COMM, "skv_comm_signal: pe %d is not in 0..%d",
                pe, comm->npes - 1);
  SKV_ARG_CHECK(slot < comm->user_slots, SKV_SUBSYS_COMM,
                "skv_comm_signal: slot %u is not below skv_comm_get_signal_slots() = %u", slot,
                comm->user_slots);
  SKV_ARG_CHECK(op == SKV_SIGNAL_SET || op == SKV_SIGNAL_ADD, SKV_SUBSYS_COMM,
                "skv_comm_signal: op %d is not SKV_SIGNAL_SET or SKV_SIGNAL_ADD", op);
  if (comm->backend == SKV_BACKEND_HOST) {
    SKV_ARG_CHECK(stream == NULL, SKV_SUBSYS_COMM,
                  "skv_comm_signal: the host backend is synchronous, stream must be NULL");
    uint64_t *s = host_slot(comm, pe, comm->heap->info.signal_offset + (uint64_t)slot * 8u);
    if (op == SKV_SIGNAL_SET)
      __atomic_store_n(s, value, __ATOMIC_SEQ_CST);
    else
      __atomic_fetch_add(s, value, __ATOMIC_SEQ_CST);
    return 0;
  }
#ifdef SKV_WITH_CUDA
  return skv__comm_cuda_signal(comm, pe, slot, value, op, stream);
#else
  return SKV_EINTERNAL;
#endif
}

int skv_comm_wait(skv_comm_t *comm, uint32_t slot, int cmp, uint64_t value, void *stream) {
  COMM_CHECK(comm, "skv_comm_wait");
  SKV_ARG_CHECK(slot < comm->user_slots, SKV_SUBSYS_COMM,
                "skv_comm_wait: slot %u is not below skv_comm_get_signal_slots() = %u", slot,
                comm->user_slots);
  SKV_ARG_CHECK(cmp >= SKV_CMP_EQ && cmp <= SKV_CMP_LE, SKV_SUBSYS_COMM,
                "skv_comm_wait: cmp %d is not one of SKV_CMP_EQ, _NE, _GE, _GT, _LT, _LE", cmp);
  if (comm->backend == SKV_BACKEND_HOST) {
    SKV_ARG_CHECK(stream == NULL, SKV_SUBSYS_COMM,
                  "skv_comm_wait: the host backend is synchronous, stream must be NULL");
    return host_wait(comm, slot, cmp, value);
  }
#ifdef SKV_WITH_CUDA
  return skv__comm_cuda_wait(comm, slot, cmp, value, stream);
#else
  return SKV_EINTERNAL;
#endif
}

int skv_comm_barrier(skv_comm_t *comm, int channel, void *stream) {
  COMM_CHECK(comm, "skv_comm_barrier");
  SKV_ARG_CHECK(channel >= 0 && (uint32_t)channel < comm->channels, SKV_SUBSYS_COMM,
                "skv_comm_barrier: channel %d is not in 0..%u (opts.channels)", channel,
                comm->channels - 1);
  if (comm->backend == SKV_BACKEND_HOST) {
    SKV_ARG_CHECK(stream == NULL, SKV_SUBSYS_COMM,
                  "skv_comm_barrier: the host backend is synchronous, stream must be NULL");
    return host_barrier(comm, channel);
  }
#ifdef SKV_WITH_CUDA
  return skv__comm_cuda_barrier(comm, channel, stream);
#else
  return SKV_EINTERNAL;
#endif
}

int skv_comm_check(skv_comm_t *comm) {
  SKV_ARG_CHECK(comm, SKV_SUBSYS_COMM, "skv_comm_check: comm is NULL");
  if (comm->backend == SKV_BACKEND_HOST) return 0; /* host calls report their failures themselves */
#ifdef SKV_WITH_CUDA
  return skv__comm_cuda_check(comm);
#else
  return 0;
#endif
}
