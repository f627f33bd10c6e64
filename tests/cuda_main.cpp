// The CUDA-vs-CPU tests' entry point: exits 77 (meson's "skipped") with a message when
// no CUDA device answers, so machines without a GPU (CI) skip them cleanly.
#define DOCTEST_CONFIG_IMPLEMENT
#include <cuda_runtime.h>
#include <doctest/doctest.h>

#include <cstdio>

int main(int argc, char** argv) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n == 0) {
    std::printf("SKIP: no CUDA device answered (%s); CUDA-vs-CPU tests not run\n",
                e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
    return 77;
  }
  doctest::Context ctx(argc, argv);
  return ctx.run();
}
