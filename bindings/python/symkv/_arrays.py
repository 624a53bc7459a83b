"""numpy / torch interop without importing torch: a torch tensor is recognised by its type's
module, and torch is only used (from sys.modules) once one was handed in."""

import ctypes
import sys

import numpy as np

from . import _lib


def is_torch(x):
    return type(x).__module__.split(".", 1)[0] == "torch"


def _torch():
    return sys.modules["torch"]


class ArrayInfo:
    """What symkv needs of an array: address, shape, element strides, element size, dtype
    name, CUDA device (-1: host) and whether it may be written."""

    __slots__ = ("obj", "ptr", "shape", "strides", "itemsize", "dtype", "device", "writable",
                 "torch", "kind")

    def __repr__(self):
        return ("ArrayInfo(%s, shape=%s, strides=%s, dtype=%s, device=%d)"
                % (self.kind, self.shape, self.strides, self.dtype, self.device))


def describe(x, what="array"):
    """ArrayInfo of a numpy array or a torch tensor; anything else is an InvalidArgument."""
    info = ArrayInfo()
    info.obj = x
    if is_torch(x):
        torch = _torch()
        if not isinstance(x, torch.Tensor):
            _lib.invalid("%s: a %s is not a torch.Tensor" % (what, type(x).__name__))
        if x.layout != torch.strided:
            _lib.invalid("%s: torch layout %s is not supported (strided tensors only)"
                         % (what, x.layout))
        info.ptr = x.data_ptr()
        info.shape = tuple(x.shape)
        info.strides = tuple(x.stride())
        info.itemsize = x.element_size()
        info.dtype = str(x.dtype).replace("torch.", "")
        if x.is_cuda:
            info.device = x.device.index if x.device.index is not None else \
                torch.cuda.current_device()
        elif x.device.type == "cpu":
            info.device = -1
        else:
            _lib.invalid("%s: tensors on %s are not supported (CUDA or CPU only)"
                         % (what, x.device))
        info.writable = True
        info.torch = True
        info.kind = "torch"
        if x.dtype.is_complex or x.dtype == torch.bool:
            _lib.invalid("%s: dtype %s is not a KV or token element type" % (what, info.dtype))
        return info
    if not isinstance(x, np.ndarray):
        _lib.invalid("%s: expected a numpy array or a torch tensor, got %s"
                     % (what, type(x).__name__))
    if x.dtype.kind not in "iufV" or x.dtype.hasobject or (x.dtype.kind == "V" and x.dtype.fields):
        _lib.invalid("%s: dtype %s is not a numeric element type" % (what, x.dtype))
    info.ptr = x.__array_interface__["data"][0]
    info.shape = tuple(x.shape)
    info.itemsize = x.dtype.itemsize
    if any(s % info.itemsize for s in x.strides):
        _lib.invalid("%s: byte strides %s are not multiples of the element size %d"
                     % (what, x.strides, info.itemsize))
    info.strides = tuple(s // info.itemsize for s in x.strides)
    info.dtype = x.dtype.name
    info.device = -1
    info.writable = bool(x.flags.writeable)
    info.torch = False
    info.kind = "numpy"
    return info


def current_stream(device, stream=None):
    """The cudaStream_t to pass for work on `device`: `stream` as given (an int handle, a
    torch.cuda.Stream or anything with .cuda_stream), else torch's current stream of that
    device (device None: the current device) when torch is loaded, else NULL (host work,
    device -1, or the legacy default stream)."""
    if stream is not None:
        if isinstance(stream, int):
            return stream or None
        handle = getattr(stream, "cuda_stream", None)
        if handle is None:
            handle = getattr(stream, "handle", None)  # cupy-like
        if not isinstance(handle, int):
            _lib.invalid("stream: expected an int cudaStream_t or an object with .cuda_stream, "
                         "got %s" % type(stream).__name__)
        return handle or None
    if device is not None and device < 0:
        return None
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return None
    return torch.cuda.current_stream(device).cuda_stream or None


def host_view(addr, nbytes, dtype, shape, owner):
    """A numpy array over `nbytes` at host address `addr` that keeps `owner` alive."""
    buf = (ctypes.c_char * nbytes).from_address(addr)
    buf._symkv_owner = owner
    dt = np.dtype(dtype)
    count = nbytes // dt.itemsize
    arr = np.frombuffer(buf, dtype=dt, count=count)
    return arr.reshape(shape) if shape is not None else arr


def as_uint_array(x, dtype, what, max_value=None):
    """x (sequence, numpy array, CPU/GPU torch tensor) as a C-contiguous numpy array of the
    unsigned `dtype`, without a copy when it already is one; values are range-checked."""
    if is_torch(x):
        x = x.detach().cpu().numpy()
    if isinstance(x, (bytes, bytearray, str)):
        _lib.invalid("%s: expected integers, got %s" % (what, type(x).__name__))
    if isinstance(x, np.ndarray):
        arr = x
    else:
        try:
            arr = np.asarray(x)
        except (ValueError, TypeError, OverflowError) as e:
            _lib.invalid("%s: cannot be read as integers: %s" % (what, e))
    if arr.ndim == 0:
        arr = arr.reshape(1)
    if arr.size == 0:
        return np.zeros(arr.shape, dtype=dtype)
    if arr.dtype == np.dtype(dtype) and arr.flags.c_contiguous:
        return arr
    if arr.dtype.kind == "b" or arr.dtype.kind not in "iuO":
        _lib.invalid("%s: expected integers, got dtype %s" % (what, arr.dtype))
    if arr.dtype.kind == "O" and not all(isinstance(v, (int, np.integer)) and
                                         not isinstance(v, bool) for v in arr.flat):
        _lib.invalid("%s: expected integers" % what)
    info = np.iinfo(dtype)
    hi = info.max if max_value is None else max_value
    lo_v, hi_v = arr.min(), arr.max()
    if lo_v < 0 or hi_v > hi:
        bad = lo_v if lo_v < 0 else hi_v
        _lib.invalid("%s: value %d is out of range 0..%d" % (what, int(bad), hi))
    return np.ascontiguousarray(arr.astype(dtype))


def ptr(arr, ctype):
    """A ctypes POINTER(ctype) to a numpy array's data (None for an empty array)."""
    if arr.size == 0:
        return None
    return ctypes.cast(arr.__array_interface__["data"][0], ctypes.POINTER(ctype))
