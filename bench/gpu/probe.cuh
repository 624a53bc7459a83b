/* What the one-file plain-CUDA probes of bench/gpu share (gate_probe.cu, args_probe.cu): CK, and
 * the median GPU time of 20 launches after 3 warm-ups. Included by path beside them, so that each
 * still builds with `nvcc -O2 -arch=sm_90 -o NAME bench/gpu/NAME.cu`. */
#ifndef SKV_BENCH_GPU_PROBE_CUH
#define SKV_BENCH_GPU_PROBE_CUH

#include <algorithm>
#include <cstdio>
#include <cuda_runtime.h>
#include <vector>

/* Return 1 from the calling function, naming the call, when it fails. */
#define CK(x)                                                                             \
  do {                                                                                    \
    cudaError_t e_ = (x);                                                                 \
    if (e_ != cudaSuccess) {                                                              \
      fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      return 1;                                                                           \
    }                                                                                     \
  } while (0)

/* *us: the median GPU time of launch() on st between events e0 and e1, over 20 runs after 3
 * warm-ups; before() runs ahead of each, untimed. */
template <class B, class L>
int median_us(cudaStream_t st, cudaEvent_t e0, cudaEvent_t e1, B before, L launch, float *us) {
  std::vector<float> t;
  for (int r = 0; r < 23; r++) {
    CK(before());
    CK(cudaEventRecord(e0, st));
    launch();
    CK(cudaGetLastError());
    CK(cudaEventRecord(e1, st));
    CK(cudaEventSynchronize(e1));
    float ms;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    if (r >= 3) t.push_back(ms * 1000.f);
  }
  std::sort(t.begin(), t.end());
  *us = t[t.size() / 2];
  return 0;
}

#endif
