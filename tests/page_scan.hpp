// Byte-level checks of one page against its layout, for the scrubbing tests and the
// stress test: the bytes no slot owns (alignment padding between the regions, after K,
// after V, the page's end) must be zero, and so must every byte of the slots a page has
// never been written in (slots >= used: its K/V rows, position, score, generation, live
// bit). A page taken fresh is written whole, so anything else is a previous owner's.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "../kernels/page_layout.hpp"

namespace kvgc_test {

// [begin, end) byte ranges of a page that belong to slots; everything else is padding.
inline std::vector<std::pair<size_t, size_t>> owned_ranges(const kvgc::PageLayout& L) {
  const size_t pt = L.page_tokens, payload = L.head_stride * L.n_kv_heads;
  std::vector<std::pair<size_t, size_t>> r = {
      {L.live_off, L.live_off + 4 * size_t(kvgc::PageLayout::live_words(L.page_tokens))},
      {L.pos_off, L.pos_off + 4 * pt},
      {L.score_off, L.score_off + 4 * pt},
      {L.recent_off, L.recent_off + 4 * pt},
      {L.gen_off, L.gen_off + pt},
      {L.k_off, L.k_off + payload},
      {L.v_off, L.v_off + payload}};
  if (L.qwords) {  // int8 scales, int4 scale/zero pairs
    const size_t qparams = size_t(L.n_kv_heads) * pt * L.qwords * 2;
    r.push_back({L.kq_off, L.kq_off + qparams});
    r.push_back({L.vq_off, L.vq_off + qparams});
  }
  std::sort(r.begin(), r.end());
  return r;
}

// The offset of the first nonzero byte of [p, p + n), or n. memcmp against a zero block
// (fast even in the sanitizer builds' -O0), then a byte loop only to place the finding.
inline size_t first_nonzero(const uint8_t* p, size_t n) {
  static const uint8_t zeros[4096] = {};
  for (size_t at = 0; at < n; at += sizeof zeros) {
    const size_t len = std::min(n - at, sizeof zeros);
    if (std::memcmp(p + at, zeros, len) == 0) continue;
    for (size_t i = at; i < at + len; ++i)
      if (p[i]) return i;
  }
  return n;
}

// "" if the page is clean, else the first dirty byte found. `used` = page_tokens skips
// the unwritten-slot check (the caller does not know it).
inline std::string scan_page(const kvgc::PageLayout& L, const uint8_t* page, uint32_t used) {
  auto dirty = [&](size_t i, const char* what) {
    return std::string(what) + " byte " + std::to_string(i) + " of a " +
           std::to_string(L.bytes) + "-byte " + kvgc::class_name(L.cls) +
           " page is " + std::to_string(page[i]);
  };
  auto padding = [&](size_t from, size_t to) -> std::string {
    if (from >= to) return "";
    const size_t i = from + first_nonzero(page + from, to - from);
    return i < to ? dirty(i, "padding") : "";
  };
  size_t at = 0;
  for (auto [lo, hi] : owned_ranges(L)) {
    if (std::string bad = padding(at, lo); !bad.empty()) return bad;
    at = std::max(at, hi);
  }
  if (std::string bad = padding(at, L.bytes); !bad.empty()) return bad;
  if (used >= L.page_tokens) return "";
  const size_t pt = L.page_tokens, rest = pt - used;
  auto zero = [&](size_t from, size_t n, const char* what) -> std::string {
    const size_t i = first_nonzero(page + from, n);
    return i < n ? dirty(from + i, what) : "";
  };
  std::string bad;
  for (uint32_t s = used; s < pt && bad.empty(); ++s)
    if (page[L.live_off + s / 8] >> (s % 8) & 1) bad = dirty(L.live_off + s / 8, "unwritten slot's live bit");
  if (bad.empty()) bad = zero(L.pos_off + 4 * used, 4 * rest, "unwritten slot's position");
  if (bad.empty()) bad = zero(L.score_off + 4 * used, 4 * rest, "unwritten slot's score");
  if (bad.empty()) bad = zero(L.recent_off + 4 * used, 4 * rest, "unwritten slot's recent score");
  if (bad.empty()) bad = zero(L.gen_off + used, rest, "unwritten slot's generation");
  for (uint32_t h = 0; h < L.n_kv_heads && bad.empty(); ++h) {
    const size_t at_slot = h * L.head_stride + used * L.slot_stride;
    bad = zero(L.k_off + at_slot, rest * L.slot_stride, "unwritten slot's K");
    if (bad.empty()) bad = zero(L.v_off + at_slot, rest * L.slot_stride, "unwritten slot's V");
  }
  if (L.qwords && bad.empty()) {
    const size_t per_slot = size_t(L.qwords) * 2;
    for (uint32_t h = 0; h < L.n_kv_heads && bad.empty(); ++h) {
      const size_t q = L.qparam_index(h, used) * 2;
      bad = zero(L.kq_off + q, rest * per_slot, "unwritten slot's quantisation words");
      if (bad.empty()) bad = zero(L.vq_off + q, rest * per_slot, "unwritten slot's quantisation words");
    }
  }
  return bad;
}

}  // namespace kvgc_test
