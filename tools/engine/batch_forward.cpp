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
  tokens_.clear();
  positions_.clear();
  last_rows_.clear();
  for (const BatchItem& item : items) {
    if (item.n == 0 || item.tokens == nullptr) {
      if (err) *err = "BatchEngine::step: an item brings no tokens (n == 0 or tokens null)";
      return Outcome::Failed;
    }
    seqs_.push_back(item.seq);
    n_new_.push_back(item.n);
    for (uint32_t t = 0; t < item.n; ++t) {
      tokens_.push_back(item.tokens[t]);
      positions_.push_back(item.position + t);
    }
    if (item.logits != nullptr) last_rows_.push_back(uint32_t(tokens_.size() - 1));
  }
  using Clock = std::chrono::steady_clock;
  const auto plan_start = Clock::now();
  uint32_t failed_index = 0;
  const kvgc_status planned = kvgc_batch_plan(batch_, seqs_.data(), n_new_.data(),
                                              uint32_t(seqs_.size()), &failed_index, nullptr);
  engine_.add_kvgc_seconds(std::chrono::duration<double>(Clock::now() - plan_start).count());
  if (planned == KVGC_ENOMEM || (planned == KVGC_EBUDGET && failed_index < seqs_.size())) {
    if (failed) *failed = failed_index;
    return Outcome::NoRoom;
  }
  if (engine_.kvgc_failed(planned, "kvgc_batch_plan", err)) return Outcome::Failed;
  if (items.empty()) return Outcome::Ok;

  kvgc_attend_params params;
  kvgc_attend_params_init(&params);  // every row scores: decode rows and prompt chunks alike
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
  if (stepped != KVGC_EBUDGET && engine_.kvgc_failed(stepped, "kvgc_batch_step", err))
    return Outcome::Failed;
  return Outcome::Ok;
}

}  // namespace engine
