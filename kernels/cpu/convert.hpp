// Scalar conversions between the model dtypes and float, for the CPU executor.
// Round-to-nearest-even, with NaN and infinities preserved.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "kvgc.h"

namespace kvgc::cpu {

inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      const float f = std::ldexp(float(man), -24);
      std::memcpy(&bits, &f, 4);
      bits |= sign;
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t f32_to_f16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint16_t sign = uint16_t((x >> 16) & 0x8000u);
  const uint32_t ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) return uint16_t(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0));
  if (ax >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // rounds past 65504: inf
  if (ax < 0x38800000u) {                                   // below 2^-14: subnormal
    const float a = std::fabs(f);
    return uint16_t(sign | uint16_t(std::nearbyint(a * 16777216.0f)));  // units of 2^-24
  }
  const uint32_t rounded = ax + 0xfffu + ((ax >> 13) & 1u);  // nearest even at bit 13
  return uint16_t(sign | ((rounded - 0x38000000u) >> 13));
}

inline float bf16_to_f32(uint16_t h) {
  const uint32_t bits = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  if ((x & 0x7fffffffu) > 0x7f800000u) return uint16_t((x >> 16) | 0x40u);  // quiet NaN
  return uint16_t((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

inline float load(const uint8_t* p, kvgc_dtype t) {
  if (t == KVGC_DTYPE_F32) {
    float f;
    std::memcpy(&f, p, 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, p, 2);
  return t == KVGC_DTYPE_F16 ? f16_to_f32(h) : bf16_to_f32(h);
}

inline void store(uint8_t* p, kvgc_dtype t, float f) {
  if (t == KVGC_DTYPE_F32) {
    std::memcpy(p, &f, 4);
    return;
  }
  const uint16_t h = t == KVGC_DTYPE_F16 ? f32_to_f16(f) : f32_to_bf16(f);
  std::memcpy(p, &h, 2);
}

}  // namespace kvgc::cpu
