/* Tests of the elastic node domain (host backend): processes attach and detach in random order
 * while others publish and fetch (every byte checked against its key), kill -9 of owners and
 * readers at random points, restart and re-attach, two domains side by side, attaches refused
 * (another geometry, another user), nothing left in /dev/shm. */
#define _GNU_SOURCE
#include "skv_test.h"

#include "kv/kv.h"

#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

TestSuite(domain, .timeout = 300);

#define PAGES  64 /* pages of each owner */
#define SLOTS  16
#define KEYS   256 /* the key space every process draws from */
#define BLOCKS 8   /* engine blocks of one process (one page each) */

static skv_geometry_t geom(uint32_t layers) {
  skv_geometry_t g = SKV_GEOMETRY_INIT;
  g.num_layers = layers, g.num_kv_heads = 2, g.head_dim = 32, g.elem_bytes = 2, g.page_tokens = 16;
  return g;
}

/* A unique domain name per test run (tests of several runs may share the machine). */
static const char *dname(const char *what) {
  static char name[64];
  snprintf(name, sizeof name, "t%d-%s", (int)getpid(), what);
  return name;
}

static bool shm_exists(const char *name) {
  char path[128];
  snprintf(path, sizeof path, "/dev/shm/symkv-%s", name);
  return access(path, F_OK) == 0;
}

/* A process's engine cache: BLOCKS contiguous blocks of one page each, and its namespace. */
typedef struct eng {
  skv_geometry_t g;
  uint64_t pb;
  uint8_t *mem;
  skv_layout_t *lay;
  skv_namespace_t *ns;
} eng_t;

static int eng_open(eng_t *e, uint32_t layers) {
  e->g = geom(layers);
  if (skv_geometry_get_page_bytes(&e->g, &e->pb)) return 1;
  e->mem = malloc(e->pb * BLOCKS);
  void *base[1] = {e->mem};
  if (!e->mem ||
      skv_layout_create_preset(&e->g, SKV_LAYOUT_CONTIGUOUS, 16, BLOCKS, base, -1, &e->lay) ||
      skv_namespace_create("m", &e->g, NULL, 0, "secret", 6, &e->ns))
    return 1;
  return 0;
}

static void eng_close(eng_t *e) {
  skv_layout_destroy(e->lay);
  skv_namespace_destroy(e->ns);
  free(e->mem);
}

static skv_key_t key_of(const eng_t *e, uint64_t i) {
  skv_key_t k;
  (void)skv_namespace_hash_bytes(e->ns, &i, sizeof i, &k);
  return k;
}

/* The bytes a page of key k holds, whoever published it. */
static void content(skv_key_t k, uint8_t *p, uint64_t n) {
  uint64_t s = k.hi ^ (k.lo * 0x9e3779b97f4a7c15ull);
  for (uint64_t i = 0; i < n; i += 8) {
    uint64_t v = skv_test_rand(&s);
    memcpy(p + i, &v, 8);
  }
}

static int attach(const char *name, const eng_t *e, int role, skv_kv_t **kv) {
  skv_attach_opts_t o = SKV_ATTACH_OPTS_INIT;
  o.role = role;
  o.pages_per_pe = PAGES;
  o.max_slots = SLOTS;
  o.timeout_ms = 10000;
  return skv_kv_attach(name, &e->g, &o, kv);
}

/* Publish keys idx[0..n) (n <= BLOCKS) with their content. */
static int publish(skv_kv_t *kv, eng_t *e, const uint64_t *idx, size_t n) {
  skv_key_t keys[BLOCKS];
  uint64_t bids[BLOCKS];
  for (size_t i = 0; i < n; i++) {
    keys[i] = key_of(e, idx[i]);
    bids[i] = i;
    content(keys[i], e->mem + i * e->pb, e->pb);
  }
  return skv_kv_publish(kv, e->ns, keys, n, e->lay, bids, NULL, NULL);
}

/* Look key i up, fetch it when found and check every byte. 1: fetched and right; 0: a miss or
 * a stale reference (the owner left); -1: an error; -2: wrong bytes. */
static int fetch_check(skv_kv_t *kv, eng_t *e, uint64_t i) {
  skv_key_t k = key_of(e, i);
  skv_page_ref_t ref;
  size_t nhit = 0;
  int pin = (int)(i & 1); /* half pinned at lookup (released by the fetch), half not */
  if (skv_kv_lookup(kv, e->ns, &k, 1, pin ? SKV_LOOKUP_PIN : 0, &ref, &nhit)) return -1;
  if (!nhit) return 0;
  memset(e->mem, 0xa5, e->pb);
  uint64_t bid = 0;
  int rc = skv_kv_fetch(kv, &ref, 1, e->lay, &bid, pin ? SKV_FETCH_UNPIN : 0, NULL);
  if (rc == SKV_ESTALE) {
    if (pin) (void)skv_kv_unpin(kv, &ref, 1);
    return 0;
  }
  if (rc) {
    fprintf(stderr, "fetch of key %llu: %s: %s\n", (unsigned long long)i, skv_err_name(rc),
            skv_last_error());
    return -1;
  }
  uint8_t *want = malloc(e->pb);
  content(k, want, e->pb);
  bool same = memcmp(want, e->mem, e->pb) == 0;
  free(want);
  return same ? 1 : -2;
}

/* Is key i in the index (a lookup hit, no pin)? */
static size_t found(skv_kv_t *kv, eng_t *e, uint64_t i) {
  skv_key_t k = key_of(e, i);
  skv_page_ref_t ref;
  size_t nhit = 0;
  return skv_kv_lookup(kv, e->ns, &k, 1, 0, &ref, &nhit) == 0 ? nhit : 99;
}

/* ---- the basics ---------------------------------------------------------------------------- */

/* This process maps `n` slot segments (2 MiB here), each on a 2 MiB boundary and advised for
 * transparent huge pages (heap.h: skv__host_advise_huge). */
static bool segments_advised(int n) {
  int maps = 0, advised = 0;
  size_t huge_kb = 0;
  bool aligned = false;
  if (skv_test_maps("/memfd:symkv-dom-", &maps, &advised, &huge_kb, &aligned) != 0) return false;
  if (maps == n && advised == n && aligned) return true;
  fprintf(stderr, "domain segments: %d mapped (want %d), %d advised, %s\n", maps, n, advised,
          aligned ? "aligned" : "not all on 2 MiB boundaries");
  return false;
}

static int pe_basic(int rank, int npes, void *arg) {
  const char *name = arg;
  eng_t e;
  PE_CHECK(eng_open(&e, 2) == 0, "engine");
  skv_kv_t *kv;
  PE_CHECK(attach(name, &e, rank == 0 ? SKV_ROLE_OWNER : SKV_ROLE_READER, &kv) == 0, "attach");
  int fd = open("/proc/self/fd", O_RDONLY); /* a descriptor count before and after */
  close(fd);
  if (rank == 0) {
    uint64_t idx[BLOCKS];
    for (int i = 0; i < BLOCKS; i++) idx[i] = (uint64_t)i;
    PE_CHECK(publish(kv, &e, idx, BLOCKS) == 0, "publish");
    PE_CHECK(segments_advised(1), "the owner's segment");
    skv_test_sleep_ms(
        1500); /* the reader fetches meanwhile; then leave first (the reader still maps) */
  } else {
    int got = 0;
    for (int tries = 0; tries < 100 && got < BLOCKS; tries++) {
      got = 0;
      for (uint64_t i = 0; i < BLOCKS; i++) {
        int r = fetch_check(kv, &e, i);
        PE_CHECK(r >= 0, "key %llu: %d", (unsigned long long)i, r);
        got += r;
      }
      if (got < BLOCKS) skv_test_sleep_ms(10);
    }
    PE_CHECK(got == BLOCKS, "fetched %d of %d", got, BLOCKS);
    PE_CHECK(segments_advised(1), "the owner's segment mapped by the reader");
    /* a reader cannot publish */
    uint64_t idx = 99;
    PE_CHECK(publish(kv, &e, &idx, 1) == SKV_ESTATE, "reader publish: %s", skv_last_error());
    /* nor reserve pages to publish in parts */
    skv_key_t rk = key_of(&e, 99);
    skv_page_ref_t rref;
    PE_CHECK(skv_kv_reserve(kv, e.ns, &rk, 1, &rref, NULL) == SKV_ESTATE, "reader reserve: %s",
             skv_last_error());
    skv_test_sleep_ms(3000); /* the owner leaves meanwhile: its pages are gone, never wrong */
    for (uint64_t i = 0; i < BLOCKS; i++)
      PE_CHECK(found(kv, &e, i) == 0, "key %llu after leave", (unsigned long long)i);
  }
  PE_CHECK(skv_kv_detach(kv) == 0, "detach");
  eng_close(&e);
  return 0;
}

Test(domain, owner_publishes_reader_fetches_and_last_one_out_removes_it) {
  const char *name = dname("basic");
  skv_test_job_t job;
  int bad = skv_test_run(&job, 2, pe_basic, (void *)name, 60000);
  cr_assert_eq(bad, 0, "%s", skv_test_statuses(&job));
  cr_assert(!shm_exists(name), "the domain's file stayed in /dev/shm");
}

/* ---- attach and detach in random order while others publish and fetch -------------------- */

typedef struct churn {
  const char *name;
  int seconds;
} churn_t;

static int pe_churn(int rank, int npes, void *arg) {
  const churn_t *c = arg;
  eng_t e;
  PE_CHECK(eng_open(&e, 2) == 0, "engine");
  uint64_t s = skv_test_seed() ^ (uint64_t)rank;
  uint64_t end = skv__now_ms() + (uint64_t)c->seconds * 1000u;
  long fetched = 0, published = 0, attaches = 0;
  while (skv__now_ms() < end) {
    int role = skv_test_rand(&s) % 10 < 6 ? SKV_ROLE_OWNER : SKV_ROLE_READER;
    skv_kv_t *kv;
    int rc = attach(c->name, &e, role, &kv);
    PE_CHECK(rc == 0, "attach %ld: %s", attaches, skv_err_name(rc));
    attaches++;
    int steps = 20 + (int)(skv_test_rand(&s) % 200);
    for (int st = 0; st < steps; st++) {
      if (role == SKV_ROLE_OWNER && skv_test_rand(&s) % 2) {
        uint64_t idx[4];
        for (int i = 0; i < 4; i++) idx[i] = skv_test_rand(&s) % KEYS;
        rc = publish(kv, &e, idx, 4);
        PE_CHECK(rc == 0, "publish: %s", skv_err_name(rc));
        published += 4;
      } else {
        int r = fetch_check(kv, &e, skv_test_rand(&s) % KEYS);
        PE_CHECK(r != -2, "WRONG BYTES");
        PE_CHECK(r >= 0, "fetch failed");
        fetched += r;
      }
    }
    PE_CHECK(skv_kv_detach(kv) == 0, "detach");
  }
  fprintf(stderr, "rank %d: %ld attaches, %ld pages published, %ld fetched and checked\n", rank,
          attaches, published, fetched);
  eng_close(&e);
  return 0;
}

Test(domain, processes_attach_and_detach_in_random_order_every_byte_checked) {
  churn_t c = {dname("churn"), 6};
  skv_test_job_t job;
  int bad = skv_test_run(&job, 6, pe_churn, &c, 120000);
  cr_assert_eq(bad, 0, "%s", skv_test_statuses(&job));
  cr_assert(!shm_exists(c.name), "the domain's file stayed in /dev/shm");
}

/* ---- kill -9 of an owner or a reader at random points -------------------------------------- */

/* Owner: publish every key of [0, 32), then keep evicting and republishing until killed. */
static int pe_kill_owner(int rank, int npes, void *arg) {
  const char *name = arg;
  eng_t e;
  PE_CHECK(eng_open(&e, 2) == 0, "engine");
  skv_kv_t *kv;
  PE_CHECK(attach(name, &e, SKV_ROLE_OWNER, &kv) == 0, "attach");
  uint64_t s = skv_test_seed();
  for (;;) {
    uint64_t idx[BLOCKS];
    for (int i = 0; i < BLOCKS; i++) idx[i] = skv_test_rand(&s) % 32;
    PE_CHECK(publish(kv, &e, idx, BLOCKS) == 0, "publish");
    uint64_t ev;
    if (skv_test_rand(&s) % 4 == 0) (void)skv_kv_evict(kv, 4, &ev);
  }
}

/* Reader: fetch and check for 250 ms (or until killed); exits 2 on wrong bytes. */
static int pe_kill_reader(int rank, int npes, void *arg) {
  const char *name = arg;
  eng_t e;
  PE_CHECK(eng_open(&e, 2) == 0, "engine");
  skv_kv_t *kv;
  PE_CHECK(attach(name, &e, SKV_ROLE_READER, &kv) == 0, "attach");
  uint64_t s = skv_test_seed();
  uint64_t end = skv__now_ms() + 250;
  while (skv__now_ms() < end) {
    int r = fetch_check(kv, &e, skv_test_rand(&s) % 32);
    if (r == -2) return 2;
    PE_CHECK(r >= 0, "fetch failed");
  }
  PE_CHECK(skv_kv_detach(kv) == 0, "detach");
  return 0;
}

static pid_t fork_fn(skv_test_pe_fn fn, const char *name) {
  pid_t p = fork();
  if (p == 0) _exit(fn(0, 1, (void *)name));
  return p;
}

Test(domain, kill_9_of_owners_and_readers_at_random_points, .timeout = 600) {
  const char *name = dname("kill");
  uint64_t s = skv_test_seed();
  int trials = 100, owners_killed = 0, readers_killed = 0;
  eng_t e;
  cr_assert_eq(eng_open(&e, 2), 0);
  /* a witness keeps the domain alive throughout: the dead are reclaimed, not laid out afresh */
  skv_kv_t *witness;
  cr_assert_eq(attach(name, &e, SKV_ROLE_READER, &witness), 0, "%s", skv_last_error());
  for (int t = 0; t < trials; t++) {
    pid_t o = fork_fn(pe_kill_owner, name);
    pid_t r = fork_fn(pe_kill_reader, name);
    skv_test_sleep_ms(20 + (int)(skv_test_rand(&s) % 80));
    bool kill_owner = skv_test_rand(&s) % 2;
    kill(kill_owner ? o : r, SIGKILL);
    owners_killed += kill_owner, readers_killed += !kill_owner;
    int st;
    waitpid(kill_owner ? o : r, &st, 0);
    if (kill_owner) {
      /* the reader lives on, finds the dead owner's pages stale or gone, never wrong bytes */
      cr_assert_eq(waitpid(r, &st, 0), r);
      cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "trial %d: reader status %d", t, st);
    } else {
      kill(o, SIGKILL);
      waitpid(o, &st, 0);
    }
    /* Both gone now (one killed, the other killed or exited). The next attacher reclaims the
     * dead's slots: every key is gone (no page of the dead is indexed), and a fresh owner gets
     * all its pages (no leftover pin holds one). */
    skv_kv_t *kv;
    cr_assert_eq(attach(name, &e, SKV_ROLE_OWNER, &kv), 0, "trial %d: %s", t, skv_last_error());
    for (uint64_t i = 0; i < 32; i++)
      cr_assert_eq(found(kv, &e, i), 0, "trial %d: key %llu of the dead is still indexed", t,
                   (unsigned long long)i);
    for (int round = 0; round < PAGES / BLOCKS; round++) {
      uint64_t idx[BLOCKS];
      for (int i = 0; i < BLOCKS; i++) idx[i] = 1000 + (uint64_t)(round * BLOCKS + i);
      cr_assert_eq(publish(kv, &e, idx, BLOCKS), 0, "trial %d: %s", t, skv_last_error());
    }
    skv_kv_stats_t st2 = SKV_KV_STATS_INIT;
    cr_assert_eq(skv_kv_get_stats(kv, &st2), 0);
    cr_assert_eq(st2.pages_used, PAGES, "trial %d: %llu pages used", t,
                 (unsigned long long)st2.pages_used);
    int64_t valid = skv__index_check(&kv->index); /* every VALID slot, counted */
    cr_assert_eq(valid, PAGES, "trial %d: %lld valid index entries (the dead's stayed?)", t,
                 (long long)valid);
    cr_assert_eq(skv_kv_detach(kv), 0);
    /* the witness never reads a wrong byte either */
    for (uint64_t i = 0; i < 32; i++) cr_assert_geq(fetch_check(witness, &e, i), 0);
  }
  cr_assert_eq(skv_kv_detach(witness), 0);
  eng_close(&e);
  cr_assert(!shm_exists(name), "the domain's file stayed in /dev/shm");
  cr_log_info("%d trials: %d owners and %d readers killed", trials, owners_killed, readers_killed);
}

/* ---- restart and re-attach; stale references; pins waited for at detach -------------------- */

Test(domain, restart_reattach_old_references_are_stale_never_wrong) {
  const char *name = dname("restart");
  eng_t e;
  cr_assert_eq(eng_open(&e, 2), 0);
  /* a reader keeps the domain alive across the owner's restart */
  skv_kv_t *reader, *owner;
  cr_assert_eq(attach(name, &e, SKV_ROLE_READER, &reader), 0, "%s", skv_last_error());
  pid_t p = fork();
  if (p == 0) {
    skv_kv_t *kv;
    if (attach(name, &e, SKV_ROLE_OWNER, &kv)) _exit(1);
    uint64_t idx[BLOCKS];
    for (int i = 0; i < BLOCKS; i++) idx[i] = (uint64_t)i;
    if (publish(kv, &e, idx, BLOCKS)) _exit(2);
    skv_test_sleep_ms(800);
    _exit(skv_kv_detach(kv) ? 3 : 0);
  }
  /* pin references of the first incarnation while it is up */
  skv_page_ref_t refs[BLOCKS];
  skv_key_t keys[BLOCKS];
  size_t nhit = 0;
  for (int i = 0; i < BLOCKS; i++) keys[i] = key_of(&e, (uint64_t)i);
  for (int tries = 0; tries < 200 && nhit < BLOCKS; tries++) {
    nhit = 0;
    for (int i = 0; i < BLOCKS; i++) {
      size_t h = 0;
      cr_assert_eq(skv_kv_lookup(reader, e.ns, &keys[i], 1, 0, &refs[i], &h), 0);
      nhit += h;
    }
    if (nhit < BLOCKS) skv_test_sleep_ms(5);
  }
  cr_assert_eq(nhit, BLOCKS);
  int st;
  waitpid(p, &st, 0);
  cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "first owner: %d", st);
  /* the owner left: its pages are out of the index, old references stale */
  uint64_t bids[BLOCKS] = {0, 1, 2, 3, 4, 5, 6, 7};
  cr_assert_eq(skv_kv_fetch(reader, refs, BLOCKS, e.lay, bids, 0, NULL), SKV_ESTALE, "%s",
               skv_last_error());
  /* a new owner (this process) publishes again: new pages, new generations */
  cr_assert_eq(attach(name, &e, SKV_ROLE_OWNER, &owner), 0, "%s", skv_last_error());
  uint64_t idx[BLOCKS];
  for (int i = 0; i < BLOCKS; i++) idx[i] = (uint64_t)i;
  cr_assert_eq(publish(owner, &e, idx, BLOCKS), 0);
  cr_assert_eq(skv_kv_fetch(reader, refs, BLOCKS, e.lay, bids, 0, NULL), SKV_ESTALE);
  for (uint64_t i = 0; i < BLOCKS; i++) cr_assert_eq(fetch_check(reader, &e, i), 1);
  cr_assert_eq(skv_kv_detach(owner), 0);
  cr_assert_eq(skv_kv_detach(reader), 0);
  cr_assert(!shm_exists(name));
  eng_close(&e);
}

Test(domain, an_owner_leaving_waits_for_pins_then_their_fetch_is_stale) {
  const char *name = dname("pins");
  eng_t e;
  cr_assert_eq(eng_open(&e, 2), 0);
  skv_kv_t *reader;
  cr_assert_eq(attach(name, &e, SKV_ROLE_READER, &reader), 0);
  int go[2];
  cr_assert_eq(pipe(go), 0);
  pid_t p = fork();
  if (p == 0) {
    skv_attach_opts_t o = SKV_ATTACH_OPTS_INIT;
    o.pages_per_pe = PAGES, o.max_slots = SLOTS, o.timeout_ms = 600;
    skv_kv_t *kv;
    if (skv_kv_attach(name, &e.g, &o, &kv)) _exit(1);
    uint64_t idx = 7;
    if (publish(kv, &e, &idx, 1)) _exit(2);
    char c;
    if (read(go[0], &c, 1) != 1) _exit(3); /* the reader holds its pin now */
    uint64_t t0 = skv__now_ms();
    if (skv_kv_detach(kv)) _exit(4);
    uint64_t waited = skv__now_ms() - t0;
    _exit(waited >= 500 && waited < 5000 ? 0 : 5); /* it waited for the pin, boundedly */
  }
  skv_key_t k = key_of(&e, 7);
  skv_page_ref_t ref;
  size_t nhit = 0;
  for (int tries = 0; tries < 400 && !nhit; tries++) {
    cr_assert_eq(skv_kv_lookup(reader, e.ns, &k, 1, SKV_LOOKUP_PIN, &ref, &nhit), 0);
    if (!nhit) skv_test_sleep_ms(5);
  }
  cr_assert_eq(nhit, 1);
  cr_assert_eq(write(go[1], "x", 1), 1);
  int st;
  waitpid(p, &st, 0);
  cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "owner: status %d", st);
  uint64_t bid = 0;
  cr_assert_eq(skv_kv_fetch(reader, &ref, 1, e.lay, &bid, 0, NULL), SKV_ESTALE, "%s",
               skv_last_error());
  cr_assert_eq(skv_kv_unpin(reader, &ref, 1), 0, "%s", skv_last_error());
  cr_assert_eq(skv_kv_detach(reader), 0);
  cr_assert(!shm_exists(name));
  eng_close(&e);
}

/* ---- two domains; refusals; a domain whose processes all died ----------------------------- */

Test(domain, two_domains_side_by_side) {
  char a[64], b[64];
  snprintf(a, sizeof a, "%s", dname("side-a"));
  snprintf(b, sizeof b, "%s", dname("side-b"));
  eng_t e2, e3;
  cr_assert_eq(eng_open(&e2, 2), 0);
  cr_assert_eq(eng_open(&e3, 3), 0);
  skv_kv_t *ka, *kb;
  cr_assert_eq(attach(a, &e2, SKV_ROLE_OWNER, &ka), 0);
  cr_assert_eq(attach(b, &e3, SKV_ROLE_OWNER, &kb), 0);
  uint64_t idx[2] = {1, 2};
  cr_assert_eq(publish(ka, &e2, idx, 2), 0);
  cr_assert_eq(fetch_check(ka, &e2, 1), 1);
  cr_assert_eq(fetch_check(kb, &e3, 1), 0, "a key of domain a found in domain b");
  cr_assert_eq(publish(kb, &e3, idx, 1), 0);
  cr_assert_eq(fetch_check(kb, &e3, 1), 1);
  /* another geometry cannot attach to a */
  skv_kv_t *x;
  cr_assert_eq(attach(a, &e3, SKV_ROLE_READER, &x), SKV_EINVAL);
  cr_assert(strstr(skv_last_error(), "another geometry"), "%s", skv_last_error());
  /* nor another capacity, nor another backend for an owner */
  skv_attach_opts_t o = SKV_ATTACH_OPTS_INIT;
  o.pages_per_pe = PAGES + 1;
  cr_assert_eq(skv_kv_attach(a, &e2.g, &o, &x), SKV_EINVAL);
  cr_assert(strstr(skv_last_error(), "pages"), "%s", skv_last_error());
  o.pages_per_pe = 0;
  o.backend = SKV_BACKEND_CUDA;
  cr_assert_eq(skv_kv_attach(a, &e2.g, &o, &x), SKV_EINVAL);
  /* names */
  cr_assert_eq(attach("a/b", &e2, SKV_ROLE_OWNER, &x), SKV_EINVAL);
  cr_assert_eq(attach("", &e2, SKV_ROLE_OWNER, &x), SKV_EINVAL);
  cr_assert_eq(skv_kv_detach(ka), 0);
  cr_assert_eq(skv_kv_detach(kb), 0);
  cr_assert(!shm_exists(a) && !shm_exists(b));
  eng_close(&e2);
  eng_close(&e3);
}

Test(domain, a_domain_whose_processes_all_died_is_laid_out_afresh) {
  const char *name = dname("dead");
  eng_t e;
  cr_assert_eq(eng_open(&e, 2), 0);
  pid_t p = fork();
  if (p == 0) {
    skv_kv_t *kv;
    uint64_t idx[2] = {3, 4};
    if (attach(name, &e, SKV_ROLE_OWNER, &kv) || publish(kv, &e, idx, 2)) _exit(1);
    _exit(0); /* dies attached: the file stays */
  }
  int st;
  waitpid(p, &st, 0);
  cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0);
  cr_assert(shm_exists(name));
  skv_kv_t *kv;
  cr_assert_eq(attach(name, &e, SKV_ROLE_OWNER, &kv), 0, "%s", skv_last_error());
  cr_assert_eq(found(kv, &e, 3), 0, "a dead domain's key was found");
  cr_assert_eq(skv_kv_detach(kv), 0);
  cr_assert(!shm_exists(name));
  eng_close(&e);
}

Test(domain, another_users_domain_is_refused) {
  if (geteuid() != 0)
    cr_skip_test("switching to another user needs root (this runs as uid %d)", (int)geteuid());
  const char *name = dname("user");
  eng_t e;
  cr_assert_eq(eng_open(&e, 2), 0);
  skv_kv_t *kv;
  cr_assert_eq(attach(name, &e, SKV_ROLE_OWNER, &kv), 0);
  pid_t p = fork();
  if (p == 0) { /* nobody: the domain is 0600 root's */
    if (setgid(65534) || setuid(65534)) _exit(9);
    skv_kv_t *x;
    int rc = attach(name, &e, SKV_ROLE_READER, &x);
    _exit(rc == -EACCES ? 0 : 1);
  }
  int st;
  waitpid(p, &st, 0);
  cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "nobody attached to root's domain: %d", st);
  cr_assert_eq(skv_kv_detach(kv), 0);
  /* and a name another user took first is refused, not used */
  const char *squat = dname("squat");
  p = fork();
  if (p == 0) {
    if (setgid(65534) || setuid(65534)) _exit(9);
    char path[96];
    snprintf(path, sizeof path, "/symkv-%s", squat);
    int fd = shm_open(path, O_RDWR | O_CREAT, 0666);
    _exit(fd >= 0 ? 0 : 1);
  }
  waitpid(p, &st, 0);
  cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0);
  cr_assert_eq(attach(squat, &e, SKV_ROLE_OWNER, &kv), -EACCES);
  cr_assert(strstr(skv_last_error(), "another user"), "%s", skv_last_error());
  char path[96];
  snprintf(path, sizeof path, "/symkv-%s", squat);
  shm_unlink(path);
  eng_close(&e);
}

Test(domain, a_killed_readers_pins_are_reclaimed) {
  const char *name = dname("rpins");
  eng_t e;
  cr_assert_eq(eng_open(&e, 2), 0);
  skv_kv_t *owner;
  cr_assert_eq(attach(name, &e, SKV_ROLE_OWNER, &owner), 0);
  uint64_t idx[BLOCKS];
  for (int i = 0; i < BLOCKS; i++) idx[i] = (uint64_t)i;
  cr_assert_eq(publish(owner, &e, idx, BLOCKS), 0);
  int ready[2];
  cr_assert_eq(pipe(ready), 0);
  pid_t p = fork();
  if (p == 0) { /* pin every page, say so, and wait to be killed */
    skv_kv_t *kv;
    if (attach(name, &e, SKV_ROLE_READER, &kv)) _exit(1);
    skv_key_t keys[BLOCKS];
    skv_page_ref_t refs[BLOCKS];
    for (int i = 0; i < BLOCKS; i++) keys[i] = key_of(&e, (uint64_t)i);
    for (int i = 0; i < BLOCKS; i++) {
      size_t h = 0;
      if (skv_kv_lookup(kv, e.ns, &keys[i], 1, SKV_LOOKUP_PIN, &refs[i], &h) || h != 1) _exit(2);
    }
    (void)!write(ready[1], "x", 1);
    for (;;) pause();
  }
  char c;
  cr_assert_eq(read(ready[0], &c, 1), 1);
  skv_kv_stats_t st = SKV_KV_STATS_INIT;
  cr_assert_eq(skv_kv_get_stats(owner, &st), 0);
  cr_assert_eq(st.pages_pinned, BLOCKS, "%llu pinned", (unsigned long long)st.pages_pinned);
  uint64_t ev = 0;
  cr_assert_eq(skv_kv_evict(owner, BLOCKS, &ev), 0);
  cr_assert_eq(ev, 0, "evicted pinned pages");
  kill(p, SIGKILL);
  int ws;
  waitpid(p, &ws, 0);
  skv_test_sleep_ms(20); /* past the liveness cache */
  cr_assert_eq(skv_kv_evict(owner, BLOCKS, &ev), 0);
  cr_assert_eq(ev, BLOCKS, "a dead reader's pins kept %llu pages",
               (unsigned long long)(BLOCKS - ev));
  cr_assert_eq(skv_kv_detach(owner), 0);
  cr_assert(!shm_exists(name));
  eng_close(&e);
}
