#!/usr/bin/env bash
# Fetch kernel variants chosen through the environment (SKV_FETCH_KERNEL / _THREADS / _CTAS /
# _UNROLL), each a whole symkv-bench fetch run of 64 KiB and 1 MiB pages, batches 1-1024, against
# the copy engine in the same run; one JSON per variant under $OUT. On a GPU host, from the
# repository root, with the build folder and runtime libraries carried:
#   bench/gpu/fetch_env_variants.sh BUILD_DIR LIB_DIR
set -u
B=${1:?build dir}; L=${2:?lib dir}
OUT=${OUT:-/tmp/skv-out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export LD_LIBRARY_PATH="$PWD/$L:${LD_LIBRARY_PATH:-}"
one() { # name env...
  local name=$1; shift
  echo "== $name $*"
  env "$@" timeout 120 "$B/symkv-run" -n 2 --timeout 110 -- "$B/bench/symkv-bench" fetch \
    --page-sizes 64K,1M --batches 1,16,64,1024 --no-variants --json-out "$OUT/$name.json" \
    > "$OUT/$name.log" 2>&1
  echo "rc=$?"
  grep -E '^\[0\] (fetch|fetch_local|fetch_latency|gpu_floor)[/_]' "$OUT/$name.log"
}
one bulk_c4 SKV_FETCH_KERNEL=bulk
one vec_t128_c8 SKV_FETCH_KERNEL=vec SKV_FETCH_THREADS=128 SKV_FETCH_CTAS=8
one vec_t128_c16 SKV_FETCH_KERNEL=vec SKV_FETCH_THREADS=128 SKV_FETCH_CTAS=16
one vec_u8_t128_c8 SKV_FETCH_KERNEL=vec SKV_FETCH_THREADS=128 SKV_FETCH_CTAS=8 SKV_FETCH_UNROLL=8
one vec_t512_c4 SKV_FETCH_KERNEL=vec SKV_FETCH_THREADS=512 SKV_FETCH_CTAS=4
