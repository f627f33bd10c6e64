// CUDA select: the GC's decision op (kernels/cpu/gc.cpp's select is the specification,
// reproduced bit for bit). Over the segment's slots g = page_index * page_tokens + slot
// (read order, dead slots included), on the engine's stream:
//   1. zero_fresh: fresh demotion pages (runs from slot 0) are zeroed whole.
//   2. keys: a block per page tenures young slots that left the window and writes each
//      candidate's key as an order-preserving 64-bit integer (dead slots and other tiers:
//      all ones, so they sort last), its index g, and its fate (survivor / not ranked).
//   3. sum (demotion only): one block sums the finite keys in read order, one thread
//      adding, so the threshold is the CPU's to the bit.
//   4. CUB's stable radix sort of (key, g): the CPU's total order (key, page, slot).
//   5. decide (gc_decide.cu): one block walks the sorted candidates where the CPU loop
//      is sequential (demotions from the threshold up, evictions from the bottom, then
//      the top survivors for promotion or a major GC's re-split), chunks loaded by all
//      threads, decisions taken by thread 0, recorded as fates and a demotion list.
//   6. apply: per slot, clears evicted live bits and sets generations and ages.
//   7. demote: a block per demotion quantises K and V into its int4 slot.
//   8. count: per page, live slots and tiers; then page_live and the result are copied
//      into the op's host memory.
// Nothing here waits: the runtime reads the results after an event (runtime/harvest.cpp).
#include <cub/device/device_radix_sort.cuh>

#include <algorithm>
#include <cstdint>

#include "convert.cuh"
#include "gc.cuh"
#include "gc_select.cuh"

namespace kvgc::cuda {
using namespace select_detail;
namespace {

__global__ void zero_fresh_kernel(const Params p) {
  const AppendRun& r = p.runs[blockIdx.x];
  if (r.first_slot != 0) return;
  uint4* w = reinterpret_cast<uint4*>(r.page);
  for (size_t i = threadIdx.x; i < p.L[KVGC_CLASS_INT4].bytes / 16; i += blockDim.x)
    w[i] = make_uint4(0, 0, 0, 0);
}

__global__ void keys_kernel(const Params p) {
  const SegPage sp = p.pages[blockIdx.x];
  const PageLayout& L = p.L[sp.cls];
  const uint32_t* live = reinterpret_cast<const uint32_t*>(sp.page + L.live_off);
  const int32_t* pos = reinterpret_cast<const int32_t*>(sp.page + L.pos_off);
  const float* score = reinterpret_cast<const float*>(sp.page + L.score_off);
  uint8_t* gen = sp.page + L.gen_off;
  __shared__ unsigned int tenured, cands;
  if (threadIdx.x == 0) tenured = cands = 0;
  __syncthreads();
  for (uint32_t s = threadIdx.x; s < p.pt; s += blockDim.x) {
    const uint32_t g = blockIdx.x * p.pt + s;
    uint64_t key = kNotRanked;
    uint8_t fate = kNone;
    if (live[s / 32] >> (s % 32) & 1u) {
      uint8_t b = gen[s];
      if (gen_of(b) == kGenYoung && pos[s] < p.tenure_before) {
        b = make_gen(kGenIntermediate, 0);
        gen[s] = b;
        atomicAdd(&tenured, 1u);
      }
      if (p.candidates & gen_bit(gen_of(b))) {
        key = sort_key(key_of(p, pos[s], score[s]));
        fate = kSurvivor;
        atomicAdd(&cands, 1u);
      }
    }
    p.keys[g] = key;
    p.vals[g] = g;
    p.fate[g] = fate;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    if (tenured) atomicAdd(u64(&p.st->r.tenured), tenured);
    if (cands) atomicAdd(&p.st->n_cand, cands);
  }
}

// The candidates' finite keys summed in read order by one thread (gc.cpp's key_sum).
__global__ void __launch_bounds__(kChunk) sum_kernel(const Params p) {
  __shared__ double val[kChunk];
  __shared__ bool use[kChunk];
  double sum = 0;
  for (uint64_t base = 0; base < p.n_slots; base += kChunk) {
    const uint64_t i = base + threadIdx.x;
    const double k = i < p.n_slots && p.keys[i] != kNotRanked ? key_value(p.keys[i]) : 0.0;
    val[threadIdx.x] = k;
    use[threadIdx.x] = i < p.n_slots && p.keys[i] != kNotRanked && isfinite(k);
    __syncthreads();
    if (threadIdx.x == 0)
      for (int j = 0; j < kChunk; ++j)
        if (use[j]) sum += val[j];
    __syncthreads();
  }
  if (threadIdx.x == 0) p.st->key_sum = sum;
}

// Per slot, after decide: evictions clear live bits; survivors get their new
// generation (promotion or re-split) and age, as gc.cpp's step 3.
__global__ void apply_kernel(const Params p) {
  const SegPage sp = p.pages[blockIdx.x];
  const PageLayout& L = p.L[sp.cls];
  uint32_t* live = reinterpret_cast<uint32_t*>(sp.page + L.live_off);
  uint8_t* gen = sp.page + L.gen_off;
  __shared__ unsigned int promoted, eligible;
  if (threadIdx.x == 0) promoted = eligible = 0;
  __syncthreads();
  for (uint32_t s = threadIdx.x; s < p.pt; s += blockDim.x) {
    const uint8_t f = p.fate[blockIdx.x * p.pt + s];
    if (f == kNone || f == kDemoted) continue;  // demote_kernel moves the demoted
    if (f == kEvicted) {
      atomicAnd(&live[s / 32], ~(1u << (s % 32)));
      continue;
    }
    uint8_t b = gen[s];
    if (p.retier) {
      const bool lt = f == kTop;
      if (lt && gen_of(b) != kGenLongTerm) atomicAdd(&promoted, 1u);
      b = make_gen(lt ? kGenLongTerm : kGenIntermediate, age_of(b));
    } else if (p.promote > 0 || p.age_intermediate) {
      if (f == kTop) {
        b = make_gen(kGenLongTerm, 0);
        atomicAdd(&promoted, 1u);
      } else if (gen_of(b) == kGenIntermediate && age_of(b) >= p.promote_age) {
        atomicAdd(&eligible, 1u);
      }
    }
    if (p.age_intermediate && gen_of(b) == kGenIntermediate)
      b = make_gen(kGenIntermediate, uint8_t(age_of(b) + 1));
    gen[s] = b;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    if (promoted) atomicAdd(u64(&p.st->r.promoted), promoted);
    if (eligible) atomicAdd(u64(&p.st->r.promote_eligible), eligible);
  }
}

// A block per possible demotion (those past the decided count return): K and V of every
// head quantised per group (a thread per (K|V, head, group)), metadata copied, the
// live bits moved.
__global__ void demote_kernel(const Params p) {
  const uint32_t i = blockIdx.x;
  if (i >= p.st->r.demoted) return;
  const PageLayout& Lf = p.L[KVGC_CLASS_FP16];
  const PageLayout& Lq = p.L[KVGC_CLASS_INT4];
  const uint32_t g = p.dem_src[i], s = g % p.pt;
  uint8_t* src = slot_page(p, g);
  const uint64_t dd = p.dem_dst[i];
  uint8_t* dst = p.runs[dd >> 16].page;
  const uint32_t d = uint32_t(dd & 0xffffu);
  const uint32_t groups = Lq.head_dim / Lq.group, n = 2 * Lf.n_kv_heads * groups;
  for (uint32_t t = threadIdx.x; t < n; t += blockDim.x) {
    const uint32_t grp = t % groups, h = (t / groups) % Lf.n_kv_heads;
    const bool v = t >= Lf.n_kv_heads * groups;
    const uint8_t* row = src + (v ? Lf.v_off : Lf.k_off) + h * Lf.head_stride + s * Lf.slot_stride;
    uint8_t* nib = dst + (v ? Lq.v_off : Lq.k_off) + h * Lq.head_stride + d * Lq.slot_stride;
    uint16_t* qp = reinterpret_cast<uint16_t*>(dst + (v ? Lq.vq_off : Lq.kq_off)) +
                   (size_t(h) * Lq.page_tokens + d) * groups * 2;
    dev::quantize_group(row, Lf.dtype, Lq.group, grp, nib, qp);
  }
  if (threadIdx.x == 0) {
    reinterpret_cast<int32_t*>(dst + Lq.pos_off)[d] = reinterpret_cast<const int32_t*>(src + Lf.pos_off)[s];
    reinterpret_cast<float*>(dst + Lq.score_off)[d] = reinterpret_cast<const float*>(src + Lf.score_off)[s];
    dst[Lq.gen_off + d] = src[Lf.gen_off + s];
    atomicOr(reinterpret_cast<uint32_t*>(dst + Lq.live_off) + d / 32, 1u << (d % 32));
    atomicAnd(reinterpret_cast<uint32_t*>(src + Lf.live_off) + s / 32, ~(1u << (s % 32)));
  }
}

// Per page: live slots (page_live) and the tiers and classes of the live tokens.
__global__ void count_kernel(const Params p) {
  const SegPage sp = p.pages[blockIdx.x];
  const PageLayout& L = p.L[sp.cls];
  const uint32_t* live = reinterpret_cast<const uint32_t*>(sp.page + L.live_off);
  __shared__ unsigned int tier[4];
  if (threadIdx.x < 4) tier[threadIdx.x] = 0;
  __syncthreads();
  for (uint32_t s = threadIdx.x; s < p.pt; s += blockDim.x)
    if (live[s / 32] >> (s % 32) & 1u) atomicAdd(&tier[gen_of(sp.page[L.gen_off + s])], 1u);
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned int n = tier[0] + tier[1] + tier[2] + tier[3];
    p.page_live[blockIdx.x] = uint16_t(n);
    if (n) atomicAdd(u64(&p.st->r.live[sp.cls]), n);
    for (int t = 0; t < 4; ++t)
      if (tier[t]) atomicAdd(u64(&p.st->r.tier[t]), tier[t]);
  }
}

// Scratch carving, in the order select uses it; every piece 256-byte aligned.
struct Layout {
  size_t pages, runs, state, page_live, keys0, keys1, vals0, vals1, fate, dem_src, dem_dst,
      cub, end;
};
Layout carve(uint64_t n_pages, uint64_t n_runs, uint64_t slots, uint64_t dem, size_t cub_bytes) {
  Layout c{};
  size_t off = 0;
  auto take = [&](size_t bytes) {
    const size_t at = off;
    off = align_up(off + bytes, 256);
    return at;
  };
  c.pages = take(n_pages * sizeof(SegPage));
  c.runs = take(n_runs * sizeof(AppendRun));
  c.state = take(sizeof(State));
  c.page_live = take(n_pages * sizeof(uint16_t));
  c.keys0 = take(slots * 8);
  c.keys1 = take(slots * 8);
  c.vals0 = take(slots * 4);
  c.vals1 = take(slots * 4);
  c.fate = take(slots);
  c.dem_src = take(dem * 4);
  c.dem_dst = take(dem * 8);
  c.cub = take(cub_bytes);
  c.end = off;
  return c;
}

cudaError_t sort_bytes(uint64_t slots, size_t* bytes) {
  cub::DoubleBuffer<uint64_t> k(nullptr, nullptr);
  cub::DoubleBuffer<uint32_t> v(nullptr, nullptr);
  *bytes = 0;
  return cub::DeviceRadixSort::SortPairs(nullptr, *bytes, k, v, int64_t(slots), 0, 64);
}

}  // namespace

size_t gc_scratch_bytes(uint64_t max_slots, uint32_t page_tokens) {
  size_t cub_bytes = 0;
  if (sort_bytes(max_slots, &cub_bytes) != cudaSuccess) {
    cudaGetLastError();
    cub_bytes = max_slots * 16 + (4u << 20);  // a generous stand-in; select re-checks
  }
  const uint64_t pages = max_slots / std::max(page_tokens, 1u) + 2;
  return carve(pages, pages, max_slots, max_slots, cub_bytes).end + (64u << 10);
}

cudaError_t select(const SelectOp& op, cudaStream_t stream) {
  if (op.n_pages == 0) {
    *op.result = SelectResult{};
    return cudaSuccess;
  }
  const uint32_t pt = op.layout[KVGC_CLASS_FP16].page_tokens;
  const uint64_t slots = uint64_t(op.n_pages) * pt;
  if (slots > UINT32_MAX) return cudaErrorNotSupported;
  uint64_t dem = 0;  // int4 slots the runs offer: at most that many demotions
  for (uint32_t i = 0; i < op.n_demote_dst; ++i) dem += op.demote_dst[i].count;
  size_t cub_bytes = 0;
  if (cudaError_t e = sort_bytes(slots, &cub_bytes); e != cudaSuccess) return e;
  const Layout c = carve(op.n_pages, op.n_demote_dst, slots, dem, cub_bytes);
  if (!op.scratch || c.end > op.scratch_bytes) return cudaErrorMemoryAllocation;
  uint8_t* base = static_cast<uint8_t*>(op.scratch);

  Params p{};
  p.L[0] = op.layout[0];
  p.L[1] = op.layout[1];
  p.pages = reinterpret_cast<const SegPage*>(base + c.pages);
  p.runs = reinterpret_cast<const AppendRun*>(base + c.runs);
  p.n_pages = op.n_pages;
  p.pt = pt;
  p.n_runs = op.n_demote_dst;
  p.n_slots = slots;
  p.tenure_before = op.tenure_before;
  p.candidates = op.candidates;
  p.key = op.key;
  p.noise = op.noise;
  p.seed = op.seed;
  p.salt = op.segment_salt;
  p.epoch = op.epoch;
  p.reclaim = op.reclaim;
  p.int4_cost = op.int4_cost;
  p.demote_ratio = op.demote_ratio;
  p.promote = op.promote;
  p.promote_age = op.promote_age;
  p.retier = op.retier;
  p.retier_top = op.retier_top;
  p.age_intermediate = op.age_intermediate;
  p.demote_on = op.demote_ratio >= 0 && op.n_demote_dst > 0;
  p.keys = reinterpret_cast<uint64_t*>(base + c.keys0);
  p.vals = reinterpret_cast<uint32_t*>(base + c.vals0);
  p.fate = base + c.fate;
  p.dem_src = reinterpret_cast<uint32_t*>(base + c.dem_src);
  p.dem_dst = reinterpret_cast<uint64_t*>(base + c.dem_dst);
  p.page_live = reinterpret_cast<uint16_t*>(base + c.page_live);
  p.st = reinterpret_cast<State*>(base + c.state);

#define KVGC_STEP(call)                                  \
  do {                                                   \
    if (cudaError_t e_ = (call); e_ != cudaSuccess) return e_; \
  } while (0)
#define KVGC_LAUNCHED() KVGC_STEP(cudaGetLastError())
  KVGC_STEP(cudaMemcpyAsync(base + c.pages, op.pages, op.n_pages * sizeof(SegPage),
                            cudaMemcpyHostToDevice, stream));
  if (op.n_demote_dst)
    KVGC_STEP(cudaMemcpyAsync(base + c.runs, op.demote_dst, op.n_demote_dst * sizeof(AppendRun),
                              cudaMemcpyHostToDevice, stream));
  KVGC_STEP(cudaMemsetAsync(p.st, 0, sizeof(State), stream));
  if (op.n_demote_dst) {
    zero_fresh_kernel<<<op.n_demote_dst, 256, 0, stream>>>(p);
    KVGC_LAUNCHED();
  }
  keys_kernel<<<op.n_pages, 128, 0, stream>>>(p);
  KVGC_LAUNCHED();
  const bool ordered = op.reclaim > 0 || op.retier || op.promote > 0;
  if (ordered && p.demote_on && op.reclaim > 0) {
    sum_kernel<<<1, kChunk, 0, stream>>>(p);
    KVGC_LAUNCHED();
  }
  cub::DoubleBuffer<uint64_t> keys(p.keys, reinterpret_cast<uint64_t*>(base + c.keys1));
  cub::DoubleBuffer<uint32_t> vals(p.vals, reinterpret_cast<uint32_t*>(base + c.vals1));
  if (ordered) {
    size_t bytes = cub_bytes;
    KVGC_STEP(cub::DeviceRadixSort::SortPairs(base + c.cub, bytes, keys, vals, int64_t(slots), 0,
                                              64, stream));
  }
  p.skeys = keys.Current();
  p.svals = vals.Current();
  KVGC_STEP(launch_decide(p, stream));
  apply_kernel<<<op.n_pages, 128, 0, stream>>>(p);
  KVGC_LAUNCHED();
  if (p.demote_on && op.reclaim > 0 && dem > 0) {
    demote_kernel<<<uint32_t(dem), 128, 0, stream>>>(p);
    KVGC_LAUNCHED();
  }
  count_kernel<<<op.n_pages, 128, 0, stream>>>(p);
  KVGC_LAUNCHED();
  KVGC_STEP(cudaMemcpyAsync(op.page_live, p.page_live, op.n_pages * sizeof(uint16_t),
                            cudaMemcpyDeviceToHost, stream));
  KVGC_STEP(cudaMemcpyAsync(op.result, &p.st->r, sizeof(SelectResult), cudaMemcpyDeviceToHost,
                            stream));
#undef KVGC_LAUNCHED
#undef KVGC_STEP
  return cudaSuccess;
}

}  // namespace kvgc::cuda
