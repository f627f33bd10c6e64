// Between the kernel files: the AVX2 kernels the AVX-512 tables reuse (the f32 dot,
// dequantisation, f16 conversion and activation quantisation, which AVX-512 would not make materially faster).
#pragma once

#include <cstddef>
#include <cstdint>

namespace engine::avx2 {

void f32(const float* w, size_t w_stride, uint32_t rows, const float* x, size_t x_stride,
         uint32_t n, uint32_t cols, float* out, size_t stride);
void dequant_q4_1(const uint8_t* w, uint32_t blocks, float* out);
void dequant_q8_0(const uint8_t* w, uint32_t blocks, float* out);
void halves_to_floats(const uint16_t* in, size_t n, float* out);
void floats_to_halves(const float* in, size_t n, uint16_t* out);
void quantize(const float* x, size_t blocks, int8_t* q, float* d, float* s);

}  // namespace engine::avx2
