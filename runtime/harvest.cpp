// The deferred harvest: a GC's page-level results applied after the step that issued
// it. The decision op runs on the device and writes its results (live slots per page,
// a SelectResult) into pinned memory (PinnedPool); an event marks their completion. Until
// they are applied the host's counts stay what they were plus later appends, and every
// consumer copes:
//   - appends fill the FP16 tail from `used`, which the op never changes;
//   - attention numbers its rows by `used` (an upper bound on live slots), and the
//     demotion targets' reserved slots (INT8, INT4) already count in `used`;
//   - whatever needs exact counts (read, observe, stats, the next step, ...) settles
//     first. Settling is what collect did right after select before: page live counts,
//     unfilled demotion slots given back, emptied pages freed, counters. Compaction
//     follows where a stream of the segment's is at hand (its next step, or an append
//     that would not fit otherwise).
#include "heap.hpp"

namespace kvgc {
namespace {

// One block per segment:
// [SelectResult][page_live x cap][page_classes x cap][SegPage x cap][AppendRun x cap].
constexpr size_t round16(size_t n) { return (n + 15) / 16 * 16; }
size_t live_off() { return round16(sizeof(SelectResult)); }
size_t classes_off(size_t cap) { return live_off() + round16(cap * sizeof(uint16_t)); }
size_t pages_off(size_t cap) { return classes_off(cap) + round16(cap); }
size_t runs_off(size_t cap) { return pages_off(cap) + round16(cap * sizeof(SegPage)); }
size_t block_bytes(size_t cap) { return runs_off(cap) + round16(cap * sizeof(AppendRun)); }

}  // namespace

SelectResult* PendingGc::result() const { return reinterpret_cast<SelectResult*>(buf); }
uint16_t* PendingGc::page_live() const { return reinterpret_cast<uint16_t*>(buf + live_off()); }
uint8_t* PendingGc::page_classes() const { return buf + classes_off(capacity); }
SegPage* PendingGc::pages() const { return reinterpret_cast<SegPage*>(buf + pages_off(capacity)); }
AppendRun* PendingGc::runs() const { return reinterpret_cast<AppendRun*>(buf + runs_off(capacity)); }

Status ManagedHeap::harvest_reserve(PendingGc& p, size_t pages) {
  if (p.buf && p.capacity >= pages) return Status::Ok();
  if (!p.event_made) {  // events are reused across segments: creating one costs a call
    if (!spare_events_.empty()) {
      p.event = spare_events_.back();
      spare_events_.pop_back();
    } else {
      spare_events_.reserve(events_made_ + 1);  // so that giving it back never allocates
      KVGC_TRY(backend_->event_create(&p.event));
      ++events_made_;
    }
    p.event_made = true;
  }
  size_t cap = 64;
  while (cap < pages) cap *= 2;
  if (cap > UINT32_MAX) return fail(KVGC_ENOMEM, "kvgc_step: a segment of " +
                                                     std::to_string(pages) + " pages");
  void* buf = nullptr;
  size_t got = 0;
  KVGC_TRY(pinned_.alloc(*backend_, block_bytes(cap), &buf, &got));
  pinned_.free(*backend_, p.buf, p.buf_bytes);  // never while pending: collect settled first
  p.buf = static_cast<uint8_t*>(buf);
  p.buf_bytes = got;
  p.capacity = uint32_t(cap);
  return Status::Ok();
}

void ManagedHeap::harvest_release(uint32_t tenant, Segment& seg) {
  PendingGc& p = seg.gc;
  if (p.active && !settle(tenant, seg).ok()) {  // a failed device: nothing to apply
    p.active = false;
    --pending_;
  }
  pinned_.free(*backend_, p.buf, p.buf_bytes);
  if (p.event_made) spare_events_.push_back(p.event);  // capacity reserved at creation
  p = PendingGc{};
}

Status ManagedHeap::settle(uint32_t tenant, Segment& seg) {
  PendingGc& p = seg.gc;
  if (!p.active) return Status::Ok();
  KVGC_TRY(backend_->event_wait(p.event));
  p.active = false;
  touch(seg);
  --pending_;
  const SelectResult& r = *p.result();
  const uint16_t* page_live = p.page_live();
  PageTable& f = seg.table[KVGC_CLASS_FP16];
  // Page live counts: the op's, plus what appends added to the FP16 tail since (pages
  // appended after the issue were not in the op and are exact already). The op's pages
  // are in read order: each class's first n_pages at issue.
  // The FP16 table's pinned pages (prefix.cpp) come first and were not in the op.
  // Header pages also learn which classes their live slots count at (shrink.cpp).
  const uint8_t* page_classes = p.page_classes();
  uint32_t at = 0;
  for (int c = 0; c < KVGC_CLASS_COUNT; ++c) {
    const uint32_t skip = c == KVGC_CLASS_FP16 ? seg.pinned_pages : 0;
    for (uint32_t i = 0; i < p.n_pages[c]; ++i, ++at) {
      const PageId page = seg.table[c].pages[skip + i];
      pool_.desc(page).live = page_live[at];
      if (charges_in_place() && is_header(page)) note_classes(page, c, page_classes[at]);
    }
  }
  if (p.n_pages[0]) {
    PageDesc& tail = pool_.desc(f.pages[seg.pinned_pages + p.n_pages[0] - 1]);
    tail.live = uint16_t(tail.live + (tail.used - p.tail_used));
  }
  // Demotion slots were reserved in `used` at issue: give back those not filled (each
  // class's runs fill in order).
  for (int c = 0; c < KVGC_CLASS_COUNT; ++c) {
    uint64_t filled = r.demoted_to[c];
    const AppendRun* runs = p.runs(c);
    for (uint32_t i = 0; i < p.n_runs[c]; ++i) {
      const uint32_t n = uint32_t(std::min<uint64_t>(runs[i].count, filled));
      PageDesc& d = pool_.desc(pool_.page_at(reinterpret_cast<uintptr_t>(runs[i].page)));
      d.used = uint16_t(d.used - (runs[i].count - n));
      seg.table[c].used -= runs[i].count - n;
      filled -= n;
    }
  }
  f.live = r.live[KVGC_CLASS_FP16] + seg.pinned_live + (f.live - p.fp16_live);
  for (int c = 1; c < KVGC_CLASS_COUNT; ++c) seg.table[c].live = r.live[c];
  std::copy(std::begin(r.shift), std::end(r.shift), seg.shift);  // appends since add none
  for (int g = 0; g < 4; ++g) seg.tier[g] = r.tier[g] + seg.pinned_tier[g] + (seg.tier[g] - p.tier[g]);
  for (PageTable& t : seg.table) free_empty_pages(tenant, t);  // incl. unwritten demotion pages

  ++counters_.gcs;
  counters_.tokens_ranked += r.ranked;
  counters_.tokens_evicted += r.evicted;
  counters_.tokens_demoted += r.demoted;
  counters_.tokens_promoted += r.promoted;
  counters_.tokens_tenured += r.tenured;
  for (int c = 0; c < KVGC_CLASS_COUNT; ++c) {
    counters_.demoted_to[c] += r.demoted_to[c];
    counters_.bytes_moved += r.demoted_to[c] * 2 * uint64_t(model_.n_kv_heads) *
                             (layout_[c].slot_stride + 2 * layout_[c].qwords);
  }
  if (opts_.policy == KVGC_POLICY_GENERATIONAL) {
    ++(p.minor ? counters_.minor_gcs : counters_.major_gcs);
    if (p.minor) seg.promote_blocked = r.promote_eligible > 0;
  }
  return Status::Ok();
}

Status ManagedHeap::settle_all() {
  if (pending_ == 0) return Status::Ok();
  for (auto& [id, s] : seqs_)
    for (Segment& seg : s.layers) KVGC_TRY(settle(s.tenant, seg));
  return Status::Ok();
}

}  // namespace kvgc
