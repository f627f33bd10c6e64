#include <doctest/doctest.h>

#include <numeric>

#include "../gc/layer_budget.hpp"

using kvgc::split_layer_budget;

TEST_CASE("uniform gives every layer the mean") {
  const auto b = split_layer_budget(KVGC_LAYER_BUDGET_UNIFORM, 30, 512);
  CHECK(b.size() == 30);
  for (uint64_t x : b) CHECK(x == 512);
}

TEST_CASE("pyramid: decreasing from the bottom, same total, exact") {
  for (uint32_t layers : {2u, 7u, 30u, 32u, 80u}) {
    for (uint64_t mean : {1ull, 17ull, 512ull, 100000ull}) {
      CAPTURE(layers);
      CAPTURE(mean);
      const auto b = split_layer_budget(KVGC_LAYER_BUDGET_PYRAMID, layers, mean);
      REQUIRE(b.size() == layers);
      CHECK(std::accumulate(b.begin(), b.end(), uint64_t(0)) == mean * layers);
      for (uint32_t l = 1; l < layers; ++l) CHECK(b[l] <= b[l - 1] + 1);  // rounding may tie
      if (mean >= 100) CHECK(b.front() > 3 * b.back());
    }
  }
  // PyramidKV with beta = 20: bottom 39/20 of the mean, top 1/20.
  const auto b = split_layer_budget(KVGC_LAYER_BUDGET_PYRAMID, 32, 2000);
  CHECK(b.front() == doctest::Approx(3900).epsilon(0.001));
  CHECK(b.back() == doctest::Approx(100).epsilon(0.01));
}

TEST_CASE("pyramid respects a per-layer floor and keeps the total") {
  const auto b = split_layer_budget(KVGC_LAYER_BUDGET_PYRAMID, 30, 100, 68);  // sinks+window
  CHECK(std::accumulate(b.begin(), b.end(), uint64_t(0)) == 3000);
  for (uint64_t x : b) CHECK(x >= 68);
  CHECK(b.front() > b.back());
  // A floor above the mean cannot be honoured for all layers: the total still wins.
  const auto c = split_layer_budget(KVGC_LAYER_BUDGET_PYRAMID, 4, 10, 50);
  CHECK(std::accumulate(c.begin(), c.end(), uint64_t(0)) == 40);
}

TEST_CASE("split_by_weights: proportional, exact total, floors respected") {
  const float w[] = {1.f, 3.f, 2.f, 2.f};
  auto b = kvgc::split_by_weights(w, 4, 100);
  CHECK(std::accumulate(b.begin(), b.end(), uint64_t(0)) == 400);
  CHECK(b[1] == 150);
  CHECK(b[0] == 50);
  CHECK(b[2] == b[3]);
  b = kvgc::split_by_weights(w, 4, 100, 60);  // each at least 60; the rest by weight
  CHECK(std::accumulate(b.begin(), b.end(), uint64_t(0)) == 400);
  for (uint64_t x : b) CHECK(x >= 60);
  CHECK(b[1] > b[2]);
  CHECK(b[2] > b[0]);
  const float equal[] = {5.f, 5.f, 5.f};
  b = kvgc::split_by_weights(equal, 3, 7);
  CHECK(std::accumulate(b.begin(), b.end(), uint64_t(0)) == 21);
  for (uint64_t x : b) CHECK(x == 7);
}
