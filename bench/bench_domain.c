/* symkv-bench domain: the elastic node domain. Attach and detach latency to a live domain (p50,
 * p99), lookups and host fetches through an attached handle against the collective path in the
 * same run, GPU fetches of a peer's pages (over NVLink with one GPU per PE) through an attached
 * handle against the collective path, and a trace replay in which engines (processes) leave and
 * join again, its hit rates checked against the exact bound for the pages that survived (with
 * --backend cuda the engines keep their caches on the GPUs and fetch every hit into them). */
#define _GNU_SOURCE
#include "bench.h"
#include "workload.h"

#include <sched.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#ifdef SKV_WITH_CUDA
#include "cuda/device.h"

#include <cuda_runtime_api.h>
#define BCUDA(call) SKV_CUDA_CHECK((call), SKV_SUBSYS_BENCH)
#endif

#define CHAIN 64 /* keys per prefix lookup */

static skv_geometry_t geom(uint32_t layers, uint32_t heads, uint32_t dim, uint32_t page_tokens) {
  skv_geometry_t g = SKV_GEOMETRY_INIT;
  g.num_layers = layers, g.num_kv_heads = heads, g.head_dim = dim, g.elem_bytes = 2;
  g.page_tokens = page_tokens;
  return g;
}

static void domain_name(char *buf, size_t cap, const char *what) {
  snprintf(buf, cap, "bench-%d-%s", (int)getpid(), what);
}

static int attach_ex(const char *name, const skv_geometry_t *g, int role, uint64_t pages,
                     uint32_t slots, uint64_t index_slots, skv_kv_t **kv) {
  skv_attach_opts_t o = SKV_ATTACH_OPTS_INIT;
  o.role = role;
  o.pages_per_pe = pages;
  o.max_slots = slots;
  o.index_slots = index_slots;
  return skv_kv_attach(name, g, &o, kv);
}

static int attach(const char *name, const skv_geometry_t *g, int role, uint64_t pages,
                  uint32_t slots, skv_kv_t **kv) {
  return attach_ex(name, g, role, pages, slots, 0, kv);
}

/* ---- attach and detach latency to a live domain ------------------------------------------- */

static int latency(bench_t *b) {
  const int n = (int)bench_opt_int(b, "--attaches", 200);
  skv_geometry_t g = geom(32, 8, 128, 16); /* Llama-3-8B pages (2 MiB) */
  char name[64];
  domain_name(name, sizeof name, "lat");
  skv_kv_t *keeper;
  double t0 = bench_now();
  SKV_CHECK(attach(name, &g, SKV_ROLE_OWNER, 256, 8, &keeper)); /* creates it */
  double create_ms = (bench_now() - t0) * 1e3;
  double *at = malloc(sizeof(double) * (size_t)n * 4), *dt = at + n;
  double *rat = at + 2 * n, *rdt = at + 3 * n;
  int rc = at ? 0 : SKV_ENOMEM;
  for (int i = 0; rc == 0 && i < n; i++) {
    skv_kv_t *kv;
    for (int role = 0; rc == 0 && role < 2; role++) {
      t0 = bench_now();
      rc = attach(name, &g, role ? SKV_ROLE_READER : SKV_ROLE_OWNER, 256, 8, &kv);
      double t1 = bench_now();
      if (rc == 0) rc = skv_kv_detach(kv);
      double t2 = bench_now();
      (role ? rat : at)[i] = (t1 - t0) * 1e3;
      (role ? rdt : dt)[i] = (t2 - t1) * 1e3;
    }
    bench_progress(b, "attach/detach", i + 1, n);
  }
  bench_progress_end(b);
  int r2 = skv_kv_detach(keeper);
  if (rc == 0) rc = r2;
  if (rc == 0) {
    const char *tgt = "target (issue 18)";
    bench_row(b, "attach/create_domain", create_ms, "ms", "lower", tgt, 50);
    struct {
      const char *what;
      double *v;
    } s[4] = {
        {"attach/owner", at}, {"detach/owner", dt}, {"attach/reader", rat}, {"detach/reader", rdt}};
    for (int k = 0; k < 4; k++) {
      char nm[64];
      snprintf(nm, sizeof nm, "%s/p50", s[k].what);
      double p50 = bench_percentile(s[k].v, (size_t)n, 0.50),
             p99 = bench_percentile(s[k].v, (size_t)n, 0.99);
      bench_row(b, nm, p50, "ms", "lower", tgt, 50);
      snprintf(nm, sizeof nm, "%s/p99", s[k].what);
      bench_row(b, nm, p99, "ms", "lower", tgt, 50);
    }
  }
  free(at);
  return rc;
}

/* ---- the data path: attached against collective ------------------------------------------- */

typedef struct side {
  skv_kv_t *kv;
  skv_namespace_t *ns;
  skv_layout_t *lay;
  void *eng;
  uint64_t eng_bytes;
  int dev; /* -1: the engine cache is in host memory; else on this CUDA device */
} side_t;

/* A row name "WHAT/256_KiBxN": the page size as skv__fmt_bytes writes it, spaces as '_'. */
static void batch_row_name(char *nm, size_t cap, const char *what, uint64_t pb, uint64_t batch) {
  char sz[32];
  snprintf(nm, cap, "%s/%sx%llu", what, skv__fmt_bytes(pb, sz, sizeof sz),
           (unsigned long long)batch);
  for (char *p = nm; *p; p++)
    if (*p == ' ') *p = '_';
}

/* Publish `nkeys` keys (chains of CHAIN) from `keys` into s->kv. */
static int fill(side_t *s, const skv_key_t *keys, uint64_t nkeys) {
  uint64_t bids[CHAIN];
  for (int i = 0; i < CHAIN; i++) bids[i] = (uint64_t)i;
  for (uint64_t i = 0; i < nkeys; i += CHAIN)
    SKV_CHECK(skv_kv_publish(s->kv, s->ns, keys + i, CHAIN, s->lay, bids, NULL, NULL));
  return 0;
}

/* Prefix lookups of every chain for `seconds`: million keys per second. */
static double lookup_rate(side_t *s, const skv_key_t *keys, uint64_t nkeys, double seconds) {
  skv_page_ref_t refs[CHAIN];
  uint64_t done = 0;
  double t0 = bench_now(), t;
  do {
    for (uint64_t i = 0; i < nkeys; i += CHAIN) {
      size_t nh;
      (void)skv_kv_lookup(s->kv, s->ns, keys + i, CHAIN, 0, refs, &nh);
      done += nh;
    }
  } while ((t = bench_now()) - t0 < seconds);
  return (double)done / (t - t0) / 1e6;
}

/* A pinned fetch of `n` pages into the engine: GB/s of the median of `reps`. */
static double fetch_rate(side_t *s, const skv_key_t *keys, uint64_t n, uint64_t pb, int reps) {
  skv_page_ref_t *refs = malloc(n * sizeof *refs);
  uint64_t *bids = malloc(n * sizeof *bids);
  double *tm = malloc(sizeof(double) * (size_t)reps), r = 0;
  size_t nh = 0;
  for (uint64_t i = 0; i < n; i++) bids[i] = i;
  if (refs && bids && tm && skv_kv_lookup(s->kv, s->ns, keys, n, SKV_LOOKUP_PIN, refs, &nh) == 0 &&
      nh == n) {
    for (int k = 0; k < reps; k++) {
      double t0 = bench_now();
      if (skv_kv_fetch(s->kv, refs, n, s->lay, bids, 0, NULL)) break;
      tm[k] = bench_now() - t0;
    }
    r = (double)(n * pb) / bench_median(tm, (size_t)reps) / 1e9;
    (void)skv_kv_unpin(s->kv, refs, n);
  }
  free(refs);
  free(bids);
  free(tm);
  return r;
}

/* An engine cache of `blocks` blocks (one tensor, blocks of one page) in host memory (dev -1)
 * or on CUDA device `dev`, zeroed. */
static int side_open_on(side_t *s, const skv_geometry_t *g, uint64_t blocks, int dev) {
  s->dev = dev;
  SKV_CHECK(skv_namespace_create("bench-domain", g, NULL, 0, "bench", 5, &s->ns));
  uint64_t lb;
  SKV_CHECK(
      skv_layout_get_preset_layer_bytes(g, SKV_LAYOUT_CONTIGUOUS, g->page_tokens, blocks, &lb));
  s->eng_bytes = lb;
  if (dev < 0) {
    s->eng = calloc(1, lb);
    if (!s->eng) return SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_BENCH, "out of memory");
  } else {
#ifdef SKV_WITH_CUDA
    BCUDA(cudaSetDevice(dev));
    BCUDA(cudaMalloc(&s->eng, lb));
    BCUDA(cudaMemset(s->eng, 0, lb));
#else
    return SKV_FAIL(SKV_ENOTSUP, SKV_SUBSYS_BENCH,
                    "GPU engine caches need a build with CUDA (configure with -DSKV_CUDA=ON)");
#endif
  }
  return skv_layout_create_preset(g, SKV_LAYOUT_CONTIGUOUS, g->page_tokens, blocks, &s->eng, dev,
                                  &s->lay);
}

static int side_open(side_t *s, const skv_geometry_t *g, uint64_t blocks) {
  return side_open_on(s, g, blocks, -1);
}

static void side_close(side_t *s) {
  skv_layout_destroy(s->lay);
  skv_namespace_destroy(s->ns);
  if (s->dev < 0) free(s->eng);
#ifdef SKV_WITH_CUDA
  else if (s->eng)
    (void)cudaFree(s->eng);
#endif
  s->eng = NULL;
}

static int datapath(bench_t *b) {
  const uint64_t nkeys = SKV_ALIGN_UP((uint64_t)bench_opt_int(b, "--keys", 65536), CHAIN);
  const uint64_t batch = (uint64_t)bench_opt_int(b, "--batch-pages", 256);
  const int reps = (int)bench_opt_int(b, "--reps", 5);
  const double seconds = bench_opt_real(b, "--seconds", 0.5);
  skv_geometry_t small = geom(1, 1, 16, 4); /* 128-byte pages: the index dominates */
  skv_geometry_t big = geom(4, 8, 128, 16); /* 256 KiB pages: the copy dominates */
  uint64_t pb;
  SKV_CHECK(skv_geometry_get_page_bytes(&big, &pb));
  skv_ctx_t *ctx;
  SKV_CHECK(skv_init(NULL, &ctx));
  char name[64];
  domain_name(name, sizeof name, "dp");
  side_t coll[2] = {{0}}, att[2] = {{0}};
  int rc = 0;
  skv_key_t *keys = malloc(nkeys * sizeof *keys);
  uint64_t s = 11;
  for (uint64_t i = 0; keys && i < nkeys; i++)
    keys[i] = (skv_key_t){bench_rand(&s) | 1, bench_rand(&s)};
  const skv_geometry_t *gs[2] = {&small, &big};
  const uint64_t caps[2] = {nkeys, SKV_MAX(batch, (uint64_t)CHAIN)};
  for (int k = 0; rc == 0 && k < 2; k++) {
    skv_kv_opts_t o = SKV_KV_OPTS_INIT;
    o.pages_per_pe = caps[k];
    char dn[80];
    snprintf(dn, sizeof dn, "%s%d", name, k);
    if (rc == 0) rc = side_open(&coll[k], gs[k], SKV_MAX(batch, CHAIN));
    if (rc == 0) rc = side_open(&att[k], gs[k], SKV_MAX(batch, CHAIN));
    if (rc == 0) rc = skv_kv_create(ctx, gs[k], &o, &coll[k].kv);
    /* an index of the collective one's size (4 slots per page): the same table to walk */
    if (rc == 0) rc = attach_ex(dn, gs[k], SKV_ROLE_OWNER, caps[k], 4, 4 * caps[k], &att[k].kv);
  }
  if (rc == 0) rc = fill(&coll[0], keys, nkeys);
  if (rc == 0) rc = fill(&att[0], keys, nkeys);
  if (rc == 0) rc = fill(&coll[1], keys, SKV_ALIGN_UP(batch, CHAIN));
  if (rc == 0) rc = fill(&att[1], keys, SKV_ALIGN_UP(batch, CHAIN));
  if (rc == 0) {
    double lc[16], la[16], fc[16], fa[16];
    int r = SKV_MIN(reps, 16);
    for (int i = 0; i < r; i++) { /* interleaved: the same conditions for both */
      lc[i] = lookup_rate(&coll[0], keys, nkeys, seconds);
      la[i] = lookup_rate(&att[0], keys, nkeys, seconds);
      fc[i] = fetch_rate(&coll[1], keys, batch, pb, 5);
      fa[i] = fetch_rate(&att[1], keys, batch, pb, 5);
      bench_progress(b, "lookup and fetch", i + 1, r);
    }
    bench_progress_end(b);
    char nm[96];
    snprintf(nm, sizeof nm, "lookup/attached/%d-key_chains", CHAIN);
    bench_row(b, nm, bench_median(la, (size_t)r), "Mkeys/s", "higher", "collective path",
              bench_median(lc, (size_t)r));
    batch_row_name(nm, sizeof nm, "fetch_host/attached", pb, batch);
    bench_row(b, nm, bench_median(fa, (size_t)r), "GB/s", "higher", "collective path",
              bench_median(fc, (size_t)r));
  }
  for (int k = 0; k < 2; k++) {
    if (att[k].kv) skv_kv_detach(att[k].kv);
    if (coll[k].kv) skv_kv_destroy(coll[k].kv);
    side_close(&coll[k]);
    side_close(&att[k]);
  }
  free(keys);
  int r2 = skv_finalize(ctx);
  return rc ? rc : r2;
}

/* ---- GPU fetches of a peer's pages: attached against collective ----------------------------- */

#ifdef SKV_WITH_CUDA

/* The bytes PE 1 publishes: the same on every PE, so PE 0 checks what it fetched. */
static void pattern(uint8_t *p, uint64_t n) {
  uint64_t s = 0x6e766c696e6bull;
  for (uint64_t i = 0; i + 8 <= n; i += 8) {
    uint64_t v = bench_rand(&s);
    memcpy(p + i, &v, 8);
  }
}

/* PE 1 publishes `batch` pages from its GPU through both paths; PE 0 fetches all of them into
 * its GPU (wall time of the call and a stream synchronisation, reps interleaved), then checks
 * every byte of both copies. With one GPU per PE the pages cross NVLink. */
static int nvlink(bench_t *b) {
  const uint64_t batch = (uint64_t)bench_opt_int(b, "--batch-pages", 256);
  const int reps = SKV_MIN((int)bench_opt_int(b, "--reps", 5) * 3, 48);
  skv_geometry_t g = geom(4, 8, 128, 16); /* 256 KiB pages */
  uint64_t pb;
  SKV_CHECK(skv_geometry_get_page_bytes(&g, &pb));
  skv_ctx_t *ctx;
  SKV_CHECK(skv_init(NULL, &ctx));
  const int me = skv_ctx_get_rank(ctx), npes = skv_ctx_get_world_size(ctx);
  int rc = 0;
  if (npes < 2) {
    skv_finalize(ctx);
    return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_BENCH,
                    "symkv-bench domain --part nvlink: needs 2 PEs, one per GPU "
                    "(symkv-run -n 2 -- symkv-bench domain --part nvlink)");
  }
  const int dev = skv_ctx_get_device(ctx);
  if (dev < 0) {
    skv_finalize(ctx);
    return dev;
  }
  char bus[2][32] = {{0}}, name[64] = {0};
  side_t coll = {0}, att = {0};
  coll.dev = att.dev = -1;
  skv_key_t *keys = malloc(batch * sizeof *keys);
  uint64_t *bids = malloc(batch * sizeof *bids);
  skv_page_ref_t *rc_refs = malloc(batch * sizeof *rc_refs),
                 *ra_refs = malloc(batch * sizeof *ra_refs);
  double *tc = malloc(sizeof(double) * (size_t)reps), *ta = malloc(sizeof(double) * (size_t)reps);
  uint8_t *pat = NULL, *got = NULL;
  if (!keys || !bids || !rc_refs || !ra_refs || !tc || !ta)
    rc = SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_BENCH, "out of memory");
  uint64_t s = 7;
  for (uint64_t i = 0; rc == 0 && i < batch; i++) {
    keys[i] = (skv_key_t){bench_rand(&s) | 1, bench_rand(&s)};
    bids[i] = i;
  }
  if (rc == 0 && cudaDeviceGetPCIBusId(bus[0], (int)sizeof bus[0], dev) != cudaSuccess)
    rc = SKV_FAIL(SKV_ECUDA, SKV_SUBSYS_BENCH, "cudaDeviceGetPCIBusId(%d) failed", dev);
  if (rc == 0) { /* bus[1]: the other one of PEs 0 and 1's GPU */
    char(*all)[32] = calloc((size_t)npes, sizeof *all);
    rc = all ? skv_ctx_allgather(ctx, bus[0], all, sizeof bus[0])
             : SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_BENCH, "out of memory");
    if (rc == 0 && me < 2) memcpy(bus[1], all[1 - me], sizeof bus[1]);
    free(all);
  }
  if (rc == 0 && me == 0) {
    domain_name(name, sizeof name, "nv");
    if (strcmp(bus[0], bus[1]) == 0)
      fprintf(stderr,
              "symkv-bench domain: PEs 0 and 1 share GPU %s: the fetches read this GPU's own "
              "memory, not NVLink; run with one GPU per PE\n",
              bus[0]);
  }
  if (rc == 0) rc = skv_ctx_broadcast(ctx, name, sizeof name, 0);
  if (rc == 0) rc = side_open_on(&coll, &g, batch, dev);
  if (rc == 0) rc = side_open_on(&att, &g, batch, dev);
  if (rc == 0) {
    skv_kv_opts_t o = SKV_KV_OPTS_INIT;
    o.backend = SKV_BACKEND_CUDA;
    o.pages_per_pe = batch;
    rc = skv_kv_create(ctx, &g, &o, &coll.kv);
  }
  if (rc == 0) {
    skv_attach_opts_t a = SKV_ATTACH_OPTS_INIT;
    a.backend = SKV_BACKEND_CUDA;
    a.device = dev;
    a.pages_per_pe = batch;
    a.max_slots = (uint32_t)SKV_MIN(npes, 64);
    rc = skv_kv_attach(name, &g, &a, &att.kv);
  }
  if (rc == 0 && (me <= 1)) {
    pat = malloc(coll.eng_bytes);
    got = malloc(coll.eng_bytes);
    if (!pat || !got) rc = SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_BENCH, "out of memory");
    if (rc == 0) pattern(pat, coll.eng_bytes);
  }
  if (rc == 0 && me == 1) { /* the owner of every page */
    side_t *sd[2] = {&coll, &att};
    for (int k = 0; rc == 0 && k < 2; k++) {
      if (cudaMemcpy(sd[k]->eng, pat, sd[k]->eng_bytes, cudaMemcpyHostToDevice) != cudaSuccess)
        rc = SKV_FAIL(SKV_ECUDA, SKV_SUBSYS_BENCH, "cudaMemcpy of the pattern failed");
      size_t ins = 0;
      if (rc == 0)
        rc = skv_kv_publish(sd[k]->kv, sd[k]->ns, keys, batch, sd[k]->lay, bids, NULL, &ins);
      if (rc == 0) rc = skv_kv_sync(sd[k]->kv);
    }
  }
  int r2 = skv_ctx_barrier(ctx);
  if (rc == 0) rc = r2;
  if (rc == 0 && me == 0) {
    size_t nc = 0, na = 0;
    cudaStream_t st = NULL;
    rc = skv_kv_lookup(coll.kv, coll.ns, keys, batch, SKV_LOOKUP_PIN, rc_refs, &nc);
    if (rc == 0) rc = skv_kv_lookup(att.kv, att.ns, keys, batch, SKV_LOOKUP_PIN, ra_refs, &na);
    if (rc == 0 && (nc != batch || na != batch))
      rc = SKV_FAIL(SKV_EINTERNAL, SKV_SUBSYS_BENCH,
                    "PE 0 found %zu (collective) and %zu (attached) of PE 1's %llu pages", nc, na,
                    (unsigned long long)batch);
    if (rc == 0 && cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking) != cudaSuccess)
      rc = SKV_FAIL(SKV_ECUDA, SKV_SUBSYS_BENCH, "cudaStreamCreate failed");
    for (int i = -1; rc == 0 && i < reps; i++) { /* interleaved; -1 warms both up */
      for (int k = 0; rc == 0 && k < 2; k++) {
        side_t *sd = (i + k) % 2 ? &att : &coll; /* alternate which goes first */
        double t0 = bench_now();
        rc = skv_kv_fetch(sd->kv, sd == &att ? ra_refs : rc_refs, batch, sd->lay, bids, 0, st);
        if (rc == 0 && cudaStreamSynchronize(st) != cudaSuccess)
          rc = SKV_FAIL(SKV_ECUDA, SKV_SUBSYS_BENCH, "cudaStreamSynchronize failed");
        if (i >= 0) (sd == &att ? ta : tc)[i] = bench_now() - t0;
      }
      bench_progress(b, "GPU fetch", i + 1, reps);
    }
    bench_progress_end(b);
    uint64_t wrong = 0;
    side_t *sd[2] = {&coll, &att};
    for (int k = 0; rc == 0 && k < 2; k++) {
      memset(got, 0xa5, sd[k]->eng_bytes);
      if (cudaMemcpy(got, sd[k]->eng, sd[k]->eng_bytes, cudaMemcpyDeviceToHost) != cudaSuccess)
        rc = SKV_FAIL(SKV_ECUDA, SKV_SUBSYS_BENCH, "cudaMemcpy of the fetched blocks failed");
      for (uint64_t j = 0; rc == 0 && j < sd[k]->eng_bytes; j++) wrong += got[j] != pat[j];
    }
    if (st) (void)cudaStreamDestroy(st);
    if (nc) (void)skv_kv_unpin(coll.kv, rc_refs, nc);
    if (na) (void)skv_kv_unpin(att.kv, ra_refs, na);
    if (rc == 0 && wrong)
      rc = SKV_FAIL(SKV_EINTERNAL, SKV_SUBSYS_BENCH,
                    "%llu of the %llu fetched bytes differ from what PE 1 published",
                    (unsigned long long)wrong, (unsigned long long)(2 * coll.eng_bytes));
    if (rc == 0) {
      char nm[96];
      const double bytes = (double)(batch * pb);
      const double ga = bytes / bench_median(ta, (size_t)reps) / 1e9,
                   gc = bytes / bench_median(tc, (size_t)reps) / 1e9;
      batch_row_name(nm, sizeof nm, "fetch_gpu/attached", pb, batch);
      bench_row(b, nm, ga, "GB/s", "higher", "collective path", gc);
      batch_row_name(nm, sizeof nm, "fetch_gpu/collective", pb, batch);
      bench_row(b, nm, gc, "GB/s", "higher", NULL, -1);
      bench_row(b, "fetch_gpu/bytes_checked", 2 * (double)coll.eng_bytes, "bytes", "higher", NULL,
                -1);
      bench_config_str(b, "gpu_pe0", bus[0]);
      bench_config_str(b, "gpu_pe1", bus[1]);
    }
  }
  r2 = skv_ctx_barrier(ctx); /* PE 1's pages stay until PE 0 is done */
  if (rc == 0) rc = r2;
  if (att.kv) (void)skv_kv_detach(att.kv);
  if (coll.kv) {
    r2 = skv_kv_destroy(coll.kv);
    if (rc == 0) rc = r2;
  }
  side_close(&coll);
  side_close(&att);
  free(keys), free(bids), free(rc_refs), free(ra_refs), free(tc), free(ta), free(pat), free(got);
  r2 = skv_finalize(ctx);
  return rc ? rc : r2;
}

#else

static int nvlink(bench_t *b) {
  SKV_UNUSED(b);
  return SKV_FAIL(SKV_ENOTSUP, SKV_SUBSYS_BENCH,
                  "symkv-bench domain --part nvlink needs a build with CUDA (-DSKV_CUDA=ON)");
}

#endif

/* ---- a trace replay with engines leaving and joining -------------------------------------- */

/* Events of the replay, in global order: a request (engine = its index mod E), or an engine
 * leaving and joining again at once (its pages leave with it). */
typedef struct ev {
  uint32_t leave; /* 1: engine leaves and rejoins; 0: request `req` */
  uint32_t engine;
  uint64_t req;
} ev_t;

typedef struct ctl {
  volatile uint64_t turn;
  volatile int32_t failed;
  uint32_t pad;
  uint64_t pages_fetched, wrong_bytes; /* --backend cuda: every hit fetched and checked */
} ctl_t;

/* The exact hits when every request runs in order: a key is present when some engine still
 * attached published it (capacity unbounded). */
typedef struct model {
  uint64_t *k, *owner, mask; /* owner + 1; 0 empty; ~0 deleted */
} model_t;

static uint64_t *model_slot(model_t *m, skv_key_t key, bool insert) {
  uint64_t h = (key.lo ^ key.hi) & m->mask, tomb = UINT64_MAX;
  for (;; h = (h + 1) & m->mask) {
    if (m->owner[h] == 0) return insert ? &m->owner[tomb != UINT64_MAX ? tomb : h] : NULL;
    if (m->owner[h] == UINT64_MAX) {
      if (tomb == UINT64_MAX) tomb = h;
      continue;
    }
    if (m->k[h] == key.lo) return &m->owner[h];
  }
}

#ifdef SKV_WITH_CUDA
/* The bytes of the page of `key`: every engine publishes and checks the same. */
static void page_fill(uint8_t *p, uint64_t pb, skv_key_t key) {
  for (uint64_t i = 0; i + 8 <= pb; i += 8) {
    uint64_t v = key.lo * (i + 1) + key.hi;
    memcpy(p + i, &v, 8);
  }
}
#endif

/* An engine of the replay (a forked process): attaches as an owner, serves its requests in the
 * global order (lookup, then publish the misses), leaves and attaches again when told. With
 * `gpu` its cache is on GPU (engine mod GPUs) and every hit is fetched into it and checked. */
static int engine_main(const wl_workload_t *w, const ev_t *evs, uint64_t nev, int me,
                       const char *name, uint64_t pages, uint32_t slots, ctl_t *ctl, uint32_t *hits,
                       double *lat, bool gpu) {
  skv_geometry_t g = geom(1, 1, 16, w->page_tokens);
  side_t s = {0};
  skv_attach_opts_t ao = SKV_ATTACH_OPTS_INIT;
  ao.role = SKV_ROLE_OWNER;
  ao.pages_per_pe = pages;
  ao.max_slots = slots;
  uint64_t pb;
  SKV_CHECK(skv_geometry_get_page_bytes(&g, &pb));
  uint8_t *host = NULL, *want = NULL;
  if (gpu) {
#ifdef SKV_WITH_CUDA
    int ngpu = 0;
    BCUDA(cudaGetDeviceCount(&ngpu));
    ao.backend = SKV_BACKEND_CUDA;
    ao.device = me % SKV_MAX(ngpu, 1);
    host = malloc(w->max_pages * pb);
    want = malloc(pb);
    if (!host || !want) return SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_BENCH, "out of memory");
#endif
  }
  SKV_CHECK(side_open_on(&s, &g, w->max_pages, gpu ? ao.device : -1));
  uint64_t *bids = malloc(sizeof(uint64_t) * w->max_pages);
  skv_page_ref_t *refs = malloc(sizeof(skv_page_ref_t) * w->max_pages);
  for (uint32_t i = 0; i < w->max_pages; i++) bids[i] = i;
  SKV_CHECK(skv_kv_attach(name, &g, &ao, &s.kv));
  int nlat = 0;
  for (uint64_t e = 0; e < nev && !ctl->failed; e++) {
    if ((int)evs[e].engine != me) continue;
    uint64_t deadline = skv__now_ms() + 120000;
    while (__atomic_load_n(&ctl->turn, __ATOMIC_ACQUIRE) != e) {
      if (ctl->failed || skv__now_ms() > deadline) return SKV_ETIMEDOUT;
      sched_yield();
    }
    int rc = 0;
    if (evs[e].leave) {
      double t0 = bench_now();
      rc = skv_kv_detach(s.kv);
      double t1 = bench_now();
      if (rc == 0) rc = skv_kv_attach(name, &g, &ao, &s.kv);
      lat[2 * nlat] = (t1 - t0) * 1e3, lat[2 * nlat + 1] = (bench_now() - t1) * 1e3;
      nlat++;
    } else {
      const wl_request_t *r = &w->req[evs[e].req];
      const skv_key_t *k = w->keys + r->key0;
      size_t nh = 0;
      rc = skv_kv_lookup(s.kv, s.ns, k, r->npages, gpu ? SKV_LOOKUP_PIN : 0, refs, &nh);
#ifdef SKV_WITH_CUDA
      if (rc == 0 && gpu && nh) { /* the hits into this engine's GPU, every byte checked */
        rc = skv_kv_fetch(s.kv, refs, nh, s.lay, bids, SKV_FETCH_UNPIN, NULL);
        if (rc == 0 && cudaMemcpy(host, s.eng, nh * pb, cudaMemcpyDeviceToHost) != cudaSuccess)
          rc = SKV_FAIL(SKV_ECUDA, SKV_SUBSYS_BENCH, "cudaMemcpy of fetched pages failed");
        uint64_t bad = 0;
        for (size_t j = 0; rc == 0 && j < nh; j++) {
          page_fill(want, pb, k[j]);
          for (uint64_t i = 0; i < pb; i++) bad += host[j * pb + i] != want[i];
        }
        __atomic_fetch_add(&ctl->pages_fetched, rc == 0 ? nh : 0, __ATOMIC_RELAXED);
        __atomic_fetch_add(&ctl->wrong_bytes, bad, __ATOMIC_RELAXED);
      }
      if (rc == 0 && gpu && nh < r->npages) { /* the misses' bytes into blocks 0.. */
        for (size_t j = nh; j < r->npages; j++) page_fill(host + (j - nh) * pb, pb, k[j]);
        if (cudaMemcpy(s.eng, host, (r->npages - nh) * pb, cudaMemcpyHostToDevice) != cudaSuccess)
          rc = SKV_FAIL(SKV_ECUDA, SKV_SUBSYS_BENCH, "cudaMemcpy of published pages failed");
      }
#endif
      if (rc == 0 && nh < r->npages)
        rc = skv_kv_publish(s.kv, s.ns, k + nh, r->npages - nh, s.lay, bids, NULL, NULL);
      if (rc == 0 && gpu) rc = skv_kv_sync(s.kv); /* inserted before the next request */
      hits[evs[e].req] = (uint32_t)nh;
    }
    if (rc) {
      ctl->failed = 1;
      return rc;
    }
    __atomic_store_n(&ctl->turn, e + 1, __ATOMIC_RELEASE);
  }
  /* stay until every engine is done: leaving takes this engine's pages away */
  uint64_t deadline = skv__now_ms() + 120000;
  while (__atomic_load_n(&ctl->turn, __ATOMIC_ACQUIRE) < nev && !ctl->failed &&
         skv__now_ms() < deadline)
    sched_yield();
  int rc = skv_kv_detach(s.kv);
  side_close(&s);
  free(bids);
  free(refs);
  free(host);
  free(want);
  return rc;
}

static int replay(bench_t *b) {
  const char *path = bench_opt(b, "--trace");
  if (!path) return 0;
  const int E = (int)bench_opt_int(b, "--engines", 4);
  const int leaves = (int)bench_opt_int(b, "--leaves", 8);
  const char *be = bench_opt(b, "--backend");
  const bool gpu = be && strcmp(be, "cuda") == 0;
  wl_workload_t w;
  memset(&w, 0, sizeof w);
  char err[512];
  if (wl_trace_read(path, 16, (uint64_t)bench_opt_int(b, "--requests", 0), &w, err, sizeof err))
    return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_BENCH, "%s", err);
  skv_geometry_t g = geom(1, 1, 16, w.page_tokens);
  skv_namespace_t *ns;
  SKV_CHECK(skv_namespace_create("bench-domain", &g, NULL, 0, "bench", 5, &ns));
  SKV_CHECK(wl_trace_keys(&w, ns));
  skv_namespace_destroy(ns);
  /* events: every request in order, and `leaves` leave-and-rejoin events spread evenly */
  uint64_t nev = w.nreq + (uint64_t)leaves;
  size_t shm = sizeof(ctl_t) + nev * sizeof(ev_t) + w.nreq * sizeof(uint32_t) +
               (size_t)E * (size_t)(leaves + 1) * 2 * sizeof(double);
  char *mem = mmap(NULL, shm, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED) return SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_BENCH, "out of memory");
  ctl_t *ctl = (ctl_t *)mem;
  ev_t *evs = (ev_t *)(ctl + 1);
  uint32_t *hits = (uint32_t *)(evs + nev);
  double *lat = (double *)(hits + w.nreq);
  uint64_t e = 0;
  for (uint64_t r = 0, l = 0; r < w.nreq; r++) {
    if (l < (uint64_t)leaves && r == (l + 1) * w.nreq / ((uint64_t)leaves + 1))
      evs[e++] = (ev_t){1, (uint32_t)(l++ % (uint64_t)E), 0};
    evs[e++] = (ev_t){0, (uint32_t)(r % (uint64_t)E), r};
  }
  nev = e;
  char name[64];
  domain_name(name, sizeof name, "trace");
  const uint64_t pages = w.nkeys; /* unbounded: no eviction */
  pid_t pid[64];
  double t0 = bench_now();
  for (int i = 0; i < E; i++) {
    pid[i] = fork();
    if (pid[i] == 0) {
      if (engine_main(&w, evs, nev, i, name, pages, (uint32_t)E + 1, ctl, hits,
                      lat + (size_t)i * (size_t)(leaves + 1) * 2, gpu) == 0)
        _exit(0);
      fprintf(stderr, "symkv-bench domain: engine %d failed: %s\n", i, skv_last_error());
      __atomic_store_n(&ctl->failed, 1, __ATOMIC_RELEASE); /* the others stop waiting */
      _exit(1);
    }
  }
  while (__atomic_load_n(&ctl->turn, __ATOMIC_ACQUIRE) < nev && !ctl->failed) {
    bench_progress(b, "trace replay", (double)ctl->turn, (double)nev);
    usleep(20000);
  }
  bench_progress_end(b);
  int bad = 0;
  for (int i = 0; i < E; i++) {
    int st;
    waitpid(pid[i], &st, 0);
    bad += !WIFEXITED(st) || WEXITSTATUS(st);
  }
  double secs = bench_now() - t0;
  /* the exact bound, from the same events */
  model_t m;
  m.mask = 1;
  while (m.mask < 4 * w.nkeys) m.mask <<= 1;
  m.k = calloc(m.mask, sizeof *m.k);
  m.owner = calloc(m.mask, sizeof *m.owner);
  m.mask--;
  uint64_t got = 0, bound = 0, total = 0, mismatched = 0, dropped = 0;
  for (uint64_t i = 0; i < nev && m.k && m.owner; i++) {
    if (evs[i].leave) {
      for (uint64_t h = 0; h <= m.mask; h++)
        if (m.owner[h] == evs[i].engine + 1) m.owner[h] = UINT64_MAX, dropped++;
      continue;
    }
    const wl_request_t *r = &w.req[evs[i].req];
    const skv_key_t *k = w.keys + r->key0;
    uint32_t nh = 0;
    while (nh < r->npages && model_slot(&m, k[nh], false)) nh++;
    for (uint32_t j = nh; j < r->npages; j++) {
      uint64_t *o = model_slot(&m, k[j], true);
      if (*o == 0 || *o == UINT64_MAX) {
        *o = evs[i].engine + 1;
        m.k[o - m.owner] = k[j].lo;
      }
    }
    bound += nh;
    got += hits[evs[i].req];
    total += r->npages;
    if (hits[evs[i].req] != nh && getenv("SKV_BENCH_DEBUG"))
      fprintf(stderr, "request %llu (event %llu, engine %u, %u pages): %u hits, bound %u\n",
              (unsigned long long)evs[i].req, (unsigned long long)i, evs[i].engine, r->npages,
              hits[evs[i].req], nh);
    mismatched += hits[evs[i].req] != nh;
  }
  int rc = bad ? SKV_FAIL(SKV_EINTERNAL, SKV_SUBSYS_BENCH, "%d engine(s) failed", bad) : 0;
  if (rc == 0 && ctl->wrong_bytes)
    rc = SKV_FAIL(SKV_EINTERNAL, SKV_SUBSYS_BENCH, "%llu fetched bytes were wrong",
                  (unsigned long long)ctl->wrong_bytes);
  if (rc == 0) {
    bench_row(b, "trace_churn/block_hit_rate", (double)got / (double)total, "ratio", "higher",
              "exact bound for the surviving pages", (double)bound / (double)total);
    bench_row(b, "trace_churn/requests_off_the_bound", (double)mismatched, "requests", "lower",
              NULL, -1);
    bench_row(b, "trace_churn/pages_dropped_by_leaves", (double)dropped, "pages", "lower", NULL,
              -1);
    bench_row(b, "trace_churn/requests_per_s", (double)w.nreq / secs, "req/s", "higher", NULL, -1);
    if (gpu) {
      bench_row(b, "trace_churn/pages_fetched_to_gpu", (double)ctl->pages_fetched, "pages",
                "higher", "hits (every one fetched)", (double)got);
      bench_row(b, "trace_churn/wrong_bytes", (double)ctl->wrong_bytes, "bytes", "lower", NULL, -1);
    }
    size_t nl = 0;
    double *dl = malloc(sizeof(double) * (size_t)leaves),
           *al = malloc(sizeof(double) * (size_t)leaves);
    for (int i = 0; dl && al && i < E; i++)
      for (int k = 0; k < leaves && nl < (size_t)leaves; k++) {
        double *p = lat + (size_t)i * (size_t)(leaves + 1) * 2 + 2 * (size_t)k;
        if (p[0] > 0) dl[nl] = p[0], al[nl++] = p[1];
      }
    if (nl) {
      bench_row(b, "trace_churn/detach_with_pages/p99", bench_percentile(dl, nl, 0.99), "ms",
                "lower", "target (issue 18)", 50);
      bench_row(b, "trace_churn/attach_live/p99", bench_percentile(al, nl, 0.99), "ms", "lower",
                "target (issue 18)", 50);
    }
    free(dl);
    free(al);
    bench_config_str(b, "trace", path);
    bench_config_int(b, "engines", E);
    bench_config_int(b, "leaves", leaves);
    bench_config_str(b, "backend", gpu ? "cuda" : "host");
  }
  free(m.k);
  free(m.owner);
  munmap(mem, shm);
  wl_workload_free(&w);
  return rc;
}

static int bench_domain(bench_t *b) {
  const char *part = bench_opt(b, "--part");
  bool all = !part || strcmp(part, "all") == 0;
  if (all || strcmp(part, "latency") == 0) SKV_CHECK(latency(b));
  if (all || strcmp(part, "datapath") == 0) SKV_CHECK(datapath(b));
  if (part && strcmp(part, "nvlink") == 0) SKV_CHECK(nvlink(b)); /* not in all: needs GPUs */
  if (all || strcmp(part, "trace") == 0) SKV_CHECK(replay(b));
  return bench_report(b);
}

static const bench_optspec_t domain_opts[] = {
    {"--part", BENCH_CHOICE, "P", "all", "what to run", 0, 0, "all,latency,datapath,nvlink,trace"},
    {"--attaches", BENCH_INT, "N", "200", "attach/detach pairs timed (each role)", 1, 100000, NULL},
    {"--keys", BENCH_INT, "N", "64K", "keys looked up (chains of 64)", 64, 1ll << 24, NULL},
    {"--seconds", BENCH_REAL, "S", "0.5", "lookup time of one repetition", 0.01, 60, NULL},
    {"--batch-pages", BENCH_INT, "N", "256", "pages of one host fetch (256 KiB pages)", 1, 4096,
     NULL},
    {"--reps", BENCH_INT, "N", "5", "repetitions, attached and collective interleaved", 1, 16,
     NULL},
    {"--trace", BENCH_STR, "FILE", NULL, "Mooncake trace to replay with engines leaving", 0, 0,
     NULL},
    {"--engines", BENCH_INT, "N", "4", "engine processes of the replay", 1, 32, NULL},
    {"--leaves", BENCH_INT, "N", "8", "leave-and-rejoin events spread over the replay", 0, 1000,
     NULL},
    {"--requests", BENCH_INT, "N", "0", "requests of the trace (0: all)", 0, 1ll << 30, NULL},
    {"--backend", BENCH_CHOICE, "B", "host",
     "the replay's engine caches and pages: host, or cuda (GPUs, every hit fetched and checked)", 0,
     0, "host,cuda"},
    BENCH_OPTS_END,
};

const bench_cmd_t bench_cmd_domain = {
    .name = "domain",
    .run = bench_domain,
    .summary = "elastic domain: attach/detach latency, data path vs the collective one, trace "
               "replay with engines leaving",
    .opts = domain_opts,
};
