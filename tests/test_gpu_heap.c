/* GPU tests of the CUDA heap backends (skipped without a GPU): PEs write into peers' device
 * segments through symmetric addresses and read back what peers wrote; cuda_host segments are
 * reached by kernels and by the CPU at the same address; destroy gives the memory back, also
 * after a PE died. */
#define _GNU_SOURCE
#include "skv_test.h"

#include "heap/heap.h"

#include <criterion/criterion.h>
#include <criterion/parameterized.h>
#include <errno.h>
#include <signal.h>
#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

TestSuite(gpu_heap, .timeout = 180);

typedef struct {
  int npes;
  int backend;
  uint64_t bytes;
} gh_param_t;

static int pe_gpu_rw(int rank, int npes, void *arg) {
  gh_param_t *p = arg;
  skv_ctx_t *ctx;
  PE_CHECK(skv_test_init(&ctx, 60000) == 0, "init");
  int dev = skv_ctx_get_device(ctx);
  PE_CHECK(dev >= 0, "device: %s", skv_err_name(dev));
  /* Device memory is compared before and after at points where every PE is in step: a PE's
   * segment stays allocated until its peers unmapped it too, and PEs may share a device. */
  size_t free0, total;
  PE_CHECK(cudaMemGetInfo(&free0, &total) == cudaSuccess, "meminfo"); /* creates the context */
  PE_CHECK(skv_ctx_barrier(ctx) == 0, "barrier");
  PE_CHECK(cudaMemGetInfo(&free0, &total) == cudaSuccess, "meminfo");
  PE_CHECK(skv_ctx_barrier(ctx) == 0, "barrier");
  skv_heap_t *heap;
  PE_CHECK(skv_heap_create(ctx, p->bytes, p->backend, &heap) == 0, "create");
  skv_heap_info_t in;
  skv_heap_get_info(heap, &in);
  PE_CHECK(in.device == dev && in.npes == npes && in.data_offset % 4096 == 0, "info");
  uint8_t *mine = skv_heap_get_ptr(heap, rank, in.data_offset);
  /* fresh segments are zero */
  uint8_t *host = malloc(p->bytes), *want = malloc(p->bytes);
  PE_CHECK(cudaMemcpy(host, mine, p->bytes, cudaMemcpyDefault) == cudaSuccess, "read own");
  for (uint64_t i = 0; i < p->bytes; i++)
    PE_CHECK(host[i] == 0, "byte %llu of a fresh segment is %u", (unsigned long long)i, host[i]);
  uint64_t seed = skv_test_seed(), seeds[SKV_TEST_MAX_PES];
  PE_CHECK(skv_ctx_allgather(ctx, &seed, seeds, sizeof seed) == 0, "seeds");
  int to = (rank + 1) % npes, from = (rank + npes - 1) % npes;
  uint64_t s = seed;
  skv_test_fill_random(host, p->bytes, &s);
  /* write through the symmetric address of the next PE's segment */
  PE_CHECK(cudaMemcpy(skv_heap_get_ptr(heap, to, in.data_offset), host, p->bytes, cudaMemcpyDefault) ==
               cudaSuccess,
           "write to peer %d", to);
  PE_CHECK(cudaDeviceSynchronize() == cudaSuccess, "sync");
  PE_CHECK(skv_ctx_barrier(ctx) == 0, "barrier");
  memset(host, 0xA5, p->bytes);
  PE_CHECK(cudaMemcpy(host, mine, p->bytes, cudaMemcpyDefault) == cudaSuccess, "read own");
  s = seeds[from];
  skv_test_fill_random(want, p->bytes, &s);
  PE_CHECK(memcmp(host, want, p->bytes) == 0, "my segment does not hold what PE %d wrote", from);
  if (p->backend == SKV_BACKEND_CUDA_HOST)
    PE_CHECK(memcmp(mine, want, p->bytes) == 0,
             "the CPU sees other bytes than the GPU at the same address");
  PE_CHECK(skv_ctx_barrier(ctx) == 0, "barrier");
  PE_CHECK(skv_heap_destroy(heap) == 0, "destroy");
  PE_CHECK(cudaDeviceSynchronize() == cudaSuccess, "sync");
  PE_CHECK(skv_ctx_barrier(ctx) == 0, "barrier");
  size_t free1;
  PE_CHECK(cudaMemGetInfo(&free1, &total) == cudaSuccess, "meminfo");
  PE_CHECK(free1 + (4u << 20) >= free0, "device memory not given back: %zu -> %zu free", free0,
           free1);
  free(host);
  free(want);
  PE_CHECK(skv_finalize(ctx) == 0, "finalize");
  return 0;
}

ParameterizedTestParameters(gpu_heap, peers_read_what_peers_wrote) {
  static gh_param_t p[] = {
      {2, SKV_BACKEND_CUDA, 64 << 20},     {4, SKV_BACKEND_CUDA, 8 << 20},
      {2, SKV_BACKEND_CUDA, 4097},         {2, SKV_BACKEND_CUDA_HOST, 16 << 20},
      {4, SKV_BACKEND_CUDA_HOST, 1 << 20},
  };
  return cr_make_param_array(gh_param_t, p, sizeof p / sizeof p[0]);
}

ParameterizedTest(gh_param_t *p, gpu_heap, peers_read_what_peers_wrote) {
  SKV_TEST_REQUIRE_GPUS(1);
  skv_test_job_t job;
  int bad = skv_test_run(&job, p->npes, pe_gpu_rw, p, 150000);
  cr_assert_eq(bad, 0, "backend %d, %d PEs: %s", p->backend, p->npes, skv_test_statuses(&job));
}

static int pe_bad(int rank, int npes, void *arg) {
  skv_ctx_t *ctx;
  PE_CHECK(skv_test_init(&ctx, 20000) == 0, "init");
  skv_heap_t *heap;
  /* more than any GPU has: a clear CUDA error, and the job stays usable */
  int rc = skv_heap_create(ctx, 1ull << 40, SKV_BACKEND_CUDA, &heap);
  PE_CHECK(rc == SKV_ECUDA && strstr(skv_last_error(), "cuMemCreate"), "1 TiB: %s / %s",
           skv_err_name(rc), skv_last_error());
  /* every PE failed on its own here; one_pe_failing_alone... below has one fail alone */
  PE_CHECK(skv_heap_create(ctx, 1 << 20, SKV_BACKEND_CUDA, &heap) == 0, "create after failure");
  PE_CHECK(skv_heap_destroy(heap) == 0, "destroy");
  PE_CHECK(skv_finalize(ctx) == 0, "finalize");
  return 0;
}

Test(gpu_heap, allocation_failure_is_reported) {
  SKV_TEST_REQUIRE_GPUS(1);
  skv_test_job_t job;
  int bad = skv_test_run(&job, 2, pe_bad, NULL, 120000);
  cr_assert_eq(bad, 0, "%s", skv_test_statuses(&job));
}

/* PE 1 runs out of file descriptors, so that exporting its segment fails (before the exchange);
 * PE 0 must fail at once with PE 1's error instead of waiting for it in the exchange until the
 * timeout, and give its segment back; then both create again. */
static int pe_one_fails_alone(int rank, int npes, void *arg) {
  (void)npes, (void)arg;
  skv_ctx_t *ctx;
  PE_CHECK(skv_test_init(&ctx, 20000) == 0, "init");
  int dev = skv_ctx_get_device(ctx);
  PE_CHECK(dev >= 0, "device: %s", skv_err_name(dev));
  size_t free0, total;
  PE_CHECK(cudaMemGetInfo(&free0, &total) == cudaSuccess, "meminfo"); /* creates the context */
  PE_CHECK(skv_ctx_barrier(ctx) == 0, "barrier");
  PE_CHECK(cudaMemGetInfo(&free0, &total) == cudaSuccess, "meminfo");
  struct rlimit was;
  if (rank == 1) PE_CHECK(skv_test_limit_fds(0, &was) == 0, "limit the descriptors");
  skv_heap_t *heap = (skv_heap_t *)1;
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  int rc = skv_heap_create(ctx, 256ull << 20, SKV_BACKEND_CUDA, &heap);
  clock_gettime(CLOCK_MONOTONIC, &t1);
  if (rank == 1) PE_CHECK(setrlimit(RLIMIT_NOFILE, &was) == 0, "restore the limit");
  const double took = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) * 1e-9;
  int rcs[2];
  PE_CHECK(skv_ctx_allgather(ctx, &rc, rcs, sizeof rc) == 0, "results");
  PE_CHECK(rcs[1] < 0, "PE 1 created a cuda heap without a free file descriptor");
  PE_CHECK(rc == rcs[1] && heap == NULL, "create: %s, PE 1 got %s", skv_err_name(rc),
           skv_err_name(rcs[1]));
  PE_CHECK(took < 5.0, "failing took %.1f s (the timeout is 20 s)", took);
  if (rank == 0)
    PE_CHECK(strstr(skv_last_error(), "rank 1 failed"), "the error names rank 1: %s",
             skv_last_error());
  PE_CHECK(skv_ctx_barrier(ctx) == 0, "barrier");
  size_t free1;
  PE_CHECK(cudaMemGetInfo(&free1, &total) == cudaSuccess, "meminfo");
  PE_CHECK(free1 + (4u << 20) >= free0, "device memory not given back: %zu -> %zu MiB free",
           free0 >> 20, free1 >> 20);
  PE_CHECK(skv_heap_create(ctx, 256ull << 20, SKV_BACKEND_CUDA, &heap) == 0,
           "create after the failure");
  PE_CHECK(skv_heap_destroy(heap) == 0, "destroy");
  PE_CHECK(skv_finalize(ctx) == 0, "finalize");
  return 0;
}

Test(gpu_heap, one_pe_failing_alone_fails_every_pe_at_once) {
  SKV_TEST_REQUIRE_GPUS(1);
  skv_test_job_t job;
  int bad = skv_test_run(&job, 2, pe_one_fails_alone, NULL, 120000);
  cr_assert_eq(bad, 0, "%s", skv_test_statuses(&job));
}

/* Free bytes of device `dev` (the current device is kept). */
static size_t dev_free(int dev) {
  int cur = -1;
  size_t fr = 0, total = 0;
  if (cudaGetDevice(&cur) != cudaSuccess || cudaSetDevice(dev) != cudaSuccess ||
      cudaMemGetInfo(&fr, &total) != cudaSuccess)
    fr = 0;
  if (cur >= 0) cudaSetDevice(cur);
  return fr;
}

#define DEAD_SEG (2ull << 30)

/* PE 1 dies holding a cuda heap of 2 GiB segments. PE 0 still reads its segment (its mapping
 * keeps the memory), destroy reports the dead peer, and then both devices have the memory back:
 * PE 0's own segment and PE 1's, which only PE 0's mapping held. */
static int pe_dies_with_cuda_heap(int rank, int npes, void *arg) {
  (void)npes, (void)arg;
  skv_ctx_t *ctx;
  PE_CHECK(skv_test_init(&ctx, 5000) == 0, "init");
  int devs[2], dev = skv_ctx_get_device(ctx);
  PE_CHECK(skv_ctx_allgather(ctx, &dev, devs, sizeof dev) == 0, "devices");
  int32_t pid = (int32_t)getpid(), pids[2];
  PE_CHECK(skv_ctx_allgather(ctx, &pid, pids, sizeof pid) == 0, "pids");
  PE_CHECK(devs[0] != devs[1], "both PEs on device %d: this test needs one GPU per PE", dev);
  const int peer_dev = devs[1 - rank];
  /* contexts on both devices first, then the free memory when every PE has its contexts */
  PE_CHECK(dev_free(dev) > 0 && dev_free(peer_dev) > 0, "meminfo");
  PE_CHECK(skv_ctx_barrier(ctx) == 0, "barrier");
  const size_t own0 = dev_free(dev), peer0 = dev_free(peer_dev);
  PE_CHECK(skv_ctx_barrier(ctx) == 0, "barrier");
  skv_heap_t *heap;
  PE_CHECK(skv_heap_create(ctx, DEAD_SEG, SKV_BACKEND_CUDA, &heap) == 0, "create: %s",
           skv_last_error());
  skv_heap_info_t in;
  skv_heap_get_info(heap, &in);
  PE_CHECK(cudaMemset(skv_heap_get_ptr(heap, rank, in.data_offset), 0x40 + rank, DEAD_SEG) ==
               cudaSuccess,
           "fill");
  PE_CHECK(cudaDeviceSynchronize() == cudaSuccess, "sync");
  PE_CHECK(skv_ctx_barrier(ctx) == 0, "barrier");
  if (rank == 1) raise(SIGKILL);
  /* wait until PE 1's process is gone (the test harness reaps it), up to 20 s */
  for (int i = 0; i < 2000 && kill((pid_t)pids[1], 0) == 0; i++) usleep(10000);
  PE_CHECK(kill((pid_t)pids[1], 0) != 0 && errno == ESRCH, "PE 1 (pid %d) is still there", pids[1]);
  /* the dead PE's segment is still mapped here and holds what it wrote */
  uint8_t head[4096], tail[4096];
  const uint8_t *dead = skv_heap_get_ptr(heap, 1, in.data_offset);
  PE_CHECK(cudaMemcpy(head, dead, sizeof head, cudaMemcpyDefault) == cudaSuccess &&
               cudaMemcpy(tail, dead + DEAD_SEG - sizeof tail, sizeof tail, cudaMemcpyDefault) ==
                   cudaSuccess,
           "read the dead PE's segment: %s", cudaGetErrorString(cudaGetLastError()));
  for (size_t i = 0; i < sizeof head; i++)
    PE_CHECK(head[i] == 0x41 && tail[i] == 0x41, "the dead PE's segment holds %#x / %#x", head[i],
             tail[i]);
  /* which keeps its memory in use (the check below could see a leak) */
  PE_CHECK(dev_free(peer_dev) + (1ull << 30) < peer0,
           "the dead PE's segment is not counted on device %d", peer_dev);
  int rc = skv_heap_destroy(heap);
  PE_CHECK(rc == SKV_EPEERDEAD || rc == SKV_ETIMEDOUT, "destroy with a dead peer: %s",
           skv_err_name(rc));
  /* the dead process's own context may take a moment to go: wait up to 20 s */
  size_t own1 = 0, peer1 = 0;
  for (int i = 0; i < 200; i++) {
    own1 = dev_free(dev);
    peer1 = dev_free(peer_dev);
    if (own1 + (64u << 20) >= own0 && peer1 + (64u << 20) >= peer0) break;
    usleep(100000);
  }
  PE_CHECK(own1 + (64u << 20) >= own0, "device %d: %zu MiB free before the heap, %zu after destroy",
           dev, own0 >> 20, own1 >> 20);
  PE_CHECK(peer1 + (64u << 20) >= peer0,
           "device %d (the dead PE's): %zu MiB free before, %zu after destroy", peer_dev,
           peer0 >> 20, peer1 >> 20);
  skv_finalize(ctx);
  return 0;
}

Test(gpu_heap, a_dead_pe_s_segment_is_released_with_the_survivor_s_destroy) {
  SKV_TEST_REQUIRE_GPUS(2);
  skv_test_job_t job;
  skv_test_spawn(&job, 2, pe_dies_with_cuda_heap, NULL);
  skv_test_wait(&job, 120000);
  cr_assert_eq(job.status[1], 128 + SIGKILL, "%s", skv_test_statuses(&job));
  cr_assert_eq(job.status[0], 0, "survivor: %s", skv_test_statuses(&job));
}
