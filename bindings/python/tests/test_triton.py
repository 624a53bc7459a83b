"""symkv.triton: the device functions and the one-shot all-reduce compile for sm_90 without a
GPU (Triton's compiler and ptxas; the PTX must hold the acquire loads, the system-scope release
atomics and the clock reads the functions promise), and run on 2 processes sharing one GPU on
the GPU hosts against a host reference (skipped without a GPU)."""
import re

import pytest

import symkv
from conftest import run_torch_pes, torch_or_skip


def _triton():
    torch_or_skip()
    triton = pytest.importorskip("triton", reason="triton is not installed")
    import symkv.triton as skt
    return triton, skt


def _compile(triton, fn, signature, constexprs):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    try:
        k = triton.compile(ASTSource(fn, signature, constexprs=constexprs),
                           target=GPUTarget("cuda", 90, 32))
    except RuntimeError as e:
        if "ptxas" in str(e) and "not found" in str(e):
            pytest.skip("Triton's ptxas is missing: %s" % e)
        raise
    return k.asm["ptx"]


def test_oneshot_kernel_compiles_with_the_promised_ordering():
    triton, skt = _triton()
    sig = {"x_ptr": "*bf16", "out_ptr": "*bf16", "buf_ptr": "*bf16", "flags_ptr": "*i64",
           "epoch_ptr": "*i64", "err_ptr": "*i64", "n": "i32", "my_pe": "i32",
           "buf_stride": "i64", "flag_stride": "i64", "timeout_ns": "i64",
           "NPES": "constexpr", "BLOCK": "constexpr"}
    ptx = _compile(triton, skt._oneshot_kernel, sig, {"NPES": 2, "BLOCK": 2048})
    instr = set(re.findall(r"\b(?:atom|ld|st|red)\.[\w.]+", ptx))
    assert "ld.acquire.sys.global.u64" in instr, instr            # wait_ge's polling load
    assert any(i.startswith("atom.global.sys.release.exch") for i in instr), instr  # signals
    assert "%globaltimer" in ptx                                   # the timeout's clock
    assert "bar.sync" in ptx                                       # block barrier before signals
    assert "multimem" not in ptx                                   # never NVLink multicast
    # Triton passes an int argument equal to 1 as a constant (specialisation): PE 1's kernel
    # must compile too (peer_ptr called .to() on it, which failed on PE 1 only)
    sig1 = dict(sig, my_pe="constexpr")
    ptx1 = _compile(triton, skt._oneshot_kernel, sig1, {"NPES": 2, "BLOCK": 2048, "my_pe": 1})
    assert "ld.acquire.sys.global.u64" in ptx1


def test_device_functions_compile_in_a_user_kernel():
    triton, skt = _triton()
    import triton.language as tl

    @triton.jit
    def user(src, sym, dst, flags, my_pe, pe, stride, fstride, ok_out, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        m = offs < BLOCK
        skt.put(sym, src, offs, m, my_pe, pe, stride)
        skt.signal_add(flags, 1, my_pe, pe, fstride)
        ok = skt.wait_ge(flags, 1, 1000000)
        skt.get(dst, sym, offs, m, my_pe, pe, stride)
        tl.store(ok_out, ok)

    sig = {"src": "*fp32", "sym": "*fp32", "dst": "*fp32", "flags": "*i64", "my_pe": "i32",
           "pe": "i32", "stride": "i64", "fstride": "i64", "ok_out": "*i32",
           "BLOCK": "constexpr"}
    ptx = _compile(triton, user, sig, {"BLOCK": 256})
    assert "atom.global.sys.release.add" in ptx or "red.global.sys.release.add" in ptx, \
        sorted(set(re.findall(r"\b(?:atom|red)\.[\w.]+", ptx)))


def test_triton_functions_on_two_pes_of_one_gpu():
    torch = torch_or_skip()
    _triton()
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device visible to torch")
    if not symkv.has_function("skv_comm_create"):
        pytest.skip("libsymkv.so has no comm layer")
    r = run_torch_pes(2, "pe_triton.py", timeout=300)
    assert r.ok(), str(r)
