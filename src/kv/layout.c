/* Engine layouts: a custom descriptor checked so that no two elements symkv may touch share a
 * byte, the presets' bases and strides from their tensor shapes, and a preset tensor's size. */
#include "kv/layout.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* How it works: the elements a layout lets symkv touch in one (layer, k|v) tensor are
 *   base + (b * stride_block + t * stride_token + h * stride_head + d) * elem_bytes
 * for b < num_blocks, t < block_tokens, h < num_kv_heads, d < head_dim. Sorted by stride, the
 * three levels (blocks, tokens, heads; a level of one item drops out) must nest: each stride is
 * at least the extent of what lies below it, (count - 1) * stride + extent, with head_dim
 * elements at the bottom. Then every element has one address (no write of a fetch lands on
 * another one's element) and a tensor spans extent(top level) elements. Two tensors (K and V
 * of a layer, or different layers) at distance delta overlap iff some delta - sum k_i * stride_i
 * with |k_i| < count_i is within (-head_dim, head_dim); the nesting leaves at most two
 * candidates k_i per level (see nest_overlap), so the exact check costs at most 2^3 steps. That
 * accepts K and V interleaved per block (FlashInfer) or per token, which an extent check would
 * reject.
 *
 * What can go wrong: a layout whose strides do not nest in any order (e.g. head_dim 1, strides
 * 3 and 4 over 3 tokens and 2 heads) can be free of overlaps and still be rejected; it would be
 * the engine's odd layout, and the error says which stride to look at. Address arithmetic is
 * overflow-checked: a tensor must end below 2^63 bytes from its base and not wrap the address
 * space. Nothing here reads the memory (device layouts hold GPU addresses). */

typedef struct level {
  uint64_t count;
  int64_t stride;  /* elements */
  uint64_t extent; /* elements spanned by this level's items and everything below them */
  const char *name;
} level_t;

static const char *const preset_names[] = {"CUSTOM",         "VLLM_FLASH_NHD", "VLLM_FLASH_HND",
                                           "FLASHINFER_NHD", "FLASHINFER_HND", "MLA",
                                           "CONTIGUOUS"};

static int64_t floor_div(int64_t a, int64_t s) { /* s > 0 */
  int64_t q = a / s;
  return (a % s < 0) ? q - 1 : q;
}

/* Whether S and S + delta share an element, S being the nest lv[0..n) (outermost first) over
 * head_dim contiguous elements. Items k apart at level 0 put their sub-nests at distance
 * delta - k * stride; those can meet only when that is within the sub-nest's extent, which the
 * nesting keeps at most `stride`: only k = floor(delta / stride) and the next one remain. */
static bool nest_overlap(const level_t *lv, int n, int64_t dim, int64_t delta) {
  if (n == 0) return delta > -dim && delta < dim;
  int64_t inner = n > 1 ? (int64_t)lv[1].extent : dim;
  int64_t kmax = (int64_t)(lv[0].count - 1);
  int64_t k0 = floor_div(delta, lv[0].stride);
  for (int64_t k = k0; k <= k0 + 1; k++) {
    if (k < -kmax || k > kmax) continue;
    int64_t d = delta - k * lv[0].stride;
    if (d > -inner && d < inner && nest_overlap(lv + 1, n - 1, dim, d)) return true;
  }
  return false;
}

/* Build the nest of a layout (levels with more than one item, by decreasing stride), check that
 * it nests and give the tensor's extent in elements. */
static int build_nest(const skv_geometry_t *g, const skv_layout_desc_t *d, const char *fn,
                      level_t *lv, int *nlev, uint64_t *extent) {
  level_t all[3] = {{d->num_blocks, d->stride_block, 0, "block"},
                    {d->block_tokens, d->stride_token, 0, "token"},
                    {g->num_kv_heads, d->stride_head, 0, "head"}};
  int n = 0;
  for (int i = 0; i < 3; i++)
    if (all[i].count > 1) lv[n++] = all[i];
  for (int i = 1; i < n; i++) /* insertion sort, decreasing stride */
    for (int j = i; j > 0 && lv[j].stride > lv[j - 1].stride; j--) {
      level_t t = lv[j];
      lv[j] = lv[j - 1];
      lv[j - 1] = t;
    }
  uint64_t below = g->head_dim;
  char what[160];
  snprintf(what, sizeof what, "head_dim %u", g->head_dim);
  for (int i = n - 1; i >= 0; i--) {
    if ((uint64_t)lv[i].stride < below)
      return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_KV,
                      "%s: desc.stride_%s=%" PRId64 " is less than %" PRIu64 ", the elements one "
                      "%s spans (%s): two %ss would overlap. Strides are in elements, not bytes, "
                      "and must nest: sorted by size, each stride at least the extent of what "
                      "lies inside it (stride_head >= head_dim for NHD, stride_token >= "
                      "head_dim for HND)",
                      fn, lv[i].name, lv[i].stride, below, lv[i].name, what, lv[i].name);
    uint64_t ext;
    if (__builtin_mul_overflow(lv[i].count - 1, (uint64_t)lv[i].stride, &ext) ||
        __builtin_add_overflow(ext, below, &ext) || ext > (uint64_t)INT64_MAX / g->elem_bytes)
      return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_KV,
                      "%s: %" PRIu64 " %ss x desc.stride_%s=%" PRId64 " x %u bytes overflow "
                      "(over 2^63 bytes): check num_blocks and the strides (in elements)",
                      fn, lv[i].count, lv[i].name, lv[i].name, lv[i].stride, g->elem_bytes);
    lv[i].extent = ext;
    below = ext;
    snprintf(what, sizeof what, "%" PRIu64 " %ss x stride_%s %" PRId64 " and what lies inside",
             lv[i].count, lv[i].name, lv[i].name, lv[i].stride);
  }
  *nlev = n;
  *extent = below;
  return 0;
}

typedef struct tensor_ref {
  uintptr_t addr;
  uint32_t idx; /* layer * kvn + kv */
} tensor_ref_t;

static int cmp_tensor(const void *a, const void *b) {
  uintptr_t x = ((const tensor_ref_t *)a)->addr, y = ((const tensor_ref_t *)b)->addr;
  return x < y ? -1 : x > y;
}

static const char *kv_name(const skv_geometry_t *g, uint32_t idx) {
  return g->kv_kind == SKV_KV_MLA ? "k_base" : (idx % 2 ? "v_base" : "k_base");
}

/* Validate `d` for `g` and make the layout (`preset` is recorded). `fn` prefixes errors. */
static int layout_build(const skv_geometry_t *g, const skv_layout_desc_t *d, int preset,
                        const char *fn, skv_layout_t **out) {
  const uint32_t kvn = skv__geometry_kvn(g), L = g->num_layers, e = g->elem_bytes;
  SKV_ARG_CHECK(d->block_tokens >= 1 && g->page_tokens % d->block_tokens == 0, SKV_SUBSYS_KV,
                "%s: desc.block_tokens=%u does not divide the geometry's page_tokens=%u: pick "
                "page_tokens as a multiple of the engine's block size",
                fn, d->block_tokens, g->page_tokens);
  SKV_ARG_CHECK(d->num_blocks >= 1, SKV_SUBSYS_KV,
                "%s: desc.num_blocks=0: give the number of blocks of the engine's cache", fn);
  SKV_ARG_CHECK(d->device >= -1, SKV_SUBSYS_KV,
                "%s: desc.device=%d: use -1 for host memory or a CUDA device ordinal", fn,
                (int)d->device);
  SKV_ARG_CHECK(d->k_base, SKV_SUBSYS_KV,
                "%s: desc.k_base is NULL: pass an array of num_layers=%u base addresses", fn, L);
  if (kvn == 1)
    SKV_ARG_CHECK(!d->v_base, SKV_SUBSYS_KV,
                  "%s: desc.v_base is set but the geometry is SKV_KV_MLA (one latent per token, "
                  "in k_base): pass NULL",
                  fn);
  else
    SKV_ARG_CHECK(d->v_base, SKV_SUBSYS_KV,
                  "%s: desc.v_base is NULL: pass an array of num_layers=%u V base addresses "
                  "(NULL only for SKV_KV_MLA geometries)",
                  fn, L);
  SKV_ARG_CHECK(d->stride_block > 0 && d->stride_token > 0 && d->stride_head > 0, SKV_SUBSYS_KV,
                "%s: desc.stride_block=%" PRId64 ", stride_token=%" PRId64 ", stride_head=%" PRId64
                ": every stride must be positive (in elements; any positive value where the "
                "level has one item)",
                fn, d->stride_block, d->stride_token, d->stride_head);

  level_t lv[3];
  int nlev = 0;
  uint64_t extent = 0;
  SKV_CHECK(build_nest(g, d, fn, lv, &nlev, &extent));
  const uint64_t ext_bytes = extent * e; /* <= INT64_MAX: checked by build_nest */

  tensor_ref_t *refs = malloc((size_t)L * kvn * sizeof *refs);
  if (!refs) return SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_KV, "%s: out of memory", fn);
  int rc = 0;
  for (uint32_t i = 0; i < L * kvn && rc == 0; i++) {
    const void *p = (kvn == 1 || i % 2 == 0) ? d->k_base[i / kvn] : d->v_base[i / kvn];
    uintptr_t a = (uintptr_t)p;
    if (!p)
      rc = SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_KV, "%s: desc.%s[%u] is NULL: every layer needs one", fn,
                    kv_name(g, i), i / kvn);
    else if (a % e)
      rc = SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_KV,
                    "%s: desc.%s[%u]=%p is not aligned to elem_bytes=%u: pass the address of "
                    "element 0 of the tensor",
                    fn, kv_name(g, i), i / kvn, p, e);
    else if (a > UINTPTR_MAX - ext_bytes)
      rc = SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_KV,
                    "%s: desc.%s[%u]=%p plus the %" PRIu64 " bytes the strides span wraps the "
                    "address space: check the base and num_blocks",
                    fn, kv_name(g, i), i / kvn, p, ext_bytes);
    refs[i].addr = a;
    refs[i].idx = i;
  }
  /* No two tensors may share an element: sorted by address, only those closer than a tensor's
   * extent can meet. */
  if (rc == 0) qsort(refs, (size_t)L * kvn, sizeof *refs, cmp_tensor);
  for (uint32_t i = 0; i < L * kvn && rc == 0; i++)
    for (uint32_t j = i + 1; j < L * kvn && rc == 0; j++) {
      uint64_t dist = refs[j].addr - refs[i].addr;
      if (dist >= ext_bytes) break;
      if (nest_overlap(lv, nlev, g->head_dim, (int64_t)(dist / e))) {
        uint32_t a = SKV_MIN(refs[i].idx, refs[j].idx), b = SKV_MAX(refs[i].idx, refs[j].idx);
        rc = SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_KV,
                      "%s: desc.%s[%u] and desc.%s[%u] overlap (%" PRIu64 " bytes apart, each "
                      "spanning %" PRIu64 " bytes with these strides): K and V of each layer, "
                      "and every layer, need their own elements",
                      fn, kv_name(g, a), a / kvn, kv_name(g, b), b / kvn, dist, ext_bytes);
      }
    }
  if (rc == 0) {
    skv_layout_t *lay = calloc(1, sizeof *lay + (size_t)L * kvn * sizeof(char *));
    if (!lay) {
      rc = SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_KV, "%s: out of memory", fn);
    } else {
      lay->geom = *g;
      lay->preset = preset;
      lay->block_tokens = d->block_tokens;
      lay->blocks_per_page = g->page_tokens / d->block_tokens;
      lay->num_blocks = d->num_blocks;
      /* A level with one item is only ever indexed 0: its stride (any positive value, not
       * range-checked) is kept as 0, so that byte strides (stride * elem_bytes) cannot overflow
       * in the copies and do not spoil their alignment checks. */
      lay->stride_block = d->num_blocks > 1 ? d->stride_block : 0;
      lay->stride_token = d->block_tokens > 1 ? d->stride_token : 0;
      lay->stride_head = g->num_kv_heads > 1 ? d->stride_head : 0;
      lay->device = d->device;
      lay->num_layers = L;
      lay->kvn = kvn;
      lay->base = (char **)(lay + 1);
      for (uint32_t l = 0; l < L; l++) {
        lay->base[l * kvn] = (char *)d->k_base[l];
        if (kvn == 2) lay->base[l * kvn + 1] = (char *)d->v_base[l];
      }
      lay->dev_base = NULL; /* filled by the CUDA data path for device layouts */
      const uint64_t H = g->num_kv_heads, D = g->head_dim, T = d->block_tokens;
      lay->run_bytes = D * e;
      if (H == 1 || (uint64_t)d->stride_head == D) {
        lay->run_bytes = H * D * e;
        if (T == 1 || (uint64_t)d->stride_token == H * D) lay->run_bytes = T * H * D * e;
      }
      *out = lay;
      SKV_TRACE(SKV_SUBSYS_KV,
                "%s: layout %s, %u layers x %u, %" PRIu64 " blocks of %u tokens, strides %" PRId64
                "/%" PRId64 "/%" PRId64 ", device %d, runs of %" PRIu64 " bytes",
                fn, preset_names[preset], L, kvn, d->num_blocks, d->block_tokens, d->stride_block,
                d->stride_token, d->stride_head, (int)d->device, lay->run_bytes);
    }
  }
  free(refs);
  return rc;
}

int skv_layout_create(const skv_geometry_t *geom, const skv_layout_desc_t *desc,
                      skv_layout_t **layout) {
  SKV_ARG_CHECK(layout, SKV_SUBSYS_KV, "skv_layout_create: layout (the result pointer) is NULL");
  *layout = NULL;
  SKV_CHECK(skv__geometry_check(geom, "skv_layout_create: geom", NULL));
  SKV_ARG_CHECK(desc, SKV_SUBSYS_KV,
                "skv_layout_create: desc is NULL: describe the engine's KV cache "
                "(SKV_LAYOUT_DESC_INIT) or use skv_layout_create_preset");
  SKV_ARG_CHECK(desc->size == sizeof(skv_layout_desc_t) && desc->version >= 1 &&
                    desc->version <= SKV_LAYOUT_DESC_VERSION,
                SKV_SUBSYS_KV,
                "skv_layout_create: desc.size=%zu / desc.version=%u: this library expects size "
                "%zu and version 1..%d; initialise with SKV_LAYOUT_DESC_INIT from a matching "
                "symkv.h",
                desc->size, desc->version, sizeof(skv_layout_desc_t), SKV_LAYOUT_DESC_VERSION);
  return layout_build(geom, desc, SKV_LAYOUT_CUSTOM, "skv_layout_create", layout);
}

/* ---- presets ------------------------------------------------------------------------------ */

typedef struct preset_shape {
  int64_t sb, st, sh; /* strides, elements */
  uint64_t v_off;     /* bytes from a layer's tensor to its V (0: MLA) */
  uint64_t layer_off; /* CONTIGUOUS: bytes from layer l's K to layer l+1's K */
  uint64_t bytes;     /* bytes of the tensor behind one layer_ptrs entry */
} preset_shape_t;

static int preset_shape(const skv_geometry_t *g, int preset, uint32_t block_tokens,
                        uint64_t num_blocks, const char *fn, preset_shape_t *s) {
  SKV_ARG_CHECK(preset >= SKV_LAYOUT_VLLM_FLASH_NHD && preset <= SKV_LAYOUT_CONTIGUOUS,
                SKV_SUBSYS_KV,
                "%s: preset=%d is not an SKV_LAYOUT_* preset (1..6); describe other layouts "
                "with skv_layout_create",
                fn, preset);
  const bool mla = g->kv_kind == SKV_KV_MLA;
  if (preset == SKV_LAYOUT_MLA)
    SKV_ARG_CHECK(mla, SKV_SUBSYS_KV,
                  "%s: preset SKV_LAYOUT_MLA needs a geometry with kv_kind SKV_KV_MLA; for K and "
                  "V use a VLLM_FLASH_* or FLASHINFER_* preset",
                  fn);
  else if (preset != SKV_LAYOUT_CONTIGUOUS)
    SKV_ARG_CHECK(!mla, SKV_SUBSYS_KV,
                  "%s: preset SKV_LAYOUT_%s holds K and V but the geometry is SKV_KV_MLA: use "
                  "SKV_LAYOUT_MLA",
                  fn, preset_names[preset]);
  SKV_ARG_CHECK(block_tokens >= 1 && g->page_tokens % block_tokens == 0, SKV_SUBSYS_KV,
                "%s: block_tokens=%u does not divide the geometry's page_tokens=%u: pick "
                "page_tokens as a multiple of the engine's block size",
                fn, block_tokens, g->page_tokens);
  SKV_ARG_CHECK(num_blocks >= 1, SKV_SUBSYS_KV,
                "%s: num_blocks=0: give the number of blocks of the engine's cache", fn);
  const uint64_t T = block_tokens, H = g->num_kv_heads, D = g->head_dim, e = g->elem_bytes;
  const uint64_t kvn = skv__geometry_kvn(g);
  const uint64_t blk = T * H * D; /* elements of one block of one tensor; < 2^42 */
  memset(s, 0, sizeof *s);
  uint64_t per_block; /* elements of all tensors behind one layer_ptrs entry, per block */
  switch (preset) {
  case SKV_LAYOUT_VLLM_FLASH_NHD:
  case SKV_LAYOUT_VLLM_FLASH_HND: /* (2, num_blocks, ...): all K blocks, then all V blocks */
    s->sb = (int64_t)blk;
    per_block = 2 * blk;
    break;
  case SKV_LAYOUT_FLASHINFER_NHD:
  case SKV_LAYOUT_FLASHINFER_HND: /* (num_blocks, 2, ...): K and V of a block side by side */
    s->sb = (int64_t)(2 * blk);
    s->v_off = blk * e;
    per_block = 2 * blk;
    break;
  case SKV_LAYOUT_MLA:
    s->sb = (int64_t)blk;
    per_block = blk;
    break;
  default: /* CONTIGUOUS: block b is a page of block_tokens tokens, all layers */
    s->sb = (int64_t)(g->num_layers * kvn * blk);
    s->v_off = blk * e;
    s->layer_off = kvn * blk * e;
    per_block = (uint64_t)s->sb;
    break;
  }
  bool hnd = preset == SKV_LAYOUT_VLLM_FLASH_HND || preset == SKV_LAYOUT_FLASHINFER_HND;
  s->st = (int64_t)(hnd ? D : H * D);
  s->sh = (int64_t)(hnd ? T * D : D);
  if (__builtin_mul_overflow(num_blocks, per_block, &s->bytes) ||
      __builtin_mul_overflow(s->bytes, e, &s->bytes) || s->bytes > (uint64_t)INT64_MAX)
    return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_KV,
                    "%s: num_blocks=%" PRIu64 " is too large: the %s tensor would be over 2^63 "
                    "bytes",
                    fn, num_blocks, preset_names[preset]);
  if (preset == SKV_LAYOUT_VLLM_FLASH_NHD || preset == SKV_LAYOUT_VLLM_FLASH_HND)
    s->v_off = s->bytes / 2;
  return 0;
}

int skv_layout_get_preset_layer_bytes(const skv_geometry_t *geom, skv_layout_preset_t preset,
                                      uint32_t block_tokens, uint64_t num_blocks, uint64_t *bytes) {
  const char *fn = "skv_layout_get_preset_layer_bytes";
  SKV_ARG_CHECK(bytes, SKV_SUBSYS_KV, "%s: bytes (the result pointer) is NULL", fn);
  *bytes = 0;
  SKV_CHECK(skv__geometry_check(geom, "skv_layout_get_preset_layer_bytes: geom", NULL));
  preset_shape_t s;
  SKV_CHECK(preset_shape(geom, preset, block_tokens, num_blocks, fn, &s));
  *bytes = s.bytes;
  return 0;
}

int skv_layout_create_preset(const skv_geometry_t *geom, skv_layout_preset_t preset,
                             uint32_t block_tokens, uint64_t num_blocks, void *const *layer_ptrs,
                             int device, skv_layout_t **layout) {
  const char *fn = "skv_layout_create_preset";
  SKV_ARG_CHECK(layout, SKV_SUBSYS_KV, "%s: layout (the result pointer) is NULL", fn);
  *layout = NULL;
  SKV_CHECK(skv__geometry_check(geom, "skv_layout_create_preset: geom", NULL));
  preset_shape_t s;
  SKV_CHECK(preset_shape(geom, preset, block_tokens, num_blocks, fn, &s));
  const uint32_t L = geom->num_layers, kvn = skv__geometry_kvn(geom);
  const uint32_t nptr = preset == SKV_LAYOUT_CONTIGUOUS ? 1 : L;
  SKV_ARG_CHECK(layer_ptrs, SKV_SUBSYS_KV, "%s: layer_ptrs is NULL: pass %s", fn,
                nptr == 1 ? "an array whose entry 0 is the cache" : "one tensor per layer");
  for (uint32_t l = 0; l < nptr; l++) {
    uintptr_t a = (uintptr_t)layer_ptrs[l];
    SKV_ARG_CHECK(a, SKV_SUBSYS_KV, "%s: layer_ptrs[%u] is NULL (the preset needs %u entries)", fn,
                  l, nptr);
    SKV_ARG_CHECK(a % geom->elem_bytes == 0, SKV_SUBSYS_KV,
                  "%s: layer_ptrs[%u]=%p is not aligned to elem_bytes=%u", fn, l, layer_ptrs[l],
                  geom->elem_bytes);
    SKV_ARG_CHECK(a <= UINTPTR_MAX - s.bytes, SKV_SUBSYS_KV,
                  "%s: layer_ptrs[%u]=%p plus the tensor's %" PRIu64 " bytes wraps the address "
                  "space: check num_blocks",
                  fn, l, layer_ptrs[l], s.bytes);
  }
  void **ptrs = malloc(2 * (size_t)L * sizeof *ptrs);
  if (!ptrs) return SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_KV, "%s: out of memory", fn);
  void **k = ptrs, **v = ptrs + L;
  for (uint32_t l = 0; l < L; l++) {
    uintptr_t a = preset == SKV_LAYOUT_CONTIGUOUS ? (uintptr_t)layer_ptrs[0] + l * s.layer_off
                                                  : (uintptr_t)layer_ptrs[l];
    k[l] = (void *)a;
    v[l] = (void *)(a + s.v_off);
  }
  skv_layout_desc_t d = SKV_LAYOUT_DESC_INIT;
  d.block_tokens = block_tokens;
  d.num_blocks = num_blocks;
  d.k_base = k;
  d.v_base = kvn == 2 ? v : NULL;
  d.stride_block = s.sb;
  d.stride_token = s.st;
  d.stride_head = s.sh;
  d.device = device;
  int rc = layout_build(geom, &d, preset, fn, layout);
  free(ptrs);
  return rc;
}

int skv_layout_create_layers(const skv_layout_t *layout, uint32_t first, uint32_t n,
                             skv_layout_t **sub) {
  const char *fn = "skv_layout_create_layers";
  SKV_ARG_CHECK(sub, SKV_SUBSYS_KV, "%s: sub (the result pointer) is NULL", fn);
  *sub = NULL;
  SKV_ARG_CHECK(layout, SKV_SUBSYS_KV, "%s: layout is NULL", fn);
  const uint32_t lo = layout->first_layer, hi = layout->first_layer + layout->num_layers;
  SKV_ARG_CHECK(n >= 1 && first >= lo && first < hi && n <= hi - first, SKV_SUBSYS_KV,
                "%s: layers [%u, %u + %u) are not a non-empty range inside the layers [%u, %u) "
                "this layout covers (of the geometry's %u)",
                fn, first, first, n, lo, hi, layout->geom.num_layers);
  const uint32_t kvn = layout->kvn;
  skv_layout_t *lay = calloc(1, sizeof *lay + (size_t)n * kvn * sizeof(char *));
  if (!lay) return SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_KV, "%s: out of memory", fn);
  *lay = *layout;
  lay->num_layers = n;
  lay->first_layer = first;
  lay->page_off = (uint64_t)first * kvn * skv__geometry_slab_bytes(&layout->geom);
  lay->base = (char **)(lay + 1);
  memcpy(lay->base, layout->base + (size_t)(first - lo) * kvn, (size_t)n * kvn * sizeof(char *));
  lay->dev_base = NULL;
  *sub = lay;
  return 0;
}

int skv_layout_destroy(skv_layout_t *layout) {
  /* The pointer array lives in the same allocation. This file never allocates dev_base: a
   * device copy made by the CUDA data path is that path's to release. */
  free(layout);
  return 0;
}
