/* symkv-bench progress (rank 0): a bar on the terminal, its own or symkv-run's, redrawn every
 * 0.1 s; where no terminal is at hand (a pipe, a log file), a line every few seconds. */
#define _GNU_SOURCE
#include "bench.h"

#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static struct {
  int fd;    /* -2: not opened yet, -1: no progress */
  bool bar;  /* a terminal: the bar; else lines */
  double t0; /* when this phase began */
  double last;
} P = {-2, false, 0, 0};

/* Under symkv-run the PEs' stderr is a pipe: draw on the launcher's terminal if it has one. */
static void progress_open(bench_t *b) {
  P.t0 = P.last = bench_now();
  P.bar = false;
  P.fd = -1;
  if (b->quiet || b->rank != 0) return;
  if (isatty(2)) {
    P.fd = 2;
    P.bar = true;
    return;
  }
  const char *pid = getenv("SKV_RUN_PID");
  if (pid) {
    char path[64];
    snprintf(path, sizeof path, "/proc/%s/fd/2", pid);
    int fd = open(path, O_WRONLY | O_NOCTTY | O_CLOEXEC);
    if (fd >= 0 && isatty(fd)) {
      P.fd = fd;
      P.bar = true;
      return;
    }
    if (fd >= 0) close(fd);
  }
  P.fd = 2; /* lines on stderr */
}

bool bench_progress_due(bench_t *b) {
  if (P.fd == -2) progress_open(b);
  if (P.fd < 0) return false;
  return bench_now() - P.last >= (P.bar ? 0.1 : b->progress_every);
}

void bench_progress_x(bench_t *b, const char *what, double done, double total, const char *unit,
                      const char *extra, bool force) {
  if (!force && !bench_progress_due(b)) return;
  if (P.fd < 0) return;
  P.last = bench_now();
  double pct = total > 0 ? 100.0 * done / total : 0.0;
  char line[320];
  int n;
  if (P.bar) {
    int width = 30, fill = total > 0 ? (int)(width * done / total) : 0;
    fill = fill < 0 ? 0 : fill > width ? width : fill;
    n = snprintf(line, sizeof line, "\r%-10s [%.*s%*s] %5.1f%% %.0f/%.0f%s%s", what, fill,
                 "##############################", width - fill, "", pct, done, total,
                 extra ? "  " : "", extra ? extra : "");
  } else {
    n = snprintf(line, sizeof line, "symkv-bench %s: %s %.0f/%.0f%s%s (%.1f%%), %.0f s%s%s\n",
                 b->cmd, what, done, total, unit ? " " : "", unit ? unit : "", pct, P.last - P.t0,
                 extra ? ", " : "", extra ? extra : "");
  }
  if (n > 0 && write(P.fd, line, (size_t)SKV_MIN(n, (int)sizeof line - 1)) < 0) P.fd = -1;
}

void bench_progress(bench_t *b, const char *what, double done, double total) {
  bench_progress_x(b, what, done, total, NULL, NULL, false);
}

void bench_progress_end(bench_t *b) {
  SKV_UNUSED(b);
  if (P.fd >= 0 && P.bar) {
    char blank[128];
    memset(blank, ' ', sizeof blank);
    blank[0] = '\r';
    blank[sizeof blank - 1] = '\r';
    if (write(P.fd, blank, sizeof blank) < 0) { /* nothing to do */
    }
  }
  if (P.fd > 2) close(P.fd);
  P.fd = -2; /* the next phase opens it again, with its own clock */
}
