#include "quant.hpp"

#include <algorithm>
#include <cmath>

#include "convert.hpp"

namespace kvgc::cpu {
namespace {

float from16(uint16_t h, kvgc_dtype t) { return t == KVGC_DTYPE_F16 ? f16_to_f32(h) : bf16_to_f32(h); }
uint16_t to16(float f, kvgc_dtype t) { return t == KVGC_DTYPE_F16 ? f32_to_f16(f) : f32_to_bf16(f); }

// The 16-bit value nearest to x on the requested side: <= x (down) or >= x (up).
uint16_t to16_directed(float x, kvgc_dtype t, bool up) {
  uint16_t h = to16(x, t);
  const float y = from16(h, t);
  if (std::isfinite(y) && (up ? y < x : y > x)) {
    // One ulp toward the requested side: magnitude grows or shrinks with the sign bit.
    const bool neg = h & 0x8000u;
    const bool grow = up != neg;
    if ((h & 0x7fffu) == 0 && !grow) h = uint16_t((h ^ 0x8000u) + 1);  // +-0 -> smallest opposite
    else h = uint16_t(grow ? h + 1 : h - 1);
  }
  return h;
}

}  // namespace

void quantize_row(const uint8_t* src, kvgc_dtype dtype, uint32_t head_dim, uint8_t* nibbles,
                  uint16_t* qparams) {
  const uint32_t group = int4_group(head_dim);
  const kvgc_dtype qt = qparam_dtype(dtype);
  const uint32_t eb = dtype_bytes(dtype);
  for (uint32_t g = 0; g < head_dim / group; ++g) {
    float lo = INFINITY, hi = -INFINITY;
    for (uint32_t i = g * group; i < (g + 1) * group; ++i) {
      const float x = load(src + i * eb, dtype);
      if (std::isfinite(x)) {
        lo = std::min(lo, x);
        hi = std::max(hi, x);
      }
    }
    if (!(lo <= hi)) lo = hi = 0;  // no finite value: the group quantises to zeros
    const uint16_t zero_h = to16_directed(lo, qt, false);
    const float zero = from16(zero_h, qt);
    const uint16_t scale_h = to16_directed((hi - zero) / 15.0f, qt, true);
    const float scale = from16(scale_h, qt);
    qparams[2 * g] = scale_h;
    qparams[2 * g + 1] = zero_h;
    for (uint32_t i = g * group; i < (g + 1) * group; ++i) {
      const float x = load(src + i * eb, dtype);
      float q = scale > 0 ? std::nearbyint((x - zero) / scale) : 0.f;
      q = std::isfinite(q) ? std::clamp(q, 0.f, 15.f) : (x > zero ? 15.f : 0.f);
      const uint8_t n = uint8_t(q);
      if (i % 2 == 0) nibbles[i / 2] = n;
      else nibbles[i / 2] = uint8_t(nibbles[i / 2] | (n << 4));
    }
  }
}

void dequantize_row(const uint8_t* nibbles, const uint16_t* qparams, kvgc_dtype dtype,
                    uint32_t head_dim, uint8_t* dst) {
  const uint32_t group = int4_group(head_dim);
  const kvgc_dtype qt = qparam_dtype(dtype);
  const uint32_t eb = dtype_bytes(dtype);
  for (uint32_t i = 0; i < head_dim; ++i) {
    const uint32_t g = i / group;
    const float scale = from16(qparams[2 * g], qt), zero = from16(qparams[2 * g + 1], qt);
    const uint8_t n = (nibbles[i / 2] >> (4 * (i % 2))) & 0xfu;
    store(dst + i * eb, dtype, float(n) * scale + zero);
  }
}

}  // namespace kvgc::cpu
