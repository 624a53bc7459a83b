"""Loading libsymkv.so: where from, version check, every function of symkv.h declared with
argtypes/restype, struct layouts equal to the C library's."""
import ctypes
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

import symkv
from symkv import _lib
from conftest import PKG, REPO

HEADER = os.path.join(REPO, "include", "symkv.h")


def header_text():
    if not os.path.exists(HEADER):
        pytest.skip("include/symkv.h not found next to the bindings")
    return open(HEADER).read()


def header_functions():
    """name -> (return type, [parameter types]) of every SKV_EXTERN declaration."""
    text = re.sub(r"/\*.*?\*/", " ", header_text(), flags=re.S)
    text = re.sub(r"^\s*#(?:[^\n]*\\\n)*[^\n]*", " ", text, flags=re.M)  # preprocessor lines
    out = {}
    for m in re.finditer(r"SKV_EXTERN\s+([^;{]*?)\b(skv_\w+)\s*\(([^)]*)\)\s*;", text):
        ret, name, params = " ".join(m.group(1).split()), m.group(2), m.group(3)
        types = []
        for p in params.split(","):
            p = " ".join(p.split())
            if not p or p == "void":
                continue
            # drop the parameter name
            p = re.sub(r"\s*\b\w+$", "", p) if not p.endswith("*") else p
            types.append(p.replace(" *", "*").replace("* ", "*"))
        out[name] = (ret.replace(" *", "*"), types)
    return out


P = ctypes.POINTER
C_TYPES = {
    "void": None, "int": ctypes.c_int, "unsigned int": ctypes.c_uint, "size_t": ctypes.c_size_t,
    "uint32_t": ctypes.c_uint32, "uint64_t": ctypes.c_uint64, "int64_t": ctypes.c_int64,
    "const char*": ctypes.c_char_p, "void*": ctypes.c_void_p, "const void*": ctypes.c_void_p,
    "skv_log_cb": _lib.LOG_CB, "skv_ctx_t*": ctypes.c_void_p, "const skv_ctx_t*": ctypes.c_void_p,
    "skv_heap_t*": ctypes.c_void_p, "const skv_heap_t*": ctypes.c_void_p,
    "skv_layout_t*": ctypes.c_void_p, "const skv_layout_t*": ctypes.c_void_p,
    "skv_namespace_t*": ctypes.c_void_p, "const skv_namespace_t*": ctypes.c_void_p,
    "skv_kv_t*": ctypes.c_void_p, "const skv_kv_t*": ctypes.c_void_p,
    "skv_comm_t*": ctypes.c_void_p, "const skv_comm_t*": ctypes.c_void_p,
    "skv_ctx_t**": P(ctypes.c_void_p), "skv_heap_t**": P(ctypes.c_void_p),
    "skv_layout_t**": P(ctypes.c_void_p), "skv_namespace_t**": P(ctypes.c_void_p),
    "skv_kv_t**": P(ctypes.c_void_p), "skv_comm_t**": P(ctypes.c_void_p),
    "void*const*": P(ctypes.c_void_p), "const char*const*": P(ctypes.c_char_p),
    "size_t*": P(ctypes.c_size_t), "uint64_t*": P(ctypes.c_uint64),
    "int64_t*": P(ctypes.c_int64), "const uint32_t*": P(ctypes.c_uint32),
    "const uint64_t*": P(ctypes.c_uint64),
    "skv_config_t*": P(_lib.Config), "const skv_config_t*": P(_lib.Config),
    "const skv_heap_opts_t*": P(_lib.HeapOpts), "skv_heap_info_t*": P(_lib.HeapInfo),
    "const skv_geometry_t*": P(_lib.Geometry), "const skv_layout_desc_t*": P(_lib.LayoutDesc),
    "skv_key_t*": P(_lib.Key), "const skv_key_t*": P(_lib.Key),
    "const skv_kv_opts_t*": P(_lib.KvOpts), "skv_kv_stats_t*": P(_lib.KvStats),
    "const skv_attach_opts_t*": P(_lib.AttachOpts),
    "skv_page_ref_t*": P(_lib.PageRef), "const skv_page_ref_t*": P(_lib.PageRef),
    "const skv_comm_opts_t*": P(_lib.CommOpts),
    "skv_cluster_t*": ctypes.c_void_p, "const skv_cluster_t*": ctypes.c_void_p,
    "skv_cluster_t**": P(ctypes.c_void_p), "const skv_cluster_opts_t*": P(_lib.ClusterOpts),
    "skv_cluster_ref_t*": P(_lib.ClusterRef), "const skv_cluster_ref_t*": P(_lib.ClusterRef),
    "skv_cluster_stats_t*": P(_lib.ClusterStats),
}
# The typed enums are passed as C int (32 bits on every ABI symkv runs on).
C_TYPES.update({t: ctypes.c_int for t in (
    "skv_backend_t", "skv_layout_preset_t", "skv_dtype_t", "skv_op_t", "skv_algo_t",
    "skv_signal_op_t", "skv_cmp_t", "skv_log_level_t", "skv_kv_kind_t")})


def test_every_header_function_is_declared():
    funcs = header_functions()
    assert len(funcs) > 50
    assert set(funcs) == set(_lib.FUNCTIONS), (set(funcs) ^ set(_lib.FUNCTIONS))


@pytest.mark.parametrize("name", sorted(_lib.FUNCTIONS))
def test_argtypes_and_restype_match_the_header(name):
    funcs = header_functions()
    if name not in funcs:
        pytest.skip("%s is not in this symkv.h" % name)
    ret, params = funcs[name]
    restype, argtypes, _check = _lib.FUNCTIONS[name]
    for t in params + [ret]:
        assert t in C_TYPES, "C type %r of %s has no ctypes mapping in this test" % (t, name)
    assert [C_TYPES[t] for t in params] == argtypes, name
    want_ret = C_TYPES[ret]
    if ret in ("const char*",):
        want_ret = ctypes.c_char_p
    assert restype == want_ret, name
    fn = getattr(symkv.lib, name)
    assert fn.argtypes == argtypes and fn.restype == restype


def test_library_found_through_SKV_LIBRARY():
    assert os.path.realpath(symkv.library_path) == os.path.realpath(os.environ["SKV_LIBRARY"])
    assert symkv.version() == (0, 1, 0) or symkv.version()[0] == _lib.EXPECTED_MAJOR
    assert symkv.version_string().startswith("%d.%d" % symkv.version()[:2])


def test_header_version_matches_the_package():
    text = header_text()
    major = int(re.search(r"#define SKV_VERSION_MAJOR (\d+)", text).group(1))
    minor = int(re.search(r"#define SKV_VERSION_MINOR (\d+)", text).group(1))
    assert major == _lib.EXPECTED_MAJOR and minor >= _lib.MIN_MINOR


def test_version_mismatch_is_an_import_error():
    with pytest.raises(ImportError, match=r"libsymkv 1\.0\.0.*needs 0\.x.*SKV_LIBRARY"):
        _lib.check_version(0x010000, "/x/libsymkv.so")
    with pytest.raises(ImportError, match=r"libsymkv 0\.0\.9"):
        _lib.check_version(0x000009, "/x/libsymkv.so")
    _lib.check_version(0x000200, "/x/libsymkv.so")
    with pytest.raises(ImportError, match=r"libsymkv 0\.1\.0"):  # before the 0.2 names
        _lib.check_version(0x000100, "/x/libsymkv.so")
    _lib.check_version(0x000203, "/x/libsymkv.so")


def _import_in_subprocess(env_update, code="import symkv; print(symkv.library_path)"):
    env = dict(os.environ)
    env.update(env_update)
    env["PYTHONPATH"] = PKG
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=60)


def test_bad_SKV_LIBRARY_is_a_clear_import_error(tmp_path):
    r = _import_in_subprocess({"SKV_LIBRARY": str(tmp_path / "nope.so")})
    assert r.returncode != 0
    assert "ImportError" in r.stderr and "SKV_LIBRARY" in r.stderr and "nope.so" in r.stderr


def test_not_a_symkv_library_is_refused():
    import ctypes.util
    libc = ctypes.util.find_library("z") or ctypes.util.find_library("c")
    if not libc:
        pytest.skip("no other shared library to try")
    r = _import_in_subprocess({"SKV_LIBRARY": libc})
    assert r.returncode != 0 and "not libsymkv" in r.stderr


def test_library_beside_the_package(tmp_path):
    """A copy of the package with libsymkv.so in its folder loads that one."""
    dst = tmp_path / "symkv"
    shutil.copytree(os.path.join(PKG, "symkv"), dst,
                    ignore=shutil.ignore_patterns("__pycache__", "libsymkv.so*"))
    shutil.copy(os.environ["SKV_LIBRARY"], dst / "libsymkv.so")
    env = dict(os.environ)
    env.pop("SKV_LIBRARY")
    env["PYTHONPATH"] = str(tmp_path)
    r = subprocess.run([sys.executable, "-c", "import symkv; print(symkv.library_path)"],
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert os.path.realpath(r.stdout.strip()) == os.path.realpath(str(dst / "libsymkv.so"))


def test_struct_sizes_match_the_C_library():
    # What the library can tell at run time (also checked at import).
    _lib.check_abi(symkv.lib)
    for cls, size in _lib.STRUCT_SIZES.items():
        assert ctypes.sizeof(cls) == size, cls.__name__


def test_struct_layouts_match_a_C_compiler(tmp_path):
    """sizeof and offsetof of every field, from a C program compiled against symkv.h."""
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        pytest.skip("no C compiler")
    header_text()
    structs = {"skv_config_t": _lib.Config, "skv_heap_opts_t": _lib.HeapOpts,
               "skv_heap_info_t": _lib.HeapInfo, "skv_geometry_t": _lib.Geometry,
               "skv_layout_desc_t": _lib.LayoutDesc, "skv_key_t": _lib.Key,
               "skv_page_ref_t": _lib.PageRef, "skv_kv_opts_t": _lib.KvOpts,
               "skv_kv_stats_t": _lib.KvStats, "skv_comm_opts_t": _lib.CommOpts,
               "skv_cluster_opts_t": _lib.ClusterOpts, "skv_cluster_ref_t": _lib.ClusterRef,
               "skv_cluster_stats_t": _lib.ClusterStats}
    lines = []
    for cname, cls in structs.items():
        lines.append('printf("%s %%zu\\n", sizeof(%s));' % (cname, cname))
        for f, _ in cls._fields_:
            lines.append('printf("%s.%s %%zu\\n", offsetof(%s, %s));' % (cname, f, cname, f))
    src = tmp_path / "probe.c"
    src.write_text("#include <stddef.h>\n#include <stdio.h>\n#include <symkv.h>\n"
                   "int main(void) {\n%s\nreturn 0;\n}\n" % "\n".join(lines))
    exe = tmp_path / "probe"
    subprocess.run([cc, "-std=c11", "-I", os.path.join(REPO, "include"), str(src), "-o",
                    str(exe)], check=True, timeout=120)
    got = dict(l.split() for l in subprocess.run([str(exe)], capture_output=True, text=True,
                                                  check=True).stdout.splitlines())
    for cname, cls in structs.items():
        assert int(got[cname]) == ctypes.sizeof(cls), cname
        for f, _ in cls._fields_:
            assert int(got["%s.%s" % (cname, f)]) == getattr(cls, f).offset, (cname, f)


def test_constants_match_the_header():
    text = header_text()
    for name, value in [("SKV_BACKEND_HOST", _lib.BACKEND_HOST),
                        ("SKV_BACKEND_CUDA", _lib.BACKEND_CUDA),
                        ("SKV_BACKEND_CUDA_HOST", _lib.BACKEND_CUDA_HOST),
                        ("SKV_LAYOUT_VLLM_FLASH_NHD", _lib.LAYOUT_VLLM_FLASH_NHD),
                        ("SKV_LAYOUT_VLLM_FLASH_HND", _lib.LAYOUT_VLLM_FLASH_HND),
                        ("SKV_LAYOUT_FLASHINFER_NHD", _lib.LAYOUT_FLASHINFER_NHD),
                        ("SKV_LAYOUT_FLASHINFER_HND", _lib.LAYOUT_FLASHINFER_HND),
                        ("SKV_LAYOUT_MLA", _lib.LAYOUT_MLA),
                        ("SKV_LAYOUT_CONTIGUOUS", _lib.LAYOUT_CONTIGUOUS),
                        ("SKV_DTYPE_BF16", _lib.DTYPE_BF16), ("SKV_DTYPE_FP16", _lib.DTYPE_FP16),
                        ("SKV_DTYPE_FP32", _lib.DTYPE_FP32), ("SKV_OP_MAX", _lib.OP_MAX),
                        ("SKV_OP_MIN", _lib.OP_MIN), ("SKV_ALGO_ONESHOT", _lib.ALGO_ONESHOT),
                        ("SKV_ALGO_TWOSHOT", _lib.ALGO_TWOSHOT), ("SKV_ALGO_NCCL", _lib.ALGO_NCCL),
                        ("SKV_SIGNAL_ADD", _lib.SIGNAL_ADD), ("SKV_CMP_LE", _lib.CMP_LE),
                        ("SKV_CMP_GT", _lib.CMP_GT)]:
        m = re.search(r"\b%s\s*=\s*(\d+)" % name, text)
        assert m and int(m.group(1)) == value, name
    for name, bit in _lib.SUBSYS.items():
        assert re.search(r"XX\(%s, 0x%02x\)" % (name, bit), text), name
    for name in ("CONFIG", "HEAP_OPTS", "GEOMETRY", "LAYOUT_DESC", "KV_OPTS", "COMM_OPTS"):
        m = re.search(r"#define SKV_%s_VERSION (\d+)" % name, text)
        assert int(m.group(1)) == getattr(_lib, "SKV_%s_VERSION" % name), name


def test_functions_missing_from_the_library_raise_NotSupported():
    stub = _lib._Missing("skv_comm_allreduce", "/x/libsymkv.so")
    with pytest.raises(symkv.NotSupported, match="skv_comm_allreduce.*does not export"):
        stub(None)
    for name in symkv.lib.missing:
        assert name in _lib.OPTIONAL and not symkv.has_function(name)
    assert symkv.has_function("skv_init") and not symkv.has_function("skv_nope")


def test_torch_is_not_imported():
    r = _import_in_subprocess({}, textwrap.dedent("""
        import sys, numpy as np, symkv
        g = symkv.Geometry(num_layers=1, num_kv_heads=1, head_dim=8, page_tokens=4, elem_bytes=4)
        a = [np.zeros((2, 4, 4, 1, 8), np.float32)]
        symkv.Layout.from_tensors(g, a, "vllm_flash")
        symkv.Namespace("m", g).hash_tokens(range(8))
        print("torch" in sys.modules)
        """))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"
