/* latency_probe: where the fixed cost of a small peer gather goes, on a host with 2 GPUs.
 *
 * Times, on GPU 0, kernels and copies of 1 MiB (16 pages of 64 KiB out of a 1 GiB pool) the way
 * symkv-bench fetch does: single operations behind a gate kernel between events, and 8 back to
 * back behind one gate (per operation). Plain cudaMalloc memory and peer access, no symkv: it
 * separates what the hardware costs (a kernel launch, large kernel parameters, a large shared
 * memory carve-out, the first load of a page, local or over NVLink) from what symkv's fetch adds.
 *
 *   nvcc -O3 -arch=sm_90 -o latency_probe bench/gpu/latency_probe.cu && ./latency_probe
 */
#include "probe.cuh"

constexpr int NP = 16;                    /* pages per gather */
constexpr size_t PAGE = 64 << 10;         /* bytes per page */
constexpr size_t POOL = 1ull << 30;       /* pages drawn from this much memory */
constexpr size_t NPOOL = POOL / PAGE;     /* pages in the pool */
constexpr int REPS = 15, WARM = 2, K = 8; /* single: median of REPS; b2b: K per gate */

struct gp_t {
  const char *src[NP];
  char *dst[NP];
  uint32_t chunk; /* bytes per warp item: 32 lanes x U x 16 */
};
struct gp_big_t {
  gp_t g;
  uint8_t pad[4000 - sizeof(gp_t)];
};

__global__ void empty1() {}
__global__ void empty_big(const __grid_constant__ gp_big_t p) {
  if (threadIdx.x == 1000000) printf("%d", p.pad[0]);
}
__global__ void empty_smem() {
  extern __shared__ uint8_t s[];
  if (threadIdx.x == 1000000) s[0] = 1;
}

template <int U> __device__ __forceinline__ void gather_body(const gp_t &p) {
  const uint32_t lane = threadIdx.x & 31, wpc = blockDim.x >> 5;
  const uint32_t per_page = (uint32_t)(PAGE / p.chunk), items = NP * per_page;
  for (uint32_t it = blockIdx.x * wpc + (threadIdx.x >> 5); it < items; it += gridDim.x * wpc) {
    const uint32_t pg = it / per_page, off = (it % per_page) * p.chunk;
    const uint4 *s = reinterpret_cast<const uint4 *>(p.src[pg] + off);
    uint4 *d = reinterpret_cast<uint4 *>(p.dst[pg] + off);
    uint4 v[U];
#pragma unroll
    for (int k = 0; k < U; k++) v[k] = s[k * 32 + lane];
#pragma unroll
    for (int k = 0; k < U; k++) d[k * 32 + lane] = v[k];
  }
}
template <int U> __global__ void gather(const __grid_constant__ gp_t p) {
  gather_body<U>(p);
}
template <int U> __global__ void gather_big(const __grid_constant__ gp_big_t p) {
  gather_body<U>(p.g);
}

static void CUDART_CB noop(void *) {}

struct probe {
  gated_t g; /* the measured stream */
  cudaStream_t side, side_prio;
  cudaEvent_t done[64];
  int di = 0;
  char *local, *peer, *dst;
  uint64_t rng = 0x1234567;
  uint64_t rnd() {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
  }
};

enum op_t {
  EMPTY1,
  EMPTY_BIG,
  EMPTY_SMEM,
  G_LOCAL,
  G_PEER,
  G_PEER_CONTIG,
  G_PEER_WIDE,
  G_PEER_BIG,
  G_PEER_U8,
  G_PEER_EV,
  G_PEER_WAIT,
  G_PEER_CB,
  G_PEER_CB_PRIO,
  G_PEER_CB_MAIN,
  CE_PEER,
  CE_LOCAL,
  NOPS
};
static const char *names[NOPS] = {"empty kernel, 1 thread",
                                  "empty kernel, 4000 B of parameters",
                                  "empty kernel, 32 CTAs, 128 KiB shared",
                                  "gather local random pages (U4, 2 KiB/warp)",
                                  "gather peer random pages (U4, 2 KiB/warp)",
                                  "gather peer contiguous 1 MiB (U4)",
                                  "gather peer random, 512 B/warp (U1)",
                                  "gather peer random, 4000 B parameters",
                                  "gather peer random, 4 KiB/warp (U8)",
                                  "gather peer random + event record",
                                  "... + side stream waits for it",
                                  "... + side stream waits, host callback",
                                  "... same, side stream of another priority",
                                  "gather peer random + host callback on stream",
                                  "copy engine peer contiguous 1 MiB",
                                  "copy engine local contiguous 1 MiB"};

static void launch(probe &P, int op) {
  gp_t g;
  const bool contig = op == G_PEER_CONTIG;
  const char *base = op == G_LOCAL ? P.local : P.peer;
  const uint64_t first = P.rnd() % (NPOOL - NP);
  for (int i = 0; i < NP; i++) {
    g.src[i] = base + (contig ? first + i : P.rnd() % NPOOL) * PAGE;
    g.dst[i] = P.dst + (P.rnd() % (NPOOL / 4)) * PAGE;
  }
  switch (op) {
  case EMPTY1:
    empty1<<<1, 1, 0, P.g.st>>>();
    break;
  case EMPTY_BIG: {
    gp_big_t b;
    b.g = g;
    empty_big<<<1, 1, 0, P.g.st>>>(b);
    break;
  }
  case EMPTY_SMEM:
    empty_smem<<<32, 128, 128 << 10, P.g.st>>>();
    break;
  case G_PEER_WIDE:
    g.chunk = 512;
    gather<1><<<NP * PAGE / 512 / 4, 128, 0, P.g.st>>>(g);
    break;
  case G_PEER_U8:
    g.chunk = 4096;
    gather<8><<<NP * PAGE / 4096 / 4, 128, 0, P.g.st>>>(g);
    break;
  case G_PEER_BIG: {
    gp_big_t b;
    g.chunk = 2048;
    b.g = g;
    gather_big<4><<<NP * PAGE / 2048 / 4, 128, 0, P.g.st>>>(b);
    break;
  }
  case CE_PEER:
  case CE_LOCAL:
    CK(cudaMemcpyAsync(P.dst + (P.rnd() % (NPOOL / 4 - NP)) * PAGE,
                       (op == CE_PEER ? P.peer : P.local) + first * PAGE, NP * PAGE,
                       cudaMemcpyDeviceToDevice, P.g.st));
    break;
  default:
    g.chunk = 2048;
    gather<4><<<NP * PAGE / 2048 / 4, 128, 0, P.g.st>>>(g);
  }
  CK(cudaGetLastError());
  if (op >= G_PEER_EV && op <= G_PEER_CB_PRIO) { /* symkv's completion: event, side stream */
    cudaEvent_t ev = P.done[P.di++ % 64];
    cudaStream_t side = op == G_PEER_CB_PRIO ? P.side_prio : P.side;
    CK(cudaEventRecord(ev, P.g.st));
    if (op != G_PEER_EV) CK(cudaStreamWaitEvent(side, ev, 0));
    if (op == G_PEER_CB || op == G_PEER_CB_PRIO) CK(cudaLaunchHostFunc(side, noop, nullptr));
  }
  if (op == G_PEER_CB_MAIN) CK(cudaLaunchHostFunc(P.g.st, noop, nullptr));
}

/* Microseconds per operation of n operations behind one gate. */
static double timed(probe &P, int op, int n) {
  return gated_ms(P.g,
                  [&] {
                    for (int k = 0; k < n; k++) launch(P, op);
                  }) *
         1e3 / n;
}

int main() {
  int n = 0;
  CK(cudaGetDeviceCount(&n));
  if (n < 2) {
    fprintf(stderr, "latency_probe: needs 2 GPUs, found %d\n", n);
    return 2;
  }
  probe P;
  CK(cudaSetDevice(1));
  CK(cudaMalloc(&P.peer, POOL));
  CK(cudaMemset(P.peer, 1, POOL));
  CK(cudaSetDevice(0));
  CK(cudaDeviceEnablePeerAccess(1, 0));
  CK(cudaMalloc(&P.local, POOL));
  CK(cudaMemset(P.local, 2, POOL));
  CK(cudaMalloc(&P.dst, POOL / 4));
  CK(cudaFuncSetAttribute((const void *)empty_smem, cudaFuncAttributeMaxDynamicSharedMemorySize,
                          128 << 10));
  gated_init(P.g);
  CK(cudaStreamCreateWithFlags(&P.side, cudaStreamNonBlocking));
  int lo, hi;
  CK(cudaDeviceGetStreamPriorityRange(&lo, &hi));
  CK(cudaStreamCreateWithPriority(&P.side_prio, cudaStreamNonBlocking, hi));
  for (auto &e : P.done) CK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  CK(cudaDeviceSynchronize());
  printf("%-45s %10s %10s\n", "operation (1 MiB = 16 x 64 KiB)", "single us", "b2b us");
  for (int op = 0; op < NOPS; op++) {
    std::vector<double> s, b;
    for (int r = 0; r < WARM + REPS; r++) {
      double t = timed(P, op, 1);
      if (r >= WARM) s.push_back(t);
    }
    for (int r = 0; r < WARM + REPS; r++) {
      double t = timed(P, op, K);
      if (r >= WARM) b.push_back(t);
    }
    printf("%-45s %10.2f %10.2f\n", names[op], median(s), median(b));
  }
  /* The bandwidth ceiling of SM loads from the peer against the copy engines: 256 MiB
   * contiguous, one operation behind a gate, median of REPS. */
  const size_t big = 256ull << 20;
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  printf("\n%-45s %10s\n", "peer -> local, 256 MiB contiguous", "GB/s");
  for (int v = 0; v < 4; v++) {
    std::vector<double> t;
    for (int r = 0; r < WARM + REPS; r++) {
      const char *src = P.peer + (P.rnd() % 3) * big;
      const uint4 *s4 = reinterpret_cast<const uint4 *>(src);
      uint4 *d4 = reinterpret_cast<uint4 *>(P.dst);
      const cudaStream_t st = P.g.st;
      const double ms = gated_ms(P.g, [&] {
        if (v == 0) CK(cudaMemcpyAsync(P.dst, src, big, cudaMemcpyDeviceToDevice, st));
        if (v == 1) stream_copy<4, LD_PLAIN><<<sms * 4, 256, 0, st>>>(s4, d4, big / 16);
        if (v == 2) stream_copy<8, LD_PLAIN><<<sms * 4, 256, 0, st>>>(s4, d4, big / 16);
        if (v == 3) stream_copy<4, LD_PLAIN><<<sms * 16, 128, 0, st>>>(s4, d4, big / 16);
      });
      if (r >= WARM) t.push_back(big / (ms * 1e-3) / 1e9);
    }
    static const char *vn[] = {
        "copy engine (cudaMemcpyAsync)", "SM loads, U4, 4 x 256-thread CTAs/SM",
        "SM loads, U8, 4 x 256-thread CTAs/SM", "SM loads, U4, 16 x 128-thread CTAs/SM"};
    printf("%-45s %10.1f\n", vn[v], median(t));
  }
  return 0;
}
