"""The configuration (skv_config_t, fields set by name) and the context: joining the job,
host collectives and the bootstrap store, and the heaps, KV caches and comms made from it."""

import atexit
import ctypes
import logging
import sys
from ctypes import byref, c_char_p, c_int64, c_size_t, c_void_p

import numpy as np

from . import _lib, errors
from ._lib import lib
from ._resource import Resource, check_int

log = logging.getLogger("symkv")


class Config:
    """skv_config_t. Keyword arguments (and `set`) go through skv_config_set by name, so the
    C library validates them and names the field: Config(rank=0, world_size=2,
    bootstrap="tcp://127.0.0.1:29500", token="..."). Fields left unset come from SKV_* at
    skv_init. None sets a field back to unset."""

    FIELDS = tuple(n for n, _ in _lib.Config._fields_ if n not in ("size", "version"))

    def __init__(self, **fields):
        self._c = _lib.Config()
        lib.skv_config_init(byref(self._c))
        self._strings = {}  # skv_config_set borrows the strings: keep them alive
        for name, value in fields.items():
            self.set(name, value)

    def set(self, name, value):
        if not isinstance(name, str):
            _lib.invalid("config field name %r is not a string" % (name,))
        if value is None:
            raw = None if name in ("bootstrap", "token", "bind_addr") else b"-1"
        elif isinstance(value, bool):
            _lib.invalid("config.%s=%r: give a number or a string" % (name, value))
        elif isinstance(value, bytes):
            raw = value
        else:
            raw = str(value).encode("utf-8")
        if raw is not None and b"\0" in raw:
            _lib.invalid("config.%s contains a NUL character" % name)
        lib.skv_config_set(byref(self._c), name.encode("utf-8"), raw)
        self._strings[name] = raw
        return self

    def validate(self):
        """Check every field as given (without the environment)."""
        lib.skv_config_validate(byref(self._c))
        return self

    def __getattr__(self, name):
        if name in Config.FIELDS:
            v = getattr(self._c, name)
            return v.decode("utf-8") if isinstance(v, bytes) else v
        raise AttributeError(name)

    def as_dict(self):
        return {n: getattr(self, n) for n in Config.FIELDS}

    def __repr__(self):
        d = self.as_dict()
        if d.get("token"):
            d["token"] = "***"
        return "Config(%s)" % ", ".join("%s=%r" % kv for kv in d.items())

    @property
    def struct(self):
        """The ctypes skv_config_t (valid while this Config lives)."""
        return self._c


_open_contexts = []
_exit_state = {"uncaught": False}


class Context(Resource):
    """A PE's membership in the job (skv_init / skv_finalize). Collective.

    Context(config=None, **fields): fields as in Config; with neither, everything comes from
    the environment symkv-run sets. Use it as a context manager, or call close(): closing
    first closes, in reverse creation order, the heaps, KV caches and comms made from it,
    then finalizes. Contexts still open at a normal interpreter exit are closed then (not
    after an uncaught exception, where peers might not join)."""

    _what = "context"

    def __init__(self, config=None, **fields):
        if config is not None and not isinstance(config, Config):
            _lib.invalid("config must be a symkv.Config, got %s" % type(config).__name__)
        if fields:
            config = config or Config()
            for k, v in fields.items():
                config.set(k, v)
        self._config = config
        self._children = []
        h = c_void_p()
        lib.skv_init(byref(config.struct) if config is not None else None, byref(h))
        self._h = h.value
        self._rank = lib.skv_ctx_get_rank(self._h)
        self._world = lib.skv_ctx_get_world_size(self._h)
        _open_contexts.append(self)

    # -- identity ---------------------------------------------------------------------------
    @property
    def rank(self):
        return self._rank

    @property
    def world_size(self):
        return self._world

    @property
    def local_rank(self):
        return lib.skv_ctx_get_local_rank(self.handle)

    @property
    def local_size(self):
        return lib.skv_ctx_get_local_size(self.handle)

    @property
    def timeout_ms(self):
        return lib.skv_ctx_get_timeout_ms(self.handle)

    @timeout_ms.setter
    def timeout_ms(self, ms):
        lib.skv_ctx_set_timeout_ms(self.handle, check_int("timeout_ms", ms))

    @property
    def device(self):
        """This PE's CUDA device; NotSupported without CUDA or a GPU."""
        return lib.skv_ctx_get_device(self.handle)

    def __repr__(self):
        if self.closed:
            return "<symkv.Context closed>"
        return "<symkv.Context rank %d of %d>" % (self._rank, self._world)

    # -- host collectives -------------------------------------------------------------------
    def barrier(self):
        """Host barrier through the bootstrap store. Collective."""
        lib.skv_ctx_barrier(self.handle)

    def allgather(self, data):
        """Every PE contributes the same number of bytes (bytes-like or a numpy array);
        returns a list of world_size bytes objects (numpy: an array with a leading PE axis)
        in rank order. Collective."""
        arr = None
        if isinstance(data, np.ndarray):
            arr = np.ascontiguousarray(data)
            src = arr.view(np.uint8).reshape(-1) if arr.size else np.zeros(0, np.uint8)
            payload = src.tobytes()
        else:
            payload = _lib.as_bytes(data, "allgather data", none_ok=False)
        n = len(payload)
        out = ctypes.create_string_buffer(n * self._world or 1)
        lib.skv_ctx_allgather(self.handle, payload, out, n)
        raw = out.raw[:n * self._world]
        if arr is not None:
            return np.frombuffer(raw, dtype=arr.dtype).reshape((self._world,) + arr.shape).copy()
        return [raw[i * n:(i + 1) * n] for i in range(self._world)]

    def broadcast(self, data, root=0):
        """Root's bytes reach every PE: bytes in, bytes out; a numpy array is filled in place
        (and returned). Every PE passes the same size. Collective."""
        root = check_int("root", root)
        if isinstance(data, np.ndarray):
            if not (data.flags.c_contiguous and data.flags.writeable):
                _lib.invalid("broadcast: the numpy array must be C-contiguous and writable")
            lib.skv_ctx_broadcast(self.handle, data.ctypes.data if data.size else None,
                                  data.nbytes, root)
            return data
        data = _lib.as_bytes(data, "broadcast data", none_ok=False)
        buf = ctypes.create_string_buffer(data, len(data))
        lib.skv_ctx_broadcast(self.handle, buf if len(data) else None, len(data), root)
        return buf.raw

    # -- the bootstrap store (point to point) -----------------------------------------------
    @staticmethod
    def _key(key):
        k = _lib.as_bytes(key, "store key", none_ok=False)
        if b"\0" in k:
            _lib.invalid("store key %r contains a NUL character" % key)
        return k

    def store_set(self, key, value):
        value = _lib.as_bytes(value, "store value", none_ok=False)
        lib.skv_store_set(self.handle, self._key(key), value, len(value))

    def store_get(self, key):
        """Wait (bounded by the timeout) until `key` exists; returns its bytes."""
        k = self._key(key)
        cap = 65536  # a larger value costs one more round trip
        while True:
            buf = ctypes.create_string_buffer(cap)
            n = c_size_t()
            try:
                lib.skv_store_get(self.handle, k, buf, cap, byref(n))
            except errors.OutOfRange:
                if n.value > cap:
                    cap = n.value
                    continue
                raise
            return buf.raw[:n.value]

    def store_add(self, key, delta=1):
        """Atomically add `delta` to the 64-bit counter `key`; returns the new value."""
        r = c_int64()
        lib.skv_store_add(self.handle, self._key(key),
                          check_int("delta", delta, -(1 << 63), (1 << 63) - 1), byref(r))
        return r.value

    def store_wait(self, *keys):
        """Wait until every key exists (bounded by the timeout)."""
        if len(keys) == 1 and isinstance(keys[0], (list, tuple)):
            keys = keys[0]
        arr = (c_char_p * max(1, len(keys)))(*[self._key(k) for k in keys])
        lib.skv_store_wait(self.handle, arr, len(keys))

    # -- objects made from the context ------------------------------------------------------
    def heap(self, data_bytes, backend="host", signal_bytes=0, scratch_bytes=0):
        """A symmetric heap (collective); see symkv.Heap."""
        from .heap import Heap
        return Heap(self, data_bytes, backend, signal_bytes, scratch_bytes)

    def kv_cache(self, geometry, pages_per_pe, backend="host", index_slots=0):
        """The node-wide KV cache (collective); see symkv.KVCache."""
        from .kv import KVCache
        return KVCache(self, geometry, pages_per_pe, backend, index_slots)

    def comm(self, backend="host", channels=0, nccl=True, max_bytes=0, checked=False):
        """Collectives, signals and barrier (collective); see symkv.Comm. checked=True: every
        all-reduce and barrier is checked against every PE's (docs/comm.md, "Checking mode")."""
        from .comm import Comm
        return Comm(self, backend, channels, nccl, max_bytes, checked)

    # -- closing ----------------------------------------------------------------------------
    def close(self):
        """Collective: close the objects made from this context (newest first), then
        skv_finalize (a final barrier bounded by the timeout). The context is gone even when
        this raises; the first error is raised after everything was released."""
        if not self._h:
            return
        first = None
        for child in reversed(list(self._children)):
            try:
                child.close()
            except errors.Error as e:
                first = first or e
        self._children.clear()
        h, self._h = self._h, None
        try:
            _open_contexts.remove(self)
        except ValueError:
            pass
        try:
            lib.skv_finalize(h)  # frees the context even when it fails
        except errors.Error as e:
            first = first or e
        if first is not None:
            raise first

    finalize = close

    def __del__(self):
        # Only at interpreter teardown (open contexts are referenced by _open_contexts).
        pass


def _excepthook(tp, value, tb):
    _exit_state["uncaught"] = True
    return _prev_excepthook(tp, value, tb)


_prev_excepthook = sys.excepthook
sys.excepthook = _excepthook


def _close_at_exit():
    if not _open_contexts:
        return
    if _exit_state["uncaught"]:
        # Peers may be anywhere: a collective finalize could only wait for them. Exiting
        # releases the memory; peers see this PE leave (SKV_EPEERDEAD) instead of a hang.
        log.info("symkv: not finalizing %d open context(s) after an uncaught exception",
                 len(_open_contexts))
        return
    for ctx in reversed(list(_open_contexts)):
        try:
            ctx.close()
        except errors.Error as e:
            log.warning("symkv: closing a context at exit: %s", e)


atexit.register(_close_at_exit)


def init(config=None, **fields):
    """symkv.init(**fields) -> Context (skv_init); fields as in Config."""
    return Context(config, **fields)


__all__ = ["Config", "Context", "init"]
