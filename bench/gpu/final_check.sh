#!/usr/bin/env bash
# A build's whole check on the GPU host: the GPU suites (test_gpu_kv, _domain, _heap, _comm), the
# capture test with SKV_FETCH_GATE_PAGES=256 and 0, every `symkv-bench fetch --quick` row twice,
# and the trace replay (cuda backend), on one GPU shared by 2 PEs under MPS. Logs and JSON under
# $OUT, the rows in $OUT/summary.txt. About 2 minutes. From the repository root on the GPU host:
#   bench/gpu/final_check.sh BUILD_DIR LIB_DIR
set -u
. "$(dirname "$0")/common.sh"
session_begin
gpu_suites test_gpu_kv test_gpu_domain test_gpu_heap test_gpu_comm
for g in 256 0; do
  log "capture test, SKV_FETCH_GATE_PAGES=$g"
  SKV_FETCH_GATE_PAGES=$g SKV_TEST_BIN_DIR="$PWD/$B" timeout -k 5 100 "$B/tests/test_gpu_kv" -j1 --filter 'gpu_kv/a_fetch_beside*' > "$OUT/cap_$g.log" 2>&1
  echo "rc=$?" | tee -a "$S"; grep -E "Synthesis|PE check" "$OUT/cap_$g.log" | head -4 | tee -a "$S"
done
for r in 1 2; do
  log "quick $r"
  timeout -k 5 90 "$B/symkv-run" -n 2 --timeout 85 -- "$B/bench/symkv-bench" fetch --quick --no-variants --backend cuda --json-out "$OUT/q_$r.json" > "$OUT/q_$r.log" 2>&1
  echo "rc=$?" | tee -a "$S"
  grep -E '^\[0\] (fetch_local|publish|fetch_e2e|publish_e2e|fetch_latency_e2e)[/_]' "$OUT/q_$r.log" | awk '{print $2, $3, $4, $6, $7}' | tee -a "$S"
done
log "trace"
timeout -k 5 150 "$B/symkv-run" -n 2 --timeout 140 -- "$B/bench/symkv-bench" trace bench/data/mooncake_synthetic_trace.jsonl --backend cuda --json-out "$OUT/trace.json" > "$OUT/trace.log" 2>&1
echo "rc=$?" | tee -a "$S"; grep -E "fetch_gbps" "$OUT/trace.log" | tee -a "$S"
log "done"
