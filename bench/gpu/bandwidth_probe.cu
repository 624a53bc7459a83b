/* bandwidth_probe: what limits a large peer -> local copy on a host with 2 GPUs.
 *
 * symkv's fetch kernels level off at ~372 GB/s from a peer while the copy engines reach ~390:
 * this times 256 MiB contiguous peer -> local copies on GPU 0 (plain cudaMalloc memory and peer
 * access, no symkv) to see where that ceiling lies:
 *   - the copy engine alone, and two copy-engine copies at once on two streams;
 *   - SM loads (16-byte vectors) on all multiprocessors and on fewer, with the 256-byte L2 hint;
 *   - TMA bulk copies (cp.async.bulk global -> shared -> global) with several chunk sizes;
 *   - the copy engine and an SM kernel at once, each taking a share of the bytes;
 *   - SM stores pushed by a kernel on GPU 1 into GPU 0 (the same link, the other way round).
 * Each operation runs behind a gate kernel between events; median of REPS, GB/s.
 *
 *   nvcc -O3 -arch=sm_90 -o bandwidth_probe bench/gpu/bandwidth_probe.cu && ./bandwidth_probe
 */
#include "probe.cuh"

#include <functional>

constexpr size_t BIG = 256ull << 20; /* bytes per copy */
constexpr size_t POOL = 4 * BIG;     /* sources drawn from this much peer memory */
constexpr int REPS = 15, WARM = 2;

/* TMA: per warp a pipeline of S shared buffers of C bytes; lane 0 loads chunks with
 * cp.async.bulk (mbarrier completion) and writes them back with cp.async.bulk shared -> global. */
template <int S>
__global__ void tma_copy(const char *__restrict__ s, char *__restrict__ d, size_t bytes,
                         uint32_t C) {
  extern __shared__ __align__(128) uint8_t sm[];
  __shared__ uint64_t bars[32 * S];
  const uint32_t lane = threadIdx.x & 31, wid = threadIdx.x >> 5, wpc = blockDim.x >> 5;
  const uint64_t nw = (uint64_t)gridDim.x * wpc, gw = (uint64_t)blockIdx.x * wpc + wid;
  const uint64_t items = bytes / C;
  uint8_t *buf = sm + (size_t)wid * S * C;
  uint64_t *bar = bars + wid * S;
  if (lane != 0) return;
  for (int k = 0; k < S; k++)
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(su32(&bar[k])) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  auto issue = [&](uint64_t it, int st) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(su32(&bar[st])),
                 "r"(C)
                 : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], "
                 "%2, [%3];" ::"r"(su32(buf + (size_t)st * C)),
                 "l"(s + it * C), "r"(C), "r"(su32(&bar[st]))
                 : "memory");
  };
  for (int k = 0; k < S; k++)
    if (gw + k * nw < items) issue(gw + k * nw, k);
  uint32_t phase = 0;
  for (uint64_t k = 0;; k++) {
    const uint64_t it = gw + k * nw;
    if (it >= items) break;
    const int st = (int)(k % S);
    mbar_wait(&bar[st], (phase >> st) & 1u);
    phase ^= 1u << st;
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(d + it * C),
                 "r"(su32(buf + (size_t)st * C)), "r"(C)
                 : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
    const uint64_t next = gw + (k + S) * nw;
    if (next < items) issue(next, st);
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

struct probe {
  gated_t g; /* the measured stream (GPU 0) */
  cudaStream_t side, peer_st;
  cudaEvent_t fork, join, pjoin;
  char *peer, *dst;
  int sms;
  uint64_t rng = 0x9e3779b97f4a7c15ull;
  const char *src() {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return peer + (rng % (POOL / BIG)) * BIG;
  }
};

/* GB/s of `body(src)`, enqueued behind a gate on P.g.st between events; median of REPS. */
static double timed(probe &P, const std::function<void(const char *)> &body) {
  std::vector<double> t;
  for (int r = 0; r < WARM + REPS; r++) {
    const char *src = P.src();
    const double ms = gated_ms(P.g, [&] { body(src); });
    if (r >= WARM) t.push_back(BIG / (ms * 1e-3) / 1e9);
  }
  return median(t);
}

/* The side stream starts with the main one (after the gate) and the main one ends after it. */
static void fork_side(probe &P) {
  CK(cudaEventRecord(P.fork, P.g.st));
  CK(cudaStreamWaitEvent(P.side, P.fork, 0));
}
static void join_side(probe &P) {
  CK(cudaEventRecord(P.join, P.side));
  CK(cudaStreamWaitEvent(P.g.st, P.join, 0));
}

static void sm_copy(probe &P, cudaStream_t s, const char *src, char *dst, size_t bytes, int ctas,
                    bool l256 = false) {
  const uint4 *s4 = reinterpret_cast<const uint4 *>(src);
  uint4 *d4 = reinterpret_cast<uint4 *>(dst);
  if (l256)
    stream_copy<4, LD_NC_L2_256><<<ctas, 256, 0, s>>>(s4, d4, bytes / 16);
  else
    stream_copy<4, LD_NC><<<ctas, 256, 0, s>>>(s4, d4, bytes / 16);
}

int main() {
  int n = 0;
  CK(cudaGetDeviceCount(&n));
  if (n < 2) {
    fprintf(stderr, "bandwidth_probe: needs 2 GPUs, found %d\n", n);
    return 2;
  }
  probe P;
  CK(cudaSetDevice(1));
  CK(cudaDeviceEnablePeerAccess(0, 0));
  CK(cudaMalloc(&P.peer, POOL));
  CK(cudaMemset(P.peer, 1, POOL));
  CK(cudaStreamCreateWithFlags(&P.peer_st, cudaStreamNonBlocking));
  CK(cudaEventCreateWithFlags(&P.pjoin, cudaEventDisableTiming));
  CK(cudaSetDevice(0));
  CK(cudaDeviceEnablePeerAccess(1, 0));
  CK(cudaMalloc(&P.dst, BIG));
  CK(cudaDeviceGetAttribute(&P.sms, cudaDevAttrMultiProcessorCount, 0));
  gated_init(P.g);
  CK(cudaStreamCreateWithFlags(&P.side, cudaStreamNonBlocking));
  CK(cudaEventCreateWithFlags(&P.fork, cudaEventDisableTiming));
  CK(cudaEventCreateWithFlags(&P.join, cudaEventDisableTiming));
  for (int S : {2, 4})
    CK(cudaFuncSetAttribute((const void *)(S == 2 ? tma_copy<2> : tma_copy<4>),
                            cudaFuncAttributeMaxDynamicSharedMemorySize, 200 << 10));
  CK(cudaDeviceSynchronize());
  const int sms = P.sms;
  printf("%-58s %8s\n", "peer (GPU 1) -> local (GPU 0), 256 MiB contiguous", "GB/s");
  auto row = [](const char *name, double v) { printf("%-58s %8.1f\n", name, v); };
  const double ce = timed(P, [&](const char *s) {
    CK(cudaMemcpyAsync(P.dst, s, BIG, cudaMemcpyDeviceToDevice, P.g.st));
  });
  row("copy engine, one cudaMemcpyAsync", ce);
  row("copy engine, two halves on two streams at once", timed(P, [&](const char *s) {
        fork_side(P);
        CK(cudaMemcpyAsync(P.dst, s, BIG / 2, cudaMemcpyDeviceToDevice, P.g.st));
        CK(cudaMemcpyAsync(P.dst + BIG / 2, s + BIG / 2, BIG / 2, cudaMemcpyDeviceToDevice,
                           P.side));
        join_side(P);
      }));
  row("copy engine, 64 copies of 4 MiB on one stream", timed(P, [&](const char *s) {
        for (int i = 0; i < 64; i++)
          CK(cudaMemcpyAsync(P.dst + i * (BIG / 64), s + i * (BIG / 64), BIG / 64,
                             cudaMemcpyDeviceToDevice, P.g.st));
      }));
  char name[96];
  for (int div : {1, 2, 3, 4}) {
    const int g = sms * 4 / div;
    snprintf(name, sizeof name, "SM loads U4, %d CTAs of 256 (%d SMs' worth)", g, sms / div);
    row(name, timed(P, [&](const char *s) { sm_copy(P, P.g.st, s, P.dst, BIG, g); }));
  }
  row("SM loads U4 + L2::256B hint, 4 CTAs/SM",
      timed(P, [&](const char *s) { sm_copy(P, P.g.st, s, P.dst, BIG, sms * 4, true); }));
  struct {
    int S, warps;
    uint32_t C;
  } tc[] = {{4, 4, 8192}, {4, 2, 16384}, {4, 1, 32768}, {2, 4, 16384}, {4, 4, 4096}};
  for (auto &c : tc) {
    snprintf(name, sizeof name, "TMA bulk, %d warps/CTA, %d x %u B stages/warp, 1 CTA/SM", c.warps,
             c.S, c.C);
    const size_t smem = (size_t)c.S * c.warps * c.C;
    row(name, timed(P, [&](const char *s) {
          if (c.S == 2)
            tma_copy<2><<<sms, 32 * c.warps, smem, P.g.st>>>(s, P.dst, BIG, c.C);
          else
            tma_copy<4><<<sms, 32 * c.warps, smem, P.g.st>>>(s, P.dst, BIG, c.C);
        }));
  }
  /* copy engine and SMs at once: the engine takes a share of the bytes on the side stream */
  for (int pct : {10, 20, 30, 50}) {
    for (int div : {1, 2}) {
      const size_t ceb = (BIG * pct / 100) & ~(size_t)0xfffff;
      snprintf(name, sizeof name, "copy engine %d%% + SM loads %d%% (%d SMs), at once", pct,
               100 - pct, sms / div);
      row(name, timed(P, [&](const char *s) {
            fork_side(P);
            CK(cudaMemcpyAsync(P.dst, s, ceb, cudaMemcpyDeviceToDevice, P.side));
            sm_copy(P, P.g.st, s + ceb, P.dst + ceb, BIG - ceb, sms * 4 / div);
            join_side(P);
          }));
    }
  }
  /* GPU 1's SMs store into GPU 0 (a push over the same link) */
  row("SM stores pushed from GPU 1 into GPU 0, 4 CTAs/SM", timed(P, [&](const char *s) {
        CK(cudaEventRecord(P.fork, P.g.st));
        CK(cudaSetDevice(1));
        CK(cudaStreamWaitEvent(P.peer_st, P.fork, 0));
        sm_copy(P, P.peer_st, s, P.dst, BIG, sms * 4);
        CK(cudaEventRecord(P.pjoin, P.peer_st));
        CK(cudaSetDevice(0));
        CK(cudaStreamWaitEvent(P.g.st, P.pjoin, 0));
      }));
  row("copy engine of GPU 1 pushing into GPU 0", timed(P, [&](const char *s) {
        CK(cudaEventRecord(P.fork, P.g.st));
        CK(cudaSetDevice(1));
        CK(cudaStreamWaitEvent(P.peer_st, P.fork, 0));
        CK(cudaMemcpyAsync(P.dst, s, BIG, cudaMemcpyDeviceToDevice, P.peer_st));
        CK(cudaEventRecord(P.pjoin, P.peer_st));
        CK(cudaSetDevice(0));
        CK(cudaStreamWaitEvent(P.g.st, P.pjoin, 0));
      }));
  row("copy engine again (drift check)", timed(P, [&](const char *s) {
        CK(cudaMemcpyAsync(P.dst, s, BIG, cudaMemcpyDeviceToDevice, P.g.st));
      }));
  return 0;
}
