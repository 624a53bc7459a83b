"""One vLLM engine (CPU) driven over stdin/stdout, for test_vllm.py and bench/vllm_prefix.py:

    python vllm_engine.py make-model OUT [hidden=256 layers=2 heads=4 kv_heads=2]
    python vllm_engine.py make-mla-model OUT [hidden=256 layers=2 heads=4]  (DeepSeek-V2, MLA)
    python vllm_engine.py serve MODEL --domain NAME|none [--block-size 32] [--tp 1]
                                      [--prefix-caching] [--cache-gb 0.25] [--load-async]

`serve` reads one JSON command per line and answers one line "@@ {json}" (vLLM's own log lines
go to stderr). Commands: {"op": "generate", "prompt": [ids], "max_tokens": 8, "cache_salt": s}
-> tokens, num_cached_tokens, seconds; {"op": "generate_many", "prompts": [[ids], ...],
"max_tokens": 8} -> the same as lists, one batch, its seconds; {"op": "loads"} / {"op": "saves"}
-> each worker's last loads / saves with the sha256 of every block's bytes (all layers);
{"op": "poison", "value": v} -> each worker evicts its pages and publishes pages of constant v
under every key it saved; {"op": "stats"}; {"op": "hooks"} -> the connector calls vLLM made in
each worker, in order; {"op": "quit"}."""

import hashlib
import json
import os
import sys
import time


def make_model(out, hidden=256, layers=2, heads=4, kv_heads=2, vocab=1024):
    """A random-weight Llama with a word-level tokenizer ("w4 w5 ..."), no hub access."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, max_position_embeddings=4096, bos_token_id=1,
                      eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out)
    _save_tokenizer(out, vocab)


def _save_tokenizer(out, vocab):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    words = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    words.update({"w%d" % i: i for i in range(4, vocab)})
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>", pad_token="<pad>").save_pretrained(out)


def make_mla_model(out, hidden=256, layers=2, heads=4, vocab=1024):
    """A random-weight DeepSeek-V2 (MLA attention, dense MLPs: no experts) with the same
    word-level tokenizer, no hub access. kv_lora_rank 512 + rope 64: the 576-wide latent that
    vLLM's CPU MLA kernel takes (its kernel blocks are 16 tokens: 32-token blocks split)."""
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM
    torch.manual_seed(0)
    cfg = DeepseekV2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden,
                           num_hidden_layers=layers, num_attention_heads=heads,
                           num_key_value_heads=heads, kv_lora_rank=512, q_lora_rank=None,
                           qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
                           n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                           moe_intermediate_size=hidden, first_k_dense_replace=layers,
                           max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
                           pad_token_id=0, tie_word_embeddings=False)
    DeepseekV2ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out)
    _save_tokenizer(out, vocab)


# ---- functions run in every worker (collective_rpc; cloudpickled by value from __main__) -----

def _conn():
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    return get_kv_transfer_group()


def _block_digest(c, b):
    h = hashlib.sha256()
    for t in c._kv_caches.values():
        r = c._ratio
        h.update(t[b * r:(b + 1) * r].contiguous().cpu().numpy().tobytes())
    return h.hexdigest()


def _worker_loads(worker):
    c = _conn()
    return dict(rank=c._rank, loads=[dict(req=r, blocks=list(map(int, b)), loaded=n,
                                          digests=[_block_digest(c, x) for x in b[:n]])
                                     for r, b, n in c.load_log])


def _worker_saves(worker):
    c = _conn()
    return dict(rank=c._rank, saves=[dict(req=r, blocks=list(map(int, b)), inserted=n,
                                          hashes=[h.hex() for h in hs],
                                          digests=[_block_digest(c, x) for x in b])
                                     for r, b, hs, n in c.save_log])


def _worker_poison(worker, value):
    import torch
    from symkv.vllm import _layout_over
    c = _conn()
    hashes = []
    for _r, _b, hs, _n in c.save_log:
        hashes.extend(h for h in hs if h not in hashes)
    evicted = c._kv.evict(c._cfg["pages_per_pe"])
    t0 = next(iter(c._kv_caches.values()))
    n = len(hashes) * c._ratio
    fake = [torch.full((n,) + tuple(t0.shape[1:]), value, dtype=t0.dtype)
            for _ in c._kv_caches]
    lay, _ = _layout_over(c._cfg["geometry"], c._cfg["spec"], fake)
    try:
        keys = c._ns.keys_from_bytes(hashes)
        ins = c._kv.publish(c._ns, keys, lay, list(range(n)))
    finally:
        lay.close()
    return dict(rank=c._rank, evicted=evicted, published=ins)


def _worker_loaded_values(worker):
    """Per load, per loaded block: up to 4 of its distinct values (one for poison)."""
    import torch
    c = _conn()
    out = []
    for r, b, n in c.load_log:
        blocks = []
        for x in b[:n]:
            vals = set()
            for t in c._kv_caches.values():
                vals.update(torch.unique(t[x * c._ratio:(x + 1) * c._ratio].float())[:4].tolist())
            blocks.append(sorted(vals)[:4])
        out.append(dict(req=r, values=blocks))
    return dict(rank=c._rank, loads=out)


def _worker_stats(worker):
    c = _conn()
    return dict(rank=c._rank, **c.stats)


def _worker_hooks(worker):
    """The connector calls vLLM made in this worker, oldest first: [name, layer number]."""
    c = _conn()
    return dict(rank=c._rank, hooks=[list(h) for h in c.hook_log])


def serve(argv):
    import argparse
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--domain", required=True)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--prefix-caching", action="store_true")
    ap.add_argument("--cache-gb", type=float, default=0.25)
    ap.add_argument("--load-async", action="store_true")
    ap.add_argument("--layerwise", action="store_true")
    ap.add_argument("--max-model-len", type=int, default=4096)
    a = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc(callable)
    if a.tp == 1:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    else:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(
            str(i % (os.cpu_count() or 1)) for i in range(a.tp)))
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    kw = {}
    if a.domain != "none":
        kw["kv_transfer_config"] = {
            "kv_connector": "SymkvConnector", "kv_connector_module_path": "symkv.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"domain": a.domain, "cache_gb": a.cache_gb}}
        if a.load_async:
            kw["kv_transfer_config"]["kv_connector_extra_config"]["load_async"] = True
        if a.layerwise:
            kw["kv_transfer_config"]["kv_connector_extra_config"]["layerwise"] = True
    t0 = time.perf_counter()
    llm = LLM(model=a.model, dtype="float32", max_model_len=a.max_model_len,
              max_num_batched_tokens=a.max_model_len, block_size=a.block_size,
              tensor_parallel_size=a.tp, enable_prefix_caching=a.prefix_caching,
              skip_tokenizer_init=True, enforce_eager=True, seed=0, **kw)
    out = sys.stdout
    sys.stdout = sys.stderr  # vLLM's prints stay off the answer channel

    def answer(obj):
        out.write("@@ " + json.dumps(obj) + "\n")
        out.flush()

    answer(dict(ready=True, start_seconds=time.perf_counter() - t0))
    rpc = dict(loads=_worker_loads, saves=_worker_saves, stats=_worker_stats,
               loaded_values=_worker_loaded_values, hooks=_worker_hooks)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.get("op")
        try:
            if op == "generate":
                sp = SamplingParams(temperature=0.0, max_tokens=cmd.get("max_tokens", 8),
                                    detokenize=False, ignore_eos=True)
                p = TokensPrompt(prompt_token_ids=cmd["prompt"])
                if cmd.get("cache_salt"):
                    p["cache_salt"] = cmd["cache_salt"]
                t = time.perf_counter()
                o = llm.generate([p], sp, use_tqdm=False)[0]
                answer(dict(tokens=list(o.outputs[0].token_ids),
                            num_cached_tokens=o.num_cached_tokens,
                            seconds=time.perf_counter() - t))
            elif op == "generate_many":  # one batch: request throughput
                sp = SamplingParams(temperature=0.0, max_tokens=cmd.get("max_tokens", 8),
                                    detokenize=False, ignore_eos=True)
                ps = [TokensPrompt(prompt_token_ids=x) for x in cmd["prompts"]]
                t = time.perf_counter()
                outs = llm.generate(ps, sp, use_tqdm=False)
                answer(dict(tokens=[list(o.outputs[0].token_ids) for o in outs],
                            num_cached_tokens=[o.num_cached_tokens for o in outs],
                            seconds=time.perf_counter() - t))
            elif op in rpc:
                answer(dict(workers=llm.collective_rpc(rpc[op], timeout=60)))
            elif op == "poison":
                answer(dict(workers=llm.collective_rpc(_worker_poison, timeout=60,
                                                       args=(float(cmd["value"]),))))
            elif op == "quit":
                answer(dict(bye=True))
                break
            else:
                answer(dict(error="unknown op %r" % op))
        except Exception as e:  # noqa: BLE001  (the test reads the error)
            answer(dict(error="%s: %s" % (type(e).__name__, e)))
    del llm


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "make-mla-model":
        make_mla_model(sys.argv[2], **{k: int(v) for k, v in (x.split("=") for x in sys.argv[3:])})
    elif len(sys.argv) > 2 and sys.argv[1] == "make-model":
        make_model(sys.argv[2], **{k: int(v) for k, v in (x.split("=") for x in sys.argv[3:])})
    elif len(sys.argv) > 2 and sys.argv[1] == "serve":
        serve(sys.argv[2:])
    else:
        sys.exit(__doc__)
