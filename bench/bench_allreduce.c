/* symkv-bench allreduce: skv_comm_allreduce latency inside CUDA graphs per algorithm and AUTO
 * against ncclAllReduce captured the same way in the same run; crossovers; barrier; signal round
 * trips. */
#define _GNU_SOURCE
#include "bench.h"

#include "comm/comm_state.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef SKV_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

#define NALGO 4
static const int algos[NALGO] = {SKV_ALGO_ONESHOT, SKV_ALGO_TWOSHOT, SKV_ALGO_AUTO, SKV_ALGO_NCCL};

typedef struct arb {
  bench_t *b;
  skv_ctx_t *ctx;
  skv_comm_t *comm;
  int rank, npes, dtype, reps, calls;
  bool cuda;
  bool sliced;    /* PEs share a GPU without MPS: every step waits a time slice (docs/comm.md) */
  void *in, *out; /* max_bytes each */
  uint64_t max_bytes;
#ifdef SKV_WITH_CUDA
  cudaStream_t s;
  cudaEvent_t e0, e1;
#endif
} arb_t;

#define BCU(call)                                                                           \
  do {                                                                                      \
    int e_ = (int)(call);                                                                   \
    if (e_ != 0)                                                                            \
      return SKV_FAIL(SKV_ECUDA, SKV_SUBSYS_BENCH, "%s failed (CUDA error %d)", #call, e_); \
  } while (0)

/* Calls per timed graph: about 100, fewer for big messages (a graph of ~10 ms at most). */
static int calls_for(const arb_t *a, uint64_t bytes) {
  uint64_t c = (uint64_t)a->calls;
  if (bytes > (1u << 20)) c = c * (1u << 20) / bytes;
  return (int)SKV_MAX(c, 8u);
}

/* Median microseconds per call of `algo` on this PE; NaN when the algorithm is unavailable. */
static int time_one(arb_t *a, int algo, uint64_t bytes, double *us) {
  uint32_t es = skv__dtype_size(a->dtype);
  size_t count = (size_t)(bytes / es);
  int calls = calls_for(a, bytes);
  double t[64];
  int reps = SKV_MIN(a->reps, 64);
  *us = NAN;
  if (algo == SKV_ALGO_NCCL && !a->comm->has_nccl) return 0;
  if (!a->cuda) { /* host backend: synchronous calls, wall clock */
    for (int r = 0; r < reps; r++) {
      SKV_CHECK(skv_ctx_barrier(a->ctx));
      double t0 = bench_now();
      for (int i = 0; i < calls; i++)
        SKV_CHECK(
            skv_comm_allreduce(a->comm, a->in, a->out, count, a->dtype, SKV_OP_SUM, algo, 0, NULL));
      t[r] = (bench_now() - t0) * 1e6 / calls;
    }
    *us = bench_median(t, (size_t)reps);
    return 0;
  }
#ifdef SKV_WITH_CUDA
  cudaGraph_t g;
  cudaGraphExec_t ge;
  BCU(cudaStreamBeginCapture(a->s, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < calls; i++) {
    int rc = skv_comm_allreduce(a->comm, a->in, a->out, count, a->dtype, SKV_OP_SUM, algo, 0, a->s);
    if (rc) {
      cudaStreamEndCapture(a->s, &g);
      return rc;
    }
  }
  BCU(cudaStreamEndCapture(a->s, &g));
  BCU(cudaGraphInstantiate(&ge, g, 0));
  BCU(cudaGraphLaunch(ge, a->s)); /* warm-up */
  BCU(cudaStreamSynchronize(a->s));
  SKV_CHECK(skv_ctx_barrier(a->ctx));
  for (int r = 0; r < reps; r++) {
    /* the first replay absorbs the PEs' start skew; the second is timed back to back */
    BCU(cudaGraphLaunch(ge, a->s));
    BCU(cudaEventRecord(a->e0, a->s));
    BCU(cudaGraphLaunch(ge, a->s));
    BCU(cudaEventRecord(a->e1, a->s));
    BCU(cudaEventSynchronize(a->e1));
    float ms = 0;
    BCU(cudaEventElapsedTime(&ms, a->e0, a->e1));
    t[r] = (double)ms * 1e3 / calls;
  }
  cudaGraphExecDestroy(ge);
  cudaGraphDestroy(g);
  SKV_CHECK(skv_comm_check(a->comm));
  *us = bench_median(t, (size_t)reps);
#endif
  return 0;
}

/* The slowest PE's median. */
static int time_algo(arb_t *a, int algo, uint64_t bytes, double *us) {
  double mine;
  SKV_CHECK(time_one(a, algo, bytes, &mine));
  double all[SKV_MAX_LOCAL_PES];
  SKV_CHECK(skv_ctx_allgather(a->ctx, &mine, all, sizeof mine));
  *us = all[0];
  for (int r = 1; r < a->npes; r++) *us = isnan(*us) || all[r] > *us ? all[r] : *us;
  return 0;
}

static const char *fmt_size(uint64_t bytes, char *buf, size_t cap) {
  if (bytes >= (1u << 20) && bytes % (1u << 20) == 0)
    snprintf(buf, cap, "%lluMiB", (unsigned long long)(bytes >> 20));
  else if (bytes >= 1024 && bytes % 1024 == 0)
    snprintf(buf, cap, "%lluKiB", (unsigned long long)(bytes >> 10));
  else
    snprintf(buf, cap, "%lluB", (unsigned long long)bytes);
  return buf;
}

/* Sizes: --sizes 1K,4K,... or powers of two from --min (1K) to --max (64M). */
static size_t parse_sizes(bench_t *b, uint64_t max_default, uint64_t *sizes, size_t cap) {
  const char *list = bench_opt(b, "--sizes");
  size_t n = 0;
  if (list) {
    char tmp[512];
    snprintf(tmp, sizeof tmp, "%s", list);
    for (char *tok = strtok(tmp, ","); tok && n < cap; tok = strtok(NULL, ",")) {
      long long v;
      if (skv__parse_int(tok, 16, 1ll << 36, true, &v)) sizes[n++] = (uint64_t)v;
    }
    return n;
  }
  uint64_t lo = (uint64_t)bench_opt_int(b, "--min", 1024),
           hi = (uint64_t)bench_opt_int(b, "--max", (long long)max_default);
  hi = SKV_MIN(hi, max_default); /* the host backend's 4M, a time-sliced GPU's 1M */
  for (uint64_t s = lo; s <= hi && n < cap; s *= 2) sizes[n++] = s;
  return n;
}

#ifdef SKV_WITH_CUDA
/* Barrier latency in a graph, against a 4-byte ncclAllReduce captured the same way. */
static int bench_barrier(arb_t *a, double *us, double *nccl_us) {
  const int calls = 100;
  double t[64];
  *nccl_us = NAN;
  if (a->comm->has_nccl) SKV_CHECK(time_algo(a, SKV_ALGO_NCCL, 4, nccl_us));
  cudaGraph_t g;
  cudaGraphExec_t ge;
  BCU(cudaStreamBeginCapture(a->s, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < calls; i++) SKV_CHECK(skv_comm_barrier(a->comm, 0, a->s));
  BCU(cudaStreamEndCapture(a->s, &g));
  BCU(cudaGraphInstantiate(&ge, g, 0));
  BCU(cudaGraphLaunch(ge, a->s));
  BCU(cudaStreamSynchronize(a->s));
  SKV_CHECK(skv_ctx_barrier(a->ctx));
  int reps = SKV_MIN(a->reps, 64);
  for (int r = 0; r < reps; r++) {
    BCU(cudaGraphLaunch(ge, a->s));
    BCU(cudaEventRecord(a->e0, a->s));
    BCU(cudaGraphLaunch(ge, a->s));
    BCU(cudaEventRecord(a->e1, a->s));
    BCU(cudaEventSynchronize(a->e1));
    float ms = 0;
    BCU(cudaEventElapsedTime(&ms, a->e0, a->e1));
    t[r] = (double)ms * 1e3 / calls;
  }
  cudaGraphExecDestroy(ge);
  cudaGraphDestroy(g);
  SKV_CHECK(skv_comm_check(a->comm));
  double mine = bench_median(t, (size_t)reps), all[SKV_MAX_LOCAL_PES];
  SKV_CHECK(skv_ctx_allgather(a->ctx, &mine, all, sizeof mine));
  *us = 0;
  for (int r = 0; r < a->npes; r++) *us = SKV_MAX(*us, all[r]);
  return 0;
}

/* Signal ping-pong between PEs 0 and 1: in one kernel through the device API, and through
 * stream-ordered skv_comm_signal / skv_comm_wait calls in a CUDA graph (one kernel node each).
 * Round trip in us as PE 0 measured it. */
static int bench_pingpong(arb_t *a, double *dev_us, double *host_us) {
  double d = 0, h = 0;
  static uint64_t base = 0;
  /* time-sliced PEs: a round trip costs a time slice or more, so far fewer rounds */
  const int iters = a->sliced ? 50 : 10000, host_iters = a->sliced ? 20 : 1000;
  if (a->rank < 2) {
    double rt[5];
    for (int r = 0; r < 5; r++) {
      SKV_CHECK(skv__comm_pingpong(a->comm, 1 - a->rank, 200, base, iters, &rt[r], a->s));
      base += (uint64_t)iters;
    }
    d = bench_median(rt, 5);
  }
  SKV_CHECK(skv_ctx_barrier(a->ctx));
  /* Graphs per repetition (the values they wait for are baked into them): a warm-up graph of
   * 100 rounds absorbs the PEs' start skew, then events around a second graph time host_iters
   * rounds (events recorded inside a capture cannot be timed). */
  static uint64_t hbase = 0;
  double rt[3];
  for (int r = 0; r < 3; r++) {
    cudaGraph_t g[2] = {NULL, NULL};
    cudaGraphExec_t ge[2] = {NULL, NULL};
    if (a->rank < 2) {
      for (int k = 0; k < 2; k++) {
        int lo = k == 0 ? 1 : 101, hi = k == 0 ? 100 : 100 + host_iters;
        BCU(cudaStreamBeginCapture(a->s, cudaStreamCaptureModeThreadLocal));
        for (int i = lo; i <= hi; i++) {
          uint64_t v = hbase + (uint64_t)i;
          if (a->rank == 0) {
            SKV_CHECK(skv_comm_signal(a->comm, 1, 201, v, SKV_SIGNAL_SET, a->s));
            SKV_CHECK(skv_comm_wait(a->comm, 201, SKV_CMP_GE, v, a->s));
          } else {
            SKV_CHECK(skv_comm_wait(a->comm, 201, SKV_CMP_GE, v, a->s));
            SKV_CHECK(skv_comm_signal(a->comm, 0, 201, v, SKV_SIGNAL_SET, a->s));
          }
        }
        BCU(cudaStreamEndCapture(a->s, &g[k]));
        BCU(cudaGraphInstantiate(&ge[k], g[k], 0));
      }
    }
    hbase += (uint64_t)host_iters + 100;
    SKV_CHECK(skv_ctx_barrier(a->ctx));
    if (a->rank < 2) {
      BCU(cudaGraphLaunch(ge[0], a->s));
      BCU(cudaEventRecord(a->e0, a->s));
      BCU(cudaGraphLaunch(ge[1], a->s));
      BCU(cudaEventRecord(a->e1, a->s));
      BCU(cudaStreamSynchronize(a->s));
      float ms = 0;
      BCU(cudaEventElapsedTime(&ms, a->e0, a->e1));
      rt[r] = (double)ms * 1e3 / host_iters;
      for (int k = 0; k < 2; k++) {
        cudaGraphExecDestroy(ge[k]);
        cudaGraphDestroy(g[k]);
      }
    }
  }
  if (a->rank < 2) {
    h = bench_median(rt, 3);
    SKV_CHECK(skv_comm_check(a->comm));
  }
  double mine[2] = {d, h}, all[2 * SKV_MAX_LOCAL_PES];
  SKV_CHECK(skv_ctx_allgather(a->ctx, mine, all, sizeof mine));
  *dev_us = all[0];
  *host_us = all[1];
  return 0;
}
#endif

static int run(arb_t *a) {
  bench_t *b = a->b;
  char name[128], sz[32];
  uint64_t sizes[64];
  size_t ns = parse_sizes(b, a->max_bytes, sizes, 64); /* host: already at most 4M */
  double res[64][NALGO];
  for (size_t i = 0; i < ns; i++) {
    for (int k = 0; k < NALGO; k++) SKV_CHECK(time_algo(a, algos[k], sizes[i], &res[i][k]));
    bench_progress(b, "allreduce", (double)i + 1, (double)ns);
  }
  bench_progress_end(b);
  /* Crossovers: one-shot while it is the fastest from the smallest size up; then two-shot (or
   * one-shot) while it beats NCCL. */
  uint64_t os_max = 0, ts_max = 0;
  bool os_open = true, ts_open = true;
  for (size_t i = 0; i < ns; i++) {
    double os = res[i][0], ts = res[i][1], nc = res[i][3];
    double best = SKV_MIN(os, ts);
    if (!isnan(nc)) best = SKV_MIN(best, nc);
    if (os_open && os <= best)
      os_max = sizes[i];
    else
      os_open = false;
    if (ts_open && (isnan(nc) || SKV_MIN(os, ts) <= nc))
      ts_max = sizes[i];
    else
      ts_open = false;
  }
  if (a->rank != 0) return 0;
  bench_config_int(b, "pes", a->npes);
  bench_config_str(b, "backend", a->cuda ? "cuda" : "host");
  bench_config_str(b, "dtype", skv__dtype_name(a->dtype));
  bench_config_str(b, "op", "sum");
  bench_config_int(b, "calls_per_graph", a->calls);
  bench_config_int(b, "reps", a->reps);
  bench_config_int(b, "gpu_time_sliced", a->sliced);
  bench_config_int(b, "nccl", a->comm->has_nccl);
  bench_config_int(b, "auto_oneshot_max", (long long)a->comm->oneshot_max);
  bench_config_int(b, "auto_twoshot_max",
                   (long long)(a->comm->twoshot_max > (1ull << 50) ? 0 : a->comm->twoshot_max));
  const char *bl = a->cuda ? "ncclAllReduce in a CUDA graph" : NULL;
  for (size_t i = 0; i < ns; i++) {
    fmt_size(sizes[i], sz, sizeof sz);
    for (int k = 0; k < NALGO; k++) {
      if (isnan(res[i][k])) continue;
      snprintf(name, sizeof name, "allreduce/%s/%s/%s/%dpe", skv__dtype_name(a->dtype),
               skv__algo_name(algos[k]), sz, a->npes);
      bool base = algos[k] != SKV_ALGO_NCCL && bl && !isnan(res[i][3]);
      bench_row(b, name, res[i][k], "us", "lower", base ? bl : NULL, base ? res[i][3] : -1);
    }
  }
  snprintf(name, sizeof name, "crossover/oneshot_max/%dpe", a->npes);
  bench_row(b, name, (double)os_max, "bytes", "higher", NULL, -1);
  snprintf(name, sizeof name, "crossover/twoshot_max/%dpe", a->npes);
  bench_row(b, name, (double)ts_max, "bytes", "higher", NULL, -1);
  char now[64];
  if (a->comm->twoshot_max >= (1ull << 50))
    snprintf(now, sizeof now, "%llu / no limit", (unsigned long long)a->comm->oneshot_max);
  else
    snprintf(now, sizeof now, "%llu / %llu", (unsigned long long)a->comm->oneshot_max,
             (unsigned long long)a->comm->twoshot_max);
  fprintf(stderr,
          "symkv-bench allreduce: measured crossovers for %d PEs: one-shot <= %llu B, two-shot <= "
          "%llu B%s (AUTO uses %s; put the measured ones into cuda_crossovers[] in "
          "src/comm/comm.c, or try them with SKV_ALLREDUCE_ONESHOT_MAX / "
          "SKV_ALLREDUCE_TWOSHOT_MAX)\n",
          a->npes, (unsigned long long)os_max, (unsigned long long)ts_max,
          a->comm->has_nccl ? "" : " (no NCCL in this run: the largest size measured)", now);
  return 0;
}

static int bench_allreduce(bench_t *b) {
  arb_t a;
  memset(&a, 0, sizeof a);
  a.b = b;
  const char *bk = bench_opt(b, "--backend");
  a.cuda = !(bk && strcmp(bk, "host") == 0);
#ifndef SKV_WITH_CUDA
  if (a.cuda)
    return SKV_FAIL(SKV_ENOTSUP, SKV_SUBSYS_BENCH,
                    "symkv-bench allreduce needs a build with CUDA (configure with -DSKV_CUDA=ON); "
                    "--backend host times the host backend's protocol instead");
#endif
  const char *dt = bench_opt(b, "--dtype");
  if (!dt || strcmp(dt, "bf16") == 0)
    a.dtype = SKV_DTYPE_BF16;
  else if (strcmp(dt, "fp16") == 0)
    a.dtype = SKV_DTYPE_FP16;
  else
    a.dtype = SKV_DTYPE_FP32;
  a.reps = (int)bench_opt_int(b, "--reps", 7);
  a.calls = (int)bench_opt_int(b, "--calls", 100);
  a.max_bytes = (uint64_t)bench_opt_int(b, "--max", 64 << 20);
  if (bench_flag(b, "--quick")) { /* explicit options still win: they are read first */
    if (!bench_opt(b, "--reps")) a.reps = 3;
    if (!bench_opt(b, "--calls")) a.calls = 20;
    if (!bench_opt(b, "--max")) a.max_bytes = 1u << 20;
  }
  if (!a.cuda) a.max_bytes = SKV_MIN(a.max_bytes, 4u << 20);
  SKV_CHECK(skv_init(NULL, &a.ctx));
  a.rank = skv_ctx_get_rank(a.ctx);
  a.npes = skv_ctx_get_world_size(a.ctx);
  skv_comm_opts_t o = SKV_COMM_OPTS_INIT;
  o.backend = a.cuda ? SKV_BACKEND_CUDA : SKV_BACKEND_HOST;
  o.channels = 1;
  o.max_bytes = SKV_MAX(a.max_bytes, 1u << 20);
  int rc = skv_comm_create(a.ctx, &o, &a.comm);
  if (rc) {
    skv_finalize(a.ctx);
    return rc;
  }
  /* PEs sharing a GPU without MPS take turns on it: every step of a collective waits a time
   * slice (milliseconds). The library warned; the bench caps its work so that it ends in about
   * a minute instead of looking hung, and says so. The figures then show correctness and
   * overhead only. */
  a.sliced = rc == 0 && a.comm->gpu_time_sliced;
  if (a.sliced) {
    a.reps = SKV_MIN(a.reps, 3);
    a.calls = SKV_MIN(a.calls, 10);
    a.max_bytes = SKV_MIN(a.max_bytes, 1u << 20);
    if (a.rank == 0)
      fprintf(stderr,
              "symkv-bench allreduce: PEs share a GPU without MPS (time-sliced): capped at "
              "--reps %d --calls %d --max %llu and 50 ping-pong rounds; the latencies are "
              "time slices, not the hardware's\n",
              a.reps, a.calls, (unsigned long long)a.max_bytes);
  }
  if (a.cuda) {
#ifdef SKV_WITH_CUDA
    /* in the comm's heap: the symmetric algorithms read nothing else, NCCL does not care */
    skv_heap_t *h = skv_comm_get_heap(a.comm);
    a.in = skv_heap_get_ptr(h, a.rank, h->info.data_offset);
    if (cudaMalloc(&a.out, o.max_bytes) != cudaSuccess ||
        cudaStreamCreateWithFlags(&a.s, cudaStreamNonBlocking) || cudaEventCreate(&a.e0) ||
        cudaEventCreate(&a.e1))
      rc = SKV_FAIL(SKV_ECUDA, SKV_SUBSYS_BENCH, "allocating the benchmark's buffers failed");
    /* values in [-2, 2] of the benchmark's dtype */
    uint16_t *host = malloc(o.max_bytes);
    uint64_t s = 0x5eed + (uint64_t)a.rank;
    const uint32_t es = skv__dtype_size(a.dtype);
    for (uint64_t i = 0; host && i < o.max_bytes / es; i++) {
      float v = (float)((int)(bench_rand(&s) % 2001) - 1000) / 500.0f;
      if (a.dtype == SKV_DTYPE_FP32)
        memcpy((char *)host + i * 4, &v, sizeof v);
      else
        host[i] = a.dtype == SKV_DTYPE_BF16 ? skv__float_to_bf16(v) : skv__float_to_fp16(v);
    }
    if (rc == 0 &&
        (!host || cudaMemcpy(a.in, host, o.max_bytes, cudaMemcpyHostToDevice) != cudaSuccess))
      rc = SKV_FAIL(SKV_ECUDA, SKV_SUBSYS_BENCH, "filling the input failed");
    free(host);
#endif
  } else {
    a.in = malloc(o.max_bytes);
    a.out = malloc(o.max_bytes);
    if (a.in) memset(a.in, 0x3c, o.max_bytes);
  }
  if (rc == 0) rc = run(&a);
#ifdef SKV_WITH_CUDA
  if (rc == 0 && a.cuda && !bench_flag(b, "--no-signals")) {
    double bar = 0, bar_nccl = NAN, pp_dev = 0, pp_host = 0;
    rc = bench_barrier(&a, &bar, &bar_nccl);
    if (rc == 0 && a.npes >= 2) rc = bench_pingpong(&a, &pp_dev, &pp_host);
    if (rc == 0 && a.rank == 0) {
      char name[96];
      snprintf(name, sizeof name, "barrier/graph/%dpe", a.npes);
      bench_row(b, name, bar, "us", "lower",
                isnan(bar_nccl) ? NULL : "ncclAllReduce of 4 B in a CUDA graph",
                isnan(bar_nccl) ? -1 : bar_nccl);
      if (a.npes >= 2) {
        bench_row(b, "signal/pingpong_rt/device_api", pp_dev, "us", "lower", "target (issue 5)",
                  3.0);
        bench_row(b, "signal/pingpong_rt/stream_ordered_graph", pp_host, "us", "lower",
                  "target (issue 5)", 3.0);
      }
    }
  }
  if (a.cuda) {
    if (a.out) cudaFree(a.out);
    if (a.s) cudaStreamDestroy(a.s);
  }
#endif
  if (!a.cuda) {
    free(a.in);
    free(a.out);
  }
  if (rc == 0 && a.rank == 0) bench_report(b);
  int rc2 = skv_comm_destroy(a.comm);
  int rc3 = skv_finalize(a.ctx);
  return rc ? rc : rc2 ? rc2 : rc3;
}

static const bench_optspec_t allreduce_opts[] = {
    {"--sizes", BENCH_LIST, "LIST", NULL, "message sizes (1K,4K,...), instead of --min/--max", 16,
     1ll << 36, NULL},
    {"--min", BENCH_INT, "N", "1K", "smallest size (powers of two up to --max)", 16, 1ll << 36,
     NULL},
    {"--max", BENCH_INT, "N", "64M", "largest size (host backend: at most 4M)", 16, 1ll << 36,
     NULL},
    {"--calls", BENCH_INT, "N", "100", "calls per timed graph", 1, 100000, NULL},
    {"--reps", BENCH_INT, "N", "7", "repetitions, the median is reported", 1, 64, NULL},
    {"--dtype", BENCH_CHOICE, "T", "bf16", "element type", 0, 0, "bf16,fp16,fp32"},
    {"--quick", BENCH_FLAG, NULL, NULL, "1K..1M, 20 calls per graph, 3 repetitions", 0, 0, NULL},
    {"--no-signals", BENCH_FLAG, NULL, NULL, "skip the barrier and signal ping-pong", 0, 0, NULL},
    {"--backend", BENCH_CHOICE, "B", "cuda", "host times the host backend's protocol", 0, 0,
     "cuda,host"},
    BENCH_OPTS_END,
};

const bench_cmd_t bench_cmd_allreduce = {
    .name = "allreduce",
    .run = bench_allreduce,
    .summary = "skv_comm_allreduce latency in CUDA graphs per algorithm and AUTO vs ncclAllReduce "
               "(same run),\n"
               "              measured crossovers, barrier latency, signal ping-pong round trips",
    .opts = allreduce_opts,
};
