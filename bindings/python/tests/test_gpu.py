"""GPU bindings: torch CUDA tensors with a CUDA build of libsymkv (skipped without torch, a
GPU or a CUDA build)."""
import pytest

import symkv
from conftest import torch_or_skip


def _need_cuda_build():
    if "(cuda" not in symkv.version_string():
        pytest.skip("libsymkv.so is a host-only build (%s)" % symkv.version_string())


def test_cuda_heap_tensor_and_kv_one_pe(ctx):
    torch = torch_or_skip(cuda=True)
    _need_cuda_build()
    torch.cuda.set_device(ctx.device)
    with ctx.heap(1 << 20, backend="cuda") as h:
        assert h.backend == "cuda" and h.info.device == ctx.device
        t = h.tensor(torch.float16, (256,))
        t.fill_(2)
        torch.cuda.synchronize()
        assert t.device.type == "cuda" and float(t.sum()) == 512
        with pytest.raises(symkv.NotSupported, match="heap.tensor"):
            h.array()
    g = symkv.Geometry(num_layers=2, num_kv_heads=4, head_dim=128, page_tokens=16, dtype="bf16")
    with ctx.kv_cache(g, pages_per_pe=8, backend="cuda") as kv, symkv.Namespace("m", g) as ns:
        src = [torch.randn(10, 2, 16, 4, 128, device="cuda").to(torch.bfloat16) for _ in range(2)]
        dst = [torch.zeros_like(s) for s in src]
        keys = ns.hash_tokens(list(range(48)))
        assert kv.publish(ns, keys, symkv.Layout.from_tensors(g, src, "flashinfer"), [1, 2, 3]) == 3
        kv.sync()  # GPU publish inserts the keys once the copy is complete (a stream callback)
        kv.fetch(kv.lookup(ns, keys), symkv.Layout.from_tensors(g, dst, "flashinfer"), [7, 8, 9])
        torch.cuda.synchronize()
        kv.sync()
        for s, d in zip(src, dst):
            assert torch.equal(d[[7, 8, 9]], s[[1, 2, 3]])


def test_cuda_kv_two_pes(pes):
    torch = torch_or_skip(cuda=True)
    _need_cuda_build()
    if torch.cuda.device_count() < 2:
        pytest.skip("two PEs need two GPUs (this host has %d)" % torch.cuda.device_count())
    r = pes(2, "pe_gpu.py")
    assert r.ok(), r
