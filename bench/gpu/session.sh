#!/usr/bin/env bash
# One GPU-host session: GPU test suites and GPU benchmarks, one log per step under $OUT, and a
# summary ($OUT/summary.txt). Run from the repository root on the GPU host with the build folder
# and the runtime libraries carried (../shared/gpu-host-libs.sh):
#   bench/gpu/session.sh BUILD_DIR LIB_DIR STEP...
# Steps: tests (every test_gpu_* suite), test_gpu_NAME (one suite), allreduce, torch, fetch,
# fetch-quick, trace (SKV_TRACE_PES, default 4), pytest (the Python tests; pytest importable, e.g. PYTHONPATH=.gpupy).
# A step gets its own time limit; a step that fails does not stop the others. Result files are
# named after the host kind: SKV_HOST_KIND, else from the GPUs (nvidia-h200, nvidia-h200-x2, ...).
# NVLink multicast stays off everywhere (it can take a shared host's GPUs down).
set -u
. "$(dirname "$0")/common.sh"; shift 2
nccl=$(python3 -c "import nvidia.nccl as m; print(m.__path__[0])" 2>/dev/null)/lib
export LD_LIBRARY_PATH="$PWD/$L:$nccl:${LD_LIBRARY_PATH#"$PWD/$L:"}"
export SKV_TEST_BIN_DIR="$PWD/$B"
ngpu=$(nvidia-smi -L | wc -l)
model=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o -i -E 'h100|h200' |
  tr '[:upper:]' '[:lower:]')
model=${model:-h200}
def_kind=nvidia-$model-x$ngpu # the lent kinds' names: nvidia-h200 (one H200), nvidia-h100-x1, ...
if [ "$model" = h200 ] && [ "$ngpu" = 1 ]; then def_kind=nvidia-h200; fi
kind=${SKV_HOST_KIND:-$def_kind}
T=${SKV_TRACE:-bench/data/mooncake_synthetic_trace.jsonl}; npes_trace=${SKV_TRACE_PES:-4}
# These name the session's choices, not library settings: the library would warn about them.
unset SKV_HOST_KIND SKV_TRACE SKV_TRACE_PES
{ date -u; hostname; nvidia-smi -L; nvidia-smi topo -m
  nvidia-smi --query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv; } \
  > "$OUT/host.txt" 2>&1
log() { echo "== $* ($(date -u +%T))" | tee -a "$OUT/summary.txt"; }
run() { # name timeout cmd...
  local name=$1 t=$2; shift 2
  log "$name: $*"
  local t0=$SECONDS
  timeout -k 5 "$t" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  grep -E "Synthesis|FAIL|PE check|Assertion|error|Error" "$OUT/$name.log" | head -20 |
    tee -a "$OUT/summary.txt"
  echo "rc=$rc in $((SECONDS - t0)) s" | tee -a "$OUT/summary.txt"
}
R="$B/symkv-run"; SB="$B/bench/symkv-bench"
for step in "$@"; do
  case $step in
  tests) for t in "$B"/tests/test_gpu_*; do run "$(basename "$t")" "${STEP_TIMEOUT:-300}" "$t" -j1; done ;;
  test_gpu_*) run "$step" "${STEP_TIMEOUT:-300}" "$B/tests/$step" -j1 ;;
  allreduce)
    run allreduce2 240 "$R" -n 2 --timeout 230 -- "$SB" allreduce --json-out "$OUT/allreduce_$kind.json" ;;
  torch)
    run torch2 180 python3 -m torch.distributed.run --nproc-per-node 2 bench/torch_symm_mem.py \
      --json-out "$OUT/torch_symm_mem_$kind.json" ;;
  fetch) run fetch 400 "$R" -n 2 --timeout 390 -- "$SB" fetch --json-out "$OUT/fetch_$kind.json" ;;
  fetch-quick) run fetch_quick 200 "$R" -n 2 --timeout 190 -- "$SB" fetch --quick --json-out "$OUT/fetch_quick.json" ;;
  trace) # the trace on SKV_TRACE_PES (4) PEs over the GPUs: unbounded, a quarter of the pages, llama-3-8b
    n=$npes_trace
    run trace 200 "$R" -n "$n" --timeout 190 -- "$SB" trace "$T" --backend cuda \
      --json-out "$OUT/trace_$kind.json"
    run trace_quarter 200 "$R" -n "$n" --timeout 190 -- "$SB" trace "$T" --backend cuda \
      --capacity-fraction 0.25 --json-out "$OUT/trace_quarter_$kind.json"
    run trace_llama 240 "$R" -n "$n" --timeout 230 -- "$SB" trace "$T" --backend cuda \
      --model llama-3-8b --requests 400 --json-out "$OUT/trace_llama-3-8b_$kind.json" ;;
  pytest) # the Python bindings' tests against the CUDA build (pytest from PYTHONPATH, e.g. .gpupy)
    SKV_LIBRARY="$PWD/$B/libsymkv.so" SKV_RUN="$PWD/$R" PYTHONPATH="${PYTHONPATH:-}:$PWD/bindings/python" \
      run pytest 300 python3 -m pytest -q -rs -p no:cacheprovider bindings/python/tests ;;
  *) echo "unknown step $step" | tee -a "$OUT/summary.txt" ;;
  esac
done
log "done"
