/* symkv-bench cluster: pages across nodes. Remote fetch bandwidth (UCX gets through
 * skv_cluster_fetch) against ucx_perftest's ucp_get of the same sizes over the same transport
 * in the same run, and lookup latency with the Redis directory (p50, p99). The "nodes" are
 * domains in separate processes of this host; redis-server is started and stopped by the run. */
#define _GNU_SOURCE
#include "bench.h"
#include "workload.h"

#include <errno.h>
#include <inttypes.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#ifdef SKV_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

#define MAX_SIZES  16
#define MAX_ROUNDS 15

static void sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

static pid_t spawn(char *const argv[], bool quiet) {
  fflush(stdout), fflush(stderr);
  pid_t pid = fork();
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (quiet) {
      (void)!freopen("/dev/null", "w", stdout);
      (void)!freopen("/dev/null", "w", stderr);
    }
    execvp(argv[0], argv);
    _exit(127);
  }
  return pid;
}

/* Pages of `bytes`: 2 heads x 32 dims x 2 bytes x 16 tokens x K and V = 4 KiB per layer. */
static skv_geometry_t geom_of(uint64_t bytes) {
  skv_geometry_t g = SKV_GEOMETRY_INIT;
  g.num_layers = (uint32_t)(bytes / 4096), g.num_kv_heads = 2, g.head_dim = 32;
  g.elem_bytes = 2, g.page_tokens = 16;
  return g;
}

static uint8_t pat(uint32_t i, uint64_t j) {
  return (uint8_t)(i * 131u + (uint32_t)(j * 7u) + (uint32_t)(j >> 9));
}

typedef struct node {
  skv_geometry_t g;
  uint64_t pb;
  uint32_t npages;
  uint8_t *mem;
  uint8_t *dev; /* --gpu: the engine's blocks in GPU memory (mem then receives a copy) */
  skv_layout_t *lay;
  skv_namespace_t *ns;
  skv_kv_t *kv;
  skv_cluster_t *cl;
  skv_key_t *keys;
} node_t;

/* Where a node keeps things: its blocks and pages in GPU memory (a CUDA domain: --gpu for the
 * fetching node, --gpu-pages for the serving one, which then exports GPU memory), and whether
 * UCX reads pages for GPU blocks into GPU memory itself (--gpu-direct). */
enum { NODE_GPU = 1, NODE_EXPORT = 2, NODE_DIRECT = 4 };

/* A node; NODE_GPU: its blocks in GPU memory and its pages too (a CUDA domain, joined with
 * SKV_CLUSTER_NO_EXPORT unless NODE_EXPORT). */
static int node_open(node_t *n, const char *domain, const char *name, const char *url,
                     const char *cluster, uint64_t page_bytes, uint32_t npages, int role,
                     int mode) {
  const bool gpu = mode & NODE_GPU;
  memset(n, 0, sizeof *n);
  n->g = geom_of(page_bytes);
  n->npages = npages;
  SKV_CHECK(skv_geometry_get_page_bytes(&n->g, &n->pb));
  n->mem = aligned_alloc(4096, n->pb * npages);
  n->keys = calloc(npages, sizeof(*n->keys));
  if (!n->mem || !n->keys) return SKV_ENOMEM;
  void *base[1] = {n->mem};
  if (gpu) {
#ifdef SKV_WITH_CUDA
    if (cudaMalloc((void **)&n->dev, n->pb * npages) != cudaSuccess)
      return SKV_FAIL(SKV_ECUDA, SKV_SUBSYS_BENCH, "cluster --gpu: cudaMalloc failed");
    base[0] = n->dev;
#else
    return SKV_FAIL(SKV_ENOTSUP, SKV_SUBSYS_BENCH, "cluster --gpu: built without CUDA");
#endif
  }
  SKV_CHECK(skv_layout_create_preset(&n->g, SKV_LAYOUT_CONTIGUOUS, 16, npages, base, gpu ? 0 : -1,
                                     &n->lay));
  SKV_CHECK(skv_namespace_create("bench", &n->g, NULL, 0, NULL, 0, &n->ns));
  for (uint32_t i = 0; i < npages; i++)
    SKV_CHECK(skv_namespace_hash_bytes(n->ns, &i, sizeof i, &n->keys[i]));
  skv_attach_opts_t ao = SKV_ATTACH_OPTS_INIT;
  ao.role = gpu ? SKV_ROLE_OWNER : role;
  ao.pages_per_pe = npages;
  ao.max_slots = 2;
  if (gpu) ao.backend = SKV_BACKEND_CUDA;
  SKV_CHECK(skv_kv_attach(domain, &n->g, &ao, &n->kv));
  skv_cluster_opts_t co = SKV_CLUSTER_OPTS_INIT;
  co.redis_url = url;
  co.node = name;
  co.cluster = cluster;
  if (gpu && !(mode & NODE_EXPORT)) co.flags |= SKV_CLUSTER_NO_EXPORT;
  if (mode & NODE_DIRECT) co.flags |= SKV_CLUSTER_GPU_DIRECT;
  return skv_cluster_join(n->kv, &co, &n->cl);
}

static void node_close(node_t *n) {
  if (n->cl) skv_cluster_leave(n->cl);
  if (n->kv) skv_kv_detach(n->kv);
  if (n->lay) skv_layout_destroy(n->lay);
  if (n->ns) skv_namespace_destroy(n->ns);
#ifdef SKV_WITH_CUDA
  if (n->dev) cudaFree(n->dev);
#endif
  free(n->mem);
  free(n->keys);
}

/* The serving node: publish npages pages, say so on `ready`, stay until `quit` closes. */
static _Noreturn void server_main(const char *domain, const char *url, const char *cluster,
                                  uint64_t page_bytes, uint32_t npages, int mode, int ready,
                                  int quit) {
  node_t n;
  char name[32]; /* one per size: a node's record is under its name */
  snprintf(name, sizeof name, "server-%" PRIu64, page_bytes);
  int rc = node_open(&n, domain, name, url, cluster, page_bytes, npages, SKV_ROLE_OWNER, mode);
  uint64_t *ids = malloc(npages * sizeof(*ids));
  if (!rc && !ids) rc = SKV_ENOMEM;
  if (!rc) {
    for (uint32_t i = 0; i < npages; i++) {
      ids[i] = i;
      for (uint64_t j = 0; j < n.pb; j++) n.mem[i * n.pb + j] = pat(i, j);
    }
#ifdef SKV_WITH_CUDA
    if (n.dev && cudaMemcpy(n.dev, n.mem, n.pb * npages, cudaMemcpyHostToDevice) != cudaSuccess)
      rc = SKV_ECUDA;
#endif
    size_t ins = 0;
    if (!rc) rc = skv_cluster_publish(n.cl, n.ns, n.keys, npages, n.lay, ids, NULL, &ins);
    if (!rc) rc = skv_cluster_flush(n.cl);
  }
  if (rc)
    fprintf(stderr, "symkv-bench cluster: server: %s: %s\n", skv_err_name(rc), skv_last_error());
  (void)!write(ready, &rc, sizeof rc);
  char c;
  while (!rc && read(quit, &c, 1) > 0) {
  }
  node_close(&n);
  free(ids);
  _exit(rc ? 1 : 0);
}

/* ucx_perftest ucp_get of `bytes`, `outstanding` operations in flight, `mem` the memory types
 * (-m local,remote: "host,host", "cuda,cuda"...): MB/s (2^20 bytes). */
static double perftest_get(uint64_t bytes, int iters, int outstanding, const char *mem, char *cmd,
                           size_t cap) {
  int port = bench_free_port();
  char ps[16], ss[32], ns[16], os[16];
  snprintf(ps, sizeof ps, "%d", port);
  snprintf(ss, sizeof ss, "%llu", (unsigned long long)bytes);
  snprintf(ns, sizeof ns, "%d", iters);
  snprintf(os, sizeof os, "%d", outstanding);
  char *srv[] = {"ucx_perftest", "-p", ps, NULL};
  pid_t s = spawn(srv, true);
  if (s < 0) return -1;
  sleep_ms(300);
  snprintf(cmd, cap, "ucx_perftest 127.0.0.1 -p %s -t ucp_get -s %s -n %s -O %s -m %s", ps, ss, ns,
           os, mem);
  char line[512];
  snprintf(line, sizeof line, "%s 2>/dev/null", cmd);
  FILE *f = popen(line, "r");
  double mbs = -1;
  while (f && fgets(line, sizeof line, f)) {
    double it, p50, avg, ovl, bwa, bwo;
    if (sscanf(line, "Final: %lf %lf %lf %lf %lf %lf", &it, &p50, &avg, &ovl, &bwa, &bwo) == 6)
      mbs = bwo;
  }
  if (f) pclose(f);
  kill(s, SIGKILL);
  waitpid(s, NULL, 0);
  return mbs;
}

/* /proc/loadavg's first three figures (the host's load moves both sides of the comparison). */
static const char *loadavg(char *buf, size_t cap) {
  FILE *f = fopen("/proc/loadavg", "r");
  double a = 0, b5 = 0, c = 0;
  if (!f || fscanf(f, "%lf %lf %lf", &a, &b5, &c) != 3)
    snprintf(buf, cap, "unknown");
  else
    snprintf(buf, cap, "%.2f %.2f %.2f", a, b5, c);
  if (f) fclose(f);
  return buf;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

/* ---- the held trace on N nodes x P PEs ------------------------------------------------------ */

/* Request i runs on PE i mod (N * P), in order (a turn in shared memory); PE q is on node q / P,
 * each node a domain of its own, each PE an owner joined to the cluster. A request looks up its
 * chain (node index, then the directory), fetches nothing, publishes what its node lacks and
 * flushes the directory, so the next request sees it. Measured: the node-wide prefix (nlocal) and
 * the cluster-wide one (nhit); exact bounds from the chains themselves (capacities unbounded). */
typedef struct turn {
  volatile uint64_t turn;
  volatile int32_t failed;
  int32_t pad;
} turn_t;

static int trace_pe(const wl_workload_t *w, int q, int npes, int per_node, uint64_t pages,
                    const char *url, const char *cluster, turn_t *t, uint32_t *node_hits,
                    uint32_t *cl_hits) {
  skv_geometry_t g = SKV_GEOMETRY_INIT;
  g.num_layers = 1, g.num_kv_heads = 1, g.head_dim = 16, g.elem_bytes = 2;
  g.page_tokens = w->page_tokens;
  char dom[64], node[64];
  snprintf(dom, sizeof dom, "bench-%d-n%d", (int)getppid(), q / per_node);
  snprintf(node, sizeof node, "n%dp%d", q / per_node, q % per_node);
  skv_namespace_t *ns;
  SKV_CHECK(skv_namespace_create("bench-cluster", &g, NULL, 0, "bench", 5, &ns));
  uint64_t lb;
  SKV_CHECK(skv_layout_get_preset_layer_bytes(&g, SKV_LAYOUT_CONTIGUOUS, g.page_tokens,
                                              w->max_pages, &lb));
  void *eng = calloc(1, lb);
  uint64_t *bids = malloc(sizeof(uint64_t) * w->max_pages);
  skv_cluster_ref_t *refs = malloc(sizeof(*refs) * w->max_pages);
  if (!eng || !bids || !refs) return SKV_ENOMEM;
  for (uint32_t i = 0; i < w->max_pages; i++) bids[i] = i;
  skv_layout_t *lay;
  SKV_CHECK(skv_layout_create_preset(&g, SKV_LAYOUT_CONTIGUOUS, g.page_tokens, w->max_pages, &eng,
                                     -1, &lay));
  skv_attach_opts_t ao = SKV_ATTACH_OPTS_INIT;
  ao.pages_per_pe = pages;
  ao.max_slots = (uint32_t)per_node;
  skv_kv_t *kv;
  SKV_CHECK(skv_kv_attach(dom, &g, &ao, &kv));
  skv_cluster_opts_t co = SKV_CLUSTER_OPTS_INIT;
  co.redis_url = url;
  co.node = node;
  co.cluster = cluster;
  co.lease_ms = 60000; /* the replay's length: no renewal traffic in the way */
  skv_cluster_t *cl;
  SKV_CHECK(skv_cluster_join(kv, &co, &cl));
  int rc = 0;
  for (uint64_t r = (uint64_t)q; r < w->nreq && !rc; r += (uint64_t)npes) {
    uint64_t deadline = skv__now_ms() + 120000;
    while (__atomic_load_n(&t->turn, __ATOMIC_ACQUIRE) != r) {
      if (t->failed || skv__now_ms() > deadline) {
        rc = t->failed ? SKV_EPEERDEAD : SKV_ETIMEDOUT;
        break;
      }
      sched_yield();
    }
    if (rc) break;
    const wl_request_t *req = &w->req[r];
    const skv_key_t *k = w->keys + req->key0;
    size_t nl = 0, nh = 0;
    rc = skv_cluster_lookup(cl, ns, k, req->npages, 0, refs, &nl, &nh);
    node_hits[r] = (uint32_t)nl;
    cl_hits[r] = (uint32_t)nh;
    if (!rc && nl < req->npages)
      rc = skv_cluster_publish(cl, ns, k + nl, req->npages - nl, lay, bids, NULL, NULL);
    if (!rc) rc = skv_cluster_flush(cl);
    if (rc) t->failed = 1;
    __atomic_store_n(&t->turn, r + 1, __ATOMIC_RELEASE);
  }
  if (rc)
    fprintf(stderr, "symkv-bench cluster: PE %d: %s: %s\n", q, skv_err_name(rc), skv_last_error());
  /* stay until every PE is done: leaving takes this PE's pages away */
  uint64_t deadline = skv__now_ms() + 120000;
  while (__atomic_load_n(&t->turn, __ATOMIC_ACQUIRE) < w->nreq && !t->failed &&
         skv__now_ms() < deadline)
    sched_yield();
  skv_cluster_leave(cl);
  skv_kv_detach(kv);
  skv_layout_destroy(lay);
  skv_namespace_destroy(ns);
  free(eng), free(bids), free(refs);
  return rc;
}

static int trace_replay(bench_t *b, const char *path, const char *url, const char *cluster) {
  const int nodes = (int)bench_opt_int(b, "--nodes", 2),
            per_node = (int)bench_opt_int(b, "--pes", 4);
  const int npes = nodes * per_node;
  wl_workload_t w;
  memset(&w, 0, sizeof w);
  char err[512];
  if (wl_trace_read(path, 16, (uint64_t)bench_opt_int(b, "--requests", 0), &w, err, sizeof err))
    return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_BENCH, "%s", err);
  skv_geometry_t g = SKV_GEOMETRY_INIT;
  g.num_layers = 1, g.num_kv_heads = 1, g.head_dim = 16, g.elem_bytes = 2;
  g.page_tokens = w.page_tokens;
  skv_namespace_t *ns;
  SKV_CHECK(skv_namespace_create("bench-cluster", &g, NULL, 0, "bench", 5, &ns));
  SKV_CHECK(wl_trace_keys(&w, ns));
  skv_namespace_destroy(ns);
  wl_workload_finish(&w);
  /* exact bounds: cluster = any earlier request, per-PE = an earlier one on the same PE, node =
   * an earlier one on the same node */
  wl_exact_t ex;
  wl_exact_prefix_hits(&w, npes, &ex);
  uint64_t node_bound = 0, total = 0;
  wl_lru_t *sets[64];
  for (int n = 0; n < nodes; n++) sets[n] = wl_lru_create(0);
  for (size_t r = 0; r < w.nreq; r++) {
    wl_lru_t *c = sets[(int)(r % (size_t)npes) / per_node];
    const skv_key_t *k = w.keys + w.req[r].key0;
    node_bound += wl_lru_lookup(c, k, w.req[r].npages);
    wl_lru_publish(c, k, w.req[r].npages);
    total += w.req[r].npages;
  }
  for (int n = 0; n < nodes; n++) wl_lru_destroy(sets[n]);
  const uint64_t pages = wl_max_pages_per_pe(&w, npes) + 16;
  size_t shm = sizeof(turn_t) + 2 * w.nreq * sizeof(uint32_t);
  char *mem = mmap(NULL, shm, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (mem == MAP_FAILED) return SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_BENCH, "out of memory");
  turn_t *t = (turn_t *)mem;
  uint32_t *node_hits = (uint32_t *)(t + 1), *cl_hits = node_hits + w.nreq;
  double t0 = bench_now();
  pid_t pids[64];
  for (int q = 0; q < npes; q++) {
    fflush(stdout), fflush(stderr);
    pids[q] = fork();
    if (pids[q] == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      _exit(trace_pe(&w, q, npes, per_node, pages, url, cluster, t, node_hits, cl_hits) ? 1 : 0);
    }
  }
  int bad = 0;
  for (int q = 0; q < npes; q++) {
    int st = 0;
    waitpid(pids[q], &st, 0);
    if (!WIFEXITED(st) || WEXITSTATUS(st)) bad++;
  }
  double secs = bench_now() - t0;
  int rc = 0;
  if (bad || t->failed) {
    rc = SKV_FAIL(SKV_EPEERDEAD, SKV_SUBSYS_BENCH, "cluster trace: %d of %d PEs failed", bad, npes);
  } else {
    uint64_t got_node = 0, got_cl = 0;
    for (size_t r = 0; r < w.nreq; r++) got_node += node_hits[r], got_cl += cl_hits[r];
    char name[128];
    snprintf(name, sizeof name, "trace %zu requests, %dx%d PEs: per-PE hit rate bound", w.nreq,
             nodes, per_node);
    bench_row(b, name, (double)ex.hit_pages[1] / (double)total, "pages", "higher", "", -1);
    snprintf(name, sizeof name, "trace: node-wide hit rate");
    bench_row(b, name, (double)got_node / (double)total, "pages", "higher",
              "exact bound (earlier requests of the node)", (double)node_bound / (double)total);
    snprintf(name, sizeof name, "trace: cluster-wide hit rate");
    bench_row(b, name, (double)got_cl / (double)total, "pages", "higher",
              "exact bound (any earlier request)", (double)ex.hit_pages[0] / (double)total);
    bench_config_str(b, "trace", path);
    bench_config_int(b, "trace_requests", (long long)w.nreq);
    bench_config_int(b, "trace_pages", (long long)total);
    bench_config_int(b, "trace_distinct_pages", (long long)w.distinct);
    bench_config_real(b, "trace_seconds", secs);
  }
  munmap(mem, shm);
  wl_workload_free(&w);
  return rc;
}

static int bench_cluster(bench_t *b) {
  uint64_t sizes[MAX_SIZES];
  int nsizes = 0;
  const char *ss = bench_opt(b, "--sizes");
  if (bench_parse_list(ss ? ss : "64K,256K,1M,4M", sizes, MAX_SIZES, &nsizes) || nsizes == 0)
    bench_usage_error(b, "--sizes: a comma list of sizes (64K,1M,...)");
  for (int i = 0; i < nsizes; i++)
    if (sizes[i] < 4096 || sizes[i] % 4096)
      bench_usage_error(b, "--sizes: %llu is not a multiple of 4 KiB",
                        (unsigned long long)sizes[i]);
  const uint64_t batch_bytes = (uint64_t)bench_opt_int(b, "--batch-bytes", 16ll << 20);
  const double seconds = bench_opt_real(b, "--seconds", 1.0);
  const int nlookups = (int)bench_opt_int(b, "--lookups", 2000);
  const int chain = (int)bench_opt_int(b, "--chain", 32);
  const int rounds = (int)bench_opt_int(b, "--rounds", 3);
  const bool gpu = bench_flag(b, "--gpu"), gpu_direct = bench_flag(b, "--gpu-direct"),
             gpu_pages = bench_flag(b, "--gpu-pages");
  if (gpu_direct && !gpu) bench_usage_error(b, "--gpu-direct: with --gpu (GPU blocks) only");
  const int cmode = (gpu ? NODE_GPU : 0) | (gpu_direct ? NODE_DIRECT : 0),
            smode = gpu_pages ? NODE_GPU | NODE_EXPORT : 0;
  char mem[32]; /* ucx_perftest's -m: local, remote */
  snprintf(mem, sizeof mem, "%s,%s", gpu_direct ? "cuda" : "host", gpu_pages ? "cuda" : "host");
  const char *tls = bench_opt(b, "--tls");
  if (tls)
    setenv("UCX_TLS", tls, 1);
  else if (!getenv("UCX_TLS"))
    setenv("UCX_TLS", "tcp", 1);
  bench_config_str(b, "ucx_tls", getenv("UCX_TLS"));
  bench_config_int(b, "batch_bytes", (long long)batch_bytes);
  bench_config_real(b, "seconds", seconds);
  bench_config_int(b, "rounds", rounds);
  bench_config_str(b, "destination",
                   !gpu         ? "host blocks"
                   : gpu_direct ? "GPU blocks (UCX reads into GPU staging, copy kernels)"
                                : "GPU blocks (pinned host staging, copy kernels)");
  bench_config_str(b, "source", gpu_pages ? "GPU pages (exported GPU memory)" : "host pages");
  bench_config_str(b, "perftest_memory", mem);
  bench_config_str(b, "host_kind", getenv("SKV_HOST_KIND") ? getenv("SKV_HOST_KIND") : "unknown");
  char la[64];
  bench_config_str(b, "loadavg_start", loadavg(la, sizeof la));

  /* redis-server, ours */
  const char *url_opt = bench_opt(b, "--redis-url");
  char url[128];
  pid_t redis = 0;
  if (url_opt) {
    snprintf(url, sizeof url, "%s", url_opt);
  } else {
    int port = bench_free_port();
    char ps[16];
    snprintf(ps, sizeof ps, "%d", port);
    char *argv[] = {"redis-server", "--port", ps,  "--bind", "127.0.0.1", "--save", "",
                    "--appendonly", "no",     NULL};
    redis = spawn(argv, true);
    snprintf(url, sizeof url, "redis://127.0.0.1:%d", port);
    sleep_ms(300);
  }
  bench_config_str(b, "redis", url_opt ? url : "redis-server started by the run (127.0.0.1)");
  char cluster[32];
  snprintf(cluster, sizeof cluster, "bench%d", (int)getpid());
  int rc = 0;

  /* the serving nodes, one per size, all forked before this process touches CUDA (a child
   * forked after cannot use it) */
  pid_t srvs[MAX_SIZES] = {0};
  int ready[MAX_SIZES], quit[MAX_SIZES];
  for (int si = 0; si < nsizes; si++) {
    const uint64_t pb = sizes[si];
    const uint32_t per = (uint32_t)SKV_MAX(1, SKV_MIN(64, batch_bytes / pb));
    char dom_s[64];
    snprintf(dom_s, sizeof dom_s, "bench-%d-s%d", (int)getpid(), si);
    int rp[2], qp[2];
    if (pipe(rp) || pipe(qp)) return SKV_FAIL(-errno, SKV_SUBSYS_BENCH, "pipe");
    fflush(stdout), fflush(stderr);
    srvs[si] = fork();
    if (srvs[si] == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      close(rp[0]), close(qp[1]);
      for (int j = 0; j < si; j++) close(quit[j]), close(ready[j]);
      server_main(dom_s, url, cluster, pb, per, smode, rp[1], qp[0]);
    }
    close(rp[1]), close(qp[0]);
    ready[si] = rp[0], quit[si] = qp[1];
  }

  for (int si = 0; si < nsizes && !rc; si++) {
    const uint64_t pb = sizes[si];
    const uint32_t per = (uint32_t)SKV_MAX(1, SKV_MIN(64, batch_bytes / pb));
    char dom_c[64];
    snprintf(dom_c, sizeof dom_c, "bench-%d-c%d", (int)getpid(), si);
    const pid_t srv = srvs[si];
    int src = -1;
    if (read(ready[si], &src, sizeof src) != sizeof src || src) {
      rc = src ? src : SKV_EPEERDEAD;
      fprintf(stderr, "symkv-bench cluster: the serving node failed (%s)\n", skv_err_name(rc));
      break;
    }
    node_t c;
    rc = node_open(&c, dom_c, "client", url, cluster, pb, per, SKV_ROLE_READER, cmode);
    skv_cluster_ref_t *refs = calloc(per, sizeof(*refs));
    uint64_t *ids = malloc(per * sizeof(*ids));
    size_t nl = 0, nh = 0;
    if (!rc && (!refs || !ids)) rc = SKV_ENOMEM;
    if (!rc) rc = skv_cluster_lookup(c.cl, c.ns, c.keys, per, 0, refs, &nl, &nh);
    if (!rc && nh != per) {
      rc = SKV_FAIL(SKV_EINTERNAL, SKV_SUBSYS_BENCH, "cluster: %zu of %u keys found", nh, per);
    }
    for (uint32_t i = 0; i < per && ids; i++) ids[i] = i;
    /* the first fetch is checked byte for byte */
    if (!rc) {
      memset(c.mem, 0xEE, pb * per);
#ifdef SKV_WITH_CUDA
      if (c.dev && cudaMemset(c.dev, 0xEE, pb * per) != cudaSuccess) rc = SKV_ECUDA;
#endif
      if (!rc) rc = skv_cluster_fetch(c.cl, refs, per, c.lay, ids, 0, NULL);
      if (!rc) rc = skv_cluster_sync(c.cl); /* GPU blocks: the reads are stream-ordered */
#ifdef SKV_WITH_CUDA
      if (!rc && c.dev && cudaMemcpy(c.mem, c.dev, pb * per, cudaMemcpyDeviceToHost) != cudaSuccess)
        rc = SKV_FAIL(SKV_ECUDA, SKV_SUBSYS_BENCH, "cluster --gpu: copying the blocks back failed");
#endif
      for (uint64_t i = 0; !rc && i < per; i++)
        for (uint64_t j = 0; j < pb; j++)
          if (c.mem[i * pb + j] != pat((uint32_t)i, j)) {
            rc = SKV_FAIL(SKV_EINTERNAL, SKV_SUBSYS_BENCH,
                          "cluster: page %" PRIu64 " byte %" PRIu64 " wrong", i, j);
            break;
          }
    }
    /* --same-page: every reference names the first page (perftest's access pattern: one
     * remote buffer, cache-resident), checked byte for byte above with distinct pages */
    if (!rc && bench_flag(b, "--same-page"))
      for (uint32_t i = 1; i < per; i++) refs[i] = refs[0];
    /* rounds of ours and of ucx_perftest in turn (this host's load moves both): medians */
    double ours[MAX_ROUNDS] = {0}, theirs[MAX_ROUNDS] = {0};
    char cmd[256] = "";
    for (int round = 0; !rc && round < rounds; round++) {
      double t0 = bench_now(), t;
      int iters = 0;
      do {
        rc = skv_cluster_fetch(c.cl, refs, per, c.lay, ids, 0, NULL);
        iters++;
        t = bench_now() - t0;
      } while (!rc && t < seconds);
      if (!rc) rc = skv_cluster_sync(c.cl); /* GPU blocks: the reads still queued */
#ifdef SKV_WITH_CUDA
      if (!rc && c.dev && cudaDeviceSynchronize() != cudaSuccess)
        rc = SKV_FAIL(SKV_ECUDA, SKV_SUBSYS_BENCH, "cluster --gpu: the copies failed");
#endif
      t = bench_now() - t0;
      ours[round] = (double)pb * per * iters / t / 1e9;
      const int piters = (int)SKV_MAX(20, SKV_MIN(20000, (uint64_t)iters * per));
      double mbs = perftest_get(pb, piters, (int)per, mem, cmd, sizeof cmd);
      theirs[round] = mbs > 0 ? mbs * 1048576.0 / 1e9 : -1;
    }
    double sorted[2][MAX_ROUNDS];
    memcpy(sorted[0], ours, sizeof ours);
    memcpy(sorted[1], theirs, sizeof theirs);
    const double gbs = rc ? 0 : bench_median(sorted[0], (size_t)rounds);
    const double base = rc ? -1 : bench_median(sorted[1], (size_t)rounds);
    /* lookups of the whole chain from the directory (size of the first size only) */
    if (!rc && si == 0) {
      const int nk = SKV_MIN(chain, (int)per);
      double *lat = malloc(sizeof(double) * (size_t)nlookups);
      for (int i = 0; lat && !rc && i < nlookups; i++) {
        double t0 = bench_now();
        rc = skv_cluster_lookup(c.cl, c.ns, c.keys, (size_t)nk, 0, refs, &nl, &nh);
        lat[i] = (bench_now() - t0) * 1e6;
        if (!rc && nh != (size_t)nk) rc = SKV_EINTERNAL;
      }
      if (!rc && lat) {
        qsort(lat, (size_t)nlookups, sizeof *lat, cmp_double);
        char name[96];
        snprintf(name, sizeof name, "lookup %d remote keys (directory) p50", nk);
        bench_row(b, name, lat[nlookups / 2], "us", "lower", "", -1);
        snprintf(name, sizeof name, "lookup %d remote keys (directory) p99", nk);
        bench_row(b, name, lat[(size_t)(nlookups * 0.99)], "us", "lower", "target p99 (1 ms)",
                  1000);
      }
      free(lat);
    }
    if (rc) fprintf(stderr, "symkv-bench cluster: %s: %s\n", skv_err_name(rc), skv_last_error());
    node_close(&c);
    free(refs), free(ids);
    close(quit[si]), close(ready[si]);
    waitpid(srv, NULL, 0);
    srvs[si] = 0;
    if (rc) break;
    char name[160], bname[192];
    char sz[32];
    skv__fmt_bytes(pb, sz, sizeof sz);
    snprintf(name, sizeof name, "remote fetch %s%s pages, %u per fetch%s%s", sz,
             gpu_pages ? " GPU" : "", per,
             !gpu         ? ""
             : gpu_direct ? ", into the GPU (direct)"
                          : ", into the GPU",
             bench_flag(b, "--same-page") ? " (one page)" : "");
    snprintf(bname, sizeof bname, "ucx_perftest ucp_get %s, -O %u -m %s", sz, per, mem);
    bench_row(b, name, gbs, "GB/s", "higher", bname, base);
    bench_config_str(b, sz, cmd);
    char key[64], vals[512];
    size_t o = 0;
    for (int r = 0; r < rounds && o < sizeof vals; r++)
      o += (size_t)snprintf(vals + o, sizeof vals - o, "%s%.4g/%.4g", r ? " " : "", ours[r],
                            theirs[r]);
    snprintf(key, sizeof key, "rounds_%s_ours_vs_perftest_GBps", sz);
    bench_config_str(b, key, vals);
  }
  for (int si = 0; si < nsizes; si++) /* those a failure left */
    if (srvs[si] > 0) {
      close(quit[si]), close(ready[si]);
      waitpid(srvs[si], NULL, 0);
    }
  const char *trace = bench_opt(b, "--trace");
  if (!rc && trace) rc = trace_replay(b, trace, url, cluster);
  bench_config_str(b, "loadavg_end", loadavg(la, sizeof la));
  if (redis > 0) {
    kill(redis, SIGKILL);
    waitpid(redis, NULL, 0);
  }
  if (rc) return rc;
  return bench_report(b);
}

static const bench_optspec_t cluster_opts[] = {
    {"--sizes", BENCH_STR, "LIST", "64K,256K,1M,4M", "page sizes (multiples of 4 KiB)", 0, 0, NULL},
    {"--batch-bytes", BENCH_INT, "N", "16M", "bytes per fetch (pages per fetch: N / size, 1..64)",
     4096, 1ll << 32, NULL},
    {"--seconds", BENCH_REAL, "S", "1", "time of each round of remote fetches", 0.05, 600, NULL},
    {"--rounds", BENCH_INT, "N", "3", "rounds of ours and of ucx_perftest in turn (medians)", 1,
     MAX_ROUNDS, NULL},
    {"--lookups", BENCH_INT, "N", "2000", "lookups timed for p50 / p99", 10, 1000000, NULL},
    {"--chain", BENCH_INT, "N", "32", "keys per lookup (at most the pages of the first size)", 1,
     64, NULL},
    {"--tls", BENCH_STR, "LIST", "UCX_TLS, else tcp", "UCX transports (UCX_TLS), e.g. tcp or sm", 0,
     0, NULL},
    {"--gpu", BENCH_FLAG, NULL, NULL,
     "the fetching node's blocks (and pages) in GPU memory: remote pages go through its pinned "
     "staging buffer and the copy kernels (ucx_perftest still gets into host memory)",
     0, 0, NULL},
    {"--gpu-direct", BENCH_FLAG, NULL, NULL,
     "with --gpu: UCX reads the pages into GPU memory itself (SKV_CLUSTER_GPU_DIRECT; a UCX with "
     "CUDA), ucx_perftest then gets into GPU memory too",
     0, 0, NULL},
    {"--gpu-pages", BENCH_FLAG, NULL, NULL,
     "the serving node's pages in GPU memory, exported through UCX's CUDA support (a UCX with "
     "CUDA), ucx_perftest then reads GPU memory too",
     0, 0, NULL},
    {"--same-page", BENCH_FLAG, NULL, NULL,
     "every fetch reads one remote page N times (ucx_perftest's pattern: one buffer)", 0, 0, NULL},
    {"--trace", BENCH_STR, "FILE", NULL,
     "also replay a Mooncake JSONL trace on --nodes x --pes PEs: node and cluster hit rates vs "
     "their exact bounds",
     0, 0, NULL},
    {"--requests", BENCH_INT, "N", "all", "requests of the trace", 0, 1ll << 32, NULL},
    {"--nodes", BENCH_INT, "N", "2", "nodes of the replay", 1, 8, NULL},
    {"--pes", BENCH_INT, "N", "4", "PEs (processes) per node of the replay", 1, 8, NULL},
    {"--redis-url", BENCH_STR, "URL", "a redis-server of its own", "an existing Redis", 0, 0, NULL},
    BENCH_OPTS_END};

const bench_cmd_t bench_cmd_cluster = {
    .name = "cluster",
    .run = bench_cluster,
    .summary = "across nodes: remote fetch over UCX vs ucx_perftest ucp_get, lookup latency "
               "with the Redis directory",
    .opts = cluster_opts,
    .more = "Two nodes on this host (domains in two processes) and a redis-server of its own. "
            "Needs a build with the cluster layer (UCX, hiredis), redis-server and ucx_perftest "
            "(tests/deps.sh installs them).",
};
