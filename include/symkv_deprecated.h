/* symkv: the names of the public API before 0.2, kept as deprecated aliases for one release
 * (they go in 0.3). Each one calls the function it names; the rule that replaced them is in
 * docs/reference.md ("Names"). Included by symkv.h; define SKV_NO_DEPRECATED to leave them out. */
#ifndef SYMKV_DEPRECATED_H
#define SYMKV_DEPRECATED_H

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__) && !defined(SKV_BUILDING_LIBRARY)
#define SKV_DEPRECATED(msg) __attribute__((deprecated(msg)))
#else
#define SKV_DEPRECATED(msg)
#endif

SKV_EXTERN int skv_ctx_rank(const skv_ctx_t *ctx) SKV_DEPRECATED("use skv_ctx_get_rank");
SKV_EXTERN int skv_ctx_world_size(const skv_ctx_t *ctx)
    SKV_DEPRECATED("use skv_ctx_get_world_size");
SKV_EXTERN int skv_ctx_local_rank(const skv_ctx_t *ctx)
    SKV_DEPRECATED("use skv_ctx_get_local_rank");
SKV_EXTERN int skv_ctx_local_size(const skv_ctx_t *ctx)
    SKV_DEPRECATED("use skv_ctx_get_local_size");
SKV_EXTERN int skv_ctx_timeout_ms(const skv_ctx_t *ctx)
    SKV_DEPRECATED("use skv_ctx_get_timeout_ms");
SKV_EXTERN int skv_ctx_device(skv_ctx_t *ctx) SKV_DEPRECATED("use skv_ctx_get_device");
SKV_EXTERN void *skv_heap_ptr(const skv_heap_t *heap, int pe, uint64_t offset)
    SKV_DEPRECATED("use skv_heap_get_ptr");
SKV_EXTERN int skv_geometry_page_bytes(const skv_geometry_t *geom, uint64_t *page_bytes)
    SKV_DEPRECATED("use skv_geometry_get_page_bytes");
SKV_EXTERN int skv_layout_preset_layer_bytes(const skv_geometry_t *geom, skv_layout_preset_t preset,
                                             uint32_t block_tokens, uint64_t num_blocks,
                                             uint64_t *bytes)
    SKV_DEPRECATED("use skv_layout_get_preset_layer_bytes");
SKV_EXTERN int skv_namespace_id(const skv_namespace_t *ns, skv_key_t *id)
    SKV_DEPRECATED("use skv_namespace_get_id");
SKV_EXTERN int skv_hash_tokens(const skv_namespace_t *ns, const uint32_t *tokens, size_t ntokens,
                               const skv_key_t *parent, skv_key_t *keys, size_t cap, size_t *nkeys)
    SKV_DEPRECATED("use skv_namespace_hash_tokens");
SKV_EXTERN int skv_key_from_bytes(const skv_namespace_t *ns, const void *bytes, size_t len,
                                  skv_key_t *key) SKV_DEPRECATED("use skv_namespace_hash_bytes");
SKV_EXTERN skv_heap_t *skv_kv_heap(const skv_kv_t *kv) SKV_DEPRECATED("use skv_kv_get_heap");
SKV_EXTERN int skv_lookup(skv_kv_t *kv, const skv_namespace_t *ns, const skv_key_t *keys, size_t n,
                          uint32_t flags, skv_page_ref_t *refs, size_t *nhit)
    SKV_DEPRECATED("use skv_kv_lookup");
SKV_EXTERN int skv_unpin(skv_kv_t *kv, const skv_page_ref_t *refs, size_t n)
    SKV_DEPRECATED("use skv_kv_unpin");
SKV_EXTERN int skv_fetch(skv_kv_t *kv, const skv_page_ref_t *refs, size_t n,
                         const skv_layout_t *dst, const uint64_t *block_ids, uint32_t flags,
                         void *stream) SKV_DEPRECATED("use skv_kv_fetch");
SKV_EXTERN int skv_publish(skv_kv_t *kv, const skv_namespace_t *ns, const skv_key_t *keys, size_t n,
                           const skv_layout_t *src, const uint64_t *block_ids, void *stream,
                           size_t *ninserted) SKV_DEPRECATED("use skv_kv_publish");
SKV_EXTERN int skv_evict(skv_kv_t *kv, uint64_t npages, uint64_t *nevicted)
    SKV_DEPRECATED("use skv_kv_evict");
SKV_EXTERN skv_heap_t *skv_comm_heap(const skv_comm_t *comm)
    SKV_DEPRECATED("use skv_comm_get_heap");
SKV_EXTERN int skv_allreduce(skv_comm_t *comm, const void *in, void *out, size_t count,
                             skv_dtype_t dtype, skv_op_t op, skv_algo_t algo, int channel,
                             void *stream) SKV_DEPRECATED("use skv_comm_allreduce");
SKV_EXTERN int skv_comm_signal_slots(const skv_comm_t *comm)
    SKV_DEPRECATED("use skv_comm_get_signal_slots");
SKV_EXTERN int skv_signal(skv_comm_t *comm, int pe, uint32_t slot, uint64_t value,
                          skv_signal_op_t op, void *stream) SKV_DEPRECATED("use skv_comm_signal");
SKV_EXTERN int skv_wait(skv_comm_t *comm, uint32_t slot, skv_cmp_t cmp, uint64_t value,
                        void *stream) SKV_DEPRECATED("use skv_comm_wait");
SKV_EXTERN int skv_barrier(skv_comm_t *comm, int channel, void *stream)
    SKV_DEPRECATED("use skv_comm_barrier");
SKV_EXTERN void skv_log_message(int level, unsigned int subsys, const char *msg)
    SKV_DEPRECATED("use skv_log_write");

#ifdef __cplusplus
}
#endif
#endif /* SYMKV_DEPRECATED_H */
