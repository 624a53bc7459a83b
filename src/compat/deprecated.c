/* The deprecated names of the public API (include/symkv_deprecated.h): each calls the function
 * that replaced it. Built on the public API alone, above every layer. */
#include "symkv.h"

int skv_ctx_rank(const skv_ctx_t *ctx) {
  return skv_ctx_get_rank(ctx);
}

int skv_ctx_world_size(const skv_ctx_t *ctx) {
  return skv_ctx_get_world_size(ctx);
}

int skv_ctx_local_rank(const skv_ctx_t *ctx) {
  return skv_ctx_get_local_rank(ctx);
}

int skv_ctx_local_size(const skv_ctx_t *ctx) {
  return skv_ctx_get_local_size(ctx);
}

int skv_ctx_timeout_ms(const skv_ctx_t *ctx) {
  return skv_ctx_get_timeout_ms(ctx);
}

int skv_ctx_device(skv_ctx_t *ctx) {
  return skv_ctx_get_device(ctx);
}

void *skv_heap_ptr(const skv_heap_t *heap, int pe, uint64_t offset) {
  return skv_heap_get_ptr(heap, pe, offset);
}

int skv_geometry_page_bytes(const skv_geometry_t *geom, uint64_t *page_bytes) {
  return skv_geometry_get_page_bytes(geom, page_bytes);
}

int skv_layout_preset_layer_bytes(const skv_geometry_t *geom, skv_layout_preset_t preset,
                                  uint32_t block_tokens, uint64_t num_blocks, uint64_t *bytes) {
  return skv_layout_get_preset_layer_bytes(geom, preset, block_tokens, num_blocks, bytes);
}

int skv_namespace_id(const skv_namespace_t *ns, skv_key_t *id) {
  return skv_namespace_get_id(ns, id);
}

int skv_hash_tokens(const skv_namespace_t *ns, const uint32_t *tokens, size_t ntokens,
                    const skv_key_t *parent, skv_key_t *keys, size_t cap, size_t *nkeys) {
  return skv_namespace_hash_tokens(ns, tokens, ntokens, parent, keys, cap, nkeys);
}

int skv_key_from_bytes(const skv_namespace_t *ns, const void *bytes, size_t len, skv_key_t *key) {
  return skv_namespace_hash_bytes(ns, bytes, len, key);
}

skv_heap_t *skv_kv_heap(const skv_kv_t *kv) {
  return skv_kv_get_heap(kv);
}

int skv_lookup(skv_kv_t *kv, const skv_namespace_t *ns, const skv_key_t *keys, size_t n,
               uint32_t flags, skv_page_ref_t *refs, size_t *nhit) {
  return skv_kv_lookup(kv, ns, keys, n, flags, refs, nhit);
}

int skv_unpin(skv_kv_t *kv, const skv_page_ref_t *refs, size_t n) {
  return skv_kv_unpin(kv, refs, n);
}

int skv_fetch(skv_kv_t *kv, const skv_page_ref_t *refs, size_t n, const skv_layout_t *dst,
              const uint64_t *block_ids, uint32_t flags, void *stream) {
  return skv_kv_fetch(kv, refs, n, dst, block_ids, flags, stream);
}

int skv_publish(skv_kv_t *kv, const skv_namespace_t *ns, const skv_key_t *keys, size_t n,
                const skv_layout_t *src, const uint64_t *block_ids, void *stream,
                size_t *ninserted) {
  return skv_kv_publish(kv, ns, keys, n, src, block_ids, stream, ninserted);
}

int skv_evict(skv_kv_t *kv, uint64_t npages, uint64_t *nevicted) {
  return skv_kv_evict(kv, npages, nevicted);
}

skv_heap_t *skv_comm_heap(const skv_comm_t *comm) {
  return skv_comm_get_heap(comm);
}

int skv_allreduce(skv_comm_t *comm, const void *in, void *out, size_t count, skv_dtype_t dtype,
                  skv_op_t op, skv_algo_t algo, int channel, void *stream) {
  return skv_comm_allreduce(comm, in, out, count, dtype, op, algo, channel, stream);
}

int skv_comm_signal_slots(const skv_comm_t *comm) {
  return skv_comm_get_signal_slots(comm);
}

int skv_signal(skv_comm_t *comm, int pe, uint32_t slot, uint64_t value, skv_signal_op_t op,
               void *stream) {
  return skv_comm_signal(comm, pe, slot, value, op, stream);
}

int skv_wait(skv_comm_t *comm, uint32_t slot, skv_cmp_t cmp, uint64_t value, void *stream) {
  return skv_comm_wait(comm, slot, cmp, value, stream);
}

int skv_barrier(skv_comm_t *comm, int channel, void *stream) {
  return skv_comm_barrier(comm, channel, stream);
}

void skv_log_message(int level, unsigned int subsys, const char *msg) {
  skv_log_write(level, subsys, msg);
}
