/* Internal view of the CUDA data path of the KV cache (kv_cuda.c) beyond the hooks in kv.h:
 * the kernel variant in use, and the device-side error word (for tests and benchmarks). */
#ifndef SKV_KV_CUDA_H
#define SKV_KV_CUDA_H

#include "kv/kv.h"

#ifdef SKV_WITH_CUDA

/* The process-wide kernel variant (kernels/kv_copy.h): kernel SKV_KV_KERNEL_VEC, _BULK or _CE,
 * 16-byte loads in flight per thread (VEC: 4 or 8), CTAs per multiprocessor (1..32, fewer when
 * the kernel's occupancy allows fewer), threads per CTA (VEC: 128, 256 or 512) and where the
 * arguments travel (SKV_KV_ARGS_*). Read once from SKV_FETCH_KERNEL, _UNROLL, _CTAS and
 * _THREADS; set here to compare variants in one run. */
typedef struct skv_kv_variant {
  int kernel, unroll, ctas_per_sm, threads, args, l2_256;
} skv_kv_variant_t;
int skv__kv_cuda_variant_set(const skv_kv_variant_t *v);
void skv__kv_cuda_variant_get(skv_kv_variant_t *v);
/* "vec_u8_c4_t256_auto", "bulk_c1_auto": `v`, or the variant in use when NULL. */
const char *skv__kv_cuda_variant_name(const skv_kv_variant_t *v, char *buf, size_t cap);

/* The cache's device-side error word (4 words of pinned host memory, mapped at the same address
 * for the device): kernels set it on a reference or block id they refuse; skv_kv_sync reports
 * and clears it. NULL for a cache without the CUDA data path. */
uint32_t *skv__kv_cuda_err_word(skv_kv_t *kv);

#endif
#endif
