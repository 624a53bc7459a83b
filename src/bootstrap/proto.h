/* The bootstrap store's wire protocol, shared by the server, the client and the tests: opcodes,
 * frame and reply layouts, limits, and a frame builder and reader over core/bytes.h. */
#ifndef SKV_BOOTSTRAP_PROTO_H
#define SKV_BOOTSTRAP_PROTO_H

#include "bootstrap/bootstrap.h"
#include "core/bytes.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Limits of the protocol (docs/bootstrap.md, "Frames" and "Limits"); keys and values are
 * limited by SKV_BOOT_MAX_KEY and SKV_BOOT_MAX_VALUE (bootstrap.h). */
#define SKV_BOOT_PROTO_VERSION 1
#define SKV_BOOT_MAX_FRAME     (SKV_BOOT_MAX_VALUE + 1024u) /* bytes of one frame's payload */
#define SKV_BOOT_PRE_HELLO_MAX_FRAME \
  4096u                                 /* a HELLO is small; anything bigger before it is garbage */
#define SKV_BOOT_MAX_TOKEN        1024u /* bytes of the job's token */
#define SKV_BOOT_HELLO_TIMEOUT_MS 2000  /* a connection must say HELLO by then (PEs do at once) */

/* Every frame, both ways: u32 length of what follows, then (requests) the opcode and fields. */
#define SKV_BOOT_FRAME_HDR 4
/* A reply: u32 length (4 + payload), i32 status (0 or a negative SKV_E* code), payload. */
#define SKV_BOOT_REPLY_HDR 8
/* HELLO: opcode, u32 version, i32 rank, i32 nranks, then the token (the rest of the frame). */
#define SKV_BOOT_HELLO_FIXED 13

/* Opcodes (docs/bootstrap.md, "Requests"). */
typedef enum skv__boot_op {
  SKV_BOOT_OP_HELLO = 1,
  SKV_BOOT_OP_SET = 2,
  SKV_BOOT_OP_GET = 3,
  SKV_BOOT_OP_TRY_GET = 4,
  SKV_BOOT_OP_ADD = 5,
  SKV_BOOT_OP_WAIT = 6,
  SKV_BOOT_OP_WAIT_GE = 7,
  SKV_BOOT_OP_DEL = 8,
  SKV_BOOT_OP_BYE = 9,
} skv__boot_op_t;

/* ---- frame builder ------------------------------------------------------------------------- */

/* A frame being built in a growing buffer: begin, fields, end (which fills in the length).
 * `failed` once memory ran out: later fields are dropped and the caller reports ENOMEM.
 * Starts zeroed; skv__frame_free releases the buffer. */
typedef struct skv__frame {
  uint8_t *p;
  size_t len, cap;
  bool failed;
} skv__frame_t;

static inline void skv__frame_put(skv__frame_t *f, const void *src, size_t n) {
  if (f->failed) return;
  if (f->len + n > f->cap) {
    size_t cap = SKV_MAX(f->cap * 2, f->len + n + 64);
    uint8_t *p = realloc(f->p, cap);
    if (!p) {
      f->failed = true;
      return;
    }
    f->p = p;
    f->cap = cap;
  }
  if (n) memcpy(f->p + f->len, src, n);
  f->len += n;
}
static inline void skv__frame_u8(skv__frame_t *f, uint8_t v) {
  skv__frame_put(f, &v, 1);
}
static inline void skv__frame_u16(skv__frame_t *f, uint16_t v) {
  uint8_t b[2];
  skv__put_le16(b, v);
  skv__frame_put(f, b, 2);
}
static inline void skv__frame_u32(skv__frame_t *f, uint32_t v) {
  uint8_t b[4];
  skv__put_le32(b, v);
  skv__frame_put(f, b, 4);
}
static inline void skv__frame_u64(skv__frame_t *f, uint64_t v) {
  uint8_t b[8];
  skv__put_le64(b, v);
  skv__frame_put(f, b, 8);
}
/* A key: u16 length, then its bytes. */
static inline void skv__frame_key(skv__frame_t *f, const char *k) {
  size_t n = strlen(k);
  skv__frame_u16(f, (uint16_t)n);
  skv__frame_put(f, k, n);
}
/* Start a new frame in `f` (its buffer is reused): room for the length, then the opcode. */
static inline void skv__frame_begin(skv__frame_t *f, uint8_t op) {
  f->len = 0;
  f->failed = false;
  skv__frame_u32(f, 0);
  skv__frame_u8(f, op);
}
/* Fill in the length of the frame begun last. */
static inline void skv__frame_end(skv__frame_t *f) {
  if (!f->failed) skv__put_le32(f->p, (uint32_t)(f->len - SKV_BOOT_FRAME_HDR));
}
/* A whole HELLO frame. */
static inline void skv__frame_hello(skv__frame_t *f, const char *token, int rank, int nranks) {
  skv__frame_begin(f, SKV_BOOT_OP_HELLO);
  skv__frame_u32(f, SKV_BOOT_PROTO_VERSION);
  skv__frame_u32(f, (uint32_t)rank);
  skv__frame_u32(f, (uint32_t)nranks);
  skv__frame_put(f, token, strlen(token));
  skv__frame_end(f);
}
static inline void skv__frame_free(skv__frame_t *f) {
  free(f->p);
  f->p = NULL;
  f->len = f->cap = 0;
}

/* ---- reply header -------------------------------------------------------------------------- */

static inline void skv__reply_hdr_put(uint8_t *p, size_t payload, int32_t status) {
  skv__put_le32(p, (uint32_t)(4 + payload));
  skv__put_le32(p + 4, (uint32_t)status);
}
/* *len: the length field as sent (4 + payload bytes, unchecked). */
static inline void skv__reply_hdr_get(const uint8_t *p, uint32_t *len, int32_t *status) {
  *len = skv__get_le32(p);
  *status = (int32_t)skv__get_le32(p + 4);
}

/* ---- frame reader -------------------------------------------------------------------------- */

/* A cursor over one frame's fields; `bad` once a field runs past the end (every later field
 * reads as 0 / NULL). */
typedef struct skv__reader {
  const uint8_t *p;
  size_t n, off;
  bool bad;
} skv__reader_t;

static inline void skv__read_init(skv__reader_t *r, const uint8_t *p, size_t n, size_t off) {
  r->p = p;
  r->n = n;
  r->off = off;
  r->bad = false;
}
static inline const uint8_t *skv__read_take(skv__reader_t *r, size_t n) {
  if (r->bad || r->n - r->off < n) {
    r->bad = true;
    return NULL;
  }
  const uint8_t *p = r->p + r->off;
  r->off += n;
  return p;
}
static inline uint32_t skv__read_u32(skv__reader_t *r) {
  const uint8_t *p = skv__read_take(r, 4);
  return p ? skv__get_le32(p) : 0;
}
static inline uint64_t skv__read_u64(skv__reader_t *r) {
  const uint8_t *p = skv__read_take(r, 8);
  return p ? skv__get_le64(p) : 0;
}
/* A key: u16 length, then its bytes. */
static inline const uint8_t *skv__read_key(skv__reader_t *r, size_t *kl) {
  const uint8_t *p = skv__read_take(r, 2);
  if (!p) return NULL;
  *kl = skv__get_le16(p);
  return skv__read_take(r, *kl);
}
/* Every field read, and nothing left over. */
static inline bool skv__read_done(const skv__reader_t *r) {
  return !r->bad && r->off == r->n;
}

#endif /* SKV_BOOTSTRAP_PROTO_H */
