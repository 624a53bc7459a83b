/* GPU tests of the collectives (skipped without GPUs): every dtype, op and algorithm from 1
 * element to 64 MiB against float64, graph replays, two streams, timeouts, the device API.
 * They need one GPU: with fewer GPUs than PEs the PEs share them (run the MPS daemon for speed;
 * without it they take turns on the GPU and the tests run fewer rounds, docs/comm.md). */
#define _GNU_SOURCE
#include "skv_test.h"

#include "comm/comm_state.h"

#include <criterion/criterion.h>
#include <criterion/parameterized.h>
#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <xxhash.h>

TestSuite(gpu_comm, .timeout = 900);

#define CU(call) \
  PE_CHECK((call) == cudaSuccess, "%s: %s", #call, cudaGetErrorString(cudaGetLastError()))

/* ---- data (as in test_comm.c; no libm in the test link) ----------------------------------- */

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

static void gen_input(void *buf, size_t count, int dtype, uint64_t seed, int pe) {
  uint64_t s = seed ^ (0x9e3779b97f4a7c15ull * (uint64_t)(pe + 1));
  for (size_t i = 0; i < count; i++) {
    float f = (float)((int)(skv_test_rand(&s) % 4001) - 2000) / 250.0f;
    if (dtype == SKV_DTYPE_FP32) {
      memcpy((char *)buf + 4 * i, &f, 4);
    } else {
      uint16_t h = dtype == SKV_DTYPE_BF16 ? skv__float_to_bf16(f) : skv__float_to_fp16(f);
      memcpy((char *)buf + 2 * i, &h, 2);
    }
  }
}

/* How many times the element type may be rounded on the way to a result: symkv's algorithms
 * accumulate in float32 and round once; NCCL's ring rounds each partial sum it passes on (npes - 1
 * times), which 4 PEs on 4 H100 showed (bf16: 1 ulp off the once-rounded sum). */
static int roundings(skv_comm_t *comm, int algo, uint64_t bytes, int npes) {
  if (algo == SKV_ALGO_AUTO) algo = skv__comm_choose(comm, bytes);
  return algo == SKV_ALGO_NCCL ? SKV_MAX(npes - 1, 1) : 1;
}

static int check_output(const void *out, size_t count, int dtype, int op, int npes, int rounds,
                        uint64_t seed, char *why, size_t cap) {
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
      ref = p == 0             ? x
            : op == SKV_OP_SUM ? ref + x
            : op == SKV_OP_MAX ? dmax(ref, x)
                               : dmin(ref, x);
      mag += dabs(x);
    }
    double got = decode(out, i, dtype);
    double tol = op == SKV_OP_SUM
                     ? eps * dabs(ref) + (rounds - 1) * eps * mag + npes * mag * 0x1p-22 + 1e-7
                     : 0;
    if (!(dabs(got - ref) <= tol)) {
      snprintf(why, cap, "element %zu of %zu: got %.9g, float64 reference %.9g", i, count, got,
               ref);
      bad = 1;
    }
  }
  free(inputs);
  return bad;
}

/* Every PE agrees that every PE passed, and holds the same bytes (2: passed, but the bytes
 * differ between PEs). */
static int agree(skv_ctx_t *ctx, int bad, const void *out, size_t bytes, char *why, size_t cap) {
  struct {
    int32_t bad;
    uint64_t hash;
  } me = {bad, bad ? 0 : XXH3_64bits(out, bytes)}, all[SKV_TEST_MAX_PES];
  if (skv_ctx_allgather(ctx, &me, all, sizeof me) != 0)
    return snprintf(why, cap, "allgather failed"), 1;
  if (bad) return 1;
  for (int r = 0; r < skv_ctx_get_world_size(ctx); r++) {
    if (all[r].bad) return 0; /* that PE reports its own failure */
    if (all[r].hash != me.hash)
      return snprintf(why, cap, "PE %d's output differs from mine, bit for bit", r), 2;
  }
  return 0;
}

typedef struct pe_env {
  skv_ctx_t *ctx;
  skv_comm_t *comm;
  int rank, npes, ngpus;
  cudaStream_t s;
  char *dev_a, *dev_b; /* cudaMalloc'ed, 64 MiB + 64 each */
  char *heap_a;        /* the comm heap's data area (same offset everywhere) */
  char *host_in, *host_out;
} pe_env_t;

#define MAX_BYTES (64u << 20)

static int env_open(pe_env_t *e, int rank, int npes, int timeout_ms) {
  memset(e, 0, sizeof *e);
  e->rank = rank;
  e->npes = npes;
  PE_CHECK(skv_test_init(&e->ctx, timeout_ms) == 0, "init");
  PE_CHECK(skv_ctx_get_device(e->ctx) >= 0, "device: %s", skv_last_error());
  CU(cudaGetDeviceCount(&e->ngpus));
  skv_comm_opts_t o = SKV_COMM_OPTS_INIT;
  o.channels = 2;
  o.max_bytes = MAX_BYTES;
  PE_CHECK(skv_comm_create(e->ctx, &o, &e->comm) == 0, "comm create");
  CU(cudaStreamCreate(&e->s));
  CU(cudaMalloc((void **)&e->dev_a, MAX_BYTES + 64));
  CU(cudaMalloc((void **)&e->dev_b, MAX_BYTES + 64));
  skv_heap_t *h = skv_comm_get_heap(e->comm);
  e->heap_a = skv_heap_get_ptr(h, rank, h->info.data_offset);
  e->host_in = malloc(MAX_BYTES + 64);
  e->host_out = malloc(MAX_BYTES + 64);
  PE_CHECK(e->host_in && e->host_out, "malloc");
  return 0;
}

static int env_close(pe_env_t *e) {
  CU(cudaStreamSynchronize(e->s));
  cudaFree(e->dev_a);
  cudaFree(e->dev_b);
  cudaStreamDestroy(e->s);
  free(e->host_in);
  free(e->host_out);
  PE_CHECK(skv_comm_destroy(e->comm) == 0, "comm destroy: %s", skv_last_error());
  PE_CHECK(skv_finalize(e->ctx) == 0, "finalize");
  return 0;
}

typedef struct ar_case {
  size_t count;
  int dtype, op, algo, in_place, in_heap, misalign, channel;
} ar_case_t;

static const char *case_str(const ar_case_t *k) {
  static char s[160];
  snprintf(s, sizeof s, "count %zu %s %s %s ch%d%s%s%s", k->count, skv__dtype_name(k->dtype),
           skv__op_name(k->op), skv__algo_name(k->algo), k->channel, k->in_place ? " in-place" : "",
           k->in_heap ? " in-heap" : "", k->misalign ? " misaligned" : "");
  return s;
}

/* One checked all-reduce; returns 0 when it passed on every PE. */
static int run_case(pe_env_t *e, const ar_case_t *k, uint64_t seed, char *why, size_t cap) {
  uint32_t es = esize(k->dtype);
  size_t bytes = k->count * es, shift = k->misalign ? es : 0;
  char *a = (k->in_heap ? e->heap_a : e->dev_a) + shift, *out = k->in_place ? a : e->dev_b + shift;
  gen_input(e->host_in, k->count, k->dtype, seed, e->rank);
  int bad = 0;
  if (cudaMemcpyAsync(a, e->host_in, bytes, cudaMemcpyHostToDevice, e->s) != cudaSuccess ||
      (!k->in_place && cudaMemsetAsync(out, 0x7f, bytes, e->s) != cudaSuccess)) {
    snprintf(why, cap, "upload: %s", cudaGetErrorString(cudaGetLastError()));
    bad = 1;
  }
  int rc = bad ? 0
               : skv_comm_allreduce(e->comm, a, out, k->count, k->dtype, k->op, k->algo, k->channel,
                                    e->s);
  if (rc != 0) {
    snprintf(why, cap, "skv_comm_allreduce: %s: %s", skv_err_name(rc), skv_last_error());
    bad = 1;
  }
  if (!bad &&
      (cudaMemcpyAsync(e->host_out, out, bytes, cudaMemcpyDeviceToHost, e->s) != cudaSuccess ||
       cudaStreamSynchronize(e->s) != cudaSuccess)) {
    snprintf(why, cap, "download: %s", cudaGetErrorString(cudaGetLastError()));
    bad = 1;
  }
  if (!bad && (rc = skv_comm_check(e->comm)) != 0) {
    snprintf(why, cap, "skv_comm_check: %s: %s", skv_err_name(rc), skv_last_error());
    bad = 1;
  }
  if (!bad)
    bad = check_output(e->host_out, k->count, k->dtype, k->op, e->npes,
                       roundings(e->comm, k->algo, bytes, e->npes), seed, why, cap);
  int rc2 = agree(e->ctx, bad, e->host_out, bytes, why, cap);
  if (rc2 == 2 && k->algo == SKV_ALGO_NCCL) {
    /* symkv's own algorithms promise identical bits; NCCL's are reported, not failed */
    if (e->rank == 0) fprintf(stderr, "note: ncclAllReduce (%s): %s\n", case_str(k), why);
    return 0;
  }
  return rc2;
}

/* ---- every dtype, op, algorithm and size, 1 element .. 64 MiB ---------------------------- */

static int pe_sweep(int rank, int npes, void *arg) {
  pe_env_t e;
  if (env_open(&e, rank, npes, 120000)) return 1;
  uint64_t seed = skv_test_seed();
  PE_CHECK(skv_ctx_broadcast(e.ctx, &seed, sizeof seed, 0) == 0, "seed");
  static const size_t counts[] = {1, 2, 3, 7, 8, 9, 17, 127, 1000, 4097, 65537, 262147, 1048577};
  static const int algos[] = {SKV_ALGO_ONESHOT, SKV_ALGO_TWOSHOT, SKV_ALGO_NCCL, SKV_ALGO_AUTO};
  char why[256];
  uint64_t call = 0;
  for (int dt = SKV_DTYPE_BF16; dt <= SKV_DTYPE_FP32; dt++)
    for (int op = SKV_OP_SUM; op <= SKV_OP_MIN; op++)
      for (size_t a = 0; a < 4; a++) {
        if (algos[a] == SKV_ALGO_NCCL && !e.comm->has_nccl) {
          float x = 0;
          int rc = skv_comm_allreduce(e.comm, &x, &x, 1, dt, op, SKV_ALGO_NCCL, 0, e.s);
          PE_CHECK(rc == SKV_ENOTSUP, "NCCL without a communicator: %s", skv_err_name(rc));
          continue;
        }
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
          PE_CHECK(run_case(&e, &k, seed + call, why, sizeof why) == 0, "%s: %s", case_str(&k),
                   why);
        }
      }
  /* 64 MiB, bf16 sum, with every algorithm */
  for (size_t a = 0; a < 4; a++) {
    if (algos[a] == SKV_ALGO_NCCL && !e.comm->has_nccl) continue;
    ar_case_t k = {MAX_BYTES / 2, SKV_DTYPE_BF16, SKV_OP_SUM, algos[a],
                   (int)(a % 2),  (int)(a == 0),  0,          0};
    PE_CHECK(run_case(&e, &k, seed + 100000 + a, why, sizeof why) == 0, "%s: %s", case_str(&k),
             why);
    k.count = MAX_BYTES / 4 - 1; /* fp32, odd */
    k.dtype = SKV_DTYPE_FP32;
    PE_CHECK(run_case(&e, &k, seed + 200000 + a, why, sizeof why) == 0, "%s: %s", case_str(&k),
             why);
  }
  return env_close(&e);
}

ParameterizedTestParameters(gpu_comm, allreduce_matches_float64_reference) {
  static int n[] = {2, 4};
  return cr_make_param_array(int, n, sizeof n / sizeof n[0]);
}

ParameterizedTest(int *npes, gpu_comm, allreduce_matches_float64_reference) {
  SKV_TEST_REQUIRE_GPUS(1);
  skv_test_job_t job;
  int bad = skv_test_run(&job, *npes, pe_sweep, NULL, 880000);
  cr_assert_eq(bad, 0, "%d PEs: %s", *npes, skv_test_statuses(&job));
}

/* ---- CUDA graphs: 1000 replays with fresh inputs ------------------------------------------ */

static int pe_graph(int rank, int npes, void *arg) {
  pe_env_t e;
  if (env_open(&e, rank, npes, 60000)) return 1;
  int replays = *(int *)arg;
  if (e.comm->gpu_time_sliced) replays /= 10; /* PEs taking turns on a GPU: every step waits */
  uint64_t seed = skv_test_seed();
  PE_CHECK(skv_ctx_broadcast(e.ctx, &seed, sizeof seed, 0) == 0, "seed");
  /* three calls (one-shot bf16, two-shot fp32, AUTO fp16 in place in the heap) and a barrier */
  const ar_case_t ks[3] = {{1000, SKV_DTYPE_BF16, SKV_OP_SUM, SKV_ALGO_ONESHOT, 0, 0, 0, 0},
                           {20001, SKV_DTYPE_FP32, SKV_OP_SUM, SKV_ALGO_TWOSHOT, 0, 0, 0, 0},
                           {5003, SKV_DTYPE_FP16, SKV_OP_MAX, SKV_ALGO_AUTO, 1, 1, 0, 0}};
  char *ins[3] = {e.dev_a, e.dev_a + (1u << 20), e.heap_a};
  char *outs[3] = {e.dev_b, e.dev_b + (1u << 20), e.heap_a};
  cudaGraph_t g;
  cudaGraphExec_t ge;
  /* thread-local: a background thread's CUDA call (NCCL's proxy) must not void the capture */
  CU(cudaStreamBeginCapture(e.s, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < 3; i++)
    PE_CHECK(skv_comm_allreduce(e.comm, ins[i], outs[i], ks[i].count, ks[i].dtype, ks[i].op,
                                ks[i].algo, 0, e.s) == 0,
             "capture %d: %s", i, skv_last_error());
  PE_CHECK(skv_comm_barrier(e.comm, 0, e.s) == 0, "capture barrier");
  PE_CHECK(skv_comm_check(e.comm) == 0, "check during capture");
  CU(cudaStreamEndCapture(e.s, &g));
  CU(cudaGraphInstantiate(&ge, g, 0));
  char why[256];
  for (int r = 0; r < replays; r++) {
    for (int i = 0; i < 3; i++) {
      gen_input(e.host_in + (size_t)i * (1u << 20), ks[i].count, ks[i].dtype,
                seed + (uint64_t)r * 3 + i, rank);
      CU(cudaMemcpyAsync(ins[i], e.host_in + (size_t)i * (1u << 20),
                         ks[i].count * esize(ks[i].dtype), cudaMemcpyHostToDevice, e.s));
    }
    CU(cudaGraphLaunch(ge, e.s));
    int bad = 0;
    for (int i = 0; i < 3 && !bad; i++) {
      CU(cudaMemcpyAsync(e.host_out, outs[i], ks[i].count * esize(ks[i].dtype),
                         cudaMemcpyDeviceToHost, e.s));
      CU(cudaStreamSynchronize(e.s));
      bad = check_output(e.host_out, ks[i].count, ks[i].dtype, ks[i].op, npes,
                         roundings(e.comm, ks[i].algo, ks[i].count * esize(ks[i].dtype), npes),
                         seed + (uint64_t)r * 3 + i, why, sizeof why);
      if (bad) snprintf(why + strlen(why), sizeof why - strlen(why), " (call %d)", i);
    }
    PE_CHECK(!bad, "replay %d: %s", r, why);
    /* the graph's barrier keeps the next replay's uploads behind every PE's reads */
  }
  PE_CHECK(skv_comm_check(e.comm) == 0, "check: %s", skv_last_error());
  /* the kernels advanced the epochs themselves: one per launch, the same on every PE */
  skv__comm_dev_t d;
  PE_CHECK(skv__comm_cuda_dev(e.comm, &d) == 0, "dev");
  skv__chan_state_t st;
  CU(cudaMemcpy(&st, d.chan, sizeof st, cudaMemcpyDeviceToHost));
  for (uint32_t i = 0; i < SKV__EPOCH_LANES; i++)
    PE_CHECK(st.epoch[i] == (uint64_t)replays * 3, "epoch lane %u: %llu, want %d", i,
             (unsigned long long)st.epoch[i], replays * 3);
  PE_CHECK(st.barrier_epoch == (uint64_t)replays, "barrier epoch %llu",
           (unsigned long long)st.barrier_epoch);
  cudaGraphExecDestroy(ge);
  cudaGraphDestroy(g);
  return env_close(&e);
}

ParameterizedTestParameters(gpu_comm, graph_replays) {
  static int n[] = {2, 4};
  return cr_make_param_array(int, n, sizeof n / sizeof n[0]);
}

ParameterizedTest(int *npes, gpu_comm, graph_replays) {
  SKV_TEST_REQUIRE_GPUS(1);
  int replays = 1000;
  skv_test_job_t job;
  int bad = skv_test_run(&job, *npes, pe_graph, &replays, 880000);
  cr_assert_eq(bad, 0, "%d PEs: %s", *npes, skv_test_statuses(&job));
}

/* ---- two streams on two channels at once -------------------------------------------------- */

static int pe_streams(int rank, int npes, void *arg) {
  pe_env_t e;
  if (env_open(&e, rank, npes, 60000)) return 1;
  uint64_t seed = skv_test_seed();
  PE_CHECK(skv_ctx_broadcast(e.ctx, &seed, sizeof seed, 0) == 0, "seed");
  cudaStream_t s2;
  CU(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
  int iters = e.comm->gpu_time_sliced ? 20 : 200;
  const size_t ca = 3001, cb = 700001; /* fp32: one-shot on channel 0, two-shot on channel 1 */
  char why[256];
  for (int i = 0; i < iters; i++) {
    gen_input(e.host_in, ca, SKV_DTYPE_FP32, seed + 2 * (uint64_t)i, rank);
    gen_input(e.host_in + (8u << 20), cb, SKV_DTYPE_FP32, seed + 2 * (uint64_t)i + 1, rank);
    CU(cudaMemcpy(e.dev_a, e.host_in, ca * 4, cudaMemcpyHostToDevice));
    CU(cudaMemcpy(e.dev_a + (8u << 20), e.host_in + (8u << 20), cb * 4, cudaMemcpyHostToDevice));
    /* cudaMemcpy from pageable memory may return before its DMA landed, and s2 (non-blocking)
     * does not wait for the legacy stream: without this the channel-1 kernel read a stale tail
     * of its input under MPS (4 PEs on one H100: element 524288 of 700001 wrong on every PE) */
    CU(cudaDeviceSynchronize());
    /* odd PEs enqueue channel 1 first: the kernels must run side by side, not in one order */
    for (int j = 0; j < 2; j++) {
      int which = (j + rank) % 2;
      int rc = which == 0
                   ? skv_comm_allreduce(e.comm, e.dev_a, e.dev_b, ca, SKV_DTYPE_FP32, SKV_OP_SUM,
                                        SKV_ALGO_ONESHOT, 0, e.s)
                   : skv_comm_allreduce(e.comm, e.dev_a + (8u << 20), e.dev_b + (8u << 20), cb,
                                        SKV_DTYPE_FP32, SKV_OP_SUM, SKV_ALGO_TWOSHOT, 1, s2);
      PE_CHECK(rc == 0, "iteration %d: %s", i, skv_last_error());
    }
    CU(cudaStreamSynchronize(e.s));
    CU(cudaStreamSynchronize(s2));
    PE_CHECK(skv_comm_check(e.comm) == 0, "iteration %d: %s", i, skv_last_error());
    CU(cudaMemcpy(e.host_out, e.dev_b, ca * 4, cudaMemcpyDeviceToHost));
    PE_CHECK(!check_output(e.host_out, ca, SKV_DTYPE_FP32, SKV_OP_SUM, npes, 1,
                           seed + 2 * (uint64_t)i, why, sizeof why),
             "iteration %d channel 0: %s", i, why);
    CU(cudaMemcpy(e.host_out, e.dev_b + (8u << 20), cb * 4, cudaMemcpyDeviceToHost));
    PE_CHECK(!check_output(e.host_out, cb, SKV_DTYPE_FP32, SKV_OP_SUM, npes, 1,
                           seed + 2 * (uint64_t)i + 1, why, sizeof why),
             "iteration %d channel 1: %s", i, why);
    PE_CHECK(skv_ctx_barrier(e.ctx) == 0, "host barrier"); /* inputs are rewritten next */
  }
  cudaStreamDestroy(s2);
  return env_close(&e);
}

ParameterizedTestParameters(gpu_comm, two_streams_on_two_channels) {
  static int n[] = {2, 4};
  return cr_make_param_array(int, n, sizeof n / sizeof n[0]);
}

ParameterizedTest(int *npes, gpu_comm, two_streams_on_two_channels) {
  SKV_TEST_REQUIRE_GPUS(1);
  skv_test_job_t job;
  int bad = skv_test_run(&job, *npes, pe_streams, NULL, 880000);
  cr_assert_eq(bad, 0, "%d PEs: %s", *npes, skv_test_statuses(&job));
}

/* ---- a peer that never arrives ------------------------------------------------------------ */

static int pe_missing(int rank, int npes, void *arg) {
  pe_env_t e;
  if (env_open(&e, rank, npes, 60000)) return 1;
  skv_comm_opts_t o = SKV_COMM_OPTS_INIT;
  o.channels = 1;
  o.max_bytes = 1u << 20;
  o.flags = SKV_COMM_NO_NCCL;
  skv_comm_t *c2, *c3;
  PE_CHECK(skv_comm_create(e.ctx, &o, &c2) == 0 && skv_comm_create(e.ctx, &o, &c3) == 0,
           "more comms");
  if (rank == 0) {
    skv_comm_t *comms[3] = {e.comm, c2, c3};
    const char *needle[3] = {"PE 1", "PE 1", "slot 7"};
    PE_CHECK(skv_ctx_set_timeout_ms(e.ctx, 1500) == 0, "timeout");
    for (int w = 0; w < 3; w++) {
      uint64_t t0 = skv__now_ms();
      int rc = w == 0   ? skv_comm_allreduce(comms[w], e.dev_a, e.dev_a, 4096, SKV_DTYPE_BF16,
                                             SKV_OP_SUM, SKV_ALGO_ONESHOT, 0, e.s)
               : w == 1 ? skv_comm_barrier(comms[w], 0, e.s)
                        : skv_comm_wait(comms[w], 7, SKV_CMP_GE, 1, e.s);
      PE_CHECK(rc == 0, "launch %d: %s", w, skv_last_error());
      CU(cudaStreamSynchronize(e.s)); /* the kernel gives up by itself */
      uint64_t dt = skv__now_ms() - t0;
      rc = skv_comm_check(comms[w]);
      PE_CHECK(rc == SKV_ETIMEDOUT && strstr(skv_last_error(), needle[w]), "case %d: %s: %s", w,
               skv_err_name(rc), skv_last_error());
      PE_CHECK(dt >= 1500 && dt < 10000, "case %d gave up after %llu ms (timeout 1500)", w,
               (unsigned long long)dt);
      PE_CHECK(skv_comm_check(comms[w]) == 0, "check clears the error");
      rc = skv_comm_allreduce(comms[w], e.dev_a, e.dev_a, 16, SKV_DTYPE_BF16, SKV_OP_SUM,
                              SKV_ALGO_ONESHOT, 0, e.s);
      PE_CHECK(rc == SKV_ESTATE, "after the timeout: %s", skv_err_name(rc));
    }
    PE_CHECK(skv_ctx_set_timeout_ms(e.ctx, 60000) == 0, "timeout");
  }
  PE_CHECK(skv_ctx_barrier(e.ctx) == 0, "host barrier");
  PE_CHECK(skv_comm_destroy(c3) == 0 && skv_comm_destroy(c2) == 0, "destroy");
  return env_close(&e);
}

Test(gpu_comm, peer_that_never_arrives_times_out, .timeout = 300) {
  SKV_TEST_REQUIRE_GPUS(1);
  skv_test_job_t job;
  int bad = skv_test_run(&job, 2, pe_missing, NULL, 280000);
  cr_assert_eq(bad, 0, "%s", skv_test_statuses(&job));
}

/* ---- checking mode ------------------------------------------------------------------------ */

/* Checking mode on the GPU: matching calls (also in a graph) pass and reduce right; PE 1 reducing
 * with another op makes skv_comm_check return SKV_EMISMATCH on every PE, naming both calls, and
 * the call's kernel writes nothing. */
static int pe_checked(int rank, int npes, void *arg) {
  pe_env_t e;
  if (env_open(&e, rank, npes, 60000)) return 1;
  skv_comm_opts_t o = SKV_COMM_OPTS_INIT;
  o.channels = 2;
  o.max_bytes = 1u << 20;
  o.flags = SKV_COMM_NO_NCCL | SKV_COMM_CHECKED;
  skv_comm_t *c;
  PE_CHECK(skv_comm_create(e.ctx, &o, &c) == 0, "checked comm: %s", skv_last_error());
  const size_t n = 4096;
  float *h = (float *)e.host_in;
  for (size_t i = 0; i < n; i++) h[i] = (float)(rank + 1);
  CU(cudaMemcpy(e.dev_a, h, n * 4, cudaMemcpyHostToDevice));
  for (int round = 0; round < 4; round++) {
    PE_CHECK(skv_comm_allreduce(c, e.dev_a, e.dev_b, n, SKV_DTYPE_FP32, SKV_OP_SUM,
                                round & 1 ? SKV_ALGO_TWOSHOT : SKV_ALGO_ONESHOT, round & 1,
                                e.s) == 0,
             "launch: %s", skv_last_error());
    PE_CHECK(skv_comm_barrier(c, round & 1, e.s) == 0, "barrier: %s", skv_last_error());
  }
  CU(cudaStreamSynchronize(e.s));
  PE_CHECK(skv_comm_check(c) == 0, "matching checked calls: %s", skv_last_error());
  CU(cudaMemcpy(e.host_out, e.dev_b, n * 4, cudaMemcpyDeviceToHost));
  PE_CHECK(((float *)e.host_out)[7] == (float)(npes * (npes + 1) / 2), "sum %g",
           (double)((float *)e.host_out)[7]);
  CU(cudaMemset(e.dev_b, 0, n * 4));
  int rc = skv_comm_allreduce(c, e.dev_a, e.dev_b, n, SKV_DTYPE_FP32,
                              rank == 1 ? SKV_OP_MAX : SKV_OP_SUM, SKV_ALGO_ONESHOT, 0, e.s);
  PE_CHECK(rc == 0, "launch: %s", skv_last_error());
  CU(cudaStreamSynchronize(e.s));
  rc = skv_comm_check(c);
  PE_CHECK(rc == SKV_EMISMATCH && strstr(skv_last_error(), "max") &&
               strstr(skv_last_error(), "sum"),
           "mismatched op: %s: %s", skv_err_name(rc), skv_last_error());
  CU(cudaMemcpy(e.host_out, e.dev_b, n * 4, cudaMemcpyDeviceToHost));
  PE_CHECK(((float *)e.host_out)[7] == 0.0f, "the mismatched call wrote its output");
  PE_CHECK(skv_ctx_barrier(e.ctx) == 0, "host barrier");
  PE_CHECK(skv_comm_destroy(c) == 0, "destroy: %s", skv_last_error());
  return env_close(&e);
}

Test(gpu_comm, checking_mode_catches_a_mismatched_op, .timeout = 300) {
  SKV_TEST_REQUIRE_GPUS(1);
  skv_test_job_t job;
  int bad = skv_test_run(&job, 2, pe_checked, NULL, 280000);
  cr_assert_eq(bad, 0, "%s", skv_test_statuses(&job));
}

/* ---- SKV_COMM_CHUNK: a message cut into launches of another size ------------------------- */

static int pe_chunk_bad(int rank, int npes, void *arg) {
  (void)npes, (void)arg;
  /* a bad value on one PE fails skv_comm_create on every PE, nothing left waiting */
  setenv("SKV_COMM_CHUNK", rank == 0 ? "12" : "64K", 1);
  skv__env_reload();
  skv_ctx_t *ctx;
  PE_CHECK(skv_test_init(&ctx, 60000) == 0, "init");
  skv_comm_t *c = NULL;
  int rc = skv_comm_create(ctx, NULL, &c);
  PE_CHECK(c == NULL, "comm created");
  /* PE 0 names its bad value; the others fail with a mismatch that names it */
  PE_CHECK(rc == (rank == 0 ? SKV_EINVAL : SKV_EMISMATCH) &&
               strstr(skv_last_error(), "SKV_COMM_CHUNK=12") != NULL,
           "%s: %s", skv_err_name(rc), skv_last_error());
  PE_CHECK(skv_ctx_barrier(ctx) == 0, "the job is still usable");
  PE_CHECK(skv_finalize(ctx) == 0, "finalize");
  return 0;
}

static int pe_chunk(int rank, int npes, void *arg) {
  (void)arg;
  /* 64 KiB chunks: 1 MiB messages take 16+ launches; bits as the float64 reference says, and
   * the epoch lanes advanced once per launch on every PE */
  setenv("SKV_COMM_CHUNK", "64K", 1);
  skv__env_reload();
  pe_env_t e;
  if (env_open(&e, rank, npes, 60000)) return 1;
  PE_CHECK(e.comm->region_bytes == (128u << 10), "region %llu, want 128 KiB",
           (unsigned long long)e.comm->region_bytes);
  uint64_t seed = skv_test_seed();
  PE_CHECK(skv_ctx_broadcast(e.ctx, &seed, sizeof seed, 0) == 0, "seed");
  static const ar_case_t ks[] = {
      {(1u << 19) + 3, SKV_DTYPE_BF16, SKV_OP_SUM, SKV_ALGO_TWOSHOT, 0, 0, 0, 0},
      {(1u << 18) + 1, SKV_DTYPE_FP32, SKV_OP_MAX, SKV_ALGO_TWOSHOT, 1, 0, 1, 0},
      {100001, SKV_DTYPE_FP16, SKV_OP_SUM, SKV_ALGO_ONESHOT, 0, 1, 0, 0}};
  char why[256];
  uint64_t launches = 0;
  for (size_t i = 0; i < SKV_ARRAY_LEN(ks); i++) {
    PE_CHECK(run_case(&e, &ks[i], seed + i, why, sizeof why) == 0, "%s: %s", case_str(&ks[i]), why);
    uint64_t per = skv__comm_chunk_count(e.comm, ks[i].algo, esize(ks[i].dtype));
    launches += (ks[i].count + per - 1) / per;
  }
  PE_CHECK(launches >= 30, "only %llu launches", (unsigned long long)launches);
  skv__comm_dev_t d;
  PE_CHECK(skv__comm_cuda_dev(e.comm, &d) == 0, "dev");
  skv__chan_state_t st;
  CU(cudaMemcpy(&st, d.chan, sizeof st, cudaMemcpyDeviceToHost));
  PE_CHECK(st.epoch[0] == launches, "epoch %llu, want %llu launches",
           (unsigned long long)st.epoch[0], (unsigned long long)launches);
  return env_close(&e);
}

Test(gpu_comm, chunk_size_from_the_environment, .timeout = 300) {
  SKV_TEST_REQUIRE_GPUS(1);
  skv_test_job_t job;
  int bad = skv_test_run(&job, 2, pe_chunk_bad, NULL, 120000);
  cr_assert_eq(bad, 0, "%s", skv_test_statuses(&job));
  bad = skv_test_run(&job, 2, pe_chunk, NULL, 160000);
  cr_assert_eq(bad, 0, "%s", skv_test_statuses(&job));
}

/* ---- signals, barriers, the device API, capture rules ------------------------------------- */

static int pe_signals(int rank, int npes, void *arg) {
  pe_env_t e;
  if (env_open(&e, rank, npes, 60000)) return 1;
  /* stream-ordered ping-pong between PEs 0 and 1, then barriers on both channels */
  if (rank < 2) {
    for (uint64_t i = 1; i <= 200; i++) {
      if (rank == 0) {
        PE_CHECK(skv_comm_signal(e.comm, 1, 5, i, SKV_SIGNAL_SET, e.s) == 0, "signal");
        PE_CHECK(skv_comm_wait(e.comm, 5, SKV_CMP_GE, i, e.s) == 0, "wait");
      } else {
        PE_CHECK(skv_comm_wait(e.comm, 5, SKV_CMP_EQ, i, e.s) == 0, "wait");
        PE_CHECK(skv_comm_signal(e.comm, 0, 5, i, SKV_SIGNAL_SET, e.s) == 0, "signal");
      }
    }
  }
  for (int i = 0; i < 200; i++) PE_CHECK(skv_comm_barrier(e.comm, i % 2, e.s) == 0, "barrier");
  PE_CHECK(skv_comm_signal(e.comm, 0, 6, 1, SKV_SIGNAL_ADD, e.s) == 0, "add");
  PE_CHECK(skv_comm_barrier(e.comm, 0, e.s) == 0, "barrier");
  if (rank == 0)
    PE_CHECK(skv_comm_wait(e.comm, 6, SKV_CMP_EQ, (uint64_t)npes, e.s) == 0, "wait adds");
  CU(cudaStreamSynchronize(e.s));
  PE_CHECK(skv_comm_check(e.comm) == 0, "check: %s", skv_last_error());
  /* the device API from a test kernel: put-with-signal ring, block and grid barriers */
  int errs[2] = {-1, -1};
  PE_CHECK(skv__comm_devapi_selftest(e.comm, 100, 50, 8, 0, 64u << 10, errs, e.s) == 0,
           "selftest: %s", skv_last_error());
  PE_CHECK(errs[0] == 0 && errs[1] == 0, "device API self-test: %d wrong words, %d timeouts",
           errs[0], errs[1]);
  /* in-kernel ping-pong */
  if (rank < 2) {
    double rt = 0;
    PE_CHECK(skv__comm_pingpong(e.comm, 1 - rank, 300, 0, 1000, &rt, e.s) == 0, "pingpong: %s",
             skv_last_error());
    if (rank == 0) fprintf(stderr, "device-API signal ping-pong round trip: %.2f us\n", rt);
  }
  /* capture rules: destroy refuses (the comm stays usable), check is fine, max_bytes holds */
  cudaStream_t cs;
  CU(cudaStreamCreate(&cs));
  CU(cudaStreamBeginCapture(cs, cudaStreamCaptureModeGlobal));
  int rc = skv_comm_destroy(e.comm);
  int rc2 = skv_comm_check(e.comm);
  int rc3 = skv_comm_allreduce(e.comm, e.dev_a, e.dev_a, MAX_BYTES / 2 + 1, SKV_DTYPE_BF16,
                               SKV_OP_SUM, SKV_ALGO_ONESHOT, 0, cs);
  cudaGraph_t g;
  CU(cudaStreamEndCapture(cs, &g));
  cudaGraphDestroy(g);
  cudaStreamDestroy(cs);
  PE_CHECK(rc == SKV_ECAPTURE, "destroy during capture: %s", skv_err_name(rc));
  PE_CHECK(rc2 == 0, "check during capture: %s", skv_err_name(rc2));
  PE_CHECK(rc3 == SKV_ERANGE, "beyond max_bytes in a capture: %s", skv_err_name(rc3));
  ar_case_t k = {999, SKV_DTYPE_BF16, SKV_OP_SUM, SKV_ALGO_AUTO, 0, 0, 0, 0};
  char why[256];
  PE_CHECK(run_case(&e, &k, 77, why, sizeof why) == 0, "after the capture: %s", why);
  return env_close(&e);
}

ParameterizedTestParameters(gpu_comm, signals_barriers_and_device_api) {
  static int n[] = {2, 4};
  return cr_make_param_array(int, n, sizeof n / sizeof n[0]);
}

ParameterizedTest(int *npes, gpu_comm, signals_barriers_and_device_api) {
  SKV_TEST_REQUIRE_GPUS(1);
  skv_test_job_t job;
  int bad = skv_test_run(&job, *npes, pe_signals, NULL, 880000);
  cr_assert_eq(bad, 0, "%d PEs: %s", *npes, skv_test_statuses(&job));
}
