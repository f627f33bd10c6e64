#!/usr/bin/env bash
# Installs kvgc into a temporary prefix and builds a C consumer against it through
# pkg-config and through CMake's find_package(kvgc); both must run.
set -euo pipefail
build=$1 src=$2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
prefix=$(meson introspect "$build" --buildoptions | python3 -c \
  'import json,sys; print(next(o["value"] for o in json.load(sys.stdin) if o["name"]=="prefix"))')
libdir=$(meson introspect "$build" --buildoptions | python3 -c \
  'import json,sys; print(next(o["value"] for o in json.load(sys.stdin) if o["name"]=="libdir"))')
meson install -C "$build" --no-rebuild --destdir "$tmp/root" >/dev/null
root="$tmp/root$prefix"
for f in include/kvgc.h include/kvgc.hpp "$libdir/libkvgc.so" "$libdir/libkvgc.a" \
         "$libdir/pkgconfig/kvgc.pc" "$libdir/cmake/kvgc/kvgcConfig.cmake"; do
  [ -e "$root/$f" ] || { echo "missing after install: $f"; exit 1; }
done
# pkg-config (the .pc holds the real prefix; point it at the staged tree).
export PKG_CONFIG_PATH="$root/$libdir/pkgconfig"
cc -std=c11 "$src/tests/consumer/main.c" -o "$tmp/pc-consumer" \
  $(pkg-config --define-variable=prefix="$root" --cflags --libs kvgc)
LD_LIBRARY_PATH="$root/$libdir" "$tmp/pc-consumer"
# The package's version is the header's.
header_version=$(sed -n 's/^#define KVGC_VERSION_STRING "\(.*\)"$/\1/p' "$root/include/kvgc.h")
pc_version=$(pkg-config --modversion kvgc)
[ "$header_version" = "$pc_version" ] || {
  echo "version mismatch: kvgc.h says $header_version, kvgc.pc $pc_version"; exit 1; }
# CMake package config.
if command -v cmake >/dev/null; then
  cmake -S "$src/tests/consumer" -B "$tmp/cmake" -DCMAKE_PREFIX_PATH="$root" >/dev/null
  cmake --build "$tmp/cmake" >/dev/null
  LD_LIBRARY_PATH="$root/$libdir" "$tmp/cmake/consumer"
else
  echo "cmake not found: CMake package config not exercised"
fi
