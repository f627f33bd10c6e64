// The page pool: pages of each storage class, carved from arena slabs on demand.
//
// Per class, a list of "partial" slabs (at least one free page) serves allocation from
// its front: O(1). A slab that fills leaves the list; one that gets a page back joins
// it; one whose pages are all free goes back to the arena at once, so that memory
// flows to whichever class needs it. Nothing here touches the memory it manages.
#pragma once

#include <string>

#include "arena.hpp"

namespace kvgc {

struct PoolConfig {
  uintptr_t base = 0;              // arena start (real or fake), slab_bytes aligned
  size_t arena_bytes = 0;          // rounded down to whole slabs
  size_t slab_bytes = 0;
  size_t page_bytes[kNumClasses] = {};
};

struct ClassCounts {
  uint64_t slabs = 0;
  uint64_t pages_used = 0;
  uint64_t pages_free = 0;  // in this class's slabs
};

class PagePool {
 public:
  PagePool() = default;
  PagePool(const PagePool&) = delete;
  PagePool& operator=(const PagePool&) = delete;
  ~PagePool();

  // Validates the geometry. On failure returns false with *err naming the problem.
  bool init(const PoolConfig& cfg, std::string* err);

  // A page of class `cls` owned by `owner`, or kNoPage when the arena has no room
  // (or the host cannot grow a descriptor array).
  PageId alloc(int cls, SegmentId owner);
  void free(PageId id);
  // Whether n more pages of `cls` fit right now (free pages + free slabs).
  bool can_alloc(int cls, uint64_t n) const;

  // Evacuation: memory moves between classes only by whole slabs, so free pages of one
  // class are stranded until their slab empties. The runtime empties a sparse slab by
  // moving its pages into the free pages of its class's other slabs (the pages' holders
  // are the runtime's to rewrite), and the slab goes back to the arena.
  // The slab of class `cls` with the fewest pages in use, at least one free, whose pages
  // the class's other slabs can take, and which `movable(slab index)` accepts; or
  // UINT32_MAX when there is none.
  template <class F>
  uint32_t sparsest_evacuable(int cls, F&& movable) const;
  // Takes the slab off its class's partial list: no alloc picks it, and its free pages no
  // longer count as the class's. Its pages go on being freed as usual; the last one
  // returns it to the arena. undrain() puts back one that did not empty.
  void drain(uint32_t slab);
  void undrain(uint32_t slab);
  uint32_t slab_of_page(PageId id) const { return slab_of(id); }
  PageId page_id(uint32_t slab, uint32_t index) const { return make_id(slab, index, index_bits_); }

  PageDesc& desc(PageId id) { return arena_.slab(slab_of(id)).desc[index_of(id)]; }
  const PageDesc& desc(PageId id) const { return arena_.slab(slab_of(id)).desc[index_of(id)]; }
  int class_of(PageId id) const { return arena_.slab(slab_of(id)).cls; }
  uintptr_t address(PageId id) const {
    return arena_.slab_address(slab_of(id)) + uintptr_t(index_of(id)) * page_bytes_[class_of(id)];
  }
  // The page holding address `a`, or kNoPage if `a` is not the start of a live page.
  PageId page_at(uintptr_t a) const;
  // Whether `id` names a page that is currently allocated.
  bool allocated(PageId id) const;

  size_t page_bytes(int cls) const { return page_bytes_[cls]; }
  uint32_t pages_per_slab(int cls) const { return pages_per_slab_[cls]; }
  const Arena& arena() const { return arena_; }
  const ClassCounts& counts(int cls) const { return counts_[cls]; }
  uint64_t slabs_acquired() const { return slabs_acquired_; }
  uint64_t slabs_released() const { return slabs_released_; }

  // Every invariant of the free lists and counters; false with *err on the first
  // violation. O(pages): the expensive walker, for tests and debug builds.
  bool check(std::string* err) const;

  // Calls f(PageId, const PageDesc&) for every allocated page.
  template <class F>
  void for_each_allocated(F&& f) const;

  static constexpr PageId make_id(uint32_t slab, uint32_t index, uint32_t bits) {
    return (slab << bits) | index;
  }

 private:
  uint32_t slab_of(PageId id) const { return id >> index_bits_; }
  uint32_t index_of(PageId id) const { return id & index_mask_; }

  Arena arena_;
  SlabList partial_[kNumClasses];
  ClassCounts counts_[kNumClasses];
  size_t page_bytes_[kNumClasses] = {};
  uint32_t pages_per_slab_[kNumClasses] = {};
  uint32_t index_bits_ = 0, index_mask_ = 0;
  uint64_t slabs_acquired_ = 0, slabs_released_ = 0;
};

template <class F>
uint32_t PagePool::sparsest_evacuable(int cls, F&& movable) const {
  uint32_t best = UINT32_MAX, best_used = UINT32_MAX;
  for (const Slab& s : partial_[cls]) {
    const uint32_t free_elsewhere = uint32_t(counts_[cls].pages_free) - (s.pages_total - s.pages_used);
    if (s.pages_used >= best_used || s.pages_used > free_elsewhere) continue;
    const uint32_t i = arena_.index_of(s);
    if (movable(i)) best = i, best_used = s.pages_used;
  }
  return best;
}

template <class F>
void PagePool::for_each_allocated(F&& f) const {
  for (uint32_t s = 0; s < arena_.slabs(); ++s) {
    const Slab& slab = arena_.slab(s);
    if (slab.cls == Slab::kFree) continue;
    for (uint32_t i = 0; i < slab.bump; ++i)
      if (!slab.desc[i].is_free()) f(make_id(s, i, index_bits_), slab.desc[i]);
  }
}

}  // namespace kvgc
