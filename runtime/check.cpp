// heap_check: the expensive invariant walker (mimalloc's mi_heap_check, in spirit).
// Allocator lists and counters, page ownership, and the host's page-granular counts
// against the slot metadata the device holds. Synchronises: a test and debug tool.
// It applies nothing: a segment whose GC results are pending (harvest.cpp) is checked
// as it stands, its live counts as the pre-GC upper bounds they are.
#include <algorithm>
#include <bit>
#include <unordered_map>
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
  std::unordered_map<PageId, uint64_t> refs;  // shared page -> header pages and prefixes
  std::unordered_map<PageId, uint64_t> cheap;  // shared page -> cheap headers (shrink.cpp) naming it
  std::unordered_map<PageId, uint64_t> prefix_refs;  // ... of which prefixes
  std::vector<uint8_t> header;
  for (const auto& [id, s] : seqs_) {
    if (s.slot >= seq_slots_.size() || seq_slots_[s.slot] != &s)
      return bad("sequence " + std::to_string(id) + " is not in its slot");
    const host::vector<LayerBudget> budgets = layer_budgets(s);  // their young windows
    for (uint32_t layer = 0; layer < model_.n_layers; ++layer) {
      const Segment& seg = s.layers[layer];
      const bool pending = seg.gc.active;
      if (pending) KVGC_TRY(backend_->event_wait(seg.gc.event));  // the device's state is final
      const std::string name = "segment (seq " + std::to_string(id) + ", layer " +
                               std::to_string(layer) + ")";
      std::unordered_set<int32_t> positions;
      uint64_t tiers[4] = {0, 0, 0, 0};
      int64_t shift[KVGC_CLASS_COUNT] = {};  // slots charged apart (Segment::shift)
      for (int cls = 0; cls < KVGC_CLASS_COUNT; ++cls) {
        const PageTable& t = seg.table[cls];
        const std::string segname = name + " " + class_name(uint32_t(cls));
        uint64_t used = 0, live = 0;
        for (size_t i = 0; i < t.pages.size(); ++i) {
          const PageId p = t.pages[i];
          if (!pool_.allocated(p)) return bad(segname + " holds a page that is not allocated");
          if (!seen.insert(p).second) return bad(segname + " holds a page owned twice");
          if (is_header(p)) {  // a shared page's header: the shared page must be sound
            const auto b = backing_.find(p);
            if (b == backing_.end()) return bad(segname + " holds a header page that names no shared page");
            const PageId q = b->second.page;
            if (!pool_.allocated(q) || !shared_.count(q)) return bad(segname + " reads a shared page that is not held");
            if (pool_.class_of(q) != cls) return bad(segname + " reads a shared page of another class");
            if (pool_.desc(q).owner != kSharedOwner) return bad(segname + " reads a shared page that has an owner");
            if (pool_.desc(p).used > pool_.desc(q).used)
              return bad(segname + " uses more slots of a shared page than it holds");
            ++refs[q];
            cheap[q] += b->second.cheap;
          } else if (pool_.class_of(p) != cls) {
            return bad(segname + " holds a page of another class");
          }
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
          header.resize(header_bytes_);
          KVGC_TRY(backend_->copy(header.data(), page_ptr(p), header_bytes_, CopyKind::DeviceToHost, nullptr));
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
            if (is_header(p) && backing_.find(p)->second.cheap && !pending &&
                class_rank(counted_class(gen[slot], uint32_t(cls))) < class_rank(uint32_t(shrink_class_)))
              return bad(segname + " has a header marked as counting no slot above " +
                         class_name(uint32_t(shrink_class_)) + " with a live slot counted at " +
                         class_name(counted_class(gen[slot], uint32_t(cls))));
            if (const uint32_t c = charged_of(gen[slot])) {  // KVGC_PREFIX_CHARGE=prune
              // (A private page too: a partly filled shared tail copied before an append
              // keeps its header's charges. At its own class: a page shrunk to the class
              // the slot was charged at, shrink.cpp.)
              if (!charges_in_place() || c >= KVGC_CLASS_COUNT ||
                  class_rank(c) < class_rank(uint32_t(cls)))
                return bad(segname + " has a slot charged at " + class_name(c) +
                           " without a demotion in place to that class");
              ++shift[c];
              --shift[cls];
            }
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
      // Pinned pages (prefix.cpp): full header pages at the FP16 table's front, their
      // tokens all live and counted apart.
      const PageTable& f = seg.table[KVGC_CLASS_FP16];
      if (seg.pinned_pages > f.pages.size() || seg.pinned_live != uint64_t(seg.pinned_pages) * pt ||
          seg.pinned_tier[0] + seg.pinned_tier[1] != seg.pinned_live || seg.pinned_tier[2] || seg.pinned_tier[3])
        return bad(name + " pinned counts are inconsistent");
      for (uint32_t i = 0; i < seg.pinned_pages; ++i)
        if (!is_header(f.pages[i]) || pool_.desc(f.pages[i]).live != pt)
          return bad(name + " has a pinned page that is not a whole shared page");
      // The plan's tail cache (heap.hpp), whenever it claims to be valid.
      const Tail tail = tail_of(f);
      if (seg.tail_epoch == seg.epoch &&
          (seg.tail_count != f.pages.size() || seg.tail_page != tail.page ||
           seg.tail_used != tail.used || seg.tail_header != tail.header))
        return bad(name + " has a stale FP16 tail cache that claims to be current");
      // The plan's mirror (heap.hpp), whenever it claims to be current.
      if (s.mirror_changes == s.changes) {
        const PlanMirror& m = s.mirror[layer];
        const PlanMirror want = mirror_of(seg, tail, uint32_t(seg.attn.size()));
        if (m.length != want.length || m.epoch != want.epoch || seg.attn_epoch != seg.epoch ||
            m.rows != want.rows || m.pages != want.pages || m.tail != want.tail ||
            m.tail_used != want.tail_used || m.tail_header != want.tail_header)
          return bad(name + " has a stale plan mirror that claims to be current");
      }
      for (int c = 0; c < KVGC_CLASS_COUNT && !pending; ++c)
        if (shift[c] != seg.shift[c])
          return bad(name + " is charged " + std::to_string(seg.shift[c]) + " tokens apart at " +
                     class_name(uint32_t(c)) + " but its slots say " + std::to_string(shift[c]));
      for (int g = 0; g < 4 && !pending; ++g)
        if (tiers[g] != seg.tier[g])
          return bad(name + " tier " + std::to_string(g) + " count " + std::to_string(seg.tier[g]) +
                     " but " + std::to_string(tiers[g]) + " tokens of that generation");
      // Sinks and the young window are never evicted: all of them must still be live (the
      // window's positions that no earlier, narrower window left evictable: heap.hpp).
      const uint64_t sinks = std::min<uint64_t>(opts_.sinks, seg.length);
      if (tiers[kGenSink] != sinks) return bad(name + " lost a sink");
      const uint64_t window = young_window(policy_, budgets[layer].units);
      const uint64_t young_from = std::max(seg.length > window ? seg.length - window : 0, seg.evictable_below);
      for (uint64_t p = young_from; p < seg.length; ++p)
        if (!positions.count(int32_t(p))) return bad(name + " lost position " + std::to_string(p) + " of its young window");
    }
  }
  // Cached prefixes: every page they hold is shared, and their index names them.
  for (const auto& [id, e] : prefixes_) {
    const std::string name = "cached prefix " + std::to_string(id);
    if (e.pages.size() != size_t(model_.n_layers) * e.n_pages || e.hashes.size() != e.n_pages ||
        e.ids.size() > uint64_t(e.n_pages) * pt || e.ids.size() <= uint64_t(e.n_pages - 1) * pt)
      return bad(name + " has the wrong number of pages");
    for (PageId q : e.pages) {
      if (!shared_.count(q) || !pool_.allocated(q)) return bad(name + " holds a page that is not shared");
      ++refs[q];
      ++prefix_refs[q];
    }
    for (uint64_t h : e.hashes) {
      bool indexed = false;
      for (auto [a, b] = prefix_index_.equal_range(h); a != b && !indexed; ++a) indexed = a->second == id;
      if (!indexed) return bad(name + " has a page the index does not name");
    }
  }
  size_t indexed = 0;
  for (const auto& [h, id] : prefix_index_) {
    if (!prefixes_.count(id)) return bad("the prefix index names a dropped prefix");
    ++indexed;
  }
  size_t hashes = 0;
  for (const auto& [id, e] : prefixes_) hashes += e.hashes.size();
  if (indexed != hashes) return bad("the prefix index has entries no prefix holds");
  // Reference counts balance: each shared page's count is its holders, and nothing else
  // holds it.
  for (const auto& [q, sp] : shared_) {
    const auto r = refs.find(q);
    if (r == refs.end() || r->second != sp.refs)
      return bad("shared page " + std::to_string(q) + " counts " + std::to_string(sp.refs) +
                 " holders but " + std::to_string(r == refs.end() ? 0 : r->second) + " hold it");
    if (seen.count(q)) return bad("shared page " + std::to_string(q) + " is also in a page table");
    if (cheap[q] != sp.cheap)
      return bad("shared page " + std::to_string(q) + " counts " + std::to_string(sp.cheap) +
                 " holders counting no slot above the shrink class, but " + std::to_string(cheap[q]) + " are marked");
    if (sp.cheap && shrink_class_ < 0) return bad("a heap that never shrinks has a header marked for it");
    const auto pr = prefix_refs.find(q);
    if ((pr == prefix_refs.end() ? 0 : pr->second) != sp.prefix_refs)
      return bad("shared page " + std::to_string(q) + " counts " + std::to_string(sp.prefix_refs) +
                 " cached prefixes holding it, but another number do");
  }
  if (refs.size() != shared_.size()) return bad("a header page reads a page that is not counted as shared");
  if (backing_.size() != pool_.counts(kHeaderClass).pages_used)
    return bad("header pages and their shared pages disagree");
  for (const auto& [tenant, t] : tenants_) {
    const uint64_t bytes = tenant_bytes_now(tenant);  // incl. a plan's pages not appended yet
    if (bytes != t.bytes)
      return bad("tenant " + std::to_string(tenant) + " is charged " + std::to_string(t.bytes) +
                 " bytes but holds " + std::to_string(bytes));
  }
  uint64_t pages_used = 0;
  for (int c = 0; c < kNumClasses; ++c) pages_used += pool_.counts(c).pages_used;
  pages_in_tables += batch_reserved_pages() + shared_.size();
  if (pages_used != pages_in_tables)
    return bad(std::to_string(pages_used - pages_in_tables) + " allocated pages belong to no segment");
  for (uint32_t slot = 0; slot < seq_slots_.size(); ++slot)
    if (seq_slots_[slot] && seq_slots_[slot]->slot != slot) return bad("sequence slot map is corrupt");
  return Status::Ok();
}

}  // namespace kvgc
