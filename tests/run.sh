#!/usr/bin/env bash
# Builds symkv and runs every test: the Criterion suites (multi-PE tests fork PEs through the
# real bootstrap; GPU tests skip with a reason where no GPU is present) and the Python tests.
# Usage: tests/run.sh [--sanitize address,undefined|thread] [--build DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
san=""; build=""
while [ $# -gt 0 ]; do
  case "$1" in
    --sanitize) san="$2"; shift 2 ;;
    --build) build="$2"; shift 2 ;;
    *) echo "usage: tests/run.sh [--sanitize address,undefined|thread] [--build DIR]" >&2; exit 2 ;;
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
status=0
(cd "$build" && ctest --output-on-failure --timeout 1800) 2>&1 | tee "$build/ctest.log" || status=1
echo
echo "== Criterion summaries ($build) =="
grep -E "^\[====\] Synthesis|Tested:|skipped" "$build/ctest.log" | sed 's/\x1b\[[0-9;]*m//g' || true
grep -E "tests passed|tests failed" "$build/ctest.log" || true
skips=$(grep -h "\[SKIP\]" "$build"/Testing/Temporary/LastTest*.log 2>/dev/null | sed 's/\x1b\[[0-9;]*m//g' |
  sed -E 's/^\[SKIP\] ([^:]+)::[^:]+: /\1: /' | sort | uniq -c || true)
if [ -n "$skips" ]; then echo "== Skipped tests (count, suite: reason) =="; echo "$skips"; fi
if [ -z "$san" ] && [ -d bindings/python/tests ]; then
  echo "== Python tests =="
  SKV_LIBRARY="$PWD/$build/libsymkv.so" SKV_RUN="$PWD/$build/symkv-run" \
    python3 -m pytest -q -rs bindings/python/tests || status=1
fi
exit $status
