// GC planning: the host decides *whether* a segment collects, *which tiers* are ranked
// and *how much* it gives back; a data-plane op (kernels/) decides *which* tokens. Pure
// arithmetic over page-granular counts, so every policy is testable without a heap.
//
// Five policies, one mechanism (a priority key plus protection rules):
//   full          never evicts (still paged, still compacts)
//   streaming     protects sinks + young window; evicts the oldest (key = position)
//   h2o           protects sinks + young window; evicts the lowest accumulated score
//   random        protects sinks + young window; evicts by a seeded hash (control)
//   generational  minor GC every page_tokens new tokens: tenures tokens leaving the
//                 young window into the intermediate tier, ranks that tier only,
//                 promotes its stable heavy hitters to long-term, evicts its lowest;
//                 a major GC ranks long-term too, only when a minor GC cannot meet the
//                 budget or long-term is full while heavy hitters wait for promotion.
// Budgets are in units of page bytes per slot x page_tokens (a token of class c costs
// unit_cost[c], its class's page bytes): integers, so every sum is exact on any executor.
// A token budget of T tokens is T x unit_cost[FP16]; a byte budget of B bytes is
// B x page_tokens. Demoted tokens cost their class's share, so demotion keeps more
// tokens per byte.
#pragma once

#include <cstdint>

#include "../kernels/ops.hpp"
#include "kvgc.h"

namespace kvgc {

constexpr uint64_t kNoBudget = UINT64_MAX;
constexpr uint8_t kPromoteAge = 2;        // minor GCs survived before promotion
constexpr uint32_t kMajorEveryMinors = 8;  // at most one promotion-driven major GC per 8 minors

struct PolicyParams {
  kvgc_policy policy = KVGC_POLICY_GENERATIONAL;
  uint32_t sinks = 4, window = 64, page_tokens = 16;
  // Under a byte budget the young window is an eighth of the budget in fp16 tokens,
  // within window_min..window (kvgc.h, window_min); otherwise it is `window`.
  bool window_scales = false;
  uint32_t window_min = 8;
  uint64_t unit_cost[KVGC_CLASS_COUNT] = {1, 1, 1, 1};  // page bytes per class
  bool recent = false;  // generational: the intermediate tier is ranked by recent score
};

// What the host knows about a segment: exact, because the previous GC's results are
// applied before planning (runtime/harvest.cpp).
struct SegmentView {
  uint64_t length = 0;               // tokens appended so far (next position)
  uint64_t live[KVGC_CLASS_COUNT] = {};
  uint64_t tier[4] = {0, 0, 0, 0};   // live tokens per SlotGen
  uint32_t since_minor = 0;          // tokens appended since the last minor GC
  uint32_t minors_since_major = 0;
  bool promote_blocked = false;      // the last minor GC had heavy hitters but no room
  uint64_t budget = kNoBudget;       // this segment's budget, units (see above)
  bool bytes_over = false;           // its pages, once compacted, exceed its byte budget
};

struct GcPlan {
  bool run = false;
  bool major = false;                // generational: long-term is ranked too
  int64_t tenure_before = -1;        // young slots with position < this leave the window
  uint8_t candidates = 0;            // gen_bit mask of the tiers ranked
  KeyKind key = KeyKind::Score;
  uint64_t reclaim = 0;              // units to give back
  uint32_t promote = 0;              // intermediate -> long-term, top-ranked, age >= kPromoteAge
  uint64_t retier_top = 0;           // major GC: keep the top this many as long-term
  bool retier = false;
  bool age_intermediate = false;     // survivors of the intermediate tier age by one
};

uint64_t segment_cost(const PolicyParams& p, const SegmentView& s);
// The young window of a segment whose budget is `budget` units (kNoBudget: none). A
// budget that grows with the length (a fraction) grows the window by at most one token
// per eight, so a window's start never moves back: no token re-enters it.
uint64_t young_window(const PolicyParams& p, uint64_t budget);
// The same for a budget of `fp16_tokens` fp16 tokens' worth.
uint64_t young_window_of_tokens(const PolicyParams& p, uint64_t fp16_tokens);
// Tokens no policy may evict: the sinks and the young window.
uint64_t protected_tokens(const PolicyParams& p, const SegmentView& s);
// The intermediate tier's share of a generational budget of `budget` fp16 tokens: what
// long-term leaves free.
uint64_t intermediate_target(const PolicyParams& p, uint64_t budget);

GcPlan plan_gc(const PolicyParams& p, const SegmentView& s);

}  // namespace kvgc
