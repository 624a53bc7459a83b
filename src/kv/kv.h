/* Internal view of the node-wide KV cache: the data heap holding pages, the metadata heap
 * holding the pool records and the index shards, and the CUDA copy backend it drives. */
#ifndef SKV_KV_H
#define SKV_KV_H

#include "domain/domain.h"
#include "heap/heap.h"
#include "kv/keys.h"
#include "kv/kv_cuda.h"
#include "kv/kv_prof.h"
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
  skv__pool_t pool;
  skv__index_t index;
  skv__index_shard_hdr_t *shard_hdr[SKV_MAX_LOCAL_PES];
  skv__index_slot_t *shard_slots[SKV_MAX_LOCAL_PES];
  skv__kvc_t *cuda;      /* the CUDA copy backend (kv_cuda.c), NULL for host pages */
  skv__domain_t *domain; /* an attached cache's domain (skv_kv_attach), else NULL */
  /* this PE's counters */
  uint64_t lookups, lookup_hits, published, deduplicated, evicted, stale, index_full;
  /* evictions and index erases an eviction pass has not counted yet (under the pool's mu) */
  uint64_t evicted_backlog, erased_backlog;
  skv__kv_prof_t prof; /* where the data path's time goes (off unless switched on) */
  /* publish's helper thread (claims the next window's keys), made at the first publish that
   * uses it; helper_busy: a publish uses it (one at a time), helper_off: none (off, or failed) */
  skv__helper_t *helper;
  int helper_busy;
  bool helper_off;
  /* pages kept free by evicting ahead (skv_kv_set_free_reserve; atomic), the helper's eviction
   * posted and not joined yet (reclaim_pending: owned by whoever holds helper_busy), and the
   * flag that stops it (atomic) */
  uint64_t free_reserve;
  bool reclaim_pending;
  int reclaim_stop;
  /* the next cache whose pool lock a fork waits for (kv.c, fork_prepare: every cache with a
   * helper is listed) */
  struct skv_kv *fork_next;
};

/* Address of a page (host-visible for host heaps, device address for cuda heaps). */
static inline void *skv__kv_page(const skv_kv_t *kv, uint32_t pe, uint32_t page) {
  return skv__heap_addr(kv->data, (int)pe,
                        kv->data->info.data_offset + (uint64_t)page * kv->page_stride);
}

/* Device publish: the launches a large batch is split into, at most (kv.c, PUB_CHUNK); 1: one
 * launch per argument slot's worth of pages, as before. symkv-bench fetch compares the two. */
extern int skv__kv_pub_split;
/* Tests: microseconds a gated fetch sleeps between two runs of pins (0), so that its copy is
 * seen to read the runs opened before the gate closes. */
extern int skv__kv_gate_delay_us;

/* Evict callback for the pool: erase the page's index entry. */
void skv__kv_evict_cb(void *arg, uint32_t page, uint32_t gen, uint64_t key_hi, uint64_t key_lo);

#endif
