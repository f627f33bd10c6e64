#include "quant.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>

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

void quantize_row(const uint8_t* src, kvgc_dtype dtype, uint32_t head_dim, uint8_t* codes,
                  uint16_t* qparams, uint32_t bits) {
  const uint32_t group = int4_group(head_dim);
  const float top = float((1u << bits) - 1);  // the largest code: 15 (int4) or 3 (int2)
  const uint32_t per_byte = 8 / bits;
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
    const uint16_t scale_h = to16_directed((hi - zero) / top, qt, true);
    const float scale = from16(scale_h, qt);
    qparams[2 * g] = scale_h;
    qparams[2 * g + 1] = zero_h;
    for (uint32_t i = g * group; i < (g + 1) * group; ++i) {
      const float x = load(src + i * eb, dtype);
      float q = scale > 0 ? std::nearbyint((x - zero) / scale) : 0.f;
      q = std::isfinite(q) ? std::clamp(q, 0.f, top) : (x > zero ? top : 0.f);
      const uint8_t n = uint8_t(q);
      const uint32_t shift = bits * (i % per_byte);
      if (shift == 0) codes[i / per_byte] = n;
      else codes[i / per_byte] = uint8_t(codes[i / per_byte] | (n << shift));
    }
  }
}

void dequantize_row(const uint8_t* codes, const uint16_t* qparams, kvgc_dtype dtype,
                    uint32_t head_dim, uint8_t* dst, uint32_t bits) {
  const uint32_t group = int4_group(head_dim);
  const uint32_t per_byte = 8 / bits, mask = (1u << bits) - 1;
  const kvgc_dtype qt = qparam_dtype(dtype);
  const uint32_t eb = dtype_bytes(dtype);
  for (uint32_t i = 0; i < head_dim; ++i) {
    const uint32_t g = i / group;
    const float scale = from16(qparams[2 * g], qt), zero = from16(qparams[2 * g + 1], qt);
    const uint8_t n = uint8_t((codes[i / per_byte] >> (bits * (i % per_byte))) & mask);
    store(dst + i * eb, dtype, float(n) * scale + zero);
  }
}

void quantize_row_int8(const uint8_t* src, kvgc_dtype dtype, uint32_t head_dim, int8_t* q,
                       uint16_t* scale_out) {
  const kvgc_dtype qt = qparam_dtype(dtype);
  const uint32_t eb = dtype_bytes(dtype);
  float amax = 0;
  for (uint32_t i = 0; i < head_dim; ++i) {
    const float x = load(src + i * eb, dtype);
    if (std::isfinite(x)) amax = std::max(amax, std::fabs(x));
  }
  const uint16_t scale_h = to16_directed(amax / 127.0f, qt, true);
  const float scale = from16(scale_h, qt);
  *scale_out = scale_h;
  for (uint32_t i = 0; i < head_dim; ++i) {
    const float x = load(src + i * eb, dtype);
    float v = scale > 0 ? std::nearbyint(x / scale) : 0.f;
    // Infinities saturate; NaN (and anything non-finite the division made) reads as 0.
    v = std::isfinite(v) ? std::clamp(v, -127.f, 127.f) : std::isinf(x) ? (x > 0 ? 127.f : -127.f) : 0.f;
    q[i] = int8_t(v);
  }
}

float int8_scale_f32(uint16_t scale, kvgc_dtype dtype) { return from16(scale, qparam_dtype(dtype)); }

void dequantize_row_int8(const int8_t* q, const uint16_t* scale_h, kvgc_dtype dtype,
                         uint32_t head_dim, uint8_t* dst) {
  const float scale = int8_scale_f32(*scale_h, dtype);
  const uint32_t eb = dtype_bytes(dtype);
  for (uint32_t i = 0; i < head_dim; ++i) store(dst + i * eb, dtype, float(q[i]) * scale);
}

void load_row(const PageLayout& L, const uint8_t* page, uint32_t head, uint32_t slot, bool v,
              uint8_t* dst) {
  const uint8_t* row = page + (v ? L.v_off : L.k_off) + head * L.head_stride + slot * L.slot_stride;
  const auto* qp = reinterpret_cast<const uint16_t*>(page + (v ? L.vq_off : L.kq_off)) +
                   L.qparam_index(head, slot);
  switch (L.cls) {
    case KVGC_CLASS_INT8:
      dequantize_row_int8(reinterpret_cast<const int8_t*>(row), qp, L.dtype, L.head_dim, dst);
      break;
    case KVGC_CLASS_INT4:
    case KVGC_CLASS_INT2: dequantize_row(row, qp, L.dtype, L.head_dim, dst, group_bits(L.cls)); break;
    default: std::memcpy(dst, row, size_t(L.head_dim) * dtype_bytes(L.dtype)); break;
  }
}

void store_row(const PageLayout& L, uint8_t* page, uint32_t head, uint32_t slot, bool v,
               const uint8_t* src) {
  uint8_t* row = page + (v ? L.v_off : L.k_off) + head * L.head_stride + slot * L.slot_stride;
  auto* qp = reinterpret_cast<uint16_t*>(page + (v ? L.vq_off : L.kq_off)) + L.qparam_index(head, slot);
  switch (L.cls) {
    case KVGC_CLASS_INT8:
      quantize_row_int8(src, L.dtype, L.head_dim, reinterpret_cast<int8_t*>(row), qp);
      break;
    case KVGC_CLASS_INT4:
    case KVGC_CLASS_INT2: quantize_row(src, L.dtype, L.head_dim, row, qp, group_bits(L.cls)); break;
    default: std::memcpy(row, src, size_t(L.head_dim) * dtype_bytes(L.dtype)); break;
  }
}

}  // namespace kvgc::cpu
