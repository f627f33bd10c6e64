#include "engine/forward.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>

namespace engine {
namespace {

using Clock = std::chrono::steady_clock;

// Adds the wall time of a kvgc call to a running total.
class KvgcTimer {
 public:
  explicit KvgcTimer(double* total) : total_(total), start_(Clock::now()) {}
  ~KvgcTimer() { *total_ += std::chrono::duration<double>(Clock::now() - start_).count(); }

 private:
  double* total_;
  Clock::time_point start_;
};

std::atomic<uint32_t> g_default_threads{1};

}  // namespace

void set_default_threads(uint32_t threads) { g_default_threads.store(std::max(1u, threads)); }
uint32_t default_threads() { return g_default_threads.load(); }

int32_t argmax(const float* logits, uint32_t n) {
  return int32_t(std::max_element(logits, logits + n) - logits);
}

double log_prob(const float* logits, uint32_t n, int32_t target) {
  const float max = *std::max_element(logits, logits + n);
  double sum = 0.0;
  for (uint32_t i = 0; i < n; ++i) sum += std::exp(logits[i] - max);
  return double(logits[target] - max) - std::log(sum);
}

void rms_norm(const float* x, const float* weight, float* out, uint32_t width, float eps) {
  double sum = 0.0;
  for (uint32_t i = 0; i < width; ++i) sum += double(x[i]) * x[i];
  const float inv = float(1.0 / std::sqrt(sum / width + eps));
  for (uint32_t i = 0; i < width; ++i) out[i] = x[i] * inv * weight[i];
}

Engine::~Engine() {
  if (heap_ != nullptr) {
    if (seq_ != 0) kvgc_seq_destroy(heap_, seq_);
    kvgc_heap_destroy(heap_);
  }
}

bool Engine::kvgc_failed(kvgc_status status, const char* call, std::string* err) const {
  if (status == KVGC_OK) return false;
  if (err) *err = std::string(call) + ": " + kvgc_status_str(status) + ": " + kvgc_errmsg(heap_);
  return true;
}

bool Engine::init(const Model& model, const kvgc_heap_options* options, std::string* err,
                  const EngineOptions& engine_options) {
  if (engine_options.kv_dtype != KVGC_DTYPE_F16 && engine_options.kv_dtype != KVGC_DTYPE_F32) {
    if (err) *err = "EngineOptions.kv_dtype must be KVGC_DTYPE_F16 or KVGC_DTYPE_F32";
    return false;
  }
  if (engine_options.pool_radius > kMaxPoolRadius) {
    if (err) *err = "EngineOptions.pool_radius " + std::to_string(engine_options.pool_radius) +
                    " is above " + std::to_string(kMaxPoolRadius);
    return false;
  }
  if (!(engine_options.key_prior >= 0 && std::isfinite(engine_options.key_prior))) {
    if (err) *err = "EngineOptions.key_prior " + std::to_string(engine_options.key_prior) +
                    " is not a finite number >= 0";
    return false;
  }
  if (!(engine_options.reconstruct >= 0 && std::isfinite(engine_options.reconstruct))) {
    if (err) *err = "EngineOptions.reconstruct " + std::to_string(engine_options.reconstruct) +
                    " is not a finite number >= 0";
    return false;
  }
  if (engine_options.reconstruct_rows == 0) {
    if (err) *err = "EngineOptions.reconstruct_rows is 0 (an observation needs a query)";
    return false;
  }
  if (engine_options.reconstruct_chunk == 0) {
    if (err) *err = "EngineOptions.reconstruct_chunk is 0 (it needs at least one token a fork)";
    return false;
  }
  model_ = &model;
  options_ = engine_options;
  const Config& c = model.config;
  kv_model_ = kv_desc(c, options_.kv_dtype);
  if (kvgc_failed(kvgc_heap_create(&kv_model_, options, &heap_), "kvgc_heap_create", err) ||
      (options_.own_sequence &&
       kvgc_failed(kvgc_seq_create(heap_, 0, &seq_), "kvgc_seq_create", err))) {
    return false;
  }
  kvgc_heap_options effective;
  kvgc_heap_options_init(&effective);
  if (kvgc_heap_get_options(heap_, &effective) == KVGC_OK && effective.device == KVGC_DEVICE_CPU)
    kvgc_threads_ = std::max(1u, effective.cpu_threads);
  pool_ = std::make_unique<ThreadPool>(options_.threads ? options_.threads : default_threads());
  options_.threads = pool_->size();
  matmul_ = std::make_unique<Matmul>(pool_.get(), options_.matmul);

  inv_freq_.resize(c.head_dim / 2);
  for (uint32_t i = 0; i < c.head_dim / 2; ++i) {
    inv_freq_[i] = float(std::pow(double(c.rope_base), -2.0 * i / c.head_dim));
  }
  reserve_rows(kChunkTokens);
  return true;
}

void Engine::reserve_rows(uint32_t n) {
  if (n <= rows_capacity_) return;
  rows_capacity_ = n;
  const Config& c = model_->config;
  const size_t q_width = size_t(c.n_heads) * c.head_dim;
  const size_t kv_width = size_t(c.n_kv_heads) * c.head_dim;
  rope_cos_.resize(n * size_t(c.head_dim / 2));
  rope_sin_.resize(rope_cos_.size());
  row_positions_.resize(n);
  x_.resize(n * size_t(c.n_embd));
  xb_.resize(x_.size());
  proj_.resize(x_.size());
  q_.resize(n * q_width);
  att_.resize(q_.size());
  k_.resize(n * kv_width);
  v_.resize(k_.size());
  gate_.resize(n * size_t(c.n_ff));
  up_.resize(gate_.size());
  if (options_.kv_dtype == KVGC_DTYPE_F16) {
    q16_.resize(q_.size());
    att16_.resize(q_.size());
    k16_.resize(k_.size());
    v16_.resize(k_.size());
  }
}

// The rows' rotation angles, once for all layers and both q and k.
void Engine::rope_table(const uint64_t* positions, uint32_t n) {
  const uint32_t half = model_->config.head_dim / 2;
  for (uint32_t t = 0; t < n; ++t) {
    const double pos = double(positions[t]);
    for (uint32_t i = 0; i < half; ++i) {
      const double angle = pos * inv_freq_[i];
      rope_cos_[size_t(t) * half + i] = float(std::cos(angle));
      rope_sin_[size_t(t) * half + i] = float(std::sin(angle));
    }
  }
}

// llama's "normal" RoPE: pairs (x[2i], x[2i+1]) of each head rotated by pos * inv_freq[i].
void Engine::apply_rope(float* x, uint32_t n, uint32_t n_heads) const {
  const uint32_t head_dim = model_->config.head_dim, half = head_dim / 2;
  for (uint32_t t = 0; t < n; ++t) {
    const float* cos_t = &rope_cos_[size_t(t) * half];
    const float* sin_t = &rope_sin_[size_t(t) * half];
    for (uint32_t h = 0; h < n_heads; ++h) {
      float* head = x + (size_t(t) * n_heads + h) * head_dim;
      for (uint32_t i = 0; i < half; ++i) {
        const float a = head[2 * i], b = head[2 * i + 1];
        head[2 * i] = a * cos_t[i] - b * sin_t[i];
        head[2 * i + 1] = a * sin_t[i] + b * cos_t[i];
      }
    }
  }
}

// The rows' q, k, v in the kvgc model dtype to `attention`, its output back to f32.
bool Engine::attend(uint32_t layer, uint32_t n, const Attention& attention, std::string* err) {
  const Config& c = model_->config;
  const size_t q_count = size_t(n) * c.n_heads * c.head_dim;
  const size_t kv_count = size_t(n) * c.n_kv_heads * c.head_dim;
  const bool f16 = options_.kv_dtype == KVGC_DTYPE_F16;
  if (f16) {
    const Kernels& k = kernels();
    k.f32_to_f16(q_.data(), q_count, q16_.data());
    k.f32_to_f16(k_.data(), kv_count, k16_.data());
    k.f32_to_f16(v_.data(), kv_count, v16_.data());
  }
  // kvgc's own attention threads get the cores: the matmul workers sleep meanwhile.
  if (kvgc_threads_ > 1) pool_->rest();
  {
    KvgcTimer timer(&kvgc_seconds_);
    const void* k = f16 ? static_cast<const void*>(k16_.data()) : k_.data();
    const void* v = f16 ? static_cast<const void*>(v16_.data()) : v_.data();
    const void* q = f16 ? static_cast<const void*>(q16_.data()) : q_.data();
    void* out = f16 ? static_cast<void*>(att16_.data()) : att_.data();
    if (!attention(layer, q, k, v, out, err)) return false;
  }
  if (f16) kernels().f16_to_f32(att16_.data(), q_count, att_.data());
  return true;
}

// One chunk of the engine's own sequence: append, then attend, at the next positions.
bool Engine::run_chunk(const int32_t* tokens, uint32_t n, bool scores, std::string* err) {
  uint64_t positions[kChunkTokens];
  for (uint32_t t = 0; t < n; ++t) positions[t] = position_ + t;
  kvgc_attend_params params;
  kvgc_attend_params_init(&params);
  if (!scores) params.flags |= KVGC_ATTEND_NO_SCORES;
  const Attention attention = [&](uint32_t layer, const void* q, const void* k, const void* v,
                                  void* out, std::string* e) {
    return !kvgc_failed(kvgc_append(heap_, seq_, layer, k, v, n, nullptr), "kvgc_append", e) &&
           !kvgc_failed(kvgc_attend(heap_, seq_, layer, q, n, out, &params, nullptr),
                        "kvgc_attend", e);
  };
  if (!run_rows(tokens, positions, n, attention, err)) return false;
  position_ += n;
  return true;
}

bool Engine::run_rows(const int32_t* tokens, const uint64_t* positions, uint32_t n,
                      const Attention& attention, std::string* err) {
  const Config& c = model_->config;
  const uint32_t q_width = c.n_heads * c.head_dim;
  reserve_rows(n);
  for (uint32_t t = 0; t < n; ++t) {
    if (tokens[t] < 0 || uint32_t(tokens[t]) >= c.n_vocab) {
      if (err) *err = "token id " + std::to_string(tokens[t]) + " is outside the vocabulary";
      return false;
    }
    dequantize_row(model_->token_embd, uint32_t(tokens[t]), &x_[size_t(t) * c.n_embd]);
    row_positions_[t] = positions[t];
  }
  rope_table(positions, n);
  for (uint32_t layer = 0; layer < c.n_layers; ++layer) {
    const LayerWeights& w = model_->layers[layer];
    for (uint32_t t = 0; t < n; ++t) {
      rms_norm(&x_[size_t(t) * c.n_embd], w.attn_norm.data(), &xb_[size_t(t) * c.n_embd],
               c.n_embd, c.rms_eps);
    }
    input_.set(xb_.data(), n, c.n_embd);
    matmul_->run({{&w.wq, q_.data()}, {&w.wk, k_.data()}, {&w.wv, v_.data()}}, input_);
    apply_rope(q_.data(), n, c.n_heads);
    apply_rope(k_.data(), n, c.n_kv_heads);
    if (!attend(layer, n, attention, err)) return false;
    input_.set(att_.data(), n, q_width);
    matmul_->run({{&w.wo, proj_.data()}}, input_);
    for (size_t i = 0; i < size_t(n) * c.n_embd; ++i) x_[i] += proj_[i];

    for (uint32_t t = 0; t < n; ++t) {
      rms_norm(&x_[size_t(t) * c.n_embd], w.ffn_norm.data(), &xb_[size_t(t) * c.n_embd],
               c.n_embd, c.rms_eps);
    }
    input_.set(xb_.data(), n, c.n_embd);
    matmul_->run({{&w.w_gate, gate_.data()}, {&w.w_up, up_.data()}}, input_);
    for (size_t i = 0; i < size_t(n) * c.n_ff; ++i) {
      const float g = gate_[i];
      gate_[i] = g / (1.0f + std::exp(-g)) * up_[i];  // SiLU(gate) * up
    }
    input_.set(gate_.data(), n, c.n_ff);
    matmul_->run({{&w.w_down, proj_.data()}}, input_);
    for (size_t i = 0; i < size_t(n) * c.n_embd; ++i) x_[i] += proj_[i];
  }
  return true;
}

bool Engine::step(std::string* err) {
  KvgcTimer timer(&kvgc_seconds_);
  const kvgc_status status = kvgc_step(heap_, seq_, nullptr);
  return status == KVGC_EBUDGET || !kvgc_failed(status, "kvgc_step", err);
}

bool Engine::project(uint32_t first_row, uint32_t n, float* logits, std::string* err) {
  project_list_.resize(n);
  for (uint32_t t = 0; t < n; ++t) project_list_[t] = first_row + t;
  return project_rows(project_list_.data(), n, logits, err);
}

bool Engine::project_rows(const uint32_t* rows, uint32_t n, float* logits, std::string* err) {
  const Config& c = model_->config;
  for (uint32_t t = 0; t < n; ++t) {
    rms_norm(&x_[size_t(rows[t]) * c.n_embd], model_->output_norm.data(),
             &xb_[size_t(t) * c.n_embd], c.n_embd, c.rms_eps);
  }
  input_.set(xb_.data(), n, c.n_embd);
  matmul_->run({{&model_->output_weights(), logits}}, input_);
  for (size_t i = 0; i < size_t(n) * c.n_vocab; ++i) {
    if (!std::isfinite(logits[i])) {
      if (err) {
        *err = "the logits at position " + std::to_string(row_positions_[rows[i / c.n_vocab]]) +
               " are not finite (NaN or infinity): the model's weights are broken or its "
               "activations overflow";
      }
      return false;
    }
  }
  return true;
}

bool Engine::forward(const int32_t* tokens, uint32_t n_tokens, float* logits, std::string* err,
                     const Pass& pass) {
  if (n_tokens == 0) {
    if (err) *err = "forward needs at least one token";
    return false;
  }
  const Config& c = model_->config;
  uint32_t last = 0;
  for (uint32_t done = 0; done < n_tokens; done += last) {
    last = std::min(kChunkTokens, n_tokens - done);
    // A chunk either scores or not: split it where scoring starts.
    if (done < pass.scored_from) last = std::min(last, pass.scored_from - done);
    if (!run_chunk(tokens + done, last, done >= pass.scored_from, err)) return false;
    // All rows at once: one matmul over the chunk's normalised rows.
    if (pass.all_logits != nullptr &&
        !project(0, last, pass.all_logits + size_t(done) * c.n_vocab, err)) {
      return false;
    }
    if (pass.step && !step(err)) return false;
  }
  return logits == nullptr || project(last - 1, 1, logits, err);
}
bool Engine::prefill(const int32_t* tokens, uint32_t n_tokens, float* logits, std::string* err,
                     PrefillMode mode, const std::function<void(uint32_t)>& progress) {
  Pass pass;
  uint64_t from = 0;  // kvgc's position of the prompt's first token
  if (mode == PrefillMode::Observe) {
    uint64_t live = 0;
    if (kvgc_failed(kvgc_seq_tokens(heap_, seq_, 0, &live, &from), "kvgc_seq_tokens", err))
      return false;
    pass.step = false;
    pass.scored_from = n_tokens > kObserveTokens ? n_tokens - kObserveTokens : 0;
  }
  // Chunk by chunk so progress can be reported; scoring and stepping as the mode says.
  for (uint32_t done = 0; done < n_tokens;) {
    uint32_t n = std::min(kChunkTokens, n_tokens - done);
    if (done < pass.scored_from) n = std::min(n, pass.scored_from - done);
    Pass piece = pass;
    piece.scored_from = done >= pass.scored_from ? 0 : n;  // the piece never straddles it
    const bool last = done + n == n_tokens;
    if (!forward(tokens + done, n, last ? logits : nullptr, err, piece)) return false;
    done += n;
    if (progress) progress(done);
  }
  if (mode != PrefillMode::Observe) return true;
  if (options_.reconstruct > 0) {
    LayerMass mass;
    if (!reconstruction_mass(seq_, from, tokens, n_tokens, &mass, err) ||
        !add_reconstruction(seq_, from, mass, err))
      return false;
  }
  return end_observe_scores(seq_, from, err) && step(err);
}

bool Engine::end_observe_scores(kvgc_seq seq, uint64_t from, std::string* err) {
  return (options_.key_prior <= 0 || add_key_prior(seq, from, err)) && pool_scores(seq, err);
}

void Engine::kv_to_f32(const void* src, size_t count, float* dst) const {
  if (options_.kv_dtype == KVGC_DTYPE_F16)
    kernels().f16_to_f32(static_cast<const uint16_t*>(src), count, dst);
  else
    std::memcpy(dst, src, count * sizeof(float));
}

// KeyDiff's signal as a prior: per KV head, the mean direction of the prefill's unit keys,
// and each key's 1 - cosine to it. Through the public API, as pooling is.
bool Engine::add_key_prior(kvgc_seq seq, uint64_t from, std::string* err) {
  const Config& c = model_->config;
  const uint32_t heads = c.n_kv_heads, dim = c.head_dim, width = heads * dim;
  const size_t elem = kv_bytes();
  for (uint32_t layer = 0; layer < c.n_layers; ++layer) {
    KvgcTimer timer(&kvgc_seconds_);
    uint64_t n = 0, length = 0;
    if (kvgc_failed(kvgc_seq_tokens(heap_, seq, layer, &n, &length), "kvgc_seq_tokens", err))
      return false;
    if (n == 0) continue;
    prior_k_.resize(n * width * elem);
    prior_kf_.resize(n * width);
    pool_pos_.resize(n);
    pool_delta_.assign(n, 0.0f);
    if (kvgc_failed(kvgc_read(heap_, seq, layer, prior_k_.data(), nullptr, pool_pos_.data(), n,
                              &n, nullptr), "kvgc_read", err))
      return false;
    kv_to_f32(prior_k_.data(), n * width, prior_kf_.data());
    uint64_t fresh = 0;
    for (uint64_t i = 0; i < n; ++i) fresh += uint64_t(pool_pos_[i]) >= from;
    if (fresh < 2) continue;
    // Unit keys, then each head's mean direction over the fresh ones.
    std::vector<float> anchor(width, 0.0f);
    for (uint64_t i = 0; i < n; ++i) {
      float* row = &prior_kf_[i * width];
      for (uint32_t h = 0; h < heads; ++h) {
        float* x = row + h * dim;
        double norm = 0;
        for (uint32_t d = 0; d < dim; ++d) norm += double(x[d]) * x[d];
        const float inv = norm > 0 ? float(1.0 / std::sqrt(norm)) : 0.0f;
        for (uint32_t d = 0; d < dim; ++d) x[d] *= inv;
      }
      if (uint64_t(pool_pos_[i]) >= from)
        for (uint32_t j = 0; j < width; ++j) anchor[j] += row[j];
    }
    for (uint32_t h = 0; h < heads; ++h) {
      double norm = 0;
      for (uint32_t d = 0; d < dim; ++d) norm += double(anchor[h * dim + d]) * anchor[h * dim + d];
      const float inv = norm > 0 ? float(1.0 / std::sqrt(norm)) : 0.0f;
      for (uint32_t d = 0; d < dim; ++d) anchor[h * dim + d] *= inv;
    }
    double total = 0;
    for (uint64_t i = 0; i < n; ++i) {
      if (uint64_t(pool_pos_[i]) < from) continue;
      const float* row = &prior_kf_[i * width];
      double diversity = 0;
      for (uint32_t h = 0; h < heads; ++h) {
        double dot = 0;
        for (uint32_t d = 0; d < dim; ++d) dot += double(row[h * dim + d]) * anchor[h * dim + d];
        diversity += 1.0 - dot;
      }
      pool_delta_[i] = float(diversity);
      total += diversity;
    }
    if (total > 0 && !observe_prior(seq, layer, n, fresh, total, options_.key_prior, err))
      return false;
  }
  return true;
}

bool Engine::observe_prior(kvgc_seq seq, uint32_t layer, uint64_t n, uint64_t fresh,
                           double total, float weight, std::string* err) {
  // What the observed queries paid: each query head's probabilities sum to 1.
  const double mass = double(std::min<uint64_t>(fresh, kObserveTokens)) * model_->config.n_heads;
  const float scale = float(double(weight) * mass / total);
  for (float& x : pool_delta_) x *= scale;
  return !kvgc_failed(kvgc_observe(heap_, seq, layer, pool_delta_.data(), n, nullptr),
                      "kvgc_observe", err);
}

bool Engine::read_scores(kvgc_seq seq, uint32_t layer, uint64_t* n, std::string* err) {
  *n = 0;
  if (kvgc_failed(kvgc_read_scores(heap_, seq, layer, nullptr, nullptr, 0, n, nullptr),
                  "kvgc_read_scores", err))
    return false;
  pool_score_.resize(*n);
  pool_pos_.resize(*n);
  return *n == 0 ||
         (!kvgc_failed(kvgc_read_scores(heap_, seq, layer, pool_score_.data(), nullptr, *n, n,
                                        nullptr), "kvgc_read_scores", err) &&
          !kvgc_failed(kvgc_read(heap_, seq, layer, nullptr, nullptr, pool_pos_.data(), *n, n,
                                 nullptr), "kvgc_read", err));
}

// SnapKV's clustering: a token's score becomes the largest within pool_radius positions,
// so the neighbours of what the question attends to (the other digits of a number, the
// rest of a name) are ranked with it. Done through the public API: read the scores,
// then kvgc_observe the difference.
bool Engine::pool_scores(kvgc_seq seq, std::string* err) {
  const int32_t radius = int32_t(options_.pool_radius);
  if (radius == 0) return true;
  for (uint32_t layer = 0; layer < model_->config.n_layers; ++layer) {
    KvgcTimer timer(&kvgc_seconds_);
    uint64_t n = 0;
    if (!read_scores(seq, layer, &n, err)) return false;
    pool_delta_.resize(n);
    if (n == 0) continue;
    // Rows in position order (read order need not be), then a window max over positions.
    pool_order_.resize(n);
    for (uint32_t i = 0; i < n; ++i) pool_order_[i] = i;
    std::sort(pool_order_.begin(), pool_order_.end(),
              [&](uint32_t a, uint32_t b) { return pool_pos_[a] < pool_pos_[b]; });
    size_t lo = 0;
    for (size_t i = 0; i < n; ++i) {
      const int32_t p = pool_pos_[pool_order_[i]];
      while (pool_pos_[pool_order_[lo]] < p - radius) ++lo;
      float best = pool_score_[pool_order_[i]];
      for (size_t j = lo; j < n && pool_pos_[pool_order_[j]] <= p + radius; ++j)
        best = std::max(best, pool_score_[pool_order_[j]]);
      pool_delta_[pool_order_[i]] = best - pool_score_[pool_order_[i]];
    }
    if (kvgc_failed(kvgc_observe(heap_, seq, layer, pool_delta_.data(), n, nullptr),
                    "kvgc_observe", err))
      return false;
  }
  return true;
}

}  // namespace engine
