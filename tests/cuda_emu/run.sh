#!/usr/bin/env bash
# Host emulation of kvgc's CUDA executor: runs the CUDA-vs-CPU tests (tests/cuda_main.cpp,
# test_cuda.cpp, test_cuda_gc.cpp, test_cuda_scrub.cpp, test_cuda_batch.cpp) without a GPU, every op on the CUDA kernels' code.
#
# How: transform.py rewrites kernels/cuda/*.cu into host C++ (a launch becomes a loop
# over the grid's blocks, 3D grids included; __shared__ variables are poisoned at every
# block's start). A block's threads are fibers (shim/cuda_runtime.h) that switch at
# barriers: __syncthreads is a real block barrier, and warp operations (__shfl*_sync,
# __syncwarp, votes) are warp barriers where every lane deposits its value and then
# reads its source lane's. CUB's sort is a stable host sort (shim/cub); cuda_fp16.h and
# cuda_bf16.h are bit-exact host conversions (shim/). emu_backend.cpp is the Backend.
#
# Emulated: append/read, the GC's observe, select, compaction, int4 demotion and
# dequantising read, and attention (attend.cu: split-K partial, combine and mass
# kernels, every dims-per-lane instantiation), with the SM count and the scratch size
# varied between calls so that several split counts and multi-pass queries are reached.
# shim_test.cu checks the shim itself first (shuffle semantics, barriers, poisoning,
# launch limits, refusals, conversions).
# Then bench/gpu-check.sh's four GPU benchmarks run in quick mode on the emulation, as a
# smoke test: they must reach their RESULT line and pass their own integrity checks.
#
# What it checks: the kernels' logic against the CPU specification, on every commit;
# missing barriers where the stale read changes a result (threads are swept in both
# orders); reads of shared memory no thread of the block wrote (they read NaN); launch
# configurations beyond CUDA's limits; warp operations misused (lanes at different
# operations, reads from exited lanes, deadlocks).
# What it cannot: races between blocks or between threads that the sweep orders do not
# expose (no memory model: a write is seen at once), warp divergence with partial masks
# (refused rather than emulated), the real CUB, CUDA's math (expf and the fast
# intrinsics are the host's, not bit-exact; nvcc may contract a*b+c into FMA, the host
# build does not), shared-memory and register limits, speed. Those need a GPU
# (bench/gpu-check.sh).
#
# usage: tests/cuda_emu/run.sh [BUILD_DIR]   (default build-emu; doctest headers needed)
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
here="$root/tests/cuda_emu"
out=${1:-$root/build-emu}
mkdir -p "$out" && out=$(cd "$out" && pwd)  # absolute: the build runs from $out/src
rm -rf "$out/src" "$out/obj" && mkdir -p "$out/src" "$out/obj"
cp -r "$root/allocator" "$root/gc" "$root/kernels" "$root/runtime" "$root/c_api" "$root/tests" \
  "$root/bench" "$out/src/"
cd "$out/src"
for f in copy gc gc_select gc_decide attend; do
  python3 "$here/transform.py" "kernels/cuda/$f.cu" "kernels/cuda/$f.emu.cpp"
done
python3 "$here/transform.py" "$here/shim_test.cu" shim_test.emu.cpp
cxx=(${CXX:-g++} -std=c++20 -O1 -g -I "$here/shim" -I c_api -I . -DKVGC_ASSERT_LEVEL=2
     -fno-strict-aliasing -w)
srcs=(allocator/host_memory.cpp allocator/page_pool.cpp gc/layer_budget.cpp gc/plan.cpp gc/ladder.cpp
      gc/compaction.cpp kernels/cpu/copy.cpp kernels/cpu/gc.cpp kernels/cpu/quant.cpp
      kernels/cpu/attend.cpp kernels/cpu/attend_avx2.cpp kernels/cpu/attend_avx512.cpp
      kernels/cpu/attend_split.cpp kernels/cpu/thread_pool.cpp
      runtime/options.cpp runtime/model.cpp runtime/heap.cpp runtime/batch.cpp runtime/check.cpp
      runtime/collect.cpp runtime/harvest.cpp runtime/staging_ring.cpp runtime/pinned_pool.cpp runtime/fork.cpp runtime/shared.cpp runtime/prefix.cpp runtime/evacuate.cpp runtime/shrink.cpp runtime/cpu_backend.cpp
      c_api/api_heap.cpp c_api/api_batch.cpp c_api/api_prefix.cpp c_api/api_introspect.cpp
      kernels/cuda/copy.emu.cpp kernels/cuda/gc.emu.cpp kernels/cuda/gc_select.emu.cpp
      kernels/cuda/gc_decide.emu.cpp kernels/cuda/attend.emu.cpp tests/cuda_main.cpp tests/test_cuda.cpp
      tests/test_cuda_gc.cpp tests/test_cuda_scrub.cpp tests/test_cuda_batch.cpp tests/util.cpp "$here/emu_backend.cpp"
      bench/cuda_copy.cpp bench/cuda_attend.cpp bench/cuda_gc.cpp bench/cuda_batch.cpp)
tests=(cuda_main test_cuda test_cuda_gc test_cuda_scrub test_cuda_batch util)  # objects only the test binary links
benches=(cuda_copy cuda_attend cuda_gc cuda_batch)           # one main each
objs=()
jobs=$(nproc)
"${cxx[@]}" shim_test.emu.cpp -o "$out/shim-test" &
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
core=()
for o in "${objs[@]}"; do
  b=$(basename "${o%.o}")
  [[ " ${tests[*]} ${benches[*]} " == *" $b "* ]] || core+=("$o")
done
"${cxx[@]}" "${core[@]}" $(printf "$out/obj/%s.o " "${tests[@]}") -o "$out/kvgc-cuda-emu-tests" -lpthread
for b in "${benches[@]}"; do
  "${cxx[@]}" "${core[@]}" "$out/obj/$b.o" -o "$out/kvgc-bench-$b" -lpthread
done
"$out/shim-test"
echo "cuda-emu: running the CUDA-vs-CPU tests on the host emulation"
"$out/kvgc-cuda-emu-tests"
# The GPU benchmarks (bench/gpu-check.sh's) in quick mode: they must run to their RESULT
# line (and their own integrity checks) before a GPU session spends time on them. The
# emulation's timings mean nothing.
for b in "${benches[@]}"; do
  echo "cuda-emu: kvgc-bench-$b --quick (a smoke run: timings are the emulation's)"
  "$out/kvgc-bench-$b" --quick > "$out/bench-$b.txt"
  grep -q '^RESULT ' "$out/bench-$b.txt" || { cat "$out/bench-$b.txt"; echo "cuda-emu: kvgc-bench-$b printed no RESULT line"; exit 1; }
  grep '^RESULT ' "$out/bench-$b.txt" | cut -c1-160
done
