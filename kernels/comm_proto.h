/* Comm kernels' internal interface: how the flag protocols work, the layout math shared by the
 * CUDA kernels and the host backend, the kernels' descriptor, and comm.cu's launch wrappers. */
#ifndef SKV_COMM_PROTO_H
#define SKV_COMM_PROTO_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#ifdef __CUDACC__
#define SKV__HD static __host__ __device__ __forceinline__
#else
#define SKV__HD static inline
#endif

/* ---- the flag protocols ------------------------------------------------------------------- */

/* How the flag protocols work (kernels/comm.cu runs them on the GPU; the host backend,
 * src/comm/comm_host.c, runs the same with one CPU thread per PE and 16-byte vectors written as
 * two 8-byte atomic words; both place slots and flags with the layout math below):
 *
 * All-reduce (Lamport, no barrier). Each channel has two regions of Lamport slots in every
 * PE's scratch, used by epoch parity; the epoch counts the channel's all-reduce launches and
 * lives with the PE (device memory on the GPU, advanced by the kernel itself). Every slot
 * holds the sentinel (all bits set in every element) unless it carries data of the current
 * epoch.
 *  - One-shot: PE p stores its input vector v, canonicalised (an element equal to the sentinel
 *    gets its lowest bit flipped: still a NaN), into slot (p, v) of region e%2 of every peer.
 *    Each PE polls its own slots (q, v) until no element is the sentinel, puts the sentinel
 *    back (clear after read), and reduces the n vectors in PE order 0..n-1 in float32.
 *  - Two-shot: vector range j of the message belongs to PE j. PE p pushes range j to PE j's
 *    reduce-scatter slot (p, v); PE j polls those, reduces in PE order, canonicalises the
 *    result, writes its own output and pushes the result to every PE's all-gather slot (j, v);
 *    every PE polls the all-gather slots and writes them out. (The CUDA kernel runs the three
 *    steps in one pass, vector by vector; the host backend runs them one after the other.)
 *  Every slot a peer writes into my region is read and cleared by me in the same epoch, so a
 *  region is clean when the epoch ends. A peer is at most one epoch ahead of me (finishing
 *  epoch e needs my epoch-e data), so while I run epoch e peers write only regions e%2 and
 *  (e+1)%2, and (e+1)%2 was cleared during my epoch e-1, which completed before I pushed any
 *  data of epoch e. Hence two regions suffice and no flag ever needs resetting.
 *  Every PE reduces the same values in the same order (two-shot: one PE reduces, everyone
 *  copies), so the results are bitwise identical everywhere.
 *
 * Barrier: PE p stores the channel's barrier epoch e into flag (c, p) of every peer with
 * release semantics, then waits (acquire) until its own flags (c, q) are >= e for every q.
 * Flags only grow, so nothing is reset; a PE cannot reach e+1 before every PE reached e.
 *
 * What can go wrong:
 *  - A peer that never arrives: every wait gives up after the context's timeout and fails
 *    with SKV_ETIMEDOUT naming the PE and slot. Slots may then hold data that nobody clears,
 *    so the comm is marked broken: later calls fail with SKV_ESTATE; destroy it everywhere.
 *  - PEs that call with different counts, dtypes or channels: slots are polled that nobody
 *    writes (timeout) or data is left behind; a different op reduces to wrong results without
 *    a word. The collectives are not checked on the fast path; every PE must make the same
 *    calls in the same order on a channel. The checking mode (below) checks every call.
 *  - Two threads on one channel at once: they share the epoch; use one channel per thread
 *    (GPU: per stream).
 *  - The sentinel changes inputs that carry exactly its pattern (a NaN stays a NaN). */

/* Checking mode (SKV_COMM_CHECKED, SKV_COMM_CHECK=1). Before each all-reduce or barrier on
 * channel c, PE p writes what it is about to do, the call's description (kind, dtype, op,
 * algorithm, channel) and count, into its check slot (c, p) on every peer, then the call's
 * number s (the channel's checked calls so far, plus one) with release semantics; it waits
 * (acquire) until its own slot (c, q) of every peer q holds s, and compares. The same Dekker-free
 * argument as the barrier's holds: a peer cannot post s + 1 on c before it passed call s, which
 * needs my post of s, so a slot read at s is the peer's call s (its number is read again after
 * the fields, to be sure). A slot that holds a larger number means the peer made more checked
 * calls on c than this PE. Every PE compares every peer's call with its own, so a mismatch is
 * found on every PE; then nothing is pushed, the call fails with SKV_EMISMATCH naming both
 * calls, and the comm is broken (destroy it). A PE that calls on another channel never posts on
 * c: a PE that waits on c longer than SKV__CHECK_CHANNEL_MS while a peer has posted a call on a
 * channel this PE has not reached reports the channel mismatch. */
#define SKV__CHECK_SLOT_BYTES 32u   /* u64 call number, u64 description, u64 count, pad */
#define SKV__CHECK_CHANNEL_MS 1000u /* grace before a wait on another channel is a mismatch */
enum { SKV__CHECK_ALLREDUCE = 1, SKV__CHECK_BARRIER = 2 };

/* The description of a checked call: kind, dtype, op and algorithm (0 for a barrier), channel. */
SKV__HD uint64_t skv__check_desc(int kind, int dtype, int op, int algo, int ch) {
  return (uint64_t)(kind & 0xff) | (uint64_t)(dtype & 0xff) << 8 | (uint64_t)(op & 0xff) << 16 |
         (uint64_t)(algo & 0xff) << 24 | (uint64_t)(ch & 0xffff) << 32;
}

/* ---- layout (identical on every PE; see docs/comm.md "Memory") ---------------------------- */

#define SKV__VEC             16u   /* bytes of one vector: the unit pushed, polled and cleared */
#define SKV__USER_SLOTS      4096u /* user signal slots at the start of the signal pad */
#define SKV__LAMPORT_REGIONS 2u    /* double buffering by epoch parity (clear after read) */
#define SKV__MAX_UNROLL_PES  8     /* one-shot polls up to this many peers with loads in flight */

/* Sentinel of the Lamport buffers: every bit set in an element (a negative NaN with a full
 * payload). Inputs carrying exactly this pattern are pushed with their lowest bit flipped. */
#define SKV__SENT32 0xffffffffu

/* Vectors needed for `count` elements of `es` bytes (the last one zero-padded). */
SKV__HD uint64_t skv__nvec(uint64_t count, uint32_t es) {
  return (count * es + SKV__VEC - 1) / SKV__VEC;
}
/* Two-shot: vectors of each PE's chunk (PE j owns vectors [j*cv, j*cv + valid_j)). */
SKV__HD uint64_t skv__ts_cv(uint64_t nvec, int n) {
  return (nvec + (uint64_t)n - 1) / (uint64_t)n;
}
SKV__HD uint64_t skv__ts_valid(uint64_t nvec, uint64_t cv, int j) {
  uint64_t lo = (uint64_t)j * cv;
  if (lo >= nvec) return 0;
  return nvec - lo < cv ? nvec - lo : cv;
}
/* Most bytes one launch (one epoch) can carry within a region of `region` bytes. One-shot:
 * n slots of the whole message; two-shot: n reduce-scatter + n all-gather slots of a chunk. */
SKV__HD uint64_t skv__oneshot_chunk_bytes(uint64_t region, int n) {
  return region / ((uint64_t)n * SKV__VEC) * SKV__VEC;
}
SKV__HD uint64_t skv__twoshot_chunk_bytes(uint64_t region, int n) {
  return region / (2ull * (uint64_t)n * SKV__VEC) * (uint64_t)n * SKV__VEC;
}
/* Byte offset in a segment of channel ch's region for epoch e (regions alternate by parity). */
SKV__HD uint64_t skv__region_off(uint64_t scratch_off, uint64_t chan_bytes, uint64_t region_bytes,
                                 int ch, uint64_t e) {
  return scratch_off + (uint64_t)ch * chan_bytes + (e % SKV__LAMPORT_REGIONS) * region_bytes;
}
/* Byte offset in a segment of the barrier flag that PE pe sets on channel ch. */
SKV__HD uint64_t skv__flag_off(uint64_t flag_off, uint64_t flag_chan_bytes, int ch, int pe) {
  return flag_off + (uint64_t)ch * flag_chan_bytes + (uint64_t)pe * 8u;
}
/* Byte offset in a segment of the check slot that PE pe writes on channel ch. */
SKV__HD uint64_t skv__check_off(uint64_t check_off, int npes, int ch, int pe) {
  return check_off + ((uint64_t)ch * (uint64_t)npes + (uint64_t)pe) * SKV__CHECK_SLOT_BYTES;
}
/* Byte offsets inside one region. One-shot: slot of source PE p holds nvec vectors. Two-shot:
 * RS slot of source p (cv vectors), then AG slot of owner j (cv vectors). */
SKV__HD uint64_t skv__os_slot(uint64_t nvec, int p, uint64_t v) {
  return ((uint64_t)p * nvec + v) * SKV__VEC;
}
SKV__HD uint64_t skv__ts_rs(uint64_t cv, int p, uint64_t v) {
  return ((uint64_t)p * cv + v) * SKV__VEC;
}
SKV__HD uint64_t skv__ts_ag(uint64_t cv, int n, int j, uint64_t v) {
  return (((uint64_t)n + (uint64_t)j) * cv + v) * SKV__VEC;
}

/* ---- device state and error record -------------------------------------------------------- */

/* Per-channel state in device memory, private to the PE; advanced by the kernels themselves so
 * that graph replays need no host. The all-reduce epoch (launches completed on the channel) is
 * kept in SKV__EPOCH_LANES equal copies: block b of a launch reads lane b and writes lanes
 * b, b+G, b+2G, ... (G blocks), so no block waits for another and no atomic is needed. */
#define SKV__EPOCH_LANES 1024u
typedef struct skv__chan_state {
  uint64_t barrier_epoch; /* barriers completed on this channel */
  uint64_t check_seq;     /* checked calls posted on this channel (checking mode) */
  uint64_t pad[6];
  uint64_t epoch[SKV__EPOCH_LANES];
} skv__chan_state_t;

enum {
  SKV__ERR_ALLREDUCE = 1,
  SKV__ERR_BARRIER = 2,
  SKV__ERR_WAIT = 3,
  SKV__ERR_DEVAPI = 4,
  SKV__ERR_CHECK = 5, /* checking mode: a mismatch (code SKV_EMISMATCH) or a wait that timed out */
};
/* Steps of an all-reduce that can wait for a peer (skv__phase_name in src/comm/dtype.c). */
enum { SKV__PHASE_ONESHOT = 1, SKV__PHASE_RS = 2, SKV__PHASE_AG = 3 };

/* The first device-side failure, in host-mapped memory (written once: the thread that wins
 * `broken` fills it, fences, then sets `code` last). */
typedef struct skv__comm_err {
  volatile int32_t code;    /* 0, SKV_ETIMEDOUT or (checking mode) SKV_EMISMATCH */
  volatile int32_t kind;    /* SKV__ERR_* */
  volatile int32_t channel; /* channel, or -1 */
  volatile int32_t peer;    /* PE waited for, or -1 */
  volatile int32_t phase;   /* all-reduce: SKV__PHASE_* */
  volatile int32_t cmp;     /* wait: SKV_CMP_* */
  volatile uint64_t slot;   /* wait: slot; all-reduce: vector index */
  volatile uint64_t epoch;  /* epoch of the channel */
  volatile uint64_t value;  /* wait: value compared with */
  volatile uint64_t observed;
  volatile uint64_t waited_ns;
} skv__comm_err_t;

/* Everything a kernel needs, passed by value (captured graphs keep their own copy). */
typedef struct skv__comm_dev {
  char *base; /* PE 0's segment; PE p's at base + p * stride */
  uint64_t stride;
  uint64_t signal_off; /* offset of the signal pad in a segment */
  uint64_t flag_off;   /* offset of channel 0's barrier flags (u64 [npes]) in a segment */
  uint64_t flag_chan_bytes;
  uint64_t scratch_off; /* offset of channel 0's Lamport regions in a segment */
  uint64_t chan_bytes;  /* SKV__LAMPORT_REGIONS * region_bytes */
  uint64_t region_bytes;
  uint64_t check_off;      /* offset of channel 0's check slots in a segment (checking mode) */
  skv__chan_state_t *chan; /* device memory, [channels] */
  uint32_t *broken;        /* device memory: set once a wait gave up; every later launch returns */
  skv__comm_err_t *err;    /* host-mapped, device address */
  uint64_t timeout_ns;
  int32_t me, npes;
  int32_t nsm; /* multiprocessors of the device */
  uint32_t user_slots;
  int32_t pdl;      /* launch with programmatic dependent launch (SKV_COMM_PDL, default 1) */
  int32_t grid_cap; /* most blocks of an all-reduce launch below SKV__COMM_LARGE_BYTES */
  int32_t channels;
  int32_t grid_cap_large; /* most blocks of a launch of SKV__COMM_LARGE_BYTES or more */
  int32_t stream_hints;   /* large launches read and write the caller's buffers evict-first */
  int32_t reserved;
} skv__comm_dev_t;

/* Blocks of the all-reduce kernels: 256 threads, registers capped so that 3 fit on an SM. A
 * launch below SKV__COMM_LARGE_BYTES takes at most 2 per SM, leaving room for another channel's
 * kernel; a larger one takes 3 (on 2 H100, 16 MiB launches: 64 MiB two-shot 214 us against
 * 223 us with 2 per SM; 4 MiB launches are faster with 2: bench/results/comm_tuning_*). */
#define SKV__COMM_THREADS             256
#define SKV__COMM_BLOCKS_PER_SM       2
#define SKV__COMM_MIN_BLOCKS_PER_SM   3
#define SKV__COMM_BLOCKS_PER_SM_LARGE 3
#define SKV__COMM_LARGE_BYTES         (8ull << 20)

enum { SKV__ALG_ONESHOT = 1, SKV__ALG_TWOSHOT = 2 };

/* ---- launch wrappers (kernels/comm.cu); each returns a cudaError_t ------------------------ */

/* One launch = one epoch of `channel`: count elements (at most the algorithm's chunk bytes). */
int skv__k_allreduce(const skv__comm_dev_t *d, int alg, int dtype, int op, int channel,
                     const void *in, void *out, uint64_t count, void *stream);
int skv__k_barrier(const skv__comm_dev_t *d, int channel, void *stream);
/* Checking mode: the check of one call (desc, count) on `channel`, before the call's launch. */
int skv__k_check(const skv__comm_dev_t *d, int channel, uint64_t desc, uint64_t count,
                 void *stream);
int skv__k_signal(const skv__comm_dev_t *d, int pe, uint32_t slot, uint64_t value, int op,
                  void *stream);
int skv__k_wait(const skv__comm_dev_t *d, uint32_t slot, int cmp, uint64_t value, void *stream);
/* Load every comm kernel now (lazy module loading must not happen during a capture). */
int skv__k_preload(void);
/* Self-test of include/symkv_device.cuh: `iters` rounds of put-with-signal around the ring of
 * PEs from `blocks` CTAs into `buf` (this PE's heap data, blocks * bytes_per_block bytes),
 * verification, block and grid barriers. Uses user slots [slot_base, slot_base + npes + 4).
 * errors[0] (device int) counts wrong words, errors[1] the waits that timed out. */
int skv__k_devapi_selftest(const skv__comm_dev_t *d, uint32_t slot_base, int iters, int blocks,
                           void *buf, uint64_t bytes_per_block, int *errors, void *stream);
/* Signal ping-pong between this PE and `partner` inside one kernel, through user slot `slot`
 * (values base+1 .. base+iters). PE with the lower index starts. ns[0] gets the nanoseconds of
 * iterations 2..iters, ns[1] nonzero on a timeout. */
int skv__k_pingpong(const skv__comm_dev_t *d, int partner, uint32_t slot, uint64_t base, int iters,
                    unsigned long long *ns, void *stream);

#ifdef __cplusplus
}
#endif
#endif
