"""Run on 2+ PEs: the host-backend comm: all-reduce (sum/max/min, fp32/fp16, every algorithm,
in place, zero copy in the comm's heap), signals, wait, barrier, timeouts, bad input and the
checking mode."""
import time

import numpy as np

import symkv

ctx = symkv.init()
rank, n = ctx.rank, ctx.world_size
ctx.timeout_ms = 5000  # every PE: bounds the timeout test below
comm = ctx.comm(backend="host", nccl=False)

for dtype in (np.float32, np.float16):
    x = (np.arange(1000) % 17).astype(dtype) * (rank + 1)
    for algo in ("auto", "oneshot", "twoshot"):
        out = comm.allreduce(x, algo=algo)
        want = (np.arange(1000) % 17).astype(np.float64) * (n * (n + 1) // 2)
        assert np.array_equal(out.astype(np.float64), want), (dtype, algo)
        assert out.dtype == x.dtype and out.shape == x.shape
    mx = comm.allreduce(x, op="max")
    assert np.array_equal(mx, (np.arange(1000) % 17).astype(dtype) * n)
    mn = comm.allreduce(x, op="min")
    assert np.array_equal(mn, (np.arange(1000) % 17).astype(dtype))
# identical on every PE, bit for bit
r = np.random.default_rng(rank).standard_normal(4096).astype(np.float32)
s = comm.allreduce(r)
assert all(b == s.tobytes() for b in ctx.allgather(s.tobytes()))
# in place, 2-D
y = np.full((8, 16), rank, np.float32)
assert comm.allreduce(y, out=y) is y and (y == n * (n - 1) / 2).all()
# zero copy in the comm's heap
buf = comm.heap.array(np.float32, (256,))
buf[:] = rank + 1
comm.allreduce(buf, out=buf)
assert (buf == n * (n + 1) / 2).all()
symkv.allreduce(comm, buf, out=buf, op="max")
# raw 16-bit storage as bf16 (1.0 is 0x3f80 in bfloat16)
bf = np.full(64, 0x3F80, np.uint16)
o = comm.allreduce(bf, dtype="bf16")
assert (o.view(np.uint16) == {1: 0x3F80, 2: 0x4000, 3: 0x4040, 4: 0x4080}.get(n, o[0])).all()

# signals: a ring, then every PE adds to PE 0's slot
assert comm.signal_slots >= 4
comm.signal((rank + 1) % n, 1, rank + 100)
comm.wait(1, (rank - 1) % n + 100, cmp="eq")
comm.signal(0, 2, 1, op="add")
if rank == 0:
    comm.wait(2, n, cmp=">=")
comm.barrier()
symkv.barrier(comm)

# a wait nobody satisfies times out
t = time.time()
try:
    comm.wait(3, 1 << 40, cmp="ge")
except symkv.Timeout as e:
    assert e.code == symkv.Timeout.code and e.name == "SKV_ETIMEDOUT"
else:
    raise AssertionError("wait did not time out")
assert time.time() - t < 30
comm.barrier()

# bad input
for bad, exc in [(lambda: comm.allreduce(np.zeros(4, np.int32)), symkv.InvalidArgument),
                 (lambda: comm.allreduce(np.zeros(4, np.float32), out=np.zeros(5, np.float32)),
                  symkv.InvalidArgument),
                 (lambda: comm.allreduce(np.zeros(4, np.float32), op="avg"), symkv.InvalidArgument),
                 (lambda: comm.allreduce(np.zeros(4, np.float32), stream=1), symkv.InvalidArgument),
                 (lambda: comm.signal(n + 5, 0, 1), symkv.Error),
                 (lambda: comm.signal(0, comm.signal_slots, 1), symkv.Error),
                 (lambda: comm.signal(0, -1, 1), symkv.InvalidArgument)]:
    try:
        bad()
    except exc as e:
        assert e.code in (symkv.InvalidArgument.code, symkv.OutOfRange.code), e
    else:
        raise AssertionError("bad input accepted")
comm.barrier()

# checking mode: matching calls pass; the last PE reducing with another op fails on every PE
chk = ctx.comm(backend="host", nccl=False, checked=True)
x = np.ones(100, np.float32)
assert (chk.allreduce(x) == n).all()
try:
    chk.allreduce(x, op="max" if rank == n - 1 else "sum")
except symkv.CollectiveMismatch as e:
    assert "checking mode" in str(e) and ("max" in str(e) and "sum" in str(e)), e
else:
    raise AssertionError("a mismatched op went unnoticed in checking mode")
chk.close()
ctx.close()
assert comm.closed
print("OK", rank)
