// bench/cuda_batch: the CUDA executor's batched decode attention (one AttendOp over B
// sequences: a constant number of launches) against the device's copy bandwidth and
// against one call per sequence, measured side by side in one run (CUDA events,
// medians). B = 64 sequences x 4K tokens, Llama-3-8B's per-layer KV shape (8 KV heads,
// 32 query heads, head_dim 128, f16), with and without the fused scores. Pages are
// filled by the batched append (device-side runs: one launch). Attention reads the K
// and V bytes once; the copy's bandwidth counts bytes read plus written.
// Executor level (kernels/cuda): the batch's page and sequence tables are uploaded
// once, as the batch plan does (AttendOp::dev_pages, dev_seqs). Then the GC of a batch
// step: every sequence's select in one select_batch against one select per segment.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "../kernels/cpu/convert.hpp"
#include "../kernels/cuda/attend.cuh"
#include "../kernels/cuda/copy.cuh"
#include "../kernels/cuda/gc.cuh"
#include "../kernels/page_layout.hpp"
#include "cuda_bench_util.hpp"

using kvgc::bench::median_ms;

int main(int argc, char** argv) {
  int n_dev = 0;
  if (cudaGetDeviceCount(&n_dev) != cudaSuccess || n_dev == 0) {
    std::printf("SKIP: no CUDA device answered; bench/cuda_batch needs a GPU\n");
    return 77;
  }
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  const uint32_t kv_heads = quick ? 2 : 8, q_heads = 4 * kv_heads, hd = 128, pt = 16;
  const uint32_t B = quick ? 4 : 64, tokens = quick ? 64 : 4096;
  const int reps = quick ? 2 : 20;
  cudaDeviceProp prop{};
  CUDA_OK(cudaGetDeviceProperties(&prop, 0));
  cudaStream_t s;
  CUDA_OK(cudaStreamCreate(&s));

  kvgc::PageLayout L[KVGC_CLASS_COUNT];
  for (int c = 0; c < KVGC_CLASS_COUNT; ++c)
    L[c] = kvgc::PageLayout::make(pt, kv_heads, hd, KVGC_DTYPE_F16, kvgc_storage_class(c));
  const uint32_t pages_per_seq = tokens / pt, n_pages = B * pages_per_seq;
  uint8_t* arena = nullptr;
  CUDA_OK(cudaMalloc(&arena, size_t(n_pages) * L[0].bytes));

  // One sequence's K/V (|x| < 1), appended to every sequence: one batched append.
  const size_t seq_bytes = size_t(tokens) * kv_heads * hd * 2;
  std::vector<uint16_t> host(seq_bytes / 2);
  std::mt19937 rng(3);
  for (auto& x : host) x = uint16_t((rng() & 0x33ff) | ((rng() & 1) << 15));
  void *k, *v;
  CUDA_OK(cudaMalloc(&k, seq_bytes));
  CUDA_OK(cudaMalloc(&v, seq_bytes));
  CUDA_OK(cudaMemcpy(k, host.data(), seq_bytes, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(v, host.data(), seq_bytes, cudaMemcpyHostToDevice));
  std::vector<kvgc::AppendRun> runs;
  std::vector<kvgc::SegPage> pages;
  std::vector<kvgc::AttendSeq> seqs;
  for (uint32_t i = 0; i < B; ++i) {
    seqs.push_back({i * pages_per_seq, pages_per_seq, tokens, i, 1, int64_t(tokens) - 1, 1.0f});
    for (uint32_t p = 0; p < pages_per_seq; ++p) {
      uint8_t* page = arena + size_t(i * pages_per_seq + p) * L[0].bytes;
      runs.push_back({page, 0, pt, p * pt, 0});
      pages.push_back({page, KVGC_CLASS_FP16, uint64_t(p) * pt});
    }
  }
  kvgc::AppendRun* d_runs;
  kvgc::SegPage* d_pages;
  kvgc::AttendSeq* d_seqs;
  CUDA_OK(cudaMalloc(&d_runs, runs.size() * sizeof(runs[0])));
  CUDA_OK(cudaMalloc(&d_pages, pages.size() * sizeof(pages[0])));
  CUDA_OK(cudaMalloc(&d_seqs, seqs.size() * sizeof(seqs[0])));
  CUDA_OK(cudaMemcpy(d_runs, runs.data(), runs.size() * sizeof(runs[0]), cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(d_pages, pages.data(), pages.size() * sizeof(pages[0]), cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(d_seqs, seqs.data(), seqs.size() * sizeof(seqs[0]), cudaMemcpyHostToDevice));
  kvgc::AppendOp ap{L[0], k, v, 0, 4, runs.data(), uint32_t(runs.size()), d_runs};
  CUDA_OK(kvgc::cuda::append(ap, s));
  CUDA_OK(cudaStreamSynchronize(s));

  // Queries: one row per sequence.
  const size_t q_bytes = size_t(B) * q_heads * hd * 2;
  void *q, *out;
  CUDA_OK(cudaMalloc(&q, q_bytes));
  CUDA_OK(cudaMalloc(&out, q_bytes));
  CUDA_OK(cudaMemcpy(q, host.data(), std::min(q_bytes, seq_bytes), cudaMemcpyHostToDevice));
  const size_t scratch_bytes = kvgc::cuda::attend_scratch_bytes(uint64_t(n_pages) * pt, q_heads, hd, pt);
  void* scratch;
  CUDA_OK(cudaMalloc(&scratch, scratch_bytes));
  // The page list per-sequence calls ship: pinned, as the heap's staging ring is.
  kvgc::SegPage* pinned_pages = nullptr;
  CUDA_OK(cudaMallocHost(&pinned_pages, pages.size() * sizeof(pages[0])));
  std::copy(pages.begin(), pages.end(), pinned_pages);
  kvgc::AttendOp op{};
  for (int c = 0; c < KVGC_CLASS_COUNT; ++c) op.layout[c] = L[c];
  op.pages = pinned_pages;
  op.n_pages = n_pages;
  op.q = q;
  op.q_heads = q_heads;
  op.scale = 0.088f;
  op.out = out;
  op.seqs = seqs.data();
  op.n_seqs = B;
  op.dev_pages = d_pages;
  op.dev_seqs = d_seqs;
  auto batched = [&](bool scores) {
    kvgc::AttendOp o = op;
    o.add_scores = scores;
    CUDA_OK(kvgc::cuda::attend(o, scratch, scratch_bytes, prop.multiProcessorCount, s));
  };
  auto per_seq = [&](bool scores) {  // what B kvgc_attend calls enqueue
    for (uint32_t i = 0; i < B; ++i) {
      kvgc::AttendOp o = kvgc::attend_seq_op(op, i);
      o.add_scores = scores;
      CUDA_OK(kvgc::cuda::attend(o, scratch, scratch_bytes, prop.multiProcessorCount, s));
    }
  };
  // Integrity: the batched output equals the per-sequence one within f16 rounding (the
  // split partitions differ, so the summation order does).
  std::vector<uint16_t> a(q_bytes / 2), b(q_bytes / 2);
  batched(false);
  CUDA_OK(cudaMemcpyAsync(a.data(), out, q_bytes, cudaMemcpyDeviceToHost, s));
  CUDA_OK(cudaStreamSynchronize(s));
  per_seq(false);
  CUDA_OK(cudaMemcpyAsync(b.data(), out, q_bytes, cudaMemcpyDeviceToHost, s));
  CUDA_OK(cudaStreamSynchronize(s));
  double se = 0, sr = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double x = kvgc::cpu::load(reinterpret_cast<const uint8_t*>(&a[i]), KVGC_DTYPE_F16),
                 y = kvgc::cpu::load(reinterpret_cast<const uint8_t*>(&b[i]), KVGC_DTYPE_F16);
    se += (x - y) * (x - y);
    sr += y * y;
  }
  if (!(sr > 0) || std::sqrt(se / sr) > 2e-3) {
    std::printf("FAIL: batched and per-sequence outputs differ (relative RMS %.3g)\n", sr > 0 ? std::sqrt(se / sr) : -1.0);
    return 1;
  }

  const size_t total = 2 * size_t(n_pages) * pt * kv_heads * hd * 2;  // K + V read
  void *copy_src, *copy_dst;
  CUDA_OK(cudaMalloc(&copy_src, total / 2));
  CUDA_OK(cudaMalloc(&copy_dst, total / 2));
  CUDA_OK(cudaMemset(copy_src, 1, total / 2));
  // Interleaved: each measurement's median over reps, the four side by side.
  const double copy_ms = median_ms(reps, s, [&] {
    CUDA_OK(cudaMemcpyAsync(copy_dst, copy_src, total / 2, cudaMemcpyDeviceToDevice, s));
  });
  const double batch_ms = median_ms(reps, s, [&] { batched(true); });
  const double batch_plain_ms = median_ms(reps, s, [&] { batched(false); });
  const double seq_ms = median_ms(reps, s, [&] { per_seq(true); });
  const double seq_plain_ms = median_ms(reps, s, [&] { per_seq(false); });
  // The GC of a batch step (issue 22): every sequence's select at once (select_batch: a
  // constant number of launches) against one select per segment, as kvgc_step issued
  // them before. Each op is a generational minor shape: the young tokens past the
  // window tenured, the intermediate tier ranked (by score), the top 16 eligible
  // promoted; results into pinned memory the kernels write (results_mapped), as the
  // heap's result blocks are.
  const size_t gc_scratch = kvgc::cuda::gc_scratch_bytes(uint64_t(n_pages) * pt, pt);
  void* gscratch;
  CUDA_OK(cudaMalloc(&gscratch, gc_scratch));
  uint16_t* g_live = nullptr;
  kvgc::SelectResult* g_res = nullptr;
  CUDA_OK(cudaMallocHost(&g_live, size_t(n_pages) * sizeof(uint16_t)));
  CUDA_OK(cudaMallocHost(&g_res, B * sizeof(kvgc::SelectResult)));
  std::vector<kvgc::SelectOp> gops(B);
  for (uint32_t i = 0; i < B; ++i) {
    kvgc::SelectOp& g = gops[i];
    for (int c = 0; c < KVGC_CLASS_COUNT; ++c) g.layout[c] = L[c], g.unit_cost[c] = L[c].bytes;
    g.pages = pinned_pages + size_t(i) * pages_per_seq;
    g.n_pages = pages_per_seq;
    g.tenure_before = int64_t(tokens) / 2;
    g.candidates = uint8_t(kvgc::gen_bit(kvgc::kGenIntermediate));
    g.key = kvgc::KeyKind::Score;
    g.segment_salt = i;
    g.n_ladder = 1;
    g.ladder[0] = KVGC_CLASS_FP16;
    g.slope[0] = 1.0;
    g.promote = 16;
    g.promote_age = 0;
    g.page_live = g_live + size_t(i) * pages_per_seq;
    g.result = g_res + i;
    g.scratch = gscratch;
    g.scratch_bytes = gc_scratch;
    g.results_mapped = true;
  }
  kvgc::cuda::SelectStaging stage(true);
  auto gc_batched = [&] {
    uint32_t launched = 0;
    CUDA_OK(kvgc::cuda::select_batch(gops.data(), B, stage, s, &launched));
  };
  auto gc_per_seg = [&] {
    for (uint32_t i = 0; i < B; ++i) {
      uint32_t launched = 0;
      CUDA_OK(kvgc::cuda::select_batch(&gops[i], 1, stage, s, &launched));
    }
  };
  gc_batched();
  CUDA_OK(cudaStreamSynchronize(s));
  for (uint32_t i = 0; i < B; ++i)
    if (g_res[i].promoted != 16 || g_res[i].live[KVGC_CLASS_FP16] != tokens) {
      std::printf("FAIL: batched select of sequence %u promoted %llu (16 expected), %llu live\n", i,
                  (unsigned long long)g_res[i].promoted, (unsigned long long)g_res[i].live[KVGC_CLASS_FP16]);
      return 1;
    }
  const double gc_batch_ms = median_ms(reps, s, gc_batched);
  const double gc_seg_ms = median_ms(reps, s, gc_per_seg);
  std::printf("GC select over %u segments x %u tokens: batched %.3f ms, per segment %.3f ms (%.2fx)\n", B,
              tokens, gc_batch_ms, gc_seg_ms, gc_seg_ms / gc_batch_ms);
  cudaFree(gscratch);
  cudaFreeHost(g_live);
  cudaFreeHost(g_res);
  auto gbs = [&](double ms) { return double(total) / (ms * 1e6); };
  std::printf("device: %s; batched decode attention, B=%u x %u tokens, %u KV heads x %u, GQA %u, f16 (%.2f GiB of K+V)\n",
              prop.name, B, tokens, kv_heads, hd, q_heads / kv_heads, double(total) / (1 << 30));
  std::printf("%-34s %9s %10s %10s\n", "op", "ms", "GB/s", "vs copy");
  std::printf("%-34s %9.3f %10.1f %10.2f\n", "cudaMemcpy D2D (r+w)", copy_ms, gbs(copy_ms), 1.0);
  std::printf("%-34s %9.3f %10.1f %10.2f\n", "batched attend + scores", batch_ms, gbs(batch_ms), gbs(batch_ms) / gbs(copy_ms));
  std::printf("%-34s %9.3f %10.1f %10.2f\n", "batched attend, no scores", batch_plain_ms, gbs(batch_plain_ms), gbs(batch_plain_ms) / gbs(copy_ms));
  std::printf("%-34s %9.3f %10.1f %10.2f\n", "per-sequence attend + scores", seq_ms, gbs(seq_ms), gbs(seq_ms) / gbs(copy_ms));
  std::printf("%-34s %9.3f %10.1f %10.2f\n", "per-sequence attend, no scores", seq_plain_ms, gbs(seq_plain_ms), gbs(seq_plain_ms) / gbs(copy_ms));
  std::printf("RESULT batch_vs_copy=%.3f batch_noscores_vs_copy=%.3f batch_speedup_vs_per_seq=%.3f "
              "batch_noscores_speedup_vs_per_seq=%.3f copy_GBps=%.0f batch_GBps=%.0f B=%u tokens=%u "
              "gc_batch_ms=%.3f gc_per_seg_ms=%.3f gc_batch_speedup=%.3f\n",
              gbs(batch_ms) / gbs(copy_ms), gbs(batch_plain_ms) / gbs(copy_ms), seq_ms / batch_ms,
              seq_plain_ms / batch_plain_ms, gbs(copy_ms), gbs(batch_ms), B, tokens, gc_batch_ms, gc_seg_ms,
              gc_seg_ms / gc_batch_ms);
  cudaFreeHost(pinned_pages);
  return 0;
}
