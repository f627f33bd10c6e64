// heap_check: the expensive invariant walker (mimalloc's mi_heap_check, in spirit).
// Allocator lists and counters, page ownership, and the host's page-granular counts
// against the slot metadata the device holds. Synchronises: a test and debug tool.
// It applies nothing: a segment whose GC results are pending (harvest.cpp) is checked
// as it stands, its live counts as the pre-GC upper bounds they are.
#include <algorithm>
#include <bit>
#include <unordered_set>
#include <vector>

#include "heap.hpp"

namespace kvgc {

Status ManagedHeap::check() {
  std::string err;
  if (!pool_.check(&err)) return fail(KVGC_EINTERNAL, "kvgc_heap_check: " + err);
  auto bad = [](const std::string& m) { return fail(KVGC_EINTERNAL, "kvgc_heap_check: " + m); };

  const uint32_t pt = opts_.page_tokens;
  uint64_t pages_in_tables = 0;
  std::unordered_set<PageId> seen;
  std::vector<uint8_t> header;
  for (const auto& [id, s] : seqs_) {
    if (s.slot >= seq_slots_.size() || seq_slots_[s.slot] != &s)
      return bad("sequence " + std::to_string(id) + " is not in its slot");
    for (uint32_t layer = 0; layer < model_.n_layers; ++layer) {
      const Segment& seg = s.layers[layer];
      const bool pending = seg.gc.active;
      if (pending) KVGC_TRY(backend_->event_wait(seg.gc.event));  // the device's state is final
      const std::string name = "segment (seq " + std::to_string(id) + ", layer " +
                               std::to_string(layer) + ")";
      std::unordered_set<int32_t> positions;
      uint64_t tiers[4] = {0, 0, 0, 0};
      for (int cls = 0; cls < KVGC_CLASS_COUNT; ++cls) {
        const PageTable& t = seg.table[cls];
        const std::string segname = name + " " + class_name(uint32_t(cls));
        uint64_t used = 0, live = 0;
        for (size_t i = 0; i < t.pages.size(); ++i) {
          const PageId p = t.pages[i];
          if (!pool_.allocated(p)) return bad(segname + " holds a page that is not allocated");
          if (!seen.insert(p).second) return bad(segname + " holds a page owned twice");
          if (pool_.class_of(p) != cls) return bad(segname + " holds a page of another class");
          const PageDesc& d = pool_.desc(p);
          if (d.owner != segment_id(s, layer)) return bad(segname + " holds another segment's page");
          if (d.live > d.used || d.used > pt) return bad(segname + " page counts out of range");
          if (d.live == 0 && !pending) return bad(segname + " holds a page with no live token");
          if (i + 1 < t.pages.size() && d.used != pt)
            return bad(segname + " has a partly filled page before its tail");
          used += d.used;
          live += d.live;
          // Device-side metadata of this page.
          const PageLayout& L = layout_[cls];
          header.resize(L.k_off);
          KVGC_TRY(backend_->copy(header.data(), page_ptr(p), L.k_off, CopyKind::DeviceToHost, nullptr));
          KVGC_TRY(backend_->synchronize(nullptr));
          const auto* bits = reinterpret_cast<const uint32_t*>(header.data() + L.live_off);
          const auto* pos = reinterpret_cast<const int32_t*>(header.data() + L.pos_off);
          const uint8_t* gen = header.data() + L.gen_off;
          uint32_t n_live = 0;
          for (uint32_t slot = 0; slot < pt; ++slot) {
            if (!(bits[slot / 32] >> (slot % 32) & 1)) continue;
            ++n_live;
            if (slot >= d.used) return bad(segname + " has a live bit past the page's used slots");
            if (pos[slot] < 0 || uint64_t(pos[slot]) >= seg.length)
              return bad(segname + " has a live slot with position " + std::to_string(pos[slot]) +
                         " outside [0, length)");
            if (!positions.insert(pos[slot]).second)
              return bad(segname + " has position " + std::to_string(pos[slot]) + " twice");
            const uint8_t g = gen_of(gen[slot]);
            ++tiers[g];
            if ((pos[slot] < int64_t(opts_.sinks)) != (g == kGenSink))
              return bad(segname + " has a sink flag that disagrees with its position");
          }
          if (n_live != d.live && !pending)
            return bad(segname + " page live count " + std::to_string(d.live) + " but " +
                       std::to_string(n_live) + " live bits on the device");
        }
        if (used != t.used || live != t.live) return bad(segname + " totals disagree with its pages");
        pages_in_tables += t.pages.size();
      }
      for (int g = 0; g < 4 && !pending; ++g)
        if (tiers[g] != seg.tier[g])
          return bad(name + " tier " + std::to_string(g) + " count " + std::to_string(seg.tier[g]) +
                     " but " + std::to_string(tiers[g]) + " tokens of that generation");
      // Sinks and the young window are never evicted: all of them must still be live.
      const uint64_t sinks = std::min<uint64_t>(opts_.sinks, seg.length);
      if (tiers[kGenSink] != sinks) return bad(name + " lost a sink");
      for (uint64_t p = seg.length > opts_.window ? seg.length - opts_.window : 0; p < seg.length; ++p)
        if (!positions.count(int32_t(p))) return bad(name + " lost position " + std::to_string(p) + " of its young window");
    }
  }
  for (const auto& [tenant, t] : tenants_) {
    uint64_t bytes = 0;
    for (const auto& [id, s] : seqs_)
      if (s.tenant == tenant)
        for (const Segment& seg : s.layers)
          for (int c = 0; c < KVGC_CLASS_COUNT; ++c) bytes += seg.table[c].pages.size() * layout_[c].bytes;
    bytes += batch_reserved_bytes(tenant);  // a plan's pages for layers not appended yet
    if (bytes != t.bytes)
      return bad("tenant " + std::to_string(tenant) + " is charged " + std::to_string(t.bytes) +
                 " bytes but holds " + std::to_string(bytes));
  }
  uint64_t pages_used = 0;
  for (int c = 0; c < KVGC_CLASS_COUNT; ++c) pages_used += pool_.counts(c).pages_used;
  pages_in_tables += batch_reserved_pages();
  if (pages_used != pages_in_tables)
    return bad(std::to_string(pages_used - pages_in_tables) + " allocated pages belong to no segment");
  for (uint32_t slot = 0; slot < seq_slots_.size(); ++slot)
    if (seq_slots_[slot] && seq_slots_[slot]->slot != slot) return bad("sequence slot map is corrupt");
  return Status::Ok();
}

}  // namespace kvgc
