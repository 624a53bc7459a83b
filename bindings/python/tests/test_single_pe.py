"""One PE in this process: context, store, heap views, the KV cache's publish / lookup / fetch
/ evict / stats with numpy arrays, and bad input on each binding."""
import errno
import logging
import os
import subprocess
import sys
import time

import numpy as np
import pytest

import symkv
from conftest import PKG, single_pe_config, torch_or_skip


def test_context(ctx):
    assert (ctx.rank, ctx.world_size, ctx.local_rank, ctx.local_size) == (0, 1, 0, 1)
    assert ctx.timeout_ms == 20000
    ctx.timeout_ms = 15000
    assert ctx.timeout_ms == 15000
    with pytest.raises(symkv.InvalidArgument, match="0 ms is not in 1..86400000"):
        ctx.timeout_ms = 0
    ctx.barrier()
    symkv.barrier(ctx)
    assert ctx.allgather(b"xy") == [b"xy"]
    a = ctx.allgather(np.arange(6, dtype=np.int16).reshape(2, 3))
    assert a.shape == (1, 2, 3) and a.dtype == np.int16
    assert ctx.broadcast(b"abc") == b"abc"
    buf = np.arange(4.0)
    assert ctx.broadcast(buf) is buf
    with pytest.raises(symkv.InvalidArgument, match="root 1 is not a rank"):
        ctx.broadcast(b"abc", root=1)
    with pytest.raises(symkv.InvalidArgument, match="1..16777216 bytes"):
        ctx.allgather(b"")
    if symkv.version_string().endswith("(host only)"):
        with pytest.raises(symkv.NotSupported, match="without CUDA"):
            ctx.device
    assert "rank 0 of 1" in repr(ctx)


def test_store(ctx):
    ctx.store_set("a", b"1")
    ctx.store_set("big", bytes(range(256)) * 1000)  # > the first 64 KiB try
    assert ctx.store_get("a") == b"1"
    assert ctx.store_get("big") == bytes(range(256)) * 1000
    assert ctx.store_add("n", 5) == 5 and ctx.store_add("n", -2) == 3
    ctx.store_wait("a", "big")
    ctx.store_wait(["a"])
    with pytest.raises(symkv.InvalidArgument, match="key length 300"):
        ctx.store_set("k" * 300, b"")
    for bad in (5, 0, True):  # bytes(5) would store five zero bytes
        with pytest.raises(symkv.InvalidArgument, match="an int"):
            ctx.store_set("i", bad)
        with pytest.raises(symkv.InvalidArgument, match="an int"):
            ctx.allgather(bad)
        with pytest.raises(symkv.InvalidArgument, match="an int"):
            ctx.broadcast(bad)
    with pytest.raises(symkv.InvalidArgument, match="an int"):
        ctx.store_get(7)
    ctx.timeout_ms = 300
    with pytest.raises(symkv.Timeout) as ei:
        ctx.store_get("never-set")
    assert ei.value.code == -errno.ETIMEDOUT and "never-set" in str(ei.value)


def test_heap(ctx):
    with ctx.heap(1 << 16, signal_bytes=4096) as h:
        i = h.info
        assert i.data_bytes == 1 << 16 and i.npes == 1 and i.my_pe == 0 and i.backend == 1
        assert i.signal_bytes == 4096 and i.data_offset % 4096 == 0
        assert h.backend == "host" and h.data_bytes == 1 << 16
        a = h.array(np.int32, (100,))
        a[:] = np.arange(100)
        assert (h.array(np.int32, (10,), offset=40) == np.arange(10, 20)).all()
        assert h.array().nbytes == 1 << 16 and h.array(area="signal").nbytes == 4096
        assert h.ptr(0, i.data_offset) == a.__array_interface__["data"][0]
        assert a.base is not None
        with pytest.raises(symkv.OutOfRange, match="outside"):
            h.array(np.uint8, (1 << 17,))
        with pytest.raises(symkv.InvalidArgument, match="area"):
            h.array(area="nope")
        with pytest.raises(symkv.OutOfRange):
            h.ptr(1)
    assert h.closed
    with pytest.raises(symkv.InvalidState, match="heap is closed"):
        h.array()
    with pytest.raises(symkv.InvalidArgument, match="data_bytes=0"):
        ctx.heap(0)
    with pytest.raises(symkv.InvalidArgument, match="backend 'gpu'"):
        ctx.heap(4096, backend="gpu")
    with pytest.raises(symkv.InvalidArgument, match="out of range"):
        ctx.heap(-5)


G = dict(num_layers=2, num_kv_heads=2, head_dim=16, page_tokens=8, elem_bytes=2)


def test_publish_lookup_fetch(ctx):
    g = symkv.Geometry(**G)
    with ctx.kv_cache(g, pages_per_pe=8) as kv, symkv.Namespace("m", g) as ns:
        src = [np.random.default_rng(l).standard_normal((2, 20, 4, 2, 16)).astype(np.float16)
               for l in range(2)]
        lay = symkv.Layout.from_tensors(g, src, "vllm_flash")
        tokens = np.arange(35)
        keys = symkv.hash_tokens(ns, tokens)
        assert len(keys) == 4
        ids = np.arange(8) + 10
        assert symkv.publish(kv, ns, keys[:2], lay, ids[:4]) == 2
        assert kv.publish(ns, keys, lay, ids) == 2  # two new ones
        st = kv.stats()
        assert st.published == 4 and st.pages_used == 4 and st.page_bytes == g.page_bytes
        hit = symkv.lookup(kv, ns, keys)
        assert hit.nhit == 4 and not hit.pinned and hit.refs.shape == (4, 4)
        dst = [np.zeros_like(s) for s in src]
        dlay = symkv.Layout.from_tensors(g, dst, "vllm_flash")
        out_ids = [19, 18, 17, 16, 15, 14, 13, 12]
        assert symkv.fetch(kv, hit, dlay, out_ids) == 4
        for l in range(2):
            for a, b in zip(ids, out_ids):
                assert src[l][:, a].tobytes() == dst[l][:, b].tobytes()
        # a miss in the middle stops the chain
        other = ns.hash_tokens(np.arange(8) + 1000)
        assert kv.lookup(ns, np.concatenate([keys[:1], other, keys[1:]])).nhit == 1
        # pins
        with kv.lookup(ns, keys, pin=True) as p:
            assert p.pinned and kv.stats().pages_pinned == 4
            assert kv.evict(10) == 0
        assert not p.pinned and kv.stats().pages_pinned == 0
        p2 = kv.lookup(ns, keys[:1], pin=True)
        kv.unpin(p2)
        assert not p2.pinned
        assert kv.evict(1) == 1
        kv.sync()
        assert kv.lookup(ns, keys).nhit < 4 and kv.stats().evicted == 1
        assert kv.heap.backend == "host" and kv.heap.npes == 1
        # the heap view is not an owner
        kv.heap.close()
        assert not kv.closed
    assert kv.closed and ns.closed
    with pytest.raises(symkv.InvalidState, match="KV cache is closed"):
        kv.stats()


def test_kv_bad_input(ctx):
    g = symkv.Geometry(**G)
    kv = ctx.kv_cache(g, pages_per_pe=4)
    ns = symkv.Namespace("m", g)
    lay = symkv.Layout.from_tensors(g, [np.zeros((2, 8, 4, 2, 16), np.float16)
                                        for _ in range(2)])
    keys = ns.hash_tokens(np.arange(16))
    g2 = symkv.Geometry(**dict(G, num_layers=1))
    ns2 = symkv.Namespace("m", g2)
    cases = [
        (lambda: kv.publish(ns, keys, lay, [0, 1, 2]), symkv.InvalidArgument,
         "block_ids has 3 entries; this call needs exactly 4"),
        (lambda: kv.publish(ns, keys, lay, [0, 1, 2, 99]), symkv.Error, "99"),
        (lambda: kv.publish(ns, keys, lay, [0, 1, 2, -1]), symkv.InvalidArgument, "out of range"),
        (lambda: kv.publish(ns2, keys, lay, [0, 1, 2, 3]), symkv.InvalidArgument,
         "wrong namespace"),
        (lambda: kv.publish("ns", keys, lay, [0, 1, 2, 3]), symkv.InvalidArgument,
         "expected a symkv.Namespace"),
        (lambda: kv.publish(ns, [(0, 1)], lay, [0, 1]), symkv.InvalidArgument, "hi == 0"),
        (lambda: kv.publish(ns, np.zeros((2, 3), np.uint64), lay, [0]), symkv.InvalidArgument,
         r"not \(n, 2\)"),
        (lambda: kv.lookup(ns, ["xyz"]), symkv.InvalidArgument, "32 hex digits"),
        (lambda: kv.lookup(ns, [1 << 130]), symkv.InvalidArgument, "128-bit"),
        (lambda: kv.fetch([[5, 0, 1, 0]], lay, [0, 1]), symkv.OutOfRange, "names PE 5"),
        (lambda: kv.fetch([[0, 99, 1, 0]], lay, [0, 1]), symkv.OutOfRange, "page 99"),
        (lambda: kv.fetch([[0, 0, 0, 0]], lay, [0, 1]), symkv.InvalidArgument, "generation 0"),
        (lambda: kv.fetch([[0, 0, 7, 0]], lay, [0, 1]), symkv.StaleReference, "stale"),
        (lambda: kv.fetch([[0, 0, 1]], "layout", [0, 1]), symkv.InvalidArgument,
         "expected a symkv.Layout"),
        (lambda: kv.fetch([[0, 0, 1, 0, 0]], lay, [0, 1]), symkv.InvalidArgument, r"\(n, 4\)"),
        (lambda: kv.evict(-1), symkv.InvalidArgument, "npages=-1"),
        (lambda: ctx.kv_cache(g, pages_per_pe=0), symkv.InvalidArgument, "pages_per_pe=0"),
        (lambda: ctx.kv_cache(g, 4, backend=7), symkv.InvalidArgument, "backend=7"),
    ]
    for call, exc, match in cases:
        with pytest.raises(exc, match=match) as ei:
            call()
        assert ei.value.code == exc.code if exc is not symkv.Error else ei.value.code < 0
    ro = [np.zeros((2, 8, 4, 2, 16), np.float16) for _ in range(2)]
    for a in ro:
        a.flags.writeable = False
    rolay = symkv.Layout.from_tensors(g, ro)
    kv.publish(ns, keys, rolay, [0, 1, 2, 3])
    with pytest.raises(symkv.InvalidArgument, match="read-only"):
        kv.fetch(kv.lookup(ns, keys), rolay, [0, 1, 2, 3])
    if symkv.version_string().endswith("(host only)"):
        glay = symkv.Layout.preset(g, "vllm_flash", 4, 8, [1 << 20, 1 << 21], device=0)
        with pytest.raises(symkv.NotSupported):
            kv.fetch(kv.lookup(ns, keys), glay, [0, 1, 2, 3])
        with pytest.raises(symkv.NotSupported):
            ctx.kv_cache(g, 4, backend="cuda")
    kv.close()
    kv.close()



def test_free_reserve_is_evicted_ahead(ctx):
    """set_free_reserve: after a publish into a full pool, the helper thread frees the reserve
    (the least recently used pages) without another call; 0 stops it; bad values are refused."""
    g = symkv.Geometry(**G)
    with ctx.kv_cache(g, pages_per_pe=8) as kv, symkv.Namespace("r", g) as ns:
        lay = symkv.Layout.from_tensors(g, [np.ones((2, 16, 4, 2, 16), np.float16)
                                            for _ in range(2)], "vllm_flash")
        with pytest.raises(symkv.InvalidArgument, match="over half"):
            kv.set_free_reserve(5)
        with pytest.raises(symkv.InvalidArgument, match="npages=-1"):
            kv.set_free_reserve(-1)
        first, second = ns.hash_tokens(np.arange(8 * 8)), ns.hash_tokens(np.arange(4 * 8) + 999)
        assert kv.publish(ns, first, lay, np.arange(16)) == 8 and kv.stats().pages_used == 8
        assert kv.free_reserve == 0
        kv.set_free_reserve(2)
        assert kv.free_reserve == 2 and kv.publish(ns, second, lay, np.arange(8)) == 4
        one_cpu = hasattr(os, "sched_getaffinity") and len(os.sched_getaffinity(0)) < 2
        off = os.environ.get("SKV_PUBLISH_HELPER") == "0"
        want = 8 if one_cpu or off else 6  # the helper: on, with a second CPU
        for _ in range(5000):
            if kv.stats().pages_used == want:
                break
            time.sleep(0.001)
        st = kv.stats()
        assert st.pages_used == want and st.evicted == 4 + (8 - want)
        assert kv.lookup(ns, second).nhit == 4  # the newest stay
        kv.set_free_reserve(0)
        assert kv.publish(ns, ns.hash_tokens(np.arange(2 * 8) + 5000), lay, np.arange(4)) == 2
        time.sleep(0.02)
        assert kv.stats().pages_used == min(8, want + 2)


def test_fetch_into_read_only_preset_and_custom_layouts(ctx):
    # preset / custom layouts over read-only arrays are refused by fetch like from_tensors ones
    # (fetch used to write into the memory of an immutable bytes object).
    g = symkv.Geometry(num_layers=1, num_kv_heads=1, head_dim=8, page_tokens=4, elem_bytes=1)
    shape = symkv.layer_shape(g, "vllm_flash", 4, 2)
    kv = ctx.kv_cache(g, pages_per_pe=4)
    ns = symkv.Namespace("m", g)
    keys = ns.hash_tokens([1, 2, 3, 4])
    kv.publish(ns, keys, symkv.Layout.from_tensors(g, [np.full(shape, 7, np.uint8)]), [0])
    blob = bytes(int(np.prod(shape)))
    ro = np.frombuffer(blob, np.uint8).reshape(shape)
    base = ro.ctypes.data
    layouts = [symkv.Layout.preset(g, "vllm_flash", 4, 2, [ro]),
               symkv.Layout.preset(g, "vllm_flash", 4, 2, [base], keep=(ro,)),
               symkv.Layout.custom(g, 4, 2, [base], [base + 2 * 4 * 8], 4 * 8, 8, 8,
                                   keep=(ro,))]
    for lay in layouts:
        assert not lay.writable
        with pytest.raises(symkv.InvalidArgument, match="read-only"):
            kv.fetch(kv.lookup(ns, keys), lay, [1])
    assert blob.count(7) == 0
    rw = np.zeros(shape, np.uint8)
    for lay in (symkv.Layout.preset(g, "vllm_flash", 4, 2, [rw]),
                symkv.Layout.custom(g, 4, 2, [rw.ctypes.data], [rw.ctypes.data + 64], 32, 8, 8,
                                    keep=(rw,))):
        assert lay.writable and kv.fetch(kv.lookup(ns, keys), lay, [1]) == 1
    assert (rw[:, 1] == 7).all()
    kv.close()


def test_unpin_needs_a_lookup_that_holds_pins(ctx):
    # An unpinned Lookup must not release pins that another request of this PE holds.
    g = symkv.Geometry(num_layers=1, num_kv_heads=1, head_dim=8, page_tokens=4, elem_bytes=1)
    shape = symkv.layer_shape(g, "vllm_flash", 4, 4)
    eng = np.full(shape, 7, np.uint8)
    lay = symkv.Layout.from_tensors(g, [eng], "vllm_flash")
    kv = ctx.kv_cache(g, pages_per_pe=4)
    ns = symkv.Namespace("m", g)
    keys = ns.hash_tokens([1, 2, 3, 4])
    kv.publish(ns, keys, lay, [0])
    a = kv.lookup(ns, keys, pin=True)
    b = kv.lookup(ns, keys, pin=False)
    with pytest.raises(symkv.InvalidState, match="holds no pins"):
        kv.fetch(b, lay, [1], unpin=True)
    with pytest.raises(symkv.InvalidState, match="holds no pins"):
        kv.unpin(b)
    assert kv.stats().pages_pinned == 1 and kv.evict(4) == 0
    assert kv.fetch(b, lay, [1]) == 1                    # without unpin: fine
    c = kv.lookup(ns, keys, pin=True)
    assert kv.fetch(c, lay, [2], unpin=True) == 1 and not c.pinned
    with pytest.raises(symkv.InvalidState, match="holds no pins"):
        kv.fetch(c, lay, [2], unpin=True)                # a second unpin of the same Lookup
    assert a.pinned and kv.stats().pages_pinned == 1 and kv.evict(4) == 0
    assert kv.fetch(a, lay, [3], unpin=True) == 1 and not a.pinned
    assert kv.stats().pages_pinned == 0
    empty = kv.lookup(ns, ns.hash_tokens([9, 9, 9, 9]), pin=True)
    assert kv.fetch(empty, lay, [], unpin=True) == 0     # no hits: nothing to unpin, no error
    kv.close()

def test_closing_the_context_closes_its_objects():
    c = symkv.init(**single_pe_config())
    h = c.heap(4096)
    g = symkv.Geometry(**G)
    kv = c.kv_cache(g, 2)
    assert c._children == [h, kv]
    c.close()
    assert h.closed and kv.closed and c.closed
    with pytest.raises(symkv.InvalidState, match="context is closed"):
        c.barrier()
    with pytest.raises(symkv.InvalidState):
        with c:
            pass


def test_context_manager_on_error_releases_and_keeps_the_error():
    with pytest.raises(RuntimeError, match="boom"):
        with symkv.init(**single_pe_config()) as c:
            c.heap(4096)
            raise RuntimeError("boom")
    assert c.closed


def test_log_lines_reach_logging(caplog):
    caplog.set_level(logging.INFO, logger="symkv")
    # A failure is the exception's message; it is logged (at INFO) only when asked for.
    with pytest.raises(symkv.InvalidArgument):
        symkv.Geometry(num_layers=0, num_kv_heads=1, head_dim=1, page_tokens=1, elem_bytes=1)
    assert not [r for r in caplog.records if r.name == "symkv"]
    symkv.log.set_level("INFO", ["KV", "INIT"])
    try:
        with pytest.raises(symkv.InvalidArgument):
            symkv.Geometry(num_layers=0, num_kv_heads=1, head_dim=1, page_tokens=1, elem_bytes=1)
        rec = [r for r in caplog.records if r.name == "symkv" and "num_layers=0" in r.getMessage()]
        assert rec and rec[0].levelno == logging.INFO and rec[0].symkv_subsys == "KV"
        symkv.log.message("INFO", "an info line", "INIT")
        assert caplog.records[-1].getMessage().endswith("an info line")
        assert caplog.records[-1].levelno == logging.INFO
        symkv.log.message("INFO", "filtered out", "BOOT")
        assert not caplog.records[-1].getMessage().endswith("filtered out")
    finally:
        symkv.log.set_level("WARN")
    with pytest.raises(symkv.InvalidArgument, match="unknown log subsystem"):
        symkv.log.set_level("INFO", ["GPU"])
    with pytest.raises(symkv.InvalidArgument, match="log level"):
        symkv.log.set_level("LOUD")
    symkv.log.use_python_logging(False)
    try:
        n = len(caplog.records)
        symkv.log.message("WARN", "to stderr")
        assert len(caplog.records) == n
    finally:
        symkv.log.use_python_logging(True)


def test_layer_by_layer_reserve_write_commit_and_fetch(ctx):
    """Layout.layers, reserve / write / commit / abort: keys appear only at commit; a layer
    fetch writes only its layer (the others stay poison); bad ranges and states are refused."""
    g = symkv.Geometry(num_layers=3, num_kv_heads=2, head_dim=16, page_tokens=8, elem_bytes=2)
    rng = np.random.default_rng()
    with ctx.kv_cache(g, pages_per_pe=8) as kv, symkv.Namespace("layers", g) as ns:
        src = [rng.standard_normal((2, 20, 4, 2, 16)).astype(np.float16) for _ in range(3)]
        lay = symkv.Layout.from_tensors(g, src, "vllm_flash")
        keys = ns.hash_tokens(np.arange(24))
        ids = np.array([3, 4, 9, 1, 17, 12])
        refs = kv.reserve(ns, keys)
        assert refs.shape == (3, 4) and (refs[:, 2] > 0).all()
        for l in range(3):
            part = lay.layers(l)
            assert part.first_layer == l and part.num_layers == 1 and "layers" in repr(part)
            kv.write(refs, part, ids)
            assert kv.lookup(ns, keys).nhit == 0  # not before the commit
        with pytest.raises(symkv.InvalidArgument, match="skv_kv_reserve"):
            kv.publish(ns, keys, lay.layers(0, 2), ids)
        assert kv.commit(ns, keys, refs) == 3
        with pytest.raises(symkv.InvalidState, match="reserved"):
            kv.write(refs, lay, ids)
        assert (kv.reserve(ns, keys)[:, 2] == 0).all()  # cached: nothing to write
        extra = ns.hash_tokens(np.arange(8) + 500)
        r2 = kv.reserve(ns, extra)
        used = kv.stats().pages_used
        kv.abort(r2)
        assert kv.stats().pages_used == used - 1 and kv.lookup(ns, extra).nhit == 0
        with pytest.raises(symkv.InvalidState):
            kv.abort(r2)
        dst = [np.full_like(s, np.nan) for s in src]
        dlay = symkv.Layout.from_tensors(g, dst, "vllm_flash")
        out = [19, 18, 17, 16, 15, 14]
        with kv.lookup(ns, keys, pin=True) as hit:
            kv.fetch(hit, dlay.layers(1), out)
            for l in range(3):
                for a, b in zip(ids, out):
                    if l == 1:
                        assert src[l][:, a].tobytes() == dst[l][:, b].tobytes()
                    else:
                        assert np.isnan(dst[l][:, b]).all()
            kv.fetch(hit, dlay.layers(0), out)
            kv.fetch(hit, dlay.layers(2), out)
        for l in range(3):
            for a, b in zip(ids, out):
                assert src[l][:, a].tobytes() == dst[l][:, b].tobytes()
        for first, n in ((3, 1), (0, 0), (2, 2)):
            with pytest.raises(symkv.InvalidArgument, match="range"):
                lay.layers(first, n)
        with pytest.raises(symkv.InvalidArgument, match="range"):
            lay.layers(1, 2).layers(0)


def test_torch_cpu_tensors_publish_fetch(ctx):
    torch = torch_or_skip()
    g = symkv.Geometry(**G)
    with ctx.kv_cache(g, pages_per_pe=4) as kv, symkv.Namespace("t", g) as ns:
        src = [torch.randn(6, 2, 4, 2, 16).to(torch.bfloat16) for _ in range(2)]
        dst = [torch.zeros_like(s) for s in src]
        keys = ns.hash_tokens(torch.arange(16))
        slay = symkv.Layout.from_tensors(g, src, "flashinfer")
        assert kv.publish(ns, keys, slay, [0, 1, 2, 3]) == 2
        kv.fetch(kv.lookup(ns, keys), symkv.Layout.from_tensors(g, dst, "flashinfer"), [5, 4, 3, 2])
        for s, d in zip(src, dst):
            assert torch.equal(d[[5, 4, 3, 2]], s[[0, 1, 2, 3]])
    with ctx.heap(4096) as h:
        t = h.tensor(torch.float32, (8,))
        t[:] = 3
        assert (h.array(np.float32, (8,)) == 3).all()


def test_a_caught_exception_leaves_no_stderr_line(tmp_path):
    """Issue 24: a failure is reported once, by the exception; nothing is printed on stderr
    unless a log level asked for it (then the INFO line is there)."""
    code = ("import symkv\n"
            "try:\n"
            "    symkv.Geometry(num_layers=0, num_kv_heads=1, head_dim=1, page_tokens=1,\n"
            "                   elem_bytes=1)\n"
            "except symkv.InvalidArgument as e:\n"
            "    print('caught', e.name)\n")
    env = dict(os.environ, PYTHONPATH=PKG)
    env.pop("SKV_DEBUG", None)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=60, cwd=str(tmp_path))
    assert r.returncode == 0 and r.stdout == "caught SKV_EINVAL\n", r
    assert r.stderr == "", r.stderr
    env["SKV_DEBUG"] = "INFO"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=60, cwd=str(tmp_path))
    assert r.returncode == 0 and "[INFO KV]" in r.stderr and "num_layers=0" in r.stderr, r
