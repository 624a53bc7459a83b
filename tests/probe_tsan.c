/* Probe: ThreadSanitizer over the node-shared page pool and index, with PEs as threads of one
 * process (outside Criterion, which cannot start under TSan). Built with -fsanitize=thread. */
#define _GNU_SOURCE
#include "index/index.h"
#include "pool/pool.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* How it works
 *
 * NPES threads each play a PE: each owns a pool (its records, pins and LRU), a shard of one
 * index and PAGES pages of PAGE_BYTES in "shared" memory (here: the heap of the process, which
 * is what every PE maps). Until the deadline each thread, at random: publishes a key of a small
 * key space (allocate a page, evicting the least recently used one through the index, fill it
 * with a pattern derived from the key, READY, insert, commit or free), looks a key up, pins the
 * page, reads and checks every byte, unpins; evicts a page; or publishes a batch of BATCH keys as
 * skv_kv_publish does with its helper: the keys' index slots claimed by the PE's helper thread
 * (core/helper.c) while the PE allocates their pages, then the claims published or given up,
 * and then, as skv_kv_publish does with a free reserve, the helper evicts pages until RESERVE
 * are free (skv__pool_reclaim) while the PE goes on, until its next batch stops it.
 * Keys are fewer than the pages of all
 * PEs and more than one PE's, so pages are evicted, reused and raced for all the time.
 * ThreadSanitizer reports every data race (exit code 66); a byte that differs from its key's
 * pattern is counted as wrong. */

#define NPES       4
#define PAGES      64
#define PAGE_BYTES 512
#define KEYS       400
#define SLOTS      256 /* per shard */
#define BATCH      4
#define RESERVE    8

typedef struct pe {
  int me;
  skv__pool_t pool;
  skv__index_t ix;
  skv__index_shard_hdr_t *hdr[NPES];
  skv__index_slot_t *slots[NPES];
  skv__helper_t *helper;
  uint64_t seed, published, deduplicated, hits, verified, stale, evicted, wrong;
  uint64_t batches, helped; /* batches published, and of these claimed by the helper */
  int reclaim_stop;         /* atomic */
  bool reclaim_pending;     /* a reclaim posted and not joined */
  uint64_t reclaimed;       /* pages the helper's reclaims evicted (written by the helper) */
} pe_t;

static pe_t pes[NPES];
static uint8_t *data[NPES]; /* each PE's pages */
static uint64_t deadline_ms;

static uint64_t rnd(uint64_t *s) {
  uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

static skv_key_t key_of(uint64_t id) {
  uint64_t s = id * 7919 + 1;
  skv_key_t k = {rnd(&s) | (1ull << 63), rnd(&s)};
  return k;
}

static uint8_t pattern(uint64_t id, size_t i) {
  return (uint8_t)(id * 131 + i * 7 + (i >> 8));
}

static bool alive(void *arg, int pe) {
  return skv__pool_alive(&((pe_t *)arg)->pool, pe);
}

static void evict_cb(void *arg, uint32_t page, uint32_t gen, uint64_t key_hi, uint64_t key_lo) {
  pe_t *p = arg;
  skv_key_t k = {key_hi, key_lo};
  (void)skv__index_erase(&p->ix, k, skv__val_pack((uint32_t)p->me, page, gen));
  p->evicted++;
}

static void publish(pe_t *p, uint64_t id) {
  skv_key_t k = key_of(id);
  uint64_t val;
  if (skv__index_lookup(&p->ix, k, &val) == 0) return;
  uint32_t page, gen;
  uint64_t ev = 0;
  if (skv__pool_alloc(&p->pool, evict_cb, p, &page, &gen, &ev) != 0) return;
  uint8_t *d = data[p->me] + (size_t)page * PAGE_BYTES;
  for (size_t i = 0; i < PAGE_BYTES; i++) d[i] = pattern(id, i);
  skv__pool_ready(&p->pool, page, k.hi, k.lo);
  gen = skv__pool_gen(&p->pool, (uint32_t)p->me, page);
  if (skv__index_insert(&p->ix, k, skv__val_pack((uint32_t)p->me, page, gen), p->me) == 0) {
    skv__pool_commit(&p->pool, page);
    p->published++;
  } else {
    skv__pool_release(&p->pool, page);
    p->deduplicated++;
  }
}

/* A batch claimed by the helper (skv__index_claim_n, as skv_kv_publish's helper does). */
typedef struct batch {
  pe_t *p;
  pthread_t caller;
  bool by_helper; /* the helper ran the claims (not its caller) */
  skv_key_t keys[BATCH];
  skv__index_claim_t cl[BATCH];
  int crc[BATCH];
  bool raced[BATCH];
} batch_t;

static void claim_batch(void *arg) {
  batch_t *b = arg;
  b->by_helper = !pthread_equal(pthread_self(), b->caller);
  skv__index_claim_n(&b->p->ix, b->keys, BATCH, b->p->me, b->cl, b->crc, b->raced);
}

static void reclaim_job(void *arg) {
  pe_t *p = arg;
  static const uint64_t reserve = RESERVE;
  p->reclaimed += skv__pool_reclaim(&p->pool, &reserve, evict_cb, p, &p->reclaim_stop);
}

/* Stop the helper's reclaim, as kv.c's reclaim_end does. */
static void reclaim_end(pe_t *p) {
  if (!p->reclaim_pending) return;
  __atomic_store_n(&p->reclaim_stop, 1, __ATOMIC_RELEASE);
  skv__helper_join(p->helper);
  __atomic_store_n(&p->reclaim_stop, 0, __ATOMIC_RELAXED);
  p->reclaim_pending = false;
}

static void publish_batch(pe_t *p) {
  reclaim_end(p);
  batch_t b = {.p = p, .caller = pthread_self()};
  uint64_t ids[BATCH];
  for (int q = 0; q < BATCH; q++) ids[q] = (rnd(&p->seed) >> 8) % KEYS, b.keys[q] = key_of(ids[q]);
  skv__helper_burst(p->helper, true); /* per batch, as per publish: the helper also sleeps */
  const bool posted = skv__helper_post(p->helper, claim_batch, &b);
  if (!posted) claim_batch(&b);
  uint32_t pages[BATCH];
  size_t got = 0;
  uint64_t ev = 0;
  (void)skv__pool_alloc_n(&p->pool, evict_cb, p, pages, BATCH, &got, &ev); /* meanwhile */
  if (posted) skv__helper_join(p->helper);
  skv__helper_burst(p->helper, false);
  p->batches++;
  p->helped += b.by_helper;
  size_t used = 0;
  for (int q = 0; q < BATCH; q++) {
    if (b.crc[q] != 0) continue;
    if (used == got) { /* no page for it */
      skv__index_release(&p->ix, b.keys[q], &b.cl[q]);
      continue;
    }
    const uint32_t page = pages[used++];
    uint8_t *d = data[p->me] + (size_t)page * PAGE_BYTES;
    for (size_t i = 0; i < PAGE_BYTES; i++) d[i] = pattern(ids[q], i);
    skv__pool_ready(&p->pool, page, b.keys[q].hi, b.keys[q].lo);
    const uint32_t gen = skv__pool_gen(&p->pool, (uint32_t)p->me, page);
    if (skv__index_publish(&p->ix, &b.cl[q], skv__val_pack((uint32_t)p->me, page, gen)) == 0) {
      skv__pool_commit(&p->pool, page);
      p->published++;
    } else {
      skv__pool_release(&p->pool, page);
      p->deduplicated++;
    }
  }
  for (; used < got; used++) skv__pool_release(&p->pool, pages[used]);
  p->reclaim_pending = skv__helper_post(p->helper, reclaim_job, p);
}

static void fetch(pe_t *p, uint64_t id) {
  skv_key_t k = key_of(id);
  uint64_t val;
  if (skv__index_lookup(&p->ix, k, &val) != 0) return;
  p->hits++;
  uint32_t pe = skv__val_pe(val), page = skv__val_page(val), gen = skv__val_gen(val);
  const uint64_t revoked0 = skv__pool_revoked(&p->pool); /* as skv_kv_fetch does */
  if (skv__pool_pin(&p->pool, pe, page, gen) != 0) {
    p->stale++;
    return;
  }
  skv__pool_touch(&p->pool, pe, page, skv__now_ns());
  const uint8_t *d = data[pe] + (size_t)page * PAGE_BYTES;
  uint64_t wrong = 0;
  for (size_t i = 0; i < PAGE_BYTES; i++) wrong += d[i] != pattern(id, i);
  if (skv__pool_revoked(&p->pool) != revoked0) { /* the library reports SKV_ESTALE here */
    p->stale++;
    (void)skv__pool_unpin(&p->pool, pe, page);
    return;
  }
  p->wrong += wrong;
  p->verified++;
  (void)skv__pool_unpin(&p->pool, pe, page);
}

static void *pe_main(void *arg) {
  pe_t *p = arg;
  while (skv__now_ms() < deadline_ms) {
    /* as every KV call does: a PE making progress renews its pins' lease (pool.h, Leases);
     * without it every pin would be revoked once the run outlasts SKV_PIN_LEASE_MS */
    (void)skv__pool_renew(&p->pool);
    for (int i = 0; i < 256; i++) {
      uint64_t r = rnd(&p->seed), id = (r >> 8) % KEYS;
      if (r % 16 < 4)
        publish(p, id);
      else if (r % 16 < 5)
        publish_batch(p);
      else if (r % 16 < 15)
        fetch(p, id);
      else
        (void)skv__pool_evict(&p->pool, 1, evict_cb, p); /* counted by evict_cb */
    }
  }
  return NULL;
}

int main(int argc, char **argv) {
  int seconds = 30;
  uint64_t seed = (uint64_t)skv__now_ns();
  for (int i = 1; i + 1 < argc; i += 2) {
    if (strcmp(argv[i], "--seconds") == 0) seconds = atoi(argv[i + 1]);
    if (strcmp(argv[i], "--seed") == 0) seed = strtoull(argv[i + 1], NULL, 0);
  }
  printf("probe_tsan: seed %#llx, %d PEs as threads, %d s\n", (unsigned long long)seed, NPES,
         seconds);
  fflush(stdout);
  void *pool_seg[NPES], *shard_seg[NPES];
  for (int i = 0; i < NPES; i++) {
    pool_seg[i] = aligned_alloc(64, SKV_ALIGN_UP(skv__pool_meta_bytes(PAGES), 64));
    shard_seg[i] = aligned_alloc(64, SKV_ALIGN_UP(skv__index_shard_bytes(SLOTS), 64));
    data[i] = aligned_alloc(64, (size_t)PAGES * PAGE_BYTES);
    if (!pool_seg[i] || !shard_seg[i] || !data[i]) return 2;
    memset(pool_seg[i], 0, skv__pool_meta_bytes(PAGES));
    memset(shard_seg[i], 0, skv__index_shard_bytes(SLOTS));
  }
  for (int i = 0; i < NPES; i++) { /* every PE's records exist before anyone looks (kv-ready) */
    pe_t *p = &pes[i];
    p->me = i;
    p->seed = seed ^ (uint64_t)(i + 1) * 0x1234567ull;
    if (skv__pool_init(&p->pool, NPES, i, PAGES, pool_seg, 0) != 0) return 2;
    p->ix.hdr = p->hdr;
    p->ix.slots = p->slots;
    skv__index_bind(&p->ix, NPES, SLOTS, shard_seg, alive, p);
    if (skv__helper_create(SKV_SUBSYS_KV, "probe_tsan", &p->helper) != 0) return 2;
  }
  deadline_ms = skv__now_ms() + (uint64_t)seconds * 1000;
  pthread_t th[NPES];
  for (int i = 0; i < NPES; i++)
    if (pthread_create(&th[i], NULL, pe_main, &pes[i]) != 0) return 2;
  uint64_t pub = 0, dedup = 0, hits = 0, ver = 0, stale = 0, ev = 0, wrong = 0, nb = 0, helped = 0,
           recl = 0;
  for (int i = 0; i < NPES; i++) {
    pthread_join(th[i], NULL);
    pe_t *p = &pes[i];
    reclaim_end(p);
    recl += p->reclaimed;
    pub += p->published, dedup += p->deduplicated, hits += p->hits, ver += p->verified;
    stale += p->stale, ev += p->evicted, wrong += p->wrong;
    nb += p->batches, helped += p->helped;
  }
  /* the helpers must have run some batches' claims and reclaims, or their races were not looked
   * at */
  const bool unhelped = nb > 0 && (helped == 0 || recl == 0);
  int64_t valid = skv__index_check(&pes[0].ix);
  printf("probe_tsan: %llu pages published (%llu deduplicated or lost), %llu evicted, %llu lookup "
         "hits, %llu pages pinned and verified (%llu stale), %llu wrong bytes; %llu batches, the "
         "claims of %llu by a helper thread, %llu pages evicted ahead by it; index check: %lld "
         "valid keys%s\n",
         (unsigned long long)pub, (unsigned long long)dedup, (unsigned long long)ev,
         (unsigned long long)hits, (unsigned long long)ver, (unsigned long long)stale,
         (unsigned long long)wrong, (unsigned long long)nb, (unsigned long long)helped,
         (unsigned long long)recl, (long long)valid,
         wrong || valid < 0 || unhelped ? "; FAILED"
                                        : "; races: see ThreadSanitizer above (none: exit 0)");
  for (int i = 0; i < NPES; i++) skv__helper_destroy(pes[i].helper);
  for (int i = 0; i < NPES; i++) skv__pool_fini(&pes[i].pool);
  for (int i = 0; i < NPES; i++) {
    free(pool_seg[i]);
    free(shard_seg[i]);
    free(data[i]);
  }
  return wrong || valid < 0 || unhelped ? 1 : 0;
}
