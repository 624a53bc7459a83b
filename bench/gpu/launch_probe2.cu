/* launch_probe2: what a lone small fetch pays the host, call by call, against cudaMemcpyAsync.
 * The host cost (median and mean of 2000 calls, a stream sync every 8 so that the queue stays
 * short as for a lone call) of a launch with the copy kernels' tiny parameter block (704 B)
 * through the runtime's <<<>>>, cudaLaunchKernelExC (what kernels/kv_copy.cu uses), the
 * driver's cuLaunchKernel and cuLaunchKernelEx; of cudaMemcpyAsync of 1 MiB, of
 * cudaStreamGetCaptureInfo and of cudaEventRecord; of cudaLaunchKernelExC while another thread
 * polls cudaEventQuery (as a completion thread does). Then wall time of a call and
 * cudaStreamSynchronize: cudaMemcpyAsync 1 MiB against a 1 MiB copy kernel launched each way.
 * Plain CUDA, no symkv.
 *
 *   nvcc -O2 -arch=sm_90 -o launch_probe2 bench/gpu/launch_probe2.cu -lcuda && ./launch_probe2
 *   (under MPS: start nvidia-cuda-mps-control -d first)
 */
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>
#include <cuda.h>
#include <cuda_runtime.h>

struct Tiny {
  const uint4 *src;
  uint4 *dst;
  unsigned n; /* uint4s */
  unsigned char pad[704 - 20];
};

__global__ void kcopy(const __grid_constant__ Tiny p) {
  for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < p.n; i += gridDim.x * blockDim.x)
    p.dst[i] = p.src[i];
  if (p.n == 0xffffffffu) printf("%d", p.pad[0]);
}

static double now_us() {
  return std::chrono::duration<double, std::micro>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

#define CK(x)                                                                      \
  do {                                                                             \
    auto e_ = (x);                                                                 \
    if (e_ != 0) {                                                                 \
      fprintf(stderr, "%s:%d: %s failed (%d)\n", __FILE__, __LINE__, #x, (int)e_); \
      return 1;                                                                    \
    }                                                                              \
  } while (0)

int main() {
  const size_t bytes = 1 << 20;
  void *a = nullptr, *b = nullptr;
  CK(cudaMalloc(&a, bytes));
  CK(cudaMalloc(&b, bytes));
  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  cudaEvent_t ev, ev_done;
  CK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  CK(cudaEventCreateWithFlags(&ev_done, cudaEventDisableTiming));
  CK(cudaEventRecord(ev_done, st));
  CK(cudaStreamSynchronize(st));
  Tiny p;
  memset(&p, 0, sizeof p);
  p.src = (const uint4 *)a;
  p.dst = (uint4 *)b;
  p.n = (unsigned)(bytes / 16);
  const unsigned grid = 132, threads = 512;
  cudaFunction_t rf;
  CK(cudaGetFuncBySymbol(&rf, (const void *)kcopy));
  CUfunction f = (CUfunction)rf;
  void *args[] = {&p};
  cudaLaunchConfig_t lc = {};
  lc.gridDim = dim3(grid);
  lc.blockDim = dim3(threads);
  lc.stream = st;
  CUlaunchConfig dc = {};
  dc.gridDimX = grid, dc.gridDimY = 1, dc.gridDimZ = 1;
  dc.blockDimX = threads, dc.blockDimY = 1, dc.blockDimZ = 1;
  dc.hStream = (CUstream)st;
  cudaStreamCaptureStatus cs;
  unsigned long long cid;
  std::atomic<int> poll{0};
  std::thread poller([&] {
    while (poll.load() >= 0) {
      if (poll.load() == 1)
        (void)cudaEventQuery(ev_done);
      else
        std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  });
  const char *names[] = {"launch <<<>>> 704 B",   "cudaLaunchKernelExC 704 B",
                         "cuLaunchKernel 704 B",  "cuLaunchKernelEx 704 B",
                         "cudaMemcpyAsync 1 MiB", "cudaStreamGetCaptureInfo",
                         "cudaEventRecord",       "cudaLaunchKernelExC, a thread polls"};
  const int ncases = 8, N = 2000;
  for (int rep = 0; rep < 3; rep++) {
    for (int which = 0; which < ncases; which++) {
      std::vector<double> t;
      poll.store(which == 7 ? 1 : 0);
      CK(cudaStreamSynchronize(st));
      for (int i = 0; i < N; i++) {
        const double t0 = now_us();
        int e = 0;
        switch (which) {
        case 0:
          kcopy<<<grid, threads, 0, st>>>(p);
          break;
        case 1:
        case 7:
          e = (int)cudaLaunchKernelExC(&lc, (const void *)kcopy, args);
          break;
        case 2:
          e = (int)cuLaunchKernel(f, grid, 1, 1, threads, 1, 1, 0, (CUstream)st, args, 0);
          break;
        case 3:
          e = (int)cuLaunchKernelEx(&dc, f, args, 0);
          break;
        case 4:
          e = (int)cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, st);
          break;
        case 5:
          e = (int)cudaStreamGetCaptureInfo(st, &cs, &cid);
          break;
        case 6:
          e = (int)cudaEventRecord(ev, st);
          break;
        }
        const double t1 = now_us();
        CK(e);
        t.push_back(t1 - t0);
        if (i % 8 == 7) CK(cudaStreamSynchronize(st));
      }
      std::sort(t.begin(), t.end());
      double s = 0;
      for (double x : t) s += x;
      printf("rep %d host %-38s median %.2f us, mean %.2f us\n", rep, names[which], t[N / 2],
             s / N);
    }
    poll.store(0);
    /* a lone call and its wait, wall */
    const char *wnames[] = {"cudaMemcpyAsync 1 MiB + sync", "<<<>>> copy 1 MiB + sync",
                            "cudaLaunchKernelExC copy + sync", "cuLaunchKernel copy + sync"};
    for (int which = 0; which < 4; which++) {
      std::vector<double> t;
      for (int i = 0; i < 500; i++) {
        CK(cudaStreamSynchronize(st));
        const double t0 = now_us();
        int e = 0;
        switch (which) {
        case 0:
          e = (int)cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, st);
          break;
        case 1:
          kcopy<<<grid, threads, 0, st>>>(p);
          break;
        case 2:
          e = (int)cudaLaunchKernelExC(&lc, (const void *)kcopy, args);
          break;
        case 3:
          e = (int)cuLaunchKernel(f, grid, 1, 1, threads, 1, 1, 0, (CUstream)st, args, 0);
          break;
        }
        CK(e);
        CK(cudaStreamSynchronize(st));
        t.push_back(now_us() - t0);
      }
      std::sort(t.begin(), t.end());
      printf("rep %d wall %-38s median %.2f us\n", rep, wnames[which], t[t.size() / 2]);
    }
  }
  poll.store(-1);
  poller.join();
  return 0;
}
