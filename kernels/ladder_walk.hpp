// The ladder walk of select's step 2, and its refill: one algorithm for both executors.
// kernels/cpu/gc.cpp calls it; kernels/cuda/gc_decide.cu runs it in one thread. Every
// sum is an integer (units, counts, bytes) and every ratio one rounded product, so the
// two stop at the same points.
#pragma once

#include <cstddef>
#include <cstdint>

#include "page_layout.hpp"

namespace kvgc {

struct WalkRules {
  uint32_t rungs;                              // classes on the ladder (n_ladder)
  const uint8_t* ladder;                       // [rungs] classes, dearest first
  const double* slope;                         // [rungs] rung r: ladder[r] -> r + 1 (or evicted)
  const uint64_t* unit_cost;                   // [KVGC_CLASS_COUNT] a token's units per class
  uint64_t reclaim;                            // units to give back
  uint64_t budget_bytes;                       // 0: none; else the pages kept must fit it
  uint32_t page_tokens;
  uint64_t page_bytes[KVGC_CLASS_COUNT];
};

// The pages the classes need for `live` tokens once compacted, in bytes.
template <class Count>
KVGC_HD uint64_t walk_held_bytes(const WalkRules& w, const Count* live) {
  uint64_t bytes = 0;
  for (int c = 0; c < KVGC_CLASS_COUNT; ++c)
    bytes += (uint64_t(live[c]) + w.page_tokens - 1) / w.page_tokens * w.page_bytes[c];
  return bytes;
}

KVGC_HD inline double walk_ratio(double weight, double slope) {
#if defined(__CUDA_ARCH__)
  return __dmul_rn(weight, slope);  // no contraction: the host's product, bit for bit
#else
  return weight * slope;
#endif
}

// Over candidates sorted by ascending rank: the rungs taken in increasing order of
// (weight x slope, rung, rank) until `reclaim` units are given back and, with a byte
// budget, the pages the segment would keep once compacted fit it (a demotion frees an
// FP16 page only once a page's worth of tokens has moved, so stopping at the units alone
// would leave the byte budget to evictions). from[i] is candidate i's ladder position
// before the op (0 .. rungs - 1; rungs = evicted), at[i] where the walk leaves it.
// live: live tokens per class, updated. Returns the units given back.
//
// The refill (issue 23): the walk stops where the pages first fit, and pages are whole,
// so the last page of a class can have slots the budget already pays for, and a step
// taken late (a page of a dearer class freed) can make room for tokens demoted earlier.
// Rung r's refill option is the highest-ranked candidate that took step r and sits below
// rung r now: it goes back to rung r (its later steps undone with it). The options that
// keep the pages within the budget and the reclaim met are taken, the one of highest
// weight x slope[r] first (the walk's reverse order), until none fits. So the next-ranked
// tokens take the slots the budget pays for.
template <class Count>
KVGC_HD uint64_t ladder_walk(const WalkRules& w, const double* weight, const uint8_t* from,
                             uint8_t* at, size_t n, Count* live) {
  const uint32_t rungs = w.rungs;
  size_t next[KVGC_CLASS_COUNT] = {};  // rung r's next candidate (ascending rank)
  uint64_t reclaimed = 0;
  // A candidate from ladder position a to b (rungs = evicted), in the live counts and
  // the units given back.
  auto move = [&](uint32_t a, uint32_t b) {
    if (a < rungs) --live[w.ladder[a]];
    if (b < rungs) ++live[w.ladder[b]];
    reclaimed = reclaimed + (a < rungs ? w.unit_cost[w.ladder[a]] : 0) - (b < rungs ? w.unit_cost[w.ladder[b]] : 0);
  };
  const bool budget = w.budget_bytes > 0;
  while (reclaimed < w.reclaim || (budget && walk_held_bytes(w, live) > w.budget_bytes)) {
    int best = -1;
    double best_ratio = 0;
    for (uint32_t r = 0; r < rungs; ++r) {
      // Candidates below rung r's start take no step r: they are past it already.
      while (next[r] < n && at[next[r]] > r) ++next[r];
      if (next[r] == n) continue;
      const double ratio = walk_ratio(weight[next[r]], w.slope[r]);
      if (best < 0 || ratio < best_ratio) best = int(r), best_ratio = ratio;  // ties: lower rung
    }
    if (best < 0) break;  // every candidate evicted
    at[next[best]++] = uint8_t(best + 1);  // its earlier steps came first (lower ratio or rung)
    move(uint32_t(best), uint32_t(best) + 1);
  }
  if (!budget) return reclaimed;
  for (;;) {
    int best = -1;
    size_t best_i = 0;
    double best_ratio = 0;
    for (uint32_t r = 0; r < rungs; ++r) {
      // Before next[r], a candidate took step r unless it began below rung r; one back at
      // rung r or above (refilled) is passed for good, so next[r] moves down with the scan.
      size_t& j = next[r];
      while (j > 0 && (from[j - 1] > r || at[j - 1] <= r)) --j;
      if (j == 0) continue;
      const uint32_t a = at[j - 1];
      move(a, r);  // tried, then put back (its steps gave at least what this takes)
      const bool fits = reclaimed >= w.reclaim && walk_held_bytes(w, live) <= w.budget_bytes;
      move(r, a);
      if (!fits) continue;
      const double ratio = walk_ratio(weight[j - 1], w.slope[r]);
      if (best < 0 || ratio >= best_ratio) best = int(r), best_i = j - 1, best_ratio = ratio;  // ties: lower on the ladder
    }
    if (best < 0) return reclaimed;
    move(at[best_i], uint32_t(best));
    at[best_i] = uint8_t(best);
  }
}

}  // namespace kvgc
