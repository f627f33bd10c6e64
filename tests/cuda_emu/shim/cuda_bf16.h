// Host emulation of cuda_bf16.h (tests/cuda_emu): __nv_bfloat16 and its conversions,
// bit-exact with CUDA's: bf16 -> f32 is exact; f32 -> bf16 rounds to nearest even and
// turns every NaN into the canonical 0x7fff, as __float2bfloat16_rn does.
#pragma once
#include <bit>
#include <cstdint>
struct __nv_bfloat16 { uint16_t __x; };
inline float __bfloat162float(__nv_bfloat16 b) { return std::bit_cast<float>(uint32_t(b.__x) << 16); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return {0x7fff};
  return {uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16)};
}
inline __nv_bfloat16 __float2bfloat16(float f) { return __float2bfloat16_rn(f); }
inline uint16_t __bfloat16_as_ushort(__nv_bfloat16 b) { return b.__x; }
inline __nv_bfloat16 __ushort_as_bfloat16(uint16_t u) { return {u}; }
