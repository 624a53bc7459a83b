/* args_probe: how long one warp (or several) takes to copy a gated fetch's arguments from pinned
 * host memory into device memory inside a kernel: what a "launch first, arguments through the
 * gate" fetch would pay per run of opened pages (issue 21; closing note of 2026-11-28). Each lane
 * loads UNROLL 16-byte vectors of host memory (ld.volatile: no stale line of an earlier use)
 * before it stores them, so a warp moves 32 x UNROLL x 16 bytes per round trip over PCIe. GPU
 * time per launch (median of 20), against the same grid copying nothing. Plain CUDA, no symkv.
 *
 *   nvcc -O2 -arch=sm_90 -o args_probe bench/gpu/args_probe.cu && ./args_probe
 */
#include "probe.cuh"

#include <cstdint>
#include <vector>

__device__ __forceinline__ uint4 ld_volatile(const uint4 *p) {
  uint4 v;
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
  return v;
}

/* Warp w of the grid copies its slice of `bytes` (a multiple of 16) from host to dev. */
template <int U> __global__ void copier(const uint4 *host, uint4 *dev, uint32_t bytes) {
  const uint32_t lane = threadIdx.x & 31u, warps = (gridDim.x * blockDim.x) >> 5;
  const uint32_t w = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const uint32_t nv = bytes / 16u, per = (nv + warps - 1) / warps;
  const uint32_t v0 = w * per, v1 = min(nv, v0 + per);
  for (uint32_t v = v0 + lane; v < v1; v += 32u * U) {
    uint4 r[U];
#pragma unroll
    for (int k = 0; k < U; k++)
      if (v + 32u * k < v1) r[k] = ld_volatile(host + v + 32u * k);
#pragma unroll
    for (int k = 0; k < U; k++)
      if (v + 32u * k < v1) dev[v + 32u * k] = r[k];
  }
}

int main() {
  const uint32_t cap = 64u << 10;
  uint4 *host, *hdev, *dev;
  CK(cudaHostAlloc((void **)&host, cap, cudaHostAllocMapped));
  CK(cudaHostGetDevicePointer((void **)&hdev, host, 0));
  CK(cudaMalloc((void **)&dev, cap));
  for (uint32_t i = 0; i < cap / 16; i++) host[i] = make_uint4(i, i + 1, i + 2, i + 3);
  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  const uint32_t sizes[] = {0, 768, 2048, 4096, 12288, 16384};
  const int warps[] = {1, 2, 6, 24};
  printf("GPU time per launch (median of 20), us; a 16-byte vector per lane per load\n");
  printf("%-8s %-6s %10s %10s %10s\n", "bytes", "warps", "unroll 4", "unroll 8", "unroll 16");
  for (uint32_t b : sizes)
    for (int nw : warps) {
      float med[3];
      for (int u = 0; u < 3; u++) {
        if (median_us(
                st, e0, e1, [&] { return cudaMemset(dev, 0, cap); },
                [&] {
                  if (u == 0) copier<4><<<nw, 32, 0, st>>>(hdev, dev, b);
                  if (u == 1) copier<8><<<nw, 32, 0, st>>>(hdev, dev, b);
                  if (u == 2) copier<16><<<nw, 32, 0, st>>>(hdev, dev, b);
                },
                &med[u]))
          return 1;
        std::vector<uint4> back(b / 16);
        CK(cudaMemcpy(back.data(), dev, b, cudaMemcpyDeviceToHost));
        for (uint32_t i = 0; i < b / 16; i++)
          if (back[i].x != i || back[i].w != i + 3) {
            fprintf(stderr, "args_probe: wrong vector %u of %u bytes\n", i, b);
            return 1;
          }
      }
      printf("%-8u %-6d %10.2f %10.2f %10.2f\n", b, nw, med[0], med[1], med[2]);
    }
  return 0;
}
