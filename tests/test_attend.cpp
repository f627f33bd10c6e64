// kvgc_attend on the CPU backend against a naive float64 dense softmax over the live
// slots (read back through kvgc_read, so int8/int4 slots are compared dequantised), for random
// shapes: GQA ratios 1/3/8, page boundaries, dead slots, int8 and int4 pages, causal prefill
// chunks, queries that see nothing. Scores must grow by exactly the reference's mass.
#include <doctest/doctest.h>

#include <cmath>
#include <random>

#include "../kernels/cpu/attend.hpp"
#include "../kernels/cpu/convert.hpp"
#include "attend_reference.hpp"
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

struct Case {
  uint32_t kv_heads, gqa, head_dim, page_tokens;
  kvgc_dtype dtype;
  uint32_t tokens, n_q;
  bool evict;
  kvgc_demote demote;
};

void run_case(const Case& c, std::mt19937& rng) {
  CAPTURE(c.kv_heads);
  CAPTURE(c.gqa);
  CAPTURE(c.head_dim);
  CAPTURE(c.page_tokens);
  CAPTURE(c.dtype);
  CAPTURE(c.tokens);
  CAPTURE(c.n_q);
  CAPTURE(c.evict);
  CAPTURE(c.demote);
  const kvgc_model_desc m = model(1, c.kv_heads, c.head_dim, c.dtype, c.gqa);
  kvgc_heap_options o = cpu_options(32 << 20, c.page_tokens);
  o.policy = KVGC_POLICY_H2O;
  o.sinks = 2;
  o.window = 4;
  // An eighth of the tokens' units: below what int4 alone meets, so the int2 rung is taken.
  if (c.evict) o.token_budget = c.demote == KVGC_DEMOTE_LADDER_INT2 ? c.tokens / 8 : c.tokens / 2;
  o.demote = c.demote;
  kvgc_heap* h = nullptr;
  REQUIRE(kvgc_heap_create(&m, &o, &h) == KVGC_OK);
  kvgc_seq s;
  REQUIRE(kvgc_seq_create(h, 0, &s) == KVGC_OK);
  const uint32_t first = c.tokens - c.n_q;  // the cache, then the query chunk's own tokens
  for (uint32_t at = 0; at < first;) {
    const uint32_t n = std::min<uint32_t>(first - at, 1 + rng() % 50);
    const auto k = gaussian(m, s, 0, at, n, false), v = gaussian(m, s, 0, at, n, true);
    REQUIRE(kvgc_append(h, s, 0, k.data(), v.data(), n, nullptr) == KVGC_OK);
    at += n;
    if (c.evict) {  // scores from a previous "step", then the GC: dead slots, int4 pages
      uint64_t live = 0;
      kvgc_seq_tokens(h, s, 0, &live, nullptr);
      std::vector<float> mass(live);
      for (auto& x : mass) x = float(rng() % 1000) / 1000.f;
      REQUIRE(kvgc_observe(h, s, 0, mass.data(), live, nullptr) == KVGC_OK);
      const kvgc_status st = kvgc_step(h, s, nullptr);
      REQUIRE((st == KVGC_OK || st == KVGC_EBUDGET));
    }
  }
  const auto k = gaussian(m, s, 0, first, c.n_q, false), v = gaussian(m, s, 0, first, c.n_q, true);
  REQUIRE(kvgc_append(h, s, 0, k.data(), v.data(), c.n_q, nullptr) == KVGC_OK);

  const size_t eb = elem_bytes(m);
  std::vector<uint8_t> q(size_t(c.n_q) * m.n_q_heads * c.head_dim * eb);
  std::normal_distribution<float> gauss(0.f, 1.f);
  for (size_t i = 0; i < q.size() / eb; ++i) kvgc::cpu::store(&q[i * eb], m.dtype, 2.0f * gauss(rng));
  const double scale = 1.0 / std::sqrt(double(c.head_dim));
  const Reference ref = reference(h, m, s, 0, q, c.n_q, scale);
  const auto before = scores(h, s, 0);
  std::vector<uint8_t> out(q.size(), 0xA5);  // poisoned
  REQUIRE(kvgc_attend(h, s, 0, q.data(), c.n_q, out.data(), nullptr, nullptr) == KVGC_OK);
  const auto after = scores(h, s, 0);
  REQUIRE(after.size() == ref.mass.size());
  std::vector<float> got = to_float(out, m.dtype), delta(after.size());
  for (size_t i = 0; i < after.size(); ++i) delta[i] = after[i] - before[i];
  const double bound = kvgc_test::output_bound(m.dtype);
  const double e_out = rel_err(ref.out, got), e_mass = rel_err(ref.mass, delta);
  CHECK(e_out <= bound);
  // Mass is f32 either way: the bound of the inputs' precision holds for it too, and the
  // accumulated score adds the f32 rounding of the previous score.
  CHECK(e_mass <= bound);
  double total = 0;
  for (double x : ref.mass) total += x;
  CHECK(total <= double(c.n_q) * m.n_q_heads + 1e-6);
  REQUIRE(kvgc_heap_check(h) == KVGC_OK);
  kvgc_heap_destroy(h);
}

}  // namespace

TEST_CASE("attend equals a float64 dense reference: random shapes, GQA, dead, int8, int4 and int2 slots") {
  const uint32_t seed = kvgc_test::fresh_seed("test_attend");
  std::mt19937 rng(seed);
  constexpr kvgc_demote kOff = KVGC_DEMOTE_OFF, kInt4 = KVGC_DEMOTE_INT4, kInt8 = KVGC_DEMOTE_INT8,
                        kLadder = KVGC_DEMOTE_LADDER, kLadder2 = KVGC_DEMOTE_LADDER_INT2;
  const Case cases[] = {
      {2, 1, 64, 16, KVGC_DTYPE_F32, 100, 1, false, kOff},   // MHA, decode
      {1, 3, 64, 16, KVGC_DTYPE_F32, 257, 1, false, kOff},   // GQA 3, page boundary + 1
      {2, 8, 128, 16, KVGC_DTYPE_F32, 300, 7, false, kOff},  // GQA 8, causal chunk
      {2, 4, 128, 5, KVGC_DTYPE_F16, 333, 1, true, kOff},    // dead slots
      {3, 3, 64, 16, KVGC_DTYPE_F16, 400, 16, true, kInt4},  // int4 pages, chunk
      {1, 8, 64, 16, KVGC_DTYPE_BF16, 200, 3, true, kInt4},
      {2, 4, 128, 16, KVGC_DTYPE_F16, 300, 1, true, kInt4},  // int4, GQA 4 decode (grouped K)
      {4, 3, 128, 8, KVGC_DTYPE_BF16, 250, 2, true, kInt4},  // int4, 6 rows: groups + rest
      {1, 2, 96, 16, KVGC_DTYPE_F32, 180, 1, true, kInt4},   // int4, f32 model
      {3, 3, 64, 16, KVGC_DTYPE_F16, 400, 16, true, kInt8},  // int8 pages, chunk
      {2, 4, 128, 16, KVGC_DTYPE_F16, 300, 1, true, kInt8},  // int8, GQA 4 decode (grouped K)
      {4, 3, 128, 8, KVGC_DTYPE_BF16, 250, 2, true, kInt8},  // int8 bf16: element-wise path
      {1, 2, 96, 16, KVGC_DTYPE_F32, 180, 3, true, kInt8},   // int8, f32 model
      {2, 4, 64, 16, KVGC_DTYPE_F16, 500, 1, true, kLadder}, // all three classes
      {1, 3, 128, 8, KVGC_DTYPE_BF16, 300, 5, true, kLadder},
      {2, 4, 64, 16, KVGC_DTYPE_F16, 500, 1, true, kLadder2},  // int2 pages too (0.10)
      {1, 3, 128, 8, KVGC_DTYPE_BF16, 400, 5, true, kLadder2},
      {2, 1, 6, 7, KVGC_DTYPE_F32, 64, 64, false, kOff},     // prefill from empty, tiny head
      {4, 2, 256, 32, KVGC_DTYPE_F16, 150, 2, false, kOff},  // head_dim 256
      {1, 1, 64, 16, KVGC_DTYPE_F32, 1, 1, false, kOff},     // one token
  };
  for (int level : {2, 1, 0}) {  // AVX-512, AVX2, portable (clamped to what the CPU has)
    kvgc::cpu::set_simd_level(level);
    CAPTURE(std::string(kvgc::cpu::simd_name()));
    for (const Case& c : cases) run_case(c, rng);
  }
  kvgc::cpu::set_simd(true);
}

TEST_CASE("a query that sees no live token gets zeros, and no score moves") {
  const kvgc_model_desc m = model(1, 1, 64, KVGC_DTYPE_F32);
  kvgc_heap_options o = cpu_options(8 << 20, 16);
  o.policy = KVGC_POLICY_STREAMING;
  o.sinks = 0;
  o.window = 0;
  o.token_budget = 1;
  kvgc_heap* h = nullptr;
  REQUIRE(kvgc_heap_create(&m, &o, &h) == KVGC_OK);
  kvgc_seq s;
  REQUIRE(kvgc_seq_create(h, 0, &s) == KVGC_OK);
  const auto k = gaussian(m, s, 0, 0, 10, false), v = gaussian(m, s, 0, 0, 10, true);
  REQUIRE(kvgc_append(h, s, 0, k.data(), v.data(), 10, nullptr) == KVGC_OK);
  REQUIRE(kvgc_step(h, s, nullptr) == KVGC_OK);  // keeps only position 9
  std::vector<float> q(3 * 64, 1.f), out(3 * 64, 7.f);
  // Queries at positions 7, 8, 9: only the last sees position 9.
  REQUIRE(kvgc_attend(h, s, 0, q.data(), 3, out.data(), nullptr, nullptr) == KVGC_OK);
  for (int i = 0; i < 128; ++i) REQUIRE(out[i] == 0.f);
  const auto vf = gaussian(m, s, 0, 9, 1, true);
  CHECK(std::memcmp(&out[128], vf.data(), 64 * 4) == 0);  // one visible token: its V
  CHECK(scores(h, s, 0)[0] == doctest::Approx(1.0));
  kvgc_heap_destroy(h);
}

TEST_CASE("attend: scale, no-scores flag, and bad input") {
  const kvgc_model_desc m = model(2, 2, 64, KVGC_DTYPE_F32, 2);
  const kvgc_heap_options o = cpu_options(8 << 20, 16);
  kvgc_heap* h = nullptr;
  REQUIRE(kvgc_heap_create(&m, &o, &h) == KVGC_OK);
  kvgc_seq s;
  REQUIRE(kvgc_seq_create(h, 0, &s) == KVGC_OK);
  const auto k = gaussian(m, s, 1, 0, 40, false), v = gaussian(m, s, 1, 0, 40, true);
  REQUIRE(kvgc_append(h, s, 1, k.data(), v.data(), 40, nullptr) == KVGC_OK);
  std::vector<float> q(4 * 64, 0.5f), a(4 * 64), b(4 * 64);
  kvgc_attend_params p;
  REQUIRE(kvgc_attend_params_init(&p) == KVGC_OK);
  p.flags = KVGC_ATTEND_NO_SCORES;
  REQUIRE(kvgc_attend(h, s, 1, q.data(), 1, a.data(), &p, nullptr) == KVGC_OK);
  for (float x : scores(h, s, 1)) CHECK(x == 0.f);
  p.scale = 0.01f;  // a different scale gives a different (flatter) result
  REQUIRE(kvgc_attend(h, s, 1, q.data(), 1, b.data(), &p, nullptr) == KVGC_OK);
  CHECK(a != b);
  REQUIRE(kvgc_attend(h, s, 1, q.data(), 1, a.data(), nullptr, nullptr) == KVGC_OK);
  double total = 0;
  for (float x : scores(h, s, 1)) total += x;
  CHECK(total == doctest::Approx(4.0));  // 4 query heads, one query: mass 1 each

  CHECK(kvgc_attend(h, s, 0, q.data(), 1, a.data(), nullptr, nullptr) == KVGC_EINVAL);  // empty
  CHECK(std::string(kvgc_errmsg(h)).find("n_q 1") != std::string::npos);
  CHECK(kvgc_attend(h, s, 1, q.data(), 41, a.data(), nullptr, nullptr) == KVGC_EINVAL);
  CHECK(kvgc_attend(h, s, 1, q.data(), 0, a.data(), nullptr, nullptr) == KVGC_EINVAL);
  CHECK(kvgc_attend(h, s, 1, nullptr, 1, a.data(), nullptr, nullptr) == KVGC_EINVAL);
  CHECK(kvgc_attend(h, s, 1, q.data(), 1, nullptr, nullptr, nullptr) == KVGC_EINVAL);
  CHECK(kvgc_attend(h, s, 2, q.data(), 1, a.data(), nullptr, nullptr) == KVGC_EINVAL);
  CHECK(kvgc_attend(h, s + 9, 1, q.data(), 1, a.data(), nullptr, nullptr) == KVGC_ENOTFOUND);
  p.scale = -1.f;
  CHECK(kvgc_attend(h, s, 1, q.data(), 1, a.data(), &p, nullptr) == KVGC_EINVAL);
  CHECK(std::string(kvgc_errmsg(h)).find("params->scale") != std::string::npos);
  p.scale = 0;
  p.struct_size = 3;
  CHECK(kvgc_attend(h, s, 1, q.data(), 1, a.data(), &p, nullptr) == KVGC_EINVAL);
  REQUIRE(kvgc_heap_check(h) == KVGC_OK);
  kvgc_heap_destroy(h);
}
