#!/usr/bin/env bash
# Host emulation of kvgc's CUDA executor: runs the CUDA-vs-CPU tests (tests/cuda_main.cpp,
# test_cuda.cpp, test_cuda_gc.cpp) without a GPU. The CUDA kernels (append/read, the GC's
# observe, select, compaction, int4 demotion and dequantising read) are rewritten into
# host code (transform.py), a block's threads run as fibers that switch at
# __syncthreads (shim/cuda_runtime.h), CUB's sort is a stable host sort, and attention
# goes through the CPU executor (its CUDA kernel uses warp shuffles; not emulated).
#
# What it checks: the kernels' logic against the CPU specification, on every commit.
# What it cannot: races between blocks or threads, warp-level semantics, the real CUB,
# CUDA's math library, launch limits, speed. Those need a GPU (bench/gpu-check.sh).
#
# usage: tests/cuda_emu/run.sh [BUILD_DIR]   (default build-emu; doctest headers needed)
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
here="$root/tests/cuda_emu"
out=${1:-$root/build-emu}
mkdir -p "$out" && out=$(cd "$out" && pwd)  # absolute: the build runs from $out/src
rm -rf "$out/src" "$out/obj" && mkdir -p "$out/src" "$out/obj"
cp -r "$root/allocator" "$root/gc" "$root/kernels" "$root/runtime" "$root/c_api" "$root/tests" "$out/src/"
cd "$out/src"
for f in copy gc gc_select gc_decide; do
  python3 "$here/transform.py" "kernels/cuda/$f.cu" "kernels/cuda/$f.emu.cpp"
done
cxx=(${CXX:-g++} -std=c++20 -O1 -g -I "$here/shim" -I c_api -I . -DKVGC_ASSERT_LEVEL=2
     -fno-strict-aliasing -w)
srcs=(allocator/host_memory.cpp allocator/page_pool.cpp gc/layer_budget.cpp gc/plan.cpp
      gc/compaction.cpp kernels/cpu/copy.cpp kernels/cpu/gc.cpp kernels/cpu/quant.cpp
      kernels/cpu/attend.cpp kernels/cpu/attend_avx2.cpp kernels/cpu/attend_avx512.cpp
      runtime/options.cpp runtime/model.cpp runtime/heap.cpp runtime/check.cpp
      runtime/collect.cpp runtime/harvest.cpp runtime/staging_ring.cpp runtime/cpu_backend.cpp c_api/kvgc.cpp
      kernels/cuda/copy.emu.cpp kernels/cuda/gc.emu.cpp kernels/cuda/gc_select.emu.cpp
      kernels/cuda/gc_decide.emu.cpp tests/cuda_main.cpp tests/test_cuda.cpp
      tests/test_cuda_gc.cpp tests/util.cpp "$here/emu_backend.cpp")
objs=()
jobs=$(nproc)
for s in "${srcs[@]}"; do
  o="$out/obj/$(basename "${s%.*}").o"
  objs+=("$o")
  "${cxx[@]}" -c "$s" -o "$o" &
  while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n; done
done
fail=0
for pid in $(jobs -rp); do wait "$pid" || fail=1; done
wait || fail=1
[ $fail = 0 ] || { echo "cuda-emu: build failed"; exit 1; }
"${cxx[@]}" "${objs[@]}" -o "$out/kvgc-cuda-emu-tests" -lpthread
echo "cuda-emu: running the CUDA-vs-CPU tests on the host emulation"
"$out/kvgc-cuda-emu-tests"
