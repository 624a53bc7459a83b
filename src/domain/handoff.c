/* An owner hands its segment over itself: a thread accepting on an abstract unix socket with a
 * random name, credentials checked both ways, the fd sent with SCM_RIGHTS. No server, no TCP. */
#define _GNU_SOURCE
#include "domain/domain_int.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#define HANDOFF_MAGIC 0x68646f66u /* "fodh" */

typedef struct req {
  uint32_t magic;
  uint32_t slot;  /* the asking participant's slot */
  uint64_t epoch; /* the incarnation of the owner's slot it wants */
} req_t;

typedef struct rep {
  uint32_t magic;
  int32_t status; /* 0, or why no fd comes */
  uint64_t epoch;
  uint64_t bytes;
} rep_t;

static socklen_t abstract_addr(struct sockaddr_un *a, const char *name) {
  memset(a, 0, sizeof *a);
  a->sun_family = AF_UNIX;
  size_t n = strlen(name);
  memcpy(a->sun_path + 1, name, n); /* sun_path[0] = 0: the abstract namespace, no file */
  return (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + n);
}

static bool same_user(const struct ucred *cr) {
  return cr->uid == geteuid();
}

/* ---- the owner's side ---------------------------------------------------------------------- */

static void serve_one(skv__domain_t *d, int c) {
  struct ucred cr;
  socklen_t cl = sizeof cr;
  rep_t rep = {HANDOFF_MAGIC, 0, d->epoch, d->hdr->slot_bytes};
  req_t req;
  if (getsockopt(c, SOL_SOCKET, SO_PEERCRED, &cr, &cl) != 0) return;
  struct pollfd pf = {c, POLLIN, 0};
  if (poll(&pf, 1, 1000) != 1 || recv(c, &req, sizeof req, MSG_DONTWAIT) != (ssize_t)sizeof req)
    return; /* silent or malformed: drop it */
  if (!same_user(&cr) || req.magic != HANDOFF_MAGIC || req.slot >= d->max_slots ||
      (int32_t)cr.pid != __atomic_load_n(&d->slots[req.slot].pid, __ATOMIC_ACQUIRE) ||
      !skv__domain_alive(d, (int)req.slot)) {
    SKV_INFO(SKV_SUBSYS_KV,
             "domain '%s': refused a segment request from pid %d (uid %u, slot %u): not a "
             "participant of this domain",
             d->name, (int)cr.pid, (unsigned)cr.uid, req.slot);
    rep.status = SKV_EAUTH;
    (void)send(c, &rep, sizeof rep, MSG_NOSIGNAL);
    return;
  }
  if (req.epoch != d->epoch) {
    rep.status = SKV_ESTALE;
    (void)send(c, &rep, sizeof rep, MSG_NOSIGNAL);
    return;
  }
  union {
    char buf[CMSG_SPACE(sizeof(int))];
    struct cmsghdr align;
  } u;
  memset(&u, 0, sizeof u);
  struct iovec iov = {&rep, sizeof rep};
  struct msghdr m;
  memset(&m, 0, sizeof m);
  m.msg_iov = &iov;
  m.msg_iovlen = 1;
  m.msg_control = u.buf;
  m.msg_controllen = sizeof u.buf;
  struct cmsghdr *cm = CMSG_FIRSTHDR(&m);
  cm->cmsg_level = SOL_SOCKET;
  cm->cmsg_type = SCM_RIGHTS;
  cm->cmsg_len = CMSG_LEN(sizeof(int));
  memcpy(CMSG_DATA(cm), &d->seg_fd, sizeof(int));
  (void)sendmsg(c, &m, MSG_NOSIGNAL);
}

static void *handoff_main(void *arg) {
  skv__domain_t *d = arg;
  for (;;) {
    struct pollfd pf[2] = {{d->listen_fd, POLLIN, 0}, {d->stop_pipe[0], POLLIN, 0}};
    if (poll(pf, 2, -1) < 0) {
      if (errno == EINTR) continue;
      break;
    }
    if (pf[1].revents) break;
    if (!(pf[0].revents & POLLIN)) continue;
    int c = accept4(d->listen_fd, NULL, NULL, SOCK_CLOEXEC);
    if (c < 0) continue;
    serve_one(d, c);
    close(c);
  }
  return NULL;
}

int skv__dom_handoff_start(skv__domain_t *d) {
  uint8_t nonce[16];
  SKV_CHECK(skv__random_bytes(nonce, sizeof nonce));
  char name[sizeof d->slots[0].sock];
  int k = snprintf(name, sizeof name, "symkv-");
  for (size_t i = 0; i < sizeof nonce; i++)
    k += snprintf(name + k, sizeof name - (size_t)k, "%02x", nonce[i]);
  d->listen_fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (d->listen_fd < 0)
    return SKV_FAIL(-errno, SKV_SUBSYS_KV, "domain '%s': socket failed: %s", d->name,
                    strerror(errno));
  struct sockaddr_un a;
  socklen_t al = abstract_addr(&a, name);
  if (bind(d->listen_fd, (struct sockaddr *)&a, al) != 0 || listen(d->listen_fd, 64) != 0) {
    int e = errno;
    close(d->listen_fd);
    d->listen_fd = -1;
    return SKV_FAIL(-e, SKV_SUBSYS_KV, "domain '%s': binding the hand-over socket failed: %s",
                    d->name, strerror(e));
  }
  if (pipe2(d->stop_pipe, O_CLOEXEC) != 0) {
    int e = errno;
    close(d->listen_fd);
    d->listen_fd = -1;
    return SKV_FAIL(-e, SKV_SUBSYS_KV, "domain '%s': pipe failed: %s", d->name, strerror(e));
  }
  int te = skv__thread_start(&d->handoff, handoff_main, d); /* it takes no signals */
  if (te) {
    close(d->listen_fd);
    close(d->stop_pipe[0]);
    close(d->stop_pipe[1]);
    d->listen_fd = d->stop_pipe[0] = d->stop_pipe[1] = -1;
    return SKV_FAIL(-te, SKV_SUBSYS_KV, "domain '%s': starting the hand-over thread failed: %s",
                    d->name, strerror(te));
  }
  d->handoff_on = true;
  /* bound: only now may anyone learn the name */
  memcpy(d->slots[d->slot].sock, name, sizeof name);
  return 0;
}

void skv__dom_handoff_stop(skv__domain_t *d) {
  if (!d->handoff_on) return;
  if (d->slot >= 0) d->slots[d->slot].sock[0] = '\0';
  (void)!write(d->stop_pipe[1], "x", 1);
  pthread_join(d->handoff, NULL);
  close(d->listen_fd);
  close(d->stop_pipe[0]);
  close(d->stop_pipe[1]);
  d->listen_fd = d->stop_pipe[0] = d->stop_pipe[1] = -1;
  d->handoff_on = false;
}

/* ---- the asking side ----------------------------------------------------------------------- */

int skv__dom_handoff_get(skv__domain_t *d, int s, uint64_t epoch, int *fd) {
  *fd = -1;
  skv__dom_slot_t *rec = &d->slots[s];
  char name[sizeof rec->sock];
  memcpy(name, rec->sock, sizeof name);
  name[sizeof name - 1] = '\0';
  const int32_t pid = __atomic_load_n(&rec->pid, __ATOMIC_ACQUIRE);
  if (!name[0] || pid <= 0)
    return SKV_FAIL(SKV_ESTALE, SKV_SUBSYS_KV,
                    "domain '%s': slot %d has no owner now (it left or is leaving): its pages "
                    "are stale; look the keys up again",
                    d->name, s);
  const uint64_t deadline = skv__now_ms() + (uint64_t)d->timeout_ms;
  int c = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (c < 0) return SKV_FAIL(-errno, SKV_SUBSYS_KV, "socket failed: %s", strerror(errno));
  struct sockaddr_un a;
  socklen_t al = abstract_addr(&a, name);
  int rc = 0;
  while (connect(c, (struct sockaddr *)&a, al) != 0) {
    if ((errno != EAGAIN && errno != EINTR) || skv__now_ms() >= deadline) {
      rc = SKV_FAIL(errno == ECONNREFUSED ? SKV_ESTALE : SKV_ETIMEDOUT, SKV_SUBSYS_KV,
                    "domain '%s': the owner of slot %d (pid %d) did not answer: %s; its pages "
                    "are stale",
                    d->name, s, (int)pid, strerror(errno));
      goto out;
    }
    struct timespec ts = {0, 1000000};
    nanosleep(&ts, NULL);
  }
  struct ucred cr;
  socklen_t cl = sizeof cr;
  if (getsockopt(c, SOL_SOCKET, SO_PEERCRED, &cr, &cl) != 0 || !same_user(&cr) ||
      (int32_t)cr.pid != pid) {
    rc = SKV_FAIL(SKV_EAUTH, SKV_SUBSYS_KV,
                  "domain '%s': the socket of slot %d is held by pid %d, uid %u, not by its owner "
                  "(pid %d) of this user: refusing it",
                  d->name, s, (int)cr.pid, (unsigned)cr.uid, (int)pid);
    goto out;
  }
  req_t req = {HANDOFF_MAGIC, (uint32_t)d->slot, epoch};
  if (send(c, &req, sizeof req, MSG_NOSIGNAL) != (ssize_t)sizeof req) {
    rc = SKV_FAIL(SKV_ESTALE, SKV_SUBSYS_KV, "domain '%s': slot %d's owner went away", d->name, s);
    goto out;
  }
  struct pollfd pf = {c, POLLIN, 0};
  int left = skv__ms_left(deadline);
  if (poll(&pf, 1, left) != 1) {
    rc = SKV_FAIL(SKV_ETIMEDOUT, SKV_SUBSYS_KV,
                  "domain '%s': slot %d's owner (pid %d) did not hand its segment over within "
                  "%d ms (stopped?)",
                  d->name, s, (int)pid, d->timeout_ms);
    goto out;
  }
  rep_t rep;
  union {
    char buf[CMSG_SPACE(sizeof(int))];
    struct cmsghdr align;
  } u;
  struct iovec iov = {&rep, sizeof rep};
  struct msghdr m;
  memset(&m, 0, sizeof m);
  m.msg_iov = &iov;
  m.msg_iovlen = 1;
  m.msg_control = u.buf;
  m.msg_controllen = sizeof u.buf;
  ssize_t r = recvmsg(c, &m, MSG_CMSG_CLOEXEC);
  int got = -1;
  for (struct cmsghdr *cm = r > 0 ? CMSG_FIRSTHDR(&m) : NULL; cm; cm = CMSG_NXTHDR(&m, cm))
    if (cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SCM_RIGHTS &&
        cm->cmsg_len == CMSG_LEN(sizeof(int)))
      memcpy(&got, CMSG_DATA(cm), sizeof got);
  if (r != (ssize_t)sizeof rep || rep.magic != HANDOFF_MAGIC || rep.status != 0 || got < 0 ||
      rep.epoch != epoch) {
    if (got >= 0) close(got);
    int st = r == (ssize_t)sizeof rep && rep.status ? rep.status : SKV_ESTALE;
    rc = SKV_FAIL(st, SKV_SUBSYS_KV,
                  "domain '%s': slot %d's owner did not hand its segment over (%s): its pages "
                  "are stale; look the keys up again",
                  d->name, s, skv_err_name(st));
    goto out;
  }
  *fd = got;
out:
  close(c);
  return rc;
}
