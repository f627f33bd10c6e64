// CUDA observe, compact and requant (kernels/cpu/gc.cpp is the specification). Observe
// and requant travel as kernel parameters, chunked like copy.cu's append and gather;
// compact's moves go to the device in one copy from a staging ring (pinned) and run in
// one launch. None synchronises.
#include <algorithm>
#include <bit>
#include <cstdint>

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

static_assert(sizeof(ObserveParams<kObserveChunk>) <= kMaxParamBytes);

// ---- compact ----------------------------------------------------------------------

// The op as the kernel reads it (one upload): its moves, then a table of the pages they
// touch. Each move has its place in the op: the holes of dst that earlier moves into the
// same page fill (dst_skip) and the live slots of src that earlier moves take
// (src_skip). Every block reads the masks as they were before the op (no mask changes
// until every block that reads it has), so moves run in parallel and still pair exactly
// as the CPU's sequential loop: move m takes dst's holes ranked [dst_skip, dst_skip +
// count) in slot order and src's live slots ranked [src_skip, src_skip + count) from the
// top.
struct MoveDesc {
  uint32_t dst, src;  // indices into the page table
  uint32_t count, dst_skip, src_skip;
};

// A page the op touches: `total` slots the op fills (a destination: holes set from the
// lowest) or takes (a source: live slots cleared from the highest). `arrived` (0 in the
// upload) sums the counts of the moves whose blocks have read its mask, once per block:
// the block that brings it to total x blocks a move writes the final mask.
struct PageFix {
  uint8_t* page;
  uint16_t total, src;
  uint32_t arrived;
};
static_assert(sizeof(MoveDesc) == 20 && sizeof(PageFix) == 16);

struct CompactParams {
  PageLayout L;
  const MoveDesc* moves;
  PageFix* pages;
};

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

// Orders this thread's earlier reads and writes before its later ones for every other
// block (the emulation runs blocks one after another: nothing to order).
__device__ __forceinline__ void fence() {
#ifndef KVGC_CUDA_EMU
  __threadfence();
#endif
}

// The final mask of a page the op fills `fill` holes of, from the lowest.
__device__ inline void fill_holes(uint32_t* live, uint32_t pt, uint32_t fill) {
  for (uint32_t w = 0; w < PageLayout::live_words(pt) && fill; ++w) {
    const uint32_t valid = (w + 1) * 32 <= pt ? ~0u : (1u << (pt % 32)) - 1u;
    uint32_t holes = ~live[w] & valid, word = live[w];
    for (; holes && fill; --fill) {
      word |= holes & (~holes + 1u);  // lowest hole
      holes &= holes - 1u;
    }
    live[w] = word;
  }
}

// The final mask of a page the op takes `take` live slots of, from the highest.
__device__ inline void take_live(uint32_t* live, uint32_t pt, uint32_t take) {
  for (uint32_t w = PageLayout::live_words(pt); w-- > 0 && take;) {
    uint32_t word = live[w];
    for (; word && take; --take) word &= ~(0x80000000u >> __clz(word));  // highest live
    live[w] = word;
  }
}

// Calls f(r, i, u) for this thread's share of the elements (r, i, u) of a move: r over
// `regions`, i over `count` pairs, u over `units`, element e = (r * count + i) * units +
// u, threads of the move's blocks taking e, e + stride, ... The digits step without a
// division (the stride's digits are worked out once).
template <class F>
__device__ __forceinline__ void for_elements(uint32_t regions, uint32_t count, uint32_t units, F&& f) {
  const uint32_t first = blockIdx.y * blockDim.x + threadIdx.x, stride = gridDim.y * blockDim.x;
  uint32_t u = first % units, rest = first / units, i = rest % count, r = rest / count;
  const uint32_t su = stride % units, srest = stride / units, si = srest % count, sr = srest / count;
  while (r < regions) {
    f(r, i, u);
    u += su;
    if (u >= units) u -= units, ++i;
    i += si;
    if (i >= count) i -= count, ++r;
    r += sr;
  }
}

// blockIdx.x = move; the blocks along y share its rows. T: the copy unit of the K/V rows.
template <class T>
__global__ void compact_kernel(const __grid_constant__ CompactParams p) {
  const MoveDesc mv = p.moves[blockIdx.x];
  PageFix* const df = p.pages + mv.dst;
  PageFix* const sf = p.pages + mv.src;
  uint8_t* const dst = df->page;
  const uint8_t* const src = sf->page;
  const PageLayout& L = p.L;
  // Pair i: dst slot to[i], src slot from[i]. A pair the masks cannot supply (host
  // counts out of step with the device: a broken invariant) keeps kNoSlot and is
  // skipped, so no byte outside the two pages' slots is ever written.
  constexpr uint16_t kNoSlot = 0xffff;
  __shared__ uint16_t to[kMaxPageTokens], from[kMaxPageTokens];
  for (uint32_t i = threadIdx.x; i < mv.count; i += blockDim.x) to[i] = from[i] = kNoSlot;
  __syncthreads();
  const uint32_t* dl = reinterpret_cast<const uint32_t*>(dst + L.live_off);
  const uint32_t* sl = reinterpret_cast<const uint32_t*>(src + L.live_off);
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
  __syncthreads();  // every thread's mask reads are done
  if (threadIdx.x == 0) {
    // Counted in after this block's reads: the block that completes a page's count is
    // the last to read its mask, and writes the final one.
    fence();
    const uint32_t blocks = gridDim.y;
    const bool last_dst = atomicAdd(&df->arrived, mv.count) + mv.count == uint32_t(df->total) * blocks;
    const bool last_src = atomicAdd(&sf->arrived, mv.count) + mv.count == uint32_t(sf->total) * blocks;
    if (last_dst || last_src) fence();
    if (last_dst) fill_holes(reinterpret_cast<uint32_t*>(dst + L.live_off), L.page_tokens, df->total);
    if (last_src)
      take_live(reinterpret_cast<uint32_t*>(sf->page + L.live_off), L.page_tokens, sf->total);
  }
  // K and V rows, head-major: region r (K of head r, then V of head r - heads) of a page
  // holds each slot's row, `units` T units.
  const uint32_t heads = L.n_kv_heads;
  for_elements(2 * heads, mv.count, uint32_t(L.slot_stride / sizeof(T)), [&](uint32_t r, uint32_t i, uint32_t u) {
    if (to[i] == kNoSlot || from[i] == kNoSlot) return;
    const size_t base = r < heads ? L.k_off + r * L.head_stride : L.v_off + (r - heads) * L.head_stride;
    reinterpret_cast<T*>(dst + base + to[i] * L.slot_stride)[u] =
        reinterpret_cast<const T*>(src + base + from[i] * L.slot_stride)[u];
  });
  if (L.qwords)  // quantisation words (int8 scale, int4 scale/zero pairs) of each row
    for_elements(2 * heads, mv.count, L.qwords, [&](uint32_t r, uint32_t i, uint32_t u) {
      if (to[i] == kNoSlot || from[i] == kNoSlot) return;
      const uint32_t h = r < heads ? r : r - heads;
      const size_t off = r < heads ? L.kq_off : L.vq_off;
      reinterpret_cast<uint16_t*>(dst + off)[L.qparam_index(h, to[i]) + u] =
          reinterpret_cast<const uint16_t*>(src + off)[L.qparam_index(h, from[i]) + u];
    });
  if (blockIdx.y == 0)
    for (uint32_t i = threadIdx.x; i < mv.count; i += blockDim.x) {
      const uint32_t d = to[i], s = from[i];
      if (d == kNoSlot || s == kNoSlot) continue;
      reinterpret_cast<int32_t*>(dst + L.pos_off)[d] = reinterpret_cast<const int32_t*>(src + L.pos_off)[s];
      reinterpret_cast<float*>(dst + L.score_off)[d] = reinterpret_cast<const float*>(src + L.score_off)[s];
      reinterpret_cast<float*>(dst + L.recent_off)[d] = reinterpret_cast<const float*>(src + L.recent_off)[s];
      dst[L.gen_off + d] = src[L.gen_off + s];
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

void CompactPageIndex::reset(size_t pages) {
  size_t want = 16;
  while (want < 2 * pages) want *= 2;
  if (slots.size() < want) slots.assign(want, Slot{nullptr, 0, 0}), stamp = 0;
  used = want;
  shift = uint32_t(64 - std::countr_zero(want));
  if (++stamp == 0) {  // wrapped: old stamps could match again
    for (Slot& s : slots) s.stamp = 0;
    stamp = 1;
  }
}

CompactPageIndex::Slot& CompactPageIndex::find(const uint8_t* page) {
  // Pages are 256-byte aligned: the bits above, Fibonacci-hashed; linear probing.
  size_t h = size_t((uint64_t(reinterpret_cast<uintptr_t>(page)) >> 8) * 0x9E3779B97F4A7C15ull >> shift);
  for (;; h = (h + 1) & (used - 1)) {
    Slot& s = slots[h];
    if (s.stamp != stamp || s.page == page) return s;
  }
}

cudaError_t compact(const CompactOp& op, CompactStaging& stage, cudaStream_t stream) {
  const uint32_t n = op.n_moves;
  if (n == 0) return cudaSuccess;
  const PageLayout& L = op.layout;
  if (n > uint32_t(INT32_MAX) || L.page_tokens == 0 || L.page_tokens > kMaxPageTokens)
    return cudaErrorInvalidValue;
  // The upload: the moves, then the page table (at most two pages a move), written
  // straight into the staging ring while the moves are checked; only the pages the op
  // touches travel.
  const size_t moves_bytes = align_up(size_t(n) * sizeof(MoveDesc), 16);
  CompactPageIndex& index = stage.index;
  index.reset(2 * size_t(n));  // before anything is enqueued (a bad_alloc changes nothing)
  size_t at = 0;
  if (cudaError_t e = stage.take(moves_bytes + 2 * size_t(n) * sizeof(PageFix), &at); e != cudaSuccess)
    return e;
  MoveDesc* const desc = reinterpret_cast<MoveDesc*>(stage.host + at);
  PageFix* const fix = reinterpret_cast<PageFix*>(stage.host + at + moves_bytes);
  uint32_t n_pages = 0, most = 0;
  // The page's entry, made on first sight; false if it already has the other role.
  auto entry = [&](uint8_t* page, bool src, uint32_t* i) {
    CompactPageIndex::Slot& s = index.find(page);
    if (s.stamp != index.stamp) {
      s = {page, n_pages, index.stamp};
      fix[n_pages] = PageFix{page, 0, uint16_t(src), 0};
      *i = n_pages++;
      return true;
    }
    *i = s.index;
    return fix[s.index].src == uint16_t(src);
  };
  const uint8_t *last_dst = nullptr, *last_src = nullptr;  // the planner reuses a page in consecutive moves
  uint32_t d = 0, sp = 0;
  for (uint32_t m = 0; m < n; ++m) {
    const CompactMove& mv = op.moves[m];
    if (!mv.dst || !mv.src || mv.dst == mv.src || mv.count == 0 || mv.count > L.page_tokens)
      return cudaErrorInvalidValue;
    if (mv.dst != last_dst && !entry(mv.dst, false, &d)) return cudaErrorInvalidValue;  // both roles
    if (mv.src != last_src && !entry(mv.src, true, &sp)) return cudaErrorInvalidValue;
    last_dst = mv.dst;
    last_src = mv.src;
    PageFix &fd = fix[d], &fs = fix[sp];
    desc[m] = MoveDesc{d, sp, mv.count, fd.total, fs.total};
    fd.total = uint16_t(fd.total + mv.count);  // <= 2 x kMaxPageTokens before the check
    fs.total = uint16_t(fs.total + mv.count);
    if (fd.total > L.page_tokens || fs.total > L.page_tokens) return cudaErrorInvalidValue;
    most = std::max(most, mv.count);
  }
  const size_t bytes = moves_bytes + size_t(n_pages) * sizeof(PageFix);
  if (cudaError_t e = cudaMemcpyAsync(stage.dev + at, stage.host + at, bytes, cudaMemcpyHostToDevice, stream);
      e != cudaSuccess)
    return e;
  ++stage.uploads;
  const CompactParams p{L, reinterpret_cast<const MoveDesc*>(stage.dev + at),
                        reinterpret_cast<PageFix*>(stage.dev + at + moves_bytes)};
  // Blocks per move: about 4 16-byte units per thread of its longest, at most 64.
  const uint64_t move_bytes = uint64_t(2) * L.n_kv_heads * most * L.slot_stride;
  const dim3 grid(n, uint32_t(std::clamp<uint64_t>(move_bytes / (16 * 4 * kThreads), 1, 64)));
  with_row_unit(L.slot_stride, [&](auto t) { compact_kernel<decltype(t)><<<grid, kThreads, 0, stream>>>(p); });
  const cudaError_t launched = cudaGetLastError();
  const cudaError_t marked = stage.commit(at, bytes, stream);  // the copy is enqueued whatever the launch did
  return launched != cudaSuccess ? launched : marked;
}

cudaError_t compact(const CompactOp& op, cudaStream_t stream) {
  thread_local CompactStaging stage;
  return compact(op, stage, stream);
}

// ---- the staging ring (gc.cuh) -----------------------------------------------------

void CompactStaging::release() {
  while (count_) (void)wait_oldest();
  for (cudaEvent_t& e : events_)
    if (e) cudaEventDestroy(e), e = nullptr;
  if (host) cudaFreeHost(host);
  if (dev) cudaFree(dev);
  host = dev = nullptr;
  bytes = 0;
  first_ = 0;
  index = CompactPageIndex();
}

size_t CompactStaging::fit(size_t n) const {
  if (count_ == 0) return n <= bytes ? 0 : SIZE_MAX;
  const Use& oldest = uses_[first_];
  const Use& newest = uses_[(first_ + count_ - 1) % kSlots];
  if (newest.begin >= oldest.begin) {  // in flight: [oldest.begin, newest.end)
    if (newest.end + n <= bytes) return newest.end;
    if (n <= oldest.begin) return 0;  // wrap around
    return SIZE_MAX;
  }
  // Wrapped: in flight [oldest.begin, bytes) and [0, newest.end).
  return newest.end + n <= oldest.begin ? newest.end : SIZE_MAX;
}

cudaError_t CompactStaging::wait_oldest() {
  const cudaError_t e = cudaEventSynchronize(events_[first_]);
  first_ = (first_ + 1) % kSlots;
  --count_;
  return e;
}

cudaError_t CompactStaging::take(size_t want, size_t* at) {
  want = align_up(std::max<size_t>(want, 1), 256);
  if (want > bytes / 8) {  // grow: nothing in flight may still read the old rings
    while (count_)
      if (cudaError_t e = wait_oldest(); e != cudaSuccess) return e;
    const size_t cap = std::max({8 * want, 2 * bytes, size_t(1) << 20});
    void *h = nullptr, *d = nullptr;
    cudaError_t e = cudaMallocHost(&h, cap);
    if (e == cudaSuccess) e = cudaMalloc(&d, cap);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();  // an allocation failure is not sticky: clear it
      if (h) cudaFreeHost(h);
      return cudaErrorMemoryAllocation;
    }
    if (host) cudaFreeHost(host);
    if (dev) cudaFree(dev);
    host = static_cast<uint8_t*>(h);
    dev = static_cast<uint8_t*>(d);
    bytes = cap;
  }
  size_t where;
  while (count_ == kSlots || (where = fit(want)) == SIZE_MAX)
    if (cudaError_t e = wait_oldest(); e != cudaSuccess) return e;
  *at = where;
  return cudaSuccess;
}

cudaError_t CompactStaging::commit(size_t at, size_t used, cudaStream_t stream) {
  const uint32_t slot = (first_ + count_) % kSlots;
  cudaError_t e = events_[slot] ? cudaSuccess : cudaEventCreateWithFlags(&events_[slot], cudaEventDisableTiming);
  if (e == cudaSuccess) e = cudaEventRecord(events_[slot], stream);
  if (e != cudaSuccess) return cudaStreamSynchronize(stream);  // untracked: wait for it instead
  uses_[slot] = {at, at + align_up(std::max<size_t>(used, 1), 256)};
  ++count_;
  return cudaSuccess;
}

}  // namespace kvgc::cuda
