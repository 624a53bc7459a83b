/* Page pool: shared page metadata, the pin protocol against the owner's eviction, an exact
 * LRU by lazy min-heap, and liveness of peers. The protocol is described in pool.h. */
#define _GNU_SOURCE
#include "pool/pool.h"

#include <errno.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define PE_MAGIC         0x766b6d7973ull /* "symkv" */
#define ALIVE_RECHECK_MS 20
#define PIN_EVICTING_WAIT_MS \
  20 /* a pin meeting EVICTING waits at most this for the evictor's verdict */

uint64_t skv__pool_meta_bytes(uint64_t pages) {
  return sizeof(skv__pe_hdr_t) + pages * sizeof(skv__page_meta_t);
}

/* What /proc says of a process: PROC_ALIVE with its start time (clock ticks since boot; with
 * the pid it names a process even if the pid is reused), PROC_GONE when it does not exist or is
 * a zombie, PROC_UNKNOWN when /proc could not be read (EMFILE, ...): that is no evidence. */
enum { PROC_ALIVE, PROC_GONE, PROC_UNKNOWN };
static int proc_start_time(int64_t pid, uint64_t *start) {
  char path[64], buf[1024];
  snprintf(path, sizeof path, "/proc/%lld/stat", (long long)pid);
  FILE *f = fopen(path, "r");
  if (!f) return errno == ENOENT || errno == ESRCH ? PROC_GONE : PROC_UNKNOWN;
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  bool err = ferror(f);
  fclose(f);
  if (err) return errno == ESRCH ? PROC_GONE : PROC_UNKNOWN; /* ESRCH: it exited meanwhile */
  buf[n] = '\0';
  char *p = strrchr(buf, ')'); /* the command name may contain spaces */
  if (!p || p[1] != ' ') return PROC_UNKNOWN;
  char state = p[2];
  if (state == 'Z' || state == 'X' || state == 'x') return PROC_GONE;
  /* fields after ")": state is field 3; start time is field 22 */
  int field = 3;
  for (char *q = p + 2; *q; q++) {
    if (*q == ' ') {
      field++;
      if (field == 22) {
        *start = strtoull(q + 1, NULL, 10);
        return PROC_ALIVE;
      }
    }
  }
  return PROC_UNKNOWN;
}

/* Inode of this process's PID namespace (0 if unknown). */
static uint64_t pid_namespace(void) {
  struct stat st;
  return stat("/proc/self/ns/pid", &st) == 0 ? (uint64_t)st.st_ino : 0;
}

/* The LRU (lru_push, lru_pop) is a queue and a 4-ary min-heap whose entry i is
 * lru_mem[i + LRU_SKEW]. */
#define LRU_ARITY 4
#define LRU_SKEW  3 /* entries before entry 0 in lru_mem: entry 4i + 1 starts a cache line */

int skv__pool_init(skv__pool_t *p, int npes, int me, uint64_t pages, void *const *seg,
                   unsigned flags) {
  memset(p, 0, sizeof *p);
  p->npes = npes;
  p->me = me;
  p->pages = pages;
  p->hdr = calloc((size_t)npes, sizeof *p->hdr);
  p->meta = calloc((size_t)npes, sizeof *p->meta);
  p->free_stack = malloc(pages * sizeof *p->free_stack);
  /* entry i at lru_mem[i + LRU_SKEW]: the children of entry i, 4i + 1 .. 4i + 4, fill one line */
  p->lru_mem = aligned_alloc(64, SKV_ALIGN_UP((pages + LRU_SKEW) * sizeof *p->lru, 64));
  p->lru = p->lru_mem ? p->lru_mem + LRU_SKEW : NULL;
  p->lru_q = malloc(pages * sizeof *p->lru_q);
  p->pins = calloc((size_t)npes * pages, sizeof *p->pins); /* untouched pages cost nothing */
  p->dead = calloc((size_t)npes, sizeof *p->dead);
  p->alive_checked_ms = calloc((size_t)npes, sizeof *p->alive_checked_ms);
  p->retired = malloc(pages * sizeof *p->retired);
  p->rp_seen = (flags & SKV__POOL_NO_PAGES) ? NULL : calloc(pages, sizeof *p->rp_seen);
  p->forgot = calloc((size_t)npes, 1);
  if (!p->hdr || !p->meta || !p->free_stack || !p->lru || !p->lru_q || !p->pins || !p->dead ||
      !p->alive_checked_ms || !p->retired || !p->forgot ||
      (!p->rp_seen && pages && !(flags & SKV__POOL_NO_PAGES))) {
    skv__pool_fini(p);
    return SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_POOL, "page pool: out of memory for %llu pages",
                    (unsigned long long)pages);
  }
  pthread_mutex_init(&p->mu, NULL);
  pthread_mutex_init(&p->pin_mu, NULL);
  for (int i = 0; i < npes; i++) {
    p->hdr[i] = seg[i];
    p->meta[i] = (skv__page_meta_t *)((char *)seg[i] + sizeof(skv__pe_hdr_t));
  }
  /* Our own records: every page FREE with generation 1 (0 never names a live page), or, for a
   * slot used before, the generation after the last one; pages a live PE still pins wait. */
  skv__pe_hdr_t *h = p->hdr[me];
  for (uint64_t i = 0; i < pages && !(flags & SKV__POOL_NO_PAGES); i++) {
    skv__page_meta_t *m = &p->meta[me][i];
    uint64_t st = __atomic_load_n(&m->state, __ATOMIC_ACQUIRE);
    uint64_t pins = (flags & SKV__POOL_REUSE) ? skv__page_pins(m) & ~(1ull << me) : 0;
    uint32_t gen = 1;
    if (flags & SKV__POOL_REUSE) {
      gen = skv__st_gen(st) ? skv__st_gen(st) : 1;
      if (skv__st_state(st) != SKV_PAGE_FREE) gen = gen + 1 ? gen + 1 : 1;
    }
    m->last_use = m->key_hi = m->key_lo = 0;
    /* remote pins of an earlier incarnation went with its UCX registration */
    __atomic_store_n(&m->rpins, 0, __ATOMIC_RELAXED);
    if (flags & SKV__POOL_REUSE) {
      skv__page_pin_clear(m, me); /* other PEs' pins stay: they may still be reading */
    } else {
      __atomic_store_n(&m->pinmask, 0, __ATOMIC_RELAXED);
      __atomic_store_n(&m->pinbytes, 0, __ATOMIC_RELAXED);
    }
    __atomic_store_n(&m->state, skv__st_make(gen, SKV_PAGE_FREE), __ATOMIC_RELEASE);
    if (pins)
      p->retired[p->nretired++] = (uint32_t)i;
    else
      p->free_stack[p->nfree++] = (uint32_t)i;
  }
  /* lowest pages first */
  for (uint64_t i = 0; i < p->nfree / 2; i++) {
    uint32_t t = p->free_stack[i];
    p->free_stack[i] = p->free_stack[p->nfree - 1 - i];
    p->free_stack[p->nfree - 1 - i] = t;
  }
  h->pid = getpid();
  uint64_t start = 0;
  (void)proc_start_time(h->pid, &start); /* 0 if unknown: then only the pid is compared */
  h->start_time = start;
  p->my_pidns = h->pidns = pid_namespace();
  h->pages = pages;
  long long lease = 30000;
  if (skv__env_int(SKV_ENV_PIN_LEASE_MS, 0, 86400000, 30000, &lease) != 0) lease = 30000;
  p->lease_ms = (uint64_t)lease;
  p->seen_revoked = __atomic_load_n(&h->revoked, __ATOMIC_ACQUIRE); /* a slot used before */
  __atomic_store_n(&h->lease_until, p->lease_ms ? skv__now_ms() + p->lease_ms : 0,
                   __ATOMIC_RELEASE);
  __atomic_store_n(&h->magic, PE_MAGIC, __ATOMIC_RELEASE);
  return 0;
}

void skv__pool_set_alive(skv__pool_t *p, bool (*fn)(void *arg, int pe), void *arg) {
  p->alive_fn = fn;
  p->alive_arg = arg;
}

void skv__pool_forget_pe(skv__pool_t *p, int pe) {
  pthread_mutex_lock(&p->pin_mu);
  for (uint64_t i = 0; i < p->pages; i++) {
    uint32_t *c = &p->pins[(uint64_t)pe * p->pages + i];
    if (*c == 0) continue;
    *c = 0;
    skv__page_pin_clear(&p->meta[pe][i], p->me);
    p->pinned_pages--;
  }
  p->forgot[pe] = 1;
  pthread_mutex_unlock(&p->pin_mu);
}

void skv__pool_fini(skv__pool_t *p) {
  if (p->hdr && p->hdr[p->me]) __atomic_store_n(&p->hdr[p->me]->pid, 0, __ATOMIC_RELEASE);
  free(p->hdr);
  free(p->meta);
  free(p->free_stack);
  free(p->lru_mem);
  free(p->lru_q);
  free(p->pins);
  free(p->dead);
  free(p->alive_checked_ms);
  free(p->retired);
  free(p->rp_seen);
  free(p->forgot);
  if (p->hdr) {
    pthread_mutex_destroy(&p->mu);
    pthread_mutex_destroy(&p->pin_mu);
  }
  memset(p, 0, sizeof *p);
}

bool skv__pool_alive(skv__pool_t *p, int pe) {
  if (pe == p->me) return true;
  if (pe < 0 || pe >= p->npes) return false;
  if (p->alive_fn) return p->alive_fn(p->alive_arg, pe);
  skv__pe_hdr_t *h = p->hdr[pe];
  int64_t pid = __atomic_load_n(&h->pid, __ATOMIC_ACQUIRE);
  if (pid <= 0) return false; /* left (finalised) */
  if (__atomic_load_n(&p->dead[pe], __ATOMIC_RELAXED) == pid) return false;
  uint64_t now = skv__now_ms();
  if (now - __atomic_load_n(&p->alive_checked_ms[pe], __ATOMIC_RELAXED) < ALIVE_RECHECK_MS)
    return true;
  /* Another PID namespace (or one we cannot tell): its pid means nothing here. */
  uint64_t ns = __atomic_load_n(&h->pidns, __ATOMIC_RELAXED);
  if (!ns || ns != p->my_pidns) return true;
  bool alive = true;
  uint64_t st = 0;
  if (kill((pid_t)pid, 0) != 0 && errno == ESRCH) {
    alive = false;
  } else {
    int r = proc_start_time(pid, &st);
    if (r == PROC_GONE || (r == PROC_ALIVE && h->start_time && st != h->start_time))
      alive = false;
    else if (r == PROC_UNKNOWN)
      return true; /* no evidence either way: ask again next time */
  }
  if (!alive) {
    __atomic_store_n(&p->dead[pe], pid, __ATOMIC_RELAXED);
    SKV_WARN(SKV_SUBSYS_POOL,
             "PE %d (pid %lld) has died: its pins are released, its pages stay readable", pe,
             (long long)pid);
  } else {
    __atomic_store_n(&p->alive_checked_ms[pe], now, __ATOMIC_RELAXED);
  }
  return alive;
}

/* ---- pins ---------------------------------------------------------------------------- */

/* The owner of a page died inside its own eviction, between its CAS to EVICTING(gen) and its
 * FREE store: nobody else would ever move the page again, and its key would stay broken for the
 * cache's life (indexed but never pinnable). Its bytes are intact (an eviction writes none), so
 * the eviction is undone: READY(gen) again, pinnable and readable like the dead owner's other
 * pages. If the owner had already erased the index entry, the page is simply not found any more
 * and the key can be published again. Returns the state now. */
static uint64_t undo_dead_eviction(skv__page_meta_t *m, uint32_t gen, uint32_t pe, uint32_t page) {
  uint64_t expect = skv__st_make(gen, SKV_PAGE_EVICTING);
  if (__atomic_compare_exchange_n(&m->state, &expect, skv__st_make(gen, SKV_PAGE_READY), false,
                                  __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
    SKV_WARN_RL(SKV_SUBSYS_POOL,
                "PE %u died while evicting its page %u (generation %u): eviction undone, the page "
                "is READY again",
                pe, page, gen);
  return __atomic_load_n(&m->state, __ATOMIC_SEQ_CST);
}

/* ---- leases ------------------------------------------------------------------------- */

bool skv__pool_renew(skv__pool_t *p) {
  if (!p->lease_ms || !p->hdr) return false;
  skv__pe_hdr_t *h = p->hdr[p->me];
  __atomic_store_n(&h->lease_until, skv__now_ms() + p->lease_ms, __ATOMIC_SEQ_CST);
  uint64_t rv = __atomic_load_n(&h->revoked, __ATOMIC_SEQ_CST);
  if (rv == __atomic_load_n(&p->seen_revoked, __ATOMIC_RELAXED)) return false;
  pthread_mutex_lock(&p->pin_mu);
  bool dropped = rv != p->seen_revoked;
  if (dropped) {
    uint64_t n = 0;
    for (uint64_t i = 0; i < (uint64_t)p->npes * p->pages; i++) {
      if (!p->pins[i]) continue;
      skv__page_pin_clear(&p->meta[i / p->pages][i % p->pages], p->me);
      p->pins[i] = 0;
      n++;
    }
    p->pinned_pages = 0;
    p->lease_lost++;
    __atomic_store_n(&p->seen_revoked, rv, __ATOMIC_RELAXED);
    SKV_WARN_RL(SKV_SUBSYS_POOL,
                "PE %d made no call for longer than its pin lease (%llu ms) while other PEs "
                "needed its pinned pages: its pins were revoked, %llu pins dropped; fetches of "
                "pages that went fail with SKV_ESTALE (SKV_PIN_LEASE_MS sets the lease)",
                p->me, (unsigned long long)p->lease_ms, (unsigned long long)n);
  }
  pthread_mutex_unlock(&p->pin_mu);
  return dropped;
}

uint64_t skv__pool_revoked(const skv__pool_t *p) {
  return p->hdr ? __atomic_load_n(&p->hdr[p->me]->revoked, __ATOMIC_SEQ_CST) : 0;
}

/* Has PE pe's lease run out (it lives but made no call for lease_ms)? Its own setting counts:
 * every PE of a cache reads the same SKV_PIN_LEASE_MS only by convention, so the holder's
 * lease_until, which it computed, is what is compared. */
static bool lease_expired(skv__pool_t *p, int pe) {
  if (!p->lease_ms) return false; /* this evictor does not revoke */
  uint64_t until = __atomic_load_n(&p->hdr[pe]->lease_until, __ATOMIC_SEQ_CST);
  return until != 0 && skv__now_ms() > until;
}

/* The pins on page record m (page `page` of ours) that still hold: bits of dead PEs are cleared
 * (their leases ended with them) and bits of live PEs whose lease ran out are revoked (counter
 * first, then the bit). Our own bit is left to the caller. */
static uint64_t live_pins(skv__pool_t *p, skv__page_meta_t *m, uint32_t page) {
  uint64_t pins = skv__page_pins(m);
  for (int pe = 0; pins && pe < p->npes; pe++) {
    uint64_t bit = 1ull << pe;
    if (!(pins & bit) || pe == p->me) continue;
    if (!skv__pool_alive(p, pe)) {
      skv__page_pin_clear(m, pe);
      pins &= ~bit;
    } else if (lease_expired(p, pe)) {
      __atomic_fetch_add(&p->hdr[pe]->revoked, 1, __ATOMIC_SEQ_CST);
      skv__page_pin_clear(m, pe);
      pins &= ~bit;
      SKV_WARN_RL(SKV_SUBSYS_POOL,
                  "PE %d holds a pin on page %u but made no call for longer than its lease: "
                  "pin revoked",
                  pe, page);
    }
  }
  return pins;
}

/* Do other nodes pin page `page` of ours (record m)? Read after the CAS to EVICTING, as
 * pinmask is; pins whose word stayed the same for a lease are treated as released (see
 * "Remote pins" in pool.h). Under mu. */
static bool remote_pins(skv__pool_t *p, skv__page_meta_t *m, uint32_t page) {
  const uint64_t w = __atomic_load_n(&m->rpins, __ATOMIC_SEQ_CST);
  if ((uint32_t)w == 0) return false;
  if (!p->rp_seen || !p->lease_ms) return true;
  const uint64_t now = skv__now_ms();
  if (p->rp_seen[page].word != w) {
    p->rp_seen[page].word = w;
    p->rp_seen[page].since_ms = now;
    return true;
  }
  if (now - p->rp_seen[page].since_ms <= p->lease_ms) return true;
  p->rp_voided++;
  SKV_WARN_RL(SKV_SUBSYS_POOL,
              "page %u holds %u pin(s) of other nodes, none pinned or unpinned for longer than the "
              "lease (%llu ms): treated as released",
              page, (uint32_t)w, (unsigned long long)p->lease_ms);
  return false;
}

/* Our pin on page `page` of PE pe (record m) is set, and the fence after it passed: does it
 * hold? 0, or SKV_ESTALE with the pin cleared again. pin_mu held. */
static int pin_check(skv__pool_t *p, skv__page_meta_t *m, uint32_t pe, uint32_t page,
                     uint32_t gen) {
  uint64_t st = __atomic_load_n(&m->state, __ATOMIC_SEQ_CST);
  /* The owner's evictor is between its CAS and its pins read: it either saw our pin and
   * puts the page back to READY, or evicts it (FREE, next generation). Wait for which. */
  uint64_t until = 0;
  for (unsigned spin = 0; st == skv__st_make(gen, SKV_PAGE_EVICTING); spin++) {
    if (spin < 256) {
      SKV_CPU_RELAX();
    } else { /* the evictor was descheduled in its window: let it run, if it lives */
      uint64_t now = skv__now_ms();
      if (!until) {
        if (!skv__pool_alive(p, (int)pe)) {
          st = undo_dead_eviction(m, gen, pe, page);
          break;
        }
        until = now + PIN_EVICTING_WAIT_MS;
      }
      if (now > until) break; /* it stopped there: stale for us */
      sched_yield();
    }
    st = __atomic_load_n(&m->state, __ATOMIC_SEQ_CST);
  }
  if (skv__st_state(st) != SKV_PAGE_READY || skv__st_gen(st) != gen) {
    skv__page_pin_clear(m, p->me);
    return SKV_ESTALE;
  }
  return 0;
}

/* Pin one page, pin_mu held. */
static inline __attribute__((always_inline)) int pin_locked(skv__pool_t *p, uint32_t pe,
                                                            uint32_t page, uint32_t gen) {
  skv__page_meta_t *m = &p->meta[pe][page];
  uint32_t *c = &p->pins[(uint64_t)pe * p->pages + page];
  if (*c > 0) {
    /* Our pin keeps the page from changing: its current generation is the pinned one. */
    if (skv__st_gen(__atomic_load_n(&m->state, __ATOMIC_ACQUIRE)) != gen) return SKV_ESTALE;
    (*c)++;
    return 0;
  }
  skv__page_pin_set(m, p->me);
  if (p->me < SKV_PIN_BYTE_PES) skv__pin_fence(); /* a bit's OR is one */
  int rc = pin_check(p, m, pe, page, gen);
  if (rc == 0) {
    *c = 1;
    p->pinned_pages++;
  }
  return rc;
}

int skv__pool_pin(skv__pool_t *p, uint32_t pe, uint32_t page, uint32_t gen) {
  pthread_mutex_lock(&p->pin_mu);
  int rc = pin_locked(p, pe, page, gen);
  pthread_mutex_unlock(&p->pin_mu);
  return rc;
}

/* Unpin one page, pin_mu held: 0, or SKV_EINVAL (not pinned by us; nothing logged). */
static inline __attribute__((always_inline)) int unpin_locked(skv__pool_t *p, uint32_t pe,
                                                              uint32_t page) {
  uint32_t *c = &p->pins[(uint64_t)pe * p->pages + page];
  if (*c == 0 && (p->forgot[pe] || p->lease_lost))
    return 0; /* dropped with its incarnation, or with a lease that ran out: nothing to release */
  if (*c == 0) return SKV_EINVAL;
  if (--*c == 0) {
    skv__page_pin_clear(&p->meta[pe][page], p->me);
    p->pinned_pages--;
  }
  return 0;
}

static int unpin_failed(uint32_t pe, uint32_t page) {
  return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_POOL,
                  "unpin of page %u of PE %u, which this PE does not hold pinned (unbalanced "
                  "unpin?)",
                  page, pe);
}

int skv__pool_unpin(skv__pool_t *p, uint32_t pe, uint32_t page) {
  pthread_mutex_lock(&p->pin_mu);
  int rc = unpin_locked(p, pe, page);
  pthread_mutex_unlock(&p->pin_mu);
  return rc ? unpin_failed(pe, page) : 0;
}

/* Batches take pin_mu once per PIN_RUN pages: a lock and an unlock per page were a third of a
 * pin's cost (symkv-bench fetch's breakdown), and the completion thread's unpins of the previous
 * batch contend for the same lock; a bounded run keeps the other thread's wait short. */
#define PIN_RUN 64
/* A batch's page records (other PEs' pages, cold) and this PE's pin counts are prefetched this
 * many pages ahead, so that their misses overlap instead of queueing behind each locked op. */
#define PIN_AHEAD 8

static inline void pin_prefetch(const skv__pool_t *p, uint32_t pe, uint32_t page) {
  SKV_PREFETCH_W(&p->meta[pe][page]);
  SKV_PREFETCH_W(&p->pins[(uint64_t)pe * p->pages + page]);
}

/* Pages [i, end) of a batch with pin bytes (PE < SKV_PIN_BYTE_PES), pin_mu held: every page's
 * count taken and, where it was 0, its byte stored; one fence; then, in order, each page
 * checked (the Dekker read of a new pin, the generation of one held already). A page that
 * fails gives its rc in *rc, and it and the pages after it are given back: returns the index
 * of the first page not pinned (end when all were). */
static size_t pin_bytes_run(skv__pool_t *p, const uint32_t *pe, size_t pe_step,
                            const uint32_t *page, size_t page_step, const uint32_t *gen,
                            size_t gen_step, size_t i, size_t end, size_t n, int *rc) {
  _Static_assert(PIN_RUN <= 64, "a run's new pins are a 64-bit mask");
  uint64_t fresh = 0; /* bit j - i: page j's pin is new in this run (its count was 0) */
  for (size_t j = i; j < end; j++) {
    if (j + PIN_AHEAD < n)
      pin_prefetch(p, pe[(j + PIN_AHEAD) * pe_step], page[(j + PIN_AHEAD) * page_step]);
    const uint32_t e = pe[j * pe_step], pg = page[j * page_step];
    uint32_t *c = &p->pins[(uint64_t)e * p->pages + pg];
    if ((*c)++ == 0) {
      skv__page_pin_set(&p->meta[e][pg], p->me);
      fresh |= 1ull << (j - i);
    }
  }
  if (fresh) skv__pin_fence(); /* only new pins need their Dekker read */
  size_t j = i;
  *rc = 0;
  for (; j < end && *rc == 0; j++) {
    const uint32_t e = pe[j * pe_step], pg = page[j * page_step], g = gen[j * gen_step];
    skv__page_meta_t *m = &p->meta[e][pg];
    if (fresh >> (j - i) & 1) {
      *rc = pin_check(p, m, e, pg, g);
      if (*rc == 0) p->pinned_pages++;
    } else if (skv__st_gen(__atomic_load_n(&m->state, __ATOMIC_ACQUIRE)) != g) {
      /* held already (earlier in this run or before it): the page cannot have changed */
      *rc = SKV_ESTALE;
    }
  }
  if (*rc == 0) return end;
  /* The failed page and those after it: counts back, and pins that only they held cleared
   * (none of them was counted in pinned_pages). */
  const size_t bad = j - 1;
  for (size_t k = end; k-- > bad;) {
    const uint32_t e = pe[k * pe_step], pg = page[k * page_step];
    if (--p->pins[(uint64_t)e * p->pages + pg] == 0) skv__page_pin_clear(&p->meta[e][pg], p->me);
  }
  return bad;
}

/* Pin the leading pages of a batch, in runs, up to the first that fails (its rc in *rc): how
 * many were pinned. */
static size_t pin_run(skv__pool_t *p, const uint32_t *pe, size_t pe_step, const uint32_t *page,
                      size_t page_step, const uint32_t *gen, size_t gen_step, size_t n, int *rc) {
  size_t i = 0;
  *rc = 0;
  while (i < n && *rc == 0) {
    const size_t end = SKV_MIN(n, i + PIN_RUN);
    pthread_mutex_lock(&p->pin_mu);
    if (p->me < SKV_PIN_BYTE_PES) {
      i = pin_bytes_run(p, pe, pe_step, page, page_step, gen, gen_step, i, end, n, rc);
    } else {
      for (; i < end; i++) {
        if (i + PIN_AHEAD < n)
          pin_prefetch(p, pe[(i + PIN_AHEAD) * pe_step], page[(i + PIN_AHEAD) * page_step]);
        *rc = pin_locked(p, pe[i * pe_step], page[i * page_step], gen[i * gen_step]);
        if (*rc) break;
      }
    }
    pthread_mutex_unlock(&p->pin_mu);
  }
  return i;
}

int skv__pool_pin_n(skv__pool_t *p, const uint32_t *pe, size_t pe_step, const uint32_t *page,
                    size_t page_step, const uint32_t *gen, size_t gen_step, size_t n, size_t *bad) {
  if (n == 1) { /* the one-page call costs what skv__pool_pin does (no run loop) */
    int rc = skv__pool_pin(p, pe[0], page[0], gen[0]);
    if (rc) *bad = 0;
    return rc;
  }
  int rc;
  const size_t i = pin_run(p, pe, pe_step, page, page_step, gen, gen_step, n, &rc);
  if (rc == 0) return 0;
  *bad = i;
  (void)skv__pool_unpin_n(p, pe, pe_step, page, page_step, i, 1);
  return rc;
}

size_t skv__pool_pin_prefix(skv__pool_t *p, const uint32_t *pe, const uint32_t *page,
                            const uint32_t *gen, size_t n) {
  int rc;
  return pin_run(p, pe, 1, page, 1, gen, 1, n, &rc);
}

int skv__pool_unpin_n(skv__pool_t *p, const uint32_t *pe, size_t pe_step, const uint32_t *page,
                      size_t page_step, size_t n, int times) {
  if (n == 1 && times == 1) return skv__pool_unpin(p, pe[0], page[0]);
  size_t bad = n;
  for (size_t i = 0; i < n;) {
    const size_t end = SKV_MIN(n, i + PIN_RUN);
    pthread_mutex_lock(&p->pin_mu);
    for (; i < end; i++) {
      if (i + PIN_AHEAD < n)
        pin_prefetch(p, pe[(i + PIN_AHEAD) * pe_step], page[(i + PIN_AHEAD) * page_step]);
      const uint32_t e = pe[i * pe_step], pg = page[i * page_step];
      int r = unpin_locked(p, e, pg);
      if (times == 2 && r == 0) r = unpin_locked(p, e, pg);
      if (r && bad == n) bad = i;
    }
    pthread_mutex_unlock(&p->pin_mu);
  }
  return bad < n ? unpin_failed(pe[bad * pe_step], page[bad * page_step]) : 0;
}

int skv__pool_held(skv__pool_t *p, uint32_t pe, uint32_t page, uint32_t gen) {
  pthread_mutex_lock(&p->pin_mu);
  uint32_t c = p->pins[(uint64_t)pe * p->pages + page];
  int rc = c == 0 ? SKV_ENOTFOUND : skv__pool_gen(p, pe, page) != gen ? SKV_ESTALE : 0;
  pthread_mutex_unlock(&p->pin_mu);
  return rc;
}

int skv__pool_held_refs(skv__pool_t *p, const skv_page_ref_t *refs, size_t n, size_t *bad) {
  /* Count each reference against this PE's pins (taken one by one, so that a page listed twice
   * needs two), then give every one back: the counts are private to this PE, under pin_mu. */
  int rc = 0;
  size_t i = 0;
  pthread_mutex_lock(&p->pin_mu);
  for (; i < n; i++) {
    uint32_t *c = &p->pins[(uint64_t)refs[i].pe * p->pages + refs[i].page];
    if (*c == 0) {
      rc = SKV_ENOTFOUND;
      *bad = i;
      break;
    }
    (*c)--;
  }
  while (i-- > 0) p->pins[(uint64_t)refs[i].pe * p->pages + refs[i].page]++;
  pthread_mutex_unlock(&p->pin_mu);
  return rc;
}

/* ---- LRU heap (owner, under mu) ------------------------------------------------------ */

/* A 4-ary min-heap by stamp: half the levels of a binary one, and an entry's four children
 * (16 bytes each) share one cache line, so a pop (an eviction) walks about log4(n) lines where a
 * binary heap walked log2(n) (perf of a full pool's publish put a quarter of it in the pops). */

static void heap_push(skv__pool_t *p, skv__lru_ent_t e) {
  uint64_t i = p->nheap++;
  const uint64_t stamp = e.stamp;
  while (i > 0) {
    uint64_t parent = (i - 1) / LRU_ARITY;
    if (p->lru[parent].stamp <= stamp) break;
    p->lru[i] = p->lru[parent];
    i = parent;
  }
  p->lru[i] = e;
}

static skv__lru_ent_t heap_pop(skv__pool_t *p) {
  skv__lru_ent_t top = p->lru[0];
  skv__lru_ent_t last = p->lru[--p->nheap];
  const uint64_t n = p->nheap;
  uint64_t i = 0;
  for (;;) {
    const uint64_t c = LRU_ARITY * i + 1;
    if (c >= n) break;
    uint64_t m = c, ms = p->lru[c].stamp;
    if (c + LRU_ARITY <= n) { /* a full line of children: the least without branches (their
                               * order is random: branches on it were mostly mispredicted) */
      const skv__lru_ent_t *ch = &p->lru[c];
      const uint64_t s0 = ch[0].stamp, s1 = ch[1].stamp, s2 = ch[2].stamp, s3 = ch[3].stamp;
      const uint64_t ia = s1 < s0 ? 1 : 0, sa = s1 < s0 ? s1 : s0;
      const uint64_t ib = s3 < s2 ? 3 : 2, sb = s3 < s2 ? s3 : s2;
      m = c + (sb < sa ? ib : ia);
      ms = sb < sa ? sb : sa;
    } else {
      for (uint64_t j = c + 1; j < n; j++)
        if (p->lru[j].stamp < ms) m = j, ms = p->lru[j].stamp;
    }
    if (ms >= last.stamp) break;
    p->lru[i] = p->lru[m];
    i = m;
  }
  if (n > 0) p->lru[i] = last;
  return top;
}

/* Entries pushed in stamp order (a publish commits its pages so, one clock read per batch)
 * queue up: pushing and popping them is O(1), where the heap's pop walked log4(n) lines (a
 * tenth of a full pool's publish on the GPU host's Xeon). An entry older than the queue's last
 * (a page touched since, pushed back by an eviction pass) goes to the heap; a pop takes the
 * older of the two heads, so the order is the heap's alone had: exact LRU. */
static void lru_push(skv__pool_t *p, uint64_t stamp, uint32_t page, uint32_t gen) {
  const skv__lru_ent_t e = {stamp, page, gen};
  p->nlru++;
  uint64_t tail = p->q_head + p->q_len;
  if (tail >= p->pages) tail -= p->pages;
  const uint64_t last = tail ? tail - 1 : p->pages - 1;
  if (p->q_len == 0 || p->lru_q[last].stamp <= stamp) {
    p->lru_q[tail] = e;
    p->q_len++;
  } else {
    heap_push(p, e);
  }
}

static skv__lru_ent_t lru_pop(skv__pool_t *p) {
  p->nlru--;
  if (p->q_len && (p->nheap == 0 || p->lru_q[p->q_head].stamp <= p->lru[0].stamp)) {
    const skv__lru_ent_t e = p->lru_q[p->q_head];
    p->q_head = p->q_head + 1 == p->pages ? 0 : p->q_head + 1;
    p->q_len--;
    return e;
  }
  return heap_pop(p);
}

/* Try to evict one READY page (generation gen). Returns true when it became FREE. */
static bool try_evict(skv__pool_t *p, uint32_t page, uint32_t gen, skv__pool_evict_cb evict,
                      void *arg) {
  skv__page_meta_t *m = &p->meta[p->me][page];
  uint64_t ready = skv__st_make(gen, SKV_PAGE_READY);
  uint64_t expect = ready;
  if (!__atomic_compare_exchange_n(&m->state, &expect, skv__st_make(gen, SKV_PAGE_EVICTING), false,
                                   __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
    return false;
  uint64_t pins = live_pins(p, m, page);
  if (pins || remote_pins(p, m, page)) {
    __atomic_store_n(&m->state, ready, __ATOMIC_SEQ_CST);
    return false;
  }
  evict(arg, page, gen, m->key_hi, m->key_lo);
  uint32_t ng = gen + 1 ? gen + 1 : 1;
  __atomic_store_n(&m->state, skv__st_make(ng, SKV_PAGE_FREE), __ATOMIC_RELEASE);
  return true;
}

/* Evict up to `want` LRU unpinned pages into the free stack (under mu); returns how many went.
 * Pages other PEs touched since they were pushed go back with their new time; pinned pages are
 * set aside and pushed back at the end. Other PEs may keep touching pages while the pass runs:
 * after as many push-backs as the heap had entries (plus `want`), recency is no longer honoured
 * and the next unpinned page popped goes (the oldest by its snapshot), so a pool with an
 * unpinned page never reports ENOSPC.
 * The records of the least recently used pages are cold (perf on symkv-bench fetch's publish:
 * the state load of the popped page was two thirds of the eviction), so entries are popped
 * EVICT_AHEAD ahead of the one decided on, their records and index slots prefetched. Popping
 * ahead keeps the decisions exactly those of one pop at a time: the queue holds the next entries
 * of the heap in order, and an entry pushed back with a newer time that sorts before queued
 * entries sends those back to the heap first. */
#define EVICT_AHEAD 8

static void evict_prefetch(skv__pool_t *p, const skv__lru_ent_t *e, void *arg) {
  const skv__page_meta_t *m = &p->meta[p->me][e->page];
  SKV_PREFETCH_W(m);
  if (p->evict_hint) /* the key's index slot: the record is warm by now (prefetched earlier) */
    p->evict_hint(arg, __atomic_load_n(&m->key_hi, __ATOMIC_RELAXED),
                  __atomic_load_n(&m->key_lo, __ATOMIC_RELAXED),
                  __atomic_load_n(&m->islot, __ATOMIC_RELAXED));
}

static uint64_t evict_lru_n(skv__pool_t *p, uint64_t want, skv__pool_evict_cb evict, void *arg) {
  skv__lru_ent_t *held = NULL, q[EVICT_AHEAD]; /* q: popped, not decided on yet, in heap order */
  const unsigned ahead = want > 1 ? EVICT_AHEAD : 1; /* one page: no pops to push back after */
  uint64_t nheld = 0, cap = 0, pushbacks = p->nlru + want, budget = 2 * (p->nlru + want) + 8;
  uint64_t done = 0;
  unsigned qh = 0, qn = 0; /* queue head and length (a ring) */
  while (done < want && budget > 0) {
    /* fill the queue: each entry's record is prefetched when popped, its index slot when the
     * entry is half way (its record has arrived meanwhile) */
    while (qn < ahead && qn < want - done + ahead / 2 && p->nlru > 0) {
      skv__lru_ent_t e = lru_pop(p);
      SKV_PREFETCH_W(&p->meta[p->me][e.page]);
      q[(qh + qn++) % EVICT_AHEAD] = e;
    }
    if (qn == 0) break;
    if (qn > EVICT_AHEAD / 2) evict_prefetch(p, &q[(qh + EVICT_AHEAD / 2) % EVICT_AHEAD], arg);
    skv__lru_ent_t e = q[qh];
    qh = (qh + 1) % EVICT_AHEAD;
    qn--;
    budget--;
    skv__page_meta_t *m = &p->meta[p->me][e.page];
    uint64_t st = __atomic_load_n(&m->state, __ATOMIC_ACQUIRE);
    if (skv__st_state(st) != SKV_PAGE_READY || skv__st_gen(st) != e.gen) continue; /* stale entry */
    uint64_t lu = __atomic_load_n(&m->last_use, __ATOMIC_RELAXED);
    if (lu > e.stamp && pushbacks > 0) {
      pushbacks--;
      /* queued entries newer than lu would come after it one pop at a time: back they go */
      while (qn > 0 && q[(qh + qn - 1) % EVICT_AHEAD].stamp > lu) {
        const skv__lru_ent_t b = q[(qh + --qn) % EVICT_AHEAD];
        lru_push(p, b.stamp, b.page, b.gen);
      }
      lru_push(p, lu, e.page, e.gen);
      continue;
    }
    if (lu > e.stamp) e.stamp = lu; /* if it stays (pinned), it goes back with its new time */
    if (try_evict(p, e.page, e.gen, evict, arg)) {
      p->free_stack[p->nfree++] = e.page;
      done++;
      continue;
    }
    if (nheld == cap) {
      uint64_t ncap = cap ? 2 * cap : 64;
      skv__lru_ent_t *nh = realloc(held, ncap * sizeof *nh);
      if (!nh) {
        lru_push(p, e.stamp, e.page, e.gen);
        break;
      }
      held = nh;
      cap = ncap;
    }
    held[nheld++] = e;
  }
  for (; qn > 0; qn--, qh = (qh + 1) % EVICT_AHEAD) lru_push(p, q[qh].stamp, q[qh].page, q[qh].gen);
  for (uint64_t i = 0; i < nheld; i++) lru_push(p, held[i].stamp, held[i].page, held[i].gen);
  free(held);
  if (done && p->evict_flush) p->evict_flush(arg);
  return done;
}

static bool evict_lru(skv__pool_t *p, skv__pool_evict_cb evict, void *arg) {
  return evict_lru_n(p, 1, evict, arg) == 1;
}

/* Pages a slot's previous incarnation left pinned go free once no live PE pins them (under mu;
 * they are FREE already, at their next generation, so no pin can succeed on them). */
static void recycle_retired(skv__pool_t *p) {
  for (uint64_t i = 0; i < p->nretired;) {
    uint32_t pg = p->retired[i];
    skv__page_meta_t *m = &p->meta[p->me][pg];
    if (live_pins(p, m, pg)) {
      i++;
      continue;
    }
    p->free_stack[p->nfree++] = pg;
    p->retired[i] = p->retired[--p->nretired];
  }
}

/* Take one page (mu held): false when none is free or evictable. */
static inline __attribute__((always_inline)) bool alloc_locked(skv__pool_t *p,
                                                               skv__pool_evict_cb evict, void *arg,
                                                               uint32_t *page, uint32_t *gen,
                                                               uint64_t *nevicted) {
  if (p->nfree == 0 && p->nretired) recycle_retired(p);
  if (p->nfree == 0 && evict_lru(p, evict, arg)) (*nevicted)++;
  if (p->nfree == 0) return false;
  uint32_t pg = p->free_stack[--p->nfree];
  skv__page_meta_t *m = &p->meta[p->me][pg];
  uint64_t st = __atomic_load_n(&m->state, __ATOMIC_ACQUIRE);
  SKV_ASSERT(skv__st_state(st) == SKV_PAGE_FREE);
  __atomic_store_n(&m->state, skv__st_make(skv__st_gen(st), SKV_PAGE_WRITING), __ATOMIC_RELEASE);
  *page = pg;
  *gen = skv__st_gen(st);
  return true;
}

static int alloc_failed(const skv__pool_t *p) {
  return SKV_FAIL(SKV_ENOSPC, SKV_SUBSYS_POOL,
                  "no free page on PE %d: all %llu pages are pinned or being written; unpin pages "
                  "(skv_kv_unpin / SKV_FETCH_UNPIN) or create the cache with more pages_per_pe",
                  p->me, (unsigned long long)p->pages);
}

int skv__pool_alloc(skv__pool_t *p, skv__pool_evict_cb evict, void *arg, uint32_t *page,
                    uint32_t *gen, uint64_t *nevicted) {
  pthread_mutex_lock(&p->mu);
  bool ok = alloc_locked(p, evict, arg, page, gen, nevicted);
  pthread_mutex_unlock(&p->mu);
  return ok ? 0 : alloc_failed(p);
}

/* Batches take mu once per POOL_RUN pages (allocations and commits), where a lock and an unlock
 * per page were: a publish's completion commits pages while its caller allocates the next
 * launch's, and both would hand the lock back and forth per page. A run bounds the other's wait
 * (an allocation may evict, an index erase each). */
#define POOL_RUN 64

int skv__pool_alloc_n(skv__pool_t *p, skv__pool_evict_cb evict, void *arg, uint32_t *pages,
                      size_t n, size_t *got, uint64_t *nevicted) {
  if (n == 1) { /* as skv__pool_alloc (no run loop) */
    uint32_t gen;
    int rc = skv__pool_alloc(p, evict, arg, pages, &gen, nevicted);
    *got = rc == 0;
    return rc;
  }
  bool ok = true;
  *got = 0;
  while (*got < n && ok) {
    const size_t end = SKV_MIN(n, *got + POOL_RUN);
    pthread_mutex_lock(&p->mu);
    if (p->nfree < end - *got && p->nretired) recycle_retired(p);
    if (p->nfree < end - *got) /* the run's evictions in one pass (prefetched) */
      *nevicted += evict_lru_n(p, end - *got - p->nfree, evict, arg);
    for (; *got < end; (*got)++) {
      uint32_t gen;
      ok = alloc_locked(p, evict, arg, &pages[*got], &gen, nevicted);
      if (!ok) break;
    }
    pthread_mutex_unlock(&p->mu);
  }
  return ok ? 0 : alloc_failed(p);
}

void skv__pool_ready(skv__pool_t *p, uint32_t page, uint64_t key_hi, uint64_t key_lo) {
  skv__pool_ready_at(p, page, key_hi, key_lo, skv__now_ns());
}

void skv__pool_ready_at(skv__pool_t *p, uint32_t page, uint64_t key_hi, uint64_t key_lo,
                        uint64_t now) {
  skv__page_meta_t *m = &p->meta[p->me][page];
  /* relaxed atomics: an eviction pass may read them early for its index prefetch (a hint) */
  __atomic_store_n(&m->key_hi, key_hi, __ATOMIC_RELAXED);
  __atomic_store_n(&m->key_lo, key_lo, __ATOMIC_RELAXED);
  __atomic_store_n(&m->last_use, now, __ATOMIC_RELAXED);
  uint32_t gen = skv__st_gen(__atomic_load_n(&m->state, __ATOMIC_RELAXED));
  /* Release is enough: a pin that reads READY(gen) sees the key and the page written before it
   * (acquire), and one that reads WRITING fails as stale; no pin can succeed before the index
   * insert that follows publishes the reference (a seq_cst CAS, after this store). The Dekker
   * pair is the pin against an eviction, not this store. (A seq_cst store was an xchg per page.) */
  __atomic_store_n(&m->state, skv__st_make(gen, SKV_PAGE_READY), __ATOMIC_RELEASE);
}

void skv__pool_commit(skv__pool_t *p, uint32_t page) {
  skv__pool_commit_n(p, &page, 1);
}

void skv__pool_commit_n(skv__pool_t *p, const uint32_t *pages, size_t n) {
  for (size_t i = 0; i < n;) {
    const size_t end = SKV_MIN(n, i + POOL_RUN);
    pthread_mutex_lock(&p->mu);
    for (; i < end; i++) {
      skv__page_meta_t *m = &p->meta[p->me][pages[i]];
      uint32_t gen = skv__st_gen(__atomic_load_n(&m->state, __ATOMIC_RELAXED));
      lru_push(p, __atomic_load_n(&m->last_use, __ATOMIC_RELAXED), pages[i], gen);
    }
    pthread_mutex_unlock(&p->mu);
  }
}

void skv__pool_release(skv__pool_t *p, uint32_t page) {
  skv__page_meta_t *m = &p->meta[p->me][page];
  uint32_t gen = skv__st_gen(__atomic_load_n(&m->state, __ATOMIC_RELAXED));
  uint32_t ng = gen + 1 ? gen + 1 : 1;
  __atomic_store_n(&m->state, skv__st_make(ng, SKV_PAGE_FREE), __ATOMIC_RELEASE);
  pthread_mutex_lock(&p->mu);
  p->free_stack[p->nfree++] = page;
  pthread_mutex_unlock(&p->mu);
}

uint64_t skv__pool_evict(skv__pool_t *p, uint64_t n, skv__pool_evict_cb evict, void *arg) {
  uint64_t done = 0;
  pthread_mutex_lock(&p->mu);
  while (done < n) { /* in passes of a bounded size (the pinned pages go back after each) */
    const uint64_t ask = SKV_MIN(n - done, (uint64_t)POOL_RUN), d = evict_lru_n(p, ask, evict, arg);
    done += d;
    if (d < ask) break; /* nothing more to evict */
  }
  pthread_mutex_unlock(&p->mu);
  return done;
}

uint64_t skv__pool_reclaim(skv__pool_t *p, const uint64_t *nfree_p, skv__pool_evict_cb evict,
                           void *arg, const int *stop) {
  uint64_t done = 0;
  while (!__atomic_load_n(stop, __ATOMIC_ACQUIRE)) {
    const uint64_t nfree = __atomic_load_n(nfree_p, __ATOMIC_RELAXED);
    pthread_mutex_lock(&p->mu);
    if (p->nfree < nfree && p->nretired) recycle_retired(p);
    const uint64_t ask = p->nfree < nfree ? SKV_MIN(nfree - p->nfree, (uint64_t)POOL_RUN) : 0;
    const uint64_t d = ask ? evict_lru_n(p, ask, evict, arg) : 0;
    pthread_mutex_unlock(&p->mu);
    done += d;
    if (ask == 0 || d < ask) break; /* enough free, or nothing more to evict */
  }
  return done;
}

uint64_t skv__pool_drain(skv__pool_t *p, skv__pool_evict_cb evict, void *arg,
                         uint64_t deadline_ms) {
  uint64_t still = 0;
  pthread_mutex_lock(&p->mu);
  for (uint64_t pg = 0; pg < p->pages; pg++) {
    skv__page_meta_t *m = &p->meta[p->me][pg];
    uint64_t st = __atomic_load_n(&m->state, __ATOMIC_ACQUIRE);
    uint32_t gen = skv__st_gen(st), ng = gen + 1 ? gen + 1 : 1;
    if (skv__st_state(st) == SKV_PAGE_WRITING) {
      __atomic_store_n(&m->state, skv__st_make(ng, SKV_PAGE_FREE), __ATOMIC_RELEASE);
      continue;
    }
    if (skv__st_state(st) != SKV_PAGE_READY) continue;
    if (!__atomic_compare_exchange_n(&m->state, &st, skv__st_make(gen, SKV_PAGE_EVICTING), false,
                                     __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
      continue;
    /* From here no new pin succeeds (Dekker, as in try_evict); wait for the ones held. */
    for (;;) {
      uint64_t pins = live_pins(p, m, (uint32_t)pg) & ~(1ull << p->me);
      if (!pins) break;
      if (skv__now_ms() >= deadline_ms) {
        still++;
        break;
      }
      struct timespec ts = {0, 200000}; /* 0.2 ms */
      nanosleep(&ts, NULL);
    }
    evict(arg, (uint32_t)pg, gen, m->key_hi, m->key_lo);
    __atomic_store_n(&m->state, skv__st_make(ng, SKV_PAGE_FREE), __ATOMIC_RELEASE);
  }
  p->nfree = p->nlru = p->nheap = p->q_len = p->nretired = 0; /* the pool is done with */
  if (p->evict_flush) p->evict_flush(arg);
  pthread_mutex_unlock(&p->mu);
  return still;
}

uint64_t skv__pool_used(skv__pool_t *p) {
  pthread_mutex_lock(&p->mu);
  uint64_t used = p->pages - p->nfree;
  pthread_mutex_unlock(&p->mu);
  return used;
}

uint64_t skv__pool_pinned_own(skv__pool_t *p) {
  uint64_t n = 0;
  for (uint64_t i = 0; i < p->pages; i++)
    if (skv__page_pins(&p->meta[p->me][i])) n++;
  return n;
}
