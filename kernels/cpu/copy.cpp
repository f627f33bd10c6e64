#include "copy.hpp"

#include "quant.hpp"

#include <bit>
#include <cstring>

namespace kvgc::cpu {

void append(const AppendOp& op) {
  const PageLayout& L = op.layout;
  const size_t row = size_t(L.head_dim) * dtype_bytes(L.dtype);  // one head of one token
  const size_t token_bytes = row * L.n_kv_heads;
  const auto* k = static_cast<const uint8_t*>(op.k);
  const auto* v = static_cast<const uint8_t*>(op.v);
  for (uint32_t r = 0; r < op.n_runs; ++r) {
    const AppendRun& run = op.runs[r];
    uint8_t* page = run.page;
    auto* live = reinterpret_cast<uint32_t*>(page + L.live_off);
    auto* pos = reinterpret_cast<int32_t*>(page + L.pos_off);
    auto* score = reinterpret_cast<float*>(page + L.score_off);
    auto* recent = reinterpret_cast<float*>(page + L.recent_off);
    auto* gen = page + L.gen_off;
    if (run.first_slot == 0) {
      // A fresh page: scrub every byte this run does not write. The whole metadata block
      // (live mask, pos, score, gen and the alignment padding between them), the K/V
      // slots past the run, and the padding after K, after V and at the page's end: a
      // recycled page shows nothing of its previous owner, whatever the geometry.
      std::memset(page, 0, L.k_off);
      const uint32_t rest = L.page_tokens - run.count;
      for (uint32_t h = 0; h < L.n_kv_heads && rest; ++h) {
        const size_t at = h * L.head_stride + size_t(run.count) * L.slot_stride;
        std::memset(page + L.k_off + at, 0, rest * L.slot_stride);
        std::memset(page + L.v_off + at, 0, rest * L.slot_stride);
      }
      const size_t payload = L.head_stride * L.n_kv_heads;
      std::memset(page + L.k_off + payload, 0, L.v_off - (L.k_off + payload));
      std::memset(page + L.v_off + payload, 0, L.bytes - (L.v_off + payload));
    }
    for (uint32_t t = 0; t < run.count; ++t) {
      const uint32_t slot = run.first_slot + t;
      const uint64_t src = run.src_token + t;
      for (uint32_t h = 0; h < L.n_kv_heads; ++h) {
        const size_t dst = h * L.head_stride + slot * L.slot_stride;
        std::memcpy(page + L.k_off + dst, k + src * token_bytes + h * row, row);
        std::memcpy(page + L.v_off + dst, v + src * token_bytes + h * row, row);
      }
      const int64_t p = op.first_pos + int64_t(src) + run.pos_delta;
      pos[slot] = int32_t(p);
      score[slot] = 0.f;
      recent[slot] = 0.f;
      gen[slot] = p < int64_t(op.sinks) ? kGenSink : kGenYoung;
      live[slot / 32] |= 1u << (slot % 32);
    }
  }
}

void gather(const GatherOp& op) {
  auto* k_out = static_cast<uint8_t*>(op.k_out);
  auto* v_out = static_cast<uint8_t*>(op.v_out);
  for (uint32_t p = 0; p < op.n_pages; ++p) {
    const SegPage& sp = op.pages[p];
    const PageLayout& L = op.layout[sp.cls];
    const size_t row = size_t(L.head_dim) * dtype_bytes(L.dtype);  // one head, model dtype
    const size_t token_bytes = row * L.n_kv_heads;
    const uint8_t* page = sp.page;          // header: live bits and metadata
    const uint8_t* kv = payload_of(sp);     // K/V and quantisation words
    const auto* live = reinterpret_cast<const uint32_t*>(page + L.live_off);
    const auto* pos = reinterpret_cast<const int32_t*>(page + L.pos_off);
    uint64_t out = sp.out_row;
    for (uint32_t w = 0; w < PageLayout::live_words(L.page_tokens); ++w) {
      for (uint32_t bits = live[w]; bits; bits &= bits - 1) {
        const uint32_t slot = w * 32 + uint32_t(std::countr_zero(bits));
        for (uint32_t h = 0; h < L.n_kv_heads; ++h) {
          if (k_out) load_row(L, kv, h, slot, false, k_out + out * token_bytes + h * row);
          if (v_out) load_row(L, kv, h, slot, true, v_out + out * token_bytes + h * row);
        }
        if (op.pos_out) op.pos_out[out] = pos[slot];
        if (op.score_out) op.score_out[out] = reinterpret_cast<const float*>(page + L.score_off)[slot];
        if (op.gen_out) op.gen_out[out] = gen_of(page[L.gen_off + slot]);
        ++out;
      }
    }
  }
}

}  // namespace kvgc::cpu
