// CUDA paged attention with fused scores (kernels/cpu/attend.cpp is the specification).
//
// One op is a batch of sequences (AttendOp::seqs; a single segment is the batch of
// one). The host turns it into a work list of items, (sequence, query, split of its
// pages), balanced FlashDecoding-style: a page budget per split is chosen so that the
// batch's blocks fill whole waves of the GPU (make_plan); long sequences get several
// splits, short ones one. A pass is three launches on the engine's stream whatever the batch
// size, no sync:
//   1. partial: a block per (item, KV head x chunk of <= 8 query heads); each warp takes
//      every 4th page of the item, a tile of S <= 32 slots at a time, streamed through
//      shared memory two tiles deep (cp.async: the next tile is in flight while this one
//      is computed). Per tile, 32 / S lanes share a slot and dot its K row (16-byte
//      chunks) with the group's queries (in shared memory), then lanes own dims for the
//      values (p broadcast from shared memory), with an online softmax in fp32. With
//      scores, logits go to scratch for pass 3. An item that is its query's only split
//      writes the output (and its (m, l)) itself; the others write their (m, l, acc)
//      partial to scratch.
//   2. combine: per (split query, query head), merges its partials into out (model
//      dtype) and keeps the final (m, l). Not launched when no query is split.
//   3. mass: a block per page of the pass's sequences; per slot, sums exp(logit - m) / l
//      over the sequence's queries and query heads and adds it to the slot's score.
// The work list (and the sequence table, unless AttendOp::dev_seqs has it on the device
// already) travel in one host-to-device copy into the scratch; the page list likewise
// unless AttendOp::dev_pages. A pass holds as many (sequence, query) units as the
// scratch fits: a decode batch always fits one (attend_scratch_bytes reserves for it);
// long prefill chunks go in several passes, split by queries.
// Head dims are dispatched at compile time by dims per lane (2, 4, 8: head_dim <= 64,
// <= 128, <= 256); larger head dims are not supported on CUDA.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "../../allocator/host_memory.hpp"
#include "../score.hpp"
#include "attend.cuh"

namespace kvgc::cuda {
namespace {

constexpr int kWarps = 4, kThreads = kWarps * 32, kGMax = 8;
// Blocks of pass 1 an SM runs at once (a wave), as make_plan counts them: at head_dim 128
// and a GQA group of 4, 80 registers and 36.5 KiB of shared memory make 6 on sm_90.
constexpr uint32_t kBlocksPerSm = 6;
constexpr uint32_t kMaxParts = 256;  // split partials a pass may hold (attend_scratch_bytes)
constexpr uint32_t kNoPart = 0xffffffffu;
// Entries a pass carries as a kernel parameter: a small block for one segment and small
// batches, a large one (20 KiB; parameters up to 32 KiB need CUDA 12.1 and sm_70) for
// the rest. A batch of more sequences than that goes in several passes.
constexpr uint32_t kSmallEntries = 4, kEntries = 256;

// Queries [qa, qb) of one sequence in a pass, each split `splits` ways over `pps` pages
// a split. Pass 1's items, pass 2's merges and pass 3's blocks of the entry start at
// item0, merge0 and block0 (running counts over the pass's entries); its units (one per
// query: the (m, l) rows) at unit0, its split partials at part0, its logits at log_off0.
struct Entry {
  uint32_t first_page, n_pages, q_row, qa, qb, splits, pps;
  uint32_t item0, merge0, unit0, block0, part0;
  uint64_t n_live, log_off0;
  int64_t q_pos0;
  float recent_decay;
  uint32_t flags;  // kScored, kDecays
};
// An entry's queries add mass (all of its queries or none: an entry never straddles the
// sequence's score_from); it is the one that decays the sequence's recent scores (its
// first scoring query, or a sequence without queries).
constexpr uint32_t kScored = 1u, kDecays = 2u;

struct Common {
  PageLayout L[KVGC_CLASS_COUNT];
  const SegPage* pages;  // the op's page list, on the device
  const uint8_t* q;      // model dtype [rows][q_heads][hd]
  uint8_t* out;
  uint32_t q_heads, kv_heads, group, hd;
  float scale;
  float* logits;   // null without scores
  float* part;     // [slot][q_heads][hd + 2]
  float* ml;       // [unit][q_heads][2]; null without scores
  float* mass_out; // AttendOp::mass_out: [page][page_tokens], or null (into the scores)
  uint32_t n_entries;
};

template <uint32_t N>
struct Params {
  Common c;
  Entry e[N];
};

// The entry whose range [field, next field) holds x: the last one with field <= x
// (entries with an empty range share their successor's start and are skipped).
template <uint32_t N>
__device__ __forceinline__ const Entry& entry_of(const Params<N>& p, uint32_t x, uint32_t Entry::*field) {
  uint32_t lo = 0, hi = p.c.n_entries;
  while (hi - lo > 1) {
    const uint32_t mid = (lo + hi) / 2;
    if (p.e[mid].*field <= x) lo = mid;
    else hi = mid;
  }
  return p.e[lo];
}

// A 16-bit element (f16 or bf16: D; f32 is not 16-bit) from its bits.
template <kvgc_dtype D>
__device__ __forceinline__ float from_bits(uint32_t b) {
  if constexpr (D == KVGC_DTYPE_F16) return __half2float(__ushort_as_half(uint16_t(b)));
  else return __uint_as_float((b & 0xffffu) << 16);
}
template <kvgc_dtype D>
__device__ __forceinline__ float ld(const uint8_t* p, uint32_t i) {
  if constexpr (D == KVGC_DTYPE_F32) return reinterpret_cast<const float*>(p)[i];
  else return from_bits<D>(reinterpret_cast<const uint16_t*>(p)[i]);
}
template <kvgc_dtype D>
__device__ __forceinline__ void st(uint8_t* p, uint32_t i, float x) {
  if constexpr (D == KVGC_DTYPE_F16) reinterpret_cast<__half*>(p)[i] = __float2half_rn(x);
  else if constexpr (D == KVGC_DTYPE_BF16) reinterpret_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(x);
  else reinterpret_cast<float*>(p)[i] = x;
}
// int4 scale/zero pairs are f16 for f16 models, bf16 otherwise (qparam_dtype).
template <kvgc_dtype D>
__device__ __forceinline__ float ldq(const uint16_t* p, uint32_t i) {
  return from_bits<D == KVGC_DTYPE_F16 ? KVGC_DTYPE_F16 : KVGC_DTYPE_BF16>(p[i]);
}

// Element d of one head's K (v = false) or V row of `slot`, as f32 (int8 and int4
// dequantised in f32, without the model dtype's rounding: within attention's tolerance).
// `page`: where the K/V are (payload_of).
template <kvgc_dtype D>
__device__ __forceinline__ float elem(const uint8_t* page, const PageLayout& L, uint32_t cls,
                                      uint32_t h, uint32_t slot, bool v, uint32_t d) {
  const uint8_t* row = page + (v ? L.v_off : L.k_off) + h * L.head_stride + slot * L.slot_stride;
  if (cls == KVGC_CLASS_FP16) return ld<D>(row, d);
  const uint16_t* qp = reinterpret_cast<const uint16_t*>(page + (v ? L.vq_off : L.kq_off)) +
                       L.qparam_index(h, slot);
  if (cls == KVGC_CLASS_INT8) return float(reinterpret_cast<const int8_t*>(row)[d]) * ldq<D>(qp, 0);
  const uint32_t g = d / L.group, bits = group_bits(cls), per_byte = 8 / bits;
  const uint32_t n = (row[d / per_byte] >> (bits * (d % per_byte))) & ((1u << bits) - 1);
  return float(n) * ldq<D>(qp, 2 * g) + ldq<D>(qp, 2 * g + 1);
}

__device__ __forceinline__ float warp_max(float x) {
  for (int o = 16; o; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
__device__ __forceinline__ float warp_sum(float x) {
  for (int o = 16; o; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// ---- pass 1's staging and row readers --------------------------------------------
// A warp streams its pages' K and V rows of head h through shared memory, a tile of S
// slots at a time, two stages deep: cp.async brings tile t + 1 while tile t is computed,
// so a warp keeps a whole tile in flight without holding it in registers (a kernel that
// loads into registers runs out of them before it has enough bytes in flight).
// Rows must be 16-byte aligned for that (slot_stride % 16 == 0: every row of the page
// is); pages of other rows (odd head dims) are read from global memory element by
// element (elem()). K rows are stored swizzled (chunk c of row r at c ^ (r mod P)) so
// that lanes reading different rows' chunk c hit different banks; V rows are read a row
// at a time by the whole warp and stay as they are.
constexpr uint32_t kStageBytes = 2048;  // a tile's K rows (and again its V rows) at most

__device__ __forceinline__ void copy16_async(void* smem, const void* gmem) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const uint32_t a = uint32_t(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(a), "l"(gmem) : "memory");
#else
  *reinterpret_cast<uint4*>(smem) = *reinterpret_cast<const uint4*>(gmem);
#endif
}
__device__ __forceinline__ void async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}
// Waits until at most N of this thread's most recent copy groups are still in flight.
template <int N>
__device__ __forceinline__ void async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
#endif
}

// Slots a tile of a page of layout L takes: its tokens rounded up to a power of two, at
// most 32 (a lane's slot) and at most what a stage holds.
__device__ __forceinline__ uint32_t tile_slots(const PageLayout& L) {
  uint32_t S = 32;
  while (S > 1 && (S / 2 >= L.page_tokens || S * L.slot_stride > kStageBytes)) S /= 2;
  return S;
}
// The swizzle span of rows of `chunks` 16-byte chunks: a power of two, at most 8.
__device__ __forceinline__ uint32_t swizzle_span(uint32_t chunks) {
  return chunks >= 8 ? 8u : chunks >= 4 ? 4u : chunks >= 2 ? 2u : 1u;
}
__device__ __forceinline__ uint32_t swizzled(uint32_t c, uint32_t r, uint32_t span) {
  return c < span ? c ^ (r & (span - 1)) : c;
}

// q . K over this lane's chunks part, part + R, ... of a staged K row (row r of its tile,
// swizzled), added to s[g] for the GP query heads of qs (scaled, zero past hd).
// qp: the row's quantisation words (int classes), in global memory.
template <kvgc_dtype D, int GP, int HD_MAX>
__device__ __forceinline__ void dot_staged(const uint8_t* row, uint32_t r, uint32_t chunks, uint32_t span,
                                           uint32_t cls, const uint16_t* qp, uint32_t part, uint32_t R,
                                           const float (*qs)[HD_MAX], float s[GP]) {
  // Elements d .. d + 3 (d a multiple of 4): one 16-byte read of each query's q.
  auto fma4 = [&](uint32_t d, float x0, float x1, float x2, float x3) {
#pragma unroll
    for (int g = 0; g < GP; ++g) {
      const float4 q = *reinterpret_cast<const float4*>(&qs[g][d]);
      s[g] = fmaf(q.x, x0, fmaf(q.y, x1, fmaf(q.z, x2, fmaf(q.w, x3, s[g]))));
    }
  };
  const float int8_scale = cls == KVGC_CLASS_INT8 ? ldq<D>(qp, 0) : 0.f;
  for (uint32_t c = part; c < chunks; c += R) {
    const uint4 w = reinterpret_cast<const uint4*>(row)[swizzled(c, r, span)];
    const uint32_t words[4] = {w.x, w.y, w.z, w.w};
    if (cls == KVGC_CLASS_FP16) {
      if constexpr (D == KVGC_DTYPE_F32) {
        fma4(4 * c, __uint_as_float(w.x), __uint_as_float(w.y), __uint_as_float(w.z), __uint_as_float(w.w));
      } else {
#pragma unroll
        for (int k = 0; k < 2; ++k)
          fma4(8 * c + 4 * k, from_bits<D>(words[2 * k]), from_bits<D>(words[2 * k] >> 16),
               from_bits<D>(words[2 * k + 1]), from_bits<D>(words[2 * k + 1] >> 16));
      }
    } else if (cls == KVGC_CLASS_INT8) {
      auto x = [&](int k) { return float(int8_t(words[k / 4] >> (8 * (k % 4)))) * int8_scale; };
#pragma unroll
      for (int k = 0; k < 16; k += 4) fma4(16 * c + k, x(k), x(k + 1), x(k + 2), x(k + 3));
    } else if (cls == KVGC_CLASS_INT4) {  // aligned rows: head_dim % 32 == 0, a chunk is a group
      const float sc = ldq<D>(qp, 2 * c), z = ldq<D>(qp, 2 * c + 1);
      auto x = [&](int k) { return float((words[k / 8] >> (4 * (k % 8))) & 15u) * sc + z; };
#pragma unroll
      for (int k = 0; k < 32; k += 4) fma4(32 * c + k, x(k), x(k + 1), x(k + 2), x(k + 3));
    } else {  // INT2: a chunk is two groups of 32
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const float sc = ldq<D>(qp, 2 * (2 * c + half)), z = ldq<D>(qp, 2 * (2 * c + half) + 1);
        auto x = [&](int k) {
          const uint32_t e = 32 * half + k;
          return float((words[e / 16] >> (2 * (e % 16))) & 3u) * sc + z;
        };
#pragma unroll
        for (int k = 0; k < 32; k += 4) fma4(64 * c + 32 * half + k, x(k), x(k + 1), x(k + 2), x(k + 3));
      }
    }
  }
}

// The same from global memory, element by element (rows not 16-byte aligned).
template <kvgc_dtype D, int GP, int HD_MAX>
__device__ __forceinline__ void dot_global(const uint8_t* kv, const PageLayout& L, uint32_t cls, uint32_t h,
                                           uint32_t slot, uint32_t part, uint32_t R,
                                           const float (*qs)[HD_MAX], float s[GP]) {
  for (uint32_t d = part; d < L.head_dim; d += R) {
    const float x = elem<D>(kv, L, cls, h, slot, false, d);
#pragma unroll
    for (int g = 0; g < GP; ++g) s[g] = fmaf(qs[g][d], x, s[g]);
  }
}

// V[row][d0 .. d0 + DPL) as f32 (elements past hd read 0), from a staged V row (one
// vector load for fp16-class rows, and for int8/int4 rows whose lane dims are whole), or
// (row == null: rows not 16-byte aligned) from global memory through elem().
template <kvgc_dtype D, int DPL>
__device__ __forceinline__ void load_v(const uint8_t* row, const uint8_t* kv, const PageLayout& L, uint32_t cls,
                                       uint32_t h, uint32_t slot, uint32_t d0, float v[DPL]) {
  const uint32_t hd = L.head_dim;
  const bool whole = row && d0 + DPL <= hd;
  if (whole && cls == KVGC_CLASS_FP16) {
    constexpr int kElt = D == KVGC_DTYPE_F32 ? 4 : 2, kBytes = DPL * kElt;
    constexpr int kWords = kBytes / 4;
    uint32_t words[kWords];
    const uint8_t* src = row + d0 * kElt;
    if constexpr (kBytes % 16 == 0) {
#pragma unroll
      for (int i = 0; i < kBytes / 16; ++i) {
        const uint4 w = reinterpret_cast<const uint4*>(src)[i];
        words[4 * i] = w.x, words[4 * i + 1] = w.y, words[4 * i + 2] = w.z, words[4 * i + 3] = w.w;
      }
    } else if constexpr (kBytes == 8) {
      const uint2 w = *reinterpret_cast<const uint2*>(src);
      words[0] = w.x, words[1] = w.y;
    } else {
      words[0] = *reinterpret_cast<const uint32_t*>(src);
    }
#pragma unroll
    for (int k = 0; k < DPL; ++k) {
      if constexpr (D == KVGC_DTYPE_F32) v[k] = __uint_as_float(words[k]);
      else v[k] = from_bits<D>(words[k / 2] >> (16 * (k % 2)));
    }
    return;
  }
  const uint16_t* qp =
      cls == KVGC_CLASS_FP16 ? nullptr
                             : reinterpret_cast<const uint16_t*>(kv + L.vq_off) + L.qparam_index(h, slot);
  if (whole && cls == KVGC_CLASS_INT8 && DPL >= 4) {  // DPL bytes, DPL-aligned
    const float sc = ldq<D>(qp, 0);
#pragma unroll
    for (int i = 0; i < DPL / 4; ++i) {
      const uint32_t w = reinterpret_cast<const uint32_t*>(row + d0)[i];
#pragma unroll
      for (int k = 0; k < 4; ++k) v[4 * i + k] = float(int8_t(w >> (8 * k))) * sc;
    }
    return;
  }
  if (whole && cls == KVGC_CLASS_INT4 && DPL >= 4) {  // DPL / 2 bytes in one group (32 | hd)
    const uint32_t g = d0 / 32;
    const float sc = ldq<D>(qp, 2 * g), z = ldq<D>(qp, 2 * g + 1);
    const uint32_t w = DPL == 8 ? *reinterpret_cast<const uint32_t*>(row + d0 / 2)
                                : uint32_t(*reinterpret_cast<const uint16_t*>(row + d0 / 2));
#pragma unroll
    for (int k = 0; k < DPL; ++k) v[k] = float((w >> (4 * k)) & 15u) * sc + z;
    return;
  }
#pragma unroll
  for (int k = 0; k < DPL; ++k) v[k] = d0 + k < hd ? elem<D>(kv, L, cls, h, slot, true, d0 + k) : 0.f;
}

// Pass 1. DPL = dims per lane, GP = query heads a block computes (the group's chunk,
// rounded up to 1, 2, 4 or 8); blockIdx.x = item, .y = KV head x query-head chunk.
// Each warp takes every kWarps-th page of the item, a tile of S slots at a time
// (tile_slots); R = 32 / S lanes share a slot: each dots its part of the K row (R > 1 for
// small tiles, so that no lane idles), then the parts are summed by shuffles.
template <kvgc_dtype D, int DPL, int GP, uint32_t N>
__global__ void __launch_bounds__(kThreads) partial_kernel(const __grid_constant__ Params<N> prm) {
  const Common& p = prm.c;
  const Entry& e = entry_of(prm, blockIdx.x, &Entry::item0);
  const uint32_t local = blockIdx.x - e.item0, qi = e.qa + local / e.splits, split = local % e.splits;
  const uint32_t p0 = e.first_page + split * e.pps, p1 = e.first_page + min(e.n_pages, (split + 1) * e.pps);
  const uint32_t part = e.splits > 1 ? e.part0 + (qi - e.qa) * e.splits + split : kNoPart;
  const uint32_t unit = e.unit0 + (qi - e.qa);
  const uint64_t log_off = e.log_off0 + uint64_t(qi - e.qa) * p.q_heads * e.n_live;
  const uint32_t chunks_y = (p.group + kGMax - 1) / kGMax;
  const uint32_t h = blockIdx.y / chunks_y, g0 = (blockIdx.y % chunks_y) * kGMax;
  const uint32_t G = min(GP, int(p.group - g0));
  const uint32_t qrow = e.q_row + qi;
  const int64_t qpos = e.q_pos0 + qi;
  const bool scored = p.logits && (e.flags & kScored);
  const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32, hd = p.hd;
  constexpr int kHdMax = DPL * 32;

  alignas(16) __shared__ float qs[GP][kHdMax];         // the queries, scaled
  alignas(16) __shared__ float probs[kWarps][32][GP];  // per warp: a tile's probabilities
  __shared__ float red_m[kWarps][GP], red_l[kWarps][GP];
  // Per warp: two stages of (K, V) tiles; after the page loop, the warp's accumulators.
  constexpr uint32_t kWarpStage = 4 * kStageBytes;
  static_assert(GP * kHdMax * sizeof(float) <= kWarpStage, "accumulators overlay the warp's stages");
  __shared__ uint4 stage_mem[kWarps][kWarpStage / 16];
  uint8_t* const my_stages = reinterpret_cast<uint8_t*>(stage_mem[warp]);

  for (uint32_t i = threadIdx.x; i < GP * kHdMax; i += blockDim.x) {
    const uint32_t g = i / kHdMax, d = i % kHdMax;
    qs[g][d] = (g < G && d < hd)
                   ? ld<D>(p.q, ((size_t(qrow) * p.q_heads) + h * p.group + g0 + g) * hd + d) * p.scale
                   : 0.f;
  }
  __syncthreads();

  // Enqueues tile (pi, base)'s K and V rows of head h into stage `stage` (nothing for
  // pages of unaligned rows: they are read in place).
  auto issue = [&](uint32_t pi, uint32_t base, uint32_t stage) {
    const SegPage sp = p.pages[pi];
    const PageLayout& L = p.L[sp.cls];
    if (L.slot_stride % 16) return;
    const uint32_t n = min(tile_slots(L), L.page_tokens - base);
    const uint32_t chunks = uint32_t(L.slot_stride / 16), span = swizzle_span(chunks);
    const uint8_t* kv = payload_of(sp);
    const uint8_t* k = kv + L.k_off + h * L.head_stride + base * L.slot_stride;
    const uint8_t* v = kv + L.v_off + h * L.head_stride + base * L.slot_stride;
    uint8_t* sk = my_stages + stage * 2 * kStageBytes;
    uint8_t* sv = sk + kStageBytes;
    for (uint32_t i = lane; i < n * chunks; i += 32) {
      const uint32_t r = i / chunks, c = i % chunks;
      copy16_async(sk + (r * chunks + swizzled(c, r, span)) * 16, k + size_t(i) * 16);
      copy16_async(sv + size_t(i) * 16, v + size_t(i) * 16);
    }
  };

  float m[GP], l[GP], acc[GP][DPL];
#pragma unroll
  for (int g = 0; g < GP; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.f;
#pragma unroll
    for (int k = 0; k < DPL; ++k) acc[g][k] = 0.f;
  }
  uint32_t pi = p0 + warp, base = 0, stage = 0;  // the tile being computed, its stage
  if (pi < p1) issue(pi, 0, 0);
  async_commit();
  while (pi < p1) {
    const SegPage sp = p.pages[pi];
    const PageLayout& L = p.L[sp.cls];
    const uint32_t S = tile_slots(L), R = 32 / S, mine = lane % S, share = lane / S;
    // The next tile goes in flight before this one is computed.
    uint32_t next_pi = pi, next_base = base + S;
    if (next_base >= L.page_tokens) next_pi = pi + kWarps, next_base = 0;
    if (next_pi < p1) issue(next_pi, next_base, stage ^ 1);
    async_commit();
    async_wait<1>();
    __syncwarp();  // every lane's copies of this tile have landed

    const uint32_t* live = reinterpret_cast<const uint32_t*>(sp.page + L.live_off);
    const int32_t* pos = reinterpret_cast<const int32_t*>(sp.page + L.pos_off);
    const uint8_t* kv = payload_of(sp);  // K/V: a shared page's are not at its header
    const bool staged = L.slot_stride % 16 == 0;
    const uint32_t chunks = uint32_t(L.slot_stride / 16), span = swizzle_span(chunks);
    const uint8_t* sk = my_stages + stage * 2 * kStageBytes;
    const uint8_t* sv = sk + kStageBytes;
    // Logits: lanes mine, mine + S, ... share slot base + mine.
    const uint32_t slot = base + mine;
    const bool is_live = slot < L.page_tokens && (live[slot / 32] >> (slot % 32) & 1u);
    const bool visible = is_live && int64_t(pos[slot]) <= qpos;
    float s[GP];
#pragma unroll
    for (int g = 0; g < GP; ++g) s[g] = 0.f;
    if (visible) {
      if (staged) {
        const uint16_t* qp = sp.cls == KVGC_CLASS_FP16
                                 ? nullptr
                                 : reinterpret_cast<const uint16_t*>(kv + L.kq_off) + L.qparam_index(h, slot);
        dot_staged<D, GP, kHdMax>(sk + mine * L.slot_stride, mine, chunks, span, sp.cls, qp, share, R, qs, s);
      } else {
        dot_global<D, GP, kHdMax>(kv, L, sp.cls, h, slot, share, R, qs, s);
      }
    }
    for (uint32_t o = S; o < 32; o <<= 1)
#pragma unroll
      for (int g = 0; g < GP; ++g) s[g] += __shfl_xor_sync(0xffffffffu, s[g], o);
    const bool owner = share == 0;  // the lane that writes the slot's logit and probability
    uint32_t row_index = 0;         // the slot's read-order row within its sequence
    if (is_live && owner && scored) {
      row_index = uint32_t(sp.out_row) + __popc(live[slot / 32] & ((1u << (slot % 32)) - 1u));
      for (uint32_t w = 0; w < slot / 32; ++w) row_index += __popc(live[w]);
    }
    // Online softmax over this tile (every lane of a slot holds the same logit).
#pragma unroll
    for (int g = 0; g < GP; ++g) {
      if (g >= int(G)) break;
      const float x = visible ? s[g] : -INFINITY;
      if (is_live && owner && scored) p.logits[log_off + size_t(h * p.group + g0 + g) * e.n_live + row_index] = x;
      const float tile_m = warp_max(x);
      const float new_m = fmaxf(m[g], tile_m);
      const float ex = (visible && new_m > -INFINITY) ? expf(x - new_m) : 0.f;
      const float corr = (m[g] > -INFINITY) ? expf(m[g] - new_m) : 0.f;
      l[g] = l[g] * corr + warp_sum(owner ? ex : 0.f);
      m[g] = new_m;
#pragma unroll
      for (int k = 0; k < DPL; ++k) acc[g][k] *= corr;
      if (owner) probs[warp][mine][g] = ex;
    }
    __syncwarp();
    // Values: lane owns dims lane * DPL ..; every live slot of the tile.
    const uint32_t n = min(S, L.page_tokens - base);
    const uint32_t tile_live = live[base / 32] >> (base % 32);  // a tile never straddles a word
    for (uint32_t j = 0; j < n; ++j) {
      if (!(tile_live >> j & 1u)) continue;
      float v[DPL], pr[GP];
      load_v<D, DPL>(staged ? sv + j * L.slot_stride : nullptr, kv, L, sp.cls, h, base + j, lane * DPL, v);
      if constexpr (GP % 4 == 0) {
#pragma unroll
        for (int g = 0; g < GP; g += 4) {
          const float4 q = *reinterpret_cast<const float4*>(&probs[warp][j][g]);
          pr[g] = q.x, pr[g + 1] = q.y, pr[g + 2] = q.z, pr[g + 3] = q.w;
        }
      } else {
#pragma unroll
        for (int g = 0; g < GP; ++g) pr[g] = probs[warp][j][g];
      }
#pragma unroll
      for (int g = 0; g < GP; ++g)
#pragma unroll
        for (int k = 0; k < DPL; ++k) acc[g][k] += pr[g] * v[k];
    }
    __syncwarp();  // the stage is free for the tile after next
    pi = next_pi, base = next_base, stage ^= 1;
  }
  async_wait<0>();
  __syncwarp();
  // Merge the warps of the block, then write the block's partial, or (the query's only
  // split) its output and (m, l). Each warp's accumulators overlay its own stages.
  float(*const red_acc_w)[kHdMax] = reinterpret_cast<float(*)[kHdMax]>(my_stages);
  if (lane == 0)
    for (int g = 0; g < GP; ++g) red_m[warp][g] = m[g], red_l[warp][g] = l[g];
#pragma unroll
  for (int g = 0; g < GP; ++g)
#pragma unroll
    for (int k = 0; k < DPL; ++k) red_acc_w[g][lane * DPL + k] = acc[g][k];
  __syncthreads();
  const bool direct = part == kNoPart;
  for (uint32_t i = threadIdx.x; i < G * (hd + 2); i += blockDim.x) {
    const uint32_t g = i / (hd + 2), c = i % (hd + 2);
    const uint32_t head = h * p.group + g0 + g;
    float M = -INFINITY;
    for (int w = 0; w < kWarps; ++w) M = fmaxf(M, red_m[w][g]);
    float val = 0.f, Ls = 0.f;
    for (int w = 0; w < kWarps; ++w) {
      const float f = red_m[w][g] > -INFINITY ? expf(red_m[w][g] - M) : 0.f;
      const float(*acc_w)[kHdMax] = reinterpret_cast<const float(*)[kHdMax]>(stage_mem[w]);
      val += f * (c == hd ? red_l[w][g] : c < hd ? acc_w[g][c] : 0.f);
      Ls += f * red_l[w][g];
    }
    if (c == hd + 1) val = M;
    if (!direct) {
      p.part[(size_t(part) * p.q_heads + head) * (hd + 2) + c] = val;
    } else if (c < hd) {
      uint8_t* out = p.out + (size_t(qrow) * p.q_heads + head) * hd * (D == KVGC_DTYPE_F32 ? 4 : 2);
      st<D>(out, c, Ls > 0.f ? val / Ls : 0.f);
    } else if (scored) {
      p.ml[(size_t(unit) * p.q_heads + head) * 2 + (c - hd)] = c == hd ? M : Ls;
    }
  }
}

// Pass 2: one block per (split query, query head).
template <kvgc_dtype D, uint32_t N>
__global__ void combine_kernel(const __grid_constant__ Params<N> prm) {
  const Common& p = prm.c;
  const uint32_t m = blockIdx.x / p.q_heads, j = blockIdx.x % p.q_heads;
  const Entry& e = entry_of(prm, m, &Entry::merge0);
  const uint32_t qi = e.qa + (m - e.merge0), unit = e.unit0 + (qi - e.qa);
  const uint32_t n_parts = e.splits, part0 = e.part0 + (qi - e.qa) * e.splits;
  const uint32_t hd = p.hd, stride = p.q_heads * (hd + 2);
  const float* part = p.part + (size_t(part0) * p.q_heads + j) * (hd + 2);
  float M = -INFINITY;
  for (uint32_t s = 0; s < n_parts; ++s) M = fmaxf(M, part[size_t(s) * stride + hd + 1]);
  float Lsum = 0.f;
  for (uint32_t s = 0; s < n_parts; ++s) {
    const float ms = part[size_t(s) * stride + hd + 1];
    if (ms > -INFINITY) Lsum += expf(ms - M) * part[size_t(s) * stride + hd];
  }
  const uint32_t qrow = e.q_row + qi;
  uint8_t* out = p.out + (size_t(qrow) * p.q_heads + j) * hd * (D == KVGC_DTYPE_F32 ? 4 : 2);
  for (uint32_t d = threadIdx.x; d < hd; d += blockDim.x) {
    float a = 0.f;
    for (uint32_t s = 0; s < n_parts; ++s) {
      const float ms = part[size_t(s) * stride + hd + 1];
      if (ms > -INFINITY) a += expf(ms - M) * part[size_t(s) * stride + d];
    }
    st<D>(out, d, Lsum > 0.f ? a / Lsum : 0.f);
  }
  if (threadIdx.x == 0 && p.ml && (e.flags & kScored)) {
    p.ml[(size_t(unit) * p.q_heads + j) * 2] = M;
    p.ml[(size_t(unit) * p.q_heads + j) * 2 + 1] = Lsum;
  }
}

// Pass 3: a block per page of the pass's sequences, a thread per slot; adds the slot's
// mass over the sequence's queries in the pass (and all query heads) to its score. The
// recent score decays once per op: in the entry that holds the sequence's first scoring
// query. Only scoring entries have blocks.
template <uint32_t N>
__global__ void mass_kernel(const __grid_constant__ Params<N> prm) {
  const Common& p = prm.c;
  const Entry& e = entry_of(prm, blockIdx.x, &Entry::block0);
  const uint32_t page = e.first_page + (blockIdx.x - e.block0);
  const SegPage sp = p.pages[page];
  const PageLayout& L = p.L[sp.cls];
  const uint32_t* live = reinterpret_cast<const uint32_t*>(sp.page + L.live_off);
  const uint32_t rows = (e.qb - e.qa) * p.q_heads;
  const float decay = (e.flags & kDecays) ? e.recent_decay : 1.0f;
  for (uint32_t slot = threadIdx.x; slot < L.page_tokens; slot += blockDim.x) {
    if (!(live[slot / 32] >> (slot % 32) & 1u)) continue;
    uint32_t idx = uint32_t(sp.out_row) + __popc(live[slot / 32] & ((1u << (slot % 32)) - 1u));
    for (uint32_t w = 0; w < slot / 32; ++w) idx += __popc(live[w]);
    float mass = 0.f;
    for (uint32_t r = 0; r < rows; ++r) {
      const float x = p.logits[e.log_off0 + size_t(r) * e.n_live + idx];
      const float* ml = p.ml + (size_t(e.unit0) * p.q_heads + r) * 2;
      if (x > -INFINITY && ml[1] > 0.f) mass += expf(x - ml[0]) / ml[1];
    }
    if (p.mass_out) {  // a page is one block's in a launch; passes run one after another
      p.mass_out[size_t(page) * L.page_tokens + slot] += mass;
      continue;
    }
    float& score = reinterpret_cast<float*>(sp.page + L.score_off)[slot];
    score = accumulate_score(score, mass);  // the CPU's rule (kernels/score.hpp)
    float& recent = reinterpret_cast<float*>(sp.page + L.recent_off)[slot];
    recent = accumulate_score(__fmul_rn(recent, decay), mass);
  }
}

// ---- host: the work list ----------------------------------------------------------

// One pass: its entries (a range of Plan::entries), the counts that size its launches,
// the floats it takes in scratch.
struct Pass {
  uint32_t first_entry, n_entries;
  uint32_t n_items, n_merges, mass_blocks, n_units, n_parts;
  uint64_t logits_floats;
};

size_t align256(size_t x) { return (x + 255) / 256 * 256; }

struct Geometry {
  uint32_t q_heads, hd;
  bool scores;
};

// Scratch floats of a pass: logits, split partials, (m, l).
uint64_t pass_floats(const Geometry& g, uint64_t logits, uint64_t parts, uint64_t units) {
  return logits + parts * g.q_heads * (g.hd + 2) + (g.scores ? units * g.q_heads * 2 : 0);
}

struct Plan {
  host::vector<Entry> entries;
  host::vector<Pass> passes;
};

// Builds the passes: units (sequence, query) in order, as many per pass as `avail_floats`
// and kEntries entries hold; a unit alone that does not fit gets fewer splits. Host work
// O(B + passes). Error before anything is enqueued: cudaErrorMemoryAllocation (one
// query in one split does not fit the scratch).
cudaError_t make_plan(const AttendSeq* seqs, uint32_t n_seqs, const Geometry& g, uint32_t blocks_per_item,
                      uint32_t n_sm, uint64_t avail_floats, Plan* plan) {
  // The split budget: pages per split (chunk), at most kMaxParts partials (so that a
  // decode batch fits in one pass). Pass 1 runs in waves of kBlocksPerSm blocks an SM, so
  // a pass takes about (its waves) x (its longest split): for targets of 1 to 4 waves of
  // items, the chunk with the least such cost wins (the fewest splits on a tie).
  uint64_t work = 0;
  for (uint32_t i = 0; i < n_seqs; ++i) work += uint64_t(seqs[i].n_q) * seqs[i].n_pages;
  const uint64_t wave_blocks = uint64_t(kBlocksPerSm) * n_sm;
  const uint64_t wave_items = std::max<uint64_t>(1, wave_blocks / std::max<uint32_t>(1, blocks_per_item));
  auto splits_of = [](const AttendSeq& s, uint64_t chunk) -> uint32_t {
    const uint64_t by_chunk = (s.n_pages + chunk - 1) / chunk;
    const uint64_t cap = std::max<uint64_t>(1, std::min<uint64_t>(kMaxParts, s.n_pages / kWarps));
    const uint32_t want = uint32_t(std::clamp<uint64_t>(by_chunk, 1, cap));
    const uint32_t pps = (s.n_pages + want - 1) / want;  // even splits
    return pps ? (s.n_pages + pps - 1) / pps : 1;
  };
  auto chunk_for = [&](uint64_t target) {  // widened until the partials fit (O(B) a round)
    for (uint64_t chunk = std::max<uint64_t>(kWarps, (work + target - 1) / target);; chunk *= 2) {
      uint64_t parts = 0;
      for (uint32_t i = 0; i < n_seqs && parts <= kMaxParts; ++i) {
        const uint32_t s = splits_of(seqs[i], chunk);
        if (s > 1) parts += uint64_t(s) * seqs[i].n_q;
      }
      if (parts <= kMaxParts) return chunk;
    }
  };
  auto cost_of = [&](uint64_t chunk) {
    uint64_t items = 0, longest = 0;
    for (uint32_t i = 0; i < n_seqs; ++i) {
      const uint32_t s = splits_of(seqs[i], chunk);
      items += uint64_t(s) * seqs[i].n_q;
      if (seqs[i].n_q) longest = std::max<uint64_t>(longest, (seqs[i].n_pages + s - 1) / s);
    }
    return (items * blocks_per_item + wave_blocks - 1) / wave_blocks * longest;
  };
  uint64_t chunk = kWarps, best_cost = UINT64_MAX;
  for (uint64_t waves = 1; waves <= 4; ++waves) {
    const uint64_t c = chunk_for(waves * wave_items), t = cost_of(c);
    if (t < best_cost) chunk = c, best_cost = t;
  }
  Pass cur{};
  auto flush = [&] {
    if (cur.n_entries == 0) return;
    plan->passes.push_back(cur);
    cur = Pass{};
    cur.first_entry = uint32_t(plan->entries.size());
  };
  // Opens an entry for sequence si from query qa with `splits` splits; a scoring one
  // gets the mass pass's blocks, and the decay if qa is the first query that scores.
  auto open_entry = [&](const AttendSeq& s, uint32_t qa, uint32_t splits, bool scored) {
    if (cur.n_entries == kEntries) flush();
    Entry e{};
    e.first_page = s.first_page, e.n_pages = s.n_pages, e.q_row = s.q_row, e.qa = e.qb = qa;
    e.splits = splits, e.pps = splits > 1 ? (s.n_pages + splits - 1) / splits : s.n_pages;
    e.item0 = cur.n_items, e.merge0 = cur.n_merges, e.unit0 = cur.n_units, e.block0 = cur.mass_blocks;
    e.part0 = cur.n_parts;
    e.n_live = s.n_live, e.log_off0 = cur.logits_floats, e.q_pos0 = s.q_pos0, e.recent_decay = s.recent_decay;
    e.flags = scored ? kScored | (qa == s.score_from ? kDecays : 0u) : 0u;
    plan->entries.push_back(e);
    ++cur.n_entries;
    if (scored) cur.mass_blocks += s.n_pages;
  };
  for (uint32_t si = 0; si < n_seqs; ++si) {
    const AttendSeq& s = seqs[si];
    if (s.n_q == 0) {
      // No queries, yet the CPU decays the recent scores (by the decay it is given).
      if (g.scores && s.recent_decay != 1.0f && s.n_pages) open_entry(s, 0, 1, true);
      continue;
    }
    uint32_t base_splits = splits_of(s, chunk);
    bool in_entry = false;
    for (uint32_t qi = 0; qi < s.n_q; ++qi) {
      // kvgc_batch_plan_ex: queries before score_from attend without scores.
      const bool scored = g.scores && qi >= s.score_from;
      uint32_t splits = base_splits;
      for (;;) {
        const uint64_t unit = pass_floats(g, scored ? uint64_t(g.q_heads) * s.n_live : 0,
                                          splits > 1 ? splits : 0, 1);
        if (pass_floats(g, cur.logits_floats, cur.n_parts, cur.n_units) + unit <= avail_floats) break;
        if (cur.n_entries) { flush(); in_entry = false; continue; }  // a fresh pass for this unit
        if (splits == 1) return cudaErrorMemoryAllocation;
        splits = (splits + 1) / 2;  // alone and too big: fewer splits
      }
      if (splits > 1) {  // even splits: pages per split, then the splits that takes
        const uint32_t pps = (s.n_pages + splits - 1) / splits;
        splits = (s.n_pages + pps - 1) / pps;
      }
      if (!in_entry || plan->entries.back().splits != splits || cur.n_entries == 0 ||
          (g.scores && qi == s.score_from)) {
        open_entry(s, qi, splits, scored);
        in_entry = true;
      }
      Entry& e = plan->entries.back();
      e.qb = qi + 1;
      ++cur.n_units;
      cur.n_items += splits;
      if (splits > 1) ++cur.n_merges, cur.n_parts += splits;
      if (scored) cur.logits_floats += uint64_t(g.q_heads) * s.n_live;
      base_splits = splits;  // a unit cut down stays cut down for the sequence's rest
    }
  }
  flush();
  return cudaSuccess;
}

template <kvgc_dtype D, uint32_t N>
cudaError_t launch_pass(const Common& c, const Plan& plan, const Pass& ps, uint32_t dpl, uint32_t blocks_y,
                        bool scores, cudaStream_t stream) {
  Params<N> p;
  p.c = c;
  p.c.n_entries = ps.n_entries;
  std::copy_n(plan.entries.data() + ps.first_entry, ps.n_entries, p.e);
  if (ps.n_items) {
    const dim3 grid(ps.n_items, blocks_y);
    // Query heads a block computes: the group, at most kGMax, rounded up to a power of 2.
    const uint32_t gp = c.group >= 5 ? 8 : c.group >= 3 ? 4 : c.group;
    switch (dpl * 16 + gp) {
#define KVGC_PARTIAL(DPL, GP) \
  case DPL * 16 + GP: partial_kernel<D, DPL, GP, N><<<grid, kThreads, 0, stream>>>(p); break;
      KVGC_PARTIAL(2, 1) KVGC_PARTIAL(2, 2) KVGC_PARTIAL(2, 4) KVGC_PARTIAL(2, 8)
      KVGC_PARTIAL(4, 1) KVGC_PARTIAL(4, 2) KVGC_PARTIAL(4, 4) KVGC_PARTIAL(4, 8)
      KVGC_PARTIAL(8, 1) KVGC_PARTIAL(8, 2) KVGC_PARTIAL(8, 4) KVGC_PARTIAL(8, 8)
#undef KVGC_PARTIAL
      default: return cudaErrorInvalidValue;
    }
  }
  if (ps.n_merges) combine_kernel<D, N><<<ps.n_merges * c.q_heads, 128, 0, stream>>>(p);
  if (scores && ps.mass_blocks) mass_kernel<N><<<ps.mass_blocks, 128, 0, stream>>>(p);
  return cudaGetLastError();
}

template <kvgc_dtype D>
cudaError_t launch_pass(const Common& c, const Plan& plan, const Pass& ps, uint32_t dpl, uint32_t blocks_y,
                        bool scores, cudaStream_t stream) {
  return ps.n_entries <= kSmallEntries
             ? launch_pass<D, kSmallEntries>(c, plan, ps, dpl, blocks_y, scores, stream)
             : launch_pass<D, kEntries>(c, plan, ps, dpl, blocks_y, scores, stream);
}

}  // namespace

cudaError_t attend(const AttendOp& op, void* scratch, size_t scratch_bytes, int n_sm,
                   cudaStream_t stream) {
  const uint32_t hd = op.layout[0].head_dim;
  if (hd > 256) return cudaErrorNotSupported;
  // A single segment is the batch of one.
  const AttendSeq one{0, op.n_pages, op.n_live, 0, op.n_q, op.q_pos0, op.recent_decay};
  const bool batch = op.n_seqs > 0;
  const AttendSeq* seqs = batch ? op.seqs : &one;
  const uint32_t n_seqs = batch ? op.n_seqs : 1;
  for (uint32_t i = 0; i < n_seqs; ++i)
    if (uint64_t(seqs[i].first_page) + seqs[i].n_pages > op.n_pages) return cudaErrorInvalidValue;
  // Scratch: the page list (unless on the device already), then a pass's floats. The
  // sequences travel in the kernels' parameters (op.dev_seqs is not needed).
  const SegPage* dev_pages = batch ? op.dev_pages : nullptr;
  const size_t pages_bytes = dev_pages ? 0 : align256(size_t(op.n_pages) * sizeof(SegPage));
  if (pages_bytes >= scratch_bytes) return cudaErrorMemoryAllocation;
  uint8_t* const base = static_cast<uint8_t*>(scratch);
  const uint32_t chunks = (op.q_heads / op.layout[0].n_kv_heads + kGMax - 1) / kGMax;
  const uint32_t blocks_y = op.layout[0].n_kv_heads * chunks;
  const Geometry g{op.q_heads, hd, op.add_scores};
  Plan plan;
  if (cudaError_t e = make_plan(seqs, n_seqs, g, blocks_y, uint32_t(std::max(1, n_sm)),
                                (scratch_bytes - pages_bytes) / sizeof(float), &plan);
      e != cudaSuccess)
    return e;

  Common c{};
  for (int k = 0; k < KVGC_CLASS_COUNT; ++k) c.L[k] = op.layout[k];
  c.pages = dev_pages ? dev_pages : reinterpret_cast<const SegPage*>(base);
  c.q = static_cast<const uint8_t*>(op.q);
  c.out = static_cast<uint8_t*>(op.out);
  c.q_heads = op.q_heads;
  c.kv_heads = op.layout[0].n_kv_heads;
  c.group = op.q_heads / c.kv_heads;
  c.hd = hd;
  c.scale = op.scale;
  c.mass_out = op.add_scores ? op.mass_out : nullptr;
  const uint32_t dpl = hd <= 64 ? 2 : hd <= 128 ? 4 : 8;

  if (pages_bytes && op.n_pages)  // pinned when the runtime passes it (its staging ring)
    if (cudaError_t e = cudaMemcpyAsync(base, op.pages, op.n_pages * sizeof(SegPage),
                                        cudaMemcpyHostToDevice, stream);
        e != cudaSuccess)
      return e;
  float* const f = reinterpret_cast<float*>(base + pages_bytes);
  for (const Pass& ps : plan.passes) {
    c.logits = op.add_scores ? f : nullptr;
    c.part = f + ps.logits_floats;
    c.ml = op.add_scores ? c.part + size_t(ps.n_parts) * op.q_heads * (hd + 2) : nullptr;
    cudaError_t e;
    switch (op.layout[0].dtype) {
      case KVGC_DTYPE_F16: e = launch_pass<KVGC_DTYPE_F16>(c, plan, ps, dpl, blocks_y, op.add_scores, stream); break;
      case KVGC_DTYPE_BF16: e = launch_pass<KVGC_DTYPE_BF16>(c, plan, ps, dpl, blocks_y, op.add_scores, stream); break;
      default: e = launch_pass<KVGC_DTYPE_F32>(c, plan, ps, dpl, blocks_y, op.add_scores, stream); break;
    }
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

size_t attend_scratch_bytes(uint64_t max_tokens, uint32_t q_heads, uint32_t head_dim,
                            uint32_t page_tokens) {
  const uint64_t pages = max_tokens / page_tokens + 2;
  // The page list, and per page of the arena room for a decode batch of one page a
  // sequence: its (m, l); the split partials are capped at kMaxParts a pass.
  return align256(pages * sizeof(SegPage)) +
         sizeof(float) * (uint64_t(q_heads) * max_tokens +                   // logits
                          uint64_t(q_heads) * kMaxParts * (head_dim + 2) +   // partials
                          uint64_t(q_heads) * 2 * pages) +                   // (m, l)
         (1u << 20);
}

size_t attend_min_scratch_bytes(const AttendOp& op, uint32_t splits) {
  splits = std::clamp<uint32_t>(splits, 1, kMaxParts);
  const bool batch = op.n_seqs > 0;
  uint64_t longest = batch ? 0 : op.n_live;
  for (uint32_t i = 0; batch && i < op.n_seqs; ++i) longest = std::max(longest, op.seqs[i].n_live);
  const size_t pages_bytes = batch && op.dev_pages ? 0 : align256(size_t(op.n_pages) * sizeof(SegPage));
  const Geometry g{op.q_heads, op.layout[0].head_dim, op.add_scores};
  return pages_bytes + sizeof(float) * pass_floats(g, g.scores ? uint64_t(g.q_heads) * longest : 0,
                                                   splits > 1 ? splits : 0, 1);
}

}  // namespace kvgc::cuda
