/* claim_probe: skv__index_claim_n alone, without a cache or a GPU: 1024 fresh keys a call into a
 * table that is kept at a steady state (the oldest keys erased first, a quarter of the slots
 * live), timing the erases, the claims and the publishes of each call. Prints the reach
 * histogram of shard 0 and the mean time per call of each step over calls 100..2999.
 *
 *   symkv-claim-probe [slots per shard, default 32768]
 *
 * bench/results/cpu_spin_probe_nvidia-h200.txt runs it pinned to one CPU beside spinning
 * threads (symkv-spin-probe). */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "index/index.h"
#include "probe.h"

enum { NSH = 2, N = 1024, REPS = 3000, SKIP = 100 };

/* Shard 0's slots by kind, and its reach histogram. */
static void describe(skv__index_t *ix, uint64_t slots) {
  uint64_t hist[33] = {0}, tomb = 0, empty = 0, used = 0;
  const uint8_t *rch = skv__index_reach(ix, 0);
  for (uint64_t h = 0; h < slots; h++) {
    hist[rch[h] > 32 ? 32 : rch[h]]++;
    const uint64_t hi = ix->slots[0][h].key.p.hi, lo = ix->slots[0][h].key.p.lo;
    if (hi)
      used++;
    else if (lo == 1)
      tomb++;
    else
      empty++;
  }
  printf("live %llu tomb %llu empty %llu; reach:", (unsigned long long)used,
         (unsigned long long)tomb, (unsigned long long)empty);
  for (int i = 0; i < 33; i++)
    if (hist[i]) printf(" %d:%llu", i, (unsigned long long)hist[i]);
  printf("\n");
}

int main(int argc, char **argv) {
  const uint64_t slots = argc > 1 ? strtoull(argv[1], NULL, 0) : 32768;
  if (slots < 2 * N || (slots & (slots - 1))) {
    fprintf(stderr, "usage: symkv-claim-probe [slots per shard: a power of two >= %d]\n", 2 * N);
    return 2;
  }
  const uint64_t cap = slots / 4 * NSH; /* keys kept live */
  void *seg[NSH];
  skv__index_shard_hdr_t *hdr[NSH];
  skv__index_slot_t *sl[NSH];
  const size_t b = (skv__index_shard_bytes(slots) + 63) / 64 * 64;
  for (int i = 0; i < NSH; i++) {
    seg[i] = aligned_alloc(64, b);
    if (!seg[i]) return 1;
    memset(seg[i], 0, b);
  }
  skv__index_t ix;
  memset(&ix, 0, sizeof ix);
  ix.hdr = hdr;
  ix.slots = sl;
  skv__index_bind(&ix, NSH, slots, seg, NULL, NULL);
  skv_key_t *live = calloc(cap, sizeof *live);
  uint64_t *lval = calloc(cap, sizeof *lval);
  static skv_key_t keys[N];
  static skv__index_claim_t cl[N];
  static int rc[N];
  static bool raced[N];
  if (!live || !lval) return 1;
  uint64_t s = 1, nl = 0, head = 0;
  double tc = 0, te = 0, tp = 0;
  for (int r = 0; r < REPS; r++) {
    for (int i = 0; i < N; i++) {
      keys[i].hi = probe_rand(&s) | 1ull << 63;
      keys[i].lo = probe_rand(&s);
    }
    const double t0 = probe_now();
    while (nl - head + N > cap && head < nl) { /* the oldest keys out */
      (void)skv__index_erase(&ix, live[head % cap], lval[head % cap]);
      head++;
    }
    const double t1 = probe_now();
    skv__index_claim_n(&ix, keys, N, 0, cl, rc, raced);
    const double t2 = probe_now();
    for (int i = 0; i < N; i++) {
      if (rc[i]) continue;
      const uint64_t v = skv__val_pack(0, (uint32_t)(nl % 100000) + 1, 1);
      (void)skv__index_publish(&ix, &cl[i], v);
      live[nl % cap] = keys[i];
      lval[nl % cap] = v;
      nl++;
    }
    const double t3 = probe_now();
    if (r >= SKIP) {
      te += t1 - t0;
      tc += t2 - t1;
      tp += t3 - t2;
    }
  }
  describe(&ix, slots);
  const double m = REPS - SKIP;
  printf("slots/shard %llu: per 1024 keys: erase %.1f us, claim %.1f us, publish %.1f us (%.0f "
         "ns/claim)\n",
         (unsigned long long)slots, te / m * 1e6, tc / m * 1e6, tp / m * 1e6, tc / m / N * 1e9);
  for (int i = 0; i < NSH; i++) free(seg[i]);
  free(live);
  free(lval);
  return 0;
}
