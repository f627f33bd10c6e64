#include "quality_replay.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

namespace quality {
namespace {

size_t dtype_bytes(kvgc_dtype dtype) { return dtype == KVGC_DTYPE_F32 ? 4 : 2; }

float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ffu, bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {  // subnormal
    exp = 113;
    while ((mant & 0x400u) == 0) mant <<= 1, --exp;
    bits = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Round to nearest even, as the engine's conversion (and F16C) does.
uint16_t float_to_half(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t abs = x & 0x7fffffffu;
  if (abs >= 0x7f800000u) return uint16_t(sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u : 0));
  if (abs >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // overflow to inf
  if (abs < 0x38800000u) {  // subnormal or zero
    const float magic = 0.5f;  // 2^-1: aligns the subnormal's bits, rounding to nearest
    float a;
    std::memcpy(&a, &abs, 4);
    a += magic;
    uint32_t r;
    std::memcpy(&r, &a, 4);
    return uint16_t(sign | (r - 0x3f000000u));
  }
  const uint32_t mant_odd = (abs >> 13) & 1u;
  const uint32_t rounded = abs + 0xc8000fffu + mant_odd;  // rebias (-112 << 23) + round
  return uint16_t(sign | (rounded >> 13));
}

float load(const uint8_t* p, kvgc_dtype dtype) {
  if (dtype == KVGC_DTYPE_F32) {
    float f;
    std::memcpy(&f, p, 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, p, 2);
  if (dtype == KVGC_DTYPE_F16) return half_to_float(h);
  const uint32_t bits = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

void store(uint8_t* p, kvgc_dtype dtype, float f) {
  if (dtype == KVGC_DTYPE_F32) {
    std::memcpy(p, &f, 4);
    return;
  }
  uint16_t h;
  if (dtype == KVGC_DTYPE_F16) {
    h = float_to_half(f);
  } else {
    uint32_t x;
    std::memcpy(&x, &f, 4);
    h = uint16_t((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
  }
  std::memcpy(p, &h, 2);
}

// Rotates every head of `rows` keys by `shift` positions, as the engine's RoPE does
// (tools/engine/forward.cpp, apply_rope: pairs (2i, 2i+1), angle pos * base^(-2i/d)).
void rope_shift(const Bench& bench, uint8_t* keys, uint64_t rows, int64_t shift) {
  const engine::Config& c = bench.model->config;
  const kvgc_dtype dtype = bench.kv.dtype;
  const size_t es = dtype_bytes(dtype);
  std::vector<float> cos_a(c.head_dim / 2), sin_a(c.head_dim / 2);
  for (uint32_t i = 0; i < c.head_dim / 2; ++i) {
    const float inv_freq = float(std::pow(double(c.rope_base), -2.0 * i / c.head_dim));
    const double angle = double(shift) * inv_freq;
    cos_a[i] = float(std::cos(angle));
    sin_a[i] = float(std::sin(angle));
  }
  const size_t heads = size_t(rows) * c.n_kv_heads;
  for (size_t h = 0; h < heads; ++h) {
    uint8_t* head = keys + h * c.head_dim * es;
    for (uint32_t i = 0; i < c.head_dim / 2; ++i) {
      const float a = load(head + 2 * i * es, dtype), b = load(head + (2 * i + 1) * es, dtype);
      store(head + 2 * i * es, dtype, a * cos_a[i] - b * sin_a[i]);
      store(head + (2 * i + 1) * es, dtype, a * sin_a[i] + b * cos_a[i]);
    }
  }
}

bool kvgc_ok(kvgc_status s, const char* call, kvgc_heap* heap, std::string* err) {
  if (s == KVGC_OK) return true;
  *err = std::string(call) + ": " + kvgc_status_str(s) + ": " + kvgc_errmsg(heap);
  return false;
}

// An engine that can continue a sequence the caller filled (detected, not required).
template <typename E>
concept Resumable = requires(E& e, std::string* err) {
  { e.resume(uint64_t{}, err) } -> std::convertible_to<bool>;
};

template <typename E>
bool try_resume(E* engine, uint64_t position, bool* resumed, std::string* err) {
  if constexpr (Resumable<E>) {
    *resumed = true;
    return engine->resume(position, err);
  } else {
    *resumed = false;
    (void)engine, (void)position, (void)err;
    return true;
  }
}

// One layer of an engine's cache, rows sorted by position.
struct LayerView {
  std::vector<int32_t> pos;
  std::vector<uint8_t> k, v, gen;
  std::vector<float> scores;
};

bool read_layer(const Bench& bench, const engine::Engine& e, uint32_t layer, LayerView* out,
                std::string* err) {
  kvgc_heap* heap = e.heap();
  const size_t row = size_t(bench.kv.n_kv_heads) * bench.kv.head_dim * dtype_bytes(bench.kv.dtype);
  uint64_t n = 0;
  if (!kvgc_ok(kvgc_read(heap, e.sequence(), layer, nullptr, nullptr, nullptr, 0, &n, nullptr),
               "kvgc_read", heap, err))
    return false;
  std::vector<int32_t> pos(n);
  std::vector<uint8_t> k(n * row), v(n * row), gen(n);
  std::vector<float> scores(n);
  if (!kvgc_ok(kvgc_read(heap, e.sequence(), layer, k.data(), v.data(), pos.data(), n, &n,
                         nullptr), "kvgc_read", heap, err) ||
      !kvgc_ok(kvgc_read_scores(heap, e.sequence(), layer, scores.data(), gen.data(), n, &n,
                                nullptr), "kvgc_read_scores", heap, err))
    return false;
  std::vector<size_t> order(n);
  std::iota(order.begin(), order.end(), size_t(0));
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return pos[a] < pos[b]; });
  out->pos.resize(n);
  out->k.resize(n * row);
  out->v.resize(n * row);
  out->gen.resize(n);
  out->scores.resize(n);
  for (size_t i = 0; i < n; ++i) {
    const size_t j = order[i];
    out->pos[i] = pos[j];
    out->gen[i] = gen[j];
    out->scores[i] = scores[j];
    std::memcpy(&out->k[i * row], &k[j * row], row);
    std::memcpy(&out->v[i * row], &v[j * row], row);
  }
  return true;
}

}  // namespace

bool take_snapshot(const Bench& bench, engine::Engine* full, const std::vector<int32_t>& prompt,
                   Snapshot* out, std::string* err) {
  const uint32_t layers = bench.kv.n_layers;
  out->tokens = prompt.size();
  out->logits.resize(bench.model->config.n_vocab);
  if (!full->prefill(prompt.data(), uint32_t(prompt.size()), out->logits.data(), err,
                     engine::Engine::PrefillMode::Observe))
    return false;
  out->k.resize(layers);
  out->v.resize(layers);
  out->scores.resize(layers);
  for (uint32_t l = 0; l < layers; ++l) {
    LayerView view;
    if (!read_layer(bench, *full, l, &view, err)) return false;
    for (size_t i = 0; i < view.pos.size(); ++i) {
      if (view.pos[i] != int32_t(i)) {
        *err = "snapshot: the full cache of layer " + std::to_string(l) + " lacks position " +
               std::to_string(i) + " (a full-cache prefill must keep every token)";
        return false;
      }
    }
    if (view.pos.size() != prompt.size()) {
      *err = "snapshot: layer " + std::to_string(l) + " holds " +
             std::to_string(view.pos.size()) + " tokens, the prompt has " +
             std::to_string(prompt.size());
      return false;
    }
    out->k[l] = std::move(view.k);
    out->v[l] = std::move(view.v);
    out->scores[l] = std::move(view.scores);
  }
  return true;
}

bool replay(const Bench& bench, const Snapshot& snap, engine::Engine* engine,
            uint64_t* position_offset, std::string* err) {
  kvgc_heap* heap = engine->heap();
  const kvgc_seq seq = engine->sequence();
  bool resumed = false;
  std::vector<uint8_t> k;
  for (uint32_t l = 0; l < bench.kv.n_layers; ++l) {
    k = snap.k[l];
    if constexpr (!Resumable<engine::Engine>) rope_shift(bench, k.data(), snap.tokens, -int64_t(snap.tokens));
    if (!kvgc_ok(kvgc_append(heap, seq, l, k.data(), snap.v[l].data(), uint32_t(snap.tokens),
                             nullptr), "kvgc_append", heap, err) ||
        !kvgc_ok(kvgc_observe(heap, seq, l, snap.scores[l].data(), snap.tokens, nullptr),
                 "kvgc_observe", heap, err))
      return false;
  }
  // The snapshot's scores are unpooled (full_config's engine): this engine pools them at
  // its own radius, as its own observe prefill would before the step.
  if (!engine->end_observe_scores(seq, 0, err)) return false;
  if (!try_resume(engine, snap.tokens, &resumed, err)) return false;
  *position_offset = resumed ? 0 : snap.tokens;
  const kvgc_status s = kvgc_step(heap, seq, nullptr);
  return s == KVGC_EBUDGET || kvgc_ok(s, "kvgc_step", heap, err);
}

bool replayable(const Config& config) {
  if (config.from_env) return false;  // its decay is whatever KVGC_RECENT_DECAY says
  if (config.reconstruct > 0) return false;
  kvgc_heap_options defaults;
  kvgc_heap_options_init(&defaults);
  const double decay = config.library_defaults ? defaults.recent_decay : config.recent_decay;
  return decay == 1.0;
}

bool prefill_or_replay(const Bench& bench, const Config& config, const Snapshot& snap,
                       const std::vector<int32_t>& prompt, engine::Engine* engine,
                       uint64_t* offset, std::string* err) {
  if (replayable(config)) return replay(bench, snap, engine, offset, err);
  *offset = 0;
  std::vector<float> logits(bench.model->config.n_vocab);
  // The same prompt, so the same last logits as the snapshot's (computed before eviction).
  return engine->prefill(prompt.data(), uint32_t(prompt.size()), logits.data(), err,
                         engine::Engine::PrefillMode::Observe);
}

bool compare_replay(const Bench& bench, const engine::Engine& replayed, uint64_t offset,
                    const engine::Engine& fresh, bool demotes, bool* same, std::string* what,
                    std::string* err) {
  *same = true;
  auto differ = [&](const std::string& s) {
    *same = false;
    *what = s;
    return true;
  };
  KvHeld a, b;
  if (!kv_held(replayed, bench.kv.n_layers, 1, &a, err) ||
      !kv_held(fresh, bench.kv.n_layers, 1, &b, err))
    return false;
  for (int c = 0; c < 4; ++c)
    if (a.class_bytes[c] != b.class_bytes[c])
      return differ("class " + std::to_string(c) + " holds " + std::to_string(a.class_bytes[c]) +
                    " bytes replayed, " + std::to_string(b.class_bytes[c]) + " fresh");
  const size_t es = dtype_bytes(bench.kv.dtype);
  const size_t hd = bench.kv.head_dim;
  for (uint32_t l = 0; l < bench.kv.n_layers; ++l) {
    LayerView r, f;
    if (!read_layer(bench, replayed, l, &r, err) || !read_layer(bench, fresh, l, &f, err))
      return false;
    const std::string at = "layer " + std::to_string(l) + ": ";
    if (r.pos != f.pos)
      return differ(at + "live positions differ (" + std::to_string(r.pos.size()) + " vs " +
                    std::to_string(f.pos.size()) + " tokens)");
    if (r.gen != f.gen) return differ(at + "generations differ");
    if (std::memcmp(r.scores.data(), f.scores.data(), r.scores.size() * sizeof(float)) != 0)
      return differ(at + "scores differ");
    if (r.v != f.v) return differ(at + "V differs");
    if (offset != 0) rope_shift(bench, r.k.data(), r.pos.size(), int64_t(offset));
    // K per head: the largest difference relative to the head's largest element.
    const size_t heads = r.k.size() / (hd * es);
    for (size_t h = 0; h < heads; ++h) {
      float peak = 0, diff = 0;
      for (size_t i = 0; i < hd; ++i) {
        const float x = load(&f.k[(h * hd + i) * es], bench.kv.dtype);
        const float y = load(&r.k[(h * hd + i) * es], bench.kv.dtype);
        peak = std::max(peak, std::abs(x));
        diff = std::max(diff, std::abs(x - y));
      }
      // One rotation's rounding (f32: ~1e-6; f16: one ulp, 2^-10); a quantized key may
      // differ by up to a quantization step (int4: 1/15 of the range: 2/15 of the peak),
      // and rotating it back mixes each pair (up to sqrt(2) more in one element).
      const float rounding = es == 4 ? 1e-5f : 2e-3f;
      const float limit = (demotes ? 0.2f : rounding) * std::max(peak, 1e-6f);
      if (diff > limit)
        return differ(at + "K of token " + std::to_string(r.pos[h / bench.kv.n_kv_heads]) +
                      " differs by " + std::to_string(diff / std::max(peak, 1e-6f)) +
                      " of its peak");
    }
  }
  return true;
}

}  // namespace quality
