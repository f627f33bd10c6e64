// Data-plane op descriptors: what the runtime asks an executor (CPU or CUDA) to do.
// Pointers are the heap's device pointers (host pointers on the CPU backend). The ops
// make no policy decisions: the host has already chosen pages and output positions.
#pragma once

#include <cstdint>

#include "page_layout.hpp"

namespace kvgc {

// Tokens [src_token, src_token + count) of the source go to slots
// [first_slot, first_slot + count) of `page`. A run with first_slot == 0 starts a fresh
// page and owns its whole live mask (bits past the run are cleared); later runs into
// the same page only add bits. So recycled pages never show stale live bits.
struct AppendRun {
  uint8_t* page;
  uint32_t first_slot;
  uint32_t count;
  uint32_t src_token;
};

struct AppendOp {
  PageLayout layout;      // FP16 class: new tokens are always stored in the model dtype
  const void* k;          // [n][n_kv_heads][head_dim] model dtype
  const void* v;
  int64_t first_pos;      // position of source token 0
  uint32_t sinks;         // positions below this are sinks (kGenSink), others young
  const AppendRun* runs;  // host array
  uint32_t n_runs;
};

// One page to gather: its live slots, in slot order, go to output rows
// [out_row, out_row + live count of the page).
struct GatherPage {
  const uint8_t* page;
  uint64_t out_row;
};

struct GatherOp {
  PageLayout layout;
  const GatherPage* pages;  // host array
  uint32_t n_pages;
  void* k_out;              // [rows][n_kv_heads][head_dim] model dtype, or null
  void* v_out;
  int32_t* pos_out;         // [rows], or null
};

}  // namespace kvgc
