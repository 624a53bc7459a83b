#!/usr/bin/env bash
# Issue 21, which kernel and gate for local fetches: `symkv-bench fetch --quick` on 64 KiB and
# 1 MiB pages, batches of 16 and 1024, by default and with SKV_FETCH_KERNEL=vec,
# SKV_FETCH_GATE_PAGES=0, both, and SKV_FETCH_UNROLL=8, alternated twice, on one GPU shared by
# 2 PEs under MPS. Logs and JSON under $OUT, the rows in $OUT/summary.txt. About 80 seconds. From
# the repository root on the GPU host, the build folder and the runtime libraries carried:
#   bench/gpu/gate_variants.sh BUILD_DIR LIB_DIR
set -u
. "$(dirname "$0")/common.sh"
session_begin
rows='^\[0\] (fetch/|fetch_local/|publish/|fetch_e2e/|fetch_latency/|fetch_latency_e2e/)'
for round in 1 2; do
  for cfg in def "SKV_FETCH_KERNEL=vec" "SKV_FETCH_GATE_PAGES=0" \
    "SKV_FETCH_KERNEL=vec SKV_FETCH_GATE_PAGES=0" "SKV_FETCH_UNROLL=8"; do
    tag=$(echo "$cfg" | tr ' =' '__')
    name=f_${tag}_$round
    log "$name ($cfg)"
    e=""; [ "$cfg" != def ] && e="$cfg"
    # shellcheck disable=SC2086  # the settings are split on purpose
    env $e timeout -k 5 60 "$B/symkv-run" -n 2 --timeout 55 -- "$B/bench/symkv-bench" fetch \
      --quick --page-sizes 64K,1M --batches 16,1024 --no-variants --backend cuda \
      --json-out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
    echo "rc=$?" | tee -a "$S"
    grep -E "$rows" "$OUT/$name.log" | awk '{print $2, $3, $4, $7}' | tee -a "$S"
  done
done
log "done"
