"""Run on N processes with torch's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; no
symkv-run): a torch process group bootstraps symkv.torch, whose ops are compared with
torch.distributed.all_reduce and an exact host reference on fresh random inputs.

    pe_torch.py cpu|cuda [quick] [inductor]

quick: sizes up to 4 MiB (else one 64 MiB message too); inductor: compile with Inductor too
(always on CUDA), beside aot_eager.

cpu: gloo group, host backend. cuda: the CUDA backend on cuda:(LOCAL_RANK % GPUs); the
reference all-reduce is NCCL when every rank has its own GPU, else gloo on CPU copies (NCCL
refuses two ranks on one GPU). Prints "OK <rank>" at the end."""
import os
import sys
import time

import torch
import torch.distributed as dist

import symkv
import symkv.torch as st

where = sys.argv[1]
quick = "quick" in sys.argv[2:]
inductor = "inductor" in sys.argv[2:] or where == "cuda"
rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
cuda = where == "cuda"
if cuda:
    ngpu = torch.cuda.device_count()
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)) % ngpu)
    torch.cuda.set_device(dev)
    shared_gpu = n > ngpu
    dist.init_process_group("gloo" if shared_gpu else "nccl", device_id=None if shared_gpu else dev)
else:
    dev = torch.device("cpu")
    shared_gpu = False
    dist.init_process_group("gloo")


T0 = time.time()


def log(*a):
    print(rank, "%.1f s:" % (time.time() - T0), *a, flush=True)


g = st.init(device=dev, timeout_ms=30000)
assert g.rank == rank and g.world_size == n, g
assert st.default_group() is g

DT = [torch.float32, torch.float16, torch.bfloat16]
SIZES = [1, 7, 1000, 4097, 1 << 16, 1 << 20]
BIG = 64 << 20  # bytes: the largest message (max_bytes of the default Group)


def fresh(numel, dtype, seed):
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    x = torch.randn(numel, generator=gen, dtype=torch.float32).to(dtype)
    return x.to(dev)


def gather_cpu(t):
    """Every rank's t (on the CPU), through gloo / NCCL."""
    if cuda and not shared_gpu:
        parts = [torch.empty_like(t) for _ in range(n)]
        dist.all_gather(parts, t)
        return [p.cpu() for p in parts]
    parts = [torch.empty_like(t.cpu()) for _ in range(n)]
    dist.all_gather(parts, t.cpu())
    return parts


def exact(inputs, op):
    """symkv's definition: accumulate in float32 in PE order 0..n-1, round once."""
    acc = inputs[0].float()
    for x in inputs[1:]:
        acc = acc + x.float() if op == "sum" else (torch.maximum(acc, x.float()) if op == "max"
                                                   else torch.minimum(acc, x.float()))
    return acc.to(inputs[0].dtype)


def dist_ref(x, op):
    red = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]
    if cuda and not shared_gpu:
        y = x.clone()
        dist.all_reduce(y, red)
        return y.cpu()
    y = x.cpu().clone()
    dist.all_reduce(y, red)
    return y


def same_bits(a, b):
    return torch.equal(a.view(torch.int8 if a.element_size() == 1 else
                              {2: torch.int16, 4: torch.int32}[a.element_size()]),
                       b.view({2: torch.int16, 4: torch.int32}[b.element_size()]))


def sync():
    if cuda:
        torch.cuda.synchronize()


# 1. out of place and in place, every dtype and size, against dist.all_reduce and the exact
#    reference; every rank must hold the same bits.
seed = 0
for dtype in DT:
    sizes = SIZES if quick or (not cuda and dtype != torch.bfloat16) else \
        SIZES + [BIG // dtype.itemsize]
    for numel in sizes:
        for op in (["sum", "max"] if numel < (1 << 20) else ["sum"]):
            seed += 1
            x = fresh(numel, dtype, seed)
            keep = x.clone()
            y = torch.ops.symkv.all_reduce(x, g.id, op, "auto", 0)
            sync()
            assert torch.equal(x, keep), "the out-of-place op changed its input"
            inputs = gather_cpu(x)
            want = exact(inputs, op)
            got = y.cpu()
            assert same_bits(got, want), (dtype, numel, op, (got.float() - want.float()).abs().max())
            ref = dist_ref(x, op)
            if op != "sum" or n == 2:
                # 2 PEs: one rounding of an exact sum, whatever the order; max / min: exact
                assert same_bits(got, ref), (dtype, numel, op, "differs from dist.all_reduce")
            else:
                tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
                torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol * n)
            everyone = gather_cpu(y)
            assert all(same_bits(e, everyone[0]) for e in everyone), "ranks differ"
            # in place, on a non-contiguous view too
            z = x.clone()
            st.all_reduce_(z, op=op)
            sync()
            assert same_bits(z.cpu(), want), ("in place", dtype, numel, op)
            del x, y, z, keep
    log("dtype", dtype, "ok")

x = fresh(64, torch.float32, 999).reshape(8, 8)
v = x.t()
assert not v.is_contiguous()
want = exact(gather_cpu(v.contiguous()), "sum")
assert same_bits(st.all_reduce(v).cpu(), want)
st.all_reduce_(v)
sync()
assert same_bits(v.contiguous().cpu(), want)
for algo in ("oneshot", "twoshot"):
    x = fresh(3000, torch.bfloat16, 77)
    want = exact(gather_cpu(x), "sum")
    assert same_bits(g.all_reduce(x, algo=algo).cpu(), want), algo
    # spellings the C++ kernel leaves to the Python one (docs/python.md, "Overhead")
    assert same_bits(torch.ops.symkv.all_reduce(x, g.id, "SUM", algo.upper(), 0).cpu(), want)
log("kernels of torch.ops.symkv.*:", "Python" if where.upper() in st._py_kernels else "C++")

# 2. clear errors, before any PE is left waiting (the same on every rank)
for bad, match in ((lambda: g.all_reduce(torch.ones(4, dtype=torch.int32, device=dev)), "dtype"),
                   (lambda: g.all_reduce(fresh(4, torch.float32, 1), op="avg"), "op 'avg'"),
                   (lambda: g.all_reduce(fresh(4, torch.float32, 1), algo="ring"), "algo 'ring'"),
                   (lambda: torch.ops.symkv.all_reduce(fresh(4, torch.float32, 1), 12345, "sum",
                                                       "auto", 0), "not an open"),
                   # the C++ kernel's own call fails (channel out of range): the same error type
                   (lambda: torch.ops.symkv.all_reduce_(fresh(4, torch.float32, 1), g.id, "sum",
                                                        "auto", 99), "channel"),
                   (lambda: torch.ops.symkv.all_reduce(fresh(4, torch.float32, 1), g.id, "avg",
                                                       "auto", 0), "op 'avg'")):
    try:
        bad()
        raise AssertionError("no error for " + match)
    except symkv.InvalidArgument as e:
        assert match in str(e), e
if cuda:
    try:
        g.all_reduce(torch.ones(4))
        raise AssertionError("a CPU tensor was taken by a CUDA group")
    except symkv.InvalidArgument as e:
        assert "this group's comm is on cuda" in str(e), e
log("errors ok")

# 3. torch.compile(fullgraph=True): no graph break, the op in the graph, same bits as eager
seen = []


def counting(gm, example_inputs):
    seen.append([str(nd.target) for nd in gm.graph.nodes])
    return gm.forward


def f(a, b):
    # one rounding per bf16 result in eager and compiled code alike (a * 2 is exact), so that
    # compiled and eager results can be compared bit for bit
    h = st.all_reduce(a * 2 + b)
    st.all_reduce_(b, op="max")
    return h + 1, h, b


a = fresh(4096, torch.bfloat16, 5)
b = fresh(4096, torch.bfloat16, 6)
b2 = b.clone()
eager = f(a, b2)
for backend in (["aot_eager", "inductor"] if inductor else ["aot_eager"]):
    torch._dynamo.reset()
    fc = torch.compile(f, fullgraph=True, backend=backend)
    b3 = b.clone()
    out = fc(a, b3)
    sync()
    for e, o in zip(eager, out):
        assert same_bits(e.cpu(), o.cpu()), (backend, "compiled differs from eager")
    assert same_bits(b3.cpu(), b2.cpu()), (backend, "in-place op under compile")
torch._dynamo.reset()
fc = torch.compile(f, fullgraph=True, backend=counting)
fc(a, b.clone())
names = [t.replace(".default", "") for t in seen[0]] if len(seen) == 1 else []
assert "symkv.all_reduce" in names and "symkv.all_reduce_" in names, seen
want_h = exact(gather_cpu(a * 2 + b), "sum")
assert same_bits(eager[1].cpu(), want_h) and same_bits(eager[2].cpu(), exact(gather_cpu(b), "max"))
# the Python API calls the kernel directly only in plain eager mode: under make_fx (a dispatch
# mode) it must still record the ops
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402
gm = make_fx(lambda p, q: (st.all_reduce(p), st.all_reduce_(q)), tracing_mode="fake")(a, b.clone())
traced = [str(nd.target) for nd in gm.graph.nodes]
assert "symkv.all_reduce.default" in traced and "symkv.all_reduce_.default" in traced, traced
log("compile ok")

# 4. CUDA graphs: capture, replay on fresh inputs, same bits as eager
if cuda:
    static = fresh(1 << 16, torch.bfloat16, 10)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm up (the comm allocates nothing, torch's allocator might)
        st.all_reduce(static)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    ca = st.CustomAllreduce(None, dev, max_size=8 << 20)
    with ca.capture():
        with torch.cuda.graph(graph):
            res = st.all_reduce(static)
            res2 = ca.custom_all_reduce(res)
    for it in range(5):
        fresh_in = fresh(1 << 16, torch.bfloat16, 100 + it)
        static.copy_(fresh_in)
        res.fill_(float("nan"))
        res2.fill_(float("nan"))
        graph.replay()
        sync()
        want = exact(gather_cpu(fresh_in), "sum")
        assert same_bits(res.cpu(), want), ("graph replay", it)
        assert same_bits(res2.cpu(), st.all_reduce(want.to(dev)).cpu()), ("graph replay 2", it)
    fc = torch.compile(f, fullgraph=True, mode="reduce-overhead")
    for it in range(4):
        a, b = fresh(4096, torch.bfloat16, 200 + it), fresh(4096, torch.bfloat16, 300 + it)
        bb = b.clone()
        e = f(a, bb)
        bc = b.clone()
        o = fc(a, bc)
        sync()
        assert all(same_bits(p.cpu(), q.cpu()) for p, q in zip(e, o)), ("reduce-overhead", it)
    ca.close()
    log("graphs ok")

# 5. symmetric tensors: empty, rendezvous, peers' views
t = st.empty((4, 1000), torch.float32)
assert t.shape == (4, 1000) and t.dtype == torch.float32 and t.device == dev
t.fill_(rank + 1)
u = st.empty(10, torch.bfloat16)
peers = g.rendezvous(t)
g.barrier()
sync()
dist.barrier()
for pe, p in enumerate(peers):
    assert torch.equal(p.cpu(), torch.full((4, 1000), pe + 1.0)), pe
assert g.offset(u) >= g.offset(t) + 16000
used = g._alloc.used()
del peers, p, t
import gc  # noqa: E402
gc.collect()
assert g._alloc.used() < used, "freed tensors go back to the heap"
try:
    st.empty(g.data_bytes + 1)
    raise AssertionError("an empty() larger than the heap was taken")
except symkv.NoSpace as e:
    assert "max_bytes" in str(e)
y = st.empty(1000, torch.float32)
y.copy_(fresh(1000, torch.float32, 55))
want = exact(gather_cpu(y), "sum")
st.all_reduce_(y)  # in place inside the heap
sync()
assert same_bits(y.cpu(), want)
log("empty ok")

# 6. vLLM's custom all-reduce shape
ca = st.CustomAllreduce(None, dev, max_size=1 << 20)
assert not ca.disabled
assert ca.should_custom_ar(fresh(1024, torch.bfloat16, 1))
assert not ca.should_custom_ar(fresh(1025, torch.bfloat16, 1))            # not 16-byte multiple
assert not ca.should_custom_ar(fresh(1 << 20, torch.float32, 1))          # over max_size
assert not ca.should_custom_ar(torch.ones(64, dtype=torch.int32, device=dev))
assert ca.custom_all_reduce(torch.ones(64, dtype=torch.int32, device=dev)) is None
x = fresh(2048, torch.float16, 8)
assert same_bits(ca.custom_all_reduce(x).cpu(), exact(gather_cpu(x), "sum"))
ca.close()
assert ca.disabled and ca.custom_all_reduce(x) is None

# 7. a Group from a plain torch Store (no process group), and closing
# Rank 0 listens on a port the kernel picks and tells the others through the process group: a
# fixed MASTER_PORT + 1 could be taken already (EADDRINUSE), e.g. as the source port of one of
# this run's own connections. (The server does not wait for the others here: they learn the port
# only after it returns.)
server = dist.TCPStore(os.environ["MASTER_ADDR"], 0, n, True, use_libuv=True,
                       wait_for_workers=False) if rank == 0 else None
port = [server.port if server is not None else 0]
dist.broadcast_object_list(port, src=0)
store = server if server is not None else dist.TCPStore(os.environ["MASTER_ADDR"], port[0], n,
                                                      False, use_libuv=True)
with st.Group(store=store, rank=rank, world_size=n, device=dev, max_bytes=1 << 20) as g2:
    x = fresh(100, torch.float32, 9)
    assert same_bits(g2.all_reduce(x).cpu(), exact(gather_cpu(x), "sum"))
assert g2.closed
g.close()
try:
    st.all_reduce(x)
    raise AssertionError("the default group outlived close()")
except symkv.InvalidArgument as e:
    assert "no open Group" in str(e), e
dist.destroy_process_group()
print("OK", rank, flush=True)
