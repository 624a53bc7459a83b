/* symkv-bench workloads on a GPU: the engine's KV blocks in device memory, streams, and the
 * prefill throughput measured with a cuBLAS bf16 GEMM (libcublas opened at run time). */
#define _GNU_SOURCE
#include "workload.h"

#include <stdio.h>
#include <string.h>

#ifdef SKV_WITH_CUDA
#include "cuda/device.h"

#include <cuda_runtime_api.h>
#include <dlfcn.h>

#define WL_CUDA(call) SKV_CUDA_CHECK((call), SKV_SUBSYS_BENCH)

bool wl_dev_present(void) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return n > 0;
}

int wl_dev_use(skv_ctx_t *ctx, int *device) {
  int d = skv_ctx_get_device(ctx);
  if (d < 0) return d;
  WL_CUDA(cudaSetDevice(d));
  *device = d;
  return 0;
}

int wl_dev_alloc(uint64_t bytes, void **ptr) {
  WL_CUDA(cudaMalloc(ptr, bytes ? bytes : 1));
  return 0;
}

void wl_dev_free(void *ptr) {
  if (ptr) cudaFree(ptr);
}

int wl_dev_mem_free(uint64_t *free_bytes) {
  size_t fr = 0, total = 0;
  WL_CUDA(cudaMemGetInfo(&fr, &total));
  *free_bytes = fr;
  return 0;
}

int wl_dev_stream_create(void **stream) {
  cudaStream_t s;
  WL_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  *stream = s;
  return 0;
}

void wl_dev_stream_destroy(void *stream) {
  if (stream) cudaStreamDestroy((cudaStream_t)stream);
}

int wl_dev_stream_sync(void *stream) {
  WL_CUDA(cudaStreamSynchronize((cudaStream_t)stream));
  return 0;
}

int wl_dev_memcpy(void *dst, const void *src, uint64_t bytes, int kind, void *stream) {
  static const enum cudaMemcpyKind kinds[] = {cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost,
                                              cudaMemcpyDeviceToDevice};
  WL_CUDA(cudaMemcpyAsync(dst, src, bytes, kinds[kind], (cudaStream_t)stream));
  return 0;
}

/* The few cuBLAS declarations we need (cublas_api.h values), so that nothing links cuBLAS. */
typedef void *wl_cublas_t;
typedef int (*cublas_create_fn)(wl_cublas_t *);
typedef int (*cublas_destroy_fn)(wl_cublas_t);
typedef int (*cublas_set_stream_fn)(wl_cublas_t, cudaStream_t);
typedef int (*cublas_gemm_ex_fn)(wl_cublas_t, int, int, int, int, int, const void *, const void *,
                                 int, int, const void *, int, int, const void *, void *, int, int,
                                 int, int);
enum { CUBLAS_OP_N_ = 0, CUDA_R_16BF_ = 14, CUBLAS_COMPUTE_32F_ = 68, CUBLAS_GEMM_DEFAULT_ = -1 };

int wl_dev_gemm_tflops(double *tflops, char *about, size_t cap) {
  const char *libs[] = {"libcublas.so.13", "libcublas.so.12", "libcublas.so"};
  void *h = NULL;
  const char *lib = NULL;
  for (size_t i = 0; i < SKV_ARRAY_LEN(libs) && !h; i++)
    if ((h = dlopen(libs[i], RTLD_NOW | RTLD_LOCAL))) lib = libs[i];
  if (!h)
    return SKV_FAIL(SKV_ENOTSUP, SKV_SUBSYS_BENCH,
                    "cannot open libcublas.so.13 (%s): add its folder to LD_LIBRARY_PATH or pass "
                    "--prefill-tflops",
                    dlerror());
  cublas_create_fn create = (cublas_create_fn)dlsym(h, "cublasCreate_v2");
  cublas_destroy_fn destroy = (cublas_destroy_fn)dlsym(h, "cublasDestroy_v2");
  cublas_set_stream_fn set_stream = (cublas_set_stream_fn)dlsym(h, "cublasSetStream_v2");
  cublas_gemm_ex_fn gemm = (cublas_gemm_ex_fn)dlsym(h, "cublasGemmEx");
  int rc = 0;
  wl_cublas_t handle = NULL;
  void *a = NULL, *bm = NULL, *c = NULL;
  cudaStream_t s = NULL;
  cudaEvent_t e0 = NULL, e1 = NULL;
  if (!create || !destroy || !set_stream || !gemm) {
    rc = SKV_FAIL(SKV_ENOTSUP, SKV_SUBSYS_BENCH, "%s lacks cublasCreate_v2 / cublasGemmEx", lib);
    goto out;
  }
  const int n = 8192; /* M = N = K: large enough to reach the tensor cores' plateau */
  size_t bytes = (size_t)n * n * 2;
  if (cudaMalloc(&a, bytes) != cudaSuccess || cudaMalloc(&bm, bytes) != cudaSuccess ||
      cudaMalloc(&c, bytes) != cudaSuccess ||
      cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess ||
      cudaEventCreate(&e0) != cudaSuccess || cudaEventCreate(&e1) != cudaSuccess) {
    (void)cudaGetLastError();
    rc = SKV_FAIL(SKV_ECUDA, SKV_SUBSYS_BENCH, "GEMM buffers (3 x %zu MiB) could not be allocated",
                  bytes >> 20);
    goto out;
  }
  cudaMemsetAsync(a, 0x3c, bytes, s); /* bf16 ~1.0: finite values, no denormals */
  cudaMemsetAsync(bm, 0x3c, bytes, s);
  if (create(&handle) != 0) {
    rc = SKV_FAIL(SKV_ECUDA, SKV_SUBSYS_BENCH, "cublasCreate failed");
    goto out;
  }
  set_stream(handle, s);
  float alpha = 1.0f, beta = 0.0f;
  int reps = 20, st = 0;
  for (int i = 0; i < 3 && st == 0; i++) /* warm-up: picks the kernel, clocks up */
    st =
        gemm(handle, CUBLAS_OP_N_, CUBLAS_OP_N_, n, n, n, &alpha, a, CUDA_R_16BF_, n, bm,
             CUDA_R_16BF_, n, &beta, c, CUDA_R_16BF_, n, CUBLAS_COMPUTE_32F_, CUBLAS_GEMM_DEFAULT_);
  cudaEventRecord(e0, s);
  for (int i = 0; i < reps && st == 0; i++)
    st =
        gemm(handle, CUBLAS_OP_N_, CUBLAS_OP_N_, n, n, n, &alpha, a, CUDA_R_16BF_, n, bm,
             CUDA_R_16BF_, n, &beta, c, CUDA_R_16BF_, n, CUBLAS_COMPUTE_32F_, CUBLAS_GEMM_DEFAULT_);
  cudaEventRecord(e1, s);
  if (st != 0 || cudaEventSynchronize(e1) != cudaSuccess) {
    (void)cudaGetLastError();
    rc = SKV_FAIL(SKV_ECUDA, SKV_SUBSYS_BENCH, "cublasGemmEx failed (status %d)", st);
    goto out;
  }
  float ms = 0;
  cudaEventElapsedTime(&ms, e0, e1);
  *tflops = 2.0 * n * (double)n * n * reps / (ms * 1e-3) / 1e12;
  snprintf(about, cap, "cuBLAS bf16 GEMM %dx%dx%d (%s), measured in this run", n, n, n, lib);
out:
  if (handle) destroy(handle);
  if (e0) cudaEventDestroy(e0);
  if (e1) cudaEventDestroy(e1);
  if (s) cudaStreamDestroy(s);
  cudaFree(a);
  cudaFree(bm);
  cudaFree(c);
  dlclose(h);
  return rc;
}

#else /* no CUDA in this build */

static int no_cuda(const char *what) {
  return SKV_FAIL(SKV_ENOTSUP, SKV_SUBSYS_BENCH, "%s: this symkv-bench was built without CUDA",
                  what);
}
bool wl_dev_present(void) {
  return false;
}
int wl_dev_use(skv_ctx_t *ctx, int *device) {
  (void)ctx;
  *device = -1;
  return no_cuda("GPU engine blocks");
}
int wl_dev_alloc(uint64_t bytes, void **ptr) {
  (void)bytes;
  *ptr = NULL;
  return no_cuda("device memory");
}
void wl_dev_free(void *ptr) {
  (void)ptr;
}
int wl_dev_mem_free(uint64_t *free_bytes) {
  *free_bytes = 0;
  return no_cuda("device memory");
}
int wl_dev_stream_create(void **stream) {
  *stream = NULL;
  return no_cuda("streams");
}
void wl_dev_stream_destroy(void *stream) {
  (void)stream;
}
int wl_dev_stream_sync(void *stream) {
  (void)stream;
  return 0;
}
int wl_dev_memcpy(void *dst, const void *src, uint64_t bytes, int kind, void *stream) {
  (void)dst, (void)src, (void)bytes, (void)kind, (void)stream;
  return no_cuda("device copies");
}
int wl_dev_gemm_tflops(double *tflops, char *about, size_t cap) {
  *tflops = 0;
  snprintf(about, cap, "no CUDA in this build");
  return no_cuda("the cuBLAS GEMM");
}
#endif
