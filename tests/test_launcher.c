/* Tests of symkv-run: the real binary runs /bin/sh PEs; we check their environment, the
 * prefixed output, exit statuses, timeouts, signals and that stopped PEs take their children. */
#define _GNU_SOURCE
#include "skv_test.h"

#include <criterion/criterion.h>
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

/* An assertion that reports only when it fails: under --full-stats every passing cr_assert is
 * a message to the runner, too slow for checks made once per line of output. */
#define CHECK(cond, ...)                      \
  do {                                        \
    if (!(cond)) cr_assert_fail(__VA_ARGS__); \
  } while (0)

typedef struct launch {
  int status; /* exit status, 128 + signal if killed, -1 if we had to kill it (hung) */
  char *out;  /* its stdout and stderr, NUL-terminated */
  char *err;
  size_t out_len, err_len;
  double secs; /* from start to exit */
  pid_t pid;
  bool out_nonblock; /* watch_flags: its stdout was seen non-blocking while it ran */
} launch_t;

typedef struct buf {
  char *p;
  size_t len, cap;
} buf_t;

static void buf_add(buf_t *b, const char *p, size_t n) {
  if (b->len + n + 1 > b->cap) {
    b->cap = (b->len + n + 1) * 2;
    b->p = realloc(b->p, b->cap);
    CHECK(b->p, "out of memory");
  }
  memcpy(b->p + b->len, p, n);
  b->len += n;
  b->p[b->len] = '\0';
}

static const char *launcher_path(void) {
  static char path[PATH_MAX];
  const char *dir = getenv("SKV_TEST_BIN_DIR");
  cr_assert(dir && *dir, "SKV_TEST_BIN_DIR is not set: run this test through ctest");
  snprintf(path, sizeof path, "%s/symkv-run", dir);
  cr_assert(access(path, X_OK) == 0, "%s is not there (%s): build the symkv-run target", path,
            strerror(errno));
  return path;
}

typedef struct launch_opts {
  int timeout_ms;      /* kill the launcher after this (status -1) */
  int sig;             /* non-zero: send it to the launcher ... */
  int sig_after_lines; /* ... once its stdout holds this many lines, */
  int sig_after_ms;    /* ... or (when > 0) this long after the start */
  int stall_ms;        /* do not read its stdout for this long (-1: never) */
  bool merge;          /* its stderr goes to the stdout pipe */
  bool watch_flags;    /* keep the write end of its stdout and check O_NONBLOCK until it exits */
} launch_opts_t;

/* Run symkv-run with `args` (NULL-terminated, without argv[0]) as `o` says. */
static void launch_opts(launch_t *res, const char *const *args, const launch_opts_t *o) {
  int timeout_ms = o->timeout_ms, sig = o->sig, sig_after_lines = o->sig_after_lines;
  const char *path = launcher_path();
  const char *argv[64];
  int argc = 0;
  argv[argc++] = path;
  for (; args[argc - 1]; argc++) {
    cr_assert(argc < 63, "too many arguments");
    argv[argc] = args[argc - 1];
  }
  argv[argc] = NULL;

  int po[2], pe[2];
  cr_assert(pipe2(po, O_CLOEXEC) == 0 && pipe2(pe, O_CLOEXEC) == 0);
  fflush(stdout);
  fflush(stderr);
  uint64_t t0 = skv__now_ns();
  pid_t pid = fork();
  if (pid == 0) { /* no cr_* call here: the child must not talk to Criterion's runner */
    int nul = open("/dev/null", O_RDONLY);
    dup2(nul, 0);
    dup2(po[1], 1);
    dup2(o->merge ? po[1] : pe[1], 2);
    const int sigs[] = {SIGINT, SIGTERM, SIGHUP, SIGPIPE, SIGCHLD};
    for (size_t i = 0; i < SKV_ARRAY_LEN(sigs); i++) signal(sigs[i], SIG_DFL);
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    execv(path, (char *const *)argv);
    _exit(126);
  }
  cr_assert(pid > 0, "fork: %s", strerror(errno));
  int keep = o->watch_flags ? po[1] : -1; /* shares the open file with the launcher's stdout */
  if (keep < 0) close(po[1]);
  close(pe[1]);
  res->out_nonblock = false;
  buf_t out = {0}, err = {0};
  buf_add(&out, "", 0);
  buf_add(&err, "", 0);
  uint64_t deadline = skv__now_ms() + (uint64_t)timeout_ms;
  bool hung = false, sent = false;
  int fds[2] = {po[0], pe[0]};
  char chunk[65536];
  uint64_t start = skv__now_ms();
  bool exited = false;
  int st = 0;
  while (fds[0] >= 0 || fds[1] >= 0) {
    uint64_t now = skv__now_ms();
    if (now >= deadline) {
      hung = true;
      kill(pid, SIGKILL);
      break;
    }
    bool stalled = o->stall_ms < 0 || now < start + (uint64_t)o->stall_ms;
    int wait_ms = (int)(deadline - now);
    if (stalled || keep >= 0 || (sig && !sent && o->sig_after_ms > 0))
      wait_ms = SKV_MIN(wait_ms, 20);
    if ((stalled || keep >= 0) && !exited && waitpid(pid, &st, WNOHANG) == pid) exited = true;
    if (keep >= 0) {
      int fl = fcntl(keep, F_GETFL);
      if (fl >= 0 && (fl & O_NONBLOCK)) res->out_nonblock = true;
      if (exited) { /* our copy would keep the pipe from reaching EOF */
        close(keep);
        keep = -1;
      }
    }
    if (stalled && exited && fds[1] < 0) break; /* nothing more to see */
    if (sig && !sent && o->sig_after_ms > 0 && now >= start + (uint64_t)o->sig_after_ms) {
      kill(pid, sig);
      sent = true;
    }
    struct pollfd pfd[2] = {{.fd = stalled ? -1 : fds[0], .events = POLLIN},
                            {.fd = fds[1], .events = POLLIN}};
    int n = poll(pfd, 2, wait_ms);
    if (n < 0 && errno == EINTR) continue;
    CHECK(n >= 0, "poll: %s", strerror(errno));
    for (int i = 0; i < 2; i++) {
      if (fds[i] < 0 || !pfd[i].revents) continue;
      ssize_t r = read(fds[i], chunk, sizeof chunk);
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) {
        close(fds[i]);
        fds[i] = -1;
        continue;
      }
      buf_add(i == 0 ? &out : &err, chunk, (size_t)r);
    }
    if (sig && !sent && o->sig_after_ms <= 0) {
      int lines = 0;
      for (size_t i = 0; i < out.len; i++) lines += out.p[i] == '\n';
      if (lines >= sig_after_lines) {
        kill(pid, sig);
        sent = true;
      }
    }
  }
  for (int i = 0; i < 2; i++)
    if (fds[i] >= 0) close(fds[i]);
  if (keep >= 0) close(keep);
  while (!exited && waitpid(pid, &st, 0) < 0 && errno == EINTR) {
  }
  res->secs = (double)(skv__now_ns() - t0) / 1e9;
  res->status = hung ? -1 : WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
  res->out = out.p;
  res->out_len = out.len;
  res->err = err.p;
  res->err_len = err.len;
  res->pid = pid;
}

/* Kill it after timeout_ms. When `sig` is non-zero, send it to the launcher once its stdout
 * holds `sig_after_lines` lines. */
static void launch_sig(launch_t *res, const char *const *args, int timeout_ms, int sig,
                       int sig_after_lines) {
  launch_opts_t o = {.timeout_ms = timeout_ms, .sig = sig, .sig_after_lines = sig_after_lines};
  launch_opts(res, args, &o);
}

static void launch(launch_t *res, const char *const *args, int timeout_ms) {
  launch_sig(res, args, timeout_ms, 0, 0);
}

static void launch_free(launch_t *res) {
  free(res->out);
  free(res->err);
}

/* ---- environment ------------------------------------------------------------------------- */

typedef struct pe_env {
  int rank, world, local_rank, local_size, run_pid;
  char boot[128], token[128], keep[64];
} pe_env_t;

#define ENV_SCRIPT                                                                       \
  "echo \"ENV $SKV_RANK $SKV_WORLD_SIZE $SKV_LOCAL_RANK $SKV_LOCAL_SIZE $SKV_BOOTSTRAP " \
  "$SKV_TOKEN $SKV_RUN_PID $LAUNCHER_TEST_KEEP\""

/* Parse the ENV lines of a run with n PEs into env[rank]; checks the prefix matches. */
static void parse_env(const launch_t *res, int n, pe_env_t *env) {
  bool seen[SKV_TEST_MAX_PES] = {false};
  char *save = NULL, *copy = strdup(res->out);
  for (char *line = strtok_r(copy, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
    int prefix;
    pe_env_t e;
    int k = sscanf(line, "[%d] ENV %d %d %d %d %127s %127s %d %63s", &prefix, &e.rank, &e.world,
                   &e.local_rank, &e.local_size, e.boot, e.token, &e.run_pid, e.keep);
    cr_assert_eq(k, 9, "unexpected output line: '%s'", line);
    cr_assert(prefix >= 0 && prefix < n, "prefix out of range: '%s'", line);
    cr_assert_eq(prefix, e.rank, "line of rank %d has the prefix [%d]: '%s'", e.rank, prefix, line);
    cr_assert(!seen[prefix], "rank %d printed twice", prefix);
    seen[prefix] = true;
    env[prefix] = e;
  }
  for (int r = 0; r < n; r++) cr_assert(seen[r], "no line from rank %d in:\n%s", r, res->out);
  free(copy);
}

static bool is_hex32(const char *s) {
  if (strlen(s) != 32) return false;
  for (int i = 0; i < 32; i++)
    if (!isxdigit((unsigned char)s[i]) || isupper((unsigned char)s[i])) return false;
  return true;
}

static void check_env(const launch_t *res, int n, pe_env_t *env, const char *want_host,
                      int want_port) {
  cr_assert_eq(res->status, 0, "symkv-run exited %d; stderr:\n%s", res->status, res->err);
  parse_env(res, n, env);
  int port0 = -1;
  for (int r = 0; r < n; r++) {
    cr_assert_eq(env[r].world, n);
    cr_assert_eq(env[r].local_rank, r);
    cr_assert_eq(env[r].local_size, n);
    cr_assert_eq(env[r].run_pid, (int)res->pid, "SKV_RUN_PID %d, launcher pid %d", env[r].run_pid,
                 (int)res->pid);
    cr_assert_str_eq(env[r].keep, "kept-value", "the rest of the environment must be kept");
    cr_assert(is_hex32(env[r].token), "SKV_TOKEN is not 32 hex characters: '%s'", env[r].token);
    cr_assert_str_eq(env[r].token, env[0].token, "ranks 0 and %d have different tokens", r);
    cr_assert_str_eq(env[r].boot, env[0].boot, "ranks 0 and %d have different bootstraps", r);
    char host[64];
    int port = -1;
    char pfx[80];
    snprintf(pfx, sizeof pfx, "tcp://%s:", want_host);
    cr_assert(strncmp(env[r].boot, pfx, strlen(pfx)) == 0, "SKV_BOOTSTRAP '%s' is not %s...",
              env[r].boot, pfx);
    cr_assert(sscanf(env[r].boot + strlen(pfx), "%d%63s", &port, host) == 1, "bad port in '%s'",
              env[r].boot);
    cr_assert(port > 0 && port < 65536, "bad port in '%s'", env[r].boot);
    if (want_port) cr_assert_eq(port, want_port);
    if (r == 0) port0 = port;
    cr_assert_eq(port, port0);
  }
}

Test(launcher, environment_of_every_rank, .timeout = 30) {
  setenv("LAUNCHER_TEST_KEEP", "kept-value", 1);
  const char *args[] = {"-n", "4", "--", "/bin/sh", "-c", ENV_SCRIPT, NULL};
  launch_t a, b;
  pe_env_t ea[4], eb[4];
  launch(&a, args, 20000);
  check_env(&a, 4, ea, "127.0.0.1", 0);
  launch(&b, args, 20000);
  check_env(&b, 4, eb, "127.0.0.1", 0);
  cr_assert_str_neq(ea[0].token, eb[0].token, "two runs got the same SKV_TOKEN %s", ea[0].token);
  launch_free(&a);
  launch_free(&b);
}

Test(launcher, port_and_bind_options, .timeout = 30) {
  setenv("LAUNCHER_TEST_KEEP", "kept-value", 1);
  int port = skv_test_free_port();
  cr_assert(port > 0);
  char ps[16];
  snprintf(ps, sizeof ps, "%d", port);
  const char *args[] = {"-n",      "2",  "--port",  ps,   "--bind",   "127.0.0.1",
                        "--quiet", "--", "/bin/sh", "-c", ENV_SCRIPT, NULL};
  launch_t a;
  pe_env_t e[2];
  launch(&a, args, 20000);
  check_env(&a, 2, e, "127.0.0.1", port);
  cr_assert_eq(a.err_len, 0, "--quiet printed:\n%s", a.err);
  launch_free(&a);
}

/* ---- output ------------------------------------------------------------------------------ */

#define PAD "abcdefghijklmnopqrstuvwxyz0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ-abcdefghijklmnopqrstuv"

/* Every line is "[r] TAG r i PAD" and, per rank, i runs 0..lines-1 in order. With tag NULL, the
 * lines are OUT and ERR lines, each in order. */
static void check_lines(const char *text, const char *tag, int n, int lines) {
  int next_tag[2][SKV_TEST_MAX_PES] = {{0}};
  const char *p = text;
  int total = 0;
  while (*p) {
    const char *nl = strchr(p, '\n');
    CHECK(nl, "the output ends with a partial line: '%.200s'", p);
    char line[512];
    size_t len = (size_t)(nl - p);
    CHECK(len < sizeof line, "line too long (interleaved?): '%.200s'", p);
    memcpy(line, p, len);
    line[len] = '\0';
    int pfx, r, i, used = 0;
    char t[8];
    int k = sscanf(line, "[%d] %7s %d %d %n", &pfx, t, &r, &i, &used);
    CHECK(k == 4 && used > 0, "malformed line: '%s'", line);
    CHECK(tag ? strcmp(t, tag) == 0 : strcmp(t, "OUT") == 0 || strcmp(t, "ERR") == 0,
          "line on the wrong stream: '%s'", line);
    int *next = next_tag[!tag && strcmp(t, "ERR") == 0];
    CHECK(pfx == r && r >= 0 && r < n, "wrong prefix: '%s'", line);
    CHECK(strcmp(line + used, PAD) == 0, "mangled line: '%s'", line);
    CHECK(i == next[r], "rank %d: line %d came after line %d: '%s'", r, i, next[r] - 1, line);
    next[r]++;
    total++;
    p = nl + 1;
  }
  for (int j = 0; j < (tag ? 1 : 2); j++)
    for (int r = 0; r < n; r++)
      CHECK(next_tag[j][r] == lines, "rank %d: %d of %d %s lines", r, next_tag[j][r], lines,
            tag ? tag
            : j ? "ERR"
                : "OUT");
  CHECK(total == (tag ? 1 : 2) * n * lines, "%d lines, expected %d", total,
        (tag ? 1 : 2) * n * lines);
}

Test(launcher, many_lines_are_prefixed_whole_and_complete, .timeout = 60) {
  const char *script = "i=0; while [ $i -lt 2000 ]; do echo \"OUT $SKV_RANK $i " PAD "\"; "
                       "echo \"ERR $SKV_RANK $i " PAD "\" >&2; i=$((i+1)); done";
  const char *args[] = {"-n", "4", "--quiet", "--", "/bin/sh", "-c", script, NULL};
  launch_t a;
  launch(&a, args, 50000);
  cr_assert_eq(a.status, 0, "symkv-run exited %d; stderr:\n%.2000s", a.status, a.err);
  check_lines(a.out, "OUT", 4, 2000);
  check_lines(a.err, "ERR", 4, 2000);
  launch_free(&a);
}

Test(launcher, partial_lines_are_held_until_newline_or_eof, .timeout = 30) {
  const char *script = "printf ab; sleep 0.3; printf 'cd\\nef'; printf 'x' >&2";
  const char *args[] = {"-n", "1", "--quiet", "--", "/bin/sh", "-c", script, NULL};
  launch_t a;
  launch(&a, args, 20000);
  cr_assert_eq(a.status, 0);
  cr_assert_str_eq(a.out, "[0] abcd\n[0] ef\n");
  cr_assert_str_eq(a.err, "[0] x\n");
  launch_free(&a);
}

Test(launcher, long_line_comes_out_whole, .timeout = 30) {
  const char *args[] = {
      "-n", "2", "--quiet", "--", "/bin/sh", "-c", "head -c 200000 /dev/zero | tr '\\0' x; echo",
      NULL};
  launch_t a;
  launch(&a, args, 20000);
  cr_assert_eq(a.status, 0, "stderr:\n%s", a.err);
  cr_assert_eq(a.out_len, 2 * (4 + 200000 + 1), "got %zu bytes", a.out_len);
  for (int i = 0; i < 2; i++) {
    const char *line = a.out + (size_t)i * (4 + 200000 + 1);
    cr_assert(line[0] == '[' && (line[1] == '0' || line[1] == '1') && line[2] == ']');
    cr_assert(strspn(line + 4, "x") == 200000 && line[4 + 200000] == '\n', "line %d mangled", i);
  }
  launch_free(&a);
}

Test(launcher, no_prefix_passes_output_through, .timeout = 30) {
  const char *args[] = {"-n", "1",       "--no-prefix", "--quiet",
                        "--", "/bin/sh", "-c",          "printf 'x\\ny'; printf 'e\\n' >&2",
                        NULL};
  launch_t a;
  launch(&a, args, 20000);
  cr_assert_eq(a.status, 0);
  cr_assert_str_eq(a.out, "x\ny");
  cr_assert_str_eq(a.err, "e\n");
  launch_free(&a);
}

/* Issue 24: a job whose rank 0 prints the report (symkv-bench) shows it without "[0] ". */
Test(launcher, prefix_others_leaves_rank_0_plain, .timeout = 30) {
  const char *args[] = {"-n",      "3",       "--prefix",
                        "others",  "--quiet", "--",
                        "/bin/sh", "-c",      "sleep 0.$SKV_RANK; echo r$SKV_RANK",
                        NULL};
  launch_t a;
  launch(&a, args, 20000);
  cr_assert_eq(a.status, 0, "stderr:\n%s", a.err);
  cr_assert_str_eq(a.out, "r0\n[1] r1\n[2] r2\n");
  launch_free(&a);
}

/* ---- failures, timeouts, signals --------------------------------------------------------- */

Test(launcher, failing_rank_status_propagates_and_stops_the_others, .timeout = 30) {
  const char *args[] = {
      "-n", "4", "--", "/bin/sh", "-c", "if [ $SKV_RANK = 2 ]; then exit 3; fi; sleep 30", NULL};
  launch_t a;
  launch(&a, args, 20000);
  cr_assert_eq(a.status, 3, "symkv-run exited %d; stderr:\n%s", a.status, a.err);
  cr_assert_lt(a.secs, 10.0, "stopping the other ranks took %.1f s", a.secs);
  cr_assert(strstr(a.err, "symkv-run: rank 2 exited with status 3; stopping the others"),
            "stderr:\n%s", a.err);
  launch_free(&a);
}

Test(launcher, rank_killed_by_signal_gives_128_plus_signal, .timeout = 30) {
  const char *args[] = {"-n",      "2",  "--",
                        "/bin/sh", "-c", "if [ $SKV_RANK = 1 ]; then kill -9 $$; fi; sleep 30",
                        NULL};
  launch_t a;
  launch(&a, args, 20000);
  cr_assert_eq(a.status, 128 + 9, "symkv-run exited %d; stderr:\n%s", a.status, a.err);
  cr_assert_lt(a.secs, 10.0);
  cr_assert(strstr(a.err, "rank 1 killed by signal 9 (Killed)"), "stderr:\n%s", a.err);
  launch_free(&a);
}

Test(launcher, all_ranks_exit_zero_gives_zero, .timeout = 30) {
  const char *args[] = {"-n", "3", "--", "/bin/sh", "-c", "sleep 0.$SKV_RANK", NULL};
  launch_t a;
  launch(&a, args, 20000);
  cr_assert_eq(a.status, 0, "stderr:\n%s", a.err);
  launch_free(&a);
}

Test(launcher, timeout_stops_every_rank_with_124, .timeout = 30) {
  const char *args[] = {"-n", "2", "--timeout", "1", "--", "/bin/sh", "-c", "sleep 30", NULL};
  launch_t a;
  launch(&a, args, 20000);
  cr_assert_eq(a.status, 124, "symkv-run exited %d; stderr:\n%s", a.status, a.err);
  cr_assert(a.secs >= 0.9 && a.secs < 5.0, "took %.1f s", a.secs);
  cr_assert(strstr(a.err, "symkv-run: timeout after 1 s; ranks 0,1 still running; stopping them"),
            "stderr:\n%s", a.err);
  launch_free(&a);
}

static void check_forwarded(int sig) {
  const char *args[] = {"-n", "2", "--", "/bin/sh", "-c", "echo ready; exec sleep 30", NULL};
  launch_t a;
  launch_sig(&a, args, 20000, sig, 2);
  cr_assert_eq(a.status, 128 + sig, "symkv-run exited %d after signal %d; stderr:\n%s", a.status,
               sig, a.err);
  cr_assert_lt(a.secs, 10.0);
  launch_free(&a);
}

Test(launcher, sigterm_is_forwarded, .timeout = 30) {
  check_forwarded(SIGTERM);
}
Test(launcher, sigint_is_forwarded, .timeout = 30) {
  check_forwarded(SIGINT);
}

/* A reader that never reads the launcher's stdout must not stop its loop: the --timeout still
 * stops the PEs, and the launcher exits (dropping what it could not write) soon after. */
Test(launcher, timeout_works_while_stdout_is_not_read, .timeout = 30) {
  const char *args[] = {"-n", "2", "--timeout", "1", "--", "yes", NULL};
  launch_opts_t o = {.timeout_ms = 12000, .stall_ms = -1};
  launch_t a;
  launch_opts(&a, args, &o);
  cr_assert_eq(a.status, 124, "symkv-run exited %d after %.1f s (-1: hung); stderr:\n%s", a.status,
               a.secs, a.err);
  cr_assert_lt(a.secs, 8.0);
  cr_assert(strstr(a.err, "symkv-run: timeout after 1 s"), "stderr:\n%s", a.err);
  launch_free(&a);
}

Test(launcher, signal_is_forwarded_while_stdout_is_not_read, .timeout = 30) {
  const char *args[] = {"-n", "2", "--", "yes", NULL};
  launch_opts_t o = {.timeout_ms = 12000, .stall_ms = -1, .sig = SIGTERM, .sig_after_ms = 1000};
  launch_t a;
  launch_opts(&a, args, &o);
  cr_assert_eq(a.status, 128 + SIGTERM, "symkv-run exited %d after %.1f s (-1: hung); stderr:\n%s",
               a.status, a.secs, a.err);
  cr_assert_lt(a.secs, 8.0);
  launch_free(&a);
}

/* A reader that stalls for a while and then reads loses nothing: the PEs are held back while
 * the launcher's queue is full. stdout and stderr share one pipe; no line may be torn. */
Test(launcher, slow_reader_gets_every_line_whole, .timeout = 60) {
  const char *script = "i=0; while [ $i -lt 3000 ]; do echo \"OUT $SKV_RANK $i " PAD "\"; "
                       "echo \"ERR $SKV_RANK $i " PAD "\" >&2; i=$((i+1)); done";
  const char *args[] = {"-n", "3", "--quiet", "--", "/bin/sh", "-c", script, NULL};
  launch_opts_t o = {.timeout_ms = 50000, .stall_ms = 1500, .merge = true};
  launch_t a;
  launch_opts(&a, args, &o);
  cr_assert_eq(a.status, 0, "symkv-run exited %d; output:\n%.2000s", a.status, a.out);
  check_lines(a.out, NULL, 3, 3000);
  launch_free(&a);
}

/* O_NONBLOCK belongs to the open file, which the launcher shares with its parent (for a
 * terminal, often stdin, stdout and stderr are one): it must not change it, even while a stalled
 * reader makes its output wait. */
Test(launcher, stdout_stays_blocking_while_it_runs, .timeout = 30) {
  const char *args[] = {"-n", "2", "--timeout", "1", "--", "yes", NULL};
  launch_opts_t o = {.timeout_ms = 12000, .stall_ms = -1, .watch_flags = true};
  launch_t a;
  launch_opts(&a, args, &o);
  cr_assert_eq(a.status, 124, "symkv-run exited %d after %.1f s (-1: hung); stderr:\n%s", a.status,
               a.secs, a.err);
  cr_assert(!a.out_nonblock, "symkv-run made its stdout (a pipe it shares with us) non-blocking");
  launch_free(&a);
}

/* Whether process `pid` is gone (or a zombie nobody reaped yet). */
static bool process_gone(pid_t pid) {
  char path[64], stat[512];
  snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
  FILE *f = fopen(path, "r");
  if (!f) return true;
  size_t n = fread(stat, 1, sizeof stat - 1, f);
  fclose(f);
  stat[n] = '\0';
  const char *close_paren = strrchr(stat, ')');
  return !close_paren || close_paren[1] != ' ' || close_paren[2] == 'Z' || close_paren[2] == 'X';
}

Test(launcher, children_of_a_stopped_rank_are_stopped, .timeout = 30) {
  char dir[] = "/tmp/skv_launcher_XXXXXX";
  cr_assert(mkdtemp(dir), "mkdtemp: %s", strerror(errno));
  _Static_assert(sizeof dir + 16 < 64, "file must fit");
  char file[64], script[512];
  snprintf(file, sizeof file, "%s/child.pid", dir);
  snprintf(script, sizeof script,
           "if [ $SKV_RANK = 1 ]; then while [ ! -s %s ]; do sleep 0.05; done; exit 5; fi; "
           "sleep 100 & echo $! > %s.tmp; mv %s.tmp %s; wait",
           file, file, file, file);
  const char *args[] = {"-n", "2", "--", "/bin/sh", "-c", script, NULL};
  launch_t a;
  launch(&a, args, 20000);
  int child = 0; /* read the pid and clean up before any assertion can end the test */
  FILE *f = fopen(file, "r");
  bool have_pid = f && fscanf(f, "%d", &child) == 1 && child > 1;
  if (f) fclose(f);
  unlink(file);
  rmdir(dir);
  cr_assert_eq(a.status, 5, "symkv-run exited %d; stderr:\n%s", a.status, a.err);
  cr_assert_lt(a.secs, 10.0);
  cr_assert(have_pid, "rank 0 did not write its child's pid to %s", file);
  uint64_t until = skv__now_ms() + 3000;
  while (!process_gone(child) && skv__now_ms() < until) usleep(20000);
  bool gone = process_gone(child);
  if (!gone) kill(child, SIGKILL);
  cr_assert(gone, "rank 0's child 'sleep 100' (pid %d) still runs after symkv-run exited", child);
  launch_free(&a);
}

Test(launcher, missing_program_exits_127, .timeout = 30) {
  const char *args[] = {"-n", "2", "--", "/nonexistent/skv-no-such-program", "x", NULL};
  launch_t a;
  launch(&a, args, 20000);
  cr_assert_eq(a.status, 127, "symkv-run exited %d; stderr:\n%s", a.status, a.err);
  cr_assert(strstr(a.err, "/nonexistent/skv-no-such-program") &&
                strstr(a.err, "No such file or directory"),
            "stderr:\n%s", a.err);
  launch_free(&a);
}

/* ---- usage ------------------------------------------------------------------------------- */

Test(launcher, usage_errors_exit_2, .timeout = 60) {
  static const char *const cases[][8] = {
      {"--", "/bin/true", NULL},               /* missing -n */
      {"-n", "0", "--", "/bin/true", NULL},    /* N < 1 */
      {"-n", "1025", "--", "/bin/true", NULL}, /* N > 1024 */
      {"-n", "two", "--", "/bin/true", NULL},  /* not a number */
      {"-n", "2", "/bin/true", NULL},          /* missing -- */
      {"-n", "2", NULL},                       /* missing -- and program */
      {"-n", "2", "--", NULL},                 /* missing program */
      {"-n", "2", "--timeout", "abc", "--", "/bin/true", NULL},
      {"-n", "2", "--timeout", "-1", "--", "/bin/true", NULL},
      {"-n", "2", "--timeout", NULL},
      {"-n", "2", "--port", "70000", "--", "/bin/true", NULL},
      {"-n", "2", "--frobnicate", "--", "/bin/true", NULL},
      {"-n", "2", "--po", "3", "--", "/bin/true", NULL},        /* no abbreviations */
      {"-n", "2", "--prefix", "some", "--", "/bin/true", NULL}, /* all, others or none */
      {"-n", "2", "--quiet=yes", "--", "/bin/true", NULL},      /* a flag takes no value */
      {"-n", "2", "--port", "--", "/bin/true", NULL},           /* the value is missing */
  };
  for (size_t i = 0; i < SKV_ARRAY_LEN(cases); i++) {
    launch_t a;
    launch(&a, cases[i], 10000);
    cr_assert_eq(a.status, 2, "case %zu (%s %s %s ...) exited %d; stderr:\n%s", i, cases[i][0],
                 cases[i][1] ? cases[i][1] : "", cases[i][1] && cases[i][2] ? cases[i][2] : "",
                 a.status, a.err);
    cr_assert(strstr(a.err, "usage: symkv-run"), "case %zu printed no usage:\n%s", i, a.err);
    cr_assert(strncmp(a.err, "symkv-run: ", 11) == 0, "case %zu: no reason first:\n%s", i, a.err);
    launch_free(&a);
  }
}

Test(launcher, help_prints_usage, .timeout = 30) {
  const char *args[] = {"--help", NULL};
  launch_t a;
  launch(&a, args, 10000);
  cr_assert_eq(a.status, 0);
  cr_assert(strstr(a.out, "usage: symkv-run -n N"), "stdout:\n%s", a.out);
  launch_free(&a);
}
