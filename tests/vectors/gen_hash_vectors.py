#!/usr/bin/env python3
# Pinned test vectors of symkv's key hashing (docs/hashing.md), computed with PyPI `xxhash`.
# Prints the generated block of tests/test_hash.c; `--check tests/test_hash.c` compares.
"""Usage: pip install xxhash
  python3 tests/vectors/gen_hash_vectors.py                        # print the C block
  python3 tests/vectors/gen_hash_vectors.py --check tests/test_hash.c  # exit 1 if it differs
  python3 tests/vectors/gen_hash_vectors.py --example              # vector 0, for the docs
"""
import struct
import sys

import xxhash

SPLIT, MLA = 0, 1
MASK64 = (1 << 64) - 1


def fix(h):
    """hi == 0 is reserved by the index: map it to 1. h is XXH3-128 as an int (hi << 64 | lo)."""
    return h | (1 << 64) if h >> 64 == 0 else h


def le128(k):
    return struct.pack("<QQ", k >> 64, k & MASK64)


def lp(b):
    return struct.pack("<I", len(b)) + b


def namespace(model, geom, salt=b"", secret=b""):
    """(id, seed) of a namespace; geom = (kv_kind, layers, kv_heads, head_dim, elem_bytes,
    page_tokens); model, salt and secret are bytes."""
    data = b"symkv-ns-v1" + lp(secret) + lp(model) + struct.pack("<6I", *geom) + lp(salt)
    nid = fix(xxhash.xxh3_128(data, seed=0).intdigest())
    return nid, (nid >> 64) ^ (nid & MASK64)


def hash_tokens(ns, page_tokens, tokens, parent=None):
    """One key per full page; parent: the key of the page before tokens[0], else None."""
    nid, seed = ns
    prev, keys = nid if parent is None else parent, []
    for i in range(len(tokens) // page_tokens):
        page = tokens[i * page_tokens:(i + 1) * page_tokens]
        data = b"\x01" + le128(nid) + le128(prev) + struct.pack("<%dI" % page_tokens, *page)
        prev = fix(xxhash.xxh3_128(data, seed=seed).intdigest())
        keys.append(prev)
    return keys


def key_from_bytes(ns, b):
    nid, seed = ns
    return fix(xxhash.xxh3_128(b"\x02" + le128(nid) + b, seed=seed).intdigest())


def rule(n, mul, add, mod):
    """x[i] = (mul * i + add) mod `mod`: long inputs stated compactly."""
    return [(mul * i + add) % mod for i in range(n)]


LLAMA = (SPLIT, 32, 8, 128, 2, 4)
HELLO = [128000, 791, 4062, 14198, 39935, 35308, 927, 279, 16053, 5679]
# name, model, geometry, salt, secret, tokens (list or ('rule', n, mul, add)),
# key_from_bytes input ('rule', n, mul, add): byte i = (mul * i + add) mod 256
VECTORS = [
    ("plain", b"meta-llama/Llama-3.1-8B-Instruct", LLAMA, b"", b"", HELLO, ("rule", 32, 1, 0)),
    ("salted", b"meta-llama/Llama-3.1-8B-Instruct", LLAMA, b"tenant-42",
     b"correct horse battery staple", HELLO + [13, 128009], ("rule", 0, 0, 0)),
    ("mla-fp8", b"deepseek-ai/DeepSeek-V3", (MLA, 61, 1, 576, 1, 64), b"\x00\xffsalt\x00",
     b"\x00\x01\x02secret\xfe", ("rule", 133, 2654435761, 12345), ("rule", 8, 0, 0x5a)),
    ("long-page", b"Qwen/Qwen2.5-0.5B", (SPLIT, 2, 2, 64, 4, 512), b"s", b"0123456789abcdef" * 4,
     ("rule", 1031, 40503, 7), ("rule", 2000, 7, 3)),
    ("page-1", b"x", (SPLIT, 1, 1, 1, 1, 1), b"", b"z",
     [0, 0xFFFFFFFF, 1, 0x80000000, 0x01020304], ("rule", 1, 0, 0xFF)),
]


def expand(spec, mod):
    if isinstance(spec, tuple):
        return rule(spec[1], spec[2], spec[3], mod)
    return list(spec)


def compute(v):
    name, model, geom, salt, secret, tok_spec, fb_spec = v
    tokens = expand(tok_spec, 1 << 32)
    ns = namespace(model, geom, salt, secret)
    keys = hash_tokens(ns, geom[5], tokens)
    fb = key_from_bytes(ns, bytes(expand(fb_spec, 256)))
    return tokens, ns[0], keys, fb


def c_bytes(b):
    """A C string literal: printable ASCII as is, other bytes as 3-digit octal escapes."""
    ok = lambda c: 32 <= c < 127 and chr(c) not in '"\\?'
    return '"' + "".join(chr(c) if ok(c) else "\\%03o" % c for c in b) + '"'


def wrap(items, indent, width=100):
    lines, cur = [], ""
    for it in items:
        if cur and len(indent) + len(cur) + len(it) + 2 > width:
            lines.append(cur.rstrip())
            cur = ""
        cur += it + ", "
    lines.append(cur.rstrip().rstrip(","))
    return ("\n" + indent).join(lines)


def c_block():
    out = ["/* BEGIN GENERATED VECTORS (tests/vectors/gen_hash_vectors.py; do not edit) */",
           "// clang-format off"]
    for i, v in enumerate(VECTORS):
        if not isinstance(v[5], tuple):
            out.append("static const uint32_t vec%d_tokens[] = {" % i)
            out.append("    " + wrap(["0x%08x" % t for t in v[5]], "    ") + "};")
    out.append("static const hash_vector_t vectors[] = {")
    for i, v in enumerate(VECTORS):
        name, model, geom, salt, secret, tok_spec, fb_spec = v
        tokens, nid, keys, fb = compute(v)
        if isinstance(tok_spec, tuple):
            tok = ".tokens = NULL, .ntokens = %d, .tok_mul = %du, .tok_add = %du" % tok_spec[1:]
        else:
            tok = ".tokens = vec%d_tokens, .ntokens = %d" % (i, len(tokens))
        out.append('    {.name = "%s",' % name)
        out.append('     .model = %s,' % c_bytes(model))
        out.append("     .geom = {%s}," % ", ".join(map(str, geom)))
        out.append("     .salt = %s, .salt_len = %d," % (c_bytes(salt), len(salt)))
        out.append("     .secret = %s, .secret_len = %d," % (c_bytes(secret), len(secret)))
        out.append("     %s," % tok)
        out.append("     .fb_len = %d, .fb_mul = %d, .fb_add = %d," % fb_spec[1:])
        out.append('     .ns_id = "%032x",' % nid)
        out.append("     .nkeys = %d," % len(keys))
        out.append("     .keys = {" + ",\n              ".join('"%032x"' % k for k in keys) + "},")
        out.append('     .from_bytes = "%032x"},' % fb)
    out.append("};")
    out.append("// clang-format on")
    out.append("/* END GENERATED VECTORS */")
    return "\n".join(out)


def example():
    tokens, nid, keys, fb = compute(VECTORS[0])
    print("model  %s\ngeometry %s\ntokens %s" % (VECTORS[0][1].decode(), VECTORS[0][2], tokens))
    print("namespace id  %032x" % nid)
    for i, k in enumerate(keys):
        print("key %d         %032x" % (i, k))
    print("key_from_bytes(bytes 0..31)  %032x" % fb)


def main(argv):
    if len(argv) > 1 and argv[1] == "--example":
        return example() or 0
    block = c_block()
    if len(argv) > 2 and argv[1] == "--check":
        text = open(argv[2]).read()
        a = text.find("/* BEGIN GENERATED VECTORS")
        b = text.find("/* END GENERATED VECTORS */")
        found = text[a:b + len("/* END GENERATED VECTORS */")] if a >= 0 and b > a else ""
        if found != block:
            print("%s: the generated block differs from this script's output" % argv[2])
            return 1
        print("%s: %d vectors match" % (argv[2], len(VECTORS)))
        return 0
    print(block)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
