/* launch_probe: the host cost of a kernel launch by parameter size (16 B against 3712 B, the copy
 * kernels' parameter block) and of cudaEventRecord: 2000 calls each, a stream sync every 8, so
 * that the queue stays short as for a lone call. Plain CUDA, no symkv.
 *
 *   nvcc -O2 -arch=sm_90 -o launch_probe bench/gpu/launch_probe.cu && ./launch_probe
 *   (under MPS: start nvidia-cuda-mps-control -d first)
 */
#include <cstdio>
#include <chrono>
#include <cuda_runtime.h>
struct Small {
  long a, b;
};
struct Big {
  long a, b;
  unsigned char pad[3696];
};
__global__ void ks(Small p) {
  if (p.a == 123456789) printf("x");
}
__global__ void kb(const __grid_constant__ Big p) {
  if (p.a == 123456789) printf("%d", p.pad[0]);
}
int main() {
  cudaStream_t st;
  cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking);
  cudaEvent_t ev;
  cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
  Small s{1, 2};
  Big b{};
  b.a = 1;
  for (int rep = 0; rep < 3; rep++) {
    for (int which = 0; which < 3; which++) {
      const int N = 2000;
      cudaStreamSynchronize(st);
      double tot = 0;
      int cnt = 0;
      for (int i = 0; i < N; i++) {
        auto t0 = std::chrono::steady_clock::now();
        if (which == 0)
          ks<<<32, 128, 0, st>>>(s);
        else if (which == 1)
          kb<<<32, 128, 0, st>>>(b);
        else
          cudaEventRecord(ev, st);
        auto t1 = std::chrono::steady_clock::now();
        tot += std::chrono::duration<double, std::micro>(t1 - t0).count();
        cnt++;
        if (i % 8 == 7) cudaStreamSynchronize(st); // keep the queue short, like a lone call
      }
      printf("rep %d %-28s %.2f us per call (host)\n", rep,
             which == 0   ? "launch, 16 B params"
             : which == 1 ? "launch, 3712 B params"
                          : "cudaEventRecord",
             tot / cnt);
    }
  }
  return 0;
}
