/* Internal API of the node-shared, lock-free index: 128-bit key -> (pe, page, generation),
 * sharded by key over the PEs' metadata segments, every shard mapped by every local PE. */
#ifndef SKV_INDEX_H
#define SKV_INDEX_H

#include "core/core.h"

/* How it works
 * ------------
 * The table is open addressing with linear probing inside a window of SKV_INDEX_WINDOW slots
 * from the key's home slot (the window wraps inside the key's shard). A slot is 32 bytes:
 *
 *   key    128 bits, changed only by a 128-bit compare-and-swap. (0, 0) is EMPTY, (0, 1) a
 *          TOMBstone; real keys have hi != 0.
 *   val    64 bits: VALID flag, ERASING flag, pe, page, generation. A slot whose key is set
 *          but whose val is not VALID is being inserted (PENDING, owner pe in val) or erased.
 *   ticket 64 bits: a node-wide insertion order number (0: not taken yet).
 *
 * The life of a slot, (key, val): every arrow is one CAS, or one store to a slot that only its
 * claimer writes.
 *
 *   EMPTY (0, 0) or TOMB (0, 1)
 *     |  claim: CAS key -> the key (inserter)
 *     v
 *   CLAIMED (key, 0 or ERASING)
 *     |  store PENDING(pe, claim), then the ticket (the claimer)
 *     v
 *   PENDING (key, PENDING) --- lost, or its owner dead: CAS val -> ERASING ---+
 *     |  publish: CAS val PENDING -> VALID (the claimer)                      |
 *     v                                                                       v
 *   VALID (key, pe|page|gen) --- evict (the owner): CAS val -> ERASING ---> ERASING
 *                                                                             |
 *   TOMB (0, 1) <--- clear the ticket, CAS key -> TOMB (who set ERASING) -----+
 *
 * EMPTY never comes back once claimed; a lookup hits VALID only; CLAIMED, PENDING and ERASING
 * are misses to readers, and tickets decide between inserters of one key (below).
 *
 * Reach. Since EMPTY never comes back, a long-running table has none left (erased keys leave
 * tombstones: after 300 publishes of 1024 pages into a full pool of 2 x 3072 pages, 0 of 32768
 * slots were EMPTY), and a walk that stops only at EMPTY went the whole window (32 slots, 16
 * cache lines) for every miss and every insert's rescan: most of a publish's lookup and insert.
 * So each home slot h also has a reach byte (an array after the shard's slots): the largest
 * distance from h of any slot ever claimed for a key whose home is h. It only grows; claims take
 * the first free slot, so it stays small (a tombstone is as free as EMPTY). Lookups, rescans and
 * erases walk min(window, reach + 1) slots (and stop at EMPTY as before).
 * An inserter raises reach to its slot's distance right after claiming it, before PENDING: so
 * a reader that reads reach after an insert completed covers its slot, and between two
 * inserters of one key the argument of step 3 holds as before: the reach read of the later
 * one's rescan comes after its ticket, which comes after the earlier one's raise.
 *
 * Insert (only by the PE that owns the page):
 *   1. claim the first EMPTY or TOMB slot of the window by CAS of the key (ENOSPC if none);
 *   2. write val = PENDING(pe, claim number) (never 0: see skv__val_pending), take a ticket
 *      from the node-wide counter, store it;
 *   3. rescan the window up to the first EMPTY slot (or reach) for other slots holding the key. A
 *      copy that is VALID, or PENDING with a smaller ticket and a live owner, wins over us: we
 *      clear our slot and report EEXIST (the caller frees its page). A copy that is ERASING,
 *      has a larger ticket, or has not stored PENDING yet (val still 0 or ERASING: it takes
 *      its ticket after we read that, so it is newer and its own scan sees us) will lose. A
 *      PENDING copy whose ticket is not stored yet is waited for, briefly: its owner stores it
 *      right after PENDING; if it does not come (a stopped owner) we lose, which is safe;
 *   4. publish: CAS val from PENDING(pe) to VALID(pe, page, gen). It fails only if another
 *      inserter judged us dead and cleared our claim: then we lose too.
 *   Every copy agrees on the winner (the smallest ticket), so a key is VALID in at most one
 *   slot and "first writer wins" holds. Copies never lie beyond the first EMPTY slot: claims
 *   stop at the first free slot and EMPTY slots never come back.
 * Lookup (any PE, any thread): walk the window until the key or an EMPTY slot; a hit needs the
 *   val read before and after the key to be equal and VALID (a seqlock without a counter:
 *   erase changes val before it changes the key, and (pe, page, gen) never repeats).
 * Erase (owner, on eviction): CAS val from the exact VALID value to ERASING, clear the ticket,
 *   CAS the key to TOMB. Tombstones are reused by later inserts; the bounded window keeps
 *   lookups short even when a long-running table is full of tombstones.
 * Clearing a claim (our own, or a dead owner's): CAS val from the PENDING value the decision
 *   was taken on to ERASING, then clear the ticket and CAS the key to TOMB. Every change of a
 *   slot that is not ours is such a CAS on val, so a decision that went stale (the slot was
 *   cleared and claimed again meanwhile, or published) changes nothing, and a VALID val is
 *   always under the key that inserted it.
 *
 * What can go wrong
 * -----------------
 * - A PE dies in the middle of an erase: the slot stays ERASING (with that PE in val) and
 *   holds a slot of the window; skv__index_forget_pe finishes it (an elastic domain calls it for
 *   a dead participant). The entries counter may then be one high: it is approximate.
 * - A PE dies between claim and publish: its slot stays PENDING. Inserters that meet a
 *   PENDING copy whose owner is dead clear it. A PE that dies between its claim and its
 *   PENDING store leaves a slot that holds the key and no owner: it is passed over, never
 *   waited for, and stays taken (one slot of the window).
 * - A PE stopped (SIGSTOP, debugger) in the middle of an insert: inserters of the same key
 *   wait at most COPY_TICKET_WAIT_MS (index.c) for its ticket, then lose; nothing waits longer.
 * - Two inserters race on a slot that is being erased: the claim CAS decides, tickets decide
 *   between copies; the loser reports EEXIST while the winner may still be PENDING, which is
 *   fine (the key becomes VALID as soon as the winner publishes).
 * - A reader races with erase and reuse of the slot: the val double-read catches it.
 * - A window with no free slot: insert fails with ENOSPC and the caller does not cache the key
 *   (the default table has 4 slots per page, at most 25% load, where a full 32-slot window
 *   is vanishingly rare); lookups are unaffected.
 */

#define SKV_INDEX_WINDOW 32

typedef struct skv__index_slot {
  union {
    unsigned __int128 w;
    struct {
      uint64_t lo, hi;
    } p;
  } key;
  uint64_t val;
  uint64_t ticket;
} __attribute__((aligned(32))) skv__index_slot_t;

/* Shared per-shard header (one per PE segment, 64 bytes). */
typedef struct skv__index_shard_hdr {
  uint64_t entries; /* VALID keys counted here: the sum over shards is the table's (approximate
                     * under races); inserts count in their PE's shard, erases in the key's */
  uint64_t ticket;  /* node-wide insertion counter (used in shard 0 only) */
  uint64_t pad[6];
} skv__index_shard_hdr_t;

/* Liveness of a PE, for the PENDING-with-dead-owner case; supplied by the pool. */
typedef bool (*skv__index_alive_fn)(void *arg, int pe);

typedef struct skv__index {
  int nshards;
  uint64_t shard_m; /* UINT64_MAX / nshards + 1: skv__index_shard's remainder without a divide */
  uint64_t slots_per_shard;     /* power of two, >= SKV_INDEX_WINDOW */
  skv__index_shard_hdr_t **hdr; /* [nshards] */
  skv__index_slot_t **slots;    /* [nshards] */
  skv__index_alive_fn alive;
  void *alive_arg;
} skv__index_t;

/* Packed value of a VALID entry. */
#define SKV_VAL_VALID       (1ull << 63)
#define SKV_VAL_ERASING     (1ull << 62)
#define SKV_VAL_PE_SHIFT    56
#define SKV_VAL_PE_MASK     0x3full
#define SKV_VAL_PAGE_SHIFT  32
#define SKV_VAL_PAGE_MASK   0xffffffull
#define SKV_INDEX_MAX_PES   64
#define SKV_INDEX_MAX_PAGES (1u << 24)

static inline uint64_t skv__val_pack(uint32_t pe, uint32_t page, uint32_t gen) {
  return SKV_VAL_VALID | ((uint64_t)pe << SKV_VAL_PE_SHIFT) |
         ((uint64_t)page << SKV_VAL_PAGE_SHIFT) | gen;
}
/* The val of a claim being inserted: its owner's PE, a number of the claim (`claim`, unique in
 * the owner process, so that a release decided on one claim never matches a later claim of the
 * same PE), and bit 0 so that it is never 0, the val of a slot just claimed from EMPTY (a claim
 * whose val is still 0 or ERASING has no ticket yet). */
#define SKV_VAL_PENDING_MARK 1ull
static inline uint64_t skv__val_pending(uint32_t pe, uint64_t claim) {
  return ((uint64_t)pe << SKV_VAL_PE_SHIFT) | ((claim << 1) & ((1ull << SKV_VAL_PE_SHIFT) - 2)) |
         SKV_VAL_PENDING_MARK;
}
static inline bool skv__val_is_pending(uint64_t v) {
  return !(v & (SKV_VAL_VALID | SKV_VAL_ERASING)) && (v & SKV_VAL_PENDING_MARK);
}
static inline uint32_t skv__val_pe(uint64_t v) {
  return (uint32_t)((v >> SKV_VAL_PE_SHIFT) & SKV_VAL_PE_MASK);
}
static inline uint32_t skv__val_page(uint64_t v) {
  return (uint32_t)((v >> SKV_VAL_PAGE_SHIFT) & SKV_VAL_PAGE_MASK);
}
static inline uint32_t skv__val_gen(uint64_t v) {
  return (uint32_t)v;
}

/* Bytes of one shard (header, slots, then a reach byte per slot) for `slots_per_shard` slots. */
uint64_t skv__index_shard_bytes(uint64_t slots_per_shard);
/* Bind the shards (already zeroed shared memory, shard i at shard_mem[i]). */
void skv__index_bind(skv__index_t *ix, int nshards, uint64_t slots_per_shard,
                     void *const *shard_mem, skv__index_alive_fn alive, void *alive_arg);

/* 0 and *val on a hit, SKV_ENOTFOUND on a miss. */
int skv__index_lookup(const skv__index_t *ix, skv_key_t key, uint64_t *val);
/* Prefetch key's home slot: a lookup, insert or erase of it follows soon (a batch's keys'
 * memory latencies then overlap). Same shard and home as index.c's. */
static inline uint8_t *skv__index_reach(const skv__index_t *ix, int shard) {
  return (uint8_t *)(ix->slots[shard] + ix->slots_per_shard);
}
/* The shard of key k: the high half of hi (the home slot comes from lo: independent bits), mod
 * the shards, as a multiply (Lemire's direct remainder, exact for 32-bit operands; perf put a
 * divide per key's claim, rescan and prefetch in a publish). */
static inline int skv__index_shard(const skv__index_t *ix, skv_key_t k) {
  const uint64_t low = ix->shard_m * (uint32_t)(k.hi >> 32);
  return (int)(((unsigned __int128)low * (uint32_t)ix->nshards) >> 64);
}
static inline void skv__index_prefetch(const skv__index_t *ix, skv_key_t k) {
  const int sh = skv__index_shard(ix, k);
  const uint64_t h = k.lo & (ix->slots_per_shard - 1);
  __builtin_prefetch(&ix->slots[sh][h]);
  __builtin_prefetch(&skv__index_reach(ix, sh)[h]); /* a miss reads it */
}
/* The same for a claim of `k`: its home slot to be written (the claim's CAS). */
static inline void skv__index_prefetch_w(const skv__index_t *ix, skv_key_t k) {
  const int sh = skv__index_shard(ix, k);
  const uint64_t h = k.lo & (ix->slots_per_shard - 1);
  SKV_PREFETCH_W(&ix->slots[sh][h]);
  __builtin_prefetch(&skv__index_reach(ix, sh)[h]);
}
/* Batched prefix lookup: vals[0..*nhit) of the leading keys found (prefetches ahead). */
void skv__index_lookup_prefix(const skv__index_t *ix, const skv_key_t *keys, size_t n,
                              uint64_t *vals, size_t *nhit);
/* Insert key -> val (VALID value of the caller's page). 0: inserted; SKV_EEXIST: the key is
 * present or another PE won the race (the caller frees its page); SKV_ENOSPC: window full.
 * skv__index_claim, then skv__index_publish. */
int skv__index_insert(skv__index_t *ix, skv_key_t key, uint64_t val, int my_pe);

/* An insert in two halves, for a page whose bytes are still being written (a publish claims
 * its keys before it copies, and publishes each once its copy is complete):
 *  - skv__index_claim takes steps 1-3 of Insert: on 0 the key holds a PENDING slot of ours in
 *    *c, which readers miss and other inserters of the key lose to (first writer wins);
 *    SKV_EEXIST: the key is VALID (*raced false; the value seen in c->valid), or an older copy
 *    won (*raced true);
 *    SKV_ENOSPC: no free slot in its window.
 *  - skv__index_publish takes step 4, val the VALID value: 0, or SKV_EEXIST when another
 *    inserter judged us dead and cleared the claim (the key is then cached by that copy);
 *  - skv__index_release gives a claim up (its copy failed, or no page for it): its slot goes
 *    back to a tombstone.
 * Each claim must end in exactly one publish or release; a PE that dies in between leaves
 * PENDING slots, which inserters of those keys, or skv__index_forget_pe, clear. A claim released
 * after other inserters of its key lost to it (its copy failed) leaves the key uncached: they
 * skipped it, and it is cached again by its next publish. */
typedef struct skv__index_claim {
  uint32_t shard, slot;
  union {
    uint64_t pending; /* our PENDING value in it (claimed) */
    uint64_t valid;   /* the key's VALID value seen (SKV_EEXIST, not raced) */
  };
  uint64_t ticket;
} skv__index_claim_t;
int skv__index_claim(skv__index_t *ix, skv_key_t key, int my_pe, skv__index_claim_t *c,
                     bool *raced);
/* skv__index_claim of keys[0..n), rc[i] and raced[i] its results (c[i] where rc[i] is 0), in
 * phases over each group of 32 keys: every key's slot and PENDING value, then one ticket add for
 * the group and the tickets stored, one fence, then every rescan. Per key that is one atomic
 * operation (the slot's claim) where one at a time took three (and a fence): the ticket's add, and
 * the PENDING value and the ticket stored sequentially consistent. The protocol's orders hold per
 * key: reach before PENDING, PENDING before the ticket is taken, the ticket stored before the
 * rescan reads. A claim of a group has no ticket until the group's slots are all claimed; another
 * inserter of its key waits for it (briefly) as for any claim between PENDING and its ticket. */
void skv__index_claim_n(skv__index_t *ix, const skv_key_t *keys, size_t n, int my_pe,
                        skv__index_claim_t *c, int *rc, bool *raced);
/* Where a claim's slot is, as one word: (shard << 32 | slot) + 1 (0 is "not known"). */
static inline uint64_t skv__index_islot(const skv__index_claim_t *c) {
  return (((uint64_t)c->shard << 32) | c->slot) + 1;
}
static inline void skv__index_islot_prefetch(const skv__index_t *ix, uint64_t islot) {
  const uint64_t sh = (islot - 1) >> 32;
  if (islot && sh < (uint64_t)ix->nshards)
    SKV_PREFETCH_W(&ix->slots[sh][(uint32_t)(islot - 1) & (ix->slots_per_shard - 1)]);
}
static inline void skv__index_claim_prefetch(const skv__index_t *ix, const skv__index_claim_t *c) {
  SKV_PREFETCH_W(&ix->slots[c->shard][c->slot]);
}
int skv__index_publish(skv__index_t *ix, const skv__index_claim_t *c, uint64_t val);
/* Count n keys published (skv__index_publish does not, so that a batch counts with one atomic
 * add), or -n erased, in the counter of shard `shard` (mod the shards): the counters' sum is the
 * entries. */
void skv__index_count(skv__index_t *ix, int shard, int64_t n);
void skv__index_release(skv__index_t *ix, skv_key_t key, const skv__index_claim_t *c);
/* Erase key if it maps to exactly `val`; SKV_ENOTFOUND otherwise. */
int skv__index_erase(skv__index_t *ix, skv_key_t key, uint64_t val);
/* skv__index_erase of the entry at `islot` (skv__index_islot of the claim it was published
 * with), without walking from the key's home to it: SKV_ENOTFOUND when that slot does not hold
 * key with exactly `val` (a hint gone stale: skv__index_erase walks). Without `count`, the
 * caller counts it (skv__index_count with -1 per erase, once for a batch). */
int skv__index_erase_at(skv__index_t *ix, skv_key_t key, uint64_t val, uint64_t islot, bool count);
/* Remove every entry and claim of PE `pe`, whose pages are gone (an elastic domain's slot whose
 * holder died or left): VALID entries are erased and PENDING claims cleared, each by a CAS from
 * the value seen, and erases it left half done are finished. Scans the whole table. Returns how
 * many slots it cleared. */
uint64_t skv__index_forget_pe(skv__index_t *ix, int pe);
/* VALID entries in all shards (sum of the shard counters). */
uint64_t skv__index_entries(const skv__index_t *ix);
/* Expensive walker (tests, SKV_DEBUG_LEVEL=2): count VALID slots, check no key is VALID twice
 * within its window; returns the count or a negative error. */
int64_t skv__index_check(const skv__index_t *ix);

#endif
