/* Internal view of the node-wide KV cache: the data heap holding pages, the metadata heap
 * holding the pool records and the index shards, and the hooks of the CUDA data path. */
#ifndef SKV_KV_H
#define SKV_KV_H

#include "heap/heap.h"
#include "kv/keys.h"
#include "index/index.h"
#include "kv/layout.h"
#include "pool/pool.h"

struct skv_kv {
  skv_ctx_t *ctx;
  skv_geometry_t geom;
  uint64_t page_bytes;  /* bytes of page data */
  uint64_t page_stride; /* distance between pages in the data area */
  skv_heap_t *data;     /* pages: host, cuda or cuda_host */
  skv_heap_t *meta;     /* node-shared host memory: pool records + index shard per PE */
  skv_pool_t pool;
  skv_index_t index;
  skv_index_shard_hdr_t *shard_hdr[SKV_MAX_LOCAL_PES];
  skv_index_slot_t *shard_slots[SKV_MAX_LOCAL_PES];
  void *cuda; /* CUDA data path state (kv_cuda.c), NULL without it */
  /* this PE's counters */
  uint64_t lookups, lookup_hits, published, deduplicated, evicted, stale, index_full;
};

/* Address of a page (host-visible for host heaps, device address for cuda heaps). */
static inline void *skv__kv_page(const skv_kv_t *kv, uint32_t pe, uint32_t page) {
  return skv__heap_addr(kv->data, (int)pe,
                        kv->data->info.data_offset + (uint64_t)page * kv->page_stride);
}

/* Evict callback for the pool: erase the page's index entry. */
void skv__kv_evict_cb(void *arg, uint32_t page, uint32_t gen, uint64_t key_hi, uint64_t key_lo);
/* Check refs against the cache (pe, page in range). */
int skv__kv_check_refs(const skv_kv_t *kv, const skv_page_ref_t *refs, size_t n, const char *fn);

#ifdef SKV_WITH_CUDA
/* CUDA data path (kv_cuda.c): set up / tear down; fetch and publish for device layouts or
 * device-memory pages, stream-ordered. */
int skv__kv_cuda_init(skv_kv_t *kv);
void skv__kv_cuda_fini(skv_kv_t *kv);
int skv__kv_cuda_fetch(skv_kv_t *kv, const skv_page_ref_t *refs, size_t n, const skv_layout_t *dst,
                       const uint64_t *block_ids, uint32_t flags, void *stream);
int skv__kv_cuda_publish(skv_kv_t *kv, const skv_key_t *keys, size_t n, const skv_layout_t *src,
                         const uint64_t *block_ids, void *stream, size_t *ninserted);
int skv__kv_cuda_sync(skv_kv_t *kv);
#endif

#endif
