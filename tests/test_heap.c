/* Multi-PE tests of the host symmetric heap: layout, peer writes and reads through symmetric
 * addresses, collective checks, bad input, and nothing left behind (also after a PE dies). */
#define _GNU_SOURCE
#include "skv_test.h"

#include "heap/heap.h"

#include <criterion/criterion.h>
#include <criterion/parameterized.h>
#include <dirent.h>
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

TestSuite(heap, .timeout = 120);

static int count_dir(const char *path) {
  DIR *d = opendir(path);
  if (!d) return -1;
  int n = 0;
  struct dirent *e;
  while ((e = readdir(d))) n += e->d_name[0] != '.';
  closedir(d);
  return n;
}

/* Mappings of heap segments in this process (heap_host.c names its memfds "symkv-heap-RANK"). */
static int heap_maps(void) {
  FILE *f = fopen("/proc/self/maps", "r");
  if (!f) return -1;
  char line[512];
  int n = 0;
  while (fgets(line, sizeof line, f)) n += strstr(line, "/memfd:symkv-heap-") != NULL;
  fclose(f);
  return n;
}

static int pe_peer_rw(int rank, int npes, void *arg) {
  uint64_t bytes = *(uint64_t *)arg;
  skv_ctx_t *ctx;
  PE_CHECK(skv_test_init(&ctx, 20000) == 0, "init");
  int fds_before = count_dir("/proc/self/fd");
  PE_CHECK(heap_maps() == 0, "heap mappings before create: %d", heap_maps());
  skv_heap_t *heap;
  PE_CHECK(skv_heap_create(ctx, bytes, SKV_BACKEND_HOST, &heap) == 0, "create");
  PE_CHECK(heap_maps() >= npes, "%d heap mappings for %d segments", heap_maps(), npes);
  skv_heap_info_t in = SKV_HEAP_INFO_INIT;
  PE_CHECK(skv_heap_get_info(heap, &in) == 0, "info");
  PE_CHECK(in.npes == npes && in.my_pe == rank && in.data_bytes == bytes, "info fields");
  PE_CHECK(in.signal_offset == 0 && in.scratch_offset >= in.signal_bytes &&
               in.data_offset % 4096 == 0 &&
               in.data_offset >= in.scratch_offset + in.scratch_bytes &&
               in.segment_bytes >= in.data_offset + bytes,
           "layout");
  for (int pe = 0; pe < npes; pe++)
    PE_CHECK(skv_heap_get_ptr(heap, pe, 0) == (char *)in.base + (uint64_t)pe * in.stride,
             "symmetric address of %d", pe);
  /* identical layout everywhere */
  skv_heap_info_t all[SKV_TEST_MAX_PES];
  PE_CHECK(skv_ctx_allgather(ctx, &in, all, sizeof in) == 0, "allgather info");
  for (int r = 0; r < npes; r++)
    PE_CHECK(all[r].data_offset == in.data_offset && all[r].segment_bytes == in.segment_bytes &&
                 all[r].signal_bytes == in.signal_bytes,
             "layout of rank %d differs", r);
  /* freshly created memory is zero */
  const uint8_t *mine = skv_heap_get_ptr(heap, rank, in.data_offset);
  for (uint64_t i = 0; i < bytes; i += 4093)
    PE_CHECK(mine[i] == 0, "byte %llu not zero", (unsigned long long)i);
  /* each PE writes a random pattern into the next PE's data area */
  uint64_t seed = skv_test_seed(), all_seeds[SKV_TEST_MAX_PES];
  PE_CHECK(skv_ctx_allgather(ctx, &seed, all_seeds, sizeof seed) == 0, "seeds");
  int to = (rank + 1) % npes, from = (rank + npes - 1) % npes;
  uint8_t *dst = skv_heap_get_ptr(heap, to, in.data_offset);
  uint64_t s = seed;
  skv_test_fill_random(dst, bytes, &s);
  PE_CHECK(skv_ctx_barrier(ctx) == 0, "barrier");
  uint8_t *want = malloc(bytes);
  s = all_seeds[from];
  skv_test_fill_random(want, bytes, &s);
  PE_CHECK(memcmp(mine, want, bytes) == 0, "my data area does not hold what rank %d wrote", from);
  /* and every PE sees every segment the same way */
  s = all_seeds[(rank + 2 * npes - 2) % npes];
  skv_test_fill_random(want, bytes, &s);
  PE_CHECK(memcmp(skv_heap_get_ptr(heap, from, in.data_offset), want, bytes) == 0,
           "peer segment content");
  free(want);
  PE_CHECK(skv_heap_destroy(heap) == 0, "destroy");
  PE_CHECK(count_dir("/proc/self/fd") == fds_before, "fds leaked: %d -> %d", fds_before,
           count_dir("/proc/self/fd"));
  PE_CHECK(heap_maps() == 0, "%d heap mappings left after destroy", heap_maps());
  PE_CHECK(skv_finalize(ctx) == 0, "finalize");
  return 0;
}

typedef struct {
  int npes;
  uint64_t bytes;
} rw_param_t;

ParameterizedTestParameters(heap, peers_read_what_peers_wrote) {
  static rw_param_t p[] = {{1, 4096},  {2, 1},       {2, 1 << 20},
                           {3, 12345}, {4, 4 << 20}, {8, 256 << 10}};
  return cr_make_param_array(rw_param_t, p, sizeof p / sizeof p[0]);
}

ParameterizedTest(rw_param_t *p, heap, peers_read_what_peers_wrote) {
  skv_test_job_t job;
  uint64_t bytes = p->bytes;
  int bad = skv_test_run(&job, p->npes, pe_peer_rw, &bytes, 90000);
  cr_assert_eq(bad, 0, "PEs failed: %s", skv_test_statuses(&job));
}

/* Segments of 64 MiB of data and more lie on 2 MiB boundaries, advised for transparent huge
 * pages; where the node gives shared memory huge pages, what a PE writes and reads lies on them.
 * A small heap's segments get no advice (a 2 MiB page would be mostly empty). */
static int pe_huge(int rank, int npes, void *arg) {
  skv_ctx_t *ctx;
  PE_CHECK(skv_test_init(&ctx, 20000) == 0, "init");
  const uint64_t sizes[2] = {64 << 20, 1 << 20};
  for (int z = 0; z < 2; z++) {
    const uint64_t bytes = sizes[z];
    skv_heap_t *heap;
    PE_CHECK(skv_heap_create(ctx, bytes, SKV_BACKEND_HOST, &heap) == 0, "create: %s",
             skv_last_error());
    skv_heap_info_t in = SKV_HEAP_INFO_INIT;
    PE_CHECK(skv_heap_get_info(heap, &in) == 0, "info");
    uint8_t *mine = skv_heap_get_ptr(heap, rank, in.data_offset);
    uint64_t s = skv_test_seed();
    skv_test_fill_random(mine, bytes, &s);
    PE_CHECK(skv_ctx_barrier(ctx) == 0, "barrier");
    uint64_t sum = 0; /* every segment read here: mapped in this process */
    for (int pe = 0; pe < npes; pe++)
      for (uint64_t i = 0; i < bytes; i += 4096)
        sum += ((const uint8_t *)skv_heap_get_ptr(heap, pe, in.data_offset))[i];
    int n = 0, advised = 0;
    size_t huge_kb = 0;
    bool aligned = false;
    PE_CHECK(skv_test_maps("/memfd:symkv-heap-", &n, &advised, &huge_kb, &aligned) == 0, "smaps");
    PE_CHECK(n == npes, "%d heap mappings for %d PEs (sum %llu)", n, npes, (unsigned long long)sum);
    if (z == 0) {
      PE_CHECK((uintptr_t)in.base % (2 << 20) == 0 && in.stride % (2 << 20) == 0 && aligned,
               "base %p, stride %llu: not on 2 MiB boundaries", in.base,
               (unsigned long long)in.stride);
      PE_CHECK(advised == npes, "%d of %d segments advised for huge pages", advised, npes);
      /* the kernel may fall back to 4 KiB pages when memory is fragmented: most, not all */
      PE_CHECK(!skv_test_shmem_thp() || huge_kb >= (size_t)npes * (bytes >> 10) / 2,
               "shared memory may have huge pages here, yet %zu kB of %llu kB are on them", huge_kb,
               (unsigned long long)(npes * bytes) >> 10);
    } else {
      PE_CHECK(advised == 0, "%d small segments advised for huge pages", advised);
    }
    PE_CHECK(skv_heap_destroy(heap) == 0, "destroy");
  }
  PE_CHECK(skv_finalize(ctx) == 0, "finalize");
  return 0;
}

Test(heap, large_segments_lie_on_huge_page_boundaries_advised_for_huge_pages) {
  skv_test_job_t job;
  int bad = skv_test_run(&job, 2, pe_huge, NULL, 60000);
  cr_assert_eq(bad, 0, "PEs failed: %s", skv_test_statuses(&job));
}

static int pe_mismatch(int rank, int npes, void *arg) {
  skv_ctx_t *ctx;
  PE_CHECK(skv_test_init(&ctx, 10000) == 0, "init");
  skv_heap_t *heap = NULL;
  int rc = skv_heap_create(ctx, rank == 0 ? 4096 : 8192, SKV_BACKEND_HOST, &heap);
  PE_CHECK(rc == SKV_EMISMATCH && heap == NULL, "got %s", skv_err_name(rc));
  PE_CHECK(strstr(skv_last_error(), "data_bytes=4096") &&
               strstr(skv_last_error(), "data_bytes=8192"),
           "message names both sides: %s", skv_last_error());
  /* the job is still usable afterwards */
  PE_CHECK(skv_heap_create(ctx, 4096, SKV_BACKEND_HOST, &heap) == 0, "create after mismatch");
  PE_CHECK(skv_heap_destroy(heap) == 0, "destroy");
  PE_CHECK(skv_finalize(ctx) == 0, "finalize");
  return 0;
}

Test(heap, mismatched_sizes_fail_on_every_pe) {
  skv_test_job_t job;
  int bad = skv_test_run(&job, 3, pe_mismatch, NULL, 60000);
  cr_assert_eq(bad, 0, "PEs failed: %s", skv_test_statuses(&job));
}

static int pe_bad_input(int rank, int npes, void *arg) {
  skv_ctx_t *ctx;
  PE_CHECK(skv_test_init(&ctx, 10000) == 0, "init");
  skv_heap_t *heap = NULL;
  PE_CHECK(skv_heap_create(ctx, 0, SKV_BACKEND_HOST, &heap) == SKV_EINVAL, "zero bytes");
  PE_CHECK(skv_heap_create(ctx, 1ull << 62, SKV_BACKEND_HOST, &heap) == SKV_EINVAL, "huge");
  PE_CHECK(skv_heap_create(ctx, 4096, 77, &heap) == SKV_EINVAL, "bad backend");
  PE_CHECK(skv_heap_create(NULL, 4096, SKV_BACKEND_HOST, &heap) == SKV_EINVAL, "NULL ctx");
  PE_CHECK(skv_heap_create(ctx, 4096, SKV_BACKEND_HOST, NULL) == SKV_EINVAL, "NULL out");
#ifndef SKV_WITH_CUDA
  PE_CHECK(skv_heap_create(ctx, 4096, SKV_BACKEND_CUDA, &heap) == SKV_ENOTSUP, "cuda without CUDA");
#endif
  skv_heap_opts_t o = SKV_HEAP_OPTS_INIT;
  o.data_bytes = 4096;
  o.size = 8;
  PE_CHECK(skv_heap_create_ex(ctx, &o, &heap) == SKV_EINVAL, "bad opts size");
  PE_CHECK(skv_heap_create(ctx, 4096, SKV_BACKEND_HOST, &heap) == 0, "good create");
  skv_heap_info_t in = SKV_HEAP_INFO_INIT;
  skv_heap_get_info(heap, &in);
  PE_CHECK(skv_heap_get_ptr(heap, npes, 0) == NULL && strstr(skv_last_error(), "PE"),
           "pe out of range");
  PE_CHECK(skv_heap_get_ptr(heap, -1, 0) == NULL, "negative pe");
  PE_CHECK(skv_heap_get_ptr(heap, 0, in.segment_bytes) == NULL, "offset out of range");
  PE_CHECK(skv_heap_get_ptr(heap, 0, in.segment_bytes - 1) != NULL, "last byte in range");
  PE_CHECK(skv_heap_get_ptr(NULL, 0, 0) == NULL, "NULL heap");
  PE_CHECK(skv_heap_get_info(heap, NULL) == SKV_EINVAL, "NULL info");
  /* an output struct the caller did not size is refused, and nothing is written into it */
  skv_heap_info_t unsized;
  memset(&unsized, 0x5a, sizeof unsized);
  unsized.size = 8;
  PE_CHECK(skv_heap_get_info(heap, &unsized) == SKV_EINVAL &&
               strstr(skv_last_error(), "SKV_HEAP_INFO_INIT") && unsized.npes == 0x5a5a5a5a,
           "unsized info: %s", skv_last_error());
  PE_CHECK(skv_heap_destroy(heap) == 0, "destroy");
  PE_CHECK(skv_heap_destroy(NULL) == 0, "destroy NULL");
  PE_CHECK(skv_finalize(ctx) == 0, "finalize");
  return 0;
}

Test(heap, bad_input_gives_clear_errors) {
  skv_test_job_t job;
  int bad = skv_test_run(&job, 2, pe_bad_input, NULL, 60000);
  cr_assert_eq(bad, 0, "PEs failed: %s", skv_test_statuses(&job));
}

static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* The store keys of a failed heap create's steps that remain, over every rank (0 when none). The
 * heap's name is read from a peer's error about it. */
static int create_keys_left(skv_ctx_t *ctx, const char *err, int npes) {
  const char *at =
      strstr(err, "heap/"); /* "skv_heap_create(heap/...)" or "fd exchange \"heap/...\"" */
  if (!at) return -1;
  char name[96];
  if (sscanf(at, "%95[^)\"]", name) != 1) return -1;
  static const char *const steps[] = {"dev", "prep", "made"};
  int left = 0;
  for (int r = 0; r < npes; r++)
    for (int i = 0; i < 3; i++) {
      char key[160];
      snprintf(key, sizeof key, "%s/%s/%d", name, steps[i], r);
      void *v = NULL;
      size_t len = 0;
      int rc = skv__store_try_get(ctx->store, key, &v, &len);
      free(v);
      left += rc != SKV_ENOTFOUND;
    }
  return left;
}

/* One PE's create fails (arg 0: before the fd exchange, memfd_create out of descriptors on PE 1;
 * arg 1: after it, reserving the address range refused on PE 2). Every PE must fail at once with
 * that PE's error and keep nothing mapped, and the job must stay usable. */
static int pe_one_fails(int rank, int npes, void *arg) {
  const int mode = *(const int *)arg, after = mode == 1, in_exchange = mode == 2,
            bad = after ? 2 : 1;
  const uint64_t bytes = 256ull << 20;
  skv_ctx_t *ctx;
  PE_CHECK(skv_test_init(&ctx, 20000) == 0, "init");
  PE_CHECK(skv_ctx_barrier(ctx) == 0, "barrier");
  struct rlimit was;
  const int which = after ? RLIMIT_AS : RLIMIT_NOFILE;
  PE_CHECK(getrlimit(which, &was) == 0, "getrlimit");
  if (rank == bad && after) {
    struct rlimit lim = was;
    lim.rlim_cur = skv_test_vm_bytes() + (64ull << 20); /* the 768 MiB range cannot be reserved */
    PE_CHECK(setrlimit(which, &lim) == 0, "setrlimit");
  }
  if (rank == bad &&
      !after) /* no descriptor for the memfd, or one for it but none for the socket */
    PE_CHECK(skv_test_limit_fds(in_exchange ? 1 : 0, &was) == 0, "limit the descriptors");
  skv_heap_t *heap = (skv_heap_t *)1;
  double t0 = now_s();
  int rc = skv_heap_create(ctx, bytes, SKV_BACKEND_HOST, &heap);
  double took = now_s() - t0;
  if (rank == bad) PE_CHECK(setrlimit(which, &was) == 0, "restore the limit");
  const int want = after ? -ENOMEM : -EMFILE;
  PE_CHECK(rc == want && heap == NULL, "create: %s, want %s", skv_err_name(rc), skv_err_name(want));
  PE_CHECK(took < 5.0, "failing took %.1f s (the timeout is 20 s)", took);
  const char *why = after         ? "reserving"
                    : in_exchange ? "listening on a unix socket"
                                  : "memfd_create";
  PE_CHECK(strstr(skv_last_error(), why), "the error says why: %s", skv_last_error());
  char err[1024] = "";
  if (rank != bad) {
    char who[32];
    snprintf(who, sizeof who, in_exchange ? "(rank %d) failed" : "rank %d failed", bad);
    PE_CHECK(strstr(skv_last_error(), who), "the error names rank %d: %s", bad, skv_last_error());
    snprintf(err, sizeof err, "%s", skv_last_error());
  }
  PE_CHECK(heap_maps() == 0, "%d heap mappings left after the failed create", heap_maps());
  /* the job is still usable afterwards */
  PE_CHECK(skv_heap_create(ctx, bytes, SKV_BACKEND_HOST, &heap) == 0, "create after the failure");
  PE_CHECK(heap_maps() == npes, "%d heap mappings, want %d", heap_maps(), npes);
  PE_CHECK(skv_heap_destroy(heap) == 0, "destroy");
  PE_CHECK(skv_ctx_barrier(ctx) == 0, "barrier");
  /* every PE has made a collective check since: the failed create's keys are gone */
  if (rank == 0)
    PE_CHECK(create_keys_left(ctx, err, npes) == 0, "%d store keys of the failed create left (%s)",
             create_keys_left(ctx, err, npes), err);
  PE_CHECK(skv_ctx_barrier(ctx) == 0, "barrier");
  PE_CHECK(skv_finalize(ctx) == 0, "finalize");
  return 0;
}

Test(heap, one_pe_failing_before_the_exchange_fails_every_pe_at_once) {
  skv_test_job_t job;
  int after = 0;
  int bad = skv_test_run(&job, 3, pe_one_fails, &after, 60000);
  cr_assert_eq(bad, 0, "PEs failed: %s", skv_test_statuses(&job));
}

Test(heap, one_pe_failing_in_the_exchange_before_it_listens_fails_every_pe_at_once) {
  skv_test_job_t job;
  int mode = 2;
  int bad = skv_test_run(&job, 3, pe_one_fails, &mode, 60000);
  cr_assert_eq(bad, 0, "PEs failed: %s", skv_test_statuses(&job));
}

Test(heap, one_pe_failing_after_the_exchange_fails_every_pe_and_nothing_stays_mapped) {
  skv_test_job_t job;
  int after = 1;
  int bad = skv_test_run(&job, 3, pe_one_fails, &after, 60000);
  cr_assert_eq(bad, 0, "PEs failed: %s", skv_test_statuses(&job));
}

#ifndef __SANITIZE_ADDRESS__
/* One calloc of exactly (fail_calloc_n, fail_calloc_size) fails, once (0: none). ASan's
 * allocator cannot be interposed so: the test skips there. */
extern void *__libc_calloc(size_t n, size_t size);
static size_t fail_calloc_n, fail_calloc_size;
void *calloc(size_t n, size_t size) {
  if (fail_calloc_size && n == fail_calloc_n && size == fail_calloc_size) {
    fail_calloc_size = 0;
    errno = ENOMEM;
    return NULL;
  }
  return __libc_calloc(n, size);
}

/* PE 2 cannot allocate the agreement's records (calloc of npes x 512 bytes) in the first
 * agreement of a create: it must still tell the others, who fail at once, naming it. */
static int pe_agree_out_of_memory(int rank, int npes, void *arg) {
  (void)arg;
  skv_ctx_t *ctx;
  PE_CHECK(skv_test_init(&ctx, 20000) == 0, "init");
  PE_CHECK(skv_ctx_barrier(ctx) == 0, "barrier");
  if (rank == 2) {
    fail_calloc_n = (size_t)npes;
    fail_calloc_size = sizeof(skv__step_result_t); /* the records of skv__coll_agree */
  }
  skv_heap_t *heap = (skv_heap_t *)1;
  double t0 = now_s();
  int rc = skv_heap_create(ctx, 1 << 20, SKV_BACKEND_HOST, &heap);
  double took = now_s() - t0;
  PE_CHECK(fail_calloc_size == 0, "the agreement's calloc was not made");
  PE_CHECK(rc == SKV_ENOMEM && heap == NULL, "create: %s", skv_err_name(rc));
  PE_CHECK(took < 5.0, "failing took %.1f s (the timeout is 20 s)", took);
  if (rank != 2)
    PE_CHECK(strstr(skv_last_error(), "rank 2 failed"), "the error names rank 2: %s",
             skv_last_error());
  PE_CHECK(skv_heap_create(ctx, 1 << 20, SKV_BACKEND_HOST, &heap) == 0, "create after the failure");
  PE_CHECK(skv_heap_destroy(heap) == 0, "destroy");
  PE_CHECK(skv_finalize(ctx) == 0, "finalize");
  return 0;
}
#endif

Test(heap, a_pe_out_of_memory_in_an_agreement_still_tells_the_others) {
#ifdef __SANITIZE_ADDRESS__
  cr_skip_test(
      "interposes calloc, which ASan's allocator does not allow (runs in the plain build)");
#else
  skv_test_job_t job;
  int bad = skv_test_run(&job, 3, pe_agree_out_of_memory, NULL, 60000);
  cr_assert_eq(bad, 0, "PEs failed: %s", skv_test_statuses(&job));
#endif
}

static int pe_dies_with_heap(int rank, int npes, void *arg) {
  skv_ctx_t *ctx;
  PE_CHECK(skv_test_init(&ctx, 3000) == 0, "init");
  skv_heap_t *heap;
  PE_CHECK(skv_heap_create(ctx, 1 << 20, SKV_BACKEND_HOST, &heap) == 0, "create");
  memset(skv_heap_get_ptr(heap, rank, heap->info.data_offset), 0x40 + rank, 1 << 20);
  PE_CHECK(skv_ctx_barrier(ctx) == 0, "barrier");
  if (rank == 1) raise(SIGKILL);
  /* The dead PE's segment stays readable for the survivors until they unmap it. */
  const uint8_t *dead = skv_heap_get_ptr(heap, 1, heap->info.data_offset);
  PE_CHECK(dead[0] == 0x41 && dead[(1 << 20) - 1] == 0x41, "dead PE's data");
  int rc = skv_heap_destroy(heap);
  PE_CHECK(rc == SKV_EPEERDEAD || rc == SKV_ETIMEDOUT, "destroy with a dead peer: %s",
           skv_err_name(rc));
  /* the dead PE's segment too: a survivor's mapping is what keeps its memory alive */
  PE_CHECK(heap_maps() == 0, "%d heap mappings left after destroy", heap_maps());
  skv_finalize(ctx);
  return 0;
}

Test(heap, destroy_after_a_pe_died_leaves_nothing_behind) {
  skv_test_job_t job;
  skv_test_spawn(&job, 3, pe_dies_with_heap, NULL);
  skv_test_wait(&job, 60000);
  cr_assert_eq(job.status[1], 128 + SIGKILL);
  cr_assert(job.status[0] == 0 && job.status[2] == 0, "survivors: %s", skv_test_statuses(&job));
}
