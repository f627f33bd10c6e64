// CPU attention with fused scores: the specification the CUDA kernel is tested against,
// and a real backend.
//
// Per KV head: every live slot's K row is converted to f32 once and dotted with all the
// queries that read it (the GQA group times the query block); each query's logits get
// an exact fp32 softmax (max, exp, sum); then every V row, converted once, is accumulated
// into those queries' outputs while the slot's mass (its probabilities summed over the
// group and the block) is added to its score. Queries are processed in blocks so the
// logits buffer stays bounded for long prefill chunks.
//
// The inner loops (row conversion, dot, axpy, exp) have a portable scalar version and an
// AVX2/FMA/F16C version picked at run time; set_simd(false) forces the scalar one (tests
// compare them).
#include "attend.hpp"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <vector>

#include "convert.hpp"
#include "quant.hpp"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define KVGC_X86 1
#endif

namespace kvgc::cpu {
namespace {

// ---- scalar kernels -----------------------------------------------------------------
void to_f32_scalar(const uint8_t* src, kvgc_dtype t, uint32_t n, float* dst) {
  const uint32_t eb = dtype_bytes(t);
  for (uint32_t i = 0; i < n; ++i) dst[i] = load(src + i * eb, t);
}
float dot_scalar(const float* a, const float* b, uint32_t n) {
  float s = 0;
  for (uint32_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}
void axpy_scalar(float a, const float* x, float* y, uint32_t n) {
  for (uint32_t i = 0; i < n; ++i) y[i] += a * x[i];
}
// exp(x[i] - m) in place, returns the sum.
float exp_sum_scalar(float* x, uint32_t n, float m) {
  float s = 0;
  for (uint32_t i = 0; i < n; ++i) s += (x[i] = std::exp(x[i] - m));
  return s;
}

#ifdef KVGC_X86
// ---- AVX2 + FMA + F16C kernels ------------------------------------------------------
#define KVGC_AVX2 __attribute__((target("avx2,fma,f16c")))

KVGC_AVX2 void to_f32_avx2(const uint8_t* src, kvgc_dtype t, uint32_t n, float* dst) {
  uint32_t i = 0;
  if (t == KVGC_DTYPE_F16) {
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 2 * i))));
  } else if (t == KVGC_DTYPE_BF16) {
    for (; i + 8 <= n; i += 8) {
      const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 2 * i)));
      _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
    }
  } else {
    std::memcpy(dst, src, size_t(n) * 4);
    return;
  }
  for (; i < n; ++i) dst[i] = load(src + i * dtype_bytes(t), t);
}

KVGC_AVX2 float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

KVGC_AVX2 float dot_avx2(const float* a, const float* b, uint32_t n) {
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  uint32_t i = 0;
  for (; i + 16 <= n; i += 16) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
  }
  for (; i + 8 <= n; i += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
  float s = hsum(_mm256_add_ps(s0, s1));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

KVGC_AVX2 void axpy_avx2(float a, const float* x, float* y, uint32_t n) {
  const __m256 va = _mm256_set1_ps(a);
  uint32_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] += a * x[i];
}

// exp for x <= 0 (logits minus their max), Cephes-style: 2^k * p(r), relative error
// ~2e-7, flushing below e^-87 to 0.
KVGC_AVX2 __m256 exp_avx2(__m256 x) {
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
  const __m256 out = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
  return _mm256_and_ps(out, _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GT_OQ));
}

KVGC_AVX2 float exp_sum_avx2(float* x, uint32_t n, float m) {
  const __m256 vm = _mm256_set1_ps(m);
  __m256 s = _mm256_setzero_ps();
  uint32_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(x + i), vm));
    _mm256_storeu_ps(x + i, e);
    s = _mm256_add_ps(s, e);
  }
  float t = hsum(s);
  for (; i < n; ++i) t += (x[i] = std::exp(x[i] - m));
  return t;
}

bool cpu_has_avx2() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
}
#endif

struct Kernels {
  void (*to_f32)(const uint8_t*, kvgc_dtype, uint32_t, float*);
  float (*dot)(const float*, const float*, uint32_t);
  void (*axpy)(float, const float*, float*, uint32_t);
  float (*exp_sum)(float*, uint32_t, float);
};
constexpr Kernels kScalar{to_f32_scalar, dot_scalar, axpy_scalar, exp_sum_scalar};
#ifdef KVGC_X86
constexpr Kernels kAvx2{to_f32_avx2, dot_avx2, axpy_avx2, exp_sum_avx2};
std::atomic<bool> g_simd{cpu_has_avx2()};
#else
std::atomic<bool> g_simd{false};
#endif

const Kernels& kernels() {
#ifdef KVGC_X86
  if (g_simd.load(std::memory_order_relaxed)) return kAvx2;
#endif
  return kScalar;
}

struct LiveSlot {
  uint8_t* page;
  uint32_t cls, slot;
  int32_t pos;
};

// One head's K or V row of a slot as f32 (int4 rows dequantised through the model dtype,
// exactly as kvgc_read returns them).
void row_f32(const Kernels& kn, const AttendOp& op, const LiveSlot& s, uint32_t h, bool v,
             float* dst, std::vector<uint8_t>& tmp) {
  const PageLayout& L = op.layout[s.cls];
  const size_t at = h * L.head_stride + s.slot * L.slot_stride;
  if (s.cls == KVGC_CLASS_FP16) {
    kn.to_f32(s.page + (v ? L.v_off : L.k_off) + at, L.dtype, L.head_dim, dst);
    return;
  }
  const size_t qp = (size_t(h) * L.page_tokens + s.slot) * (L.head_dim / L.group) * 2;
  tmp.resize(size_t(L.head_dim) * dtype_bytes(L.dtype));
  dequantize_row(s.page + (v ? L.v_off : L.k_off) + at,
                 reinterpret_cast<const uint16_t*>(s.page + (v ? L.vq_off : L.kq_off)) + qp,
                 L.dtype, L.head_dim, tmp.data());
  kn.to_f32(tmp.data(), L.dtype, L.head_dim, dst);
}

}  // namespace

void set_simd(bool on) {
#ifdef KVGC_X86
  g_simd = on && cpu_has_avx2();
#else
  (void)on;
#endif
}
bool simd_enabled() { return g_simd; }

void attend(const AttendOp& op) {
  const Kernels& kn = kernels();
  const PageLayout& L0 = op.layout[0];
  const uint32_t hd = L0.head_dim, kv_heads = L0.n_kv_heads, group = op.q_heads / kv_heads;
  const kvgc_dtype dt = L0.dtype;
  const uint32_t eb = dtype_bytes(dt);

  std::vector<LiveSlot> slots;
  slots.reserve(op.n_live);
  for (uint32_t p = 0; p < op.n_pages; ++p) {
    const SegPage& sp = op.pages[p];
    const PageLayout& L = op.layout[sp.cls];
    const auto* words = reinterpret_cast<const uint32_t*>(sp.page + L.live_off);
    const auto* pos = reinterpret_cast<const int32_t*>(sp.page + L.pos_off);
    for (uint32_t s = 0; s < L.page_tokens; ++s)
      if (words[s / 32] >> (s % 32) & 1u) slots.push_back({sp.page, sp.cls, s, pos[s]});
  }
  const size_t n = slots.size();
  // Queries per block: keep the logits buffer near 16 MiB.
  const uint32_t block = uint32_t(std::clamp<size_t>((size_t(4) << 20) / std::max<size_t>(1, n * group), 1, op.n_q));
  std::vector<float> logits(size_t(block) * group * n), qf(size_t(block) * group * hd);
  std::vector<float> acc(size_t(block) * group * hd), row(hd), mass(n);
  std::vector<uint8_t> tmp;
  const auto* q = static_cast<const uint8_t*>(op.q);
  auto* out = static_cast<uint8_t*>(op.out);

  for (uint32_t h = 0; h < kv_heads; ++h) {
    std::fill(mass.begin(), mass.end(), 0.f);
    for (uint32_t q0 = 0; q0 < op.n_q; q0 += block) {
      const uint32_t nb = std::min(block, op.n_q - q0), rows = nb * group;
      // Query rows (i, g) = query q0 + i, q head h * group + g; pre-scaled.
      for (uint32_t i = 0; i < nb; ++i)
        for (uint32_t g = 0; g < group; ++g) {
          float* dst = &qf[size_t(i * group + g) * hd];
          kn.to_f32(q + ((size_t(q0 + i) * op.q_heads) + h * group + g) * hd * eb, dt, hd, dst);
          for (uint32_t d = 0; d < hd; ++d) dst[d] *= op.scale;
        }
      // Logits; a slot a query must not see (a later position) gets -inf.
      for (size_t j = 0; j < n; ++j) {
        row_f32(kn, op, slots[j], h, false, row.data(), tmp);
        for (uint32_t i = 0; i < nb; ++i) {
          const bool visible = int64_t(slots[j].pos) <= op.q_pos0 + q0 + i;
          for (uint32_t g = 0; g < group; ++g)
            logits[size_t(i * group + g) * n + j] =
                visible ? kn.dot(&qf[size_t(i * group + g) * hd], row.data(), hd) : -INFINITY;
        }
      }
      for (uint32_t r = 0; r < rows; ++r) {
        float* lr = &logits[size_t(r) * n];
        const float m = n ? *std::max_element(lr, lr + n) : -INFINITY;
        if (!std::isfinite(m)) {  // the query sees no live token: zero output, no mass
          std::fill(lr, lr + n, 0.f);
          continue;
        }
        const float inv = 1.f / kn.exp_sum(lr, uint32_t(n), m);
        for (size_t j = 0; j < n; ++j) lr[j] *= inv;  // probabilities
      }
      std::fill(acc.begin(), acc.begin() + size_t(rows) * hd, 0.f);
      for (size_t j = 0; j < n; ++j) {
        row_f32(kn, op, slots[j], h, true, row.data(), tmp);
        float m = 0;
        for (uint32_t r = 0; r < rows; ++r) {
          const float p = logits[size_t(r) * n + j];
          if (p != 0.f) kn.axpy(p, row.data(), &acc[size_t(r) * hd], hd);
          m += p;
        }
        mass[j] += m;
      }
      for (uint32_t i = 0; i < nb; ++i)
        for (uint32_t g = 0; g < group; ++g) {
          uint8_t* dst = out + ((size_t(q0 + i) * op.q_heads) + h * group + g) * hd * eb;
          const float* a = &acc[size_t(i * group + g) * hd];
          for (uint32_t d = 0; d < hd; ++d) store(dst + d * eb, dt, a[d]);
        }
    }
    if (op.add_scores)
      for (size_t j = 0; j < n; ++j) {
        const PageLayout& L = op.layout[slots[j].cls];
        reinterpret_cast<float*>(slots[j].page + L.score_off)[slots[j].slot] += mass[j];
      }
  }
}

}  // namespace kvgc::cpu
