#include "plan.hpp"

#include <algorithm>
#include <cmath>

#include "../kernels/page_layout.hpp"

namespace kvgc {

uint64_t segment_cost(const PolicyParams& p, const SegmentView& s) {
  uint64_t cost = 0;
  for (int c = 0; c < KVGC_CLASS_COUNT; ++c) cost += s.live[c] * p.unit_cost[c];
  return cost;
}

uint64_t young_window_of_tokens(const PolicyParams& p, uint64_t fp16_tokens) {
  if (!p.window_scales || p.window_min >= p.window) return p.window;
  return std::min<uint64_t>(p.window, std::max<uint64_t>(p.window_min, fp16_tokens / 8));
}

uint64_t young_window(const PolicyParams& p, uint64_t budget) {
  return budget == kNoBudget ? p.window
                             : young_window_of_tokens(p, budget / p.unit_cost[KVGC_CLASS_FP16]);
}

uint64_t protected_tokens(const PolicyParams& p, const SegmentView& s) {
  const uint64_t sinks = std::min<uint64_t>(p.sinks, s.length);
  const uint64_t young = std::min<uint64_t>(young_window(p, s.budget), s.length - sinks);
  return sinks + young;
}

uint64_t intermediate_target(const PolicyParams& p, uint64_t budget) {
  const uint64_t protect = uint64_t(p.sinks) + young_window_of_tokens(p, budget);
  const uint64_t rest = budget > protect ? budget - protect : 0;
  // Half of what the protected tokens leave: recency is what prediction needs most
  // (streaming perplexity, 2K tokens of the Jargon File with a 256-token cache, minors by
  // recent score: a quarter 1.061x the full cache, half 1.049x, three quarters 1.043x;
  // streaming 1.104x), and the pillars keep the other half.
  return std::min<uint64_t>(rest, std::max<uint64_t>(2ull * p.page_tokens, rest / 2));
}

GcPlan plan_gc(const PolicyParams& p, const SegmentView& s) {
  GcPlan g;
  if (p.policy == KVGC_POLICY_FULL) return g;
  // Tokens leave the young window once `window` newer tokens exist (sinks never do).
  const uint64_t window = young_window(p, s.budget);
  const int64_t window_start = int64_t(s.length) - int64_t(window);
  const uint64_t cost = segment_cost(p, s);
  const uint64_t over = s.budget == kNoBudget || cost <= s.budget ? 0 : cost - s.budget;
  g.tenure_before = std::max<int64_t>(window_start, 0);

  if (p.policy != KVGC_POLICY_GENERATIONAL) {
    // Flat policies rank every unprotected token, at every step that is over budget.
    if (over == 0 && !s.bytes_over) return g;
    g.run = true;
    g.candidates = gen_bit(kGenIntermediate) | gen_bit(kGenLongTerm);
    g.key = p.policy == KVGC_POLICY_STREAMING ? KeyKind::Position
            : p.policy == KVGC_POLICY_RANDOM  ? KeyKind::Random
                                              : KeyKind::Score;
    g.reclaim = over;
    return g;
  }

  // Generational: a minor GC per page of new tokens; nothing in between.
  // Under budget a minor gives nothing back, yet it reads every live mask, walks every
  // live slot twice, tenures, keys every intermediate token (tokens_ranked), promotes
  // while long-term has room and ages the survivors; once long-term is full every 8th
  // minor is a refresh major (promote_blocked). That is upkeep for the next collection
  // that gives something back, and part of it is wasted (keys nothing compares; a
  // refresh's split, recomputed by the next). It is not free to drop: the split, the
  // ages, promote_blocked and the noise epoch carry into later decisions, so skipping
  // idle minors or refreshes, or tiering lazily at the first collection over budget,
  // would change which tokens are kept (a policy decision, not made here). Two changes
  // would keep the decisions: compute no key that nothing compares (tokens_ranked would
  // count less on both executors: test_cuda_gc compares them), and age by a stamp per
  // slot so that a minor touches only the pages holding young tokens. What each kind of
  // collection costs: kvgc-bench-gc --census (docs/records/perf-2026-12-02-gc-cost.md).
  if (s.since_minor < p.page_tokens) return g;
  g.run = true;
  g.key = p.recent ? KeyKind::Recent : KeyKind::Score;
  g.age_intermediate = true;
  g.reclaim = over;
  // The tiers are sized in fp16 tokens: the budget's worth of them. Over budget with
  // eviction only, generational so ranks about I/page_tokens + budget/(8 x page_tokens)
  // tokens per token appended (I = intermediate_target), against h2o's budget. A laddered segment holds up to about
  // 3x its budget in tokens, so there the intermediate tier is most of the segment and a
  // minor ranks most of it; sizing the tiers in cost units would change decisions, so it
  // is not done.
  const uint64_t budget =
      s.budget == kNoBudget ? UINT64_MAX / 2 : s.budget / p.unit_cost[KVGC_CLASS_FP16];
  const uint64_t protect = uint64_t(p.sinks) + window;
  const uint64_t lt_cap =
      budget > protect + intermediate_target(p, budget)
          ? budget - protect - intermediate_target(p, budget)
          : 0;
  // Tokens about to leave the window join the intermediate tier before it is ranked.
  const uint64_t leaving =
      window_start > 0 ? std::min<uint64_t>(s.tier[kGenYoung], uint64_t(window_start)) : 0;
  // At most what evicting every one of them would give back (as if all were fp16).
  const uint64_t intermediate_after =
      (s.tier[kGenIntermediate] + leaving) * p.unit_cost[KVGC_CLASS_FP16];
  // Major GC: the minor cannot give back enough from the intermediate tier alone, or
  // long-term is full while heavy hitters wait (rate-limited). A major GC ranks both
  // tiers by the accumulated score: long-term holds the pillars.
  const bool shortfall = g.reclaim > intermediate_after;
  const bool refresh = s.promote_blocked && s.minors_since_major + 1 >= kMajorEveryMinors;
  if (s.budget != kNoBudget && (shortfall || refresh)) {
    g.major = true;
    g.key = KeyKind::Score;
    g.candidates = gen_bit(kGenIntermediate) | gen_bit(kGenLongTerm);
    g.retier = true;
    g.retier_top = lt_cap;
    return g;
  }
  g.candidates = gen_bit(kGenIntermediate);
  const uint64_t lt = s.tier[kGenLongTerm];
  g.promote = s.budget == kNoBudget ? 0 : uint32_t(std::min<uint64_t>(lt_cap > lt ? lt_cap - lt : 0, UINT32_MAX));
  return g;
}

}  // namespace kvgc
