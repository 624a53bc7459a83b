"""Geometries and engine layouts from numpy arrays (and torch tensors when installed): every
preset's shape, strides from the arrays, validation, keeping the arrays alive."""
import errno
import gc
import weakref

import numpy as np
import pytest

import symkv
from conftest import torch_or_skip

KINDS = ["vllm_flash_nhd", "vllm_flash_hnd", "flashinfer_nhd", "flashinfer_hnd", "contiguous"]


def geom(L=2, H=2, D=8, page=8, elem=2, kind="split"):
    return symkv.Geometry(num_layers=L, num_kv_heads=H, head_dim=D, page_tokens=page,
                          elem_bytes=elem, kv_kind=kind)


def test_geometry():
    g = geom()
    assert g.page_bytes == 2 * 2 * 8 * 2 * 8 * 2
    assert g == geom() and hash(g) == hash(geom()) and g != geom(L=3)
    assert symkv.Geometry(1, 1, 576, 64, dtype="bfloat16", kv_kind="mla").page_bytes == 576 * 64 * 2
    assert symkv.Geometry(1, 1, 8, 4, dtype=np.float32).elem_bytes == 4
    with pytest.raises(AttributeError):
        g.num_layers = 3
    with pytest.raises(symkv.InvalidArgument, match="num_kv_heads=2 but kv_kind is SKV_KV_MLA"):
        geom(kind="mla")
    with pytest.raises(symkv.InvalidArgument, match="kv_kind 'x'"):
        geom(kind="x")
    with pytest.raises(symkv.InvalidArgument, match="out of range"):
        geom(L=-1)
    with pytest.raises(symkv.InvalidArgument, match="over 4 GiB"):
        symkv.Geometry(1024, 1024, 1024, 1024, elem_bytes=4)


@pytest.mark.parametrize("kind", KINDS + ["mla"])
def test_layout_from_numpy(kind):
    g = geom(kind="mla", H=1) if kind == "mla" else geom()
    shape = symkv.layer_shape(g, kind, 4, 10)
    n = 1 if kind == "contiguous" else g.num_layers
    arrs = [np.zeros(shape, np.float16) for _ in range(n)]
    lay = symkv.Layout.from_tensors(g, arrs, kind)
    assert (lay.block_tokens, lay.num_blocks, lay.device, lay.kind) == (4, 10, -1, kind)
    assert lay.blocks_per_page == 2 and not lay.torch and lay.writable
    # the byte size the C presets expect for one such tensor
    assert symkv.layer_bytes(g, kind, 4, 10) == arrs[0].nbytes
    # the same layout from the C preset (pointers)
    p = symkv.Layout.preset(g, kind, 4, 10, arrs)
    assert p.kind == kind
    assert g == symkv.Geometry.from_kv_caches(arrs, kind, page_tokens=8)
    lay.close()
    assert lay.closed
    lay.close()


def test_aliases_dicts_and_stacked():
    g = geom()
    caches = {"layer.%d" % l: np.zeros((2, 6, 4, 2, 8), np.float16) for l in range(2)}
    assert symkv.Layout.from_tensors(g, caches, "vllm").kind == "vllm_flash_nhd"
    assert symkv.Layout.from_tensors(g, caches).kind == "vllm_flash_nhd"
    stacked = np.zeros((2, 6, 2, 4, 2, 8), np.float16)  # (layers, blocks, 2, T, H, D)
    assert symkv.Layout.from_tensors(g, stacked, "flashinfer").kind == "flashinfer_nhd"
    g1 = geom(L=1)
    assert symkv.Layout.from_tensors(g1, np.zeros((2, 6, 4, 2, 8), np.float16)).num_blocks == 6


def test_strided_views_hnd_order_on_an_nhd_shape():
    """vLLM keeps HND physically but hands an NHD-shaped view (permuted strides)."""
    g = geom()
    phys = [np.zeros((2, 10, 2, 4, 8), np.float16) for _ in range(2)]   # (2, nb, H, T, D)
    views = [p.transpose(0, 1, 3, 2, 4) for p in phys]                  # (2, nb, T, H, D)
    lay = symkv.Layout.from_tensors(g, views, "vllm_flash_nhd")
    assert lay.num_blocks == 10 and lay.block_tokens == 4


def test_arrays_are_kept_alive():
    g = geom()
    arrs = [np.zeros((2, 6, 4, 2, 8), np.float16) for _ in range(2)]
    ref = weakref.ref(arrs[0])
    lay = symkv.Layout.from_tensors(g, arrs)
    del arrs
    gc.collect()
    assert ref() is not None
    assert lay.arrays[0] is ref()
    del lay
    gc.collect()
    assert ref() is None


def test_read_only_arrays_make_read_only_layouts():
    g = geom()
    arrs = [np.zeros((2, 6, 4, 2, 8), np.float16) for _ in range(2)]
    for a in arrs:
        a.flags.writeable = False
    assert not symkv.Layout.from_tensors(g, arrs).writable


@pytest.mark.parametrize("make,match", [
    (lambda g: [np.zeros((2, 6, 4, 2, 8), np.float16)],
     "1 layers of KV cache tensors but geometry.num_layers=2"),
    (lambda g: [np.zeros((2, 6, 4, 2, 8), np.float32)] * 2,
     "4-byte elements but geometry.elem_bytes=2"),
    (lambda g: [np.zeros((2, 6, 4, 3, 8), np.float16)] * 2,
     "3 KV heads but geometry.num_kv_heads=2"),
    (lambda g: [np.zeros((2, 6, 4, 2, 16), np.float16)] * 2, "head_dim 16 but geometry.head_dim=8"),
    (lambda g: [np.zeros((3, 6, 4, 2, 8), np.float16)] * 2, r"axis 0 \(K/V\) has 3 entries"),
    (lambda g: [np.zeros((6, 4, 2, 8), np.float16)] * 2, "needs 5 dimensions"),
    (lambda g: [np.zeros((2, 6, 4, 2, 8), np.float16),
                np.zeros((2, 7, 4, 2, 8), np.float16)], "kv_caches\\[1\\] has shape"),
    (lambda g: [np.zeros((2, 6, 4, 2, 16), np.float16)[..., ::2]] * 2, "must be contiguous"),
    (lambda g: [np.zeros((2, 6, 4, 2, 8), np.complex64)] * 2, "not a numeric element type"),
    (lambda g: [np.zeros((2, 6, 4, 2, 8), bool)] * 2, "not a numeric element type"),
    (lambda g: [[0.0] * 8] * 2, "expected a numpy array or a torch tensor"),
    (lambda g: [], "empty"),
    (lambda g: [np.zeros((2, 6, 3, 2, 8), np.float16)] * 2, "block_tokens=3 does not divide"),
    (lambda g: [np.zeros((2, 0, 4, 2, 8), np.float16)] * 2, "num_blocks"),
])
def test_bad_tensors(make, match):
    g = geom()
    with pytest.raises(symkv.InvalidArgument, match=match) as ei:
        symkv.Layout.from_tensors(g, make(g), "vllm_flash")
    assert ei.value.code == -errno.EINVAL


def test_overlapping_tensors_are_rejected_by_the_library():
    g = geom()
    a = np.zeros((2, 6, 4, 2, 8), np.float16)
    with pytest.raises(symkv.InvalidArgument, match="overlap|share") as ei:
        symkv.Layout.from_tensors(g, [a, a], "vllm_flash")
    assert "layout.c" in str(ei.value)


def test_layout_kind_checks():
    with pytest.raises(symkv.InvalidArgument, match="layout 'nope' is not one of"):
        symkv.Layout.from_tensors(geom(), [np.zeros(1)] * 2, "nope")
    with pytest.raises(symkv.InvalidArgument, match="needs an MLA geometry"):
        symkv.Layout.from_tensors(geom(), [np.zeros((6, 4, 8), np.float16)] * 2, "mla")
    gm = geom(kind="mla", H=1)
    with pytest.raises(symkv.InvalidArgument, match="use layout 'mla'"):
        symkv.Layout.from_tensors(gm, [np.zeros((2, 6, 4, 1, 8), np.float16)] * 2, "vllm_flash")
    with pytest.raises(symkv.InvalidArgument, match="expected a symkv.Geometry"):
        symkv.Layout.from_tensors((0, 2, 2, 8, 2, 8), [np.zeros(1)], "vllm_flash")


def test_custom_and_preset_errors():
    g = geom()
    a = np.zeros((6, 4, 2, 2, 8), np.float16)      # (nb, T, k|v, H, D): interleaved per token
    b = np.zeros((6, 4, 2, 2, 8), np.float16)
    base = [x.ctypes.data for x in (a, b)]
    lay = symkv.Layout.custom(g, 4, 6, base, [p + 2 * 8 * 2 for p in base],
                              stride_block=4 * 2 * 2 * 8, stride_token=2 * 2 * 8, stride_head=8,
                              keep=(a, b))
    assert lay.kind == "custom" and lay.arrays == (a, b)
    with pytest.raises(symkv.InvalidArgument, match="stride"):
        symkv.Layout.custom(g, 4, 6, base, [p + 32 for p in base], 0, 32, 8)
    with pytest.raises(symkv.InvalidArgument, match="num_layers=2 entries"):
        symkv.Layout.custom(g, 4, 6, base[:1], None, 256, 32, 8)
    with pytest.raises(symkv.InvalidArgument, match=r"layer_ptrs\[1\] is NULL"):
        symkv.Layout.preset(g, "vllm_flash", 4, 6, [base[0], None])
    with pytest.raises(symkv.InvalidArgument, match="not aligned"):
        symkv.Layout.preset(g, "vllm_flash", 4, 6, [base[0] + 1, base[1]])
    with pytest.raises(symkv.InvalidArgument, match="preset=9"):
        symkv.Layout.preset(g, 9, 4, 6, base)
    with pytest.raises(symkv.InvalidArgument, match="out of range"):
        symkv.Layout.preset(g, "vllm_flash", -4, 6, base)


def test_torch_cpu_tensors():
    torch = torch_or_skip()
    g = geom()
    ts = [torch.zeros((2, 6, 4, 2, 8), dtype=torch.bfloat16) for _ in range(2)]
    lay = symkv.Layout.from_tensors(g, ts)
    assert lay.torch and lay.device == -1
    assert symkv.Geometry.from_kv_caches(ts, page_tokens=8) == g
    with pytest.raises(symkv.InvalidArgument, match="4-byte"):
        symkv.Layout.from_tensors(g, [t.float() for t in ts])
    fp8 = getattr(torch, "float8_e4m3fn", None)
    if fp8 is not None:
        g8 = geom(elem=1)
        assert symkv.Layout.from_tensors(g8, [t.to(fp8) for t in ts]).device == -1


def test_torch_cuda_tensors():
    torch = torch_or_skip(cuda=True)
    g = geom()
    ts = [torch.zeros((6, 2, 4, 2, 8), dtype=torch.float16, device="cuda") for _ in range(2)]
    lay = symkv.Layout.from_tensors(g, ts, "flashinfer")
    assert lay.device == torch.cuda.current_device() and lay.torch
    from symkv import _arrays
    assert _arrays.current_stream(lay.device) == (torch.cuda.current_stream().cuda_stream or None)
    s = torch.cuda.Stream()
    assert _arrays.current_stream(lay.device, s) == s.cuda_stream


@pytest.mark.parametrize("kind", KINDS + ["mla"])
def test_preset_needs_exactly_the_pointers_C_reads(kind):
    # C reads 1 address for contiguous, else num_layers (V bases are offsets from them): a
    # shorter list used to let it read past the ctypes array and take garbage as layer bases.
    g = geom(L=8, kind="mla", H=1) if kind == "mla" else geom(L=8)
    shape = symkv.layer_shape(g, kind, 4, 6)
    need = 1 if kind == "contiguous" else 8
    arrs = [np.zeros(shape, np.float16) for _ in range(need)]
    assert symkv.Layout.preset(g, kind, 4, 6, arrs).kind == kind
    extra = [np.zeros(shape, np.float16) for _ in range(3)]
    # short lists first (C read past them), then too long, then empty
    for n in dict.fromkeys(n for n in (need - 1, 3, 1, need + 1, 0) if n != need):
        with pytest.raises(symkv.InvalidArgument,
                           match=r"%d layer_ptrs given; preset %s needs exactly %d"
                           % (n, kind, need)):
            symkv.Layout.preset(g, kind, 4, 6, (arrs + extra)[:n])
    if need > 1:
        with pytest.raises(symkv.InvalidArgument, match=r"layer_ptrs\[2\] is NULL \(None\)"):
            symkv.Layout.preset(g, kind, 4, 6, arrs[:2] + [None] + arrs[3:])
