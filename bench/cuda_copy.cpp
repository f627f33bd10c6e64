// bench/cuda_copy: kvgc's data movement on the GPU against the device's own copy
// bandwidth, measured side by side in one run (CUDA events, medians).
//
//   prefill append: 32K tokens per sequence x batch 8 into pages (scatter) vs a
//                   cudaMemcpy of the same K/V bytes (device to device)
//   read (gather):  the same segments back to dense buffers vs the same memcpy
//   decode append:  one token per sequence per layer-call: launch-bound, in us/call
//
// Shape: Llama-3-8B's KV per layer (8 KV heads x head_dim 128, f16), one layer per
// sequence (layers are independent segments, so one is representative). Bytes are
// counted as read + written, the way the copy bandwidth is counted.
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

int main(int argc, char** argv) {
  int n_dev = 0;
  if (cudaGetDeviceCount(&n_dev) != cudaSuccess || n_dev == 0) {
    std::printf("SKIP: no CUDA device answered; bench/cuda_copy needs a GPU\n");
    return 77;
  }
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  const uint32_t kv_heads = 8, head_dim = 128, batch = 8;
  const uint32_t tokens = quick ? 4096 : 32768;
  const int reps = quick ? 3 : 15;
  const size_t token_bytes = size_t(kv_heads) * head_dim * 2;
  const size_t seq_bytes = size_t(tokens) * token_bytes;  // K (or V) of one sequence

  cudaDeviceProp prop{};
  CUDA_OK(cudaGetDeviceProperties(&prop, 0));
  cudaStream_t s;
  CUDA_OK(cudaStreamCreate(&s));

  // Source K/V for all sequences, random bits (never zeros: they can hide bugs and
  // run faster than real data).
  std::vector<uint16_t> host(seq_bytes / 2);
  std::mt19937 rng(1);
  for (auto& x : host) x = uint16_t(rng() & 0x7bff);  // finite f16 patterns
  std::vector<void*> k(batch), v(batch), ko(batch), vo(batch);
  for (uint32_t b = 0; b < batch; ++b) {
    for (void** p : {&k[b], &v[b], &ko[b], &vo[b]}) CUDA_OK(cudaMalloc(p, seq_bytes));
    CUDA_OK(cudaMemcpy(k[b], host.data(), seq_bytes, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(v[b], host.data(), seq_bytes, cudaMemcpyHostToDevice));
  }

  kvgc_model_desc m;
  kvgc_model_desc_init(&m);
  m.n_layers = 1;
  m.n_q_heads = 32;
  m.n_kv_heads = kv_heads;
  m.head_dim = head_dim;
  m.dtype = KVGC_DTYPE_F16;
  kvgc_heap_options o;
  kvgc_heap_options_init(&o);
  o.flags = KVGC_OPT_IGNORE_ENV;
  o.device = KVGC_DEVICE_CUDA;
  uint64_t need = 0;
  kvgc_kv_bytes(&m, tokens + 1024, KVGC_CLASS_FP16, o.page_tokens, &need);
  o.budget_bytes = need * batch + (64ull << 20);
  kvgc_heap* heap = nullptr;
  KVGC_OK(nullptr, kvgc_heap_create(&m, &o, &heap));

  // memcpy baseline: K and V of every sequence, device to device.
  const double copy_ms = median_ms(reps, s, [&] {
    for (uint32_t b = 0; b < batch; ++b) {
      CUDA_OK(cudaMemcpyAsync(ko[b], k[b], seq_bytes, cudaMemcpyDeviceToDevice, s));
      CUDA_OK(cudaMemcpyAsync(vo[b], v[b], seq_bytes, cudaMemcpyDeviceToDevice, s));
    }
  });
  // Prefill append: fresh sequences each repetition (destroyed outside the timing).
  std::vector<kvgc_seq> seqs(batch);
  std::vector<double> append_t;
  cudaEvent_t e0, e1;
  CUDA_OK(cudaEventCreate(&e0));
  CUDA_OK(cudaEventCreate(&e1));
  for (int r = 0; r <= reps; ++r) {
    for (auto& q : seqs) KVGC_OK(heap, kvgc_seq_create(heap, 0, &q));
    CUDA_OK(cudaEventRecord(e0, s));
    for (uint32_t b = 0; b < batch; ++b)
      KVGC_OK(heap, kvgc_append(heap, seqs[b], 0, k[b], v[b], tokens, s));
    CUDA_OK(cudaEventRecord(e1, s));
    CUDA_OK(cudaEventSynchronize(e1));
    float ms = 0;
    CUDA_OK(cudaEventElapsedTime(&ms, e0, e1));
    if (r) append_t.push_back(ms);  // r == 0 is the warm-up
    if (r < reps)
      for (auto q : seqs) KVGC_OK(heap, kvgc_seq_destroy(heap, q));
  }
  std::sort(append_t.begin(), append_t.end());
  const double append_ms = append_t[append_t.size() / 2];
  // Gather the segments back (poisoned first, then verified against the source).
  for (uint32_t b = 0; b < batch; ++b) CUDA_OK(cudaMemsetAsync(ko[b], 0xA5, seq_bytes, s));
  const double read_ms = median_ms(reps, s, [&] {
    for (uint32_t b = 0; b < batch; ++b) {
      uint64_t n = 0;
      KVGC_OK(heap, kvgc_read(heap, seqs[b], 0, ko[b], vo[b], nullptr, tokens, &n, s));
    }
  });
  CUDA_OK(cudaStreamSynchronize(s));
  std::vector<uint16_t> back(host.size());
  CUDA_OK(cudaMemcpy(back.data(), ko[batch - 1], seq_bytes, cudaMemcpyDeviceToHost));
  const bool intact = back == host;
  // Decode: one token per sequence per call (the engine's per-layer append).
  const int steps = quick ? 16 : 64;
  const double decode_ms = median_ms(3, s, [&] {
    for (int t = 0; t < steps; ++t)
      for (uint32_t b = 0; b < batch; ++b)
        KVGC_OK(heap, kvgc_append(heap, seqs[b], 0, k[b], v[b], 1, s));
  });
  const double decode_us = decode_ms * 1000.0 / (steps * batch);

  const double bytes = 2.0 * 2.0 * double(seq_bytes) * batch;  // K+V, read + written
  const double copy_gbs = bytes / (copy_ms * 1e6);
  const double append_gbs = bytes / (append_ms * 1e6);
  const double read_gbs = bytes / (read_ms * 1e6);
  std::printf("device: %s, %d SMs\n", prop.name, prop.multiProcessorCount);
  std::printf("shape: %u kv heads x %u dims f16, %u tokens x batch %u (%.2f GiB of K+V)\n",
              kv_heads, head_dim, tokens, batch, 2.0 * seq_bytes * batch / (1 << 30));
  std::printf("%-26s %10s %12s %10s\n", "op", "ms", "GB/s (r+w)", "vs memcpy");
  std::printf("%-26s %10.3f %12.1f %10.2f\n", "cudaMemcpy D2D", copy_ms, copy_gbs, 1.0);
  std::printf("%-26s %10.3f %12.1f %10.2f\n", "kvgc_append (prefill)", append_ms, append_gbs,
              append_gbs / copy_gbs);
  std::printf("%-26s %10.3f %12.1f %10.2f\n", "kvgc_read (gather)", read_ms, read_gbs,
              read_gbs / copy_gbs);
  std::printf("%-26s %10.2f us per call (1 token, launch-bound)\n", "kvgc_append (decode)",
              decode_us);
  std::printf("read-back of the last sequence: %s\n", intact ? "intact" : "CORRUPT");
  std::printf("RESULT append_vs_memcpy=%.3f read_vs_memcpy=%.3f memcpy_GBps=%.0f "
              "append_GBps=%.0f read_GBps=%.0f decode_append_us=%.2f intact=%d\n",
              append_gbs / copy_gbs, read_gbs / copy_gbs, copy_gbs, append_gbs, read_gbs,
              decode_us, int(intact));
  kvgc_heap_destroy(heap);
  return intact ? 0 : 1;
}
