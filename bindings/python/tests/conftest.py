"""Shared set-up of the Python tests: the package from this checkout, libsymkv.so and
symkv-run from $SKV_LIBRARY / $SKV_RUN (default: build/ of this checkout), a one-PE context in
this process, and a helper that runs a script on N PEs under the real launcher."""

import os
import socket
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
PKG = os.path.dirname(HERE)                      # bindings/python
REPO = os.path.dirname(os.path.dirname(PKG))     # the checkout
PE_DIR = os.path.join(HERE, "pe")

os.environ.setdefault("SKV_LIBRARY", os.path.join(REPO, "build", "libsymkv.so"))
os.environ.setdefault("SKV_RUN", os.path.join(REPO, "build", "symkv-run"))
# Relative paths (SKV_LIBRARY=build/libsymkv.so, as docs/python.md writes it) are the caller's:
# made absolute here, since tests run processes in other folders (test_install).
for _v in ("SKV_LIBRARY", "SKV_RUN"):
    if os.sep in os.environ[_v]:
        os.environ[_v] = os.path.abspath(os.environ[_v])
# Keys of the pinned vectors assume no deployment secret; symkv reads the environment once.
os.environ.pop("SKV_HASH_SECRET", None)
for _v in ("SKV_RANK", "SKV_WORLD_SIZE", "SKV_LOCAL_RANK", "SKV_LOCAL_SIZE", "SKV_BOOTSTRAP",
           "SKV_TOKEN"):
    os.environ.pop(_v, None)  # the in-process contexts below configure themselves
sys.path.insert(0, PKG)

import symkv  # noqa: E402  (the checkout's package, the library under test)

if not os.path.dirname(symkv.__file__).startswith(PKG):
    raise RuntimeError("tests import %s instead of %s" % (symkv.__file__, PKG))


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def single_pe_config(**extra):
    fields = dict(rank=0, world_size=1, bootstrap="tcp://127.0.0.1:%d" % free_port(),
                  token="pytest-%d-token" % os.getpid(), timeout_ms=20000)
    fields.update(extra)
    return fields


@pytest.fixture
def ctx():
    """A one-PE context of this process (closed after the test)."""
    c = symkv.init(**single_pe_config())
    yield c
    c.close()


@pytest.fixture(scope="module")
def mctx():
    """A one-PE context shared by a module's tests."""
    c = symkv.init(**single_pe_config())
    yield c
    c.close()


class PEResult:
    def __init__(self, proc, n):
        self.rc = proc.returncode
        self.out = proc.stdout
        self.err = proc.stderr
        self.n = n

    def lines(self, rank):
        """The lines PE `rank` printed (symkv-run prefixes them with "[rank] ")."""
        pre = "[%d] " % rank
        return [l[len(pre):] for l in (self.out + self.err).splitlines() if l.startswith(pre)]

    def ok(self):
        return self.rc == 0 and all(any(l.startswith("OK") for l in self.lines(r))
                                    for r in range(self.n))

    def __str__(self):
        return "exit %s\n--- stdout\n%s\n--- stderr\n%s" % (self.rc, self.out, self.err)


def run_pes(n, script, *args, env=None, timeout=120, launcher_args=()):
    """Run `python3 script args` on n PEs under symkv-run; returns a PEResult."""
    run = os.environ["SKV_RUN"]
    if not os.access(run, os.X_OK):
        pytest.fail("SKV_RUN=%s is not an executable symkv-run (build it, or set SKV_RUN)" % run)
    e = dict(os.environ)
    e.pop("SKV_RUN", None)  # the tests' variable: the PEs do not need it
    e["PYTHONPATH"] = PKG + os.pathsep + e.get("PYTHONPATH", "")
    e.setdefault("SKV_TIMEOUT_MS", "20000")
    e["PYTHONUNBUFFERED"] = "1"
    if env:
        e.update(env)
    path = script if os.path.isabs(script) else os.path.join(PE_DIR, script)
    cmd = [run, "-n", str(n), "--timeout", str(timeout), *launcher_args, "--",
           sys.executable, path, *map(str, args)]
    proc = subprocess.run(cmd, env=e, capture_output=True, text=True, timeout=timeout + 30)
    return PEResult(proc, n)


@pytest.fixture
def pes():
    return run_pes


def torch_or_skip(cuda=False):
    torch = pytest.importorskip("torch", reason="torch is not installed")
    if cuda and not torch.cuda.is_available():
        pytest.skip("no CUDA device visible to torch")
    return torch


def run_torch_pes(n, script, *args, env=None, timeout=240):
    """Run `python3 script args` on n processes with torch.distributed's environment (RANK,
    WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), as torchrun sets it: no symkv-run.
    Returns a PEResult whose lines are prefixed "[rank] " like symkv-run's."""
    import threading
    e = dict(os.environ)
    e.pop("SKV_RUN", None)
    e["PYTHONPATH"] = PKG + os.pathsep + e.get("PYTHONPATH", "")
    e["PYTHONUNBUFFERED"] = "1"
    e.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(n))
    if env:
        e.update(env)
    path = script if os.path.isabs(script) else os.path.join(PE_DIR, script)
    procs = []
    for r in range(n):
        pe = dict(e, RANK=str(r), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(n))
        procs.append(subprocess.Popen([sys.executable, path, *map(str, args)], env=pe,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [None] * n
    failed = threading.Event()     # a PE exited non-zero: the others get 30 s, not `timeout`

    def collect(r):
        try:
            outs[r] = procs[r].communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            procs[r].kill()
            o, err = procs[r].communicate()
            outs[r] = (o, err + "\n[timed out after %d s]" % timeout)
        if procs[r].returncode != 0:
            failed.set()
    threads = [threading.Thread(target=collect, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    failed_at, killed = None, []
    while any(t.is_alive() for t in threads):
        time.sleep(0.1)
        if failed_at is None and failed.is_set():
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > 30:
            killed = [r for r, p in enumerate(procs) if p.poll() is None]
            for r in killed:
                procs[r].kill()
            break
    for t in threads:
        t.join()
    for r in killed:
        outs[r] = (outs[r][0],
                   outs[r][1] + "\n[killed: still running 30 s after another PE failed]")

    class _P:
        returncode = max((abs(p.returncode) for p in procs), default=0)
        stdout = "".join("".join("[%d] %s\n" % (r, l) for l in outs[r][0].splitlines())
                         for r in range(n))
        stderr = "".join("".join("[%d] %s\n" % (r, l) for l in outs[r][1].splitlines())
                         for r in range(n))
    return PEResult(_P, n)
