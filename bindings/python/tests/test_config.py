"""skv_config_t: the ctypes struct, fields set by name through skv_config_set, validation."""
import ctypes
import errno

import pytest

import symkv
from symkv import _lib


def test_defaults_are_SKV_CONFIG_INIT():
    c = symkv.Config()
    s = c.struct
    assert s.size == ctypes.sizeof(_lib.Config) and s.version == 1
    assert (c.rank, c.world_size, c.local_rank, c.local_size, c.timeout_ms, c.device) == (-1,) * 6
    assert c.flags == 0 and c.bootstrap is None and c.token is None and c.bind_addr is None


def test_fields_by_name():
    c = symkv.Config(rank=1, world_size="4", timeout_ms=2500, bootstrap="tcp://10.0.0.1:29500",
                     token="secret-token-123", bind_addr="0.0.0.0")
    assert (c.rank, c.world_size, c.timeout_ms) == (1, 4, 2500)
    assert c.bootstrap == "tcp://10.0.0.1:29500" and c.bind_addr == "0.0.0.0"
    c.validate()
    assert "secret-token-123" not in repr(c)
    c.set("rank", None)
    assert c.rank == -1
    c.set("token", None)
    assert c.token is None
    assert c.as_dict()["world_size"] == 4


def test_strings_stay_valid():
    c = symkv.Config()
    c.set("bootstrap", "tcp://127.0.0.1:%d" % (20000 + 1))
    import gc
    gc.collect()
    assert c.struct.bootstrap == b"tcp://127.0.0.1:20001"


@pytest.mark.parametrize("name,value,match", [
    ("rnak", 1, r'unknown config field "rnak" \(known: rank, world_size'),
    ("rank", "two", r'config.rank="two" is not an integer'),
    ("rank", -2, r"config.rank=-2 is out of range: use -1"),
    ("timeout_ms", 0, r"config.timeout_ms=0 is out of range"),
    ("token", "short", r"config.token has 5 characters; it needs 8 to 128"),
    ("bootstrap", "10.0.0.1", r"expected tcp://HOST:PORT"),
    ("flags", 1, r"config.flags=1 is invalid"),
])
def test_bad_fields_name_themselves(name, value, match):
    with pytest.raises(symkv.InvalidArgument, match=match) as ei:
        symkv.Config(**{name: value})
    assert ei.value.code == -errno.EINVAL and "(SKV_EINVAL, config.c:" in str(ei.value)


def test_validate_checks_relations():
    c = symkv.Config(rank=3, world_size=2)
    with pytest.raises(symkv.InvalidArgument,
                       match="config.rank=3 is not below config.world_size=2"):
        c.validate()


def test_bad_python_values():
    with pytest.raises(symkv.InvalidArgument):
        symkv.Config(rank=True)
    with pytest.raises(symkv.InvalidArgument, match="NUL"):
        symkv.Config(token="abc\0defghij")
    with pytest.raises(symkv.InvalidArgument):
        symkv.Context(config={"rank": 0})


def test_init_without_rank_fails_clearly(monkeypatch):
    with pytest.raises(symkv.InvalidArgument, match="rank unknown"):
        symkv.init(world_size=2, bootstrap="tcp://127.0.0.1:1", token="abcdefghijk")
