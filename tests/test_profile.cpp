// Entropy profiles and the weighted budget split: a weight a float cannot hold must be
// refused where it is read (file and line named), and the split must stay exact and
// defined whatever weights reach it.
#include <doctest/doctest.h>

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <limits>
#include <numeric>
#include <string>

#include "../gc/layer_budget.hpp"
#include "../runtime/options.hpp"
#include "util.hpp"

using namespace kvgc_test;

TEST_CASE("layer profile: values a float cannot hold are refused with the file and line") {
  std::vector<float> w;
  // 1e39 became inf and 1e-50 became 0 after the double was checked: the split then
  // computed inf/inf (NaN, cast to an integer) and one layer kept every token.
  for (const char* bad : {"1e39", "1e-50", "1e-40", "inf", "-inf", "nan", "0", "-1", "0x1p200",
                          "3.5e38"}) {
    CAPTURE(bad);
    const std::string text = std::string("1.0\n") + bad + "  # layer 1\n1.0\n";
    const kvgc::Status st = kvgc::parse_layer_profile(text, "prof.txt", 3, "KVGC_LAYER_BUDGET", &w);
    CHECK(st.code == KVGC_EINVAL);
    CHECK(st.msg.find("KVGC_LAYER_BUDGET: prof.txt:2: ") == 0);
  }
  CHECK(kvgc::parse_layer_profile("1\n2\n3\n4\n", "p", 3, "X", &w).msg.find("more than 3") !=
        std::string::npos);
  CHECK(kvgc::parse_layer_profile("1\n2\n", "p", 3, "X", &w).msg.find("has 2 layer weights") !=
        std::string::npos);
  CHECK(kvgc::parse_layer_profile(std::string(100000, 'x'), "p", 3, "X", &w).msg.size() < 200);
  // Comments, blank lines, CRLF and the extremes a float does hold are accepted.
  REQUIRE(kvgc::parse_layer_profile("# c\r\n1e-37\r\n\n  3e38 # top\n2\n", "p", 3, "X", &w).ok());
  CHECK(w == std::vector<float>{1e-37f, 3e38f, 2.f});
}

TEST_CASE("layer profile: a file far larger than a profile is refused without reading it") {
  const std::string path = "/tmp/kvgc-test-bigprofile-" + std::to_string(::getpid());
  FILE* f = std::fopen(path.c_str(), "w");
  REQUIRE(f);
  for (int i = 0; i < 100000; ++i) std::fputs("1.0\n", f);
  std::fclose(f);
  std::vector<float> w;
  const kvgc::Status st = kvgc::read_layer_profile(path, 3, "KVGC_LAYER_BUDGET", &w);
  std::remove(path.c_str());
  CHECK(st.code == KVGC_EINVAL);
  CHECK(st.msg.find("is larger than") != std::string::npos);
  CHECK(kvgc::read_layer_profile("/dev/zero", 3, "X", &w).code == KVGC_EINVAL);
  CHECK(kvgc::read_layer_profile("/", 3, "X", &w).code == KVGC_EINVAL);
}

TEST_CASE("split_by_weights: exact and defined whatever the weights") {
  const float inf = std::numeric_limits<float>::infinity(), nan = std::nanf("");
  const float cases[][4] = {{1, inf, 1, 1}, {inf, inf, inf, inf}, {nan, 1, 2, 3},
                            {0, 0, 0, 0},   {-1, 1, 1, 1},        {3e38f, 3e38f, 3e38f, 1e-45f}};
  for (const auto& w : cases) {
    for (uint64_t floor : {0ull, 10ull, 68ull}) {
      const auto b = kvgc::split_by_weights(w, 4, 100, floor);
      CHECK(std::accumulate(b.begin(), b.end(), uint64_t(0)) == 400);
      for (uint64_t x : b) {
        CHECK(x >= std::min<uint64_t>(floor, 100));
        CHECK(x <= 400);
      }
    }
  }
  // The unusable weight counts as 0: with {1, inf, 1, 1} layer 1 keeps only its floor.
  const auto b = kvgc::split_by_weights(cases[0], 4, 100, 10);
  CHECK(b[1] == 10);
  CHECK(b[0] == b[2]);
}

TEST_CASE("entropy profile through the environment: an overflowing weight fails heap creation") {
  const kvgc_model_desc m = model(3, 2, 32);
  const std::string path = "/tmp/kvgc-test-profile-inf-" + std::to_string(::getpid());
  FILE* f = std::fopen(path.c_str(), "w");
  REQUIRE(f);
  std::fputs("1.0\n1e39\n1.0\n", f);
  std::fclose(f);
  kvgc_heap_options o = cpu_options(1 << 20, 8);
  o.flags = 0;
  setenv("KVGC_LAYER_BUDGET", ("entropy:" + path).c_str(), 1);
  kvgc_heap* h = reinterpret_cast<kvgc_heap*>(&o);  // any non-NULL value
  CHECK(kvgc_heap_create(&m, &o, &h) == KVGC_EINVAL);
  CHECK(h == nullptr);  // kvgc.h: a failed create sets *heap_out to NULL
  const std::string msg = kvgc_errmsg(nullptr);
  CHECK(msg.find(path + ":2: '1e39'") != std::string::npos);
  unsetenv("KVGC_LAYER_BUDGET");
  std::remove(path.c_str());
}
