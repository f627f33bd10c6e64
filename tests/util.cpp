#include "util.hpp"

#include "../kernels/cpu/convert.hpp"

namespace kvgc_test {

std::vector<uint8_t> gaussian(const kvgc_model_desc& m, uint64_t seq, uint32_t layer,
                              int64_t first, uint32_t n, bool is_v) {
  return generate(m, first, n, [&](uint8_t* dst, int64_t pos, uint32_t h, uint32_t d) {
    kvgc::cpu::store(dst, m.dtype, gauss_value(seq, layer, pos, h, d, is_v));
  });
}

std::string verify_gaussian(kvgc_heap* heap, const kvgc_model_desc& m, uint64_t seq,
                            uint32_t layer, double int4_tol) {
  return verify_gaussian(heap, m, seq, seq, layer, int4_tol);
}

std::string compare_gaussian_row(const kvgc_model_desc& m, uint64_t tag, uint32_t layer, int32_t pos,
                                 const uint8_t* got, bool is_v, double int4_tol) {
  const size_t eb = elem_bytes(m), row = m.head_dim * eb;
  const auto expect = gaussian(m, tag, layer, pos, 1, is_v);
  for (uint32_t h = 0; h < m.n_kv_heads; ++h) {
    if (std::memcmp(got + h * row, expect.data() + h * row, row) == 0) continue;
    double err = 0, ref = 0;
    for (uint32_t d = 0; d < m.head_dim; ++d) {
      const double x = kvgc::cpu::load(&expect[h * row + d * eb], m.dtype);
      const double y = kvgc::cpu::load(got + h * row + d * eb, m.dtype);
      err += (x - y) * (x - y);
      ref += x * x;
    }
    const double rel = std::sqrt(err / ref);
    if (!(rel <= int4_tol))
      return std::string(is_v ? "V" : "K") + " of position " + std::to_string(pos) + " head " +
             std::to_string(h) + " differs (relative RMSE " + std::to_string(rel) + ")";
  }
  return "";
}

std::string verify_gaussian(kvgc_heap* heap, const kvgc_model_desc& m, uint64_t seq,
                            uint64_t tag, uint32_t layer, double int4_tol) {
  uint64_t n = 0;
  if (kvgc_read(heap, seq, layer, nullptr, nullptr, nullptr, 0, &n, nullptr) != KVGC_OK)
    return std::string("kvgc_read: ") + kvgc_errmsg(heap);
  const size_t tb = token_bytes(m);
  std::vector<uint8_t> k(n * tb + 1), v(n * tb + 1);
  std::vector<int32_t> pos(n + 1);
  if (kvgc_read(heap, seq, layer, k.data(), v.data(), pos.data(), n, &n, nullptr) != KVGC_OK)
    return std::string("kvgc_read: ") + kvgc_errmsg(heap);
  for (uint64_t r = 0; r < n; ++r) {
    for (int is_v = 0; is_v < 2; ++is_v) {
      const uint8_t* got = (is_v ? v.data() : k.data()) + r * tb;
      if (std::string bad = compare_gaussian_row(m, tag, layer, pos[r], got, is_v, int4_tol); !bad.empty())
        return bad;
    }
  }
  return "";
}

}  // namespace kvgc_test
