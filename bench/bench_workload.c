/* symkv-bench trace / longdoc / multiround: replay requests of page-key chains on N PEs and
 * compare three policies in one run: none (no cache), per_pe (each PE's own LRU prefix cache)
 * and shared (symkv's node-wide cache: real lookup, fetch and publish of real page bytes). */
#define _GNU_SOURCE
#include "workload.h"

#include "kv/kv.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <jansson.h>
#include <limits.h>
#include <linux/futex.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/* How it works
 * ------------
 * Every PE reads (or generates) the whole workload and computes every request's key chain;
 * request i runs on PE i mod N. Each request of the shared policy looks its chain up
 * (skv_kv_lookup, pinned), fetches the hits from whichever PE holds them into engine blocks
 * (skv_kv_fetch), "prefills" the misses (a modelled time, not computed) and publishes the missed
 * pages from engine blocks (skv_kv_publish, which evicts the PE's least recently used pages at
 * the capacity limit). per_pe replays the same steps on a private LRU of keys of the same
 * capacity per PE (an engine's own prefix cache: its hits cost no copy); none prefills all.
 *
 * --ordered (default): a turn counter in node-shared memory (a one-page symmetric heap, a
 * futex) lets request i start only after request i-1 has published and evicted, so every
 * request sees exactly the pages of the requests before it and results do not depend on
 * timing. --realtime (run_realtime): an event loop per PE over arrivals (at the timestamps
 * divided by --speed: lookup and fetch) and completions (when the modelled prefill, divided by
 * --speed, is over: publish), so a PE has several requests in flight and all PEs run at once;
 * a request does not see the pages of requests still prefilling. Every sleep is cut into 0.1 s
 * slices that check for a failed PE, and the wait for the other PEs' last requests gives up
 * after the context's timeout without progress past the schedule's end.
 *
 * TTFT model (seconds): lookup + fetch + prefill(cached tokens, prompt tokens) where lookup and
 * fetch are measured in this run (per_pe: its lookup, no fetch; none: neither) and
 * prefill = FLOPs / tp / throughput, FLOPs = 2 x params x new tokens + attention
 * (wl_prefill_flops), throughput from --prefill-tflops, else a cuBLAS GEMM measured in this run
 * on a GPU, else 400 TFLOP/s (assumed).
 *
 * What can go wrong
 * -----------------
 * - A PE fails mid-run: it raises `failed` in the control page and wakes the others, which
 *   stop instead of waiting out the timeout for a turn that never comes.
 * - Page bytes must fit: capacities whose pages exceed --mem-fraction of the host's memory (or
 *   of the GPU's free memory) are capped, said on stderr and in the JSON config.
 * - Wrong bytes: every fetched page's first 8 bytes are checked against the key of the page
 *   (host layouts always, GPU layouts with --verify).
 */

enum { P_NONE = 0, P_PER_PE = 1, P_SHARED = 2, NPOL = 3 };
static const char *const pol_names[NPOL] = {"none", "per_pe", "shared"};

typedef struct wl_opts {
  const wl_model_t *model;
  uint32_t tp;
  int backend;
  const char *backend_name;
  int preset;
  const char *layout_name;
  uint32_t block_tokens, page_tokens;
  bool realtime, verify;
  double speed;
  double tflops;
  char tflops_src[160];
  uint64_t capacity;        /* pages per PE; 0 = unbounded */
  double capacity_fraction; /* < 0: not given */
  double mem_fraction;
  uint64_t ring_bytes;
  uint64_t max_requests;
  const char *plot;
} wl_opts_t;

/* One request's outcome (gathered on rank 0). */
typedef struct wl_res {
  uint32_t req, pe;
  uint32_t hits[NPOL];
  uint32_t pad;
  double ttft[NPOL], prefill[NPOL], lookup[NPOL];
  double fetch_s, memcpy_s;
  uint64_t fetch_bytes;
} wl_res_t;

/* The control page in node-shared memory (PE 0's segment of a small symmetric heap). */
typedef struct wl_ctl {
  uint32_t turn;   /* futex word: the request whose turn it is (--ordered) */
  uint32_t failed; /* rank + 1 of a PE that failed */
  uint64_t done, pages, hits_shared, hits_per_pe;
} wl_ctl_t;

/* ---- options ------------------------------------------------------------------------------ */

static void parse_common(bench_t *b, wl_opts_t *o, uint32_t default_page_tokens) {
  memset(o, 0, sizeof *o);
  const char *mname = bench_opt(b, "--model");
  o->model = wl_model_find(mname ? mname : "tiny");
  if (!o->model) {
    bench_usage_error(b, "unknown --model %s (presets: %s)", mname, wl_model_names());
  }
  o->tp = (uint32_t)bench_opt_int(b, "--tp", o->model->default_tp);
  if (o->tp < 1 || (o->model->kv_kind == SKV_KV_SPLIT && o->model->kv_heads % o->tp != 0)) {
    bench_usage_error(b, "--tp %u does not divide the %u KV heads of %s", o->tp, o->model->kv_heads,
                      o->model->name);
  }
  const char *be = bench_opt(b, "--backend");
  o->backend_name = be ? be : "host";
  if (strcmp(o->backend_name, "host") == 0)
    o->backend = SKV_BACKEND_HOST;
  else if (strcmp(o->backend_name, "cuda") == 0)
    o->backend = SKV_BACKEND_CUDA;
  else if (strcmp(o->backend_name, "cuda_host") == 0)
    o->backend = SKV_BACKEND_CUDA_HOST;
  else {
    bench_usage_error(b, "--backend %s: want host, cuda or cuda_host", o->backend_name);
  }
  bool mla = o->model->kv_kind == SKV_KV_MLA;
  const char *lay = bench_opt(b, "--layout");
  o->layout_name = lay ? lay : mla ? "mla" : "nhd";
  static const struct {
    const char *name;
    int preset;
    int mla; /* 1: MLA models only, 0: split only, 2: both */
  } layouts[] = {{"nhd", SKV_LAYOUT_VLLM_FLASH_NHD, 0},
                 {"hnd", SKV_LAYOUT_VLLM_FLASH_HND, 0},
                 {"flashinfer-nhd", SKV_LAYOUT_FLASHINFER_NHD, 0},
                 {"flashinfer-hnd", SKV_LAYOUT_FLASHINFER_HND, 0},
                 {"mla", SKV_LAYOUT_MLA, 1},
                 {"contiguous", SKV_LAYOUT_CONTIGUOUS, 2}};
  o->preset = -1;
  for (size_t i = 0; i < SKV_ARRAY_LEN(layouts); i++)
    if (strcmp(layouts[i].name, o->layout_name) == 0 &&
        (layouts[i].mla == 2 || layouts[i].mla == (int)mla))
      o->preset = layouts[i].preset;
  if (o->preset < 0) {
    bench_usage_error(b, "--layout %s does not suit %s (want %s)", o->layout_name, o->model->name,
                      mla ? "mla or contiguous"
                          : "nhd, hnd, flashinfer-nhd, flashinfer-hnd or contiguous");
  }
  o->page_tokens = (uint32_t)bench_opt_int(b, "--page-tokens", default_page_tokens);
  o->block_tokens = (uint32_t)bench_opt_int(b, "--block-tokens", 16);
  if (o->block_tokens < 1 || o->page_tokens < 1 || o->page_tokens % o->block_tokens != 0) {
    bench_usage_error(b, "--block-tokens %u must divide --page-tokens %u", o->block_tokens,
                      o->page_tokens);
  }
  if (bench_flag(b, "--realtime") && bench_flag(b, "--ordered")) {
    bench_usage_error(b, "--ordered and --realtime exclude each other");
  }
  o->realtime = bench_flag(b, "--realtime");
  o->verify = bench_flag(b, "--verify");
  o->speed = bench_opt_real(b, "--speed", 1.0);
  if (o->speed <= 0) {
    bench_usage_error(b, "--speed must be > 0");
  }
  o->tflops = bench_opt_real(b, "--prefill-tflops", 0);
  if (bench_opt(b, "--prefill-tflops")) {
    if (o->tflops <= 0) {
      bench_usage_error(b, "--prefill-tflops must be > 0");
    }
    snprintf(o->tflops_src, sizeof o->tflops_src, "given (--prefill-tflops)");
  }
  const char *cap = bench_opt(b, "--capacity-pages");
  o->capacity = 0;
  if (cap && strcmp(cap, "unbounded") != 0) {
    long long x;
    if (!skv__parse_int(cap, 1, (long long)SKV_INDEX_MAX_PAGES, true, &x)) {
      bench_usage_error(b, "--capacity-pages %s: want a page count 1..%u or 'unbounded'", cap,
                        SKV_INDEX_MAX_PAGES);
    }
    o->capacity = (uint64_t)x;
  }
  o->capacity_fraction =
      bench_opt(b, "--capacity-fraction") ? bench_opt_real(b, "--capacity-fraction", 1) : -1;
  if (cap && o->capacity_fraction >= 0) {
    bench_usage_error(b, "give --capacity-pages or --capacity-fraction, not both");
  }
  if (bench_opt(b, "--capacity-fraction") && !(o->capacity_fraction > 0)) {
    bench_usage_error(b, "--capacity-fraction must be > 0");
  }
  o->mem_fraction = bench_opt_real(b, "--mem-fraction", o->backend == SKV_BACKEND_CUDA ? 0.8 : 0.5);
  if (o->mem_fraction <= 0 || o->mem_fraction > 0.95) {
    bench_usage_error(b, "--mem-fraction must be in (0, 0.95]");
  }
  o->ring_bytes = (uint64_t)bench_opt_int(b, "--ring-bytes", 256 << 20);
  o->max_requests = (uint64_t)bench_opt_int(b, "--requests", 0);
  o->plot = bench_opt(b, "--plot");
}

static void make_geometry(const wl_opts_t *o, skv_geometry_t *g) {
  *g = (skv_geometry_t)SKV_GEOMETRY_INIT;
  g->kv_kind = o->model->kv_kind;
  g->num_layers = o->model->layers;
  g->num_kv_heads = o->model->kv_kind == SKV_KV_MLA ? 1 : o->model->kv_heads / o->tp;
  g->head_dim = o->model->head_dim;
  g->elem_bytes = o->model->elem_bytes;
  g->page_tokens = o->page_tokens;
}

/* ---- progress (rank 0) ---------------------------------------------------------------------- */

static void progress_draw(bench_t *b, const wl_ctl_t *ctl, size_t total, bool force) {
  if (!force && !bench_progress_due(b)) return;
  uint64_t done = __atomic_load_n(&ctl->done, __ATOMIC_RELAXED);
  uint64_t pages = __atomic_load_n(&ctl->pages, __ATOMIC_RELAXED);
  double hs =
      pages ? (double)__atomic_load_n(&ctl->hits_shared, __ATOMIC_RELAXED) / (double)pages : 0;
  double hp =
      pages ? (double)__atomic_load_n(&ctl->hits_per_pe, __ATOMIC_RELAXED) / (double)pages : 0;
  char extra[96];
  snprintf(extra, sizeof extra, "block hits: shared %.3f per_pe %.3f", hs, hp);
  bench_progress_x(b, b->cmd, (double)done, (double)total, "requests", extra, force);
}

/* ---- the turn of --ordered ------------------------------------------------------------------ */

static long futex(uint32_t *addr, int op, uint32_t val, const struct timespec *ts) {
  return syscall(SYS_futex, addr, op, val, ts, NULL, 0);
}

/* Wait until it is request i's turn; bounded by the context's timeout without progress. */
static int turn_wait(skv_ctx_t *ctx, bench_t *b, wl_ctl_t *ctl, uint32_t i, size_t total,
                     bool show) {
  double timeout = skv_ctx_get_timeout_ms(ctx) / 1000.0, since = bench_now();
  uint32_t seen = __atomic_load_n(&ctl->turn, __ATOMIC_ACQUIRE);
  while (seen != i) {
    uint32_t failed = __atomic_load_n(&ctl->failed, __ATOMIC_ACQUIRE);
    if (failed) {
      b->failed_elsewhere = true;
      return SKV_FAIL(SKV_EPEERDEAD, SKV_SUBSYS_BENCH,
                      "PE %u failed; stopping (its message says why)", failed - 1);
    }
    struct timespec ts = {0, 100 * 1000 * 1000};
    futex(&ctl->turn, FUTEX_WAIT, seen, &ts);
    uint32_t now_turn = __atomic_load_n(&ctl->turn, __ATOMIC_ACQUIRE);
    if (now_turn != seen) since = bench_now();
    seen = now_turn;
    if (show) progress_draw(b, ctl, total, false);
    if (bench_now() - since > timeout)
      return SKV_FAIL(
          SKV_ETIMEDOUT, SKV_SUBSYS_BENCH,
          "request %u waited %.0f s for its turn while request %u (PE %u) made no progress", i,
          timeout, seen, seen % (uint32_t)skv_ctx_get_world_size(ctx));
  }
  return 0;
}

static void turn_pass(wl_ctl_t *ctl, uint32_t next) {
  __atomic_store_n(&ctl->turn, next, __ATOMIC_RELEASE);
  futex(&ctl->turn, FUTEX_WAKE, INT_MAX, NULL);
}

static void fail_all(wl_ctl_t *ctl, int rank) {
  if (!ctl) return;
  __atomic_store_n(&ctl->failed, (uint32_t)rank + 1, __ATOMIC_RELEASE);
  __atomic_add_fetch(&ctl->turn, 0x40000000u, __ATOMIC_RELEASE); /* wake and never match */
  futex(&ctl->turn, FUTEX_WAKE, INT_MAX, NULL);
}

static void sleep_until(double t) {
  double d = t - bench_now();
  if (d <= 0) return;
  struct timespec ts = {(time_t)d, (long)((d - (double)(time_t)d) * 1e9)};
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
  }
}

/* ---- the engine's KV blocks: a ring of `ring` pages' worth of blocks ------------------------ */

typedef struct engine {
  bool device;
  int dev;
  void *stream;
  uint32_t ring, m; /* pages in the ring, blocks per page */
  uint32_t ntensors;
  void **tensors;
  uint64_t tensor_bytes;
  skv_layout_t *lay;
  uint64_t *blocks;      /* identity: page x of a chunk fills blocks x*m .. x*m+m-1 */
  void *cp_src, *cp_dst; /* the memcpy baseline's buffers (ring bytes) */
  uint64_t cp_bytes;
} engine_t;

/* Address of the first bytes of a block (layer 0, K, token 0, head 0): the page's tag. */
static char *block_tag(const engine_t *e, uint64_t block) {
  const skv_layout_t *l = e->lay;
  return l->base[0] + (int64_t)block * l->stride_block * (int64_t)l->geom.elem_bytes;
}

static int engine_create(engine_t *e, const wl_opts_t *o, const skv_geometry_t *g,
                         uint64_t page_bytes, uint32_t max_pages, skv_ctx_t *ctx) {
  memset(e, 0, sizeof *e);
  e->device = o->backend != SKV_BACKEND_HOST;
  e->m = o->page_tokens / o->block_tokens;
  e->ring = (uint32_t)SKV_MAX(1, SKV_MIN((uint64_t)max_pages, o->ring_bytes / page_bytes));
  uint64_t nblocks = (uint64_t)e->ring * e->m;
  e->ntensors = o->preset == SKV_LAYOUT_CONTIGUOUS ? 1 : g->num_layers;
  SKV_CHECK(
      skv_layout_get_preset_layer_bytes(g, o->preset, o->block_tokens, nblocks, &e->tensor_bytes));
  e->tensors = calloc(e->ntensors, sizeof *e->tensors);
  e->cp_bytes = (uint64_t)e->ring * page_bytes;
  if (e->device) {
    SKV_CHECK(wl_dev_use(ctx, &e->dev));
    SKV_CHECK(wl_dev_stream_create(&e->stream));
    for (uint32_t l = 0; l < e->ntensors; l++)
      SKV_CHECK(wl_dev_alloc(e->tensor_bytes, &e->tensors[l]));
    SKV_CHECK(wl_dev_alloc(e->cp_bytes, &e->cp_src));
    SKV_CHECK(wl_dev_alloc(e->cp_bytes, &e->cp_dst));
  } else {
    e->dev = -1;
    for (uint32_t l = 0; l < e->ntensors; l++) {
      e->tensors[l] = aligned_alloc(4096, SKV_ALIGN_UP(e->tensor_bytes, 4096));
      if (!e->tensors[l])
        return SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_BENCH, "engine blocks: out of memory");
      memset(e->tensors[l], 0, e->tensor_bytes);
    }
    e->cp_src = malloc(e->cp_bytes);
    e->cp_dst = malloc(e->cp_bytes);
    if (!e->cp_src || !e->cp_dst)
      return SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_BENCH, "copy buffers: out of memory");
    memset(e->cp_src, 1, e->cp_bytes);
    memset(e->cp_dst, 2, e->cp_bytes);
  }
  SKV_CHECK(skv_layout_create_preset(g, o->preset, o->block_tokens, nblocks, e->tensors, e->dev,
                                     &e->lay));
  e->blocks = malloc(nblocks * sizeof *e->blocks);
  for (uint64_t i = 0; i < nblocks; i++) e->blocks[i] = i;
  return 0;
}

static void engine_destroy(engine_t *e) {
  if (e->lay) skv_layout_destroy(e->lay);
  for (uint32_t l = 0; e->tensors && l < e->ntensors; l++) {
    if (e->device)
      wl_dev_free(e->tensors[l]);
    else
      free(e->tensors[l]);
  }
  if (e->device) {
    wl_dev_free(e->cp_src);
    wl_dev_free(e->cp_dst);
    wl_dev_stream_destroy(e->stream);
  } else {
    free(e->cp_src);
    free(e->cp_dst);
  }
  free(e->tensors);
  free(e->blocks);
  memset(e, 0, sizeof *e);
}

static int tag_write(engine_t *e, uint32_t x, uint64_t tag) {
  char *p = block_tag(e, (uint64_t)x * e->m);
  if (!e->device) {
    memcpy(p, &tag, sizeof tag);
    return 0;
  }
  static uint64_t staged[4096]; /* host source of the copies until the stream syncs */
  staged[x % 4096] = tag;
  return wl_dev_memcpy(p, &staged[x % 4096], sizeof tag, 0, e->stream);
}

static int tag_check(engine_t *e, uint32_t x, uint64_t want, uint64_t req) {
  uint64_t got;
  char *p = block_tag(e, (uint64_t)x * e->m);
  if (e->device) {
    SKV_CHECK(wl_dev_memcpy(&got, p, sizeof got, 1, e->stream));
    SKV_CHECK(wl_dev_stream_sync(e->stream));
  } else {
    memcpy(&got, p, sizeof got);
  }
  if (got != want)
    return SKV_FAIL(SKV_EINTERNAL, SKV_SUBSYS_BENCH,
                    "request %" PRIu64 ": a fetched page holds %016" PRIx64
                    " where its key says %016" PRIx64 " (wrong or torn page)",
                    req, got, want);
  return 0;
}

/* ---- one request --------------------------------------------------------------------------- */

typedef struct run {
  bench_t *b;
  skv_ctx_t *ctx;
  const wl_workload_t *w;
  const wl_opts_t *o;
  skv_kv_t *kv;
  const skv_namespace_t *ns;
  engine_t eng;
  skv_page_ref_t *refs;
  wl_lru_t *own; /* per_pe */
  uint64_t page_bytes;
  double flops_rate; /* FLOP/s of one GPU x tp */
  uint64_t nospace;  /* publishes refused: every page pinned (--realtime) */
} run_t;

static double prefill_s(const run_t *r, uint64_t cached, uint64_t total) {
  return wl_prefill_flops(r->o->model, cached, total) / r->flops_rate;
}

/* Request i arrives: the shared policy looks its chain up and fetches the hits; per_pe looks it
 * up in the PE's own cache. The TTFT model of all three policies follows. */
static int arrive(run_t *r, size_t i, wl_res_t *res) {
  const wl_request_t *q = &r->w->req[i];
  const skv_key_t *keys = r->w->keys + q->key0;
  engine_t *e = &r->eng;
  double t0 = bench_now();
  size_t nhit = 0;
  SKV_CHECK(skv_kv_lookup(r->kv, r->ns, keys, q->npages, SKV_LOOKUP_PIN, r->refs, &nhit));
  double t1 = bench_now();
  bool check = !e->device || r->o->verify;
  for (size_t j = 0; j < nhit; j += e->ring) {
    uint32_t c = (uint32_t)SKV_MIN((size_t)e->ring, nhit - j);
    SKV_CHECK(skv_kv_fetch(r->kv, r->refs + j, c, e->lay, e->blocks, SKV_FETCH_UNPIN, e->stream));
    if (e->device) SKV_CHECK(wl_dev_stream_sync(e->stream));
    if (check)
      for (uint32_t x = 0; x < c; x++) SKV_CHECK(tag_check(e, x, keys[j + x].lo, i));
  }
  double t2 = bench_now();
  res->hits[P_SHARED] = (uint32_t)nhit;
  res->lookup[P_SHARED] = t1 - t0;
  res->fetch_bytes = (uint64_t)nhit * r->page_bytes;
  res->fetch_s = nhit ? t2 - t1 : 0;
  /* baseline: the same bytes in one contiguous copy per ring's worth */
  if (nhit) {
    double c0 = bench_now();
    for (uint64_t left = res->fetch_bytes; left;) {
      uint64_t n = SKV_MIN(left, e->cp_bytes);
      if (e->device)
        SKV_CHECK(wl_dev_memcpy(e->cp_dst, e->cp_src, n, 2, e->stream));
      else
        memcpy(e->cp_dst, e->cp_src, n);
      left -= n;
    }
    if (e->device) SKV_CHECK(wl_dev_stream_sync(e->stream));
    __asm__ __volatile__("" : : "r"(e->cp_dst) : "memory");
    res->memcpy_s = bench_now() - c0;
  }
  /* per_pe: the PE's own prefix cache (hits need no copy); none: no cache */
  double p0 = bench_now();
  uint64_t h = wl_lru_lookup(r->own, keys, q->npages);
  res->lookup[P_PER_PE] = bench_now() - p0;
  res->hits[P_PER_PE] = (uint32_t)h;
  res->hits[P_NONE] = 0;
  for (int p = 0; p < NPOL; p++)
    res->prefill[p] = prefill_s(r, wl_hit_tokens(r->w, q, res->hits[p]), q->tokens);
  res->ttft[P_NONE] = res->prefill[P_NONE];
  res->ttft[P_PER_PE] = res->lookup[P_PER_PE] + res->prefill[P_PER_PE];
  res->ttft[P_SHARED] = res->lookup[P_SHARED] + res->fetch_s + res->prefill[P_SHARED];
  return 0;
}

/* Request i's prefill is done: publish its missed pages (the shared cache evicts the PE's least
 * recently used pages at the capacity limit; per_pe does the same in the PE's own cache). */
static int complete(run_t *r, size_t i, const wl_res_t *res) {
  const wl_request_t *q = &r->w->req[i];
  const skv_key_t *keys = r->w->keys + q->key0;
  engine_t *e = &r->eng;
  bool check = !e->device || r->o->verify;
  for (size_t j = res->hits[P_SHARED]; j < q->npages; j += e->ring) {
    uint32_t c = (uint32_t)SKV_MIN((size_t)e->ring, q->npages - j);
    if (check)
      for (uint32_t x = 0; x < c; x++) SKV_CHECK(tag_write(e, x, keys[j + x].lo));
    size_t ins;
    int rc = skv_kv_publish(r->kv, r->ns, keys + j, c, e->lay, e->blocks, e->stream, &ins);
    if (rc == SKV_ENOSPC &&
        r->o->realtime) { /* every page pinned by readers right now: not cached */
      r->nospace++;
      skv_clear_error();
      break;
    }
    SKV_CHECK(rc);
    if (e->device) SKV_CHECK(wl_dev_stream_sync(e->stream));
  }
  if (e->device) SKV_CHECK(skv_kv_sync(r->kv));
  uint64_t h = res->hits[P_PER_PE];
  wl_lru_publish(r->own, keys + h, q->npages - h);
  return 0;
}

/* ---- capacity ------------------------------------------------------------------------------ */

static uint64_t page_stride(uint64_t page_bytes) {
  return page_bytes >= 4096 ? SKV_ALIGN_UP(page_bytes, 4096) : SKV_ALIGN_UP(page_bytes, 256);
}

typedef struct cap_info {
  uint64_t requested, pages; /* per PE */
  bool capped;
  char note[320];
} cap_info_t;

static int choose_capacity(run_t *r, cap_info_t *ci) {
  const wl_opts_t *o = r->o;
  int npes = skv_ctx_get_world_size(r->ctx);
  memset(ci, 0, sizeof *ci);
  if (o->capacity)
    ci->requested = o->capacity;
  else if (o->capacity_fraction >= 0)
    ci->requested =
        SKV_MAX(1, (uint64_t)ceil(o->capacity_fraction * (double)r->w->distinct / npes));
  else /* unbounded: every distinct page a PE's requests touch, and a margin for in-flight copies */
    ci->requested = wl_max_pages_per_pe(r->w, npes) + 64;
  uint64_t per_page = page_stride(r->page_bytes), meta = 64 + 4 * 32; /* record + 4 index slots */
  uint64_t budget, max_pages;
  char what[128];
  if (o->backend == SKV_BACKEND_CUDA) {
    uint64_t fr = 0;
    SKV_CHECK(wl_dev_mem_free(&fr));
    struct {
      uint64_t free;
      int32_t dev, pad;
    } mine = {fr, r->eng.dev, 0}, *all = calloc((size_t)npes, sizeof *all);
    SKV_CHECK(skv_ctx_allgather(r->ctx, &mine, all, sizeof mine));
    int sharing = 0;
    for (int p = 0; p < npes; p++) sharing += all[p].dev == mine.dev;
    uint64_t minfree = UINT64_MAX;
    for (int p = 0; p < npes; p++) minfree = SKV_MIN(minfree, all[p].free);
    free(all);
    budget = (uint64_t)(o->mem_fraction * (double)minfree) / (uint64_t)SKV_MAX(sharing, 1);
    max_pages = budget / per_page;
    snprintf(what, sizeof what, "%.0f%% of the GPU's free memory", 100 * o->mem_fraction);
  } else {
    uint64_t phys = (uint64_t)sysconf(_SC_PHYS_PAGES) * (uint64_t)sysconf(_SC_PAGESIZE);
    uint64_t rings = (uint64_t)npes * (r->eng.ntensors * r->eng.tensor_bytes + 2 * r->eng.cp_bytes);
    budget = (uint64_t)(o->mem_fraction * (double)phys);
    budget = budget > rings ? budget - rings : 0;
    max_pages = budget / ((per_page + meta) * (uint64_t)npes);
    snprintf(what, sizeof what, "%.0f%% of this host's memory for the pages of all %d PEs",
             100 * o->mem_fraction, npes);
  }
  max_pages = SKV_MIN(max_pages, (uint64_t)SKV_INDEX_MAX_PAGES);
  ci->pages = ci->requested;
  if (ci->pages > max_pages) {
    if (max_pages < 1)
      return SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_BENCH, "not one page of %" PRIu64 " bytes fits in %s",
                      r->page_bytes, what);
    ci->pages = max_pages;
    ci->capped = true;
    char pb[32], tb[32];
    snprintf(ci->note, sizeof ci->note,
             "capacity capped: %" PRIu64 " pages per PE of %s each would exceed %s; using %" PRIu64
             " pages per PE (%s per PE) for shared and per_pe alike",
             ci->requested, skv__fmt_bytes(r->page_bytes, pb, sizeof pb), what, ci->pages,
             skv__fmt_bytes(ci->pages * per_page, tb, sizeof tb));
  }
  return 0;
}

/* ---- reporting (rank 0) -------------------------------------------------------------------- */

typedef struct summary {
  uint64_t pages, tokens, hit_pages[NPOL], hit_tokens[NPOL], fetch_bytes;
  double ttft_p50[NPOL], ttft_p99[NPOL], lookup_p50[NPOL], lookup_p99[NPOL], saved[NPOL];
  double fetch_s, memcpy_s, fetch_gbps, memcpy_gbps;
} summary_t;

static void summarize(const wl_workload_t *w, const wl_res_t *res, size_t n, summary_t *s) {
  memset(s, 0, sizeof *s);
  double *v = malloc((n ? n : 1) * sizeof *v);
  for (size_t i = 0; i < n; i++) {
    const wl_request_t *q = &w->req[res[i].req];
    s->pages += q->npages;
    s->tokens += q->tokens;
    for (int p = 0; p < NPOL; p++) {
      s->hit_pages[p] += res[i].hits[p];
      s->hit_tokens[p] += wl_hit_tokens(w, q, res[i].hits[p]);
      s->saved[p] += res[i].prefill[P_NONE] - res[i].prefill[p];
    }
    s->fetch_bytes += res[i].fetch_bytes;
    s->fetch_s += res[i].fetch_s;
    s->memcpy_s += res[i].memcpy_s;
  }
  for (int p = 0; p < NPOL; p++) {
    for (size_t i = 0; i < n; i++) v[i] = res[i].ttft[p] * 1e3;
    s->ttft_p50[p] = bench_percentile(v, n, 0.5);
    s->ttft_p99[p] = bench_percentile(v, n, 0.99);
    for (size_t i = 0; i < n; i++) v[i] = res[i].lookup[p] * 1e6;
    s->lookup_p50[p] = bench_percentile(v, n, 0.5);
    s->lookup_p99[p] = bench_percentile(v, n, 0.99);
  }
  s->fetch_gbps = s->fetch_s > 0 ? (double)s->fetch_bytes / s->fetch_s / 1e9 : NAN;
  s->memcpy_gbps = s->memcpy_s > 0 ? (double)s->fetch_bytes / s->memcpy_s / 1e9 : NAN;
  free(v);
}

static double frac(uint64_t a, uint64_t b) {
  return b ? (double)a / (double)b : 0;
}

/* The policy table: a row per measure, a column per policy (the results table that follows has
 * the same figures as rows against their baselines). */
static void print_policy_table(const summary_t *s) {
  enum { NR = 9, NC = 2 + NPOL };
  static const char *const head[NC] = {"measure", "better", "none", "per_pe", "shared"};
  static const char *const what[NR][2] = {
      {"block hit rate", "higher"},    {"token hit rate", "higher"}, {"TTFT p50 (ms)", "lower"},
      {"TTFT p99 (ms)", "lower"},      {"lookup p50 (us)", "lower"}, {"lookup p99 (us)", "lower"},
      {"prefill saved (s)", "higher"}, {"fetched (GB)", "-"},        {"fetch (GB/s)", "higher"}};
  char txt[NR][NPOL][32];
  const char *cells[NR * NC];
  for (int p = 0; p < NPOL; p++) {
    bool shared = p == P_SHARED, none = p == P_NONE;
    snprintf(txt[0][p], 32, "%.4f", frac(s->hit_pages[p], s->pages));
    snprintf(txt[1][p], 32, "%.4f", frac(s->hit_tokens[p], s->tokens));
    snprintf(txt[2][p], 32, "%.1f", s->ttft_p50[p]);
    snprintf(txt[3][p], 32, "%.1f", s->ttft_p99[p]);
    snprintf(txt[4][p], 32, none ? "-" : "%.1f", s->lookup_p50[p]);
    snprintf(txt[5][p], 32, none ? "-" : "%.1f", s->lookup_p99[p]);
    snprintf(txt[6][p], 32, "%.1f", s->saved[p]);
    snprintf(txt[7][p], 32, shared ? "%.3f" : "-", (double)s->fetch_bytes / 1e9);
    snprintf(txt[8][p], 32, shared && isfinite(s->fetch_gbps) ? "%.2f" : "-", s->fetch_gbps);
  }
  for (int r = 0; r < NR; r++) {
    cells[r * NC] = what[r][0];
    cells[r * NC + 1] = what[r][1];
    for (int p = 0; p < NPOL; p++) cells[r * NC + 2 + p] = txt[r][p];
  }
  bench_table(stdout, NC, head, "llrrr", cells, NR);
  printf("\n");
}

static void add_rows(bench_t *b, const summary_t *s) {
  char name[96];
  static const char *const base_name[NPOL] = {NULL, "none (no cache)",
                                              "per_pe (each PE's own cache)"};
  for (int p = 0; p < NPOL; p++) {
    int bp = p == P_SHARED ? P_PER_PE : P_NONE; /* the policy each is compared with */
    bool hb = p == P_SHARED;                    /* hit-rate baselines: shared vs per_pe only */
    snprintf(name, sizeof name, "block_hit_rate/%s", pol_names[p]);
    bench_row(b, name, frac(s->hit_pages[p], s->pages), "frac", "higher", hb ? base_name[p] : NULL,
              frac(s->hit_pages[bp], s->pages));
    snprintf(name, sizeof name, "token_hit_rate/%s", pol_names[p]);
    bench_row(b, name, frac(s->hit_tokens[p], s->tokens), "frac", "higher",
              hb ? base_name[p] : NULL, frac(s->hit_tokens[bp], s->tokens));
    snprintf(name, sizeof name, "ttft_p50_ms/%s", pol_names[p]);
    bench_row(b, name, s->ttft_p50[p], "ms", "lower", base_name[p], s->ttft_p50[bp]);
    snprintf(name, sizeof name, "ttft_p99_ms/%s", pol_names[p]);
    bench_row(b, name, s->ttft_p99[p], "ms", "lower", base_name[p], s->ttft_p99[bp]);
    if (p != P_NONE) {
      snprintf(name, sizeof name, "prefill_saved_s/%s", pol_names[p]);
      bench_row(b, name, s->saved[p], "s", "higher", hb ? base_name[p] : NULL, s->saved[bp]);
      snprintf(name, sizeof name, "lookup_p50_us/%s", pol_names[p]);
      bench_row(b, name, s->lookup_p50[p], "us", "lower", hb ? "per_pe (private hash table)" : NULL,
                s->lookup_p50[bp]);
      snprintf(name, sizeof name, "lookup_p99_us/%s", pol_names[p]);
      bench_row(b, name, s->lookup_p99[p], "us", "lower", hb ? "per_pe (private hash table)" : NULL,
                s->lookup_p99[bp]);
    }
  }
  bench_row(b, "fetched_gb/shared", (double)s->fetch_bytes / 1e9, "GB", "higher", NULL, 0);
  bench_row(b, "fetch_gbps/shared", s->fetch_gbps, "GB/s", "higher", "memcpy of the same bytes",
            s->memcpy_gbps);
}

/* plot_workload.py: --plot-script, else the one next to this source file (the tree symkv-bench
 * was built from). */
static const char *plot_script(bench_t *b, char *path, size_t cap) {
  const char *script = bench_opt(b, "--plot-script");
  if (script) return script;
  const char *src = __FILE__, *slash = strrchr(src, '/');
  snprintf(path, cap, "%.*s/plot_workload.py", slash ? (int)(slash - src) : 1, slash ? src : ".");
  return path;
}

/* Run python3 with argv (its stdout goes to stderr, keeping stdout clean for --json); returns its
 * exit status, 127 when python3 cannot be started, 124 when it ran past `timeout_s` (killed). */
static int run_python(const char *const *argv, double timeout_s) {
  fflush(stdout);
  fflush(stderr);
  pid_t pid = fork();
  if (pid == 0) {
    dup2(2, 1);
    execvp(argv[0], (char *const *)argv);
    fprintf(stderr, "symkv-bench: cannot run %s: %s (install python3 and matplotlib)\n", argv[0],
            strerror(errno));
    _exit(127);
  }
  int st = 0;
  if (pid < 0) return 127;
  for (double end = bench_now() + timeout_s;;) {
    pid_t w = waitpid(pid, &st, WNOHANG);
    if (w == pid) break;
    if (w < 0 && errno != EINTR) return 127;
    if (bench_now() > end) {
      fprintf(stderr, "symkv-bench: %s %s ran past %.0f s; stopped\n", argv[0], argv[1], timeout_s);
      kill(pid, SIGKILL);
      while (waitpid(pid, &st, 0) < 0 && errno == EINTR) {
      }
      return 124;
    }
    sleep_until(bench_now() + 0.01);
  }
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

/* Before the run (rank 0): can --plot draw at the end? Fails early, with what to install. */
static int plot_check(bench_t *b) {
  char path[PATH_MAX];
  const char *script = plot_script(b, path, sizeof path);
  if (access(script, R_OK) != 0)
    return SKV_FAIL(SKV_ENOTFOUND, SKV_SUBSYS_BENCH,
                    "--plot: %s is not there (pass --plot-script PATH/TO/bench/plot_workload.py)",
                    script);
  const char *argv[] = {"python3", script, "--check", NULL};
  if (run_python(argv, 60) != 0)
    return SKV_FAIL(SKV_ENOTSUP, SKV_SUBSYS_BENCH,
                    "--plot needs python3 with matplotlib: python3 -m pip install matplotlib (or "
                    "apt-get install "
                    "python3-matplotlib), or leave out --plot");
  return 0;
}

/* Write the per-request CSV and draw it with plot_workload.py (matplotlib). */
static int plot(bench_t *b, const run_t *r, const wl_res_t *res, size_t n, const char *title) {
  const char *png = r->o->plot;
  char csv[PATH_MAX];
  size_t len = strlen(png);
  if (len > 4 && strcmp(png + len - 4, ".png") == 0)
    snprintf(csv, sizeof csv, "%.*s.csv", (int)(len - 4), png);
  else
    snprintf(csv, sizeof csv, "%s.csv", png);
  FILE *f = fopen(csv, "w");
  if (!f)
    return SKV_FAIL(-errno, SKV_SUBSYS_BENCH, "--plot: cannot write %s: %s", csv, strerror(errno));
  fprintf(f, "request,pe,arrival_ms,tokens,pages,hits_none,hits_per_pe,hits_shared,ttft_ms_none,"
             "ttft_ms_per_pe,"
             "ttft_ms_shared,lookup_us_shared,fetch_ms_shared\n");
  for (size_t i = 0; i < n; i++) {
    const wl_res_t *x = &res[i];
    const wl_request_t *q = &r->w->req[x->req];
    fprintf(f, "%u,%u,%.3f,%" PRIu64 ",%u,%u,%u,%u,%.6f,%.6f,%.6f,%.3f,%.6f\n", x->req, x->pe,
            q->arrival_ms, q->tokens, q->npages, x->hits[0], x->hits[1], x->hits[2],
            x->ttft[0] * 1e3, x->ttft[1] * 1e3, x->ttft[2] * 1e3, x->lookup[2] * 1e6,
            x->fetch_s * 1e3);
  }
  if (fclose(f) != 0)
    return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_BENCH, "--plot: writing %s failed", csv);
  char path[PATH_MAX];
  const char *script = plot_script(b, path, sizeof path);
  const char *argv[] = {"python3", script, "--csv", csv, "--out", png, "--title", title, NULL};
  int st = run_python(argv, 600);
  if (st != 0)
    return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_BENCH,
                    "--plot: python3 %s failed (exit status %d, its message is above); "
                    "the data is in %s",
                    script, st, csv);
  if (!b->json) printf("plot: %s (data: %s)\n", png, csv);
  return 0;
}

/* ---- the run -------------------------------------------------------------------------------- */

static int gather(skv_ctx_t *ctx, const wl_res_t *mine, size_t nmine, size_t per, wl_res_t *all) {
  int npes = skv_ctx_get_world_size(ctx);
  size_t chunk = SKV_MAX((size_t)1, (size_t)(4u << 20) / sizeof(wl_res_t) / (size_t)npes);
  wl_res_t *in = calloc(chunk, sizeof *in), *out = calloc(chunk * (size_t)npes, sizeof *out);
  int rc = 0;
  for (size_t off = 0; off < per && rc == 0; off += chunk) {
    size_t c = SKV_MIN(chunk, per - off);
    memset(in, 0xff, chunk * sizeof *in); /* req = UINT32_MAX: no request */
    for (size_t k = 0; k < c && off + k < nmine; k++) in[k] = mine[off + k];
    rc = skv_ctx_allgather(ctx, in, out, c * sizeof *in);
    for (int p = 0; p < npes && rc == 0; p++)
      for (size_t k = 0; k < c; k++) {
        const wl_res_t *x = &out[(size_t)p * c + k];
        if (x->req != UINT32_MAX) all[x->req] = *x;
      }
  }
  free(in);
  free(out);
  return rc;
}

static void count_done(run_t *r, wl_ctl_t *ctl, size_t i, const wl_res_t *x) {
  __atomic_add_fetch(&ctl->pages, r->w->req[i].npages, __ATOMIC_RELAXED);
  __atomic_add_fetch(&ctl->hits_shared, x->hits[P_SHARED], __ATOMIC_RELAXED);
  __atomic_add_fetch(&ctl->hits_per_pe, x->hits[P_PER_PE], __ATOMIC_RELAXED);
  __atomic_add_fetch(&ctl->done, 1, __ATOMIC_RELEASE);
  if (skv_ctx_get_rank(r->ctx) == 0) progress_draw(r->b, ctl, r->w->nreq, false);
}

static int peer_failed(bench_t *b, const wl_ctl_t *ctl) {
  uint32_t failed = __atomic_load_n(&ctl->failed, __ATOMIC_ACQUIRE);
  if (!failed) return 0;
  b->failed_elsewhere = true;
  return SKV_FAIL(SKV_EPEERDEAD, SKV_SUBSYS_BENCH, "PE %u failed; stopping (its message says why)",
                  failed - 1);
}

/* Sleep until `t` in slices of at most 0.1 s, stopping early when a PE fails; rank 0 keeps the
 * progress bar moving meanwhile. `t` is a moment of the schedule, so the wait is bounded by it. */
static int wait_until(run_t *r, wl_ctl_t *ctl, double t) {
  bool show = skv_ctx_get_rank(r->ctx) == 0;
  for (double now = bench_now(); now < t; now = bench_now()) {
    SKV_CHECK(peer_failed(r->b, ctl));
    sleep_until(SKV_MIN(t, now + 0.1));
    if (show) progress_draw(r->b, ctl, r->w->nreq, false);
  }
  return peer_failed(r->b, ctl);
}

/* Wait until every PE has finished all its requests (so that the barrier that follows does not
 * time out while a PE still has requests of a later timestamp). Fails when a PE fails, or when
 * no request completes for the context's timeout after `nominal_end` (the schedule's end). */
static int wait_all_done(run_t *r, wl_ctl_t *ctl, double nominal_end) {
  double timeout = skv_ctx_get_timeout_ms(r->ctx) / 1000.0, last = bench_now();
  uint64_t seen = __atomic_load_n(&ctl->done, __ATOMIC_ACQUIRE);
  bool show = skv_ctx_get_rank(r->ctx) == 0;
  while (seen < r->w->nreq) {
    SKV_CHECK(peer_failed(r->b, ctl));
    double now = bench_now();
    if (now > SKV_MAX(last, nominal_end) + timeout)
      return SKV_FAIL(SKV_ETIMEDOUT, SKV_SUBSYS_BENCH,
                      "%" PRIu64
                      " of %zu requests done and none finished for %.0f s: a PE is stuck",
                      seen, r->w->nreq, timeout);
    sleep_until(now + 0.01);
    if (show) progress_draw(r->b, ctl, r->w->nreq, false);
    uint64_t d = __atomic_load_n(&ctl->done, __ATOMIC_ACQUIRE);
    if (d != seen) last = bench_now();
    seen = d;
  }
  return 0;
}

typedef struct pending {
  double t; /* when the request's prefill is done */
  size_t k; /* its slot in `mine` */
} pending_t;

/* --realtime: requests arrive at their timestamps / speed; each one's lookup and fetch happen on
 * arrival and its publish once its modelled prefill (/ speed) is over, so that a PE has as many
 * requests in flight as arrive meanwhile (an engine batching prefills), and every PE runs at once.
 */
static int run_realtime(run_t *r, wl_ctl_t *ctl, wl_res_t *mine, size_t *nmine, double start,
                        double first_ms) {
  const wl_workload_t *w = r->w;
  int rank = skv_ctx_get_rank(r->ctx), npes = skv_ctx_get_world_size(r->ctx);
  size_t per = (w->nreq + (size_t)npes - 1) / (size_t)npes, nheap = 0, next = (size_t)rank;
  pending_t *heap = calloc(per ? per : 1, sizeof *heap);
  int rc = 0;
  while (rc == 0 && (next < w->nreq || nheap > 0)) {
    double t_arr = next < w->nreq ? start + (w->req[next].arrival_ms - first_ms) / 1e3 / r->o->speed
                                  : INFINITY;
    double t_done = nheap ? heap[0].t : INFINITY;
    if (t_done <= t_arr) { /* the earliest prefill in flight is over: publish it */
      rc = wait_until(r, ctl, t_done);
      if (rc) break;
      pending_t top = heap[0], last = heap[--nheap];
      size_t i = 0; /* sift `last` down from the root */
      for (;;) {
        size_t c = 2 * i + 1;
        if (c >= nheap) break;
        if (c + 1 < nheap && heap[c + 1].t < heap[c].t) c++;
        if (heap[c].t >= last.t) break;
        heap[i] = heap[c];
        i = c;
      }
      if (nheap) heap[i] = last;
      wl_res_t *x = &mine[top.k];
      rc = complete(r, x->req, x);
      if (rc == 0) count_done(r, ctl, x->req, x);
    } else { /* the next request arrives: look up, fetch, start its prefill */
      rc = wait_until(r, ctl, t_arr);
      if (rc) break;
      size_t k = (*nmine)++;
      wl_res_t *x = &mine[k];
      x->req = (uint32_t)next;
      x->pe = (uint32_t)rank;
      rc = arrive(r, next, x);
      if (rc) break;
      pending_t e = {bench_now() + x->prefill[P_SHARED] / r->o->speed, k};
      size_t i = nheap++;
      while (i > 0 && heap[(i - 1) / 2].t > e.t) {
        heap[i] = heap[(i - 1) / 2];
        i = (i - 1) / 2;
      }
      heap[i] = e;
      next += (size_t)npes;
    }
  }
  free(heap);
  return rc;
}

static int wl_run(bench_t *b, skv_ctx_t *ctx, const wl_workload_t *w, const wl_opts_t *o,
                  const skv_geometry_t *g, const skv_namespace_t *ns) {
  int rank = skv_ctx_get_rank(ctx), npes = skv_ctx_get_world_size(ctx);
  if (skv_ctx_get_local_size(ctx) != npes)
    return SKV_FAIL(SKV_ENOTSUP, SKV_SUBSYS_BENCH,
                    "%s runs on the PEs of one node (%d of %d are local)", b->cmd,
                    skv_ctx_get_local_size(ctx), npes);
  if (w->nreq >= 0x40000000u)
    return SKV_FAIL(SKV_ERANGE, SKV_SUBSYS_BENCH, "%zu requests: at most 2^30 in one run", w->nreq);
  run_t r;
  memset(&r, 0, sizeof r);
  r.b = b;
  r.ctx = ctx;
  r.w = w;
  r.o = o;
  r.ns = ns;
  SKV_CHECK(skv_geometry_get_page_bytes(g, &r.page_bytes));
  wl_opts_t *ow = (wl_opts_t *)o;
  if (ow->tflops <= 0) { /* measure on rank 0's GPU where there is one */
    struct {
      double tflops;
      char src[160];
    } m = {0, ""};
    int dev;
    if (rank == 0 && wl_dev_present() &&
        (wl_dev_use(ctx, &dev) != 0 || wl_dev_gemm_tflops(&m.tflops, m.src, sizeof m.src) != 0)) {
      fprintf(stderr,
              "symkv-bench %s: note: the GPU's GEMM throughput could not be measured (%s)\n",
              b->cmd, skv_last_error());
      m.tflops = 0;
    }
    SKV_CHECK(skv_ctx_broadcast(ctx, &m, sizeof m, 0));
    if (m.tflops > 0) {
      ow->tflops = m.tflops;
      snprintf(ow->tflops_src, sizeof ow->tflops_src, "%s", m.src);
    } else {
      ow->tflops = 400;
      snprintf(ow->tflops_src, sizeof ow->tflops_src,
               "assumed, no GPU measured: pass --prefill-tflops");
    }
  }
  r.flops_rate = o->tflops * 1e12 * o->tp;
  if (o->plot) { /* find out now, not after the run, that the plot cannot be drawn */
    int32_t v = rank == 0 ? plot_check(b) : 0;
    SKV_CHECK(skv_ctx_broadcast(ctx, &v, sizeof v, 0));
    if (v && rank != 0) { /* rank 0 says why, once */
      b->failed_elsewhere = true;
      return SKV_FAIL(v, SKV_SUBSYS_BENCH,
                      "--plot: rank 0 cannot draw the plot (its message says why)");
    }
    if (v) return v;
  }

  int rc = 0;
  bool synced = false;
  skv_heap_t *ctl_heap = NULL;
  wl_ctl_t *ctl = NULL;
  wl_res_t *mine = NULL, *all = NULL;
  cap_info_t ci;
  SKV_CHECK_GOTO(engine_create(&r.eng, o, g, r.page_bytes, SKV_MAX(w->max_pages, 1u), ctx), rc,
                 out);
  SKV_CHECK_GOTO(choose_capacity(&r, &ci), rc, out);
  if (rank == 0 && ci.capped) fprintf(stderr, "symkv-bench %s: note: %s\n", b->cmd, ci.note);
  skv_kv_opts_t ko = SKV_KV_OPTS_INIT;
  ko.backend = o->backend;
  ko.pages_per_pe = ci.pages;
  SKV_CHECK_GOTO(skv_kv_create(ctx, g, &ko, &r.kv), rc, out);
  SKV_CHECK_GOTO(skv_heap_create(ctx, 4096, SKV_BACKEND_HOST, &ctl_heap), rc, out);
  skv_heap_info_t hi = SKV_HEAP_INFO_INIT;
  SKV_CHECK_GOTO(skv_heap_get_info(ctl_heap, &hi), rc, out);
  ctl = skv_heap_get_ptr(ctl_heap, 0, hi.data_offset);
  r.own = wl_lru_create(ci.pages);
  r.refs = calloc(SKV_MAX(w->max_pages, 1u), sizeof *r.refs);
  size_t per = (w->nreq + (size_t)npes - 1) / (size_t)npes, nmine = 0;
  mine = calloc(per ? per : 1, sizeof *mine);

  SKV_CHECK_GOTO(skv_ctx_barrier(ctx), rc, out);
  double begin = bench_now(), start = begin + 0.05, first_ms = w->req[0].arrival_ms;
  for (size_t i = 0; i < w->nreq; i++) first_ms = SKV_MIN(first_ms, w->req[i].arrival_ms);
  { /* every PE starts the clock at the same moment (--realtime) */
    SKV_CHECK_GOTO(skv_ctx_broadcast(ctx, &start, sizeof start, 0), rc, out);
  }
  if (o->realtime) {
    rc = run_realtime(&r, ctl, mine, &nmine, start, first_ms);
    if (rc) {
      fail_all(ctl, rank);
      goto out;
    }
  } else {
    for (size_t i = (size_t)rank; i < w->nreq; i += (size_t)npes) {
      wl_res_t *x = &mine[nmine++];
      x->req = (uint32_t)i;
      x->pe = (uint32_t)rank;
      rc = turn_wait(ctx, b, ctl, (uint32_t)i, w->nreq, rank == 0);
      if (rc) goto out;
      rc = arrive(&r, i, x);
      if (rc == 0) rc = complete(&r, i, x);
      if (rc) {
        fail_all(ctl, rank);
        goto out;
      }
      turn_pass(ctl, (uint32_t)i + 1);
      count_done(&r, ctl, i, x);
    }
  }
  { /* the others' last requests; in --realtime a PE's last one can come well after this PE's */
    double end = start;
    if (o->realtime) {
      double last_ms = first_ms, slowest = 0;
      for (size_t i = 0; i < w->nreq; i++) {
        last_ms = SKV_MAX(last_ms, w->req[i].arrival_ms);
        slowest = SKV_MAX(slowest, prefill_s(&r, 0, w->req[i].tokens));
      }
      end = start + ((last_ms - first_ms) / 1e3 + slowest) / o->speed;
    }
    rc = wait_all_done(&r, ctl, end);
    if (rank == 0) bench_progress_end(b);
    if (rc) {
      fail_all(ctl, rank);
      goto out;
    }
  }
  SKV_CHECK_GOTO(skv_kv_sync(r.kv), rc, out);
  SKV_CHECK_GOTO(skv_ctx_barrier(ctx), rc, out);
  double wall = bench_now() - begin;

  /* gather every request's outcome and the cache counters on rank 0 */
  all = calloc(w->nreq, sizeof *all);
  SKV_CHECK_GOTO(gather(ctx, mine, nmine, per, all), rc, out);
  skv_kv_stats_t st = SKV_KV_STATS_INIT, *sts = calloc((size_t)npes, sizeof *sts);
  skv_kv_get_stats(r.kv, &st);
  uint64_t nospace_all = 0, nospace_mine = r.nospace;
  uint64_t *nsp = calloc((size_t)npes, sizeof *nsp);
  rc = skv_ctx_allgather(ctx, &st, sts, sizeof st);
  if (rc == 0) rc = skv_ctx_allgather(ctx, &nospace_mine, nsp, sizeof nospace_mine);
  uint64_t index_full = 0, evicted = 0, dedup = 0, stale = 0;
  for (int p = 0; p < npes; p++) {
    index_full += sts[p].index_full;
    evicted += sts[p].evicted;
    dedup += sts[p].deduplicated;
    stale += sts[p].stale;
    nospace_all += nsp[p];
  }
  free(sts);
  free(nsp);
  if (rc) goto out;

  if (rank == 0) {
    summary_t s;
    summarize(w, all, w->nreq, &s);
    const char *cap_word = ci.capped                                  ? "capped to "
                           : o->capacity || o->capacity_fraction >= 0 ? ""
                                                                      : "unbounded: ";
    char pb[32];
    bench_config_str(b, "workload", w->kind);
    bench_config_str(b, "about", w->about);
    bench_config_int(b, "pes", npes);
    bench_config_int(b, "requests", (long long)w->nreq);
    bench_config_str(b, "mode", o->realtime ? "realtime" : "ordered");
    if (o->realtime) bench_config_real(b, "speed", o->speed);
    bench_config_str(b, "model", o->model->name);
    bench_config_str(b, "model_about", o->model->about);
    bench_config_int(b, "tp", o->tp);
    bench_config_str(b, "backend", o->backend_name);
    bench_config_str(b, "layout", o->layout_name);
    bench_config_int(b, "block_tokens", o->block_tokens);
    bench_config_int(b, "page_tokens", o->page_tokens);
    bench_config_int(b, "page_bytes", (long long)r.page_bytes);
    bench_config_int(b, "kv_bytes_per_token", (long long)(r.page_bytes / o->page_tokens));
    bench_config_int(b, "distinct_pages", (long long)w->distinct);
    bench_config_int(b, "capacity_pages_per_pe", (long long)ci.pages);
    bench_config_str(b, "capacity",
                     o->capacity                 ? "pages"
                     : o->capacity_fraction >= 0 ? "fraction"
                                                 : "unbounded");
    if (o->capacity_fraction >= 0) bench_config_real(b, "capacity_fraction", o->capacity_fraction);
    if (ci.capped) {
      bench_config_int(b, "capacity_requested", (long long)ci.requested);
      bench_config_str(b, "capacity_note", ci.note);
    }
    bench_config_real(b, "prefill_tflops", o->tflops);
    bench_config_str(b, "prefill_tflops_source", o->tflops_src);
    bench_config_int(b, "pages", (long long)s.pages);
    bench_config_int(b, "tokens", (long long)s.tokens);
    for (int p = 0; p < NPOL; p++) {
      char k[64];
      snprintf(k, sizeof k, "block_hits_%s", pol_names[p]);
      bench_config_int(b, k, (long long)s.hit_pages[p]);
      snprintf(k, sizeof k, "token_hits_%s", pol_names[p]);
      bench_config_int(b, k, (long long)s.hit_tokens[p]);
    }
    bench_config_int(b, "evicted", (long long)evicted);
    bench_config_int(b, "deduplicated", (long long)dedup);
    bench_config_int(b, "stale", (long long)stale);
    bench_config_int(b, "index_full", (long long)index_full);
    if (nospace_all) bench_config_int(b, "publish_nospace", (long long)nospace_all);
    bench_config_real(b, "wall_s", wall);
    bool exact_due = !o->realtime && !o->capacity && o->capacity_fraction < 0 && !ci.capped;
    /* the exact prefix hits (unbounded caches, file order), computed from the key chains alone:
     * what an ordered unbounded run must measure, and an upper bound for every other run */
    wl_exact_t ex;
    wl_exact_prefix_hits(w, npes, &ex);
    bench_config_int(b, "exact_block_hits_shared", (long long)ex.hit_pages[0]);
    bench_config_int(b, "exact_block_hits_per_pe", (long long)ex.hit_pages[1]);
    bench_config_int(b, "exact_token_hits_shared", (long long)ex.hit_tokens[0]);
    bench_config_int(b, "exact_token_hits_per_pe", (long long)ex.hit_tokens[1]);
    bool mismatch =
        exact_due &&
        (ex.hit_pages[0] != s.hit_pages[P_SHARED] || ex.hit_pages[1] != s.hit_pages[P_PER_PE] ||
         ex.hit_tokens[0] != s.hit_tokens[P_SHARED] || ex.hit_tokens[1] != s.hit_tokens[P_PER_PE]);
    add_rows(b, &s);
    char mode[48];
    if (o->realtime)
      snprintf(mode, sizeof mode, "realtime at %gx speed", o->speed);
    else
      snprintf(mode, sizeof mode, "ordered");
    if (!b->json) {
      char line[1024], pg[48];
      snprintf(line, sizeof line, "%s: %s", b->cmd, w->about);
      bench_wrap(stdout, line, 80, 2);
      snprintf(pg, sizeof pg, "%s", skv__fmt_bytes(r.page_bytes, pb, sizeof pb));
      snprintf(line, sizeof line,
               "%d PEs, %s, model %s (tp %u, %s a page of %u tokens); capacity %s%" PRIu64
               " pages per PE%s; prefill %.0f TFLOP/s per GPU (%s); %.1f s",
               npes, mode, o->model->name, o->tp, pg, o->page_tokens, cap_word, ci.pages,
               ci.capped ? " by memory" : "", o->tflops, o->tflops_src, wall);
      bench_wrap(stdout, line, 80, 2);
      printf("\n");
      print_policy_table(&s);
      snprintf(line, sizeof line,
               "exact prefix hits (unbounded caches, file order): block shared %.4f per_pe %.4f, "
               "token shared %.4f per_pe %.4f%s",
               frac(ex.hit_pages[0], ex.pages), frac(ex.hit_pages[1], ex.pages),
               frac(ex.hit_tokens[0], ex.tokens), frac(ex.hit_tokens[1], ex.tokens),
               exact_due ? (mismatch ? ": MISMATCH" : ": measured the same")
                         : " (this run's upper bound)");
      bench_wrap(stdout, line, 80, 2);
      printf("\n");
    }
    if (exact_due && mismatch)
      fprintf(stderr,
              "symkv-bench %s: the measured hits differ from the exact prefix hits (shared %" PRIu64
              " vs %" PRIu64 ", per_pe %" PRIu64 " vs %" PRIu64 " pages; index_full %" PRIu64 ")\n",
              b->cmd, s.hit_pages[P_SHARED], ex.hit_pages[0], s.hit_pages[P_PER_PE],
              ex.hit_pages[1], index_full);
    if (bench_report(b) != 0)
      rc = SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_BENCH, "writing the JSON failed");
    if (rc == 0 && o->plot) {
      char title[256];
      snprintf(title, sizeof title, "%s on %d PEs, %s, %s, capacity %s%" PRIu64 " pages/PE%s",
               w->kind, npes, mode, o->model->name, cap_word, ci.pages,
               ci.capped ? " by memory" : "");
      rc = plot(b, &r, all, w->nreq, title);
    }
    if (rc == 0 && exact_due && mismatch)
      rc = SKV_FAIL(SKV_EINTERNAL, SKV_SUBSYS_BENCH,
                    "hits differ from the exact prefix hits (see above)");
  }
  { /* every PE learns rank 0's verdict before tearing down */
    int32_t v = rc;
    int r2 = skv_ctx_broadcast(ctx, &v, sizeof v, 0);
    if (r2 == 0) synced = true;
    if (rc == 0 && r2)
      rc = r2;
    else if (rc == 0 && v) {
      b->failed_elsewhere = true;
      rc = SKV_FAIL(v, SKV_SUBSYS_BENCH, "rank 0 failed (its message says why)");
    }
  }
out:
  if (synced) { /* collective teardown only when every PE got here */
    int r2 = skv_kv_destroy(r.kv);
    int r3 = skv_heap_destroy(ctl_heap);
    if (rc == 0) rc = r2 ? r2 : r3;
  } else if (ctl) {
    fail_all(ctl, rank);
  }
  engine_destroy(&r.eng);
  wl_lru_destroy(r.own);
  free(r.refs);
  free(mine);
  free(all);
  return rc;
}

/* ---- commands ----------------------------------------------------------------------------------
 */

static int run_workload(bench_t *b, wl_workload_t *w, const wl_opts_t *o, const skv_geometry_t *g,
                        skv_namespace_t *ns) {
  if (o->max_requests && w->nreq > o->max_requests) {
    w->nreq = o->max_requests;
    wl_workload_finish(w);
  }
  skv_ctx_t *ctx;
  int rc = skv_init(NULL, &ctx);
  if (rc == 0) {
    rc = wl_run(b, ctx, w, o, g, ns);
    int r2 = skv_finalize(ctx);
    if (rc == 0) rc = r2;
  }
  wl_workload_free(w);
  skv_namespace_destroy(ns);
  /* the report is out: release its rows and config (leak checkers run on these commands) */
  free(b->rows);
  b->rows = NULL;
  b->nrows = b->cap = 0;
  json_decref((json_t *)b->config);
  b->config = NULL;
  return rc;
}

static int setup(bench_t *b, wl_opts_t *o, uint32_t default_page_tokens, skv_geometry_t *g,
                 skv_namespace_t **ns) {
  parse_common(b, o, default_page_tokens); /* exits 2 on a bad option */
  make_geometry(o, g);
  SKV_CHECK(skv_namespace_create(o->model->name, g, "symkv-bench", 11, "symkv-bench", 11, ns));
  return 0;
}

static int bench_trace(bench_t *b) {
  wl_opts_t o;
  skv_geometry_t g;
  skv_namespace_t *ns;
  if (b->npos != 1)
    bench_usage_error(b, "give the trace file (e.g. bench/data/mooncake_synthetic_trace.jsonl)");
  SKV_CHECK(setup(b, &o, 512, &g, &ns));
  wl_workload_t w;
  char err[512];
  if (wl_trace_read(b->pos[0], o.page_tokens, o.max_requests, &w, err, sizeof err) != 0) {
    if (b->rank == 0) fprintf(stderr, "symkv-bench trace: %s\n", err); /* every PE reads it */
    skv_namespace_destroy(ns);
    bench_exit_after_rank0(b, 1);
  }
  int rc = wl_trace_keys(&w, ns);
  if (rc) {
    wl_workload_free(&w);
    skv_namespace_destroy(ns);
    return rc;
  }
  return run_workload(b, &w, &o, &g, ns);
}

static int bench_longdoc(bench_t *b) {
  wl_opts_t o;
  skv_geometry_t g;
  skv_namespace_t *ns;
  SKV_CHECK(setup(b, &o, 512, &g, &ns));
  wl_longdoc_opts_t lo;
  lo.docs = (uint32_t)bench_opt_int(b, "--docs", 16);
  lo.doc_tokens = (uint64_t)bench_opt_int(b, "--doc-tokens", 32768);
  lo.repeats = (uint32_t)bench_opt_int(b, "--repeats", 4);
  lo.question_tokens = (uint64_t)bench_opt_int(b, "--question-tokens", 64);
  lo.rate = bench_opt_real(b, "--rate", 4);
  lo.seed = (uint64_t)bench_opt_int(b, "--seed", 1);
  const char *order = bench_opt(b, "--order");
  if (!order || strcmp(order, "random") == 0)
    lo.order = WL_ORDER_RANDOM;
  else if (strcmp(order, "tile") == 0)
    lo.order = WL_ORDER_TILE;
  else
    lo.order = WL_ORDER_INTERLEAVE; /* bench_parse allowed only these */
  if (lo.docs < 1 || lo.repeats < 1 || lo.doc_tokens + lo.question_tokens < 1 || lo.rate <= 0) {
    bench_usage_error(b, "--docs, --repeats, --rate and the tokens must be positive");
  }
  wl_workload_t w;
  SKV_CHECK(wl_longdoc_make(&lo, ns, o.page_tokens, &w));
  return run_workload(b, &w, &o, &g, ns);
}

static int bench_multiround(bench_t *b) {
  wl_opts_t o;
  skv_geometry_t g;
  skv_namespace_t *ns;
  SKV_CHECK(setup(b, &o, 512, &g, &ns));
  wl_multiround_opts_t mo;
  mo.users = (uint32_t)bench_opt_int(b, "--users", 10);
  mo.rounds = (uint32_t)bench_opt_int(b, "--rounds", 8);
  mo.system_tokens = (uint64_t)bench_opt_int(b, "--system-tokens", 2048);
  mo.message_tokens = (uint64_t)bench_opt_int(b, "--message-tokens", 640);
  mo.answer_tokens = (uint64_t)bench_opt_int(b, "--answer-tokens", 320);
  mo.rate = bench_opt_real(b, "--rate", 4);
  mo.seed = (uint64_t)bench_opt_int(b, "--seed", 1);
  if (mo.users < 1 || mo.rounds < 1 || mo.rate <= 0) {
    bench_usage_error(b, "--users, --rounds and --rate must be positive");
  }
  wl_workload_t w;
  SKV_CHECK(wl_multiround_make(&mo, ns, o.page_tokens, &w));
  return run_workload(b, &w, &o, &g, ns);
}

/* ---- options ------------------------------------------------------------------------------ */

static const bench_optspec_t wl_opts[] = {
    {"--model", BENCH_STR, "M", "tiny",
     "model preset: tiny, llama-3-8b, llama-3-70b, qwen2.5-32b, deepseek-v3", 0, 0, NULL},
    {"--tp", BENCH_INT, "N", "the model's", "tensor-parallel degree (splits the KV heads)", 1, 1024,
     NULL},
    {"--backend", BENCH_CHOICE, "B", "host", "where pages and engine blocks live", 0, 0,
     "host,cuda,cuda_host"},
    {"--layout", BENCH_STR, "L", "nhd or mla",
     "engine layout: nhd, hnd, flashinfer-nhd, flashinfer-hnd, mla, contiguous", 0, 0, NULL},
    {"--block-tokens", BENCH_INT, "N", "16", "tokens per engine block", 1, 65536, NULL},
    {"--page-tokens", BENCH_INT, "N", "512", "tokens per cached page", 1, 65536, NULL},
    {"--ordered", BENCH_FLAG, NULL, NULL,
     "one request at a time in file order, exact hits (default)", 0, 0, NULL},
    {"--realtime", BENCH_FLAG, NULL, NULL, "requests at their timestamps / --speed, concurrently",
     0, 0, NULL},
    {"--speed", BENCH_REAL, "X", "1", "--realtime: play the timestamps X times faster", 1e-6, 1e6,
     NULL},
    {"--prefill-tflops", BENCH_REAL, "T", "measured, else 400", "prefill throughput of one GPU",
     1e-6, 1e9, NULL},
    {"--capacity-pages", BENCH_STR, "N", "unbounded", "pages per PE, or unbounded", 0, 0, NULL},
    {"--capacity-fraction", BENCH_REAL, "F", NULL, "capacity per PE = F x distinct pages / PEs",
     1e-9, 1e6, NULL},
    {"--mem-fraction", BENCH_REAL, "F", "0.5, cuda 0.8", "cap of the pages' memory", 1e-9, 0.95,
     NULL},
    {"--ring-bytes", BENCH_INT, "N", "256M", "engine blocks of a PE", 1, 1ll << 40, NULL},
    {"--requests", BENCH_INT, "N", "all", "replay the first N requests", 0, 1ll << 30, NULL},
    {"--plot", BENCH_STR, "FILE.png", NULL, "draw hit rate and TTFT over the run (matplotlib)", 0,
     0, NULL},
    {"--plot-script", BENCH_STR, "PATH", "bench/plot_workload.py", "the plotting script", 0, 0,
     NULL},
    {"--verify", BENCH_FLAG, NULL, NULL, "check every fetched page's tag on GPU layouts too", 0, 0,
     NULL},
    {"--seed", BENCH_INT, "N", "1", "seed of the synthetic workloads", 0, 1ll << 50, NULL},
    BENCH_OPTS_END,
};

static const bench_optspec_t longdoc_opts[] = {
    {"--docs", BENCH_INT, "D", "16", "documents", 1, 1 << 20, NULL},
    {"--doc-tokens", BENCH_INT, "L", "32768", "tokens of a document", 1, 1ll << 32, NULL},
    {"--repeats", BENCH_INT, "N", "4", "queries of each document", 1, 1 << 20, NULL},
    {"--order", BENCH_CHOICE, "O", "random", "order of the queries", 0, 0,
     "random,tile,interleave"},
    {"--question-tokens", BENCH_INT, "N", "64", "tokens after the document", 0, 1ll << 32, NULL},
    {"--rate", BENCH_REAL, "R", "4", "requests per second (--realtime)", 1e-9, 1e9, NULL},
    BENCH_OPTS_END,
};

static const bench_optspec_t multiround_opts[] = {
    {"--users", BENCH_INT, "U", "10", "conversations", 1, 1 << 20, NULL},
    {"--rounds", BENCH_INT, "R", "8", "rounds of each conversation", 1, 1 << 20, NULL},
    {"--system-tokens", BENCH_INT, "N", "2048", "shared system prompt", 0, 1ll << 32, NULL},
    {"--message-tokens", BENCH_INT, "N", "640", "tokens of a user message", 0, 1ll << 32, NULL},
    {"--answer-tokens", BENCH_INT, "N", "320", "tokens of an answer", 0, 1ll << 32, NULL},
    {"--rate", BENCH_REAL, "R", "4", "requests per second (--realtime)", 1e-9, 1e9, NULL},
    BENCH_OPTS_END,
};

static const char wl_more[] =
    "Policies none (no cache), per_pe (each PE's own LRU prefix cache) and shared (symkv's\n"
    "node-wide cache), measured in the same run; docs/workloads.md has every option.";

const bench_cmd_t bench_cmd_trace = {
    .name = "trace",
    .run = bench_trace,
    .summary = "replay a Mooncake JSONL trace (request i on PE i mod N): hit rates and TTFT of\n"
               "              the policies none, per_pe and shared",
    .positional = "FILE",
    .max_pos = 1,
    .opts = wl_opts,
    .more = wl_more,
};

const bench_cmd_t bench_cmd_longdoc = {
    .name = "longdoc",
    .run = bench_longdoc,
    .summary = "D documents of L tokens queried repeatedly; the policies of trace",
    .opts = wl_opts,
    .opts2 = longdoc_opts,
    .more = wl_more,
};

const bench_cmd_t bench_cmd_multiround = {
    .name = "multiround",
    .run = bench_multiround,
    .summary = "U users x R rounds of a conversation with growing histories; the policies of trace",
    .opts = wl_opts,
    .opts2 = multiround_opts,
    .more = wl_more,
};
