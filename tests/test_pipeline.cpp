// Pipeline parallelism: heaps over layer ranges (opts.first_layer, opts.total_layers)
// decide exactly what one heap over every layer decides, token for token.
#include <doctest/doctest.h>

#include <cstring>
#include <random>
#include <vector>

#include "kvgc.h"
#include "util.hpp"

using namespace kvgc_test;

namespace {

constexpr uint32_t kLayers = 6;

kvgc_heap* range_heap(uint32_t first, uint32_t count, kvgc_policy p, kvgc_layer_budget lb,
                      const std::vector<float>& weights, bool whole_model_desc = false) {
  kvgc_model_desc m = model(count, 2, 16, KVGC_DTYPE_F32, 2);
  kvgc_heap_options o;
  kvgc_heap_options_init(&o);
  o.flags = KVGC_OPT_IGNORE_ENV;
  o.device = KVGC_DEVICE_CPU;
  o.min_length = 0;  // short sequences: budgets from the first token
  o.budget_bytes = 32u << 20;
  o.policy = p;
  o.token_budget_fraction = 0.3;
  o.sinks = 2;
  o.window = 8;
  o.page_tokens = 8;
  o.layer_budget = lb;
  o.layer_weights = weights.data();
  o.n_layer_weights = uint32_t(weights.size());
  o.harvest = KVGC_HARVEST_IMMEDIATE;
  if (!whole_model_desc) {
    o.first_layer = first;
    o.total_layers = kLayers;
  }
  kvgc_heap* h = nullptr;
  REQUIRE(kvgc_heap_create(&m, &o, &h) == KVGC_OK);
  return h;
}

struct Rank {
  kvgc_heap* heap;
  uint32_t first, count;
  kvgc_seq seq[2];
};

}  // namespace

TEST_CASE("pipeline: heaps over layer ranges decide what one heap over all layers decides") {
  std::vector<float> weights = {1.f, 3.f, 0.5f, 2.f, 1.f, 4.f};
  struct Case {
    kvgc_policy p;
    kvgc_layer_budget lb;
  };
  for (Case c : {Case{KVGC_POLICY_H2O, KVGC_LAYER_BUDGET_PYRAMID}, Case{KVGC_POLICY_RANDOM, KVGC_LAYER_BUDGET_UNIFORM},
                 Case{KVGC_POLICY_GENERATIONAL, KVGC_LAYER_BUDGET_ENTROPY}}) {
    CAPTURE(c.p);
    const std::vector<float> w = c.lb == KVGC_LAYER_BUDGET_ENTROPY ? weights : std::vector<float>{};
    std::vector<Rank> ranks = {{nullptr, 0, 2, {}}, {nullptr, 2, 3, {}}, {nullptr, 5, 1, {}}};
    Rank whole{range_heap(0, kLayers, c.p, c.lb, w, true), 0, kLayers, {}};
    for (Rank& r : ranks) r.heap = range_heap(r.first, r.count, c.p, c.lb, w);
    for (Rank* r : {&whole, &ranks[0], &ranks[1], &ranks[2]})
      for (kvgc_seq& s : r->seq) REQUIRE(kvgc_seq_create(r->heap, 0, &s) == KVGC_OK);
    std::mt19937 rng(99);
    std::normal_distribution<float> nd;
    const size_t kv_row = 2 * 16, q_row = 4 * 16;
    for (int step = 0; step < 60; ++step) {
      for (int s = 0; s < 2; ++s) {
        const uint32_t n = step == 0 ? 20u + 13u * s : 1u;
        for (uint32_t layer = 0; layer < kLayers; ++layer) {
          std::vector<float> k(n * kv_row), v(n * kv_row), q(n * q_row), out(n * q_row);
          for (float& x : k) x = nd(rng);
          for (float& x : v) x = nd(rng);
          for (float& x : q) x = nd(rng);
          REQUIRE(kvgc_append(whole.heap, whole.seq[s], layer, k.data(), v.data(), n, nullptr) == KVGC_OK);
          REQUIRE(kvgc_attend(whole.heap, whole.seq[s], layer, q.data(), n, out.data(), nullptr, nullptr) == KVGC_OK);
          for (Rank& r : ranks)
            if (layer >= r.first && layer < r.first + r.count) {
              const uint32_t local = layer - r.first;
              REQUIRE(kvgc_append(r.heap, r.seq[s], local, k.data(), v.data(), n, nullptr) == KVGC_OK);
              REQUIRE(kvgc_attend(r.heap, r.seq[s], local, q.data(), n, out.data(), nullptr, nullptr) == KVGC_OK);
            }
        }
        const kvgc_status st = kvgc_step(whole.heap, whole.seq[s], nullptr);
        REQUIRE((st == KVGC_OK || st == KVGC_EBUDGET));
        for (Rank& r : ranks) {
          const kvgc_status rs = kvgc_step(r.heap, r.seq[s], nullptr);
          REQUIRE((rs == KVGC_OK || rs == KVGC_EBUDGET));
        }
      }
    }
    uint64_t evicted_layers = 0;
    for (int s = 0; s < 2; ++s)
      for (uint32_t layer = 0; layer < kLayers; ++layer) {
        Rank* r = nullptr;
        for (Rank& x : ranks)
          if (layer >= x.first && layer < x.first + x.count) r = &x;
        uint64_t live_w = 0, len_w = 0, live_r = 0, len_r = 0;
        REQUIRE(kvgc_seq_tokens(whole.heap, whole.seq[s], layer, &live_w, &len_w) == KVGC_OK);
        REQUIRE(kvgc_seq_tokens(r->heap, r->seq[s], layer - r->first, &live_r, &len_r) == KVGC_OK);
        REQUIRE(live_w == live_r);
        evicted_layers += live_w < len_w;
        std::vector<int32_t> pw(live_w + 1), pr(live_w + 1);
        std::vector<uint8_t> cw(live_w + 1), cr(live_w + 1);
        uint64_t n = 0;
        REQUIRE(kvgc_read(whole.heap, whole.seq[s], layer, nullptr, nullptr, pw.data(), live_w + 1, &n, nullptr) == KVGC_OK);
        REQUIRE(kvgc_read(r->heap, r->seq[s], layer - r->first, nullptr, nullptr, pr.data(), live_w + 1, &n, nullptr) == KVGC_OK);
        REQUIRE(kvgc_read_classes(whole.heap, whole.seq[s], layer, cw.data(), live_w + 1, &n, nullptr) == KVGC_OK);
        REQUIRE(kvgc_read_classes(r->heap, r->seq[s], layer - r->first, cr.data(), live_w + 1, &n, nullptr) == KVGC_OK);
        CHECK_MESSAGE(pw == pr, "seq " << s << " layer " << layer);
        CHECK_MESSAGE(cw == cr, "seq " << s << " layer " << layer);
      }
    CHECK(evicted_layers == 2 * kLayers);  // every layer collected: the comparison meant something
    kvgc_heap_destroy(whole.heap);
    for (Rank& r : ranks) kvgc_heap_destroy(r.heap);
  }
}

TEST_CASE("pipeline: a layer range is checked against the model") {
  kvgc_model_desc m = model(3, 1, 16);
  kvgc_heap_options o;
  kvgc_heap_options_init(&o);
  o.flags = KVGC_OPT_IGNORE_ENV;
  o.device = KVGC_DEVICE_CPU;
  o.budget_bytes = 8u << 20;
  o.first_layer = 2;
  o.total_layers = 4;  // layers 2..4 of 4: one too many
  kvgc_heap* h = nullptr;
  CHECK(kvgc_heap_create(&m, &o, &h) == KVGC_EINVAL);
  CHECK(h == nullptr);
  CHECK(std::string(kvgc_errmsg(nullptr)).find("first_layer") != std::string::npos);
  o.total_layers = 5;
  REQUIRE(kvgc_heap_create(&m, &o, &h) == KVGC_OK);
  kvgc_heap_options got;
  kvgc_heap_options_init(&got);
  REQUIRE(kvgc_heap_get_options(h, &got) == KVGC_OK);
  CHECK(got.first_layer == 2);
  CHECK(got.total_layers == 5);
  kvgc_heap_destroy(h);
  // Entropy weights are one per layer of the whole model.
  std::vector<float> w(3, 1.f);
  o.layer_budget = KVGC_LAYER_BUDGET_ENTROPY;
  o.layer_weights = w.data();
  o.n_layer_weights = 3;
  CHECK(kvgc_heap_create(&m, &o, &h) == KVGC_EINVAL);
  w.assign(5, 1.f);
  o.layer_weights = w.data();
  o.n_layer_weights = 5;
  REQUIRE(kvgc_heap_create(&m, &o, &h) == KVGC_OK);
  kvgc_heap_destroy(h);
}
