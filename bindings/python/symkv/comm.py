"""Tensor-parallel collectives: all-reduce, signals, wait and barrier on numpy arrays (host
backend) or torch CUDA tensors (device pointers, torch's current stream)."""

from ctypes import byref, c_void_p

import numpy as np

from . import _arrays, _lib
from ._lib import lib
from ._resource import CollectiveResource, backend_id, check_int, check_uint

OPS = {"sum": _lib.OP_SUM, "max": _lib.OP_MAX, "min": _lib.OP_MIN}
ALGOS = {"auto": _lib.ALGO_AUTO, "oneshot": _lib.ALGO_ONESHOT, "one_shot": _lib.ALGO_ONESHOT,
         "twoshot": _lib.ALGO_TWOSHOT, "two_shot": _lib.ALGO_TWOSHOT, "nccl": _lib.ALGO_NCCL}
SIGNAL_OPS = {"set": _lib.SIGNAL_SET, "add": _lib.SIGNAL_ADD}
CMPS = {"eq": _lib.CMP_EQ, "==": _lib.CMP_EQ, "ne": _lib.CMP_NE, "!=": _lib.CMP_NE,
        "ge": _lib.CMP_GE, ">=": _lib.CMP_GE, "gt": _lib.CMP_GT, ">": _lib.CMP_GT,
        "lt": _lib.CMP_LT, "<": _lib.CMP_LT, "le": _lib.CMP_LE, "<=": _lib.CMP_LE}
DTYPES = {"float32": _lib.DTYPE_FP32, "fp32": _lib.DTYPE_FP32, "float16": _lib.DTYPE_FP16,
          "fp16": _lib.DTYPE_FP16, "half": _lib.DTYPE_FP16, "bfloat16": _lib.DTYPE_BF16,
          "bf16": _lib.DTYPE_BF16}


def _pick(table, value, what):
    if isinstance(value, str):
        try:
            return table[value.lower()]
        except KeyError:
            _lib.invalid("%s %r is not one of %s" % (what, value, ", ".join(table)))
    return check_int(what, value)


def _dtype_id(info, dtype):
    if dtype is not None:
        if isinstance(dtype, int):
            return dtype
        name = str(dtype).replace("torch.", "")
        if name not in DTYPES:
            _lib.invalid("allreduce dtype %r is not bfloat16, float16 or float32" % (dtype,))
        want = DTYPES[name]
        size = 4 if want == _lib.DTYPE_FP32 else 2
        if info.itemsize != size:
            _lib.invalid("allreduce: dtype %s has %d-byte elements but the array's are %d bytes"
                         % (name, size, info.itemsize))
        return want
    if info.dtype not in DTYPES:
        _lib.invalid("allreduce: dtype %s is not bfloat16, float16 or float32 (pass dtype= to "
                     "reduce raw 16-bit arrays as bf16)" % info.dtype)
    return DTYPES[info.dtype]


def _contiguous(info):
    want = 1
    for n, s in zip(reversed(info.shape), reversed(info.strides)):
        if n != 1 and s != want:
            return False
        want *= n
    return True


class Comm(CollectiveResource):
    """skv_comm_t: one-shot / two-shot all-reduce (NCCL for large messages on CUDA), signals,
    wait and barrier. backend "host" works on numpy arrays (synchronous), "cuda" on torch CUDA
    tensors (stream-ordered on torch's current stream unless stream= is given). Made with
    Context.comm (collective)."""

    _what = "comm"

    def __init__(self, ctx, backend="host", channels=0, nccl=True, max_bytes=0, checked=False):
        opts = _lib.comm_opts_init()
        opts.backend = backend_id(backend)
        opts.channels = check_uint("channels", channels, 32)
        opts.flags = (0 if nccl else _lib.COMM_NO_NCCL) | (_lib.COMM_CHECKED if checked else 0)
        opts.max_bytes = check_uint("max_bytes", max_bytes)
        self.backend = opts.backend
        h = c_void_p()
        lib.skv_comm_create(ctx.handle, byref(opts), byref(h))
        self._adopt(ctx, h.value)

    def _destroy(self, h):
        lib.skv_comm_destroy(h)

    @property
    def heap(self):
        """The comm's heap (a view): arrays in its data area are reduced in place."""
        from .heap import Heap
        return Heap._borrow(lib.skv_comm_get_heap(self.handle), self)

    @property
    def signal_slots(self):
        return lib.skv_comm_get_signal_slots(self.handle)

    def _stream(self, device, stream):
        if self.backend == _lib.BACKEND_HOST:
            if stream is not None:
                _lib.invalid("a host comm takes no stream (it is synchronous)")
            return None
        return _arrays.current_stream(device, stream)

    def allreduce(self, x, out=None, op="sum", algo="auto", channel=0, stream=None,
                  dtype=None):
        """out[i] = op over PEs of x[i]; identical on every PE. `out` defaults to a new array
        (numpy) / tensor (torch) like x; out=x reduces in place. Returns out. Collective."""
        xi = _arrays.describe(x, "allreduce input")
        if out is None:
            if xi.torch:
                out = _arrays._torch().empty_like(x)
            else:
                out = np.empty_like(x)
        oi = _arrays.describe(out, "allreduce output")
        if xi.shape != oi.shape or xi.dtype != oi.dtype or xi.device != oi.device:
            _lib.invalid("allreduce: out (%s %s, device %d) does not match the input (%s %s, "
                         "device %d)" % (oi.shape, oi.dtype, oi.device, xi.shape, xi.dtype,
                                         xi.device))
        if not (_contiguous(xi) and _contiguous(oi)):
            _lib.invalid("allreduce: input and output must be contiguous")
        if not oi.writable:
            _lib.invalid("allreduce: the output array is read-only")
        count = 1
        for n in xi.shape:
            count *= n
        if self.backend == _lib.BACKEND_HOST and xi.device >= 0:
            _lib.invalid("allreduce: a host comm needs host arrays, got CUDA device %d"
                         % xi.device)
        if self.backend != _lib.BACKEND_HOST and xi.device < 0:
            _lib.invalid("allreduce: a cuda comm needs CUDA tensors, got host memory")
        lib.skv_comm_allreduce(self.handle, xi.ptr or None, oi.ptr or None, count,
                          _dtype_id(xi, dtype), _pick(OPS, op, "op"), _pick(ALGOS, algo, "algo"),
                          check_int("channel", channel), self._stream(xi.device, stream))
        return out

    def signal(self, pe, slot, value=1, op="set", stream=None, device=None):
        """Set (op="set") or add (op="add") `value` to signal slot `slot` of PE `pe`."""
        lib.skv_comm_signal(self.handle, check_int("pe", pe), check_uint("slot", slot, 32),
                       check_uint("value", value), _pick(SIGNAL_OPS, op, "signal op"),
                       self._stream(device, stream))

    def wait(self, slot, value, cmp="ge", stream=None, device=None):
        """Wait until this PE's slot compares true with `value` (bounded by the timeout)."""
        lib.skv_comm_wait(self.handle, check_uint("slot", slot, 32), _pick(CMPS, cmp, "cmp"),
                     check_uint("value", value), self._stream(device, stream))

    def barrier(self, channel=0, stream=None, device=None):
        """All PEs (stream-ordered on CUDA), bounded by the timeout. Collective."""
        lib.skv_comm_barrier(self.handle, check_int("channel", channel),
                        self._stream(device, stream))

    def check(self):
        """Raise the device-side failure of an earlier stream-ordered call, if any."""
        lib.skv_comm_check(self.handle)

    def __repr__(self):
        return "<symkv.Comm %s%s>" % ({1: "host", 2: "cuda", 3: "cuda_host"}.get(
            self.backend, self.backend), ", closed" if self.closed else "")


__all__ = ["Comm", "OPS", "ALGOS", "CMPS", "DTYPES"]
