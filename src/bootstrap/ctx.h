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
  /* this PE's store keys of collectives already done (skv__coll_forget), deleted once the
   * next collective check proves every PE has read them */
  char deferred[SKV_CTX_DEFERRED_KEYS][SKV_BOOT_MAX_KEY + 16]; /* as the keys built for them */
  int ndeferred;
};

/* A context of this process alone, for what is not a job (an elastic domain's attachment): no
 * store, rank 0 of 1; timeout_ms <= 0 and device < 0 come from SKV_TIMEOUT_MS / SKV_DEVICE. */
int skv__ctx_solo(int timeout_ms, int device, skv_ctx_t **out);
void skv__ctx_solo_free(skv_ctx_t *ctx);

/* Collective check: every PE describes the collective it is entering ("skv_heap_create(backend
 * =host, data_bytes=4096)"); descriptions are allgathered under a per-context sequence number
 * and must be identical everywhere. A mismatch fails on every PE with SKV_EMISMATCH naming both
 * sides; a PE that never arrives makes the others time out. Returns the sequence number used
 * (>= 1) through *seq when not NULL. When it completes, this PE's keys of earlier collectives
 * that were deferred (skv__coll_forget) are deleted. For a collective that writes no store keys
 * of its own; one that does begins an operation (skv__coll_begin). */
int skv__coll_check(skv_ctx_t *ctx, uint64_t *seq, const char *fmt, ...) SKV_PRINTF(3, 4);
/* The codes that mean the bootstrap itself failed (timeout, dead peer, lost connection,
 * mismatch, protocol, authentication): the peers are not all there to take part any more. */
bool skv__is_bootstrap_failure(int rc);

/* ---- collective operations and their store keys ------------------------------------------- */

/* How it works
 *
 * A collective operation (a heap's create, the context's allgather...) goes through the store
 * in steps, and each step writes keys of this PE that the other PEs read. The operation owns
 * them: skv__coll_begin makes the collective check and gives the operation a unique name; each
 * step (agree, allgather, contribute, bcast) is named relative to it ("<name>/<step>"), builds
 * its store keys from that, and notes in the operation which keys this PE wrote; the operation
 * ends by deleting them now (skv__coll_end, skv__coll_settle), when every PE is known to have
 * read them, or later (skv__coll_forget), after this PE's next collective check completes, when
 * not (docs/bootstrap.md, "Key lifetime"). A heap's operation lives as long as the heap: what is
 * built on a heap (a KV cache, a comm) takes its steps in the heap's operation, and their keys
 * go with the heap's, once skv_heap_destroy's check has completed.
 *
 * What can go wrong: a key deleted while a peer still waits for it makes that peer time out.
 * Deleting now is right only after a step that gathered every PE's contribution (then every PE
 * has finished the steps before it) or after a collective check that came later; a PE that
 * contributes without reading (skv__coll_contribute) must fail the operation's next agreement,
 * so that nobody takes that step as proof. A key past SKV_COLL_OP_KEYS (or of a step name too
 * long to note) is deferred at once, which is always safe: every PE reads a step's keys before
 * it takes part in any later collective check. Keys deferred past SKV_CTX_DEFERRED_KEYS before
 * a check stay in the store (a small leak, never an error). */

#define SKV_COLL_NAME_CAP 96 /* bytes of an operation's name, NUL included */
#define SKV_COLL_STEP_CAP 16 /* bytes of a step's name, NUL included */
#define SKV_COLL_OP_KEYS  6  /* keys an operation holds; further ones are deferred at once */

/* A key of this PE written by a step. */
typedef struct skv__coll_key {
  char step[SKV_COLL_STEP_CAP]; /* "" for the operation's name itself */
  bool per_rank;                /* an allgather's key, "<name>[/<step>]/<rank>" */
} skv__coll_key_t;

typedef struct skv__coll_op {
  skv_ctx_t *ctx;
  uint64_t seq;                 /* sequence number of its collective check */
  char name[SKV_COLL_NAME_CAP]; /* unique: "<kind>/<job id>/<seq>" ("ag/<seq>" in ctx.c) */
  int nkeys;
  skv__coll_key_t keys[SKV_COLL_OP_KEYS]; /* oldest first */
} skv__coll_op_t;

/* Begin an operation: the collective check (as skv__coll_check), and op named "<kind>/<job id
 * in hex>/<seq>", with no keys. On failure op is left without keys (nothing to end). */
int skv__coll_begin(skv_ctx_t *ctx, skv__coll_op_t *op, const char *kind, const char *fmt, ...)
    SKV_PRINTF(4, 5);
/* The steps. `step` names one (unique within the operation, under SKV_COLL_STEP_CAP bytes) or is
 * NULL for the operation's name itself; each is bounded by the context's timeout.
 *
 * All-or-nothing step: every PE passes its result `rc` of the step. Returns 0 when every PE
 * succeeded. A PE that failed publishes its failure and returns its own rc (its message kept)
 * without waiting; the others return the code of the first rank that failed, with "`what`:
 * rank R failed: <its message>". A failure of the bootstrap itself (timeout, dead peer, lost
 * connection, mismatch) is returned at once: the peers are not all there to tell. */
int skv__coll_agree(skv__coll_op_t *op, const char *step, int rc, const char *what);
/* Every PE contributes `bytes` of `in`; `out` gets world_size * bytes in rank order. */
int skv__coll_allgather(skv__coll_op_t *op, const char *step, const void *in, void *out,
                        size_t bytes);
/* This PE's contribution to allgather `step` alone: a PE that has failed and needs nothing from
 * the others still lets them complete (it then fails the next agreement). */
int skv__coll_contribute(skv__coll_op_t *op, const char *step, const void *in, size_t bytes);
/* Rank `root` sends `bytes` of buf to every PE; a value of another size fails with SKV_EPROTO,
 * "`what` from rank R carried N bytes, expected M". */
int skv__coll_bcast(skv__coll_op_t *op, const char *step, void *buf, size_t bytes, int root,
                    const char *what);
/* The last step gathered every PE's contribution, so every PE has read this PE's keys of the
 * steps before it: those are deleted now; the last step's key stays in op. */
void skv__coll_settle(skv__coll_op_t *op);
/* Every PE is known to have read this PE's keys of op (a later collective check completed):
 * they are deleted now. */
void skv__coll_end(skv__coll_op_t *op);
/* Not known: this PE's keys of op are deleted after its next collective check completes (by
 * then every PE has finished the operation's steps). */
void skv__coll_forget(skv__coll_op_t *op);

#endif
