// CUDA backend vs the CPU specification, data plane: the same calls on both, on fresh
// random inputs (seeds printed), CUDA outputs poisoned before every read, results
// compared byte for byte: append/read, attention, argument checks, device exhaustion.
#include <cuda_runtime.h>
#include <doctest/doctest.h>

#include <array>
#include <bit>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>

#include "../kernels/cpu/convert.hpp"
#include "cuda_util.hpp"

using namespace kvgc_test;

TEST_CASE("the CUDA backend is chosen and reports itself") {
  const kvgc_model_desc m = model(2, 2, 64);
  kvgc_heap* h = make_heap(m, KVGC_DEVICE_AUTO, 16, 8 << 20);
  kvgc_stats st;
  kvgc_stats_init(&st);
  REQUIRE(kvgc_get_stats(h, &st) == KVGC_OK);
  CHECK(st.device == KVGC_DEVICE_CUDA);
  kvgc_heap_destroy(h);
}

TEST_CASE("append + read on CUDA equal the CPU specification (random shapes, poisoned outputs)") {
  const uint32_t seed = kvgc_test::fresh_seed("test_cuda");
  std::mt19937 rng(seed);
  struct Shape { uint32_t layers, kv_heads, head_dim, page_tokens; kvgc_dtype dtype; };
  const Shape shapes[] = {{2, 8, 128, 16, KVGC_DTYPE_F16}, {1, 3, 64, 7, KVGC_DTYPE_BF16},
                          {2, 1, 256, 32, KVGC_DTYPE_F32}, {1, 4, 6, 1, KVGC_DTYPE_F16},
                          {1, 2, 64, 256, KVGC_DTYPE_F16}, {3, 8, 64, 33, KVGC_DTYPE_BF16}};
  cudaStream_t stream;
  REQUIRE(cudaStreamCreate(&stream) == cudaSuccess);
  for (const Shape& sh : shapes) {
    CAPTURE(sh.head_dim);
    CAPTURE(sh.page_tokens);
    const kvgc_model_desc m = model(sh.layers, sh.kv_heads, sh.head_dim, sh.dtype);
    kvgc_heap* cpu = make_heap(m, KVGC_DEVICE_CPU, sh.page_tokens, 64 << 20);
    kvgc_heap* gpu = make_heap(m, KVGC_DEVICE_CUDA, sh.page_tokens, 64 << 20);
    kvgc_seq sc, sg;
    REQUIRE(kvgc_seq_create(cpu, 0, &sc) == KVGC_OK);
    REQUIRE(kvgc_seq_create(gpu, 0, &sg) == KVGC_OK);
    const size_t tb = token_bytes(m);
    for (int step = 0; step < 10; ++step) {
      const uint32_t layer = rng() % sh.layers;
      const uint32_t n = step % 2 ? 1 : 1 + rng() % 600;
      std::vector<uint8_t> k(n * tb), v(n * tb);
      for (auto& x : k) x = uint8_t(rng());
      for (auto& x : v) x = uint8_t(rng());
      // Odd steps read the source from a 2-byte-misaligned (but dtype-aligned) address.
      const size_t off = (step % 2 && m.dtype != KVGC_DTYPE_F32) ? 2 : 0;
      DeviceBuffer dk(n * tb + off), dv(n * tb + off);
      REQUIRE(cudaMemcpy(dk.get(off), k.data(), n * tb, cudaMemcpyHostToDevice) == cudaSuccess);
      REQUIRE(cudaMemcpy(dv.get(off), v.data(), n * tb, cudaMemcpyHostToDevice) == cudaSuccess);
      REQUIRE(kvgc_append(cpu, sc, layer, k.data(), v.data(), n, nullptr) == KVGC_OK);
      REQUIRE(kvgc_append(gpu, sg, layer, dk.get(off), dv.get(off), n, stream) == KVGC_OK);

      uint64_t live = 0;
      REQUIRE(kvgc_read(cpu, sc, layer, nullptr, nullptr, nullptr, 0, &live, nullptr) == KVGC_OK);
      std::vector<uint8_t> ck(live * tb), cv(live * tb);
      std::vector<int32_t> cp(live);
      uint64_t got = 0;
      REQUIRE(kvgc_read(cpu, sc, layer, ck.data(), cv.data(), cp.data(), live, &got, nullptr) == KVGC_OK);
      DeviceBuffer ok(live * tb), ov(live * tb), op(live * 4);
      REQUIRE(cudaMemsetAsync(ok.p, 0xA5, live * tb, stream) == cudaSuccess);  // poison
      REQUIRE(cudaMemsetAsync(ov.p, 0x5A, live * tb, stream) == cudaSuccess);
      REQUIRE(cudaMemsetAsync(op.p, 0xFF, live * 4, stream) == cudaSuccess);
      uint64_t got_gpu = 0;
      REQUIRE(kvgc_read(gpu, sg, layer, ok.p, ov.p, op.get<int32_t>(), live, &got_gpu, stream) == KVGC_OK);
      REQUIRE(got_gpu == got);
      std::vector<uint8_t> gk(live * tb), gv(live * tb);
      std::vector<int32_t> gp(live);
      REQUIRE(cudaStreamSynchronize(stream) == cudaSuccess);
      REQUIRE(cudaMemcpy(gk.data(), ok.p, live * tb, cudaMemcpyDeviceToHost) == cudaSuccess);
      REQUIRE(cudaMemcpy(gv.data(), ov.p, live * tb, cudaMemcpyDeviceToHost) == cudaSuccess);
      REQUIRE(cudaMemcpy(gp.data(), op.p, live * 4, cudaMemcpyDeviceToHost) == cudaSuccess);
      CHECK(gk == ck);
      CHECK(gv == cv);
      CHECK(gp == cp);
      require_check(gpu);
    }
    kvgc_heap_destroy(cpu);
    kvgc_heap_destroy(gpu);
  }
  cudaStreamDestroy(stream);
}

TEST_CASE("CUDA argument checks: host pointers are refused, the heap is unchanged") {
  const kvgc_model_desc m = model(1, 2, 64);
  kvgc_heap* h = make_heap(m, KVGC_DEVICE_CUDA, 16, 8 << 20);
  kvgc_seq s;
  REQUIRE(kvgc_seq_create(h, 0, &s) == KVGC_OK);
  std::vector<uint8_t> host(4 * token_bytes(m));
  DeviceBuffer d(4 * token_bytes(m));
  CHECK(kvgc_append(h, s, 0, host.data(), d.p, 4, nullptr) == KVGC_EINVAL);
  CHECK(std::string(kvgc_errmsg(h)).find("k is host memory") != std::string::npos);
  CHECK(kvgc_append(h, s, 0, d.p, d.p, 4, nullptr) == KVGC_OK);
  uint64_t n = 0;
  CHECK(kvgc_read(h, s, 0, host.data(), nullptr, nullptr, 4, &n, nullptr) == KVGC_EINVAL);
  CHECK(std::string(kvgc_errmsg(h)).find("k_out") != std::string::npos);
  require_check(h);
  kvgc_heap_destroy(h);
}

TEST_CASE("attend on CUDA equals the CPU specification (random shapes, GQA, chunks, poisoned outputs)") {
  const uint32_t seed = kvgc_test::fresh_seed("test_cuda attend");
  std::mt19937 rng(seed);
  struct Shape { uint32_t kv_heads, gqa, head_dim, page_tokens; kvgc_dtype dtype; uint32_t tokens, n_q; };
  const Shape shapes[] = {{8, 4, 128, 16, KVGC_DTYPE_F16, 4000, 1},  {2, 1, 64, 16, KVGC_DTYPE_F32, 300, 1},
                          {1, 3, 64, 7, KVGC_DTYPE_BF16, 500, 5},    {2, 8, 128, 16, KVGC_DTYPE_F32, 257, 16},
                          {4, 2, 256, 32, KVGC_DTYPE_F16, 700, 2},   {1, 16, 96, 16, KVGC_DTYPE_F16, 333, 3},
                          {3, 1, 6, 5, KVGC_DTYPE_F32, 64, 64},      {1, 1, 64, 16, KVGC_DTYPE_F16, 1, 1},
                          // more than 32 slots a page: several live-bitmap words per page
                          {2, 2, 64, 48, KVGC_DTYPE_F16, 600, 2},    {1, 4, 128, 100, KVGC_DTYPE_F32, 450, 1}};
  cudaStream_t stream;
  REQUIRE(cudaStreamCreate(&stream) == cudaSuccess);
  for (const Shape& sh : shapes) {
    CAPTURE(sh.head_dim);
    CAPTURE(sh.gqa);
    CAPTURE(sh.n_q);
    CAPTURE(sh.dtype);
    const kvgc_model_desc m = model(1, sh.kv_heads, sh.head_dim, sh.dtype, sh.gqa);
    kvgc_heap* cpu = make_heap(m, KVGC_DEVICE_CPU, sh.page_tokens, 128 << 20);
    kvgc_heap* gpu = make_heap(m, KVGC_DEVICE_CUDA, sh.page_tokens, 128 << 20);
    kvgc_seq sc, sg;
    REQUIRE(kvgc_seq_create(cpu, 0, &sc) == KVGC_OK);
    REQUIRE(kvgc_seq_create(gpu, 0, &sg) == KVGC_OK);
    const auto k = gaussian(m, 1, 0, 0, sh.tokens, false), v = gaussian(m, 1, 0, 0, sh.tokens, true);
    DeviceBuffer dk(k.size()), dv(v.size());
    REQUIRE(cudaMemcpy(dk.p, k.data(), k.size(), cudaMemcpyHostToDevice) == cudaSuccess);
    REQUIRE(cudaMemcpy(dv.p, v.data(), v.size(), cudaMemcpyHostToDevice) == cudaSuccess);
    REQUIRE(kvgc_append(cpu, sc, 0, k.data(), v.data(), sh.tokens, nullptr) == KVGC_OK);
    REQUIRE(kvgc_append(gpu, sg, 0, dk.p, dv.p, sh.tokens, stream) == KVGC_OK);
    const size_t eb = elem_bytes(m), qn = size_t(sh.n_q) * m.n_q_heads * sh.head_dim;
    std::vector<uint8_t> q(qn * eb), out_cpu(q.size());
    std::normal_distribution<float> gauss(0.f, 1.f);
    for (size_t i = 0; i < qn; ++i) kvgc::cpu::store(&q[i * eb], m.dtype, 2.f * gauss(rng));
    DeviceBuffer dq(q.size()), dout(q.size());
    REQUIRE(cudaMemcpy(dq.p, q.data(), q.size(), cudaMemcpyHostToDevice) == cudaSuccess);
    REQUIRE(cudaMemsetAsync(dout.p, 0xA5, q.size(), stream) == cudaSuccess);  // poison
    for (int rep = 0; rep < 2; ++rep) {  // twice: scores accumulate
      REQUIRE(kvgc_attend(cpu, sc, 0, q.data(), sh.n_q, out_cpu.data(), nullptr, nullptr) == KVGC_OK);
      const kvgc_status st = kvgc_attend(gpu, sg, 0, dq.p, sh.n_q, dout.p, nullptr, stream);
      INFO(std::string(kvgc_errmsg(gpu)));
      REQUIRE(st == KVGC_OK);
    }
    std::vector<uint8_t> out_gpu(q.size());
    REQUIRE(cudaStreamSynchronize(stream) == cudaSuccess);
    REQUIRE(cudaMemcpy(out_gpu.data(), dout.p, q.size(), cudaMemcpyDeviceToHost) == cudaSuccess);
    const double bound = kvgc_test::output_bound(m.dtype);
    CHECK(rel_rms(out_cpu, out_gpu, qn, m.dtype) <= bound);
    uint64_t n = 0;
    std::vector<float> sc_cpu(sh.tokens), sc_gpu(sh.tokens);
    REQUIRE(kvgc_read_scores(cpu, sc, 0, sc_cpu.data(), nullptr, sh.tokens, &n, nullptr) == KVGC_OK);
    DeviceBuffer ds(sh.tokens * 4);
    REQUIRE(kvgc_read_scores(gpu, sg, 0, ds.get<float>(), nullptr, sh.tokens, &n, stream) == KVGC_OK);
    REQUIRE(cudaStreamSynchronize(stream) == cudaSuccess);
    REQUIRE(cudaMemcpy(sc_gpu.data(), ds.p, sh.tokens * 4, cudaMemcpyDeviceToHost) == cudaSuccess);
    double se = 0, sr = 0;
    for (uint32_t i = 0; i < sh.tokens; ++i) {
      se += double(sc_cpu[i] - sc_gpu[i]) * (sc_cpu[i] - sc_gpu[i]);
      sr += double(sc_cpu[i]) * sc_cpu[i];
    }
    CHECK(std::sqrt(se / sr) <= 1e-4);
    require_check(gpu);
    kvgc_heap_destroy(cpu);
    kvgc_heap_destroy(gpu);
  }
  cudaStreamDestroy(stream);
}

// ---- the GC on CUDA against the CPU specification ---------------------------------

TEST_CASE("a budget beyond the device is KVGC_ENOMEM with the CUDA message, not a crash") {
  const kvgc_model_desc m = model(1, 2, 64);
  kvgc_heap_options o = cpu_options(uint64_t(1) << 50);
  o.device = KVGC_DEVICE_CUDA;
  kvgc_heap* h = nullptr;
  CHECK(kvgc_heap_create(&m, &o, &h) == KVGC_ENOMEM);
  CHECK(h == nullptr);
  CHECK(std::string(kvgc_errmsg(nullptr)).find("cudaMalloc") != std::string::npos);
  // The device is still usable afterwards.
  kvgc_heap* ok = make_heap(m, KVGC_DEVICE_CUDA, 16, 8 << 20);
  kvgc_heap_destroy(ok);
}
