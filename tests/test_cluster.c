/* Tests of the cluster layer: "nodes" on this host as separate domains in separate processes,
 * UCX over loopback TCP, a redis-server started and stopped by each test. Publish on one node,
 * fetch on another byte for byte; a page evicted before the read is stale, never served; a
 * node killed mid-fetch; Redis unreachable, killed and restarted. */
#define _GNU_SOURCE
#include "skv_test.h"
#include "cluster/cluster.h"

#include <criterion/criterion.h>
#include <errno.h>
#include <hiredis.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stddef.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#ifdef SKV_WITH_CUDA
#include <cuda_runtime.h>
#endif

static char g_cluster[64]; /* the directory's prefix: t<pid of the test> */
static void setup(void) {
  snprintf(g_cluster, sizeof g_cluster, "t%d", (int)getpid());
  setenv("UCX_TLS", "tcp", 0); /* loopback TCP unless the caller chose (e.g. UCX_TLS=sm) */
}
TestSuite(cluster, .timeout = 120, .init = setup);

#define BLOCKS 64

/* ---- redis-server, started and stopped by the test ---------------------------------------- */

typedef struct redis {
  pid_t pid;
  int port;
  char url[64];
} redis_t;

static bool redis_ping(int port, int ms) {
  struct timeval tv = {0, 200000};
  uint64_t end = skv__now_ms() + (uint64_t)ms;
  do {
    redisContext *c = redisConnectWithTimeout("127.0.0.1", port, tv);
    if (c && !c->err) {
      redisReply *r = redisCommand(c, "PING");
      bool ok = r && r->type == REDIS_REPLY_STATUS;
      if (r) freeReplyObject(r);
      redisFree(c);
      if (ok) return true;
    } else if (c) {
      redisFree(c);
    }
    skv_test_sleep_ms(20);
  } while (skv__now_ms() < end);
  return false;
}

static void redis_start(redis_t *r, int port) {
  if (access("/usr/bin/redis-server", X_OK) != 0 && system("command -v redis-server >/dev/null"))
    cr_skip_test("redis-server not installed (tests/deps.sh installs it from Debian)");
  r->port = port > 0 ? port : skv_test_free_port();
  snprintf(r->url, sizeof r->url, "redis://127.0.0.1:%d", r->port);
  fflush(stdout), fflush(stderr);
  r->pid = fork();
  if (r->pid == 0) { /* no Criterion call in a forked child: it would talk to the runner */
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    char port_s[16];
    snprintf(port_s, sizeof port_s, "%d", r->port);
    freopen("/dev/null", "w", stdout);
    execlp("redis-server", "redis-server", "--port", port_s, "--bind", "127.0.0.1", "--save", "",
           "--appendonly", "no", "--daemonize", "no", (char *)NULL);
    _exit(127);
  }
  cr_assert(r->pid > 0, "fork: %s", strerror(errno));
  cr_assert(redis_ping(r->port, 5000), "redis-server on port %d did not answer in 5 s", r->port);
}

static void redis_stop(redis_t *r) {
  if (r->pid > 0) {
    kill(r->pid, SIGKILL);
    waitpid(r->pid, NULL, 0);
    r->pid = 0;
  }
}

/* Keys under `pattern` in the test's Redis. */
static long long redis_count(const redis_t *r, const char *pattern) {
  struct timeval tv = {1, 0};
  redisContext *c = redisConnectWithTimeout("127.0.0.1", r->port, tv);
  if (!c || c->err) return -1;
  redisReply *rep = redisCommand(c, "KEYS %s", pattern);
  long long n = rep && rep->type == REDIS_REPLY_ARRAY ? (long long)rep->elements : -1;
  if (rep) freeReplyObject(rep);
  redisFree(c);
  return n;
}

/* ---- a node: a domain of its own, one owner process, a cluster handle ------------------- */

typedef struct eng {
  skv_geometry_t g;
  uint64_t pb;
  uint8_t *mem;
  uint8_t *dev; /* a GPU node: its blocks in GPU memory (mem then holds what is copied there) */
  skv_layout_t *lay;
  skv_namespace_t *ns;
  skv_kv_t *kv;
  skv_cluster_t *cl;
} eng_t;

/* Key i (no Criterion call: node children use it too). */
static skv_key_t key_of(const skv_namespace_t *ns, uint32_t i) {
  skv_key_t k = {0, 0};
  if (skv_namespace_hash_bytes(ns, &i, sizeof i, &k) != 0) abort();
  return k;
}

/* The bytes page `i` holds in version `v`. */
static uint8_t pat(uint32_t i, uint32_t v, uint64_t j) {
  return (uint8_t)(i * 131u + v * 17u + (uint32_t)(j * 7u) + (uint32_t)(j >> 9));
}

/* A node; gpu: its pages (a CUDA domain, exported through UCX's CUDA support) and its blocks in
 * GPU memory. */
static int eng_open(eng_t *e, const char *domain, uint32_t layers, uint64_t pages, const char *node,
                    const char *url, int lease_ms, int timeout_ms, bool gpu) {
  memset(e, 0, sizeof *e);
  e->g = (skv_geometry_t)SKV_GEOMETRY_INIT;
  e->g.num_layers = layers, e->g.num_kv_heads = 2, e->g.head_dim = 32, e->g.elem_bytes = 2;
  e->g.page_tokens = 16;
  int rc;
  if ((rc = skv_geometry_get_page_bytes(&e->g, &e->pb))) return rc;
  e->mem = malloc(e->pb * BLOCKS);
  void *base[1] = {e->mem};
  if (!e->mem) return SKV_ENOMEM;
#ifdef SKV_WITH_CUDA
  if (gpu && cudaMalloc((void **)&e->dev, e->pb * BLOCKS) != cudaSuccess) return SKV_ECUDA;
  if (gpu) base[0] = e->dev;
#else
  if (gpu) return SKV_ENOTSUP;
#endif
  if ((rc = skv_layout_create_preset(&e->g, SKV_LAYOUT_CONTIGUOUS, 16, BLOCKS, base, gpu ? 0 : -1,
                                     &e->lay)) ||
      (rc = skv_namespace_create("m", &e->g, NULL, 0, "secret", 6, &e->ns)))
    return rc;
  skv_attach_opts_t ao = SKV_ATTACH_OPTS_INIT;
  ao.pages_per_pe = pages;
  ao.max_slots = 4;
  ao.timeout_ms = timeout_ms;
  if (gpu) ao.backend = SKV_BACKEND_CUDA;
  if ((rc = skv_kv_attach(domain, &e->g, &ao, &e->kv))) return rc;
  skv_cluster_opts_t co = SKV_CLUSTER_OPTS_INIT;
  co.redis_url = url;
  co.node = node;
  co.lease_ms = lease_ms;
  co.timeout_ms = timeout_ms;
  co.cluster = g_cluster;
  return skv_cluster_join(e->kv, &co, &e->cl);
}

static void eng_close(eng_t *e) {
  if (e->cl) skv_cluster_leave(e->cl);
  if (e->kv) skv_kv_detach(e->kv);
  if (e->lay) skv_layout_destroy(e->lay);
  if (e->ns) skv_namespace_destroy(e->ns);
#ifdef SKV_WITH_CUDA
  if (e->dev) cudaFree(e->dev);
#endif
  free(e->mem);
}

/* Publish keys first..first+n (n <= BLOCKS) with version v, through the cluster. */
static int eng_publish(eng_t *e, uint32_t first, uint32_t n, uint32_t v) {
  skv_key_t keys[BLOCKS];
  uint64_t ids[BLOCKS];
  for (uint32_t i = 0; i < n; i++) {
    keys[i] = key_of(e->ns, first + i);
    ids[i] = i;
    for (uint64_t j = 0; j < e->pb; j++) e->mem[i * e->pb + j] = pat(first + i, v, j);
  }
#ifdef SKV_WITH_CUDA
  if (e->dev && cudaMemcpy(e->dev, e->mem, e->pb * n, cudaMemcpyHostToDevice) != cudaSuccess)
    return SKV_ECUDA;
#endif
  size_t ins = 0;
  int rc = skv_cluster_publish(e->cl, e->ns, keys, n, e->lay, ids, NULL, &ins);
  if (rc) return rc;
  return skv_cluster_flush(e->cl);
}

/* Bytes of blocks[0..n) that differ from keys first.. version v, among blocks not poisoned;
 * *poisoned counts the blocks that still hold the poison (0xEE everywhere). */
static uint64_t eng_wrong(const eng_t *e, uint32_t first, uint32_t n, uint32_t v, int *poisoned) {
  uint64_t wrong = 0;
  *poisoned = 0;
  for (uint32_t i = 0; i < n; i++) {
    const uint8_t *b = e->mem + i * e->pb;
    bool poison = true;
    for (uint64_t j = 0; j < e->pb && poison; j++) poison = b[j] == 0xEE;
    if (poison) {
      (*poisoned)++;
      continue;
    }
    for (uint64_t j = 0; j < e->pb; j++) wrong += b[j] != pat(first + i, v, j);
  }
  return wrong;
}

/* Bytes of blocks[0..n) (pages of pb bytes at mem) wrong: in [off, off + len) not those of
 * keys first.. version v, elsewhere not the poison 0xEE. */
static uint64_t layer_wrong(const uint8_t *mem, uint64_t pb, uint32_t first, uint32_t n, uint32_t v,
                            uint64_t off, uint64_t len) {
  uint64_t wrong = 0;
  for (uint32_t i = 0; i < n; i++)
    for (uint64_t j = 0; j < pb; j++) {
      const uint8_t b = mem[i * pb + j];
      wrong += (j >= off && j < off + len) ? b != pat(first + i, v, j) : b != 0xEE;
    }
  return wrong;
}

/* A node in a child process, driven through pipes: commands "P first n v" (publish), "E"
 * (evict everything; "C" answers how many pages went), "Q" (leave and exit). Each answers with its
 * return code. */
typedef struct child {
  pid_t pid;
  int cmd, rep;
} child_t;

typedef struct node_args {
  char domain[64], node[64], url[64];
  uint32_t layers;
  uint64_t pages;
  int lease_ms;
  bool gpu; /* pages and blocks in GPU memory (eng_open) */
} node_args_t;

static void child_main(const node_args_t *a, int cmd, int rep) {
  eng_t e;
  int rc =
      eng_open(&e, a->domain, a->layers, a->pages, a->node, a->url, a->lease_ms, 10000, a->gpu);
  if (write(rep, &rc, sizeof rc) != sizeof rc || rc) _exit(rc ? 1 : 2);
  char line[128];
  FILE *in = fdopen(cmd, "r");
  while (fgets(line, sizeof line, in)) {
    uint32_t first, n, v;
    if (line[0] == 'P' && sscanf(line + 1, "%u %u %u", &first, &n, &v) == 3) {
      rc = eng_publish(&e, first, n, v);
    } else if (line[0] == 'E') {
      uint64_t ev = 0;
      rc = skv_kv_evict(e.kv, UINT64_MAX, &ev);
      if (!rc) rc = skv_cluster_flush(e.cl);
    } else if (line[0] == 'C') { /* as E, answering how many pages went */
      uint64_t ev = 0;
      rc = skv_kv_evict(e.kv, UINT64_MAX, &ev);
      if (!rc) rc = skv_cluster_flush(e.cl);
      if (!rc) rc = (int)ev;
    } else if (line[0] == 'Q') {
      eng_close(&e);
      rc = 0;
      (void)!write(rep, &rc, sizeof rc);
      _exit(0);
    } else {
      rc = SKV_EINVAL;
    }
    if (write(rep, &rc, sizeof rc) != sizeof rc) _exit(3);
  }
  _exit(0); /* the test went away: leave without cleaning (as a crash would) */
}

/* Start a node; its join's return code (a node that failed to join has exited, reaped). */
static int child_try(child_t *c, const node_args_t *a) {
  int cp[2], rp[2];
  cr_assert(pipe(cp) == 0 && pipe(rp) == 0);
  fflush(stdout), fflush(stderr);
  c->pid = fork();
  if (c->pid == 0) { /* the node: no Criterion call from here on */
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    close(cp[1]), close(rp[0]);
    child_main(a, cp[0], rp[1]);
  }
  cr_assert(c->pid > 0, "fork: %s", strerror(errno));
  close(cp[0]), close(rp[1]);
  c->cmd = cp[1], c->rep = rp[0];
  int rc = -1;
  cr_assert_eq(read(c->rep, &rc, sizeof rc), (ssize_t)sizeof rc, "node %s did not start", a->node);
  if (rc) {
    waitpid(c->pid, NULL, 0);
    close(c->cmd), close(c->rep);
    c->pid = 0;
  }
  return rc;
}

static void child_start(child_t *c, const node_args_t *a) {
  int rc = child_try(c, a);
  cr_assert_eq(rc, 0, "node %s: join failed: %s", a->node, skv_err_name(rc));
}

static int child_do(child_t *c, const char *fmt, ...) {
  char line[128];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(line, sizeof line, fmt, ap);
  va_end(ap);
  strcat(line, "\n");
  if (write(c->cmd, line, strlen(line)) != (ssize_t)strlen(line)) return -EPIPE;
  int rc = -1;
  if (read(c->rep, &rc, sizeof rc) != sizeof rc) return -EPIPE;
  return rc;
}

static void child_stop(child_t *c) {
  if (c->pid <= 0) return;
  (void)child_do(c, "Q");
  int st;
  waitpid(c->pid, &st, 0);
  close(c->cmd), close(c->rep);
  c->pid = 0;
}

static void child_kill(child_t *c) {
  kill(c->pid, SIGKILL);
  waitpid(c->pid, NULL, 0);
  close(c->cmd), close(c->rep);
  c->pid = 0;
}

static node_args_t args_for(const char *what, const redis_t *r, uint32_t layers, uint64_t pages,
                            int lease_ms) {
  node_args_t a;
  memset(&a, 0, sizeof a);
  snprintf(a.domain, sizeof a.domain, "t%d-%s", (int)getpid(), what);
  snprintf(a.node, sizeof a.node, "%s", what);
  snprintf(a.url, sizeof a.url, "%s", r->url);
  a.layers = layers, a.pages = pages, a.lease_ms = lease_ms;
  return a;
}

static void lookup_all(eng_t *e, uint32_t first, uint32_t n, skv_cluster_ref_t *refs,
                       size_t *nlocal, size_t *nhit) {
  skv_key_t keys[BLOCKS];
  for (uint32_t i = 0; i < n; i++) keys[i] = key_of(e->ns, first + i);
  int rc = skv_cluster_lookup(e->cl, e->ns, keys, n, 0, refs, nlocal, nhit);
  cr_assert_eq(rc, 0, "lookup: %s: %s", skv_err_name(rc), skv_last_error());
}

/* ---- the tests --------------------------------------------------------------------------- */

Test(cluster, publish_on_two_nodes_fetch_on_a_third_byte_exact) {
  redis_t r;
  redis_start(&r, 0);
  node_args_t aa = args_for("a", &r, 4, 32, 2000), ab = args_for("b", &r, 4, 32, 2000);
  child_t a, b;
  child_start(&a, &aa);
  child_start(&b, &ab);
  cr_assert_eq(child_do(&a, "P 8 16 1"), 0);
  cr_assert_eq(child_do(&b, "P 24 24 1"), 0);
  eng_t c;
  char dom[64];
  snprintf(dom, sizeof dom, "t%d-c", (int)getpid());
  int rc = eng_open(&c, dom, 4, 32, "c", r.url, 2000, 10000, false);
  cr_assert_eq(rc, 0, "%s", skv_last_error());
  cr_assert_eq(eng_publish(&c, 0, 8, 1), 0, "%s", skv_last_error());
  skv_cluster_ref_t refs[BLOCKS];
  size_t nl, nh;
  lookup_all(&c, 0, 56, refs, &nl, &nh);
  cr_assert_eq(nl, 8, "local hits %zu", nl);
  cr_assert_eq(nh, 48, "hits %zu (keys 48.. were published by no one)", nh);
  cr_assert_str_eq(skv_cluster_node_name(c.cl, refs[8].node), "a");
  cr_assert_str_eq(skv_cluster_node_name(c.cl, refs[30].node), "b");
  uint64_t ids[BLOCKS];
  for (int i = 0; i < BLOCKS; i++) ids[i] = (uint64_t)i;
  memset(c.mem, 0xEE, c.pb * BLOCKS);
  rc = skv_cluster_fetch(c.cl, refs, nh, c.lay, ids, 0, NULL);
  cr_assert_eq(rc, 0, "fetch: %s: %s", skv_err_name(rc), skv_last_error());
  int poisoned;
  cr_assert_eq(eng_wrong(&c, 0, 48, 1, &poisoned), 0, "wrong bytes");
  cr_assert_eq(poisoned, 0, "%d blocks not written", poisoned);
  skv_cluster_stats_t st = SKV_CLUSTER_STATS_INIT;
  cr_assert_eq(skv_cluster_get_stats(c.cl, &st), 0);
  cr_assert_eq(st.remote_pages, 40);
  cr_assert_eq(st.remote_bytes, 40 * c.pb);
  cr_assert_eq(st.local_hits, 8);
  cr_assert_eq(st.exported_pages, 8);
  /* the directory holds each node's entries and records */
  char pat_s[64];
  snprintf(pat_s, sizeof pat_s, "t%d:k:*", (int)getpid());
  cr_assert_eq(redis_count(&r, pat_s), 48);
  eng_close(&c);
  child_stop(&a);
  child_stop(&b);
  /* leaving takes a node's entries and record out */
  cr_assert_eq(redis_count(&r, pat_s), 0, "entries left after every node left");
  snprintf(pat_s, sizeof pat_s, "t%d:node:*", (int)getpid());
  cr_assert_eq(redis_count(&r, pat_s), 0);
  redis_stop(&r);
}

Test(cluster, evicted_page_is_stale_never_served) {
  redis_t r;
  redis_start(&r, 0);
  node_args_t aa = args_for("a", &r, 4, 8, 5000);
  child_t a;
  child_start(&a, &aa);
  cr_assert_eq(child_do(&a, "P 0 8 1"), 0);
  eng_t c;
  char dom[64];
  snprintf(dom, sizeof dom, "t%d-c", (int)getpid());
  cr_assert_eq(eng_open(&c, dom, 4, 8, "c", r.url, 5000, 10000, false), 0, "%s", skv_last_error());
  skv_cluster_ref_t refs[BLOCKS];
  size_t nl, nh;
  lookup_all(&c, 0, 8, refs, &nl, &nh);
  cr_assert_eq(nh, 8);
  /* a's 8 pages go to 8 other keys (version 2): every reference c holds is now stale */
  cr_assert_eq(child_do(&a, "P 100 8 2"), 0);
  uint64_t ids[BLOCKS];
  for (int i = 0; i < BLOCKS; i++) ids[i] = (uint64_t)i;
  memset(c.mem, 0xEE, c.pb * BLOCKS);
  int rc = skv_cluster_fetch(c.cl, refs, 8, c.lay, ids, 0, NULL);
  cr_assert_eq(rc, SKV_ESTALE, "fetch of evicted pages: %s", skv_err_name(rc));
  cr_assert(strstr(skv_last_error(), "node 'a'"), "%s", skv_last_error());
  int poisoned;
  cr_assert_eq(eng_wrong(&c, 0, 8, 1, &poisoned), 0);
  cr_assert_eq(poisoned, 8, "a stale page was copied into its block");
  /* the evictions reached the directory: the old keys miss, the new ones hit */
  lookup_all(&c, 0, 8, refs, &nl, &nh);
  cr_assert_eq(nh, 0, "an evicted key still in the directory");
  lookup_all(&c, 100, 8, refs, &nl, &nh);
  cr_assert_eq(nh, 8);
  /* a layout of another geometry (same page size, other heads) is refused, nothing written */
  {
    skv_geometry_t g2 = c.g;
    g2.num_kv_heads = 4, g2.head_dim = 16;
    skv_layout_t *other = NULL;
    void *base[1] = {c.mem};
    cr_assert_eq(skv_layout_create_preset(&g2, SKV_LAYOUT_CONTIGUOUS, 16, BLOCKS, base, -1, &other),
                 0, "%s", skv_last_error());
    memset(c.mem, 0xEE, c.pb * BLOCKS);
    rc = skv_cluster_fetch(c.cl, refs, 8, other, ids, 0, NULL);
    cr_assert_eq(rc, SKV_EINVAL, "a layout of another geometry: %s", skv_err_name(rc));
    cr_assert(strstr(skv_last_error(), "another geometry"), "%s", skv_last_error());
    skv_layout_destroy(other);
    cr_assert_eq(eng_wrong(&c, 100, 8, 2, &poisoned), 0);
    cr_assert_eq(poisoned, 8, "a refused fetch wrote blocks");
  }
  /* remote pages into a layout of layer 1 of 4: that layer's bytes only are read and written */
  skv_layout_t *part = NULL;
  cr_assert_eq(skv_layout_create_layers(c.lay, 1, 1, &part), 0, "%s", skv_last_error());
  rc = skv_cluster_fetch(c.cl, refs, 8, part, ids, 0, NULL);
  cr_assert_eq(rc, 0, "remote fetch into layers [1, 2): %s: %s", skv_err_name(rc),
               skv_last_error());
  skv_layout_destroy(part);
  cr_assert_eq(layer_wrong(c.mem, c.pb, 100, 8, 2, c.pb / 4, c.pb / 4), 0,
               "layer 1 wrong, or bytes of other layers written");
  skv_cluster_stats_t st0 = SKV_CLUSTER_STATS_INIT;
  skv_cluster_get_stats(c.cl, &st0);
  cr_assert_eq(st0.remote_bytes, 8 * c.pb / 4, "only layer 1's bytes travel");
  memset(c.mem, 0xEE, c.pb * BLOCKS);
  cr_assert_eq(skv_cluster_fetch(c.cl, refs, 8, c.lay, ids, 0, NULL), 0, "%s", skv_last_error());
  cr_assert_eq(eng_wrong(&c, 100, 8, 2, &poisoned), 0);
  cr_assert_eq(poisoned, 0);
  skv_cluster_stats_t st = SKV_CLUSTER_STATS_INIT;
  skv_cluster_get_stats(c.cl, &st);
  cr_assert_eq(st.remote_stale, 1);
  eng_close(&c);
  child_stop(&a);
  redis_stop(&r);
}

/* Remote pins: pages that a lookup pinned on their node survive its evictions until the fetch
 * releases them; pins nobody touches for a lease lapse (the owner evicts, the reader gets
 * SKV_ESTALE and no wrong byte), and their late unpin is harmless. */
Test(cluster, remote_pins_hold_evictions_until_released_or_lapsed) {
  redis_t r;
  redis_start(&r, 0);
  setenv("SKV_PIN_LEASE_MS", "1000", 1); /* the owner's pin lease (read at attach) */
  node_args_t aa = args_for("a", &r, 4, 8, 5000);
  child_t a;
  child_start(&a, &aa);
  unsetenv("SKV_PIN_LEASE_MS");
  cr_assert_eq(child_do(&a, "P 0 8 1"), 0);
  eng_t c;
  char dom[64];
  snprintf(dom, sizeof dom, "t%d-c", (int)getpid());
  cr_assert_eq(eng_open(&c, dom, 4, 8, "c", r.url, 5000, 10000, false), 0, "%s", skv_last_error());
  skv_key_t keys[BLOCKS];
  for (uint32_t i = 0; i < 8; i++) keys[i] = key_of(c.ns, i);
  skv_cluster_ref_t refs[BLOCKS];
  size_t nl = 0, nh = 0;
  /* pin the first 5 only: a's evictions take the other 3 */
  cr_assert_eq(skv_cluster_lookup(c.cl, c.ns, keys, 5, SKV_LOOKUP_PIN, refs, &nl, &nh), 0, "%s",
               skv_last_error());
  cr_assert_eq(nh, 5, "%zu of 5 remote pages pinned (%s)", nh, skv_last_error());
  skv_cluster_stats_t st = SKV_CLUSTER_STATS_INIT;
  skv_cluster_get_stats(c.cl, &st);
  cr_assert_eq(st.remote_pins, 5);
  cr_assert_eq(child_do(&a, "C"), 3, "a evicted other than its 3 unpinned pages");
  uint64_t ids[BLOCKS];
  for (int i = 0; i < BLOCKS; i++) ids[i] = (uint64_t)i;
  memset(c.mem, 0xEE, c.pb * BLOCKS);
  int rc = skv_cluster_fetch(c.cl, refs, 5, c.lay, ids, SKV_FETCH_UNPIN, NULL);
  cr_assert_eq(rc, 0, "fetch of pinned pages after evictions: %s: %s", skv_err_name(rc),
               skv_last_error());
  int poisoned;
  cr_assert_eq(eng_wrong(&c, 0, 5, 1, &poisoned), 0);
  cr_assert_eq(poisoned, 0);
  cr_assert_eq(child_do(&a, "C"), 5, "the released pins still held pages");
  /* pinned, then left alone longer than the lease: the pins lapse */
  cr_assert_eq(child_do(&a, "P 20 4 3"), 0);
  for (uint32_t i = 0; i < 4; i++) keys[i] = key_of(c.ns, 20 + i);
  cr_assert_eq(skv_cluster_lookup(c.cl, c.ns, keys, 4, SKV_LOOKUP_PIN, refs, &nl, &nh), 0, "%s",
               skv_last_error());
  cr_assert_eq(nh, 4);
  cr_assert_eq(child_do(&a, "C"), 0, "pinned pages evicted within the lease");
  usleep(1300 * 1000);
  cr_assert_eq(child_do(&a, "C"), 4, "pins untouched for longer than the lease did not lapse");
  memset(c.mem, 0xEE, c.pb * BLOCKS);
  rc = skv_cluster_fetch(c.cl, refs, 4, c.lay, ids, 0, NULL);
  cr_assert_eq(rc, SKV_ESTALE, "fetch of pages whose pins lapsed: %s", skv_err_name(rc));
  cr_assert_eq(eng_wrong(&c, 20, 4, 3, &poisoned), 0);
  cr_assert_eq(poisoned, 4);
  /* the late unpin is harmless: new pins on the reused pages still hold */
  cr_assert_eq(skv_cluster_unpin(c.cl, refs, 4), 0, "%s", skv_last_error());
  cr_assert_eq(child_do(&a, "P 40 8 4"), 0);
  for (uint32_t i = 0; i < 8; i++) keys[i] = key_of(c.ns, 40 + i);
  cr_assert_eq(skv_cluster_lookup(c.cl, c.ns, keys, 8, SKV_LOOKUP_PIN, refs, &nl, &nh), 0, "%s",
               skv_last_error());
  cr_assert_eq(nh, 8);
  cr_assert_eq(child_do(&a, "C"), 0, "pages pinned again were evicted");
  cr_assert_eq(skv_cluster_unpin(c.cl, refs, 8), 0, "%s", skv_last_error());
  /* unbalanced unpins are refused before anything is sent (they would take another node's
   * pins away): a second unpin, and a fetch with SKV_FETCH_UNPIN of references looked up
   * without SKV_LOOKUP_PIN, which reads nothing either */
  rc = skv_cluster_unpin(c.cl, refs, 8);
  cr_assert_eq(rc, SKV_EINVAL, "a second unpin: %s", skv_err_name(rc));
  cr_assert(strstr(skv_last_error(), "not pinned by this handle"), "%s", skv_last_error());
  cr_assert_eq(skv_cluster_lookup(c.cl, c.ns, keys, 8, 0, refs, &nl, &nh), 0);
  cr_assert_eq(nh, 8);
  memset(c.mem, 0xEE, c.pb * BLOCKS);
  rc = skv_cluster_fetch(c.cl, refs, 8, c.lay, ids, SKV_FETCH_UNPIN, NULL);
  cr_assert_eq(rc, SKV_EINVAL, "fetch(UNPIN) of unpinned references: %s", skv_err_name(rc));
  cr_assert_eq(eng_wrong(&c, 40, 8, 4, &poisoned), 0);
  cr_assert_eq(poisoned, 8, "a refused fetch wrote blocks");
  /* one node's pins and another's are counted apart: c's refused unpin took none of them */
  cr_assert_eq(skv_cluster_lookup(c.cl, c.ns, keys, 8, SKV_LOOKUP_PIN, refs, &nl, &nh), 0);
  cr_assert_eq(child_do(&a, "C"), 0, "pinned pages were evicted after refused unpins");
  cr_assert_eq(skv_cluster_fetch(c.cl, refs, 8, c.lay, ids, SKV_FETCH_UNPIN, NULL), 0, "%s",
               skv_last_error());
  cr_assert_eq(eng_wrong(&c, 40, 8, 4, &poisoned), 0);
  cr_assert_eq(poisoned, 0);
  cr_assert_eq(child_do(&a, "C"), 8);
  eng_close(&c);
  child_stop(&a);
  redis_stop(&r);
}

#ifdef SKV_WITH_CUDA
/* Node g of the GPU tests: a cache of 8 pages in GPU memory (a CUDA domain of its own), in the
 * geometry of the child nodes (4 layers); *g and *pb are its geometry and page size. */
static skv_kv_t *gpu_cache(skv_geometry_t *g, uint64_t *pb) {
  *g = (skv_geometry_t)SKV_GEOMETRY_INIT;
  g->num_layers = 4, g->num_kv_heads = 2, g->head_dim = 32, g->elem_bytes = 2;
  g->page_tokens = 16;
  cr_assert_eq(skv_geometry_get_page_bytes(g, pb), 0);
  char dom[64];
  snprintf(dom, sizeof dom, "t%d-g", (int)getpid());
  skv_attach_opts_t ao = SKV_ATTACH_OPTS_INIT;
  ao.pages_per_pe = 8;
  ao.max_slots = 2;
  ao.backend = SKV_BACKEND_CUDA;
  ao.timeout_ms = 10000;
  skv_kv_t *kv = NULL;
  cr_assert_eq(skv_kv_attach(dom, g, &ao, &kv), 0, "%s", skv_last_error());
  return kv;
}
#endif

#ifdef SKV_WITH_CUDA
/* The two nodes of the stream-ordered tests: a, in a child, with host pages of keys 0..7
 * (version 1), and g, this process, a cache in GPU memory joined to read only
 * (SKV_CLUSTER_NO_EXPORT), with a Redis of its own. */
typedef struct gpu_pair {
  redis_t r;
  child_t a;
  skv_geometry_t g;
  uint64_t pb;
  skv_kv_t *kv;
  skv_cluster_t *cl;
  uint8_t *dev, *back; /* g's blocks (nblocks), and pinned host memory to copy them back to */
  cudaStream_t s;      /* a non-blocking stream */
  skv_layout_t *lay;   /* the blocks, SKV_LAYOUT_CONTIGUOUS */
  skv_namespace_t *ns;
  skv_key_t keys[8];
} gpu_pair_t;

static void gpu_pair_open(gpu_pair_t *t, uint64_t nblocks) {
  redis_start(&t->r, 0);
  node_args_t aa = args_for("a", &t->r, 4, 8, 5000);
  child_start(&t->a, &aa); /* before this process touches CUDA */
  cr_assert_eq(child_do(&t->a, "P 0 8 1"), 0);
  t->kv = gpu_cache(&t->g, &t->pb);
  skv_cluster_opts_t co = SKV_CLUSTER_OPTS_INIT;
  co.redis_url = t->r.url, co.node = "g", co.cluster = g_cluster, co.timeout_ms = 10000;
  co.flags = SKV_CLUSTER_NO_EXPORT;
  t->cl = NULL;
  cr_assert_eq(skv_cluster_join(t->kv, &co, &t->cl), 0, "%s", skv_last_error());
  const uint64_t bytes = t->pb * nblocks;
  cr_assert_eq(cudaMalloc((void **)&t->dev, bytes), cudaSuccess);
  cr_assert_eq(cudaHostAlloc((void **)&t->back, bytes, cudaHostAllocDefault), cudaSuccess);
  cr_assert_eq(cudaStreamCreateWithFlags(&t->s, cudaStreamNonBlocking), cudaSuccess);
  void *base[1] = {t->dev};
  cr_assert_eq(
      skv_layout_create_preset(&t->g, SKV_LAYOUT_CONTIGUOUS, 16, nblocks, base, 0, &t->lay), 0,
      "%s", skv_last_error());
  cr_assert_eq(skv_namespace_create("m", &t->g, NULL, 0, "secret", 6, &t->ns), 0);
  for (uint32_t i = 0; i < 8; i++) t->keys[i] = key_of(t->ns, i);
}

static void gpu_pair_close(gpu_pair_t *t) {
  skv_cluster_leave(t->cl);
  skv_layout_destroy(t->lay);
  skv_namespace_destroy(t->ns);
  cudaStreamDestroy(t->s);
  cudaFree(t->dev);
  cudaFreeHost(t->back);
  skv_kv_detach(t->kv);
  child_stop(&t->a);
  redis_stop(&t->r);
}
#endif

/* Remote pages into a GPU layout: node c keeps its pages in GPU memory (a CUDA domain, which it
 * cannot export: join says so and names SKV_CLUSTER_NO_EXPORT) and reads a's host pages into
 * engine blocks in GPU memory, all layers and layer 1 alone, every byte checked against the
 * host pattern, the rest of the poisoned blocks untouched. */
Test(cluster, remote_pages_into_a_gpu_layout_byte_exact) {
#ifndef SKV_WITH_CUDA
  cr_skip_test("symkv built without CUDA");
#else
  SKV_TEST_REQUIRE_GPUS(1);
  redis_t r;
  redis_start(&r, 0);
  node_args_t aa = args_for("a", &r, 4, 8, 5000);
  child_t a;
  child_start(&a, &aa); /* before this process touches CUDA */
  cr_assert_eq(child_do(&a, "P 0 8 1"), 0);
  skv_geometry_t g;
  uint64_t pb = 0;
  skv_kv_t *kv = gpu_cache(&g, &pb);
  skv_cluster_opts_t co = SKV_CLUSTER_OPTS_INIT;
  co.redis_url = r.url, co.node = "g", co.cluster = g_cluster, co.timeout_ms = 10000;
  skv_cluster_t *cl = NULL;
  int rc = skv_cluster_join(kv, &co, &cl);
  cr_assert_eq(rc, SKV_ENOTSUP, "GPU pages exported: %s", skv_err_name(rc));
  cr_assert(strstr(skv_last_error(), "SKV_CLUSTER_NO_EXPORT"), "%s", skv_last_error());
  co.flags = SKV_CLUSTER_NO_EXPORT;
  cr_assert_eq(skv_cluster_join(kv, &co, &cl), 0, "%s", skv_last_error());
  uint8_t *dev = NULL, *host = malloc(pb * BLOCKS);
  cr_assert(host);
  cr_assert_eq(cudaMalloc((void **)&dev, pb * BLOCKS), cudaSuccess);
  void *base[1] = {dev};
  skv_layout_t *lay = NULL, *part = NULL;
  cr_assert_eq(skv_layout_create_preset(&g, SKV_LAYOUT_CONTIGUOUS, 16, BLOCKS, base, 0, &lay), 0,
               "%s", skv_last_error());
  cr_assert_eq(skv_layout_create_layers(lay, 1, 1, &part), 0, "%s", skv_last_error());
  skv_namespace_t *ns = NULL;
  cr_assert_eq(skv_namespace_create("m", &g, NULL, 0, "secret", 6, &ns), 0);
  skv_key_t keys[BLOCKS];
  for (uint32_t i = 0; i < 8; i++) keys[i] = key_of(ns, i);
  skv_cluster_ref_t refs[BLOCKS];
  size_t nl = 0, nh = 0;
  cr_assert_eq(skv_cluster_lookup(cl, ns, keys, 8, SKV_LOOKUP_PIN, refs, &nl, &nh), 0, "%s",
               skv_last_error());
  cr_assert_eq(nh, 8);
  cr_assert_eq(nl, 0);
  /* blocks in reverse order, so that a copy ignoring block ids is caught */
  uint64_t ids[BLOCKS];
  for (int i = 0; i < 8; i++) ids[i] = (uint64_t)(7 - i);
  const skv_layout_t *lays[2] = {part, lay};
  const uint64_t offs[2] = {pb / 4, 0}, lens[2] = {pb / 4, pb};
  for (int t = 0; t < 2; t++) {
    cr_assert_eq(cudaMemset(dev, 0xEE, pb * BLOCKS), cudaSuccess);
    cr_assert_eq(cudaDeviceSynchronize(), cudaSuccess);
    rc = skv_cluster_fetch(cl, refs, 8, lays[t], ids, t == 1 ? SKV_FETCH_UNPIN : 0, NULL);
    cr_assert_eq(rc, 0, "remote fetch into the GPU (%s): %s: %s", t ? "every layer" : "layer 1",
                 skv_err_name(rc), skv_last_error());
    cr_assert_eq(cudaMemcpy(host, dev, pb * BLOCKS, cudaMemcpyDeviceToHost), cudaSuccess);
    uint8_t *ordered = malloc(pb * 8);
    cr_assert(ordered);
    for (int i = 0; i < 8; i++) memcpy(ordered + i * pb, host + ids[i] * pb, pb);
    cr_assert_eq(layer_wrong(ordered, pb, 0, 8, 1, offs[t], lens[t]), 0,
                 "wrong bytes in the GPU blocks (%s)", t ? "every layer" : "layer 1");
    free(ordered);
  }
  /* the pins went with the second fetch: a evicts all 8 */
  cr_assert_eq(child_do(&a, "C"), 8);
  skv_cluster_stats_t st = SKV_CLUSTER_STATS_INIT;
  skv_cluster_get_stats(cl, &st);
  cr_assert_eq(st.remote_pages, 16);
  cr_assert_eq(st.remote_bytes, 8 * pb + 8 * pb / 4);
  /* chosen from UCX's transports: over TCP through pinned host memory */
  cr_assert_eq(st.remote_direct_pages, 0, "%" PRIu64 " pages read into GPU memory over %s",
               st.remote_direct_pages, getenv("UCX_TLS"));
  skv_cluster_leave(cl);
  skv_layout_destroy(part);
  skv_layout_destroy(lay);
  skv_namespace_destroy(ns);
  cudaFree(dev);
  free(host);
  skv_kv_detach(kv);
  child_stop(&a);
  redis_stop(&r);
#endif
}

#ifdef SKV_WITH_CUDA
static volatile int g_hold; /* a stream held by hold_stream goes on once this is 0 */
static void CUDART_CB hold_stream(void *arg) {
  (void)arg;
  const uint64_t end = skv__now_ms() + 20000; /* bounded: a failing test does not hang */
  while (__atomic_load_n(&g_hold, __ATOMIC_ACQUIRE) && skv__now_ms() < end) skv_test_sleep_ms(1);
}
#endif

/* A remote fetch into a GPU layout is stream-ordered: with the caller's stream held by a host
 * function, followed by a poisoning memset, the call returns at once; what the stream holds
 * after it (a copy back to the host) waits for the remote pages, whose copy came after the
 * memset: every byte right. Then a's pages are evicted: the fetch is queued all the same, the
 * stream is not held for good, the blocks get 0xFF bytes (NaN) and skv_cluster_sync says
 * SKV_ESTALE, once. */
Test(cluster, remote_fetch_into_a_gpu_layout_is_stream_ordered) {
#ifndef SKV_WITH_CUDA
  cr_skip_test("symkv built without CUDA");
#else
  SKV_TEST_REQUIRE_GPUS(1);
  gpu_pair_t t;
  gpu_pair_open(&t, BLOCKS);
  const uint64_t pb = t.pb;
  skv_cluster_t *cl = t.cl;
  uint8_t *dev = t.dev, *back = t.back;
  cudaStream_t s = t.s;
  const skv_layout_t *lay = t.lay;
  skv_namespace_t *ns = t.ns;
  const skv_key_t *keys = t.keys;
  skv_cluster_ref_t refs[BLOCKS];
  size_t nl = 0, nh = 0;
  cr_assert_eq(skv_cluster_lookup(cl, ns, keys, 8, SKV_LOOKUP_PIN, refs, &nl, &nh), 0, "%s",
               skv_last_error());
  cr_assert_eq(nh, 8);
  uint64_t ids[BLOCKS]; /* reversed, so that a copy ignoring block ids is caught */
  for (int i = 0; i < 8; i++) ids[i] = (uint64_t)(7 - i);
  for (int round = 0; round < 2; round++) {
    /* round 1: a evicted every page (the pins went with round 0's fetch) */
    if (round == 1) cr_assert_eq(child_do(&t.a, "C"), 8);
    cr_assert_eq(cudaMemset(dev, 0x11, pb * BLOCKS), cudaSuccess);
    cr_assert_eq(cudaDeviceSynchronize(), cudaSuccess);
    memset(back, 0x55, pb * BLOCKS);
    __atomic_store_n(&g_hold, 1, __ATOMIC_RELEASE);
    cr_assert_eq(cudaLaunchHostFunc(s, hold_stream, NULL), cudaSuccess);
    cr_assert_eq(cudaMemsetAsync(dev, 0xEE, pb * BLOCKS, s), cudaSuccess);
    const uint64_t t0 = skv__now_ms();
    int rc = skv_cluster_fetch(cl, refs, 8, lay, ids, round == 0 ? SKV_FETCH_UNPIN : 0, s);
    const uint64_t took = skv__now_ms() - t0;
    cr_assert_eq(rc, 0, "fetch queued (round %d): %s: %s", round, skv_err_name(rc),
                 skv_last_error());
    cr_assert(took < 5000, "the call waited %" PRIu64 " ms for a held stream", took);
    cr_assert_eq(cudaMemcpyAsync(back, dev, pb * BLOCKS, cudaMemcpyDeviceToHost, s), cudaSuccess);
    skv_test_sleep_ms(200);
    cr_assert_eq(back[0], 0x55, "work after the fetch ran while the stream was held");
    __atomic_store_n(&g_hold, 0, __ATOMIC_RELEASE);
    cr_assert_eq(cudaStreamSynchronize(s), cudaSuccess);
    uint8_t *ordered = malloc(pb * 8);
    cr_assert(ordered);
    for (int i = 0; i < 8; i++) memcpy(ordered + i * pb, back + ids[i] * pb, pb);
    rc = skv_cluster_sync(cl);
    if (round == 0) {
      cr_assert_eq(rc, 0, "sync: %s: %s", skv_err_name(rc), skv_last_error());
      cr_assert_eq(layer_wrong(ordered, pb, 0, 8, 1, 0, pb), 0,
                   "wrong bytes in the GPU blocks (the copy before the memset?)");
    } else {
      cr_assert_eq(rc, SKV_ESTALE, "sync after a fetch of evicted pages: %s", skv_err_name(rc));
      cr_assert(strstr(skv_last_error(), "node 'a'"), "%s", skv_last_error());
      for (uint64_t x = 0; x < pb * 8; x++)
        cr_assert_eq(ordered[x], 0xFF, "an evicted page's block, byte %" PRIu64, x);
      cr_assert_eq(skv_cluster_sync(cl), 0, "a failure is returned once");
    }
    free(ordered);
  }
  skv_cluster_stats_t st = SKV_CLUSTER_STATS_INIT;
  skv_cluster_get_stats(cl, &st);
  cr_assert_eq(st.remote_pages, 8);
  cr_assert_eq(st.remote_stale, 1);
  gpu_pair_close(&t);
#endif
}

#ifdef SKV_WITH_CUDA
typedef struct cont_later {
  pid_t pid;
  int ms;
} cont_later_t;
static void *cont_later_main(void *arg) {
  const cont_later_t *c = arg;
  skv_test_sleep_ms(c->ms);
  kill(c->pid, SIGCONT);
  return NULL;
}
#endif

/* Stream-ordered fetches in numbers and mixed with synchronous ones, on one stream:
 *  - 24 fetches queued back to back (more than the cache's 8 argument slots, which only the
 *    earlier gates give back), then one sync: every byte right;
 *  - node a stopped (SIGSTOP) while keys 4..7 are fetched into blocks that the ring's run held
 *    keys 0..3 for: a gate opened before the read would copy those; a's CONT comes 300 ms
 *    later, from another thread;
 *  - right behind it on the same stream, a fetch of 4,200 pages (more than the 64 MiB ring:
 *    synchronous), whose copies would wait behind the queued fetch's gate: it must not wait
 *    for the timeout (10 s) but end once a answers. */
Test(cluster, stream_ordered_fetches_in_numbers_and_behind_a_stopped_node) {
#ifndef SKV_WITH_CUDA
  cr_skip_test("symkv built without CUDA");
#else
  SKV_TEST_REQUIRE_GPUS(1);
  gpu_pair_t t;
  const uint64_t nbig = 4200; /* x 16 KiB: more than the ring */
  gpu_pair_open(&t, nbig);
  const uint64_t pb = t.pb;
  skv_cluster_t *cl = t.cl;
  uint8_t *dev = t.dev, *back = t.back;
  cudaStream_t s = t.s;
  const skv_layout_t *lay = t.lay;
  const skv_key_t *keys = t.keys;
  skv_cluster_ref_t refs[8];
  size_t nl = 0, nh = 0;
  cr_assert_eq(skv_cluster_lookup(cl, t.ns, keys, 8, 0, refs, &nl, &nh), 0, "%s", skv_last_error());
  cr_assert_eq(nh, 8);
  uint64_t *ids = malloc(nbig * sizeof *ids);
  skv_cluster_ref_t *many = malloc(nbig * sizeof *many);
  uint8_t *ordered = malloc(pb * 8);
  cr_assert(ids && many && ordered);
  /* 24 fetches back to back: block 8f + i gets key i */
  cr_assert_eq(cudaMemset(dev, 0xEE, pb * 8 * 24), cudaSuccess);
  cr_assert_eq(cudaDeviceSynchronize(), cudaSuccess);
  for (uint64_t f = 0; f < 24; f++) {
    for (uint64_t i = 0; i < 8; i++) ids[i] = 8 * f + i;
    int rc = skv_cluster_fetch(cl, refs, 8, lay, ids, 0, s);
    cr_assert_eq(rc, 0, "fetch %" PRIu64 ": %s: %s", f, skv_err_name(rc), skv_last_error());
  }
  cr_assert_eq(cudaMemcpyAsync(back, dev, pb * 8 * 24, cudaMemcpyDeviceToHost, s), cudaSuccess);
  cr_assert_eq(cudaStreamSynchronize(s), cudaSuccess);
  cr_assert_eq(skv_cluster_sync(cl), 0, "%s", skv_last_error());
  for (uint64_t f = 0; f < 24; f++)
    cr_assert_eq(layer_wrong(back + f * 8 * pb, pb, 0, 8, 1, 0, pb), 0, "fetch %" PRIu64, f);
  /* keys 4..7 while a is stopped, then the big synchronous fetch behind them */
  cr_assert_eq(cudaMemset(dev, 0xEE, pb * nbig), cudaSuccess);
  cr_assert_eq(cudaDeviceSynchronize(), cudaSuccess);
  for (uint64_t i = 0; i < 4; i++) ids[i] = i;
  cr_assert_eq(kill(t.a.pid, SIGSTOP), 0);
  cont_later_t cont = {t.a.pid, 300};
  pthread_t ct;
  cr_assert_eq(pthread_create(&ct, NULL, cont_later_main, &cont), 0);
  int rc = skv_cluster_fetch(cl, refs + 4, 4, lay, ids, 0, s);
  cr_assert_eq(rc, 0, "fetch of keys 4..7: %s: %s", skv_err_name(rc), skv_last_error());
  for (uint64_t i = 0; i < nbig - 8; i++) many[i] = refs[i % 8], ids[i] = 8 + i;
  const uint64_t t0 = skv__now_ms();
  rc = skv_cluster_fetch(cl, many, nbig - 8, lay, ids, 0, s);
  const uint64_t took = skv__now_ms() - t0;
  pthread_join(ct, NULL);
  cr_assert_eq(rc, 0, "the synchronous fetch behind a queued one: %s: %s (%" PRIu64 " ms)",
               skv_err_name(rc), skv_last_error(), took);
  cr_assert(took < 8000, "the synchronous fetch took %" PRIu64 " ms", took);
  cr_assert_eq(cudaMemcpyAsync(back, dev, pb * nbig, cudaMemcpyDeviceToHost, s), cudaSuccess);
  cr_assert_eq(cudaStreamSynchronize(s), cudaSuccess);
  cr_assert_eq(skv_cluster_sync(cl), 0, "%s", skv_last_error());
  cr_assert_eq(layer_wrong(back, pb, 4, 4, 1, 0, pb), 0, "keys 4..7 (read while a was stopped)");
  for (uint64_t i = 0; i < nbig - 8; i += 97) /* a sample of the big fetch's blocks */
    cr_assert_eq(layer_wrong(back + (8 + i) * pb, pb, (uint32_t)(i % 8), 1, 1, 0, pb), 0,
                 "block %" PRIu64, 8 + i);
  free(ids), free(many), free(ordered);
  gpu_pair_close(&t);
#endif
}

#ifdef SKV_WITH_CUDA
/* Wrong bytes of blocks ids[0..n) of the GPU blocks `dev` (pages of pb bytes) against keys 0..
 * version 1 in [off, off + len), the poison elsewhere (copied back into `host`). */
static uint64_t gpu_blocks_wrong(const uint8_t *dev, uint8_t *host, uint64_t pb,
                                 const uint64_t *ids, uint32_t n, uint64_t off, uint64_t len) {
  if (cudaMemcpy(host, dev, pb * BLOCKS, cudaMemcpyDeviceToHost) != cudaSuccess) return UINT64_MAX;
  uint8_t *ordered = malloc(pb * n);
  if (!ordered) return UINT64_MAX;
  for (uint32_t i = 0; i < n; i++) memcpy(ordered + i * pb, host + ids[i] * pb, pb);
  uint64_t w = layer_wrong(ordered, pb, 0, n, 1, off, len);
  free(ordered);
  return w;
}
#endif

/* Pages in GPU memory exported through UCX's CUDA support (a UCX built with CUDA, cuda_copy in
 * UCX_TLS): node a keeps its pages and blocks in GPU memory; node g reads them into GPU blocks,
 * by UCX straight into GPU memory (SKV_CLUSTER_GPU_DIRECT) and through pinned host memory, and
 * into host blocks; every layer and layer 1 alone, every byte checked, the rest poisoned. Then a
 * evicts them: the fetch is SKV_ESTALE and the blocks stay poisoned. With a UCX that reads no
 * GPU memory (Debian's), the joins are refused by name, and then the test skips. */
Test(cluster, gpu_pages_exported_read_into_gpu_and_host_byte_exact) {
#ifndef SKV_WITH_CUDA
  cr_skip_test("symkv built without CUDA");
#else
  SKV_TEST_REQUIRE_GPUS(1);
  char tls[128]; /* the caller's transports and cuda_copy (not to an exclusion list, ^...) */
  snprintf(tls, sizeof tls, "%s,cuda_copy", getenv("UCX_TLS"));
  if (!strstr(getenv("UCX_TLS"), "cuda") && getenv("UCX_TLS")[0] != '^') setenv("UCX_TLS", tls, 1);
  redis_t r;
  redis_start(&r, 0);
  node_args_t aa = args_for("a", &r, 4, 8, 5000);
  aa.gpu = true;
  child_t a;
  const int arc = child_try(&a, &aa); /* before this process touches CUDA */
  skv_geometry_t g;
  uint64_t pb = 0;
  skv_kv_t *kv = gpu_cache(&g, &pb);
  skv_cluster_opts_t co = SKV_CLUSTER_OPTS_INIT;
  co.redis_url = r.url, co.node = "g", co.cluster = g_cluster, co.timeout_ms = 10000;
  skv_cluster_t *cl = NULL;
  if (arc == SKV_ENOTSUP) { /* this UCX reads no GPU memory: both joins say so, by name */
    int rc = skv_cluster_join(kv, &co, &cl);
    cr_assert_eq(rc, SKV_ENOTSUP, "GPU pages exported by a UCX without CUDA: %s", skv_err_name(rc));
    cr_assert(strstr(skv_last_error(), "SKV_CLUSTER_NO_EXPORT") &&
                  strstr(skv_last_error(), "libucx-cu12"),
              "%s", skv_last_error());
    co.flags = SKV_CLUSTER_NO_EXPORT | SKV_CLUSTER_GPU_DIRECT;
    rc = skv_cluster_join(kv, &co, &cl);
    cr_assert_eq(rc, SKV_ENOTSUP, "GPU direct with a UCX without CUDA: %s", skv_err_name(rc));
    cr_assert(strstr(skv_last_error(), "SKV_CLUSTER_GPU_DIRECT"), "%s", skv_last_error());
    skv_kv_detach(kv);
    redis_stop(&r);
    cr_skip_test("this UCX reads no GPU memory with UCX_TLS=%s (refused by name, checked): GPU "
                 "pages are exported with a UCX built with CUDA (the libucx-cu12 wheel)",
                 getenv("UCX_TLS"));
  }
  cr_assert_eq(arc, 0, "node a (GPU pages): join failed: %s", skv_err_name(arc));
  cr_assert_eq(child_do(&a, "P 0 8 1"), 0);
  co.flags = SKV_CLUSTER_GPU_DIRECT; /* and g exports its own GPU pages */
  cr_assert_eq(skv_cluster_join(kv, &co, &cl), 0, "%s", skv_last_error());
  uint8_t *dev = NULL, *host = malloc(pb * BLOCKS), *hblocks = malloc(pb * BLOCKS);
  cr_assert(host && hblocks);
  cr_assert_eq(cudaMalloc((void **)&dev, pb * BLOCKS), cudaSuccess);
  void *base[1] = {dev}, *hbase[1] = {hblocks};
  skv_layout_t *lay = NULL, *part = NULL, *hlay = NULL;
  cr_assert_eq(skv_layout_create_preset(&g, SKV_LAYOUT_CONTIGUOUS, 16, BLOCKS, base, 0, &lay), 0,
               "%s", skv_last_error());
  cr_assert_eq(skv_layout_create_layers(lay, 1, 1, &part), 0, "%s", skv_last_error());
  cr_assert_eq(skv_layout_create_preset(&g, SKV_LAYOUT_CONTIGUOUS, 16, BLOCKS, hbase, -1, &hlay), 0,
               "%s", skv_last_error());
  skv_namespace_t *ns = NULL;
  cr_assert_eq(skv_namespace_create("m", &g, NULL, 0, "secret", 6, &ns), 0);
  skv_key_t keys[BLOCKS];
  for (uint32_t i = 0; i < 8; i++) keys[i] = key_of(ns, i);
  skv_cluster_ref_t refs[BLOCKS];
  size_t nl = 0, nh = 0;
  cr_assert_eq(skv_cluster_lookup(cl, ns, keys, 8, 0, refs, &nl, &nh), 0, "%s", skv_last_error());
  cr_assert_eq(nh, 8);
  cr_assert_eq(nl, 0);
  uint64_t ids[BLOCKS]; /* reversed, so that a copy ignoring block ids is caught */
  for (int i = 0; i < 8; i++) ids[i] = (uint64_t)(7 - i);
  const skv_layout_t *lays[2] = {part, lay};
  const uint64_t offs[2] = {pb / 4, 0}, lens[2] = {pb / 4, pb};
  for (int direct = 1; direct >= 0; direct--) {
    if (!direct) { /* again, as chosen from the transports (TCP: through pinned host memory) */
      skv_cluster_stats_t sd = SKV_CLUSTER_STATS_INIT;
      cr_assert_eq(skv_cluster_get_stats(cl, &sd), 0);
      cr_assert_eq(sd.remote_direct_pages, 16, "pages read into GPU memory: %" PRIu64,
                   sd.remote_direct_pages);
      skv_cluster_leave(cl);
      co.flags = 0;
      cr_assert_eq(skv_cluster_join(kv, &co, &cl), 0, "%s", skv_last_error());
      cr_assert_eq(skv_cluster_lookup(cl, ns, keys, 8, 0, refs, &nl, &nh), 0, "%s",
                   skv_last_error());
      cr_assert_eq(nh, 8);
    }
    for (int t = 0; t < 2; t++) {
      cr_assert_eq(cudaMemset(dev, 0xEE, pb * BLOCKS), cudaSuccess);
      cr_assert_eq(cudaDeviceSynchronize(), cudaSuccess);
      int rc = skv_cluster_fetch(cl, refs, 8, lays[t], ids, 0, NULL);
      cr_assert_eq(rc, 0, "GPU pages into the GPU (%s, %s): %s: %s",
                   direct ? "direct" : "pinned host", t ? "every layer" : "layer 1",
                   skv_err_name(rc), skv_last_error());
      cr_assert_eq(gpu_blocks_wrong(dev, host, pb, ids, 8, offs[t], lens[t]), 0,
                   "wrong bytes in the GPU blocks (%s, %s)", direct ? "direct" : "pinned host",
                   t ? "every layer" : "layer 1");
    }
  }
  /* into host blocks: UCX reads a's GPU memory into host staging */
  memset(hblocks, 0xEE, pb * BLOCKS);
  int rc = skv_cluster_fetch(cl, refs, 8, hlay, ids, 0, NULL);
  cr_assert_eq(rc, 0, "GPU pages into host blocks: %s: %s", skv_err_name(rc), skv_last_error());
  uint8_t *ordered = malloc(pb * 8);
  cr_assert(ordered);
  for (int i = 0; i < 8; i++) memcpy(ordered + i * pb, hblocks + ids[i] * pb, pb);
  cr_assert_eq(layer_wrong(ordered, pb, 0, 8, 1, 0, pb), 0, "wrong bytes in the host blocks");
  free(ordered);
  /* a evicts them: read after, the generation says so; nothing is written */
  cr_assert_eq(child_do(&a, "C"), 8);
  cr_assert_eq(cudaMemset(dev, 0xEE, pb * BLOCKS), cudaSuccess);
  cr_assert_eq(cudaDeviceSynchronize(), cudaSuccess);
  rc = skv_cluster_fetch(cl, refs, 8, lay, ids, 0, NULL); /* stream-ordered: queued */
  cr_assert_eq(rc, 0, "fetch of evicted GPU pages queued: %s: %s", skv_err_name(rc),
               skv_last_error());
  rc = skv_cluster_sync(cl);
  cr_assert_eq(rc, SKV_ESTALE, "fetch of evicted GPU pages: %s", skv_err_name(rc));
  /* their blocks hold 0xFF (NaN), the others the poison */
  cr_assert_eq(cudaMemcpy(host, dev, pb * BLOCKS, cudaMemcpyDeviceToHost), cudaSuccess);
  for (uint64_t x = 0; x < pb * BLOCKS; x++)
    cr_assert_eq(host[x], x < 8 * pb ? 0xFF : 0xEE, "byte %" PRIu64 " of the blocks", x);
  skv_cluster_stats_t st = SKV_CLUSTER_STATS_INIT;
  skv_cluster_get_stats(cl, &st);
  /* this handle's: the two fetches through host memory into the GPU, the one into host blocks */
  cr_assert_eq(st.remote_pages, 24, "remote pages counted: %" PRIu64, st.remote_pages);
  cr_assert_eq(st.remote_direct_pages, 0, "TCP chose GPU memory: %" PRIu64, st.remote_direct_pages);
  cr_assert_eq(st.remote_bytes, 8 * pb / 4 + 16 * pb, "remote bytes counted: %" PRIu64,
               st.remote_bytes);
  skv_cluster_leave(cl);
  skv_layout_destroy(part);
  skv_layout_destroy(lay);
  skv_layout_destroy(hlay);
  skv_namespace_destroy(ns);
  cudaFree(dev);
  free(host);
  free(hblocks);
  skv_kv_detach(kv);
  child_stop(&a);
  redis_stop(&r);
#endif
}

/* A fetch of 16 MiB from one node goes in a pipeline of sub-batches (xfer.c): a page evicted
 * before the fetch, placed in its third quarter, fails it with SKV_ESTALE; no block holds a
 * wrong byte, the stale page's block and every later one stay unwritten, and the stats count
 * exactly the blocks written. */
Test(cluster, stale_page_late_in_a_pipelined_fetch_is_not_served) {
  redis_t r;
  redis_start(&r, 0);
  node_args_t aa = args_for("a", &r, 64, BLOCKS, 5000); /* pages of 256 KiB */
  child_t a;
  child_start(&a, &aa);
  cr_assert_eq(child_do(&a, "P 0 64 1"), 0);
  eng_t c;
  char dom[64];
  snprintf(dom, sizeof dom, "t%d-c", (int)getpid());
  cr_assert_eq(eng_open(&c, dom, 64, 4, "c", r.url, 5000, 10000, false), 0, "%s", skv_last_error());
  skv_cluster_ref_t refs[BLOCKS], one;
  size_t nl, nh;
  lookup_all(&c, 0, BLOCKS, refs, &nl, &nh);
  cr_assert_eq(nh, BLOCKS);
  uint64_t ids[BLOCKS];
  for (int i = 0; i < BLOCKS; i++) ids[i] = (uint64_t)i;
  /* first, all 64 byte-exact (four sub-batches, more than are in flight at once) */
  memset(c.mem, 0xEE, c.pb * BLOCKS);
  int rc = skv_cluster_fetch(c.cl, refs, BLOCKS, c.lay, ids, 0, NULL);
  cr_assert_eq(rc, 0, "fetch: %s: %s", skv_err_name(rc), skv_last_error());
  int poisoned;
  cr_assert_eq(eng_wrong(&c, 0, BLOCKS, 1, &poisoned), 0, "wrong bytes");
  cr_assert_eq(poisoned, 0);
  /* a's cache is full: one more key takes the page of one of keys 0..63 */
  cr_assert_eq(child_do(&a, "P 100 1 2"), 0);
  uint32_t gone = BLOCKS;
  for (uint32_t i = 0; i < BLOCKS; i++) {
    skv_key_t k = key_of(c.ns, i);
    cr_assert_eq(skv_cluster_lookup(c.cl, c.ns, &k, 1, 0, &one, &nl, &nh), 0);
    if (nh == 0) {
      cr_assert_eq(gone, BLOCKS, "two keys evicted for one");
      gone = i;
    }
  }
  cr_assert_neq(gone, BLOCKS, "no key was evicted");
  /* the stale reference at position 40, the others around it in key order */
  const uint32_t at = 40;
  uint32_t key_at[BLOCKS];
  skv_cluster_ref_t perm[BLOCKS];
  for (uint32_t j = 0, i = 0; j < BLOCKS; j++) {
    if (j == at) {
      key_at[j] = gone;
    } else {
      if (i == gone) i++;
      key_at[j] = i++;
    }
    perm[j] = refs[key_at[j]];
  }
  skv_cluster_stats_t st0 = SKV_CLUSTER_STATS_INIT, st1 = SKV_CLUSTER_STATS_INIT;
  cr_assert_eq(skv_cluster_get_stats(c.cl, &st0), 0);
  memset(c.mem, 0xEE, c.pb * BLOCKS);
  rc = skv_cluster_fetch(c.cl, perm, BLOCKS, c.lay, ids, 0, NULL);
  cr_assert_eq(rc, SKV_ESTALE, "fetch with an evicted page: %s", skv_err_name(rc));
  cr_assert(strstr(skv_last_error(), "node 'a'"), "%s", skv_last_error());
  uint64_t wrong = 0, written = 0;
  for (uint32_t j = 0; j < BLOCKS; j++) {
    const uint8_t *b = c.mem + j * c.pb;
    bool poison = true;
    for (uint64_t x = 0; x < c.pb && poison; x++) poison = b[x] == 0xEE;
    if (poison) continue;
    cr_assert(j < at, "block %u (at or after the stale page at %u) was written", j, at);
    written++;
    for (uint64_t x = 0; x < c.pb; x++) wrong += b[x] != pat(key_at[j], 1, x);
  }
  cr_assert_eq(wrong, 0, "%" PRIu64 " wrong bytes", wrong);
  cr_assert_eq(skv_cluster_get_stats(c.cl, &st1), 0);
  cr_assert_eq(st1.remote_pages - st0.remote_pages, written,
               "%" PRIu64 " pages counted, %" PRIu64 " blocks written",
               st1.remote_pages - st0.remote_pages, written);
  cr_assert_eq(st1.remote_stale - st0.remote_stale, 1);
  /* the handle goes on: the fresh pages read fine afterwards */
  memset(c.mem, 0xEE, c.pb * BLOCKS);
  rc = skv_cluster_fetch(c.cl, perm, at, c.lay, ids, 0, NULL);
  cr_assert_eq(rc, 0, "fetch: %s: %s", skv_err_name(rc), skv_last_error());
  wrong = 0;
  for (uint32_t j = 0; j < at; j++)
    for (uint64_t x = 0; x < c.pb; x++) wrong += c.mem[j * c.pb + x] != pat(key_at[j], 1, x);
  cr_assert_eq(wrong, 0, "%" PRIu64 " wrong bytes", wrong);
  eng_close(&c);
  child_stop(&a);
  redis_stop(&r);
}

typedef struct fetch_loop {
  eng_t *e;
  skv_cluster_ref_t *refs;
  size_t n;
  volatile int stop;
  int fetches, last_rc;
  uint64_t wrong;
  char msg[512];
} fetch_loop_t;

static void *fetch_loop_main(void *arg) {
  fetch_loop_t *f = arg;
  uint64_t ids[BLOCKS];
  for (int i = 0; i < BLOCKS; i++) ids[i] = (uint64_t)i;
  while (!f->stop) {
    memset(f->e->mem, 0xEE, f->e->pb * f->n);
    int rc = skv_cluster_fetch(f->e->cl, f->refs, f->n, f->e->lay, ids, 0, NULL);
    int poisoned;
    f->wrong += eng_wrong(f->e, 0, (uint32_t)f->n, 1, &poisoned);
    __atomic_add_fetch(&f->fetches, 1, __ATOMIC_RELEASE);
    if (rc) {
      f->last_rc = rc;
      snprintf(f->msg, sizeof f->msg, "%s", skv_last_error());
      break;
    }
    if (poisoned) f->wrong += (uint64_t)poisoned; /* a fetch that returned 0 wrote every block */
  }
  return NULL;
}

Test(cluster, node_killed_mid_fetch) {
  redis_t r;
  redis_start(&r, 0);
  /* pages of 256 KiB (64 layers), 32 of them: 8 MiB a fetch */
  node_args_t aa = args_for("a", &r, 64, 32, 1000);
  child_t a;
  child_start(&a, &aa);
  cr_assert_eq(child_do(&a, "P 0 32 1"), 0);
  eng_t c;
  char dom[64];
  snprintf(dom, sizeof dom, "t%d-c", (int)getpid());
  cr_assert_eq(eng_open(&c, dom, 64, 4, "c", r.url, 1000, 5000, false), 0, "%s", skv_last_error());
  skv_cluster_ref_t refs[BLOCKS];
  size_t nl, nh;
  lookup_all(&c, 0, 32, refs, &nl, &nh);
  cr_assert_eq(nh, 32);
  fetch_loop_t f = {.e = &c, .refs = refs, .n = 32};
  pthread_t t;
  pthread_create(&t, NULL, fetch_loop_main, &f);
  /* kill once two fetches went through: the loop runs back to back, so the kill lands inside
   * one (a fetch of 8 MiB takes milliseconds here; under load, longer) */
  uint64_t until = skv__now_ms() + 20000;
  while (__atomic_load_n(&f.fetches, __ATOMIC_ACQUIRE) < 2 && !f.last_rc && skv__now_ms() < until)
    skv_test_sleep_ms(1);
  child_kill(&a);
  uint64_t killed = skv__now_ms();
  pthread_join(t, NULL);
  uint64_t noticed = skv__now_ms() - killed;
  cr_assert(f.fetches >= 2, "only %d fetches before the kill (%s: %s)", f.fetches,
            skv_err_name(f.last_rc), f.msg);
  cr_assert_eq(f.last_rc, SKV_EPEERDEAD, "fetch from a killed node: %s (%s)",
               skv_err_name(f.last_rc), f.msg);
  cr_assert(strstr(f.msg, "node 'a'"), "%s", f.msg);
  cr_assert_eq(f.wrong, 0, "%" PRIu64 " wrong bytes", f.wrong);
  cr_assert(noticed < 5000, "the failure took %" PRIu64 " ms to notice", noticed);
  /* after its lease, the dead node's entries and record are gone from Redis */
  char pat_k[64], pat_a[64];
  snprintf(pat_k, sizeof pat_k, "t%d:k:*", (int)getpid());
  snprintf(pat_a, sizeof pat_a, "t%d:node:a", (int)getpid());
  uint64_t end = skv__now_ms() + 5000;
  long long left;
  while ((left = redis_count(&r, pat_k) + redis_count(&r, pat_a)) > 0 && skv__now_ms() < end)
    skv_test_sleep_ms(100);
  cr_assert_eq(left, 0, "%lld entries of node a in Redis 5 s after the kill (lease 1 s)", left);
  lookup_all(&c, 0, 32, refs, &nl, &nh);
  cr_assert_eq(nh, 0);
  eng_close(&c);
  /* the killed node's domain has no participant left to remove it: the next attacher would lay
   * it out afresh; none comes, so the test removes it */
  char shm[96];
  snprintf(shm, sizeof shm, "/symkv-%s", aa.domain);
  cr_assert_eq(shm_unlink(shm), 0, "%s: %s", shm, strerror(errno));
  redis_stop(&r);
}

Test(cluster, redis_unreachable_node_local_service_goes_on) {
  eng_t c;
  char dom[64], url[64];
  snprintf(dom, sizeof dom, "t%d-c", (int)getpid());
  snprintf(url, sizeof url, "redis://127.0.0.1:%d", skv_test_free_port());
  int rc = eng_open(&c, dom, 4, 16, "c", url, 1000, 2000, false);
  cr_assert_eq(rc, SKV_ECONN, "join with no Redis: %s", skv_err_name(rc));
  cr_assert(strstr(skv_last_error(), url), "%s", skv_last_error());
  cr_assert_null(c.cl);
  /* the cache itself works; a node-local handle too */
  rc = skv_cluster_join(c.kv, NULL, &c.cl);
  cr_assert_eq(rc, 0, "%s", skv_last_error());
  cr_assert_eq(eng_publish(&c, 0, 8, 1), 0, "%s", skv_last_error());
  skv_cluster_ref_t refs[BLOCKS];
  size_t nl, nh;
  lookup_all(&c, 0, 16, refs, &nl, &nh);
  cr_assert_eq(nl, 8);
  cr_assert_eq(nh, 8);
  uint64_t ids[BLOCKS];
  for (int i = 0; i < BLOCKS; i++) ids[i] = (uint64_t)i;
  memset(c.mem, 0xEE, c.pb * BLOCKS);
  cr_assert_eq(skv_cluster_fetch(c.cl, refs, nh, c.lay, ids, 0, NULL), 0);
  int poisoned;
  cr_assert_eq(eng_wrong(&c, 0, 8, 1, &poisoned), 0);
  cr_assert_eq(poisoned, 0);
  refs[0].node = 3;
  cr_assert_eq(skv_cluster_fetch(c.cl, refs, 1, c.lay, ids, 0, NULL), SKV_EINVAL);
  eng_close(&c);
}

Test(cluster, redis_killed_then_restarted_directory_rebuilt) {
  redis_t r;
  redis_start(&r, 0);
  node_args_t aa = args_for("a", &r, 4, 32, 1500);
  child_t a;
  child_start(&a, &aa);
  cr_assert_eq(child_do(&a, "P 8 16 1"), 0);
  eng_t c;
  char dom[64];
  snprintf(dom, sizeof dom, "t%d-c", (int)getpid());
  cr_assert_eq(eng_open(&c, dom, 4, 32, "c", r.url, 1500, 10000, false), 0, "%s", skv_last_error());
  cr_assert_eq(eng_publish(&c, 0, 8, 1), 0);
  skv_cluster_ref_t refs[BLOCKS];
  size_t nl, nh;
  lookup_all(&c, 0, 24, refs, &nl, &nh);
  cr_assert_eq(nh, 24);
  /* Redis goes away: lookups give the node-local hits with SKV_ECONN; local fetches work */
  int port = r.port;
  redis_stop(&r);
  skv_key_t keys[BLOCKS];
  for (uint32_t i = 0; i < 24; i++) keys[i] = key_of(c.ns, i);
  int rc = skv_cluster_lookup(c.cl, c.ns, keys, 24, 0, refs, &nl, &nh);
  cr_assert_eq(rc, SKV_ECONN, "lookup without Redis: %s", skv_err_name(rc));
  cr_assert_eq(nl, 8);
  cr_assert_eq(nh, 8);
  uint64_t ids[BLOCKS];
  for (int i = 0; i < BLOCKS; i++) ids[i] = (uint64_t)i;
  memset(c.mem, 0xEE, c.pb * BLOCKS);
  cr_assert_eq(skv_cluster_fetch(c.cl, refs, nh, c.lay, ids, 0, NULL), 0, "%s", skv_last_error());
  int poisoned;
  cr_assert_eq(eng_wrong(&c, 0, 8, 1, &poisoned), 0);
  cr_assert_eq(poisoned, 0);
  /* Redis comes back empty on the same port: both nodes republish, lookups find all again */
  skv_test_sleep_ms(300);
  redis_start(&r, port);
  uint64_t t0 = skv__now_ms(), end = t0 + 10000;
  do {
    skv_test_sleep_ms(100);
    rc = skv_cluster_lookup(c.cl, c.ns, keys, 24, 0, refs, &nl, &nh);
  } while ((rc || nh < 24) && skv__now_ms() < end);
  cr_assert_eq(rc, 0, "%s", skv_last_error());
  cr_assert_eq(nh, 24, "directory not rebuilt %" PRIu64 " ms after the restart",
               skv__now_ms() - t0);
  memset(c.mem, 0xEE, c.pb * BLOCKS);
  cr_assert_eq(skv_cluster_fetch(c.cl, refs, nh, c.lay, ids, 0, NULL), 0, "%s", skv_last_error());
  cr_assert_eq(eng_wrong(&c, 0, 24, 1, &poisoned), 0);
  cr_assert_eq(poisoned, 0);
  /* c's own writer notices the restart at its next write (a lease renewal at the latest): its
   * lookups above needed only a's entries (its own are node-local hits) */
  skv_cluster_stats_t st = SKV_CLUSTER_STATS_INIT;
  for (end = skv__now_ms() + 5000;; skv_test_sleep_ms(50)) {
    skv_cluster_get_stats(c.cl, &st);
    if (st.dir_reconnects >= 1 || skv__now_ms() >= end) break;
  }
  cr_assert_geq(st.dir_reconnects, 1, "node c did not reconnect within 5 s of the restart");
  eng_close(&c);
  child_stop(&a);
  redis_stop(&r);
}

/* Pages for GPU layouts go straight into GPU memory where UCX's transport to the node writes
 * it itself, never over TCP or shared memory (where UCX bounces it through host buffers). */
Test(cluster, gpu_direct_is_chosen_from_the_transports) {
  const char *tcp[] = {"tcp", "tcp", "cuda_copy"}, *shm[] = {"sysv", "cma", "cuda_copy"},
             *ipc[] = {"sysv", "cuda_ipc"}, *gdr[] = {"tcp", "gdr_copy"},
             *ib[] = {"rc_mlx5", "ud_mlx5"}, *none[] = {NULL};
  cr_assert_not(skv__xfer_gpu_direct_lanes(tcp, 3, true));
  cr_assert_not(skv__xfer_gpu_direct_lanes(shm, 3, true));
  cr_assert(skv__xfer_gpu_direct_lanes(ipc, 2, false));
  cr_assert(skv__xfer_gpu_direct_lanes(gdr, 2, false));
  cr_assert(skv__xfer_gpu_direct_lanes(ib, 2, true), "RDMA with GPUDirect RDMA");
  cr_assert_not(skv__xfer_gpu_direct_lanes(ib, 2, false), "RDMA without GPUDirect RDMA");
  cr_assert_not(skv__xfer_gpu_direct_lanes(none, 1, true));
  cr_assert_not(skv__xfer_gpu_direct_lanes(NULL, 0, true));
}

Test(cluster, bad_arguments_are_refused_by_name) {
  skv_cluster_t *cl = NULL;
  cr_assert_eq(skv_cluster_join(NULL, NULL, &cl), SKV_EINVAL);
  eng_t c;
  char dom[64];
  snprintf(dom, sizeof dom, "t%d-c", (int)getpid());
  unsetenv("SKV_REDIS_URL");
  cr_assert_eq(eng_open(&c, dom, 4, 4, "c", NULL, -1, 2000, false), 0);
  skv_cluster_opts_t o = SKV_CLUSTER_OPTS_INIT;
  o.node = "no spaces";
  cr_assert_eq(skv_cluster_join(c.kv, &o, &cl), SKV_EINVAL);
  cr_assert(strstr(skv_last_error(), "opts.node"), "%s", skv_last_error());
  o = (skv_cluster_opts_t)SKV_CLUSTER_OPTS_INIT;
  o.redis_url = "http://x";
  cr_assert_eq(skv_cluster_join(c.kv, &o, &cl), SKV_EINVAL);
  cr_assert(strstr(skv_last_error(), "redis://"), "%s", skv_last_error());
  o = (skv_cluster_opts_t)SKV_CLUSTER_OPTS_INIT;
  o.lease_ms = 5;
  cr_assert_eq(skv_cluster_join(c.kv, &o, &cl), SKV_EINVAL);
  o = (skv_cluster_opts_t)SKV_CLUSTER_OPTS_INIT;
  o.flags = 8;
  cr_assert_eq(skv_cluster_join(c.kv, &o, &cl), SKV_EINVAL);
  cr_assert(strstr(skv_last_error(), "SKV_CLUSTER_NO_EXPORT") &&
                strstr(skv_last_error(), "SKV_CLUSTER_GPU_DIRECT") &&
                strstr(skv_last_error(), "SKV_CLUSTER_HOST_STAGING"),
            "%s", skv_last_error());
  o.flags = SKV_CLUSTER_GPU_DIRECT | SKV_CLUSTER_HOST_STAGING;
  cr_assert_eq(skv_cluster_join(c.kv, &o, &cl), SKV_EINVAL);
  cr_assert(strstr(skv_last_error(), "at most one"), "%s", skv_last_error());
  /* stats: a caller built before remote_pins existed gets the fields it knows, no more */
  skv_cluster_stats_t st = SKV_CLUSTER_STATS_INIT;
  st.size = offsetof(skv_cluster_stats_t, remote_pins);
  st.remote_pins = 12345;
  cr_assert_eq(skv_cluster_get_stats(c.cl, &st), 0, "%s", skv_last_error());
  cr_assert_eq(st.remote_pins, 12345, "written beyond the caller's size");
  st = (skv_cluster_stats_t)SKV_CLUSTER_STATS_INIT; /* and one built before remote_direct_pages */
  st.size = offsetof(skv_cluster_stats_t, remote_direct_pages);
  st.remote_direct_pages = 12345;
  cr_assert_eq(skv_cluster_get_stats(c.cl, &st), 0, "%s", skv_last_error());
  cr_assert_eq(st.remote_direct_pages, 12345, "written beyond the caller's size");
  st.size = sizeof st - 1;
  cr_assert_eq(skv_cluster_get_stats(c.cl, &st), SKV_EINVAL);
  /* unpins of a node-local handle: local references only */
  skv_cluster_ref_t far = {0, 0, 0, 1};
  cr_assert_eq(skv_cluster_unpin(c.cl, &far, 1), SKV_EINVAL);
  cr_assert(strstr(skv_last_error(), "node-local"), "%s", skv_last_error());
  eng_close(&c);
}

Test(cluster, redis_url_and_lease_from_the_environment) {
  redis_t r;
  redis_start(&r, 0);
  setenv("SKV_REDIS_URL", r.url, 1);
  setenv("SKV_CLUSTER_LEASE_MS", "1500", 1);
  skv__env_reload();
  eng_t c;
  char dom[64];
  snprintf(dom, sizeof dom, "t%d-c", (int)getpid());
  /* opts.redis_url NULL, opts.lease_ms -1: both from the environment */
  cr_assert_eq(eng_open(&c, dom, 4, 8, "c", NULL, -1, 10000, false), 0, "%s", skv_last_error());
  cr_assert_eq(eng_publish(&c, 0, 4, 1), 0, "%s", skv_last_error());
  char pat_s[64];
  snprintf(pat_s, sizeof pat_s, "t%d:k:*", (int)getpid());
  cr_assert_eq(redis_count(&r, pat_s), 4, "the entries are not in the Redis of SKV_REDIS_URL");
  /* the lease is the environment's: the node record's TTL is at most 1.5 s */
  struct timeval tv = {1, 0};
  redisContext *rc = redisConnectWithTimeout("127.0.0.1", r.port, tv);
  cr_assert(rc && !rc->err);
  redisReply *rep = redisCommand(rc, "PTTL t%d:node:c", (int)getpid());
  cr_assert(rep && rep->type == REDIS_REPLY_INTEGER);
  cr_assert(rep->integer > 0 && rep->integer <= 1500, "PTTL %lld", rep->integer);
  freeReplyObject(rep);
  redisFree(rc);
  eng_close(&c);
  unsetenv("SKV_REDIS_URL");
  unsetenv("SKV_CLUSTER_LEASE_MS");
  skv__env_reload();
  redis_stop(&r);
}
