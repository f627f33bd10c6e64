// The heap: one model's KV memory on one device. Owns the backend, the arena, the
// page pool and the sequences; implements the C API's verbs under one lock.
//
// Host owns pages, device owns tokens: the page tables and per-page counts below are
// host structures; slot metadata (live bits, positions, scores, generations) lives in
// the pages themselves, in device memory, written only by data-plane ops.
#pragma once

#include <algorithm>
#include <memory>
#include <mutex>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "../allocator/page_table.hpp"
#include "../gc/ladder.hpp"
#include "../gc/plan.hpp"
#include "../kernels/page_layout.hpp"
#include "backend.hpp"
#include "batch.hpp"
#include "pinned_pool.hpp"
#include "staging_ring.hpp"

namespace kvgc {

// A GC the device has run (or will) whose page-level results the host has not applied
// yet (harvest.cpp). Until they are: the pages it emptied stay held, the counts below
// stay what they were plus later appends, and attention numbers its rows by upper
// bounds (`used`), which is all the decode path needs.
struct PendingGc {
  bool active = false;
  bool minor = false;           // a generational minor GC: promote_blocked comes from the result
  uint32_t n_pages[KVGC_CLASS_COUNT] = {};  // pages per class at issue (incl. demotion targets)
  uint32_t n_runs[KVGC_CLASS_COUNT] = {};   // demotion runs per class (their slots are
                                                   // reserved in `used`), stored class by class
  uint16_t tail_used = 0;       // the FP16 tail's used at issue: later appends add live slots
  uint64_t fp16_live = 0;       // the FP16 table's live count at issue
  uint64_t tier[4] = {0, 0, 0, 0};  // tiers at issue
  // result_alloc() memory, one block: the device writes the SelectResult and page_live;
  // the op's page list and demotion runs are read from here too, so their copies to
  // the device never wait for pageable memory.
  uint8_t* buf = nullptr;  // (page_classes follow page_live: shrink.cpp reads them)
  size_t buf_bytes = 0;
  uint32_t capacity = 0;        // pages (and runs) the block holds
  void* event = nullptr;        // marks the op's completion (null on the CPU)
  bool event_made = false;
  bool queued = false;          // its op is in ManagedHeap::gc_ops_, not launched yet

  SelectResult* result() const;
  uint16_t* page_live() const;
  uint8_t* page_classes() const;
  SegPage* pages() const;
  AppendRun* runs() const;  // every class's runs, class 0's first
  AppendRun* runs(int cls) const {
    AppendRun* r = runs();
    for (int c = 0; c < cls; ++c) r += n_runs[c];
    return r;
  }
};

// One (sequence, layer): its pages per storage class (read order: FP16, INT4, INT8, INT2), and
// the host's page-granular view the GC plans from.
// What a batch plan reads of every segment comes first, in the first two cache lines of
// an aligned 128-byte pair (the pending GC's flag last): at B x L segments a decode
// step's plan is bound by the lines it misses a segment (issue 22, the host cost).
struct SequenceState;

struct alignas(128) Segment {
  // Bumped by every change to the segment's pages or their counts outside a batch's own
  // calls (append, a GC, its harvest, compaction), through ManagedHeap::touch: a batch
  // plan made before is stale.
  uint64_t epoch = 0;
  SequenceState* owner = nullptr;  // touch: the sequence's change count and plan mark
  uint64_t length = 0;     // tokens appended: the next position
  // The FP16 tail as the last plan or batch append saw it (tail_count: the table's pages
  // then), valid while tail_epoch == epoch (ManagedHeap::fp16_tail). A plan reads
  // it instead of the table's page list and the page's descriptor: once a decode step's
  // appends have evicted them from the cache, those two loads were most of a plan's time
  // a segment. The walker checks it whenever it claims to be valid: a change to the FP16
  // table that bypassed touch() would show there.
  uint64_t tail_epoch = UINT64_MAX;
  uint32_t tail_count = 0;
  PageId tail_page = kNoPage;
  uint16_t tail_used = 0;    // the tail page's used slots
  bool tail_header = false;  // the tail is a header page (its K/V in a shared page)
  // Attention's page list: INT2, INT4, INT8, then FP16 pages, the FP16 tail last so that an
  // append only lengthens it, each with its first row (numbered by `used` while a GC is
  // pending, else by `live`). Valid while attn_epoch == epoch (ManagedHeap::attn_pages).
  uint64_t attn_rows = 0;
  uint64_t attn_epoch = UINT64_MAX;
  host::vector<SegPage> attn;
  PendingGc gc;  // its `active` flag first
  PageTable table[KVGC_CLASS_COUNT];
  uint64_t tier[4] = {0, 0, 0, 0};  // live tokens per SlotGen
  uint32_t since_minor = 0;         // tokens appended since the last minor GC
  uint32_t minors_since_major = 0;
  bool promote_blocked = false;
  uint64_t draws = 0;  // rankings so far: salts the score noise of the next
  // The highest young-window start of any GC prepared so far: positions below it may have
  // been evicted. A fractional budget grows with the length and a scaling window with it,
  // so a later, wider window can cover positions an earlier GC was free to evict; the
  // walker checks only the part of the window above this.
  uint64_t evictable_below = 0;
  // Whole pages attached from the prefix cache under KVGC_PREFIX_CHARGE=cache (prefix.cpp):
  // the first pinned_pages pages of the FP16 table, header pages of full shared pages. Its
  // GC leaves them out (no op sees them, no budget counts them), so their counts never
  // change: pinned_live tokens, pinned_tier of each generation, until the sequence dies.
  uint32_t pinned_pages = 0;
  uint64_t pinned_live = 0;
  uint64_t pinned_tier[4] = {0, 0, 0, 0};
  // KVGC_PREFIX_CHARGE=prune: tokens of shared pages demoted in place are charged at the
  // class their gen byte names, net per class (SelectResult::shift, from the last GC
  // applied). table[c].live + shift[c] is what the GC plans from.
  int64_t shift[KVGC_CLASS_COUNT] = {};
  // A read order is lent out (kvgc_read, _read_scores, _read_classes) and an observe may
  // still use it: until the sequence's next append, observe or step on this segment, no
  // call on another sequence may reorder its pages (the shrink pass leaves pages this
  // segment holds where they are: shrink.cpp).
  bool order_lent = false;

  uint64_t live() const {
    uint64_t n = 0;
    for (const PageTable& t : table) n += t.live;
    return n;
  }
};

// What a batch plan reads of one segment, kept per sequence in one array (the plan's
// mirror), so that a plan over a sequence nothing but batch appends changed reads a few
// contiguous lines instead of two lines of each of its segments (runtime/batch.cpp).
struct PlanMirror {         // 32 bytes: two a line
  uint64_t epoch = 0;       // Segment::epoch
  uint8_t* tail = nullptr;  // the FP16 tail page's address (ManagedHeap::tail_of), or none
  uint32_t length = 0;      // Segment::length (a plan keeps positions under 2^31)
  uint32_t rows = 0;        // Segment::attn_rows (<= length)
  uint32_t pages = 0;       // Segment::attn.size(): the attention list's pages
  uint16_t tail_used = 0;
  bool tail_header = false;
};

struct SequenceState {
  kvgc_seq id = 0;
  uint64_t batch_mark = 0;         // the serial of the last plan that took it (duplicates,
                                   // and touch: a change to a planned sequence)
  // Bumped by touch on any of its segments. The mirror is current while mirror_changes
  // equals it: a plan's walk over the segments makes it so, the batch appends keep it so,
  // and the walker checks it whenever it claims to be.
  uint64_t changes = 1;
  uint64_t mirror_changes = 0;
  host::vector<PlanMirror> mirror;  // one per layer
  uint32_t tenant = 0;
  uint32_t slot = 0;               // index into ManagedHeap::seq_slots_; segment ids derive from it
  host::vector<Segment> layers;    // one segment per layer
  // KVGC_PREFIX_CHARGE=shrink (shrink.cpp): the class of each page an attach took,
  // [layer * attached_pages + j], when any was stored below FP16 (then its header is in
  // that class's table, not the FP16 one). Empty otherwise. kvgc_prefix_keep reads it
  // to find the prompt's page j; a sequence's own pages follow in its FP16 table.
  uint32_t attached_pages = 0;
  host::vector<uint8_t> attached_cls;
};

// A cached prefix (prefix.cpp): the shared pages of a finished prefill, kept for later
// sequences whose token ids begin the same way. It holds a reference on each page and
// no header: attaching composes each holder's header afresh (positions, sinks, no
// score), which is what appending the same K/V would have written.
struct PrefixEntry {
  kvgc_prefix id = 0;
  uint32_t tenant = 0;       // the keeper's (charged for the pages it created)
  uint64_t salt = 0;         // 0: its tenant's sequences only
  uint64_t seed = 0;         // the hash chain's start: from salt, else from tenant
  host::vector<int32_t> ids; // the prefix's token ids
  uint32_t n_pages = 0;      // per layer: ceil(ids / page_tokens)
  host::vector<PageId> pages;     // [layer * n_pages + i]: the shared pages it holds
  host::vector<uint64_t> hashes;  // [n_pages]: page i's chained hash (prefix_index_ keys)
  bool pinned = false;
  uint32_t busy = 0;         // an attach is using it: not evicted meanwhile
  uint64_t last_use = 0;     // LRU clock
};

struct TenantState {
  uint64_t bytes = 0;  // pages held by the tenant's sequences
  uint64_t limit = 0;  // 0: none
};

struct Counters {
  uint64_t appends = 0, tokens_appended = 0, pages_allocated = 0, pages_freed = 0, enomem = 0;
  uint64_t steps = 0, observes = 0, gcs = 0, minor_gcs = 0, major_gcs = 0;
  uint64_t tokens_ranked = 0, tokens_evicted = 0, tokens_demoted = 0, tokens_promoted = 0;
  uint64_t tokens_tenured = 0, compactions = 0, slots_moved = 0, bytes_moved = 0, ebudget = 0;
  uint64_t attends = 0;
  uint64_t demoted_to[KVGC_CLASS_COUNT] = {};
  uint64_t prefix_lookups = 0, prefix_hits = 0, prefix_tokens_attached = 0, prefix_evictions = 0;
  uint64_t pages_shared = 0, cow_copies = 0;
  uint64_t pages_migrated = 0, slabs_evacuated = 0;
  uint64_t pages_shrunk = 0, bytes_shrunk = 0;
  uint64_t gcs_short_of_pages = 0, demote_slots_short = 0;
  uint64_t pages_unshared = 0;
};

// Named ManagedHeap (and SequenceState), not Heap and Sequence: the public C++ wrapper
// (c_api/kvgc.hpp) owns kvgc::Heap and kvgc::Sequence, and an ODR clash between the two
// was caught by ASan.
class ManagedHeap : public host::HostAllocated {
 public:
  // A segment's budget: in units (gc/plan.hpp; kNoBudget: none) and in bytes (0: none).
  struct LayerBudget {
    uint64_t units = kNoBudget, bytes = 0;
  };

  // Resolves options (environment included), picks the backend and reserves the arena.
  static Status create(const kvgc_model_desc& model, const kvgc_heap_options& opts,
                       std::unique_ptr<ManagedHeap>* out);
  ~ManagedHeap();

  std::mutex& mutex() { return mu_; }
  const kvgc_model_desc& model() const { return model_; }
  const kvgc_heap_options& options() const { return opts_; }
  Backend& backend() { return *backend_; }
  const PageLayout& layout(int cls) const { return layout_[cls]; }
  // An op's layouts: every class's, so no op built here can miss a class added later.
  void set_layouts(PageLayout (&out)[KVGC_CLASS_COUNT]) const {
    std::copy(std::begin(layout_), std::end(layout_), out);
  }

  Status seq_create(uint32_t tenant, kvgc_seq* out);
  Status seq_destroy(kvgc_seq seq);
  Status seq_fork(kvgc_seq seq, uint32_t tenant, kvgc_seq* out, void* stream);
  // The prefix cache (prefix.cpp): kvgc_prefix_keep / attach / pin / drop.
  Status prefix_keep(kvgc_seq seq, const int32_t* ids, uint64_t n, uint64_t salt, bool pin,
                     kvgc_prefix* out, void* stream);
  Status prefix_attach(kvgc_seq seq, const int32_t* ids, uint64_t n, uint64_t salt,
                       uint64_t* n_attached, void* stream);
  Status prefix_pin(kvgc_prefix prefix, bool pinned);
  Status prefix_drop(kvgc_prefix prefix);
  Status append(kvgc_seq seq, uint32_t layer, const void* k, const void* v, uint32_t n,
                void* stream);
  Status tokens(kvgc_seq seq, uint32_t layer, uint64_t* live, uint64_t* length);
  Status read(kvgc_seq seq, uint32_t layer, void* k_out, void* v_out, int32_t* pos_out,
              uint64_t capacity, uint64_t* n_out, void* stream);
  Status read_scores(kvgc_seq seq, uint32_t layer, float* scores_out, uint8_t* gen_out,
                     uint64_t capacity, uint64_t* n_out, void* stream);
  Status read_classes(kvgc_seq seq, uint32_t layer, uint8_t* cls_out, uint64_t capacity,
                      uint64_t* n_out, void* stream);
  Status observe(kvgc_seq seq, uint32_t layer, const float* mass, uint64_t n, void* stream);
  Status step(kvgc_seq seq, void* stream);
  Status tenant_set_limit(uint32_t tenant, uint64_t max_bytes);
  Status tenant_usage(uint32_t tenant, uint64_t* bytes, uint64_t* limit);
  // Test hook: calls f(page bytes, size) for every page of a sequence (tenant isolation
  // tests scan them for another tenant's bytes).
  template <class F>
  Status for_each_page(kvgc_seq seq, F&& f);
  Status attend(kvgc_seq seq, uint32_t layer, const void* q, uint32_t n_q, void* out,
                float scale, bool add_scores, void* stream);
  // Batches (batch.cpp): kvgc_batch_*. release returns the pages a plan reserved for
  // layers never appended and spends the plan; destroy also frees the plan's arrays.
  // scored: [n] rows that score, from each chunk's end (null: all); flags: [n]
  // KVGC_BATCH_SEQ_* (null: none). kvgc_batch_plan_ex.
  Status batch_plan(BatchPlan& b, const kvgc_seq* seqs, const uint32_t* n_new, uint32_t n,
                    const uint32_t* scored, const uint32_t* flags, uint32_t* failed, void* stream);
  Status batch_append(BatchPlan& b, uint32_t layer, const void* k, const void* v, void* stream);
  // mass_out (null: the mass goes to the scores): kvgc_attend_params.mass_out.
  Status batch_attend(BatchPlan& b, uint32_t layer, const void* q, void* out, float scale,
                      bool add_scores, float* mass_out, void* stream);
  Status batch_observe(BatchPlan& b, uint32_t layer, const float* mass, void* stream);
  Status batch_step(BatchPlan& b, void* stream);
  Status batch_export(BatchPlan& b, uint32_t layer, kvgc_batch_view* out);
  void batch_release(BatchPlan& b);
  void batch_destroy(BatchPlan& b);
  void page_layout(int cls, kvgc_page_layout* out) const;
  uint32_t first_layer() const { return first_layer_; }
  uint32_t total_layers() const { return total_layers_; }
  Status stats(kvgc_stats* out);  // a full struct; the C glue copies struct_size
  Status check();                     // the invariant walker
  uint64_t pending_gcs() const { return pending_; }  // segments whose GC is not applied yet

 private:
  ManagedHeap() = default;
  Status find(kvgc_seq seq, uint32_t layer, const char* fn, SequenceState** out);
  SegmentId segment_id(const SequenceState& s, uint32_t layer) const {
    return s.slot * model_.n_layers + layer;
  }
  uint8_t* page_ptr(PageId id) const { return reinterpret_cast<uint8_t*>(pool_.address(id)); }
  // Shared pages (shared.cpp). A page that several segments or cached prefixes hold is
  // immutable and owned by kSharedOwner. Each segment holding it has a header page of its
  // own in its table (kHeaderClass: its live bits, positions, scores, generations; the
  // host's used/live counts are the header page's) that names the shared page here;
  // ops read K/V from the shared page (SegPage::kv) and everything else from the header.
  bool is_header(PageId p) const { return pool_.class_of(p) == kHeaderClass; }
  // Live tokens of a table in pages of its own (not shared).
  uint64_t private_live(const PageTable& t) const {
    uint64_t n = t.live;
    for (PageId p : t.pages)
      if (is_header(p)) n -= pool_.desc(p).live;
    return n;
  }
  // The page holding p's K/V when p is a header page, else null (p holds its own).
  const uint8_t* kv_of(PageId p) const {
    return is_header(p) ? page_ptr(backing_.find(p)->second.page) : nullptr;
  }
  // Makes page `index` of the segment's class-`cls` table shared: its slot metadata moves
  // to a new header page that takes its place in the table. Copies no K/V byte.
  Status share(SequenceState& s, uint32_t layer, int cls, size_t index, void* stream);
  // Page `index` of the segment's fp16 table, private and holding the same tokens as the
  // shared page `cached` (a cached prefix's, same ids at the same place), gives way to a
  // header page reading `cached`: its metadata stays the segment's, its copy of the K/V
  // goes back to the pool. Copies no K/V byte.
  Status rebind_to_shared(SequenceState& s, uint32_t layer, size_t index, PageId cached, void* stream);
  // A header page for `holder` that reads `shared`, its metadata copied from `src` (a
  // header's bytes on the device, or on the host: kind says which).
  Status add_header(const SequenceState& holder, uint32_t layer, PageId shared, const void* src,
                    CopyKind kind, void* stream, PageId* out);
  // Copy-on-write of a partly filled shared tail: the segment's class-`cls` tail becomes a
  // private copy before anything writes into it. ENOMEM when no page is free.
  Status unshare_tail(SequenceState& s, uint32_t layer, int cls, void* stream);
  // A table's tail page (kNoPage when it is empty): its used slots, and whether it is a
  // header page (its K/V in a shared page).
  struct Tail {
    PageId page;
    uint32_t used;
    bool header;
    uint32_t room(uint32_t pt) const { return page == kNoPage ? 0 : pt - used; }
    // A partly filled shared page: copied before anything writes into it.
    bool shared(uint32_t pt) const { return header && used < pt; }
  };
  Tail tail_of(const PageTable& t) const {
    if (t.pages.empty()) return {kNoPage, 0, false};
    return {t.pages.back(), pool_.desc(t.pages.back()).used, is_header(t.pages.back())};
  }
  // The segment's FP16 tail, from the cache above when it is valid, else from the pool,
  // and cached.
  Tail fp16_tail(Segment& seg) const {
    if (seg.tail_epoch != seg.epoch) {
      const PageTable& f = seg.table[KVGC_CLASS_FP16];
      const Tail t = tail_of(f);
      seg.tail_epoch = seg.epoch;
      seg.tail_count = uint32_t(f.pages.size());
      seg.tail_page = t.page;
      seg.tail_used = uint16_t(t.used);
      seg.tail_header = t.header;
    }
    return {seg.tail_page, seg.tail_used, seg.tail_header};
  }
  // A segment's plan mirror entry (its attention list current, `pages` long).
  PlanMirror mirror_of(const Segment& seg, const Tail& t, uint32_t pages) const {
    return {seg.epoch, t.page == kNoPage ? nullptr : page_ptr(t.page), uint32_t(seg.length),
            uint32_t(seg.attn_rows), pages, uint16_t(t.used), t.header};
  }
  bool tail_shared(const PageTable& t) const { return tail_of(t).shared(opts_.page_tokens); }
  void unref_shared(PageId shared);
  // A shared page that only one header page still names (its other holders destroyed,
  // no cached prefix holding it) becomes that holder's own page again: the header's bytes
  // are copied into the page's, and the header page goes back to the pool. Run where
  // shrink_shared runs (nothing in flight names a page, no plan is live); unref_shared
  // counts the candidates in sole_ready_. Pinned pages and pages charged to another
  // tenant stay shared.
  Status unshare_sole_holders(void* stream);
  // Shared pages stored below their class (shrink.cpp, KVGC_PREFIX_CHARGE=shrink).
  // shrink_class_: the class they go to (the ladder's first rung below FP16), -1 when
  // the heap does not shrink. note_classes records a GC's page_classes for the header
  // pages among a segment's pages; shrink_shared re-stores every shared page all of whose
  // holders count it at shrink_class_ or below, when nothing in flight names a page.
  bool charges_in_place() const {
    return opts_.prefix_charge == KVGC_PREFIX_CHARGE_PRUNE || opts_.prefix_charge == KVGC_PREFIX_CHARGE_SHRINK;
  }
  struct SharedPage;
  void note_classes(PageId header, int page_cls, uint8_t classes);
  void mark_cheap(PageId header);
  bool shrinkable(PageId shared, const SharedPage& sp) const;
  // shrink_shared leaves a page where it is while one of its holders has lent out its
  // read order (Segment::order_lent): it waits for a later pass.
  Status shrink_shared(void* stream);
  static void end_lent_orders(SequenceState& s) {
    for (Segment& seg : s.layers) seg.order_lent = false;
  }
  // Bytes the tenant is charged: its tables' pages (private and header) and the shared
  // pages it created.
  uint64_t tenant_bytes_now(uint32_t tenant) const;
  // Evacuation (evacuate.cpp): empties sparse slabs of classes other than `cls`, sparsest
  // first, by moving their pages into their class's other slabs, until n pages of `cls`
  // fit or no slab can go. Leaves slabs holding a page of segment `keep` alone
  // (kNoSegment: none). Does nothing while a GC is issued and not applied, or a batch
  // plan is live. A device error from a copy is returned with nothing changed.
  Status evacuate(int cls, uint64_t n, SegmentId keep, void* stream);
  Status evacuate_slab(uint32_t slab, void* stream);
  bool evacuable(uint32_t slab, SegmentId keep) const;
  Segment& segment_of(SegmentId id);
  // Evicts the least recently used cached prefix that is neither pinned nor in use;
  // false when there is none. Callers loop while the arena is short.
  bool evict_one_prefix();
  void drop_prefix(PrefixEntry& e);
  void unindex_prefix(const PrefixEntry& e);
  // Every change to a segment's pages or counts outside a batch's own calls goes through
  // here: it bumps the segment's epoch and, when the segment belongs to the live plan,
  // makes that whole plan stale (kvgc.h: every later call on the plan fails with
  // KVGC_EINVAL), whichever layer changed.
  void touch(Segment& seg) {
    ++seg.epoch;
    ++seg.owner->changes;
    if (planned_ && seg.owner->batch_mark == planned_->serial) planned_->stale = true;
  }
  void free_pages(uint32_t tenant, Segment& s);
  // Every page a segment takes or gives back goes through these two: they keep the
  // tenant's byte count, which quotas are checked against.
  PageId take_page(const SequenceState& s, uint32_t layer, int cls);
  void drop_page(uint32_t tenant, PageId id);
  // Bytes the tenant may still take (UINT64_MAX without a limit).
  uint64_t tenant_room(uint32_t tenant) const;
  // Whether n[c] new pages of each class fit the arena at once (classes share its free
  // slabs).
  bool can_alloc_all(const uint64_t n[KVGC_CLASS_COUNT]) const;
  // The segment's pages in read order, with each page's first read-order row; returns
  // the rows. rows_by_used numbers them by `used`, an upper bound on live slots that
  // holds while a GC's results are pending (attention's rows are its own).
  uint64_t segment_pages(const Segment& s, host::vector<SegPage>* out,
                         bool rows_by_used = false) const;
  // The segment's attention page list, rebuilt if a change since made it stale.
  const host::vector<SegPage>& attn_pages(Segment& s);
  // One segment's GC (collect.cpp): apply the previous GC's results, compact when
  // fragmented, plan, issue the decision op (applied at once with KVGC_HARVEST=immediate).
  // Sets *short_of_budget when the protected tokens alone exceed the budget.
  // It is split in two so that a step launches every collecting segment's select at once
  // (issue 22): gc_prepare does everything up to the op (settle, compaction, the plan,
  // the demotion pages, the op in the segment's result block) and queues it in gc_ops_;
  // gc_flush launches the queued ops with one Backend::select_batch (a constant number of
  // launches on CUDA, whatever their number) and then does each segment's post-launch
  // bookkeeping (pending record, reserved demotion slots, event). Ops not launched (a
  // failed launch) give their demotion pages back, as one failed select did before.
  // Anything in gc_prepare that would settle other segments (settle_all when short of
  // pages) flushes the queue first, so the batch decides what segment-by-segment did.
  Status gc_prepare(SequenceState& s, uint32_t layer, const LayerBudget& budget, void* stream,
                    bool* short_of_budget);
  Status gc_flush(void* stream);
  // For a preparation that threw: flushes what was queued before, swallowing a second
  // exception (the first is rethrown by the caller).
  void gc_flush_after_throw(void* stream);
  // Returns the pages a queued GC took past `before` (per class) to the pool.
  void drop_pages_after(uint32_t tenant, Segment& seg, const size_t before[]);
  // Room in the queue for n more segments (may throw: called before anything changes).
  void gc_reserve(size_t n);
  // Prepares every layer of a sequence (kvgc_step without the flush); KVGC_EBUDGET as
  // kvgc_step returns it.
  Status step_prepare(kvgc_seq seq, void* stream);
  Status compact_fragmented(uint32_t tenant, Segment& seg, void* stream);
  Status compact(uint32_t tenant, Segment& seg, int cls, void* stream);
  // The deferred harvest (harvest.cpp). settle applies a segment's pending GC results
  // (waiting for them on a device); settle_all every segment's. harvest_reserve sizes a
  // segment's result block for `pages` pages; harvest_release waits and frees it.
  Status settle(uint32_t tenant, Segment& seg);
  Status settle_all();
  Status harvest_reserve(PendingGc& p, size_t pages);
  void harvest_release(uint32_t tenant, Segment& seg);

  // The batch plan's checks and layout (batch.cpp).
  Status batch_live(BatchPlan& b, uint32_t layer, const char* fn);
  Status batch_arrays(BatchPlan& b, size_t n_runs, size_t n_pages);
  void batch_materialize(BatchPlan& b, uint32_t layer);
  void export_page(const BatchPlan::Arrays& A, uint32_t at, const SegPage& sp) const;
  uint64_t batch_reserved_bytes(uint32_t tenant) const;  // pages a plan holds for the tenant
  size_t batch_reserved_pages() const;

  // Frees the pages of `t` whose live count is zero, keeping the order of the others.
  void free_empty_pages(uint32_t tenant, PageTable& t);
  host::vector<LayerBudget> layer_budgets(const SequenceState& s);

  std::mutex mu_;
  kvgc_model_desc model_{};
  kvgc_heap_options opts_{};
  std::unique_ptr<Backend> backend_;
  void* arena_ = nullptr;
  size_t arena_bytes_ = 0;
  void* scratch_ = nullptr;  // device executors' scratch (attention, the GC's select): the
                             // arena's last slabs, shared (they never run concurrently)
  size_t scratch_bytes_ = 0;
  PageLayout layout_[KVGC_CLASS_COUNT];
  PagePool pool_;
  host::unordered_map<kvgc_seq, SequenceState> seqs_;  // node-based: addresses are stable
  host::vector<SequenceState*> seq_slots_;  // slot -> sequence (null when free)
  host::vector<uint32_t> free_slots_;
  kvgc_seq next_seq_ = 1;
  Counters counters_;
  struct SharedPage {
    uint32_t refs = 0;    // header pages naming it + cached prefixes holding it
    uint32_t tenant = 0;  // charged once, to the tenant whose sequence created it
    uint32_t prefix_refs = 0;  // of refs, cached prefixes (all of them: no sequence holds it)
    // KVGC_PREFIX_CHARGE=shrink (shrink.cpp): headers naming it whose holder counts every
    // live slot at the shrink class or below (Backing::cheap), and whether any holder
    // ever did (a holder whose GC evicted all of the page's slots counts).
    uint32_t cheap = 0;
    bool judged = false;
    bool cached_only() const { return refs == prefix_refs; }  // evicting prefixes frees it
    uint32_t holders() const { return refs - prefix_refs; }
    // One header names it and no cached prefix holds it: its holder may take it back
    // (unshare_sole_holders, shared.cpp).
    bool sole_holder() const { return refs == 1 && prefix_refs == 0; }
  };
  host::unordered_map<PageId, SharedPage> shared_;  // shared page -> its holders
  struct Backing {
    PageId page;         // the shared page a header page reads
    bool cheap = false;  // its holder's last GC counted no live slot above the shrink class
    // Its holder's last GC counted a live slot below the page's class (charged in place:
    // prune, shrink). Such a header stays one when its page has no other holder: as its
    // holder's own page the slot would keep its bytes but be charged less.
    bool charged = false;
  };
  host::unordered_map<PageId, Backing> backing_;    // header page -> its shared page
  size_t header_bytes_ = 0;                         // a header: the layout's bytes before K
  int shrink_class_ = -1;
  uint64_t shrink_ready_ = 0;  // pages found shrinkable since the last pass (a hint)
  uint64_t sole_ready_ = 0;    // shared pages left with one holder since the last pass (a hint)
  host::unordered_map<kvgc_prefix, PrefixEntry> prefixes_;
  host::unordered_multimap<uint64_t, kvgc_prefix> prefix_index_;  // page hash -> prefixes
  kvgc_prefix next_prefix_ = 1;
  uint64_t lru_clock_ = 0;
  host::unordered_map<uint32_t, TenantState> tenants_;
  PolicyParams policy_;
  Ladder ladder_;  // the classes demotion may store tokens in (gc/ladder.hpp)
  host::vector<float> layer_weights_;  // KVGC_LAYER_BUDGET_ENTROPY: one per layer
  uint64_t pending_ = 0;   // segments with a GC not yet applied
  StagingRing staging_;  // device backends: attention's page lists, in pinned memory
  PinnedPool pinned_;    // the GC's result blocks
  host::vector<void*> spare_events_;  // events of released segments, for reuse
  size_t events_made_ = 0;
  uint32_t first_layer_ = 0, total_layers_ = 0;  // the model's layers this heap holds
  BatchPlan* planned_ = nullptr;  // the batch whose plan is live (one per heap)
  uint64_t plan_serial_ = 0;
  uint8_t* batch_region_ = nullptr;  // device backends: the plans' tables (arena's end)
  size_t batch_region_bytes_ = 0;
  // Scratch reused across calls so that the decode path does not allocate.
  host::vector<AppendRun> runs_;
  host::vector<SegPage> pages_;
  // The GCs gc_prepare queued and gc_flush launches (collect.cpp).
  struct PreparedGc {
    SequenceState* s;
    uint32_t layer;
    bool major;
    size_t before[KVGC_CLASS_COUNT];  // pages per class before the demotion targets
  };
  host::vector<PreparedGc> gc_prep_;
  host::vector<SelectOp> gc_ops_;
};

// A shared page is shown as the segment sees it: a host copy of its header page, then the
// shared page's K/V (the copy synchronises the device).
template <class F>
Status ManagedHeap::for_each_page(kvgc_seq seq, F&& f) {
  SequenceState* s;
  KVGC_TRY(find(seq, 0, "for_each_page", &s));
  host::vector<uint8_t> image;
  for (const Segment& seg : s->layers)
    for (int c = 0; c < KVGC_CLASS_COUNT; ++c)
      for (PageId p : seg.table[c].pages) {
        const uint8_t* at = page_ptr(p);
        if (is_header(p)) {
          const size_t bytes = layout_[c].bytes;
          image.resize(bytes);
          KVGC_TRY(backend_->copy(image.data(), at, header_bytes_, CopyKind::DeviceToHost, nullptr));
          KVGC_TRY(backend_->copy(image.data() + header_bytes_, kv_of(p) + header_bytes_,
                                  bytes - header_bytes_, CopyKind::DeviceToHost, nullptr));
          KVGC_TRY(backend_->synchronize(nullptr));
          at = image.data();
        }
        if constexpr (std::is_invocable_v<F, const uint8_t*, size_t, int, uint32_t>)
          f(at, layout_[c].bytes, c, uint32_t(pool_.desc(p).used));  // + slots written
        else if constexpr (std::is_invocable_v<F, const uint8_t*, size_t, int>)
          f(at, layout_[c].bytes, c);  // with its storage class
        else
          f(at, layout_[c].bytes);
      }
  return Status::Ok();
}

}  // namespace kvgc
