// heap_check: the expensive invariant walker (mimalloc's mi_heap_check, in spirit).
// Allocator lists and counters, page ownership, and the host's page-granular counts
// against the slot metadata the device holds. Synchronises: a test and debug tool.
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
  for (const auto& [id, sp] : seqs_) {
    const SequenceState& s = *sp;
    if (s.slot >= seq_slots_.size() || seq_slots_[s.slot] != &s)
      return bad("sequence " + std::to_string(id) + " is not in its slot");
    for (uint32_t layer = 0; layer < model_.n_layers; ++layer) {
      const PageTable& t = s.layers[layer];
      const std::string seg = "segment (seq " + std::to_string(id) + ", layer " +
                              std::to_string(layer) + ")";
      uint64_t used = 0, live = 0;
      std::unordered_set<int32_t> positions;
      for (size_t i = 0; i < t.pages.size(); ++i) {
        const PageId p = t.pages[i];
        if (!pool_.allocated(p)) return bad(seg + " holds a page that is not allocated");
        if (!seen.insert(p).second) return bad(seg + " holds a page owned twice");
        const PageDesc& d = pool_.desc(p);
        if (d.owner != segment_id(s, layer)) return bad(seg + " holds another segment's page");
        if (d.live > d.used || d.used > pt) return bad(seg + " page counts out of range");
        if (d.used == 0) return bad(seg + " holds an empty page");
        if (i + 1 < t.pages.size() && d.used != pt)
          return bad(seg + " has a partly filled page before its tail");
        used += d.used;
        live += d.live;
        // Device-side metadata of this page.
        const PageLayout& L = layout_[pool_.class_of(p)];
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
          if (slot >= d.used) return bad(seg + " has a live bit past the page's used slots");
          if (pos[slot] < 0 || uint64_t(pos[slot]) >= t.length)
            return bad(seg + " has a live slot with position " + std::to_string(pos[slot]) +
                       " outside [0, length)");
          if (!positions.insert(pos[slot]).second)
            return bad(seg + " has position " + std::to_string(pos[slot]) + " twice");
          if (gen[slot] > kGenLongTerm) return bad(seg + " has a bad generation");
          if ((pos[slot] < int64_t(opts_.sinks)) != (gen[slot] == kGenSink))
            return bad(seg + " has a sink flag that disagrees with its position");
        }
        if (n_live != d.live)
          return bad(seg + " page live count " + std::to_string(d.live) + " but " +
                     std::to_string(n_live) + " live bits on the device");
      }
      if (used != t.used || live != t.live)
        return bad(seg + " totals disagree with its pages");
      if (t.used > t.length) return bad(seg + " holds more slots than it was given tokens");
      pages_in_tables += t.pages.size();
    }
  }
  uint64_t pages_used = 0;
  for (int c = 0; c < KVGC_CLASS_COUNT; ++c) pages_used += pool_.counts(c).pages_used;
  if (pages_used != pages_in_tables)
    return bad(std::to_string(pages_used - pages_in_tables) + " allocated pages belong to no segment");
  for (uint32_t slot = 0; slot < seq_slots_.size(); ++slot)
    if (seq_slots_[slot] && seq_slots_[slot]->slot != slot) return bad("sequence slot map is corrupt");
  return Status::Ok();
}

}  // namespace kvgc
