/* Host heap backend: each PE's segment is a memfd, passed to the local peers over a unix
 * socket (SCM_RIGHTS) and mapped by every PE into one reserved range at base + pe * stride. */
#define _GNU_SOURCE
#include "heap/heap.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

typedef struct host_impl {
  void *reserved; /* the whole range: npes * stride bytes */
  size_t reserved_bytes;
} host_impl_t;

static uint64_t host_granularity(skv_heap_t *heap) {
  long pg = sysconf(_SC_PAGESIZE);
  uint64_t g = pg > 0 ? (uint64_t)pg : 4096;
  /* Large segments on 2 MiB boundaries so that huge pages can back them. */
  if (heap->info.data_bytes >= (64ull << 20)) g = SKV_MAX(g, 2ull << 20);
  return g;
}

/* Create and size this PE's memfd. */
static int make_segment(skv_heap_t *heap, int *fd_out) {
  char name[64];
  snprintf(name, sizeof name, "symkv-heap-%d", heap->ctx->cfg.rank);
  int fd = memfd_create(name, MFD_CLOEXEC);
  if (fd < 0)
    return SKV_FAIL(-errno, SKV_SUBSYS_HEAP,
                    "memfd_create failed: %s (too many open files? ulimit -n)", strerror(errno));
  if (ftruncate(fd, (off_t)heap->info.segment_bytes) != 0) {
    int e = errno;
    close(fd);
    char b[32];
    return SKV_FAIL(-e, SKV_SUBSYS_HEAP, "sizing the %s heap segment failed: %s",
                    skv__fmt_bytes(heap->info.segment_bytes, b, sizeof b), strerror(e));
  }
  *fd_out = fd;
  return 0;
}

#define HUGE_BYTES (2ull << 20)

void *skv__host_reserve(size_t bytes) {
  /* over-reserve by 2 MiB, then give back what lies outside the aligned range */
  const size_t span = bytes + HUGE_BYTES;
  char *r = mmap(NULL, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (r == MAP_FAILED) return NULL;
  char *at = (char *)SKV_ALIGN_UP((uintptr_t)r, HUGE_BYTES);
  if (at > r) munmap(r, (size_t)(at - r));
  if (at + bytes < r + span) munmap(at + bytes, (size_t)(r + span - (at + bytes)));
  return at;
}

bool skv__host_shmem_thp(char *buf, size_t cap) {
  char line[128] = "";
  FILE *f = fopen("/sys/kernel/mm/transparent_hugepage/shmem_enabled", "r");
  if (f) {
    if (!fgets(line, sizeof line, f)) line[0] = 0;
    fclose(f);
  }
  const char *l = strchr(line, '['), *e = l ? strchr(l, ']') : NULL;
  if (e)
    snprintf(buf, cap, "%.*s", (int)(e - l - 1), l + 1);
  else
    snprintf(buf, cap, "unknown");
  return e && strcmp(buf, "never") != 0 && strcmp(buf, "deny") != 0;
}

/* Say once per process when the node gives shared memory no transparent huge pages. */
static void note_shmem_thp(void) {
  static int told;
  if (__atomic_exchange_n(&told, 1, __ATOMIC_RELAXED)) return;
  char mode[32];
  if (!skv__host_shmem_thp(mode, sizeof mode))
    SKV_INFO(SKV_SUBSYS_HEAP,
             "host segments stay on 4 KiB pages: this node gives shared memory no transparent "
             "huge pages (shmem_enabled: %s); 'advise' there makes host fetches faster "
             "(docs/reference.md, Symmetric heap)",
             mode);
}

void skv__host_advise_huge(void *at, size_t bytes) {
  if (bytes < HUGE_BYTES || (uintptr_t)at % HUGE_BYTES) return;
  /* the advice stays with the mapping either way: it takes effect wherever the node allows */
  if (madvise(at, bytes, MADV_HUGEPAGE) != 0)
    SKV_INFO(SKV_SUBSYS_HEAP, "madvise(MADV_HUGEPAGE) on a host segment failed: %s",
             strerror(errno));
  note_shmem_thp();
}

/* Map every PE's memfd into one reserved range; on failure nothing stays mapped. */
int skv__heap_host_map(skv_heap_t *heap, const int *fds, void **base_out, size_t *bytes_out);
int skv__heap_host_map(skv_heap_t *heap, const int *fds, void **base_out, size_t *bytes_out) {
  skv_heap_info_t *in = &heap->info;
  size_t total = (size_t)in->stride * (size_t)in->npes;
  void *base = skv__host_reserve(total);
  if (!base) {
    char b[32];
    return SKV_FAIL(-errno, SKV_SUBSYS_HEAP, "reserving %s of address space failed: %s",
                    skv__fmt_bytes(total, b, sizeof b), strerror(errno));
  }
  for (int pe = 0; pe < in->npes; pe++) {
    void *want = (char *)base + (size_t)pe * in->stride;
    void *p =
        mmap(want, in->segment_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fds[pe], 0);
    if (p == MAP_FAILED) {
      int e = errno;
      munmap(base, total);
      return SKV_FAIL(-e, SKV_SUBSYS_HEAP, "mapping PE %d's heap segment failed: %s", pe,
                      strerror(e));
    }
    skv__host_advise_huge(p, in->segment_bytes);
  }
  *base_out = base;
  *bytes_out = total;
  return 0;
}

int skv__heap_host_create(skv_heap_t *heap, int rc) {
  skv_ctx_t *ctx = heap->ctx;
  int n = heap->info.npes;
  int my_fd = -1;
  int *fds = malloc(sizeof(int) * (size_t)n);
  host_impl_t *impl = calloc(1, sizeof *impl);
  if (rc == 0 && (!fds || !impl)) rc = SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_HEAP, "out of memory");
  if (rc == 0) rc = make_segment(heap, &my_fd);
  for (int i = 0; fds && i < n; i++) fds[i] = -1;
  SKV_CHECK_GOTO(skv__heap_agree(heap, "prep", rc), rc, out);
  SKV_CHECK_GOTO(skv__fd_exchange(ctx->store, heap->name, ctx->local_ranks, n, ctx->local_index,
                                  my_fd, fds, ctx->cfg.timeout_ms),
                 rc, out);
  SKV_CHECK_GOTO(skv__heap_host_map(heap, fds, &impl->reserved, &impl->reserved_bytes), rc, out);
  heap->info.base = impl->reserved;
  heap->impl = impl;
  impl = NULL;
out:
  /* The mappings keep the memfds alive; nothing is left to name or unlink. */
  for (int i = 0; fds && i < n; i++)
    if (fds[i] >= 0) close(fds[i]);
  if (my_fd >= 0) close(my_fd);
  free(fds);
  free(impl);
  return rc;
}

static int host_create(skv_heap_t *heap) {
  return skv__heap_host_create(heap, 0);
}

static int host_destroy(skv_heap_t *heap) {
  host_impl_t *impl = heap->impl;
  if (!impl) return 0;
  int rc = 0;
  if (munmap(impl->reserved, impl->reserved_bytes) != 0)
    rc = SKV_FAIL(-errno, SKV_SUBSYS_HEAP, "unmapping the heap failed: %s", strerror(errno));
  free(impl);
  heap->impl = NULL;
  return rc;
}

const skv__heap_backend_t skv__heap_host = {
    .name = "host",
    .granularity = host_granularity,
    .create = host_create,
    .destroy = host_destroy,
};
