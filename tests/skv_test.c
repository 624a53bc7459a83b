/* Test helpers: forked PEs through the real bootstrap, timeouts, fresh random inputs. */
#define _GNU_SOURCE
#include "skv_test.h"

int skv_test_gpu_probe(char *msg, size_t cap);

#include <arpa/inet.h>
#include <errno.h>
#include <grp.h>
#include <netinet/in.h>
#include <pwd.h>
#include <signal.h>
#include <stdio.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

void skv_test_sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
  }
}

int skv_test_free_port(void) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t len = sizeof a;
  if (bind(fd, (struct sockaddr *)&a, sizeof a) != 0 ||
      getsockname(fd, (struct sockaddr *)&a, &len) != 0) {
    close(fd);
    return -1;
  }
  int port = ntohs(a.sin_port);
  close(fd);
  return port;
}

void skv_test_config(const skv_test_job_t *job, int rank, skv_config_t *cfg) {
  skv_config_init(cfg);
  cfg->rank = rank;
  cfg->world_size = job->npes;
  cfg->bootstrap = job->bootstrap;
  cfg->token = job->token;
}

size_t skv_test_vm_bytes(void) {
  FILE *f = fopen("/proc/self/status", "r");
  if (!f) return 0;
  char line[256];
  size_t kb = 0;
  while (fgets(line, sizeof line, f))
    if (sscanf(line, "VmSize: %zu kB", &kb) == 1) break;
  fclose(f);
  return kb << 10;
}

int skv_test_maps(const char *name, int *n, int *advised, size_t *huge_kb, bool *aligned) {
  FILE *f = fopen("/proc/self/smaps", "r");
  if (!f) return -1;
  char line[512];
  bool in = false;
  *n = *advised = 0;
  *huge_kb = 0;
  *aligned = true;
  while (fgets(line, sizeof line, f)) {
    unsigned long long lo, hi;
    size_t kb;
    if (sscanf(line, "%llx-%llx ", &lo, &hi) == 2 && strchr(line, '-') < strchr(line, ' ')) {
      in = strstr(line, name) != NULL; /* a mapping's first line */
      if (in) {
        ++*n;
        *aligned = *aligned && lo % (2ull << 20) == 0;
      }
    } else if (in && strncmp(line, "VmFlags:", 8) == 0) {
      *advised += strstr(line, " hg") != NULL;
    } else if (in && (sscanf(line, "ShmemPmdMapped: %zu kB", &kb) == 1 ||
                      sscanf(line, "AnonHugePages: %zu kB", &kb) == 1)) {
      *huge_kb += kb;
    }
  }
  fclose(f);
  return 0;
}

bool skv_test_shmem_thp(void) {
  char buf[128] = "";
  FILE *f = fopen("/sys/kernel/mm/transparent_hugepage/shmem_enabled", "r");
  if (!f) return false;
  if (!fgets(buf, sizeof buf, f)) buf[0] = 0;
  fclose(f);
  return strstr(buf, "[advise]") || strstr(buf, "[always]") || strstr(buf, "[within_size]") ||
         strstr(buf, "[force]");
}

int skv_test_limit_fds(int spare, struct rlimit *was) {
  if (getrlimit(RLIMIT_NOFILE, was) != 0) return -1;
  int next = dup(0); /* the lowest free descriptor */
  if (next < 0) return -1;
  close(next);
  struct rlimit lim = *was;
  lim.rlim_cur = (rlim_t)next + (rlim_t)spare;
  return setrlimit(RLIMIT_NOFILE, &lim);
}

uint64_t skv_test_seed(void) {
  uint64_t s;
  if (skv__random_bytes(&s, sizeof s) != 0) s = (uint64_t)time(NULL) ^ (uint64_t)getpid();
  return s;
}

void skv_test_fill_random(void *buf, size_t n, uint64_t *state) {
  uint8_t *p = buf;
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t r = skv_test_rand(state);
    memcpy(p + i, &r, 8);
  }
  if (i < n) {
    uint64_t r = skv_test_rand(state);
    memcpy(p + i, &r, n - i);
  }
}

int skv_test_spawn(skv_test_job_t *job, int npes, skv_test_pe_fn fn, void *arg) {
  if (npes < 1 || npes > SKV_TEST_MAX_PES) return SKV_EINVAL;
  memset(job, 0, sizeof *job);
  job->npes = npes;
  job->port = skv_test_free_port();
  if (job->port <= 0) return SKV_ECONN;
  uint8_t rnd[16];
  skv__random_bytes(rnd, sizeof rnd);
  for (int i = 0; i < 16; i++) snprintf(job->token + 2 * i, 3, "%02x", rnd[i]);
  snprintf(job->bootstrap, sizeof job->bootstrap, "tcp://127.0.0.1:%d", job->port);
  fflush(stdout);
  fflush(stderr);
  for (int r = 0; r < npes; r++) {
    pid_t pid = fork();
    if (pid < 0) return -errno;
    if (pid == 0) {
      char buf[32];
      snprintf(buf, sizeof buf, "%d", r);
      setenv("SKV_RANK", buf, 1);
      snprintf(buf, sizeof buf, "%d", npes);
      setenv("SKV_WORLD_SIZE", buf, 1);
      setenv("SKV_BOOTSTRAP", job->bootstrap, 1);
      setenv("SKV_TOKEN", job->token, 1);
      unsetenv("SKV_LOCAL_RANK");
      unsetenv("SKV_LOCAL_SIZE");
      skv__env_reload();
      int rc = fn(r, npes, arg);
      fflush(stdout);
      fflush(stderr);
      _exit(rc & 0xff);
    }
    job->pids[r] = pid;
    job->status[r] = -2;
  }
  return 0;
}

int skv_test_wait(skv_test_job_t *job, int timeout_ms) {
  uint64_t deadline = skv__now_ms() + (uint64_t)timeout_ms;
  int left = job->npes;
  while (left > 0) {
    for (int r = 0; r < job->npes; r++) {
      if (job->status[r] != -2) continue;
      int st;
      pid_t p = waitpid(job->pids[r], &st, WNOHANG);
      if (p == job->pids[r]) {
        job->status[r] = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
        left--;
      }
    }
    if (left == 0) break;
    if (skv__now_ms() > deadline) {
      for (int r = 0; r < job->npes; r++)
        if (job->status[r] == -2) {
          kill(job->pids[r], SIGKILL);
          waitpid(job->pids[r], NULL, 0);
          job->status[r] = -1;
        }
      break;
    }
    usleep(2000);
  }
  int bad = 0;
  for (int r = 0; r < job->npes; r++) bad += job->status[r] != 0;
  return bad;
}

int skv_test_run(skv_test_job_t *job, int npes, skv_test_pe_fn fn, void *arg, int timeout_ms) {
  int rc = skv_test_spawn(job, npes, fn, arg);
  if (rc) return npes;
  return skv_test_wait(job, timeout_ms);
}

const char *skv_test_statuses(const skv_test_job_t *job) {
  static char buf[512];
  size_t o = 0;
  buf[0] = '\0';
  for (int r = 0; r < job->npes && o < sizeof buf - 32; r++) {
    int s = job->status[r];
    if (s == -1)
      o += (size_t)snprintf(buf + o, sizeof buf - o, "rank%d=timeout ", r);
    else if (s >= 128)
      o += (size_t)snprintf(buf + o, sizeof buf - o, "rank%d=sig%d ", r, s - 128);
    else
      o += (size_t)snprintf(buf + o, sizeof buf - o, "rank%d=%d ", r, s);
  }
  return buf;
}

int skv_test_become_other_user(int nofile, char *why, size_t cap) {
  if (nofile > 0) {
    struct rlimit lim = {(rlim_t)nofile, (rlim_t)nofile};
    struct rlimit have;
    if (getrlimit(RLIMIT_NOFILE, &have) == 0 && have.rlim_max >= (rlim_t)nofile)
      lim.rlim_max = have.rlim_max;
    (void)setrlimit(RLIMIT_NOFILE, &lim);
  }
  pid_t parent = getppid();
  prctl(PR_SET_PDEATHSIG, SIGKILL); /* never outlive a test that timed out */
  if (getppid() != parent) _exit(0);
  if (getuid() != 0) {
    snprintf(why, cap, "not root (uid %d): the attacker runs as this user", (int)getuid());
    return 0;
  }
  struct passwd *pw = getpwnam("nobody");
  if (!pw) {
    snprintf(why, cap, "no user 'nobody': the attacker runs as root");
    return 0;
  }
  if (setgroups(0, NULL) != 0 || setgid(pw->pw_gid) != 0 || setuid(pw->pw_uid) != 0) {
    snprintf(why, cap, "switching to 'nobody' failed: %s", strerror(errno));
    return -1;
  }
  snprintf(why, cap, "the attacker runs as 'nobody' (uid %d)", (int)pw->pw_uid);
  /* a changed uid clears the parent-death signal: set it again */
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() != parent) _exit(0);
  return 1;
}

int skv_test_init(skv_ctx_t **ctx, int timeout_ms) {
  skv_config_t cfg = SKV_CONFIG_INIT;
  cfg.timeout_ms = timeout_ms;
  return skv_init(&cfg, ctx);
}

int skv_test_gpus(char *why, size_t cap) {
#ifndef SKV_WITH_CUDA
  if (why)
    snprintf(why, cap,
             "this build has no CUDA (configure with -DSKV_CUDA=ON on a machine with nvcc)");
  return 0;
#else
  int pfd[2];
  if (pipe(pfd) != 0) return 0;
  pid_t pid = fork();
  if (pid == 0) {
    close(pfd[0]);
    char msg[256];
    int n = skv_test_gpu_probe(msg, sizeof msg);
    (void)!write(pfd[1], &n, sizeof n);
    (void)!write(pfd[1], msg, sizeof msg);
    _exit(0);
  }
  close(pfd[1]);
  int n = 0;
  char msg[256] = "GPU probe failed";
  if (read(pfd[0], &n, sizeof n) != sizeof n) n = 0;
  if (read(pfd[0], msg, sizeof msg) <= 0) snprintf(msg, sizeof msg, "GPU probe died");
  close(pfd[0]);
  waitpid(pid, NULL, 0);
  if (why) snprintf(why, cap, "%s", msg);
  return n;
#endif
}
