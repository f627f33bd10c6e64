// kvgc_attend_params.mass_out (0.15): a batch's attention mass written out instead of
// added, then handed back with kvgc_batch_observe. What tensor parallelism needs: ranks
// whose heaps hold their own KV heads sum their mass in one order, observe the same sum,
// and their GCs make the same decisions, bit for bit.
#include <doctest/doctest.h>

#include <cmath>
#include <cstddef>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kvgc.h"
#include "util.hpp"

using namespace kvgc_test;

namespace {

kvgc_heap* tp_heap(const kvgc_model_desc& m, uint32_t threads = 1) {
  kvgc_heap_options o = cpu_options(32u << 20, 8);
  o.policy = KVGC_POLICY_GENERATIONAL;
  o.byte_budget_fraction = 0.3;  // evicts and demotes (the ladder) from the first steps
  o.demote = KVGC_DEMOTE_LADDER;
  o.sinks = 2;
  o.window = 8;
  o.cpu_threads = threads;
  o.harvest = KVGC_HARVEST_DEFERRED;
  kvgc_heap* h = nullptr;
  REQUIRE(kvgc_heap_create(&m, &o, &h) == KVGC_OK);
  return h;
}

std::vector<float> normal(std::mt19937& rng, size_t n) {
  std::normal_distribution<float> d(0.f, 1.f);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

// Every live token of (seq, layer) as kvgc_read_scores and kvgc_read_classes give it,
// with its position: what the GC decided and what it ranks by.
struct Seen {
  std::vector<int32_t> pos;
  std::vector<float> scores;
  std::vector<uint8_t> gen, cls;
  bool operator==(const Seen& o) const {
    return pos == o.pos && gen == o.gen && cls == o.cls && scores.size() == o.scores.size() &&
           (scores.empty() || std::memcmp(scores.data(), o.scores.data(), scores.size() * 4) == 0);
  }
};

Seen seen(kvgc_heap* h, const kvgc_model_desc& m, kvgc_seq s, uint32_t layer) {
  uint64_t live = 0, len = 0, n = 0;
  REQUIRE(kvgc_seq_tokens(h, s, layer, &live, &len) == KVGC_OK);
  Seen r;
  r.pos.resize(live + 1);
  r.scores.resize(live + 1);
  r.gen.resize(live + 1);
  r.cls.resize(live + 1);
  std::vector<float> k((live + 1) * m.n_kv_heads * m.head_dim), v(k.size());
  REQUIRE(kvgc_read(h, s, layer, k.data(), v.data(), r.pos.data(), live + 1, &n, nullptr) == KVGC_OK);
  REQUIRE(kvgc_read_scores(h, s, layer, r.scores.data(), r.gen.data(), live + 1, &n, nullptr) == KVGC_OK);
  REQUIRE(kvgc_read_classes(h, s, layer, r.cls.data(), live + 1, &n, nullptr) == KVGC_OK);
  for (auto* v8 : {&r.gen, &r.cls}) v8->resize(n);
  r.pos.resize(n);
  r.scores.resize(n);
  return r;
}

// The pages of `layer` in b's plan.
uint32_t pages_of(kvgc_batch* b, uint32_t layer) {
  kvgc_batch_view view;
  std::memset(&view, 0, sizeof view);
  view.struct_size = sizeof view;
  REQUIRE(kvgc_batch_export(b, layer, &view) == KVGC_OK);
  return view.n_pages;
}

}  // namespace

TEST_CASE("tensor parallel: mass_out then kvgc_batch_observe is the fused attend, bit for bit, one scored row a sequence") {
  const kvgc_model_desc m = model(2, 2, 32, KVGC_DTYPE_F32, 2);
  kvgc_heap* fused = tp_heap(m);
  kvgc_heap* split = tp_heap(m);
  kvgc_batch *bf = nullptr, *bs = nullptr;
  REQUIRE(kvgc_batch_create(fused, &bf) == KVGC_OK);
  REQUIRE(kvgc_batch_create(split, &bs) == KVGC_OK);
  kvgc_seq sf[3], ss[3];
  for (int i = 0; i < 3; ++i) {
    REQUIRE(kvgc_seq_create(fused, 0, &sf[i]) == KVGC_OK);
    REQUIRE(kvgc_seq_create(split, 0, &ss[i]) == KVGC_OK);
  }
  std::mt19937 rng(7);
  const size_t kv_row = size_t(m.n_kv_heads) * m.head_dim, q_row = size_t(m.n_q_heads) * m.head_dim;
  for (int step = 0; step < 40; ++step) {
    CAPTURE(step);
    // Prompts in chunks that score only their last row (a deferred GC at the first), then
    // one decode row a sequence.
    std::vector<uint32_t> n_new = {step == 0 ? 30u : 1u, step < 2 ? 17u : 1u, 1u};
    std::vector<uint32_t> scored = {1, 1, 1}, flags = {0, step == 0 ? KVGC_BATCH_SEQ_DEFER_STEP : 0u, 0};
    uint32_t rows = 0, failed = 0;
    for (uint32_t n : n_new) rows += n;
    kvgc_batch_plan_options po;
    REQUIRE(kvgc_batch_plan_options_init(&po) == KVGC_OK);
    po.scored_rows = scored.data();
    po.seq_flags = flags.data();
    REQUIRE(kvgc_batch_plan_ex(bf, sf, n_new.data(), 3, &po, &failed, nullptr) == KVGC_OK);
    REQUIRE(kvgc_batch_plan_ex(bs, ss, n_new.data(), 3, &po, &failed, nullptr) == KVGC_OK);
    for (uint32_t layer = 0; layer < m.n_layers; ++layer) {
      const auto k = normal(rng, rows * kv_row), v = normal(rng, rows * kv_row), q = normal(rng, rows * q_row);
      std::vector<float> of(rows * q_row, NAN), os(rows * q_row, NAN);
      REQUIRE(kvgc_batch_append(bf, layer, k.data(), v.data(), nullptr) == KVGC_OK);
      REQUIRE(kvgc_batch_append(bs, layer, k.data(), v.data(), nullptr) == KVGC_OK);
      REQUIRE(kvgc_batch_attend(bf, layer, q.data(), of.data(), nullptr, nullptr) == KVGC_OK);
      std::vector<float> mass(size_t(pages_of(bs, layer)) * 8 + 1, NAN);  // poisoned, one past
      kvgc_attend_params p;
      REQUIRE(kvgc_attend_params_init(&p) == KVGC_OK);
      p.mass_out = mass.data();
      REQUIRE(kvgc_batch_attend(bs, layer, q.data(), os.data(), &p, nullptr) == KVGC_OK);
      REQUIRE(std::memcmp(of.data(), os.data(), of.size() * 4) == 0);
      CHECK(std::isnan(mass.back()));  // nothing written past the view
      mass.pop_back();
      double total = 0;
      for (float x : mass) {
        REQUIRE(x >= 0.f);  // every entry written: dead slots 0
        total += x;
      }
      // Each scored row's mass over its query heads sums to n_q_heads.
      CHECK(total == doctest::Approx(3.0 * m.n_q_heads).epsilon(1e-4));
      REQUIRE(kvgc_batch_observe(bs, layer, mass.data(), nullptr) == KVGC_OK);
    }
    const kvgc_status a = kvgc_batch_step(bf, nullptr), b = kvgc_batch_step(bs, nullptr);
    REQUIRE(a == b);
    for (int i = 0; i < 3; ++i)
      for (uint32_t layer = 0; layer < m.n_layers; ++layer)
        REQUIRE_MESSAGE(seen(fused, m, sf[i], layer) == seen(split, m, ss[i], layer), "seq " << i << " layer " << layer);
  }
  kvgc_stats st;
  REQUIRE(kvgc_stats_init(&st) == KVGC_OK);
  REQUIRE(kvgc_get_stats(split, &st) == KVGC_OK);
  CHECK(st.tokens_evicted > 0);  // the GC ranked by these scores, and the ladder ran
  CHECK(st.tokens_demoted > 0);
  kvgc_batch_destroy(bf);
  kvgc_batch_destroy(bs);
  kvgc_heap_destroy(fused);
  kvgc_heap_destroy(split);
}

TEST_CASE("tensor parallel: ranks holding their own KV heads, observing the summed mass, make the same decisions") {
  // Two ranks of a model with 4 KV heads (GQA 2): each heap holds 2 KV heads and their 4
  // query heads. Each attends its heads with mass_out, the ranks' arrays are summed in
  // rank order and observed by both: every rank holds the same tokens, classes and
  // scores after every step, and the summed mass is the whole model's.
  const uint32_t ranks = 2, kv = 4, gqa = 2, hd = 16, layers = 2;
  const kvgc_model_desc whole = model(layers, kv, hd, KVGC_DTYPE_F32, gqa);
  const kvgc_model_desc part = model(layers, kv / ranks, hd, KVGC_DTYPE_F32, gqa);
  std::vector<kvgc_heap*> h(ranks);
  std::vector<kvgc_batch*> b(ranks);
  std::vector<std::vector<kvgc_seq>> seqs(ranks, std::vector<kvgc_seq>(2));
  for (uint32_t r = 0; r < ranks; ++r) {
    h[r] = tp_heap(part, r + 1);  // the ranks' thread counts differ: decisions must not
    REQUIRE(kvgc_batch_create(h[r], &b[r]) == KVGC_OK);
    for (auto& s : seqs[r]) REQUIRE(kvgc_seq_create(h[r], 0, &s) == KVGC_OK);
  }
  kvgc_heap* one = tp_heap(whole);  // the model on one rank: its first step's mass
  kvgc_batch* bo = nullptr;
  REQUIRE(kvgc_batch_create(one, &bo) == KVGC_OK);
  kvgc_seq so[2];
  for (auto& s : so) REQUIRE(kvgc_seq_create(one, 0, &s) == KVGC_OK);

  std::mt19937 rng(11);
  const size_t rank_kv = size_t(kv / ranks) * hd, rank_q = size_t(kv / ranks) * gqa * hd;
  for (int step = 0; step < 60; ++step) {
    CAPTURE(step);
    std::vector<uint32_t> n_new = {step == 0 ? 40u : 1u, step == 0 ? 9u : 1u};
    const uint32_t rows = n_new[0] + n_new[1];
    uint32_t failed = 0;
    for (uint32_t r = 0; r < ranks; ++r)
      REQUIRE(kvgc_batch_plan(b[r], seqs[r].data(), n_new.data(), 2, &failed, nullptr) == KVGC_OK);
    if (step == 0) REQUIRE(kvgc_batch_plan(bo, so, n_new.data(), 2, &failed, nullptr) == KVGC_OK);
    for (uint32_t layer = 0; layer < layers; ++layer) {
      // The whole model's rows; rank r takes its KV heads' and their query heads' slices.
      const auto k = normal(rng, rows * kv * hd), v = normal(rng, rows * kv * hd);
      const auto q = normal(rng, rows * kv * gqa * hd);
      std::vector<std::vector<float>> mass(ranks);
      for (uint32_t r = 0; r < ranks; ++r) {
        std::vector<float> kr(rows * rank_kv), vr(rows * rank_kv), qr(rows * rank_q), out(rows * rank_q);
        for (uint32_t i = 0; i < rows; ++i) {
          std::memcpy(&kr[i * rank_kv], &k[(i * ranks + r) * rank_kv], rank_kv * 4);
          std::memcpy(&vr[i * rank_kv], &v[(i * ranks + r) * rank_kv], rank_kv * 4);
          std::memcpy(&qr[i * rank_q], &q[(i * ranks + r) * rank_q], rank_q * 4);
        }
        REQUIRE(kvgc_batch_append(b[r], layer, kr.data(), vr.data(), nullptr) == KVGC_OK);
        mass[r].assign(size_t(pages_of(b[r], layer)) * 8, NAN);
        kvgc_attend_params p;
        REQUIRE(kvgc_attend_params_init(&p) == KVGC_OK);
        p.mass_out = mass[r].data();
        REQUIRE(kvgc_batch_attend(b[r], layer, qr.data(), out.data(), &p, nullptr) == KVGC_OK);
      }
      REQUIRE(mass[0].size() == mass[1].size());  // the same pages on every rank
      std::vector<float> sum(mass[0].size(), 0.f);
      for (uint32_t r = 0; r < ranks; ++r)
        for (size_t i = 0; i < sum.size(); ++i) sum[i] += mass[r][i];
      for (uint32_t r = 0; r < ranks; ++r) REQUIRE(kvgc_batch_observe(b[r], layer, sum.data(), nullptr) == KVGC_OK);
      if (step == 0) {  // the ranks' summed mass is the whole model's
        std::vector<float> out(rows * kv * gqa * hd), wm(sum.size(), NAN);
        REQUIRE(kvgc_batch_append(bo, layer, k.data(), v.data(), nullptr) == KVGC_OK);
        REQUIRE(pages_of(bo, layer) * 8 == wm.size());
        kvgc_attend_params p;
        REQUIRE(kvgc_attend_params_init(&p) == KVGC_OK);
        p.mass_out = wm.data();
        REQUIRE(kvgc_batch_attend(bo, layer, q.data(), out.data(), &p, nullptr) == KVGC_OK);
        for (size_t i = 0; i < sum.size(); ++i) CHECK(sum[i] == doctest::Approx(wm[i]).epsilon(1e-5));
      }
    }
    for (uint32_t r = 0; r < ranks; ++r) {
      const kvgc_status st = kvgc_batch_step(b[r], nullptr);
      REQUIRE((st == KVGC_OK || st == KVGC_EBUDGET));
    }
    for (int i = 0; i < 2; ++i)
      for (uint32_t layer = 0; layer < layers; ++layer)
        REQUIRE_MESSAGE(seen(h[0], part, seqs[0][i], layer) == seen(h[1], part, seqs[1][i], layer),
                        "seq " << i << " layer " << layer);
  }
  kvgc_stats st;
  REQUIRE(kvgc_stats_init(&st) == KVGC_OK);
  REQUIRE(kvgc_get_stats(h[1], &st) == KVGC_OK);
  CHECK(st.tokens_evicted > 0);
  for (uint32_t r = 0; r < ranks; ++r) {
    kvgc_batch_destroy(b[r]);
    kvgc_heap_destroy(h[r]);
  }
  kvgc_batch_destroy(bo);
  kvgc_heap_destroy(one);
}

TEST_CASE("tensor parallel: mass_out is refused where it means nothing, and older params still serve") {
  const kvgc_model_desc m = model(1, 1, 16, KVGC_DTYPE_F32);
  kvgc_heap* h = tp_heap(m);
  kvgc_batch* b = nullptr;
  REQUIRE(kvgc_batch_create(h, &b) == KVGC_OK);
  kvgc_seq s;
  REQUIRE(kvgc_seq_create(h, 0, &s) == KVGC_OK);
  std::vector<float> k(4 * 16, 0.5f), q(4 * 16, 0.25f), out(4 * 16), mass(64, NAN);
  uint32_t n = 4, failed = 0;
  REQUIRE(kvgc_batch_plan(b, &s, &n, 1, &failed, nullptr) == KVGC_OK);
  REQUIRE(kvgc_batch_append(b, 0, k.data(), k.data(), nullptr) == KVGC_OK);
  kvgc_attend_params p;
  REQUIRE(kvgc_attend_params_init(&p) == KVGC_OK);
  p.mass_out = mass.data();
  p.flags = KVGC_ATTEND_NO_SCORES;
  CHECK(kvgc_batch_attend(b, 0, q.data(), out.data(), &p, nullptr) == KVGC_EINVAL);
  CHECK(std::string(kvgc_errmsg(h)).find("mass_out") != std::string::npos);
  CHECK(std::isnan(mass[0]));  // nothing written
  p.flags = 0;
  p.mass_out = reinterpret_cast<float*>(reinterpret_cast<char*>(mass.data()) + 1);
  CHECK(kvgc_batch_attend(b, 0, q.data(), out.data(), &p, nullptr) == KVGC_EINVAL);
  CHECK(std::string(kvgc_errmsg(h)).find("aligned") != std::string::npos);
  // kvgc_attend has no page layout to write mass in: refused, nothing attended.
  p.mass_out = mass.data();
  CHECK(kvgc_attend(h, s, 0, q.data(), 1, out.data(), &p, nullptr) == KVGC_EINVAL);
  CHECK(std::string(kvgc_errmsg(h)).find("kvgc_batch_attend only") != std::string::npos);
  // A caller built before 0.15 passes the shorter struct: mass goes to the scores.
  p.struct_size = KVGC_ATTEND_PARAMS_V1_SIZE;
  CHECK(kvgc_batch_attend(b, 0, q.data(), out.data(), &p, nullptr) == KVGC_OK);
  CHECK(std::isnan(mass[0]));
  std::vector<float> scores(8);
  std::vector<uint8_t> gen(8);
  uint64_t got = 0;
  REQUIRE(kvgc_read_scores(h, s, 0, scores.data(), gen.data(), 8, &got, nullptr) == KVGC_OK);
  REQUIRE(got == 4);
  CHECK(scores[0] > 0.f);
  p.struct_size = KVGC_ATTEND_PARAMS_V1_SIZE - 1;
  CHECK(kvgc_batch_attend(b, 0, q.data(), out.data(), &p, nullptr) == KVGC_EINVAL);
  kvgc_batch_destroy(b);
  kvgc_heap_destroy(h);
}
