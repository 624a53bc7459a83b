"""symkv.connector: on one PE (keys, errors) and on four PEs through the launcher; the worked
example of docs/connector.md runs as written."""
import hashlib
import os
import re

import numpy as np
import pytest

import symkv
from symkv.connector import KVConnector
from conftest import REPO, run_pes


def test_connector_on_four_pes(pes):
    r = pes(4, "pe_connector.py")
    assert r.ok(), r


def _example():
    path = os.path.join(REPO, "docs", "connector.md")
    if not os.path.exists(path):
        pytest.skip("docs/connector.md not found")
    text = open(path).read()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks, "docs/connector.md has no python example"
    m = re.search(r"symkv-run -n (\d+)", text)
    return blocks[0], int(m.group(1)) if m else 2


def test_docs_worked_example_runs(tmp_path):
    code, n = _example()
    script = tmp_path / "connector_example.py"
    script.write_text(code)
    r = run_pes(n, str(script))
    assert r.rc == 0, r
    for rank in range(n):
        assert any("loaded" in l or "saved" in l for l in r.lines(rank)), r


def test_single_pe_behaviour(ctx):
    caches = [np.zeros((2, 16, 4, 1, 8), np.float32) for _ in range(2)]
    with KVConnector.create(ctx, caches, model="m", pages_per_pe=8, page_tokens=8) as conn:
        assert conn.page_tokens == 8 and conn.block_size == 4
        toks = list(range(24))
        for l, c in enumerate(caches):
            c[:] = np.arange(c.size, dtype=np.float32).reshape(c.shape) + l
        table = list(range(6))
        assert conn.save(table, toks) == 3
        assert conn.num_matched_tokens(toks) == 24
        assert conn.num_matched_tokens(toks, max_tokens=23) == 23
        assert conn.num_matched_tokens(toks, num_computed_tokens=30) == 0
        before = [c.copy() for c in caches]
        assert conn.load(list(range(10, 16)), toks) == 24
        for b, c in zip(before, caches):
            assert (c[:, 10:16] == b[:, 0:6]).all()
        with pytest.raises(symkv.InvalidArgument, match="exactly one of tokens or block_hashes"):
            conn.keys()
        with pytest.raises(symkv.InvalidArgument, match="exactly one"):
            conn.keys(toks, block_hashes=[b"x"])
        with pytest.raises(symkv.InvalidArgument, match=r"block_hashes\[1\]"):
            conn.keys(block_hashes=[1.5, 2.5])
        with pytest.raises(symkv.InvalidArgument, match="not several"):
            conn.num_matched_tokens(toks, keys=conn.keys(toks))
        # a (1, n) batch of one is the request's tokens; a (k, n) batch is refused
        assert (conn.keys(np.array([toks])) == conn.keys(toks)).all()
        assert conn.num_matched_tokens(np.array([toks])) == 24
        with pytest.raises(symkv.InvalidArgument, match="is not one sequence"):
            conn.num_matched_tokens(np.array(toks).reshape(3, 8))
        with pytest.raises(symkv.InvalidArgument, match="negative block id"):
            conn.save([-1, 0, 1, 2, 3, 4], toks)
        # block hash kinds: bytes, str, int, objects with .hash_value
        hs = [hashlib.sha256(bytes([i])).digest() for i in range(4)]

        class BH:
            def __init__(self, v):
                self.hash_value = v
        k1 = conn.keys(block_hashes=hs)
        assert (conn.keys(block_hashes=[BH(h) for h in hs]) == k1).all()
        assert len(conn.keys(block_hashes=[1, -2, 3, 4 << 200])) == 2
        assert len(conn.keys(block_hashes=["a", "b", "c"])) == 1
    assert conn.kv.closed and conn.layout.closed and conn.namespace.closed


def test_scheduler_side_without_a_layout(ctx):
    g = symkv.Geometry(num_layers=1, num_kv_heads=1, head_dim=8, page_tokens=4, elem_bytes=2)
    kv = ctx.kv_cache(g, 4)
    ns = symkv.Namespace("m", g)
    conn = KVConnector(kv, ns)
    assert conn.num_matched_tokens(list(range(8))) == 0
    with pytest.raises(symkv.InvalidState, match="register_kv_caches"):
        conn.load([0, 1], list(range(8)))
    with pytest.raises(symkv.InvalidState, match="block size"):
        conn.keys(block_hashes=[b"a"])
    lay = conn.register_kv_caches([np.zeros((2, 4, 2, 1, 8), np.float16)])
    assert conn.block_size == 2 and lay.blocks_per_page == 2
    with pytest.raises(symkv.InvalidArgument, match="geometry"):
        KVConnector(kv, symkv.Namespace("m", symkv.Geometry(2, 1, 8, 4, elem_bytes=2)))
    with pytest.raises(symkv.InvalidArgument, match="KVCache"):
        KVConnector(ns, ns)
    conn.close()   # closes only what it made (the layout)
    assert lay.closed and not kv.closed
    kv.close()
