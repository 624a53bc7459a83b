/* gate_probe: what it costs a grid to read one word of pinned host memory (a gated fetch's gate,
 * kernels/kv_copy.h) once per warp or once per CTA, by load kind, against the same grid reading
 * nothing and against a word of device memory. 20 launches each, the median of their GPU times.
 * Plain CUDA, no symkv.
 *
 *   nvcc -O2 -arch=sm_90 -o gate_probe bench/gpu/gate_probe.cu && ./gate_probe
 */
#include "probe.cuh"

#include <cstdint>

enum { NONE, ACQ_SYS, VOLATILE, RELAXED_SYS, ACQ_GPU_DEV, NKIND };
static const char *names[NKIND] = {"nothing", "ld.acquire.sys (host)", "ld.volatile (host)",
                                   "ld.relaxed.sys (host)", "ld.acquire.gpu (device word)"};

__global__ void reader(const uint32_t *g, int kind, int per_cta, uint32_t *out) {
  const bool me = per_cta ? threadIdx.x == 0 : (threadIdx.x & 31u) == 0;
  if (!me || kind == NONE) return;
  uint32_t v = 0;
  if (kind == ACQ_SYS)
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(g) : "memory");
  else if (kind == VOLATILE)
    v = *(const volatile uint32_t *)g;
  else if (kind == RELAXED_SYS)
    asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(g) : "memory");
  else
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(g) : "memory");
  if (v == 0xdeadbeef) out[0] = v;
}

int main() {
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  uint32_t *host, *hdev, *dev, *out;
  CK(cudaHostAlloc((void **)&host, 64, cudaHostAllocMapped));
  CK(cudaHostGetDevicePointer((void **)&hdev, host, 0));
  CK(cudaMalloc((void **)&dev, 64));
  CK(cudaMalloc((void **)&out, 64));
  *host = 7;
  CK(cudaMemset(dev, 0, 64));
  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  const int grids[2] = {sms * 4, sms};
  const int threads[2] = {256, 128};
  printf("%d SMs; GPU time per launch (median of 20), us\n", sms);
  for (int shape = 0; shape < 2; shape++)
    for (int per_cta = 0; per_cta < 2; per_cta++)
      for (int kind = 0; kind < NKIND; kind++) {
        float us;
        const uint32_t *word = kind == ACQ_GPU_DEV ? dev : hdev;
        if (median_us(
                st, e0, e1, [] { return cudaSuccess; },
                [&] { reader<<<grids[shape], threads[shape], 0, st>>>(word, kind, per_cta, out); },
                &us))
          return 1;
        printf("grid %4d x %3d, one read per %-4s %-30s %8.2f\n", grids[shape], threads[shape],
               per_cta ? "CTA" : "warp", names[kind], us);
      }
  return 0;
}
