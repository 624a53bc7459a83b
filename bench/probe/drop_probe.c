/* drop_probe: the CUDA data path's argument slots, on the host alone. A caller thread stages a
 * batch's arguments into a slot (a page reference of 8 bytes and a block id of 4 per page, as
 * skv__kvc_fill does), a completion thread later reads the references back (as a fetch's unpins
 * do), touching a page record per reference on the way, and hands the slot back to a LIFO ring
 * of 8, from which the caller takes it again. Timed: the caller's staging, three ways: the
 * completion thread leaves the lines it read in the caches (off), flushes them after reading
 * (on: lines_drop below; SKV_COMPLETION_DROP=1 did this in the library until the GPU host showed
 * no gain, bench/results/completion_drop_nvidia-h100-x1.txt), or reads the references from the
 * caller's own array instead, so that no line of the slot crosses cores (floor). The three take
 * turns batch by batch, in a random order within each group of three, so that the host's
 * drifts fall on all of them alike; a staging counts for the way the slot's previous completion
 * went, since that is what it meets.
 *
 *   symkv-drop-probe [ROUNDS [PAGES]]      (8 rounds of 1024 pages; 3 x 400 batches a round)
 *
 * The two threads are pinned to the first two CPUs the process may run on (their cores and
 * packages are printed: two hyperthreads of one core share its caches). Prints each round's
 * median staging time in us per way and on/off, then the medians over the rounds. */
#define _GNU_SOURCE
#include "probe.h"

#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__)
#include <cpuid.h>
#endif

#define SLOTS      8
#define SLOT_BYTES (512u << 10)
#define BATCHES    400
#define GPU_US     40.0 /* the copy the completion waits for */
#define META_PAGES (1u << 20)

typedef struct probe {
  uint8_t *slots;
  uint8_t *meta; /* a 64-byte record per page, as the pool's */
  uint32_t pages;
  const uint32_t *page; /* the caller's references: 64 batches of `pages` page numbers */
  const uint64_t *bids; /* and their block ids */
  pthread_mutex_t mu;
  /* the batch in flight (one at a time): its slot (-1 once the completion thread took it), its
   * way (0 off, 1 on, 2 floor) and where in `page` its references are */
  int pending, way;
  uint64_t off;
  int ring[SLOTS], nring; /* free slots, LIFO (as the backend's free_ring) */
  int last_way[SLOTS];    /* the way its last completion handled each slot (-1) */
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

/* Write [p, p + len) back to memory and drop its lines from every cache of the machine:
 * CLFLUSHOPT (CPUID.(EAX=7,ECX=0):EBX bit 23) or CLFLUSH on x86-64, DC CIVAC on arm64, nothing
 * elsewhere. The bytes do not change. */
static void lines_drop(const void *p, size_t len) {
  const uintptr_t end = (uintptr_t)p + len;
#if defined(__x86_64__)
  static int opt; /* 1 CLFLUSHOPT, -1 CLFLUSH, 0 not looked yet (one thread calls this) */
  if (opt == 0) {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    opt = __get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) && (ebx & (1u << 23)) ? 1 : -1;
  }
  for (uintptr_t a = (uintptr_t)p & ~(uintptr_t)63; a < end; a += 64) {
    if (opt > 0)
      __asm__ __volatile__("clflushopt %0" : "+m"(*(volatile char *)a));
    else
      __asm__ __volatile__("clflush %0" : "+m"(*(volatile char *)a));
  }
#elif defined(__aarch64__)
  for (uintptr_t a = (uintptr_t)p & ~(uintptr_t)63; a < end; a += 64)
    __asm__ __volatile__("dc civac, %0" ::"r"(a) : "memory");
#else
  (void)end;
#endif
}

/* The completion thread: for each staged slot, the copy's time, the references read (a page
 * record touched per reference), the lines dropped when asked, the slot back on the ring. */
static void *completion(void *arg) {
  probe_t *p = arg;
  pin_to(cpu_completion);
  for (;;) {
    pthread_mutex_lock(&p->mu);
    const int stop = p->stop, s = p->pending, way = p->way;
    const uint64_t off = p->off;
    p->pending = -1;
    pthread_mutex_unlock(&p->mu);
    if (s < 0) {
      if (stop) return NULL;
      continue;
    }
    spin_us(GPU_US);
    const uint32_t *pp = (const uint32_t *)(p->slots + (size_t)s * SLOT_BYTES + 64);
    for (uint32_t q = 0; q < p->pages; q++) {
      const uint32_t pg = way == 2 ? p->page[off + q] : pp[2 * q + 1];
      __atomic_fetch_sub((uint32_t *)(p->meta + (size_t)pg * 64), 1, __ATOMIC_RELAXED);
    }
    if (way == 1) lines_drop(pp, 8 * (size_t)p->pages);
    pthread_mutex_lock(&p->mu);
    p->last_way[s] = way;
    p->ring[p->nring++] = s;
    pthread_mutex_unlock(&p->mu);
  }
}

/* One round: BATCHES batches each way, the ways taking turns in a random order within each
 * group of three; med[w]: the median time of the stagings into a slot whose last completion went
 * way w (what a staging meets is what the completion before it left), in seconds. */
static void round_of(probe_t *p, uint64_t *rng, double med[3]) {
  const uint32_t *page = p->page;
  static double t[3][3 * BATCHES];
  int nt[3] = {0, 0, 0};
  for (int g = 0; g < BATCHES; g++) {
    int order[3] = {0, 1, 2};
    for (int k = 2; k > 0; k--) { /* Fisher-Yates */
      const int j = (int)(probe_rand(rng) % (uint64_t)(k + 1)), x = order[k];
      order[k] = order[j];
      order[j] = x;
    }
    for (int k = 0; k < 3; k++) {
      const int way = order[k];
      const uint64_t off = probe_rand(rng) % 64 * p->pages; /* one of 64 batches of references */
      for (uint32_t q = 0; q < p->pages; q++)               /* the pins, on this thread */
        __atomic_fetch_add((uint32_t *)(p->meta + (size_t)page[off + q] * 64), 1, __ATOMIC_RELAXED);
      int s = -1, was = -1;
      while (s < 0) {
        pthread_mutex_lock(&p->mu);
        if (p->nring) s = p->ring[--p->nring], was = p->last_way[s];
        pthread_mutex_unlock(&p->mu);
      }
      const double t0 = probe_now();
      uint8_t *a = p->slots + (size_t)s * SLOT_BYTES;
      for (int k2 = 0; k2 < 8; k2++) ((uint64_t *)a)[k2] = (uint64_t)k2; /* the layout's bases */
      uint32_t *pp = (uint32_t *)(a + 64), *bp = (uint32_t *)(a + 64 + 8 * (size_t)p->pages);
      for (uint32_t q = 0; q < p->pages; q++) {
        pp[2 * q] = 0;
        pp[2 * q + 1] = page[off + q];
      }
      for (uint32_t q = 0; q < p->pages; q++) bp[q] = (uint32_t)p->bids[off + q];
      if (was >= 0) t[was][nt[was]++] = probe_now() - t0;
      pthread_mutex_lock(&p->mu);
      p->way = way;
      p->off = off;
      p->pending = s;
      pthread_mutex_unlock(&p->mu);
      /* the caller waits for the copy (a stream synchronised), then comes back */
      for (int done = 0; !done;) {
        pthread_mutex_lock(&p->mu);
        done = p->nring == SLOTS;
        pthread_mutex_unlock(&p->mu);
      }
      spin_us(5);
    }
  }
  for (int w = 0; w < 3; w++) {
    qsort(t[w], (size_t)nt[w], sizeof t[w][0], probe_cmp_double);
    med[w] = nt[w] ? t[w][nt[w] / 2] : 0;
  }
}

/* "core C, package P" of a CPU, from sysfs ("?" where it cannot be read). */
static void cpu_place(int cpu, char *buf, size_t cap) {
  int v[2] = {-1, -1};
  static const char *const what[2] = {"core_id", "physical_package_id"};
  for (int k = 0; k < 2; k++) {
    char path[128];
    snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu%d/topology/%s", cpu, what[k]);
    FILE *f = fopen(path, "r");
    if (f) {
      if (fscanf(f, "%d", &v[k]) != 1) v[k] = -1;
      fclose(f);
    }
  }
  if (v[0] < 0 || v[1] < 0)
    snprintf(buf, cap, "core ?, package ?");
  else
    snprintf(buf, cap, "core %d, package %d", v[0], v[1]);
}

int main(int argc, char **argv) {
  const int rounds = argc > 1 ? atoi(argv[1]) : 8;
  const long pages = argc > 2 ? atol(argv[2]) : 1024;
  if (argc > 3 || rounds < 1 || rounds > 64 || pages < 1 || pages > 16384) {
    fprintf(stderr, "usage: symkv-drop-probe [ROUNDS (1..64) [PAGES (1..16384)]]\n");
    return 2;
  }
  probe_t p = {.pages = (uint32_t)pages, .mu = PTHREAD_MUTEX_INITIALIZER, .pending = -1};
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
  p.page = page;
  p.bids = bids;
  for (int i = 0; i < SLOTS; i++) p.ring[p.nring++] = i, p.last_way[i] = -1;
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
  char w0[48], w1[48];
  cpu_place(cpu_writer, w0, sizeof w0);
  cpu_place(cpu_completion, w1, sizeof w1);
  printf("symkv-drop-probe: %ld pages a batch, %d batches a way a round; caller on CPU %d (%s), "
         "completion on CPU %d (%s), of %d CPUs; staging, median us\n",
         pages, BATCHES, cpu_writer, w0, cpu_completion, w1, cpus);
  double t[3][64];
  for (int r = 0; r < rounds; r++) {
    double med[3];
    round_of(&p, &rng, med);
    for (int w = 0; w < 3; w++) t[w][r] = med[w];
    printf("round %d: drop off %.2f us, on %.2f us, floor %.2f us (on/off %.2f)\n", r + 1,
           med[0] * 1e6, med[1] * 1e6, med[2] * 1e6, med[1] / med[0]);
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
