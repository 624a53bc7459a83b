/* Namespaces and key hashing: XXH3-128 chains over explicitly serialised little-endian bytes,
 * keyed with the namespace id and the deployment secret. The byte format is docs/hashing.md. */
#define _GNU_SOURCE
#include "kv/keys.h"

#include "core/bytes.h"

#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#define XXH_STATIC_LINKING_ONLY /* XXH3_state_t on the stack */
#include <xxhash.h>

/* How it works (docs/hashing.md has the normative text and a worked example):
 *   id    = fix(XXH3_128(seed 0, "symkv-ns-v1" || lp(secret) || lp(model) || u32 kv_kind,
 *           num_layers, num_kv_heads, head_dim, elem_bytes, page_tokens || lp(salt)))
 *   seed  = id.lo ^ id.hi
 *   key_i = fix(XXH3_128(seed, 0x01 || id || key_{i-1} || page i's tokens as u32)), key_{-1} = id
 *   bytes = fix(XXH3_128(seed, 0x02 || id || the engine's bytes))
 * lp(x) is u32 length || x; a 128-bit value is hi then lo, each u64; every integer is little
 * endian; fix() maps hi == 0 to hi = 1. Only seeded XXH3-128 over plain bytes, so that any
 * xxHash binding (PyPI xxhash included) computes the same keys.
 *
 * What can go wrong: a format change silently splits every deployment's cache in two (old and
 * new processes stop finding each other's pages); tests/test_hash.c pins vectors, so change
 * the "v1" tag and the vectors together, never one without the other. */

#define NS_TAG       "symkv-ns-v1"
#define TAG_PAGE     0x01
#define TAG_BYTES    0x02
#define PREFIX_BYTES 33 /* tag, id, previous key */
#define MAX_MODEL    256
#define MAX_SALT     4096
#define MAX_SECRET   4096
/* Pages of up to this many tokens (and key_from_bytes inputs of up to 4 * this many bytes) are
 * serialised into a stack buffer and hashed in one shot; longer ones are streamed. */
#define ONESHOT_TOKENS 256

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#define HOST_IS_LE 1
#else
#define HOST_IS_LE 0
#endif

static inline void put_key(uint8_t *p, skv_key_t k) {
  skv__put_le64(p, k.hi);
  skv__put_le64(p + 8, k.lo);
}

static inline skv_key_t key_of(XXH128_hash_t h) {
  skv_key_t k = {h.high64, h.low64};
  return skv__key_fix(k);
}

/* n tokens as u32 little endian at dst. */
static inline void put_tokens(uint8_t *dst, const uint32_t *tok, size_t n) {
#if HOST_IS_LE
  memcpy(dst, tok, n * sizeof(uint32_t));
#else
  for (size_t i = 0; i < n; i++) skv__put_le32(dst + 4 * i, tok[i]);
#endif
}

static void update_tokens(XXH3_state_t *st, const uint32_t *tok, size_t n) {
#if HOST_IS_LE
  XXH3_128bits_update(st, tok, n * sizeof(uint32_t));
#else
  uint8_t buf[4 * 256];
  while (n > 0) {
    size_t m = SKV_MIN(n, (size_t)256);
    put_tokens(buf, tok, m);
    XXH3_128bits_update(st, buf, 4 * m);
    tok += m;
    n -= m;
  }
#endif
}

static void update_u32(XXH3_state_t *st, uint32_t v) {
  uint8_t b[4];
  skv__put_le32(b, v);
  XXH3_128bits_update(st, b, sizeof b);
}

/* u32 length, then the bytes. */
static void update_lp(XXH3_state_t *st, const void *p, size_t n) {
  update_u32(st, (uint32_t)n);
  if (n) XXH3_128bits_update(st, p, n);
}

static void wipe(void *p, size_t n) {
  explicit_bzero(p, n);
}

/* ---- namespaces ---------------------------------------------------------------------------- */

int skv_namespace_create(const char *model, const skv_geometry_t *geom, const void *salt,
                         size_t salt_len, const void *secret, size_t secret_len,
                         skv_namespace_t **out) {
  SKV_ARG_CHECK(out, SKV_SUBSYS_INDEX, "skv_namespace_create: ns (the result pointer) is NULL");
  *out = NULL;
  SKV_ARG_CHECK(model, SKV_SUBSYS_INDEX,
                "skv_namespace_create: model is NULL: pass the engine's model name "
                "(e.g. \"meta-llama/Llama-3.1-8B-Instruct\")");
  size_t model_len = strnlen(model, MAX_MODEL + 1);
  SKV_ARG_CHECK(model_len >= 1 && model_len <= MAX_MODEL, SKV_SUBSYS_INDEX,
                "skv_namespace_create: model name is %s: it must be 1..%d bytes (pass the "
                "model's name or a digest of it)",
                model_len == 0 ? "empty" : "longer than 256 bytes", MAX_MODEL);
  SKV_ARG_CHECK(geom, SKV_SUBSYS_INDEX,
                "skv_namespace_create: geom is NULL: describe the KV pages (SKV_GEOMETRY_INIT)");
  uint64_t page_bytes = 0;
  SKV_CHECK(skv__geometry_check(geom, "skv_namespace_create: geom", &page_bytes));
  SKV_ARG_CHECK(salt || salt_len == 0, SKV_SUBSYS_INDEX,
                "skv_namespace_create: salt is NULL but salt_len is %zu: pass the salt bytes, "
                "or NULL and 0 for no salt",
                salt_len);
  SKV_ARG_CHECK(salt_len <= MAX_SALT, SKV_SUBSYS_INDEX,
                "skv_namespace_create: salt_len %zu is more than %d bytes: pass a shorter tenant "
                "id (or a digest of it)",
                salt_len, MAX_SALT);
  SKV_ARG_CHECK(secret || secret_len == 0, SKV_SUBSYS_INDEX,
                "skv_namespace_create: secret is NULL but secret_len is %zu: pass the secret "
                "bytes, or NULL and 0 to use SKV_HASH_SECRET",
                secret_len);
  SKV_ARG_CHECK(secret_len <= MAX_SECRET, SKV_SUBSYS_INDEX,
                "skv_namespace_create: secret_len %zu is more than %d bytes: 32 random bytes "
                "are plenty",
                secret_len, MAX_SECRET);

  const char *source = "the secret argument";
  if (secret_len == 0) {
    const char *env = skv__env(SKV_ENV_HASH_SECRET);
    secret = env;
    secret_len = env ? strlen(env) : 0;
    source = env ? "SKV_HASH_SECRET" : "none";
    if (secret_len > MAX_SECRET)
      return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_INDEX,
                      "skv_namespace_create: SKV_HASH_SECRET is %zu bytes, more than %d: set it "
                      "to a shorter random string (64 hex digits are plenty)",
                      secret_len, MAX_SECRET);
  }

  skv_namespace_t *ns = calloc(1, sizeof *ns);
  if (!ns)
    return SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_INDEX,
                    "skv_namespace_create: out of memory for %zu bytes", sizeof *ns);

  XXH3_state_t st;
  XXH3_INITSTATE(&st);
  XXH3_128bits_reset_withSeed(&st, 0);
  XXH3_128bits_update(&st, NS_TAG, strlen(NS_TAG));
  update_lp(&st, secret, secret_len);
  update_lp(&st, model, model_len);
  const uint32_t g[6] = {geom->kv_kind,  geom->num_layers, geom->num_kv_heads,
                         geom->head_dim, geom->elem_bytes, geom->page_tokens};
  for (size_t i = 0; i < SKV_ARRAY_LEN(g); i++) update_u32(&st, g[i]);
  update_lp(&st, salt, salt_len);
  ns->id = key_of(XXH3_128bits_digest(&st));
  wipe(&st, sizeof st); /* it held the secret */
  ns->seed = ns->id.lo ^ ns->id.hi;
  ns->geom = (skv_geometry_t)SKV_GEOMETRY_INIT;
  ns->geom.kv_kind = geom->kv_kind;
  ns->geom.num_layers = geom->num_layers;
  ns->geom.num_kv_heads = geom->num_kv_heads;
  ns->geom.head_dim = geom->head_dim;
  ns->geom.elem_bytes = geom->elem_bytes;
  ns->geom.page_tokens = geom->page_tokens;
  ns->page_bytes = page_bytes;

  if (secret_len == 0)
    SKV_INFO(SKV_SUBSYS_INDEX,
             "namespace of model %s has no deployment secret (no argument, SKV_HASH_SECRET "
             "unset): its keys are predictable from the tokens; set SKV_HASH_SECRET to the same "
             "random string in every process if tenants must not be able to aim collisions",
             model);
  SKV_INFO(SKV_SUBSYS_INDEX,
           "namespace %016" PRIx64 "%016" PRIx64 ": model %s, page_tokens %u, salt %zu bytes, "
           "secret: %s",
           ns->id.hi, ns->id.lo, model, geom->page_tokens, salt_len, source);
  *out = ns;
  return 0;
}

int skv_namespace_get_id(const skv_namespace_t *ns, skv_key_t *id) {
  SKV_ARG_CHECK(ns && id, SKV_SUBSYS_INDEX, "skv_namespace_get_id: ns and id must be non-NULL");
  *id = ns->id;
  return 0;
}

int skv_namespace_destroy(skv_namespace_t *ns) {
  if (!ns) return 0;
  wipe(ns, sizeof *ns); /* the seed is derived from the secret */
  free(ns);
  return 0;
}

/* ---- keys ---------------------------------------------------------------------------------- */

int skv_namespace_hash_tokens(const skv_namespace_t *ns, const uint32_t *tokens, size_t ntokens,
                    const skv_key_t *parent, skv_key_t *keys, size_t cap, size_t *nkeys) {
  SKV_ARG_CHECK(nkeys, SKV_SUBSYS_INDEX,
                "skv_namespace_hash_tokens: nkeys is NULL: pass where to store the number of full pages");
  *nkeys = 0;
  SKV_ARG_CHECK(ns, SKV_SUBSYS_INDEX,
                "skv_namespace_hash_tokens: ns is NULL: create one with skv_namespace_create");
  SKV_ARG_CHECK(tokens || ntokens == 0, SKV_SUBSYS_INDEX,
                "skv_namespace_hash_tokens: tokens is NULL but ntokens is %zu: pass the token array",
                ntokens);
  SKV_ARG_CHECK(ntokens <= SIZE_MAX / sizeof(uint32_t), SKV_SUBSYS_INDEX,
                "skv_namespace_hash_tokens: ntokens %zu is larger than any array: pass the token count, "
                "not a byte count or a negative value",
                ntokens);
  SKV_ARG_CHECK(keys || cap == 0, SKV_SUBSYS_INDEX,
                "skv_namespace_hash_tokens: keys is NULL but cap is %zu: pass an array of cap keys, or "
                "NULL and 0 to only count the full pages",
                cap);
  SKV_ARG_CHECK(!parent || parent->hi != 0, SKV_SUBSYS_INDEX,
                "skv_namespace_hash_tokens: parent.hi is 0, which no key has: pass the last key of the "
                "preceding pages, or NULL at the start of a sequence");

  const uint32_t pt = ns->geom.page_tokens;
  const size_t full = ntokens / pt;
  const size_t todo = SKV_MIN(full, cap);
  skv_key_t prev = parent ? *parent : ns->id;

  if (pt <= ONESHOT_TOKENS) {
    uint8_t buf[PREFIX_BYTES + 4 * ONESHOT_TOKENS];
    const size_t len = PREFIX_BYTES + 4 * (size_t)pt;
    buf[0] = TAG_PAGE;
    put_key(buf + 1, ns->id);
    for (size_t i = 0; i < todo; i++) {
      put_key(buf + 17, prev);
      put_tokens(buf + PREFIX_BYTES, tokens + i * pt, pt);
      prev = key_of(XXH3_128bits_withSeed(buf, len, ns->seed));
      keys[i] = prev;
    }
  } else {
    uint8_t head[PREFIX_BYTES];
    head[0] = TAG_PAGE;
    put_key(head + 1, ns->id);
    XXH3_state_t st;
    XXH3_INITSTATE(&st);
    for (size_t i = 0; i < todo; i++) {
      put_key(head + 17, prev);
      XXH3_128bits_reset_withSeed(&st, ns->seed);
      XXH3_128bits_update(&st, head, sizeof head);
      update_tokens(&st, tokens + i * pt, pt);
      prev = key_of(XXH3_128bits_digest(&st));
      keys[i] = prev;
    }
  }
  *nkeys = full;
  return 0;
}

int skv_namespace_hash_bytes(const skv_namespace_t *ns, const void *bytes, size_t len, skv_key_t *key) {
  SKV_ARG_CHECK(ns && key, SKV_SUBSYS_INDEX,
                "skv_namespace_hash_bytes: ns and key must be non-NULL (ns from skv_namespace_create)");
  SKV_ARG_CHECK(bytes || len == 0, SKV_SUBSYS_INDEX,
                "skv_namespace_hash_bytes: bytes is NULL but len is %zu: pass the engine's block hash",
                len);
  uint8_t buf[17 + 4 * ONESHOT_TOKENS];
  buf[0] = TAG_BYTES;
  put_key(buf + 1, ns->id);
  if (len <= sizeof buf - 17) {
    if (len) memcpy(buf + 17, bytes, len);
    *key = key_of(XXH3_128bits_withSeed(buf, 17 + len, ns->seed));
  } else {
    XXH3_state_t st;
    XXH3_INITSTATE(&st);
    XXH3_128bits_reset_withSeed(&st, ns->seed);
    XXH3_128bits_update(&st, buf, 17);
    XXH3_128bits_update(&st, bytes, len);
    *key = key_of(XXH3_128bits_digest(&st));
  }
  return 0;
}
