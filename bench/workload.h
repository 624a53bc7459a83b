/* symkv-bench workloads: requests made of page-key chains (a Mooncake trace, or the synthetic
 * longdoc / multiround generators), model presets, the engine-side GPU helpers. */
#ifndef SKV_BENCH_WORKLOAD_H
#define SKV_BENCH_WORKLOAD_H

#include "bench.h"

#include <stdbool.h>
#include <stdint.h>

/* ---- models (workload_gen.c) ---------------------------------------------------------- */

typedef struct wl_model {
  const char *name;
  uint32_t kv_kind;    /* SKV_KV_SPLIT or SKV_KV_MLA */
  uint32_t layers;     /* layers whose KV is cached */
  uint32_t kv_heads;   /* KV heads of the whole model (split over --tp; MLA: 1, replicated) */
  uint32_t head_dim;   /* elements per head vector (MLA: latent + rope, 576) */
  uint32_t elem_bytes; /* 2: bf16 */
  uint32_t default_tp;
  double params;     /* parameters active per token (the 2 x params FLOPs term) */
  double attn_flops; /* attention FLOPs per prompt token per context token, all layers:
                        layers x 2 x (q_heads x qk_dim + q_heads x v_dim) */
  const char *about;
} wl_model_t;

/* The preset named `name`, or NULL. */
const wl_model_t *wl_model_find(const char *name);
/* "tiny, llama-3-8b, ..." for messages. */
const char *wl_model_names(void);
/* FLOPs of prefilling tokens [cached, total) of a prompt (causal attention over the whole
 * prefix), for the whole model (divide by the tensor-parallel degree for one GPU). */
double wl_prefill_flops(const wl_model_t *m, uint64_t cached, uint64_t total);

/* ---- requests (workload_gen.c) ------------------------------------------------------- */

typedef struct wl_request {
  double arrival_ms; /* trace timestamp, or index / rate for the synthetic workloads */
  uint64_t tokens;   /* prompt tokens */
  uint64_t key0;     /* first of its keys in wl_workload_t.keys */
  uint32_t npages;   /* keys of its page chain */
  uint32_t pad;
} wl_request_t;

typedef struct wl_workload {
  char kind[16];   /* "trace", "longdoc", "multiround" */
  char about[256]; /* one line: what was generated or read */
  uint32_t page_tokens;
  wl_request_t *req;
  size_t nreq;
  skv_key_t *keys; /* every request's chain, back to back */
  uint64_t nkeys;
  uint64_t *ids;      /* trace only: the raw hash ids (nkeys of them), else NULL */
  uint64_t distinct;  /* distinct page keys of the whole workload */
  uint32_t max_pages; /* longest chain */
} wl_workload_t;

/* Tokens covered by the first `hits` pages of request r. */
static inline uint64_t wl_hit_tokens(const wl_workload_t *w, const wl_request_t *r, uint64_t hits) {
  uint64_t t = hits * w->page_tokens;
  return t < r->tokens ? t : r->tokens;
}

/* Read a Mooncake-format JSONL trace: {"timestamp", "input_length", "hash_ids", ...} a line.
 * Each hash id is one page of `page_tokens` tokens. Errors name the file and the line and go
 * to `err`. max_requests 0: all. Keys are made later by wl_trace_keys. */
int wl_trace_read(const char *path, uint32_t page_tokens, uint64_t max_requests, wl_workload_t *w,
                  char *err, size_t errcap);
/* Page keys of a trace: key_i = skv_namespace_hash_bytes(ns, key_{i-1} || id_i), key_{-1} = 0. */
int wl_trace_keys(wl_workload_t *w, const skv_namespace_t *ns);

typedef struct wl_longdoc_opts {
  uint32_t docs, repeats, order; /* order: WL_ORDER_* */
  uint64_t doc_tokens, question_tokens;
  double rate; /* requests per second (arrival times for --realtime) */
  uint64_t seed;
} wl_longdoc_opts_t;
enum { WL_ORDER_RANDOM = 0, WL_ORDER_TILE = 1, WL_ORDER_INTERLEAVE = 2 };
int wl_longdoc_make(const wl_longdoc_opts_t *o, const skv_namespace_t *ns, uint32_t page_tokens,
                    wl_workload_t *w);

typedef struct wl_multiround_opts {
  uint32_t users, rounds;
  uint64_t system_tokens, message_tokens, answer_tokens;
  double rate;
  uint64_t seed;
} wl_multiround_opts_t;
int wl_multiround_make(const wl_multiround_opts_t *o, const skv_namespace_t *ns,
                       uint32_t page_tokens, wl_workload_t *w);

void wl_workload_free(wl_workload_t *w);
/* Count distinct keys (fills w->distinct, w->max_pages). */
void wl_workload_finish(wl_workload_t *w);

/* Exact prefix-hit counts with unbounded caches, computed directly from the key chains: a
 * request's hits are its leading pages seen in any earlier request (shared) or in an earlier
 * request on the same PE (per_pe; request i runs on PE i mod npes). */
typedef struct wl_exact {
  uint64_t pages, tokens;
  uint64_t hit_pages[2], hit_tokens[2]; /* [0] shared, [1] per_pe */
} wl_exact_t;
void wl_exact_prefix_hits(const wl_workload_t *w, int npes, wl_exact_t *out);
/* The most distinct pages the requests of one PE touch (an unbounded per-PE capacity). */
uint64_t wl_max_pages_per_pe(const wl_workload_t *w, int npes);

/* ---- a set / LRU of 128-bit keys (workload_gen.c) ------------------------------------ */

/* A private LRU cache of keys with a fixed capacity: the per_pe policy (an engine's own
 * prefix cache) and the exact-hit computations. Capacity 0: unbounded (grows). */
typedef struct wl_lru wl_lru_t;
wl_lru_t *wl_lru_create(uint64_t capacity);
void wl_lru_destroy(wl_lru_t *c);
/* Leading keys present; each hit becomes the most recently used, in chain order. */
uint64_t wl_lru_lookup(wl_lru_t *c, const skv_key_t *keys, uint64_t n);
/* Insert keys not present (present ones are left alone, as skv_kv_publish does), evicting the
 * least recently used when full. Returns the number inserted. */
uint64_t wl_lru_publish(wl_lru_t *c, const skv_key_t *keys, uint64_t n);
bool wl_lru_contains(const wl_lru_t *c, skv_key_t k);
uint64_t wl_lru_size(const wl_lru_t *c);

/* ---- GPU helpers (workload_cuda.c; SKV_ENOTSUP in builds without CUDA) -------------- */

/* A CUDA build and a GPU (no error logged when not). */
bool wl_dev_present(void);
/* Make this PE's device current (skv_ctx_get_device) and return it. */
int wl_dev_use(skv_ctx_t *ctx, int *device);
int wl_dev_alloc(uint64_t bytes, void **ptr);
void wl_dev_free(void *ptr);
int wl_dev_mem_free(uint64_t *free_bytes);
int wl_dev_stream_create(void **stream);
void wl_dev_stream_destroy(void *stream);
int wl_dev_stream_sync(void *stream);
/* kind: 0 host to device, 1 device to host, 2 device to device; asynchronous on `stream`. */
int wl_dev_memcpy(void *dst, const void *src, uint64_t bytes, int kind, void *stream);
/* Dense bf16 GEMM throughput of this device with cuBLAS (libcublas.so.13 opened at run time),
 * in TFLOP/s; `about` gets what was measured. */
int wl_dev_gemm_tflops(double *tflops, char *about, size_t cap);

#endif
