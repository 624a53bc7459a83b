"""Run on 2+ PEs: context managers release what they hold. Heaps unmap their segments (no
memfd mapping left), closing a context closes what was made from it and finalizes (rank 0's
bootstrap server thread is gone), and the job can start a new context afterwards."""
import os
import threading

import numpy as np

import symkv


def memfds():
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if "memfd:symkv-heap" in line)


def threads():
    return len(os.listdir("/proc/self/task"))


t0, m0 = threads(), memfds()
with symkv.init() as ctx:
    rank = ctx.rank
    # The second context below needs its own store: reusing SKV_BOOTSTRAP would let ranks 1..
    # join the old store before rank 0 has stopped it.
    port = np.zeros(1, np.int64)
    if rank == 0:
        import socket
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port[0] = s.getsockname()[1]
        s.close()
    ctx.broadcast(port, root=0)
    if rank == 0:
        assert threads() > t0, "rank 0 should serve the bootstrap store on a thread"
    with ctx.heap(1 << 20) as heap:
        assert memfds() > m0
        view = heap.array(np.uint8, (16,))
        view[:] = 1
    assert heap.closed and memfds() == m0, (memfds(), m0)
    try:
        heap.ptr(0)
    except symkv.InvalidState as e:
        assert "closed" in str(e)
    else:
        raise AssertionError("a closed heap still answered")
    # Not closed explicitly: closing the context closes them, newest first.
    g = symkv.Geometry(num_layers=1, num_kv_heads=1, head_dim=64, page_tokens=16, elem_bytes=2)
    kv = ctx.kv_cache(g, pages_per_pe=4)
    heap2 = ctx.heap(1 << 16)
    assert memfds() > m0
assert ctx.closed and kv.closed and heap2.closed
assert memfds() == m0, (memfds(), m0)
if rank == 0:
    # The store server has stopped (its thread joined) once every PE left.
    assert threads() == t0, (threads(), t0)
assert not any(t.name.startswith("symkv") for t in threading.enumerate())

# A second context in the same processes: finalize left nothing behind.
ctx2 = symkv.init(bootstrap="tcp://127.0.0.1:%d" % port[0])
assert ctx2.rank == rank
ctx2.barrier()
ctx2.close()
ctx2.close()  # idempotent
print("OK", rank)
