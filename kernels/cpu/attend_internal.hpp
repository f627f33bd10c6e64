// Shared between the portable (attend.cpp) and AVX2 (attend_avx2.cpp) attention paths.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "../../allocator/host_memory.hpp"

#include "../ops.hpp"

namespace kvgc::cpu {

struct LiveSlot {
  uint8_t* page;
  uint32_t cls, slot;
  int32_t pos;
};

namespace avx2 {
bool available();
// Every KV head for one block of R query rows per head (row r of head h: query r / group,
// query head h * group + r % group), visiting the segment page by page so that each
// page's K block, then its V block, is read front to back. q: [H][rows][hd], rows >= R
// padded with zero rows to a multiple of 8, q_head_stride = rows * hd; row_pos[r] is row
// r's position. Leaves unnormalised outputs in acc ([H][R][hd]) and 1 / sum in inv_sum
// ([H][R]); adds each slot's mass (all heads) to mass[j] if not null. logits: [H][n][R].
void all_heads(const AttendOp& op, const LiveSlot* slots, size_t n, const float* q,
               size_t q_head_stride, uint32_t R, const int64_t* row_pos, float* logits,
               float* acc, float* mass, float* inv_sum);
}  // namespace avx2

namespace avx512 {  // the same contract, 16 lanes; head_dim % 32 == 0
bool available();
void all_heads(const AttendOp& op, const LiveSlot* slots, size_t n, const float* q,
               size_t q_head_stride, uint32_t R, const int64_t* row_pos, float* logits,
               float* acc, float* mass, float* inv_sum);
}  // namespace avx512

}  // namespace kvgc::cpu
