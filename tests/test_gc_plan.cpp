// The GC's host-side planning (gc/) and the data-plane's numeric helpers, without a heap.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "../gc/compaction.hpp"
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
  v.live_fp16 = length;
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
    CHECK(g.reclaim == doctest::Approx(1.0));
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
  v.live_fp16 = 100;
  v.since_minor = 7;
  CHECK_FALSE(plan_gc(p, v).run);  // not a page of new tokens yet
  v.since_minor = 8;
  v.live_fp16 = 101;
  GcPlan g = plan_gc(p, v);
  CHECK(g.run);
  CHECK_FALSE(g.major);
  CHECK(g.candidates == gen_bit(kGenIntermediate));
  CHECK(g.age_intermediate);
  CHECK(g.reclaim == doctest::Approx(1.0));
  // Long-term has room (cap = budget - protected - intermediate share): promote into it.
  CHECK(g.promote == 100 - 20 - intermediate_target(p, 100));
  // The intermediate tier cannot absorb the reclaim: a major GC ranks long-term too.
  v.tier[kGenIntermediate] = 0;
  v.tier[kGenLongTerm] = 80;
  v.live_fp16 = 150;
  g = plan_gc(p, v);
  CHECK(g.major);
  CHECK(g.candidates == (gen_bit(kGenIntermediate) | gen_bit(kGenLongTerm)));
  CHECK(g.retier);
  // Long-term full with heavy hitters waiting: a refresh, at most once per 8 minors.
  v = view(200, 100);
  v.since_minor = 8;
  v.tier[kGenLongTerm] = 60;
  v.tier[kGenIntermediate] = 20;
  v.live_fp16 = 100;
  v.promote_blocked = true;
  v.minors_since_major = 3;
  CHECK_FALSE(plan_gc(p, v).major);
  v.minors_since_major = kMajorEveryMinors - 1;
  CHECK(plan_gc(p, v).major);
}

TEST_CASE("budgets count int4 tokens at their byte share") {
  PolicyParams p = params(KVGC_POLICY_H2O);
  p.int4_cost = 0.25;
  SegmentView v = view(100, 100);
  v.live_fp16 = 80;
  v.live_int4 = 40;  // 80 + 10 = 90 units
  CHECK(segment_cost(p, v) == doctest::Approx(90));
  CHECK_FALSE(plan_gc(p, v).run);
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
