// GC tests through the public API on the CPU backend: a heap with REQUIRE-checked
// helpers (append Gaussian K/V by position, observe mass by position, read positions).
#pragma once

#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "util.hpp"

namespace kvgc_test {

struct Heap {
  kvgc_heap* h = nullptr;
  kvgc_model_desc m;
  explicit Heap(const kvgc_heap_options& o, const kvgc_model_desc& model = kvgc_test::model(1, 2, 32))
      : m(model) {
    const kvgc_status st = kvgc_heap_create(&m, &o, &h);
    INFO(std::string(kvgc_errmsg(nullptr)));
    REQUIRE(st == KVGC_OK);
  }
  ~Heap() { kvgc_heap_destroy(h); }
  void check() {
    const kvgc_status st = kvgc_heap_check(h);
    INFO(std::string(kvgc_errmsg(h)));
    REQUIRE(st == KVGC_OK);
  }
  kvgc_stats stats() {
    kvgc_stats s;
    kvgc_stats_init(&s);
    REQUIRE(kvgc_get_stats(h, &s) == KVGC_OK);
    return s;
  }
  std::vector<int32_t> positions(kvgc_seq s, uint32_t layer = 0) {
    uint64_t n = 0;
    REQUIRE(kvgc_read(h, s, layer, nullptr, nullptr, nullptr, 0, &n, nullptr) == KVGC_OK);
    std::vector<int32_t> pos(n);
    REQUIRE(kvgc_read(h, s, layer, nullptr, nullptr, pos.data(), n, &n, nullptr) == KVGC_OK);
    return pos;
  }
  // Appends positions [from, from + n) with Gaussian K/V derived from the position.
  void append(kvgc_seq s, uint32_t layer, int64_t from, uint32_t n) {
    const auto k = gaussian(m, s, layer, from, n, false), v = gaussian(m, s, layer, from, n, true);
    const kvgc_status st = kvgc_append(h, s, layer, k.data(), v.data(), n, nullptr);
    const std::string err = kvgc_errmsg(h);
    CAPTURE(err);
    REQUIRE(st == KVGC_OK);
  }
  // Hands each live token mass(position).
  template <class F>
  void observe(kvgc_seq s, uint32_t layer, F&& mass) {
    const auto pos = positions(s, layer);
    std::vector<float> w(pos.size());
    for (size_t i = 0; i < pos.size(); ++i) w[i] = float(mass(pos[i]));
    REQUIRE(kvgc_observe(h, s, layer, w.data(), w.size(), nullptr) == KVGC_OK);
  }
  kvgc_status step(kvgc_seq s) { return kvgc_step(h, s, nullptr); }

  // Everything a segment holds, in read order: K/V, positions, scores, generations and
  // storage classes (what fork and prefix tests compare between sequences).
  struct Image {
    std::vector<uint8_t> k, v;
    std::vector<int32_t> pos;
    std::vector<float> score;
    std::vector<uint8_t> gen, cls;
    bool operator==(const Image&) const = default;
  };
  Image image(kvgc_seq s, uint32_t layer) {
    Image im;
    uint64_t n = 0;
    REQUIRE(kvgc_read(h, s, layer, nullptr, nullptr, nullptr, 0, &n, nullptr) == KVGC_OK);
    im.k.resize(n * token_bytes(m));
    im.v.resize(im.k.size());
    im.pos.resize(n);
    im.score.resize(n);
    im.gen.resize(n);
    im.cls.resize(n);
    REQUIRE(kvgc_read(h, s, layer, im.k.data(), im.v.data(), im.pos.data(), n, &n, nullptr) == KVGC_OK);
    REQUIRE(kvgc_read_scores(h, s, layer, im.score.data(), im.gen.data(), n, &n, nullptr) == KVGC_OK);
    REQUIRE(kvgc_read_classes(h, s, layer, im.cls.data(), n, &n, nullptr) == KVGC_OK);
    return im;
  }
};

inline kvgc_heap_options gc_options(kvgc_policy policy, uint64_t budget_tokens, uint32_t sinks = 4,
                             uint32_t window = 8, uint32_t page_tokens = 8) {
  kvgc_heap_options o = cpu_options(8 << 20, page_tokens);
  o.policy = policy;
  o.token_budget = budget_tokens;
  o.sinks = sinks;
  o.window = window;
  return o;
}

inline double weight(int32_t pos) { return double(mix(uint64_t(pos) * 7919) % 1000) / 1000.0; }


}  // namespace kvgc_test
