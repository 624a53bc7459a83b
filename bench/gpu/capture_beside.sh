#!/usr/bin/env bash
# A fetch beside an engine's graph capture: test_gpu_kv's a_fetch_beside_an_engines_graph_capture
# test (another thread captures a graph in the global mode while this one fetches 320 pages and
# the completion thread completes the copy), by default and with SKV_FETCH_GATE_PAGES=0 (no look
# at the fetch's stream: the completion thread's queries alone), twice each, for each build
# folder given (e.g. one without the relaxed queries, then one with). Logs under $OUT, the
# results in $OUT/summary.txt. A few seconds. From the repository root on the GPU host:
#   bench/gpu/capture_beside.sh BUILD_DIR LIB_DIR [OTHER_BUILD_DIR...]
set -u
. "$(dirname "$0")/common.sh"
shift 2
session_begin
for b in "$B" "$@"; do
  for g in 256 0; do
    for i in 1 2; do
      name="$(basename "$b")_${g}_$i"
      log "capture test, $b, SKV_FETCH_GATE_PAGES=$g, $i"
      SKV_FETCH_GATE_PAGES=$g SKV_TEST_BIN_DIR="$PWD/$B" timeout -k 5 100 "$b/tests/test_gpu_kv" \
        -j1 --filter 'gpu_kv/a_fetch_beside*' > "$OUT/$name.log" 2>&1
      echo "rc=$?" | tee -a "$S"
      grep -E "Synthesis|PE check" "$OUT/$name.log" | head -4 | tee -a "$S"
    done
  done
done
log "done"
