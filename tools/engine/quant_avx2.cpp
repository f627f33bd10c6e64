// AVX2 (+FMA, F16C) kernels: the integer part of a block's dot product with vpmaddubsw
// (unsigned weight nibbles, or |q| of Q8_0 weights, times signed activations; at most
// 2 * 128 * 127 per 16-bit pair, so it never saturates) and vpmaddwd, then one FMA per
// block by the block's scale. Tiles of R weight rows x G tokens share each load: 4 x 1
// for decode, 2 x 4 for prefill chunks. The same integer sums as the portable kernels;
// only the float sums over blocks are ordered differently.
#include "engine/quant.hpp"
#include "engine/quant_internal.hpp"

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>

#include <cmath>
#include <cstring>

#define KVGC_AVX2 __attribute__((target("avx2,fma,f16c")))

namespace engine::avx2 {
namespace {

KVGC_AVX2 inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// d and m of a block (two f16 at p) as floats.
KVGC_AVX2 inline void scales(const uint8_t* p, float* d, float* m) {
  uint32_t bits;
  std::memcpy(&bits, p, 4);
  const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(int(bits)));
  *d = _mm_cvtss_f32(dm);
  *m = _mm_cvtss_f32(_mm_movehdup_ps(dm));
}

KVGC_AVX2 inline float scale(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits)));
}

// A Q4_1 block's 32 weights as unsigned bytes, elements 0..31 in order.
KVGC_AVX2 inline __m256i nibbles(const uint8_t* p) {
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i low = _mm_set1_epi8(0x0f);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(packed, 4), low),
                          _mm_and_si128(packed, low));
}

KVGC_AVX2 inline __m256i load32(const void* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

// Eight int32 partial sums of unsigned u times signed s, byte by byte.
KVGC_AVX2 inline __m256i dot_u8s8(__m256i u, __m256i s) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

// R rows from w (row_bytes apart) x G tokens from t0: out[(t0 + g) * stride + r].
template <int R, int G>
KVGC_AVX2 inline void tile_q4_1(const uint8_t* w, size_t row_bytes, const QuantRows& x,
                                uint32_t t0, float* out, size_t stride) {
  const uint32_t blocks = x.blocks;
  __m256 acc[R][G];
  float offset[R][G];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) acc[r][g] = _mm256_setzero_ps(), offset[r][g] = 0.0f;
  const int8_t* q = x.q.data() + size_t(t0) * blocks * kQuantBlock;
  const float* xd = x.d.data() + size_t(t0) * blocks;
  const float* xs = x.s.data() + size_t(t0) * blocks;
  for (uint32_t b = 0; b < blocks; ++b) {
    __m256i wq[R];
    float d[R], m[R];
    for (int r = 0; r < R; ++r) {
      const uint8_t* block = w + r * row_bytes + b * kQ4_1BlockBytes;
      scales(block, &d[r], &m[r]);
      wq[r] = nibbles(block + 4);
    }
    for (int g = 0; g < G; ++g) {
      const __m256i xq = load32(q + (size_t(g) * blocks + b) * kQuantBlock);
      const float dx = xd[size_t(g) * blocks + b], sx = xs[size_t(g) * blocks + b];
      for (int r = 0; r < R; ++r) {
        const __m256 sum = _mm256_cvtepi32_ps(dot_u8s8(wq[r], xq));
        acc[r][g] = _mm256_fmadd_ps(sum, _mm256_set1_ps(d[r] * dx), acc[r][g]);
        // One explicit fma: the compiler may not contract some tile shapes and not others,
        // so a row's result never depends on the batch it is in.
        offset[r][g] = std::fma(m[r], sx, offset[r][g]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) out[(t0 + g) * stride + r] = hsum(acc[r][g]) + offset[r][g];
}

template <int R, int G>
KVGC_AVX2 inline void tile_q8_0(const uint8_t* w, size_t row_bytes, const QuantRows& x,
                                uint32_t t0, float* out, size_t stride) {
  const uint32_t blocks = x.blocks;
  __m256 acc[R][G];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) acc[r][g] = _mm256_setzero_ps();
  const int8_t* q = x.q.data() + size_t(t0) * blocks * kQuantBlock;
  const float* xd = x.d.data() + size_t(t0) * blocks;
  for (uint32_t b = 0; b < blocks; ++b) {
    __m256i wq[R], magnitude[R];
    float d[R];
    for (int r = 0; r < R; ++r) {
      const uint8_t* block = w + r * row_bytes + b * kQ8_0BlockBytes;
      d[r] = scale(block);
      wq[r] = load32(block + 2);
      magnitude[r] = _mm256_sign_epi8(wq[r], wq[r]);  // |q|; -128 stays 0x80 = 128 unsigned
    }
    for (int g = 0; g < G; ++g) {
      const __m256i xq = load32(q + (size_t(g) * blocks + b) * kQuantBlock);
      const float dx = xd[size_t(g) * blocks + b];
      for (int r = 0; r < R; ++r) {
        // |w| * (x with w's sign) = w * x, so the unsigned-by-signed multiply applies.
        const __m256i sum = dot_u8s8(magnitude[r], _mm256_sign_epi8(xq, wq[r]));
        acc[r][g] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_set1_ps(d[r] * dx),
                                    acc[r][g]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) out[(t0 + g) * stride + r] = hsum(acc[r][g]);
}

// Rows x tokens in tiles: decode (one token) 4 rows at a time, so four independent
// accumulator chains hide the FMA latency; prefill 2 rows x 4 tokens.
template <void (*T41)(const uint8_t*, size_t, const QuantRows&, uint32_t, float*, size_t),
          void (*T11)(const uint8_t*, size_t, const QuantRows&, uint32_t, float*, size_t),
          void (*T24)(const uint8_t*, size_t, const QuantRows&, uint32_t, float*, size_t),
          void (*T21)(const uint8_t*, size_t, const QuantRows&, uint32_t, float*, size_t),
          void (*T14)(const uint8_t*, size_t, const QuantRows&, uint32_t, float*, size_t)>
KVGC_AVX2 void tiled(const uint8_t* w, size_t row_bytes, uint32_t rows, const QuantRows& x,
                     float* out, size_t stride) {
  uint32_t r = 0;
  if (x.n == 1) {
    for (; r + 4 <= rows; r += 4) T41(w + r * row_bytes, row_bytes, x, 0, out + r, stride);
    for (; r < rows; ++r) T11(w + r * row_bytes, row_bytes, x, 0, out + r, stride);
    return;
  }
  for (; r + 2 <= rows; r += 2) {
    uint32_t t = 0;
    for (; t + 4 <= x.n; t += 4) T24(w + r * row_bytes, row_bytes, x, t, out + r, stride);
    for (; t < x.n; ++t) T21(w + r * row_bytes, row_bytes, x, t, out + r, stride);
  }
  for (; r < rows; ++r) {
    uint32_t t = 0;
    for (; t + 4 <= x.n; t += 4) T14(w + r * row_bytes, row_bytes, x, t, out + r, stride);
    for (; t < x.n; ++t) T11(w + r * row_bytes, row_bytes, x, t, out + r, stride);
  }
}

KVGC_AVX2 void q4_1(const uint8_t* w, size_t row_bytes, uint32_t rows, const QuantRows& x,
                    float* out, size_t stride) {
  tiled<tile_q4_1<4, 1>, tile_q4_1<1, 1>, tile_q4_1<2, 4>, tile_q4_1<2, 1>, tile_q4_1<1, 4>>(
      w, row_bytes, rows, x, out, stride);
}

KVGC_AVX2 void q8_0(const uint8_t* w, size_t row_bytes, uint32_t rows, const QuantRows& x,
                    float* out, size_t stride) {
  tiled<tile_q8_0<4, 1>, tile_q8_0<1, 1>, tile_q8_0<2, 4>, tile_q8_0<2, 1>, tile_q8_0<1, 4>>(
      w, row_bytes, rows, x, out, stride);
}

}  // namespace

namespace {

KVGC_AVX2 float dot_f32(const float* a, const float* b, uint32_t n) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  uint32_t i = 0;
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
  }
  for (; i + 8 <= n; i += 8) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
  }
  float sum = hsum(_mm256_add_ps(acc0, acc1));
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

}  // namespace

KVGC_AVX2 void f32(const float* w, size_t w_stride, uint32_t rows, const float* x,
                   size_t x_stride, uint32_t n, uint32_t cols, float* out, size_t stride) {
  for (uint32_t r = 0; r < rows; ++r)
    for (uint32_t t = 0; t < n; ++t)
      out[t * stride + r] = dot_f32(w + r * w_stride, x + t * x_stride, cols);
}

KVGC_AVX2 void dequant_q4_1(const uint8_t* w, uint32_t blocks, float* out) {
  for (uint32_t b = 0; b < blocks; ++b, w += kQ4_1BlockBytes, out += kQuantBlock) {
    float d, m;
    scales(w, &d, &m);
    const __m256 vd = _mm256_set1_ps(d), vm = _mm256_set1_ps(m);
    const __m256i q = nibbles(w + 4);
    const __m128i halves[2] = {_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)};
    for (int h = 0; h < 2; ++h) {
      const __m128i eight_hi = _mm_srli_si128(halves[h], 8);
      const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(halves[h]));
      const __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(eight_hi));
      _mm256_storeu_ps(out + 16 * h, _mm256_fmadd_ps(vd, lo, vm));
      _mm256_storeu_ps(out + 16 * h + 8, _mm256_fmadd_ps(vd, hi, vm));
    }
  }
}

KVGC_AVX2 void dequant_q8_0(const uint8_t* w, uint32_t blocks, float* out) {
  for (uint32_t b = 0; b < blocks; ++b, w += kQ8_0BlockBytes, out += kQuantBlock) {
    const __m256 vd = _mm256_set1_ps(scale(w));
    for (int k = 0; k < 4; ++k) {
      const __m128i eight = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + 2 + 8 * k));
      _mm256_storeu_ps(out + 8 * k,
                       _mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(eight))));
    }
  }
}

KVGC_AVX2 void halves_to_floats(const uint16_t* in, size_t n, float* out) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(
                                  reinterpret_cast<const __m128i*>(in + i))));
  }
  for (; i < n; ++i) out[i] = f16_to_f32(in[i]);
}

KVGC_AVX2 void floats_to_halves(const float* in, size_t n, uint16_t* out) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT));
  }
  for (; i < n; ++i) out[i] = f32_to_f16(in[i]);
}

// The portable definition, eight lanes at a time: the same float division, product and
// rounding (vcvtps2dq rounds to nearest even, as nearbyint does), so the same bytes.
KVGC_AVX2 void quantize(const float* x, size_t blocks, int8_t* q_out, float* d_out,
                        float* s_out) {
  const __m256 sign = _mm256_set1_ps(-0.0f), infinity = _mm256_set1_ps(INFINITY);
  for (size_t b = 0; b < blocks; ++b) {
    const float* in = x + b * kQuantBlock;
    __m256 v[4], amax = _mm256_setzero_ps();
    int finite = 0xff;
    for (int k = 0; k < 4; ++k) {
      v[k] = _mm256_loadu_ps(in + 8 * k);
      const __m256 magnitude = _mm256_andnot_ps(sign, v[k]);
      finite &= _mm256_movemask_ps(_mm256_cmp_ps(magnitude, infinity, _CMP_LT_OQ));
      amax = _mm256_max_ps(amax, magnitude);
    }
    int8_t* q = q_out + b * kQuantBlock;
    if (finite != 0xff) {
      std::memset(q, 0, kQuantBlock);
      d_out[b] = s_out[b] = NAN;
      continue;
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float d = _mm_cvtss_f32(m4) / 127.0f;
    const float inverse = d > 0.0f ? 1.0f / d : 0.0f;
    const __m256 scale = _mm256_set1_ps(inverse);
    __m256i i[4];
    for (int k = 0; k < 4; ++k) i[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], scale));
    const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
    // int32 -> int8 in order: the packs work per 128-bit lane, the permute undoes that.
    const __m256i w01 = _mm256_packs_epi32(i[0], i[1]);  // lanes: 0-3 8-11 | 4-7 12-15
    const __m256i w23 = _mm256_packs_epi32(i[2], i[3]);
    const __m256i bytes = _mm256_packs_epi16(w01, w23);  // 0-3 8-11 16-19 24-27 | 4-7 ...
    const __m256i ordered =
        _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), ordered);
    d_out[b] = d;
    s_out[b] = d * float(_mm_cvtsi128_si32(s4));
  }
}

// AVX2, FMA and F16C, with the YMM state enabled by the OS.
bool available() {
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return false;
  const bool fma = c & (1u << 12), osxsave = c & (1u << 27), avx = c & (1u << 28);
  const bool f16c = c & (1u << 29);
  if (!(fma && osxsave && avx && f16c)) return false;
  unsigned xlo, xhi;
  __asm__("xgetbv" : "=a"(xlo), "=d"(xhi) : "c"(0));
  if ((xlo & 6u) != 6u) return false;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  return b & (1u << 5);
}

const Kernels kKernels = {"avx2",           q4_1,         q8_0,         f32,
                          dequant_q4_1,     dequant_q8_0, halves_to_floats,
                          floats_to_halves, quantize};

}  // namespace engine::avx2

#else
namespace engine::avx2 {
bool available() { return false; }
const Kernels kKernels = portable::kKernels;
}  // namespace engine::avx2
#endif
