// The GC's runtime side: kvgc_observe and kvgc_step. The host plans from page-granular
// counts (gc/), one data-plane op picks the tokens (kernels/), and the host applies the
// op's page-level results (harvest.cpp): frees empty pages, updates counts, compacts
// when fragmented. With KVGC_HARVEST=deferred (the default) the results are applied at
// the segment's next step, so a step only enqueues; immediate applies them at once.
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
  Segment& seg = s->layers[layer];
  KVGC_TRY(settle(s->tenant, seg));  // mass rows follow the exact live counts
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
  KVGC_TRY(settle(s.tenant, seg));  // the previous GC's results, usually long complete
  KVGC_TRY(compact_fragmented(s.tenant, seg, stream));
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
  if (!g.run) return Status::Ok();
  // Known before the op runs: once every candidate is gone, the protected tokens (sinks
  // and the young window, all fp16) are what is left.
  *short_of_budget = g.reclaim > 0 && double(protected_tokens(policy_, v)) > double(budget) + 1e-9;

  PageTable& f = seg.table[KVGC_CLASS_FP16];
  PageTable& q = seg.table[KVGC_CLASS_INT4];
  const uint32_t pt = opts_.page_tokens;
  // Demotion targets: the int4 tail's room, then as many new int4 pages as the reclaim
  // could use and the arena allows (fewer targets just means more evictions).
  runs_.clear();
  const size_t int4_before = q.pages.size();
  const double per = 1.0 - policy_.int4_cost;
  // Slots demotion could use: the reclaim over what one demotion saves (> 0.25 units).
  const double wanted = g.demote && g.reclaim > 0 && per > 0 ? std::ceil(g.reclaim / per) + 1 : 0;
  const uint64_t want_slots = wanted >= double(v.live_fp16) ? v.live_fp16 : uint64_t(wanted);
  // Every host container and the result block are sized before the first page is
  // taken, so running out of memory cannot strand a demotion page.
  const size_t max_new = (want_slots + pt - 1) / pt;
  const size_t max_pages = f.pages.size() + q.pages.size() + max_new;
  KVGC_TRY(harvest_reserve(seg.gc, max_pages));
  runs_.reserve(max_new + 1);
  pages_.reserve(max_pages);
  q.pages.reserve(q.pages.size() + max_new);
  auto give_back = [&] {  // nothing was decided: return the demotion pages
    for (size_t i = int4_before; i < q.pages.size(); ++i) drop_page(s.tenant, q.pages[i]);
    q.pages.resize(int4_before);
  };
  if (want_slots) {
    uint64_t want = want_slots;
    const uint32_t room = q.tail_room(pool_, pt);
    if (room && want) runs_.push_back({page_ptr(q.pages.back()), pt - room,
                                       uint32_t(std::min<uint64_t>(room, want)), 0});
    want -= std::min<uint64_t>(room, want);
    bool settled = false;
    while (want > 0) {
      PageId p = pool_.can_alloc(KVGC_CLASS_INT4, 1) ? take_page(s, layer, KVGC_CLASS_INT4) : kNoPage;
      if (p == kNoPage && !settled && pending_) {  // pages other GCs emptied come back first
        settled = true;
        if (Status st = settle_all(); !st.ok()) {
          give_back();
          return st;
        }
        continue;
      }
      if (p == kNoPage) break;  // within arena and quota
      q.pages.push_back(p);
      const uint32_t n = uint32_t(std::min<uint64_t>(pt, want));
      runs_.push_back({page_ptr(p), 0, n, 0});
      want -= n;
    }
  }
  PendingGc& pend = seg.gc;
  segment_pages(seg, &pages_);
  std::copy(pages_.begin(), pages_.end(), pend.pages());  // pinned: the copy never waits
  std::copy(runs_.begin(), runs_.end(), pend.runs());
  SelectOp op{};
  op.layout[0] = layout_[0];
  op.layout[1] = layout_[1];
  op.pages = pend.pages();
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
  op.demote_dst = pend.runs();
  op.n_demote_dst = uint32_t(runs_.size());
  op.promote = g.promote;
  op.promote_age = kPromoteAge;
  op.retier = g.retier;
  op.retier_top = g.retier_top;
  op.age_intermediate = g.age_intermediate;
  op.page_live = pend.page_live();
  op.result = pend.result();
  op.scratch = scratch_;  // device executors (shared with attention: same stream)
  op.scratch_bytes = scratch_bytes_;
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
  // Pending until applied (harvest.cpp). The demotion slots count as used from now on,
  // so that attention's rows (numbered by `used`) cover whatever the op fills.
  pend.active = true;
  ++pending_;
  pend.minor = opts_.policy == KVGC_POLICY_GENERATIONAL && !g.major;
  pend.n_pages[KVGC_CLASS_FP16] = uint32_t(f.pages.size());
  pend.n_pages[KVGC_CLASS_INT4] = uint32_t(q.pages.size());
  pend.n_runs = uint32_t(runs_.size());
  pend.tail_used = f.pages.empty() ? 0 : pool_.desc(f.pages.back()).used;
  pend.fp16_live = f.live;
  std::copy(std::begin(seg.tier), std::end(seg.tier), pend.tier);
  for (const AppendRun& run : runs_) {
    PageDesc& d = pool_.desc(pool_.page_at(reinterpret_cast<uintptr_t>(run.page)));
    d.used = uint16_t(d.used + run.count);
    q.used += run.count;
  }
  // The plan's own bookkeeping needs no result.
  if (opts_.policy == KVGC_POLICY_GENERATIONAL) {
    seg.since_minor = 0;
    if (g.major) {
      seg.minors_since_major = 0;
      seg.promote_blocked = false;
    } else {
      ++seg.minors_since_major;
    }
  }
  if (!backend_->event_record(pend.event, stream).ok())  // cannot mark it: wait for all
    KVGC_TRY(backend_->synchronize(stream));
  if (opts_.harvest == KVGC_HARVEST_IMMEDIATE) {
    KVGC_TRY(settle(s.tenant, seg));
    KVGC_TRY(compact_fragmented(s.tenant, seg, stream));
  }
  return Status::Ok();
}

Status ManagedHeap::compact_fragmented(uint32_t tenant, Segment& seg, void* stream) {
  for (int c = 0; c < KVGC_CLASS_COUNT; ++c)
    if (seg.table[c].fragmentation(opts_.page_tokens) > opts_.compact_threshold)
      KVGC_TRY(compact(tenant, seg, c, stream));
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
