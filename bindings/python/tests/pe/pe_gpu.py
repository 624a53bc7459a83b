"""Run on 2+ PEs with CUDA: torch CUDA tensors as the engine cache, pages in GPU memory
(backend cuda), publish on PE 0, lookup + fetch on the others, ordered on torch's stream."""
import torch

import symkv

ctx = symkv.init()
rank, n = ctx.rank, ctx.world_size
dev = ctx.device
torch.cuda.set_device(dev)
g = symkv.Geometry(num_layers=3, num_kv_heads=2, head_dim=64, page_tokens=32, dtype="bf16")
kv = ctx.kv_cache(g, pages_per_pe=16, backend="cuda")
ns = symkv.Namespace("gpu-model", g)
shape = symkv.layer_shape(g, "vllm_flash", 16, 40)
gen = torch.Generator(device="cuda").manual_seed(1234)
src = [torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3)]
keys = ns.hash_tokens(torch.arange(32 * 3 + 5))
ids = [4, 5, 30, 31, 0, 1]
if rank == 0:
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        assert kv.publish(ns, keys, symkv.Layout.from_tensors(g, src, "vllm_flash"), ids) == 3
    kv.sync()
ctx.barrier()
dst = [torch.zeros(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
lay = symkv.Layout.from_tensors(g, dst, "vllm_flash")
with kv.lookup(ns, keys, pin=True) as hit:
    assert hit.nhit == 3, hit
    kv.fetch(hit, lay, [10, 11, 12, 13, 14, 15], unpin=True)
torch.cuda.current_stream().synchronize()
kv.sync()
for l in range(3):
    assert torch.equal(dst[l][:, 10:16], src[l][:, ids]), l
ctx.barrier()
ctx.close()
print("OK", rank)
