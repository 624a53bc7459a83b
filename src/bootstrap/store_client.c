/* The bootstrap store client: a blocking TCP connection to rank 0's store, one request at a
 * time, every wait bounded; set/get/add/wait plus the barrier and allgather built on them. */
#define _GNU_SOURCE
#include "bootstrap/proto.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define GRACE_MS      2000 /* a reply may come this long after the request's own timeout */
#define CLOSE_WAIT_MS 5000 /* bound on the BYE round trip */
#define RETRY_MS      20   /* connect retry period while rank 0 starts */

struct skv__store {
  pthread_mutex_t mu;
  int fd;
  bool broken;
  bool quiet; /* closing after another failure: log failures, keep the thread's last error */
  int rank, nranks, timeout_ms;
  char peer[300];
  char why[300]; /* why the connection is broken */
};

/* ---- bounded socket I/O ----------------------------------------------------------------- */

static int send_all(int fd, const uint8_t *p, size_t n, uint64_t deadline) {
  while (n > 0) {
    ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
    if (w > 0) {
      p += w;
      n -= (size_t)w;
      continue;
    }
    if (w < 0 && errno == EINTR) continue;
    if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      int rc = skv__wait_fd(fd, POLLOUT, deadline);
      if (rc < 0) return rc;
      continue;
    }
    return w < 0 ? -errno : SKV_ECONN;
  }
  return 0;
}

/* 0, SKV_ECONN (closed by the store), SKV_ETIMEDOUT or -errno. */
static int recv_all(int fd, uint8_t *p, size_t n, uint64_t deadline) {
  while (n > 0) {
    ssize_t r = recv(fd, p, n, 0);
    if (r > 0) {
      p += r;
      n -= (size_t)r;
      continue;
    }
    if (r == 0) return SKV_ECONN;
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      int rc = skv__wait_fd(fd, POLLIN, deadline);
      if (rc < 0) return rc;
      continue;
    }
    return -errno;
  }
  return 0;
}

/* ---- one request ------------------------------------------------------------------------ */

/* Mark the connection unusable and fail with `err`. Called with st->mu held. */
static int broken(skv__store_t *st, int err, const char *what, const char *fmt, ...)
    SKV_PRINTF(4, 5);
static int broken(skv__store_t *st, int err, const char *what, const char *fmt, ...) {
  char msg[300];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  st->broken = true;
  snprintf(st->why, sizeof st->why, "%s", msg);
  if (st->quiet) {
    SKV_WARN(SKV_SUBSYS_BOOT, "%s: %s (%s)", what, msg, skv_err_name(err));
    return err;
  }
  return SKV_FAIL(err, SKV_SUBSYS_BOOT, "%s: %s", what, msg);
}

static int io_error(skv__store_t *st, int rc, const char *what, int wait_ms, bool sending) {
  if (rc == SKV_ETIMEDOUT)
    return broken(st, SKV_ETIMEDOUT, what,
                  "no reply from the bootstrap store at %s within %d ms; is rank 0 stopped or "
                  "overloaded? (this connection is now unusable)",
                  st->peer, wait_ms + GRACE_MS);
  if (rc == SKV_ECONN)
    return broken(st, SKV_ECONN, what,
                  "the bootstrap store at %s closed the connection; rank 0 probably exited",
                  st->peer);
  return broken(st, SKV_ECONN, what,
                "%s the bootstrap store at %s failed: %s; rank 0 probably exited",
                sending ? "sending to" : "receiving from", st->peer, strerror(-rc));
}

/* Send the frame in `b` (its length filled in here) and read the reply: *status and a malloc'ed
 * payload (NUL appended). Transport failures break the connection and are returned; the caller
 * maps *status. */
static int rpc(skv__store_t *st, const char *what, skv__frame_t *b, int wait_ms, int32_t *status,
               uint8_t **payload, size_t *plen) {
  *payload = NULL;
  *plen = 0;
  if (b->failed)
    return SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_BOOT, "%s: out of memory for the request", what);
  if (st->broken)
    return SKV_FAIL(
        SKV_ECONN, SKV_SUBSYS_BOOT,
        "%s: the connection to the bootstrap store was lost earlier (%s); the job must be "
        "restarted",
        what, st->why);
  skv__frame_end(b);
  uint64_t deadline = skv__now_ms() + (uint64_t)wait_ms + GRACE_MS;
  int rc = send_all(st->fd, b->p, b->len, deadline);
  if (rc < 0) return io_error(st, rc, what, wait_ms, true);
  uint8_t hdr[SKV_BOOT_REPLY_HDR];
  rc = recv_all(st->fd, hdr, sizeof hdr, deadline);
  if (rc < 0) return io_error(st, rc, what, wait_ms, false);
  uint32_t rlen;
  int32_t s;
  skv__reply_hdr_get(hdr, &rlen, &s);
  if (rlen < 4 || rlen > SKV_BOOT_MAX_FRAME || s > 0 ||
      (s < 0 && (s < SKV_EINTERNAL || s > SKV_EINVAL)))
    return broken(st, SKV_EPROTO, what,
                  "malformed reply from the bootstrap store at %s (length %u, status %d); "
                  "is SKV_BOOTSTRAP pointing at a symkv store?",
                  st->peer, rlen, (int)s);
  size_t n = rlen - 4;
  uint8_t *p = malloc(n + 1);
  if (!p) return broken(st, SKV_ENOMEM, what, "out of memory for a %zu-byte reply", n);
  rc = recv_all(st->fd, p, n, deadline);
  if (rc < 0) {
    free(p);
    return io_error(st, rc, what, wait_ms, false);
  }
  p[n] = '\0';
  *status = s;
  *payload = p;
  *plen = n;
  return 0;
}

static const char *advice(int status) {
  switch (status) {
  case SKV_ETIMEDOUT:
    return "; check that every PE reaches this point, or raise SKV_TIMEOUT_MS if they are just "
           "slow";
  case SKV_EPEERDEAD:
    return "; the job cannot continue: look at that PE's log for why it exited, then restart the "
           "job";
  case SKV_ENOSPC:
    return "; delete keys that are no longer needed";
  default:
    return "";
  }
}

/* Turn an error status from the store into a return code with its message. */
static int status_error(const char *what, int32_t status, const uint8_t *msg, size_t n) {
  return SKV_FAIL(status, SKV_SUBSYS_BOOT, "%s: %.*s%s", what, (int)SKV_MIN(n, (size_t)400),
                  (const char *)msg, advice(status));
}

/* A request that returns no data (or data the caller ignores). */
static int call(skv__store_t *st, const char *what, skv__frame_t *b, int wait_ms, uint8_t **out,
                size_t *outlen) {
  int32_t status = 0;
  uint8_t *p = NULL;
  size_t n = 0;
  pthread_mutex_lock(&st->mu);
  int rc = rpc(st, what, b, wait_ms, &status, &p, &n);
  pthread_mutex_unlock(&st->mu);
  skv__frame_free(b);
  if (rc < 0) return rc;
  if (status < 0) {
    rc = status_error(what, status, p, n);
    free(p);
    return rc;
  }
  if (out) {
    *out = p;
    *outlen = n;
  } else {
    free(p);
  }
  return 0;
}

static int check_key(const char *what, const char *key) {
  if (!key) return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_BOOT, "%s: key is NULL", what);
  size_t n = strlen(key);
  if (n == 0 || n > SKV_BOOT_MAX_KEY)
    return SKV_FAIL(
        SKV_EINVAL, SKV_SUBSYS_BOOT,
        "%s: key of %zu bytes is not in 1..%d bytes (SKV_STORE_MAX_KEY); use a shorter key", what,
        n, SKV_BOOT_MAX_KEY);
  return 0;
}

static int check_timeout(const char *what, int timeout_ms) {
  if (timeout_ms < 0)
    return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_BOOT, "%s: timeout of %d ms is negative", what,
                    timeout_ms);
  return 0;
}

#define STORE_CHECK(st, what)                                                           \
  do {                                                                                  \
    if (!(st)) return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_BOOT, "%s: store is NULL", what); \
  } while (0)

/* "fn(\"key\")" for messages. */
static const char *describe(char *buf, size_t cap, const char *fn, const char *key) {
  if (key)
    snprintf(buf, cap, "%s(\"%.*s%s\")", fn, 80, key, strlen(key) > 80 ? "..." : "");
  else
    snprintf(buf, cap, "%s", fn);
  return buf;
}

/* ---- connect and close ------------------------------------------------------------------ */

/* One TCP connection attempt to every address of host:port; the connected fd or -errno. */
static int try_connect(const char *host, int port, uint64_t deadline, int *gai_err) {
  struct addrinfo hints, *res = NULL;
  memset(&hints, 0, sizeof hints);
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  char ps[16];
  snprintf(ps, sizeof ps, "%d", port);
  *gai_err = getaddrinfo(host, ps, &hints, &res);
  if (*gai_err != 0) return -EHOSTUNREACH;
  int err = ECONNREFUSED;
  for (struct addrinfo *ai = res; ai; ai = ai->ai_next) {
    int fd = socket(ai->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) {
      err = errno;
      continue;
    }
    int rc = connect(fd, ai->ai_addr, ai->ai_addrlen);
    if (rc != 0 && errno == EINPROGRESS) {
      /* at most 1 s per address, so that an unreachable one does not use up the timeout */
      rc = skv__wait_fd(fd, POLLOUT, SKV_MIN(deadline, skv__now_ms() + 1000));
      if (rc == 0) {
        int soerr = 0;
        socklen_t sl = sizeof soerr;
        getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &sl);
        rc = soerr ? -1 : 0;
        errno = soerr;
      } else {
        errno = rc == SKV_ETIMEDOUT ? ETIMEDOUT : -rc;
        rc = -1;
      }
    }
    if (rc == 0) {
      freeaddrinfo(res);
      return fd;
    }
    err = errno;
    close(fd);
  }
  freeaddrinfo(res);
  return -err;
}

int skv__store_connect(const char *host, int port, const char *token, int rank, int nranks,
                       int timeout_ms, skv__store_t **out) {
  SKV_ARG_CHECK(out, SKV_SUBSYS_BOOT, "skv__store_connect: out is NULL");
  *out = NULL;
  SKV_ARG_CHECK(host && *host, SKV_SUBSYS_BOOT, "skv__store_connect: host is empty");
  SKV_ARG_CHECK(port > 0 && port <= 65535, SKV_SUBSYS_BOOT,
                "skv__store_connect: port %d is not in 1..65535", port);
  SKV_ARG_CHECK(token && *token && strlen(token) <= SKV_BOOT_MAX_TOKEN, SKV_SUBSYS_BOOT,
                "skv__store_connect: the token must have 1..%u bytes (set SKV_TOKEN)",
                SKV_BOOT_MAX_TOKEN);
  SKV_ARG_CHECK(nranks >= 1 && rank >= 0 && rank < nranks, SKV_SUBSYS_BOOT,
                "skv__store_connect: rank %d is not in [0, %d)", rank, nranks);
  SKV_ARG_CHECK(timeout_ms >= 0, SKV_SUBSYS_BOOT,
                "skv__store_connect: timeout of %d ms is negative", timeout_ms);
  skv__store_t *st = calloc(1, sizeof *st);
  if (!st) return SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_BOOT, "skv__store_connect: out of memory");
  pthread_mutex_init(&st->mu, NULL);
  st->fd = -1;
  st->rank = rank;
  st->nranks = nranks;
  st->timeout_ms = timeout_ms;
  snprintf(st->peer, sizeof st->peer, strchr(host, ':') ? "[%.256s]:%d" : "%.256s:%d", host, port);
  char what[400];
  snprintf(what, sizeof what, "skv__store_connect(%s, rank %d of %d)", st->peer, rank, nranks);
  uint64_t start = skv__now_ms(), deadline = start + (uint64_t)timeout_ms;
  int fd = -1, gai = 0, rc, shed = 0;
  int32_t status = 0;
  uint8_t *p = NULL;
  size_t n = 0;
  for (;;) {
    for (;;) {
      fd = try_connect(host, port, deadline, &gai);
      if (fd >= 0) break;
      if (gai != 0 && gai != EAI_AGAIN) {
        rc = SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_BOOT,
                      "%s: cannot resolve \"%s\": %s; check SKV_BOOTSTRAP", what, host,
                      gai_strerror(gai));
        goto fail;
      }
      if (skv__now_ms() + RETRY_MS > deadline) {
        int e = -fd;
        rc = SKV_FAIL(
            e == ECONNREFUSED ? SKV_ECONN : SKV_ETIMEDOUT, SKV_SUBSYS_BOOT,
            "%s: could not connect within %d ms (last error: %s); is rank 0 running, and does "
            "SKV_BOOTSTRAP name its address?",
            what, timeout_ms, gai ? gai_strerror(gai) : strerror(e));
        goto fail;
      }
      struct timespec ts = {0, RETRY_MS * 1000000L};
      nanosleep(&ts, NULL);
    }
    st->fd = fd;
    int one = 1;
    (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    skv__frame_t b = {0};
    skv__frame_hello(&b, token, rank, nranks);
    int left = skv__ms_left(deadline);
    rc = rpc(st, what, &b, left, &status, &p, &n);
    skv__frame_free(&b);
    /* Closed before the HELLO reply: the store sheds connections that have not said HELLO
     * when too many strangers hold connections open (docs/bootstrap.md, "Limits"), so this PE
     * connects again while time is left; if rank 0 exited, connecting fails soon. */
    if (rc == SKV_ECONN && skv__now_ms() + RETRY_MS < deadline) {
      shed++;
      close(fd);
      st->fd = fd = -1;
      st->broken = false;
      struct timespec ts = {0, RETRY_MS * 1000000L};
      nanosleep(&ts, NULL);
      continue;
    }
    break;
  }
  if (rc < 0) goto fail;
  if (shed)
    SKV_INFO(SKV_SUBSYS_BOOT,
             "%s: the store closed %d connection(s) before HELLO (it sheds unauthenticated "
             "connections when many are open); connected on attempt %d",
             what, shed, shed + 1);
  if (status == SKV_EAUTH) {
    rc = SKV_FAIL(SKV_EAUTH, SKV_SUBSYS_BOOT,
                  "%s: the bootstrap store rejected this PE's token; every PE must use the same "
                  "SKV_TOKEN (symkv-run sets it)",
                  what);
  } else if (status < 0) {
    rc = SKV_FAIL(status, SKV_SUBSYS_BOOT, "%s: the bootstrap store refused this PE: %.*s", what,
                  (int)SKV_MIN(n, (size_t)400), (const char *)p);
  } else if (n != 4 || skv__get_le32(p) != SKV_BOOT_PROTO_VERSION) {
    rc = SKV_FAIL(SKV_EPROTO, SKV_SUBSYS_BOOT, "%s: unexpected HELLO reply from the store", what);
  }
  free(p);
  if (rc < 0) goto fail;
  SKV_INFO(SKV_SUBSYS_BOOT, "rank %d connected to the bootstrap store at %s in %" PRIu64 " ms",
           rank, st->peer, skv__now_ms() - start);
  *out = st;
  return 0;
fail:
  if (st->fd >= 0)
    close(st->fd);
  else if (fd >= 0)
    close(fd);
  pthread_mutex_destroy(&st->mu);
  free(st);
  return rc;
}

static void store_free(skv__store_t *st) {
  if (st->fd >= 0) close(st->fd);
  pthread_mutex_destroy(&st->mu);
  free(st);
}

static int store_close(skv__store_t *st, bool quiet) {
  if (!st) return 0;
  int rc = 0;
  pthread_mutex_lock(&st->mu);
  st->quiet = quiet;
  if (!st->broken) {
    skv__frame_t b = {0};
    skv__frame_begin(&b, SKV_BOOT_OP_BYE);
    int32_t status = 0;
    uint8_t *p = NULL;
    size_t n = 0;
    if (b.failed && quiet)
      rc = SKV_ENOMEM;
    else
      rc = rpc(st, "skv__store_close", &b, CLOSE_WAIT_MS - GRACE_MS, &status, &p, &n);
    skv__frame_free(&b);
    if (rc == 0 && status < 0) {
      if (quiet) {
        SKV_WARN(SKV_SUBSYS_BOOT, "skv__store_close: %.*s (%s)", (int)SKV_MIN(n, (size_t)400),
                 (const char *)p, skv_err_name(status));
        rc = status;
      } else {
        rc = status_error("skv__store_close", status, p, n);
      }
    }
    free(p);
  }
  pthread_mutex_unlock(&st->mu);
  store_free(st);
  return rc;
}

int skv__store_close(skv__store_t *st) {
  return store_close(st, false);
}

int skv__store_close_quiet(skv__store_t *st) {
  return store_close(st, true);
}

void skv__store_abort(skv__store_t *st) {
  if (!st) return;
  store_free(st);
}

void skv__store_allgather_key(const skv__store_t *st, const char *name, char *buf, size_t cap) {
  snprintf(buf, cap, "%s/%d", name, st->rank);
}

int skv__store_allgather_put(skv__store_t *st, const char *name, const void *in, size_t bytes) {
  char key[SKV_BOOT_MAX_KEY + 16];
  skv__store_allgather_key(st, name, key, sizeof key);
  return skv__store_set(st, key, in, bytes);
}

void skv__store_put_failure(skv__store_t *st, const char *key, int rc) {
  skv__step_result_t r;
  memset(&r, 0, sizeof r);
  r.rc = rc;
  char saved[1024];
  snprintf(saved, sizeof saved, "%s", skv_last_error());
  memcpy(r.msg, saved, SKV_MIN(strlen(saved), sizeof r.msg - 1)); /* cut to what a record holds */
  (void)skv__store_set(st, key, &r, sizeof r);
  skv__error_restore(saved);
}

const char *skv__step_msg(skv__step_result_t *r) {
  r->msg[sizeof r->msg - 1] = '\0';
  return r->msg[0] ? r->msg : skv_err_name(r->rc);
}

int skv__store_rank(const skv__store_t *st) {
  STORE_CHECK(st, "skv__store_rank");
  return st->rank;
}

int skv__store_nranks(const skv__store_t *st) {
  STORE_CHECK(st, "skv__store_nranks");
  return st->nranks;
}

/* ---- operations ------------------------------------------------------------------------- */

static int do_set(skv__store_t *st, const char *what, const char *key, const void *val, size_t len,
                  int wait_ms) {
  SKV_CHECK(check_key(what, key));
  if (len > SKV_BOOT_MAX_VALUE)
    return SKV_FAIL(
        SKV_EINVAL, SKV_SUBSYS_BOOT,
        "%s: value of %zu bytes is over the %u-byte limit (SKV_STORE_MAX_VALUE); split it "
        "over several keys",
        what, len, SKV_BOOT_MAX_VALUE);
  if (!val && len) return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_BOOT, "%s: value is NULL", what);
  skv__frame_t b = {0};
  skv__frame_begin(&b, SKV_BOOT_OP_SET);
  skv__frame_key(&b, key);
  skv__frame_u32(&b, (uint32_t)len);
  skv__frame_put(&b, val, len);
  return call(st, what, &b, wait_ms, NULL, NULL);
}

int skv__store_set(skv__store_t *st, const char *key, const void *val, size_t len) {
  char what[128];
  STORE_CHECK(st, "skv__store_set");
  return do_set(st, describe(what, sizeof what, "skv__store_set", key), key, val, len,
                st->timeout_ms);
}

static int do_get(skv__store_t *st, const char *what, const char *key, void **val, size_t *len,
                  int timeout_ms) {
  SKV_CHECK(check_key(what, key));
  SKV_CHECK(check_timeout(what, timeout_ms));
  if (!val || !len) return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_BOOT, "%s: val or len is NULL", what);
  *val = NULL;
  *len = 0;
  skv__frame_t b = {0};
  skv__frame_begin(&b, SKV_BOOT_OP_GET);
  skv__frame_u32(&b, (uint32_t)timeout_ms);
  skv__frame_key(&b, key);
  uint8_t *p = NULL;
  size_t n = 0;
  SKV_CHECK(call(st, what, &b, timeout_ms, &p, &n));
  *val = p;
  *len = n;
  return 0;
}

int skv__store_get(skv__store_t *st, const char *key, void **val, size_t *len, int timeout_ms) {
  char what[128];
  STORE_CHECK(st, "skv__store_get");
  return do_get(st, describe(what, sizeof what, "skv__store_get", key), key, val, len, timeout_ms);
}

int skv__store_try_get(skv__store_t *st, const char *key, void **val, size_t *len) {
  char what[128];
  STORE_CHECK(st, "skv__store_try_get");
  describe(what, sizeof what, "skv__store_try_get", key);
  SKV_CHECK(check_key(what, key));
  if (!val || !len) return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_BOOT, "%s: val or len is NULL", what);
  *val = NULL;
  *len = 0;
  skv__frame_t b = {0};
  skv__frame_begin(&b, SKV_BOOT_OP_TRY_GET);
  skv__frame_key(&b, key);
  uint8_t *p = NULL;
  size_t n = 0;
  int32_t status = 0;
  pthread_mutex_lock(&st->mu);
  int rc = rpc(st, what, &b, st->timeout_ms, &status, &p, &n);
  pthread_mutex_unlock(&st->mu);
  skv__frame_free(&b);
  if (rc < 0) return rc;
  if (status == SKV_ENOTFOUND) { /* an expected answer: no warning in the log */
    free(p);
    return SKV_ENOTFOUND;
  }
  if (status < 0) {
    rc = status_error(what, status, p, n);
    free(p);
    return rc;
  }
  *val = p;
  *len = n;
  return 0;
}

static int do_add(skv__store_t *st, const char *what, const char *key, int64_t delta,
                  int64_t *result, int wait_ms) {
  SKV_CHECK(check_key(what, key));
  skv__frame_t b = {0};
  skv__frame_begin(&b, SKV_BOOT_OP_ADD);
  skv__frame_key(&b, key);
  skv__frame_u64(&b, (uint64_t)delta);
  uint8_t *p = NULL;
  size_t n = 0;
  SKV_CHECK(call(st, what, &b, wait_ms, &p, &n));
  int rc = 0;
  if (n != 8) {
    pthread_mutex_lock(&st->mu);
    rc = broken(st, SKV_EPROTO, what, "ADD reply of %zu bytes instead of 8", n);
    pthread_mutex_unlock(&st->mu);
  } else if (result) {
    *result = (int64_t)skv__get_le64(p);
  }
  free(p);
  return rc;
}

int skv__store_add(skv__store_t *st, const char *key, int64_t delta, int64_t *result) {
  char what[128];
  STORE_CHECK(st, "skv__store_add");
  return do_add(st, describe(what, sizeof what, "skv__store_add", key), key, delta, result,
                st->timeout_ms);
}

int skv__store_wait(skv__store_t *st, const char *const *keys, size_t n, int timeout_ms) {
  char what[128];
  STORE_CHECK(st, "skv__store_wait");
  describe(what, sizeof what, "skv__store_wait", n && keys ? keys[0] : NULL);
  SKV_CHECK(check_timeout(what, timeout_ms));
  if (n == 0) return 0;
  if (!keys) return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_BOOT, "%s: keys is NULL", what);
  if (n > UINT32_MAX)
    return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_BOOT, "%s: %zu keys are too many", what, n);
  size_t bytes = 1 + 4 + 4;
  for (size_t i = 0; i < n; i++) {
    SKV_CHECK(check_key(what, keys[i]));
    bytes += 2 + strlen(keys[i]);
  }
  if (bytes > SKV_BOOT_MAX_FRAME)
    return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_BOOT,
                    "%s: %zu keys (%zu bytes) do not fit in one request; wait for "
                    "fewer keys at a time",
                    what, n, bytes);
  skv__frame_t b = {0};
  skv__frame_begin(&b, SKV_BOOT_OP_WAIT);
  skv__frame_u32(&b, (uint32_t)timeout_ms);
  skv__frame_u32(&b, (uint32_t)n);
  for (size_t i = 0; i < n; i++) skv__frame_key(&b, keys[i]);
  return call(st, what, &b, timeout_ms, NULL, NULL);
}

static int do_wait_ge(skv__store_t *st, const char *what, const char *key, int64_t target,
                      int timeout_ms) {
  SKV_CHECK(check_key(what, key));
  SKV_CHECK(check_timeout(what, timeout_ms));
  skv__frame_t b = {0};
  skv__frame_begin(&b, SKV_BOOT_OP_WAIT_GE);
  skv__frame_u32(&b, (uint32_t)timeout_ms);
  skv__frame_key(&b, key);
  skv__frame_u64(&b, (uint64_t)target);
  return call(st, what, &b, timeout_ms, NULL, NULL);
}

int skv__store_wait_ge(skv__store_t *st, const char *key, int64_t target, int timeout_ms) {
  char what[128];
  STORE_CHECK(st, "skv__store_wait_ge");
  return do_wait_ge(st, describe(what, sizeof what, "skv__store_wait_ge", key), key, target,
                    timeout_ms);
}

int skv__store_check_dead(skv__store_t *st, const char *key) {
  char what[128];
  STORE_CHECK(st, "skv__store_check_dead");
  describe(what, sizeof what, "skv__store_check_dead", key);
  SKV_CHECK(check_key(what, key));
  /* A WAIT_GE that cannot be met, checked once: the store answers SKV_EPEERDEAD once a rank
   * died, else SKV_ETIMEDOUT, which here means "all alive" (no warning in the log). */
  skv__frame_t b = {0};
  skv__frame_begin(&b, SKV_BOOT_OP_WAIT_GE);
  skv__frame_u32(&b, 0);
  skv__frame_key(&b, key);
  skv__frame_u64(&b, (uint64_t)INT64_MAX);
  uint8_t *p = NULL;
  size_t n = 0;
  int32_t status = 0;
  pthread_mutex_lock(&st->mu);
  int rc = rpc(st, what, &b, 0, &status, &p, &n);
  pthread_mutex_unlock(&st->mu);
  skv__frame_free(&b);
  if (rc == 0 && status < 0 && status != SKV_ETIMEDOUT) rc = status_error(what, status, p, n);
  free(p);
  return rc;
}

int skv__store_del(skv__store_t *st, const char *key) {
  char what[128];
  STORE_CHECK(st, "skv__store_del");
  describe(what, sizeof what, "skv__store_del", key);
  SKV_CHECK(check_key(what, key));
  skv__frame_t b = {0};
  skv__frame_begin(&b, SKV_BOOT_OP_DEL);
  skv__frame_key(&b, key);
  return call(st, what, &b, st->timeout_ms, NULL, NULL);
}

/* ---- collectives ------------------------------------------------------------------------ */

int skv__store_barrier(skv__store_t *st, const char *name, int timeout_ms) {
  char what[128];
  STORE_CHECK(st, "skv__store_barrier");
  describe(what, sizeof what, "skv__store_barrier", name);
  SKV_CHECK(check_key(what, name));
  SKV_CHECK(check_timeout(what, timeout_ms));
  uint64_t deadline = skv__now_ms() + (uint64_t)timeout_ms;
  int64_t arrived = 0;
  SKV_CHECK(do_add(st, what, name, 1, &arrived, timeout_ms));
  if (arrived > st->nranks)
    return SKV_FAIL(SKV_EMISMATCH, SKV_SUBSYS_BOOT,
                    "%s: %" PRId64
                    " arrivals for %d ranks: the barrier name was used twice; give each "
                    "barrier a unique name",
                    what, arrived, st->nranks);
  return do_wait_ge(st, what, name, st->nranks, skv__ms_left(deadline));
}

int skv__store_allgather(skv__store_t *st, const char *name, const void *in, void *out,
                         size_t bytes, int timeout_ms) {
  char what[128], key[SKV_BOOT_MAX_KEY + 16];
  STORE_CHECK(st, "skv__store_allgather");
  describe(what, sizeof what, "skv__store_allgather", name);
  SKV_CHECK(check_key(what, name));
  SKV_CHECK(check_timeout(what, timeout_ms));
  if (!in || !out || bytes == 0 || bytes > SKV_BOOT_MAX_VALUE)
    return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_BOOT,
                    "%s: need non-NULL in/out and 1..%u bytes (got %zu)", what, SKV_BOOT_MAX_VALUE,
                    bytes);
  if (strlen(name) + 12 > SKV_BOOT_MAX_KEY)
    return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_BOOT,
                    "%s: name too long for \"<name>/<rank>\" keys (limit %d bytes)", what,
                    SKV_BOOT_MAX_KEY - 12);
  uint64_t deadline = skv__now_ms() + (uint64_t)timeout_ms;
  skv__store_allgather_key(st, name, key, sizeof key);
  SKV_CHECK(do_set(st, what, key, in, bytes, timeout_ms));
  for (int r = 0; r < st->nranks; r++) {
    uint8_t *dst = (uint8_t *)out + (size_t)r * bytes;
    if (r == st->rank) {
      memmove(dst, in, bytes);
      continue;
    }
    snprintf(key, sizeof key, "%s/%d", name, r);
    void *v = NULL;
    size_t n = 0;
    int rc = do_get(st, what, key, &v, &n, skv__ms_left(deadline));
    if (rc < 0) {
      char inner[800];
      snprintf(inner, sizeof inner, "%s", skv_last_error());
      if (rc == SKV_ETIMEDOUT)
        return SKV_FAIL(rc, SKV_SUBSYS_BOOT,
                        "%s: rank %d never contributed (key \"%s\") within %d ms: %s", what, r, key,
                        timeout_ms, inner);
      return SKV_FAIL(rc, SKV_SUBSYS_BOOT, "%s: waiting for rank %d's contribution: %s", what, r,
                      inner);
    }
    if (n != bytes) {
      free(v);
      return SKV_FAIL(
          SKV_EMISMATCH, SKV_SUBSYS_BOOT,
          "%s: rank %d contributed %zu bytes but this PE (rank %d) %zu; every PE must pass "
          "the same size",
          what, r, n, st->rank, bytes);
    }
    memcpy(dst, v, bytes);
    free(v);
  }
  return 0;
}
