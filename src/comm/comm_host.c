/* Host backend of the collectives: the flag protocols of the GPU run by the CPU, one thread per
 * PE over a host (memfd) heap, synchronous; for tests and machines without a GPU. */
#define _GNU_SOURCE
#include "comm/comm_state.h"

#include <inttypes.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>

/* The flag protocols ("How the flag protocols work" in kernels/comm_proto.h, with the layout
 * math), run with one CPU thread per PE and 16-byte vectors written as two 8-byte atomic words. */

/* ---- create / destroy --------------------------------------------------------------------- */

int skv__comm_host_create(skv_comm_t *c) {
  /* Every Lamport slot starts out as the sentinel; the pad starts at zero (fresh memfd). */
  memset(skv__comm_addr(c, c->me, c->scratch_off), 0xff, c->channels * c->chan_bytes);
  c->hchan = calloc(c->channels, sizeof *c->hchan);
  if (!c->hchan) return SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_COMM, "skv_comm_create: out of memory");
  return 0;
}

void skv__comm_host_destroy(skv_comm_t *c) {
  free(c->hchan);
  c->hchan = NULL;
}

/* ---- vectors, slots and waits ------------------------------------------------------------- */

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

/* ---- all-reduce --------------------------------------------------------------------------- */

/* Byte offset of slot (p, v) in a region: skv__os_slot (per_pe = nvec) or skv__ts_rs (cv). */
typedef uint64_t (*slot_off_fn)(uint64_t per_pe, int p, uint64_t v);

/* x = `own` (my vector) and slot (p, v) of every other PE p, taken (polled, then cleared) from
 * mine + slot_off(per_pe, p, v), reduced in PE order: gather_reduce of kernels/comm.cu. Returns
 * -1, or the PE that did not deliver in time. */
static int host_gather_reduce(const skv_comm_t *c, char *mine, slot_off_fn slot_off,
                              uint64_t per_pe, uint64_t v, const hvec_t *own, int dtype, int op,
                              host_wait_t *w, hvec_t *x) {
  uint32_t es = skv__dtype_size(dtype);
  float acc[8] = {0}; /* fp32 fills 4 lanes; zeros keep -Wmaybe-uninitialized quiet */
  for (int p = 0; p < c->npes; p++) {
    hvec_t y = *own;
    if (p != c->me && !slot_take(mine + slot_off(per_pe, p, v), &y, es, w)) return p;
    hvec_accumulate(acc, &y, dtype, op, p == 0);
  }
  hvec_from_acc(x, acc, dtype);
  return -1;
}

static int host_timeout(skv_comm_t *c, int phase, int channel, uint64_t epoch, int peer,
                        uint64_t v) {
  __atomic_store_n(&c->broken, true, __ATOMIC_RELAXED);
  return SKV_FAIL(
      SKV_ETIMEDOUT, SKV_SUBSYS_COMM,
      "skv_comm_allreduce (%s, channel %d, epoch %" PRIu64
      "): PE %d did not deliver vector %" PRIu64
      " within %d ms; is it alive and making the same calls (count, dtype, channel)? The comm is "
      "unusable now: destroy it on every PE",
      skv__phase_name(phase), channel, epoch, peer, v, c->ctx->cfg.timeout_ms);
}

static int host_oneshot(skv_comm_t *c, const void *in, void *out, uint64_t count, int dtype, int op,
                        int ch) {
  uint32_t es = skv__dtype_size(dtype);
  int n = c->npes, me = c->me;
  uint64_t e = c->hchan[ch].epoch, nvec = skv__nvec(count, es);
  uint64_t roff = skv__region_off(c->scratch_off, c->chan_bytes, c->region_bytes, ch, e);
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
  hvec_t own;
  for (uint64_t v = 0; v < nvec; v++) {
    hvec_load(&own, in, v, count, es);
    hvec_canon(&own, es);
    int bad = host_gather_reduce(c, mine, skv__os_slot, nvec, v, &own, dtype, op, &w, &x);
    if (bad >= 0) return host_timeout(c, SKV__PHASE_ONESHOT, ch, e, bad, v);
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
  uint64_t roff = skv__region_off(c->scratch_off, c->chan_bytes, c->region_bytes, ch, e);
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
  hvec_t own;
  uint64_t mv = skv__ts_valid(nvec, cv, me);
  for (uint64_t v = 0; v < mv; v++) {
    uint64_t gv = (uint64_t)me * cv + v;
    hvec_load(&own, in, gv, count, es);
    hvec_canon(&own, es);
    int bad = host_gather_reduce(c, mine, skv__ts_rs, cv, v, &own, dtype, op, &w, &x);
    if (bad >= 0) return host_timeout(c, SKV__PHASE_RS, ch, e, bad, gv);
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
        return host_timeout(c, SKV__PHASE_AG, ch, e, j, (uint64_t)j * cv + v);
      hvec_store(out, &x, (uint64_t)j * cv + v, count, es);
    }
  }
  c->hchan[ch].epoch = e + 1;
  return 0;
}

int skv__comm_host_allreduce(skv_comm_t *c, const void *in, void *out, size_t count, int dtype,
                             int op, int algo, int ch) {
  uint32_t es = skv__dtype_size(dtype);
  uint64_t per = skv__comm_chunk_count(c, algo, es);
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

/* ---- barrier, signal, wait ---------------------------------------------------------------- */

static uint64_t *host_slot(const skv_comm_t *c, int pe, uint64_t off) {
  return (uint64_t *)skv__comm_addr(c, pe, off);
}

int skv__comm_host_signal(skv_comm_t *c, int pe, uint32_t slot, uint64_t value, int op) {
  uint64_t *s = host_slot(c, pe, c->heap->info.signal_offset + (uint64_t)slot * 8u);
  if (op == SKV_SIGNAL_SET)
    __atomic_store_n(s, value, __ATOMIC_SEQ_CST);
  else
    __atomic_fetch_add(s, value, __ATOMIC_SEQ_CST);
  return 0;
}

int skv__comm_host_barrier(skv_comm_t *c, int ch) {
  uint64_t e = c->hchan[ch].barrier_epoch + 1;
  uint64_t my_flag = skv__flag_off(c->flag_off, c->flag_chan_bytes, ch, c->me);
  for (int k = 1; k < c->npes; k++)
    __atomic_store_n(host_slot(c, (c->me + k) % c->npes, my_flag), e, __ATOMIC_RELEASE);
  host_wait_t w = host_wait_start(c);
  for (int k = 1; k < c->npes; k++) {
    int q = (c->me + k) % c->npes;
    uint64_t *f = host_slot(c, c->me, skv__flag_off(c->flag_off, c->flag_chan_bytes, ch, q));
    uint64_t have;
    while ((have = __atomic_load_n(f, __ATOMIC_ACQUIRE)) < e) {
      if (!host_keep_waiting(&w)) {
        __atomic_store_n(&c->broken, true, __ATOMIC_RELAXED);
        return SKV_FAIL(
            SKV_ETIMEDOUT, SKV_SUBSYS_COMM,
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

int skv__comm_host_wait(skv_comm_t *c, uint32_t slot, int cmp, uint64_t value) {
  uint64_t *s = host_slot(c, c->me, c->heap->info.signal_offset + (uint64_t)slot * 8u);
  host_wait_t w = host_wait_start(c);
  uint64_t have = __atomic_load_n(s, __ATOMIC_ACQUIRE);
  while (!SKV_CMP_HOLDS(have, cmp, value)) {
    if (!host_keep_waiting(&w))
      return SKV_FAIL(SKV_ETIMEDOUT, SKV_SUBSYS_COMM,
                      "skv_comm_wait: slot %u still reads %" PRIu64
                      " after %d ms, waiting for %s %" PRIu64
                      "; did the peer that should signal it run?",
                      slot, have, c->ctx->cfg.timeout_ms, skv__cmp_name(cmp), value);
    have = __atomic_load_n(s, __ATOMIC_ACQUIRE);
  }
  return 0;
}

/* ---- checking mode ("Checking mode" in kernels/comm_proto.h) ------------------------------ */

static int host_mismatch(skv_comm_t *c, int ch, uint64_t s, int q, uint64_t desc, uint64_t count,
                         uint64_t qdesc, uint64_t qcount, const char *how) {
  char mine[192], theirs[192];
  skv__check_name(desc, count, mine, sizeof mine);
  skv__check_name(qdesc, qcount, theirs, sizeof theirs);
  __atomic_store_n(&c->broken, true, __ATOMIC_RELAXED);
  return SKV_FAIL(SKV_EMISMATCH, SKV_SUBSYS_COMM,
                  "%.*s (checking mode, channel %d, checked call %" PRIu64 "): PE %d %s %s, this "
                  "PE %s; every PE must make the same calls in the same order on a channel. "
                  "Nothing was reduced; the comm is unusable now: destroy it on every PE",
                  (int)strcspn(mine, "("), mine, ch, s, q, how, theirs, mine);
}

int skv__comm_host_verify(skv_comm_t *c, int ch, uint64_t desc, uint64_t count) {
  const int n = c->npes, me = c->me;
  const uint64_t s = __atomic_load_n(&c->hchan[ch].check_seq, __ATOMIC_RELAXED) + 1;
  for (int k = 1; k < n; k++) { /* post: fields, then the call number (release) */
    uint64_t *slot = host_slot(c, (me + k) % n, skv__check_off(c->check_off, n, ch, me));
    __atomic_store_n(&slot[1], desc, __ATOMIC_RELAXED);
    __atomic_store_n(&slot[2], count, __ATOMIC_RELAXED);
    __atomic_store_n(&slot[0], s, __ATOMIC_RELEASE);
  }
  __atomic_store_n(&c->hchan[ch].check_seq, s, __ATOMIC_RELAXED);
  host_wait_t w = host_wait_start(c);
  const uint64_t grace = skv__now_ns() + (uint64_t)SKV__CHECK_CHANNEL_MS * 1000000u;
  for (int k = 1; k < n; k++) {
    const int q = (me + k) % n;
    const uint64_t *slot = host_slot(c, me, skv__check_off(c->check_off, n, ch, q));
    for (;;) {
      uint64_t seq = __atomic_load_n(&slot[0], __ATOMIC_ACQUIRE);
      if (seq >= s) {
        uint64_t qd = __atomic_load_n(&slot[1], __ATOMIC_RELAXED),
                 qc = __atomic_load_n(&slot[2], __ATOMIC_RELAXED);
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        if (__atomic_load_n(&slot[0], __ATOMIC_RELAXED) != seq) continue; /* posted again */
        if (seq > s)
          return host_mismatch(c, ch, s, q, desc, count, qd, qc,
                               "has made more checked calls on this channel; its latest is");
        if (qd != desc || qc != count)
          return host_mismatch(c, ch, s, q, desc, count, qd, qc, "made");
        break;
      }
      if ((w.spins & 255u) == 255u && skv__now_ns() > grace) {
        /* still waiting: has q posted a call on a channel this PE has not reached? */
        for (int c2 = 0; c2 < (int)c->channels; c2++) {
          if (c2 == ch) continue;
          const uint64_t *o = host_slot(c, me, skv__check_off(c->check_off, n, c2, q));
          if (__atomic_load_n(&o[0], __ATOMIC_ACQUIRE) >
              __atomic_load_n(&c->hchan[c2].check_seq, __ATOMIC_RELAXED))
            return host_mismatch(c, ch, s, q, desc, count, __atomic_load_n(&o[1], __ATOMIC_RELAXED),
                                 __atomic_load_n(&o[2], __ATOMIC_RELAXED),
                                 "waits in another call,");
        }
      }
      if (!host_keep_waiting(&w)) {
        __atomic_store_n(&c->broken, true, __ATOMIC_RELAXED);
        char mine[192];
        return SKV_FAIL(SKV_ETIMEDOUT, SKV_SUBSYS_COMM,
                        "%s (checking mode, channel %d, checked call %" PRIu64
                        "): PE %d did not post its call within %d ms (its slot reads call %" PRIu64
                        "); is it alive and making the same calls? The comm is unusable now: "
                        "destroy it on every PE",
                        skv__check_name(desc, count, mine, sizeof mine), ch, s, q,
                        c->ctx->cfg.timeout_ms, seq);
      }
    }
  }
  return 0;
}
