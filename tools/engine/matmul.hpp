// Matrix products of the engine: weights in their file type (quant.hpp) times a chunk of
// activation rows, over the engine's thread pool. Several matrices that read the same
// input (Q, K and V; gate and up) go in one parallel region, and the input is quantised
// once for all of them.
#pragma once

#include <atomic>
#include <cstdint>
#include <initializer_list>
#include <vector>

#include "engine/quant.hpp"
#include "engine/thread_pool.hpp"

namespace engine {

// A weight matrix as the file stores it: `rows` rows of `cols` elements of `type`,
// row-major (GGUF dims (cols, rows)), `row_bytes` apart: out = W x. The bytes stay in
// the file's mapping.
struct Matrix {
  uint32_t type = kGgmlF32;
  uint32_t rows = 0, cols = 0;
  uint64_t row_bytes = 0;
  const uint8_t* data = nullptr;
  const uint8_t* row(uint32_t r) const { return data + r * row_bytes; }
};

// Row `r` of `w` as f32 (an embedding lookup).
void dequantize_row(const Matrix& w, uint32_t r, float* out);
// The whole matrix as f32, [rows][cols] (for tests and references).
std::vector<float> dequantize_matrix(const Matrix& w);

// How Q4_1 and Q8_0 weights meet the activations.
enum class MatmulMode : uint8_t {
  // Activations quantised per block of 32 to 8 bits, integer dot products (quant.hpp);
  // what llama.cpp does, and the default.
  Quantized,
  // Each weight row dequantised to f32 and multiplied by the f32 activations: no
  // rounding of the activations (the f32 reference, several times slower). Activation
  // rounding is chaotic over 30 layers: a 1e-6 difference that moves one activation
  // across a rounding boundary changes the rest of the run by a quantisation step, so
  // Quantized's prefill-chunk and decode logits differ by draws of that noise (and
  // near-ties flip) where Exact's agree to about 3e-6 (tests/test_model.cpp).
  Exact,
};

// The input of one or more matmuls: n rows of `cols` f32 activations, quantised on first
// need and then reused until the next set().
class Activations {
 public:
  void set(const float* x, uint32_t n, uint32_t cols) {
    x_ = x, n_ = n, cols_ = cols, quantized_ = false;
  }
  const float* data() const { return x_; }
  uint32_t n() const { return n_; }
  uint32_t cols() const { return cols_; }
  const QuantRows& quantized();

 private:
  const float* x_ = nullptr;
  uint32_t n_ = 0, cols_ = 0;
  bool quantized_ = false;
  QuantRows q_;
};

// out [x.n()][w.rows], row-major.
struct MatmulTask {
  const Matrix* w;
  float* out;
};

class Matmul {
 public:
  Matmul(ThreadPool* pool, MatmulMode mode) : pool_(pool), mode_(mode) {}

  // Every task's product with `x` (each w.cols == x.cols()), split into row chunks over
  // the pool's threads.
  void run(std::initializer_list<MatmulTask> tasks, Activations& x);

  MatmulMode mode() const { return mode_; }

 private:
  void run_rows(const MatmulTask& task, uint32_t first, uint32_t count, Activations& x,
                std::vector<float>* row_scratch) const;

  ThreadPool* pool_;
  MatmulMode mode_;
  std::vector<std::vector<float>> scratch_;  // a dequantised row per thread (exact path)
};

}  // namespace engine
