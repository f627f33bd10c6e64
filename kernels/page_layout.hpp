// Byte layout of one page, for every storage class. Shared by every executor (CPU and
// CUDA) and by the runtime, which only needs `bytes`. The allocator never sees it: it
// deals in page sizes alone.
//
// A page holds `page_tokens` slots of one segment for all KV heads of its layer:
//
//   live   uint32[ceil(pt/32)]   live bitmask: bit s = slot s holds a live token
//   pos    int32[pt]             token position in the sequence
//   score  float[pt]             accumulated attention mass (H2O signal)
//   recent float[pt]             recent attention mass: decayed per scoring query
//   gen    uint8[pt]             generation (SlotGen)
//   K      FP16 class: elem[kv_heads][pt][head_dim]    (head-major: one head's keys for
//   V                  the page are contiguous, which is what attention streams)
//          INT8 class: int8[kv_heads][pt][head_dim]
//          INT4 class: uint8[kv_heads][pt][head_dim/2] (two nibbles a byte, low first)
//          INT2 class: uint8[kv_heads][pt][head_dim/4] (four 2-bit codes a byte, low first)
//   Kq,Vq  INT8:       16-bit scale[kv_heads][pt]      (symmetric: x = q * scale)
//          INT4, INT2: 16-bit {scale, zero}[kv_heads][pt][head_dim/group]
//
// Every array starts on a 16-byte boundary, K and V on 128 (one cache line / one
// coalesced warp transaction); the page size is a multiple of 256 so that page starts
// stay aligned wherever a slab places them.
//
// One page holds every KV head of its layer, so a token's class and its eviction are
// decided once for all its heads: per-head choices were measured first and read worse on
// the reference model (docs/QUALITY.md, per-head allocation), so there are no per-head
// pages. The FP16 class stores the model dtype ("full precision"): f16 and bf16, and f32
// for f32 models, whose attention accuracy tests need f32 storage. Known cost: the
// metadata before K (256 bytes at 16 tokens a page) makes a 64 KiB payload page 65,792
// bytes, so 2 MiB slabs hold 31 such pages (3% tail waste); a per-slab side region would
// remove it (kvgc_stats.cls[].free_bytes shows it).
#pragma once

#include <cstddef>
#include <cstdint>

#include "kvgc.h"

#if defined(__CUDACC__)
#define KVGC_HD __host__ __device__
#else
#define KVGC_HD
#endif

namespace kvgc {

enum SlotGen : uint8_t { kGenSink = 0, kGenYoung = 1, kGenIntermediate = 2, kGenLongTerm = 3 };

// The gen byte: bits 0-1 the generation, bits 2-5 the slot's age (minor GCs survived in
// the intermediate tier, saturating at 15; promotion asks for 2), which is what "stable"
// means for promotion, and bits 6-7 the class a slot of a shared page is charged at
// (0.8, KVGC_PREFIX_CHARGE=prune): 0 its page's class, else the kvgc_storage_class the
// holder's ladder demoted it to while it stays readable at its page's precision (a
// demotion that would need a private copy of a shared token is only charged).
KVGC_HD constexpr uint8_t gen_of(uint8_t b) { return b & 3u; }
KVGC_HD constexpr uint8_t age_of(uint8_t b) { return (b >> 2) & 15u; }
KVGC_HD constexpr uint8_t charged_of(uint8_t b) { return b >> 6; }
// A gen byte of generation `gen` and age `age` that keeps b's charged class.
KVGC_HD constexpr uint8_t make_gen(uint8_t gen, uint8_t age, uint8_t b = 0) {
  return uint8_t((b & 0xc0u) | (age > 15 ? 15 : age) << 2 | (gen & 3u));
}
KVGC_HD constexpr uint8_t with_charged(uint8_t b, uint32_t cls) {
  return uint8_t((b & 0x3fu) | (cls & 3u) << 6);
}
// The class a live slot counts at: its charged class when it has one, else its page's.
KVGC_HD constexpr uint32_t counted_class(uint8_t b, uint32_t page_cls) {
  return charged_of(b) ? charged_of(b) : page_cls;
}
KVGC_HD constexpr uint8_t gen_bit(uint8_t gen) { return uint8_t(1u << gen); }

constexpr uint32_t kMaxPageTokens = 256;
constexpr uint32_t kMaxHeadDim = 1024;
constexpr size_t kPageAlign = 256;

inline constexpr size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

inline constexpr uint32_t dtype_bytes(kvgc_dtype d) { return d == KVGC_DTYPE_F32 ? 4u : 2u; }

// The 16-bit type of int4 scale/zero pairs: f16 for f16 models; bf16 otherwise, since
// bf16 and f32 values can exceed f16's range.
inline constexpr kvgc_dtype qparam_dtype(kvgc_dtype model) {
  return model == KVGC_DTYPE_F16 ? KVGC_DTYPE_F16 : KVGC_DTYPE_BF16;
}

// int4 and int2 quantisation groups: 32 elements when head_dim allows, else the whole head.
inline constexpr uint32_t int4_group(uint32_t head_dim) {
  return head_dim % 32 == 0 ? 32u : head_dim;
}

// Bits per element of the grouped (asymmetric) classes: INT4 4, INT2 2; else 0.
KVGC_HD constexpr uint32_t group_bits(uint32_t cls) {
  return cls == KVGC_CLASS_INT4 ? 4u : cls == KVGC_CLASS_INT2 ? 2u : 0u;
}

inline constexpr const char* class_name(uint32_t cls) {
  return cls == KVGC_CLASS_FP16   ? "fp16"
         : cls == KVGC_CLASS_INT8 ? "int8"
         : cls == KVGC_CLASS_INT4 ? "int4"
         : cls == KVGC_CLASS_INT2 ? "int2"
                                  : "?";
}

// The ladder's rank of a class: 0 is the dearest (FP16), then INT8, INT4, INT2.
KVGC_HD constexpr int class_rank(uint32_t cls) {
  return cls == KVGC_CLASS_FP16 ? 0 : cls == KVGC_CLASS_INT8 ? 1 : cls == KVGC_CLASS_INT4 ? 2 : 3;
}

struct PageLayout {
  uint32_t page_tokens = 0, n_kv_heads = 0, head_dim = 0;
  kvgc_dtype dtype = KVGC_DTYPE_F16;
  kvgc_storage_class cls = KVGC_CLASS_FP16;
  uint32_t group = 0;  // elements per scale (INT4, INT2: 32 or head_dim; INT8 and FP16: head_dim)
  size_t live_off = 0, pos_off = 0, score_off = 0, recent_off = 0, gen_off = 0;
  size_t k_off = 0, v_off = 0;    // payload
  size_t kq_off = 0, vq_off = 0;  // quantisation parameters (0 for FP16)
  size_t head_stride = 0;         // bytes between consecutive heads in K (and V)
  size_t slot_stride = 0;         // bytes between consecutive slots of one head
  uint32_t qwords = 0;            // 16-bit quantisation words per (head, slot): INT8 1,
                                  // INT4 and INT2 2 per group, FP16 0
  size_t bytes = 0;               // whole page, a multiple of kPageAlign

  KVGC_HD static constexpr uint32_t live_words(uint32_t pt) { return (pt + 31) / 32; }

  // The quantisation words of (head, slot): at page + kq_off (K) or vq_off (V), plus this.
  KVGC_HD size_t qparam_index(uint32_t head, uint32_t slot) const {
    return (size_t(head) * page_tokens + slot) * qwords;
  }

  static PageLayout make(uint32_t page_tokens, uint32_t n_kv_heads, uint32_t head_dim,
                         kvgc_dtype dtype, kvgc_storage_class cls) {
    PageLayout L;
    L.page_tokens = page_tokens;
    L.n_kv_heads = n_kv_heads;
    L.head_dim = head_dim;
    L.dtype = dtype;
    L.cls = cls;
    L.group = group_bits(cls) ? int4_group(head_dim) : head_dim;
    L.qwords = group_bits(cls) ? 2 * (head_dim / L.group) : cls == KVGC_CLASS_INT8 ? 1 : 0;
    const size_t pt = page_tokens;
    size_t off = 0;
    L.live_off = off;
    off = align_up(off + 4 * size_t(live_words(page_tokens)), 16);
    L.pos_off = off;
    off = align_up(off + 4 * pt, 16);
    L.score_off = off;
    off = align_up(off + 4 * pt, 16);
    L.recent_off = off;
    off = align_up(off + 4 * pt, 16);
    L.gen_off = off;
    off = align_up(off + pt, 128);
    L.slot_stride = cls == KVGC_CLASS_FP16   ? size_t(head_dim) * dtype_bytes(dtype)
                    : cls == KVGC_CLASS_INT8 ? size_t(head_dim)
                                             : (head_dim * group_bits(cls) + 7) / 8;
    L.head_stride = L.slot_stride * pt;
    const size_t payload = L.head_stride * n_kv_heads;
    L.k_off = off;
    off = align_up(off + payload, 128);
    L.v_off = off;
    off = align_up(off + payload, 16);
    if (L.qwords) {
      const size_t qparams = size_t(n_kv_heads) * pt * L.qwords * 2;
      L.kq_off = off;
      off = align_up(off + qparams, 16);
      L.vq_off = off;
      off = align_up(off + qparams, 16);
    }
    L.bytes = align_up(off, kPageAlign);
    return L;
  }
};

}  // namespace kvgc
