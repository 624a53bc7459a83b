"""`pip install ./bindings/python` builds libsymkv with the repository's CMake (scikit-build-core)
and bundles it: the installed package loads its own library with no SKV_LIBRARY, and an
explicit SKV_LIBRARY still wins."""
import os
import shutil
import subprocess
import sys

import pytest

from conftest import PKG

NETWORK_HINTS = ("Could not find a version that satisfies", "No matching distribution",
                 "Failed to establish a new connection", "Network is unreachable",
                 "Temporary failure in name resolution", "Read timed out")


def _can_build_offline():
    """scikit-build-core in this Python (tests/deps.sh installs it) and a cmake to call: pip
    can then build without fetching the build backend (--no-build-isolation)."""
    try:
        import scikit_build_core  # noqa: F401
    except ImportError:
        return False
    return shutil.which("cmake") is not None


def _pip_install(target, cwd):
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target)]
    if _can_build_offline():
        cmd.append("--no-build-isolation")  # no network needed
    env = dict(os.environ)
    env.pop("SKV_LIBRARY", None)
    r = subprocess.run(cmd + [PKG], capture_output=True, text=True, timeout=1200, cwd=str(cwd),
                       env=env)
    if r.returncode != 0 and ("No module named pip" in r.stderr or
                              any(h in r.stderr for h in NETWORK_HINTS)):
        pytest.skip("pip cannot build here (no pip, or the build backend cannot be fetched "
                    "without a network): %s" % r.stderr.strip().splitlines()[-1])
    assert r.returncode == 0, r.stderr[-4000:]


def _load(target, cwd, skv_library=None):
    env = dict(os.environ)
    env.pop("SKV_LIBRARY", None)
    if skv_library:
        env["SKV_LIBRARY"] = skv_library
    env["PYTHONPATH"] = str(target)
    return subprocess.run([sys.executable, "-c",
                           "import symkv; print(symkv.__file__); print(symkv.library_path); "
                           "print(symkv.version_string())"],
                          env=env, capture_output=True, text=True, timeout=60, cwd=str(cwd))


def test_pip_install_bundles_the_library(tmp_path):
    target = tmp_path / "site"
    _pip_install(target, tmp_path)
    assert (target / "symkv" / "__init__.py").exists()
    assert (target / "symkv" / "connector.py").exists()
    assert (target / "symkv" / "vllm.py").exists()
    assert (target / "symkv" / "_torch_ops.cpp").exists()  # symkv.torch builds it on first use
    lib = target / "symkv" / "libsymkv.so"
    assert lib.exists() and not lib.is_symlink()
    r = _load(target, tmp_path)                 # no SKV_LIBRARY: the bundled library
    assert r.returncode == 0, r.stderr
    out = r.stdout.splitlines()
    assert out[0].startswith(str(target))
    assert os.path.realpath(out[1]) == os.path.realpath(str(lib))
    r = _load(target, tmp_path, os.environ["SKV_LIBRARY"])   # an explicit choice wins
    assert r.returncode == 0, r.stderr
    assert os.path.realpath(r.stdout.splitlines()[1]) == \
        os.path.realpath(os.environ["SKV_LIBRARY"])
    # Nothing but the package: no headers, CMake or pkg-config files in site-packages.
    assert sorted(p.name for p in target.iterdir() if not p.name.endswith(".dist-info")) == \
        ["symkv"]
