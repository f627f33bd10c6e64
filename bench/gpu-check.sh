#!/usr/bin/env bash
# One script for a GPU machine: CUDA tests against the CPU specification and the GPU
# benchmarks, a table printed last. Runs from a bare checkout in a few minutes.
#
#   bench/gpu-check.sh --prepare   (here, on a dev machine with the Debian packages)
#       builds the CUDA tests and benchmarks for sm_90 with the static CUDA runtime and
#       static libstdc++ into .gpu/bin, and bundles the header-only dependencies
#       (doctest, the Boost headers used) into .gpu/include, so the GPU host needs no
#       Debian -dev packages and no network.
#   bench/gpu-check.sh             (on the GPU machine)
#       runs .gpu/bin; if those binaries cannot run there (another libc), rebuilds them
#       with nvcc from the sources and .gpu/include, then runs them.
# Logs go to $OUT (if set) or .gpu/out. KVGC_GPU_BUILD (default build-gpu) names the
# meson build directory --prepare uses, so a shared checkout can prepare without
# touching someone else's build.
set -uo pipefail
cd "$(dirname "$0")/.."
ARCH=${KVGC_GPU_ARCH:-90}
BUILD=${KVGC_GPU_BUILD:-build-gpu}
export PATH="$PATH:/usr/local/cuda/bin"

core_sources() {
  echo allocator/host_memory.cpp allocator/page_pool.cpp gc/layer_budget.cpp kernels/cpu/copy.cpp runtime/options.cpp \
       runtime/model.cpp runtime/heap.cpp runtime/batch.cpp runtime/check.cpp runtime/cpu_backend.cpp \
       runtime/cuda_backend.cpp kernels/cuda/copy.cu kernels/cuda/attend.cu \
       c_api/api_heap.cpp c_api/api_batch.cpp c_api/api_prefix.cpp c_api/api_introspect.cpp \
       kernels/cuda/gc.cu kernels/cuda/gc_select.cu kernels/cuda/gc_decide.cu \
       runtime/collect.cpp runtime/harvest.cpp runtime/staging_ring.cpp runtime/pinned_pool.cpp runtime/fork.cpp runtime/shared.cpp runtime/prefix.cpp runtime/evacuate.cpp runtime/shrink.cpp gc/plan.cpp gc/ladder.cpp gc/compaction.cpp kernels/cpu/gc.cpp kernels/cpu/quant.cpp \
       kernels/cpu/attend.cpp kernels/cpu/attend_avx2.cpp kernels/cpu/attend_avx512.cpp \
       kernels/cpu/attend_split.cpp kernels/cpu/thread_pool.cpp
}
GPU_TESTS="kvgc-cuda-tests"
GPU_BENCHES="kvgc-bench-cuda-copy kvgc-bench-cuda-attend kvgc-bench-cuda-gc kvgc-bench-cuda-batch"

if [ "${1:-}" = "--prepare" ]; then
  set -e
  rm -rf .gpu && mkdir -p .gpu/bin .gpu/include
  rm -rf "$BUILD"
  meson setup "$BUILD" -Dgpu_arch="$ARCH" -Dcuda=enabled -Dtcmalloc=disabled \
    -Dtools=false -Dcpp_link_args='-static-libstdc++ -static-libgcc' >/dev/null
  ninja -C "$BUILD" tests/$GPU_TESTS $(printf 'bench/%s ' $GPU_BENCHES) >/dev/null
  cp "$BUILD/tests/$GPU_TESTS" .gpu/bin/
  for b in $GPU_BENCHES; do cp "$BUILD/bench/$b" .gpu/bin/; done
  # Header-only dependencies, for a rebuild on the GPU host.
  cp /usr/include/doctest/doctest.h .gpu/include/
  mkdir -p .gpu/include/doctest && cp /usr/include/doctest/doctest.h .gpu/include/doctest/
  for f in $(g++ -std=c++20 -M -I c_api allocator/page_pool.cpp runtime/heap.cpp \
               runtime/check.cpp | tr ' \\' '\n\n' | grep '^/usr/include/boost/'); do
    mkdir -p ".gpu/include/$(dirname "${f#/usr/include/}")"
    cp "$f" ".gpu/include/${f#/usr/include/}"
  done
  du -sh .gpu | sed 's/^/prepared: /'
  exit 0
fi

OUTDIR=${OUT:-.gpu/out}
mkdir -p "$OUTDIR"
summary=()
row() { summary+=("$(printf '%-34s %s' "$1" "$2")"); }

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee "$OUTDIR/gpu.txt"

# Run the carried binaries if this machine's libc can; otherwise rebuild here.
# (KVGC_GPU_REBUILD=1 forces the rebuild.) 0 = ran, 77 = ran and found no GPU; anything
# else (127, a loader error about GLIBC/GLIBCXX) means the binary cannot run here.
bin=.gpu/bin
probe=$("$bin/kvgc-cuda-tests" --help 2>&1); rc=$?
if [ "${KVGC_GPU_REBUILD:-0}" = 1 ] || { [ $rc -ne 0 ] && [ $rc -ne 77 ]; }; then
  echo "carried binaries not used (rc=$rc: $(echo "$probe" | head -1)); rebuilding with nvcc"
  bin=.gpu/rebuilt && mkdir -p $bin
  flags="-std=c++20 -O2 -gencode=arch=compute_${ARCH},code=sm_${ARCH} -I c_api -I .gpu/include -DKVGC_ASSERT_LEVEL=1"
  nvcc $flags $(core_sources) tests/cuda_main.cpp tests/test_cuda.cpp tests/test_cuda_gc.cpp tests/test_cuda_scrub.cpp tests/test_cuda_batch.cpp tests/util.cpp -o $bin/kvgc-cuda-tests 2>&1 | tail -20 &
  nvcc $flags $(core_sources) bench/cuda_copy.cpp -o $bin/kvgc-bench-cuda-copy 2>&1 | tail -20 &
  nvcc $flags $(core_sources) bench/cuda_attend.cpp -o $bin/kvgc-bench-cuda-attend 2>&1 | tail -20 &
  nvcc $flags $(core_sources) bench/cuda_gc.cpp -o $bin/kvgc-bench-cuda-gc 2>&1 | tail -20 &
  nvcc $flags $(core_sources) bench/cuda_batch.cpp -o $bin/kvgc-bench-cuda-batch 2>&1 | tail -20 &
  wait
  row "build" "rebuilt on the GPU host with nvcc"
else
  row "build" "carried binaries (sm_${ARCH}, static cudart)"
fi

for t in $GPU_TESTS; do
  timeout 300 "$bin/$t" 2>&1 | tee "$OUTDIR/$t.log" | tail -4
  rc=${PIPESTATUS[0]}
  row "$t" "$(grep -E 'test cases:' "$OUTDIR/$t.log" | tail -1 | sed 's/\[doctest\] //') rc=$rc"
done
for b in $GPU_BENCHES; do
  timeout 300 "$bin/$b" 2>&1 | tee "$OUTDIR/$b.log"
  row "$b" "$(grep '^RESULT' "$OUTDIR/$b.log" | tail -1)"
done

echo
echo "==== kvgc gpu-check summary ($(head -1 "$OUTDIR/gpu.txt")) ===="
printf '%s\n' "${summary[@]}"
