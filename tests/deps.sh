#!/usr/bin/env bash
# Installs what symkv needs to build and test on Debian/Ubuntu (only what is missing):
# compilers, CMake, libuv, xxHash, Criterion, jansson; Python packages for the bindings' tests
# (torch too, best effort) and matplotlib for symkv-bench --plot (not for bench/run.sh, which
# sets SKV_WITH_PYTHON_DEPS=0).
set -euo pipefail
pkgs="build-essential cmake pkg-config libuv1-dev libxxhash-dev libcriterion-dev libjansson-dev python3 python3-pip"
missing=""
for p in $pkgs; do dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"; done
if [ -n "$missing" ]; then
  echo "installing Debian packages:$missing"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get install -y $missing >/dev/null 2>&1 || { $SUDO apt-get update >/dev/null && $SUDO apt-get install -y $missing >/dev/null; }
fi
if [ "${SKV_WITH_PYTHON_DEPS:-1}" = 1 ]; then
  py=$(command -v python3)
  need=""
  for m in pytest numpy xxhash; do "$py" -c "import $m" 2>/dev/null || need="$need $m"; done
  # matplotlib: symkv-bench --plot (test_workload); Debian's package for the system python3
  if ! "$py" -c "import matplotlib" 2>/dev/null; then
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
    if [ "$py" = /usr/bin/python3 ] && command -v apt-get >/dev/null; then
      echo "installing Debian packages: python3-matplotlib"
      $SUDO apt-get install -y python3-matplotlib >/dev/null 2>&1 ||
        { $SUDO apt-get update >/dev/null && $SUDO apt-get install -y python3-matplotlib >/dev/null; } ||
        need="$need matplotlib"
    else
      need="$need matplotlib"
    fi
  fi
  if [ -n "$need" ]; then
    echo "installing Python packages:$need"
    "$py" -m pip install -q $need 2>/dev/null || "$py" -m pip install -q --break-system-packages $need
  fi
  # torch: the bindings' torch tests (CPU tensors; CUDA ones skip without a GPU). PyPI's wheel
  # with its CUDA libraries takes about 5 GB: best effort, and its tests skip, saying why, when
  # it cannot be had (SKV_WITH_TORCH=0 skips it on purpose).
  if [ "${SKV_WITH_TORCH:-1}" = 1 ] && ! "$py" -c "import torch" 2>/dev/null; then
    site=$("$py" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    while [ ! -d "$site" ] && [ "$site" != / ]; do site=$(dirname "$site"); done
    free_gb=$(df -Pk "$site" | awk 'NR == 2 { print int($4 / 1048576) }')
    if [ "${free_gb:-0}" -ge 12 ]; then
      echo "installing Python packages: torch (about 5 GB; SKV_WITH_TORCH=0 to skip)"
      "$py" -m pip install -q torch 2>/dev/null || "$py" -m pip install -q --break-system-packages torch ||
        echo "tests/deps.sh: torch could not be installed: the torch tests skip" >&2
    else
      echo "tests/deps.sh: ${free_gb:-?} GB free, torch needs about 5: not installed, the torch tests skip" >&2
    fi
  fi
fi
