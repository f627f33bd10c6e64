// How attention mass accumulates into a slot's score, on every executor (CPU and CUDA)
// and both paths (kvgc_observe's mass from the engine, kvgc_attend's own fused mass):
// a mass that is NaN, infinite or not positive adds nothing, and a score saturates at
// the largest float, so a score is always finite and >= 0 whatever the input (kvgc.h).
// The check costs two compares where the mass is already in a register; on CUDA the
// engine's mass is a device pointer, so rejecting bad values would need a copy back.
#pragma once

#include "page_layout.hpp"  // KVGC_HD

namespace kvgc {

constexpr float kMaxScore = 3.40282346638528859812e+38f;  // FLT_MAX

KVGC_HD inline float accumulate_score(float score, float mass) {
  if (!(mass > 0.f && mass <= kMaxScore)) return score;  // NaN, +-inf, <= 0
  const float s = score + mass;
  return s <= kMaxScore ? s : kMaxScore;
}

}  // namespace kvgc
