/* What the plain-CUDA probes of bench/gpu share (no symkv code: each probe builds from its own
 * .cu file with nvcc alone, `nvcc -O2 -arch=sm_90 -std=c++17 -o NAME bench/gpu/NAME.cu`; the
 * CUDA build compiles them all, bench/CMakeLists.txt): error checks, the gate kernel and a
 * measurement behind it, the median GPU time of 20 launches, a contiguous copy kernel, the
 * median, the TMA helpers. */
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CK(x)                                                                             \
  do {                                                                                    \
    cudaError_t e_ = (x);                                                                 \
    if (e_ != cudaSuccess) {                                                              \
      fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      exit(1);                                                                            \
    }                                                                                     \
  } while (0)

/* *us: the median GPU time of launch() on st between events e0 and e1, over 20 runs after 3
 * warm-ups; before() runs ahead of each, untimed (returns 0, or exits at a CUDA error as CK). */
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

/* Holds its stream until *flag is set (at least min_ns, at most max_ns). */
__global__ void gate(const volatile uint32_t *flag, uint64_t min_ns, uint64_t max_ns) {
  uint64_t t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  for (;;) {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    if (t - t0 >= max_ns || (t - t0 >= min_ns && *flag != 0)) break;
    __nanosleep(500);
  }
}

/* A stream, two timing events and the gate's flag (host memory mapped for the device). */
struct gated_t {
  cudaStream_t st;
  cudaEvent_t e0, e1;
  volatile uint32_t *flag;
};

static void gated_init(gated_t &g) {
  CK(cudaStreamCreateWithFlags(&g.st, cudaStreamNonBlocking));
  CK(cudaEventCreate(&g.e0));
  CK(cudaEventCreate(&g.e1));
  uint32_t *f;
  CK(cudaHostAlloc((void **)&f, 64, cudaHostAllocMapped));
  g.flag = f;
}

/* GPU milliseconds of what `enqueue()` puts on g.st: a gate holds the stream (1 ms at least,
 * so that clocks are up) until the host has enqueued it all, events before and after it. */
template <typename F> static double gated_ms(const gated_t &g, F &&enqueue) {
  *g.flag = 0;
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
  gate<<<1, 1, 0, g.st>>>(g.flag, 1000000ull, 100000000ull);
  CK(cudaEventRecord(g.e0, g.st));
  enqueue();
  CK(cudaGetLastError());
  CK(cudaEventRecord(g.e1, g.st));
  __atomic_store_n((uint32_t *)g.flag, 1, __ATOMIC_SEQ_CST);
  CK(cudaEventSynchronize(g.e1));
  float ms;
  CK(cudaEventElapsedTime(&ms, g.e0, g.e1));
  return ms;
}

static double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

/* 16-byte loads: plain, read-once (.nc, no L1 allocation), read-once with the 256-byte L2 hint */
enum { LD_PLAIN, LD_NC, LD_NC_L2_256 };
template <int LD> __device__ __forceinline__ uint4 ld16(const uint4 *p) {
  uint4 v;
  if constexpr (LD == LD_PLAIN)
    v = *p;
  else if constexpr (LD == LD_NC)
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
  else
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
  return v;
}

/* A contiguous copy of n16 16-byte vectors, grid-stride, U loads in flight per thread. */
template <int U, int LD>
__global__ void stream_copy(const uint4 *__restrict__ s, uint4 *__restrict__ d, size_t n16) {
  const size_t step = (size_t)gridDim.x * blockDim.x * U;
  for (size_t i = (size_t)blockIdx.x * blockDim.x * U + threadIdx.x; i < n16; i += step) {
    uint4 v[U];
#pragma unroll
    for (int k = 0; k < U; k++)
      if (i + (size_t)k * blockDim.x < n16) v[k] = ld16<LD>(s + i + (size_t)k * blockDim.x);
#pragma unroll
    for (int k = 0; k < U; k++)
      if (i + (size_t)k * blockDim.x < n16) d[i + (size_t)k * blockDim.x] = v[k];
  }
}

/* TMA helpers of the probes' bulk-copy kernels: a shared-memory address as the 32-bit value PTX
 * takes, and a wait for an mbarrier's phase `parity` to complete. */
__device__ __forceinline__ uint32_t su32(const void *p) {
  return (uint32_t)__cvta_generic_to_shared(p);
}
__device__ __forceinline__ void mbar_wait(uint64_t *bar, uint32_t parity) {
  uint32_t done = 0;
  while (!done)
    asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                 " selp.u32 %0, 1, 0, p;\n}"
                 : "=r"(done)
                 : "r"(su32(bar)), "r"(parity)
                 : "memory");
}
