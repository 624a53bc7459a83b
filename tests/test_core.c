/* Unit tests of the core layer: error table and names, thread-local last error, config
 * validation by field, environment resolution, logging levels, subsystems, sink, prefix. */
#define _GNU_SOURCE
#include "skv_test.h"

#include <criterion/criterion.h>
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

TestSuite(core, .timeout = 30);

/* ---- errors ---- */

static const int all_codes[] = {
#define X(name, value, msg) SKV_##name,
    SKV_ERRNO_MAP(X)
#undef X
};

Test(core, error_table_has_distinct_names_and_messages) {
  size_t n = sizeof all_codes / sizeof all_codes[0];
  cr_assert_geq(n, 20);
  for (size_t i = 0; i < n; i++) {
    const char *name = skv_err_name(all_codes[i]);
    /* named after an errno value: that value negated (as libuv); else symkv's own, apart */
    static const struct {
      const char *name;
      int err;
    } eq[] = {{"EINVAL", EINVAL}, {"ENOMEM", ENOMEM},   {"ETIMEDOUT", ETIMEDOUT},
              {"EPROTO", EPROTO}, {"ENOTSUP", ENOTSUP}, {"ESTALE", ESTALE},
              {"ENOSPC", ENOSPC}, {"EEXIST", EEXIST},   {"ERANGE", ERANGE}};
    int want = 0;
    for (size_t k = 0; k < sizeof eq / sizeof eq[0]; k++)
      if (strcmp(name + 4, eq[k].name) == 0) want = -eq[k].err;
    if (want)
      cr_assert_eq(all_codes[i], want, "%s is %d, not -%s", name, all_codes[i], name + 4);
    else
      cr_assert_lt(all_codes[i], -1000, "own code %s (%d) in errno space", name, all_codes[i]);
    cr_assert(strncmp(name, "SKV_E", 5) == 0, "name %s", name);
    cr_assert_gt(strlen(skv_strerror(all_codes[i])), 5);
    for (size_t j = 0; j < i; j++) {
      cr_assert_neq(all_codes[i], all_codes[j]);
      cr_assert_str_neq(name, skv_err_name(all_codes[j]));
    }
  }
  cr_assert_str_eq(skv_err_name(SKV_ETIMEDOUT), "SKV_ETIMEDOUT");
  cr_assert_str_eq(skv_err_name(0), "SKV_OK");
}

Test(core, errno_codes_pass_through) {
  cr_assert_str_eq(skv_err_name(-ENOENT), "ENOENT");
  cr_assert_str_eq(skv_strerror(-ENOENT), strerror(ENOENT));
  cr_assert(strstr(skv_err_name(-999999), "UNKNOWN") != NULL);
  cr_assert(strstr(skv_strerror(12345), "unknown") != NULL);
}

static void *other_thread(void *arg) {
  SKV_FAIL(SKV_ENOSPC, SKV_SUBSYS_POOL, "from the other thread");
  snprintf(arg, 256, "%s", skv_last_error());
  return NULL;
}

Test(core, last_error_is_thread_local_with_location) {
  skv_log_set_level(SKV_LOG_NONE, SKV_SUBSYS_ALL);
  skv_clear_error();
  cr_assert_str_eq(skv_last_error(), "");
  int rc = SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_INIT, "bad thing %d", 42);
  cr_assert_eq(rc, SKV_EINVAL);
  cr_assert(strstr(skv_last_error(), "bad thing 42") != NULL, "%s", skv_last_error());
  cr_assert(strstr(skv_last_error(), "SKV_EINVAL") != NULL);
  cr_assert(strstr(skv_last_error(), "test_core.c:") != NULL, "%s", skv_last_error());
  char buf[256];
  pthread_t t;
  pthread_create(&t, NULL, other_thread, buf);
  pthread_join(t, NULL);
  cr_assert(strstr(buf, "other thread") != NULL);
  cr_assert(strstr(skv_last_error(), "bad thing 42") != NULL, "overwritten by another thread: %s",
            skv_last_error());
}

Test(core, version_matches_header) {
  cr_assert_eq(skv_version(), (unsigned)SKV_VERSION_HEX);
  char want[32];
  snprintf(want, sizeof want, "%d.%d.%d", SKV_VERSION_MAJOR, SKV_VERSION_MINOR, SKV_VERSION_PATCH);
  cr_assert(strncmp(skv_version_string(), want, strlen(want)) == 0, "%s", skv_version_string());
}

/* ---- config ---- */

Test(core, config_init_and_validate) {
  skv_config_t c = SKV_CONFIG_INIT;
  cr_assert_eq(skv_config_validate(&c), 0);
  skv_config_t d;
  memset(&d, 0x5a, sizeof d);
  cr_assert_eq(skv_config_init(&d), 0);
  cr_assert_eq(memcmp(&c, &d, sizeof c), 0);
  cr_assert_eq(c.rank, -1);
  cr_assert_eq(c.size, sizeof(skv_config_t));
}

static void expect_invalid(skv_config_t *c, const char *field) {
  int rc = skv_config_validate(c);
  cr_assert_lt(rc, 0, "field %s accepted", field);
  cr_assert(strstr(skv_last_error(), field) != NULL, "error does not name %s: %s", field,
            skv_last_error());
}

Test(core, config_rejects_bad_fields_by_name) {
  skv_log_set_level(SKV_LOG_NONE, SKV_SUBSYS_ALL);
  skv_config_t c = SKV_CONFIG_INIT;
  c.world_size = 0;
  expect_invalid(&c, "config.world_size");
  c = (skv_config_t)SKV_CONFIG_INIT;
  c.rank = -2;
  expect_invalid(&c, "config.rank");
  c = (skv_config_t)SKV_CONFIG_INIT;
  c.rank = 4;
  c.world_size = 4;
  expect_invalid(&c, "config.rank");
  c = (skv_config_t)SKV_CONFIG_INIT;
  c.timeout_ms = 0;
  expect_invalid(&c, "config.timeout_ms");
  c = (skv_config_t)SKV_CONFIG_INIT;
  c.flags = 1;
  expect_invalid(&c, "config.flags");
  c = (skv_config_t)SKV_CONFIG_INIT;
  c.bootstrap = "tcp://127.0.0.1";
  expect_invalid(&c, "config.bootstrap");
  c.bootstrap = "tcp://127.0.0.1:70000";
  expect_invalid(&c, "config.bootstrap");
  c = (skv_config_t)SKV_CONFIG_INIT;
  c.token = "short";
  expect_invalid(&c, "config.token");
  c.token = "has a space in it";
  expect_invalid(&c, "config.token");
  c = (skv_config_t)SKV_CONFIG_INIT;
  c.local_size = 3;
  c.world_size = 2;
  expect_invalid(&c, "config.local_size");
}

Test(core, config_header_checks) {
  skv_log_set_level(SKV_LOG_NONE, SKV_SUBSYS_ALL);
  skv_config_t c = SKV_CONFIG_INIT;
  c.version = 99;
  cr_assert_eq(skv_config_validate(&c), SKV_EVERSION);
  c = (skv_config_t)SKV_CONFIG_INIT;
  c.size = 4;
  cr_assert_eq(skv_config_validate(&c), SKV_EVERSION);
  /* A struct from a "newer" header: unknown trailing fields that are set are rejected. */
  struct {
    skv_config_t c;
    uint64_t future;
  } big = {SKV_CONFIG_INIT, 0};
  big.c.size = sizeof big;
  cr_assert_eq(skv_config_validate(&big.c), 0);
  big.future = 7;
  cr_assert_eq(skv_config_validate(&big.c), SKV_EINVAL);
  cr_assert(strstr(skv_last_error(), "unknown fields") != NULL, "%s", skv_last_error());
  cr_assert_eq(skv_config_validate(NULL), SKV_EINVAL);
}

Test(core, config_set_by_name) {
  skv_log_set_level(SKV_LOG_NONE, SKV_SUBSYS_ALL);
  skv_config_t c = SKV_CONFIG_INIT;
  cr_assert_eq(skv_config_set(&c, "rank", "3"), 0);
  cr_assert_eq(c.rank, 3);
  cr_assert_eq(skv_config_set(&c, "timeout_ms", "1500"), 0);
  cr_assert_eq(c.timeout_ms, 1500);
  cr_assert_eq(skv_config_set(&c, "bootstrap", "tcp://[::1]:1234"), 0);
  cr_assert_str_eq(c.bootstrap, "tcp://[::1]:1234");
  cr_assert_eq(skv_config_set(&c, "rnak", "3"), SKV_EINVAL);
  cr_assert(strstr(skv_last_error(), "\"rnak\"") != NULL, "%s", skv_last_error());
  cr_assert_eq(skv_config_set(&c, "rank", "three"), SKV_EINVAL);
  cr_assert(strstr(skv_last_error(), "config.rank") != NULL, "%s", skv_last_error());
  cr_assert_eq(skv_config_set(&c, "world_size", "-5"), SKV_EINVAL);
  cr_assert(strstr(skv_last_error(), "out of range") != NULL, "%s", skv_last_error());
  cr_assert_eq(skv_config_set(&c, "token", "x"), SKV_EINVAL);
  cr_assert_eq(c.rank, 3, "a failed set must not change the config");
}

Test(core, config_resolves_environment_and_names_bad_variables) {
  skv_log_set_level(SKV_LOG_NONE, SKV_SUBSYS_ALL);
  setenv("SKV_RANK", "1", 1);
  setenv("SKV_WORLD_SIZE", "2", 1);
  setenv("SKV_BOOTSTRAP", "tcp://127.0.0.1:4567", 1);
  setenv("SKV_TOKEN", "0123456789abcdef", 1);
  setenv("SKV_TIMEOUT_MS", "2500", 1);
  skv__env_reload();
  skv__cfg_resolved_t r;
  cr_assert_eq(skv__config_resolve(NULL, &r), 0, "%s", skv_last_error());
  cr_assert_eq(r.rank, 1);
  cr_assert_eq(r.world_size, 2);
  /* Unset: skv_init takes the PEs it finds on this node (docs/reference.md). */
  cr_assert_eq(r.local_rank, -1);
  cr_assert_eq(r.local_size, -1);
  cr_assert_eq(r.port, 4567);
  cr_assert_str_eq(r.host, "127.0.0.1");
  cr_assert_str_eq(r.bind_addr, "127.0.0.1");
  cr_assert_eq(r.timeout_ms, 2500);
  /* The config wins over the environment. */
  skv_config_t c = SKV_CONFIG_INIT;
  c.rank = 0;
  c.timeout_ms = 99;
  cr_assert_eq(skv__config_resolve(&c, &r), 0);
  cr_assert_eq(r.rank, 0);
  cr_assert_eq(r.timeout_ms, 99);
  setenv("SKV_TIMEOUT_MS", "soon", 1);
  skv__env_reload();
  cr_assert_eq(skv__config_resolve(NULL, &r), SKV_EINVAL);
  cr_assert(strstr(skv_last_error(), "SKV_TIMEOUT_MS") != NULL, "%s", skv_last_error());
  setenv("SKV_TIMEOUT_MS", "100", 1);
  unsetenv("SKV_TOKEN");
  skv__env_reload();
  cr_assert_eq(skv__config_resolve(NULL, &r), SKV_EINVAL);
  cr_assert(strstr(skv_last_error(), "SKV_TOKEN") != NULL, "%s", skv_last_error());
  unsetenv("SKV_WORLD_SIZE");
  skv__env_reload();
  cr_assert_eq(skv__config_resolve(NULL, &r), SKV_EINVAL);
  cr_assert(strstr(skv_last_error(), "SKV_WORLD_SIZE") != NULL, "%s", skv_last_error());
}

Test(core, config_local_size_unset_means_the_pes_found_on_the_node) {
  skv_log_set_level(SKV_LOG_NONE, SKV_SUBSYS_ALL);
  setenv("SKV_RANK", "3", 1);
  setenv("SKV_WORLD_SIZE", "4", 1);
  setenv("SKV_BOOTSTRAP", "tcp://127.0.0.1:4567", 1);
  setenv("SKV_TOKEN", "0123456789abcdef", 1);
  unsetenv("SKV_LOCAL_SIZE");
  unsetenv("SKV_LOCAL_RANK");
  skv__env_reload();
  skv__cfg_resolved_t r;
  cr_assert_eq(skv__config_resolve(NULL, &r), 0, "%s", skv_last_error());
  cr_assert_eq(r.local_size, -1, "not world_size: a multi-node job has fewer PEs per node");
  cr_assert_eq(r.local_rank, -1);
  setenv("SKV_LOCAL_SIZE", "2", 1);
  skv__env_reload();
  cr_assert_eq(skv__config_resolve(NULL, &r), 0, "%s", skv_last_error());
  cr_assert_eq(r.local_size, 2);
  cr_assert_eq(r.local_rank, -1);
  skv_config_t c = SKV_CONFIG_INIT;
  c.local_rank = 2; /* not below SKV_LOCAL_SIZE=2 */
  cr_assert_eq(skv__config_resolve(&c, &r), SKV_EINVAL);
  unsetenv("SKV_LOCAL_SIZE");
  skv__env_reload();
  cr_assert_eq(skv__config_resolve(&c, &r), 0, "%s", skv_last_error());
  cr_assert_eq(r.local_rank, 2);
  cr_assert_eq(r.local_size, -1);
}

Test(core, parse_int_with_suffixes) {
  long long v;
  cr_assert(skv__parse_int("64K", 0, 1LL << 40, true, &v));
  cr_assert_eq(v, 65536);
  cr_assert(skv__parse_int("2MiB", 0, 1LL << 40, true, &v));
  cr_assert_eq(v, 2 << 20);
  cr_assert(!skv__parse_int("2X", 0, 1LL << 40, true, &v));
  cr_assert(!skv__parse_int("64K", 0, 1LL << 40, false, &v));
  cr_assert(!skv__parse_int("99999999999999999999", 0, 1LL << 40, false, &v));
  cr_assert(!skv__parse_int("5", 6, 7, false, &v));
  cr_assert(skv__consttime_eq("abc", 3, "abc", 3));
  cr_assert(!skv__consttime_eq("abc", 3, "abd", 3));
  cr_assert(!skv__consttime_eq("abc", 3, "abcd", 4));
}

/* ---- logging ---- */

typedef struct captured {
  int n;
  char lines[16][512];
  int levels[16];
} captured_t;

static void capture_sink(void *arg, int level, unsigned subsys, const char *line) {
  captured_t *c = arg;
  if (c->n < 16) {
    snprintf(c->lines[c->n], sizeof c->lines[0], "%s", line);
    c->levels[c->n] = level;
  }
  c->n++;
}

static int side_effects;
static int count_me(void) {
  return ++side_effects;
}

Test(core, logging_levels_subsystems_sink_and_prefix) {
  captured_t cap = {0};
  skv_log_set_sink(capture_sink, &cap);
  skv_log_set_level(SKV_LOG_INFO, SKV_SUBSYS_BOOT | SKV_SUBSYS_KV);
  SKV_INFO(SKV_SUBSYS_BOOT, "hello %d", 7);
  SKV_TRACE(SKV_SUBSYS_BOOT, "not shown %d", count_me());
  SKV_INFO(SKV_SUBSYS_HEAP, "not shown either %d", count_me());
  SKV_WARN(SKV_SUBSYS_KV, "warned");
  cr_assert_eq(side_effects, 0, "arguments were evaluated for a disabled level");
  cr_assert_eq(cap.n, 2);
  char want[128];
  snprintf(want, sizeof want, "%s:%d:", skv__hostname(), (int)getpid());
  cr_assert(strncmp(cap.lines[0], want, strlen(want)) == 0, "prefix: %s", cap.lines[0]);
  cr_assert(strstr(cap.lines[0], "[INFO BOOT] hello 7") != NULL, "%s", cap.lines[0]);
  cr_assert(strstr(cap.lines[1], "[WARN KV] warned") != NULL, "%s", cap.lines[1]);
  skv__log_rank = 5;
  SKV_INFO(SKV_SUBSYS_BOOT, "with rank");
  snprintf(want, sizeof want, "%s:%d:5 [INFO", skv__hostname(), (int)getpid());
  cr_assert(strstr(cap.lines[2], want) != NULL, "%s", cap.lines[2]);
  skv_log_write(SKV_LOG_WARN, SKV_SUBSYS_KV, "from a binding");
  cr_assert(strstr(cap.lines[3], "from a binding") != NULL);
  cr_assert_eq(skv_log_set_level(9, 0), SKV_EINVAL);
  skv_log_set_sink(NULL, NULL);
}

/* Issue 24: a failure is reported once, by its code and skv_last_error(); the library prints
 * nothing by default (it logs the failure at INFO), and a sink gets it once asked for INFO. */
Test(core, failures_are_logged_at_info_not_printed_by_default) {
  unsetenv("SKV_DEBUG");
  skv__env_reload();
  char path[] = "/tmp/skv-stderr-XXXXXX";
  int fd = mkstemp(path);
  cr_assert(fd >= 0);
  fflush(stderr);
  int saved = dup(2);
  dup2(fd, 2);
  skv_geometry_t g = SKV_GEOMETRY_INIT;
  uint64_t pb;
  int rc = skv_geometry_get_page_bytes(&g, &pb);
  dup2(saved, 2);
  close(saved);
  off_t len = lseek(fd, 0, SEEK_END);
  close(fd);
  unlink(path);
  cr_assert_eq(rc, SKV_EINVAL);
  cr_assert(strstr(skv_last_error(), "num_layers") != NULL, "%s", skv_last_error());
  cr_assert_eq(len, 0, "a failure the caller gets back was printed on stderr too (%lld bytes)",
               (long long)len);
  captured_t cap = {0};
  skv_log_set_sink(capture_sink, &cap);
  skv_log_set_level(SKV_LOG_INFO, SKV_SUBSYS_ALL);
  cr_assert_eq(skv_geometry_get_page_bytes(&g, &pb), SKV_EINVAL);
  skv_log_set_sink(NULL, NULL);
  skv_log_set_level(SKV_LOG_WARN, SKV_SUBSYS_ALL);
  cr_assert(cap.n >= 1 && cap.n <= 16, "got %d lines", cap.n); /* the failure, its breadcrumbs */
  cr_assert(strstr(cap.lines[0], skv_last_error()) != NULL, "%s", cap.lines[0]);
  for (int i = 0; i < cap.n; i++) cr_assert_eq(cap.levels[i], SKV_LOG_INFO, "%s", cap.lines[i]);
}

Test(core, logging_from_environment) {
  setenv("SKV_DEBUG", "TRACE", 1);
  setenv("SKV_DEBUG_SUBSYS", "ALL,^HEAP", 1);
  skv__env_reload();
  captured_t cap = {0};
  skv_log_set_sink(capture_sink, &cap);
  /* First use reads the environment. */
  SKV_TRACE(SKV_SUBSYS_POOL, "trace pool");
  SKV_WARN(SKV_SUBSYS_HEAP, "heap excluded");
  cr_assert_eq(cap.n, 1, "got %d lines", cap.n);
  cr_assert(strstr(cap.lines[0], "trace pool") != NULL);
  cr_assert(strstr(cap.lines[0], "test_core.c:") != NULL, "TRACE lines carry file:line: %s",
            cap.lines[0]);
  skv_log_set_sink(NULL, NULL);
}

/* A 0-or-1 parameter: the default unset, its value when 0 or 1, the default (warned once) for
 * anything else; decided once until the environment is reloaded. */
Test(core, switches_from_environment) {
  captured_t cap = {0};
  skv_log_set_sink(capture_sink, &cap);
  skv_log_set_level(SKV_LOG_WARN, SKV_SUBSYS_ALL);
  unsetenv("SKV_PUBLISH_PDL");
  skv__env_reload();
  cr_assert(skv__env_switch(SKV_ENV_PUBLISH_PDL, true, SKV_SUBSYS_KV));
  cr_assert(skv__env_switch(SKV_ENV_PUBLISH_PDL, false, SKV_SUBSYS_KV),
            "decided once: the first call's default stands");
  skv__env_reload();
  cr_assert_not(skv__env_switch(SKV_ENV_PUBLISH_PDL, false, SKV_SUBSYS_KV));
  setenv("SKV_PUBLISH_PDL", "0", 1);
  skv__env_reload();
  cr_assert_not(skv__env_switch(SKV_ENV_PUBLISH_PDL, true, SKV_SUBSYS_KV));
  setenv("SKV_PUBLISH_PDL", "1", 1);
  skv__env_reload();
  cr_assert(skv__env_switch(SKV_ENV_PUBLISH_PDL, false, SKV_SUBSYS_KV));
  cr_assert_eq(cap.n, 0, "no warning for 0 or 1: %s", cap.n ? cap.lines[0] : "");
  setenv("SKV_PUBLISH_PDL", "yes", 1);
  skv__env_reload();
  cr_assert(skv__env_switch(SKV_ENV_PUBLISH_PDL, true, SKV_SUBSYS_KV));
  cr_assert(skv__env_switch(SKV_ENV_PUBLISH_PDL, true, SKV_SUBSYS_KV));
  cr_assert_eq(cap.n, 1, "warned once, got %d lines", cap.n);
  cr_assert(strstr(cap.lines[0], "SKV_PUBLISH_PDL must be 0 or 1; using 1") != NULL, "%s",
            cap.lines[0]);
  unsetenv("SKV_PUBLISH_PDL");
  skv__env_reload();
  skv_log_set_sink(NULL, NULL);
}

/* A rate-limited site writes SKV_LOG_RL_BURST lines per window and counts the rest; a disabled
 * level neither writes nor counts (nor evaluates its arguments). */
Test(core, rate_limited_logging) {
  captured_t cap = {0};
  skv_log_set_sink(capture_sink, &cap);
  skv_log_set_level(SKV_LOG_WARN, SKV_SUBSYS_ALL);
  uint64_t before = skv__ratelimit_suppressed_total();
  for (int i = 0; i < 100; i++) SKV_WARN_RL(SKV_SUBSYS_BOOT, "hostile %d", i);
  cr_assert_eq(cap.n, SKV_LOG_RL_BURST, "%d lines written", cap.n);
  cr_assert(strstr(cap.lines[0], "hostile 0") != NULL, "%s", cap.lines[0]);
  cr_assert_eq(skv__ratelimit_suppressed_total() - before, 100 - SKV_LOG_RL_BURST);
  for (int i = 0; i < 5; i++) SKV_INFO_RL(SKV_SUBSYS_BOOT, "off %d", count_me());
  cr_assert_eq(side_effects, 0, "arguments were evaluated for a disabled level");
  cr_assert_eq(skv__ratelimit_suppressed_total() - before, 100 - SKV_LOG_RL_BURST);
  /* a next window starts with the count of what was suppressed */
  skv__ratelimit_t rl = {skv__now_ms() - SKV_LOG_RL_WINDOW_MS, SKV_LOG_RL_BURST, 7};
  uint64_t n = 0;
  cr_assert(skv__ratelimit_take(&rl, &n) && n == 7, "suppressed %llu", (unsigned long long)n);
  skv_log_set_sink(NULL, NULL);
}

/* The names before 0.2 still link and call the functions that replaced them (one release). */
/* ---- the helper thread (core/helper.c) ---- */

typedef struct hjob {
  pthread_t caller;
  int runs;      /* how often the job ran (once, whoever ran it) */
  bool helped;   /* the helper ran it */
  useconds_t us; /* how long it takes */
  int ran;       /* set (atomic) once it ran */
} hjob_t;

static void hjob_run(void *arg) {
  hjob_t *j = arg;
  j->helped = !pthread_equal(pthread_self(), j->caller);
  if (j->us) usleep(j->us);
  j->runs++;
  __atomic_store_n(&j->ran, 1, __ATOMIC_RELEASE);
}

Test(core, helper_runs_each_job_once_by_whoever_comes_first) {
  skv__helper_t *h;
  cr_assert_eq(skv__helper_create(SKV_SUBSYS_KV, "test", &h), 0, "%s", skv_last_error());
  /* a burst: the helper spins for jobs and takes most of them while the caller is busy */
  skv__helper_burst(h, true);
  int helped = 0;
  for (int i = 0; i < 200; i++) {
    hjob_t j = {pthread_self(), 0, false, 0, 0};
    cr_assert(skv__helper_post(h, hjob_run, &j));
    usleep(200); /* the caller's other work */
    skv__helper_join(h);
    cr_assert_eq(j.runs, 1, "job %d ran %d times", i, j.runs);
    helped += j.helped;
  }
  cr_assert_gt(helped, 0, "the helper took none of 200 jobs posted 200 us before their join");
  /* joined at once: taken back and run by the caller, or waited for; once either way */
  for (int i = 0; i < 2000; i++) {
    hjob_t j = {pthread_self(), 0, false, (useconds_t)(i % 3 == 0), 0};
    cr_assert(skv__helper_post(h, hjob_run, &j));
    skv__helper_join(h);
    cr_assert_eq(j.runs, 1, "job %d ran %d times", i, j.runs);
  }
  /* no burst: the helper sleeps after its linger; a posted job wakes it */
  skv__helper_burst(h, false);
  usleep(20000);
  hjob_t j = {pthread_self(), 0, false, 0, 0};
  cr_assert(skv__helper_post(h, hjob_run, &j));
  for (int ms = 0; ms < 10000 && !__atomic_load_n(&j.ran, __ATOMIC_ACQUIRE); ms++) usleep(1000);
  skv__helper_join(h);
  cr_assert_eq(j.runs, 1);
  cr_assert(j.helped, "a job posted to a sleeping helper was not taken in 10 s");
  skv__helper_destroy(h);
  skv__helper_destroy(NULL);
}

Test(core, helper_refuses_jobs_in_a_forked_child) {
  skv__helper_t *h;
  cr_assert_eq(skv__helper_create(SKV_SUBSYS_KV, "test", &h), 0, "%s", skv_last_error());
  pid_t pid = fork();
  if (pid == 0) {
    /* no helper thread here: post and usable say so, burst and destroy touch no lock of the
     * parent's; and no Criterion call (the child is not a test process of the runner's) */
    hjob_t j = {pthread_self(), 0, false, 0, 0};
    skv__helper_burst(h, true);
    const bool usable = skv__helper_usable(h);
    const bool posted = skv__helper_post(h, hjob_run, &j);
    skv__helper_destroy(h);
    _exit(posted || usable ? 1 : 0);
  }
  cr_assert_geq(pid, 0, "fork: %s", strerror(errno));
  int st = 0;
  cr_assert_eq(waitpid(pid, &st, 0), pid);
  cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0, "the child's helper was usable (status %d)", st);
  hjob_t j = {pthread_self(), 0, false, 0, 0};
  cr_assert(skv__helper_post(h, hjob_run, &j));
  skv__helper_join(h);
  cr_assert_eq(j.runs, 1);
  skv__helper_destroy(h);
}

/* A thread that may run on one CPU only would share it with the spinning helper. */
static void *usable_on_one_cpu(void *arg) {
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(sched_getcpu() >= 0 ? sched_getcpu() : 0, &one);
  if (sched_setaffinity(0, sizeof one, &one) != 0) return (void *)2;
  return (void *)(uintptr_t)(skv__helper_usable(arg) ? 1 : 0);
}

Test(core, helper_is_not_used_by_a_thread_pinned_to_one_cpu) {
  skv__helper_t *h;
  cr_assert_eq(skv__helper_create(SKV_SUBSYS_KV, "test", &h), 0, "%s", skv_last_error());
  cpu_set_t cs;
  CPU_ZERO(&cs);
  cr_assert_eq(sched_getaffinity(0, sizeof cs, &cs), 0);
  cr_assert_eq(skv__helper_usable(h), CPU_COUNT(&cs) >= 2, "usable with %d CPUs", CPU_COUNT(&cs));
  pthread_t t;
  void *r = NULL;
  cr_assert_eq(pthread_create(&t, NULL, usable_on_one_cpu, h), 0);
  cr_assert_eq(pthread_join(t, &r), 0);
  cr_assert_eq((uintptr_t)r, 0, "pinned to one CPU: %s", r == (void *)2 ? "no affinity" : "usable");
  cr_assert_not(skv__helper_usable(NULL));
  skv__helper_destroy(h);
}

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
Test(core, deprecated_names_call_their_replacements) {
  skv_geometry_t g = SKV_GEOMETRY_INIT;
  g.num_layers = 2, g.num_kv_heads = 4, g.head_dim = 8, g.elem_bytes = 2, g.page_tokens = 16;
  uint64_t a = 0, b = 0;
  cr_assert_eq(skv_geometry_page_bytes(&g, &a), 0);
  cr_assert_eq(skv_geometry_get_page_bytes(&g, &b), 0);
  cr_assert_eq(a, b);
  cr_assert_eq(a, 2ull * 2 * 16 * 4 * 8 * 2);
  g.num_layers = 0;
  cr_assert_eq(skv_geometry_page_bytes(&g, &a), SKV_EINVAL);
  cr_assert(strstr(skv_last_error(), "num_layers") != NULL, "%s", skv_last_error());
  skv_namespace_t *ns;
  g.num_layers = 2;
  cr_assert_eq(skv_namespace_create("m", &g, NULL, 0, "s", 1, &ns), 0);
  const uint32_t tok[32] = {1, 2, 3};
  skv_key_t k1[2], k2[2];
  size_t n1 = 0, n2 = 0;
  cr_assert_eq(skv_hash_tokens(ns, tok, 32, NULL, k1, 2, &n1), 0);
  cr_assert_eq(skv_namespace_hash_tokens(ns, tok, 32, NULL, k2, 2, &n2), 0);
  cr_assert(n1 == 2 && n2 == 2 && memcmp(k1, k2, sizeof k1) == 0);
  cr_assert_eq(skv_key_from_bytes(ns, "abc", 3, &k1[0]), 0);
  cr_assert_eq(skv_namespace_hash_bytes(ns, "abc", 3, &k2[0]), 0);
  cr_assert(memcmp(&k1[0], &k2[0], sizeof k1[0]) == 0);
  cr_assert_null(skv_heap_ptr(NULL, 0, 0));
  cr_assert_eq(skv_lookup(NULL, ns, k1, 1, 0, NULL, &n1), SKV_EINVAL);
  cr_assert(strstr(skv_last_error(), "skv_kv_lookup") != NULL, "%s", skv_last_error());
  skv_namespace_destroy(ns);
}
#pragma GCC diagnostic pop
