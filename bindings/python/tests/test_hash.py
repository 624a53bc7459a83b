"""Keys: the pinned vectors of tests/test_hash.c (parsed from its generated block), the same
vectors from tests/vectors/gen_hash_vectors.py (PyPI xxhash), chains and bad input."""
import importlib.util
import os
import re

import numpy as np
import pytest

import symkv
from conftest import REPO

TEST_HASH_C = os.path.join(REPO, "tests", "test_hash.c")
GEN = os.path.join(REPO, "tests", "vectors", "gen_hash_vectors.py")


def c_string(lit):
    """The bytes of a C string literal body (printable ASCII and \\ooo / \\x escapes)."""
    out = bytearray()
    i = 0
    while i < len(lit):
        c = lit[i]
        if c != "\\":
            out.append(ord(c))
            i += 1
            continue
        m = re.match(r"[0-7]{1,3}", lit[i + 1:])
        if m:
            out.append(int(m.group(0), 8))
            i += 1 + len(m.group(0))
            continue
        out.append(ord({"n": "\n", "t": "\t", "\\": "\\", '"': '"', "?": "?"}[lit[i + 1]]))
        i += 2
    return bytes(out)


def pinned_vectors():
    if not os.path.exists(TEST_HASH_C):
        return []
    text = open(TEST_HASH_C).read()
    a = text.index("/* BEGIN GENERATED VECTORS")
    b = text.index("/* END GENERATED VECTORS */")
    block = text[a:b]
    arrays = {m.group(1): [int(x, 16) for x in re.findall(r"0x([0-9a-f]+)", m.group(2))]
              for m in re.finditer(r"static const uint32_t (\w+)\[\] = \{(.*?)\};", block, re.S)}
    vecs = []
    for m in re.finditer(r"\{\.name = (.*?)\.from_bytes = \"([0-9a-f]{32})\"\}", block, re.S):
        body = m.group(1)
        f = lambda k: re.search(r"\.%s = ([^,]+)," % k, body).group(1).strip()
        s = lambda k: c_string(re.search(r'\.%s = "((?:[^"\\]|\\.)*)"' % k, body).group(1))
        v = {"name": re.match(r'"([^"]*)"', body).group(1), "model": s("model"),
             "geom": [int(x) for x in re.search(r"\.geom = \{([^}]*)\}", body).group(1).split(",")],
             "salt": s("salt")[:int(f("salt_len"))], "secret": s("secret")[:int(f("secret_len"))],
             "ntokens": int(f("ntokens")), "fb_len": int(f("fb_len")),
             "fb_mul": int(f("fb_mul")), "fb_add": int(f("fb_add")),
             "ns_id": re.search(r'\.ns_id = "([0-9a-f]{32})"', body).group(1),
             "keys": re.findall(r'"([0-9a-f]{32})"', re.search(r"\.keys = \{(.*?)\}", body,
                                                                re.S).group(1)),
             "from_bytes": m.group(2)}
        if f("tokens") == "NULL":
            mul, add = int(f("tok_mul").rstrip("u")), int(f("tok_add").rstrip("u"))
            v["tokens"] = [(mul * i + add) % (1 << 32) for i in range(v["ntokens"])]
        else:
            v["tokens"] = arrays[f("tokens")]
        assert len(v["tokens"]) == v["ntokens"] and len(v["keys"]) == int(f("nkeys"))
        vecs.append(v)
    return vecs


VECTORS = pinned_vectors()


def make_ns(v):
    kind, layers, heads, dim, elem, page = v["geom"]
    g = symkv.Geometry(num_layers=layers, num_kv_heads=heads, head_dim=dim, elem_bytes=elem,
                       page_tokens=page, kv_kind=kind)
    return symkv.Namespace(v["model"], g, salt=v["salt"], secret=v["secret"] or None)


def test_the_C_vectors_were_found():
    if not os.path.exists(TEST_HASH_C):
        pytest.skip("tests/test_hash.c not in this checkout")
    assert [v["name"] for v in VECTORS] == ["plain", "salted", "mla-fp8", "long-page", "page-1"]


@pytest.mark.parametrize("v", VECTORS, ids=[v["name"] for v in VECTORS])
def test_keys_equal_the_pinned_C_vectors(v):
    assert os.environ.get("SKV_HASH_SECRET") is None
    ns = make_ns(v)
    assert "%032x" % ns.id == v["ns_id"]
    keys = ns.hash_tokens(np.array(v["tokens"], dtype=np.uint32))
    assert symkv.keys_to_hex(keys) == v["keys"]
    # the same from a list, and from int64
    assert symkv.keys_to_hex(symkv.hash_tokens(ns, list(v["tokens"]))) == v["keys"]
    assert symkv.keys_to_hex(ns.hash_tokens(np.array(v["tokens"], np.int64))) == v["keys"]
    fb = bytes((v["fb_mul"] * i + v["fb_add"]) % 256 for i in range(v["fb_len"]))
    assert symkv.keys_to_hex(ns.key_from_bytes(fb)) == [v["from_bytes"]]


@pytest.mark.parametrize("v", VECTORS, ids=[v["name"] for v in VECTORS])
def test_continuing_a_chain_with_parent(v):
    ns = make_ns(v)
    page = v["geom"][5]
    tok = v["tokens"]
    if len(tok) // page < 2:
        pytest.skip("one page")
    first = ns.hash_tokens(tok[:page])
    rest = ns.hash_tokens(tok[page:], parent=first[-1])
    assert symkv.keys_to_hex(np.concatenate([first, rest])) == v["keys"]
    # parent as an int and as hex
    assert symkv.keys_to_hex(ns.hash_tokens(tok[page:], parent=symkv.key_to_int(first[0]))) == \
        v["keys"][1:]
    assert symkv.keys_to_hex(ns.hash_tokens(tok[page:], parent=v["keys"][0])) == v["keys"][1:]


def test_vectors_from_gen_hash_vectors_py():
    pytest.importorskip("xxhash")
    if not os.path.exists(GEN):
        pytest.skip("tests/vectors/gen_hash_vectors.py not in this checkout")
    spec = importlib.util.spec_from_file_location("gen_hash_vectors", GEN)
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    for vec in gen.VECTORS:
        tokens, nid, keys, fb = gen.compute(vec)
        name, model, geom, salt, secret, _tok, fb_spec = vec
        v = {"model": model, "geom": geom, "salt": salt, "secret": secret}
        ns = make_ns(v)
        assert ns.id == nid, name
        assert symkv.keys_to_ints(ns.hash_tokens(tokens)) == keys, name
        fbb = bytes(gen.expand(fb_spec, 256))
        assert symkv.key_to_int(ns.key_from_bytes(fbb)) == fb, name
    # and random sequences against the reference implementation
    rng = np.random.default_rng(5)
    g = symkv.Geometry(num_layers=4, num_kv_heads=2, head_dim=64, page_tokens=16, elem_bytes=2)
    ns = symkv.Namespace("random-model", g, salt=b"t", secret=b"s3cr3t")
    ref = gen.namespace(b"random-model", g.astuple(), b"t", b"s3cr3t")
    for n in (0, 15, 16, 100, 1000):
        t = rng.integers(0, 1 << 32, n, dtype=np.uint64).astype(np.uint32)
        assert symkv.keys_to_ints(ns.hash_tokens(t)) == gen.hash_tokens(ref, 16, t.tolist())


def test_key_formats():
    g = symkv.Geometry(num_layers=1, num_kv_heads=1, head_dim=1, page_tokens=2, elem_bytes=1)
    ns = symkv.Namespace("x", g)
    k = ns.hash_tokens([1, 2, 3, 4])
    assert k.dtype == np.uint64 and k.shape == (2, 2) and k.flags.c_contiguous
    ints = symkv.keys_to_ints(k)
    assert (symkv.as_keys(ints) == k).all()
    assert (symkv.as_keys(symkv.keys_to_hex(k)) == k).all()
    assert (symkv.as_keys([(int(r[0]), int(r[1])) for r in k]) == k).all()
    assert symkv.as_keys(k) is k or (symkv.as_keys(k) == k).all()
    assert len(ns.hash_tokens([1])) == 0  # partial page: no key
    assert ns.hash_tokens([]).shape == (0, 2)
    assert ns.keys_from_bytes([b"a", b"b"]).shape == (2, 2)
    assert (ns.key_from_bytes("a") == ns.key_from_bytes(b"a")).all()


def test_namespaces_separate():
    g = symkv.Geometry(num_layers=1, num_kv_heads=1, head_dim=4, page_tokens=2, elem_bytes=2)
    a = symkv.Namespace("m", g).hash_tokens([1, 2])
    b = symkv.Namespace("m", g, salt="tenant").hash_tokens([1, 2])
    c = symkv.Namespace("m", g, secret=b"x").hash_tokens([1, 2])
    g2 = symkv.Geometry(num_layers=2, num_kv_heads=1, head_dim=4, page_tokens=2, elem_bytes=2)
    d = symkv.Namespace("m", g2).hash_tokens([1, 2])
    assert len({symkv.keys_to_hex(x)[0] for x in (a, b, c, d)}) == 4


@pytest.mark.parametrize("call,exc,match", [
    (lambda ns: ns.hash_tokens([1.5, 2.0]), symkv.InvalidArgument, "expected integers"),
    (lambda ns: ns.hash_tokens([0, 1 << 32]), symkv.InvalidArgument, "out of range"),
    (lambda ns: ns.hash_tokens(b"ab"), symkv.InvalidArgument, "expected integers"),
    (lambda ns: ns.hash_tokens([1, 2], parent=(0, 5)), symkv.InvalidArgument, r"parent.*hi"),
    (lambda ns: ns.hash_tokens([1, 2], parent="zz"), symkv.InvalidArgument, "32 hex digits"),
    (lambda ns: ns.key_from_bytes(3.5), symkv.InvalidArgument, "expected bytes"),
    (lambda ns: ns.key_from_bytes(5), symkv.InvalidArgument, "int"),
])
def test_bad_hash_input(call, exc, match):
    g = symkv.Geometry(num_layers=1, num_kv_heads=1, head_dim=1, page_tokens=2, elem_bytes=1)
    with pytest.raises(exc, match=match):
        call(symkv.Namespace("x", g))


@pytest.mark.parametrize("kw,match", [
    (dict(model=""), r"model"),
    (dict(model="m" * 257), r"model"),
    (dict(model="a\0b"), "NUL"),
    (dict(salt=b"s" * 4097), r"salt"),
    (dict(secret=b"s" * 4097), r"secret"),
    # bytes(n) is n zero bytes, and bytes(0) no salt at all: an int is refused, not converted
    (dict(salt=0), r"salt: an int"),
    (dict(salt=5), r"salt: an int"),
    (dict(secret=7), r"secret: an int"),
    (dict(model=3), r"model: an int"),
])
def test_bad_namespace(kw, match):
    g = symkv.Geometry(num_layers=1, num_kv_heads=1, head_dim=1, page_tokens=2, elem_bytes=1)
    args = dict(model="m", salt=b"", secret=None)
    args.update(kw)
    with pytest.raises(symkv.InvalidArgument, match=match):
        symkv.Namespace(args["model"], g, salt=args["salt"], secret=args["secret"])


def test_salts_that_are_not_bytes():
    """An int salt is an error (it was turned into that many zero bytes, and salt=0 into the
    unsalted namespace); its explicit encodings are distinct namespaces."""
    g = symkv.Geometry(num_layers=1, num_kv_heads=1, head_dim=1, page_tokens=2, elem_bytes=1)
    ids = {symkv.Namespace("m", g, salt=s).id for s in (None, b"", "")}
    assert len(ids) == 1  # no salt, however spelled
    enc = [b"\0", b"\0" * 5, str(5).encode(), (5).to_bytes(8, "little"), b"0"]
    assert len({symkv.Namespace("m", g, salt=s).id for s in enc} | ids) == len(enc) + 1


def test_namespace_is_released():
    g = symkv.Geometry(num_layers=1, num_kv_heads=1, head_dim=1, page_tokens=2, elem_bytes=1)
    with symkv.Namespace("x", g) as ns:
        ns.hash_tokens([1, 2])
    assert ns.closed
    with pytest.raises(symkv.InvalidState, match="namespace is closed"):
        ns.hash_tokens([1, 2])


def test_tokens_with_more_than_one_dimension():
    # A (1, n) batch of one (tokenizer(..., return_tensors="np")) is that sequence; other
    # shapes are ambiguous and raise instead of hashing len(axis 0) tokens.
    g = symkv.Geometry(num_layers=1, num_kv_heads=1, head_dim=1, page_tokens=4, elem_bytes=1)
    ns = symkv.Namespace("x", g)
    flat = ns.hash_tokens(np.arange(32))
    assert len(flat) == 8
    assert (ns.hash_tokens(np.arange(32).reshape(1, 32)) == flat).all()
    assert (ns.hash_tokens([list(range(32))]) == flat).all()
    assert (symkv.as_tokens(np.arange(8, dtype=np.uint32).reshape(1, 8)) == np.arange(8)).all()
    for bad in (np.arange(32).reshape(8, 4), np.arange(32).reshape(16, 2),
                np.arange(32).reshape(32, 1), np.arange(32).reshape(1, 1, 32),
                np.zeros((2, 0), np.uint32)):
        with pytest.raises(symkv.InvalidArgument, match="is not one sequence"):
            ns.hash_tokens(bad)
