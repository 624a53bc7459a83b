/* The elastic node domain: the named segment and its layout, attach and detach, the slot locks
 * that tell who is alive, reclaiming a dead participant's slot. The protocol is in domain.h. */
#define _GNU_SOURCE
#include "domain/domain_int.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define DOM_MAGIC        0x316d6f64766b7973ull /* "symkvdom1" */
#define DOM_VERSION      3 /* 2: the index shards' reach bytes (index.h); 3: pin bytes (pool.h) */
#define DEFAULT_PAGES    1024
#define ALIVE_RECHECK_MS 10
#define ATTACH_RETRIES   8

/* ---- locks: open-file-description locks on bytes of the segment -------------------------- */

static int ofd_try(int fd, off_t start, off_t len, short type) {
  struct flock fl;
  memset(&fl, 0, sizeof fl);
  fl.l_type = type;
  fl.l_whence = SEEK_SET;
  fl.l_start = start;
  fl.l_len = len;
  return fcntl(fd, F_OFD_SETLK, &fl) == 0 ? 0 : -errno;
}

/* Lock [start, start + len) for writing, waiting up to timeout_ms. */
static int ofd_lock(int fd, off_t start, off_t len, int timeout_ms, const char *what) {
  uint64_t deadline = skv__now_ms() + (uint64_t)timeout_ms;
  long nap_us = 50;
  for (;;) {
    int r = ofd_try(fd, start, len, F_WRLCK);
    if (r == 0) return 0;
    if (r != -EAGAIN && r != -EACCES)
      return SKV_FAIL(r, SKV_SUBSYS_KV, "locking %s failed: %s", what, strerror(-r));
    if (skv__now_ms() >= deadline)
      return SKV_FAIL(SKV_ETIMEDOUT, SKV_SUBSYS_KV,
                      "%s stayed locked for %d ms: another process is attaching or detaching "
                      "(or stopped while doing so)",
                      what, timeout_ms);
    struct timespec ts = {0, nap_us * 1000};
    nanosleep(&ts, NULL);
    if (nap_us < 5000) nap_us *= 2;
  }
}

static void ofd_unlock(int fd, off_t start, off_t len) {
  (void)ofd_try(fd, start, len, F_UNLCK);
}

/* Does another open file description hold a lock on [start, start + len)? Our own never
 * conflicts with us, so this is false for our own slot. */
static bool ofd_held(int fd, off_t start, off_t len) {
  struct flock fl;
  memset(&fl, 0, sizeof fl);
  fl.l_type = F_WRLCK;
  fl.l_whence = SEEK_SET;
  fl.l_start = start;
  fl.l_len = len;
  if (fcntl(fd, F_OFD_GETLK, &fl) != 0) return true; /* cannot tell: assume alive */
  return fl.l_type != F_UNLCK;
}

#define ATTACH_BYTE  0
#define SLOT_BYTE(s) (1 + (off_t)(s))

bool skv__domain_alive(skv__domain_t *d, int s) {
  if (s == d->slot) return true;
  if (s < 0 || s >= (int)d->max_slots) return false;
  /* only "alive" is remembered (briefly): a slot found dead may have a new holder the next
   * moment, and its pages must not look dead then */
  uint64_t now = skv__now_ms();
  if (now - __atomic_load_n(&d->alive_ms[s], __ATOMIC_RELAXED) < ALIVE_RECHECK_MS) return true;
  bool alive = ofd_held(d->fd, SLOT_BYTE(s), 1);
  if (alive) __atomic_store_n(&d->alive_ms[s], now, __ATOMIC_RELAXED);
  return alive;
}

static bool alive_cb(void *arg, int s) {
  return skv__domain_alive(arg, s);
}

/* ---- layout -------------------------------------------------------------------------------- */

static uint64_t next_pow2(uint64_t x) {
  uint64_t p = 1;
  while (p < x) p <<= 1;
  return p;
}

static void layout(skv__dom_hdr_t *h, const skv__dom_params_t *p) {
  memset(h, 0, sizeof *h);
  h->version = DOM_VERSION;
  h->max_slots = p->max_slots ? p->max_slots : SKV__DOM_MAX_SLOTS;
  h->geom = p->geom;
  h->pages_per_slot = p->pages_per_slot ? p->pages_per_slot : DEFAULT_PAGES;
  h->page_bytes = p->page_bytes;
  h->page_stride = p->page_stride;
  h->slot_bytes = SKV_ALIGN_UP(h->pages_per_slot * h->page_stride, SKV__DOM_SLOT_ALIGN);
  h->backend = p->backend;
  uint64_t total_slots =
      p->index_slots ? p->index_slots : 4 * h->pages_per_slot * (uint64_t)h->max_slots;
  h->index_sps = next_pow2(
      SKV_MAX((total_slots + h->max_slots - 1) / h->max_slots, 2 * (uint64_t)SKV_INDEX_WINDOW));
  h->ns_hi = p->ns_hi;
  h->ns_lo = p->ns_lo;
  h->off_slots = 4096;
  h->off_pool = h->off_slots + SKV_ALIGN_UP(h->max_slots * sizeof(skv__dom_slot_t), 4096);
  h->pool_bytes = SKV_ALIGN_UP(skv__pool_meta_bytes(h->pages_per_slot), 4096);
  h->off_index = h->off_pool + h->max_slots * h->pool_bytes;
  h->shard_bytes = SKV_ALIGN_UP(skv__index_shard_bytes(h->index_sps), 4096);
  h->total_bytes = h->off_index + h->max_slots * h->shard_bytes;
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  h->created_ns = (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static const char *role_name(int role) {
  return role == SKV_ROLE_OWNER ? "owner" : "reader";
}

/* The same geometry (its size and version aside)? */
static bool same_geometry(const skv_geometry_t *a, const skv_geometry_t *b) {
  return a->kv_kind == b->kv_kind && a->num_layers == b->num_layers &&
         a->num_kv_heads == b->num_kv_heads && a->head_dim == b->head_dim &&
         a->elem_bytes == b->elem_bytes && a->page_tokens == b->page_tokens;
}

/* An attacher must agree with the domain it finds; the error names the difference. */
static int check_params(const skv__domain_t *d, const skv__dom_params_t *p) {
  const skv__dom_hdr_t *h = d->hdr;
  const char *n = p->name;
  if (h->version != DOM_VERSION)
    return SKV_FAIL(SKV_EVERSION, SKV_SUBSYS_KV,
                    "domain '%s' has layout version %u; this library knows %d: detach every "
                    "process of the other symkv version first",
                    n, h->version, DOM_VERSION);
  if (!same_geometry(&h->geom, &p->geom))
    return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_KV,
                    "domain '%s' holds pages of another geometry (kind=%u layers=%u heads=%u "
                    "dim=%u elem=%u page_tokens=%u) than this attach's (kind=%u layers=%u "
                    "heads=%u dim=%u elem=%u page_tokens=%u): use another domain name",
                    n, h->geom.kv_kind, h->geom.num_layers, h->geom.num_kv_heads, h->geom.head_dim,
                    h->geom.elem_bytes, h->geom.page_tokens, p->geom.kv_kind, p->geom.num_layers,
                    p->geom.num_kv_heads, p->geom.head_dim, p->geom.elem_bytes,
                    p->geom.page_tokens);
  if (p->pages_per_slot && p->pages_per_slot != h->pages_per_slot)
    return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_KV,
                    "domain '%s' gives each owner %" PRIu64 " pages; this attach asks %" PRIu64
                    " (pass 0 to take the domain's)",
                    n, h->pages_per_slot, p->pages_per_slot);
  if (p->max_slots && p->max_slots != h->max_slots)
    return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_KV,
                    "domain '%s' has %u slots; this attach asks %u (pass 0 to take the "
                    "domain's)",
                    n, h->max_slots, p->max_slots);
  if (p->role == SKV_ROLE_OWNER && p->backend != h->backend)
    return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_KV,
                    "domain '%s' keeps its pages in %s memory; this owner asks %s", n,
                    skv__backend_name(h->backend), skv__backend_name(p->backend));
  if ((p->ns_hi || p->ns_lo) && (h->ns_hi || h->ns_lo) &&
      (p->ns_hi != h->ns_hi || p->ns_lo != h->ns_lo))
    return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_KV,
                    "domain '%s' serves namespace %016" PRIx64 "%016" PRIx64
                    "; this attach uses %016" PRIx64 "%016" PRIx64
                    " (another model, salt or secret): use another domain name",
                    n, h->ns_hi, h->ns_lo, p->ns_hi, p->ns_lo);
  return 0;
}

static skv__dom_slot_t *slot_rec(const skv__domain_t *d, int s) {
  return &d->slots[s];
}

static void *pool_seg(const skv__domain_t *d, int s) {
  return (char *)d->seg + d->hdr->off_pool + (uint64_t)s * d->hdr->pool_bytes;
}

/* ---- reclaiming a dead participant's slot (attach lock held) ----------------------------- */

static void reclaim(skv__domain_t *d, int r) {
  const skv__dom_hdr_t *h = d->hdr;
  const uint64_t bit = 1ull << r;
  skv__dom_slot_t *rec = slot_rec(d, r);
  SKV_INFO(SKV_SUBSYS_KV, "domain '%s': slot %d (%s, pid %d) died: reclaiming it", d->name, r,
           role_name(rec->role), rec->pid);
  for (uint32_t s = 0; s < h->max_slots; s++) {
    skv__page_meta_t *m = (skv__page_meta_t *)((char *)pool_seg(d, (int)s) + sizeof(skv__pe_hdr_t));
    for (uint64_t i = 0; i < h->pages_per_slot; i++)
      if (skv__page_pinned_by(&m[i], r)) skv__page_pin_clear(&m[i], r);
    __atomic_fetch_and(&d->slots[s].mapped_by, ~bit, __ATOMIC_SEQ_CST);
  }
  /* Nothing may point at its pages any more: entries and claims out of the index, pages FREE
   * at their next generation (references to them stay stale). */
  skv__index_forget_pe(d->index, r);
  skv__page_meta_t *m = (skv__page_meta_t *)((char *)pool_seg(d, r) + sizeof(skv__pe_hdr_t));
  for (uint64_t i = 0; i < h->pages_per_slot; i++) {
    uint64_t st = __atomic_load_n(&m[i].state, __ATOMIC_ACQUIRE);
    if (skv__st_state(st) == SKV_PAGE_FREE) continue;
    uint32_t g = skv__st_gen(st), ng = g + 1 ? g + 1 : 1;
    __atomic_store_n(&m[i].state, skv__st_make(ng, SKV_PAGE_FREE), __ATOMIC_RELEASE);
  }
  rec->pid = 0;
  rec->sock[0] = '\0';
  __atomic_store_n(&rec->state, SKV__DOM_FREE, __ATOMIC_RELEASE);
  __atomic_add_fetch(&d->hdr->gen, 1, __ATOMIC_RELEASE);
}

/* Reclaim every slot whose holder died (attach lock held), then take the first slot whose lock
 * is free and that no live participant still maps. */
static int pick_slot(skv__domain_t *d) {
  const uint32_t n = d->hdr->max_slots;
  bool live[SKV__DOM_MAX_SLOTS];
  for (uint32_t s = 0; s < n; s++) {
    live[s] = ofd_held(d->fd, SLOT_BYTE(s), 1);
    if (!live[s] && __atomic_load_n(&slot_rec(d, (int)s)->state, __ATOMIC_ACQUIRE) != SKV__DOM_FREE)
      reclaim(d, (int)s);
  }
  for (uint32_t s = 0; s < n; s++) {
    if (live[s]) continue;
    skv__dom_slot_t *rec = slot_rec(d, (int)s);
    uint64_t by = __atomic_load_n(&rec->mapped_by, __ATOMIC_ACQUIRE);
    for (uint32_t q = 0; q < n; q++)
      if ((by & (1ull << q)) && !live[q]) {
        __atomic_fetch_and(&rec->mapped_by, ~(1ull << q), __ATOMIC_SEQ_CST);
        by &= ~(1ull << q);
      }
    if (by) continue; /* a live participant still maps its old segment */
    if (ofd_try(d->fd, SLOT_BYTE(s), 1, F_WRLCK) == 0) return (int)s;
  }
  return -1;
}

/* ---- open, lay out or validate ------------------------------------------------------------ */

static int check_name(const char *name) {
  size_t n = name ? strlen(name) : 0;
  if (n == 0 || n > 48)
    return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_KV,
                    "skv_kv_attach: the domain name must have 1..48 characters (got %zu)", n);
  for (size_t i = 0; i < n; i++) {
    char c = name[i];
    if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' ||
          c == '_' || c == '.'))
      return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_KV,
                      "skv_kv_attach: domain name '%s' may hold only letters, digits, '-', '_' "
                      "and '.'",
                      name);
  }
  return 0;
}

/* Open (creating when absent) the segment file, refuse another user's, and take the attach
 * lock on the file the name names now. */
static int open_locked(skv__domain_t *d, const skv__dom_params_t *p) {
  const mode_t mode = p->group >= 0 ? 0660 : 0600;
  for (int attempt = 0; attempt < ATTACH_RETRIES; attempt++) {
    int fd = shm_open(d->shm_name, O_RDWR | O_CREAT | O_CLOEXEC, mode);
    if (fd < 0) {
      int e = errno;
      struct stat st;
      if (e == EACCES && stat(d->path, &st) == 0)
        return SKV_FAIL(-EACCES, SKV_SUBSYS_KV,
                        "domain '%s' (%s) belongs to uid %u, group %u, mode %03o: this process "
                        "(uid %u) may not attach; use another name or a shared group",
                        d->name, d->path, (unsigned)st.st_uid, (unsigned)st.st_gid,
                        (unsigned)st.st_mode & 0777, (unsigned)geteuid());
      return SKV_FAIL(-e, SKV_SUBSYS_KV, "opening domain '%s' (%s) failed: %s", d->name, d->path,
                      strerror(e));
    }
    struct stat st;
    if (fstat(fd, &st) != 0) {
      close(fd);
      return SKV_FAIL(-errno, SKV_SUBSYS_KV, "fstat of domain '%s' failed", d->name);
    }
    bool group_ok = p->group >= 0 && st.st_gid == (gid_t)p->group && (st.st_mode & 0060) == 0060;
    if (st.st_uid != geteuid() && !group_ok) {
      close(fd);
      return SKV_FAIL(-EACCES, SKV_SUBSYS_KV,
                      "domain '%s' (%s) belongs to uid %u, not to this process's uid %u: refusing "
                      "to attach to another user's domain",
                      d->name, d->path, (unsigned)st.st_uid, (unsigned)geteuid());
    }
    int rc = ofd_lock(fd, ATTACH_BYTE, 1, p->timeout_ms, "the domain's attach lock");
    if (rc < 0) {
      close(fd);
      return rc;
    }
    /* A last detacher may have unlinked the file while we waited: use the one the name names. */
    struct stat now;
    if (stat(d->path, &now) == 0 && now.st_ino == st.st_ino && now.st_dev == st.st_dev) {
      d->fd = fd;
      return 0;
    }
    close(fd);
  }
  return SKV_FAIL(SKV_ETIMEDOUT, SKV_SUBSYS_KV,
                  "domain '%s' was removed and re-created %d times while attaching; try again",
                  d->name, ATTACH_RETRIES);
}

static int map_segment(skv__domain_t *d, size_t bytes) {
  void *m = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, d->fd, 0);
  if (m == MAP_FAILED)
    return SKV_FAIL(-errno, SKV_SUBSYS_KV, "mapping domain '%s' failed: %s", d->name,
                    strerror(errno));
  d->seg = m;
  d->seg_bytes = bytes;
  d->hdr = m;
  d->slots = (skv__dom_slot_t *)((char *)m + d->hdr->off_slots);
  return 0;
}

/* Lay the domain out afresh (attach lock held, no live participant). */
static int create_layout(skv__domain_t *d, const skv__dom_params_t *p) {
  skv__dom_hdr_t h;
  layout(&h, p);
  if (ftruncate(d->fd, 0) != 0 || ftruncate(d->fd, (off_t)h.total_bytes) != 0) {
    char b[32];
    return SKV_FAIL(-errno, SKV_SUBSYS_KV, "sizing domain '%s' to %s failed: %s", d->name,
                    skv__fmt_bytes(h.total_bytes, b, sizeof b), strerror(errno));
  }
  if (p->group >= 0 && (fchown(d->fd, (uid_t)-1, (gid_t)p->group) != 0 || fchmod(d->fd, 0660)))
    return SKV_FAIL(-errno, SKV_SUBSYS_KV, "giving domain '%s' to group %d failed: %s", d->name,
                    p->group, strerror(errno));
  skv__dom_hdr_t *mh = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, d->fd, 0);
  if (mh == MAP_FAILED) return SKV_FAIL(-errno, SKV_SUBSYS_KV, "mapping domain '%s'", d->name);
  uint64_t magic = DOM_MAGIC;
  h.magic = 0;
  memcpy(mh, &h, sizeof h);
  __atomic_store_n(&mh->magic, magic, __ATOMIC_RELEASE);
  munmap(mh, 4096);
  char b[32];
  SKV_INFO(SKV_SUBSYS_KV,
           "domain '%s' laid out: %u slots x %" PRIu64 " pages of %s, index %u x %" PRIu64
           " slots, %s in %s",
           d->name, h.max_slots, h.pages_per_slot, skv__fmt_bytes(h.page_bytes, b, sizeof b),
           h.max_slots, h.index_sps, skv__backend_name(h.backend), d->path);
  return 0;
}

static int open_domain(skv__domain_t *d, const skv__dom_params_t *p) {
  SKV_CHECK(open_locked(d, p));
  struct stat st;
  if (fstat(d->fd, &st) != 0) return SKV_FAIL(-errno, SKV_SUBSYS_KV, "fstat of domain failed");
  bool live = ofd_held(d->fd, SLOT_BYTE(0), SKV__DOM_MAX_SLOTS);
  bool fresh = st.st_size < 4096;
  if (!fresh) {
    skv__dom_hdr_t *h = mmap(NULL, 4096, PROT_READ, MAP_SHARED, d->fd, 0);
    if (h == MAP_FAILED) return SKV_FAIL(-errno, SKV_SUBSYS_KV, "mapping domain '%s'", d->name);
    fresh = __atomic_load_n(&h->magic, __ATOMIC_ACQUIRE) != DOM_MAGIC ||
            (uint64_t)st.st_size < h->total_bytes;
    munmap(h, 4096);
  }
  if (fresh || !live) {
    if (!fresh)
      SKV_INFO(SKV_SUBSYS_KV,
               "domain '%s': every process that used it is gone; laying it out afresh", d->name);
    SKV_CHECK(create_layout(d, p));
    if (fstat(d->fd, &st) != 0) return SKV_FAIL(-errno, SKV_SUBSYS_KV, "fstat of domain failed");
  }
  SKV_CHECK(map_segment(d, (size_t)st.st_size));
  if (__atomic_load_n(&d->hdr->magic, __ATOMIC_ACQUIRE) != DOM_MAGIC)
    return SKV_FAIL(SKV_EINTERNAL, SKV_SUBSYS_KV, "domain '%s' has no layout", d->name);
  return check_params(d, p);
}

/* ---- attach -------------------------------------------------------------------------------- */

static void bind_index(skv__domain_t *d) {
  const skv__dom_hdr_t *h = d->hdr;
  void *shards[SKV__DOM_MAX_SLOTS];
  for (uint32_t s = 0; s < h->max_slots; s++)
    shards[s] = (char *)d->seg + h->off_index + (uint64_t)s * h->shard_bytes;
  skv__index_bind(d->index, (int)h->max_slots, h->index_sps, shards, alive_cb, d);
}

static void domain_free(skv__domain_t *d) {
  if (d->pool->hdr) skv__pool_fini(d->pool);
  skv__dom_unmap_all(d);
  if (d->seg) munmap(d->seg, d->seg_bytes);
  skv__dom_release_own(d);
  if (d->fd >= 0) close(d->fd); /* drops every lock this process held on the domain */
  if (d->map_init) pthread_rwlock_destroy(&d->map_rw);
  free(d);
}

/* attach_once's answer when the domain's file was removed while it waited for a slot (the last
 * participant left): start over, a new domain is laid out */
#define ATTACH_AGAIN (-100000)

static int attach_once(const skv__dom_params_t *p, skv__domain_t **out) {
  *out = NULL;
  skv__domain_t *d = calloc(1, sizeof *d);
  if (!d) return SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_KV, "skv_kv_attach: out of memory");
  d->fd = -1;
  d->slot = -1;
  d->role = p->role;
  d->ctx = p->ctx;
  d->pool = p->pool;
  d->index = p->index;
  d->seg_fd = -1;
  d->listen_fd = d->stop_pipe[0] = d->stop_pipe[1] = -1;
  d->timeout_ms = p->timeout_ms;
  snprintf(d->name, sizeof d->name, "%s", p->name);
  snprintf(d->shm_name, sizeof d->shm_name, "/symkv-%s", p->name);
  snprintf(d->path, sizeof d->path, "/dev/shm/symkv-%s", p->name);
  pthread_rwlock_init(&d->map_rw, NULL);
  d->map_init = true;
  int rc = open_domain(d, p);
  if (rc == 0) {
    d->max_slots = d->hdr->max_slots;
    bind_index(d);
    /* Every slot taken: participants drop departed owners' mappings on their next call, and
     * detaching ones need the attach lock to leave, so a slot may come free soon. Wait a little
     * (bounded) without the lock before saying no. */
    d->slot = pick_slot(d);
    for (uint64_t until = skv__now_ms() + SKV_MIN((uint64_t)d->timeout_ms, 2000u);
         rc == 0 && d->slot < 0 && skv__now_ms() < until;) {
      ofd_unlock(d->fd, ATTACH_BYTE, 1);
      usleep(2000);
      rc = ofd_lock(d->fd, ATTACH_BYTE, 1, d->timeout_ms, "the domain's attach lock");
      struct stat st;
      if (rc == 0 && fstat(d->fd, &st) == 0 && st.st_nlink == 0) rc = ATTACH_AGAIN;
      if (rc == 0) d->slot = pick_slot(d);
    }
    if (rc == 0 && d->slot < 0)
      rc = SKV_FAIL(SKV_ENOSPC, SKV_SUBSYS_KV,
                    "domain '%s' has no free slot: its %u slots are held by live processes (or "
                    "still mapped by one); detach some, or create the domain with more slots",
                    d->name, d->max_slots);
  }
  if (rc == 0) {
    skv__dom_slot_t *rec = slot_rec(d, d->slot);
    skv__pe_hdr_t *ph = pool_seg(d, d->slot);
    bool reuse = ph->magic != 0; /* the slot had an incarnation before */
    rec->role = p->role;
    rec->pid = (int32_t)getpid();
    rec->seg_bytes = p->role == SKV_ROLE_OWNER ? d->hdr->slot_bytes : 0;
    rec->sock[0] = '\0';
    d->epoch = __atomic_add_fetch(&rec->epoch, 1, __ATOMIC_RELEASE);
    __atomic_store_n(&rec->state, SKV__DOM_ATTACHING, __ATOMIC_RELEASE);
    void *segs[SKV__DOM_MAX_SLOTS];
    for (uint32_t s = 0; s < d->max_slots; s++) segs[s] = pool_seg(d, (int)s);
    unsigned flags =
        (reuse ? SKV__POOL_REUSE : 0) | (p->role == SKV_ROLE_READER ? SKV__POOL_NO_PAGES : 0);
    rc = skv__pool_init(d->pool, (int)d->max_slots, d->slot, d->hdr->pages_per_slot, segs, flags);
    if (rc == 0) skv__pool_set_alive(d->pool, alive_cb, d);
  }
  if (rc == 0) rc = skv__dom_reserve(d);
  if (rc == 0 && p->role == SKV_ROLE_OWNER) rc = skv__dom_own_segment(d);
  if (rc == 0 && p->role == SKV_ROLE_OWNER) rc = skv__dom_handoff_start(d);
  if (rc == 0) {
    __atomic_store_n(&slot_rec(d, d->slot)->state, SKV__DOM_ACTIVE, __ATOMIC_RELEASE);
    __atomic_add_fetch(&d->hdr->gen, 1, __ATOMIC_RELEASE);
    SKV_INFO(SKV_SUBSYS_KV, "domain '%s': attached as %s in slot %d (incarnation %" PRIu64 ")",
             d->name, role_name(p->role), d->slot, d->epoch);
  } else if (d->slot >= 0) {
    skv__dom_handoff_stop(d);
    skv__dom_slot_t *rec = slot_rec(d, d->slot);
    rec->pid = 0;
    __atomic_store_n(&rec->state, SKV__DOM_FREE, __ATOMIC_RELEASE);
  }
  if (d->fd >= 0) ofd_unlock(d->fd, ATTACH_BYTE, 1);
  if (rc == ATTACH_AGAIN) {
    domain_free(d);
    return rc;
  }
  if (rc < 0) {
    char saved[1024];
    snprintf(saved, sizeof saved, "%s", skv_last_error());
    domain_free(d);
    skv__error_restore(saved);
    return rc;
  }
  *out = d;
  return 0;
}

int skv__domain_attach(const skv__dom_params_t *p, skv__domain_t **out) {
  *out = NULL;
  SKV_CHECK(check_name(p->name));
  for (int tries = 0;; tries++) {
    int rc = attach_once(p, out);
    if (rc != ATTACH_AGAIN) return rc;
    if (tries == 3)
      return SKV_FAIL(SKV_ETIMEDOUT, SKV_SUBSYS_KV,
                      "skv_kv_attach: domain '%s' was removed and laid out again %d times "
                      "while this process waited for a slot",
                      p->name, tries + 1);
  }
}

/* ---- detach -------------------------------------------------------------------------------- */

int skv__domain_detach(skv__domain_t *d, skv__pool_evict_cb unindex, void *unindex_arg,
                       void (*before_unmap)(void *arg), void *arg) {
  if (!d) return 0;
  int rc = ofd_lock(d->fd, ATTACH_BYTE, 1, d->timeout_ms, "the domain's attach lock");
  bool locked = rc == 0;
  if (!locked) {
    SKV_WARN(SKV_SUBSYS_KV, "domain '%s': detaching without the attach lock: %s", d->name,
             skv_last_error());
    rc = 0;
  }
  skv__dom_slot_t *rec = slot_rec(d, d->slot);
  __atomic_store_n(&rec->state, SKV__DOM_LEAVING, __ATOMIC_RELEASE);
  skv__dom_handoff_stop(d);
  if (d->role == SKV_ROLE_OWNER) {
    /* out of the index before anything is unmapped: no reader finds these pages any more */
    uint64_t still =
        skv__pool_drain(d->pool, unindex, unindex_arg, skv__now_ms() + (uint64_t)d->timeout_ms);
    if (still)
      SKV_INFO(SKV_SUBSYS_KV,
               "domain '%s': %" PRIu64 " pages were still pinned when slot %d left; their "
               "pinners read their own mappings, and later fetches of them fail as stale",
               d->name, still, d->slot);
  }
  if (before_unmap) before_unmap(arg);
  for (uint32_t s = 0; s < d->max_slots; s++) skv__pool_forget_pe(d->pool, (int)s);
  skv__dom_unmap_all(d);
  skv__dom_release_own(d);
  skv__pool_fini(d->pool);
  rec->pid = 0;
  rec->sock[0] = '\0';
  __atomic_store_n(&rec->state, SKV__DOM_FREE, __ATOMIC_RELEASE);
  __atomic_add_fetch(&d->hdr->gen, 1, __ATOMIC_RELEASE);
  /* The last one out removes the file: nothing of the domain stays behind. */
  if (locked && !ofd_held(d->fd, SLOT_BYTE(0), SKV__DOM_MAX_SLOTS)) {
    if (shm_unlink(d->shm_name) == 0)
      SKV_INFO(SKV_SUBSYS_KV, "domain '%s': last participant left, removed %s", d->name, d->path);
  }
  SKV_INFO(SKV_SUBSYS_KV, "domain '%s': slot %d detached", d->name, d->slot);
  domain_free(d); /* closing the file drops the slot and attach locks */
  return rc;
}

/* ---- accessors ----------------------------------------------------------------------------- */

skv_heap_t *skv__domain_heap(skv__domain_t *d) {
  return &d->heap;
}
int skv__domain_slot(const skv__domain_t *d) {
  return d->slot;
}
int skv__domain_role(const skv__domain_t *d) {
  return d->role;
}
const skv__dom_hdr_t *skv__domain_hdr(const skv__domain_t *d) {
  return d->hdr;
}
