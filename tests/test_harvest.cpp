// The deferred harvest (runtime/harvest.cpp) on the CPU backend: a GC's results applied
// at the next step make the same decisions as results applied at once; attention,
// appends, the walker and destruction work while a GC is pending.
#include <doctest/doctest.h>

#include <cstring>
#include <map>
#include <tuple>

#include "../c_api/internal.hpp"
#include "../runtime/heap.hpp"
#include "gc_util.hpp"

using namespace kvgc_test;

namespace {

uint64_t pending(kvgc_heap* h) { return kvgc::internal_heap(h)->pending_gcs(); }

// Everything a decision shows, by position: score, generation, K/V (via verify_gaussian).
struct Token {
  float score;
  uint8_t gen;
  bool operator==(const Token&) const = default;
};

std::map<int32_t, Token> tokens(Heap& H, kvgc_seq s, uint32_t layer) {
  const std::vector<int32_t> pos = H.positions(s, layer);
  std::vector<float> score(pos.size());
  std::vector<uint8_t> gen(pos.size());
  uint64_t n = 0;
  REQUIRE(kvgc_read_scores(H.h, s, layer, score.data(), gen.data(), pos.size(), &n, nullptr) ==
          KVGC_OK);
  std::map<int32_t, Token> out;
  for (size_t i = 0; i < pos.size(); ++i) out[pos[i]] = {score[i], gen[i]};
  return out;
}

// Mass that differs by position and step, identical whichever page a token sits in.
// Ties in the ranking key are broken by read order (page, slot), which compaction
// timing changes; distinct masses keep the comparison about the decisions.
double mass(int32_t pos, int step) { return double(mix(uint64_t(pos) * 131 + uint64_t(step))) / 4294967296.0 + 1e-3; }

}  // namespace

TEST_CASE("deferred and immediate harvest make the same decisions: every policy, every ladder") {
  const kvgc_model_desc m = model(2, 2, 32);
  for (const kvgc_policy policy : {KVGC_POLICY_H2O, KVGC_POLICY_GENERATIONAL, KVGC_POLICY_STREAMING,
                                   KVGC_POLICY_RANDOM})
    for (const kvgc_demote demote : {KVGC_DEMOTE_OFF, KVGC_DEMOTE_INT4, KVGC_DEMOTE_INT8, KVGC_DEMOTE_LADDER}) {
      CAPTURE(policy);
      CAPTURE(demote);
      // A window of 24 > two appends: every token is observed before it can be ranked.
      kvgc_heap_options o = gc_options(policy, 48, 4, 24, 8);
      o.demote = demote;
      o.compact_threshold = 0.2;
      o.harvest = KVGC_HARVEST_IMMEDIATE;
      Heap now(o, m);
      o.harvest = KVGC_HARVEST_DEFERRED;
      Heap late(o, m);
      kvgc_seq a, b;
      REQUIRE(kvgc_seq_create(now.h, 0, &a) == KVGC_OK);
      REQUIRE(kvgc_seq_create(late.h, 0, &b) == KVGC_OK);
      REQUIRE(a == b);  // same id: the same K/V and the same random keys
      int64_t len = 0;
      uint64_t pending_seen = 0;
      for (int step = 0; step < 40; ++step) {
        CAPTURE(step);
        const uint32_t n = 1 + uint32_t(mix(uint64_t(step) * 977) % 12);
        for (uint32_t layer = 0; layer < m.n_layers; ++layer) {
          now.append(a, layer, len, n);
          late.append(b, layer, len, n);  // into a segment whose GC may be pending
        }
        len += n;
        if (step % 2 == 0)  // observing settles: every other step keeps results pending
          for (uint32_t layer = 0; layer < m.n_layers; ++layer) {
            now.observe(a, layer, [&](int32_t p) { return mass(p, step); });
            late.observe(b, layer, [&](int32_t p) { return mass(p, step); });
          }
        const kvgc_status s1 = now.step(a), s2 = late.step(b);
        CHECK(s1 == s2);
        pending_seen += pending(late.h);
        CHECK(pending(now.h) == 0);
        late.check();  // the walker, on a heap with results pending
        if (step % 4 != 3) continue;
        for (uint32_t layer = 0; layer < m.n_layers; ++layer) {
          CAPTURE(layer);
          const auto tx = tokens(now, a, layer), ty = tokens(late, b, layer);
          CHECK(tx == ty);
          CHECK(verify_gaussian(late.h, m, b, layer, 0.12).empty());
        }
        const kvgc_stats x = now.stats(), y = late.stats();
        CHECK(x.live_tokens == y.live_tokens);
        CHECK(std::make_tuple(x.gcs, x.minor_gcs, x.major_gcs, x.tokens_ranked) ==
              std::make_tuple(y.gcs, y.minor_gcs, y.major_gcs, y.tokens_ranked));
        CHECK(std::make_tuple(x.tokens_evicted, x.tokens_demoted, x.tokens_promoted,
                              x.tokens_tenured) ==
              std::make_tuple(y.tokens_evicted, y.tokens_demoted, y.tokens_promoted,
                              y.tokens_tenured));
        CHECK(x.ebudget == y.ebudget);
        CHECK(pending(late.h) == 0);  // stats applied everything
      }
      CHECK(pending_seen > 0);  // the deferred heap really had results outstanding
      CHECK(now.stats().tokens_evicted > 0);
      if (demote == KVGC_DEMOTE_INT4 && policy != KVGC_POLICY_STREAMING &&
          policy != KVGC_POLICY_RANDOM)
        CHECK(late.stats().tokens_demoted > 0);
    }
}

TEST_CASE("while a GC is pending: attention equals attention after it is applied; reads settle one segment") {
  const kvgc_model_desc m = model(2, 2, 32);
  kvgc_heap_options o = gc_options(KVGC_POLICY_H2O, 40, 4, 8, 8);
  o.demote = KVGC_DEMOTE_INT4;  // demotion targets: int4 slots reserved until applied
  Heap A(o, m), B(o, m);
  kvgc_seq a, b;
  REQUIRE(kvgc_seq_create(A.h, 0, &a) == KVGC_OK);
  REQUIRE(kvgc_seq_create(B.h, 0, &b) == KVGC_OK);
  for (Heap* H : {&A, &B})
    for (uint32_t layer = 0; layer < 2; ++layer) {
      H->append(a, layer, 0, 150);
      H->observe(a, layer, [](int32_t p) { return weight(p); });
    }
  REQUIRE(A.step(a) == KVGC_OK);
  REQUIRE(B.step(b) == KVGC_OK);
  CHECK(pending(A.h) == 2);
  A.check();
  // A attends with both layers pending; B applies layer 0's results first (a read of
  // the segment settles it, and only it).
  uint64_t live = 0;
  REQUIRE(kvgc_seq_tokens(B.h, b, 0, &live, nullptr) == KVGC_OK);
  CHECK(pending(B.h) == 1);
  CHECK(live < 150);
  CHECK(live > 40);  // int4 tokens cost less: more than 40 stay
  for (Heap* H : {&A, &B}) H->append(a, 0, 150, 3);  // three queries' own K/V
  const std::vector<uint8_t> q = gaussian(m, 99, 0, 0, 3, false);
  std::vector<uint8_t> out_a(q.size(), 0xcd), out_b(q.size(), 0x5a);
  REQUIRE(kvgc_attend(A.h, a, 0, q.data(), 3, out_a.data(), nullptr, nullptr) == KVGC_OK);
  CHECK(pending(A.h) == 2);  // attention did not wait for the results
  REQUIRE(kvgc_attend(B.h, b, 0, q.data(), 3, out_b.data(), nullptr, nullptr) == KVGC_OK);
  CHECK(out_a == out_b);
  CHECK(tokens(A, a, 0) == tokens(B, b, 0));  // the same mass went to the same tokens
  CHECK(pending(A.h) == 1);
  A.check();
  // The next step applies layer 1's results before planning; then both heaps agree.
  REQUIRE(A.step(a) == KVGC_OK);
  REQUIRE(B.step(b) == KVGC_OK);
  for (uint32_t layer = 0; layer < 2; ++layer) CHECK(tokens(A, a, layer) == tokens(B, b, layer));
  CHECK(A.stats().tokens_demoted > 0);
  // Destroying a sequence with results pending frees everything.
  for (uint32_t layer = 0; layer < 2; ++layer) A.append(a, layer, 153, 40);
  REQUIRE(A.step(a) == KVGC_OK);
  CHECK(pending(A.h) > 0);
  REQUIRE(kvgc_seq_destroy(A.h, a) == KVGC_OK);
  CHECK(pending(A.h) == 0);
  const kvgc_stats st = A.stats();
  CHECK(st.cls[0].pages_used + st.cls[1].pages_used == 0);
  A.check();
}

TEST_CASE("KVGC_HARVEST=immediate applies within the step; deferred leaves the results for later") {
  for (const kvgc_harvest harvest : {KVGC_HARVEST_IMMEDIATE, KVGC_HARVEST_DEFERRED}) {
    CAPTURE(harvest);
    kvgc_heap_options o = gc_options(KVGC_POLICY_STREAMING, 20, 4, 8, 8);
    o.harvest = harvest;
    Heap H(o, model(3, 2, 32));
    kvgc_seq s;
    REQUIRE(kvgc_seq_create(H.h, 0, &s) == KVGC_OK);
    for (uint32_t layer = 0; layer < 3; ++layer) H.append(s, layer, 0, 64);
    REQUIRE(H.step(s) == KVGC_OK);
    CHECK(pending(H.h) == (harvest == KVGC_HARVEST_DEFERRED ? 3u : 0u));
    H.check();
    kvgc_heap_options got;
    kvgc_heap_options_init(&got);
    REQUIRE(kvgc_heap_get_options(H.h, &got) == KVGC_OK);
    CHECK(got.harvest == harvest);
    const kvgc_stats st = H.stats();  // exact counts either way
    CHECK(pending(H.h) == 0);
    CHECK(st.live_tokens == 3 * 20);
    CHECK(st.tokens_evicted == 3 * 44);
  }
}
