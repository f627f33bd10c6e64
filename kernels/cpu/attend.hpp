// CPU executor for paged attention with fused scores (see attend.cpp).
#pragma once

#include "../ops.hpp"

namespace kvgc::cpu {

void attend(const AttendOp& op);

// The vector path (AVX2/FMA/F16C) is used when the CPU has it; tests switch it off to
// check the portable path against it. Process-wide.
void set_simd(bool on);
void set_simd_level(int level);  // 0 portable, 1 AVX2, 2 AVX-512 (clamped to the CPU's best)
bool simd_enabled();
const char* simd_name();

}  // namespace kvgc::cpu
