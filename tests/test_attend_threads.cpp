// Split-K attention (cpu::attend with a ThreadPool) on pages built directly: fp16 and int4
// pages mixed, dead slots, partly filled pages, causal chunks, queries that see nothing,
// empty and short segments. Threaded results equal the single-threaded ones within
// summation-order tolerance and a float64 reference within attend's bounds; a pool of
// one, a segment too short to split and the portable path are bit-identical to no pool;
// a given worker count is deterministic.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "../kernels/cpu/attend.hpp"
#include "../kernels/cpu/attend_internal.hpp"
#include "../kernels/cpu/convert.hpp"
#include "../kernels/cpu/quant.hpp"
#include "../kernels/cpu/thread_pool.hpp"
#include "util.hpp"

using namespace kvgc;
using kvgc_test::rel_err;

namespace {

struct Shape {
  uint32_t kv_heads, gqa, head_dim, page_tokens;
  kvgc_dtype dtype;
  uint32_t pages, n_q;
  double dead, int4;  // fractions of slots dead and of pages int4
  double int8 = 0;    // fraction of pages int8
  bool early = false;  // queries from position -1: the first sees nothing, the rest little
};

// A segment's pages, built from random data, and everything an AttendOp needs.
struct Segment {
  PageLayout layout[KVGC_CLASS_COUNT];
  std::vector<std::vector<uint8_t>> pages;  // 256-byte aligned storage per page
  std::vector<SegPage> seg;
  std::vector<int32_t> positions;           // live slots' positions in read order
  uint64_t live = 0;
  int64_t length = 0;

  uint8_t* page_ptr(size_t i) {
    auto a = reinterpret_cast<uintptr_t>(pages[i].data());
    return reinterpret_cast<uint8_t*>((a + 255) / 256 * 256);
  }
};

Segment build(const Shape& s, std::mt19937& rng) {
  Segment g;
  for (int c = 0; c < KVGC_CLASS_COUNT; ++c)
    g.layout[c] = PageLayout::make(s.page_tokens, s.kv_heads, s.head_dim, s.dtype, kvgc_storage_class(c));
  std::normal_distribution<float> gauss(0.f, 1.f);
  std::uniform_real_distribution<double> u(0, 1);
  const uint32_t eb = dtype_bytes(s.dtype);
  std::vector<uint8_t> row(s.head_dim * eb);
  int32_t pos = 0;
  for (uint32_t p = 0; p < s.pages; ++p) {
    const double pick = u(rng);
    const auto cls = pick < s.int4 ? KVGC_CLASS_INT4 : pick < s.int4 + s.int8 ? KVGC_CLASS_INT8 : KVGC_CLASS_FP16;
    const PageLayout& L = g.layout[cls];
    g.pages.emplace_back(L.bytes + 256, 0);
    uint8_t* page = g.page_ptr(p);
    const uint32_t used = p + 1 == s.pages ? 1 + rng() % s.page_tokens : s.page_tokens;
    g.seg.push_back({page, uint32_t(cls), g.live});
    for (uint32_t slot = 0; slot < used; ++slot, ++pos) {
      reinterpret_cast<int32_t*>(page + L.pos_off)[slot] = pos;
      if (u(rng) < s.dead) continue;
      reinterpret_cast<uint32_t*>(page + L.live_off)[slot / 32] |= 1u << (slot % 32);
      g.positions.push_back(pos);
      ++g.live;
      for (uint32_t h = 0; h < s.kv_heads; ++h)
        for (bool v : {false, true}) {
          for (uint32_t d = 0; d < s.head_dim; ++d) cpu::store(&row[d * eb], s.dtype, gauss(rng));
          cpu::store_row(L, page, h, slot, v, row.data());  // quantised for INT8 and INT4
        }
    }
  }
  g.length = pos;
  return g;
}

// One head's K or V row of a live slot as float64, dequantised as kvgc_read returns it.
std::vector<double> row_of(const Segment& g, const SegPage& sp, uint32_t slot, uint32_t h, bool v) {
  const PageLayout& L = g.layout[sp.cls];
  const uint32_t eb = dtype_bytes(L.dtype);
  std::vector<uint8_t> tmp(L.head_dim * eb);
  cpu::load_row(L, sp.page, h, slot, v, tmp.data());
  std::vector<double> r(L.head_dim);
  for (uint32_t d = 0; d < L.head_dim; ++d) r[d] = cpu::load(tmp.data() + d * eb, L.dtype);
  return r;
}

struct Result {
  std::vector<float> out, mass;  // out as f32; mass per live slot in read order
};

Result run(Segment& g, const std::vector<uint8_t>& q, uint32_t n_q, uint32_t q_heads,
           int64_t q_pos0, cpu::ThreadPool* pool) {
  const PageLayout& L0 = g.layout[0];
  const uint32_t eb = dtype_bytes(L0.dtype);
  std::vector<uint8_t> out(q.size(), 0xA5);  // poisoned
  for (const SegPage& sp : g.seg)  // scores from zero: what the op adds is the mass
    std::memset(sp.page + g.layout[sp.cls].score_off, 0, g.layout[sp.cls].page_tokens * 4);
  const AttendOp op{{g.layout[0], g.layout[1], g.layout[2], g.layout[3]}, g.seg.data(), uint32_t(g.seg.size()), g.live,
                    q.data(), n_q, q_heads, q_pos0, 1.f / std::sqrt(float(L0.head_dim)),
                    out.data(), true};
  cpu::attend(op, pool);
  Result r;
  for (size_t i = 0; i < out.size() / eb; ++i) r.out.push_back(cpu::load(&out[i * eb], L0.dtype));
  for (const SegPage& sp : g.seg) {
    const PageLayout& L = g.layout[sp.cls];
    for (uint32_t s = 0; s < L.page_tokens; ++s)
      if (reinterpret_cast<const uint32_t*>(sp.page + L.live_off)[s / 32] >> (s % 32) & 1u)
        r.mass.push_back(reinterpret_cast<const float*>(sp.page + L.score_off)[s]);
  }
  return r;
}

std::vector<double> widen(const std::vector<float>& f) { return {f.begin(), f.end()}; }

// Dense float64 attention over the live slots (the test_attend reference, on pages).
void reference64(const Segment& g, const std::vector<uint8_t>& q, uint32_t n_q, uint32_t q_heads,
                   int64_t q_pos0, std::vector<double>* out64, std::vector<double>* mass64) {
  const PageLayout& L0 = g.layout[0];
  const uint32_t hd = L0.head_dim, group = q_heads / L0.n_kv_heads, eb = dtype_bytes(L0.dtype);
  const double scale = 1.f / std::sqrt(float(hd));  // the op's (f32) scale
  out64->assign(size_t(n_q) * q_heads * hd, 0.0);
  mass64->assign(g.live, 0.0);
  struct Ref { const SegPage* sp; uint32_t slot; };
  std::vector<Ref> live;
  for (const SegPage& sp : g.seg) {
    const PageLayout& L = g.layout[sp.cls];
    for (uint32_t s = 0; s < L.page_tokens; ++s)
      if (reinterpret_cast<const uint32_t*>(sp.page + L.live_off)[s / 32] >> (s % 32) & 1u) live.push_back({&sp, s});
  }
  for (uint32_t i = 0; i < n_q; ++i)
    for (uint32_t j = 0; j < q_heads; ++j) {
      const uint32_t kh = j / group;
      std::vector<double> qv(hd), logit(live.size(), -INFINITY);
      for (uint32_t d = 0; d < hd; ++d) qv[d] = cpu::load(&q[((size_t(i) * q_heads + j) * hd + d) * eb], L0.dtype);
      double mx = -INFINITY;
      for (size_t t = 0; t < live.size(); ++t) {
        if (g.positions[t] > q_pos0 + i) continue;
        const auto k = row_of(g, *live[t].sp, live[t].slot, kh, false);
        double dot = 0;
        for (uint32_t d = 0; d < hd; ++d) dot += qv[d] * k[d];
        mx = std::max(mx, logit[t] = dot * scale);
      }
      if (!std::isfinite(mx)) continue;
      double sum = 0;
      for (double l : logit) sum += std::isfinite(l) ? std::exp(l - mx) : 0;
      for (size_t t = 0; t < live.size(); ++t) {
        if (!std::isfinite(logit[t])) continue;
        const double p = std::exp(logit[t] - mx) / sum;
        (*mass64)[t] += p;
        const auto v = row_of(g, *live[t].sp, live[t].slot, kh, true);
        for (uint32_t d = 0; d < hd; ++d) (*out64)[(size_t(i) * q_heads + j) * hd + d] += p * v[d];
      }
    }
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * 4) == 0);
}
bool same_bits(const Result& a, const Result& b) {
  return same_bits(a.out, b.out) && same_bits(a.mass, b.mass);
}

void check_shape(const Shape& s, std::mt19937& rng, bool with_reference) {
  CAPTURE(s.kv_heads);
  CAPTURE(s.gqa);
  CAPTURE(s.head_dim);
  CAPTURE(s.pages);
  CAPTURE(s.n_q);
  CAPTURE(s.dead);
  CAPTURE(s.int4);
  CAPTURE(s.dtype);
  Segment g = build(s, rng);
  CAPTURE(g.live);
  const uint32_t q_heads = s.kv_heads * s.gqa, eb = dtype_bytes(s.dtype);
  std::vector<uint8_t> q(size_t(s.n_q) * q_heads * s.head_dim * eb);
  std::normal_distribution<float> gauss(0.f, 1.f);
  for (size_t i = 0; i < q.size() / eb; ++i) cpu::store(&q[i * eb], s.dtype, 2.f * gauss(rng));
  const int64_t q_pos0 = s.early ? -1 : g.length - s.n_q;  // a causal chunk at the end
  const Result one = run(g, q, s.n_q, q_heads, q_pos0, nullptr);
  {
    cpu::ThreadPool single(1);
    CHECK(same_bits(run(g, q, s.n_q, q_heads, q_pos0, &single), one));
  }
  const double tight = kvgc_test::output_bound(s.dtype);  // f16/bf16 outputs round
  for (unsigned T : {2u, 3u, 4u, 7u}) {
    CAPTURE(T);
    cpu::ThreadPool pool(T);
    const Result threaded = run(g, q, s.n_q, q_heads, q_pos0, &pool);
    CHECK(rel_err(widen(one.out), threaded.out) <= tight);
    CHECK(rel_err(widen(one.mass), threaded.mass) <= 1e-5);  // mass is f32 either way
    CHECK(same_bits(run(g, q, s.n_q, q_heads, q_pos0, &pool), threaded));  // deterministic
    if (g.live / cpu::split_min_slots() < 2)  // too short to split: exactly one thread's
      CHECK(same_bits(threaded, one));
    if (with_reference) {
      std::vector<double> out64, mass64;
      reference64(g, q, s.n_q, q_heads, q_pos0, &out64, &mass64);
      const double bound = kvgc_test::output_bound(s.dtype);
      CHECK(rel_err(out64, threaded.out) <= bound);
      CHECK(rel_err(mass64, threaded.mass) <= bound);
    }
  }
}

}  // namespace

TEST_CASE("split-K attention equals one thread's, and a float64 reference") {
  const uint32_t seed = kvgc_test::fresh_seed("test_attend_threads");
  std::mt19937 rng(seed);
  const Shape shapes[] = {
      {2, 1, 64, 16, KVGC_DTYPE_F32, 120, 1, 0.0, 0.0},     // MHA decode, ~1.9K slots
      {1, 3, 64, 16, KVGC_DTYPE_F32, 100, 1, 0.2, 0.5},     // GQA 3, dead, int4 mixed
      {2, 8, 128, 16, KVGC_DTYPE_F16, 90, 1, 0.1, 0.3},     // GQA 8, hd 128
      {3, 3, 64, 8, KVGC_DTYPE_BF16, 200, 5, 0.3, 0.4},     // causal chunk
      {1, 3, 64, 16, KVGC_DTYPE_F32, 80, 3, 0.0, 0.5, true}, // first query sees nothing
      {2, 1, 128, 32, KVGC_DTYPE_F16, 60, 1, 0.0, 1.0},     // int4 only
      {1, 8, 64, 16, KVGC_DTYPE_F32, 20, 1, 0.1, 0.5},      // too short to split
      {2, 3, 64, 16, KVGC_DTYPE_F16, 5, 2, 1.0, 0.5},       // no live slot at all
      {2, 4, 128, 16, KVGC_DTYPE_F16, 100, 1, 0.1, 0.0, 1.0},  // int8 only, GQA 4
      {1, 3, 64, 16, KVGC_DTYPE_F16, 120, 3, 0.2, 0.3, 0.4},   // all three classes
      {2, 2, 64, 8, KVGC_DTYPE_BF16, 150, 1, 0.1, 0.2, 0.5},   // int8 bf16 element-wise
      {1, 1, 64, 16, KVGC_DTYPE_F32, 120, 2, 0.0, 0.0, 0.6},   // int8 f32 model
  };
  for (int level : {2, 1}) {  // AVX-512, AVX2 (clamped to what the CPU has)
    cpu::set_simd_level(level);
    CAPTURE(std::string(cpu::simd_name()));
    for (size_t i = 0; i < std::size(shapes); ++i) check_shape(shapes[i], rng, i < 3 || i >= 4);
  }
  cpu::set_simd(true);
}

TEST_CASE("split-K: many small ranges (the minimum lowered), and the portable path") {
  std::mt19937 rng(42);
  cpu::set_split_min_slots(16);  // every page boundary is a candidate cut
  check_shape({2, 3, 64, 16, KVGC_DTYPE_F16, 12, 3, 0.3, 0.5}, rng, true);
  check_shape({1, 4, 128, 5, KVGC_DTYPE_F32, 30, 1, 0.5, 0.3}, rng, true);
  cpu::set_split_min_slots(0);
  cpu::set_simd_level(0);  // the specification stays single-threaded: same bits
  Segment g = build({2, 2, 64, 16, KVGC_DTYPE_F32, 60, 1, 0.1, 0.3}, rng);
  std::vector<uint8_t> q(4 * 64 * 4);
  for (size_t i = 0; i < q.size() / 4; ++i) cpu::store(&q[i * 4], KVGC_DTYPE_F32, float(rng() % 100) / 50.f - 1);
  cpu::ThreadPool pool(4);
  CHECK(same_bits(run(g, q, 1, 4, g.length - 1, nullptr), run(g, q, 1, 4, g.length - 1, &pool)));
  cpu::set_simd(true);
}

TEST_CASE("split_slots: page boundaries, balance, the minimum, no empty range") {
  std::vector<uint8_t> pages(64);
  std::vector<cpu::LiveSlot> slots;
  for (uint32_t p = 0; p < 64; ++p)
    for (uint32_t s = 0; s < 16 - p % 5; ++s) slots.push_back({&pages[p], 0, s, int32_t(slots.size())});
  const size_t n = slots.size();
  std::vector<size_t> b(9);
  for (unsigned w : {1u, 2u, 3u, 8u}) {
    const unsigned T = cpu::split_slots(slots.data(), n, w, b.data());
    CHECK(T == std::min<size_t>(w, n / cpu::split_min_slots() ? n / cpu::split_min_slots() : 1));
    CHECK(b[0] == 0);
    CHECK(b[T] == n);
    for (unsigned i = 1; i <= T; ++i) {
      CHECK(b[i] > b[i - 1]);
      if (i < T) CHECK(slots[b[i]].page != slots[b[i] - 1].page);
    }
  }
  cpu::set_split_min_slots(16);
  const unsigned T = cpu::split_slots(slots.data(), n, 8, b.data());
  CHECK(T == 8);
  for (unsigned i = 0; i < T; ++i) CHECK(b[i + 1] - b[i] <= n / 8 + 16);  // balanced to a page
  cpu::set_split_min_slots(0);
  CHECK(cpu::split_slots(slots.data(), 0, 4, b.data()) == 1);
  CHECK(b[1] == 0);
}
