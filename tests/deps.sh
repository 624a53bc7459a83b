#!/usr/bin/env bash
# Installs what symkv needs to build and test on Debian/Ubuntu (only what is missing):
# compilers, CMake, libuv, xxHash, Criterion, jansson; Python packages for the bindings' tests
# and matplotlib for symkv-bench --plot (not for bench/run.sh, which sets SKV_WITH_PYTHON_DEPS=0).
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
fi
