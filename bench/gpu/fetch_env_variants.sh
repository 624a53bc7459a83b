#!/usr/bin/env bash
# Fetch kernel variants chosen through the environment (SKV_FETCH_KERNEL / _THREADS / _CTAS /
# _UNROLL), each a whole symkv-bench fetch run of 64 KiB and 1 MiB pages, batches 1-1024, against
# the copy engine in the same run; one JSON per variant under $OUT. On a GPU host, from the
# repository root, with the build folder and runtime libraries carried:
#   bench/gpu/fetch_env_variants.sh BUILD_DIR LIB_DIR
set -u
. "$(dirname "$0")/common.sh"
A="--page-sizes 64K,1M --batches 1,16,64,1024"
fetch_variant bulk_c4 "$A" SKV_FETCH_KERNEL=bulk
fetch_variant vec_t128_c8 "$A" SKV_FETCH_KERNEL=vec SKV_FETCH_THREADS=128 SKV_FETCH_CTAS=8
fetch_variant vec_t128_c16 "$A" SKV_FETCH_KERNEL=vec SKV_FETCH_THREADS=128 SKV_FETCH_CTAS=16
fetch_variant vec_u8_t128_c8 "$A" SKV_FETCH_KERNEL=vec SKV_FETCH_THREADS=128 SKV_FETCH_CTAS=8 SKV_FETCH_UNROLL=8
fetch_variant vec_t512_c4 "$A" SKV_FETCH_KERNEL=vec SKV_FETCH_THREADS=512 SKV_FETCH_CTAS=4
