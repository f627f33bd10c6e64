// Continuous batching over one kvgc heap (vLLM's scheduler, on the batch engine): every
// engine step, requests whose projected pages fit join (their prompts prefilled in
// chunks, in the same step as the others' decode rows), finished ones leave
// (kvgc_seq_destroy), and when kvgc_batch_plan finds no room the most recently admitted
// sequence of the batch is preempted: destroyed and queued again at the front, to be
// recomputed (prompt and the tokens generated so far) when it is admitted again.
// With ServeOptions::prefix_cache (observe prefill), a sequence first attaches the longest
// cached prefix of its context (kvgc_prefix_attach) and prefills only the rest, and keeps
// its prompt for later requests (kvgc_prefix_keep) once the prompt is in.
#pragma once

#include <algorithm>
#include <cstdint>
#include <deque>
#include <functional>
#include <string>
#include <vector>

#include "engine/batch_forward.hpp"

namespace engine {

struct ServeRequest {
  uint64_t id = 0;
  std::vector<int32_t> prompt;
  uint32_t max_new = 0;       // tokens to generate at most (>= 1)
  bool stop_at_eos = true;    // end at a stop token (ServeOptions::stop)
  double arrival = 0;         // seconds on the caller's clock
  // Filled in by the server.
  std::vector<int32_t> output;  // generated tokens, without the stop token that ended them
  double admitted = -1;       // first admission
  double first_token = -1;
  double finished = -1;
  uint32_t preemptions = 0;
  uint64_t attached = 0;      // prompt tokens attached from the prefix cache, last admission
  bool done = false;
  std::string error;          // set when the request can never run (done, no output)
};

struct ServeOptions {
  uint32_t chunk_tokens = Engine::kChunkTokens;  // prompt tokens a sequence brings per step
  uint32_t max_step_tokens = 256;  // rows per step: decode rows first, then prompt chunks
  uint32_t max_running = 256;      // sequences in the heap at most
  // Sequences admitted while others are still in their prompt: at most this many in
  // their prompt at once (0: no limit). An observe prefill holds its whole prompt until
  // its end, so prompts entering side by side hold several whole prompts; one at a time
  // (with a chunk as large as the step) each is in and pruned sooner, and the room goes
  // to decoding sequences (vLLM's max_num_partial_prefills).
  uint32_t max_prefilling = 0;
  // How prompts enter the cache. Stream (default): every chunk is a batch row like any
  // other, scoring, and the GC runs each step. Observe: SnapKV-style as Engine::prefill's
  // default (BatchItem::observe): unscored chunks but the last Engine::kObserveTokens,
  // no GC until the prompt's end, then pooled scores and one kvgc_step; the prompt is
  // held whole meanwhile.
  Engine::PrefillMode prefill = Engine::PrefillMode::Stream;
  // The bytes a sequence of `tokens` tokens is expected to hold under the heap's policy
  // (`prefilling`: while its prompt enters the cache): a request is admitted only while
  // the running sequences' (recomputed as their outputs grow) and its own fit the arena
  // with a page (all layers) of headroom per running sequence. With prefix_cache, the first
  // `cached` of them are pages the cache pays for (below): the sequence holds the rest.
  // Default: every page of the rest (the full cache).
  std::function<uint64_t(uint64_t tokens, uint64_t cached, bool prefilling)> footprint;
  std::vector<int32_t> stop;       // token ids that end an answer
  // The prefix cache (kvgc 0.7; observe prefill only: submit refuses it with a stream
  // prefill, whose GC ranks the prompt before it is in). On admission a sequence attaches
  // the longest cached prefix of its context (at most all but its last token, which runs
  // for the logits) and prefills the rest; when its prompt is in (before end_observe's
  // GC), it keeps what others can use (kvgc_prefix_keep; KVGC_EINVAL / KVGC_ENOMEM /
  // KVGC_EBUDGET are counted and ignored):
  //  - under the full policy, its whole prompt (its pages are held whole anyway);
  //  - under a pruning policy, the whole pages it shares with another prompt seen
  //    (waiting, or among the last kSeenPrompts admitted), when more than it attached:
  //    a prompt's own part stays its own, for its GC to prune and free (kept, the cache
  //    would hold every page its GC prunes).
  // Admission then counts, per sequence, footprint() of its context with the pages the
  // cache pays for (attached whole pages under KVGC_PREFIX_CHARGE=cache or the full
  // policy; its kept pages under the full policy) and a header page per shared page it
  // holds in each layer (kvgc_stats.cls_header.page_bytes), plus once the shared pages
  // the running sequences hold (kvgc_stats: shared_bytes - cached_only_bytes, read after
  // each attach), plus a page of headroom per running sequence. Cached pages no running
  // sequence holds count as free: the heap evicts them, least recently used first, before
  // an append or a plan runs short (vLLM's rule). Since kvgc 0.12 a head is also admitted
  // only when the heap's own room (Server::heap_room: its free bytes and cached-only pages,
  // less what prompts in progress will still take) holds its footprint: the projection
  // alone admitted heads the arena could not hold, and preempted them at their next plan.
  bool prefix_cache = false;
  uint64_t prefix_salt = 0;        // kvgc_prefix_keep/attach's salt (0: the tenant's own)
};

// What the server did so far.
struct ServeStats {
  uint64_t steps = 0;
  uint64_t prompt_tokens = 0;     // prompt rows run (recomputation included)
  uint64_t decode_rows = 0;
  uint64_t generated_tokens = 0;
  uint64_t preemptions = 0;
  uint32_t max_running = 0;       // sequences in one step at most
  uint32_t max_in_prompt = 0;     // ... of them still in their prompt
  double running_sum = 0;         // sum over steps of the sequences in the step
  // The prefix cache (ServeOptions::prefix_cache), counted at admission.
  uint64_t prefix_lookups = 0;    // admissions that looked the context up
  uint64_t prefix_hits = 0;       // ... that attached at least one token
  uint64_t prefix_tokens_attached = 0;  // = prompt rows skipped (not prefilled)
  uint64_t prefix_keeps = 0;      // prompts kept (kvgc_prefix_keep KVGC_OK)
  uint64_t prefix_keep_failed = 0;  // keeps refused (KVGC_EINVAL, _ENOMEM, _EBUDGET): ignored
  // What bounds concurrency: the admissions that waited for room (the queue's head had
  // arrived and did not fit), and at each, the projected bytes of the running sequences
  // still in their prompt and of those decoding, and the head's own need, summed.
  uint64_t waits_for_room = 0;
  double wait_prefill_bytes = 0, wait_decode_bytes = 0, wait_head_bytes = 0;
  // The same over the steps at which an arrived request waited in the queue: what the
  // arena sustains under load, without the stream's start and drain (where fewer
  // requests remain than the arena could run).
  uint64_t loaded_steps = 0;
  double loaded_running_sum = 0;
  double mean_running() const { return steps ? running_sum / double(steps) : 0.0; }
  double mean_running_loaded() const {
    return loaded_steps ? loaded_running_sum / double(loaded_steps) : 0.0;
  }
};

class Server {
 public:
  // `engine` must outlive the server; its heap must hold no other sequences.
  Server(BatchEngine* engine, ServeOptions options);
  ~Server();  // destroys the sequences still running
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // Queues a request (FIFO). The request must stay alive until it is done. False with
  // *err when it is malformed (an empty prompt, max_new 0), or when the options are
  // (prefix_cache with a stream prefill).
  bool submit(ServeRequest* request, std::string* err);
  // One engine step at time `now`: admit, plan (preempting until it fits), run, sample
  // greedily, retire the finished. False with *err when the engine fails.
  bool step(double now, std::string* err);
  bool idle() const { return waiting_.empty() && running_.empty(); }
  size_t running() const { return running_.size(); }
  size_t waiting() const { return waiting_.size(); }
  const ServeStats& stats() const { return stats_; }

 private:
  struct Running {
    ServeRequest* request;
    kvgc_seq seq;
    std::vector<int32_t> context;  // prompt, then what was generated before a preemption
    size_t done = 0;               // context tokens in the cache
    size_t prompt_end = 0;         // context.size() at admission: what prefill runs
    uint64_t footprint = 0;        // projected bytes now (of the tokens it holds itself)
    size_t attached = 0;           // context tokens attached from the prefix cache
    size_t kept = 0;               // tokens of its context it kept in the prefix cache
  };
  static constexpr size_t kSeenPrompts = 64;
  bool admit(double now, std::string* err);
  void preempt(size_t index);      // running_[index] back to the front of the queue
  void finish(size_t index, double now);
  uint64_t footprint(uint64_t tokens, uint64_t cached, bool prefilling) const;
  // Its footprint with `tokens` of its context in the cache (default: all of it and the
  // next token).
  uint64_t own_footprint(const Running& r, bool prefilling, size_t tokens = SIZE_MAX) const;
  // The heap's own count of the room left, beside the projection: its free bytes (free
  // slabs and every class's free pages, which evacuation moves to where they are needed)
  // and the cached pages no sequence holds, less what the running sequences still in their
  // prompt will take before its end. The projection counts what each sequence will hold
  // once pruned; this is what the arena can take now, so that a head admitted into the
  // gap between the two is not preempted at its next plan, again and again.
  // `s`: a heap_stats() snapshot (null: none could be read; the projection decides).
  uint64_t heap_room(const kvgc_stats* s) const;
  // What a finished prompt keeps in the prefix cache (see ServeOptions::prefix_cache).
  size_t tokens_to_keep(const Running& r) const;
  size_t in_prompt() const;        // running sequences still in their prompt
  // Bytes of the shared pages the running sequences hold, each page once (0 without `s`).
  uint64_t cache_held(const kvgc_stats* s) const;
  // One read of the heap's counts for an admission check (it settles pending GCs, so it
  // is read once, not per use): `*out`, or null when it cannot be read.
  const kvgc_stats* heap_stats(kvgc_stats* out) const;

  BatchEngine* engine_;
  ServeOptions options_;
  uint64_t arena_bytes_ = 0;
  std::string config_error_;       // options submit refuses
  uint32_t page_tokens_ = 0;
  uint64_t header_bytes_ = 0;      // a shared page's header page (kvgc_stats.cls_header)
  uint64_t page_bytes_ = 0;        // one fp16 page in every layer: admission's headroom unit
  bool whole_attached_ = false;    // attached whole pages are never the sequence's bytes
  bool whole_kept_ = false;        // nor its own kept pages (the full policy: no GC)
  uint64_t projected_ = 0;         // footprints of the running sequences
  std::deque<ServeRequest*> waiting_;
  // The last kSeenPrompts admitted prompts (the pointer only tells a prompt from itself).
  std::deque<std::pair<const ServeRequest*, std::vector<int32_t>>> seen_;
  std::vector<Running> running_;   // in admission order
  ServeStats stats_;
  std::vector<BatchItem> items_;
  std::vector<size_t> item_of_;    // running_ index of each item
  std::vector<bool> wants_logits_; // the item ends its context: sample its next token
  std::vector<bool> decode_row_;   // the item feeds the last generated token
  std::vector<float> logits_;
};

}  // namespace engine
