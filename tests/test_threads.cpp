// Threads sharing one heap (the header promises calls on a heap are serialised) and
// the per-thread error message. Meant to run under TSan as well as normally.
#include <doctest/doctest.h>

#include <atomic>
#include <random>
#include <thread>

#include "util.hpp"

using namespace kvgc_test;

TEST_CASE("threads share a heap: appends, reads, destroys, hand-offs, per-thread errors") {
  const kvgc_model_desc m = model(2, 2, 32);
  const kvgc_heap_options o = cpu_options(32 << 20, 8);
  kvgc_heap* h = nullptr;
  REQUIRE(kvgc_heap_create(&m, &o, &h) == KVGC_OK);
  constexpr int kThreads = 4, kIters = 60;
  std::atomic<int> errors{0};
  std::atomic<kvgc_seq> handoff{0};  // a sequence passed from one thread to another
  std::vector<std::thread> pool;
  for (int t = 0; t < kThreads; ++t) {
    pool.emplace_back([&, t] {
      std::mt19937 rng(t);
      for (int it = 0; it < kIters; ++it) {
        kvgc_seq s;
        if (kvgc_seq_create(h, uint32_t(t), &s) != KVGC_OK) { ++errors; continue; }
        uint64_t len = 0;
        for (int a = 0; a < 4; ++a) {
          const uint32_t n = 1 + rng() % 20;
          const auto k = tagged(m, s, 1, len, n, false), v = tagged(m, s, 1, len, n, true);
          if (kvgc_append(h, s, 1, k.data(), v.data(), n, nullptr) != KVGC_OK) ++errors;
          len += n;
        }
        std::vector<uint8_t> k(len * token_bytes(m)), v(k.size());
        std::vector<int32_t> pos(len);
        uint64_t n = 0;
        if (kvgc_read(h, s, 1, k.data(), v.data(), pos.data(), len, &n, nullptr) != KVGC_OK ||
            n != len || !verify(m, s, 1, k, v, pos, n).empty())
          ++errors;
        // Each thread's error stays its own while others succeed or fail differently.
        if (kvgc_append(h, s, 5 + t, k.data(), v.data(), 1, nullptr) != KVGC_EINVAL ||
            std::string(kvgc_errmsg(h)).find("layer " + std::to_string(5 + t)) == std::string::npos)
          ++errors;
        // Hand the sequence to whichever thread comes next; destroy the one received.
        const kvgc_seq got = handoff.exchange(s);
        if (got && kvgc_seq_destroy(h, got) != KVGC_OK) ++errors;
      }
    });
  }
  for (auto& th : pool) th.join();
  if (kvgc_seq last = handoff.exchange(0)) REQUIRE(kvgc_seq_destroy(h, last) == KVGC_OK);
  CHECK(errors == 0);
  CHECK(kvgc_heap_check(h) == KVGC_OK);
  kvgc_stats st;
  kvgc_stats_init(&st);
  kvgc_get_stats(h, &st);
  CHECK(st.sequences == 0);
  CHECK(st.slabs_free == st.slabs_total);
  kvgc_heap_destroy(h);
}
