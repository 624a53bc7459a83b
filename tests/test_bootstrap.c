/* Tests of the bootstrap layer: the store server and client (in one process and across forked
 * PEs, hostile input, dead and stopped peers) and fd passing between the PEs of one node. */
#define _GNU_SOURCE
#include "bootstrap/proto.h"
#include "skv_test.h"

#include <arpa/inet.h>
#include <criterion/criterion.h>
#include <criterion/parameterized.h>
#include <dirent.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

TestSuite(store, .timeout = 60);
TestSuite(fdpass, .timeout = 60);

/* ---- helpers ------------------------------------------------------------------------------ */

static int count_fds(void) {
  DIR *d = opendir("/proc/self/fd");
  if (!d) return -1;
  int n = 0;
  while (readdir(d)) n++;
  closedir(d);
  return n;
}

/* One PE of a forked job: rank 0 serves the store, every PE connects (from the environment the
 * harness set: SKV_BOOTSTRAP, SKV_TOKEN). */
typedef struct pe {
  skv__store_server_t *srv;
  skv__store_t *st;
} pe_t;

static int pe_join(pe_t *pe, int rank, int npes, int timeout_ms) {
  memset(pe, 0, sizeof *pe);
  const char *boot = getenv("SKV_BOOTSTRAP"), *tok = getenv("SKV_TOKEN");
  if (!boot || !tok) return SKV_EINVAL;
  char host[256];
  int port = 0;
  int rc = skv__parse_bootstrap(boot, "SKV_BOOTSTRAP", host, sizeof host, &port);
  if (rc) return rc;
  if (rank == 0 && (rc = skv__store_server_start(host, port, tok, npes, &pe->srv)) != 0) return rc;
  rc = skv__store_connect(host, port, tok, rank, npes, timeout_ms, &pe->st);
  if (rc && pe->srv) {
    skv__store_server_stop(pe->srv, 0);
    pe->srv = NULL;
  }
  return rc;
}

/* Leave: a final barrier (so rank 0 serves until everyone is done), BYE, stop the server. */
static int pe_leave(pe_t *pe, bool barrier) {
  int rc = 0;
  if (barrier) rc = skv__store_barrier(pe->st, "test/leave", 20000);
  int rc2 = skv__store_close(pe->st);
  int rc3 = skv__store_server_stop(pe->srv, 20000);
  return rc ? rc : rc2 ? rc2 : rc3;
}

#define JOIN(pe, rank, npes) PE_CHECK(pe_join(pe, rank, npes, 20000) == 0, "join")
#define LEAVE(pe)            PE_CHECK(pe_leave(pe, true) == 0, "leave")

#define RUN_JOB(npes, fn, arg, timeout_ms)                             \
  do {                                                                 \
    skv_test_job_t job_;                                               \
    int bad_ = skv_test_run(&job_, (npes), (fn), (arg), (timeout_ms)); \
    cr_assert_eq(bad_, 0, "PEs failed: %s", skv_test_statuses(&job_)); \
  } while (0)

/* A server on an ephemeral loopback port and clients of it, in this process. */
static skv__store_server_t *serve(const char *token, int nranks) {
  skv__store_server_t *srv = NULL;
  int rc = skv__store_server_start("127.0.0.1", 0, token, nranks, &srv);
  cr_assert_eq(rc, 0, "server start: %s", skv_last_error());
  cr_assert_gt(skv__store_server_port(srv), 0);
  return srv;
}

static skv__store_t *join(skv__store_server_t *srv, const char *token, int rank, int nranks) {
  skv__store_t *st = NULL;
  int rc =
      skv__store_connect("127.0.0.1", skv__store_server_port(srv), token, rank, nranks, 5000, &st);
  cr_assert_eq(rc, 0, "connect rank %d: %s", rank, skv_last_error());
  return st;
}

static void expect_value(skv__store_t *st, const char *key, const void *want, size_t n) {
  void *v = NULL;
  size_t len = 0;
  int rc = skv__store_get(st, key, &v, &len, 2000);
  cr_assert_eq(rc, 0, "get %s: %s", key, skv_last_error());
  cr_assert_eq(len, n, "get %s: %zu bytes, want %zu", key, len, n);
  cr_assert(n == 0 || memcmp(v, want, n) == 0, "get %s: wrong content", key);
  cr_assert_eq(((char *)v)[len], '\0', "no NUL after the value");
  free(v);
}

/* ---- raw protocol (for hostile input) ------------------------------------------------------ */

static int raw_connect(int port) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  cr_assert_geq(fd, 0);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  cr_assert_eq(connect(fd, (struct sockaddr *)&a, sizeof a), 0, "raw connect: %s", strerror(errno));
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  return fd;
}

static int raw_local_port(int fd) {
  struct sockaddr_in a;
  socklen_t l = sizeof a;
  getsockname(fd, (struct sockaddr *)&a, &l);
  return ntohs(a.sin_port);
}

static void raw_send(int fd, const void *p, size_t n) {
  cr_assert_eq(send(fd, p, n, MSG_NOSIGNAL), (ssize_t)n, "raw send: %s", strerror(errno));
}

static bool raw_recv(int fd, void *p, size_t n, int timeout_ms) {
  uint8_t *q = p;
  while (n) {
    struct pollfd pf = {.fd = fd, .events = POLLIN};
    if (poll(&pf, 1, timeout_ms) <= 0) return false;
    ssize_t r = recv(fd, q, n, 0);
    if (r <= 0) return false;
    q += r;
    n -= (size_t)r;
  }
  return true;
}

/* Read one reply: its status and up to cap payload bytes. */
static int32_t raw_reply(int fd, void *payload, size_t cap, size_t *plen) {
  uint8_t h[SKV_BOOT_REPLY_HDR];
  cr_assert(raw_recv(fd, h, sizeof h, 5000), "no reply from the server");
  uint32_t len;
  int32_t status;
  skv__reply_hdr_get(h, &len, &status);
  cr_assert_geq(len, 4u);
  size_t n = len - 4;
  cr_assert_leq(n, cap, "reply of %zu bytes", n);
  if (n) cr_assert(raw_recv(fd, payload, n, 5000), "truncated reply");
  if (plen) *plen = n;
  return status;
}

/* True once the server closed fd (EOF or reset), within timeout_ms; replies are skipped. */
static bool raw_closed(int fd, int timeout_ms) {
  uint64_t end = skv__now_ms() + (uint64_t)timeout_ms;
  char buf[4096];
  while (skv__now_ms() < end) {
    struct pollfd pf = {.fd = fd, .events = POLLIN};
    if (poll(&pf, 1, (int)(end - skv__now_ms())) <= 0) return false;
    ssize_t r = recv(fd, buf, sizeof buf, 0);
    if (r == 0 || (r < 0 && errno == ECONNRESET)) return true;
  }
  return false;
}

/* ---- log capture ---------------------------------------------------------------------------- */

static pthread_mutex_t cap_mu = PTHREAD_MUTEX_INITIALIZER;
static char cap_buf[65536];
static size_t cap_len;

static void cap_sink(void *arg, int level, unsigned subsys, const char *line) {
  pthread_mutex_lock(&cap_mu);
  if (level == SKV_LOG_WARN) {
    size_t n = strlen(line);
    if (cap_len + n + 2 < sizeof cap_buf) {
      memcpy(cap_buf + cap_len, line, n);
      cap_len += n;
      cap_buf[cap_len++] = '\n';
      cap_buf[cap_len] = '\0';
    }
  }
  pthread_mutex_unlock(&cap_mu);
}

static bool cap_has(const char *needle) {
  pthread_mutex_lock(&cap_mu);
  bool r = strstr(cap_buf, needle) != NULL;
  pthread_mutex_unlock(&cap_mu);
  return r;
}

static bool cap_wait(const char *needle, int timeout_ms) {
  uint64_t end = skv__now_ms() + (uint64_t)timeout_ms;
  while (skv__now_ms() < end) {
    if (cap_has(needle)) return true;
    skv_test_sleep_ms(5);
  }
  return cap_has(needle);
}

/* ---- single process: the operations --------------------------------------------------------- */

Test(store, set_get_roundtrip) {
  skv__store_server_t *srv = serve("tok-roundtrip", 1);
  skv__store_t *st = join(srv, "tok-roundtrip", 0, 1);
  cr_assert_eq(skv__store_rank(st), 0);
  cr_assert_eq(skv__store_nranks(st), 1);

  cr_assert_eq(skv__store_set(st, "a", "hello", 5), 0);
  expect_value(st, "a", "hello", 5);
  uint8_t bin[4096];
  uint64_t seed = skv_test_seed();
  skv_test_fill_random(bin, sizeof bin, &seed);
  bin[0] = 0;
  bin[100] = 0;
  cr_assert_eq(skv__store_set(st, "bin", bin, sizeof bin), 0);
  expect_value(st, "bin", bin, sizeof bin);
  cr_assert_eq(skv__store_set(st, "a", "xy", 2), 0, "overwrite");
  expect_value(st, "a", "xy", 2);
  cr_assert_eq(skv__store_set(st, "empty", NULL, 0), 0);
  expect_value(st, "empty", "", 0);

  void *v = (void *)1;
  size_t len = 99;
  cr_assert_eq(skv__store_try_get(st, "missing", &v, &len), SKV_ENOTFOUND);
  cr_assert_null(v);
  cr_assert_eq(len, 0);
  cr_assert_eq(skv__store_try_get(st, "a", &v, &len), 0);
  cr_assert(len == 2 && memcmp(v, "xy", 2) == 0);
  free(v);
  cr_assert_eq(skv__store_del(st, "a"), 0);
  cr_assert_eq(skv__store_try_get(st, "a", &v, &len), SKV_ENOTFOUND, "deleted key still there");
  cr_assert_eq(skv__store_del(st, "a"), 0, "deleting an absent key is fine");

  int64_t r = 0;
  cr_assert_eq(skv__store_add(st, "ctr", 5, &r), 0);
  cr_assert_eq(r, 5);
  cr_assert_eq(skv__store_add(st, "ctr", -7, &r), 0);
  cr_assert_eq(r, -2);
  cr_assert_eq(skv__store_add(st, "ctr", 5, NULL), 0);
  cr_assert_eq(skv__store_try_get(st, "ctr", &v, &len), 0);
  cr_assert_eq(len, 8);
  uint8_t le[8] = {3, 0, 0, 0, 0, 0, 0, 0};
  cr_assert_arr_eq(v, le, 8, "counter is stored as 8-byte little-endian");
  free(v);
  cr_assert_eq(skv__store_add(st, "bin", 1, &r), SKV_EINVAL, "add to a non-counter");
  cr_assert(strstr(skv_last_error(), "not a counter"), "%s", skv_last_error());
  cr_assert_eq(skv__store_add(st, "ctr", INT64_MAX, &r), SKV_ERANGE, "overflow");

  cr_assert_eq(skv__store_wait_ge(st, "ctr", 3, 0), 0);
  cr_assert_eq(skv__store_wait_ge(st, "ctr", 4, 0), SKV_ETIMEDOUT);
  const char *keys[] = {"ctr", "empty", "bin"};
  cr_assert_eq(skv__store_wait(st, keys, 3, 0), 0);
  cr_assert_eq(skv__store_wait(st, keys, 0, 0), 0);

  cr_assert_eq(skv__store_close(st), 0, "%s", skv_last_error());
  cr_assert_eq(skv__store_server_stop(srv, 2000), 0, "%s", skv_last_error());
}

Test(store, oversized_keys_and_values) {
  skv__store_server_t *srv = serve("tok-oversized", 1);
  skv__store_t *st = join(srv, "tok-oversized", 0, 1);
  char key[SKV_BOOT_MAX_KEY + 2];
  memset(key, 'k', sizeof key);
  key[SKV_BOOT_MAX_KEY + 1] = '\0';
  cr_assert_eq(skv__store_set(st, key, "v", 1), SKV_EINVAL, "257-byte key accepted");
  cr_assert(strstr(skv_last_error(), "257 bytes") && strstr(skv_last_error(), "1..256"), "%s",
            skv_last_error());
  void *v = NULL;
  size_t len = 0;
  cr_assert_eq(skv__store_get(st, key, &v, &len, 100), SKV_EINVAL);
  cr_assert_eq(skv__store_add(st, key, 1, NULL), SKV_EINVAL);
  cr_assert_eq(skv__store_set(st, "", "v", 1), SKV_EINVAL, "empty key accepted");
  key[SKV_BOOT_MAX_KEY] = '\0';
  cr_assert_eq(skv__store_set(st, key, "v", 1), 0, "256-byte key refused: %s", skv_last_error());
  expect_value(st, key, "v", 1);

  size_t big = SKV_BOOT_MAX_VALUE;
  uint8_t *buf = malloc(big + 1);
  cr_assert_not_null(buf);
  uint64_t seed = skv_test_seed();
  skv_test_fill_random(buf, big + 1, &seed);
  cr_assert_eq(skv__store_set(st, "big", buf, big + 1), SKV_EINVAL,
               "value over the limit accepted");
  cr_assert(strstr(skv_last_error(), "limit"), "%s", skv_last_error());
  cr_assert_eq(skv__store_set(st, "big", buf, big), 0, "a value of exactly the limit: %s",
               skv_last_error());
  expect_value(st, "big", buf, big);
  free(buf);

  /* The server checks too (for clients that skip the client-side checks), and keeps the
   * connection: a raw SET with a 300-byte key gets SKV_EINVAL, then a TRY_GET is answered. */
  int fd = raw_connect(skv__store_server_port(srv));
  skv__frame_t f = {0};
  /* rank 0 is taken by `st`; a 2-rank server would be needed for another rank, so leave st. */
  cr_assert_eq(skv__store_close(st), 0);
  skv__frame_hello(&f, "tok-oversized", 0, 1);
  raw_send(fd, f.p, f.len);
  uint8_t pl[600];
  cr_assert_eq(raw_reply(fd, pl, sizeof pl, NULL), 0, "HELLO refused");
  skv__frame_begin(&f, SKV_BOOT_OP_SET);
  skv__frame_u16(&f, 300);
  char k300[300];
  memset(k300, 'z', sizeof k300);
  skv__frame_put(&f, k300, sizeof k300);
  skv__frame_u32(&f, 1);
  skv__frame_put(&f, "v", 1);
  skv__frame_end(&f);
  raw_send(fd, f.p, f.len);
  size_t n = 0;
  cr_assert_eq(raw_reply(fd, pl, sizeof pl - 1, &n), SKV_EINVAL);
  pl[n] = '\0';
  cr_assert(strstr((char *)pl, "300 bytes"), "reason: %s", pl);
  skv__frame_begin(&f, SKV_BOOT_OP_TRY_GET);
  skv__frame_key(&f, "big");
  skv__frame_end(&f);
  raw_send(fd, f.p, f.len);
  uint8_t hdr[SKV_BOOT_REPLY_HDR];
  cr_assert(raw_recv(fd, hdr, sizeof hdr, 5000));
  uint32_t rlen;
  int32_t status;
  skv__reply_hdr_get(hdr, &rlen, &status);
  cr_assert_eq(status, 0, "connection unusable after a rejected key");
  close(fd);
  skv__frame_free(&f);
  cr_assert_eq(skv__store_server_stop(srv, 2000), 0, "%s", skv_last_error());
}

Test(store, get_timeout) {
  skv__store_server_t *srv = serve("tok-timeout", 1);
  skv__store_t *st = join(srv, "tok-timeout", 0, 1);
  void *v = NULL;
  size_t len = 0;
  uint64_t t0 = skv__now_ms();
  cr_assert_eq(skv__store_get(st, "heap/3/1", &v, &len, 300), SKV_ETIMEDOUT);
  uint64_t dt = skv__now_ms() - t0;
  cr_assert(dt >= 280 && dt < 1500, "timed out after %llu ms, want ~300", (unsigned long long)dt);
  cr_assert(strstr(skv_last_error(), "heap/3/1") && strstr(skv_last_error(), "300 ms"), "%s",
            skv_last_error());
  cr_assert_null(v);
  const char *keys[] = {"w1", "w2"};
  cr_assert_eq(skv__store_set(st, "w1", "x", 1), 0);
  cr_assert_eq(skv__store_wait(st, keys, 2, 200), SKV_ETIMEDOUT);
  cr_assert(strstr(skv_last_error(), "w2"), "names the missing key: %s", skv_last_error());
  cr_assert_eq(skv__store_add(st, "c", 2, NULL), 0);
  cr_assert_eq(skv__store_wait_ge(st, "c", 3, 200), SKV_ETIMEDOUT);
  cr_assert(strstr(skv_last_error(), "is 2"), "names the counter value: %s", skv_last_error());
  cr_assert_eq(skv__store_get(st, "x", &v, &len, -1), SKV_EINVAL, "negative timeout");
  /* a server-side timeout does not break the connection */
  cr_assert_eq(skv__store_set(st, "after", "ok", 2), 0, "%s", skv_last_error());
  expect_value(st, "after", "ok", 2);
  cr_assert_eq(skv__store_close(st), 0);
  cr_assert_eq(skv__store_server_stop(srv, 2000), 0);
}

typedef struct adder {
  skv__store_t *st;
  int n, id, bad;
} adder_t;

static void *adder_main(void *arg) {
  adder_t *a = arg;
  int64_t last = INT64_MIN;
  char key[32];
  for (int i = 0; i < a->n; i++) {
    int64_t r = 0;
    if (skv__store_add(a->st, "tctr", 1, &r) != 0 || r <= last) a->bad++;
    last = r;
    snprintf(key, sizeof key, "t%d/%d", a->id, i % 8);
    if (skv__store_set(a->st, key, &i, sizeof i) != 0) a->bad++;
    void *v = NULL;
    size_t len = 0;
    if (skv__store_get(a->st, key, &v, &len, 1000) != 0 || len != sizeof i ||
        memcmp(v, &i, sizeof i) != 0)
      a->bad++;
    free(v);
  }
  return NULL;
}

Test(store, threads_share_one_client) {
  skv__store_server_t *srv = serve("tok-threads", 1);
  skv__store_t *st = join(srv, "tok-threads", 0, 1);
  pthread_t th[4];
  adder_t a[4];
  for (int i = 0; i < 4; i++) {
    a[i] = (adder_t){st, 300, i, 0};
    cr_assert_eq(pthread_create(&th[i], NULL, adder_main, &a[i]), 0);
  }
  for (int i = 0; i < 4; i++) pthread_join(th[i], NULL);
  for (int i = 0; i < 4; i++)
    cr_assert_eq(a[i].bad, 0, "thread %d saw %d bad results", i, a[i].bad);
  int64_t r = 0;
  cr_assert_eq(skv__store_add(st, "tctr", 0, &r), 0);
  cr_assert_eq(r, 1200);
  cr_assert_eq(skv__store_close(st), 0);
  cr_assert_eq(skv__store_server_stop(srv, 2000), 0);
}

/* ---- single process: joining, leaving, dead ranks ---------------------------------------------
 */

Test(store, wrong_token_and_bad_ranks_rejected) {
  skv__store_server_t *srv = serve("good-token-123", 3);
  int port = skv__store_server_port(srv);
  skv__store_t *a = join(srv, "good-token-123", 0, 3), *bad = NULL;
  cr_assert_eq(skv__store_set(a, "k", "v", 1), 0);
  uint64_t t0 = skv__now_ms();
  cr_assert_eq(skv__store_connect("127.0.0.1", port, "bad-token-123", 1, 3, 5000, &bad), SKV_EAUTH);
  cr_assert_null(bad);
  cr_assert(strstr(skv_last_error(), "SKV_TOKEN"), "message says what to do: %s", skv_last_error());
  cr_assert_eq(skv__store_connect("127.0.0.1", port, "good-token-12", 1, 3, 5000, &bad), SKV_EAUTH,
               "prefix");
  cr_assert_eq(skv__store_connect("127.0.0.1", port, "good-token-1234", 1, 3, 5000, &bad),
               SKV_EAUTH, "longer");
  cr_assert_eq(skv__store_connect("127.0.0.1", port, "good-token-123", 1, 4, 5000, &bad),
               SKV_EINVAL);
  cr_assert(strstr(skv_last_error(), "4 ranks"), "%s", skv_last_error());
  cr_assert_eq(skv__store_connect("127.0.0.1", port, "good-token-123", 0, 3, 5000, &bad),
               SKV_EINVAL);
  cr_assert(strstr(skv_last_error(), "already connected"), "%s", skv_last_error());
  cr_assert(skv__now_ms() - t0 < 3000, "rejections should be quick");
  /* a rank out of range never reaches the server (checked by the client), so send it raw */
  int fd = raw_connect(port);
  skv__frame_t f = {0};
  skv__frame_hello(&f, "good-token-123", 7, 3);
  raw_send(fd, f.p, f.len);
  char msg[600];
  size_t n = 0;
  cr_assert_eq(raw_reply(fd, msg, sizeof msg - 1, &n), SKV_EINVAL);
  msg[n] = '\0';
  cr_assert(strstr(msg, "rank 7"), "%s", msg);
  cr_assert(raw_closed(fd, 3000), "connection kept after a rejected HELLO");
  close(fd);
  skv__frame_free(&f);
  /* the correct clients are still served */
  skv__store_t *b = join(srv, "good-token-123", 1, 3);
  expect_value(b, "k", "v", 1);
  cr_assert_eq(skv__store_set(a, "k2", "w", 1), 0);
  expect_value(b, "k2", "w", 1);
  cr_assert_eq(skv__store_close(a), 0);
  cr_assert_eq(skv__store_close(b), 0);
  cr_assert_eq(skv__store_server_stop(srv, 2000), 0);
}

/* HELLO of another protocol version: only a PE that presents the token learns which version the
 * store speaks (SKV_EVERSION); without the token the answer is SKV_EAUTH and nothing more. */
Test(store, token_checked_before_version) {
  skv__store_server_t *srv = serve("good-token-456", 2);
  int port = skv__store_server_port(srv);
  for (int good = 0; good < 2; good++) {
    const char *tok = good ? "good-token-456" : "bad-token-456";
    int fd = raw_connect(port);
    skv__frame_t f = {0};
    skv__frame_begin(&f, SKV_BOOT_OP_HELLO);
    skv__frame_u32(&f, SKV_BOOT_PROTO_VERSION + 7);
    skv__frame_u32(&f, 1);
    skv__frame_u32(&f, 2);
    skv__frame_put(&f, tok, strlen(tok));
    skv__frame_end(&f);
    raw_send(fd, f.p, f.len);
    char msg[600];
    size_t n = 0;
    int32_t st = raw_reply(fd, msg, sizeof msg - 1, &n);
    msg[n] = '\0';
    if (good) {
      cr_assert_eq(st, SKV_EVERSION, "right token, other version: %d (%s)", st, msg);
      cr_assert(strstr(msg, "protocol"), "%s", msg);
    } else {
      cr_assert_eq(st, SKV_EAUTH, "wrong token, other version: %d (%s)", st, msg);
      cr_assert_null(strstr(msg, "protocol"), "the version leaked to a stranger: %s", msg);
    }
    cr_assert(raw_closed(fd, 3000), "connection kept after a rejected HELLO");
    close(fd);
    skv__frame_free(&f);
  }
  cr_assert_eq(skv__store_server_stop(srv, 2000), 0);
}

typedef struct getter {
  skv__store_t *st;
  const char *key;
  int timeout_ms, rc;
  uint64_t ms;
  char err[1024];
} getter_t;

static void *getter_main(void *arg) {
  getter_t *g = arg;
  void *v = NULL;
  size_t len = 0;
  uint64_t t0 = skv__now_ms();
  g->rc = skv__store_get(g->st, g->key, &v, &len, g->timeout_ms);
  g->ms = skv__now_ms() - t0;
  snprintf(g->err, sizeof g->err, "%s", skv_last_error());
  free(v);
  return NULL;
}

Test(store, dead_rank_fails_waiting_and_later_requests) {
  skv__store_server_t *srv = serve("tok-dead", 3);
  skv__store_t *a = join(srv, "tok-dead", 0, 3), *b = join(srv, "tok-dead", 1, 3),
               *c = join(srv, "tok-dead", 2, 3);
  cr_assert_eq(skv__store_set(b, "there", "1", 1), 0);
  getter_t g = {a, "never", 10000, 0, 0, ""};
  pthread_t th;
  cr_assert_eq(pthread_create(&th, NULL, getter_main, &g), 0);
  skv_test_sleep_ms(150); /* let the GET park */
  skv__store_abort(c);    /* rank 2 "crashes" */
  pthread_join(th, NULL);
  cr_assert_eq(g.rc, SKV_EPEERDEAD, "parked GET got %s: %s", skv_err_name(g.rc), g.err);
  cr_assert(g.ms < 3000, "took %llu ms", (unsigned long long)g.ms);
  cr_assert(strstr(g.err, "rank 2 disconnected from the bootstrap store without leaving"), "%s",
            g.err);
  /* later blocking requests that would wait fail at once; the rest are still served */
  void *v = NULL;
  size_t len = 0;
  uint64_t t0 = skv__now_ms();
  cr_assert_eq(skv__store_get(b, "never2", &v, &len, 10000), SKV_EPEERDEAD);
  cr_assert_eq(skv__store_barrier(b, "bar", 10000), SKV_EPEERDEAD);
  cr_assert(strstr(skv_last_error(), "rank 2"), "%s", skv_last_error());
  cr_assert(skv__now_ms() - t0 < 2000);
  expect_value(b, "there", "1", 1);
  cr_assert_eq(skv__store_set(a, "k", "v", 1), 0);
  expect_value(b, "k", "v", 1);
  cr_assert_eq(skv__store_close(a), 0);
  cr_assert_eq(skv__store_close(b), 0);
  cr_assert_eq(skv__store_server_stop(srv, 2000), 0, "%s", skv_last_error());
}

Test(store, rank_that_left_is_not_dead) {
  skv__store_server_t *srv = serve("tok-left", 2);
  skv__store_t *a = join(srv, "tok-left", 0, 2), *b = join(srv, "tok-left", 1, 2);
  cr_assert_eq(skv__store_close(b), 0);
  void *v = NULL;
  size_t len = 0;
  cr_assert_eq(skv__store_get(a, "never", &v, &len, 200), SKV_ETIMEDOUT, "%s", skv_last_error());
  cr_assert(strstr(skv_last_error(), "1 left"), "timeout names the rank that left: %s",
            skv_last_error());
  /* and it may come back */
  b = join(srv, "tok-left", 1, 2);
  cr_assert_eq(skv__store_set(b, "back", "y", 1), 0);
  expect_value(a, "back", "y", 1);
  cr_assert_eq(skv__store_close(b), 0);
  cr_assert_eq(skv__store_close(a), 0);
  cr_assert_eq(skv__store_server_stop(srv, 2000), 0);
}

typedef struct late_server {
  int port, delay_ms;
  skv__store_server_t *srv;
  int rc;
} late_server_t;

static void *late_server_main(void *arg) {
  late_server_t *l = arg;
  skv_test_sleep_ms(l->delay_ms);
  l->rc = skv__store_server_start("127.0.0.1", l->port, "tok-late", 1, &l->srv);
  return NULL;
}

Test(store, connect_retries_until_server_listens) {
  late_server_t l = {skv_test_free_port(), 300, NULL, -1};
  cr_assert_gt(l.port, 0);
  pthread_t th;
  cr_assert_eq(pthread_create(&th, NULL, late_server_main, &l), 0);
  skv__store_t *st = NULL;
  uint64_t t0 = skv__now_ms();
  int rc = skv__store_connect("127.0.0.1", l.port, "tok-late", 0, 1, 5000, &st);
  uint64_t dt = skv__now_ms() - t0;
  pthread_join(th, NULL);
  cr_assert_eq(l.rc, 0, "late server failed to start");
  cr_assert_eq(rc, 0, "%s", skv_last_error());
  cr_assert(dt >= 250, "connected after %llu ms, before the server listened?",
            (unsigned long long)dt);
  cr_assert_eq(skv__store_set(st, "k", "v", 1), 0);
  cr_assert_eq(skv__store_close(st), 0);
  cr_assert_eq(skv__store_server_stop(l.srv, 2000), 0);

  /* nobody listening: fails after the timeout, not before, not much after */
  int port = skv_test_free_port();
  t0 = skv__now_ms();
  rc = skv__store_connect("127.0.0.1", port, "tok-late", 0, 1, 300, &st);
  dt = skv__now_ms() - t0;
  cr_assert(rc == SKV_ECONN || rc == SKV_ETIMEDOUT, "got %s", skv_err_name(rc));
  cr_assert(dt >= 250 && dt < 2000, "gave up after %llu ms", (unsigned long long)dt);
  cr_assert(strstr(skv_last_error(), "rank 0 running"), "%s", skv_last_error());
}

Test(store, ipv6_and_hostname) {
  skv__store_server_t *srv = NULL;
  skv__store_t *st = NULL;
  cr_assert_eq(skv__store_server_start("localhost", 0, "tok-host", 1, &srv), 0, "%s",
               skv_last_error());
  cr_assert_eq(
      skv__store_connect("localhost", skv__store_server_port(srv), "tok-host", 0, 1, 3000, &st), 0,
      "%s", skv_last_error());
  cr_assert_eq(skv__store_set(st, "k", "v", 1), 0);
  expect_value(st, "k", "v", 1);
  cr_assert_eq(skv__store_close(st), 0);
  cr_assert_eq(skv__store_server_stop(srv, 2000), 0);
  int rc = skv__store_server_start("::1", 0, "tok-v6", 1, &srv);
  if (rc != 0) cr_skip_test("no IPv6 loopback here: %s", skv_last_error());
  cr_assert_eq(skv__store_connect("::1", skv__store_server_port(srv), "tok-v6", 0, 1, 3000, &st), 0,
               "%s", skv_last_error());
  cr_assert_eq(skv__store_set(st, "k6", "v6", 2), 0);
  expect_value(st, "k6", "v6", 2);
  cr_assert_eq(skv__store_close(st), 0);
  cr_assert_eq(skv__store_server_stop(srv, 2000), 0);
}

typedef struct closer {
  skv__store_t *st;
  int delay_ms;
} closer_t;

static void *closer_main(void *arg) {
  closer_t *c = arg;
  skv_test_sleep_ms(c->delay_ms);
  skv__store_close(c->st);
  return NULL;
}

Test(store, stop_waits_for_ranks_to_leave) {
  skv__store_server_t *srv = serve("tok-stop", 2);
  skv__store_t *a = join(srv, "tok-stop", 0, 2);
  closer_t c = {a, 300};
  pthread_t th;
  cr_assert_eq(pthread_create(&th, NULL, closer_main, &c), 0);
  uint64_t t0 = skv__now_ms();
  cr_assert_eq(skv__store_server_stop(srv, 5000), 0, "%s", skv_last_error());
  uint64_t dt = skv__now_ms() - t0;
  pthread_join(th, NULL);
  cr_assert(dt >= 250 && dt < 3000, "stop returned after %llu ms", (unsigned long long)dt);

  /* a rank that never leaves: stop gives up at its timeout and says who */
  srv = serve("tok-stop", 2);
  skv__store_t *b = join(srv, "tok-stop", 1, 2);
  t0 = skv__now_ms();
  cr_assert_eq(skv__store_server_stop(srv, 300), SKV_ETIMEDOUT);
  dt = skv__now_ms() - t0;
  cr_assert(dt >= 280 && dt < 2000, "stop returned after %llu ms", (unsigned long long)dt);
  cr_assert(strstr(skv_last_error(), "(1)"), "names rank 1: %s", skv_last_error());
  cr_assert_eq(skv__store_set(b, "k", "v", 1), SKV_ECONN, "the server is gone");
  cr_assert_eq(skv__store_set(b, "k", "v", 1), SKV_ECONN, "and stays gone");
  skv__store_close(b);
}

/* ---- single process: hostile input ----------------------------------------------------------- */

static void still_serving(skv__store_t *st, int i) {
  char key[32], val[32];
  snprintf(key, sizeof key, "alive/%d", i);
  snprintf(val, sizeof val, "value %d", i);
  cr_assert_eq(skv__store_set(st, key, val, strlen(val)), 0, "server stopped serving (%d): %s", i,
               skv_last_error());
  expect_value(st, key, val, strlen(val));
}

static void expect_closed_and_logged(int fd, const char *what) {
  char peer[64];
  snprintf(peer, sizeof peer, "127.0.0.1:%d", raw_local_port(fd));
  cr_assert(raw_closed(fd, 3000), "%s: connection not closed", what);
  cr_assert(cap_wait(peer, 2000), "%s: no WARN naming %s; log:\n%s", what, peer, cap_buf);
  close(fd);
}

Test(store, malformed_input_closes_only_that_connection) {
  skv_log_set_sink(cap_sink, NULL);
  const char *tok = "tok-malformed";
  skv__store_server_t *srv = serve(tok, 8);
  int port = skv__store_server_port(srv);
  skv__store_t *st = join(srv, tok, 0, 8);
  skv__frame_t f = {0};
  uint64_t seed = skv_test_seed();
  int step = 0;

  /* random bytes (a plausible length, then garbage) */
  int fd = raw_connect(port);
  uint8_t junk[200];
  skv_test_fill_random(junk, sizeof junk, &seed);
  skv__put_le32(junk, 100);
  junk[4] = 0xee;
  raw_send(fd, junk, sizeof junk);
  expect_closed_and_logged(fd, "random bytes");
  still_serving(st, step++);

  /* a huge length field */
  fd = raw_connect(port);
  uint8_t huge[8] = {0xf0, 0xff, 0xff, 0xff, 1, 2, 3, 4};
  raw_send(fd, huge, sizeof huge);
  expect_closed_and_logged(fd, "huge length");
  still_serving(st, step++);

  /* a zero length */
  fd = raw_connect(port);
  uint8_t zero[4] = {0};
  raw_send(fd, zero, sizeof zero);
  expect_closed_and_logged(fd, "zero length");
  still_serving(st, step++);

  /* a frame longer than any HELLO before HELLO */
  fd = raw_connect(port);
  uint8_t big[8] = {0x00, 0x00, 0x01, 0x00, 1, 0, 0, 0}; /* 65536 bytes */
  raw_send(fd, big, sizeof big);
  expect_closed_and_logged(fd, "oversized pre-HELLO frame");
  still_serving(st, step++);

  /* a truncated frame, then the peer goes away */
  fd = raw_connect(port);
  skv__frame_hello(&f, tok, 1, 8);
  raw_send(fd, f.p, 10);
  shutdown(fd, SHUT_WR);
  cr_assert(raw_closed(fd, 3000), "truncated frame");
  close(fd);
  still_serving(st, step++);

  /* an unknown opcode before HELLO */
  fd = raw_connect(port);
  skv__frame_begin(&f, 0x42);
  skv__frame_end(&f);
  raw_send(fd, f.p, f.len);
  expect_closed_and_logged(fd, "opcode before HELLO");
  still_serving(st, step++);

  /* several frames in one write, and a frame split into single bytes */
  fd = raw_connect(port);
  skv__frame_t all = {0};
  skv__frame_hello(&f, tok, 6, 8);
  skv__frame_put(&all, f.p, f.len);
  skv__frame_begin(&f, SKV_BOOT_OP_SET);
  skv__frame_key(&f, "multi");
  skv__frame_u32(&f, 3);
  skv__frame_put(&f, "abc", 3);
  skv__frame_end(&f);
  skv__frame_put(&all, f.p, f.len);
  skv__frame_begin(&f, SKV_BOOT_OP_ADD);
  skv__frame_key(&f, "mctr");
  skv__frame_u64(&f, 41);
  skv__frame_end(&f);
  skv__frame_put(&all, f.p, f.len);
  skv__frame_begin(&f, SKV_BOOT_OP_GET);
  skv__frame_u32(&f, 1000);
  skv__frame_key(&f, "multi");
  skv__frame_end(&f);
  skv__frame_put(&all, f.p, f.len);
  raw_send(fd, all.p, all.len);
  uint8_t pl[64];
  size_t n = 0;
  cr_assert_eq(raw_reply(fd, pl, sizeof pl, &n), 0);
  cr_assert_eq(n, 4, "HELLO reply carries the protocol version");
  cr_assert_eq(raw_reply(fd, pl, sizeof pl, &n), 0);
  cr_assert_eq(n, 0);
  cr_assert_eq(raw_reply(fd, pl, sizeof pl, &n), 0);
  int64_t ctr = (int64_t)skv__get_le64(pl);
  cr_assert(n == 8 && ctr == 41, "ADD reply");
  cr_assert_eq(raw_reply(fd, pl, sizeof pl, &n), 0);
  cr_assert(n == 3 && memcmp(pl, "abc", 3) == 0, "GET reply");
  /* byte by byte: a TRY_GET */
  skv__frame_begin(&f, SKV_BOOT_OP_TRY_GET);
  skv__frame_key(&f, "multi");
  skv__frame_end(&f);
  for (size_t i = 0; i < f.len; i++) {
    raw_send(fd, f.p + i, 1);
    skv_test_sleep_ms(2);
  }
  cr_assert_eq(raw_reply(fd, pl, sizeof pl, &n), 0);
  cr_assert(n == 3 && memcmp(pl, "abc", 3) == 0, "TRY_GET reply after a split frame");
  /* a frame queued behind a parked GET is answered after it, in order */
  all.len = 0;
  skv__frame_begin(&f, SKV_BOOT_OP_GET);
  skv__frame_u32(&f, 5000);
  skv__frame_key(&f, "parked");
  skv__frame_end(&f);
  skv__frame_put(&all, f.p, f.len);
  skv__frame_begin(&f, SKV_BOOT_OP_TRY_GET);
  skv__frame_key(&f, "multi");
  skv__frame_end(&f);
  skv__frame_put(&all, f.p, f.len);
  raw_send(fd, all.p, all.len);
  skv_test_sleep_ms(100);
  struct pollfd pf = {.fd = fd, .events = POLLIN};
  cr_assert_eq(poll(&pf, 1, 0), 0, "a reply came before the parked GET was answered");
  cr_assert_eq(skv__store_set(st, "parked", "P", 1), 0);
  cr_assert_eq(raw_reply(fd, pl, sizeof pl, &n), 0);
  cr_assert(n == 1 && pl[0] == 'P', "parked GET answered first");
  cr_assert_eq(raw_reply(fd, pl, sizeof pl, &n), 0);
  cr_assert(n == 3 && memcmp(pl, "abc", 3) == 0, "queued TRY_GET answered second");
  skv__frame_begin(&f, SKV_BOOT_OP_BYE);
  skv__frame_end(&f);
  raw_send(fd, f.p, f.len);
  cr_assert_eq(raw_reply(fd, pl, sizeof pl, &n), 0, "BYE acknowledged");
  cr_assert(raw_closed(fd, 3000), "server closes after BYE");
  close(fd);
  still_serving(st, step++);

  /* after a good HELLO: an unknown opcode, truncated fields, trailing bytes, a second HELLO */
  for (int kind = 0; kind < 4; kind++) {
    fd = raw_connect(port);
    skv__frame_hello(&f, tok, 2 + kind, 8);
    raw_send(fd, f.p, f.len);
    cr_assert_eq(raw_reply(fd, junk, sizeof junk, NULL), 0, "HELLO of rank %d refused", 2 + kind);
    if (kind == 0) {
      skv__frame_begin(&f, 0x7f);
    } else if (kind == 1) {
      skv__frame_begin(&f, SKV_BOOT_OP_SET); /* key length 100, but 2 bytes of key and no more */
      skv__frame_u16(&f, 100);
      skv__frame_put(&f, "ab", 2);
    } else if (kind == 2) {
      skv__frame_begin(&f, SKV_BOOT_OP_TRY_GET); /* TRY_GET with a byte too many */
      skv__frame_key(&f, "alive/0");
      skv__frame_put(&f, "!", 1);
    } else {
      skv__frame_hello(&f, tok, 2 + kind, 8);
    }
    if (kind != 3) skv__frame_end(&f);
    raw_send(fd, f.p, f.len);
    expect_closed_and_logged(fd, kind == 0   ? "unknown opcode"
                                 : kind == 1 ? "truncated fields"
                                 : kind == 2 ? "trailing bytes"
                                             : "second HELLO");
    still_serving(st, step++);
  }
  cr_assert(cap_has("unknown opcode 127") && cap_has("a second HELLO"),
            "the WARN says what was wrong:\n%s", cap_buf);

  /* ranks 2..5 misbehaved after HELLO, so they count as dead: a GET that would wait fails */
  void *v = NULL;
  cr_assert_eq(skv__store_get(st, "never", &v, &n, 5000), SKV_EPEERDEAD);
  skv_log_set_sink(NULL, NULL);
  skv__frame_free(&f);
  skv__frame_free(&all);
  cr_assert_eq(skv__store_close(st), 0);
  cr_assert_eq(skv__store_server_stop(srv, 2000), 0, "%s", skv_last_error());
}

Test(store, silent_connection_closed_after_hello_timeout, .timeout = 40) {
  skv_log_set_sink(cap_sink, NULL);
  skv__store_server_t *srv = serve("tok-silent", 1);
  int fd = raw_connect(skv__store_server_port(srv));
  uint64_t t0 = skv__now_ms();
  skv__store_t *st = join(srv, "tok-silent", 0, 1); /* served while the silent one waits */
  still_serving(st, 0);
  char peer[64];
  snprintf(peer, sizeof peer, "127.0.0.1:%d", raw_local_port(fd));
  cr_assert(raw_closed(fd, SKV_BOOT_HELLO_TIMEOUT_MS + 3000), "silent connection never closed");
  uint64_t dt = skv__now_ms() - t0;
  cr_assert(dt >= SKV_BOOT_HELLO_TIMEOUT_MS - 200, "closed after %llu ms", (unsigned long long)dt);
  cr_assert(cap_wait(peer, 2000), "no WARN naming %s:\n%s", peer, cap_buf);
  cr_assert(cap_has("did not say HELLO"), "%s", cap_buf);
  close(fd);
  still_serving(st, 1);
  skv_log_set_sink(NULL, NULL);
  cr_assert_eq(skv__store_close(st), 0);
  cr_assert_eq(skv__store_server_stop(srv, 2000), 0);
}

/* Log lines that strangers cause at will are rate-limited: 600 connections that each send
 * garbage (a zero-length frame, a frame before HELLO, a wrong token) cost a few dozen WARN lines,
 * not 600; the store keeps serving. */
static int flood_warns;
static void count_sink(void *arg, int level, unsigned subsys, const char *line) {
  if (level == SKV_LOG_WARN) __atomic_add_fetch(&flood_warns, 1, __ATOMIC_RELAXED);
}

Test(store, hostile_flood_logs_are_rate_limited) {
  skv_log_set_sink(count_sink, NULL);
  skv__store_server_t *srv = serve("tok-flood-log", 1);
  int port = skv__store_server_port(srv);
  skv__store_t *st = join(srv, "tok-flood-log", 0, 1);
  skv__frame_t f = {0};
  const int conns = 600;
  for (int i = 0; i < conns; i++) {
    int fd = raw_connect(port);
    if (i % 3 == 0) {
      uint8_t zero[4] = {0};
      raw_send(fd, zero, sizeof zero);
    } else if (i % 3 == 1) {
      skv__frame_begin(&f, SKV_BOOT_OP_SET);
      skv__frame_key(&f, "x");
      skv__frame_u32(&f, 0);
      skv__frame_end(&f);
      raw_send(fd, f.p, f.len);
    } else {
      skv__frame_hello(&f, "not-the-token", 0, 1);
      raw_send(fd, f.p, f.len);
    }
    cr_assert(raw_closed(fd, 3000), "connection %d not closed", i);
    close(fd);
  }
  still_serving(st, 0);
  int warns = __atomic_load_n(&flood_warns, __ATOMIC_RELAXED);
  skv_log_set_sink(NULL, NULL);
  cr_assert_leq(warns, 4 * (SKV_LOG_RL_BURST + 1), "%d WARN lines for %d hostile connections",
                warns, conns);
  cr_assert_geq(warns, 3, "the first ones are still logged (%d)", warns);
  skv__frame_free(&f);
  cr_assert_eq(skv__store_close(st), 0);
  cr_assert_eq(skv__store_server_stop(srv, 2000), 0);
}

/* An attacker (another user when the test runs as root) that holds `n` silent connections to
 * the store's port: it opens them, then every 100 ms reopens those the store closed, until it is
 * killed. Once it first opened them all it writes one byte to `ready_fd`: 1 when it runs as
 * another user, 0 when it could not switch. */
static void silent_flood(int port, int n, int ready_fd) {
  char why[160];
  int other = skv_test_become_other_user(n + 64, why, sizeof why);
  int *fds = calloc((size_t)n, sizeof *fds);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bool told = false;
  for (;;) {
    for (int i = 0; i < n; i++) {
      if (fds[i] > 0) {
        char b;
        struct pollfd pf = {.fd = fds[i], .events = POLLIN};
        if (poll(&pf, 1, 0) == 1 && recv(fds[i], &b, 1, MSG_DONTWAIT) <= 0) {
          close(fds[i]); /* closed by the store: reopen it */
          fds[i] = 0;
        }
      }
      if (fds[i] <= 0) {
        int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
        if (fd < 0) continue;
        if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0 && errno != EINPROGRESS) {
          close(fd);
          continue;
        }
        fds[i] = fd;
      }
    }
    if (!told) {
      uint8_t who = other == 1;
      (void)!write(ready_fd, &who, 1);
      told = true;
    }
    skv_test_sleep_ms(100);
  }
}

/* A local user holding 1,100 silent connections to rank 0's store (its port is visible in
 * /proc/net/tcp) does not keep late PEs out, nor use up the descriptors of rank 0's process
 * (here with RLIMIT_NOFILE 1024): unauthenticated connections have their own small budget (the
 * oldest goes when it is full) and a short deadline, and a PE whose connection was shed before
 * HELLO connects again. No PE is told SKV_EPEERDEAD. */
Test(store, silent_flood_does_not_lock_out_late_pes, .timeout = 120) {
  struct rlimit was, lim;
  cr_assert_eq(getrlimit(RLIMIT_NOFILE, &was), 0);
  lim = was;
  lim.rlim_cur = 1024;
  cr_assert_eq(setrlimit(RLIMIT_NOFILE, &lim), 0);
  skv_log_set_level(SKV_LOG_NONE, SKV_SUBSYS_ALL);
  enum { NPES = 4, FLOOD = 1100 };
  skv__store_server_t *srv = serve("tok-silent-flood", NPES);
  int port = skv__store_server_port(srv);
  int pfd[2];
  cr_assert_eq(pipe(pfd), 0);
  fflush(stdout);
  fflush(stderr);
  pid_t att = fork();
  if (att == 0) { /* no Criterion call in the child: it would talk to the runner */
    close(pfd[0]);
    silent_flood(port, FLOOD, pfd[1]);
    _exit(0);
  }
  cr_assert_geq(att, 0, "fork: %s", strerror(errno));
  close(pfd[1]);
  uint8_t other = 0;
  struct pollfd pf = {.fd = pfd[0], .events = POLLIN};
  cr_assert(poll(&pf, 1, 30000) == 1 && read(pfd[0], &other, 1) == 1, "the attacker never started");
  close(pfd[0]);
  cr_log_info("flood of %d silent connections, %s", FLOOD,
              other ? "from user 'nobody'" : "from this user (cannot switch users)");
  skv_test_sleep_ms(500); /* the flood is established */
  skv__store_t *st[NPES] = {NULL};
  int failed = 0;
  uint64_t worst = 0;
  char first[1024] = "";
  /* 10 rounds over 2 s, against the attacker's reopening bursts: every PE joins, and leaves
   * (BYE) except in the last round */
  const int rounds = 10;
  for (int round = 0; round < rounds; round++) {
    for (int r = 0; r < NPES; r++) {
      uint64_t t0 = skv__now_ms();
      int rc = skv__store_connect("127.0.0.1", port, "tok-silent-flood", r, NPES, 10000, &st[r]);
      if (rc != 0) {
        if (!failed++)
          snprintf(first, sizeof first, "rank %d, round %d: %s: %s", r, round, skv_err_name(rc),
                   skv_last_error());
        continue;
      }
      worst = SKV_MAX(worst, skv__now_ms() - t0);
      if (round < rounds - 1) {
        cr_assert_eq(skv__store_close(st[r]), 0, "%s", skv_last_error());
        st[r] = NULL;
      }
    }
    skv_test_sleep_ms(200);
  }
  cr_log_info("%d PEs joined %d times each; the slowest join took %llu ms", NPES, rounds,
              (unsigned long long)worst);
  /* rank 0's process holds few of the flood's connections and can still open descriptors (a
   * heap's memfds, sockets) */
  int held = count_fds();
  int fds[64], nfd = 0;
  for (; nfd < 64; nfd++)
    if ((fds[nfd] = memfd_create("skv-flood", MFD_CLOEXEC)) < 0) break;
  int memfd_errno = errno;
  for (int i = 0; i < nfd; i++) close(fds[i]);
  int dead = 0;
  for (int r = 0; r < NPES; r++) {
    if (!st[r]) continue;
    char key[32];
    snprintf(key, sizeof key, "flood/%d", r);
    cr_assert_eq(skv__store_set(st[r], key, "x", 1), 0, "%s", skv_last_error());
    if (skv__store_check_dead(st[r], "flood/none") == SKV_EPEERDEAD) dead++;
  }
  kill(att, SIGKILL);
  waitpid(att, NULL, 0);
  for (int r = 0; r < NPES; r++)
    if (st[r]) skv__store_close(st[r]);
  skv__store_server_stop(srv, 2000);
  setrlimit(RLIMIT_NOFILE, &was);
  cr_assert_eq(failed, 0, "%d of %d joins failed under the flood; first: %s", failed, NPES * rounds,
               first);
  cr_assert_lt(worst, 3000, "a late PE needed %llu ms to join under the flood",
               (unsigned long long)worst);
  cr_assert_lt(held, 256, "rank 0's process holds %d descriptors under the flood", held);
  cr_assert_eq(nfd, 64, "rank 0's process ran out of descriptors under the flood: %s",
               strerror(memfd_errno));
  cr_assert_eq(dead, 0, "a PE was told a rank died while every rank lives");
}

/* ---- forked PEs -------------------------------------------------------------------------------
 */

static int pe_get_blocks(int rank, int npes, void *arg) {
  pe_t pe;
  JOIN(&pe, rank, npes);
  if (rank == 1) {
    PE_CHECK(skv__store_set(pe.st, "ready", "1", 1) == 0, "set ready");
    uint64_t t0 = skv__now_ms();
    void *v = NULL;
    size_t len = 0;
    PE_CHECK(skv__store_get(pe.st, "late", &v, &len, 10000) == 0, "get");
    uint64_t dt = skv__now_ms() - t0;
    PE_CHECK(len == 6 && memcmp(v, "from 0", 6) == 0, "value");
    PE_CHECK(dt >= 250, "get returned after %llu ms, before the key was set",
             (unsigned long long)dt);
    free(v);
  } else {
    void *v = NULL;
    size_t len = 0;
    PE_CHECK(skv__store_get(pe.st, "ready", &v, &len, 10000) == 0, "get ready");
    free(v);
    skv_test_sleep_ms(300);
    PE_CHECK(skv__store_set(pe.st, "late", "from 0", 6) == 0, "set");
  }
  LEAVE(&pe);
  return 0;
}

Test(store, get_blocks_until_another_pe_sets) {
  RUN_JOB(2, pe_get_blocks, NULL, 30000);
}

#define ADDS 250

static int pe_add(int rank, int npes, void *arg) {
  pe_t pe;
  JOIN(&pe, rank, npes);
  PE_CHECK(skv__store_barrier(pe.st, "start", 20000) == 0, "start");
  int64_t last = -1;
  for (int i = 0; i < ADDS; i++) {
    int64_t r = 0;
    PE_CHECK(skv__store_add(pe.st, "ctr", rank + 1, &r) == 0, "add %d", i);
    PE_CHECK(r > last && r <= (int64_t)ADDS * npes * (npes + 1) / 2,
             "add %d returned %lld after %lld", i, (long long)r, (long long)last);
    last = r;
  }
  PE_CHECK(skv__store_barrier(pe.st, "done", 20000) == 0, "done");
  int64_t total = 0;
  PE_CHECK(skv__store_add(pe.st, "ctr", 0, &total) == 0, "read");
  PE_CHECK(total == (int64_t)ADDS * npes * (npes + 1) / 2, "total %lld, want %lld",
           (long long)total, (long long)ADDS * npes * (npes + 1) / 2);
  LEAVE(&pe);
  return 0;
}

Test(store, add_from_8_pes_is_exact) {
  RUN_JOB(8, pe_add, NULL, 60000);
}

static int pe_wait(int rank, int npes, void *arg) {
  pe_t pe;
  JOIN(&pe, rank, npes);
  if (rank == 0) {
    const char *keys[] = {"w/1", "w/2"};
    uint64_t t0 = skv__now_ms();
    PE_CHECK(skv__store_wait(pe.st, keys, 2, 10000) == 0, "wait");
    PE_CHECK(skv__now_ms() - t0 >= 150, "wait returned before both keys were set");
    void *v = NULL;
    size_t len = 0;
    PE_CHECK(skv__store_try_get(pe.st, "w/2", &v, &len) == 0, "w/2 exists");
    free(v);
    t0 = skv__now_ms();
    PE_CHECK(skv__store_wait_ge(pe.st, "ge", 10, 10000) == 0, "wait_ge");
    int64_t now = 0;
    PE_CHECK(skv__store_add(pe.st, "ge", 0, &now) == 0 && now >= 10, "counter %lld",
             (long long)now);
    PE_CHECK(skv__store_wait_ge(pe.st, "ge", 11, 200) == SKV_ETIMEDOUT,
             "wait_ge past the final value");
    PE_CHECK(strstr(skv_last_error(), "is 10"), "message: %s", skv_last_error());
  } else {
    char key[16];
    skv_test_sleep_ms(100 * rank);
    snprintf(key, sizeof key, "w/%d", rank);
    PE_CHECK(skv__store_set(pe.st, key, "x", 1) == 0, "set");
    skv_test_sleep_ms(100);
    PE_CHECK(skv__store_add(pe.st, "ge", 5, NULL) == 0, "add");
  }
  LEAVE(&pe);
  return 0;
}

Test(store, wait_and_wait_ge) {
  RUN_JOB(3, pe_wait, NULL, 30000);
}

static int pe_barrier(int rank, int npes, void *arg) {
  pe_t pe;
  JOIN(&pe, rank, npes);
  char name[32];
  for (int i = 0; i < 100; i++) {
    PE_CHECK(skv__store_add(pe.st, "arrivals", 1, NULL) == 0, "add");
    snprintf(name, sizeof name, "b/%d", i);
    PE_CHECK(skv__store_barrier(pe.st, name, 20000) == 0, "barrier %d", i);
    int64_t seen = 0;
    PE_CHECK(skv__store_add(pe.st, "arrivals", 0, &seen) == 0, "read");
    /* everyone arrived at barrier i; nobody can be past barrier i+1 */
    PE_CHECK(seen >= (int64_t)npes * (i + 1) && seen <= (int64_t)npes * (i + 2),
             "barrier %d let rank %d "
             "through with %lld arrivals of %d PEs",
             i, rank, (long long)seen, npes);
  }
  PE_CHECK(skv__store_barrier(pe.st, "b/0", 1000) == SKV_EMISMATCH,
           "a reused barrier name is caught");
  LEAVE(&pe);
  return 0;
}

ParameterizedTestParameters(store, barrier_100_times) {
  static int n[] = {2, 3, 4, 5, 6, 7, 8};
  return cr_make_param_array(int, n, sizeof n / sizeof n[0]);
}

ParameterizedTest(int *npes, store, barrier_100_times, .timeout = 60) {
  RUN_JOB(*npes, pe_barrier, NULL, 50000);
}

static void contribution(int rank, int round, uint8_t *buf, size_t n) {
  uint64_t s = 0x5eed0000u + (uint64_t)rank * 131u + (uint64_t)round;
  skv_test_fill_random(buf, n, &s);
}

static int pe_allgather(int rank, int npes, void *arg) {
  pe_t pe;
  JOIN(&pe, rank, npes);
  static const size_t sizes[] = {1, 8, 1001, 65536 + 3, 256 << 10};
  for (int round = 0; round < 5; round++) {
    size_t n = sizes[round];
    uint8_t *in = malloc(n), *out = malloc(n * (size_t)npes), *want = malloc(n);
    PE_CHECK(in && out && want, "malloc");
    contribution(rank, round, in, n);
    memset(out, 0xcc, n * (size_t)npes);
    char name[32];
    snprintf(name, sizeof name, "ag/%d", round);
    PE_CHECK(skv__store_allgather(pe.st, name, in, out, n, 20000) == 0, "allgather %zu bytes", n);
    for (int r = 0; r < npes; r++) {
      contribution(r, round, want, n);
      PE_CHECK(memcmp(out + (size_t)r * n, want, n) == 0,
               "slot %d of round %d (%zu bytes) is wrong", r, round, n);
    }
    free(in);
    free(out);
    free(want);
  }
  LEAVE(&pe);
  return 0;
}

ParameterizedTestParameters(store, allgather) {
  static int n[] = {2, 3, 4, 5, 6, 7, 8};
  return cr_make_param_array(int, n, sizeof n / sizeof n[0]);
}

ParameterizedTest(int *npes, store, allgather, .timeout = 60) {
  RUN_JOB(*npes, pe_allgather, NULL, 50000);
}

/* A PE killed mid-barrier: the others fail with SKV_EPEERDEAD quickly, not at the timeout. */
static int pe_killed(int rank, int npes, void *arg) {
  pe_t pe;
  JOIN(&pe, rank, npes);
  PE_CHECK(skv__store_barrier(pe.st, "start", 20000) == 0, "start");
  if (rank == 2) {
    skv_test_sleep_ms(200);
    raise(SIGKILL);
  }
  uint64_t t0 = skv__now_ms();
  int rc = skv__store_barrier(pe.st, "mid", 8000);
  uint64_t dt = skv__now_ms() - t0;
  PE_CHECK(rc == SKV_EPEERDEAD || rc == SKV_ETIMEDOUT, "barrier returned %s", skv_err_name(rc));
  PE_CHECK(rc == SKV_EPEERDEAD, "the server saw rank 2 die, want SKV_EPEERDEAD, got %s",
           skv_err_name(rc));
  PE_CHECK(dt < 5000, "failing took %llu ms", (unsigned long long)dt);
  PE_CHECK(strstr(skv_last_error(), "rank 2 disconnected"), "message: %s", skv_last_error());
  PE_CHECK(pe_leave(&pe, false) == 0, "leave");
  return 0;
}

Test(store, killed_pe_fails_barrier_with_peerdead) {
  skv_test_job_t job;
  skv_test_run(&job, 4, pe_killed, NULL, 30000);
  cr_assert_eq(job.status[2], 128 + SIGKILL, "%s", skv_test_statuses(&job));
  for (int r = 0; r < 4; r++)
    if (r != 2) cr_assert_eq(job.status[r], 0, "%s", skv_test_statuses(&job));
}

/* The PE running the store is killed: the others see the connection drop at once. */
static int pe_server_killed(int rank, int npes, void *arg) {
  pe_t pe;
  JOIN(&pe, rank, npes);
  PE_CHECK(skv__store_barrier(pe.st, "start", 20000) == 0, "start");
  if (rank == 0) {
    skv_test_sleep_ms(200);
    raise(SIGKILL);
  }
  uint64_t t0 = skv__now_ms();
  int rc = skv__store_barrier(pe.st, "mid", 8000);
  uint64_t dt = skv__now_ms() - t0;
  PE_CHECK(rc == SKV_ECONN, "barrier returned %s", skv_err_name(rc));
  PE_CHECK(dt < 5000, "failing took %llu ms", (unsigned long long)dt);
  t0 = skv__now_ms();
  PE_CHECK(skv__store_set(pe.st, "k", "v", 1) == SKV_ECONN, "later calls fail");
  PE_CHECK(skv__now_ms() - t0 < 100, "and fail fast");
  PE_CHECK(skv__store_close(pe.st) == 0, "close of a broken connection");
  return 0;
}

Test(store, killed_server_pe_fails_others_with_econn) {
  skv_test_job_t job;
  skv_test_run(&job, 3, pe_server_killed, NULL, 30000);
  cr_assert_eq(job.status[0], 128 + SIGKILL, "%s", skv_test_statuses(&job));
  cr_assert(job.status[1] == 0 && job.status[2] == 0, "%s", skv_test_statuses(&job));
}

/* A stopped PE: the others time out (SKV_ETIMEDOUT) at the barrier's timeout. */
static int pe_stopped(int rank, int npes, void *arg) {
  pe_t pe;
  JOIN(&pe, rank, npes);
  int pid = (int)getpid();
  char key[16];
  snprintf(key, sizeof key, "pid/%d", rank);
  PE_CHECK(skv__store_set(pe.st, key, &pid, sizeof pid) == 0, "pid");
  PE_CHECK(skv__store_barrier(pe.st, "start", 20000) == 0, "start");
  if (rank == 2) {
    raise(SIGSTOP);
    PE_CHECK(skv__store_close(pe.st) == 0, "close after SIGCONT");
    return 0;
  }
  uint64_t t0 = skv__now_ms();
  int rc = skv__store_barrier(pe.st, "mid", 1500);
  uint64_t dt = skv__now_ms() - t0;
  PE_CHECK(rc == SKV_ETIMEDOUT, "barrier returned %s", skv_err_name(rc));
  PE_CHECK(dt >= 1400 && dt < 4000, "timed out after %llu ms, want ~1500", (unsigned long long)dt);
  PE_CHECK(strstr(skv_last_error(), "is 2, waiting for 3"), "message: %s", skv_last_error());
  if (rank == 1) {
    void *v = NULL;
    size_t len = 0;
    PE_CHECK(skv__store_get(pe.st, "pid/2", &v, &len, 1000) == 0 && len == sizeof(int), "pid of 2");
    memcpy(&pid, v, sizeof pid);
    free(v);
    PE_CHECK(kill(pid, SIGCONT) == 0, "SIGCONT");
  }
  PE_CHECK(pe_leave(&pe, false) == 0, "leave");
  return 0;
}

Test(store, stopped_pe_makes_barrier_time_out) {
  RUN_JOB(3, pe_stopped, NULL, 30000);
}

/* The PE running the store is stopped: the client gives up after timeout + grace. */
static int pe_server_stopped(int rank, int npes, void *arg) {
  pe_t pe;
  JOIN(&pe, rank, npes);
  int pid = (int)getpid();
  PE_CHECK(skv__store_set(pe.st, rank ? "pid/1" : "pid/0", &pid, sizeof pid) == 0, "pid");
  PE_CHECK(skv__store_barrier(pe.st, "start", 20000) == 0, "start");
  void *v = NULL;
  size_t len = 0;
  if (rank == 0) {
    /* stop only once rank 1 is past the barrier (its reply may still be on the way) */
    PE_CHECK(skv__store_get(pe.st, "past", &v, &len, 10000) == 0, "rank 1 past the barrier");
    free(v);
    raise(SIGSTOP);
    PE_CHECK(pe_leave(&pe, false) == 0, "leave after SIGCONT");
    return 0;
  }
  PE_CHECK(skv__store_get(pe.st, "pid/0", &v, &len, 1000) == 0 && len == sizeof(int), "pid of 0");
  memcpy(&pid, v, sizeof pid);
  free(v);
  PE_CHECK(skv__store_set(pe.st, "past", "1", 1) == 0, "past");
  skv_test_sleep_ms(300);
  uint64_t t0 = skv__now_ms();
  int rc = skv__store_barrier(pe.st, "mid", 1000);
  uint64_t dt = skv__now_ms() - t0;
  PE_CHECK(rc == SKV_ETIMEDOUT, "barrier returned %s", skv_err_name(rc));
  PE_CHECK(dt >= 2900 && dt < 5000, "gave up after %llu ms, want ~3000 (1000 + grace)",
           (unsigned long long)dt);
  PE_CHECK(strstr(skv_last_error(), "no reply"), "message: %s", skv_last_error());
  t0 = skv__now_ms();
  PE_CHECK(skv__store_set(pe.st, "k", "v", 1) == SKV_ECONN, "a broken connection fails fast");
  PE_CHECK(skv__now_ms() - t0 < 100, "fast");
  PE_CHECK(kill(pid, SIGCONT) == 0, "SIGCONT");
  PE_CHECK(skv__store_close(pe.st) == 0, "close");
  return 0;
}

Test(store, stopped_server_pe_times_out_clients) {
  RUN_JOB(2, pe_server_stopped, NULL, 30000);
}

/* ---- fd passing ---------------------------------------------------------------------------------
 */

#define FD_BYTES 8192

static void fd_content(int rank, int round, uint8_t *buf) {
  uint64_t s = 0xfd000000u + (uint64_t)rank * 7919u + (uint64_t)round;
  skv_test_fill_random(buf, FD_BYTES, &s);
  snprintf((char *)buf, 32, "pe %d round %d", rank, round);
}

/* One exchange among the PEs listed in ranks[]; checks every peer's file and that the fds
 * name the same files (a write through a peer's fd shows in the peer's own). */
static int do_exchange(pe_t *pe, const char *tag, const int *ranks, int nlocal, int me, int round) {
  uint8_t mine[FD_BYTES], want[FD_BYTES], got[FD_BYTES];
  int fd = memfd_create("skv-test", MFD_CLOEXEC);
  PE_CHECK(fd >= 0, "memfd");
  fd_content(ranks[me], round, mine);
  PE_CHECK(pwrite(fd, mine, FD_BYTES, 0) == FD_BYTES, "write");
  int peer_fds[SKV_TEST_MAX_PES];
  PE_CHECK(skv__fd_exchange(pe->st, tag, ranks, nlocal, me, fd, peer_fds, 10000) == 0,
           "exchange %s", tag);
  for (int i = 0; i < nlocal; i++) {
    PE_CHECK(peer_fds[i] >= 0 && peer_fds[i] != fd, "fd of local PE %d is %d", i, peer_fds[i]);
    fd_content(ranks[i], round, want);
    PE_CHECK(pread(peer_fds[i], got, FD_BYTES, 0) == FD_BYTES, "read local PE %d", i);
    PE_CHECK(memcmp(got, want, FD_BYTES) == 0, "content of local PE %d is wrong: '%.20s'", i,
             (char *)got);
    uint8_t mark = (uint8_t)(0xa0 + me);
    PE_CHECK(pwrite(peer_fds[i], &mark, 1, FD_BYTES + me) == 1, "write through local PE %d's fd",
             i);
  }
  char name[64];
  snprintf(name, sizeof name, "%s/written/%d", tag, ranks[0]);
  PE_CHECK(skv__store_add(pe->st, name, 1, NULL) == 0, "add");
  PE_CHECK(skv__store_wait_ge(pe->st, name, nlocal, 10000) == 0, "wait");
  for (int i = 0; i < nlocal; i++) {
    uint8_t mark = 0;
    PE_CHECK(pread(fd, &mark, 1, FD_BYTES + i) == 1 && mark == 0xa0 + i,
             "local PE %d's write not seen", i);
  }
  for (int i = 0; i < nlocal; i++) close(peer_fds[i]);
  close(fd);
  return 0;
}

/* Run exchange `tag` of local PEs {0, 1} (rank 1 has already done something bad to PE 0, whose
 * log goes to cap_sink): it succeeds, leaks no descriptor, and PE 0 logged `report`. */
static int exchange_reports(pe_t *pe, const char *tag, int rank, int round, const char *report) {
  int ranks[2] = {0, 1};
  int before = count_fds();
  if (do_exchange(pe, tag, ranks, 2, rank, round)) return 1;
  PE_CHECK(count_fds() == before, "fds leaked: %d -> %d", before, count_fds());
  if (rank == 0) {
    skv_log_set_sink(NULL, NULL);
    PE_CHECK(cap_has(report), "PE 0 did not report \"%s\":\n%s", report, cap_buf);
  }
  return 0;
}

static int pe_fdpass(int rank, int npes, void *arg) {
  pe_t pe;
  JOIN(&pe, rank, npes);
  int ranks[SKV_TEST_MAX_PES];
  for (int i = 0; i < npes; i++) ranks[i] = i;
  /* rank 0's count includes the server's connections: count once every PE has joined */
  PE_CHECK(skv__store_barrier(pe.st, "joined", 20000) == 0, "joined");
  int before = count_fds();
  for (int round = 0; round < 3; round++) {
    char tag[32];
    snprintf(tag, sizeof tag, "fx/%d", round);
    if (do_exchange(&pe, tag, ranks, npes, rank, round)) return 1;
  }
  PE_CHECK(count_fds() == before, "fds leaked: %d -> %d", before, count_fds());
  LEAVE(&pe);
  return 0;
}

ParameterizedTestParameters(fdpass, exchange) {
  static int n[] = {2, 3, 4, 5, 6, 7, 8};
  return cr_make_param_array(int, n, sizeof n / sizeof n[0]);
}

ParameterizedTest(int *npes, fdpass, exchange, .timeout = 60) {
  RUN_JOB(*npes, pe_fdpass, NULL, 50000);
}

/* Two "nodes" on one host: PEs {0, 2} and {1, 3} exchange under the same tag at once. */
static int pe_fdpass_groups(int rank, int npes, void *arg) {
  pe_t pe;
  JOIN(&pe, rank, npes);
  int ranks[2] = {rank % 2, rank % 2 + 2};
  if (do_exchange(&pe, "grp", ranks, 2, rank / 2, 7)) return 1;
  int one = rank;
  int solo = memfd_create("solo", MFD_CLOEXEC), out = -1;
  PE_CHECK(skv__fd_exchange(pe.st, "solo", &one, 1, 0, solo, &out, 1000) == 0 && out >= 0 &&
               out != solo,
           "an exchange of one PE is a dup");
  close(out);
  close(solo);
  LEAVE(&pe);
  return 0;
}

Test(fdpass, two_groups_same_tag) {
  RUN_JOB(4, pe_fdpass_groups, NULL, 30000);
}

/* The socket of local PE `index` in exchange `tag` among `nlocal` PEs whose local PE 0 is rank 0,
 * from the store as a peer reads it (the nonce, then one random name per PE): its address and
 * length, and the nonce; 0 when the store has no such exchange within 10 s. */
static socklen_t exchange_socket(skv__store_t *st, const char *tag, int nlocal, int index,
                                 uint8_t nonce[16], struct sockaddr_un *a) {
  char key[64];
  snprintf(key, sizeof key, "%s/nonce/0", tag);
  void *v = NULL;
  size_t len = 0;
  if (skv__store_get(st, key, &v, &len, 10000) != 0 || len != 16u * ((size_t)nlocal + 1)) {
    free(v);
    return 0;
  }
  const uint8_t *name = (const uint8_t *)v + 16 * (index + 1);
  memcpy(nonce, v, 16);
  memset(a, 0, sizeof *a);
  a->sun_family = AF_UNIX;
  int n = snprintf(a->sun_path + 1, sizeof a->sun_path - 1, "symkv/");
  for (int i = 0; i < 16; i++) n += snprintf(a->sun_path + 1 + n, 3, "%02x", name[i]);
  free(v);
  return (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + (size_t)n);
}

/* An intruder that knows the socket name but not the nonce is dropped; the exchange goes on. */
typedef struct intruder {
  skv__store_t *st;
  int ok;
} intruder_t;

static void *intruder_main(void *arg) {
  intruder_t *in = arg;
  struct sockaddr_un a;
  uint8_t nonce[16];
  socklen_t alen = exchange_socket(in->st, "intr", 2, 0, nonce, &a);
  if (!alen) return NULL;
  int s = -1;
  for (int i = 0; i < 2000; i++) {
    s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (connect(s, (struct sockaddr *)&a, alen) == 0) break;
    close(s);
    s = -1;
    skv_test_sleep_ms(2);
  }
  if (s < 0) return NULL;
  /* a header of the right size with a wrong nonce, and an fd attached */
  uint8_t hdr[40];
  memset(hdr, 0, sizeof hdr);
  uint32_t magic = 0x464b5653u, ver = 1;
  int32_t idx = 1, rank = 1;
  memcpy(hdr, &magic, 4);
  memcpy(hdr + 4, &ver, 4);
  memcpy(hdr + 24, &idx, 4);
  memcpy(hdr + 28, &rank, 4);
  int bogus = memfd_create("bogus", MFD_CLOEXEC);
  union {
    char buf[CMSG_SPACE(sizeof(int))];
    struct cmsghdr align;
  } u;
  memset(&u, 0, sizeof u);
  struct iovec iov = {.iov_base = hdr, .iov_len = 32};
  struct msghdr m = {
      .msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf, .msg_controllen = sizeof u.buf};
  struct cmsghdr *cm = CMSG_FIRSTHDR(&m);
  cm->cmsg_level = SOL_SOCKET;
  cm->cmsg_type = SCM_RIGHTS;
  cm->cmsg_len = CMSG_LEN(sizeof(int));
  memcpy(CMSG_DATA(cm), &bogus, sizeof bogus);
  in->ok = sendmsg(s, &m, MSG_NOSIGNAL) == 32;
  close(bogus);
  close(s);
  skv__store_set(in->st, "intr/sent", "1", 1);
  return NULL;
}

static int pe_intruder(int rank, int npes, void *arg) {
  pe_t pe;
  JOIN(&pe, rank, npes);
  /* rank 0's fd count includes the server's connections: count once every PE has joined */
  PE_CHECK(skv__store_barrier(pe.st, "joined", 20000) == 0, "joined");
  if (rank == 1) {
    intruder_t in = {pe.st, 0};
    pthread_t th;
    PE_CHECK(pthread_create(&th, NULL, intruder_main, &in) == 0, "thread");
    pthread_join(th, NULL);
    PE_CHECK(in.ok, "the intruder could not send");
  } else {
    skv_log_set_sink(cap_sink, NULL);
  }
  if (exchange_reports(&pe, "intr", rank, 3, "not a peer of this exchange")) return 1;
  LEAVE(&pe);
  return 0;
}

Test(fdpass, intruder_without_nonce_is_dropped) {
  RUN_JOB(2, pe_intruder, NULL, 30000);
}

/* A PE that dies after the ready barrier (it arrived, then exited without BYE): the others fail
 * with SKV_EPEERDEAD at once, not after the exchange's timeout. Mode 0: it dies at once, so the
 * others cannot connect to it. Mode 1: it listens and dies a second later, after the others
 * sent to it, while they wait for its descriptor. */
static int pe_fd_dead_peer(int rank, int npes, void *arg) {
  int mode = *(int *)arg;
  pe_t pe;
  JOIN(&pe, rank, npes);
  int ranks[SKV_TEST_MAX_PES];
  for (int i = 0; i < npes; i++) ranks[i] = i;
  if (rank == 1) { /* steps 1 to 3 of the protocol, then gone */
    struct sockaddr_un a;
    uint8_t nonce[16];
    socklen_t alen = exchange_socket(pe.st, "dead", npes, 1, nonce, &a);
    PE_CHECK(alen > 0, "nonce and names");
    int l = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    PE_CHECK(mode == 0 || (bind(l, (struct sockaddr *)&a, alen) == 0 && listen(l, 16) == 0),
             "listen: %s", strerror(errno));
    /* arrive last, so that the others pass the barrier before this PE is gone */
    PE_CHECK(skv__store_wait_ge(pe.st, "dead/ready/0", npes - 1, 20000) == 0, "others ready");
    PE_CHECK(skv__store_add(pe.st, "dead/ready/0", 1, NULL) == 0, "ready");
    if (mode == 1) skv_test_sleep_ms(1000);
    _exit(0);
  }
  skv_log_set_level(SKV_LOG_NONE, SKV_SUBSYS_ALL);
  int fd = memfd_create("skv-test", MFD_CLOEXEC), peer_fds[SKV_TEST_MAX_PES];
  PE_CHECK(fd >= 0, "memfd");
  uint64_t t0 = skv__now_ms();
  int rc = skv__fd_exchange(pe.st, "dead", ranks, npes, rank, fd, peer_fds, 8000);
  uint64_t dt = skv__now_ms() - t0;
  PE_CHECK(rc == SKV_EPEERDEAD, "rank %d: expected SKV_EPEERDEAD, got %s after %llu ms", rank,
           skv_err_name(rc), (unsigned long long)dt);
  PE_CHECK(dt < 4000, "rank %d failed after %llu ms, the timeout was 8000", rank,
           (unsigned long long)dt);
  PE_CHECK(strstr(skv_last_error(), "rank 1"), "rank %d: message: %s", rank, skv_last_error());
  for (int i = 0; i < npes; i++) PE_CHECK(peer_fds[i] == -1, "peer_fds[%d] left open", i);
  close(fd);
  PE_CHECK(pe_leave(&pe, false) == 0, "leave");
  return 0;
}

Test(fdpass, dead_peer_fails_the_others_promptly) {
  for (int mode = 0; mode < 2; mode++) RUN_JOB(4, pe_fd_dead_peer, &mode, 40000);
}

/* A PE that fails after the ready barrier (local PE 0 here, out of descriptors when it opens the
 * socket to send its own) tells its peers through the store before it stops listening: they fail
 * at once with its code and a message naming it, never with SKV_EPEERDEAD (every rank lives),
 * nor after the exchange's timeout. */
static int pe_fail_after_ready(int rank, int npes, void *arg) {
  pe_t pe;
  JOIN(&pe, rank, npes);
  PE_CHECK(skv__store_barrier(pe.st, "joined", 20000) == 0, "joined");
  skv_log_set_level(SKV_LOG_NONE, SKV_SUBSYS_ALL);
  int ranks[SKV_TEST_MAX_PES], peer_fds[SKV_TEST_MAX_PES];
  for (int i = 0; i < npes; i++) ranks[i] = i;
  int fd = memfd_create("skv-test", MFD_CLOEXEC);
  PE_CHECK(fd >= 0, "memfd");
  struct rlimit was;
  if (rank == 0) /* one descriptor left: the listening socket gets it */
    PE_CHECK(skv_test_limit_fds(1, &was) == 0, "limit: %s", strerror(errno));
  uint64_t t0 = skv__now_ms();
  int rc = skv__fd_exchange(pe.st, "late", ranks, npes, rank, fd, peer_fds, 8000);
  uint64_t dt = skv__now_ms() - t0;
  if (rank == 0) PE_CHECK(setrlimit(RLIMIT_NOFILE, &was) == 0, "restore the limit");
  PE_CHECK(rc == -EMFILE, "rank %d: expected rank 0's EMFILE, got %s after %llu ms: %s", rank,
           skv_err_name(rc), (unsigned long long)dt, skv_last_error());
  PE_CHECK(dt < 4000, "rank %d failed after %llu ms, the timeout was 8000", rank,
           (unsigned long long)dt);
  if (rank != 0)
    PE_CHECK(strstr(skv_last_error(), "(rank 0) failed"), "rank %d: message: %s", rank,
             skv_last_error());
  for (int i = 0; i < npes; i++) PE_CHECK(peer_fds[i] == -1, "peer_fds[%d] left open", i);
  close(fd);
  LEAVE(&pe);
  return 0;
}

Test(fdpass, failure_after_the_barrier_is_announced) {
  RUN_JOB(3, pe_fail_after_ready, NULL, 40000);
}

/* Connect to local PE 0 of exchange `tag` as a stranger that knows the nonce (read from the
 * store): a connected unix socket, or -1. */
static int connect_to_pe0(skv__store_t *st, const char *tag, uint8_t nonce[16]) {
  struct sockaddr_un a;
  socklen_t alen = exchange_socket(st, tag, 2, 0, nonce, &a);
  if (!alen) return -1;
  for (int i = 0; i < 2000; i++) {
    int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (connect(s, (struct sockaddr *)&a, alen) == 0) return s;
    close(s);
    skv_test_sleep_ms(2);
  }
  return -1;
}

/* A header that is right in every field (it claims to be local PE 1, rank 1) but carries two
 * descriptors is dropped, both are closed, and the real PE 1's descriptor is used. */
static int pe_two_fds(int rank, int npes, void *arg) {
  pe_t pe;
  JOIN(&pe, rank, npes);
  PE_CHECK(skv__store_barrier(pe.st, "joined", 20000) == 0, "joined");
  if (rank == 1) {
    uint8_t nonce[16];
    int s = connect_to_pe0(pe.st, "twofd", nonce);
    PE_CHECK(s >= 0, "could not connect to PE 0");
    uint8_t hdr[32];
    uint32_t magic = 0x464b5653u, ver = 1;
    int32_t idx = 1, rk = 1;
    memcpy(hdr, &magic, 4);
    memcpy(hdr + 4, &ver, 4);
    memcpy(hdr + 8, nonce, 16);
    memcpy(hdr + 24, &idx, 4);
    memcpy(hdr + 28, &rk, 4);
    int bogus[2] = {memfd_create("bogus", MFD_CLOEXEC), memfd_create("bogus", MFD_CLOEXEC)};
    union {
      char buf[CMSG_SPACE(sizeof bogus)];
      struct cmsghdr align;
    } u;
    memset(&u, 0, sizeof u);
    struct iovec iov = {.iov_base = hdr, .iov_len = sizeof hdr};
    struct msghdr m = {
        .msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf, .msg_controllen = sizeof u.buf};
    struct cmsghdr *cm = CMSG_FIRSTHDR(&m);
    cm->cmsg_level = SOL_SOCKET;
    cm->cmsg_type = SCM_RIGHTS;
    cm->cmsg_len = CMSG_LEN(sizeof bogus);
    memcpy(CMSG_DATA(cm), bogus, sizeof bogus);
    PE_CHECK(sendmsg(s, &m, MSG_NOSIGNAL) == (ssize_t)sizeof hdr, "send: %s", strerror(errno));
    close(bogus[0]);
    close(bogus[1]);
    close(s);
  } else {
    skv_log_set_sink(cap_sink, NULL);
  }
  if (exchange_reports(&pe, "twofd", rank, 4, "not exactly one fd")) return 1;
  LEAVE(&pe);
  return 0;
}

Test(fdpass, header_with_two_fds_is_dropped) {
  RUN_JOB(2, pe_two_fds, NULL, 30000);
}

/* A same-user connection that sends nothing is dropped after a while; the exchange goes on
 * (it does not wait for it until the exchange's own timeout). */
static int pe_silent(int rank, int npes, void *arg) {
  pe_t pe;
  JOIN(&pe, rank, npes);
  PE_CHECK(skv__store_barrier(pe.st, "joined", 20000) == 0, "joined");
  int s = -1;
  if (rank == 1) {
    uint8_t nonce[16];
    s = connect_to_pe0(pe.st, "silent", nonce); /* held open, silent, until the end */
    PE_CHECK(s >= 0, "could not connect to PE 0");
  } else {
    skv_log_set_sink(cap_sink, NULL);
  }
  if (exchange_reports(&pe, "silent", rank, 5, "sent no complete header")) return 1;
  if (s >= 0) close(s);
  LEAVE(&pe);
  return 0;
}

Test(fdpass, silent_connection_is_dropped) {
  RUN_JOB(2, pe_silent, NULL, 30000);
}
