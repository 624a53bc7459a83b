#!/usr/bin/env bash
# Builds symkv and runs the main job: symkv-bench trace, a replay of the Mooncake trace under
# symkv-run on 4 PEs in real time at 17x speed (about a minute), comparing the policies none,
# per_pe and shared (docs/workloads.md). Host backend; --backend cuda where nvidia-smi lists GPUs
# and the build has CUDA. Extra arguments go to the benchmark (symkv-bench trace --help lists
# them) and replace the defaults below; relative paths in them (--plot, --json-out) are taken
# from the directory you run this in. SKV_BENCH_PES sets the number of PEs, SKV_TRACE the trace.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)   # the caller's directory stays the working directory

# Defaults, each left out when the arguments give that option.
has() {
  local want=$1 a
  shift
  for a in "$@"; do [ "$a" = "$want" ] || [ "${a%%=*}" = "$want" ] && return 0; done
  return 1
}
if has --help "$@" || has -h "$@"; then
  sed -n '2,7p' "$0" | sed 's/^# \{0,1\}//'
  echo
  echo "usage: bench/run.sh [symkv-bench trace options]; its defaults: --model tiny --realtime --speed 17"
  echo "The benchmark's own help follows."
  echo
  if [ -x "$repo/build/bench/symkv-bench" ]; then
    exec "$repo/build/bench/symkv-bench" trace --help
  fi
  echo "(build/bench/symkv-bench is not built yet: bench/run.sh builds it)"
  exit 0
fi
# matplotlib only where the plot needs it, into the project's .venv (tests/deps.sh)
python=none
has --plot "$@" && python=plot
"$repo/tests/deps.sh" --python $python
cmake -S "$repo" -B "$repo/build" -DSKV_CUDA=AUTO >/dev/null
cmake --build "$repo/build" -j"$(nproc)" --target symkv-run symkv-bench
[ "$python" = plot ] && export PATH="$repo/.venv/bin:$PATH"   # the python3 symkv-bench --plot runs

# The trace: $SKV_TRACE, else the copy next to this repository (../shared/data), else the one
# committed in bench/data (Mooncake's synthetic trace, Apache-2.0; bench/data/README.md).
trace=${SKV_TRACE:-}
if [ -z "$trace" ]; then
  for t in "$repo/../shared/data/mooncake_synthetic_trace.jsonl" "$repo/bench/data/mooncake_synthetic_trace.jsonl"; do
    if [ -r "$t" ]; then trace=$t; break; fi
  done
fi
if [ -z "$trace" ] || [ ! -r "$trace" ]; then
  echo "bench/run.sh: no readable trace (${trace:-none found}); set SKV_TRACE=FILE" >&2
  exit 1
fi

defaults=()
has --model "$@" || defaults+=(--model tiny)
has --ordered "$@" || has --realtime "$@" || defaults+=(--realtime)
has --ordered "$@" || has --speed "$@" || defaults+=(--speed 17)
if ! has --backend "$@"; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
    if grep -q '^CMAKE_CUDA_COMPILER:[A-Z]*=.*nvcc' "$repo/build/CMakeCache.txt"; then
      defaults+=(--backend cuda)
    else
      echo "bench/run.sh: GPUs present but this build has no CUDA (no nvcc found): host backend" >&2
    fi
  fi
fi
# rank 0 prints the report: its lines unprefixed, the other ranks' with "[rank] "
exec "$repo/build/symkv-run" -n "${SKV_BENCH_PES:-4}" --prefix others -- \
  "$repo/build/bench/symkv-bench" trace "$trace" "$@" ${defaults[@]+"${defaults[@]}"}
