/* GPU tests of the elastic domain (skipped without a GPU): pages in GPU memory, an owner
 * publishing from its GPU cache and readers in other processes (sharing the GPU) fetching into
 * GPU and host memory, every byte checked against its key with poisoned outputs; a reader with
 * no usable GPU looks pages up and is told why it cannot fetch them. */
#define _GNU_SOURCE
#include "skv_test.h"

#include <criterion/criterion.h>
#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

TestSuite(gpu_domain, .timeout = 300);

#define NPAGES 24

#define CU_OK(call) \
  PE_CHECK((call) == cudaSuccess, "%s: %s", #call, cudaGetErrorString(cudaGetLastError()))

static skv_geometry_t geom(void) {
  skv_geometry_t g = SKV_GEOMETRY_INIT;
  g.num_layers = 4, g.num_kv_heads = 8, g.head_dim = 128, g.elem_bytes = 2, g.page_tokens = 16;
  return g; /* 256 KiB pages */
}

static void content(skv_key_t k, uint8_t *p, uint64_t n) {
  uint64_t s = k.hi ^ (k.lo * 0x9e3779b97f4a7c15ull);
  for (uint64_t i = 0; i < n; i += 8) {
    uint64_t v = skv_test_rand(&s);
    memcpy(p + i, &v, 8);
  }
}

typedef struct shared {
  char name[64];
  uint64_t seed;
} shared_t;

static int attach(const shared_t *sh, int role, skv_kv_t **kv) {
  skv_geometry_t g = geom();
  skv_attach_opts_t o = SKV_ATTACH_OPTS_INIT;
  o.role = role;
  o.backend = SKV_BACKEND_CUDA;
  o.pages_per_pe = 64;
  o.max_slots = 8;
  o.timeout_ms = 30000;
  return skv_kv_attach(sh->name, &g, &o, kv);
}

static void keys_of(const shared_t *sh, skv_namespace_t *ns, skv_key_t *keys) {
  for (uint64_t i = 0; i < NPAGES; i++) {
    uint64_t v = sh->seed + i;
    (void)skv_namespace_hash_bytes(ns, &v, sizeof v, &keys[i]);
  }
}

/* Rank 0 owns and publishes from GPU memory; ranks 1 and 2 read into GPU and host memory; rank
 * 3 hides the GPU (no usable device) and only looks up. The owner stays until they are done. */
static int pe_main(int rank, int npes, void *arg) {
  const shared_t *sh = arg;
  if (rank == 3) setenv("CUDA_VISIBLE_DEVICES", "", 1);
  skv_geometry_t g = geom();
  uint64_t pb;
  PE_CHECK(skv_geometry_get_page_bytes(&g, &pb) == 0, "page bytes");
  skv_namespace_t *ns;
  PE_CHECK(skv_namespace_create("m", &g, NULL, 0, "gpu", 3, &ns) == 0, "ns");
  skv_key_t keys[NPAGES];
  keys_of(sh, ns, keys);
  uint8_t *host = malloc(pb * NPAGES), *want = malloc(pb * NPAGES);
  for (int i = 0; i < NPAGES; i++) content(keys[i], want + (uint64_t)i * pb, pb);
  uint64_t bids[NPAGES];
  for (int i = 0; i < NPAGES; i++) bids[i] = (uint64_t)(NPAGES - 1 - i); /* scattered */
  skv_kv_t *kv;
  int rc = attach(sh, rank == 0 ? SKV_ROLE_OWNER : SKV_ROLE_READER, &kv);
  PE_CHECK(rc == 0, "attach: %s", skv_err_name(rc));
  void *dev = NULL;
  skv_layout_t *dlay = NULL, *hlay = NULL;
  if (rank != 3) {
    CU_OK(cudaMalloc(&dev, pb * NPAGES));
    PE_CHECK(skv_layout_create_preset(&g, SKV_LAYOUT_CONTIGUOUS, 16, NPAGES, &dev, 0, &dlay) == 0,
             "device layout");
  }
  PE_CHECK(skv_layout_create_preset(&g, SKV_LAYOUT_CONTIGUOUS, 16, NPAGES, (void **)&host, -1,
                                    &hlay) == 0,
           "host layout");
  if (rank == 0) {
    for (int i = 0; i < NPAGES; i++) memcpy(host + bids[i] * pb, want + (uint64_t)i * pb, pb);
    CU_OK(cudaMemcpy(dev, host, pb * NPAGES, cudaMemcpyHostToDevice));
    CU_OK(cudaDeviceSynchronize()); /* from pageable memory the DMA may still be under way */
    size_t ins = 0;
    PE_CHECK(skv_kv_publish(kv, ns, keys, NPAGES, dlay, bids, NULL, &ins) == 0, "publish");
    PE_CHECK(skv_kv_sync(kv) == 0, "sync");
    /* stay while the readers read: a file in the domain's place says they are done */
    char done[128];
    snprintf(done, sizeof done, "/tmp/%s.done", sh->name);
    for (int t = 0; t < 20000 && access(done, F_OK) != 0; t++) usleep(1000);
  } else {
    skv_page_ref_t refs[NPAGES];
    size_t nhit = 0;
    for (int t = 0; t < 5000 && nhit < NPAGES; t++) {
      PE_CHECK(skv_kv_lookup(kv, ns, keys, NPAGES, 0, refs, &nhit) == 0, "lookup");
      if (nhit < NPAGES) usleep(1000);
    }
    PE_CHECK(nhit == NPAGES, "%zu hits", nhit);
    if (rank == 3) { /* no GPU: the pages are found, fetching them says why not */
      rc = skv_kv_fetch(kv, refs, NPAGES, hlay, bids, 0, NULL);
      PE_CHECK(rc == SKV_ENOTSUP && strstr(skv_last_error(), "no usable GPU"), "GPU-less fetch: %s",
               skv_last_error());
    } else {
      memset(host, 0xa5, pb * NPAGES); /* poisoned */
      if (rank == 1) {
        CU_OK(cudaMemset(dev, 0x5a, pb * NPAGES));
        CU_OK(cudaDeviceSynchronize()); /* a memset is asynchronous: done before the fetch */
        PE_CHECK(skv_kv_fetch(kv, refs, NPAGES, dlay, bids, 0, NULL) == 0, "GPU fetch");
        CU_OK(cudaDeviceSynchronize());
        PE_CHECK(skv_kv_sync(kv) == 0, "sync");
        CU_OK(cudaMemcpy(host, dev, pb * NPAGES, cudaMemcpyDeviceToHost));
      } else {
        PE_CHECK(skv_kv_fetch(kv, refs, NPAGES, hlay, bids, 0, NULL) == 0, "staged fetch");
      }
      for (int i = 0; i < NPAGES; i++)
        PE_CHECK(memcmp(host + bids[i] * pb, want + (uint64_t)i * pb, pb) == 0,
                 "page %d: wrong bytes", i);
    }
    char done[128];
    snprintf(done, sizeof done, "/tmp/%s.r%d", sh->name, rank);
    FILE *f = fopen(done, "w");
    if (f) fclose(f);
  }
  PE_CHECK(skv_kv_detach(kv) == 0, "detach");
  if (dev) cudaFree(dev);
  skv_layout_destroy(dlay);
  skv_layout_destroy(hlay);
  skv_namespace_destroy(ns);
  free(host);
  free(want);
  return 0;
}

Test(gpu_domain, owner_on_the_gpu_readers_in_other_processes_every_byte_checked) {
  SKV_TEST_REQUIRE_GPUS(1);
  shared_t sh;
  snprintf(sh.name, sizeof sh.name, "tg%d", (int)getpid());
  sh.seed = skv_test_seed();
  skv_test_job_t job;
  cr_assert_eq(skv_test_spawn(&job, 4, pe_main, &sh), 0);
  /* the owner leaves once the three readers said they are done */
  char path[128];
  for (int t = 0; t < 60000; t++) {
    int n = 0;
    for (int r = 1; r < 4; r++) {
      snprintf(path, sizeof path, "/tmp/%s.r%d", sh.name, r);
      n += access(path, F_OK) == 0;
    }
    if (n == 3) break;
    usleep(1000);
  }
  snprintf(path, sizeof path, "/tmp/%s.done", sh.name);
  FILE *f = fopen(path, "w");
  if (f) fclose(f);
  int bad = skv_test_wait(&job, 120000);
  unlink(path);
  for (int r = 1; r < 4; r++) {
    snprintf(path, sizeof path, "/tmp/%s.r%d", sh.name, r);
    unlink(path);
  }
  cr_assert_eq(bad, 0, "%s", skv_test_statuses(&job));
  snprintf(path, sizeof path, "/dev/shm/symkv-%s", sh.name);
  cr_assert(access(path, F_OK) != 0, "the domain stayed in /dev/shm");
}
