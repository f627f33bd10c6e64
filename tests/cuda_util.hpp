// Shared by the CUDA-vs-CPU tests: device buffers and heap helpers.
#pragma once

#include <cuda_runtime.h>
#include <doctest/doctest.h>

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

}  // namespace kvgc_test
