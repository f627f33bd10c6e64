// The GC's host-side planning (gc/) and the data-plane's numeric helpers, without a heap.
#include <doctest/doctest.h>

#include <array>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "../gc/compaction.hpp"
#include "../gc/ladder.hpp"
#include "../gc/plan.hpp"
#include "../kernels/cpu/convert.hpp"
#include "../kernels/cpu/quant.hpp"

using namespace kvgc;

namespace {

PolicyParams params(kvgc_policy p) {
  PolicyParams q;
  q.policy = p;
  q.sinks = 4;
  q.window = 16;
  q.page_tokens = 8;
  return q;
}

SegmentView view(uint64_t length, uint64_t budget) {
  SegmentView v;
  v.length = length;
  v.live[KVGC_CLASS_FP16] = length;
  v.tier[kGenSink] = std::min<uint64_t>(4, length);
  v.tier[kGenYoung] = length - v.tier[kGenSink];
  v.budget = budget;
  return v;
}

}  // namespace

TEST_CASE("full never plans a collection") {
  const GcPlan g = plan_gc(params(KVGC_POLICY_FULL), view(1000, 10));
  CHECK_FALSE(g.run);
}

TEST_CASE("flat policies collect exactly when over budget, ranking every unprotected tier") {
  for (kvgc_policy p : {KVGC_POLICY_H2O, KVGC_POLICY_STREAMING, KVGC_POLICY_RANDOM}) {
    CAPTURE(p);
    CHECK_FALSE(plan_gc(params(p), view(100, 100)).run);
    CHECK_FALSE(plan_gc(params(p), view(100, kNoBudget)).run);
    const GcPlan g = plan_gc(params(p), view(101, 100));
    CHECK(g.run);
    CHECK(g.reclaim == 1);
    CHECK(g.candidates == (gen_bit(kGenIntermediate) | gen_bit(kGenLongTerm)));
    CHECK(g.tenure_before == 101 - 16);
    CHECK(g.promote == 0);
  }
  CHECK(plan_gc(params(KVGC_POLICY_STREAMING), view(101, 100)).key == KeyKind::Position);
  CHECK(plan_gc(params(KVGC_POLICY_RANDOM), view(101, 100)).key == KeyKind::Random);
  CHECK(plan_gc(params(KVGC_POLICY_H2O), view(101, 100)).key == KeyKind::Score);
}

TEST_CASE("generational: a minor GC per page of new tokens, ranking the intermediate tier only") {
  const PolicyParams p = params(KVGC_POLICY_GENERATIONAL);
  SegmentView v = view(200, 100);
  v.tier[kGenYoung] = 16;
  v.tier[kGenIntermediate] = 80;
  v.live[KVGC_CLASS_FP16] = 100;
  v.since_minor = 7;
  CHECK_FALSE(plan_gc(p, v).run);  // not a page of new tokens yet
  v.since_minor = 8;
  v.live[KVGC_CLASS_FP16] = 101;
  GcPlan g = plan_gc(p, v);
  CHECK(g.run);
  CHECK_FALSE(g.major);
  CHECK(g.candidates == gen_bit(kGenIntermediate));
  CHECK(g.age_intermediate);
  CHECK(g.reclaim == 1);
  // Long-term has room (cap = budget - protected - intermediate share): promote into it.
  CHECK(g.promote == 100 - 20 - intermediate_target(p, 100));
  // The intermediate tier cannot absorb the reclaim: a major GC ranks long-term too.
  v.tier[kGenIntermediate] = 0;
  v.tier[kGenLongTerm] = 80;
  v.live[KVGC_CLASS_FP16] = 150;
  g = plan_gc(p, v);
  CHECK(g.major);
  CHECK(g.candidates == (gen_bit(kGenIntermediate) | gen_bit(kGenLongTerm)));
  CHECK(g.retier);
  // Long-term full with heavy hitters waiting: a refresh, at most once per 8 minors.
  v = view(200, 100);
  v.since_minor = 8;
  v.tier[kGenLongTerm] = 60;
  v.tier[kGenIntermediate] = 20;
  v.live[KVGC_CLASS_FP16] = 100;
  v.promote_blocked = true;
  v.minors_since_major = 3;
  CHECK_FALSE(plan_gc(p, v).major);
  v.minors_since_major = kMajorEveryMinors - 1;
  CHECK(plan_gc(p, v).major);
}

TEST_CASE("budgets count int8 and int4 tokens at their byte share") {
  PolicyParams p = params(KVGC_POLICY_H2O);
  p.unit_cost[KVGC_CLASS_FP16] = 8;  // an int8 token costs half an fp16 one, int4 a quarter
  p.unit_cost[KVGC_CLASS_INT8] = 4;
  p.unit_cost[KVGC_CLASS_INT4] = 2;
  SegmentView v = view(100, 100 * 8);
  v.live[KVGC_CLASS_FP16] = 70;
  v.live[KVGC_CLASS_INT8] = 10;
  v.live[KVGC_CLASS_INT4] = 40;  // 560 + 40 + 80 = 680 units
  CHECK(segment_cost(p, v) == 680);
  CHECK_FALSE(plan_gc(p, v).run);
  v.live[KVGC_CLASS_INT4] = 100;  // 800 units: at the budget
  CHECK_FALSE(plan_gc(p, v).run);
  v.live[KVGC_CLASS_INT4] = 101;
  CHECK(plan_gc(p, v).reclaim == 2);
  // Within its units, a segment whose pages exceed its byte budget still collects.
  v.live[KVGC_CLASS_INT4] = 40;
  v.bytes_over = true;
  const GcPlan g = plan_gc(p, v);
  CHECK(g.run);
  CHECK(g.reclaim == 0);
}

TEST_CASE("compaction plan: tail pages empty into the front pages' holes") {
  // 4 pages of 8: holes in pages 0 and 1, live slots in the tail.
  host::vector<PageCounts> pages = {{8, 5}, {8, 6}, {8, 2}, {3, 3}};
  const CompactionPlan plan = plan_compaction(pages, 8);
  REQUIRE(plan.moves.size() >= 2);
  CHECK(plan.moves[0].dst == 0);
  CHECK(plan.moves[0].src == 3);
  uint32_t total = 0;
  for (const PageCounts& p : pages) total += p.live;
  CHECK(total == 16);  // nothing lost
  CHECK(plan.freed == host::vector<uint32_t>{2, 3});
  CHECK(pages[0].live == 8);
  CHECK(pages[1].live == 8);
  CHECK(plan.slots_moved == 5);
}

TEST_CASE("compaction plan: edge cases (empty, all live, nothing movable)") {
  host::vector<PageCounts> none;
  CHECK(plan_compaction(none, 8).moves.empty());
  host::vector<PageCounts> full = {{8, 8}, {8, 8}, {4, 4}};
  CHECK(plan_compaction(full, 8).moves.empty());
  host::vector<PageCounts> one = {{8, 1}};
  CHECK(plan_compaction(one, 8).moves.empty());
  host::vector<PageCounts> tail_holes = {{8, 8}, {8, 1}};  // the only holes are in the source
  const CompactionPlan p = plan_compaction(tail_holes, 8);
  CHECK(p.moves.empty());
  CHECK(p.freed.empty());
}

TEST_CASE("f16 conversion round-trips every finite half and rounds to nearest even") {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    if ((h & 0x7c00) == 0x7c00 && (h & 0x3ff)) continue;  // NaN payloads
    CAPTURE(h);
    REQUIRE(cpu::f32_to_f16(cpu::f16_to_f32(uint16_t(h))) == h);
  }
  CHECK(cpu::f32_to_f16(65520.f) == 0x7c00);           // rounds to inf
  CHECK(cpu::f32_to_f16(1.0f + 1.0f / 2048) == 0x3c00);  // tie to even
  CHECK(std::isnan(cpu::f16_to_f32(cpu::f32_to_f16(NAN))));
  CHECK(cpu::bf16_to_f32(cpu::f32_to_bf16(3.140625f)) == 3.140625f);
}

TEST_CASE("int4 quantisation: relative RMSE per vector on Gaussian data within 0.12") {
  std::mt19937 rng(11);
  std::normal_distribution<float> gauss(0.f, 1.f);
  for (kvgc_dtype dt : {KVGC_DTYPE_F16, KVGC_DTYPE_BF16, KVGC_DTYPE_F32}) {
    for (uint32_t hd : {64u, 128u, 96u, 6u}) {
      CAPTURE(dt);
      CAPTURE(hd);
      const uint32_t eb = dt == KVGC_DTYPE_F32 ? 4 : 2;
      const uint32_t groups = hd / int4_group(hd);
      double worst = 0, sum = 0;
      const int vectors = 2000;
      for (int n = 0; n < vectors; ++n) {
        const float scale = std::exp(gauss(rng));  // vectors of very different magnitude
        std::vector<uint8_t> src(hd * eb), back(hd * eb), nib(hd / 2);
        std::vector<uint16_t> qp(2 * groups);
        for (uint32_t i = 0; i < hd; ++i) cpu::store(&src[i * eb], dt, gauss(rng) * scale);
        cpu::quantize_row(src.data(), dt, hd, nib.data(), qp.data());
        cpu::dequantize_row(nib.data(), qp.data(), dt, hd, back.data());
        double err = 0, ref = 0;
        for (uint32_t i = 0; i < hd; ++i) {
          const double x = cpu::load(&src[i * eb], dt), y = cpu::load(&back[i * eb], dt);
          err += (x - y) * (x - y);
          ref += x * x;
        }
        const double rel = std::sqrt(err / ref);
        worst = std::max(worst, rel);
        sum += rel;
      }
      MESSAGE("int4 relative RMSE, dtype " << dt << " head_dim " << hd << ": mean "
                                           << sum / vectors << ", worst " << worst);
      if (hd >= 32) CHECK(sum / vectors <= 0.12);
      if (hd >= 32) CHECK(worst <= 0.2);
    }
  }
}

TEST_CASE("int4 quantisation edge cases: constant, extreme and non-finite values") {
  const uint32_t hd = 32;
  std::vector<uint8_t> src(hd * 2), back(hd * 2), nib(hd / 2);
  std::vector<uint16_t> qp(2);
  for (uint32_t i = 0; i < hd; ++i) cpu::store(&src[i * 2], KVGC_DTYPE_F16, 3.5f);
  cpu::quantize_row(src.data(), KVGC_DTYPE_F16, hd, nib.data(), qp.data());
  cpu::dequantize_row(nib.data(), qp.data(), KVGC_DTYPE_F16, hd, back.data());
  CHECK(back == src);  // a constant group is exact
  // bf16 values beyond f16's range keep their magnitude (bf16 scale/zero).
  for (uint32_t i = 0; i < hd; ++i) cpu::store(&src[i * 2], KVGC_DTYPE_BF16, i % 2 ? 1e30f : -1e30f);
  cpu::quantize_row(src.data(), KVGC_DTYPE_BF16, hd, nib.data(), qp.data());
  cpu::dequantize_row(nib.data(), qp.data(), KVGC_DTYPE_BF16, hd, back.data());
  for (uint32_t i = 0; i < hd; ++i)
    CHECK(cpu::load(&back[i * 2], KVGC_DTYPE_BF16) == doctest::Approx(i % 2 ? 1e30 : -1e30).epsilon(0.02));
  // NaN and inf do not poison the finite values of the group.
  for (uint32_t i = 0; i < hd; ++i) cpu::store(&src[i * 2], KVGC_DTYPE_F16, float(i) / 8);
  cpu::store(&src[0], KVGC_DTYPE_F16, NAN);
  cpu::store(&src[2], KVGC_DTYPE_F16, INFINITY);
  cpu::quantize_row(src.data(), KVGC_DTYPE_F16, hd, nib.data(), qp.data());
  cpu::dequantize_row(nib.data(), qp.data(), KVGC_DTYPE_F16, hd, back.data());
  for (uint32_t i = 2; i < hd; ++i)
    CHECK(cpu::load(&back[i * 2], KVGC_DTYPE_F16) == doctest::Approx(float(i) / 8).epsilon(0.1).scale(1));
}

namespace {

// Mean and worst relative RMS error per head row over Gaussian rows of varied magnitude.
template <class Quant>
std::pair<double, double> row_error(kvgc_dtype dt, uint32_t hd, Quant&& roundtrip) {
  std::mt19937 rng(17 + hd);
  std::normal_distribution<float> gauss(0.f, 1.f);
  const uint32_t eb = dt == KVGC_DTYPE_F32 ? 4 : 2;
  double worst = 0, sum = 0;
  const int vectors = 2000;
  std::vector<uint8_t> src(hd * eb), back(hd * eb);
  for (int n = 0; n < vectors; ++n) {
    const float scale = std::exp(gauss(rng));
    for (uint32_t i = 0; i < hd; ++i) cpu::store(&src[i * eb], dt, gauss(rng) * scale);
    roundtrip(src.data(), back.data());
    double err = 0, ref = 0;
    for (uint32_t i = 0; i < hd; ++i) {
      const double x = cpu::load(&src[i * eb], dt), y = cpu::load(&back[i * eb], dt);
      err += (x - y) * (x - y);
      ref += x * x;
    }
    worst = std::max(worst, std::sqrt(err / ref));
    sum += std::sqrt(err / ref);
  }
  return {sum / vectors, worst};
}

}  // namespace

TEST_CASE("int8 quantisation: per-row error bound, and the ladder's error constants match") {
  for (kvgc_dtype dt : {KVGC_DTYPE_F16, KVGC_DTYPE_BF16, KVGC_DTYPE_F32})
    for (uint32_t hd : {64u, 128u, 96u, 6u}) {
      CAPTURE(dt);
      CAPTURE(hd);
      const uint32_t eb = dt == KVGC_DTYPE_F32 ? 4 : 2;
      std::vector<int8_t> q(hd);
      uint16_t scale = 0;
      // Every element within half a step (plus the model dtype's rounding of x').
      auto roundtrip = [&](const uint8_t* src, uint8_t* back) {
        cpu::quantize_row_int8(src, dt, hd, q.data(), &scale);
        cpu::dequantize_row_int8(q.data(), &scale, dt, hd, back);
        const float step = cpu::int8_scale_f32(scale, dt);
        float amax = 0;
        for (uint32_t i = 0; i < hd; ++i) amax = std::max(amax, std::fabs(cpu::load(src + i * eb, dt)));
        REQUIRE(step * 127 >= amax);  // the scale was rounded up: nothing clipped
        REQUIRE(step <= amax / 127 * 1.01f + 1e-30f);
        for (uint32_t i = 0; i < hd; ++i) {
          const float x = cpu::load(src + i * eb, dt), y = cpu::load(back + i * eb, dt);
          REQUIRE(std::fabs(x - y) <= step / 2 + std::fabs(x) * (dt == KVGC_DTYPE_BF16 ? 8e-3f : 1e-3f));
        }
      };
      const auto [mean, worst] = row_error(dt, hd, roundtrip);
      MESSAGE("int8 relative RMSE, dtype " << dt << " head_dim " << hd << ": mean " << mean
                                           << ", worst " << worst);
      if (hd >= 32 && dt != KVGC_DTYPE_BF16) {  // bf16's own rounding (2^-9) dominates int8's
        CHECK(mean == doctest::Approx(kInt8Error).epsilon(0.3));
        CHECK(worst <= 2.5 * kInt8Error);
      }
    }
  // The int4 constant too (the ladder's exchange rates come from these two).
  std::vector<uint8_t> nib(32);
  std::vector<uint16_t> qp(8);
  const auto [mean4, worst4] = row_error(KVGC_DTYPE_F16, 64, [&](const uint8_t* src, uint8_t* back) {
    cpu::quantize_row(src, KVGC_DTYPE_F16, 64, nib.data(), qp.data());
    cpu::dequantize_row(nib.data(), qp.data(), KVGC_DTYPE_F16, 64, back);
  });
  CHECK(mean4 == doctest::Approx(kInt4Error).epsilon(0.3));
  CHECK(worst4 < 0.2);
}

TEST_CASE("int2 quantisation: within half a step, the ladder's error constant, edge cases") {
  // The int4 code with 2 bits: four levels per group of 32 (or the whole row), codes
  // packed four a byte, lowest bits first; head_dim 6 and 10 leave a partial last byte.
  for (kvgc_dtype dt : {KVGC_DTYPE_F16, KVGC_DTYPE_BF16, KVGC_DTYPE_F32})
    for (uint32_t hd : {64u, 128u, 96u, 6u, 10u}) {
      CAPTURE(dt);
      CAPTURE(hd);
      const uint32_t eb = dt == KVGC_DTYPE_F32 ? 4 : 2, group = int4_group(hd);
      std::vector<uint8_t> codes((hd + 3) / 4);
      std::vector<uint16_t> qp(2 * (hd / group));
      auto roundtrip = [&](const uint8_t* src, uint8_t* back) {
        std::fill(codes.begin(), codes.end(), uint8_t(0xa5));  // poisoned: every code written
        cpu::quantize_row(src, dt, hd, codes.data(), qp.data(), 2);
        cpu::dequantize_row(codes.data(), qp.data(), dt, hd, back, 2);
        if (hd % 4) REQUIRE(int(codes.back() >> (2 * (hd % 4))) == 0);  // the partial byte's rest: zero
        for (uint32_t g = 0; g < hd / group; ++g) {
          const kvgc_dtype qt = qparam_dtype(dt);
          auto f = [&](uint16_t h) { return qt == KVGC_DTYPE_F16 ? cpu::f16_to_f32(h) : cpu::bf16_to_f32(h); };
          const float scale = f(qp[2 * g]), zero = f(qp[2 * g + 1]);
          for (uint32_t i = g * group; i < (g + 1) * group; ++i) {
            const float x = cpu::load(src + i * eb, dt), y = cpu::load(back + i * eb, dt);
            REQUIRE(x >= zero);                 // zero rounded down, scale up: nothing clipped
            REQUIRE(x <= zero + 3 * scale * (1 + 1e-6f) + 1e-30f);
            REQUIRE(std::fabs(x - y) <= scale / 2 * (1 + 1e-3f) + std::fabs(x) * 8e-3f + 1e-30f);
          }
        }
      };
      const auto [mean, worst] = row_error(dt, hd, roundtrip);
      MESSAGE("int2 relative RMSE, dtype " << dt << " head_dim " << hd << ": mean " << mean << ", worst " << worst);
      if (hd == 64 && dt == KVGC_DTYPE_F16) CHECK(mean == doctest::Approx(kInt2Error).epsilon(0.3));
      if (hd >= 32) CHECK(mean > 2 * kInt4Error);  // the rung below int4 really is coarser
    }
  // A constant group is exact; NaN and inf do not poison the group's finite values.
  const uint32_t hd = 32;
  std::vector<uint8_t> src(hd * 2), back(hd * 2), codes(hd / 4);
  std::vector<uint16_t> qp(2);
  for (uint32_t i = 0; i < hd; ++i) cpu::store(&src[i * 2], KVGC_DTYPE_F16, -1.25f);
  cpu::quantize_row(src.data(), KVGC_DTYPE_F16, hd, codes.data(), qp.data(), 2);
  cpu::dequantize_row(codes.data(), qp.data(), KVGC_DTYPE_F16, hd, back.data(), 2);
  CHECK(back == src);
  for (uint32_t i = 0; i < hd; ++i) cpu::store(&src[i * 2], KVGC_DTYPE_F16, float(i % 4));
  cpu::store(&src[0], KVGC_DTYPE_F16, NAN);
  cpu::store(&src[1], KVGC_DTYPE_F16, -INFINITY);
  cpu::quantize_row(src.data(), KVGC_DTYPE_F16, hd, codes.data(), qp.data(), 2);
  cpu::dequantize_row(codes.data(), qp.data(), KVGC_DTYPE_F16, hd, back.data(), 2);
  for (uint32_t i = 2; i < hd; ++i) CHECK(cpu::load(&back[i * 2], KVGC_DTYPE_F16) == float(i % 4));
}

TEST_CASE("int8 quantisation edge cases: zeros, constants, bf16 range, non-finite values") {
  const uint32_t hd = 16;
  std::vector<uint8_t> src(hd * 2), back(hd * 2);
  std::vector<int8_t> q(hd);
  uint16_t scale = 0xffff;
  cpu::quantize_row_int8(src.data(), KVGC_DTYPE_F16, hd, q.data(), &scale);  // all zeros
  cpu::dequantize_row_int8(q.data(), &scale, KVGC_DTYPE_F16, hd, back.data());
  CHECK(back == src);
  for (uint32_t i = 0; i < hd; ++i) cpu::store(&src[i * 2], KVGC_DTYPE_F16, -2.5f);
  cpu::quantize_row_int8(src.data(), KVGC_DTYPE_F16, hd, q.data(), &scale);
  cpu::dequantize_row_int8(q.data(), &scale, KVGC_DTYPE_F16, hd, back.data());
  for (uint32_t i = 0; i < hd; ++i)
    CHECK(cpu::load(&back[i * 2], KVGC_DTYPE_F16) == doctest::Approx(-2.5).epsilon(0.005));
  for (uint32_t i = 0; i < hd; ++i) cpu::store(&src[i * 2], KVGC_DTYPE_BF16, i % 2 ? 3e35f : -1e35f);
  cpu::quantize_row_int8(src.data(), KVGC_DTYPE_BF16, hd, q.data(), &scale);
  cpu::dequantize_row_int8(q.data(), &scale, KVGC_DTYPE_BF16, hd, back.data());
  for (uint32_t i = 0; i < hd; ++i)
    CHECK(cpu::load(&back[i * 2], KVGC_DTYPE_BF16) == doctest::Approx(i % 2 ? 3e35 : -1e35).epsilon(0.02));
  for (uint32_t i = 0; i < hd; ++i) cpu::store(&src[i * 2], KVGC_DTYPE_F16, float(i) - 8);
  cpu::store(&src[0], KVGC_DTYPE_F16, NAN);
  cpu::store(&src[2], KVGC_DTYPE_F16, INFINITY);
  cpu::store(&src[4], KVGC_DTYPE_F16, -INFINITY);
  cpu::quantize_row_int8(src.data(), KVGC_DTYPE_F16, hd, q.data(), &scale);
  cpu::dequantize_row_int8(q.data(), &scale, KVGC_DTYPE_F16, hd, back.data());
  CHECK(q[0] == 0);     // NaN reads as 0 (elements 0, 1, 2 at bytes 0, 2, 4)
  CHECK(q[1] == 127);   // infinities saturate
  CHECK(q[2] == -127);
  for (uint32_t i = 3; i < hd; ++i)  // the finite values keep their own scale
    CHECK(cpu::load(&back[i * 2], KVGC_DTYPE_F16) == doctest::Approx(float(i) - 8).epsilon(0.01).scale(1));
}

TEST_CASE("the storage ladder: classes by demote option, convex slopes, tiny heads drop rungs") {
  auto pages = [](uint32_t hd, uint32_t heads) {
    std::array<uint64_t, KVGC_CLASS_COUNT> b{};
    for (int c = 0; c < KVGC_CLASS_COUNT; ++c)
      b[c] = PageLayout::make(16, heads, hd, KVGC_DTYPE_F16, kvgc_storage_class(c)).bytes;
    return b;
  };
  std::string note;
  const auto big = pages(128, 8);
  Ladder L = make_ladder(KVGC_DEMOTE_LADDER, big.data(), &note);
  CHECK(note.empty());
  REQUIRE(L.n == 3);
  CHECK(L.cls[0] == KVGC_CLASS_FP16);
  CHECK(L.cls[1] == KVGC_CLASS_INT8);
  CHECK(L.cls[2] == KVGC_CLASS_INT4);
  CHECK(L.slope[0] < L.slope[1]);
  CHECK(L.slope[1] < L.slope[2]);
  // slope = error gained / cost saved, with cost = page bytes / fp16 page bytes.
  const double c8 = double(big[KVGC_CLASS_INT8]) / big[KVGC_CLASS_FP16];
  const double c4 = double(big[KVGC_CLASS_INT4]) / big[KVGC_CLASS_FP16];
  CHECK(L.slope[0] == doctest::Approx(kInt8Error / (1 - c8)));
  CHECK(L.slope[1] == doctest::Approx((kInt4Error - kInt8Error) / (c8 - c4)));
  CHECK(L.slope[2] == doctest::Approx((1 - kInt4Error) / c4));
  L = make_ladder(KVGC_DEMOTE_INT4, big.data(), &note);
  CHECK((L.n == 2 && L.cls[1] == KVGC_CLASS_INT4));
  L = make_ladder(KVGC_DEMOTE_INT8, big.data(), &note);
  CHECK((L.n == 2 && L.cls[1] == KVGC_CLASS_INT8));
  L = make_ladder(KVGC_DEMOTE_OFF, big.data(), &note);
  CHECK(L.n == 1);
  CHECK(L.slope[0] == doctest::Approx(1.0));  // fp16 -> evicted
  // A head of 2 dims: scale words cost what the bytes save; both rungs are left out.
  const auto tiny = pages(2, 1);
  L = make_ladder(KVGC_DEMOTE_LADDER, tiny.data(), &note);
  CHECK(L.n == 1);
  CHECK(note.find("int4 left out") != std::string::npos);
  CHECK(note.find("int8 left out") != std::string::npos);
}

TEST_CASE("young window: fixed without a byte budget; under one an eighth of it, within window_min..window") {
  PolicyParams p = params(KVGC_POLICY_GENERATIONAL);
  p.window = 32;
  p.window_min = 8;
  p.unit_cost[KVGC_CLASS_FP16] = 10;
  const auto tokens = [&](uint64_t t) { return t * p.unit_cost[KVGC_CLASS_FP16]; };
  // No byte budget (a token budget only, or none): always `window`.
  CHECK(young_window(p, tokens(40)) == 32);
  CHECK(young_window(p, kNoBudget) == 32);
  p.window_scales = true;
  CHECK(young_window(p, kNoBudget) == 32);
  CHECK(young_window(p, tokens(51)) == 8);    // 5% of 1K tokens: the floor
  CHECK(young_window(p, tokens(102)) == 12);  // 10%
  CHECK(young_window(p, tokens(205)) == 25);  // 5% of 4K
  CHECK(young_window(p, tokens(4096)) == 32); // capped at window
  p.window_min = 32;                          // window_min >= window: fixed (0.8)
  CHECK(young_window(p, tokens(51)) == 32);
  p.window_min = 8;
  // A budget that grows with the length never moves the window's start back.
  for (uint64_t length = 100, before = 0; length < 3000; ++length) {
    const uint64_t start = length - young_window(p, tokens(length / 20));  // 5%, a fraction
    CHECK(start >= before);
    before = start;
  }
  // The plan protects, tenures and sizes the tiers by the scaled window.
  SegmentView v = view(1024, tokens(51));
  CHECK(protected_tokens(p, v) == 4 + 8);
  v.since_minor = p.page_tokens;
  const GcPlan g = plan_gc(p, v);
  CHECK(g.run);
  CHECK(g.tenure_before == 1024 - 8);
}
