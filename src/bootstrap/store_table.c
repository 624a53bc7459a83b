/* The bootstrap store's key table (store_table.h): chained hashing over power-of-two buckets,
 * the keys and value bytes it holds counted against the store's limits. */
#include "bootstrap/store_table.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

static uint64_t key_hash(const uint8_t *k, size_t n) {
  return XXH3_64bits(k, n);
}

static skv__entry_t **table_slot(skv__table_t *t, const uint8_t *k, size_t kl, uint64_t h) {
  skv__entry_t **pp = &t->b[h & (t->nb - 1)];
  for (; *pp; pp = &(*pp)->next)
    if ((*pp)->hash == h && (*pp)->klen == kl && memcmp((*pp)->key, k, kl) == 0) return pp;
  return pp;
}

skv__entry_t *skv__table_find(skv__table_t *t, const uint8_t *k, size_t kl) {
  return *table_slot(t, k, kl, key_hash(k, kl));
}

int skv__table_init(skv__table_t *t) {
  t->nb = 64;
  t->b = calloc(t->nb, sizeof *t->b);
  return t->b ? 0 : SKV_ENOMEM;
}

static void table_grow(skv__table_t *t) {
  size_t nb = t->nb * 2;
  skv__entry_t **b = calloc(nb, sizeof *b);
  if (!b) return; /* longer chains, still correct */
  for (size_t i = 0; i < t->nb; i++) {
    skv__entry_t *e = t->b[i];
    while (e) {
      skv__entry_t *next = e->next;
      e->next = b[e->hash & (nb - 1)];
      b[e->hash & (nb - 1)] = e;
      e = next;
    }
  }
  free(t->b);
  t->b = b;
  t->nb = nb;
}

void skv__table_free(skv__table_t *t) {
  for (size_t i = 0; t->b && i < t->nb; i++) {
    skv__entry_t *e = t->b[i];
    while (e) {
      skv__entry_t *next = e->next;
      free(e->val);
      free(e);
      e = next;
    }
  }
  free(t->b);
  memset(t, 0, sizeof *t);
}

int skv__table_set(skv__table_t *t, const uint8_t *k, size_t kl, const uint8_t *v, size_t vl,
                   char *msg, size_t cap) {
  uint64_t h = key_hash(k, kl);
  skv__entry_t **pp = table_slot(t, k, kl, h);
  skv__entry_t *e = *pp;
  uint64_t old = e ? e->vlen : 0;
  if (t->bytes - old + vl > SKV_BOOT_MAX_BYTES) {
    snprintf(msg, cap,
             "the store holds %" PRIu64 " value bytes and this value of %zu bytes would pass its "
             "limit of %llu; delete keys that are no longer needed",
             t->bytes, vl, (unsigned long long)SKV_BOOT_MAX_BYTES);
    return SKV_ENOSPC;
  }
  if (!e && t->n >= SKV_BOOT_MAX_KEYS) {
    snprintf(msg, cap, "the store holds %zu keys, its limit; delete keys that are no longer needed",
             t->n);
    return SKV_ENOSPC;
  }
  uint8_t *nv = NULL;
  if (vl) {
    nv = malloc(vl);
    if (!nv) {
      snprintf(msg, cap, "the store server is out of memory for a %zu-byte value", vl);
      return SKV_ENOMEM;
    }
    memcpy(nv, v, vl);
  }
  if (!e) {
    e = malloc(sizeof *e + kl);
    if (!e) {
      free(nv);
      snprintf(msg, cap, "the store server is out of memory for a key");
      return SKV_ENOMEM;
    }
    e->next = NULL;
    e->hash = h;
    e->klen = (uint16_t)kl;
    memcpy(e->key, k, kl);
    e->val = NULL;
    e->vlen = 0;
    *pp = e;
    t->n++;
  }
  free(e->val);
  e->val = nv;
  e->vlen = (uint32_t)vl;
  t->bytes = t->bytes - old + vl;
  if (t->n > t->nb) table_grow(t);
  return 0;
}

void skv__table_del(skv__table_t *t, const uint8_t *k, size_t kl) {
  skv__entry_t **pp = table_slot(t, k, kl, key_hash(k, kl));
  skv__entry_t *e = *pp;
  if (!e) return;
  *pp = e->next;
  t->n--;
  t->bytes -= e->vlen;
  free(e->val);
  free(e);
}
