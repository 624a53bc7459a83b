/* Host copy between a page ([layer][k|v][token][head][dim], contiguous) and the engine blocks a
 * layout describes: whole blocks, whole tokens or head_dim rows, whichever the strides allow. */
#include "kv/layout.h"

#include <inttypes.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#if defined(__GNUC__)
#define SKV_ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define SKV_ALWAYS_INLINE inline
#endif

/* Copy with non-temporal stores: large copies that will not be read again soon skip the
 * read-for-ownership of every destination line (a third of the traffic of ordinary stores),
 * as glibc's memcpy does for large sizes. Runs under 256 bytes use ordinary stores. */
static void copy_stream(char *restrict d, const char *restrict s, size_t n) {
#if defined(__SSE2__)
  if (n >= 256) {
    size_t head = (16 - ((uintptr_t)d & 15)) & 15;
    memcpy(d, s, head);
    d += head, s += head, n -= head;
    const bool long_run = n >= 2048; /* prefetch the source ahead, as glibc's large memcpy does */
    for (; n >= 64; n -= 64, d += 64, s += 64) {
      if (long_run) __builtin_prefetch(s + 1024); /* past the run too: a page is contiguous */
      __m128i a = _mm_loadu_si128((const __m128i *)s),
              b = _mm_loadu_si128((const __m128i *)(s + 16));
      __m128i c = _mm_loadu_si128((const __m128i *)(s + 32)),
              e = _mm_loadu_si128((const __m128i *)(s + 48));
      _mm_stream_si128((__m128i *)d, a);
      _mm_stream_si128((__m128i *)(d + 16), b);
      _mm_stream_si128((__m128i *)(d + 32), c);
      _mm_stream_si128((__m128i *)(d + 48), e);
    }
  }
#endif
  memcpy(d, s, n);
}

void skv__copy_stream_fence(void) {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

/* n rows of `bytes` each, `dstep` / `sstep` bytes apart. Common row sizes get a fixed-size
 * memcpy, which the compiler turns into a few vector moves instead of a library call. */
static SKV_ALWAYS_INLINE void copy_rows(char *restrict d, int64_t dstep, const char *restrict s,
                                        int64_t sstep, uint64_t n, size_t bytes, bool stream) {
#if defined(__SSE2__)
  /* Short rows of whole, aligned destination lines: non-temporal stores skip their
   * read-for-ownership, and each row fills its write-combining buffers completely. */
  if (stream && bytes < 256 && bytes % 64 == 0 && dstep % 64 == 0 && ((uintptr_t)d & 63) == 0) {
    for (uint64_t i = 0; i < n; i++, s += sstep, d += dstep - (int64_t)bytes)
      for (size_t o = 0; o < bytes; o += 64, d += 64) {
        /* 2 KiB ahead, one line per line copied: the hardware prefetcher stops at every
         * 4 KiB, and a burst of prefetches stalls on the fill buffers */
        if (sstep == (int64_t)bytes) __builtin_prefetch(s + o + 2048);
        __m128i a = _mm_loadu_si128((const __m128i *)(s + o)),
                b = _mm_loadu_si128((const __m128i *)(s + o + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + o + 32)),
                e = _mm_loadu_si128((const __m128i *)(s + o + 48));
        _mm_stream_si128((__m128i *)d, a);
        _mm_stream_si128((__m128i *)(d + 16), b);
        _mm_stream_si128((__m128i *)(d + 32), c);
        _mm_stream_si128((__m128i *)(d + 48), e);
      }
    return;
  }
#endif
  if (stream && bytes >= 256) {
    for (uint64_t i = 0; i < n; i++, d += dstep, s += sstep) {
      if (i + 1 < n) /* the next row's source, which no hardware prefetcher predicts */
        for (size_t o = 0; o < bytes && o < 2048; o += 64)
          __builtin_prefetch(s + sstep + (int64_t)o);
      copy_stream(d, s, bytes);
    }
    return;
  }
  // clang-format off
#define ROWS(B)                                                                                  \
  case B:                                                                                        \
    for (uint64_t i = 0; i < n; i++, d += dstep, s += sstep) memcpy(d, s, B);                   \
    return;
  switch (bytes) {
    ROWS(16) ROWS(32) ROWS(64) ROWS(128) ROWS(256)
  default:
    for (uint64_t i = 0; i < n; i++, d += dstep, s += sstep) memcpy(d, s, bytes);
  }
#undef ROWS
  // clang-format on
}

/* n rows of `bytes` (a multiple of 16, under 256) from `sstep` apart into one contiguous,
 * 16-byte aligned run at d, with non-temporal stores: an HND block's head keeps its tokens' rows
 * next to each other, so the rows of short heads (16..240 bytes) fill whole destination lines
 * in order, and the write-combining buffers complete every line without reading it first (with
 * ordinary 16-byte stores each line was read for ownership: fetch_host/hnd/16_KiB, rows of 16
 * bytes, ran at 0.52 to 0.66 x memcpy in symkv-bench micro). */
static SKV_ALWAYS_INLINE void gather_stream(char *restrict d, const char *restrict s, int64_t sstep,
                                            uint64_t n, size_t bytes) {
#if defined(__SSE2__)
  for (uint64_t i = 0; i < n; i++, s += sstep, d += bytes) {
    if (i + 8 < n) __builtin_prefetch(s + 8 * sstep);
    for (size_t o = 0; o < bytes; o += 16)
      _mm_stream_si128((__m128i *)(d + o), _mm_loadu_si128((const __m128i *)(s + o)));
  }
#else
  for (uint64_t i = 0; i < n; i++, s += sstep, d += bytes) memcpy(d, s, bytes);
#endif
}

/* The T x H rows of `row` bytes (16 or 32) of a page's block part (token-major, as the page
 * holds them) into an HND block at d (64-byte aligned, each head's T rows contiguous), one whole
 * line at a time with non-temporal stores: g = 64 / row tokens at a time, read in the page's
 * order (prefetched 1 KiB ahead, into the page's next part), each head's g rows of them are one
 * line of the block. Going head by head instead (gather_stream) read the page across its tokens
 * and ran at about half of memcpy; transposing in L1 first (transpose_rows) at 0.54-0.60, this at
 * 0.66-0.72, near NHD's plain copy of the same parts (0.70-0.79), on a 2-core VM
 * (symkv-hnd-probe, bench/results/gather_lines_2core-vm.txt). T is a multiple of g. */
static SKV_ALWAYS_INLINE void gather_lines(char *restrict d, const char *restrict s, uint64_t T,
                                           uint64_t H, size_t row) {
#if defined(__SSE2__)
  const uint64_t g = 64 / row, tok = H * row;
  for (uint64_t t = 0; t < T; t += g, s += g * tok) {
    for (uint64_t o = 0; o < g * tok; o += 64) __builtin_prefetch(s + 1024 + o);
    for (uint64_t h = 0; h < H; h++) {
      char *l = d + (h * T + t) * row;
      for (uint64_t k = 0; k < g; k++)
        for (size_t v = 0; v < row; v += 16)
          _mm_stream_si128((__m128i *)(l + k * row + v),
                           _mm_loadu_si128((const __m128i *)(s + k * tok + h * row + v)));
    }
  }
#else
  for (uint64_t t = 0; t < T; t++, s += H * row)
    for (uint64_t h = 0; h < H; h++) memcpy(d + (h * T + t) * row, s + h * row, row);
#endif
}

/* The T x H rows of `row` bytes of a page's block part (token-major, as the page holds them)
 * into `d` head-major (an HND block: each head's tokens contiguous); rows under 64 bytes (longer
 * ones are scattered whole lines at a time instead). Rows of 16 and 32 bytes get a fixed-size
 * memcpy (a few vector moves), and prefetch the page's next part a token ahead (the
 * pages of a batch are far apart: the hardware prefetcher starts late on each). */
static SKV_ALWAYS_INLINE void transpose_rows(char *restrict d, const char *restrict s, uint64_t T,
                                             uint64_t H, size_t row) {
  // clang-format off
#define TROWS(B)                                                                                 \
  case B:                                                                                        \
    for (uint64_t t = 0; t < T; t++, s += H * B) {                                              \
      for (uint64_t o = 0; o < H * B; o += 64) __builtin_prefetch(s + T * H * B + o);           \
      for (uint64_t h = 0; h < H; h++) memcpy(d + (h * T + t) * B, s + h * B, B);               \
    }                                                                                            \
    return;
  switch (row) {
    TROWS(16) TROWS(32)
  default:
    for (uint64_t t = 0; t < T; t++, s += H * row)
      for (uint64_t h = 0; h < H; h++) memcpy(d + (h * T + t) * row, s + h * row, row);
  }
#undef TROWS
  // clang-format on
}

/* Bytes of a block part small enough to transpose in a stack buffer that stays in L1. */
#define TRANSPOSE_MAX_BYTES (16u << 10)

/* How it works: page tensor i (layer i / kvn, k|v i % kvn) is a slab of page_tokens x heads x
 * head_dim elements; its part for block j of the page is the j-th run of block_tokens tokens.
 * That part is copied as one memcpy when the block is dense NHD (run_bytes = the whole part),
 * as one memcpy per token when a token's heads are dense, else as head_dim rows, walking the
 * engine side in address order (tokens inside heads for HND). `to_blocks` is a constant in
 * each caller, so each direction gets its own inlined copy. */
static SKV_ALWAYS_INLINE void copy_page(const skv_layout_t *lay, char *page,
                                        const uint64_t *block_ids, bool to_blocks, bool stream) {
  const skv_geometry_t *g = &lay->geom;
  const uint64_t e = g->elem_bytes;
  const uint64_t T = lay->block_tokens, H = g->num_kv_heads;
  const uint64_t row = (uint64_t)g->head_dim * e, tok = H * row, blk = T * tok;
  const uint64_t slab = skv__geometry_slab_bytes(g);
  const int64_t sb = lay->stride_block * (int64_t)e, st = lay->stride_token * (int64_t)e,
                sh = lay->stride_head * (int64_t)e;
  const uint32_t m = lay->blocks_per_page, ntensors = lay->num_layers * lay->kvn;
  const uint64_t run = lay->run_bytes;
  SKV_ASSERT(lay->device < 0);
  for (uint32_t i = 0; i < ntensors; i++) {
    char *eng = lay->base[i];
    char *pg = page + (uint64_t)i * slab;
    for (uint32_t j = 0; j < m; j++, pg += blk) {
      char *b = eng + (int64_t)block_ids[j] * sb;
      if (to_blocks && stream) {
        /* the next part's first destination line, for its address translation: a block of
         * another tensor lies on another 4 KiB page, whose TLB miss then overlaps this copy */
        const uint32_t ni = j + 1 < m ? i : i + 1, nj = j + 1 < m ? j + 1 : 0;
        if (ni < ntensors) __builtin_prefetch(lay->base[ni] + (int64_t)block_ids[nj] * sb, 1, 0);
      }
      if (run == blk) {
        if (stream)
          to_blocks ? copy_stream(b, pg, blk) : copy_stream(pg, b, blk);
        else if (to_blocks)
          memcpy(b, pg, blk);
        else
          memcpy(pg, b, blk);
      } else if (run == tok) {
        if (to_blocks)
          copy_rows(b, st, pg, (int64_t)tok, T, tok, stream);
        else
          copy_rows(pg, (int64_t)tok, b, st, T, tok, stream);
      } else if (to_blocks && stream && (row == 16 || row == 32) && st == (int64_t)row &&
                 sh == (int64_t)(T * row) && T % (64 / row) == 0 && ((uintptr_t)b & 63) == 0) {
        /* HND with dense blocks of 16- or 32-byte rows, large copy: whole lines */
        gather_lines(b, pg, T, H, row);
      } else if (to_blocks && stream && row < 64 && st == (int64_t)row &&
                 sh == (int64_t)(T * row) && blk <= TRANSPOSE_MAX_BYTES) {
        /* HND with dense blocks, large copy: transpose the part in L1 (the page streams in in
         * order), then stream the whole block out in full lines (gathering short rows straight
         * into the block ran at 0.49-0.56x memcpy for rows of 32 bytes: symkv-bench micro
         * fetch_host/hnd/16_KiB) */
        _Alignas(64) char tmp[TRANSPOSE_MAX_BYTES];
        transpose_rows(tmp, pg, T, H, row);
        copy_stream(b, tmp, blk);
      } else if (st <= sh && to_blocks && stream && row < 256 && row % 64 == 0) {
        /* HND-like, short rows, large copy: walk the page in order (the source streams in) and
         * scatter whole-line rows with non-temporal stores */
        for (uint64_t t = 0; t < T; t++)
          copy_rows(b + (int64_t)t * st, sh, pg + t * tok, (int64_t)row, H, row, true);
      } else if (st <= sh && to_blocks && stream && st == (int64_t)row && row % 16 == 0 &&
                 row < 256 && ((uintptr_t)b & 15) == 0 && sh % 16 == 0) {
        /* HND, short rows, large copy: each head's tokens are one contiguous run */
        for (uint64_t h = 0; h < H; h++)
          gather_stream(b + (int64_t)h * sh, pg + h * row, (int64_t)tok, T, row);
      } else if (st <= sh) { /* HND-like: for each head, its tokens */
        for (uint64_t h = 0; h < H; h++) {
          char *bh = b + (int64_t)h * sh, *ph = pg + h * row;
          if (to_blocks)
            copy_rows(bh, st, ph, (int64_t)tok, T, row, stream);
          else
            copy_rows(ph, (int64_t)tok, bh, st, T, row, stream);
        }
      } else { /* NHD with padded heads: for each token, its heads */
        for (uint64_t t = 0; t < T; t++) {
          char *bt = b + (int64_t)t * st, *pt = pg + t * tok;
          if (to_blocks)
            copy_rows(bt, sh, pt, (int64_t)row, H, row, stream);
          else
            copy_rows(pt, (int64_t)row, bt, sh, H, row, stream);
        }
      }
    }
  }
}

void skv__copy_page_to_blocks(const skv_layout_t *lay, const void *page, const uint64_t *block_ids,
                              bool stream) {
  if (stream)
    copy_page(lay, (char *)page, block_ids, true, true);
  else
    copy_page(lay, (char *)page, block_ids, true, false);
}

void skv__copy_page_prefetch(const skv_layout_t *lay, const void *page, const uint64_t *block_ids) {
  __builtin_prefetch(page);
  __builtin_prefetch(lay->base[0] +
                         (int64_t)block_ids[0] * lay->stride_block * (int64_t)lay->geom.elem_bytes,
                     1, 0);
}

void skv__copy_blocks_to_page(const skv_layout_t *lay, void *page, const uint64_t *block_ids,
                              bool stream) {
  if (stream)
    copy_page(lay, page, block_ids, false, true);
  else
    copy_page(lay, page, block_ids, false, false);
}

int skv__check_block_ids(const skv_layout_t *lay, const uint64_t *block_ids, size_t npages,
                         const char *fn) {
  if (!fn) fn = "skv__check_block_ids";
  SKV_ARG_CHECK(lay, SKV_SUBSYS_KV, "%s: layout is NULL", fn);
  if (npages == 0) return 0;
  const uint32_t m = lay->blocks_per_page;
  size_t n;
  SKV_ARG_CHECK(!__builtin_mul_overflow(npages, (size_t)m, &n), SKV_SUBSYS_KV,
                "%s: %zu pages x %u blocks per page overflow", fn, npages, m);
  SKV_ARG_CHECK(block_ids, SKV_SUBSYS_KV,
                "%s: block_ids is NULL: pass %zu block ids (%u per page: page_tokens / "
                "block_tokens)",
                fn, n, m);
  for (size_t i = 0; i < n; i++)
    if (SKV_UNLIKELY(block_ids[i] >= lay->num_blocks))
      return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_KV,
                      "%s: block_ids[%zu]=%" PRIu64 " (page %zu, its block %zu) is not below the "
                      "layout's num_blocks=%" PRIu64 ": nothing was copied; pass ids of the "
                      "engine's blocks",
                      fn, i, block_ids[i], i / m, i % m, lay->num_blocks);
  return 0;
}
