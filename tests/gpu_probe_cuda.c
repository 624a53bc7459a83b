/* The GPU probe of the test harness, in its own file because only it includes CUDA headers. */
#include <cuda_runtime_api.h>
#include <stdio.h>

int skv_test_gpu_probe(char *msg, size_t cap);
int skv_test_gpu_probe(char *msg, size_t cap) {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    snprintf(msg, cap, "no usable CUDA device: %s (%s)", cudaGetErrorString(e),
             cudaGetErrorName(e));
    return 0;
  }
  snprintf(msg, cap, "%d CUDA device(s)", n);
  return n;
}
