// Shared pages: one page's K/V held by several segments (kvgc_seq_fork) and cached
// prefixes (prefix.cpp), each segment with liveness of its own.
//
// A shared page is immutable and owned by kSharedOwner. Every segment that holds it has,
// in its page table, a header page (kHeaderClass) in its place: that segment's live bits,
// positions, scores, recent scores and generations, laid out as the bytes of a page before
// its K/V, and the host's used/live counts for it. Ops read K/V from the shared page
// (SegPage::kv) and everything else from the header, so a GC that evicts a shared token
// clears one holder's bit and touches no shared byte. A reference count (SharedPage::refs:
// header pages naming it, plus cached prefixes holding it) returns the page to the pool
// when nothing holds it; it stays charged to the tenant whose sequence created it.
//
// What never writes into a shared page: appends (a partly filled shared tail is copied on
// first write: unshare_tail), demotion targets (the same, for a cheaper class's tail) and
// compaction (collect.cpp compacts a table's private pages only: moving a holder's live
// tokens out of a page others hold frees no byte of the arena).
#include <algorithm>

#include "heap.hpp"

namespace kvgc {

Status ManagedHeap::add_header(const SequenceState& holder, uint32_t layer, PageId shared,
                               const void* src, CopyKind kind, void* stream, PageId* out) {
  auto it = shared_.find(shared);
  KVGC_ASSERT(it != shared_.end());
  backing_.reserve(backing_.size() + 1);  // may throw: nothing taken yet
  const PageId h = take_page(holder, layer, kHeaderClass);
  if (h == kNoPage)
    return fail(KVGC_ENOMEM, "out of pages for a shared page's header (" +
                                 std::to_string(pool_.page_bytes(kHeaderClass)) + " bytes)");
  // The header page is written whole: its previous owner's bytes never show.
  auto undo = [&] {  // take_page's effects; the page names no shared page yet
    if (auto t = tenants_.find(holder.tenant); t != tenants_.end()) t->second.bytes -= pool_.page_bytes(kHeaderClass);
    pool_.free(h);
    ++counters_.pages_freed;
  };
  if (Status st = backend_->copy(page_ptr(h), src, header_bytes_, kind, stream); !st.ok()) {
    undo();
    return st;
  }
  try {
    backing_.emplace(h, Backing{shared});  // a node: may throw even with the buckets reserved
  } catch (...) {
    undo();
    throw;
  }
  ++it->second.refs;
  *out = h;
  return Status::Ok();
}

Status ManagedHeap::share(SequenceState& s, uint32_t layer, int cls, size_t index, void* stream) {
  Segment& seg = s.layers[layer];
  PageTable& t = seg.table[cls];
  const PageId p = t.pages[index];
  if (is_header(p)) return Status::Ok();  // shared already
  shared_.reserve(shared_.size() + 1);  // may throw: nothing changed yet
  backing_.reserve(backing_.size() + 1);
  shared_.emplace(p, SharedPage{0, s.tenant});
  PageId h;
  Status st;
  try {
    st = add_header(s, layer, p, page_ptr(p), CopyKind::DeviceToDevice, stream, &h);
  } catch (...) {
    shared_.erase(p);
    throw;
  }
  if (!st.ok()) {
    shared_.erase(p);
    return st;
  }
  PageDesc& d = pool_.desc(p);
  pool_.desc(h).used = d.used;
  pool_.desc(h).live = d.live;
  d.owner = kSharedOwner;
  t.pages[index] = h;
  ++counters_.pages_shared;
  touch(seg);
  return Status::Ok();
}

Status ManagedHeap::rebind_to_shared(SequenceState& s, uint32_t layer, size_t index, PageId cached,
                                     void* stream) {
  Segment& seg = s.layers[layer];
  PageTable& t = seg.table[KVGC_CLASS_FP16];
  const PageId p = t.pages[index];
  KVGC_ASSERT(!is_header(p) && pool_.desc(cached).used == pool_.desc(p).used);
  PageId h;
  KVGC_TRY(add_header(s, layer, cached, page_ptr(p), CopyKind::DeviceToDevice, stream, &h));
  pool_.desc(h).used = pool_.desc(p).used;
  pool_.desc(h).live = pool_.desc(p).live;
  t.pages[index] = h;
  drop_page(s.tenant, p);
  touch(seg);
  return Status::Ok();
}

Status ManagedHeap::unshare_tail(SequenceState& s, uint32_t layer, int cls, void* stream) {
  Segment& seg = s.layers[layer];
  PageTable& t = seg.table[cls];
  if (!tail_shared(t)) return Status::Ok();
  const PageId h = t.pages.back();
  const PageId q = take_page(s, layer, cls);
  if (q == kNoPage)
    return fail(KVGC_ENOMEM, "copying a shared partly filled page before writing into it: "
                             "no " + std::string(class_name(uint32_t(cls))) + " page is free");
  // The copy is whole: the header's bytes, then the shared page's K/V, scales and padding
  // (slots past `used` were zeroed when the page was first taken).
  const PageLayout& L = layout_[cls];
  Status st = backend_->copy(page_ptr(q), page_ptr(h), header_bytes_, CopyKind::DeviceToDevice, stream);
  if (st.ok())
    st = backend_->copy(page_ptr(q) + L.k_off, kv_of(h) + L.k_off, L.bytes - L.k_off,
                        CopyKind::DeviceToDevice, stream);
  if (!st.ok()) {
    drop_page(s.tenant, q);
    return st;
  }
  pool_.desc(q).used = pool_.desc(h).used;
  pool_.desc(q).live = pool_.desc(h).live;
  t.pages.back() = q;
  drop_page(s.tenant, h);
  ++counters_.cow_copies;
  touch(seg);
  return Status::Ok();
}

void ManagedHeap::unref_shared(PageId p) {
  auto it = shared_.find(p);
  KVGC_ASSERT(it != shared_.end() && it->second.refs > 0);
  if (--it->second.refs) {
    if (it->second.sole_holder()) ++sole_ready_;  // one holder left
    return;
  }
  if (auto t = tenants_.find(it->second.tenant); t != tenants_.end())
    t->second.bytes -= pool_.page_bytes(pool_.class_of(p));
  shared_.erase(it);
  pool_.free(p);
  ++counters_.pages_freed;
}

Status ManagedHeap::unshare_sole_holders(void* stream) {
  if (sole_ready_ == 0 || planned_ || !gc_ops_.empty()) return Status::Ok();
  KVGC_TRY(settle_all());  // a GC in flight writes its segment's header pages
  sole_ready_ = 0;
  struct Found {
    PageId header, page;
  };
  host::vector<Found> found;  // may throw: nothing changed yet
  for (const auto& [h, b] : backing_) {
    const SharedPage& sp = shared_.find(b.page)->second;
    if (sp.sole_holder() && !b.charged) found.push_back({h, b.page});
  }
  const uint64_t hb = pool_.page_bytes(kHeaderClass);
  for (const Found& f : found) {
    const SegmentId owner = pool_.desc(f.header).owner;
    SequenceState& s = *seq_slots_[owner / model_.n_layers];
    Segment& seg = s.layers[owner % model_.n_layers];
    const int cls = pool_.class_of(f.page);
    PageTable& t = seg.table[cls];
    const auto at = std::find(t.pages.begin(), t.pages.end(), f.header);
    KVGC_ASSERT(at != t.pages.end());
    // Pinned pages (KVGC_PREFIX_CHARGE=cache) stay headers: the walker and the GC find
    // them at the FP16 table's front. A page another tenant created stays charged to it.
    // (A header whose holder charges a slot below the page's class waits: Backing::charged.)
    if ((cls == KVGC_CLASS_FP16 && size_t(at - t.pages.begin()) < seg.pinned_pages) ||
        shared_.find(f.page)->second.tenant != s.tenant)
      continue;
    // The holder's metadata goes into the page's own header bytes (only K/V was read from
    // the page while it was shared); K/V stays where it is.
    KVGC_TRY(backend_->copy(page_ptr(f.page), page_ptr(f.header), header_bytes_,
                            CopyKind::DeviceToDevice, stream));
    PageDesc& d = pool_.desc(f.page);
    d.owner = owner;
    d.used = pool_.desc(f.header).used;
    d.live = pool_.desc(f.header).live;
    *at = f.page;
    shared_.erase(f.page);  // the page stays charged to s.tenant, as it was
    backing_.erase(f.header);
    if (auto it = tenants_.find(s.tenant); it != tenants_.end()) it->second.bytes -= hb;
    pool_.free(f.header);
    ++counters_.pages_freed;
    ++counters_.pages_unshared;
    touch(seg);
  }
  return Status::Ok();
}

uint64_t ManagedHeap::tenant_bytes_now(uint32_t tenant) const {
  uint64_t bytes = 0;
  for (const auto& [id, s] : seqs_)
    if (s.tenant == tenant)
      for (const Segment& seg : s.layers)
        for (const PageTable& t : seg.table)
          for (PageId p : t.pages) bytes += pool_.page_bytes(pool_.class_of(p));
  for (const auto& [p, sp] : shared_)
    if (sp.tenant == tenant) bytes += pool_.page_bytes(pool_.class_of(p));
  return bytes + batch_reserved_bytes(tenant);  // a plan's pages, not yet in a table
}

}  // namespace kvgc
