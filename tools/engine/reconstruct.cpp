// The reconstruction signal (EngineOptions::reconstruct): what a model must look up to
// repeat a prompt is what a later question about it is likely to need. The repeat runs on
// forks of the sequence, so it reads the prompt's own cached K/V through kvgc_attend and
// never touches the prompt's scores. Two signals: the mass kvgc_attend fuses into the
// fork's scores, read back by position (the default), or each query head's own
// probabilities, computed here from the fork's keys (reconstruct_head_peak).
#include <algorithm>
#include <cmath>

#include "engine/forward.hpp"

namespace engine {
namespace {

// Destroys a fork on every way out of a chunk.
struct ForkGuard {
  kvgc_heap* heap;
  kvgc_seq seq = 0;
  ~ForkGuard() {
    if (seq != 0) kvgc_seq_destroy(heap, seq);
  }
};

// Runs a fork's repeat rows from position `length`, Engine::kChunkTokens at a time; each
// block's attention gets the block's first position and row count first.
using BlockAttention = std::function<bool(uint64_t first, uint32_t k, uint32_t layer,
                                          const void* q, const void* kk, const void* v,
                                          void* o, std::string* e)>;
bool run_repeat(Engine& engine, const std::vector<int32_t>& rows, uint64_t length,
                const BlockAttention& attention, std::string* err) {
  std::vector<uint64_t> positions;
  for (uint32_t done = 0; done < rows.size();) {
    const uint32_t k = std::min<uint32_t>(Engine::kChunkTokens, uint32_t(rows.size()) - done);
    positions.resize(k);
    for (uint32_t t = 0; t < k; ++t) positions[t] = length + done + t;
    const Engine::Attention block = [&](uint32_t layer, const void* q, const void* kk,
                                        const void* v, void* o, std::string* e) {
      return attention(length + done, k, layer, q, kk, v, o, e);
    };
    if (!engine.run_rows(rows.data() + done, positions.data(), k, block, err)) return false;
    done += k;
  }
  return true;
}

}  // namespace

bool Engine::for_each_repeat(kvgc_seq seq, uint64_t from, const int32_t* tokens, uint32_t n,
                             const RepeatFn& repeat, std::string* err) {
  if (n == 0) return true;
  uint64_t live = 0, length = 0;
  if (kvgc_failed(kvgc_seq_tokens(heap_, seq, 0, &live, &length), "kvgc_seq_tokens", err))
    return false;
  if (length < from + n || live < n) {
    if (err)
      *err = "reconstruction: the sequence holds " + std::to_string(live) + " of " +
             std::to_string(length) + " positions, not the " + std::to_string(n) +
             " prompt tokens from position " + std::to_string(from) + " unevicted";
    return false;
  }
  const std::vector<int32_t>& prompt = options_.reconstruct_prompt;
  std::vector<int32_t> rows;
  for (uint32_t start = 0; start < n; start += options_.reconstruct_chunk) {
    const uint32_t m = std::min(options_.reconstruct_chunk, n - start);
    rows.assign(prompt.begin(), prompt.end());
    rows.insert(rows.end(), tokens + start, tokens + start + m);
    ForkGuard fork{heap_};
    if (kvgc_failed(kvgc_seq_fork(heap_, seq, 0, &fork.seq, nullptr), "kvgc_seq_fork", err) ||
        !repeat(fork.seq, rows, length))
      return false;
  }
  return true;
}

bool Engine::reconstruction_head_peaks(kvgc_seq seq, uint64_t from, const int32_t* tokens,
                                       uint32_t n, LayerMass* out, std::string* err) {
  const Config& c = model_->config;
  out->assign(c.n_layers, std::vector<float>(size_t(c.n_kv_heads) * n, 0.0f));
  return for_each_repeat(seq, from, tokens, n,
                         [&](kvgc_seq fork, const std::vector<int32_t>& rows, uint64_t length) {
                           return head_peak_repeat(fork, from, n, length, rows, out, err);
                         },
                         err);
}

bool Engine::reconstruction_mass(kvgc_seq seq, uint64_t from, const int32_t* tokens,
                                 uint32_t n, LayerMass* out, std::string* err) {
  const Config& c = model_->config;
  out->assign(c.n_layers, std::vector<float>(n, 0.0f));
  if (n == 0) return true;
  if (options_.reconstruct_head_peak) {
    LayerMass heads;
    if (!reconstruction_head_peaks(seq, from, tokens, n, &heads, err)) return false;
    for (uint32_t l = 0; l < c.n_layers; ++l)
      for (uint32_t g = 0; g < c.n_kv_heads; ++g)
        for (uint32_t i = 0; i < n; ++i)
          (*out)[l][i] = std::max((*out)[l][i], heads[l][size_t(g) * n + i]);
    return true;
  }
  // Each layer's live scores by prompt position: `base` from seq, then each fork's.
  auto by_position = [&](kvgc_seq s, uint32_t layer, std::vector<float>* scores) {
    uint64_t count = 0;
    if (!read_scores(s, layer, &count, err)) return false;
    scores->assign(n, 0.0f);
    for (uint64_t i = 0; i < count; ++i) {
      const uint64_t p = uint64_t(pool_pos_[i]);
      if (p >= from && p < from + n) (*scores)[p - from] = pool_score_[i];
    }
    return true;
  };
  LayerMass base(c.n_layers);
  for (uint32_t l = 0; l < c.n_layers; ++l)
    if (!by_position(seq, l, &base[l])) return false;

  std::vector<float> scores;
  const size_t elem = kv_bytes();
  const size_t q_row = size_t(c.n_heads) * c.head_dim * elem;
  const size_t kv_row = size_t(c.n_kv_heads) * c.head_dim * elem;
  kvgc_attend_params params;
  kvgc_attend_params_init(&params);  // scores on: the repeat's mass is the signal
  auto repeat = [&](kvgc_seq fork, const std::vector<int32_t>& rows, uint64_t length) {
    LayerMass last = base;  // the fork's scores after its latest block of queries
    LayerMass peak(c.n_layers, std::vector<float>(n, 0.0f));
    uint64_t observations = 0;
    // reconstruct_rows queries at a time, each block's mass one observation per token: a
    // token's signal is its largest (KVzip's max over queries), not a sum that the tokens
    // every query glances at would win.
    const BlockAttention attention = [&](uint64_t, uint32_t k, uint32_t layer, const void* q,
                                         const void* kk, const void* v, void* o, std::string* e) {
      for (uint32_t r = 0; r < k; r += options_.reconstruct_rows) {
        const uint32_t b = std::min(options_.reconstruct_rows, k - r);
        if (kvgc_failed(kvgc_append(heap_, fork, layer,
                                    static_cast<const uint8_t*>(kk) + r * kv_row,
                                    static_cast<const uint8_t*>(v) + r * kv_row, b, nullptr),
                        "kvgc_append", e) ||
            kvgc_failed(kvgc_attend(heap_, fork, layer,
                                    static_cast<const uint8_t*>(q) + r * q_row, b,
                                    static_cast<uint8_t*>(o) + r * q_row, &params, nullptr),
                        "kvgc_attend", e) ||
            !by_position(fork, layer, &scores))
          return false;
        std::vector<float>& seen = last[layer];
        std::vector<float>& best = peak[layer];
        for (uint32_t i = 0; i < n; ++i) {
          best[i] = std::max(best[i], scores[i] - seen[i]);
          seen[i] = scores[i];
        }
        observations += layer == 0;
      }
      return true;
    };
    if (!run_repeat(*this, rows, length, attention, err)) return false;
    // A token's peak less its mean over this fork's observations: what one query had to
    // look up, not what every query glances at (the tokens that serve as sinks).
    for (uint32_t l = 0; l < c.n_layers; ++l)
      for (uint32_t i = 0; i < n; ++i) {
        const float mean = (last[l][i] - base[l][i]) / float(std::max<uint64_t>(1, observations));
        (*out)[l][i] = std::max((*out)[l][i], std::max(0.0f, peak[l][i] - mean));
      }
    return true;
  };
  return for_each_repeat(seq, from, tokens, n, repeat, err);
}

// Each query head's own softmax over the fork's live keys (kvgc_read's K, what
// kvgc_attend reads, converted to f32), computed here: kvgc_attend's fused mass sums a
// query's heads, and the fork's output still comes from kvgc_attend (no scores).
bool Engine::head_peak_repeat(kvgc_seq fork, uint64_t from, uint32_t n, uint64_t length,
                              const std::vector<int32_t>& rows, LayerMass* out,
                              std::string* err) {
  const Config& c = model_->config;
  const uint32_t hd = c.head_dim, kv_heads = c.n_kv_heads, heads = c.n_heads;
  const uint32_t group = heads / kv_heads, width = kv_heads * hd;
  const size_t elem = kv_bytes();
  const float scale = 1.0f / std::sqrt(float(hd));  // kvgc_attend's default, as run_rows
  // Each layer's live keys (f32, [key][kv_heads * hd]) and positions: the fork's, then
  // the repeat's rows as they are appended.
  std::vector<std::vector<float>> keys(c.n_layers);
  std::vector<std::vector<int32_t>> key_pos(c.n_layers);
  for (uint32_t l = 0; l < c.n_layers; ++l) {
    uint64_t live = 0, len = 0;
    if (kvgc_failed(kvgc_seq_tokens(heap_, fork, l, &live, &len), "kvgc_seq_tokens", err))
      return false;
    prior_k_.resize(live * width * elem);
    key_pos[l].resize(live);
    if (live != 0 &&
        kvgc_failed(kvgc_read(heap_, fork, l, prior_k_.data(), nullptr, key_pos[l].data(), live,
                              &live, nullptr), "kvgc_read", err))
      return false;
    keys[l].resize(live * width);
    kv_to_f32(prior_k_.data(), live * width, keys[l].data());
  }
  // Per thread: one query head's logits over a layer's keys.
  std::vector<std::vector<float>> logits(pool_->size());
  std::vector<float> qf, peaks;
  kvgc_attend_params params;
  kvgc_attend_params_init(&params);
  params.flags = KVGC_ATTEND_NO_SCORES;  // the fork's output only: the signal is computed here
  const BlockAttention attention = [&](uint64_t first, uint32_t k, uint32_t layer,
                                       const void* q, const void* kk, const void* v, void* o,
                                       std::string* e) {
    if (kvgc_failed(kvgc_append(heap_, fork, layer, kk, v, k, nullptr), "kvgc_append", e) ||
        kvgc_failed(kvgc_attend(heap_, fork, layer, q, k, o, &params, nullptr), "kvgc_attend", e))
      return false;
    std::vector<float>& K = keys[layer];
    std::vector<int32_t>& P = key_pos[layer];
    const size_t first_row = P.size();
    K.resize((first_row + k) * width);
    kv_to_f32(kk, size_t(k) * width, &K[first_row * width]);
    for (uint32_t t = 0; t < k; ++t) P.push_back(int32_t(first + t));
    qf.resize(size_t(k) * heads * hd);
    kv_to_f32(q, qf.size(), qf.data());
    std::vector<float>& best = (*out)[layer];  // [kv head][n]
    const size_t total = P.size();
    // One job per query head; a head's largest probabilities go to its own row of
    // `peaks`, combined after the join (no two threads write one float).
    peaks.assign(size_t(heads) * n, 0.0f);
    auto job = [&](uint32_t h, uint32_t thread) {
      std::vector<float>& x = logits[thread];
      x.resize(total);
      const uint32_t g = h / group;
      float* peak = &peaks[size_t(h) * n];
      for (uint32_t r = 0; r < k; ++r) {
        const size_t visible = first_row + r + 1;  // every earlier key, then causal
        kernels().f32(&K[size_t(g) * hd], width, uint32_t(visible),
                      &qf[(size_t(r) * heads + h) * hd], hd, 1, hd, x.data(), visible);
        float m = -INFINITY;
        for (size_t j = 0; j < visible; ++j) m = std::max(m, x[j] *= scale);
        double sum = 0;
        for (size_t j = 0; j < visible; ++j) sum += (x[j] = std::exp(x[j] - m));
        const float inv = sum > 0 ? float(1.0 / sum) : 0.0f;
        for (size_t j = 0; j < first_row; ++j) {
          const uint64_t p = uint64_t(P[j]);
          if (p >= from && p < from + n) peak[p - from] = std::max(peak[p - from], x[j] * inv);
        }
      }
    };
    pool_->run(heads, job);
    for (uint32_t h = 0; h < heads; ++h)
      for (uint32_t i = 0; i < n; ++i) {
        float& b = best[size_t(h / group) * n + i];
        b = std::max(b, peaks[size_t(h) * n + i]);
      }
    return true;
  };
  return run_repeat(*this, rows, length, attention, err);
}

bool Engine::add_reconstruction(kvgc_seq seq, uint64_t from, const LayerMass& mass,
                                std::string* err) {
  const Config& c = model_->config;
  if (options_.reconstruct <= 0) return true;
  if (mass.size() != c.n_layers) {
    if (err)
      *err = "reconstruction: mass for " + std::to_string(mass.size()) + " layers, the model has " +
             std::to_string(c.n_layers);
    return false;
  }
  kvgc_heap_options effective;
  kvgc_heap_options_init(&effective);
  if (kvgc_failed(kvgc_heap_get_options(heap_, &effective), "kvgc_heap_get_options", err))
    return false;
  // reconstruct_across_layers: every layer gets the mean of the layers' shares.
  std::vector<float> shared;
  if (options_.reconstruct_across_layers && !mass.empty()) {
    shared.assign(mass[0].size(), 0.0f);
    for (const std::vector<float>& m : mass) {
      double total = 0;
      for (size_t i = effective.sinks; i < m.size(); ++i) total += m[i];
      if (total > 0)
        for (size_t i = effective.sinks; i < m.size() && i < shared.size(); ++i)
          shared[i] += float(m[i] / total);
    }
  }
  for (uint32_t layer = 0; layer < c.n_layers; ++layer) {
    uint64_t n = 0, length = 0;
    if (kvgc_failed(kvgc_seq_tokens(heap_, seq, layer, &n, &length), "kvgc_seq_tokens", err))
      return false;
    if (n == 0) continue;
    pool_pos_.resize(n);
    pool_delta_.assign(n, 0.0f);
    if (kvgc_failed(kvgc_read(heap_, seq, layer, nullptr, nullptr, pool_pos_.data(), n, &n,
                              nullptr), "kvgc_read", err))
      return false;
    const std::vector<float>& m = shared.empty() ? mass[layer] : shared;
    uint64_t fresh = 0;
    double total = 0;
    for (uint64_t i = 0; i < n; ++i) {
      const uint64_t p = uint64_t(pool_pos_[i]);
      fresh += p >= from;
      // The sinks are kept whatever they score, and the repeat pays them most of its
      // mass: counted, they would shrink every other token's share.
      if (p < from || p < effective.sinks || p - from >= m.size()) continue;
      pool_delta_[i] = m[p - from];
      total += m[p - from];
    }
    if (total > 0 && !observe_prior(seq, layer, n, fresh, total, options_.reconstruct, err))
      return false;
  }
  return true;
}

}  // namespace engine
