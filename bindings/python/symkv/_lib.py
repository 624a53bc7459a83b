"""Loads libsymkv.so, checks its version and struct sizes, and declares every C function of
include/symkv.h with argtypes/restype; failing calls raise symkv.Error subclasses."""

import ctypes
import ctypes.util
import numbers
import os
import re
from ctypes import (POINTER, Structure, byref, c_char, c_char_p, c_int, c_int32, c_int64,
                    c_size_t, c_uint, c_uint32, c_uint64, c_void_p)

from . import errors

# The C library version this package is written against (include/symkv.h SKV_VERSION_*).
EXPECTED_MAJOR = 0
MIN_MINOR = 2

# ---- constants of symkv.h ---------------------------------------------------------------------

SKV_CONFIG_VERSION = 1
SKV_HEAP_OPTS_VERSION = 1
SKV_GEOMETRY_VERSION = 1
SKV_LAYOUT_DESC_VERSION = 1
SKV_KV_OPTS_VERSION = 1
SKV_ATTACH_OPTS_VERSION = 1
ROLE_OWNER, ROLE_READER = 1, 2
SKV_COMM_OPTS_VERSION = 1

LOG_NONE, LOG_WARN, LOG_INFO, LOG_TRACE = 0, 1, 2, 3
SUBSYS = {"INIT": 0x01, "BOOT": 0x02, "HEAP": 0x04, "POOL": 0x08, "INDEX": 0x10, "KV": 0x20,
          "COMM": 0x40, "BENCH": 0x80}
SUBSYS_ALL = 0xFF

BACKEND_HOST, BACKEND_CUDA, BACKEND_CUDA_HOST = 1, 2, 3
KV_SPLIT, KV_MLA = 0, 1
LAYOUT_CUSTOM = 0
LAYOUT_VLLM_FLASH_NHD = 1
LAYOUT_VLLM_FLASH_HND = 2
LAYOUT_FLASHINFER_NHD = 3
LAYOUT_FLASHINFER_HND = 4
LAYOUT_MLA = 5
LAYOUT_CONTIGUOUS = 6
LOOKUP_PIN = 1
FETCH_UNPIN = 1
DTYPE_BF16, DTYPE_FP16, DTYPE_FP32 = 1, 2, 3
OP_SUM, OP_MAX, OP_MIN = 0, 1, 2
ALGO_AUTO, ALGO_ONESHOT, ALGO_TWOSHOT, ALGO_NCCL = 0, 1, 2, 3
SIGNAL_SET, SIGNAL_ADD = 0, 1
CMP_EQ, CMP_NE, CMP_GE, CMP_GT, CMP_LT, CMP_LE = 0, 1, 2, 3, 4, 5
COMM_NO_NCCL = 1
COMM_CHECKED = 2  # checking mode: every all-reduce and barrier checked against every PE's
STORE_MAX_KEY = 256
STORE_MAX_VALUE = 16 << 20

# ---- structs (field for field as in symkv.h) --------------------------------------------------


class Config(Structure):
    _fields_ = [("size", c_size_t), ("version", c_uint32), ("rank", c_int32),
                ("world_size", c_int32), ("local_rank", c_int32), ("local_size", c_int32),
                ("timeout_ms", c_int32), ("device", c_int32), ("flags", c_uint32),
                ("bootstrap", c_char_p), ("token", c_char_p), ("bind_addr", c_char_p)]


class HeapOpts(Structure):
    _fields_ = [("size", c_size_t), ("version", c_uint32), ("backend", c_int32),
                ("data_bytes", c_uint64), ("signal_bytes", c_uint64), ("scratch_bytes", c_uint64)]


class HeapInfo(Structure):
    _fields_ = [("size", c_size_t), ("segment_bytes", c_uint64), ("stride", c_uint64), ("signal_offset", c_uint64),
                ("signal_bytes", c_uint64), ("scratch_offset", c_uint64),
                ("scratch_bytes", c_uint64), ("data_offset", c_uint64), ("data_bytes", c_uint64),
                ("backend", c_int32), ("npes", c_int32), ("my_pe", c_int32), ("device", c_int32),
                ("base", c_void_p)]


class Geometry(Structure):
    _fields_ = [("size", c_size_t), ("version", c_uint32), ("kv_kind", c_uint32),
                ("num_layers", c_uint32), ("num_kv_heads", c_uint32), ("head_dim", c_uint32),
                ("elem_bytes", c_uint32), ("page_tokens", c_uint32)]


class LayoutDesc(Structure):
    _fields_ = [("size", c_size_t), ("version", c_uint32), ("block_tokens", c_uint32),
                ("num_blocks", c_uint64), ("k_base", POINTER(c_void_p)),
                ("v_base", POINTER(c_void_p)), ("stride_block", c_int64),
                ("stride_token", c_int64), ("stride_head", c_int64), ("device", c_int32)]


class Key(Structure):
    _fields_ = [("hi", c_uint64), ("lo", c_uint64)]


class PageRef(Structure):
    _fields_ = [("pe", c_uint32), ("page", c_uint32), ("gen", c_uint32), ("reserved", c_uint32)]


class KvOpts(Structure):
    _fields_ = [("size", c_size_t), ("version", c_uint32), ("backend", c_int32),
                ("pages_per_pe", c_uint64), ("index_slots", c_uint64)]


class AttachOpts(Structure):
    _fields_ = [("size", c_size_t), ("version", c_uint32), ("role", c_int32),
                ("backend", c_int32), ("timeout_ms", c_int32), ("device", c_int32),
                ("group", c_int32), ("max_slots", c_uint32), ("flags", c_uint32),
                ("pages_per_pe", c_uint64), ("index_slots", c_uint64), ("ns", c_void_p)]


class KvStats(Structure):
    _fields_ = [("size", c_size_t)] + [(n, c_uint64) for n in (
        "page_bytes", "pages_per_pe", "pages_used", "pages_pinned", "index_slots",
        "index_entries", "lookups", "lookup_hits", "published", "deduplicated", "evicted",
        "stale", "index_full")]


class ClusterOpts(Structure):
    _fields_ = [("size", c_size_t), ("version", c_uint32), ("timeout_ms", c_int32),
                ("lease_ms", c_int32), ("flags", c_uint32), ("redis_url", c_char_p),
                ("node", c_char_p), ("cluster", c_char_p)]


class ClusterRef(Structure):
    _fields_ = [("node", c_uint32), ("pe", c_uint32), ("page", c_uint32), ("gen", c_uint32)]


class ClusterStats(Structure):
    _fields_ = [("size", c_size_t)] + [(n, c_uint64) for n in (
        "exported_pages", "dir_puts", "dir_dels", "dir_errors", "dir_reconnects", "lookups",
        "local_hits", "remote_hits", "remote_pages", "remote_bytes", "remote_stale",
        "peer_failures", "remote_pins", "remote_direct_pages")]


class CommOpts(Structure):
    _fields_ = [("size", c_size_t), ("version", c_uint32), ("backend", c_int32),
                ("channels", c_uint32), ("flags", c_uint32), ("max_bytes", c_uint64)]


# Sizes on LP64 (x86-64, aarch64); checked against the library at load where it can tell.
STRUCT_SIZES = {Config: 64, HeapOpts: 40, HeapInfo: 96, Geometry: 40, LayoutDesc: 72, Key: 16,
                PageRef: 16, KvOpts: 32, AttachOpts: 64, KvStats: 112, CommOpts: 32}


def geometry_init():
    return Geometry(ctypes.sizeof(Geometry), SKV_GEOMETRY_VERSION, KV_SPLIT, 0, 0, 0, 0, 0)


def layout_desc_init():
    d = LayoutDesc()
    d.size, d.version, d.device = ctypes.sizeof(LayoutDesc), SKV_LAYOUT_DESC_VERSION, -1
    return d


def heap_opts_init():
    return HeapOpts(ctypes.sizeof(HeapOpts), SKV_HEAP_OPTS_VERSION, BACKEND_HOST, 0, 0, 0)


def kv_opts_init():
    return KvOpts(ctypes.sizeof(KvOpts), SKV_KV_OPTS_VERSION, BACKEND_HOST, 0, 0)


def attach_opts_init():
    return AttachOpts(ctypes.sizeof(AttachOpts), SKV_ATTACH_OPTS_VERSION, ROLE_OWNER,
                      BACKEND_HOST, -1, -1, -1, 0, 0, 0, 0, None)


def comm_opts_init():
    return CommOpts(ctypes.sizeof(CommOpts), SKV_COMM_OPTS_VERSION, BACKEND_CUDA, 0, 0, 0)


def out_struct(cls):
    """An instance of `cls` to be filled by the C library, its `size` field set when it has one
    (the library writes no further than that), inside a buffer with room to spare."""
    buf = (c_char * max(512, 2 * ctypes.sizeof(cls)))()
    obj = cls.from_buffer(buf)
    obj._symkv_buf = buf
    if cls._fields_[0][0] == "size":
        obj.size = ctypes.sizeof(cls)
    return obj


# skv_log_cb: void (*)(void *arg, int level, unsigned int subsys, const char *line)
LOG_CB = ctypes.CFUNCTYPE(None, c_void_p, c_int, c_uint, c_char_p)

# ---- error checking ---------------------------------------------------------------------------

_NAME_IN_MSG = re.compile(r"\(((?:SKV_)?E[A-Z0-9]+), [^(),]*:\d+\)\s*$")


def last_error():
    """skv_last_error() of this thread, as str ("" if none)."""
    s = lib.skv_last_error()
    return s.decode("utf-8", "replace") if s else ""


def error_from_code(code, fn=None):
    """The exception for a failed call that returned `code`, carrying the thread's last
    detailed message when it is about this code."""
    name = lib.skv_err_name(code).decode("utf-8", "replace")
    text = last_error()
    if not (text and ("(%s, " % name) in text):
        text = "%s%s (%s)" % (fn + ": " if fn else "",
                              lib.skv_strerror(code).decode("utf-8", "replace"), name)
    return errors.make_error(code, text, name)


def error_from_last(fn, default_code=errors.InternalError.code):
    """The exception for a call that signals failure without a code (a NULL pointer): the
    code is read from the last error's "(SKV_EX, file:line)"."""
    text = last_error()
    m = _NAME_IN_MSG.search(text)
    code = default_code
    if m:
        cls = errors.class_for_name(m.group(1))
        if cls is not None:
            code = cls.code
        else:
            import errno as _errno
            code = -getattr(_errno, m.group(1), -default_code)
    if not text:
        text = "%s failed (no detail)" % fn
    return errors.make_error(code, text)


def _check_rc(result, func, args):
    if result < 0:
        raise error_from_code(result, func.__name__)
    return result


def _check_ptr(result, func, args):
    if not result:
        raise error_from_last(func.__name__)
    return result


def raise_error(code, message):
    """Raise a symkv error for a bad argument found on the Python side."""
    raise errors.make_error(code, message)


def invalid(message):
    raise errors.make_error(errors.InvalidArgument.code, message + " (SKV_EINVAL, python)")


def as_bytes(v, what, none_ok=True):
    """The bytes of a bytes-like value (bytes, bytearray, memoryview, a buffer such as a numpy
    array, an iterable of ints 0..255) or of a str (UTF-8); None is b"" when none_ok. An int is
    refused: bytes(5) is five zero bytes and bytes(0) none, so an int salt or value would
    silently be zeros (and salt=0 no salt at all). Encode it yourself, e.g. str(n).encode() or
    n.to_bytes(8, "little")."""
    if v is None and none_ok:
        return b""
    if isinstance(v, str):
        return v.encode("utf-8")
    if isinstance(v, (bytes, bytearray, memoryview)):
        return bytes(v)
    if isinstance(v, numbers.Integral):  # int, bool, numpy integers
        invalid("%s: an int (%r) is not bytes (bytes(n) would be n zero bytes); encode it "
                "explicitly, e.g. str(n).encode() or n.to_bytes(8, \"little\")" % (what, v))
    try:
        return bytes(memoryview(v))
    except TypeError:
        pass
    try:
        return bytes(v)
    except (TypeError, ValueError):
        invalid("%s: expected bytes or str, got %s" % (what, type(v).__name__))


# ---- the function table -----------------------------------------------------------------------

P = POINTER
_ctx = c_void_p  # opaque handles
# name: (restype, argtypes, check): check "rc" raises on a negative int, "ptr" on NULL.
FUNCTIONS = {
    "skv_version": (c_uint, [], None),
    "skv_version_string": (c_char_p, [], None),
    "skv_strerror": (c_char_p, [c_int], None),
    "skv_err_name": (c_char_p, [c_int], None),
    "skv_last_error": (c_char_p, [], None),
    "skv_clear_error": (None, [], None),
    "skv_log_set_sink": (c_int, [LOG_CB, c_void_p], "rc"),
    "skv_log_set_level": (c_int, [c_int, c_uint], "rc"),
    "skv_log_write": (None, [c_int, c_uint, c_char_p], None),
    "skv_config_init": (c_int, [P(Config)], "rc"),
    "skv_config_set": (c_int, [P(Config), c_char_p, c_char_p], "rc"),
    "skv_config_validate": (c_int, [P(Config)], "rc"),
    "skv_init": (c_int, [P(Config), P(c_void_p)], "rc"),
    "skv_finalize": (c_int, [_ctx], "rc"),
    "skv_ctx_get_rank": (c_int, [_ctx], "rc"),
    "skv_ctx_get_world_size": (c_int, [_ctx], "rc"),
    "skv_ctx_get_local_rank": (c_int, [_ctx], "rc"),
    "skv_ctx_get_local_size": (c_int, [_ctx], "rc"),
    "skv_ctx_get_timeout_ms": (c_int, [_ctx], "rc"),
    "skv_ctx_get_device": (c_int, [_ctx], "rc"),
    "skv_ctx_set_timeout_ms": (c_int, [_ctx, c_int], "rc"),
    "skv_ctx_barrier": (c_int, [_ctx], "rc"),
    "skv_ctx_allgather": (c_int, [_ctx, c_void_p, c_void_p, c_size_t], "rc"),
    "skv_ctx_broadcast": (c_int, [_ctx, c_void_p, c_size_t, c_int], "rc"),
    "skv_store_set": (c_int, [_ctx, c_char_p, c_void_p, c_size_t], "rc"),
    "skv_store_get": (c_int, [_ctx, c_char_p, c_void_p, c_size_t, P(c_size_t)], "rc"),
    "skv_store_add": (c_int, [_ctx, c_char_p, c_int64, P(c_int64)], "rc"),
    "skv_store_wait": (c_int, [_ctx, P(c_char_p), c_size_t], "rc"),
    "skv_heap_create": (c_int, [_ctx, c_uint64, c_int, P(c_void_p)], "rc"),
    "skv_heap_create_ex": (c_int, [_ctx, P(HeapOpts), P(c_void_p)], "rc"),
    "skv_heap_get_ptr": (c_void_p, [c_void_p, c_int, c_uint64], "ptr"),
    "skv_heap_get_info": (c_int, [c_void_p, P(HeapInfo)], "rc"),
    "skv_heap_destroy": (c_int, [c_void_p], "rc"),
    "skv_geometry_get_page_bytes": (c_int, [P(Geometry), P(c_uint64)], "rc"),
    "skv_layout_create": (c_int, [P(Geometry), P(LayoutDesc), P(c_void_p)], "rc"),
    "skv_layout_create_preset": (c_int, [P(Geometry), c_int, c_uint32, c_uint64, P(c_void_p),
                                         c_int, P(c_void_p)], "rc"),
    "skv_layout_get_preset_layer_bytes": (c_int, [P(Geometry), c_int, c_uint32, c_uint64,
                                              P(c_uint64)], "rc"),
    "skv_layout_create_layers": (c_int, [c_void_p, c_uint32, c_uint32, P(c_void_p)], "rc"),
    "skv_layout_destroy": (c_int, [c_void_p], "rc"),
    "skv_namespace_create": (c_int, [c_char_p, P(Geometry), c_void_p, c_size_t, c_void_p,
                                     c_size_t, P(c_void_p)], "rc"),
    "skv_namespace_get_id": (c_int, [c_void_p, P(Key)], "rc"),
    "skv_namespace_destroy": (c_int, [c_void_p], "rc"),
    "skv_namespace_hash_tokens": (c_int, [c_void_p, P(c_uint32), c_size_t, P(Key), P(Key), c_size_t,
                                P(c_size_t)], "rc"),
    "skv_namespace_hash_bytes": (c_int, [c_void_p, c_void_p, c_size_t, P(Key)], "rc"),
    "skv_kv_create": (c_int, [_ctx, P(Geometry), P(KvOpts), P(c_void_p)], "rc"),
    "skv_kv_destroy": (c_int, [c_void_p], "rc"),
    "skv_kv_attach": (c_int, [c_char_p, P(Geometry), P(AttachOpts), P(c_void_p)], "rc"),
    "skv_kv_detach": (c_int, [c_void_p], "rc"),
    "skv_kv_get_stats": (c_int, [c_void_p, P(KvStats)], "rc"),
    "skv_kv_get_heap": (c_void_p, [c_void_p], "ptr"),
    "skv_kv_lookup": (c_int, [c_void_p, c_void_p, P(Key), c_size_t, c_uint32, P(PageRef),
                           P(c_size_t)], "rc"),
    "skv_kv_unpin": (c_int, [c_void_p, P(PageRef), c_size_t], "rc"),
    "skv_kv_fetch": (c_int, [c_void_p, P(PageRef), c_size_t, c_void_p, P(c_uint64), c_uint32,
                          c_void_p], "rc"),
    "skv_kv_publish": (c_int, [c_void_p, c_void_p, P(Key), c_size_t, c_void_p, P(c_uint64),
                            c_void_p, P(c_size_t)], "rc"),
    "skv_kv_reserve": (c_int, [c_void_p, c_void_p, P(Key), c_size_t, P(PageRef), P(c_size_t)],
                       "rc"),
    "skv_kv_write": (c_int, [c_void_p, P(PageRef), c_size_t, c_void_p, P(c_uint64), c_void_p],
                     "rc"),
    "skv_kv_commit": (c_int, [c_void_p, c_void_p, P(Key), c_size_t, P(PageRef), c_void_p,
                              P(c_size_t)], "rc"),
    "skv_kv_abort": (c_int, [c_void_p, P(PageRef), c_size_t, c_void_p], "rc"),
    "skv_kv_evict": (c_int, [c_void_p, c_uint64, P(c_uint64)], "rc"),
    "skv_kv_set_free_reserve": (c_int, [c_void_p, c_uint64], "rc"),
    "skv_kv_sync": (c_int, [c_void_p], "rc"),
    # across nodes (docs/cluster.md): declared for completeness, no Python wrapper yet
    "skv_cluster_join": (c_int, [c_void_p, P(ClusterOpts), P(c_void_p)], "rc"),
    "skv_cluster_leave": (c_int, [c_void_p], "rc"),
    "skv_cluster_publish": (c_int, [c_void_p, c_void_p, P(Key), c_size_t, c_void_p, P(c_uint64),
                                 c_void_p, P(c_size_t)], "rc"),
    "skv_cluster_flush": (c_int, [c_void_p], "rc"),
    "skv_cluster_lookup": (c_int, [c_void_p, c_void_p, P(Key), c_size_t, c_uint32, P(ClusterRef),
                                P(c_size_t), P(c_size_t)], "rc"),
    "skv_cluster_fetch": (c_int, [c_void_p, P(ClusterRef), c_size_t, c_void_p, P(c_uint64),
                               c_uint32, c_void_p], "rc"),
    "skv_cluster_unpin": (c_int, [c_void_p, P(ClusterRef), c_size_t], "rc"),
    "skv_cluster_sync": (c_int, [c_void_p], "rc"),
    "skv_cluster_get_stats": (c_int, [c_void_p, P(ClusterStats)], "rc"),
    "skv_cluster_node_name": (c_char_p, [c_void_p, c_uint32], None),
    "skv_comm_create": (c_int, [_ctx, P(CommOpts), P(c_void_p)], "rc"),
    "skv_comm_destroy": (c_int, [c_void_p], "rc"),
    "skv_comm_get_heap": (c_void_p, [c_void_p], "ptr"),
    "skv_comm_allreduce": (c_int, [c_void_p, c_void_p, c_void_p, c_size_t, c_int, c_int, c_int, c_int,
                              c_void_p], "rc"),
    "skv_comm_get_signal_slots": (c_int, [c_void_p], "rc"),
    "skv_comm_signal": (c_int, [c_void_p, c_int, c_uint32, c_uint64, c_int, c_void_p], "rc"),
    "skv_comm_wait": (c_int, [c_void_p, c_uint32, c_int, c_uint64, c_void_p], "rc"),
    "skv_comm_barrier": (c_int, [c_void_p, c_int, c_void_p], "rc"),
    "skv_comm_check": (c_int, [c_void_p], "rc"),
}

# Functions a library may lack (a build without the comm layer): calling one raises
# symkv.NotSupported naming it instead of failing at import.
OPTIONAL = frozenset(n for n in FUNCTIONS if n.startswith("skv_comm_") or n in (
    "skv_comm_allreduce", "skv_comm_signal", "skv_comm_wait", "skv_comm_barrier"))


class _Missing:
    """Stands in for a function the loaded library does not export."""

    def __init__(self, name, path):
        self.__name__ = name
        self._path = path
        self.argtypes, self.restype = FUNCTIONS[name][1], FUNCTIONS[name][0]

    def __call__(self, *args):
        raise errors.make_error(
            errors.NotSupported.code,
            "%s: the loaded library %s does not export it (built before that part of symkv "
            "existed?); rebuild libsymkv.so or point SKV_LIBRARY to a newer one "
            "(SKV_ENOTSUP, python)" % (self.__name__, self._path))


class Lib:
    """The loaded library: one attribute per C function, declared from FUNCTIONS."""

    def __init__(self, cdll, path):
        self._cdll = cdll
        self.path = path
        self.missing = []
        for name, (restype, argtypes, check) in FUNCTIONS.items():
            try:
                fn = getattr(cdll, name)
            except AttributeError:
                if name not in OPTIONAL:
                    raise ImportError("symkv: %s does not export %s: it is not a libsymkv.so "
                                      "matching this package" % (path, name))
                self.missing.append(name)
                setattr(self, name, _Missing(name, path))
                continue
            fn.restype = restype
            fn.argtypes = argtypes
            if check == "rc":
                fn.errcheck = _check_rc
            elif check == "ptr":
                fn.errcheck = _check_ptr
            setattr(self, name, fn)

    def has(self, name):
        return name in FUNCTIONS and name not in self.missing


# ---- finding and loading the library ----------------------------------------------------------


def _candidates():
    """(path or name, where it came from) in search order: SKV_LIBRARY (an explicit choice
    wins and is not silently replaced), the package folder, then the system's search path."""
    env = os.environ.get("SKV_LIBRARY")
    if env:
        return [(env, "SKV_LIBRARY")]
    here = os.path.dirname(os.path.abspath(__file__))
    out = []
    for n in ("libsymkv.so", "libsymkv.so.%d" % EXPECTED_MAJOR):
        p = os.path.join(here, n)
        if os.path.exists(p):
            out.append((p, "the package folder"))
    found = ctypes.util.find_library("symkv")
    for n in ([found] if found else []) + ["libsymkv.so.%d" % EXPECTED_MAJOR, "libsymkv.so"]:
        out.append((n, "the system library path"))
    return out


def version_tuple(v):
    return (v >> 16) & 0xFF, (v >> 8) & 0xFF, v & 0xFF


def check_version(v, path, expected_major=EXPECTED_MAJOR, min_minor=MIN_MINOR):
    """ImportError unless library version `v` (SKV_VERSION_HEX) has our major version and at
    least our minor one."""
    major, minor, patch = version_tuple(v)
    if major != expected_major or minor < min_minor:
        raise ImportError(
            "symkv: %s is libsymkv %d.%d.%d, but this Python package needs %d.x with x >= %d: "
            "install the matching library, or set SKV_LIBRARY to the libsymkv.so of a matching "
            "build" % (path, major, minor, patch, expected_major, min_minor))


def check_abi(lib):
    """Compare our struct layouts with the library's: skv_config_init writes the C
    sizeof(skv_config_t); skv_geometry_get_page_bytes rejects a geometry of the wrong size."""
    for cls, size in STRUCT_SIZES.items():
        if ctypes.sizeof(cls) != size and ctypes.sizeof(c_void_p) == 8:
            raise ImportError("symkv: ctypes.sizeof(%s) is %d, expected %d on LP64"
                              % (cls.__name__, ctypes.sizeof(cls), size))
    buf = (c_char * 512)()
    lib.skv_config_init(ctypes.cast(buf, P(Config)))
    c_size = c_size_t.from_buffer(buf).value
    if c_size != ctypes.sizeof(Config):
        raise ImportError("symkv: %s has sizeof(skv_config_t) = %d but this package's Config "
                          "is %d bytes: the library and the package do not match"
                          % (lib.path, c_size, ctypes.sizeof(Config)))
    g = geometry_init()
    g.num_layers, g.num_kv_heads, g.head_dim, g.elem_bytes, g.page_tokens = 1, 1, 1, 1, 1
    pb = c_uint64()
    try:
        lib.skv_geometry_get_page_bytes(byref(g), byref(pb))
    except errors.Error as e:
        raise ImportError("symkv: %s rejects this package's skv_geometry_t (%d bytes): %s"
                          % (lib.path, ctypes.sizeof(Geometry), e)) from None
    lib.skv_clear_error()


def load():
    tried = []
    for cand, where in _candidates():
        try:
            cdll = ctypes.CDLL(cand)
        except OSError as e:
            tried.append("%s (from %s): %s" % (cand, where, e))
            continue
        path = cand
        try:
            # The path actually mapped (for messages); best effort.
            path = _mapped_path(cdll) or cand
        except Exception:
            pass
        if not hasattr(cdll, "skv_version"):
            tried.append("%s (from %s): not libsymkv (no skv_version)" % (cand, where))
            continue
        ver = cdll.skv_version
        ver.restype, ver.argtypes = c_uint, []
        check_version(ver(), path)
        out = Lib(cdll, path)
        check_abi(out)
        return out
    raise ImportError(
        "symkv: cannot load libsymkv.so; tried:\n  " + "\n  ".join(tried) +
        "\nBuild it (cmake -S . -B build && cmake --build build) and set "
        "SKV_LIBRARY=/path/to/build/libsymkv.so, copy it next to the package, or install it "
        "(cmake --install build)")


def _mapped_path(cdll):
    class _DlInfo(Structure):
        _fields_ = [("dli_fname", c_char_p), ("dli_fbase", c_void_p), ("dli_sname", c_char_p),
                    ("dli_saddr", c_void_p)]
    libdl = ctypes.CDLL(None)
    dladdr = libdl.dladdr
    dladdr.argtypes, dladdr.restype = [c_void_p, P(_DlInfo)], c_int
    info = _DlInfo()
    addr = ctypes.cast(cdll.skv_version, c_void_p).value
    if dladdr(addr, byref(info)) and info.dli_fname:
        return os.path.realpath(info.dli_fname.decode())
    return None


lib = load()
