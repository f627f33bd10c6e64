#!/usr/bin/env bash
# Installs what building kvgc needs from Debian's packages, if anything is missing.
# The CUDA toolkit (nvcc) is optional: without it kvgc builds the CPU backend only.
set -euo pipefail
# gnuplot-nox: the PNG plots of bench/quality (kvgc-bench-quality). nlohmann-json3-dev:
# the config.json reader of kvgc-plan (tools/json.cpp). valgrind: the memcheck test
# (tests/valgrind.sh; skipped without it). doxygen: the C API reference (make docs).
pkgs=(meson ninja-build pkg-config g++ clang python3-dev python3-venv libclang-rt-14-dev doctest-dev libboost-dev libgoogle-perftools-dev cmake gnuplot-nox nlohmann-json3-dev valgrind doxygen)
missing=()
for p in "${pkgs[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "kvgc: installing ${missing[*]}" >&2
  sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
fi
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
  echo "kvgc: note: nvcc is in /usr/local/cuda/bin but not on PATH; the Makefile adds it" >&2
fi
# The Python package's build and its numpy-only tests (make test): nanobind, numpy and
# pytest from PyPI in a venv of kvgc's own, so no system Python is modified. The Makefile
# builds the package for this venv's interpreter (-Dpython_exe).
build_venv="${KVGC_BUILD_VENV:-$HOME/.cache/kvgc/build-venv}"
py_reqs="nanobind==3.1.0 numpy pytest"
if [ ! -f "$build_venv/.installed" ] || [ "$(cat "$build_venv/.installed")" != "$py_reqs" ]; then
  echo "kvgc: creating the build venv $build_venv ($py_reqs)" >&2
  python3 -m venv "$build_venv" >&2 || {
    echo "kvgc: python3 -m venv failed (Debian: apt-get install python3-venv python3-dev)" >&2; exit 1; }
  "$build_venv/bin/python" -m pip install -q --upgrade pip >&2
  # shellcheck disable=SC2086
  "$build_venv/bin/python" -m pip install -q $py_reqs >&2
  echo "$py_reqs" > "$build_venv/.installed"
fi
