/* Context: joining and leaving the job through the bootstrap store, the node's PEs, host
 * barrier/allgather/broadcast, the public store calls and the collective check. */
#define _GNU_SOURCE
#include "bootstrap/ctx.h"

#include <errno.h>
#include <inttypes.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <xxhash.h>

#define SKV_CTX_CHECK(ctx, fn)                                                    \
  do {                                                                            \
    if (!(ctx)) return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_INIT, fn ": ctx is NULL"); \
  } while (0)

/* How long rank 0 keeps serving after its skv_init failed, for the others to finish and leave. */
#define INIT_FAIL_GRACE_MS 3000

/* What identifies this node: host name and boot id (two hosts may share a name). */
typedef struct node_rec {
  char host[64];
  char boot_id[40];
  int32_t rank;
  int32_t pid;
} node_rec_t;

static void node_id(node_rec_t *r, int rank) {
  memset(r, 0, sizeof *r);
  snprintf(r->host, sizeof r->host, "%s", skv__hostname());
  FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
  if (f) {
    if (!fgets(r->boot_id, sizeof r->boot_id, f)) r->boot_id[0] = '\0';
    fclose(f);
  }
  r->rank = rank;
  r->pid = (int32_t)getpid();
}

/* The PEs of this node (same host name and boot id), in rank order. A local size given in the
 * config or SKV_LOCAL_SIZE (`local_from`) must match them; without one they are taken as is. */
static int find_local_pes(skv_ctx_t *ctx, const char *local_from) {
  int n = ctx->cfg.world_size;
  node_rec_t me, *all = calloc((size_t)n, sizeof *all);
  if (!all) return SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_INIT, "out of memory for %d node records", n);
  node_id(&me, ctx->cfg.rank);
  int rc = skv__store_allgather(ctx->store, "init/node", &me, all, sizeof me, ctx->cfg.timeout_ms);
  if (rc < 0) {
    free(all);
    return rc;
  }
  ctx->nlocal = 0;
  for (int r = 0; r < n; r++) {
    if (strcmp(all[r].host, me.host) != 0 || strcmp(all[r].boot_id, me.boot_id) != 0) continue;
    if (ctx->nlocal == SKV_MAX_LOCAL_PES) {
      free(all);
      return SKV_FAIL(SKV_ENOTSUP, SKV_SUBSYS_INIT, "more than %d PEs on node %s",
                      SKV_MAX_LOCAL_PES, me.host);
    }
    if (r == ctx->cfg.rank) ctx->local_index = ctx->nlocal;
    ctx->local_ranks[ctx->nlocal++] = r;
  }
  free(all);
  if (ctx->cfg.local_size > 0 && ctx->nlocal != ctx->cfg.local_size)
    return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_INIT,
                    "local size is %d (%s) but %d PEs of the job run on node %s: make it match, or "
                    "leave %s unset to use the PEs found on each node",
                    ctx->cfg.local_size, local_from, ctx->nlocal, me.host, local_from);
  if (ctx->cfg.local_rank >= 0 && ctx->local_index != ctx->cfg.local_rank)
    SKV_INFO(SKV_SUBSYS_INIT,
             "local rank %d (configured) differs from position %d among this node's PEs; using %d",
             ctx->cfg.local_rank, ctx->local_index, ctx->local_index);
  ctx->cfg.local_rank = ctx->local_index;
  ctx->cfg.local_size = ctx->nlocal;
  return 0;
}

int skv__ctx_solo(int timeout_ms, int device, skv_ctx_t **out) {
  *out = NULL;
  long long t = timeout_ms, dev = device;
  if (t <= 0) SKV_CHECK(skv__env_int(SKV_ENV_TIMEOUT_MS, 1, 86400000, 60000, &t));
  if (dev < 0) SKV_CHECK(skv__env_int(SKV_ENV_DEVICE, 0, 1023, -1, &dev));
  skv_ctx_t *ctx = calloc(1, sizeof *ctx);
  if (!ctx) return SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_INIT, "out of memory");
  pthread_mutex_init(&ctx->mu, NULL);
  ctx->cfg.rank = 0;
  ctx->cfg.world_size = ctx->cfg.local_size = ctx->nlocal = 1;
  ctx->cfg.local_rank = ctx->local_index = 0;
  ctx->cfg.timeout_ms = (int)t;
  ctx->cfg.device = (int)dev;
  ctx->device = -1;
  *out = ctx;
  return 0;
}

void skv__ctx_solo_free(skv_ctx_t *ctx) {
  if (!ctx) return;
  pthread_mutex_destroy(&ctx->mu);
  free(ctx);
}

int skv_init(const skv_config_t *cfg, skv_ctx_t **out) {
  if (!out) return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_INIT, "skv_init: ctx output pointer is NULL");
  *out = NULL;
  skv_ctx_t *ctx = calloc(1, sizeof *ctx);
  if (!ctx) return SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_INIT, "skv_init: out of memory");
  pthread_mutex_init(&ctx->mu, NULL);
  ctx->device = -1;
  int rc;
  SKV_CHECK_GOTO(skv__config_resolve(cfg, &ctx->cfg), rc, fail);
  skv__log_rank = ctx->cfg.rank;
  skv__env_report();
  SKV_INFO(SKV_SUBSYS_INIT, "symkv %s: rank %d of %d, store %s:%d, timeout %d ms",
           skv_version_string(), ctx->cfg.rank, ctx->cfg.world_size, ctx->cfg.host, ctx->cfg.port,
           ctx->cfg.timeout_ms);
  if (ctx->cfg.rank == 0)
    SKV_CHECK_GOTO(skv__store_server_start(ctx->cfg.bind_addr, ctx->cfg.port, ctx->cfg.token,
                                           ctx->cfg.world_size, &ctx->server),
                   rc, fail);
  SKV_CHECK_GOTO(skv__store_connect(ctx->cfg.host, ctx->cfg.port, ctx->cfg.token, ctx->cfg.rank,
                                    ctx->cfg.world_size, ctx->cfg.timeout_ms, &ctx->store),
                 rc, fail);
  bool local_in_cfg = cfg && cfg->size >= offsetof(skv_config_t, local_size) + sizeof(int32_t) &&
                      cfg->local_size != -1;
  SKV_CHECK_GOTO(find_local_pes(ctx, local_in_cfg ? "config.local_size" : "SKV_LOCAL_SIZE"), rc,
                 fail);
  uint64_t job = 0;
  if (ctx->cfg.rank == 0) SKV_CHECK_GOTO(skv__random_bytes(&job, sizeof job), rc, fail);
  SKV_CHECK_GOTO(skv_ctx_broadcast(ctx, &job, sizeof job, 0), rc, fail);
  ctx->job_id = job;
  /* local_size is left out: nodes may run different numbers of PEs (checked above). */
  SKV_CHECK_GOTO(skv__coll_check(ctx, NULL, "skv_init(world_size=%d, timeout_ms=%d)",
                                 ctx->cfg.world_size, ctx->cfg.timeout_ms),
                 rc, fail);
  *out = ctx;
  return 0;
fail:
  /* The cleanup leaves skv_last_error() describing the failure. Rank 0 serves the store, so it
   * gives the other PEs a bounded grace to finish the collective that failed (they find the
   * same failure) and leave, instead of cutting them off with a lost connection. */
  if (ctx->store) skv__store_close_quiet(ctx->store);
  if (ctx->server)
    skv__store_server_stop_quiet(ctx->server, SKV_MIN(ctx->cfg.timeout_ms, INIT_FAIL_GRACE_MS));
  pthread_mutex_destroy(&ctx->mu);
  free(ctx);
  return rc;
}

int skv_finalize(skv_ctx_t *ctx) {
  SKV_CTX_CHECK(ctx, "skv_finalize");
  int rc = skv__coll_check(ctx, NULL, "skv_finalize()");
  if (rc == 0) {
    char name[64];
    snprintf(name, sizeof name, "fini/%" PRIu64, ctx->coll_seq);
    rc = skv__store_barrier(ctx->store, name, ctx->cfg.timeout_ms);
  }
  /* After a failure, the cleanup leaves skv_last_error() describing that failure. */
  int rc2 = rc ? skv__store_close_quiet(ctx->store) : skv__store_close(ctx->store);
  if (ctx->server) {
    int wait_ms = rc == 0 ? ctx->cfg.timeout_ms : 1000;
    int rc3 = rc || rc2 ? skv__store_server_stop_quiet(ctx->server, wait_ms)
                        : skv__store_server_stop(ctx->server, wait_ms);
    if (rc2 == 0) rc2 = rc3;
  }
  pthread_mutex_destroy(&ctx->mu);
  free(ctx);
  return rc ? rc : rc2;
}

int skv_ctx_get_rank(const skv_ctx_t *ctx) {
  SKV_CTX_CHECK(ctx, "skv_ctx_get_rank");
  return ctx->cfg.rank;
}
int skv_ctx_get_world_size(const skv_ctx_t *ctx) {
  SKV_CTX_CHECK(ctx, "skv_ctx_get_world_size");
  return ctx->cfg.world_size;
}
int skv_ctx_get_local_rank(const skv_ctx_t *ctx) {
  SKV_CTX_CHECK(ctx, "skv_ctx_get_local_rank");
  return ctx->local_index;
}
int skv_ctx_get_local_size(const skv_ctx_t *ctx) {
  SKV_CTX_CHECK(ctx, "skv_ctx_get_local_size");
  return ctx->nlocal;
}
int skv_ctx_get_timeout_ms(const skv_ctx_t *ctx) {
  SKV_CTX_CHECK(ctx, "skv_ctx_get_timeout_ms");
  return ctx->cfg.timeout_ms;
}
#ifndef SKV_WITH_CUDA
int skv_ctx_get_device(skv_ctx_t *ctx) {
  SKV_CTX_CHECK(ctx, "skv_ctx_get_device");
  return SKV_FAIL(SKV_ENOTSUP, SKV_SUBSYS_INIT,
                  "skv_ctx_get_device: this symkv was built without CUDA");
}
#endif

int skv_ctx_set_timeout_ms(skv_ctx_t *ctx, int timeout_ms) {
  SKV_CTX_CHECK(ctx, "skv_ctx_set_timeout_ms");
  SKV_ARG_CHECK(timeout_ms >= 1 && timeout_ms <= 86400000, SKV_SUBSYS_INIT,
                "skv_ctx_set_timeout_ms: %d ms is not in 1..86400000", timeout_ms);
  ctx->cfg.timeout_ms = timeout_ms;
  return 0;
}

/* ---- collective check ------------------------------------------------------------------ */

typedef struct coll_rec {
  uint64_t seq;
  uint64_t digest;
  char desc[240];
} coll_rec_t;

/* Delete this PE's store key `key` after the next collective check completes. */
static void defer_key(skv_ctx_t *ctx, const char *key) {
  pthread_mutex_lock(&ctx->mu);
  if (ctx->ndeferred < SKV_CTX_DEFERRED_KEYS)
    snprintf(ctx->deferred[ctx->ndeferred++], sizeof ctx->deferred[0], "%s", key);
  pthread_mutex_unlock(&ctx->mu);
}

/* The context's own operations (the check, allgather, broadcast) are named "<kind>/<seq>". */
static void op_init(skv__coll_op_t *op, skv_ctx_t *ctx, uint64_t seq, const char *kind) {
  op->ctx = ctx;
  op->seq = seq;
  op->nkeys = 0;
  snprintf(op->name, sizeof op->name, "%s/%" PRIu64, kind, seq);
}

static int coll_check_v(skv_ctx_t *ctx, uint64_t *seq_out, const char *fmt, va_list ap) {
  coll_rec_t me;
  memset(&me, 0, sizeof me);
  vsnprintf(me.desc, sizeof me.desc, fmt, ap);
  pthread_mutex_lock(&ctx->mu);
  uint64_t seq = ++ctx->coll_seq;
  pthread_mutex_unlock(&ctx->mu);
  me.seq = seq;
  me.digest = XXH3_64bits(me.desc, strlen(me.desc));
  int n = ctx->cfg.world_size;
  coll_rec_t *all = calloc((size_t)n, sizeof *all);
  if (!all) return SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_INIT, "out of memory for the collective check");
  skv__coll_op_t op;
  op_init(&op, ctx, seq, "coll");
  SKV_TRACE(SKV_SUBSYS_INIT, "collective #%" PRIu64 ": %s", seq, me.desc);
  int rc = skv__coll_allgather(&op, NULL, &me, all, sizeof me);
  if (rc < 0) {
    skv__coll_forget(&op);
    free(all);
    char what[300];
    snprintf(what, sizeof what, "%s", skv_last_error());
    return SKV_FAIL(rc, SKV_SUBSYS_INIT,
                    "%s: collective call #%" PRIu64 " did not complete on every PE: %s", me.desc,
                    seq, what);
  }
  for (int r = 0; r < n; r++) {
    if (all[r].seq == seq && all[r].digest == me.digest && strcmp(all[r].desc, me.desc) == 0)
      continue;
    all[r].desc[sizeof all[r].desc - 1] = '\0';
    rc = SKV_FAIL(
        SKV_EMISMATCH, SKV_SUBSYS_INIT,
        "collective call #%" PRIu64 " does not match across PEs: rank %d called %s but rank %d "
        "called %s; every PE must make the same collective calls in the same order with the "
        "same arguments",
        seq, ctx->cfg.rank, me.desc, r, all[r].desc);
    break;
  }
  free(all);
  /* Every PE that contributed to this check had finished reading the keys of its earlier
   * collectives, so this PE's keys of those can go (docs/bootstrap.md, "Key lifetime"); the
   * check's own key goes after the next one. */
  if (rc == 0) {
    pthread_mutex_lock(&ctx->mu);
    int nd = ctx->ndeferred;
    ctx->ndeferred = 0;
    for (int i = 0; i < nd; i++) (void)skv__store_del(ctx->store, ctx->deferred[i]);
    pthread_mutex_unlock(&ctx->mu);
  }
  skv__coll_forget(&op);
  if (rc == 0 && seq_out) *seq_out = seq;
  return rc;
}

int skv__coll_check(skv_ctx_t *ctx, uint64_t *seq_out, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  int rc = coll_check_v(ctx, seq_out, fmt, ap);
  va_end(ap);
  return rc;
}

bool skv__is_bootstrap_failure(int rc) {
  return rc == SKV_ETIMEDOUT || rc == SKV_EPEERDEAD || rc == SKV_ECONN || rc == SKV_EMISMATCH ||
         rc == SKV_EPROTO || rc == SKV_EAUTH;
}

/* ---- collective operations ------------------------------------------------------------- */

int skv__coll_begin(skv_ctx_t *ctx, skv__coll_op_t *op, const char *kind, const char *fmt, ...) {
  op->ctx = ctx;
  op->seq = 0;
  op->nkeys = 0;
  op->name[0] = '\0';
  va_list ap;
  va_start(ap, fmt);
  int rc = coll_check_v(ctx, &op->seq, fmt, ap);
  va_end(ap);
  if (rc == 0)
    snprintf(op->name, sizeof op->name, "%s/%016" PRIx64 "/%" PRIu64, kind, ctx->job_id, op->seq);
  return rc;
}

/* The store name of `step` of op ("<name>/<step>", or the name itself); per_rank: this PE's
 * allgather key of it. */
static void op_key(const skv__coll_op_t *op, const char *step, bool per_rank, char *buf,
                   size_t cap) {
  char name[SKV_BOOT_MAX_KEY + 16];
  if (step && step[0])
    snprintf(name, sizeof name, "%s/%s", op->name, step);
  else
    snprintf(name, sizeof name, "%s", op->name);
  if (per_rank)
    skv__store_allgather_key(op->ctx->store, name, buf, cap);
  else
    snprintf(buf, cap, "%s", name);
}

/* This PE is about to write its key of `step`: the operation notes it (or, full, defers it). */
static void op_note(skv__coll_op_t *op, const char *step, bool per_rank) {
  if (!step) step = "";
  if (op->nkeys < SKV_COLL_OP_KEYS && strlen(step) < SKV_COLL_STEP_CAP) {
    snprintf(op->keys[op->nkeys].step, sizeof op->keys[0].step, "%s", step);
    op->keys[op->nkeys++].per_rank = per_rank;
    return;
  }
  char key[SKV_BOOT_MAX_KEY + 16];
  op_key(op, step, per_rank, key, sizeof key);
  defer_key(op->ctx, key);
}

/* Delete now (or defer) this PE's keys first..nkeys-1 of op. */
static void op_drop(skv__coll_op_t *op, int first, bool later) {
  char key[SKV_BOOT_MAX_KEY + 16];
  for (int i = first; i < op->nkeys; i++) {
    op_key(op, op->keys[i].step, op->keys[i].per_rank, key, sizeof key);
    if (later)
      defer_key(op->ctx, key);
    else
      (void)skv__store_del(op->ctx->store, key);
  }
  op->nkeys = first;
}

int skv__coll_agree(skv__coll_op_t *op, const char *step, int rc, const char *what) {
  if (rc < 0 && skv__is_bootstrap_failure(rc)) return rc;
  skv_ctx_t *ctx = op->ctx;
  const int n = ctx->cfg.world_size;
  skv__step_result_t *all = rc < 0 ? NULL : calloc((size_t)n, sizeof *all);
  if (rc == 0 && !all) rc = SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_INIT, "%s: out of memory", what);
  if (rc < 0) {
    /* A PE that failed only tells the others (its allgather key): it needs nothing from them,
     * and some may have given up already. Its own error stays the one it reports. */
    char key[SKV_BOOT_MAX_KEY + 16];
    op_note(op, step, true);
    op_key(op, step, true, key, sizeof key);
    skv__store_put_failure(ctx->store, key, rc);
    return rc;
  }
  skv__step_result_t me;
  memset(&me, 0, sizeof me);
  int out = skv__coll_allgather(op, step, &me, all, sizeof me);
  for (int r = 0; out == 0 && r < n; r++)
    if (all[r].rc < 0)
      out = SKV_FAIL(all[r].rc, SKV_SUBSYS_INIT, "%s: rank %d failed: %s", what, r,
                     skv__step_msg(&all[r]));
  free(all);
  return out;
}

int skv__coll_allgather(skv__coll_op_t *op, const char *step, const void *in, void *out,
                        size_t bytes) {
  char name[SKV_BOOT_MAX_KEY + 16];
  op_key(op, step, false, name, sizeof name);
  op_note(op, step, true);
  return skv__store_allgather(op->ctx->store, name, in, out, bytes, op->ctx->cfg.timeout_ms);
}

int skv__coll_contribute(skv__coll_op_t *op, const char *step, const void *in, size_t bytes) {
  char name[SKV_BOOT_MAX_KEY + 16];
  op_key(op, step, false, name, sizeof name);
  op_note(op, step, true);
  return skv__store_allgather_put(op->ctx->store, name, in, bytes);
}

int skv__coll_bcast(skv__coll_op_t *op, const char *step, void *buf, size_t bytes, int root,
                    const char *what) {
  skv_ctx_t *ctx = op->ctx;
  char key[SKV_BOOT_MAX_KEY + 16];
  op_key(op, step, false, key, sizeof key);
  if (ctx->cfg.rank == root) {
    op_note(op, step, false);
    return skv__store_set(ctx->store, key, buf, bytes);
  }
  void *val = NULL;
  size_t len = 0;
  SKV_CHECK(skv__store_get(ctx->store, key, &val, &len, ctx->cfg.timeout_ms));
  int rc = 0;
  if (len != bytes)
    rc = SKV_FAIL(SKV_EPROTO, SKV_SUBSYS_BOOT, "%s from rank %d carried %zu bytes, expected %zu",
                  what, root, len, bytes);
  else
    memcpy(buf, val, bytes);
  free(val);
  return rc;
}

void skv__coll_settle(skv__coll_op_t *op) {
  if (op->nkeys < 2) return;
  skv__coll_key_t last = op->keys[--op->nkeys];
  op_drop(op, 0, false);
  op->keys[op->nkeys++] = last;
}

void skv__coll_end(skv__coll_op_t *op) {
  if (op->ctx) op_drop(op, 0, false);
}

void skv__coll_forget(skv__coll_op_t *op) {
  if (op->ctx) op_drop(op, 0, true);
}

/* ---- host collectives and the public store -------------------------------------------- */

/* Begin one of the context's own collectives: the check, and op named "<kind>/<seq>". */
static int host_begin(skv_ctx_t *ctx, skv__coll_op_t *op, const char *kind, const char *fmt, ...)
    SKV_PRINTF(4, 5);
static int host_begin(skv_ctx_t *ctx, skv__coll_op_t *op, const char *kind, const char *fmt, ...) {
  uint64_t seq = 0;
  va_list ap;
  va_start(ap, fmt);
  int rc = coll_check_v(ctx, &seq, fmt, ap);
  va_end(ap);
  op_init(op, ctx, seq, kind);
  return rc;
}

int skv_ctx_barrier(skv_ctx_t *ctx) {
  SKV_CTX_CHECK(ctx, "skv_ctx_barrier");
  uint64_t seq;
  SKV_CHECK(skv__coll_check(ctx, &seq, "skv_ctx_barrier()"));
  /* The collective check is itself an allgather: when it returns every PE has arrived. */
  return 0;
}

int skv_ctx_allgather(skv_ctx_t *ctx, const void *in, void *out, size_t bytes) {
  SKV_CTX_CHECK(ctx, "skv_ctx_allgather");
  SKV_ARG_CHECK(in && out && bytes > 0 && bytes <= SKV_STORE_MAX_VALUE, SKV_SUBSYS_BOOT,
                "skv_ctx_allgather: need non-NULL in/out and 1..%u bytes (got %zu)",
                SKV_STORE_MAX_VALUE, bytes);
  skv__coll_op_t op;
  SKV_CHECK(host_begin(ctx, &op, "ag", "skv_ctx_allgather(bytes=%zu)", bytes));
  int rc = skv__coll_allgather(&op, NULL, in, out, bytes);
  skv__coll_forget(&op);
  return rc;
}

int skv_ctx_broadcast(skv_ctx_t *ctx, void *buf, size_t bytes, int root) {
  SKV_CTX_CHECK(ctx, "skv_ctx_broadcast");
  SKV_ARG_CHECK(buf && bytes > 0 && bytes <= SKV_STORE_MAX_VALUE, SKV_SUBSYS_BOOT,
                "skv_ctx_broadcast: need a buffer and 1..%u bytes (got %zu)", SKV_STORE_MAX_VALUE,
                bytes);
  SKV_ARG_CHECK(root >= 0 && root < ctx->cfg.world_size, SKV_SUBSYS_BOOT,
                "skv_ctx_broadcast: root %d is not a rank of this %d-PE job", root,
                ctx->cfg.world_size);
  skv__coll_op_t op;
  SKV_CHECK(host_begin(ctx, &op, "bc", "skv_ctx_broadcast(bytes=%zu, root=%d)", bytes, root));
  int rc = skv__coll_bcast(&op, NULL, buf, bytes, root, "broadcast");
  skv__coll_forget(&op);
  return rc;
}

static int check_key(const char *fn, const char *key) {
  if (!key) return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_BOOT, "%s: key is NULL", fn);
  size_t n = strlen(key);
  if (n == 0 || n > SKV_STORE_MAX_KEY)
    return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_BOOT, "%s: key length %zu is not in 1..%d", fn, n,
                    SKV_STORE_MAX_KEY);
  return 0;
}

int skv_store_set(skv_ctx_t *ctx, const char *key, const void *value, size_t len) {
  SKV_CTX_CHECK(ctx, "skv_store_set");
  SKV_CHECK(check_key("skv_store_set", key));
  SKV_ARG_CHECK(len <= SKV_STORE_MAX_VALUE && (value || len == 0), SKV_SUBSYS_BOOT,
                "skv_store_set(\"%s\"): value of %zu bytes is NULL or over the %u-byte limit", key,
                len, SKV_STORE_MAX_VALUE);
  return skv__store_set(ctx->store, key, value, len);
}

int skv_store_get(skv_ctx_t *ctx, const char *key, void *value, size_t cap, size_t *len) {
  SKV_CTX_CHECK(ctx, "skv_store_get");
  SKV_CHECK(check_key("skv_store_get", key));
  SKV_ARG_CHECK(value || cap == 0, SKV_SUBSYS_BOOT, "skv_store_get(\"%s\"): value buffer is NULL",
                key);
  void *v = NULL;
  size_t n = 0;
  SKV_CHECK(skv__store_get(ctx->store, key, &v, &n, ctx->cfg.timeout_ms));
  if (len) *len = n;
  int rc = 0;
  size_t copy = SKV_MIN(n, cap); /* as much as fits: all of it, or its first cap bytes */
  if (copy) memcpy(value, v, copy);
  if (n > cap)
    rc =
        SKV_FAIL(SKV_ERANGE, SKV_SUBSYS_BOOT,
                 "skv_store_get(\"%s\"): value has %zu bytes, buffer %zu (its first %zu bytes were "
                 "copied); pass a buffer of *len bytes",
                 key, n, cap, cap);
  free(v);
  return rc;
}

int skv_store_add(skv_ctx_t *ctx, const char *key, int64_t delta, int64_t *result) {
  SKV_CTX_CHECK(ctx, "skv_store_add");
  SKV_CHECK(check_key("skv_store_add", key));
  int64_t r = 0;
  SKV_CHECK(skv__store_add(ctx->store, key, delta, &r));
  if (result) *result = r;
  return 0;
}

int skv_store_wait(skv_ctx_t *ctx, const char *const *keys, size_t n) {
  SKV_CTX_CHECK(ctx, "skv_store_wait");
  SKV_ARG_CHECK(keys || n == 0, SKV_SUBSYS_BOOT, "skv_store_wait: keys is NULL");
  for (size_t i = 0; i < n; i++) SKV_CHECK(check_key("skv_store_wait", keys[i]));
  return skv__store_wait(ctx->store, keys, n, ctx->cfg.timeout_ms);
}
