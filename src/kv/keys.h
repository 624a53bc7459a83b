/* Internal view of namespaces and key hashing (XXH3-128 chains keyed with the namespace and
 * the deployment secret); the byte format is docs/hashing.md. */
#ifndef SKV_KEYS_H
#define SKV_KEYS_H

#include "kv/geometry.h"

struct skv_namespace {
  skv_key_t id;        /* 128-bit namespace id (secret, model, geometry, salt) */
  uint64_t seed;       /* XXH3 seed derived from id */
  skv_geometry_t geom; /* the geometry the namespace was made for */
  uint64_t page_bytes;
};

/* Keys with hi == 0 are reserved by the index; hashing maps them to hi = 1. */
static inline skv_key_t skv__key_fix(skv_key_t k) {
  if (k.hi == 0) k.hi = 1;
  return k;
}

#endif
