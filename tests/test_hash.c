/* Tests of namespaces and key hashing: pinned vectors (recomputed here from scratch with XXH3
 * streaming, and by tests/vectors/gen_hash_vectors.py), chains, separation and bad input. */
#define _GNU_SOURCE
#include "skv_test.h"
#include "kv/keys.h"

#include <criterion/criterion.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define XXH_STATIC_LINKING_ONLY
#include <xxhash.h>

#define MAX_VEC_KEYS 8

/* One pinned vector. Tokens are explicit, or (tokens NULL) token i = (tok_mul * i + tok_add)
 * mod 2^32; key_from_bytes hashes fb_len bytes, byte i = (fb_mul * i + fb_add) mod 256. */
typedef struct hash_vector {
  const char *name;
  const char *model;
  uint32_t geom[6]; /* kv_kind, num_layers, num_kv_heads, head_dim, elem_bytes, page_tokens */
  const char *salt;
  size_t salt_len;
  const char *secret;
  size_t secret_len;
  const uint32_t *tokens;
  size_t ntokens;
  uint32_t tok_mul, tok_add;
  size_t fb_len;
  uint32_t fb_mul, fb_add;
  const char *ns_id;
  size_t nkeys;
  const char *keys[MAX_VEC_KEYS];
  const char *from_bytes;
} hash_vector_t;

/* BEGIN GENERATED VECTORS (tests/vectors/gen_hash_vectors.py; do not edit) */
// clang-format off
static const uint32_t vec0_tokens[] = {
    0x0001f400, 0x00000317, 0x00000fde, 0x00003776, 0x00009bff, 0x000089ec, 0x0000039f, 0x00000117,
    0x00003eb5, 0x0000162f};
static const uint32_t vec1_tokens[] = {
    0x0001f400, 0x00000317, 0x00000fde, 0x00003776, 0x00009bff, 0x000089ec, 0x0000039f, 0x00000117,
    0x00003eb5, 0x0000162f, 0x0000000d, 0x0001f409};
static const uint32_t vec4_tokens[] = {
    0x00000000, 0xffffffff, 0x00000001, 0x80000000, 0x01020304};
static const hash_vector_t vectors[] = {
    {.name = "plain",
     .model = "meta-llama/Llama-3.1-8B-Instruct",
     .geom = {0, 32, 8, 128, 2, 4},
     .salt = "", .salt_len = 0,
     .secret = "", .secret_len = 0,
     .tokens = vec0_tokens, .ntokens = 10,
     .fb_len = 32, .fb_mul = 1, .fb_add = 0,
     .ns_id = "bb70d8b115ea895774814d24d6a8de9d",
     .nkeys = 2,
     .keys = {"be27a5c6b6d80608858d72d0430072b3",
              "d2ec10bed6a4331d6f643abea9b7605c"},
     .from_bytes = "f681a4a09078ef1a2836d2ff583f3b44"},
    {.name = "salted",
     .model = "meta-llama/Llama-3.1-8B-Instruct",
     .geom = {0, 32, 8, 128, 2, 4},
     .salt = "tenant-42", .salt_len = 9,
     .secret = "correct horse battery staple", .secret_len = 28,
     .tokens = vec1_tokens, .ntokens = 12,
     .fb_len = 0, .fb_mul = 0, .fb_add = 0,
     .ns_id = "f1d7aa91d7258165863c9b084d996ac7",
     .nkeys = 3,
     .keys = {"2f001ab8bbbafb1d11f14aebaf9b45d5",
              "0e367712aa3ec82802e3f103ab43b035",
              "684017aad6fd7f973106a1377e91810f"},
     .from_bytes = "478c767101fb9efb6ba7eb3f5be8ed86"},
    {.name = "mla-fp8",
     .model = "deepseek-ai/DeepSeek-V3",
     .geom = {1, 61, 1, 576, 1, 64},
     .salt = "\000\377salt\000", .salt_len = 7,
     .secret = "\000\001\002secret\376", .secret_len = 10,
     .tokens = NULL, .ntokens = 133, .tok_mul = 2654435761u, .tok_add = 12345u,
     .fb_len = 8, .fb_mul = 0, .fb_add = 90,
     .ns_id = "b4e2c0afc1ed4034438f579162854120",
     .nkeys = 2,
     .keys = {"abbabd7dc474fa04d8942d441560f0e7",
              "a670d6ece6c9e9dd377645c2414b66f3"},
     .from_bytes = "7c1ec949d2f0db74c06663ef5795d332"},
    {.name = "long-page",
     .model = "Qwen/Qwen2.5-0.5B",
     .geom = {0, 2, 2, 64, 4, 512},
     .salt = "s", .salt_len = 1,
     .secret = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef", .secret_len = 64,
     .tokens = NULL, .ntokens = 1031, .tok_mul = 40503u, .tok_add = 7u,
     .fb_len = 2000, .fb_mul = 7, .fb_add = 3,
     .ns_id = "735475cdd3147cc893433439bba2b2d6",
     .nkeys = 2,
     .keys = {"b51ed4227c81c836e5f1a31af3201084",
              "f6c525aa1b2aa4cc8565183335ddfdd8"},
     .from_bytes = "df7418412776a8dc92d9a195ce49b048"},
    {.name = "page-1",
     .model = "x",
     .geom = {0, 1, 1, 1, 1, 1},
     .salt = "", .salt_len = 0,
     .secret = "z", .secret_len = 1,
     .tokens = vec4_tokens, .ntokens = 5,
     .fb_len = 1, .fb_mul = 0, .fb_add = 255,
     .ns_id = "e94ca1df110c06b4cfa1a594c8216629",
     .nkeys = 5,
     .keys = {"22a3fc3fa4bae254ef4c1d86f89736d2",
              "3530aedf65b9f9e8a3ffdc7f54f16344",
              "02b42d490655baf68bc205646297fc08",
              "e2f8b8c69b51c0a5f0d6d47e94b35bc3",
              "b882dbf202845cb6d4f13504c1834925"},
     .from_bytes = "825c3353a6c3a097c6bbc5ec8d5d62d4"},
};
// clang-format on
/* END GENERATED VECTORS */

/* ---- helpers ------------------------------------------------------------------------------- */

static void no_env_secret(void) {
  unsetenv("SKV_HASH_SECRET");
  skv__env_reload();
}

TestSuite(hash, .init = no_env_secret, .timeout = 30);

static skv_geometry_t geom_of(const uint32_t g[6]) {
  skv_geometry_t geom = SKV_GEOMETRY_INIT;
  geom.kv_kind = g[0];
  geom.num_layers = g[1];
  geom.num_kv_heads = g[2];
  geom.head_dim = g[3];
  geom.elem_bytes = g[4];
  geom.page_tokens = g[5];
  return geom;
}

static skv_geometry_t llama_geom(uint32_t page_tokens) {
  const uint32_t g[6] = {SKV_KV_SPLIT, 32, 8, 128, 2, page_tokens};
  return geom_of(g);
}

static const char *hex(skv_key_t k, char buf[33]) {
  snprintf(buf, 33, "%016" PRIx64 "%016" PRIx64, k.hi, k.lo);
  return buf;
}

static bool key_eq(skv_key_t a, skv_key_t b) {
  return a.hi == b.hi && a.lo == b.lo;
}

static uint32_t *vec_tokens(const hash_vector_t *v) {
  uint32_t *t = malloc((v->ntokens + 1) * sizeof *t);
  cr_assert(t);
  for (size_t i = 0; i < v->ntokens; i++)
    t[i] = v->tokens ? v->tokens[i] : (uint32_t)((uint64_t)v->tok_mul * i + v->tok_add);
  return t;
}

static uint8_t *vec_bytes(const hash_vector_t *v) {
  uint8_t *b = malloc(v->fb_len + 1);
  cr_assert(b);
  for (size_t i = 0; i < v->fb_len; i++) b[i] = (uint8_t)((uint64_t)v->fb_mul * i + v->fb_add);
  return b;
}

static skv_namespace_t *make_ns(const char *model, const skv_geometry_t *g, const char *salt,
                                const char *secret) {
  skv_namespace_t *ns = NULL;
  int rc = skv_namespace_create(model, g, salt, salt ? strlen(salt) : 0, secret,
                                secret ? strlen(secret) : 0, &ns);
  cr_assert_eq(rc, 0, "skv_namespace_create(%s): %s", model, skv_last_error());
  return ns;
}

static void hash_all(const skv_namespace_t *ns, const uint32_t *tok, size_t n,
                     const skv_key_t *parent, skv_key_t *keys, size_t cap, size_t *nkeys) {
  int rc = skv_namespace_hash_tokens(ns, tok, n, parent, keys, cap, nkeys);
  cr_assert_eq(rc, 0, "skv_namespace_hash_tokens: %s", skv_last_error());
}

/* ---- the independent reference: the byte format of docs/hashing.md, written from scratch --- */

static void ref_u8(XXH3_state_t *st, uint8_t v) {
  XXH3_128bits_update(st, &v, 1);
}

static void ref_u32(XXH3_state_t *st, uint32_t v) {
  for (int i = 0; i < 4; i++) ref_u8(st, (uint8_t)(v >> (8 * i)));
}

static void ref_u64(XXH3_state_t *st, uint64_t v) {
  for (int i = 0; i < 8; i++) ref_u8(st, (uint8_t)(v >> (8 * i)));
}

static void ref_key(XXH3_state_t *st, skv_key_t k) {
  ref_u64(st, k.hi);
  ref_u64(st, k.lo);
}

static skv_key_t ref_digest(XXH3_state_t *st) {
  XXH128_hash_t h = XXH3_128bits_digest(st);
  skv_key_t k = {h.high64 ? h.high64 : 1, h.low64};
  return k;
}

static skv_key_t ref_namespace_id(const hash_vector_t *v) {
  XXH3_state_t *st = XXH3_createState();
  cr_assert(st);
  XXH3_128bits_reset_withSeed(st, 0);
  XXH3_128bits_update(st, "symkv-ns-v1", 11);
  ref_u32(st, (uint32_t)v->secret_len);
  for (size_t i = 0; i < v->secret_len; i++) ref_u8(st, (uint8_t)v->secret[i]);
  ref_u32(st, (uint32_t)strlen(v->model));
  for (const char *c = v->model; *c; c++) ref_u8(st, (uint8_t)*c);
  for (int i = 0; i < 6; i++) ref_u32(st, v->geom[i]);
  ref_u32(st, (uint32_t)v->salt_len);
  for (size_t i = 0; i < v->salt_len; i++) ref_u8(st, (uint8_t)v->salt[i]);
  skv_key_t id = ref_digest(st);
  XXH3_freeState(st);
  return id;
}

static size_t ref_page_keys(skv_key_t id, uint32_t page_tokens, const uint32_t *tok, size_t n,
                            skv_key_t *keys) {
  XXH3_state_t *st = XXH3_createState();
  cr_assert(st);
  uint64_t seed = id.hi ^ id.lo;
  skv_key_t prev = id;
  size_t npages = n / page_tokens;
  for (size_t p = 0; p < npages; p++) {
    XXH3_128bits_reset_withSeed(st, seed);
    ref_u8(st, 0x01);
    ref_key(st, id);
    ref_key(st, prev);
    for (size_t t = 0; t < page_tokens; t++) ref_u32(st, tok[p * page_tokens + t]);
    keys[p] = prev = ref_digest(st);
  }
  XXH3_freeState(st);
  return npages;
}

static skv_key_t ref_from_bytes(skv_key_t id, const uint8_t *b, size_t len) {
  XXH3_state_t *st = XXH3_createState();
  cr_assert(st);
  XXH3_128bits_reset_withSeed(st, id.hi ^ id.lo);
  ref_u8(st, 0x02);
  ref_key(st, id);
  for (size_t i = 0; i < len; i++) ref_u8(st, b[i]);
  skv_key_t k = ref_digest(st);
  XXH3_freeState(st);
  return k;
}

/* ---- (a) pinned vectors -------------------------------------------------------------------- */

Test(hash, pinned_vectors, .timeout = 10) {
  for (size_t vi = 0; vi < SKV_ARRAY_LEN(vectors); vi++) {
    const hash_vector_t *v = &vectors[vi];
    skv_geometry_t g = geom_of(v->geom);
    skv_namespace_t *ns = NULL;
    cr_assert_eq(
        skv_namespace_create(v->model, &g, v->salt, v->salt_len, v->secret, v->secret_len, &ns), 0,
        "%s: %s", v->name, skv_last_error());
    char h[33];
    skv_key_t id;
    cr_assert_eq(skv_namespace_get_id(ns, &id), 0);
    cr_expect_str_eq(hex(id, h), v->ns_id, "%s: namespace id", v->name);

    uint32_t *tok = vec_tokens(v);
    skv_key_t keys[MAX_VEC_KEYS + 1];
    size_t nkeys = 99;
    hash_all(ns, tok, v->ntokens, NULL, keys, SKV_ARRAY_LEN(keys), &nkeys);
    cr_assert_eq(nkeys, v->nkeys, "%s: %zu keys, expected %zu", v->name, nkeys, v->nkeys);
    for (size_t i = 0; i < nkeys; i++)
      cr_expect_str_eq(hex(keys[i], h), v->keys[i], "%s: key %zu", v->name, i);

    uint8_t *b = vec_bytes(v);
    skv_key_t fb;
    cr_assert_eq(skv_namespace_hash_bytes(ns, b, v->fb_len, &fb), 0, "%s", skv_last_error());
    cr_expect_str_eq(hex(fb, h), v->from_bytes, "%s: key_from_bytes", v->name);
    free(b);
    free(tok);
    skv_namespace_destroy(ns);
  }
}

Test(hash, vectors_recomputed_from_scratch, .timeout = 10) {
  for (size_t vi = 0; vi < SKV_ARRAY_LEN(vectors); vi++) {
    const hash_vector_t *v = &vectors[vi];
    char h[33];
    skv_key_t id = ref_namespace_id(v);
    cr_expect_str_eq(hex(id, h), v->ns_id, "%s: reference namespace id", v->name);
    uint32_t *tok = vec_tokens(v);
    skv_key_t keys[MAX_VEC_KEYS + 1];
    size_t n = ref_page_keys(id, v->geom[5], tok, v->ntokens, keys);
    cr_assert_eq(n, v->nkeys, "%s", v->name);
    for (size_t i = 0; i < n; i++)
      cr_expect_str_eq(hex(keys[i], h), v->keys[i], "%s: reference key %zu", v->name, i);
    uint8_t *b = vec_bytes(v);
    cr_expect_str_eq(hex(ref_from_bytes(id, b, v->fb_len), h), v->from_bytes,
                     "%s: reference key_from_bytes", v->name);
    free(b);
    free(tok);
  }
}

/* The library and the reference agree on fresh random inputs too (every path: one-shot and
 * streamed pages, short and long engine hashes, binary salts and secrets). */
Test(hash, random_inputs_match_reference, .timeout = 20) {
  uint64_t seed = skv_test_seed(), s = seed;
  static const uint32_t page_sizes[] = {1, 3, 16, 60, 64, 256, 257, 1024};
  for (int iter = 0; iter < 64; iter++) {
    char model[40], salt[64], secret[64];
    uint8_t raw[64];
    skv_test_fill_random(raw, sizeof raw, &s);
    size_t mlen = 1 + skv_test_rand(&s) % 30;
    for (size_t i = 0; i < mlen; i++) model[i] = (char)('a' + raw[i] % 26);
    model[mlen] = '\0';
    hash_vector_t v = {.model = model, .salt = salt, .secret = secret};
    v.salt_len = skv_test_rand(&s) % sizeof salt;
    v.secret_len = 1 + skv_test_rand(&s) % (sizeof secret - 1);
    skv_test_fill_random(salt, v.salt_len, &s);
    skv_test_fill_random(secret, v.secret_len, &s);
    uint32_t pt = page_sizes[skv_test_rand(&s) % SKV_ARRAY_LEN(page_sizes)];
    const uint32_t g[6] = {SKV_KV_SPLIT, 1 + (uint32_t)(skv_test_rand(&s) % 80), 8, 128, 2, pt};
    memcpy(v.geom, g, sizeof g);
    skv_geometry_t geom = geom_of(g);
    skv_namespace_t *ns = NULL;
    cr_assert_eq(skv_namespace_create(model, &geom, salt, v.salt_len, secret, v.secret_len, &ns), 0,
                 "seed %" PRIu64 ": %s", seed, skv_last_error());
    skv_key_t id, rid = ref_namespace_id(&v);
    skv_namespace_get_id(ns, &id);
    cr_assert(key_eq(id, rid), "seed %" PRIu64 ": namespace id", seed);

    size_t ntok = skv_test_rand(&s) % (5 * (size_t)pt + 1);
    uint32_t *tok = malloc((ntok + 1) * sizeof *tok);
    skv_test_fill_random(tok, ntok * sizeof *tok, &s);
    skv_key_t keys[8], rkeys[8];
    size_t nkeys;
    hash_all(ns, tok, ntok, NULL, keys, SKV_ARRAY_LEN(keys), &nkeys);
    size_t rn = ref_page_keys(id, pt, tok, ntok, rkeys);
    cr_assert_eq(nkeys, rn);
    for (size_t i = 0; i < nkeys; i++)
      cr_assert(key_eq(keys[i], rkeys[i]), "seed %" PRIu64 ": page %zu of %u tokens", seed, i, pt);

    size_t blen = skv_test_rand(&s) % 3000;
    uint8_t *b = malloc(blen + 1);
    skv_test_fill_random(b, blen, &s);
    skv_key_t fb;
    cr_assert_eq(skv_namespace_hash_bytes(ns, b, blen, &fb), 0);
    cr_assert(key_eq(fb, ref_from_bytes(id, b, blen)), "seed %" PRIu64 ": %zu bytes", seed, blen);
    free(b);
    free(tok);
    skv_namespace_destroy(ns);
  }
}

/* ---- (b) chains, (c) partial pages, cap ---------------------------------------------------- */

Test(hash, chain_continues_with_parent, .timeout = 10) {
  uint64_t seed = skv_test_seed(), s = seed;
  static const uint32_t page_sizes[] = {1, 4, 16, 64, 512};
  for (size_t pi = 0; pi < SKV_ARRAY_LEN(page_sizes); pi++) {
    uint32_t pt = page_sizes[pi];
    skv_geometry_t g = llama_geom(pt);
    skv_namespace_t *ns = make_ns("chain-model", &g, "t", "secret");
    const size_t npages = 9, ntok = npages * pt + pt / 2;
    uint32_t *tok = malloc(ntok * sizeof *tok);
    skv_test_fill_random(tok, ntok * sizeof *tok, &s);
    skv_key_t all[9], part[9];
    size_t n;
    hash_all(ns, tok, ntok, NULL, all, npages, &n);
    cr_assert_eq(n, npages);
    for (size_t k = 1; k < npages; k++) {
      size_t n1, n2;
      hash_all(ns, tok, k * pt, NULL, part, npages, &n1);
      cr_assert_eq(n1, k);
      hash_all(ns, tok + k * pt, ntok - k * pt, &part[k - 1], part + k, npages - k, &n2);
      cr_assert_eq(n2, npages - k);
      for (size_t i = 0; i < npages; i++)
        cr_assert(key_eq(part[i], all[i]),
                  "seed %" PRIu64 ": page_tokens %u, split after page %zu: key %zu differs", seed,
                  pt, k, i);
    }
    free(tok);
    skv_namespace_destroy(ns);
  }
}

Test(hash, partial_last_page_yields_no_key, .timeout = 10) {
  skv_geometry_t g = llama_geom(16);
  skv_namespace_t *ns = make_ns("m", &g, NULL, NULL);
  uint32_t tok[64];
  for (uint32_t i = 0; i < 64; i++) tok[i] = i * 7 + 1;
  skv_key_t ref[4], keys[6];
  size_t n;
  hash_all(ns, tok, 48, NULL, ref, 4, &n);
  cr_assert_eq(n, 3);
  for (size_t extra = 1; extra < 16; extra++) {
    memset(keys, 0xab, sizeof keys);
    hash_all(ns, tok, 48 + extra, NULL, keys, 6, &n);
    cr_assert_eq(n, 3, "48 + %zu tokens: %zu keys", extra, n);
    for (size_t i = 0; i < 3; i++) cr_assert(key_eq(keys[i], ref[i]));
    for (size_t i = 3; i < 6; i++)
      cr_assert(keys[i].hi == 0xababababababababull && keys[i].lo == 0xababababababababull,
                "key %zu was written past the full pages", i);
  }
  for (size_t ntok = 0; ntok < 16; ntok++) {
    hash_all(ns, tok, ntok, NULL, keys, 6, &n);
    cr_assert_eq(n, 0, "%zu tokens (less than a page): %zu keys", ntok, n);
  }
  hash_all(ns, NULL, 0, NULL, keys, 6, &n); /* no tokens at all */
  cr_assert_eq(n, 0);
  skv_namespace_destroy(ns);
}

Test(hash, keys_independent_of_cap, .timeout = 10) {
  uint64_t seed = skv_test_seed(), s = seed;
  skv_geometry_t g = llama_geom(16);
  skv_namespace_t *ns = make_ns("m", &g, "salt", NULL);
  uint32_t tok[16 * 10 + 5];
  skv_test_fill_random(tok, sizeof tok, &s);
  const size_t ntok = SKV_ARRAY_LEN(tok);
  skv_key_t all[10], keys[12];
  size_t n;
  hash_all(ns, tok, ntok, NULL, all, 10, &n);
  cr_assert_eq(n, 10);
  for (size_t cap = 0; cap <= 12; cap++) {
    memset(keys, 0xcd, sizeof keys);
    hash_all(ns, tok, ntok, NULL, keys, cap, &n);
    cr_assert_eq(n, 10, "cap %zu: nkeys must count every full page, got %zu", cap, n);
    for (size_t i = 0; i < SKV_MIN(cap, (size_t)10); i++) cr_assert(key_eq(keys[i], all[i]));
    for (size_t i = SKV_MIN(cap, (size_t)10); i < 12; i++)
      cr_assert_eq(keys[i].hi, 0xcdcdcdcdcdcdcdcdull, "cap %zu: key %zu written", cap, i);
  }
  hash_all(ns, tok, ntok, NULL, NULL, 0, &n); /* count only */
  cr_assert_eq(n, 10);
  skv_namespace_destroy(ns);
}

/* ---- (d) separation ------------------------------------------------------------------------ */

#define NTOK (16 * 4)

static void keys_of(const skv_namespace_t *ns, const uint32_t *tok, skv_key_t out[4]) {
  size_t n;
  hash_all(ns, tok, NTOK, NULL, out, 4, &n);
  cr_assert_eq(n, 4);
}

/* Every key of a and b differ (and the namespace ids too). */
static void expect_all_differ(skv_namespace_t *a, skv_namespace_t *b, const uint32_t *tok,
                              const char *what) {
  skv_key_t ka[4], kb[4], ia, ib;
  skv_namespace_get_id(a, &ia);
  skv_namespace_get_id(b, &ib);
  cr_expect(!key_eq(ia, ib), "%s: same namespace id", what);
  keys_of(a, tok, ka);
  keys_of(b, tok, kb);
  for (int i = 0; i < 4; i++) cr_expect(!key_eq(ka[i], kb[i]), "%s: key %d equal", what, i);
  skv_key_t fa, fb;
  skv_namespace_hash_bytes(a, "block", 5, &fa);
  skv_namespace_hash_bytes(b, "block", 5, &fb);
  cr_expect(!key_eq(fa, fb), "%s: key_from_bytes equal", what);
  skv_namespace_destroy(a);
  skv_namespace_destroy(b);
}

static void expect_same(skv_namespace_t *a, skv_namespace_t *b, const uint32_t *tok,
                        const char *what) {
  skv_key_t ka[4], kb[4], ia, ib;
  skv_namespace_get_id(a, &ia);
  skv_namespace_get_id(b, &ib);
  cr_expect(key_eq(ia, ib), "%s: namespace ids differ", what);
  keys_of(a, tok, ka);
  keys_of(b, tok, kb);
  for (int i = 0; i < 4; i++) cr_expect(key_eq(ka[i], kb[i]), "%s: key %d differs", what, i);
  skv_namespace_destroy(a);
  skv_namespace_destroy(b);
}

Test(hash, namespaces_separate, .timeout = 10) {
  uint64_t s = skv_test_seed();
  uint32_t tok[NTOK];
  skv_test_fill_random(tok, sizeof tok, &s);
  skv_geometry_t g = llama_geom(16);
  expect_all_differ(make_ns("llama", &g, NULL, NULL), make_ns("llama2", &g, NULL, NULL), tok,
                    "model");
  expect_all_differ(make_ns("llama", &g, "a", NULL), make_ns("llama", &g, "b", NULL), tok, "salt");
  expect_all_differ(make_ns("llama", &g, NULL, NULL), make_ns("llama", &g, "a", NULL), tok,
                    "no salt / salt");
  expect_all_differ(make_ns("llama", &g, NULL, "k1"), make_ns("llama", &g, NULL, "k2"), tok,
                    "secret");
  expect_all_differ(make_ns("llama", &g, NULL, NULL), make_ns("llama", &g, NULL, "k"), tok,
                    "no secret / secret");
  /* Length prefixes: moving bytes between fields changes the namespace. */
  expect_all_differ(make_ns("ab", &g, "c", NULL), make_ns("a", &g, "bc", NULL), tok,
                    "model/salt boundary");
  expect_all_differ(make_ns("ab", &g, NULL, "c"), make_ns("abc", &g, NULL, NULL), tok,
                    "secret/model boundary");
  /* Every geometry field. */
  const uint32_t base[6] = {SKV_KV_SPLIT, 32, 8, 128, 2, 16};
  for (int f = 0; f < 6; f++) {
    uint32_t other[6];
    memcpy(other, base, sizeof other);
    switch (f) {
    case 0: /* MLA needs one KV head: two fields change */
      other[0] = SKV_KV_MLA;
      other[2] = 1;
      break;
    case 4:
      other[4] = 1;
      break;
    case 5:
      other[5] = 8;
      break; /* still divides NTOK into whole pages */
    default:
      other[f] += 1;
      break;
    }
    skv_geometry_t ga = geom_of(base), gb = geom_of(other);
    char what[32];
    snprintf(what, sizeof what, "geometry field %d", f);
    skv_namespace_t *b = make_ns("llama", &gb, NULL, NULL);
    if (f == 5) { /* 8 pages then: compare the keys the two have in common by position */
      skv_key_t ia, ib;
      skv_namespace_t *a = make_ns("llama", &ga, NULL, NULL);
      skv_namespace_get_id(a, &ia);
      skv_namespace_get_id(b, &ib);
      cr_expect(!key_eq(ia, ib), "page_tokens: same namespace id");
      skv_namespace_destroy(a);
      skv_namespace_destroy(b);
      continue;
    }
    expect_all_differ(make_ns("llama", &ga, NULL, NULL), b, tok, what);
  }
  /* NULL and empty salts are the same namespace; so are equal inputs. */
  expect_same(make_ns("llama", &g, NULL, "k"), make_ns("llama", &g, "", "k"), tok, "NULL/empty");
  expect_same(make_ns("llama", &g, "t", "k"), make_ns("llama", &g, "t", "k"), tok, "equal");
}

Test(hash, secret_from_environment, .timeout = 10) {
  uint64_t s = skv_test_seed();
  uint32_t tok[NTOK];
  skv_test_fill_random(tok, sizeof tok, &s);
  skv_geometry_t g = llama_geom(16);
  skv_namespace_t *none = make_ns("m", &g, "t", NULL);
  setenv("SKV_HASH_SECRET", "from-the-environment", 1);
  skv__env_reload();
  expect_same(make_ns("m", &g, "t", NULL), make_ns("m", &g, "t", "from-the-environment"), tok,
              "SKV_HASH_SECRET vs argument");
  expect_all_differ(make_ns("m", &g, "t", NULL), none, tok, "SKV_HASH_SECRET vs none");
  /* An explicit secret wins over the environment. */
  expect_all_differ(make_ns("m", &g, "t", NULL), make_ns("m", &g, "t", "other"), tok,
                    "argument over SKV_HASH_SECRET");
  no_env_secret();
}

Test(hash, any_token_changes_its_page_and_later_keys, .timeout = 10) {
  uint64_t seed = skv_test_seed(), s = seed;
  uint32_t tok[NTOK];
  skv_test_fill_random(tok, sizeof tok, &s);
  skv_geometry_t g = llama_geom(16);
  skv_namespace_t *ns = make_ns("m", &g, NULL, "k");
  skv_key_t base[4], keys[4];
  keys_of(ns, tok, base);
  for (size_t t = 0; t < NTOK; t++) {
    uint32_t saved = tok[t];
    tok[t] ^= 1u << (skv_test_rand(&s) % 32);
    keys_of(ns, tok, keys);
    size_t page = t / 16;
    for (size_t i = 0; i < 4; i++) {
      if (i < page)
        cr_assert(key_eq(keys[i], base[i]), "seed %" PRIu64 ": token %zu changed key %zu", seed, t,
                  i);
      else
        cr_assert(!key_eq(keys[i], base[i]), "seed %" PRIu64 ": token %zu left key %zu", seed, t,
                  i);
    }
    tok[t] = saved;
  }
  /* The same page content at another position of the chain has another key. */
  uint32_t same[NTOK];
  for (size_t i = 0; i < NTOK; i++) same[i] = tok[i % 16];
  keys_of(ns, same, keys);
  for (size_t i = 1; i < 4; i++) cr_assert(!key_eq(keys[i], keys[0]));
  skv_namespace_destroy(ns);
}

/* ---- (e) key_from_bytes -------------------------------------------------------------------- */

Test(hash, key_from_bytes_separates, .timeout = 10) {
  skv_geometry_t g = llama_geom(16);
  skv_namespace_t *a = make_ns("m", &g, "tenant-a", "k"), *b = make_ns("m", &g, "tenant-b", "k");
  const uint8_t block[32] = {1, 2, 3};
  skv_key_t ka, kb, ka2, k0, k1;
  cr_assert_eq(skv_namespace_hash_bytes(a, block, sizeof block, &ka), 0);
  cr_assert_eq(skv_namespace_hash_bytes(b, block, sizeof block, &kb), 0);
  cr_assert_eq(skv_namespace_hash_bytes(a, block, sizeof block, &ka2), 0);
  cr_expect(!key_eq(ka, kb), "the same engine hash in two namespaces gave the same key");
  cr_expect(key_eq(ka, ka2), "key_from_bytes is not deterministic");
  cr_assert_eq(skv_namespace_hash_bytes(a, block, 31, &k0), 0);
  cr_expect(!key_eq(ka, k0), "length is not covered");
  cr_assert_eq(skv_namespace_hash_bytes(a, NULL, 0, &k0), 0);
  cr_assert_eq(skv_namespace_hash_bytes(a, "", 0, &k1), 0);
  cr_expect(key_eq(k0, k1), "NULL/0 and \"\"/0 differ");
  /* A page key and a key_from_bytes of the same serialised tokens never coincide (tag). */
  uint32_t tok[16] = {0};
  skv_key_t pk;
  size_t n;
  hash_all(a, tok, 16, NULL, &pk, 1, &n);
  cr_assert_eq(skv_namespace_hash_bytes(a, tok, sizeof tok, &k0), 0);
  cr_expect(!key_eq(pk, k0));
  skv_namespace_destroy(a);
  skv_namespace_destroy(b);
}

/* ---- (f) bad input ------------------------------------------------------------------------- */

#define EXPECT_EINVAL(call, needle)                                                                \
  do {                                                                                             \
    skv_clear_error();                                                                             \
    int rc_ = (call);                                                                              \
    cr_expect_eq(rc_, SKV_EINVAL, "%s returned %d (%s), expected SKV_EINVAL", #call, rc_,          \
                 skv_err_name(rc_));                                                               \
    cr_expect(strstr(skv_last_error(), (needle)) != NULL,                                          \
              "%s: last error \"%s\" does not mention \"%s\"", #call, skv_last_error(), (needle)); \
  } while (0)

Test(hash, bad_namespace_arguments, .timeout = 10) {
  skv_geometry_t g = llama_geom(16);
  skv_namespace_t *ns = (skv_namespace_t *)(uintptr_t)1;
  char long_model[300];
  memset(long_model, 'm', sizeof long_model - 1);
  long_model[sizeof long_model - 1] = '\0';
  static char big[4097];
  EXPECT_EINVAL(skv_namespace_create("m", &g, NULL, 0, NULL, 0, NULL), "ns");
  EXPECT_EINVAL(skv_namespace_create(NULL, &g, NULL, 0, NULL, 0, &ns), "model is NULL");
  cr_expect_null(ns, "a failed create must set *ns to NULL");
  EXPECT_EINVAL(skv_namespace_create("", &g, NULL, 0, NULL, 0, &ns), "empty");
  EXPECT_EINVAL(skv_namespace_create(long_model, &g, NULL, 0, NULL, 0, &ns), "256");
  long_model[256] = '\0'; /* exactly 256 bytes is fine */
  cr_expect_eq(skv_namespace_create(long_model, &g, NULL, 0, NULL, 0, &ns), 0, "%s",
               skv_last_error());
  skv_namespace_destroy(ns);
  EXPECT_EINVAL(skv_namespace_create("m", NULL, NULL, 0, NULL, 0, &ns), "geom");
  EXPECT_EINVAL(skv_namespace_create("m", &g, NULL, 3, NULL, 0, &ns), "salt is NULL");
  EXPECT_EINVAL(skv_namespace_create("m", &g, big, 4097, NULL, 0, &ns), "salt_len");
  EXPECT_EINVAL(skv_namespace_create("m", &g, NULL, 0, NULL, 5, &ns), "secret is NULL");
  EXPECT_EINVAL(skv_namespace_create("m", &g, NULL, 0, big, 4097, &ns), "secret_len");
  cr_expect_eq(skv_namespace_create("m", &g, big, 4096, big, 4096, &ns), 0, "%s", skv_last_error());
  skv_namespace_destroy(ns);
  /* The geometry is validated (the message names the field). */
  skv_geometry_t bad = g;
  bad.num_layers = 0;
  EXPECT_EINVAL(skv_namespace_create("m", &bad, NULL, 0, NULL, 0, &ns), "num_layers");
  bad = g;
  bad.page_tokens = 0;
  EXPECT_EINVAL(skv_namespace_create("m", &bad, NULL, 0, NULL, 0, &ns), "page_tokens");
  bad = g;
  bad.elem_bytes = 3;
  EXPECT_EINVAL(skv_namespace_create("m", &bad, NULL, 0, NULL, 0, &ns), "elem_bytes");
  /* An oversized SKV_HASH_SECRET. */
  memset(big, 'x', 4096);
  big[4096] = 'x';
  char env[4098];
  memcpy(env, big, 4097);
  env[4097] = '\0';
  setenv("SKV_HASH_SECRET", env, 1);
  skv__env_reload();
  EXPECT_EINVAL(skv_namespace_create("m", &g, NULL, 0, NULL, 0, &ns), "SKV_HASH_SECRET");
  no_env_secret();
  EXPECT_EINVAL(skv_namespace_get_id(NULL, &(skv_key_t){0, 0}), "skv_namespace_get_id");
  cr_expect_eq(skv_namespace_destroy(NULL), 0);
}

Test(hash, bad_hash_arguments, .timeout = 10) {
  skv_geometry_t g = llama_geom(4);
  skv_namespace_t *ns = make_ns("m", &g, NULL, NULL);
  uint32_t tok[8] = {0};
  skv_key_t keys[2], zero = {0, 5};
  size_t n = 77;
  EXPECT_EINVAL(skv_namespace_hash_tokens(NULL, tok, 8, NULL, keys, 2, &n), "ns is NULL");
  cr_expect_eq(n, 0, "a failed call must set *nkeys to 0");
  EXPECT_EINVAL(skv_namespace_hash_tokens(ns, NULL, 8, NULL, keys, 2, &n), "tokens is NULL");
  EXPECT_EINVAL(skv_namespace_hash_tokens(ns, tok, 8, NULL, NULL, 2, &n), "keys is NULL");
  EXPECT_EINVAL(skv_namespace_hash_tokens(ns, tok, 8, NULL, keys, 2, NULL), "nkeys");
  EXPECT_EINVAL(skv_namespace_hash_tokens(ns, tok, 8, &zero, keys, 2, &n), "parent");
  EXPECT_EINVAL(skv_namespace_hash_tokens(ns, tok, SIZE_MAX, NULL, keys, 2, &n), "ntokens");
  EXPECT_EINVAL(skv_namespace_hash_tokens(ns, tok, SIZE_MAX / 2, NULL, keys, 2, &n), "ntokens");
  EXPECT_EINVAL(skv_namespace_hash_bytes(NULL, "x", 1, &keys[0]), "skv_namespace_hash_bytes");
  EXPECT_EINVAL(skv_namespace_hash_bytes(ns, "x", 1, NULL), "skv_namespace_hash_bytes");
  EXPECT_EINVAL(skv_namespace_hash_bytes(ns, NULL, 4, &keys[0]), "bytes is NULL");
  /* The allowed corner cases. */
  cr_expect_eq(skv_namespace_hash_tokens(ns, NULL, 0, NULL, NULL, 0, &n), 0);
  cr_expect_eq(n, 0);
  cr_expect_eq(skv_namespace_hash_tokens(ns, tok, 8, NULL, NULL, 0, &n), 0);
  cr_expect_eq(n, 2);
  skv_namespace_destroy(ns);
}

/* ---- (g) hi is never 0 --------------------------------------------------------------------- */

Test(hash, hi_never_zero, .timeout = 10) {
  skv_key_t z = skv__key_fix((skv_key_t){0, 42});
  cr_expect(z.hi == 1 && z.lo == 42, "skv__key_fix must map hi 0 to 1 and keep lo");
  z = skv__key_fix((skv_key_t){7, 0});
  cr_expect(z.hi == 7 && z.lo == 0);
  uint64_t s = skv_test_seed();
  skv_geometry_t g = llama_geom(1);
  skv_namespace_t *ns = make_ns("m", &g, NULL, NULL);
  enum { N = 1 << 16 };
  uint32_t *tok = malloc(N * sizeof *tok);
  skv_key_t *keys = malloc(N * sizeof *keys);
  skv_test_fill_random(tok, N * sizeof *tok, &s);
  size_t n;
  hash_all(ns, tok, N, NULL, keys, N, &n);
  cr_assert_eq(n, N);
  size_t zeros = 0; /* one assertion, not N: Criterion reports every assertion to its runner */
  for (size_t i = 0; i < N; i++) zeros += keys[i].hi == 0;
  cr_assert_eq(zeros, 0, "%zu keys have hi 0", zeros);
  free(tok);
  free(keys);
  skv_namespace_destroy(ns);
}

/* ---- logging and speed --------------------------------------------------------------------- */

typedef struct captured {
  char text[8192];
  size_t len;
} captured_t;

static void capture(void *arg, int level, unsigned int subsys, const char *line) {
  captured_t *c = arg;
  int n = snprintf(c->text + c->len, sizeof c->text - c->len, "%s\n", line);
  if (n > 0) c->len = SKV_MIN(c->len + (size_t)n, sizeof c->text - 1);
}

Test(hash, logs_missing_secret_never_the_secret, .timeout = 10) {
  static captured_t cap;
  skv_log_set_sink(capture, &cap);
  skv_log_set_level(SKV_LOG_TRACE, SKV_SUBSYS_ALL);
  skv_geometry_t g = llama_geom(16);
  skv_namespace_destroy(make_ns("m", &g, NULL, NULL));
  cr_expect(strstr(cap.text, "no deployment secret") != NULL,
            "no INFO about the missing secret in:\n%s", cap.text);
  cap.len = 0;
  cap.text[0] = '\0';
  skv_namespace_destroy(make_ns("m", &g, NULL, "hunter2-very-secret"));
  setenv("SKV_HASH_SECRET", "env-very-secret", 1);
  skv__env_reload();
  skv_namespace_destroy(make_ns("m", &g, NULL, NULL));
  cr_expect(strstr(cap.text, "no deployment secret") == NULL);
  cr_expect(strstr(cap.text, "very-secret") == NULL, "a secret was logged:\n%s", cap.text);
  skv_log_set_sink(NULL, NULL);
  no_env_secret();
}

Test(hash, speed_128k_tokens, .timeout = 30) {
  static const uint32_t page_sizes[] = {16, 64, 1024};
  uint64_t s = skv_test_seed();
  enum { N = 128 * 1024 };
  uint32_t *tok = malloc(N * sizeof *tok);
  skv_key_t *keys = malloc(N * sizeof *keys);
  skv_test_fill_random(tok, N * sizeof *tok, &s);
  for (size_t pi = 0; pi < SKV_ARRAY_LEN(page_sizes); pi++) {
    skv_geometry_t g = llama_geom(page_sizes[pi]);
    skv_namespace_t *ns = make_ns("m", &g, "t", "k");
    uint64_t best = UINT64_MAX;
    for (int rep = 0; rep < 5; rep++) {
      size_t n;
      uint64_t t0 = skv__now_ns();
      hash_all(ns, tok, N, NULL, keys, N, &n);
      best = SKV_MIN(best, skv__now_ns() - t0);
    }
    cr_log_info("hashing %d tokens, page_tokens %u: %.3f ms", N, page_sizes[pi], best / 1e6);
    /* About 0.3 ms on a current x86 core; the bound leaves room for sanitizers and busy CI. */
    cr_expect_lt(best, 50ull * 1000 * 1000, "hashing 128k tokens took %.3f ms", best / 1e6);
    skv_namespace_destroy(ns);
  }
  free(tok);
  free(keys);
}
