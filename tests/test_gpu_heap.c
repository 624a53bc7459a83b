/* GPU tests of the CUDA heap backends (skipped without a GPU): PEs write into peers' device
 * segments through symmetric addresses and read back what peers wrote; cuda_host segments are
 * reached by kernels and by the CPU at the same address; destroy gives the memory back. */
#define _GNU_SOURCE
#include "skv_test.h"

#include "heap/heap.h"

#include <criterion/criterion.h>
#include <criterion/parameterized.h>
#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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
  int dev = skv_ctx_device(ctx);
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
  uint8_t *mine = skv_heap_ptr(heap, rank, in.data_offset);
  /* fresh segments are zero */
  uint8_t *host = malloc(p->bytes), *want = malloc(p->bytes);
  PE_CHECK(cudaMemcpy(host, mine, p->bytes, cudaMemcpyDefault) == cudaSuccess, "read own");
  for (uint64_t i = 0; i < p->bytes; i++) PE_CHECK(host[i] == 0, "byte %llu of a fresh segment is %u", (unsigned long long)i, host[i]);
  uint64_t seed = skv_test_seed(), seeds[SKV_TEST_MAX_PES];
  PE_CHECK(skv_ctx_allgather(ctx, &seed, seeds, sizeof seed) == 0, "seeds");
  int to = (rank + 1) % npes, from = (rank + npes - 1) % npes;
  uint64_t s = seed;
  skv_test_fill_random(host, p->bytes, &s);
  /* write through the symmetric address of the next PE's segment */
  PE_CHECK(cudaMemcpy(skv_heap_ptr(heap, to, in.data_offset), host, p->bytes, cudaMemcpyDefault) == cudaSuccess,
           "write to peer %d", to);
  PE_CHECK(cudaDeviceSynchronize() == cudaSuccess, "sync");
  PE_CHECK(skv_ctx_barrier(ctx) == 0, "barrier");
  memset(host, 0xA5, p->bytes);
  PE_CHECK(cudaMemcpy(host, mine, p->bytes, cudaMemcpyDefault) == cudaSuccess, "read own");
  s = seeds[from];
  skv_test_fill_random(want, p->bytes, &s);
  PE_CHECK(memcmp(host, want, p->bytes) == 0, "my segment does not hold what PE %d wrote", from);
  if (p->backend == SKV_BACKEND_CUDA_HOST)
    PE_CHECK(memcmp(mine, want, p->bytes) == 0, "the CPU sees other bytes than the GPU at the same address");
  PE_CHECK(skv_ctx_barrier(ctx) == 0, "barrier");
  PE_CHECK(skv_heap_destroy(heap) == 0, "destroy");
  PE_CHECK(cudaDeviceSynchronize() == cudaSuccess, "sync");
  PE_CHECK(skv_ctx_barrier(ctx) == 0, "barrier");
  size_t free1;
  PE_CHECK(cudaMemGetInfo(&free1, &total) == cudaSuccess, "meminfo");
  PE_CHECK(free1 + (4u << 20) >= free0, "device memory not given back: %zu -> %zu free", free0, free1);
  free(host);
  free(want);
  PE_CHECK(skv_finalize(ctx) == 0, "finalize");
  return 0;
}

ParameterizedTestParameters(gpu_heap, peers_read_what_peers_wrote) {
  static gh_param_t p[] = {
      {2, SKV_BACKEND_CUDA, 64 << 20}, {4, SKV_BACKEND_CUDA, 8 << 20}, {2, SKV_BACKEND_CUDA, 4097},
      {2, SKV_BACKEND_CUDA_HOST, 16 << 20}, {4, SKV_BACKEND_CUDA_HOST, 1 << 20},
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
  PE_CHECK(rc == SKV_ECUDA && strstr(skv_last_error(), "cuMemCreate"), "1 TiB: %s / %s", skv_err_name(rc),
           skv_last_error());
  /* the failed create left the PEs out of step only if one PE failed alone; here all did */
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
