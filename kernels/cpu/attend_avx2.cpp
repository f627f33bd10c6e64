// The AVX2/FMA/F16C path of CPU attention (attend.cpp holds the portable path, which is
// the specification; tests compare the two). Organised for memory bandwidth:
//   K pass   slot by slot; each K row is loaded once, converted (or int4-dequantised)
//            in registers, and dotted with up to 8 query rows kept in registers.
//   softmax  exp over the whole [slots][rows] logit array, 8 lanes at a time.
//   V pass   tiles of 64 slots (which stay in L2) x chunks of 16 dims, with up to 4
//            query rows' accumulators in registers: each V line comes from memory once.
//   mass     per slot, its probabilities summed over the rows; normalisation is folded
//            into the outputs and the mass, never a pass of its own.
// Requires head_dim % 16 == 0 (attend.cpp falls back to the portable path otherwise).
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

#define KVGC_AVX2 __attribute__((target("avx2,fma,f16c")))

namespace kvgc::cpu::avx2 {
namespace {

KVGC_AVX2 inline float hsum(__m256 v) {
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

// Where one head's K or V rows of a class live: row = page + off + slot * stride; int4
// scale/zero pairs at page + qoff + slot * qstride.
struct Rows {
  size_t off, stride, qoff, qstride;
  uint32_t group;
};

inline Rows rows_of(const PageLayout& L, uint32_t h, bool v) {
  const size_t groups = L.head_dim / L.group;
  return {(v ? L.v_off : L.k_off) + h * L.head_stride, L.slot_stride,
          (v ? L.vq_off : L.kq_off) + size_t(h) * L.page_tokens * groups * 4, groups * 4, L.group};
}

// 8 elements [d, d + 8) of a row, as f32; int4 elements go through the model dtype, as
// kvgc_read returns them (the specification).
template <kvgc_dtype D, bool INT4>
KVGC_AVX2 inline __m256 load8(const uint8_t* row, const uint16_t* qp, uint32_t group, uint32_t d) {
  if constexpr (!INT4) {
    if constexpr (D == KVGC_DTYPE_F16)
      return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * d)));
    else if constexpr (D == KVGC_DTYPE_BF16)
      return _mm256_castsi256_ps(_mm256_slli_epi32(
          _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * d))), 16));
    else
      return _mm256_loadu_ps(reinterpret_cast<const float*>(row) + d);
  } else {
    uint32_t w;
    std::memcpy(&w, row + d / 2, 4);  // 8 nibbles, low first
    const __m256i n = _mm256_and_si256(
        _mm256_srlv_epi32(_mm256_set1_epi32(int(w)), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)),
        _mm256_set1_epi32(15));
    const uint32_t g = d / group;
    constexpr kvgc_dtype qt = qparam_dtype(D);
    const __m256 x = _mm256_fmadd_ps(_mm256_cvtepi32_ps(n), _mm256_set1_ps(load16(qp + 2 * g, qt)),
                                     _mm256_set1_ps(load16(qp + 2 * g + 1, qt)));
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
}

// Logits of rows [r0, r0 + RP) of one head for one slot (RP padded: rows >= R are
// computed on zero queries and dropped); updates the rows' maxima.
template <kvgc_dtype D, bool INT4, int RP>
KVGC_AVX2 inline void k_slot(const uint8_t* row, const uint16_t* qp, uint32_t group, int32_t pos,
                             const float* q, const int64_t* row_pos, uint32_t R, uint32_t r0,
                             uint32_t hd, float* logits, float* m) {
  __m256 acc[RP];
  for (int r = 0; r < RP; ++r) acc[r] = _mm256_setzero_ps();
  for (uint32_t d = 0; d < hd; d += 8) {
    const __m256 k = load8<D, INT4>(row, qp, group, d);
    for (int r = 0; r < RP; ++r)
      acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(q + size_t(r0 + r) * hd + d), k, acc[r]);
  }
  for (int r = 0; r < RP && r0 + r < R; ++r) {
    const float l = int64_t(pos) <= row_pos[r0 + r] ? hsum(acc[r]) : -INFINITY;
    logits[r0 + r] = l;
    m[r0 + r] = std::max(m[r0 + r], l);
  }
}

// Cephes-style exp for x <= 0 (see attend.cpp); 0 below e^-87.
KVGC_AVX2 inline __m256 exp8(__m256 x) {
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

// V accumulation of rows [r0, r0 + RP) of one head over slots [t0, t1) of one page,
// dims [d, d + 16).
template <kvgc_dtype D, bool INT4, int RP>
KVGC_AVX2 inline void v_chunk(const LiveSlot* slots, size_t t0, size_t t1, const Rows& rows,
                              const float* probs, uint32_t R, uint32_t r0, uint32_t d, uint32_t hd,
                              float* acc) {
  __m256 a0[RP], a1[RP];
  for (int r = 0; r < RP; ++r) {
    a0[r] = _mm256_loadu_ps(acc + size_t(r0 + r) * hd + d);
    a1[r] = _mm256_loadu_ps(acc + size_t(r0 + r) * hd + d + 8);
  }
  for (size_t j = t0; j < t1; ++j) {
    const uint8_t* row = slots[j].page + rows.off + slots[j].slot * rows.stride;
    const auto* qp = reinterpret_cast<const uint16_t*>(slots[j].page + rows.qoff + slots[j].slot * rows.qstride);
    const __m256 v0 = load8<D, INT4>(row, qp, rows.group, d), v1 = load8<D, INT4>(row, qp, rows.group, d + 8);
    for (int r = 0; r < RP; ++r) {
      const __m256 p = _mm256_broadcast_ss(probs + j * R + r0 + r);
      a0[r] = _mm256_fmadd_ps(p, v0, a0[r]);
      a1[r] = _mm256_fmadd_ps(p, v1, a1[r]);
    }
  }
  for (int r = 0; r < RP; ++r) {
    _mm256_storeu_ps(acc + size_t(r0 + r) * hd + d, a0[r]);
    _mm256_storeu_ps(acc + size_t(r0 + r) * hd + d + 8, a1[r]);
  }
}

// The K pass over one page's slots [t0, t1), every head in turn: the page's K block is
// read front to back.
template <kvgc_dtype D, bool INT4>
KVGC_AVX2 void k_page(const AttendOp& op, const LiveSlot* slots, size_t t0, size_t t1, size_t n,
                      const float* q, size_t q_head_stride, const int64_t* row_pos, uint32_t R,
                      float* logits, float* m) {
  const PageLayout& L = op.layout[INT4 ? 1 : 0];
  const uint32_t hd = L.head_dim;
  for (uint32_t h = 0; h < L.n_kv_heads; ++h) {
    const Rows rows = rows_of(L, h, false);
    const float* qh = q + h * q_head_stride;
    float* lh = logits + size_t(h) * n * R;
    float* mh = m + size_t(h) * R;
    for (size_t j = t0; j < t1; ++j) {
      const uint8_t* row = slots[j].page + rows.off + slots[j].slot * rows.stride;
      const auto* qp = reinterpret_cast<const uint16_t*>(slots[j].page + rows.qoff + slots[j].slot * rows.qstride);
      for (uint32_t r0 = 0; r0 < R; r0 += 8) {
        const uint32_t left = R - r0;
        float* out = lh + j * R;
        if (left > 4) k_slot<D, INT4, 8>(row, qp, rows.group, slots[j].pos, qh, row_pos, R, r0, hd, out, mh);
        else if (left > 2) k_slot<D, INT4, 4>(row, qp, rows.group, slots[j].pos, qh, row_pos, R, r0, hd, out, mh);
        else if (left == 2) k_slot<D, INT4, 2>(row, qp, rows.group, slots[j].pos, qh, row_pos, R, r0, hd, out, mh);
        else k_slot<D, INT4, 1>(row, qp, rows.group, slots[j].pos, qh, row_pos, R, r0, hd, out, mh);
      }
    }
  }
}

// The V pass over one page's slots [t0, t1), every head in turn.
template <kvgc_dtype D, bool INT4>
KVGC_AVX2 void v_page(const AttendOp& op, const LiveSlot* slots, size_t t0, size_t t1, size_t n,
                      const float* probs, uint32_t R, float* acc) {
  const PageLayout& L = op.layout[INT4 ? 1 : 0];
  const uint32_t hd = L.head_dim;
  for (uint32_t h = 0; h < L.n_kv_heads; ++h) {
    const Rows rows = rows_of(L, h, true);
    const float* ph = probs + size_t(h) * n * R;
    float* ah = acc + size_t(h) * R * hd;
    for (uint32_t d = 0; d < hd; d += 16)
      for (uint32_t r0 = 0; r0 < R; r0 += 4) {
        const uint32_t left = R - r0;
        if (left >= 4) v_chunk<D, INT4, 4>(slots, t0, t1, rows, ph, R, r0, d, hd, ah);
        else if (left == 3) v_chunk<D, INT4, 3>(slots, t0, t1, rows, ph, R, r0, d, hd, ah);
        else if (left == 2) v_chunk<D, INT4, 2>(slots, t0, t1, rows, ph, R, r0, d, hd, ah);
        else v_chunk<D, INT4, 1>(slots, t0, t1, rows, ph, R, r0, d, hd, ah);
      }
  }
}

// Both passes visit the slots page by page (consecutive slots of one page).
template <kvgc_dtype D>
KVGC_AVX2 void by_page(bool k, const AttendOp& op, const LiveSlot* slots, size_t n, const float* q,
                       size_t q_head_stride, const int64_t* row_pos, uint32_t R, float* logits,
                       float* m, float* acc) {
  for (size_t t0 = 0; t0 < n;) {
    size_t t1 = t0 + 1;
    while (t1 < n && slots[t1].page == slots[t0].page) ++t1;
    const bool int4 = slots[t0].cls == KVGC_CLASS_INT4;
    if (k) {
      if (int4) k_page<D, true>(op, slots, t0, t1, n, q, q_head_stride, row_pos, R, logits, m);
      else k_page<D, false>(op, slots, t0, t1, n, q, q_head_stride, row_pos, R, logits, m);
    } else {
      if (int4) v_page<D, true>(op, slots, t0, t1, n, logits, R, acc);
      else v_page<D, false>(op, slots, t0, t1, n, logits, R, acc);
    }
    t0 = t1;
  }
}

KVGC_AVX2 void run_pass(bool k, const AttendOp& op, const LiveSlot* slots, size_t n,
                        const float* q, size_t q_head_stride, const int64_t* row_pos, uint32_t R,
                        float* logits, float* m, float* acc) {
  switch (op.layout[0].dtype) {
    case KVGC_DTYPE_F16: by_page<KVGC_DTYPE_F16>(k, op, slots, n, q, q_head_stride, row_pos, R, logits, m, acc); break;
    case KVGC_DTYPE_BF16: by_page<KVGC_DTYPE_BF16>(k, op, slots, n, q, q_head_stride, row_pos, R, logits, m, acc); break;
    default: by_page<KVGC_DTYPE_F32>(k, op, slots, n, q, q_head_stride, row_pos, R, logits, m, acc); break;
  }
}

// exp(logit - m[row]) over one head's flat [n][R] logits; returns the rows' sums. Lane i
// of 8-chunk c is row (8c + i) % R, so the maxima repeat every lcm(8, R) / 8 chunks.
KVGC_AVX2 void softmax_head(float* logits, size_t n, uint32_t R, const float* m_in, float* inv_sum) {
  host::vector<float> m(m_in, m_in + R);
  for (uint32_t r = 0; r < R; ++r)
    if (!std::isfinite(m[r])) m[r] = 0.f;  // sees nothing: every exp is 0
  const uint32_t period = std::lcm(8u, R) / 8;
  host::vector<float> mpat(size_t(period) * 8), vsum(size_t(period) * 8, 0.f);
  for (uint32_t i = 0; i < period * 8; ++i) mpat[i] = m[i % R];
  const size_t total = n * R, full = total / 8 * 8;
  for (size_t i = 0, c = 0; i < full; i += 8, c = (c + 1 == period ? 0 : c + 1)) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(logits + i), _mm256_loadu_ps(&mpat[c * 8])));
    _mm256_storeu_ps(logits + i, e);
    _mm256_storeu_ps(&vsum[c * 8], _mm256_add_ps(_mm256_loadu_ps(&vsum[c * 8]), e));
  }
  host::vector<float> row_sum(R, 0.f);
  for (uint32_t i = 0; i < period * 8; ++i) row_sum[i % R] += vsum[i];
  for (size_t i = full; i < total; ++i) row_sum[i % R] += (logits[i] = std::exp(logits[i] - m[i % R]));
  for (uint32_t r = 0; r < R; ++r) inv_sum[r] = row_sum[r] > 0 ? 1.f / row_sum[r] : 0.f;
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

KVGC_AVX2 void all_heads(const AttendOp& op, const LiveSlot* slots, size_t n, const float* q,
                         size_t q_head_stride, uint32_t R, const int64_t* row_pos,
                         float* logits, float* acc, float* mass, float* inv_sum) {
  const uint32_t H = op.layout[0].n_kv_heads, hd = op.layout[0].head_dim;
  host::vector<float> m(size_t(H) * R, -INFINITY);
  run_pass(true, op, slots, n, q, q_head_stride, row_pos, R, logits, m.data(), nullptr);
  for (uint32_t h = 0; h < H; ++h)
    softmax_head(logits + size_t(h) * n * R, n, R, &m[size_t(h) * R], inv_sum + size_t(h) * R);
  if (mass)
    for (uint32_t h = 0; h < H; ++h) {
      const float* lh = logits + size_t(h) * n * R;
      const float* inv = inv_sum + size_t(h) * R;
      for (size_t j = 0; j < n; ++j) {
        float s = 0;
        for (uint32_t r = 0; r < R; ++r) s += lh[j * R + r] * inv[r];
        mass[j] += s;
      }
    }
  std::fill(acc, acc + size_t(H) * R * hd, 0.f);
  run_pass(false, op, slots, n, nullptr, 0, row_pos, R, logits, nullptr, acc);
}

}  // namespace kvgc::cpu::avx2

#else
namespace kvgc::cpu::avx2 {
bool available() { return false; }
void all_heads(const AttendOp&, const LiveSlot*, size_t, const float*, size_t, uint32_t,
               const int64_t*, float*, float*, float*, float*) {}
}  // namespace kvgc::cpu::avx2
#endif
