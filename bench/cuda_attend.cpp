// bench/cuda_attend: kvgc_attend on the GPU against the device's copy bandwidth,
// measured side by side in one run (CUDA events, medians): decode (one query) over 32K
// live tokens per sequence x batch 8, Llama-3-8B's per-layer KV shape (8 KV heads, 32
// query heads, head_dim 128, f16), with and without the fused scores. Attention reads
// the K and V bytes once; the copy's bandwidth counts bytes read plus written.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "cuda_bench_util.hpp"
#include "kvgc.h"

using kvgc::bench::median_ms;
using kvgc::bench::one_layer;

int main(int argc, char** argv) {
  int n_dev = 0;
  if (cudaGetDeviceCount(&n_dev) != cudaSuccess || n_dev == 0) {
    std::printf("SKIP: no CUDA device answered; bench/cuda_attend needs a GPU\n");
    return 77;
  }
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  const uint32_t kv_heads = 8, q_heads = 32, hd = 128, batch = 8, tokens = quick ? 4096 : 32768;
  const int reps = quick ? 3 : 20;
  cudaStream_t s;
  CUDA_OK(cudaStreamCreate(&s));
  const kvgc_model_desc m = one_layer(q_heads, kv_heads, hd);
  kvgc_heap_options o;
  kvgc_heap_options_init(&o);
  o.flags = KVGC_OPT_IGNORE_ENV;
  o.device = KVGC_DEVICE_CUDA;
  uint64_t need = 0;
  kvgc_kv_bytes(&m, tokens + 64, KVGC_CLASS_FP16, o.page_tokens, &need);
  o.budget_bytes = need * batch * 11 / 10 + (256ull << 20);
  kvgc_heap* h = nullptr;
  KVGC_OK(nullptr, kvgc_heap_create(&m, &o, &h));

  const size_t seq_bytes = size_t(tokens) * kv_heads * hd * 2;
  std::vector<uint16_t> host(seq_bytes / 2);
  std::mt19937 rng(3);
  for (auto& x : host) x = uint16_t((rng() & 0x33ff) | ((rng() & 1) << 15));  // |x| < 1
  void *k, *v, *q, *out, *copy_dst;
  CUDA_OK(cudaMalloc(&k, seq_bytes));
  CUDA_OK(cudaMalloc(&v, seq_bytes));
  CUDA_OK(cudaMalloc(&q, q_heads * hd * 2));
  CUDA_OK(cudaMalloc(&out, q_heads * hd * 2));
  CUDA_OK(cudaMemcpy(k, host.data(), seq_bytes, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(v, host.data(), seq_bytes, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(q, host.data(), q_heads * hd * 2, cudaMemcpyHostToDevice));
  std::vector<kvgc_seq> seqs(batch);
  for (auto& sq : seqs) {
    KVGC_OK(h, kvgc_seq_create(h, 0, &sq));
    KVGC_OK(h, kvgc_append(h, sq, 0, k, v, tokens, s));
  }
  const size_t total = 2 * seq_bytes * batch;  // K + V of every sequence
  void* copy_src;
  CUDA_OK(cudaMalloc(&copy_src, total / 2));
  CUDA_OK(cudaMalloc(&copy_dst, total / 2));
  CUDA_OK(cudaMemset(copy_src, 1, total / 2));
  // Copy half the bytes: read + written = the bytes attention reads.
  const double copy_ms = median_ms(reps, s, [&] {
    CUDA_OK(cudaMemcpyAsync(copy_dst, copy_src, total / 2, cudaMemcpyDeviceToDevice, s));
  });
  kvgc_attend_params no_scores;
  kvgc_attend_params_init(&no_scores);
  no_scores.flags = KVGC_ATTEND_NO_SCORES;
  const double att_ms = median_ms(reps, s, [&] {
    for (auto sq : seqs) KVGC_OK(h, kvgc_attend(h, sq, 0, q, 1, out, nullptr, s));
  });
  const double plain_ms = median_ms(reps, s, [&] {
    for (auto sq : seqs) KVGC_OK(h, kvgc_attend(h, sq, 0, q, 1, out, &no_scores, s));
  });
  cudaDeviceProp prop{};
  CUDA_OK(cudaGetDeviceProperties(&prop, 0));
  const double copy_gbs = double(total) / (copy_ms * 1e6);
  const double att_gbs = double(total) / (att_ms * 1e6), plain_gbs = double(total) / (plain_ms * 1e6);
  std::printf("device: %s; decode attention, %u tokens x batch %u, %u KV heads x %u, GQA %u, f16 (%.2f GiB of K+V)\n",
              prop.name, tokens, batch, kv_heads, hd, q_heads / kv_heads, double(total) / (1 << 30));
  std::printf("%-28s %9s %12s %10s\n", "op", "ms", "GB/s", "vs copy");
  std::printf("%-28s %9.3f %12.1f %10.2f\n", "cudaMemcpy D2D (r+w)", copy_ms, copy_gbs, 1.0);
  std::printf("%-28s %9.3f %12.1f %10.2f\n", "kvgc_attend + scores", att_ms, att_gbs, att_gbs / copy_gbs);
  std::printf("%-28s %9.3f %12.1f %10.2f\n", "kvgc_attend, no scores", plain_ms, plain_gbs, plain_gbs / copy_gbs);
  std::printf("RESULT attend_vs_copy=%.3f attend_noscores_vs_copy=%.3f score_overhead=%.3f copy_GBps=%.0f attend_GBps=%.0f\n",
              att_gbs / copy_gbs, plain_gbs / copy_gbs, att_ms / plain_ms, copy_gbs, att_gbs);
  kvgc_heap_destroy(h);
  return 0;
}
