/* Multi-PE tests of the collectives on the host backend (the GPU's flag protocols run by the CPU):
 * all-reduce against a float64 reference, bitwise identity, epochs, channels, timeouts, bad input.
 */
#define _GNU_SOURCE
#include "skv_test.h"

#include "comm/comm_state.h"

#include <criterion/criterion.h>
#include <criterion/parameterized.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <xxhash.h>

TestSuite(comm, .timeout = 240);

/* ---- data: random inputs every PE can regenerate, float64 reference ---------------------- */

/* (No libm in the test link: the few math helpers are here.) */
static double dmax(double a, double b) {
  return a > b ? a : b;
}
static double dmin(double a, double b) {
  return a < b ? a : b;
}
static double dabs(double a) {
  return a < 0 ? -a : a;
}

static uint32_t esize(int dtype) {
  return dtype == SKV_DTYPE_FP32 ? 4u : 2u;
}

static double decode(const void *buf, size_t i, int dtype) {
  if (dtype == SKV_DTYPE_FP32) {
    float f;
    memcpy(&f, (const char *)buf + 4 * i, 4);
    return f;
  }
  uint16_t h;
  memcpy(&h, (const char *)buf + 2 * i, 2);
  return dtype == SKV_DTYPE_BF16 ? skv__bf16_to_float(h) : skv__fp16_to_float(h);
}

static void encode(void *buf, size_t i, int dtype, float f) {
  if (dtype == SKV_DTYPE_FP32) {
    memcpy((char *)buf + 4 * i, &f, 4);
  } else {
    uint16_t h = dtype == SKV_DTYPE_BF16 ? skv__float_to_bf16(f) : skv__float_to_fp16(f);
    memcpy((char *)buf + 2 * i, &h, 2);
  }
}

/* PE pe's input of call `seed`: values in [-8, 8], never NaN. */
static void gen_input(void *buf, size_t count, int dtype, uint64_t seed, int pe) {
  uint64_t s = seed ^ (0x9e3779b97f4a7c15ull * (uint64_t)(pe + 1));
  for (size_t i = 0; i < count; i++) {
    uint64_t r = skv_test_rand(&s);
    encode(buf, i, dtype, (float)((int)(r % 4001) - 2000) / 250.0f);
  }
}

/* Every element of `out` within the tolerance of the float64 reduction of every PE's input. */
static int check_output(const void *out, size_t count, int dtype, int op, int npes, uint64_t seed,
                        char *why, size_t cap) {
  uint32_t es = esize(dtype);
  char *inputs = malloc((size_t)npes * count * es);
  for (int p = 0; p < npes; p++) gen_input(inputs + (size_t)p * count * es, count, dtype, seed, p);
  double eps = dtype == SKV_DTYPE_BF16   ? 1.0 / 256
               : dtype == SKV_DTYPE_FP16 ? 1.0 / 2048
                                         : 1.0 / (1 << 23);
  int bad = 0;
  for (size_t i = 0; i < count && !bad; i++) {
    double ref = 0, mag = 0;
    for (int p = 0; p < npes; p++) {
      double x = decode(inputs + (size_t)p * count * es, i, dtype);
      if (p == 0 || op == SKV_OP_SUM)
        ref = p == 0 ? x : ref + x;
      else
        ref = op == SKV_OP_MAX ? dmax(ref, x) : dmin(ref, x);
      mag += dabs(x);
    }
    double got = decode(out, i, dtype);
    double tol = op == SKV_OP_SUM ? eps * dabs(ref) + npes * mag * 0x1p-22 + 1e-7 : 0;
    if (!(dabs(got - ref) <= tol)) {
      snprintf(why, cap, "element %zu of %zu: got %.9g, float64 reference %.9g (tolerance %.3g)", i,
               count, got, ref, tol);
      bad = 1;
    }
  }
  free(inputs);
  return bad;
}

/* Every PE's output is the same, bit for bit. */
static int check_identical(skv_ctx_t *ctx, const void *out, size_t bytes, char *why, size_t cap) {
  uint64_t h = XXH3_64bits(out, bytes), all[SKV_TEST_MAX_PES];
  if (skv_ctx_allgather(ctx, &h, all, sizeof h) != 0) {
    snprintf(why, cap, "allgather failed: %s", skv_last_error());
    return 1;
  }
  for (int r = 1; r < skv_ctx_get_world_size(ctx); r++)
    if (all[r] != all[0]) {
      snprintf(why, cap, "PE %d's output differs from PE 0's", r);
      return 1;
    }
  return 0;
}

/* One all-reduce on this PE's buffers, checked. in_heap: in and out live in the comm's heap at
 * the same offsets on every PE; misalign: shift both by one element. */
typedef struct ar_case {
  size_t count;
  int dtype, op, algo, in_place, in_heap, misalign, channel;
} ar_case_t;

static int run_case(skv_ctx_t *ctx, skv_comm_t *comm, const ar_case_t *k, uint64_t seed, int rank,
                    int npes, char *why, size_t cap) {
  uint32_t es = esize(k->dtype);
  size_t bytes = k->count * es, shift = k->misalign ? es : 0;
  skv_heap_t *heap = skv_comm_get_heap(comm);
  char *a, *b, *ma = NULL, *mb = NULL;
  if (k->in_heap) {
    a = (char *)skv_heap_get_ptr(heap, rank, heap->info.data_offset) + shift;
    b = (char *)skv_heap_get_ptr(heap, rank, heap->info.data_offset + heap->info.data_bytes / 2) +
        shift;
  } else {
    a = (ma = malloc(bytes + 16)) + shift;
    b = (mb = malloc(bytes + 16)) + shift;
  }
  gen_input(a, k->count, k->dtype, seed, rank);
  char *out = k->in_place ? a : b;
  if (!k->in_place) memset(out, 0x7f, bytes); /* NaN in every dtype: an unwritten element fails */
  int rc = skv_comm_allreduce(comm, a, out, k->count, k->dtype, k->op, k->algo, k->channel, NULL);
  int bad = 0;
  if (rc != 0) {
    snprintf(why, cap, "skv_comm_allreduce: %s: %s", skv_err_name(rc), skv_last_error());
    bad = 1;
  }
  if (!bad) bad = check_output(out, k->count, k->dtype, k->op, npes, seed, why, cap);
  int bads[SKV_TEST_MAX_PES];
  if (skv_ctx_allgather(ctx, &bad, bads, sizeof bad) != 0) bad = 1;
  for (int r = 0; r < npes && !bad; r++)
    if (bads[r]) bad = 2; /* another PE failed: its message says why */
  if (!bad) bad = check_identical(ctx, out, bytes, why, cap);
  free(ma);
  free(mb);
  return bad == 2 ? 0 : bad;
}

static const char *case_str(const ar_case_t *k) {
  static __thread char s[160];
  snprintf(s, sizeof s, "count %zu %s %s %s ch%d%s%s%s", k->count, skv__dtype_name(k->dtype),
           skv__op_name(k->op), skv__algo_name(k->algo), k->channel, k->in_place ? " in-place" : "",
           k->in_heap ? " in-heap" : "", k->misalign ? " misaligned" : "");
  return s;
}

static int make_comm(skv_ctx_t *ctx, uint32_t channels, uint64_t max_bytes, skv_comm_t **comm) {
  skv_comm_opts_t o = SKV_COMM_OPTS_INIT;
  o.backend = SKV_BACKEND_HOST;
  o.channels = channels;
  o.max_bytes = max_bytes;
  return skv_comm_create(ctx, &o, comm);
}

/* ---- every dtype, op, algorithm and size ------------------------------------------------- */

typedef struct {
  int npes;
  int big;
} sweep_param_t;

static int pe_sweep(int rank, int npes, void *arg) {
  sweep_param_t *p = arg;
  skv_ctx_t *ctx;
  PE_CHECK(skv_test_init(&ctx, 60000) == 0, "init");
  skv_comm_t *comm;
  PE_CHECK(make_comm(ctx, 2, 16u << 20, &comm) == 0, "comm create");
  uint64_t seed = skv_test_seed();
  PE_CHECK(skv_ctx_broadcast(ctx, &seed, sizeof seed, 0) == 0, "seed");
  static const size_t counts[] = {1, 2, 3, 7, 8, 9, 15, 16, 17, 33, 127, 1000, 4097, 65537};
  static const int algos[] = {SKV_ALGO_ONESHOT, SKV_ALGO_TWOSHOT, SKV_ALGO_AUTO};
  char why[256];
  uint64_t call = 0;
  for (int dt = SKV_DTYPE_BF16; dt <= SKV_DTYPE_FP32; dt++)
    for (int op = SKV_OP_SUM; op <= SKV_OP_MIN; op++)
      for (size_t a = 0; a < 3; a++)
        for (size_t ci = 0; ci < SKV_ARRAY_LEN(counts); ci++) {
          call++;
          ar_case_t k = {counts[ci],
                         dt,
                         op,
                         algos[a],
                         (int)(call % 2),
                         (int)((call / 2) % 2),
                         (int)(call % 5 == 0),
                         (int)(call % 2)};
          PE_CHECK(run_case(ctx, comm, &k, seed + call, rank, npes, why, sizeof why) == 0, "%s: %s",
                   case_str(&k), why);
        }
  if (p->big) { /* several chunks per call */
    for (int a = 0; a < 2; a++) {
      ar_case_t k = {
          (1u << 20) + 3, a ? SKV_DTYPE_FP32 : SKV_DTYPE_BF16, SKV_OP_SUM, algos[a], a, !a, 0, 0};
      PE_CHECK(run_case(ctx, comm, &k, seed + 1000 + (uint64_t)a, rank, npes, why, sizeof why) == 0,
               "%s: %s", case_str(&k), why);
    }
  }
  PE_CHECK(skv_comm_destroy(comm) == 0, "comm destroy");
  PE_CHECK(skv_finalize(ctx) == 0, "finalize");
  return 0;
}

ParameterizedTestParameters(comm, allreduce_matches_float64_reference) {
  static sweep_param_t p[] = {{1, 0}, {2, 1}, {3, 0}, {4, 1}, {8, 1}};
  return cr_make_param_array(sweep_param_t, p, sizeof p / sizeof p[0]);
}

ParameterizedTest(sweep_param_t *p, comm, allreduce_matches_float64_reference, .timeout = 600) {
  skv_test_job_t job;
  int bad = skv_test_run(&job, p->npes, pe_sweep, p, 580000);
  cr_assert_eq(bad, 0, "%d PEs: %s", p->npes, skv_test_statuses(&job));
}

/* ---- epochs: many calls of changing sizes on one channel --------------------------------- */

static int pe_epochs(int rank, int npes, void *arg) {
  skv_ctx_t *ctx;
  PE_CHECK(skv_test_init(&ctx, 60000) == 0, "init");
  skv_comm_t *comm;
  PE_CHECK(make_comm(ctx, 1, 1u << 20, &comm) == 0, "comm create");
  uint64_t seed = skv_test_seed();
  PE_CHECK(skv_ctx_broadcast(ctx, &seed, sizeof seed, 0) == 0, "seed");
  static const size_t counts[] = {1, 100000, 5, 40000, 3, 262144, 17};
  char why[256];
  for (int i = 0; i < 300; i++) {
    ar_case_t k = {
        counts[i % 7], i % 3 + 1, SKV_OP_SUM, i % 2 ? SKV_ALGO_ONESHOT : SKV_ALGO_TWOSHOT,
        i % 3 == 0,    0,         0,          0};
    if (k.count * esize(k.dtype) > (1u << 20)) k.count = (1u << 20) / esize(k.dtype);
    PE_CHECK(run_case(ctx, comm, &k, seed + (uint64_t)i, rank, npes, why, sizeof why) == 0,
             "call %d (%s): %s", i, case_str(&k), why);
  }
  /* the epoch advanced once per launch, identically everywhere */
  uint64_t e = comm->hchan[0].epoch, all[SKV_TEST_MAX_PES];
  PE_CHECK(skv_ctx_allgather(ctx, &e, all, sizeof e) == 0, "allgather");
  for (int r = 0; r < npes; r++)
    PE_CHECK(all[r] == e && e >= 300, "epochs differ: %llu vs %llu", (unsigned long long)all[r],
             (unsigned long long)e);
  /* and every Lamport slot is back to the sentinel */
  const uint8_t *s = (const uint8_t *)skv__comm_addr(comm, rank, comm->scratch_off);
  for (uint64_t i = 0; i < comm->chan_bytes; i++)
    PE_CHECK(s[i] == 0xff, "scratch byte %llu is %u after the calls", (unsigned long long)i, s[i]);
  PE_CHECK(skv_comm_destroy(comm) == 0, "comm destroy");
  PE_CHECK(skv_finalize(ctx) == 0, "finalize");
  return 0;
}

ParameterizedTestParameters(comm, epochs_alternate_with_changing_sizes) {
  static int n[] = {2, 3, 5};
  return cr_make_param_array(int, n, sizeof n / sizeof n[0]);
}

ParameterizedTest(int *npes, comm, epochs_alternate_with_changing_sizes, .timeout = 300) {
  skv_test_job_t job;
  int bad = skv_test_run(&job, *npes, pe_epochs, NULL, 280000);
  cr_assert_eq(bad, 0, "%d PEs: %s", *npes, skv_test_statuses(&job));
}

/* ---- two threads on two channels at once ------------------------------------------------- */

typedef struct thr_arg {
  skv_ctx_t *ctx;
  skv_comm_t *comm;
  int rank, npes, channel, failed;
  uint64_t seed;
  char why[256];
} thr_arg_t;

static void *thr_main(void *p) {
  thr_arg_t *t = p;
  uint32_t es = 4;
  for (int i = 0; i < 200 && !t->failed; i++) {
    size_t count = t->channel ? (size_t)(1 + i * 37) : (size_t)(50000 - i * 11);
    float *buf = malloc(count * es);
    gen_input(buf, count, SKV_DTYPE_FP32, t->seed + (uint64_t)i, t->rank);
    int rc = skv_comm_allreduce(t->comm, buf, buf, count, SKV_DTYPE_FP32, SKV_OP_SUM,
                                i % 2 ? SKV_ALGO_ONESHOT : SKV_ALGO_TWOSHOT, t->channel, NULL);
    if (rc) {
      snprintf(t->why, sizeof t->why, "call %d: %s", i, skv_last_error());
      t->failed = 1;
    } else if (check_output(buf, count, SKV_DTYPE_FP32, SKV_OP_SUM, t->npes, t->seed + (uint64_t)i,
                            t->why, sizeof t->why)) {
      t->failed = 1;
    }
    free(buf);
  }
  return NULL;
}

static int pe_threads(int rank, int npes, void *arg) {
  skv_ctx_t *ctx;
  PE_CHECK(skv_test_init(&ctx, 60000) == 0, "init");
  skv_comm_t *comm;
  PE_CHECK(make_comm(ctx, 2, 1u << 20, &comm) == 0, "comm create");
  uint64_t seed = skv_test_seed();
  PE_CHECK(skv_ctx_broadcast(ctx, &seed, sizeof seed, 0) == 0, "seed");
  thr_arg_t t[2];
  pthread_t th[2];
  for (int i = 0; i < 2; i++) {
    t[i] = (thr_arg_t){ctx, comm, rank, npes, i, 0, seed + (uint64_t)i * 1000000, ""};
    PE_CHECK(pthread_create(&th[i], NULL, thr_main, &t[i]) == 0, "thread");
  }
  for (int i = 0; i < 2; i++) pthread_join(th[i], NULL);
  for (int i = 0; i < 2; i++) PE_CHECK(!t[i].failed, "channel %d: %s", i, t[i].why);
  PE_CHECK(skv_comm_destroy(comm) == 0, "comm destroy");
  PE_CHECK(skv_finalize(ctx) == 0, "finalize");
  return 0;
}

ParameterizedTestParameters(comm, two_threads_on_two_channels) {
  static int n[] = {2, 4};
  return cr_make_param_array(int, n, sizeof n / sizeof n[0]);
}

ParameterizedTest(int *npes, comm, two_threads_on_two_channels, .timeout = 300) {
  skv_test_job_t job;
  int bad = skv_test_run(&job, *npes, pe_threads, NULL, 280000);
  cr_assert_eq(bad, 0, "%d PEs: %s", *npes, skv_test_statuses(&job));
}

/* ---- inputs that look like the sentinel --------------------------------------------------- */

static int pe_sentinel(int rank, int npes, void *arg) {
  skv_ctx_t *ctx;
  PE_CHECK(skv_test_init(&ctx, 30000) == 0, "init");
  skv_comm_t *comm;
  PE_CHECK(make_comm(ctx, 1, 1u << 20, &comm) == 0, "comm create");
  for (int dt = SKV_DTYPE_BF16; dt <= SKV_DTYPE_FP32; dt++)
    for (int algo = SKV_ALGO_ONESHOT; algo <= SKV_ALGO_TWOSHOT; algo++) {
      uint32_t es = esize(dt);
      size_t count = 37;
      char *buf = calloc(count, es);
      for (size_t i = 0; i < count; i++) encode(buf, i, dt, 1.0f);
      /* element 3: the sentinel pattern on PE 0; element 5: -0.0 everywhere; element 7: +inf */
      if (rank == 0) memset(buf + 3 * es, 0xff, es);
      encode(buf, 5, dt, -0.0f);
      encode(buf, 7, dt, INFINITY);
      PE_CHECK(skv_comm_allreduce(comm, buf, buf, count, dt, SKV_OP_SUM, algo, 0, NULL) == 0,
               "allreduce");
      for (size_t i = 0; i < count; i++) {
        double v = decode(buf, i, dt);
        if (i == 3)
          PE_CHECK(isnan(v), "%s: the sentinel pattern must reduce to a NaN, got %g",
                   skv__dtype_name(dt), v);
        else if (i == 5)
          PE_CHECK(v == 0.0, "%s: -0.0 sums to %g", skv__dtype_name(dt), v);
        else if (i == 7)
          PE_CHECK(isinf(v) && v > 0, "%s: inf sums to %g", skv__dtype_name(dt), v);
        else
          PE_CHECK(v == npes, "%s %s: element %zu is %g, want %d", skv__dtype_name(dt),
                   skv__algo_name(algo), i, v, npes);
      }
      free(buf);
    }
  PE_CHECK(skv_comm_destroy(comm) == 0, "comm destroy");
  PE_CHECK(skv_finalize(ctx) == 0, "finalize");
  return 0;
}

Test(comm, inputs_equal_to_the_sentinel_do_not_hang) {
  skv_test_job_t job;
  int bad = skv_test_run(&job, 3, pe_sentinel, NULL, 60000);
  cr_assert_eq(bad, 0, "%s", skv_test_statuses(&job));
}

/* ---- signals, waits and barriers ---------------------------------------------------------- */

static int pe_signals(int rank, int npes, void *arg) {
  skv_ctx_t *ctx;
  PE_CHECK(skv_test_init(&ctx, 30000) == 0, "init");
  skv_comm_t *comm;
  PE_CHECK(make_comm(ctx, 2, 1u << 16, &comm) == 0, "comm create");
  PE_CHECK(skv_comm_get_signal_slots(comm) >= 1024, "slots %d", skv_comm_get_signal_slots(comm));
  /* ping-pong between PEs 0 and 1 through slot 1 */
  if (rank < 2) {
    int peer = 1 - rank;
    for (uint64_t i = 1; i <= 1000; i++) {
      if (rank == 0) {
        PE_CHECK(skv_comm_signal(comm, peer, 1, i, SKV_SIGNAL_SET, NULL) == 0, "signal");
        PE_CHECK(skv_comm_wait(comm, 1, SKV_CMP_GE, i, NULL) == 0, "wait %llu",
                 (unsigned long long)i);
      } else {
        PE_CHECK(skv_comm_wait(comm, 1, SKV_CMP_EQ, i, NULL) == 0, "wait %llu",
                 (unsigned long long)i);
        PE_CHECK(skv_comm_signal(comm, peer, 1, i, SKV_SIGNAL_SET, NULL) == 0, "signal");
      }
    }
  }
  /* barriers: nobody passes round r before every PE added to PE 0's slot 2 in round r */
  skv_heap_t *heap = skv_comm_get_heap(comm);
  volatile uint64_t *ctr =
      (volatile uint64_t *)skv_heap_get_ptr(heap, 0, heap->info.signal_offset + 2 * 8);
  for (int r = 1; r <= 200; r++) {
    PE_CHECK(skv_comm_signal(comm, 0, 2, 1, SKV_SIGNAL_ADD, NULL) == 0, "add");
    PE_CHECK(skv_comm_barrier(comm, r % 2, NULL) == 0, "barrier %d", r);
    PE_CHECK(*ctr >= (uint64_t)(npes * r), "round %d: passed the barrier with the counter at %llu",
             r, (unsigned long long)*ctr);
    PE_CHECK(skv_comm_barrier(comm, r % 2, NULL) == 0, "barrier %d", r);
  }
  /* comparisons */
  PE_CHECK(skv_comm_signal(comm, rank, 3, 10, SKV_SIGNAL_SET, NULL) == 0, "set");
  PE_CHECK(skv_comm_signal(comm, rank, 3, 5, SKV_SIGNAL_ADD, NULL) == 0, "add");
  PE_CHECK(skv_comm_wait(comm, 3, SKV_CMP_EQ, 15, NULL) == 0, "==");
  PE_CHECK(skv_comm_wait(comm, 3, SKV_CMP_NE, 14, NULL) == 0, "!=");
  PE_CHECK(skv_comm_wait(comm, 3, SKV_CMP_GT, 14, NULL) == 0, ">");
  PE_CHECK(skv_comm_wait(comm, 3, SKV_CMP_LT, 16, NULL) == 0, "<");
  PE_CHECK(skv_comm_wait(comm, 3, SKV_CMP_LE, 15, NULL) == 0, "<=");
  PE_CHECK(skv_ctx_set_timeout_ms(ctx, 300) == 0, "timeout");
  uint64_t t0 = skv__now_ms();
  int rc = skv_comm_wait(comm, 3, SKV_CMP_GT, 15, NULL);
  uint64_t dt = skv__now_ms() - t0;
  PE_CHECK(rc == SKV_ETIMEDOUT && strstr(skv_last_error(), "slot 3"),
           "wait nobody answers: %s / %s", skv_err_name(rc), skv_last_error());
  PE_CHECK(dt >= 300 && dt < 3000, "the wait gave up after %llu ms, timeout 300",
           (unsigned long long)dt);
  PE_CHECK(skv_ctx_set_timeout_ms(ctx, 30000) == 0, "timeout");
  PE_CHECK(skv_comm_check(comm) == 0, "check");
  PE_CHECK(skv_comm_destroy(comm) == 0, "comm destroy");
  PE_CHECK(skv_finalize(ctx) == 0, "finalize");
  return 0;
}

ParameterizedTestParameters(comm, signals_waits_and_barriers) {
  static int n[] = {2, 4};
  return cr_make_param_array(int, n, sizeof n / sizeof n[0]);
}

ParameterizedTest(int *npes, comm, signals_waits_and_barriers, .timeout = 120) {
  skv_test_job_t job;
  int bad = skv_test_run(&job, *npes, pe_signals, NULL, 110000);
  cr_assert_eq(bad, 0, "%d PEs: %s", *npes, skv_test_statuses(&job));
}

/* ---- a peer that never arrives ------------------------------------------------------------ */

#define MISSING_TIMEOUT_MS 1000

static int pe_missing(int rank, int npes, void *arg) {
  int what = *(int *)arg; /* 0: all-reduce, 1: barrier */
  skv_ctx_t *ctx;
  PE_CHECK(skv_test_init(&ctx, 30000) == 0, "init");
  skv_comm_t *comm;
  PE_CHECK(make_comm(ctx, 1, 1u << 20, &comm) == 0, "comm create");
  PE_CHECK(skv_ctx_set_timeout_ms(ctx, MISSING_TIMEOUT_MS) == 0, "timeout");
  if (rank == 0) {
    float buf[1000] = {0};
    uint64_t t0 = skv__now_ms();
    int rc = what == 0 ? skv_comm_allreduce(comm, buf, buf, 1000, SKV_DTYPE_FP32, SKV_OP_SUM,
                                            SKV_ALGO_TWOSHOT, 0, NULL)
                       : skv_comm_barrier(comm, 0, NULL);
    uint64_t dt = skv__now_ms() - t0;
    PE_CHECK(rc == SKV_ETIMEDOUT, "got %s: %s", skv_err_name(rc), skv_last_error());
    PE_CHECK(strstr(skv_last_error(), "PE 1"), "the message does not name the missing PE: %s",
             skv_last_error());
    PE_CHECK(dt >= MISSING_TIMEOUT_MS && dt < 4 * MISSING_TIMEOUT_MS, "gave up after %llu ms",
             (unsigned long long)dt);
    rc = skv_comm_allreduce(comm, buf, buf, 1000, SKV_DTYPE_FP32, SKV_OP_SUM, SKV_ALGO_ONESHOT, 0,
                            NULL);
    PE_CHECK(rc == SKV_ESTATE && strstr(skv_last_error(), "destroy"), "after a timeout: %s / %s",
             skv_err_name(rc), skv_last_error());
  } else {
    usleep((MISSING_TIMEOUT_MS + 500) * 1000); /* alive, but never calls */
  }
  PE_CHECK(skv_ctx_set_timeout_ms(ctx, 30000) == 0, "timeout");
  PE_CHECK(skv_comm_destroy(comm) == 0, "comm destroy: %s", skv_last_error());
  PE_CHECK(skv_finalize(ctx) == 0, "finalize");
  return 0;
}

ParameterizedTestParameters(comm, peer_that_never_arrives_times_out) {
  static int w[] = {0, 1};
  return cr_make_param_array(int, w, sizeof w / sizeof w[0]);
}

ParameterizedTest(int *what, comm, peer_that_never_arrives_times_out, .timeout = 60) {
  skv_test_job_t job;
  int bad = skv_test_run(&job, 2, pe_missing, what, 50000);
  cr_assert_eq(bad, 0, "%s: %s", *what ? "barrier" : "allreduce", skv_test_statuses(&job));
}

/* ---- checking mode ------------------------------------------------------------------------ */

/* Without checking, PEs whose calls differ in op get wrong results and SKV_OK; in checking mode
 * every mismatch of op, dtype, count, algorithm, channel or kind (all-reduce against barrier)
 * fails on every PE with SKV_EMISMATCH naming both calls, before anything is reduced, and the
 * comm is broken afterwards (SKV_ESTATE). Matching calls pass and reduce correctly. */
enum { MM_NONE, MM_OP, MM_DTYPE, MM_COUNT, MM_ALGO, MM_CHANNEL, MM_KIND, MM_COUNT_OF };
static const char *mm_name[] = {"none", "op", "dtype", "count", "algorithm", "channel", "kind"};

typedef struct {
  int what;
  int by_env; /* checking mode from SKV_COMM_CHECK=1 instead of the flag */
} mm_param_t;

static int pe_mismatch(int rank, int npes, void *arg) {
  const mm_param_t *p = arg;
  if (p->by_env) {
    setenv("SKV_COMM_CHECK", "1", 1);
    skv__env_reload();
  }
  skv_ctx_t *ctx;
  PE_CHECK(skv_test_init(&ctx, 20000) == 0, "init");
  skv_comm_opts_t o = SKV_COMM_OPTS_INIT;
  o.backend = SKV_BACKEND_HOST;
  o.channels = 2;
  o.max_bytes = 1u << 20;
  o.flags = p->by_env ? 0 : SKV_COMM_CHECKED;
  skv_comm_t *comm;
  PE_CHECK(skv_comm_create(ctx, &o, &comm) == 0, "comm create: %s", skv_last_error());
  PE_CHECK(comm->checked, "checking mode is off");
  enum { N = 1000 };
  float in[N], out[N];
  for (int i = 0; i < N; i++) in[i] = (float)(rank + 1) * (float)(i % 7);
  /* matching calls pass, with the right sums */
  for (int round = 0; round < 3; round++) {
    PE_CHECK(skv_comm_allreduce(comm, in, out, N, SKV_DTYPE_FP32, SKV_OP_SUM, SKV_ALGO_AUTO,
                                round & 1, NULL) == 0,
             "matching all-reduce: %s", skv_last_error());
    for (int i = 0; i < N; i++)
      PE_CHECK(out[i] == (float)(npes * (npes + 1) / 2) * (float)(i % 7), "out[%d] = %g", i,
               (double)out[i]);
    PE_CHECK(skv_comm_barrier(comm, round & 1, NULL) == 0, "barrier: %s", skv_last_error());
  }
  if (p->what != MM_NONE) {
    const bool odd = rank == npes - 1; /* the last PE makes another call */
    size_t count = N;
    int dtype = SKV_DTYPE_FP32, op = SKV_OP_SUM, algo = SKV_ALGO_ONESHOT, ch = 0;
    if (odd && p->what == MM_OP) op = SKV_OP_MAX;
    if (odd && p->what == MM_DTYPE) dtype = SKV_DTYPE_BF16, count = 2 * N; /* the same bytes */
    if (odd && p->what == MM_COUNT) count = N - 1;
    if (odd && p->what == MM_ALGO) algo = SKV_ALGO_TWOSHOT;
    if (odd && p->what == MM_CHANNEL) ch = 1;
    uint64_t t0 = skv__now_ms();
    int rc = odd && p->what == MM_KIND
                 ? skv_comm_barrier(comm, 0, NULL)
                 : skv_comm_allreduce(comm, in, out, count, dtype, op, algo, ch, NULL);
    uint64_t dt = skv__now_ms() - t0;
    PE_CHECK(rc == SKV_EMISMATCH, "%s mismatch: rank %d got %s after %llu ms: %s", mm_name[p->what],
             rank, skv_err_name(rc), (unsigned long long)dt, skv_last_error());
    PE_CHECK(dt < 5000, "found after %llu ms", (unsigned long long)dt);
    const char *msg = skv_last_error();
    const char *want = p->what == MM_OP      ? (odd ? "fp32, sum" : "fp32, max")
                       : p->what == MM_DTYPE ? (odd ? "count 1000, fp32" : "count 2000, bf16")
                       : p->what == MM_COUNT ? (odd ? "count 1000," : "count 999,")
                       : p->what == MM_ALGO  ? (odd ? "oneshot" : "twoshot")
                       : p->what == MM_KIND  ? (odd ? "skv_comm_allreduce(" : "skv_comm_barrier(")
                                             : (odd ? "channel 0" : "channel 1");
    PE_CHECK(strstr(msg, want) && strstr(msg, "PE "),
             "%s mismatch: rank %d's message lacks '%s': %s", mm_name[p->what], rank, want, msg);
    rc = skv_comm_allreduce(comm, in, out, N, SKV_DTYPE_FP32, SKV_OP_SUM, SKV_ALGO_AUTO, 0, NULL);
    PE_CHECK(rc == SKV_ESTATE, "after a mismatch: %s", skv_err_name(rc));
  }
  PE_CHECK(skv_comm_destroy(comm) == 0, "comm destroy: %s", skv_last_error());
  PE_CHECK(skv_finalize(ctx) == 0, "finalize");
  return 0;
}

ParameterizedTestParameters(comm, checking_mode_catches_every_mismatch_on_every_pe) {
  static mm_param_t ps[] = {{MM_NONE, 0}, {MM_OP, 0},      {MM_DTYPE, 0}, {MM_COUNT, 0},
                            {MM_ALGO, 0}, {MM_CHANNEL, 0}, {MM_KIND, 0},  {MM_OP, 1}};
  return cr_make_param_array(mm_param_t, ps, sizeof ps / sizeof ps[0]);
}

ParameterizedTest(mm_param_t *p, comm, checking_mode_catches_every_mismatch_on_every_pe,
                  .timeout = 60) {
  skv_test_job_t job;
  int bad = skv_test_run(&job, 3, pe_mismatch, p, 50000);
  cr_assert_eq(bad, 0, "%s mismatch%s: %s", mm_name[p->what],
               p->by_env ? " (SKV_COMM_CHECK=1)" : "", skv_test_statuses(&job));
}

/* Without the checking mode, a PE that reduces with another op gets SKV_OK and wrong results
 * (what the checking mode is for). */
static int pe_unchecked_op(int rank, int npes, void *arg) {
  skv_ctx_t *ctx;
  PE_CHECK(skv_test_init(&ctx, 20000) == 0, "init");
  skv_comm_t *comm;
  PE_CHECK(make_comm(ctx, 1, 1u << 20, &comm) == 0, "comm create");
  PE_CHECK(!comm->checked, "checking mode is on by default");
  float in[64], out[64];
  for (int i = 0; i < 64; i++) in[i] = (float)(rank + 1);
  int rc = skv_comm_allreduce(comm, in, out, 64, SKV_DTYPE_FP32, rank ? SKV_OP_MAX : SKV_OP_SUM,
                              SKV_ALGO_ONESHOT, 0, NULL);
  PE_CHECK(rc == 0 && out[0] == (rank ? 2.0f : 3.0f), "unchecked: %s, %g", skv_err_name(rc),
           (double)out[0]);
  PE_CHECK(skv_comm_destroy(comm) == 0, "comm destroy");
  PE_CHECK(skv_finalize(ctx) == 0, "finalize");
  return 0;
}

Test(comm, unchecked_op_mismatch_goes_unnoticed) {
  skv_test_job_t job;
  int bad = skv_test_run(&job, 2, pe_unchecked_op, NULL, 30000);
  cr_assert_eq(bad, 0, "%s", skv_test_statuses(&job));
}

/* ---- bad input ---------------------------------------------------------------------------- */

#define EXPECT_EINVAL(call, needle)                                                             \
  do {                                                                                          \
    int rc_ = (call);                                                                           \
    PE_CHECK(rc_ == SKV_EINVAL && strstr(skv_last_error(), needle),                             \
             "%s: got %s, message '%s' lacks '%s'", #call, skv_err_name(rc_), skv_last_error(), \
             needle);                                                                           \
  } while (0)

static int pe_bad(int rank, int npes, void *arg) {
  skv_ctx_t *ctx;
  PE_CHECK(skv_test_init(&ctx, 20000) == 0, "init");
  skv_comm_t *comm = NULL;
  skv_comm_opts_t o = SKV_COMM_OPTS_INIT;
  o.backend = SKV_BACKEND_HOST;
  o.channels = 65;
  EXPECT_EINVAL(skv_comm_create(ctx, &o, &comm), "channels");
  o.channels = 1;
  o.flags = 8;
  EXPECT_EINVAL(skv_comm_create(ctx, &o, &comm), "flags");
  o.flags = 0;
  o.max_bytes = 8;
  EXPECT_EINVAL(skv_comm_create(ctx, &o, &comm), "max_bytes");
  o.max_bytes = 0;
  o.backend = 9;
  EXPECT_EINVAL(skv_comm_create(ctx, &o, &comm), "backend");
  o.backend = SKV_BACKEND_HOST;
  o.size = 4;
  EXPECT_EINVAL(skv_comm_create(ctx, &o, &comm), "SKV_COMM_OPTS_INIT");
  EXPECT_EINVAL(skv_comm_create(NULL, NULL, &comm), "ctx");
  PE_CHECK(comm == NULL, "comm set on failure");
  PE_CHECK(make_comm(ctx, 2, 1u << 20, &comm) == 0, "comm create");
  float buf[64] = {0};
  EXPECT_EINVAL(skv_comm_allreduce(NULL, buf, buf, 4, SKV_DTYPE_FP32, 0, 0, 0, NULL),
                "comm is NULL");
  EXPECT_EINVAL(skv_comm_allreduce(comm, buf, buf, 0, SKV_DTYPE_FP32, 0, 0, 0, NULL), "count is 0");
  EXPECT_EINVAL(skv_comm_allreduce(comm, buf, buf, SIZE_MAX, SKV_DTYPE_FP32, 0, 0, 0, NULL),
                "overflows");
  EXPECT_EINVAL(skv_comm_allreduce(comm, buf, buf, SIZE_MAX / 2 + 7, SKV_DTYPE_BF16, 0, 0, 0, NULL),
                "overflows");
  EXPECT_EINVAL(skv_comm_allreduce(comm, buf, buf, 4, 0, 0, 0, 0, NULL), "dtype 0");
  EXPECT_EINVAL(skv_comm_allreduce(comm, buf, buf, 4, 7, 0, 0, 0, NULL), "dtype 7");
  EXPECT_EINVAL(skv_comm_allreduce(comm, buf, buf, 4, SKV_DTYPE_FP32, 3, 0, 0, NULL), "op 3");
  EXPECT_EINVAL(skv_comm_allreduce(comm, buf, buf, 4, SKV_DTYPE_FP32, -1, 0, 0, NULL), "op -1");
  EXPECT_EINVAL(skv_comm_allreduce(comm, buf, buf, 4, SKV_DTYPE_FP32, 0, 4, 0, NULL), "algo 4");
  EXPECT_EINVAL(skv_comm_allreduce(comm, buf, buf, 4, SKV_DTYPE_FP32, 0, 0, 2, NULL), "channel 2");
  EXPECT_EINVAL(skv_comm_allreduce(comm, buf, buf, 4, SKV_DTYPE_FP32, 0, 0, -1, NULL),
                "channel -1");
  EXPECT_EINVAL(skv_comm_allreduce(comm, NULL, buf, 4, SKV_DTYPE_FP32, 0, 0, 0, NULL), "non-NULL");
  EXPECT_EINVAL(skv_comm_allreduce(comm, buf, NULL, 4, SKV_DTYPE_FP32, 0, 0, 0, NULL), "non-NULL");
  EXPECT_EINVAL(skv_comm_allreduce(comm, buf, buf, 4, SKV_DTYPE_FP32, 0, 0, 0, (void *)buf),
                "stream must be NULL");
  int rc = skv_comm_allreduce(comm, buf, buf, 4, SKV_DTYPE_FP32, 0, SKV_ALGO_NCCL, 0, NULL);
  PE_CHECK(rc == SKV_ENOTSUP && strstr(skv_last_error(), "NCCL"), "nccl on host: %s",
           skv_err_name(rc));
  rc = skv_comm_allreduce(comm, buf, buf, (2u << 20) / 4, SKV_DTYPE_FP32, 0, SKV_ALGO_ONESHOT, 0,
                          NULL);
  PE_CHECK(rc == SKV_ERANGE && strstr(skv_last_error(), "max_bytes"), "beyond max_bytes: %s",
           skv_err_name(rc));
  EXPECT_EINVAL(skv_comm_signal(comm, npes, 0, 1, SKV_SIGNAL_SET, NULL), "pe");
  EXPECT_EINVAL(skv_comm_signal(comm, 0, SKV__USER_SLOTS, 1, SKV_SIGNAL_SET, NULL), "slot");
  EXPECT_EINVAL(skv_comm_signal(comm, 0, 0, 1, 2, NULL), "op 2");
  EXPECT_EINVAL(skv_comm_signal(comm, 0, 0, 1, SKV_SIGNAL_SET, (void *)buf), "stream must be NULL");
  EXPECT_EINVAL(skv_comm_wait(comm, SKV__USER_SLOTS, SKV_CMP_EQ, 0, NULL), "slot");
  EXPECT_EINVAL(skv_comm_wait(comm, 0, 6, 0, NULL), "cmp 6");
  EXPECT_EINVAL(skv_comm_barrier(comm, 2, NULL), "channel 2");
  EXPECT_EINVAL(skv_comm_barrier(NULL, 0, NULL), "comm is NULL");
  EXPECT_EINVAL(skv_comm_check(NULL), "comm is NULL");
  EXPECT_EINVAL(skv_comm_get_signal_slots(NULL), "comm is NULL");
  PE_CHECK(skv_comm_get_heap(NULL) == NULL, "heap of NULL");
  /* the comm still works after all that */
  for (int i = 0; i < 4; i++) buf[i] = (float)rank;
  PE_CHECK(skv_comm_allreduce(comm, buf, buf, 4, SKV_DTYPE_FP32, SKV_OP_MAX, SKV_ALGO_AUTO, 1,
                              NULL) == 0,
           "allreduce");
  PE_CHECK(buf[0] == (float)(npes - 1), "max %g", buf[0]);
  PE_CHECK(skv_comm_destroy(comm) == 0, "comm destroy");
  PE_CHECK(skv_comm_destroy(NULL) == 0, "destroy NULL");
  PE_CHECK(skv_finalize(ctx) == 0, "finalize");
  return 0;
}

Test(comm, bad_input_is_rejected_by_name) {
  skv_test_job_t job;
  int bad = skv_test_run(&job, 2, pe_bad, NULL, 60000);
  cr_assert_eq(bad, 0, "%s", skv_test_statuses(&job));
}

/* A bad SKV_ALLREDUCE_ONESHOT_MAX on one PE only: that PE reports it, the others fail at once
 * (not at the timeout) with a mismatch that names it, and the job stays usable. */
static int pe_bad_env_on_one(int rank, int npes, void *arg) {
  if (rank == 1) {
    setenv("SKV_ALLREDUCE_ONESHOT_MAX", "lots", 1);
    skv__env_reload();
  }
  skv_ctx_t *ctx;
  PE_CHECK(skv_test_init(&ctx, 20000) == 0, "init");
  skv_comm_opts_t o = SKV_COMM_OPTS_INIT;
  o.backend = SKV_BACKEND_HOST;
  skv_comm_t *comm = NULL;
  uint64_t t0 = skv__now_ms();
  int rc = skv_comm_create(ctx, &o, &comm);
  uint64_t ms = skv__now_ms() - t0;
  PE_CHECK(comm == NULL, "comm created");
  if (rank == 1)
    PE_CHECK(rc == SKV_EINVAL && strstr(skv_last_error(), "SKV_ALLREDUCE_ONESHOT_MAX=lots"),
             "%s: %s", skv_err_name(rc), skv_last_error());
  else
    PE_CHECK(rc == SKV_EMISMATCH && strstr(skv_last_error(), "SKV_ALLREDUCE_ONESHOT_MAX=lots"),
             "%s: %s", skv_err_name(rc), skv_last_error());
  PE_CHECK(ms < 10000, "failed after %llu ms", (unsigned long long)ms);
  PE_CHECK(skv_ctx_barrier(ctx) == 0, "the job is still usable");
  PE_CHECK(skv_finalize(ctx) == 0, "finalize");
  return 0;
}

Test(comm, a_bad_env_on_one_pe_fails_every_pe_at_once) {
  skv_test_job_t job;
  int bad = skv_test_run(&job, 3, pe_bad_env_on_one, NULL, 60000);
  cr_assert_eq(bad, 0, "%s", skv_test_statuses(&job));
}

/* ---- algorithm choice and conversions (one process, no PEs) ------------------------------- */

Test(comm, auto_picks_by_size_and_env_overrides) {
  skv_comm_t c;
  memset(&c, 0, sizeof c);
  c.max_bytes = 64u << 20;
  c.oneshot_max = 256u << 10;
  c.twoshot_max = 4u << 20;
  cr_assert_eq(skv__comm_choose(&c, 1024), SKV_ALGO_ONESHOT);
  cr_assert_eq(skv__comm_choose(&c, 256u << 10), SKV_ALGO_ONESHOT);
  cr_assert_eq(skv__comm_choose(&c, (256u << 10) + 2), SKV_ALGO_TWOSHOT);
  cr_assert_eq(skv__comm_choose(&c, 64u << 20), SKV_ALGO_TWOSHOT,
               "no NCCL: two-shot up to max_bytes");
  c.has_nccl = true;
  cr_assert_eq(skv__comm_choose(&c, 4u << 20), SKV_ALGO_TWOSHOT);
  cr_assert_eq(skv__comm_choose(&c, (4u << 20) + 2), SKV_ALGO_NCCL);
  c.max_bytes = 1u << 20;
  cr_assert_eq(skv__comm_choose(&c, 2u << 20), SKV_ALGO_NCCL, "beyond max_bytes only NCCL");
}

Test(comm, half_precision_conversions_round_to_nearest_even) {
  /* every bf16 and fp16 pattern survives float and back (NaNs become the canonical NaN) */
  int bad = 0;
  uint32_t first = 0;
  for (uint32_t h = 0; h < 65536; h++) {
    float f = skv__bf16_to_float((uint16_t)h);
    uint16_t b = skv__float_to_bf16(f);
    if (isnan(f) ? b != 0x7fff : b != h) bad++, first = h;
    f = skv__fp16_to_float((uint16_t)h);
    b = skv__float_to_fp16(f);
    if (isnan(f) ? b != 0x7fff : b != h) bad++, first = h | 0x10000u;
  }
  cr_assert_eq(bad, 0, "%d patterns do not survive the round trip (last: %s %04x)", bad,
               first >> 16 ? "fp16" : "bf16", first & 0xffffu);
  cr_assert_eq(skv__fp16_to_float(0x3c00), 1.0f);
  cr_assert_eq(skv__fp16_to_float(0x0001), 0x1p-24f);
  cr_assert_eq(skv__float_to_fp16(65504.0f), 0x7bff);
  cr_assert_eq(skv__float_to_fp16(65520.0f), 0x7c00, "65520 rounds to infinity");
  cr_assert_eq(skv__float_to_fp16(65519.0f), 0x7bff);
  cr_assert_eq(skv__float_to_fp16(0x1p-25f), 0x0000, "2^-25 ties to even zero");
  cr_assert_eq(skv__float_to_fp16(0x1.8p-25f), 0x0001);
  cr_assert_eq(skv__float_to_fp16(0x1.8p-24f), 0x0002, "1.5 subnormal ulps tie to even 2");
  cr_assert_eq(skv__float_to_fp16(1.0f + 0x1p-11f), 0x3c00, "half an ulp ties to even");
  cr_assert_eq(skv__float_to_fp16(1.0f + 0x1.8p-11f), 0x3c01, "0.75 ulp rounds up");
  cr_assert_eq(skv__float_to_fp16(1.0f + 0x1.8p-10f), 0x3c02, "1.5 ulps tie to even");
  cr_assert_eq(skv__float_to_bf16(1.0f + 0x1p-8f), 0x3f80, "half an ulp ties to even");
  cr_assert_eq(skv__float_to_bf16(1.0f + 0x1.8p-8f), 0x3f81, "0.75 ulp rounds up");
  cr_assert_eq(skv__float_to_bf16(1.0f + 0x1.8p-7f), 0x3f82, "1.5 ulps tie to even");
  cr_assert_eq(skv__float_to_bf16(-0.0f), 0x8000);
  /* within half an ulp on random floats */
  uint64_t s = skv_test_seed();
  bad = 0;
  float worst = 0;
  for (int i = 0; i < 200000; i++) {
    uint32_t u = (uint32_t)skv_test_rand(&s);
    float f;
    memcpy(&f, &u, 4);
    if (isnan(f) || dabs(f) > 60000.0 || dabs(f) < 1e-9) continue;
    uint16_t h = skv__float_to_fp16(f) & 0x7fffu;
    double hf = skv__fp16_to_float(h), ulp = skv__fp16_to_float((uint16_t)(h + 1)) - hf;
    if (dabs(hf - dabs(f)) > ulp / 2) bad++, worst = f;
  }
  cr_assert_eq(bad, 0, "%d floats convert to fp16 with more than half an ulp of error (e.g. %a)",
               bad, worst);
}
