#include "page_pool.hpp"

#include <bit>
#include <vector>

namespace kvgc {

PagePool::~PagePool() {
  for (auto& l : partial_) l.clear();
}

bool PagePool::init(const PoolConfig& cfg, std::string* err) {
  if (cfg.slab_bytes == 0 || cfg.slab_bytes % 256 != 0) {
    *err = "slab_bytes must be a positive multiple of 256";
    return false;
  }
  uint32_t max_pages = 0;
  for (int c = 0; c < kNumClasses; ++c) {
    if (c == kHeaderClass && cfg.page_bytes[c] == 0) continue;  // not used by this pool
    if (cfg.page_bytes[c] == 0 || cfg.page_bytes[c] > cfg.slab_bytes) {
      *err = "page of class " + std::to_string(c) + " (" + std::to_string(cfg.page_bytes[c]) +
             " bytes) does not fit a slab of " + std::to_string(cfg.slab_bytes) + " bytes";
      return false;
    }
    page_bytes_[c] = cfg.page_bytes[c];
    pages_per_slab_[c] = uint32_t(cfg.slab_bytes / cfg.page_bytes[c]);
    max_pages = std::max(max_pages, pages_per_slab_[c]);
  }
  const uint64_t n_slabs = cfg.arena_bytes / cfg.slab_bytes;
  index_bits_ = uint32_t(std::bit_width(max_pages - 1u));
  index_mask_ = (1u << index_bits_) - 1u;
  // Page ids must leave kNoPage free: (n_slabs << bits) must stay below 2^32 - 1.
  if (n_slabs == 0 || (n_slabs << index_bits_) >= uint64_t(kNoPage)) {
    *err = n_slabs == 0 ? "arena (" + std::to_string(cfg.arena_bytes) +
                              " bytes) is smaller than one slab (" +
                              std::to_string(cfg.slab_bytes) + " bytes)"
                        : "arena has too many pages for 32-bit page ids: use larger slabs";
    return false;
  }
  if (!arena_.init(cfg.base, cfg.slab_bytes, uint32_t(n_slabs))) {
    *err = "out of host memory for slab descriptors (" + std::to_string(n_slabs) + " slabs)";
    return false;
  }
  return true;
}

bool PagePool::can_alloc(int cls, uint64_t n) const {
  if (pages_per_slab_[cls] == 0) return n == 0;  // a class this pool leaves out
  return n <= counts_[cls].pages_free + uint64_t(arena_.free_slabs()) * pages_per_slab_[cls];
}

PageId PagePool::alloc(int cls, SegmentId owner) {
  KVGC_ASSERT(cls >= 0 && cls < kNumClasses && owner < kMaxSegments && pages_per_slab_[cls]);
  SlabList& partial = partial_[cls];
  if (partial.empty()) {
    Slab* s = arena_.acquire();
    if (!s) return kNoPage;
    if (!s->carve(int8_t(cls), pages_per_slab_[cls])) {
      arena_.release(*s);
      return kNoPage;
    }
    ++slabs_acquired_;
    ++counts_[cls].slabs;
    counts_[cls].pages_free += s->pages_total;
    partial.push_front(*s);
  }
  Slab& s = partial.front();
  const uint32_t index = s.pop();
  if (s.full()) partial.pop_front();
  PageDesc& d = s.desc[index];
  d.owner = owner;
  d.used = d.live = 0;
  --counts_[cls].pages_free;
  ++counts_[cls].pages_used;
  return make_id(arena_.index_of(s), index, index_bits_);
}

void PagePool::free(PageId id) {
  Slab& s = arena_.slab(slab_of(id));
  // Double free or a foreign id; free touches this descriptor anyway, so it is cheap.
  KVGC_ASSERT(s.cls != Slab::kFree && index_of(id) < s.bump && !s.desc[index_of(id)].is_free());
  const int cls = s.cls;
  const bool was_full = s.full();
  s.push(index_of(id));
  --counts_[cls].pages_used;
  if (s.draining) {  // off the list, its free pages not counted (drain)
    if (!s.empty()) return;
    --counts_[cls].slabs;
    arena_.release(s);
    ++slabs_released_;
    return;
  }
  ++counts_[cls].pages_free;
  if (s.empty()) {
    if (!was_full) partial_[cls].erase(partial_[cls].iterator_to(s));
    counts_[cls].pages_free -= s.pages_total;
    --counts_[cls].slabs;
    arena_.release(s);
    ++slabs_released_;
  } else if (was_full) {
    partial_[cls].push_front(s);
  }
}

void PagePool::drain(uint32_t slab) {
  Slab& s = arena_.slab(slab);
  KVGC_ASSERT(s.cls != Slab::kFree && !s.draining && !s.empty());
  if (!s.full()) partial_[s.cls].erase(partial_[s.cls].iterator_to(s));
  counts_[s.cls].pages_free -= s.pages_total - s.pages_used;
  s.draining = true;
}

void PagePool::undrain(uint32_t slab) {
  Slab& s = arena_.slab(slab);
  if (s.cls == Slab::kFree || !s.draining) return;  // it emptied: back in the arena
  s.draining = false;
  counts_[s.cls].pages_free += s.pages_total - s.pages_used;
  if (!s.full()) partial_[s.cls].push_front(s);
}

bool PagePool::allocated(PageId id) const {
  const uint32_t slab = slab_of(id);
  if (id == kNoPage || slab >= arena_.slabs()) return false;
  const Slab& s = arena_.slab(slab);
  return s.cls != Slab::kFree && index_of(id) < s.bump && !s.desc[index_of(id)].is_free();
}

PageId PagePool::page_at(uintptr_t a) const {
  if (a < arena_.base()) return kNoPage;
  const uintptr_t off = a - arena_.base();
  const uint64_t slab = off / arena_.slab_bytes();
  if (slab >= arena_.slabs()) return kNoPage;
  const Slab& s = arena_.slab(uint32_t(slab));
  if (s.cls == Slab::kFree) return kNoPage;
  const uintptr_t in = off % arena_.slab_bytes();
  if (in % page_bytes_[s.cls] != 0) return kNoPage;
  const PageId id = make_id(uint32_t(slab), uint32_t(in / page_bytes_[s.cls]), index_bits_);
  return allocated(id) ? id : kNoPage;
}

bool PagePool::check(std::string* err) const {
  auto fail = [&](const std::string& m) { *err = "allocator: " + m; return false; };
  std::vector<uint8_t> on_list(arena_.slabs(), 0);  // the walker: std, never injected  // 1 = arena free list, 2 = partial
  for (const Slab& s : arena_.free_list()) {
    const uint32_t i = arena_.index_of(s);
    if (on_list[i]) return fail("slab " + std::to_string(i) + " twice on the free list");
    if (s.cls != Slab::kFree) return fail("slab " + std::to_string(i) + " free but has a class");
    on_list[i] = 1;
  }
  ClassCounts seen[kNumClasses];
  for (int c = 0; c < kNumClasses; ++c) {
    for (const Slab& s : partial_[c]) {
      const uint32_t i = arena_.index_of(s);
      if (on_list[i]) return fail("slab " + std::to_string(i) + " on two lists");
      if (s.cls != c) return fail("slab " + std::to_string(i) + " on another class's list");
      if (s.full()) return fail("full slab " + std::to_string(i) + " on a partial list");
      on_list[i] = 2;
    }
  }
  for (uint32_t i = 0; i < arena_.slabs(); ++i) {
    const Slab& s = arena_.slab(i);
    const std::string name = "slab " + std::to_string(i);
    if (s.cls == Slab::kFree) {
      if (on_list[i] != 1) return fail(name + " is free but not on the arena free list");
      continue;
    }
    if (s.cls < 0 || s.cls >= kNumClasses) return fail(name + " has a bad class");
    if (s.draining) return fail(name + " was left draining");
    if (s.pages_total != pages_per_slab_[s.cls]) return fail(name + " has a bad page count");
    if (s.empty()) return fail(name + " is empty but was not returned to the arena");
    if (!s.full() && on_list[i] != 2) return fail(name + " has free pages but is not partial");
    if (s.bump > s.pages_total) return fail(name + " bump past its pages");
    uint32_t owned = 0, listed = 0;
    for (uint32_t p = 0; p < s.bump; ++p) owned += !s.desc[p].is_free();
    for (uint32_t p = s.free_head; p != Slab::kNil; p = s.desc[p].owner & ~PageDesc::kFreeBit) {
      if (p >= s.bump) return fail(name + " free list holds a foreign page");
      if (!s.desc[p].is_free()) return fail(name + " free list holds an owned page");
      if (++listed > s.bump) return fail(name + " free list has a cycle");
    }
    if (owned != s.pages_used) return fail(name + " pages_used disagrees with owners");
    if (owned + listed != s.bump) return fail(name + " leaks pages below its bump index");
    seen[s.cls].slabs += 1;
    seen[s.cls].pages_used += s.pages_used;
    seen[s.cls].pages_free += s.pages_total - s.pages_used;
  }
  for (int c = 0; c < kNumClasses; ++c) {
    if (seen[c].slabs != counts_[c].slabs || seen[c].pages_used != counts_[c].pages_used ||
        seen[c].pages_free != counts_[c].pages_free)
      return fail("class " + std::to_string(c) + " counters disagree with its slabs");
  }
  return true;
}

}  // namespace kvgc
