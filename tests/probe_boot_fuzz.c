/* Probe: a fuzzer of the bootstrap store. Random and malformed frames from many connections
 * against a live store (this process), while a PE checks that the store keeps answering. */
#define _GNU_SOURCE
#include "bootstrap/proto.h"
#include "skv_test.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

/* How it works
 *
 * One store serves NRANKS ranks with a known token. A PE (rank 0, the real client) stays
 * connected and, every PROBE_EVERY frames, makes a round trip (SET then TRY_GET of a key only it
 * writes); the slowest round trip is the hang detector. CONNS raw sockets are driven in turn:
 * each is either a stranger (garbage before HELLO: random bytes, lengths of 0 or past the limits,
 * truncated or mutated HELLOs, wrong tokens and versions; one frame, then the store must close
 * it) or a session (a correct HELLO of rank 1..NRANKS-1, then up to 300 frames: requests of
 * every opcode with random fields, some malformed on purpose, blocking ones with short timeouts;
 * it ends with BYE, an abrupt close, or a malformed frame that makes the store close it). Replies
 * are read without ever blocking. Counted: frames sent, connections, replies; a crash is the
 * process dying (ASan in the sanitizer build), a hang a round trip over HANG_MS or the run over
 * its time budget. */

#define CONNS       24
#define NRANKS      (CONNS + 1) /* rank 0 is the PE, rank i + 1 the sessions of connection i */
#define KEYSPACE    512
#define PROBE_EVERY 2000
#define HANG_MS     5000
#define TOKEN       "probe-fuzz-token"

typedef struct raw {
  int fd;
  int left;     /* frames left in this session; 0: closed */
  bool session; /* said HELLO */
  int rank;
} raw_t;

static uint64_t rng;
static uint64_t frames, conns, sessions, replies, closed_by_store;

static uint64_t rnd(uint64_t n) {
  return n ? skv_test_rand(&rng) % n : 0;
}

static int raw_open(int port) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
    close(fd);
    return -1;
  }
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  conns++;
  return fd;
}

/* Read whatever replies are there; false once the store closed the connection. */
static bool drain(int fd) {
  static uint8_t buf[1 << 16];
  for (;;) {
    ssize_t r = recv(fd, buf, sizeof buf, MSG_DONTWAIT);
    if (r > 0) {
      replies++;
      continue;
    }
    if (r == 0 || (errno != EAGAIN && errno != EINTR)) return false;
    return true;
  }
}

static bool send_all(int fd, const void *p, size_t n) {
  const uint8_t *q = p;
  while (n > 0) {
    ssize_t w = send(fd, q, n, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w > 0) {
      q += w;
      n -= (size_t)w;
      continue;
    }
    if (w < 0 && errno == EINTR) continue;
    if (w < 0 && errno == EAGAIN) {
      if (!drain(fd)) return false; /* the store may wait for us to read its replies */
      struct pollfd pf = {.fd = fd, .events = POLLOUT};
      if (poll(&pf, 1, 1000) <= 0) return false; /* never wait long: a stuck store shows as such */
      continue;
    }
    return false;
  }
  return true;
}

static void rand_key(skv__frame_t *f) {
  char k[64];
  int n = snprintf(k, sizeof k, "fz/%llu", (unsigned long long)rnd(KEYSPACE));
  if (rnd(50) == 0) { /* lengths at and past the limits */
    uint16_t kl = (uint16_t)(rnd(3) == 0 ? 0 : SKV_BOOT_MAX_KEY + rnd(3));
    skv__frame_u16(f, kl);
    for (uint16_t i = 0; i < kl; i++) skv__frame_u8(f, (uint8_t)('a' + i % 26));
    return;
  }
  skv__frame_u16(f, (uint16_t)n);
  skv__frame_put(f, k, (size_t)n);
}

static void rand_bytes(skv__frame_t *f, size_t n) {
  for (size_t i = 0; i < n; i++) skv__frame_u8(f, (uint8_t)rnd(256));
}

/* One request of a session: every opcode with random fields (HELLO and BYE, which end it, rarely),
 * 1 in 30 malformed on purpose. */
static void rand_request(skv__frame_t *f) {
  static const uint8_t ops[20] = {
      SKV_BOOT_OP_SET,     SKV_BOOT_OP_SET,     SKV_BOOT_OP_SET,     SKV_BOOT_OP_SET,
      SKV_BOOT_OP_SET,     SKV_BOOT_OP_GET,     SKV_BOOT_OP_GET,     SKV_BOOT_OP_TRY_GET,
      SKV_BOOT_OP_TRY_GET, SKV_BOOT_OP_TRY_GET, SKV_BOOT_OP_ADD,     SKV_BOOT_OP_ADD,
      SKV_BOOT_OP_ADD,     SKV_BOOT_OP_WAIT,    SKV_BOOT_OP_WAIT_GE, SKV_BOOT_OP_WAIT_GE,
      SKV_BOOT_OP_DEL,     SKV_BOOT_OP_DEL,     SKV_BOOT_OP_HELLO,   SKV_BOOT_OP_BYE};
  uint8_t op = rnd(40) == 0 ? (uint8_t)rnd(256) : ops[rnd(20)];
  skv__frame_begin(f, op);
  switch (op) {
  case SKV_BOOT_OP_SET: {
    rand_key(f);
    size_t vl = rnd(1000) == 0 ? (size_t)rnd(1u << 20) : (size_t)rnd(256);
    skv__frame_u32(f, (uint32_t)vl);
    rand_bytes(f, vl);
    break;
  }
  case SKV_BOOT_OP_GET:
  case SKV_BOOT_OP_WAIT_GE:
    skv__frame_u32(f, rnd(20) == 0 ? (uint32_t)-1 : (uint32_t)rnd(20));
    rand_key(f);
    if (op == SKV_BOOT_OP_WAIT_GE) skv__frame_u64(f, rnd(8));
    break;
  case SKV_BOOT_OP_WAIT: {
    skv__frame_u32(f, (uint32_t)rnd(20));
    uint32_t nk = (uint32_t)rnd(4);
    skv__frame_u32(f, nk);
    for (uint32_t i = 0; i < nk; i++) rand_key(f);
    break;
  }
  case SKV_BOOT_OP_TRY_GET:
  case SKV_BOOT_OP_DEL:
    rand_key(f);
    break;
  case SKV_BOOT_OP_ADD:
    rand_key(f);
    skv__frame_u64(f, rnd(10) == 0 ? (uint64_t)INT64_MAX : rnd(5));
    break;
  case SKV_BOOT_OP_HELLO: /* a second HELLO: the store closes the connection */
    skv__frame_u32(f, SKV_BOOT_PROTO_VERSION);
    skv__frame_u32(f, 1);
    skv__frame_u32(f, NRANKS);
    break;
  default: /* BYE, or garbage after it */
    if (rnd(4) == 0) rand_bytes(f, 1 + rnd(8));
    break;
  }
  skv__frame_end(f);
  if (rnd(30) == 0 && f->len > SKV_BOOT_FRAME_HDR + 1) { /* mutate */
    switch (rnd(4)) {
    case 0: /* a flipped byte anywhere after the length */
      f->p[SKV_BOOT_FRAME_HDR + rnd(f->len - SKV_BOOT_FRAME_HDR)] ^= (uint8_t)(1 + rnd(255));
      break;
    case 1: /* a length one short or one long (the next frame starts in the wrong place) */
      skv__put_le32(f->p, (uint32_t)(f->len - SKV_BOOT_FRAME_HDR + (rnd(2) ? 1 : -1)));
      break;
    case 2: /* an unknown opcode */
      f->p[SKV_BOOT_FRAME_HDR] = (uint8_t)(10 + rnd(246));
      break;
    default: /* a huge length */
      skv__put_le32(f->p, SKV_BOOT_MAX_FRAME + 1 + (uint32_t)rnd(1000));
      break;
    }
  }
}

/* One frame of a stranger that never said HELLO. */
static void rand_stranger(skv__frame_t *f) {
  switch (rnd(7)) {
  case 0: /* random bytes */
    f->len = 0;
    f->failed = false;
    rand_bytes(f, 1 + rnd(300));
    break;
  case 1: /* a zero or oversized length */
    f->len = 0;
    skv__frame_u32(f, rnd(2) ? 0 : SKV_BOOT_PRE_HELLO_MAX_FRAME + 1 + (uint32_t)rnd(1u << 20));
    rand_bytes(f, rnd(16));
    break;
  case 2: /* a wrong token */
    skv__frame_hello(f, rnd(2) ? "not-the-token" : "probe-fuzz-tokeN", (int)rnd(NRANKS), NRANKS);
    break;
  case 3: /* the right token, another version or job size or rank */
    skv__frame_begin(f, SKV_BOOT_OP_HELLO);
    skv__frame_u32(f, rnd(2) ? SKV_BOOT_PROTO_VERSION : (uint32_t)rnd(100));
    skv__frame_u32(f, (uint32_t)rnd(2 * NRANKS) - 2);
    skv__frame_u32(f, rnd(2) ? NRANKS : (uint32_t)rnd(10));
    skv__frame_put(f, TOKEN, strlen(TOKEN));
    skv__frame_end(f);
    break;
  case 4: /* another request before HELLO */
    rand_request(f);
    break;
  case 5: /* a truncated HELLO (the connection is then closed by us) */
    skv__frame_hello(f, TOKEN, 1, NRANKS);
    f->len = 1 + rnd(f->len - 1);
    break;
  default: /* a HELLO with a mutated byte */
    skv__frame_hello(f, TOKEN, 1 + (int)rnd(NRANKS - 1), NRANKS);
    f->p[rnd(f->len)] ^= (uint8_t)(1 + rnd(255));
    break;
  }
}

static void raw_close(raw_t *r) {
  if (r->fd >= 0) close(r->fd);
  r->fd = -1;
  r->left = 0;
}

/* One step of connection r (index i): open it if closed, else send one frame. */
static void step(raw_t *r, int i, int port, skv__frame_t *f) {
  if (r->fd >= 0 && !drain(r->fd)) {
    closed_by_store++;
    raw_close(r);
  }
  if (r->fd < 0) {
    r->fd = raw_open(port);
    if (r->fd < 0) return;
    r->session = rnd(5) != 0;
    r->left = r->session ? 1 + (int)rnd(300) : 1;
    if (r->session) {
      r->rank = rnd(50) ? 1 + i : (int)rnd(NRANKS); /* sometimes a rank that is connected */
      skv__frame_hello(f, TOKEN, r->rank, NRANKS);
      sessions++;
      frames++;
      if (!send_all(r->fd, f->p, f->len)) raw_close(r);
      return;
    }
  }
  if (r->session)
    rand_request(f);
  else
    rand_stranger(f);
  frames++;
  if (f->failed || !send_all(r->fd, f->p, f->len)) {
    raw_close(r);
    return;
  }
  if (--r->left <= 0) {
    if (r->session && rnd(2)) { /* leave properly, half of the time */
      skv__frame_begin(f, SKV_BOOT_OP_BYE);
      skv__frame_end(f);
      frames++;
      (void)send_all(r->fd, f->p, f->len);
    }
    raw_close(r);
  }
}

int main(int argc, char **argv) {
  uint64_t want = 100000, budget_s = 600;
  rng = skv_test_seed();
  for (int i = 1; i + 1 < argc; i += 2) {
    if (strcmp(argv[i], "--frames") == 0) want = strtoull(argv[i + 1], NULL, 10);
    if (strcmp(argv[i], "--seed") == 0) rng = strtoull(argv[i + 1], NULL, 0);
    if (strcmp(argv[i], "--budget-s") == 0) budget_s = strtoull(argv[i + 1], NULL, 10);
  }
  const uint64_t seed = rng;
  printf("probe_boot_fuzz: seed %#llx (rerun with --seed), %llu frames\n", (unsigned long long)seed,
         (unsigned long long)want);
  fflush(stdout);
  skv_log_set_level(SKV_LOG_NONE, SKV_SUBSYS_ALL); /* the store's WARN lines are its business */
  skv__store_server_t *srv = NULL;
  if (skv__store_server_start("127.0.0.1", 0, TOKEN, NRANKS, &srv) != 0) {
    fprintf(stderr, "probe_boot_fuzz: cannot start the store: %s\n", skv_last_error());
    return 1;
  }
  int port = skv__store_server_port(srv);
  skv__store_t *pe = NULL;
  if (skv__store_connect("127.0.0.1", port, TOKEN, 0, NRANKS, 5000, &pe) != 0) {
    fprintf(stderr, "probe_boot_fuzz: the PE cannot connect: %s\n", skv_last_error());
    return 1;
  }
  raw_t raws[CONNS];
  for (int i = 0; i < CONNS; i++) raws[i] = (raw_t){-1, 0, false, 0};
  skv__frame_t f = {0};
  uint64_t t0 = skv__now_ms(), slowest = 0, probes = 0;
  int bad = 0;
  while (frames < want) {
    int i = (int)rnd(CONNS);
    step(&raws[i], i, port, &f);
    if (frames / PROBE_EVERY != probes) {
      probes = frames / PROBE_EVERY;
      uint64_t p0 = skv__now_ms();
      char v[32];
      int n = snprintf(v, sizeof v, "%llu", (unsigned long long)probes);
      void *got = NULL;
      size_t len = 0;
      int rc = skv__store_set(pe, "probe/alive", v, (size_t)n);
      if (rc == 0) rc = skv__store_try_get(pe, "probe/alive", &got, &len);
      if (rc != 0 || len != (size_t)n || memcmp(got, v, len) != 0) {
        fprintf(stderr, "probe_boot_fuzz: the store stopped serving the PE after %llu frames: %s\n",
                (unsigned long long)frames, skv_last_error());
        bad = 1;
        free(got);
        break;
      }
      free(got);
      slowest = SKV_MAX(slowest, skv__now_ms() - p0);
      if (slowest > HANG_MS) {
        fprintf(stderr, "probe_boot_fuzz: a round trip took %llu ms: the store hangs\n",
                (unsigned long long)slowest);
        bad = 1;
        break;
      }
    }
    if (skv__now_ms() - t0 > budget_s * 1000) {
      fprintf(stderr, "probe_boot_fuzz: %llu frames in %llu s, over the budget: a hang?\n",
              (unsigned long long)frames, (unsigned long long)budget_s);
      bad = 1;
      break;
    }
  }
  for (int i = 0; i < CONNS; i++) raw_close(&raws[i]);
  skv__frame_free(&f);
  double secs = (double)(skv__now_ms() - t0) / 1000.0;
  /* the PE still gets answers, leaves, and the store stops in time */
  if (!bad && skv__store_close(pe) != 0) {
    fprintf(stderr, "probe_boot_fuzz: BYE failed: %s\n", skv_last_error());
    bad = 1;
  }
  int stop = skv__store_server_stop(srv, 2000);
  if (!bad && stop != 0 && stop != SKV_ETIMEDOUT) bad = 1;
  printf("probe_boot_fuzz: %llu frames over %llu connections (%llu sessions after a good HELLO, "
         "%llu closed by the store) in %.1f s; %llu reads of replies; slowest PE round trip %llu "
         "ms; %s\n",
         (unsigned long long)frames, (unsigned long long)conns, (unsigned long long)sessions,
         (unsigned long long)closed_by_store, secs, (unsigned long long)replies,
         (unsigned long long)slowest, bad ? "FAILED" : "0 crashes, 0 hangs");
  return bad;
}
