// CUDA paged attention with fused scores (kernels/cpu/attend.cpp is the specification).
//
// Split-K (flash-decoding) in three launches on the engine's stream, no sync:
//   1. partial: a block per (query, KV head, chunk of <= 8 query heads, split of the
//      pages); each warp takes every 4th page of the split. Per page, lanes own slots for
//      the logits (each lane dots its slot's K row with the group's queries, kept in
//      shared memory) and then own dims for the values (p broadcast from shared memory),
//      with an online softmax in fp32. Logits go to scratch for pass 3; the block's
//      (m, l, acc) go to scratch.
//   2. combine: per (query, query head), merges the splits into out (model dtype) and
//      keeps the final (m, l).
//   3. mass: per slot, sums exp(logit - m) / l over queries and query heads and adds it to
//      the slot's score.
// Head dims are dispatched at compile time by dims per lane (2, 4, 8: head_dim <= 64,
// <= 128, <= 256); larger head dims are not supported on CUDA.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>

#include "../score.hpp"
#include "attend.cuh"

namespace kvgc::cuda {
namespace {

constexpr int kWarps = 4, kThreads = kWarps * 32, kGMax = 8;

struct Params {
  PageLayout L[KVGC_CLASS_COUNT];
  const SegPage* pages;  // device copy (scratch)
  uint32_t n_pages, pages_per_split;
  const uint8_t* q;      // model dtype [n_q][q_heads][hd]
  uint8_t* out;
  uint32_t q0, nq, q_heads, kv_heads, group, hd;  // queries [q0, q0 + nq) of the op
  int64_t q_pos0;
  float scale;
  float recent_decay;  // the op's (already raised to n_q)
  uint64_t n_live;
  float* logits;   // [nq * q_heads][n_live]
  float* part;     // [nq][q_heads][splits][hd + 2]
  float* ml;       // [nq][q_heads][2]
  uint32_t splits;
};

template <kvgc_dtype D>
__device__ __forceinline__ float ld(const uint8_t* p, uint32_t i) {
  if constexpr (D == KVGC_DTYPE_F16) return __half2float(reinterpret_cast<const __half*>(p)[i]);
  else if constexpr (D == KVGC_DTYPE_BF16) return __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(p)[i]);
  else return reinterpret_cast<const float*>(p)[i];
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
  if constexpr (D == KVGC_DTYPE_F16) return __half2float(reinterpret_cast<const __half*>(p)[i]);
  else return __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(p)[i]);
}

// Element d of one head's K (v = false) or V row of `slot`, as f32 (int8 and int4
// dequantised in f32, without the model dtype's rounding: within attention's tolerance).
template <kvgc_dtype D>
__device__ __forceinline__ float elem(const uint8_t* page, const PageLayout& L, uint32_t cls,
                                      uint32_t h, uint32_t slot, bool v, uint32_t d) {
  const uint8_t* row = page + (v ? L.v_off : L.k_off) + h * L.head_stride + slot * L.slot_stride;
  if (cls == KVGC_CLASS_FP16) return ld<D>(row, d);
  const uint16_t* qp = reinterpret_cast<const uint16_t*>(page + (v ? L.vq_off : L.kq_off)) +
                       L.qparam_index(h, slot);
  if (cls == KVGC_CLASS_INT8) return float(reinterpret_cast<const int8_t*>(row)[d]) * ldq<D>(qp, 0);
  const uint32_t g = d / L.group;
  const uint32_t n = (row[d / 2] >> (4 * (d % 2))) & 0xfu;
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

// Pass 1. DPL = dims per lane; blockIdx.x = KV head x query-head chunk, .y = split,
// .z = query.
template <kvgc_dtype D, int DPL>
__global__ void __launch_bounds__(kThreads) partial_kernel(const __grid_constant__ Params p) {
  const uint32_t chunks = (p.group + kGMax - 1) / kGMax;
  const uint32_t h = blockIdx.x / chunks, g0 = (blockIdx.x % chunks) * kGMax;
  const uint32_t G = min(kGMax, int(p.group - g0));
  const uint32_t qi = blockIdx.z, split = blockIdx.y;
  const int64_t qpos = p.q_pos0 + p.q0 + qi;
  const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32, hd = p.hd;
  constexpr int kHdMax = DPL * 32;

  __shared__ float qs[kGMax][kHdMax];           // the queries, scaled
  __shared__ float probs[kWarps][32][kGMax];    // per warp: a sub-tile's probabilities
  __shared__ float red_m[kWarps][kGMax], red_l[kWarps][kGMax];
  __shared__ float red_acc[kWarps][kGMax][kHdMax];

  for (uint32_t i = threadIdx.x; i < kGMax * kHdMax; i += blockDim.x) {
    const uint32_t g = i / kHdMax, d = i % kHdMax;
    qs[g][d] = (g < G && d < hd)
                   ? ld<D>(p.q, ((size_t(p.q0 + qi) * p.q_heads) + h * p.group + g0 + g) * hd + d) * p.scale
                   : 0.f;
  }
  __syncthreads();

  float m[kGMax], l[kGMax], acc[kGMax][DPL];
#pragma unroll
  for (int g = 0; g < kGMax; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.f;
#pragma unroll
    for (int k = 0; k < DPL; ++k) acc[g][k] = 0.f;
  }
  const uint32_t first = split * p.pages_per_split;
  const uint32_t last = min(p.n_pages, first + p.pages_per_split);
  for (uint32_t pi = first + warp; pi < last; pi += kWarps) {
    const SegPage sp = p.pages[pi];
    const PageLayout& L = p.L[sp.cls];
    const uint32_t* live = reinterpret_cast<const uint32_t*>(sp.page + L.live_off);
    const int32_t* pos = reinterpret_cast<const int32_t*>(sp.page + L.pos_off);
    for (uint32_t base = 0; base < L.page_tokens; base += 32) {
      // Logits: lane owns slot base + lane.
      const uint32_t slot = base + lane;
      const bool is_live = slot < L.page_tokens && (live[slot / 32] >> (slot % 32) & 1u);
      const bool visible = is_live && int64_t(pos[slot]) <= qpos;
      float s[kGMax];
#pragma unroll
      for (int g = 0; g < kGMax; ++g) s[g] = 0.f;
      if (visible)
        for (uint32_t d = 0; d < hd; ++d) {
          const float k = elem<D>(sp.page, L, sp.cls, h, slot, false, d);
#pragma unroll
          for (int g = 0; g < kGMax; ++g) s[g] += qs[g][d] * k;
        }
      uint32_t row_index = 0;  // the slot's read-order row
      if (is_live) {
        row_index = uint32_t(sp.out_row) + __popc(live[slot / 32] & ((1u << (slot % 32)) - 1u));
        for (uint32_t w = 0; w < slot / 32; ++w) row_index += __popc(live[w]);
      }
      // Online softmax over this sub-tile.
#pragma unroll
      for (int g = 0; g < kGMax; ++g) {
        if (g >= int(G)) break;
        const float x = visible ? s[g] : -INFINITY;
        if (is_live)
          p.logits[(size_t(qi) * p.q_heads + h * p.group + g0 + g) * p.n_live + row_index] = x;
        const float tile_m = warp_max(x);
        const float new_m = fmaxf(m[g], tile_m);
        const float e = (visible && new_m > -INFINITY) ? expf(x - new_m) : 0.f;
        const float corr = (m[g] > -INFINITY) ? expf(m[g] - new_m) : 0.f;
        l[g] = l[g] * corr + warp_sum(e);
        m[g] = new_m;
#pragma unroll
        for (int k = 0; k < DPL; ++k) acc[g][k] *= corr;
        probs[warp][lane][g] = e;
      }
      __syncwarp();
      // Values: lane owns dims lane * DPL ..; every live slot of the sub-tile.
      const uint32_t n = min(32u, L.page_tokens - base);
      for (uint32_t j = 0; j < n; ++j) {
        const uint32_t sl = base + j;
        if (!(live[sl / 32] >> (sl % 32) & 1u)) continue;
        float v[DPL];
#pragma unroll
        for (int k = 0; k < DPL; ++k) {
          const uint32_t d = lane * DPL + k;
          v[k] = d < hd ? elem<D>(sp.page, L, sp.cls, h, sl, true, d) : 0.f;
        }
#pragma unroll
        for (int g = 0; g < kGMax; ++g) {
          const float pr = probs[warp][j][g];
#pragma unroll
          for (int k = 0; k < DPL; ++k) acc[g][k] += pr * v[k];
        }
      }
      __syncwarp();
    }
  }
  // Merge the warps of the block, then write the block's partial.
  if (lane == 0)
    for (int g = 0; g < kGMax; ++g) red_m[warp][g] = m[g], red_l[warp][g] = l[g];
#pragma unroll
  for (int g = 0; g < kGMax; ++g)
#pragma unroll
    for (int k = 0; k < DPL; ++k) red_acc[warp][g][lane * DPL + k] = acc[g][k];
  __syncthreads();
  for (uint32_t i = threadIdx.x; i < G * (hd + 2); i += blockDim.x) {
    const uint32_t g = i / (hd + 2), c = i % (hd + 2);
    float M = -INFINITY;
    for (int w = 0; w < kWarps; ++w) M = fmaxf(M, red_m[w][g]);
    float val = 0.f;
    for (int w = 0; w < kWarps; ++w) {
      const float f = red_m[w][g] > -INFINITY ? expf(red_m[w][g] - M) : 0.f;
      val += f * (c == hd ? red_l[w][g] : c < hd ? red_acc[w][g][c] : 0.f);
    }
    if (c == hd + 1) val = M;
    float* dst = p.part + ((size_t(qi) * p.q_heads + h * p.group + g0 + g) * p.splits + split) * (hd + 2);
    dst[c] = val;
  }
}

// Pass 2: one block per (query, query head).
template <kvgc_dtype D>
__global__ void combine_kernel(const __grid_constant__ Params p) {
  const uint32_t row = blockIdx.x;  // qi * q_heads + j
  const float* part = p.part + size_t(row) * p.splits * (p.hd + 2);
  float M = -INFINITY;
  for (uint32_t s = 0; s < p.splits; ++s) M = fmaxf(M, part[s * (p.hd + 2) + p.hd + 1]);
  float Lsum = 0.f;
  for (uint32_t s = 0; s < p.splits; ++s) {
    const float ms = part[s * (p.hd + 2) + p.hd + 1];
    if (ms > -INFINITY) Lsum += expf(ms - M) * part[s * (p.hd + 2) + p.hd];
  }
  const uint32_t qi = row / p.q_heads, j = row % p.q_heads;
  uint8_t* out = p.out + ((size_t(p.q0 + qi) * p.q_heads) + j) * p.hd * (D == KVGC_DTYPE_F32 ? 4 : 2);
  for (uint32_t d = threadIdx.x; d < p.hd; d += blockDim.x) {
    float a = 0.f;
    for (uint32_t s = 0; s < p.splits; ++s) {
      const float ms = part[s * (p.hd + 2) + p.hd + 1];
      if (ms > -INFINITY) a += expf(ms - M) * part[s * (p.hd + 2) + d];
    }
    st<D>(out, d, Lsum > 0.f ? a / Lsum : 0.f);
  }
  if (threadIdx.x == 0) {
    p.ml[2 * row] = M;
    p.ml[2 * row + 1] = Lsum;
  }
}

// Pass 3: a thread per slot of a page; adds the slot's mass over all rows to its score.
__global__ void mass_kernel(const __grid_constant__ Params p) {
  const SegPage sp = p.pages[blockIdx.x];
  const PageLayout& L = p.L[sp.cls];
  const uint32_t* live = reinterpret_cast<const uint32_t*>(sp.page + L.live_off);
  const uint32_t rows = p.nq * p.q_heads;
  for (uint32_t slot = threadIdx.x; slot < L.page_tokens; slot += blockDim.x) {
    if (!(live[slot / 32] >> (slot % 32) & 1u)) continue;
    uint32_t idx = uint32_t(sp.out_row) + __popc(live[slot / 32] & ((1u << (slot % 32)) - 1u));
    for (uint32_t w = 0; w < slot / 32; ++w) idx += __popc(live[w]);
    float mass = 0.f;
    for (uint32_t r = 0; r < rows; ++r) {
      const float x = p.logits[size_t(r) * p.n_live + idx];
      const float M = p.ml[2 * r], Ls = p.ml[2 * r + 1];
      if (x > -INFINITY && Ls > 0.f) mass += expf(x - M) / Ls;
    }
    float& score = reinterpret_cast<float*>(sp.page + L.score_off)[slot];
    score = accumulate_score(score, mass);  // the CPU's rule (kernels/score.hpp)
    float& recent = reinterpret_cast<float*>(sp.page + L.recent_off)[slot];
    recent = accumulate_score(__fmul_rn(recent, p.recent_decay), mass);
  }
}

template <kvgc_dtype D>
cudaError_t launch(const AttendOp& op, const Params& base, uint32_t dpl, uint32_t n_sm,
                   size_t scratch_floats, float* scratch_f, cudaStream_t stream) {
  const uint32_t chunks = (base.group + kGMax - 1) / kGMax;
  // Queries per pass: as many as the logits and partials fit in scratch.
  const uint64_t per_query_logits = uint64_t(op.q_heads) * op.n_live;
  for (uint32_t q0 = 0; q0 < op.n_q;) {
    Params p = base;
    p.q0 = q0;
    // Splits: enough blocks to fill the GPU (about 4 per SM), at least a page each.
    const uint32_t blocks_per_split = op.layout[0].n_kv_heads * chunks;
    uint32_t nq = std::min<uint32_t>(op.n_q - q0, 64);
    uint32_t splits = std::max<uint32_t>(1, std::min<uint32_t>(
        std::max<uint32_t>(1, 4 * n_sm / std::max<uint32_t>(1, blocks_per_split * nq)),
        std::max<uint32_t>(1, op.n_pages / kWarps)));
    splits = std::min<uint32_t>(splits, 256);
    auto need = [&](uint32_t n, uint32_t s) {
      return uint64_t(n) * per_query_logits + uint64_t(n) * op.q_heads * s * (op.layout[0].head_dim + 2) +
             uint64_t(n) * op.q_heads * 2;
    };
    while (nq > 1 && need(nq, splits) > scratch_floats) nq = (nq + 1) / 2;
    if (need(nq, splits) > scratch_floats) return cudaErrorMemoryAllocation;
    p.nq = nq;
    p.splits = splits;
    p.pages_per_split = (op.n_pages + splits - 1) / splits;
    p.logits = scratch_f;
    p.part = p.logits + size_t(nq) * per_query_logits;
    p.ml = p.part + size_t(nq) * op.q_heads * splits * (op.layout[0].head_dim + 2);
    const dim3 grid(blocks_per_split, splits, nq);
    switch (dpl) {
      case 2: partial_kernel<D, 2><<<grid, kThreads, 0, stream>>>(p); break;
      case 4: partial_kernel<D, 4><<<grid, kThreads, 0, stream>>>(p); break;
      default: partial_kernel<D, 8><<<grid, kThreads, 0, stream>>>(p); break;
    }
    combine_kernel<D><<<nq * op.q_heads, 128, 0, stream>>>(p);
    if (op.add_scores) mass_kernel<<<op.n_pages, 128, 0, stream>>>(p);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
    q0 += nq;
  }
  return cudaSuccess;
}

}  // namespace

cudaError_t attend(const AttendOp& op, void* scratch, size_t scratch_bytes, int n_sm,
                   cudaStream_t stream) {
  const uint32_t hd = op.layout[0].head_dim;
  if (hd > 256) return cudaErrorNotSupported;
  // Scratch: the page list first (16-byte aligned), then floats.
  const size_t pages_bytes = (size_t(op.n_pages) * sizeof(SegPage) + 255) / 256 * 256;
  if (pages_bytes >= scratch_bytes) return cudaErrorMemoryAllocation;
  auto* dev_pages = static_cast<SegPage*>(scratch);
  if (op.n_pages)
    if (cudaError_t e = cudaMemcpyAsync(dev_pages, op.pages, op.n_pages * sizeof(SegPage),
                                        cudaMemcpyHostToDevice, stream);
        e != cudaSuccess)
      return e;
  Params p{};
  for (int c = 0; c < KVGC_CLASS_COUNT; ++c) p.L[c] = op.layout[c];
  p.recent_decay = op.recent_decay;
  p.pages = dev_pages;
  p.n_pages = op.n_pages;
  p.q = static_cast<const uint8_t*>(op.q);
  p.out = static_cast<uint8_t*>(op.out);
  p.q_heads = op.q_heads;
  p.kv_heads = op.layout[0].n_kv_heads;
  p.group = op.q_heads / p.kv_heads;
  p.hd = hd;
  p.q_pos0 = op.q_pos0;
  p.scale = op.scale;
  p.n_live = op.n_live;
  const uint32_t dpl = hd <= 64 ? 2 : hd <= 128 ? 4 : 8;
  float* f = reinterpret_cast<float*>(static_cast<uint8_t*>(scratch) + pages_bytes);
  const size_t floats = (scratch_bytes - pages_bytes) / sizeof(float);
  switch (op.layout[0].dtype) {
    case KVGC_DTYPE_F16: return launch<KVGC_DTYPE_F16>(op, p, dpl, uint32_t(n_sm), floats, f, stream);
    case KVGC_DTYPE_BF16: return launch<KVGC_DTYPE_BF16>(op, p, dpl, uint32_t(n_sm), floats, f, stream);
    default: return launch<KVGC_DTYPE_F32>(op, p, dpl, uint32_t(n_sm), floats, f, stream);
  }
}

size_t attend_scratch_bytes(uint64_t max_tokens, uint32_t q_heads, uint32_t head_dim,
                            uint32_t page_tokens) {
  const uint64_t pages = max_tokens / page_tokens + 2;
  return (pages * sizeof(SegPage) + 255) / 256 * 256 +
         sizeof(float) * (uint64_t(q_heads) * max_tokens +               // one query's logits
                          uint64_t(q_heads) * 256 * (head_dim + 2) +     // partials
                          uint64_t(q_heads) * 2) +
         (1u << 20);
}

}  // namespace kvgc::cuda
