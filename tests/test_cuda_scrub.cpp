// CUDA append vs the CPU specification, byte for byte over whole pages: a page full of
// a previous owner's bytes (0xA5) takes a fresh run and then a later one; the CUDA page
// must equal the CPU page in every byte, padding included. The CPU page's scrubbing is
// proven by tests/test_scrub.cpp; equality carries it to CUDA, geometry by geometry.
#include <cuda_runtime.h>
#include <doctest/doctest.h>

#include <cstring>
#include <random>
#include <vector>

#include "../kernels/cpu/copy.hpp"
#include "../kernels/cuda/copy.cuh"
#include "cuda_util.hpp"
#include "page_scan.hpp"

using namespace kvgc_test;

TEST_CASE("append on CUDA writes every byte of a fresh page as the CPU does (padding included)") {
  const uint32_t pts[] = {1, 3, 16, 33, 100, 256};
  const uint32_t hds[] = {8, 40, 64, 72, 128, 256};
  const kvgc_dtype dts[] = {KVGC_DTYPE_F16, KVGC_DTYPE_BF16, KVGC_DTYPE_F32};
  std::mt19937 rng(7);
  cudaStream_t stream;
  REQUIRE(cudaStreamCreate(&stream) == cudaSuccess);
  uint32_t i = 0, geometries = 0;
  for (kvgc_dtype dt : dts)
    for (uint32_t pt : pts)
      for (uint32_t hd : hds) {
        const uint32_t heads = 1 + (i++ % 8);
        const kvgc::PageLayout L = kvgc::PageLayout::make(pt, heads, hd, dt, KVGC_CLASS_FP16);
        if (L.bytes > (2u << 20)) continue;
        CAPTURE(pt);
        CAPTURE(heads);
        CAPTURE(hd);
        CAPTURE(int(dt));
        ++geometries;
        const size_t tb = size_t(heads) * hd * kvgc::dtype_bytes(dt);
        const uint32_t first = 1 + rng() % pt, second = pt - first;  // a fresh run, then the rest
        std::vector<uint8_t> k(size_t(pt) * tb), v(k.size());
        for (size_t j = 0; j < k.size(); ++j) {
          k[j] = uint8_t(rng() % 200);  // no 0xA5: a stale byte cannot pass for data
          v[j] = uint8_t(rng() % 200);
        }
        std::vector<uint8_t> host(L.bytes, 0xA5), back(L.bytes);
        DeviceBuffer page(L.bytes), dk(k.size()), dv(v.size());
        REQUIRE(cudaMemset(page.p, 0xA5, L.bytes) == cudaSuccess);
        REQUIRE(cudaMemcpy(dk.p, k.data(), k.size(), cudaMemcpyHostToDevice) == cudaSuccess);
        REQUIRE(cudaMemcpy(dv.p, v.data(), v.size(), cudaMemcpyHostToDevice) == cudaSuccess);
        for (int step = 0; step < 2; ++step) {
          const uint32_t slot = step ? first : 0, count = step ? second : first;
          if (count == 0) continue;
          const kvgc::AppendRun hr{host.data(), slot, count, slot};
          const kvgc::AppendRun dr{page.get(), slot, count, slot};
          kvgc::cpu::append({L, k.data(), v.data(), 100, 2, &hr, 1});
          REQUIRE(kvgc::cuda::append({L, dk.p, dv.p, 100, 2, &dr, 1}, stream) == cudaSuccess);
          REQUIRE(cudaStreamSynchronize(stream) == cudaSuccess);
          REQUIRE(cudaMemcpy(back.data(), page.p, L.bytes, cudaMemcpyDeviceToHost) == cudaSuccess);
          size_t differ = 0, first_at = 0;
          for (size_t j = L.bytes; j-- > 0;)
            if (back[j] != host[j]) {
              ++differ;
              first_at = j;
            }
          INFO("after run " << step << ": " << differ << " bytes differ, the first at " << first_at);
          CHECK(differ == 0);
          const std::string bad = scan_page(L, back.data(), step ? pt : first);
          INFO(bad);
          CHECK(bad.empty());
        }
      }
  MESSAGE(geometries << " geometries compared");
  cudaStreamDestroy(stream);
}
