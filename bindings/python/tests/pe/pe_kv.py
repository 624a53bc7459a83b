"""Run on 4 PEs: publish on one PE, lookup + fetch on the others (numpy arrays, every layout
kind, byte for byte), dedup, pins against eviction, stale references, heap peers, host
collectives and the store."""
import numpy as np

import symkv

ctx = symkv.init()
rank, n = ctx.rank, ctx.world_size
assert n >= 2, "run on 2 PEs or more"

# ---- host collectives and the store ---------------------------------------------------------
assert ctx.allgather(bytes([rank]) * 3) == [bytes([r]) * 3 for r in range(n)]
got = ctx.allgather(np.array([rank, rank * 10], dtype=np.int64))
assert got.shape == (n, 2) and (got[:, 1] == np.arange(n) * 10).all()
buf = np.full(4, rank, dtype=np.int32)
ctx.broadcast(buf, root=n - 1)
assert (buf == n - 1).all()
assert ctx.broadcast(b"hello" if rank == 1 else b"xxxxx", root=1) == b"hello"
ctx.store_set("py/%d" % rank, b"value of %d" % rank)
ctx.store_wait(["py/%d" % r for r in range(n)])
assert ctx.store_get("py/%d" % ((rank + 1) % n)) == b"value of %d" % ((rank + 1) % n)
ctx.store_add("py/count", 1)
ctx.barrier()
assert ctx.store_add("py/count", 0) == n

# ---- symmetric heap: every PE's segment through symmetric addresses ------------------------
with ctx.heap(1 << 16) as heap:
    assert heap.npes == n and heap.my_pe == rank
    heap.array(np.int64, (8,))[:] = rank * 100 + np.arange(8)
    ctx.barrier()
    for p in range(n):
        assert (heap.array(np.int64, (8,), pe=p) == p * 100 + np.arange(8)).all()
    assert heap.ptr(1) - heap.ptr(0) == heap.info.stride
    ctx.barrier()
assert heap.closed

# ---- KV: every layout kind ------------------------------------------------------------------
KINDS = ["vllm_flash_nhd", "vllm_flash_hnd", "flashinfer_nhd", "flashinfer_hnd", "contiguous"]
L, H, D, T, NB = 3, 2, 16, 4, 24
for kind_i, kind in enumerate(KINDS):
    for dtype in (np.float16, np.float32):
        g = symkv.Geometry(num_layers=L, num_kv_heads=H, head_dim=D, page_tokens=2 * T,
                           dtype=dtype)
        shape = symkv.layer_shape(g, kind, T, NB)
        nlay = 1 if kind == "contiguous" else L
        with ctx.kv_cache(g, pages_per_pe=16) as kv, \
                symkv.Namespace("test-model", g, salt=kind) as ns:
            seed = 1000 * kind_i + np.dtype(dtype).itemsize
            src = [np.random.default_rng(seed + l).standard_normal(shape).astype(dtype)
                   for l in range(nlay)]
            tokens = np.arange(5 * 2 * T + 3, dtype=np.uint32) * 7 + seed  # 5 full pages
            keys = ns.hash_tokens(tokens)
            assert len(keys) == 5
            src_blocks = np.array([3, 4, 10, 11, 0, 1, 20, 21, 7, 8], dtype=np.uint64)
            if rank == 0:
                lay = symkv.Layout.from_tensors(g, src, kind)
                assert kv.publish(ns, keys, lay, src_blocks) == 5
                assert kv.publish(ns, keys, lay, src_blocks) == 0  # cached already
                lay.close()
            ctx.barrier()
            dst = [np.zeros(shape, dtype) for _ in range(nlay)]
            lay = symkv.Layout.from_tensors(g, dst, kind)
            with kv.lookup(ns, keys, pin=True) as hit:
                assert hit.nhit == 5, hit
                assert (hit.refs[:, 0] == 0).all()  # PE 0 owns them
                dst_blocks = np.array([5, 6, 12, 13, 2, 9, 22, 23, 14, 15], dtype=np.uint64)
                kv.fetch(hit, lay, dst_blocks, unpin=True)
                assert not hit.pinned
            # byte for byte: block dst_blocks[j] of every layer (and K/V) = src block src_blocks[j]
            for l in range(nlay):
                for s, d in zip(src_blocks, dst_blocks):
                    if kind.startswith("vllm"):
                        a, b = src[l][:, s], dst[l][:, d]
                    else:
                        a, b = src[l][s], dst[l][d]
                    assert a.tobytes() == b.tobytes(), (kind, dtype, l, s, d)
            st = kv.stats()
            assert st.index_entries == 5 and st.lookup_hits == 5
            ctx.barrier()
            lay.close()

# MLA
g = symkv.Geometry(num_layers=2, num_kv_heads=1, head_dim=72, page_tokens=4, elem_bytes=2,
                   kv_kind="mla")
with ctx.kv_cache(g, pages_per_pe=8) as kv, symkv.Namespace("mla-model", g) as ns:
    src = [np.random.default_rng(7 + l).integers(0, 1 << 16, (10, 4, 72), dtype=np.uint16)
           for l in range(2)]
    keys = ns.hash_tokens(np.arange(12) + 5)
    if rank == n - 1:
        assert kv.publish(ns, keys, symkv.Layout.from_tensors(g, src, "mla"), [9, 8, 7]) == 3
    ctx.barrier()
    dst = [np.zeros_like(s) for s in src]
    hit = kv.lookup(ns, keys)
    assert hit.nhit == 3 and (hit.refs[:, 0] == n - 1).all()
    kv.fetch(hit, symkv.Layout.from_tensors(g, dst, "mla"), [0, 1, 2])
    for l in range(2):
        assert dst[l][[0, 1, 2]].tobytes() == src[l][[9, 8, 7]].tobytes()
    ctx.barrier()

# ---- every PE publishes, everyone reads everyone; dedup; pins; stale refs -------------------
g = symkv.Geometry(num_layers=2, num_kv_heads=2, head_dim=8, page_tokens=4, elem_bytes=4)
kv = ctx.kv_cache(g, pages_per_pe=8)
ns = symkv.Namespace("m", g)
shape = symkv.layer_shape(g, "flashinfer", 4, 16)
mine = [np.full(shape, rank + 1 + l / 10, np.float32) for l in range(2)]
lay_mine = symkv.Layout.from_tensors(g, mine, "flashinfer")
keys_of = [ns.hash_tokens(np.arange(8) + 100 * r) for r in range(n)]
assert kv.publish(ns, keys_of[rank], lay_mine, [0, 1]) == 2
common = ns.hash_tokens(np.arange(4) + 99999)
ins = kv.publish(ns, common, lay_mine, [2])   # every PE tries the same key: one wins
ctx.barrier()
assert sum(ctx.allgather(bytes([ins]))[r][0] for r in range(n)) == 1
st = kv.stats()
assert st.index_entries == 2 * n + 1, st
dst = [np.zeros(shape, np.float32) for _ in range(2)]
lay_dst = symkv.Layout.from_tensors(g, dst, "flashinfer")
for r in range(n):
    hit = kv.lookup(ns, keys_of[r])
    assert hit.nhit == 2 and (hit.refs[:, 0] == r).all(), hit.refs
    kv.fetch(hit.refs, lay_dst, [5, 6])
    assert (dst[1][5:7] == np.float32(r + 1.1)).all()
ctx.barrier()

# Stale: PE 1 keeps an unpinned reference to PE 0's page, PE 0 evicts, the fetch fails.
hit = kv.lookup(ns, keys_of[0]) if rank == 1 else None
ctx.barrier()
if rank == 0:
    assert kv.evict(100) >= 2
ctx.barrier()
if rank == 1:
    try:
        kv.fetch(hit, lay_dst, [5, 6])
    except symkv.StaleReference as e:
        assert e.code == symkv.StaleReference.code and e.name == "SKV_ESTALE" and "stale" in str(e), e
    else:
        raise AssertionError("fetch of an evicted page did not raise StaleReference")
ctx.barrier()
# Pinned pages survive eviction.
if rank == 0:
    kv.publish(ns, keys_of[0], lay_mine, [0, 1])
ctx.barrier()
pinned = kv.lookup(ns, keys_of[0], pin=True) if rank == 1 else None
ctx.barrier()
if rank == 0:
    kv.evict(100)
ctx.barrier()
if rank == 1:
    assert pinned.nhit == 2
    kv.fetch(pinned, lay_dst, [5, 6], unpin=True)
    assert (dst[0][5:7] == np.float32(1.0)).all()
ctx.barrier()
ctx.close()
assert kv.closed and ctx.closed
print("OK", rank)
