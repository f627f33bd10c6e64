// CPU executor for paged attention with fused scores (see attend.cpp).
#pragma once

#include "../ops.hpp"

namespace kvgc::cpu {

void attend(const AttendOp& op);

// The vector path (AVX2/FMA/F16C) is used when the CPU has it; tests switch it off to
// check the portable path against it. Process-wide.
void set_simd(bool on);
bool simd_enabled();

}  // namespace kvgc::cpu
