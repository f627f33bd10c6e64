// bench/cuda_gc: the GC's CUDA ops, side by side in one run (CUDA events and host
// clocks, medians), Llama-3-8B's per-layer KV shape (8 KV heads x 128, 32 query heads,
// f16, pages of 16):
//
//   compaction:  32K tokens x batch 8 in pages with half the slots dead at random,
//                compacted by the CUDA op (the planner's moves; headers restored from
//                a pristine copy before each repetition, untimed) against
//                cudaMemcpyAsync D2D of the bytes it moves (K/V rows + slot metadata);
//                both counted read + written. Goal >= 0.70.
//   kvgc_step:   a steady decode step at 32K live tokens per segment: append 16,
//                observe, step (h2o evicts 16; generational's minor/major GCs, mean
//                per step). Host clock: a step synchronises the stream (select).
//   attention:   decode (one query) over 32K x batch 8 in fp16 pages against the same
//                tokens demoted to int4 by one kvgc_step (equal masses, a budget that
//                demotes every unprotected token).
#include <cuda_runtime.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "../gc/compaction.hpp"
#include "../kernels/cuda/gc.cuh"
#include "cuda_bench_util.hpp"
#include "kvgc.h"

using kvgc::bench::median_ms;
using kvgc::bench::one_layer;

namespace {

constexpr uint32_t kKvHeads = 8, kQHeads = 32, kHeadDim = 128, kPt = 16;

kvgc_model_desc llama_layer() { return one_layer(kQHeads, kKvHeads, kHeadDim); }

kvgc_heap* cuda_heap(kvgc_heap_options o) {
  o.flags = KVGC_OPT_IGNORE_ENV;
  o.device = KVGC_DEVICE_CUDA;
  const kvgc_model_desc m = llama_layer();
  kvgc_heap* h = nullptr;
  KVGC_OK(nullptr, kvgc_heap_create(&m, &o, &h));
  return h;
}

// Compaction of `batch` segments of `tokens` slots with about half dead; returns ms
// (median) and sets *bytes to what one compaction moves and *intact to whether the
// live counts after it match the plan's.
// *gpu_ms: the same op with the host's enqueueing out of the timed range (the stream
// waits on a host function while the host enqueues), *enqueue_ms: the host's time to
// enqueue it; both medians.
double bench_compaction(uint32_t tokens, uint32_t batch, int reps, cudaStream_t s, double* bytes,
                        double* copy_ms, double* gpu_ms, double* enqueue_ms, bool* intact) {
  const kvgc::PageLayout L = kvgc::PageLayout::make(kPt, kKvHeads, kHeadDim, KVGC_DTYPE_F16, KVGC_CLASS_FP16);
  const size_t per_seq = tokens / kPt, n_pages = per_seq * batch;
  uint8_t* pages = nullptr;
  uint8_t* pristine = nullptr;  // headers (live, pos, score, gen) of every page
  CUDA_OK(cudaMalloc(&pages, n_pages * L.bytes));
  CUDA_OK(cudaMalloc(&pristine, n_pages * L.k_off));
  // Payload: random bits (not zeros) from one host page replicated; headers built here.
  std::mt19937 rng(7);
  std::vector<uint8_t> page(L.bytes);
  for (auto& b : page) b = uint8_t(rng());
  for (size_t i = 0; i < n_pages; ++i)
    CUDA_OK(cudaMemcpyAsync(pages + i * L.bytes, page.data(), L.bytes, cudaMemcpyHostToDevice, s));
  std::vector<uint8_t> headers(n_pages * L.k_off, 0);
  std::vector<kvgc::CompactMove> moves;
  std::vector<uint32_t> expect(n_pages);
  uint64_t slots_moved = 0;
  std::vector<size_t> seq_moves(batch + 1, 0);
  for (uint32_t b = 0; b < batch; ++b) {
    kvgc::host::vector<kvgc::PageCounts> counts(per_seq);
    for (size_t p = 0; p < per_seq; ++p) {
      uint8_t* h = headers.data() + (b * per_seq + p) * L.k_off;
      uint32_t live = 0;
      for (uint32_t slot = 0; slot < kPt; ++slot) {
        reinterpret_cast<int32_t*>(h + L.pos_off)[slot] = int32_t(p * kPt + slot);
        h[L.gen_off + slot] = kvgc::kGenIntermediate;
        if (rng() % 2) {
          reinterpret_cast<uint32_t*>(h + L.live_off)[slot / 32] |= 1u << (slot % 32);
          ++live;
        }
      }
      counts[p] = {kPt, live};
    }
    const kvgc::CompactionPlan plan = kvgc::plan_compaction(counts, kPt);
    for (const kvgc::Move& mv : plan.moves)
      moves.push_back({pages + (b * per_seq + mv.dst) * L.bytes, pages + (b * per_seq + mv.src) * L.bytes, mv.count});
    for (size_t p = 0; p < per_seq; ++p) expect[b * per_seq + p] = counts[p].live;
    slots_moved += plan.slots_moved;
    seq_moves[b + 1] = moves.size();
  }
  CUDA_OK(cudaMemcpy2DAsync(pristine, L.k_off, headers.data(), L.k_off, L.k_off, n_pages,
                            cudaMemcpyHostToDevice, s));
  auto restore = [&] {
    CUDA_OK(cudaMemcpy2DAsync(pages, L.bytes, pristine, L.k_off, L.k_off, n_pages,
                              cudaMemcpyDeviceToDevice, s));
  };
  auto compact_all = [&] {
    for (uint32_t b = 0; b < batch; ++b) {
      const kvgc::CompactOp op{L, moves.data() + seq_moves[b], uint32_t(seq_moves[b + 1] - seq_moves[b])};
      CUDA_OK(kvgc::cuda::compact(op, s));
    }
  };
  const double compact_ms = median_ms(reps, s, compact_all, restore);
  auto gate = [](void*) { std::this_thread::sleep_for(std::chrono::milliseconds(20)); };
  *gpu_ms = median_ms(reps, s, compact_all, [&] {
    restore();
    CUDA_OK(cudaLaunchHostFunc(s, gate, nullptr));
  });
  std::vector<double> enq;
  for (int i = 0; i < reps; ++i) {
    restore();
    CUDA_OK(cudaStreamSynchronize(s));
    const auto t0 = std::chrono::steady_clock::now();
    compact_all();
    enq.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    CUDA_OK(cudaStreamSynchronize(s));
  }
  std::sort(enq.begin(), enq.end());
  *enqueue_ms = enq[enq.size() / 2];
  // Live counts after the last compaction against the plan's.
  std::vector<uint8_t> after(n_pages * L.k_off);
  CUDA_OK(cudaMemcpy2D(after.data(), L.k_off, pages, L.bytes, L.k_off, n_pages, cudaMemcpyDeviceToHost));
  *intact = true;
  for (size_t i = 0; i < n_pages; ++i) {
    const uint32_t live = uint32_t(std::popcount(*reinterpret_cast<const uint32_t*>(after.data() + i * L.k_off + L.live_off)));
    *intact = *intact && live == expect[i];
  }
  *bytes = double(slots_moved) * (2.0 * kKvHeads * L.slot_stride + 9.0);  // K/V + pos, score, gen
  void *a, *b;
  CUDA_OK(cudaMalloc(&a, size_t(*bytes)));
  CUDA_OK(cudaMalloc(&b, size_t(*bytes)));
  CUDA_OK(cudaMemset(a, 1, size_t(*bytes)));
  *copy_ms = median_ms(reps, s, [&] { CUDA_OK(cudaMemcpyAsync(b, a, size_t(*bytes), cudaMemcpyDeviceToDevice, s)); });
  cudaFree(a);
  cudaFree(b);
  cudaFree(pages);
  cudaFree(pristine);
  return compact_ms;
}

struct StepTimes {
  double host_us;   // how long kvgc_step kept the caller
  double total_us;  // until the stream had finished the step's work
};

// Means per steady-state decode step (append 16, observe, kvgc_step) at `tokens`, under
// one harvest mode. The previous step's work is complete before each timed step, as in
// an engine that has read its logits (observe's exact count applies deferred results
// first); a deferred step then only plans and enqueues.
StepTimes bench_step(kvgc_policy policy, kvgc_harvest harvest, uint32_t tokens, int steps,
                     cudaStream_t s, const void* kv, const float* mass) {
  kvgc_heap_options o;
  kvgc_heap_options_init(&o);
  o.policy = policy;
  o.harvest = harvest;
  o.token_budget = tokens;
  const kvgc_model_desc m = llama_layer();
  uint64_t need = 0;
  kvgc_kv_bytes(&m, tokens * 2, KVGC_CLASS_FP16, kPt, &need);
  o.budget_bytes = need + (256ull << 20);
  kvgc_heap* h = cuda_heap(o);
  kvgc_seq q;
  KVGC_OK(h, kvgc_seq_create(h, 0, &q));
  KVGC_OK(h, kvgc_append(h, q, 0, kv, kv, tokens, s));
  auto one = [&] {
    KVGC_OK(h, kvgc_append(h, q, 0, kv, kv, 16, s));
    uint64_t live = 0;  // exact: applies pending results (complete: the stream is idle)
    KVGC_OK(h, kvgc_seq_tokens(h, q, 0, &live, nullptr));
    KVGC_OK(h, kvgc_observe(h, q, 0, mass, live, s));
    CUDA_OK(cudaStreamSynchronize(s));
    const auto t0 = std::chrono::steady_clock::now();
    const kvgc_status st = kvgc_step(h, q, s);
    const auto t1 = std::chrono::steady_clock::now();
    if (st != KVGC_OK && st != KVGC_EBUDGET) KVGC_OK(h, st);
    CUDA_OK(cudaStreamSynchronize(s));
    const auto t2 = std::chrono::steady_clock::now();
    return StepTimes{std::chrono::duration<double, std::micro>(t1 - t0).count(),
                     std::chrono::duration<double, std::micro>(t2 - t0).count()};
  };
  for (int i = 0; i < 24; ++i) one();  // warm-up: generational reaches its steady tiers
  StepTimes sum{0, 0};
  for (int i = 0; i < steps; ++i) {
    const StepTimes t = one();
    sum.host_us += t.host_us / steps;
    sum.total_us += t.total_us / steps;
  }
  kvgc_heap_destroy(h);
  return sum;
}

}  // namespace

int main(int argc, char** argv) {
  int n_dev = 0;
  if (cudaGetDeviceCount(&n_dev) != cudaSuccess || n_dev == 0) {
    std::printf("SKIP: no CUDA device answered; bench/cuda_gc needs a GPU\n");
    return 77;
  }
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  const uint32_t tokens = quick ? 4096 : 32768, batch = quick ? 2 : 8;
  const int reps = quick ? 3 : 15;
  cudaDeviceProp prop{};
  CUDA_OK(cudaGetDeviceProperties(&prop, 0));
  cudaStream_t s;
  CUDA_OK(cudaStreamCreate(&s));

  double bytes = 0, copy_ms = 0, compact_gpu_ms = 0, compact_enqueue_ms = 0;
  bool intact = false;
  const double compact_ms =
      bench_compaction(tokens, batch, reps, s, &bytes, &copy_ms, &compact_gpu_ms, &compact_enqueue_ms, &intact);
  const double compact_gbs = 2 * bytes / (compact_ms * 1e6), copy_gbs = 2 * bytes / (copy_ms * 1e6);
  const double compact_gpu_gbs = 2 * bytes / (compact_gpu_ms * 1e6);

  // Shared inputs: K/V of `tokens` tokens (|x| < 1 f16 bits), masses.
  const size_t seq_bytes = size_t(tokens) * kKvHeads * kHeadDim * 2;
  std::vector<uint16_t> host(seq_bytes / 2);
  std::mt19937 rng(3);
  for (auto& x : host) x = uint16_t((rng() & 0x33ff) | ((rng() & 1) << 15));
  void* kv;
  CUDA_OK(cudaMalloc(&kv, seq_bytes));
  CUDA_OK(cudaMemcpy(kv, host.data(), seq_bytes, cudaMemcpyHostToDevice));
  std::vector<float> w(size_t(tokens) * 2);
  for (auto& x : w) x = float(rng() % 1000) / 1000.f;
  float* mass;
  CUDA_OK(cudaMalloc(&mass, w.size() * 4));
  CUDA_OK(cudaMemcpy(mass, w.data(), w.size() * 4, cudaMemcpyHostToDevice));
  const int steps = quick ? 8 : 64;
  const StepTimes h2o_now = bench_step(KVGC_POLICY_H2O, KVGC_HARVEST_IMMEDIATE, tokens, steps, s, kv, mass);
  const StepTimes h2o_late = bench_step(KVGC_POLICY_H2O, KVGC_HARVEST_DEFERRED, tokens, steps, s, kv, mass);
  const StepTimes gen_late =
      bench_step(KVGC_POLICY_GENERATIONAL, KVGC_HARVEST_DEFERRED, tokens, steps, s, kv, mass);

  // Attention: fp16 heap (policy full) against an int4 heap (one demoting step).
  const kvgc_model_desc m = llama_layer();
  uint64_t need16 = 0, need4 = 0;
  kvgc_kv_bytes(&m, tokens + 64, KVGC_CLASS_FP16, kPt, &need16);
  kvgc_kv_bytes(&m, tokens + 64, KVGC_CLASS_INT4, kPt, &need4);
  kvgc_heap_options o;
  kvgc_heap_options_init(&o);
  o.policy = KVGC_POLICY_FULL;
  o.budget_bytes = need16 * batch * 11 / 10 + (512ull << 20);
  kvgc_heap* fp16 = cuda_heap(o);
  o.policy = KVGC_POLICY_H2O;
  o.demote = KVGC_DEMOTE_INT4;
  o.budget_bytes = (need16 + need4) * batch * 11 / 10 + (512ull << 20);
  const double int4_cost = double(need4) / double(need16);
  const uint64_t protect = o.sinks + o.window;
  o.token_budget = uint64_t(std::ceil(double(protect) + double(tokens - protect) * int4_cost)) + 1;
  kvgc_heap* int4 = cuda_heap(o);
  std::vector<float> ones(tokens, 1.f);
  CUDA_OK(cudaMemcpy(mass, ones.data(), tokens * 4, cudaMemcpyHostToDevice));
  std::vector<kvgc_seq> s16(batch), s4(batch);
  for (uint32_t b = 0; b < batch; ++b) {
    KVGC_OK(fp16, kvgc_seq_create(fp16, 0, &s16[b]));
    KVGC_OK(int4, kvgc_seq_create(int4, 0, &s4[b]));
    KVGC_OK(fp16, kvgc_append(fp16, s16[b], 0, kv, kv, tokens, s));
    KVGC_OK(int4, kvgc_append(int4, s4[b], 0, kv, kv, tokens, s));
    KVGC_OK(int4, kvgc_observe(int4, s4[b], 0, mass, tokens, s));
    const kvgc_status st = kvgc_step(int4, s4[b], s);
    if (st != KVGC_OK && st != KVGC_EBUDGET) KVGC_OK(int4, st);
  }
  kvgc_stats st4;
  kvgc_stats_init(&st4);
  KVGC_OK(int4, kvgc_get_stats(int4, &st4));
  void *q, *out;
  CUDA_OK(cudaMalloc(&q, kQHeads * kHeadDim * 2));
  CUDA_OK(cudaMalloc(&out, kQHeads * kHeadDim * 2));
  CUDA_OK(cudaMemcpy(q, host.data(), kQHeads * kHeadDim * 2, cudaMemcpyHostToDevice));
  kvgc_attend_params no_scores;
  kvgc_attend_params_init(&no_scores);
  no_scores.flags = KVGC_ATTEND_NO_SCORES;
  const double att16 = median_ms(reps, s, [&] {
    for (auto sq : s16) KVGC_OK(fp16, kvgc_attend(fp16, sq, 0, q, 1, out, &no_scores, s));
  });
  const double att4 = median_ms(reps, s, [&] {
    for (auto sq : s4) KVGC_OK(int4, kvgc_attend(int4, sq, 0, q, 1, out, &no_scores, s));
  });
  std::vector<uint16_t> o_host(kQHeads * kHeadDim);
  CUDA_OK(cudaMemcpy(o_host.data(), out, o_host.size() * 2, cudaMemcpyDeviceToHost));
  for (uint16_t x : o_host) intact = intact && (x & 0x7c00u) != 0x7c00u;  // finite

  std::printf("device: %s, %d SMs; %u KV heads x %u, %u query heads, f16, pages of %u\n", prop.name,
              prop.multiProcessorCount, kKvHeads, kHeadDim, kQHeads, kPt);
  std::printf("compaction, %u tokens x batch %u, half dead: %.1f MiB moved\n", tokens, batch, bytes / (1 << 20));
  std::printf("%-30s %10s %12s %10s\n", "op", "ms", "GB/s (r+w)", "vs memcpy");
  std::printf("%-30s %10.3f %12.1f %10.2f\n", "cudaMemcpy D2D", copy_ms, copy_gbs, 1.0);
  std::printf("%-30s %10.3f %12.1f %10.2f\n", "compact (CUDA op)", compact_ms, compact_gbs, compact_gbs / copy_gbs);
  std::printf("%-30s %10.3f %12.1f %10.2f\n", "  kernels alone (gated)", compact_gpu_ms, compact_gpu_gbs,
              compact_gpu_gbs / copy_gbs);
  std::printf("%-30s %10.3f\n", "  host enqueue", compact_enqueue_ms);
  std::printf("kvgc_step at %u live tokens (append 16 + observe untimed), mean us: caller blocked / "
              "until the stream is done\n", tokens);
  std::printf("  h2o, immediate harvest   %8.1f / %8.1f\n", h2o_now.host_us, h2o_now.total_us);
  std::printf("  h2o, deferred harvest    %8.1f / %8.1f\n", h2o_late.host_us, h2o_late.total_us);
  std::printf("  generational, deferred   %8.1f / %8.1f\n", gen_late.host_us, gen_late.total_us);
  std::printf("decode attention, %u tokens x batch %u, no scores: fp16 %.3f ms, int4 %.3f ms "
              "(int4 heap: %llu live tokens, %llu demoted)\n",
              tokens, batch, att16, att4, (unsigned long long)st4.live_tokens,
              (unsigned long long)st4.tokens_demoted);
  std::printf("checks: compaction live counts and attention outputs %s\n", intact ? "intact" : "CORRUPT");
  std::printf("RESULT compact_vs_memcpy=%.3f compact_kernels_vs_memcpy=%.3f compact_enqueue_ms=%.3f "
              "int4_vs_fp16_attend=%.3f step_blocked_deferred_vs_immediate=%.3f "
              "step_h2o_us=%.1f step_gen_us=%.1f step_h2o_blocked_us=%.1f step_h2o_immediate_blocked_us=%.1f "
              "compact_GBps=%.0f memcpy_GBps=%.0f attend_fp16_ms=%.3f attend_int4_ms=%.3f tokens_demoted=%llu intact=%d\n",
              compact_gbs / copy_gbs, compact_gpu_gbs / copy_gbs, compact_enqueue_ms, att4 / att16,
              h2o_late.host_us / h2o_now.host_us, h2o_late.total_us,
              gen_late.total_us, h2o_late.host_us, h2o_now.host_us, compact_gbs, copy_gbs, att16, att4,
              (unsigned long long)st4.tokens_demoted, int(intact));
  kvgc_heap_destroy(fp16);
  kvgc_heap_destroy(int4);
  return intact ? 0 : 1;
}
