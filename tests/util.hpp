// Shared test helpers: model shapes, tagged K/V data and a verifying reader.
//
// Every element is a hash of (sequence, layer, position, head, dim, k|v): appends and
// reads move bytes, never arithmetic, so any misplaced byte shows as a wrong tag.
#pragma once

#include <cstdint>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kvgc.h"

namespace kvgc_test {

// A fresh seed for a randomised test, printed so that a failure can be replayed:
// KVGC_TEST_SEED=N reruns every randomised test with seed N.
inline uint32_t fresh_seed(const char* test) {
  uint32_t seed;
  if (const char* env = std::getenv("KVGC_TEST_SEED"); env && *env)
    seed = uint32_t(std::strtoul(env, nullptr, 10));
  else
    seed = std::random_device{}();
  std::printf("%s: seed %u (KVGC_TEST_SEED=%u replays it)\n", test, seed, seed);
  return seed;
}

// The relative RMS error an attention output in `t` may carry against a float64 reference.
// Outputs are rounded to the model's dtype, so the bound is a few of its unit roundoffs:
// f16 2^-11 (2e-3 is 4 of them), bf16 2^-8 (1e-2 is 2.5: bf16 rounding alone reaches
// 2e-3 RMS on some random draws, which a 2e-3 bound made a flaky test); f32 outputs keep
// the summation order's error only.
inline double output_bound(kvgc_dtype t) {
  return t == KVGC_DTYPE_F32 ? 1e-5 : t == KVGC_DTYPE_F16 ? 2e-3 : 1e-2;
}

// Relative RMS error of `got` against the reference `ref` (absolute when ref is all 0).
inline double rel_err(const std::vector<double>& ref, const std::vector<float>& got) {
  double e = 0, r = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    e += (ref[i] - got[i]) * (ref[i] - got[i]);
    r += ref[i] * ref[i];
  }
  return r > 0 ? std::sqrt(e / r) : std::sqrt(e);
}

inline uint32_t mix(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return uint32_t(x);
}

inline uint32_t tag(uint64_t seq, uint32_t layer, int64_t pos, uint32_t head, uint32_t dim,
                    bool is_v) {
  return mix((seq << 40) ^ (uint64_t(layer) << 52) ^ (uint64_t(pos) << 12) ^ (head << 20) ^
             (dim << 1) ^ uint64_t(is_v) ^ 0x9e3779b97f4a7c15ull * (pos + 1));
}

// Stores any int in an enum field, as a C caller may; a C++ cast to an out-of-range enum
// would itself be undefined.
template <class E>
void poke_enum(E& field, int value) {
  static_assert(sizeof(E) == sizeof(int));
  std::memcpy(&field, &value, sizeof value);
}

inline kvgc_model_desc model(uint32_t layers, uint32_t kv_heads, uint32_t head_dim,
                             kvgc_dtype dtype = KVGC_DTYPE_F16, uint32_t gqa = 1) {
  kvgc_model_desc m;
  kvgc_model_desc_init(&m);
  m.n_layers = layers;
  m.n_kv_heads = kv_heads;
  m.n_q_heads = kv_heads * gqa;
  m.head_dim = head_dim;
  m.dtype = dtype;
  return m;
}

inline size_t elem_bytes(const kvgc_model_desc& m) { return m.dtype == KVGC_DTYPE_F32 ? 4 : 2; }
inline size_t token_bytes(const kvgc_model_desc& m) {
  return size_t(m.n_kv_heads) * m.head_dim * elem_bytes(m);
}

// K/V bytes for positions [first, first + n), [n][kv_heads][head_dim]: put(element
// pointer, position, head, dim) writes each element.
template <class Put>
std::vector<uint8_t> generate(const kvgc_model_desc& m, int64_t first, uint32_t n, Put&& put) {
  std::vector<uint8_t> out(size_t(n) * token_bytes(m));
  const size_t eb = elem_bytes(m);
  size_t i = 0;
  for (uint32_t t = 0; t < n; ++t)
    for (uint32_t h = 0; h < m.n_kv_heads; ++h)
      for (uint32_t d = 0; d < m.head_dim; ++d, ++i) put(&out[i * eb], first + t, h, d);
  return out;
}

// Tagged K (is_v = false) or V for positions [first, first + n) of (seq, layer).
inline std::vector<uint8_t> tagged(const kvgc_model_desc& m, uint64_t seq, uint32_t layer,
                                   int64_t first, uint32_t n, bool is_v) {
  const size_t eb = elem_bytes(m);
  return generate(m, first, n, [&](uint8_t* dst, int64_t pos, uint32_t h, uint32_t d) {
    const uint32_t x = tag(seq, layer, pos, h, d, is_v);
    std::memcpy(dst, &x, eb);
  });
}

// Empty string when rows [0, n) of k/v hold the tags of positions pos[0..n).
inline std::string verify(const kvgc_model_desc& m, uint64_t seq, uint32_t layer,
                          const std::vector<uint8_t>& k, const std::vector<uint8_t>& v,
                          const std::vector<int32_t>& pos, uint64_t n) {
  const size_t eb = elem_bytes(m), tb = token_bytes(m);
  for (uint64_t r = 0; r < n; ++r) {
    const auto expect_k = tagged(m, seq, layer, pos[r], 1, false);
    const auto expect_v = tagged(m, seq, layer, pos[r], 1, true);
    if (std::memcmp(&k[r * tb], expect_k.data(), tb) != 0)
      return "K row " + std::to_string(r) + " (pos " + std::to_string(pos[r]) + ") differs";
    if (std::memcmp(&v[r * tb], expect_v.data(), tb) != 0)
      return "V row " + std::to_string(r) + " (pos " + std::to_string(pos[r]) + ") differs";
  }
  (void)eb;
  return "";
}

// K (is_v = false) or V for positions [first, first + n): N(0, 1) values in the model
// dtype, a deterministic function of (seq, layer, position, head, dim, k|v); for data
// that must survive int4 demotion within its error bound.
inline float gauss_value(uint64_t seq, uint32_t layer, int64_t pos, uint32_t h, uint32_t d, bool v) {
  const uint32_t a = tag(seq, layer, pos, h, d, v), b = mix(a ^ 0x5bd1e995u);
  const double u1 = (double(a) + 1.0) / 4294967297.0, u2 = double(b) / 4294967296.0;
  return float(std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
}

std::vector<uint8_t> gaussian(const kvgc_model_desc& m, uint64_t seq, uint32_t layer,
                              int64_t first, uint32_t n, bool is_v);

// Reads segment (seq, layer) and checks every row against gaussian(): each head's vector
// must be bit-identical, or (a demoted token) within relative RMSE `int4_tol` (0: exact
// only). Empty string if all rows pass, else what failed.
std::string verify_gaussian(kvgc_heap* heap, const kvgc_model_desc& m, uint64_t seq,
                            uint32_t layer, double int4_tol);
// One token's K (is_v false) or V rows, read back at `got`, against gaussian(m, tag, layer,
// pos): "" when every head is bit-identical or within relative RMSE int4_tol, else which
// head differs and by how much.
std::string compare_gaussian_row(const kvgc_model_desc& m, uint64_t tag, uint32_t layer, int32_t pos,
                                 const uint8_t* got, bool is_v, double int4_tol);
// The same for a sequence whose tokens were made for sequence `tag` (a fork's source).
std::string verify_gaussian(kvgc_heap* heap, const kvgc_model_desc& m, uint64_t seq,
                            uint64_t tag, uint32_t layer, double int4_tol);

// Options for tests: CPU, a fixed budget, environment ignored (tests must not depend
// on the caller's shell), eviction only (the default ladder is off here: tests of the
// ladder ask for their rungs, so every other test's positions mean what it kept).
inline kvgc_heap_options cpu_options(uint64_t budget_bytes, uint32_t page_tokens = 16) {
  kvgc_heap_options o;
  kvgc_heap_options_init(&o);
  o.flags = KVGC_OPT_IGNORE_ENV;
  o.device = KVGC_DEVICE_CPU;
  o.budget_bytes = budget_bytes;
  o.page_tokens = page_tokens;
  o.slab_bytes = 64 << 10;
  o.demote = KVGC_DEMOTE_OFF;
  o.min_length = 0;  // budgets from the first token: the tests' sequences are short
  return o;
}

}  // namespace kvgc_test
