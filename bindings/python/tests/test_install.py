"""`pip install ./bindings/python` gives a package that finds the library via SKV_LIBRARY."""
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
    try:
        import setuptools
    except ImportError:
        return False
    major = int(setuptools.__version__.split(".")[0])
    if major > 70 or (major == 70 and int(setuptools.__version__.split(".")[1]) >= 1):
        return True  # bdist_wheel is part of setuptools
    try:
        import wheel  # noqa: F401  (provides bdist_wheel)
        return True
    except ImportError:
        return False


def test_pip_install_and_import(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(PKG, src, ignore=shutil.ignore_patterns(
        "build", "*.egg-info", "__pycache__", ".pytest_cache", "tests", "libsymkv.so*"))
    target = tmp_path / "site"
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target)]
    if _can_build_offline():
        cmd.append("--no-build-isolation")  # no network needed
    r = subprocess.run(cmd + [str(src)], capture_output=True, text=True, timeout=600,
                       cwd=str(tmp_path))
    if r.returncode != 0 and ("No module named pip" in r.stderr or
                              any(h in r.stderr for h in NETWORK_HINTS)):
        pytest.skip("pip cannot build here (no pip, or the build backend cannot be fetched "
                    "without a network): %s" % r.stderr.strip().splitlines()[-1])
    assert r.returncode == 0, r.stderr
    assert (target / "symkv" / "__init__.py").exists()
    assert (target / "symkv" / "connector.py").exists()
    env = dict(os.environ)
    env["PYTHONPATH"] = str(target)
    r = subprocess.run([sys.executable, "-c",
                        "import symkv; print(symkv.__file__); print(symkv.library_path); "
                        "print(symkv.version_string())"],
                       env=env, capture_output=True, text=True, timeout=60, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    out = r.stdout.splitlines()
    assert out[0].startswith(str(target))
    assert os.path.realpath(out[1]) == os.path.realpath(os.environ["SKV_LIBRARY"])
