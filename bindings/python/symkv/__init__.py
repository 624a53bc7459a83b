"""symkv: node-wide KV cache sharing and tensor-parallel collectives over symmetric memory.

Python bindings (ctypes) of libsymkv.so, found through $SKV_LIBRARY, next to this package, or
on the system library path. Every failing call raises a symkv.Error subclass (InvalidArgument,
Timeout, StaleReference, ...) carrying the code and symkv's detailed message. See
docs/python.md."""

__version__ = "0.2.0"

from . import _lib  # noqa: E402  (loads and checks the library)
from ._lib import lib  # noqa: E402
from .errors import *  # noqa: E402,F401,F403
from .errors import Error, SystemCallError, ERRNO_MAP, error_class  # noqa: E402
from . import log  # noqa: E402

# Route symkv's log to `logging` now; its exit hook is registered before the context module's,
# so at exit contexts are finalized first (still logging to Python), then the sink goes.
log._install()

from .context import Config, Context, init  # noqa: E402
from .heap import Heap, HeapInfo  # noqa: E402
from .kv import (Geometry, Layout, Namespace, KVCache, Lookup, KVStats, LAYOUTS,  # noqa: E402
                 DomainKV, attach,
                 as_keys, as_tokens, as_refs, key_to_int, keys_to_ints, keys_to_hex,
                 hash_tokens, layer_bytes, layer_shape)
from .comm import Comm  # noqa: E402
from . import connector  # noqa: E402,F401

__all__ = (["Config", "Context", "init", "Heap", "HeapInfo", "Geometry", "Layout", "Namespace",
            "KVCache", "DomainKV", "attach", "Lookup", "KVStats", "LAYOUTS", "Comm", "Error", "SystemCallError",
            "ERRNO_MAP", "error_class", "as_keys", "as_tokens", "as_refs", "key_to_int",
            "keys_to_ints", "keys_to_hex", "hash_tokens", "layer_bytes", "layer_shape", "lookup",
            "fetch", "publish", "allreduce", "signal", "wait", "barrier", "version",
            "version_string", "has_function", "strerror", "err_name", "last_error",
            "clear_error", "library_path", "log", "connector"] +
           [row[3] for row in ERRNO_MAP])

library_path = lib.path


def version():
    """(major, minor, patch) of the loaded libsymkv."""
    return _lib.version_tuple(lib.skv_version())


def version_string():
    """The loaded library's version string, e.g. "0.2.0 (host only)"."""
    return lib.skv_version_string().decode()


def has_function(name):
    """Whether the loaded library exports C function `name` (e.g. "skv_comm_allreduce")."""
    return lib.has(name)


def strerror(code):
    return lib.skv_strerror(int(code)).decode()


def err_name(code):
    return lib.skv_err_name(int(code)).decode()


def last_error():
    """This thread's last detailed failure message ("" if none)."""
    return _lib.last_error()


def clear_error():
    lib.skv_clear_error()


def lookup(kv, namespace, keys, pin=False):
    """symkv.lookup(kv, ns, keys, pin=False) == kv.lookup(ns, keys, pin)."""
    return kv.lookup(namespace, keys, pin)


def fetch(kv, refs, layout, block_ids, unpin=False, stream=None):
    """symkv.fetch(kv, refs, layout, block_ids) == kv.fetch(refs, layout, block_ids)."""
    return kv.fetch(refs, layout, block_ids, unpin, stream)


def publish(kv, namespace, keys, layout, block_ids, stream=None):
    """symkv.publish(kv, ns, keys, layout, block_ids) == kv.publish(ns, keys, layout, ...)."""
    return kv.publish(namespace, keys, layout, block_ids, stream)


def allreduce(comm, x, out=None, op="sum", algo="auto", channel=0, stream=None, dtype=None):
    """symkv.allreduce(comm, x, ...) == comm.allreduce(x, ...)."""
    return comm.allreduce(x, out, op, algo, channel, stream, dtype)


def signal(comm, pe, slot, value=1, op="set", stream=None):
    return comm.signal(pe, slot, value, op, stream)


def wait(comm, slot, value, cmp="ge", stream=None):
    return comm.wait(slot, value, cmp, stream)


def barrier(comm_or_ctx, channel=0, stream=None):
    """A comm's stream-ordered barrier, or a context's host barrier."""
    if isinstance(comm_or_ctx, Context):
        return comm_or_ctx.barrier()
    return comm_or_ctx.barrier(channel, stream)
