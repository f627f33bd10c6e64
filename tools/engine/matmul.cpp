#include "engine/matmul.hpp"

#include <algorithm>
#include <cstring>

namespace engine {
namespace {

bool is_block_type(uint32_t type) { return type == kGgmlQ4_1 || type == kGgmlQ8_0; }

}  // namespace

void dequantize_row(const Matrix& w, uint32_t r, float* out) {
  const Kernels& k = kernels();
  const uint8_t* row = w.row(r);
  switch (w.type) {
    case kGgmlF32: std::memcpy(out, row, size_t(w.cols) * 4); break;
    case kGgmlF16: {
      // The mapping need not be 2-byte aligned for a crafted file: copy out first.
      uint16_t halves[256];
      for (uint32_t i = 0; i < w.cols; i += 256) {
        const uint32_t n = std::min<uint32_t>(256, w.cols - i);
        std::memcpy(halves, row + 2 * size_t(i), 2 * size_t(n));
        k.f16_to_f32(halves, n, out + i);
      }
      break;
    }
    case kGgmlQ4_1: k.dequant_q4_1(row, w.cols / kQuantBlock, out); break;
    case kGgmlQ8_0: k.dequant_q8_0(row, w.cols / kQuantBlock, out); break;
    default: std::fill(out, out + w.cols, 0.0f); break;  // the loader admits no other type
  }
}

std::vector<float> dequantize_matrix(const Matrix& w) {
  std::vector<float> out(size_t(w.rows) * w.cols);
  for (uint32_t r = 0; r < w.rows; ++r) dequantize_row(w, r, out.data() + size_t(r) * w.cols);
  return out;
}

const QuantRows& Activations::quantized() {
  if (!quantized_) {
    quantize_rows(x_, n_, cols_, &q_);
    quantized_ = true;
  }
  return q_;
}

void Matmul::run_rows(const MatmulTask& task, uint32_t first, uint32_t count, Activations& x,
                      std::vector<float>* row_scratch) const {
  const Kernels& k = kernels();
  const Matrix& w = *task.w;
  float* out = task.out + first;
  const size_t stride = w.rows;
  if (is_block_type(w.type) && mode_ == MatmulMode::Quantized) {
    const QuantRows& q = x.quantized();  // made before the parallel region
    (w.type == kGgmlQ4_1 ? k.q4_1 : k.q8_0)(w.row(first), w.row_bytes, count, q, out, stride);
    return;
  }
  if (w.type == kGgmlF32 && (reinterpret_cast<uintptr_t>(w.data) % 4 == 0)) {
    k.f32(reinterpret_cast<const float*>(w.row(first)), w.row_bytes / 4, count, x.data(),
          x.cols(), x.n(), w.cols, out, stride);
    return;
  }
  // Any other row: to f32 first, then the f32 product with every token.
  row_scratch->resize(w.cols);
  for (uint32_t r = 0; r < count; ++r) {
    dequantize_row(w, first + r, row_scratch->data());
    k.f32(row_scratch->data(), w.cols, 1, x.data(), x.cols(), x.n(), w.cols, out + r, stride);
  }
}

void Matmul::run(std::initializer_list<MatmulTask> tasks, Activations& x) {
  bool needs_quantized = false;
  uint32_t total_rows = 0;
  for (const MatmulTask& t : tasks) {
    needs_quantized |= is_block_type(t.w->type) && mode_ == MatmulMode::Quantized;
    total_rows += t.w->rows;
  }
  if (needs_quantized) x.quantized();  // once, on this thread, before the workers read it
  const uint32_t threads = pool_->size();
  scratch_.resize(threads);
  // Chunks small enough to balance threads slowed by other load, large enough that the
  // shared counter is touched rarely: about 8 per thread, in whole 4-row tiles.
  uint32_t chunk = std::max<uint32_t>(4, total_rows / (8 * threads));
  chunk = (chunk + 3) / 4 * 4;
  std::vector<uint32_t> first_chunk;  // of each task, in the global chunk numbering
  first_chunk.reserve(tasks.size() + 1);
  uint32_t n_chunks = 0;
  for (const MatmulTask& t : tasks) {
    first_chunk.push_back(n_chunks);
    n_chunks += (t.w->rows + chunk - 1) / chunk;
  }
  first_chunk.push_back(n_chunks);
  auto job = [&](uint32_t c, uint32_t thread) {
    size_t t = 0;
    while (first_chunk[t + 1] <= c) ++t;
    const MatmulTask& task = tasks.begin()[t];
    const uint32_t first = (c - first_chunk[t]) * chunk;
    run_rows(task, first, std::min(chunk, task.w->rows - first), x, &scratch_[thread]);
  };
  pool_->run(n_chunks, job);
}

}  // namespace engine
