/* split_probe: what does a device publish lose on the GPU by being split into launches, and does
 * programmatic dependent launch (PDL) give it back? One GPU (device 0), plain CUDA, no symkv.
 *
 * symkv's device publish of 1024 pages of 64 KiB runs as 4 launches of 256 pages (so that the
 * host allocates the next window while the GPU copies one), and its GPU time is about 0.70x one
 * contiguous cudaMemcpyAsync of the same bytes, where one launch of all 1024 pages reaches about
 * 0.90x (page_probe.cu): a launch of 16 MiB spends a larger share of its time filling and
 * draining the GPU. PDL lets launch k+1's CTAs start while launch k's last ones run (the windows
 * are independent: disjoint pages, blocks only read). This probe times, per direction (fetch:
 * random pages into random blocks; publish: random blocks into random pages) and batch:
 *   - the copy engine on the same bytes, contiguous (ratio 1);
 *   - one launch of the 16-byte SM copy (a warp per 2 KiB chunk, 4 loads in flight, 4 CTAs of
 *     256 threads per SM: symkv's vec kernel's shape);
 *   - the same split into launches of 256 pages, plain, with an event recorded after each (as
 *     symkv's completion does), with PDL (each kernel lets its dependents launch when it starts),
 *     and with PDL and the events;
 *   - the split of 256, 256, 256, 192, 64 pages (a short last launch).
 * Each operation runs behind a gate kernel between events; median of REPS, fresh random lists
 * each repetition. Every split is first checked byte-exact, and PDL's stream order is checked:
 * with the first launch held back (one CTA sleeps 2 ms), the event after the last launch must
 * not complete before the first launch did.
 *
 *   nvcc -O3 -arch=sm_90 -std=c++17 -o split_probe bench/gpu/split_probe.cu && ./split_probe
 */
#include "probe.cuh"

#include <functional>
#include <string>

constexpr size_t PAGE = 64 << 10, SLAB = 32 << 10; /* a page: slab 0 (K), slab 1 (V) */
constexpr uint32_t NPOOL = 8192;
constexpr size_t POOL = (size_t)NPOOL * PAGE;   /* 512 MiB of pages */
constexpr size_t TENSOR = (size_t)NPOOL * SLAB; /* 256 MiB: 8192 blocks of 32 KiB */
constexpr int REPS = 15, WARM = 2, U = 4, THREADS = 256, PER_SM = 4;
constexpr uint32_t CH = 32 * U * 16, QS = SLAB / CH; /* 2 KiB chunks, 16 per slab */
constexpr uint32_t GOLD = 2654435761u;

__global__ void fill_pattern(uint32_t *p, size_t n) {
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    p[i] = (uint32_t)i * GOLD;
}

/* Pages [first, first + n) of a batch of `all`: lists pages[all], K blocks[all], V blocks[all].
 * PUBLISH: blocks -> pages, else pages -> blocks. pdl: let the dependent launch start now.
 * hold_ns: CTA 0 sleeps that long first (the order check); done: set once the CTA ends. */
template <bool PUBLISH>
__global__ void __launch_bounds__(THREADS)
    vec_copy(char *__restrict__ pool, char *__restrict__ kt, char *__restrict__ vt,
             const uint32_t *__restrict__ args, uint32_t all, uint32_t first, uint32_t n, int pdl,
             uint64_t hold_ns, volatile uint32_t *done) {
  if (pdl) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  if (hold_ns && blockIdx.x == 0 && threadIdx.x == 0) {
    uint64_t t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
      __nanosleep(1000);
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (t - t0 < hold_ns);
  }
  const uint32_t lane = threadIdx.x & 31, wpc = blockDim.x >> 5;
  const uint32_t nw = gridDim.x * wpc, items = 2 * n * QS;
  for (uint32_t it = blockIdx.x * wpc + (threadIdx.x >> 5); it < items; it += nw) {
    const uint32_t u = it / QS, c = it % QS, i = first + (u >> 1), t = u & 1;
    char *pg = pool + (size_t)args[i] * PAGE + t * SLAB + c * CH;
    char *bl = (t ? vt : kt) + (size_t)args[(1 + t) * all + i] * SLAB + c * CH;
    const uint4 *s = reinterpret_cast<const uint4 *>(PUBLISH ? bl : pg) + lane;
    uint4 *d = reinterpret_cast<uint4 *>(PUBLISH ? pg : bl) + lane;
    uint4 v[U];
#pragma unroll
    for (int k = 0; k < U; k++) v[k] = ld16<LD_NC>(s + k * 32);
#pragma unroll
    for (int k = 0; k < U; k++) d[k * 32] = v[k];
  }
  if (done) {
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence_system();
      atomicAdd((uint32_t *)done, 1u);
    }
  }
}

struct probe {
  gated_t g;
  char *pool, *kt, *vt;
  uint32_t *d; /* the lists on the device */
  int sms, grid_max;
  std::vector<uint32_t> h, perm[3];
  cudaEvent_t ev[64]; /* one after each launch of a split */
  uint64_t rng = 0x9e3779b97f4a7c15ull;
  uint64_t next() {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
  }
};

/* n distinct pages and n distinct blocks per tensor (partial Fisher-Yates), uploaded untimed. */
static void draw(probe &P, uint32_t n) {
  P.h.resize(3 * (size_t)n);
  for (int l = 0; l < 3; l++)
    for (uint32_t j = 0; j < n; j++) {
      std::swap(P.perm[l][j], P.perm[l][j + P.next() % (NPOOL - j)]);
      P.h[(size_t)l * n + j] = P.perm[l][j];
    }
  CK(cudaMemcpy(P.d, P.h.data(), P.h.size() * 4, cudaMemcpyHostToDevice));
}

/* One launch of pages [first, first + n) of the drawn batch of `all`; trigger: its kernel lets
 * its dependents launch when it starts; attr: it is launched as a dependent (PDL). */
static void launch(probe &P, bool publish, uint32_t all, uint32_t first, uint32_t n, bool trigger,
                   bool attr, uint64_t hold_ns = 0, uint32_t *done = nullptr) {
  const uint32_t warps = 2 * n * QS;
  const int grid =
      (int)std::min<uint64_t>((warps + THREADS / 32 - 1) / (THREADS / 32), (uint64_t)P.grid_max);
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(grid);
  cfg.blockDim = dim3(THREADS);
  cfg.stream = P.g.st;
  cudaLaunchAttribute at[1];
  at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  at[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = at;
  cfg.numAttrs = attr ? 1 : 0;
  if (publish)
    CK(cudaLaunchKernelEx(&cfg, vec_copy<true>, P.pool, P.kt, P.vt, (const uint32_t *)P.d, all,
                          first, n, trigger ? 1 : 0, hold_ns, (volatile uint32_t *)done));
  else
    CK(cudaLaunchKernelEx(&cfg, vec_copy<false>, P.pool, P.kt, P.vt, (const uint32_t *)P.d, all,
                          first, n, trigger ? 1 : 0, hold_ns, (volatile uint32_t *)done));
}

/* The batch of `all` pages in launches of sizes[], PDL on the launches after the first (the
 * first follows whatever the stream ran before: the engine's own kernels), an event after each
 * with `events`. */
static void split(probe &P, bool publish, uint32_t all, const std::vector<uint32_t> &sizes,
                  bool pdl, bool events) {
  uint32_t first = 0;
  for (size_t k = 0; k < sizes.size(); k++) {
    launch(P, publish, all, first, sizes[k], pdl, pdl && k > 0);
    if (events) CK(cudaEventRecord(P.ev[k], P.g.st));
    first += sizes[k];
  }
}

static std::vector<uint32_t> windows(uint32_t n, uint32_t w, uint32_t tail) {
  std::vector<uint32_t> v;
  for (uint32_t i = 0; i < n; i += w) v.push_back(std::min(w, n - i));
  if (tail && v.size() > 1 && v.back() > 2 * tail) {
    v.back() -= tail;
    v.push_back(tail);
  }
  return v;
}

struct row_t {
  std::string name;
  std::function<void(uint32_t)> op; /* enqueue the copy of the drawn batch of n pages */
};

static std::vector<row_t> rows_for(probe &P, bool publish) {
  std::vector<row_t> rows;
  rows.push_back(
      {"copy engine, one cudaMemcpyAsync, contiguous", [&P](uint32_t n) {
         CK(cudaMemcpyAsync(P.kt, P.pool, (size_t)n * PAGE, cudaMemcpyDeviceToDevice, P.g.st));
       }});
  rows.push_back(
      {"one launch", [&P, publish](uint32_t n) { launch(P, publish, n, 0, n, false, false); }});
  rows.push_back({"launches of 256", [&P, publish](uint32_t n) {
                    split(P, publish, n, windows(n, 256, 0), false, false);
                  }});
  rows.push_back({"launches of 256, an event after each", [&P, publish](uint32_t n) {
                    split(P, publish, n, windows(n, 256, 0), false, true);
                  }});
  rows.push_back({"launches of 256, PDL", [&P, publish](uint32_t n) {
                    split(P, publish, n, windows(n, 256, 0), true, false);
                  }});
  rows.push_back({"launches of 256, PDL, an event after each", [&P, publish](uint32_t n) {
                    split(P, publish, n, windows(n, 256, 0), true, true);
                  }});
  rows.push_back({"launches of 256 with a last one of 64, events", [&P, publish](uint32_t n) {
                    split(P, publish, n, windows(n, 256, 64), false, true);
                  }});
  rows.push_back({"launches of 256 with a last one of 64, PDL, events", [&P, publish](uint32_t n) {
                    split(P, publish, n, windows(n, 256, 64), true, true);
                  }});
  return rows;
}

/* Byte-exact: every page or block the batch wrote holds what it was copied from. */
static int check(probe &P, bool publish, uint32_t n, const row_t &r) {
  /* pages carry the pattern, blocks are poisoned; for publish the blocks get the pattern of
   * their own offsets and pages are poisoned */
  fill_pattern<<<P.sms * 4, 256>>>(reinterpret_cast<uint32_t *>(publish ? P.kt : P.pool),
                                   (publish ? 2 * TENSOR : POOL) / 4);
  CK(cudaMemset(publish ? P.pool : P.kt, 0xA5, publish ? POOL : 2 * TENSOR));
  CK(cudaDeviceSynchronize());
  draw(P, n);
  r.op(n);
  CK(cudaStreamSynchronize(P.g.st));
  std::vector<uint32_t> got(SLAB / 4);
  for (uint32_t i = 0; i < n; i++)
    for (uint32_t t = 0; t < 2; t++) {
      const size_t po = (size_t)P.h[i] * PAGE + t * SLAB;
      const size_t bo = (t ? TENSOR : 0) + (size_t)P.h[(1 + t) * n + i] * SLAB;
      CK(cudaMemcpy(got.data(), (publish ? P.pool + po : P.kt + bo), SLAB, cudaMemcpyDeviceToHost));
      const size_t src = (publish ? bo : po) / 4;
      for (uint32_t w = 0; w < SLAB / 4; w++)
        if (got[w] != (uint32_t)(src + w) * GOLD) {
          printf("CHECK FAILED: %s, %s, page %u slab %u word %u\n", publish ? "publish" : "fetch",
                 r.name.c_str(), i, t, w);
          return 1;
        }
    }
  return 0;
}

int main() {
  setvbuf(stdout, nullptr, _IOLBF, 0); /* lines as they come (a crash loses none) */
  probe P;
  CK(cudaSetDevice(0));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  P.sms = prop.multiProcessorCount;
  int occ = 0;
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, vec_copy<false>, THREADS, 0));
  P.grid_max = P.sms * std::min(PER_SM, occ);
  printf("GPU 0: %s, %d SMs; SM copy: %d x %d threads per SM, 2 KiB per warp\n", prop.name, P.sms,
         std::min(PER_SM, occ), THREADS);
  CK(cudaMalloc(&P.pool, POOL));
  CK(cudaMalloc(&P.kt, 2 * TENSOR));
  P.vt = P.kt + TENSOR;
  CK(cudaMalloc(&P.d, 3 * (size_t)NPOOL * 4));
  for (auto &p : P.perm) {
    p.resize(NPOOL);
    for (uint32_t j = 0; j < NPOOL; j++) p[j] = j;
  }
  gated_init(P.g);
  for (auto &e : P.ev) CK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));

  /* correctness, on 1024 pages, both directions, every row */
  for (bool publish : {false, true})
    for (const row_t &r : rows_for(P, publish))
      if (r.name.find("launch") != std::string::npos && check(P, publish, 1024, r)) return 1;
  printf("check ok (both directions, every split, 1024 pages, byte-exact)\n");

  /* PDL's stream order: the first launch held 2 ms; neither the event after it nor the one
   * after the last launch may complete before every CTA of the first launch ended */
  {
    uint32_t *done;
    CK(cudaHostAlloc((void **)&done, 64, cudaHostAllocMapped));
    draw(P, 1024);
    const auto w = windows(1024, 256, 0);
    const uint32_t warps = 2 * w[0] * QS;
    const uint32_t ctas = (uint32_t)std::min<uint64_t>((warps + 7) / 8, (uint64_t)P.grid_max);
    *done = 0;
    bool ordered = true;
    for (int which = 0; which < 2; which++) {
      *done = 0;
      launch(P, true, 1024, 0, w[0], true, false, 2000000ull, done);
      CK(cudaEventRecord(P.ev[0], P.g.st));
      for (size_t k = 1; k < w.size(); k++) {
        launch(P, true, 1024, 256 * (uint32_t)k, w[k], true, true);
        CK(cudaEventRecord(P.ev[k], P.g.st));
      }
      const cudaEvent_t e = which == 0 ? P.ev[0] : P.ev[w.size() - 1];
      CK(cudaEventSynchronize(e));
      const uint32_t seen = __atomic_load_n(done, __ATOMIC_SEQ_CST);
      printf("PDL order: when the event after the %s launch completed, %u of the first launch's "
             "%u CTAs had ended: %s\n",
             which == 0 ? "first" : "last", seen, ctas, seen == ctas ? "ok" : "NOT ORDERED");
      CK(cudaStreamSynchronize(P.g.st));
      ordered = ordered && seen == ctas;
    }
    if (!ordered) return 1;
  }

  for (bool publish : {false, true})
    for (uint32_t n : {256u, 1024u, 4096u}) {
      const std::vector<row_t> rows = rows_for(P, publish);
      char head[96];
      snprintf(head, sizeof head, "%s, %u pages x 64 KiB = %zu MiB, random",
               publish ? "publish (blocks -> pages)" : "fetch (pages -> blocks)", n,
               (size_t)n * PAGE >> 20);
      printf("\n%-60s %8s %6s\n", head, "GB/s", "ratio");
      double base = 0;
      for (const row_t &r : rows) {
        std::vector<double> v;
        for (int k = 0; k < WARM + REPS; k++) {
          draw(P, n);
          const double ms = gated_ms(P.g, [&] { r.op(n); });
          if (k >= WARM) v.push_back((double)n * PAGE / (ms * 1e-3) / 1e9);
        }
        const double gbs = median(v);
        if (base == 0) base = gbs;
        printf("%-60s %8.1f %6.2f\n", r.name.c_str(), gbs, gbs / base);
      }
    }
  return 0;
}
