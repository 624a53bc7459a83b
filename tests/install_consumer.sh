#!/usr/bin/env bash
# The installed package, used as a plain C project would: `cmake --install` into a temporary
# prefix, then examples/embed.c (README's example) built against it four ways, CMake's
# find_package(symkv) and pkg-config, each with the shared and the static library, and run on 2
# PEs under the installed symkv-run. Also: the package config asks for no CUDAToolkit and holds
# no empty $<LINK_ONLY:>. CTest runs it (tests/CMakeLists.txt); usage: install_consumer.sh BUILD SRC
set -euo pipefail
build=$(cd "$1" && pwd)
src=$(cd "$2" && pwd)
tmp=$(mktemp -d /tmp/skv-install-XXXXXX)
trap 'rm -rf "$tmp"' EXIT
prefix=$tmp/prefix
fail() { echo "install_consumer: FAIL: $*" >&2; exit 1; }

cmake --install "$build" --prefix "$prefix" >"$tmp/install.log" || { cat "$tmp/install.log"; fail "cmake --install"; }
pkgdir=$(dirname "$(find "$prefix" -name symkvConfig.cmake)")
[ -d "$pkgdir" ] || fail "no symkvConfig.cmake installed"
if grep -n 'CUDAToolkit\|CUDA::' "$pkgdir"/*.cmake; then fail "the package config needs the CUDA toolkit's package"; fi
if grep -n 'LINK_ONLY:>' "$pkgdir"/*.cmake; then fail "an empty \$<LINK_ONLY:> in the package"; fi
pcdir=$(dirname "$(find "$prefix" -name symkv.pc)")
[ -f "$pcdir/symkv-static.pc" ] || fail "no symkv.pc / symkv-static.pc installed"

mkdir -p "$tmp/consumer"
cp "$src/examples/embed.c" "$tmp/consumer/"
cat >"$tmp/consumer/CMakeLists.txt" <<'CM'
cmake_minimum_required(VERSION 3.22)
project(consumer LANGUAGES C)
find_package(symkv REQUIRED)
add_executable(cmake_shared embed.c)
target_link_libraries(cmake_shared PRIVATE symkv::symkv)
add_executable(cmake_static embed.c)
target_link_libraries(cmake_static PRIVATE symkv::symkv_static)
CM
cmake -S "$tmp/consumer" -B "$tmp/consumer/build" -DCMAKE_PREFIX_PATH="$prefix" >"$tmp/cmake.log" 2>&1 ||
  { cat "$tmp/cmake.log"; fail "configuring a consumer with find_package(symkv)"; }
cmake --build "$tmp/consumer/build" >"$tmp/build.log" 2>&1 || { cat "$tmp/build.log"; fail "building it"; }

export PKG_CONFIG_PATH=$pcdir
cc=${CC:-cc}
# shellcheck disable=SC2046
$cc -std=c11 -o "$tmp/pc_shared" "$tmp/consumer/embed.c" $(pkg-config --cflags --libs symkv) ||
  fail "cc ... \$(pkg-config --cflags --libs symkv)"
# shellcheck disable=SC2046
$cc -std=c11 -o "$tmp/pc_static" "$tmp/consumer/embed.c" $(pkg-config --cflags --libs symkv-static) ||
  fail "cc ... \$(pkg-config --cflags --libs symkv-static)"

libdir=$(dirname "$(find "$prefix" -name 'libsymkv.so.0' | head -1)")
for exe in "$tmp/consumer/build/cmake_shared" "$tmp/consumer/build/cmake_static" "$tmp/pc_shared" "$tmp/pc_static"; do
  name=$(basename "$exe")
  case $name in
    *static) if LD_LIBRARY_PATH= ldd "$exe" | grep -q libsymkv; then fail "$name links libsymkv.so"; fi ;;
  esac
  out=$(LD_LIBRARY_PATH="$libdir" "$prefix/bin/symkv-run" -n 2 --quiet -- "$exe" 2>&1) || { echo "$out"; fail "$name on 2 PEs"; }
  echo "$out" | grep -q "rank 1: 12 of 12 pages of the prompt came from the node's cache" || { echo "$out"; fail "$name's output"; }
  echo "install_consumer: $name: ok"
done
echo "install_consumer: PASS (find_package and pkg-config, shared and static)"
