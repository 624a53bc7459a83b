#!/usr/bin/env bash
# Builds symkv and runs the main job: symkv-bench trace, a replay of the Mooncake trace under
# symkv-run on 4 PEs in real time at 17x speed (about a minute), comparing the policies none,
# per_pe and shared (docs/workloads.md). Host backend; --backend cuda where nvidia-smi lists GPUs
# and the build has CUDA. Extra arguments go to the bench and replace the defaults below.
set -euo pipefail
cd "$(dirname "$0")/.."
SKV_WITH_PYTHON_DEPS=0 tests/deps.sh
cmake -S . -B build -DSKV_CUDA=AUTO >/dev/null
cmake --build build -j"$(nproc)" --target symkv-run symkv-bench

# The trace: $SKV_TRACE, else the copy next to this repository (../shared/data), else the one
# committed in bench/data (Mooncake's synthetic trace, Apache-2.0; bench/data/README.md).
trace=${SKV_TRACE:-}
if [ -z "$trace" ]; then
  for t in ../shared/data/mooncake_synthetic_trace.jsonl bench/data/mooncake_synthetic_trace.jsonl; do
    if [ -r "$t" ]; then trace=$t; break; fi
  done
fi
if [ -z "$trace" ] || [ ! -r "$trace" ]; then
  echo "bench/run.sh: no readable trace (${trace:-none found}); set SKV_TRACE=FILE" >&2
  exit 1
fi

# Defaults, each left out when the arguments give that option.
has() {
  local want=$1 a
  shift
  for a in "$@"; do [ "$a" = "$want" ] || [ "${a%%=*}" = "$want" ] && return 0; done
  return 1
}
defaults=()
has --model "$@" || defaults+=(--model tiny)
has --ordered "$@" || has --realtime "$@" || defaults+=(--realtime)
has --ordered "$@" || has --speed "$@" || defaults+=(--speed 17)
if ! has --backend "$@"; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
    if grep -q '^CMAKE_CUDA_COMPILER:[A-Z]*=.*nvcc' build/CMakeCache.txt; then
      defaults+=(--backend cuda)
    else
      echo "bench/run.sh: GPUs present but this build has no CUDA (no nvcc found): host backend" >&2
    fi
  fi
fi
exec build/symkv-run -n "${SKV_BENCH_PES:-4}" -- build/bench/symkv-bench trace "$trace" "$@" ${defaults[@]+"${defaults[@]}"}
