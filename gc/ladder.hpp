// The storage ladder: which classes a GC may store a candidate in, dearest first, and
// the exchange rate that decides each candidate's rung. Pure host arithmetic.
//
// Rule (a Lagrangian over the candidates): a token of weight w (its ranking score, or 1
// for position and random keys) stored in class c loses about w * error(c) of what
// attention would read from it (error: FP16 0, INT8 and INT4 their measured relative
// RMS error, evicted 1) and costs cost(c) (its page bytes per slot; evicted 0). Giving
// back units at the smallest loss per unit means taking, over all candidates, the steps
// down the ladder ("rungs") in increasing order of w * slope(rung), where
//   slope(rung c -> d) = (error(d) - error(c)) / (cost(c) - cost(d)),
// until the reclaim is met. Because slopes increase down the ladder (classes that break
// that are dropped: they are dominated), every token's steps come in ladder order, and a
// token of higher weight is never further down than one of lower weight: the ladder is
// monotone by construction, and bands by rank fall out of it (FP16 for heavy hitters,
// INT8 for the middle, INT4 below, eviction for the rest).
#pragma once

#include <cstdint>
#include <string>

#include "kvgc.h"

namespace kvgc {

// Relative RMS error of a head row's K/V after quantisation (Gaussian rows; measured by
// tests/test_gc_plan.cpp holds them within 30%): the ladder's exchange rates.
constexpr double kInt8Error = 0.0065;
constexpr double kInt4Error = 0.078;
constexpr double kInt2Error = 0.39;
// A class that saves less than a quarter of an FP16 page is not worth its precision.
constexpr double kMaxDemoteCost = 0.75;

struct Ladder {
  uint8_t n = 1;                          // classes on the ladder (1: FP16 only)
  uint8_t cls[KVGC_CLASS_COUNT] = {KVGC_CLASS_FP16};  // dearest first
  double slope[KVGC_CLASS_COUNT] = {1.0};             // rung r: cls[r] -> cls[r + 1] (r = n - 1: evicted)
};

// The ladder `demote` asks for, over classes whose page bytes are page_bytes[class].
// Classes that would save too little, or are dominated, are left out; *note says which
// and why (empty when none was).
Ladder make_ladder(kvgc_demote demote, const uint64_t page_bytes[KVGC_CLASS_COUNT],
                   std::string* note);

}  // namespace kvgc
