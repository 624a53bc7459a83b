/* Internal view of KV geometries (skv_geometry_t): validation, the size of one page
 * ([layer][k|v][token][head][dim]) and of its parts, equality. */
#ifndef SKV_GEOMETRY_H
#define SKV_GEOMETRY_H

#include "core/core.h"

/* Validate (errors name the field, prefixed by `what`) and compute derived sizes. */
int skv__geometry_check(const skv_geometry_t *g, const char *what, uint64_t *page_bytes);
/* K and V (2) or the MLA latent (1). */
static inline uint32_t skv__geometry_kvn(const skv_geometry_t *g) {
  return g->kv_kind == SKV_KV_MLA ? 1u : 2u;
}
/* Bytes of one [token][head][dim] slab of one layer and one of k/v within a page. */
static inline uint64_t skv__geometry_slab_bytes(const skv_geometry_t *g) {
  return (uint64_t)g->page_tokens * g->num_kv_heads * g->head_dim * g->elem_bytes;
}

/* Same geometry (every field but size and version)? */
bool skv__geometry_equal(const skv_geometry_t *a, const skv_geometry_t *b);

#endif
