// Tenant isolation and side channels: quotas, page scrubbing (a canary planted by one
// tenant is never found in another's pages), and score noise.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstring>
#include <set>

#include "../c_api/internal.hpp"
#include "../kernels/cpu/quant.hpp"
#include "util.hpp"

using namespace kvgc_test;

namespace {

kvgc_stats stats(kvgc_heap* h) {
  kvgc_stats s;
  kvgc_stats_init(&s);
  REQUIRE(kvgc_get_stats(h, &s) == KVGC_OK);
  return s;
}

void append(kvgc_heap* h, const kvgc_model_desc& m, kvgc_seq s, uint32_t layer, uint32_t n,
            kvgc_status expect = KVGC_OK) {
  uint64_t len = 0;
  REQUIRE(kvgc_seq_tokens(h, s, layer, nullptr, &len) == KVGC_OK);
  const auto k = gaussian(m, s, layer, int64_t(len), n, false), v = gaussian(m, s, layer, int64_t(len), n, true);
  REQUIRE(kvgc_append(h, s, layer, k.data(), v.data(), n, nullptr) == expect);
}

}  // namespace

TEST_CASE("quotas: a tenant over its limit gets KVGC_EBUDGET, others are untouched") {
  const kvgc_model_desc m = model(1, 2, 64);
  kvgc_heap_options o = cpu_options(4 << 20, 16);
  o.policy = KVGC_POLICY_H2O;
  o.token_budget = 12;  // = sinks + window: a step keeps exactly the protected tokens
  o.window = 8;
  o.harvest = KVGC_HARVEST_IMMEDIATE;  // the step below gives pages back within the call
  kvgc_heap* h = nullptr;
  REQUIRE(kvgc_heap_create(&m, &o, &h) == KVGC_OK);
  const uint64_t page = stats(h).cls[KVGC_CLASS_FP16].page_bytes;
  REQUIRE(kvgc_tenant_set_limit(h, 1, 3 * page) == KVGC_OK);
  kvgc_seq a, b, other;
  REQUIRE(kvgc_seq_create(h, 1, &a) == KVGC_OK);
  REQUIRE(kvgc_seq_create(h, 1, &b) == KVGC_OK);
  REQUIRE(kvgc_seq_create(h, 2, &other) == KVGC_OK);
  append(h, m, other, 0, 40);
  append(h, m, a, 0, 32);  // 2 pages
  append(h, m, b, 0, 16);  // 3 pages: at the limit
  uint64_t used = 0, limit = 0;
  REQUIRE(kvgc_tenant_usage(h, 1, &used, &limit) == KVGC_OK);
  CHECK(used == 3 * page);
  CHECK(limit == 3 * page);
  const kvgc_stats before = stats(h);
  append(h, m, b, 0, 1, KVGC_EBUDGET);
  const std::string msg = kvgc_errmsg(h);
  CHECK(msg.find("tenant 1") != std::string::npos);
  CHECK(msg.find("quota") != std::string::npos);
  kvgc_stats after = stats(h);
  after.enomem = before.enomem;
  CHECK(std::memcmp(&before, &after, sizeof before) == 0);  // nothing changed
  append(h, m, other, 0, 100);  // tenant 2 has no limit
  // Tenant 1's GC evicts only its own tokens: tenant 2's stay intact. a keeps 12 of 32
  // tokens, compacts into one page and gives the other back.
  REQUIRE(kvgc_step(h, a, nullptr) == KVGC_OK);
  uint64_t live_other = 0;
  REQUIRE(kvgc_seq_tokens(h, other, 0, &live_other, nullptr) == KVGC_OK);
  CHECK(live_other == 140);
  CHECK(verify_gaussian(h, m, other, 0, 0.0).empty());
  // The step gave pages back: tenant 1 may grow again.
  REQUIRE(kvgc_tenant_usage(h, 1, &used, nullptr) == KVGC_OK);
  CHECK(used == 2 * page);
  append(h, m, b, 0, 1);  // b's second page: back at the limit
  append(h, m, b, 0, 16, KVGC_EBUDGET);
  REQUIRE(kvgc_seq_destroy(h, a) == KVGC_OK);
  REQUIRE(kvgc_tenant_usage(h, 1, &used, nullptr) == KVGC_OK);
  CHECK(used == 2 * page);
  REQUIRE(kvgc_tenant_set_limit(h, 1, 0) == KVGC_OK);  // lifted
  append(h, m, b, 0, 64);
  CHECK(kvgc_tenant_usage(h, 1, nullptr, nullptr) == KVGC_EINVAL);
  CHECK(kvgc_heap_check(h) == KVGC_OK);
  kvgc_heap_destroy(h);
}

TEST_CASE("scrubbing: a canary planted by tenant A is never found in tenant B's pages") {
  const kvgc_model_desc m = model(2, 2, 64);
  kvgc_heap_options o = cpu_options(2 << 20, 16);
  o.policy = KVGC_POLICY_H2O;
  o.token_budget = 40;
  o.window = 8;
  o.demote = KVGC_DEMOTE_INT4;
  kvgc_heap* h = nullptr;
  REQUIRE(kvgc_heap_create(&m, &o, &h) == KVGC_OK);
  // Tenant A: every K/V byte is the canary, in fp16 pages and (after demotion) int4 pages.
  const char marker[9] = "SECRET!!";
  const size_t tb = token_bytes(m);
  std::vector<uint8_t> secret(200 * tb);
  for (size_t i = 0; i < secret.size(); ++i) secret[i] = uint8_t(marker[i % 8]);
  // The 4-byte scale/zero pair A's rows quantise to: its int4 pages' fingerprint.
  std::vector<uint8_t> nib(32);
  std::vector<uint16_t> qp(4);
  kvgc::cpu::quantize_row(secret.data(), m.dtype, 64, nib.data(), qp.data());
  for (int round = 0; round < 3; ++round) {
    kvgc_seq a;
    REQUIRE(kvgc_seq_create(h, 7, &a) == KVGC_OK);
    for (uint32_t layer = 0; layer < 2; ++layer) {
      for (int i = 0; i < 5; ++i) {
        REQUIRE(kvgc_append(h, a, layer, secret.data(), secret.data(), 40, nullptr) == KVGC_OK);
        uint64_t live = 0;
        kvgc_seq_tokens(h, a, layer, &live, nullptr);
        std::vector<float> mass(live, 1.f);
        REQUIRE(kvgc_observe(h, a, layer, mass.data(), live, nullptr) == KVGC_OK);
        REQUIRE(kvgc_step(h, a, nullptr) == KVGC_OK);
      }
    }
    REQUIRE(stats(h).tokens_demoted > 0);
    REQUIRE(kvgc_seq_destroy(h, a) == KVGC_OK);
    // Tenant B reuses the same memory through every path that takes pages.
    kvgc_seq b;
    REQUIRE(kvgc_seq_create(h, 8, &b) == KVGC_OK);
    for (uint32_t layer = 0; layer < 2; ++layer) {
      append(h, m, b, layer, 1);   // a fresh page, 15 slots never written
      append(h, m, b, layer, 70);
      uint64_t live = 0;
      kvgc_seq_tokens(h, b, layer, &live, nullptr);
      std::vector<float> mass(live, 1.f);
      REQUIRE(kvgc_observe(h, b, layer, mass.data(), live, nullptr) == KVGC_OK);
    }
    REQUIRE(kvgc_step(h, b, nullptr) == KVGC_OK);  // demotion pages for B
    // Apply the step's results: destination pages the GC reserved but did not use go back
    // to the pool unwritten (their live masks cleared, never readable), used ones were
    // scrubbed whole before their first write. Then scan every byte of every page B holds.
    stats(h);
    size_t pages = 0, hits = 0;
    REQUIRE(kvgc::internal_heap(h)->for_each_page(b, [&](const uint8_t* page, size_t bytes) {
      ++pages;
      for (size_t i = 0; i + 8 <= bytes; ++i)
        if (std::memcmp(page + i, marker, 8) == 0) ++hits;
      for (size_t i = 0; i + 4 <= bytes; i += 2)
        if (std::memcmp(page + i, qp.data(), 4) == 0) ++hits;
    }).ok());
    CHECK(pages > 4);
    CHECK(hits == 0);
    // And through the API: B reads back exactly its own data.
    for (uint32_t layer = 0; layer < 2; ++layer) CHECK(verify_gaussian(h, m, b, layer, 0.12).empty());
    REQUIRE(kvgc_seq_destroy(h, b) == KVGC_OK);
  }
  CHECK(kvgc_heap_check(h) == KVGC_OK);
  kvgc_heap_destroy(h);
}

TEST_CASE("score noise: 0 is deterministic; with noise the kept set varies by seed; its cost") {
  auto kept = [](double noise, uint64_t seed, int* heavy_kept) {
    const kvgc_model_desc m = model(1, 1, 32);
    kvgc_heap_options o = cpu_options(4 << 20, 8);
    o.policy = KVGC_POLICY_H2O;
    o.token_budget = 64;
    o.sinks = 2;
    o.window = 8;
    o.score_noise = noise;
    o.seed = seed;
    kvgc_heap* h = nullptr;
    REQUIRE(kvgc_heap_create(&m, &o, &h) == KVGC_OK);
    kvgc_seq s;
    REQUIRE(kvgc_seq_create(h, 0, &s) == KVGC_OK);
    for (int64_t len = 0; len < 600; ++len) {
      append(h, m, s, 0, 1);
      uint64_t n = 0;
      REQUIRE(kvgc_read(h, s, 0, nullptr, nullptr, nullptr, 0, &n, nullptr) == KVGC_OK);
      std::vector<int32_t> pos(n);
      REQUIRE(kvgc_read(h, s, 0, nullptr, nullptr, pos.data(), n, &n, nullptr) == KVGC_OK);
      std::vector<float> mass(n);
      // Heavy hitters (every 20th position) get 0.05 per step, the rest 0.001.
      for (size_t i = 0; i < n; ++i) mass[i] = pos[i] % 20 == 3 ? 0.05f : 0.001f;
      REQUIRE(kvgc_observe(h, s, 0, mass.data(), n, nullptr) == KVGC_OK);
      REQUIRE(kvgc_step(h, s, nullptr) == KVGC_OK);
    }
    uint64_t n = 0;
    kvgc_read(h, s, 0, nullptr, nullptr, nullptr, 0, &n, nullptr);
    std::vector<int32_t> pos(n);
    kvgc_read(h, s, 0, nullptr, nullptr, pos.data(), n, &n, nullptr);
    *heavy_kept = int(std::count_if(pos.begin(), pos.end(), [](int32_t p) { return p % 20 == 3; }));
    kvgc_heap_destroy(h);
    return std::set<int32_t>(pos.begin(), pos.end());
  };
  int hk = 0;
  const auto a = kept(0, 1, &hk), b = kept(0, 2, &hk);
  CHECK(a == b);  // no noise: the seed does not matter
  const int heavy_total = 600 / 20;
  MESSAGE("heavy hitters kept without noise: " << hk << "/" << heavy_total);
  const auto c = kept(0.05, 1, &hk), d = kept(0.05, 1, &hk), e = kept(0.05, 2, &hk);
  CHECK(c == d);  // reproducible from the seed
  CHECK(c != e);  // and different across seeds
  for (double noise : {0.001, 0.01, 0.05, 0.2}) {
    int total = 0;
    for (uint64_t seed = 1; seed <= 3; ++seed) {
      int k = 0;
      kept(noise, seed, &k);
      total += k;
    }
    MESSAGE("score noise " << noise << ": heavy hitters kept " << double(total) / 3 << "/" << heavy_total);
  }
}
