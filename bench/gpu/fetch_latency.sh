#!/usr/bin/env bash
# Latency of a 1 MiB fetch of 16 random 64 KiB pages from the peer GPU, per kernel variant:
# single operations between events and back to back (8 behind one gate), against the copy
# engine's contiguous 1 MiB copy timed the same ways in the same run; then the fetch kernel's
# own duration under Nsight Compute where it can read it. On a GPU host (2 GPUs), from the
# repository root, with the build folder and runtime libraries carried:
#   bench/gpu/fetch_latency.sh BUILD_DIR LIB_DIR
set -u
B=${1:?build dir}; L=${2:?lib dir}
OUT=${OUT:-/tmp/skv-out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export LD_LIBRARY_PATH="$PWD/$L:${LD_LIBRARY_PATH:-}"
one() { # name env...
  local name=$1; shift
  echo "== $name $*"
  env "$@" timeout 150 "$B/symkv-run" -n 2 --timeout 140 -- "$B/bench/symkv-bench" fetch \
    --page-sizes 64K --batches 16,1024 --no-variants --json-out "$OUT/$name.json" \
    > "$OUT/$name.log" 2>&1
  echo "rc=$?"
  grep -E '^\[0\] (fetch|fetch_latency|gpu_floor)[/_]' "$OUT/$name.log"
}
one bulk SKV_FETCH_KERNEL=bulk
one vec SKV_FETCH_KERNEL=vec
one vec_t128_c8 SKV_FETCH_KERNEL=vec SKV_FETCH_THREADS=128 SKV_FETCH_CTAS=8
one ce SKV_FETCH_KERNEL=ce
if command -v ncu > /dev/null; then
  echo "== ncu: fetch kernel durations, 16 x 64 KiB"
  timeout 240 ncu --clock-control none --target-processes all -k regex:skv_k_fetch \
    --metrics gpu__time_duration.sum --csv \
    "$B/symkv-run" -n 2 --timeout 220 -- "$B/bench/symkv-bench" fetch --page-sizes 64K \
    --batches 16 --no-variants --reps 10 > "$OUT/ncu.csv" 2> "$OUT/ncu.err"
  echo "rc=$?"
  grep gpu__time_duration "$OUT/ncu.csv" | tail -30
  tail -5 "$OUT/ncu.err"
fi
