"""symkv.torch: a torch process group bootstraps symkv (no symkv-run), the torch.library ops
against torch.distributed.all_reduce and symkv's exact order on fresh random inputs, bit for bit
on every rank, torch.compile(fullgraph=True), CUDA graphs, symmetric tensors and the vLLM-shaped
CustomAllreduce. CPU tensors use the host backend (run in CI); CUDA ones skip without a GPU and
run with 2 processes on one GPU (MPS) on the GPU hosts."""
import os
import re
import select
import shutil
import subprocess
import sys
import time

import pytest

import symkv
from conftest import PKG, run_torch_pes, torch_or_skip


def _need():
    torch = torch_or_skip()
    if not symkv.has_function("skv_comm_create"):
        pytest.skip("libsymkv.so has no comm layer")
    return torch


@pytest.mark.parametrize("n", [2, 4])
def test_torch_ops_cpu_gloo_group(n):
    _need()
    # 2 PEs: sizes up to 64 MiB (bf16) and Inductor, the C++ kernels; 4 PEs: up to 4 MiB,
    # aot_eager only, the Python kernels (SKV_TORCH_CPP=0)
    r = run_torch_pes(n, "pe_torch.py", "cpu", *(["quick"] if n > 2 else ["inductor"]),
                      env={"SKV_TORCH_CPP": "0"} if n > 2 else None)
    assert r.ok(), str(r)
    assert ("kernels of torch.ops.symkv.*: " + ("Python" if n > 2 else "C++")) in r.out, str(r)


def _kernels(env):
    code = ("import torch, symkv.torch\n"
            "print(torch._C._dispatch_dump('symkv::all_reduce'))\n"
            "print(torch._C._dispatch_dump('symkv::all_reduce_'))\n")
    e = dict(os.environ, PYTHONPATH=PKG, **env)
    p = subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout, p.stderr


def test_torch_op_kernels_are_cpp():
    torch = _need()
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler: symkv.torch keeps its Python kernels")
    out, err = _kernels({})
    keys = ["CPU"]
    from torch.utils import cpp_extension
    if torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None:
        keys.append("CUDA")
    for op in ("all_reduce", "all_reduce_"):
        text = out.split("name: symkv::%s\n" % op)[1].split("name: ")[0]
        for key in keys:
            assert re.search(r"^%s: registered at \S*_torch_ops\.cpp" % key, text, re.M), \
                (op, key, out, err)
    assert "were not built" not in err, err


def test_torch_op_kernels_python_when_disabled():
    _need()
    out, err = _kernels({"SKV_TORCH_CPP": "0"})
    assert re.search(r"^CPU: registered at \S*symkv/torch\.py", out, re.M), out + err
    assert "_torch_ops.cpp" not in out, out


def _build_dirs(root):
    """The directories symkv.torch may build its op kernels in under the TORCH_EXTENSIONS_DIR
    root (with and without CUDA)."""
    import torch
    name = "symkv_torch_ops_%s" % re.sub(r"\W", "_", torch.__version__)
    return [root / name, root / (name + "_cuda")]


def _age(path, age_s):
    t = time.time() - age_s
    os.utime(path, (t, t))


def _locked_build_dirs(root, age_s):
    """Torch's build lock in each build directory, age_s old; their paths."""
    locks = []
    for d in _build_dirs(root):
        d.mkdir()
        (d / "lock").write_bytes(b"")
        _age(d / "lock", age_s)
        locks.append(d / "lock")
    return locks


def _import_torch_ops(root, prelude=""):
    """A process that runs `prelude`, imports symkv.torch (its op kernels built under root) and
    prints the dispatcher's kernels of symkv::all_reduce."""
    code = prelude + ("import torch, symkv.torch\n"
                      "print(torch._C._dispatch_dump('symkv::all_reduce'), flush=True)\n")
    e = dict(os.environ, PYTHONPATH=PKG, TORCH_EXTENSIONS_DIR=str(root))
    e.pop("SKV_TORCH_CPP", None)
    return subprocess.Popen([sys.executable, "-c", code], env=e, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _python_kernels_after_stale_lock(p, locks):
    try:
        out, err = p.communicate(timeout=120)
    finally:
        p.kill()
        p.wait()
    assert p.returncode == 0, out + err
    assert re.search(r"^CPU: registered at \S*symkv/torch\.py", out, re.M), out + err
    assert "left by a build that stopped" in err and any(str(k) in err for k in locks), err
    for k in locks:  # not removed: another process may still be building there
        if k.parent.exists():
            assert k.exists() and not list(k.parent.glob("*.so")), k


def test_torch_stale_build_lock_leaves_python_kernels(tmp_path):
    # torch waits forever on a build's lock file; one an hour old was left by a build that was
    # killed: the import goes on with the Python kernels and says which file to remove
    _need()
    locks = _locked_build_dirs(tmp_path, 3600)
    _python_kernels_after_stale_lock(_import_torch_ops(tmp_path), locks)


def test_torch_build_lock_waited_for_until_stale(tmp_path):
    # a young lock (another process building) is waited for; once it is old enough to be a
    # stopped build's, the import goes on with the Python kernels. The child says when it first
    # sleeps after importing torch: symkv.torch's wait on the lock
    _need()
    locks = _locked_build_dirs(tmp_path, 0)
    prelude = ("import time, torch\n"
               "_sleep = time.sleep\n"
               "def _said(s, said=[]):\n"
               "    if not said: said.append(print('waiting', flush=True))\n"
               "    _sleep(s)\n"
               "time.sleep = _said\n")
    p = _import_torch_ops(tmp_path, prelude)
    ready = select.select([p.stdout], [], [], 120)[0]
    line = p.stdout.readline() if ready else ""
    if line != "waiting\n":
        p.kill()
        assert False, (line, p.communicate())
    for k in locks:
        _age(k, 3600)
    _python_kernels_after_stale_lock(p, locks)


def test_torch_build_lock_taken_by_another_meanwhile(tmp_path):
    # no lock when symkv.torch starts the build, then another process takes it before torch does
    # and dies (simulated: the lock made an hour old just before torch's own attempt)
    _need()
    locks = [d / "lock" for d in _build_dirs(tmp_path)]
    prelude = ("import os, time\n"
               "from torch.utils import cpp_extension\n"
               "_load = cpp_extension.load\n"
               "def _taken(*a, **k):\n"
               "    d = cpp_extension._get_build_directory(k['name'], False)\n"
               "    lock = os.path.join(d, 'lock')\n"
               "    open(lock, 'w').close()\n"
               "    os.utime(lock, (time.time() - 3600,) * 2)\n"
               "    return _load(*a, **k)\n"
               "cpp_extension.load = _taken\n")
    _python_kernels_after_stale_lock(_import_torch_ops(tmp_path, prelude), locks)


def test_torch_ops_cuda_two_pes():
    torch = _need()
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device visible to torch")
    r = run_torch_pes(2, "pe_torch.py", "cuda", timeout=480)
    assert r.ok(), str(r)
