#include "heap.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <unordered_set>

#include "model.hpp"
#include "options.hpp"

namespace kvgc {

Status ManagedHeap::create(const kvgc_model_desc& model, const kvgc_heap_options& opts_in,
                    std::unique_ptr<ManagedHeap>* out) {
  KVGC_TRY(model_validate(model, "model"));
  kvgc_heap_options opts = opts_in;
  std::string profile;  // KVGC_LAYER_BUDGET=entropy:FILE
  if (!(opts.flags & KVGC_OPT_IGNORE_ENV))
    KVGC_TRY(options_from_env(
        &opts, [](const char* name) -> const char* { return std::getenv(name); }, &profile));
  KVGC_TRY(options_validate(opts));
  // A pipeline rank's heap holds layers [first_layer, first_layer + n_layers) of the model.
  const uint32_t total = opts.total_layers ? opts.total_layers : model.n_layers;
  if (uint64_t(opts.first_layer) + model.n_layers > total)
    return fail(KVGC_EINVAL, "opts->first_layer " + std::to_string(opts.first_layer) + " + model->n_layers " +
                                 std::to_string(model.n_layers) + " exceeds opts->total_layers " +
                                 std::to_string(total));
  std::vector<float> weights;
  if (opts.layer_budget == KVGC_LAYER_BUDGET_ENTROPY) {  // one weight per global layer
    if (!profile.empty()) {
      KVGC_TRY(read_layer_profile(profile, total, "KVGC_LAYER_BUDGET", &weights));
    } else {
      if (!opts.layer_weights || opts.n_layer_weights != total)
        return fail(KVGC_EINVAL, "opts->layer_weights: KVGC_LAYER_BUDGET_ENTROPY needs one "
                                 "weight per layer of the model (" + std::to_string(total) + ")");
      weights.assign(opts.layer_weights, opts.layer_weights + total);
      for (float w : weights)
        if (!(w > 0) || !std::isfinite(w))
          return fail(KVGC_EINVAL, "opts->layer_weights: weights must be finite and > 0");
    }
  }
  opts.layer_weights = nullptr;  // copied below: the caller's array need not outlive create
  opts.n_layer_weights = 0;

  std::unique_ptr<ManagedHeap> h(new ManagedHeap());
  h->model_ = model;
  h->opts_ = opts;
  // 0.15: prune is retired into shrink (the same decisions; shrink re-stores the shared
  // pages every holder demoted). Without a rung below fp16 shrink is prune.
  if (h->opts_.prefix_charge == KVGC_PREFIX_CHARGE_PRUNE) h->opts_.prefix_charge = KVGC_PREFIX_CHARGE_SHRINK;
  h->layer_weights_.assign(weights.begin(), weights.end());
  h->first_layer_ = opts.first_layer;
  h->total_layers_ = h->opts_.total_layers = total;
  std::string why;
  KVGC_TRY(make_backend(opts.device, opts.cuda_device, opts.cpu_threads, &h->backend_, &why));
  h->opts_.device = h->backend_->kind();

  for (int c = 0; c < KVGC_CLASS_COUNT; ++c)
    h->layout_[c] = PageLayout::make(opts.page_tokens, model.n_kv_heads, model.head_dim,
                                     model.dtype, kvgc_storage_class(c));
  // Classes that save too little for this head_dim (scale words cost as much as the
  // bytes they save), or are dominated, stay off the ladder.
  uint64_t page_bytes[KVGC_CLASS_COUNT];
  for (int c = 0; c < KVGC_CLASS_COUNT; ++c) page_bytes[c] = h->layout_[c].bytes;
  std::string note;
  h->ladder_ = make_ladder(h->opts_.demote, page_bytes, &note);
  if (!note.empty() && h->opts_.verbose)
    std::fprintf(stderr, "kvgc: KVGC_DEMOTE=%s for head_dim %u: %s\n",
                 demote_name(h->opts_.demote), model.head_dim, note.c_str());

  // A slab must hold at least one page of every class (int4 pages are the smaller).
  // By default (0) a heap that demotes gets small slabs: kAutoSlabFp16Pages fp16 pages
  // rounded up to 64 KiB, then down to whole fp16 pages (no tail waste in that class:
  // 64 KiB steps alone wasted 11% of an arena of 64 KiB pages). Memory moves between
  // classes a whole slab at a time, and a slab goes back only when every page in it is
  // free; pages of many sequences share a slab, so the larger the slab the rarer that
  // is, and the ladder's cheaper classes then find no slab for the tokens the GC demotes
  // while the fp16 class holds many free pages (the GC evicts those tokens instead).
  // Measured on kvgc-bench-serve --shared-prefix (80 MiB, 12.3 KiB fp16 pages): demotions
  // that found no page 1,040 times with 2 MiB slabs, 909 with 512 KiB, 232 with 256 KiB,
  // 53 with 128 KiB (10 fp16 pages, as now); passkeys 13/24, 16/24, 21/24, 21/24. A heap
  // that never demotes keeps kFp16OnlySlab: there the same run's full cache with sharing
  // preempted more with small slabs (12 against 7) and held 4.08 sequences on average
  // against 5.09.
  constexpr size_t kAutoSlabFp16Pages = 8, kSlabStep = 64u << 10, kFp16OnlySlab = 2u << 20;
  const size_t fp16_page = h->layout_[KVGC_CLASS_FP16].bytes;
  const bool demotes = opts.policy != KVGC_POLICY_FULL && h->ladder_.n > 1;
  // KVGC_PREFIX_CHARGE=shrink: shared pages go to the ladder's first rung below FP16.
  if (h->opts_.prefix_charge == KVGC_PREFIX_CHARGE_SHRINK && demotes) h->shrink_class_ = h->ladder_.cls[1];
  const size_t stepped = (kAutoSlabFp16Pages * fp16_page + kSlabStep - 1) / kSlabStep * kSlabStep;
  const size_t auto_slab = demotes ? stepped / fp16_page * fp16_page : kFp16OnlySlab;
  const size_t slab = std::max<size_t>(opts.slab_bytes ? opts.slab_bytes : auto_slab, fp16_page);
  h->opts_.slab_bytes = uint32_t(slab);

  uint64_t budget = opts.budget_bytes;
  if (budget == 0) {
    uint64_t free_bytes = 0;
    KVGC_TRY(h->backend_->free_memory(&free_bytes));
    budget = uint64_t(double(free_bytes) * opts.budget_fraction);
  }
  const uint64_t arena = budget / slab * slab;
  if (arena == 0)
    return fail(KVGC_EINVAL, "KVGC_BUDGET / opts->budget_bytes: the budget (" +
                                 std::to_string(budget) + " bytes) is smaller than one slab (" +
                                 std::to_string(slab) + " bytes)");
  if (arena > SIZE_MAX) return fail(KVGC_EINVAL, "opts->budget_bytes exceeds the address space");
  KVGC_TRY(h->backend_->reserve(size_t(arena), &h->arena_));
  h->arena_bytes_ = size_t(arena);

  h->policy_.policy = h->opts_.policy;
  h->policy_.sinks = h->opts_.sinks;
  h->policy_.window = h->opts_.window;
  h->policy_.window_min = h->opts_.window_min;
  h->policy_.window_scales = h->opts_.byte_budget || h->opts_.byte_budget_fraction > 0;
  h->policy_.page_tokens = h->opts_.page_tokens;
  h->policy_.recent = h->opts_.recent_decay < 1.0;
  for (int c = 0; c < KVGC_CLASS_COUNT; ++c) h->policy_.unit_cost[c] = page_bytes[c];

  // Device executors keep their scratch in the arena's last slabs, sized for a segment
  // as long as the whole arena could hold, so neither attention nor the GC allocates.
  // One scratch serves both (the larger of the two): they are enqueued on the heap's
  // stream one after the other and never run concurrently. Attention needs room per
  // live token (fp16 pages bound the count); the GC's select per slot of the segment,
  // and with demotion a segment can hold as many slots as int4 pages fit.
  const uint32_t pt = h->opts_.page_tokens;
  const uint64_t max_tokens = uint64_t(h->arena_bytes_ / h->layout_[KVGC_CLASS_FP16].bytes) * pt;
  size_t smallest = h->layout_[KVGC_CLASS_FP16].bytes;
  for (uint32_t i = 1; i < h->ladder_.n; ++i) smallest = std::min(smallest, h->layout_[h->ladder_.cls[i]].bytes);
  const uint64_t max_slots = uint64_t(h->arena_bytes_ / smallest) * pt;
  const size_t scratch = std::max(
      h->backend_->attend_scratch_bytes(max_tokens, model, pt),
      h->opts_.policy == KVGC_POLICY_FULL ? size_t(0)  // never selects
                                          : h->backend_->gc_scratch_bytes(max_slots, model, pt));
  // Device backends also keep the batch plans' tables there (one plan at a time): every
  // page of the arena at most once, and per planned segment its runs and attention work.
  const uint64_t max_pages = max_slots / pt + 1;
  const size_t region = h->backend_->kind() == KVGC_DEVICE_CPU
                            ? 0
                            : batch_arrays_size(max_pages + uint64_t(kMaxBatch) * model.n_layers, max_pages,
                                                model.n_layers, kMaxBatch);
  const size_t tail = (scratch + region + slab - 1) / slab * slab;  // whole slabs
  if (tail + slab > h->arena_bytes_)
    return fail(KVGC_EINVAL, "KVGC_BUDGET / opts->budget_bytes: the budget (" +
                                 std::to_string(h->arena_bytes_) +
                                 " bytes) leaves no room for pages after the device scratch (" +
                                 std::to_string(tail) + " bytes)");
  h->scratch_ = static_cast<uint8_t*>(h->arena_) + (h->arena_bytes_ - tail);
  h->scratch_bytes_ = tail - region;  // what the executors may use
  if (region) {
    h->batch_region_ = static_cast<uint8_t*>(h->scratch_) + h->scratch_bytes_;
    h->batch_region_bytes_ = region;
  }

  PoolConfig cfg;
  cfg.base = reinterpret_cast<uintptr_t>(h->arena_);
  cfg.arena_bytes = h->arena_bytes_ - tail;
  cfg.slab_bytes = slab;
  for (int c = 0; c < KVGC_CLASS_COUNT; ++c) cfg.page_bytes[c] = h->layout_[c].bytes;
  // Header pages (shared.cpp): a page's bytes before its K/V, the same for every class
  // (a multiple of 128, so every header array stays aligned wherever a slab puts it).
  h->header_bytes_ = h->layout_[KVGC_CLASS_FP16].k_off;
  for (int c = 1; c < KVGC_CLASS_COUNT; ++c) KVGC_ASSERT(h->layout_[c].k_off == h->header_bytes_);
  cfg.page_bytes[kHeaderClass] = h->header_bytes_;
  std::string err;
  if (!h->pool_.init(cfg, &err))
    return fail(err.rfind("out of host memory", 0) == 0 ? KVGC_ENOMEM : KVGC_EINVAL,
                "heap geometry: " + err);

  if (h->opts_.verbose) {
    std::fprintf(stderr,
                 "kvgc %s: heap on %s\nkvgc: arena %zu bytes = %u slabs of %zu bytes; pages: "
                 "fp16 %zu bytes (%u/slab), int8 %zu bytes (%u/slab), int4 %zu bytes (%u/slab), "
                 "int2 %zu bytes (%u/slab); "
                 "model %u layers x %u kv heads x %u dims %s\n%s",
                 KVGC_VERSION_STRING, why.c_str(), h->arena_bytes_, h->pool_.arena().slabs(),
                 slab, h->layout_[0].bytes, h->pool_.pages_per_slab(0), h->layout_[2].bytes,
                 h->pool_.pages_per_slab(2), h->layout_[1].bytes, h->pool_.pages_per_slab(1),
                 h->layout_[3].bytes, h->pool_.pages_per_slab(3),
                 model.n_layers, model.n_kv_heads, model.head_dim,
                 dtype_name(model.dtype), options_describe(h->opts_).c_str());
  }
  *out = std::move(h);
  return Status::Ok();
}

ManagedHeap::~ManagedHeap() {
  for (auto& [id, s] : seqs_)
    for (Segment& seg : s.layers) free_pages(s.tenant, seg);
  for (auto& [id, e] : prefixes_) drop_prefix(e);
  if (backend_) {
    staging_.release(*backend_);
    for (void* e : spare_events_) backend_->event_destroy(e);
    pinned_.release(*backend_);
  }
  if (arena_) backend_->release(arena_);
}

Status ManagedHeap::find(kvgc_seq seq, uint32_t layer, const char* fn, SequenceState** out) {
  auto it = seqs_.find(seq);
  if (it == seqs_.end())
    return fail_fixed(KVGC_ENOTFOUND, "%s: seq %llu is not a live sequence of this heap", fn,
                      (unsigned long long)seq);
  if (layer >= model_.n_layers)
    return fail_fixed(KVGC_EINVAL, "%s: layer %u is out of range (model has %u layers)", fn, layer,
                      model_.n_layers);
  *out = &it->second;
  return Status::Ok();
}

Status ManagedHeap::seq_create(uint32_t tenant, kvgc_seq* out) {
  const uint32_t slot = free_slots_.empty() ? uint32_t(seq_slots_.size()) : free_slots_.back();
  // Segment ids (slot * layers + layer) must fit the allocator's 31-bit owner ids.
  if ((uint64_t(slot) + 1) * model_.n_layers > kSharedOwner)
    return fail(KVGC_ENOMEM, "kvgc_seq_create: too many live sequences");
  SequenceState s;
  s.id = next_seq_;
  s.tenant = tenant;
  s.slot = slot;
  s.layers.resize(model_.n_layers);
  s.mirror.resize(model_.n_layers);
  // Reserve every container before the first mutation: a bad_alloc here changes nothing.
  // free_slots_ can take back every slot there is, so that destroying a sequence never
  // allocates (an engine out of memory frees sequences to get memory back).
  if (free_slots_.empty()) {
    seq_slots_.reserve(seq_slots_.size() + 1);
    free_slots_.reserve(seq_slots_.size() + 1);
  }
  seqs_.reserve(seqs_.size() + 1);
  const kvgc_seq id = next_seq_;
  SequenceState* raw = &seqs_.emplace(id, std::move(s)).first->second;  // may throw: nothing changed yet
  for (Segment& seg : raw->layers) seg.owner = raw;
  ++next_seq_;
  if (free_slots_.empty()) seq_slots_.push_back(raw);
  else {
    free_slots_.pop_back();
    seq_slots_[slot] = raw;
  }
  *out = id;
  return Status::Ok();
}

PageId ManagedHeap::take_page(const SequenceState& s, uint32_t layer, int cls) {
  const size_t bytes = pool_.page_bytes(cls);
  if (tenant_room(s.tenant) < bytes) return kNoPage;
  const PageId p = pool_.alloc(cls, segment_id(s, layer));
  if (p == kNoPage) return kNoPage;
  if (auto it = tenants_.find(s.tenant); it != tenants_.end()) it->second.bytes += bytes;
  ++counters_.pages_allocated;
  return p;
}

void ManagedHeap::drop_page(uint32_t tenant, PageId id) {
  const int cls = pool_.class_of(id);
  if (auto it = tenants_.find(tenant); it != tenants_.end()) it->second.bytes -= pool_.page_bytes(cls);
  PageId shared = kNoPage;
  if (cls == kHeaderClass) {  // a holder lets go of a shared page
    const auto it = backing_.find(id);
    shared = it->second.page;
    if (it->second.cheap) --shared_.find(shared)->second.cheap;
    backing_.erase(it);
  }
  pool_.free(id);
  ++counters_.pages_freed;
  if (shared != kNoPage) {
    unref_shared(shared);
    // The holder that kept it from shrinking may have been this one.
    if (shrink_class_ >= 0)
      if (auto it = shared_.find(shared); it != shared_.end() && shrinkable(it->first, it->second)) ++shrink_ready_;
  }
}

uint64_t ManagedHeap::tenant_room(uint32_t tenant) const {
  const auto it = tenants_.find(tenant);
  if (it == tenants_.end() || it->second.limit == 0) return UINT64_MAX;
  return it->second.limit > it->second.bytes ? it->second.limit - it->second.bytes : 0;
}

Status ManagedHeap::tenant_set_limit(uint32_t tenant, uint64_t max_bytes) {
  KVGC_TRY(settle_all());  // pages pending GCs emptied are not the tenant's any more
  auto it = tenants_.find(tenant);
  if (it == tenants_.end()) {
    // Start counting now: the tenant's current pages are summed once, here.
    TenantState t;
    t.bytes = tenant_bytes_now(tenant);
    it = tenants_.emplace(tenant, t).first;
  }
  it->second.limit = max_bytes;
  return Status::Ok();
}

Status ManagedHeap::tenant_usage(uint32_t tenant, uint64_t* bytes, uint64_t* limit) {
  KVGC_TRY(settle_all());
  uint64_t used = 0, lim = 0;
  if (auto it = tenants_.find(tenant); it != tenants_.end()) {
    used = it->second.bytes;
    lim = it->second.limit;
  } else {
    used = tenant_bytes_now(tenant);
  }
  if (bytes) *bytes = used;
  if (limit) *limit = lim;
  return Status::Ok();
}

void ManagedHeap::free_pages(uint32_t tenant, Segment& s) {
  harvest_release(tenant, s);  // the device may still be writing these pages
  for (PageTable& t : s.table) {
    for (PageId p : t.pages) drop_page(tenant, p);
    t.pages.clear();
    t.pages.shrink_to_fit();
    t.live = t.used = 0;
  }
  s.pinned_pages = 0;
  s.pinned_live = 0;
  std::fill(std::begin(s.pinned_tier), std::end(s.pinned_tier), 0);
  std::fill(std::begin(s.shift), std::end(s.shift), 0);
  s.tail_epoch = UINT64_MAX;
}

uint64_t ManagedHeap::segment_pages(const Segment& s, host::vector<SegPage>* out,
                                    bool rows_by_used) const {
  out->clear();
  uint64_t row = 0;
  for (int c = 0; c < KVGC_CLASS_COUNT; ++c)
    for (PageId p : s.table[c].pages) {
      out->push_back({page_ptr(p), uint32_t(c), row, kv_of(p)});
      row += rows_by_used ? pool_.desc(p).used : pool_.desc(p).live;
    }
  return row;
}

const host::vector<SegPage>& ManagedHeap::attn_pages(Segment& s) {
  if (s.attn_epoch == s.epoch) return s.attn;
  s.attn.clear();
  uint64_t row = 0;
  for (int c : {int(KVGC_CLASS_INT2), int(KVGC_CLASS_INT4), int(KVGC_CLASS_INT8), int(KVGC_CLASS_FP16)})
    for (PageId p : s.table[c].pages) {
      s.attn.push_back({page_ptr(p), uint32_t(c), row, kv_of(p)});
      row += s.gc.active ? pool_.desc(p).used : pool_.desc(p).live;
    }
  s.attn_rows = row;
  s.attn_epoch = s.epoch;
  return s.attn;
}

Status ManagedHeap::seq_destroy(kvgc_seq seq) {
  SequenceState* s;
  KVGC_TRY(find(seq, 0, "kvgc_seq_destroy", &s));
  KVGC_ASSERT(free_slots_.capacity() > free_slots_.size());  // seq_create reserved it
  for (Segment& seg : s->layers) free_pages(s->tenant, seg);
  seq_slots_[s->slot] = nullptr;
  free_slots_.push_back(s->slot);
  seqs_.erase(seq);
  return Status::Ok();
}

Status ManagedHeap::append(kvgc_seq seq, uint32_t layer, const void* k, const void* v, uint32_t n,
                    void* stream) {
  SequenceState* s;
  KVGC_TRY(find(seq, layer, "kvgc_append", &s));
  if (n == 0) return Status::Ok();
  KVGC_TRY(backend_->check_pointer(k, "kvgc_append: k"));
  KVGC_TRY(backend_->check_pointer(v, "kvgc_append: v"));
  const uint32_t elem = dtype_bytes(model_.dtype);
  if (uintptr_t(k) % elem || uintptr_t(v) % elem)
    return fail(KVGC_EINVAL, "kvgc_append: k and v must be aligned to the dtype's " +
                                 std::to_string(elem) + " bytes");
  Segment& seg = s->layers[layer];
  seg.order_lent = false;  // the live count changes: a read before is stale
  PageTable& t = seg.table[KVGC_CLASS_FP16];  // new tokens are always stored fp16
  const uint32_t pt = opts_.page_tokens;
  if (seg.length + n > uint64_t(INT32_MAX))
    return fail(KVGC_EINVAL, "kvgc_append: n_tokens " + std::to_string(n) +
                                 " would take the segment past 2^31 positions");
  // A shared, partly filled tail is copied before the write (copy-on-write): one page more.
  uint64_t cow = tail_shared(t), need = t.pages_needed(pool_, pt, n) + cow;
  auto fits = [&] {
    return pool_.can_alloc(KVGC_CLASS_FP16, need) &&
           tenant_room(s->tenant) >= need * layout_[KVGC_CLASS_FP16].bytes;
  };
  if (!fits()) {  // pages pending GCs emptied come back, and this segment's holes
    KVGC_TRY(settle_all());
    KVGC_TRY(compact_fragmented(s->tenant, seg, stream));
    cow = tail_shared(t);
    need = t.pages_needed(pool_, pt, n) + cow;
    KVGC_TRY(evacuate(KVGC_CLASS_FP16, need, kNoSegment, stream));  // then other classes' sparse slabs
    while (!pool_.can_alloc(KVGC_CLASS_FP16, need) && evict_one_prefix()) {}  // then cached prefixes
  }
  if (!pool_.can_alloc(KVGC_CLASS_FP16, need)) {
    ++counters_.enomem;
    return fail(KVGC_ENOMEM, "kvgc_append: " + std::to_string(n) + " tokens need " +
                                 std::to_string(need) + " new pages" +
                                 (cow ? " (one copies the shared, partly filled last page)" : "") +
                                 "; the arena has room for " +
                                 std::to_string(pool_.counts(KVGC_CLASS_FP16).pages_free +
                                                uint64_t(pool_.arena().free_slabs()) *
                                                    pool_.pages_per_slab(KVGC_CLASS_FP16)));
  }
  if (tenant_room(s->tenant) < need * layout_[KVGC_CLASS_FP16].bytes)
    return fail(KVGC_EBUDGET, "kvgc_append: tenant " + std::to_string(s->tenant) +
                                  " would pass its quota of " +
                                  std::to_string(tenants_.find(s->tenant)->second.limit) +
                                  " bytes (" + std::to_string(need) + " new pages needed)");
  if (cow) {  // nothing below can run short of pages now
    KVGC_TRY(unshare_tail(*s, layer, KVGC_CLASS_FP16, stream));
    need -= 1;
  }
  // Reserve host containers first, so that nothing below can fail half-way on the host.
  t.pages.reserve(t.pages.size() + need);
  runs_.clear();
  runs_.reserve(need + 1);

  const size_t first_new = t.pages.size();
  const uint32_t tail_used = t.pages.empty() ? pt : pool_.desc(t.pages.back()).used;
  for (uint64_t i = 0; i < need; ++i) {
    const PageId p = take_page(*s, layer, KVGC_CLASS_FP16);
    if (p == kNoPage) {  // host descriptor growth failed: undo
      for (size_t j = first_new; j < t.pages.size(); ++j) drop_page(s->tenant, t.pages[j]);
      t.pages.resize(first_new);
      ++counters_.enomem;
      return fail(KVGC_ENOMEM, "kvgc_append: out of host memory for page descriptors");
    }
    t.pages.push_back(p);
  }
  // Runs: first the tail page's room, then each new page from slot 0.
  uint32_t src = 0;
  const size_t first_page = tail_used < pt ? first_new - 1 : first_new;
  for (size_t i = first_page; src < n; ++i) {
    const uint32_t used = i < first_new ? tail_used : 0;
    const uint32_t count = std::min(pt - used, n - src);
    runs_.push_back({page_ptr(t.pages[i]), used, count, src});
    src += count;
  }
  AppendOp op{layout_[KVGC_CLASS_FP16], k, v, int64_t(seg.length), opts_.sinks, runs_.data(),
              uint32_t(runs_.size())};
  Status st = backend_->append(op, stream);
  if (!st.ok()) {
    for (size_t j = first_new; j < t.pages.size(); ++j) drop_page(s->tenant, t.pages[j]);
    t.pages.resize(first_new);
    return st;
  }
  for (size_t r = 0; r < runs_.size(); ++r) {  // run r fills page first_page + r
    PageDesc& d = pool_.desc(t.pages[first_page + r]);
    d.used = uint16_t(d.used + runs_[r].count);
    d.live = uint16_t(d.live + runs_[r].count);
  }
  t.used += n;
  t.live += n;
  const uint64_t sinks = seg.length < opts_.sinks ? std::min<uint64_t>(opts_.sinks - seg.length, n) : 0;
  seg.tier[kGenSink] += sinks;
  seg.tier[kGenYoung] += n - sinks;
  seg.length += n;
  seg.since_minor = uint32_t(std::min<uint64_t>(uint64_t(seg.since_minor) + n, UINT32_MAX));
  touch(seg);
  counters_.appends += 1;
  counters_.tokens_appended += n;

  return Status::Ok();
}

Status ManagedHeap::tokens(kvgc_seq seq, uint32_t layer, uint64_t* live, uint64_t* length) {
  SequenceState* s;
  KVGC_TRY(find(seq, layer, "kvgc_seq_tokens", &s));
  KVGC_TRY(settle(s->tenant, s->layers[layer]));
  if (live) *live = s->layers[layer].live();
  if (length) *length = s->layers[layer].length;
  return Status::Ok();
}

Status ManagedHeap::read(kvgc_seq seq, uint32_t layer, void* k_out, void* v_out, int32_t* pos_out,
                  uint64_t capacity, uint64_t* n_out, void* stream) {
  SequenceState* s;
  KVGC_TRY(find(seq, layer, "kvgc_read", &s));
  KVGC_TRY(settle(s->tenant, s->layers[layer]));  // rows follow the exact live counts
  const Segment& seg = s->layers[layer];
  const uint32_t elem = dtype_bytes(model_.dtype);
  if (k_out) KVGC_TRY(backend_->check_pointer(k_out, "kvgc_read: k_out"));
  if (v_out) KVGC_TRY(backend_->check_pointer(v_out, "kvgc_read: v_out"));
  if (pos_out) KVGC_TRY(backend_->check_pointer(pos_out, "kvgc_read: pos_out"));
  if (uintptr_t(k_out) % elem || uintptr_t(v_out) % elem || uintptr_t(pos_out) % 4)
    return fail(KVGC_EINVAL, "kvgc_read: k_out/v_out must be aligned to " +
                                 std::to_string(elem) + " bytes and pos_out to 4");
  const uint64_t live = seg.live();
  *n_out = live;
  if ((k_out || v_out || pos_out) && capacity < live)
    return fail(KVGC_EINVAL, "kvgc_read: capacity " + std::to_string(capacity) +
                                 " is smaller than the segment's " + std::to_string(live) +
                                 " live tokens");
  if (!(k_out || v_out || pos_out) || live == 0) return Status::Ok();
  s->layers[layer].order_lent = true;
  segment_pages(seg, &pages_);
  GatherOp op{{}, pages_.data(), uint32_t(pages_.size()),
              k_out, v_out, pos_out};
  set_layouts(op.layout);
  return backend_->gather(op, stream);
}

Status ManagedHeap::read_scores(kvgc_seq seq, uint32_t layer, float* scores_out,
                                uint8_t* gen_out, uint64_t capacity, uint64_t* n_out,
                                void* stream) {
  SequenceState* s;
  KVGC_TRY(find(seq, layer, "kvgc_read_scores", &s));
  KVGC_TRY(settle(s->tenant, s->layers[layer]));
  if (scores_out) KVGC_TRY(backend_->check_pointer(scores_out, "kvgc_read_scores: scores_out"));
  if (gen_out) KVGC_TRY(backend_->check_pointer(gen_out, "kvgc_read_scores: gen_out"));
  if (uintptr_t(scores_out) % alignof(float))
    return fail(KVGC_EINVAL, "kvgc_read_scores: scores_out must be 4-byte aligned");
  const Segment& seg = s->layers[layer];
  const uint64_t live = seg.live();
  *n_out = live;
  if ((scores_out || gen_out) && capacity < live)
    return fail(KVGC_EINVAL, "kvgc_read_scores: capacity " + std::to_string(capacity) +
                                 " is smaller than the segment's " + std::to_string(live) +
                                 " live tokens");
  if (!(scores_out || gen_out) || live == 0) return Status::Ok();
  s->layers[layer].order_lent = true;
  segment_pages(seg, &pages_);
  GatherOp op{{}, pages_.data(), uint32_t(pages_.size()),
              nullptr, nullptr, nullptr, scores_out, gen_out};
  set_layouts(op.layout);
  return backend_->gather(op, stream);
}

Status ManagedHeap::read_classes(kvgc_seq seq, uint32_t layer, uint8_t* cls_out,
                                 uint64_t capacity, uint64_t* n_out, void* stream) {
  SequenceState* s;
  KVGC_TRY(find(seq, layer, "kvgc_read_classes", &s));
  KVGC_TRY(settle(s->tenant, s->layers[layer]));
  if (cls_out) KVGC_TRY(backend_->check_pointer(cls_out, "kvgc_read_classes: cls_out"));
  const Segment& seg = s->layers[layer];
  const uint64_t live = seg.live();
  *n_out = live;
  if (cls_out && capacity < live)
    return fail(KVGC_EINVAL, "kvgc_read_classes: capacity " + std::to_string(capacity) +
                                 " is smaller than the segment's " + std::to_string(live) +
                                 " live tokens");
  if (!cls_out || live == 0) return Status::Ok();
  s->layers[layer].order_lent = true;
  // Read order is class by class, so the host knows the answer from its own counts; a
  // token charged at another class than its page's (KVGC_PREFIX_CHARGE=prune) reads as
  // the class its ladder decided, from its gen byte (each page's header, read back).
  host::vector<uint8_t> cls;
  cls.reserve(live);
  const bool charged = std::any_of(std::begin(seg.shift), std::end(seg.shift), [](int64_t x) { return x != 0; });
  host::vector<uint8_t> header(charged ? header_bytes_ : 0);
  for (int c = 0; c < KVGC_CLASS_COUNT; ++c) {
    if (!charged) {
      cls.insert(cls.end(), seg.table[c].live, uint8_t(c));
      continue;
    }
    const PageLayout& L = layout_[c];
    for (PageId p : seg.table[c].pages) {
      KVGC_TRY(backend_->copy(header.data(), page_ptr(p), header_bytes_, CopyKind::DeviceToHost, stream));
      KVGC_TRY(backend_->synchronize(stream));
      const auto* bits = reinterpret_cast<const uint32_t*>(header.data() + L.live_off);
      for (uint32_t slot = 0; slot < opts_.page_tokens; ++slot)
        if (bits[slot / 32] >> (slot % 32) & 1u)
          cls.push_back(uint8_t(counted_class(header[L.gen_off + slot], uint32_t(c))));
    }
  }
  if (cls.size() != live) return fail(KVGC_EINTERNAL, "kvgc_read_classes: the pages' live bits disagree with the counts");
  KVGC_TRY(backend_->copy(cls_out, cls.data(), live, CopyKind::HostToDevice, stream));
  return backend_->synchronize(stream);  // the host buffer dies here
}

Status ManagedHeap::attend(kvgc_seq seq, uint32_t layer, const void* q, uint32_t n_q, void* out,
                           float scale, bool add_scores, void* stream) {
  SequenceState* s;
  KVGC_TRY(find(seq, layer, "kvgc_attend", &s));
  const Segment& seg = s->layers[layer];
  if (n_q == 0 || n_q > seg.length)
    return fail(KVGC_EINVAL, "kvgc_attend: n_q " + std::to_string(n_q) +
                                 " must be in 1..the segment's length " +
                                 std::to_string(seg.length) +
                                 " (append the queries' own K/V first)");
  KVGC_TRY(backend_->check_pointer(q, "kvgc_attend: q"));
  KVGC_TRY(backend_->check_pointer(out, "kvgc_attend: out"));
  const uint32_t elem = dtype_bytes(model_.dtype);
  if (uintptr_t(q) % elem || uintptr_t(out) % elem)
    return fail(KVGC_EINVAL, "kvgc_attend: q and out must be aligned to the dtype's " +
                                 std::to_string(elem) + " bytes");
  // Rows are internal to attention: with a GC pending, number them by upper bounds
  // rather than wait for its live counts (attn_pages does).
  const host::vector<SegPage>& list = attn_pages(s->layers[layer]);
  const uint64_t rows = seg.attn_rows;
  const SegPage* pages = list.data();
  if (backend_->kind() != KVGC_DEVICE_CPU) {  // the upload must not wait for pageable memory
    void* staged = nullptr;
    KVGC_TRY(staging_.take(*backend_, list.size() * sizeof(SegPage), &staged));
    std::copy(list.begin(), list.end(), static_cast<SegPage*>(staged));
    pages = static_cast<const SegPage*>(staged);
  }
  AttendOp op{{}, pages, uint32_t(list.size()), rows,
              q, n_q, model_.n_q_heads, int64_t(seg.length) - n_q, scale, out, add_scores,
              float(std::pow(opts_.recent_decay, double(n_q))), scratch_, scratch_bytes_};
  set_layouts(op.layout);
  KVGC_TRY(backend_->attend(op, stream));
  if (pages != list.data()) KVGC_TRY(staging_.enqueued(*backend_, stream));
  ++counters_.attends;
  return Status::Ok();
}

Status ManagedHeap::stats(kvgc_stats* o) {
  KVGC_TRY(settle_all());  // exact counts
  std::memset(o, 0, sizeof *o);
  o->struct_size = sizeof *o;
  o->version = KVGC_STATS_VERSION;
  o->device = backend_->kind();
  const Arena& a = pool_.arena();
  o->arena_bytes = arena_bytes_;
  o->slab_bytes = a.slab_bytes();
  o->slabs_total = a.slabs();
  o->slabs_free = a.free_slabs();
  o->free_bytes = uint64_t(a.free_slabs()) * a.slab_bytes();
  for (int c = 0; c < kNumClasses; ++c) {  // the storage classes, then header pages
    const ClassCounts& n = pool_.counts(c);
    kvgc_class_stats& cs = c == kHeaderClass      ? o->cls_header
                           : c == KVGC_CLASS_INT8 ? o->cls_int8
                           : c == KVGC_CLASS_INT2 ? o->cls_int2
                                                  : o->cls[c];
    cs.page_bytes = pool_.page_bytes(c);
    cs.slabs = n.slabs;
    cs.reserved_bytes = n.slabs * a.slab_bytes();
    cs.used_bytes = n.pages_used * cs.page_bytes;
    cs.free_bytes = cs.reserved_bytes - cs.used_bytes;
    cs.pages_used = n.pages_used;
    cs.pages_free = n.pages_free;
    o->free_bytes += cs.free_bytes;
  }
  o->sequences = seqs_.size();
  for (const auto& [id, s] : seqs_)
    for (const Segment& seg : s.layers) {
      o->segments += std::any_of(std::begin(seg.table), std::end(seg.table),
                                 [](const PageTable& t) { return !t.pages.empty(); });
      for (const PageTable& t : seg.table) {
        o->live_tokens += t.live;
        o->slots_held += t.held_slots(opts_.page_tokens);
        o->dead_slots += t.dead();
      }
      for (int g = 0; g < 4; ++g) o->tier_tokens[g] += seg.tier[g];
    }
  o->fragmentation = o->slots_held ? double(o->dead_slots) / double(o->slots_held) : 0.0;
  o->appends = counters_.appends;
  o->tokens_appended = counters_.tokens_appended;
  o->pages_allocated = counters_.pages_allocated;
  o->pages_freed = counters_.pages_freed;
  o->slabs_acquired = pool_.slabs_acquired();
  o->slabs_released = pool_.slabs_released();
  o->enomem = counters_.enomem;
  o->steps = counters_.steps;
  o->observes = counters_.observes;
  o->gcs = counters_.gcs;
  o->minor_gcs = counters_.minor_gcs;
  o->major_gcs = counters_.major_gcs;
  o->tokens_ranked = counters_.tokens_ranked;
  o->tokens_evicted = counters_.tokens_evicted;
  o->tokens_demoted = counters_.tokens_demoted;
  o->tokens_promoted = counters_.tokens_promoted;
  o->tokens_tenured = counters_.tokens_tenured;
  o->compactions = counters_.compactions;
  o->slots_moved = counters_.slots_moved;
  o->bytes_moved = counters_.bytes_moved;
  o->ebudget = counters_.ebudget;
  o->attends = counters_.attends;
  o->scratch_bytes = scratch_bytes_ + batch_region_bytes_;
  for (int c = 0; c < 3; ++c) o->tokens_demoted_to[c] = counters_.demoted_to[c];
  o->tokens_demoted_to_int2 = counters_.demoted_to[KVGC_CLASS_INT2];
  o->shared_pages = shared_.size();
  for (const auto& [p, sp] : shared_) {
    o->shared_bytes += pool_.page_bytes(pool_.class_of(p));
    o->shared_refs += sp.refs;
    if (sp.cached_only()) o->cached_only_bytes += pool_.page_bytes(pool_.class_of(p));
  }
  o->prefixes = prefixes_.size();
  for (const auto& [id, e] : prefixes_) o->prefixes_pinned += e.pinned;
  o->prefix_lookups = counters_.prefix_lookups;
  o->prefix_hits = counters_.prefix_hits;
  o->prefix_tokens_attached = counters_.prefix_tokens_attached;
  o->prefix_evictions = counters_.prefix_evictions;
  o->pages_shared = counters_.pages_shared;
  o->cow_copies = counters_.cow_copies;
  o->pages_migrated = counters_.pages_migrated;
  o->slabs_evacuated = counters_.slabs_evacuated;
  o->pages_shrunk = counters_.pages_shrunk;
  o->bytes_shrunk = counters_.bytes_shrunk;
  o->gcs_short_of_pages = counters_.gcs_short_of_pages;
  o->demote_slots_short = counters_.demote_slots_short;
  o->pages_unshared = counters_.pages_unshared;
  return Status::Ok();
}

}  // namespace kvgc
