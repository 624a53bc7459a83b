/* Tests of the lock-free index on its own: semantics against a reference, tombstone churn,
 * full windows, dead owners' claims, and forked processes racing on shared memory. */
#define _GNU_SOURCE
#include "skv_test.h"

#include "index/index.h"

#include <criterion/criterion.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

TestSuite(index, .timeout = 120);

/* An assertion for hot loops: Criterion's own asserts are each reported to the runner under
 * --full-stats (as ctest runs the suites), which makes 400,000 of them take minutes. */
#define LOOP_CHECK(cond, ...)                 \
  do {                                        \
    if (!(cond)) cr_assert_fail(__VA_ARGS__); \
  } while (0)

typedef struct table {
  skv__index_t ix;
  skv__index_shard_hdr_t *hdr[8];
  skv__index_slot_t *slots[8];
  void *mem;
  size_t bytes;
  bool dead[64];
  bool slow_alive; /* liveness takes a while, as the pool's /proc read does */
  int go;          /* start flag for racing children */
} table_t;

static bool alive_fn(void *arg, int pe) {
  table_t *t = arg;
  bool alive = !t->dead[pe];
  if (t->slow_alive) sched_yield(); /* the answer may be stale by the time it is acted on */
  return alive;
}

/* A table in shared anonymous memory (so forked children share it). */
static table_t *table_new(int nshards, uint64_t sps) {
  table_t *t = mmap(NULL, sizeof *t, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  memset(t, 0, sizeof *t);
  uint64_t sb = SKV_ALIGN_UP(skv__index_shard_bytes(sps), 64);
  t->bytes = sb * (uint64_t)nshards;
  t->mem = mmap(NULL, t->bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  cr_assert_neq(t->mem, MAP_FAILED);
  void *seg[8];
  for (int i = 0; i < nshards; i++) seg[i] = (char *)t->mem + sb * (uint64_t)i;
  t->ix.hdr = t->hdr;
  t->ix.slots = t->slots;
  skv__index_bind(&t->ix, nshards, sps, seg, alive_fn, t);
  return t;
}

static skv_key_t rand_key(uint64_t *s) {
  skv_key_t k = {skv_test_rand(s) | (1ull << 63), skv_test_rand(s)};
  return k;
}

Test(index, insert_lookup_erase_semantics) {
  table_t *t = table_new(2, 64);
  uint64_t s = skv_test_seed(), v;
  skv_key_t k = rand_key(&s), other = rand_key(&s);
  cr_assert_eq(skv__index_lookup(&t->ix, k, &v), SKV_ENOTFOUND);
  uint64_t val = skv__val_pack(1, 77, 5);
  cr_assert_eq(skv__index_insert(&t->ix, k, val, 1), 0);
  cr_assert_eq(skv__index_lookup(&t->ix, k, &v), 0);
  cr_assert_eq(v, val);
  cr_assert_eq(skv__val_pe(v), 1);
  cr_assert_eq(skv__val_page(v), 77);
  cr_assert_eq(skv__val_gen(v), 5);
  cr_assert_eq(skv__index_insert(&t->ix, k, skv__val_pack(0, 3, 1), 0), SKV_EEXIST,
               "first writer wins");
  cr_assert_eq(skv__index_lookup(&t->ix, k, &v), 0);
  cr_assert_eq(v, val);
  cr_assert_eq(skv__index_entries(&t->ix), 1);
  cr_assert_eq(skv__index_erase(&t->ix, k, skv__val_pack(1, 77, 4)), SKV_ENOTFOUND,
               "wrong generation");
  cr_assert_eq(skv__index_erase(&t->ix, other, val), SKV_ENOTFOUND);
  cr_assert_eq(skv__index_erase(&t->ix, k, val), 0);
  cr_assert_eq(skv__index_lookup(&t->ix, k, &v), SKV_ENOTFOUND);
  cr_assert_eq(skv__index_entries(&t->ix), 0);
  uint64_t val2 = skv__val_pack(0, 3, 6);
  cr_assert_eq(skv__index_insert(&t->ix, k, val2, 0), 0, "re-insert after erase");
  cr_assert_eq(skv__index_lookup(&t->ix, k, &v), 0);
  cr_assert_eq(v, val2);
  cr_assert_eq(skv__index_check(&t->ix), 1);
}

/* An insert in two halves (a publish claims its keys before its copy, and publishes each once
 * the copy is complete): a claimed key is a miss to readers, every other inserter or claimer of
 * it loses until it is published, a release leaves it free for the next one, and a claim of a
 * PE that died before publishing is cleared by the next inserter. */
Test(index, claimed_keys_are_misses_win_over_later_inserts_and_publish_or_release) {
  table_t *t = table_new(2, 64);
  uint64_t s = skv_test_seed(), v;
  skv_key_t k = rand_key(&s), k2 = rand_key(&s);
  skv__index_claim_t c, c2;
  bool raced = true;
  cr_assert_eq(skv__index_claim(&t->ix, k, 1, &c, &raced), 0);
  cr_assert(!raced);
  cr_assert_eq(skv__index_lookup(&t->ix, k, &v), SKV_ENOTFOUND, "a claim is not a hit");
  cr_assert_eq(skv__index_entries(&t->ix), 0);
  cr_assert_eq(skv__index_check(&t->ix), 0, "PENDING is not VALID");
  /* later inserters and claimers of the key lose to the claim (it is older) */
  cr_assert_eq(skv__index_insert(&t->ix, k, skv__val_pack(2, 9, 1), 2), SKV_EEXIST);
  cr_assert_eq(skv__index_claim(&t->ix, k, 2, &c2, &raced), SKV_EEXIST);
  cr_assert(raced, "lost to a copy in flight, not to a cached key");
  cr_assert_eq(skv__index_lookup(&t->ix, k, &v), SKV_ENOTFOUND);
  /* published: found with the value given at publish time */
  const uint64_t val = skv__val_pack(1, 77, 5);
  cr_assert_eq(skv__index_publish(&t->ix, &c, val), 0);
  cr_assert_eq(skv__index_entries(&t->ix), 0, "a batch counts its publishes itself");
  skv__index_count(&t->ix, 1, 1);
  cr_assert_eq(skv__index_lookup(&t->ix, k, &v), 0);
  cr_assert_eq(v, val);
  cr_assert_eq(skv__index_entries(&t->ix), 1);
  cr_assert_eq(skv__index_claim(&t->ix, k, 2, &c2, &raced), SKV_EEXIST);
  cr_assert(!raced, "the key is cached");
  cr_assert_eq(c2.valid, val, "the claim gives the cached key's value");
  /* a released claim leaves nothing behind: the key is free for the next inserter */
  cr_assert_eq(skv__index_claim(&t->ix, k2, 1, &c, &raced), 0);
  skv__index_release(&t->ix, k2, &c);
  cr_assert_eq(skv__index_lookup(&t->ix, k2, &v), SKV_ENOTFOUND);
  cr_assert_eq(skv__index_publish(&t->ix, &c, skv__val_pack(1, 78, 1)), SKV_EEXIST,
               "a released claim cannot be published");
  cr_assert_eq(skv__index_lookup(&t->ix, k2, &v), SKV_ENOTFOUND);
  cr_assert_eq(skv__index_insert(&t->ix, k2, skv__val_pack(2, 10, 1), 2), 0);
  cr_assert_eq(skv__index_lookup(&t->ix, k2, &v), 0);
  cr_assert_eq(skv__val_pe(v), 2);
  cr_assert_eq(skv__index_check(&t->ix), 2);
  /* PE 3 claims a key and dies before publishing: the next inserter clears its claim */
  skv_key_t k3 = rand_key(&s);
  cr_assert_eq(skv__index_claim(&t->ix, k3, 3, &c, &raced), 0);
  cr_assert_eq(skv__index_insert(&t->ix, k3, skv__val_pack(2, 11, 1), 2), SKV_EEXIST);
  t->dead[3] = true;
  cr_assert_eq(skv__index_insert(&t->ix, k3, skv__val_pack(2, 11, 1), 2), 0);
  cr_assert_eq(skv__index_publish(&t->ix, &c, skv__val_pack(3, 12, 1)), SKV_EEXIST,
               "a cleared claim cannot be published");
  cr_assert_eq(skv__index_lookup(&t->ix, k3, &v), 0);
  cr_assert_eq(skv__val_pe(v), 2);
  cr_assert_eq(skv__index_check(&t->ix), 3);
}

/* An eviction erases the entry where its publish put it (the page record keeps the claim's
 * islot): the slot must hold exactly the key and value, else nothing is erased and the caller
 * walks (skv__index_erase). */
Test(index, erase_at_the_published_slot_checks_key_and_value) {
  table_t *t = table_new(2, 64);
  uint64_t s = skv_test_seed(), v;
  skv_key_t k = rand_key(&s), k2 = rand_key(&s);
  skv__index_claim_t c, c2;
  bool raced;
  const uint64_t val = skv__val_pack(1, 7, 3), val2 = skv__val_pack(1, 8, 3);
  cr_assert_eq(skv__index_claim(&t->ix, k, 1, &c, &raced), 0);
  cr_assert_eq(skv__index_publish(&t->ix, &c, val), 0);
  cr_assert_eq(skv__index_claim(&t->ix, k2, 1, &c2, &raced), 0);
  cr_assert_eq(skv__index_publish(&t->ix, &c2, val2), 0);
  skv__index_count(&t->ix, 1, 2);
  const uint64_t at = skv__index_islot(&c), at2 = skv__index_islot(&c2);
  cr_assert_neq(at, 0);
  cr_assert_eq(skv__index_erase_at(&t->ix, k, val, 0, true), SKV_ENOTFOUND, "no hint");
  cr_assert_eq(skv__index_erase_at(&t->ix, k, skv__val_pack(1, 7, 2), at, true), SKV_ENOTFOUND,
               "another generation");
  cr_assert_eq(skv__index_erase_at(&t->ix, k, val2, at2, true), SKV_ENOTFOUND,
               "another key's slot");
  cr_assert_eq(skv__index_erase_at(&t->ix, k, val, at + (1ull << 40), true), SKV_ENOTFOUND,
               "no such shard");
  cr_assert_eq(skv__index_lookup(&t->ix, k, &v), 0, "nothing erased so far");
  cr_assert_eq(skv__index_lookup(&t->ix, k2, &v), 0);
  cr_assert_eq(skv__index_erase_at(&t->ix, k, val, at, true), 0);
  cr_assert_eq(skv__index_lookup(&t->ix, k, &v), SKV_ENOTFOUND);
  cr_assert_eq(skv__index_erase_at(&t->ix, k, val, at, true), SKV_ENOTFOUND, "erased once");
  cr_assert_eq(skv__index_lookup(&t->ix, k2, &v), 0);
  cr_assert_eq(v, val2);
  cr_assert_eq(skv__index_entries(&t->ix), 1);
  cr_assert_eq(skv__index_check(&t->ix), 1);
}

/* A PE gone from an elastic domain: skv__index_forget_pe clears what it left, its VALID entries,
 * its PENDING claims and its erases left half way (val ERASING with the key whole, or with only
 * the key's low half made a tombstone's), and nothing of another PE. */
Test(index, forget_pe_clears_entries_claims_and_half_done_erases) {
  table_t *t = table_new(1, 64);
  uint64_t s = skv_test_seed(), v;
  skv_key_t kv5 = rand_key(&s), kp5 = rand_key(&s), ko = rand_key(&s);
  skv_key_t e1 = rand_key(&s), e2 = rand_key(&s);
  skv__index_claim_t c;
  bool raced;
  cr_assert_eq(skv__index_insert(&t->ix, kv5, skv__val_pack(5, 1, 1), 5), 0);
  cr_assert_eq(skv__index_insert(&t->ix, ko, skv__val_pack(2, 2, 1), 2), 0);
  cr_assert_eq(skv__index_claim(&t->ix, kp5, 5, &c, &raced), 0);
  /* two erases of PE 5 stopped half way, forged where the keys would go */
  cr_assert_eq(skv__index_insert(&t->ix, e1, skv__val_pack(5, 3, 1), 5), 0);
  cr_assert_eq(skv__index_insert(&t->ix, e2, skv__val_pack(5, 4, 1), 5), 0);
  for (unsigned i = 0; i < 64; i++) {
    skv__index_slot_t *sl = &t->slots[0][i];
    if (sl->key.p.hi == e1.hi && sl->key.p.lo == e1.lo) sl->val = SKV_VAL_ERASING | (5ull << 56);
    if (sl->key.p.hi == e2.hi && sl->key.p.lo == e2.lo)
      sl->val = SKV_VAL_ERASING | (5ull << 56), sl->key.p.lo = 1; /* only lo made a tombstone's */
  }
  cr_assert_eq(skv__index_forget_pe(&t->ix, 5), 4, "an entry, a claim and two erases");
  cr_assert_eq(skv__index_lookup(&t->ix, kv5, &v), SKV_ENOTFOUND);
  cr_assert_eq(skv__index_lookup(&t->ix, ko, &v), 0, "another PE's entry stays");
  for (unsigned i = 0; i < 64; i++) {
    const skv__index_slot_t *sl = &t->slots[0][i];
    cr_assert(!(sl->key.p.hi != 0 && (sl->val & SKV_VAL_ERASING)), "slot %u still ERASING", i);
  }
  /* every key of PE 5 can be cached again */
  cr_assert_eq(skv__index_insert(&t->ix, kp5, skv__val_pack(2, 5, 1), 2), 0);
  cr_assert_eq(skv__index_insert(&t->ix, e1, skv__val_pack(2, 6, 1), 2), 0);
  cr_assert_eq(skv__index_insert(&t->ix, e2, skv__val_pack(2, 7, 1), 2), 0);
  cr_assert_eq(skv__index_check(&t->ix), 4);
}

/* The shard of a key is (hi >> 32) mod the shards, computed without a divide: the same shard as
 * the divide (the table's layout in shared memory depends on it), for every count of shards. */
Test(index, shard_by_multiply_matches_the_remainder) {
  uint64_t s = skv_test_seed();
  static const int counts[] = {1, 2, 3, 5, 7, 8, 13, 31, 32, 33, 63, 64, 1000};
  const uint64_t sps = SKV_INDEX_WINDOW, sb = SKV_ALIGN_UP(skv__index_shard_bytes(sps), 64);
  for (size_t c = 0; c < SKV_ARRAY_LEN(counts); c++) {
    const int n = counts[c];
    char *mem = aligned_alloc(64, sb * (uint64_t)n);
    void **seg = malloc((size_t)n * sizeof *seg);
    skv__index_t ix;
    ix.hdr = malloc((size_t)n * sizeof *ix.hdr);
    ix.slots = malloc((size_t)n * sizeof *ix.slots);
    cr_assert(mem && seg && ix.hdr && ix.slots);
    memset(mem, 0, sb * (uint64_t)n);
    for (int i = 0; i < n; i++) seg[i] = mem + sb * (uint64_t)i;
    skv__index_bind(&ix, n, sps, seg, NULL, NULL);
    for (int i = 0; i < 100000; i++) {
      skv_key_t k = rand_key(&s);
      if (i < 3) k.hi = (uint64_t)(i == 0 ? 1u : i == 1 ? UINT32_MAX : UINT32_MAX - 1u) << 32 | 1u;
      LOOP_CHECK(skv__index_shard(&ix, k) == (int)((k.hi >> 32) % (uint64_t)n),
                 "%d shards, hi %016llx: %d", n, (unsigned long long)k.hi,
                 skv__index_shard(&ix, k));
    }
    free(ix.hdr), free(ix.slots), free(seg), free(mem);
  }
}

/* A key cached past a tombstone (its home slot freed by an erase): the claim takes the tombstone,
 * its rescan finds the VALID copy, and the claim is given up with the key reported cached (not a
 * lost race: a publish counts it as nothing, not as deduplicated); the tombstone is free again. */
Test(index, a_claim_of_a_key_cached_past_a_tombstone_is_cached_not_raced) {
  table_t *t = table_new(1, 64);
  uint64_t s = skv_test_seed(), v;
  skv_key_t a = rand_key(&s), k = rand_key(&s);
  k.lo = (k.lo & ~63ull) | (a.lo & 63); /* the same home slot */
  const uint64_t home = a.lo & 63;
  cr_assert_eq(skv__index_insert(&t->ix, a, skv__val_pack(1, 1, 1), 1), 0);
  cr_assert_eq(skv__index_insert(&t->ix, k, skv__val_pack(1, 2, 1), 1), 0);
  cr_assert_eq(t->slots[0][home].key.p.lo, a.lo, "a at its home");
  cr_assert_eq(skv__index_erase(&t->ix, a, skv__val_pack(1, 1, 1)), 0);
  cr_assert(t->slots[0][home].key.p.hi == 0 && t->slots[0][home].key.p.lo == 1, "a tombstone");
  skv__index_claim_t c;
  bool raced = true;
  cr_assert_eq(skv__index_claim(&t->ix, k, 2, &c, &raced), SKV_EEXIST);
  cr_assert(!raced, "cached, not a lost race");
  cr_assert_eq(c.valid, skv__val_pack(1, 2, 1), "the value of the copy found past our slot");
  cr_assert(t->slots[0][home].key.p.hi == 0 && t->slots[0][home].key.p.lo == 1,
            "the tombstone is free again");
  cr_assert_eq(skv__index_lookup(&t->ix, k, &v), 0);
  cr_assert_eq(skv__val_page(v), 2);
  cr_assert_eq(skv__index_check(&t->ix), 1);
}

Test(index, full_window_gives_enospc_and_lookups_still_work) {
  table_t *t = table_new(1, 64);
  uint64_t s = skv_test_seed(), v;
  skv_key_t keys[SKV_INDEX_WINDOW + 1];
  for (unsigned i = 0; i <= SKV_INDEX_WINDOW; i++) {
    keys[i] = rand_key(&s);
    keys[i].lo = (keys[i].lo & ~63ull) | 5; /* same home slot */
  }
  for (unsigned i = 0; i < SKV_INDEX_WINDOW; i++)
    cr_assert_eq(skv__index_insert(&t->ix, keys[i], skv__val_pack(0, i, 1), 0), 0);
  cr_assert_eq(skv__index_insert(&t->ix, keys[SKV_INDEX_WINDOW], skv__val_pack(0, 99, 1), 0),
               SKV_ENOSPC);
  for (unsigned i = 0; i < SKV_INDEX_WINDOW; i++) {
    cr_assert_eq(skv__index_lookup(&t->ix, keys[i], &v), 0);
    cr_assert_eq(skv__val_page(v), i);
  }
  cr_assert_eq(skv__index_lookup(&t->ix, keys[SKV_INDEX_WINDOW], &v), SKV_ENOTFOUND);
  /* a tombstone makes room again */
  cr_assert_eq(skv__index_erase(&t->ix, keys[7], skv__val_pack(0, 7, 1)), 0);
  cr_assert_eq(skv__index_insert(&t->ix, keys[SKV_INDEX_WINDOW], skv__val_pack(0, 99, 1), 0), 0);
  cr_assert_eq(skv__index_lookup(&t->ix, keys[SKV_INDEX_WINDOW], &v), 0);
}

Test(index, churn_matches_a_reference_model) {
  enum { NKEYS = 3000, OPS = 400000 };
  table_t *t = table_new(4, 2048); /* 8192 slots, at most 3000 live */
  uint64_t s = skv_test_seed();
  skv_key_t *keys = malloc(sizeof *keys * NKEYS);
  uint64_t *model = calloc(NKEYS, sizeof *model); /* 0: absent, else val */
  uint32_t gen = 1;
  for (int i = 0; i < NKEYS; i++) keys[i] = rand_key(&s);
  size_t live = 0;
  for (int op = 0; op < OPS; op++) {
    int i = (int)(skv_test_rand(&s) % NKEYS);
    uint64_t v;
    switch (skv_test_rand(&s) % 3) {
    case 0: {
      uint64_t val = skv__val_pack((uint32_t)(op % 4), (uint32_t)i, gen++);
      int rc = skv__index_insert(&t->ix, keys[i], val, op % 4);
      if (model[i])
        LOOP_CHECK(rc == SKV_EEXIST, "op %d: insert of a cached key: %s", op, skv_err_name(rc));
      else {
        LOOP_CHECK(rc == 0, "op %d: %s", op, skv_err_name(rc));
        model[i] = val;
        live++;
      }
      break;
    }
    case 1: {
      int rc = skv__index_lookup(&t->ix, keys[i], &v);
      if (model[i])
        LOOP_CHECK(rc == 0 && v == model[i], "op %d lookup", op);
      else
        LOOP_CHECK(rc == SKV_ENOTFOUND, "op %d phantom", op);
      break;
    }
    default:
      if (model[i]) {
        LOOP_CHECK(skv__index_erase(&t->ix, keys[i], model[i]) == 0, "op %d erase", op);
        model[i] = 0;
        live--;
      } else {
        LOOP_CHECK(skv__index_erase(&t->ix, keys[i], skv__val_pack(0, 0, 1)) == SKV_ENOTFOUND,
                   "op %d erase of an absent key", op);
      }
    }
  }
  cr_assert_eq(skv__index_check(&t->ix), (int64_t)live);
  cr_assert_eq(skv__index_entries(&t->ix), live);
  size_t nhit;
  uint64_t vals[NKEYS];
  skv__index_lookup_prefix(&t->ix, keys, NKEYS, vals, &nhit);
  size_t want = 0;
  while (want < NKEYS && model[want]) want++;
  cr_assert_eq(nhit, want, "prefix lookup stops at the first miss");
  free(keys);
  free(model);
}

Test(index, pending_claim_of_a_dead_pe_is_cleared) {
  table_t *t = table_new(1, 64);
  uint64_t s = skv_test_seed(), v;
  skv_key_t k = rand_key(&s);
  /* Forge what a PE that died between claim and publish leaves: key set, PENDING, ticket. */
  uint64_t home = k.lo & 63;
  skv__index_slot_t *slot = &t->slots[0][home];
  slot->key.p.hi = k.hi;
  slot->key.p.lo = k.lo;
  slot->val = skv__val_pending(5, 1);
  slot->ticket = 1;
  t->hdr[0]->ticket = 1;
  /* While PE 5 lives, its older claim wins. */
  cr_assert_eq(skv__index_insert(&t->ix, k, skv__val_pack(2, 9, 1), 2), SKV_EEXIST);
  cr_assert_eq(skv__index_lookup(&t->ix, k, &v), SKV_ENOTFOUND, "PENDING is not a hit");
  t->dead[5] = true;
  cr_assert_eq(skv__index_insert(&t->ix, k, skv__val_pack(2, 9, 1), 2), 0);
  cr_assert_eq(skv__index_lookup(&t->ix, k, &v), 0);
  cr_assert_eq(skv__val_pe(v), 2);
  cr_assert_eq(skv__index_check(&t->ix), 1);
}

/* Forge, at k's home slot, a claim of another inserter in one of its states. */
static skv__index_slot_t *forge_claim(table_t *t, skv_key_t k, uint64_t val, uint64_t ticket) {
  skv__index_slot_t *slot = &t->slots[0][k.lo & 63];
  slot->key.p.hi = k.hi;
  slot->key.p.lo = k.lo;
  slot->val = val;
  slot->ticket = ticket;
  if (t->hdr[0]->ticket < ticket) t->hdr[0]->ticket = ticket;
  return slot;
}

/* Insert in a child with a deadline (an insert that spins must fail the test, not hang it). */
static int insert_within(table_t *t, skv_key_t k, uint64_t val, int pe, int ms) {
  int *rc = mmap(NULL, sizeof *rc, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  *rc = 1;
  pid_t pid = fork();
  if (pid == 0) {
    *rc = skv__index_insert(&t->ix, k, val, pe);
    _exit(0);
  }
  uint64_t end = skv__now_ms() + (uint64_t)ms;
  int st;
  while (waitpid(pid, &st, WNOHANG) == 0) {
    if (skv__now_ms() > end) {
      kill(pid, SIGKILL);
      waitpid(pid, &st, 0);
      munmap(rc, sizeof *rc);
      cr_assert_fail("insert still running after %d ms", ms);
    }
    usleep(1000);
  }
  int r = *rc;
  munmap(rc, sizeof *rc);
  return r;
}

/* A PE that died (or stopped) right after claiming a slot, before its PENDING value: the val is
 * still what the slot held (0 from EMPTY, ERASING from a tombstone). Its ticket would be newer
 * than ours, so it is passed over, whichever PE it was (PE 0's PENDING is not 0). */
Test(index, a_claim_without_its_pending_value_does_not_hold_up_inserts) {
  table_t *t = table_new(1, 64);
  uint64_t s = skv_test_seed(), v;
  uint64_t before[] = {0, SKV_VAL_ERASING};
  for (int i = 0; i < 2; i++) {
    skv_key_t k = rand_key(&s);
    skv__index_slot_t *slot = forge_claim(t, k, before[i], 0);
    uint64_t val = skv__val_pack(2, 9, (uint32_t)i + 1);
    cr_assert_eq(insert_within(t, k, val, 2, 5000), 0, "val %llx", (unsigned long long)before[i]);
    cr_assert_eq(skv__index_lookup(&t->ix, k, &v), 0);
    cr_assert_eq(v, val);
    /* the claimer comes back: it stores PENDING, takes a newer ticket and loses to our copy */
    slot->val = skv__val_pending(0, 1);
    slot->ticket = ++t->hdr[0]->ticket;
    cr_assert_eq(insert_within(t, k, skv__val_pack(0, 1, 1), 0, 5000), SKV_EEXIST);
    cr_assert_eq(skv__index_erase(&t->ix, k, val), 0);
  }
}

/* A PE stopped (SIGSTOP, a debugger) between its PENDING value and its ticket: an inserter of
 * the same key waits a bounded time, then loses (does not cache its page); once the owner is
 * known dead, its claim is cleared and the insert wins. */
Test(index, a_stopped_claim_without_ticket_makes_inserts_lose_not_hang) {
  table_t *t = table_new(1, 64);
  uint64_t s = skv_test_seed(), v;
  skv_key_t k = rand_key(&s);
  forge_claim(t, k, skv__val_pending(5, 1), 0);
  uint64_t t0 = skv__now_ms();
  cr_assert_eq(insert_within(t, k, skv__val_pack(2, 9, 1), 2, 5000), SKV_EEXIST);
  cr_assert_geq(skv__now_ms() - t0, 50, "gave up before the owner had a chance to run");
  cr_assert_eq(skv__index_lookup(&t->ix, k, &v), SKV_ENOTFOUND);
  t->dead[5] = true;
  cr_assert_eq(insert_within(t, k, skv__val_pack(2, 9, 2), 2, 5000), 0);
  cr_assert_eq(skv__index_lookup(&t->ix, k, &v), 0);
  cr_assert_eq(v, skv__val_pack(2, 9, 2));
  cr_assert_eq(skv__index_check(&t->ix), 1);
}

/* Inserters that wrongly believe live PEs dead clear those PEs' PENDING claims while they run:
 * the worst a liveness mistake, or a decision taken on a read that is stale by the time it is
 * acted on, can do. Keys are inserted, erased and inserted again by several processes at once.
 * Whatever the interleaving, a reader never gets a page for another key, a VALID slot holds the
 * key that inserted it, a key is VALID at most once, and what each process holds is indexed. */
Test(index, clearing_live_claims_never_mixes_up_keys) {
  enum { NPROC = 4, NKEYS = 96, OPS = 30000, ROUNDS = 4 };
  table_t *t = table_new(1, 256); /* one shard: keys share windows */
  t->slow_alive = true;
  uint64_t seed = skv_test_seed();
  skv_key_t *keys = mmap(NULL, sizeof(skv_key_t) * NKEYS, PROT_READ | PROT_WRITE,
                         MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  uint64_t *held = mmap(NULL, sizeof(uint64_t) * NPROC * NKEYS, PROT_READ | PROT_WRITE,
                        MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  int *lost =
      mmap(NULL, sizeof(int) * NPROC, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  uint64_t s = seed;
  for (int i = 0; i < NKEYS; i++) {
    keys[i] = rand_key(&s);
    keys[i].lo = (keys[i].lo & ~255ull) | (uint64_t)(i % 24) * 10; /* 4 keys per home slot */
  }
  for (int round = 0; round < ROUNDS; round++) {
    memset(held, 0, sizeof(uint64_t) * NPROC * NKEYS);
    memset(lost, 0, sizeof(int) * NPROC);
    volatile int *go = &t->go;
    *go = 0;
    pid_t pids[NPROC + 2];
    for (int p = 0; p < NPROC + 2; p++) {
      pids[p] = fork();
      if (pids[p] != 0) continue;
      uint64_t ps = seed ^ (uint64_t)(round * 16 + p + 1) * 0x9e3779b97f4a7c15ull;
      while (!*go) SKV_CPU_RELAX();
      if (p == NPROC) { /* the liar: flips PEs between dead and alive */
        while (*go == 1) {
          t->dead[skv_test_rand(&ps) % NPROC] ^= 1;
          sched_yield();
        }
        _exit(0);
      }
      if (p == NPROC + 1) { /* the reader */
        while (*go == 1) {
          int i = (int)(skv_test_rand(&ps) % NKEYS);
          uint64_t v;
          if (skv__index_lookup(&t->ix, keys[i], &v) == 0 && skv__val_page(v) != (uint32_t)i) {
            fprintf(stderr, "lookup of key %d returned key %u's page\n", i, skv__val_page(v));
            _exit(3);
          }
        }
        _exit(0);
      }
      for (int j = 0; j < OPS; j++) {
        int i = (int)((p % 2 ? OPS - j : j) % NKEYS); /* pairs of processes on one key at once */
        uint64_t *h = &held[p * NKEYS + i];
        if (*h) {
          if (skv_test_rand(&ps) % 2) continue;
          if (skv__index_erase(&t->ix, keys[i], *h) != 0) {
            fprintf(stderr, "child %d: key %d it holds is not indexed\n", p, i);
            _exit(3);
          }
          *h = 0;
        }
        uint64_t val = skv__val_pack((uint32_t)p, (uint32_t)i, (uint32_t)j + 1);
        int rc = skv__index_insert(&t->ix, keys[i], val, p);
        if (rc == 0)
          *h = val;
        else if (rc == SKV_EEXIST)
          lost[p]++;
        else {
          fprintf(stderr, "child %d key %d: %s\n", p, i, skv_err_name(rc));
          _exit(3);
        }
      }
      _exit(0);
    }
    *go = 1;
    for (int p = 0; p < NPROC; p++) {
      int st;
      waitpid(pids[p], &st, 0);
      cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "round %d: inserter %d failed", round, p);
    }
    *go = 2; /* stop the liar and the reader */
    for (int p = NPROC; p < NPROC + 2; p++) {
      int st;
      waitpid(pids[p], &st, 0);
      cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "round %d: %s failed", round,
                p == NPROC ? "liar" : "reader");
    }
    memset(t->dead, 0, sizeof t->dead);
    for (uint64_t j = 0; j < t->ix.slots_per_shard; j++) {
      skv__index_slot_t *sl = &t->slots[0][j];
      if (!(sl->val & SKV_VAL_VALID)) continue;
      skv_key_t want = keys[skv__val_page(sl->val)];
      cr_assert(sl->key.p.hi == want.hi && sl->key.p.lo == want.lo,
                "round %d: slot %llu is VALID for key %u but holds another key", round,
                (unsigned long long)j, skv__val_page(sl->val));
    }
    cr_assert_geq(skv__index_check(&t->ix), 0, "%s", skv_last_error());
    for (int i = 0; i < NKEYS; i++) {
      int holders = 0, who = -1;
      for (int p = 0; p < NPROC; p++)
        if (held[p * NKEYS + i]) holders++, who = p;
      cr_assert_leq(holders, 1, "round %d key %d is held by %d processes", round, i, holders);
      uint64_t v;
      int rc = skv__index_lookup(&t->ix, keys[i], &v);
      if (holders) {
        cr_assert(rc == 0 && v == held[who * NKEYS + i],
                  "round %d key %d: its holder's value is not indexed", round, i);
        cr_assert_eq(skv__index_erase(&t->ix, keys[i], v), 0);
      } else {
        cr_assert_eq(rc, SKV_ENOTFOUND, "round %d key %d: indexed without a holder", round, i);
      }
    }
    if (getenv("IDX_STATS"))
      fprintf(stderr, "round %d: inserts lost %d %d %d %d\n", round, lost[0], lost[1], lost[2],
              lost[3]);
    cr_assert_eq(skv__index_check(&t->ix), 0);
  }
  munmap(keys, sizeof(skv_key_t) * NKEYS);
  munmap(held, sizeof(uint64_t) * NPROC * NKEYS);
  munmap(lost, sizeof(int) * NPROC);
}

/* A reader can see (hi, lo) = (0, x) while a tombstone is being claimed (hi read before the
 * 16-byte CAS, lo after it). That is not EMPTY: lookups, erases and inserts must look past it. */
Test(index, a_claim_in_flight_is_not_the_end_of_the_chain) {
  table_t *t = table_new(1, 64);
  uint64_t s = skv_test_seed(), v;
  skv_key_t k = rand_key(&s);
  uint64_t home = k.lo & 63;
  /* occupy the home slot with another key, insert k (it lands one further), then make the
   * home slot look like a torn read of a claim in flight */
  skv_key_t other = rand_key(&s);
  other.lo = (other.lo & ~63ull) | home;
  cr_assert_eq(skv__index_insert(&t->ix, other, skv__val_pack(0, 1, 1), 0), 0);
  uint64_t val = skv__val_pack(1, 2, 3);
  cr_assert_eq(skv__index_insert(&t->ix, k, val, 1), 0);
  skv__index_slot_t *h = &t->slots[0][home];
  h->key.p.hi = 0;
  h->key.p.lo = 0x1234567;
  h->val = SKV_VAL_ERASING;
  cr_assert_eq(skv__index_lookup(&t->ix, k, &v), 0, "lookup stopped at a claim in flight");
  cr_assert_eq(v, val);
  cr_assert_eq(skv__index_insert(&t->ix, k, skv__val_pack(2, 9, 9), 2), SKV_EEXIST,
               "insert missed the copy");
  cr_assert_eq(skv__index_erase(&t->ix, k, val), 0, "erase stopped at a claim in flight");
  cr_assert_eq(skv__index_lookup(&t->ix, k, &v), SKV_ENOTFOUND);
}

/* No EMPTY slot comes back, so a long-running table has none (index.h, Reach): walks stop at
 * the home's reach instead. Keys of one home at distances 0..4, the first four erased (tombstones
 * before the fifth), then every other slot turned into a tombstone too: the fifth key is still
 * found, erased and deduplicated, keys never inserted miss, and inserts reuse the tombstones. */
Test(index, keys_beyond_tombstones_are_found_with_no_empty_slot_left) {
  table_t *t = table_new(1, 64);
  uint64_t s = skv_test_seed(), v;
  const uint64_t home = 17;
  skv_key_t k[5];
  for (int i = 0; i < 5; i++) {
    k[i] = rand_key(&s);
    k[i].lo = (k[i].lo & ~63ull) | home;
    cr_assert_eq(skv__index_insert(&t->ix, k[i], skv__val_pack(0, (uint32_t)i, 1), 0), 0);
  }
  cr_assert_eq(skv__index_check(&t->ix), 5, "walker (reach covers every key)");
  for (int i = 0; i < 4; i++)
    cr_assert_eq(skv__index_erase(&t->ix, k[i], skv__val_pack(0, (uint32_t)i, 1)), 0);
  /* every slot a tombstone but the fifth key's: keys of every home, inserted and erased */
  for (uint64_t h = 0; h < 64; h++) {
    skv_key_t o = rand_key(&s);
    o.lo = (o.lo & ~63ull) | h;
    if (skv__index_insert(&t->ix, o, skv__val_pack(1, 1, (uint32_t)h + 1), 1) == 0)
      cr_assert_eq(skv__index_erase(&t->ix, o, skv__val_pack(1, 1, (uint32_t)h + 1)), 0);
  }
  int empty = 0;
  for (uint64_t i = 0; i < 64; i++)
    empty += t->slots[0][i].key.p.hi == 0 && t->slots[0][i].key.p.lo == 0;
  cr_assert_eq(empty, 0, "%d EMPTY slots left: the test needs none", empty);
  cr_assert_eq(skv__index_lookup(&t->ix, k[4], &v), 0, "the key 4 slots from home was lost");
  cr_assert_eq(v, skv__val_pack(0, 4, 1));
  cr_assert_eq(skv__index_insert(&t->ix, k[4], skv__val_pack(2, 9, 9), 2), SKV_EEXIST,
               "a second copy of the key was inserted");
  for (int i = 0; i < 100; i++) {
    skv_key_t miss = rand_key(&s);
    cr_assert_eq(skv__index_lookup(&t->ix, miss, &v), SKV_ENOTFOUND);
  }
  /* an insert of home 17 takes the first tombstone (the home slot), and is found */
  skv_key_t n = rand_key(&s);
  n.lo = (n.lo & ~63ull) | home;
  cr_assert_eq(skv__index_insert(&t->ix, n, skv__val_pack(0, 7, 7), 0), 0);
  cr_assert_eq(skv__index_lookup(&t->ix, n, &v), 0);
  cr_assert_eq(t->slots[0][home].val, skv__val_pack(0, 7, 7), "the home tombstone was reused");
  cr_assert_eq(skv__index_erase(&t->ix, k[4], skv__val_pack(0, 4, 1)), 0, "erase of the far key");
  cr_assert_eq(skv__index_lookup(&t->ix, k[4], &v), SKV_ENOTFOUND);
  cr_assert_eq(skv__index_check(&t->ix), 1, "walker");
}

/* NPROC processes insert the same keys at once; exactly one wins each. */
#define NKEYS_RACE 20000

static skv_key_t race_key(uint64_t seed, int round, int i) {
  uint64_t ks = (seed + (uint64_t)round) ^ ((uint64_t)i * 0x9e3779b97f4a7c15ull);
  return rand_key(&ks);
}

/* Process p's part of a race: insert every key (batch 0), or claim them in batches of `batch`
 * keys (skv__index_claim_n; every eighth batch lists its first key twice) and publish the
 * batch's claims only after all of it is claimed, as a publish does once its copy completed.
 * won[i] = 1 for the keys it cached. */
static int race_child(table_t *t, int p, int round, uint64_t seed, int batch, int *won) {
  enum { MAXB = 64 };
  skv_key_t keys[MAXB + 1];
  int ids[MAXB + 1], rc[MAXB + 1];
  bool raced[MAXB + 1];
  skv__index_claim_t c[MAXB + 1];
  for (int j = 0; j < NKEYS_RACE;) {
    int n = 0;
    for (; n < (batch ? batch : 1) && j < NKEYS_RACE; n++, j++) {
      ids[n] = (p % 2) ? NKEYS_RACE - 1 - j : j; /* every process in a different order */
      keys[n] = race_key(seed, round, ids[n]);
    }
    if (batch && (j / batch) % 8 == 0) ids[n] = ids[0], keys[n] = keys[0], n++;
    if (!batch) {
      rc[0] = skv__index_insert(
          &t->ix, keys[0], skv__val_pack((uint32_t)p, (uint32_t)ids[0], (uint32_t)round + 1), p);
    } else {
      skv__index_claim_n(&t->ix, keys, (size_t)n, p, c, rc, raced);
      for (int q = 0; q < n; q++)
        if (rc[q] == 0)
          if ((rc[q] = skv__index_publish(
                   &t->ix, &c[q],
                   skv__val_pack((uint32_t)p, (uint32_t)ids[q], (uint32_t)round + 1))) == 0)
            skv__index_count(&t->ix, p, 1);
    }
    for (int q = 0; q < n; q++) {
      if (rc[q] == 0 && won[ids[q]]++) return 4; /* a key cached twice by one process */
      if (rc[q] != 0 && rc[q] != SKV_EEXIST) {
        fprintf(stderr, "child %d key %d: %s\n", p, ids[q], skv_err_name(rc[q]));
        return 3;
      }
    }
  }
  return 0;
}

/* NPROC processes cache the same keys at once (each its own value): every key ends up cached
 * exactly once, with the value of the process that was told it won. */
static void race(int batch) {
  enum { NPROC = 4, NKEYS = NKEYS_RACE, ROUNDS = 3 };
  table_t *t = table_new(4, 16384);
  uint64_t seed = skv_test_seed();
  int *won = mmap(NULL, sizeof(int) * NPROC * NKEYS, PROT_READ | PROT_WRITE,
                  MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  for (int round = 0; round < ROUNDS; round++) {
    memset(won, 0, sizeof(int) * NPROC * NKEYS);
    volatile int *go = &t->go;
    *go = 0;
    pid_t pids[NPROC];
    for (int p = 0; p < NPROC; p++) {
      pids[p] = fork();
      if (pids[p] == 0) {
        while (!*go) SKV_CPU_RELAX();
        _exit(race_child(t, p, round, seed, batch, won + p * NKEYS));
      }
    }
    *go = 1;
    for (int p = 0; p < NPROC; p++) {
      int st;
      waitpid(pids[p], &st, 0);
      cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "child %d failed (%d)", p,
                WIFEXITED(st) ? WEXITSTATUS(st) : -1);
    }
    for (int i = 0; i < NKEYS; i++) {
      int winners = 0, who = -1;
      for (int p = 0; p < NPROC; p++)
        if (won[p * NKEYS + i]) winners++, who = p;
      LOOP_CHECK(winners == 1, "round %d key %d has %d winners", round, i, winners);
      skv_key_t k = race_key(seed, round, i);
      uint64_t v;
      LOOP_CHECK(skv__index_lookup(&t->ix, k, &v) == 0, "round %d key %d not indexed", round, i);
      LOOP_CHECK((int)skv__val_pe(v) == who,
                 "round %d key %d: the winner's value is not the one indexed", round, i);
      /* erase for the next round (tombstones everywhere) */
      LOOP_CHECK(skv__index_erase(&t->ix, k, v) == 0, "round %d key %d: erase", round, i);
    }
    cr_assert_eq(skv__index_check(&t->ix), 0);
  }
}

Test(index, racing_processes_agree_on_one_winner_per_key) {
  race(0);
}

/* The same race with claims in batches (a publish's), published only once a batch is claimed. */
Test(index, racing_batched_claims_agree_on_one_winner_per_key) {
  race(37);
}
