/* Multi-PE tests of the context: init/finalize, host collectives, the store API, the
 * collective check across PEs, wrong tokens, and PEs that die or stall mid-collective. */
#define _GNU_SOURCE
#include "skv_test.h"

#include "bootstrap/ctx.h"

#include <criterion/criterion.h>
#include <criterion/parameterized.h>
#include <errno.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

TestSuite(ctx, .timeout = 120);

static int pe_basic(int rank, int npes, void *arg) {
  skv_ctx_t *ctx;
  PE_CHECK(skv_test_init(&ctx, 20000) == 0, "init");
  PE_CHECK(skv_ctx_get_rank(ctx) == rank, "rank %d", skv_ctx_get_rank(ctx));
  PE_CHECK(skv_ctx_get_world_size(ctx) == npes, "world");
  PE_CHECK(skv_ctx_get_local_size(ctx) == npes && skv_ctx_get_local_rank(ctx) == rank, "local");
  const uint64_t seq0 = ctx->coll_seq; /* the round 0 allgather is check seq0 + 1 */
  /* allgather of distinct values, several rounds */
  for (int round = 0; round < 20; round++) {
    uint64_t mine = (uint64_t)rank * 1000003u + (uint64_t)round, all[SKV_TEST_MAX_PES];
    PE_CHECK(skv_ctx_allgather(ctx, &mine, all, sizeof mine) == 0, "allgather");
    for (int r = 0; r < npes; r++)
      PE_CHECK(all[r] == (uint64_t)r * 1000003u + (uint64_t)round, "allgather slot %d round %d", r,
               round);
    char msg[32] = {0};
    int root = round % npes;
    if (rank == root) snprintf(msg, sizeof msg, "from %d in %d", root, round);
    PE_CHECK(skv_ctx_broadcast(ctx, msg, sizeof msg, root) == 0, "broadcast");
    char want[32];
    snprintf(want, sizeof want, "from %d in %d", root, round);
    PE_CHECK(strcmp(msg, want) == 0, "broadcast got '%s'", msg);
    PE_CHECK(skv_ctx_barrier(ctx) == 0, "barrier");
  }
  /* Key lifetime: every rank's keys of the first round's collectives (its allgather and
   * broadcast) are gone; those of the last collective (a barrier) wait for the next check. */
  const unsigned long long ag = seq0 + 1, bc = seq0 + 2, last = ctx->coll_seq;
  for (int r = 0; r <= npes; r++) {
    for (int i = 0; i < 4; i++) {
      char k[64];
      if (r == npes && i > 0) break;
      if (r == npes)
        snprintf(k, sizeof k, "bc/%llu", bc); /* the broadcast's one key, by its root */
      else if (i == 0)
        snprintf(k, sizeof k, "coll/%llu/%d", ag, r);
      else if (i == 1)
        snprintf(k, sizeof k, "ag/%llu/%d", ag, r);
      else if (i == 2)
        snprintf(k, sizeof k, "coll/%llu/%d", bc, r);
      else
        snprintf(k, sizeof k, "coll/%llu/%d", last, r);
      void *v = NULL;
      size_t n = 0;
      int got = skv__store_try_get(ctx->store, k, &v, &n);
      free(v);
      PE_CHECK(i < 3 ? got == SKV_ENOTFOUND : got == 0, "store key %s: %s", k, skv_err_name(got));
    }
  }
  PE_CHECK(skv_ctx_barrier(ctx) == 0, "barrier"); /* nobody deletes a key another still reads */
  /* the public store */
  char key[32];
  snprintf(key, sizeof key, "user/%d", rank);
  PE_CHECK(skv_store_set(ctx, key, &rank, sizeof rank) == 0, "set");
  int64_t total = 0;
  PE_CHECK(skv_store_add(ctx, "user/counter", rank + 1, &total) == 0, "add");
  snprintf(key, sizeof key, "user/%d", (rank + 1) % npes);
  int peer = -1;
  size_t len = 0;
  PE_CHECK(skv_store_get(ctx, key, &peer, sizeof peer, &len) == 0 && len == sizeof peer, "get");
  PE_CHECK(peer == (rank + 1) % npes, "peer value %d", peer);
  char small[1];
  PE_CHECK(skv_store_get(ctx, key, small, sizeof small, &len) == SKV_ERANGE && len == sizeof peer,
           "ERANGE");
  PE_CHECK(skv_ctx_barrier(ctx) == 0, "barrier");
  PE_CHECK(skv_store_add(ctx, "user/counter", 0, &total) == 0 && total == npes * (npes + 1) / 2,
           "counter %lld", (long long)total);
  PE_CHECK(skv_finalize(ctx) == 0, "finalize");
  return 0;
}

ParameterizedTestParameters(ctx, collectives_and_store) {
  static int n[] = {1, 2, 3, 4, 8};
  return cr_make_param_array(int, n, sizeof n / sizeof n[0]);
}

ParameterizedTest(int *npes, ctx, collectives_and_store) {
  skv_test_job_t job;
  int bad = skv_test_run(&job, *npes, pe_basic, NULL, 90000);
  cr_assert_eq(bad, 0, "PEs failed: %s", skv_test_statuses(&job));
}

static int pe_mismatch(int rank, int npes, void *arg) {
  skv_ctx_t *ctx;
  PE_CHECK(skv_test_init(&ctx, 10000) == 0, "init");
  uint64_t x = 1, all[SKV_TEST_MAX_PES];
  int rc = rank == 1 ? skv_ctx_allgather(ctx, &x, all, sizeof x) : skv_ctx_barrier(ctx);
  PE_CHECK(rc == SKV_EMISMATCH, "expected SKV_EMISMATCH, got %s", skv_err_name(rc));
  const char *e = skv_last_error();
  PE_CHECK(strstr(e, "skv_ctx_allgather(bytes=8)") && strstr(e, "skv_ctx_barrier()"),
           "message names both sides: %s", e);
  PE_CHECK(strstr(e, "rank 1") != NULL, "message names the other rank: %s", e);
  skv_finalize(ctx);
  return 0;
}

Test(ctx, mismatched_collective_fails_on_every_pe) {
  skv_test_job_t job;
  int bad = skv_test_run(&job, 3, pe_mismatch, NULL, 60000);
  cr_assert_eq(bad, 0, "PEs failed: %s", skv_test_statuses(&job));
}

static int pe_mismatch_args(int rank, int npes, void *arg) {
  skv_ctx_t *ctx;
  PE_CHECK(skv_test_init(&ctx, 10000) == 0, "init");
  char buf[16] = {0};
  int rc = skv_ctx_broadcast(ctx, buf, rank == 0 ? 8 : 16, 0);
  PE_CHECK(rc == SKV_EMISMATCH, "expected SKV_EMISMATCH, got %s", skv_err_name(rc));
  skv_finalize(ctx);
  return 0;
}

Test(ctx, mismatched_arguments_fail_on_every_pe) {
  skv_test_job_t job;
  int bad = skv_test_run(&job, 2, pe_mismatch_args, NULL, 60000);
  cr_assert_eq(bad, 0, "PEs failed: %s", skv_test_statuses(&job));
}

static int pe_wrong_token(int rank, int npes, void *arg) {
  skv_config_t cfg = SKV_CONFIG_INIT;
  cfg.timeout_ms = 5000;
  if (rank == 1) cfg.token = "not-the-right-token";
  skv_ctx_t *ctx;
  int rc = skv_init(&cfg, &ctx);
  if (rank == 1) {
    PE_CHECK(rc == SKV_EAUTH, "expected SKV_EAUTH, got %s", skv_err_name(rc));
    PE_CHECK(strstr(skv_last_error(), "token") != NULL, "message: %s", skv_last_error());
    return 0;
  }
  /* Rank 0 waits for rank 1, which never gets in: a bounded failure, not a hang. */
  PE_CHECK(rc == SKV_ETIMEDOUT || rc == SKV_EPEERDEAD, "rank 0 got %s", skv_err_name(rc));
  return 0;
}

Test(ctx, wrong_token_is_rejected) {
  skv_test_job_t job;
  int bad = skv_test_run(&job, 2, pe_wrong_token, NULL, 60000);
  cr_assert_eq(bad, 0, "PEs failed: %s", skv_test_statuses(&job));
}

/* Rank `victim` is killed (or stopped) by the test while the others sit in a barrier. */
static int pe_barrier_victim(int rank, int npes, void *arg) {
  int victim_sig = *(int *)arg;
  skv_ctx_t *ctx;
  PE_CHECK(skv_test_init(&ctx, 3000) == 0, "init");
  PE_CHECK(skv_ctx_barrier(ctx) == 0, "first barrier");
  if (rank == npes - 1) {
    raise(victim_sig);
    pause();
    return 0;
  }
  uint64_t t0 = skv__now_ms();
  int rc = skv_ctx_barrier(ctx);
  uint64_t dt = skv__now_ms() - t0;
  if (victim_sig == SIGKILL)
    PE_CHECK(rc == SKV_EPEERDEAD || rc == SKV_ETIMEDOUT, "got %s", skv_err_name(rc));
  else
    PE_CHECK(rc == SKV_ETIMEDOUT, "a stopped PE must give a timeout, got %s", skv_err_name(rc));
  PE_CHECK(dt < 3000 + 4000, "failed after %llu ms, timeout was 3000", (unsigned long long)dt);
  skv_finalize(ctx); /* must not hang either */
  return 0;
}

Test(ctx, killed_pe_mid_barrier_fails_the_others) {
  skv_test_job_t job;
  int sig = SIGKILL;
  skv_test_spawn(&job, 4, pe_barrier_victim, &sig);
  skv_test_wait(&job, 40000);
  for (int r = 0; r < 3; r++)
    cr_assert_eq(job.status[r], 0, "survivors: %s", skv_test_statuses(&job));
  cr_assert_eq(job.status[3], 128 + SIGKILL);
}

Test(ctx, stopped_pe_mid_barrier_times_out) {
  skv_test_job_t job;
  int sig = SIGSTOP;
  skv_test_spawn(&job, 3, pe_barrier_victim, &sig);
  /* The stopped PE never exits by itself: wait for the others, then kill it. */
  uint64_t deadline = skv__now_ms() + 40000;
  int done = 0;
  while (skv__now_ms() < deadline && done < 2) {
    done = 0;
    for (int r = 0; r < 2; r++) {
      int st;
      if (job.status[r] == -2 && waitpid(job.pids[r], &st, WNOHANG) == job.pids[r])
        job.status[r] = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
      done += job.status[r] != -2;
    }
    usleep(10000);
  }
  kill(job.pids[2], SIGKILL);
  skv_test_wait(&job, 5000);
  for (int r = 0; r < 2; r++)
    cr_assert_eq(job.status[r], 0, "survivors: %s", skv_test_statuses(&job));
}

/* Rank 0 passes another timeout, so the collective check of skv_init mismatches. Every PE must
 * see that mismatch: rank 0 keeps serving the store until the others found it too and left, and
 * the cleanup does not replace the message. */
static int pe_init_mismatch(int rank, int npes, void *arg) {
  skv_config_t cfg = SKV_CONFIG_INIT;
  cfg.timeout_ms = rank == 0 ? 10000 : 20000;
  skv_ctx_t *ctx = NULL;
  int rc = skv_init(&cfg, &ctx);
  PE_CHECK(rc == SKV_EMISMATCH, "rank %d: expected SKV_EMISMATCH, got %s", rank, skv_err_name(rc));
  PE_CHECK(ctx == NULL, "ctx set on failure");
  PE_CHECK(strstr(skv_last_error(), "does not match across PEs") &&
               strstr(skv_last_error(), "timeout_ms=10000"),
           "rank %d: the message is not about the mismatch: %s", rank, skv_last_error());
  return 0;
}

Test(ctx, init_failure_keeps_its_error_on_every_pe) {
  for (int round = 0; round < 4; round++) { /* a store stopped too early shows only at times */
    skv_test_job_t job;
    int bad = skv_test_run(&job, 8, pe_init_mismatch, NULL, 40000);
    cr_assert_eq(bad, 0, "round %d: PEs failed: %s", round, skv_test_statuses(&job));
  }
}

/* The last rank never calls skv_finalize (it stays connected, then exits): the others' finalize
 * fails, and rank 0's message must still be about the final collective, not the store stop. */
static int pe_fini_missing(int rank, int npes, void *arg) {
  skv_ctx_t *ctx;
  PE_CHECK(skv_test_init(&ctx, 1000) == 0, "init");
  if (rank == npes - 1) {
    usleep(4000 * 1000);
    _exit(0);
  }
  int rc = skv_finalize(ctx);
  PE_CHECK(rc == SKV_ETIMEDOUT, "rank %d: expected SKV_ETIMEDOUT, got %s", rank, skv_err_name(rc));
  PE_CHECK(strstr(skv_last_error(), "skv_finalize()") &&
               strstr(skv_last_error(), "did not complete on every PE"),
           "rank %d: the message is not about the final collective: %s", rank, skv_last_error());
  return 0;
}

Test(ctx, finalize_failure_keeps_its_error) {
  skv_test_job_t job;
  int bad = skv_test_run(&job, 3, pe_fini_missing, NULL, 30000);
  cr_assert_eq(bad, 0, "PEs failed: %s", skv_test_statuses(&job));
}

/* A buffer that is too small gets the value's first `cap` bytes and its full length. */
static int pe_store_get_small(int rank, int npes, void *arg) {
  skv_ctx_t *ctx;
  PE_CHECK(skv_test_init(&ctx, 10000) == 0, "init");
  PE_CHECK(skv_store_set(ctx, "user/digits", "0123456789", 10) == 0, "set");
  char buf[8] = "-------";
  size_t len = 0;
  PE_CHECK(skv_store_get(ctx, "user/digits", buf, 4, &len) == SKV_ERANGE, "ERANGE");
  PE_CHECK(len == 10, "len %zu", len);
  PE_CHECK(memcmp(buf, "0123---", 8) == 0, "buffer holds '%s', expected '0123---'", buf);
  PE_CHECK(skv_store_get(ctx, "user/digits", NULL, 0, &len) == SKV_ERANGE && len == 10, "cap 0");
  PE_CHECK(skv_finalize(ctx) == 0, "finalize");
  return 0;
}

Test(ctx, store_get_copies_what_fits) {
  skv_test_job_t job;
  int bad = skv_test_run(&job, 1, pe_store_get_small, NULL, 30000);
  cr_assert_eq(bad, 0, "PEs failed: %s", skv_test_statuses(&job));
}

/* Two "nodes" on one host: ranks 2 and 3 run under another host name (a UTS namespace). Without
 * SKV_LOCAL_SIZE, each PE takes the PEs found on its node. */
static int enter_other_node(void) {
  if (unshare(CLONE_NEWUTS) != 0 && unshare(CLONE_NEWUSER | CLONE_NEWUTS) != 0) return -errno;
  if (sethostname("skv-other-node", 14) != 0) return -errno;
  return 0;
}

static int pe_two_nodes(int rank, int npes, void *arg) {
  if (rank >= 2) PE_CHECK(enter_other_node() == 0, "cannot enter a UTS namespace");
  PE_CHECK(strcmp(skv__hostname(), rank >= 2 ? "skv-other-node" : *(char **)arg) == 0,
           "host name %s", skv__hostname());
  skv_ctx_t *ctx;
  PE_CHECK(skv_test_init(&ctx, 10000) == 0, "init");
  PE_CHECK(skv_ctx_get_local_size(ctx) == 2, "local size %d", skv_ctx_get_local_size(ctx));
  PE_CHECK(skv_ctx_get_local_rank(ctx) == rank % 2, "local rank %d", skv_ctx_get_local_rank(ctx));
  PE_CHECK(skv_ctx_barrier(ctx) == 0, "barrier");
  PE_CHECK(skv_finalize(ctx) == 0, "finalize");
  return 0;
}

Test(ctx, local_size_defaults_to_the_pes_of_each_node) {
  pid_t p = fork(); /* can this host give a PE another host name? */
  if (p == 0) _exit(enter_other_node() == 0 ? 0 : 1);
  int st = 1;
  waitpid(p, &st, 0);
  if (!WIFEXITED(st) || WEXITSTATUS(st) != 0)
    cr_skip_test("needs unshare(CLONE_NEWUTS) (root or user namespaces) to fake a second node");
  char host[256];
  cr_assert_eq(gethostname(host, sizeof host), 0);
  host[sizeof host - 1] = '\0';
  if (strchr(host, '.')) *strchr(host, '.') = '\0';
  char *hp = host;
  skv_test_job_t job;
  int bad = skv_test_run(&job, 4, pe_two_nodes, &hp, 40000);
  cr_assert_eq(bad, 0, "PEs failed: %s", skv_test_statuses(&job));
}

/* A local size that is given must match, and the error names where it came from. */
static int pe_wrong_local_size(int rank, int npes, void *arg) {
  bool from_env = *(int *)arg;
  skv_config_t cfg = SKV_CONFIG_INIT;
  cfg.timeout_ms = 10000;
  if (from_env) {
    setenv("SKV_LOCAL_SIZE", "1", 1);
    skv__env_reload();
  } else {
    cfg.local_size = 1;
  }
  skv_ctx_t *ctx;
  int rc = skv_init(&cfg, &ctx);
  PE_CHECK(rc == SKV_EINVAL, "expected SKV_EINVAL, got %s", skv_err_name(rc));
  const char *want = from_env ? "local size is 1 (SKV_LOCAL_SIZE) but 2 PEs"
                              : "local size is 1 (config.local_size) but 2 PEs";
  PE_CHECK(strstr(skv_last_error(), want), "rank %d: message: %s", rank, skv_last_error());
  return 0;
}

Test(ctx, wrong_local_size_names_its_source) {
  for (int from_env = 0; from_env < 2; from_env++) {
    skv_test_job_t job;
    int bad = skv_test_run(&job, 2, pe_wrong_local_size, &from_env, 30000);
    cr_assert_eq(bad, 0, "PEs failed (%s): %s", from_env ? "SKV_LOCAL_SIZE" : "config.local_size",
                 skv_test_statuses(&job));
  }
}

static int pe_bad_args(int rank, int npes, void *arg) {
  skv_ctx_t *ctx;
  PE_CHECK(skv_test_init(&ctx, 10000) == 0, "init");
  char b[8];
  PE_CHECK(skv_ctx_allgather(ctx, NULL, b, 8) == SKV_EINVAL, "NULL in");
  PE_CHECK(skv_ctx_allgather(ctx, b, b, 0) == SKV_EINVAL, "zero bytes");
  PE_CHECK(skv_ctx_broadcast(ctx, b, 8, npes) == SKV_EINVAL, "root out of range");
  PE_CHECK(skv_store_set(ctx, "", b, 1) == SKV_EINVAL, "empty key");
  PE_CHECK(skv_store_set(ctx, NULL, b, 1) == SKV_EINVAL, "NULL key");
  char longkey[SKV_STORE_MAX_KEY + 2];
  memset(longkey, 'k', sizeof longkey - 1);
  longkey[sizeof longkey - 1] = '\0';
  PE_CHECK(skv_store_set(ctx, longkey, b, 1) == SKV_EINVAL, "long key");
  PE_CHECK(skv_ctx_set_timeout_ms(ctx, 0) == SKV_EINVAL, "timeout 0");
  PE_CHECK(skv_ctx_set_timeout_ms(ctx, 500) == 0 && skv_ctx_get_timeout_ms(ctx) == 500, "timeout set");
  size_t len;
  uint64_t t0 = skv__now_ms();
  PE_CHECK(skv_store_get(ctx, "never/set", b, sizeof b, &len) == SKV_ETIMEDOUT, "get times out");
  PE_CHECK(skv__now_ms() - t0 < 3500, "get waited too long");
  PE_CHECK(skv_ctx_set_timeout_ms(ctx, 10000) == 0, "timeout back");
  PE_CHECK(skv_ctx_get_rank(NULL) == SKV_EINVAL, "NULL ctx");
  PE_CHECK(skv_finalize(ctx) == 0, "finalize");
  return 0;
}

Test(ctx, bad_arguments_are_rejected) {
  skv_test_job_t job;
  int bad = skv_test_run(&job, 2, pe_bad_args, NULL, 60000);
  cr_assert_eq(bad, 0, "PEs failed: %s", skv_test_statuses(&job));
}

Test(ctx, init_without_configuration_explains_what_is_missing) {
  skv_log_set_level(SKV_LOG_NONE, SKV_SUBSYS_ALL);
  unsetenv("SKV_RANK");
  unsetenv("SKV_WORLD_SIZE");
  unsetenv("SKV_BOOTSTRAP");
  skv__env_reload();
  skv_ctx_t *ctx = (skv_ctx_t *)0x1;
  cr_assert_eq(skv_init(NULL, &ctx), SKV_EINVAL);
  cr_assert_null(ctx);
  cr_assert(strstr(skv_last_error(), "symkv-run") != NULL, "%s", skv_last_error());
  cr_assert_eq(skv_init(NULL, NULL), SKV_EINVAL);
}
