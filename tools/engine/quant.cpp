// The block formats' specification (the portable kernels), activation quantisation, and
// the choice of kernels for this CPU.
#include "engine/quant.hpp"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>

#include "gguf.hpp"

namespace engine {

float f16_to_f32(uint16_t half) {
  const uint32_t sign = uint32_t(half >> 15) << 31;
  const uint32_t exponent = (half >> 10) & 0x1f;
  const uint32_t mantissa = half & 0x3ff;
  float value;
  if (exponent == 0) {
    value = std::ldexp(float(mantissa), -24);  // zero or subnormal
  } else if (exponent == 31) {
    value = mantissa ? NAN : INFINITY;
  } else {
    value = std::ldexp(float(mantissa | 0x400), int(exponent) - 25);
  }
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  bits |= sign;
  std::memcpy(&value, &bits, sizeof bits);
  return value;
}

uint16_t f32_to_f16(float value) {
  uint32_t x;
  std::memcpy(&x, &value, sizeof x);
  const uint16_t sign = uint16_t((x >> 16) & 0x8000);
  x &= 0x7fffffff;
  if (x > 0x7f800000) return uint16_t(sign | 0x7e00 | ((x >> 13) & 0x3ff));  // NaN, quiet
  if (x >= 0x477ff000) return uint16_t(sign | 0x7c00);  // >= 65520 rounds to infinity
  if (x < 0x38800000) {
    // Below 2^-14: a subnormal half. Adding 0.5 puts the half's unit (2^-24) in the
    // float's last mantissa bit, so the float addition itself rounds to nearest even.
    float magnitude;
    std::memcpy(&magnitude, &x, sizeof x);
    magnitude += 0.5f;
    uint32_t bits;
    std::memcpy(&bits, &magnitude, sizeof bits);
    return uint16_t(sign | (bits - 0x3f000000));
  }
  // Normal: rebias the exponent (127 -> 15), then round the 13 dropped bits to even; a
  // carry out of the mantissa correctly bumps the exponent.
  const uint32_t rebased = x - 0x38000000;
  return uint16_t(sign | ((rebased + 0xfff + ((rebased >> 13) & 1)) >> 13));
}

uint64_t tensor_bytes(uint32_t ggml_type, uint64_t n_elements) {
  switch (ggml_type) {
    case kGgmlF32: return n_elements * 4;
    case kGgmlF16: return n_elements * 2;
    case kGgmlQ4_1:
      return n_elements % kQuantBlock ? 0 : n_elements / kQuantBlock * kQ4_1BlockBytes;
    case kGgmlQ8_0:
      return n_elements % kQuantBlock ? 0 : n_elements / kQuantBlock * kQ8_0BlockBytes;
    default: return 0;
  }
}

bool row_fits_blocks(uint32_t ggml_type, uint64_t cols) {
  return (ggml_type != kGgmlQ4_1 && ggml_type != kGgmlQ8_0) || cols % kQuantBlock == 0;
}

namespace {

uint16_t read_u16(const uint8_t* p) { return uint16_t(p[0] | (p[1] << 8)); }

}  // namespace

bool dequantize(uint32_t ggml_type, const uint8_t* data, uint64_t n_elements, float* out,
                std::string* err) {
  if (tensor_bytes(ggml_type, n_elements) == 0 && n_elements != 0) {
    if (err) *err = "cannot dequantise " + std::to_string(n_elements) + " elements of type " +
                    gguf::ggml_type_name(ggml_type) + " (supported: " + kSupportedTypes +
                    ", whole blocks)";
    return false;
  }
  const Kernels& k = portable::kKernels;
  switch (ggml_type) {
    case kGgmlF32: std::memcpy(out, data, n_elements * 4); break;
    case kGgmlF16:
      for (uint64_t i = 0; i < n_elements; ++i) out[i] = f16_to_f32(read_u16(data + 2 * i));
      break;
    case kGgmlQ4_1: k.dequant_q4_1(data, uint32_t(n_elements / kQuantBlock), out); break;
    case kGgmlQ8_0: k.dequant_q8_0(data, uint32_t(n_elements / kQuantBlock), out); break;
    default: break;
  }
  return true;
}

void quantize_rows(const float* x, uint32_t n, uint32_t cols, QuantRows* out) {
  const uint32_t blocks = cols / kQuantBlock;
  out->n = n;
  out->blocks = blocks;
  out->q.resize(size_t(n) * cols);
  out->d.resize(size_t(n) * blocks);
  out->s.resize(size_t(n) * blocks);
  kernels().quantize(x, size_t(n) * blocks, out->q.data(), out->d.data(), out->s.data());
}

// ---- the specification ------------------------------------------------------------
namespace portable {
namespace {

// One weight row against one activation row: the block sums in order, the integer part
// of each block exact.
float dot_q4_1(const uint8_t* w, const QuantRows& x, uint32_t t) {
  const uint32_t blocks = x.blocks;
  const int8_t* q = x.q.data() + size_t(t) * blocks * kQuantBlock;
  const float* xd = x.d.data() + size_t(t) * blocks;
  const float* xs = x.s.data() + size_t(t) * blocks;
  float sum = 0.0f, offset = 0.0f;
  for (uint32_t b = 0; b < blocks; ++b, w += kQ4_1BlockBytes, q += kQuantBlock) {
    int32_t isum = 0;
    for (uint32_t j = 0; j < kQuantBlock / 2; ++j) {
      isum += int32_t(w[4 + j] & 0x0f) * q[j] + int32_t(w[4 + j] >> 4) * q[j + 16];
    }
    sum += float(isum) * (f16_to_f32(read_u16(w)) * xd[b]);
    offset += f16_to_f32(read_u16(w + 2)) * xs[b];
  }
  return sum + offset;
}

float dot_q8_0(const uint8_t* w, const QuantRows& x, uint32_t t) {
  const uint32_t blocks = x.blocks;
  const int8_t* q = x.q.data() + size_t(t) * blocks * kQuantBlock;
  const float* xd = x.d.data() + size_t(t) * blocks;
  float sum = 0.0f;
  for (uint32_t b = 0; b < blocks; ++b, w += kQ8_0BlockBytes, q += kQuantBlock) {
    int32_t isum = 0;
    for (uint32_t j = 0; j < kQuantBlock; ++j) isum += int32_t(int8_t(w[2 + j])) * q[j];
    sum += float(isum) * (f16_to_f32(read_u16(w)) * xd[b]);
  }
  return sum;
}

void q4_1(const uint8_t* w, size_t row_bytes, uint32_t rows, const QuantRows& x, float* out,
          size_t out_stride) {
  for (uint32_t r = 0; r < rows; ++r)
    for (uint32_t t = 0; t < x.n; ++t) out[t * out_stride + r] = dot_q4_1(w + r * row_bytes, x, t);
}

void q8_0(const uint8_t* w, size_t row_bytes, uint32_t rows, const QuantRows& x, float* out,
          size_t out_stride) {
  for (uint32_t r = 0; r < rows; ++r)
    for (uint32_t t = 0; t < x.n; ++t) out[t * out_stride + r] = dot_q8_0(w + r * row_bytes, x, t);
}

void f32(const float* w, size_t w_stride, uint32_t rows, const float* x, size_t x_stride,
         uint32_t n, uint32_t cols, float* out, size_t out_stride) {
  for (uint32_t r = 0; r < rows; ++r) {
    for (uint32_t t = 0; t < n; ++t) {
      float sum = 0.0f;
      for (uint32_t i = 0; i < cols; ++i) sum += w[r * w_stride + i] * x[t * x_stride + i];
      out[t * out_stride + r] = sum;
    }
  }
}

void dequant_q4_1(const uint8_t* w, uint32_t blocks, float* out) {
  for (uint32_t b = 0; b < blocks; ++b, w += kQ4_1BlockBytes, out += kQuantBlock) {
    const float d = f16_to_f32(read_u16(w)), m = f16_to_f32(read_u16(w + 2));
    for (uint32_t j = 0; j < kQuantBlock / 2; ++j) {
      out[j] = d * float(w[4 + j] & 0x0f) + m;
      out[j + kQuantBlock / 2] = d * float(w[4 + j] >> 4) + m;
    }
  }
}

void dequant_q8_0(const uint8_t* w, uint32_t blocks, float* out) {
  for (uint32_t b = 0; b < blocks; ++b, w += kQ8_0BlockBytes, out += kQuantBlock) {
    const float d = f16_to_f32(read_u16(w));
    for (uint32_t j = 0; j < kQuantBlock; ++j) out[j] = d * float(int8_t(w[2 + j]));
  }
}

void halves_to_floats(const uint16_t* in, size_t n, float* out) {
  for (size_t i = 0; i < n; ++i) out[i] = f16_to_f32(in[i]);
}

void floats_to_halves(const float* in, size_t n, uint16_t* out) {
  for (size_t i = 0; i < n; ++i) out[i] = f32_to_f16(in[i]);
}

// d = max|x| / 127 (exactly this float division), q = round-to-nearest-even(x * (1 / d)),
// s = d * sum(q).
void quantize(const float* x, size_t blocks, int8_t* q_out, float* d_out, float* s_out) {
  for (size_t b = 0; b < blocks; ++b) {
    const float* in = x + b * kQuantBlock;
    int8_t* q = q_out + b * kQuantBlock;
    float amax = 0.0f;
    bool finite = true;
    for (uint32_t j = 0; j < kQuantBlock; ++j) {
      finite &= std::isfinite(in[j]);
      amax = std::max(amax, std::fabs(in[j]));
    }
    if (!finite) {
      std::memset(q, 0, kQuantBlock);
      d_out[b] = s_out[b] = NAN;
      continue;
    }
    const float d = amax / 127.0f;
    const float inverse = d > 0.0f ? 1.0f / d : 0.0f;
    int32_t sum = 0;
    for (uint32_t j = 0; j < kQuantBlock; ++j) {
      q[j] = int8_t(std::nearbyint(in[j] * inverse));  // |q| <= 127: round to even
      sum += q[j];
    }
    d_out[b] = d;
    s_out[b] = d * float(sum);
  }
}

}  // namespace

const Kernels kKernels = {"portable",       q4_1,          q8_0,         f32,
                          dequant_q4_1,     dequant_q8_0,  halves_to_floats,
                          floats_to_halves, quantize};

}  // namespace portable

// ---- dispatch -----------------------------------------------------------------------
namespace {

int detect_level() {
  if (avx512::available()) return avx512::vnni_available() ? 3 : 2;
  return avx2::available() ? 1 : 0;
}

const int g_best = detect_level();
std::atomic<int> g_level{g_best};

}  // namespace

int best_kernel_level() { return g_best; }

const Kernels& kernels_at(int level) {
  switch (level < g_best ? level : g_best) {
    case 3: return avx512::kKernelsVnni;
    case 2: return avx512::kKernels;
    case 1: return avx2::kKernels;
    default: return portable::kKernels;
  }
}

const Kernels& kernels() { return kernels_at(g_level.load(std::memory_order_relaxed)); }

void set_kernel_level(int level) { g_level.store(level, std::memory_order_relaxed); }

}  // namespace engine
