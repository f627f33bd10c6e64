// The batch API (kvgc_batch_*): equal to the per-sequence calls, all or nothing at plan,
// stale plans refused, and the exported page tables readable through the documented
// layout alone.
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <map>
#include <random>
#include <vector>

#include "kvgc.h"
#include "util.hpp"

using namespace kvgc_test;

namespace {

kvgc_heap* make_heap(const kvgc_model_desc& m, kvgc_policy policy, uint32_t threads = 1,
                     uint64_t budget = 64u << 20, double byte_fraction = 0.3) {
  kvgc_heap_options o;
  kvgc_heap_options_init(&o);
  o.flags = KVGC_OPT_IGNORE_ENV;
  o.device = KVGC_DEVICE_CPU;
  o.min_length = 0;  // short sequences: budgets from the first token
  o.budget_bytes = budget;
  o.policy = policy;
  o.byte_budget_fraction = policy == KVGC_POLICY_FULL ? 0 : byte_fraction;
  o.sinks = 2;
  o.window = 8;
  o.page_tokens = 8;
  o.cpu_threads = threads;
  o.harvest = KVGC_HARVEST_DEFERRED;
  kvgc_heap* h = nullptr;
  REQUIRE(kvgc_heap_create(&m, &o, &h) == KVGC_OK);
  return h;
}

std::vector<float> random_rows(std::mt19937& rng, size_t n) {
  std::normal_distribution<float> d(0.f, 1.f);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

// One segment's readable state: K, V, positions, scores, generations, classes.
struct SegState {
  std::vector<float> k, v, scores;
  std::vector<int32_t> pos;
  std::vector<uint8_t> gen, cls;
  bool operator==(const SegState& o) const {
    return k == o.k && v == o.v && scores == o.scores && pos == o.pos && gen == o.gen && cls == o.cls;
  }
};

SegState read_seg(kvgc_heap* h, const kvgc_model_desc& m, kvgc_seq s, uint32_t layer) {
  uint64_t live = 0, len = 0;
  REQUIRE(kvgc_seq_tokens(h, s, layer, &live, &len) == KVGC_OK);
  SegState st;
  const size_t row = size_t(m.n_kv_heads) * m.head_dim;
  st.k.resize(live * row + 1);
  st.v.resize(live * row + 1);
  st.pos.resize(live + 1);
  st.scores.resize(live + 1);
  st.gen.resize(live + 1);
  st.cls.resize(live + 1);
  uint64_t n = 0;
  REQUIRE(kvgc_read(h, s, layer, st.k.data(), st.v.data(), st.pos.data(), live + 1, &n, nullptr) == KVGC_OK);
  REQUIRE(kvgc_read_scores(h, s, layer, st.scores.data(), st.gen.data(), live + 1, &n, nullptr) == KVGC_OK);
  REQUIRE(kvgc_read_classes(h, s, layer, st.cls.data(), live + 1, &n, nullptr) == KVGC_OK);
  return st;
}

// Each live token's (position, score, recent score) of segment (s, layer), by position:
// what the GC ranks by, the recent scores included (no getter reads those), through a
// plan without new rows and the documented page layout. Applies pending GC results, as
// kvgc_seq_tokens does.
std::vector<std::array<float, 3>> read_meta(kvgc_heap* h, kvgc_seq s, uint32_t layer) {
  kvgc_batch* b = nullptr;
  REQUIRE(kvgc_batch_create(h, &b) == KVGC_OK);
  uint32_t zero = 0, failed = 0;
  REQUIRE(kvgc_batch_plan(b, &s, &zero, 1, &failed, nullptr) == KVGC_OK);
  REQUIRE(kvgc_batch_append(b, layer, nullptr, nullptr, nullptr) == KVGC_OK);
  kvgc_batch_view view;
  std::memset(&view, 0, sizeof view);
  view.struct_size = sizeof view;
  REQUIRE(kvgc_batch_export(b, layer, &view) == KVGC_OK);
  kvgc_page_layout lay[KVGC_CLASS_COUNT];
  for (int c = 0; c < KVGC_CLASS_COUNT; ++c) {
    std::memset(&lay[c], 0, sizeof lay[c]);
    lay[c].struct_size = sizeof lay[c];
    REQUIRE(kvgc_page_layout_get(h, kvgc_storage_class(c), &lay[c]) == KVGC_OK);
  }
  std::vector<std::array<float, 3>> meta;
  for (uint32_t p = view.page_indptr[0]; p < view.page_indptr[1]; ++p) {
    const kvgc_page_layout& L = lay[view.page_class[p]];
    const uint8_t* page = static_cast<const uint8_t*>(view.arena_base) + view.page_offset[p];
    for (uint32_t t = 0; t < view.page_tokens; ++t) {
      uint32_t word;
      std::memcpy(&word, page + L.live_offset + 4 * (t / 32), 4);
      if (!(word >> (t % 32) & 1u)) continue;
      int32_t pos;
      float score, recent;
      std::memcpy(&pos, page + L.pos_offset + 4 * t, 4);
      std::memcpy(&score, page + L.score_offset + 4 * t, 4);
      std::memcpy(&recent, page + L.recent_offset + 4 * t, 4);
      meta.push_back({float(pos), score, recent});
    }
  }
  std::sort(meta.begin(), meta.end(), [](const auto& a, const auto& b) { return a[0] < b[0]; });
  kvgc_batch_destroy(b);
  return meta;
}

bool same_bits(const std::vector<std::array<float, 3>>& a, const std::vector<std::array<float, 3>>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof a[0]) == 0);
}

// Drives two heaps through the same steps: `batched` with the batch API, `single` with the
// per-sequence calls, and checks attention outputs and every segment's state are equal
// bit for bit (max_err = 0) or within max_err.
struct Twin {
  kvgc_model_desc m;
  kvgc_heap *batched, *single;
  kvgc_batch* batch = nullptr;
  std::map<uint32_t, std::pair<kvgc_seq, kvgc_seq>> seqs;  // request id -> (batched, single)
  std::mt19937 rng{1234};
  double max_err = 0;
  uint64_t ebudget = 0;

  Twin(const kvgc_model_desc& model, kvgc_policy p, uint32_t threads_batched = 1) : m(model) {
    batched = make_heap(m, p, threads_batched);
    single = make_heap(m, p, 1);
    REQUIRE(kvgc_batch_create(batched, &batch) == KVGC_OK);
  }
  ~Twin() {
    kvgc_batch_destroy(batch);
    kvgc_heap_destroy(batched);
    kvgc_heap_destroy(single);
  }
  void join(uint32_t id, uint32_t tenant) {
    kvgc_seq a, b;
    REQUIRE(kvgc_seq_create(batched, tenant, &a) == KVGC_OK);
    REQUIRE(kvgc_seq_create(single, tenant, &b) == KVGC_OK);
    seqs[id] = {a, b};
  }
  void leave(uint32_t id) {
    REQUIRE(kvgc_seq_destroy(batched, seqs[id].first) == KVGC_OK);
    REQUIRE(kvgc_seq_destroy(single, seqs[id].second) == KVGC_OK);
    seqs.erase(id);
  }
  // One sequence's part of a step for step_ex: n new rows, of which the last `scored`
  // add attention mass (kvgc_batch_plan_ex's scored_rows), and whether its GC is deferred
  // (KVGC_BATCH_SEQ_DEFER_STEP).
  struct Chunk {
    uint32_t id, n;
    uint32_t scored = UINT32_MAX;
    bool defer = false;
  };
  // One engine step: request ids and their new rows.
  void step(const std::vector<std::pair<uint32_t, uint32_t>>& work) {
    std::vector<Chunk> chunks;
    for (auto [id, n] : work) chunks.push_back({id, n});
    step_ex(chunks, false);
  }
  // The same through kvgc_batch_plan_ex (ex: even when every chunk has the defaults). The
  // twin runs a chunk that scores only its last s rows as the per-sequence calls that
  // promise to equal: kvgc_append of the first n - s rows, kvgc_attend of them with
  // KVGC_ATTEND_NO_SCORES, then kvgc_append and kvgc_attend of the last s; a deferred
  // sequence is not stepped.
  void step_ex(const std::vector<Chunk>& work, bool ex = true) {
    const size_t kv_row = size_t(m.n_kv_heads) * m.head_dim, q_row = size_t(m.n_q_heads) * m.head_dim;
    std::vector<kvgc_seq> ids;
    std::vector<uint32_t> n_new, scored, flags;
    uint32_t rows = 0;
    for (const Chunk& c : work) {
      ids.push_back(seqs.at(c.id).first);
      n_new.push_back(c.n);
      scored.push_back(c.scored);
      flags.push_back(c.defer ? KVGC_BATCH_SEQ_DEFER_STEP : 0u);
      rows += c.n;
    }
    uint32_t failed = 99;
    if (ex) {
      kvgc_batch_plan_options po;
      REQUIRE(kvgc_batch_plan_options_init(&po) == KVGC_OK);
      po.scored_rows = scored.data();
      po.seq_flags = flags.data();
      REQUIRE(kvgc_batch_plan_ex(batch, ids.data(), n_new.data(), uint32_t(ids.size()), &po, &failed, nullptr) == KVGC_OK);
    } else {
      REQUIRE(kvgc_batch_plan(batch, ids.data(), n_new.data(), uint32_t(ids.size()), &failed, nullptr) == KVGC_OK);
    }
    kvgc_attend_params unscored;
    kvgc_attend_params_init(&unscored);
    unscored.flags = KVGC_ATTEND_NO_SCORES;
    for (uint32_t layer = 0; layer < m.n_layers; ++layer) {
      const std::vector<float> k = random_rows(rng, rows * kv_row + 1), v = random_rows(rng, rows * kv_row + 1);
      const std::vector<float> q = random_rows(rng, rows * q_row + 1);
      std::vector<float> out_b(rows * q_row + 1, NAN), out_s(rows * q_row + 1, NAN);
      REQUIRE(kvgc_batch_append(batch, layer, k.data(), v.data(), nullptr) == KVGC_OK);
      REQUIRE(kvgc_batch_attend(batch, layer, q.data(), out_b.data(), nullptr, nullptr) == KVGC_OK);
      uint32_t row = 0;
      for (const Chunk& c : work) {
        const kvgc_seq s = seqs.at(c.id).second;
        const uint32_t n_scored = std::min(c.scored, c.n), first = c.n - n_scored;
        for (int part = 0; part < 2; ++part) {  // the unscored rows, then the scored ones
          const uint32_t r = part ? row + first : row, n = part ? n_scored : first;
          if (!n) continue;
          REQUIRE(kvgc_append(single, s, layer, k.data() + r * kv_row, v.data() + r * kv_row, n, nullptr) == KVGC_OK);
          REQUIRE(kvgc_attend(single, s, layer, q.data() + r * q_row, n, out_s.data() + r * q_row,
                              part ? nullptr : &unscored, nullptr) == KVGC_OK);
        }
        row += c.n;
      }
      for (size_t i = 0; i < size_t(rows) * q_row; ++i) {
        if (max_err == 0) {
          if (std::memcmp(&out_b[i], &out_s[i], 4) != 0) FAIL("attention output " << i << " differs at layer " << layer);
        } else if (!(std::fabs(out_b[i] - out_s[i]) <= max_err)) {
          FAIL("attention output " << i << ": " << out_b[i] << " vs " << out_s[i]);
        }
      }
    }
    const kvgc_status sb = kvgc_batch_step(batch, nullptr);
    REQUIRE((sb == KVGC_OK || sb == KVGC_EBUDGET));
    ebudget += sb == KVGC_EBUDGET;
    for (const Chunk& c : work) {
      if (c.defer) continue;
      const kvgc_status ss = kvgc_step(single, seqs.at(c.id).second, nullptr);
      REQUIRE((ss == KVGC_OK || ss == KVGC_EBUDGET));
    }
    REQUIRE(kvgc_heap_check(batched) == KVGC_OK);
  }
  void compare() {
    for (auto& [id, p] : seqs)
      for (uint32_t layer = 0; layer < m.n_layers; ++layer) {
        const SegState a = read_seg(batched, m, p.first, layer), b = read_seg(single, m, p.second, layer);
        if (max_err == 0) {
          CHECK_MESSAGE(a == b, "request " << id << " layer " << layer);
          CHECK_MESSAGE(same_bits(read_meta(batched, p.first, layer), read_meta(single, p.second, layer)),
                        "request " << id << " layer " << layer << ": scores or recent scores differ");
        } else {
          CHECK(a.pos == b.pos);
          CHECK(a.cls == b.cls);
        }
      }
  }
};

}  // namespace

TEST_CASE("batch: a batch is the per-sequence calls, bit for bit on one thread") {
  for (uint32_t gqa : {1u, 4u, 8u}) {
    CAPTURE(gqa);
    for (kvgc_policy p : {KVGC_POLICY_GENERATIONAL, KVGC_POLICY_H2O, KVGC_POLICY_FULL}) {
      CAPTURE(p);
      Twin t(model(2, 2, 32, KVGC_DTYPE_F32, gqa), p);
      // Prefill chunks and decode rows in one batch, tenants 0 and 1, a request that
      // joins late, one with no new rows, one that leaves between steps.
      t.join(1, 0);
      t.join(2, 1);
      t.join(3, 0);
      t.step({{1, 37}, {2, 5}, {3, 1}});
      t.step({{1, 1}, {2, 40}, {3, 0}});
      t.join(4, 1);
      for (int s = 0; s < 30; ++s) {
        if (s == 10) t.leave(3);
        std::vector<std::pair<uint32_t, uint32_t>> w = {{1, 1}, {2, 1}, {4, s < 3 ? 21u : 1u}};
        if (s < 10) w.push_back({3, s % 2 ? 1u : 0u});
        t.step(w);
      }
      t.compare();
      if (p != KVGC_POLICY_FULL) {  // the ladder ran: tokens in int8/int4 pages were compared
        kvgc_stats st;
        kvgc_stats_init(&st);
        REQUIRE(kvgc_get_stats(t.batched, &st) == KVGC_OK);
        CHECK(st.tokens_demoted > 0);
        CHECK(st.tokens_evicted > 0);
      }
    }
  }
}

TEST_CASE("batch: scored rows and a deferred GC equal the per-sequence observe prefill, bit for bit") {
  // kvgc_batch_plan_ex: a prompt entering SnapKV-style inside the plan (chunks unscored,
  // the last chunk scoring only its last rows, no GC until the prompt's end) beside
  // decoding sequences, equal to the per-sequence calls kvgc.h names: kvgc_append and
  // kvgc_attend(KVGC_ATTEND_NO_SCORES) of the early rows, kvgc_append and kvgc_attend of
  // the last ones, no kvgc_step. Scores, recent scores (their decay: recent_decay^scored
  // rows, nothing for an unscored chunk) and every later GC decision must match.
  for (uint32_t gqa : {1u, 4u}) {
    CAPTURE(gqa);
    for (kvgc_policy p : {KVGC_POLICY_GENERATIONAL, KVGC_POLICY_H2O, KVGC_POLICY_FULL}) {
      CAPTURE(p);
      Twin t(model(2, 2, 32, KVGC_DTYPE_F32, gqa), p);
      for (uint32_t id = 1; id <= 6; ++id) t.join(id, id % 2);
      t.step_ex({{1, 40}, {2, 3}});  // 1 and 2 decode from here on, stepped as usual
      // 3: a 75-token prompt in chunks of 20, 20, 20, 15 (its last 9 rows score: the
      // observation window starts inside the chunk); 4: a chunk that scores whole but is
      // deferred, one that scores its last 2 rows (its recent scores, no longer zero,
      // decay by recent_decay^2), one unscored, both stepped; 5: likewise, deferred; 6:
      // deferred without rows; 2: one whole chunk unscored, stepped.
      using C = Twin::Chunk;
      t.step_ex({C{1, 1}, C{3, 20, 0, true}, C{4, 13, UINT32_MAX, true}, C{5, 2, 7, true}, C{6, 0, 0, true}});
      t.step_ex({C{1, 1}, C{3, 20, 0, true}, C{2, 5, 0}, C{4, 6, 2, false}});
      t.step_ex({C{3, 20, 0, true}, C{1, 1}, C{5, 11, 1, true}, C{4, 9, 0, false}});
      t.step_ex({C{1, 1}, C{3, 15, 9, true}, C{2, 1}});
      // The prompt is in and no GC has touched it; the twins agree on every score.
      uint64_t live = 0, length = 0;
      REQUIRE(kvgc_seq_tokens(t.batched, t.seqs.at(3).first, 0, &live, &length) == KVGC_OK);
      CHECK(length == 75);
      CHECK(live == 75);
      t.compare();
      // Its GC at the prompt's end, then decode, everyone stepped.
      for (int s = 0; s < 12; ++s) t.step_ex({{1, 1}, {2, 1}, {3, 1}, {4, 1}, {5, 1}, {6, 1}});
      t.compare();
      if (p != KVGC_POLICY_FULL) {
        REQUIRE(kvgc_seq_tokens(t.batched, t.seqs.at(3).first, 0, &live, &length) == KVGC_OK);
        CHECK(live < length);  // it was collected once stepped
      }
    }
  }
}

TEST_CASE("batch: a long chunk scoring its last rows equals the per-sequence calls, bit for bit") {
  // Long enough that the CPU's query blocks depend on the slot count (the unscored rows
  // fit one block over the slots they can see, not over the whole chunk's): the first
  // rows attend over exactly the slots a per-sequence call before the rest saw.
  Twin t(model(1, 2, 32, KVGC_DTYPE_F32, 4), KVGC_POLICY_FULL);
  t.join(1, 0);
  t.join(2, 0);
  t.step_ex({{1, 1400}, {2, 5}});
  t.step_ex({Twin::Chunk{1, 400, 100, true}, Twin::Chunk{2, 1}});
  t.step_ex({{1, 1}, {2, 1}});
  t.compare();
}

TEST_CASE("batch: kvgc_batch_plan_ex refuses what it does not know and changes nothing") {
  const kvgc_model_desc m = model(2, 2, 16, KVGC_DTYPE_F32);
  kvgc_heap* h = make_heap(m, KVGC_POLICY_H2O);
  kvgc_batch* b = nullptr;
  REQUIRE(kvgc_batch_create(h, &b) == KVGC_OK);
  kvgc_seq s[2];
  for (kvgc_seq& x : s) REQUIRE(kvgc_seq_create(h, 0, &x) == KVGC_OK);
  uint32_t n_new[2] = {3, 5}, flags[2] = {KVGC_BATCH_SEQ_DEFER_STEP, 0x10}, failed = 99;
  kvgc_batch_plan_options po;
  CHECK(kvgc_batch_plan_options_init(nullptr) == KVGC_EINVAL);
  REQUIRE(kvgc_batch_plan_options_init(&po) == KVGC_OK);
  CHECK(po.scored_rows == nullptr);
  CHECK(po.seq_flags == nullptr);
  po.seq_flags = flags;
  CHECK(kvgc_batch_plan_ex(b, s, n_new, 2, &po, &failed, nullptr) == KVGC_EINVAL);
  CHECK(failed == 1);
  CHECK(std::string(kvgc_errmsg(h)).find("seq_flags[1]") != std::string::npos);
  po.struct_size = sizeof po + 8;
  flags[1] = 0;
  CHECK(kvgc_batch_plan_ex(b, s, n_new, 2, &po, &failed, nullptr) == KVGC_EINVAL);
  CHECK(kvgc_batch_append(b, 0, nullptr, nullptr, nullptr) == KVGC_EINVAL);  // no plan
  kvgc_stats st;
  kvgc_stats_init(&st);
  REQUIRE(kvgc_get_stats(h, &st) == KVGC_OK);
  CHECK(st.pages_allocated == 0);
  // NULL opts is kvgc_batch_plan; a deferred sequence is not stepped.
  po.struct_size = sizeof po;
  REQUIRE(kvgc_batch_plan_ex(b, s, n_new, 2, nullptr, &failed, nullptr) == KVGC_OK);
  REQUIRE(kvgc_batch_plan_ex(b, s, n_new, 2, &po, &failed, nullptr) == KVGC_OK);
  std::vector<float> k(8 * m.n_kv_heads * m.head_dim, 0.5f);
  for (uint32_t l = 0; l < m.n_layers; ++l) REQUIRE(kvgc_batch_append(b, l, k.data(), k.data(), nullptr) == KVGC_OK);
  REQUIRE(kvgc_get_stats(h, &st) == KVGC_OK);
  const uint64_t steps = st.steps;
  const kvgc_status stepped = kvgc_batch_step(b, nullptr);
  REQUIRE((stepped == KVGC_OK || stepped == KVGC_EBUDGET));  // 5 tokens in the window: advisory
  REQUIRE(kvgc_get_stats(h, &st) == KVGC_OK);
  CHECK(st.steps == steps + 1);
  kvgc_batch_destroy(b);
  REQUIRE(kvgc_heap_check(h) == KVGC_OK);
  kvgc_heap_destroy(h);
}

TEST_CASE("batch: with threads only split sequences differ, by summation order") {
  Twin t(model(1, 2, 64, KVGC_DTYPE_F32, 4), KVGC_POLICY_FULL, 2);
  t.max_err = 1e-4;
  for (uint32_t id = 1; id <= 6; ++id) t.join(id, 0);
  t.step({{1, 700}, {2, 30}, {3, 3}, {4, 1}, {5, 200}, {6, 64}});  // 1 is long: split-K
  // Chunks scoring only their last rows (kvgc_batch_plan_ex): split-K and whole-sequence
  // tasks run both parts.
  t.step_ex({Twin::Chunk{1, 300, 40, true}, Twin::Chunk{2, 30, 7, true}, Twin::Chunk{3, 5, 0, true},
             {4, 1}, {5, 1}, {6, 1}});
  for (int s = 0; s < 4; ++s) t.step({{1, 1}, {2, 1}, {3, 1}, {4, 1}, {5, 1}, {6, 1}});
  t.compare();
}

TEST_CASE("batch: plan is all or nothing and names the first sequence that does not fit") {
  const kvgc_model_desc m = model(2, 2, 32, KVGC_DTYPE_F32);
  kvgc_heap* h = make_heap(m, KVGC_POLICY_FULL, 1, 2u << 20);  // one slab
  kvgc_batch* b = nullptr;
  REQUIRE(kvgc_batch_create(h, &b) == KVGC_OK);
  kvgc_stats st;
  kvgc_stats_init(&st);
  REQUIRE(kvgc_get_stats(h, &st) == KVGC_OK);
  const uint64_t pages = st.cls[0].page_bytes ? (2u << 20) / st.cls[0].page_bytes : 0;
  kvgc_seq s[3];
  for (kvgc_seq& x : s) REQUIRE(kvgc_seq_create(h, 0, &x) == KVGC_OK);
  // seq 0 takes about a third of the pages, seq 1 another third, seq 2 more than is left.
  const uint32_t third = uint32_t(pages / 3 / m.n_layers * 8);
  uint32_t n_new[3] = {third, third, 2 * third};
  uint32_t failed = 99;
  CHECK(kvgc_batch_plan(b, s, n_new, 3, &failed, nullptr) == KVGC_ENOMEM);
  CHECK(failed == 2);
  CHECK(std::string(kvgc_errmsg(h)).find("seqs[2]") != std::string::npos);
  kvgc_stats after;
  kvgc_stats_init(&after);
  REQUIRE(kvgc_get_stats(h, &after) == KVGC_OK);
  CHECK(after.cls[0].pages_used == st.cls[0].pages_used);  // nothing reserved
  CHECK(kvgc_batch_append(b, 0, nullptr, nullptr, nullptr) == KVGC_EINVAL);  // no plan
  // Preempt seq 2 (as an engine would) and plan the rest.
  REQUIRE(kvgc_batch_plan(b, s, n_new, 2, &failed, nullptr) == KVGC_OK);
  REQUIRE(kvgc_heap_check(h) == KVGC_OK);  // reserved pages are accounted for
  // Only layer 0 is appended: layer 1's reserved pages go back at the step.
  std::vector<float> kv(size_t(2 * third) * 2 * 32, 0.5f);
  REQUIRE(kvgc_batch_append(b, 0, kv.data(), kv.data(), nullptr) == KVGC_OK);
  CHECK(kvgc_batch_append(b, 0, kv.data(), kv.data(), nullptr) == KVGC_EINVAL);  // twice
  CHECK(kvgc_batch_attend(b, 1, kv.data(), kv.data(), nullptr, nullptr) == KVGC_EINVAL);  // not appended
  REQUIRE(kvgc_batch_step(b, nullptr) == KVGC_OK);
  REQUIRE(kvgc_heap_check(h) == KVGC_OK);
  uint64_t live = 0, len = 0;
  REQUIRE(kvgc_seq_tokens(h, s[0], 0, &live, &len) == KVGC_OK);
  CHECK(len == third);
  REQUIRE(kvgc_seq_tokens(h, s[0], 1, &live, &len) == KVGC_OK);
  CHECK(len == 0);
  kvgc_stats_init(&after);
  REQUIRE(kvgc_get_stats(h, &after) == KVGC_OK);
  CHECK(after.cls[0].pages_used == 2 * ((third + 7) / 8));
  kvgc_batch_destroy(b);
  kvgc_heap_destroy(h);
}

TEST_CASE("batch: bad arguments and stale plans are refused, changing nothing") {
  const kvgc_model_desc m = model(2, 1, 16, KVGC_DTYPE_F32);
  kvgc_heap* h = make_heap(m, KVGC_POLICY_H2O);
  kvgc_batch *b = nullptr, *b2 = nullptr;
  REQUIRE(kvgc_batch_create(h, &b) == KVGC_OK);
  REQUIRE(kvgc_batch_create(h, &b2) == KVGC_OK);
  CHECK(kvgc_batch_create(h, nullptr) == KVGC_EINVAL);
  CHECK(kvgc_batch_plan(nullptr, nullptr, nullptr, 0, nullptr, nullptr) == KVGC_EINVAL);
  kvgc_seq s[2];
  for (kvgc_seq& x : s) REQUIRE(kvgc_seq_create(h, 0, &x) == KVGC_OK);
  uint32_t n_new[2] = {4, 4}, failed = 99;
  kvgc_seq dup[2] = {s[0], s[0]};
  CHECK(kvgc_batch_plan(b, dup, n_new, 2, &failed, nullptr) == KVGC_EINVAL);
  CHECK(failed == 1);
  kvgc_seq unknown[2] = {s[0], 999};
  CHECK(kvgc_batch_plan(b, unknown, n_new, 2, &failed, nullptr) == KVGC_ENOTFOUND);
  CHECK(failed == 1);
  CHECK(kvgc_batch_plan(b, s, nullptr, 2, &failed, nullptr) == KVGC_EINVAL);
  std::vector<kvgc_seq> many(1025, s[0]);
  std::vector<uint32_t> many_n(1025, 1);
  CHECK(kvgc_batch_plan(b, many.data(), many_n.data(), 1025, &failed, nullptr) == KVGC_EINVAL);
  CHECK(std::string(kvgc_errmsg(h)).find("n_seqs") != std::string::npos);

  std::vector<float> kv(8 * 16, 1.f);
  REQUIRE(kvgc_batch_plan(b, s, n_new, 2, &failed, nullptr) == KVGC_OK);
  CHECK(kvgc_batch_append(b, 2, kv.data(), kv.data(), nullptr) == KVGC_EINVAL);  // layer range
  CHECK(kvgc_batch_append(b, 0, nullptr, kv.data(), nullptr) == KVGC_EINVAL);
  // A per-sequence append to a planned sequence makes the plan stale.
  REQUIRE(kvgc_append(h, s[1], 0, kv.data(), kv.data(), 1, nullptr) == KVGC_OK);
  CHECK(kvgc_batch_append(b, 0, kv.data(), kv.data(), nullptr) == KVGC_EINVAL);
  CHECK(std::string(kvgc_errmsg(h)).find("stale") != std::string::npos);
  REQUIRE(kvgc_heap_check(h) == KVGC_OK);
  // Planning another batch on the heap makes the first one's plan stale too.
  REQUIRE(kvgc_batch_plan(b, s, n_new, 2, &failed, nullptr) == KVGC_OK);
  REQUIRE(kvgc_batch_plan(b2, s, n_new, 1, &failed, nullptr) == KVGC_OK);
  CHECK(kvgc_batch_append(b, 0, kv.data(), kv.data(), nullptr) == KVGC_EINVAL);
  REQUIRE(kvgc_heap_check(h) == KVGC_OK);
  // A destroyed sequence makes it stale; its reserved pages still go back.
  REQUIRE(kvgc_batch_plan(b, s, n_new, 2, &failed, nullptr) == KVGC_OK);
  REQUIRE(kvgc_seq_destroy(h, s[0]) == KVGC_OK);
  CHECK(kvgc_batch_append(b, 0, kv.data(), kv.data(), nullptr) == KVGC_EINVAL);
  CHECK(std::string(kvgc_errmsg(h)).find("destroyed") != std::string::npos);
  kvgc_batch_destroy(b);
  REQUIRE(kvgc_heap_check(h) == KVGC_OK);
  kvgc_stats st;
  kvgc_stats_init(&st);
  REQUIRE(kvgc_get_stats(h, &st) == KVGC_OK);
  CHECK(st.cls[0].pages_used == 1);  // s[1]'s own append; every reservation went back
  kvgc_batch_destroy(b2);
  kvgc_heap_destroy(h);
}

TEST_CASE("batch: an engine's own attention reads the exported pages through the layout alone") {
  // A twin heap attends with kvgc_batch_attend (fused scores); the other exports its pages
  // and runs a reference kernel written against kvgc.h's documented layout, then hands the
  // mass back with kvgc_batch_observe. Outputs and scores must agree, with tokens in every
  // class (the ladder demotes under the byte budget).
  const kvgc_model_desc m = model(1, 2, 32, KVGC_DTYPE_F32, 2);
  kvgc_heap* ha = make_heap(m, KVGC_POLICY_H2O, 1, 64u << 20, 0.35);
  kvgc_heap* hb = make_heap(m, KVGC_POLICY_H2O, 1, 64u << 20, 0.35);
  kvgc_batch *ba, *bb;
  REQUIRE(kvgc_batch_create(ha, &ba) == KVGC_OK);
  REQUIRE(kvgc_batch_create(hb, &bb) == KVGC_OK);
  kvgc_page_layout lay[KVGC_CLASS_COUNT];
  for (int c = 0; c < KVGC_CLASS_COUNT; ++c) {
    std::memset(&lay[c], 0, sizeof lay[c]);
    lay[c].struct_size = sizeof lay[c];
    REQUIRE(kvgc_page_layout_get(hb, kvgc_storage_class(c), &lay[c]) == KVGC_OK);
    CHECK(lay[c].version == KVGC_PAGE_LAYOUT_VERSION);
  }
  kvgc_seq sa[3], sb[3];
  for (int i = 0; i < 3; ++i) {
    REQUIRE(kvgc_seq_create(ha, 0, &sa[i]) == KVGC_OK);
    REQUIRE(kvgc_seq_create(hb, 0, &sb[i]) == KVGC_OK);
  }
  std::mt19937 rng(7);
  const uint32_t H = m.n_kv_heads, G = m.n_q_heads / H, D = m.head_dim;
  auto bf16 = [](const uint8_t* p) {
    uint16_t w;
    std::memcpy(&w, p, 2);
    const uint32_t u = uint32_t(w) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  };
  uint64_t demoted_seen = 0;
  for (int step = 0; step < 40; ++step) {
    uint32_t n_new[3] = {step == 0 ? 30u : 1u, step == 0 ? 3u : 1u, step == 0 ? 64u : (step % 3 == 0)};
    const uint32_t rows = n_new[0] + n_new[1] + n_new[2];
    uint32_t failed;
    REQUIRE(kvgc_batch_plan(ba, sa, n_new, 3, &failed, nullptr) == KVGC_OK);
    REQUIRE(kvgc_batch_plan(bb, sb, n_new, 3, &failed, nullptr) == KVGC_OK);
    const std::vector<float> k = random_rows(rng, rows * H * D + 1), v = random_rows(rng, rows * H * D + 1);
    const std::vector<float> q = random_rows(rng, rows * H * G * D + 1);
    std::vector<float> out_a(rows * H * G * D + 1, NAN), out_b(rows * H * G * D + 1, NAN);
    REQUIRE(kvgc_batch_append(ba, 0, k.data(), v.data(), nullptr) == KVGC_OK);
    REQUIRE(kvgc_batch_append(bb, 0, k.data(), v.data(), nullptr) == KVGC_OK);
    REQUIRE(kvgc_batch_attend(ba, 0, q.data(), out_a.data(), nullptr, nullptr) == KVGC_OK);
    kvgc_batch_view view;
    std::memset(&view, 0, sizeof view);
    view.struct_size = sizeof view;
    REQUIRE(kvgc_batch_export(bb, 0, &view) == KVGC_OK);
    REQUIRE(view.n_seqs == 3);
    REQUIRE(view.n_rows == rows);
    std::vector<float> mass(size_t(view.n_pages) * view.page_tokens, NAN);
    // The engine's kernel: for each sequence, query row and query head, softmax over the
    // live, causally visible slots of its pages.
    auto elem = [&](const uint8_t* page, const kvgc_page_layout& L, uint32_t h, uint32_t s, uint32_t d, bool is_v) {
      const uint8_t* base = page + (is_v ? L.v_offset : L.k_offset) + h * L.head_stride + s * L.slot_stride;
      const uint8_t* qw = page + (is_v ? L.vq_offset : L.kq_offset) + 2 * ((size_t(h) * L.page_tokens + s) * L.qwords);
      if (L.cls == KVGC_CLASS_FP16) {
        float f;
        std::memcpy(&f, base + 4 * d, 4);
        return f;
      }
      if (L.cls == KVGC_CLASS_INT8) return float(int8_t(base[d])) * bf16(qw);
      const uint32_t nib = (base[d / 2] >> (4 * (d % 2))) & 0xf, g = d / L.group;
      return float(nib) * bf16(qw + 4 * g) + bf16(qw + 4 * g + 2);
    };
    for (uint32_t i = 0; i < view.n_seqs; ++i)
      for (uint32_t r = view.q_indptr[i]; r < view.q_indptr[i + 1]; ++r) {
        const int32_t qpos = view.q_pos0[i] + int32_t(r - view.q_indptr[i]);
        for (uint32_t qh = 0; qh < H * G; ++qh) {
          const uint32_t h = qh / G;
          const float* qv = q.data() + (size_t(r) * H * G + qh) * D;
          std::vector<std::pair<double, std::pair<uint32_t, uint32_t>>> logits;  // (logit, (page, slot))
          for (uint32_t p = view.page_indptr[i]; p < view.page_indptr[i + 1]; ++p) {
            const kvgc_page_layout& L = lay[view.page_class[p]];
            const uint8_t* page = static_cast<const uint8_t*>(view.arena_base) + view.page_offset[p];
            const uint32_t* live = reinterpret_cast<const uint32_t*>(page + L.live_offset);
            const int32_t* pos = reinterpret_cast<const int32_t*>(page + L.pos_offset);
            for (uint32_t s = 0; s < L.page_tokens; ++s) {
              if (!(live[s / 32] >> (s % 32) & 1u) || pos[s] > qpos) continue;
              double dot = 0;
              for (uint32_t d = 0; d < D; ++d) dot += double(qv[d]) * elem(page, L, h, s, d, false);
              logits.push_back({dot / std::sqrt(double(D)), {p, s}});
            }
          }
          double mx = -INFINITY, sum = 0;
          for (auto& x : logits) mx = std::max(mx, x.first);
          for (auto& x : logits) sum += std::exp(x.first - mx);
          for (uint32_t d = 0; d < D; ++d) {
            double acc = 0;
            for (auto& x : logits) {
              const uint32_t p = x.second.first;
              const uint8_t* page = static_cast<const uint8_t*>(view.arena_base) + view.page_offset[p];
              acc += std::exp(x.first - mx) / sum * elem(page, lay[view.page_class[p]], h, x.second.second, d, true);
            }
            out_b[(size_t(r) * H * G + qh) * D + d] = float(acc);
          }
          for (auto& x : logits) {
            float& slot_mass = mass[size_t(x.second.first) * view.page_tokens + x.second.second];
            if (std::isnan(slot_mass)) slot_mass = 0;
            slot_mass += float(std::exp(x.first - mx) / sum);
          }
        }
      }
    for (uint32_t p = 0; p < view.n_pages; ++p) demoted_seen += view.page_class[p] != KVGC_CLASS_FP16;
    REQUIRE(kvgc_batch_observe(bb, 0, mass.data(), nullptr) == KVGC_OK);  // NaN (dead/unseen) adds nothing
    for (size_t i = 0; i < size_t(rows) * H * G * D; ++i)
      REQUIRE_MESSAGE(std::fabs(out_a[i] - out_b[i]) <= 1e-4f * (1 + std::fabs(out_a[i])), "step " << step << " row elem " << i);
    REQUIRE(kvgc_batch_step(ba, nullptr) != KVGC_EINVAL);
    REQUIRE(kvgc_batch_step(bb, nullptr) != KVGC_EINVAL);
    for (int i = 0; i < 3; ++i) {  // same scores, so the GC decides the same
      const SegState a = read_seg(ha, m, sa[i], 0), b = read_seg(hb, m, sb[i], 0);
      REQUIRE(a.pos == b.pos);
      REQUIRE(a.cls == b.cls);
      for (size_t j = 0; j + 1 < a.scores.size(); ++j)
        REQUIRE(std::fabs(a.scores[j] - b.scores[j]) <= 1e-4f * (1 + a.scores[j]));
    }
  }
  CHECK(demoted_seen > 0);  // int8/int4 pages were read through the layout
  kvgc_batch_destroy(ba);
  kvgc_batch_destroy(bb);
  kvgc_heap_destroy(ha);
  kvgc_heap_destroy(hb);
}

TEST_CASE("batch: a tenant limit set while a plan holds pages counts them, and quotas name the sequence") {
  // Found by fuzz_api: the limit's first count missed the plan's reserved pages, so once
  // appended the tenant held more than it was charged.
  const kvgc_model_desc m = model(2, 1, 16, KVGC_DTYPE_F32);
  kvgc_heap* h = make_heap(m, KVGC_POLICY_FULL);
  kvgc_batch* b = nullptr;
  REQUIRE(kvgc_batch_create(h, &b) == KVGC_OK);
  kvgc_seq s[2];
  REQUIRE(kvgc_seq_create(h, 3, &s[0]) == KVGC_OK);
  REQUIRE(kvgc_seq_create(h, 3, &s[1]) == KVGC_OK);
  uint32_t n_new[2] = {5, 5}, failed = 99;
  REQUIRE(kvgc_batch_plan(b, s, n_new, 2, &failed, nullptr) == KVGC_OK);
  REQUIRE(kvgc_tenant_set_limit(h, 3, 1 << 20) == KVGC_OK);
  REQUIRE(kvgc_heap_check(h) == KVGC_OK);
  std::vector<float> kv(10 * 16, 1.f);
  REQUIRE(kvgc_batch_append(b, 0, kv.data(), kv.data(), nullptr) == KVGC_OK);
  REQUIRE(kvgc_batch_append(b, 1, kv.data(), kv.data(), nullptr) == KVGC_OK);
  REQUIRE(kvgc_batch_step(b, nullptr) == KVGC_OK);
  REQUIRE(kvgc_heap_check(h) == KVGC_OK);
  uint64_t used = 0, limit = 0;
  REQUIRE(kvgc_tenant_usage(h, 3, &used, &limit) == KVGC_OK);
  kvgc_stats st;
  kvgc_stats_init(&st);
  REQUIRE(kvgc_get_stats(h, &st) == KVGC_OK);
  CHECK(used == st.cls[0].used_bytes);
  // A quota of what the tenant holds now: the first sequence needing a page is refused.
  REQUIRE(kvgc_tenant_set_limit(h, 3, used) == KVGC_OK);
  n_new[0] = 3;   // fits its tail page
  n_new[1] = 20;  // needs new pages
  CHECK(kvgc_batch_plan(b, s, n_new, 2, &failed, nullptr) == KVGC_EBUDGET);
  CHECK(failed == 1);
  CHECK(std::string(kvgc_errmsg(h)).find("seqs[1]") != std::string::npos);
  REQUIRE(kvgc_heap_check(h) == KVGC_OK);
  kvgc_batch_destroy(b);
  kvgc_heap_destroy(h);
}

TEST_CASE("batch: a 128K-token sequence beside one-token ones equals the per-sequence calls") {
  // Lengths from 1 to 128K in one batch: the long one is filled by per-sequence appends
  // (a 128K-query prefill would take minutes), then every step decodes a row for each.
  const kvgc_model_desc m = model(1, 1, 16, KVGC_DTYPE_F32, 4);
  kvgc_heap* hb = make_heap(m, KVGC_POLICY_FULL, 1, 96u << 20);
  kvgc_heap* hs = make_heap(m, KVGC_POLICY_FULL, 1, 96u << 20);
  kvgc_batch* b = nullptr;
  REQUIRE(kvgc_batch_create(hb, &b) == KVGC_OK);
  const uint32_t lengths[4] = {128u << 10, 1, 0, 300};
  kvgc_seq sb[4], ss[4];
  std::mt19937 rng(5);
  for (int i = 0; i < 4; ++i) {
    REQUIRE(kvgc_seq_create(hb, 0, &sb[i]) == KVGC_OK);
    REQUIRE(kvgc_seq_create(hs, 0, &ss[i]) == KVGC_OK);
    for (uint32_t done = 0; done < lengths[i];) {
      const uint32_t n = std::min<uint32_t>(lengths[i] - done, 8192);
      const std::vector<float> k = random_rows(rng, n * 16), v = random_rows(rng, n * 16);
      REQUIRE(kvgc_append(hb, sb[i], 0, k.data(), v.data(), n, nullptr) == KVGC_OK);
      REQUIRE(kvgc_append(hs, ss[i], 0, k.data(), v.data(), n, nullptr) == KVGC_OK);
      done += n;
    }
  }
  for (int step = 0; step < 3; ++step) {
    uint32_t n_new[4] = {1, 1, 1, 1}, failed = 99;
    REQUIRE(kvgc_batch_plan(b, sb, n_new, 4, &failed, nullptr) == KVGC_OK);
    const std::vector<float> k = random_rows(rng, 4 * 16), v = random_rows(rng, 4 * 16), q = random_rows(rng, 4 * 64);
    std::vector<float> ob(4 * 64, NAN), os(4 * 64, NAN);
    REQUIRE(kvgc_batch_append(b, 0, k.data(), v.data(), nullptr) == KVGC_OK);
    REQUIRE(kvgc_batch_attend(b, 0, q.data(), ob.data(), nullptr, nullptr) == KVGC_OK);
    for (int i = 0; i < 4; ++i) {
      REQUIRE(kvgc_append(hs, ss[i], 0, k.data() + i * 16, v.data() + i * 16, 1, nullptr) == KVGC_OK);
      REQUIRE(kvgc_attend(hs, ss[i], 0, q.data() + i * 64, 1, os.data() + i * 64, nullptr, nullptr) == KVGC_OK);
    }
    CHECK(std::memcmp(ob.data(), os.data(), ob.size() * 4) == 0);
    REQUIRE(kvgc_batch_step(b, nullptr) == KVGC_OK);
  }
  uint64_t live = 0, len = 0;
  REQUIRE(kvgc_seq_tokens(hb, sb[0], 0, &live, &len) == KVGC_OK);
  CHECK(len == (128u << 10) + 3);
  REQUIRE(kvgc_heap_check(hb) == KVGC_OK);
  kvgc_batch_destroy(b);
  kvgc_heap_destroy(hb);
  kvgc_heap_destroy(hs);
}

// Issue 22 (part 1): a plan went stale per (sequence, layer), not as a whole. A
// per-sequence append to one layer of a planned sequence failed only that layer's batch
// calls: layers 0 and 2 took the step's rows, layer 1 did not (the sequence ended with 3,
// 1 and 3 tokens). kvgc.h: every later call on a stale plan fails with KVGC_EINVAL and
// changes nothing, whichever layer it names.
TEST_CASE("batch: a plan goes stale as a whole, whichever layer a per-sequence call touched") {
  const kvgc_model_desc m = model(3, 2, 16, KVGC_DTYPE_F32);
  kvgc_heap_options o;
  kvgc_heap_options_init(&o);  // the defaults, on the CPU, in a small arena
  o.flags = KVGC_OPT_IGNORE_ENV;
  o.device = KVGC_DEVICE_CPU;
  o.budget_bytes = 16u << 20;
  kvgc_heap* h = nullptr;
  REQUIRE(kvgc_heap_create(&m, &o, &h) == KVGC_OK);
  kvgc_batch* b = nullptr;
  REQUIRE(kvgc_batch_create(h, &b) == KVGC_OK);
  kvgc_seq s;
  REQUIRE(kvgc_seq_create(h, 0, &s) == KVGC_OK);
  auto lengths = [&] {
    std::vector<uint64_t> len(m.n_layers);
    for (uint32_t l = 0; l < m.n_layers; ++l)
      REQUIRE(kvgc_seq_tokens(h, s, l, nullptr, &len[l]) == KVGC_OK);
    return len;
  };
  const size_t row = size_t(m.n_kv_heads) * m.head_dim, q_row = size_t(m.n_q_heads) * m.head_dim;
  std::vector<float> k(3 * row, 0.5f), q(3 * q_row, 0.25f), out(3 * q_row), mass(64, 0.1f);
  uint32_t n = 3, failed = 99;

  // The repro, exactly.
  REQUIRE(kvgc_batch_plan(b, &s, &n, 1, &failed, nullptr) == KVGC_OK);
  REQUIRE(kvgc_append(h, s, 1, k.data(), k.data(), 1, nullptr) == KVGC_OK);  // layer 1 only
  const std::vector<uint64_t> before = lengths();
  CHECK(before == std::vector<uint64_t>{0, 1, 0});
  CHECK(kvgc_batch_append(b, 0, k.data(), k.data(), nullptr) == KVGC_EINVAL);
  CHECK(std::string(kvgc_errmsg(h)).find("stale") != std::string::npos);
  CHECK(std::string(kvgc_errmsg(h)).find("layer 1") != std::string::npos);
  CHECK(kvgc_batch_append(b, 1, k.data(), k.data(), nullptr) == KVGC_EINVAL);
  CHECK(kvgc_batch_append(b, 2, k.data(), k.data(), nullptr) == KVGC_EINVAL);
  CHECK(kvgc_batch_step(b, nullptr) == KVGC_EINVAL);
  // The batch added the same to every layer: nothing.
  CHECK(lengths() == before);
  REQUIRE(kvgc_heap_check(h) == KVGC_OK);

  // Layers even again, then a whole plan runs: every layer takes the step's rows.
  REQUIRE(kvgc_append(h, s, 0, k.data(), k.data(), 1, nullptr) == KVGC_OK);
  REQUIRE(kvgc_append(h, s, 2, k.data(), k.data(), 1, nullptr) == KVGC_OK);
  REQUIRE(kvgc_batch_plan(b, &s, &n, 1, &failed, nullptr) == KVGC_OK);
  for (uint32_t l = 0; l < m.n_layers; ++l) {
    REQUIRE(kvgc_batch_append(b, l, k.data(), k.data(), nullptr) == KVGC_OK);
    REQUIRE(kvgc_batch_attend(b, l, q.data(), out.data(), nullptr, nullptr) == KVGC_OK);
  }
  REQUIRE(kvgc_batch_step(b, nullptr) == KVGC_OK);
  CHECK(lengths() == std::vector<uint64_t>{4, 4, 4});

  // Stale after a layer already ran: the calls made before it stand, every later one
  // fails (a layer already appended cannot be attended, exported or observed either).
  REQUIRE(kvgc_batch_plan(b, &s, &n, 1, &failed, nullptr) == KVGC_OK);
  REQUIRE(kvgc_batch_append(b, 0, k.data(), k.data(), nullptr) == KVGC_OK);
  REQUIRE(kvgc_append(h, s, 2, k.data(), k.data(), 1, nullptr) == KVGC_OK);
  CHECK(kvgc_batch_attend(b, 0, q.data(), out.data(), nullptr, nullptr) == KVGC_EINVAL);
  kvgc_batch_view view;
  std::memset(&view, 0, sizeof view);
  view.struct_size = sizeof view;
  CHECK(kvgc_batch_export(b, 0, &view) == KVGC_EINVAL);
  CHECK(kvgc_batch_observe(b, 0, mass.data(), nullptr) == KVGC_EINVAL);
  CHECK(kvgc_batch_append(b, 1, k.data(), k.data(), nullptr) == KVGC_EINVAL);
  CHECK(kvgc_batch_step(b, nullptr) == KVGC_EINVAL);
  CHECK(lengths() == std::vector<uint64_t>{7, 4, 5});  // layer 0's batch rows, layer 2's own
  REQUIRE(kvgc_heap_check(h) == KVGC_OK);

  // A per-sequence step of another planned sequence (its GC may change any layer's pages):
  // the same holds for it.
  kvgc_seq t;
  REQUIRE(kvgc_seq_create(h, 0, &t) == KVGC_OK);
  std::vector<float> big(200 * row, 0.5f);
  for (uint32_t l = 0; l < m.n_layers; ++l)
    REQUIRE(kvgc_append(h, t, l, big.data(), big.data(), 200, nullptr) == KVGC_OK);
  kvgc_seq both[2] = {s, t};
  uint32_t n2[2] = {1, 1};
  REQUIRE(kvgc_batch_plan(b, both, n2, 2, &failed, nullptr) == KVGC_OK);
  const kvgc_status ss = kvgc_step(h, t, nullptr);
  REQUIRE((ss == KVGC_OK || ss == KVGC_EBUDGET));
  for (uint32_t l = 0; l < m.n_layers; ++l)
    CHECK(kvgc_batch_append(b, l, k.data(), k.data(), nullptr) == KVGC_EINVAL);
  CHECK(kvgc_batch_step(b, nullptr) == KVGC_EINVAL);
  CHECK(lengths() == std::vector<uint64_t>{7, 4, 5});
  kvgc_batch_destroy(b);
  REQUIRE(kvgc_heap_check(h) == KVGC_OK);
  kvgc_heap_destroy(h);
}
