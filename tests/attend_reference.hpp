// A naive float64 dense softmax over a segment's live tokens, read back through kvgc_read
// (int8/int4 slots dequantised, shared ones at their page's precision): what kvgc_attend's
// output and per-token mass are checked against.
#pragma once

#include <doctest/doctest.h>

#include <cmath>
#include <vector>

#include "../kernels/cpu/convert.hpp"
#include "util.hpp"

namespace kvgc_test {

struct Reference {
  std::vector<double> out;   // [n_q][q_heads][head_dim]
  std::vector<double> mass;  // [live] in read order
};

inline std::vector<float> to_float(const std::vector<uint8_t>& raw, kvgc_dtype t) {
  const size_t eb = t == KVGC_DTYPE_F32 ? 4 : 2;
  std::vector<float> f(raw.size() / eb);
  for (size_t i = 0; i < f.size(); ++i) f[i] = kvgc::cpu::load(&raw[i * eb], t);
  return f;
}

inline Reference reference(kvgc_heap* h, const kvgc_model_desc& m, kvgc_seq s, uint32_t layer,
                    const std::vector<uint8_t>& q, uint32_t n_q, double scale) {
  uint64_t n = 0, length = 0;
  REQUIRE(kvgc_seq_tokens(h, s, layer, &n, &length) == KVGC_OK);
  std::vector<uint8_t> k(n * token_bytes(m) + 1), v(k.size());
  std::vector<int32_t> pos(n + 1);
  REQUIRE(kvgc_read(h, s, layer, k.data(), v.data(), pos.data(), n, &n, nullptr) == KVGC_OK);
  const auto kf = to_float(k, m.dtype), vf = to_float(v, m.dtype), qf = to_float(q, m.dtype);
  const uint32_t hd = m.head_dim, group = m.n_q_heads / m.n_kv_heads;
  Reference r;
  r.out.assign(size_t(n_q) * m.n_q_heads * hd, 0.0);
  r.mass.assign(n, 0.0);
  for (uint32_t i = 0; i < n_q; ++i) {
    const int64_t qpos = int64_t(length) - n_q + i;
    for (uint32_t j = 0; j < m.n_q_heads; ++j) {
      const uint32_t kh = j / group;
      const float* qv = &qf[(size_t(i) * m.n_q_heads + j) * hd];
      std::vector<double> logit(n, -INFINITY);
      double mx = -INFINITY;
      for (uint64_t t = 0; t < n; ++t) {
        if (pos[t] > qpos) continue;
        double d = 0;
        for (uint32_t e = 0; e < hd; ++e) d += double(qv[e]) * kf[(t * m.n_kv_heads + kh) * hd + e];
        logit[t] = d * scale;
        mx = std::max(mx, logit[t]);
      }
      if (!std::isfinite(mx)) continue;  // sees nothing: zeros
      double sum = 0;
      for (uint64_t t = 0; t < n; ++t) sum += std::isfinite(logit[t]) ? std::exp(logit[t] - mx) : 0;
      for (uint64_t t = 0; t < n; ++t) {
        if (!std::isfinite(logit[t])) continue;
        const double p = std::exp(logit[t] - mx) / sum;
        r.mass[t] += p;
        for (uint32_t e = 0; e < hd; ++e)
          r.out[(size_t(i) * m.n_q_heads + j) * hd + e] += p * vf[(t * m.n_kv_heads + kh) * hd + e];
      }
    }
  }
  return r;
}

}  // namespace kvgc_test
