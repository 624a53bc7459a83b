#!/usr/bin/env bash
# Issue 21, fetches gated only on an idle stream: test_gpu_kv and test_gpu_domain of BUILD, then
# `symkv-bench fetch --quick` of BASE and BUILD alternated twice, then the trace replay (cuda
# backend) of each, on one GPU shared by 2 PEs under MPS. Logs and JSON under $OUT, the rows in
# $OUT/summary.txt. About 1 minute. From the repository root on the GPU host, both build folders
# (or folders holding symkv-run, bench/symkv-bench and tests/test_gpu_*) and the runtime
# libraries carried:
#   bench/gpu/gate_busy_ab.sh BUILD_DIR LIB_DIR BASE_BUILD_DIR
set -u
. "$(dirname "$0")/common.sh"
A=${3:?base build dir}
session_begin
gpu_suites test_gpu_kv test_gpu_domain
rows='^\[0\] (fetch/64KiB/x1024|fetch_local/|publish/|fetch_e2e/|publish_e2e/|fetch_latency_e2e/)'
for round in 1 2; do
  for which in base new; do
    b=$B; [ "$which" = base ] && b=$A
    name=q_${which}_$round
    log "$name"
    timeout -k 5 60 "$b/symkv-run" -n 2 --timeout 55 -- "$b/bench/symkv-bench" fetch --quick \
      --no-variants --backend cuda --json-out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
    echo "rc=$?" | tee -a "$S"
    grep -E "$rows" "$OUT/$name.log" | awk '{print $2, $3, $4, $7}' | tee -a "$S"
  done
done
for which in base new; do
  b=$B; [ "$which" = base ] && b=$A
  log "trace $which"
  timeout -k 5 150 "$b/symkv-run" -n 2 --timeout 140 -- "$b/bench/symkv-bench" trace \
    bench/data/mooncake_synthetic_trace.jsonl --backend cuda --json-out "$OUT/trace_$which.json" \
    > "$OUT/trace_$which.log" 2>&1
  echo "rc=$?" | tee -a "$S"
  grep -E "^\[0\] .*fetch_gbps" "$OUT/trace_$which.log" | head -6 | tee -a "$S"
done
log "done"
