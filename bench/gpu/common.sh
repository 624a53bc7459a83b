# shellcheck shell=bash
# Sourced by the bench/gpu scripts, with the build folder and the runtime-library folder (both
# relative to the repository root, carried to the GPU host) as $1 and $2: sets B, L and OUT,
# keeps NVLink multicast off everywhere (it can take a shared host's GPUs down) and puts the
# carried libraries on the loader's path.
B=${1:?build dir}; L=${2:?lib dir}
OUT=${OUT:-/tmp/skv-out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export LD_LIBRARY_PATH="$PWD/$L:${LD_LIBRARY_PATH:-}"

# mps_start: start the MPS daemon, so that the kernels of PEs sharing a GPU run side by side
# instead of in time slices (docs/comm.md), and stop it when the script exits; says which
# through the script's `log`.
mps_start() {
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  mps=/usr/local/nvidia/bin/nvidia-cuda-mps-control
  [ -x "$mps" ] || mps=$(command -v nvidia-cuda-mps-control || true)
  if [ -n "$mps" ] && "$mps" -d; then
    log "MPS daemon started ($mps)"
    trap 'echo quit | "$mps" 2>/dev/null; sleep 1' EXIT
  else
    log "MPS daemon NOT started (no nvidia-cuda-mps-control): PEs time-slice the GPU"
  fi
}

# session_begin: GPU 0 unless CUDA_VISIBLE_DEVICES says otherwise; S, the rows' summary
# ($OUT/summary.txt), and `log` (a line "== MSG (time, +seconds)" to stdout and S); the host in
# $OUT/host.txt; then mps_start.
session_begin() {
  export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
  S="$OUT/summary.txt"
  log() { echo "== $* ($(date -u +%T), +${SECONDS}s)" | tee -a "$S"; }
  { date -u; hostname; nvidia-smi -L; } > "$OUT/host.txt" 2>&1
  mps_start
}

# gpu_suites TEST...: each test binary of $B/tests that was built, -j1 (its log $OUT/TEST.log),
# its exit status and result lines in S (after session_begin).
gpu_suites() {
  local t
  for t in "$@"; do
    if [ ! -x "$B/tests/$t" ]; then
      log "$t ($B): not built, skipped"
      continue
    fi
    log "$t ($B)"
    SKV_TEST_BIN_DIR="$PWD/$B" timeout -k 5 150 "$B/tests/$t" -j1 > "$OUT/$t.log" 2>&1
    echo "rc=$?" | tee -a "$S"
    grep -E "Synthesis|FAIL|PE check" "$OUT/$t.log" | head -20 | tee -a "$S"
  done
}

# fetch_variant NAME "FETCH ARGS" ENV...: one `symkv-bench fetch` on 2 PEs with ENV set, its
# log and JSON under $OUT as NAME.*, the rows on stdout.
fetch_variant() {
  local name=$1 args=$2; shift 2
  echo "== $name $*"
  # shellcheck disable=SC2086  # the bench arguments are split on purpose
  env "$@" timeout 150 "$B/symkv-run" -n 2 --timeout 140 -- "$B/bench/symkv-bench" fetch \
    $args --no-variants --json-out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  echo "rc=$?"
  grep -E '^\[0\] (fetch|fetch_local|fetch_latency|gpu_floor)[/_]' "$OUT/$name.log"
}
