"""Layer-by-layer loads and saves against whole pages (issue 19): what symkv.vllm pays for
copying each layer in its own call (skv_kv_fetch with a one-layer
layout, skv_kv_reserve / skv_kv_write per layer / skv_kv_commit) instead of one call of whole
pages. Prints the median of --rounds rounds of each and the ratios to the whole-page baseline,
measured in the same run. Host memory by default; --device cuda puts the engine's blocks and the
pages on the GPU (torch tensors, the cuda backend; each call timed to completion: the stream
synchronised, and for saves the keys inserted).

    SKV_LIBRARY=build/libsymkv.so PYTHONPATH=bindings/python build/symkv-run -n 1 -- \
        .venv/bin/python bench/layer_fetch.py [--layers 32] [--kv-heads 8] [--head-dim 128] [--page-tokens 16] [--pages 64]
        [--rounds 7] [--device cpu|cuda]"""

import argparse
import time

import numpy as np

import symkv


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-tokens", type=int, default=16)
    ap.add_argument("--pages", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    a = ap.parse_args()
    cuda = a.device == "cuda"
    g = symkv.Geometry(num_layers=a.layers, num_kv_heads=a.kv_heads, head_dim=a.head_dim,
                       page_tokens=a.page_tokens, elem_bytes=2)
    n, L = a.pages, a.layers
    shape = symkv.layer_shape(g, "vllm_flash", a.page_tokens, 2 * n)
    rng = np.random.default_rng(0)
    src = [rng.integers(0, 1 << 16, size=shape, dtype=np.uint16) for _ in range(L)]
    dst = [np.zeros(shape, np.uint16) for _ in range(L)]
    done = lambda kv: None  # noqa: E731  host copies are synchronous
    if cuda:
        import torch
        src = [torch.from_numpy(x.view(np.int16)).cuda() for x in src]
        dst = [torch.zeros(shape, dtype=torch.int16, device="cuda") for _ in range(L)]

        def done(kv):  # noqa: F811  the copies complete, the keys are inserted
            torch.cuda.synchronize()
            kv.sync()
    ctx = symkv.init()  # one PE, under symkv-run
    with ctx, ctx.kv_cache(g, pages_per_pe=2 * n + 8, backend=a.device if cuda else "host") as kv, \
            symkv.Namespace("bench", g) as ns:
        slay = symkv.Layout.from_tensors(g, src, "vllm_flash")
        dlay = symkv.Layout.from_tensors(g, dst, "vllm_flash")
        sl = [slay.layers(i) for i in range(L)]
        dl = [dlay.layers(i) for i in range(L)]
        ids = np.arange(n)
        out = np.arange(n) + n
        same = (lambda s, d: bool((s[:, ids] == d[:, out]).all())) if not cuda else \
            (lambda s, d: torch.equal(s[:, torch.as_tensor(ids, device="cuda")],
                                      d[:, torch.as_tensor(out, device="cuda")]))
        res = {k: [] for k in ("fetch_whole", "fetch_layers", "save_whole", "save_layers")}
        for r in range(a.rounds):
            keys = ns.hash_tokens(np.arange(n * a.page_tokens) + r * 10_000_000)
            t = time.perf_counter()
            kv.publish(ns, keys, slay, ids)
            done(kv)
            res["save_whole"].append(time.perf_counter() - t)
            kv.evict(2 * n + 8)
            t = time.perf_counter()
            refs = kv.reserve(ns, keys)
            for i in range(L):
                kv.write(refs, sl[i], ids)
            kv.commit(ns, keys, refs)
            done(kv)
            res["save_layers"].append(time.perf_counter() - t)
            with kv.lookup(ns, keys, pin=True) as hit:
                assert hit.nhit == n
                t = time.perf_counter()
                kv.fetch(hit, dlay, out)
                done(kv)
                res["fetch_whole"].append(time.perf_counter() - t)
                t = time.perf_counter()
                for i in range(L):
                    kv.fetch(hit, dl[i], out)
                done(kv)
                res["fetch_layers"].append(time.perf_counter() - t)
            assert all(same(s, d) for s, d in zip(src, dst))
            for d in dst:  # the next round's fetches must write every byte again
                d.fill(0) if not cuda else d.zero_()
            kv.evict(2 * n + 8)
        mb = n * g.page_bytes / 1e6
        print("%s: %d pages of %.2f MB (%d layers), %d rounds, medians:" % (
            a.device, n, g.page_bytes / 1e6, L, a.rounds))
        for what in ("fetch", "save"):
            w = float(np.median(res[what + "_whole"]))
            p = float(np.median(res[what + "_layers"]))
            print("  %-5s whole pages %8.2f ms (%6.2f GB/s)   layer by layer (%d calls) %8.2f ms "
                  "(%6.2f GB/s)   ratio %.3f" % (what, w * 1e3, mb / w / 1e3, L, p * 1e3,
                                                  mb / p / 1e3, p / w))


if __name__ == "__main__":
    main()
