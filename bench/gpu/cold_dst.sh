#!/usr/bin/env bash
# Is the local copy engine baseline helped by its fixed destination staying in the L2? Runs
# `symkv-bench fetch --quick --no-variants --backend cuda` three times on 2 PEs sharing one GPU
# under MPS and keeps the rows that compare fetch_local and publish (GPU time) and their e2e rows
# with the copy engine into the same fixed destination (the baseline of issue 21's targets) and
# into a destination drawn afresh each repetition (ce_local_cold, *_vs_cold). Logs and JSON under
# $OUT, the rows in $OUT/summary.txt. About 10 s a run. From the repository root on the GPU host:
#   bench/gpu/cold_dst.sh BUILD_DIR LIB_DIR
# The question it asks: the baseline copies into one fixed destination, which at 16 MiB stays in
# the 50 MiB L2 from one repetition to the next (the source moves), while fetch_local and publish
# write cold engine blocks; that would explain why the 1 MiB x16 cells stay at 0.69-0.77 whatever
# the kernel's shape while 1 MiB x1024 reaches 0.94-0.95. Its answer, on one H100 (2026-12-07,
# bench/results/cold_dst_nvidia-h100-x1.txt): yes, at 16 MiB only (cold 0.81x fixed; fetch_local
# 0.92x and publish 0.87x the cold copy).
set -u
. "$(dirname "$0")/common.sh"
session_begin
for r in 1 2 3; do
  log "quick $r"
  timeout -k 5 90 "$B/symkv-run" -n 2 --timeout 85 -- "$B/bench/symkv-bench" fetch --quick --no-variants --backend cuda --json-out "$OUT/cold_$r.json" > "$OUT/cold_$r.log" 2>&1
  echo "rc=$?" | tee -a "$S"
  grep -E '^\[0\] (fetch|fetch_local|publish|ce_local_cold|fetch_e2e|publish_e2e|fetch_latency_e2e)[/_]' "$OUT/cold_$r.log" | grep -v mapped | awk '{print $2, $3, $4, $6, $7}' | tee -a "$S"
done
log "done"
