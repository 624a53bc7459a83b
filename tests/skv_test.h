/* Test helpers: fork N PEs that join one job through the real bootstrap (a fresh port and
 * token each time), collect their exit statuses, and kill them all on a timeout. */
#ifndef SKV_TEST_H
#define SKV_TEST_H

#include "core/core.h"

#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

#define SKV_TEST_MAX_PES 16

/* Body of one PE; returns its exit status (0 = pass). Runs in a forked child. */
typedef int (*skv_test_pe_fn)(int rank, int npes, void *arg);

typedef struct skv_test_job {
  int npes;
  int port;
  char token[64];
  char bootstrap[64];
  pid_t pids[SKV_TEST_MAX_PES];
  int status[SKV_TEST_MAX_PES]; /* exit code, or 128 + signal, or -1 if killed on timeout */
} skv_test_job_t;

/* A free loopback TCP port. */
int skv_test_free_port(void);
/* Sleep `ms` milliseconds (all of them, also when a signal interrupts). */
void skv_test_sleep_ms(int ms);
/* Fill a config for PE `rank` of `job` (bootstrap and token of the job). */
void skv_test_config(const skv_test_job_t *job, int rank, skv_config_t *cfg);
/* Fork `npes` children running fn(rank, npes, arg) with SKV_RANK/SKV_WORLD_SIZE/SKV_BOOTSTRAP/
 * SKV_TOKEN set (and skv__env_reload'ed); do not wait. */
int skv_test_spawn(skv_test_job_t *job, int npes, skv_test_pe_fn fn, void *arg);
/* Wait for every child up to timeout_ms; past it, SIGKILL the rest (status -1). Returns the
 * number of children that did not exit with 0. */
int skv_test_wait(skv_test_job_t *job, int timeout_ms);
/* spawn + wait. */
int skv_test_run(skv_test_job_t *job, int npes, skv_test_pe_fn fn, void *arg, int timeout_ms);
/* Human-readable statuses ("rank0=0 rank1=sig9 ...") for assertion messages. */
const char *skv_test_statuses(const skv_test_job_t *job);

/* This process's virtual size in bytes (VmSize of /proc/self/status), or 0. */
size_t skv_test_vm_bytes(void);
/* This process's mappings whose name contains `name` (/proc/self/smaps): how many (*n), how
 * many of them advised for transparent huge pages (*advised, VmFlags "hg"), their bytes on huge
 * pages (*huge_kb, ShmemPmdMapped + AnonHugePages), and whether each starts on a 2 MiB boundary
 * (*aligned). 0, or -1 when smaps cannot be read. */
int skv_test_maps(const char *name, int *n, int *advised, size_t *huge_kb, bool *aligned);
/* Whether shared memory can have transparent huge pages here
 * (/sys/kernel/mm/transparent_hugepage/shmem_enabled "advise", "always", "within_size" or "force").
 */
bool skv_test_shmem_thp(void);

/* Lower RLIMIT_NOFILE so that exactly `spare` more descriptors can be opened (the lowest free
 * ones); the previous limit goes to *was. 0, or -1 with errno. */
struct rlimit;
int skv_test_limit_fds(int spare, struct rlimit *was);

/* In a forked child that plays an attacker: become another user (`nobody`) when running as root,
 * raising RLIMIT_NOFILE to `nofile` first (0: leave it). 1 when the child now runs as another
 * user, 0 when it cannot switch (not root, no such user: `why` says so), -1 on a failed call.
 * Either way the child is killed when its parent exits (PR_SET_PDEATHSIG). */
int skv_test_become_other_user(int nofile, char *why, size_t cap);

/* Inside a PE: skv_init with the job's config (from the environment) and a timeout. */
int skv_test_init(skv_ctx_t **ctx, int timeout_ms);

/* Number of CUDA devices, probed in a forked child so that CUDA is never initialised in the
 * test process (its forked PEs could not use CUDA then). 0 without CUDA, a driver or a GPU;
 * `why` (may be NULL) gets the reason for 0. */
int skv_test_gpus(char *why, size_t cap);
/* Skip the current Criterion test unless `n` GPUs exist, with the reason. */
#define SKV_TEST_REQUIRE_GPUS(n)                                                      \
  do {                                                                                \
    char why_[256];                                                                   \
    int have_ = skv_test_gpus(why_, sizeof why_);                                     \
    if (have_ < (n)) cr_skip_test("needs %d GPU(s), found %d: %s", (n), have_, why_); \
  } while (0)

/* Deterministic-per-call fresh randomness: a seed from /dev/urandom, printed on failure. */
uint64_t skv_test_seed(void);
static inline uint64_t skv_test_rand(uint64_t *s) { /* splitmix64 */
  uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
void skv_test_fill_random(void *buf, size_t n, uint64_t *state);

/* Fail the current PE (child) with a message: prints "rank R: file:line: msg" and returns 1. */
#define PE_CHECK(cond, ...)                                                         \
  do {                                                                              \
    if (!(cond)) {                                                                  \
      fprintf(stderr, "PE check failed at %s:%d: %s: ", __FILE__, __LINE__, #cond); \
      fprintf(stderr, __VA_ARGS__);                                                 \
      fprintf(stderr, " (last error: %s)\n", skv_last_error());                     \
      return 1;                                                                     \
    }                                                                               \
  } while (0)

#endif
