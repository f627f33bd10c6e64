// CUDA observe, compact and requant (kernels/cpu/gc.cpp is the specification). All
// travel as kernel parameters, chunked like copy.cu's append and gather, and never
// synchronise.
#include <algorithm>
#include <cstdint>
#include <functional>

#include "../../allocator/host_memory.hpp"
#include "../score.hpp"
#include "convert.cuh"
#include "gc.cuh"

namespace kvgc::cuda {
namespace {

// Parameter blocks are copied whole at every launch, so small ops (a short segment, a
// few moves) use small blocks, as copy.cu's decode append does.
constexpr int kThreads = 256;
constexpr uint32_t kObserveChunk = 768;   // 32 B a page: 24 KiB of parameters
constexpr uint32_t kMoveChunk = 768;      // 32 B a move
constexpr uint32_t kFixChunk = 1024;      // 16 B a page
constexpr uint32_t kRequantChunk = 1024;  // 24 B a page
constexpr uint32_t kSmall = 16;
constexpr size_t kMaxParamBytes = 32764;  // sm_70+, CUDA 12.1+ (nvcc refuses more)

__device__ __forceinline__ bool live_bit(const uint32_t* live, uint32_t s) {
  return live[s / 32] >> (s % 32) & 1u;
}
// Live slots below `s` in the mask.
__device__ __forceinline__ uint32_t live_below(const uint32_t* live, uint32_t s) {
  uint32_t n = __popc(live[s / 32] & ((1u << (s % 32)) - 1u));
  for (uint32_t w = 0; w < s / 32; ++w) n += __popc(live[w]);
  return n;
}

// ---- observe ----------------------------------------------------------------------

struct ObserveCommon {
  PageLayout L[KVGC_CLASS_COUNT];
  const float* mass;
  float decay;
  bool by_slot;
};

template <uint32_t N>
struct ObserveParams {
  ObserveCommon c;
  uint32_t base;  // index in the op's page list of pages[0] (by_slot's mass rows)
  uint32_t n_pages;
  SegPage pages[N];
};

// The page list already on the device (ObserveOp::dev_pages): one launch, any length.
struct ObserveDevParams {
  ObserveCommon c;
  const SegPage* pages;
};

// A thread per slot of page `index` of the op: score += m and recent = recent * decay +
// m, with m = mass[out_row + rank] (by_slot: mass[index * page_tokens + slot]); one
// rounding each, as on the CPU: no contraction.
__device__ inline void observe_page(const ObserveCommon& c, const SegPage& sp, uint64_t index) {
  const PageLayout& L = c.L[sp.cls];
  const uint32_t* live = reinterpret_cast<const uint32_t*>(sp.page + L.live_off);
  float* score = reinterpret_cast<float*>(sp.page + L.score_off);
  float* recent = reinterpret_cast<float*>(sp.page + L.recent_off);
  for (uint32_t s = threadIdx.x; s < L.page_tokens; s += blockDim.x)
    if (live_bit(live, s)) {
      const float m = c.by_slot ? c.mass[index * L.page_tokens + s] : c.mass[sp.out_row + live_below(live, s)];
      score[s] = accumulate_score(score[s], m);
      recent[s] = accumulate_score(__fmul_rn(recent[s], c.decay), m);  // no contraction
    }
}

// A block per page.
template <uint32_t N>
__global__ void observe_kernel(const __grid_constant__ ObserveParams<N> p) {
  observe_page(p.c, p.pages[blockIdx.x], uint64_t(p.base) + blockIdx.x);
}
__global__ void observe_dev_kernel(const __grid_constant__ ObserveDevParams p) {
  observe_page(p.c, p.pages[blockIdx.x], blockIdx.x);
}

// ---- compact ----------------------------------------------------------------------

// One move with its place in the op: the holes of dst that earlier moves into the same
// page filled (dst_skip) and the live slots of src that earlier moves took (src_skip).
// Every move reads the masks as they were before the op (no kernel of the op changes a
// mask until mask_kernel), so moves run in parallel and still pair exactly as the CPU's
// sequential loop: move m takes dst's holes ranked [dst_skip, dst_skip + count) in slot
// order and src's live slots ranked [src_skip, src_skip + count) from the top.
struct MoveDesc {
  uint8_t* dst;
  uint8_t* src;
  uint32_t count, dst_skip, src_skip;
};

template <uint32_t N>
struct MoveParams {
  PageLayout L;
  uint32_t n_moves;
  MoveDesc moves[N];
};

// The final mask of a page the op touches: `fill` more holes set from the lowest (a
// destination) or `take` live slots cleared from the highest (a source).
struct MaskFix {
  uint8_t* page;
  uint32_t fill, take;
};

template <uint32_t N>
struct FixParams {
  PageLayout L;
  uint32_t n;
  MaskFix fixes[N];
};
static_assert(sizeof(ObserveParams<kObserveChunk>) <= kMaxParamBytes);
static_assert(sizeof(MoveParams<kMoveChunk>) <= kMaxParamBytes);
static_assert(sizeof(FixParams<kFixChunk>) <= kMaxParamBytes);

// ---- requant ----------------------------------------------------------------------

template <uint32_t N>
struct RequantParams {
  PageLayout Ls, Ld;
  uint32_t n_pages;
  RequantPage pages[N];
};
static_assert(sizeof(RequantParams<kRequantChunk>) <= kMaxParamBytes);

// A block per page: dst zeroed whole, header included (scrubbing: a fresh page shows
// nothing of its previous owner's). Before requant_kernel, which writes into it.
template <uint32_t N>
__global__ void requant_zero_kernel(const __grid_constant__ RequantParams<N> p) {
  uint4* w = reinterpret_cast<uint4*>(p.pages[blockIdx.x].dst);
  for (size_t i = threadIdx.x; i < p.Ld.bytes / 16; i += blockDim.x) w[i] = make_uint4(0, 0, 0, 0);
}

// A block per (page, slot): blockIdx.x the page, blockIdx.y the slot (those at or past
// the page's `used` return). Each head's K and V rows re-stored through the model dtype
// into the same slot of dst, as select's demotions do (dev::restore_row).
template <uint32_t N>
__global__ void requant_kernel(const __grid_constant__ RequantParams<N> p) {
  const RequantPage& rp = p.pages[blockIdx.x];
  const uint32_t s = blockIdx.y;
  if (s >= rp.used) return;  // the whole block: no barrier is left waiting
  __shared__ float row[kMaxHeadDim];
  __shared__ uint16_t scale;
  const uint32_t heads = p.Ls.n_kv_heads;
  for (uint32_t t = 0; t < 2 * heads; ++t)
    dev::restore_row(rp.src, p.Ls, s, rp.dst, p.Ld, s, t % heads, t >= heads, row, &scale);
}

// blockIdx.y = move; blocks along x share its rows. T: the copy unit of the K/V rows.
template <class T, uint32_t N>
__global__ void move_kernel(const __grid_constant__ MoveParams<N> p) {
  const MoveDesc& mv = p.moves[blockIdx.y];
  const PageLayout& L = p.L;
  // Pair i: dst slot to[i], src slot from[i]. A pair the masks cannot supply (host
  // counts out of step with the device: a broken invariant) keeps kNoSlot and is
  // skipped, so no byte outside the two pages' slots is ever written.
  constexpr uint16_t kNoSlot = 0xffff;
  __shared__ uint16_t to[kMaxPageTokens], from[kMaxPageTokens];
  for (uint32_t i = threadIdx.x; i < mv.count; i += blockDim.x) to[i] = from[i] = kNoSlot;
  __syncthreads();
  const uint32_t* dl = reinterpret_cast<const uint32_t*>(mv.dst + L.live_off);
  const uint32_t* sl = reinterpret_cast<const uint32_t*>(mv.src + L.live_off);
  const uint32_t src_live = live_below(sl, L.page_tokens - 1) + live_bit(sl, L.page_tokens - 1);
  for (uint32_t s = threadIdx.x; s < L.page_tokens; s += blockDim.x) {
    if (!live_bit(dl, s)) {
      const uint32_t r = s - live_below(dl, s);  // rank among the holes
      if (r >= mv.dst_skip && r < mv.dst_skip + mv.count) to[r - mv.dst_skip] = uint16_t(s);
    }
    if (live_bit(sl, s)) {
      const uint32_t r = src_live - 1 - live_below(sl, s);  // rank from the top
      if (r >= mv.src_skip && r < mv.src_skip + mv.count) from[r - mv.src_skip] = uint16_t(s);
    }
  }
  __syncthreads();
  // K and V rows, head-major: each head's rows of a page are one region.
  const uint32_t units = uint32_t(L.slot_stride / sizeof(T));
  const uint32_t total = 2 * L.n_kv_heads * mv.count * units;
  for (uint32_t e = blockIdx.x * blockDim.x + threadIdx.x; e < total; e += gridDim.x * blockDim.x) {
    const uint32_t u = e % units;
    uint32_t rest = e / units;
    const uint32_t i = rest % mv.count;
    rest /= mv.count;
    const uint32_t h = rest % L.n_kv_heads;
    const size_t off = rest / L.n_kv_heads ? L.v_off : L.k_off;
    const size_t base = off + h * L.head_stride;
    if (to[i] == kNoSlot || from[i] == kNoSlot) continue;
    reinterpret_cast<T*>(mv.dst + base + to[i] * L.slot_stride)[u] =
        reinterpret_cast<const T*>(mv.src + base + from[i] * L.slot_stride)[u];
  }
  if (L.qwords) {  // quantisation words (int8 scale, int4 scale/zero pairs) of each row
    const uint32_t qunits = L.qwords;
    const uint32_t qtotal = 2 * L.n_kv_heads * mv.count * qunits;
    for (uint32_t e = blockIdx.x * blockDim.x + threadIdx.x; e < qtotal; e += gridDim.x * blockDim.x) {
      const uint32_t u = e % qunits;
      uint32_t rest = e / qunits;
      const uint32_t i = rest % mv.count;
      rest /= mv.count;
      const uint32_t h = rest % L.n_kv_heads;
      const size_t off = rest / L.n_kv_heads ? L.vq_off : L.kq_off;
      if (to[i] == kNoSlot || from[i] == kNoSlot) continue;
      reinterpret_cast<uint16_t*>(mv.dst + off)[L.qparam_index(h, to[i]) + u] =
          reinterpret_cast<const uint16_t*>(mv.src + off)[L.qparam_index(h, from[i]) + u];
    }
  }
  if (blockIdx.x == 0)
    for (uint32_t i = threadIdx.x; i < mv.count; i += blockDim.x) {
      const uint32_t d = to[i], s = from[i];
      if (d == kNoSlot || s == kNoSlot) continue;
      reinterpret_cast<int32_t*>(mv.dst + L.pos_off)[d] = reinterpret_cast<const int32_t*>(mv.src + L.pos_off)[s];
      reinterpret_cast<float*>(mv.dst + L.score_off)[d] = reinterpret_cast<const float*>(mv.src + L.score_off)[s];
      reinterpret_cast<float*>(mv.dst + L.recent_off)[d] = reinterpret_cast<const float*>(mv.src + L.recent_off)[s];
      mv.dst[L.gen_off + d] = mv.src[L.gen_off + s];
    }
}

// A thread per touched page: applies its final mask (after every move_kernel of the op).
template <uint32_t N>
__global__ void mask_kernel(const __grid_constant__ FixParams<N> p) {
  const uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= p.n) return;
  const MaskFix& f = p.fixes[i];
  const uint32_t pt = p.L.page_tokens, words = PageLayout::live_words(pt);
  uint32_t* live = reinterpret_cast<uint32_t*>(f.page + p.L.live_off);
  uint32_t fill = f.fill, take = f.take;
  for (uint32_t w = 0; w < words && fill; ++w) {
    const uint32_t valid = (w + 1) * 32 <= pt ? ~0u : (1u << (pt % 32)) - 1u;
    uint32_t holes = ~live[w] & valid, word = live[w];
    for (; holes && fill; --fill) {
      word |= holes & (~holes + 1u);  // lowest hole
      holes &= holes - 1u;
    }
    live[w] = word;
  }
  for (uint32_t w = words; w-- > 0 && take;) {
    uint32_t word = live[w];
    for (; word && take; --take) word &= ~(0x80000000u >> __clz(word));  // highest live
    live[w] = word;
  }
}

// The widest unit (16, 8, 4, 2 or 1 bytes) a row length is a multiple of; page rows sit
// at multiples of the row length from 128-aligned offsets of 256-aligned pages.
template <class F>
void with_row_unit(size_t row, F&& f) {
  if (row % 16 == 0) f(uint4{});
  else if (row % 8 == 0) f(uint2{});
  else if (row % 4 == 0) f(uint32_t{});
  else if (row % 2 == 0) f(uint16_t{});
  else f(uint8_t{});
}

ObserveCommon observe_common(const ObserveOp& op) {
  ObserveCommon c;
  for (int k = 0; k < KVGC_CLASS_COUNT; ++k) c.L[k] = op.layout[k];
  c.mass = op.mass;
  c.decay = op.decay;
  c.by_slot = op.by_slot;
  return c;
}

template <uint32_t N>
cudaError_t observe_chunks(const ObserveOp& op, cudaStream_t stream) {
  ObserveParams<N> p;
  p.c = observe_common(op);
  for (uint32_t base = 0; base < op.n_pages; base += N) {
    p.base = base;
    p.n_pages = std::min(N, op.n_pages - base);
    for (uint32_t i = 0; i < p.n_pages; ++i) p.pages[i] = op.pages[base + i];
    observe_kernel<N><<<p.n_pages, 128, 0, stream>>>(p);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

template <uint32_t N>
cudaError_t move_chunks(const CompactOp& op, const host::vector<uint32_t>& skip, cudaStream_t stream) {
  const PageLayout& L = op.layout;
  MoveParams<N> mp;
  mp.L = L;
  for (uint32_t base = 0; base < op.n_moves; base += N) {
    mp.n_moves = std::min(N, op.n_moves - base);
    uint32_t max_count = 0;
    for (uint32_t i = 0; i < mp.n_moves; ++i) {
      const uint32_t m = base + i;
      const CompactMove& mv = op.moves[m];
      mp.moves[i] = {mv.dst, mv.src, mv.count, skip[2 * size_t(m)], skip[2 * size_t(m) + 1]};
      max_count = std::max(max_count, mv.count);
    }
    // Blocks per move: about 4 16-byte units per thread, at most 64.
    const uint64_t bytes = uint64_t(2) * L.n_kv_heads * max_count * L.slot_stride;
    const dim3 grid(uint32_t(std::clamp<uint64_t>(bytes / (16 * 4 * kThreads), 1, 64)), mp.n_moves);
    with_row_unit(L.slot_stride, [&](auto t) {
      move_kernel<decltype(t), N><<<grid, kThreads, 0, stream>>>(mp);
    });
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

template <uint32_t N>
cudaError_t requant_chunks(const RequantOp& op, cudaStream_t stream) {
  RequantParams<N> p;
  p.Ls = op.src_layout;
  p.Ld = op.dst_layout;
  for (uint32_t base = 0; base < op.n_pages; base += N) {
    p.n_pages = std::min(N, op.n_pages - base);
    uint32_t most = 0;  // the chunk's largest used count: the grid's slots
    for (uint32_t i = 0; i < p.n_pages; ++i) {
      p.pages[i] = op.pages[base + i];
      most = std::max(most, p.pages[i].used);
    }
    requant_zero_kernel<N><<<p.n_pages, kThreads, 0, stream>>>(p);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
    if (most == 0) continue;
    requant_kernel<N><<<dim3(p.n_pages, most), 128, 0, stream>>>(p);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

template <uint32_t N>
cudaError_t fix_chunks(const PageLayout& L, const host::vector<MaskFix>& fixes, cudaStream_t stream) {
  FixParams<N> fp;
  fp.L = L;
  for (size_t base = 0; base < fixes.size(); base += N) {
    fp.n = uint32_t(std::min<size_t>(N, fixes.size() - base));
    for (uint32_t i = 0; i < fp.n; ++i) fp.fixes[i] = fixes[base + i];
    mask_kernel<N><<<(fp.n + 127) / 128, 128, 0, stream>>>(fp);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

}  // namespace

cudaError_t observe(const ObserveOp& op, cudaStream_t stream) {
  if (op.n_pages == 0) return cudaSuccess;
  if (op.dev_pages) {  // a batch's page table, uploaded at plan: one launch
    ObserveDevParams p{observe_common(op), op.dev_pages};
    observe_dev_kernel<<<op.n_pages, 128, 0, stream>>>(p);
    return cudaGetLastError();
  }
  return op.n_pages <= kSmall ? observe_chunks<kSmall>(op, stream)
                              : observe_chunks<kObserveChunk>(op, stream);
}

cudaError_t requant(const RequantOp& op, cudaStream_t stream) {
  if (op.n_pages == 0) return cudaSuccess;
  const PageLayout &Ls = op.src_layout, &Ld = op.dst_layout;
  if (Ls.page_tokens != Ld.page_tokens || Ls.n_kv_heads != Ld.n_kv_heads || Ls.head_dim != Ld.head_dim ||
      Ls.dtype != Ld.dtype || Ls.head_dim == 0 || Ls.head_dim > kMaxHeadDim || Ld.bytes % 16 != 0)
    return cudaErrorInvalidValue;
  for (uint32_t i = 0; i < op.n_pages; ++i) {
    const RequantPage& rp = op.pages[i];
    if (!rp.src || !rp.dst || reinterpret_cast<uintptr_t>(rp.dst) % 16 != 0 || rp.used > Ls.page_tokens)
      return cudaErrorInvalidValue;
  }
  return op.n_pages <= kSmall ? requant_chunks<kSmall>(op, stream)
                              : requant_chunks<kRequantChunk>(op, stream);
}

cudaError_t compact(const CompactOp& op, cudaStream_t stream) {
  if (op.n_moves == 0) return cudaSuccess;
  const PageLayout& L = op.layout;
  for (uint32_t m = 0; m < op.n_moves; ++m) {
    const CompactMove& mv = op.moves[m];
    if (!mv.dst || !mv.src || mv.dst == mv.src || mv.count == 0 || mv.count > L.page_tokens)
      return cudaErrorInvalidValue;
  }
  // Each move's skips and each page's final fill/take: the (page, move) uses sorted by
  // page, then in move order, give running counts per page. Sized before anything is
  // enqueued (a bad_alloc here changes nothing).
  struct Use {
    uint8_t* page;
    uint32_t move;
    bool dst;
  };
  host::vector<Use> uses(2 * size_t(op.n_moves));
  host::vector<uint32_t> skip(2 * size_t(op.n_moves));  // [2m] dst skip, [2m + 1] src skip
  host::vector<MaskFix> fixes;
  fixes.reserve(2 * size_t(op.n_moves));
  for (uint32_t m = 0; m < op.n_moves; ++m) {
    uses[2 * m] = {op.moves[m].dst, m, true};
    uses[2 * m + 1] = {op.moves[m].src, m, false};
  }
  std::sort(uses.begin(), uses.end(), [](const Use& a, const Use& b) {
    return a.page != b.page ? std::less<uint8_t*>()(a.page, b.page) : a.move < b.move;
  });
  for (size_t i = 0; i < uses.size();) {
    size_t j = i;
    uint32_t used = 0;
    for (; j < uses.size() && uses[j].page == uses[i].page; ++j) {
      if (uses[j].dst != uses[i].dst) return cudaErrorInvalidValue;  // both roles
      skip[2 * size_t(uses[j].move) + (uses[j].dst ? 0 : 1)] = used;
      used += op.moves[uses[j].move].count;
    }
    if (used > L.page_tokens) return cudaErrorInvalidValue;
    fixes.push_back(uses[i].dst ? MaskFix{uses[i].page, used, 0} : MaskFix{uses[i].page, 0, used});
    i = j;
  }
  // Every move reads the masks as they were before the op; the masks change last.
  if (cudaError_t e = op.n_moves <= kSmall ? move_chunks<kSmall>(op, skip, stream)
                                           : move_chunks<kMoveChunk>(op, skip, stream);
      e != cudaSuccess)
    return e;
  return fixes.size() <= kSmall ? fix_chunks<kSmall>(L, fixes, stream)
                                : fix_chunks<kFixChunk>(L, fixes, stream);
}

}  // namespace kvgc::cuda
