/* The bootstrap store's key table: keys to values by chained hashing, with the count of keys and
 * value bytes held against the store's limits. The server's loop thread owns it (no locking). */
#ifndef SKV_BOOTSTRAP_STORE_TABLE_H
#define SKV_BOOTSTRAP_STORE_TABLE_H

#include "bootstrap/bootstrap.h"

#include <stddef.h>
#include <stdint.h>

#define SKV_BOOT_MAX_KEYS  (1u << 20)   /* keys the server holds at most */
#define SKV_BOOT_MAX_BYTES (1ull << 30) /* value bytes the server holds at most */

/* ---- store_table.c ------------------------------------------------------------------------- */

/* One key and its value (a counter is an 8-byte value: bootstrap/proto.h). */
typedef struct skv__entry {
  struct skv__entry *next;
  uint64_t hash;
  uint8_t *val;
  uint32_t vlen;
  uint16_t klen;
  uint8_t key[];
} skv__entry_t;

typedef struct skv__table {
  skv__entry_t **b;
  size_t nb;      /* buckets: a power of two */
  size_t n;       /* keys */
  uint64_t bytes; /* value bytes */
} skv__table_t;

/* 0, or SKV_ENOMEM. */
int skv__table_init(skv__table_t *t);
/* Every key and value freed. */
void skv__table_free(skv__table_t *t);
/* The entry of key k (kl bytes), or NULL. */
skv__entry_t *skv__table_find(skv__table_t *t, const uint8_t *k, size_t kl);
/* Set key k to a copy of v (vl bytes): 0, or SKV_ENOSPC past SKV_BOOT_MAX_KEYS or
 * SKV_BOOT_MAX_BYTES, or SKV_ENOMEM, with `msg` (cap bytes) saying why for the client. */
int skv__table_set(skv__table_t *t, const uint8_t *k, size_t kl, const uint8_t *v, size_t vl,
                   char *msg, size_t cap);
/* Delete key k (nothing when absent). */
void skv__table_del(skv__table_t *t, const uint8_t *k, size_t kl);

#endif /* SKV_BOOTSTRAP_STORE_TABLE_H */
