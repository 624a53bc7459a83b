/* The bootstrap key-value store server: a libuv loop on a background thread of rank 0 that serves
 * the protocol to every PE over TCP, parking blocking requests; the keys are in store_table.c. */
#define _GNU_SOURCE
#include "bootstrap/proto.h"
#include "bootstrap/store_table.h"

#include <errno.h>
#include <inttypes.h>
#include <netdb.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>
#include <uv.h>

/* How it works
 *
 * One thread runs a libuv loop that owns every piece of server state (connections, the key
 * table of store_table.c, parked requests); the only cross-thread traffic is the stop request (a
 * uv_async plus `stop` under `mu`) and the count of live ranks that skv__store_server_stop waits
 * on. Parked requests stay here, not with the table: they are a connection's state (its frame,
 * deadline and place in the reply order), and a SET or ADD on the table is what wakes them.
 *
 * Each connection accumulates bytes in `in` and handles every complete frame in order. A
 * blocking request (GET, WAIT, WAIT_GE) that cannot be answered at once is parked on the
 * connection (a copy of its frame, a deadline) and the connection stops handling frames until
 * it is answered: a well-behaved client has one request in flight, so replies stay in order.
 * SET and ADD re-check every parked request; one timer, armed for the earliest deadline
 * (parked requests, HELLO deadlines), answers timeouts and drops silent connections.
 * Connections that have not said HELLO are also on the `pre` list, in accept order (so in
 * deadline order): strangers can open them at will, so they have a budget of their own
 * (pre_max), and the oldest goes when a new one would exceed it; PEs reconnect when shed.
 *
 * What can go wrong: a reply must never free or close a connection while a list is being
 * walked, so send_reply only flags a connection whose peer does not read (`kill`), and
 * connections that must be looked at again (flagged, or unparked with frames queued) go on the
 * `ready` list, which every libuv callback drains before returning. Memory of a closed
 * connection is freed only in its close callback, after libuv has cancelled its writes. */

/* Connections that have not said HELLO yet: a budget of their own, so that strangers holding
 * connections open never keep a PE out nor use up rank 0's descriptors. When it is full the
 * oldest goes (a PE whose connection is shed before HELLO connects again). Connections that
 * said HELLO are one per live rank. */
#define MAX_PRE_HELLO    64
#define MAX_PRE_HELLO_HI 1024 /* a large job's PEs start at once: nranks of them, up to this */
#define READ_CHUNK       65536u
#define WRITE_QUEUE_MAX  (2u * (SKV_BOOT_MAX_FRAME + SKV_BOOT_REPLY_HDR))
#define MAX_RANKS        (1 << 20)
#define MSG_CAP          512

typedef enum { RANK_NONE = 0, RANK_LIVE, RANK_LEFT, RANK_DEAD } rank_state_t;

/* ---- connections and the server ---------------------------------------------------------- */

typedef struct conn conn_t;
typedef struct skv__store_server skv__store_server_t;

struct conn {
  uv_tcp_t tcp;
  uv_shutdown_t shutdown;
  skv__store_server_t *srv;
  conn_t *prev, *next;   /* srv->conns */
  conn_t *pprev, *pnext; /* srv->parked */
  conn_t *rprev, *rnext; /* srv->ready */
  conn_t *qprev, *qnext; /* srv->pre_head .. pre_tail: before HELLO, oldest first */
  bool in_pre;
  bool parked, ready;
  char peer[80];
  int rank; /* -1 until HELLO */
  bool said_hello, said_bye, closing, kill;
  uint64_t hello_deadline;
  uint8_t *in;
  size_t in_len, in_cap;
  /* the parked request: a copy of its frame */
  uint8_t park_op;
  int32_t park_timeout;
  uint64_t park_deadline;
  uint8_t *park_frame;
  size_t park_len;
  size_t park_off;    /* WAIT: offset of the first key not yet seen */
  uint32_t park_left; /* WAIT: keys not yet seen */
};

struct skv__store_server {
  uv_loop_t loop;
  uv_tcp_t listener;
  uv_async_t async;
  uv_timer_t timer;
  pthread_t thread;
  bool loop_ready, thread_started, shutting_down;
  uint8_t *token;
  size_t token_len;
  int nranks;
  int port;
  conn_t *conns, *parked, *ready;
  conn_t *pre_head, *pre_tail; /* connections before HELLO, in accept order */
  int nconns, npre, pre_max;
  skv__table_t tab;
  uint64_t timer_due;
  uint8_t *rank_state;
  conn_t **rank_conn;
  int dead_rank;
  char dead_msg[160];
  /* shared with the stopping thread */
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int nlive; /* ranks that said HELLO and neither BYE nor disconnected */
  bool stop;
};

#define LIST_ADD(head, c, P, N) \
  do {                          \
    (c)->P = NULL;              \
    (c)->N = (head);            \
    if (head) (head)->P = (c);  \
    (head) = (c);               \
  } while (0)
#define LIST_DEL(head, c, P, N)     \
  do {                              \
    if ((c)->P)                     \
      (c)->P->N = (c)->N;           \
    else                            \
      (head) = (c)->N;              \
    if ((c)->N) (c)->N->P = (c)->P; \
    (c)->P = (c)->N = NULL;         \
  } while (0)

/* Printable copy of a key for messages. */
static const char *show_key(const uint8_t *k, size_t kl, char *buf, size_t cap) {
  size_t o = 0, lim = SKV_MIN(kl, (size_t)80);
  for (size_t i = 0; i < lim && o + 4 < cap; i++)
    buf[o++] = (k[i] >= 32 && k[i] < 127) ? (char)k[i] : '?';
  if (kl > lim && o + 4 < cap) {
    memcpy(buf + o, "...", 3);
    o += 3;
  }
  buf[o] = '\0';
  return buf;
}

static void set_rank_state(skv__store_server_t *srv, int rank, rank_state_t st) {
  pthread_mutex_lock(&srv->mu);
  bool was_live = srv->rank_state[rank] == RANK_LIVE;
  srv->rank_state[rank] = (uint8_t)st;
  if (was_live && st != RANK_LIVE) srv->nlive--;
  if (!was_live && st == RANK_LIVE) srv->nlive++;
  pthread_cond_broadcast(&srv->cv);
  pthread_mutex_unlock(&srv->mu);
}

/* "; ranks not connected: 2, 5; ranks that left: 1" (empty when every rank is connected). */
static void ranks_summary(skv__store_server_t *srv, char *buf, size_t cap) {
  static const char *what[] = {"never connected", "", "left", "disconnected without leaving"};
  size_t o = 0;
  buf[0] = '\0';
  for (int s = RANK_NONE; s <= RANK_DEAD; s++) {
    if (s == RANK_LIVE) continue;
    int shown = 0, more = 0;
    for (int r = 0; r < srv->nranks; r++) {
      if (srv->rank_state[r] != s) continue;
      if (shown == 8) {
        more++;
        continue;
      }
      if (o + 40 >= cap) break;
      o += (size_t)snprintf(buf + o, cap - o, "%s%d", shown ? ", " : "; ranks ", r);
      shown++;
    }
    if (more && o + 40 < cap) o += (size_t)snprintf(buf + o, cap - o, " and %d more", more);
    if (shown && o + 40 < cap) o += (size_t)snprintf(buf + o, cap - o, " %s", what[s]);
  }
}

/* ---- replies ---------------------------------------------------------------------------- */

typedef struct wreq {
  uv_write_t req;
  uint8_t data[];
} wreq_t;

static void on_write(uv_write_t *req, int status) {
  if (status < 0 && status != UV_ECANCELED)
    SKV_TRACE(SKV_SUBSYS_BOOT, "bootstrap store: a reply could not be sent: %s",
              uv_strerror(status));
  free(req); /* the wreq_t begins with the uv_write_t */
}

static void mark_ready(conn_t *c) {
  if (c->ready || c->closing) return;
  c->ready = true;
  LIST_ADD(c->srv->ready, c, rprev, rnext);
}

/* Queue the reply {status, a, b}. Never closes `c` (see "what can go wrong"). */
static void send_reply(conn_t *c, int32_t status, const void *a, size_t alen, const void *b,
                       size_t blen) {
  if (c->closing) return;
  size_t len = 4 + alen + blen; /* after the length field */
  wreq_t *w = malloc(sizeof *w + SKV_BOOT_FRAME_HDR + len);
  if (!w) {
    SKV_WARN_RL(SKV_SUBSYS_BOOT,
                "bootstrap store: out of memory for a %zu-byte reply to %s; closing it", len,
                c->peer);
    c->kill = true;
    mark_ready(c);
    return;
  }
  skv__reply_hdr_put(w->data, alen + blen, status);
  if (alen) memcpy(w->data + SKV_BOOT_REPLY_HDR, a, alen);
  if (blen) memcpy(w->data + SKV_BOOT_REPLY_HDR + alen, b, blen);
  uv_buf_t buf = uv_buf_init((char *)w->data, (unsigned)(SKV_BOOT_FRAME_HDR + len));
  int rc = uv_write(&w->req, (uv_stream_t *)&c->tcp, &buf, 1, on_write);
  if (rc < 0) {
    free(w);
    SKV_INFO_RL(SKV_SUBSYS_BOOT, "bootstrap store: reply to %s failed: %s", c->peer,
                uv_strerror(rc));
    c->kill = true;
    mark_ready(c);
    return;
  }
  if (c->tcp.write_queue_size > WRITE_QUEUE_MAX) {
    SKV_WARN_RL(
        SKV_SUBSYS_BOOT,
        "bootstrap store: %s does not read its replies (%zu bytes queued); closing its connection",
        c->peer, c->tcp.write_queue_size);
    c->kill = true;
    mark_ready(c);
  }
}

static void reply_msg(conn_t *c, int32_t status, const char *msg) {
  send_reply(c, status, msg, strlen(msg), NULL, 0);
}

/* ---- timer ------------------------------------------------------------------------------ */

static void on_timer(uv_timer_t *t);

static void timer_want(skv__store_server_t *srv, uint64_t due) {
  if (srv->shutting_down || due >= srv->timer_due) return;
  uint64_t now = uv_now(&srv->loop);
  srv->timer_due = due;
  uv_timer_start(&srv->timer, on_timer, due > now ? due - now : 0, 0);
}

/* ---- connections before HELLO ---------------------------------------------------------- */

static void pre_add(conn_t *c) {
  skv__store_server_t *srv = c->srv;
  c->qnext = NULL;
  c->qprev = srv->pre_tail;
  if (srv->pre_tail)
    srv->pre_tail->qnext = c;
  else
    srv->pre_head = c;
  srv->pre_tail = c;
  c->in_pre = true;
  srv->npre++;
}

static void pre_del(conn_t *c) {
  skv__store_server_t *srv = c->srv;
  if (!c->in_pre) return;
  if (c->qprev)
    c->qprev->qnext = c->qnext;
  else
    srv->pre_head = c->qnext;
  if (c->qnext)
    c->qnext->qprev = c->qprev;
  else
    srv->pre_tail = c->qprev;
  c->qprev = c->qnext = NULL;
  c->in_pre = false;
  srv->npre--;
}

/* ---- closing ---------------------------------------------------------------------------- */

static void unpark(conn_t *c) {
  if (!c->parked) return;
  LIST_DEL(c->srv->parked, c, pprev, pnext);
  c->parked = false;
  c->park_op = 0;
  free(c->park_frame);
  c->park_frame = NULL;
  c->park_len = 0;
  if (c->in_len > 0) mark_ready(c); /* queued frames wait for us */
}

static void on_conn_closed(uv_handle_t *h) {
  conn_t *c = h->data;
  skv__store_server_t *srv = c->srv;
  LIST_DEL(srv->conns, c, prev, next);
  srv->nconns--;
  free(c->in);
  free(c->park_frame);
  free(c);
}

static void on_shutdown(uv_shutdown_t *req, int status) {
  conn_t *c = req->data;
  if (!uv_is_closing((uv_handle_t *)&c->tcp)) uv_close((uv_handle_t *)&c->tcp, on_conn_closed);
}

static void mark_dead(skv__store_server_t *srv, int rank);

/* Forget `c` as a rank and a parked request. When `after_write`, its queued replies are sent
 * first (uv_shutdown), else they are dropped. A rank that leaves without BYE is marked dead. */
static void conn_close(conn_t *c, bool after_write) {
  if (c->closing) return;
  skv__store_server_t *srv = c->srv;
  unpark(c);
  pre_del(c);
  if (c->ready) {
    LIST_DEL(srv->ready, c, rprev, rnext);
    c->ready = false;
  }
  c->closing = true;
  int rank = -1;
  if (c->said_hello && srv->rank_conn[c->rank] == c) {
    srv->rank_conn[c->rank] = NULL;
    rank = c->rank;
    if (!srv->shutting_down) set_rank_state(srv, rank, c->said_bye ? RANK_LEFT : RANK_DEAD);
  }
  uv_read_stop((uv_stream_t *)&c->tcp);
  int rc = -1;
  if (after_write) {
    c->shutdown.data = c;
    rc = uv_shutdown(&c->shutdown, (uv_stream_t *)&c->tcp, on_shutdown);
  }
  if (rc != 0) uv_close((uv_handle_t *)&c->tcp, on_conn_closed);
  if (rank >= 0 && !c->said_bye && !srv->shutting_down) mark_dead(srv, rank);
}

static void mark_dead(skv__store_server_t *srv, int rank) {
  if (srv->dead_rank < 0) {
    srv->dead_rank = rank;
    snprintf(srv->dead_msg, sizeof srv->dead_msg,
             "rank %d disconnected from the bootstrap store without leaving", rank);
  }
  char msg[MSG_CAP];
  snprintf(msg, sizeof msg, "%s (it probably crashed or was killed)", srv->dead_msg);
  while (srv->parked) {
    conn_t *p = srv->parked;
    send_reply(p, SKV_EPEERDEAD, msg, strlen(msg), NULL, 0);
    unpark(p);
  }
}

/* ---- parked requests -------------------------------------------------------------------- */

/* A reader over the parked request's frame, past its opcode and timeout: at the key of a GET or
 * WAIT_GE, at the first key not yet seen of a WAIT. */
static void park_reader(const conn_t *c, skv__reader_t *r) {
  skv__read_init(r, c->park_frame, c->park_len, 1);
  (void)skv__read_u32(r);
  if (c->park_op == SKV_BOOT_OP_WAIT) r->off = c->park_off;
}

/* Is the parked (or about to be parked) request of `c` answerable now? Answers it if so. */
static bool try_complete(conn_t *c) {
  skv__store_server_t *srv = c->srv;
  skv__reader_t r;
  park_reader(c, &r);
  size_t kl = 0;
  const uint8_t *k;
  switch (c->park_op) {
  case SKV_BOOT_OP_GET: {
    k = skv__read_key(&r, &kl);
    skv__entry_t *e = skv__table_find(&srv->tab, k, kl);
    if (!e) return false;
    send_reply(c, 0, e->val, e->vlen, NULL, 0);
    return true;
  }
  case SKV_BOOT_OP_WAIT: {
    while (c->park_left > 0) {
      size_t at = r.off;
      k = skv__read_key(&r, &kl);
      if (!skv__table_find(&srv->tab, k, kl)) {
        c->park_off = at;
        return false;
      }
      c->park_left--;
    }
    c->park_off = r.off;
    send_reply(c, 0, NULL, 0, NULL, 0);
    return true;
  }
  case SKV_BOOT_OP_WAIT_GE: {
    k = skv__read_key(&r, &kl);
    int64_t target = (int64_t)skv__read_u64(&r);
    skv__entry_t *e = skv__table_find(&srv->tab, k, kl);
    int64_t v = 0;
    if (e && e->vlen == 8) v = (int64_t)skv__get_le64(e->val);
    if (e && e->vlen != 8) {
      char kb[96], msg[MSG_CAP];
      snprintf(msg, sizeof msg, "key \"%s\" holds a %u-byte value, not a counter",
               show_key(k, kl, kb, sizeof kb), e->vlen);
      reply_msg(c, SKV_EINVAL, msg);
      return true;
    }
    if (v < target) return false;
    uint8_t b[8];
    skv__put_le64(b, (uint64_t)v);
    send_reply(c, 0, b, 8, NULL, 0);
    return true;
  }
  default:
    return true;
  }
}

/* A SET or ADD happened: answer the parked requests it satisfies. */
static void wake_parked(skv__store_server_t *srv) {
  conn_t *c = srv->parked;
  while (c) {
    conn_t *next = c->pnext;
    if (try_complete(c)) unpark(c);
    c = next;
  }
}

static void timeout_reply(conn_t *c) {
  skv__store_server_t *srv = c->srv;
  char msg[MSG_CAP], kb[96], ranks[256];
  skv__reader_t r;
  park_reader(c, &r);
  size_t kl = 0;
  const uint8_t *k;
  ranks_summary(srv, ranks, sizeof ranks);
  switch (c->park_op) {
  case SKV_BOOT_OP_GET:
    k = skv__read_key(&r, &kl);
    snprintf(msg, sizeof msg, "timed out after %d ms waiting for key \"%s\"; no PE set it%s",
             (int)c->park_timeout, show_key(k, kl, kb, sizeof kb), ranks);
    break;
  case SKV_BOOT_OP_WAIT:
    k = skv__read_key(&r, &kl);
    snprintf(msg, sizeof msg, "timed out after %d ms with %u keys missing, first \"%s\"%s",
             (int)c->park_timeout, c->park_left, show_key(k, kl, kb, sizeof kb), ranks);
    break;
  default: {
    k = skv__read_key(&r, &kl);
    int64_t target = (int64_t)skv__read_u64(&r);
    skv__entry_t *e = skv__table_find(&srv->tab, k, kl);
    int64_t v = (e && e->vlen == 8) ? (int64_t)skv__get_le64(e->val) : 0;
    snprintf(msg, sizeof msg,
             "timed out after %d ms: counter \"%s\" is %" PRId64 ", waiting for %" PRId64 "%s",
             (int)c->park_timeout, show_key(k, kl, kb, sizeof kb), v, target, ranks);
    break;
  }
  }
  reply_msg(c, SKV_ETIMEDOUT, msg);
}

static void drain(skv__store_server_t *srv);

static void on_timer(uv_timer_t *t) {
  skv__store_server_t *srv = t->data;
  uint64_t now = uv_now(&srv->loop), next = UINT64_MAX;
  srv->timer_due = UINT64_MAX;
  /* connections before HELLO are in accept order, so in deadline order */
  while (srv->pre_head && now >= srv->pre_head->hello_deadline) {
    conn_t *c = srv->pre_head;
    SKV_WARN_RL(SKV_SUBSYS_BOOT,
                "bootstrap store: %s did not say HELLO within %d ms; closing its connection",
                c->peer, SKV_BOOT_HELLO_TIMEOUT_MS);
    conn_close(c, false); /* takes it off the list */
  }
  if (srv->pre_head) next = srv->pre_head->hello_deadline;
  conn_t *c = srv->parked;
  while (c) {
    conn_t *pn = c->pnext;
    if (now >= c->park_deadline) {
      timeout_reply(c);
      unpark(c);
    } else {
      next = SKV_MIN(next, c->park_deadline);
    }
    c = pn;
  }
  if (next != UINT64_MAX) timer_want(srv, next);
  drain(srv);
}

static void park(conn_t *c, uint8_t op, int32_t timeout, const uint8_t *p, size_t n) {
  skv__store_server_t *srv = c->srv;
  c->park_frame = malloc(n);
  if (!c->park_frame) {
    reply_msg(c, SKV_ENOMEM, "the store server is out of memory for a waiting request");
    return;
  }
  memcpy(c->park_frame, p, n);
  c->park_len = n;
  c->park_op = op;
  c->park_timeout = timeout;
  if (try_complete(c)) {
    free(c->park_frame);
    c->park_frame = NULL;
    c->park_op = 0;
    return;
  }
  if (srv->dead_rank >= 0) {
    char msg[MSG_CAP];
    snprintf(msg, sizeof msg, "%s (it probably crashed or was killed)", srv->dead_msg);
    reply_msg(c, SKV_EPEERDEAD, msg);
    free(c->park_frame);
    c->park_frame = NULL;
    c->park_op = 0;
    return;
  }
  if (timeout == 0) {
    timeout_reply(c);
    free(c->park_frame);
    c->park_frame = NULL;
    c->park_op = 0;
    return;
  }
  c->park_deadline = uv_now(&srv->loop) + (uint64_t)timeout;
  c->parked = true;
  LIST_ADD(srv->parked, c, pprev, pnext);
  timer_want(srv, c->park_deadline);
}

/* ---- frames ----------------------------------------------------------------------------- */

static void protocol_error(conn_t *c, const char *what) {
  if (c->said_hello)
    SKV_WARN_RL(SKV_SUBSYS_BOOT, "bootstrap store: rank %d (%s) sent %s; closing its connection",
                c->rank, c->peer, what);
  else
    SKV_WARN_RL(SKV_SUBSYS_BOOT, "bootstrap store: %s sent %s; closing its connection", c->peer,
                what);
  conn_close(c, false);
}

/* HELLO {u32 version, i32 rank, i32 nranks, token}. */
static void handle_hello(conn_t *c, const uint8_t *p, size_t n) {
  skv__store_server_t *srv = c->srv;
  char msg[MSG_CAP];
  if (p[0] != SKV_BOOT_OP_HELLO) {
    char what[64];
    snprintf(what, sizeof what, "opcode %u before HELLO", p[0]);
    protocol_error(c, what);
    return;
  }
  if (n < SKV_BOOT_HELLO_FIXED || n - SKV_BOOT_HELLO_FIXED > SKV_BOOT_MAX_TOKEN) {
    protocol_error(c, "a malformed HELLO");
    return;
  }
  skv__reader_t r;
  skv__read_init(&r, p, n, 1);
  uint32_t ver = skv__read_u32(&r);
  int32_t rank = (int32_t)skv__read_u32(&r), nranks = (int32_t)skv__read_u32(&r);
  const uint8_t *tok = p + r.off;
  size_t tlen = n - r.off;
  uint8_t vb[4];
  skv__put_le32(vb, SKV_BOOT_PROTO_VERSION);
  /* The token first: a stranger learns nothing, not even the protocol version. */
  if (!skv__consttime_eq(tok, tlen, srv->token, srv->token_len)) {
    SKV_WARN_RL(
        SKV_SUBSYS_BOOT,
        "bootstrap store: %s presented a wrong token (claiming rank %d); closing its connection",
        c->peer, (int)rank);
    reply_msg(c, SKV_EAUTH, "the bootstrap store rejected this PE's token");
    conn_close(c, true);
    return;
  }
  if (ver != SKV_BOOT_PROTO_VERSION) {
    snprintf(msg, sizeof msg,
             "this PE speaks bootstrap protocol %u, the store speaks %u: every PE must "
             "run the same symkv version",
             ver, SKV_BOOT_PROTO_VERSION);
    SKV_WARN_RL(SKV_SUBSYS_BOOT, "bootstrap store: %s: %s; closing its connection", c->peer, msg);
    reply_msg(c, SKV_EVERSION, msg);
    conn_close(c, true);
    return;
  }
  msg[0] = '\0';
  if (nranks != srv->nranks)
    snprintf(msg, sizeof msg, "this PE says the job has %d ranks but the store serves %d",
             (int)nranks, srv->nranks);
  else if (rank < 0 || rank >= srv->nranks)
    snprintf(msg, sizeof msg, "rank %d is not in [0, %d)", (int)rank, srv->nranks);
  else if (srv->rank_state[rank] == RANK_LIVE)
    snprintf(msg, sizeof msg,
             "rank %d is already connected (from %s): two PEs were given the same rank", (int)rank,
             srv->rank_conn[rank] ? srv->rank_conn[rank]->peer : "?");
  if (msg[0]) {
    SKV_WARN_RL(SKV_SUBSYS_BOOT, "bootstrap store: rejected %s: %s", c->peer, msg);
    reply_msg(c, SKV_EINVAL, msg);
    conn_close(c, true);
    return;
  }
  pre_del(c);
  c->said_hello = true;
  c->rank = rank;
  srv->rank_conn[rank] = c;
  set_rank_state(srv, rank, RANK_LIVE);
  SKV_INFO(SKV_SUBSYS_BOOT, "bootstrap store: rank %d of %d joined from %s", (int)rank, srv->nranks,
           c->peer);
  send_reply(c, 0, vb, 4, NULL, 0);
}

static bool key_ok(conn_t *c, size_t kl) {
  if (kl >= 1 && kl <= SKV_BOOT_MAX_KEY) return true;
  char msg[MSG_CAP];
  snprintf(msg, sizeof msg, "key of %zu bytes is not in 1..%d bytes", kl, SKV_BOOT_MAX_KEY);
  reply_msg(c, SKV_EINVAL, msg);
  return false;
}

static bool timeout_ok(conn_t *c, int32_t t) {
  if (t >= 0) return true;
  char msg[MSG_CAP];
  snprintf(msg, sizeof msg, "timeout of %d ms is negative", (int)t);
  reply_msg(c, SKV_EINVAL, msg);
  return false;
}

static void handle_frame(conn_t *c, const uint8_t *p, size_t n) {
  skv__store_server_t *srv = c->srv;
  if (!c->said_hello) {
    handle_hello(c, p, n);
    return;
  }
  skv__reader_t r;
  skv__read_init(&r, p, n, 1);
  size_t kl = 0;
  const uint8_t *k;
  char msg[MSG_CAP], kb[96];
  switch (p[0]) {
  case SKV_BOOT_OP_SET: {
    k = skv__read_key(&r, &kl);
    uint32_t vl = skv__read_u32(&r);
    const uint8_t *v = skv__read_take(&r, vl);
    if (!skv__read_done(&r)) break;
    if (!key_ok(c, kl)) return;
    if (vl > SKV_BOOT_MAX_VALUE) {
      snprintf(msg, sizeof msg, "value of %u bytes for key \"%s\" is over the %u-byte limit", vl,
               show_key(k, kl, kb, sizeof kb), SKV_BOOT_MAX_VALUE);
      reply_msg(c, SKV_EINVAL, msg);
      return;
    }
    int rc = skv__table_set(&srv->tab, k, kl, v, vl, msg, sizeof msg);
    if (rc < 0) {
      reply_msg(c, rc, msg);
      return;
    }
    send_reply(c, 0, NULL, 0, NULL, 0);
    wake_parked(srv);
    return;
  }
  case SKV_BOOT_OP_GET:
  case SKV_BOOT_OP_WAIT_GE: {
    int32_t t = (int32_t)skv__read_u32(&r);
    k = skv__read_key(&r, &kl);
    if (p[0] == SKV_BOOT_OP_WAIT_GE) (void)skv__read_u64(&r);
    if (!skv__read_done(&r)) break;
    if (!key_ok(c, kl) || !timeout_ok(c, t)) return;
    park(c, p[0], t, p, n);
    return;
  }
  case SKV_BOOT_OP_TRY_GET: {
    k = skv__read_key(&r, &kl);
    if (!skv__read_done(&r)) break;
    if (!key_ok(c, kl)) return;
    skv__entry_t *e = skv__table_find(&srv->tab, k, kl);
    if (!e) {
      snprintf(msg, sizeof msg, "key \"%s\" does not exist", show_key(k, kl, kb, sizeof kb));
      reply_msg(c, SKV_ENOTFOUND, msg);
      return;
    }
    send_reply(c, 0, e->val, e->vlen, NULL, 0);
    return;
  }
  case SKV_BOOT_OP_ADD: {
    k = skv__read_key(&r, &kl);
    int64_t d = (int64_t)skv__read_u64(&r);
    if (!skv__read_done(&r)) break;
    if (!key_ok(c, kl)) return;
    skv__entry_t *e = skv__table_find(&srv->tab, k, kl);
    int64_t v = 0;
    if (e && e->vlen != 8) {
      snprintf(msg, sizeof msg, "key \"%s\" holds a %u-byte value, not a counter (8 bytes)",
               show_key(k, kl, kb, sizeof kb), e->vlen);
      reply_msg(c, SKV_EINVAL, msg);
      return;
    }
    if (e) v = (int64_t)skv__get_le64(e->val);
    if (__builtin_add_overflow(v, d, &v)) {
      snprintf(msg, sizeof msg, "adding %" PRId64 " to counter \"%s\" overflows", d,
               show_key(k, kl, kb, sizeof kb));
      reply_msg(c, SKV_ERANGE, msg);
      return;
    }
    uint8_t b[8];
    skv__put_le64(b, (uint64_t)v);
    if (e) {
      memcpy(e->val, b, 8);
    } else {
      int rc = skv__table_set(&srv->tab, k, kl, b, 8, msg, sizeof msg);
      if (rc < 0) {
        reply_msg(c, rc, msg);
        return;
      }
    }
    send_reply(c, 0, b, 8, NULL, 0);
    wake_parked(srv);
    return;
  }
  case SKV_BOOT_OP_WAIT: {
    int32_t t = (int32_t)skv__read_u32(&r);
    uint32_t nk = skv__read_u32(&r);
    size_t first = r.off;
    for (uint32_t i = 0; i < nk && !r.bad; i++) {
      (void)skv__read_key(&r, &kl);
      if (!r.bad && (kl < 1 || kl > SKV_BOOT_MAX_KEY)) {
        key_ok(c, kl);
        return;
      }
    }
    if (!skv__read_done(&r)) break;
    if (!timeout_ok(c, t)) return;
    c->park_off = first;
    c->park_left = nk;
    park(c, SKV_BOOT_OP_WAIT, t, p, n);
    return;
  }
  case SKV_BOOT_OP_DEL: {
    k = skv__read_key(&r, &kl);
    if (!skv__read_done(&r)) break;
    if (!key_ok(c, kl)) return;
    skv__table_del(&srv->tab, k, kl);
    send_reply(c, 0, NULL, 0, NULL, 0);
    return;
  }
  case SKV_BOOT_OP_HELLO:
    protocol_error(c, "a second HELLO");
    return;
  case SKV_BOOT_OP_BYE:
    if (n != 1) break;
    c->said_bye = true;
    SKV_INFO(SKV_SUBSYS_BOOT, "bootstrap store: rank %d (%s) left", c->rank, c->peer);
    send_reply(c, 0, NULL, 0, NULL, 0);
    conn_close(c, true);
    return;
  default: {
    char what[64];
    snprintf(what, sizeof what, "unknown opcode %u", p[0]);
    protocol_error(c, what);
    return;
  }
  }
  char what[64];
  snprintf(what, sizeof what, "a malformed frame (opcode %u, %zu bytes)", p[0], n);
  protocol_error(c, what);
}

/* Handle every complete frame in c->in, unless a request of c is parked. */
static void process_input(conn_t *c) {
  size_t off = 0;
  while (!c->closing && !c->parked && !c->kill && c->in_len - off >= SKV_BOOT_FRAME_HDR) {
    uint32_t len = skv__get_le32(c->in + off);
    uint32_t lim = c->said_hello ? SKV_BOOT_MAX_FRAME : SKV_BOOT_PRE_HELLO_MAX_FRAME;
    if (len == 0 || len > lim) {
      char what[96];
      snprintf(what, sizeof what, "a frame of %u bytes (limit %u)", len, lim);
      protocol_error(c, what);
      return;
    }
    if (c->in_len - off - SKV_BOOT_FRAME_HDR < len) break;
    handle_frame(c, c->in + off + SKV_BOOT_FRAME_HDR, len);
    off += SKV_BOOT_FRAME_HDR + (size_t)len;
  }
  if (c->closing) return;
  if (off) {
    memmove(c->in, c->in + off, c->in_len - off);
    c->in_len -= off;
  }
  if (c->parked && c->in_len > SKV_BOOT_FRAME_HDR + (size_t)SKV_BOOT_MAX_FRAME) {
    protocol_error(c, "more requests while one was waiting");
    return;
  }
  if (c->in_len == 0 && c->in_cap > (1u << 20)) {
    free(c->in);
    c->in = NULL;
    c->in_cap = 0;
  }
}

static void drain(skv__store_server_t *srv) {
  while (srv->ready) {
    conn_t *c = srv->ready;
    LIST_DEL(srv->ready, c, rprev, rnext);
    c->ready = false;
    if (c->closing) continue;
    if (c->kill)
      conn_close(c, false);
    else
      process_input(c);
  }
}

static void on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf) {
  conn_t *c = h->data;
  size_t want = c->in_len + READ_CHUNK;
  if (want > c->in_cap) {
    size_t cap = SKV_MAX(want, c->in_cap * 2);
    uint8_t *p = realloc(c->in, cap);
    if (!p) {
      *buf = uv_buf_init(NULL, 0); /* read_cb gets UV_ENOBUFS */
      return;
    }
    c->in = p;
    c->in_cap = cap;
  }
  *buf = uv_buf_init((char *)c->in + c->in_len,
                     (unsigned)SKV_MIN(c->in_cap - c->in_len, (size_t)UINT32_MAX));
}

static void on_read(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf) {
  conn_t *c = s->data;
  skv__store_server_t *srv = c->srv;
  if (c->closing) return;
  if (nread < 0) {
    if (c->said_hello && !c->said_bye)
      SKV_WARN(SKV_SUBSYS_BOOT,
               "bootstrap store: rank %d (%s) disconnected without leaving (%s); marking it dead",
               c->rank, c->peer, nread == UV_EOF ? "end of stream" : uv_strerror((int)nread));
    else if (nread == UV_ENOBUFS)
      SKV_WARN_RL(SKV_SUBSYS_BOOT,
                  "bootstrap store: out of memory reading from %s; closing its connection",
                  c->peer);
    else
      SKV_TRACE(SKV_SUBSYS_BOOT, "bootstrap store: %s closed its connection", c->peer);
    conn_close(c, false);
    drain(srv);
    return;
  }
  if (nread == 0) return;
  c->in_len += (size_t)nread;
  process_input(c);
  drain(srv);
}

static void peer_name(uv_tcp_t *t, char *buf, size_t cap) {
  struct sockaddr_storage ss;
  int len = sizeof ss;
  char ip[INET6_ADDRSTRLEN] = "?";
  if (uv_tcp_getpeername(t, (struct sockaddr *)&ss, &len) != 0) {
    snprintf(buf, cap, "an unknown peer");
    return;
  }
  if (ss.ss_family == AF_INET6) {
    struct sockaddr_in6 *a = (struct sockaddr_in6 *)&ss;
    uv_ip6_name(a, ip, sizeof ip);
    snprintf(buf, cap, "[%s]:%d", ip, ntohs(a->sin6_port));
  } else {
    struct sockaddr_in *a = (struct sockaddr_in *)&ss;
    uv_ip4_name(a, ip, sizeof ip);
    snprintf(buf, cap, "%s:%d", ip, ntohs(a->sin_port));
  }
}

static void on_connection(uv_stream_t *server, int status) {
  skv__store_server_t *srv = server->data;
  if (status < 0) {
    SKV_WARN_RL(SKV_SUBSYS_BOOT, "bootstrap store: accepting a connection failed: %s",
                uv_strerror(status));
    return;
  }
  conn_t *c = calloc(1, sizeof *c);
  if (!c) {
    SKV_WARN_RL(SKV_SUBSYS_BOOT, "bootstrap store: out of memory for a new connection");
    return;
  }
  c->srv = srv;
  c->rank = -1;
  uv_tcp_init(&srv->loop, &c->tcp);
  c->tcp.data = c;
  LIST_ADD(srv->conns, c, prev, next);
  srv->nconns++;
  if (uv_accept(server, (uv_stream_t *)&c->tcp) != 0) {
    c->closing = true;
    uv_close((uv_handle_t *)&c->tcp, on_conn_closed);
    return;
  }
  peer_name(&c->tcp, c->peer, sizeof c->peer);
  uint64_t now = uv_now(&srv->loop);
  if (srv->npre >= srv->pre_max) {
    /* The budget of unauthenticated connections is full: the oldest goes (closing a tcp
     * handle closes its descriptor at once), never a PE that said HELLO. */
    conn_t *old = srv->pre_head;
    SKV_WARN_RL(SKV_SUBSYS_BOOT,
                "bootstrap store: %d connections have not said HELLO, the limit; closing the "
                "oldest, from %s (open for %llu ms)",
                srv->pre_max, old->peer,
                (unsigned long long)(now + SKV_BOOT_HELLO_TIMEOUT_MS - old->hello_deadline));
    conn_close(old, false);
  }
  uv_tcp_nodelay(&c->tcp, 1);
  c->hello_deadline = now + SKV_BOOT_HELLO_TIMEOUT_MS;
  pre_add(c);
  timer_want(srv, c->hello_deadline);
  int rc = uv_read_start((uv_stream_t *)&c->tcp, on_alloc, on_read);
  if (rc != 0) {
    SKV_WARN_RL(SKV_SUBSYS_BOOT, "bootstrap store: reading from %s failed: %s", c->peer,
                uv_strerror(rc));
    conn_close(c, false);
  }
  SKV_TRACE(SKV_SUBSYS_BOOT, "bootstrap store: connection from %s", c->peer);
}

/* ---- start and stop --------------------------------------------------------------------- */

static void on_async(uv_async_t *a) {
  skv__store_server_t *srv = a->data;
  pthread_mutex_lock(&srv->mu);
  bool stop = srv->stop;
  pthread_mutex_unlock(&srv->mu);
  if (!stop) return;
  srv->shutting_down = true;
  for (conn_t *c = srv->conns; c; c = c->next) {
    if (!c->closing) conn_close(c, false);
    if (!uv_is_closing((uv_handle_t *)&c->tcp)) uv_close((uv_handle_t *)&c->tcp, on_conn_closed);
  }
  uv_close((uv_handle_t *)&srv->listener, NULL);
  uv_close((uv_handle_t *)&srv->timer, NULL);
  uv_close((uv_handle_t *)&srv->async, NULL);
}

static void *server_main(void *arg) {
  skv__store_server_t *srv = arg;
  uv_run(&srv->loop, UV_RUN_DEFAULT);
  return NULL;
}

static void server_free(skv__store_server_t *srv) {
  if (srv->loop_ready) {
    /* Handles still open (start failed half-way): close them and let the loop finish. */
    if (!srv->thread_started) {
      if (!uv_is_closing((uv_handle_t *)&srv->listener))
        uv_close((uv_handle_t *)&srv->listener, NULL);
      if (!uv_is_closing((uv_handle_t *)&srv->timer)) uv_close((uv_handle_t *)&srv->timer, NULL);
      if (!uv_is_closing((uv_handle_t *)&srv->async)) uv_close((uv_handle_t *)&srv->async, NULL);
      uv_run(&srv->loop, UV_RUN_DEFAULT);
    }
    int rc = uv_loop_close(&srv->loop);
    if (rc != 0)
      SKV_WARN(SKV_SUBSYS_BOOT, "bootstrap store: closing its event loop failed: %s",
               uv_strerror(rc));
  }
  skv__table_free(&srv->tab);
  free(srv->token);
  free(srv->rank_state);
  free(srv->rank_conn);
  pthread_cond_destroy(&srv->cv);
  pthread_mutex_destroy(&srv->mu);
  free(srv);
}

/* A listening socket on the first address of bind_addr:port that works. */
static int listen_socket(const char *bind_addr, int port, int *fd_out) {
  struct addrinfo hints, *res = NULL;
  memset(&hints, 0, sizeof hints);
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  char ps[16];
  snprintf(ps, sizeof ps, "%d", port);
  int g = getaddrinfo(bind_addr, ps, &hints, &res);
  if (g != 0)
    return SKV_FAIL(
        SKV_EINVAL, SKV_SUBSYS_BOOT,
        "bootstrap store: cannot resolve bind address \"%s\": %s; set SKV_BIND_ADDR to an "
        "address of this host",
        bind_addr, gai_strerror(g));
  int err = EADDRNOTAVAIL;
  for (struct addrinfo *ai = res; ai; ai = ai->ai_next) {
    int fd = socket(ai->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
      err = errno;
      continue;
    }
    int one = 1;
    (void)setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 && listen(fd, 1024) == 0) {
      freeaddrinfo(res);
      *fd_out = fd;
      return 0;
    }
    err = errno;
    close(fd);
  }
  freeaddrinfo(res);
  return SKV_FAIL(-err, SKV_SUBSYS_BOOT, "bootstrap store: cannot listen on %s:%d: %s; %s",
                  bind_addr, port, strerror(err),
                  err == EADDRINUSE
                      ? "another process uses the port: pick another SKV_BOOTSTRAP port"
                      : "set SKV_BIND_ADDR to an address of this host");
}

int skv__store_server_start(const char *bind_addr, int port, const char *token, int nranks,
                            skv__store_server_t **out) {
  SKV_ARG_CHECK(out, SKV_SUBSYS_BOOT, "skv__store_server_start: out is NULL");
  *out = NULL;
  SKV_ARG_CHECK(port >= 0 && port <= 65535, SKV_SUBSYS_BOOT,
                "skv__store_server_start: port %d is not in 0..65535", port);
  SKV_ARG_CHECK(token && strlen(token) >= 1 && strlen(token) <= SKV_BOOT_MAX_TOKEN, SKV_SUBSYS_BOOT,
                "skv__store_server_start: the token must have 1..%u bytes", SKV_BOOT_MAX_TOKEN);
  SKV_ARG_CHECK(nranks >= 1 && nranks <= MAX_RANKS, SKV_SUBSYS_BOOT,
                "skv__store_server_start: nranks %d is not in 1..%d", nranks, MAX_RANKS);
  if (!bind_addr || !*bind_addr) bind_addr = "127.0.0.1";
  skv__store_server_t *srv = calloc(1, sizeof *srv);
  if (!srv) return SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_BOOT, "bootstrap store: out of memory");
  pthread_mutex_init(&srv->mu, NULL);
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&srv->cv, &ca);
  pthread_condattr_destroy(&ca);
  srv->nranks = nranks;
  srv->dead_rank = -1;
  /* Room for every rank to connect at once, and never more than a quarter of the descriptors
   * this process may open (a flood of strangers must leave rank 0 room for its heaps). */
  srv->pre_max = SKV_MAX(MAX_PRE_HELLO, SKV_MIN(nranks, MAX_PRE_HELLO_HI));
  struct rlimit nofile;
  if (getrlimit(RLIMIT_NOFILE, &nofile) == 0 && nofile.rlim_cur != RLIM_INFINITY)
    srv->pre_max = (int)SKV_MIN((rlim_t)srv->pre_max, SKV_MAX(nofile.rlim_cur / 4, (rlim_t)16));
  srv->timer_due = UINT64_MAX;
  srv->token_len = strlen(token);
  srv->token = malloc(srv->token_len);
  srv->rank_state = calloc((size_t)nranks, 1);
  srv->rank_conn = calloc((size_t)nranks, sizeof *srv->rank_conn);
  int rc, fd = -1;
  if (!srv->token || !srv->rank_state || !srv->rank_conn || skv__table_init(&srv->tab) != 0) {
    rc = SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_BOOT, "bootstrap store: out of memory");
    goto fail;
  }
  memcpy(srv->token, token, srv->token_len);
  SKV_CHECK_GOTO(listen_socket(bind_addr, port, &fd), rc, fail);
  rc = uv_loop_init(&srv->loop);
  if (rc != 0) {
    close(fd);
    rc = SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_BOOT, "bootstrap store: uv_loop_init failed: %s",
                  uv_strerror(rc));
    goto fail;
  }
  srv->loop_ready = true;
  uv_tcp_init(&srv->loop, &srv->listener);
  uv_timer_init(&srv->loop, &srv->timer);
  uv_async_init(&srv->loop, &srv->async, on_async);
  srv->listener.data = srv->timer.data = srv->async.data = srv;
  rc = uv_tcp_open(&srv->listener, fd);
  if (rc != 0) {
    close(fd);
    rc = SKV_FAIL(SKV_EINTERNAL, SKV_SUBSYS_BOOT, "bootstrap store: uv_tcp_open failed: %s",
                  uv_strerror(rc));
    goto fail;
  }
  rc = uv_listen((uv_stream_t *)&srv->listener, 1024, on_connection);
  if (rc != 0) {
    rc = SKV_FAIL(rc, SKV_SUBSYS_BOOT, "bootstrap store: listening on %s:%d failed: %s", bind_addr,
                  port, uv_strerror(rc));
    goto fail;
  }
  struct sockaddr_storage ss;
  int slen = sizeof ss;
  uv_tcp_getsockname(&srv->listener, (struct sockaddr *)&ss, &slen);
  srv->port = ss.ss_family == AF_INET6 ? ntohs(((struct sockaddr_in6 *)&ss)->sin6_port)
                                       : ntohs(((struct sockaddr_in *)&ss)->sin_port);
  /* The server thread takes no signals (SIGPIPE from a write to a dead peer included: with it
   * blocked, the write fails with EPIPE instead of killing the process). */
  int prc = skv__thread_start(&srv->thread, server_main, srv);
  if (prc != 0) {
    rc = SKV_FAIL(-prc, SKV_SUBSYS_BOOT, "bootstrap store: cannot start its thread: %s",
                  strerror(prc));
    goto fail;
  }
  srv->thread_started = true;
  SKV_INFO(SKV_SUBSYS_BOOT, "bootstrap store: serving %d ranks on %s port %d", nranks, bind_addr,
           srv->port);
  *out = srv;
  return 0;
fail:
  server_free(srv);
  return rc;
}

int skv__store_server_port(const skv__store_server_t *srv) {
  SKV_ARG_CHECK(srv, SKV_SUBSYS_BOOT, "skv__store_server_port: server is NULL");
  return srv->port;
}

static int server_stop(skv__store_server_t *srv, int timeout_ms, bool quiet) {
  if (!srv) return 0;
  if (timeout_ms < 0) timeout_ms = 0;
  const struct timespec ts = skv__ts_at(skv__now_ns() + (uint64_t)timeout_ms * 1000000u);
  char live[256] = "";
  pthread_mutex_lock(&srv->mu);
  while (srv->nlive > 0) {
    if (pthread_cond_timedwait(&srv->cv, &srv->mu, &ts) == ETIMEDOUT) break;
  }
  int nlive = srv->nlive;
  if (nlive > 0) {
    size_t o = 0;
    int shown = 0;
    for (int r = 0; r < srv->nranks && o + 24 < sizeof live; r++)
      if (srv->rank_state[r] == RANK_LIVE && shown++ < 16)
        o += (size_t)snprintf(live + o, sizeof live - o, "%s%d", o ? ", " : "", r);
  }
  srv->stop = true;
  pthread_mutex_unlock(&srv->mu);
  uv_async_send(&srv->async);
  pthread_join(srv->thread, NULL);
  server_free(srv);
  if (nlive > 0 && quiet) {
    SKV_WARN(SKV_SUBSYS_BOOT,
             "bootstrap store stopped after %d ms with %d rank(s) still connected (%s); their "
             "connections were closed",
             timeout_ms, nlive, live);
    return SKV_ETIMEDOUT;
  }
  if (nlive > 0)
    return SKV_FAIL(
        SKV_ETIMEDOUT, SKV_SUBSYS_BOOT,
        "bootstrap store stopped after %d ms with %d rank(s) still connected (%s): they never "
        "left (skv_finalize); their connections were closed",
        timeout_ms, nlive, live);
  SKV_INFO(SKV_SUBSYS_BOOT, "bootstrap store stopped");
  return 0;
}

int skv__store_server_stop(skv__store_server_t *srv, int timeout_ms) {
  return server_stop(srv, timeout_ms, false);
}

int skv__store_server_stop_quiet(skv__store_server_t *srv, int timeout_ms) {
  return server_stop(srv, timeout_ms, true);
}
