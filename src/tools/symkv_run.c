/* symkv-run: start N local PEs with the bootstrap environment (like torchrun), prefix their
 * output with the rank, and stop every PE when one fails, on a timeout or on a signal. */
#define _GNU_SOURCE
#include "core/core.h"

#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <netdb.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

/* How it works
 * ------------
 * The launcher's main thread runs one poll() loop. The fds are a signalfd (SIGCHLD, and
 * SIGINT/SIGTERM/SIGHUP unless they were ignored when we started; all of them are blocked, in
 * every thread), the read ends of two pipes per PE (its stdout and stderr), and an eventfd that
 * the output threads signal. Each PE is forked into its own process group, so that a signal to
 * the group also reaches the processes the PE started.
 *
 * Output: every read appends to the stream's held partial line; the complete lines of one read
 * get the "[rank] " prefix and go, as one chunk tagged with fd 1 or 2, to the end of an output
 * queue. A writer thread per queue writes the chunks in order, each one whole, with blocking
 * write()s: a reader that stalls blocks only that thread, never the main loop (timers, signals,
 * reaping), and the flags of fds 0-2 are left as they are (O_NONBLOCK would belong to the open
 * file, which the shell and other processes share). When stdout and stderr are one file (a
 * terminal, 2>&1), one queue serves both, so lines come out in the order they were read and
 * never tear; else each has its own, so that stderr goes on while stdout waits. A queue past
 * RUN_OUT_MAX bytes stops the reads from the PE pipes that feed it until its writer gets it
 * below that and signals the eventfd: the PEs then block in their own writes (back-pressure);
 * nothing is dropped. A write that fails (EPIPE) marks that fd broken: its output is dropped,
 * the PEs keep running. The launcher's own notes go through the stderr queue; fatal() writes
 * directly. The writer threads start once the PEs are forked.
 *
 * Stopping: the first PE that exits non-zero or dies of a signal (or the --timeout) decides the
 * exit status; every PE's group gets SIGTERM, and SIGKILL 5 s later if any PE is still there.
 * Once every PE has exited, the launcher reads their pipes until EOF and waits until the queues
 * are written out, as long as the reader takes; after a --timeout or a signal, at most
 * RUN_DRAIN_MS: then it exits, and a writer still blocked in write() goes with it.
 *
 * What can go wrong
 * -----------------
 * - A process that escaped the group (setsid, daemon) keeps a pipe open after every PE exited:
 *   the launcher stops waiting for it RUN_DRAIN_MS later (after the SIGKILL when stopping).
 * - After a --timeout or a signal, output that is not read RUN_DRAIN_MS after the PEs exited
 *   is dropped; the line being written then may be cut.
 * - A line longer than RUN_LINE_MAX is written in pieces, each one a line of its own.
 * - The free port is closed again before rank 0 binds it; another process may take it in
 *   between (as with torchrun). Pass --port to choose it.
 * - If the launcher itself is killed with SIGKILL, each PE gets SIGKILL (PR_SET_PDEATHSIG);
 *   the processes a PE started are not reached then. */

#define RUN_MAX_PES       1024
#define RUN_KILL_GRACE_MS 5000          /* SIGTERM, then SIGKILL this much later */
#define RUN_DRAIN_MS      2000          /* pipes still open after every PE exited */
#define RUN_READ_CHUNK    65536         /* one read() per ready pipe per poll() */
#define RUN_LINE_MAX      (1024 * 1024) /* longer lines are split */
#define RUN_OUT_MAX       (1024 * 1024) /* queued for one output file: stop reading the PEs */
#define RUN_LAST_NOTE_MS  100           /* the note about dropped output gets this to go out */

typedef struct run_stream {
  int fd;   /* read end of the pipe, -1 once at EOF */
  int dest; /* STDOUT_FILENO or STDERR_FILENO */
  char *held;
  size_t len, cap; /* partial line held until its newline */
} run_stream_t;

typedef struct run_pe {
  pid_t pid; /* 0 if never started; also the id of its process group */
  bool running;
  int status; /* exit status, or 128 + signal, once it exited */
  run_stream_t out, err;
} run_pe_t;

/* Whole lines for the launcher's stdout or stderr, in an output queue. */
typedef struct run_chunk {
  struct run_chunk *next;
  int fd; /* STDOUT_FILENO or STDERR_FILENO */
  size_t len;
  char data[];
} run_chunk_t;

/* An output queue and its writer thread; the fields after `mu` are under it. */
typedef struct run_out {
  pthread_t thread;
  int wake_fd; /* the launcher's eventfd */
  pthread_mutex_t mu;
  pthread_cond_t cv;        /* a chunk came */
  run_chunk_t *head, *tail; /* head is the one being written; it leaves once written */
  size_t queued;            /* bytes in the chunks */
  size_t wake_below;        /* non-zero: signal wake_fd once fewer bytes are queued */
  bool broken[3];           /* a write to that fd failed (EPIPE): drop its output */
} run_out_t;

enum { PREFIX_ALL, PREFIX_OTHERS, PREFIX_NONE };

typedef struct run_opts {
  int n;
  long long timeout_s; /* 0: no limit */
  int port;            /* 0: a free one */
  const char *bind;    /* NULL: 127.0.0.1 */
  int prefix;          /* PREFIX_ALL, PREFIX_OTHERS (every rank but 0) or PREFIX_NONE */
  bool quiet;
  char **argv; /* program and its arguments, NULL-terminated */
} run_opts_t;

typedef struct run {
  run_opts_t o;
  run_pe_t *pes;
  int running, open_streams;
  int exit_status; /* -1 until a PE failed or the timeout expired */
  bool stopping, killed;
  uint64_t start_ms, deadline_ms, kill_ms, all_exited_ms;
  int sigfd;
  int signals_forwarded;
  bool stdin_to_rank0;
  run_out_t outs[2];  /* one per output file */
  run_out_t *out[3];  /* the queue of fd 1 and of fd 2 (the same one if they are one file) */
  int nouts, wake_fd; /* wake_fd: eventfd, a queue got below what the loop waits for */
  uint64_t hurry_ms;  /* when the --timeout fired or a signal came: output gets RUN_DRAIN_MS */
  bool paused;        /* a PE pipe was not read because its queue was full */
  uint64_t paused_ms; /* the last time it was so */
  char *obuf;
  size_t olen, ocap;
  char *scratch;
  /* What the PEs get back before exec. */
  sigset_t old_mask;
  struct sigaction old_pipe;
  struct rlimit old_nofile;
} run_t;

/* ---- messages ---------------------------------------------------------------------------- */

static void usage(FILE *f) {
  fputs(
      "usage: symkv-run -n N [--timeout S] [--port P] [--bind ADDR] [--prefix WHICH] [--quiet]\n"
      "                 -- PROG [ARGS...]\n"
      "\n"
      "Start N local processes (PEs) of PROG, each with SKV_RANK, SKV_WORLD_SIZE,\n"
      "SKV_LOCAL_RANK, SKV_LOCAL_SIZE, SKV_BOOTSTRAP=tcp://ADDR:PORT, a fresh SKV_TOKEN and\n"
      "SKV_RUN_PID set (the rest of the environment is kept). Each output line is prefixed with\n"
      "its rank (\"[3] ...\"); stderr lines go to stderr. If a PE fails, the others are stopped.\n"
      "\n"
      "options:\n"
      "  -n, --np N      number of PEs, 1 to 1024 (required)\n"
      "  --timeout S     stop every PE after S seconds and exit 124 (default or 0: no limit)\n"
      "  --port P        bootstrap port (default: a free port on the bind address)\n"
      "  --bind ADDR     address of rank 0's bootstrap store (default 127.0.0.1)\n"
      "  --prefix WHICH  which ranks' lines get \"[rank] \": all (default), others (every rank\n"
      "                  but 0: for a job whose rank 0 prints the report) or none\n"
      "  --no-prefix     the same as --prefix none\n"
      "  --quiet         print only failures (no start line, no signal notes)\n"
      "  -h, --help      print this help\n"
      "\n"
      "Stopping: SIGTERM to each PE's process group, SIGKILL 5 s later. SIGINT, SIGTERM and\n"
      "SIGHUP to symkv-run are forwarded to every PE; a second one kills them all.\n"
      "Output is written by a separate thread; once 1 MiB waits for a slow reader, the PEs are\n"
      "held back. After --timeout or a signal, what is unwritten 2 s after the PEs exited is\n"
      "dropped.\n"
      "Rank 0 reads symkv-run's stdin unless it is a terminal; the other ranks read /dev/null.\n"
      "\n"
      "exit status: 0 if every PE exits 0; else that of the first PE that failed (128 + signal\n"
      "if it was killed), 124 after --timeout, 127 if PROG cannot be executed, 2 on a usage\n"
      "error, 1 if the launcher itself fails.\n",
      f);
}

static _Noreturn void SKV_PRINTF(1, 2) usage_error(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fputs("symkv-run: ", stderr);
  vfprintf(stderr, fmt, ap);
  fputs("\n\n", stderr);
  va_end(ap);
  usage(stderr);
  exit(2);
}

static _Noreturn void fatal(const char *fmt, ...) SKV_PRINTF(1, 2);

/* ---- output queues ----------------------------------------------------------------------- */

/* One queue for stdout and one for stderr, or a single one when they are one file. */
static void out_init(run_t *L) {
  struct stat a, b;
  bool same = fstat(STDOUT_FILENO, &a) == 0 && fstat(STDERR_FILENO, &b) == 0 &&
              a.st_dev == b.st_dev && a.st_ino == b.st_ino;
  L->nouts = same ? 1 : 2;
  L->wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (L->wake_fd < 0) fatal("eventfd() failed: %s", strerror(errno));
  for (int i = 0; i < L->nouts; i++) {
    L->outs[i].wake_fd = L->wake_fd;
    pthread_mutex_init(&L->outs[i].mu, NULL);
    pthread_cond_init(&L->outs[i].cv, NULL);
  }
  L->out[STDOUT_FILENO] = &L->outs[0];
  L->out[STDERR_FILENO] = &L->outs[L->nouts - 1];
}

/* Blocking; false once the reader is gone. */
static bool write_all(int fd, const char *p, size_t n) {
  while (n > 0) {
    ssize_t w = write(fd, p, n);
    if (w > 0) {
      p += w;
      n -= (size_t)w;
    } else if (w < 0 && errno == EINTR) {
      continue;
    } else if (w < 0 && errno == EAGAIN) { /* someone else made the file non-blocking */
      struct pollfd pf = {.fd = fd, .events = POLLOUT};
      (void)poll(&pf, 1, 100);
    } else {
      return false;
    }
  }
  return true;
}

/* A writer thread: the queue's chunks in order, each one whole. */
static void *out_writer(void *arg) {
  run_out_t *q = arg;
  pthread_mutex_lock(&q->mu);
  for (;;) {
    while (!q->head) pthread_cond_wait(&q->cv, &q->mu);
    run_chunk_t *c = q->head;
    bool skip = q->broken[c->fd];
    pthread_mutex_unlock(&q->mu);
    bool ok = skip || write_all(c->fd, c->data, c->len);
    pthread_mutex_lock(&q->mu);
    if (!ok) q->broken[c->fd] = true; /* reader gone: keep the PEs running, drop their output */
    q->head = c->next;
    if (!q->head) q->tail = NULL;
    q->queued -= c->len;
    if (q->wake_below && q->queued < q->wake_below) {
      q->wake_below = 0;
      uint64_t one = 1;
      ssize_t w = write(q->wake_fd, &one, sizeof one);
      (void)w;
    }
    free(c);
  }
  return NULL;
}

/* After the PEs are forked, so that no fork() happens with threads running. They inherit the
 * blocked signals: those are read from the signalfd only. */
static void out_start(run_t *L) {
  for (int i = 0; i < L->nouts; i++) {
    int e = pthread_create(&L->outs[i].thread, NULL, out_writer, &L->outs[i]);
    if (e != 0) fatal("cannot start an output thread: %s", strerror(e));
  }
}

/* Queue n bytes of whole lines for fd (1 or 2); never waits for the reader. */
static void out_put(run_t *L, int fd, const char *p, size_t n) {
  if (n == 0) return;
  run_chunk_t *c = malloc(sizeof *c + n);
  if (!c) fatal("out of memory for the output queue (%zu bytes)", n);
  *c = (run_chunk_t){.fd = fd, .len = n};
  memcpy(c->data, p, n);
  run_out_t *q = L->out[fd];
  pthread_mutex_lock(&q->mu);
  if (!q->broken[fd]) {
    if (q->tail)
      q->tail->next = c;
    else
      q->head = c;
    q->tail = c;
    q->queued += n;
    pthread_cond_signal(&q->cv);
    c = NULL;
  }
  pthread_mutex_unlock(&q->mu);
  free(c);
}

/* Bytes in q not written yet. If that is wake_below or more, its writer signals wake_fd once
 * it is less (or less than a larger value already asked for). */
static size_t out_queued(run_out_t *q, size_t wake_below) {
  pthread_mutex_lock(&q->mu);
  size_t n = q->queued;
  if (n >= wake_below && wake_below > q->wake_below) q->wake_below = wake_below;
  pthread_mutex_unlock(&q->mu);
  return n;
}

static size_t out_total(run_t *L, size_t wake_below) {
  size_t n = 0;
  for (int i = 0; i < L->nouts; i++) n += out_queued(&L->outs[i], wake_below);
  return n;
}

static void out_woken(run_t *L) {
  uint64_t v;
  ssize_t r = read(L->wake_fd, &v, sizeof v);
  (void)r;
}

/* Wait at most ms for fd's queue to be written out. */
static void out_settle(run_t *L, int fd, int ms) {
  uint64_t end = skv__now_ms() + (uint64_t)ms, now;
  while (out_queued(L->out[fd], 1) > 0 && (now = skv__now_ms()) < end) {
    struct pollfd pf = {.fd = L->wake_fd, .events = POLLIN};
    if (poll(&pf, 1, (int)(end - now)) > 0) out_woken(L);
  }
}

/* One line of the launcher's own on stderr; `always` ones are printed under --quiet too. */
static void SKV_PRINTF(3, 4) note(run_t *L, bool always, const char *fmt, ...) {
  if (L->o.quiet && !always) return;
  char buf[1024];
  int k = snprintf(buf, sizeof buf, "symkv-run: ");
  va_list ap;
  va_start(ap, fmt);
  int m = vsnprintf(buf + k, sizeof buf - (size_t)k - 1, fmt, ap);
  va_end(ap);
  size_t len = (size_t)k + (m < 0 ? 0 : SKV_MIN((size_t)m, sizeof buf - (size_t)k - 2));
  buf[len++] = '\n';
  out_put(L, STDERR_FILENO, buf, len);
}

static _Noreturn void SKV_PRINTF(1, 2) fatal(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fputs("symkv-run: ", stderr);
  vfprintf(stderr, fmt, ap);
  fputc('\n', stderr);
  va_end(ap);
  exit(1);
}

/* "0-3,7,9" for the PEs that are still running (runs of three or more as ranges). */
static const char *running_ranks(const run_t *L, char *buf, size_t cap, int *count) {
  size_t o = 0;
  int c = 0;
  buf[0] = '\0';
  for (int r = 0; r < L->o.n; r++) {
    if (!L->pes[r].running) continue;
    int e = r;
    while (e + 1 < L->o.n && L->pes[e + 1].running) e++;
    c += e - r + 1;
    if (o + 32 < cap) {
      const char *sep = o ? "," : "";
      int k = e - r >= 2   ? snprintf(buf + o, cap - o, "%s%d-%d", sep, r, e)
              : e - r == 1 ? snprintf(buf + o, cap - o, "%s%d,%d", sep, r, e)
                           : snprintf(buf + o, cap - o, "%s%d", sep, r);
      o += (size_t)SKV_MAX(k, 0);
    } else if (o + 4 < cap && strcmp(buf + o - 3, "...") != 0) {
      o += (size_t)snprintf(buf + o, cap - o, ",...");
    }
    r = e;
  }
  *count = c;
  return buf;
}

/* ---- arguments --------------------------------------------------------------------------- */

/* getopt_long, stopping at the first argument that is not an option ('+'): what follows "--"
 * (or the program) is the PEs'. */
static void parse_args(int argc, char **argv, run_opts_t *o) {
  enum { O_TIMEOUT = 1000, O_PORT, O_BIND, O_PREFIX, O_NO_PREFIX };
  static const struct option longs[] = {{"np", required_argument, NULL, 'n'},
                                        {"timeout", required_argument, NULL, O_TIMEOUT},
                                        {"port", required_argument, NULL, O_PORT},
                                        {"bind", required_argument, NULL, O_BIND},
                                        {"prefix", required_argument, NULL, O_PREFIX},
                                        {"no-prefix", no_argument, NULL, O_NO_PREFIX},
                                        {"quiet", no_argument, NULL, 'q'},
                                        {"help", no_argument, NULL, 'h'},
                                        {NULL, 0, NULL, 0}};
  memset(o, 0, sizeof *o);
  o->prefix = PREFIX_ALL;
  bool have_n = false;
  opterr = 0;
  for (;;) {
    int li = -1, c = getopt_long(argc, argv, "+:n:qh", longs, &li);
    if (c == -1) break;
    const char *text = argv[optind - 1];
    if (optarg && optarg == argv[optind - 1] && optind >= 2) text = argv[optind - 2];
    /* no abbreviations: "--po" must not stand for --port or --prefix */
    if (li >= 0 && strncmp(text, "--", 2) == 0) {
      size_t len = strcspn(text + 2, "=");
      if (len != strlen(longs[li].name) || strncmp(text + 2, longs[li].name, len) != 0)
        usage_error("unknown option '%.*s' (did you mean --%s?)", (int)len + 2, text,
                    longs[li].name);
    }
    if (optarg && strcmp(optarg, "--") == 0) usage_error("%s needs a value", text);
    long long x;
    switch (c) {
    case 'h':
      usage(stdout);
      exit(0);
    case 'n':
      if (!skv__parse_int(optarg, 1, RUN_MAX_PES, false, &x))
        usage_error("-n needs a number of PEs from 1 to %d, got '%s'", RUN_MAX_PES, optarg);
      o->n = (int)x;
      have_n = true;
      break;
    case O_TIMEOUT:
      if (!skv__parse_int(optarg, 0, 1000000000, false, &x))
        usage_error("--timeout needs whole seconds (0 for no limit), got '%s'", optarg);
      o->timeout_s = x;
      break;
    case O_PORT:
      if (!skv__parse_int(optarg, 1, 65535, false, &x))
        usage_error("--port needs a TCP port from 1 to 65535, got '%s'", optarg);
      o->port = (int)x;
      break;
    case O_BIND:
      if (!*optarg) usage_error("--bind needs an address of this host, such as 127.0.0.1");
      o->bind = optarg;
      break;
    case O_PREFIX:
      if (strcmp(optarg, "all") == 0)
        o->prefix = PREFIX_ALL;
      else if (strcmp(optarg, "others") == 0)
        o->prefix = PREFIX_OTHERS;
      else if (strcmp(optarg, "none") == 0)
        o->prefix = PREFIX_NONE;
      else
        usage_error("--prefix needs all, others or none, got '%s'", optarg);
      break;
    case O_NO_PREFIX:
      o->prefix = PREFIX_NONE;
      break;
    case 'q':
      o->quiet = true;
      break;
    case ':':
      usage_error("%s needs a value", text);
    default: {
      size_t len = strcspn(text, "=");
      bool flag = strncmp(text, "--no-prefix=", 12) == 0 || strncmp(text, "--quiet=", 8) == 0 ||
                  strncmp(text, "--help=", 7) == 0;
      if (flag) usage_error("%.*s takes no value", (int)len, text);
      if (optopt && text[0] == '-' && text[1] != '-') usage_error("unknown option '-%c'", optopt);
      usage_error("unknown option '%.*s'", (int)len, text);
    }
    }
  }
  bool have_dashes = optind > 1 && strcmp(argv[optind - 1], "--") == 0;
  if (!have_n) usage_error("missing -n N (the number of PEs to start)");
  if (!have_dashes && optind < argc)
    usage_error("unexpected '%s' before '--'; write: symkv-run -n N [options] -- %s ...",
                argv[optind], argv[optind]);
  if (!have_dashes) usage_error("missing '--' before the program: symkv-run -n %d -- PROG", o->n);
  if (optind >= argc || !argv[optind][0]) usage_error("missing the program after '--'");
  o->argv = argv + optind;
}

/* ---- start-up ---------------------------------------------------------------------------- */

/* Check that `host` can listen on `port` (0: let the kernel pick one) and return the port. */
static int pick_port(const char *host, int port) {
  char h[256];
  size_t hl = strlen(host);
  if (hl >= sizeof h) fatal("--bind address is too long: '%s'", host);
  memcpy(h, host, hl + 1);
  if (h[0] == '[' && hl > 2 && h[hl - 1] == ']') { /* [::1] */
    memmove(h, h + 1, hl - 2);
    h[hl - 2] = '\0';
  }
  char ps[16];
  snprintf(ps, sizeof ps, "%d", port);
  struct addrinfo hints = {
      .ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_PASSIVE | AI_NUMERICSERV};
  struct addrinfo *res = NULL;
  int g = getaddrinfo(h, ps, &hints, &res);
  if (g != 0) fatal("cannot resolve the bind address '%s': %s", host, gai_strerror(g));
  int fd = socket(res->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) fatal("socket() for '%s' failed: %s", host, strerror(errno));
  int one = 1;
  (void)setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (bind(fd, res->ai_addr, res->ai_addrlen) != 0) {
    int e = errno;
    if (port)
      fatal("cannot use port %d on %s: %s; pick another with --port or leave --port out", port,
            host, strerror(e));
    fatal("cannot bind to %s: %s; give --bind an address of this host", host, strerror(e));
  }
  struct sockaddr_storage ss;
  socklen_t sl = sizeof ss;
  if (getsockname(fd, (struct sockaddr *)&ss, &sl) != 0)
    fatal("getsockname() failed: %s", strerror(errno));
  int got = ss.ss_family == AF_INET6 ? ntohs(((struct sockaddr_in6 *)&ss)->sin6_port)
                                     : ntohs(((struct sockaddr_in *)&ss)->sin_port);
  close(fd);
  freeaddrinfo(res);
  return got;
}

static void set_env(const char *name, const char *value) {
  if (setenv(name, value, 1) != 0) fatal("setenv(%s) failed: %s", name, strerror(errno));
}

static void set_env_int(const char *name, long long v) {
  char buf[32];
  snprintf(buf, sizeof buf, "%lld", v);
  set_env(name, buf);
}

/* The environment every PE shares; SKV_RANK and SKV_LOCAL_RANK are set per PE in spawn(). */
static void setup_env(run_t *L) {
  const char *host = L->o.bind ? L->o.bind : "127.0.0.1";
  int port = pick_port(host, L->o.port);
  char boot[300];
  bool v6 = strchr(host, ':') && host[0] != '[';
  snprintf(boot, sizeof boot, v6 ? "tcp://[%s]:%d" : "tcp://%s:%d", host, port);
  uint8_t rnd[16];
  if (skv__random_bytes(rnd, sizeof rnd) != 0) fatal("cannot read random bytes for SKV_TOKEN");
  char token[33];
  for (size_t i = 0; i < sizeof rnd; i++) snprintf(token + 2 * i, 3, "%02x", rnd[i]);
  set_env("SKV_BOOTSTRAP", boot);
  set_env("SKV_TOKEN", token);
  set_env_int("SKV_WORLD_SIZE", L->o.n);
  set_env_int("SKV_LOCAL_SIZE", L->o.n);
  set_env_int("SKV_RUN_PID", (long long)getpid());
  note(L, false, "starting %d rank%s of '%s', bootstrap %s", L->o.n, L->o.n == 1 ? "" : "s",
       L->o.argv[0], boot);
}

/* Signals: block the ones we watch and read them from a signalfd. Also make sure that fds
 * 0-2 exist (so that no pipe lands there) and that 2 pipes per PE fit under RLIMIT_NOFILE. */
static void setup_process(run_t *L) {
  for (int fd = 0; fd <= 2; fd++)
    if (fcntl(fd, F_GETFD) < 0 && open("/dev/null", O_RDWR) < 0)
      fatal("cannot open /dev/null: %s", strerror(errno));
  L->stdin_to_rank0 = !isatty(STDIN_FILENO);
  out_init(L);

  struct sigaction dfl = {.sa_handler = SIG_DFL}, ign = {.sa_handler = SIG_IGN};
  sigaction(SIGCHLD, &dfl, NULL); /* an inherited SIG_IGN would reap the PEs for us */
  sigaction(SIGPIPE, &ign, &L->old_pipe);
  sigset_t watch;
  sigemptyset(&watch);
  sigaddset(&watch, SIGCHLD);
  const int fwd[] = {SIGINT, SIGTERM, SIGHUP};
  for (size_t i = 0; i < SKV_ARRAY_LEN(fwd); i++) {
    struct sigaction cur;
    sigaction(fwd[i], NULL, &cur);
    if (cur.sa_handler != SIG_IGN) sigaddset(&watch, fwd[i]); /* nohup, `&` in a script */
  }
  sigprocmask(SIG_BLOCK, &watch, &L->old_mask);
  L->sigfd = signalfd(-1, &watch, SFD_CLOEXEC | SFD_NONBLOCK);
  if (L->sigfd < 0) fatal("signalfd() failed: %s", strerror(errno));

  getrlimit(RLIMIT_NOFILE, &L->old_nofile);
  rlim_t need = (rlim_t)L->o.n * 2 + 16;
  if (L->old_nofile.rlim_cur != RLIM_INFINITY && L->old_nofile.rlim_cur < need) {
    if (L->old_nofile.rlim_max != RLIM_INFINITY && L->old_nofile.rlim_max < need)
      fatal("-n %d needs %llu open files but the limit is %llu; raise it (ulimit -n) or start "
            "fewer PEs",
            L->o.n, (unsigned long long)need, (unsigned long long)L->old_nofile.rlim_max);
    struct rlimit nl = {.rlim_cur = need, .rlim_max = L->old_nofile.rlim_max};
    if (setrlimit(RLIMIT_NOFILE, &nl) != 0)
      fatal("cannot raise the open-file limit to %llu: %s", (unsigned long long)need,
            strerror(errno));
  }
}

/* In the forked child: become the PE. */
static _Noreturn void child_exec(run_t *L, int rank, int out_w, int err_w, pid_t parent) {
  setpgid(0, 0);
  if (prctl(PR_SET_PDEATHSIG, SIGKILL) == 0 && getppid() != parent) _exit(1);
  if (rank != 0 || !L->stdin_to_rank0) {
    int fd = open("/dev/null", O_RDONLY);
    if (fd >= 0 && fd != STDIN_FILENO) {
      dup2(fd, STDIN_FILENO);
      close(fd);
    }
  }
  if (dup2(out_w, STDOUT_FILENO) < 0 || dup2(err_w, STDERR_FILENO) < 0) _exit(127);
  sigaction(SIGPIPE, &L->old_pipe, NULL);
  setrlimit(RLIMIT_NOFILE, &L->old_nofile);
  sigprocmask(SIG_SETMASK, &L->old_mask, NULL);
  execvp(L->o.argv[0], L->o.argv);
  int e = errno;
  dprintf(STDERR_FILENO, "symkv-run: cannot execute '%s': %s (check the name, PATH and %s)\n",
          L->o.argv[0], strerror(e), e == EACCES ? "its permissions" : "that it exists");
  _exit(127);
}

static int spawn(run_t *L, int rank) {
  run_pe_t *pe = &L->pes[rank];
  int po[2], pr[2];
  if (pipe2(po, O_CLOEXEC) != 0) return -errno;
  if (pipe2(pr, O_CLOEXEC) != 0) {
    int e = errno;
    close(po[0]);
    close(po[1]);
    return -e;
  }
  set_env_int("SKV_RANK", rank);
  set_env_int("SKV_LOCAL_RANK", rank);
  pid_t parent = getpid();
  pid_t pid = fork();
  if (pid < 0) {
    int e = errno;
    close(po[0]), close(po[1]), close(pr[0]), close(pr[1]);
    return -e;
  }
  if (pid == 0) child_exec(L, rank, po[1], pr[1], parent);
  (void)setpgid(pid, pid); /* the child does it too: whichever runs first */
  close(po[1]);
  close(pr[1]);
  fcntl(po[0], F_SETFL, O_NONBLOCK);
  fcntl(pr[0], F_SETFL, O_NONBLOCK);
  pe->pid = pid;
  pe->running = true;
  pe->out.fd = po[0];
  pe->err.fd = pr[0];
  L->running++;
  L->open_streams += 2;
  return 0;
}

/* ---- output ------------------------------------------------------------------------------ */

static void obuf_put(run_t *L, const char *p, size_t n) {
  if (L->olen + n > L->ocap) {
    size_t cap = SKV_MAX(L->ocap * 2, L->olen + n + 4096);
    char *b = realloc(L->obuf, cap);
    if (!b) fatal("out of memory for the output buffer (%zu bytes)", cap);
    L->obuf = b;
    L->ocap = cap;
  }
  memcpy(L->obuf + L->olen, p, n);
  L->olen += n;
}

/* One line of PE `rank`: the prefix, a then b, and a newline if `add_nl`. */
static void emit(run_t *L, int rank, const char *a, size_t alen, const char *b, size_t blen,
                 bool add_nl) {
  if (L->o.prefix == PREFIX_ALL || (L->o.prefix == PREFIX_OTHERS && rank != 0)) {
    char pfx[24];
    int k = snprintf(pfx, sizeof pfx, "[%d] ", rank);
    obuf_put(L, pfx, (size_t)k);
  }
  if (alen) obuf_put(L, a, alen);
  if (blen) obuf_put(L, b, blen);
  if (add_nl) obuf_put(L, "\n", 1);
}

static void hold(run_stream_t *s, const char *p, size_t n) {
  if (s->len + n > s->cap) {
    size_t cap = SKV_MAX(s->cap * 2, s->len + n);
    char *b = realloc(s->held, cap);
    if (!b) fatal("out of memory holding a partial line (%zu bytes)", cap);
    s->held = b;
    s->cap = cap;
  }
  memcpy(s->held + s->len, p, n);
  s->len += n;
}

static void close_stream(run_t *L, int rank, run_stream_t *s) {
  if (s->len) /* the last line, without its newline: one is added where a prefix is */
    emit(L, rank, s->held, s->len, NULL, 0, L->o.prefix != PREFIX_NONE);
  free(s->held);
  s->held = NULL;
  s->len = s->cap = 0;
  close(s->fd);
  s->fd = -1;
  L->open_streams--;
}

/* One read() from a ready pipe; complete lines go out now, the rest is held. */
static void pump(run_t *L, int rank, run_stream_t *s) {
  ssize_t n = read(s->fd, L->scratch, RUN_READ_CHUNK);
  if (n < 0 && (errno == EINTR || errno == EAGAIN)) return;
  L->olen = 0;
  if (n <= 0) {
    close_stream(L, rank, s);
  } else {
    const char *p = L->scratch, *end = p + n;
    const char *nl;
    while ((nl = memchr(p, '\n', (size_t)(end - p))) != NULL) {
      emit(L, rank, s->held, s->len, p, (size_t)(nl + 1 - p), false);
      s->len = 0;
      p = nl + 1;
    }
    if (p < end) hold(s, p, (size_t)(end - p));
    if (s->len >= RUN_LINE_MAX) {
      emit(L, rank, s->held, s->len, NULL, 0, L->o.prefix != PREFIX_NONE);
      s->len = 0;
    }
  }
  out_put(L, s->dest, L->obuf, L->olen);
  L->olen = 0;
}

/* ---- processes --------------------------------------------------------------------------- */

static void signal_all(run_t *L, int sig) {
  for (int r = 0; r < L->o.n; r++)
    if (L->pes[r].pid > 0) (void)kill(-L->pes[r].pid, sig); /* the group; ESRCH once empty */
}

static void begin_stop(run_t *L) {
  if (L->stopping) return;
  L->stopping = true;
  L->kill_ms = skv__now_ms() + RUN_KILL_GRACE_MS;
  signal_all(L, SIGTERM);
}

static void reap(run_t *L) {
  for (;;) {
    int st;
    pid_t p = waitpid(-1, &st, WNOHANG);
    if (p < 0 && errno == EINTR) continue;
    if (p <= 0) return;
    int r = 0;
    while (r < L->o.n && L->pes[r].pid != p) r++;
    if (r == L->o.n || !L->pes[r].running) continue;
    run_pe_t *pe = &L->pes[r];
    pe->running = false;
    if (--L->running == 0) L->all_exited_ms = skv__now_ms();
    pe->status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    if (pe->status == 0 || L->stopping) continue;
    const char *tail = L->running ? "; stopping the others" : "";
    if (WIFEXITED(st))
      note(L, true, "rank %d exited with status %d%s", r, pe->status, tail);
    else
      note(L, true, "rank %d killed by signal %d (%s)%s%s", r, WTERMSIG(st),
           strsignal(WTERMSIG(st)), WCOREDUMP(st) ? ", core dumped" : "", tail);
    L->exit_status = pe->status;
    begin_stop(L);
  }
}

static const char *sig_name(int sig) {
  return sig == SIGINT    ? "SIGINT"
         : sig == SIGTERM ? "SIGTERM"
         : sig == SIGHUP  ? "SIGHUP"
                          : "a signal";
}

static void on_signals(run_t *L) {
  struct signalfd_siginfo si[16];
  ssize_t n;
  bool child = false;
  while ((n = read(L->sigfd, si, sizeof si)) > 0) {
    for (size_t i = 0; i < (size_t)n / sizeof si[0]; i++) {
      int sig = (int)si[i].ssi_signo;
      if (sig != SIGCHLD && !L->hurry_ms) L->hurry_ms = skv__now_ms();
      if (sig == SIGCHLD) {
        child = true;
      } else if (L->signals_forwarded++ == 0) {
        note(L, false, "got %s; forwarding it to every rank (send it again to kill them)",
             sig_name(sig));
        signal_all(L, sig);
      } else {
        note(L, true, "got %s after a first signal; killing every rank", sig_name(sig));
        signal_all(L, SIGKILL);
        L->killed = true;
        if (!L->stopping) {
          L->stopping = true;
          L->kill_ms = skv__now_ms();
          L->exit_status = 128 + sig; /* the PEs die of SIGKILL now; report what we got */
        }
      }
    }
  }
  if (child) reap(L);
}

static void close_open_streams(run_t *L) {
  for (int r = 0; r < L->o.n; r++) {
    run_stream_t *ss[2] = {&L->pes[r].out, &L->pes[r].err};
    for (int j = 0; j < 2; j++) {
      if (ss[j]->fd < 0) continue;
      L->olen = 0;
      close_stream(L, r, ss[j]);
      out_put(L, ss[j]->dest, L->obuf, L->olen);
    }
  }
}

/* Timers: the --timeout, SIGKILL after the grace, giving up on pipes held open and (after a
 * timeout or a signal) on a reader that does not read. Returns the poll() timeout in ms (-1:
 * none), or -2 when the launcher is done. */
static int check_timers(run_t *L) {
  uint64_t now = skv__now_ms();
  char ranks[4096];
  int cnt;
  if (L->deadline_ms && !L->stopping && L->running > 0 && now >= L->deadline_ms) {
    running_ranks(L, ranks, sizeof ranks, &cnt);
    note(L, true, "timeout after %lld s; rank%s %s still running; stopping %s", L->o.timeout_s,
         cnt == 1 ? "" : "s", ranks, cnt == 1 ? "it" : "them");
    L->exit_status = 124;
    L->hurry_ms = now;
    begin_stop(L);
  }
  if (L->stopping && !L->killed && now >= L->kill_ms) {
    if (L->running > 0) {
      running_ranks(L, ranks, sizeof ranks, &cnt);
      note(L, true, "rank%s %s still running %d s after SIGTERM; sending SIGKILL",
           cnt == 1 ? "" : "s", ranks, RUN_KILL_GRACE_MS / 1000);
    }
    signal_all(L, SIGKILL); /* also what the exited PEs left in their groups */
    L->killed = true;
  }
  uint64_t next = UINT64_MAX;
  if (L->running == 0) {
    uint64_t base = L->all_exited_ms;
    if (L->stopping && !L->killed) base = SKV_MAX(base, L->kill_ms);
    if (L->open_streams > 0) {
      /* Time spent not reading (output queue full) does not count: the pipes are not idle. */
      if (L->paused) L->paused_ms = now;
      uint64_t drain = SKV_MAX(base, L->paused_ms) + RUN_DRAIN_MS;
      if (now >= drain) {
        note(L, false,
             "every rank exited but a process they started still holds their output "
             "open; not waiting for it");
        close_open_streams(L);
      } else {
        next = drain;
      }
    }
    size_t queued = out_total(L, L->open_streams == 0 ? 1 : 0); /* 1: wake us once empty */
    if (L->open_streams == 0 && queued == 0) return -2;
    if (L->hurry_ms && queued > 0) { /* after a timeout or signal, do not wait on the reader */
      uint64_t end = SKV_MAX(L->all_exited_ms, L->hurry_ms) + RUN_DRAIN_MS;
      if (now >= end) {
        note(L, false, "the output is not being read; dropping the last %zu bytes", queued);
        if (L->stopping && !L->killed) signal_all(L, SIGKILL); /* leave nothing behind */
        return -2;
      }
      next = SKV_MIN(next, end);
    }
  }
  if (L->deadline_ms && !L->stopping && L->running > 0) next = SKV_MIN(next, L->deadline_ms);
  if (L->stopping && !L->killed) next = SKV_MIN(next, L->kill_ms);
  if (next == UINT64_MAX) return -1;
  return next <= now ? 0 : (int)SKV_MIN(next - now, (uint64_t)60000);
}

static void loop(run_t *L) {
  size_t cap = 2 + 2 * (size_t)L->o.n;
  struct pollfd *pfd = calloc(cap, sizeof *pfd);
  run_stream_t **who = calloc(cap, sizeof *who);
  int *rank_of = calloc(cap, sizeof *rank_of);
  if (!pfd || !who || !rank_of) fatal("out of memory for %zu poll entries", cap);
  out_start(L);
  for (;;) {
    int timeout = check_timers(L);
    if (timeout == -2) break;
    size_t k = 0;
    pfd[k++] = (struct pollfd){.fd = L->sigfd, .events = POLLIN};
    pfd[k++] = (struct pollfd){.fd = L->wake_fd, .events = POLLIN};
    bool full[3] = {false, false, false}; /* back-pressure: let the PEs block in their writes */
    for (int fd = 1; fd <= 2; fd++) full[fd] = out_queued(L->out[fd], RUN_OUT_MAX) >= RUN_OUT_MAX;
    L->paused = false;
    for (int r = 0; r < L->o.n; r++) {
      run_stream_t *ss[2] = {&L->pes[r].out, &L->pes[r].err};
      for (int j = 0; j < 2; j++) {
        if (ss[j]->fd < 0) continue;
        if (full[ss[j]->dest]) {
          L->paused = true;
          L->paused_ms = skv__now_ms();
          continue;
        }
        who[k] = ss[j];
        rank_of[k] = r;
        pfd[k++] = (struct pollfd){.fd = ss[j]->fd, .events = POLLIN};
      }
    }
    int n = poll(pfd, (nfds_t)k, timeout);
    if (n < 0) {
      if (errno == EINTR) continue;
      fatal("poll() failed: %s", strerror(errno));
    }
    if (pfd[1].revents) out_woken(L);
    for (size_t i = 2; i < k; i++)
      if (pfd[i].revents) pump(L, rank_of[i], who[i]);
    if (pfd[0].revents) on_signals(L);
  }
  /* Left open only when output is dropped (see check_timers): queue the held lines too; the
   * note about it gets a moment to reach stderr, if its writer is not blocked. */
  close_open_streams(L);
  out_settle(L, STDERR_FILENO, RUN_LAST_NOTE_MS);
  free(pfd);
  free(who);
  free(rank_of);
}

int main(int argc, char **argv) {
  static run_t L; /* static: a writer thread may still use its queue while the process exits */
  L.exit_status = -1;
  parse_args(argc, argv, &L.o);
  setup_process(&L);
  L.pes = calloc((size_t)L.o.n, sizeof *L.pes);
  L.scratch = malloc(RUN_READ_CHUNK);
  if (!L.pes || !L.scratch) fatal("out of memory for %d PEs", L.o.n);
  for (int r = 0; r < L.o.n; r++) {
    L.pes[r].out = (run_stream_t){.fd = -1, .dest = STDOUT_FILENO};
    L.pes[r].err = (run_stream_t){.fd = -1, .dest = STDERR_FILENO};
  }
  setup_env(&L);
  L.start_ms = skv__now_ms();
  if (L.o.timeout_s > 0) L.deadline_ms = L.start_ms + (uint64_t)L.o.timeout_s * 1000u;
  for (int r = 0; r < L.o.n; r++) {
    int rc = spawn(&L, r);
    if (rc < 0) {
      note(&L, true, "cannot start rank %d: %s%s", r, strerror(-rc),
           r ? "; stopping the others" : "");
      L.exit_status = 1;
      begin_stop(&L);
      break;
    }
  }
  loop(&L);
  for (int r = 0; r < L.o.n; r++) {
    free(L.pes[r].out.held);
    free(L.pes[r].err.held);
  }
  free(L.pes);
  free(L.scratch);
  free(L.obuf);
  close(L.sigfd);
  return L.exit_status < 0 ? 0 : L.exit_status;
}
