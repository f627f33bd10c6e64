// Device twins of kernels/cpu/convert.hpp and quant.cpp: conversions between the model
// dtypes and float, and int8 / int4 quantisation of one head row, written to give the CPU
// specification's bits exactly (same rounding, same NaN patterns, same operation
// order, no fused multiply-add: every product that meets a sum goes through __fmul_rn /
// __fadd_rn so nvcc cannot contract it). Included by the .cu files only.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../page_layout.hpp"

namespace kvgc::cuda::dev {

// page_layout.hpp's dtype_bytes and qparam_dtype, callable on the device.
__device__ __forceinline__ uint32_t elem_bytes(kvgc_dtype d) { return d == KVGC_DTYPE_F32 ? 4u : 2u; }
__device__ __forceinline__ kvgc_dtype qtype(kvgc_dtype model) {
  return model == KVGC_DTYPE_F16 ? KVGC_DTYPE_F16 : KVGC_DTYPE_BF16;
}

__device__ __forceinline__ float f16_to_f32(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: man * 2^-24 is exact in f32
      bits = __float_as_uint(__fmul_rn(float(man), 5.9604644775390625e-8f)) | sign;
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  }
  return __uint_as_float(bits);
}

__device__ __forceinline__ uint16_t f32_to_f16(float f) {
  const uint32_t x = __float_as_uint(f);
  const uint16_t sign = uint16_t((x >> 16) & 0x8000u);
  const uint32_t ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) return uint16_t(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0));
  if (ax >= 0x477ff000u) return uint16_t(sign | 0x7c00u);
  if (ax < 0x38800000u) return uint16_t(sign | uint16_t(rintf(__fmul_rn(fabsf(f), 16777216.0f))));
  const uint32_t rounded = ax + 0xfffu + ((ax >> 13) & 1u);
  return uint16_t(sign | ((rounded - 0x38000000u) >> 13));
}

__device__ __forceinline__ float bf16_to_f32(uint16_t h) { return __uint_as_float(uint32_t(h) << 16); }

__device__ __forceinline__ uint16_t f32_to_bf16(float f) {
  const uint32_t x = __float_as_uint(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return uint16_t((x >> 16) | 0x40u);
  return uint16_t((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

__device__ __forceinline__ float load(const uint8_t* p, kvgc_dtype t) {
  if (t == KVGC_DTYPE_F32) return *reinterpret_cast<const float*>(p);
  const uint16_t h = *reinterpret_cast<const uint16_t*>(p);
  return t == KVGC_DTYPE_F16 ? f16_to_f32(h) : bf16_to_f32(h);
}

__device__ __forceinline__ void store(uint8_t* p, kvgc_dtype t, float f) {
  if (t == KVGC_DTYPE_F32) {
    *reinterpret_cast<float*>(p) = f;
    return;
  }
  *reinterpret_cast<uint16_t*>(p) = t == KVGC_DTYPE_F16 ? f32_to_f16(f) : f32_to_bf16(f);
}

__device__ __forceinline__ float from16(uint16_t h, kvgc_dtype t) {
  return t == KVGC_DTYPE_F16 ? f16_to_f32(h) : bf16_to_f32(h);
}
__device__ __forceinline__ uint16_t to16(float f, kvgc_dtype t) {
  return t == KVGC_DTYPE_F16 ? f32_to_f16(f) : f32_to_bf16(f);
}

// quant.cpp's to16_directed: the 16-bit value nearest to x on the requested side.
__device__ __forceinline__ uint16_t to16_directed(float x, kvgc_dtype t, bool up) {
  uint16_t h = to16(x, t);
  const float y = from16(h, t);
  if (isfinite(y) && (up ? y < x : y > x)) {
    const bool neg = h & 0x8000u;
    const bool grow = up != neg;
    if ((h & 0x7fffu) == 0 && !grow) h = uint16_t((h ^ 0x8000u) + 1);
    else h = uint16_t(grow ? h + 1 : h - 1);
  }
  return h;
}

// x rounded to the model dtype and back: what a model-dtype row holds of a value.
__device__ __forceinline__ float model_round(float x, kvgc_dtype t) {
  return t == KVGC_DTYPE_F32 ? x : from16(to16(x, t), t);
}

// quant.cpp's quantize_row for one group [g * group, (g + 1) * group) of a head row given
// as floats (model-dtype values): min/max with the same comparisons in the same order (so
// -0/+0 come out the same), zero rounded down, scale up, q = rint((x - zero) / scale)
// clamped to 0..15.
__device__ inline void quantize_group(const float* src, kvgc_dtype dtype, uint32_t group,
                                      uint32_t g, uint8_t* nibbles, uint16_t* qparams,
                                      uint32_t bits = 4) {
  const kvgc_dtype qt = qtype(dtype);
  const float top = float((1u << bits) - 1);  // 15 (int4) or 3 (int2)
  const uint32_t per_byte = 8 / bits;
  float lo = INFINITY, hi = -INFINITY;
  for (uint32_t i = g * group; i < (g + 1) * group; ++i) {
    const float x = src[i];
    if (isfinite(x)) {
      if (x < lo) lo = x;  // std::min(lo, x)
      if (hi < x) hi = x;  // std::max(hi, x)
    }
  }
  if (!(lo <= hi)) lo = hi = 0;
  const uint16_t zero_h = to16_directed(lo, qt, false);
  const float zero = from16(zero_h, qt);
  const uint16_t scale_h = to16_directed(__fdiv_rn(__fsub_rn(hi, zero), top), qt, true);
  const float scale = from16(scale_h, qt);
  qparams[2 * g] = scale_h;
  qparams[2 * g + 1] = zero_h;
  // Groups are 32 elements or the whole (even) row, so a group starts on a byte; the
  // last byte of a row whose length is not a multiple of per_byte is zero-padded.
  for (uint32_t i = g * group; i < (g + 1) * group; i += per_byte) {
    uint8_t byte = 0;
    for (uint32_t j = 0; j < per_byte && i + j < (g + 1) * group; ++j) {
      const float x = src[i + j];
      float q = scale > 0 ? rintf(__fdiv_rn(__fsub_rn(x, zero), scale)) : 0.f;
      q = isfinite(q) ? (q < 0.f ? 0.f : top < q ? top : q) : (x > zero ? top : 0.f);
      byte = uint8_t(byte | (uint8_t(q) << (bits * j)));
    }
    nibbles[i / per_byte] = byte;
  }
}

// quant.cpp's dequantize_row for element i: n * scale + zero, rounded twice (no FMA).
__device__ __forceinline__ float dequantize(const uint8_t* nibbles, const uint16_t* qparams,
                                            kvgc_dtype dtype, uint32_t group, uint32_t i,
                                            uint32_t bits = 4) {
  const kvgc_dtype qt = qtype(dtype);
  const uint32_t g = i / group, per_byte = 8 / bits;
  const float scale = from16(qparams[2 * g], qt), zero = from16(qparams[2 * g + 1], qt);
  const uint32_t n = (nibbles[i / per_byte] >> (bits * (i % per_byte))) & ((1u << bits) - 1);
  return __fadd_rn(__fmul_rn(float(n), scale), zero);
}

// quant.cpp's int8 scale of a row given as floats: max |x| over finite x (order does not
// matter to a maximum), / 127, rounded up to the 16-bit type.
__device__ inline uint16_t int8_scale(const float* src, kvgc_dtype dtype, uint32_t hd) {
  float amax = 0;
  for (uint32_t i = 0; i < hd; ++i)
    if (isfinite(src[i]) && amax < fabsf(src[i])) amax = fabsf(src[i]);
  return to16_directed(__fdiv_rn(amax, 127.0f), qtype(dtype), true);
}
// quant.cpp's quantize_row_int8 for element i, given the row's scale.
__device__ __forceinline__ int8_t int8_quantize(float x, uint16_t scale_h, kvgc_dtype dtype) {
  const float scale = from16(scale_h, qtype(dtype));
  float v = scale > 0 ? rintf(__fdiv_rn(x, scale)) : 0.f;
  v = isfinite(v) ? (v < -127.f ? -127.f : 127.f < v ? 127.f : v) : isinf(x) ? (x > 0 ? 127.f : -127.f) : 0.f;
  return int8_t(v);
}
// quant.cpp's dequantize_row_int8 for element i: q * scale, exact in f32.
__device__ __forceinline__ float dequantize_int8(const int8_t* q, const uint16_t* scale,
                                                 kvgc_dtype dtype, uint32_t i) {
  return __fmul_rn(float(q[i]), from16(*scale, qtype(dtype)));
}

// Element d of (head h, slot s)'s K (v = false) or V row on a page of layout L, as the
// model dtype holds it (quant.cpp's load_row): FP16 as stored, INT8 and INT4 dequantised
// and rounded to the model dtype. `page`: where the K/V are (for a SegPage: payload_of);
// only bytes from L.k_off on are read.
__device__ inline float row_element(const uint8_t* page, const PageLayout& L, uint32_t h,
                                    uint32_t s, bool v, uint32_t d) {
  const uint8_t* row = page + (v ? L.v_off : L.k_off) + h * L.head_stride + s * L.slot_stride;
  const uint16_t* qp = reinterpret_cast<const uint16_t*>(page + (v ? L.vq_off : L.kq_off)) +
                       L.qparam_index(h, s);
  if (L.cls == KVGC_CLASS_INT8)
    return model_round(dequantize_int8(reinterpret_cast<const int8_t*>(row), qp, L.dtype, d), L.dtype);
  if (group_bits(L.cls))
    return model_round(dequantize(row, qp, L.dtype, L.group, d, group_bits(L.cls)), L.dtype);
  return load(row + d * elem_bytes(L.dtype), L.dtype);
}

// quant.cpp's load_row then store_row, block-wide: (head h, slot s)'s K (v = false) or V
// row of a page of layout Ls (`src`: where its K/V are) re-stored into (head h, slot d)
// of `dst` (layout Ld, same model dtype) through the model dtype. INT8: the row's scale,
// then each element; INT4 and INT2: a thread per group; FP16: each element stored (an
// FP16 source's bits copied as they are, as the CPU's memcpy). Every thread of the block
// calls it (uniform arguments); `row` (head_dim floats) and `scale` are the caller's
// shared memory, free again when it returns (it ends with a barrier). Writes only the
// row's codes / elements and its quantisation words.
__device__ inline void restore_row(const uint8_t* src, const PageLayout& Ls, uint32_t s, uint8_t* dst,
                                   const PageLayout& Ld, uint32_t d, uint32_t h, bool v, float* row,
                                   uint16_t* scale) {
  const uint32_t hd = Ls.head_dim;
  uint8_t* out = dst + (v ? Ld.v_off : Ld.k_off) + h * Ld.head_stride + d * Ld.slot_stride;
  if (Ld.cls == KVGC_CLASS_FP16) {
    const uint32_t eb = elem_bytes(Ld.dtype);
    if (Ls.cls == KVGC_CLASS_FP16) {
      const uint8_t* in = src + (v ? Ls.v_off : Ls.k_off) + h * Ls.head_stride + s * Ls.slot_stride;
      for (uint32_t e = threadIdx.x; e < hd; e += blockDim.x)
        for (uint32_t b = 0; b < eb; ++b) out[e * eb + b] = in[e * eb + b];
    } else {
      for (uint32_t e = threadIdx.x; e < hd; e += blockDim.x)
        store(out + e * eb, Ld.dtype, row_element(src, Ls, h, s, v, e));
    }
    __syncthreads();
    return;
  }
  for (uint32_t e = threadIdx.x; e < hd; e += blockDim.x) row[e] = row_element(src, Ls, h, s, v, e);
  __syncthreads();
  uint16_t* qp = reinterpret_cast<uint16_t*>(dst + (v ? Ld.vq_off : Ld.kq_off)) + Ld.qparam_index(h, d);
  if (Ld.cls == KVGC_CLASS_INT8) {
    if (threadIdx.x == 0) *scale = *qp = int8_scale(row, Ld.dtype, hd);
    __syncthreads();
    for (uint32_t e = threadIdx.x; e < hd; e += blockDim.x)
      reinterpret_cast<int8_t*>(out)[e] = int8_quantize(row[e], *scale, Ld.dtype);
  } else {
    for (uint32_t grp = threadIdx.x; grp < hd / Ld.group; grp += blockDim.x)
      quantize_group(row, Ld.dtype, Ld.group, grp, out, qp, group_bits(Ld.cls));
  }
  __syncthreads();
}

}  // namespace kvgc::cuda::dev
