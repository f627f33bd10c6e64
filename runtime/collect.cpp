// The GC's runtime side: kvgc_observe and kvgc_step. The host plans from page-granular
// counts (gc/), one data-plane op picks the tokens (kernels/), and the host applies the
// op's page-level results: frees empty pages, updates counts, compacts when fragmented.
// On CUDA the select op synchronises the stream so that its results are here at once
// (backend.hpp); observe and compaction are only enqueued.
#include <algorithm>
#include <cmath>

#include "../gc/compaction.hpp"
#include "../gc/layer_budget.hpp"
#include "heap.hpp"

namespace kvgc {

Status ManagedHeap::observe(kvgc_seq seq, uint32_t layer, const float* mass, uint64_t n,
                            void* stream) {
  SequenceState* s;
  KVGC_TRY(find(seq, layer, "kvgc_observe", &s));
  const Segment& seg = s->layers[layer];
  if (n != seg.live())
    return fail(KVGC_EINVAL, "kvgc_observe: n " + std::to_string(n) +
                                 " differs from the segment's live count " +
                                 std::to_string(seg.live()) + " (mass is in kvgc_read order)");
  if (n == 0) return Status::Ok();
  KVGC_TRY(backend_->check_pointer(mass, "kvgc_observe: mass"));
  if (uintptr_t(mass) % alignof(float))
    return fail(KVGC_EINVAL, "kvgc_observe: mass must be 4-byte aligned");
  segment_pages(seg, &pages_);
  ObserveOp op{{layout_[0], layout_[1]}, pages_.data(), uint32_t(pages_.size()), mass};
  KVGC_TRY(backend_->observe(op, stream));
  ++counters_.observes;
  return Status::Ok();
}

host::vector<uint64_t> ManagedHeap::layer_budgets(const SequenceState& s) {
  uint64_t base = kNoBudget;
  if (opts_.token_budget) {
    base = opts_.token_budget;
  } else if (opts_.token_budget_fraction > 0) {
    uint64_t length = 0;
    for (const Segment& seg : s.layers) length = std::max(length, seg.length);
    base = uint64_t(std::ceil(opts_.token_budget_fraction * double(length)));
  }
  if (base == kNoBudget) return host::vector<uint64_t>(s.layers.size(), kNoBudget);
  // The split keeps each layer at least its protected tokens where the mean allows.
  const uint64_t floor = uint64_t(opts_.sinks) + opts_.window;
  if (opts_.layer_budget == KVGC_LAYER_BUDGET_ENTROPY)
    return split_by_weights(layer_weights_.data(), uint32_t(s.layers.size()), base, floor);
  return split_layer_budget(opts_.layer_budget, uint32_t(s.layers.size()), base, floor);
}

Status ManagedHeap::step(kvgc_seq seq, void* stream) {
  SequenceState* s;
  KVGC_TRY(find(seq, 0, "kvgc_step", &s));
  ++counters_.steps;
  if (opts_.policy == KVGC_POLICY_FULL) return Status::Ok();  // never evicts, never fragments
  const host::vector<uint64_t> budgets = layer_budgets(*s);
  uint32_t short_layers = 0;
  for (uint32_t layer = 0; layer < model_.n_layers; ++layer) {
    bool short_of_budget = false;
    KVGC_TRY(collect(*s, layer, budgets[layer], stream, &short_of_budget));
    short_layers += short_of_budget;
  }
  if (short_layers) {
    counters_.ebudget += short_layers;
    return fail(KVGC_EBUDGET, "kvgc_step: " + std::to_string(short_layers) +
                                  " segment(s) of seq " + std::to_string(seq) +
                                  " stay over their token budget: every remaining token is "
                                  "protected (sinks, young window); nothing was lost");
  }
  return Status::Ok();
}

void ManagedHeap::free_empty_pages(uint32_t tenant, PageTable& t) {
  size_t kept = 0;
  for (PageId p : t.pages) {
    const PageDesc& d = pool_.desc(p);
    if (d.live == 0) {
      t.used -= d.used;
      drop_page(tenant, p);
    } else {
      t.pages[kept++] = p;
    }
  }
  t.pages.resize(kept);
}

Status ManagedHeap::collect(SequenceState& s, uint32_t layer, uint64_t budget, void* stream,
                            bool* short_of_budget) {
  Segment& seg = s.layers[layer];
  SegmentView v;
  v.length = seg.length;
  v.live_fp16 = seg.table[KVGC_CLASS_FP16].live;
  v.live_int4 = seg.table[KVGC_CLASS_INT4].live;
  std::copy(std::begin(seg.tier), std::end(seg.tier), v.tier);
  v.since_minor = seg.since_minor;
  v.minors_since_major = seg.minors_since_major;
  v.promote_blocked = seg.promote_blocked;
  v.budget = budget;
  const GcPlan g = plan_gc(policy_, v);

  if (g.run) {
    PageTable& q = seg.table[KVGC_CLASS_INT4];
    const uint32_t pt = opts_.page_tokens;
    // Demotion targets: the int4 tail's room, then as many new int4 pages as the
    // reclaim could use and the arena allows (fewer targets just means more evictions).
    runs_.clear();
    const size_t int4_before = q.pages.size();
    const double per = 1.0 - policy_.int4_cost;
    // Slots demotion could use: the reclaim over what one demotion saves (> 0.25 units).
    const double wanted = g.demote && g.reclaim > 0 && per > 0 ? std::ceil(g.reclaim / per) + 1 : 0;
    const uint64_t want_slots =
        wanted >= double(v.live_fp16) ? v.live_fp16 : uint64_t(wanted);
    // Every host container this collection needs is sized before the first page is
    // taken, so running out of host memory cannot strand a demotion page.
    const size_t max_new = (want_slots + pt - 1) / pt;
    const size_t max_pages = seg.table[0].pages.size() + q.pages.size() + max_new;
    runs_.reserve(max_new + 1);
    pages_.reserve(max_pages);
    page_live_.reserve(max_pages);
    q.pages.reserve(q.pages.size() + max_new);
    if (want_slots) {
      uint64_t want = want_slots;
      const uint32_t room = q.tail_room(pool_, pt);
      if (room && want) runs_.push_back({page_ptr(q.pages.back()), pt - room,
                                         uint32_t(std::min<uint64_t>(room, want)), 0});
      want -= std::min<uint64_t>(room, want);
      while (want > 0 && pool_.can_alloc(KVGC_CLASS_INT4, 1)) {
        const PageId p = take_page(s, layer, KVGC_CLASS_INT4);  // within arena and quota
        if (p == kNoPage) break;
        q.pages.push_back(p);
        const uint32_t n = uint32_t(std::min<uint64_t>(pt, want));
        runs_.push_back({page_ptr(p), 0, n, 0});
        want -= n;
      }
    }
    segment_pages(seg, &pages_);
    page_live_.assign(pages_.size(), 0);
    SelectResult r;
    SelectOp op{};
    op.layout[0] = layout_[0];
    op.layout[1] = layout_[1];
    op.pages = pages_.data();
    op.n_pages = uint32_t(pages_.size());
    op.tenure_before = g.tenure_before;
    op.candidates = g.candidates;
    op.key = g.key;
    op.noise = opts_.score_noise;
    op.seed = opts_.seed;
    op.segment_salt = (uint64_t(s.slot) << 20) ^ layer;
    op.epoch = ++gc_epoch_;
    op.reclaim = g.reclaim;
    op.int4_cost = policy_.int4_cost;
    op.demote_ratio = g.demote ? kDemoteRatio : -1.0;
    op.demote_dst = runs_.data();
    op.n_demote_dst = uint32_t(runs_.size());
    op.promote = g.promote;
    op.promote_age = kPromoteAge;
    op.retier = g.retier;
    op.retier_top = g.retier_top;
    op.age_intermediate = g.age_intermediate;
    op.page_live = page_live_.data();
    op.result = &r;
    op.scratch = scratch_;  // device executors (shared with attention: same stream)
    op.scratch_bytes = scratch_bytes_;
    auto give_back = [&] {  // nothing was decided: return the demotion pages
      for (size_t i = int4_before; i < q.pages.size(); ++i) drop_page(s.tenant, q.pages[i]);
      q.pages.resize(int4_before);
    };
    Status st;
    try {
      st = backend_->select(op, stream);
    } catch (...) {  // the op allocates before it mutates: nothing else changed
      give_back();
      throw;
    }
    if (!st.ok()) {
      give_back();
      return st;
    }
    // Apply the page-level results: live counts, then the int4 slots demotion filled.
    size_t i = 0;  // pages_ lists the FP16 table, then the INT4 table
    for (const PageTable& t : seg.table)
      for (PageId id : t.pages) pool_.desc(id).live = page_live_[i++];
    uint64_t filled = r.demoted;
    for (const AppendRun& run : runs_) {
      const uint32_t n = uint32_t(std::min<uint64_t>(run.count, filled));
      PageDesc& d = pool_.desc(pool_.page_at(reinterpret_cast<uintptr_t>(run.page)));
      d.used = uint16_t(d.used + n);
      q.used += n;
      filled -= n;
    }
    for (int c = 0; c < KVGC_CLASS_COUNT; ++c) seg.table[c].live = r.live[c];
    std::copy(std::begin(r.tier), std::end(r.tier), seg.tier);
    free_empty_pages(s.tenant, seg.table[KVGC_CLASS_FP16]);
    free_empty_pages(s.tenant, q);  // includes demotion pages nothing was written to

    ++counters_.gcs;
    counters_.tokens_ranked += r.ranked;
    counters_.tokens_evicted += r.evicted;
    counters_.tokens_demoted += r.demoted;
    counters_.tokens_promoted += r.promoted;
    counters_.tokens_tenured += r.tenured;
    counters_.bytes_moved += r.demoted * 2 * uint64_t(model_.n_kv_heads) * layout_[0].slot_stride;
    if (opts_.policy == KVGC_POLICY_GENERATIONAL) {
      seg.since_minor = 0;
      if (g.major) {
        ++counters_.major_gcs;
        seg.minors_since_major = 0;
        seg.promote_blocked = false;
      } else {
        ++counters_.minor_gcs;
        ++seg.minors_since_major;
        seg.promote_blocked = r.promote_eligible > 0;
      }
    }
    *short_of_budget = r.reclaimed + 1e-9 < g.reclaim;
  }
  // Compaction, per class, when the segment's holes pass the threshold.
  for (int c = 0; c < KVGC_CLASS_COUNT; ++c)
    if (seg.table[c].fragmentation(opts_.page_tokens) > opts_.compact_threshold)
      KVGC_TRY(compact(s.tenant, seg, c, stream));
  return Status::Ok();
}

Status ManagedHeap::compact(uint32_t tenant, Segment& seg, int cls, void* stream) {
  PageTable& t = seg.table[cls];
  host::vector<PageCounts> counts(t.pages.size());
  for (size_t i = 0; i < t.pages.size(); ++i)
    counts[i] = {pool_.desc(t.pages[i]).used, pool_.desc(t.pages[i]).live};
  const CompactionPlan plan = plan_compaction(counts, opts_.page_tokens);
  if (plan.moves.empty()) return Status::Ok();
  host::vector<CompactMove> moves(plan.moves.size());
  for (size_t i = 0; i < moves.size(); ++i)
    moves[i] = {page_ptr(t.pages[plan.moves[i].dst]), page_ptr(t.pages[plan.moves[i].src]),
                plan.moves[i].count};
  CompactOp op{layout_[cls], moves.data(), uint32_t(moves.size())};
  KVGC_TRY(backend_->compact(op, stream));
  for (size_t i = 0; i < t.pages.size(); ++i) pool_.desc(t.pages[i]).live = uint16_t(counts[i].live);
  free_empty_pages(tenant, t);
  ++counters_.compactions;
  counters_.slots_moved += plan.slots_moved;
  counters_.bytes_moved += plan.slots_moved *
                           (2 * uint64_t(model_.n_kv_heads) * layout_[cls].slot_stride +
                            (cls == KVGC_CLASS_INT4 ? 2 * uint64_t(model_.n_kv_heads) *
                                                          (model_.head_dim / layout_[cls].group) * 4
                                                    : 0));
  return Status::Ok();
}

}  // namespace kvgc
