// bench/attend: CPU decode attention (kernels/cpu/attend.cpp) against the memory-
// bandwidth bound of the bytes it must read, measured side by side in one run; fp16
// against int8 and int4 pages at the same live-token count; fused scores against none.
//
// Pages are built directly (the op's own input format) from random data: 8 KV heads, 32
// query heads (GQA 4), head_dim 64 and 128, 4K and 32K live tokens, f16 model dtype,
// pages of 16. The bound: bytes of K and V the op reads, over the read bandwidth of a
// vectorised sum of a buffer of the same size, measured in the same run. A second floor:
// the FMAs the op cannot avoid (K.q and p.V for every live slot, head and query row, in
// fp32) over the core's FMA rate, also measured in the same run; the op can be no faster
// than the larger of the two.
//
// Two cache states. "In cache": the same layer attended again and again, so a 4K-token
// layer (8-16 MiB) stays in L3 and the op is compute-bound there. "Decode step": what a
// model's decode step does, attention over enough layers in turn (copies of the same
// pages, at least 8x the L3 between a layer and its next visit) that each layer comes
// from DRAM, against the read bandwidth of a buffer of all of their bytes.
// GCC 12's _mm512_reduce_add_ps trips -Wuninitialized on its internal temporary.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <random>
#include <vector>

#include "../kernels/cpu/attend.hpp"
#include "../runtime/backend.hpp"
#include "../kernels/cpu/convert.hpp"
#include "../kernels/cpu/quant.hpp"
#include "bench_util.hpp"

using namespace kvgc;
using namespace kvgc::bench;

namespace {

constexpr uint32_t kKvHeads = 8, kQHeads = 32, kPageTokens = 16;

// The pages live in one arena reserved by the CPU backend, as a heap's do (2 MiB
// aligned, huge pages where the OS gives them), one after another.
struct Segment {
  PageLayout layout[KVGC_CLASS_COUNT];
  std::unique_ptr<Backend> backend = make_cpu_backend();
  void* arena = nullptr;
  std::vector<SegPage> seg;
  uint64_t live = 0;
  ~Segment() {
    if (arena) backend->release(arena);
  }
};

// `tokens` live tokens in pages of class `cls`, from random f16 data.
void build(Segment& s, uint32_t head_dim, uint32_t tokens, kvgc_storage_class cls, std::mt19937& rng) {
  for (int c = 0; c < KVGC_CLASS_COUNT; ++c)
    s.layout[c] = PageLayout::make(kPageTokens, kKvHeads, head_dim, KVGC_DTYPE_F16, kvgc_storage_class(c));
  const PageLayout& L = s.layout[cls];
  std::normal_distribution<float> gauss(0.f, 1.f);
  std::vector<uint8_t> row(head_dim * 2);
  const size_t n_pages = (tokens + kPageTokens - 1) / kPageTokens;
  if (!s.backend->reserve(n_pages * L.bytes, &s.arena).ok()) {
    std::fprintf(stderr, "kvgc-bench-attend: cannot reserve %zu bytes\n", n_pages * L.bytes);
    std::exit(1);
  }
  for (uint32_t t = 0; t < tokens; t += kPageTokens) {
    auto* page = static_cast<uint8_t*>(s.arena) + (t / kPageTokens) * L.bytes;
    std::memset(page, 0, L.bytes);
    for (uint32_t slot = 0; slot < kPageTokens; ++slot) {
      reinterpret_cast<uint32_t*>(page + L.live_off)[slot / 32] |= 1u << (slot % 32);
      reinterpret_cast<int32_t*>(page + L.pos_off)[slot] = int32_t(t + slot);
      page[L.gen_off + slot] = kGenIntermediate;
      for (uint32_t h = 0; h < kKvHeads; ++h)
        for (bool v : {false, true}) {
          for (uint32_t d = 0; d < head_dim; ++d) cpu::store(&row[2 * d], KVGC_DTYPE_F16, gauss(rng));
          cpu::store_row(L, page, h, slot, v, row.data());  // quantised for INT8 and INT4
        }
    }
    s.seg.push_back({page, uint32_t(cls), s.live});
    s.live += kPageTokens;
  }
}

// A copy of `src`'s pages in an arena of its own (another layer with the same tokens).
void replicate(const Segment& src, Segment& dst) {
  for (int c = 0; c < KVGC_CLASS_COUNT; ++c) dst.layout[c] = src.layout[c];
  const size_t bytes = src.seg.size() * src.layout[src.seg.empty() ? 0 : src.seg[0].cls].bytes;
  if (!dst.backend->reserve(bytes, &dst.arena).ok()) {
    std::fprintf(stderr, "kvgc-bench-attend: cannot reserve %zu bytes\n", bytes);
    std::exit(1);
  }
  std::memcpy(dst.arena, src.arena, bytes);
  for (const SegPage& p : src.seg)
    dst.seg.push_back({static_cast<uint8_t*>(dst.arena) + (p.page - static_cast<uint8_t*>(src.arena)),
                       p.cls, p.out_row});
  dst.live = src.live;
}

AttendOp decode_op(const Segment& s, bool scores, const std::vector<uint16_t>& q, std::vector<uint16_t>& out) {
  return AttendOp{{s.layout[0], s.layout[1], s.layout[2], s.layout[3]}, s.seg.data(), uint32_t(s.seg.size()), s.live, q.data(), 1,
                  kQHeads, int64_t(s.live) - 1, 0.125f, out.data(), scores};
}

// Median time of one layer's attention in a decode step over all of `layers` in turn.
double step_ns(const std::vector<Segment>& layers, const std::vector<uint16_t>& q,
               std::vector<uint16_t>& out, int reps) {
  for (const Segment& s : layers) cpu::attend(decode_op(s, true, q, out));  // first touch
  return median_of(reps, [&] {
    const Timer t;
    for (const Segment& s : layers) cpu::attend(decode_op(s, true, q, out));
    const double ns = t.elapsed_ns();
    do_not_optimize(out[0]);
    return ns / double(layers.size());
  }).median;
}

// The L3 size (sysfs; 32 MiB when unknown).
size_t l3_bytes() {
  if (FILE* f = std::fopen("/sys/devices/system/cpu/cpu0/cache/index3/size", "r")) {
    size_t kib = 0;
    const bool ok = std::fscanf(f, "%zuK", &kib) == 1;
    std::fclose(f);
    if (ok && kib > 0) return kib << 10;
  }
  return size_t(32) << 20;
}

double attend_ns(const Segment& s, bool scores, const std::vector<uint16_t>& q, std::vector<uint16_t>& out,
                 int reps) {
  const AttendOp op = decode_op(s, scores, q, out);
  cpu::attend(op);  // warm-up: first-touch and cache state out of the timings
  return median_of(reps, [&] {
    const Timer t;
    cpu::attend(op);
    const double ns = t.elapsed_ns();
    do_not_optimize(out[0]);
    return ns;
  }).median;
}

// Read bandwidth of a vectorisable sum over `bytes` (the bound's denominator).
// The buffer comes from the same arena reservation as the pages (huge pages alike).
double read_gbps(size_t bytes, int reps) {
  const std::unique_ptr<Backend> backend = make_cpu_backend();
  void* arena = nullptr;
  if (!backend->reserve(bytes, &arena).ok()) std::exit(1);
  const std::span<uint64_t> buf(static_cast<uint64_t*>(arena), bytes / 8);
  for (size_t i = 0; i < buf.size(); ++i) buf[i] = i * 2654435761u;
  const double ns = median_of(reps, [&] {
    const Timer t;
    uint64_t a = 0, b = 0, c = 0, d = 0;
    for (size_t i = 0; i + 4 <= buf.size(); i += 4) a += buf[i], b += buf[i + 1], c += buf[i + 2], d += buf[i + 3];
    do_not_optimize(a + b + c + d);
    return t.elapsed_ns();
  }).median;
  backend->release(arena);
  return double(bytes) / ns;
}

// Vector FMAs per ns of one core at the attention path's vector width: 12 independent
// accumulator chains (enough to cover the FMA latency on current cores), median of 5.
constexpr int kChains = 12;
constexpr int64_t kFmaIters = 20'000'000;

#define KVGC_FMA_RATE(NAME, TARGET, VEC, SET1, FMA, SUM)                     \
  __attribute__((target(TARGET))) double NAME##_once() {                  \
    VEC acc[kChains];                                                     \
    for (int c = 0; c < kChains; ++c) acc[c] = SET1(1e-9f * float(c));   \
    VEC x = SET1(0.999f), y = SET1(1e-6f);                                \
    asm volatile("" : "+v"(x), "+v"(y));  /* opaque: nothing folds */     \
    const Timer t;                                                        \
    for (int64_t i = 0; i < kFmaIters; ++i)                               \
      for (int c = 0; c < kChains; ++c) acc[c] = FMA(x, y, acc[c]);       \
    const double ns = t.elapsed_ns();                                     \
    float sink = 0;                                                       \
    for (int c = 0; c < kChains; ++c) sink += SUM(acc[c]);                \
    do_not_optimize(sink);                                                \
    return double(kFmaIters) * kChains / ns;                              \
  }                                                                       \
  double NAME() { return median_of(5, [] { return NAME##_once(); }).median; }

__attribute__((target("avx2"))) inline float sum256(__m256 v) {
  alignas(32) float f[8];
  _mm256_store_ps(f, v);
  return f[0] + f[7];
}
KVGC_FMA_RATE(fma_rate_avx512, "avx512f", __m512, _mm512_set1_ps, _mm512_fmadd_ps, _mm512_reduce_add_ps)
KVGC_FMA_RATE(fma_rate_avx2, "avx2,fma", __m256, _mm256_set1_ps, _mm256_fmadd_ps, sum256)
#undef KVGC_FMA_RATE

}  // namespace

int main(int argc, char** argv) {
  bool quick = false;
  if (const int status = quick_only_args(argc, argv, &quick); status >= 0) return status;
  const int reps = quick ? 3 : 9;
  std::mt19937 rng(17);
  std::printf("kvgc-bench-attend: CPU decode attention, %u KV heads, %u query heads (GQA %u), f16, "
              "pages of %u, %s path, single thread\n\n",
              kKvHeads, kQHeads, kQHeads / kKvHeads, kPageTokens,
              cpu::simd_name());
  // The FMA floor uses the vector width of the path the op runs.
  const std::string path = cpu::simd_name();
  const int lanes = path == "AVX-512" ? 16 : path == "AVX2" ? 8 : 1;
  const double fma_per_ns = lanes == 16 ? fma_rate_avx512() : lanes == 8 ? fma_rate_avx2() : 0;
  if (lanes > 1)
    std::printf("FMA rate: %.2f %d-lane FMAs/ns (%.1f GFLOP/s fp32)\n\n", fma_per_ns, lanes,
                fma_per_ns * lanes * 2);
  // floor = the larger of the bandwidth bound and the FMA time.
  std::printf("| head_dim | live | read GB/s | fp16 ms | bound ms | FMA ms | fp16/bound | fp16/floor | int8 ms | fp16/int8 | int4 ms | int4/floor | fp16/int4 | scores/no-scores |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  ResultLine result;
  std::string step_table;  // the decode-step rows, printed after the in-cache table
  const size_t cold_bytes = 8 * l3_bytes();
  for (uint32_t hd : {64u, 128u}) {
    for (uint32_t live : quick ? std::vector<uint32_t>{4096} : std::vector<uint32_t>{4096, 32768}) {
      Segment f, i8, i4;
      build(f, hd, live, KVGC_CLASS_FP16, rng);
      build(i8, hd, live, KVGC_CLASS_INT8, rng);
      build(i4, hd, live, KVGC_CLASS_INT4, rng);
      std::vector<uint16_t> q(kQHeads * hd), out(q.size());
      std::normal_distribution<float> gauss(0.f, 1.f);
      for (auto& x : q) x = cpu::f32_to_f16(gauss(rng));
      const double bytes = double(live) * kKvHeads * 2 * hd * 2;  // K and V, f16
      const double gbps = read_gbps(size_t(bytes), reps);
      const double bound_ns = bytes / gbps;
      const double t16 = attend_ns(f, true, q, out, reps);
      const double t16_plain = attend_ns(f, false, q, out, reps);
      const double t8 = attend_ns(i8, true, q, out, reps);
      const double t4 = attend_ns(i4, true, q, out, reps);
      // K.q and p.V: every live slot, KV head, query row (GQA group) and dim, once each.
      const double fmas = 2.0 * live * kKvHeads * (kQHeads / kKvHeads) * hd / std::max(lanes, 1);
      const double fma_ns = fma_per_ns > 0 ? fmas / fma_per_ns : 0.0;
      const double floor_ns = std::max(bound_ns, fma_ns);
      std::printf("| %u | %u | %.1f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.3f |\n",
                  hd, live, gbps, t16 / 1e6, bound_ns / 1e6, fma_ns / 1e6, t16 / bound_ns,
                  t16 / floor_ns, t8 / 1e6, t16 / t8, t4 / 1e6, t4 / floor_ns, t16 / t4, t16 / t16_plain);
      std::fflush(stdout);
      const std::string k = "hd" + std::to_string(hd) + "_" + std::to_string(live / 1024) + "k";
      result.add("vs_bound_" + k, t16 / bound_ns);
      result.add("vs_floor_" + k, t16 / floor_ns);
      result.add("int8_speedup_" + k, t16 / t8);
      result.add("int4_speedup_" + k, t16 / t4);
      result.add("score_overhead_" + k, t16 / t16_plain, 3);

      // Decode step: enough layers that each one's pages leave the caches before its turn.
      const size_t layer_bytes = f.seg.size() * f.layout[0].bytes;
      const size_t n_layers = std::clamp<size_t>((cold_bytes + layer_bytes - 1) / layer_bytes, 1, 32);
      std::vector<Segment> layers16(n_layers), layers8(n_layers), layers4(n_layers);
      for (size_t l = 0; l < n_layers; ++l) {
        replicate(f, layers16[l]);
        replicate(i8, layers8[l]);
        replicate(i4, layers4[l]);
      }
      const double step_gbps = read_gbps(size_t(bytes) * n_layers, quick ? 1 : 3);
      const double step_bound_ns = bytes / step_gbps;
      const double s16 = step_ns(layers16, q, out, quick ? 1 : 5);
      const double s8 = step_ns(layers8, q, out, quick ? 1 : 5);
      const double s4 = step_ns(layers4, q, out, quick ? 1 : 5);
      char row[256];
      std::snprintf(row, sizeof row, "| %u | %u | %zu | %.1f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f |\n", hd, live,
                    n_layers, step_gbps, s16 / 1e6, step_bound_ns / 1e6, s16 / step_bound_ns, s8 / 1e6, s16 / s8,
                    s4 / 1e6, s16 / s4);
      step_table += row;
      result.add("step_vs_bound_" + k, s16 / step_bound_ns);
      result.add("step_int8_speedup_" + k, s16 / s8);
      result.add("step_int4_speedup_" + k, s16 / s4);
    }
  }
  std::printf("\nDecode step: one layer's attention while every layer is attended in turn (per layer)\n\n");
  std::printf("| head_dim | live | layers | read GB/s | fp16 ms | bound ms | fp16/bound | int8 ms | fp16/int8 | int4 ms | fp16/int4 |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|\n%s", step_table.c_str());
  result.print();
  return 0;
}
