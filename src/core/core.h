/* Internal declarations of the core layer: errors, logging, environment parameters, time.
 * Grouped by the file that defines them. Every other layer includes this. */
#ifndef SKV_CORE_H
#define SKV_CORE_H

#include "symkv.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <time.h>

#define SKV_UNUSED(x)      ((void)(x))
#define SKV_ARRAY_LEN(a)   (sizeof(a) / sizeof((a)[0]))
#define SKV_MIN(a, b)      ((a) < (b) ? (a) : (b))
#define SKV_MAX(a, b)      ((a) > (b) ? (a) : (b))
#define SKV_ALIGN_UP(x, a) ((((x) + (a)-1) / (a)) * (a))

#if defined(__GNUC__)
#define SKV_PRINTF(f, a) __attribute__((format(printf, f, a)))
#define SKV_LIKELY(x)    __builtin_expect(!!(x), 1)
#define SKV_UNLIKELY(x)  __builtin_expect(!!(x), 0)
#else
#define SKV_PRINTF(f, a)
#define SKV_LIKELY(x)   (x)
#define SKV_UNLIKELY(x) (x)
#endif

/* Spin-wait hint. */
#if defined(__x86_64__) || defined(__i386__)
#define SKV_CPU_RELAX() __builtin_ia32_pause()
#elif defined(__aarch64__)
#define SKV_CPU_RELAX() __asm__ __volatile__("yield")
#else
#define SKV_CPU_RELAX() ((void)0)
#endif

/* Bring a line in to be written (a CAS, a store): exclusive, so that the locked op that follows
 * does not wait for the other cores' copies to be invalidated (a read prefetch leaves a line
 * that another core holds shared). __builtin_prefetch(p, 1) is a read prefetch on x86-64 unless
 * the compiler is told the CPU has PREFETCHW (every x86-64 CPU since 2014 does; older ones run
 * it as a NOP). */
#if defined(__x86_64__)
#define SKV_PREFETCH_W(p) __asm__ __volatile__("prefetchw %0" ::"m"(*(const char *)(p)))
#else
#define SKV_PREFETCH_W(p) __builtin_prefetch((p), 1)
#endif

/* ---- error.c ------------------------------------------------------------------------------ */

/* Record `err` with a formatted message as the thread's last error, log it at INFO (subsys),
 * and return `err`. The caller reports it (the code and skv_last_error()); WARN is for what no
 * return code reports (SKV_WARN). */
int skv__set_error(int err, unsigned subsys, const char *file, int line, const char *fmt, ...)
    SKV_PRINTF(5, 6);
/* Put back a last-error text saved earlier (skv_last_error() copied), without logging it
 * again: for cleanup steps whose own failures must not replace the one being reported. */
void skv__error_restore(const char *saved);
/* Breadcrumb for a propagated failure: logged at INFO as "file:line <- call: SKV_EX". */
void skv__error_trace(int err, const char *file, int line, const char *expr);

/* Fail with `err` and a message (say what failed and what to do next). */
#define SKV_FAIL(err, subsys, ...) skv__set_error((err), (subsys), __FILE__, __LINE__, __VA_ARGS__)

/* Propagate a failing symkv call, leaving a breadcrumb. */
#define SKV_CHECK(call)                                    \
  do {                                                     \
    int skv_r_ = (call);                                   \
    if (SKV_UNLIKELY(skv_r_ < 0)) {                        \
      skv__error_trace(skv_r_, __FILE__, __LINE__, #call); \
      return skv_r_;                                       \
    }                                                      \
  } while (0)

/* Same, but store the code in `rc` and jump to `label` for single-exit cleanup. */
#define SKV_CHECK_GOTO(call, rc, label)                  \
  do {                                                   \
    (rc) = (call);                                       \
    if (SKV_UNLIKELY((rc) < 0)) {                        \
      skv__error_trace((rc), __FILE__, __LINE__, #call); \
      goto label;                                        \
    }                                                    \
  } while (0)

/* Always-on argument check: fail with SKV_EINVAL naming the condition. */
#define SKV_ARG_CHECK(cond, subsys, ...)                                           \
  do {                                                                             \
    if (SKV_UNLIKELY(!(cond))) return SKV_FAIL(SKV_EINVAL, (subsys), __VA_ARGS__); \
  } while (0)

/* Debug invariants (SKV_DEBUG_LEVEL >= 1) and expensive walkers (>= 2), checked at run time so
 * that one build serves all tiers. A failed invariant aborts: memory may already be wrong. */
extern int skv__debug_level;
void skv__assert_fail(const char *expr, const char *file, int line);
#define SKV_ASSERT(cond)                                                                    \
  do {                                                                                      \
    if (SKV_UNLIKELY(__atomic_load_n(&skv__debug_level, __ATOMIC_RELAXED) >= 1) && !(cond)) \
      skv__assert_fail(#cond, __FILE__, __LINE__);                                          \
  } while (0)

/* ---- log.c -------------------------------------------------------------------------------- */

extern int skv__log_level;       /* -1 until SKV_DEBUG was read */
extern unsigned skv__log_subsys; /* mask of enabled subsystems */
extern int skv__log_rank;        /* -1 until skv_init knows it */
void skv__log_init(void);
void skv__log(int level, unsigned subsys, const char *file, int line, const char *fmt, ...)
    SKV_PRINTF(5, 6);
void skv__vlog(int level, unsigned subsys, const char *file, int line, const char *fmt, va_list ap);

static inline bool skv__log_on(int level, unsigned subsys) {
  if (SKV_UNLIKELY(skv__log_level < 0)) skv__log_init();
  return level <= skv__log_level && (subsys & skv__log_subsys) != 0;
}

/* The level check happens before any argument is evaluated or formatted. */
#define SKV_LOG(level, subsys, ...)                                 \
  do {                                                              \
    if (skv__log_on((level), (subsys)))                             \
      skv__log((level), (subsys), __FILE__, __LINE__, __VA_ARGS__); \
  } while (0)
#define SKV_WARN(subsys, ...)  SKV_LOG(SKV_LOG_WARN, subsys, __VA_ARGS__)
#define SKV_INFO(subsys, ...)  SKV_LOG(SKV_LOG_INFO, subsys, __VA_ARGS__)
#define SKV_TRACE(subsys, ...) SKV_LOG(SKV_LOG_TRACE, subsys, __VA_ARGS__)

/* ---- ratelimit.c -------------------------------------------------------------------------- */

/* Lines that other processes can cause at will (hostile connections to the store or to the fd
 * exchange) or that a hot path may repeat (evictions, inserts) are rate-limited per call site:
 * at most SKV_LOG_RL_BURST lines per SKV_LOG_RL_WINDOW_MS window; the first line of the next
 * window says how many were suppressed. A site's state is a static skv__ratelimit_t. */
#define SKV_LOG_RL_BURST     10
#define SKV_LOG_RL_WINDOW_MS 10000
typedef struct skv__ratelimit {
  uint64_t window_ms; /* start of the current window (skv__now_ms), 0 before the first line */
  uint32_t lines;     /* lines written in it */
  uint32_t suppressed;
} skv__ratelimit_t;
/* May this site write a line now? *suppressed gets the lines suppressed since the last one
 * written (to be mentioned in it). Thread-safe. */
bool skv__ratelimit_take(skv__ratelimit_t *rl, uint64_t *suppressed);
/* Lines suppressed by every rate limit of the process so far (tests, stats). */
uint64_t skv__ratelimit_suppressed_total(void);
void skv__log_suppressed(int level, unsigned subsys, uint64_t n);

#define SKV_LOG_RL(level, subsys, ...)                                                 \
  do {                                                                                 \
    static skv__ratelimit_t skv_rl_;                                                   \
    uint64_t skv_rl_n_;                                                                \
    if (skv__log_on((level), (subsys)) && skv__ratelimit_take(&skv_rl_, &skv_rl_n_)) { \
      if (skv_rl_n_) skv__log_suppressed((level), (subsys), skv_rl_n_);                \
      skv__log((level), (subsys), __FILE__, __LINE__, __VA_ARGS__);                    \
    }                                                                                  \
  } while (0)
#define SKV_WARN_RL(subsys, ...) SKV_LOG_RL(SKV_LOG_WARN, subsys, __VA_ARGS__)
#define SKV_INFO_RL(subsys, ...) SKV_LOG_RL(SKV_LOG_INFO, subsys, __VA_ARGS__)

/* ---- env.c -------------------------------------------------------------------------------- */

/* Every SKV_* environment variable the library reads: name, default, allowed values, meaning
 * (docs/reference.md has one row per entry, in this order; a test compares them). Read once, on
 * first use; the ones that are set are logged (INIT, INFO) and unknown SKV_* names are warned
 * about, except the ones symkv's tools, bindings and tests read (SKV_ENV_TOOL_NAMES). */
/* clang-format off */
#define SKV_ENV_MAP(XX)                                                                          \
  XX(DEBUG, "WARN", "NONE, WARN, INFO or TRACE", "log level")                                    \
  XX(DEBUG_SUBSYS, "ALL", "comma list of INIT,BOOT,HEAP,POOL,INDEX,KV,COMM,BENCH or ALL; ^X excludes X", \
     "subsystems that log")                                                                      \
  XX(DEBUG_FILE, "stderr", "a path (%h host, %p pid)", "write log lines to this file")           \
  XX(DEBUG_LEVEL, "0", "0..2", "0: argument checks only, 1: + invariants, 2: + expensive walkers") \
  XX(RANK, "required", "0..65535, below SKV_WORLD_SIZE", "this PE's rank")                       \
  XX(WORLD_SIZE, "required", "1..65536", "number of PEs")                                         \
  XX(LOCAL_RANK, "position among the node's PEs", "0..1023", "rank among the PEs of this node")   \
  XX(LOCAL_SIZE, "PEs found on this node", "1..1024, must match", "number of PEs on this node")   \
  XX(BOOTSTRAP, "required", "tcp://HOST:PORT or tcp://[IPv6]:PORT", "rank 0's bootstrap store")  \
  XX(TOKEN, "required", "8..128 printable characters", "secret every PE presents to the store")  \
  XX(BIND_ADDR, "the host of SKV_BOOTSTRAP", "a host name or address", "where rank 0's store listens") \
  XX(TIMEOUT_MS, "60000", "1..86400000", "bound on every wait, in milliseconds")                  \
  XX(DEVICE, "local rank modulo the GPUs", "0..1023", "CUDA device of this PE")                   \
  XX(NCCL_ALLREDUCE, "1", "0 or 1", "0 disables the NCCL all-reduce fallback")                    \
  XX(ALLREDUCE_ONESHOT_MAX, "by PE count", "0..1T bytes (K/M/G/T suffixes)",                      \
     "all-reduce AUTO: largest one-shot message")                                                \
  XX(ALLREDUCE_TWOSHOT_MAX, "by PE count", "0..1T bytes (K/M/G/T suffixes)",                      \
     "all-reduce AUTO: largest two-shot message")                                                \
  XX(COMM_PDL, "1", "0 or 1", "0 launches the comm kernels without programmatic dependent launch") \
  XX(COMM_BLOCKS_PER_SM, "2", "1..3", "CUDA all-reduce: blocks per multiprocessor of a launch (PEs with a GPU each)") \
  XX(COMM_STREAMING, "1", "0 or 1", "0: CUDA all-reduce launches of 8 MiB or more read and write the caller's buffers through L2 as usual, not evict-first") \
  XX(COMM_CHUNK, "16M", "64K..1G bytes (K/M/G suffixes)",                                          \
     "CUDA all-reduce: most bytes one launch carries; each channel's scratch is 4x this")        \
  XX(COMM_CHECK, "0", "0 or 1", "1 checks every all-reduce and barrier of every comm against every PE's (checking mode)") \
  XX(FETCH_KERNEL, "auto", "auto, bulk, vec or ce", "KV copy: TMA bulk copies for fetches of 8 MiB and more and 16-byte loads below (auto), or always one of TMA bulk copies, 16-byte loads, copy engines") \
  XX(FETCH_UNROLL, "4", "4 or 8", "KV copy kernels: 16-byte loads in flight per thread")          \
  XX(FETCH_CTAS, "4", "1..32 (occupancy caps it)", "KV copy kernels: CTAs per multiprocessor")    \
  XX(FETCH_THREADS, "256", "128, 256 or 512", "KV copy kernels: threads per CTA")                 \
  XX(FETCH_GATE_PAGES, "256", "0..4096 (0: never)", "KV fetch into GPU blocks: a batch of this many pages or more starts its copy first and pins its pages while the copy waits for them (on SKV_ESTALE, blocks of references before the stale one may be written)") \
  XX(PUBLISH_HELPER, "1", "0 or 1", "KV publish of more than one window of pages (over 256): a helper thread claims the next window's index slots while the caller allocates and copies this one, and evicts a free reserve ahead (skv_kv_set_free_reserve); 0: the caller does it all, nothing is evicted ahead") \
  XX(PUBLISH_PDL, "1", "0 or 1", "KV publish into GPU pages: the launches of a batch after its first are programmatic dependent launches (each begins while the one before ends); 0 launches them one after the other")                                 \
  XX(PIN_LEASE_MS, "30000", "0..86400000 (0: pins never expire)",                                \
     "a pin's lease: a live PE that makes no KV call for this long loses pins others need")     \
  XX(HASH_SECRET, "none", "any bytes", "deployment secret mixed into every key (when the caller passes none)") \
  XX(REDIS_URL, "none (node-local)", "redis://HOST:PORT[/DB]", "the cluster directory (skv_cluster_join, when opts give none)") \
  XX(CLUSTER_LEASE_MS, "10000", "200..86400000", "lease of a node's cluster directory entries (renewed every third of it)")
/* clang-format on */

/* SKV_* variables that symkv's launcher, tools, bindings and tests read (not the library): the
 * library does not warn about them. */
#define SKV_ENV_TOOL_NAMES                                                                     \
  "SKV_RUN_PID", "SKV_RUN", "SKV_LIBRARY", "SKV_TEST_BIN_DIR", "SKV_TEST_STRESS_SECONDS",      \
      "SKV_HEAP_BACKEND", "SKV_BENCH_PES", "SKV_TRACE", "SKV_TRACE_PES", "SKV_HOST_KIND",      \
      "SKV_WITH_TORCH", "SKV_WITH_PYTHON_DEPS", "SKV_WITH_VLLM", "SKV_VLLM_TP2", "SKV_NO_MPS", \
      "SKV_SIZES", "SKV_BENCH_DEBUG", "SKV_TORCH_CPP"

/* clang-format off */
typedef enum skv__env_id {
#define SKV__ENV_ENUM(name, def, range, doc) SKV_ENV_##name,
  SKV_ENV_MAP(SKV__ENV_ENUM)
#undef SKV__ENV_ENUM
  SKV_ENV_COUNT
} skv__env_id_t;
/* clang-format on */

/* Value of SKV_<name> as read at first use, or NULL when unset or empty. */
const char *skv__env(skv__env_id_t id);
/* Parse an integer parameter; `def` when unset. Bad values fail naming the variable. */
int skv__env_int(skv__env_id_t id, long long lo, long long hi, long long def, long long *out);
const char *skv__env_name(skv__env_id_t id);
/* A 0-or-1 parameter, read and decided once (until skv__env_reload): `def` when unset, and when
 * set to anything else (warned once, under `subsys`). */
bool skv__env_switch(skv__env_id_t id, bool def, unsigned subsys);
/* Log the SKV_* variables that are set (INFO) and warn about unknown SKV_* names; the first
 * call of the process does it, later calls nothing. skv_init calls it. */
void skv__env_report(void);
/* Re-read the environment (tests only). */
void skv__env_reload(void);

/* ---- config.c ----------------------------------------------------------------------------- */

/* A configuration with the environment and defaults applied, every field checked. */
typedef struct skv__cfg_resolved {
  int rank, world_size, local_rank, local_size, timeout_ms, device;
  char host[256];      /* bootstrap host (rank 0's store) */
  int port;            /* bootstrap port */
  char token[129];     /* shared token */
  char bind_addr[256]; /* where rank 0 listens */
} skv__cfg_resolved_t;

int skv__config_resolve(const skv_config_t *cfg, skv__cfg_resolved_t *out);
/* Parse "tcp://HOST:PORT" (HOST may be [IPv6]); `what` names the source in errors. */
int skv__parse_bootstrap(const char *addr, const char *what, char *host, size_t hcap, int *port);

/* ---- helper.c ----------------------------------------------------------------------------- */

/* A helper thread that may run one job at a time for a caller who could run it too: the caller
 * posts a job, does other work, then joins it (runs it itself if the helper has not taken it,
 * else waits for it to end). While a burst is on the helper spins for jobs; between bursts it
 * sleeps. One caller at a time; a forked child's post() is refused (no thread there). */
typedef struct skv__helper skv__helper_t;
int skv__helper_create(unsigned subsys, const char *what, skv__helper_t **out);
void skv__helper_destroy(skv__helper_t *h);
/* Worth using from this thread: the helper is this process's, and the thread may run on more
 * than one CPU (the helper spins beside it). */
bool skv__helper_usable(const skv__helper_t *h);
/* A burst of jobs begins (the helper spins for them) or ends (it sleeps after a linger). */
void skv__helper_burst(skv__helper_t *h, bool on);
/* false: not posted (no helper, or another process's): run fn yourself. */
bool skv__helper_post(skv__helper_t *h, void (*fn)(void *), void *arg);
void skv__helper_join(skv__helper_t *h);

/* ---- util.c ------------------------------------------------------------------------------- */

/* pthread_create for symkv's background threads: the thread starts with every signal blocked,
 * so that signals stay the engine's threads' (and a write to a dead peer fails with EPIPE there
 * instead of raising SIGPIPE). Returns pthread_create's result. */
int skv__thread_start(pthread_t *t, void *(*fn)(void *), void *arg);
/* Monotonic clock in nanoseconds / milliseconds. */
uint64_t skv__now_ns(void);
static inline uint64_t skv__now_ms(void) {
  return skv__now_ns() / 1000000u;
}
/* The time skv__now_ns() reads as `ns`, as a timespec of CLOCK_MONOTONIC: a deadline for
 * pthread_cond_timedwait on condition variables set to that clock. */
static inline struct timespec skv__ts_at(uint64_t ns) {
  struct timespec t = {(time_t)(ns / 1000000000u), (long)(ns % 1000000000u)};
  return t;
}
/* Milliseconds from now to `deadline` (skv__now_ms() time), 0 once passed, at most INT32_MAX:
 * a poll() timeout. */
static inline int skv__ms_left(uint64_t deadline) {
  uint64_t now = skv__now_ms();
  if (now >= deadline) return 0;
  uint64_t d = deadline - now;
  return d > INT32_MAX ? INT32_MAX : (int)d;
}
/* Wait for poll() event `ev` on fd until the deadline: 0, SKV_ETIMEDOUT or -errno. */
int skv__wait_fd(int fd, short ev, uint64_t deadline);
/* Parse a decimal integer in [lo, hi] with an optional K/M/G/T (binary) suffix when
 * `allow_suffix`; returns false on junk or overflow. */
bool skv__parse_int(const char *s, long long lo, long long hi, bool allow_suffix, long long *out);
/* Fill `buf` with `n` bytes from the kernel's random source. */
int skv__random_bytes(void *buf, size_t n);
/* Constant-time comparison of two byte strings (lengths compared too). */
bool skv__consttime_eq(const void *a, size_t alen, const void *b, size_t blen);
/* Human-readable bytes ("64 KiB") into buf. */
const char *skv__fmt_bytes(uint64_t bytes, char *buf, size_t cap);
/* Host name (cached). */
const char *skv__hostname(void);

#endif /* SKV_CORE_H */
