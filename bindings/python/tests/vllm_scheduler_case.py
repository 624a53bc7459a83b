"""SymkvConnector driven through vLLM's own objects in one process, for test_vllm.py: vLLM's
Scheduler (which calls the scheduler-side hooks and builds the SchedulerOutput), vLLM Requests
with vLLM's block hasher, KV cache views made by vLLM's create_kv_cache_views over every layout
vLLM 0.32 has (with and without kernel block splitting), and vLLM's ModelRunnerOutput /
KVConnectorOutput going back into the scheduler. The worker-side hooks are called in the order
vLLM's model runner calls them. Prints "CASE name OK" per case; exits non-zero on a failure.

    python vllm_scheduler_case.py MODEL_DIR [CASE ...]"""

import os
import sys
import uuid

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import torch  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging  # noqa: E402
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig,  # noqa: E402
                                        KVCacheGroupSpec, KVCacheTensor, MLAAttentionSpec,
                                        compute_layout_strides, create_kv_cache_views,
                                        group_kernel_blocks)
from vllm.v1.request import RequestStatus  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from symkv.vllm import SymkvConnector  # noqa: E402

BS, NB, LAYERS, HEADS, HEAD = 32, 24, 2, 2, 64
init_none_hash(sha256)
HASHER = get_request_block_hasher(BS, sha256)


def check(cond, what):
    if not cond:
        raise AssertionError(what)


class _TpRank:
    """vLLM's TP rank and world size as a worker of a TP engine sees them, for the duration of
    register_kv_caches (this process runs every rank's worker-side connector itself)."""

    def __init__(self, rank, world):
        self.rank, self.world = rank, world

    def __enter__(self):
        import vllm.distributed.parallel_state as ps
        self.saved = ps.get_tensor_model_parallel_rank, ps.get_tensor_model_parallel_world_size
        ps.get_tensor_model_parallel_rank = lambda: self.rank
        ps.get_tensor_model_parallel_world_size = lambda: self.world

    def __exit__(self, *exc):
        import vllm.distributed.parallel_state as ps
        ps.get_tensor_model_parallel_rank, ps.get_tensor_model_parallel_world_size = self.saved


class Engine:
    """vLLM's Scheduler with the connector, plus a worker-side connector over KV views per TP
    rank (their outputs merged by vLLM's KVOutputAggregator, as vLLM's executor does)."""

    def __init__(self, model, domain, layout=KVCacheLayout.LBHNC, kernel=None, fill=None,
                 timeout_ms=30000, load_async=False, mla=False, tp=1, log_stats=False,
                 layerwise=False, free_reserve=None):
        extra = {"domain": domain, "cache_gb": 0.05, "timeout_ms": timeout_ms}
        if free_reserve is not None:
            extra["free_reserve_pages"] = free_reserve
        if load_async:
            extra["load_async"] = True
        if layerwise:
            extra["layerwise"] = True
        ktc = KVTransferConfig(kv_connector="SymkvConnector", kv_role="kv_both",
                               kv_connector_module_path="symkv.vllm",
                               kv_load_failure_policy="recompute",
                               kv_connector_extra_config=extra)
        self.cfg = EngineArgs(model=model, dtype="float32", block_size=BS, max_model_len=1024,
                              enforce_eager=True, skip_tokenizer_init=True,
                              enable_prefix_caching=False, tensor_parallel_size=tp,
                              distributed_executor_backend="mp" if tp > 1 else None,
                              kv_transfer_config=ktc).create_engine_config()
        names = ["model.layers.%d.self_attn.attn" % i for i in range(LAYERS)]
        if mla:  # as MLAAttention.get_kv_cache_spec makes it: one latent "head", replicated
            spec = MLAAttentionSpec(block_size=BS, num_kv_heads=1, max_tp_shards=1,
                                    head_size=HEAD + 32, dtype=torch.float32)
        else:
            spec = FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=HEAD,
                                     dtype=torch.float32)
        page = spec.page_size_bytes
        # Layer and block strides as vLLM's allocator lays them out for this layout.
        lstride, bstride = compute_layout_strides(spec, NB, LAYERS, layout)[:2]
        tensor = KVCacheTensor(size=page * NB * LAYERS, layers=names, layer_stride=lstride,
                               block_stride=bstride)
        self.kvcfg = KVCacheConfig(num_blocks=NB, kv_cache_tensors=[tensor],
                                   kv_cache_groups=[KVCacheGroupSpec(names, spec)],
                                   kv_cache_layout=layout.name)
        self.workers, self.all_views = [], []
        for rank in range(tp):
            # MLA ranks hold the same latent KV (the same random fill); dense ones their own.
            g = torch.Generator().manual_seed((fill or 0) + (0 if mla else 1000 * rank))
            raw = torch.empty(tensor.size, dtype=torch.int8)
            if fill is None:
                raw.zero_()
            else:
                raw.copy_(torch.randint(-100, 100, (tensor.size,), generator=g,
                                        dtype=torch.int8))
            views = dict(zip(names, create_kv_cache_views(raw, spec, NB, layout, tensor,
                                                          kernel_block_size=kernel)))
            w = SymkvConnector(self.cfg, KVConnectorRole.WORKER, self.kvcfg)
            with _TpRank(rank, tp):
                w.register_kv_caches(views)
            self.workers.append(w)
            self.all_views.append(views)
        self.worker, self.views = self.workers[0], self.all_views[0]
        self.agg = KVOutputAggregator(tp)
        self.cfg.cache_config.num_gpu_blocks = NB   # what the engine core sets after profiling
        self.sched = Scheduler(self.cfg, self.kvcfg, StructuredOutputManager(self.cfg),
                               block_size=BS, log_stats=log_stats)

    def forward(self, rank=0, skip=()):
        """The per-layer hooks of a forward, as vLLM's attention layers call them
        (kv_transfer_utils.maybe_transfer_kv_layer): for each layer in order,
        wait_for_layer_load before it reads the cache, save_kv_layer after it wrote it.
        `skip`: layers whose attention does not call them (tests of the safety net)."""
        w = self.workers[rank]
        for i, (name, view) in enumerate(self.all_views[rank].items()):
            if i not in skip:
                w.wait_for_layer_load(name)
                w.save_kv_layer(name, view, None)

    def block(self, b, rank=0):
        """Block b of every layer (manager block: kernel blocks grouped) of a TP rank."""
        # As integers: random bytes make NaNs, which never compare equal as floats.
        return [group_kernel_blocks(v, NB)[b].contiguous().view(torch.int32)
                for v in self.all_views[rank].values()]

    def step(self, sampled=7):
        """One engine step: schedule (scheduler hooks), each worker's hooks in the model
        runner's order (KVConnectorModelRunnerMixin._get_kv_connector_output), the workers'
        outputs merged by vLLM's KVOutputAggregator, back into the scheduler. Returns
        (SchedulerOutput, the merged KVConnectorOutput, update_from_output's result)."""
        return self.finish(self.sched.schedule())

    def finish(self, so, sampled=7):
        """The workers' part of step() and the output back into the scheduler."""
        ids = list(so.num_scheduled_tokens)
        outs = []
        for rank, w in enumerate(self.workers):
            w.bind_connector_metadata(so.kv_connector_metadata)
            if so.has_sync_kv_loads:
                w.start_load_kv(None)
            self.forward(rank)
            if not so.has_sync_kv_loads:
                w.start_load_kv(None)
            w.wait_for_save()
            res = w.get_transfer_results(so.finished_req_ids)
            kvo = KVConnectorOutput(finished_sending=res.finished_sending,
                                    finished_recving=res.finished_recving,
                                    invalid_block_ids=w.get_block_ids_with_load_errors(),
                                    kv_connector_stats=w.get_kv_connector_stats(),
                                    kv_connector_worker_meta=w.build_connector_worker_meta())
            w.clear_connector_metadata()
            outs.append(ModelRunnerOutput(req_ids=ids,
                                          req_id_to_index={r: i for i, r in enumerate(ids)},
                                          sampled_token_ids=[[sampled] for _ in ids],
                                          kv_connector_output=kvo))
        out = self.agg.aggregate(outs)
        eco = self.sched.update_from_output(so, out)
        return so, out.kv_connector_output, eco

    def add(self, rid, prompt, salt=None):
        req = Request(rid, prompt, SamplingParams(max_tokens=3, ignore_eos=True), None,
                      cache_salt=salt, block_hasher=HASHER)
        self.sched.add_request(req)
        return req

    def close(self):
        self.sched.shutdown()
        for w in self.workers:
            w.shutdown()


P1 = list(range(4, 204))
P2 = P1[:150] + list(range(600, 640))


def case_share(model, layout=KVCacheLayout.LBHNC, kernel=None, reserve=True):
    """A saves P1 after its prefill; B (another scheduler and worker) gets P2: exactly the 4
    shared blocks are reported, loaded byte for byte into B's blocks, pinned until B's
    workers report the load, then unpinned."""
    dom = "t-case-%s" % uuid.uuid4().hex[:10]
    for bad in (-1, True, "8", 1 << 40) if reserve else ():
        try:
            Engine(model, dom, layout, kernel, free_reserve=bad)
        except ValueError as e:
            check("free_reserve_pages must be an integer" in str(e), "refusal %r" % e)
        else:
            check(False, "free_reserve_pages=%r accepted" % (bad,))
    a = Engine(model, dom, layout, kernel, fill=1, free_reserve=4 if reserve else None)
    check(a.worker._kv.free_reserve == (4 if reserve else 0),
          "A's reserve %r" % a.worker._kv.free_reserve)
    try:
        b = Engine(model, dom, layout, kernel)
    except BaseException:
        a.close()
        raise
    try:
        r1 = a.add("a1", P1)
        so = a.step()[0]
        table_a = so.scheduled_new_reqs[0].block_ids[0]
        check(a.worker.stats["saved_pages"] == 6, "A saved %r" % a.worker.stats)
        b.add("b1", P2)
        so = b.sched.schedule()
        new = so.scheduled_new_reqs[0]
        check(new.num_computed_tokens == 128, "B computed %d" % new.num_computed_tokens)
        check(so.num_scheduled_tokens["b1"] == len(P2) - 128, "scheduled %r"
              % so.num_scheduled_tokens)
        check(so.has_sync_kv_loads, "a synchronous load")
        meta = so.kv_connector_metadata
        check(len(meta.loads) == 1 and len(meta.loads[0].block_ids) == 4, "loads %r" % meta.loads)
        # While B's load is pending its pages are pinned: A cannot evict them.
        check(a.worker._kv.evict(100) == 2, "A evicted pinned pages")
        w = b.worker
        w.bind_connector_metadata(meta)
        w.start_load_kv(None)
        b.forward()
        w.wait_for_save()
        kvo = KVConnectorOutput(invalid_block_ids=w.get_block_ids_with_load_errors(),
                                kv_connector_worker_meta=w.build_connector_worker_meta())
        w.clear_connector_metadata()
        check(not kvo.invalid_block_ids, "load errors %r" % kvo.invalid_block_ids)
        table_b = new.block_ids[0]
        for j in range(4):
            for x, y in zip(a.block(table_a[j]), b.block(table_b[j])):
                check(torch.equal(x, y), "block %d differs" % j)
        zero = [torch.zeros_like(t) for t in b.block(table_b[4])]
        check(all(torch.equal(x, z) for x, z in zip(b.block(table_b[4]), zero)),
              "block 4 was written")
        out = ModelRunnerOutput(req_ids=["b1"], req_id_to_index={"b1": 0},
                                sampled_token_ids=[[7]], kv_connector_output=kvo)
        b.sched.update_from_output(so, out)       # the scheduler unpins
        check(a.worker._kv.evict(100) == 4, "pins not released after the load")
        del r1
    finally:
        a.close()
        b.close()


def case_layerwise(model):
    """Layer by layer, in the order vLLM's attention layers call the hooks: A's pages are
    reserved at its first save_kv_layer and written one layer per call; until wait_for_save
    commits them, B's scheduler matches nothing (a partly saved page is never found). B loads
    one layer per wait_for_layer_load (host caches: each layer copied right before its
    attention): after layer 0's call, layer 0 of B's blocks is A's and layer 1 is untouched.
    A forward that never asks for a layer gets the load's blocks reported as load errors
    (vLLM recomputes them), never served half loaded."""
    from symkv.vllm import SymkvConnector
    # opt-in: by default whole pages, and vLLM may keep full CUDA graphs
    check(not SymkvConnector.requires_piecewise_for_cudagraph({}) and
          SymkvConnector.requires_piecewise_for_cudagraph({"layerwise": True}),
          "layerwise is not opt-in")
    dom = "t-case-%s" % uuid.uuid4().hex[:10]
    a = Engine(model, dom, fill=5, layerwise=True)
    b = Engine(model, dom, layerwise=True)
    try:
        a.add("a1", P1)
        so = a.sched.schedule()
        table_a = so.scheduled_new_reqs[0].block_ids[0]
        w = a.worker
        w.bind_connector_metadata(so.kv_connector_metadata)
        names = list(a.views)
        w.wait_for_layer_load(names[0])
        w.save_kv_layer(names[0], a.views[names[0]], None)
        check(w.stats["save_layers"] == 1, "layer 0 not saved on its own: %r" % w.stats)
        probe = Request("probe", P2, SamplingParams(max_tokens=3), None, block_hasher=HASHER)
        bc = b.sched.connector
        check(bc.get_num_new_matched_tokens(probe, 0)[0] == 0,
              "a page with one of two layers written was found")
        w.wait_for_layer_load(names[1])
        w.save_kv_layer(names[1], a.views[names[1]], None)
        check(bc.get_num_new_matched_tokens(probe, 0)[0] == 0,
              "written pages were found before the commit")
        bc.request_finished(probe, [])
        w.wait_for_save()
        check(w.stats["saved_pages"] == 6 and w.stats["save_layers"] == 2,
              "A's save %r" % w.stats)
        check([h[0] for h in list(w.hook_log)[-5:]] ==
              ["wait_for_layer_load", "save_kv_layer", "wait_for_layer_load", "save_kv_layer",
               "wait_for_save"], "hook order %r" % list(w.hook_log))
        w.clear_connector_metadata()

        b.add("b1", P2)
        so = b.sched.schedule()
        new = so.scheduled_new_reqs[0]
        check(new.num_computed_tokens == 128, "B computed %d" % new.num_computed_tokens)
        table_b = new.block_ids[0]
        wb = b.worker
        wb.bind_connector_metadata(so.kv_connector_metadata)
        wb.start_load_kv(None)
        nb = list(b.views)
        wb.wait_for_layer_load(nb[0])
        for j in range(4):
            x0, x1 = a.block(table_a[j]), b.block(table_b[j])
            check(torch.equal(x0[0], x1[0]), "block %d: layer 0 not loaded by its call" % j)
            check(not x1[1].any(), "block %d: layer 1 loaded before its call" % j)
        wb.save_kv_layer(nb[0], b.views[nb[0]], None)
        wb.wait_for_layer_load(nb[1])
        wb.save_kv_layer(nb[1], b.views[nb[1]], None)
        wb.wait_for_save()
        check(not wb.get_block_ids_with_load_errors(), "load errors")
        check(wb.stats["load_layers"] == 2 and wb.stats["loaded_pages"] == 4,
              "B's load %r" % wb.stats)
        for j in range(4):
            for x, y in zip(a.block(table_a[j]), b.block(table_b[j])):
                check(torch.equal(x, y), "block %d differs" % j)
        wb.clear_connector_metadata()

        # the safety net: a forward that skips layer 1's hooks
        c = Engine(model, dom, layerwise=True)
        try:
            c.add("c1", P2)
            so = c.sched.schedule()
            check(so.scheduled_new_reqs[0].num_computed_tokens == 160, "C matched")
            wc = c.worker
            wc.bind_connector_metadata(so.kv_connector_metadata)
            wc.start_load_kv(None)
            c.forward(skip=(1,))
            wc.wait_for_save()
            bad = wc.get_block_ids_with_load_errors()
            check(bad == set(so.scheduled_new_reqs[0].block_ids[0][:5]),
                  "a half-loaded load was not reported: %r" % bad)
            wc.clear_connector_metadata()
        finally:
            c.close()
    finally:
        a.close()
        b.close()


def case_salt_and_no_whole_prompt(model):
    """Another cache_salt matches nothing; the whole prompt is never claimed (a 192-token
    prompt of 6 full blocks matches 5)."""
    dom = "t-case-%s" % uuid.uuid4().hex[:10]
    a = Engine(model, dom, fill=2)
    b = Engine(model, dom)
    try:
        a.add("a1", P1)
        a.step()
        b.add("b1", P1[:150], salt="tenant-2")
        so = b.step()[0]
        check(so.scheduled_new_reqs[0].num_computed_tokens == 0, "salted request matched")
        b.add("b2", P1[:192])
        so = b.step()[0]
        check(so.scheduled_new_reqs[0].num_computed_tokens == 160,
              "192-token prompt: %d" % so.scheduled_new_reqs[0].num_computed_tokens)
    finally:
        a.close()
        b.close()


def case_load_failure_recomputes(model):
    """The owner of the matched pages leaves between the match and the load: the worker cannot
    copy them (stale references, never the new bytes), reports the blocks through
    get_block_ids_with_load_errors, and vLLM's scheduler (policy recompute) rolls the request
    back to recompute them."""
    dom = "t-case-%s" % uuid.uuid4().hex[:10]
    a = Engine(model, dom, fill=3, timeout_ms=500)
    b = Engine(model, dom, timeout_ms=500)
    try:
        a.add("a1", P1)
        a.step()
        req = b.add("b1", P2)
        so = b.sched.schedule()
        check(so.scheduled_new_reqs[0].num_computed_tokens == 128, "matched")
        a.worker.shutdown()       # detach: waits 0.5 s for B's pins, then leaves anyway
        w = b.worker
        w.bind_connector_metadata(so.kv_connector_metadata)
        w.start_load_kv(None)
        b.forward()
        w.wait_for_save()
        bad = w.get_block_ids_with_load_errors()
        table_b = so.scheduled_new_reqs[0].block_ids[0]
        check(bad == set(table_b[:4]), "errors %r, table %r" % (bad, table_b))
        zero = [torch.zeros_like(t) for t in b.block(table_b[0])]
        check(all(torch.equal(x, z) for x, z in zip(b.block(table_b[0]), zero)),
              "a stale page was copied")
        kvo = KVConnectorOutput(invalid_block_ids=bad,
                                kv_connector_worker_meta=w.build_connector_worker_meta())
        w.clear_connector_metadata()
        out = ModelRunnerOutput(req_ids=["b1"], req_id_to_index={"b1": 0},
                                sampled_token_ids=[[7]], kv_connector_output=kvo)
        b.sched.update_from_output(so, out)
        check(req.num_computed_tokens == 0, "not rolled back: %d" % req.num_computed_tokens)
        so = b.step()[0]          # recomputes from token 0
        check(so.scheduled_cached_reqs.num_computed_tokens == [0] or
              so.num_scheduled_tokens.get("b1") == len(P2),
              "next step %r" % so.num_scheduled_tokens)
    finally:
        a.sched.shutdown()
        b.close()


def case_layouts(model):
    """Every layout vLLM 0.32 builds, with and without kernel block splitting (16-token kernel
    blocks in 32-token blocks): dense blocks round-trip byte for byte; layouts whose block is
    not one dense range are refused with a clear error."""
    for layout in KVCacheLayout:
        for kernel in (None, 16):
            try:
                case_share(model, layout, kernel, reserve=False)
                result = "round trip"
            except ValueError as e:
                if "cannot be split into" in str(e):
                    result = "vLLM refuses kernel blocks here"
                else:
                    check("not one dense range" in str(e), "%s: %s" % (layout.name, e))
                    result = "refused: %s" % e
            print("layout %s kernel %s: %s" % (layout.name, kernel, result), flush=True)
            if layout in (KVCacheLayout.LBHNC, KVCacheLayout.LBNHC, KVCacheLayout.BLHNC,
                          KVCacheLayout.BLNHC):
                check(not result.startswith("refused"), "%s was refused" % layout.name)


def _domain():
    return "t-case-%s" % uuid.uuid4().hex[:10]


def case_async_load(model):
    """load_async: the scheduler returns (128, True), vLLM parks the request in
    WAITING_FOR_REMOTE_KVS with nothing scheduled, the workers copy the pages after the step's
    forward (no synchronous load in it) and report the request through get_finished (vLLM's
    KVOutputAggregator counts every rank); the pins hold until then; the next step schedules
    the request from token 128 over the loaded blocks, byte for byte A's."""
    dom = _domain()
    a = Engine(model, dom, fill=4)
    b = Engine(model, dom, load_async=True)
    try:
        a.add("a1", P1)
        so = a.step()[0]
        table_a = so.scheduled_new_reqs[0].block_ids[0]
        req = b.add("b1", P2)
        so = b.sched.schedule()
        check(not so.scheduled_new_reqs and not so.num_scheduled_tokens,
              "scheduled while loading: %r" % so.num_scheduled_tokens)
        check(req.status == RequestStatus.WAITING_FOR_REMOTE_KVS, "status %s" % req.status)
        check(not so.has_sync_kv_loads, "a synchronous load")
        loads = so.kv_connector_metadata.loads
        check(len(loads) == 1 and loads[0].load_async and len(loads[0].block_ids) == 4,
              "loads %r" % loads)
        check(a.worker._kv.evict(100) == 2, "A evicted pinned pages")
        _, kvo, _ = b.finish(so)
        check(kvo.finished_recving == {"b1"}, "finished_recving %r" % kvo.finished_recving)
        check(not kvo.invalid_block_ids, "load errors %r" % kvo.invalid_block_ids)
        check(a.worker._kv.evict(100) == 4, "pins not released after the load")
        so = b.step()[0]
        check(len(so.scheduled_new_reqs) == 1, "not scheduled after the load")
        new = so.scheduled_new_reqs[0]
        check(new.num_computed_tokens == 128 and so.num_scheduled_tokens["b1"] == len(P2) - 128,
              "resumed at %d, %r" % (new.num_computed_tokens, so.num_scheduled_tokens))
        table_b = new.block_ids[0]
        check(table_b[:4] == list(loads[0].block_ids), "blocks %r vs %r"
              % (table_b, loads[0].block_ids))
        for j in range(4):
            for x, y in zip(a.block(table_a[j]), b.block(table_b[j])):
                check(torch.equal(x, y), "block %d differs" % j)
    finally:
        a.close()
        b.close()


def case_async_failure(model):
    """load_async and the owner of the matched pages leaves before the workers copy them: the
    workers name the request in get_finished and its blocks in get_block_ids_with_load_errors
    in the same step (no stale byte copied), and vLLM (policy recompute) schedules it from
    token 0."""
    dom = _domain()
    a = Engine(model, dom, fill=8, timeout_ms=500)
    b = Engine(model, dom, load_async=True, timeout_ms=500)
    try:
        a.add("a1", P1)
        a.step()
        req = b.add("b1", P2)
        so = b.sched.schedule()
        check(req.status == RequestStatus.WAITING_FOR_REMOTE_KVS, "status %s" % req.status)
        table = list(so.kv_connector_metadata.loads[0].block_ids)
        a.worker.shutdown()       # detach: waits 0.5 s for B's pins, then leaves anyway
        _, kvo, _ = b.finish(so)
        check(kvo.finished_recving == {"b1"}, "finished_recving %r" % kvo.finished_recving)
        check(kvo.invalid_block_ids == set(table), "errors %r, blocks %r"
              % (kvo.invalid_block_ids, table))
        zero = [torch.zeros_like(t) for t in b.block(table[0])]
        check(all(torch.equal(x, z) for x, z in zip(b.block(table[0]), zero)),
              "a stale page was copied")
        so = b.step()[0]
        check(len(so.scheduled_new_reqs) == 1 and so.scheduled_new_reqs[0].num_computed_tokens
              == 0 and so.num_scheduled_tokens["b1"] == len(P2),
              "after the failed load: %r %r" % (so.scheduled_new_reqs, so.num_scheduled_tokens))
    finally:
        a.sched.shutdown()
        b.close()


def case_stats(model):
    """The connector's counters through vLLM's stats interface: workers' and the scheduler's
    get_kv_connector_stats, merged by KVOutputAggregator and the Scheduler into
    SchedulerStats.kv_connector_stats, rebuilt and logged by vLLM's KVConnectorLogging."""
    dom = _domain()
    a = Engine(model, dom, fill=5, log_stats=True)
    b = Engine(model, dom, log_stats=True)
    try:
        a.add("a1", P1)
        eco = a.step()[2]
        d = eco[0].scheduler_stats.kv_connector_stats
        check(d and d.get("saved_pages") == 6 and d.get("lookups") == 1
              and d.get("matched_tokens") == 0, "A's stats %r" % d)
        b.add("b1", P2)
        eco = b.step()[2]
        d = eco[0].scheduler_stats.kv_connector_stats
        pb = b.worker._cfg["geometry"].page_bytes
        check(d.get("lookups") == 1 and d.get("matched_tokens") == 128
              and d.get("pinned_pages") == 4 and d.get("loaded_pages") == 4
              and d.get("loaded_bytes") == 4 * pb and d.get("saved_pages") == 1,
              "B's stats %r" % d)
        lines = []
        logging = KVConnectorLogging(b.cfg.kv_transfer_config)
        logging.observe(d)
        logging.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
        check(len(lines) == 1 and "loaded_pages=4" in lines[0] and "matched_tokens=128"
              in lines[0], "vLLM logged %r" % lines)
        eco = b.step()[2]       # a decode step: nothing new, so no connector stats
        st = eco[0].scheduler_stats if eco else None
        check(st is None or not st.kv_connector_stats, "stats of an idle step %r"
              % (st and st.kv_connector_stats))
    finally:
        a.close()
        b.close()


def case_tp2(model):
    """TP=2 (every rank's worker-side connector in this process, vLLM's TP rank set for each).
    Dense: each rank publishes its own heads under its own namespace; the match is the
    minimum over ranks (rank 1 keeps only 3 of the 4 shared blocks: B matches 96 tokens) and
    each B rank loads its own rank's bytes. MLA (MLAAttentionSpec, max_tp_shards=1): rank 0
    alone writes the replicated latent pages, the scheduler matches one namespace, and both
    B ranks read rank 0's pages."""
    dom = _domain()
    a = Engine(model, dom, fill=6, tp=2)
    b = Engine(model, dom, tp=2)
    try:
        req = a.add("a1", P1)
        so = a.step()[0]
        table_a = so.scheduled_new_reqs[0].block_ids[0]
        check([w.stats["saved_pages"] for w in a.workers] == [6, 6],
              "dense saves %r" % [w.stats for w in a.workers])
        w1 = a.workers[1]
        check(w1._kv.evict(100) == 6, "rank 1 evicts its pages")
        keys = w1._ns.keys_from_bytes([bytes(h) for h in req.block_hashes[:3]])
        check(w1._kv.publish(w1._ns, keys, w1._layout, table_a[:3]) == 3, "rank 1 republish")
        b.add("b1", P2)
        so, kvo, _ = b.step()
        check(so.scheduled_new_reqs[0].num_computed_tokens == 96,
              "dense TP=2 match %d" % so.scheduled_new_reqs[0].num_computed_tokens)
        table_b = so.scheduled_new_reqs[0].block_ids[0]
        for r in (0, 1):
            for j in range(3):
                for x, y in zip(a.block(table_a[j], r), b.block(table_b[j], r)):
                    check(torch.equal(x, y), "rank %d block %d differs" % (r, j))
        check(not all(torch.equal(x, y) for x, y in zip(b.block(table_b[0], 0),
                                                        b.block(table_b[0], 1))),
              "both ranks loaded the same bytes")
    finally:
        a.close()
        b.close()
    dom = _domain()
    a = Engine(model, dom, fill=7, tp=2, mla=True)
    b = Engine(model, dom, tp=2, mla=True)
    try:
        check(a.worker._cfg["shards"] == 1, "MLA shards %r" % a.worker._cfg["shards"])
        a.add("a1", P1)
        so = a.step()[0]
        table_a = so.scheduled_new_reqs[0].block_ids[0]
        check([w.stats["saved_pages"] for w in a.workers] == [6, 0],
              "MLA saves %r" % [w.stats["saved_pages"] for w in a.workers])
        b.add("b1", P2)
        so = b.sched.schedule()
        check(so.scheduled_new_reqs[0].num_computed_tokens == 128, "MLA match")
        check(len(so.kv_connector_metadata.loads[0].refs) == 1, "one namespace matched")
        _, kvo, _ = b.finish(so)
        check(not kvo.invalid_block_ids, "load errors %r" % kvo.invalid_block_ids)
        table_b = so.scheduled_new_reqs[0].block_ids[0]
        check([w.stats["loaded_pages"] for w in b.workers] == [4, 4], "MLA loads")
        for r in (0, 1):
            for j in range(4):
                for x, y in zip(a.block(table_a[j], 0), b.block(table_b[j], r)):
                    check(torch.equal(x, y), "MLA rank %d block %d differs" % (r, j))
    finally:
        a.close()
        b.close()


CASES = dict(share=case_share, layerwise=case_layerwise, salt=case_salt_and_no_whole_prompt,
             failure=case_load_failure_recomputes, layouts=case_layouts,
             async_load=case_async_load, async_failure=case_async_failure, stats=case_stats,
             tp2=case_tp2)


def main():
    from vllm.distributed.parallel_state import (ensure_model_parallel_initialized,
                                                 init_distributed_environment)
    s = __import__("socket").socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    model = sys.argv[1]
    from vllm.config import set_current_vllm_config
    with set_current_vllm_config(EngineArgs(model=model, dtype="float32",
                                            skip_tokenizer_init=True).create_engine_config()):
        init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                     distributed_init_method="tcp://127.0.0.1:%d" % port,
                                     backend="gloo")
        ensure_model_parallel_initialized(1, 1)
    for name in sys.argv[2:] or list(CASES):
        CASES[name](model)
        print("CASE %s OK" % name, flush=True)


if __name__ == "__main__":
    main()
