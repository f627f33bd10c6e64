// The AVX2/FMA/F16C instantiation of the vector attention path (attend_simd.inc holds the
// algorithm; attend.cpp the portable specification that tests compare it with).
// Requires head_dim % 16 == 0.
#include "attend_internal.hpp"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <vector>

#include "../../allocator/host_memory.hpp"

#include "thread_pool.hpp"

#define KVGC_AVX2 __attribute__((target("avx2,fma,f16c")))
#define KVGC_SIMD KVGC_AVX2

namespace kvgc::cpu::avx2 {
namespace {

using VEC = __m256;
constexpr int W = 8;
KVGC_AVX2 inline VEC vzero() { return _mm256_setzero_ps(); }
KVGC_AVX2 inline VEC vload(const float* p) { return _mm256_loadu_ps(p); }
KVGC_AVX2 inline void vstore(float* p, VEC v) { _mm256_storeu_ps(p, v); }
KVGC_AVX2 inline VEC vbcast(const float* p) { return _mm256_broadcast_ss(p); }
KVGC_AVX2 inline VEC vfma(VEC a, VEC b, VEC c) { return _mm256_fmadd_ps(a, b, c); }
KVGC_AVX2 inline VEC vadd(VEC a, VEC b) { return _mm256_add_ps(a, b); }
KVGC_AVX2 inline VEC vsub(VEC a, VEC b) { return _mm256_sub_ps(a, b); }
KVGC_AVX2 inline VEC vmul(VEC a, VEC b) { return _mm256_mul_ps(a, b); }

KVGC_AVX2 inline void vstore_first(float* p, VEC v, uint32_t n) {  // lanes [0, n)
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  _mm256_maskstore_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(int(n)), lane), v);
}
KVGC_AVX2 inline VEC vmax(VEC a, VEC b) { return _mm256_max_ps(a, b); }  // b where a is NaN

// Lane i of the result is the sum of v[i]'s lanes (a transpose-and-add tree).
KVGC_AVX2 inline VEC vsum_lanes(const VEC* v) {
  VEC t[4], u[2];
  for (int i = 0; i < 4; ++i)  // [v2i halves summed | v2i+1 halves summed]
    t[i] = _mm256_add_ps(_mm256_permute2f128_ps(v[2 * i], v[2 * i + 1], 0x20),
                         _mm256_permute2f128_ps(v[2 * i], v[2 * i + 1], 0x31));
  for (int i = 0; i < 2; ++i)  // half l: 2 partials of v4i+l, 2 of v4i+2+l
    u[i] = _mm256_add_ps(_mm256_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm256_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // half l, element e: the sum of v2e+l
  const VEC x = _mm256_add_ps(_mm256_shuffle_ps(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm256_shuffle_ps(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm256_permutevar8x32_ps(x, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// x where a[i] <= b[i], else -inf (the causal mask of a group of logits).
KVGC_AVX2 inline VEC vmask_le(VEC x, const int32_t* a, const int32_t* b) {
  const __m256i gt = _mm256_cmpgt_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a)),
                                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)));
  return _mm256_blendv_ps(x, _mm256_set1_ps(-INFINITY), _mm256_castsi256_ps(gt));
}

KVGC_AVX2 inline float vhsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

KVGC_AVX2 inline float load16(const uint16_t* p, kvgc_dtype t) {
  return t == KVGC_DTYPE_F16 ? _cvtsh_ss(*p) : [&] {
    uint32_t b = uint32_t(*p) << 16;
    float f;
    std::memcpy(&f, &b, 4);
    return f;
  }();
}

// x rounded to the model dtype D and back (how kvgc_read returns a dequantised value).
template <kvgc_dtype D>
KVGC_AVX2 inline __m256 round_to(__m256 x) {
  if constexpr (D == KVGC_DTYPE_F16) {
    return _mm256_cvtph_ps(_mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  } else if constexpr (D == KVGC_DTYPE_BF16) {
    const __m256i b = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_add_epi32(b, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb));
    return _mm256_castsi256_ps(_mm256_and_si256(rounded, _mm256_set1_epi32(int(0xffff0000u))));
  } else {
    return x;
  }
}

// 8 elements [d, d + 8) of a row of class C, as f32; int8 and int4 elements go through
// the model dtype, as kvgc_read returns them (the specification).
template <kvgc_dtype D, int C>
KVGC_AVX2 inline __m256 vload_row(const uint8_t* row, const uint16_t* qp, uint32_t group, uint32_t d) {
  constexpr kvgc_dtype qt = qparam_dtype(D);
  if constexpr (C == KVGC_CLASS_FP16) {
    if constexpr (D == KVGC_DTYPE_F16)
      return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * d)));
    else if constexpr (D == KVGC_DTYPE_BF16)
      return _mm256_castsi256_ps(_mm256_slli_epi32(
          _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * d))), 16));
    else
      return _mm256_loadu_ps(reinterpret_cast<const float*>(row) + d);
  } else if constexpr (C == KVGC_CLASS_INT8 && int8_factored(D)) {
    // The row's scale is applied per slot by the caller (attend_simd.inc).
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + d))));
  } else if constexpr (C == KVGC_CLASS_INT8) {
    // q * scale is exact in f32 (7 + 11 bits), then rounded once to the model dtype.
    const __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + d)));
    return round_to<D>(_mm256_mul_ps(_mm256_cvtepi32_ps(q), _mm256_set1_ps(load16(qp, qt))));
  } else {
    // INT4 and INT2: 8 codes of `bits` bits, the lowest first (d is a multiple of 8, so
    // they start on a byte).
    constexpr uint32_t bits = group_bits(C);
    uint32_t w = 0;
    std::memcpy(&w, row + d * bits / 8, bits);
    const __m256i shifts = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(int(bits)));
    const __m256i n = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(int(w)), shifts),
                                       _mm256_set1_epi32(int((1u << bits) - 1)));
    const uint32_t g = d / group;
    return round_to<D>(_mm256_fmadd_ps(_mm256_cvtepi32_ps(n), _mm256_set1_ps(load16(qp + 2 * g, qt)),
                                       _mm256_set1_ps(load16(qp + 2 * g + 1, qt))));
  }
}

// Cephes-style exp for x <= 0 (see attend.cpp); 0 below e^-87.
KVGC_AVX2 inline __m256 vexp(__m256 x) {
  const __m256 keep = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GT_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
  const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), keep);
}

}  // namespace

// cpuid directly (clang 14 has no "f16c" for __builtin_cpu_supports): FMA, F16C, AVX
// with OS-saved YMM state (XGETBV), and AVX2.
bool available() {
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return false;
  const bool fma = c & (1u << 12), osxsave = c & (1u << 27), avx = c & (1u << 28), f16c = c & (1u << 29);
  if (!(fma && osxsave && avx && f16c)) return false;
  unsigned xlo, xhi;
  __asm__("xgetbv" : "=a"(xlo), "=d"(xhi) : "c"(0));
  if ((xlo & 6u) != 6u) return false;  // XMM and YMM state enabled by the OS
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  return b & (1u << 5);  // AVX2
}

#include "attend_simd.inc"
#include "attend_simd_phases.inc"

}  // namespace kvgc::cpu::avx2

#else
namespace kvgc::cpu::avx2 {
bool available() { return false; }
void all_heads(const AttendOp&, const LiveSlot*, size_t, const float*, size_t, uint32_t,
               const int64_t*, float*, float*, float*, float*, ThreadPool*) {}
}  // namespace kvgc::cpu::avx2
#endif
