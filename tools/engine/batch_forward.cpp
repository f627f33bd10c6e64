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
  order_.clear();
  dropped_.clear();
  first_row_.assign(items.size(), 0);
  // Rows: the planned items first (kvgc's batch order), then the observe items.
  for (int observe = 0; observe < 2; ++observe) {
    for (uint32_t i = 0; i < items.size(); ++i) {
      const BatchItem& item = items[i];
      if (item.observe != bool(observe)) continue;
      if (item.n == 0 || item.tokens == nullptr) {
        if (err) *err = "BatchEngine::step: item " + std::to_string(i) +
                        " brings no tokens (n == 0 or tokens null)";
        return Outcome::Failed;
      }
      if (!observe) {
        seqs_.push_back(item.seq);
        n_new_.push_back(item.n);
      }
      order_.push_back(i);
      first_row_[i] = uint32_t(tokens_.size());
      for (uint32_t t = 0; t < item.n; ++t) {
        tokens_.push_back(item.tokens[t]);
        positions_.push_back(item.position + t);
      }
    }
  }
  using Clock = std::chrono::steady_clock;
  const auto plan_start = Clock::now();
  uint32_t failed_plan = 0;
  const kvgc_status planned = kvgc_batch_plan(batch_, seqs_.data(), n_new_.data(),
                                              uint32_t(seqs_.size()), &failed_plan, nullptr);
  engine_.add_kvgc_seconds(std::chrono::duration<double>(Clock::now() - plan_start).count());
  if (planned == KVGC_ENOMEM || (planned == KVGC_EBUDGET && failed_plan < seqs_.size())) {
    if (failed) *failed = order_[failed_plan];  // as an index into items
    return Outcome::NoRoom;
  }
  if (engine_.kvgc_failed(planned, "kvgc_batch_plan", err)) return Outcome::Failed;
  if (items.empty()) return Outcome::Ok;

  const kvgc_model_desc& m = engine_.kv_model();
  const size_t dtype_bytes = m.dtype == KVGC_DTYPE_F32 ? 4 : 2;
  const size_t kv_row = size_t(m.n_kv_heads) * m.head_dim * dtype_bytes;
  const size_t q_row = size_t(m.n_q_heads) * m.head_dim * dtype_bytes;
  std::vector<bool> lost(items.size(), false);
  kvgc_attend_params params;  // planned rows: every one scores (one params per call)
  kvgc_attend_params_init(&params);
  kvgc_attend_params unscored = params;
  unscored.flags |= KVGC_ATTEND_NO_SCORES;
  const Engine::Attention attention = [&](uint32_t layer, const void* q, const void* k,
                                          const void* v, void* out, std::string* e) {
    if (!seqs_.empty() &&
        (engine_.kvgc_failed(kvgc_batch_append(batch_, layer, k, v, nullptr),
                             "kvgc_batch_append", e) ||
         engine_.kvgc_failed(kvgc_batch_attend(batch_, layer, q, out, &params, nullptr),
                             "kvgc_batch_attend", e)))
      return false;
    for (const uint32_t i : order_) {
      const BatchItem& item = items[i];
      if (!item.observe) continue;
      const size_t r = first_row_[i];
      char* item_out = static_cast<char*>(out) + r * q_row;
      if (lost[i]) {
        std::memset(item_out, 0, item.n * q_row);
        continue;
      }
      const kvgc_status appended = kvgc_append(
          engine_.heap(), item.seq, layer, static_cast<const char*>(k) + r * kv_row,
          static_cast<const char*>(v) + r * kv_row, item.n, nullptr);
      if (appended == KVGC_ENOMEM) {  // no room: this sequence is dropped after the step
        lost[i] = true;
        std::memset(item_out, 0, item.n * q_row);
        continue;
      }
      if (engine_.kvgc_failed(appended, "kvgc_append", e) ||
          engine_.kvgc_failed(kvgc_attend(engine_.heap(), item.seq, layer,
                                          static_cast<const char*>(q) + r * q_row, item.n,
                                          item_out, item.scores ? &params : &unscored, nullptr),
                              "kvgc_attend", e))
        return false;
    }
    return true;
  };
  if (!engine_.run_rows(tokens_.data(), positions_.data(), uint32_t(tokens_.size()), attention,
                        err))
    return Outcome::Failed;
  rows_run_ += tokens_.size();
  for (uint32_t i = 0; i < items.size(); ++i)
    if (lost[i]) dropped_.push_back(i);
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
  if (stepped != KVGC_EBUDGET && engine_.kvgc_failed(stepped, "kvgc_batch_step", err))
    return Outcome::Failed;
  return Outcome::Ok;
}

bool BatchEngine::end_observe(kvgc_seq seq, std::string* err) {
  if (!engine_.pool_scores(seq, err)) return false;
  const kvgc_status s = kvgc_step(engine_.heap(), seq, nullptr);
  return s == KVGC_EBUDGET || !engine_.kvgc_failed(s, "kvgc_step", err);
}

}  // namespace engine
