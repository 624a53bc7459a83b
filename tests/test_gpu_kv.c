/* GPU tests of the KV data path (skipped without GPUs): publish and fetch through the copy
 * kernels against the host reference for every layout preset, 2 and 4 PEs reading every peer,
 * graph capture and replay, stale and bad references, device-side checks, the cuda_host tier. */
#define _GNU_SOURCE
#include "skv_test.h"

#include "kernels/kv_copy.h"
#include "kv/kv.h"
#include "kv/kv_cuda.h"

#include <criterion/criterion.h>
#include <criterion/parameterized.h>
#include <cuda_runtime_api.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

TestSuite(gpu_kv, .timeout = 300);

#define CU_OK(call) \
  PE_CHECK((call) == cudaSuccess, "%s: %s", #call, cudaGetErrorString(cudaGetLastError()))

/* ---- an engine cache on a GPU (or in host memory), with a host mirror of what it holds ---- */

typedef struct dengine {
  skv_geometry_t g;
  int preset, device;
  uint32_t bt, nl;
  uint64_t nb, layer_bytes;
  uint8_t **host;     /* [num_layers] host mirror: what the device memory should hold */
  void **dev;         /* [num_layers] device tensors (device >= 0) */
  skv_layout_t *lay;  /* the layout symkv copies with (device, or host when device < 0) */
  skv_layout_t *hlay; /* the same layout over the host mirror */
} dengine_t;

static skv_geometry_t geom_make(uint32_t kind, uint32_t layers, uint32_t heads, uint32_t dim,
                                uint32_t eb, uint32_t pt) {
  skv_geometry_t g = SKV_GEOMETRY_INIT;
  g.kv_kind = kind;
  g.num_layers = layers;
  g.num_kv_heads = heads;
  g.head_dim = dim;
  g.elem_bytes = eb;
  g.page_tokens = pt;
  return g;
}

static int de_new(dengine_t *e, const skv_geometry_t *g, int preset, uint32_t bt, uint64_t nb,
                  int device) {
  memset(e, 0, sizeof *e);
  e->g = *g;
  e->preset = preset;
  e->device = device;
  e->bt = bt;
  e->nb = nb;
  if (skv_layout_get_preset_layer_bytes(g, preset, bt, nb, &e->layer_bytes) != 0) return -1;
  e->nl = preset == SKV_LAYOUT_CONTIGUOUS ? 1 : g->num_layers;
  e->host = calloc(g->num_layers, sizeof *e->host);
  e->dev = calloc(g->num_layers, sizeof *e->dev);
  for (uint32_t l = 0; l < e->nl; l++) {
    e->host[l] = aligned_alloc(64, SKV_ALIGN_UP(e->layer_bytes, 64));
    if (device >= 0 && cudaMalloc(&e->dev[l], e->layer_bytes) != cudaSuccess) return -2;
  }
  if (skv_layout_create_preset(g, preset, bt, nb, (void *const *)e->host, -1, &e->hlay) != 0)
    return -3;
  if (device < 0) {
    e->lay = e->hlay;
    return 0;
  }
  return skv_layout_create_preset(g, preset, bt, nb, e->dev, device, &e->lay) == 0 ? 0 : -4;
}

static void de_free(dengine_t *e) {
  if (e->lay != e->hlay) skv_layout_destroy(e->lay);
  skv_layout_destroy(e->hlay);
  for (uint32_t l = 0; l < e->nl; l++) {
    free(e->host[l]);
    if (e->dev[l]) cudaFree(e->dev[l]);
  }
  free(e->host);
  free(e->dev);
}

/* cudaMemcpy from pageable memory may return before the DMA landed: synchronise the device, or
 * the copy could still overwrite what a kernel on another stream writes next. */
static int de_upload(dengine_t *e) {
  for (uint32_t l = 0; l < e->nl && e->device >= 0; l++)
    if (cudaMemcpy(e->dev[l], e->host[l], e->layer_bytes, cudaMemcpyHostToDevice) != cudaSuccess)
      return -1;
  return cudaDeviceSynchronize() == cudaSuccess ? 0 : -2;
}

static int de_download(dengine_t *e) {
  for (uint32_t l = 0; l < e->nl && e->device >= 0; l++)
    if (cudaMemcpy(e->host[l], e->dev[l], e->layer_bytes, cudaMemcpyDeviceToHost) != cudaSuccess)
      return -1;
  return 0;
}

/* Fresh random data derived from `seed` (any PE regenerates a peer's from its seed). */
static int de_fill(dengine_t *e, uint64_t seed) {
  for (uint32_t l = 0; l < e->nl; l++) {
    uint64_t s = seed + l;
    skv_test_fill_random(e->host[l], e->layer_bytes, &s);
  }
  return de_upload(e);
}

static int de_poison(dengine_t *e) {
  for (uint32_t l = 0; l < e->nl; l++) memset(e->host[l], 0xA5, e->layer_bytes);
  return de_upload(e);
}

/* Address of the vector (layer, kv, block, token, head) in the host mirror, straight from the
 * preset's tensor shape (independent of symkv's layout code). */
static uint8_t *ref_vec(const dengine_t *e, uint32_t l, uint32_t kv, uint64_t b, uint32_t t,
                        uint32_t h) {
  const skv_geometry_t *g = &e->g;
  uint64_t H = g->num_kv_heads, D = g->head_dim, T = e->bt, NB = e->nb, eb = g->elem_bytes, idx;
  switch (e->preset) {
  case SKV_LAYOUT_VLLM_FLASH_NHD:
    idx = ((kv * NB + b) * T + t) * H + h;
    break;
  case SKV_LAYOUT_VLLM_FLASH_HND:
    idx = ((kv * NB + b) * H + h) * T + t;
    break;
  case SKV_LAYOUT_FLASHINFER_NHD:
    idx = ((b * 2 + kv) * T + t) * H + h;
    break;
  case SKV_LAYOUT_FLASHINFER_HND:
    idx = ((b * 2 + kv) * H + h) * T + t;
    break;
  case SKV_LAYOUT_MLA:
    idx = b * T + t;
    break;
  default: {
    uint64_t kvn = g->kv_kind == SKV_KV_MLA ? 1 : 2;
    idx = b * (g->num_layers * kvn * T * H) + ((l * kvn + kv) * T + t) * H + h;
    return e->host[0] + idx * D * eb;
  }
  }
  return e->host[l] + idx * D * eb;
}

static int pages_equal(const dengine_t *src, const uint64_t *sb, const dengine_t *dst,
                       const uint64_t *db) {
  const skv_geometry_t *g = &src->g;
  uint32_t kvn = g->kv_kind == SKV_KV_MLA ? 1 : 2;
  size_t vb = (size_t)g->head_dim * g->elem_bytes;
  for (uint32_t l = 0; l < g->num_layers; l++)
    for (uint32_t kv = 0; kv < kvn; kv++)
      for (uint32_t t = 0; t < g->page_tokens; t++)
        for (uint32_t h = 0; h < g->num_kv_heads; h++)
          if (memcmp(ref_vec(src, l, kv, sb[t / src->bt], t % src->bt, h),
                     ref_vec(dst, l, kv, db[t / dst->bt], t % dst->bt, h), vb) != 0)
            return 0;
  return 1;
}

/* Are all vectors of blocks not in `used` still poison? */
static int untouched_outside(const dengine_t *e, const uint8_t *used) {
  const skv_geometry_t *g = &e->g;
  uint32_t kvn = g->kv_kind == SKV_KV_MLA ? 1 : 2;
  size_t vb = (size_t)g->head_dim * g->elem_bytes;
  for (uint64_t b = 0; b < e->nb; b++) {
    if (used && used[b]) continue;
    for (uint32_t l = 0; l < g->num_layers; l++)
      for (uint32_t kv = 0; kv < kvn; kv++)
        for (uint32_t t = 0; t < e->bt; t++)
          for (uint32_t h = 0; h < g->num_kv_heads; h++) {
            const uint8_t *v = ref_vec(e, l, kv, b, t, h);
            for (size_t i = 0; i < vb; i++)
              if (v[i] != 0xA5) return 0;
          }
  }
  return 1;
}

static void pick_blocks(uint64_t nb, size_t n, uint64_t *out, uint64_t *s) {
  uint8_t *taken = calloc(nb, 1);
  for (size_t i = 0; i < n; i++) {
    uint64_t b;
    do b = skv_test_rand(s) % nb;
    while (taken[b]);
    taken[b] = 1;
    out[i] = b;
  }
  free(taken);
}

/* Do the pages behind refs[0..n) hold exactly what the host path would have written from
 * `src`'s blocks blocks[i*m ..]? Reads the heap with cudaMemcpy (device or registered host). */
static int pages_hold(skv_kv_t *kv, const skv_page_ref_t *refs, size_t n, const dengine_t *src,
                      const uint64_t *blocks) {
  uint8_t *want = malloc(kv->page_bytes), *got = malloc(kv->page_bytes);
  int ok = 1;
  for (size_t i = 0; i < n && ok; i++) {
    memset(want, 0x5A, kv->page_bytes);
    skv__copy_blocks_to_page(src->hlay, want, blocks + i * src->hlay->blocks_per_page, false);
    if (cudaMemcpy(got, skv__kv_page(kv, refs[i].pe, refs[i].page), kv->page_bytes,
                   cudaMemcpyDefault) != cudaSuccess)
      ok = 0;
    else
      ok = memcmp(want, got, kv->page_bytes) == 0;
  }
  free(want);
  free(got);
  return ok;
}

/* ---- round trips: publish on every PE, every PE fetches every PE's pages ---- */

typedef struct rt_param {
  int npes;
  int backend;    /* SKV_BACKEND_CUDA or _CUDA_HOST */
  int engine_gpu; /* 1: engine caches on the GPU (the kernels); 0: in host memory */
  int preset;
  uint32_t kind, layers, heads, dim, eb, pt, bt;
  int variant; /* kernel variant: see set_variant */
} rt_param_t;

/* 0: the default (environment, else auto: bulk for fetches of 8 MiB and more, vec below); 1: TMA
 * bulk fetch; 2: vec, arguments read over PCIe; 3: vec, arguments copied to the device, 8 loads in
 * flight, L2 256-byte hint; 4: bulk, arguments copied to the device; 5: vec only; 6: copy
 * engines for dense runs (vec otherwise). */
static int set_variant(int which) {
  if (which == 0) return 0;
  skv__kv_variant_t v = {SKV_KV_KERNEL_VEC, 4, 4, 256, SKV_KV_ARGS_AUTO, 0};
  if (which == 6) v.kernel = SKV_KV_KERNEL_CE;
  if (which == 1 || which == 4) v.kernel = SKV_KV_KERNEL_BULK, v.ctas_per_sm = 1;
  if (which == 2) v.args = SKV_KV_ARGS_MAPPED;
  if (which == 3 || which == 4) v.args = SKV_KV_ARGS_DEVICE;
  if (which == 3) v.unroll = 8, v.l2_256 = 1;
  return skv__kv_variant_set(&v);
}

static int pe_round_trip(int rank, int npes, void *arg) {
  rt_param_t *p = arg;
  skv_ctx_t *ctx;
  PE_CHECK(skv_test_init(&ctx, 60000) == 0, "init");
  int dev = skv_ctx_get_device(ctx);
  PE_CHECK(dev >= 0, "device: %s", skv_err_name(dev));
  PE_CHECK(set_variant(p->variant) == 0, "variant");
  skv_geometry_t g = geom_make(p->kind, p->layers, p->heads, p->dim, p->eb, p->pt);
  enum { NPAGES = 6 };
  uint32_t m = p->pt / p->bt;
  uint64_t nb = NPAGES * m * 3;
  skv_kv_opts_t o = SKV_KV_OPTS_INIT;
  o.backend = p->backend;
  o.pages_per_pe = 16;
  skv_kv_t *kv;
  PE_CHECK(skv_kv_create(ctx, &g, &o, &kv) == 0, "kv create");
  skv_namespace_t *ns;
  PE_CHECK(skv_namespace_create("gpu-model", &g, "tenant", 6, "secret", 6, &ns) == 0, "ns");
  int edev = p->engine_gpu ? dev : -1;
  dengine_t src, dst, ref;
  PE_CHECK(de_new(&src, &g, p->preset, p->bt, nb, edev) == 0, "src engine: %s", skv_last_error());
  PE_CHECK(de_new(&dst, &g, p->preset, p->bt, nb, edev) == 0, "dst engine");
  PE_CHECK(de_new(&ref, &g, p->preset, p->bt, nb, -1) == 0, "ref engine");
  uint64_t seed = skv_test_seed(), seeds[SKV_TEST_MAX_PES];
  PE_CHECK(skv_ctx_allgather(ctx, &seed, seeds, sizeof seed) == 0, "seeds");
  PE_CHECK(de_fill(&src, seed) == 0, "fill");
  uint32_t tokens[NPAGES * 64];
  uint32_t ntok = NPAGES * p->pt;
  PE_CHECK(ntok <= sizeof tokens / sizeof tokens[0], "too many tokens");
  for (uint32_t i = 0; i < ntok; i++) tokens[i] = (uint32_t)(rank * 100000 + i);
  skv_key_t keys[NPAGES];
  size_t nk;
  PE_CHECK(skv_namespace_hash_tokens(ns, tokens, ntok, NULL, keys, NPAGES, &nk) == 0 &&
               nk == NPAGES,
           "hash");
  uint64_t sblocks[NPAGES * 64];
  uint64_t s = seed ^ 0x55;
  pick_blocks(nb, NPAGES * m, sblocks, &s);
  cudaStream_t st;
  CU_OK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  size_t ins = 0;
  PE_CHECK(skv_kv_publish(kv, ns, keys, NPAGES, src.lay, sblocks, st, &ins) == 0 && ins == NPAGES,
           "publish: %zu", ins);
  PE_CHECK(skv_kv_sync(kv) == 0, "sync after publish");
  skv_kv_stats_t stats = SKV_KV_STATS_INIT;
  skv_kv_get_stats(kv, &stats);
  PE_CHECK(stats.published == NPAGES && stats.pages_used == NPAGES, "published %llu used %llu",
           (unsigned long long)stats.published, (unsigned long long)stats.pages_used);
  /* the pages hold exactly what the host path would have written */
  skv_page_ref_t refs[NPAGES + 1];
  size_t nhit;
  PE_CHECK(skv_kv_lookup(kv, ns, keys, NPAGES, 0, refs, &nhit) == 0 && nhit == NPAGES,
           "own lookup %zu", nhit);
  PE_CHECK(pages_hold(kv, refs, NPAGES, &src, sblocks),
           "a published page differs from the host reference");
  uint64_t all_blocks[SKV_TEST_MAX_PES][NPAGES * 64];
  PE_CHECK(skv_ctx_allgather(ctx, sblocks, all_blocks, sizeof sblocks) == 0, "blocks");
  PE_CHECK(skv_ctx_barrier(ctx) == 0, "barrier");
  for (int k = 0; k < npes; k++) {
    int from = (rank + k) % npes; /* every PE reads every PE, peers first at different times */
    for (uint32_t i = 0; i < ntok; i++) tokens[i] = (uint32_t)(from * 100000 + i);
    skv_key_t fk[NPAGES + 1];
    PE_CHECK(skv_namespace_hash_tokens(ns, tokens, ntok, NULL, fk, NPAGES, &nk) == 0, "hash");
    fk[NPAGES] = fk[0];
    fk[NPAGES].lo ^= 1;
    PE_CHECK(skv_kv_lookup(kv, ns, fk, NPAGES + 1, SKV_LOOKUP_PIN, refs, &nhit) == 0 &&
                 nhit == NPAGES,
             "lookup %zu", nhit);
    for (int i = 0; i < NPAGES; i++)
      PE_CHECK(refs[i].pe == (uint32_t)from, "page %d is on PE %u", i, refs[i].pe);
    PE_CHECK(de_poison(&dst) == 0, "poison");
    uint64_t dblocks[NPAGES * 64];
    s = skv_test_seed();
    pick_blocks(nb, NPAGES * m, dblocks, &s);
    PE_CHECK(skv_kv_fetch(kv, refs, NPAGES, dst.lay, dblocks, SKV_FETCH_UNPIN, st) == 0,
             "fetch from %d", from);
    CU_OK(cudaStreamSynchronize(st));
    PE_CHECK(skv_kv_sync(kv) == 0, "sync after fetch");
    PE_CHECK(de_download(&dst) == 0, "download");
    PE_CHECK(de_fill(&ref, seeds[from]) == 0, "ref");
    for (int i = 0; i < NPAGES; i++)
      PE_CHECK(pages_equal(&ref, &all_blocks[from][i * m], &dst, &dblocks[i * m]),
               "page %d from PE %d differs", i, from);
    uint8_t *used = calloc(nb, 1);
    for (uint32_t i = 0; i < NPAGES * m; i++) used[dblocks[i]] = 1;
    PE_CHECK(untouched_outside(&dst, used), "fetch wrote outside its blocks");
    free(used);
  }
  PE_CHECK(skv_ctx_barrier(ctx) == 0, "barrier");
  skv_kv_get_stats(kv, &stats);
  PE_CHECK(stats.pages_pinned == 0 && stats.pages_used == NPAGES, "pinned %llu used %llu",
           (unsigned long long)stats.pages_pinned, (unsigned long long)stats.pages_used);
  PE_CHECK(stats.index_entries == (uint64_t)npes * NPAGES, "entries %llu",
           (unsigned long long)stats.index_entries);
  CU_OK(cudaStreamDestroy(st));
  de_free(&src);
  de_free(&dst);
  de_free(&ref);
  skv_namespace_destroy(ns);
  PE_CHECK(skv_kv_destroy(kv) == 0, "destroy");
  PE_CHECK(skv_finalize(ctx) == 0, "finalize");
  return 0;
}

#define CUDA_DEV SKV_BACKEND_CUDA, 1
ParameterizedTestParameters(gpu_kv, round_trip_every_preset) {
  static rt_param_t p[] = {
      /* every preset, 2 and 4 PEs (4 PEs share 2 GPUs where there are 2) */
      {2, CUDA_DEV, SKV_LAYOUT_VLLM_FLASH_NHD, SKV_KV_SPLIT, 3, 4, 64, 2, 32, 16, 0},
      {4, CUDA_DEV, SKV_LAYOUT_VLLM_FLASH_NHD, SKV_KV_SPLIT, 3, 4, 64, 2, 32, 16, 0},
      {2, CUDA_DEV, SKV_LAYOUT_VLLM_FLASH_HND, SKV_KV_SPLIT, 2, 3, 128, 2, 16, 16, 0},
      {4, CUDA_DEV, SKV_LAYOUT_VLLM_FLASH_HND, SKV_KV_SPLIT, 2, 3, 128, 2, 16, 16, 0},
      {2, CUDA_DEV, SKV_LAYOUT_FLASHINFER_NHD, SKV_KV_SPLIT, 2, 2, 32, 4, 32, 8, 0},
      {4, CUDA_DEV, SKV_LAYOUT_FLASHINFER_NHD, SKV_KV_SPLIT, 2, 2, 32, 4, 32, 8, 0},
      {2, CUDA_DEV, SKV_LAYOUT_FLASHINFER_HND, SKV_KV_SPLIT, 4, 1, 8, 1, 16, 4, 0},
      {4, CUDA_DEV, SKV_LAYOUT_FLASHINFER_HND, SKV_KV_SPLIT, 4, 1, 8, 1, 16, 4, 0},
      {2, CUDA_DEV, SKV_LAYOUT_MLA, SKV_KV_MLA, 3, 1, 576, 2, 16, 16, 0},
      {4, CUDA_DEV, SKV_LAYOUT_MLA, SKV_KV_MLA, 3, 1, 576, 2, 16, 16, 0},
      {2, CUDA_DEV, SKV_LAYOUT_CONTIGUOUS, SKV_KV_SPLIT, 2, 2, 16, 2, 32, 32, 0},
      {4, CUDA_DEV, SKV_LAYOUT_CONTIGUOUS, SKV_KV_SPLIT, 2, 2, 16, 2, 32, 32, 0},
      {2, CUDA_DEV, SKV_LAYOUT_CONTIGUOUS, SKV_KV_MLA, 2, 1, 72, 2, 16, 8, 0},
      {4, CUDA_DEV, SKV_LAYOUT_CONTIGUOUS, SKV_KV_MLA, 2, 1, 72, 2, 16, 8, 0},
      /* the narrow kernels: rows of 3 (1-byte vectors), 6 (2) and 4 bytes, and pages of 64
       * one-token blocks (a chunk spans more than 32 blocks: block ids loaded per vector) */
      {2, CUDA_DEV, SKV_LAYOUT_VLLM_FLASH_NHD, SKV_KV_SPLIT, 2, 3, 3, 1, 8, 2, 0},
      {2, CUDA_DEV, SKV_LAYOUT_VLLM_FLASH_HND, SKV_KV_SPLIT, 1, 2, 3, 2, 16, 4, 0},
      {2, CUDA_DEV, SKV_LAYOUT_VLLM_FLASH_NHD, SKV_KV_SPLIT, 1, 1, 2, 2, 64, 1, 0},
      /* narrow vectors whose chunks lie inside one run (one engine address per chunk): rows of
       * 12 bytes (4-byte vectors, 512-byte chunks in runs of 1.5 KiB) and of 8 bytes (a run of
       * 1 KiB is exactly one chunk), vec by default and vec only */
      {2, CUDA_DEV, SKV_LAYOUT_VLLM_FLASH_NHD, SKV_KV_SPLIT, 2, 8, 6, 2, 16, 16, 0},
      {2, CUDA_DEV, SKV_LAYOUT_VLLM_FLASH_NHD, SKV_KV_SPLIT, 2, 8, 4, 2, 16, 16, 5},
      /* a real page size: Llama-3-8B's 8 KV heads of 128, 16 tokens, 4 layers (256 KiB) */
      {2, CUDA_DEV, SKV_LAYOUT_VLLM_FLASH_NHD, SKV_KV_SPLIT, 4, 8, 128, 2, 16, 16, 0},
      /* the cuda_host tier: pages in host memory that the kernels read and write */
      {2, SKV_BACKEND_CUDA_HOST, 1, SKV_LAYOUT_VLLM_FLASH_NHD, SKV_KV_SPLIT, 3, 4, 64, 2, 32, 16,
       0},
      {4, SKV_BACKEND_CUDA_HOST, 1, SKV_LAYOUT_MLA, SKV_KV_MLA, 3, 1, 576, 2, 16, 16, 0},
      /* host engines: over GPU pages (bounced through host memory) and over cuda_host pages */
      {2, SKV_BACKEND_CUDA, 0, SKV_LAYOUT_VLLM_FLASH_HND, SKV_KV_SPLIT, 2, 3, 128, 2, 16, 16, 0},
      {2, SKV_BACKEND_CUDA_HOST, 0, SKV_LAYOUT_FLASHINFER_NHD, SKV_KV_SPLIT, 2, 2, 32, 4, 32, 8, 0},
      /* kernel variants: TMA bulk fetch (whole blocks, rows, MLA latents, from cuda_host pages;
       * rows of 8 bytes fall back to vec), arguments over PCIe or copied to the device */
      {2, CUDA_DEV, SKV_LAYOUT_VLLM_FLASH_NHD, SKV_KV_SPLIT, 4, 8, 128, 2, 16, 16, 1},
      {4, CUDA_DEV, SKV_LAYOUT_VLLM_FLASH_HND, SKV_KV_SPLIT, 2, 3, 128, 2, 16, 16, 1},
      {2, CUDA_DEV, SKV_LAYOUT_MLA, SKV_KV_MLA, 3, 1, 576, 2, 16, 16, 4},
      {2, CUDA_DEV, SKV_LAYOUT_FLASHINFER_HND, SKV_KV_SPLIT, 4, 1, 8, 1, 16, 4, 1},
      {2, SKV_BACKEND_CUDA_HOST, 1, SKV_LAYOUT_VLLM_FLASH_NHD, SKV_KV_SPLIT, 3, 4, 64, 2, 32, 16,
       1},
      {2, CUDA_DEV, SKV_LAYOUT_FLASHINFER_NHD, SKV_KV_SPLIT, 2, 2, 32, 4, 32, 8, 2},
      {4, CUDA_DEV, SKV_LAYOUT_VLLM_FLASH_NHD, SKV_KV_SPLIT, 3, 4, 64, 2, 32, 16, 3},
      /* the copy engines (runs of 8 KiB and more: whole blocks of a layer's K or V), 2 blocks per
       * page; and the same with the kernel only */
      {2, CUDA_DEV, SKV_LAYOUT_FLASHINFER_NHD, SKV_KV_SPLIT, 2, 8, 128, 2, 32, 16, 6},
      {4, CUDA_DEV, SKV_LAYOUT_VLLM_FLASH_NHD, SKV_KV_SPLIT, 4, 8, 128, 2, 16, 16, 6},
      {2, SKV_BACKEND_CUDA_HOST, 1, SKV_LAYOUT_MLA, SKV_KV_MLA, 3, 1, 576, 2, 16, 16, 6},
      {2, CUDA_DEV, SKV_LAYOUT_FLASHINFER_NHD, SKV_KV_SPLIT, 2, 8, 128, 2, 32, 16, 5},
  };
  return cr_make_param_array(rt_param_t, p, sizeof p / sizeof p[0]);
}

ParameterizedTest(rt_param_t *p, gpu_kv, round_trip_every_preset, .timeout = 240) {
  SKV_TEST_REQUIRE_GPUS(1);
  skv_test_job_t job;
  int bad = skv_test_run(&job, p->npes, pe_round_trip, p, 200000);
  cr_assert_eq(
      bad, 0, "%d PEs, backend %d, engine %s, preset %d L%u H%u D%u eb%u pt%u bt%u, variant %d: %s",
      p->npes, p->backend, p->engine_gpu ? "GPU" : "host", p->preset, p->layers, p->heads, p->dim,
      p->eb, p->pt, p->bt, p->variant, skv_test_statuses(&job));
}

Test(gpu_kv, round_trip_random_geometries, .timeout = 300) {
  SKV_TEST_REQUIRE_GPUS(1);
  uint64_t s = skv_test_seed();
  static const uint32_t dims[] = {1, 3, 8, 64, 80, 128};
  for (int iter = 0; iter < 5; iter++) {
    rt_param_t p;
    p.npes = 2;
    p.backend = SKV_BACKEND_CUDA;
    p.engine_gpu = 1;
    p.preset = 1 + (int)(skv_test_rand(&s) % 6);
    p.kind = p.preset == SKV_LAYOUT_MLA                                     ? SKV_KV_MLA
             : (p.preset == SKV_LAYOUT_CONTIGUOUS && skv_test_rand(&s) % 2) ? SKV_KV_MLA
                                                                            : SKV_KV_SPLIT;
    p.layers = 1 + (uint32_t)(skv_test_rand(&s) % 4);
    p.heads = p.kind == SKV_KV_MLA ? 1 : 1 + (uint32_t)(skv_test_rand(&s) % 4);
    p.dim = dims[skv_test_rand(&s) % 6];
    p.eb = 1u << (skv_test_rand(&s) % 3);
    p.bt = 1u << (skv_test_rand(&s) % 4);
    p.pt = p.bt * (1 + (uint32_t)(skv_test_rand(&s) % 4));
    p.variant = iter % 2 ? 4 : 0;
    skv_test_job_t job;
    int bad = skv_test_run(&job, 2, pe_round_trip, &p, 120000);
    cr_assert_eq(bad, 0, "preset %d kind %u L%u H%u D%u eb%u pt%u bt%u: %s", p.preset, p.kind,
                 p.layers, p.heads, p.dim, p.eb, p.pt, p.bt, skv_test_statuses(&job));
  }
}

/* ---- graph capture and replay ---- */

typedef struct graph_param {
  int npes, variant;
} graph_param_t;

/* The keys of pages 0..n-1 of PE `pe`: ids (pe << 32) | i. */
static void pe_keys(const skv_namespace_t *ns, int pe, uint64_t n, skv_key_t *keys) {
  for (uint64_t i = 0; i < n; i++) {
    uint64_t id = ((uint64_t)pe << 32) | i;
    skv_namespace_hash_bytes(ns, &id, sizeof id, &keys[i]);
  }
}

static int pe_graph(int rank, int npes, void *arg) {
  const graph_param_t *gp = arg;
  skv_ctx_t *ctx;
  PE_CHECK(skv_test_init(&ctx, 60000) == 0, "init");
  int dev = skv_ctx_get_device(ctx);
  PE_CHECK(dev >= 0, "device");
  PE_CHECK(set_variant(gp->variant) == 0, "variant");
  skv_geometry_t g = geom_make(SKV_KV_SPLIT, 2, 4, 64, 2, 32); /* 64 KiB pages */
  enum { NP = 4, REPLAYS = 100 };
  const uint32_t bt = 16, m = 2;
  const uint64_t nb = 64;
  skv_kv_opts_t o = SKV_KV_OPTS_INIT;
  o.backend = SKV_BACKEND_CUDA;
  o.pages_per_pe = 32;
  skv_kv_t *kv;
  PE_CHECK(skv_kv_create(ctx, &g, &o, &kv) == 0, "kv create");
  skv_namespace_t *ns;
  PE_CHECK(skv_namespace_create("graph", &g, NULL, 0, "s", 1, &ns) == 0, "ns");
  dengine_t src, dst;
  PE_CHECK(de_new(&src, &g, SKV_LAYOUT_VLLM_FLASH_NHD, bt, nb, dev) == 0, "src");
  PE_CHECK(de_new(&dst, &g, SKV_LAYOUT_VLLM_FLASH_NHD, bt, nb, dev) == 0, "dst");
  uint64_t seed = skv_test_seed();
  PE_CHECK(de_fill(&src, seed) == 0, "fill");
  skv_key_t keys[NP];
  uint64_t sblocks[NP * 2];
  pe_keys(ns, rank, NP, keys);
  for (uint32_t i = 0; i < NP * m; i++) sblocks[i] = i;
  cudaStream_t st;
  CU_OK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  size_t ins;
  PE_CHECK(skv_kv_publish(kv, ns, keys, NP, src.lay, sblocks, st, &ins) == 0 && ins == NP,
           "publish");
  PE_CHECK(skv_kv_sync(kv) == 0, "sync");
  PE_CHECK(skv_ctx_barrier(ctx) == 0, "barrier");
  int from = (rank + 1) % npes;
  pe_keys(ns, from, NP, keys);
  skv_page_ref_t refs[NP], own[NP];
  size_t nhit;
  PE_CHECK(skv_kv_lookup(kv, ns, keys, NP, SKV_LOOKUP_PIN, refs, &nhit) == 0 && nhit == NP,
           "pinned lookup");
  pe_keys(ns, rank, NP, keys);
  PE_CHECK(skv_kv_lookup(kv, ns, keys, NP, 0, own, &nhit) == 0 && nhit == NP, "unpinned lookup");
  uint64_t dblocks[NP * 2];
  uint64_t s = skv_test_seed();
  pick_blocks(nb, NP * m, dblocks, &s);

  /* what a capture refuses, each leaving the capture usable */
  cudaGraph_t graph;
  CU_OK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
  int rc = skv_kv_fetch(kv, own, NP, dst.lay, dblocks, 0, st);
  PE_CHECK(rc == SKV_ECAPTURE && strstr(skv_last_error(), "SKV_LOOKUP_PIN"),
           "unpinned refs: %s / %s", skv_err_name(rc), skv_last_error());
  rc = skv_kv_fetch(kv, refs, NP, dst.lay, dblocks, SKV_FETCH_UNPIN, st);
  PE_CHECK(rc == SKV_ECAPTURE, "SKV_FETCH_UNPIN: %s", skv_err_name(rc));
  rc = skv_kv_publish(kv, ns, keys, NP, src.lay, sblocks, st, &ins);
  PE_CHECK(rc == SKV_ECAPTURE && strstr(skv_last_error(), "evicted"), "publish: %s",
           skv_err_name(rc));
  PE_CHECK(skv_kv_fetch(kv, refs, NP, dst.lay, dblocks, 0, st) == 0, "captured fetch: %s",
           skv_last_error());
  CU_OK(cudaStreamEndCapture(st, &graph));
  cudaGraphExec_t exec;
  CU_OK(cudaGraphInstantiate(&exec, graph, 0));

  /* replays: the test changes the pages' data between replays and checks every one */
  const uint64_t pb = kv->page_bytes;
  uint8_t *pages = malloc(NP * pb);
  dengine_t want;
  PE_CHECK(de_new(&want, &g, SKV_LAYOUT_VLLM_FLASH_NHD, bt, nb, -1) == 0, "want");
  for (int r = 0; r < REPLAYS; r++) {
    skv_test_fill_random(pages, NP * pb, &s);
    for (int i = 0; i < NP; i++)
      CU_OK(cudaMemcpyAsync(skv__kv_page(kv, refs[i].pe, refs[i].page), pages + i * pb, pb,
                            cudaMemcpyHostToDevice, st));
    PE_CHECK(de_poison(&dst) == 0, "poison");
    CU_OK(cudaGraphLaunch(exec, st));
    CU_OK(cudaStreamSynchronize(st));
    PE_CHECK(de_download(&dst) == 0, "download");
    for (uint32_t l = 0; l < want.nl; l++) memset(want.host[l], 0xA5, want.layer_bytes);
    for (int i = 0; i < NP; i++)
      skv__copy_page_to_blocks(want.hlay, pages + i * pb, dblocks + i * m, false);
    for (uint32_t l = 0; l < want.nl; l++)
      PE_CHECK(memcmp(want.host[l], dst.host[l], want.layer_bytes) == 0,
               "replay %d: layer %u differs", r, l);
  }
  free(pages);
  de_free(&want);
  PE_CHECK(skv_kv_sync(kv) == 0, "no device-side error");
  CU_OK(cudaGraphExecDestroy(exec));
  CU_OK(cudaGraphDestroy(graph));

  /* every captured fetch keeps its argument slot: the 9th capture finds none */
  int ok = 0;
  for (int c = 0; c < 9; c++) {
    CU_OK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
    rc = skv_kv_fetch(kv, refs, NP, dst.lay, dblocks, 0, st);
    CU_OK(cudaStreamEndCapture(st, &graph));
    CU_OK(cudaGraphDestroy(graph));
    if (rc == 0)
      ok++;
    else
      PE_CHECK(rc == SKV_ECAPTURE && strstr(skv_last_error(), "slot"), "capture %d: %s", c,
               skv_last_error());
  }
  PE_CHECK(ok == 7, "%d more captures succeeded, expected 7 (8 graph slots, 1 taken)", ok);
  PE_CHECK(skv_kv_unpin(kv, refs, NP) == 0, "unpin");
  PE_CHECK(skv_ctx_barrier(ctx) == 0, "barrier");
  skv_kv_stats_t stats = SKV_KV_STATS_INIT;
  skv_kv_get_stats(kv, &stats);
  PE_CHECK(stats.pages_pinned == 0, "pinned %llu", (unsigned long long)stats.pages_pinned);
  CU_OK(cudaStreamDestroy(st));
  de_free(&src);
  de_free(&dst);
  skv_namespace_destroy(ns);
  PE_CHECK(skv_kv_destroy(kv) == 0, "destroy");
  PE_CHECK(skv_finalize(ctx) == 0, "finalize");
  return 0;
}

ParameterizedTestParameters(gpu_kv, graph_capture_and_replay) {
  /* arguments in the kernel parameters (captured by value), and a TMA bulk fetch whose
   * arguments are copied to the device (a memcpy node that reads the graph's slot) */
  static graph_param_t p[] = {{2, 0}, {4, 0}, {2, 4}};
  return cr_make_param_array(graph_param_t, p, sizeof p / sizeof p[0]);
}

ParameterizedTest(graph_param_t *p, gpu_kv, graph_capture_and_replay, .timeout = 240) {
  SKV_TEST_REQUIRE_GPUS(1);
  skv_test_job_t job;
  int bad = skv_test_run(&job, p->npes, pe_graph, p, 200000);
  cr_assert_eq(bad, 0, "%d PEs, variant %d: %s", p->npes, p->variant, skv_test_statuses(&job));
}

/* ---- stale and bad references ---- */

typedef struct fix {
  skv_ctx_t *ctx;
  skv_kv_t *kv;
  skv_namespace_t *ns;
  skv_geometry_t g;
  dengine_t eng;
  cudaStream_t st;
  int dev;
} fix_t;

static int fix_init(fix_t *f, uint64_t pages, uint64_t nb) {
  memset(f, 0, sizeof *f);
  if (skv_test_init(&f->ctx, 60000)) return -1;
  f->dev = skv_ctx_get_device(f->ctx);
  if (f->dev < 0) return -2;
  f->g = geom_make(SKV_KV_SPLIT, 2, 2, 64, 2, 16); /* 8 KiB pages */
  skv_kv_opts_t o = SKV_KV_OPTS_INIT;
  o.backend = SKV_BACKEND_CUDA;
  o.pages_per_pe = pages;
  if (skv_kv_create(f->ctx, &f->g, &o, &f->kv)) return -3;
  if (skv_namespace_create("fixture", &f->g, NULL, 0, "s3cret", 6, &f->ns)) return -4;
  if (cudaStreamCreateWithFlags(&f->st, cudaStreamNonBlocking) != cudaSuccess) return -5;
  return de_new(&f->eng, &f->g, SKV_LAYOUT_CONTIGUOUS, 16, nb, f->dev);
}

static void fix_fini(fix_t *f) {
  de_free(&f->eng);
  cudaStreamDestroy(f->st);
  skv_namespace_destroy(f->ns);
  skv_kv_destroy(f->kv);
  skv_finalize(f->ctx);
}

static skv_key_t key_of(const fix_t *f, uint64_t id) {
  skv_key_t k;
  skv_namespace_hash_bytes(f->ns, &id, sizeof id, &k);
  return k;
}

/* Publish ids[0..n) from blocks 0..n of the fixture's engine (filled with fresh data). */
static int publish_ids(fix_t *f, const uint64_t *ids, size_t n) {
  skv_key_t keys[64];
  uint64_t blocks[64];
  for (size_t i = 0; i < n; i++) keys[i] = key_of(f, ids[i]), blocks[i] = i;
  uint64_t s = skv_test_seed();
  if (de_fill(&f->eng, s)) return -1;
  size_t ins;
  int rc = skv_kv_publish(f->kv, f->ns, keys, n, f->eng.lay, blocks, f->st, &ins);
  if (rc) return rc;
  return skv_kv_sync(f->kv);
}

static int pe_stale(int rank, int npes, void *arg) {
  fix_t f;
  PE_CHECK(fix_init(&f, 8, 16) == 0, "fixture: %s", skv_last_error());
  skv_page_ref_t ref;
  size_t nhit;
  skv_key_t k = key_of(&f, 77);
  if (rank == 0) PE_CHECK(publish_ids(&f, (uint64_t[]){77}, 1) == 0, "publish");
  PE_CHECK(skv_ctx_barrier(f.ctx) == 0, "barrier");
  PE_CHECK(skv_kv_lookup(f.kv, f.ns, &k, 1, 0, &ref, &nhit) == 0 && nhit == 1, "lookup");
  PE_CHECK(skv_ctx_barrier(f.ctx) == 0, "barrier");
  if (rank == 0) {
    uint64_t n;
    PE_CHECK(skv_kv_evict(f.kv, 1, &n) == 0 && n == 1, "evict");
    PE_CHECK(publish_ids(&f, (uint64_t[]){78}, 1) == 0,
             "reuse"); /* the same page, next generation */
  }
  PE_CHECK(skv_ctx_barrier(f.ctx) == 0, "barrier");
  PE_CHECK(de_poison(&f.eng) == 0, "poison");
  int rc = skv_kv_fetch(f.kv, &ref, 1, f.eng.lay, (uint64_t[]){9}, 0, f.st);
  PE_CHECK(rc == SKV_ESTALE, "stale reference gives %s", skv_err_name(rc));
  PE_CHECK(strstr(skv_last_error(), "stale") != NULL, "message: %s", skv_last_error());
  CU_OK(cudaStreamSynchronize(f.st));
  PE_CHECK(skv_kv_sync(f.kv) == 0, "sync");
  PE_CHECK(de_download(&f.eng) == 0, "download");
  PE_CHECK(untouched_outside(&f.eng, NULL), "a stale fetch wrote something");
  skv_kv_stats_t st = SKV_KV_STATS_INIT;
  skv_kv_get_stats(f.kv, &st);
  PE_CHECK(st.stale == 1 && st.pages_pinned == 0, "stale %llu pinned %llu",
           (unsigned long long)st.stale, (unsigned long long)st.pages_pinned);
  PE_CHECK(skv_ctx_barrier(f.ctx) == 0, "barrier");
  fix_fini(&f);
  return 0;
}

Test(gpu_kv, stale_references_are_reported_not_read, .timeout = 120) {
  SKV_TEST_REQUIRE_GPUS(1);
  skv_test_job_t job;
  int bad = skv_test_run(&job, 2, pe_stale, NULL, 100000);
  cr_assert_eq(bad, 0, "PEs failed: %s", skv_test_statuses(&job));
}

static int pe_bad_refs(int rank, int npes, void *arg) {
  fix_t f;
  PE_CHECK(fix_init(&f, 8, 16) == 0, "fixture: %s", skv_last_error());
  PE_CHECK(publish_ids(&f, (uint64_t[]){100 + (uint64_t)rank}, 1) == 0, "publish");
  skv_key_t k = key_of(&f, 100 + (uint64_t)rank);
  skv_page_ref_t ref;
  size_t nhit;
  PE_CHECK(skv_kv_lookup(f.kv, f.ns, &k, 1, 0, &ref, &nhit) == 0 && nhit == 1, "lookup");
  PE_CHECK(de_poison(&f.eng) == 0, "poison");
  uint64_t blk = 3, big = 16;
  skv_page_ref_t bad_page = ref, bad_pe = ref, bad_gen = ref;
  bad_page.page = 8;
  bad_pe.pe = (uint32_t)npes;
  bad_gen.gen = 0;
  int rc = skv_kv_fetch(f.kv, &bad_page, 1, f.eng.lay, &blk, 0, f.st);
  PE_CHECK(rc == SKV_ERANGE && strstr(skv_last_error(), "page 8"), "page out of range: %s / %s",
           skv_err_name(rc), skv_last_error());
  PE_CHECK(skv_kv_fetch(f.kv, &bad_pe, 1, f.eng.lay, &blk, 0, f.st) == SKV_ERANGE,
           "PE out of range");
  PE_CHECK(skv_kv_fetch(f.kv, &bad_gen, 1, f.eng.lay, &blk, 0, f.st) == SKV_EINVAL, "generation 0");
  PE_CHECK(skv_kv_fetch(f.kv, &ref, 1, f.eng.lay, &big, 0, f.st) == SKV_EINVAL,
           "block id out of range");
  PE_CHECK(skv_kv_publish(f.kv, f.ns, &k, 1, f.eng.lay, &big, f.st, NULL) == SKV_EINVAL,
           "publish bad block");
  int ndev = 0;
  CU_OK(cudaGetDeviceCount(&ndev));
  if (ndev > 1) {
    skv_layout_t *other;
    void *ptrs[1] = {f.eng.dev[0]};
    PE_CHECK(skv_layout_create_preset(&f.g, SKV_LAYOUT_CONTIGUOUS, 16, 16, ptrs, (f.dev + 1) % ndev,
                                      &other) == 0,
             "layout");
    rc = skv_kv_fetch(f.kv, &ref, 1, other, &blk, 0, f.st);
    PE_CHECK(rc == SKV_EINVAL && strstr(skv_last_error(), "GPU"), "layout of another GPU: %s",
             skv_last_error());
    skv_layout_destroy(other);
  }
  CU_OK(cudaStreamSynchronize(f.st));
  PE_CHECK(skv_kv_sync(f.kv) == 0, "sync");
  PE_CHECK(de_download(&f.eng) == 0, "download");
  PE_CHECK(untouched_outside(&f.eng, NULL), "a refused fetch wrote something");
  skv_kv_stats_t st = SKV_KV_STATS_INIT;
  skv_kv_get_stats(f.kv, &st);
  PE_CHECK(st.pages_pinned == 0, "pins leaked: %llu", (unsigned long long)st.pages_pinned);
  PE_CHECK(skv_ctx_barrier(f.ctx) == 0, "barrier");
  fix_fini(&f);
  return 0;
}

Test(gpu_kv, bad_references_are_refused_on_the_host, .timeout = 120) {
  SKV_TEST_REQUIRE_GPUS(1);
  skv_test_job_t job;
  int bad = skv_test_run(&job, 2, pe_bad_refs, NULL, 100000);
  cr_assert_eq(bad, 0, "PEs failed: %s", skv_test_statuses(&job));
}

/* ---- gated fetches: the copy launched first, the pages pinned while it waits ---- */

/* Each PE publishes GF_PAGES pages of fresh data, then fetches its neighbour's (peer memory):
 * whole (every page the host reference's), with a stale reference in the middle (SKV_ESTALE:
 * the blocks of the runs before its run written and right, the others still poison), with the
 * first reference stale (nothing written), and a batch under SKV_FETCH_GATE_PAGES (not gated:
 * a stale reference leaves every block poison), and a batch on a stream still busy with earlier
 * work (gated all the same). No pin is left, and the caller's pins
 * (SKV_FETCH_UNPIN) go with a copy that succeeded and stay with one that failed. */
enum { GF_PAGES = 320, GF_RUN = 64, GF_BLOCKS = 1024 };

/* Non-NULL: gf_fetch holds the stream while it calls the fetch (a kernel waiting for this flag of
 * mapped host memory, as an engine's earlier work still running), and lets it go after. */
static uint32_t *gf_hold;

/* Fetch refs[0..n) into fresh random blocks of the poisoned engine: the call fails with
 * SKV_ESTALE when stale_at is set, skv_kv_sync returns sync_rc (once), pages [0, written) are
 * the reference's and every other block is still poison. */
static int gf_fetch(fix_t *f, dengine_t *ref, const skv_page_ref_t *refs, size_t n,
                    const uint64_t *from_blocks, uint32_t flags, size_t stale_at, size_t written,
                    int sync_rc, const char *what) {
  PE_CHECK(de_poison(&f->eng) == 0, "%s: poison", what);
  uint64_t db[GF_PAGES], s = skv_test_seed();
  pick_blocks(GF_BLOCKS, n, db, &s);
  if (gf_hold) {
    __atomic_store_n(gf_hold, 0, __ATOMIC_SEQ_CST);
    CU_OK((cudaError_t)skv__kv_gate_launch(f->st, gf_hold, 0, 20ull * 1000 * 1000 * 1000));
  }
  int rc = skv_kv_fetch(f->kv, refs, n, f->eng.lay, db, flags, f->st);
  if (gf_hold) __atomic_store_n(gf_hold, 1, __ATOMIC_SEQ_CST);
  if (stale_at == SIZE_MAX)
    PE_CHECK(rc == 0, "%s: fetch: %s", what, skv_last_error());
  else
    PE_CHECK(rc == SKV_ESTALE && strstr(skv_last_error(), "stale"), "%s: %s (%s)", what,
             skv_err_name(rc), skv_last_error());
  CU_OK(cudaStreamSynchronize(f->st));
  const int src = skv_kv_sync(f->kv);
  PE_CHECK(src == sync_rc && (sync_rc == 0 || strstr(skv_last_error(), "gated")),
           "%s: sync gave %s (%s)", what, skv_err_name(src), skv_last_error());
  if (sync_rc)
    PE_CHECK(skv_kv_sync(f->kv) == 0, "%s: the error is reported once: %s", what, skv_last_error());
  PE_CHECK(de_download(&f->eng) == 0, "%s: download", what);
  uint8_t used[GF_BLOCKS] = {0};
  for (size_t i = 0; i < written; i++) {
    PE_CHECK(pages_equal(ref, &from_blocks[i], &f->eng, &db[i]), "%s: page %zu differs", what, i);
    used[db[i]] = 1;
  }
  PE_CHECK(untouched_outside(&f->eng, used), "%s: blocks past page %zu were written", what,
           written);
  return 0;
}

/* Pages of this PE pinned by some PE once every PE is at the same step (each PE fetches its
 * neighbour's pages, so this counts the pins a neighbour holds after the step this one took). */
static uint64_t pinned_at_step(fix_t *f) {
  skv_kv_stats_t st = SKV_KV_STATS_INIT;
  if (skv_ctx_barrier(f->ctx)) return UINT64_MAX;
  skv_kv_get_stats(f->kv, &st);
  if (skv_ctx_barrier(f->ctx)) return UINT64_MAX;
  return st.pages_pinned;
}

static int pe_gated(int rank, int npes, void *arg) {
  const int variant = *(const int *)arg;
  /* whatever the environment says: gated from 256 pages, auto (vec at 5 MiB) or bulk */
  setenv("SKV_FETCH_GATE_PAGES", "256", 1);
  fix_t f;
  PE_CHECK(fix_init(&f, GF_PAGES + 16, GF_BLOCKS) == 0, "fixture: %s", skv_last_error());
  const skv__kv_variant_t autov = {SKV_KV_KERNEL_AUTO, 4, 4, 256, SKV_KV_ARGS_AUTO, 0};
  PE_CHECK((variant ? set_variant(variant) : skv__kv_variant_set(&autov)) == 0, "variant");
  dengine_t ref;
  PE_CHECK(de_new(&ref, &f.g, SKV_LAYOUT_CONTIGUOUS, 16, GF_BLOCKS, -1) == 0, "ref engine");
  /* publish GF_PAGES keys of this rank from blocks 0.. of fresh data */
  uint64_t seed = skv_test_seed(), seeds[SKV_TEST_MAX_PES];
  PE_CHECK(skv_ctx_allgather(f.ctx, &seed, seeds, sizeof seed) == 0, "seeds");
  PE_CHECK(de_fill(&f.eng, seed) == 0, "fill");
  static skv_key_t keys[GF_PAGES];
  static uint64_t blocks[GF_PAGES];
  for (uint64_t i = 0; i < GF_PAGES; i++) keys[i] = key_of(&f, (uint64_t)rank * 100000 + i);
  for (uint64_t i = 0; i < GF_PAGES; i++) blocks[i] = i;
  size_t ins = 0;
  PE_CHECK(skv_kv_publish(f.kv, f.ns, keys, GF_PAGES, f.eng.lay, blocks, f.st, &ins) == 0 &&
               ins == GF_PAGES,
           "publish: %zu: %s", ins, skv_last_error());
  PE_CHECK(skv_kv_sync(f.kv) == 0, "sync");
  PE_CHECK(skv_ctx_barrier(f.ctx) == 0, "barrier");
  /* the neighbour's pages */
  const int from = (rank + 1) % npes;
  for (uint64_t i = 0; i < GF_PAGES; i++) keys[i] = key_of(&f, (uint64_t)from * 100000 + i);
  PE_CHECK(de_fill(&ref, seeds[from]) == 0, "reference");
  static skv_page_ref_t refs[GF_PAGES], bad[GF_PAGES];
  size_t nhit;
  PE_CHECK(skv_kv_lookup(f.kv, f.ns, keys, GF_PAGES, 0, refs, &nhit) == 0 && nhit == GF_PAGES,
           "lookup %zu", nhit);
  PE_CHECK(gf_fetch(&f, &ref, refs, GF_PAGES, blocks, 0, SIZE_MAX, GF_PAGES, 0, "whole") == 0,
           "see above");
  /* pins slowed down (200 us a run): the copy starts long before the gate closes and reads
   * each run as it opens */
  skv__kv_gate_delay_us = 200;
  PE_CHECK(gf_fetch(&f, &ref, refs, GF_PAGES, blocks, 0, SIZE_MAX, GF_PAGES, 0, "slow pins") == 0,
           "see above");
  const size_t mid = 200; /* in the run [192, 256) */
  memcpy(bad, refs, sizeof refs);
  bad[mid].gen ^= 0x40000000u; /* a generation the page does not have: stale */
  PE_CHECK(gf_fetch(&f, &ref, bad, GF_PAGES, blocks, 0, mid, mid / GF_RUN * GF_RUN, 0,
                    "slow pins, stale in the middle") == 0,
           "see above");
  skv__kv_gate_delay_us = 0;
  PE_CHECK(gf_fetch(&f, &ref, bad, GF_PAGES, blocks, 0, mid, mid / GF_RUN * GF_RUN, 0,
                    "stale in the middle") == 0,
           "see above");
  memcpy(bad, refs, sizeof refs);
  bad[0].gen ^= 0x40000000u;
  PE_CHECK(gf_fetch(&f, &ref, bad, GF_PAGES, blocks, 0, 0, 0, 0, "stale first") == 0, "see above");
  memcpy(bad, refs, sizeof refs);
  bad[100].gen ^= 0x40000000u; /* 128 pages: under SKV_FETCH_GATE_PAGES, all or nothing */
  PE_CHECK(gf_fetch(&f, &ref, bad, 128, blocks, 0, 100, 0, 0, "small batch") == 0, "see above");
  /* the stream busy with earlier work: gated all the same (the copy waits behind that work and
   * for its pins), so a stale reference leaves the runs before its run written */
  CU_OK(cudaHostAlloc((void **)&gf_hold, 64, cudaHostAllocMapped));
  memcpy(bad, refs, sizeof refs);
  bad[mid].gen ^= 0x40000000u;
  PE_CHECK(gf_fetch(&f, &ref, bad, GF_PAGES, blocks, 0, mid, mid / GF_RUN * GF_RUN, 0,
                    "busy stream, stale in the middle") == 0,
           "see above");
  PE_CHECK(gf_fetch(&f, &ref, refs, GF_PAGES, blocks, 0, SIZE_MAX, GF_PAGES, 0, "busy stream") == 0,
           "see above");
  CU_OK(cudaFreeHost(gf_hold));
  gf_hold = NULL;
  skv_kv_stats_t st = SKV_KV_STATS_INIT;
  skv_kv_get_stats(f.kv, &st);
  uint64_t pinned = pinned_at_step(&f);
  PE_CHECK(st.stale == 5 && pinned == 0, "stale %llu pinned %llu", (unsigned long long)st.stale,
           (unsigned long long)pinned);
  /* a copy whose pins do not come within its time limit (50 ms here; the host sleeps 300 ms
   * after each run) gives up after the first run: the fetch returns, skv_kv_sync says
   * SKV_ETIMEDOUT, only the first run's blocks are written, and every pin goes */
  skv__kvc_gate_ms = 50;
  skv__kv_gate_delay_us = 300000;
  PE_CHECK(gf_fetch(&f, &ref, refs, GF_PAGES, blocks, 0, SIZE_MAX, GF_RUN, SKV_ETIMEDOUT,
                    "late pins") == 0,
           "see above");
  skv__kvc_gate_ms = 0;
  skv__kv_gate_delay_us = 0;
  pinned = pinned_at_step(&f);
  PE_CHECK(pinned == 0, "pins left after the late pins: %llu", (unsigned long long)pinned);
  /* the caller's pins: released with a copy that succeeded, kept with one that failed */
  PE_CHECK(skv_kv_lookup(f.kv, f.ns, keys, GF_PAGES, SKV_LOOKUP_PIN, refs, &nhit) == 0 &&
               nhit == GF_PAGES,
           "lookup and pin %zu", nhit);
  memcpy(bad, refs, sizeof refs);
  bad[mid].gen ^= 0x40000000u;
  PE_CHECK(gf_fetch(&f, &ref, bad, GF_PAGES, blocks, SKV_FETCH_UNPIN, mid, mid / GF_RUN * GF_RUN, 0,
                    "pinned, stale in the middle") == 0,
           "see above");
  pinned = pinned_at_step(&f);
  PE_CHECK(pinned == GF_PAGES, "the caller's pins after a failed fetch: %llu",
           (unsigned long long)pinned);
  PE_CHECK(gf_fetch(&f, &ref, refs, GF_PAGES, blocks, SKV_FETCH_UNPIN, SIZE_MAX, GF_PAGES, 0,
                    "pinned") == 0,
           "see above");
  pinned = pinned_at_step(&f);
  PE_CHECK(pinned == 0, "pins left after SKV_FETCH_UNPIN: %llu", (unsigned long long)pinned);
  PE_CHECK(skv_ctx_barrier(f.ctx) == 0, "barrier");
  de_free(&ref);
  fix_fini(&f);
  return 0;
}

ParameterizedTestParameters(gpu_kv, gated_fetches_read_what_is_pinned) {
  static int v[] = {0, 1}; /* auto (vec at 5 MiB), bulk */
  return cr_make_param_array(int, v, sizeof v / sizeof v[0]);
}

ParameterizedTest(int *v, gpu_kv, gated_fetches_read_what_is_pinned, .timeout = 240) {
  SKV_TEST_REQUIRE_GPUS(1);
  skv_test_job_t job;
  int bad = skv_test_run(&job, 2, pe_gated, v, 200000);
  cr_assert_eq(bad, 0, "variant %d: %s", *v, skv_test_statuses(&job));
}

/* ---- a fetch beside an engine's graph capture ---- */

/* An engine thread capturing a CUDA graph in the default (global) mode on a stream of the same GPU
 * while this thread fetches 320 pages and publishes 64 on its own stream, the copies complete and
 * skv_kv_sync waits for them: nothing of it (the look at the stream, the launches, the event
 * queries of the completion thread and of the calls) is one of the calls a global capture forbids
 * to other threads, which would invalidate the engine's graph. */
typedef struct cap_beside {
  int dev, state; /* state: 1 capturing, 2 the fetch is done (atomic) */
  cudaStream_t s;
  void *buf;
  cudaError_t begin, end;
} cap_beside_t;

static void *cap_beside_main(void *arg) {
  cap_beside_t *c = arg;
  (void)cudaSetDevice(c->dev);
  c->begin = cudaStreamBeginCapture(c->s, cudaStreamCaptureModeGlobal);
  if (c->begin == cudaSuccess) (void)cudaMemsetAsync(c->buf, 7, 256, c->s);
  __atomic_store_n(&c->state, 1, __ATOMIC_SEQ_CST);
  while (__atomic_load_n(&c->state, __ATOMIC_SEQ_CST) != 2) usleep(1000);
  cudaGraph_t g = NULL;
  c->end = c->begin == cudaSuccess ? cudaStreamEndCapture(c->s, &g) : c->begin;
  if (g) (void)cudaGraphDestroy(g);
  return NULL;
}

static int pe_capture_beside(int rank, int npes, void *arg) {
  (void)rank, (void)npes, (void)arg;
  fix_t f;
  PE_CHECK(fix_init(&f, GF_PAGES + 16, GF_BLOCKS) == 0, "fixture: %s", skv_last_error());
  dengine_t ref;
  PE_CHECK(de_new(&ref, &f.g, SKV_LAYOUT_CONTIGUOUS, 16, GF_BLOCKS, -1) == 0, "ref engine");
  const uint64_t seed = skv_test_seed();
  PE_CHECK(de_fill(&f.eng, seed) == 0 && de_fill(&ref, seed) == 0, "fill");
  static skv_key_t keys[GF_PAGES];
  static uint64_t blocks[GF_PAGES];
  static skv_page_ref_t refs[GF_PAGES];
  for (uint64_t i = 0; i < GF_PAGES; i++) keys[i] = key_of(&f, 500000 + i), blocks[i] = i;
  size_t ins = 0, nhit = 0;
  PE_CHECK(skv_kv_publish(f.kv, f.ns, keys, GF_PAGES, f.eng.lay, blocks, f.st, &ins) == 0 &&
               ins == GF_PAGES && skv_kv_sync(f.kv) == 0,
           "publish: %zu: %s", ins, skv_last_error());
  PE_CHECK(skv_kv_lookup(f.kv, f.ns, keys, GF_PAGES, 0, refs, &nhit) == 0 && nhit == GF_PAGES,
           "lookup %zu", nhit);
  PE_CHECK(de_poison(&f.eng) == 0, "poison");
  CU_OK(cudaStreamSynchronize(f.st));
  uint64_t db[GF_PAGES], s2 = seed;
  pick_blocks(GF_BLOCKS, GF_PAGES, db, &s2);
  cap_beside_t c = {.dev = f.dev};
  CU_OK(cudaStreamCreateWithFlags(&c.s, cudaStreamNonBlocking));
  CU_OK(cudaMalloc(&c.buf, 256));
  pthread_t th;
  PE_CHECK(pthread_create(&th, NULL, cap_beside_main, &c) == 0, "capture thread");
  while (__atomic_load_n(&c.state, __ATOMIC_SEQ_CST) != 1) usleep(1000);
  const int rc = skv_kv_fetch(f.kv, refs, GF_PAGES, f.eng.lay, db, 0, f.st);
  usleep(100 * 1000); /* the copy completes, and the completion thread sees it */
  /* 64 fresh keys from blocks the fetch does not write (its blocks: db), then the sync */
  enum { NPUB = 64 };
  static skv_key_t pkeys[NPUB];
  uint64_t pblocks[NPUB];
  uint8_t taken[GF_BLOCKS] = {0};
  for (size_t i = 0; i < GF_PAGES; i++) taken[db[i]] = 1;
  size_t np = 0;
  for (uint64_t b = 0; b < GF_BLOCKS && np < NPUB; b++)
    if (!taken[b]) pkeys[np] = key_of(&f, 600000 + b), pblocks[np++] = b;
  size_t pins = 0;
  const int prc = skv_kv_publish(f.kv, f.ns, pkeys, np, f.eng.lay, pblocks, f.st, &pins);
  const int src = skv_kv_sync(f.kv);
  __atomic_store_n(&c.state, 2, __ATOMIC_SEQ_CST);
  pthread_join(th, NULL);
  PE_CHECK(rc == 0, "fetch during the capture: %s", skv_last_error());
  PE_CHECK(prc == 0 && pins == NPUB && src == 0,
           "publish (%d, %zu queued) and sync (%d) during the capture", prc, pins, src);
  PE_CHECK(skv_kv_lookup(f.kv, f.ns, pkeys, NPUB, 0, refs, &nhit) == 0 && nhit == NPUB,
           "the keys published during the capture: %zu found", nhit);
  PE_CHECK(c.begin == cudaSuccess, "begin capture: %s", cudaGetErrorString(c.begin));
  PE_CHECK(c.end == cudaSuccess, "the engine's capture was broken by the fetch beside it: %s",
           cudaGetErrorName(c.end));
  CU_OK(cudaStreamSynchronize(f.st));
  PE_CHECK(skv_kv_sync(f.kv) == 0, "sync: %s", skv_last_error());
  PE_CHECK(de_download(&f.eng) == 0, "download");
  for (size_t i = 0; i < GF_PAGES; i++)
    PE_CHECK(pages_equal(&ref, &blocks[i], &f.eng, &db[i]), "page %zu differs", i);
  CU_OK(cudaFree(c.buf));
  CU_OK(cudaStreamDestroy(c.s));
  de_free(&ref);
  fix_fini(&f);
  return 0;
}

Test(gpu_kv, a_fetch_beside_an_engines_graph_capture_leaves_it_valid, .timeout = 120) {
  SKV_TEST_REQUIRE_GPUS(1);
  skv_test_job_t job;
  int bad = skv_test_run(&job, 1, pe_capture_beside, NULL, 100000);
  cr_assert_eq(bad, 0, "%s", skv_test_statuses(&job));
}

/* ---- the device-side checks, through the kernel wrapper with bad descriptors ---- */

enum { DC_PAGES = 4, DC_BLOCKS = 8, DC_GUARD = 65536, DC_BIG_REFS = 4096 };

typedef struct dcheck {
  uint8_t *heap, *eng;            /* device: [pages | guard], [blocks | guard] */
  uint8_t *args;                  /* device: the argument block (bases, one ref, two block ids) */
  uint8_t host[DC_BIG_REFS + 16]; /* its host copy (the ref at 16, or at DC_BIG_REFS) */
  uint32_t *err;                  /* host-mapped */
  size_t heap_bytes, eng_bytes;
  skv__kv_copy_desc_t d;
  skv__kv_copy_cfg_t cfg;
} dcheck_t;

/* Pages of 2 tensors x 4 tokens x 1 head x 64 bytes, blocks of bt tokens (CONTIGUOUS-like:
 * runs of bt x 64 bytes, so the bulk kernel takes them; with bt = 4 a run is a whole slab, and
 * the vec kernels take a chunk's one engine address). */
static int dc_setup(dcheck_t *c, uint32_t bt) {
  const uint32_t row = 64, pt = 4, nt = 2;
  const uint64_t page = (uint64_t)nt * pt * row, block = (uint64_t)nt * bt * row;
  c->heap_bytes = DC_PAGES * page + DC_GUARD;
  c->eng_bytes = DC_BLOCKS * block + DC_GUARD;
  if (cudaMalloc((void **)&c->heap, c->heap_bytes) || cudaMalloc((void **)&c->eng, c->eng_bytes) ||
      cudaMalloc((void **)&c->args, sizeof c->host) ||
      cudaHostAlloc((void **)&c->err, 16, cudaHostAllocMapped))
    return -1;
  uint64_t bases[2] = {(uint64_t)(uintptr_t)c->eng,
                       (uint64_t)(uintptr_t)(c->eng + (uint64_t)bt * row)};
  memcpy(c->host, bases, sizeof bases);
  memset(&c->d, 0, sizeof c->d);
  skv__kv_copy_desc_t *d = &c->d;
  d->width = 16;
  d->heap = (uint64_t)(uintptr_t)c->heap;
  d->pe_stride = c->heap_bytes;
  d->page_stride = page;
  d->npes = 1;
  d->pages_per_pe = DC_PAGES;
  d->ntensors = nt;
  d->heads = 1;
  d->row_bytes = row;
  d->page_tokens = pt;
  d->block_tokens = bt;
  d->blocks_per_page = pt / bt;
  d->run_bytes = bt * row;
  d->num_blocks = DC_BLOCKS;
  d->stride_block = (int64_t)block;
  d->stride_token = row;
  d->stride_head = row;
  d->n = 1;
  d->refs_off = 16;
  d->bids_off = 24;
  d->args_bytes = 32;
  d->args_dev = c->args;
  d->err = c->err;
  c->cfg.unroll = 8;
  c->cfg.ctas_per_sm = 2;
  c->cfg.threads = 256;
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return -3;
  return cudaDeviceGetAttribute(&c->cfg.sms, cudaDevAttrMultiProcessorCount, dev) == cudaSuccess
             ? 0
             : -4;
}

/* Run one batch of one page: ref (pe, page), block ids (b0, b1), direction, with the arguments
 * read from device memory (mode 0), from the kernel parameters (1: the vec kernel's tiny ones),
 * or the bulk kernel (2), modes 1 and 2 again with an argument block over
 * SKV_KV_COPY_INLINE_BYTES (3 and 4: the ref at DC_BIG_REFS, the kernels with big parameters),
 * and the vec kernel with its small parameters (5: the ref at 1024); buffers are reset to known
 * bytes first (heap 0x11 + guard 0x22, engine 0x33 + guard 0x44). */
static int dc_run(dcheck_t *c, int mode, int dir, uint32_t pe, uint32_t page, uint32_t b0,
                  uint32_t b1, uint32_t *err) {
  uint32_t a[4] = {pe, page, b0, b1};
  const uint32_t refs = mode == 3 || mode == 4 ? DC_BIG_REFS : mode == 5 ? 1024 : 16;
  memset(c->host + 16, 0xee, sizeof c->host - 16);
  memcpy(c->host + refs, a, sizeof a);
  c->d.refs_off = refs;
  c->d.bids_off = refs + 8;
  c->d.args_bytes = refs + 16;
  memset(c->err, 0, 16);
  if (cudaMemcpy(c->args, c->host, sizeof c->host, cudaMemcpyHostToDevice) ||
      cudaMemset(c->heap, 0x11, c->heap_bytes - DC_GUARD) ||
      cudaMemset(c->heap + c->heap_bytes - DC_GUARD, 0x22, DC_GUARD) ||
      cudaMemset(c->eng, 0x33, c->eng_bytes - DC_GUARD) ||
      cudaMemset(c->eng + c->eng_bytes - DC_GUARD, 0x44, DC_GUARD) || cudaDeviceSynchronize())
    return -1;
  c->d.dir = dir;
  c->d.args_host = mode ? c->host : NULL;
  c->d.args_dev = mode ? NULL : c->args; /* inline modes: a read of args_dev would fault */
  c->cfg.args = mode ? SKV_KV_ARGS_AUTO : SKV_KV_ARGS_DEVICE;
  c->cfg.kernel = mode == 2 || mode == 4 ? SKV_KV_KERNEL_BULK : SKV_KV_KERNEL_VEC;
  const char *kn = skv__kv_copy_kernel_name(&c->d, &c->cfg);
  if ((mode == 3 || mode == 4) != (strstr(kn, "16 KiB parameters") != NULL) ||
      (mode == 1) != (strstr(kn, "512 B parameters") != NULL) ||
      (mode == 2 || mode == 4) != (strstr(kn, "bulk") != NULL))
    return -3; /* not the kernel this mode is about */
  if (skv__kv_copy_launch(&c->d, &c->cfg, NULL) != 0 || cudaDeviceSynchronize() != cudaSuccess)
    return -2;
  memcpy(err, c->err, 16);
  return 0;
}

/* Count bytes of [p, p + n) on the device that differ from `v`. */
static size_t dc_count_not(const uint8_t *p, size_t n, uint8_t v) {
  uint8_t *h = malloc(n);
  size_t bad = 0;
  if (cudaMemcpy(h, p, n, cudaMemcpyDeviceToHost) != cudaSuccess)
    bad = n;
  else
    for (size_t i = 0; i < n; i++) bad += h[i] != v;
  free(h);
  return bad;
}

static int pe_device_checks(int rank, int npes, void *arg) {
  skv_ctx_t *ctx;
  PE_CHECK(skv_test_init(&ctx, 60000) == 0, "init");
  PE_CHECK(skv_ctx_get_device(ctx) >= 0, "device");
  dcheck_t c;
  memset(&c, 0, sizeof c);
  PE_CHECK(dc_setup(&c, 2) == 0, "setup");
  const size_t pages = c.heap_bytes - DC_GUARD, blocks = c.eng_bytes - DC_GUARD;
  uint32_t err[4];
  int drv = 0;
  PE_CHECK(cudaDriverGetVersion(&drv) == cudaSuccess, "driver version");
  for (int mode = 0; mode < 6; mode++) {
    if ((mode == 3 || mode == 4) && drv < 12010) continue; /* no parameters over 4 KiB */
    /* a valid batch: the reference run, so that the checks below prove something */
    PE_CHECK(dc_run(&c, mode, SKV_KV_COPY_FETCH, 0, 1, 2, 5, err) == 0 && err[0] == 0,
             "mode %d: valid fetch: err %u", mode, err[0]);
    PE_CHECK(dc_count_not(c.eng, blocks, 0x33) == 2 * 256,
             "mode %d: a valid fetch writes 2 blocks of 256 bytes", mode);
    /* fetch of a page beyond the heap (it would read the guard): nothing written, error set */
    PE_CHECK(dc_run(&c, mode, SKV_KV_COPY_FETCH, 0, DC_PAGES, 2, 5, err) == 0, "run");
    PE_CHECK(err[0] == SKV_KV_DEVERR_PAGE && err[3] == DC_PAGES, "mode %d: page check: err %u/%u",
             mode, err[0], err[3]);
    PE_CHECK(dc_count_not(c.eng, c.eng_bytes - DC_GUARD, 0x33) == 0,
             "mode %d: a refused page was copied", mode);
    PE_CHECK(dc_count_not(c.eng + blocks, DC_GUARD, 0x44) == 0, "mode %d: engine guard touched",
             mode);
    /* a PE that does not exist */
    PE_CHECK(dc_run(&c, mode, SKV_KV_COPY_FETCH, 1, 0, 2, 5, err) == 0, "run");
    PE_CHECK(err[0] == SKV_KV_DEVERR_PE && err[3] == 1, "mode %d: PE check: err %u/%u", mode,
             err[0], err[3]);
    PE_CHECK(dc_count_not(c.eng, c.eng_bytes, 0x33) == DC_GUARD, "mode %d: a refused PE was copied",
             mode);
    /* a block id beyond the engine (its address lies in the guard): that block skipped only */
    PE_CHECK(dc_run(&c, mode, SKV_KV_COPY_FETCH, 0, 1, 2, DC_BLOCKS, err) == 0, "run");
    PE_CHECK(err[0] == SKV_KV_DEVERR_BLOCK && err[3] == DC_BLOCKS,
             "mode %d: block check: err %u/%u", mode, err[0], err[3]);
    PE_CHECK(dc_count_not(c.eng + blocks, DC_GUARD, 0x44) == 0,
             "mode %d: engine guard touched by a bad block id", mode);
    PE_CHECK(dc_count_not(c.eng, blocks, 0x33) == 256,
             "mode %d: the good block of the page is still copied", mode);
    if (mode == 2 || mode == 4) continue; /* the bulk kernel only fetches */
    /* publish into a page beyond the heap: the heap guard stays */
    PE_CHECK(dc_run(&c, mode, SKV_KV_COPY_PUBLISH, 0, DC_PAGES, 2, 5, err) == 0, "run");
    PE_CHECK(err[0] == SKV_KV_DEVERR_PAGE, "mode %d: publish page check: err %u", mode, err[0]);
    PE_CHECK(dc_count_not(c.heap + pages, DC_GUARD, 0x22) == 0,
             "mode %d: heap guard touched by a publish", mode);
    PE_CHECK(dc_count_not(c.heap, pages, 0x11) == 0,
             "mode %d: heap pages touched by a refused publish", mode);
    /* publish from a block beyond the engine: that part of the page is not written */
    PE_CHECK(dc_run(&c, mode, SKV_KV_COPY_PUBLISH, 0, 2, DC_BLOCKS + 100, 5, err) == 0, "run");
    PE_CHECK(err[0] == SKV_KV_DEVERR_BLOCK, "mode %d: publish block check: err %u", mode, err[0]);
    PE_CHECK(dc_count_not(c.heap, pages, 0x11) == 256,
             "mode %d: only the good block's half of the page is written", mode);
    PE_CHECK(dc_count_not(c.heap + pages, DC_GUARD, 0x22) == 0, "mode %d: heap guard touched",
             mode);
  }
  cudaFree(c.heap);
  cudaFree(c.eng);
  cudaFree(c.args);
  cudaFreeHost(c.err);

  /* one block per page (a run is the whole slab): the vec kernels' path for a chunk inside one
   * run refuses a bad block as the per-vector path does, with all of the page's bytes skipped */
  memset(&c, 0, sizeof c);
  PE_CHECK(dc_setup(&c, 4) == 0, "setup, one block per page");
  for (int mode = 0; mode < 6; mode += mode == 1 ? 2 : mode == 3 ? 2 : 1) { /* 0, 1, 3, 5: vec */
    if (mode == 3 && drv < 12010) continue;
    PE_CHECK(dc_run(&c, mode, SKV_KV_COPY_FETCH, 0, 1, 2, 0, err) == 0 && err[0] == 0,
             "one run, mode %d: valid fetch: err %u", mode, err[0]);
    PE_CHECK(dc_count_not(c.eng, c.eng_bytes - DC_GUARD, 0x33) == 2 * 256,
             "one run, mode %d: a valid fetch writes the block's 2 x 256 bytes", mode);
    PE_CHECK(dc_run(&c, mode, SKV_KV_COPY_FETCH, 0, 1, DC_BLOCKS, 0, err) == 0, "run");
    PE_CHECK(err[0] == SKV_KV_DEVERR_BLOCK && err[3] == DC_BLOCKS,
             "one run, mode %d: block check: err %u/%u", mode, err[0], err[3]);
    PE_CHECK(dc_count_not(c.eng, c.eng_bytes, 0x33) == DC_GUARD,
             "one run, mode %d: a bad block id wrote something", mode);
    PE_CHECK(dc_run(&c, mode, SKV_KV_COPY_PUBLISH, 0, 2, 3, 0, err) == 0 && err[0] == 0,
             "one run, mode %d: valid publish: err %u", mode, err[0]);
    PE_CHECK(dc_count_not(c.heap, c.heap_bytes - DC_GUARD, 0x11) == 2 * 256,
             "one run, mode %d: a valid publish writes the page's 2 x 256 bytes", mode);
    PE_CHECK(dc_run(&c, mode, SKV_KV_COPY_PUBLISH, 0, 2, DC_BLOCKS + 7, 0, err) == 0, "run");
    PE_CHECK(err[0] == SKV_KV_DEVERR_BLOCK && err[3] == DC_BLOCKS + 7,
             "one run, mode %d: publish block check: err %u/%u", mode, err[0], err[3]);
    PE_CHECK(dc_count_not(c.heap, c.heap_bytes, 0x11) == DC_GUARD,
             "one run, mode %d: a refused publish wrote something", mode);
  }
  cudaFree(c.heap);
  cudaFree(c.eng);
  cudaFree(c.args);
  cudaFreeHost(c.err);

  /* a cache reports its kernels' refusals at skv_kv_sync, once */
  skv_geometry_t g = geom_make(SKV_KV_SPLIT, 1, 1, 32, 2, 2);
  skv_kv_opts_t o = SKV_KV_OPTS_INIT;
  o.backend = SKV_BACKEND_CUDA;
  o.pages_per_pe = 4;
  skv_kv_t *kv;
  PE_CHECK(skv_kv_create(ctx, &g, &o, &kv) == 0, "kv");
  uint32_t *ew = skv__kvc_err_word(kv->cuda);
  PE_CHECK(ew != NULL, "error word");
  ew[1] = 3, ew[2] = 1, ew[3] = 99, ew[0] = SKV_KV_DEVERR_PAGE; /* as a kernel would */
  int rc = skv_kv_sync(kv);
  PE_CHECK(rc == SKV_ERANGE && strstr(skv_last_error(), "page 99"), "sync reports: %s / %s",
           skv_err_name(rc), skv_last_error());
  PE_CHECK(skv_kv_sync(kv) == 0 && ew[0] == 0, "reported once");
  PE_CHECK(skv_kv_destroy(kv) == 0, "destroy");
  PE_CHECK(skv_finalize(ctx) == 0, "finalize");
  return 0;
}

Test(gpu_kv, device_side_checks_touch_nothing_outside, .timeout = 120) {
  SKV_TEST_REQUIRE_GPUS(1);
  skv_test_job_t job;
  int bad = skv_test_run(&job, 1, pe_device_checks, NULL, 100000);
  cr_assert_eq(bad, 0, "PE failed: %s", skv_test_statuses(&job));
}

/* ---- large batches (several launches) and many fetches in flight ---- */

static int pe_large(int rank, int npes, void *arg) {
  skv_ctx_t *ctx;
  PE_CHECK(skv_test_init(&ctx, 60000) == 0, "init");
  int dev = skv_ctx_get_device(ctx);
  PE_CHECK(dev >= 0, "device");
  skv_geometry_t g = geom_make(SKV_KV_SPLIT, 1, 1, 16, 2, 4); /* 256-byte pages */
  enum { N = 5000, BURST = 40, PER = 16 };
  skv_kv_opts_t o = SKV_KV_OPTS_INIT;
  o.backend = SKV_BACKEND_CUDA;
  o.pages_per_pe = N + 8;
  skv_kv_t *kv;
  PE_CHECK(skv_kv_create(ctx, &g, &o, &kv) == 0, "kv");
  skv_namespace_t *ns;
  PE_CHECK(skv_namespace_create("large", &g, NULL, 0, "s", 1, &ns) == 0, "ns");
  dengine_t src, dst, ref;
  PE_CHECK(de_new(&src, &g, SKV_LAYOUT_VLLM_FLASH_NHD, 4, N, dev) == 0, "src");
  PE_CHECK(de_new(&dst, &g, SKV_LAYOUT_VLLM_FLASH_NHD, 4, N, dev) == 0, "dst");
  PE_CHECK(de_new(&ref, &g, SKV_LAYOUT_VLLM_FLASH_NHD, 4, N, -1) == 0, "ref");
  uint64_t seed = skv_test_seed(), seeds[SKV_TEST_MAX_PES];
  PE_CHECK(skv_ctx_allgather(ctx, &seed, seeds, sizeof seed) == 0, "seeds");
  PE_CHECK(de_fill(&src, seed) == 0, "fill");
  skv_key_t *keys = malloc(N * sizeof *keys);
  uint64_t *blocks = malloc(N * sizeof *blocks), *dblocks = malloc(N * sizeof *dblocks);
  skv_page_ref_t *refs = malloc(N * sizeof *refs);
  pe_keys(ns, rank, N, keys);
  for (uint64_t i = 0; i < N; i++) blocks[i] = (i * 7919) % N; /* a permutation */
  cudaStream_t st;
  CU_OK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  size_t ins;
  PE_CHECK(skv_kv_publish(kv, ns, keys, N, src.lay, blocks, st, &ins) == 0 && ins == N,
           "publish %zu", ins);
  PE_CHECK(skv_kv_sync(kv) == 0, "sync");
  PE_CHECK(skv_ctx_barrier(ctx) == 0, "barrier");
  int from = (rank + 1) % npes;
  pe_keys(ns, from, N, keys);
  for (uint64_t i = 0; i < N; i++) dblocks[i] = (i * 104729 + 13) % N;
  size_t nhit;
  PE_CHECK(skv_kv_lookup(kv, ns, keys, N, 0, refs, &nhit) == 0 && nhit == N, "lookup %zu", nhit);
  PE_CHECK(de_fill(&ref, seeds[from]) == 0, "ref");
  uint64_t fblocks[N];
  for (uint64_t i = 0; i < N; i++) fblocks[i] = (i * 7919) % N; /* the publisher's blocks */
  /* one call of 5000 pages: more than one launch */
  PE_CHECK(de_poison(&dst) == 0, "poison");
  PE_CHECK(skv_kv_fetch(kv, refs, N, dst.lay, dblocks, 0, st) == 0, "large fetch");
  CU_OK(cudaStreamSynchronize(st));
  PE_CHECK(skv_kv_sync(kv) == 0, "sync");
  PE_CHECK(de_download(&dst) == 0, "download");
  for (uint64_t i = 0; i < N; i++)
    PE_CHECK(pages_equal(&ref, &fblocks[i], &dst, &dblocks[i]), "page %llu differs",
             (unsigned long long)i);
  /* the same of this PE's own pages: a local batch, its arguments copied to the GPU first */
  skv_page_ref_t *own = malloc(N * sizeof *own);
  pe_keys(ns, rank, N, keys);
  PE_CHECK(skv_kv_lookup(kv, ns, keys, N, 0, own, &nhit) == 0 && nhit == N, "own lookup %zu", nhit);
  for (uint64_t i = 0; i < N; i++)
    PE_CHECK(own[i].pe == (uint32_t)rank, "own page on PE %u", own[i].pe);
  PE_CHECK(de_fill(&ref, seed) == 0, "ref");
  PE_CHECK(de_poison(&dst) == 0, "poison");
  PE_CHECK(skv_kv_fetch(kv, own, N, dst.lay, dblocks, 0, st) == 0, "large local fetch");
  CU_OK(cudaStreamSynchronize(st));
  PE_CHECK(skv_kv_sync(kv) == 0, "sync");
  PE_CHECK(de_download(&dst) == 0, "download");
  for (uint64_t i = 0; i < N; i++)
    PE_CHECK(pages_equal(&ref, &fblocks[i], &dst, &dblocks[i]), "own page %llu differs",
             (unsigned long long)i);
  free(own);
  PE_CHECK(de_fill(&ref, seeds[from]) == 0, "ref");
  /* many small fetches back to back: more than the argument slots, nothing synchronised */
  PE_CHECK(de_poison(&dst) == 0, "poison");
  for (int b = 0; b < BURST; b++)
    PE_CHECK(skv_kv_fetch(kv, refs + b * PER, PER, dst.lay, dblocks + b * PER, 0, st) == 0,
             "burst %d", b);
  CU_OK(cudaStreamSynchronize(st));
  PE_CHECK(skv_kv_sync(kv) == 0, "sync");
  PE_CHECK(de_download(&dst) == 0, "download");
  for (uint64_t i = 0; i < BURST * PER; i++)
    PE_CHECK(pages_equal(&ref, &fblocks[i], &dst, &dblocks[i]), "burst page %llu differs",
             (unsigned long long)i);
  PE_CHECK(skv_ctx_barrier(ctx) == 0, "barrier");
  skv_kv_stats_t stats = SKV_KV_STATS_INIT;
  skv_kv_get_stats(kv, &stats);
  PE_CHECK(stats.pages_pinned == 0, "pinned %llu", (unsigned long long)stats.pages_pinned);
  free(keys);
  free(blocks);
  free(dblocks);
  free(refs);
  CU_OK(cudaStreamDestroy(st));
  de_free(&src);
  de_free(&dst);
  de_free(&ref);
  skv_namespace_destroy(ns);
  PE_CHECK(skv_kv_destroy(kv) == 0, "destroy");
  PE_CHECK(skv_finalize(ctx) == 0, "finalize");
  return 0;
}

Test(gpu_kv, large_batches_and_many_in_flight, .timeout = 180) {
  SKV_TEST_REQUIRE_GPUS(1);
  skv_test_job_t job;
  int bad = skv_test_run(&job, 2, pe_large, NULL, 150000);
  cr_assert_eq(bad, 0, "PEs failed: %s", skv_test_statuses(&job));
}

/* ---- a publish of several windows: each launch after the first may begin while the one before
 * it ends (programmatic dependent launch); every page is written, no key shows before its copy
 * ran ---- */

static int pe_follow(int rank, int npes, void *arg) {
  (void)npes, (void)arg;
  skv_ctx_t *ctx;
  PE_CHECK(skv_test_init(&ctx, 60000) == 0, "init");
  int dev = skv_ctx_get_device(ctx);
  PE_CHECK(dev >= 0, "device");
  /* 16 KiB pages; 1100 keys: 4 windows of 275, whose arguments (3.3 KiB) go in the kernel
   * parameters, so that nothing but their events comes between the launches: the dependent
   * launches run (their copies are checked byte by byte here; that a launch's completion waits
   * for its copy, split_probe.cu checks in plain CUDA) */
  skv_geometry_t g = geom_make(SKV_KV_SPLIT, 2, 2, 64, 2, 16);
  enum { N = 1100 };
  skv_kv_opts_t o = SKV_KV_OPTS_INIT;
  o.backend = SKV_BACKEND_CUDA;
  o.pages_per_pe = N + 8;
  skv_kv_t *kv;
  PE_CHECK(skv_kv_create(ctx, &g, &o, &kv) == 0, "kv: %s", skv_last_error());
  skv_namespace_t *ns;
  PE_CHECK(skv_namespace_create("follow", &g, NULL, 0, "s", 1, &ns) == 0, "ns");
  dengine_t src, dst, ref;
  PE_CHECK(de_new(&src, &g, SKV_LAYOUT_VLLM_FLASH_NHD, 16, N, dev) == 0, "src");
  PE_CHECK(de_new(&dst, &g, SKV_LAYOUT_VLLM_FLASH_NHD, 16, N, dev) == 0, "dst");
  PE_CHECK(de_new(&ref, &g, SKV_LAYOUT_VLLM_FLASH_NHD, 16, N, -1) == 0, "ref");
  const uint64_t seed = skv_test_seed();
  PE_CHECK(de_fill(&src, seed) == 0 && de_fill(&ref, seed) == 0, "fill");
  static skv_key_t keys[N];
  static uint64_t blocks[N], dblocks[N];
  static skv_page_ref_t refs[N];
  pe_keys(ns, rank, N, keys);
  for (uint64_t i = 0; i < N; i++) {
    blocks[i] = (i * 7919 + seed) % N; /* permutations */
    dblocks[i] = (i * 104729 + 13) % N;
  }
  cudaStream_t st;
  CU_OK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  uint32_t *flag;
  CU_OK(cudaHostAlloc((void **)&flag, 64, cudaHostAllocMapped));
  __atomic_store_n(flag, 0, __ATOMIC_SEQ_CST);
  /* the launches queue behind a held stream, so that they run back to back */
  CU_OK((cudaError_t)skv__kv_gate_launch(st, flag, 0, 20ull * 1000 * 1000 * 1000));
  size_t queued = 0, nhit = 0;
  PE_CHECK(skv_kv_publish(kv, ns, keys, N, src.lay, blocks, st, &queued) == 0 && queued == N,
           "publish: %zu queued (%s)", queued, skv_last_error());
  usleep(50 * 1000);
  PE_CHECK(skv_kv_lookup(kv, ns, keys, N, 0, refs, &nhit) == 0 && nhit == 0,
           "%zu keys found before their copies ran", nhit);
  __atomic_store_n(flag, 1, __ATOMIC_SEQ_CST);
  PE_CHECK(skv_kv_sync(kv) == 0, "sync: %s", skv_last_error());
  PE_CHECK(skv_kv_lookup(kv, ns, keys, N, 0, refs, &nhit) == 0 && nhit == N, "lookup %zu", nhit);
  PE_CHECK(de_poison(&dst) == 0, "poison");
  PE_CHECK(skv_kv_fetch(kv, refs, N, dst.lay, dblocks, 0, st) == 0, "fetch: %s", skv_last_error());
  CU_OK(cudaStreamSynchronize(st));
  PE_CHECK(skv_kv_sync(kv) == 0, "sync");
  PE_CHECK(de_download(&dst) == 0, "download");
  for (uint64_t i = 0; i < N; i++)
    PE_CHECK(pages_equal(&ref, &blocks[i], &dst, &dblocks[i]), "page %llu differs",
             (unsigned long long)i);
  cudaFreeHost(flag);
  CU_OK(cudaStreamDestroy(st));
  de_free(&src);
  de_free(&dst);
  de_free(&ref);
  skv_namespace_destroy(ns);
  PE_CHECK(skv_kv_destroy(kv) == 0, "destroy");
  PE_CHECK(skv_finalize(ctx) == 0, "finalize");
  return 0;
}

Test(gpu_kv, publish_windows_launched_back_to_back_write_every_page, .timeout = 120) {
  SKV_TEST_REQUIRE_GPUS(1);
  skv_test_job_t job;
  int bad = skv_test_run(&job, 1, pe_follow, NULL, 100000);
  cr_assert_eq(bad, 0, "PEs failed: %s", skv_test_statuses(&job));
}

/* ---- pins and keys wait for the copy: a held stream keeps them until it ran ---- */

static int pe_wait_copy(int rank, int npes, void *arg) {
  (void)rank, (void)npes, (void)arg;
  fix_t f;
  PE_CHECK(fix_init(&f, 16, 16) == 0, "fixture: %s", skv_last_error());
  const uint64_t ids[4] = {500, 501, 502, 503};
  PE_CHECK(publish_ids(&f, ids, 4) == 0, "publish: %s", skv_last_error());
  skv_key_t keys[4], nk = key_of(&f, 600);
  skv_page_ref_t refs[4], nref;
  size_t nhit, queued;
  for (int i = 0; i < 4; i++) keys[i] = key_of(&f, ids[i]);
  PE_CHECK(skv_kv_lookup(f.kv, f.ns, keys, 4, 0, refs, &nhit) == 0 && nhit == 4, "lookup");
  uint32_t *flag;
  CU_OK(cudaHostAlloc((void **)&flag, 64, cudaHostAllocMapped));
  __atomic_store_n(flag, 0, __ATOMIC_SEQ_CST);
  /* the stream waits for the flag (20 s at most) */
  CU_OK((cudaError_t)skv__kv_gate_launch(f.st, flag, 0, 20ull * 1000 * 1000 * 1000));
  PE_CHECK(skv_kv_fetch(f.kv, refs, 4, f.eng.lay, (uint64_t[]){8, 9, 10, 11}, 0, f.st) == 0,
           "fetch: %s", skv_last_error());
  PE_CHECK(skv_kv_publish(f.kv, f.ns, &nk, 1, f.eng.lay, (uint64_t[]){12}, f.st, &queued) == 0 &&
               queued == 1,
           "publish: %s", skv_last_error());
  usleep(100 * 1000);
  skv_kv_stats_t st = SKV_KV_STATS_INIT;
  skv_kv_get_stats(f.kv, &st);
  PE_CHECK(st.pages_pinned == 4, "pins released before the copy ran: %llu pinned",
           (unsigned long long)st.pages_pinned);
  PE_CHECK(skv_kv_lookup(f.kv, f.ns, &nk, 1, 0, &nref, &nhit) == 0 && nhit == 0,
           "a key was inserted before its page was written");
  __atomic_store_n(flag, 1, __ATOMIC_SEQ_CST);
  PE_CHECK(skv_kv_sync(f.kv) == 0, "sync: %s", skv_last_error());
  skv_kv_get_stats(f.kv, &st);
  PE_CHECK(st.pages_pinned == 0, "pins left after the copy: %llu",
           (unsigned long long)st.pages_pinned);
  PE_CHECK(skv_kv_lookup(f.kv, f.ns, &nk, 1, 0, &nref, &nhit) == 0 && nhit == 1,
           "the published key is missing after the copy");
  cudaFreeHost(flag);
  fix_fini(&f);
  return 0;
}

Test(gpu_kv, pins_and_keys_wait_for_the_copy, .timeout = 120) {
  SKV_TEST_REQUIRE_GPUS(1);
  skv_test_job_t job;
  int bad = skv_test_run(&job, 1, pe_wait_copy, NULL, 100000);
  cr_assert_eq(bad, 0, "PEs failed: %s", skv_test_statuses(&job));
}

/* ---- concurrent GPU publishes of the same keys are deduplicated ---- */

static int pe_dedup(int rank, int npes, void *arg) {
  fix_t f;
  PE_CHECK(fix_init(&f, 64, 64) == 0, "fixture: %s", skv_last_error());
  skv_key_t keys[32];
  uint64_t blocks[32];
  for (int i = 0; i < 32; i++) keys[i] = key_of(&f, 1000 + (uint64_t)i), blocks[i] = (uint64_t)i;
  PE_CHECK(de_fill(&f.eng, 4242) == 0, "fill"); /* the same data everywhere */
  PE_CHECK(skv_ctx_barrier(f.ctx) == 0, "barrier");
  size_t queued;
  PE_CHECK(skv_kv_publish(f.kv, f.ns, keys, 32, f.eng.lay, blocks, f.st, &queued) == 0, "publish");
  PE_CHECK(skv_kv_sync(f.kv) == 0, "sync");
  PE_CHECK(skv_ctx_barrier(f.ctx) == 0, "barrier");
  skv_kv_stats_t st = SKV_KV_STATS_INIT;
  skv_kv_get_stats(f.kv, &st);
  uint64_t pub[SKV_TEST_MAX_PES];
  PE_CHECK(skv_ctx_allgather(f.ctx, &st.published, pub, sizeof st.published) == 0, "ag");
  uint64_t total = 0;
  for (int r = 0; r < npes; r++) total += pub[r];
  PE_CHECK(total == 32, "every key inserted exactly once in all: %llu", (unsigned long long)total);
  PE_CHECK(st.pages_used == st.published, "losers freed their pages: used %llu published %llu",
           (unsigned long long)st.pages_used, (unsigned long long)st.published);
  /* the keys are claimed before the copy: a key another PE's publish holds is skipped then
   * (deduplicated, nothing copied), so every page queued is inserted */
  PE_CHECK(queued == st.published && st.published + st.deduplicated <= 32,
           "queued %zu, published %llu, deduplicated %llu", queued,
           (unsigned long long)st.published, (unsigned long long)st.deduplicated);
  PE_CHECK(st.index_entries == 32 && skv__index_check(&f.kv->index) == 32, "entries %llu",
           (unsigned long long)st.index_entries);
  PE_CHECK(skv_ctx_barrier(f.ctx) == 0, "barrier");
  fix_fini(&f);
  return 0;
}

Test(gpu_kv, concurrent_publish_of_the_same_keys_is_deduplicated, .timeout = 120) {
  SKV_TEST_REQUIRE_GPUS(1);
  skv_test_job_t job;
  int bad = skv_test_run(&job, 4, pe_dedup, NULL, 100000);
  cr_assert_eq(bad, 0, "PEs failed: %s", skv_test_statuses(&job));
}

/* ---- layer by layer: layouts of some layers, reserve / write / commit, against the host ---- */

/* Layers [l0, l1) of page `src` (blocks sb[]) equal in `dst` (blocks db[]), every other layer of
 * dst's blocks still poison (host mirrors). */
static int layers_equal_rest_poison(const dengine_t *src, const uint64_t *sb, const dengine_t *dst,
                                    const uint64_t *db, uint32_t l0, uint32_t l1) {
  const skv_geometry_t *g = &src->g;
  uint32_t kvn = g->kv_kind == SKV_KV_MLA ? 1 : 2;
  size_t vb = (size_t)g->head_dim * g->elem_bytes;
  for (uint32_t l = 0; l < g->num_layers; l++)
    for (uint32_t kv = 0; kv < kvn; kv++)
      for (uint32_t t = 0; t < g->page_tokens; t++)
        for (uint32_t h = 0; h < g->num_kv_heads; h++) {
          const uint8_t *d = ref_vec(dst, l, kv, db[t / dst->bt], t % dst->bt, h);
          if (l >= l0 && l < l1) {
            if (memcmp(ref_vec(src, l, kv, sb[t / src->bt], t % src->bt, h), d, vb) != 0) return 0;
          } else {
            for (size_t i = 0; i < vb; i++)
              if (d[i] != 0xA5) return 0;
          }
        }
  return 1;
}

/* PE 0 writes a chain layer by layer from its engine (layer 0 on one stream, the rest on
 * another that waits for it, then a commit on that stream); PE 1 never finds it before the
 * commit, then fetches the last layer alone and the others after, each compared with the host
 * reference of PE 0's engine (regenerated from its seed) on poisoned blocks. */
static int pe_layers(int rank, int npes, void *arg) {
  SKV_UNUSED(npes);
  const rt_param_t *p = arg;
  skv_ctx_t *ctx;
  PE_CHECK(skv_test_init(&ctx, 60000) == 0, "init");
  int dev = skv_ctx_get_device(ctx);
  PE_CHECK(dev >= 0, "device: %s", skv_err_name(dev));
  PE_CHECK(set_variant(p->variant) == 0, "variant");
  const uint32_t L = p->layers;
  skv_geometry_t g = geom_make(p->kind, L, p->heads, p->dim, p->eb, p->pt);
  enum { NPAGES = 6 };
  const uint32_t m = p->pt / p->bt;
  const uint64_t nb = NPAGES * m * 3;
  skv_kv_opts_t o = SKV_KV_OPTS_INIT;
  o.backend = p->backend;
  o.pages_per_pe = 16;
  skv_kv_t *kv;
  PE_CHECK(skv_kv_create(ctx, &g, &o, &kv) == 0, "kv create");
  skv_namespace_t *ns;
  PE_CHECK(skv_namespace_create("gpu-layers", &g, NULL, 0, "s", 1, &ns) == 0, "ns");
  const int edev = p->engine_gpu ? dev : -1;
  dengine_t src, dst, ref;
  PE_CHECK(de_new(&src, &g, p->preset, p->bt, nb, edev) == 0, "src: %s", skv_last_error());
  PE_CHECK(de_new(&dst, &g, p->preset, p->bt, nb, edev) == 0, "dst");
  PE_CHECK(de_new(&ref, &g, p->preset, p->bt, nb, -1) == 0, "ref");
  uint64_t seed = skv_test_seed(), seeds[SKV_TEST_MAX_PES];
  PE_CHECK(skv_ctx_allgather(ctx, &seed, seeds, sizeof seed) == 0, "seeds");
  PE_CHECK(de_fill(&src, seeds[0]) == 0, "fill");
  PE_CHECK(de_fill(&ref, seeds[0]) == 0, "ref fill");
  uint32_t tokens[NPAGES * 64];
  for (uint32_t i = 0; i < NPAGES * p->pt; i++) tokens[i] = 9000 + i;
  skv_key_t keys[NPAGES];
  size_t nk, nhit;
  PE_CHECK(skv_namespace_hash_tokens(ns, tokens, NPAGES * p->pt, NULL, keys, NPAGES, &nk) == 0,
           "hash");
  uint64_t sb[NPAGES * 64], db[NPAGES * 64];
  uint64_t s = seeds[0] ^ 0x99;
  pick_blocks(nb, NPAGES * m, sb, &s);
  cudaStream_t st, st2;
  CU_OK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  CU_OK(cudaStreamCreateWithFlags(&st2, cudaStreamNonBlocking));
  cudaEvent_t ev;
  CU_OK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  skv_layout_t *s0, *srest, *d0, *dlast;
  PE_CHECK(skv_layout_create_layers(src.lay, 0, 1, &s0) == 0, "s0: %s", skv_last_error());
  PE_CHECK(skv_layout_create_layers(src.lay, 1, L - 1, &srest) == 0, "srest");
  PE_CHECK(skv_layout_create_layers(dst.lay, 0, L - 1, &d0) == 0, "d0");
  PE_CHECK(skv_layout_create_layers(dst.lay, L - 1, 1, &dlast) == 0, "dlast");
  skv_page_ref_t refs[NPAGES];
  if (rank == 0) {
    size_t nres;
    PE_CHECK(skv_kv_reserve(kv, ns, keys, NPAGES, refs, &nres) == 0 && nres == NPAGES,
             "reserve %zu", nres);
    PE_CHECK(skv_kv_write(kv, refs, NPAGES, s0, sb, st) == 0, "write 0: %s", skv_last_error());
    CU_OK(cudaEventRecord(ev, st));
    CU_OK(cudaStreamWaitEvent(st2, ev, 0));
    PE_CHECK(skv_kv_write(kv, refs, NPAGES, srest, sb, st2) == 0, "write rest");
    CU_OK(cudaStreamSynchronize(st2));
    PE_CHECK(skv_kv_sync(kv) == 0, "sync");
  }
  PE_CHECK(skv_ctx_barrier(ctx) == 0, "barrier");
  skv_page_ref_t probe[NPAGES];
  PE_CHECK(skv_kv_lookup(kv, ns, keys, NPAGES, 0, probe, &nhit) == 0 && nhit == 0,
           "written, uncommitted pages found (%zu)", nhit);
  PE_CHECK(skv_ctx_barrier(ctx) == 0, "barrier");
  if (rank == 0) {
    size_t ins;
    PE_CHECK(skv_kv_commit(kv, ns, keys, NPAGES, refs, st2, &ins) == 0 && ins == NPAGES,
             "commit %zu: %s", ins, skv_last_error());
    /* queued, maybe not done yet: committing, aborting or writing again is refused already */
    PE_CHECK(skv_kv_commit(kv, ns, keys, NPAGES, refs, st2, &ins) == SKV_ESTATE, "commit twice");
    PE_CHECK(skv_kv_abort(kv, refs, NPAGES, st2) == SKV_ESTATE, "abort after commit");
    PE_CHECK(skv_kv_write(kv, refs, NPAGES, s0, sb, st2) == SKV_ESTATE, "write after commit");
    CU_OK(cudaStreamSynchronize(st2));
    PE_CHECK(skv_kv_sync(kv) == 0, "sync after commit");
    PE_CHECK(pages_hold(kv, refs, NPAGES, &ref, sb), "a page differs from the host reference");
  }
  PE_CHECK(skv_ctx_barrier(ctx) == 0, "barrier");
  if (rank == 1) {
    skv_page_ref_t found[NPAGES];
    PE_CHECK(skv_kv_lookup(kv, ns, keys, NPAGES, SKV_LOOKUP_PIN, found, &nhit) == 0 &&
                 nhit == NPAGES,
             "committed: %zu", nhit);
    PE_CHECK(de_poison(&dst) == 0, "poison");
    s = skv_test_seed();
    pick_blocks(nb, NPAGES * m, db, &s);
    PE_CHECK(skv_kv_fetch(kv, found, NPAGES, dlast, db, 0, st) == 0, "fetch last layer");
    CU_OK(cudaStreamSynchronize(st));
    PE_CHECK(skv_kv_sync(kv) == 0, "sync");
    PE_CHECK(de_download(&dst) == 0, "download");
    for (int i = 0; i < NPAGES; i++)
      PE_CHECK(layers_equal_rest_poison(&ref, &sb[i * m], &dst, &db[i * m], L - 1, L),
               "page %d after the last layer alone", i);
    PE_CHECK(skv_kv_fetch(kv, found, NPAGES, d0, db, SKV_FETCH_UNPIN, st) == 0, "fetch rest");
    CU_OK(cudaStreamSynchronize(st));
    PE_CHECK(skv_kv_sync(kv) == 0, "sync");
    PE_CHECK(de_download(&dst) == 0, "download");
    for (int i = 0; i < NPAGES; i++)
      PE_CHECK(pages_equal(&ref, &sb[i * m], &dst, &db[i * m]), "page %d after every layer", i);
    uint8_t *used = calloc(nb, 1);
    for (uint32_t i = 0; i < NPAGES * m; i++) used[db[i]] = 1;
    PE_CHECK(untouched_outside(&dst, used), "a layer fetch wrote outside its blocks");
    free(used);
    /* abort on a stream: the page goes back once the stream reached it */
    skv_key_t k2 = keys[0];
    k2.lo ^= 77;
    skv_page_ref_t r2;
    size_t nres;
    skv_kv_stats_t a = SKV_KV_STATS_INIT, b = SKV_KV_STATS_INIT;
    PE_CHECK(skv_kv_get_stats(kv, &a) == 0, "stats");
    PE_CHECK(skv_kv_reserve(kv, ns, &k2, 1, &r2, &nres) == 0 && nres == 1, "reserve");
    PE_CHECK(skv_kv_write(kv, &r2, 1, dlast, db, st) == 0, "write");
    PE_CHECK(skv_kv_abort(kv, &r2, 1, st) == 0, "abort: %s", skv_last_error());
    CU_OK(cudaStreamSynchronize(st));
    PE_CHECK(skv_kv_sync(kv) == 0, "sync");
    PE_CHECK(skv_kv_get_stats(kv, &b) == 0 && b.pages_used == a.pages_used, "pages used");
    PE_CHECK(skv_kv_lookup(kv, ns, &k2, 1, 0, &r2, &nhit) == 0 && nhit == 0, "aborted key");
  }
  PE_CHECK(skv_ctx_barrier(ctx) == 0, "barrier");
  skv_layout_destroy(s0);
  skv_layout_destroy(srest);
  skv_layout_destroy(d0);
  skv_layout_destroy(dlast);
  CU_OK(cudaEventDestroy(ev));
  CU_OK(cudaStreamDestroy(st));
  CU_OK(cudaStreamDestroy(st2));
  de_free(&src);
  de_free(&dst);
  de_free(&ref);
  skv_namespace_destroy(ns);
  PE_CHECK(skv_kv_destroy(kv) == 0, "destroy");
  PE_CHECK(skv_finalize(ctx) == 0, "finalize");
  return 0;
}

ParameterizedTestParameters(gpu_kv, layers_match_host_reference) {
  static rt_param_t p[] = {
      /* GPU pages, GPU engine (the kernels, offset by the layers' place in the page) */
      {2, SKV_BACKEND_CUDA, 1, SKV_LAYOUT_VLLM_FLASH_NHD, SKV_KV_SPLIT, 4, 2, 64, 2, 16, 16, 0},
      {2, SKV_BACKEND_CUDA, 1, SKV_LAYOUT_FLASHINFER_HND, SKV_KV_SPLIT, 3, 4, 32, 2, 32, 8, 0},
      {2, SKV_BACKEND_CUDA, 1, SKV_LAYOUT_MLA, SKV_KV_MLA, 5, 1, 576, 2, 16, 16, 1},
      {2, SKV_BACKEND_CUDA, 1, SKV_LAYOUT_VLLM_FLASH_NHD, SKV_KV_SPLIT, 4, 2, 64, 2, 16, 16, 6},
      /* GPU pages, host engine (staged: only the layers' bytes cross) */
      {2, SKV_BACKEND_CUDA, 0, SKV_LAYOUT_VLLM_FLASH_HND, SKV_KV_SPLIT, 3, 2, 64, 2, 16, 8, 0},
      /* host pages GPUs read, GPU engine */
      {2, SKV_BACKEND_CUDA_HOST, 1, SKV_LAYOUT_VLLM_FLASH_NHD, SKV_KV_SPLIT, 4, 2, 64, 2, 16, 16,
       0},
  };
  return cr_make_param_array(rt_param_t, p, sizeof p / sizeof p[0]);
}

ParameterizedTest(rt_param_t *p, gpu_kv, layers_match_host_reference, .timeout = 240) {
  SKV_TEST_REQUIRE_GPUS(1);
  skv_test_job_t job;
  int bad = skv_test_run(&job, p->npes, pe_layers, p, 200000);
  cr_assert_eq(bad, 0, "backend %d, engine %s, preset %d L%u, variant %d: %s", p->backend,
               p->engine_gpu ? "GPU" : "host", p->preset, p->layers, p->variant,
               skv_test_statuses(&job));
}
