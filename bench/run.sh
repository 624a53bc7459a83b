#!/usr/bin/env bash
# Builds symkv and runs the main job: symkv-bench under symkv-run on 4 PEs (host backend; on
# a machine with GPUs, GPU commands are used where they exist). Extra arguments go to the bench.
set -euo pipefail
cd "$(dirname "$0")/.."
SKV_WITH_PYTHON_DEPS=0 tests/deps.sh
cmake -S . -B build -DSKV_CUDA=AUTO >/dev/null
cmake --build build -j"$(nproc)" --target symkv-run symkv-bench
exec build/symkv-run -n "${SKV_BENCH_PES:-4}" -- build/bench/symkv-bench heap "$@"
