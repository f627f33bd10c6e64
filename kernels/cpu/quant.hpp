// Quantisation of one head row (head_dim values) for the INT8, INT4 and INT2 classes.
//
// int8: symmetric, one 16-bit scale (qparam_dtype) per row: q = round(x / scale) in
// -127..127, x' = q * scale (exact in f32), with scale = max|x| / 127 rounded up when
// stored, so every finite x stays in range and the error is at most scale / 2.
//
// int4 and int2 quantisation of one head row (head_dim values), asymmetric per group of
// 32 (or the whole row): with top = 2^bits - 1 (15 or 3), q = round((x - zero) / scale)
// in 0..top, x' = q * scale + zero, with scale and zero stored as a 16-bit pair
// (qparam_dtype). zero is rounded down and scale up when stored, so every x of the group
// stays inside [zero, zero + top * scale] and the error is at most scale / 2 plus the
// 16-bit rounding of the pair.
//
// Groups run along one token's head row, never across tokens: pages are per token, so
// KIVI's per-channel keys (a scale per channel over a block of tokens) would tie a
// token's bytes to its neighbours' and break eviction and demotion one token at a time;
// groups of 32 bound how far one outlier channel widens a step. Relative RMS error
// measured on Gaussian rows: int8 0.0059-0.0064 mean, 0.0105 worst; int4 0.078 mean,
// 0.115 worst; int2 0.39 (gc/ladder.hpp's exchange rates).
#pragma once

#include <cstdint>

#include "../page_layout.hpp"

namespace kvgc::cpu {

// src: head_dim values in `dtype`; codes: head_dim * bits / 8 bytes (rounded up; the
// lowest bits first); qparams: head_dim / group pairs of 16-bit {scale, zero}.
void quantize_row(const uint8_t* src, kvgc_dtype dtype, uint32_t head_dim, uint8_t* codes,
                  uint16_t* qparams, uint32_t bits = 4);
void dequantize_row(const uint8_t* codes, const uint16_t* qparams, kvgc_dtype dtype,
                    uint32_t head_dim, uint8_t* dst, uint32_t bits = 4);

// src: head_dim values in `dtype`; q: head_dim signed bytes; scale: one 16-bit word.
void quantize_row_int8(const uint8_t* src, kvgc_dtype dtype, uint32_t head_dim, int8_t* q,
                       uint16_t* scale);
void dequantize_row_int8(const int8_t* q, const uint16_t* scale, kvgc_dtype dtype,
                         uint32_t head_dim, uint8_t* dst);
// x' = q * scale as f32 (before rounding to the model dtype): what attention reads.
float int8_scale_f32(uint16_t scale, kvgc_dtype dtype);

// One head row of a slot, K (v = false) or V, as the model dtype into dst (head_dim
// values): FP16 copied, INT8 and INT4 dequantised (what kvgc_read returns). `page` is
// where the K/V and quantisation words are (for a SegPage: payload_of, not its header);
// only bytes from L.k_off on are read.
void load_row(const PageLayout& L, const uint8_t* page, uint32_t head, uint32_t slot, bool v,
              uint8_t* dst);
// Stores a row given in the model dtype into (head, slot) of a page of class L.cls.
void store_row(const PageLayout& L, uint8_t* page, uint32_t head, uint32_t slot, bool v,
               const uint8_t* src);

}  // namespace kvgc::cpu
