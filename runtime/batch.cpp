// Batches: one engine step over many sequences (kvgc_batch_*; runtime/batch.hpp).
//
// plan    applies the batch's pending GC results, reserves every layer's pages for the
//         step's new tokens (all or nothing, in batch order, so the first sequence that
//         does not fit is the one to preempt), and writes each layer's op arrays once;
//         a device gets them in one upload.
// append  per layer: one AppendOp over every sequence's runs; the reserved pages join
//         the page tables and the host counts move exactly as kvgc_append moves them.
// attend  per layer: one AttendOp whose sequences are the batch's (kernels/ops.hpp).
// step    every sequence's kvgc_step, but those planned with KVGC_BATCH_SEQ_DEFER_STEP.
//
// kvgc_batch_plan_ex's scored rows travel in AttendSeq::score_from (the first row that
// scores) and the decay (recent_decay^scored rows); the executors split a sequence's
// queries there (kernels/ops.hpp).
//
// A plan is checked at every call: the batch must be the heap's planned one, and no
// planned segment may have changed since (heap.hpp: ManagedHeap::touch, through which
// every change outside the batch's own calls goes, marks the whole plan stale), so a
// stale plan fails at every layer instead of writing into pages that moved or leaving a
// sequence's layers uneven.
//
// Host cost (kvgc-bench-batch, docs/PERF.md): a sequence nothing else changed is planned
// from its mirror (PlanMirror), and a kvgc_step that runs no GC touches nothing, so under
// generational a mirror survives the steps between GCs. What is left: the op arrays
// (about 100 bytes a segment); after each GC, a walk that rebuilds every attention list
// (a list the GC's results update would avoid it); and on a device the copy of every
// page of the batch (24 + 9 bytes each) for the one upload (persistent device-side page
// lists updated by deltas would remove it).
#include "batch.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "heap.hpp"

namespace kvgc {
namespace {

struct ArrayOffsets {
  size_t runs, pages, aseqs, page_offset, page_indptr, q_indptr, q_pos0, page_class, kv_offset, total;
};

ArrayOffsets array_offsets(uint64_t n_runs, uint64_t n_pages, uint32_t L, uint32_t B) {
  ArrayOffsets o{};
  size_t at = 0;
  auto take = [&](uint64_t bytes) {
    const size_t r = at;
    at = align_up(at + size_t(bytes), 16);
    return r;
  };
  o.runs = take(n_runs * sizeof(AppendRun));
  o.pages = take(n_pages * sizeof(SegPage));
  o.aseqs = take(uint64_t(L) * B * sizeof(AttendSeq));
  o.page_offset = take(n_pages * sizeof(uint64_t));
  o.page_indptr = take(uint64_t(L) * (B + 1) * sizeof(uint32_t));
  o.q_indptr = take(uint64_t(B + 1) * sizeof(uint32_t));
  o.q_pos0 = take(uint64_t(L) * B * sizeof(int32_t));
  o.page_class = take(n_pages);
  o.kv_offset = take(n_pages * sizeof(uint64_t));
  o.total = at;
  return o;
}

BatchPlan::Arrays arrays_at(uint8_t* base, const ArrayOffsets& o) {
  BatchPlan::Arrays a;
  a.runs = reinterpret_cast<AppendRun*>(base + o.runs);
  a.pages = reinterpret_cast<SegPage*>(base + o.pages);
  a.aseqs = reinterpret_cast<AttendSeq*>(base + o.aseqs);
  a.page_offset = reinterpret_cast<uint64_t*>(base + o.page_offset);
  a.page_indptr = reinterpret_cast<uint32_t*>(base + o.page_indptr);
  a.q_indptr = reinterpret_cast<uint32_t*>(base + o.q_indptr);
  a.q_pos0 = reinterpret_cast<int32_t*>(base + o.q_pos0);
  a.page_class = base + o.page_class;
  a.kv_offset = reinterpret_cast<uint64_t*>(base + o.kv_offset);
  return a;
}

// Room for k more elements, growing geometrically (vector::reserve is exact, so reserving
// a page at a time would copy the whole list at every page a segment takes).
template <class V>
void reserve_more(V& v, size_t k) {
  if (v.size() + k > v.capacity()) v.reserve(std::max(v.size() + k, 2 * v.capacity()));
}

}  // namespace

size_t batch_arrays_size(uint64_t n_runs, uint64_t n_pages, uint32_t n_layers, uint32_t n_seqs) {
  return array_offsets(n_runs, n_pages, n_layers, n_seqs).total;
}

Status ManagedHeap::batch_arrays(BatchPlan& b, size_t n_runs, size_t n_pages) {
  const uint32_t L = model_.n_layers, B = uint32_t(b.seqs.size());
  const ArrayOffsets o = array_offsets(n_runs, n_pages, L, B);
  if (b.upload_pending) {  // the last plan's upload reads the block: long done, usually
    KVGC_TRY(backend_->event_wait(b.upload_event));
    b.upload_pending = false;
  }
  if (o.total > b.block_bytes) {
    const size_t want = std::max(o.total, b.block_bytes + b.block_bytes / 2);
    void* p = nullptr;
    KVGC_TRY(backend_->result_alloc(want, &p));
    backend_->result_free(b.block, b.block_bytes);
    b.block = static_cast<uint8_t*>(p);
    b.block_bytes = want;
  }
  if (batch_region_ && o.total > batch_region_bytes_)  // sized for the largest plan
    return fail(KVGC_EINTERNAL, "kvgc_batch_plan: the plan's tables (" + std::to_string(o.total) +
                                    " bytes) exceed the heap's batch region");
  b.host = arrays_at(b.block, o);
  b.dev = batch_region_ ? arrays_at(batch_region_, o) : b.host;
  return Status::Ok();
}

void ManagedHeap::batch_release(BatchPlan& b) {
  if (!b.planned) return;
  const uint32_t L = model_.n_layers, B = uint32_t(b.seqs.size());
  for (uint32_t l = 0; l < L; ++l) {
    if (b.appended[l]) continue;
    for (uint32_t i = 0; i < B; ++i)
      for (uint32_t r = b.res_off[l * B + i]; r < b.res_off[l * B + i + 1]; ++r)
        drop_page(b.seqs[i].tenant, b.reserved[r]);
  }
  b.reserved.clear();
  b.planned = false;
  if (planned_ == &b) planned_ = nullptr;
}

void ManagedHeap::batch_destroy(BatchPlan& b) {
  batch_release(b);
  if (b.upload_pending) (void)backend_->event_wait(b.upload_event);
  if (b.upload_event) backend_->event_destroy(b.upload_event);
  backend_->result_free(b.block, b.block_bytes);
  b.block = nullptr;
  b.block_bytes = 0;
}

size_t ManagedHeap::batch_reserved_pages() const {
  if (!planned_) return 0;
  const BatchPlan& b = *planned_;
  const uint32_t L = model_.n_layers, B = uint32_t(b.seqs.size());
  size_t n = 0;
  for (uint32_t l = 0; l < L; ++l)
    if (!b.appended[l]) n += b.res_off[(l + 1) * B] - b.res_off[l * B];
  return n;
}

uint64_t ManagedHeap::batch_reserved_bytes(uint32_t tenant) const {
  if (!planned_) return 0;
  const BatchPlan& b = *planned_;
  const uint32_t L = model_.n_layers, B = uint32_t(b.seqs.size());
  uint64_t pages = 0;
  for (uint32_t l = 0; l < L; ++l)
    for (uint32_t i = 0; i < B && !b.appended[l]; ++i)
      if (b.seqs[i].tenant == tenant) pages += b.res_off[l * B + i + 1] - b.res_off[l * B + i];
  return pages * layout_[KVGC_CLASS_FP16].bytes;
}

Status ManagedHeap::batch_live(BatchPlan& b, uint32_t layer, const char* fn) {
  if (!b.planned)
    return fail(KVGC_EINVAL, std::string(fn) + ": the batch has no plan (kvgc_batch_plan first; "
                                               "kvgc_batch_step spends it)");
  if (layer >= model_.n_layers)
    return fail(KVGC_EINVAL, std::string(fn) + ": layer " + std::to_string(layer) +
                                 " is out of range (model has " + std::to_string(model_.n_layers) +
                                 " layers)");
  // The plan is stale as a whole: a change to any planned segment (touch) or a destroyed
  // sequence fails every call, whichever layer it names, so that no layer of a sequence
  // can take the step's rows while another cannot. The per-layer epochs and the
  // sequences' slots are checked too (O(B)); on a failure the walk over every layer only
  // names the sequence.
  const uint32_t B = uint32_t(b.seqs.size()), L = model_.n_layers;
  auto alive = [&](const BatchPlan::Entry& e) {
    return e.slot < seq_slots_.size() && seq_slots_[e.slot] == e.s && e.s->id == e.id;
  };
  for (uint32_t i = 0; i < B && !b.stale; ++i)
    if (!alive(b.seqs[i]) || b.seqs[i].s->layers[layer].epoch != b.epoch[size_t(layer) * B + i])
      b.stale = true;
  if (b.stale) {
    for (uint32_t i = 0; i < B; ++i) {
      const BatchPlan::Entry& e = b.seqs[i];
      const bool live = alive(e);
      uint32_t changed = L;
      for (uint32_t l = 0; live && l < L && changed == L; ++l)
        if (e.s->layers[l].epoch != b.epoch[size_t(l) * B + i]) changed = l;
      if (live && changed == L) continue;
      return fail(KVGC_EINVAL, std::string(fn) + ": the plan is stale: seq " + std::to_string(e.id) +
                                   (live ? " changed at layer " + std::to_string(changed) : " was destroyed") +
                                   " since kvgc_batch_plan, so no layer of the plan runs (plan again)");
    }
    return fail(KVGC_EINVAL, std::string(fn) + ": the plan is stale: a planned sequence changed since "
                                               "kvgc_batch_plan, so no layer of the plan runs (plan again)");
  }
  return Status::Ok();
}

Status ManagedHeap::batch_plan(BatchPlan& b, const kvgc_seq* seqs, const uint32_t* n_new, uint32_t n,
                               const uint32_t* scored, const uint32_t* flags, uint32_t* failed,
                               void* stream) {
  const char* fn = scored || flags ? "kvgc_batch_plan_ex" : "kvgc_batch_plan";
  auto at = [&](uint32_t i) {
    if (failed) *failed = i;
  };
  if (n > kMaxBatch)
    return fail(KVGC_EINVAL, std::string(fn) + ": n_seqs " + std::to_string(n) +
                                 " exceeds the most one plan takes (" + std::to_string(kMaxBatch) + ")");
  if (n && (!seqs || !n_new))
    return fail(KVGC_EINVAL, std::string(fn) + ": seqs and n_new must not be NULL when n_seqs > 0");
  for (uint32_t i = 0; flags && i < n; ++i)  // before anything changes
    if (flags[i] & ~KVGC_BATCH_SEQ_DEFER_STEP) {
      at(i);
      return fail(KVGC_EINVAL, std::string(fn) + ": opts->seq_flags[" + std::to_string(i) + "] = " +
                                   std::to_string(flags[i]) + " has unknown bits");
    }
  // The previous plans are spent: this batch's, and the heap's other planned batch.
  batch_release(b);
  if (planned_) batch_release(*planned_);
  const uint64_t serial = ++plan_serial_;
  b.serial = serial;
  b.stale = false;
  const uint32_t L = model_.n_layers, pt = opts_.page_tokens;
  b.seqs.clear();
  b.seqs.reserve(n);
  uint64_t rows = 0;
  for (uint32_t i = 0; i < n; ++i) {
    auto it = seqs_.find(seqs[i]);
    if (it == seqs_.end()) {
      at(i);
      return fail(KVGC_ENOTFOUND, std::string(fn) + ": seqs[" + std::to_string(i) + "] = " +
                                      std::to_string(seqs[i]) + " is not a live sequence of this heap");
    }
    SequenceState& s = it->second;
    if (s.batch_mark == serial) {
      at(i);
      return fail(KVGC_EINVAL, std::string(fn) + ": seqs[" + std::to_string(i) + "] = " +
                                   std::to_string(seqs[i]) + " appears twice in the batch");
    }
    s.batch_mark = serial;
    b.seqs.push_back({&s, seqs[i], n_new[i], uint32_t(rows), s.slot, s.tenant,
                      scored ? std::min(scored[i], n_new[i]) : n_new[i],
                      flags && (flags[i] & KVGC_BATCH_SEQ_DEFER_STEP)});
    rows += n_new[i];
    if (rows > uint64_t(INT32_MAX)) {
      at(i);
      return fail(KVGC_EINVAL, std::string(fn) + ": the batch's rows (sum of n_new) pass 2^31");
    }
  }
  // Shared pages every holder has demoted shrink here (shrink.cpp), where nothing in
  // flight names a page: the previous plan is spent and no GC is queued.
  KVGC_TRY(shrink_shared(stream));
  KVGC_TRY(unshare_sole_holders(stream));
  // One walk over the batch (below): apply the previous step's GC results, count the
  // pages each segment needs, make its attention list current, and note what the layout
  // below needs, so that nothing after it reads a segment.
  const bool device = batch_region_ != nullptr;
  const size_t LB = size_t(L) * n;
  b.cnt_new.resize(LB);
  b.cnt_pages.resize(LB);
  b.tail_room.resize(LB);
  b.length.resize(LB);
  b.rows.resize(LB);
  b.tail.resize(LB);
  b.epoch.resize(LB);
  b.decay.resize(n);
  b.res_off.resize(LB + 1);
  b.run_start.resize(LB);
  b.run_off.resize(L + 1);
  b.page_off.resize(L + 1);
  host::vector<uint64_t>& need = b.need;  // kept across steps: no allocation per plan
  need.resize(n);
  uint64_t new_pages = 0, n_pages = 0, cows = 0;
  // A sequence whose mirror is current (nothing but batch appends changed it since a plan
  // last walked it: a decode loop's usual case) is planned from its mirror, a few
  // contiguous lines; any other is walked segment by segment first, which settles its
  // pending GCs, makes its tail cache and attention lists current, and writes its mirror.
  // Then the plan's counts are written layer-major, in the order they are laid out (the
  // batch's mirrors, a few hundred KB at B = 256, stay in the cache between layers).
  auto walk = [&]() -> Status {
    new_pages = n_pages = cows = 0;
    for (uint32_t i = 0; i < n; ++i) {
      const BatchPlan::Entry& e = b.seqs[i];
      SequenceState& s = *e.s;
      if (s.mirror_changes != s.changes) {
        // Segments are far apart and cold in a decode loop: the lines of the segment
        // kPrefetchAhead places on are asked for early, so that misses overlap.
        constexpr uint32_t kPrefetchAhead = 4;
        for (uint32_t l = 0; l < L; ++l) {
          if (l + kPrefetchAhead < L) {
            __builtin_prefetch(&s.layers[l + kPrefetchAhead], 1);
            __builtin_prefetch(reinterpret_cast<const char*>(&s.layers[l + kPrefetchAhead]) + 64, 1);
          }
          Segment& seg = s.layers[l];
          // (A failure below may leave earlier segments settled, which applies decided
          // results and changes nothing visible.)
          if (seg.gc.active) KVGC_TRY(settle(s.tenant, seg));  // usually long complete
          const Tail t = fp16_tail(seg);
          const uint32_t pages = uint32_t(attn_pages(seg).size());  // makes attn_rows current
          s.mirror[l] = mirror_of(seg, t, pages);
        }
        s.mirror_changes = s.changes;
      }
      for (uint32_t l = 0; l < L; ++l)
        if (uint64_t(s.mirror[l].length) + e.n_new > uint64_t(INT32_MAX)) {
          at(i);
          return fail(KVGC_EINVAL, std::string(fn) + ": n_new[" + std::to_string(i) + "] = " +
                                       std::to_string(e.n_new) + " would take seq " +
                                       std::to_string(e.id) + " past 2^31 positions");
        }
      need[i] = 0;
    }
    uint32_t nr = 0, nres = 0;
    for (uint32_t l = 0; l < L; ++l) {
      b.run_off[l] = nr;
      b.page_off[l] = uint32_t(n_pages);
      for (uint32_t i = 0; i < n; ++i) {
        const BatchPlan::Entry& e = b.seqs[i];
        const PlanMirror& m = e.s->mirror[l];
        const size_t x = size_t(l) * n + i;
        if (e.n_new && m.tail_header && m.tail_used < pt) {  // Tail::shared: copied before the
          ++need[i];                                         // append writes (copy-on-write)
          ++cows;
        }
        const uint32_t room = m.tail ? pt - m.tail_used : 0;  // Tail::room
        b.cnt_new[x] = uint32_t(PageTable::pages_for(e.n_new, room, pt));
        b.tail_room[x] = e.n_new ? room : 0;
        b.tail[x] = b.tail_room[x] ? m.tail : nullptr;
        if (b.cnt_new[x]) reserve_more(e.s->layers[l].attn, b.cnt_new[x]);  // appends extend it
        b.cnt_pages[x] = m.pages + b.cnt_new[x];
        b.length[x] = m.length;
        b.rows[x] = m.rows;
        b.epoch[x] = m.epoch;
        need[i] += b.cnt_new[x];
        n_pages += b.cnt_pages[x];
        // Where its runs and reserved pages go (the arrays are layer-major).
        b.res_off[x] = nres;
        b.run_start[x] = nr;
        nres += b.cnt_new[x];
        nr += (b.tail_room[x] ? 1 : 0) + b.cnt_new[x];
      }
    }
    b.res_off[LB] = nres;
    b.run_off[L] = nr;
    b.page_off[L] = uint32_t(n_pages);
    for (uint32_t i = 0; i < n; ++i) new_pages += need[i];
    return Status::Ok();
  };
  KVGC_TRY(walk());

  // All or nothing, in batch order: the first sequence whose pages do not fit.
  const uint64_t page_bytes = layout_[KVGC_CLASS_FP16].bytes;
  host::vector<std::pair<uint32_t, uint64_t>>& tenant_need = b.tenant_need;  // few tenants: linear search
  auto first_misfit = [&](kvgc_status* why) -> uint32_t {
    tenant_need.clear();
    uint64_t total = 0;
    for (uint32_t i = 0; i < n; ++i) {
      const BatchPlan::Entry& e = b.seqs[i];
      total += need[i];
      if (!pool_.can_alloc(KVGC_CLASS_FP16, total)) {
        *why = KVGC_ENOMEM;
        return i;
      }
      if (need[i] && tenant_room(e.tenant) != UINT64_MAX) {
        auto t = std::find_if(tenant_need.begin(), tenant_need.end(),
                              [&](const auto& x) { return x.first == e.tenant; });
        if (t == tenant_need.end()) t = tenant_need.insert(tenant_need.end(), {e.tenant, 0});
        t->second += need[i] * page_bytes;
        if (t->second > tenant_room(e.tenant)) {
          *why = KVGC_EBUDGET;
          return i;
        }
      }
    }
    return n;
  };
  kvgc_status why = KVGC_OK;
  uint32_t misfit = first_misfit(&why);
  if (misfit < n) {  // pages other GCs emptied come back, and the batch's holes
    KVGC_TRY(settle_all());
    for (BatchPlan::Entry& e : b.seqs)
      for (Segment& seg : e.s->layers) KVGC_TRY(compact_fragmented(e.tenant, seg, stream));
    KVGC_TRY(walk());
    misfit = first_misfit(&why);
    if (misfit < n && why == KVGC_ENOMEM) {  // then other classes' sparse slabs (evacuate.cpp)
      uint64_t total = 0;
      for (uint32_t i = 0; i < n; ++i) total += need[i];
      const uint64_t moved = counters_.pages_migrated;
      KVGC_TRY(evacuate(KVGC_CLASS_FP16, total, kNoSegment, stream));
      if (counters_.pages_migrated != moved) {  // pages moved: tails and lists are stale
        KVGC_TRY(walk());
        misfit = first_misfit(&why);
      }
    }
    while (misfit < n && why == KVGC_ENOMEM && evict_one_prefix()) misfit = first_misfit(&why);
  }
  if (misfit < n) {
    at(misfit);
    const BatchPlan::Entry& e = b.seqs[misfit];
    if (why == KVGC_ENOMEM) {
      ++counters_.enomem;
      return fail(KVGC_ENOMEM, std::string(fn) + ": seqs[" + std::to_string(misfit) + "] = " +
                                   std::to_string(e.id) + " does not fit: its " +
                                   std::to_string(e.n_new) + " new tokens need " +
                                   std::to_string(need[misfit]) +
                                   " new pages beyond the sequences before it");
    }
    return fail(KVGC_EBUDGET, std::string(fn) + ": seqs[" + std::to_string(misfit) + "] = " +
                                  std::to_string(e.id) + " would take tenant " +
                                  std::to_string(e.tenant) + " past its quota");
  }

  if (cows) {  // every page fits: copy the shared tails the appends will write, then count again
    for (uint32_t i = 0; i < n; ++i)
      for (uint32_t l = 0; l < L; ++l)
        if (b.seqs[i].n_new) KVGC_TRY(unshare_tail(*b.seqs[i].s, l, KVGC_CLASS_FP16, stream));
    KVGC_TRY(walk());
  }
  // Every host container before the first page is taken (the walk placed each entry).
  const uint64_t n_runs = b.run_off[L];
  KVGC_TRY(batch_arrays(b, size_t(n_runs), size_t(n_pages)));
  b.appended.assign(L, 0);
  b.exported.assign(L, device ? 1 : 0);  // the device's arrays are written here; the CPU's on demand
  b.reserved.clear();
  b.reserved.resize(new_pages);
  const BatchPlan::Arrays& A = b.host;

  // Gives back the pages reserved so far (entries in sequence order, up to `upto`).
  size_t taken = 0;
  auto drop_reserved = [&] {
    for (uint32_t i = 0; i < n && taken; ++i)
      for (uint32_t l = 0; l < L && taken; ++l) {
        const size_t x = size_t(l) * n + i;
        for (uint32_t r = b.res_off[x]; r < b.res_off[x] + b.cnt_new[x] && taken; ++r, --taken)
          drop_page(b.seqs[i].tenant, b.reserved[r]);
      }
    b.reserved.clear();
  };
  for (uint32_t i = 0; i < n && new_pages; ++i)
    for (uint32_t l = 0; l < L; ++l) {
      const size_t x = size_t(l) * n + i;
      for (uint32_t j = 0; j < b.cnt_new[x]; ++j) {
        const PageId p = take_page(*b.seqs[i].s, l, KVGC_CLASS_FP16);
        if (p == kNoPage) {  // host descriptor growth failed: undo
          drop_reserved();
          ++counters_.enomem;
          return fail(KVGC_ENOMEM, std::string(fn) + ": out of host memory for page descriptors");
        }
        b.reserved[b.res_off[x] + j] = p;
        ++taken;
      }
    }

  // Each (layer, sequence): runs (the tail's room, then each reserved page from slot 0),
  // the attention work, positions; on a device also its pages in attention order with the
  // new tokens counted, and the export.
  // Layer-major, as the arrays are: on the CPU this touches no segment, and every array
  // is read and written in order.
  for (uint32_t i = 0; i < n; ++i)  // as kvgc_attend of the scoring rows (^0 = 1: unscored)
    b.decay[i] = float(std::pow(opts_.recent_decay, double(b.seqs[i].scored)));
  for (uint32_t l = 0; l < L; ++l) {
    uint32_t first_page = 0;  // within the layer
    A.page_indptr[l * (n + 1)] = 0;
    for (uint32_t i = 0; i < n; ++i) {
      const BatchPlan::Entry& e = b.seqs[i];
      const float seq_decay = b.decay[i];
      const size_t x = size_t(l) * n + i;
      A.aseqs[x].first_page = first_page;
      first_page += b.cnt_pages[x];
      A.page_indptr[l * (n + 1) + i + 1] = first_page;
      const int32_t delta = int32_t(int64_t(b.length[x]) - int64_t(e.row0));
      const uint32_t in_tail = std::min(b.tail_room[x], e.n_new);
      uint32_t r = b.run_start[x];
      if (in_tail) A.runs[r++] = {b.tail[x], pt - b.tail_room[x], in_tail, e.row0, delta};
      uint32_t src = in_tail;
      uint32_t at = b.page_off[l] + A.aseqs[x].first_page;
      if (device) {  // the segment's attention list as it stands, then the new pages
        for (const SegPage& sp : e.s->layers[l].attn) export_page(A, at++, sp);
      }
      uint64_t row = b.rows[x] + in_tail;
      for (uint32_t j = 0; j < b.cnt_new[x]; ++j) {
        const uint32_t count = std::min(pt, e.n_new - src);
        uint8_t* ptr = page_ptr(b.reserved[b.res_off[x] + j]);
        A.runs[r++] = {ptr, 0, count, e.row0 + src, delta};
        if (device) export_page(A, at++, {ptr, KVGC_CLASS_FP16, row});
        row += count;
        src += count;
      }
      AttendSeq& a = A.aseqs[x];
      a.n_pages = b.cnt_pages[x];
      a.n_live = row;
      a.q_row = e.row0;
      a.n_q = e.n_new;
      a.q_pos0 = int64_t(b.length[x]);
      a.recent_decay = seq_decay;
      a.score_from = e.n_new - e.scored;
      a.host_pages = nullptr;  // set at append, when the segment's own list holds them
      A.q_pos0[x] = int32_t(b.length[x]);
    }
  }
  for (uint32_t i = 0; i < n; ++i) A.q_indptr[i] = b.seqs[i].row0;
  A.q_indptr[n] = uint32_t(rows);

  if (batch_region_) {  // one upload of every layer's tables
    const size_t bytes = array_offsets(n_runs, n_pages, L, n).total;
    if (!b.upload_event) KVGC_TRY(backend_->event_create(&b.upload_event));
    Status st = backend_->copy(batch_region_, b.block, bytes, CopyKind::HostToDevice, stream);
    if (st.ok()) st = backend_->event_record(b.upload_event, stream);
    if (!st.ok()) {
      drop_reserved();
      return st;
    }
    b.upload_pending = true;
  }
  b.planned = true;
  b.stale = false;  // the plan's own settling and compaction came before its epochs
  b.n_rows = uint32_t(rows);
  planned_ = &b;
  return Status::Ok();
}

Status ManagedHeap::batch_append(BatchPlan& b, uint32_t layer, const void* k, const void* v,
                                 void* stream) {
  const char* fn = "kvgc_batch_append";
  KVGC_TRY(batch_live(b, layer, fn));
  if (b.appended[layer])
    return fail(KVGC_EINVAL, std::string(fn) + ": layer " + std::to_string(layer) +
                                 " was already appended in this plan");
  const uint32_t B = uint32_t(b.seqs.size()), pt = opts_.page_tokens;
  if (b.n_rows) {
    KVGC_TRY(backend_->check_pointer(k, "kvgc_batch_append: k"));
    KVGC_TRY(backend_->check_pointer(v, "kvgc_batch_append: v"));
    const uint32_t elem = dtype_bytes(model_.dtype);
    if (uintptr_t(k) % elem || uintptr_t(v) % elem)
      return fail(KVGC_EINVAL, std::string(fn) + ": k and v must be aligned to the dtype's " +
                                   std::to_string(elem) + " bytes");
  }
  for (uint32_t i = 0; i < B; ++i) {  // may throw: nothing changed yet
    Segment& seg = b.seqs[i].s->layers[layer];
    const uint32_t k = b.cnt_new[size_t(layer) * B + i];
    reserve_more(seg.table[KVGC_CLASS_FP16].pages, k);
    reserve_more(seg.attn, k);
  }
  const uint32_t r0 = b.run_off[layer], r1 = b.run_off[layer + 1];
  if (r1 > r0) {
    AppendOp op{layout_[KVGC_CLASS_FP16], k, v, 0, opts_.sinks, b.host.runs + r0, r1 - r0,
                batch_region_ ? b.dev.runs + r0 : nullptr};
    KVGC_TRY(backend_->append(op, stream));
  }
  // The host counts, as kvgc_append keeps them.
  for (uint32_t i = 0; i < B; ++i) {
    const BatchPlan::Entry& e = b.seqs[i];
    Segment& seg = e.s->layers[layer];
    AttendSeq& a = b.host.aseqs[size_t(layer) * B + i];
    if (!e.n_new) {
      a.host_pages = attn_pages(seg).data();
      continue;
    }
    PageTable& f = seg.table[KVGC_CLASS_FP16];
    const bool list_valid = seg.attn_epoch == seg.epoch;  // the plan made it so
    // The plan's tail (its cache, made valid by the walk, is still: nothing touched it).
    const Tail t = fp16_tail(seg);
    uint32_t left = e.n_new;
    if (const uint32_t room = b.tail_room[size_t(layer) * B + i]; room) {
      const uint32_t c = std::min(room, left);
      PageDesc& d = pool_.desc(t.page);
      d.used = uint16_t(d.used + c);
      d.live = uint16_t(d.live + c);
      seg.tail_used = d.used;
      left -= c;
    }
    uint64_t row = seg.attn_rows + (e.n_new - left);  // the tail's new rows are its own
    for (uint32_t r = b.res_off[layer * B + i]; r < b.res_off[layer * B + i + 1]; ++r) {
      const uint32_t c = std::min(pt, left);
      PageDesc& d = pool_.desc(b.reserved[r]);
      d.used = uint16_t(c);
      d.live = uint16_t(c);
      f.pages.push_back(b.reserved[r]);
      if (list_valid) seg.attn.push_back({page_ptr(b.reserved[r]), KVGC_CLASS_FP16, row});  // reserved: no throw
      row += c;
      left -= c;
    }
    seg.attn_rows = row;
    if (f.pages.size() > seg.tail_count) {  // the cache follows: the last reserved page
      seg.tail_count = uint32_t(f.pages.size());
      seg.tail_page = f.pages.back();
      seg.tail_used = pool_.desc(seg.tail_page).used;
      seg.tail_header = false;
    }
    a.host_pages = attn_pages(seg).data();  // extended in place, or rebuilt if it was stale
    f.used += e.n_new;
    f.live += e.n_new;
    const uint64_t sinks =
        seg.length < opts_.sinks ? std::min<uint64_t>(opts_.sinks - seg.length, e.n_new) : 0;
    seg.tier[kGenSink] += sinks;
    seg.tier[kGenYoung] += e.n_new - sinks;
    seg.length += e.n_new;
    seg.since_minor = uint32_t(std::min<uint64_t>(uint64_t(seg.since_minor) + e.n_new, UINT32_MAX));
    if (e.s->mirror_changes == e.s->changes)  // the plan's mirror follows, as the tail cache does
      e.s->mirror[layer] = mirror_of(seg, fp16_tail(seg), uint32_t(seg.attn.size()));
    counters_.appends += 1;
    counters_.tokens_appended += e.n_new;
  }
  b.appended[layer] = 1;
  return Status::Ok();
}

Status ManagedHeap::batch_attend(BatchPlan& b, uint32_t layer, const void* q, void* out, float scale,
                                 bool add_scores, float* mass_out, void* stream) {
  const char* fn = "kvgc_batch_attend";
  KVGC_TRY(batch_live(b, layer, fn));
  if (!b.appended[layer])
    return fail(KVGC_EINVAL, std::string(fn) + ": layer " + std::to_string(layer) +
                                 " has not been appended in this plan (kvgc_batch_append first)");
  const uint32_t p0 = b.page_off[layer], n_pages = b.page_off[layer + 1] - p0;
  if (mass_out && add_scores && n_pages) {  // the kernels add into it: zeroed first
    KVGC_TRY(backend_->check_pointer(mass_out, "kvgc_batch_attend: params->mass_out"));
    if (uintptr_t(mass_out) % alignof(float))
      return fail(KVGC_EINVAL, std::string(fn) + ": params->mass_out must be 4-byte aligned");
    KVGC_TRY(backend_->fill(mass_out, 0, size_t(n_pages) * opts_.page_tokens * sizeof(float), stream));
  }
  if (b.n_rows == 0) return Status::Ok();
  KVGC_TRY(backend_->check_pointer(q, "kvgc_batch_attend: q"));
  KVGC_TRY(backend_->check_pointer(out, "kvgc_batch_attend: out"));
  const uint32_t elem = dtype_bytes(model_.dtype);
  if (uintptr_t(q) % elem || uintptr_t(out) % elem)
    return fail(KVGC_EINVAL, std::string(fn) + ": q and out must be aligned to the dtype's " +
                                 std::to_string(elem) + " bytes");

  const uint32_t B = uint32_t(b.seqs.size());
  AttendOp op{{}, b.host.pages + p0, n_pages, 0,
              q, 0, model_.n_q_heads, 0, scale, out, add_scores, 1.0f, scratch_, scratch_bytes_};
  set_layouts(op.layout);
  op.seqs = b.host.aseqs + size_t(layer) * B;
  op.n_seqs = B;
  op.mass_out = add_scores ? mass_out : nullptr;
  if (batch_region_) {
    op.dev_pages = b.dev.pages + p0;
    op.dev_seqs = b.dev.aseqs + size_t(layer) * B;
  }
  KVGC_TRY(backend_->attend(op, stream));
  for (const BatchPlan::Entry& e : b.seqs) counters_.attends += e.n_new > 0;
  return Status::Ok();
}

// The layer's contiguous page arrays (pages with rows, offsets, classes): a device's were
// written at plan (they were uploaded); the CPU's only here, for export and observe,
// from each segment's attention list (which holds the new pages once appended).
void ManagedHeap::export_page(const BatchPlan::Arrays& A, uint32_t at, const SegPage& sp) const {
  A.pages[at] = sp;
  A.page_offset[at] = uint64_t(sp.page - static_cast<uint8_t*>(arena_));
  A.kv_offset[at] = sp.kv ? uint64_t(sp.kv - static_cast<uint8_t*>(arena_)) : A.page_offset[at];
  A.page_class[at] = uint8_t(sp.cls);
}

void ManagedHeap::batch_materialize(BatchPlan& b, uint32_t layer) {
  if (b.exported[layer]) return;
  const uint32_t B = uint32_t(b.seqs.size());
  const BatchPlan::Arrays& A = b.host;
  for (uint32_t i = 0; i < B; ++i) {
    const size_t x = size_t(layer) * B + i;
    uint32_t at = b.page_off[layer] + A.aseqs[x].first_page;
    for (const SegPage& sp : attn_pages(b.seqs[i].s->layers[layer])) export_page(A, at++, sp);
  }
  b.exported[layer] = 1;
}

Status ManagedHeap::batch_observe(BatchPlan& b, uint32_t layer, const float* mass, void* stream) {
  const char* fn = "kvgc_batch_observe";
  KVGC_TRY(batch_live(b, layer, fn));
  if (!b.appended[layer])
    return fail(KVGC_EINVAL, std::string(fn) + ": layer " + std::to_string(layer) +
                                 " has not been appended in this plan (kvgc_batch_append first)");
  const uint32_t p0 = b.page_off[layer], n_pages = b.page_off[layer + 1] - p0;
  if (n_pages == 0) return Status::Ok();
  KVGC_TRY(backend_->check_pointer(mass, "kvgc_batch_observe: mass"));
  batch_materialize(b, layer);  // the order the export showed
  if (uintptr_t(mass) % alignof(float))
    return fail(KVGC_EINVAL, std::string(fn) + ": mass must be 4-byte aligned");
  ObserveOp op{{}, b.host.pages + p0, n_pages, mass,
               float(opts_.recent_decay)};
  set_layouts(op.layout);
  op.by_slot = true;
  if (batch_region_) op.dev_pages = b.dev.pages + p0;
  KVGC_TRY(backend_->observe(op, stream));
  counters_.observes += b.seqs.size();
  return Status::Ok();
}

Status ManagedHeap::batch_export(BatchPlan& b, uint32_t layer, kvgc_batch_view* v) {
  KVGC_TRY(batch_live(b, layer, "kvgc_batch_export"));
  if (!b.appended[layer])  // reserved pages hold nothing readable before their append
    return fail(KVGC_EINVAL, "kvgc_batch_export: layer " + std::to_string(layer) +
                                 " has not been appended in this plan (kvgc_batch_append first)");
  batch_materialize(b, layer);
  const uint32_t B = uint32_t(b.seqs.size()), p0 = b.page_off[layer];
  v->n_seqs = B;
  v->n_pages = b.page_off[layer + 1] - p0;
  v->n_rows = b.n_rows;
  v->page_tokens = opts_.page_tokens;
  v->arena_base = arena_;
  v->page_indptr = b.dev.page_indptr + size_t(layer) * (B + 1);
  v->page_offset = b.dev.page_offset + p0;
  v->page_class = b.dev.page_class + p0;
  if (v->struct_size >= offsetof(kvgc_batch_view, kv_offset) + sizeof v->kv_offset) {
    v->kv_offset = b.dev.kv_offset + p0;
  } else {  // a 0.6 caller reads K/V at page_offset: it must not meet a shared page
    for (uint32_t p = p0; p < b.page_off[layer + 1]; ++p)
      if (b.host.pages[p].kv)
        return fail(KVGC_EUNSUPPORTED, "kvgc_batch_export: out->struct_size " + std::to_string(v->struct_size) +
                                           " predates kv_offset, and this layer's pages include shared ones "
                                           "(whose K/V is at kv_offset): build against kvgc.h 0.7");
  }
  v->q_indptr = b.dev.q_indptr;
  v->q_pos0 = b.dev.q_pos0 + size_t(layer) * B;
  return Status::Ok();
}

Status ManagedHeap::batch_step(BatchPlan& b, void* stream) {
  KVGC_TRY(batch_live(b, 0, "kvgc_batch_step"));
  batch_release(b);  // pages of layers never appended go back; the plan is spent
  // Every sequence's GC is prepared (kvgc_step's, segment by segment), then the
  // collecting segments of the whole batch are launched at once (gc_flush: one
  // select_batch, a constant number of launches on CUDA whatever B is).
  gc_reserve(b.seqs.size() * model_.n_layers);  // before anything changes
  uint32_t short_seqs = 0;
  Status first_short;
  try {
    for (const BatchPlan::Entry& e : b.seqs) {
      end_lent_orders(*e.s);  // the plan appended to it: a read before is stale (as kvgc_step)
      if (e.defer_step) continue;  // its GC waits for a later step (kvgc_batch_plan_ex)
      Status st = step_prepare(e.id, stream);
      if (st.code == KVGC_EBUDGET) {
        if (!short_seqs++) first_short = st;  // (a copy: may throw too)
        continue;
      }
      if (!st.ok()) {  // those prepared before it still run, as they did one by one
        (void)gc_flush(stream);
        return st;
      }
    }
  } catch (...) {  // out of host memory: those prepared before still run
    gc_flush_after_throw(stream);
    throw;
  }
  KVGC_TRY(gc_flush(stream));
  if (short_seqs)
    return fail(KVGC_EBUDGET, "kvgc_batch_step: " + std::to_string(short_seqs) +
                                  " sequence(s) stay over budget; the first: " + std::string(first_short.text()));
  return Status::Ok();
}

void ManagedHeap::page_layout(int cls, kvgc_page_layout* o) const {
  const PageLayout& L = layout_[cls];
  o->version = KVGC_PAGE_LAYOUT_VERSION;
  o->cls = kvgc_storage_class(cls);
  o->dtype = model_.dtype;
  o->page_tokens = L.page_tokens;
  o->n_kv_heads = L.n_kv_heads;
  o->head_dim = L.head_dim;
  o->group = L.group;
  o->qwords = L.qwords;
  o->page_bytes = L.bytes;
  o->live_offset = L.live_off;
  o->pos_offset = L.pos_off;
  o->score_offset = L.score_off;
  o->recent_offset = L.recent_off;
  o->gen_offset = L.gen_off;
  o->k_offset = L.k_off;
  o->v_offset = L.v_off;
  o->kq_offset = L.kq_off;
  o->vq_offset = L.vq_off;
  o->head_stride = L.head_stride;
  o->slot_stride = L.slot_stride;
}

}  // namespace kvgc
