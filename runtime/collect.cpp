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
  ObserveOp op{{}, pages_.data(), uint32_t(pages_.size()), mass,
               float(opts_.recent_decay)};
  set_layouts(op.layout);
  KVGC_TRY(backend_->observe(op, stream));
  seg.order_lent = false;  // the order lent was used
  ++counters_.observes;
  return Status::Ok();
}

host::vector<ManagedHeap::LayerBudget> ManagedHeap::layer_budgets(const SequenceState& s) {
  // Split over the whole model's layers (a pipeline rank holds a range of them), so that
  // every rank gives a layer the budget one heap over all layers would.
  const uint32_t n = total_layers_, local = uint32_t(s.layers.size()), first = first_layer_;
  host::vector<LayerBudget> out(local);
  // A fraction is of the whole length, pinned tokens included (what the sequence would
  // cost unshared), so that sharing never leaves a sequence fewer bytes for its own tokens.
  // (Own tokens at the rate the whole length's budget gives them lost the private keys
  // beside a whole prefix: docs/records/perf-2026-12-02-prefix-serve-first-run.md.)
  uint64_t length = 0;
  for (const Segment& seg : s.layers) length = std::max(length, seg.length);
  // A short sequence is never pruned (kvgc.h, min_length). A floor on the budget (never
  // fewer than N tokens' bytes) would have changed every long prompt at small fractions
  // too (2.5% of 4K is 102 tokens); a length threshold changes nothing from min_length
  // on. At min_length a sequence meets its budget at once, as a prompt's prefill does.
  if (length < opts_.min_length) return out;
  // The split keeps each layer at least its protected tokens (the young window the mean
  // budget gives) where the mean allows.
  auto split = [&](uint64_t mean) {
    const uint64_t floor = uint64_t(opts_.sinks) + young_window_of_tokens(policy_, mean);
    if (opts_.layer_budget == KVGC_LAYER_BUDGET_ENTROPY)
      return split_by_weights(layer_weights_.data(), n, mean, floor);
    return split_layer_budget(opts_.layer_budget, n, mean, floor);
  };
  const uint64_t fp16 = policy_.unit_cost[KVGC_CLASS_FP16];
  uint64_t tokens = kNoBudget;
  if (opts_.token_budget) tokens = opts_.token_budget;
  else if (opts_.token_budget_fraction > 0)
    tokens = uint64_t(std::ceil(opts_.token_budget_fraction * double(length)));
  if (tokens != kNoBudget) {
    const host::vector<uint64_t> per = split(tokens);
    for (uint32_t l = 0; l < local; ++l) out[l].units = per[first + l] * fp16;
  }
  uint64_t bytes = opts_.byte_budget;
  if (opts_.byte_budget_fraction > 0) {
    const double raw = double(model_.n_kv_heads) * model_.head_dim * 2 * dtype_bytes(model_.dtype);
    bytes = uint64_t(std::ceil(opts_.byte_budget_fraction * double(length) * raw));
  }
  if (bytes) {
    // Split as tokens are: in fp16 tokens' worth of bytes, each layer's share of the total.
    const uint32_t pt = opts_.page_tokens;
    const uint64_t mean = std::max<uint64_t>(1, uint64_t((unsigned __int128)bytes * pt / fp16));
    const host::vector<uint64_t> per = split(mean);
    for (uint32_t l = 0; l < local; ++l) {
      out[l].bytes = opts_.layer_budget == KVGC_LAYER_BUDGET_UNIFORM
                         ? bytes
                         : uint64_t((unsigned __int128)bytes * per[first + l] / mean);
      out[l].units = std::min(out[l].units, out[l].bytes * pt);
    }
  }
  return out;
}

Status ManagedHeap::step(kvgc_seq seq, void* stream) {
  // Every layer's GC is prepared, then launched together (gc_flush): the segment-by-
  // segment decisions, in one select_batch.
  // Shared pages every holder has demoted shrink first (shrink.cpp): nothing in flight
  // names a page here. Only for a live sequence: bad input changes nothing.
  // A step reorders the sequence's own pages anyway: what it lent ends here.
  if (auto it = seqs_.find(seq); it != seqs_.end()) {
    end_lent_orders(it->second);
    KVGC_TRY(shrink_shared(stream));
    KVGC_TRY(unshare_sole_holders(stream));
  }
  gc_reserve(model_.n_layers);  // before anything changes: the queue never grows midway
  Status st;
  try {
    st = step_prepare(seq, stream);
  } catch (...) {  // out of host memory: the layers prepared before still run
    gc_flush_after_throw(stream);
    throw;
  }
  KVGC_TRY(gc_flush(stream));
  return st;
}

void ManagedHeap::gc_reserve(size_t n) {
  const size_t want = gc_ops_.size() + n;
  if (gc_ops_.capacity() < want) gc_ops_.reserve(std::max(want, 2 * gc_ops_.capacity()));
  if (gc_prep_.capacity() < want) gc_prep_.reserve(std::max(want, 2 * gc_prep_.capacity()));
}

void ManagedHeap::drop_pages_after(uint32_t tenant, Segment& seg, const size_t before[]) {
  for (int c = 0; c < KVGC_CLASS_COUNT; ++c) {  // nothing was decided: the demotion pages
    PageTable& t = seg.table[c];
    for (size_t i = before[c]; i < t.pages.size(); ++i) drop_page(tenant, t.pages[i]);
    t.pages.resize(before[c]);
  }
}

void ManagedHeap::gc_flush_after_throw(void* stream) {
  try {
    (void)gc_flush(stream);
  } catch (...) {  // gc_flush left the queue empty and every segment consistent
  }
}

Status ManagedHeap::step_prepare(kvgc_seq seq, void* stream) {
  SequenceState* s;
  KVGC_TRY(find(seq, 0, "kvgc_step", &s));
  ++counters_.steps;
  if (opts_.policy == KVGC_POLICY_FULL) return Status::Ok();  // never evicts, never fragments
  const host::vector<LayerBudget> budgets = layer_budgets(*s);
  uint32_t short_layers = 0;
  for (uint32_t layer = 0; layer < model_.n_layers; ++layer) {
    bool short_of_budget = false;
    KVGC_TRY(gc_prepare(*s, layer, budgets[layer], stream, &short_of_budget));
    short_layers += short_of_budget;
  }
  if (short_layers) {
    counters_.ebudget += short_layers;
    return fail(KVGC_EBUDGET, "kvgc_step: " + std::to_string(short_layers) +
                                  " segment(s) of seq " + std::to_string(seq) +
                                  " stay over their budget: every remaining token is "
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

Status ManagedHeap::gc_prepare(SequenceState& s, uint32_t layer, const LayerBudget& budget,
                               void* stream, bool* short_of_budget) {
  Segment& seg = s.layers[layer];
  if (seg.gc.queued) KVGC_TRY(gc_flush(stream));  // its result block is in a queued op
  // settle and compaction touch the segment when they change it; the GC below, when it
  // runs. A step that changes nothing leaves its epoch (and a batch plan's mirror) be.
  KVGC_TRY(settle(s.tenant, seg));  // the previous GC's results, usually long complete
  KVGC_TRY(compact_fragmented(s.tenant, seg, stream));
  const uint32_t pt = opts_.page_tokens;
  SegmentView v;
  v.length = seg.length;
  uint64_t held = 0;  // bytes the segment's pages hold once compacted
  for (int c = 0; c < KVGC_CLASS_COUNT; ++c) {
    // Tokens the prefix cache pays for are not the GC's (KVGC_PREFIX_CHARGE=cache); shared
    // tokens demoted in place count at their charged class (=prune).
    v.live[c] = uint64_t(int64_t(seg.table[c].live) + seg.shift[c]) -
                (c == KVGC_CLASS_FP16 ? seg.pinned_live : 0);
    held += (v.live[c] + pt - 1) / pt * layout_[c].bytes;
  }
  for (int g = 0; g < 4; ++g) v.tier[g] = seg.tier[g] - seg.pinned_tier[g];
  v.since_minor = seg.since_minor;
  v.minors_since_major = seg.minors_since_major;
  v.promote_blocked = seg.promote_blocked;
  v.budget = budget.units;
  v.bytes_over = budget.bytes && held > budget.bytes;
  const GcPlan g = plan_gc(policy_, v);
  if (!g.run) return Status::Ok();
  touch(seg);
  seg.evictable_below = std::max<uint64_t>(seg.evictable_below, uint64_t(std::max<int64_t>(g.tenure_before, 0)));
  // Known before the op runs: once every candidate is gone, the protected tokens (sinks
  // and the young window, all fp16) are what is left.
  // (Less those the prefix cache pins: sinks, and window tokens still in the prefix.)
  uint64_t protect = protected_tokens(policy_, v);
  if (seg.pinned_live) {
    const uint64_t window = young_window(policy_, v.budget);
    const uint64_t start = std::max<uint64_t>(seg.length > window ? seg.length - window : 0, opts_.sinks);
    protect -= std::min<uint64_t>(protect, std::min<uint64_t>(seg.pinned_live, opts_.sinks) +
                                               (seg.pinned_live > start ? seg.pinned_live - start : 0));
  }
  *short_of_budget =
      (g.reclaim > 0 && budget.units != kNoBudget &&
       protect * policy_.unit_cost[KVGC_CLASS_FP16] > budget.units) ||
      (budget.bytes && (protect + pt - 1) / pt * layout_[KVGC_CLASS_FP16].bytes > budget.bytes);

  // Demotion targets, per class below FP16 on the ladder: the class's tail room, then as
  // many new pages as the decision could fill and the arena allows. A decision may move
  // every token of a dearer class into this one (the monotone rule moves tokens down with
  // the cheaper tokens that outrank them), but never more than the budget holds of this
  // class. The op zeroes every fresh page first (scrubbing: until the results are applied
  // they are in the segment's page tables, used or not); pages it does not use go back
  // when the results are applied. Fewer targets (a full arena, a quota) only
  // means more evictions: the decision stays monotone.
  runs_.clear();
  const bool reclaims = g.reclaim > 0 || v.bytes_over;
  size_t want_slots[KVGC_CLASS_COUNT] = {};
  // Tokens that could move into a class: those of dearer classes, less (=prune) those a
  // shared page holds, which are demoted in place.
  const bool in_place = charges_in_place();
  uint64_t movable[KVGC_CLASS_COUNT];
  for (int c = 0; c < KVGC_CLASS_COUNT; ++c) movable[c] = in_place ? private_live(seg.table[c]) : v.live[c];
  uint64_t dearer = movable[KVGC_CLASS_FP16];
  const uint64_t budget_units = budget.units != kNoBudget ? budget.units : budget.bytes * uint64_t(pt);
  for (uint32_t i = 1; reclaims && i < ladder_.n; ++i) {
    const int c = ladder_.cls[i];
    const uint64_t by_budget = budget_units / policy_.unit_cost[c] + 1;
    want_slots[c] = size_t(std::min(dearer, by_budget));
    dearer += movable[c];
  }
  // Every host container and the result block are sized before the first page is
  // taken, so running out of memory cannot strand a demotion page.
  size_t max_new = 0, held_pages = 0;
  for (int c = 0; c < KVGC_CLASS_COUNT; ++c) {
    max_new += (want_slots[c] + pt - 1) / pt;
    held_pages += seg.table[c].pages.size();
  }
  const size_t max_pages = held_pages + max_new;
  KVGC_TRY(harvest_reserve(seg.gc, max_pages));
  gc_reserve(1);  // the queue too (the steps reserve it for all their segments first)
  runs_.reserve(max_new + KVGC_CLASS_COUNT);
  pages_.reserve(max_pages);
  size_t before[KVGC_CLASS_COUNT];
  for (int c = 0; c < KVGC_CLASS_COUNT; ++c) {
    before[c] = seg.table[c].pages.size();
    seg.table[c].pages.reserve(before[c] + (want_slots[c] + pt - 1) / pt);
  }
  auto give_back = [&] { drop_pages_after(s.tenant, seg, before); };
  // Runs f; if it fails or throws (a select out of host memory), this segment's pages go
  // back too.
  auto or_give_back = [&](auto&& f) -> Status {
    Status st;
    try {
      st = f();
    } catch (...) {
      give_back();
      throw;
    }
    if (!st.ok()) give_back();
    return st;
  };
  uint32_t n_runs[KVGC_CLASS_COUNT] = {};
  bool settled = false, evacuated = false;
  uint64_t short_slots = 0;  // demotion slots wanted and not found: evictions instead
  for (int c = 0; c < KVGC_CLASS_COUNT; ++c) {  // runs_ holds the classes in order
    PageTable& t = seg.table[c];
    uint64_t want = want_slots[c];
    // A shared, partly filled tail (kvgc_seq_fork) is copied before demotion writes into
    // it; with no page for the copy, this class takes no demoted token this time (more
    // evictions instead: the decision stays monotone).
    if (want && tail_shared(t) && !unshare_tail(s, layer, c, stream).ok()) {
      short_slots += want;
      want = 0;
    }
    const size_t first_run = runs_.size();
    const uint32_t room = want ? t.tail_room(pool_, pt) : 0;
    if (room) runs_.push_back({page_ptr(t.pages.back()), pt - room, uint32_t(std::min<uint64_t>(room, want)), 0});
    want -= std::min<uint64_t>(room, want);
    while (want > 0) {
      PageId p = pool_.can_alloc(c, 1) ? take_page(s, layer, c) : kNoPage;
      if (p == kNoPage && !settled && (pending_ || !gc_ops_.empty())) {  // pages other GCs emptied come back first
        settled = true;
        // The queued GCs first: segment by segment, they would be pending by now.
        KVGC_TRY(or_give_back([&] {
          Status st = gc_flush(stream);
          return st.ok() ? settle_all() : st;
        }));
        continue;
      }
      if (p == kNoPage && !evacuated && !pool_.can_alloc(c, 1) && pending_ == 0 && gc_ops_.empty()) {
        evacuated = true;  // then other classes' sparse slabs (none holding this segment's pages)
        KVGC_TRY(or_give_back([&] { return evacuate(c, (want + pt - 1) / pt, segment_id(s, layer), stream); }));
        continue;
      }
      if (p == kNoPage && !pool_.can_alloc(c, 1) && evict_one_prefix()) continue;  // then cached prefixes
      if (p == kNoPage) {  // within arena and quota
        short_slots += want;
        break;
      }
      t.pages.push_back(p);
      const uint32_t k = uint32_t(std::min<uint64_t>(pt, want));
      runs_.push_back({page_ptr(p), 0, k, 0});
      want -= k;
    }
    n_runs[c] = uint32_t(runs_.size() - first_run);
  }
  if (short_slots) {  // the step still meets its budget, by evicting: kvgc_stats says so
    ++counters_.gcs_short_of_pages;
    counters_.demote_slots_short += short_slots;
  }
  PendingGc& pend = seg.gc;
  segment_pages(seg, &pages_);
  if (seg.pinned_pages) {  // the op never sees the pinned pages (the FP16 table's first)
    pages_.erase(pages_.begin(), pages_.begin() + seg.pinned_pages);
    for (SegPage& sp : pages_) sp.out_row -= seg.pinned_live;
  }
  std::copy(pages_.begin(), pages_.end(), pend.pages());  // pinned: the copy never waits
  std::copy(runs_.begin(), runs_.end(), pend.runs());
  std::copy(std::begin(n_runs), std::end(n_runs), pend.n_runs);
  SelectOp op{};
  for (int c = 0; c < KVGC_CLASS_COUNT; ++c) {
    op.layout[c] = layout_[c];
    op.unit_cost[c] = policy_.unit_cost[c];
    op.demote_dst[c] = pend.runs(c);
    op.n_demote_dst[c] = n_runs[c];
  }
  op.pages = pend.pages();
  op.n_pages = uint32_t(pages_.size());
  op.tenure_before = g.tenure_before;
  op.candidates = g.candidates;
  op.key = g.key;
  op.noise = opts_.score_noise;
  op.seed = opts_.seed;
  op.segment_salt = (uint64_t(s.slot) << 20) ^ (first_layer_ + layer);  // global: ranks agree
  op.epoch = ++seg.draws;  // per segment (salted by it): pipeline ranks draw alike
  op.reclaim = g.reclaim;
  op.budget_bytes = budget.bytes;
  op.n_ladder = ladder_.n;
  for (int i = 0; i < KVGC_CLASS_COUNT; ++i) {
    op.ladder[i] = ladder_.cls[i];
    op.slope[i] = ladder_.slope[i];
  }
  op.promote = g.promote;
  op.promote_age = kPromoteAge;
  op.retier = g.retier;
  op.retier_top = g.retier_top;
  op.age_intermediate = g.age_intermediate;
  op.charge_shared = in_place;
  op.page_live = pend.page_live();
  op.page_classes = pend.page_classes();
  op.result = pend.result();
  op.scratch = scratch_;  // device executors (shared with attention: same stream)
  op.scratch_bytes = scratch_bytes_;
  op.results_mapped = true;  // the result block is result_alloc memory
  PreparedGc q{&s, layer, g.major, {}};
  std::copy(std::begin(before), std::end(before), q.before);
  gc_prep_.push_back(q);
  gc_ops_.push_back(op);
  pend.queued = true;
  return Status::Ok();
}

Status ManagedHeap::gc_flush(void* stream) {
  const uint32_t n = uint32_t(gc_ops_.size());
  if (n == 0) return Status::Ok();
  auto give_back = [&](const PreparedGc& q) {
    Segment& seg = q.s->layers[q.layer];
    seg.gc.queued = false;
    drop_pages_after(q.s->tenant, seg, q.before);
  };
  // Pending until applied (harvest.cpp). The demotion slots count as used from now on,
  // so that attention's rows (numbered by `used`) cover whatever the op fills.
  auto issued = [&](const PreparedGc& q) {
    Segment& seg = q.s->layers[q.layer];
    PendingGc& pend = seg.gc;
    PageTable& f = seg.table[KVGC_CLASS_FP16];
    pend.queued = false;
    pend.active = true;
    ++pending_;
    pend.minor = opts_.policy == KVGC_POLICY_GENERATIONAL && !q.major;
    for (int c = 0; c < KVGC_CLASS_COUNT; ++c) pend.n_pages[c] = uint32_t(seg.table[c].pages.size());
    pend.n_pages[KVGC_CLASS_FP16] -= seg.pinned_pages;
    pend.tail_used = f.pages.empty() ? 0 : pool_.desc(f.pages.back()).used;
    pend.fp16_live = f.live;
    std::copy(std::begin(seg.tier), std::end(seg.tier), pend.tier);
    for (int c = 0; c < KVGC_CLASS_COUNT; ++c)
      for (uint32_t i = 0; i < pend.n_runs[c]; ++i) {
        const AppendRun& run = pend.runs(c)[i];
        PageDesc& d = pool_.desc(pool_.page_at(reinterpret_cast<uintptr_t>(run.page)));
        d.used = uint16_t(d.used + run.count);
        seg.table[c].used += run.count;
      }
    // The plan's own bookkeeping needs no result.
    if (opts_.policy == KVGC_POLICY_GENERATIONAL) {
      seg.since_minor = 0;
      if (q.major) {
        seg.minors_since_major = 0;
        seg.promote_blocked = false;
      } else {
        ++seg.minors_since_major;
      }
    }
  };
  // The queue is emptied on every way out (its capacity stays: no allocation per step).
  host::vector<PreparedGc>& prep = gc_prep_;
  struct Clear {
    ManagedHeap* h;
    ~Clear() {
      h->gc_prep_.clear();
      h->gc_ops_.clear();
    }
  } clear{this};
  uint32_t launched = 0;
  // Each launched segment becomes pending, the others get their pages back; then one
  // event per launched segment, recorded after the whole batch (each segment's results
  // are complete when the batch is; event records are not launches).
  auto settle_queue = [&]() -> Status {
    for (uint32_t i = 0; i < n; ++i) i < launched ? issued(prep[i]) : give_back(prep[i]);
    for (uint32_t i = 0; i < launched; ++i)
      if (!backend_->event_record(prep[i].s->layers[prep[i].layer].gc.event, stream).ok())
        return backend_->synchronize(stream);  // cannot mark it: wait for all
    return Status::Ok();
  };
  Status st;
  try {
    st = backend_->select_batch(gc_ops_.data(), n, stream, &launched);
  } catch (...) {  // each op allocates before it mutates: those not launched changed nothing
    (void)settle_queue();
    throw;
  }
  const Status ev = settle_queue();
  KVGC_TRY(st);
  KVGC_TRY(ev);
  if (opts_.harvest == KVGC_HARVEST_IMMEDIATE)
    for (const PreparedGc& q : prep) {
      Segment& seg = q.s->layers[q.layer];
      KVGC_TRY(settle(q.s->tenant, seg));
      KVGC_TRY(compact_fragmented(q.s->tenant, seg, stream));
    }
  return Status::Ok();
}

Status ManagedHeap::compact_fragmented(uint32_t tenant, Segment& seg, void* stream) {
  const uint32_t pt = opts_.page_tokens;
  // With a byte budget, a class compacts whenever that frees a page: the budget counts
  // the pages a segment keeps once compacted.
  const bool exact = opts_.byte_budget || opts_.byte_budget_fraction > 0;
  for (int c = 0; c < KVGC_CLASS_COUNT; ++c) {
    const PageTable& t = seg.table[c];
    if (t.fragmentation(pt) > opts_.compact_threshold ||
        (exact && t.pages.size() > (t.live + pt - 1) / pt))
      KVGC_TRY(compact(tenant, seg, c, stream));  // its private pages (shared ones stay)
  }
  return Status::Ok();
}

Status ManagedHeap::compact(uint32_t tenant, Segment& seg, int cls, void* stream) {
  PageTable& t = seg.table[cls];
  // The table's private pages only, in table order. A shared page is never moved from or
  // into: its slots are immutable, and moving this segment's live tokens out of it frees
  // no byte while another holder keeps it. (When every other holder has let go, it stays
  // a header page of this segment until freed: unsharing would copy a page to save a
  // header.)
  host::vector<uint32_t> own;
  own.reserve(t.pages.size());
  for (size_t i = 0; i < t.pages.size(); ++i)
    if (!is_header(t.pages[i])) own.push_back(uint32_t(i));
  host::vector<PageCounts> counts(own.size());
  for (size_t i = 0; i < own.size(); ++i)
    counts[i] = {pool_.desc(t.pages[own[i]]).used, pool_.desc(t.pages[own[i]]).live};
  const CompactionPlan plan = plan_compaction(counts, opts_.page_tokens);
  if (plan.moves.empty()) return Status::Ok();
  touch(seg);
  host::vector<CompactMove> moves(plan.moves.size());
  for (size_t i = 0; i < moves.size(); ++i)
    moves[i] = {page_ptr(t.pages[own[plan.moves[i].dst]]), page_ptr(t.pages[own[plan.moves[i].src]]),
                plan.moves[i].count};
  CompactOp op{layout_[cls], moves.data(), uint32_t(moves.size())};
  KVGC_TRY(backend_->compact(op, stream));
  for (size_t i = 0; i < own.size(); ++i) pool_.desc(t.pages[own[i]]).live = uint16_t(counts[i].live);
  free_empty_pages(tenant, t);
  ++counters_.compactions;
  counters_.slots_moved += plan.slots_moved;
  counters_.bytes_moved += plan.slots_moved * 2 * uint64_t(model_.n_kv_heads) *
                           (layout_[cls].slot_stride + 2 * layout_[cls].qwords);
  return Status::Ok();
}

}  // namespace kvgc
