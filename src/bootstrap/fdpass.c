/* File-descriptor exchange between the PEs of one node: abstract unix sockets with random names
 * shared through the store, SCM_RIGHTS, same-user checks both ways and a nonce on every fd. */
#define _GNU_SOURCE
#include "bootstrap/bootstrap.h"
#include "core/bytes.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

/* How it works
 *
 * Local PE 0 publishes, under "<tag>/nonce/<rank of local PE 0>" (the rank makes the key
 * unique per node), a random 128-bit nonce followed by one random 128-bit name per local PE.
 * Every PE listens on the abstract socket "\0symkv/<its name, hex>", then the node's PEs meet
 * at a counter barrier ("<tag>/ready/<rank of local PE 0>"). Each PE then connects to every
 * peer, checks that the listener runs as this user (SO_PEERCRED), and sends one header {magic,
 * version, nonce, local index, rank} with its fd attached (SCM_RIGHTS), and finally accepts
 * nlocal-1 connections. connect() to a listening unix socket completes before accept(), so
 * sending to everyone first cannot deadlock (the backlog holds nlocal).
 *
 * What can go wrong: abstract sockets have no permission check, and anyone on the host sees
 * the names of bound sockets (/proc/net/unix). Nobody can bind a name first, though: each is
 * random and known only through the store, which needs the job's token (names derived from
 * something visible plus an index were squatted: a PE could not listen, and a peer would have
 * sent its fd to the squatter). Anyone can connect to a bound name: a connection from another
 * user (SO_PEERCRED), without the nonce, with other than one fd, or that sends no header within
 * FD_CONN_WAIT_MS is logged and dropped, and the exchange goes on. A PE that fails (out of
 * descriptors, say), before or after the barrier, stores its error under "<tag>/failed/<rank>"
 * and adds FD_FAILED to the barrier's counter before it stops listening: its peers fail with its
 * code and message at once. A peer that dies after the barrier no longer listens (connect:
 * ECONNREFUSED): the others skip it, send to the rest, and fail with SKV_EPEERDEAD once the
 * store confirms the death (a peer that stopped listening while the store says every rank
 * lives gives SKV_ECONN, never SKV_EPEERDEAD); a PE waiting for descriptors asks the store
 * every FD_PROBE_MS whether a rank died or a peer failed. A peer that stops (SIGSTOP) makes the
 * others time out. Every descriptor is closed on every error path. */

#define FD_MAGIC   0x464b5653u /* "SVKF" */
#define FD_VERSION 1u

#define FD_PROBE_MS 50 /* while waiting on peers, ask the store this often for dead ranks */
#define FD_GONE_WAIT_MS                                                                        \
  1000                       /* a peer that stopped listening: wait this long for the store to \
                                say it died (its store connection may close a moment later) */
#define FD_CONN_WAIT_MS 2000 /* an accepted connection must deliver its header within this */

typedef struct fd_hdr {
  uint32_t magic;
  uint32_t version;
  uint8_t nonce[16];
  int32_t local_index;
  int32_t rank;
} fd_hdr_t;

/* Fail with `rc`, the context given, and the store's answer (the last error) after it. */
static int SKV_PRINTF(2, 3) fail_after_probe(int rc, const char *fmt, ...) {
  char ctx[300], inner[800];
  snprintf(inner, sizeof inner, "%s", skv_last_error());
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(ctx, sizeof ctx, fmt, ap);
  va_end(ap);
  return SKV_FAIL(rc, SKV_SUBSYS_BOOT, "%s: %s", ctx, inner);
}

/* A PE that fails (socket, bind, listen, accept: out of descriptors...) would leave the others
 * waiting at the ready barrier, or for its descriptor, until the timeout. It stores its error
 * under "<tag>/failed/<its rank>" and adds FD_FAILED to the barrier's counter: the others get past
 * the barrier at once, or see the counter while they wait, and fail with its code and message. */
#define FD_FAILED (1ll << 40)

static void announce_failure(skv__store_t *st, const char *tag, const char *ready_key, int rank,
                             int rc) {
  char key[SKV_BOOT_MAX_KEY + 1];
  snprintf(key, sizeof key, "%s/failed/%d", tag, rank);
  skv__store_put_failure(st, key, rc);
  (void)skv__store_add(st, ready_key, FD_FAILED, NULL);
}

/* The barrier's counter says a local PE failed: its code and message. */
static int peer_failed(skv__store_t *st, const char *tag, const int *ranks, int nlocal) {
  for (int i = 0; i < nlocal; i++) {
    char key[SKV_BOOT_MAX_KEY + 1];
    snprintf(key, sizeof key, "%s/failed/%d", tag, ranks[i]);
    void *v = NULL;
    size_t n = 0;
    if (skv__store_try_get(st, key, &v, &n) != 0) continue;
    skv__step_result_t r;
    memset(&r, 0, sizeof r);
    memcpy(&r, v, SKV_MIN(n, sizeof r));
    free(v);
    return SKV_FAIL(r.rc < 0 ? r.rc : SKV_EINTERNAL, SKV_SUBSYS_BOOT,
                    "fd exchange \"%s\": local PE %d (rank %d) failed: %s", tag, i, ranks[i],
                    skv__step_msg(&r));
  }
  return SKV_FAIL(SKV_EINTERNAL, SKV_SUBSYS_BOOT,
                  "fd exchange \"%s\": a local PE failed without saying why", tag);
}

/* While waiting on peers: SKV_EPEERDEAD once the store saw a rank die, a peer's own code once
 * it announced a failure (the barrier's counter), else 0. */
static int probe_peers(skv__store_t *st, const char *tag, const char *ready_key, const int *ranks,
                       int nlocal) {
  SKV_CHECK(skv__store_check_dead(st, ready_key));
  void *v = NULL;
  size_t n = 0;
  int rc = skv__store_try_get(st, ready_key, &v, &n);
  if (rc == SKV_ENOTFOUND) return 0; /* local PE 0 got every descriptor and deleted it */
  if (rc < 0) return rc;
  int64_t arrived = n == 8 ? (int64_t)skv__get_le64(v) : 0;
  free(v);
  return arrived >= FD_FAILED ? peer_failed(st, tag, ranks, nlocal) : 0;
}

/* The abstract socket of a local PE: "\0symkv/" and its random 128-bit name in hex. */
static socklen_t sock_name(struct sockaddr_un *a, const uint8_t name[16]) {
  memset(a, 0, sizeof *a);
  a->sun_family = AF_UNIX;
  memcpy(a->sun_path + 1, "symkv/", 6);
  for (int i = 0; i < 16; i++) snprintf(a->sun_path + 7 + 2 * i, 3, "%02x", name[i]);
  return (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + 6 + 32);
}

/* Connect to local PE `peer` and send it `fd` with the header: 0, 1 when the peer does not
 * listen (any more: called after the ready barrier, so it is gone), or a negative code. While
 * the peer's backlog is full, the store (`probe_key`) is asked now and then for dead ranks. */
static int send_fd(skv__store_t *st, const char *probe_key, const int *ranks, int nlocal,
                   const uint8_t name[16], int peer, int peer_rank, const fd_hdr_t *h, int fd,
                   uint64_t deadline, int timeout_ms, const char *tag) {
  struct sockaddr_un a;
  socklen_t alen = sock_name(&a, name);
  int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (s < 0)
    return SKV_FAIL(-errno, SKV_SUBSYS_BOOT, "fd exchange \"%s\": socket failed: %s", tag,
                    strerror(errno));
  int rc;
  uint64_t next_probe = skv__now_ms() + FD_PROBE_MS;
  for (;;) {
    if (connect(s, (struct sockaddr *)&a, alen) == 0) break;
    int e = errno;
    if (e == EINTR) continue;
    if (e == ECONNREFUSED || e == ENOENT) {
      close(s);
      return 1;
    }
    if (e == EINPROGRESS) {
      rc = skv__wait_fd(s, POLLOUT, deadline);
      if (rc == 0) break;
    } else if (e != EAGAIN) {
      close(s);
      return SKV_FAIL(-e, SKV_SUBSYS_BOOT,
                      "fd exchange \"%s\": connecting to local PE %d (rank %d) failed: %s", tag,
                      peer, peer_rank, strerror(e));
    }
    if (skv__ms_left(deadline) == 0) {
      close(s);
      return SKV_FAIL(
          SKV_ETIMEDOUT, SKV_SUBSYS_BOOT,
          "fd exchange \"%s\": could not connect to local PE %d (rank %d) within %d ms (%s); "
          "is it alive?",
          tag, peer, peer_rank, timeout_ms, strerror(e));
    }
    if (skv__now_ms() >= next_probe) {
      rc = probe_peers(st, tag, probe_key, ranks, nlocal);
      if (rc < 0) {
        close(s);
        return fail_after_probe(rc, "fd exchange \"%s\": connecting to local PE %d (rank %d)", tag,
                                peer, peer_rank);
      }
      next_probe = skv__now_ms() + FD_PROBE_MS;
    }
    struct timespec ts = {0, 1000000L};
    nanosleep(&ts, NULL);
  }
  /* The listener must be this user's: the name is secret, but never hand a descriptor to a
   * stranger (checked both ways: the peer checks who connected). */
  struct ucred cred = {0, 0, 0};
  socklen_t cl = sizeof cred;
  if (getsockopt(s, SOL_SOCKET, SO_PEERCRED, &cred, &cl) != 0 || cred.uid != getuid()) {
    close(s);
    return SKV_FAIL(SKV_EAUTH, SKV_SUBSYS_BOOT,
                    "fd exchange \"%s\": the socket of local PE %d (rank %d) is held by pid %d of "
                    "uid %d, not by this user; its descriptor was not sent",
                    tag, peer, peer_rank, (int)cred.pid, (int)cred.uid);
  }
  union {
    char buf[CMSG_SPACE(sizeof(int))];
    struct cmsghdr align;
  } u;
  memset(&u, 0, sizeof u);
  struct iovec iov = {.iov_base = (void *)h, .iov_len = sizeof *h};
  struct msghdr m = {
      .msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf, .msg_controllen = sizeof u.buf};
  struct cmsghdr *cm = CMSG_FIRSTHDR(&m);
  cm->cmsg_level = SOL_SOCKET;
  cm->cmsg_type = SCM_RIGHTS;
  cm->cmsg_len = CMSG_LEN(sizeof(int));
  memcpy(CMSG_DATA(cm), &fd, sizeof fd);
  size_t sent = 0;
  while (sent < sizeof *h) {
    ssize_t w = sendmsg(s, &m, MSG_NOSIGNAL);
    if (w > 0) {
      sent += (size_t)w;
      iov.iov_base = (uint8_t *)h + sent; /* the fd went with the first bytes */
      iov.iov_len = sizeof *h - sent;
      m.msg_control = NULL;
      m.msg_controllen = 0;
      continue;
    }
    int e = w < 0 ? errno : EPIPE;
    if (e == EINTR) continue;
    if (e == EAGAIN && (rc = skv__wait_fd(s, POLLOUT, deadline)) == 0) continue;
    close(s);
    return SKV_FAIL(e == EAGAIN ? SKV_ETIMEDOUT : -e, SKV_SUBSYS_BOOT,
                    "fd exchange \"%s\": sending to local PE %d (rank %d) failed: %s", tag, peer,
                    peer_rank, e == EAGAIN ? "timed out" : strerror(e));
  }
  close(s);
  return 0;
}

/* Read one header (and its fd) from an accepted connection. 0 with *fd_out set, or a negative
 * code; a connection that is not a peer of this exchange gives SKV_EAUTH (the caller drops it). */
static int recv_fd(int c, fd_hdr_t *h, int *fd_out, uint64_t deadline) {
  *fd_out = -1;
  size_t got = 0, nfds = 0;
  while (got < sizeof *h) {
    union {
      char buf[CMSG_SPACE(sizeof(int) * 8)];
      struct cmsghdr align;
    } u;
    struct iovec iov = {.iov_base = (uint8_t *)h + got, .iov_len = sizeof *h - got};
    struct msghdr m = {
        .msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf, .msg_controllen = sizeof u.buf};
    ssize_t r = recvmsg(c, &m, MSG_CMSG_CLOEXEC);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0 && errno == EAGAIN) {
      int rc = skv__wait_fd(c, POLLIN, deadline);
      if (rc < 0) return rc;
      continue;
    }
    if (r <= 0) return SKV_EAUTH; /* closed early or failed: not a peer we can use */
    for (struct cmsghdr *cm = CMSG_FIRSTHDR(&m); cm; cm = CMSG_NXTHDR(&m, cm)) {
      if (cm->cmsg_level != SOL_SOCKET || cm->cmsg_type != SCM_RIGHTS) continue;
      size_t nfd = (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (size_t i = 0; i < nfd; i++) {
        int fd;
        memcpy(&fd, CMSG_DATA(cm) + i * sizeof(int), sizeof fd);
        if (*fd_out < 0)
          *fd_out = fd;
        else
          close(fd);
        nfds++;
      }
    }
    if ((m.msg_flags & MSG_CTRUNC) || nfds > 1) { /* a peer sends exactly one */
      if (*fd_out >= 0) close(*fd_out);
      *fd_out = -1;
      return SKV_EAUTH;
    }
    got += (size_t)r;
  }
  return 0;
}

/* Local PE `peer` stopped listening after the ready barrier: it failed or exited. Give the store
 * a moment to say which: the peer's own error once it announced one, SKV_EPEERDEAD naming the
 * rank once the store saw it die. Without either, SKV_ECONN: a PE is never told a peer died
 * while the store says every rank lives. */
static int peer_gone(skv__store_t *st, const char *probe_key, const char *tag, const int *ranks,
                     int nlocal, int peer, uint64_t deadline) {
  uint64_t until = SKV_MIN(deadline, skv__now_ms() + FD_GONE_WAIT_MS);
  for (;;) {
    int rc = probe_peers(st, tag, probe_key, ranks, nlocal);
    if (rc < 0) {
      return fail_after_probe(rc, "fd exchange \"%s\": local PE %d (rank %d) stopped listening",
                              tag, peer, ranks[peer]);
    }
    if (skv__now_ms() >= until) break;
    struct timespec ts = {0, 10000000L};
    nanosleep(&ts, NULL);
  }
  return SKV_FAIL(SKV_ECONN, SKV_SUBSYS_BOOT,
                  "fd exchange \"%s\": local PE %d (rank %d) stopped listening before it got this "
                  "PE's descriptor, and the store says every rank is alive: it failed without "
                  "saying why; look at its log",
                  tag, peer, ranks[peer]);
}

/* A failure of this PE itself (out of descriptors or memory, a failed system call), which its
 * peers should hear about, rather than one caused by a peer (gone, failed, timed out). */
static bool own_failure(int rc) {
  return rc < 0 && rc > -1000 && rc != SKV_ETIMEDOUT && rc != -EPIPE && rc != -ECONNRESET &&
         rc != -ECONNREFUSED;
}

int skv__fd_exchange(skv__store_t *st, const char *tag, const int *ranks, int nlocal, int me,
                     int my_fd, int *peer_fds, int timeout_ms) {
  SKV_ARG_CHECK(st && tag && ranks && peer_fds, SKV_SUBSYS_BOOT,
                "skv__fd_exchange: store, tag, ranks and peer_fds must not be NULL");
  SKV_ARG_CHECK(nlocal >= 1 && nlocal <= 4096 && me >= 0 && me < nlocal, SKV_SUBSYS_BOOT,
                "skv__fd_exchange(\"%s\"): local index %d of %d PEs is out of range", tag, me,
                nlocal);
  SKV_ARG_CHECK(my_fd >= 0 && timeout_ms >= 0, SKV_SUBSYS_BOOT,
                "skv__fd_exchange(\"%s\"): fd %d or timeout %d ms is negative", tag, my_fd,
                timeout_ms);
  SKV_ARG_CHECK(strlen(tag) >= 1 && strlen(tag) + 24 <= SKV_BOOT_MAX_KEY, SKV_SUBSYS_BOOT,
                "skv__fd_exchange: tag \"%.40s\" must have 1..%d bytes", tag,
                SKV_BOOT_MAX_KEY - 24);
  for (int i = 0; i < nlocal; i++) peer_fds[i] = -1;
  uint64_t deadline = skv__now_ms() + (uint64_t)timeout_ms;
  int rc = 0, lfd = -1;
  bool listening = false;  /* past the ready barrier: a failure of ours is announced */
  uint8_t *secrets = NULL; /* the nonce, then one socket name per local PE (16 bytes each) */
  char nonce_key[SKV_BOOT_MAX_KEY + 1], ready_key[SKV_BOOT_MAX_KEY + 1];
  snprintf(nonce_key, sizeof nonce_key, "%s/nonce/%d", tag, ranks[0]);
  snprintf(ready_key, sizeof ready_key, "%s/ready/%d", tag, ranks[0]);

  if (nlocal > 1) {
    /* 1. the nonce and the socket names */
    const size_t sbytes = 16u * ((size_t)nlocal + 1);
    if (me == 0) {
      secrets = malloc(sbytes);
      if (!secrets) {
        rc = SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_BOOT, "fd exchange \"%s\": out of memory", tag);
        goto fail;
      }
      SKV_CHECK_GOTO(skv__random_bytes(secrets, sbytes), rc, fail);
      SKV_CHECK_GOTO(skv__store_set(st, nonce_key, secrets, sbytes), rc, fail);
    } else {
      void *v = NULL;
      size_t n = 0;
      SKV_CHECK_GOTO(skv__store_get(st, nonce_key, &v, &n, skv__ms_left(deadline)), rc, fail);
      secrets = v;
      if (n != sbytes) {
        rc = SKV_FAIL(SKV_EPROTO, SKV_SUBSYS_BOOT,
                      "fd exchange \"%s\": the nonce and socket names have %zu bytes, not %zu; "
                      "do all local PEs pass the same PE count, and is the tag unique?",
                      tag, n, sbytes);
        goto fail;
      }
    }
    const uint8_t *nonce = secrets, *names = secrets + 16;
    /* 2. listen */
    struct sockaddr_un a;
    socklen_t alen = sock_name(&a, names + 16 * me);
    lfd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (lfd < 0 || bind(lfd, (struct sockaddr *)&a, alen) != 0 || listen(lfd, nlocal + 8) != 0) {
      rc = SKV_FAIL(-errno, SKV_SUBSYS_BOOT,
                    "fd exchange \"%s\": listening on a unix socket failed: %s", tag,
                    strerror(errno));
      announce_failure(st, tag, ready_key, ranks[me], rc);
      goto fail;
    }
    /* 3. every local PE listens */
    SKV_CHECK_GOTO(skv__store_add(st, ready_key, 1, NULL), rc, fail);
    SKV_CHECK_GOTO(skv__store_wait_ge(st, ready_key, nlocal, skv__ms_left(deadline)), rc, fail);
    int64_t arrived = 0;
    SKV_CHECK_GOTO(skv__store_add(st, ready_key, 0, &arrived), rc, fail);
    if (arrived >= FD_FAILED) {
      rc = peer_failed(st, tag, ranks, nlocal);
      goto fail;
    }
    listening = true;
    /* 4. send to everyone */
    fd_hdr_t h;
    memset(&h, 0, sizeof h);
    h.magic = FD_MAGIC;
    h.version = FD_VERSION;
    memcpy(h.nonce, nonce, sizeof h.nonce);
    h.local_index = me;
    h.rank = ranks[me];
    int gone = -1; /* a peer that no longer listens; the others still get this PE's fd */
    for (int k = 1; k < nlocal; k++) {
      int peer = (me + k) % nlocal; /* start at different peers to spread the load */
      SKV_CHECK_GOTO(send_fd(st, ready_key, ranks, nlocal, names + 16 * peer, peer, ranks[peer], &h,
                             my_fd, deadline, timeout_ms, tag),
                     rc, fail);
      if (rc == 1 && gone < 0) gone = peer;
    }
    if (gone >= 0) {
      rc = peer_gone(st, ready_key, tag, ranks, nlocal, gone, deadline);
      goto fail;
    }
    /* 5. accept from everyone */
    int got = 0;
    while (got < nlocal - 1) {
      int c = accept4(lfd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (c < 0) {
        int e = errno;
        if (e == EINTR || e == ECONNABORTED) continue;
        if (e == EAGAIN) {
          /* Wait in slices, asking the store in between whether a rank died. */
          rc = skv__wait_fd(lfd, POLLIN, SKV_MIN(deadline, skv__now_ms() + FD_PROBE_MS));
          char missing[256];
          size_t o = 0;
          for (int i = 0; i < nlocal && o + 16 < sizeof missing; i++)
            if (i != me && peer_fds[i] < 0)
              o += (size_t)snprintf(missing + o, sizeof missing - o, " %d", ranks[i]);
          if (rc == SKV_ETIMEDOUT && skv__ms_left(deadline) > 0) {
            rc = probe_peers(st, tag, ready_key, ranks, nlocal);
            if (rc < 0) {
              rc = fail_after_probe(
                  rc, "fd exchange \"%s\": waiting for descriptors from rank(s)%s", tag, missing);
              goto fail;
            }
            continue;
          }
          if (rc == SKV_ETIMEDOUT) {
            rc = SKV_FAIL(SKV_ETIMEDOUT, SKV_SUBSYS_BOOT,
                          "fd exchange \"%s\": after %d ms no descriptor came from rank(s)%s; are "
                          "they alive?",
                          tag, timeout_ms, missing);
            goto fail;
          }
          if (rc < 0) {
            rc = SKV_FAIL(rc, SKV_SUBSYS_BOOT, "fd exchange \"%s\": poll failed: %s", tag,
                          strerror(-rc));
            goto fail;
          }
          continue;
        }
        rc = SKV_FAIL(-e, SKV_SUBSYS_BOOT, "fd exchange \"%s\": accept failed: %s", tag,
                      strerror(e));
        goto fail;
      }
      struct ucred cred = {0, 0, 0};
      socklen_t cl = sizeof cred;
      if (getsockopt(c, SOL_SOCKET, SO_PEERCRED, &cred, &cl) != 0 || cred.uid != getuid()) {
        SKV_WARN_RL(SKV_SUBSYS_BOOT,
                    "fd exchange \"%s\": dropped a connection from pid %d of uid %d (not this "
                    "user)",
                    tag, (int)cred.pid, (int)cred.uid);
        close(c);
        continue;
      }
      fd_hdr_t in;
      int fd = -1;
      uint64_t conn_deadline = SKV_MIN(deadline, skv__now_ms() + FD_CONN_WAIT_MS);
      rc = recv_fd(c, &in, &fd, conn_deadline);
      close(c);
      if (rc == SKV_ETIMEDOUT) {
        if (fd >= 0) close(fd);
        if (conn_deadline == deadline) {
          rc = SKV_FAIL(SKV_ETIMEDOUT, SKV_SUBSYS_BOOT,
                        "fd exchange \"%s\": pid %d connected but sent nothing within %d ms", tag,
                        (int)cred.pid, timeout_ms);
          goto fail;
        }
        SKV_WARN_RL(SKV_SUBSYS_BOOT,
                    "fd exchange \"%s\": dropped a connection from pid %d that sent no complete "
                    "header within %d ms",
                    tag, (int)cred.pid, FD_CONN_WAIT_MS);
        rc = 0;
        continue;
      }
      bool ok = rc == 0 && fd >= 0 && in.magic == FD_MAGIC && in.version == FD_VERSION &&
                skv__consttime_eq(in.nonce, 16, nonce, 16) && in.local_index >= 0 &&
                in.local_index < nlocal && in.local_index != me && peer_fds[in.local_index] < 0 &&
                in.rank == ranks[in.local_index];
      rc = 0;
      if (!ok) {
        SKV_WARN_RL(SKV_SUBSYS_BOOT,
                    "fd exchange \"%s\": dropped a connection from pid %d that is not a peer of "
                    "this exchange (bad header or nonce, or not exactly one fd)",
                    tag, (int)cred.pid);
        if (fd >= 0) close(fd);
        continue;
      }
      peer_fds[in.local_index] = fd;
      got++;
    }
    close(lfd);
    lfd = -1;
    /* Every peer has connected to this PE, so every peer is past the nonce and the barrier. */
    if (me == 0) {
      (void)skv__store_del(st, nonce_key);
      (void)skv__store_del(st, ready_key);
    }
  }
  peer_fds[me] = fcntl(my_fd, F_DUPFD_CLOEXEC, 0);
  if (peer_fds[me] < 0) {
    rc = SKV_FAIL(-errno, SKV_SUBSYS_BOOT, "fd exchange \"%s\": dup of the local fd failed: %s",
                  tag, strerror(errno));
    goto fail;
  }
  free(secrets);
  SKV_TRACE(SKV_SUBSYS_BOOT, "fd exchange \"%s\": %d descriptors exchanged", tag, nlocal);
  return 0;
fail:
  /* Tell the peers before they find this PE's socket gone (they would wait for it, or take it
   * for dead): from the barrier on, they learn a failure of ours from the store. */
  if (listening && own_failure(rc)) {
    char saved[1024];
    snprintf(saved, sizeof saved, "%s", skv_last_error());
    announce_failure(st, tag, ready_key, ranks[me], rc);
    skv__error_restore(saved);
  }
  free(secrets);
  if (lfd >= 0) close(lfd);
  for (int i = 0; i < nlocal; i++) {
    if (peer_fds[i] >= 0) close(peer_fds[i]);
    peer_fds[i] = -1;
  }
  return rc;
}
