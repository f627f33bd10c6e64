// AVX-512 (F, BW, DQ, VL) Q4_1 and Q8_0 kernels, twice: with vpmaddubsw + vpmaddwd for
// the byte products, and with VNNI's vpdpbusd, which does both in one instruction. The
// f32, dequantisation, f16 and quantisation kernels are the AVX2 ones. The tiles are in
// quant_avx512.inc.
#include "engine/quant.hpp"
#include "engine/quant_internal.hpp"

#if defined(__x86_64__)
#include <cpuid.h>
// GCC 12's own AVX-512 intrinsics (_mm512_reduce_add_ps, conversions) trip
// -W(maybe-)uninitialized on their internal temporaries.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#include <immintrin.h>

#include <cmath>

#include <cstring>

namespace engine::avx512 {

namespace plain {
#define KVGC_Q512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")))
KVGC_Q512 inline __m512i dot_u8s8(__m512i acc, __m512i u, __m512i s) {
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s),
                                                 _mm512_set1_epi16(1)));
}
#include "quant_avx512.inc"
#undef KVGC_Q512
}  // namespace plain

namespace vnni {
#define KVGC_Q512 \
  __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx2,fma,f16c")))
KVGC_Q512 inline __m512i dot_u8s8(__m512i acc, __m512i u, __m512i s) {
  return _mm512_dpbusd_epi32(acc, u, s);
}
#include "quant_avx512.inc"
#undef KVGC_Q512
}  // namespace vnni

namespace {

bool leaf7(unsigned* b, unsigned* c) {
  unsigned a, d;
  return __get_cpuid_count(7, 0, &a, b, c, &d);
}

}  // namespace

// AVX-512 F, DQ, BW and VL with the opmask and ZMM state enabled by the OS, plus AVX2.
bool available() {
  if (!avx2::available()) return false;
  unsigned b, c;
  if (!leaf7(&b, &c)) return false;
  const unsigned need = (1u << 16) | (1u << 17) | (1u << 30) | (1u << 31);
  if ((b & need) != need) return false;
  unsigned xlo, xhi;
  __asm__("xgetbv" : "=a"(xlo), "=d"(xhi) : "c"(0));
  return (xlo & 0xe6u) == 0xe6u;
}

bool vnni_available() {
  unsigned b, c;
  return available() && leaf7(&b, &c) && (c & (1u << 11));
}

const Kernels kKernels = {"avx512",           plain::q4_1,        plain::q8_0,
                          avx2::f32,          avx2::dequant_q4_1, avx2::dequant_q8_0,
                          avx2::halves_to_floats, avx2::floats_to_halves, avx2::quantize};
const Kernels kKernelsVnni = {"avx512-vnni",      vnni::q4_1,         vnni::q8_0,
                              avx2::f32,          avx2::dequant_q4_1, avx2::dequant_q8_0,
                              avx2::halves_to_floats, avx2::floats_to_halves, avx2::quantize};

}  // namespace engine::avx512

#else
namespace engine::avx512 {
bool available() { return false; }
bool vnni_available() { return false; }
const Kernels kKernels = portable::kKernels;
const Kernels kKernelsVnni = portable::kKernels;
}  // namespace engine::avx512
#endif
