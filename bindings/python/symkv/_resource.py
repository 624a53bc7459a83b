"""Ownership of C handles: context managers that release what they hold, collective objects
owned (and closed in reverse order) by their context, local ones freed when collected."""

import logging
import warnings

from . import _lib, errors

log = logging.getLogger("symkv")


def _closed_error(what):
    return errors.make_error(errors.InvalidState.code,
                             "%s is closed (SKV_ESTATE, python)" % what)


class Resource:
    """A C handle. `close()` releases it (idempotent); `with obj:` closes on exit."""

    _h = None
    _what = "object"

    def _destroy(self, h):
        raise NotImplementedError

    @property
    def closed(self):
        return not self._h

    @property
    def handle(self):
        """The C pointer as an int (for other ctypes code); InvalidState once closed."""
        if not self._h:
            raise _closed_error(self._what)
        return self._h

    def close(self):
        h, self._h = self._h, None
        if h:
            self._destroy(h)

    def __enter__(self):
        if not self._h:
            raise _closed_error(self._what)
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
            return False
        # An exception is on its way: release, but let the original error propagate.
        try:
            self.close()
        except Exception as e:  # noqa: BLE001
            log.warning("closing %s while handling %s: %s", self._what, exc_type.__name__, e)
        return False


class LocalResource(Resource):
    """A handle only this process uses (namespace, layout): freed when garbage collected."""

    def __del__(self):
        if self._h:
            try:
                self.close()
            except Exception:  # noqa: BLE001
                pass


class CollectiveResource(Resource):
    """A handle every PE creates and destroys together (heap, KV cache, comm). Its context
    keeps it and closes it (in reverse creation order) before finalizing, so that garbage
    collection, whose timing differs between processes, never makes a collective call."""

    _ctx = None
    _borrowed = False

    def _adopt(self, ctx, h):
        self._ctx = ctx
        self._h = h
        ctx._children.append(self)

    def close(self):
        """Collective: every PE closes it, in the same order as the other collective calls."""
        if self._borrowed:
            self._h = None
            return
        h, self._h = self._h, None
        if not h:
            return
        ctx = self._ctx
        if ctx is not None:
            try:
                ctx._children.remove(self)
            except ValueError:
                pass
        self._close_dependents()
        self._destroy(h)

    def _close_dependents(self):
        pass

    def __del__(self):
        if self._h and not self._borrowed:
            # Only reachable if the context itself was collected without being closed.
            warnings.warn("symkv: %s was never closed" % self._what, ResourceWarning, 2)


def check_uint(name, value, bits=64, lo=0):
    """Python ints for uintN arguments: ctypes would wrap a negative one silently."""
    try:
        v = int(value)
    except (TypeError, ValueError):
        _lib.invalid("%s=%r is not an integer" % (name, value))
    if isinstance(value, float) and value != v:
        _lib.invalid("%s=%r is not an integer" % (name, value))
    if v < lo or v >= (1 << bits):
        _lib.invalid("%s=%d is out of range %d..%d" % (name, v, lo, (1 << bits) - 1))
    return v


def check_int(name, value, lo=-(1 << 31), hi=(1 << 31) - 1):
    try:
        v = int(value)
    except (TypeError, ValueError):
        _lib.invalid("%s=%r is not an integer" % (name, value))
    if v < lo or v > hi:
        _lib.invalid("%s=%d is out of range %d..%d" % (name, v, lo, hi))
    return v


BACKENDS = {"host": _lib.BACKEND_HOST, "cuda": _lib.BACKEND_CUDA,
            "cuda_host": _lib.BACKEND_CUDA_HOST}
BACKEND_NAMES = {v: k for k, v in BACKENDS.items()}


def backend_id(backend):
    if isinstance(backend, str):
        try:
            return BACKENDS[backend.lower()]
        except KeyError:
            _lib.invalid("backend %r is not one of %s" % (backend, ", ".join(BACKENDS)))
    return check_int("backend", backend)
