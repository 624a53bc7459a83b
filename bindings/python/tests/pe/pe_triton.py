"""Run on N processes with torch's environment (no symkv-run), CUDA: symkv.triton's device
functions in a user kernel (put, signal, wait, get, barrier, a wait that times out) and the
Triton one-shot all-reduce, against a host reference on fresh random inputs with poisoned
outputs, eager and replayed from a CUDA graph. Prints "OK <rank>" at the end."""
import os

import torch
import torch.distributed as dist
import triton
import triton.language as tl

import symkv.torch as st
import symkv.triton as skt

rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
torch.cuda.set_device(dev)
dist.init_process_group("gloo")  # the reference's gathers run on CPU copies (GPUs may be shared)
g = st.init(device=dev, timeout_ms=30000)


def gather_cpu(t):
    parts = [torch.empty_like(t.cpu()) for _ in range(n)]
    dist.all_gather(parts, t.cpu())
    return parts


def bits(t):
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]).cpu()


def exact(xs):
    """symkv's definition: float32 in PE order 0..n-1, one rounding."""
    acc = xs[0].float()
    for p in xs[1:]:
        acc = acc + p.float()
    return acc.to(xs[0].dtype)


@triton.jit
def exchange(src, sym, mine, got, flags, bflags, my_pe, npes, stride, fstride, epoch,
             timeout_ns, ok_out, NPES: tl.constexpr, BLOCK: tl.constexpr):
    """PE p puts src into sym of PE (p+1)%npes and signals it; waits for its own signal and
    copies what it received into `mine`; after a barrier of all PEs, gets the sym of PE
    (p+1)%npes (its own src, put there in the first step) into `got`."""
    offs = tl.arange(0, BLOCK)
    m = offs < BLOCK
    right = (my_pe + 1) % npes
    skt.put(sym, src, offs, m, my_pe, right, stride)
    skt.signal(flags, epoch, my_pe, right, fstride)
    ok = skt.wait_ge(flags, epoch, timeout_ns)
    tl.store(mine + offs, tl.load(sym + offs, mask=m), mask=m)
    ok = ok * 2 + skt.barrier(bflags, epoch, my_pe, fstride, timeout_ns, NPES)
    skt.get(got, sym, offs, m, my_pe, right, stride)
    tl.store(ok_out, ok)


@triton.jit
def barrier_then_wait_forever(flag, bflags, my_pe, fstride, epoch, btimeout_ns, timeout_ns,
                              ok_out,
                              NPES: tl.constexpr):
    # the barrier may wait for a peer still compiling this kernel: a long timeout there
    ok1 = skt.barrier(bflags, epoch, my_pe, fstride, btimeout_ns, NPES)
    ok2 = skt.wait_ge(flag, epoch + 1000000, timeout_ns)  # nobody signals this value
    tl.store(ok_out, ok1 * 2 + ok2)


B = 1024
sym = st.empty(B, torch.float32)
flags = st.empty(32, torch.int64)  # [0] exchange's signal, [8:] its barrier, [16:] the 2nd test's
flags.zero_()
torch.cuda.synchronize()
g.rendezvous(sym)
g.rendezvous(flags)
g.ctx.barrier()
for it in range(1, 4):
    src = torch.randn(B, device=dev, generator=torch.Generator(dev).manual_seed(rank * 10 + it))
    mine = torch.full((B,), float("nan"), device=dev)
    got = torch.full((B,), float("nan"), device=dev)
    ok = torch.full((1,), -1, dtype=torch.int32, device=dev)
    exchange[(1,)](src, sym, mine, got, flags, flags[8:], rank, n, g.stride // 4, g.stride // 8,
                   it, 10 ** 10, ok, NPES=n, BLOCK=B)
    torch.cuda.synchronize()
    srcs = gather_cpu(src)
    assert ok.item() == 3, ok
    assert torch.equal(bits(mine), bits(srcs[(rank - 1) % n])), ("put/signal/wait", it)
    assert torch.equal(bits(got), bits(src)), ("barrier/get", it)
    g.ctx.barrier()  # nobody overwrites sym before every PE has read it
print(rank, "put/get/signal/wait/barrier ok", flush=True)

ok = torch.full((1,), -1, dtype=torch.int32, device=dev)
t0 = torch.cuda.Event(enable_timing=True)
t1 = torch.cuda.Event(enable_timing=True)
t0.record()
barrier_then_wait_forever[(1,)](flags[24:], flags[16:], rank, g.stride // 8, 1, 10 ** 10,
                                20 * 10 ** 6, ok, NPES=n)
t1.record()
torch.cuda.synchronize()
assert ok.item() == 2, ("barrier ok, then a timed-out wait", ok.item())
assert 15 <= t0.elapsed_time(t1) < 60000, t0.elapsed_time(t1)  # includes the JIT compile
print(rank, "barrier and wait timeout ok (%.1f ms)" % t0.elapsed_time(t1), flush=True)

ar = skt.AllReduce(g, max_bytes=4 << 20, blocks=8)
for dtype in (torch.float32, torch.float16, torch.bfloat16):
    for numel in (1, 7, 1000, 4097, 1 << 16, (4 << 20) // torch.empty((), dtype=dtype).element_size()):
        gen = torch.Generator(dev).manual_seed(1000 * rank + numel)
        x = torch.randn(numel, device=dev, generator=gen).to(dtype)
        out = torch.full_like(x, float("nan"))
        ar(x, out=out)
        ref = g.all_reduce(x, algo="oneshot")
        torch.cuda.synchronize()
        ar.check()
        assert torch.equal(bits(out), bits(exact(gather_cpu(x)))), (dtype, numel, "vs host")
        assert torch.equal(bits(out), bits(ref)), (dtype, numel, "vs symkv one-shot")
print(rank, "triton all-reduce ok", flush=True)

static = torch.randn(1 << 15, device=dev, dtype=torch.bfloat16)
ar(static)
torch.cuda.synchronize()
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    res = ar(static)
for it in range(5):
    x = torch.randn(1 << 15, device=dev, generator=torch.Generator(dev).manual_seed(rank + 50 * it))
    static.copy_(x.to(torch.bfloat16))
    res.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    ar.check()
    assert torch.equal(bits(res), bits(exact(gather_cpu(static)))), it
print(rank, "triton all-reduce in a graph ok", flush=True)
g.close()
dist.destroy_process_group()
print("OK", rank, flush=True)
