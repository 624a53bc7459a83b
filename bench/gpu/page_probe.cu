/* page_probe: is a local gather of random pages slower than a contiguous copy because of the
 * pattern or because of the kernel's configuration? One GPU (device 0).
 *
 * symkv's local fetch (TMA bulk: per warp 4 stages of 8 KiB, 4 warps per CTA, 1 CTA per SM,
 * consecutive warps take consecutive 8 KiB chunks, grid-stride over the items) copies random
 * 64 KiB pages into random engine blocks at ~0.75x of one contiguous cudaMemcpyAsync of the same
 * bytes for batches of 1-64 MiB, ~0.93x at 1 GiB. This probe redoes that copy with plain CUDA
 * (no symkv): a 512 MiB pool of 8192 pages (a page = a K and a V slab of 32 KiB) gathered into
 * two 256 MiB layer tensors of 32 KiB blocks, a page's slab t going to a random block of tensor
 * t (pages and blocks distinct within a batch, drawn afresh each repetition). Per batch of 16,
 * 256, 1024 and 8192 pages it times:
 *   - the copy engine on the same bytes, contiguous (the baseline: ratio 1), and per slab;
 *   - the TMA gather over warps, stages, chunk sizes and item orders (interleaved as symkv's,
 *     or slab-major: a warp takes whole slabs), with as many CTAs per SM as shared memory allows
 *     (1 to 4), and symkv's configuration on fewer CTAs (fewer bytes in flight);
 *   - symkv's configuration on a contiguous pattern (pages 0, 1, 2... into blocks 0, 1, 2...);
 *   - symkv's configuration with its lists copied to the GPU first in the timed region (what
 *     symkv's fetch did for lists over 3456 bytes), or carried in 12 KiB of kernel parameters;
 *   - SM loads (16-byte vectors, a warp per chunk) on the random pattern, and contiguous.
 * Then the copy engine and symkv's three ways of passing the lists on an idle GPU, timed on the
 * host from the enqueue to cudaStreamSynchronize (launch latency included).
 * Each operation runs behind a gate kernel between events (the lists are uploaded before,
 * untimed); median of REPS, GB/s of bytes copied, ratio to the copy engine row of the batch.
 * Every gather is first checked byte-exact on a 256-page batch (pool filled with a pattern of
 * its addresses, blocks poisoned); a mismatch ends the probe with status 1.
 *
 *   nvcc -O3 -arch=sm_90 -std=c++17 -o page_probe bench/gpu/page_probe.cu && ./page_probe
 */
#include "probe.cuh"

#include <chrono>
#include <functional>
#include <string>

constexpr size_t PAGE = 64 << 10, SLAB = 32 << 10; /* a page: slab 0 (K), slab 1 (V) */
constexpr uint32_t SLAB_SHIFT = 15;
constexpr uint32_t NPOOL = 8192;                /* pages in the pool */
constexpr size_t POOL = (size_t)NPOOL * PAGE;   /* 512 MiB */
constexpr size_t TENSOR = (size_t)NPOOL * SLAB; /* 256 MiB: 8192 blocks of 32 KiB */
constexpr int REPS = 15, WARM = 2, MAXW = 8;    /* MAXW: warps per CTA at most */
constexpr uint32_t GOLD = 2654435761u;          /* pool word w holds w * GOLD */

/* ---- kernels ---- */

__global__ void fill_pattern(uint32_t *p, size_t n) {
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    p[i] = (uint32_t)i * GOLD;
}

/* TMA gather. args: pages[n], K blocks[n], V blocks[n]. Items (page i, tensor t, chunk c) of
 * C = 1 << cshift bytes, numbered (2i + t) * (SLAB / C) + c. Lane 0 of each warp runs a pipeline
 * of S shared buffers: cp.async.bulk global -> shared (mbarrier), then shared -> global (bulk
 * group, read by the engine before the buffer is reused), as tma_copy in bandwidth_probe.cu.
 * Interleaved: warp gw takes items gw, gw + nw, ...; slab-major: slabs gw, gw + nw, ... each
 * chunk after chunk. */
template <int S, bool SLAB_MAJOR>
__device__ __forceinline__ void tma_body(const char *__restrict__ pool, char *__restrict__ kt,
                                         char *__restrict__ vt, const uint32_t *__restrict__ args,
                                         uint32_t n, uint32_t cshift, uint8_t *sm, uint64_t *bars) {
  const uint32_t lane = threadIdx.x & 31, wid = threadIdx.x >> 5, wpc = blockDim.x >> 5;
  const uint64_t nw = (uint64_t)gridDim.x * wpc, gw = (uint64_t)blockIdx.x * wpc + wid;
  const uint32_t C = 1u << cshift, qs = SLAB_SHIFT - cshift, qm = (1u << qs) - 1;
  const uint64_t slabs = 2ull * n, items = slabs << qs;
  uint8_t *buf = sm + (size_t)wid * S * C;
  uint64_t *bar = bars + wid * S;
  if (lane != 0) return;
  /* the warp's k-th item, ~0 past its last */
  auto item = [&](uint64_t k) -> uint64_t {
    if constexpr (SLAB_MAJOR) {
      const uint64_t sl = gw + (k >> qs) * nw;
      return sl < slabs ? (sl << qs) | (k & qm) : ~0ull;
    } else {
      const uint64_t it = gw + k * nw;
      return it < items ? it : ~0ull;
    }
  };
  auto issue = [&](uint64_t it, int st) {
    const uint64_t u = it >> qs, c = it & qm;
    const char *s = pool + (size_t)args[u >> 1] * PAGE + (u & 1) * SLAB + (c << cshift);
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(su32(&bar[st])),
                 "r"(C)
                 : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], "
                 "%2, [%3];" ::"r"(su32(buf + (size_t)st * C)),
                 "l"(s), "r"(C), "r"(su32(&bar[st]))
                 : "memory");
  };
  for (int k = 0; k < S; k++)
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(su32(&bar[k])) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  for (int k = 0; k < S; k++) {
    const uint64_t it = item(k);
    if (it != ~0ull) issue(it, k);
  }
  uint32_t phase = 0;
  for (uint64_t k = 0;; k++) {
    const uint64_t it = item(k);
    if (it == ~0ull) break;
    const int st = (int)(k % S);
    const uint64_t u = it >> qs, c = it & qm;
    char *d =
        ((u & 1) ? vt : kt) + (size_t)args[(1 + (u & 1)) * n + (u >> 1)] * SLAB + (c << cshift);
    mbar_wait(&bar[st], (phase >> st) & 1u);
    phase ^= 1u << st;
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(d),
                 "r"(su32(buf + (size_t)st * C)), "r"(C)
                 : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
    const uint64_t next = item(k + S);
    if (next != ~0ull) issue(next, st);
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

template <int S, bool SLAB_MAJOR>
__global__ void __launch_bounds__(MAXW * 32)
    tma_gather(const char *__restrict__ pool, char *__restrict__ kt, char *__restrict__ vt,
               const uint32_t *__restrict__ args, uint32_t n, uint32_t cshift) {
  extern __shared__ __align__(128) uint8_t sm[];
  __shared__ uint64_t bars[MAXW * S];
  tma_body<S, SLAB_MAJOR>(pool, kt, vt, args, n, cshift, sm, bars);
}

/* symkv's configuration with the lists in the kernel's parameters (up to 32 KiB since CUDA
 * 12.1): nothing to copy to the GPU before the kernel. */
constexpr uint32_t PARAM_PAGES = 1024;
struct gather_params_t {
  const char *pool;
  char *kt, *vt;
  uint32_t n, cshift;
  uint32_t args[3 * PARAM_PAGES];
};
__global__ void __launch_bounds__(MAXW * 32)
    tma_gather_params(const __grid_constant__ gather_params_t p) {
  extern __shared__ __align__(128) uint8_t sm[];
  __shared__ uint64_t bars[MAXW * 4];
  tma_body<4, false>(p.pool, p.kt, p.vt, p.args, p.n, p.cshift, sm, bars);
}

/* SM gather: a warp copies a chunk of 32 x U 16-byte vectors per item (lane l: vectors k*32 + l),
 * U loads in flight per lane before its stores; items interleaved over the grid. */
template <int U>
__global__ void __launch_bounds__(256)
    vec_gather(const char *__restrict__ pool, char *__restrict__ kt, char *__restrict__ vt,
               const uint32_t *__restrict__ args, uint32_t n) {
  constexpr uint32_t CH = 32 * U * 16, QS = SLAB / CH;
  const uint32_t lane = threadIdx.x & 31, wpc = blockDim.x >> 5;
  const uint32_t nw = gridDim.x * wpc, items = 2 * n * QS;
  for (uint32_t it = blockIdx.x * wpc + (threadIdx.x >> 5); it < items; it += nw) {
    const uint32_t u = it / QS, c = it % QS, i = u >> 1, t = u & 1;
    const uint4 *s =
        reinterpret_cast<const uint4 *>(pool + (size_t)args[i] * PAGE + t * SLAB + c * CH) + lane;
    uint4 *d =
        reinterpret_cast<uint4 *>((t ? vt : kt) + (size_t)args[(1 + t) * n + i] * SLAB + c * CH) +
        lane;
    uint4 v[U];
#pragma unroll
    for (int k = 0; k < U; k++) v[k] = ld16<LD_NC>(s + k * 32);
#pragma unroll
    for (int k = 0; k < U; k++) d[k * 32] = v[k];
  }
}

/* ---- host ---- */

typedef void (*tma_fn_t)(const char *, char *, char *, const uint32_t *, uint32_t, uint32_t);

static tma_fn_t tma_fn(int S, bool slab_major) {
  if (slab_major)
    return S == 1 ? tma_gather<1, true> : S == 2 ? tma_gather<2, true> : tma_gather<4, true>;
  return S == 1 ? tma_gather<1, false> : S == 2 ? tma_gather<2, false> : tma_gather<4, false>;
}

/* A batch: n pages, lists pages[n], K blocks[n], V blocks[n] on the host (h) and device (d). */
struct batch_t {
  uint32_t n = 0;
  std::vector<uint32_t> h;
  uint32_t *d = nullptr;
  size_t off = 0; /* source of the contiguous rows: a random page-aligned offset in the pool */
};

struct probe {
  gated_t g;
  char *pool, *kt, *vt; /* vt = kt + TENSOR: one allocation, so a 512 MiB contiguous copy fits */
  int sms, optin;
  uint32_t *hpin, *dstage;       /* pinned host lists and their device copy (the H2D row) */
  batch_t rnd, seq;              /* random lists (fresh each rep), 0, 1, 2, ... */
  std::vector<uint32_t> perm[3]; /* pages, K blocks, V blocks: shuffled in place */
  uint64_t rng = 0x9e3779b97f4a7c15ull;
  uint64_t next() {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
  }
};

/* Draw n distinct pages and n distinct blocks per tensor (partial Fisher-Yates) and a contiguous
 * source offset; upload the lists (untimed). */
static void draw(probe &P, uint32_t n) {
  batch_t &b = P.rnd;
  b.n = n;
  b.h.resize(3 * (size_t)n);
  for (int l = 0; l < 3; l++) {
    std::vector<uint32_t> &p = P.perm[l];
    for (uint32_t j = 0; j < n; j++) {
      std::swap(p[j], p[j + P.next() % (NPOOL - j)]);
      b.h[(size_t)l * n + j] = p[j];
    }
  }
  b.off = (size_t)(P.next() % (NPOOL - n + 1)) * PAGE;
  CK(cudaMemcpyAsync(b.d, b.h.data(), b.h.size() * 4, cudaMemcpyHostToDevice, P.g.st));
  CK(cudaStreamSynchronize(P.g.st));
}

static void make_seq(probe &P, uint32_t n) {
  batch_t &b = P.seq;
  b.n = n;
  b.h.resize(3 * (size_t)n);
  for (uint32_t j = 0; j < 3 * n; j++) b.h[j] = j % n;
  CK(cudaMemcpy(b.d, b.h.data(), b.h.size() * 4, cudaMemcpyHostToDevice));
}

/* A row: what it enqueues on P.g.st for a batch; seq: on the contiguous lists; check: a gather
 * to verify; na: why it cannot run (not timed). */
struct row_t {
  std::string name;
  std::function<void(const batch_t &)> op;
  bool seq = false, check = false;
  std::string na;
};

struct tma_cfg_t {
  int w, s;
  uint32_t c;
};

static uint32_t log2u(uint32_t v) {
  return 31u - (uint32_t)__builtin_clz(v);
}

/* The TMA rows: every configuration in both orders, then symkv's on fewer CTAs and on the
 * contiguous pattern. */
static void tma_rows(probe &P, uint32_t n, std::vector<row_t> &rows) {
  static const tma_cfg_t cfgs[] = {{4, 4, 8192},  {4, 2, 8192}, {4, 1, 8192},  {2, 4, 8192},
                                   {1, 4, 8192},  {4, 4, 4096}, {4, 2, 16384}, {8, 2, 8192},
                                   {2, 2, 16384}, {4, 4, 16384}};
  char name[128];
  for (bool sm : {false, true})
    for (const tma_cfg_t &c : cfgs) {
      const tma_fn_t fn = tma_fn(c.s, sm);
      const size_t smem = (size_t)c.w * c.s * c.c;
      cudaFuncAttributes fa;
      CK(cudaFuncGetAttributes(&fa, (const void *)fn));
      const bool symkv = c.w == 4 && c.s == 4 && c.c == 8192 && !sm;
      row_t r;
      int occ = 0;
      if (smem + fa.sharedSizeBytes <= (size_t)P.optin)
        CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, (const void *)fn, c.w * 32, smem));
      const int per_sm = std::min(occ, 4);
      snprintf(name, sizeof name, "TMA %dw x %d x %uK, %s, %d CTA/SM (%zuK/SM)%s", c.w, c.s,
               c.c >> 10, sm ? "slab-major" : "interleaved", per_sm, per_sm * smem >> 10,
               symkv ? " [symkv]" : "");
      r.name = name;
      if (per_sm < 1) {
        snprintf(name, sizeof name, "TMA %dw x %d x %uK, %s", c.w, c.s, c.c >> 10,
                 sm ? "slab-major" : "interleaved");
        r.name = name;
        snprintf(name, sizeof name, "%zu KiB of shared memory per CTA does not fit", smem >> 10);
        r.na = name;
      }
      const uint64_t units = sm ? 2ull * n : 2ull * n * (SLAB / c.c); /* per warp */
      const int grid = (int)std::min<uint64_t>((units + c.w - 1) / c.w, (uint64_t)P.sms * per_sm);
      const uint32_t cs = log2u(c.c);
      r.op = [&P, fn, c, smem, grid, cs](const batch_t &b) {
        fn<<<grid, c.w * 32, smem, P.g.st>>>(P.pool, P.kt, P.vt, b.d, b.n, cs);
      };
      r.check = true;
      rows.push_back(r);
    }
  /* symkv's configuration: fewer CTAs, then the contiguous pattern */
  const tma_fn_t fn = tma_fn(4, false);
  const size_t smem = 4 * 4 * 8192;
  const uint64_t units = 2ull * n * (SLAB / 8192);
  for (int div : {1, 2, 4}) {
    const int grid = (int)std::min<uint64_t>((units + 3) / 4, (uint64_t)P.sms / div);
    row_t r;
    snprintf(name, sizeof name, "TMA 4w x 4 x 8K, interleaved, %d CTAs (SMs/%d)", grid, div);
    r.name = name;
    r.op = [&P, fn, smem, grid](const batch_t &b) {
      fn<<<grid, 128, smem, P.g.st>>>(P.pool, P.kt, P.vt, b.d, b.n, 13);
    };
    r.check = true;
    rows.push_back(r);
  }
  {
    const int grid = (int)std::min<uint64_t>((units + 3) / 4, (uint64_t)P.sms);
    row_t r;
    r.name = "TMA 4w x 4 x 8K, interleaved, 1 CTA/SM, contiguous pattern";
    r.op = [&P, fn, smem, grid](const batch_t &b) {
      fn<<<grid, 128, smem, P.g.st>>>(P.pool, P.kt, P.vt, b.d, b.n, 13);
    };
    r.seq = r.check = true;
    rows.push_back(r);
  }
}

static std::vector<row_t> rows_for(probe &P, uint32_t n) {
  std::vector<row_t> rows;
  const size_t bytes = (size_t)n * PAGE;
  char name[128];
  row_t r;
  r.name = "copy engine, one cudaMemcpyAsync, contiguous";
  r.op = [&P, bytes](const batch_t &b) {
    CK(cudaMemcpyAsync(P.kt, P.pool + b.off, bytes, cudaMemcpyDeviceToDevice, P.g.st));
  };
  rows.push_back(r);
  r = row_t();
  r.name = "copy engine, one cudaMemcpyAsync per 32 KiB slab";
  if (n <= 1024) {
    r.op = [&P](const batch_t &b) {
      for (uint32_t i = 0; i < b.n; i++)
        for (uint32_t t = 0; t < 2; t++)
          CK(cudaMemcpyAsync((t ? P.vt : P.kt) + (size_t)b.h[(1 + t) * b.n + i] * SLAB,
                             P.pool + (size_t)b.h[i] * PAGE + t * SLAB, SLAB,
                             cudaMemcpyDeviceToDevice, P.g.st));
    };
    r.check = true;
  } else {
    r.na = "skipped (host enqueue time)";
  }
  rows.push_back(r);
  tma_rows(P, n, rows);
  {
    /* symkv's configuration with the lists copied to the GPU in the timed region (as symkv's
     * fetch does for lists over its 3.7 KiB of inline parameters), or in the parameters */
    const int grid = (int)std::min<uint64_t>((2ull * n * 4 + 3) / 4, (uint64_t)P.sms);
    const tma_fn_t fn = tma_fn(4, false);
    r = row_t();
    snprintf(name, sizeof name, "TMA [symkv] + lists copied H2D first (%u B, pinned)", 12 * n);
    r.name = name;
    r.op = [&P, fn, grid](const batch_t &b) {
      memcpy(P.hpin, b.h.data(), b.h.size() * 4);
      CK(cudaMemcpyAsync(P.dstage, P.hpin, b.h.size() * 4, cudaMemcpyHostToDevice, P.g.st));
      fn<<<grid, 128, 4 * 4 * 8192, P.g.st>>>(P.pool, P.kt, P.vt, P.dstage, b.n, 13);
    };
    r.check = true;
    rows.push_back(r);
    r = row_t();
    snprintf(name, sizeof name, "TMA [symkv], lists in the kernel's parameters (%zu B)",
             sizeof(gather_params_t));
    r.name = name;
    if (n <= PARAM_PAGES) {
      r.op = [&P, grid](const batch_t &b) {
        static gather_params_t prm;
        prm.pool = P.pool, prm.kt = P.kt, prm.vt = P.vt, prm.n = b.n, prm.cshift = 13;
        memcpy(prm.args, b.h.data(), b.h.size() * 4);
        void *a[] = {&prm};
        CK(cudaLaunchKernel((const void *)tma_gather_params, dim3(grid), dim3(128), a, 4 * 4 * 8192,
                            P.g.st));
      };
      r.check = true;
    } else {
      r.na = "over the parameters' 32 KiB";
    }
    rows.push_back(r);
  }
  for (int U : {4, 8})
    for (int per_sm : {2, 4, 8}) {
      int occ = 0;
      const void *fn = U == 4 ? (const void *)vec_gather<4> : (const void *)vec_gather<8>;
      CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, fn, 256, 0));
      const int res = std::min(per_sm, occ);
      const uint64_t warps = 2ull * n * (SLAB / (512 * U));
      const int grid = (int)std::min<uint64_t>((warps + 7) / 8, (uint64_t)P.sms * res);
      r = row_t();
      snprintf(name, sizeof name, "SM gather U%d (%u B/warp), %d x 256 thr/SM%s", U, 512 * U,
               per_sm, res < per_sm ? " (fewer resident)" : "");
      r.name = name;
      r.op = [&P, U, grid](const batch_t &b) {
        if (U == 4)
          vec_gather<4><<<grid, 256, 0, P.g.st>>>(P.pool, P.kt, P.vt, b.d, b.n);
        else
          vec_gather<8><<<grid, 256, 0, P.g.st>>>(P.pool, P.kt, P.vt, b.d, b.n);
      };
      r.check = true;
      rows.push_back(r);
    }
  r = row_t();
  r.name = "SM loads stream_copy U4, 4 x 256 thr/SM, contiguous";
  r.op = [&P, bytes](const batch_t &b) {
    stream_copy<4, LD_NC>
        <<<P.sms * 4, 256, 0, P.g.st>>>(reinterpret_cast<const uint4 *>(P.pool + b.off),
                                        reinterpret_cast<uint4 *>(P.kt), bytes / 16);
  };
  rows.push_back(r);
  r = rows[0];
  r.name = "copy engine again (drift check)";
  rows.push_back(r);
  return rows;
}

/* Run a gather once on poisoned blocks and compare every slab it wrote with the pool pattern. */
static void check(probe &P, const row_t &r, uint32_t n) {
  if (!r.seq) draw(P, n);
  const batch_t &b = r.seq ? P.seq : P.rnd;
  CK(cudaMemset(P.kt, 0xA5, 2 * TENSOR));
  CK(cudaDeviceSynchronize());
  r.op(b);
  CK(cudaGetLastError());
  CK(cudaStreamSynchronize(P.g.st));
  std::vector<uint32_t> got(SLAB / 4);
  for (uint32_t i = 0; i < n; i++)
    for (uint32_t t = 0; t < 2; t++) {
      CK(cudaMemcpy(got.data(), (t ? P.vt : P.kt) + (size_t)b.h[(1 + t) * n + i] * SLAB, SLAB,
                    cudaMemcpyDeviceToHost));
      const size_t w0 = ((size_t)b.h[i] * PAGE + t * SLAB) / 4;
      for (size_t j = 0; j < SLAB / 4; j++)
        if (got[j] != (uint32_t)(w0 + j) * GOLD) {
          printf("check FAILED: %s: page %u (list %u), tensor %u, block %u, byte %zu: "
                 "0x%08x, expected 0x%08x\n",
                 r.name.c_str(), b.h[i], i, t, b.h[(1 + t) * n + i], j * 4, got[j],
                 (uint32_t)(w0 + j) * GOLD);
          exit(1);
        }
    }
}

int main() {
  probe P;
  CK(cudaSetDevice(0));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  P.sms = prop.multiProcessorCount;
  P.optin = (int)prop.sharedMemPerBlockOptin;
  printf("GPU 0: %s, %d SMs, %zu KiB L2\n", prop.name, P.sms, (size_t)prop.l2CacheSize >> 10);
  CK(cudaMalloc(&P.pool, POOL));
  CK(cudaMalloc(&P.kt, 2 * TENSOR));
  P.vt = P.kt + TENSOR;
  CK(cudaMalloc(&P.rnd.d, 3 * (size_t)NPOOL * 4));
  CK(cudaMalloc(&P.seq.d, 3 * (size_t)NPOOL * 4));
  CK(cudaMalloc(&P.dstage, 3 * (size_t)NPOOL * 4));
  CK(cudaHostAlloc((void **)&P.hpin, 3 * (size_t)NPOOL * 4, cudaHostAllocDefault));
  for (auto &p : P.perm) {
    p.resize(NPOOL);
    for (uint32_t j = 0; j < NPOOL; j++) p[j] = j;
  }
  gated_init(P.g);
  for (int S : {1, 2, 4})
    for (bool sm : {false, true}) {
      const tma_fn_t fn = tma_fn(S, sm);
      cudaFuncAttributes fa;
      CK(cudaFuncGetAttributes(&fa, (const void *)fn));
      CK(cudaFuncSetAttribute((const void *)fn, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              P.optin - (int)fa.sharedSizeBytes));
    }
  CK(cudaFuncSetAttribute((const void *)tma_gather_params,
                          cudaFuncAttributeMaxDynamicSharedMemorySize, 4 * 4 * 8192));
  fill_pattern<<<P.sms * 4, 256>>>(reinterpret_cast<uint32_t *>(P.pool), POOL / 4);
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());

  /* correctness first, on 256 pages (the timing then runs on the patterned pool) */
  int nchk = 0;
  make_seq(P, 256);
  for (const row_t &r : rows_for(P, 256))
    if (r.check && r.na.empty()) {
      check(P, r, 256);
      nchk++;
    }
  printf("check ok (%d gathers, 256 pages, byte-exact)\n", nchk);

  for (uint32_t n : {16u, 256u, 1024u, NPOOL}) {
    make_seq(P, n);
    const std::vector<row_t> rows = rows_for(P, n);
    char head[96];
    snprintf(head, sizeof head, "%u pages x 64 KiB = %zu MiB, random", n, (size_t)n * PAGE >> 20);
    printf("\n%-66s %8s %6s\n", head, "GB/s", "ratio");
    double base = 0;
    for (const row_t &r : rows) {
      if (!r.na.empty()) {
        printf("%-66s %s\n", r.name.c_str(), r.na.c_str());
        continue;
      }
      std::vector<double> v;
      for (int k = 0; k < WARM + REPS; k++) {
        draw(P, n);
        const batch_t &b = r.seq ? P.seq : P.rnd;
        const double ms = gated_ms(P.g, [&] { r.op(b); });
        if (k >= WARM) v.push_back((double)n * PAGE / (ms * 1e-3) / 1e9);
      }
      const double gbs = median(v);
      if (base == 0) base = gbs;
      printf("%-66s %8.1f %6.2f\n", r.name.c_str(), gbs, gbs / base);
    }
  }

  /* The same gathers on an idle GPU, timed on the host from the enqueue to the stream's
   * synchronisation: what a caller waiting for one fetch sees, launch latency included. */
  for (uint32_t n : {16u, 1024u}) {
    make_seq(P, n);
    std::vector<row_t> rows = rows_for(P, n);
    char head[96];
    snprintf(head, sizeof head, "%u pages x 64 KiB, random, idle GPU, wall", n);
    printf("\n%-66s %8s %6s\n", head, "us", "ratio");
    double base = 0;
    for (const row_t &r : rows) {
      if (!r.na.empty() || r.name.find("TMA") != 0 || r.name.find("[symkv]") == std::string::npos)
        if (&r != &rows[0]) continue;
      std::vector<double> v;
      for (int k = 0; k < WARM + REPS; k++) {
        draw(P, n);
        CK(cudaDeviceSynchronize());
        const auto t0 = std::chrono::steady_clock::now();
        r.op(P.rnd);
        CK(cudaStreamSynchronize(P.g.st));
        const auto t1 = std::chrono::steady_clock::now();
        if (k >= WARM) v.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
      }
      const double us = median(v);
      if (base == 0) base = us;
      printf("%-66s %8.1f %6.2f\n", r.name.c_str(), us, us / base);
    }
  }
  return 0;
}
