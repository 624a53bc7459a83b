#!/usr/bin/env bash
# Latency of a 1 MiB fetch of 16 random 64 KiB pages from the peer GPU, per kernel variant:
# single operations between events and back to back (8 behind one gate), against the copy
# engine's contiguous 1 MiB copy timed the same ways in the same run. On a GPU host (2 GPUs),
# from the repository root, with the build folder and runtime libraries carried:
#   bench/gpu/fetch_latency.sh BUILD_DIR LIB_DIR
set -u
. "$(dirname "$0")/common.sh"
A="--page-sizes 64K --batches 16,1024"
fetch_variant bulk "$A" SKV_FETCH_KERNEL=bulk
fetch_variant vec "$A" SKV_FETCH_KERNEL=vec
fetch_variant vec_t128_c8 "$A" SKV_FETCH_KERNEL=vec SKV_FETCH_THREADS=128 SKV_FETCH_CTAS=8
fetch_variant ce "$A" SKV_FETCH_KERNEL=ce
