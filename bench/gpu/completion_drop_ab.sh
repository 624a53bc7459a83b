#!/usr/bin/env bash
# Issue 21, staging after the completion thread: SKV_COMPLETION_DROP=0 and =1 in the order
# 0 1 1 0 (`symkv-bench fetch --quick` of 64 KiB pages, batches of 16 and 1024, 20 repetitions:
# the e2e rows and their breakdown, stage_args among them) on one GPU shared by 2 PEs under MPS,
# after symkv-drop-probe (the same question on the host's CPUs alone); then test_gpu_kv and
# test_gpu_domain with SKV_COMPLETION_DROP=1. Logs and JSON under $OUT, the rows in
# $OUT/summary.txt. A few minutes; the steps' limits add up to 11, the suites last (a call cut
# at 10 minutes keeps the A/B rows). From the repository root on
# the GPU host, the build folder (or a folder holding symkv-run, bench/symkv-bench,
# bench/symkv-drop-probe and tests/test_gpu_*) and the runtime libraries carried:
#   bench/gpu/completion_drop_ab.sh BUILD_DIR LIB_DIR
# A carry of that size, made here:
#   cmake -S . -B build-gpu -DSKV_CUDA=ON -DSKV_CLUSTER=OFF && cmake --build build-gpu -j
#   mkdir -p .gpubin/new/bench .gpubin/new/tests && cp build-gpu/symkv-run .gpubin/new/ &&
#     cp build-gpu/bench/symkv-bench build-gpu/bench/symkv-drop-probe .gpubin/new/bench/ &&
#     cp build-gpu/tests/test_gpu_* .gpubin/new/tests/
#   ../shared/gpu-host-libs.sh .gpulibs && cp -a /usr/lib/x86_64-linux-gnu/libjansson.so.4* .gpulibs/
set -u
. "$(dirname "$0")/common.sh"
session_begin
lscpu | grep -E "Model name|^CPU\(s\)|Thread|NUMA node|L2|L3" | tee -a "$S"
log "symkv-drop-probe 8"
timeout -k 5 60 "$B/bench/symkv-drop-probe" 8 > "$OUT/drop_probe.log" 2>&1
echo "rc=$?" | tee -a "$S"
grep -E "^symkv-drop-probe|^median" "$OUT/drop_probe.log" | tee -a "$S"
rows='^\[0\] (fetch_local/|publish/|fetch_e2e/|publish_e2e/|fetch_latency_e2e/|breakdown/(fetch|publish)_e2e/64KiB/x1024/(call|check|pin|claim|alloc|stage_args|launch|finish|complete|gpu_wait|completion_wait)|breakdown/fetch_latency_e2e/64KiB/x16/(call|stage_args|launch))'
n=0
for drop in 0 1 1 0; do
  n=$((n + 1))
  name=drop${drop}_$n
  log "$name"
  SKV_COMPLETION_DROP=$drop timeout -k 5 80 "$B/symkv-run" -n 2 --timeout 75 -- \
    "$B/bench/symkv-bench" fetch --quick --page-sizes 64K --batches 16,1024 --reps 20 \
    --no-variants --backend cuda --json-out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  echo "rc=$?" | tee -a "$S"
  grep -E "$rows" "$OUT/$name.log" | awk '{print $2, $3, $4, $7}' | tee -a "$S"
done
SKV_COMPLETION_DROP=1 gpu_suites test_gpu_kv test_gpu_domain
log "done"
