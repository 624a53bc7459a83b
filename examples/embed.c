/* An engine embedding symkv: rank 0 prefills a prompt and publishes its KV pages; every PE then
 * finds the prompt's cached prefix on the node and copies it into its own paged KV cache. */
#include <symkv.h>
#include <stdio.h>
#include <stdlib.h>

#define CHECK(call)                                                \
  do {                                                             \
    if ((call) != 0) {                                             \
      fprintf(stderr, "%s failed: %s\n", #call, skv_last_error()); \
      exit(1);                                                     \
    }                                                              \
  } while (0)

enum { LAYERS = 32, BLOCKS = 64, PAGE_TOKENS = 16, PROMPT = 200 };

int main(void) {
  skv_ctx_t *ctx;
  CHECK(skv_init(NULL, &ctx)); /* rank, world size, store: from symkv-run's environment */
  int rank = skv_ctx_get_rank(ctx);

  skv_geometry_t g = SKV_GEOMETRY_INIT; /* Llama-3-8B: one page = 16 tokens = one block */
  g.num_layers = LAYERS, g.num_kv_heads = 8, g.head_dim = 128, g.elem_bytes = 2;
  g.page_tokens = PAGE_TOKENS;

  /* The engine's paged KV cache: one tensor per layer in vLLM's FlashAttention layout,
   * (2, BLOCKS, 16, 8, 128) bf16; host memory here (device -1), a GPU's in an engine. */
  uint64_t layer_bytes;
  CHECK(skv_layout_get_preset_layer_bytes(&g, SKV_LAYOUT_VLLM_FLASH_NHD, PAGE_TOKENS, BLOCKS,
                                          &layer_bytes));
  void *layer[LAYERS];
  for (int l = 0; l < LAYERS; l++)
    if (!(layer[l] = calloc(1, layer_bytes))) return 1;
  skv_layout_t *layout;
  CHECK(skv_layout_create_preset(&g, SKV_LAYOUT_VLLM_FLASH_NHD, PAGE_TOKENS, BLOCKS, layer, -1,
                                 &layout));

  skv_kv_opts_t o = SKV_KV_OPTS_INIT; /* host backend; SKV_BACKEND_CUDA for GPU pages */
  o.pages_per_pe = 256;
  skv_kv_t *kv;
  CHECK(skv_kv_create(ctx, &g, &o, &kv)); /* collective */
  skv_namespace_t *ns;                    /* the key space: model, geometry, a tenant's salt */
  CHECK(skv_namespace_create("llama-3-8b", &g, "tenant-a", 8, NULL, 0, &ns));

  uint32_t tokens[PROMPT]; /* the prompt's token ids, from the engine's tokenizer */
  for (int i = 0; i < PROMPT; i++) tokens[i] = (uint32_t)(1000 + i);
  skv_key_t keys[PROMPT / PAGE_TOKENS];
  size_t nkeys; /* one key per full page: 12 */
  CHECK(skv_namespace_hash_tokens(ns, tokens, PROMPT, NULL, keys, PROMPT / PAGE_TOKENS, &nkeys));

  /* block_ids: the engine's block table for this request, one block per page here */
  uint64_t block_ids[PROMPT / PAGE_TOKENS];
  for (size_t i = 0; i < nkeys; i++) block_ids[i] = (uint64_t)(rank * 16 + (int)i) % BLOCKS;

  if (rank == 0) { /* rank 0 computed the prompt's KV ("prefill") and publishes it */
    size_t inserted;
    CHECK(skv_kv_publish(kv, ns, keys, nkeys, layout, block_ids, NULL, &inserted));
  }
  CHECK(skv_ctx_barrier(ctx));

  skv_page_ref_t refs[PROMPT / PAGE_TOKENS];
  size_t nhit; /* the prompt's longest prefix cached on the node, pinned */
  CHECK(skv_kv_lookup(kv, ns, keys, nkeys, SKV_LOOKUP_PIN, refs, &nhit));
  CHECK(skv_kv_fetch(kv, refs, nhit, layout, block_ids, SKV_FETCH_UNPIN, NULL)); /* copy, unpin */
  /* ... prefill the tokens after the hits, then publish the pages that were missing: */
  CHECK(skv_kv_publish(kv, ns, keys + nhit, nkeys - nhit, layout, block_ids + nhit, NULL, NULL));
  printf("rank %d: %zu of %zu pages of the prompt came from the node's cache\n", rank, nhit, nkeys);

  CHECK(skv_ctx_barrier(ctx)); /* nobody destroys the cache while another PE reads it */
  CHECK(skv_namespace_destroy(ns));
  CHECK(skv_kv_destroy(kv)); /* collective */
  CHECK(skv_layout_destroy(layout));
  for (int l = 0; l < LAYERS; l++) free(layer[l]);
  CHECK(skv_finalize(ctx)); /* collective */
  return 0;
}
