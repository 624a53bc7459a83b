/* Internals shared by the files of the elastic domain: the process's handle on a domain, the
 * mapping of slots' segments (map.c) and the owners' hand-over of their segment (handoff.c). */
#ifndef SKV_DOMAIN_INT_H
#define SKV_DOMAIN_INT_H

#include "domain/domain.h"

struct skv__domain {
  char name[56], shm_name[64], path[80];
  int fd; /* the segment's file: holds our attach and slot locks while open */
  int slot, role;
  uint32_t max_slots;
  uint64_t epoch; /* our slot's incarnation */
  skv_ctx_t *ctx;
  int timeout_ms;
  skv__dom_hdr_t *hdr;
  skv__dom_slot_t *slots;
  void *seg;
  size_t seg_bytes;
  skv__pool_t *pool;                     /* the caller's, bound to the segment */
  skv__index_t *index;                   /* the caller's, bound to the segment */
  uint64_t alive_ms[SKV__DOM_MAX_SLOTS]; /* when slot s was last found alive */
  /* the reserved range and what is mapped into it (map.c) */
  skv_heap_t heap;         /* info: base, stride, npes = max_slots, my_pe, backend */
  pthread_rwlock_t map_rw; /* readers: copies in progress; writer: (re)mapping */
  bool map_init;
  void *reserved;                      /* host: the PROT_NONE range */
  uint64_t cuda_base;                  /* cuda: the reserved device range (CUdeviceptr) */
  uint64_t mapped[SKV__DOM_MAX_SLOTS]; /* incarnation of slot s mapped here, 0 when not */
  uint64_t seen_gen;                   /* hdr->gen when the mappings were last looked over */
  /* an owner's own segment and its hand-over (handoff.c) */
  int seg_fd;          /* memfd, or the exported POSIX fd of the CUDA allocation */
  uint64_t own_handle; /* CUmemGenericAllocationHandle, 0 when none */
  int listen_fd, stop_pipe[2];
  pthread_t handoff;
  bool handoff_on;
};

/* ---- map.c --------------------------------------------------------------------------------- */

/* Reserve max_slots * stride of address space (host or device) and fill `heap`. */
int skv__dom_reserve(skv__domain_t *d);
/* An owner: create its segment (a memfd, or exportable device memory), map it in its slot. */
int skv__dom_own_segment(skv__domain_t *d);
/* An owner leaving: its segment goes (what peers mapped stays alive for them). */
void skv__dom_release_own(skv__domain_t *d);
/* Unmap every slot mapped here (our bits in mapped_by cleared) and free the reservation. */
void skv__dom_unmap_all(skv__domain_t *d);

/* ---- handoff.c ----------------------------------------------------------------------------- */

/* Bind the owner's abstract socket (a random name) and start the thread that hands the segment
 * over to participants that ask; the name goes into the slot record once bound. */
int skv__dom_handoff_start(skv__domain_t *d);
void skv__dom_handoff_stop(skv__domain_t *d);
/* Ask slot s's owner for its segment: an fd of it, for incarnation `epoch` (SKV_ESTALE when the
 * slot has another incarnation or no owner now). */
int skv__dom_handoff_get(skv__domain_t *d, int s, uint64_t epoch, int *fd);

#endif
