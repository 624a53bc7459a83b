/* Tensor-parallel collectives, the front end: create and destroy, argument checks, the algorithm
 * choice and the public entry points, which dispatch to comm_host.c or comm_cuda.c. */
#define _GNU_SOURCE
#include "comm/comm_state.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define DEFAULT_CHANNELS  4u
#define DEFAULT_MAX_BYTES (64ull << 20)
#define MAX_MAX_BYTES     (16ull << 30)
/* Most bytes one Lamport launch carries (SKV_COMM_CHUNK): each launch ends in a wait for its
 * slowest block, so larger is faster, for 4x its size of scratch per channel. On 2 H100, 64 MiB
 * two-shot (3 blocks per SM), the one-pass kernel: 8M 217 us, 16M 204, 32M 195, 64M 193
 * (bench/results/comm_tuning_nvidia-h100-x2.txt); 16M keeps the default comm at 256 MiB. */
#define CUDA_CHUNK_BYTES (16ull << 20)
#define HOST_CHUNK_BYTES (1ull << 20)
#define MIN_REGION_BYTES (64ull << 10)

/* ---- algorithm choice --------------------------------------------------------------------- */

/* Crossovers of the CUDA backend by PE count, from symkv-bench allreduce on the GPU hosts (it
 * prints the measured values as "crossover" rows). A count between rows uses the row below.
 * 2 PEs: measured on nvidia-h200-x2 and nvidia-h100-x2 (bench/results/allreduce_*-x2.json):
 * two-shot beats NCCL up to 64 MiB (0.83x there on 2 H100 with the one-pass kernel; 1.005x on
 * 2 H200 with the one before), so AUTO runs two-shot up to 64 MiB. 4 PEs: measured on
 * nvidia-h100-x4: one-shot wins up to 256 KiB (allreduce_nvidia-h100-x4.json), and the one-pass
 * two-shot up to 64 MiB (0.93x NCCL at 32 MiB, 0.98x at 64 MiB; comm_tuning_nvidia-h100-x2.txt
 * section 7). 8 PEs: not measured (no 8-GPU host was lent), a conservative guess that keeps
 * one-shot, whose traffic grows with the PE count, to small messages. */
static const struct {
  int npes;
  uint64_t oneshot_max, twoshot_max;
} cuda_crossovers[] = {
    {2, 2ull << 20, 64ull << 20},
    {4, 256ull << 10, 64ull << 20},
    {8, 64ull << 10, 2ull << 20},
};

/* A byte count from the environment (K/M/G/T suffixes) in [lo, hi] into *v; unset leaves *v. */
static int env_bytes(skv__env_id_t id, long long lo, long long hi, const char *what, uint64_t *v) {
  const char *name = skv__env_name(id);
  const char *s = skv__env(id);
  if (!s || !*s) return 0;
  long long x;
  if (!skv__parse_int(s, lo, hi, true, &x))
    return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_COMM,
                    "%s=%s is not a byte count in [%lld, %lld] (e.g. 256K, 4M)", name, s, lo, hi);
  *v = (uint64_t)x;
  SKV_INFO(SKV_SUBSYS_COMM, "%s=%s: %s overridden", name, s, what);
  return 0;
}

static int crossovers(skv_comm_t *c) {
  if (c->backend == SKV_BACKEND_HOST) {
    c->oneshot_max = 32ull << 10;
    c->twoshot_max = UINT64_MAX;
  } else {
    size_t row = 0;
    for (size_t i = 0; i < SKV_ARRAY_LEN(cuda_crossovers); i++)
      if (cuda_crossovers[i].npes <= c->npes) row = i;
    c->oneshot_max = cuda_crossovers[row].oneshot_max;
    c->twoshot_max = cuda_crossovers[row].twoshot_max;
  }
  SKV_CHECK(
      env_bytes(SKV_ENV_ALLREDUCE_ONESHOT_MAX, 0, 1ll << 40, "AUTO crossover", &c->oneshot_max));
  SKV_CHECK(
      env_bytes(SKV_ENV_ALLREDUCE_TWOSHOT_MAX, 0, 1ll << 40, "AUTO crossover", &c->twoshot_max));
  return 0;
}

int skv__comm_choose(const skv_comm_t *c, uint64_t bytes) {
  if (bytes <= c->oneshot_max && bytes <= c->max_bytes) return SKV_ALGO_ONESHOT;
  if (c->has_nccl && (bytes > c->twoshot_max || bytes > c->max_bytes)) return SKV_ALGO_NCCL;
  return SKV_ALGO_TWOSHOT;
}

/* ---- create / destroy --------------------------------------------------------------------- */

/* The backend's part of a comm (the heap stays). */
static int backend_destroy(skv_comm_t *c) {
  if (c->backend == SKV_BACKEND_HOST) {
    skv__comm_host_destroy(c);
    return 0;
  }
#ifdef SKV_WITH_CUDA
  return skv__comm_cuda_destroy(c);
#else
  return 0;
#endif
}

int skv_comm_create(skv_ctx_t *ctx, const skv_comm_opts_t *opts, skv_comm_t **out) {
  SKV_ARG_CHECK(ctx && out, SKV_SUBSYS_COMM, "skv_comm_create: ctx and comm must be non-NULL");
  *out = NULL;
  skv_comm_opts_t o = SKV_COMM_OPTS_INIT;
  if (opts) {
    SKV_ARG_CHECK(
        opts->size >= sizeof(skv_comm_opts_t) && opts->version >= 1 &&
            opts->version <= SKV_COMM_OPTS_VERSION,
        SKV_SUBSYS_COMM,
        "skv_comm_create: opts.size=%zu / opts.version=%u: initialise with SKV_COMM_OPTS_INIT",
        opts->size, opts->version);
    o = *opts;
  }
  if (o.backend == SKV_BACKEND_CUDA) {
#ifndef SKV_WITH_CUDA
    return SKV_FAIL(
        SKV_ENOTSUP, SKV_SUBSYS_COMM,
        "skv_comm_create: backend cuda needs a build with CUDA (configure with -DSKV_CUDA=ON); "
        "SKV_BACKEND_HOST runs the same protocols on the CPU");
#endif
  } else if (o.backend != SKV_BACKEND_HOST) {
    return SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_COMM,
                    "skv_comm_create: opts.backend=%d is not SKV_BACKEND_CUDA or SKV_BACKEND_HOST",
                    o.backend);
  }
  if (o.channels == 0) o.channels = DEFAULT_CHANNELS;
  SKV_ARG_CHECK(o.channels <= SKV_COMM_MAX_CHANNELS, SKV_SUBSYS_COMM,
                "skv_comm_create: opts.channels=%u is not in 1..%d", o.channels,
                SKV_COMM_MAX_CHANNELS);
  SKV_ARG_CHECK((o.flags & ~(uint32_t)(SKV_COMM_NO_NCCL | SKV_COMM_CHECKED)) == 0, SKV_SUBSYS_COMM,
                "skv_comm_create: opts.flags=0x%x has unknown bits (SKV_COMM_NO_NCCL and "
                "SKV_COMM_CHECKED are defined)",
                o.flags);
  if (o.max_bytes == 0) o.max_bytes = DEFAULT_MAX_BYTES;
  SKV_ARG_CHECK(o.max_bytes >= 16 && o.max_bytes <= MAX_MAX_BYTES, SKV_SUBSYS_COMM,
                "skv_comm_create: opts.max_bytes=%" PRIu64 " is not in 16..%" PRIu64, o.max_bytes,
                (uint64_t)MAX_MAX_BYTES);
  if (ctx->nlocal != ctx->cfg.world_size)
    return SKV_FAIL(
        SKV_ENOTSUP, SKV_SUBSYS_COMM,
        "skv_comm_create: the job spans %d PEs but only %d are on this node; the symmetric "
        "collectives work within one node (use NCCL across nodes)",
        ctx->cfg.world_size, ctx->nlocal);

  skv_comm_t *c = calloc(1, sizeof *c);
  if (!c) return SKV_FAIL(SKV_ENOMEM, SKV_SUBSYS_COMM, "skv_comm_create: out of memory");
  c->ctx = ctx;
  c->backend = o.backend;
  c->npes = ctx->nlocal;
  c->me = ctx->local_index;
  c->channels = o.channels;
  c->flags = o.flags;
  c->max_bytes = o.max_bytes;
  /* Checking mode: by flag, or for every comm by SKV_COMM_CHECK=1 (a bad value goes into the
   * collective check below, like a bad crossover). */
  long long check_env = 0;
  int rc_check = skv__env_int(SKV_ENV_COMM_CHECK, 0, 1, 0, &check_env);
  c->checked = (o.flags & SKV_COMM_CHECKED) || check_env == 1;
  /* A bad SKV_ALLREDUCE_*_MAX on one PE goes into the collective check below, so that the
   * others fail with it at once instead of waiting there for the timeout. */
  int rc = rc_check < 0 ? rc_check : crossovers(c);
  char env_err[400] = "";
  if (rc < 0) snprintf(env_err, sizeof env_err, "%s", skv_last_error());
  /* Layout: [user slots | barrier flags per channel] in the signal pad, two Lamport regions
   * per channel in the scratch, max_bytes of data for buffers used in place. */
  c->user_slots = SKV__USER_SLOTS;
  c->flag_chan_bytes = SKV_ALIGN_UP((uint64_t)c->npes * 8u, 128u);
  uint64_t chunk = c->backend == SKV_BACKEND_HOST ? HOST_CHUNK_BYTES : CUDA_CHUNK_BYTES;
  if (c->backend == SKV_BACKEND_CUDA && rc == 0) {
    /* A larger chunk means fewer launches (each ends in a wait for the slowest block) for more
     * scratch; part of the collective check below, like the crossovers. */
    rc = env_bytes(SKV_ENV_COMM_CHUNK, 64 << 10, 1ll << 30, "CUDA all-reduce chunk", &chunk);
    if (rc < 0) snprintf(env_err, sizeof env_err, "%s", skv_last_error());
  }
  chunk = SKV_MIN(c->max_bytes, chunk);
  c->region_bytes = SKV_ALIGN_UP(SKV_MAX(2 * chunk, MIN_REGION_BYTES), 4096u);
  c->chan_bytes = SKV__LAMPORT_REGIONS * c->region_bytes;
  skv_heap_opts_t ho = SKV_HEAP_OPTS_INIT;
  ho.backend = c->backend;
  ho.data_bytes = c->max_bytes;
  ho.signal_bytes =
      SKV_ALIGN_UP((uint64_t)c->user_slots * 8u + c->channels * c->flag_chan_bytes +
                       (uint64_t)c->channels * (uint64_t)c->npes * SKV__CHECK_SLOT_BYTES,
                   256u);
  ho.scratch_bytes = c->channels * c->chan_bytes;
  bool want_nccl = c->backend == SKV_BACKEND_CUDA && !(c->flags & SKV_COMM_NO_NCCL);
  const char *ne = skv__env(SKV_ENV_NCCL_ALLREDUCE);
  if (ne && strcmp(ne, "0") == 0) want_nccl = false;
#ifdef SKV_WITH_CUDA
  if (rc == 0 && c->backend == SKV_BACKEND_CUDA && (rc = skv__comm_cuda_precheck(ctx)) < 0) {
    free(c);
    return rc;
  }
#endif
  int rc_env = rc;
  rc = skv__coll_check(ctx, NULL,
                       "skv_comm_create(backend=%s, channels=%u, max_bytes=%" PRIu64
                       ", nccl=%d, oneshot_max=%" PRIu64 ", twoshot_max=%" PRIu64
                       ", region=%" PRIu64 ", checked=%d%s%s)",
                       skv__backend_name(c->backend), c->channels, c->max_bytes, (int)want_nccl,
                       c->oneshot_max, c->twoshot_max, c->region_bytes, (int)c->checked,
                       rc_env < 0 ? ", failed here: " : "", env_err);
  if (rc_env < 0 || rc < 0) {
    free(c);
    return rc_env < 0 ? SKV_FAIL(rc_env, SKV_SUBSYS_COMM, "%s", env_err) : rc;
  }
  if (!want_nccl) c->flags |= SKV_COMM_NO_NCCL;
  rc = skv_heap_create_ex(ctx, &ho, &c->heap);
  if (rc < 0) {
    free(c);
    return rc;
  }
  c->flag_off = c->heap->info.signal_offset + (uint64_t)c->user_slots * 8u;
  c->check_off = c->flag_off + c->channels * c->flag_chan_bytes;
  c->scratch_off = c->heap->info.scratch_offset;
  if (c->backend == SKV_BACKEND_HOST) {
    rc = skv__comm_host_create(c);
  } else {
#ifdef SKV_WITH_CUDA
    rc = skv__comm_cuda_create(c);
#endif
  }
  /* Every PE learns whether every PE is ready (so that all keep or all drop the comm), and no
   * PE pushes into a peer's regions before that peer has filled them with the sentinel. */
  char why[512];
  snprintf(why, sizeof why, "%s", rc < 0 ? skv_last_error() : "");
  int32_t mine = rc, all[SKV_MAX_LOCAL_PES];
  int rc2 = skv_ctx_allgather(ctx, &mine, all, sizeof mine);
  if (rc == 0 && rc2 < 0) {
    rc = rc2;
    snprintf(why, sizeof why, "%s", skv_last_error());
  }
  for (int r = 0; rc == 0 && r < c->npes; r++)
    if (all[r] < 0) {
      rc = all[r];
      snprintf(why, sizeof why, "PE %d failed to set up its part (%s); its log says why", r,
               skv_err_name(all[r]));
    }
  if (rc < 0) {
    backend_destroy(c);
    skv_heap_destroy(c->heap);
    free(c);
    return SKV_FAIL(rc, SKV_SUBSYS_COMM, "skv_comm_create failed: %s", why);
  }
  char b1[32], b2[32];
  SKV_INFO(SKV_SUBSYS_COMM,
           "comm: backend %s, %d PEs, %u channels, regions of %s, max message %s, nccl %s, AUTO "
           "one-shot <= %" PRIu64 " B, two-shot <= %" PRIu64 " B%s",
           skv__backend_name(c->backend), c->npes, c->channels,
           skv__fmt_bytes(c->region_bytes, b1, sizeof b1),
           skv__fmt_bytes(c->max_bytes, b2, sizeof b2), c->has_nccl ? "yes" : "no", c->oneshot_max,
           c->twoshot_max, c->checked ? ", checking mode (every call checked)" : "");
  *out = c;
  return 0;
}

int skv_comm_destroy(skv_comm_t *comm) {
  if (!comm) return 0;
  int rc = backend_destroy(comm);
  if (rc == SKV_ECAPTURE) return rc; /* nothing was freed: the caller may retry after the capture */
  int rc2 = skv_heap_destroy(comm->heap);
  free(comm);
  return rc ? rc : rc2;
}

skv_heap_t *skv_comm_get_heap(const skv_comm_t *comm) {
  if (!comm) {
    SKV_FAIL(SKV_EINVAL, SKV_SUBSYS_COMM, "skv_comm_get_heap: comm is NULL");
    return NULL;
  }
  return comm->heap;
}

int skv_comm_get_signal_slots(const skv_comm_t *comm) {
  SKV_ARG_CHECK(comm, SKV_SUBSYS_COMM, "skv_comm_get_signal_slots: comm is NULL");
  return (int)comm->user_slots;
}

/* ---- public entry points ------------------------------------------------------------------ */

#define COMM_CHECK(c, fn)                                                                     \
  do {                                                                                        \
    SKV_ARG_CHECK((c), SKV_SUBSYS_COMM, "%s: comm is NULL", fn);                              \
    if (SKV_UNLIKELY(__atomic_load_n(&(c)->broken, __ATOMIC_RELAXED)))                        \
      return SKV_FAIL(                                                                        \
          SKV_ESTATE, SKV_SUBSYS_COMM,                                                        \
          "%s: an earlier collective or barrier of this comm timed out (or, checking mode, "  \
          "did not match), so its flags are no longer consistent; destroy the comm on every " \
          "PE and create a new one",                                                          \
          fn);                                                                                \
  } while (0)

int skv_comm_allreduce(skv_comm_t *comm, const void *in, void *out, size_t count, skv_dtype_t dtype,
                       skv_op_t op, skv_algo_t algo, int channel, void *stream) {
  COMM_CHECK(comm, "skv_comm_allreduce");
  uint32_t es = skv__dtype_size(dtype);
  SKV_ARG_CHECK(es != 0, SKV_SUBSYS_COMM,
                "skv_comm_allreduce: dtype %d is not SKV_DTYPE_BF16, _FP16 or _FP32", dtype);
  SKV_ARG_CHECK(op >= SKV_OP_SUM && op <= SKV_OP_MIN, SKV_SUBSYS_COMM,
                "skv_comm_allreduce: op %d is not SKV_OP_SUM, _MAX or _MIN", op);
  SKV_ARG_CHECK(algo >= SKV_ALGO_AUTO && algo <= SKV_ALGO_NCCL, SKV_SUBSYS_COMM,
                "skv_comm_allreduce: algo %d is not SKV_ALGO_AUTO, _ONESHOT, _TWOSHOT or _NCCL",
                algo);
  SKV_ARG_CHECK(channel >= 0 && (uint32_t)channel < comm->channels, SKV_SUBSYS_COMM,
                "skv_comm_allreduce: channel %d is not in 0..%u (opts.channels)", channel,
                comm->channels - 1);
  SKV_ARG_CHECK(count > 0, SKV_SUBSYS_COMM, "skv_comm_allreduce: count is 0");
  SKV_ARG_CHECK(count <= (UINT64_MAX >> 8) / es, SKV_SUBSYS_COMM,
                "skv_comm_allreduce: count %zu times the element size overflows", count);
  SKV_ARG_CHECK(in && out, SKV_SUBSYS_COMM,
                "skv_comm_allreduce: in (%p) and out (%p) must be non-NULL", in, out);
  uint64_t bytes = (uint64_t)count * es;
  if (algo == SKV_ALGO_AUTO) algo = skv__comm_choose(comm, bytes);
  if (algo == SKV_ALGO_NCCL && !comm->has_nccl)
    return SKV_FAIL(SKV_ENOTSUP, SKV_SUBSYS_COMM,
                    "skv_comm_allreduce: SKV_ALGO_NCCL needs the CUDA backend with an NCCL "
                    "communicator; this comm has "
                    "none (%s)",
                    comm->backend == SKV_BACKEND_HOST ? "host backend"
                    : (comm->flags & SKV_COMM_NO_NCCL)
                        ? "SKV_COMM_NO_NCCL or SKV_NCCL_ALLREDUCE=0"
                        : "libnccl.so.2 missing, or PEs share a GPU; see the INFO log");
  if (algo != SKV_ALGO_NCCL && bytes > comm->max_bytes)
    return SKV_FAIL(SKV_ERANGE, SKV_SUBSYS_COMM,
                    "skv_comm_allreduce: %" PRIu64 " bytes exceed the comm's max_bytes (%" PRIu64
                    ") for the symmetric algorithms; raise opts.max_bytes%s",
                    bytes, comm->max_bytes, comm->has_nccl ? " or use SKV_ALGO_NCCL / AUTO" : "");
  SKV_TRACE(SKV_SUBSYS_COMM, "allreduce %zu x %s %s, %s, channel %d", count, skv__dtype_name(dtype),
            skv__op_name(op), skv__algo_name(algo), channel);
  const uint64_t desc = skv__check_desc(SKV__CHECK_ALLREDUCE, dtype, op, algo, channel);
  if (comm->backend == SKV_BACKEND_HOST) {
    SKV_ARG_CHECK(
        stream == NULL, SKV_SUBSYS_COMM,
        "skv_comm_allreduce: the host backend is synchronous, stream must be NULL (got %p)",
        stream);
    if (comm->checked) SKV_CHECK(skv__comm_host_verify(comm, channel, desc, count));
    return skv__comm_host_allreduce(comm, in, out, count, dtype, op, algo, channel);
  }
#ifdef SKV_WITH_CUDA
  if (comm->checked) SKV_CHECK(skv__comm_cuda_verify(comm, channel, desc, count, stream));
  return skv__comm_cuda_allreduce(comm, in, out, count, dtype, op, algo, channel, stream);
#else
  return SKV_FAIL(SKV_EINTERNAL, SKV_SUBSYS_COMM,
                  "skv_comm_allreduce: CUDA comm in a build without CUDA");
#endif
}

int skv_comm_signal(skv_comm_t *comm, int pe, uint32_t slot, uint64_t value, skv_signal_op_t op,
                    void *stream) {
  COMM_CHECK(comm, "skv_comm_signal");
  SKV_ARG_CHECK(pe >= 0 && pe < comm->npes, SKV_SUBSYS_COMM,
                "skv_comm_signal: pe %d is not in 0..%d", pe, comm->npes - 1);
  SKV_ARG_CHECK(slot < comm->user_slots, SKV_SUBSYS_COMM,
                "skv_comm_signal: slot %u is not below skv_comm_get_signal_slots() = %u", slot,
                comm->user_slots);
  SKV_ARG_CHECK(op == SKV_SIGNAL_SET || op == SKV_SIGNAL_ADD, SKV_SUBSYS_COMM,
                "skv_comm_signal: op %d is not SKV_SIGNAL_SET or SKV_SIGNAL_ADD", op);
  if (comm->backend == SKV_BACKEND_HOST) {
    SKV_ARG_CHECK(stream == NULL, SKV_SUBSYS_COMM,
                  "skv_comm_signal: the host backend is synchronous, stream must be NULL");
    return skv__comm_host_signal(comm, pe, slot, value, op);
  }
#ifdef SKV_WITH_CUDA
  return skv__comm_cuda_signal(comm, pe, slot, value, op, stream);
#else
  return SKV_EINTERNAL;
#endif
}

int skv_comm_wait(skv_comm_t *comm, uint32_t slot, skv_cmp_t cmp, uint64_t value, void *stream) {
  COMM_CHECK(comm, "skv_comm_wait");
  SKV_ARG_CHECK(slot < comm->user_slots, SKV_SUBSYS_COMM,
                "skv_comm_wait: slot %u is not below skv_comm_get_signal_slots() = %u", slot,
                comm->user_slots);
  SKV_ARG_CHECK(cmp >= SKV_CMP_EQ && cmp <= SKV_CMP_LE, SKV_SUBSYS_COMM,
                "skv_comm_wait: cmp %d is not one of SKV_CMP_EQ, _NE, _GE, _GT, _LT, _LE", cmp);
  if (comm->backend == SKV_BACKEND_HOST) {
    SKV_ARG_CHECK(stream == NULL, SKV_SUBSYS_COMM,
                  "skv_comm_wait: the host backend is synchronous, stream must be NULL");
    return skv__comm_host_wait(comm, slot, cmp, value);
  }
#ifdef SKV_WITH_CUDA
  return skv__comm_cuda_wait(comm, slot, cmp, value, stream);
#else
  return SKV_EINTERNAL;
#endif
}

int skv_comm_barrier(skv_comm_t *comm, int channel, void *stream) {
  COMM_CHECK(comm, "skv_comm_barrier");
  SKV_ARG_CHECK(channel >= 0 && (uint32_t)channel < comm->channels, SKV_SUBSYS_COMM,
                "skv_comm_barrier: channel %d is not in 0..%u (opts.channels)", channel,
                comm->channels - 1);
  const uint64_t desc = skv__check_desc(SKV__CHECK_BARRIER, 0, 0, 0, channel);
  if (comm->backend == SKV_BACKEND_HOST) {
    SKV_ARG_CHECK(stream == NULL, SKV_SUBSYS_COMM,
                  "skv_comm_barrier: the host backend is synchronous, stream must be NULL");
    if (comm->checked) SKV_CHECK(skv__comm_host_verify(comm, channel, desc, 0));
    return skv__comm_host_barrier(comm, channel);
  }
#ifdef SKV_WITH_CUDA
  if (comm->checked) SKV_CHECK(skv__comm_cuda_verify(comm, channel, desc, 0, stream));
  return skv__comm_cuda_barrier(comm, channel, stream);
#else
  return SKV_EINTERNAL;
#endif
}

int skv_comm_check(skv_comm_t *comm) {
  SKV_ARG_CHECK(comm, SKV_SUBSYS_COMM, "skv_comm_check: comm is NULL");
  if (comm->backend == SKV_BACKEND_HOST) return 0; /* host calls report their failures themselves */
#ifdef SKV_WITH_CUDA
  return skv__comm_cuda_check(comm);
#else
  return 0;
#endif
}
