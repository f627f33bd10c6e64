#include "engine/batch_forward.hpp"

#include <chrono>
#include <cstring>

namespace engine {

BatchEngine::~BatchEngine() { kvgc_batch_destroy(batch_); }  // before engine_'s heap

bool BatchEngine::init(const Model& model, const kvgc_heap_options* options, std::string* err,
                       EngineOptions engine_options) {
  engine_options.own_sequence = false;
  if (!engine_.init(model, options, err, engine_options)) return false;
  return !engine_.kvgc_failed(kvgc_batch_create(engine_.heap(), &batch_), "kvgc_batch_create",
                              err);
}

BatchEngine::Outcome BatchEngine::step(const std::vector<BatchItem>& items, uint32_t* failed,
                                       std::string* err) {
  seqs_.clear();
  n_new_.clear();
  scored_.clear();
  flags_.clear();
  tokens_.clear();
  positions_.clear();
  last_rows_.clear();
  first_row_.assign(items.size(), 0);
  // Rows in the items' order, which is kvgc's batch order. An observe item (a prompt
  // entering SnapKV-style) is planned like the rest, with its rows unscored unless they
  // are the observation window and its GC deferred to the prompt's end (end_observe):
  // exactly the per-sequence kvgc_append, kvgc_attend (KVGC_ATTEND_NO_SCORES) and no
  // kvgc_step of Engine::prefill (kvgc_batch_plan_ex).
  bool observing = false;
  for (uint32_t i = 0; i < items.size(); ++i) {
    const BatchItem& item = items[i];
    if (item.n == 0 || item.tokens == nullptr) {
      if (err) *err = "BatchEngine::step: item " + std::to_string(i) +
                      " brings no tokens (n == 0 or tokens null)";
      return Outcome::Failed;
    }
    seqs_.push_back(item.seq);
    n_new_.push_back(item.n);
    scored_.push_back(item.observe && !item.scores ? 0 : item.n);
    flags_.push_back(item.observe ? KVGC_BATCH_SEQ_DEFER_STEP : 0);
    observing |= item.observe;
    first_row_[i] = uint32_t(tokens_.size());
    for (uint32_t t = 0; t < item.n; ++t) {
      tokens_.push_back(item.tokens[t]);
      positions_.push_back(item.position + t);
    }
  }
  using Clock = std::chrono::steady_clock;
  const auto plan_start = Clock::now();
  uint32_t failed_plan = 0;
  kvgc_batch_plan_options plan_options;
  kvgc_batch_plan_options_init(&plan_options);
  plan_options.scored_rows = scored_.data();
  plan_options.seq_flags = flags_.data();
  const kvgc_status planned =
      kvgc_batch_plan_ex(batch_, seqs_.data(), n_new_.data(), uint32_t(seqs_.size()),
                         observing ? &plan_options : nullptr, &failed_plan, nullptr);
  engine_.add_kvgc_seconds(std::chrono::duration<double>(Clock::now() - plan_start).count());
  if (planned == KVGC_ENOMEM || (planned == KVGC_EBUDGET && failed_plan < seqs_.size())) {
    if (failed) *failed = failed_plan;  // batch order is the items' order
    return Outcome::NoRoom;
  }
  if (engine_.kvgc_failed(planned, "kvgc_batch_plan_ex", err)) return Outcome::Failed;
  if (items.empty()) return Outcome::Ok;

  kvgc_attend_params params;  // every row scores but those the plan said not to
  kvgc_attend_params_init(&params);
  const Engine::Attention attention = [&](uint32_t layer, const void* q, const void* k,
                                          const void* v, void* out, std::string* e) {
    return !engine_.kvgc_failed(kvgc_batch_append(batch_, layer, k, v, nullptr),
                                "kvgc_batch_append", e) &&
           !engine_.kvgc_failed(kvgc_batch_attend(batch_, layer, q, out, &params, nullptr),
                                "kvgc_batch_attend", e);
  };
  if (!engine_.run_rows(tokens_.data(), positions_.data(), uint32_t(tokens_.size()), attention,
                        err))
    return Outcome::Failed;
  rows_run_ += tokens_.size();
  // The logits of every sequence that asked, in one matmul over their last rows.
  for (uint32_t i = 0; i < items.size(); ++i)
    if (items[i].logits != nullptr) last_rows_.push_back(first_row_[i] + items[i].n - 1);
  if (!last_rows_.empty()) {
    const size_t n_vocab = engine_.model().config.n_vocab;
    logits_.resize(last_rows_.size() * n_vocab);
    if (!engine_.project_rows(last_rows_.data(), uint32_t(last_rows_.size()), logits_.data(),
                              err))
      return Outcome::Failed;
    size_t next = 0;
    for (const BatchItem& item : items) {
      if (item.logits == nullptr) continue;
      std::memcpy(item.logits, &logits_[next++ * n_vocab], n_vocab * sizeof(float));
    }
  }
  const auto step_start = Clock::now();
  const kvgc_status stepped = kvgc_batch_step(batch_, nullptr);
  engine_.add_kvgc_seconds(std::chrono::duration<double>(Clock::now() - step_start).count());
  // Every sequence's GC but the observe items' (deferred: KVGC_BATCH_SEQ_DEFER_STEP).
  if (stepped != KVGC_EBUDGET && engine_.kvgc_failed(stepped, "kvgc_batch_step", err))
    return Outcome::Failed;
  return Outcome::Ok;
}

bool BatchEngine::end_observe(kvgc_seq seq, std::string* err) {
  if (!engine_.end_observe_scores(seq, 0, err)) return false;
  const kvgc_status s = kvgc_step(engine_.heap(), seq, nullptr);
  return s == KVGC_EBUDGET || !engine_.kvgc_failed(s, "kvgc_step", err);
}

}  // namespace engine
