"""The symmetric heap: collective allocation, its layout, peers' addresses, and zero-copy numpy
views of host-backed heaps (torch tensors of CUDA ones)."""

import collections
from ctypes import byref, c_void_p

import numpy as np

from . import _arrays, _lib, errors
from ._lib import lib
from ._resource import (BACKEND_NAMES, CollectiveResource, backend_id, check_int, check_uint)

HeapInfo = collections.namedtuple("HeapInfo", [n for n, _ in _lib.HeapInfo._fields_])
HeapInfo.__doc__ = "skv_heap_info_t: offsets and sizes of [signal | scratch | data], the " \
    "stride between PEs' segments, the backend, PEs mapped, this PE, device, base address."

_AREAS = ("signal", "scratch", "data")


class Heap(CollectiveResource):
    """A symmetric heap: every PE's segment has the same layout, PE `pe`'s byte `off` is at
    base + pe * stride + off. Made with Context.heap() (collective); KVCache.heap and
    Comm.heap are views of the heaps those objects own (closing them does nothing)."""

    _what = "heap"

    def __init__(self, ctx, data_bytes, backend="host", signal_bytes=0, scratch_bytes=0):
        opts = _lib.heap_opts_init()
        opts.backend = backend_id(backend)
        opts.data_bytes = check_uint("data_bytes", data_bytes)
        opts.signal_bytes = check_uint("signal_bytes", signal_bytes)
        opts.scratch_bytes = check_uint("scratch_bytes", scratch_bytes)
        h = c_void_p()
        lib.skv_heap_create_ex(ctx.handle, byref(opts), byref(h))
        self._adopt(ctx, h.value)
        self._info = self._get_info()

    @classmethod
    def _borrow(cls, handle, owner):
        self = cls.__new__(cls)
        self._h = handle
        self._borrowed = True
        self._owner = owner  # keeps the owning KV cache / comm object alive
        self._ctx = getattr(owner, "_ctx", None)
        self._info = self._get_info()
        return self

    def _destroy(self, h):
        lib.skv_heap_destroy(h)

    @property
    def handle(self):
        if self._borrowed and getattr(self._owner, "closed", False):
            self._h = None
        return super().handle

    def _get_info(self):
        info = _lib.out_struct(_lib.HeapInfo)
        lib.skv_heap_get_info(self.handle, info)
        return HeapInfo(*[getattr(info, n) for n in HeapInfo._fields])

    @property
    def info(self):
        return self._info

    @property
    def backend(self):
        return BACKEND_NAMES.get(self._info.backend, self._info.backend)

    @property
    def npes(self):
        return self._info.npes

    @property
    def my_pe(self):
        return self._info.my_pe

    @property
    def data_bytes(self):
        return self._info.data_bytes

    def ptr(self, pe=None, offset=0):
        """Address (int) of byte `offset` of PE `pe`'s segment (default: this PE); offsets
        count from the segment start (info.data_offset is where the data area begins)."""
        pe = self._info.my_pe if pe is None else check_int("pe", pe)
        return lib.skv_heap_get_ptr(self.handle, pe, check_uint("offset", offset))

    def _area(self, area, offset, nbytes):
        if area not in _AREAS:
            _lib.invalid("area %r is not one of %s" % (area, ", ".join(_AREAS)))
        start = getattr(self._info, area + "_offset")
        size = getattr(self._info, area + "_bytes")
        offset = check_uint("offset", offset)
        if nbytes is None:
            nbytes = size - offset if offset <= size else 0
        if offset + nbytes > size or nbytes <= 0:
            _lib.raise_error(errors.OutOfRange.code,
                             "heap %s area: bytes %d..%d are outside its %d bytes "
                             "(SKV_ERANGE, python)" % (area, offset, offset + nbytes, size))
        return start + offset, nbytes

    def array(self, dtype=np.uint8, shape=None, offset=0, pe=None, area="data"):
        """A numpy view (zero copy) of PE `pe`'s `area` (data, scratch or signal) from
        `offset`, of `dtype` and `shape` (default: the rest of the area, 1-D). Host-backed
        heaps only (host, cuda_host). The view keeps this object alive but not the memory:
        do not use it after close()."""
        if self._info.backend == _lib.BACKEND_CUDA:
            _lib.raise_error(errors.NotSupported.code,
                             "heap.array: a cuda heap is device memory; use heap.tensor() "
                             "(SKV_ENOTSUP, python)")
        dt = np.dtype(dtype)
        nbytes = None if shape is None else int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        start, nbytes = self._area(area, offset, nbytes)
        if start % dt.itemsize:
            _lib.invalid("heap.array: offset %d is not aligned to %s" % (offset, dt))
        addr = self.ptr(pe, start)
        return _arrays.host_view(addr, nbytes, dt, shape, self)

    def tensor(self, dtype, shape, offset=0, pe=None, area="data"):
        """A torch tensor view (zero copy) of a cuda heap's `area` of PE `pe` (imports torch).
        Peers' segments are readable and writable through it (symmetric addresses)."""
        import torch  # explicit request for a tensor
        if self._info.backend != _lib.BACKEND_CUDA:
            arr = self.array(np.uint8, None if shape is None else
                             (int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size(),),
                             offset, pe, area)
            return torch.from_numpy(arr).view(dtype).reshape(shape)
        esize = torch.empty((), dtype=dtype).element_size()
        nbytes = int(np.prod(shape, dtype=np.int64)) * esize
        start, nbytes = self._area(area, offset, nbytes)
        addr = self.ptr(pe, start)

        class _Cai:
            __cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                        "data": (addr, False), "version": 3, "strides": None}
        raw = torch.as_tensor(_Cai(), device="cuda:%d" % self._info.device)
        t = raw.view(dtype).reshape(shape)
        t._symkv_heap = self  # keep the heap object alive with the view
        return t

    def __repr__(self):
        if self.closed:
            return "<symkv.Heap closed>"
        i = self._info
        return "<symkv.Heap %s, PE %d of %d, data %d bytes>" % (self.backend, i.my_pe, i.npes,
                                                                i.data_bytes)


__all__ = ["Heap", "HeapInfo"]
