#!/usr/bin/env bash
# Builds symkv and runs every test: the Criterion suites (multi-PE tests fork PEs through the
# real bootstrap; GPU tests skip with a reason where no GPU is present) and the Python tests
# (with the project's .venv, tests/deps.sh), then prints each suite's counts and every skip with
# its reason.
# Usage: tests/run.sh [--sanitize address,undefined|thread] [--build DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
usage="usage: tests/run.sh [--sanitize address,undefined|thread] [--build DIR]"
san=""; build=""
while [ $# -gt 0 ]; do
  case "$1" in
    --sanitize) [ $# -ge 2 ] || { echo "$usage" >&2; exit 2; }; san="$2"; shift 2 ;;
    --build) [ $# -ge 2 ] || { echo "$usage" >&2; exit 2; }; build="$2"; shift 2 ;;
    -h|--help) echo "$usage"; sed -n '2,5p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "$usage" >&2; exit 2 ;;
  esac
done
tests/deps.sh
if [ -z "$build" ]; then build=build; [ -n "$san" ] && build="build-san-${san//,/-}"; fi
cuda=AUTO
[ -n "$san" ] && cuda=OFF   # sanitizers cover the host code; CUDA's runtime and ASan do not mix
cmake -S . -B "$build" -DSKV_WERROR=ON -DSKV_CUDA=$cuda -DSKV_SANITIZE="$san" >/dev/null
cmake --build "$build" -j"$(nproc)"
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=0}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
# the project's Python first on PATH: symkv-bench --plot (test_workload) runs python3
[ -x .venv/bin/python3 ] && export PATH="$PWD/.venv/bin:$PATH"
status=0
rm -rf "$build/criterion"   # each suite writes its report there (a crashed one writes none)
mkdir -p "$build/criterion"
(cd "$build" && ctest --output-on-failure --timeout 1800) 2>&1 | tee "$build/ctest.log" || status=1
py_summary=""
if [ -z "$san" ] && [ -d bindings/python/tests ]; then
  echo "== Python tests =="
  # symkv.torch builds its C++ op kernels on the first import (a minute here, then cached):
  # once now, so that no timed test pays for it
  if .venv/bin/python3 -c "import torch" 2>/dev/null; then
    SKV_LIBRARY="$PWD/$build/libsymkv.so" PYTHONPATH=bindings/python .venv/bin/python3 -c \
      "import symkv.torch as t; print('symkv.torch op kernels:', 'Python' if t._py_kernels == ('CPU', 'CUDA') else 'C++')" ||
      status=1
  fi
  SKV_LIBRARY="$PWD/$build/libsymkv.so" SKV_RUN="$PWD/$build/symkv-run" \
    .venv/bin/python3 -m pytest -q -rs --durations=15 bindings/python/tests 2>&1 | tee "$build/pytest.log" ||
    status=1
  py_summary=$(grep -E "^=*.*[0-9]+ (passed|failed|error)" "$build/pytest.log" | tail -1 | tr -d '=' |
    sed 's/^ *//; s/ *$//')
fi
# the cluster suite again against UCX 1.22 with CUDA, from the libucx-cu12 wheel (tests/deps.sh):
# its new protocols (ep_based fences; no software atomics under error handling) and, with a GPU,
# GPU pages exported and read straight into GPU memory
wheel_line=""
ucx_root=$(.venv/bin/python3 -c "import libucx, os; print(os.path.dirname(libucx.__file__))" \
  2>/dev/null || true)
if [ -z "$san" ] && [ -f "$ucx_root/include/ucp/api/ucp.h" ]; then
  echo "== test_cluster against the libucx-cu12 wheel's UCX ($ucx_root) =="
  wcuda=OFF   # the kernels take long to build: with CUDA only where a GPU is
  nvidia-smi -L >/dev/null 2>&1 && wcuda=$cuda
  wb="$build-ucx-wheel"
  if cmake -S . -B "$wb" -DSKV_WERROR=ON -DSKV_CUDA=$wcuda -DSKV_CLUSTER=ON \
       -DSKV_UCX_ROOT="$ucx_root" >/dev/null && cmake --build "$wb" -j"$(nproc)" --target test_cluster
  then
    # as UCX configures itself (symkv picks the ep_based fence), then with the strong fence, which
    # sends the state words after the bytes landed, over a second endpoint
    "$wb/tests/test_cluster" -j1 2>&1 | tee "$wb/test_cluster.log" || status=1
    UCX_FENCE_MODE=strong "$wb/tests/test_cluster" -j1 2>&1 | tee "$wb/test_cluster_strong.log" ||
      status=1
    for f in test_cluster test_cluster_strong; do
      wheel_line="$wheel_line${wheel_line:+; }$f: $(grep -E "Synthesis" "$wb/$f.log" | tail -1 |
        sed 's/.*Synthesis: //')"
    done
  else
    status=1
    wheel_line="the build against it failed"
  fi
fi
echo
python3 tests/summarize.py "$build" "${san:-}" "$py_summary" || status=1
[ -n "$wheel_line" ] && echo "test_cluster with UCX $(cat "$ucx_root/UCX_WHEEL_VERSION.txt" \
  2>/dev/null || echo '?') (libucx-cu12): $wheel_line"
exit $status
