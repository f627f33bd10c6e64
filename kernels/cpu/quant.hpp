// int4 quantisation of one head row (head_dim values), asymmetric per group of 32 (or
// the whole row): q = round((x - zero) / scale) in 0..15, x' = q * scale + zero, with
// scale and zero stored as a 16-bit pair (qparam_dtype). zero is rounded down and scale
// up when stored, so every x of the group stays inside [zero, zero + 15 * scale] and the
// error is at most scale / 2 plus the 16-bit rounding of the pair.
#pragma once

#include <cstdint>

#include "../page_layout.hpp"

namespace kvgc::cpu {

// src: head_dim values in `dtype`; nibbles: head_dim / 2 bytes (low nibble first);
// qparams: head_dim / group pairs of 16-bit {scale, zero}.
void quantize_row(const uint8_t* src, kvgc_dtype dtype, uint32_t head_dim, uint8_t* nibbles,
                  uint16_t* qparams);
void dequantize_row(const uint8_t* nibbles, const uint16_t* qparams, kvgc_dtype dtype,
                    uint32_t head_dim, uint8_t* dst);

}  // namespace kvgc::cpu
