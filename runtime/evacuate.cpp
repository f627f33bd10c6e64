// Evacuation: memory moves between storage classes by whole slabs, so a class's free
// pages are stranded in its slabs until a slab empties. When the arena is short of pages
// of one class (an append or a plan, a demotion's targets), the sparsest slab of another
// class whose pages fit in the free pages of that class's other slabs is emptied: each
// page is copied (on the stream, device to device) into one of them, everything naming
// the page is pointed at the copy, and the slab goes back to the arena for any class.
//
// What names a page: a segment's table (a private page, or a header page; backing_ too
// for a header), and for a shared page shared_, its holders' backing_ entries and the
// cached prefixes holding it. Cached copies of addresses (a segment's tail, its
// attention list, its plan mirror) are made stale by touch. Three things could hold an
// address this cannot rewrite, so evacuation waits for none of them and runs only
// without them: a GC issued and not yet applied (its op lists pages), a live batch plan
// (its exported page offsets are the engine's), and the pages of the segment whose GC is
// being prepared (its demotion runs name them): that segment is `keep`.
//
// Cost: bytes copied are the slab's pages in use, which fit in the class's free pages,
// and the sparsest slab goes first; a rewrite walks backing_ and the cached prefixes
// once per slab. It runs only where the alternative is KVGC_ENOMEM (a preempted request)
// or a starved demotion (tokens evicted that the ladder would have kept).
#include "heap.hpp"

namespace kvgc {

Segment& ManagedHeap::segment_of(SegmentId id) {
  return seq_slots_[id / model_.n_layers]->layers[id % model_.n_layers];
}

bool ManagedHeap::evacuable(uint32_t slab, SegmentId keep) const {
  const Slab& s = pool_.arena().slab(slab);
  for (uint32_t i = 0; i < s.bump; ++i)
    if (!s.desc[i].is_free() && s.desc[i].owner == keep) return false;
  return true;
}

Status ManagedHeap::evacuate(int cls, uint64_t need, SegmentId keep, void* stream) {
  if (planned_ || pending_ || !gc_ops_.empty()) return Status::Ok();
  while (!pool_.can_alloc(cls, need)) {
    uint32_t best = UINT32_MAX;
    uint64_t best_bytes = UINT64_MAX;
    for (int c = 0; c < kNumClasses; ++c) {
      if (c == cls || pool_.pages_per_slab(c) == 0) continue;
      const uint32_t slab =
          pool_.sparsest_evacuable(c, [&](uint32_t i) { return evacuable(i, keep); });
      if (slab == UINT32_MAX) continue;
      const uint64_t bytes = uint64_t(pool_.arena().slab(slab).pages_used) * pool_.page_bytes(c);
      if (bytes < best_bytes) best = slab, best_bytes = bytes;
    }
    if (best == UINT32_MAX) break;  // nothing more to give: the caller's ENOMEM stands
    KVGC_TRY(evacuate_slab(best, stream));
  }
  return Status::Ok();
}

Status ManagedHeap::evacuate_slab(uint32_t slab, void* stream) {
  const Slab& s = pool_.arena().slab(slab);
  const int cls = s.cls;
  const size_t bytes = pool_.page_bytes(cls);
  const uint32_t n = s.pages_used;
  // Every container first (may throw: nothing changed yet).
  host::vector<std::pair<PageId, PageId>> moves;  // old -> new
  moves.reserve(n);
  pool_.drain(slab);
  // The copies: a device error gives the targets back and changes nothing.
  for (uint32_t i = 0, bump = s.bump; i < bump; ++i) {
    if (s.desc[i].is_free()) continue;
    const PageId from = pool_.page_id(slab, i);
    const PageDesc d = pool_.desc(from);
    const PageId to = pool_.alloc(cls, d.owner);  // never a fresh slab: the class's free pages
    KVGC_ASSERT(to != kNoPage);                   // outside this one hold them all
    pool_.desc(to).used = d.used;
    pool_.desc(to).live = d.live;
    moves.emplace_back(from, to);
    if (Status st = backend_->copy(page_ptr(to), page_ptr(from), bytes, CopyKind::DeviceToDevice, stream);
        !st.ok()) {
      for (const auto& [f, t] : moves) pool_.free(t);
      pool_.undrain(slab);
      return st;
    }
  }
  // The rewrite: nothing below allocates (node handles move between equal-sized maps).
  bool any_shared = false;
  for (const auto& [from, to] : moves) {
    const SegmentId owner = pool_.desc(from).owner;
    if (owner == kSharedOwner) {
      auto node = shared_.extract(from);
      node.key() = to;
      shared_.insert(std::move(node));
      any_shared = true;
      continue;
    }
    Segment& seg = segment_of(owner);
    bool found = false;
    for (PageTable& t : seg.table) {
      auto at = std::find(t.pages.begin(), t.pages.end(), from);
      if (at == t.pages.end()) continue;
      *at = to;
      found = true;
      break;
    }
    KVGC_ASSERT(found);
    if (cls == kHeaderClass) {
      auto node = backing_.extract(from);
      node.key() = to;
      backing_.insert(std::move(node));
    }
    touch(seg);
  }
  if (any_shared) {  // holders read the K/V from the copy; prefixes hold the copy
    auto moved = [&](PageId p) {
      for (const auto& [from, to] : moves)
        if (from == p) return to;
      return kNoPage;
    };
    for (auto& [header, b] : backing_)
      if (const PageId to = moved(b.page); to != kNoPage) {
        b.page = to;
        touch(segment_of(pool_.desc(header).owner));
      }
    for (auto& [id, e] : prefixes_)
      for (PageId& p : e.pages)
        if (const PageId to = moved(p); to != kNoPage) p = to;
  }
  for (const auto& [from, to] : moves) pool_.free(from);  // the last one returns the slab
  KVGC_ASSERT(pool_.arena().slab(slab).cls == Slab::kFree);
  counters_.pages_migrated += n;
  ++counters_.slabs_evacuated;
  return Status::Ok();
}

}  // namespace kvgc
