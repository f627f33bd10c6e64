// kvgc-bench-batch: the batch API against the per-sequence calls, side by side on one heap.
//
//   1. Decode attention at B sequences (default 64, contexts 256..2048 tokens, SmolLM2's
//      attention shape): one kvgc_batch_attend vs B kvgc_attend calls, same threads, same
//      pages, interleaved repetitions; ratio = per-sequence time / batched time.
//   2. Host time per sequence per step at B = 256 over 30 layers: kvgc_batch_plan, and one
//      kvgc_batch_append of a decode row per sequence per layer (the copy is one row: the
//      time is the host's), against B kvgc_append calls per layer; every layer appended
//      each step, so pages are taken as decode takes them (one per 16 tokens).
//   3. The same loop's means over 48 steps (three cycles of 16, after one untimed: the
//      first GC ranks the whole prompt), the steps that take pages included, under full
//      and under the default policy (generational, the ladder, no budget: a minor GC per
//      16 tokens, which changes each sequence so that its next plan walks its segments),
//      with kvgc_batch_step's GC timed apart.
//
// Usage: kvgc-bench-batch [--quick] [--threads N] [--batch B]
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "bench_util.hpp"
#include "kvgc.h"

using kvgc::bench::median_of;
using kvgc::bench::ratio;
using kvgc::bench::ResultLine;
using kvgc::bench::Timer;

namespace {

void check(kvgc_status st, const char* what) {
  if (st != KVGC_OK) {
    std::fprintf(stderr, "kvgc-bench-batch: %s: %s (%s)\n", what, kvgc_status_str(st), kvgc_errmsg(nullptr));
    std::exit(1);
  }
}

kvgc_model_desc smol(uint32_t layers) {
  kvgc_model_desc m;
  kvgc_model_desc_init(&m);
  m.n_layers = layers;
  m.n_q_heads = 9;
  m.n_kv_heads = 3;
  m.head_dim = 64;
  m.dtype = KVGC_DTYPE_F16;
  return m;
}

kvgc_heap* heap_for(const kvgc_model_desc& m, uint64_t bytes, uint32_t threads,
                    kvgc_policy policy = KVGC_POLICY_FULL) {
  kvgc_heap_options o;
  kvgc_heap_options_init(&o);
  o.flags = KVGC_OPT_IGNORE_ENV;
  o.device = KVGC_DEVICE_CPU;
  o.budget_bytes = bytes;
  o.policy = policy;
  o.cpu_threads = threads;
  kvgc_heap* h = nullptr;
  check(kvgc_heap_create(&m, &o, &h), "kvgc_heap_create");
  return h;
}

std::vector<uint16_t> f16_rows(std::mt19937& rng, size_t n) {
  std::vector<uint16_t> v(n);
  for (uint16_t& x : v) x = uint16_t(0x3000 + rng() % 0x0c00) ^ uint16_t(rng() & 0x8000);  // |x| in [0.125, 1)
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false;
  uint32_t threads = 2, B = 64;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--quick") quick = true;
    else if (a == "--threads" && i + 1 < argc) threads = uint32_t(std::atoi(argv[++i]));
    else if (a == "--batch" && i + 1 < argc) B = uint32_t(std::atoi(argv[++i]));
    else {
      std::fprintf(stderr, "kvgc-bench-batch: unknown argument '%s' (--quick, --threads N, --batch B)\n", a.c_str());
      return 1;
    }
  }
  if (threads < 1 || threads > 256 || B < 1 || B > 1024) {
    std::fprintf(stderr, "kvgc-bench-batch: --threads must be 1..256 and --batch 1..1024\n");
    return 1;
  }
  std::mt19937 rng(42);
  const int reps = quick ? 3 : 15;

  // 1. Decode attention, batched vs per sequence.
  const kvgc_model_desc m1 = smol(1);
  const size_t kv_row = size_t(m1.n_kv_heads) * m1.head_dim, q_row = size_t(m1.n_q_heads) * m1.head_dim;
  const uint32_t ctx_lo = quick ? 128 : 256, ctx_hi = quick ? 512 : 2048;
  kvgc_heap* h = heap_for(m1, 512ull << 20, threads);
  std::vector<kvgc_seq> seqs(B);
  std::vector<uint32_t> ones(B, 1);
  uint64_t total_ctx = 0;
  for (kvgc_seq& s : seqs) {
    check(kvgc_seq_create(h, 0, &s), "kvgc_seq_create");
    const uint32_t n = ctx_lo + rng() % (ctx_hi - ctx_lo + 1);
    const std::vector<uint16_t> k = f16_rows(rng, n * kv_row), v = f16_rows(rng, n * kv_row);
    check(kvgc_append(h, s, 0, k.data(), v.data(), n, nullptr), "kvgc_append");
    total_ctx += n + 1;
  }
  kvgc_batch* b = nullptr;
  check(kvgc_batch_create(h, &b), "kvgc_batch_create");
  uint32_t failed = 0;
  check(kvgc_batch_plan(b, seqs.data(), ones.data(), B, &failed, nullptr), "kvgc_batch_plan");
  const std::vector<uint16_t> k1 = f16_rows(rng, B * kv_row), v1 = f16_rows(rng, B * kv_row);
  check(kvgc_batch_append(b, 0, k1.data(), v1.data(), nullptr), "kvgc_batch_append");
  const std::vector<uint16_t> q = f16_rows(rng, B * q_row);
  std::vector<uint16_t> out(B * q_row);
  std::vector<double> t_batch, t_single;
  for (int r = 0; r < reps; ++r) {  // interleaved
    Timer t;
    check(kvgc_batch_attend(b, 0, q.data(), out.data(), nullptr, nullptr), "kvgc_batch_attend");
    t_batch.push_back(t.elapsed_ns());
    t.restart();
    for (uint32_t i = 0; i < B; ++i)
      check(kvgc_attend(h, seqs[i], 0, q.data() + i * q_row, 1, out.data() + i * q_row, nullptr, nullptr), "kvgc_attend");
    t_single.push_back(t.elapsed_ns());
  }
  size_t ti = 0;
  const auto mb = median_of(reps, [&] { return t_batch[ti++]; });
  ti = 0;
  const auto ms = median_of(reps, [&] { return t_single[ti++]; });
  const double kv_bytes = double(total_ctx) * kv_row * 2 * 2;
  std::printf("decode attention, B=%u, contexts %u..%u (%.0f KiB of K/V), %u thread(s):\n", B, ctx_lo, ctx_hi,
              kv_bytes / 1024, threads);
  std::printf("  batched       %9.1f us  (%.2f GB/s of K/V)\n", mb.median / 1e3, kv_bytes / mb.median);
  std::printf("  per sequence  %9.1f us  (%.2f GB/s)\n", ms.median / 1e3, kv_bytes / ms.median);
  kvgc_batch_destroy(b);
  kvgc_heap_destroy(h);

  // 2. Host time per sequence per step at B = 256 over 30 layers.
  const uint32_t HB = quick ? 64 : 256, L = 30, ctx = quick ? 64 : 256;
  const kvgc_model_desc m2 = smol(L);
  kvgc_heap* h2 = heap_for(m2, (quick ? 512ull : 4096ull) << 20, 1);
  // Two groups of sequences, one per API: a per-sequence append changes a sequence's
  // pages outside the batch, which makes the batch rebuild its attention list.
  std::vector<kvgc_seq> s2(HB), s3(HB);
  std::vector<uint32_t> ones2(HB, 1);
  const std::vector<uint16_t> kc = f16_rows(rng, ctx * kv_row);
  for (kvgc_seq& s : s3) {
    check(kvgc_seq_create(h2, 0, &s), "kvgc_seq_create");
    for (uint32_t l = 0; l < L; ++l) check(kvgc_append(h2, s, l, kc.data(), kc.data(), ctx, nullptr), "kvgc_append");
  }
  for (kvgc_seq& s : s2) {
    check(kvgc_seq_create(h2, 0, &s), "kvgc_seq_create");
    for (uint32_t l = 0; l < L; ++l) check(kvgc_append(h2, s, l, kc.data(), kc.data(), ctx, nullptr), "kvgc_append");
  }
  kvgc_batch* b2 = nullptr;
  check(kvgc_batch_create(h2, &b2), "kvgc_batch_create");
  const std::vector<uint16_t> k2 = f16_rows(rng, HB * kv_row);
  std::vector<double> t_plan, t_bappend, t_sappend;
  for (int r = 0; r < reps; ++r) {
    Timer t;
    check(kvgc_batch_plan(b2, s2.data(), ones2.data(), HB, &failed, nullptr), "kvgc_batch_plan");
    t_plan.push_back(t.elapsed_ns());
    t.restart();
    for (uint32_t l = 0; l < L; ++l) check(kvgc_batch_append(b2, l, k2.data(), k2.data(), nullptr), "kvgc_batch_append");
    t_bappend.push_back(t.elapsed_ns() / L);
    check(kvgc_batch_step(b2, nullptr), "kvgc_batch_step");  // spends the plan (full: no GC)
    t.restart();  // the same decode row per sequence and layer, one call each
    for (uint32_t l = 0; l < L; ++l)
      for (uint32_t i = 0; i < HB; ++i) check(kvgc_append(h2, s3[i], l, k2.data() + i * kv_row, k2.data() + i * kv_row, 1, nullptr), "kvgc_append");
    t_sappend.push_back(t.elapsed_ns() / L);
  }
  ti = 0;
  const auto mp = median_of(reps, [&] { return t_plan[ti++]; });
  ti = 0;
  const auto mba = median_of(reps, [&] { return t_bappend[ti++]; });
  ti = 0;
  const auto msa = median_of(reps, [&] { return t_sappend[ti++]; });
  const double plan_us = mp.median / 1e3 / HB, bapp_us = mba.median / 1e3 / HB, sapp_us = msa.median / 1e3 / HB;
  std::printf("host time, B=%u, %u layers, %u-token contexts (%u pages per sequence):\n", HB, L, ctx, L * ((ctx + 15) / 16));
  std::printf("  kvgc_batch_plan            %7.3f us per sequence per step\n", plan_us);
  std::printf("  kvgc_batch_append, a layer %6.3f us per sequence  vs kvgc_append %6.3f us\n", bapp_us, sapp_us);
  kvgc_batch_destroy(b2);
  kvgc_heap_destroy(h2);

  // 3. Means over whole cycles of 16 steps (a page taken and, under generational, a GC
  // run by every segment at one step of each), full against generational.
  const uint32_t steps = quick ? 16 : 48;
  auto loop_means = [&](kvgc_policy policy, double* plan_us, double* step_us) {
    kvgc_heap* h3 = heap_for(m2, (quick ? 512ull : 4096ull) << 20, 1, policy);
    std::vector<kvgc_seq> s4(HB);
    for (kvgc_seq& s : s4) {
      check(kvgc_seq_create(h3, 0, &s), "kvgc_seq_create");
      for (uint32_t l = 0; l < L; ++l) check(kvgc_append(h3, s, l, kc.data(), kc.data(), ctx, nullptr), "kvgc_append");
    }
    kvgc_batch* b3 = nullptr;
    check(kvgc_batch_create(h3, &b3), "kvgc_batch_create");
    double plan_ns = 0, step_ns = 0;
    for (uint32_t r = 0; r < 16 + steps; ++r) {  // the first cycle untimed: its GC ranks the whole prompt
      if (r == 16) plan_ns = step_ns = 0;
      Timer t;
      check(kvgc_batch_plan(b3, s4.data(), ones2.data(), HB, &failed, nullptr), "kvgc_batch_plan");
      plan_ns += t.elapsed_ns();
      for (uint32_t l = 0; l < L; ++l) check(kvgc_batch_append(b3, l, k2.data(), k2.data(), nullptr), "kvgc_batch_append");
      t.restart();
      check(kvgc_batch_step(b3, nullptr), "kvgc_batch_step");
      step_ns += t.elapsed_ns();
    }
    *plan_us = plan_ns / 1e3 / steps / HB;
    *step_us = step_ns / 1e3 / steps / HB;
    kvgc_batch_destroy(b3);
    kvgc_heap_destroy(h3);
  };
  double plan_full_mean = 0, step_full_mean = 0, plan_gen_us = 0, step_gen_us = 0;
  loop_means(KVGC_POLICY_FULL, &plan_full_mean, &step_full_mean);
  loop_means(KVGC_POLICY_GENERATIONAL, &plan_gen_us, &step_gen_us);
  std::printf("  means over %u steps, pages taken included: kvgc_batch_plan %6.3f us (full), %6.3f us"
              " (generational); kvgc_batch_step (the GC) %7.3f us\n",
              steps, plan_full_mean, plan_gen_us, step_gen_us);

  ResultLine res;
  res.add("attend_batched_speedup", ratio(ms.median, mb.median));
  res.add("plan_us_per_seq", plan_us, 3);
  res.add("batch_append_us_per_seq", bapp_us, 3);
  res.add("single_append_us_per_seq", sapp_us, 3);
  res.add("plan_mean_us_per_seq", plan_full_mean, 3);
  res.add("plan_generational_us_per_seq", plan_gen_us, 3);
  res.add("step_generational_us_per_seq", step_gen_us, 3);
  res.add("batch", B, 0);
  res.add("threads", threads, 0);
  res.print();
  return 0;
}
