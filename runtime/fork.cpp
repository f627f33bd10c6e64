// kvgc_seq_fork: a new sequence holding a copy of another's cache (K/V, slot metadata,
// the host's counts and GC state), so that both continue on their own: parallel
// sampling, beam search, one prompt shared by several continuations. Since 0.7 the copy
// shares the pages (shared.cpp): each of seq's private pages becomes shared, and the new
// sequence gets a header page per page, a copy of seq's. No K/V byte is copied; the first
// write into a shared partly filled tail copies that page.
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
  // Header pages: one for the new sequence per page, one for seq per page it still holds
  // privately.
  uint64_t mine = 0, theirs = 0;
  for (const Segment& seg : src->layers)
    for (const PageTable& t : seg.table)
      for (PageId p : t.pages) {
        ++theirs;
        mine += !is_header(p);
      }
  const uint64_t hb = pool_.page_bytes(kHeaderClass);
  auto room = [&] { return pool_.can_alloc(kHeaderClass, mine + theirs); };
  if (!room()) {
    KVGC_TRY(settle_all());  // pages pending GCs emptied come back first, then other
    KVGC_TRY(evacuate(kHeaderClass, mine + theirs, kNoSegment, stream));  // classes' sparse
    while (!room() && evict_one_prefix()) {}                            // slabs, then prefixes
    if (!room()) {
      ++counters_.enomem;
      return fail(KVGC_ENOMEM, "kvgc_seq_fork: sharing seq " + std::to_string(seq) + "'s " +
                                   std::to_string(theirs) + " pages needs " +
                                   std::to_string(mine + theirs) + " header pages of " +
                                   std::to_string(hb) + " bytes; the arena has no room for them");
    }
  }
  const bool same = tenant == src->tenant;
  if (tenant_room(src->tenant) < (same ? mine + theirs : mine) * hb)
    return fail(KVGC_EBUDGET, "kvgc_seq_fork: tenant " + std::to_string(src->tenant) +
                                  " would pass its quota of " +
                                  std::to_string(tenants_.find(src->tenant)->second.limit) +
                                  " bytes (the fork's header pages: " +
                                  std::to_string((same ? mine + theirs : mine) * hb) + " bytes)");
  if (!same && tenant_room(tenant) < theirs * hb)
    return fail(KVGC_EBUDGET, "kvgc_seq_fork: tenant " + std::to_string(tenant) +
                                  " would pass its quota of " +
                                  std::to_string(tenants_.find(tenant)->second.limit) +
                                  " bytes (the copy's header pages: " + std::to_string(theirs * hb) +
                                  " bytes)");
  kvgc_seq id = 0;
  KVGC_TRY(seq_create(tenant, &id));
  SequenceState& dst = seqs_.find(id)->second;  // src stays valid: the map is node-based
  // Everything below either completes or is undone by destroying the new sequence (seq's
  // pages made shared stay so: the same tokens, read the same way).
  Status st;
  try {
    for (uint32_t layer = 0; layer < model_.n_layers && st.ok(); ++layer) {
      Segment& from = src->layers[layer];
      Segment& to = dst.layers[layer];
      for (int c = 0; c < KVGC_CLASS_COUNT && st.ok(); ++c) {
        PageTable& ft = from.table[c];
        PageTable& tt = to.table[c];
        tt.pages.reserve(ft.pages.size());
        for (size_t i = 0; i < ft.pages.size() && st.ok(); ++i) {
          st = share(*src, layer, c, i, stream);
          if (!st.ok()) break;
          const PageId h = ft.pages[i];
          PageId q;
          st = add_header(dst, layer, backing_.find(h)->second.page, page_ptr(h),
                          CopyKind::DeviceToDevice, stream, &q);
          if (!st.ok()) break;
          tt.pages.push_back(q);
          if (backing_.find(h)->second.cheap) mark_cheap(q);  // the same slots and charges
          pool_.desc(q).used = pool_.desc(h).used;
          pool_.desc(q).live = pool_.desc(h).live;
        }
        tt.live = ft.live;
        tt.used = ft.used;
      }
      to.length = from.length;
      std::memcpy(to.tier, from.tier, sizeof to.tier);
      to.since_minor = from.since_minor;
      to.minors_since_major = from.minors_since_major;
      to.promote_blocked = from.promote_blocked;
      to.evictable_below = from.evictable_below;
      to.pinned_pages = from.pinned_pages;  // the copy decides as its source does
      to.pinned_live = from.pinned_live;
      std::memcpy(to.pinned_tier, from.pinned_tier, sizeof to.pinned_tier);
      std::memcpy(to.shift, from.shift, sizeof to.shift);  // the headers' gen bytes are copied
    }
    dst.attached_pages = src->attached_pages;  // its prompt's pages where the source's are
    dst.attached_cls = src->attached_cls;
  } catch (...) {
    (void)seq_destroy(id);
    throw;
  }
  if (!st.ok()) {
    (void)seq_destroy(id);
    return fail(st.code, "kvgc_seq_fork: " + std::string(st.text()));
  }
  *out = id;
  return Status::Ok();
}

}  // namespace kvgc
