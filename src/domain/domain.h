/* Internal API of the elastic node domain: a named, node-shared segment (slot table, page
 * records, index) that processes attach to and detach from at any time, without a server. */
#ifndef SKV_DOMAIN_H
#define SKV_DOMAIN_H

#include "core/core.h"
#include "heap/heap.h"
#include "index/index.h"
#include "pool/pool.h"

#include <pthread.h>

/* How it works
 * ------------
 * The domain named N is the file /dev/shm/symkv-N (shm_open, mode 0600 or 0660 with a group).
 * Its first attacher creates and lays it out; later attachers find it by name. Layout:
 *
 *   [ header | slot table (max_slots) | page records, one pool part per slot | index shards ]
 *
 * Every participant (owner or reader) holds one slot s: its bit in every page's pin mask and
 * in the slot table's mapped_by words. An owner's pages live in its own heap segment (a memfd,
 * or cuMemCreate memory exported as a POSIX fd); every process reserves max_slots * stride of
 * address space and maps slot s's segment at base + s * stride the first time it reads it, so a
 * page's address stays arithmetic. The owner hands its segment over itself: a thread of the
 * owner accepts on an abstract unix socket whose name carries a random nonce (published in the
 * segment only after it is bound, so no one can squat it), checks the caller's credentials (same
 * user, the pid of a live slot) and sends the fd with SCM_RIGHTS; the caller checks the owner's
 * credentials in turn.
 *
 * Liveness is held, not inferred: each participant holds an open-file-description lock on byte
 * 1 + s of the segment for as long as it is attached; the kernel drops it when the process dies,
 * whatever its pid namespace. Byte 0 is the attach lock: attach, detach and reclaim take it, so
 * membership changes one at a time (the data path never takes it).
 *
 * Attach: lock byte 0; check that the file is still the one the name names (a last detacher may
 * have unlinked it); create or validate the layout (a domain whose participants all died is
 * laid out afresh); take the first slot whose lock is free and that no live participant still
 * maps, reclaiming it if its holder died (below); hold its lock; an owner creates its segment
 * and page records (generations continue from the slot's previous incarnation, so an old page
 * reference is stale, never wrong) and starts its hand-over thread; the slot becomes ACTIVE.
 * Detach: lock byte 0; LEAVING; every READY page is taken out of the index (the owner waits,
 * bounded, for other participants' pins to drop; a page still pinned then stays pinned, see
 * below), pins this process holds are released, the mappings go, the slot is FREE; the last
 * participant out unlinks the file, so nothing stays behind.
 * Reclaim (slot r's holder died, found by an attacher): r's bit is cleared in every pin mask
 * and mapped_by word, every index entry and claim of r is removed (so nothing points at the
 * dead memory), and r's pages become FREE with their next generation.
 *
 * What can go wrong
 * -----------------
 * - A reader is copying from an owner that leaves or dies: its mapping keeps the memory alive
 *   (a memfd, or an imported CUDA allocation), so the bytes it copies are the ones it pinned.
 *   The slot is not reused while any live participant maps it; a participant drops its mapping
 *   of a slot whose incarnation changed once its own copies from it completed.
 * - A stopped participant keeps its slot, its pins and its mappings (its lock is held).
 * - A process that forks keeps the domain's file description in the child, and with it the
 *   locks: a forked child of an attached process must close it (it is O_CLOEXEC for exec). */

#define SKV__DOM_MAX_SLOTS  64           /* one bit each in the 64-bit pin masks */
#define SKV__DOM_SLOT_ALIGN (2ull << 20) /* slot segments: 2 MiB (the GPUs' granularity) */

enum { SKV__DOM_FREE = 0, SKV__DOM_ATTACHING = 1, SKV__DOM_ACTIVE = 2, SKV__DOM_LEAVING = 3 };

typedef struct skv__dom_hdr {
  uint64_t magic; /* SKV__DOM_MAGIC once laid out (stored last) */
  uint32_t version, max_slots;
  skv_geometry_t geom;
  uint64_t pages_per_slot, page_bytes, page_stride, slot_bytes;
  int32_t backend, pad0;
  uint64_t index_sps;    /* index slots per shard (max_slots shards) */
  uint64_t ns_hi, ns_lo; /* namespace the domain serves; 0, 0: any */
  uint64_t off_slots, off_pool, off_index, pool_bytes, shard_bytes, total_bytes;
  uint64_t created_ns; /* CLOCK_REALTIME of the layout, for logs */
  uint64_t gen;        /* bumped at every membership change */
  uint64_t pad[8];
} skv__dom_hdr_t;

typedef struct skv__dom_slot {
  uint64_t state;     /* SKV__DOM_* */
  uint64_t epoch;     /* incarnation of the slot: bumped at each attach to it */
  uint64_t mapped_by; /* participants that map this slot's segment (bit per slot) */
  int32_t role;       /* SKV_ROLE_OWNER or SKV_ROLE_READER */
  int32_t pid;
  uint64_t seg_bytes; /* bytes of the owner's segment */
  char sock[40];      /* abstract socket name of the owner's hand-over thread (no NUL lead) */
  uint64_t pad[3];
} skv__dom_slot_t;

typedef struct skv__domain skv__domain_t;

typedef struct skv__dom_params {
  const char *name;
  skv_geometry_t geom;
  int role;                         /* SKV_ROLE_OWNER / SKV_ROLE_READER */
  int backend;                      /* owners: where pages live; must match the domain's */
  uint64_t pages_per_slot;          /* 0: the domain's (or 1024 for a new one) */
  uint32_t max_slots;               /* 0: the domain's (or 64) */
  uint64_t index_slots;             /* 0: 4 per page of the whole domain */
  uint64_t page_bytes, page_stride; /* from the geometry */
  int timeout_ms;
  int group;             /* -1, or the gid whose members may attach too (mode 0660) */
  uint64_t ns_hi, ns_lo; /* namespace the caller uses (0, 0: none given) */
  skv_ctx_t *ctx;        /* a context of the process alone (device, timeout) */
  skv__pool_t *pool;     /* the caller's pool and index (index->hdr / ->slots arrays of */
  skv__index_t *index;   /* SKV__DOM_MAX_SLOTS entries): bound to the domain by attach */
} skv__dom_params_t;

/* Attach to (creating when needed) the domain `p->name`: p->pool and p->index are bound to the
 * segment with this process's slot as `me`; skv__domain_heap describes the reserved range (base,
 * stride, npes = max_slots, my_pe = the slot, backend). */
int skv__domain_attach(const skv__dom_params_t *p, skv__domain_t **out);
/* Leave: an owner's pages out of the index (`unindex` erases each, waiting boundedly for pins),
 * `before_unmap(arg)` (the caller's copies complete), this process's pins released, mappings
 * gone, the slot FREE; the last participant out removes the segment. Frees the handle. */
int skv__domain_detach(skv__domain_t *d, skv__pool_evict_cb unindex, void *unindex_arg,
                       void (*before_unmap)(void *arg), void *arg);

skv_heap_t *skv__domain_heap(skv__domain_t *d);
int skv__domain_slot(const skv__domain_t *d);
int skv__domain_role(const skv__domain_t *d);
const skv__dom_hdr_t *skv__domain_hdr(const skv__domain_t *d);

/* Before reading the segments of slots pe[i * step] (i < n): make sure each is mapped here, and
 * keep them so until skv__domain_map_end (a read lock). Mappings of slots whose owner left or
 * died are dropped first (`quiesce(arg)` runs before, so that no copy of this process still
 * reads them, and this process's pins on them go). SKV_ESTALE when a slot has no live owner. */
int skv__domain_map_begin(skv__domain_t *d, const uint32_t *pe, size_t step, size_t n,
                          void (*quiesce)(void *arg), void *arg);
void skv__domain_map_end(skv__domain_t *d);
/* Drop the mappings of slots whose owner left or died since this process last looked (every
 * lookup and publish does, not only fetches), so that a process that stopped fetching does not
 * keep departed owners' slots from new attachers. Cheap when nothing changed (one load). */
void skv__domain_tidy(skv__domain_t *d, void (*quiesce)(void *arg), void *arg);
/* Is slot s's participant alive (its lock held)? */
bool skv__domain_alive(skv__domain_t *d, int s);

#endif
