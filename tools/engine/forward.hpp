// The llama forward pass over a kvgc-managed KV cache: every K/V byte lives in a kvgc
// heap, and attention is kvgc_attend over it, so the cache policy (full, generational,
// h2o, ...) decides what each step attends to. The matmuls multiply the weights in their
// file types (matmul.hpp) on the engine's own threads.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "engine/matmul.hpp"
#include "engine/model.hpp"
#include "engine/thread_pool.hpp"
#include "kvgc.h"

namespace engine {

// The observe prefill's default pooling radius (EngineOptions::pool_radius). 5 since
// 0.10.1 (3 before): SmolLM2 writes a number a digit a token, and a 5-digit key whose
// first digit the question attends to needs 4 neighbours on one side; at 2.5% of a
// 4K-token prompt's bytes 3 kept "7143" of "71432" (docs/QUALITY.md, "Pooling radius").
inline constexpr uint32_t kDefaultPoolRadius = 5;
inline constexpr uint32_t kMaxPoolRadius = 4096;

// The engine's own choices (the cache's come from kvgc_heap_options and KVGC_*).
struct EngineOptions {
  // The kvgc model dtype: K, V and Q go to kvgc in it, attention comes back in it. F16
  // (the default, what llama.cpp and vLLM keep) or F32.
  kvgc_dtype kv_dtype = KVGC_DTYPE_F16;
  // Matmul threads, the calling thread included; 0: default_threads().
  uint32_t threads = 0;
  MatmulMode matmul = MatmulMode::Quantized;
  // Whether init() creates the engine's own sequence (forward(), prefill()). False for a
  // caller that keeps many sequences in the heap and runs them through run_rows() (the
  // batch engine, batch_forward.hpp).
  bool own_sequence = true;
  // The observe prefill's score pooling: each token's score becomes the largest within
  // this many positions either side (SnapKV's clustering), so a kept fact keeps its
  // neighbours; 0 pools nothing. It must span what the question needs whole: a number
  // whose digits are tokens of their own needs its length less one.
  uint32_t pool_radius = kDefaultPoolRadius;
  // A query-agnostic prior on the observe prefill's scores (0: off): each prefilled
  // token gets its key's diversity, 1 - cosine to the mean direction of its KV head's
  // prefilled keys, summed over KV heads (KeyDiff's signal), scaled so that a layer's
  // prior totals key_prior times the mass the observed queries paid. For prompts whose
  // question comes after the compressed part: their last queries ask nothing.
  float key_prior = 0.0f;
  // The reconstruction signal (0: off), for a prompt a later question will ask about
  // (issue 45; KVzip's signal, through kvgc's own attention): after an observe prefill's
  // chunks the engine forks the sequence, has the model read the prompt again,
  // reconstruct_chunk tokens a fork, each after reconstruct_prompt ("repeat the text
  // above"), with scores on, and gives every prompt token past the sinks the attention
  // mass the repeat paid it, scaled so that a layer's total is `reconstruct` times the
  // mass the observed queries paid (as key_prior). A token the model must look up to
  // repeat the text (a random key) gets more than one it can predict. Costs about a
  // second prefill of the prompt; the fork's pages go back before the prefill's GC.
  float reconstruct = 0.0f;
  std::vector<int32_t> reconstruct_prompt;  // token ids before each repeated chunk
  uint32_t reconstruct_chunk = 512;         // prompt tokens a fork repeats, >= 1
  uint32_t reconstruct_rows = 1;            // queries a mass observation sums, >= 1
  // Every layer ranks by the mean of the layers' shares of the signal, so a token the
  // repeat needed in some layers is kept in all (false: each layer by its own share). A
  // layer's budget is its own, and a key the layers that copy it need is often far down
  // the others' ranks (kvgc-bench-quality's kinds-after: QUALITY.md).
  bool reconstruct_across_layers = true;
  // The signal each token gets from a fork's repeat. false: the mass kvgc_attend fused
  // into the fork's scores (summed over a query's heads), a token's peak over the queries
  // less its mean. true: each query head's own probabilities, computed by the engine from
  // the fork's keys (kvgc_read: what kvgc_attend reads), a token's largest over the
  // queries and the layer's heads (KVzip's signal): a copy target one head looks up
  // is not outweighed by what several heads glance at. Holds every layer's keys in f32
  // while a fork's repeat runs (4 x layers x KV width bytes a token: 23 MB at 1K tokens
  // of SmolLM2-135M); about 1.4x the fused mass's time (QUALITY.md, kinds-after).
  bool reconstruct_head_peak = false;
};

// The text kvgc-run, kvgc-serve and kvgc-bench-quality put before each repeated chunk.
inline constexpr const char* kReconstructPrompt = "\n\nRepeat the text above exactly.\n\n";

// The thread count of engines whose options say 0: 1 unless set. (A process running
// several engines side by side gives each one thread; kvgc-run passes --threads.)
void set_default_threads(uint32_t threads);
uint32_t default_threads();

class Engine {
 public:
  // Tokens per prefill chunk: each layer appends the chunk's K/V, then attends with
  // n_q = chunk, and every weight block a matmul loads serves the whole chunk.
  static constexpr uint32_t kChunkTokens = 64;

  Engine() = default;
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Creates the heap and one sequence for `model` (which must outlive the engine), and
  // the matmul threads. options == nullptr: kvgc's defaults, then the KVGC_* environment
  // variables. False with *err if kvgc refuses (or the dtype is not F16 or F32).
  bool init(const Model& model, const kvgc_heap_options* options, std::string* err,
            const EngineOptions& engine_options = {});

  // How a prompt enters the cache (see prefill()).
  enum class PrefillMode : uint8_t {
    // SnapKV-style (default): the whole prompt is cached first; only its last
    // kObserveTokens queries (the question, in a chat prompt) add attention mass to the
    // scores, each score is then max-pooled over pool_radius positions either side, and
    // one kvgc_step at the prompt's end evicts down to the budget. What the end of the
    // prompt attends to survives. The KV cache peaks at the prompt's length.
    Observe,
    // kvgc_step after every chunk, every query scores: the cache stays within its
    // budget during prefill, but eviction runs before the question is read, so a fact
    // the question will need looks like filler (bench/quality's passkey shows it).
    Stream,
  };
  static constexpr uint32_t kObserveTokens = 32;

  // Per-call choices of forward().
  struct Pass {
    bool step = true;             // kvgc_step after each chunk
    uint32_t scored_from = 0;     // tokens before this index attend with NO_SCORES
    float* all_logits = nullptr;  // [n_tokens][n_vocab]: logits at every position
  };

  // Runs `n_tokens` tokens at the next positions, kChunkTokens at a time. If `logits` is
  // not null it receives the last token's n_vocab logits. False with *err when kvgc
  // fails (KVGC_EBUDGET is advisory: ignored), a token is outside the vocabulary, or a
  // logit it computes is NaN or infinite (a broken or overflowing model).
  bool forward(const int32_t* tokens, uint32_t n_tokens, float* logits, std::string* err,
               const Pass& pass);
  bool forward(const int32_t* tokens, uint32_t n_tokens, float* logits, std::string* err) {
    return forward(tokens, n_tokens, logits, err, Pass{});
  }

  // Runs a prompt under `mode`; `progress(done)` after each chunk when given.
  bool prefill(const int32_t* tokens, uint32_t n_tokens, float* logits, std::string* err,
               PrefillMode mode = PrefillMode::Observe,
               const std::function<void(uint32_t done)>& progress = {});

  // The layer stack over n rows that may belong to different sequences: row t is token
  // tokens[t] at position positions[t]. Each layer's attention goes through `attention`,
  // which receives the rows' q, k, v and fills out ([n][heads][head_dim], the kvgc model
  // dtype), so it decides which cache each row meets. The rows' final hidden states stay
  // for project_rows(). What forward() runs per chunk, and the batch engine per step.
  using Attention = std::function<bool(uint32_t layer, const void* q, const void* k,
                                       const void* v, void* out, std::string* err)>;
  bool run_rows(const int32_t* tokens, const uint64_t* positions, uint32_t n,
                const Attention& attention, std::string* err);
  // Final norm + output projection of the given rows of the last run_rows() into
  // logits[n][n_vocab]; false if a logit is not finite.
  bool project_rows(const uint32_t* rows, uint32_t n, float* logits, std::string* err);
  // The message of a failed kvgc call (false when status is KVGC_OK).
  bool kvgc_failed(kvgc_status status, const char* call, std::string* err) const;
  // The end of an observe prefill's scoring (PrefillMode::Observe) on any sequence of
  // heap(), before its kvgc_step: EngineOptions::key_prior on the tokens at positions >=
  // `from` (the prefill's own), then each layer's scores max-pooled over pool_radius
  // positions either side.
  bool end_observe_scores(kvgc_seq seq, uint64_t from, std::string* err);
  // The reconstruction mass of the prompt tokens[0, n) at kvgc positions [from, from + n)
  // of `seq` (which holds them, unevicted, at its end): out[layer][position - from], what
  // the forks' repeat paid each token (EngineOptions::reconstruct). `seq` itself is left
  // as it was; the forks are destroyed, on failure too.
  // With reconstruct_head_peak, each layer's largest over its KV heads'
  // reconstruction_head_peaks.
  using LayerMass = std::vector<std::vector<float>>;
  bool reconstruction_mass(kvgc_seq seq, uint64_t from, const int32_t* tokens, uint32_t n,
                           LayerMass* out, std::string* err);
  // The per-head signal reconstruct_head_peak ranks by, as reconstruction_mass runs the
  // repeat: out[layer][g * n + position - from], the largest probability any query head
  // of KV head g's group gave the token from any of the repeat's queries.
  bool reconstruction_head_peaks(kvgc_seq seq, uint64_t from, const int32_t* tokens,
                                 uint32_t n, LayerMass* out, std::string* err);
  // Observes `mass` (reconstruction_mass's) into seq's scores, scaled as
  // EngineOptions::reconstruct says; sinks get none. Before end_observe_scores.
  bool add_reconstruction(kvgc_seq seq, uint64_t from, const LayerMass& mass, std::string* err);
  // Adds the wall time of a kvgc call the caller made to kvgc_seconds().
  void add_kvgc_seconds(double seconds) { kvgc_seconds_ += seconds; }

  uint64_t position() const { return position_; }
  kvgc_heap* heap() const { return heap_; }
  const Model& model() const { return *model_; }
  kvgc_seq sequence() const { return seq_; }
  const kvgc_model_desc& kv_model() const { return kv_model_; }
  // Wall time spent inside kvgc calls so far.
  double kvgc_seconds() const { return kvgc_seconds_; }
  const EngineOptions& options() const { return options_; }  // threads: as started
  uint32_t kvgc_threads() const { return kvgc_threads_; }    // the heap's attention threads

 private:
  // Checks that seq holds tokens[0, n) unevicted at [from, from + n), then, for each
  // reconstruct_chunk of them, forks seq and calls repeat(fork, rows, length): rows are
  // reconstruct_prompt + the chunk, to run from position `length`. The fork is destroyed
  // on every way out.
  using RepeatFn = std::function<bool(kvgc_seq fork, const std::vector<int32_t>& rows,
                                      uint64_t length)>;
  bool for_each_repeat(kvgc_seq seq, uint64_t from, const int32_t* tokens, uint32_t n,
                       const RepeatFn& repeat, std::string* err);
  // One fork's repeat for reconstruction_head_peaks: max-combined into `out`.
  bool head_peak_repeat(kvgc_seq fork, uint64_t from, uint32_t n, uint64_t length,
                        const std::vector<int32_t>& rows, LayerMass* out, std::string* err);
  // Bytes of one K/V element in the kvgc model dtype, and `count` of them to f32.
  size_t kv_bytes() const { return options_.kv_dtype == KVGC_DTYPE_F16 ? 2 : 4; }
  void kv_to_f32(const void* src, size_t count, float* dst) const;
  bool run_chunk(const int32_t* tokens, uint32_t n, bool scores, std::string* err);
  void reserve_rows(uint32_t n);  // scratch for n rows
  bool step(std::string* err);  // kvgc_step; KVGC_EBUDGET is advisory
  // project_rows() of chunk rows [first_row, first_row + n).
  bool project(uint32_t first_row, uint32_t n, float* logits, std::string* err);
  // The rows' q, k, v through the kvgc dtype into `attention`, and its output back.
  bool attend(uint32_t layer, uint32_t n, const Attention& attention, std::string* err);
  void rope_table(const uint64_t* positions, uint32_t n);  // cos/sin of the rows' positions
  void apply_rope(float* x, uint32_t n, uint32_t n_heads) const;

  const Model* model_ = nullptr;
  EngineOptions options_;
  kvgc_model_desc kv_model_{};
  kvgc_heap* heap_ = nullptr;
  kvgc_seq seq_ = 0;
  uint32_t kvgc_threads_ = 1;
  uint64_t position_ = 0;
  double kvgc_seconds_ = 0.0;
  std::unique_ptr<ThreadPool> pool_;
  std::unique_ptr<Matmul> matmul_;
  Activations input_;            // the current matmul input
  std::vector<float> inv_freq_;  // RoPE: base^(-2i/head_dim)
  std::vector<float> rope_cos_, rope_sin_;  // [rows][head_dim / 2]
  uint32_t rows_capacity_ = 0;              // rows the scratch holds
  std::vector<uint64_t> row_positions_;     // of the last run_rows()
  std::vector<uint32_t> project_list_;
  // Scratch for run_rows(), [rows][width] (kChunkTokens rows unless a batch needs more).
  std::vector<float> x_, xb_, q_, k_, v_, att_, proj_, gate_, up_;
  std::vector<uint16_t> q16_, k16_, v16_, att16_;  // the same in f16 (kv_dtype F16)
  // Score pooling scratch, one segment's live tokens.
  std::vector<float> pool_score_, pool_delta_;
  std::vector<int32_t> pool_pos_;
  std::vector<uint32_t> pool_order_;
  std::vector<uint8_t> prior_k_;    // one segment's live keys as kvgc_read gives them
  std::vector<float> prior_kf_;     // the same in f32

  bool add_key_prior(kvgc_seq seq, uint64_t from, std::string* err);
  // Observes pool_delta_ (n rows of `layer`, summing to `total` > 0) scaled so that it
  // totals `weight` times what the observed queries of `fresh` prompt tokens paid: the
  // key prior's and the reconstruction's common scale.
  bool observe_prior(kvgc_seq seq, uint32_t layer, uint64_t n, uint64_t fresh, double total,
                     float weight, std::string* err);
  bool pool_scores(kvgc_seq seq, std::string* err);
  // A segment's live scores and positions, in read order, into pool_score_ and pool_pos_;
  // *n the live count.
  bool read_scores(kvgc_seq seq, uint32_t layer, uint64_t* n, std::string* err);
};

// Index of the largest of n logits (greedy decoding; the first on ties).
int32_t argmax(const float* logits, uint32_t n);

// log softmax(logits)[target] over n logits, through a stable log-sum-exp.
double log_prob(const float* logits, uint32_t n, int32_t target);

// out = x / sqrt(mean(x^2) + eps) * weight, over `width` values.
void rms_norm(const float* x, const float* weight, float* out, uint32_t width, float eps);

}  // namespace engine
