/* drop_probe: the CUDA data path's argument slots, on the host alone. A caller thread stages a
 * batch's arguments into a slot (a page reference of 8 bytes and a block id of 4 per page, as
 * skv__kvc_fill does), a completion thread later reads the references back (as a fetch's unpins
 * do), touching a page record per reference on the way, and hands the slot back to a LIFO ring
 * of 8, from which the caller takes it again. Timed: the caller's staging, with the completion
 * thread dropping the lines it read (skv__lines_drop, SKV_COMPLETION_DROP=1) and without, and
 * with the completion thread reading the references from the caller's own array instead (no
 * line of the slot crosses cores: the floor), alternated round by round (src/kv/kv_cuda_ring.c,
 * slot_complete, says why).
 *
 *   symkv-drop-probe [ROUNDS [PAGES]]      (8 rounds of 1024 pages; 400 batches a round)
 *
 * Each thread is pinned to a CPU of its own (the first two it may run on). Prints each round's
 * median staging time in us (off, on, floor), then the medians over the rounds. */
#define _GNU_SOURCE
#include "core/core.h"
#include "probe.h"

#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define SLOTS      8
#define SLOT_BYTES (512u << 10)
#define BATCHES    400
#define GPU_US     40.0 /* the copy the completion waits for */
#define META_PAGES (1u << 20)

typedef struct probe {
  uint8_t *slots;
  uint8_t *meta; /* a 64-byte record per page, as the pool's */
  uint32_t pages;
  int drop;            /* 0 off, 1 on, 2 the floor (the slot is not read) */
  const uint32_t *src; /* the floor's references: the caller's array */
  uint64_t src_off;
  pthread_mutex_t mu;
  int ring[SLOTS], nring;         /* free slots, LIFO (as the backend's free_ring) */
  int pending[BATCHES], npending; /* staged, not completed yet */
  int taken;                      /* how many of pending the completion thread took */
  int stop;
} probe_t;

static int cpu_writer, cpu_completion; /* the first two CPUs this process may run on */

static void pin_to(int cpu) {
  cpu_set_t s;
  CPU_ZERO(&s);
  CPU_SET(cpu, &s);
  (void)pthread_setaffinity_np(pthread_self(), sizeof s, &s);
}

static void spin_us(double us) {
  const double end = probe_now() + us * 1e-6;
  while (probe_now() < end) {
  }
}

/* The completion thread: for each staged slot, the copy's time, the references read (a page
 * record touched per reference), the lines dropped when asked, the slot back on the ring. */
static void *completion(void *arg) {
  probe_t *p = arg;
  pin_to(cpu_completion);
  for (;;) {
    pthread_mutex_lock(&p->mu);
    const int stop = p->stop, s = p->taken < p->npending ? p->pending[p->taken++] : -1;
    pthread_mutex_unlock(&p->mu);
    if (s < 0) {
      if (stop) return NULL;
      continue;
    }
    spin_us(GPU_US);
    const uint32_t *pp = (const uint32_t *)(p->slots + (size_t)s * SLOT_BYTES + 64);
    const int drop = __atomic_load_n(&p->drop, __ATOMIC_RELAXED);
    if (drop == 2) {
      for (uint32_t q = 0; q < p->pages; q++)
        __atomic_fetch_sub((uint32_t *)(p->meta + (size_t)p->src[p->src_off + q] * 64), 1,
                           __ATOMIC_RELAXED);
    } else {
      for (uint32_t q = 0; q < p->pages; q++)
        __atomic_fetch_sub((uint32_t *)(p->meta + (size_t)pp[2 * q + 1] * 64), 1, __ATOMIC_RELAXED);
    }
    if (drop == 1) skv__lines_drop(pp, 8 * (size_t)p->pages);
    pthread_mutex_lock(&p->mu);
    p->ring[p->nring++] = s;
    pthread_mutex_unlock(&p->mu);
  }
}

/* One round of BATCHES stagings; returns the median staging time in seconds. */
static double round_of(probe_t *p, const uint32_t *page, const uint64_t *bids, uint64_t *rng) {
  double t[BATCHES];
  for (int b = 0; b < BATCHES; b++) {
    const uint64_t off = probe_rand(rng) % 64 * p->pages; /* one of 64 batches of references */
    for (uint32_t q = 0; q < p->pages; q++)               /* the pins, on this thread */
      __atomic_fetch_add((uint32_t *)(p->meta + (size_t)page[off + q] * 64), 1, __ATOMIC_RELAXED);
    int s = -1;
    while (s < 0) {
      pthread_mutex_lock(&p->mu);
      if (p->nring) s = p->ring[--p->nring];
      pthread_mutex_unlock(&p->mu);
    }
    const double t0 = probe_now();
    uint8_t *a = p->slots + (size_t)s * SLOT_BYTES;
    for (int k = 0; k < 8; k++) ((uint64_t *)a)[k] = (uint64_t)k; /* the layout's bases */
    uint32_t *pp = (uint32_t *)(a + 64), *bp = (uint32_t *)(a + 64 + 8 * (size_t)p->pages);
    for (uint32_t q = 0; q < p->pages; q++) {
      pp[2 * q] = 0;
      pp[2 * q + 1] = page[off + q];
    }
    for (uint32_t q = 0; q < p->pages; q++) bp[q] = (uint32_t)bids[off + q];
    t[b] = probe_now() - t0;
    pthread_mutex_lock(&p->mu);
    p->src = page;
    p->src_off = off;
    p->pending[p->npending++] = s;
    pthread_mutex_unlock(&p->mu);
    /* the caller waits for the copy (a stream synchronised), then comes back */
    for (int done = 0; !done;) {
      pthread_mutex_lock(&p->mu);
      done = p->nring == SLOTS;
      pthread_mutex_unlock(&p->mu);
    }
    spin_us(5);
  }
  pthread_mutex_lock(&p->mu);
  p->npending = p->taken = 0;
  pthread_mutex_unlock(&p->mu);
  qsort(t, BATCHES, sizeof t[0], probe_cmp_double);
  return t[BATCHES / 2];
}

int main(int argc, char **argv) {
  const int rounds = argc > 1 ? atoi(argv[1]) : 8;
  const long pages = argc > 2 ? atol(argv[2]) : 1024;
  if (argc > 3 || rounds < 1 || rounds > 64 || pages < 1 || pages > 16384) {
    fprintf(stderr, "usage: symkv-drop-probe [ROUNDS (1..64) [PAGES (1..16384)]]\n");
    return 2;
  }
  probe_t p = {.pages = (uint32_t)pages, .mu = PTHREAD_MUTEX_INITIALIZER};
  p.slots = aligned_alloc(4096, (size_t)SLOTS * SLOT_BYTES);
  p.meta = aligned_alloc(4096, (size_t)META_PAGES * 64);
  uint32_t *page = malloc(64 * (size_t)pages * sizeof *page);
  uint64_t *bids = malloc(64 * (size_t)pages * sizeof *bids);
  if (!p.slots || !p.meta || !page || !bids) {
    fprintf(stderr, "symkv-drop-probe: out of memory\n");
    return 1;
  }
  memset(p.slots, 0, (size_t)SLOTS * SLOT_BYTES);
  memset(p.meta, 0, (size_t)META_PAGES * 64);
  uint64_t rng = 0x5eed;
  for (size_t i = 0; i < 64 * (size_t)pages; i++) {
    page[i] = (uint32_t)(probe_rand(&rng) % META_PAGES);
    bids[i] = probe_rand(&rng);
  }
  for (int i = 0; i < SLOTS; i++) p.ring[p.nring++] = i;
  cpu_set_t cs;
  CPU_ZERO(&cs);
  const int cpus = sched_getaffinity(0, sizeof cs, &cs) == 0 ? CPU_COUNT(&cs) : 1;
  if (cpus < 2) {
    fprintf(stderr, "symkv-drop-probe: needs two CPUs (it has %d)\n", cpus);
    return 1;
  }
  for (int c = 0, k = 0; c < CPU_SETSIZE && k < 2; c++)
    if (CPU_ISSET(c, &cs)) *(k++ ? &cpu_completion : &cpu_writer) = c;
  pthread_t th;
  if (pthread_create(&th, NULL, completion, &p) != 0) {
    fprintf(stderr, "symkv-drop-probe: pthread_create failed\n");
    return 1;
  }
  pin_to(cpu_writer);
  printf("symkv-drop-probe: %ld pages a batch, %d batches a round, CPUs %d and %d of %d; staging, "
         "median us\n",
         pages, BATCHES, cpu_writer, cpu_completion, cpus);
  double t[3][64];
  for (int r = 0; r < rounds; r++) {
    for (int m = 0; m < 3; m++) {
      __atomic_store_n(&p.drop, m, __ATOMIC_RELAXED);
      t[m][r] = round_of(&p, page, bids, &rng);
    }
    printf("round %d: drop off %.2f us, on %.2f us, floor %.2f us\n", r + 1, t[0][r] * 1e6,
           t[1][r] * 1e6, t[2][r] * 1e6);
  }
  pthread_mutex_lock(&p.mu);
  p.stop = 1;
  pthread_mutex_unlock(&p.mu);
  pthread_join(th, NULL);
  for (int m = 0; m < 3; m++) qsort(t[m], (size_t)rounds, sizeof t[m][0], probe_cmp_double);
  const double off = t[0][rounds / 2], on = t[1][rounds / 2], floor = t[2][rounds / 2];
  printf("median over %d rounds: drop off %.2f us, on %.2f us, floor %.2f us (on/off %.2f)\n",
         rounds, off * 1e6, on * 1e6, floor * 1e6, on / off);
  free(page);
  free(bids);
  free(p.slots);
  free(p.meta);
  return 0;
}
