#!/usr/bin/env bash
# Issue 21, a fetch behind work pending on its stream: test_gpu_kv and test_gpu_domain of
# BUILD, then `symkv-bench fetch --quick --page-sizes 64K --batches 16,1024` (its
# fetch_e2e_behind_Tus rows: the fetch right behind a kernel of 5, 20 and 100 us) of each build
# folder given, in turn, twice, on one GPU shared by 2 PEs under MPS. Logs and JSON under $OUT,
# the rows in $OUT/summary.txt. About 1 minute. From the repository root on the GPU host:
#   bench/gpu/gate_behind.sh BUILD_DIR LIB_DIR [OTHER_BUILD_DIR...]
set -u
. "$(dirname "$0")/common.sh"
shift 2
session_begin
gpu_suites test_gpu_kv test_gpu_domain
rows='^\[0\] (fetch_local/64KiB/x1024|fetch/64KiB/x1024|fetch_e2e/|fetch_e2e_behind|fetch_latency_e2e/)'
for round in 1 2; do
  for b in "$B" "$@"; do
    name="q_$(basename "$b")_$round"
    log "$name"
    timeout -k 5 90 "$b/symkv-run" -n 2 --timeout 85 -- "$b/bench/symkv-bench" fetch --quick \
      --page-sizes 64K --batches 16,1024 --no-variants --backend cuda --json-out "$OUT/$name.json" \
      > "$OUT/$name.log" 2>&1
    echo "rc=$?" | tee -a "$S"
    grep -E "$rows" "$OUT/$name.log" | awk '{print $2, $3, $4, $6, $7}' | tee -a "$S"
  done
done
log "done"
