// Shared between the portable (attend.cpp) and vector (attend_avx2.cpp, attend_avx512.cpp)
// attention paths.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "../../allocator/host_memory.hpp"

#include "../ops.hpp"

namespace kvgc::cpu {

// A live slot as attention sees it: `page` is its header (positions read, scores written
// there), `kv` the page its K/V rows and quantisation words are read from (payload_of:
// another page when the page is shared; set for every slot attention visits).
struct LiveSlot {
  uint8_t* page;
  uint32_t cls, slot;
  int32_t pos;
  const uint8_t* kv = nullptr;
};

class ThreadPool;

// The vector paths read INT8 rows of f16 and f32 models unscaled and apply each row's
// scale once per slot (on the logit, and on the probability that weighs its V row):
// one multiply a slot instead of a multiply and an f16 round trip per element, at the
// cost of the f16 rounding kvgc_read's values carry (2^-11 relative, inside attention's
// f16 tolerance). bf16 rows keep the element-wise path: bf16's rounding (2^-8) is cheap
// to reproduce and has no such margin.
constexpr bool int8_factored(kvgc_dtype d) { return d != KVGC_DTYPE_BF16; }

// Split-K over slots (attend_split.cpp): at most `max_workers` contiguous ranges of the
// live slots, cut at page boundaries, balanced by slot count, none shorter than
// split_min_slots() (so a short segment gets fewer workers, down to one). Range w is
// [bounds[w], bounds[w + 1]); bounds holds max_workers + 1 entries. Returns the count.
unsigned split_slots(const LiveSlot* slots, size_t n, unsigned max_workers, size_t* bounds);
size_t split_min_slots();
// Test hook (process-wide): lowers the minimum so small segments split too; 0 restores
// the default.
void set_split_min_slots(size_t n);

namespace avx2 {
bool available();
// Every KV head for one block of R query rows per head (row r of head h: query r / group,
// query head h * group + r % group), visiting the segment page by page so that each
// page's K block, then its V block, is read front to back. q: [H][rows][hd], rows >= R
// padded with zero rows to a multiple of 8, q_head_stride = rows * hd; row_pos[r] is row
// r's position. Leaves unnormalised outputs in acc ([H][R][hd]) and 1 / sum in inv_sum
// ([H][R]); adds each slot's mass (all heads) to mass[j] if not null. logits: [H][n][R].
// With a pool the slots are split among its workers (split_slots); null: this thread.
void all_heads(const AttendOp& op, const LiveSlot* slots, size_t n, const float* q,
               size_t q_head_stride, uint32_t R, const int64_t* row_pos, float* logits,
               float* acc, float* mass, float* inv_sum, ThreadPool* pool);
}  // namespace avx2

namespace avx512 {  // the same contract, 16 lanes; head_dim % 32 == 0
bool available();
void all_heads(const AttendOp& op, const LiveSlot* slots, size_t n, const float* q,
               size_t q_head_stride, uint32_t R, const int64_t* row_pos, float* logits,
               float* acc, float* mass, float* inv_sum, ThreadPool* pool);
}  // namespace avx512

}  // namespace kvgc::cpu
