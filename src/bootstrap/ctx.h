/* Internal view of a context (skv_ctx_t): the resolved configuration, the bootstrap store,
 * the node's PEs, and the collective check every collective call goes through. */
#ifndef SKV_CTX_H
#define SKV_CTX_H

#include "bootstrap/bootstrap.h"
#include "core/core.h"

#include <pthread.h>

#define SKV_MAX_LOCAL_PES     64
#define SKV_CTX_DEFERRED_KEYS 16 /* store keys awaiting deletion at the next collective check */

struct skv_ctx {
  skv__cfg_resolved_t cfg;
  skv__store_t *store;
  skv__store_server_t *server; /* rank 0 only */
  pthread_mutex_t mu;
  uint64_t coll_seq; /* collective calls made so far (same on every PE when in step) */
  int nlocal;        /* PEs on this node */
  int local_index;   /* this PE among them (ordered by rank) */
  int local_ranks[SKV_MAX_LOCAL_PES]; /* global rank of each local PE */
  uint64_t job_id;                    /* random, equal on every PE: names node-wide objects */
  int device;                         /* CUDA device once chosen, else -1 */
  void *cuda;                         /* backend state of the CUDA layer (src/heap/heap_cuda.c) */
  /* this PE's store keys of collectives already done (skv__coll_forget_later), deleted once
   * the next collective check proves every PE has read them */
  char deferred[SKV_CTX_DEFERRED_KEYS][SKV_BOOT_MAX_KEY + 16]; /* as the keys built for them */
  int ndeferred;
};

/* Collective check: every PE describes the collective it is entering ("skv_heap_create(backend
 * =host, data_bytes=4096)"); descriptions are allgathered under a per-context sequence number
 * and must be identical everywhere. A mismatch fails on every PE with SKV_EMISMATCH naming both
 * sides; a PE that never arrives makes the others time out. Returns the sequence number used
 * (>= 1) through *seq when not NULL. */
int skv__coll_check(skv_ctx_t *ctx, uint64_t *seq, const char *fmt, ...) SKV_PRINTF(3, 4);
/* All-or-nothing step of a collective: every PE passes its result `rc` of the step under the
 * store name `name` (unique per step). Returns 0 when every PE succeeded. A PE that failed
 * publishes its failure and returns its own rc (its message kept) without waiting; the others
 * return the code of the first rank that failed, with "`what`: rank R failed: <its message>".
 * A failure of the bootstrap itself (timeout, dead peer, lost connection, mismatch) is returned
 * at once: the peers are not all there to tell. Bounded by the context's timeout. */
int skv__coll_agree(skv_ctx_t *ctx, const char *name, int rc, const char *what);
/* The codes that mean the bootstrap itself failed (timeout, dead peer, lost connection,
 * mismatch, protocol, authentication): the peers are not all there to take part any more. */
bool skv__is_bootstrap_failure(int rc);
/* Delete this PE's store key `key` after the next collective check completes (by then every
 * PE has finished the collective step that reads it). Keys beyond SKV_CTX_DEFERRED_KEYS
 * before that check stay in the store (a small leak, never an error). */
void skv__coll_forget_later(skv_ctx_t *ctx, const char *key);
/* A unique name for the collective object created under sequence number `seq`. */
void skv__coll_name(const skv_ctx_t *ctx, uint64_t seq, const char *what, char *buf, size_t cap);

#endif
