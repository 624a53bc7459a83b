/* Internal view of a communicator (skv_comm_t), shared by the front end (comm.c) and both
 * backends: its heap layout, the algorithm crossovers, and the backends' entry points. */
#ifndef SKV_COMM_STATE_H
#define SKV_COMM_STATE_H

#include "heap/heap.h"

#include "kernels/comm_proto.h"

#include <stdbool.h>
#include <stdint.h>

#define SKV_COMM_MAX_CHANNELS 64

/* Host backend (comm_host.c): per-channel state, private to the PE (the GPU keeps it in device
 * memory). */
typedef struct skv__host_chan {
  uint64_t epoch;
  uint64_t barrier_epoch;
  uint64_t check_seq; /* checked calls posted (checking mode) */
} skv__host_chan_t;

struct skv_comm {
  skv_ctx_t *ctx;
  skv_heap_t *heap;
  int backend; /* SKV_BACKEND_HOST or SKV_BACKEND_CUDA */
  int npes, me;
  uint32_t channels;
  uint32_t flags;
  uint64_t max_bytes;
  /* layout, byte offsets inside a segment */
  uint32_t user_slots; /* user signal slots at signal offset 0 */
  uint64_t flag_off;   /* channel c's barrier flags: flag_off + c * flag_chan_bytes */
  uint64_t flag_chan_bytes;
  uint64_t check_off;   /* check slots, after the flags: skv__check_off (checking mode) */
  bool checked;         /* checking mode: SKV_COMM_CHECKED or SKV_COMM_CHECK=1 */
  uint64_t scratch_off; /* channel c's regions: scratch_off + c * chan_bytes */
  uint64_t chan_bytes;
  uint64_t region_bytes;
  /* AUTO: largest message (bytes) for one-shot, then two-shot; beyond: NCCL (or two-shot) */
  uint64_t oneshot_max, twoshot_max;
  bool has_nccl;
  bool gpu_time_sliced;    /* cuda: a peer shares this PE's GPU without MPS (docs/comm.md) */
  bool broken;             /* a wait timed out: the Lamport buffers are no longer clean */
  skv__host_chan_t *hchan; /* host backend state (comm_host.c) */
  void *cuda;              /* CUDA backend state (comm_cuda.c) */
};

/* Address of byte `off` of PE pe's segment. */
static inline char *skv__comm_addr(const skv_comm_t *c, int pe, uint64_t off) {
  return (char *)skv__heap_addr(c->heap, pe, off);
}

/* Elements of `es` bytes that one launch (one epoch) of `algo` (SKV_ALGO_ONESHOT or _TWOSHOT)
 * carries; both backends split a larger message into launches of this many. */
static inline uint64_t skv__comm_chunk_count(const skv_comm_t *c, int algo, uint32_t es) {
  uint64_t bytes = algo == SKV_ALGO_ONESHOT ? skv__oneshot_chunk_bytes(c->region_bytes, c->npes)
                                            : skv__twoshot_chunk_bytes(c->region_bytes, c->npes);
  return bytes / es;
}

/* ---- dtype.c: names, and the half-precision conversions of the host backend --------------- */
/* Bytes of one element of `dtype` (0 when invalid). */
static inline uint32_t skv__dtype_size(int dtype) {
  return dtype == SKV_DTYPE_FP32                                ? 4u
         : (dtype == SKV_DTYPE_BF16 || dtype == SKV_DTYPE_FP16) ? 2u
                                                                : 0u;
}
const char *skv__dtype_name(int dtype);
const char *skv__op_name(int op);
const char *skv__algo_name(int algo);
const char *skv__cmp_name(int cmp);     /* SKV_CMP_*: "==", "!=", ... */
const char *skv__phase_name(int phase); /* SKV__PHASE_*: "one-shot", ... */
/* A checked call for messages: "skv_comm_allreduce(count 1000, fp32, sum, one-shot, channel 0)". */
const char *skv__check_name(uint64_t desc, uint64_t count, char *buf, size_t cap);
/* Round to nearest even, like the GPU; NaN becomes the GPU's canonical one. */
float skv__bf16_to_float(uint16_t h);
uint16_t skv__float_to_bf16(float f);
float skv__fp16_to_float(uint16_t h);
uint16_t skv__float_to_fp16(float f);

/* ---- comm.c ------------------------------------------------------------------------------- */
/* The algorithm AUTO picks for `bytes` on this comm (never SKV_ALGO_AUTO). */
int skv__comm_choose(const skv_comm_t *c, uint64_t bytes);

/* ---- comm_host.c: the CPU runs the flag protocols (arguments checked by comm.c) ----------- */
/* After the heap exists: sentinel fill and channel state. */
int skv__comm_host_create(skv_comm_t *c);
/* Frees the channel state; the heap is destroyed by the caller. */
void skv__comm_host_destroy(skv_comm_t *c);
int skv__comm_host_allreduce(skv_comm_t *c, const void *in, void *out, size_t count, int dtype,
                             int op, int algo, int channel);
int skv__comm_host_signal(skv_comm_t *c, int pe, uint32_t slot, uint64_t value, int op);
int skv__comm_host_wait(skv_comm_t *c, uint32_t slot, int cmp, uint64_t value);
int skv__comm_host_barrier(skv_comm_t *c, int channel);
/* Checking mode: check the call (skv__check_desc, count) against every peer's before it runs:
 * 0, SKV_EMISMATCH or SKV_ETIMEDOUT (the comm is broken then). */
int skv__comm_host_verify(skv_comm_t *c, int channel, uint64_t desc, uint64_t count);

#ifdef SKV_WITH_CUDA
/* ---- comm_cuda.c -------------------------------------------------------------------------- */
/* Before anything collective: the device is usable and no graph capture is running. */
int skv__comm_cuda_precheck(skv_ctx_t *ctx);
/* After the heap exists: sentinel fill, device state, error record, kernels, NCCL (collective).
 * Sets c->has_nccl. */
int skv__comm_cuda_create(skv_comm_t *c);
/* Waits for this PE's work, then frees; the heap is destroyed by the caller. */
int skv__comm_cuda_destroy(skv_comm_t *c);
int skv__comm_cuda_allreduce(skv_comm_t *c, const void *in, void *out, size_t count, int dtype,
                             int op, int algo, int channel, void *stream);
int skv__comm_cuda_signal(skv_comm_t *c, int pe, uint32_t slot, uint64_t value, int op,
                          void *stream);
int skv__comm_cuda_wait(skv_comm_t *c, uint32_t slot, int cmp, uint64_t value, void *stream);
int skv__comm_cuda_barrier(skv_comm_t *c, int channel, void *stream);
/* Checking mode: launch the check of the call before it (a mismatch shows in skv_comm_check). */
int skv__comm_cuda_verify(skv_comm_t *c, int channel, uint64_t desc, uint64_t count, void *stream);
int skv__comm_cuda_check(skv_comm_t *c);
/* The descriptor kernels get (tests and the bench launch the self-test and ping-pong with it). */
int skv__comm_cuda_dev(skv_comm_t *c, skv__comm_dev_t *d);
/* Tests and bench: the device-API self-test and the in-kernel ping-pong (kernels/comm_proto.h). */
int skv__comm_devapi_selftest(skv_comm_t *c, uint32_t slot_base, int iters, int blocks,
                              uint64_t data_off, uint64_t bytes_per_block, int errors_out[2],
                              void *stream);
int skv__comm_pingpong(skv_comm_t *c, int partner, uint32_t slot, uint64_t base, int iters,
                       double *rt_us, void *stream);
#endif

#endif
