// A slab: a fixed-size chunk of the arena carved into equal pages of one storage class.
// Pages come from a bump index first (no per-page work when a slab is carved) and from
// an intrusive free list once returned, so page alloc and free are O(1).
#pragma once

#include <boost/intrusive/list.hpp>
#include <boost/intrusive/slist.hpp>
#include <memory>

#include "types.hpp"

namespace kvgc {

namespace bi = boost::intrusive;
using NormalLink = bi::link_mode<bi::normal_link>;

// Host descriptor of one page. `used` counts slots ever filled since the page was
// allocated (appends go to the tail), `live` those still holding a live token; both
// are the host's page-granular mirror of the device-owned slot metadata.
struct PageDesc : bi::slist_base_hook<NormalLink> {
  SegmentId owner = kNoSegment;
  uint16_t used = 0;
  uint16_t live = 0;
};

using PageFreeList = bi::slist<PageDesc, bi::constant_time_size<false>>;

struct Slab : bi::list_base_hook<NormalLink> {
  static constexpr int8_t kFree = -1;
  int8_t cls = kFree;        // storage class, or kFree while it sits in the arena
  uint32_t pages_total = 0;  // pages this slab holds in its current class
  uint32_t pages_used = 0;
  uint32_t bump = 0;         // pages [bump, pages_total) were never handed out
  PageFreeList free_pages;   // pages [0, bump) that came back
  std::unique_ptr<PageDesc[]> desc;  // kept across carvings: re-carving is O(1)
  uint32_t desc_capacity = 0;

  bool full() const { return pages_used == pages_total; }
  bool empty() const { return pages_used == 0; }

  // Turns a free slab into `pages` pages of class `c`. False if the descriptor array
  // cannot grow (host out of memory); the slab is then unchanged.
  bool carve(int8_t c, uint32_t pages) {
    if (desc_capacity < pages) {
      std::unique_ptr<PageDesc[]> d(new (std::nothrow) PageDesc[pages]);
      if (!d) return false;
      desc = std::move(d);
      desc_capacity = pages;
    }
    cls = c;
    pages_total = pages;
    pages_used = 0;
    bump = 0;
    free_pages.clear();
    return true;
  }

  // Index of a free page (the slab must not be full).
  uint32_t pop() {
    PageDesc* p;
    if (!free_pages.empty()) {
      p = &free_pages.front();
      free_pages.pop_front();
    } else {
      p = &desc[bump++];
    }
    ++pages_used;
    return uint32_t(p - desc.get());
  }

  void push(uint32_t index) {
    PageDesc& p = desc[index];
    p.owner = kNoSegment;
    p.used = p.live = 0;
    free_pages.push_front(p);
    --pages_used;
  }
};

using SlabList = bi::list<Slab, bi::constant_time_size<true>>;

}  // namespace kvgc
