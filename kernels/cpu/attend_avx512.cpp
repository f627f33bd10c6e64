// The AVX-512 instantiation of the vector attention path (attend_simd.inc holds the
// algorithm): 16 lanes, half the FMAs of AVX2 for the same work. Requires
// head_dim % 32 == 0 (one int4 group per 16-lane load pair).
#include "attend_internal.hpp"

#if defined(__x86_64__)
#include <cpuid.h>
// GCC 12's own _mm512_cvtph_ps trips -Wmaybe-uninitialized on its internal temporary.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <vector>

#include "../../allocator/host_memory.hpp"

#include "thread_pool.hpp"

#define KVGC_AVX512 __attribute__((target("avx512f,avx2,fma,f16c")))
#define KVGC_SIMD KVGC_AVX512

namespace kvgc::cpu::avx512 {
namespace {

using VEC = __m512;
constexpr int W = 16;
KVGC_AVX512 inline VEC vzero() { return _mm512_setzero_ps(); }
KVGC_AVX512 inline VEC vload(const float* p) { return _mm512_loadu_ps(p); }
KVGC_AVX512 inline void vstore(float* p, VEC v) { _mm512_storeu_ps(p, v); }
KVGC_AVX512 inline VEC vbcast(const float* p) { return _mm512_set1_ps(*p); }
KVGC_AVX512 inline VEC vfma(VEC a, VEC b, VEC c) { return _mm512_fmadd_ps(a, b, c); }
KVGC_AVX512 inline VEC vadd(VEC a, VEC b) { return _mm512_add_ps(a, b); }
KVGC_AVX512 inline VEC vsub(VEC a, VEC b) { return _mm512_sub_ps(a, b); }
KVGC_AVX512 inline VEC vmul(VEC a, VEC b) { return _mm512_mul_ps(a, b); }
KVGC_AVX512 inline float vhsum(VEC v) { return _mm512_reduce_add_ps(v); }
KVGC_AVX512 inline void vstore_first(float* p, VEC v, uint32_t n) {  // lanes [0, n)
  _mm512_mask_storeu_ps(p, __mmask16((1u << n) - 1), v);
}
KVGC_AVX512 inline VEC vmax(VEC a, VEC b) { return _mm512_max_ps(a, b); }  // b where a is NaN

// Lane i of the result is the sum of v[i]'s lanes: a transpose-and-add tree, 46 shuffles
// and adds for 16 sums where 16 separate reductions take about three times as many.
KVGC_AVX512 inline VEC vsum_lanes(const VEC* v) {
  VEC t[8], u[4], w[2];
  for (int i = 0; i < 8; ++i)  // [v2i halves summed | v2i+1 halves summed]
    t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // quarter k: 4 partial sums of v4i+k
    u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)  // quarter k: 2 partials of v8i+k, 2 of v8i+4+k
    w[i] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // quarter k, element e: the sum of v4e+k
  const VEC x = _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_ps(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_permutexvar_ps(
      _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), x);
}

// x where a[i] <= b[i], else -inf (the causal mask of a group of logits).
KVGC_AVX512 inline VEC vmask_le(VEC x, const int32_t* a, const int32_t* b) {
  const __mmask16 keep = _mm512_cmple_epi32_mask(_mm512_loadu_si512(a), _mm512_loadu_si512(b));
  return _mm512_mask_blend_ps(keep, _mm512_set1_ps(-INFINITY), x);
}

KVGC_AVX512 inline float load16(const uint16_t* p, kvgc_dtype t) {
  if (t == KVGC_DTYPE_F16) return _cvtsh_ss(*p);
  const uint32_t b = uint32_t(*p) << 16;
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

// x rounded to the model dtype D and back (how kvgc_read returns a dequantised value).
template <kvgc_dtype D>
KVGC_AVX512 inline VEC round_to(VEC x) {
  if constexpr (D == KVGC_DTYPE_F16) {
    return _mm512_cvtph_ps(_mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  } else if constexpr (D == KVGC_DTYPE_BF16) {
    const __m512i b = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_add_epi32(b, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
    return _mm512_castsi512_ps(_mm512_and_si512(rounded, _mm512_set1_epi32(int(0xffff0000u))));
  } else {
    return x;
  }
}

// 16 elements [d, d + 16) of a row of class C as f32; int8 and int4 through the model
// dtype.
template <kvgc_dtype D, int C>
KVGC_AVX512 inline VEC vload_row(const uint8_t* row, const uint16_t* qp, uint32_t group, uint32_t d) {
  constexpr kvgc_dtype qt = qparam_dtype(D);
  if constexpr (C == KVGC_CLASS_FP16) {
    if constexpr (D == KVGC_DTYPE_F16)
      return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 2 * d)));
    else if constexpr (D == KVGC_DTYPE_BF16)
      return _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 2 * d))), 16));
    else
      return _mm512_loadu_ps(reinterpret_cast<const float*>(row) + d);
  } else if constexpr (C == KVGC_CLASS_INT8 && int8_factored(D)) {
    // The row's scale is applied per slot by the caller (attend_simd.inc).
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + d))));
  } else if constexpr (C == KVGC_CLASS_INT8) {
    // q * scale is exact in f32 (7 + 11 bits), then rounded once to the model dtype.
    const __m512i q = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + d)));
    return round_to<D>(_mm512_mul_ps(_mm512_cvtepi32_ps(q), _mm512_set1_ps(load16(qp, qt))));
  } else {
    // INT4 and INT2: 16 codes of `bits` bits, the lowest first, in one or two 32-bit words.
    constexpr uint32_t bits = group_bits(C), per_word = 32 / bits;
    uint32_t lo, hi;
    std::memcpy(&lo, row + d * bits / 8, 4);
    if constexpr (per_word < 16) std::memcpy(&hi, row + d * bits / 8 + 4, 4);
    else hi = lo;  // the upper 8 lanes shift past the first 8 codes
    const __m512i words = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi32(int(lo))),
                                             _mm256_set1_epi32(int(hi)), 1);
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i shifts = _mm512_mullo_epi32(
        _mm512_and_si512(lane, _mm512_set1_epi32(int(per_word - 1))), _mm512_set1_epi32(int(bits)));
    const __m512i n = _mm512_and_si512(_mm512_srlv_epi32(words, shifts), _mm512_set1_epi32(int((1u << bits) - 1)));
    const uint32_t g = d / group;
    return round_to<D>(_mm512_fmadd_ps(_mm512_cvtepi32_ps(n), _mm512_set1_ps(load16(qp + 2 * g, qt)),
                                       _mm512_set1_ps(load16(qp + 2 * g + 1, qt))));
  }
}

// int4 by table lookup (attend_simd.inc's INT4 path; group = 2W = 32 here). The 16 bytes
// of one group: 16 lanes holding a byte each; its low nibbles are the group's even
// elements, its high nibbles (nib_hi) the odd ones.
#define KVGC_INT4_TABLE 1
using IVEC = __m512i;
KVGC_AVX512 inline IVEC nib_load(const uint8_t* p) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
KVGC_AVX512 inline IVEC nib_hi(IVEC b) { return _mm512_srli_epi32(b, 4); }
// table[n & 15] per lane (vpermps reads only the index's low 4 bits).
KVGC_AVX512 inline VEC lookup(IVEC n, VEC table) { return _mm512_permutexvar_ps(n, table); }
// The 16 values a nibble stands for in a group: n * scale + zero, rounded through the
// model dtype as the element-wise dequantisation does, except for f16: there the rounding
// (vcvtps2ph, slow on Zen 4) costs about 15% of the int4 time and moves the result by
// about 1e-4 relative, well inside the f16 tolerance; bf16 rounding is cheap and bf16
// results have no such margin.
template <kvgc_dtype D>
KVGC_AVX512 inline VEC dequant_table(const float* scale_zero) {
  const VEC n = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const VEC x = _mm512_fmadd_ps(n, _mm512_set1_ps(scale_zero[0]), _mm512_set1_ps(scale_zero[1]));
  return D == KVGC_DTYPE_F16 ? x : round_to<D>(x);
}
// n 16-bit scale/zero values (qparam_dtype(D)) to f32.
template <kvgc_dtype D>
KVGC_AVX512 inline void qparams_f32(const uint16_t* src, size_t n, float* dst) {
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    _mm512_storeu_ps(dst + i, D == KVGC_DTYPE_F16 ? _mm512_cvtph_ps(h)
                                                  : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
  }
  for (; i < n; ++i) dst[i] = load16(src + i, qparam_dtype(D));
}

// Cephes-style exp for x <= 0, as the AVX2 path; 0 below e^-87.
KVGC_AVX512 inline VEC vexp(VEC x) {
  const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GT_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  const VEC k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  VEC r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
  VEC p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(k), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mov_ps(keep, _mm512_mul_ps(p, _mm512_castsi512_ps(e)));
}

}  // namespace

// AVX-512F with OS-saved ZMM and opmask state, plus what the AVX2 path needs.
bool available() {
  if (!avx2::available()) return false;
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(b & (1u << 16))) return false;
  unsigned xlo, xhi;
  __asm__("xgetbv" : "=a"(xlo), "=d"(xhi) : "c"(0));
  return (xlo & 0xe6u) == 0xe6u;
}

#include "attend_simd.inc"
#include "attend_simd_phases.inc"

}  // namespace kvgc::cpu::avx512

#else
namespace kvgc::cpu::avx512 {
bool available() { return false; }
void all_heads(const AttendOp&, const LiveSlot*, size_t, const float*, size_t, uint32_t,
               const int64_t*, float*, float*, float*, float*, ThreadPool*) {}
}  // namespace kvgc::cpu::avx512
#endif
