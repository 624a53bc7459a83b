/* What a UCX build can do with GPU memory between two processes of one host, with no symkv:
 * an owner process exports host memory, cudaMalloc memory and VMM memory (cuMemCreate with
 * POSIX fd handles, as symkv's CUDA heap is made); a reader gets 4 MiB blocks of each into host
 * memory and into cudaMalloc memory, checks every byte and times 16 x 4 MiB.
 *
 *   cc -O2 ucx_cuda_probe.c -I$UCX/include -L$UCX/lib -lucp -lucs \
 *      -I/usr/local/cuda/include -L/usr/local/cuda/lib64 -lcudart -lcuda -o ucx_cuda_probe
 *   UCX_TLS=tcp,cuda_copy,cuda_ipc ./ucx_cuda_probe
 *
 * One line per (source, destination): ok and GB/s, or the UCX status that refused it. */
#define _GNU_SOURCE
#include <cuda.h>
#include <cuda_runtime.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#define BYTES (64u << 20)
#define BLOCK (4u << 20)
#define NSRC  3

static const char *src_name[NSRC] = {"host", "cudaMalloc", "vmm"};

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

#define DIE(...)                  \
  do {                            \
    fprintf(stderr, __VA_ARGS__); \
    fprintf(stderr, "\n");        \
    exit(2);                      \
  } while (0)
#define CU(x)                                                         \
  do {                                                                \
    cudaError_t e_ = (x);                                             \
    if (e_ != cudaSuccess) DIE("%s: %s", #x, cudaGetErrorString(e_)); \
  } while (0)
#define CUD(x)                                                   \
  do {                                                           \
    CUresult r_ = (x);                                           \
    if (r_ != CUDA_SUCCESS) DIE("%s: CUresult %d", #x, (int)r_); \
  } while (0)

static void xwrite(int fd, const void *p, size_t n) {
  if (write(fd, &n, sizeof(n)) != (ssize_t)sizeof(n) || write(fd, p, n) != (ssize_t)n) DIE("write");
}
static void *xread(int fd, size_t *n) {
  if (read(fd, n, sizeof(*n)) != (ssize_t)sizeof(*n)) DIE("read");
  char *p = malloc(*n);
  size_t got = 0;
  while (got < *n) {
    ssize_t r = read(fd, p + got, *n - got);
    if (r <= 0) DIE("read");
    got += (size_t)r;
  }
  return p;
}

static ucp_context_h init_ctx(void) {
  ucp_params_t pp = {.field_mask = UCP_PARAM_FIELD_FEATURES, .features = UCP_FEATURE_RMA};
  ucp_context_h ctx;
  ucs_status_t st = ucp_init(&pp, NULL, &ctx);
  if (st != UCS_OK) DIE("ucp_init: %s", ucs_status_string(st));
  ucp_context_attr_t a = {.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES};
  ucp_context_query(ctx, &a);
  fprintf(stderr, "[%d] UCX %s memory types 0x%llx (cuda %s)\n", getpid(), ucp_get_version_string(),
          (unsigned long long)a.memory_types,
          (a.memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) ? "yes" : "no");
  return ctx;
}

static ucp_mem_h map(ucp_context_h ctx, void *p, size_t n, ucs_memory_type_t mt) {
  ucp_mem_map_params_t mp = {.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS |
                                           UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                                           UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE,
                             .address = p,
                             .length = n,
                             .memory_type = mt};
  ucp_mem_h mh = NULL;
  ucs_status_t st = ucp_mem_map(ctx, &mp, &mh);
  if (st != UCS_OK) {
    fprintf(stderr, "ucp_mem_map(%s): %s\n", ucs_memory_type_names[mt], ucs_status_string(st));
    return NULL;
  }
  return mh;
}

static void *vmm_alloc(size_t n) {
  CUmemAllocationProp prop = {0};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  size_t gran = 0;
  CUD(cuMemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  n = (n + gran - 1) / gran * gran;
  CUmemGenericAllocationHandle h;
  CUD(cuMemCreate(&h, n, &prop, 0));
  CUdeviceptr va;
  CUD(cuMemAddressReserve(&va, n, 0, 0, 0));
  CUD(cuMemMap(va, n, 0, h, 0));
  CUmemAccessDesc ad = {.location = prop.location, .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
  CUD(cuMemSetAccess(va, n, &ad, 1));
  return (void *)(uintptr_t)va;
}

static unsigned char pattern(int src, size_t i) {
  return (unsigned char)(i * 131u + src * 17u + 7u);
}

static void owner(int sock) {
  CU(cudaSetDevice(0));
  CU(cudaFree(0));
  unsigned char *h = malloc(BYTES);
  for (size_t i = 0; i < BYTES; i++) h[i] = pattern(0, i);
  void *buf[NSRC];
  buf[0] = h;
  CU(cudaMalloc(&buf[1], BYTES));
  buf[2] = vmm_alloc(BYTES);
  for (int s = 1; s < NSRC; s++) {
    for (size_t i = 0; i < BYTES; i++) h[i] = pattern(s, i);
    CU(cudaMemcpy(buf[s], h, BYTES, cudaMemcpyHostToDevice));
  }
  for (size_t i = 0; i < BYTES; i++) h[i] = pattern(0, i);
  ucp_context_h ctx = init_ctx();
  ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
                            .thread_mode = UCS_THREAD_MODE_SINGLE};
  ucp_worker_h w;
  if (ucp_worker_create(ctx, &wp, &w) != UCS_OK) DIE("worker");
  ucp_address_t *addr;
  size_t alen;
  ucp_worker_get_address(w, &addr, &alen);
  xwrite(sock, addr, alen);
  for (int s = 0; s < NSRC; s++) {
    ucp_mem_h mh = map(ctx, buf[s], BYTES, s ? UCS_MEMORY_TYPE_CUDA : UCS_MEMORY_TYPE_HOST);
    void *rk = NULL;
    size_t rl = 0;
    ucs_status_t st = mh ? ucp_rkey_pack(ctx, mh, &rk, &rl) : UCS_ERR_UNSUPPORTED;
    if (st != UCS_OK) fprintf(stderr, "rkey_pack(%s): %s\n", src_name[s], ucs_status_string(st));
    uint64_t a = (uintptr_t)buf[s];
    xwrite(sock, &a, sizeof(a));
    xwrite(sock, rk ? rk : "", rk ? rl : 0);
  }
  /* serve (TCP gets need the target's progress) until the reader closes the socket */
  for (;;) {
    ucp_worker_progress(w);
    struct pollfd p = {.fd = sock, .events = POLLIN};
    if (poll(&p, 1, 0) > 0) break;
  }
}

static ucs_status_t wait_req(ucp_worker_h w, void *req) {
  if (req == NULL) return UCS_OK;
  if (UCS_PTR_IS_ERR(req)) return UCS_PTR_STATUS(req);
  double t0 = now_s();
  ucs_status_t st;
  while ((st = ucp_request_check_status(req)) == UCS_INPROGRESS) {
    ucp_worker_progress(w);
    if (now_s() - t0 > 10) {
      ucp_request_cancel(w, req);
      return UCS_ERR_TIMED_OUT;
    }
  }
  ucp_request_free(req);
  return st;
}

static void reader(int sock) {
  CU(cudaSetDevice(0));
  CU(cudaFree(0));
  ucp_context_h ctx = init_ctx();
  ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
                            .thread_mode = UCS_THREAD_MODE_SINGLE};
  ucp_worker_h w;
  if (ucp_worker_create(ctx, &wp, &w) != UCS_OK) DIE("worker");
  size_t alen;
  void *addr = xread(sock, &alen);
  ucp_ep_params_t ep = {.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS, .address = addr};
  ucp_ep_h e;
  if (ucp_ep_create(w, &ep, &e) != UCS_OK) DIE("ep");
  uint64_t raddr[NSRC];
  ucp_rkey_h rkey[NSRC];
  for (int s = 0; s < NSRC; s++) {
    size_t n, rl;
    uint64_t *a = xread(sock, &n);
    raddr[s] = *a;
    void *rk = xread(sock, &rl);
    rkey[s] = NULL;
    ucs_status_t st = rl ? ucp_ep_rkey_unpack(e, rk, &rkey[s]) : UCS_ERR_UNSUPPORTED;
    if (st != UCS_OK) {
      printf("src=%-10s rkey_unpack: %s\n", src_name[s], ucs_status_string(st));
      rkey[s] = NULL;
    }
  }
  unsigned char *hd = malloc(BYTES), *check = malloc(BYTES);
  void *dd;
  CU(cudaMalloc(&dd, BYTES));
  ucp_mem_h mh[2] = {map(ctx, hd, BYTES, UCS_MEMORY_TYPE_HOST),
                     map(ctx, dd, BYTES, UCS_MEMORY_TYPE_CUDA)};
  const char *dst_name[2] = {"host", "cuda"};
  void *dst[2] = {hd, dd};
  for (int s = 0; s < NSRC; s++)
    for (int d = 0; d < 2; d++) {
      if (!rkey[s]) continue;
      memset(hd, 0xEE, BYTES);
      CU(cudaMemset(dd, 0xEE, BYTES));
      ucp_request_param_t rp = {.op_attr_mask = mh[d] ? UCP_OP_ATTR_FIELD_MEMH : 0, .memh = mh[d]};
      ucs_status_t st = UCS_OK;
      double best = 1e9;
      for (int round = 0; round < 4 && st == UCS_OK; round++) {
        double t0 = now_s();
        void *reqs[BYTES / BLOCK];
        int k = 0;
        for (unsigned b = 0; b < BYTES / BLOCK; b++) {
          void *r =
              ucp_get_nbx(e, (char *)dst[d] + b * BLOCK, BLOCK, raddr[s] + b * BLOCK, rkey[s], &rp);
          if (UCS_PTR_IS_ERR(r)) {
            st = UCS_PTR_STATUS(r);
            break;
          }
          if (r) reqs[k++] = r;
        }
        for (int i = 0; i < k; i++) {
          ucs_status_t s2 = wait_req(w, reqs[i]);
          if (st == UCS_OK) st = s2;
        }
        double t = now_s() - t0;
        if (t < best) best = t;
      }
      size_t wrong = 0;
      if (st == UCS_OK) {
        if (d)
          CU(cudaMemcpy(check, dd, BYTES, cudaMemcpyDeviceToHost));
        else
          memcpy(check, hd, BYTES);
        for (size_t i = 0; i < BYTES; i++) wrong += check[i] != pattern(s, i);
      }
      printf("src=%-10s dst=%-4s %s wrong=%zu %.2f GB/s (64 MiB in 4 MiB gets, best of 4)\n",
             src_name[s], dst_name[d], st == UCS_OK ? "ok" : ucs_status_string(st), wrong,
             st == UCS_OK ? BYTES / best / 1e9 : 0.0);
      fflush(stdout);
    }
}

int main(void) {
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv)) DIE("socketpair");
  pid_t pid = fork();
  if (pid == 0) {
    close(sv[1]);
    owner(sv[0]);
    _exit(0);
  }
  close(sv[0]);
  reader(sv[1]);
  close(sv[1]);
  int status;
  waitpid(pid, &status, 0);
  return 0;
}
