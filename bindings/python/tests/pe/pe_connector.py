"""Run on 4 PEs: the connector helper as a vLLM-style engine uses it. PE 0 prefills and saves
requests, the other PEs ask how many tokens are matched and load them into their own blocks;
block hashes, partial pages, a scratch block, incremental saves, misses."""
import hashlib

import numpy as np

import symkv
from symkv.connector import KVConnector

ctx = symkv.init()
rank, n = ctx.rank, ctx.world_size
L, H, D, T, NB, P = 4, 2, 8, 4, 64, 8      # block_size 4, pages of 8 tokens (2 blocks)
shape = (2, NB, T, H, D)                   # vLLM FlashAttention, per layer
caches = {"model.layers.%d.attn" % l: np.zeros(shape, np.float16) for l in range(L)}
conn = KVConnector.create(ctx, caches, model="llama-test tp=1/1 fp16", pages_per_pe=32,
                          page_tokens=P)
assert conn.page_tokens == P and conn.block_size == T and conn.layout.blocks_per_page == 2


def fill(blocks, seed):
    """The engine's 'prefill': deterministic KV in the given blocks."""
    for l, c in enumerate(caches.values()):
        for j, b in enumerate(blocks):
            c[:, b] = np.random.default_rng(seed * 1000 + l * 100 + j).standard_normal(
                (2, T, H, D)).astype(np.float16)


def expect(blocks, seed, skip=()):
    for l, c in enumerate(caches.values()):
        for j, b in enumerate(blocks):
            if j in skip:
                continue
            want = np.random.default_rng(seed * 1000 + l * 100 + j).standard_normal(
                (2, T, H, D)).astype(np.float16)
            assert c[:, b].tobytes() == want.tobytes(), (l, j, b)


def block_hashes(tokens):
    """An engine's own chained block hashes (like vLLM's sha256 of parent + block tokens)."""
    out, prev = [], b""
    for i in range(len(tokens) // T):
        block = np.asarray(tokens[i * T:(i + 1) * T], "<u4").tobytes()
        prev = hashlib.sha256(prev + block).digest()
        out.append(prev)
    return out


A = list(range(1000, 1035))                     # 35 tokens: 4 full pages + 3
C = [7] * 16 + list(range(50, 66))              # saved through block hashes
table_A = [40, 41, 3, 4, 50, 51, 60, 61, 62]    # PE 0's block table for A (9 blocks)
table_C = [20, 21, 22, 23, 24, 25, 26, 27]
if rank == 0:
    assert conn.num_matched_tokens(A) == 0
    fill(table_A, seed=1)
    assert conn.save(table_A, A, num_tokens=16) == 2          # the first 2 pages
    assert conn.save(table_A, A, start_token=16) == 2         # the rest, incrementally
    assert conn.save(table_A, A) == 0                         # nothing new
    fill(table_C, seed=3)
    assert conn.save(table_C, block_hashes=block_hashes(C)) == 4
ctx.barrier()

# Scheduler side: matched tokens.
assert conn.num_matched_tokens(A) == 32
assert conn.num_matched_tokens(A, max_tokens=len(A) - 1) == 32
assert conn.num_matched_tokens(A[:20]) == 16                  # only 2 full pages in 20 tokens
assert conn.num_matched_tokens(A, num_computed_tokens=8) == 24
assert conn.num_matched_tokens(A, num_computed_tokens=4) == 28
assert conn.num_matched_tokens(A[:16] + [1, 2, 3, 4, 5, 6, 7, 8, 9]) == 16  # diverges at page 2
assert conn.num_matched_tokens([5] * 40) == 0
assert conn.num_matched_tokens(block_hashes=block_hashes(C)) == 32
assert conn.num_matched_tokens(keys=conn.keys(A)) == 32
assert conn.num_matched_tokens(C) == 0                        # other key scheme, other keys

if rank != 0:
    # Worker side: load everything into this PE's own blocks.
    table_B = [10 + 5 * j for j in range(9)]
    assert conn.load(table_B, A) == 32
    expect(table_B[:8], seed=1)
    # The engine already computed the first block (prefix cache): with a scratch block the
    # page's first block goes there and the engine's block is left alone.
    table_D = [1, 2, 5, 6, 7, 8, 9, 11]
    for c in caches.values():
        c[:, 1] = 42
    conn.scratch_block = 0
    assert conn.load(table_D, A, num_computed_tokens=4, num_tokens=28) == 28
    assert all((c[:, 1] == 42).all() for c in caches.values())
    expect(table_D, seed=1, skip=(0,))
    conn.scratch_block = None
    # Block hashes, a promise of fewer tokens than cached, misses.
    table_E = [30, 31, 32, 33, 34, 35, 36, 37]
    assert conn.load(table_E, block_hashes=block_hashes(C), num_tokens=16) == 16
    expect(table_E[:4], seed=3)
    assert conn.load(table_E, [5] * 40) == 0
    # A block table too short for the pages to load is refused before anything is copied.
    try:
        conn.load([1, 2, 3], A)
    except symkv.InvalidArgument as e:
        assert "block table" in str(e)
    else:
        raise AssertionError("short block table accepted")
ctx.barrier()

# Every PE saves the same new request: one copy of each page on the node.
R = list(range(9000, 9016))
fill([44, 45, 46, 47], seed=9)
ins = conn.save([44, 45, 46, 47], R)
total = sum(b[0] for b in ctx.allgather(bytes([ins])))
assert total == 2, total
ctx.barrier()
st = conn.kv.stats()
assert st.index_entries == 4 + 4 + 2, st
conn.close()
assert conn.kv.closed
ctx.close()
print("OK", rank)
