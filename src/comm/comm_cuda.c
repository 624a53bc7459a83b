/* CUDA backend of the collectives: device state and the host-mapped error record, kernel
 * launches chunk by chunk, and the NCCL communicator (libnccl.so.2 opened at run time). */
#define _GNU_SOURCE
#include "comm/comm_state.h"
#include "cuda/device.h"

#include <dlfcn.h>
#include <inttypes.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef SKV_WITH_NCCL
#include <nccl.h>
#endif

#define EXTRA_BYTES 256u /* after the channel states: broken flag, test results, NCCL warm-up */

typedef struct comm_cuda {
  void *dmem;           /* device: [channels] state | broken | extra */
  skv__comm_err_t *err; /* host-mapped (UVA: the device uses the same address) */
  skv__comm_dev_t dev;  /* descriptor of every launch (timeout refreshed per call) */
#ifdef SKV_WITH_NCCL
  ncclComm_t nccl;
#endif
} comm_cuda_t;

static comm_cuda_t *cc_of(skv_comm_t *c) {
  return (comm_cuda_t *)c->cuda;
}

static char *extra_of(skv_comm_t *c) {
  return (char *)cc_of(c)->dmem + (size_t)c->channels * sizeof(skv__chan_state_t) + 64;
}

/* ---- capture detection -------------------------------------------------------------------- */

/* SKV_ECAPTURE when a blocking stream of this device is being captured (the legacy stream then
 * refuses work); calls that synchronise the device must not run then. */
static int not_capturing(const char *fn) {
  enum cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  cudaError_t e = cudaStreamIsCapturing(cudaStreamLegacy, &st);
  if (e == cudaErrorStreamCaptureImplicit ||
      (e == cudaSuccess && st != cudaStreamCaptureStatusNone)) {
    (void)cudaGetLastError();
    return SKV_FAIL(
        SKV_ECAPTURE, SKV_SUBSYS_COMM,
        "%s synchronises the device and cannot run while a CUDA graph is being captured; call it "
        "before or after the capture",
        fn);
  }
  if (e != cudaSuccess) (void)cudaGetLastError();
  return 0;
}

/* ---- NCCL, opened at run time ------------------------------------------------------------- */

#ifdef SKV_WITH_NCCL
typedef struct nccl_api {
  ncclResult_t (*GetVersion)(int *);
  ncclResult_t (*GetUniqueId)(ncclUniqueId *);
  ncclResult_t (*CommInitRankConfig)(ncclComm_t *, int, ncclUniqueId, int, ncclConfig_t *);
  ncclResult_t (*CommGetAsyncError)(ncclComm_t, ncclResult_t *);
  ncclResult_t (*CommFinalize)(ncclComm_t);
  ncclResult_t (*CommDestroy)(ncclComm_t);
  ncclResult_t (*CommAbort)(ncclComm_t);
  ncclResult_t (*AllReduce)(const void *, void *, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t,
                            cudaStream_t);
  const char *(*GetErrorString)(ncclResult_t);
  const char *(*GetLastError)(ncclComm_t);
} nccl_api_t;

static nccl_api_t nccl;
static pthread_once_t nccl_once = PTHREAD_ONCE_INIT;
static char nccl_why[256]; /* empty when loaded */
static int nccl_version;

static void nccl_load(void) {
  void *lib = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    snprintf(nccl_why, sizeof nccl_why, "libnccl.so.2 not found (%s)", dlerror());
    return;
  }
#define NCCL_SYM(field, name)                                                                    \
  if (!(*(void **)&nccl.field = dlsym(lib, name))) {                                             \
    snprintf(nccl_why, sizeof nccl_why, "libnccl.so.2 has no %s (NCCL older than 2.14?)", name); \
    return;                                                                                      \
  }
  NCCL_SYM(GetVersion, "ncclGetVersion")
  NCCL_SYM(GetUniqueId, "ncclGetUniqueId")
  NCCL_SYM(CommInitRankConfig, "ncclCommInitRankConfig")
  NCCL_SYM(CommGetAsyncError, "ncclCommGetAsyncError")
  NCCL_SYM(CommFinalize, "ncclCommFinalize")
  NCCL_SYM(CommDestroy, "ncclCommDestroy")
  NCCL_SYM(CommAbort, "ncclCommAbort")
  NCCL_SYM(AllReduce, "ncclAllReduce")
  NCCL_SYM(GetErrorString, "ncclGetErrorString")
  NCCL_SYM(GetLastError, "ncclGetLastError")
#undef NCCL_SYM
  if (nccl.GetVersion(&nccl_version) != ncclSuccess || nccl_version < 21400)
    snprintf(nccl_why, sizeof nccl_why, "NCCL %d is older than 2.14", nccl_version);
}

/* Wait (bounded) until a non-blocking communicator finished its background work. */
static ncclResult_t nccl_settle(ncclComm_t comm, int timeout_ms) {
  uint64_t deadline = skv__now_ns() + (uint64_t)timeout_ms * 1000000ull;
  ncclResult_t st = ncclInProgress;
  while (nccl.CommGetAsyncError(comm, &st) == ncclSuccess && st == ncclInProgress) {
    if (skv__now_ns() > deadline) return ncclInProgress;
    sched_yield();
  }
  return st;
}

static int nccl_fail(ncclComm_t comm, ncclResult_t r, const char *call) {
  return SKV_FAIL(SKV_ENCCL, SKV_SUBSYS_COMM, "%s failed: %s (%s)", call,
                  r == ncclInProgress ? "did not complete within the timeout"
                                      : nccl.GetErrorString(r),
                  comm ? nccl.GetLastError(comm) : "");
}

typedef struct nccl_ready {
  int32_t ok;
  int32_t pci[3]; /* domain, bus, device: two PEs on one GPU cannot share an NCCL communicator */
} nccl_ready_t;

/* Collective: every PE agrees whether NCCL can be used; rank 0's unique id travels through
 * the bootstrap store; the communicator is initialised without blocking and bounded. The store
 * steps are steps of the comm heap's operation: their keys go with the heap. */
static int nccl_create(skv_comm_t *c) {
  skv_ctx_t *ctx = c->ctx;
  comm_cuda_t *cc = cc_of(c);
  int n = c->npes, to = ctx->cfg.timeout_ms;
  pthread_once(&nccl_once, nccl_load);
  nccl_ready_t mine = {nccl_why[0] == '\0', {0, 0, 0}};
  cudaDeviceGetAttribute(&mine.pci[0], cudaDevAttrPciDomainId, ctx->device);
  cudaDeviceGetAttribute(&mine.pci[1], cudaDevAttrPciBusId, ctx->device);
  cudaDeviceGetAttribute(&mine.pci[2], cudaDevAttrPciDeviceId, ctx->device);
  nccl_ready_t all[SKV_MAX_LOCAL_PES];
  SKV_CHECK(skv__coll_allgather(&c->heap->op, "nccl-ready", &mine, all, sizeof mine));
  for (int r = 0; r < n; r++) {
    if (!all[r].ok) {
      SKV_INFO(SKV_SUBSYS_COMM, "no NCCL all-reduce: PE %d cannot load NCCL%s%s", r,
               r == c->me ? ": " : "", r == c->me ? nccl_why : "");
      return 0;
    }
    for (int q = 0; q < r; q++)
      if (memcmp(all[q].pci, all[r].pci, sizeof all[r].pci) == 0) {
        SKV_INFO(SKV_SUBSYS_COMM,
                 "no NCCL all-reduce: PEs %d and %d share a GPU (NCCL needs one GPU per rank)", q,
                 r);
        return 0;
      }
  }
  /* Never NVLink multicast (NVLS): on the shared GPU hosts it can take every GPU down. */
  const char *was = getenv("NCCL_NVLS_ENABLE");
  if (was && strcmp(was, "0") != 0)
    SKV_WARN(SKV_SUBSYS_COMM,
             "NCCL_NVLS_ENABLE=%s overridden with 0: symkv never lets NCCL use NVLink multicast",
             was);
  setenv("NCCL_NVLS_ENABLE", "0", 1);
  SKV_INFO(SKV_SUBSYS_COMM, "set NCCL_NVLS_ENABLE=0 (NVLink multicast stays off)");
  /* Connect every algorithm at init, so that no connection is set up inside a graph capture. */
  setenv("NCCL_RUNTIME_CONNECT", "0", 0);
  ncclUniqueId id;
  if (c->me == 0 && nccl.GetUniqueId(&id) != ncclSuccess)
    memset(&id, 0, sizeof id); /* the init below fails everywhere */
  SKV_CHECK(skv__coll_bcast(&c->heap->op, "nccl-id", &id, sizeof id, ctx->local_ranks[0],
                            "the NCCL unique id"));
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.blocking = 0;
  ncclComm_t comm = NULL;
  ncclResult_t r = nccl.CommInitRankConfig(&comm, n, id, c->me, &cfg);
  if (r == ncclInProgress || (r == ncclSuccess && comm)) r = nccl_settle(comm, to);
  int32_t ok = r == ncclSuccess, oks[SKV_MAX_LOCAL_PES];
  if (!ok) {
    nccl_fail(comm, r, "ncclCommInitRankConfig");
    if (comm) nccl.CommAbort(comm);
    comm = NULL;
  }
  int rc = skv__coll_allgather(&c->heap->op, "nccl-init", &ok, oks, sizeof ok);
  bool all_ok = rc == 0;
  for (int q = 0; all_ok && q < n; q++) all_ok = oks[q] != 0;
  if (!all_ok) {
    if (comm) nccl.CommAbort(comm);
    SKV_WARN(
        SKV_SUBSYS_COMM,
        "no NCCL all-reduce: the NCCL communicator could not be created on every PE "
        "(SKV_DEBUG=INFO and NCCL_DEBUG=WARN say why); AUTO uses the symmetric algorithms only");
    skv_clear_error();
    return rc;
  }
  cc->nccl = comm;
  c->has_nccl = true;
  SKV_INFO(SKV_SUBSYS_COMM, "NCCL %d communicator ready (%d ranks)", nccl_version, n);
  return 0;
}

static void nccl_destroy(skv_comm_t *c) {
  comm_cuda_t *cc = cc_of(c);
  if (!cc->nccl) return;
  ncclResult_t r = nccl.CommFinalize(cc->nccl);
  if (r == ncclInProgress || r == ncclSuccess) r = nccl_settle(cc->nccl, c->ctx->cfg.timeout_ms);
  if (r != ncclSuccess) {
    SKV_WARN(SKV_SUBSYS_COMM, "ncclCommFinalize: %s; aborting the communicator",
             r == ncclInProgress ? "timed out" : nccl.GetErrorString(r));
    nccl.CommAbort(cc->nccl);
  } else {
    nccl.CommDestroy(cc->nccl);
  }
  cc->nccl = NULL;
  c->has_nccl = false;
}

static int nccl_allreduce(skv_comm_t *c, const void *in, void *out, size_t count, int dtype, int op,
                          void *stream) {
  comm_cuda_t *cc = cc_of(c);
  ncclDataType_t t = dtype == SKV_DTYPE_BF16   ? ncclBfloat16
                     : dtype == SKV_DTYPE_FP16 ? ncclFloat16
                                               : ncclFloat32;
  ncclRedOp_t o = op == SKV_OP_SUM ? ncclSum : op == SKV_OP_MAX ? ncclMax : ncclMin;
  ncclResult_t r = nccl.AllReduce(in, out, count, t, o, cc->nccl, (cudaStream_t)stream);
  if (r == ncclInProgress) r = nccl_settle(cc->nccl, c->ctx->cfg.timeout_ms);
  if (r != ncclSuccess) return nccl_fail(cc->nccl, r, "ncclAllReduce");
  return 0;
}
#endif /* SKV_WITH_NCCL */

/* ---- create / destroy --------------------------------------------------------------------- */

int skv__comm_cuda_precheck(skv_ctx_t *ctx) {
  SKV_CHECK(skv__cuda_use(ctx));
  return not_capturing("skv_comm_create");
}

int skv__comm_cuda_create(skv_comm_t *c) {
  skv_ctx_t *ctx = c->ctx;
  SKV_CHECK(skv__cuda_use(ctx));
  comm_cuda_t *cc = calloc(1, sizeof *cc);
  if (!cc) return SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_COMM, "out of memory");
  c->cuda = cc;
  size_t dbytes = (size_t)c->channels * sizeof(skv__chan_state_t) + 64 + EXTRA_BYTES;
  SKV_CUDA_CHECK(cudaMalloc(&cc->dmem, dbytes), SKV_SUBSYS_COMM);
  SKV_CUDA_CHECK(cudaMemset(cc->dmem, 0, dbytes), SKV_SUBSYS_COMM);
  SKV_CUDA_CHECK(cudaHostAlloc((void **)&cc->err, sizeof *cc->err,
                               cudaHostAllocMapped | cudaHostAllocPortable),
                 SKV_SUBSYS_COMM);
  memset((void *)cc->err, 0, sizeof *cc->err);
  void *err_dev = NULL;
  SKV_CUDA_CHECK(cudaHostGetDevicePointer(&err_dev, cc->err, 0), SKV_SUBSYS_COMM);
  /* Every Lamport slot starts out as the sentinel (0xff bytes); the signal pad is zero. */
  SKV_CUDA_CHECK(
      cudaMemset(skv__comm_addr(c, c->me, c->scratch_off), 0xff, c->channels * c->chan_bytes),
      SKV_SUBSYS_COMM);
  int nsm = 0;
  SKV_CUDA_CHECK(cudaDeviceGetAttribute(&nsm, cudaDevAttrMultiProcessorCount, ctx->device),
                 SKV_SUBSYS_COMM);
  int e = skv__k_preload();
  if (e != 0) {
    (void)cudaGetLastError();
    return SKV_FAIL(
        SKV_ECUDA, SKV_SUBSYS_COMM,
        "loading the comm kernels failed: %s (is this GPU sm_90? the library is built for "
        "SKV_CUDA_ARCHITECTURES)",
        cudaGetErrorString((cudaError_t)e));
  }
  SKV_CUDA_CHECK(cudaDeviceSynchronize(), SKV_SUBSYS_COMM);
  skv__comm_dev_t *d = &cc->dev;
  memset(d, 0, sizeof *d);
  d->base = (char *)c->heap->info.base;
  d->stride = c->heap->info.stride;
  d->signal_off = c->heap->info.signal_offset;
  d->flag_off = c->flag_off;
  d->flag_chan_bytes = c->flag_chan_bytes;
  d->scratch_off = c->scratch_off;
  d->chan_bytes = c->chan_bytes;
  d->region_bytes = c->region_bytes;
  d->check_off = c->check_off;
  d->chan = (skv__chan_state_t *)cc->dmem;
  d->broken = (uint32_t *)((char *)cc->dmem + (size_t)c->channels * sizeof(skv__chan_state_t));
  d->err = (skv__comm_err_t *)err_dev;
  d->me = c->me;
  d->npes = c->npes;
  d->nsm = nsm;
  d->user_slots = c->user_slots;
  /* Blocks of a launch by its size (comm_proto.h); SKV_COMM_BLOCKS_PER_SM sets one value for
   * every size, for tuning (the slots a block fills and reads are named by element, not by
   * block, so PEs may differ). PEs sharing a GPU are capped below. */
  long long bps = 0;
  SKV_CHECK(skv__env_int(SKV_ENV_COMM_BLOCKS_PER_SM, 1, SKV__COMM_MIN_BLOCKS_PER_SM, 0, &bps));
  d->grid_cap = nsm * (bps ? (int)bps : SKV__COMM_BLOCKS_PER_SM);
  d->grid_cap_large = nsm * (bps ? (int)bps : SKV__COMM_BLOCKS_PER_SM_LARGE);
  /* evict-first in large launches: on 2 H100, 64 MiB 212.4-212.9 us against 215.7-216.5 us
   * (bench/results/comm_tuning_nvidia-h100-x2.txt) */
  long long hints = 1;
  SKV_CHECK(skv__env_int(SKV_ENV_COMM_STREAMING, 0, 1, 1, &hints));
  d->stream_hints = (int32_t)hints;
  d->channels = (int32_t)c->channels;
  /* Programmatic dependent launch hides most of a kernel's launch latency behind the kernel
   * before it; SKV_COMM_PDL=0 turns it off (to compare, or if a driver mishandles it). */
  d->pdl = skv__env_switch(SKV_ENV_COMM_PDL, true, SKV_SUBSYS_COMM);
  /* PEs sharing a GPU (docs/comm.md, "Several PEs on one GPU"). A block of a collective spins
   * until the same block of every peer has written, so the blocks of all PEs on the GPU must be
   * able to sit on it at once: under MPS nothing preempts a spinning block, and a PE whose
   * kernels filled the SMs would starve its peers' kernels for good (seen on one H100: a 64 MiB
   * all-reduce of 2 PEs, and graphs of 20 all-reduces with programmatic dependent launch, which
   * lets a PE's next kernels take the SMs while its current one waits, hung until the timeout).
   * So the grids of every PE and channel together fit the resident blocks, and programmatic
   * dependent launch is off. Without MPS the PEs take turns (time slices): a collective waits a
   * slice per step. Correct, far slower; said once, and the bench adapts. */
  if (c->heap->gpu_sharers > 1) {
    int share = c->heap->gpu_sharers * (int)c->channels;
    d->grid_cap = SKV_MAX(1, nsm * SKV__COMM_MIN_BLOCKS_PER_SM / share);
    d->grid_cap = SKV_MIN(d->grid_cap, nsm * SKV__COMM_BLOCKS_PER_SM);
    d->grid_cap_large = d->grid_cap;
    d->pdl = 0;
    SKV_INFO(SKV_SUBSYS_COMM,
             "%d PEs share GPU %d: at most %d blocks per all-reduce kernel (%d channels each), "
             "programmatic dependent launch off",
             c->heap->gpu_sharers, ctx->device, d->grid_cap, (int)c->channels);
    int mps = 0;
    if (skv__cu.cuDeviceGetAttribute(&mps, CU_DEVICE_ATTRIBUTE_MPS_ENABLED, ctx->device) !=
        CUDA_SUCCESS)
      mps = 0;
    c->gpu_time_sliced = !mps;
    if (!mps && c->me == 0)
      SKV_WARN(SKV_SUBSYS_COMM,
               "PEs %d and %d share GPU %d without MPS: their kernels take turns on it, so a "
               "collective waits a time slice (about 2 ms) per step instead of microseconds. "
               "Correct but slow; start the MPS daemon (nvidia-cuda-mps-control -d) before the "
               "PEs for concurrent kernels, or give each PE its own GPU",
               c->heap->gpu_shared_with, c->me, ctx->device);
  }
  SKV_INFO(SKV_SUBSYS_COMM, "comm kernels on %d SMs, programmatic dependent launch %s", nsm,
           d->pdl ? "on" : "off");
#ifdef SKV_WITH_NCCL
  if (!(c->flags & SKV_COMM_NO_NCCL)) {
    SKV_CHECK(nccl_create(c));
    if (c->has_nccl) { /* warm-up outside any capture */
      cudaStream_t s;
      SKV_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), SKV_SUBSYS_COMM);
      float *w = (float *)extra_of(c) + 16;
      int rc = nccl_allreduce(c, w, w, 4, SKV_DTYPE_FP32, SKV_OP_SUM, s);
      cudaError_t ce = cudaStreamSynchronize(s);
      cudaStreamDestroy(s);
      if (rc < 0) return rc;
      SKV_CUDA_CHECK(ce, SKV_SUBSYS_COMM);
    }
  }
#endif
  return 0;
}

int skv__comm_cuda_destroy(skv_comm_t *c) {
  comm_cuda_t *cc = cc_of(c);
  if (!cc) return 0;
  int rc = skv__cuda_use(c->ctx);
  if (rc == 0) SKV_CHECK(not_capturing("skv_comm_destroy"));
  cudaError_t e = rc == 0 ? cudaDeviceSynchronize() : cudaSuccess;
  if (e == cudaErrorStreamCaptureUnsupported || e == cudaErrorStreamCaptureImplicit ||
      e == cudaErrorStreamCaptureInvalidated) { /* a capture the legacy stream did not reveal */
    (void)cudaGetLastError();
    return SKV_FAIL(SKV_ECAPTURE, SKV_SUBSYS_COMM,
                    "skv_comm_destroy synchronises the device and cannot run while a CUDA graph is "
                    "being captured (%s); call it after the capture",
                    cudaGetErrorName(e));
  }
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    rc = SKV_FAIL(SKV_ECUDA, SKV_SUBSYS_COMM,
                  "a kernel of this PE failed before skv_comm_destroy: %s", cudaGetErrorString(e));
  }
#ifdef SKV_WITH_NCCL
  nccl_destroy(c);
#endif
  if (cc->dmem) cudaFree(cc->dmem);
  if (cc->err) cudaFreeHost((void *)cc->err);
  free(cc);
  c->cuda = NULL;
  return rc;
}

/* ---- calls -------------------------------------------------------------------------------- */

static const skv__comm_dev_t *dev_of(skv_comm_t *c) {
  comm_cuda_t *cc = cc_of(c);
  cc->dev.timeout_ns = (uint64_t)c->ctx->cfg.timeout_ms * 1000000ull;
  return &cc->dev;
}

static int launch_fail(int e, const char *what) {
  (void)cudaGetLastError();
  return SKV_FAIL(SKV_ECUDA, SKV_SUBSYS_COMM, "launching %s failed: %s (%s)", what,
                  cudaGetErrorString((cudaError_t)e), cudaGetErrorName((cudaError_t)e));
}

int skv__comm_cuda_allreduce(skv_comm_t *c, const void *in, void *out, size_t count, int dtype,
                             int op, int algo, int channel, void *stream) {
  SKV_CHECK(skv__cuda_use(c->ctx));
#ifdef SKV_WITH_NCCL
  if (algo == SKV_ALGO_NCCL) return nccl_allreduce(c, in, out, count, dtype, op, stream);
#endif
  const skv__comm_dev_t *d = dev_of(c);
  uint32_t es = skv__dtype_size(dtype);
  int alg = algo == SKV_ALGO_ONESHOT ? SKV__ALG_ONESHOT : SKV__ALG_TWOSHOT;
  uint64_t per = skv__comm_chunk_count(c, algo, es);
  /* One launch (one epoch) per chunk: stream-ordered, nothing allocated, capturable. */
  for (uint64_t off = 0; off < count; off += per) {
    uint64_t m = SKV_MIN(per, (uint64_t)count - off);
    int e = skv__k_allreduce(d, alg, dtype, op, channel, (const char *)in + off * es,
                             (char *)out + off * es, m, stream);
    if (e != 0)
      return launch_fail(e, alg == SKV__ALG_ONESHOT ? "skv_k_allreduce_oneshot"
                                                    : "skv_k_allreduce_twoshot");
  }
  return 0;
}

int skv__comm_cuda_signal(skv_comm_t *c, int pe, uint32_t slot, uint64_t value, int op,
                          void *stream) {
  SKV_CHECK(skv__cuda_use(c->ctx));
  int e = skv__k_signal(dev_of(c), pe, slot, value, op, stream);
  return e ? launch_fail(e, "skv_k_signal") : 0;
}

int skv__comm_cuda_wait(skv_comm_t *c, uint32_t slot, int cmp, uint64_t value, void *stream) {
  SKV_CHECK(skv__cuda_use(c->ctx));
  int e = skv__k_wait(dev_of(c), slot, cmp, value, stream);
  return e ? launch_fail(e, "skv_k_wait") : 0;
}

int skv__comm_cuda_barrier(skv_comm_t *c, int channel, void *stream) {
  SKV_CHECK(skv__cuda_use(c->ctx));
  int e = skv__k_barrier(dev_of(c), channel, stream);
  return e ? launch_fail(e, "skv_k_barrier") : 0;
}

int skv__comm_cuda_verify(skv_comm_t *c, int channel, uint64_t desc, uint64_t count, void *stream) {
  SKV_CHECK(skv__cuda_use(c->ctx));
  int e = skv__k_check(dev_of(c), channel, desc, count, stream);
  return e ? launch_fail(e, "skv_k_check") : 0;
}

int skv__comm_cuda_check(skv_comm_t *c) {
  volatile skv__comm_err_t *e = cc_of(c)->err;
  int code = e->code;
  if (code == 0) return 0;
  __atomic_thread_fence(__ATOMIC_ACQUIRE);
  char what[768];
  int to = c->ctx->cfg.timeout_ms;
  double waited = (double)e->waited_ns / 1e6;
  char mine[192], theirs[192];
  switch (e->kind) {
  case SKV__ERR_CHECK: /* observed, slot: this PE's call and count; value, waited_ns: the peer's
                          (a mismatch) or how long it waited (a timeout); epoch: the call number */
    skv__check_name(e->observed, e->slot, mine, sizeof mine);
    skv__check_name(e->value, e->waited_ns, theirs, sizeof theirs);
    if (code == SKV_EMISMATCH)
      snprintf(what, sizeof what,
               "checking mode, channel %d, checked call %" PRIu64 ": PE %d %s %s, this PE %s; "
               "every PE must make the same calls in the same order on a channel, and this "
               "call's kernel did nothing",
               e->channel, e->epoch, e->peer,
               e->phase == 1   ? "has made more checked calls on this channel; its latest is"
               : e->phase == 2 ? "waits in another call,"
                               : "made",
               theirs, mine);
    else
      snprintf(what, sizeof what,
               "%s (checking mode, channel %d, checked call %" PRIu64
               "): PE %d did not post its call (waited %.0f ms, timeout %d ms)",
               mine, e->channel, e->epoch, e->peer, waited, to);
    break;
  case SKV__ERR_ALLREDUCE:
    snprintf(what, sizeof what,
             "skv_comm_allreduce (%s, channel %d, epoch %" PRIu64
             "): PE %d did not deliver vector %" PRIu64 " (waited %.0f ms, timeout %d ms)",
             skv__phase_name(e->phase), e->channel, e->epoch, e->peer, e->slot, waited, to);
    break;
  case SKV__ERR_BARRIER:
    snprintf(what, sizeof what,
             "skv_comm_barrier (channel %d, epoch %" PRIu64
             "): PE %d did not arrive (its flag reads %" PRIu64 "; waited %.0f ms, timeout %d ms)",
             e->channel, e->epoch, e->peer, e->observed, waited, to);
    break;
  default:
    snprintf(what, sizeof what,
             "skv_comm_wait: slot %" PRIu64 " still read %" PRIu64 ", waiting for %s %" PRIu64
             " (waited %.0f ms, "
             "timeout %d ms); did the peer that should signal it run?",
             e->slot, e->observed, skv__cmp_name(e->cmp), e->value, waited, to);
    break;
  }
  e->code = 0;
  __atomic_store_n(&c->broken, true, __ATOMIC_RELAXED);
  return SKV_FAIL(code, SKV_SUBSYS_COMM,
                  "%s. %s, so its flags are no longer consistent: destroy the comm on every PE "
                  "and create a new one",
                  what,
                  code == SKV_EMISMATCH ? "A checked call of this comm did not match"
                                        : "A stream-ordered wait of this comm gave up");
}

int skv__comm_cuda_dev(skv_comm_t *c, skv__comm_dev_t *d) {
  SKV_ARG_CHECK(c && c->backend == SKV_BACKEND_CUDA && c->cuda, SKV_SUBSYS_COMM, "not a CUDA comm");
  *d = *dev_of(c);
  return 0;
}

int skv__comm_devapi_selftest(skv_comm_t *c, uint32_t slot_base, int iters, int blocks,
                              uint64_t data_off, uint64_t bytes_per_block, int errors_out[2],
                              void *stream) {
  SKV_ARG_CHECK(c && c->backend == SKV_BACKEND_CUDA, SKV_SUBSYS_COMM,
                "skv__comm_devapi_selftest: not a CUDA comm");
  SKV_ARG_CHECK(slot_base + 2u * (uint32_t)c->npes + 4u <= c->user_slots && blocks >= 1 &&
                    data_off + 2u * (uint64_t)blocks * bytes_per_block <= c->heap->info.data_bytes,
                SKV_SUBSYS_COMM, "skv__comm_devapi_selftest: slots or buffer out of range");
  SKV_CHECK(skv__cuda_use(c->ctx));
  int *errs = (int *)extra_of(c);
  SKV_CUDA_CHECK(cudaMemsetAsync(errs, 0, 2 * sizeof(int), (cudaStream_t)stream), SKV_SUBSYS_COMM);
  int e = skv__k_devapi_selftest(dev_of(c), slot_base, iters, blocks,
                                 skv__comm_addr(c, c->me, c->heap->info.data_offset + data_off),
                                 bytes_per_block, errs, stream);
  if (e) return launch_fail(e, "skv_k_devapi_selftest");
  SKV_CUDA_CHECK(cudaMemcpyAsync(errors_out, errs, 2 * sizeof(int), cudaMemcpyDeviceToHost,
                                 (cudaStream_t)stream),
                 SKV_SUBSYS_COMM);
  SKV_CUDA_CHECK(cudaStreamSynchronize((cudaStream_t)stream), SKV_SUBSYS_COMM);
  return 0;
}

int skv__comm_pingpong(skv_comm_t *c, int partner, uint32_t slot, uint64_t base, int iters,
                       double *rt_us, void *stream) {
  SKV_ARG_CHECK(c && c->backend == SKV_BACKEND_CUDA && partner >= 0 && partner < c->npes &&
                    partner != c->me && slot < c->user_slots && iters >= 2,
                SKV_SUBSYS_COMM, "skv__comm_pingpong: bad arguments");
  SKV_CHECK(skv__cuda_use(c->ctx));
  unsigned long long *ns = (unsigned long long *)(extra_of(c) + 128), host[2];
  int e = skv__k_pingpong(dev_of(c), partner, slot, base, iters, ns, stream);
  if (e) return launch_fail(e, "skv_k_pingpong");
  SKV_CUDA_CHECK(
      cudaMemcpyAsync(host, ns, sizeof host, cudaMemcpyDeviceToHost, (cudaStream_t)stream),
      SKV_SUBSYS_COMM);
  SKV_CUDA_CHECK(cudaStreamSynchronize((cudaStream_t)stream), SKV_SUBSYS_COMM);
  if (host[1])
    return SKV_FAIL(SKV_ETIMEDOUT, SKV_SUBSYS_COMM, "ping-pong with PE %d timed out after %d ms",
                    partner, c->ctx->cfg.timeout_ms);
  *rt_us = (double)host[0] / 1e3 / (double)(iters - 1);
  return 0;
}
