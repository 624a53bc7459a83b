"""symkv.torch: a torch process group bootstraps symkv (no symkv-run), the torch.library ops
against torch.distributed.all_reduce and symkv's exact order on fresh random inputs, bit for bit
on every rank, torch.compile(fullgraph=True), CUDA graphs, symmetric tensors and the vLLM-shaped
CustomAllreduce. CPU tensors use the host backend (run in CI); CUDA ones skip without a GPU and
run with 2 processes on one GPU (MPS) on the GPU hosts."""
import os

import pytest

import symkv
from conftest import run_torch_pes, torch_or_skip


def _need():
    torch = torch_or_skip()
    if not symkv.has_function("skv_comm_create"):
        pytest.skip("libsymkv.so has no comm layer")
    return torch


@pytest.mark.parametrize("n", [2, 4])
def test_torch_ops_cpu_gloo_group(n):
    _need()
    # 2 PEs: sizes up to 64 MiB (bf16) and Inductor; 4 PEs: up to 4 MiB, aot_eager only
    r = run_torch_pes(n, "pe_torch.py", "cpu", *(["quick"] if n > 2 else ["inductor"]))
    assert r.ok(), str(r)


def test_torch_ops_cuda_two_pes():
    torch = _need()
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device visible to torch")
    r = run_torch_pes(2, "pe_torch.py", "cuda", timeout=480)
    assert r.ok(), str(r)
