#!/usr/bin/env bash
# Issue 21, staging after the completion thread: SKV_COMPLETION_DROP=0 and =1 alternated twice
# (`symkv-bench fetch --quick` of 64 KiB pages, batches of 16 and 1024, 20 repetitions: the e2e
# rows and their breakdown, stage_args among them), on one GPU shared by 2 PEs under MPS; before
# them symkv-drop-probe (the same question on the host's CPUs alone) and test_gpu_kv and
# test_gpu_domain with SKV_COMPLETION_DROP=1. Logs and JSON under $OUT, the rows in
# $OUT/summary.txt. About 5 minutes. From the repository root on the GPU host, the build folder
# (or a folder holding symkv-run, bench/symkv-bench, bench/symkv-drop-probe and
# tests/test_gpu_*) and the runtime libraries carried:
#   bench/gpu/completion_drop_ab.sh BUILD_DIR LIB_DIR
set -u
. "$(dirname "$0")/common.sh"
session_begin
lscpu | grep -E "Model name|^CPU\(s\)|NUMA node|L2|L3" | tee -a "$S"
log "symkv-drop-probe 8"
timeout -k 5 60 "$B/bench/symkv-drop-probe" 8 > "$OUT/drop_probe.log" 2>&1
echo "rc=$?" | tee -a "$S"
tail -1 "$OUT/drop_probe.log" | tee -a "$S"
SKV_COMPLETION_DROP=1 gpu_suites test_gpu_kv test_gpu_domain
rows='^\[0\] (fetch_local/|publish/|fetch_e2e/|publish_e2e/|fetch_latency_e2e/|breakdown/(fetch|publish)_e2e/64KiB/x1024/(call|check|pin|claim|alloc|stage_args|launch|finish|complete|gpu_wait|completion_wait)|breakdown/fetch_latency_e2e/64KiB/x16/(call|stage_args|launch))'
for round in 1 2; do
  for drop in 0 1; do
    name=drop${drop}_$round
    log "$name"
    SKV_COMPLETION_DROP=$drop timeout -k 5 80 "$B/symkv-run" -n 2 --timeout 75 -- \
      "$B/bench/symkv-bench" fetch --quick --page-sizes 64K --batches 16,1024 --reps 20 \
      --no-variants --backend cuda --json-out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
    echo "rc=$?" | tee -a "$S"
    grep -E "$rows" "$OUT/$name.log" | awk '{print $2, $3, $4, $7}' | tee -a "$S"
  done
done
log "done"
