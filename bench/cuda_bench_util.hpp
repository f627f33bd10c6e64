// Shared by the GPU benchmarks: checked CUDA and kvgc calls, and a median of CUDA-event
// timings (METHOD: time with device events, warm up first, take the median).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "kvgc.h"

#define CUDA_OK(call)                                                                      \
  do {                                                                                     \
    cudaError_t e_ = (call);                                                               \
    if (e_ != cudaSuccess) {                                                               \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
      std::exit(1);                                                                        \
    }                                                                                      \
  } while (0)
#define KVGC_OK(heap, call)                                                                \
  do {                                                                                     \
    kvgc_status s_ = (call);                                                               \
    if (s_ != KVGC_OK) {                                                                   \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, kvgc_status_str(s_),     \
                   kvgc_errmsg(heap));                                                     \
      std::exit(1);                                                                        \
    }                                                                                      \
  } while (0)

namespace kvgc::bench {

// Median over `reps` runs of f() on stream s, in ms, after one warm-up run; setup() is
// enqueued before each run (warm-up included) outside the timed range.
template <class F, class Setup>
double median_ms(int reps, cudaStream_t s, F&& f, Setup&& setup) {
  cudaEvent_t a, b;
  CUDA_OK(cudaEventCreate(&a));
  CUDA_OK(cudaEventCreate(&b));
  setup();
  f();
  CUDA_OK(cudaStreamSynchronize(s));
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    setup();
    CUDA_OK(cudaEventRecord(a, s));
    f();
    CUDA_OK(cudaEventRecord(b, s));
    CUDA_OK(cudaEventSynchronize(b));
    float ms = 0;
    CUDA_OK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms);
  }
  std::sort(t.begin(), t.end());
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return t[t.size() / 2];
}
template <class F>
double median_ms(int reps, cudaStream_t s, F&& f) {
  return median_ms(reps, s, f, [] {});
}

// One f16 layer of a model with these heads: what the GPU benchmarks run on.
inline kvgc_model_desc one_layer(uint32_t q_heads, uint32_t kv_heads, uint32_t head_dim) {
  kvgc_model_desc m;
  kvgc_model_desc_init(&m);
  m.n_layers = 1;
  m.n_q_heads = q_heads;
  m.n_kv_heads = kv_heads;
  m.head_dim = head_dim;
  m.dtype = KVGC_DTYPE_F16;
  return m;
}

}  // namespace kvgc::bench
