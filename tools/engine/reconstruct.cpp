// The reconstruction signal (EngineOptions::reconstruct): what a model must look up to
// repeat a prompt is what a later question about it is likely to need. The repeat runs on
// forks of the sequence, so it reads the prompt's own cached K/V through kvgc_attend and
// its fused mass lands in the forks' scores, never in the prompt's; the difference, read
// back by position, is the signal.
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

}  // namespace

bool Engine::reconstruction_mass(kvgc_seq seq, uint64_t from, const int32_t* tokens,
                                 uint32_t n, LayerMass* out, std::string* err) {
  const Config& c = model_->config;
  out->assign(c.n_layers, std::vector<float>(n, 0.0f));
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

  const std::vector<int32_t>& prompt = options_.reconstruct_prompt;
  std::vector<int32_t> rows;
  std::vector<uint64_t> positions;
  std::vector<float> scores;
  const size_t elem = options_.kv_dtype == KVGC_DTYPE_F16 ? 2 : 4;
  const size_t q_row = size_t(c.n_heads) * c.head_dim * elem;
  const size_t kv_row = size_t(c.n_kv_heads) * c.head_dim * elem;
  kvgc_attend_params params;
  kvgc_attend_params_init(&params);  // scores on: the repeat's mass is the signal
  for (uint32_t start = 0; start < n; start += options_.reconstruct_chunk) {
    const uint32_t m = std::min(options_.reconstruct_chunk, n - start);
    rows.assign(prompt.begin(), prompt.end());
    rows.insert(rows.end(), tokens + start, tokens + start + m);
    ForkGuard fork{heap_};
    if (kvgc_failed(kvgc_seq_fork(heap_, seq, 0, &fork.seq, nullptr), "kvgc_seq_fork", err))
      return false;
    LayerMass last = base;  // the fork's scores after its latest block of queries
    LayerMass peak(c.n_layers, std::vector<float>(n, 0.0f));
    uint64_t observations = 0;
    for (uint32_t done = 0; done < rows.size();) {
      const uint32_t k = std::min<uint32_t>(kChunkTokens, uint32_t(rows.size()) - done);
      positions.resize(k);
      for (uint32_t t = 0; t < k; ++t) positions[t] = length + done + t;
      // reconstruct_rows queries at a time, each block's mass one observation per token:
      // a token's signal is its largest (KVzip's max over queries), not a sum that the
      // tokens every query glances at would win.
      const Attention attention = [&](uint32_t layer, const void* q, const void* kk,
                                      const void* v, void* o, std::string* e) {
        for (uint32_t r = 0; r < k; r += options_.reconstruct_rows) {
          const uint32_t b = std::min(options_.reconstruct_rows, k - r);
          if (kvgc_failed(kvgc_append(heap_, fork.seq, layer,
                                      static_cast<const uint8_t*>(kk) + r * kv_row,
                                      static_cast<const uint8_t*>(v) + r * kv_row, b, nullptr),
                          "kvgc_append", e) ||
              kvgc_failed(kvgc_attend(heap_, fork.seq, layer,
                                      static_cast<const uint8_t*>(q) + r * q_row, b,
                                      static_cast<uint8_t*>(o) + r * q_row, &params, nullptr),
                          "kvgc_attend", e) ||
              !by_position(fork.seq, layer, &scores))
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
      if (!run_rows(rows.data() + done, positions.data(), k, attention, err)) return false;
      done += k;
    }
    // A token's peak less its mean over this fork's observations: what one query had to
    // look up, not what every query glances at (the tokens that serve as sinks).
    for (uint32_t l = 0; l < c.n_layers; ++l)
      for (uint32_t i = 0; i < n; ++i) {
        const float mean = (last[l][i] - base[l][i]) / float(std::max<uint64_t>(1, observations));
        (*out)[l][i] = std::max((*out)[l][i], std::max(0.0f, peak[l][i] - mean));
      }
  }
  return true;
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
