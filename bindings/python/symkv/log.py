"""symkv's log lines routed to Python's `logging` (logger "symkv") through skv_log_set_sink,
and the run-time level; safe from symkv's background threads and at interpreter shutdown."""

import atexit
import logging
import sys
import threading

from . import _lib
from ._lib import lib

logger = logging.getLogger("symkv")

_PY_LEVEL = {_lib.LOG_WARN: logging.WARNING, _lib.LOG_INFO: logging.INFO,
             _lib.LOG_TRACE: logging.DEBUG}
_LEVEL_BY_NAME = {"NONE": _lib.LOG_NONE, "WARN": _lib.LOG_WARN, "WARNING": _lib.LOG_WARN,
                  "INFO": _lib.LOG_INFO, "TRACE": _lib.LOG_TRACE, "DEBUG": _lib.LOG_TRACE}
_SUBSYS_NAME = {bit: name for name, bit in _lib.SUBSYS.items()}

_state = {"installed": False, "closing": False}
_lock = threading.Lock()


def _sink(arg, level, subsys, line):
    # Runs on whichever thread logs (ctypes takes the GIL), with symkv's log mutex held: it
    # must not call into symkv. Never let an exception escape into C.
    try:
        if _state["closing"] or sys.is_finalizing():
            return
        text = line.decode("utf-8", "replace") if line else ""
        if not logger.hasHandlers():
            # Nobody configured logging: behave like symkv's default sink (stderr), so that
            # SKV_DEBUG=INFO output is not swallowed by logging's WARNING-only last resort.
            err = sys.stderr
            if err is not None:
                err.write(text + "\n")
                err.flush()
            return
        logger.log(_PY_LEVEL.get(level, logging.INFO), "%s", text,
                   extra={"symkv_level": level, "symkv_subsys": _SUBSYS_NAME.get(subsys, "ALL")})
    except BaseException:  # noqa: BLE001 - a log line is never worth a crash in C
        pass


# The ctypes callback object must outlive every call C may make through it: module global.
_SINK = _lib.LOG_CB(_sink)


def use_python_logging(enable=True):
    """Route symkv's log lines to the "symkv" logger (default at import; lines go to stderr
    as before while no logging handler is configured), or back to symkv's own sink."""
    with _lock:
        if enable:
            lib.skv_log_set_sink(_SINK, None)
        else:
            lib.skv_log_set_sink(_lib.LOG_CB(), None)
        _state["installed"] = bool(enable)


def set_level(level, subsystems=None):
    """Override SKV_DEBUG / SKV_DEBUG_SUBSYS: level "NONE", "WARN", "INFO", "TRACE" (or 0..3);
    subsystems: an iterable of names ("KV", "BOOT", ...), "ALL", or a bit mask."""
    if isinstance(level, str):
        try:
            level = _LEVEL_BY_NAME[level.upper()]
        except KeyError:
            _lib.invalid("log level %r is not NONE, WARN, INFO or TRACE" % level)
    mask = 0
    if subsystems is None or subsystems == "ALL":
        mask = _lib.SUBSYS_ALL
    elif isinstance(subsystems, int):
        mask = subsystems
    else:
        if isinstance(subsystems, str):
            subsystems = subsystems.split(",")
        for s in subsystems:
            s = s.strip().upper()
            if s == "ALL":
                mask |= _lib.SUBSYS_ALL
            elif s in _lib.SUBSYS:
                mask |= _lib.SUBSYS[s]
            else:
                _lib.invalid("unknown log subsystem %r (known: %s, ALL)"
                             % (s, ", ".join(_lib.SUBSYS)))
    lib.skv_log_set_level(int(level), mask)


def message(level, text, subsys="ALL"):
    """Write one line through symkv's logger (subject to its level and subsystem filters)."""
    if isinstance(level, str):
        level = _LEVEL_BY_NAME.get(level.upper(), _lib.LOG_INFO)
    bit = _lib.SUBSYS.get(subsys, _lib.SUBSYS_ALL) if isinstance(subsys, str) else subsys
    lib.skv_log_write(int(level), bit, str(text).encode("utf-8", "replace"))


def _at_exit():
    # Before the interpreter is torn down: no more calls into Python from symkv's threads.
    # skv_log_set_sink takes symkv's log mutex, so a line being written finishes first (ctypes
    # releases the GIL during the call, so that line can still get it).
    _state["closing"] = True
    try:
        lib.skv_log_set_sink(_lib.LOG_CB(), None)
    except Exception:
        pass


def _install():
    use_python_logging(True)
    atexit.register(_at_exit)
