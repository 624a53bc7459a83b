/* hnd_probe: the host copy of random 16 KiB pages into random engine blocks (symkv-bench micro's
 * fetch_host/{nhd,hnd}/16_KiB, without a cache or a second PE): symkv's skv__copy_page_to_blocks
 * into a vLLM FlashAttention NHD and HND layout, against one memcpy of the same bytes, and the HND
 * copy as it was before gather_lines (each block part transposed in L1, then streamed out whole),
 * in one process, alternated, medians of 15 repetitions.
 *
 *   symkv-hnd-probe [rounds, default 3] [huge]
 *
 * "huge": every buffer (the pages, the engine's blocks, memcpy's destination) on 2 MiB
 * transparent huge pages (MADV_HUGEPAGE, taken where /sys/kernel/mm/transparent_hugepage/enabled
 * is "madvise" or "always"), as a node with huge pages for shared memory gives symkv's host heap
 * and an engine its CPU cache (PyTorch: THP_MEM_ALLOC_ENABLE=1): no TLB miss per 4 KiB part.
 *
 * The geometry is micro's: 2 layers x K|V, 16 tokens, 8 heads, head_dim 16 (bf16): a page's part
 * of a block is 16 x 8 rows of 32 bytes, 4 KiB (bench/results/gather_lines_2core-vm.txt). */
#define _GNU_SOURCE
#include <emmintrin.h>
#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "kv/layout.h"
#include "probe.h"

enum {
  T = 16,
  H = 8,
  D = 16,
  E = 2,
  ROW = D * E,
  PART = T * H * ROW,
  NTENS = 4,
  PAGE = NTENS * PART
};
enum { NPAGES = 4096, POOL = NPAGES + 64, NB = 2 * NPAGES, REPS = 15 };

static bool huge;

static void *xalloc(size_t n) {
  void *p = NULL;
  if (posix_memalign(&p, huge ? 2 << 20 : 4096, n) != 0) {
    fprintf(stderr, "hnd_probe: out of memory (%zu bytes)\n", n);
    exit(1);
  }
  if (huge && madvise(p, n, MADV_HUGEPAGE) != 0) {
    fprintf(stderr, "hnd_probe: madvise(MADV_HUGEPAGE): %s\n", strerror(errno));
    exit(1);
  }
  memset(p, 1, n);
  return p;
}

/* The HND copy before gather_lines: the part transposed into an L1 buffer (the next part
 * prefetched a token ahead), then streamed out with non-temporal stores. */
static void before_part(char *d, const char *s) {
  _Alignas(64) char tmp[PART];
  const char *p = s;
  for (int t = 0; t < T; t++, p += H * ROW) {
    for (int o = 0; o < H * ROW; o += 64) __builtin_prefetch(p + PART + o);
    for (int h = 0; h < H; h++) memcpy(tmp + (h * T + t) * ROW, p + h * ROW, ROW);
  }
  for (int o = 0; o < PART; o += 64) {
    __builtin_prefetch(tmp + o + 1024);
    for (int v = 0; v < 64; v += 16)
      _mm_stream_si128((__m128i *)(d + o + v), _mm_load_si128((const __m128i *)(tmp + o + v)));
  }
}

/* This process's anonymous memory on huge pages, in MiB (/proc/self/smaps_rollup), or -1. */
static long anon_huge_mib(void) {
  FILE *f = fopen("/proc/self/smaps_rollup", "r");
  if (!f) return -1;
  char line[256];
  long kb = -1;
  while (fgets(line, sizeof line, f))
    if (sscanf(line, "AnonHugePages: %ld kB", &kb) == 1) break;
  fclose(f);
  return kb < 0 ? -1 : kb >> 10;
}

int main(int argc, char **argv) {
  const long rounds = argc > 1 ? strtol(argv[1], NULL, 10) : 3;
  huge = argc > 2 && strcmp(argv[2], "huge") == 0;
  if (rounds < 1 || rounds > 100 || (argc > 2 && !huge) || argc > 3) {
    fprintf(stderr, "usage: %s [rounds (1..100)] [huge]\n", argv[0]);
    return 2;
  }
  skv_geometry_t g = SKV_GEOMETRY_INIT;
  g.kv_kind = SKV_KV_SPLIT;
  g.num_layers = 2;
  g.num_kv_heads = H;
  g.head_dim = D;
  g.elem_bytes = E;
  g.page_tokens = T;
  const int presets[2] = {SKV_LAYOUT_VLLM_FLASH_NHD, SKV_LAYOUT_VLLM_FLASH_HND};
  skv_layout_t *lay[2];
  char *eng[2][2];
  uint64_t lb = 0;
  for (int p = 0; p < 2; p++) {
    if (skv_layout_get_preset_layer_bytes(&g, presets[p], T, NB, &lb) != 0) return 1;
    void *ptrs[2];
    for (int l = 0; l < 2; l++) ptrs[l] = eng[p][l] = xalloc(lb);
    if (skv_layout_create_preset(&g, presets[p], T, NB, ptrs, -1, &lay[p]) != 0) {
      fprintf(stderr, "hnd_probe: %s\n", skv_last_error());
      return 1;
    }
  }
  char *pool = xalloc((size_t)POOL * PAGE), *dst = xalloc((size_t)NPAGES * PAGE);
  uint32_t *pg = malloc(NPAGES * sizeof *pg);
  uint64_t *blk = malloc(NPAGES * sizeof *blk), s = 7;
  if (!pg || !blk) return 1;
  for (uint32_t i = 0; i < NPAGES; i++) pg[i] = i, blk[i] = (i * 2 + (probe_rand(&s) & 1)) % NB;
  for (uint32_t i = NPAGES - 1; i > 0; i--) {
    const uint32_t j = (uint32_t)(probe_rand(&s) % (i + 1)), t = pg[i];
    pg[i] = pg[j], pg[j] = t;
  }
  static const char *names[] = {"memcpy of the same bytes", "nhd (skv__copy_page_to_blocks)",
                                "hnd (skv__copy_page_to_blocks)", "hnd, transposed in L1 (before)"};
  printf("%d pages of %d KiB, random, into random blocks of %d; medians of %d; ", NPAGES,
         PAGE >> 10, NB, REPS);
  if (huge) /* the kernel may not give them (transparent_hugepage/enabled "never"): say what came */
    printf("2 MiB (MADV_HUGEPAGE; %ld MiB of the buffers on huge pages) pages\n", anon_huge_mib());
  else
    printf("4 KiB pages\n");
  for (long r = 0; r < rounds; r++) {
    double gbps[4];
    for (int v = 0; v < 4; v++) {
      double ts[REPS];
      for (int k = 0; k < REPS; k++) {
        const double t0 = probe_now();
        if (v == 0) {
          memcpy(dst, pool, (size_t)NPAGES * PAGE);
        } else {
          for (uint32_t i = 0; i < NPAGES; i++) {
            const char *page = pool + (size_t)pg[i] * PAGE;
            if (v < 3) { /* as skv_kv_fetch's host copy: the next page's first lines prefetched */
              if (i + 1 < NPAGES)
                skv__copy_page_prefetch(lay[v - 1], pool + (size_t)pg[i + 1] * PAGE, &blk[i + 1]);
              skv__copy_page_to_blocks(lay[v - 1], page, &blk[i], true);
              continue;
            }
            for (int q = 0; q < NTENS; q++) /* layer q / 2, K or V: (2, NB, H, T, D) a layer */
              before_part(eng[1][q / 2] + ((size_t)(q % 2) * NB + blk[i]) * PART, page + q * PART);
          }
          skv__copy_stream_fence();
        }
        ts[k] = probe_now() - t0;
      }
      qsort(ts, REPS, sizeof *ts, probe_cmp_double);
      gbps[v] = (double)NPAGES * PAGE / ts[REPS / 2] / 1e9;
    }
    for (int v = 0; v < 4; v++)
      printf("round %ld  %-34s %6.2f GB/s  %.3f\n", r, names[v], gbps[v], gbps[v] / gbps[0]);
  }
  for (int p = 0; p < 2; p++) {
    skv_layout_destroy(lay[p]);
    for (int l = 0; l < 2; l++) free(eng[p][l]);
  }
  free(pool);
  free(dst);
  free(pg);
  free(blk);
  return 0;
}
