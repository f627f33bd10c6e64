// kvgc_seq_fork: a new sequence holding a copy of another's cache, page for page (K/V,
// slot metadata and the host's counts and GC state), so that both continue on their own:
// parallel sampling, beam search, one prompt shared by several continuations. The copy
// is one device-to-device copy per page, enqueued on the caller's stream.
#include <cstring>

#include "heap.hpp"

namespace kvgc {

bool ManagedHeap::can_alloc_all(const uint64_t n[KVGC_CLASS_COUNT]) const {
  uint64_t slabs = 0;
  for (int c = 0; c < KVGC_CLASS_COUNT; ++c) {
    const uint64_t free = pool_.counts(c).pages_free;
    const uint64_t per = pool_.pages_per_slab(c);
    if (n[c] > free) slabs += (n[c] - free + per - 1) / per;
  }
  return slabs <= pool_.arena().free_slabs();
}

Status ManagedHeap::seq_fork(kvgc_seq seq, uint32_t tenant, kvgc_seq* out, void* stream) {
  SequenceState* src;
  KVGC_TRY(find(seq, 0, "kvgc_seq_fork", &src));
  for (Segment& seg : src->layers) KVGC_TRY(settle(src->tenant, seg));  // exact counts
  uint64_t need[KVGC_CLASS_COUNT] = {0, 0, 0};
  for (const Segment& seg : src->layers)
    for (int c = 0; c < KVGC_CLASS_COUNT; ++c) need[c] += seg.table[c].pages.size();
  if (!can_alloc_all(need)) {
    KVGC_TRY(settle_all());  // pages pending GCs emptied come back first
    if (!can_alloc_all(need)) {
      ++counters_.enomem;
      return fail(KVGC_ENOMEM, "kvgc_seq_fork: the copy of seq " + std::to_string(seq) +
                                   " needs " + std::to_string(need[0]) + " fp16, " +
                                   std::to_string(need[2]) + " int8 and " +
                                   std::to_string(need[1]) + " int4 pages; the arena has no "
                                   "room for them");
    }
  }
  uint64_t bytes = 0;
  for (int c = 0; c < KVGC_CLASS_COUNT; ++c) bytes += need[c] * layout_[c].bytes;
  if (tenant_room(tenant) < bytes)
    return fail(KVGC_EBUDGET, "kvgc_seq_fork: tenant " + std::to_string(tenant) +
                                  " would pass its quota of " +
                                  std::to_string(tenants_.find(tenant)->second.limit) +
                                  " bytes (the copy holds " + std::to_string(bytes) + ")");
  free_slots_.reserve(free_slots_.size() + 1);  // so that undoing cannot allocate
  kvgc_seq id = 0;
  KVGC_TRY(seq_create(tenant, &id));
  SequenceState& dst = seqs_.find(id)->second;  // src stays valid: the map is node-based
  // Everything below either completes or is undone by destroying the new sequence.
  Status st;
  try {
    for (uint32_t layer = 0; layer < model_.n_layers && st.ok(); ++layer) {
      const Segment& from = src->layers[layer];
      Segment& to = dst.layers[layer];
      for (int c = 0; c < KVGC_CLASS_COUNT && st.ok(); ++c) {
        const PageTable& ft = from.table[c];
        PageTable& tt = to.table[c];
        tt.pages.reserve(ft.pages.size());
        for (PageId p : ft.pages) {
          const PageId q = take_page(dst, layer, c);
          if (q == kNoPage) {
            st = fail(KVGC_ENOMEM, "kvgc_seq_fork: out of host memory for page descriptors");
            break;
          }
          tt.pages.push_back(q);
          pool_.desc(q).used = pool_.desc(p).used;
          pool_.desc(q).live = pool_.desc(p).live;
          st = backend_->copy(page_ptr(q), page_ptr(p), layout_[c].bytes,
                              CopyKind::DeviceToDevice, stream);
          if (!st.ok()) break;
        }
        tt.live = ft.live;
        tt.used = ft.used;
      }
      to.length = from.length;
      std::memcpy(to.tier, from.tier, sizeof to.tier);
      to.since_minor = from.since_minor;
      to.minors_since_major = from.minors_since_major;
      to.promote_blocked = from.promote_blocked;
    }
  } catch (...) {
    (void)seq_destroy(id);
    throw;
  }
  if (!st.ok()) {
    (void)seq_destroy(id);
    return st;
  }
  *out = id;
  return Status::Ok();
}

}  // namespace kvgc
