#!/usr/bin/env bash
# Installs what building kvgc needs from Debian's packages, if anything is missing.
# The CUDA toolkit (nvcc) is optional: without it kvgc builds the CPU backend only.
set -euo pipefail
# gnuplot-nox: the PNG plots of bench/quality (kvgc-bench-quality). nlohmann-json3-dev:
# the config.json reader of kvgc-plan (tools/json.cpp).
pkgs=(meson ninja-build pkg-config g++ clang libclang-rt-14-dev doctest-dev libboost-dev libgoogle-perftools-dev cmake gnuplot-nox nlohmann-json3-dev)
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
