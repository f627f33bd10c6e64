// Data-plane op descriptors: what the runtime asks an executor (CPU or CUDA) to do.
// Pointers are the heap's device pointers (host pointers on the CPU backend). The ops
// make no policy decisions: the host has already chosen pages and output positions.
#pragma once

#include <cstdint>

#include "page_layout.hpp"

namespace kvgc {

// Tokens [src_token, src_token + count) of the source go to slots
// [first_slot, first_slot + count) of `page`. A run with first_slot == 0 starts a fresh
// page and owns all of it: its live mask (bits past the run are cleared) and the K/V and
// metadata of the slots past the run, which it zeroes (scrubbing: a recycled page never
// shows its previous owner's bytes). Later runs into the same page only add.
//
// Positions: token i of the run has position op.first_pos + src_token + i + pos_delta.
// A single segment's append leaves pos_delta at 0; a batch (one op over many segments,
// src_token counting rows of the whole batch) sets op.first_pos = 0 and pos_delta to the
// segment's length minus its first row.
struct AppendRun {
  uint8_t* page;
  uint32_t first_slot;
  uint32_t count;
  uint32_t src_token;
  int32_t pos_delta = 0;
};

struct AppendOp {
  PageLayout layout;      // FP16 class: new tokens are always stored in the model dtype
  const void* k;          // [n][n_kv_heads][head_dim] model dtype
  const void* v;
  int64_t first_pos;      // position of source token 0
  uint32_t sinks;         // positions below this are sinks (kGenSink), others young
  const AppendRun* runs;  // host array (pinned on device backends when dev_runs is set)
  uint32_t n_runs;
  // Device backends: the same runs already in device memory (a batch uploads every
  // layer's runs once, at plan); null: the executor ships `runs` itself.
  const AppendRun* dev_runs = nullptr;
};

// One page of a segment as the ops see it. Read order is the segment's FP16 pages, then
// its INT4, INT8 and INT2 pages (kvgc_storage_class order); a page's live slots, in slot
// order, are rows [out_row, out_row + live) of that order (for gather's outputs and
// observe's mass). Attention's list (ManagedHeap::attn_pages) has its own order.
//
// A shared page (kvgc_prefix_*, kvgc_seq_fork) splits in two: `page` is the holder's own
// header (live bits, positions, scores, recent scores, generations: the layout's bytes
// before k_off) and `kv` the shared page whose K/V and quantisation parameters (at the
// layout's k_off and after) every holder reads and none writes. A private page has
// kv == null: everything is at `page`. Use payload_of().
struct SegPage {
  uint8_t* page;
  uint32_t cls;  // kvgc_storage_class
  uint64_t out_row;
  const uint8_t* kv = nullptr;
};
KVGC_HD inline const uint8_t* payload_of(const SegPage& sp) { return sp.kv ? sp.kv : sp.page; }
using GatherPage = SegPage;

struct GatherOp {
  PageLayout layout[KVGC_CLASS_COUNT];
  const SegPage* pages;  // host array
  uint32_t n_pages;
  void* k_out;              // [rows][n_kv_heads][head_dim] model dtype, or null
  void* v_out;
  int32_t* pos_out;         // [rows], or null
  float* score_out = nullptr;    // [rows], or null
  uint8_t* gen_out = nullptr;    // [rows] generation (SlotGen), or null
};

// Adds mass[row] to the score of the slot at each read-order row, and to its recent
// score after multiplying that by `decay`. On a device it is enqueued on the engine's
// stream and never synchronises.
//
// by_slot (a batch's observe, for engines that run their own attention over exported
// pages): mass is indexed by page and slot instead, mass[p * page_tokens + slot] for
// page p of `pages`; dead slots' entries are ignored.
struct ObserveOp {
  PageLayout layout[KVGC_CLASS_COUNT];
  const SegPage* pages;
  uint32_t n_pages;
  const float* mass;  // [live rows], heap's device
  float decay = 1.0f; // recent = recent * decay + mass
  bool by_slot = false;
  const SegPage* dev_pages = nullptr;  // device backends: `pages` already on the device
};

// The ranking key of a policy: accumulated score (h2o, generational's long-term tier),
// recent score (generational's intermediate tier), position (oldest first: streaming),
// or a seeded hash of the position (random).
enum class KeyKind : uint8_t { Score, Position, Random, Recent };
constexpr bool key_is_score(KeyKind k) { return k == KeyKind::Score || k == KeyKind::Recent; }

// The GC's one data-plane decision: over a segment's pages, tenure tokens leaving the
// young window, rank the candidate tiers by key (+ Laplace noise), give every candidate
// its rung of the storage ladder (gc/ladder.hpp: the rungs taken in increasing order of
// weight x slope until `reclaim` units are given back), keep the ladder monotone (no
// candidate in a cheaper class outranks one in a dearer class; capacity of the
// destination slots respected), evict the lowest-ranked further while the pages left
// after compaction would exceed budget_bytes, promote top-ranked stable intermediate
// tokens, re-split tiers on a major GC, age the intermediate survivors. Reports
// page-granular results only.
//
// Units: a token of class c costs unit_cost[c] (its page bytes: page_tokens tokens of a
// page cost page_tokens x a token's bytes, so costs stay integers and sums exact).
//
// Streams: page_live and result are host memory the device may write asynchronously
// (Backend::result_alloc). The CPU executor fills them before returning; the CUDA
// executor enqueues its kernels and copies them back without waiting; the runtime reads
// them after an event recorded behind the op (runtime/harvest.cpp).
struct SelectResult {
  uint64_t ranked = 0, tenured = 0, evicted = 0, demoted = 0, promoted = 0;
  uint64_t promote_eligible = 0;        // intermediate tokens old enough, not promoted
  uint64_t reclaimed = 0;               // units given back (evictions and demotions)
  uint64_t demoted_to[KVGC_CLASS_COUNT] = {};  // destination slots filled, per class
  uint64_t tier[4] = {0, 0, 0, 0};      // live tokens per generation after the op
  uint64_t live[KVGC_CLASS_COUNT] = {};
  // charge_shared: live tokens of shared pages counted at their charged class, net per
  // class (+1 to the charged class, -1 to the page's, for each): live + shift is what
  // the segment is charged for.
  int64_t shift[KVGC_CLASS_COUNT] = {};
};

struct SelectOp {
  PageLayout layout[KVGC_CLASS_COUNT];
  const SegPage* pages;       // every page of the segment (incl. demotion targets)
  uint32_t n_pages;
  int64_t tenure_before;      // young slots with position < this become intermediate
  uint8_t candidates;         // gen_bit mask of tiers ranked
  KeyKind key;
  double noise;               // Laplace scale on score keys (0 = off)
  uint64_t seed, segment_salt, epoch;  // random keys: (seed, salt); noise: + epoch
  uint64_t reclaim;           // units to give back
  uint64_t unit_cost[KVGC_CLASS_COUNT];  // a token's cost per class (its page bytes)
  uint64_t budget_bytes;      // 0: none; else the segment's pages after compaction
                              // (ceil(live / page_tokens) per class) must fit in it
  uint8_t n_ladder;           // classes on the ladder, dearest first (1: no demotion)
  uint8_t ladder[KVGC_CLASS_COUNT];
  double slope[KVGC_CLASS_COUNT];          // rung r: ladder[r] -> ladder[r + 1], r = n_ladder - 1: evicted
  // Destination slots per class, taken in order; a run from slot 0 is a fresh page which
  // the op zeroes whole before anything else, whether it takes its slots or not (a
  // recycled page must not show its previous owner's bytes, and an unused one stays in
  // the segment's page table until the results are applied).
  const AppendRun* demote_dst[KVGC_CLASS_COUNT];
  uint32_t n_demote_dst[KVGC_CLASS_COUNT];
  uint32_t promote;           // at most this many intermediate -> long-term
  uint8_t promote_age;
  bool retier;                // major GC: top retier_top survivors long-term, rest intermediate
  uint64_t retier_top;
  bool age_intermediate;
  // KVGC_PREFIX_CHARGE=prune: a token of a shared page (kv set) that the ladder demotes
  // keeps its slot and its page's precision, and its gen byte records the class it is
  // now charged at (charged_of): the decisions are an unshared segment's, the bytes the
  // shared page's. It takes no destination slot. Off: it moves to a private slot.
  bool charge_shared = false;
  uint16_t* page_live;        // out, [n_pages]: live slots per page after the op (host)
  // out, [n_pages], or null: per page, bit c set when a live slot counts at class c
  // (counted_class) after the op; 0 for a page with no live slot. The heap learns from
  // it which shared pages every holder counts below their precision (runtime/shrink.cpp).
  uint8_t* page_classes = nullptr;
  SelectResult* result;       // out (host)
  // Device executors: the heap's scratch (keys, sort buffers, decisions), reserved at
  // creation for the longest segment the arena can hold (Backend::gc_scratch_bytes).
  // Shared with attention: the two never run concurrently on one heap's stream.
  void* scratch = nullptr;
  size_t scratch_bytes = 0;
  // page_live and result are memory the device may write directly (the runtime's
  // result_alloc blocks: pinned, so mapped under unified addressing). A batch of such
  // ops then needs no copy per segment (the CUDA select_batch); otherwise each op's
  // results are copied back on their own.
  bool results_mapped = false;
};

// Moves `count` live slots (the highest) of src into the first holes (dead slots) of
// dst, K/V and metadata together; dst is fully used, so every dead slot is a hole.
struct CompactMove {
  uint8_t* dst;
  uint8_t* src;
  uint32_t count;
};

// A device executor runs the moves in parallel: move m pairs the holes and live slots
// that earlier moves into (out of) the same page left, exactly as the sequential loop,
// so a page may appear in several moves but never as both a destination and a source
// (the planner takes destinations from the front and sources from the back). Enqueued
// on the engine's stream; never synchronises.
struct CompactOp {
  PageLayout layout;
  const CompactMove* moves;  // applied in order (host array)
  uint32_t n_moves;
};

// Re-stores a shared page at a cheaper class (runtime/shrink.cpp): K and V of slots
// [0, used) of `src` (layout src_layout) into the same slots of `dst` (dst_layout),
// through the model dtype, as a demotion stores a token; every other byte of dst is
// zeroed (dst is a fresh page: scrubbing), header included (holders keep their own).
struct RequantPage {
  const uint8_t* src;
  uint8_t* dst;
  uint32_t used;
};
// Pages are independent (no page appears twice). Enqueued on the engine's stream; never
// synchronises.
struct RequantOp {
  PageLayout src_layout, dst_layout;
  const RequantPage* pages;  // host array
  uint32_t n_pages;
};

}  // namespace kvgc

namespace kvgc {

// Paged decode/prefill attention over a segment, with each slot's attention mass added
// to its score (and to its recent score, decayed first by recent_decay: the host passes
// the per-query decay to the power n_q). Queries are the segment's last n_q positions: query i has position
// q_pos0 + i and sees live slots with position <= its own (causal by position, so a
// prefill chunk attends to the cache and its own earlier tokens). GQA: q head j reads
// kv head j / (q_heads / kv_heads). Softmax in fp32; out in the model dtype.
//
// A batch: with n_seqs > 0 the op is many segments at once (one launch on a device):
// sequence i reads pages [seqs[i].first_page, + n_pages) of `pages` (their out_row
// relative to the sequence), and its queries are rows [q_row, q_row + n_q) of q and out;
// n_live, n_q, q_pos0 and recent_decay above are then unused. n_seqs == 0 is one segment,
// described by those fields (the per-sequence kvgc_attend). Each sequence's result is
// exactly what the op over that sequence alone computes.
struct AttendSeq {
  uint32_t first_page, n_pages;
  uint64_t n_live;       // rows over its pages (an upper bound on live slots)
  uint32_t q_row, n_q;
  int64_t q_pos0;        // position of its first query
  float recent_decay;    // the per-query decay raised to its scoring queries' count
  // Queries before this one attend without scores (kvgc_batch_plan_ex's scored rows:
  // n_q - score_from of them score); 0: all, as the op says. See attend_seq_ops.
  uint32_t score_from = 0;
  // Host executors: the sequence's pages where they already are (the segment's own
  // attention list, runtime/batch.cpp), instead of pages + first_page; null: there.
  const SegPage* host_pages = nullptr;
};

struct AttendOp {
  PageLayout layout[KVGC_CLASS_COUNT];
  const SegPage* pages;  // any order (the runtime passes INT4, INT8, then FP16 pages)
  uint32_t n_pages;
  uint64_t n_live;       // live slots over all pages
  const void* q;         // [n_q][q_heads][head_dim] model dtype
  uint32_t n_q, q_heads;
  int64_t q_pos0;
  float scale;           // softmax scale (> 0)
  void* out;             // [n_q][q_heads][head_dim] model dtype
  bool add_scores;       // accumulate mass into the slots' scores
  float recent_decay = 1.0f;  // with add_scores: recent = recent * recent_decay + mass
  void* scratch = nullptr;     // device executors: the heap's scratch (CPU: unused)
  size_t scratch_bytes = 0;
  const AttendSeq* seqs = nullptr;  // a batch (host array; pinned on device backends)
  uint32_t n_seqs = 0;
  // Device backends: `pages` and `seqs` already in device memory (uploaded by the batch's
  // plan); null: the executor ships them itself.
  const SegPage* dev_pages = nullptr;
  const AttendSeq* dev_seqs = nullptr;
  // Host executors, without scores: leave out the slots past the last query's position
  // (masked for every query anyway), so the op sees exactly the slots a per-sequence
  // call over these queries saw (attend_seq_ops' first part; the CPU's query blocks
  // and thread split depend on the slot count).
  bool trim_future = false;
  // With add_scores, a batch's mass goes here instead of to the scores (no score and no
  // recent score changes): mass_out[p * page_tokens + slot] += the mass of slot `slot`
  // of the op's page p (`pages`' order, kvgc_batch_export's); zeroed by the caller.
  // One-segment ops (attend_seq_op) point it at their first page's row.
  float* mass_out = nullptr;
};

// The one-segment op that sequence i of a batch amounts to (its pages, queries, rows).
inline AttendOp attend_seq_op(const AttendOp& op, uint32_t i) {
  const AttendSeq& s = op.seqs[i];
  const size_t row_bytes = size_t(op.q_heads) * op.layout[0].head_dim * dtype_bytes(op.layout[0].dtype);
  AttendOp one = op;
  one.pages = s.host_pages ? s.host_pages : op.pages + s.first_page;
  one.n_pages = s.n_pages;
  one.n_live = s.n_live;
  one.q = static_cast<const uint8_t*>(op.q) + size_t(s.q_row) * row_bytes;
  one.out = static_cast<uint8_t*>(op.out) + size_t(s.q_row) * row_bytes;
  one.n_q = s.n_q;
  one.q_pos0 = s.q_pos0;
  one.recent_decay = s.recent_decay;
  if (op.mass_out) one.mass_out = op.mass_out + size_t(s.first_page) * op.layout[0].page_tokens;
  one.seqs = nullptr;
  one.n_seqs = 0;
  one.dev_pages = nullptr;
  one.dev_seqs = nullptr;
  return one;
}

// The one-segment ops sequence i of a batch amounts to, in order, into out[0..return):
// one (attend_seq_op) unless it scores only its last queries (0 < score_from < n_q with
// the op's scores on); then two, exactly the per-sequence calls kvgc_batch_plan_ex
// promises: its first score_from queries without scores over the slots they can see
// (kvgc_attend with KVGC_ATTEND_NO_SCORES before the rest was appended), then the rest
// with scores and the sequence's decay. score_from >= n_q with scores: one op, unscored
// (the decay is 1: recent_decay^0).
inline uint32_t attend_seq_ops(const AttendOp& op, uint32_t i, AttendOp out[2]) {
  const AttendSeq& s = op.seqs[i];
  out[0] = attend_seq_op(op, i);
  if (!op.add_scores || s.score_from == 0) return 1;
  out[0].add_scores = false;
  if (s.score_from >= s.n_q) return 1;
  out[0].n_q = s.score_from;
  out[0].trim_future = true;
  const size_t row_bytes = size_t(op.q_heads) * op.layout[0].head_dim * dtype_bytes(op.layout[0].dtype);
  out[1] = attend_seq_op(op, i);
  out[1].q = static_cast<const uint8_t*>(out[1].q) + size_t(s.score_from) * row_bytes;
  out[1].out = static_cast<uint8_t*>(out[1].out) + size_t(s.score_from) * row_bytes;
  out[1].n_q = s.n_q - s.score_from;
  out[1].q_pos0 = s.q_pos0 + s.score_from;
  return 2;
}

}  // namespace kvgc
