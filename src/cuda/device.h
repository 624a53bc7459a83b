/* Internal CUDA helpers shared by the CUDA backends (heap, KV data path, comm): error checks,
 * the device of a context, and driver API entry points (resolved through the runtime, so that
 * no binary links libcuda and every binary loads on machines without a GPU driver). */
#ifndef SKV_DEVICE_CUDA_H
#define SKV_DEVICE_CUDA_H

#include "bootstrap/ctx.h"
#include "core/core.h"

#include <cuda.h>
#include <cuda_runtime_api.h>

/* Driver API functions symkv uses; NULL until skv__cuda_driver() succeeded. */
typedef struct skv__cu_api {
#define SKV_CU_FN(name, ret, args) ret(CUDAAPI *name) args;
#include "cuda/driver_fns.h"
#undef SKV_CU_FN
} skv__cu_api_t;

extern skv__cu_api_t skv__cu;

/* Resolve the driver API entry points once. SKV_ENOTSUP with a clear message when the driver
 * or a GPU is missing. */
int skv__cuda_driver(void);
/* Choose (once per context) and make current (on this thread) the PE's device. */
int skv__cuda_use(skv_ctx_t *ctx);

/* Runtime call: on failure clear the sticky error, log, and return SKV_ECUDA naming the call. */
#define SKV_CUDA_CHECK(call, subsys)                                         \
  do {                                                                       \
    cudaError_t skv_e_ = (call);                                             \
    if (SKV_UNLIKELY(skv_e_ != cudaSuccess)) {                               \
      (void)cudaGetLastError();                                              \
      return SKV_FAIL(SKV_ECUDA, (subsys), "%s failed: %s (%s)", #call,      \
                      cudaGetErrorString(skv_e_), cudaGetErrorName(skv_e_)); \
    }                                                                        \
  } while (0)
#define SKV_CUDA_CHECK_GOTO(call, subsys, rc, label)                         \
  do {                                                                       \
    cudaError_t skv_e_ = (call);                                             \
    if (SKV_UNLIKELY(skv_e_ != cudaSuccess)) {                               \
      (void)cudaGetLastError();                                              \
      (rc) = SKV_FAIL(SKV_ECUDA, (subsys), "%s failed: %s (%s)", #call,      \
                      cudaGetErrorString(skv_e_), cudaGetErrorName(skv_e_)); \
      goto label;                                                            \
    }                                                                        \
  } while (0)
/* Driver call (through skv__cu). */
int skv__cu_fail(CUresult r, unsigned subsys, const char *call, const char *file, int line);
#define SKV_CU_CHECK_GOTO(call, subsys, rc, label)                      \
  do {                                                                  \
    CUresult skv_r_ = (call);                                           \
    if (SKV_UNLIKELY(skv_r_ != CUDA_SUCCESS)) {                         \
      (rc) = skv__cu_fail(skv_r_, (subsys), #call, __FILE__, __LINE__); \
      goto label;                                                       \
    }                                                                   \
  } while (0)

/* Is `stream` being captured into a CUDA graph? */
int skv__cuda_capturing(void *stream, bool *capturing);

#endif
