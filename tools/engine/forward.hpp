// The llama forward pass over a kvgc-managed KV cache: every K/V byte lives in a kvgc
// heap, and attention is kvgc_attend over it, so the cache policy (full, generational,
// h2o, ...) decides what each step attends to.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "engine/model.hpp"
#include "kvgc.h"

namespace engine {

class Engine {
 public:
  // Tokens per prefill chunk: each layer appends the chunk's K/V, then attends with
  // n_q = chunk, so the matmuls are GEMMs.
  static constexpr uint32_t kChunkTokens = 64;

  Engine() = default;
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Creates the heap and one sequence for `model` (which must outlive the engine).
  // options == nullptr: kvgc's defaults, then the KVGC_* environment variables.
  bool init(const Model& model, const kvgc_heap_options* options, std::string* err);

  // How a prompt enters the cache (see prefill()).
  enum class PrefillMode : uint8_t {
    // SnapKV-style (default): the whole prompt is cached first; only its last
    // kObserveTokens queries (the question, in a chat prompt) add attention mass to the
    // scores, each score is then max-pooled over kPoolRadius positions either side, and
    // one kvgc_step at the prompt's end evicts down to the budget. What the end of the
    // prompt attends to survives. The KV cache peaks at the prompt's length.
    Observe,
    // kvgc_step after every chunk, every query scores: the cache stays within its
    // budget during prefill, but eviction runs before the question is read, so a fact
    // the question will need looks like filler (bench/quality's passkey shows it).
    Stream,
  };
  static constexpr uint32_t kObserveTokens = 32;
  static constexpr uint32_t kPoolRadius = 3;

  // Per-call choices of forward().
  struct Pass {
    bool step = true;             // kvgc_step after each chunk
    uint32_t scored_from = 0;     // tokens before this index attend with NO_SCORES
    float* all_logits = nullptr;  // [n_tokens][n_vocab]: logits at every position
  };

  // Runs `n_tokens` tokens at the next positions, kChunkTokens at a time. If `logits` is
  // not null it receives the last token's n_vocab logits. False with *err when kvgc
  // fails (KVGC_EBUDGET is advisory: ignored).
  bool forward(const int32_t* tokens, uint32_t n_tokens, float* logits, std::string* err,
               const Pass& pass);
  bool forward(const int32_t* tokens, uint32_t n_tokens, float* logits, std::string* err) {
    return forward(tokens, n_tokens, logits, err, Pass{});
  }

  // Runs a prompt under `mode`; `progress(done)` after each chunk when given.
  bool prefill(const int32_t* tokens, uint32_t n_tokens, float* logits, std::string* err,
               PrefillMode mode = PrefillMode::Observe,
               const std::function<void(uint32_t done)>& progress = {});

  uint64_t position() const { return position_; }
  kvgc_heap* heap() const { return heap_; }
  kvgc_seq sequence() const { return seq_; }
  const kvgc_model_desc& kv_model() const { return kv_model_; }
  // Wall time spent inside kvgc calls so far.
  double kvgc_seconds() const { return kvgc_seconds_; }

 private:
  bool run_chunk(const int32_t* tokens, uint32_t n, bool scores, std::string* err);
  bool step(std::string* err);  // kvgc_step; KVGC_EBUDGET is advisory
  bool pool_scores(std::string* err);
  // Final norm + output projection of chunk row `row` into logits[n_vocab].
  void project(uint32_t row, float* logits);
  bool kvgc_failed(kvgc_status status, const char* call, std::string* err) const;
  void apply_rope(float* x, uint32_t n, uint32_t n_heads) const;

  const Model* model_ = nullptr;
  kvgc_model_desc kv_model_{};
  kvgc_heap* heap_ = nullptr;
  kvgc_seq seq_ = 0;
  uint64_t position_ = 0;
  double kvgc_seconds_ = 0.0;
  std::vector<float> inv_freq_;  // RoPE: base^(-2i/head_dim)
  // Scratch for one chunk, [kChunkTokens][width].
  std::vector<float> x_, xb_, q_, k_, v_, att_, proj_, gate_, up_;
  // Score pooling scratch, one segment's live tokens.
  std::vector<float> pool_score_, pool_delta_;
  std::vector<int32_t> pool_pos_;
  std::vector<uint32_t> pool_order_;
};

// out[n][rows] = x[n][cols] * W^T for W [rows][cols]: GEMV for one token, else GEMM.
void matmul(const float* x, const float* w, float* out, uint32_t n, uint32_t cols,
            uint32_t rows);

// Index of the largest of n logits (greedy decoding; the first on ties).
int32_t argmax(const float* logits, uint32_t n);

// log softmax(logits)[target] over n logits, through a stable log-sum-exp.
double log_prob(const float* logits, uint32_t n, int32_t target);

// out = x / sqrt(mean(x^2) + eps) * weight, over `width` values.
void rms_norm(const float* x, const float* weight, float* out, uint32_t width, float eps);

}  // namespace engine
