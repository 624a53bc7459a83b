"""What a vLLM-style KV connector needs, without vLLM: how many of a request's tokens the node
has cached (from its tokens or the engine's block hashes), loading those pages into given
engine blocks, and saving given blocks. docs/connector.md has a worked example."""

import numpy as np

from . import _lib, errors
from .kv import Geometry, KVCache, Layout, Namespace, as_keys, attach as _attach

__all__ = ["KVConnector"]


def _hash_bytes(h, i):
    """One engine block hash as bytes: bytes-like as is, str as UTF-8, int as 32 bytes little
    endian two's complement, objects with .hash_value (older vLLM BlockHash) by that value."""
    if hasattr(h, "hash_value"):
        h = h.hash_value
    if isinstance(h, (bytes, bytearray, memoryview)):
        return bytes(h)
    if isinstance(h, str):
        return h.encode("utf-8")
    if isinstance(h, (int, np.integer)) and not isinstance(h, bool):
        h = int(h)
        if not -(1 << 255) <= h < (1 << 256):
            _lib.invalid("block_hashes[%d]: an int hash must fit in 256 bits" % i)
        return (h & ((1 << 256) - 1)).to_bytes(32, "little")
    _lib.invalid("block_hashes[%d]: expected bytes, str or int, got %s" % (i, type(h).__name__))


class KVConnector:
    """Pages of `page_tokens` tokens, each made of m = page_tokens / block_size engine blocks.

    kv: the node-wide KVCache; namespace: the Namespace keys are made in (its geometry is the
    cache's); layout: the engine's KV cache (Layout), needed only to load and save (a
    scheduler-side connector can leave it None and call register_kv_caches later).

    Block ids are always the request's block table: the engine's block ids for the request's
    tokens from token 0 (block j holds tokens j*block_size ..). scratch_block: an engine block
    that may be overwritten (vLLM's null block 0), used when a page to load starts inside
    blocks the engine already computed; without one, those blocks are rewritten with the
    page's (identical) content.

    KVConnector.create(ctx, kv_caches, model=..., pages_per_pe=...) builds all of it; it is
    collective (it creates the KV cache), and close() (also collective) releases what it
    made."""

    def __init__(self, kv, namespace, layout=None, scratch_block=None):
        if not isinstance(kv, KVCache):
            _lib.invalid("KVConnector: kv must be a symkv.KVCache")
        if not isinstance(namespace, Namespace):
            _lib.invalid("KVConnector: namespace must be a symkv.Namespace")
        if namespace.geometry != kv.geometry:
            _lib.invalid("KVConnector: the namespace's geometry %r is not the cache's %r"
                         % (namespace.geometry, kv.geometry))
        self.kv = kv
        self.namespace = namespace
        self.layout = None
        self.scratch_block = scratch_block
        self._owned = []
        if layout is not None:
            self._set_layout(layout)

    @classmethod
    def create(cls, ctx, kv_caches=None, *, model, pages_per_pe, layout="vllm_flash",
               page_tokens=None, geometry=None, backend="host", salt=b"", secret=None,
               index_slots=0, scratch_block=None):
        """Collective. The geometry comes from `kv_caches` (per-layer tensors or arrays of
        `layout`'s shape; see symkv.Layout.from_tensors) unless `geometry` is given;
        page_tokens defaults to the engine's block size. `model` (plus `salt`) must name
        everything that changes the KV bytes: model, revision, TP shard, KV dtype."""
        geometry = cls._geometry(kv_caches, geometry, layout, page_tokens, "create")
        kv = ctx.kv_cache(geometry, pages_per_pe, backend, index_slots)
        return cls._around(kv, kv_caches, layout, model, salt, secret, scratch_block)

    @classmethod
    def attach(cls, name, kv_caches=None, *, model, role="owner", pages_per_pe=0,
               layout="vllm_flash", page_tokens=None, geometry=None, backend="host", salt=b"",
               secret=None, scratch_block=None, **attach_kw):
        """Not collective: attach this process to the elastic node domain `name` (symkv.attach;
        created when absent) and build the connector on it. An engine worker is an "owner"
        (pass its kv_caches: it saves and loads); a scheduler process is a "reader" with no
        kv_caches (num_matched_tokens only; it may run without a GPU). close() detaches this
        process alone. Other keywords go to symkv.attach (max_slots, index_slots, timeout_ms,
        device, group). Geometry, model and salt as for create()."""
        geometry = cls._geometry(kv_caches, geometry, layout, page_tokens, "attach")
        kv = _attach(name, geometry, role=role, backend=backend, pages_per_pe=pages_per_pe,
                     **attach_kw)
        return cls._around(kv, kv_caches, layout, model, salt, secret, scratch_block)

    @staticmethod
    def _geometry(kv_caches, geometry, layout, page_tokens, what):
        if geometry is not None:
            return geometry
        if kv_caches is None:
            _lib.invalid("KVConnector.%s: give kv_caches or geometry" % what)
        return Geometry.from_kv_caches(kv_caches, layout, page_tokens)

    @classmethod
    def _around(cls, kv, kv_caches, layout, model, salt, secret, scratch_block):
        """The connector over `kv`, owning it and what it builds (closed with it)."""
        ns = lay = None
        try:
            ns = Namespace(model, kv.geometry, salt, secret)
            if kv_caches is not None:
                lay = Layout.from_tensors(kv.geometry, kv_caches, layout)
        except BaseException:
            if ns is not None:
                ns.close()
            kv.close()
            raise
        self = cls(kv, ns, lay, scratch_block)
        self._owned = [x for x in (lay, ns, kv) if x is not None]
        return self

    def register_kv_caches(self, kv_caches, layout="vllm_flash"):
        """Describe the engine's KV cache (worker side): per-layer tensors or arrays, e.g.
        vLLM's dict of layer name -> tensor."""
        lay = Layout.from_tensors(self.kv.geometry, kv_caches, layout)
        self._set_layout(lay)
        self._owned.insert(0, lay)
        return lay

    def _set_layout(self, layout):
        if not isinstance(layout, Layout):
            _lib.invalid("KVConnector: layout must be a symkv.Layout")
        if layout.geometry != self.kv.geometry:
            _lib.invalid("KVConnector: the layout's geometry is not the cache's")
        self.layout = layout

    # -- sizes ------------------------------------------------------------------------------
    @property
    def page_tokens(self):
        return self.namespace.page_tokens

    @property
    def block_size(self):
        if self.layout is None:
            return None
        return self.layout.block_tokens

    def _m(self):
        if self.layout is None:
            _lib.raise_error(errors.InvalidState.code,
                             "KVConnector: no engine KV cache registered: pass a layout "
                             "or call register_kv_caches first (SKV_ESTATE, python)")
        return self.layout.blocks_per_page

    # -- keys -------------------------------------------------------------------------------
    def keys(self, tokens=None, block_hashes=None):
        """One key per full page: from the request's token ids (symkv's own hash chain), or
        from the engine's per-block hashes (chained by the engine, one per engine block; page
        i's key folds the hash of its last block). Exactly one of the two."""
        if (tokens is None) == (block_hashes is None):
            _lib.invalid("KVConnector: give exactly one of tokens or block_hashes")
        if tokens is not None:
            return self.namespace.hash_tokens(tokens)
        m = self.page_tokens // self.block_size if self.layout is not None else None
        if m is None:
            _lib.raise_error(errors.InvalidState.code,
                             "KVConnector: block hashes need the engine's block size: "
                             "register the KV caches (or pass a layout) first "
                             "(SKV_ESTATE, python)")
        n = len(block_hashes) // m
        out = np.empty((n, 2), dtype=np.uint64)
        for i in range(n):
            j = (i + 1) * m - 1
            out[i] = self.namespace.key_from_bytes(_hash_bytes(block_hashes[j], j))
        return out

    def _keys(self, tokens, block_hashes, keys):
        if keys is not None:
            if tokens is not None or block_hashes is not None:
                _lib.invalid("KVConnector: give keys, tokens or block_hashes, not several")
            return as_keys(keys)
        return self.keys(tokens, block_hashes)

    # -- scheduler side ---------------------------------------------------------------------
    def num_matched_tokens(self, tokens=None, *, block_hashes=None, keys=None,
                           num_computed_tokens=0, max_tokens=None):
        """How many tokens after the `num_computed_tokens` the engine already has can be
        loaded from the node (whole pages, counted from token 0; 0 if none). `max_tokens`
        caps the total: vLLM recomputes a prompt's last token, so pass len(prompt) - 1
        there. Nothing is pinned: load() looks the pages up again."""
        k = self._keys(tokens, block_hashes, keys)
        hit = self.kv.lookup(self.namespace, k).nhit
        total = hit * self.page_tokens
        if max_tokens is not None:
            total = min(total, int(max_tokens))
        return max(0, total - int(num_computed_tokens))

    # -- worker side ------------------------------------------------------------------------
    def _block_ids_for(self, block_ids, first_page, npages, computed, what):
        m = self._m()
        T = self.layout.block_tokens
        table = np.asarray(block_ids, dtype=np.int64).reshape(-1)
        need = (first_page + npages) * m
        if len(table) < need:
            _lib.invalid("%s: the block table has %d blocks but pages %d..%d need %d"
                         % (what, len(table), first_page, first_page + npages - 1, need))
        if len(table) and table[:need].min() < 0:
            _lib.invalid("%s: negative block id in the block table" % what)
        ids = table[first_page * m:need].astype(np.uint64)
        if computed > first_page * self.page_tokens:
            # Blocks of the first page the engine already holds: do not write them (unless no
            # scratch block was given: the page's content is the same).
            if self.scratch_block is not None:
                full = computed // T - first_page * m  # fully computed blocks
                ids[:max(0, full)] = self.scratch_block
        return ids

    def load(self, block_ids, tokens=None, *, block_hashes=None, keys=None,
             num_computed_tokens=0, num_tokens=None, stream=None):
        """Copy the node's cached pages after `num_computed_tokens` into the request's blocks
        (block_ids: its block table from token 0). num_tokens: how many tokens the scheduler
        was promised (num_matched_tokens); None loads as many as are cached. Pages are pinned
        from lookup to copy. Returns the tokens loaded after num_computed_tokens (fewer than
        promised if pages were evicted since: recompute the rest)."""
        P = self.page_tokens
        self._m()
        computed = int(num_computed_tokens)
        k = self._keys(tokens, block_hashes, keys)
        first = computed // P
        last = len(k)
        if num_tokens is not None:
            last = min(last, -(-(computed + int(num_tokens)) // P))
        if last <= first:
            return 0
        with self.kv.lookup(self.namespace, k[first:last], pin=True) as hit:
            if hit.nhit == 0:
                return 0
            ids = self._block_ids_for(block_ids, first, hit.nhit, computed, "load")
            self.kv.fetch(hit, self.layout, ids, unpin=True, stream=stream)
        loaded = (first + hit.nhit) * P - computed
        if num_tokens is not None:
            loaded = min(loaded, int(num_tokens))
        return max(0, loaded)

    def save(self, block_ids, tokens=None, *, block_hashes=None, keys=None, num_tokens=None,
             start_token=0, stream=None):
        """Publish the request's full pages among its first `num_tokens` tokens (default: all)
        from its blocks (block_ids: its block table from token 0), skipping pages that end at
        or before `start_token` (saved earlier) and keys the node has already. Returns how
        many pages this call inserted."""
        P = self.page_tokens
        self._m()
        k = self._keys(tokens, block_hashes, keys)
        n = len(k)
        if num_tokens is not None:
            n = min(n, int(num_tokens) // P)
        first = int(start_token) // P
        if n <= first:
            return 0
        ids = self._block_ids_for(block_ids, first, n - first, 0, "save")
        return self.kv.publish(self.namespace, k[first:n], self.layout, ids, stream=stream)

    # -- lifetime ---------------------------------------------------------------------------
    def close(self):
        """Release what create() / attach() / register_kv_caches() made (create's KV cache:
        collective; attach's: this process detaches alone)."""
        owned, self._owned = self._owned, []
        first = None
        for obj in owned:
            try:
                obj.close()
            except Exception as e:  # noqa: BLE001
                first = first or e
        if first is not None:
            raise first

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
