/* The node-shared lock-free index: claim by 128-bit CAS, first-writer-wins by tickets,
 * seqlock-free lookups. The protocol and its failure cases are described in index.h. */
#include "index/index.h"

#include <sched.h>
#include <string.h>

#define EMPTY_HI 0u
#define TOMB_LO  1u

static inline unsigned __int128 k128(skv_key_t k) {
  return ((unsigned __int128)k.hi << 64) | k.lo;
}
static const unsigned __int128 K_EMPTY = 0;
static const unsigned __int128 K_TOMB = 1;

static inline bool cas_key(skv__index_slot_t *s, unsigned __int128 old, unsigned __int128 new_) {
  return __sync_bool_compare_and_swap(&s->key.w, old, new_);
}

static inline uint64_t ld_acq(const uint64_t *p) {
  return __atomic_load_n(p, __ATOMIC_ACQUIRE);
}
static inline uint64_t ld_rlx(const uint64_t *p) {
  return __atomic_load_n(p, __ATOMIC_RELAXED);
}
static inline void st_rel(uint64_t *p, uint64_t v) {
  __atomic_store_n(p, v, __ATOMIC_RELEASE);
}

uint64_t skv__index_shard_bytes(uint64_t slots_per_shard) {
  return sizeof(skv__index_shard_hdr_t) + slots_per_shard * (sizeof(skv__index_slot_t) + 1);
}

void skv__index_bind(skv__index_t *ix, int nshards, uint64_t slots_per_shard,
                     void *const *shard_mem, skv__index_alive_fn alive, void *alive_arg) {
  ix->nshards = nshards;
  ix->shard_m = UINT64_MAX / (uint64_t)nshards + 1; /* 0 for one shard: shard 0 */
  ix->slots_per_shard = slots_per_shard;
  ix->alive = alive;
  ix->alive_arg = alive_arg;
  for (int i = 0; i < nshards; i++) {
    ix->hdr[i] = shard_mem[i];
    ix->slots[i] = (skv__index_slot_t *)((char *)shard_mem[i] + sizeof(skv__index_shard_hdr_t));
  }
}

/* The reach of home slot h (index.h): slots beyond h + reach never held a key of home h. */
static inline unsigned reach_of(const skv__index_t *ix, int sh, uint64_t h) {
  return __atomic_load_n(&skv__index_reach(ix, sh)[h], __ATOMIC_SEQ_CST);
}

/* Raise home h's reach to d (never lowers it). */
static void reach_raise(skv__index_t *ix, int sh, uint64_t h, unsigned d) {
  uint8_t *r = &skv__index_reach(ix, sh)[h];
  uint8_t cur = __atomic_load_n(r, __ATOMIC_SEQ_CST);
  while (cur < d && !__atomic_compare_exchange_n(r, &cur, (uint8_t)d, false, __ATOMIC_SEQ_CST,
                                                 __ATOMIC_SEQ_CST)) {
  }
}

/* Read a slot's key. The key changes by one 16-byte CAS but is read as two 8-byte loads (hi
 * first), so a read racing with a claim of a free slot can see the old hi (0) with the new
 * lo: (0, x) with x > 1 is a claim in flight, never EMPTY. Only (0, 0) is EMPTY and (0, 1) a
 * tombstone. A claim in flight has no ticket yet, so treating it as someone else's occupied
 * slot is safe everywhere (it will lose to any copy that exists now). */
enum { SLOT_EMPTY, SLOT_TOMB, SLOT_CLAIMING, SLOT_KEY };
static inline int read_key(const skv__index_slot_t *s, uint64_t *hi, uint64_t *lo) {
  *hi = ld_acq(&s->key.p.hi);
  *lo = ld_acq(&s->key.p.lo);
  if (*hi != EMPTY_HI) return SLOT_KEY;
  return *lo == 0 ? SLOT_EMPTY : *lo == TOMB_LO ? SLOT_TOMB : SLOT_CLAIMING;
}

int skv__index_lookup(const skv__index_t *ix, skv_key_t key, uint64_t *val) {
  int sh = skv__index_shard(ix, key);
  skv__index_slot_t *slots = ix->slots[sh];
  uint64_t mask = ix->slots_per_shard - 1;
  uint64_t h = key.lo & mask;
  unsigned lim = SKV_INDEX_WINDOW; /* read once the home slot did not hold the key */
  for (unsigned i = 0; i < lim; i++) {
    if (i == 1) lim = (unsigned)reach_of(ix, sh, h) + 1;
    if (i >= lim) break;
    skv__index_slot_t *s = &slots[(h + i) & mask];
    for (int tries = 0; tries < 4; tries++) {
      uint64_t v1 = ld_acq(&s->val);
      uint64_t hi, lo;
      int kind = read_key(s, &hi, &lo);
      if (kind == SLOT_EMPTY) return SKV_ENOTFOUND; /* the key is nowhere further */
      if (kind != SLOT_KEY) break;
      if (hi != key.hi || lo != key.lo || !(v1 & SKV_VAL_VALID)) break;
      uint64_t v2 = ld_acq(&s->val);
      if (v1 == v2) {
        *val = v1;
        return 0;
      }
      /* The slot changed under us: read it again. */
    }
  }
  return SKV_ENOTFOUND;
}

void skv__index_lookup_prefix(const skv__index_t *ix, const skv_key_t *keys, size_t n,
                              uint64_t *vals, size_t *nhit) {
  enum { AHEAD = 4 };
  uint64_t mask = ix->slots_per_shard - 1;
  for (size_t j = 0; j < n && j < AHEAD; j++)
    __builtin_prefetch(&ix->slots[skv__index_shard(ix, keys[j])][keys[j].lo & mask]);
  size_t i = 0;
  for (; i < n; i++) {
    if (i + AHEAD < n) {
      skv_key_t k = keys[i + AHEAD];
      __builtin_prefetch(&ix->slots[skv__index_shard(ix, k)][k.lo & mask]);
    }
    if (skv__index_lookup(ix, keys[i], &vals[i]) != 0) break;
  }
  *nhit = i;
}

/* Turn the key of our own entry, whose val we made ERASING, into a tombstone. Nobody else writes
 * the key of such a slot (a claim CASes only an EMPTY or TOMB key, ERASING is final, and
 * skv__index_forget_pe of our PE runs only once we are dead), so two release stores do, where a
 * 16-byte CAS was the dearest step of an eviction on the GPU host's CPU: lo first, then hi, so that
 * a reader sees the old key, (hi, 1) (a key that is nobody's, whose val is not VALID: a miss) or
 * the tombstone, never (0, old lo) nor EMPTY. A PE that dies between the two leaves (hi, 1) under
 * ERASING, which skv__index_forget_pe finishes as any erase. */
static inline void tomb_key(skv__index_slot_t *s) {
  __atomic_store_n(&s->key.p.lo, (uint64_t)TOMB_LO, __ATOMIC_RELEASE);
  __atomic_store_n(&s->key.p.hi, (uint64_t)EMPTY_HI, __ATOMIC_RELEASE);
}

static inline bool same_key(const skv__index_slot_t *s, skv_key_t key) {
  uint64_t hi, lo;
  return read_key(s, &hi, &lo) == SLOT_KEY && hi == key.hi && lo == key.lo;
}

/* The val of a slot being erased or released: ERASING, with the PE doing it (so that the erase
 * of a PE that dies half way can be completed by whoever forgets that PE). */
static inline uint64_t erasing(uint64_t v) {
  return SKV_VAL_ERASING | (v & (SKV_VAL_PE_MASK << SKV_VAL_PE_SHIFT));
}

/* Turn a PENDING claim (ours, or a dead owner's) back into a tombstone, if its val is still
 * `pending`: a decision taken on an earlier read never touches a slot that moved on (released
 * and claimed again, or published). The CAS makes the caller the slot's only writer until the
 * key is a tombstone: nobody claims a slot whose key is set, and ERASING is final. */
static bool release_slot(skv__index_slot_t *s, unsigned __int128 k, uint64_t pending) {
  if (!__atomic_compare_exchange_n(&s->val, &pending, erasing(pending), false, __ATOMIC_SEQ_CST,
                                   __ATOMIC_RELAXED))
    return false;
  /* a CAS, not tomb_key's stores: clearing a dead PE's claim, skv__index_forget_pe may finish
   * the same ERASING slot at once (both see that PE in it), and the slot may be claimed again
   * between its CAS and our stores (a release is rare: a lost race, a failed copy) */
  __atomic_store_n(&s->ticket, 0, __ATOMIC_SEQ_CST);
  cas_key(s, k, K_TOMB);
  return true;
}

/* How long a PENDING copy whose ticket is not stored yet is waited for. Its owner stores the
 * ticket a few instructions after its PENDING value, so only a stopped (SIGSTOP, debugger) or
 * long-descheduled owner makes this wait run out; then we lose, which is always safe: the
 * caller does not cache its page, and the key is cached by the copy once its owner runs. */
#define COPY_TICKET_WAIT_MS 100

/* Does another inserter's copy of `key` in slot s win over ours (ticket my_ticket)? 2: it is
 * VALID (the key is cached); 1: it is PENDING with a smaller ticket and a live owner, or its
 * ticket did not come in time.
 * 0: it is gone, being erased, newer than us, or a dead owner's claim (cleared here). A claim
 * that has not stored its PENDING value yet (val still 0 or ERASING from before the claim) is
 * newer: we stored our ticket before reading its val, it takes its ticket after storing PENDING,
 * so its ticket is larger and its own scan sees our copy. */
static int copy_wins(skv__index_t *ix, skv__index_slot_t *s, skv_key_t key, uint64_t my_ticket,
                     uint64_t *valid) {
  uint64_t start = 0, next_alive_check = 0;
  for (uint64_t spin = 0;; spin++) {
    /* ticket before val: a ticket read from an earlier claim of the slot is only ever smaller
     * than the current one, which makes us lose, never win, by mistake */
    uint64_t t = __atomic_load_n(&s->ticket, __ATOMIC_SEQ_CST);
    uint64_t v = __atomic_load_n(&s->val, __ATOMIC_SEQ_CST);
    if (!same_key(s, key)) return 0;
    if (v & SKV_VAL_VALID) {
      *valid = v;
      return 2;
    }
    if (!skv__val_is_pending(v)) return 0;
    int owner = (int)skv__val_pe(v);
    if (t != 0) {
      if (t > my_ticket) return 0;
      if (!ix->alive || ix->alive(ix->alive_arg, owner)) return 1;
      if (release_slot(s, k128(key), v)) return 0;
      continue; /* it moved on (published, or cleared by another inserter): look again */
    }
    if (spin < 128) {
      SKV_CPU_RELAX();
      continue;
    }
    /* The owner is between its PENDING store and its ticket store: let it run, make sure every
     * 10 ms that it is still alive, and give up (lose) after COPY_TICKET_WAIT_MS. */
    uint64_t now = skv__now_ms();
    if (!start) start = now;
    if (now - start >= COPY_TICKET_WAIT_MS) {
      SKV_LOG_RL(
          SKV_LOG_INFO, SKV_SUBSYS_INDEX,
          "index insert: PE %d's copy of key %016llx%016llx has no ticket after %d ms (stopped?); "
          "not caching ours",
          owner, (unsigned long long)key.hi, (unsigned long long)key.lo, COPY_TICKET_WAIT_MS);
      return 1;
    }
    if (now >= next_alive_check) {
      if (next_alive_check && ix->alive && !ix->alive(ix->alive_arg, owner) &&
          release_slot(s, k128(key), v))
        return 0;
      next_alive_check = now + 10;
    }
    sched_yield();
  }
}

/* Scan the window for copies of `key` other than our slot `mine` (ticket my_ticket). Returns
 * copy_wins's answer for the first copy that wins over ours (2 VALID, its value in *valid, 1
 * older), else 0. */
static int scan_copies(skv__index_t *ix, skv_key_t key, skv__index_slot_t *mine, uint64_t my_ticket,
                       uint64_t *valid) {
  int sh = skv__index_shard(ix, key);
  skv__index_slot_t *slots = ix->slots[sh];
  uint64_t mask = ix->slots_per_shard - 1;
  uint64_t h = key.lo & mask;
  /* read after our ticket: covers every copy claimed before it (index.h, Reach) */
  const unsigned lim = SKV_MIN((unsigned)SKV_INDEX_WINDOW, reach_of(ix, sh, h) + 1);
  /* The test is the key's hi first: it is never EMPTY_HI (key.hi != 0), so it matches only our
   * own slot and the key's other copies (or a key with the same hi). Testing the slot's kind
   * first (key, tombstone, claim) branched on how the window happens to be filled: in a table of
   * a quarter live keys and three quarters tombstones that was about 5 of the rescan's 24 us per
   * 1024 keys, and the rescan about 60% of a claim (bench/results/claim_rescan_2core-vm.txt). */
  for (unsigned i = 0; i < lim; i++) {
    skv__index_slot_t *s = &slots[(h + i) & mask];
    const uint64_t hi = ld_acq(&s->key.p.hi), lo = ld_acq(&s->key.p.lo);
    if (SKV_UNLIKELY(hi == key.hi) && lo == key.lo && s != mine) {
      const int w = copy_wins(ix, s, key, my_ticket, valid);
      if (w) return w;
    } else if ((hi | lo) == 0) {
      break; /* EMPTY: the key is nowhere further */
    }
  }
  return 0;
}

/* A number for a new claim, unique in this process: from a random start, so that a claim of
 * another process at the same PE (an elastic domain's next incarnation of a slot) does not repeat
 * a dead one's numbers. Each thread takes CLAIM_BLOCK numbers at a time (one atomic add per
 * block, not per claim). */
#define CLAIM_BLOCK 1024u
static uint64_t claim_number(void) {
  static uint64_t claims;
  static __thread uint64_t next, left;
  if (SKV_UNLIKELY(left == 0)) {
    if (SKV_UNLIKELY(__atomic_load_n(&claims, __ATOMIC_RELAXED) == 0)) {
      uint64_t r = 0;
      (void)skv__random_bytes(&r, sizeof r);
      uint64_t zero = 0;
      __atomic_compare_exchange_n(&claims, &zero, (r >> 12) | 1, false, __ATOMIC_RELAXED,
                                  __ATOMIC_RELAXED);
    }
    next = __atomic_fetch_add(&claims, CLAIM_BLOCK, __ATOMIC_RELAXED) + 1;
    left = CLAIM_BLOCK;
  }
  left--;
  return next++;
}

/* Step 1 of Insert for one key and the PENDING store of step 2: 0 with *c (ticket not taken
 * yet), SKV_EEXIST when the key is VALID on the way (that value in c->valid), SKV_ENOSPC. */
static int claim_slot(skv__index_t *ix, skv_key_t key, int my_pe, skv__index_claim_t *c) {
  SKV_ASSERT(key.hi != 0);
  int sh = skv__index_shard(ix, key);
  skv__index_slot_t *slots = ix->slots[sh];
  uint64_t mask = ix->slots_per_shard - 1;
  uint64_t h = key.lo & mask;
  unsigned __int128 kw = k128(key);
  /* 1. claim the first free slot, unless the key is already VALID on the way (a copy cached
   * further on is found by the rescan: the claim is given up, the key counted as cached) */
  skv__index_slot_t *mine = NULL;
  unsigned dist = 0;
  for (unsigned i = 0; i < SKV_INDEX_WINDOW && !mine; i++) {
    skv__index_slot_t *s = &slots[(h + i) & mask];
    uint64_t hi, lo;
    int kind = read_key(s, &hi, &lo);
    if (kind == SLOT_KEY && hi == key.hi && lo == key.lo) {
      uint64_t v = ld_acq(&s->val);
      if (v & SKV_VAL_VALID) {
        c->valid = v;
        return SKV_EEXIST;
      }
      continue;
    }
    if (kind == SLOT_KEY || kind == SLOT_CLAIMING) continue;
    unsigned __int128 old = kind == SLOT_TOMB ? K_TOMB : K_EMPTY;
    if (cas_key(s, old, kw))
      mine = s, dist = i;
    else
      i--; /* the slot changed: look at it again */
  }
  if (!mine) return SKV_ENOSPC;
  reach_raise(ix, sh, h, dist); /* before PENDING: readers and rescans then cover our slot */
  /* 2. PENDING with our PE (the ticket follows). Nobody else writes the slot now: its val is 0
   * or ERASING, which no CAS of another PE expects. Release is enough: the ticket's add comes
   * after it and is a seq_cst read-modify-write, so an inserter whose ticket comes before ours
   * sees this PENDING value (index.h, Insert step 3). */
  c->shard = (uint32_t)sh;
  c->slot = (uint32_t)(mine - slots);
  c->pending = skv__val_pending((uint32_t)my_pe, claim_number());
  __atomic_store_n(&mine->val, c->pending, __ATOMIC_RELEASE);
  return 0;
}

/* ThreadSanitizer has no fences: there, each ticket store is sequentially consistent itself. */
#ifdef __SANITIZE_THREAD__
#define TICKET_STORE __ATOMIC_SEQ_CST
#else
#define TICKET_STORE __ATOMIC_RELEASE
#endif

/* skv__index_claim_n's phases over keys [from, to) of the batch; the keys' home slots are
 * prefetched AHEAD keys ahead across groups. */
static void claim_group(skv__index_t *ix, const skv_key_t *keys, size_t from, size_t to, size_t n,
                        int my_pe, skv__index_claim_t *c, int *rc, bool *raced) {
  enum { AHEAD = 8 };
  size_t m = 0;
  for (size_t i = from; i < to; i++) {
    if (i + AHEAD < n) skv__index_prefetch_w(ix, keys[i + AHEAD]);
    raced[i] = false;
    rc[i] = claim_slot(ix, keys[i], my_pe, &c[i]);
    m += rc[i] == 0;
  }
  if (m == 0) return;
  /* 2. the group's tickets, one add (in claim order: of two claims of one key in the batch, the
   * first is older), each stored, then a full fence: every rescan's reads come after every
   * ticket store (a claimer reads our val before its ticket only if its ticket is newer) */
  uint64_t t = __atomic_add_fetch(&ix->hdr[0]->ticket, m, __ATOMIC_SEQ_CST) - m;
  for (size_t i = from; i < to; i++) {
    if (rc[i]) continue;
    c[i].ticket = ++t;
    __atomic_store_n(&ix->slots[c[i].shard][c[i].slot].ticket, t, TICKET_STORE);
  }
#ifndef __SANITIZE_THREAD__
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
#endif
  /* 3. any older copy wins. */
  for (size_t i = from; i < to; i++) {
    if (rc[i]) continue;
    skv__index_slot_t *mine = &ix->slots[c[i].shard][c[i].slot];
    uint64_t valid = 0;
    const int w = scan_copies(ix, keys[i], mine, c[i].ticket, &valid);
    if (w) {
      release_slot(mine, k128(keys[i]), c[i].pending);
      rc[i] = SKV_EEXIST;
      raced[i] = w == 1; /* 2: the key is cached (VALID), maybe past our slot */
      c[i].valid = valid;
    }
  }
}

/* Keys per group of phases: the lines a group's claims walked are still in the L1 cache when its
 * rescans walk them again (with the batch as one group, perf on the GPU host's Xeon put a quarter
 * of the rescans on their first load). */
#define CLAIM_GROUP 32

void skv__index_claim_n(skv__index_t *ix, const skv_key_t *keys, size_t n, int my_pe,
                        skv__index_claim_t *c, int *rc, bool *raced) {
  for (size_t i = 0; i < n; i += CLAIM_GROUP)
    claim_group(ix, keys, i, SKV_MIN(n, i + CLAIM_GROUP), n, my_pe, c, rc, raced);
}

int skv__index_claim(skv__index_t *ix, skv_key_t key, int my_pe, skv__index_claim_t *c,
                     bool *raced) {
  int rc;
  skv__index_claim_n(ix, &key, 1, my_pe, c, &rc, raced);
  return rc;
}

int skv__index_publish(skv__index_t *ix, const skv__index_claim_t *c, uint64_t val) {
  SKV_ASSERT(val & SKV_VAL_VALID);
  skv__index_slot_t *s = &ix->slots[c->shard][c->slot];
  /* 4. publish, unless another inserter judged us dead and cleared our claim meanwhile (then
   * it caches the key, and we lose like any other copy). */
  uint64_t pending = c->pending;
  if (!__atomic_compare_exchange_n(&s->val, &pending, val, false, __ATOMIC_SEQ_CST,
                                   __ATOMIC_RELAXED))
    return SKV_EEXIST;
  return 0;
}

void skv__index_count(skv__index_t *ix, int shard, int64_t n) {
  __atomic_add_fetch(&ix->hdr[(unsigned)shard % (unsigned)ix->nshards]->entries, (uint64_t)n,
                     __ATOMIC_RELAXED);
}

void skv__index_release(skv__index_t *ix, skv_key_t key, const skv__index_claim_t *c) {
  (void)release_slot(&ix->slots[c->shard][c->slot], k128(key), c->pending);
}

int skv__index_insert(skv__index_t *ix, skv_key_t key, uint64_t val, int my_pe) {
  SKV_ASSERT(val & SKV_VAL_VALID);
  skv__index_claim_t c;
  bool raced;
  int rc = skv__index_claim(ix, key, my_pe, &c, &raced); /* EEXIST is no error to trace */
  if (rc == 0) rc = skv__index_publish(ix, &c, val);
  if (rc == 0) skv__index_count(ix, my_pe, 1);
  return rc;
}

/* Erase slot s of shard sh if it holds key with exactly val: VALID -> ERASING by CAS, then the
 * ticket cleared and the key made a tombstone. */
static bool erase_slot(skv__index_t *ix, int sh, skv__index_slot_t *s, skv_key_t key, uint64_t val,
                       bool count) {
  uint64_t expect = val;
  if (!__atomic_compare_exchange_n(&s->val, &expect, erasing(val), false, __ATOMIC_SEQ_CST,
                                   __ATOMIC_RELAXED))
    return false;
  __atomic_store_n(&s->ticket, 0, __ATOMIC_RELEASE); /* before the key, as release_slot's */
  tomb_key(s);
  if (count) __atomic_sub_fetch(&ix->hdr[sh]->entries, 1, __ATOMIC_RELAXED);
  return true;
}

int skv__index_erase(skv__index_t *ix, skv_key_t key, uint64_t val) {
  int sh = skv__index_shard(ix, key);
  skv__index_slot_t *slots = ix->slots[sh];
  uint64_t mask = ix->slots_per_shard - 1;
  uint64_t h = key.lo & mask;
  const unsigned lim = SKV_MIN((unsigned)SKV_INDEX_WINDOW, reach_of(ix, sh, h) + 1);
  for (unsigned i = 0; i < lim; i++) {
    skv__index_slot_t *s = &slots[(h + i) & mask];
    uint64_t hi, lo;
    int kind = read_key(s, &hi, &lo);
    if (kind == SLOT_EMPTY) break;
    if (kind != SLOT_KEY || hi != key.hi || lo != key.lo) continue;
    if (erase_slot(ix, sh, s, key, val, true)) return 0;
  }
  return SKV_ENOTFOUND;
}

int skv__index_erase_at(skv__index_t *ix, skv_key_t key, uint64_t val, uint64_t islot, bool count) {
  const uint64_t sh = (islot - 1) >> 32, slot = (uint32_t)(islot - 1);
  if (islot == 0 || (int)sh != skv__index_shard(ix, key) || slot >= ix->slots_per_shard)
    return SKV_ENOTFOUND;
  skv__index_slot_t *s = &ix->slots[sh][slot];
  if (!same_key(s, key) || !erase_slot(ix, (int)sh, s, key, val, count)) return SKV_ENOTFOUND;
  return 0;
}

uint64_t skv__index_forget_pe(skv__index_t *ix, int pe) {
  uint64_t cleared = 0;
  for (int sh = 0; sh < ix->nshards; sh++)
    for (uint64_t i = 0; i < ix->slots_per_shard; i++) {
      skv__index_slot_t *s = &ix->slots[sh][i];
      uint64_t hi, lo, v = ld_acq(&s->val);
      if (read_key(s, &hi, &lo) != SLOT_KEY || (int)skv__val_pe(v) != pe) continue;
      skv_key_t k = {hi, lo};
      if (v & SKV_VAL_ERASING) { /* an erase the PE did not finish: finish it */
        __atomic_store_n(&s->ticket, 0, __ATOMIC_SEQ_CST);
        if (cas_key(s, k128(k), K_TOMB)) cleared++;
        continue;
      }
      if (!(v & SKV_VAL_VALID) && !skv__val_is_pending(v)) continue;
      if (!release_slot(s, k128(k), v)) continue; /* it moved on meanwhile */
      if (v & SKV_VAL_VALID) __atomic_sub_fetch(&ix->hdr[sh]->entries, 1, __ATOMIC_RELAXED);
      cleared++;
    }
  return cleared;
}

uint64_t skv__index_entries(const skv__index_t *ix) {
  uint64_t n = 0;
  for (int i = 0; i < ix->nshards; i++) n += ld_rlx(&ix->hdr[i]->entries);
  return n;
}

int64_t skv__index_check(const skv__index_t *ix) {
  int64_t count = 0;
  uint64_t mask = ix->slots_per_shard - 1;
  for (int sh = 0; sh < ix->nshards; sh++) {
    for (uint64_t i = 0; i < ix->slots_per_shard; i++) {
      skv__index_slot_t *s = &ix->slots[sh][i];
      uint64_t v = ld_acq(&s->val), hi, lo;
      read_key(s, &hi, &lo);
      if (hi == EMPTY_HI || !(v & SKV_VAL_VALID)) continue;
      count++;
      skv_key_t k = {hi, lo};
      if (skv__index_shard(ix, k) != sh)
        return SKV_FAIL(SKV_EINTERNAL, SKV_SUBSYS_INDEX,
                        "index: key in shard %d belongs to shard %d", sh, skv__index_shard(ix, k));
      uint64_t home = lo & mask, dist = (i - home) & mask;
      if (dist >= SKV_INDEX_WINDOW)
        return SKV_FAIL(SKV_EINTERNAL, SKV_SUBSYS_INDEX,
                        "index: slot %llu is %llu slots from its home", (unsigned long long)i,
                        (unsigned long long)dist);
      if (dist > reach_of(ix, sh, home))
        return SKV_FAIL(SKV_EINTERNAL, SKV_SUBSYS_INDEX,
                        "index: slot %llu is %llu slots from its home, beyond its reach %u",
                        (unsigned long long)i, (unsigned long long)dist, reach_of(ix, sh, home));
      for (unsigned j = 0; j < SKV_INDEX_WINDOW; j++) {
        skv__index_slot_t *o = &ix->slots[sh][(home + j) & mask];
        if (o == s) continue;
        uint64_t ov = ld_acq(&o->val), ohi, olo;
        read_key(o, &ohi, &olo);
        if (ohi == hi && olo == lo && (ov & SKV_VAL_VALID))
          return SKV_FAIL(SKV_EINTERNAL, SKV_SUBSYS_INDEX,
                          "index: key %016llx%016llx is VALID twice", (unsigned long long)hi,
                          (unsigned long long)lo);
      }
    }
  }
  return count;
}
