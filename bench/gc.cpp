// bench/gc: what the GC costs per decode step, generational against h2o's full ranking
// at the same budget, side by side in one run; and compaction's throughput against
// memcpy of the same bytes.
//
// Step cost: one segment (Llama-3-8B's per-layer KV: 8 KV heads x 128, f16) holding L
// live tokens (L = 4K, 32K, 128K = its token budget). Each decode step appends one token,
// hands in attention mass for every live token (untimed: that is the engine's attention)
// and calls kvgc_step (timed). Generational GCs are bursty (a minor GC per 16 tokens, a
// refresh per 8 minors), so the figure is the mean over windows of 128 steps, after a
// warm-up that reaches the steady state; the median of 3 windows is reported.
//
// Compaction: 32K tokens of the same shape in pages with half the slots dead at random,
// compacted by the CPU op (restored from a pristine copy before each repetition), against
// one memcpy of as many bytes as the op moves.
#include <algorithm>
#include <bit>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "../gc/compaction.hpp"
#include "../kernels/cpu/gc.hpp"
#include "bench_util.hpp"
#include "kvgc.h"

using namespace kvgc;
using namespace kvgc::bench;

namespace {

constexpr uint32_t kKvHeads = 8, kHeadDim = 128, kPageTokens = 16;

#define CHECK_OK(heap, call)                                                        \
  do {                                                                              \
    kvgc_status s_ = (call);                                                        \
    if (s_ != KVGC_OK) {                                                            \
      std::fprintf(stderr, "%s: %s: %s\n", #call, kvgc_status_str(s_), kvgc_errmsg(heap)); \
      std::exit(1);                                                                 \
    }                                                                               \
  } while (0)

struct StepCost {
  double ns_per_step = NAN, ranked_per_step = NAN;
};

StepCost step_cost(kvgc_policy policy, uint32_t live, int windows, int window_steps) {
  kvgc_model_desc m;
  kvgc_model_desc_init(&m);
  m.n_layers = 1;
  m.n_q_heads = 32;
  m.n_kv_heads = kKvHeads;
  m.head_dim = kHeadDim;
  m.dtype = KVGC_DTYPE_F16;
  kvgc_heap_options o;
  kvgc_heap_options_init(&o);
  o.flags = KVGC_OPT_IGNORE_ENV;
  o.device = KVGC_DEVICE_CPU;
  o.policy = policy;
  o.token_budget = live;
  o.page_tokens = kPageTokens;
  uint64_t bytes = 0;
  kvgc_kv_bytes(&m, live + 4096, KVGC_CLASS_FP16, kPageTokens, &bytes);
  o.budget_bytes = bytes + (64ull << 20);
  kvgc_heap* h = nullptr;
  CHECK_OK(nullptr, kvgc_heap_create(&m, &o, &h));
  kvgc_seq s;
  CHECK_OK(h, kvgc_seq_create(h, 0, &s));

  const uint32_t chunk = 4096;
  std::vector<uint16_t> kv(size_t(chunk) * kKvHeads * kHeadDim);
  std::mt19937 rng(5);
  for (auto& x : kv) x = uint16_t(rng() & 0x3bff);  // finite halves in (-1, 1)
  for (uint32_t at = 0; at < live; at += chunk)
    CHECK_OK(h, kvgc_append(h, s, 0, kv.data(), kv.data(), std::min(chunk, live - at), nullptr));
  // Attention mass: a fixed random draw per live row (heavy-tailed, like real attention).
  std::vector<float> mass(live + 4096);
  std::exponential_distribution<float> expo(1.0f);
  for (auto& x : mass) x = expo(rng) * expo(rng) / float(live);

  auto one_step = [&](bool timed, double* ns) {
    CHECK_OK(h, kvgc_append(h, s, 0, kv.data(), kv.data(), 1, nullptr));
    uint64_t n = 0;
    CHECK_OK(h, kvgc_seq_tokens(h, s, 0, &n, nullptr));
    CHECK_OK(h, kvgc_observe(h, s, 0, mass.data(), n, nullptr));
    const Timer t;
    CHECK_OK(h, kvgc_step(h, s, nullptr));
    if (timed) *ns += t.elapsed_ns();
  };
  double ignored = 0;
  for (int i = 0; i < 3 * window_steps; ++i) one_step(false, &ignored);  // reach steady state
  kvgc_stats st;
  kvgc_stats_init(&st);
  std::vector<double> per_step;
  uint64_t ranked = 0, steps = 0;
  for (int w = 0; w < windows; ++w) {
    kvgc_get_stats(h, &st);
    const uint64_t ranked0 = st.tokens_ranked;
    double ns = 0;
    for (int i = 0; i < window_steps; ++i) one_step(true, &ns);
    kvgc_get_stats(h, &st);
    ranked += st.tokens_ranked - ranked0;
    steps += window_steps;
    per_step.push_back(ns / window_steps);
  }
  CHECK_OK(h, kvgc_heap_check(h));
  kvgc_heap_destroy(h);
  std::sort(per_step.begin(), per_step.end());
  return {per_step[per_step.size() / 2], double(ranked) / double(steps)};
}

struct CompactCost {
  double compact_ns = NAN, memcpy_ns = NAN;
  uint64_t bytes = 0, slots = 0;
};

CompactCost compaction_vs_memcpy(uint32_t tokens, int reps) {
  const PageLayout L = PageLayout::make(kPageTokens, kKvHeads, kHeadDim, KVGC_DTYPE_F16, KVGC_CLASS_FP16);
  const uint32_t pages = tokens / kPageTokens;
  const size_t arena = size_t(pages) * L.bytes;
  auto* pristine = static_cast<uint8_t*>(std::aligned_alloc(4096, arena));
  auto* work = static_cast<uint8_t*>(std::aligned_alloc(4096, arena));
  std::mt19937 rng(9);
  for (size_t i = 0; i < arena; i += 4) {
    const uint32_t x = rng();
    std::memcpy(pristine + i, &x, 4);
  }
  host::vector<PageCounts> counts(pages);
  for (uint32_t p = 0; p < pages; ++p) {
    uint8_t* page = pristine + size_t(p) * L.bytes;
    auto* live = reinterpret_cast<uint32_t*>(page + L.live_off);
    live[0] = 0;
    for (uint32_t s = 0; s < kPageTokens; ++s) {
      reinterpret_cast<int32_t*>(page + L.pos_off)[s] = int32_t(p * kPageTokens + s);
      page[L.gen_off + s] = kGenIntermediate;
      if (rng() % 2) live[0] |= 1u << s;  // half the slots dead, scattered
    }
    counts[p] = {kPageTokens, uint32_t(std::popcount(live[0]))};
  }
  const CompactionPlan plan = plan_compaction(counts, kPageTokens);
  std::vector<CompactMove> moves;
  for (const Move& m : plan.moves)
    moves.push_back({work + size_t(m.dst) * L.bytes, work + size_t(m.src) * L.bytes, m.count});
  const CompactOp op{L, moves.data(), uint32_t(moves.size())};
  CompactCost c;
  c.slots = plan.slots_moved;
  // K and V rows of every head plus the slot's position, score and generation.
  c.bytes = plan.slots_moved * (2 * kKvHeads * L.slot_stride + 4 + 4 + 1);
  c.compact_ns = median_of(reps, [&] {
    std::memcpy(work, pristine, arena);  // restore, untimed
    const Timer t;
    cpu::compact(op);
    const double ns = t.elapsed_ns();
    do_not_optimize(work[0]);
    return ns;
  }).median;
  auto* src = static_cast<uint8_t*>(std::aligned_alloc(4096, c.bytes + 4096));
  auto* dst = static_cast<uint8_t*>(std::aligned_alloc(4096, c.bytes + 4096));
  std::memcpy(src, pristine, std::min<size_t>(c.bytes, arena));
  std::memset(dst, 1, c.bytes);
  c.memcpy_ns = median_of(reps, [&] {
    std::memcpy(work, pristine, arena);  // the same cache disturbance as above
    const Timer t;
    std::memcpy(dst, src, c.bytes);
    const double ns = t.elapsed_ns();
    do_not_optimize(dst[0]);
    return ns;
  }).median;
  // The op must have kept every live token: count live bits after one more run.
  std::memcpy(work, pristine, arena);
  cpu::compact(op);
  uint64_t live_after = 0, live_before = 0;
  for (uint32_t p = 0; p < pages; ++p) {
    live_before += counts[p].live;
    live_after += std::popcount(*reinterpret_cast<uint32_t*>(work + size_t(p) * L.bytes + L.live_off));
  }
  if (live_after != live_before) {
    std::fprintf(stderr, "compaction lost tokens: %llu -> %llu\n", (unsigned long long)live_before,
                 (unsigned long long)live_after);
    std::exit(1);
  }
  std::free(pristine);
  std::free(work);
  std::free(src);
  std::free(dst);
  return c;
}

}  // namespace

int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  const std::vector<uint32_t> sizes = quick ? std::vector<uint32_t>{4096}
                                            : std::vector<uint32_t>{4096, 32768, 131072};
  const int windows = quick ? 1 : 3, window_steps = 128;
  std::printf("kvgc-bench-gc: one segment, 8 KV heads x 128 dims f16, page 16 tokens, CPU backend\n");
  std::printf("per decode step: append 1 token, observe mass (untimed), kvgc_step (timed);\n"
              "mean over %d-step windows after a %d-step warm-up, median of %d windows\n\n",
              window_steps, 3 * window_steps, windows);
  std::printf("| live tokens | generational us/step | h2o us/step | time ratio | generational ranked/step | h2o ranked/step | ranked ratio |\n");
  std::printf("|---|---|---|---|---|---|---|\n");
  ResultLine result;
  double time_ratio_32k = NAN, ranked_ratio_32k = NAN;
  std::vector<std::pair<std::string, double>> extra;
  for (uint32_t live : sizes) {
    const StepCost gen = step_cost(KVGC_POLICY_GENERATIONAL, live, windows, window_steps);
    const StepCost h2o = step_cost(KVGC_POLICY_H2O, live, windows, window_steps);
    const double tr = ratio(h2o.ns_per_step, gen.ns_per_step);
    const double rr = ratio(h2o.ranked_per_step, gen.ranked_per_step);
    std::printf("| %u | %.1f | %.1f | %.1fx | %.0f | %.0f | %.1fx |\n", live, gen.ns_per_step / 1e3,
                h2o.ns_per_step / 1e3, tr, gen.ranked_per_step, h2o.ranked_per_step, rr);
    std::fflush(stdout);
    if (live == 32768 || sizes.size() == 1) time_ratio_32k = tr, ranked_ratio_32k = rr;
    const std::string k = std::to_string(live / 1024) + "k";
    extra.push_back({"gen_us_" + k, gen.ns_per_step / 1e3});
    extra.push_back({"h2o_us_" + k, h2o.ns_per_step / 1e3});
  }
  const CompactCost c = compaction_vs_memcpy(32768, quick ? 3 : 9);
  const double throughput_ratio = ratio(c.memcpy_ns, c.compact_ns);
  std::printf("\ncompaction: %llu slots moved (%.1f MiB incl. metadata) in %.2f ms; memcpy of the same "
              "bytes %.2f ms; throughput ratio %.2f\n",
              (unsigned long long)c.slots, double(c.bytes) / (1 << 20), c.compact_ns / 1e6,
              c.memcpy_ns / 1e6, throughput_ratio);
  const std::string at = sizes.size() == 1 ? "4k" : "32k";
  result.add("time_ratio_" + at, time_ratio_32k);
  result.add("ranked_ratio_" + at, ranked_ratio_32k);
  result.add("compact_vs_memcpy", throughput_ratio);
  for (const auto& [k, v] : extra) result.add(k, v, 1);
  result.add("compact_GBps", double(c.bytes) / c.compact_ns, 2);
  result.print();
  return 0;
}
