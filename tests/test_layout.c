/* Tests of KV geometries, engine layouts and the host page copy: every preset and random custom
 * strides against a per-element reference built from the tensor shapes, and bad input. */
#define _GNU_SOURCE
#include "skv_test.h"
#include "kv/layout.h"

#include <criterion/criterion.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

TestSuite(layout, .timeout = 60);

/* Criterion reports every assertion to its runner, passing ones too: element loops test with
 * plain ifs and call cr_assert_fail only on a mismatch. */

#define POISON 0xA5
#define MAX_L  8

static skv_geometry_t geom_make(uint32_t kind, uint32_t L, uint32_t H, uint32_t D, uint32_t e,
                                uint32_t pt) {
  skv_geometry_t g = SKV_GEOMETRY_INIT;
  g.kv_kind = kind;
  g.num_layers = L;
  g.num_kv_heads = H;
  g.head_dim = D;
  g.elem_bytes = e;
  g.page_tokens = pt;
  return g;
}

static uint64_t page_bytes_of(const skv_geometry_t *g) {
  uint64_t pb = 0;
  cr_assert_eq(skv_geometry_get_page_bytes(g, &pb), 0, "%s", skv_last_error());
  return pb;
}

/* ---- an engine cache described twice: by its tensor shape here, by a layout in symkv ------ */

typedef struct cache {
  int preset; /* SKV_LAYOUT_*; CUSTOM: bases and strides below */
  skv_geometry_t g;
  uint32_t T; /* block tokens */
  uint64_t nb;
  uint32_t nbuf;
  uint8_t *buf[2 * MAX_L];
  size_t buf_bytes[2 * MAX_L];
  /* custom layouts */
  int64_t sb, st, sh;
  uint8_t *base[2 * MAX_L]; /* [l * kvn + kv] */
} cache_t;

static uint32_t kvn_of(const skv_geometry_t *g) {
  return g->kv_kind == SKV_KV_MLA ? 1 : 2;
}

/* Address of element (l, kv, block b, token t, head h, dim d), from the preset's shape as
 * symkv.h states it, not from any stride layout.c computes. */
static uint8_t *elem(const cache_t *c, uint32_t l, uint32_t kv, uint64_t b, uint64_t t, uint64_t h,
                     uint64_t d) {
  const uint64_t T = c->T, H = c->g.num_kv_heads, D = c->g.head_dim, nb = c->nb;
  const uint64_t L = c->g.num_layers, kvn = kvn_of(&c->g), e = c->g.elem_bytes;
  uint64_t i;
  switch (c->preset) {
  case SKV_LAYOUT_VLLM_FLASH_NHD: /* (2, nb, T, H, D) */
    i = (((kv * nb + b) * T + t) * H + h) * D + d;
    return c->buf[l] + i * e;
  case SKV_LAYOUT_VLLM_FLASH_HND: /* (2, nb, H, T, D) */
    i = (((kv * nb + b) * H + h) * T + t) * D + d;
    return c->buf[l] + i * e;
  case SKV_LAYOUT_FLASHINFER_NHD: /* (nb, 2, T, H, D) */
    i = (((b * 2 + kv) * T + t) * H + h) * D + d;
    return c->buf[l] + i * e;
  case SKV_LAYOUT_FLASHINFER_HND: /* (nb, 2, H, T, D) */
    i = (((b * 2 + kv) * H + h) * T + t) * D + d;
    return c->buf[l] + i * e;
  case SKV_LAYOUT_MLA: /* (nb, T, D) */
    i = (b * T + t) * D + d;
    return c->buf[l] + i * e;
  case SKV_LAYOUT_CONTIGUOUS: /* block b = a page of T tokens: (nb, L, kvn, T, H, D) */
    i = ((((b * L + l) * kvn + kv) * T + t) * H + h) * D + d;
    return c->buf[0] + i * e;
  default:
    return c->base[l * kvn + kv] +
           ((int64_t)b * c->sb + (int64_t)t * c->st + (int64_t)h * c->sh + (int64_t)d) * (int64_t)e;
  }
}

static size_t page_off(const skv_geometry_t *g, uint32_t l, uint32_t kv, uint64_t pt, uint64_t h,
                       uint64_t d) {
  return (size_t)(((((uint64_t)l * kvn_of(g) + kv) * g->page_tokens + pt) * g->num_kv_heads + h) *
                      g->head_dim +
                  d) *
         g->elem_bytes;
}

static void cache_free(cache_t *c) {
  for (uint32_t i = 0; i < c->nbuf; i++) free(c->buf[i]);
  c->nbuf = 0;
}

/* 64-byte aligned, as an engine's tensors are (the host copy's whole-line paths need it; the
 * custom layouts below add their own misalignment). */
static uint8_t *xmalloc(size_t n) {
  void *p = NULL;
  if (posix_memalign(&p, 64, n ? n : 1) != 0) cr_assert_fail("out of memory (%zu bytes)", n);
  return p;
}

/* A preset cache: one buffer per layer_ptrs entry, of the size symkv says. */
static void cache_preset(cache_t *c, const skv_geometry_t *g, int preset, uint32_t T, uint64_t nb) {
  memset(c, 0, sizeof *c);
  c->preset = preset;
  c->g = *g;
  c->T = T;
  c->nb = nb;
  uint64_t bytes = 0;
  cr_assert_eq(skv_layout_get_preset_layer_bytes(g, preset, T, nb, &bytes), 0, "%s",
               skv_last_error());
  uint64_t per_block = (uint64_t)T * g->num_kv_heads * g->head_dim * g->elem_bytes;
  uint64_t want = preset == SKV_LAYOUT_CONTIGUOUS ? nb * per_block * g->num_layers * kvn_of(g)
                  : preset == SKV_LAYOUT_MLA      ? nb * per_block
                                                  : 2 * nb * per_block;
  cr_assert_eq(bytes, want, "preset %d: layer bytes %" PRIu64 ", expected %" PRIu64, preset, bytes,
               want);
  c->nbuf = preset == SKV_LAYOUT_CONTIGUOUS ? 1 : g->num_layers;
  for (uint32_t i = 0; i < c->nbuf; i++) {
    c->buf[i] = xmalloc(bytes);
    c->buf_bytes[i] = bytes;
  }
}

static skv_layout_t *layout_of(const cache_t *c) {
  skv_layout_t *lay = NULL;
  if (c->preset != SKV_LAYOUT_CUSTOM) {
    void *ptrs[MAX_L];
    for (uint32_t i = 0; i < c->nbuf; i++) ptrs[i] = c->buf[i];
    cr_assert_eq(skv_layout_create_preset(&c->g, c->preset, c->T, c->nb, ptrs, -1, &lay), 0,
                 "preset %d: %s", c->preset, skv_last_error());
  } else {
    void *k[MAX_L], *v[MAX_L];
    uint32_t kvn = kvn_of(&c->g);
    for (uint32_t l = 0; l < c->g.num_layers; l++) {
      k[l] = c->base[l * kvn];
      v[l] = kvn == 2 ? c->base[l * kvn + 1] : NULL;
    }
    skv_layout_desc_t d = SKV_LAYOUT_DESC_INIT;
    d.block_tokens = c->T;
    d.num_blocks = c->nb;
    d.k_base = k;
    d.v_base = kvn == 2 ? v : NULL;
    d.stride_block = c->sb;
    d.stride_token = c->st;
    d.stride_head = c->sh;
    cr_assert_eq(skv_layout_create(&c->g, &d, &lay), 0,
                 "custom sb=%" PRId64 " st=%" PRId64 " sh=%" PRId64 ": %s", c->sb, c->st, c->sh,
                 skv_last_error());
  }
  cr_assert_eq(lay->blocks_per_page, c->g.page_tokens / c->T);
  cr_assert_eq(lay->device, -1);
  cr_assert_null(lay->dev_base);
  return lay;
}

/* A custom cache with random nesting order of (block, token, head), random padding, and one of
 * four placements of the tensors: each alone, K then V in one buffer, K and V interleaved at the
 * outermost level, or every layer and k|v interleaved at the outermost level in one buffer. */
static void cache_custom(cache_t *c, const skv_geometry_t *g, uint32_t T, uint64_t nb,
                         uint64_t *rng) {
  memset(c, 0, sizeof *c);
  c->preset = SKV_LAYOUT_CUSTOM;
  c->g = *g;
  c->T = T;
  c->nb = nb;
  const uint32_t kvn = kvn_of(g), L = g->num_layers, e = g->elem_bytes;
  const uint32_t ntens = L * kvn;
  int order[3] = {0, 1, 2}; /* innermost first: 0 block, 1 token, 2 head */
  for (int i = 2; i > 0; i--) {
    int j = (int)(skv_test_rand(rng) % (uint64_t)(i + 1)), t = order[i];
    order[i] = order[j];
    order[j] = t;
  }
  int place = (int)(skv_test_rand(rng) % 4);
  if (kvn == 1 && place == 2) place = 1;
  const uint64_t counts[3] = {nb, T, g->num_kv_heads};
  int64_t strides[3];
  uint64_t ext = g->head_dim, inner_ext = 0;
  for (int i = 0; i < 3; i++) {
    int lv = order[i];
    uint64_t pad = skv_test_rand(rng) % 3 == 0 ? skv_test_rand(rng) % 5 : 0;
    uint64_t s = ext + pad;
    if (i == 2 && place == 2) s = 2 * ext + pad; /* room for V between K items */
    if (i == 2 && place == 3) s = (uint64_t)ntens * ext + pad;
    if (i == 2) inner_ext = ext;
    strides[lv] = (int64_t)s;
    ext = (counts[lv] - 1) * s + ext;
  }
  c->sb = strides[0];
  c->st = strides[1];
  c->sh = strides[2];
  uint64_t lead = (skv_test_rand(rng) % 4) * e; /* bases not 16-byte aligned */
  if (place == 0) {
    c->nbuf = ntens;
    for (uint32_t i = 0; i < ntens; i++) {
      c->buf_bytes[i] = lead + ext * e + (skv_test_rand(rng) % 3) * e;
      c->buf[i] = xmalloc(c->buf_bytes[i]);
      c->base[i] = c->buf[i] + lead;
    }
  } else if (place == 1 || place == 2) {
    c->nbuf = L;
    uint64_t voff = place == 1 ? ext + skv_test_rand(rng) % 3
                               : inner_ext + skv_test_rand(rng) %
                                                 ((uint64_t)strides[order[2]] - 2 * inner_ext + 1);
    for (uint32_t l = 0; l < L; l++) {
      c->buf_bytes[l] = lead + (voff + ext) * e;
      c->buf[l] = xmalloc(c->buf_bytes[l]);
      c->base[l * kvn] = c->buf[l] + lead;
      if (kvn == 2) c->base[l * kvn + 1] = c->buf[l] + lead + voff * e;
    }
  } else {
    c->nbuf = 1;
    c->buf_bytes[0] = lead + (ext + (uint64_t)(ntens - 1) * inner_ext) * e;
    c->buf[0] = xmalloc(c->buf_bytes[0]);
    for (uint32_t i = 0; i < ntens; i++)
      c->base[i] = c->buf[0] + lead + (uint64_t)i * inner_ext * e;
  }
}

/* The same cache shape again (for the destination of a fetch). */
static void cache_clone_shape(cache_t *dst, const cache_t *src) {
  *dst = *src;
  for (uint32_t i = 0; i < src->nbuf; i++) {
    dst->buf[i] = xmalloc(src->buf_bytes[i]);
    for (uint32_t j = 0; j < 2 * MAX_L && src->preset == SKV_LAYOUT_CUSTOM; j++)
      if (src->base[j] >= src->buf[i] && src->base[j] < src->buf[i] + src->buf_bytes[i])
        dst->base[j] = dst->buf[i] + (src->base[j] - src->buf[i]);
  }
}

/* Distinct random block ids. */
static void pick_blocks(uint64_t *ids, size_t n, uint64_t nb, uint64_t *rng) {
  cr_assert_leq(n, nb);
  for (size_t i = 0; i < n; i++) {
    bool dup;
    do {
      ids[i] = skv_test_rand(rng) % nb;
      dup = false;
      for (size_t j = 0; j < i; j++) dup |= ids[j] == ids[i];
    } while (dup);
  }
}

/* Copy npages pages of blocks out of `src`, check them element by element, copy them into a
 * poisoned `dst` and check the chosen blocks' elements and that nothing else was written. */
static void roundtrip(cache_t *src, size_t npages, uint64_t seed, uint64_t *rng) {
  const skv_geometry_t *g = &src->g;
  const uint32_t kvn = kvn_of(g), m = g->page_tokens / src->T, e = g->elem_bytes;
  const uint64_t H = g->num_kv_heads, D = g->head_dim, pb = page_bytes_of(g);
  for (uint32_t i = 0; i < src->nbuf; i++)
    skv_test_fill_random(src->buf[i], src->buf_bytes[i], rng);
  skv_layout_t *ls = layout_of(src);
  cache_t dst;
  cache_clone_shape(&dst, src);
  for (uint32_t i = 0; i < dst.nbuf; i++) memset(dst.buf[i], POISON, dst.buf_bytes[i]);
  skv_layout_t *ld = layout_of(&dst);

  size_t nids = npages * m;
  uint64_t *ids = calloc(nids, sizeof *ids);
  pick_blocks(ids, nids, src->nb, rng);
  cr_assert_eq(skv__check_block_ids(ls, ids, npages, "test"), 0, "%s", skv_last_error());
  uint8_t *page = xmalloc(pb);
  uint8_t **mask = calloc(dst.nbuf, sizeof *mask);
  for (uint32_t i = 0; i < dst.nbuf; i++) mask[i] = calloc(dst.buf_bytes[i], 1);

  for (size_t p = 0; p < npages; p++) {
    const uint64_t *pid = ids + p * m;
    memset(page, POISON, pb);
    /* odd pages take the streaming (non-temporal) path, even pages the ordinary one */
    skv__copy_blocks_to_page(ls, page, pid, p & 1);
    skv__copy_stream_fence();
    for (uint32_t l = 0; l < g->num_layers; l++)
      for (uint32_t kv = 0; kv < kvn; kv++)
        for (uint64_t pt = 0; pt < g->page_tokens; pt++)
          for (uint64_t h = 0; h < H; h++)
            for (uint64_t d = 0; d < D; d++) {
              const uint8_t *want = elem(src, l, kv, pid[pt / src->T], pt % src->T, h, d);
              const uint8_t *got = page + page_off(g, l, kv, pt, h, d);
              if (memcmp(want, got, e) != 0)
                cr_assert_fail("seed %" PRIu64
                               " preset %d: blocks->page differs at layer %u %c token "
                               "%" PRIu64 " head %" PRIu64 " dim %" PRIu64,
                               seed, src->preset, l, kv ? 'v' : 'k', pt, h, d);
            }
    skv__copy_page_to_blocks(ld, page, pid, !(p & 1));
    skv__copy_stream_fence();
  }
  /* Every element of the chosen blocks equals the source; mark its bytes. */
  for (size_t p = 0; p < npages; p++)
    for (uint32_t j = 0; j < m; j++) {
      uint64_t b = ids[p * m + j];
      for (uint32_t l = 0; l < g->num_layers; l++)
        for (uint32_t kv = 0; kv < kvn; kv++)
          for (uint64_t t = 0; t < src->T; t++)
            for (uint64_t h = 0; h < H; h++)
              for (uint64_t d = 0; d < D; d++) {
                const uint8_t *want = elem(src, l, kv, b, t, h, d);
                uint8_t *got = elem(&dst, l, kv, b, t, h, d);
                if (memcmp(want, got, e) != 0)
                  cr_assert_fail("seed %" PRIu64
                                 " preset %d: page->blocks differs at block %" PRIu64
                                 " layer %u %c token %" PRIu64 " head %" PRIu64 " dim %" PRIu64,
                                 seed, src->preset, b, l, kv ? 'v' : 'k', t, h, d);
                for (uint32_t i = 0; i < dst.nbuf; i++)
                  if (got >= dst.buf[i] && got < dst.buf[i] + dst.buf_bytes[i]) {
                    if (got + e > dst.buf[i] + dst.buf_bytes[i])
                      cr_assert_fail("element past the end of buffer %u", i);
                    memset(mask[i] + (got - dst.buf[i]), 1, e);
                  }
              }
    }
  /* Everything else is still poison. */
  for (uint32_t i = 0; i < dst.nbuf; i++)
    for (size_t k = 0; k < dst.buf_bytes[i]; k++)
      if (!mask[i][k] && dst.buf[i][k] != POISON)
        cr_assert_fail("seed %" PRIu64
                       " preset %d: page->blocks wrote byte %zu of buffer %u, outside "
                       "the chosen blocks",
                       seed, src->preset, k, i);

  for (uint32_t i = 0; i < dst.nbuf; i++) free(mask[i]);
  free(mask);
  free(page);
  free(ids);
  skv_layout_destroy(ls);
  skv_layout_destroy(ld);
  cache_free(&dst);
}

/* ---- every preset ------------------------------------------------------------------------- */

static const int split_presets[] = {SKV_LAYOUT_VLLM_FLASH_NHD, SKV_LAYOUT_VLLM_FLASH_HND,
                                    SKV_LAYOUT_FLASHINFER_NHD, SKV_LAYOUT_FLASHINFER_HND,
                                    SKV_LAYOUT_CONTIGUOUS};

Test(layout, every_preset_roundtrips, .timeout = 60) {
  uint64_t seed = skv_test_seed(), rng = seed;
  /* Llama-like shard, two blocks per page, and one block per page; head_dim 64 fp32; fp8;
   * short rows of 32 and 16 bytes (HND's whole-line gather when streaming), and of 48 (its
   * transpose in L1). */
  const skv_geometry_t gs[] = {
      geom_make(SKV_KV_SPLIT, 4, 8, 128, 2, 32), geom_make(SKV_KV_SPLIT, 2, 2, 64, 4, 16),
      geom_make(SKV_KV_SPLIT, 3, 4, 128, 1, 8),  geom_make(SKV_KV_SPLIT, 2, 4, 16, 2, 16),
      geom_make(SKV_KV_SPLIT, 1, 8, 8, 2, 16),   geom_make(SKV_KV_SPLIT, 1, 4, 24, 2, 16)};
  const uint32_t bts[] = {16, 16, 2, 8, 16, 16};
  for (size_t gi = 0; gi < SKV_ARRAY_LEN(gs); gi++)
    for (size_t pi = 0; pi < SKV_ARRAY_LEN(split_presets); pi++) {
      cache_t c;
      cache_preset(&c, &gs[gi], split_presets[pi], bts[gi], 11);
      roundtrip(&c, 2, seed, &rng);
      cache_free(&c);
    }
  /* DeepSeek-like MLA: 576-wide latent, fp8 and bf16. */
  const skv_geometry_t gm[] = {geom_make(SKV_KV_MLA, 3, 1, 576, 1, 64),
                               geom_make(SKV_KV_MLA, 2, 1, 576, 2, 16)};
  const int mla_presets[] = {SKV_LAYOUT_MLA, SKV_LAYOUT_CONTIGUOUS};
  for (size_t gi = 0; gi < SKV_ARRAY_LEN(gm); gi++)
    for (size_t pi = 0; pi < SKV_ARRAY_LEN(mla_presets); pi++) {
      cache_t c;
      cache_preset(&c, &gm[gi], mla_presets[pi], gi == 0 ? 32 : 16, 9);
      roundtrip(&c, 2, seed, &rng);
      cache_free(&c);
    }
}

Test(layout, preset_strides_and_runs, .timeout = 10) {
  skv_geometry_t g = geom_make(SKV_KV_SPLIT, 2, 8, 128, 2, 32);
  const uint64_t T = 16, H = 8, D = 128, nb = 5;
  struct {
    int preset;
    int64_t sb, st, sh;
    uint64_t v_off, run;
  } want[] = {
      {SKV_LAYOUT_VLLM_FLASH_NHD, T * H * D, H * D, D, nb * T * H * D * 2, T * H * D * 2},
      {SKV_LAYOUT_VLLM_FLASH_HND, T * H * D, D, T * D, nb * T * H * D * 2, D * 2},
      {SKV_LAYOUT_FLASHINFER_NHD, 2 * T * H * D, H * D, D, T * H * D * 2, T * H * D * 2},
      {SKV_LAYOUT_FLASHINFER_HND, 2 * T * H * D, D, T * D, T * H * D * 2, D * 2},
      {SKV_LAYOUT_CONTIGUOUS, 2 * 2 * T * H * D, H * D, D, T * H * D * 2, T * H * D * 2},
  };
  for (size_t i = 0; i < SKV_ARRAY_LEN(want); i++) {
    cache_t c;
    cache_preset(&c, &g, want[i].preset, (uint32_t)T, nb);
    void *ptrs[2] = {c.buf[0], c.nbuf > 1 ? c.buf[1] : NULL};
    skv_layout_t *lay;
    cr_assert_eq(skv_layout_create_preset(&g, want[i].preset, (uint32_t)T, nb, ptrs, -1, &lay), 0);
    cr_assert_eq(lay->preset, want[i].preset);
    cr_assert_eq(lay->stride_block, want[i].sb, "preset %d", want[i].preset);
    cr_assert_eq(lay->stride_token, want[i].st, "preset %d", want[i].preset);
    cr_assert_eq(lay->stride_head, want[i].sh, "preset %d", want[i].preset);
    cr_assert_eq((uint64_t)(lay->base[1] - lay->base[0]), want[i].v_off, "preset %d",
                 want[i].preset);
    cr_assert_eq(lay->run_bytes, want[i].run, "preset %d", want[i].preset);
    cr_assert_eq(lay->kvn, 2);
    cr_assert_eq(lay->num_layers, 2);
    cr_assert_eq(lay->num_blocks, nb);
    skv_layout_destroy(lay);
    cache_free(&c);
  }
}

Test(layout, device_layout_is_stored_without_touching_memory, .timeout = 10) {
  skv_geometry_t g = geom_make(SKV_KV_SPLIT, 2, 8, 128, 2, 16);
  /* Addresses that are not mapped here: a GPU's. */
  void *ptrs[2] = {(void *)(uintptr_t)0x7f0000000000ull, (void *)(uintptr_t)0x7f1000000000ull};
  skv_layout_t *lay;
  cr_assert_eq(skv_layout_create_preset(&g, SKV_LAYOUT_VLLM_FLASH_HND, 16, 1000, ptrs, 3, &lay), 0,
               "%s", skv_last_error());
  cr_assert_eq(lay->device, 3);
  cr_assert_null(lay->dev_base);
  cr_assert_eq(lay->base[2], (char *)ptrs[1]);
  cr_assert_eq(skv_layout_destroy(lay), 0);
  cr_assert_eq(skv_layout_destroy(NULL), 0);
}

/* ---- random geometries, presets and custom strides ---------------------------------------- */

Test(layout, random_geometries_and_strides_roundtrip, .timeout = 120) {
  uint64_t seed = skv_test_seed(), rng = seed;
  static const uint32_t dims[] = {1, 3, 8, 64, 128, 576};
  static const uint32_t elems[] = {1, 2, 4};
  int counts[7] = {0};
  for (int iter = 0; iter < 300; iter++) {
    skv_geometry_t g;
    uint32_t T, m;
    do {
      bool mla = skv_test_rand(&rng) % 4 == 0;
      T = 1 + (uint32_t)(skv_test_rand(&rng) % 8);
      if (skv_test_rand(&rng) % 4 == 0) T = 16;
      m = 1 + (uint32_t)(skv_test_rand(&rng) % 4);
      g = geom_make(mla ? SKV_KV_MLA : SKV_KV_SPLIT, 1 + (uint32_t)(skv_test_rand(&rng) % 8),
                    mla ? 1 : 1 + (uint32_t)(skv_test_rand(&rng) % 8),
                    dims[skv_test_rand(&rng) % SKV_ARRAY_LEN(dims)],
                    elems[skv_test_rand(&rng) % SKV_ARRAY_LEN(elems)], T * m);
    } while (page_bytes_of(&g) > (256u << 10));
    int preset;
    uint64_t r = skv_test_rand(&rng) % 8;
    if (g.kv_kind == SKV_KV_MLA)
      preset = r < 3 ? SKV_LAYOUT_MLA : r < 5 ? SKV_LAYOUT_CONTIGUOUS : SKV_LAYOUT_CUSTOM;
    else
      preset = r < 5 ? split_presets[r] : SKV_LAYOUT_CUSTOM;
    size_t npages = 1 + skv_test_rand(&rng) % 2;
    uint64_t nb = npages * m + skv_test_rand(&rng) % 5;
    cache_t c;
    if (preset == SKV_LAYOUT_CUSTOM)
      cache_custom(&c, &g, T, nb, &rng);
    else
      cache_preset(&c, &g, preset, T, nb);
    roundtrip(&c, npages, seed, &rng);
    cache_free(&c);
    counts[preset]++;
  }
  for (int p = 0; p < 7; p++)
    cr_assert_gt(counts[p], 0, "seed %" PRIu64 ": preset %d never drawn", seed, p);
}

/* K and V interleaved per token, (nb, T, 2, H, D): not a preset, valid, and an extent check
 * alone would reject it. */
Test(layout, kv_interleaved_per_token, .timeout = 10) {
  uint64_t seed = skv_test_seed(), rng = seed;
  skv_geometry_t g = geom_make(SKV_KV_SPLIT, 2, 4, 64, 2, 16);
  const uint64_t T = 8, H = 4, D = 64, nb = 6;
  cache_t c;
  memset(&c, 0, sizeof c);
  c.preset = SKV_LAYOUT_CUSTOM;
  c.g = g;
  c.T = (uint32_t)T;
  c.nb = nb;
  c.sh = (int64_t)D;
  c.st = (int64_t)(2 * H * D);
  c.sb = (int64_t)(T * 2 * H * D);
  c.nbuf = 2;
  for (uint32_t l = 0; l < 2; l++) {
    c.buf_bytes[l] = nb * T * 2 * H * D * 2;
    c.buf[l] = xmalloc(c.buf_bytes[l]);
    c.base[2 * l] = c.buf[l];
    c.base[2 * l + 1] = c.buf[l] + H * D * 2;
  }
  roundtrip(&c, 2, seed, &rng);
  cache_free(&c);
}

/* A level with one item may have any positive stride (symkv.h): huge ones must neither be
 * rejected nor overflow in the copy (UBSan, in the sanitizer run, aborts on it). */
Test(layout, single_item_levels_take_any_stride, .timeout = 10) {
  uint64_t seed = skv_test_seed(), rng = seed;
  skv_geometry_t g = geom_make(SKV_KV_SPLIT, 2, 1, 64, 2, 8); /* one head */
  const uint64_t T = 8, D = 64;
  cache_t c;
  memset(&c, 0, sizeof c);
  c.preset = SKV_LAYOUT_CUSTOM;
  c.g = g;
  c.T = (uint32_t)T;
  c.nb = 1; /* one block */
  c.sb = INT64_MAX;
  c.sh = INT64_MAX - 7;
  c.st = (int64_t)D;
  c.nbuf = 4;
  for (uint32_t i = 0; i < 4; i++) {
    c.buf_bytes[i] = T * D * 2;
    c.buf[i] = xmalloc(c.buf_bytes[i]);
    c.base[i] = c.buf[i];
  }
  roundtrip(&c, 1, seed, &rng);
  cache_free(&c);
}

/* ---- bad input ---------------------------------------------------------------------------- */

#define EXPECT_EINVAL(call, needle)                                                             \
  do {                                                                                          \
    skv_clear_error();                                                                          \
    int rc_ = (call);                                                                           \
    cr_assert_eq(rc_, SKV_EINVAL, "%s returned %s", #call, skv_err_name(rc_));                  \
    cr_assert(strstr(skv_last_error(), (needle)) != NULL, "%s: message '%s' lacks '%s'", #call, \
              skv_last_error(), (needle));                                                      \
  } while (0)

static void quiet(void) {
  skv_log_set_level(SKV_LOG_NONE, SKV_SUBSYS_ALL);
}

Test(layout, bad_geometries, .init = quiet, .timeout = 10) {
  uint64_t pb;
  skv_geometry_t ok = geom_make(SKV_KV_SPLIT, 32, 8, 128, 2, 16);
  cr_assert_eq(skv_geometry_get_page_bytes(&ok, &pb), 0);
  cr_assert_eq(pb, 32ull * 2 * 16 * 8 * 128 * 2);
  skv_geometry_t mla = geom_make(SKV_KV_MLA, 61, 1, 576, 1, 64);
  cr_assert_eq(skv_geometry_get_page_bytes(&mla, &pb), 0);
  cr_assert_eq(pb, 61ull * 64 * 576);

  skv_geometry_t g;
  EXPECT_EINVAL(skv_geometry_get_page_bytes(NULL, &pb), "NULL");
  EXPECT_EINVAL(skv_geometry_get_page_bytes(&ok, NULL), "page_bytes");
  g = ok, g.size = sizeof g - 4;
  EXPECT_EINVAL(skv_geometry_get_page_bytes(&g, &pb), "SKV_GEOMETRY_INIT");
  g = ok, g.size = 0;
  EXPECT_EINVAL(skv_geometry_get_page_bytes(&g, &pb), "size");
  g = ok, g.version = 0;
  EXPECT_EINVAL(skv_geometry_get_page_bytes(&g, &pb), "version");
  g = ok, g.version = SKV_GEOMETRY_VERSION + 1;
  EXPECT_EINVAL(skv_geometry_get_page_bytes(&g, &pb), "version");
  g = ok, g.kv_kind = 2;
  EXPECT_EINVAL(skv_geometry_get_page_bytes(&g, &pb), "kv_kind");
  g = ok, g.num_layers = 0;
  EXPECT_EINVAL(skv_geometry_get_page_bytes(&g, &pb), "num_layers");
  g = ok, g.num_layers = 1025;
  EXPECT_EINVAL(skv_geometry_get_page_bytes(&g, &pb), "num_layers");
  g = ok, g.num_kv_heads = 0;
  EXPECT_EINVAL(skv_geometry_get_page_bytes(&g, &pb), "num_kv_heads");
  g = ok, g.head_dim = 0;
  EXPECT_EINVAL(skv_geometry_get_page_bytes(&g, &pb), "head_dim");
  g = ok, g.head_dim = 65537;
  EXPECT_EINVAL(skv_geometry_get_page_bytes(&g, &pb), "head_dim");
  g = ok, g.elem_bytes = 0;
  EXPECT_EINVAL(skv_geometry_get_page_bytes(&g, &pb), "elem_bytes");
  g = ok, g.elem_bytes = 3;
  EXPECT_EINVAL(skv_geometry_get_page_bytes(&g, &pb), "elem_bytes");
  g = ok, g.page_tokens = 0;
  EXPECT_EINVAL(skv_geometry_get_page_bytes(&g, &pb), "page_tokens");
  g = mla, g.num_kv_heads = 2;
  EXPECT_EINVAL(skv_geometry_get_page_bytes(&g, &pb), "num_kv_heads");
  /* 1024 layers x 2 x 65536 tokens x 1024 heads x 65536 x 4: far over 4 GiB. */
  g = geom_make(SKV_KV_SPLIT, 1024, 1024, 65536, 4, 65536);
  EXPECT_EINVAL(skv_geometry_get_page_bytes(&g, &pb), "4 GiB");
  /* Exactly 4 GiB is allowed, one more token per page is not. */
  g = geom_make(SKV_KV_SPLIT, 1, 1, 65536, 4, 8192);
  cr_assert_eq(skv_geometry_get_page_bytes(&g, &pb), 0, "%s", skv_last_error());
  cr_assert_eq(pb, 4ull << 30);
  g.page_tokens = 8193;
  EXPECT_EINVAL(skv_geometry_get_page_bytes(&g, &pb), "4 GiB");
}

/* A valid NHD-like custom description over one buffer per tensor. */
typedef struct custom_fixture {
  skv_geometry_t g;
  skv_layout_desc_t d;
  void *k[2], *v[2];
  uint8_t *mem;
} custom_fixture_t;

static void fixture(custom_fixture_t *f) {
  memset(f, 0, sizeof *f);
  f->g = geom_make(SKV_KV_SPLIT, 2, 4, 64, 2, 16);
  const size_t tensor = 10ull * 16 * 4 * 64 * 2; /* 10 blocks of 16 tokens */
  f->mem = xmalloc(5 * tensor);                  /* one tensor of room at the end */
  for (int l = 0; l < 2; l++) {
    f->k[l] = f->mem + (2 * l) * tensor;
    f->v[l] = f->mem + (2 * l + 1) * tensor;
  }
  skv_layout_desc_t d = SKV_LAYOUT_DESC_INIT;
  d.block_tokens = 16;
  d.num_blocks = 10;
  d.k_base = f->k;
  d.v_base = f->v;
  d.stride_block = 16 * 4 * 64;
  d.stride_token = 4 * 64;
  d.stride_head = 64;
  f->d = d;
  skv_layout_t *lay;
  cr_assert_eq(skv_layout_create(&f->g, &f->d, &lay), 0, "%s", skv_last_error());
  cr_assert_eq(lay->run_bytes, 16 * 4 * 64 * 2);
  skv_layout_destroy(lay);
}

Test(layout, bad_custom_descriptions, .init = quiet, .timeout = 10) {
  custom_fixture_t f;
  fixture(&f);
  skv_layout_t *lay = (skv_layout_t *)&f; /* must be reset to NULL on failure */
  skv_layout_desc_t d;
  skv_geometry_t g;

  EXPECT_EINVAL(skv_layout_create(&f.g, NULL, &lay), "desc");
  cr_assert_null(lay);
  EXPECT_EINVAL(skv_layout_create(&f.g, &f.d, NULL), "layout");
  EXPECT_EINVAL(skv_layout_create(NULL, &f.d, &lay), "geom");
  g = f.g, g.version = 7;
  EXPECT_EINVAL(skv_layout_create(&g, &f.d, &lay), "geom.version");
  d = f.d, d.size = sizeof d + 8;
  EXPECT_EINVAL(skv_layout_create(&f.g, &d, &lay), "desc.size");
  d = f.d, d.version = 0;
  EXPECT_EINVAL(skv_layout_create(&f.g, &d, &lay), "desc.version");
  /* sizes */
  d = f.d, d.block_tokens = 0;
  EXPECT_EINVAL(skv_layout_create(&f.g, &d, &lay), "block_tokens");
  d = f.d, d.block_tokens = 3;
  EXPECT_EINVAL(skv_layout_create(&f.g, &d, &lay), "does not divide");
  d = f.d, d.block_tokens = 32;
  EXPECT_EINVAL(skv_layout_create(&f.g, &d, &lay), "does not divide");
  d = f.d, d.num_blocks = 0;
  EXPECT_EINVAL(skv_layout_create(&f.g, &d, &lay), "num_blocks");
  d = f.d, d.device = -2;
  EXPECT_EINVAL(skv_layout_create(&f.g, &d, &lay), "device");
  /* bases */
  d = f.d, d.k_base = NULL;
  EXPECT_EINVAL(skv_layout_create(&f.g, &d, &lay), "k_base");
  d = f.d, d.v_base = NULL;
  EXPECT_EINVAL(skv_layout_create(&f.g, &d, &lay), "v_base");
  void *k2[2] = {f.k[0], NULL};
  d = f.d, d.k_base = k2;
  EXPECT_EINVAL(skv_layout_create(&f.g, &d, &lay), "k_base[1] is NULL");
  void *v2[2] = {(uint8_t *)f.v[0] + 1, f.v[1]};
  d = f.d, d.v_base = v2;
  EXPECT_EINVAL(skv_layout_create(&f.g, &d, &lay), "v_base[0]");
  EXPECT_EINVAL(skv_layout_create(&f.g, &d, &lay), "aligned");
  void *wrap[2] = {(void *)(UINTPTR_MAX - 4095), f.k[1]};
  d = f.d, d.k_base = wrap;
  EXPECT_EINVAL(skv_layout_create(&f.g, &d, &lay), "wraps");
  /* strides */
  d = f.d, d.stride_head = 0;
  EXPECT_EINVAL(skv_layout_create(&f.g, &d, &lay), "positive");
  d = f.d, d.stride_token = -256;
  EXPECT_EINVAL(skv_layout_create(&f.g, &d, &lay), "positive");
  d = f.d, d.stride_head = 63; /* heads of a token overlap */
  EXPECT_EINVAL(skv_layout_create(&f.g, &d, &lay), "stride_head=63");
  d = f.d, d.stride_token = 255; /* tokens overlap */
  EXPECT_EINVAL(skv_layout_create(&f.g, &d, &lay), "stride_token=255");
  d = f.d, d.stride_block = 16 * 4 * 64 - 1; /* blocks overlap */
  EXPECT_EINVAL(skv_layout_create(&f.g, &d, &lay), "stride_block");
  d = f.d, d.stride_token = 64, d.stride_head = 64; /* equal strides: cells coincide */
  EXPECT_EINVAL(skv_layout_create(&f.g, &d, &lay), "overlap");
  d = f.d, d.stride_token = 4 * 64 * 2, d.stride_block = 16 * 4 * 64; /* token span > block */
  EXPECT_EINVAL(skv_layout_create(&f.g, &d, &lay), "stride_block");
  /* HND strides, shape (heads, tokens, dim): valid; with stride_head short of a head's tokens
   * they are not. */
  d = f.d, d.stride_token = 64, d.stride_head = 16 * 64;
  cr_assert_eq(skv_layout_create(&f.g, &d, &lay), 0, "%s", skv_last_error());
  cr_assert_eq(lay->run_bytes, 64 * 2);
  skv_layout_destroy(lay);
  d.stride_head = 15 * 64;
  EXPECT_EINVAL(skv_layout_create(&f.g, &d, &lay), "stride_head");
  /* K and V overlap: same base, a partial overlap, one element apart */
  void *vs[2] = {f.k[0], f.v[1]};
  d = f.d, d.v_base = vs;
  EXPECT_EINVAL(skv_layout_create(&f.g, &d, &lay), "k_base[0] and desc.v_base[0] overlap");
  vs[0] = (uint8_t *)f.k[0] + 9 * 16 * 4 * 64 * 2; /* V's block 0 is K's block 9 */
  EXPECT_EINVAL(skv_layout_create(&f.g, &d, &lay), "overlap");
  vs[0] = (uint8_t *)f.k[0] + 2; /* one element apart */
  EXPECT_EINVAL(skv_layout_create(&f.g, &d, &lay), "overlap");
  /* ... and across layers */
  void *ks[2] = {f.k[0], (uint8_t *)f.k[0] + 16 * 4 * 64 * 2};
  d = f.d, d.k_base = ks;
  EXPECT_EINVAL(skv_layout_create(&f.g, &d, &lay), "k_base[1]");
  /* FlashInfer-like interleave with V exactly in K's gaps is fine; shifted by one element not */
  void *ki[2] = {f.mem, f.mem + 2 * 10 * 4096 * 2 + 4 * 4096 * 2}, *vi[2] = {f.mem + 4096 * 2};
  vi[1] = (uint8_t *)ki[1] + 4096 * 2;
  d = f.d, d.k_base = ki, d.v_base = vi, d.stride_block = 2 * 4096, d.num_blocks = 10;
  cr_assert_eq(skv_layout_create(&f.g, &d, &lay), 0, "%s", skv_last_error());
  skv_layout_destroy(lay);
  vi[0] = f.mem + 4096 * 2 - 2; /* V's block 0 covers K's block 0's last element */
  EXPECT_EINVAL(skv_layout_create(&f.g, &d, &lay), "k_base[0] and desc.v_base[0] overlap");
  vi[0] = f.mem + 4096 * 2 + 2; /* V's block 0 covers K's block 1's first element */
  EXPECT_EINVAL(skv_layout_create(&f.g, &d, &lay), "k_base[0] and desc.v_base[0] overlap");
  /* overflowing num_blocks */
  d = f.d, d.num_blocks = UINT64_MAX;
  EXPECT_EINVAL(skv_layout_create(&f.g, &d, &lay), "overflow");
  d = f.d, d.num_blocks = (1ull << 62) / 4096; /* fits in elements, not in bytes (x2) */
  EXPECT_EINVAL(skv_layout_create(&f.g, &d, &lay), "overflow");
  d = f.d, d.stride_block = INT64_MAX;
  EXPECT_EINVAL(skv_layout_create(&f.g, &d, &lay), "overflow");
  /* MLA: v_base must be NULL, one head */
  g = geom_make(SKV_KV_MLA, 2, 1, 64, 2, 16);
  d = f.d, d.stride_token = 64, d.stride_head = 64, d.stride_block = 16 * 64;
  EXPECT_EINVAL(skv_layout_create(&g, &d, &lay), "v_base");
  d.v_base = NULL;
  cr_assert_eq(skv_layout_create(&g, &d, &lay), 0, "%s", skv_last_error());
  cr_assert_eq(lay->kvn, 1);
  cr_assert_eq(lay->run_bytes, 16 * 64 * 2);
  skv_layout_destroy(lay);
  d.stride_head = 1; /* one head: any positive stride_head, still whole blocks */
  cr_assert_eq(skv_layout_create(&g, &d, &lay), 0, "%s", skv_last_error());
  cr_assert_eq(lay->run_bytes, 16 * 64 * 2);
  skv_layout_destroy(lay);
  g.num_kv_heads = 2;
  EXPECT_EINVAL(skv_layout_create(&g, &d, &lay), "num_kv_heads");
  free(f.mem);
}

Test(layout, bad_presets_and_block_ids, .init = quiet, .timeout = 10) {
  skv_geometry_t g = geom_make(SKV_KV_SPLIT, 2, 4, 64, 2, 16);
  skv_geometry_t gm = geom_make(SKV_KV_MLA, 2, 1, 576, 2, 16);
  uint64_t bytes;
  uint8_t *mem = xmalloc(1 << 20);
  void *ptrs[2] = {mem, mem + (1 << 19)};
  skv_layout_t *lay;
  EXPECT_EINVAL(skv_layout_get_preset_layer_bytes(&g, SKV_LAYOUT_CUSTOM, 16, 4, &bytes), "preset");
  EXPECT_EINVAL(skv_layout_get_preset_layer_bytes(&g, 7, 16, 4, &bytes), "preset");
  EXPECT_EINVAL(skv_layout_get_preset_layer_bytes(&g, SKV_LAYOUT_MLA, 16, 4, &bytes), "SKV_KV_MLA");
  EXPECT_EINVAL(skv_layout_get_preset_layer_bytes(&gm, SKV_LAYOUT_VLLM_FLASH_NHD, 16, 4, &bytes),
                "SKV_LAYOUT_MLA");
  EXPECT_EINVAL(skv_layout_get_preset_layer_bytes(&g, SKV_LAYOUT_VLLM_FLASH_NHD, 0, 4, &bytes),
                "block_tokens");
  EXPECT_EINVAL(skv_layout_get_preset_layer_bytes(&g, SKV_LAYOUT_VLLM_FLASH_NHD, 5, 4, &bytes),
                "does not divide");
  EXPECT_EINVAL(skv_layout_get_preset_layer_bytes(&g, SKV_LAYOUT_VLLM_FLASH_NHD, 16, 0, &bytes),
                "num_blocks");
  EXPECT_EINVAL(
      skv_layout_get_preset_layer_bytes(&g, SKV_LAYOUT_VLLM_FLASH_NHD, 16, UINT64_MAX, &bytes),
      "too large");
  EXPECT_EINVAL(
      skv_layout_get_preset_layer_bytes(&g, SKV_LAYOUT_FLASHINFER_HND, 16, 1ull << 50, &bytes),
      "too large");
  EXPECT_EINVAL(skv_layout_get_preset_layer_bytes(&g, SKV_LAYOUT_VLLM_FLASH_NHD, 16, 4, NULL),
                "bytes");
  EXPECT_EINVAL(skv_layout_create_preset(&g, SKV_LAYOUT_VLLM_FLASH_NHD, 16, 4, NULL, -1, &lay),
                "layer_ptrs");
  void *one[2] = {mem, NULL};
  EXPECT_EINVAL(skv_layout_create_preset(&g, SKV_LAYOUT_VLLM_FLASH_NHD, 16, 4, one, -1, &lay),
                "layer_ptrs[1]");
  cr_assert_eq(skv_layout_create_preset(&g, SKV_LAYOUT_CONTIGUOUS, 16, 4, one, -1, &lay), 0,
               "CONTIGUOUS uses layer_ptrs[0] only: %s", skv_last_error());
  skv_layout_destroy(lay);
  void *odd[2] = {mem + 1, mem + (1 << 19)};
  EXPECT_EINVAL(skv_layout_create_preset(&g, SKV_LAYOUT_VLLM_FLASH_HND, 16, 4, odd, -1, &lay),
                "aligned");
  void *same[2] = {mem, mem};
  EXPECT_EINVAL(skv_layout_create_preset(&g, SKV_LAYOUT_VLLM_FLASH_NHD, 16, 4, same, -1, &lay),
                "overlap");
  EXPECT_EINVAL(skv_layout_create_preset(&g, SKV_LAYOUT_VLLM_FLASH_NHD, 16, 4, ptrs, -2, &lay),
                "device");
  EXPECT_EINVAL(skv_layout_create_preset(&gm, SKV_LAYOUT_FLASHINFER_NHD, 16, 4, ptrs, -1, &lay),
                "SKV_LAYOUT_MLA");
  gm.num_kv_heads = 2;
  EXPECT_EINVAL(skv_layout_create_preset(&gm, SKV_LAYOUT_MLA, 16, 4, ptrs, -1, &lay),
                "num_kv_heads");
  skv_geometry_t gv = g;
  gv.size = 4;
  EXPECT_EINVAL(skv_layout_create_preset(&gv, SKV_LAYOUT_MLA, 16, 4, ptrs, -1, &lay), "geom.size");

  /* block ids: 8-token blocks, 2 per page, 4 blocks */
  cr_assert_eq(skv_layout_create_preset(&g, SKV_LAYOUT_VLLM_FLASH_NHD, 8, 4, ptrs, -1, &lay), 0);
  uint64_t ids[6] = {0, 3, 2, 1, 3, 4};
  cr_assert_eq(skv__check_block_ids(lay, ids, 2, "skv_kv_fetch"), 0, "%s", skv_last_error());
  cr_assert_eq(skv__check_block_ids(lay, NULL, 0, "skv_kv_fetch"), 0);
  EXPECT_EINVAL(skv__check_block_ids(lay, ids, 3, "skv_kv_fetch"), "block_ids[5]=4");
  EXPECT_EINVAL(skv__check_block_ids(lay, NULL, 1, "skv_kv_fetch"), "block_ids is NULL");
  EXPECT_EINVAL(skv__check_block_ids(lay, ids, SIZE_MAX / 2 + 1, "skv_kv_fetch"), "overflow");
  ids[0] = UINT64_MAX;
  EXPECT_EINVAL(skv__check_block_ids(lay, ids, 1, "skv_kv_fetch"), "block_ids[0]");
  EXPECT_EINVAL(skv__check_block_ids(NULL, ids, 1, "skv_kv_fetch"), "layout");
  skv_layout_destroy(lay);
  free(mem);
}
