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
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig,  # noqa: E402
                                        KVCacheGroupSpec, KVCacheTensor, compute_layout_strides,
                                        create_kv_cache_views,
                                        group_kernel_blocks)
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


class Engine:
    """vLLM's Scheduler with the connector, plus a worker-side connector over KV views."""

    def __init__(self, model, domain, layout=KVCacheLayout.LBHNC, kernel=None, fill=None,
                 timeout_ms=30000):
        ktc = KVTransferConfig(kv_connector="SymkvConnector", kv_role="kv_both",
                               kv_connector_module_path="symkv.vllm",
                               kv_load_failure_policy="recompute",
                               kv_connector_extra_config={"domain": domain, "cache_gb": 0.05,
                                                          "timeout_ms": timeout_ms})
        self.cfg = EngineArgs(model=model, dtype="float32", block_size=BS, max_model_len=1024,
                              enforce_eager=True, skip_tokenizer_init=True,
                              enable_prefix_caching=False,
                              kv_transfer_config=ktc).create_engine_config()
        names = ["model.layers.%d.self_attn.attn" % i for i in range(LAYERS)]
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
        g = torch.Generator().manual_seed(fill if fill is not None else 0)
        raw = torch.empty(tensor.size, dtype=torch.int8)
        if fill is None:
            raw.zero_()
        else:
            raw.copy_(torch.randint(-100, 100, (tensor.size,), generator=g, dtype=torch.int8))
        self.raw = raw
        self.views = dict(zip(names, create_kv_cache_views(raw, spec, NB, layout, tensor,
                                                           kernel_block_size=kernel)))
        self.worker = SymkvConnector(self.cfg, KVConnectorRole.WORKER, self.kvcfg)
        self.worker.register_kv_caches(self.views)
        self.cfg.cache_config.num_gpu_blocks = NB   # what the engine core sets after profiling
        self.sched = Scheduler(self.cfg, self.kvcfg, StructuredOutputManager(self.cfg),
                               block_size=BS)

    def block(self, b):
        """Block b of every layer (manager block: kernel blocks grouped)."""
        # As integers: random bytes make NaNs, which never compare equal as floats.
        return [group_kernel_blocks(v, NB)[b].contiguous().view(torch.int32)
                for v in self.views.values()]

    def step(self, sampled=7):
        """One engine step: schedule (scheduler hooks), the worker hooks in the model runner's
        order, then the runner's output back into the scheduler."""
        so = self.sched.schedule()
        w = self.worker
        w.bind_connector_metadata(so.kv_connector_metadata)
        if so.has_sync_kv_loads:
            w.start_load_kv(None)
        # (the forward would run here)
        if not so.has_sync_kv_loads:
            w.start_load_kv(None)
        w.wait_for_save()
        kvo = KVConnectorOutput(invalid_block_ids=w.get_block_ids_with_load_errors(),
                                kv_connector_worker_meta=w.build_connector_worker_meta())
        w.clear_connector_metadata()
        ids = list(so.num_scheduled_tokens)
        out = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                sampled_token_ids=[[sampled] for _ in ids],
                                kv_connector_output=kvo)
        self.sched.update_from_output(so, out)
        return so, kvo

    def add(self, rid, prompt, salt=None):
        req = Request(rid, prompt, SamplingParams(max_tokens=3, ignore_eos=True), None,
                      cache_salt=salt, block_hasher=HASHER)
        self.sched.add_request(req)
        return req

    def close(self):
        self.sched.shutdown()
        self.worker.shutdown()


P1 = list(range(4, 204))
P2 = P1[:150] + list(range(600, 640))


def case_share(model, layout=KVCacheLayout.LBHNC, kernel=None):
    """A saves P1 after its prefill; B (another scheduler and worker) gets P2: exactly the 4
    shared blocks are reported, loaded byte for byte into B's blocks, pinned until B's
    workers report the load, then unpinned."""
    dom = "t-case-%s" % uuid.uuid4().hex[:10]
    a = Engine(model, dom, layout, kernel, fill=1)
    try:
        b = Engine(model, dom, layout, kernel)
    except BaseException:
        a.close()
        raise
    try:
        r1 = a.add("a1", P1)
        so, _ = a.step()
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
        so, _ = b.step()
        check(so.scheduled_new_reqs[0].num_computed_tokens == 0, "salted request matched")
        b.add("b2", P1[:192])
        so, _ = b.step()
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
        so, _ = b.step()          # recomputes from token 0
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
                case_share(model, layout, kernel)
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


CASES = dict(share=case_share, salt=case_salt_and_no_whole_prompt,
             failure=case_load_failure_recomputes, layouts=case_layouts)


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
