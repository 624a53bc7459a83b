"""symkv's exceptions: one class per return code, generated from a table that mirrors
SKV_ERRNO_MAP in include/symkv.h (codes named after an errno value are that value negated),
and the other -errno codes mapped onto OSError subclasses."""

import errno as _errno
import os as _os

# name (SKV_<name>), value, the C library's message, Python class, extra built-in base.
# Keep in the order of SKV_ERRNO_MAP; tests/test_errors.py checks this table against the
# header and against the loaded library's skv_err_name() / skv_strerror().
ERRNO_MAP = (
    # errno equivalents: the code is -errno (Linux numbering), as in libuv
    ("EINVAL", -_errno.EINVAL, "invalid argument", "InvalidArgument", ValueError),
    ("ENOMEM", -_errno.ENOMEM, "out of memory", "OutOfMemory", MemoryError),
    ("ETIMEDOUT", -_errno.ETIMEDOUT,
     "timed out waiting for a peer (raise SKV_TIMEOUT_MS or check the peers)", "Timeout",
     TimeoutError),
    ("EPROTO", -_errno.EPROTO, "malformed or oversized bootstrap message", "ProtocolError", None),
    ("ENOTSUP", -_errno.ENOTSUP, "not supported by this build, backend or device", "NotSupported",
     NotImplementedError),
    ("ESTALE", -_errno.ESTALE, "stale page reference (the page was evicted or reused)",
     "StaleReference", None),
    ("ENOSPC", -_errno.ENOSPC,
     "no free page or index slot (every page is pinned or the index is full)", "NoSpace", None),
    ("EEXIST", -_errno.EEXIST, "already exists", "AlreadyExists", None),
    ("ERANGE", -_errno.ERANGE, "value out of range", "OutOfRange", IndexError),
    # symkv's own: -1000 and below
    ("EAUTH", -1004, "bootstrap token rejected (every PE must use the same SKV_TOKEN)",
     "AuthenticationError", PermissionError),
    ("ECONN", -1006, "bootstrap connection failed or lost (is rank 0 running?)",
     "ConnectionFailed", ConnectionError),
    ("EPEERDEAD", -1007, "a peer process exited", "PeerDead", None),
    ("EMISMATCH", -1008, "PEs called collectives that do not match", "CollectiveMismatch", None),
    ("ECUDA", -1010, "CUDA call failed", "CudaError", None),
    ("ENCCL", -1011, "NCCL call failed", "NcclError", None),
    ("ENOTFOUND", -1012, "not found", "NotFound", LookupError),
    ("ESTATE", -1017, "call not valid in the current state", "InvalidState", None),
    ("ECAPTURE", -1018, "not allowed while a CUDA graph is being captured", "CaptureError", None),
    ("EVERSION", -1019, "version mismatch between caller and library", "VersionMismatch", None),
    ("EINTERNAL", -1020, "internal error (please report it with the SKV_DEBUG=INFO log)",
     "InternalError", None),
)


class Error(Exception):
    """A failed symkv call. `code` is the negative return code, `name` its name
    ("SKV_EINVAL", "ENOENT"), `message` the detailed text (skv_last_error() of the failing
    call: what failed, where, what to do next)."""

    code = None
    name = None

    def __init__(self, message=None, code=None, name=None):
        if code is None:
            code = type(self).code
        if name is None:
            name = type(self).name or _code_name(code)
        if not message:
            message = "%s: %s" % (name, _code_message(code))
        Exception.__init__(self, message)
        self.code = code
        self.name = name
        self.message = message

    def __str__(self):
        return self.message

    def __reduce__(self):
        # Rebuilt from the code, so that errno classes made on the fly pickle too.
        cls = None if type(self) is error_class(self.code) else type(self)
        return (_rebuild, (cls, self.message, self.code, self.name))


class SystemCallError(Error, OSError):
    """A system call failed inside symkv: `code` is -errno, `errno` the errno value. The class
    of a given errno also derives from the built-in OSError subclass Python picks for it
    (ENOENT -> FileNotFoundError, EACCES -> PermissionError, ...)."""

    def __init__(self, message=None, code=None, name=None):
        Error.__init__(self, message, code, name)
        if self.code is not None:
            self.errno = -self.code
            self.strerror = _os.strerror(-self.code)


def _rebuild(cls, message, code, name):
    return (cls or error_class(code))(message, code, name)


_BY_CODE = {}
_BY_NAME = {}
for _name, _value, _msg, _cls, _base in ERRNO_MAP:
    _bases = (Error,) if _base is None else (Error, _base)
    _doc = "SKV_%s (%d): %s." % (_name, _value, _msg)
    _klass = type(_cls, _bases, {"__doc__": _doc, "code": _value, "name": "SKV_" + _name,
                                 "strerror": _msg, "__module__": "symkv"})
    globals()[_cls] = _klass
    _BY_CODE[_value] = _klass
    _BY_NAME["SKV_" + _name] = _klass
del _name, _value, _msg, _cls, _base, _bases, _doc, _klass

_ERRNO_CLASSES = {}


def _errno_class(err):
    """The SystemCallError subclass for errno `err` (cached), also deriving from the built-in
    OSError subclass of that errno when there is one."""
    cls = _ERRNO_CLASSES.get(err)
    if cls is None:
        builtin = type(OSError(err, ""))
        name = _errno.errorcode.get(err, "E%d" % err)
        bases = (SystemCallError,) if builtin is OSError else (SystemCallError, builtin)
        cls = type(name, bases, {"__module__": "symkv", "code": -err, "name": name,
                                 "__doc__": "-%s from a system call inside symkv." % name})
        _ERRNO_CLASSES[err] = cls
    return cls


def _code_name(code):
    if code is None:
        return "SKV_ERROR"
    cls = _BY_CODE.get(code)
    if cls is not None:
        return cls.name
    if -4096 < code < 0:
        return _errno.errorcode.get(-code, "E%d" % -code)
    return "SKV_UNKNOWN(%d)" % code


def _code_message(code):
    cls = _BY_CODE.get(code)
    if cls is not None:
        return cls.strerror
    if code is not None and -4096 < code < 0:
        return _os.strerror(-code)
    return "unknown error %s" % code


def error_class(code):
    """The exception class of a return code: a symkv code's class, a SystemCallError subclass
    for -errno, else Error."""
    cls = _BY_CODE.get(code)
    if cls is not None:
        return cls
    if isinstance(code, int) and -4096 < code < 0:
        return _errno_class(-code)
    return Error


def make_error(code, message=None, name=None):
    """An exception instance for `code` with `message` (or the code's generic text)."""
    return error_class(code)(message, code, name)


def class_for_name(name):
    """The class of "SKV_EINVAL" or "EINVAL"-style symkv names (None if unknown)."""
    return _BY_NAME.get(name if name.startswith("SKV_") else "SKV_" + name)


__all__ = ["Error", "SystemCallError", "ERRNO_MAP", "error_class", "make_error",
           "class_for_name"] + [row[3] for row in ERRNO_MAP]
