// CPU executor for paged attention with fused scores (see attend.cpp).
#pragma once

#include "../ops.hpp"

namespace kvgc::cpu {

class ThreadPool;

// With a pool, the vector paths split the live slots among its workers (split-K; results
// differ from one thread's only by summation order, and are deterministic for a given
// worker count); null runs on the calling thread. The portable path is single-threaded.
void attend(const AttendOp& op, ThreadPool* pool = nullptr);

// The vector path (AVX2/FMA/F16C) is used when the CPU has it; tests switch it off to
// check the portable path against it. Process-wide.
void set_simd(bool on);
void set_simd_level(int level);  // 0 portable, 1 AVX2, 2 AVX-512 (clamped to the CPU's best)
bool simd_enabled();
const char* simd_name();

}  // namespace kvgc::cpu
