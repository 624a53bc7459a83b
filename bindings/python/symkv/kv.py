"""KV geometry, engine layouts (from vLLM FlashAttention / FlashInfer / MLA tensors or numpy
arrays), namespaces and keys, and the node-wide KV cache: publish, lookup, fetch, evict."""

import collections
import ctypes
from ctypes import byref, c_size_t, c_uint64, c_void_p

import numpy as np

from . import _arrays, _lib, errors
from ._lib import lib
from ._resource import (BACKEND_NAMES, CollectiveResource, LocalResource, Resource, backend_id,
                        check_int, check_uint)

M64 = (1 << 64) - 1

# ---- geometry ---------------------------------------------------------------------------------

_KV_KINDS = {"split": _lib.KV_SPLIT, "mla": _lib.KV_MLA}
_GEOM_FIELDS = ("kv_kind", "num_layers", "num_kv_heads", "head_dim", "elem_bytes", "page_tokens")


def _elem_bytes(dtype):
    """Bytes per element of a numpy / torch dtype, a dtype name, or an int."""
    if isinstance(dtype, int):
        return dtype
    if _arrays.is_torch(dtype):
        return _arrays._torch().empty((), dtype=dtype).element_size()
    if isinstance(dtype, str) and dtype.lower() in ("bf16", "bfloat16", "fp16", "float16",
                                                     "half"):
        return 2
    if isinstance(dtype, str) and dtype.lower() in ("fp8", "float8", "float8_e4m3fn",
                                                     "float8_e5m2"):
        return 1
    return np.dtype(dtype).itemsize


class Geometry:
    """skv_geometry_t: the KV of `page_tokens` tokens for all layers of this PE's shard.
    kv_kind "split" (K and V) or "mla" (one latent vector; num_kv_heads 1); elem_bytes 1, 2
    or 4 (or pass dtype=). Validated by the C library on construction."""

    __slots__ = _GEOM_FIELDS + ("_page_bytes",)

    def __init__(self, num_layers, num_kv_heads, head_dim, page_tokens, elem_bytes=None,
                 kv_kind="split", dtype=None):
        if elem_bytes is None:
            if dtype is None:
                _lib.invalid("Geometry: give elem_bytes (1, 2 or 4) or dtype")
            elem_bytes = _elem_bytes(dtype)
        if isinstance(kv_kind, str):
            if kv_kind.lower() not in _KV_KINDS:
                _lib.invalid("Geometry: kv_kind %r is not 'split' or 'mla'" % kv_kind)
            kv_kind = _KV_KINDS[kv_kind.lower()]
        for name, v in zip(_GEOM_FIELDS, (kv_kind, num_layers, num_kv_heads, head_dim,
                                          elem_bytes, page_tokens)):
            object.__setattr__(self, name, check_uint("geometry." + name, v, 32))
        pb = c_uint64()
        lib.skv_geometry_get_page_bytes(byref(self.struct()), byref(pb))
        object.__setattr__(self, "_page_bytes", pb.value)

    def __setattr__(self, name, value):
        raise AttributeError("Geometry is immutable; make a new one")

    def struct(self):
        g = _lib.geometry_init()
        for name in _GEOM_FIELDS:
            setattr(g, name, getattr(self, name))
        return g

    @property
    def page_bytes(self):
        return self._page_bytes

    @property
    def kvn(self):
        return 1 if self.kv_kind == _lib.KV_MLA else 2

    @property
    def is_mla(self):
        return self.kv_kind == _lib.KV_MLA

    def astuple(self):
        return tuple(getattr(self, n) for n in _GEOM_FIELDS)

    def __eq__(self, other):
        return isinstance(other, Geometry) and self.astuple() == other.astuple()

    def __hash__(self):
        return hash(self.astuple())

    def __repr__(self):
        return ("Geometry(kv_kind=%r, num_layers=%d, num_kv_heads=%d, head_dim=%d, "
                "elem_bytes=%d, page_tokens=%d)" % (("split", "mla")[self.kv_kind],
                                                   *self.astuple()[1:]))

    @classmethod
    def from_kv_caches(cls, kv_caches, layout="vllm_flash", page_tokens=None):
        """The geometry of an engine's KV cache tensors (see Layout.from_tensors): layers,
        heads, head_dim and element size from the tensors; page_tokens defaults to the block
        size (it must be a multiple of it)."""
        spec, tensors = _split_tensors(kv_caches, layout)
        info = _arrays.describe(tensors[0], "kv_caches[0]")
        _check_ndim(spec, info, "kv_caches[0]")
        heads = info.shape[spec["head"]] if "head" in spec else 1
        dim = info.shape[spec["dim"]]
        block_tokens = info.shape[spec["token"]]
        if spec["name"] == "contiguous":
            nl, kvn = info.shape[spec["layer"]], info.shape[spec["kv"]]
            kind = _lib.KV_MLA if kvn == 1 else _lib.KV_SPLIT
        else:
            nl, kind = len(tensors), _lib.KV_MLA if spec["name"] == "mla" else _lib.KV_SPLIT
        return cls(num_layers=nl, num_kv_heads=heads, head_dim=dim,
                   page_tokens=block_tokens if page_tokens is None else page_tokens,
                   elem_bytes=info.itemsize, kv_kind=kind)


def _as_geometry(g):
    if not isinstance(g, Geometry):
        _lib.invalid("expected a symkv.Geometry, got %s" % type(g).__name__)
    return g


# ---- layouts ----------------------------------------------------------------------------------

# Axis of each level in the tensor of one layer (contiguous: the one tensor of all layers).
LAYOUTS = {
    "vllm_flash_nhd": dict(ndim=5, kv=0, block=1, token=2, head=3, dim=4,
                           preset=_lib.LAYOUT_VLLM_FLASH_NHD,
                           shape="(2, num_blocks, block_size, num_kv_heads, head_dim)"),
    "vllm_flash_hnd": dict(ndim=5, kv=0, block=1, head=2, token=3, dim=4,
                           preset=_lib.LAYOUT_VLLM_FLASH_HND,
                           shape="(2, num_blocks, num_kv_heads, block_size, head_dim)"),
    "flashinfer_nhd": dict(ndim=5, block=0, kv=1, token=2, head=3, dim=4,
                           preset=_lib.LAYOUT_FLASHINFER_NHD,
                           shape="(num_blocks, 2, block_size, num_kv_heads, head_dim)"),
    "flashinfer_hnd": dict(ndim=5, block=0, kv=1, head=2, token=3, dim=4,
                           preset=_lib.LAYOUT_FLASHINFER_HND,
                           shape="(num_blocks, 2, num_kv_heads, block_size, head_dim)"),
    "mla": dict(ndim=3, block=0, token=1, dim=2, preset=_lib.LAYOUT_MLA,
                shape="(num_blocks, block_size, kv_lora_rank + rope_dim)"),
    "contiguous": dict(ndim=6, block=0, layer=1, kv=2, token=3, head=4, dim=5,
                       preset=_lib.LAYOUT_CONTIGUOUS,
                       shape="(num_blocks, num_layers, 2 or 1, block_size, num_kv_heads, "
                             "head_dim), one tensor for all layers"),
}
for _n, _s in LAYOUTS.items():
    _s["name"] = _n
ALIASES = {"vllm": "vllm_flash_nhd", "vllm_flash": "vllm_flash_nhd", "flash_attn":
           "vllm_flash_nhd", "flashattention": "vllm_flash_nhd", "flashinfer": "flashinfer_nhd",
           "vllm_mla": "mla"}
PRESETS = {n: s["preset"] for n, s in LAYOUTS.items()}


def _layout_spec(name):
    if isinstance(name, str):
        key = ALIASES.get(name.lower(), name.lower())
        if key in LAYOUTS:
            return LAYOUTS[key]
    _lib.invalid("layout %r is not one of %s (or %s)" % (name, ", ".join(LAYOUTS),
                                                          ", ".join(ALIASES)))


def _split_tensors(kv_caches, layout):
    """(spec, list of per-layer tensors): a list/tuple, a dict (vLLM's layer name -> tensor,
    in layer order), or one tensor (contiguous; or per-layer kinds stacked on a leading
    layer axis)."""
    spec = _layout_spec(layout)
    if isinstance(kv_caches, dict):
        tensors = list(kv_caches.values())
    elif isinstance(kv_caches, (list, tuple)):
        tensors = list(kv_caches)
    elif spec["name"] == "contiguous":
        tensors = [kv_caches]
    else:
        nd = len(getattr(kv_caches, "shape", ()))
        if nd == spec["ndim"] + 1:
            tensors = [kv_caches[i] for i in range(kv_caches.shape[0])]
        elif nd == spec["ndim"]:
            tensors = [kv_caches]
        else:
            tensors = [kv_caches]  # describe() / the shape check says what is wrong
    if not tensors:
        _lib.invalid("kv_caches is empty: pass one tensor per layer")
    if spec["name"] == "contiguous" and len(tensors) != 1:
        _lib.invalid("layout 'contiguous' takes one tensor for all layers, got %d"
                     % len(tensors))
    return spec, tensors


def _check_ndim(spec, info, what):
    if len(info.shape) != spec["ndim"]:
        _lib.invalid("%s has shape %s; layout %s needs %d dimensions: %s"
                     % (what, info.shape, spec["name"], spec["ndim"], spec["shape"]))


def _keep_writable(objs):
    """False if a numpy array among `objs` is read-only (fetch would write into it)."""
    return not any(isinstance(o, np.ndarray) and not o.flags.writeable for o in objs)


class Layout(LocalResource):
    """How the engine stores its paged KV cache (skv_layout_t). Keeps the arrays / tensors it
    was made from alive as long as it lives. Make one with Layout.from_tensors (what engines
    use), Layout.preset (raw pointers, C presets) or Layout.custom (raw strides)."""

    _what = "layout"

    def __init__(self, geometry, handle, block_tokens, num_blocks, device, kind, keep=(),
                 writable=True, torch=False, first_layer=0, num_layers=None):
        self.geometry = geometry
        self.first_layer = first_layer
        self.num_layers = geometry.num_layers if num_layers is None else num_layers
        self._h = handle
        self.block_tokens = block_tokens
        self.num_blocks = num_blocks
        self.device = device
        self.kind = kind
        self.arrays = tuple(keep)
        self.writable = writable
        self.torch = torch

    def _destroy(self, h):
        lib.skv_layout_destroy(h)

    @property
    def blocks_per_page(self):
        return self.geometry.page_tokens // self.block_tokens

    def layers(self, first, n=1):
        """A layout of layers [first, first + n) only (skv_layout_create_layers; `first` counts
        the geometry's layers and the range must lie inside this layout's): fetch and write
        copy only those layers' bytes of each page, so an engine can load and save layer by
        layer. publish refuses it (a key is inserted only with its whole page written: use
        reserve / write / commit). InvalidArgument for a range outside this layout."""
        h = c_void_p()
        lib.skv_layout_create_layers(self.handle, check_uint("first", first, 32),
                                     check_uint("n", n, 32), byref(h))
        return Layout(self.geometry, h.value, self.block_tokens, self.num_blocks, self.device,
                      self.kind, self.arrays, writable=self.writable, torch=self.torch,
                      first_layer=int(first), num_layers=int(n))

    def __repr__(self):
        part = ("" if self.num_layers == self.geometry.num_layers else
                ", layers %d..%d" % (self.first_layer, self.first_layer + self.num_layers - 1))
        return ("<symkv.Layout %s, %d blocks of %d tokens, device %d%s%s>"
                % (self.kind, self.num_blocks, self.block_tokens, self.device, part,
                   ", closed" if self.closed else ""))

    @classmethod
    def from_tensors(cls, geometry, kv_caches, layout="vllm_flash"):
        """A layout over an engine's KV cache tensors (torch, CUDA or CPU) or numpy arrays,
        one per layer (a list, or a dict such as vLLM's kv_caches), of the shape of `layout`:

            vllm_flash_nhd (alias vllm_flash)  (2, num_blocks, block_size, heads, head_dim)
            vllm_flash_hnd                     (2, num_blocks, heads, block_size, head_dim)
            flashinfer_nhd (alias flashinfer)  (num_blocks, 2, block_size, heads, head_dim)
            flashinfer_hnd                     (num_blocks, 2, heads, block_size, head_dim)
            mla                                (num_blocks, block_size, latent_dim)
            contiguous                         one (num_blocks, layers, 2|1, block_size,
                                               heads, head_dim) tensor

        The shape names the axes; the strides may be anything symkv can address (e.g. vLLM's
        HND stride order on an NHD-shaped view), as long as head_dim is contiguous. Every
        layer must have the same shape, strides, dtype and device."""
        geometry = _as_geometry(geometry)
        spec, tensors = _split_tensors(kv_caches, layout)
        infos = [_arrays.describe(t, "kv_caches[%d]" % i) for i, t in enumerate(tensors)]
        first = infos[0]
        _check_ndim(spec, first, "kv_caches[0]")
        for i, inf in enumerate(infos[1:], 1):
            for attr in ("shape", "strides", "dtype", "device", "kind"):
                if getattr(inf, attr) != getattr(first, attr):
                    _lib.invalid("kv_caches[%d] has %s %s but kv_caches[0] has %s: every layer "
                                 "must match" % (i, attr, getattr(inf, attr),
                                                 getattr(first, attr)))
        g = geometry
        shape, st, e = first.shape, first.strides, first.itemsize
        if 0 in shape:
            _lib.invalid("kv_caches[0] has shape %s: no blocks (num_blocks=0) or an empty axis"
                         % (shape,))
        name = spec["name"]
        nl = shape[spec["layer"]] if name == "contiguous" else len(tensors)
        if nl != g.num_layers:
            _lib.invalid("%d layers of KV cache tensors but geometry.num_layers=%d"
                         % (nl, g.num_layers))
        if e != g.elem_bytes:
            _lib.invalid("kv_caches dtype %s has %d-byte elements but geometry.elem_bytes=%d"
                         % (first.dtype, e, g.elem_bytes))
        if name == "mla" and not g.is_mla:
            _lib.invalid("layout 'mla' needs an MLA geometry (kv_kind='mla')")
        if name not in ("mla", "contiguous") and g.is_mla:
            _lib.invalid("layout %r holds K and V but the geometry is MLA: use layout 'mla'"
                         % name)
        kvn = g.kvn
        if "kv" in spec and shape[spec["kv"]] != kvn:
            _lib.invalid("kv_caches[0] shape %s: axis %d (K/V) has %d entries, expected %d for "
                         "layout %s %s" % (shape, spec["kv"], shape[spec["kv"]], kvn, name,
                                           spec["shape"]))
        heads = shape[spec["head"]] if "head" in spec else 1
        if heads != g.num_kv_heads:
            _lib.invalid("kv_caches[0] shape %s has %d KV heads but geometry.num_kv_heads=%d "
                         "(layout %s %s)" % (shape, heads, g.num_kv_heads, name, spec["shape"]))
        if shape[spec["dim"]] != g.head_dim:
            _lib.invalid("kv_caches[0] shape %s has head_dim %d but geometry.head_dim=%d "
                         "(layout %s %s)" % (shape, shape[spec["dim"]], g.head_dim, name,
                                             spec["shape"]))
        if g.head_dim > 1 and st[spec["dim"]] != 1:
            _lib.invalid("kv_caches[0]: the head_dim axis has stride %d; the head_dim elements "
                         "of one vector must be contiguous (stride 1)" % st[spec["dim"]])
        block_tokens, num_blocks = shape[spec["token"]], shape[spec["block"]]

        def stride(level, default):
            # A level with a single item may have any stride; C wants a positive one.
            if level not in spec:
                return default
            s = st[spec[level]]
            return s if shape[spec[level]] > 1 or s > 0 else max(default, 1)

        sd = g.head_dim
        sh = stride("head", sd)
        stok = stride("token", heads * sh)
        sb = stride("block", block_tokens * stok)
        skv = stride("kv", 0) if "kv" in spec else 0
        nbase = g.num_layers
        kb = (c_void_p * nbase)()
        vb = (c_void_p * nbase)()
        for l in range(nbase):
            if name == "contiguous":
                base = first.ptr + l * st[spec["layer"]] * e
            else:
                base = infos[l].ptr
            kb[l] = base
            vb[l] = base + skv * e if kvn == 2 else None
        desc = _lib.layout_desc_init()
        desc.block_tokens = check_uint("block_size", block_tokens, 32)
        desc.num_blocks = num_blocks
        desc.k_base = kb
        desc.v_base = vb if kvn == 2 else None
        desc.stride_block, desc.stride_token, desc.stride_head = sb, stok, sh
        desc.device = first.device
        h = c_void_p()
        lib.skv_layout_create(byref(g.struct()), byref(desc), byref(h))
        return cls(g, h.value, block_tokens, num_blocks, first.device, name, tensors,
                   writable=all(i.writable for i in infos), torch=first.torch)

    @classmethod
    def preset(cls, geometry, preset, block_tokens, num_blocks, layer_ptrs, device=-1,
               keep=()):
        """skv_layout_create_preset: `preset` a LAYOUTS name or SKV_LAYOUT_* number;
        `layer_ptrs` addresses (ints) or arrays/tensors (their data pointers; kept alive).
        Exactly one entry for `contiguous`, else geometry.num_layers (checked before C reads
        them). `keep`: more objects to keep alive with the layout. fetch refuses the layout if
        a numpy array among layer_ptrs or keep is read-only."""
        geometry = _as_geometry(geometry)
        pid = _layout_spec(preset)["preset"] if isinstance(preset, str) else int(preset)
        name = [n for n, s in LAYOUTS.items() if s["preset"] == pid]
        name = name[0] if name else str(pid)
        objs = list(keep)
        ptrs = []
        writable = True
        if not isinstance(layer_ptrs, (list, tuple)):
            layer_ptrs = [layer_ptrs]
        # skv_layout_create_preset reads exactly this many addresses (V bases are offsets).
        nptr = 1 if pid == _lib.LAYOUT_CONTIGUOUS else geometry.num_layers
        if len(layer_ptrs) != nptr:
            _lib.invalid("Layout.preset: %d layer_ptrs given; preset %s needs exactly %d (%s)"
                         % (len(layer_ptrs), name, nptr,
                            "one cache for all layers" if pid == _lib.LAYOUT_CONTIGUOUS
                            else "geometry.num_layers, one per layer"))
        for i, p in enumerate(layer_ptrs):
            if p is None:
                _lib.invalid("Layout.preset: layer_ptrs[%d] is NULL (None); preset %s needs %d "
                             "addresses" % (i, name, nptr))
            if isinstance(p, int):
                ptrs.append(p)
            else:
                inf = _arrays.describe(p, "layer_ptrs[%d]" % i)
                ptrs.append(inf.ptr)
                objs.append(p)
                writable = writable and inf.writable
        arr = (c_void_p * nptr)(*ptrs)
        h = c_void_p()
        lib.skv_layout_create_preset(byref(geometry.struct()), pid,
                                     check_uint("block_tokens", block_tokens, 32),
                                     check_uint("num_blocks", num_blocks), arr,
                                     int(device), byref(h))
        return cls(geometry, h.value, block_tokens, num_blocks, int(device), name, objs,
                   writable=writable and _keep_writable(keep))

    @classmethod
    def custom(cls, geometry, block_tokens, num_blocks, k_base, v_base, stride_block,
               stride_token, stride_head, device=-1, keep=()):
        """skv_layout_create from raw values: k_base / v_base lists of per-layer addresses
        (v_base None for MLA), strides in elements. `keep`: objects to keep alive; fetch
        refuses the layout if a numpy array among them is read-only (the raw addresses
        themselves cannot be checked)."""
        geometry = _as_geometry(geometry)
        kb = (c_void_p * max(1, len(k_base)))(*k_base)
        vb = None if v_base is None else (c_void_p * max(1, len(v_base)))(*v_base)
        if len(k_base) != geometry.num_layers or (v_base is not None and
                                                  len(v_base) != geometry.num_layers):
            _lib.invalid("custom layout: k_base and v_base need geometry.num_layers=%d entries"
                         % geometry.num_layers)
        desc = _lib.layout_desc_init()
        desc.block_tokens = check_uint("block_tokens", block_tokens, 32)
        desc.num_blocks = check_uint("num_blocks", num_blocks)
        desc.k_base = kb
        desc.v_base = vb
        desc.stride_block, desc.stride_token, desc.stride_head = (
            int(stride_block), int(stride_token), int(stride_head))
        desc.device = int(device)
        h = c_void_p()
        lib.skv_layout_create(byref(geometry.struct()), byref(desc), byref(h))
        return cls(geometry, h.value, block_tokens, num_blocks, int(device), "custom", keep,
                   writable=_keep_writable(keep))


def layer_bytes(geometry, layout, block_tokens, num_blocks):
    """skv_layout_get_preset_layer_bytes: bytes of one layer's tensor of a preset."""
    geometry = _as_geometry(geometry)
    pid = _layout_spec(layout)["preset"] if isinstance(layout, str) else int(layout)
    out = c_uint64()
    lib.skv_layout_get_preset_layer_bytes(byref(geometry.struct()), pid,
                                      check_uint("block_tokens", block_tokens, 32),
                                      check_uint("num_blocks", num_blocks), byref(out))
    return out.value


def layer_shape(geometry, layout, block_tokens, num_blocks):
    """The per-layer tensor shape of a layout kind (to allocate engine caches)."""
    g = _as_geometry(geometry)
    name = _layout_spec(layout)["name"]
    T, H, D, nb = block_tokens, g.num_kv_heads, g.head_dim, num_blocks
    return {"vllm_flash_nhd": (2, nb, T, H, D), "vllm_flash_hnd": (2, nb, H, T, D),
            "flashinfer_nhd": (nb, 2, T, H, D), "flashinfer_hnd": (nb, 2, H, T, D),
            "mla": (nb, T, D), "contiguous": (nb, g.num_layers, g.kvn, T, H, D)}[name]


# ---- keys -------------------------------------------------------------------------------------


def _key_int(k):
    if isinstance(k, str):
        s = k.strip().lower().replace("-", "")
        if s.startswith("0x"):
            s = s[2:]
        if len(s) != 32:
            _lib.invalid("key %r: expected 32 hex digits (hi then lo)" % k)
        try:
            return int(s, 16)
        except ValueError:
            _lib.invalid("key %r is not hexadecimal" % k)
    if isinstance(k, (tuple, list, np.ndarray)) and len(k) == 2:
        hi, lo = int(k[0]), int(k[1])
        if not (0 <= hi <= M64 and 0 <= lo <= M64):
            _lib.invalid("key (%d, %d): hi and lo must be 64-bit unsigned" % (hi, lo))
        return (hi << 64) | lo
    if isinstance(k, (int, np.integer)) and not isinstance(k, bool):
        k = int(k)
        if not 0 <= k < (1 << 128):
            _lib.invalid("key %d is not a 128-bit unsigned integer" % k)
        return k
    _lib.invalid("a key must be a 128-bit int, a (hi, lo) pair or 32 hex digits, got %r"
                 % (k,))


def as_keys(keys):
    """Keys as a C-contiguous (n, 2) uint64 array of (hi, lo) rows (skv_key_t[n]), zero copy
    when they already are. Accepts such arrays, a Keys-like sequence of 128-bit ints, (hi, lo)
    pairs or 32-digit hex strings."""
    if isinstance(keys, np.ndarray) and keys.dtype == np.uint64:
        if keys.ndim == 1 and keys.shape[0] == 2:
            keys = keys.reshape(1, 2)
        if keys.ndim == 2 and keys.shape[1] == 2:
            return np.ascontiguousarray(keys)
        _lib.invalid("keys: a uint64 array of shape %s is not (n, 2) rows of (hi, lo)"
                     % (keys.shape,))
    if isinstance(keys, (int, str)):
        keys = [keys]
    ints = [_key_int(k) for k in keys]
    out = np.empty((len(ints), 2), dtype=np.uint64)
    for i, k in enumerate(ints):
        out[i, 0], out[i, 1] = k >> 64, k & M64
    return out


def key_to_int(row):
    """One key (a (hi, lo) row) as a 128-bit int, hi << 64 | lo."""
    return (int(row[0]) << 64) | int(row[1])


def keys_to_ints(keys):
    return [key_to_int(r) for r in as_keys(keys)]


def keys_to_hex(keys):
    """Keys as 32-hex-digit strings (hi then lo), as docs/hashing.md and the tests write."""
    return ["%016x%016x" % (int(r[0]), int(r[1])) for r in as_keys(keys)]


def as_tokens(tokens):
    """Tokens of one sequence as a C-contiguous 1-D uint32 array (zero copy when they are
    one). A (1, n) batch of one (what tokenizers return) is taken as its row; any other shape
    with more than one dimension is an InvalidArgument (hash each sequence on its own)."""
    tok = _arrays.as_uint_array(tokens, np.uint32, "tokens")
    if tok.ndim == 2 and tok.shape[0] == 1:
        tok = tok.reshape(-1)
    if tok.ndim != 1:
        _lib.invalid("tokens: shape %s is not one sequence: pass a 1-D array (or a (1, n) "
                     "batch of one); hash each sequence of a batch separately" % (tok.shape,))
    return tok


def _bytes_arg(v, what):
    return _lib.as_bytes(v, what)


class Namespace(LocalResource):
    """skv_namespace_t: keys of different namespaces never meet. Covers the model name, the
    geometry, a tenant salt and the deployment secret (None: $SKV_HASH_SECRET, else none).
    Put the TP shard, the KV dtype and anything else that changes K/V into the model string
    or the salt (docs/hashing.md)."""

    _what = "namespace"

    def __init__(self, model, geometry, salt=b"", secret=None):
        self.geometry = _as_geometry(geometry)
        m = _lib.as_bytes(model, "model", none_ok=False)
        if b"\0" in m:
            _lib.invalid("namespace model name contains a NUL byte")
        s = _bytes_arg(salt, "salt")
        sec = _bytes_arg(secret, "secret")
        h = c_void_p()
        lib.skv_namespace_create(m, byref(self.geometry.struct()), s or None, len(s),
                                 sec or None, len(sec), byref(h))
        self._h = h.value
        self.model = model

    def _destroy(self, h):
        lib.skv_namespace_destroy(h)

    @property
    def page_tokens(self):
        return self.geometry.page_tokens

    @property
    def id(self):
        """The namespace id as a 128-bit int (hi << 64 | lo)."""
        k = _lib.Key()
        lib.skv_namespace_get_id(self.handle, byref(k))
        return (k.hi << 64) | k.lo

    def hash_tokens(self, tokens, parent=None):
        """One key per full page of `tokens` (a chain). `parent`: the key of the page before
        tokens[0] when continuing a sequence (on a page boundary). Returns an (n, 2) uint64
        array of (hi, lo) rows."""
        tok = as_tokens(tokens)
        n = len(tok) // self.geometry.page_tokens
        keys = np.empty((n, 2), dtype=np.uint64)
        par = None
        if parent is not None:
            par = _lib.Key(*as_keys([parent])[0].tolist()) if not isinstance(parent, _lib.Key) \
                else parent
        nk = c_size_t()
        lib.skv_namespace_hash_tokens(self.handle, _arrays.ptr(tok, ctypes.c_uint32), len(tok),
                            byref(par) if par is not None else None,
                            _arrays.ptr(keys, _lib.Key), n, byref(nk))
        return keys[:nk.value]

    def key_from_bytes(self, data):
        """Fold an engine's own block hash (any bytes) into a key of this namespace; returns
        a (hi, lo) uint64 array of shape (2,)."""
        if isinstance(data, np.ndarray):
            b = np.ascontiguousarray(data).tobytes()
        elif isinstance(data, str):
            b = data.encode("utf-8")
        else:
            b = _bytes_arg(data, "key_from_bytes data")
        k = _lib.Key()
        lib.skv_namespace_hash_bytes(self.handle, b or None, len(b), byref(k))
        return np.array([k.hi, k.lo], dtype=np.uint64)

    def keys_from_bytes(self, items):
        """key_from_bytes of each item: an (n, 2) array."""
        out = np.empty((len(items), 2), dtype=np.uint64)
        for i, it in enumerate(items):
            out[i] = self.key_from_bytes(it)
        return out

    def __repr__(self):
        return "<symkv.Namespace %r %r>" % (self.model, self.geometry)


def hash_tokens(namespace, tokens, parent=None):
    """symkv.hash_tokens(ns, tokens, parent=None) == ns.hash_tokens(tokens, parent)."""
    return namespace.hash_tokens(tokens, parent)


# ---- the KV cache -----------------------------------------------------------------------------

KVStats = collections.namedtuple("KVStats", [n for n, _ in _lib.KvStats._fields_[1:]])


def as_refs(refs, what="refs"):
    """Page references as a C-contiguous (n, 4) uint32 array (pe, page, gen, reserved)."""
    if isinstance(refs, Lookup):
        refs = refs.refs
    if isinstance(refs, np.ndarray) and refs.dtype == np.uint32 and refs.ndim == 2 and \
            refs.shape[1] == 4:
        return np.ascontiguousarray(refs)
    arr = _arrays.as_uint_array(refs, np.uint32, what)
    if arr.size == 0:
        return np.zeros((0, 4), np.uint32)
    if arr.ndim == 1 and arr.shape[0] in (3, 4):
        arr = arr.reshape(1, -1)
    if arr.ndim != 2 or arr.shape[1] not in (3, 4):
        _lib.invalid("%s: expected (n, 4) rows of (pe, page, gen, reserved), got shape %s"
                     % (what, arr.shape))
    if arr.shape[1] == 3:
        arr = np.concatenate([arr, np.zeros((arr.shape[0], 1), np.uint32)], axis=1)
    return np.ascontiguousarray(arr)


def as_block_ids(block_ids, count, what="block_ids"):
    arr = _arrays.as_uint_array(block_ids, np.uint64, what).reshape(-1)
    if arr.shape[0] != count:
        _lib.invalid("%s has %d entries; this call needs exactly %d (pages x blocks per page)"
                     % (what, arr.shape[0], count))
    return arr


class Lookup:
    """The result of KVCache.lookup: `nhit` leading keys are cached; `refs` ((nhit, 4) uint32
    rows of pe, page, gen, reserved) say where. With pin=True the pages stay pinned until
    unpin() (also on leaving a `with` block, or fetch(..., unpin=True))."""

    def __init__(self, kv, refs, pinned):
        self.kv = kv
        self.refs = refs
        self.pinned = pinned

    @property
    def nhit(self):
        return len(self.refs)

    def __len__(self):
        return len(self.refs)

    def unpin(self):
        if self.pinned and len(self.refs):
            self.pinned = False
            self.kv.unpin(self.refs)
        self.pinned = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.pinned and not self.kv.closed:
            self.unpin()
        return False

    def __repr__(self):
        return "<symkv.Lookup %d hits%s>" % (self.nhit, ", pinned" if self.pinned else "")


class KVCache(CollectiveResource):
    """The node-wide KV cache (skv_kv_t): every local PE holds `pages_per_pe` pages of
    `geometry` in a heap of `backend`; the index and page metadata are node-shared. Made with
    Context.kv_cache (collective); closed with the context or by close() (collective)."""

    _what = "KV cache"

    def __init__(self, ctx, geometry, pages_per_pe, backend="host", index_slots=0):
        self.geometry = _as_geometry(geometry)
        opts = _lib.kv_opts_init()
        opts.backend = backend_id(backend)
        opts.pages_per_pe = check_uint("pages_per_pe", pages_per_pe)
        opts.index_slots = check_uint("index_slots", index_slots)
        h = c_void_p()
        lib.skv_kv_create(ctx.handle, byref(self.geometry.struct()), byref(opts), byref(h))
        self._adopt(ctx, h.value)
        self.backend = BACKEND_NAMES.get(opts.backend, opts.backend)

    def _destroy(self, h):
        lib.skv_kv_destroy(h)

    @property
    def heap(self):
        """The heap holding this PE's pages (a view; closed with the cache)."""
        from .heap import Heap
        return Heap._borrow(lib.skv_kv_get_heap(self.handle), self)

    def stats(self):
        st = _lib.out_struct(_lib.KvStats)
        lib.skv_kv_get_stats(self.handle, st)
        return KVStats(*[getattr(st, n) for n in KVStats._fields])

    def _check_ns(self, ns):
        if not isinstance(ns, Namespace):
            _lib.invalid("expected a symkv.Namespace, got %s" % type(ns).__name__)
        return ns.handle

    def _check_layout(self, layout):
        if not isinstance(layout, Layout):
            _lib.invalid("expected a symkv.Layout, got %s" % type(layout).__name__)
        return layout.handle

    def lookup(self, namespace, keys, pin=False):
        """How many leading keys of the chain are cached anywhere on the node (stops at the
        first miss). Returns a Lookup (nhit, refs); pin=True pins the hits (release with
        Lookup.unpin(), a `with` block, or fetch(..., unpin=True))."""
        nsh = self._check_ns(namespace)
        k = as_keys(keys)
        n = len(k)
        refs = np.zeros((n, 4), dtype=np.uint32)
        nhit = c_size_t()
        lib.skv_kv_lookup(self.handle, nsh, _arrays.ptr(k, _lib.Key), n,
                       _lib.LOOKUP_PIN if pin else 0, _arrays.ptr(refs, _lib.PageRef),
                       byref(nhit))
        return Lookup(self, refs[:nhit.value], bool(pin) and nhit.value > 0)

    def unpin(self, refs):
        """Release pins: a pinned Lookup's (InvalidState if it holds none), or raw refs whose
        pins this caller took (pin counts are shared by every request of the PE)."""
        r = as_refs(refs)
        if len(r) and isinstance(refs, Lookup) and not refs.pinned:
            _lib.raise_error(errors.InvalidState.code,
                             "unpin: this Lookup holds no pins (looked up without pin=True, or "
                             "already unpinned); unpinning would release pins other requests "
                             "hold (SKV_ESTATE, python)")
        lib.skv_kv_unpin(self.handle, _arrays.ptr(r, _lib.PageRef), len(r))
        if isinstance(refs, Lookup):
            refs.pinned = False

    def _stream(self, layout, stream):
        return _arrays.current_stream(layout.device, stream)

    def fetch(self, refs, layout, block_ids, unpin=False, stream=None):
        """Copy pages `refs` (a Lookup or (n, 4) rows) into the engine's blocks: page i fills
        block_ids[i*m : i*m+m], m = page_tokens / block_size. A stale reference fails
        with StaleReference; neither its blocks nor later ones are written (a CUDA fetch of
        SKV_FETCH_GATE_PAGES pages or more in one launch may still write earlier ones, in order
        on `stream`). Host layouts copy synchronously; CUDA
        ones are ordered on `stream` (default: torch's current stream of the layout's
        device). unpin=True also releases the lookup's pins once copied: a Lookup must
        hold them (InvalidState otherwise); raw refs must be pins this caller took."""
        lay = self._check_layout(layout)
        r = as_refs(refs)
        n = len(r)
        ids = as_block_ids(block_ids, n * layout.blocks_per_page)
        if n and not layout.writable:
            _lib.invalid("fetch: the layout's arrays are read-only")
        if unpin and n and isinstance(refs, Lookup) and not refs.pinned:
            _lib.raise_error(errors.InvalidState.code,
                             "fetch(unpin=True): this Lookup holds no pins (looked up without "
                             "pin=True, or already unpinned); unpinning would release pins "
                             "other requests hold (SKV_ESTATE, python)")
        lib.skv_kv_fetch(self.handle, _arrays.ptr(r, _lib.PageRef), n, lay,
                      _arrays.ptr(ids, ctypes.c_uint64), _lib.FETCH_UNPIN if unpin else 0,
                      self._stream(layout, stream))
        if unpin and isinstance(refs, Lookup):
            refs.pinned = False
        return n

    def publish(self, namespace, keys, layout, block_ids, stream=None):
        """Copy engine blocks into new pages of this PE and index them under `keys`: page i
        is made of block_ids[i*m : i*m+m]. Keys already cached anywhere are skipped. Returns
        how many keys this call inserted."""
        nsh = self._check_ns(namespace)
        lay = self._check_layout(layout)
        k = as_keys(keys)
        n = len(k)
        ids = as_block_ids(block_ids, n * layout.blocks_per_page)
        ins = c_size_t()
        lib.skv_kv_publish(self.handle, nsh, _arrays.ptr(k, _lib.Key), n, lay,
                        _arrays.ptr(ids, ctypes.c_uint64), self._stream(layout, stream),
                        byref(ins))
        return ins.value

    def reserve(self, namespace, keys):
        """Publishing in parts, step 1 (skv_kv_reserve): a page of this PE for each key not
        cached yet. Returns (n, 4) uint32 references; a row of generation 0 (column 2) has
        nothing to write (the key is cached already, or no page was free). The pages are this
        PE's alone (WRITING) until commit() or abort(): call one of them for every
        reservation."""
        nsh = self._check_ns(namespace)
        k = as_keys(keys)
        n = len(k)
        refs = np.zeros((n, 4), dtype=np.uint32)
        got = c_size_t()
        lib.skv_kv_reserve(self.handle, nsh, _arrays.ptr(k, _lib.Key), n,
                           _arrays.ptr(refs, _lib.PageRef), byref(got))
        return refs

    def write(self, refs, layout, block_ids, stream=None):
        """Step 2 (skv_kv_write): copy engine blocks into reserved pages, only the layers
        `layout` covers (Layout.layers); rows of generation 0 and their blocks are skipped.
        Host layouts copy synchronously, CUDA ones on `stream` (default: torch's current
        stream of the layout's device). InvalidState for a page this PE did not reserve."""
        lay = self._check_layout(layout)
        r = as_refs(refs)
        n = len(r)
        ids = as_block_ids(block_ids, n * layout.blocks_per_page)
        lib.skv_kv_write(self.handle, _arrays.ptr(r, _lib.PageRef), n, lay,
                         _arrays.ptr(ids, ctypes.c_uint64), self._stream(layout, stream))

    def commit(self, namespace, keys, refs, stream=None, device=None):
        """Step 3 (skv_kv_commit): index keys[i] for page refs[i] once every layer was
        written; returns the keys inserted (GPU pages: queued after what `stream` holds, or
        torch's current stream of `device`; sync() waits for the inserts)."""
        nsh = self._check_ns(namespace)
        k = as_keys(keys)
        r = as_refs(refs)
        if len(r) != len(k):
            _lib.invalid("commit: %d keys but %d references" % (len(k), len(r)))
        ins = c_size_t()
        lib.skv_kv_commit(self.handle, nsh, _arrays.ptr(k, _lib.Key), len(k),
                          _arrays.ptr(r, _lib.PageRef), self._mark_stream(stream, device),
                          byref(ins))
        return ins.value

    def abort(self, refs, stream=None, device=None):
        """Give reserved pages back unpublished (skv_kv_abort), ordered as commit is."""
        r = as_refs(refs)
        lib.skv_kv_abort(self.handle, _arrays.ptr(r, _lib.PageRef), len(r),
                         self._mark_stream(stream, device))

    @staticmethod
    def _mark_stream(stream, device):
        """commit / abort: `stream` as given, else torch's current stream of CUDA `device`,
        else NULL (host pages, or the legacy default stream)."""
        if stream is not None:
            return _arrays.current_stream(-1, stream)
        return _arrays.current_stream(device) if device is not None and device >= 0 else None

    def evict(self, npages):
        """Evict up to `npages` of this PE's least recently used unpinned pages; returns how
        many were evicted."""
        out = c_uint64()
        lib.skv_kv_evict(self.handle, check_uint("npages", npages), byref(out))
        return out.value

    def set_free_reserve(self, npages):
        """Keep `npages` of this PE's pages free for the next publish (0: none, the default):
        after each publish a helper thread evicts least recently used unpinned pages in the
        background until that many are free, so the next publish of up to `npages` pages does
        not evict on its way. Costs up to `npages` cached pages; at most half the pool.
        `free_reserve` reads back what was set."""
        lib.skv_kv_set_free_reserve(self.handle, check_uint("npages", npages))
        self._free_reserve = int(npages)

    @property
    def free_reserve(self):
        """The pages set_free_reserve keeps free (0: none)."""
        return getattr(self, "_free_reserve", 0)

    def sync(self):
        """Wait until this PE's stream-ordered publishes and fetches finished their host-side
        steps (index inserts, pin releases)."""
        lib.skv_kv_sync(self.handle)

    def __repr__(self):
        if self.closed:
            return "<symkv.KVCache closed>"
        return "<symkv.KVCache %s, %r>" % (self.backend, self.geometry)


__all__ = ["Geometry", "Layout", "Namespace", "KVCache", "Lookup", "KVStats", "LAYOUTS",
           "PRESETS", "as_keys", "as_tokens", "as_refs", "key_to_int", "keys_to_ints",
           "keys_to_hex", "hash_tokens", "layer_bytes", "layer_shape"]


ROLES = {"owner": _lib.ROLE_OWNER, "reader": _lib.ROLE_READER}


class DomainKV(KVCache):
    """This process's attachment to an elastic node domain (skv_kv_attach): every KVCache
    method works (publish needs an owner); close() (or leaving a `with` block) detaches this
    process alone, whenever it likes. Made by symkv.attach()."""

    _what = "domain attachment"

    def __init__(self, name, geometry, role="owner", backend="host", pages_per_pe=0,
                 max_slots=0, index_slots=0, timeout_ms=-1, device=-1, group=None,
                 namespace=None):
        self.geometry = _as_geometry(geometry)
        if role not in ROLES:
            _lib.invalid("role=%r is not 'owner' or 'reader'" % (role,))
        if not isinstance(name, str):
            _lib.invalid("the domain name must be a str, got %s" % type(name).__name__)
        o = _lib.attach_opts_init()
        o.role = ROLES[role]
        o.backend = backend_id(backend)
        o.pages_per_pe = check_uint("pages_per_pe", pages_per_pe)
        o.max_slots = check_uint("max_slots", max_slots, 32)
        o.index_slots = check_uint("index_slots", index_slots)
        o.timeout_ms = check_int("timeout_ms", timeout_ms)
        o.device = check_int("device", device)
        o.group = -1 if group is None else check_int("group", group, 0)
        if namespace is not None:
            if not isinstance(namespace, Namespace):
                _lib.invalid("namespace: expected a symkv.Namespace, got %s"
                             % type(namespace).__name__)
            o.ns = namespace.handle
            self._ns = namespace  # kept alive while attached
        h = c_void_p()
        lib.skv_kv_attach(name.encode(), byref(self.geometry.struct()), byref(o), byref(h))
        self._h = h.value
        self.name = name
        self.role = role
        self.backend = BACKEND_NAMES.get(o.backend, o.backend)

    def _destroy(self, h):
        lib.skv_kv_detach(h)

    def detach(self):
        """Leave the domain (same as close())."""
        self.close()

    def close(self):
        Resource.close(self)

    def __del__(self):
        if self._h:
            try:
                self.close()
            except Exception:  # noqa: BLE001
                pass

    def __repr__(self):
        return "<symkv.DomainKV %r %s%s>" % (self.name, self.role, ", detached" if self.closed
                                              else "")


def attach(name, geometry, role="owner", **kw):
    """Attach this process to the elastic node domain `name` (created when absent) as an
    "owner" (pages of its own: publish, lookup, fetch) or a "reader" (lookup and fetch; may run
    without a GPU). Keywords: backend ("host" or "cuda": where the pages live), pages_per_pe,
    max_slots, index_slots, timeout_ms, device, group (a gid whose members may attach too),
    namespace (the one namespace the domain serves). Use it as a context manager:

        with symkv.attach("llama-8b", geom, role="reader") as kv:
            hits = kv.lookup(ns, keys)
    """
    return DomainKV(name, geometry, role=role, **kw)
