/* The CUDA copy backend's argument slots and their completion: a ring of slots handed out to
 * launches, and the completion thread that hands each back once its event completed. */
#define _GNU_SOURCE
#include "kv/kv_cuda_int.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

/* How it works
 * ------------
 * SKV__KVC_RING_SLOTS slots serve ordinary calls; a slot is handed back once the launch that
 * used it completed, and a call that finds none free waits for one, bounded by the context's
 * timeout. After a launch and the event recorded behind it are enqueued, the slot goes on the
 * pending list. The completion thread watches the events of the pending launches
 * (cudaEventQuery, sleeping 2 us doubling to 100 us while any is pending; with none pending it
 * keeps looking for 2 ms, 2 us doubling to 50 us, then sleeps on a condition variable) and, once a
 * launch's event has completed, runs the protocol's `done` on the slot's batch (kv.c releases its
 * pins or indexes its pages) and hands the slot back. Callers do the same for what has completed:
 * each publish first, a call waiting for a slot, and skv__kvc_sync (a fetch leaves it to the
 * thread: its caller should not pay the previous fetch's unpins); each use of a slot has a sequence
 * number, so one completion never counts twice. The caller's stream carries nothing but the copy
 * and an event (a host callback on the stream cost it microseconds per launch: docs/gpu.md).
 *
 * What can go wrong
 * -----------------
 * - A stream that never completes (blocked on an event, a hung kernel): calls that need a slot
 *   and skv__kvc_sync time out with SKV_ETIMEDOUT; at destroy the completion thread is stopped
 *   and the slots of launches still pending are leaked (a kernel may still read them).
 * - The completion thread (and a caller completing what completed) queries events without the
 *   lock, takes the completed launches off the pending list with it, runs their protocol
 *   steps without it (launches of different slots may complete on two threads at once: the
 *   pool and the index are safe for that), then hands the slots back with it. No thread
 *   holds the lock across a CUDA call or a protocol step. A query failing with an error other than
 * "not ready" (a broken context) completes the launch anyway and records the error for
 *   skv__kvc_sync: the pins go, since no copy will ever run again. */

static void note_err_locked(skv__kvc_t *kc, int err) {
  if (kc->cb_err) return;
  kc->cb_err = err;
  snprintf(kc->cb_msg, sizeof kc->cb_msg, "%s", skv_last_error());
}

int skv__kvc_slot_get(skv__kvc_t *kc, skv__kvc_slot_t **out, const char *fn) {
  int ms = kc->p.ctx->cfg.timeout_ms;
  const struct timespec dl = skv__ts_at(skv__now_ns() + (uint64_t)ms * 1000000u);
  pthread_mutex_lock(&kc->mu);
  if (!kc->free_ring) (void)skv__kvc_reap_locked(kc);
  while (!kc->free_ring) {
    if (pthread_cond_timedwait(&kc->cv, &kc->mu, &dl) == ETIMEDOUT && !kc->free_ring) {
      pthread_mutex_unlock(&kc->mu);
      return SKV_FAIL(
          SKV_ETIMEDOUT, SKV_SUBSYS_KV,
          "%s: all %d argument slots of this cache stayed in use for %d ms: earlier fetches or "
          "publishes have not completed on their streams (is a stream blocked, or waiting for "
          "something this thread would do next?)",
          fn, SKV__KVC_RING_SLOTS, ms);
    }
  }
  skv__kvc_slot_t *s = kc->free_ring;
  kc->free_ring = s->next;
  kc->inflight++;
  pthread_mutex_unlock(&kc->mu);
  *out = s;
  return 0;
}

/* Hand a ring slot back (kc->mu held). */
static void slot_put_locked(skv__kvc_t *kc, skv__kvc_slot_t *s) {
  s->next = kc->free_ring;
  kc->free_ring = s;
  kc->inflight--;
  pthread_cond_broadcast(&kc->cv);
}

void skv__kvc_slot_put(skv__kvc_t *kc, skv__kvc_slot_t *s) {
  pthread_mutex_lock(&kc->mu);
  slot_put_locked(kc, s);
  pthread_mutex_unlock(&kc->mu);
}

/* A launch completed: the protocol's step on its batch (kc->mu not held: the slot is on no
 * list, so nothing else touches it). Returns 0 or the step's failure. */
static int slot_complete(skv__kvc_t *kc, skv__kvc_slot_t *s) {
  const uint32_t *pp = (const uint32_t *)(s->args + s->refs_off);
  skv__kv_batch_t b = {.dir = s->dir,
                       .n = s->n,
                       .pe = pp,
                       .pe_step = 2,
                       .page = pp + 1,
                       .page_step = 2,
                       .keys = s->keys,
                       .unpin_caller = s->unpin_caller,
                       .claims = s->has_claims ? s->claims : NULL};
  const uint64_t t = skv__kp_now(kc->p.prof);
  int r = kc->p.done(kc->p.done_arg, &b);
  (void)skv__kp_lap(kc->p.prof, SKV__KP_COMPLETE, t);
  return r;
}

void skv__kvc_slot_done(skv__kvc_slot_t *s) {
  skv__kvc_t *kc = s->kc;
  pthread_mutex_lock(&kc->mu);
  const bool closed = kc->closed;
  pthread_mutex_unlock(&kc->mu);
  int r = closed ? 0 : slot_complete(kc, s); /* closed: the cache is gone, nothing to update */
  pthread_mutex_lock(&kc->mu);
  if (r) note_err_locked(kc, r);
  slot_put_locked(kc, s);
  pthread_mutex_unlock(&kc->mu);
}

void skv__kvc_slot_pending(skv__kvc_t *kc, skv__kvc_slot_t *s) {
  pthread_mutex_lock(&kc->mu);
  s->seq++;
  s->next = kc->pending;
  kc->pending = s;
  pthread_cond_signal(&kc->work);
  pthread_mutex_unlock(&kc->mu);
}

/* Complete the pending launches whose events have completed (in any order: they may be on
 * different streams). A launch whose slot left the list or was used again meanwhile (another
 * thread completed it) is left alone: each use of a slot has its own sequence number. */
int skv__kvc_reap_locked(skv__kvc_t *kc) {
  skv__kvc_slot_t *snap[SKV__KVC_RING_SLOTS];
  uint64_t seq[SKV__KVC_RING_SLOTS];
  int n = 0;
  for (skv__kvc_slot_t *s = kc->pending; s && n < SKV__KVC_RING_SLOTS; s = s->next)
    snap[n] = s, seq[n++] = s->seq;
  if (n == 0) return 0;
  pthread_mutex_unlock(&kc->mu);
  cudaError_t st[SKV__KVC_RING_SLOTS];
  bool any = false;
  const enum cudaStreamCaptureMode m = skv__kvc_relax(); /* kv_cuda_int.h */
  for (int i = 0; i < n; i++) {
    st[i] = cudaEventQuery(snap[i]->done);
    if (st[i] != cudaErrorNotReady) any = true;
  }
  skv__kvc_unrelax(m);
  if (any) (void)cudaGetLastError();
  pthread_mutex_lock(&kc->mu);
  /* take the completed launches off the pending list (this thread completes them) */
  skv__kvc_slot_t *mine[SKV__KVC_RING_SLOTS];
  int done = 0;
  for (int i = 0; i < n && any; i++) {
    if (st[i] == cudaErrorNotReady) continue;
    skv__kvc_slot_t **pp = &kc->pending;
    while (*pp && *pp != snap[i]) pp = &(*pp)->next;
    if (!*pp || snap[i]->seq != seq[i]) continue; /* completed by another thread */
    *pp = snap[i]->next;
    if (st[i] != cudaSuccess && !kc->cb_err) {
      kc->cb_err = SKV_ECUDA;
      snprintf(kc->cb_msg, sizeof kc->cb_msg,
               "a fetch or publish could not be confirmed complete: %s (%s); its pins were "
               "released",
               cudaGetErrorString(st[i]), cudaGetErrorName(st[i]));
    }
    mine[done++] = snap[i];
  }
  if (done == 0) return 0;
  /* The protocol's steps without the lock: a caller taking a slot, or enqueueing its next
   * launch, does not wait for the unpins or index inserts of 1024 pages (the lock was held
   * across them before). The slots are still counted in flight, so skv__kvc_sync waits. */
  const bool closed = kc->closed;
  pthread_mutex_unlock(&kc->mu);
  int r[SKV__KVC_RING_SLOTS];
  for (int i = 0; i < done; i++) r[i] = closed ? 0 : slot_complete(kc, mine[i]);
  pthread_mutex_lock(&kc->mu);
  for (int i = 0; i < done; i++) {
    if (r[i]) note_err_locked(kc, r[i]);
    slot_put_locked(kc, mine[i]);
  }
  return done;
}

void skv__kvc_reap(skv__kvc_t *kc) {
  pthread_mutex_lock(&kc->mu);
  if (kc->pending) (void)skv__kvc_reap_locked(kc);
  pthread_mutex_unlock(&kc->mu);
}

/* Idle, the completion thread keeps looking this long before it waits on its condition variable,
 * napping 2 us doubling to REAPER_IDLE_NAP between looks. */
#define REAPER_LINGER_NS (2000u * 1000u)
#define REAPER_IDLE_NAP  50000

/* The completion thread: sleeps 2 us doubling to 100 us while launches are pending and none
 * completed. With none pending it lingers REAPER_LINGER_NS before it waits for work: a launch
 * that finds it awake hands off with no futex wake (on one H100 under MPS the hand-off took 2.3
 * us of a 10.7 us call of 1 MiB when every call woke the thread:
 * bench/results/e2e_p21_1gpu_mps_nvidia-h100-x1.txt), at the price of about 45 wake-ups after
 * the last launch; a launch right after the last one is seen within a few us, one after a longer
 * gap within 50 us (plus the timer's slack), where a woken thread saw it at once. */
static void *reaper_main(void *arg) {
  skv__kvc_t *kc = arg;
  (void)cudaSetDevice(kc->device);
  long nap_ns = 2000;
  uint64_t idle_since = 0;
  pthread_mutex_lock(&kc->mu);
  while (!kc->stop) {
    if (!kc->pending) {
      const uint64_t now = skv__now_ns();
      if (idle_since == 0) idle_since = now;
      if (now - idle_since < REAPER_LINGER_NS) {
        pthread_mutex_unlock(&kc->mu);
        struct timespec ts = {0, nap_ns};
        nanosleep(&ts, NULL);
        nap_ns = nap_ns * 2 > REAPER_IDLE_NAP ? REAPER_IDLE_NAP : nap_ns * 2;
        pthread_mutex_lock(&kc->mu);
        continue;
      }
      pthread_cond_wait(&kc->work, &kc->mu);
      idle_since = 0;
      nap_ns = 2000;
      continue;
    }
    if (idle_since) idle_since = 0, nap_ns = 2000;
    if (skv__kvc_reap_locked(kc) > 0) {
      nap_ns = 2000;
      continue;
    }
    pthread_mutex_unlock(&kc->mu);
    struct timespec ts = {0, nap_ns};
    nanosleep(&ts, NULL);
    nap_ns = nap_ns * 2 > 100000 ? 100000 : nap_ns * 2;
    pthread_mutex_lock(&kc->mu);
  }
  pthread_mutex_unlock(&kc->mu);
  return NULL;
}

int skv__kvc_ring_init(skv__kvc_t *kc) {
  for (int i = 0; i < SKV__KVC_RING_SLOTS; i++) {
    kc->slots[i].next = kc->free_ring;
    kc->free_ring = &kc->slots[i];
  }
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_mutex_init(&kc->mu, NULL);
  pthread_cond_init(&kc->cv, &ca);
  pthread_cond_init(&kc->work, &ca);
  pthread_condattr_destroy(&ca);
  kc->sync_init = true;
  int te = skv__thread_start(&kc->reaper, reaper_main, kc); /* it takes no signals */
  if (te)
    return SKV_FAIL(-te, SKV_SUBSYS_KV, "skv_kv_create: starting the completion thread failed: %s",
                    strerror(te));
  kc->reaper_on = true;
  return 0;
}

void skv__kvc_ring_stop(skv__kvc_t *kc) {
  if (!kc->reaper_on) return;
  pthread_mutex_lock(&kc->mu);
  kc->stop = true;
  pthread_cond_broadcast(&kc->work);
  pthread_mutex_unlock(&kc->mu);
  pthread_join(kc->reaper, NULL);
  kc->reaper_on = false;
}
