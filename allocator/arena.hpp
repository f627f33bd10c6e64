// The arena: one reservation split into slabs. It hands out whole slabs and takes
// them back; slabs carry no class while they are here, which is what lets memory flow
// between storage classes. LIFO, so a slab just returned (and warm) is reused first.
#pragma once

#include "slab.hpp"

namespace kvgc {

class Arena {
 public:
  // Slabs [0, n_slabs) of slab_bytes each from `base` (a real or a fake address).
  bool init(uintptr_t base, size_t slab_bytes, uint32_t n_slabs) {
    free_.clear();
    try {
      slabs_ = host::vector<Slab>(n_slabs);
    } catch (const std::bad_alloc&) {
      return false;
    }
    base_ = base;
    slab_bytes_ = slab_bytes;
    n_slabs_ = n_slabs;
    for (uint32_t i = n_slabs; i-- > 0;) free_.push_front(slabs_[i]);  // slab 0 first
    return true;
  }
  ~Arena() { free_.clear(); }

  Slab* acquire() {
    if (free_.empty()) return nullptr;
    Slab& s = free_.front();
    free_.pop_front();
    return &s;
  }
  void release(Slab& s) {
    s.cls = Slab::kFree;
    s.draining = false;
    s.pages_total = s.pages_used = s.bump = 0;
    s.free_head = Slab::kNil;
    free_.push_front(s);
  }

  uint32_t index_of(const Slab& s) const { return uint32_t(&s - slabs_.data()); }
  Slab& slab(uint32_t i) { return slabs_[i]; }
  const Slab& slab(uint32_t i) const { return slabs_[i]; }
  uintptr_t slab_address(uint32_t i) const { return base_ + uintptr_t(i) * slab_bytes_; }

  uintptr_t base() const { return base_; }
  size_t slab_bytes() const { return slab_bytes_; }
  uint32_t slabs() const { return n_slabs_; }
  uint32_t free_slabs() const { return uint32_t(free_.size()); }
  const SlabList& free_list() const { return free_; }

 private:
  uintptr_t base_ = 0;
  size_t slab_bytes_ = 0;
  uint32_t n_slabs_ = 0;
  host::vector<Slab> slabs_;
  SlabList free_;
};

}  // namespace kvgc
