#!/usr/bin/env bash
# Issue 21, host cost per page: the e2e rows of `symkv-bench fetch --quick` and their
# breakdown/ROW/PHASE rows (lookup, alloc, finish, pin, release...) for two builds, alternating
# BASE, BUILD, BASE, BUILD on one GPU shared by 2 PEs under MPS (as e2e.sh), then test_gpu_kv and
# test_gpu_domain of BUILD. Logs and JSON under $OUT, the rows side by side in $OUT/summary.txt.
# About 6 minutes. From the repository root on the GPU host, both build folders and the runtime
# libraries carried:
#   bench/gpu/e2e_ab.sh BUILD_DIR LIB_DIR BASE_BUILD_DIR
set -u
. "$(dirname "$0")/common.sh"
A=${3:?base build dir}
nccl=$(python3 -c "import nvidia.nccl as m; print(m.__path__[0])" 2>/dev/null)/lib
export LD_LIBRARY_PATH="$PWD/$L:$nccl:${LD_LIBRARY_PATH#"$PWD/$L:"}"
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
S="$OUT/summary.txt"
log() { echo "== $* ($(date -u +%T))" | tee -a "$S"; }
{ date -u; hostname; nvidia-smi -L; git log --oneline -1 2>/dev/null; } > "$OUT/host.txt" 2>&1

mps_start

rows='^\[0\] (fetch_e2e|publish_e2e|fetch_latency_e2e|breakdown/(fetch|publish)_e2e(_host)?/64KiB/x1024/)'
for round in 1 2; do
  for which in base new; do
    b=$B; [ "$which" = base ] && b=$A
    name=fetch_${which}_$round
    log "$name: $b"
    timeout -k 5 130 "$b/symkv-run" -n 2 --timeout 125 -- "$b/bench/symkv-bench" fetch --quick \
      --no-variants --json-out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
    echo "rc=$?" | tee -a "$S"
    grep -E "$rows" "$OUT/$name.log" | awk '{print $2, $3, $4, $7}' | tee -a "$S"
  done
done
for t in test_gpu_kv test_gpu_domain; do
  log "$t ($B)"
  SKV_TEST_BIN_DIR="$PWD/$B" timeout -k 5 150 "$B/tests/$t" -j1 > "$OUT/$t.log" 2>&1
  echo "rc=$?" | tee -a "$S"
  grep -E "Synthesis|FAIL" "$OUT/$t.log" | head -20 | tee -a "$S"
done
log "done"
