/* A helper thread: runs one job at a time that its caller posted and could run itself.
 *
 * How it works
 * ------------
 * The caller posts a job (a function and its argument), goes on with other work, then joins it:
 * if the helper has not taken the job yet, the caller takes it back and runs it itself, else it
 * waits for the helper to finish it. So a job is never waited for longer than it runs, and a
 * helper that sleeps, is descheduled or was never woken costs its caller nothing but the job.
 *
 * Between jobs the helper spins (pause) while its caller says a burst of jobs is on, and for
 * LINGER_NS after each job and burst (back-to-back calls find it awake); then it sleeps on a
 * condition variable until the next burst begins.
 *
 * What can go wrong
 * -----------------
 * - A fork: the child has no helper thread. post() refuses, join() returns at once (a job
 *   there is the parent's), and burst() and destroy() touch no lock, in a process other than the
 *   one that created the helper (its caller then runs the job itself; the mutex may have been
 *   copied locked).
 * - A caller pinned to one CPU would share it with the spinning helper (a publish took twice as
 *   long so): skv__helper_usable() says no then.
 * - A job that fails: the job reports into its argument; the helper knows nothing of it.
 * - Spinning costs a core while a burst is on: the caller switches bursts on only for work worth
 *   more than a wake-up (SKV_PUBLISH_HELPER=0 turns the publish helper off). */
#define _GNU_SOURCE
#include "core/core.h"

#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

enum { JOB_IDLE = 0, JOB_POSTED = 1, JOB_TAKEN = 2, JOB_DONE = 3 };

/* Spinning this long after a job or a burst ends. */
#define LINGER_NS 200000u

struct skv__helper {
  pthread_t thread;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  pid_t pid;    /* the process whose thread it is */
  int job;      /* JOB_* (atomic) */
  int burst;    /* the caller's burst is on (atomic) */
  int sleeping; /* the helper waits on cv (atomic; set under mu) */
  int stop;     /* (atomic; set under mu) */
  void (*fn)(void *);
  void *arg;
};

static void *helper_main(void *a) {
  skv__helper_t *h = a;
  uint64_t linger_until = skv__now_ns() + LINGER_NS;
  for (unsigned spin = 0;; spin++) {
    if (__atomic_load_n(&h->job, __ATOMIC_ACQUIRE) == JOB_POSTED) {
      int expect = JOB_POSTED;
      if (__atomic_compare_exchange_n(&h->job, &expect, JOB_TAKEN, false, __ATOMIC_ACQUIRE,
                                      __ATOMIC_RELAXED)) {
        h->fn(h->arg);
        __atomic_store_n(&h->job, JOB_DONE, __ATOMIC_RELEASE);
        linger_until = skv__now_ns() + LINGER_NS;
      }
      continue;
    }
    if (__atomic_load_n(&h->stop, __ATOMIC_ACQUIRE)) break;
    if (__atomic_load_n(&h->burst, __ATOMIC_RELAXED)) {
      SKV_CPU_RELAX();
      continue;
    }
    if ((spin & 63u) != 0 || skv__now_ns() < linger_until) {
      SKV_CPU_RELAX();
      continue;
    }
    pthread_mutex_lock(&h->mu);
    __atomic_store_n(&h->sleeping, 1, __ATOMIC_SEQ_CST);
    /* a burst begun or a job posted after this store sees sleeping and signals under mu */
    while (!__atomic_load_n(&h->burst, __ATOMIC_SEQ_CST) &&
           __atomic_load_n(&h->job, __ATOMIC_SEQ_CST) != JOB_POSTED &&
           !__atomic_load_n(&h->stop, __ATOMIC_SEQ_CST))
      pthread_cond_wait(&h->cv, &h->mu);
    __atomic_store_n(&h->sleeping, 0, __ATOMIC_RELAXED);
    pthread_mutex_unlock(&h->mu);
    linger_until = skv__now_ns() + LINGER_NS;
  }
  return NULL;
}

int skv__helper_create(unsigned subsys, const char *what, skv__helper_t **out) {
  *out = NULL;
  skv__helper_t *h = calloc(1, sizeof *h);
  if (!h) return SKV_FAIL(SKV_ENOMEM, subsys, "%s: out of memory for a helper", what);
  h->pid = getpid();
  pthread_mutex_init(&h->mu, NULL);
  pthread_cond_init(&h->cv, NULL);
  int te = skv__thread_start(&h->thread, helper_main, h); /* it takes no signals */
  if (te) {
    pthread_cond_destroy(&h->cv);
    pthread_mutex_destroy(&h->mu);
    free(h);
    return SKV_FAIL(-te, subsys, "%s: starting a helper thread failed: %s", what, strerror(te));
  }
  *out = h;
  return 0;
}

void skv__helper_destroy(skv__helper_t *h) {
  if (!h) return;
  if (getpid() != h->pid) { /* a forked child: no thread to stop, and the mutex and condition
                             * variable may hold the parent's thread's state: left alone */
    free(h);
    return;
  }
  pthread_mutex_lock(&h->mu);
  __atomic_store_n(&h->stop, 1, __ATOMIC_SEQ_CST);
  pthread_cond_signal(&h->cv);
  pthread_mutex_unlock(&h->mu);
  pthread_join(h->thread, NULL);
  pthread_cond_destroy(&h->cv);
  pthread_mutex_destroy(&h->mu);
  free(h);
}

/* Wake the helper if it sleeps (the caller stored what it waits for first, seq_cst). */
static void wake(skv__helper_t *h) {
  if (!__atomic_load_n(&h->sleeping, __ATOMIC_SEQ_CST)) return;
  pthread_mutex_lock(&h->mu);
  pthread_cond_signal(&h->cv);
  pthread_mutex_unlock(&h->mu);
}

bool skv__helper_usable(const skv__helper_t *h) {
  if (!h || getpid() != h->pid) return false; /* a forked child: no thread */
  /* a caller that may run on one CPU only would share it with the spinning helper */
  cpu_set_t cs;
  CPU_ZERO(&cs);
  return sched_getaffinity(0, sizeof cs, &cs) != 0 || CPU_COUNT(&cs) >= 2;
}

void skv__helper_burst(skv__helper_t *h, bool on) {
  if (!h || getpid() != h->pid) return; /* a child's mutex may hold the parent's thread's state */
  __atomic_store_n(&h->burst, on ? 1 : 0, __ATOMIC_SEQ_CST);
  if (on) wake(h);
}

bool skv__helper_post(skv__helper_t *h, void (*fn)(void *), void *arg) {
  if (!h || getpid() != h->pid) return false;
  SKV_ASSERT(__atomic_load_n(&h->job, __ATOMIC_RELAXED) == JOB_IDLE);
  h->fn = fn;
  h->arg = arg;
  __atomic_store_n(&h->job, JOB_POSTED, __ATOMIC_SEQ_CST);
  if (!__atomic_load_n(&h->burst, __ATOMIC_RELAXED)) wake(h);
  return true;
}

void skv__helper_join(skv__helper_t *h) {
  if (getpid() != h->pid) return; /* a forked child posted nothing: a job there is the parent's */
  int expect = JOB_POSTED;
  if (__atomic_compare_exchange_n(&h->job, &expect, JOB_IDLE, false, __ATOMIC_ACQUIRE,
                                  __ATOMIC_RELAXED)) {
    h->fn(h->arg); /* not taken: ours again */
    return;
  }
  /* taken: the helper runs it now */
  for (unsigned spin = 0; __atomic_load_n(&h->job, __ATOMIC_ACQUIRE) != JOB_DONE; spin++) {
    if (spin < 4096)
      SKV_CPU_RELAX();
    else
      sched_yield();
  }
  __atomic_store_n(&h->job, JOB_IDLE, __ATOMIC_RELAXED);
}
