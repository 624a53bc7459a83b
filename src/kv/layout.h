/* Internal view of engine layouts (skv_layout_t) and the host copy between a page
 * ([layer][k|v][token][head][dim]) and the engine blocks a layout describes. */
#ifndef SKV_LAYOUT_H
#define SKV_LAYOUT_H

#include "kv/geometry.h"

/* ---- layout.c ------------------------------------------------------------------------- */

struct skv_layout {
  skv_geometry_t geom;
  int preset; /* SKV_LAYOUT_* */
  uint32_t block_tokens;
  uint32_t blocks_per_page; /* page_tokens / block_tokens */
  uint64_t num_blocks;
  int64_t stride_block, stride_token, stride_head; /* elements */
  int device;                                      /* -1 host, else CUDA device */
  uint32_t num_layers;  /* layers this layout covers: geom.num_layers, or fewer (a layer range) */
  uint32_t first_layer; /* the first of them (skv_layout_create_layers), else 0 */
  uint64_t page_off;    /* bytes of a page before first_layer's (where its copies start) */
  uint32_t kvn;         /* 2 or 1 (MLA) */
  char **base;          /* [num_layers * kvn]: base of layer l, k (0) / v (1) at [l*kvn + kv] */
  void *dev_base;       /* device copy of `base` for the kernels (CUDA layouts), else NULL */
  /* Contiguity the copy exploits: bytes of the longest run that is contiguous both in the
   * page and in a block (head_dim elements at least; a whole block's [token][head][dim] when
   * the engine stores NHD densely). */
  uint64_t run_bytes;
};

/* Bytes of a page that the layout's layers take (from page_off on: pages are
 * [layer][k|v][token][head][dim]). */
static inline uint64_t skv__layout_page_bytes(const skv_layout_t *lay) {
  return (uint64_t)lay->num_layers * lay->kvn * skv__geometry_slab_bytes(&lay->geom);
}

/* ---- copy_host.c ---------------------------------------------------------------------- */

/* Copy one page at `page` into the m = blocks_per_page engine blocks block_ids[0..m). Block ids
 * must have been checked against num_blocks. `stream`: non-temporal stores for runs of 256
 * bytes and more (for copies larger than the caches; call skv__copy_stream_fence after the
 * last one). */
void skv__copy_page_to_blocks(const skv_layout_t *lay, const void *page, const uint64_t *block_ids,
                              bool stream);
/* Prefetch the first line of a page that skv__copy_page_to_blocks will copy next, and of its
 * first destination: their address translations (a TLB miss each on 4 KiB pages, as the pages
 * and blocks of a batch lie far apart) then overlap the copy before. */
void skv__copy_page_prefetch(const skv_layout_t *lay, const void *page, const uint64_t *block_ids);
/* The reverse: engine blocks into the page. */
void skv__copy_blocks_to_page(const skv_layout_t *lay, void *page, const uint64_t *block_ids,
                              bool stream);
/* Order the non-temporal stores of streaming copies before what follows. */
void skv__copy_stream_fence(void);
/* Copies of at least this many bytes in one call stream (beyond the caches). */
#define SKV_COPY_STREAM_BYTES (8ull << 20)
/* Check n * blocks_per_page block ids against num_blocks; the error names the first bad one. */
int skv__check_block_ids(const skv_layout_t *lay, const uint64_t *block_ids, size_t npages,
                         const char *fn);

#endif
