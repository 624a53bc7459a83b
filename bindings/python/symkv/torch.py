"""symkv for PyTorch: a symkv comm made from a torch process group (or any torch Store), whose
store does the bootstrap, so torchrun or an engine's workers need no symkv-run; tensors on the
symmetric heap (`empty`); the all-reduce as torch.library ops (`torch.ops.symkv.all_reduce`,
`all_reduce_`) with fake implementations, so torch.compile(fullgraph=True) traces them and CUDA
graphs capture them; and `CustomAllreduce`, shaped like vLLM's custom all-reduce.

CUDA tensors use the comm's CUDA backend (stream-ordered on torch's current stream); CPU
tensors use the host backend (synchronous), which is how the ops, their tracing and the
process-group bootstrap are tested without a GPU. See docs/python.md, "PyTorch"."""

import contextlib
import ctypes
import itertools
import logging
import os
import re
import shutil
import socket
import threading
import time
import weakref

import torch
import torch.distributed as dist

from . import _lib, errors
from ._lib import lib
from .comm import ALGOS, OPS
from .context import Context

DTYPES = {torch.float32: _lib.DTYPE_FP32, torch.float16: _lib.DTYPE_FP16,
          torch.bfloat16: _lib.DTYPE_BF16}
ALIGN = 256  # bytes: every empty() tensor starts at a multiple (16 takes the kernels' fast path)

_log = logging.getLogger("symkv.torch")
_groups = {}  # id -> Group: the ops name their group by this int (ops take no Python objects)
_ids = itertools.count(1)
_default = [None]
_seq = {}  # store prefix -> how many groups were made on it (the same on every rank)
_seq_lock = threading.Lock()


def _invalid(msg):
    _lib.invalid(msg)


def _free_port(host):
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(fam, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class _Allocator:
    """First fit over [0, size) of the comm heap's data area, ALIGN-byte blocks. Offsets are the
    same on every PE when every PE allocates and frees the same sizes in the same order."""

    def __init__(self, size):
        self.size = size
        self.free_list = [(0, size)]  # sorted (offset, bytes)
        self.lock = threading.Lock()

    def alloc(self, nbytes):
        nbytes = max(ALIGN, (nbytes + ALIGN - 1) // ALIGN * ALIGN)
        with self.lock:
            for i, (off, n) in enumerate(self.free_list):
                if n >= nbytes:
                    if n == nbytes:
                        del self.free_list[i]
                    else:
                        self.free_list[i] = (off + nbytes, n - nbytes)
                    return off, nbytes
        return None, nbytes

    def free(self, off, nbytes):
        with self.lock:
            fl = self.free_list
            fl.append((off, nbytes))
            fl.sort()
            merged = [fl[0]]
            for o, n in fl[1:]:
                po, pn = merged[-1]
                if po + pn == o:
                    merged[-1] = (po, pn + n)
                else:
                    merged.append((o, n))
            self.free_list = merged

    def used(self):
        with self.lock:
            return self.size - sum(n for _, n in self.free_list)


class _Block:
    """The memory of one empty() tensor; its storage keeps this object alive, and the block
    returns to the allocator when the last tensor viewing it is gone."""

    def __init__(self, group, addr, nbytes, device):
        self.addr = addr
        self.nbytes = nbytes
        if device >= 0:
            self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                             "data": (addr, False), "version": 3,
                                             "strides": None}
        else:
            self.__array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                        "data": (addr, False), "version": 3}


class Group:
    """A symkv context and comm over the ranks of a torch process group.

    Group(group=None, device=None, ...) is collective over the process group: rank 0 of the
    group picks a free port on `host`, publishes "tcp://host:port" and a fresh token through
    the group's store (the default store under the prefix "symkv/<group name>/<n>/"), and every
    rank joins with skv_init. `store=`, `rank=` and `world_size=` bootstrap from any
    torch.distributed.Store instead (no process group needed).

    device: "cpu" (host backend, CPU tensors), "cuda" / "cuda:N" / a torch.device / an int
    (CUDA backend on that GPU); default: the current CUDA device if CUDA is available, else CPU.
    max_bytes is the largest message of the symmetric algorithms and the size of the heap that
    `empty` allocates from; channels, nccl: as skv_comm_opts_t."""

    def __init__(self, group=None, device=None, max_bytes=64 << 20, channels=0, nccl=True,
                 timeout_ms=None, host="127.0.0.1", store=None, rank=None, world_size=None,
                 checked=False):
        self.device = _device(device)
        if store is None:
            if not dist.is_initialized():
                _invalid("symkv.torch.Group: torch.distributed is not initialised; call "
                         "dist.init_process_group first, or pass store=, rank= and world_size=")
            pg = group or dist.group.WORLD
            rank = dist.get_rank(pg)
            if rank < 0:
                _invalid("symkv.torch.Group: this process (global rank %d) is not in the group"
                         % dist.get_rank())
            world_size = dist.get_world_size(pg)
            name = getattr(pg, "group_name", None) or "default"
            base = dist.distributed_c10d._get_default_store()
        else:
            if rank is None or world_size is None:
                _invalid("symkv.torch.Group: store= needs rank= and world_size=")
            name, base = "store", store
        with _seq_lock:
            # a process group's name is unique in the job; a store given is held by the caller
            key = ("pg", name) if store is None else (id(store), name)
            n = _seq.get(key, 0)
            _seq[key] = n + 1
        st = dist.PrefixStore("symkv/%s/%d/" % (name, n), base)
        if rank == 0:
            port = _free_port(host)
            boot = ("tcp://[%s]:%d" if ":" in host else "tcp://%s:%d") % (host, port)
            st.set("bootstrap", "%s %s" % (boot, os.urandom(16).hex()))
        boot, token = st.get("bootstrap").decode().split()
        fields = dict(rank=rank, world_size=world_size, bootstrap=boot, token=token)
        if timeout_ms is not None:
            fields["timeout_ms"] = timeout_ms
        if self.device.type == "cuda":
            fields["device"] = self.device.index
        self.ctx = Context(**fields)
        try:
            self.comm = self.ctx.comm(backend="cuda" if self.device.type == "cuda" else "host",
                                      channels=channels, nccl=nccl, max_bytes=max_bytes,
                                      checked=checked)
        except BaseException:
            self.ctx.close()
            raise
        self.rank, self.world_size = rank, world_size
        self._h = self.comm.handle
        self._fn = lib.skv_comm_allreduce
        self._cuda = self.device.type == "cuda"
        self._index = self.device.index if self._cuda else -1
        heap = self.comm.heap
        info = heap.info
        self.heap = heap
        self._data = heap.ptr(None, info.data_offset)
        self.stride = info.stride
        self.data_bytes = info.data_bytes
        self._alloc = _Allocator(info.data_bytes)
        self.id = next(_ids)
        _groups[self.id] = self
        if _cpp is not None:  # the C++ kernels' table (symkv/_torch_ops.cpp)
            _cpp.set_group(self.id, self._h, _ALLREDUCE_ADDR, self._index)
        if _default[0] is None:
            _default[0] = self

    # -- the all-reduce --------------------------------------------------------------------------
    def _reduce(self, x, out, op, algo, channel):
        # The eager fast path (docs/python.md, "Overhead"): one dict lookup per argument, no
        # torch.device objects, the raw current stream.
        dt = DTYPES.get(x.dtype)
        if dt is None:
            _invalid("symkv all_reduce: dtype %s is not bfloat16, float16 or float32" % x.dtype)
        if x.is_cuda != self._cuda:
            _invalid("symkv all_reduce: a tensor on %s, but this group's comm is on %s"
                     % (x.device, self.device))
        n = x.numel()
        if n == 0:
            return
        if self._cuda:
            if x.get_device() != self._index:
                _invalid("symkv all_reduce: a tensor on %s, but this group's comm is on %s"
                         % (x.device, self.device))
            stream = _raw_stream(self._index)
        else:
            stream = None
        o = OPS.get(op)
        if o is None:
            o = _pick(OPS, op, "op")
        a = ALGOS.get(algo)
        if a is None:
            a = _pick(ALGOS, algo, "algo")
        self._fn(self._h, x.data_ptr(), out.data_ptr(), n, dt, o, a, channel, stream)

    def all_reduce(self, x, op="sum", algo="auto", channel=0):
        """A new tensor: op over the group's ranks of x (torch.ops.symkv.all_reduce; where its
        kernels are Python ones, plain eager mode calls the kernel directly, see _eager)."""
        if _py_kernels and _eager(x):
            return _all_reduce(x, self.id, op, algo, channel)
        return _OP(x, self.id, op, algo, channel)

    def all_reduce_(self, x, op="sum", algo="auto", channel=0):
        """x reduced in place (torch.ops.symkv.all_reduce_); returns x."""
        if _py_kernels and _eager(x):
            _all_reduce_(x, self.id, op, algo, channel)
        else:
            _OP_(x, self.id, op, algo, channel)
        return x

    # -- symmetric tensors ---------------------------------------------------------------------
    def empty(self, shape, dtype=torch.float32, device=None):
        """An uninitialised tensor in this group's symmetric heap (the comm heap's data area).
        Every rank that makes the same empty() calls, and frees the same tensors, in the same
        order gets the same offset, so peer(t, pe) is PE pe's tensor (see rendezvous)."""
        if device is not None and _device(device) != self.device:
            _invalid("symkv.torch.empty: device %s, but this group is on %s" % (device,
                                                                                  self.device))
        shape = tuple(shape) if isinstance(shape, (tuple, list, torch.Size)) else (shape,)
        numel = 1
        for s in shape:
            if int(s) < 0:
                _invalid("symkv.torch.empty: negative size in %s" % (shape,))
            numel *= int(s)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        off, size = self._alloc.alloc(nbytes)
        if off is None:
            _lib.raise_error(errors.NoSpace.code, "symkv.torch.empty: %d bytes do not fit in the "
                             "group's heap (%d of %d bytes used); make the Group with a larger "
                             "max_bytes (SKV_ENOSPC, python)" % (size, self._alloc.used(),
                                                                 self.data_bytes))
        return self._tensor(off, size, shape, dtype, None)

    def _tensor(self, off, size, shape, dtype, pe):
        addr = self._data + off if pe is None else self.heap.ptr(pe, self.heap.info.data_offset
                                                                 + off)
        block = _Block(self, addr, size, self.device.index if self._cuda else -1)
        if pe is None:
            weakref.finalize(block, self._alloc.free, off, size)
        if self._cuda:
            raw = torch.as_tensor(block, device=self.device)
        else:
            import numpy as np
            raw = torch.from_numpy(np.asarray(block))
        nb = 1
        for s in shape:
            nb *= s
        nb *= torch.empty((), dtype=dtype).element_size()
        t = raw[:nb].view(dtype).view(shape)
        return t

    def offset(self, t):
        """Byte offset of tensor t from the start of this rank's heap data area (InvalidArgument
        when t is not in it)."""
        p = t.data_ptr()
        if not (self._data <= p < self._data + self.data_bytes):
            _invalid("tensor at 0x%x is not in this group's symmetric heap" % p)
        return p - self._data

    def peer(self, t, pe):
        """PE pe's tensor at the same offset, shape and dtype as t (a view of its memory)."""
        off = self.offset(t)
        if not t.is_contiguous():
            _invalid("symkv.torch.peer: tensor must be contiguous")
        size = t.numel() * t.element_size()
        return self._tensor(off, size, tuple(t.shape), t.dtype, pe)

    def rendezvous(self, t):
        """Collective: check that t has the same offset and size on every rank (InvalidArgument
        naming the ranks otherwise); returns the list of every PE's tensor (peer views)."""
        import numpy as np
        mine = np.array([self.offset(t), t.numel() * t.element_size()], dtype=np.int64)
        allv = self.ctx.allgather(mine)
        if not (allv == allv[0]).all():
            _invalid("symkv.torch.rendezvous: tensors differ between ranks (offset, bytes): %s; "
                     "make the same empty() calls in the same order everywhere"
                     % [tuple(int(v) for v in r) for r in allv])
        return [t if pe == self.rank else self.peer(t, pe) for pe in range(self.world_size)]

    def barrier(self):
        """Stream-ordered barrier of the comm (CUDA), or a synchronous one (CPU)."""
        self.comm.barrier()

    def close(self):
        """Collective: destroys the comm and the context."""
        if _groups.pop(getattr(self, "id", None), None) is not None:
            if _cpp is not None:
                _cpp.set_group(self.id, 0, 0, -1)
            if _default[0] is self:
                _default[0] = None
            self.ctx.close()

    @property
    def closed(self):
        return self.id not in _groups

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return "<symkv.torch.Group %d: rank %d of %d on %s%s>" % (
            self.id, self.rank, self.world_size, self.device, ", closed" if self.closed else "")


def _raw_stream(index):
    """torch's current stream of CUDA device `index` as an int cudaStream_t (0: legacy)."""
    return torch._C._cuda_getCurrentRawStream(index) or None


def _pick(table, value, what):
    if isinstance(value, str) and value.lower() in table:
        return table[value.lower()]
    _invalid("symkv all_reduce: %s %r is not one of %s" % (what, value, ", ".join(table)))


def _device(device):
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
    if isinstance(device, int):
        return torch.device("cuda", device)
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    if d.type not in ("cuda", "cpu"):
        _invalid("symkv.torch: device %s is not CUDA or CPU" % d)
    return d


def _group(gid):
    g = _groups.get(gid)
    if g is None:
        _invalid("symkv all_reduce: group %r is not an open symkv.torch.Group (closed, or made "
                 "in another process)" % (gid,))
    return g


def init(group=None, **kw):
    """symkv.torch.Group(group, **kw); the first one made becomes the default of empty()."""
    return Group(group, **kw)


def default_group():
    if _default[0] is None:
        _invalid("symkv.torch: no open Group; make one with symkv.torch.init(process_group)")
    return _default[0]


def empty(shape, dtype=torch.float32, device=None, group=None):
    """A tensor on the symmetric heap of `group` (default: the first Group made)."""
    return (group or default_group()).empty(shape, dtype, device)


# -- torch.library ops ----------------------------------------------------------------------------
_LIB = torch.library.Library("symkv", "DEF")
_LIB.define("all_reduce(Tensor x, int group, str op='sum', str algo='auto', int channel=0) -> Tensor")
_LIB.define("all_reduce_(Tensor(a!) x, int group, str op='sum', str algo='auto', int channel=0) -> ()")


def _all_reduce(x, group, op="sum", algo="auto", channel=0):
    g = _groups.get(group) or _group(group)
    if not x.is_contiguous():
        x = x.contiguous()
    out = torch.empty_like(x)
    g._reduce(x, out, op, algo, channel)
    return out


def _all_reduce_(x, group, op="sum", algo="auto", channel=0):
    g = _groups.get(group) or _group(group)
    if x.is_contiguous():
        g._reduce(x, x, op, algo, channel)
    else:
        y = x.contiguous()
        g._reduce(y, y, op, algo, channel)
        x.copy_(y)


def _raise(rc):
    raise _lib.error_from_code(rc, "skv_comm_allreduce")


# A build of the op kernels takes a minute or two; a lock older than this was left by one that
# was stopped (killed, out of memory) and is never removed.
_BUILD_LOCK_STALE_S = 600


class _StaleBuildLock(Exception):
    pass


def _wait_build_lock(lock):
    """Wait while another process builds the op kernels (torch's lock file `lock` there); raise
    _StaleBuildLock (after a warning) when the lock is older than _BUILD_LOCK_STALE_S, or becomes
    so: torch's own wait for it has no end, so an import would hang for good."""
    while True:
        try:
            age = time.time() - os.stat(lock).st_mtime
        except FileNotFoundError:
            return
        if age > _BUILD_LOCK_STALE_S:
            _log.warning("symkv.torch: the C++ op kernels were not built: %s is %.0f s old, left "
                         "by a build that stopped (torch would wait for it forever); remove it "
                         "and import again to build them. The Python kernels serve "
                         "torch.ops.symkv.* meanwhile (SKV_TORCH_CPP=0 skips the build)",
                         lock, age)
            raise _StaleBuildLock(lock)
        time.sleep(0.2)


def _bounded_baton(baton):
    """torch's FileBaton with _wait_build_lock's wait: a process that finds the lock taken (another
    builds, or one that stopped left it) waits for it as long as it may be a live build's."""
    class Baton(baton):
        def wait(self):
            _wait_build_lock(self.lock_file_path)
    return Baton


def _load_cpp():
    """The op kernels in C++ (symkv/_torch_ops.cpp), built once per torch version with
    torch.utils.cpp_extension and cached (TORCH_EXTENSIONS_DIR); None where SKV_TORCH_CPP=0, the
    build fails (no compiler, no ninja) or a stopped build left its lock (_wait_build_lock): the
    Python kernels then serve, about 5 us slower per torch.ops call (docs/python.md,
    "Overhead")."""
    if os.environ.get("SKV_TORCH_CPP", "1") == "0" or \
            isinstance(lib.skv_comm_allreduce, _lib._Missing):
        return None
    quiet = logging.getLogger("torch.utils.cpp_extension")  # its notes on CUDA_HOME
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        from torch.utils import cpp_extension
        src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_torch_ops.cpp")
        cuda = torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None
        name = "symkv_torch_ops_%s%s" % (re.sub(r"\W", "_", torch.__version__),
                                         "_cuda" if cuda else "")
        # no .cu file is compiled, but torch derives arch flags from the visible GPUs and
        # fails on a machine with none unless a list is set
        arch = os.environ.get("TORCH_CUDA_ARCH_LIST")
        if cuda and not arch:
            os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0"
        path = os.environ.get("PATH", "")
        if shutil.which("ninja") is None:  # torch runs `ninja`; PyPI's package has one
            try:
                import ninja
                os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + path
            except ImportError:
                pass
        # torch takes the build's lock and, when another process holds it, waits for it
        # without an end: its wait is bounded (_wait_build_lock) for this build
        baton = getattr(cpp_extension, "FileBaton", None)
        if baton is not None:
            cpp_extension.FileBaton = _bounded_baton(baton)
        try:
            mod = cpp_extension.load(name=name, sources=[src], with_cuda=cuda, verbose=False,
                                     extra_cflags=["-O2"] + (["-DSYMKV_TORCH_CUDA"] if cuda
                                                             else []))
        finally:
            if baton is not None:
                cpp_extension.FileBaton = baton
            os.environ["PATH"] = path
            if cuda and not arch:
                os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
    except _StaleBuildLock:  # said so
        return None
    except Exception as e:  # noqa: BLE001 - any failure leaves the Python kernels in place
        last = (str(e).strip().splitlines() or [""])[-1]
        _log.warning("symkv.torch: the C++ op kernels were not built (%s: %s); the Python "
                     "kernels serve torch.ops.symkv.* (SKV_TORCH_CPP=0 skips the build)",
                     type(e).__name__, last)
        return None
    finally:
        quiet.setLevel(level)
    mod.set_tables([DTYPES[torch.float32], DTYPES[torch.float16], DTYPES[torch.bfloat16]],
                   sorted(OPS.items()), sorted(ALGOS.items()), _all_reduce, _all_reduce_, _raise)
    return mod


_cpp = _load_cpp()
_ALLREDUCE_ADDR = ctypes.cast(lib.skv_comm_allreduce, ctypes.c_void_p).value if _cpp else 0
# the keys the C++ library did not take (a build without CUDA headers leaves CUDA to Python)
_py_kernels = ("CPU", "CUDA") if _cpp is None else () if _cpp.has_cuda() else ("CUDA",)
for _key in _py_kernels:
    _LIB.impl("all_reduce", _all_reduce, _key)
    _LIB.impl("all_reduce_", _all_reduce_, _key)
_OP, _OP_ = torch.ops.symkv.all_reduce.default, torch.ops.symkv.all_reduce_.default


@torch.library.register_fake("symkv::all_reduce")
def _all_reduce_fake(x, group, op="sum", algo="auto", channel=0):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.register_fake("symkv::all_reduce_")
def _all_reduce__fake(x, group, op="sum", algo="auto", channel=0):
    return None


_is_compiling = torch.compiler.is_compiling
_dispatch_modes = torch._C._len_torch_dispatch_stack
_functorch_active = getattr(torch._C, "_are_functorch_transforms_active", lambda: False)


def _eager(x):
    """Whether calling the op's kernel directly is exactly what torch.ops would run: a plain
    tensor, no autograd to record, not under torch.compile (Dynamo traces the torch.ops call:
    is_compiling() is True there), no dispatch mode (make_fx, FakeTensorMode,
    functionalisation) and no functorch transform. Saves torch's dispatch into a Python
    kernel (docs/python.md, "Overhead")."""
    return (not _is_compiling() and type(x) is torch.Tensor and not _dispatch_modes()
            and not (x.requires_grad and torch.is_grad_enabled()) and not _functorch_active())


def all_reduce(x, op="sum", algo="auto", channel=0, group=None):
    """torch.ops.symkv.all_reduce on `group` (default: the first Group made)."""
    return (group or default_group()).all_reduce(x, op, algo, channel)


def all_reduce_(x, op="sum", algo="auto", channel=0, group=None):
    """torch.ops.symkv.all_reduce_ (in place); returns x."""
    return (group or default_group()).all_reduce_(x, op, algo, channel)


# -- vLLM's custom all-reduce slot -------------------------------------------------------------
class CustomAllreduce:
    """The shape of vLLM's CustomAllreduce over symkv: should_custom_ar(inp) says whether
    custom_all_reduce(inp) takes the tensor (else it returns None and the caller uses NCCL);
    capture() brackets CUDA graph capture. Made collectively over the process group."""

    _SUPPORTED_WORLD_SIZES = (2, 4, 6, 8)

    def __init__(self, group, device, max_size=8192 * 1024, algo="auto", **kw):
        self.disabled = True
        self._IS_CAPTURING = False
        self.max_size = max_size
        self.algo = algo
        world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.world_size = world
        self.fully_connected = True
        if world == 1:
            self.group = None
            return
        self.group = Group(group, device=device, max_bytes=max(max_size, 1 << 20), **kw)
        self.device = self.group.device
        self.disabled = False

    def should_custom_ar(self, inp):
        if self.disabled:
            return False
        nbytes = inp.numel() * inp.element_size()
        return (inp.dtype in DTYPES and nbytes % 16 == 0 and 0 < nbytes <= self.max_size
                and inp.is_contiguous() and inp.device == self.device)

    def custom_all_reduce(self, input):
        """The sum over ranks as a new tensor, or None when this all-reduce is not for us."""
        if self.disabled or not self.should_custom_ar(input):
            return None
        return self.group.all_reduce(input, "sum", self.algo)

    def all_reduce(self, inp, out=None, registered=False):
        if out is None:
            return self.group.all_reduce(inp, "sum", self.algo)
        out.copy_(inp)
        return self.group.all_reduce_(out, "sum", self.algo)

    @contextlib.contextmanager
    def capture(self):
        """Around CUDA graph capture: symkv needs no buffer registration after capture (its
        kernels keep their epochs in device memory, so replays stay in step)."""
        try:
            self._IS_CAPTURING = True
            yield
        finally:
            self._IS_CAPTURING = False

    def close(self):
        if self.group is not None and not self.group.closed:
            self.group.close()
        self.disabled = True

    def __del__(self):
        pass  # collective objects are never destroyed by garbage collection (docs/python.md)


__all__ = ["Group", "init", "default_group", "empty", "all_reduce", "all_reduce_",
           "CustomAllreduce", "DTYPES"]
