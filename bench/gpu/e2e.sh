#!/usr/bin/env bash
# Issue 21 on one GPU: what an engine pays end to end. Two PEs share GPU 0 under the MPS daemon
# (started here, stopped at the end): `symkv-bench fetch --quick` (the e2e rows, their
# breakdown/ROW/PHASE rows, the host backend's e2e rows, fetch_local and publish against the
# local copy engine), the GPU KV tests and the trace replay with the cuda backend, at most
# 130 + 70 + 35 s. Logs and JSON
# under $OUT, the rows that matter in $OUT/summary.txt. Under 4 minutes. From the repository
# root on the GPU host, with the build folder and the runtime libraries carried:
#   bench/gpu/e2e.sh BUILD_DIR LIB_DIR
set -u
. "$(dirname "$0")/common.sh"
nccl=$(python3 -c "import nvidia.nccl as m; print(m.__path__[0])" 2>/dev/null)/lib
export LD_LIBRARY_PATH="$PWD/$L:$nccl:${LD_LIBRARY_PATH#"$PWD/$L:"}"
export SKV_TEST_BIN_DIR="$PWD/$B" CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
S="$OUT/summary.txt"
log() { echo "== $* ($(date -u +%T))" | tee -a "$S"; }
{ date -u; hostname; nvidia-smi -L; git log --oneline -1 2>/dev/null; } > "$OUT/host.txt" 2>&1

mps_start

run() { # name timeout cmd...
  local name=$1 t=$2; shift 2
  log "$name: $*"
  local t0=$SECONDS
  timeout -k 5 "$t" "$@" > "$OUT/$name.log" 2>&1
  echo "rc=$? in $((SECONDS - t0)) s" | tee -a "$S"
}
R="$B/symkv-run"; SB="$B/bench/symkv-bench"

run fetch 130 "$R" -n 2 --timeout 125 -- "$SB" fetch --quick --no-variants \
  --json-out "$OUT/fetch_e2e_1gpu_mps.json"
grep -E '^\[0\] (fetch_e2e|publish_e2e|publish_one_launch|fetch_latency|gpu_floor/|fetch_local/|publish/|fetch/|breakdown/)' \
  "$OUT/fetch.log" | tee -a "$S"

run test_gpu_kv 70 "$B/tests/test_gpu_kv" -j1
grep -E "Synthesis|FAIL" "$OUT/test_gpu_kv.log" | head -20 | tee -a "$S"

run trace 35 "$R" -n 2 --timeout 30 -- "$SB" trace bench/data/mooncake_synthetic_trace.jsonl \
  --backend cuda --json-out "$OUT/trace_cuda_1gpu_mps.json"
grep -E 'fetch_gbps|Error|error' "$OUT/trace.log" | head -5 | tee -a "$S"
log "done"
