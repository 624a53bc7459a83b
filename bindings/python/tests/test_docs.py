"""The reference pages agree with the code they describe: the environment table of
docs/reference.md against SKV_ENV_MAP (src/core/core.h), row by row."""
import os
import re

import pytest

from conftest import REPO


def _read(*parts):
    path = os.path.join(REPO, *parts)
    if not os.path.exists(path):
        pytest.skip("%s not in this checkout" % os.path.join(*parts))
    with open(path) as f:
        return f.read()


def _env_map():
    core = _read("src", "core", "core.h")
    start = core.index("#define SKV_ENV_MAP(XX)")
    block = core[start:core.index("clang-format on", start)].replace("\\\n", " ")
    s = r'"((?:[^"\\]|\\.)*)"'
    return re.findall(r"XX\((\w+),\s*%s,\s*%s,\s*%s\)" % (s, s, s), block)


def test_environment_table_matches_SKV_ENV_MAP():
    rows = _env_map()
    assert len(rows) >= 20
    doc = _read("docs", "reference.md")
    table = re.findall(r"^\| `SKV_(\w+)` \| (.*?) \| (.*?) \| (.*?) \|$", doc, re.M)
    table = [(n, d, a.replace("\\|", "|"), m) for n, d, a, m in table]
    assert table == rows


def test_tool_variables_are_documented_and_not_library_ones():
    core = _read("src", "core", "core.h")
    start = core.index("#define SKV_ENV_TOOL_NAMES")
    names = re.findall(r'"SKV_(\w+)"', core[start:core.index("\n\n", start)])
    lib = {n for n, _, _, _ in _env_map()}
    doc = _read("docs", "reference.md")
    for n in names:
        assert n not in lib, n
        assert "`SKV_%s`" % n in doc, n
