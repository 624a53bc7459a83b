"""The elastic domain from Python (symkv.attach): owners and readers in separate processes that
attach and detach whenever they like, every fetched byte checked; refusals; nothing left in
/dev/shm. The protocol's heavy tests (kill -9, churn) are tests/test_domain.c."""
import os
import subprocess
import sys

import numpy as np
import pytest

import symkv
from conftest import PKG

G = dict(num_layers=2, num_kv_heads=2, head_dim=32, page_tokens=16, dtype="bf16")


def _name(what):
    return "py%d-%s" % (os.getpid(), what)


def _gone(name):
    return not os.path.exists("/dev/shm/symkv-" + name)


def _setup(n=8, seed=0):
    g = symkv.Geometry(**G)
    ns = symkv.Namespace("m", g, salt=b"py")
    keys = ns.hash_tokens(np.arange(16 * n, dtype=np.uint32) + seed)
    data = np.random.default_rng(seed).integers(0, 256, (n, g.page_bytes), dtype=np.uint8)
    return g, ns, keys, data


def test_owner_and_reader_in_another_process():
    name = _name("two")
    g, ns, keys, data = _setup()
    lay = symkv.Layout.preset(g, "contiguous", 16, len(keys), [data])
    with symkv.attach(name, g, pages_per_pe=64) as owner:
        assert owner.role == "owner" and not owner.closed
        owner.publish(ns, keys, lay, np.arange(len(keys)))
        code = """
import numpy as np, symkv
g = symkv.Geometry(**%r)
ns = symkv.Namespace("m", g, salt=b"py")
keys = ns.hash_tokens(np.arange(16 * 8, dtype=np.uint32))
want = np.random.default_rng(0).integers(0, 256, (8, g.page_bytes), dtype=np.uint8)
with symkv.attach(%r, g, role="reader") as r:
    hits = r.lookup(ns, keys, pin=True)
    out = np.zeros_like(want)
    r.fetch(hits, symkv.Layout.preset(g, "contiguous", 16, 8, [out]), np.arange(8), unpin=True)
    assert hits.nhit == 8 and (out == want).all(), hits.nhit
    try:
        r.publish(ns, keys[:1], symkv.Layout.preset(g, "contiguous", 16, 8, [out]), [0])
        raise SystemExit("a reader published")
    except symkv.InvalidState:
        pass
print("ok")
""" % (G, name)
        r = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=PKG),
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and r.stdout.strip() == "ok", r
    assert owner.closed and _gone(name)


def test_detach_is_idempotent_and_closed_handles_refuse():
    name = _name("close")
    g, ns, keys, _ = _setup()
    kv = symkv.attach(name, g)
    kv.detach()
    kv.close()
    with pytest.raises(symkv.InvalidState):
        kv.lookup(ns, keys)
    assert _gone(name)


def test_refusals_name_the_difference():
    name = _name("refuse")
    g, ns, keys, _ = _setup()
    with symkv.attach(name, g, pages_per_pe=32):
        other = symkv.Geometry(num_layers=3, num_kv_heads=2, head_dim=32, page_tokens=16,
                               dtype="bf16")
        with pytest.raises(symkv.InvalidArgument, match="another geometry"):
            symkv.attach(name, other, role="reader")
        with pytest.raises(symkv.InvalidArgument, match="pages"):
            symkv.attach(name, g, pages_per_pe=64)
        with pytest.raises(symkv.InvalidArgument):
            symkv.attach("bad/name", g)
        with pytest.raises(symkv.InvalidArgument, match="role"):
            symkv.attach(name, g, role="writer")
    assert _gone(name)


def test_a_namespace_pins_the_domain():
    name = _name("ns")
    g, ns, keys, _ = _setup()
    other = symkv.Namespace("another-model", g)
    with symkv.attach(name, g, namespace=ns):
        with pytest.raises(symkv.InvalidArgument, match="namespace"):
            symkv.attach(name, g, role="reader", namespace=other)
        with symkv.attach(name, g, role="reader", namespace=ns) as r:
            assert r.lookup(ns, keys).nhit == 0
    assert _gone(name)


def test_connector_attach_owner_scheduler_and_second_worker():
    """KVConnector.attach: a worker saves pages of a request; a scheduler process (a reader,
    no KV caches) counts the tokens the node holds; a worker in a third process loads them
    into poisoned blocks, every element checked. Nothing collective, nothing left behind."""
    from symkv.connector import KVConnector
    name = _name("conn")
    caches = [np.random.default_rng(l).standard_normal((2, 16, 4, 1, 8)).astype(np.float32)
              for l in range(2)]
    toks = list(range(100, 124))
    with KVConnector.attach(name, caches, model="m", pages_per_pe=16, page_tokens=8) as w:
        assert w.kv.role == "owner" and w.block_size == 4
        assert w.save([3, 4, 5, 6, 7, 8], toks) == 3
        code = """
import numpy as np, symkv
from symkv.connector import KVConnector
toks = list(range(100, 124))
g = symkv.Geometry(num_layers=2, num_kv_heads=1, head_dim=8, page_tokens=8, dtype="float32")
with KVConnector.attach(%r, geometry=g, model="m", role="reader") as s:
    assert s.num_matched_tokens(toks) == 24 and s.num_matched_tokens(toks, max_tokens=23) == 23
    assert s.num_matched_tokens(list(range(24))) == 0
want = [np.random.default_rng(l).standard_normal((2, 16, 4, 1, 8)).astype(np.float32)
        for l in range(2)]
mine = [np.full_like(c, np.nan) for c in want]
with KVConnector.attach(%r, mine, model="m", page_tokens=8) as w2:  # the domain's pages
    assert w2.load([10, 11, 12, 13, 14, 15], toks) == 24
for a, b in zip(mine, want):
    assert (a[:, 10:16] == b[:, 3:9]).all() and np.isnan(a[:, :10]).all()
print("ok")
""" % (name, name)
        r = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=PKG),
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and r.stdout.strip() == "ok", r
    assert w.kv.closed and w.namespace.closed and w.layout.closed and _gone(name)
