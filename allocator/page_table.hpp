// A segment's page table: its pages in slot order. Slot i of the segment is slot
// i % page_tokens of pages[i / page_tokens]; appends fill the last page. The counts
// here are the host's page-granular view; token metadata itself lives on the device.
#pragma once

#include "page_pool.hpp"

namespace kvgc {

struct PageTable {
  host::vector<PageId> pages;
  uint64_t live = 0;    // live tokens (sum of the pages' live counts)
  uint64_t used = 0;    // slots ever filled and still held (sum of the pages' used)

  uint64_t held_slots(uint32_t page_tokens) const { return uint64_t(pages.size()) * page_tokens; }
  uint64_t dead() const { return used - live; }
  // Dead slots / slots held: what compaction would give back. 0 when nothing is held.
  double fragmentation(uint32_t page_tokens) const {
    const uint64_t held = held_slots(page_tokens);
    return held ? double(dead()) / double(held) : 0.0;
  }
  // Free slots at the tail, which the next append fills before taking a page.
  uint32_t tail_room(const PagePool& pool, uint32_t page_tokens) const {
    return pages.empty() ? 0u : page_tokens - pool.desc(pages.back()).used;
  }
  // Pages an append of n tokens needs beyond the tail's room.
  static uint64_t pages_for(uint64_t n, uint64_t room, uint32_t page_tokens) {
    return n <= room ? 0 : (n - room + page_tokens - 1) / page_tokens;
  }
  uint64_t pages_needed(const PagePool& pool, uint32_t page_tokens, uint64_t n) const {
    return pages_for(n, tail_room(pool, page_tokens), page_tokens);
  }
};

}  // namespace kvgc
