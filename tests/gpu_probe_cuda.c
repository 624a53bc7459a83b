/* The GPU probe of the test harness, in its own file because only it includes CUDA headers. */
#define _GNU_SOURCE
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <stdio.h>

int skv_test_gpu_probe(char *msg, size_t cap);
int skv_test_gpu_probe(char *msg, size_t cap) {
  /* Without the driver (no GPU on this machine), the runtime reports an "insufficient driver
   * version": say what is the matter, not what the runtime guesses. */
  void *drv = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!drv) {
    snprintf(msg, cap, "no GPU: no NVIDIA driver on this machine (libcuda.so.1 is not there)");
    return 0;
  }
  dlclose(drv);
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e == cudaErrorNoDevice || (e == cudaSuccess && n == 0)) {
    snprintf(msg, cap, "no GPU: the NVIDIA driver sees no CUDA device");
    return 0;
  }
  if (e != cudaSuccess) {
    snprintf(msg, cap, "no usable CUDA device: %s (%s)", cudaGetErrorString(e),
             cudaGetErrorName(e));
    return 0;
  }
  snprintf(msg, cap, "%d CUDA device(s)", n);
  return n;
}
