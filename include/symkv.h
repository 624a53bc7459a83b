/* symkv: node-wide KV cache sharing and tensor-parallel collectives over GPU symmetric memory.
 * The whole public C API; a plain C11 compiler accepts it (device API: symkv_device.cuh). */
#ifndef SYMKV_H
#define SYMKV_H

#include <errno.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(SKV_BUILDING_LIBRARY) && defined(__GNUC__)
#define SKV_EXTERN __attribute__((visibility("default")))
#else
#define SKV_EXTERN
#endif

/* ------------------------------------------------------------------------------------------ */
/* Version                                                                                    */
/* ------------------------------------------------------------------------------------------ */

#define SKV_VERSION_MAJOR 0
#define SKV_VERSION_MINOR 2
#define SKV_VERSION_PATCH 0
#define SKV_VERSION_HEX   ((SKV_VERSION_MAJOR << 16) | (SKV_VERSION_MINOR << 8) | SKV_VERSION_PATCH)

/* SKV_VERSION_HEX of the library actually loaded (compare with the header's to detect skew). */
SKV_EXTERN unsigned int skv_version(void);
/* "0.2.0" plus build details, e.g. "0.2.0 (cuda 13.0, nccl 2.28.9)". */
SKV_EXTERN const char *skv_version_string(void);

/* ------------------------------------------------------------------------------------------ */
/* Errors                                                                                     */
/*                                                                                            */
/* Every call returns 0 or a negative code. As in libuv, a code named after an errno value IS */
/* that value negated (SKV_EINVAL == -EINVAL, Linux numbering), so a system call's -ENOMEM    */
/* and symkv's SKV_ENOMEM are one code; any other -errno a system call fails with comes back  */
/* as it is (-ENOENT, -EACCES). symkv's own codes, which no errno names, are -1000 and below. */
/* ------------------------------------------------------------------------------------------ */

/* clang-format off */
#define SKV_ERRNO_MAP(XX)                                                                        \
  /* errno equivalents */                                                                        \
  XX(EINVAL, -EINVAL, "invalid argument")                                                        \
  XX(ENOMEM, -ENOMEM, "out of memory")                                                           \
  XX(ETIMEDOUT, -ETIMEDOUT,                                                                    \
     "timed out waiting for a peer (raise SKV_TIMEOUT_MS or check the peers)")                    \
  XX(EPROTO, -EPROTO, "malformed or oversized bootstrap message")                                \
  XX(ENOTSUP, -ENOTSUP, "not supported by this build, backend or device")                        \
  XX(ESTALE, -ESTALE, "stale page reference (the page was evicted or reused)")                   \
  XX(ENOSPC, -ENOSPC, "no free page or index slot (every page is pinned or the index is full)")  \
  XX(EEXIST, -EEXIST, "already exists")                                                          \
  XX(ERANGE, -ERANGE, "value out of range")                                                      \
  /* symkv's own */                                                                              \
  XX(EAUTH, -1004, "bootstrap token rejected (every PE must use the same SKV_TOKEN)")            \
  XX(ECONN, -1006, "bootstrap connection failed or lost (is rank 0 running?)")                   \
  XX(EPEERDEAD, -1007, "a peer process exited")                                                  \
  XX(EMISMATCH, -1008, "PEs called collectives that do not match")                               \
  XX(ECUDA, -1010, "CUDA call failed")                                                           \
  XX(ENCCL, -1011, "NCCL call failed")                                                           \
  XX(ENOTFOUND, -1012, "not found")                                                              \
  XX(ESTATE, -1017, "call not valid in the current state")                                       \
  XX(ECAPTURE, -1018, "not allowed while a CUDA graph is being captured")                        \
  XX(EVERSION, -1019, "version mismatch between caller and library")                             \
  XX(EINTERNAL, -1020, "internal error (please report it with the SKV_DEBUG=INFO log)")
/* clang-format on */

typedef enum skv_err {
  SKV_OK = 0,
#define SKV__ERR_ENUM(name, value, msg) SKV_##name = (value),
  SKV_ERRNO_MAP(SKV__ERR_ENUM)
#undef SKV__ERR_ENUM
} skv_err_t;

/* Message for any return code (symkv's own or -errno); never NULL. */
SKV_EXTERN const char *skv_strerror(int err);
/* Name for any return code: "SKV_ETIMEDOUT", "ENOENT", "SKV_OK"; never NULL. */
SKV_EXTERN const char *skv_err_name(int err);
/* The last detailed failure message of the calling thread ("" if none): what failed, where
 * (file:line) and what to do next. Valid until the thread's next failing symkv call. */
SKV_EXTERN const char *skv_last_error(void);
/* Forget the calling thread's last error. */
SKV_EXTERN void skv_clear_error(void);

/* ------------------------------------------------------------------------------------------ */
/* Logging                                                                                    */
/*                                                                                            */
/* SKV_DEBUG=NONE|WARN|INFO|TRACE (default WARN), SKV_DEBUG_SUBSYS=INIT,BOOT,... or ALL, with  */
/* ^NAME to exclude. Lines look like "host:pid:rank [WARN BOOT] message". A failing call logs  */
/* its message at INFO (it returns the code, skv_last_error() has the text): by default only  */
/* what no return code reports is printed (WARN), such as a peer misbehaving in rank 0's store. */
/* ------------------------------------------------------------------------------------------ */

typedef enum skv_log_level {
  SKV_LOG_NONE = 0,
  SKV_LOG_WARN = 1,
  SKV_LOG_INFO = 2,
  SKV_LOG_TRACE = 3
} skv_log_level_t;

#define SKV_SUBSYS_MAP(XX) \
  XX(INIT, 0x01)           \
  XX(BOOT, 0x02)           \
  XX(HEAP, 0x04)           \
  XX(POOL, 0x08)           \
  XX(INDEX, 0x10)          \
  XX(KV, 0x20)             \
  XX(COMM, 0x40)           \
  XX(BENCH, 0x80)

enum {
#define SKV__SUBSYS_ENUM(name, bit) SKV_SUBSYS_##name = (bit),
  SKV_SUBSYS_MAP(SKV__SUBSYS_ENUM)
#undef SKV__SUBSYS_ENUM
};
enum { SKV_SUBSYS_ALL = 0xff };

/* A log sink receives one formatted line (no trailing newline). It may be called from any
 * thread, including symkv's background threads; it must not call back into symkv. */
typedef void (*skv_log_cb)(void *arg, int level, unsigned int subsys, const char *line);

/* Replace the sink (NULL restores the default: stderr). */
SKV_EXTERN int skv_log_set_sink(skv_log_cb cb, void *arg);
/* Override SKV_DEBUG / SKV_DEBUG_SUBSYS at run time. */
SKV_EXTERN int skv_log_set_level(int level, unsigned int subsys_mask);
/* Write one line through symkv's logger (used by the tools and bindings). */
SKV_EXTERN void skv_log_write(int level, unsigned int subsys, const char *msg);

/* ------------------------------------------------------------------------------------------ */
/* Configuration                                                                              */
/* ------------------------------------------------------------------------------------------ */

#define SKV_CONFIG_VERSION 1

/* Fields left at their init value are taken from the environment (SKV_RANK, ...), then from
 * defaults. Strings are borrowed: they must stay valid until skv_init returns. */
typedef struct skv_config {
  size_t size;           /* sizeof(skv_config_t), set by SKV_CONFIG_INIT */
  uint32_t version;      /* SKV_CONFIG_VERSION, set by SKV_CONFIG_INIT */
  int32_t rank;          /* -1: SKV_RANK */
  int32_t world_size;    /* -1: SKV_WORLD_SIZE */
  int32_t local_rank;    /* -1: SKV_LOCAL_RANK, else the position among this node's PEs */
  int32_t local_size;    /* -1: SKV_LOCAL_SIZE, else the PEs found on this node (a value
                            given must match them) */
  int32_t timeout_ms;    /* -1: SKV_TIMEOUT_MS, else 60000; bounds every wait */
  int32_t device;        /* -1: SKV_DEVICE, else local_rank modulo the number of GPUs */
  uint32_t flags;        /* reserved, must be 0 */
  const char *bootstrap; /* NULL: SKV_BOOTSTRAP, "tcp://HOST:PORT" of rank 0's store */
  const char *token;     /* NULL: SKV_TOKEN, shared secret every PE presents (8-128 chars) */
  const char *bind_addr; /* NULL: SKV_BIND_ADDR, else the host of `bootstrap` (loopback) */
} skv_config_t;

/* clang-format off */
#define SKV_CONFIG_INIT                                                                            \
  {                                                                                                \
    sizeof(skv_config_t), /* size */                                                               \
    SKV_CONFIG_VERSION,   /* version */                                                            \
    -1,                   /* rank: SKV_RANK */                                                     \
    -1,                   /* world_size: SKV_WORLD_SIZE */                                         \
    -1,                   /* local_rank: SKV_LOCAL_RANK, else found */                             \
    -1,                   /* local_size: SKV_LOCAL_SIZE, else found */                             \
    -1,                   /* timeout_ms: SKV_TIMEOUT_MS, else 60000 */                             \
    -1,                   /* device: SKV_DEVICE, else local rank modulo GPUs */                    \
    0u,                   /* flags: none */                                                        \
    NULL,                 /* bootstrap: SKV_BOOTSTRAP */                                           \
    NULL,                 /* token: SKV_TOKEN */                                                   \
    NULL                  /* bind_addr: SKV_BIND_ADDR, else the bootstrap host */                  \
  }
/* clang-format on */

/* Same as assigning SKV_CONFIG_INIT (for bindings that cannot use the macro). */
SKV_EXTERN int skv_config_init(skv_config_t *cfg);
/* Set one field by name from a string ("rank", "world_size", "timeout_ms", "bootstrap", ...).
 * Unknown names and unparsable values fail with SKV_EINVAL naming them. `value` is borrowed. */
SKV_EXTERN int skv_config_set(skv_config_t *cfg, const char *name, const char *value);
/* Check every field as given (without the environment); the error names the first bad one. */
SKV_EXTERN int skv_config_validate(const skv_config_t *cfg);

/* ------------------------------------------------------------------------------------------ */
/* Context and bootstrap                                                                      */
/* ------------------------------------------------------------------------------------------ */

typedef struct skv_ctx skv_ctx_t;

/* Join the job: rank 0 starts the bootstrap store, every PE connects to it and presents the
 * token. `cfg` may be NULL (everything from the environment). Collective. On failure,
 * skv_last_error() describes the failure (not the clean-up after it) on every PE. */
SKV_EXTERN int skv_init(const skv_config_t *cfg, skv_ctx_t **ctx);
/* Leave the job: a final barrier (bounded by the timeout; a dead peer does not make it hang),
 * then rank 0 stops serving once every PE has left. Frees `ctx` even when it returns an error. */
SKV_EXTERN int skv_finalize(skv_ctx_t *ctx);

SKV_EXTERN int skv_ctx_get_rank(const skv_ctx_t *ctx);
SKV_EXTERN int skv_ctx_get_world_size(const skv_ctx_t *ctx);
SKV_EXTERN int skv_ctx_get_local_rank(const skv_ctx_t *ctx);
SKV_EXTERN int skv_ctx_get_local_size(const skv_ctx_t *ctx);
SKV_EXTERN int skv_ctx_get_timeout_ms(const skv_ctx_t *ctx);
/* This PE's CUDA device (chosen at the first GPU use: config.device / SKV_DEVICE, else local
 * rank modulo the device count), or SKV_ENOTSUP without CUDA or a GPU. */
SKV_EXTERN int skv_ctx_get_device(skv_ctx_t *ctx);
/* Change the timeout of this PE's later waits (collective calls assume equal values). */
SKV_EXTERN int skv_ctx_set_timeout_ms(skv_ctx_t *ctx, int timeout_ms);

/* Host barrier through the bootstrap store. Collective. */
SKV_EXTERN int skv_ctx_barrier(skv_ctx_t *ctx);
/* Every PE contributes `bytes` bytes; `out` receives world_size * bytes in rank order. */
SKV_EXTERN int skv_ctx_allgather(skv_ctx_t *ctx, const void *in, void *out, size_t bytes);
/* Root's `bytes` bytes reach every PE's `buf`. Collective. */
SKV_EXTERN int skv_ctx_broadcast(skv_ctx_t *ctx, void *buf, size_t bytes, int root);

/* The bootstrap key-value store (point to point; keys up to SKV_STORE_MAX_KEY bytes,
 * values up to SKV_STORE_MAX_VALUE bytes). Waits are bounded by the context's timeout. */
#define SKV_STORE_MAX_KEY   256
#define SKV_STORE_MAX_VALUE (16u << 20)
SKV_EXTERN int skv_store_set(skv_ctx_t *ctx, const char *key, const void *value, size_t len);
/* Wait until `key` exists, then copy up to `cap` bytes of it; `*len` gets its full length
 * (SKV_ERANGE if it did not fit: the buffer then holds its first `cap` bytes). */
SKV_EXTERN int skv_store_get(skv_ctx_t *ctx, const char *key, void *value, size_t cap, size_t *len);
/* Atomically add `delta` to the 64-bit counter `key` (created at 0); `*result` gets the sum. */
SKV_EXTERN int skv_store_add(skv_ctx_t *ctx, const char *key, int64_t delta, int64_t *result);
/* Wait until every one of the `n` keys exists. */
SKV_EXTERN int skv_store_wait(skv_ctx_t *ctx, const char *const *keys, size_t n);

/* ------------------------------------------------------------------------------------------ */
/* Symmetric heap                                                                             */
/*                                                                                            */
/* Layout, identical on every PE: [ signal pad | comm scratch | data ], 256-byte aligned, data */
/* 4 KiB aligned. The address of byte `off` of PE `pe` is base + pe * stride + off.           */
/* ------------------------------------------------------------------------------------------ */

typedef enum skv_backend {
  SKV_BACKEND_HOST = 1,      /* memfd mapped by every local PE (CPU load/store) */
  SKV_BACKEND_CUDA = 2,      /* cuMemCreate device memory mapped by every local GPU */
  SKV_BACKEND_CUDA_HOST = 3, /* host memory (memfd) registered with every local GPU */
} skv_backend_t;

typedef struct skv_heap skv_heap_t;

#define SKV_HEAP_OPTS_VERSION 1
typedef struct skv_heap_opts {
  size_t size;            /* sizeof(skv_heap_opts_t) */
  uint32_t version;       /* SKV_HEAP_OPTS_VERSION */
  int32_t backend;        /* SKV_BACKEND_* */
  uint64_t data_bytes;    /* size of the data area (> 0) */
  uint64_t signal_bytes;  /* 0: default (64 KiB) */
  uint64_t scratch_bytes; /* 0: none (host) / default (cuda: 8 MiB for the collectives) */
} skv_heap_opts_t;

/* clang-format off */
#define SKV_HEAP_OPTS_INIT                                                                         \
  {                                                                                                \
    sizeof(skv_heap_opts_t), /* size */                                                            \
    SKV_HEAP_OPTS_VERSION,   /* version */                                                         \
    SKV_BACKEND_HOST,        /* backend */                                                         \
    0,                       /* data_bytes: must be set */                                         \
    0,                       /* signal_bytes: 64 KiB */                                            \
    0                        /* scratch_bytes: none (host), 8 MiB (cuda) */                        \
  }
/* clang-format on */

/* Filled by skv_heap_get_info. The caller sets `size` (SKV_HEAP_INFO_INIT): the library writes
 * no byte beyond it, so a struct that grows in a later version never overruns an older caller's. */
typedef struct skv_heap_info {
  size_t size;            /* in: sizeof(skv_heap_info_t) as the caller knows it */
  uint64_t segment_bytes; /* bytes of one PE's segment (signal + scratch + data) */
  uint64_t stride;        /* distance between consecutive PEs' segments */
  uint64_t signal_offset, signal_bytes;
  uint64_t scratch_offset, scratch_bytes;
  uint64_t data_offset, data_bytes;
  int32_t backend;
  int32_t npes;   /* PEs whose segments are mapped (the local PEs) */
  int32_t my_pe;  /* this PE's index among them */
  int32_t device; /* CUDA device (cuda backends), else -1 */
  void *base;     /* address of PE 0's segment */
} skv_heap_info_t;

/* clang-format off */
#define SKV_HEAP_INFO_INIT                                                                         \
  {                                                                                                \
    sizeof(skv_heap_info_t), /* size: the rest is output */                                        \
    0,                       /* segment_bytes */                                                   \
    0,                       /* stride */                                                          \
    0,                       /* signal_offset */                                                   \
    0,                       /* signal_bytes */                                                    \
    0,                       /* scratch_offset */                                                  \
    0,                       /* scratch_bytes */                                                   \
    0,                       /* data_offset */                                                     \
    0,                       /* data_bytes */                                                      \
    0,                       /* backend */                                                         \
    0,                       /* npes */                                                            \
    0,                       /* my_pe */                                                           \
    0,                       /* device */                                                          \
    NULL                     /* base */                                                            \
  }
/* clang-format on */

/* Collective: every PE gets a segment of the same size and maps every local peer's segment.
 * All or nothing: when one PE fails, every PE fails at once with its code, naming it. */
SKV_EXTERN int skv_heap_create(skv_ctx_t *ctx, uint64_t data_bytes, skv_backend_t backend,
                               skv_heap_t **heap);
SKV_EXTERN int skv_heap_create_ex(skv_ctx_t *ctx, const skv_heap_opts_t *opts, skv_heap_t **heap);
/* Address of byte `offset` of PE `pe`'s segment, or NULL (last error set) when `pe` or
 * `offset` is out of range. Pure arithmetic; never blocks. */
SKV_EXTERN void *skv_heap_get_ptr(const skv_heap_t *heap, int pe, uint64_t offset);
SKV_EXTERN int skv_heap_get_info(const skv_heap_t *heap, skv_heap_info_t *info);
/* Collective (bounded by the timeout): unmaps everything; nothing stays behind in /dev/shm. */
SKV_EXTERN int skv_heap_destroy(skv_heap_t *heap);

/* ------------------------------------------------------------------------------------------ */
/* KV geometry, engine layouts, namespaces and keys                                           */
/* ------------------------------------------------------------------------------------------ */

typedef enum skv_kv_kind {
  SKV_KV_SPLIT = 0, /* a K and a V vector per token, layer and KV head */
  SKV_KV_MLA = 1,   /* one latent vector per token and layer (DeepSeek MLA); num_kv_heads = 1 */
} skv_kv_kind_t;

#define SKV_GEOMETRY_VERSION 1
/* The KV of `page_tokens` tokens for all layers of this PE's shard of the model. A page is
 * stored as [layer][k|v][token][head][dim], contiguous, elem_bytes per element. */
typedef struct skv_geometry {
  size_t size;           /* sizeof(skv_geometry_t) */
  uint32_t version;      /* SKV_GEOMETRY_VERSION */
  uint32_t kv_kind;      /* SKV_KV_SPLIT or SKV_KV_MLA */
  uint32_t num_layers;   /* 1..1024 */
  uint32_t num_kv_heads; /* KV heads of this shard, 1..1024 (MLA: 1) */
  uint32_t head_dim;     /* elements per head vector, 1..65536 (MLA: latent width, e.g. 576) */
  uint32_t elem_bytes;   /* 1 (fp8), 2 (bf16/fp16) or 4 (fp32) */
  uint32_t page_tokens;  /* tokens per page, 1..65536 */
} skv_geometry_t;

/* clang-format off */
#define SKV_GEOMETRY_INIT                                                                          \
  {                                                                                                \
    sizeof(skv_geometry_t), /* size */                                                             \
    SKV_GEOMETRY_VERSION,   /* version */                                                          \
    SKV_KV_SPLIT,           /* kv_kind */                                                          \
    0,                      /* num_layers: must be set */                                          \
    0,                      /* num_kv_heads: must be set */                                        \
    0,                      /* head_dim: must be set */                                            \
    0,                      /* elem_bytes: must be set */                                          \
    0                       /* page_tokens: must be set */                                         \
  }
/* clang-format on */

/* Validate a geometry (the error names the bad field) and give the bytes of one page. */
SKV_EXTERN int skv_geometry_get_page_bytes(const skv_geometry_t *geom, uint64_t *page_bytes);

/* Engine layout presets. Strides are in elements; the head_dim elements of one vector are
 * contiguous. `layer_ptrs[l]` is layer l's tensor:
 *   VLLM_FLASH_NHD  (2, num_blocks, block_tokens, heads, dim)   vLLM FlashAttention
 *   VLLM_FLASH_HND  (2, num_blocks, heads, block_tokens, dim)
 *   FLASHINFER_NHD  (num_blocks, 2, block_tokens, heads, dim)   FlashInfer
 *   FLASHINFER_HND  (num_blocks, 2, heads, block_tokens, dim)
 *   MLA             (num_blocks, block_tokens, dim)              vLLM MLA (kv_kind MLA)
 *   CONTIGUOUS      layer_ptrs[0] only: blocks stored exactly as pages, block b at
 *                   base + b * page_bytes * block_tokens / page_tokens                   */
typedef enum skv_layout_preset {
  SKV_LAYOUT_CUSTOM = 0,
  SKV_LAYOUT_VLLM_FLASH_NHD = 1,
  SKV_LAYOUT_VLLM_FLASH_HND = 2,
  SKV_LAYOUT_FLASHINFER_NHD = 3,
  SKV_LAYOUT_FLASHINFER_HND = 4,
  SKV_LAYOUT_MLA = 5,
  SKV_LAYOUT_CONTIGUOUS = 6,
} skv_layout_preset_t;

#define SKV_LAYOUT_DESC_VERSION 1
/* A custom description of an engine's paged KV cache. */
typedef struct skv_layout_desc {
  size_t size;           /* sizeof(skv_layout_desc_t) */
  uint32_t version;      /* SKV_LAYOUT_DESC_VERSION */
  uint32_t block_tokens; /* tokens per engine block; must divide the geometry's page_tokens */
  uint64_t num_blocks;   /* engine blocks (block ids are checked against it) */
  void *const
      *k_base; /* [num_layers]: address of block 0, token 0, head 0 of K (MLA: the latent) */
  void *const *v_base;  /* [num_layers]: same for V; NULL for MLA */
  int64_t stride_block; /* elements between consecutive blocks */
  int64_t stride_token; /* elements between consecutive tokens of a block */
  int64_t stride_head;  /* elements between consecutive heads */
  int32_t device;       /* -1: host memory; >= 0: memory of that CUDA device */
} skv_layout_desc_t;

/* clang-format off */
#define SKV_LAYOUT_DESC_INIT                                                                       \
  {                                                                                                \
    sizeof(skv_layout_desc_t), /* size */                                                          \
    SKV_LAYOUT_DESC_VERSION,   /* version */                                                       \
    0,                         /* block_tokens: must be set */                                     \
    0,                         /* num_blocks: must be set */                                       \
    NULL,                      /* k_base: must be set */                                           \
    NULL,                      /* v_base: must be set (NULL for MLA) */                            \
    0,                         /* stride_block */                                                  \
    0,                         /* stride_token */                                                  \
    0,                         /* stride_head */                                                   \
    -1                         /* device: host memory */                                           \
  }
/* clang-format on */

typedef struct skv_layout skv_layout_t;

/* A layout for `geom` (copied: the pointer arrays need not outlive the call). Every block
 * is checked to lie inside the address ranges the strides imply; bad strides, overlapping
 * K/V, misaligned pointers are rejected. */
SKV_EXTERN int skv_layout_create(const skv_geometry_t *geom, const skv_layout_desc_t *desc,
                                 skv_layout_t **layout);
SKV_EXTERN int skv_layout_create_preset(const skv_geometry_t *geom, skv_layout_preset_t preset,
                                        uint32_t block_tokens, uint64_t num_blocks,
                                        void *const *layer_ptrs, int device, skv_layout_t **layout);
/* Bytes a preset's tensor for one layer occupies (to allocate engine caches in tests). */
SKV_EXTERN int skv_layout_get_preset_layer_bytes(const skv_geometry_t *geom,
                                                 skv_layout_preset_t preset, uint32_t block_tokens,
                                                 uint64_t num_blocks, uint64_t *bytes);
/* A layout of layers [first, first + n) of `layout` only (first counts the geometry's layers;
 * the range must lie inside the layers `layout` covers; else SKV_EINVAL naming the range). With
 * it, skv_kv_fetch and skv_kv_write copy only those layers' bytes of each page (a page is
 * [layer][k|v][token][head][dim], so they are one contiguous range of it, at byte offset
 * first * kvn * page_tokens * num_kv_heads * head_dim * elem_bytes): an engine loads and
 * saves layer by layer, as its forward reaches each layer. skv_kv_publish refuses it (a key is
 * inserted only once its whole page is written: use skv_kv_reserve / _write / _commit).
 * Independent of `layout` afterwards (destroy both with skv_layout_destroy). */
SKV_EXTERN int skv_layout_create_layers(const skv_layout_t *layout, uint32_t first, uint32_t n,
                                        skv_layout_t **sub);
SKV_EXTERN int skv_layout_destroy(skv_layout_t *layout);

/* A 128-bit page key. hi is never 0 (0 is reserved by the index). */
typedef struct skv_key {
  uint64_t hi;
  uint64_t lo;
} skv_key_t;

typedef struct skv_namespace skv_namespace_t;

/* Keys of different namespaces never meet: the namespace covers the model name, the KV
 * geometry, a tenant salt and the deployment secret (NULL/0: SKV_HASH_SECRET, else none). The
 * byte format is in docs/hashing.md. */
SKV_EXTERN int skv_namespace_create(const char *model, const skv_geometry_t *geom, const void *salt,
                                    size_t salt_len, const void *secret, size_t secret_len,
                                    skv_namespace_t **ns);
SKV_EXTERN int skv_namespace_get_id(const skv_namespace_t *ns, skv_key_t *id);
SKV_EXTERN int skv_namespace_destroy(skv_namespace_t *ns);

/* One key per full page of `tokens` (a chain: key i covers page i's tokens and key i-1).
 * `parent`: the key of the page before tokens[0] when continuing a sequence, else NULL.
 * Writes min(ntokens / page_tokens, cap) keys; *nkeys gets the count of full pages. */
SKV_EXTERN int skv_namespace_hash_tokens(const skv_namespace_t *ns, const uint32_t *tokens,
                                         size_t ntokens, const skv_key_t *parent, skv_key_t *keys,
                                         size_t cap, size_t *nkeys);
/* Fold an engine's own block hash (any bytes) into a key of this namespace. */
SKV_EXTERN int skv_namespace_hash_bytes(const skv_namespace_t *ns, const void *bytes, size_t len,
                                        skv_key_t *key);

/* ------------------------------------------------------------------------------------------ */
/* The node-wide KV cache: page pool, index, publish, lookup, fetch, evict                    */
/* ------------------------------------------------------------------------------------------ */

typedef struct skv_kv skv_kv_t;

#define SKV_KV_OPTS_VERSION 1
typedef struct skv_kv_opts {
  size_t size;           /* sizeof(skv_kv_opts_t) */
  uint32_t version;      /* SKV_KV_OPTS_VERSION */
  int32_t backend;       /* where pages live: SKV_BACKEND_HOST, _CUDA or _CUDA_HOST */
  uint64_t pages_per_pe; /* capacity of each PE, >= 1 */
  uint64_t index_slots;  /* 0: 4 per page of the node (rounded up to a power of 2 per PE) */
} skv_kv_opts_t;

/* clang-format off */
#define SKV_KV_OPTS_INIT                                                                           \
  {                                                                                                \
    sizeof(skv_kv_opts_t), /* size */                                                              \
    SKV_KV_OPTS_VERSION,   /* version */                                                           \
    SKV_BACKEND_HOST,      /* backend */                                                           \
    0,                     /* pages_per_pe: must be set */                                         \
    0                      /* index_slots: 4 per page of the node */                               \
  }
/* clang-format on */

/* Where a page is: PE (local index), page number, generation at lookup time. */
typedef struct skv_page_ref {
  uint32_t pe;
  uint32_t page;
  uint32_t gen;
  uint32_t reserved;
} skv_page_ref_t;

/* Filled by skv_kv_get_stats; `size` as in skv_heap_info_t (SKV_KV_STATS_INIT). */
typedef struct skv_kv_stats {
  size_t size;                                      /* in: sizeof(skv_kv_stats_t) */
  uint64_t page_bytes;                              /* bytes of one page */
  uint64_t pages_per_pe;                            /* capacity of each PE */
  uint64_t pages_used;                              /* this PE's pages holding data */
  uint64_t pages_pinned;                            /* this PE's pages pinned by some PE */
  uint64_t index_slots;                             /* slots of the node-wide index */
  uint64_t index_entries;                           /* keys in the index (all PEs) */
  uint64_t lookups, lookup_hits;                    /* keys asked / found by this PE */
  uint64_t published, deduplicated, evicted, stale; /* this PE's counters */
  uint64_t index_full; /* keys this PE could not cache: no free slot near their home */
} skv_kv_stats_t;

/* clang-format off */
#define SKV_KV_STATS_INIT                                                                          \
  {                                                                                                \
    sizeof(skv_kv_stats_t), /* size: the rest is output */                                         \
    0,                      /* page_bytes */                                                       \
    0,                      /* pages_per_pe */                                                     \
    0,                      /* pages_used */                                                       \
    0,                      /* pages_pinned */                                                     \
    0,                      /* index_slots */                                                      \
    0,                      /* index_entries */                                                    \
    0,                      /* lookups */                                                          \
    0,                      /* lookup_hits */                                                      \
    0,                      /* published */                                                        \
    0,                      /* deduplicated */                                                     \
    0,                      /* evicted */                                                          \
    0,                      /* stale */                                                            \
    0                       /* index_full */                                                       \
  }
/* clang-format on */

/* Collective: every local PE gets `pages_per_pe` pages of `geom` in a heap of `backend`; page
 * metadata and the index live in node-shared host memory. All or nothing: when one PE fails,
 * every PE fails at once with its code, naming it. */
SKV_EXTERN int skv_kv_create(skv_ctx_t *ctx, const skv_geometry_t *geom, const skv_kv_opts_t *opts,
                             skv_kv_t **kv);
/* Collective. Pages pinned by peers are released with the heap. */
SKV_EXTERN int skv_kv_destroy(skv_kv_t *kv);
SKV_EXTERN int skv_kv_get_stats(const skv_kv_t *kv, skv_kv_stats_t *stats);
SKV_EXTERN skv_heap_t *skv_kv_get_heap(const skv_kv_t *kv);

/* ---- The elastic node domain: processes attach and detach at any time -------------------- */

/* A named node-wide KV cache that processes attach to and detach from whenever they like: no
 * collective, no server process, no fixed number of PEs. An OWNER keeps pages of its own (and
 * publishes, looks up, fetches); a READER has none (looks up, and fetches into its own memory; it
 * may run without a GPU, and then fetches only pages kept in host memory). The first attacher
 * creates the domain, the last one out removes it (nothing stays in /dev/shm); a domain whose
 * processes all died is laid out afresh by the next attacher. Pages of an owner that leaves or
 * dies are taken out of the index first: a reference to them is stale (SKV_ESTALE), never read
 * from freed memory. Only this user's processes may attach, unless a group is given.
 * docs/architecture.md ("The elastic domain") has the protocol. */
typedef enum skv_role { SKV_ROLE_OWNER = 1, SKV_ROLE_READER = 2 } skv_role_t;

#define SKV_ATTACH_OPTS_VERSION 1
typedef struct skv_attach_opts {
  size_t size;               /* sizeof(skv_attach_opts_t) */
  uint32_t version;          /* SKV_ATTACH_OPTS_VERSION */
  int32_t role;              /* SKV_ROLE_OWNER or SKV_ROLE_READER */
  int32_t backend;           /* where the pages live; an owner's must be the domain's */
  int32_t timeout_ms;        /* bound on every wait; -1: SKV_TIMEOUT_MS, else 60000 */
  int32_t device;            /* CUDA device; -1: SKV_DEVICE, else 0 */
  int32_t group;             /* -1: this user alone (mode 0600); else this gid's members too */
  uint32_t max_slots;        /* processes at most, 1..64; 0: the domain's (64 for a new one) */
  uint32_t flags;            /* reserved, 0 */
  uint64_t pages_per_pe;     /* each owner's pages; 0: the domain's (1024 for a new one) */
  uint64_t index_slots;      /* 0: 4 per page of the whole domain */
  const skv_namespace_t *ns; /* NULL, or the one namespace the domain serves (checked) */
} skv_attach_opts_t;

/* clang-format off */
#define SKV_ATTACH_OPTS_INIT                                                                       \
  {                                                                                                \
    sizeof(skv_attach_opts_t), /* size */                                                          \
    SKV_ATTACH_OPTS_VERSION,   /* version */                                                       \
    SKV_ROLE_OWNER,            /* role */                                                          \
    SKV_BACKEND_HOST,          /* backend */                                                       \
    -1,                        /* timeout_ms: SKV_TIMEOUT_MS, else 60000 */                        \
    -1,                        /* device: SKV_DEVICE, else 0 */                                    \
    -1,                        /* group: this user alone */                                        \
    0,                         /* max_slots: the domain's, or 64 */                                \
    0,                         /* flags */                                                         \
    0,                         /* pages_per_pe: the domain's, or 1024 */                           \
    0,                         /* index_slots: 4 per page of the domain */                         \
    NULL                       /* ns: any */                                                       \
  }
/* clang-format on */

/* Attach this process to the domain `name` (1..48 of [A-Za-z0-9._-]), creating it when absent,
 * as the role opts.role says (opts NULL: an owner with host pages). The handle works with every
 * skv_kv_* call (publish needs an owner); skv_kv_detach (or skv_kv_destroy) leaves. A geometry,
 * backend, capacity or namespace that disagrees with the domain's fails with SKV_EINVAL naming
 * the difference; a domain of another user with -EACCES; a full one with SKV_ENOSPC. */
SKV_EXTERN int skv_kv_attach(const char *name, const skv_geometry_t *geom,
                             const skv_attach_opts_t *opts, skv_kv_t **kv);
/* Leave the domain: an owner's pages leave the index first (pins other processes hold on them
 * are waited for, bounded by the timeout), then the mappings go; the last process out removes
 * the domain. Frees `kv`. */
SKV_EXTERN int skv_kv_detach(skv_kv_t *kv);

enum { SKV_LOOKUP_PIN = 1u }; /* pin every hit (release with skv_kv_unpin) */

/* How many leading keys of the chain are cached anywhere on the node (stops at the first
 * miss); refs[0..*nhit) say where. `ns` must be the namespace the keys were made in. */
SKV_EXTERN int skv_kv_lookup(skv_kv_t *kv, const skv_namespace_t *ns, const skv_key_t *keys,
                             size_t n, uint32_t flags, skv_page_ref_t *refs, size_t *nhit);
/* Release pins taken by skv_kv_lookup(SKV_LOOKUP_PIN). */
SKV_EXTERN int skv_kv_unpin(skv_kv_t *kv, const skv_page_ref_t *refs, size_t n);

/* SKV_FETCH_UNPIN: also release the caller's lookup pins once copied. Every reference must hold
 * one of this PE's pins (a page listed k times: k pins), checked before anything is copied:
 * otherwise SKV_EINVAL and nothing written. */
enum { SKV_FETCH_UNPIN = 1u };

/* Copy pages refs[0..n) into the engine's blocks: page i fills blocks
 * block_ids[i*m .. i*m+m) with m = page_tokens / block_tokens; the ids must be distinct (they
 * are range-checked, not checked for duplicates: a block named twice ends up with either page's
 * bytes, on a GPU possibly a mix of both). Each page is pinned (its
 * generation checked) for the copy: a stale reference fails with SKV_ESTALE, and neither its
 * blocks nor those of the references after it are written. A GPU fetch of fewer than
 * SKV_FETCH_GATE_PAGES pages (default 256) writes nothing then. A larger one that is one launch
 * of the copy kernels (up to 4096 pages, not SKV_FETCH_KERNEL=ce, not under
 * CUDA_LAUNCH_BLOCKING) launches its copy first and pins while the copy waits for the pages (the
 * pins then cost the call no time before the copy): on SKV_ESTALE the blocks of the references
 * pinned before the stale one's run of 64 may be written, with their pages' bytes, by the copy
 * still enqueued on `stream` (the message says which). `stream`: a cudaStream_t for
 * GPU layouts (NULL: the legacy default stream): the copy is one kernel launch per batch of up to
 * 4096 pages, stream-ordered, and the pins are released by the cache's completion thread once it
 * completes (the stream carries only the copy and an event); host layouts copy synchronously. While
 * `stream` is being captured into a CUDA graph, every reference must already be pinned by this PE
 * (skv_kv_lookup with SKV_LOOKUP_PIN; else SKV_ECAPTURE): a captured fetch takes no pins, so the
 * caller keeps them for as long as it replays the graph, and releases them with skv_kv_unpin
 * afterwards (SKV_FETCH_UNPIN is refused while capturing). Each captured fetch keeps one of the
 * cache's 8 graph argument slots for the cache's lifetime (SKV_ECAPTURE when they are all taken).
 */
SKV_EXTERN int skv_kv_fetch(skv_kv_t *kv, const skv_page_ref_t *refs, size_t n,
                            const skv_layout_t *dst, const uint64_t *block_ids, uint32_t flags,
                            void *stream);
/* Copy engine blocks into new pages of this PE and insert keys[0..n) once the copy is
 * complete. A key already cached (by any PE) is skipped (on a page of this PE, that counts as a
 * use of the page, as a lookup hit: the call's evictions after it spare it; a batch of several
 * windows, over 256 keys, finds the keys of a later window after an earlier window's evictions,
 * and copies again those they took); one that another publish (any PE) claimed first is skipped
 * before anything is copied (counted as deduplicated): each key's index slot is claimed at the call
 * and found by readers only once its copy is complete. Least recently used unpinned pages of this
 * PE are evicted to make room. *ninserted (optional) counts keys this call inserted; for GPU
 * layouts the copy is stream-ordered and the keys are inserted by the completion thread after it,
 * so *ninserted counts the pages queued (skv_kv_sync waits for the inserts; the stats count what
 * was inserted and deduplicated). Refused (SKV_ECAPTURE) while `stream` is being captured: a replay
 * would write into pages that may have been evicted and reused since. */
SKV_EXTERN int skv_kv_publish(skv_kv_t *kv, const skv_namespace_t *ns, const skv_key_t *keys,
                              size_t n, const skv_layout_t *src, const uint64_t *block_ids,
                              void *stream, size_t *ninserted);
/* Publishing in parts (an engine saving each layer as its forward computes it): reserve pages,
 * write them with layouts of some layers (skv_layout_create_layers) as often as needed, then
 * commit: the keys are inserted only then, so no reader ever finds a page before every one of
 * its layers was written. A reserved page is this PE's, WRITING: no one can pin, read or evict
 * it until it is committed or aborted, so reserve shortly before writing and commit or abort
 * every reservation (a detaching or dying owner's reservations are freed).
 *
 * skv_kv_reserve: a page of this PE for each key of keys[0..n) not cached yet (by any PE).
 * refs[i] gets the page of key i, or generation 0 where there is nothing to write: the key is
 * cached already, or no page could be had (every page of this PE pinned or being written;
 * reservation stops at the first such key). *nreserved (optional) counts the pages reserved.
 * Owners only (SKV_ESTATE for a domain's reader). */
SKV_EXTERN int skv_kv_reserve(skv_kv_t *kv, const skv_namespace_t *ns, const skv_key_t *keys,
                              size_t n, skv_page_ref_t *refs, size_t *nreserved);
/* Copy engine blocks into reserved pages: page refs[i] from blocks block_ids[i*m .. i*m+m) (m =
 * page_tokens / block_tokens), only the layers `src` covers. References of generation 0 (and
 * their blocks) are skipped; every other one must be a page this PE reserved and has not
 * committed or aborted (SKV_ESTATE otherwise, checked before any byte is copied). GPU layouts:
 * stream-ordered on `stream` (a cudaStream_t; NULL: the legacy default stream), refused while
 * it is captured (SKV_ECAPTURE); host layouts copy synchronously. */
SKV_EXTERN int skv_kv_write(skv_kv_t *kv, const skv_page_ref_t *refs, size_t n,
                            const skv_layout_t *src, const uint64_t *block_ids, void *stream);
/* Insert keys[i] for page refs[i] (the arrays skv_kv_reserve took and filled; generation 0
 * skipped) and hand the pages to the cache, as skv_kv_publish does once its copy is done: a key
 * another PE inserted meanwhile is deduplicated (its page freed). The caller must have written
 * every layer of every page. Stream-ordered on `stream` when the cache's pages are GPU pages or
 * host pages GPUs write (cuda, cuda_host) and a GPU is in use here (the inserts wait for what was
 * enqueued on `stream` before: pass the stream of the writes, or one ordered after them;
 * skv_kv_sync waits for the inserts), else at once. *ninserted (optional): keys inserted, or,
 * stream-ordered, pages queued. Each page is finished once: a reference listed twice, or one
 * that another thread commits or aborts meanwhile, fails the call with SKV_ESTATE before anything
 * is done; when queueing fails part-way (a CUDA error), the pages not queued stay reserved, to
 * commit or abort again (a detach frees them), and are never freed under writes in flight. */
SKV_EXTERN int skv_kv_commit(skv_kv_t *kv, const skv_namespace_t *ns, const skv_key_t *keys,
                             size_t n, const skv_page_ref_t *refs, void *stream, size_t *ninserted);
/* Give reserved pages back unpublished (generation 0 skipped), ordered on `stream` as
 * skv_kv_commit is, so that no write still in flight lands in a page reused since. */
SKV_EXTERN int skv_kv_abort(skv_kv_t *kv, const skv_page_ref_t *refs, size_t n, void *stream);
/* Evict up to `npages` of this PE's least recently used unpinned pages. */
SKV_EXTERN int skv_kv_evict(skv_kv_t *kv, uint64_t npages, uint64_t *nevicted);
/* Keep `npages` of this PE's pages free for the next publish (0, the default: none). After each
 * skv_kv_publish and skv_kv_commit, the cache's publish helper thread evicts least recently used
 * unpinned pages in the background until that many are free, so that the next publish of up to
 * `npages` pages allocates without evicting (an eviction is an index erase per page, on the
 * publish's critical path otherwise). A publish that comes while it runs stops it (within one
 * run of 64 evictions) and evicts what it still needs itself; so does setting 0, and a fork
 * waits for the run in progress. The cost: up to `npages` fewer pages cached. An engine sets it
 * to the pages it publishes after one forward pass. Nothing is evicted ahead without the helper
 * (SKV_PUBLISH_HELPER=0, a thread allowed on one CPU only, a forked child). SKV_EINVAL over
 * half the pages of a PE; SKV_ESTATE for a reader of a domain (it publishes nothing). */
SKV_EXTERN int skv_kv_set_free_reserve(skv_kv_t *kv, uint64_t npages);
/* Wait until this PE's stream-ordered publishes and fetches have completed their host-side
 * steps (index inserts, pin releases); bounded by the timeout. Returns the first failure of
 * those steps, or a reference or block id a copy kernel refused (SKV_ERANGE / SKV_EINVAL; only
 * possible when arguments changed after the host checked them, e.g. a graph replayed after its
 * pages were unpinned; synchronise the stream first to see a replay's). */
SKV_EXTERN int skv_kv_sync(skv_kv_t *kv);

/* ---- Across nodes: pages over UCX, a cluster directory in Redis ------------------------- */

/* A cluster handle joins an attached (or created) cache to a cluster of nodes: the pages this
 * process owns are registered with UCX and readable one-sidedly by other nodes; the keys it
 * publishes through skv_cluster_publish go to a Redis directory (key -> node, page, generation),
 * asynchronously and batched; skv_cluster_lookup takes the longest prefix from the node's own
 * index, then the rest from the directory; skv_cluster_fetch copies local hits as skv_kv_fetch
 * does and reads remote ones with UCX gets, one batch per peer node, checking each page's
 * generation after the read (a page evicted meanwhile is SKV_ESTALE, never copied out).
 * Without a Redis URL (opts.redis_url, else SKV_REDIS_URL) the handle is node-local: lookup,
 * fetch and publish are the skv_kv_* calls, and nothing else runs. A build without UCX or
 * hiredis (SKV_CLUSTER=OFF, or the packages absent) has only the node-local handle: a Redis URL
 * then fails with SKV_ENOTSUP. UCX reads its own environment (UCX_TLS, UCX_NET_DEVICES...).
 * docs/cluster.md has the deployment, the failure semantics and the directory's layout. */
typedef struct skv_cluster skv_cluster_t;

#define SKV_CLUSTER_OPTS_VERSION 1
typedef struct skv_cluster_opts {
  size_t size;           /* sizeof(skv_cluster_opts_t) */
  uint32_t version;      /* SKV_CLUSTER_OPTS_VERSION */
  int32_t timeout_ms;    /* bound on every wait (Redis, UCX); -1: SKV_TIMEOUT_MS, else 60000 */
  int32_t lease_ms;      /* directory lease of this node's entries; -1: SKV_CLUSTER_LEASE_MS */
  uint32_t flags;        /* SKV_CLUSTER_NO_EXPORT, SKV_CLUSTER_GPU_DIRECT or 0 */
  const char *redis_url; /* redis://HOST:PORT[/DB]; NULL: SKV_REDIS_URL; neither: node-local */
  const char *node;      /* this node's name in the directory (1..63 of [A-Za-z0-9._:-]);
                          * NULL: HOSTNAME:PID */
  const char *cluster;   /* the directory's key prefix (same rule); NULL: "symkv" */
} skv_cluster_opts_t;

/* SKV_CLUSTER_NO_EXPORT: join to look up and read other nodes' pages only: this process's pages
 * are not exported (nor its keys put in the directory). Pages in GPU memory are exported through
 * UCX's CUDA support (a UCX built with CUDA, such as the libucx-cu12 wheel's: UCX_TLS must then
 * name cuda_copy); with a UCX without it, a cache with GPU pages needs this flag.
 * Remote pages bound for a GPU layout are read by UCX either straight into GPU memory (then
 * scattered into the blocks on the GPU), which pays where the transport writes GPU memory itself
 * (cuda_ipc, gdr_copy, GPUDirect RDMA), or into pinned host memory that the copy kernels read,
 * which is faster over TCP and shared memory (docs/cluster.md has the figures). By default
 * symkv chooses per peer node from the transports of UCX's endpoint to it (UCX 1.14 on; older:
 * pinned host memory). SKV_CLUSTER_GPU_DIRECT: always straight into GPU memory (needs a UCX with
 * CUDA); SKV_CLUSTER_HOST_STAGING: always through pinned host memory. */
enum { SKV_CLUSTER_NO_EXPORT = 1u, SKV_CLUSTER_GPU_DIRECT = 2u, SKV_CLUSTER_HOST_STAGING = 4u };

/* clang-format off */
#define SKV_CLUSTER_OPTS_INIT                                                                      \
  {                                                                                                \
    sizeof(skv_cluster_opts_t), /* size */                                                         \
    SKV_CLUSTER_OPTS_VERSION,   /* version */                                                      \
    -1,                         /* timeout_ms: SKV_TIMEOUT_MS, else 60000 */                       \
    -1,                         /* lease_ms: SKV_CLUSTER_LEASE_MS, else 10000 */                   \
    0,                          /* flags */                                                        \
    NULL,                       /* redis_url: SKV_REDIS_URL */                                     \
    NULL,                       /* node: HOSTNAME:PID */                                           \
    NULL                        /* cluster: "symkv" */                                             \
  }
/* clang-format on */

/* A page anywhere in the cluster: `node` is SKV_NODE_LOCAL for this node's own pages (then pe,
 * page and gen are an skv_page_ref_t's), else a peer node's number in this handle. */
#define SKV_NODE_LOCAL 0xffffffffu
typedef struct skv_cluster_ref {
  uint32_t node;
  uint32_t pe;
  uint32_t page;
  uint32_t gen;
} skv_cluster_ref_t;

/* Filled by skv_cluster_get_stats (SKV_CLUSTER_STATS_INIT sets `size`). */
typedef struct skv_cluster_stats {
  size_t size;                         /* in: sizeof(skv_cluster_stats_t) */
  uint64_t exported_pages;             /* this process's pages in the directory now */
  uint64_t dir_puts, dir_dels;         /* directory writes done (entries added / removed) */
  uint64_t dir_errors;                 /* directory operations that failed (Redis unreachable) */
  uint64_t dir_reconnects;             /* reconnections to Redis (each republishes everything) */
  uint64_t lookups, local_hits;        /* keys asked, found on this node */
  uint64_t remote_hits;                /* keys found in the directory */
  uint64_t remote_pages, remote_bytes; /* pages and bytes read from peer nodes */
  uint64_t remote_stale;               /* remote pages found evicted after (or before) the read */
  uint64_t peer_failures;              /* fetches that failed because a peer node was unreachable */
  uint64_t remote_pins;                /* remote pages pinned by lookups (SKV_LOOKUP_PIN) */
  uint64_t remote_direct_pages;        /* of remote_pages: read by UCX straight into GPU memory */
} skv_cluster_stats_t;

#define SKV_CLUSTER_STATS_INIT \
  { sizeof(skv_cluster_stats_t), 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0 }

/* Join `kv` (its owner's pages, if any, are exported) to the cluster. With Redis configured:
 * connects (SKV_ECONN naming the URL when Redis does not answer: the cache itself goes on
 * node-locally), creates a UCX context and worker, registers this process's pages and their
 * records, and publishes the node (worker address, memory keys) under a lease that a background
 * thread renews. One handle per `kv`; the kv must outlive it. */
SKV_EXTERN int skv_cluster_join(skv_kv_t *kv, const skv_cluster_opts_t *opts, skv_cluster_t **cl);
/* Leave: this node's directory entries are removed (best effort, bounded), peers are
 * disconnected, memory deregistered. Frees `cl`; the kv stays. */
SKV_EXTERN int skv_cluster_leave(skv_cluster_t *cl);
/* skv_kv_publish, then queue the keys this process now holds for the directory (batched, in the
 * background; skv_cluster_flush waits for them). */
SKV_EXTERN int skv_cluster_publish(skv_cluster_t *cl, const skv_namespace_t *ns,
                                   const skv_key_t *keys, size_t n, const skv_layout_t *src,
                                   const uint64_t *block_ids, void *stream, size_t *ninserted);
/* Wait (bounded by the timeout) until every directory write queued so far is in Redis. */
SKV_EXTERN int skv_cluster_flush(skv_cluster_t *cl);
/* How many leading keys are cached anywhere: refs[0..*nlocal) on this node (as skv_kv_lookup),
 * refs[*nlocal..*nhit) on peer nodes, from the directory (one round trip to Redis). A remote
 * entry whose node left or lost its lease ends the prefix. With SKV_LOOKUP_PIN every hit is
 * pinned, the remote ones on their nodes (one batch of atomic adds per peer, then their states
 * read back: a page found evicted meanwhile ends the prefix); release them with
 * skv_cluster_fetch(SKV_FETCH_UNPIN) or skv_cluster_unpin. A node keeps remote pins of a page
 * while any node pins or unpins it at least once per pin lease (SKV_PIN_LEASE_MS of the owner):
 * pins of a node that died or hangs lapse so. When Redis cannot be reached the call returns
 * SKV_ECONN with the node-local hits filled in (*nhit == *nlocal), so the caller can go on with
 * them. */
SKV_EXTERN int skv_cluster_lookup(skv_cluster_t *cl, const skv_namespace_t *ns,
                                  const skv_key_t *keys, size_t n, uint32_t flags,
                                  skv_cluster_ref_t *refs, size_t *nlocal, size_t *nhit);
/* Copy pages refs[0..n) into the engine's blocks as skv_kv_fetch does (same block_ids rule;
 * local references exactly as there, flags and stream included). Remote pages (the bytes of
 * the layout's layers) are read with UCX gets into a registered host buffer, one pipelined
 * batch per peer node, and each page's generation is read after its bytes: a page evicted or
 * reused before or during the read fails with SKV_ESTALE and is not copied into its blocks
 * (earlier batches may have been). Checked pages go into host layouts with the host copy,
 * into GPU layouts (a cache with the CUDA backend) with the copy kernels reading the buffer,
 * which is pinned for CUDA. Host layouts: synchronous, the pages are in their blocks when the
 * call returns. GPU layouts: stream-ordered, as local fetches: the call enqueues on `stream` a
 * wait (cuStreamWaitValue64: no SM busy) and the copies, and returns; a thread of the handle
 * reads the pages into a pinned ring, then lets the stream go on. The copies come after what
 * `stream` held before the call and before what it gets after. A read that fails then
 * (SKV_ESTALE, SKV_EPEERDEAD, SKV_ETIMEDOUT) lets the stream go on all the same, with the
 * failed pages' blocks filled with 0xFF bytes (NaN in 16-bit floats), and skv_cluster_sync
 * returns the failure: call it before the blocks are trusted. `dst` must stay until then.
 * Synchronous also for GPU layouts: a fetch of more than 64 MiB of remote pages, and a call
 * with a node whose reads could make CUDA calls here (read into GPU memory, a CUDA transport
 * such as cuda_ipc, a UCX with CUDA older than 1.14); also after a driver could not hold a
 * stream (a warning).
 * SKV_ECAPTURE while `stream` is captured. SKV_FETCH_UNPIN releases the pins of every
 * reference, remote ones included, also when the reads fail. A peer that does not answer
 * within the timeout, or dies, fails with SKV_EPEERDEAD naming it. A lookup of the same handle
 * waits for a read in flight. */
SKV_EXTERN int skv_cluster_fetch(skv_cluster_t *cl, const skv_cluster_ref_t *refs, size_t n,
                                 const skv_layout_t *dst, const uint64_t *block_ids, uint32_t flags,
                                 void *stream);
/* Wait (bounded by the timeout) until this handle's stream-ordered remote fetches have read
 * their pages (their streams may go on), then skv_kv_sync. Returns the first failure of those
 * reads since the last call (SKV_ESTALE, SKV_EPEERDEAD...: those pages' blocks hold 0xFF
 * bytes once the stream gets there), else skv_kv_sync's. */
SKV_EXTERN int skv_cluster_sync(skv_cluster_t *cl);
/* Release pins taken by skv_cluster_lookup(SKV_LOOKUP_PIN), local and remote, without a fetch
 * (a peer that cannot be reached keeps them until they lapse). A remote reference this handle
 * does not pin (as often as it is listed) fails the call with SKV_EINVAL before any is
 * released, as skv_cluster_fetch(SKV_FETCH_UNPIN) does before it reads anything: an unpin too
 * many would take away another node's pin. */
SKV_EXTERN int skv_cluster_unpin(skv_cluster_t *cl, const skv_cluster_ref_t *refs, size_t n);
SKV_EXTERN int skv_cluster_get_stats(const skv_cluster_t *cl, skv_cluster_stats_t *stats);
/* Name of peer node `node` of this handle (as in skv_cluster_ref_t), or NULL. */
SKV_EXTERN const char *skv_cluster_node_name(const skv_cluster_t *cl, uint32_t node);

/* ------------------------------------------------------------------------------------------ */
/* Tensor-parallel collectives, signals and barrier                                           */
/* ------------------------------------------------------------------------------------------ */

typedef enum skv_dtype { SKV_DTYPE_BF16 = 1, SKV_DTYPE_FP16 = 2, SKV_DTYPE_FP32 = 3 } skv_dtype_t;
typedef enum skv_op { SKV_OP_SUM = 0, SKV_OP_MAX = 1, SKV_OP_MIN = 2 } skv_op_t;
typedef enum skv_algo {
  SKV_ALGO_AUTO = 0,    /* the fastest for this size and PE count (measured crossovers) */
  SKV_ALGO_ONESHOT = 1, /* every PE reads every peer's input and reduces */
  SKV_ALGO_TWOSHOT = 2, /* reduce-scatter, then all-gather */
  SKV_ALGO_NCCL = 3,    /* ncclAllReduce on a communicator made through the bootstrap */
} skv_algo_t;
typedef enum skv_signal_op { SKV_SIGNAL_SET = 0, SKV_SIGNAL_ADD = 1 } skv_signal_op_t;
typedef enum skv_cmp {
  SKV_CMP_EQ = 0,
  SKV_CMP_NE = 1,
  SKV_CMP_GE = 2,
  SKV_CMP_GT = 3,
  SKV_CMP_LT = 4,
  SKV_CMP_LE = 5
} skv_cmp_t;
/* Whether `have` compares true with `want` under `cmp` (SKV_CMP_*; any other value compares as
 * SKV_CMP_LE): the one definition behind skv_comm_wait on either backend and skv_dev_cmp. A plain
 * expression, for C and CUDA device code alike; `have` and `want` are each evaluated exactly
 * once, `cmp` up to five times (pass it without side effects). */
#define SKV_CMP_HOLDS(have, cmp, want)      \
  ((cmp) == SKV_CMP_EQ   ? (have) == (want) \
   : (cmp) == SKV_CMP_NE ? (have) != (want) \
   : (cmp) == SKV_CMP_GE ? (have) >= (want) \
   : (cmp) == SKV_CMP_GT ? (have) > (want)  \
   : (cmp) == SKV_CMP_LT ? (have) < (want)  \
                         : (have) <= (want))

typedef struct skv_comm skv_comm_t;

#define SKV_COMM_OPTS_VERSION 1
typedef struct skv_comm_opts {
  size_t size;        /* sizeof(skv_comm_opts_t) */
  uint32_t version;   /* SKV_COMM_OPTS_VERSION */
  int32_t backend;    /* SKV_BACKEND_CUDA (GPU buffers, streams) or SKV_BACKEND_HOST (CPU) */
  uint32_t channels;  /* independent flag sets (one per concurrent stream), 1..64; 0: 4 */
  uint32_t flags;     /* SKV_COMM_NO_NCCL, SKV_COMM_CHECKED (below) */
  uint64_t max_bytes; /* largest message of the symmetric algorithms; 0: 64 MiB */
} skv_comm_opts_t;

/* SKV_COMM_NO_NCCL: do not create an NCCL communicator. SKV_COMM_CHECKED: checking mode, every
 * all-reduce and barrier is checked against every peer's (kind, dtype, op, algorithm, count,
 * channel) before it runs; a mismatch fails on every PE with SKV_EMISMATCH naming both calls
 * (CUDA: reported by skv_comm_check, the call's kernel does nothing) and breaks the comm. Costs
 * one flag round trip per call (docs/comm.md, "Checking mode"); SKV_COMM_CHECK=1 turns it on
 * for every comm. Every PE must create the comm with the same setting. */
enum { SKV_COMM_NO_NCCL = 1u, SKV_COMM_CHECKED = 2u };

/* clang-format off */
#define SKV_COMM_OPTS_INIT                                                                         \
  {                                                                                                \
    sizeof(skv_comm_opts_t), /* size */                                                            \
    SKV_COMM_OPTS_VERSION,   /* version */                                                         \
    SKV_BACKEND_CUDA,        /* backend */                                                         \
    0,                       /* channels: 4 */                                                     \
    0,                       /* flags: none */                                                     \
    0                        /* max_bytes: 64 MiB */                                               \
  }
/* clang-format on */

/* Collective: a symmetric heap for signals and scratch, and (CUDA) an NCCL communicator. */
SKV_EXTERN int skv_comm_create(skv_ctx_t *ctx, const skv_comm_opts_t *opts, skv_comm_t **comm);
/* Collective. */
SKV_EXTERN int skv_comm_destroy(skv_comm_t *comm);
/* The comm's heap: buffers inside its data area are used in place (zero copy). */
SKV_EXTERN skv_heap_t *skv_comm_get_heap(const skv_comm_t *comm);

/* out[i] = op over PEs of in[i], i < count; identical on every PE, bit for bit. In place when
 * in == out. CUDA: device pointers, stream-ordered on `stream` (cudaStream_t, NULL = legacy
 * default), capturable in CUDA graphs (no host synchronisation, no allocation: SKV_ECAPTURE
 * if an allocation would be needed during capture). Two streams must use different channels.
 * Host backend: host pointers, synchronous, stream must be NULL. */
SKV_EXTERN int skv_comm_allreduce(skv_comm_t *comm, const void *in, void *out, size_t count,
                                  skv_dtype_t dtype, skv_op_t op, skv_algo_t algo, int channel,
                                  void *stream);

/* Signals: 64-bit slots in the signal pad (slot < skv_comm_get_signal_slots()). Stream-ordered. */
SKV_EXTERN int skv_comm_get_signal_slots(const skv_comm_t *comm);
/* Set or add `value` to slot `slot` of PE `pe`. */
SKV_EXTERN int skv_comm_signal(skv_comm_t *comm, int pe, uint32_t slot, uint64_t value,
                               skv_signal_op_t op, void *stream);
/* Wait until this PE's slot compares true with `value` (SKV_CMP_*), bounded by the timeout. */
SKV_EXTERN int skv_comm_wait(skv_comm_t *comm, uint32_t slot, skv_cmp_t cmp, uint64_t value,
                             void *stream);
/* All PEs, stream-ordered, bounded by the timeout. */
SKV_EXTERN int skv_comm_barrier(skv_comm_t *comm, int channel, void *stream);
/* Device-side failures of earlier stream-ordered calls (a wait or barrier that timed out): 0,
 * or the error with its message in skv_last_error(). Clears it. */
SKV_EXTERN int skv_comm_check(skv_comm_t *comm);

#ifdef __cplusplus
}
#endif

#ifndef SKV_NO_DEPRECATED
#include "symkv_deprecated.h" /* the names before 0.2, for one more release */
#endif
#endif /* SYMKV_H */
