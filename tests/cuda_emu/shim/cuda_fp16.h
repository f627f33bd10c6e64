// Host emulation of cuda_fp16.h (tests/cuda_emu): __half and the conversions kvgc's
// kernels use, bit-exact with CUDA's: f16 -> f32 is exact; f32 -> f16 rounds to nearest
// even, overflows to infinity and turns every NaN into the canonical 0x7fff, as
// __float2half_rn does.
#pragma once
#include <bit>
#include <cstdint>
struct __half { uint16_t __x; };
inline float __half2float(__half h) {
  const uint32_t sign = uint32_t(h.__x & 0x8000u) << 16, exp = (h.__x >> 10) & 0x1fu, man = h.__x & 0x3ffu;
  if (exp == 0) {
    const float m = float(man) * 5.9604644775390625e-8f;  // man * 2^-24, exact
    return std::bit_cast<float>(std::bit_cast<uint32_t>(m) | sign);
  }
  if (exp == 31) return std::bit_cast<float>(sign | 0x7f800000u | (man << 13));
  return std::bit_cast<float>(sign | ((exp + 112) << 23) | (man << 13));
}
inline __half __float2half_rn(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f), sign = (x >> 16) & 0x8000u, u = x & 0x7fffffffu;
  if (u > 0x7f800000u) return {0x7fff};
  if (u >= 0x477ff000u) return {uint16_t(sign | 0x7c00u)};  // >= 65520: infinity
  if (u >= 0x38800000u) {                                  // normal
    const uint32_t r = u - (112u << 23), rem = r & 0x1fffu;
    uint32_t h = r >> 13;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
    return {uint16_t(sign | h)};
  }
  if (u <= 0x33000000u) return {uint16_t(sign)};  // <= 2^-25: zero (the tie goes to even)
  const uint32_t e = u >> 23, m = (u & 0x7fffffu) | 0x800000u, s = 126 - e;
  const uint32_t rem = m & ((1u << s) - 1), half = 1u << (s - 1);
  uint32_t h = m >> s;
  if (rem > half || (rem == half && (h & 1u))) ++h;
  return {uint16_t(sign | h)};
}
inline __half __float2half(float f) { return __float2half_rn(f); }
inline uint16_t __half_as_ushort(__half h) { return h.__x; }
inline __half __ushort_as_half(uint16_t u) { return {u}; }
