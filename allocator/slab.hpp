// A slab: a fixed-size chunk of the arena carved into equal pages of one storage class.
// Pages come from a bump index first (no per-page work when a slab is carved) and from
// the slab's free list once returned, so page alloc and free are O(1).
//
// Page descriptors are 8 bytes: the free list is threaded through the descriptors' owner
// word (top bit = free, low 31 bits = next free index) rather than a pointer hook. At 1M
// pages that halves the descriptor bytes a random free touches, which bench/alloc showed
// to be the dominant cost there. Slabs themselves sit on Boost.Intrusive lists.
#pragma once

#include <boost/intrusive/list.hpp>

#include "host_memory.hpp"
#include "types.hpp"

namespace kvgc {

namespace bi = boost::intrusive;
using NormalLink = bi::link_mode<bi::normal_link>;

// Host descriptor of one page. `used` counts slots ever filled since the page was
// allocated (appends go to the tail), `live` those still holding a live token; both
// are the host's page-granular mirror of the device-owned slot metadata.
struct PageDesc {
  static constexpr uint32_t kFreeBit = 0x80000000u;
  SegmentId owner = kNoSegment;  // owned: the segment; free: kFreeBit | next free index
  uint16_t used = 0;
  uint16_t live = 0;

  bool is_free() const { return owner & kFreeBit; }
};
static_assert(sizeof(PageDesc) == 8);

struct Slab : bi::list_base_hook<NormalLink> {
  static constexpr int8_t kFree = -1;
  static constexpr uint32_t kNil = 0x7fffffffu;  // end of the page free list
  int8_t cls = kFree;        // storage class, or kFree while it sits in the arena
  bool draining = false;     // being evacuated (PagePool::drain): off the partial list
  uint32_t pages_total = 0;  // pages this slab holds in its current class
  uint32_t pages_used = 0;
  uint32_t bump = 0;         // pages [bump, pages_total) were never handed out
  uint32_t free_head = kNil; // pages [0, bump) that came back, linked through owner
  host::vector<PageDesc> desc;  // kept across carvings: re-carving is O(1)

  bool full() const { return pages_used == pages_total; }
  bool empty() const { return pages_used == 0; }

  // Turns a free slab into `pages` pages of class `c`. False if the descriptor array
  // cannot grow (host out of memory); the slab is then unchanged.
  bool carve(int8_t c, uint32_t pages) {
    if (desc.size() < pages) {
      try {
        desc.resize(pages);
      } catch (const std::bad_alloc&) {
        return false;
      }
    }
    cls = c;
    pages_total = pages;
    pages_used = 0;
    bump = 0;
    free_head = kNil;
    return true;
  }

  // Index of a free page (the slab must not be full); the caller sets its owner.
  uint32_t pop() {
    uint32_t index;
    if (free_head != kNil) {
      index = free_head;
      free_head = desc[index].owner & ~PageDesc::kFreeBit;
    } else {
      index = bump++;
    }
    ++pages_used;
    return index;
  }

  void push(uint32_t index) {
    PageDesc& p = desc[index];
    p.owner = PageDesc::kFreeBit | free_head;
    p.used = p.live = 0;
    free_head = index;
    --pages_used;
  }
};

using SlabList = bi::list<Slab, bi::constant_time_size<true>>;

}  // namespace kvgc
