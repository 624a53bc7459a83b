"""symkv for Triton: device functions a user's @triton.jit kernel calls on symkv's symmetric
heap (peer pointers by arithmetic, put / get, signal and wait with release / acquire semantics
and a timeout flag, a barrier), and a one-shot all-reduce written in Triton on top of them.

The heap's rule is that PE q's copy of any heap address p of PE me is p + (q - me) * stride
(docs/comm.md, "Memory"); a Group (symkv.torch) gives `stride` and `empty()` tensors in the
heap. Memory ordering: Triton's atomics with sem="release" / scope="sys" for signals, inline PTX
(`ld.acquire.sys.global.u64`, `%globaltimer`) for the polling load and the clock, since Triton
has no acquire load and no clock of its own (docs/comm.md, "Triton"). CUDA only."""

import torch
import triton
import triton.language as tl

from . import _lib

# -- device functions ---------------------------------------------------------------------------


@triton.jit
def peer_ptr(ptr, my_pe, pe, stride):
    """PE `pe`'s copy of heap pointer `ptr` of this PE; `stride` is the heap's PE stride in
    elements of ptr's type (Group.stride // element size)."""
    # tl.cast, not .to(): Triton passes an int argument equal to 1 as a Python int constant
    # (specialisation), which has no .to (rank 1's my_pe failed to compile on Triton 3.6)
    return ptr + (tl.cast(pe, tl.int64) - tl.cast(my_pe, tl.int64)) * stride


@triton.jit
def put(dst, src, offs, mask, my_pe, pe, stride):
    """dst[offs] of PE `pe` = src[offs] of this PE (dst in the heap; src anywhere)."""
    tl.store(peer_ptr(dst, my_pe, pe, stride) + offs, tl.load(src + offs, mask=mask), mask=mask)


@triton.jit
def get(dst, src, offs, mask, my_pe, pe, stride):
    """dst[offs] of this PE = src[offs] of PE `pe` (src in the heap; dst anywhere)."""
    tl.store(dst + offs, tl.load(peer_ptr(src, my_pe, pe, stride) + offs, mask=mask), mask=mask)


@triton.jit
def ld_acquire(ptr):
    """The uint64/int64 at ptr, loaded with acquire semantics at system scope (each thread)."""
    return tl.inline_asm_elementwise("ld.acquire.sys.global.u64 $0, [$1];", "=l,l", [ptr],
                                     dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def globaltimer(dummy):
    """The GPU's nanosecond clock (%globaltimer); `dummy` is any 64-bit scalar (Triton needs an
    argument to shape the result)."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,l", [dummy],
                                     dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def signal(flag, value, my_pe, pe, stride):
    """Set PE `pe`'s int64 flag (heap pointer `flag` of this PE; stride in int64 elements) to
    `value` with release semantics at system scope: every store this block made before is
    visible to a peer that acquires the value. Blocks first (tl.debug_barrier) so that the
    stores of all the block's threads are ordered before the signal."""
    tl.debug_barrier()
    tl.atomic_xchg(peer_ptr(flag, my_pe, pe, stride), value, sem="release", scope="sys")


@triton.jit
def signal_add(flag, value, my_pe, pe, stride):
    """Add `value` to PE `pe`'s int64 flag with release semantics (see signal)."""
    tl.debug_barrier()
    tl.atomic_add(peer_ptr(flag, my_pe, pe, stride), value, sem="release", scope="sys")


@triton.jit
def wait_ge(flag, value, timeout_ns):
    """Spin until this PE's int64 flag >= value (acquire: the signaller's earlier stores are
    visible after it), at most timeout_ns nanoseconds. Returns 1 when the value came, 0 on
    timeout (then the caller must not trust what it guards)."""
    start = globaltimer(flag)
    v = ld_acquire(flag)
    timed_out = 0
    while (v < value) & (timed_out == 0):
        v = ld_acquire(flag)
        if globaltimer(flag) - start > timeout_ns:
            timed_out = 1
    return 1 - timed_out


@triton.jit
def barrier(flags, epoch, my_pe, stride, timeout_ns, NPES: tl.constexpr):
    """All PEs' blocks of the same program id: `flags` is this block's NPES int64 flags in the
    heap (zero at the start, only growing), `epoch` this call's number (> every earlier one).
    Signals flag[my_pe] of every PE with release, then waits (acquire) for its own flag[q] >=
    epoch of every q. Returns 1, or 0 if a peer did not arrive within timeout_ns."""
    tl.debug_barrier()
    for q in tl.static_range(NPES):
        tl.atomic_xchg(peer_ptr(flags + my_pe, my_pe, q, stride), epoch, sem="release",
                       scope="sys")
    ok = 1
    for q in tl.static_range(NPES):
        ok = ok & wait_ge(flags + q, epoch, timeout_ns)
    tl.debug_barrier()
    return ok


# -- the one-shot all-reduce in Triton ----------------------------------------------------------


@triton.jit
def _oneshot_kernel(x_ptr, out_ptr, buf_ptr, flags_ptr, epoch_ptr, err_ptr, n, my_pe,
                    buf_stride, flag_stride, timeout_ns, NPES: tl.constexpr,
                    BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    ep = tl.load(epoch_ptr + pid) + 1
    flags = flags_ptr + pid * 2 * NPES
    # 1. this block's chunks of x into this PE's staging buffer
    for start in range(pid * BLOCK, n, nprog * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        m = offs < n
        tl.store(buf_ptr + offs, tl.load(x_ptr + offs, mask=m), mask=m)
    # 2. every PE's block pid has staged the same chunks
    ok = barrier(flags, ep, my_pe, flag_stride, timeout_ns, NPES)
    # 3. reduce in PE order 0..NPES-1 in float32, round once (symkv's definition: same bits as
    #    skv_comm_allreduce's one-shot)
    for start in range(pid * BLOCK, n, nprog * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        m = offs < n
        acc = tl.load(peer_ptr(buf_ptr, my_pe, 0, buf_stride) + offs, mask=m).to(tl.float32)
        for q in tl.static_range(1, NPES):
            acc += tl.load(peer_ptr(buf_ptr, my_pe, q, buf_stride) + offs, mask=m).to(tl.float32)
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=m)
    # 4. nobody stages the next call's data before every PE has read this one's
    ok = ok & barrier(flags + NPES, ep, my_pe, flag_stride, timeout_ns, NPES)
    tl.store(epoch_ptr + pid, ep)
    if ok == 0:
        tl.atomic_max(err_ptr, ep)


class AllReduce:
    """A one-shot sum all-reduce in Triton over a symkv.torch.Group on CUDA: `ar(x)` returns a
    new tensor, `ar(x, out=x)` reduces in place. Collective to make (it allocates its staging
    buffer and flags with group.empty, so every PE must make it in the same order). Up to
    max_bytes per call; `blocks` programs (their blocks must all fit on the GPUs at once, also
    when PEs share a GPU). Every call is stream-ordered and capturable in CUDA graphs (the
    epochs live in device memory). `check()` raises symkv.Timeout when a wait of an earlier
    call gave up (err holds the epoch)."""

    BLOCK = 2048

    def __init__(self, group, max_bytes=1 << 20, blocks=16, timeout_ms=None):
        if group.device.type != "cuda":
            _lib.invalid("symkv.triton.AllReduce needs a CUDA group, not %s" % group.device)
        self.group = group
        self.npes, self.my_pe = group.world_size, group.rank
        self.blocks = blocks
        self.max_bytes = max_bytes
        self.buf = group.empty(max_bytes, torch.uint8)
        self.flags = group.empty(blocks * 2 * self.npes, torch.int64)
        self.epochs = group.empty(blocks, torch.int64)
        self.err = torch.zeros(1, dtype=torch.int64, device=group.device)
        self.flags.zero_()
        self.epochs.zero_()
        torch.cuda.synchronize(group.device)
        group.rendezvous(self.buf)  # checks the offsets agree (collective)
        group.rendezvous(self.flags)
        group.ctx.barrier()  # every PE's flags are zero before anyone signals
        tmo = group.ctx.timeout_ms if timeout_ms is None else timeout_ms
        self.timeout_ns = int(tmo) * 1000000
        self.flag_stride = group.stride // 8

    def __call__(self, x, out=None):
        if out is None:
            out = torch.empty_like(x)
        if not (x.is_contiguous() and out.is_contiguous() and x.dtype == out.dtype
                and x.shape == out.shape):
            _lib.invalid("symkv.triton.AllReduce: x and out must be contiguous, of one shape "
                         "and dtype")
        nbytes = x.numel() * x.element_size()
        if nbytes > self.max_bytes:
            _lib.invalid("symkv.triton.AllReduce: %d bytes exceed max_bytes %d"
                         % (nbytes, self.max_bytes))
        if x.numel() == 0:
            return out
        es = x.element_size()
        buf = self.buf.view(x.dtype)
        grid = (min(self.blocks, triton.cdiv(x.numel(), self.BLOCK)),)
        _oneshot_kernel[grid](x, out, buf, self.flags, self.epochs, self.err, x.numel(),
                              self.my_pe, self.group.stride // es, self.flag_stride,
                              self.timeout_ns, NPES=self.npes, BLOCK=self.BLOCK)
        return out

    def check(self):
        e = int(self.err.item())
        if e:
            self.err.zero_()
            from . import errors
            _lib.raise_error(errors.Timeout.code, "symkv.triton.AllReduce: a wait of call %d "
                             "gave up after %d ms: a peer did not arrive (SKV_ETIMEDOUT, triton)"
                             % (e, self.timeout_ns // 1000000))


__all__ = ["peer_ptr", "put", "get", "ld_acquire", "globaltimer", "signal", "signal_add",
           "wait_ge", "barrier", "AllReduce"]
