"""Exceptions: one class per code, mirroring SKV_ERRNO_MAP; -errno codes as OSError
subclasses; failing calls carry the code, the name and skv_last_error()'s text."""
import errno
import os
import pickle
import re

import numpy as np
import pytest

import symkv
from symkv import errors
from conftest import REPO


def test_table_mirrors_SKV_ERRNO_MAP_of_the_header():
    path = os.path.join(REPO, "include", "symkv.h")
    if not os.path.exists(path):
        pytest.skip("no include/symkv.h")
    text = open(path).read()
    block = text[text.index("#define SKV_ERRNO_MAP"):text.index("typedef enum skv_err")]
    block = block.replace("\\\n", " ")
    rows = re.findall(r'XX\((\w+),\s*(-\w+),\s*"((?:[^"\\]|\\.)*)"\)', block)

    def value(v):  # -1004, or -EINVAL: the errno value negated
        return int(v) if v[1:].isdigit() else -getattr(errno, v[1:])
    assert [(n, value(v), m) for n, v, m in rows] == [r[:3] for r in errors.ERRNO_MAP]


@pytest.mark.parametrize("row", errors.ERRNO_MAP, ids=[r[0] for r in errors.ERRNO_MAP])
def test_each_code_has_its_class(row):
    name, value, msg, cls_name, base = row
    cls = getattr(symkv, cls_name)
    assert issubclass(cls, symkv.Error)
    if base is not None:
        assert issubclass(cls, base)
    assert cls.code == value and cls.name == "SKV_" + name
    assert symkv.error_class(value) is cls
    # the library agrees
    assert symkv.err_name(value) == "SKV_" + name
    assert symkv.strerror(value) == msg
    e = errors.make_error(value, "what went wrong")
    assert type(e) is cls and e.code == value and e.name == "SKV_" + name
    assert str(e) == "what went wrong" and e.message == "what went wrong"
    # generic text when no detail
    assert msg in str(cls())
    e2 = pickle.loads(pickle.dumps(e))
    assert type(e2) is cls and e2.code == value and str(e2) == "what went wrong"


def test_named_classes():
    assert symkv.InvalidArgument.code == -errno.EINVAL
    assert issubclass(symkv.InvalidArgument, ValueError)
    assert symkv.Timeout.code == -errno.ETIMEDOUT and issubclass(symkv.Timeout, TimeoutError)
    assert symkv.StaleReference.code == -errno.ESTALE
    assert symkv.AuthenticationError.code == -1004  # symkv's own: -1000 and below
    assert issubclass(symkv.NotSupported, NotImplementedError)
    assert issubclass(symkv.ConnectionFailed, ConnectionError)
    assert issubclass(symkv.OutOfRange, IndexError)


@pytest.mark.parametrize("err,builtin", [(errno.ENOENT, FileNotFoundError),
                                         (errno.EACCES, PermissionError),
                                         (errno.EMFILE, OSError), (errno.EAGAIN, BlockingIOError)])
def test_errno_codes_are_oserrors(err, builtin):
    cls = symkv.error_class(-err)
    assert issubclass(cls, symkv.SystemCallError) and issubclass(cls, symkv.Error)
    assert issubclass(cls, builtin) and issubclass(cls, OSError)
    e = errors.make_error(-err, "memfd_create failed: x")
    assert e.errno == err and e.code == -err and e.name == errno.errorcode[err]
    assert symkv.err_name(-err) == errno.errorcode[err]
    assert symkv.strerror(-err) == os.strerror(err) or symkv.strerror(-err)
    e2 = pickle.loads(pickle.dumps(e))
    assert type(e2) is cls and e2.errno == err


def test_unknown_code_is_plain_Error():
    e = errors.make_error(-99999, None)
    assert type(e) is symkv.Error and e.code == -99999


def test_failing_call_carries_code_name_and_last_error():
    with pytest.raises(symkv.InvalidArgument) as ei:
        symkv.Geometry(num_layers=2, num_kv_heads=8, head_dim=128, page_tokens=16, elem_bytes=3)
    e = ei.value
    assert e.code == -errno.EINVAL and e.name == "SKV_EINVAL"
    assert "elem_bytes=3 is not 1 (fp8), 2 (bf16/fp16) or 4 (fp32)" in str(e)
    assert re.search(r"\(SKV_EINVAL, geometry\.c:\d+\)$", str(e))
    assert str(e) == symkv.last_error()
    symkv.clear_error()
    assert symkv.last_error() == ""


def test_null_pointer_failures_read_the_code_from_the_message(mctx):
    heap = mctx.heap(4096)
    try:
        with pytest.raises(symkv.OutOfRange, match=r"PE 5 is not in 0\.\.0.*SKV_ERANGE"):
            heap.ptr(5)
        with pytest.raises(symkv.OutOfRange, match="beyond"):
            heap.ptr(0, 1 << 40)
    finally:
        heap.close()


def test_python_side_checks_raise_symkv_classes():
    g = symkv.Geometry(num_layers=1, num_kv_heads=1, head_dim=8, page_tokens=4, elem_bytes=4)
    with pytest.raises(symkv.InvalidArgument, match="tokens: value -1 is out of range"):
        symkv.Namespace("m", g).hash_tokens([1, 2, -1, 3])
    with pytest.raises(symkv.InvalidArgument) as ei:
        symkv.Layout.from_tensors(g, [np.zeros((2, 4, 4, 1, 8), np.float16)])
    assert ei.value.code == -errno.EINVAL and "elem_bytes=4" in str(ei.value)
    assert "(SKV_EINVAL, python)" in str(ei.value)
