/* Where the time of the KV data path goes: nanoseconds and counts per phase of skv_kv_fetch and
 * skv_kv_publish (and their stream-ordered completion), accumulated only while switched on. */
#ifndef SKV_KV_PROF_H
#define SKV_KV_PROF_H

#include "core/core.h"

/* How it works
 * ------------
 * Off (the default) a phase costs one predictable branch on a flag. On, a phase boundary reads
 * CLOCK_MONOTONIC once (the vDSO, about 20 ns) and adds the lap with a relaxed atomic (the
 * completion thread adds too), so a call of n pages pays a few hundred ns in all, never per
 * page. symkv-bench fetch switches it on for separate runs of its e2e rows and prints the
 * phases per call next to the rows (the timed rows themselves run with it off). */

typedef enum skv__kp_phase {
  SKV__KP_CALL,     /* the whole call, entry to return */
  SKV__KP_CHECK,    /* argument checks: references, layout, block ids, keys */
  SKV__KP_BEGIN,    /* CUDA: device current, capture check, completing what completed */
  SKV__KP_PIN,      /* fetch: pinning every reference (generations checked) */
  SKV__KP_LOOKUP,   /* publish: claiming the keys' index slots (skv__index_claim_n) */
  SKV__KP_ALLOC,    /* publish: page allocation, evictions (and their index erases) included */
  SKV__KP_SLOT,     /* CUDA: taking an argument slot (waits when all are in flight) */
  SKV__KP_STAGE,    /* CUDA: writing a launch's arguments into its pinned slot */
  SKV__KP_LAUNCH,   /* CUDA: argument DMA, kernel or copy-engine launch */
  SKV__KP_HANDOFF,  /* CUDA: the launch's event recorded and handed to the completion thread */
  SKV__KP_COPY,     /* host and staged copies: the bytes moved by this thread */
  SKV__KP_RELEASE,  /* fetch: unpinning (in the call, or in the completion) */
  SKV__KP_FINISH,   /* publish: READY, index insert, LRU (in the call, or in the completion) */
  SKV__KP_COMPLETE, /* CUDA: completions run (either thread), release / finish included */
  SKV__KP_SYNC,     /* skv_kv_sync: waiting for the completions */
  SKV__KP_HELPER,   /* publish: the helper thread claiming keys (beside the call) */
  SKV__KP_JOIN,     /* publish: the call waiting for the helper's claims (within claim) */
  SKV__KP_N
} skv__kp_phase_t;

typedef struct skv__kv_prof {
  bool on;
  uint64_t ns[SKV__KP_N], n[SKV__KP_N];
} skv__kv_prof_t;

/* A phase's name ("pin", "finish"...). */
const char *skv__kp_name(int phase);

/* A start time when profiling is on, else 0. */
static inline uint64_t skv__kp_now(const skv__kv_prof_t *p) {
  return p && __atomic_load_n(&p->on, __ATOMIC_RELAXED) ? skv__now_ns() : 0;
}

/* Add the time since `t0` (0: profiling was off at the start: nothing) to `phase`; returns now
 * (the next phase's start) or 0. */
static inline uint64_t skv__kp_lap(skv__kv_prof_t *p, int phase, uint64_t t0) {
  if (!t0) return 0;
  const uint64_t t = skv__now_ns();
  __atomic_add_fetch(&p->ns[phase], t - t0, __ATOMIC_RELAXED);
  __atomic_add_fetch(&p->n[phase], 1, __ATOMIC_RELAXED);
  return t;
}

/* Zero the counters and switch profiling on or off. */
void skv__kp_reset(skv__kv_prof_t *p, bool on);

#endif
