/* Internal API of the bootstrap layer: the libuv TCP key-value store (server on rank 0, a
 * blocking client on every PE) and file-descriptor passing between the PEs of one node. */
#ifndef SKV_BOOTSTRAP_H
#define SKV_BOOTSTRAP_H

#include "core/core.h"

#include <stddef.h>
#include <stdint.h>

/* Sizes of keys and values (the wire protocol's other limits are in bootstrap/proto.h, those of
 * the server's key table in bootstrap/store_table.h). */
#define SKV_BOOT_MAX_KEY   SKV_STORE_MAX_KEY   /* bytes of a key */
#define SKV_BOOT_MAX_VALUE SKV_STORE_MAX_VALUE /* bytes of a value */

/* ---- store_server.c ------------------------------------------------------------------------ */

typedef struct skv__store_server skv__store_server_t;

/* Listen on bind_addr:port (port 0: any free port) and serve from a background thread running
 * a libuv loop. Only clients presenting `token` (compared in constant time) with a rank in
 * [0, nranks) are served. A client that misbehaves (bad token, malformed or oversized frame,
 * dropped connection) loses its connection; the others keep being served. When a client that
 * said HELLO disconnects without BYE, its rank is marked dead: every blocking request then
 * fails with SKV_EPEERDEAD naming it. */
int skv__store_server_start(const char *bind_addr, int port, const char *token, int nranks,
                            skv__store_server_t **out);
/* The port actually bound. */
int skv__store_server_port(const skv__store_server_t *srv);
/* Wait (up to timeout_ms) until every rank that said HELLO has said BYE or disconnected, then
 * stop the loop, join the thread and free everything. Safe on NULL. */
int skv__store_server_stop(skv__store_server_t *srv, int timeout_ms);
/* The same, for cleanup after another failure: a timeout is only logged (WARN), so that the
 * thread's last error still describes the failure being cleaned up after. */
int skv__store_server_stop_quiet(skv__store_server_t *srv, int timeout_ms);

/* ---- store_client.c ------------------------------------------------------------------------ */

typedef struct skv__store skv__store_t;

/* Connect to the store (retrying until timeout_ms while rank 0 is starting) and say HELLO.
 * Fails with SKV_EAUTH (token rejected), SKV_EINVAL (rank/nranks rejected), SKV_ECONN or
 * SKV_ETIMEDOUT. The client is thread-safe: one request at a time per store. */
int skv__store_connect(const char *host, int port, const char *token, int rank, int nranks,
                       int timeout_ms, skv__store_t **out);
/* Say BYE and close (BYE tells the server this rank left on purpose). Safe on NULL. */
int skv__store_close(skv__store_t *st);
/* The same, for cleanup after another failure: a failure is only logged (WARN), so that the
 * thread's last error still describes the failure being cleaned up after. */
int skv__store_close_quiet(skv__store_t *st);
/* Close without BYE, as a crash would (tests only). */
void skv__store_abort(skv__store_t *st);

int skv__store_set(skv__store_t *st, const char *key, const void *val, size_t len);
/* Block until `key` exists (or timeout_ms passes), then return a malloc'ed copy of its value
 * (caller frees; a NUL byte is appended beyond *len for convenience). */
int skv__store_get(skv__store_t *st, const char *key, void **val, size_t *len, int timeout_ms);
/* Non-blocking: SKV_ENOTFOUND when the key does not exist. */
int skv__store_try_get(skv__store_t *st, const char *key, void **val, size_t *len);
int skv__store_add(skv__store_t *st, const char *key, int64_t delta, int64_t *result);
/* Block until every key exists. */
int skv__store_wait(skv__store_t *st, const char *const *keys, size_t n, int timeout_ms);
/* Block until the counter `key` (see add) is at least `target`. */
int skv__store_wait_ge(skv__store_t *st, const char *key, int64_t target, int timeout_ms);
/* Without waiting: SKV_EPEERDEAD (message naming it) if a rank of the job died, else 0 (or the
 * failure of the request itself). `key` names a counter (or nothing): one WAIT_GE on it with
 * an unreachable target and timeout 0. */
int skv__store_check_dead(skv__store_t *st, const char *key);
/* Delete a key (no error when absent). */
int skv__store_del(skv__store_t *st, const char *key);
/* Barrier of all nranks under a caller-chosen unique name. */
int skv__store_barrier(skv__store_t *st, const char *name, int timeout_ms);
/* Every rank contributes `bytes`; `out` gets nranks * bytes in rank order. */
int skv__store_allgather(skv__store_t *st, const char *name, const void *in, void *out,
                         size_t bytes, int timeout_ms);
/* This rank's key of allgather `name` ("<name>/<rank>"): to delete it once every rank has read
 * it, or to contribute without gathering (skv__store_allgather_put). */
void skv__store_allgather_key(const skv__store_t *st, const char *name, char *buf, size_t cap);
/* This rank's contribution to allgather `name` alone: a rank that has failed and needs nothing
 * from the others still lets them complete. */
int skv__store_allgather_put(skv__store_t *st, const char *name, const void *in, size_t bytes);

/* A rank's result of a step of a collective, as its peers read it from the store: its code, and
 * when it failed its message. */
typedef struct skv__step_result {
  int32_t rc;
  char msg[508];
} skv__step_result_t;
/* Store this rank's failure `rc`, with the thread's last error as its message, under `key`
 * (best effort: the peers time out without it); the last error is kept. */
void skv__store_put_failure(skv__store_t *st, const char *key, int rc);
/* A result's message (terminated here), or the name of its code when it has none. */
const char *skv__step_msg(skv__step_result_t *r);
int skv__store_rank(const skv__store_t *st);
int skv__store_nranks(const skv__store_t *st);

/* ---- fdpass.c ------------------------------------------------------------------------------ */

/* Exchange one file descriptor among the `nlocal` PEs of this node over unix-domain sockets
 * (abstract namespace, SCM_RIGHTS), using the store for rendezvous. `ranks[i]` is the global
 * rank of local PE i; this PE is local index `me`. On success peer_fds[i] is a new descriptor
 * for PE i's `my_fd` (peer_fds[me] = dup(my_fd)); the caller closes them. `tag` must be unique
 * per exchange. The sockets have random names shared through the store; descriptors are sent
 * only to listeners of the same user and accepted only from the same user (SO_PEERCRED)
 * presenting the exchange's random nonce. Bounded by timeout_ms; a PE of the job that dies makes
 * it fail with SKV_EPEERDEAD at once, one that fails with that PE's code (docs/bootstrap.md,
 * "File-descriptor passing"). */
int skv__fd_exchange(skv__store_t *st, const char *tag, const int *ranks, int nlocal, int me,
                     int my_fd, int *peer_fds, int timeout_ms);

#endif /* SKV_BOOTSTRAP_H */
