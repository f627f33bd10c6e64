// The GGUF block formats the engine multiplies in place, and its dot-product kernels.
//
// Weights stay in their file type. Q4_1 block (20 bytes, 32 elements): f16 d, f16 m,
// then 16 bytes whose low nibbles are elements 0..15 and high nibbles 16..31; element
// j = d * q_j + m. Q8_0 block (34 bytes): f16 d, then 32 int8; element j = d * q_j.
//
// Activations meet them quantised per block of 32 (QuantRows): d_x = max|x| / 127,
// q_x = round-to-nearest-even(x / d_x), and s_x = d_x * sum(q_x). A block's dot product
// is then one integer sum: Q8_0: d * d_x * sum(q q_x); Q4_1: d * d_x * sum(q q_x) + m * s_x
// (the offset m meets the sum of the quantised activations, so the result is exactly the
// dot product of the dequantised weights with the quantised activations). That is how
// the formats are meant to be used (llama.cpp does the same with its q8_1/q8_0 blocks);
// the activation's rounding is the only error this adds to an f32 product.
//
// `portable` is the specification; AVX2 and AVX-512 (with or without VNNI) compute the
// same integer sums and differ only in the order of the float sums over blocks. The best
// level the CPU has is chosen once at start-up (tests may lower it).
//
// Why these kernels are written here: Debian 12 has no ggml or llama.cpp package; its
// oneDNN (2.6, libdnnl-dev) does int8 matmuls with per-output-channel scales only (no
// 4-bit weights, no scale per group of 32), so Q4_1 would have to be requantised
// (another model) or dequantised (540 MB of f32); OpenBLAS and BLIS are float only. On
// PyPI, llama-cpp-python, ggml-python and ctransformers carry ggml as a private shared
// library inside a wheel, without headers, whose block dot products are internal symbols
// and whose public API is a compute graph with its own threads.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace engine {

// ggml tensor types the engine reads.
constexpr uint32_t kGgmlF32 = 0;
constexpr uint32_t kGgmlF16 = 1;
constexpr uint32_t kGgmlQ4_1 = 3;
constexpr uint32_t kGgmlQ8_0 = 8;
constexpr uint32_t kQuantBlock = 32;  // elements per Q4_1 / Q8_0 block
constexpr size_t kQ4_1BlockBytes = 4 + kQuantBlock / 2;
constexpr size_t kQ8_0BlockBytes = 2 + kQuantBlock;
inline constexpr const char* kSupportedTypes = "F32, F16, Q4_1, Q8_0";

// IEEE half <-> float. f32_to_f16 rounds to nearest even, overflows to infinity, keeps
// NaN a (quiet) NaN, and rounds into subnormals as F16C's vcvtps2ph does.
float f16_to_f32(uint16_t half);
uint16_t f32_to_f16(float value);

// Bytes of `n_elements` elements of `ggml_type`, or 0 for a type the engine cannot read
// (or a block type whose count is not a whole number of blocks).
uint64_t tensor_bytes(uint32_t ggml_type, uint64_t n_elements);
// Whether rows of `cols` elements of this type are whole blocks (always for F32/F16).
bool row_fits_blocks(uint32_t ggml_type, uint64_t cols);

// Dequantises `n_elements` elements of `ggml_type` at `data` into `out`. False (with
// *err) for a type the engine does not support or a partial block.
bool dequantize(uint32_t ggml_type, const uint8_t* data, uint64_t n_elements, float* out,
                std::string* err);

// n rows of activations quantised per block of 32 (see above): row t's block b is
// q[(t * blocks + b) * 32 ...], d[t * blocks + b], s[t * blocks + b].
struct QuantRows {
  uint32_t n = 0, blocks = 0;  // rows; blocks a row
  std::vector<int8_t> q;
  std::vector<float> d, s;
};
// Quantises x[n][cols] (cols a multiple of 32) with the fastest kernels (every level
// gives the same bytes). A block holding a NaN or an infinity gets q = 0 and d = s = NaN,
// so the products it enters are NaN (never undefined casts).
void quantize_rows(const float* x, uint32_t n, uint32_t cols, QuantRows* out);

// One instruction set's kernels. Weight matrices are rows of `blocks` blocks,
// `row_bytes` apart; activations are rows 0..x.n-1 of a QuantRows (or f32 rows of
// `cols` floats, `x_stride` apart). Every kernel writes out[t * out_stride + r] for each
// token t and weight row r < rows.
struct Kernels {
  const char* name;
  void (*q4_1)(const uint8_t* w, size_t row_bytes, uint32_t rows, const QuantRows& x,
               float* out, size_t out_stride);
  void (*q8_0)(const uint8_t* w, size_t row_bytes, uint32_t rows, const QuantRows& x,
               float* out, size_t out_stride);
  // f32 weights (rows `w_stride` floats apart) against f32 activations.
  void (*f32)(const float* w, size_t w_stride, uint32_t rows, const float* x, size_t x_stride,
              uint32_t n, uint32_t cols, float* out, size_t out_stride);
  // One row's blocks to f32 (the exact path dequantises a row, then uses f32).
  void (*dequant_q4_1)(const uint8_t* w, uint32_t blocks, float* out);
  void (*dequant_q8_0)(const uint8_t* w, uint32_t blocks, float* out);
  void (*f16_to_f32)(const uint16_t* in, size_t n, float* out);
  void (*f32_to_f16)(const float* in, size_t n, uint16_t* out);
  // `blocks` blocks of 32 floats into q, d, s as quantize_rows defines them; bit for bit
  // the portable result at every level.
  void (*quantize)(const float* x, size_t blocks, int8_t* q, float* d, float* s);
};

// 0 portable, 1 AVX2+FMA+F16C, 2 AVX-512 (F, BW, DQ, VL), 3 AVX-512 with VNNI.
int best_kernel_level();
// The kernels of `level` (at most best_kernel_level(): a lower one is a test's choice).
const Kernels& kernels_at(int level);
// The kernels in use: those of best_kernel_level() unless set_kernel_level lowered it.
const Kernels& kernels();
// For tests and benchmarks: use `level` (clamped to what the CPU has) from now on.
void set_kernel_level(int level);

namespace portable {
extern const Kernels kKernels;
}
namespace avx2 {
bool available();
extern const Kernels kKernels;
}
namespace avx512 {
bool available();
bool vnni_available();
extern const Kernels kKernels;      // F, BW, DQ, VL
extern const Kernels kKernelsVnni;  // + VNNI (vpdpbusd)
}

}  // namespace engine
