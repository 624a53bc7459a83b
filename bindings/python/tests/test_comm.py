"""The comm bindings: all-reduce, signals, wait and barrier on the host backend, on several
PEs through the launcher (skipped, with the reason, while libsymkv.so has no comm layer)."""
import numpy as np
import pytest

import symkv
from symkv import _lib


def _need_comm():
    missing = [n for n in ("skv_comm_create", "skv_comm_allreduce", "skv_comm_signal", "skv_comm_wait",
                           "skv_comm_barrier") if not symkv.has_function(n)]
    if missing:
        pytest.skip("libsymkv.so (%s) does not export %s yet: the comm layer (src/comm/) is "
                    "not in this build" % (symkv.library_path, ", ".join(missing)))


def test_comm_bindings_are_declared():
    for n in ("skv_comm_create", "skv_comm_destroy", "skv_comm_get_heap", "skv_comm_allreduce",
              "skv_comm_get_signal_slots", "skv_comm_signal", "skv_comm_wait", "skv_comm_barrier",
              "skv_comm_check"):
        assert n in _lib.FUNCTIONS


def test_missing_comm_layer_raises_NotSupported(ctx):
    if symkv.has_function("skv_comm_create"):
        pytest.skip("this library has the comm layer")
    with pytest.raises(symkv.NotSupported, match="skv_comm_create.*does not export"):
        ctx.comm()


@pytest.mark.parametrize("n", [2, 4])
def test_host_comm_on_several_pes(pes, n):
    _need_comm()
    r = pes(n, "pe_comm.py")
    assert r.ok(), r


def test_host_comm_one_pe(ctx):
    _need_comm()
    with ctx.comm(backend="host", nccl=False) as comm:
        x = np.arange(10, dtype=np.float32)
        assert (comm.allreduce(x) == x).all()
        comm.barrier()
        comm.signal(0, 0, 5)
        comm.wait(0, 5, cmp="eq")
        comm.check()
        with pytest.raises(symkv.InvalidArgument, match="op 'avg'"):
            comm.allreduce(x, op="avg")
        with pytest.raises(symkv.InvalidArgument, match="cmp"):
            comm.wait(0, 5, cmp="~")
    assert comm.closed


def test_host_comm_torch_cpu_tensors(ctx):
    _need_comm()
    from conftest import torch_or_skip
    torch = torch_or_skip()
    with ctx.comm(backend="host", nccl=False) as comm:
        x = torch.arange(10, dtype=torch.bfloat16)
        out = comm.allreduce(x)
        assert isinstance(out, torch.Tensor) and torch.equal(out, x)


def test_cuda_comm_one_pe(ctx):
    _need_comm()
    from conftest import torch_or_skip
    torch = torch_or_skip(cuda=True)
    try:
        comm = ctx.comm(backend="cuda", nccl=False)
    except symkv.NotSupported as e:
        pytest.skip("this libsymkv.so has no CUDA comm: %s" % e)
    with comm:
        x = torch.arange(1024, dtype=torch.float16, device="cuda")
        out = comm.allreduce(x)
        torch.cuda.synchronize()
        assert torch.equal(out, x)
        comm.barrier()
        comm.check()
