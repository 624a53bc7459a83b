/* Internal API of the page pool: per-page metadata in node-shared memory (state, generation,
 * pins, last use), owner-only allocation and LRU eviction, pins as leases of live PEs. */
#ifndef SKV_POOL_H
#define SKV_POOL_H

#include "core/core.h"

#include <pthread.h>

/* How it works
 * ------------
 * Every page has a 64-byte metadata record in its owner's node-shared segment:
 *   state    (generation << 32) | state, state FREE, WRITING, READY or EVICTING;
 *   pins     which local PEs hold at least one pin on the page: PEs 0-7 a byte each of
 *            pinbytes (0 or 1, plain stores), PEs 8-63 a bit each of pinmask (atomic OR/AND);
 *   last_use monotonic nanoseconds of the last lookup hit or publish (the LRU position);
 *   key      the page's index key while READY (for erasing it on eviction).
 * A PE counts its own pins per page in private memory and keeps its pin set while the count
 * is non-zero.
 *
 * Pin (any PE r, reference (pe, page, gen)): set r's pin (its byte, or its bit), then read state
 * (sequentially consistent); the pin holds if the state is READY with generation gen, else the
 * pin is cleared again and the reference is stale. A batch of PE r < 8 stores the bytes of a
 * run of pages, then one sequentially consistent fence, then reads their states: one fence per
 * run where a bit costs a locked OR per page (a locked OR and a locked AND per page were half of
 * a fetch's host time on the GPU host's Xeon).
 * Evict (owner only): CAS state READY(g) -> EVICTING(g), then read pinbytes and pinmask
 * (sequentially consistent). Pinner and evictor each write, then read the other's word (Dekker):
 * at least one of them sees the other, so a page is never evicted under a pin that succeeded. With
 * pins of live PEs the page goes back to READY; otherwise the index entry is erased and the
 * state becomes FREE(g + 1), so every earlier reference is stale.
 * LRU: the owner keeps a private min-heap of (last_use snapshot, page); a popped page whose
 * shared last_use moved on is pushed back with the new value, so the first page popped with
 * an up-to-date snapshot is exactly the least recently used one. While other PEs keep touching
 * pages, a pass gives up on exactness after as many push-backs as the heap holds and takes the
 * next unpinned page popped: an eviction never fails while an unpinned page exists.
 *
 * What can go wrong
 * -----------------
 * - A reader dies holding pins: its bit stays set. The evictor checks whether the PE of each
 *   set bit is alive (pid and start time in the PE's header) and clears the bits of dead PEs.
 *   A PE is dead only on evidence (no such pid, a zombie, another start time); a /proc read
 *   that fails otherwise (EMFILE...) says nothing, and a PE in another PID namespace (another
 *   container sharing the host's network) is never judged: its pins stay until it unpins.
 * - A pin that meets the evictor between its CAS and its pins read (EVICTING, same
 *   generation) waits for the verdict (bounded, PIN_EVICTING_WAIT_MS): READY again when the
 *   evictor saw the pin, else FREE(g + 1) and the reference is stale.
 * - The owner dies inside its own eviction (EVICTING, before or after erasing the index entry):
 *   a pin that meets EVICTING of a dead owner undoes the eviction (CAS EVICTING(g) -> READY(g):
 *   an eviction writes no page bytes) and pins. The key stays usable (lookups hit and fetch),
 *   or, when the entry was already erased, is simply missing and can be published again.
 * - An owner dies: its READY pages stay readable (their memory lives while peers map it) but
 *   can no longer be evicted; the other PEs' capacity is unaffected.
 * - Pins must balance: unpinning a page the PE does not hold fails with SKV_EINVAL.
 *
 * Remote pins
 * -----------
 * Other nodes pin a page through UCX (src/cluster/xfer.c): an atomic add to its record's
 * rpins word (SKV_RPIN_ADD: one more pin, one more event), then, after a fence, a read of its
 * state: the Dekker pair of a local pin, with rpins in place of the pins. An unpin adds
 * SKV_RPIN_SUB. The evictor reads rpins after its CAS to EVICTING, as it reads the pins. A node
 * that dies or hangs holding pins cannot be told apart from one that holds them long, so remote
 * pins are leased as a whole per page: a page whose rpins word showed pins and did not change
 * for lease_ms (no pin, no unpin by anyone) is evicted as if unpinned (a warning says so). The
 * word is never reset (an unpin that comes late must not take the count below zero), so a
 * dead node's pins stay counted; they only delay that page's eviction by a lease after each
 * remote pin or unpin of it. A reader checks the generation after every remote read anyway, so
 * a pin that lapsed costs a retry, never wrong bytes.
 *
 * Leases
 * ------
 * A live PE that stops (SIGSTOP, a debugger, a hung thread) would keep its pins for ever, and
 * its pages could never be evicted. So a PE's pins are leased: every call of the PE into the
 * KV cache (lookup, fetch, unpin, publish) renews its lease, lease_until = now + lease_ms in its
 * header (SKV_PIN_LEASE_MS, default 30 s; 0: no leases). An evictor that finds the pin bit of
 * a live PE whose lease has run out revokes it: it first adds one to that PE's revoked counter,
 * then clears the bit, and evicts the page if nothing else pins it.
 * The holder notices on its next call (revoked moved): it drops every pin it holds (counts and
 * bits), and later unpins of pages it no longer holds succeed without effect. Its references
 * stay references: a fetch pins each page again by generation, so it copies the page if it is
 * unchanged and fails with SKV_ESTALE if it went; a fetch with SKV_FETCH_UNPIN of pins that were
 * dropped fails with SKV_ESTALE naming the lease. A copy the holder was inside when it stopped
 * is checked after it ends: if revoked moved since the copy's pins were taken, the fetch fails
 * with SKV_ESTALE (the destination may hold anything). The revoked counter is added to before
 * the bit is cleared, and the page is rewritten only after, so a copy that read rewritten bytes
 * always sees the counter moved.
 */

enum { SKV_PAGE_FREE = 0, SKV_PAGE_WRITING = 1, SKV_PAGE_READY = 2, SKV_PAGE_EVICTING = 3 };

typedef struct skv__page_meta {
  uint64_t state;   /* (gen << 32) | state */
  uint64_t pinmask; /* bit per local PE from SKV_PIN_BYTE_PES on (the bits below are unused) */
  uint64_t last_use;
  uint64_t key_hi, key_lo;
  uint64_t rpins; /* pins of other nodes (src/cluster): count (low half) | pins + unpins (high) */
  uint64_t islot; /* the owner's hint: where the page's index entry is, (shard << 32 | slot) + 1
                   * (0: not known); checked by the erase, which walks when it is wrong */
  uint64_t pinbytes; /* byte per local PE below SKV_PIN_BYTE_PES: 1 while it holds pins */
} skv__page_meta_t;
_Static_assert(sizeof(skv__page_meta_t) == 64, "a page record is one cache line");

/* PEs below this pin with a plain store to their byte of pinbytes, the others with an atomic OR
 * to their bit of pinmask. */
#define SKV_PIN_BYTE_PES 8

_Static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "pin byte r is bit 8r of pinbytes");

/* The local PEs that pin the page, a bit each (sequentially consistent loads). */
static inline uint64_t skv__page_pins(skv__page_meta_t *m) {
  const uint64_t b = __atomic_load_n(&m->pinbytes, __ATOMIC_SEQ_CST) & 0x0101010101010101ull;
  return ((b * 0x0102040810204080ull) >> 56) | __atomic_load_n(&m->pinmask, __ATOMIC_SEQ_CST);
}

/* A pin byte's store and the fence that orders it before the state read (skv__pin_fence).
 * ThreadSanitizer has no fences: there, the store is sequentially consistent itself. */
#ifdef __SANITIZE_THREAD__
#define SKV__PIN_STORE   __ATOMIC_SEQ_CST
#define skv__pin_fence() ((void)0)
#else
#define SKV__PIN_STORE   __ATOMIC_RELEASE /* the PE's lease and pid (its header) go first */
#define skv__pin_fence() __atomic_thread_fence(__ATOMIC_SEQ_CST)
#endif

/* Set PE pe's pin on the page (for a byte, skv__pin_fence must follow before the state read;
 * release, so that an evictor seeing the byte also sees the PE's lease and pid). */
static inline void skv__page_pin_set(skv__page_meta_t *m, int pe) {
  if (pe < SKV_PIN_BYTE_PES)
    __atomic_store_n((uint8_t *)&m->pinbytes + pe, 1, SKV__PIN_STORE);
  else
    __atomic_fetch_or(&m->pinmask, 1ull << pe, __ATOMIC_SEQ_CST);
}

/* Clear PE pe's pin on the page (release: the PE's reads of the page come before). */
static inline void skv__page_pin_clear(skv__page_meta_t *m, int pe) {
  if (pe < SKV_PIN_BYTE_PES)
    __atomic_store_n((uint8_t *)&m->pinbytes + pe, 0, __ATOMIC_RELEASE);
  else
    __atomic_fetch_and(&m->pinmask, ~(1ull << pe), __ATOMIC_RELEASE);
}

static inline bool skv__page_pinned_by(skv__page_meta_t *m, int pe) {
  return pe < SKV_PIN_BYTE_PES
             ? __atomic_load_n((uint8_t *)&m->pinbytes + pe, __ATOMIC_RELAXED) != 0
             : (__atomic_load_n(&m->pinmask, __ATOMIC_RELAXED) >> pe & 1) != 0;
}

/* Remote pins (src/cluster/xfer.c) are atomic adds of other nodes' fetching workers, through
 * UCX, to a page's rpins word: a pin adds SKV_RPIN_ADD, an unpin SKV_RPIN_SUB (the count goes
 * down by one, the activity count up by one). */
#define SKV_RPIN_ADD ((1ull << 32) + 1)
#define SKV_RPIN_SUB ((1ull << 32) - 1)

typedef struct skv__pe_hdr {
  uint64_t magic;
  int64_t pid;
  uint64_t start_time; /* /proc/<pid>/stat field 22 */
  uint64_t pages;
  uint64_t pidns;       /* inode of /proc/self/ns/pid: pids mean something only within one */
  uint64_t lease_until; /* skv__now_ms() time this PE's pins are good until; 0: not yet leased */
  uint64_t revoked;     /* pins of this PE revoked by evictors (only grows) */
  uint64_t pad;
} skv__pe_hdr_t;

static inline uint32_t skv__st_state(uint64_t st) {
  return (uint32_t)st & 0xff;
}
static inline uint32_t skv__st_gen(uint64_t st) {
  return (uint32_t)(st >> 32);
}
static inline uint64_t skv__st_make(uint32_t gen, uint32_t state) {
  return ((uint64_t)gen << 32) | state;
}

typedef struct skv__lru_ent {
  uint64_t stamp;
  uint32_t page;
  uint32_t gen;
} skv__lru_ent_t;

typedef struct skv__pool {
  int npes, me;
  uint64_t pages;          /* per PE */
  skv__pe_hdr_t **hdr;     /* [npes] */
  skv__page_meta_t **meta; /* [npes] */
  /* owner-private, under mu */
  pthread_mutex_t mu;
  uint32_t *free_stack;
  uint64_t nfree;
  /* the LRU (pool.c): a queue of entries pushed in stamp order (a publish's), and a 4-ary
   * min-heap of the others (lru, at lru_mem + LRU_SKEW); nlru entries in all */
  skv__lru_ent_t *lru;
  uint64_t nlru, nheap;
  skv__lru_ent_t *lru_mem;
  skv__lru_ent_t *lru_q; /* a ring of `pages` entries: lru_q[q_head .. + q_len) */
  uint64_t q_head, q_len;
  /* this PE's pins, under pin_mu */
  pthread_mutex_t pin_mu;
  uint32_t *pins;        /* [npes * pages] */
  uint64_t pinned_pages; /* pages (any PE) this PE pins */
  /* liveness cache */
  int64_t *dead; /* [npes]: pid found dead, or 0 */
  uint64_t my_pidns;
  uint64_t *alive_checked_ms;
  /* elastic domains (src/domain/): liveness by the domain's locks instead of pids, pages a
   * slot's previous incarnation left pinned (owner-private, under mu), and the PEs whose pins
   * this PE dropped when their incarnation went (their unpins are then no-ops) */
  bool (*alive_fn)(void *arg, int pe);
  void *alive_arg;
  uint32_t *retired;
  uint64_t nretired;
  uint8_t *forgot; /* [npes] */
  /* leases (see above) */
  uint64_t lease_ms;     /* 0: pins never expire */
  uint64_t seen_revoked; /* our header's revoked when we last looked (under pin_mu) */
  uint64_t lease_lost;   /* times our pins were dropped because a lease ran out */
  /* remote pins (see "Remote pins" above): the rpins word an evictor last saw on each page of
   * ours and since when (owner-private, under mu) */
  struct {
    uint64_t word, since_ms;
  } * rp_seen;        /* [pages] */
  uint64_t rp_voided; /* remote pins treated as released (no pin or unpin for a lease) */
  /* evictions: told each candidate's key a few pages ahead (the cache prefetches its index slot) */
  void (*evict_hint)(void *arg, uint64_t key_hi, uint64_t key_lo, uint64_t islot);
  void (*evict_flush)(void *arg);
} skv__pool_t;

/* skv__pool_init flags (elastic domains). REUSE: the records belong to a slot that was used
 * before: generations continue (an old reference stays stale), pages still pinned by live PEs
 * are set aside until their pins drop. NO_PAGES: a reader's slot: its records are not touched. */
enum { SKV__POOL_REUSE = 1u, SKV__POOL_NO_PAGES = 2u };

/* Bytes of one PE's metadata (header + page records). */
uint64_t skv__pool_meta_bytes(uint64_t pages);
/* Bind to the shared segments (seg[i]: PE i's metadata) and initialise this PE's part. */
int skv__pool_init(skv__pool_t *p, int npes, int me, uint64_t pages, void *const *seg,
                   unsigned flags);
void skv__pool_fini(skv__pool_t *p);

/* Is local PE `pe` alive (cached for a few ms)? */
bool skv__pool_alive(skv__pool_t *p, int pe);
/* Judge liveness with fn(arg, pe) instead of pids (an elastic domain's locks); no cache. */
void skv__pool_set_alive(skv__pool_t *p, bool (*fn)(void *arg, int pe), void *arg);
/* Drop every pin this PE holds on PE `pe`'s pages (their incarnation is gone): counts and
 * mask bits cleared; later unpins of such pages succeed without effect. */
void skv__pool_forget_pe(skv__pool_t *p, int pe);

/* Renew this PE's lease (every call into the KV cache does). When evictors revoked pins of ours
 * since the last call, every pin we hold is dropped first and true is returned. */
bool skv__pool_renew(skv__pool_t *p);
/* Our header's revoked counter (a copy compares it before and after). */
uint64_t skv__pool_revoked(const skv__pool_t *p);

/* Pin / unpin a page of any PE with generation check. SKV_ESTALE when the page is no longer
 * READY with that generation. */
int skv__pool_pin(skv__pool_t *p, uint32_t pe, uint32_t page, uint32_t gen);
int skv__pool_unpin(skv__pool_t *p, uint32_t pe, uint32_t page);
/* The same for page i = (pe[i * pe_step], page[i * page_step]) of a batch, at generation
 * gen[i * gen_step]: all or none (the first failure, with *bad its index, after the pins taken
 * were released). */
int skv__pool_pin_n(skv__pool_t *p, const uint32_t *pe, size_t pe_step, const uint32_t *page,
                    size_t page_step, const uint32_t *gen, size_t gen_step, size_t n, size_t *bad);
/* Pin pages (pe[i], page[i]) at generation gen[i] in order up to the first stale one: how many
 * were pinned (those pins are the caller's). A lookup's hits, pinned with one lock per run. */
size_t skv__pool_pin_prefix(skv__pool_t *p, const uint32_t *pe, const uint32_t *page,
                            const uint32_t *gen, size_t n);
/* Release `times` (1 or 2) pins on every page of a batch; every page is tried, the first failure
 * returned. */
int skv__pool_unpin_n(skv__pool_t *p, const uint32_t *pe, size_t pe_step, const uint32_t *page,
                      size_t page_step, size_t n, int times);

/* Does this PE hold a pin on page `page` of PE `pe` at generation `gen`? 0 when it does,
 * SKV_ENOTFOUND when it holds none there, SKV_ESTALE when its pin is on another generation. */
int skv__pool_held(skv__pool_t *p, uint32_t pe, uint32_t page, uint32_t gen);
/* Does this PE hold a pin on every page of refs[0..n) (a page listed k times: k pins)? 0, or
 * SKV_ENOTFOUND with *bad the first reference short of a pin. Changes nothing. */
int skv__pool_held_refs(skv__pool_t *p, const skv_page_ref_t *refs, size_t n, size_t *bad);
/* The page's current generation. */
static inline uint32_t skv__pool_gen(const skv__pool_t *p, uint32_t pe, uint32_t page) {
  return skv__st_gen(__atomic_load_n(&p->meta[pe][page].state, __ATOMIC_ACQUIRE));
}

/* Eviction passes call hint(arg of the evict callback, key, the record's islot) for candidates
 * a few pages before deciding on them (a prefetch of the index slot the eviction will erase);
 * NULL: none. */
typedef void (*skv__pool_hint_fn)(void *arg, uint64_t key_hi, uint64_t key_lo, uint64_t islot);
static inline void skv__pool_set_evict_hint(skv__pool_t *p, skv__pool_hint_fn hint) {
  p->evict_hint = hint;
}
/* Every eviction pass (and skv__pool_drain) ends with flush(arg of the evict callback), under
 * mu: what the callbacks of the pass kept back (counts) goes out once. NULL: none. */
static inline void skv__pool_set_evict_flush(skv__pool_t *p, void (*flush)(void *arg)) {
  p->evict_flush = flush;
}

/* Owner: take a page (evicting the LRU unpinned page if none is free; `evict` erases its index
 * entry) into WRITING state. SKV_ENOSPC when every page is pinned or being written. */
typedef void (*skv__pool_evict_cb)(void *arg, uint32_t page, uint32_t gen, uint64_t key_hi,
                                   uint64_t key_lo);
int skv__pool_alloc(skv__pool_t *p, skv__pool_evict_cb evict, void *arg, uint32_t *page,
                    uint32_t *gen, uint64_t *nevicted);
/* The same for n pages into pages[0..*got): stops at the first that fails (SKV_ENOSPC; the pages
 * taken are the caller's). */
int skv__pool_alloc_n(skv__pool_t *p, skv__pool_evict_cb evict, void *arg, uint32_t *pages,
                      size_t n, size_t *got, uint64_t *nevicted);
/* Owner: WRITING -> READY with its key, so that pins can succeed once the key is indexed. */
void skv__pool_ready(skv__pool_t *p, uint32_t page, uint64_t key_hi, uint64_t key_lo);
/* The same, with the time of its last use given (a batch reads the clock once). */
void skv__pool_ready_at(skv__pool_t *p, uint32_t page, uint64_t key_hi, uint64_t key_lo,
                        uint64_t now);
/* Owner: the page's key is in the index: make it an eviction candidate (LRU). */
void skv__pool_commit(skv__pool_t *p, uint32_t page);
void skv__pool_commit_n(skv__pool_t *p, const uint32_t *pages, size_t n);
/* Owner: WRITING or READY-but-never-indexed -> FREE (a deduplicated or failed publish). */
void skv__pool_release(skv__pool_t *p, uint32_t page);
/* Owner leaving an elastic domain: take every READY page out of service: READY -> EVICTING,
 * wait until no live PE pins it (bounded: until deadline_ms, skv__now_ms() time), erase its index
 * entry through `evict`, FREE at the next generation; WRITING pages go FREE too. A page still
 * pinned at the deadline goes all the same: its pinners' copies read their own mappings, which
 * stay valid, and their later pins fail as stale. Returns how many pages were still pinned. */
uint64_t skv__pool_drain(skv__pool_t *p, skv__pool_evict_cb evict, void *arg, uint64_t deadline_ms);
/* Owner: evict up to n LRU unpinned pages. */
uint64_t skv__pool_evict(skv__pool_t *p, uint64_t n, skv__pool_evict_cb evict, void *arg);
/* Owner, ahead of allocations: evict LRU unpinned pages until *nfree pages are free (read before
 * each run: lowering it stops the reclaim), in runs of a few dozen with the lock released between
 * them (an allocation or a commit waits one run at most); stops early once *stop is nonzero, or
 * when nothing more can be evicted. Returns how many pages it evicted. */
uint64_t skv__pool_reclaim(skv__pool_t *p, const uint64_t *nfree, skv__pool_evict_cb evict,
                           void *arg, const int *stop);
/* Record a use of a page (lookup hit). */
static inline void skv__pool_touch(skv__pool_t *p, uint32_t pe, uint32_t page, uint64_t now) {
  skv__page_meta_t *m = &p->meta[pe][page];
  if (__atomic_load_n(&m->last_use, __ATOMIC_RELAXED) < now)
    __atomic_store_n(&m->last_use, now, __ATOMIC_RELAXED);
}
/* Counts for stats. */
uint64_t skv__pool_used(skv__pool_t *p);
uint64_t skv__pool_pinned_own(skv__pool_t *p);

#endif
