/* CUDA helpers: driver entry points through the runtime (no libcuda link), device choice per
 * context, error text, graph-capture detection. */
#define _GNU_SOURCE
#include "cuda/device.h"

#include <pthread.h>
#include <stdio.h>
#include <string.h>

skv__cu_api_t skv__cu;
static pthread_once_t cu_once = PTHREAD_ONCE_INIT;
static int cu_status;
static char cu_msg[512];

static void resolve(void) {
  int ndev = 0;
  cudaError_t e = cudaGetDeviceCount(&ndev);
  if (e != cudaSuccess || ndev == 0) {
    (void)cudaGetLastError();
    snprintf(cu_msg, sizeof cu_msg, "no usable CUDA device (%s): %s",
             e != cudaSuccess ? cudaGetErrorName(e) : "0 devices",
             e != cudaSuccess ? cudaGetErrorString(e) : "the driver sees no GPU");
    cu_status = SKV_ENOTSUP;
    return;
  }
  enum cudaDriverEntryPointQueryResult q;
#define SKV_CU_FN(name, ret, args)                                                              \
  if (cudaGetDriverEntryPointByVersion(#name, (void **)&skv__cu.name, 12000, cudaEnableDefault, \
                                       &q) != cudaSuccess ||                                    \
      q != cudaDriverEntryPointSuccess || !skv__cu.name) {                                      \
    (void)cudaGetLastError();                                                                   \
    snprintf(cu_msg, sizeof cu_msg, "the CUDA driver has no %s (driver too old?)", #name);      \
    cu_status = SKV_ENOTSUP;                                                                    \
    return;                                                                                     \
  }
#include "cuda/driver_fns.h"
#undef SKV_CU_FN
  cu_status = 0;
}

int skv__cuda_driver(void) {
  pthread_once(&cu_once, resolve);
  if (cu_status) return SKV_FAIL(cu_status, SKV_SUBSYS_HEAP, "%s", cu_msg);
  return 0;
}

int skv__cu_fail(CUresult r, unsigned subsys, const char *call, const char *file, int line) {
  const char *name = "?", *str = "?";
  if (skv__cu.cuGetErrorName) skv__cu.cuGetErrorName(r, &name);
  if (skv__cu.cuGetErrorString) skv__cu.cuGetErrorString(r, &str);
  return skv__set_error(SKV_ECUDA, subsys, file, line, "%s failed: %s (%s)", call, str, name);
}

int skv__cuda_use(skv_ctx_t *ctx) {
  SKV_CHECK(skv__cuda_driver());
  if (ctx->device < 0) {
    int ndev = 0;
    SKV_CUDA_CHECK(cudaGetDeviceCount(&ndev), SKV_SUBSYS_HEAP);
    int dev = ctx->cfg.device >= 0 ? ctx->cfg.device : ctx->local_index % ndev;
    if (dev >= ndev)
      return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_HEAP,
                      "device %d (config.device or SKV_DEVICE) does not exist: this "
                      "node has %d GPU(s)",
                      dev, ndev);
    SKV_CUDA_CHECK(cudaSetDevice(dev), SKV_SUBSYS_HEAP);
    SKV_CUDA_CHECK(cudaFree(NULL), SKV_SUBSYS_HEAP); /* create the primary context now */
    ctx->device = dev;
    SKV_INFO(SKV_SUBSYS_HEAP, "using CUDA device %d of %d", dev, ndev);
    return 0;
  }
  SKV_CUDA_CHECK(cudaSetDevice(ctx->device), SKV_SUBSYS_HEAP);
  return 0;
}

int skv__cuda_capturing(void *stream, bool *capturing) {
  enum cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  SKV_CUDA_CHECK(cudaStreamIsCapturing((cudaStream_t)stream, &st), SKV_SUBSYS_KV);
  *capturing = st != cudaStreamCaptureStatusNone;
  return 0;
}

int skv_ctx_get_device(skv_ctx_t *ctx) {
  if (!ctx) return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_HEAP, "skv_ctx_get_device: ctx is NULL");
  SKV_CHECK(skv__cuda_use(ctx));
  return ctx->device;
}
