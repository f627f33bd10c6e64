#include <algorithm>
#include <cstdint>

#include "convert.cuh"
#include "copy.cuh"

namespace kvgc::cuda {
namespace {

// Runs and pages travel as kernel parameters (no device scratch, no extra copy on the
// decode path); larger ops launch once per chunk. A batch's append (AppendOp::dev_runs:
// the runs uploaded once by the plan) is one launch whatever its number of runs. 1024 runs keep the parameters under
// the 32 KiB that sm_70+ allows (CUDA 12.1+) while a 32K-token prefill needs only two
// launches: with 96 runs per launch, bench/cuda_copy measured 0.45x memcpy on an H200,
// the launches being too small to reach full bandwidth.
// Parameter bytes are copied on every launch, so a decode append (one run) uses a small
// variant: a 25 KB block cost 7.4 us per 1-token call against 3.5 us with 96 runs.
constexpr uint32_t kChunk = 1024;
constexpr uint32_t kSmallChunk = 8;
// Gather's pages are 32 B (SegPage: a shared page's payload pointer too): 768 a launch.
constexpr uint32_t kGatherChunk = 768;
constexpr int kThreads = 256;
// What a kernel's parameters may take (sm_70+, CUDA 12.1+); nvcc refuses a larger block,
// the host emulation would not notice.
constexpr size_t kMaxParamBytes = 32764;

struct AppendCommon {
  PageLayout L;
  const uint8_t* k;
  const uint8_t* v;
  int64_t first_pos;
  uint32_t sinks;
};

template <uint32_t N>
struct AppendParams {
  AppendCommon c;
  uint32_t n_runs;
  AppendRun runs[N];
};

// The runs already in device memory (AppendOp::dev_runs, a batch's): one launch for all.
struct AppendDevParams {
  AppendCommon c;
  const AppendRun* runs;
};

template <uint32_t N>
struct GatherParams {
  PageLayout L;
  uint8_t* k_out;
  uint8_t* v_out;
  int32_t* pos_out;
  float* score_out;
  uint8_t* gen_out;
  uint32_t n_pages;
  GatherPage pages[N];
};
static_assert(sizeof(AppendParams<kChunk>) <= kMaxParamBytes);
static_assert(sizeof(GatherParams<kGatherChunk>) <= kMaxParamBytes);

// The bytes of a fresh page that no slot owns: the alignment padding between its
// regions, after K, after V and at the page's end. Zeroed by the run that takes the
// page (disjoint from every other write of the op), so that no byte of a previous owner
// survives, whatever the geometry.
__device__ inline void zero_padding(uint8_t* page, const PageLayout& L) {
  const size_t pt = L.page_tokens, payload = L.head_stride * L.n_kv_heads;
  const size_t gaps[6][2] = {
      {L.live_off + 4 * size_t(PageLayout::live_words(L.page_tokens)), L.pos_off},
      {L.pos_off + 4 * pt, L.score_off},
      {L.score_off + 4 * pt, L.gen_off},
      {L.gen_off + pt, L.k_off},
      {L.k_off + payload, L.v_off},
      {L.v_off + payload, L.bytes}};
  for (int g = 0; g < 6; ++g)
    for (size_t i = gaps[g][0] + threadIdx.x; i < gaps[g][1]; i += blockDim.x) page[i] = 0;
}

// Copies a head row (head_dim elements) in units of T; T is picked so that every
// pointer involved is aligned to it. Block `bx` of the `nbx` blocks that share the run.
template <class T>
__device__ inline void append_run(const AppendCommon& c, const AppendRun& run, uint32_t bx, uint32_t nbx) {
  const PageLayout& L = c.L;
  const uint32_t row_units = uint32_t(L.slot_stride / sizeof(T));
  // 32-bit index math: count * heads * row units < 2^29 (pt <= 256, heads <= 1024,
  // row units <= 2048); 64-bit divisions per element cost more than the copy.
  // A fresh page's run (first_slot == 0) also zeroes the slots past it: scrubbing.
  const uint32_t slots = run.first_slot == 0 ? L.page_tokens : run.count;
  const uint32_t total = slots * L.n_kv_heads * row_units;
  for (uint32_t e = bx * blockDim.x + threadIdx.x; e < total; e += nbx * blockDim.x) {
    const uint32_t u = e % row_units;
    const uint32_t th = e / row_units;
    const uint32_t h = th % L.n_kv_heads;
    const uint32_t t = th / L.n_kv_heads;
    const size_t dst = (h * L.head_stride + (run.first_slot + t) * L.slot_stride) / sizeof(T) + u;
    if (t < run.count) {
      const uint64_t src = (uint64_t(run.src_token + t) * L.n_kv_heads + h) * row_units + u;
      reinterpret_cast<T*>(run.page + L.k_off)[dst] = reinterpret_cast<const T*>(c.k)[src];
      reinterpret_cast<T*>(run.page + L.v_off)[dst] = reinterpret_cast<const T*>(c.v)[src];
    } else {
      reinterpret_cast<T*>(run.page + L.k_off)[dst] = T{};
      reinterpret_cast<T*>(run.page + L.v_off)[dst] = T{};
    }
  }
  if (bx != 0) return;
  if (run.first_slot == 0) zero_padding(run.page, L);
  for (uint32_t t = threadIdx.x; t < slots; t += blockDim.x) {
    const uint32_t slot = run.first_slot + t;
    // A batch's runs carry their segment's offset (AppendRun::pos_delta).
    const int64_t pos = c.first_pos + int64_t(run.src_token) + t + run.pos_delta;
    const bool filled = t < run.count;
    reinterpret_cast<int32_t*>(run.page + L.pos_off)[slot] = filled ? int32_t(pos) : 0;
    reinterpret_cast<float*>(run.page + L.score_off)[slot] = 0.f;
    reinterpret_cast<float*>(run.page + L.recent_off)[slot] = 0.f;
    run.page[L.gen_off + slot] = !filled ? 0 : pos < int64_t(c.sinks) ? kGenSink : kGenYoung;
  }
  // One thread per live word: a fresh page's run owns the whole mask.
  const uint32_t words = PageLayout::live_words(L.page_tokens);
  for (uint32_t w = threadIdx.x; w < words; w += blockDim.x) {
    const uint32_t lo = w * 32, hi = lo + 32;
    const uint32_t a = max(run.first_slot, lo), b = min(run.first_slot + run.count, hi);
    uint32_t mask = 0;
    if (a < b) mask = (b - a == 32 ? ~0u : ((1u << (b - a)) - 1u)) << (a - lo);
    uint32_t* live = reinterpret_cast<uint32_t*>(run.page + L.live_off) + w;
    if (run.first_slot == 0) *live = mask;
    else if (mask) *live |= mask;
  }
}

// Runs as parameters: blockIdx.y = run, blocks along x share its rows.
template <class T, uint32_t N>
__global__ void append_kernel(const __grid_constant__ AppendParams<N> p) {
  append_run<T>(p.c, p.runs[blockIdx.y], blockIdx.x, gridDim.x);
}

// Runs in device memory: blockIdx.x = run (grid.x has room for any batch), blocks along
// y share its rows.
template <class T>
__global__ void append_dev_kernel(const __grid_constant__ AppendDevParams p) {
  append_run<T>(p.c, p.runs[blockIdx.x], blockIdx.y, gridDim.y);
}

// Element e of a page's [slot][head][unit] space (units per row: `units`): false for a
// dead slot; else its slot, head, unit and output row (out_row + the slot's live rank).
struct PageElement {
  uint32_t slot, h, u;
  uint64_t out;
};
__device__ inline bool live_element(const GatherPage& gp, const PageLayout& L, uint32_t e,
                                    uint32_t units, PageElement* x) {
  const uint32_t* live = reinterpret_cast<const uint32_t*>(gp.page + L.live_off);
  x->u = e % units;
  const uint32_t th = e / units;
  x->h = th % L.n_kv_heads;
  x->slot = th / L.n_kv_heads;
  const uint32_t w = x->slot / 32, bit = 1u << (x->slot % 32);
  if (!(live[w] & bit)) return false;
  uint32_t rank = __popc(live[w] & (bit - 1));
  for (uint32_t i = 0; i < w; ++i) rank += __popc(live[i]);
  x->out = gp.out_row + rank;
  return true;
}

// Each live slot's metadata, once (by its head 0, unit 0 element).
template <uint32_t N>
__device__ inline void gather_meta(const GatherParams<N>& p, const GatherPage& gp, const PageElement& x) {
  if (x.h != 0 || x.u != 0) return;
  const PageLayout& L = p.L;
  if (p.pos_out) p.pos_out[x.out] = reinterpret_cast<const int32_t*>(gp.page + L.pos_off)[x.slot];
  if (p.score_out) p.score_out[x.out] = reinterpret_cast<const float*>(gp.page + L.score_off)[x.slot];
  if (p.gen_out) p.gen_out[x.out] = gen_of(gp.page[L.gen_off + x.slot]);
}

template <class T, uint32_t N>
__global__ void gather_kernel(const __grid_constant__ GatherParams<N> p) {
  const GatherPage& gp = p.pages[blockIdx.y];
  const PageLayout& L = p.L;
  const uint8_t* kv = payload_of(gp);  // K/V (live bits and metadata: at gp.page)
  const uint32_t row_units = uint32_t(L.slot_stride / sizeof(T));
  const uint32_t total = L.page_tokens * L.n_kv_heads * row_units;
  for (uint32_t e = blockIdx.x * blockDim.x + threadIdx.x; e < total; e += gridDim.x * blockDim.x) {
    PageElement x;
    if (!live_element(gp, L, e, row_units, &x)) continue;
    const uint32_t u = x.u, h = x.h, slot = x.slot;
    const uint64_t out = x.out;
    const size_t src = (h * L.head_stride + slot * L.slot_stride) / sizeof(T) + u;
    const uint64_t dst = (out * L.n_kv_heads + h) * row_units + u;
    if (p.k_out) reinterpret_cast<T*>(p.k_out)[dst] = reinterpret_cast<const T*>(kv + L.k_off)[src];
    if (p.v_out) reinterpret_cast<T*>(p.v_out)[dst] = reinterpret_cast<const T*>(kv + L.v_off)[src];
    gather_meta(p, gp, x);
  }
}

// INT8 and INT4 pages (after demotion): each element dequantised to the model dtype
// exactly as the CPU's gather does (quant.cpp's load_row: q * scale, or n * scale + zero,
// then the model dtype's round-to-nearest-even). A thread per (slot, head, dim); the
// writes coalesce.
template <uint32_t N>
__global__ void gather_quant_kernel(const __grid_constant__ GatherParams<N> p) {
  const GatherPage& gp = p.pages[blockIdx.y];
  const PageLayout& L = p.L;
  const uint8_t* kv = payload_of(gp);
  const uint32_t hd = L.head_dim, eb = dev::elem_bytes(L.dtype);
  const uint32_t total = L.page_tokens * L.n_kv_heads * hd;
  for (uint32_t e = blockIdx.x * blockDim.x + threadIdx.x; e < total; e += gridDim.x * blockDim.x) {
    PageElement x;
    if (!live_element(gp, L, e, hd, &x)) continue;
    const uint64_t dst = ((x.out * L.n_kv_heads + x.h) * hd + x.u) * eb;
    if (p.k_out) dev::store(p.k_out + dst, L.dtype, dev::row_element(kv, L, x.h, x.slot, false, x.u));
    if (p.v_out) dev::store(p.v_out + dst, L.dtype, dev::row_element(kv, L, x.h, x.slot, true, x.u));
    gather_meta(p, gp, x);
  }
}

// The widest unit every address and the row length are aligned to.
int unit_bytes(size_t row, std::initializer_list<uintptr_t> ptrs) {
  for (int u : {16, 8, 4, 2}) {
    bool ok = row % u == 0;
    for (uintptr_t x : ptrs) ok = ok && x % u == 0;
    if (ok) return u;
  }
  return 1;
}

// Calls f(T{}) with the copy unit type for `unit` bytes: one switch for every launcher.
template <class F>
void with_unit(int unit, F&& f) {
  switch (unit) {
    case 16: f(uint4{}); break;
    case 8: f(uint2{}); break;
    case 4: f(uint32_t{}); break;
    default: f(uint16_t{}); break;
  }
}

// Blocks along x for `units` copy units: enough to cover them, at most 1024.
uint32_t blocks_for(uint64_t units) {
  return uint32_t(std::clamp<uint64_t>((units + kThreads - 1) / kThreads, 1, 1024));
}

AppendCommon append_common(const AppendOp& op) {
  return {op.layout, static_cast<const uint8_t*>(op.k), static_cast<const uint8_t*>(op.v), op.first_pos,
          op.sinks};
}

// One launch over runs the batch plan uploaded. Blocks per run: enough for the longest
// run (from the host copy when there is one; else a whole page), blocks past a shorter
// run's rows exit at once.
cudaError_t append_dev(const AppendOp& op, int unit, cudaStream_t stream) {
  const PageLayout& L = op.layout;
  const AppendDevParams p{append_common(op), op.dev_runs};
  uint32_t max_count = op.runs ? 0 : L.page_tokens;
  for (uint32_t i = 0; op.runs && i < op.n_runs && max_count < L.page_tokens; ++i)
    max_count = std::max(max_count, op.runs[i].first_slot == 0 ? L.page_tokens : op.runs[i].count);
  const dim3 grid(op.n_runs, blocks_for(uint64_t(max_count) * L.n_kv_heads * (L.slot_stride / unit)));
  with_unit(unit, [&](auto t) { append_dev_kernel<decltype(t)><<<grid, kThreads, 0, stream>>>(p); });
  return cudaGetLastError();
}

template <uint32_t N>
cudaError_t append_chunks(const AppendOp& op, int unit, cudaStream_t stream) {
  const PageLayout& L = op.layout;
  AppendParams<N> p;
  p.c = append_common(op);
  for (uint32_t base = 0; base < op.n_runs; base += N) {
    p.n_runs = std::min(N, op.n_runs - base);
    uint32_t max_count = 0;  // slots a block writes, fresh pages' scrubbed tails included
    for (uint32_t i = 0; i < p.n_runs; ++i) {
      p.runs[i] = op.runs[base + i];
      max_count = std::max(max_count, p.runs[i].first_slot == 0 ? L.page_tokens : p.runs[i].count);
    }
    const dim3 grid(blocks_for(uint64_t(max_count) * L.n_kv_heads * (L.slot_stride / unit)),
                    p.n_runs);
    with_unit(unit, [&](auto t) {
      append_kernel<decltype(t), N><<<grid, kThreads, 0, stream>>>(p);
    });
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

// Launches over the pages of class `cls` only (read order puts the FP16 pages first,
// but nothing here relies on it): FP16 pages are copied, INT8 and INT4 pages dequantised.
template <uint32_t N>
cudaError_t gather_chunks(const GatherOp& op, kvgc_storage_class cls, int unit,
                          cudaStream_t stream) {
  const PageLayout& L = op.layout[cls];
  GatherParams<N> p;
  p.L = L;
  p.k_out = static_cast<uint8_t*>(op.k_out);
  p.v_out = static_cast<uint8_t*>(op.v_out);
  p.pos_out = op.pos_out;
  p.score_out = op.score_out;
  p.gen_out = op.gen_out;
  const uint64_t units = cls == KVGC_CLASS_FP16 ? L.slot_stride / unit : L.head_dim;
  const uint32_t bx = blocks_for(uint64_t(L.page_tokens) * L.n_kv_heads * units);
  for (uint32_t next = 0; next < op.n_pages;) {
    p.n_pages = 0;
    for (; next < op.n_pages && p.n_pages < N; ++next)
      if (op.pages[next].cls == uint32_t(cls)) p.pages[p.n_pages++] = op.pages[next];
    if (p.n_pages == 0) break;
    const dim3 grid(bx, p.n_pages);
    if (cls == KVGC_CLASS_FP16)
      with_unit(unit, [&](auto t) {
        gather_kernel<decltype(t), N><<<grid, kThreads, 0, stream>>>(p);
      });
    else
      gather_quant_kernel<N><<<grid, kThreads, 0, stream>>>(p);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

}  // namespace

cudaError_t append(const AppendOp& op, cudaStream_t stream) {
  if (op.n_runs == 0) return cudaSuccess;
  // Pages are 256-aligned and K/V offsets 128-aligned: only the source and the row
  // length limit the unit.
  const int unit = unit_bytes(op.layout.slot_stride, {uintptr_t(op.k), uintptr_t(op.v)});
  if (op.dev_runs) return append_dev(op, unit, stream);
  return op.n_runs <= kSmallChunk ? append_chunks<kSmallChunk>(op, unit, stream)
                                  : append_chunks<kChunk>(op, unit, stream);
}

cudaError_t gather(const GatherOp& op, cudaStream_t stream) {
  if (op.n_pages == 0) return cudaSuccess;
  uint32_t n_cls[KVGC_CLASS_COUNT] = {};
  for (uint32_t i = 0; i < op.n_pages; ++i) ++n_cls[op.pages[i].cls];
  const int unit =
      unit_bytes(op.layout[KVGC_CLASS_FP16].slot_stride, {uintptr_t(op.k_out), uintptr_t(op.v_out)});
  for (int c = 0; c < KVGC_CLASS_COUNT; ++c) {
    if (!n_cls[c]) continue;
    const auto cls = kvgc_storage_class(c);
    if (cudaError_t e = n_cls[c] <= kSmallChunk ? gather_chunks<kSmallChunk>(op, cls, unit, stream)
                                                : gather_chunks<kGatherChunk>(op, cls, unit, stream);
        e != cudaSuccess)
      return e;
  }
  return cudaSuccess;
}

}  // namespace kvgc::cuda
