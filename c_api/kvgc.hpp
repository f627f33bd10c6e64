/// @file
/// kvgc.hpp -- a thin, header-only C++ layer over kvgc.h: RAII handles and exceptions.
///
/// The C API never throws; this header turns a failed status into kvgc::Error (status
/// plus kvgc_errmsg), so C++ engines can write straight-line code. It adds no state:
/// everything it does goes through kvgc.h.
///
/// ```
///   kvgc::Heap heap(model);                 // defaults, then KVGC_* environment
///   kvgc::Sequence seq(heap, /*tenant=*/0);  // destroyed with its scope
///   seq.append(layer, k, v, n);              // throws kvgc::Error on failure
/// ```
#pragma once

#include <stdexcept>
#include <string>
#include <utility>

#include "kvgc.h"

/// kvgc.h's C++ layer.
namespace kvgc {

/// A failed call's status and message (kvgc_status_str, then kvgc_errmsg).
class Error : public std::runtime_error {
 public:
  /// "STATUS: message" as what().
  Error(kvgc_status status, const std::string& msg)
      : std::runtime_error(std::string(kvgc_status_str(status)) + ": " + msg), status_(status) {}
  /// The failed call's status.
  kvgc_status status() const noexcept { return status_; }

 private:
  kvgc_status status_;
};

/// Throws kvgc::Error unless `s` is KVGC_OK; the message is the calling thread's.
inline void check(kvgc_status s, const kvgc_heap* heap = nullptr) {
  if (s != KVGC_OK) throw Error(s, kvgc_errmsg(heap));
}

/// A kvgc_model_desc (kvgc_model_desc_init, then these fields).
inline kvgc_model_desc model_desc(uint32_t layers, uint32_t q_heads, uint32_t kv_heads,
                                  uint32_t head_dim, kvgc_dtype dtype = KVGC_DTYPE_F16) {
  kvgc_model_desc m;
  check(kvgc_model_desc_init(&m));
  m.n_layers = layers;
  m.n_q_heads = q_heads;
  m.n_kv_heads = kv_heads;
  m.head_dim = head_dim;
  m.dtype = dtype;
  return m;
}

/// The default heap options (kvgc_heap_options_init).
inline kvgc_heap_options default_options() {
  kvgc_heap_options o;
  check(kvgc_heap_options_init(&o));
  return o;
}

/// A heap (kvgc_heap_create), destroyed with its scope (kvgc_heap_destroy); move-only.
class Heap {
 public:
  /// opts == nullptr: defaults, then environment (as kvgc_heap_create).
  explicit Heap(const kvgc_model_desc& model, const kvgc_heap_options* opts = nullptr) {
    check(kvgc_heap_create(&model, opts, &h_));
  }
  /// With these options (then environment, unless KVGC_OPT_IGNORE_ENV).
  Heap(const kvgc_model_desc& model, const kvgc_heap_options& opts) : Heap(model, &opts) {}
  ~Heap() { kvgc_heap_destroy(h_); }
  /// Takes o's heap; o holds none.
  Heap(Heap&& o) noexcept : h_(std::exchange(o.h_, nullptr)) {}
  /// Destroys this heap and takes o's.
  Heap& operator=(Heap&& o) noexcept {
    if (this != &o) {
      kvgc_heap_destroy(h_);
      h_ = std::exchange(o.h_, nullptr);
    }
    return *this;
  }
  Heap(const Heap&) = delete;
  Heap& operator=(const Heap&) = delete;

  /// The C handle, for kvgc.h's other calls.
  kvgc_heap* get() const noexcept { return h_; }

  /// kvgc_get_stats.
  kvgc_stats stats() const {
    kvgc_stats s;
    check(kvgc_stats_init(&s));
    check(kvgc_get_stats(h_, &s), h_);
    return s;
  }
  /// The effective options (kvgc_heap_get_options).
  kvgc_heap_options options() const {
    kvgc_heap_options o;
    check(kvgc_heap_options_init(&o));
    check(kvgc_heap_get_options(h_, &o), h_);
    return o;
  }
  /// The invariant walker; throws kvgc::Error (KVGC_EINTERNAL) on a violation.
  void check_invariants() const { check(kvgc_heap_check(h_), h_); }

 private:
  kvgc_heap* h_ = nullptr;
};

/// One request's cache; destroys the sequence (and frees its pages) with its scope.
class Sequence {
 public:
  /// A new sequence of `tenant` (kvgc_seq_create).
  Sequence(Heap& heap, uint32_t tenant) : heap_(heap.get()) {
    check(kvgc_seq_create(heap_, tenant, &id_), heap_);
  }
  ~Sequence() {
    if (id_) kvgc_seq_destroy(heap_, id_);
  }
  /// Takes o's sequence; o holds none.
  Sequence(Sequence&& o) noexcept : heap_(o.heap_), id_(std::exchange(o.id_, 0)) {}
  Sequence& operator=(Sequence&&) = delete;
  Sequence(const Sequence&) = delete;
  Sequence& operator=(const Sequence&) = delete;

  /// The C handle.
  kvgc_seq id() const noexcept { return id_; }

  /// Appends n tokens' K/V to `layer` (kvgc_append).
  void append(uint32_t layer, const void* k, const void* v, uint32_t n,
              void* stream = nullptr) {
    check(kvgc_append(heap_, id_, layer, k, v, n, stream), heap_);
  }
  /// The live K/V and positions of `layer` (kvgc_read). Returns the live count; outputs
  /// may be null (then only the count is returned).
  uint64_t read(uint32_t layer, void* k_out, void* v_out, int32_t* pos_out, uint64_t capacity,
                void* stream = nullptr) {
    uint64_t n = 0;
    check(kvgc_read(heap_, id_, layer, k_out, v_out, pos_out, capacity, &n, stream), heap_);
    return n;
  }
  /// Each live token's storage class (kvgc_storage_class) in read order; returns the count.
  uint64_t read_classes(uint32_t layer, uint8_t* cls_out, uint64_t capacity,
                        void* stream = nullptr) {
    uint64_t n = 0;
    check(kvgc_read_classes(heap_, id_, layer, cls_out, capacity, &n, stream), heap_);
    return n;
  }
  /// Live tokens of `layer` (kvgc_seq_tokens).
  uint64_t live(uint32_t layer) {
    uint64_t live = 0;
    check(kvgc_seq_tokens(heap_, id_, layer, &live, nullptr), heap_);
    return live;
  }
  /// Tokens ever appended to `layer` (kvgc_seq_tokens).
  uint64_t length(uint32_t layer) {
    uint64_t len = 0;
    check(kvgc_seq_tokens(heap_, id_, layer, nullptr, &len), heap_);
    return len;
  }
  /// A copy of this sequence's cache as a new sequence of `tenant` (kvgc_seq_fork; since
  /// 0.7 it shares the pages).
  Sequence fork(uint32_t tenant, void* stream = nullptr) {
    kvgc_seq id = 0;
    check(kvgc_seq_fork(heap_, id_, tenant, &id, stream), heap_);
    return Sequence(heap_, id);
  }
  /// The prefix cache (0.7). keep: this sequence's cache of ids[0, n) (its whole length, no
  /// step since) becomes a cached prefix; returns its handle. attach: this sequence, still
  /// empty, takes the longest cached prefix of ids[0, n); returns the tokens attached.
  ///@{
  kvgc_prefix keep_prefix(const int32_t* ids, uint64_t n, uint64_t salt = 0, uint32_t flags = 0,
                          void* stream = nullptr) {
    kvgc_prefix p = 0;
    check(kvgc_prefix_keep(heap_, id_, ids, n, salt, flags, &p, stream), heap_);
    return p;
  }
  uint64_t attach_prefix(const int32_t* ids, uint64_t n, uint64_t salt = 0, void* stream = nullptr) {
    uint64_t got = 0;
    check(kvgc_prefix_attach(heap_, id_, ids, n, salt, &got, stream), heap_);
    return got;
  }
  ///@}

 private:
  Sequence(kvgc_heap* heap, kvgc_seq id) : heap_(heap), id_(id) {}
  kvgc_heap* heap_;
  kvgc_seq id_ = 0;
};

/// One engine step over many sequences (kvgc_batch_*): plan, then per layer append and
/// attend, then step. The Batch must not outlive its Heap.
class Batch {
 public:
  /// A batch of `heap` (kvgc_batch_create).
  explicit Batch(Heap& heap) : heap_(heap.get()) { check(kvgc_batch_create(heap_, &b_), heap_); }
  ~Batch() { kvgc_batch_destroy(b_); }
  Batch(const Batch&) = delete;
  Batch& operator=(const Batch&) = delete;

  /// The C handle.
  kvgc_batch* get() const noexcept { return b_; }
  /// Plans n sequences with n_new[i] new rows each. KVGC_ENOMEM and KVGC_EBUDGET (a
  /// sequence does not fit: *failed names it) are returned, not thrown, since an engine
  /// answers them by preempting; every other error throws.
  kvgc_status plan(const kvgc_seq* seqs, const uint32_t* n_new, uint32_t n, uint32_t* failed,
                   void* stream = nullptr) {
    const kvgc_status st = kvgc_batch_plan(b_, seqs, n_new, n, failed, stream);
    if (st != KVGC_ENOMEM && st != KVGC_EBUDGET) check(st, heap_);
    return st;
  }
  /// The same with per-sequence choices (kvgc_batch_plan_ex, 0.6): scored_rows[i] (null:
  /// all) of sequence i's rows, from its chunk's end, add attention mass; seq_flags[i]
  /// (null: none) KVGC_BATCH_SEQ_DEFER_STEP leaves its GC for a later step.
  kvgc_status plan(const kvgc_seq* seqs, const uint32_t* n_new, uint32_t n,
                   const uint32_t* scored_rows, const uint32_t* seq_flags, uint32_t* failed,
                   void* stream = nullptr) {
    kvgc_batch_plan_options o;
    check(kvgc_batch_plan_options_init(&o), heap_);
    o.scored_rows = scored_rows;
    o.seq_flags = seq_flags;
    const kvgc_status st = kvgc_batch_plan_ex(b_, seqs, n_new, n, &o, failed, stream);
    if (st != KVGC_ENOMEM && st != KVGC_EBUDGET) check(st, heap_);
    return st;
  }
  /// The planned rows' K/V for `layer` (kvgc_batch_append).
  void append(uint32_t layer, const void* k, const void* v, void* stream = nullptr) {
    check(kvgc_batch_append(b_, layer, k, v, stream), heap_);
  }
  /// The planned rows' attention at `layer` (kvgc_batch_attend).
  void attend(uint32_t layer, const void* q, void* out, const kvgc_attend_params* params = nullptr,
              void* stream = nullptr) {
    check(kvgc_batch_attend(b_, layer, q, out, params, stream), heap_);
  }
  /// Every planned sequence's GC (kvgc_batch_step). KVGC_EBUDGET (advisory: a sequence
  /// stays over its budget) is returned, not thrown.
  kvgc_status step(void* stream = nullptr) {
    const kvgc_status st = kvgc_batch_step(b_, stream);
    if (st != KVGC_EBUDGET) check(st, heap_);
    return st;
  }

 private:
  kvgc_heap* heap_;
  kvgc_batch* b_ = nullptr;
};

}  // namespace kvgc
