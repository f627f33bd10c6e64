// Shared by the CUDA-vs-CPU tests: device buffers and heap helpers.
#pragma once

#include <cuda_runtime.h>
#include <doctest/doctest.h>

#include <cmath>
#include <vector>

#include "../kernels/cpu/convert.hpp"
#include "util.hpp"

namespace kvgc_test {

struct DeviceBuffer {
  void* p = nullptr;
  explicit DeviceBuffer(size_t bytes) { REQUIRE(cudaMalloc(&p, bytes ? bytes : 1) == cudaSuccess); }
  ~DeviceBuffer() { cudaFree(p); }
  template <class T = uint8_t>
  T* get(size_t byte_offset = 0) const { return reinterpret_cast<T*>(static_cast<uint8_t*>(p) + byte_offset); }
};

// A heap on `dev`; with `base`, its options but for the device (budget and page_tokens
// then come from it).
inline kvgc_heap* make_heap(const kvgc_model_desc& m, kvgc_device dev, uint32_t page_tokens,
                            uint64_t budget, const kvgc_heap_options* base = nullptr) {
  kvgc_heap_options o = base ? *base : cpu_options(budget, page_tokens);
  o.device = dev;
  kvgc_heap* h = nullptr;
  const kvgc_status st = kvgc_heap_create(&m, &o, &h);
  INFO(kvgc_errmsg(nullptr));
  REQUIRE(st == KVGC_OK);
  return h;
}

inline void require_check(kvgc_heap* h) {
  const kvgc_status st = kvgc_heap_check(h);
  INFO(kvgc_errmsg(h));
  REQUIRE(st == KVGC_OK);
}

// Relative RMS difference of two arrays of n model-dtype values (b against a); NaN
// when a is all zeros and they differ, 0 when both are.
inline double rel_rms(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b, size_t n,
                      kvgc_dtype dtype) {
  const size_t eb = dtype == KVGC_DTYPE_F32 ? 4 : 2;
  double e = 0, r = 0;
  for (size_t i = 0; i < n; ++i) {
    const double x = kvgc::cpu::load(&a[i * eb], dtype), y = kvgc::cpu::load(&b[i * eb], dtype);
    e += (x - y) * (x - y);
    r += x * x;
  }
  return r > 0 ? std::sqrt(e / r) : e > 0 ? NAN : 0.0;
}

}  // namespace kvgc_test
