#!/usr/bin/env bash
# Issue 20 on a GPU host: symkv.torch and symkv.triton with 2 PEs (processes) on one GPU under the
# MPS daemon (or one PE per GPU where there are 2): the GPU tests, then bench/torch_symkv.py.
# Run from the repository root with the build folder (CUDA build) and the runtime libraries
# carried, like session.sh:
#   bench/gpu/torch_triton.sh BUILD_DIR LIB_DIR
# Python: the host's python3 with torch (and the triton that comes with it) — nothing is
# installed there (no registry is reachable). pytest is used when importable (PYTHONPATH=.gpupy,
# as session.sh's pytest step); without it the same test scripts run directly under torchrun.
# Logs and JSON go to $OUT (summary.txt first). SKV_NO_MPS=1 leaves MPS alone.
set -u
. "$(dirname "$0")/common.sh"; shift 2
nccl=$(python3 -c "import nvidia.nccl as m; print(m.__path__[0])" 2>/dev/null)/lib
export LD_LIBRARY_PATH="$PWD/$L:$nccl:${LD_LIBRARY_PATH#"$PWD/$L:"}"
export SKV_LIBRARY="$PWD/$B/libsymkv.so" SKV_RUN="$PWD/$B/symkv-run"
export PYTHONPATH="$PWD/bindings/python:${PYTHONPATH:-}"
export PYTHONUNBUFFERED=1 SKV_TIMEOUT_MS=${SKV_TIMEOUT_MS:-60000}
# Triton and Inductor compile into caches under $HOME by default: keep them in /tmp
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/skv-triton-cache}
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/skv-inductor-cache}
ngpu=$(nvidia-smi -L | wc -l)
# CUDA_VISIBLE_DEVICES=0 on a host of several GPUs: the PEs share that one (MPS as on one-GPU hosts)
[ -z "${CUDA_VISIBLE_DEVICES:-}" ] || ngpu=$(echo "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | grep -c .)
model=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o -i -E 'h100|h200' |
  tr '[:upper:]' '[:lower:]')
kind=${SKV_HOST_KIND:-nvidia-${model:-h200}-x$ngpu}
S="$OUT/summary.txt"
log() { echo "== $* ($(date -u +%T))" | tee -a "$S"; }
run() { # name timeout cmd...
  local name=$1 t=$2; shift 2
  log "$name: $*"
  local t0=$SECONDS
  timeout -k 10 "$t" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  grep -E "^OK|ok|passed|failed|Error|error|Traceback|assert|skipped|target" "$OUT/$name.log" |
    grep -v "^\[rank" | head -30 | tee -a "$S"
  echo "rc=$rc in $((SECONDS - t0)) s" | tee -a "$S"
}
{ date -u; hostname; nvidia-smi -L
  python3 -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"
  python3 -c "import triton; print('triton', triton.__version__)" || echo "triton: not importable"
  python3 -c "import pytest; print('pytest', pytest.__version__)" || echo "pytest: not importable"
} > "$OUT/host.txt" 2>&1
tee -a "$S" < "$OUT/host.txt"
python3 -c "import torch" 2>/dev/null || { log "python3 has no torch: nothing to run"; exit 1; }

mps_started=0
if [ "${SKV_NO_MPS:-0}" != 1 ] && [ "$ngpu" -lt 2 ]; then
  export CUDA_MPS_PIPE_DIRECTORY=${CUDA_MPS_PIPE_DIRECTORY:-/tmp/skv-mps}
  export CUDA_MPS_LOG_DIRECTORY=${CUDA_MPS_LOG_DIRECTORY:-/tmp/skv-mps-log}
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  PATH=$PATH:/usr/local/nvidia/bin
  if echo get_server_list | nvidia-cuda-mps-control > /dev/null 2>&1; then
    log "MPS: a control daemon is already running (left as it is)"
  elif nvidia-cuda-mps-control -d; then
    mps_started=1; log "MPS: control daemon started"
  else
    log "MPS: could not start the control daemon (PEs on one GPU then take turns: slow)"
  fi
fi
trun() { python3 -m torch.distributed.run --nproc-per-node 2 --master-port "$1" "${@:2}"; }

# 1. the GPU tests: torch ops on CUDA (fp32/fp16/bf16, 1 element .. 64 MiB, against NCCL or,
#    on one GPU, gloo and the exact order; compile with Inductor; CUDA graphs; empty; the vLLM
#    shape) and the Triton functions and all-reduce; each passes when every rank prints OK
run pe_torch_cuda 540 trun 29611 bindings/python/tests/pe/pe_torch.py cuda
run pe_triton 300 trun 29621 bindings/python/tests/pe/pe_triton.py
if python3 -c "import pytest" 2>/dev/null; then
  run pytest_torch_triton 900 python3 -m pytest -q -rs -p no:cacheprovider \
    bindings/python/tests/test_torch.py bindings/python/tests/test_triton.py \
    bindings/python/tests/test_examples.py -k "torch or triton"
fi
# 2. the bench: overhead on the host backend (one process), then the CUDA rows on 2 PEs
run bench_overhead_cpu 240 python3 bench/torch_symkv.py --device cpu \
  --json-out "$OUT/torch_symkv_cpu_$kind.json"
run bench_torch_symkv 540 trun 29631 bench/torch_symkv.py --sizes "${SKV_SIZES:-4K,64K,1M,4M}" \
  --json-out "$OUT/torch_symkv_$kind.json"
# torch's symm_mem one-shot beside the op, last and short: where the PEs share a GPU its kernels
# spin without a timeout, and may starve each other for good (then this step's time limit ends it)
run bench_symm_mem 150 trun 29641 bench/torch_symkv.py --sizes 4K,64K --symm-mem on --reps 5 \
  --json-out "$OUT/torch_symkv_symm_mem_$kind.json"
grep -hE "^(name|symkv|torch|triton)/?" "$OUT/bench_overhead_cpu.log" "$OUT/bench_torch_symkv.log" \
  "$OUT/bench_symm_mem.log" >> "$S" 2>/dev/null

if [ "$mps_started" = 1 ]; then echo quit | nvidia-cuda-mps-control; log "MPS: stopped"; fi
log "done"
