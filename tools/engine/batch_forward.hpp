// One engine step over a batch of sequences sharing one kvgc heap: each sequence brings
// a decode row or a chunk of its prompt, every matmul runs once over all the step's rows
// (the weights are read once per step, not once per sequence), and the cache is reached
// through kvgc's batch calls: one kvgc_batch_plan_ex per step, kvgc_batch_append and
// kvgc_batch_attend per layer for the whole batch, one kvgc_batch_step at its end. Observe
// prefill chunks go through the plan too (unscored rows, GC deferred).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "engine/forward.hpp"
#include "kvgc.h"

namespace engine {

// One sequence's part of a step.
struct BatchItem {
  kvgc_seq seq = 0;
  const int32_t* tokens = nullptr;  // n tokens at positions position .. position + n - 1
  uint32_t n = 0;                   // >= 1
  uint64_t position = 0;            // the sequence's length before the step
  float* logits = nullptr;          // n_vocab logits of its last token, or null
  // A prompt chunk entering the cache SnapKV-style (Engine::PrefillMode::Observe): in the
  // plan like any row (kvgc_batch_plan_ex), but its rows add attention mass only when
  // `scores` (the observation window), and its GC is deferred (KVGC_BATCH_SEQ_DEFER_STEP):
  // the sequence is not stepped. BatchEngine::end_observe ends the prompt.
  bool observe = false;
  bool scores = false;
};

class BatchEngine {
 public:
  BatchEngine() = default;
  ~BatchEngine();
  BatchEngine(const BatchEngine&) = delete;
  BatchEngine& operator=(const BatchEngine&) = delete;

  // The heap (options as Engine::init: null means kvgc's defaults then KVGC_*), with no
  // sequence of its own, the batch object and the matmul threads.
  bool init(const Model& model, const kvgc_heap_options* options, std::string* err,
            EngineOptions engine_options = {});

  enum class Outcome : uint8_t {
    Ok,      // every item ran; logits written; every sequence's GC step done
    NoRoom,  // kvgc_batch_plan: the pages of item *failed (and later) do not fit
             // (KVGC_ENOMEM, or KVGC_EBUDGET past a tenant quota); nothing changed
    Failed,  // any other failure (*err says which call and why)
  };
  // One engine step over items (distinct live sequences of heap()).
  Outcome step(const std::vector<BatchItem>& items, uint32_t* failed, std::string* err);
  // The end of an observe prefill: scores pooled, then the sequence's kvgc_step evicts
  // to its budget.
  bool end_observe(kvgc_seq seq, std::string* err);

  kvgc_heap* heap() const { return engine_.heap(); }
  const kvgc_model_desc& kv_model() const { return engine_.kv_model(); }
  const Engine& engine() const { return engine_; }
  // Rows (tokens) run by all steps so far.
  uint64_t rows_run() const { return rows_run_; }

 private:
  Engine engine_;  // weights, matmul threads, scratch; its layer stack serves both
  kvgc_batch* batch_ = nullptr;
  std::vector<kvgc_seq> seqs_;
  std::vector<uint32_t> n_new_, scored_, flags_, last_rows_, first_row_;
  std::vector<int32_t> tokens_;
  std::vector<uint64_t> positions_;
  std::vector<float> logits_;  // [items with logits][n_vocab]
  uint64_t rows_run_ = 0;
};

}  // namespace engine
