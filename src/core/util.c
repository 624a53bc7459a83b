/* Small helpers shared by every layer: clocks, integer parsing, randomness, constant-time
 * comparison, byte formatting. */
#define _GNU_SOURCE
#include "core/core.h"

#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

int skv__thread_start(pthread_t *t, void *(*fn)(void *), void *arg) {
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  const int te = pthread_create(t, NULL, fn, arg);
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  return te;
}

uint64_t skv__now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

bool skv__parse_int(const char *s, long long lo, long long hi, bool allow_suffix, long long *out) {
  if (!s || !*s) return false;
  errno = 0;
  char *end = NULL;
  long long v = strtoll(s, &end, 10);
  if (errno || end == s) return false;
  if (allow_suffix && *end) {
    int shift = 0;
    switch (*end) {
    case 'k':
    case 'K':
      shift = 10;
      break;
    case 'm':
    case 'M':
      shift = 20;
      break;
    case 'g':
    case 'G':
      shift = 30;
      break;
    case 't':
    case 'T':
      shift = 40;
      break;
    default:
      return false;
    }
    end++;
    if (*end == 'i') end++;
    if (*end == 'B' || *end == 'b') end++;
    if (v > (LLONG_MAX >> shift) || v < (LLONG_MIN >> shift)) return false;
    v *= (1LL << shift);
  }
  if (*end) return false;
  if (v < lo || v > hi) return false;
  *out = v;
  return true;
}

int skv__random_bytes(void *buf, size_t n) {
  uint8_t *p = buf;
  while (n > 0) {
    ssize_t r = getrandom(p, n, 0);
    if (r < 0) {
      if (errno == EINTR) continue;
      return SKV_FAIL(-errno, SKV_SUBSYS_INIT, "getrandom failed: %s", strerror(errno));
    }
    p += r;
    n -= (size_t)r;
  }
  return 0;
}

bool skv__consttime_eq(const void *a, size_t alen, const void *b, size_t blen) {
  const volatile uint8_t *x = a, *y = b;
  size_t n = alen < blen ? alen : blen;
  uint8_t diff = (uint8_t)(alen != blen);
  for (size_t i = 0; i < n; i++) diff |= (uint8_t)(x[i] ^ y[i]);
  return diff == 0;
}

const char *skv__fmt_bytes(uint64_t bytes, char *buf, size_t cap) {
  static const char *units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  uint64_t v = bytes;
  while (u < 4 && v >= 1024 && v % 1024 == 0) {
    v /= 1024;
    u++;
  }
  if (u == 0 && bytes >= 1024) {
    double d = (double)bytes;
    while (u < 4 && d >= 1024) {
      d /= 1024;
      u++;
    }
    snprintf(buf, cap, "%.1f %s", d, units[u]);
  } else {
    snprintf(buf, cap, "%" PRIu64 " %s", v, units[u]);
  }
  return buf;
}

const char *skv__hostname(void) {
  static char host[256];
  static int done;
  if (!__atomic_load_n(&done, __ATOMIC_ACQUIRE)) {
    char h[256];
    if (gethostname(h, sizeof h) != 0) snprintf(h, sizeof h, "unknown");
    h[sizeof h - 1] = '\0';
    char *dot = strchr(h, '.');
    if (dot) *dot = '\0';
    memcpy(host, h, sizeof host);
    __atomic_store_n(&done, 1, __ATOMIC_RELEASE);
  }
  return host;
}

int skv__wait_fd(int fd, short ev, uint64_t deadline) {
  for (;;) {
    struct pollfd p = {.fd = fd, .events = ev};
    int rc = poll(&p, 1, skv__ms_left(deadline));
    if (rc > 0) return 0;
    if (rc == 0) return SKV_ETIMEDOUT;
    if (errno != EINTR) return -errno;
  }
}
