// Contract points an outside C client found loose (kvgc.h states each): observe's and
// attention's treatment of NaN, negative and infinite mass, a failed create's
// out-parameter, what free_bytes counts, and the error slot's bound.
#include <doctest/doctest.h>

#include <cfloat>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>

#include "../kernels/cpu/convert.hpp"
#include "util.hpp"

using namespace kvgc_test;

namespace {

std::vector<float> scores(kvgc_heap* h, kvgc_seq s, uint32_t layer) {
  uint64_t n = 0;
  REQUIRE(kvgc_read_scores(h, s, layer, nullptr, nullptr, 0, &n, nullptr) == KVGC_OK);
  std::vector<float> out(n);
  REQUIRE(kvgc_read_scores(h, s, layer, out.data(), nullptr, n, &n, nullptr) == KVGC_OK);
  return out;
}

}  // namespace

TEST_CASE("observe: NaN, negative and infinite mass add nothing; scores saturate at FLT_MAX") {
  const kvgc_model_desc m = model(1, 1, 32);
  kvgc_heap_options o = cpu_options(1 << 20, 8);
  o.policy = KVGC_POLICY_FULL;
  kvgc_heap* h = nullptr;
  REQUIRE(kvgc_heap_create(&m, &o, &h) == KVGC_OK);
  kvgc_seq s;
  REQUIRE(kvgc_seq_create(h, 0, &s) == KVGC_OK);
  const auto k = gaussian(m, s, 0, 0, 8, false), v = gaussian(m, s, 0, 0, 8, true);
  REQUIRE(kvgc_append(h, s, 0, k.data(), v.data(), 8, nullptr) == KVGC_OK);
  const float inf = std::numeric_limits<float>::infinity();
  const float first[8] = {std::nanf(""), -5.f, inf, -inf, 0.f, -0.f, 0.5f, FLT_MAX};
  REQUIRE(kvgc_observe(h, s, 0, first, 8, nullptr) == KVGC_OK);
  const float second[8] = {1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 0.25f, FLT_MAX};
  REQUIRE(kvgc_observe(h, s, 0, second, 8, nullptr) == KVGC_OK);
  const std::vector<float> got = scores(h, s, 0);
  REQUIRE(got.size() == 8);
  // The bad values were ignored; the good ones after them still accumulate.
  for (int i = 0; i < 6; ++i) CHECK(got[i] == 1.f);
  CHECK(got[6] == 0.75f);
  CHECK(got[7] == FLT_MAX);  // FLT_MAX + FLT_MAX saturates instead of becoming inf
  for (float x : got) CHECK((std::isfinite(x) && x >= 0));
  CHECK(kvgc_heap_check(h) == KVGC_OK);
  kvgc_heap_destroy(h);
}

TEST_CASE("attend's fused mass follows observe's rule: NaN K/V leave scores finite") {
  const kvgc_model_desc m = model(1, 1, 32);
  kvgc_heap_options o = cpu_options(1 << 20, 8);
  o.policy = KVGC_POLICY_FULL;
  kvgc_heap* h = nullptr;
  REQUIRE(kvgc_heap_create(&m, &o, &h) == KVGC_OK);
  kvgc_seq s;
  REQUIRE(kvgc_seq_create(h, 0, &s) == KVGC_OK);
  auto k = gaussian(m, s, 0, 0, 6, false);
  const auto v = gaussian(m, s, 0, 0, 6, true);
  kvgc::cpu::store(&k[2 * 32 * 2], m.dtype, std::nanf(""));  // token 2's key: NaN logit
  REQUIRE(kvgc_append(h, s, 0, k.data(), v.data(), 6, nullptr) == KVGC_OK);
  std::vector<uint8_t> q(32 * 2), out(q.size());
  for (size_t i = 0; i < 32; ++i) kvgc::cpu::store(&q[i * 2], m.dtype, 0.5f);
  REQUIRE(kvgc_attend(h, s, 0, q.data(), 1, out.data(), nullptr, nullptr) == KVGC_OK);
  for (float x : scores(h, s, 0)) CHECK((std::isfinite(x) && x >= 0));
  kvgc_heap_destroy(h);
}

TEST_CASE("kvgc_heap_create: a failure sets *heap_out to NULL; a NULL heap_out is refused") {
  const kvgc_model_desc m = model(1, 1, 32);
  kvgc_heap_options o = cpu_options(1 << 20, 8);
  o.page_tokens = 0;  // invalid
  kvgc_heap* h = reinterpret_cast<kvgc_heap*>(&o);  // anything but NULL
  CHECK(kvgc_heap_create(&m, &o, &h) == KVGC_EINVAL);
  CHECK(h == nullptr);
  kvgc_heap_destroy(h);  // a no-op, as kvgc.h promises
  CHECK(kvgc_heap_create(&m, &o, nullptr) == KVGC_EINVAL);
  CHECK(std::string(kvgc_errmsg(nullptr)) == "kvgc_heap_create: heap_out is NULL");
}

TEST_CASE("stats: free_bytes is free slabs plus each class's free pages and slab tail waste") {
  // 16 slots, 2 heads x 40 dims: the page size does not divide the slab, so carved slabs
  // waste their tail.
  const kvgc_model_desc m = model(2, 2, 40);
  kvgc_heap_options o = cpu_options(2 << 20, 16);
  o.policy = KVGC_POLICY_FULL;
  kvgc_heap* h = nullptr;
  REQUIRE(kvgc_heap_create(&m, &o, &h) == KVGC_OK);
  kvgc_seq s;
  REQUIRE(kvgc_seq_create(h, 0, &s) == KVGC_OK);
  for (uint32_t layer = 0; layer < 2; ++layer) {
    const auto k = gaussian(m, s, layer, 0, 37, false), v = gaussian(m, s, layer, 0, 37, true);
    REQUIRE(kvgc_append(h, s, layer, k.data(), v.data(), 37, nullptr) == KVGC_OK);
  }
  kvgc_stats st;
  kvgc_stats_init(&st);
  REQUIRE(kvgc_get_stats(h, &st) == KVGC_OK);
  uint64_t used = 0, classes_free = 0, tail = 0;
  for (const kvgc_class_stats& c : st.cls) {
    used += c.used_bytes;
    classes_free += c.free_bytes;
    CHECK(c.free_bytes == c.reserved_bytes - c.used_bytes);
    CHECK(c.free_bytes >= c.pages_free * c.page_bytes);
    tail += c.free_bytes - c.pages_free * c.page_bytes;
  }
  CHECK(tail > 0);  // the case kvgc.h's old wording ("free slabs + free pages") missed
  CHECK(st.free_bytes == st.slabs_free * st.slab_bytes + classes_free);
  CHECK(st.arena_bytes - st.scratch_bytes - st.free_bytes == used);
  kvgc_heap_destroy(h);
}

TEST_CASE("errors: a message longer than the error slot is cut, never allocated") {
  const kvgc_model_desc m = model(1, 1, 32);
  kvgc_heap_options o = cpu_options(1 << 20, 8);
  o.flags = 0;
  const std::string path = "/nonexistent/" + std::string(3000, 'x');
  setenv("KVGC_LAYER_BUDGET", ("entropy:" + path).c_str(), 1);
  kvgc_heap* h = nullptr;
  CHECK(kvgc_heap_create(&m, &o, &h) == KVGC_EINVAL);
  unsetenv("KVGC_LAYER_BUDGET");
  const std::string msg = kvgc_errmsg(nullptr);
  CHECK(msg.size() == 1023);
  CHECK(msg.find("kvgc_heap_create: KVGC_LAYER_BUDGET: cannot read the layer profile '/nonexistent/xxx") == 0);
}
