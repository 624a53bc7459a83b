/* The cluster directory in Redis: which node holds which key (written in batches by a
 * background thread under leases), read by lookups with one MGET. */
#define _GNU_SOURCE
#include "cluster/cluster.h"

#include <hiredis.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* How it works
 * ------------
 * Keys (PREFIX is the cluster's name, "symkv" by default):
 *   PREFIX:node:NAME        the node record (UCX worker address, memory keys, nonce), PX lease
 *   PREFIX:k:HI16LO16       an entry: skv__dir_val_t (node, nonce, pe, page, gen), PX lease
 * The exporting process tracks, per page of its own, the key it holds and its generation. Its
 * background thread, every few milliseconds or when woken:
 *  - scans the tracked pages: a page whose record is no longer READY with the tracked
 *    generation was evicted; its entry is deleted if it still holds what this node wrote (a
 *    Lua compare-and-delete, so another node's newer entry for the key survives);
 *  - sends the queued writes in one pipeline (SET ... PX lease, compare-and-delete);
 *  - every third of the lease renews the node record and PEXPIREs every entry it holds (an
 *    entry Redis no longer has, after a restart or a flush, makes it republish everything);
 *  - after losing Redis, reconnects every 200 ms and republishes the node and every entry.
 * A node that dies stops renewing: its record and entries expire after the lease. Until then
 * readers may find them; a fetch then fails with SKV_EPEERDEAD, never with wrong bytes.
 * Lookups use their own connection (under a lock), one MGET per call.
 *
 * What can go wrong
 * -----------------
 * - Redis is down: queued writes are dropped (the tracked pages are the truth and are
 *   republished on reconnection); flush and lookup fail with SKV_ECONN at once; the node's own
 *   cache is not touched.
 * - An entry outlives its page (the delete is asynchronous, or was lost): readers check the
 *   generation after reading (xfer.c), so the bytes are never served. */

#define OP_PUT 1
#define OP_DEL 2

typedef struct dir_op {
  int type;
  skv_key_t key;
  skv__dir_val_t val;
} dir_op_t;

typedef struct dir_track {
  skv_key_t key;
  uint32_t gen;
  uint32_t on;
} dir_track_t;

struct skv__dir {
  char host[256];
  int port, db;
  char url[256], prefix[SKV__CL_NAME_CAP], node[SKV__CL_NAME_CAP];
  uint64_t nonce;
  int timeout_ms, lease_ms;
  void *blob;
  size_t blob_len;
  uint64_t pages;
  const uint64_t *state_words;
  uint64_t state_stride;
  uint32_t pe;

  pthread_mutex_t mu;
  pthread_cond_t cv, done_cv;
  pthread_t thr;
  bool thr_started, stop, connected, need_full;
  dir_track_t *tr;
  dir_op_t *q;
  size_t nq, capq;
  uint64_t seq_queued, seq_done;
  uint64_t exported, puts, dels, errors, reconnects;
  redisContext *bg; /* the thread's */

  pthread_mutex_t lk_mu; /* lookups' connection */
  redisContext *lk;
  uint64_t lk_retry_ms;
};

static const char del_script[] =
    "if redis.call('get',KEYS[1])==ARGV[1] then return redis.call('del',KEYS[1]) end return 0";

static int parse_url(skv__dir_t *d, const char *url) {
  snprintf(d->url, sizeof(d->url), "%s", url);
  const char *s = url;
  if (strncmp(s, "redis://", 8) != 0) goto bad;
  s += 8;
  const char *at = strchr(s, '@');
  if (at) goto bad_auth;
  const char *colon = strrchr(s, ':'), *slash = strchr(s, '/');
  size_t hl = colon ? (size_t)(colon - s) : slash ? (size_t)(slash - s) : strlen(s);
  if (hl == 0 || hl >= sizeof(d->host)) goto bad;
  memcpy(d->host, s, hl);
  d->host[hl] = 0;
  d->port = 6379;
  d->db = 0;
  if (colon) {
    long long v;
    char num[16];
    size_t pl = slash ? (size_t)(slash - colon - 1) : strlen(colon + 1);
    if (pl == 0 || pl >= sizeof(num)) goto bad;
    memcpy(num, colon + 1, pl);
    num[pl] = 0;
    if (!skv__parse_int(num, 1, 65535, false, &v)) goto bad;
    d->port = (int)v;
  }
  if (slash && slash[1]) {
    long long v;
    if (!skv__parse_int(slash + 1, 0, 1 << 20, false, &v)) goto bad;
    d->db = (int)v;
  }
  return 0;
bad:
  return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_KV,
                  "cluster: Redis URL '%s' is not redis://HOST[:PORT][/DB]", url);
bad_auth:
  return SKV_FAIL(SKV_ENOTSUP, SKV_SUBSYS_KV,
                  "cluster: Redis URL '%s' has credentials, which symkv does not send yet "
                  "(run Redis on a trusted network, docs/cluster.md)",
                  url);
}

static redisContext *dir_connect(skv__dir_t *d, char *err, size_t cap) {
  int ms = SKV_MIN(d->timeout_ms, 5000);
  struct timeval tv = {ms / 1000, (ms % 1000) * 1000};
  redisContext *c = redisConnectWithTimeout(d->host, d->port, tv);
  if (!c || c->err) {
    snprintf(err, cap, "%s", c ? c->errstr : "out of memory");
    if (c) redisFree(c);
    return NULL;
  }
  tv.tv_sec = d->timeout_ms / 1000;
  tv.tv_usec = (d->timeout_ms % 1000) * 1000;
  redisSetTimeout(c, tv);
  redisEnableKeepAlive(c);
  if (d->db) {
    redisReply *r = redisCommand(c, "SELECT %d", d->db);
    bool ok = r && r->type != REDIS_REPLY_ERROR;
    snprintf(err, cap, "SELECT %d: %s", d->db,
             r && r->type == REDIS_REPLY_ERROR ? r->str : c->errstr);
    if (r) freeReplyObject(r);
    if (!ok) {
      redisFree(c);
      return NULL;
    }
  }
  return c;
}

static void key_name(const skv__dir_t *d, skv_key_t k, char *buf, size_t cap) {
  snprintf(buf, cap, "%s:k:%016" PRIx64 "%016" PRIx64, d->prefix, k.hi, k.lo);
}

static skv__dir_val_t make_val(const skv__dir_t *d, uint32_t page, uint32_t gen) {
  skv__dir_val_t v;
  memset(&v, 0, sizeof(v));
  snprintf(v.node, sizeof(v.node), "%s", d->node);
  v.nonce = d->nonce;
  v.pe = d->pe;
  v.page = page;
  v.gen = gen;
  return v;
}

static void push_op(skv__dir_t *d, int type, skv_key_t key, const skv__dir_val_t *val) {
  if (d->nq == d->capq) {
    size_t cap = d->capq ? d->capq * 2 : 256;
    dir_op_t *q = realloc(d->q, cap * sizeof(*q));
    if (!q) { /* lost: the page's state is the truth (republished, or stale on read) */
      d->errors++;
      return;
    }
    d->q = q;
    d->capq = cap;
  }
  d->q[d->nq++] = (dir_op_t){type, key, *val};
  d->seq_queued++;
}

static void append_node(skv__dir_t *d, redisContext *c) {
  char k[2 * SKV__CL_NAME_CAP + 16];
  snprintf(k, sizeof(k), "%s:node:%s", d->prefix, d->node);
  redisAppendCommand(c, "SET %s %b PX %d", k, d->blob, d->blob_len, d->lease_ms);
}

static void append_op(skv__dir_t *d, redisContext *c, const dir_op_t *op) {
  char k[SKV__CL_NAME_CAP + 48];
  key_name(d, op->key, k, sizeof(k));
  if (op->type == OP_PUT)
    redisAppendCommand(c, "SET %s %b PX %d", k, &op->val, sizeof(op->val), d->lease_ms);
  else
    redisAppendCommand(c, "EVAL %s 1 %s %b", del_script, k, &op->val, sizeof(op->val));
}

/* Read `n` replies; false when the connection failed (or Redis answered an error). *zeros:
 * integer replies that were 0 from index `zero_from` on (PEXPIRE of a key Redis lost). */
static bool read_replies(skv__dir_t *d, redisContext *c, size_t n, size_t zero_from, size_t *zeros,
                         char *err, size_t cap) {
  bool ok = true;
  *zeros = 0;
  for (size_t i = 0; i < n; i++) {
    redisReply *r = NULL;
    if (redisGetReply(c, (void **)&r) != REDIS_OK || !r) {
      snprintf(err, cap, "%s", c->errstr[0] ? c->errstr : "connection lost");
      return false;
    }
    if (r->type == REDIS_REPLY_ERROR) {
      snprintf(err, cap, "%s", r->str);
      ok = false;
    } else if (i >= zero_from && r->type == REDIS_REPLY_INTEGER && r->integer == 0) {
      (*zeros)++;
    }
    freeReplyObject(r);
  }
  return ok;
}

static void *dir_main(void *arg) {
  skv__dir_t *d = arg;
  uint64_t next_refresh = skv__now_ms() + (uint64_t)d->lease_ms / 3, next_try = 0;
  dir_op_t *ops = NULL, *extra = NULL;
  size_t ops_cap = 0, extra_cap = 0;
  char err[256];
  pthread_mutex_lock(&d->mu);
  while (!d->stop) {
    if (d->nq == 0) {
      struct timespec ts = skv__ts_at(skv__now_ns() + 20 * 1000000ull);
      pthread_cond_timedwait(&d->cv, &d->mu, &ts);
      if (d->stop) break;
    }
    uint64_t now = skv__now_ms();
    if (!d->bg) {
      if (now < next_try) {
        d->nq = 0; /* writes while Redis is away: the tracked pages are republished later */
        d->seq_done = d->seq_queued;
        pthread_cond_broadcast(&d->done_cv);
        continue;
      }
      pthread_mutex_unlock(&d->mu);
      redisContext *c = dir_connect(d, err, sizeof(err));
      pthread_mutex_lock(&d->mu);
      if (!c) {
        next_try = now + 200;
        continue;
      }
      d->bg = c;
      d->connected = true;
      d->need_full = true;
      d->reconnects++;
      SKV_WARN_RL(SKV_SUBSYS_KV, "cluster: reconnected to Redis at %s: republishing node '%s'",
                  d->url, d->node);
    }
    /* evictions: tracked pages whose record moved on */
    for (uint64_t p = 0; p < d->pages; p++) {
      dir_track_t *t = &d->tr[p];
      if (!t->on) continue;
      uint64_t w = __atomic_load_n(
          (const uint64_t *)((const char *)d->state_words + p * d->state_stride), __ATOMIC_ACQUIRE);
      uint32_t st = (uint32_t)w & 0xff, g = (uint32_t)(w >> 32);
      if (g == t->gen && (st == 2u || st == 3u)) continue; /* READY, or EVICTING (may return) */
      skv__dir_val_t v = make_val(d, (uint32_t)p, t->gen);
      push_op(d, OP_DEL, t->key, &v);
      t->on = 0;
      d->exported--;
    }
    bool refresh = now >= next_refresh, full = d->need_full;
    d->need_full = false;
    size_t nops = d->nq, nextra = 0;
    uint64_t target = d->seq_queued;
    if (nops > ops_cap) {
      dir_op_t *o = realloc(ops, nops * sizeof(*o));
      if (!o)
        nops = ops_cap;
      else
        ops = o, ops_cap = nops;
    }
    if (nops) {
      memcpy(ops, d->q, nops * sizeof(*ops));
      memmove(d->q, d->q + nops, (d->nq - nops) * sizeof(*d->q));
      d->nq -= nops;
    }
    if (full || refresh) {
      if (d->exported > extra_cap) {
        dir_op_t *o = realloc(extra, d->exported * sizeof(*o));
        if (o) extra = o, extra_cap = d->exported;
      }
      for (uint64_t p = 0; p < d->pages && nextra < extra_cap; p++)
        if (d->tr[p].on)
          extra[nextra++] =
              (dir_op_t){OP_PUT, d->tr[p].key, make_val(d, (uint32_t)p, d->tr[p].gen)};
    }
    redisContext *c = d->bg;
    pthread_mutex_unlock(&d->mu);

    size_t n = 0, zero_from = (size_t)-1, zeros = 0;
    if (full || refresh) append_node(d, c), n++;
    for (size_t i = 0; i < nops; i++) append_op(d, c, &ops[i]), n++;
    zero_from = n;
    for (size_t i = 0; i < nextra; i++, n++) {
      if (full) {
        append_op(d, c, &extra[i]);
      } else {
        char k[SKV__CL_NAME_CAP + 48];
        key_name(d, extra[i].key, k, sizeof(k));
        redisAppendCommand(c, "PEXPIRE %s %d", k, d->lease_ms);
      }
    }
    bool ok =
        n == 0 || read_replies(d, c, n, full ? (size_t)-1 : zero_from, &zeros, err, sizeof(err));

    pthread_mutex_lock(&d->mu);
    if (ok) {
      for (size_t i = 0; i < nops; i++)
        if (ops[i].type == OP_PUT)
          d->puts++;
        else
          d->dels++;
      if (full) d->puts += nextra;
      if (full || refresh) next_refresh = now + (uint64_t)d->lease_ms / 3;
      if (zeros) {
        SKV_WARN_RL(SKV_SUBSYS_KV,
                    "cluster: Redis lost %zu of node '%s''s entries (restarted or flushed): "
                    "republishing",
                    zeros, d->node);
        d->need_full = true;
      }
    } else {
      d->errors++;
      SKV_WARN_RL(SKV_SUBSYS_KV,
                  "cluster: Redis at %s failed: %s (node-local service goes on; reconnecting)",
                  d->url, err);
      redisFree(d->bg);
      d->bg = NULL;
      d->connected = false;
      next_try = now + 200;
    }
    d->seq_done = target;
    pthread_cond_broadcast(&d->done_cv);
  }
  pthread_mutex_unlock(&d->mu);
  free(ops);
  free(extra);
  return NULL;
}

int skv__dir_create(const skv__dir_params_t *p, skv__dir_t **out) {
  *out = NULL;
  skv__dir_t *d = calloc(1, sizeof(*d));
  if (!d) return SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_KV, "cluster: out of memory");
  int rc = parse_url(d, p->url);
  if (rc) {
    free(d);
    return rc;
  }
  snprintf(d->prefix, sizeof(d->prefix), "%s", p->prefix);
  snprintf(d->node, sizeof(d->node), "%s", p->node);
  d->nonce = p->nonce;
  d->timeout_ms = p->timeout_ms;
  d->lease_ms = p->lease_ms;
  d->pages = p->pages;
  d->state_words = p->state_words;
  d->state_stride = p->state_stride;
  d->pe = p->pe;
  pthread_mutex_init(&d->mu, NULL);
  pthread_mutex_init(&d->lk_mu, NULL);
  pthread_condattr_t ca; /* deadlines are skv__now_ns() (monotonic) times */
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&d->cv, &ca);
  pthread_cond_init(&d->done_cv, &ca);
  pthread_condattr_destroy(&ca);
  d->blob = malloc(p->blob_len);
  d->tr = calloc(p->pages ? p->pages : 1, sizeof(*d->tr));
  if (!d->blob || !d->tr) {
    skv__dir_destroy(d);
    return SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_KV, "cluster: out of memory");
  }
  memcpy(d->blob, p->blob, p->blob_len);
  d->blob_len = p->blob_len;
  char err[256];
  d->bg = dir_connect(d, err, sizeof(err));
  if (!d->bg) {
    skv__dir_destroy(d);
    return SKV_FAIL(SKV_ECONN, SKV_SUBSYS_KV,
                    "cluster: cannot reach Redis at %s: %s (start redis-server or fix "
                    "SKV_REDIS_URL; the node's own cache is not affected)",
                    p->url, err);
  }
  append_node(d, d->bg);
  size_t z;
  if (!read_replies(d, d->bg, 1, (size_t)-1, &z, err, sizeof(err))) {
    skv__dir_destroy(d);
    return SKV_FAIL(SKV_ECONN, SKV_SUBSYS_KV, "cluster: Redis at %s refused the node record: %s",
                    p->url, err);
  }
  d->connected = true;
  if (pthread_create(&d->thr, NULL, dir_main, d) != 0) {
    skv__dir_destroy(d);
    return SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_KV, "cluster: cannot start the directory thread");
  }
  d->thr_started = true;
  *out = d;
  return 0;
}

void skv__dir_destroy(skv__dir_t *d) {
  if (!d) return;
  if (d->thr_started) {
    pthread_mutex_lock(&d->mu);
    d->stop = true;
    pthread_cond_broadcast(&d->cv);
    pthread_mutex_unlock(&d->mu);
    pthread_join(d->thr, NULL);
  }
  if (d->bg && d->tr) { /* take our entries and record out (best effort, bounded) */
    size_t n = 0, z;
    char err[256];
    for (uint64_t p = 0; p < d->pages; p++)
      if (d->tr[p].on) {
        dir_op_t op = {OP_DEL, d->tr[p].key, make_val(d, (uint32_t)p, d->tr[p].gen)};
        append_op(d, d->bg, &op);
        n++;
      }
    char k[2 * SKV__CL_NAME_CAP + 16];
    snprintf(k, sizeof(k), "%s:node:%s", d->prefix, d->node);
    redisAppendCommand(d->bg, "DEL %s", k);
    (void)read_replies(d, d->bg, n + 1, (size_t)-1, &z, err, sizeof(err));
  }
  if (d->bg) redisFree(d->bg);
  if (d->lk) redisFree(d->lk);
  pthread_mutex_destroy(&d->mu);
  pthread_mutex_destroy(&d->lk_mu);
  pthread_cond_destroy(&d->cv);
  pthread_cond_destroy(&d->done_cv);
  free(d->q);
  free(d->tr);
  free(d->blob);
  free(d);
}

void skv__dir_track(skv__dir_t *d, uint32_t page, skv_key_t key, uint32_t gen) {
  if (page >= d->pages) return;
  pthread_mutex_lock(&d->mu);
  dir_track_t *t = &d->tr[page];
  if (t->on && t->gen == gen && t->key.hi == key.hi && t->key.lo == key.lo) {
    pthread_mutex_unlock(&d->mu);
    return;
  }
  if (t->on) {
    skv__dir_val_t old = make_val(d, page, t->gen);
    push_op(d, OP_DEL, t->key, &old);
  } else {
    d->exported++;
  }
  *t = (dir_track_t){key, gen, 1};
  skv__dir_val_t v = make_val(d, page, gen);
  push_op(d, OP_PUT, key, &v);
  pthread_cond_signal(&d->cv);
  pthread_mutex_unlock(&d->mu);
}

void skv__dir_forget(skv__dir_t *d, skv_key_t key, const skv__dir_val_t *val) {
  pthread_mutex_lock(&d->mu);
  push_op(d, OP_DEL, key, val);
  pthread_cond_signal(&d->cv);
  pthread_mutex_unlock(&d->mu);
}

int skv__dir_flush(skv__dir_t *d) {
  uint64_t deadline = skv__now_ns() + (uint64_t)d->timeout_ms * 1000000ull;
  pthread_mutex_lock(&d->mu);
  uint64_t target = d->seq_queued;
  pthread_cond_signal(&d->cv);
  int rc = 0;
  while (d->seq_done < target) {
    if (!d->connected) {
      rc = SKV_ECONN;
      break;
    }
    struct timespec ts = skv__ts_at(deadline);
    if (pthread_cond_timedwait(&d->done_cv, &d->mu, &ts) != 0 && skv__now_ns() >= deadline) {
      rc = SKV_ETIMEDOUT;
      break;
    }
  }
  if (!rc && !d->connected) rc = SKV_ECONN;
  pthread_mutex_unlock(&d->mu);
  if (rc == SKV_ECONN)
    return SKV_FAIL(SKV_ECONN, SKV_SUBSYS_KV,
                    "cluster: Redis at %s is unreachable: the directory writes wait for it to "
                    "come back (node-local service goes on)",
                    d->url);
  if (rc)
    return SKV_FAIL(rc, SKV_SUBSYS_KV, "cluster: directory writes not done within %d ms",
                    d->timeout_ms);
  return 0;
}

/* The lookups' connection, made when needed (not more often than every 500 ms after a
 * failure, so that lookups stay fast while Redis is away). Under lk_mu. */
static int lk_conn(skv__dir_t *d) {
  if (d->lk) return 0;
  uint64_t now = skv__now_ms();
  if (now < d->lk_retry_ms)
    return SKV_FAIL(SKV_ECONN, SKV_SUBSYS_KV,
                    "cluster: Redis at %s is unreachable (retried every 500 ms): node-local "
                    "hits only",
                    d->url);
  char err[256];
  d->lk = dir_connect(d, err, sizeof(err));
  if (!d->lk) {
    d->lk_retry_ms = now + 500;
    return SKV_FAIL(SKV_ECONN, SKV_SUBSYS_KV,
                    "cluster: cannot reach Redis at %s: %s (node-local hits only)", d->url, err);
  }
  return 0;
}

static int lk_broken(skv__dir_t *d, const char *what) {
  char msg[256];
  snprintf(msg, sizeof(msg), "%s", d->lk->errstr[0] ? d->lk->errstr : "connection lost");
  redisFree(d->lk);
  d->lk = NULL;
  d->lk_retry_ms = skv__now_ms() + 500;
  pthread_mutex_lock(&d->mu);
  d->errors++;
  pthread_mutex_unlock(&d->mu);
  return SKV_FAIL(SKV_ECONN, SKV_SUBSYS_KV,
                  "cluster: %s at Redis %s failed: %s (node-local hits only)", what, d->url, msg);
}

int skv__dir_mget(skv__dir_t *d, const skv_key_t *keys, size_t n, skv__dir_val_t *vals,
                  bool *found) {
  if (n == 0) return 0;
  const char **argv = malloc((n + 1) * sizeof(*argv));
  size_t *argl = malloc((n + 1) * sizeof(*argl));
  char *names = malloc(n * (SKV__CL_NAME_CAP + 48));
  if (!argv || !argl || !names) {
    free(argv), free(argl), free(names);
    return SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_KV, "cluster: out of memory");
  }
  argv[0] = "MGET";
  argl[0] = 4;
  for (size_t i = 0; i < n; i++) {
    char *k = names + i * (SKV__CL_NAME_CAP + 48);
    key_name(d, keys[i], k, SKV__CL_NAME_CAP + 48);
    argv[i + 1] = k;
    argl[i + 1] = strlen(k);
  }
  pthread_mutex_lock(&d->lk_mu);
  int rc = lk_conn(d);
  redisReply *r = NULL;
  if (!rc) {
    r = redisCommandArgv(d->lk, (int)n + 1, argv, argl);
    if (!r) rc = lk_broken(d, "MGET");
  }
  pthread_mutex_unlock(&d->lk_mu);
  free(argv), free(argl), free(names);
  if (rc) return rc;
  if (r->type != REDIS_REPLY_ARRAY || r->elements != n) {
    rc = SKV_FAIL(SKV_EPROTO, SKV_SUBSYS_KV, "cluster: Redis answered MGET with %s",
                  r->type == REDIS_REPLY_ERROR ? r->str : "something else than an array");
  } else {
    for (size_t i = 0; i < n; i++) {
      redisReply *e = r->element[i];
      found[i] = e->type == REDIS_REPLY_STRING && e->len == sizeof(skv__dir_val_t);
      if (found[i]) {
        memcpy(&vals[i], e->str, sizeof(vals[i]));
        vals[i].node[SKV__CL_NAME_CAP - 1] = 0;
      }
    }
  }
  freeReplyObject(r);
  return rc;
}

int skv__dir_node(skv__dir_t *d, const char *node, void **blob, size_t *len) {
  char k[2 * SKV__CL_NAME_CAP + 16];
  snprintf(k, sizeof(k), "%s:node:%s", d->prefix, node);
  pthread_mutex_lock(&d->lk_mu);
  int rc = lk_conn(d);
  redisReply *r = NULL;
  if (!rc) {
    r = redisCommand(d->lk, "GET %s", k);
    if (!r) rc = lk_broken(d, "GET of a node record");
  }
  pthread_mutex_unlock(&d->lk_mu);
  if (rc) return rc;
  if (r->type == REDIS_REPLY_STRING) {
    *blob = malloc(r->len);
    if (*blob)
      memcpy(*blob, r->str, r->len), *len = r->len;
    else
      rc = SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_KV, "cluster: out of memory");
  } else if (r->type == REDIS_REPLY_NIL) {
    rc = SKV_ENOTFOUND; /* the caller says what it means */
  } else {
    rc = SKV_FAIL(SKV_EPROTO, SKV_SUBSYS_KV, "cluster: Redis answered GET %s with %s", k,
                  r->type == REDIS_REPLY_ERROR ? r->str : "something else than a string");
  }
  freeReplyObject(r);
  return rc;
}

void skv__dir_counters(const skv__dir_t *d, skv__dir_counters_t *c) {
  skv__dir_t *m = (skv__dir_t *)d;
  pthread_mutex_lock(&m->mu);
  *c = (skv__dir_counters_t){d->exported, d->puts, d->dels, d->errors, d->reconnects};
  pthread_mutex_unlock(&m->mu);
}
