/* KV geometries: validation of skv_geometry_t field by field and the size of one page,
 * [layer][k|v][token][head][dim] with elem_bytes per element. */
#include "kv/geometry.h"

#include <inttypes.h>

#define PAGE_BYTES_MAX (4ull << 30) /* 4 GiB: page offsets and sizes fit in 32-bit counts */

/* One range check of a uint32 field; the message names `what`.field and the allowed range. */
static int check_range(const char *what, const char *field, uint32_t v, uint32_t lo, uint32_t hi) {
  if (v >= lo && v <= hi) return 0;
  return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_KV, "%s.%s=%u is not in %u..%u: set it in the geometry",
                  what, field, v, lo, hi);
}

int skv__geometry_check(const skv_geometry_t *g, const char *what, uint64_t *page_bytes) {
  if (page_bytes) *page_bytes = 0;
  if (!what) what = "geometry";
  if (!g)
    return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_KV,
                    "%s is NULL: describe the KV pages with an skv_geometry_t (SKV_GEOMETRY_INIT)",
                    what);
  if (g->size != sizeof(skv_geometry_t) || g->version == 0 || g->version > SKV_GEOMETRY_VERSION)
    return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_KV,
                    "%s.size=%zu / %s.version=%u: this library expects size %zu and version 1..%d; "
                    "initialise the struct with SKV_GEOMETRY_INIT from a matching symkv.h",
                    what, g->size, what, g->version, sizeof(skv_geometry_t), SKV_GEOMETRY_VERSION);
  if (g->kv_kind != SKV_KV_SPLIT && g->kv_kind != SKV_KV_MLA)
    return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_KV,
                    "%s.kv_kind=%u is neither SKV_KV_SPLIT (0) nor SKV_KV_MLA (1)", what,
                    g->kv_kind);
  SKV_CHECK(check_range(what, "num_layers", g->num_layers, 1, 1024));
  SKV_CHECK(check_range(what, "num_kv_heads", g->num_kv_heads, 1, 1024));
  SKV_CHECK(check_range(what, "head_dim", g->head_dim, 1, 65536));
  SKV_CHECK(check_range(what, "page_tokens", g->page_tokens, 1, 65536));
  if (g->elem_bytes != 1 && g->elem_bytes != 2 && g->elem_bytes != 4)
    return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_KV,
                    "%s.elem_bytes=%u is not 1 (fp8), 2 (bf16/fp16) or 4 (fp32)", what,
                    g->elem_bytes);
  if (g->kv_kind == SKV_KV_MLA && g->num_kv_heads != 1)
    return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_KV,
                    "%s.num_kv_heads=%u but kv_kind is SKV_KV_MLA, whose one latent vector per "
                    "token is shared by all heads: set num_kv_heads to 1 and head_dim to the "
                    "latent width (e.g. 576)",
                    what, g->num_kv_heads);
  /* The ranges above bound the product by 2^55, but keep the arithmetic checked anyway. */
  uint64_t b = skv__geometry_kvn(g);
  if (__builtin_mul_overflow(b, (uint64_t)g->num_layers, &b) ||
      __builtin_mul_overflow(b, skv__geometry_slab_bytes(g), &b) || b > PAGE_BYTES_MAX)
    return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_KV,
                    "%s: a page of %u layers x %u x %u tokens x %u heads x %u x %u bytes is over "
                    "4 GiB: lower %s.page_tokens",
                    what, g->num_layers, skv__geometry_kvn(g), g->page_tokens, g->num_kv_heads,
                    g->head_dim, g->elem_bytes, what);
  if (page_bytes) *page_bytes = b;
  return 0;
}

int skv_geometry_get_page_bytes(const skv_geometry_t *geom, uint64_t *page_bytes) {
  SKV_ARG_CHECK(page_bytes, SKV_SUBSYS_KV,
                "skv_geometry_get_page_bytes: page_bytes (the result pointer) is NULL");
  return skv__geometry_check(geom, "skv_geometry_get_page_bytes: geom", page_bytes);
}

bool skv__geometry_equal(const skv_geometry_t *a, const skv_geometry_t *b) {
  if (a == b) return true;
  if (!a || !b) return false;
  /* size and version describe the struct, not the geometry: they are not compared. */
  return a->kv_kind == b->kv_kind && a->num_layers == b->num_layers &&
         a->num_kv_heads == b->num_kv_heads && a->head_dim == b->head_dim &&
         a->elem_bytes == b->elem_bytes && a->page_tokens == b->page_tokens;
}
