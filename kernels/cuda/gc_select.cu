// CUDA select: the GC's decision op (kernels/cpu/gc.cpp's select is the specification,
// reproduced bit for bit). Over the segment's slots g = page_index * page_tokens + slot
// (read order, dead slots included), on the engine's stream:
//   1. fresh: fresh destination pages (runs from slot 0) are zeroed whole, used or not
//      (they stay in the segment's page tables until the results are applied: scrubbed
//      when taken, as the CPU's select does).
//   2. keys: a block per page tenures young slots that left the window, counts live slots
//      per class, and writes each candidate's key as an order-preserving 64-bit integer
//      (dead slots and other tiers: all ones, so they sort last), its index g, and its
//      fate (survivor / not ranked).
//   3. CUB's stable radix sort of (key, g): the CPU's total order (key, page, slot).
//   4. prep: per sorted candidate, the ladder walk's weight and ladder position; per
//      reserved destination slot, its run and page slot.
//   5. decide (gc_decide.cu): one thread walks the ladder, assigns rungs from the top
//      (monotone, within capacity), meets the byte budget from the bottom and lists the
//      demotions; one block picks the top survivors for promotion or a re-split.
//   6. apply: per slot, clears evicted live bits and sets generations and ages.
//   7. demote: a block per demotion re-stores K and V (through the model dtype) into its
//      slot one or more rungs down, and moves the metadata and the live bit.
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

// The class of concatenated destination run r.
__device__ __forceinline__ int run_class(const Params& p, uint32_t r) {
  int c = 0;
  while (c + 1 < KVGC_CLASS_COUNT && r >= p.run_first[c] + p.class_runs[c]) ++c;
  return c;
}

// Fresh destination pages (a run from slot 0) are zeroed whole before anything reads
// them: scrubbing, whether the op uses them or not (an unused one stays in the segment's
// page table until the results are applied).
__global__ void fresh_kernel(const Params p) {
  const AppendRun& r = p.runs[blockIdx.x];
  if (r.first_slot != 0) return;
  uint4* w = reinterpret_cast<uint4*>(r.page);
  for (size_t i = threadIdx.x; i < p.L[run_class(p, blockIdx.x)].bytes / 16; i += blockDim.x)
    w[i] = make_uint4(0, 0, 0, 0);
}

__global__ void keys_kernel(const Params p) {
  const SegPage sp = p.pages[blockIdx.x];
  const PageLayout& L = p.L[sp.cls];
  const uint32_t* live = reinterpret_cast<const uint32_t*>(sp.page + L.live_off);
  const int32_t* pos = reinterpret_cast<const int32_t*>(sp.page + L.pos_off);
  const float* score = reinterpret_cast<const float*>(sp.page + L.score_off);
  const float* recent = reinterpret_cast<const float*>(sp.page + L.recent_off);
  uint8_t* gen = sp.page + L.gen_off;
  __shared__ unsigned int tenured, cands, n_live;
  if (threadIdx.x == 0) tenured = cands = n_live = 0;
  __syncthreads();
  for (uint32_t s = threadIdx.x; s < p.pt; s += blockDim.x) {
    const uint32_t g = blockIdx.x * p.pt + s;
    uint64_t key = kNotRanked;
    uint8_t fate = kNone;
    if (live[s / 32] >> (s % 32) & 1u) {
      atomicAdd(&n_live, 1u);
      uint8_t b = gen[s];
      if (gen_of(b) == kGenYoung && pos[s] < p.tenure_before) {
        b = make_gen(kGenIntermediate, 0);
        gen[s] = b;
        atomicAdd(&tenured, 1u);
      }
      if (p.candidates & gen_bit(gen_of(b))) {
        key = sort_key(key_of(p, pos[s], score[s], recent[s]));
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
    if (n_live) atomicAdd(&p.st->live_cls[sp.cls], n_live);
  }
}

// Per sorted candidate: the walk's weight (the key for score keys, at least 0; 1 for
// position and random keys) and its ladder position; a class off the ladder reads as
// evicted (gc.cpp's step 2).
__global__ void prep_kernel(const Params p) {
  const uint64_t n = p.st->n_cand;
  for (uint64_t i = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; i < n; i += uint64_t(gridDim.x) * blockDim.x) {
    const double key = key_value(p.skeys[i]);
    p.weight[i] = (p.key == KeyKind::Score || p.key == KeyKind::Recent) ? (key < 0.0 ? 0.0 : key) : 1.0;
    const int pos = p.position_of[slot_cls(p, p.svals[i])];
    p.at[i] = p.from[i] = uint8_t(pos < 0 ? p.n_ladder : pos);
  }
}

// Per destination run: its slots' places in the class's flat slot list.
__global__ void slots_kernel(const Params p) {
  const uint32_t r = blockIdx.x;
  const int c = run_class(p, r);
  uint32_t flat = p.slot_base[c];
  for (uint32_t q = p.run_first[c]; q < r; ++q) flat += p.runs[q].count;
  for (uint32_t k = threadIdx.x; k < p.runs[r].count; k += blockDim.x) {
    p.slot_run[flat + k] = r;
    p.slot_in[flat + k] = uint16_t(p.runs[r].first_slot + k);
  }
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

// A block per possible demotion (those past the decided count return): each K and V row
// of every head staged in shared memory as the model dtype holds it (the CPU's load_row),
// then quantised into the destination class (int8: the row's scale, then a thread per
// element; int4: a thread per group), metadata copied, the live bits moved.
__global__ void demote_kernel(const Params p) {
  const uint32_t i = blockIdx.x;
  if (i >= p.st->n_dem) return;
  const Demotion dm = p.dem[i];
  const uint32_t g = dm.g, s = g % p.pt;
  uint8_t* src = slot_page(p, g);                 // header: metadata and the live bit
  const uint8_t* src_kv = slot_payload(p, g);     // K/V read from here
  const PageLayout& Ls = p.L[slot_cls(p, g)];
  const PageLayout& Ld = p.L[dm.cls];
  uint8_t* dst = p.runs[p.slot_run[dm.flat]].page;
  const uint32_t d = p.slot_in[dm.flat];
  const uint32_t hd = Ls.head_dim;
  __shared__ float row[kMaxHeadDim];
  __shared__ uint16_t scale;
  for (uint32_t t = 0; t < 2 * Ls.n_kv_heads; ++t) {
    const bool v = t >= Ls.n_kv_heads;
    const uint32_t h = t % Ls.n_kv_heads;
    for (uint32_t e = threadIdx.x; e < hd; e += blockDim.x) row[e] = dev::row_element(src_kv, Ls, h, s, v, e);
    __syncthreads();
    uint8_t* out = dst + (v ? Ld.v_off : Ld.k_off) + h * Ld.head_stride + d * Ld.slot_stride;
    uint16_t* qp = reinterpret_cast<uint16_t*>(dst + (v ? Ld.vq_off : Ld.kq_off)) + Ld.qparam_index(h, d);
    if (Ld.cls == KVGC_CLASS_INT8) {
      if (threadIdx.x == 0) scale = *qp = dev::int8_scale(row, Ld.dtype, hd);
      __syncthreads();
      for (uint32_t e = threadIdx.x; e < hd; e += blockDim.x)
        reinterpret_cast<int8_t*>(out)[e] = dev::int8_quantize(row[e], scale, Ld.dtype);
    } else {
      for (uint32_t grp = threadIdx.x; grp < hd / Ld.group; grp += blockDim.x)
        dev::quantize_group(row, Ld.dtype, Ld.group, grp, out, qp);
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    reinterpret_cast<int32_t*>(dst + Ld.pos_off)[d] = reinterpret_cast<const int32_t*>(src + Ls.pos_off)[s];
    reinterpret_cast<float*>(dst + Ld.score_off)[d] = reinterpret_cast<const float*>(src + Ls.score_off)[s];
    reinterpret_cast<float*>(dst + Ld.recent_off)[d] = reinterpret_cast<const float*>(src + Ls.recent_off)[s];
    dst[Ld.gen_off + d] = src[Ls.gen_off + s];
    atomicOr(reinterpret_cast<uint32_t*>(dst + Ld.live_off) + d / 32, 1u << (d % 32));
    atomicAnd(reinterpret_cast<uint32_t*>(src + Ls.live_off) + s / 32, ~(1u << (s % 32)));
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
  size_t pages, runs, state, page_live, keys0, keys1, vals0, vals1, fate, weight, at, from,
      dem, slot_run, slot_in, cub, end;
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
  c.weight = take(slots * 8);
  c.at = take(slots);
  c.from = take(slots);
  c.dem = take(dem * sizeof(Demotion));
  c.slot_run = take(dem * 4);
  c.slot_in = take(dem * 2);
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
  uint64_t dem = 0;  // slots the runs offer: at most that many demotions
  uint32_t n_runs = 0;
  for (int c = 0; c < KVGC_CLASS_COUNT; ++c) {
    n_runs += op.n_demote_dst[c];
    for (uint32_t i = 0; i < op.n_demote_dst[c]; ++i) dem += op.demote_dst[c][i].count;
  }
  size_t cub_bytes = 0;
  if (cudaError_t e = sort_bytes(slots, &cub_bytes); e != cudaSuccess) return e;
  const Layout c = carve(op.n_pages, n_runs, slots, dem, cub_bytes);
  if (!op.scratch || c.end > op.scratch_bytes) return cudaErrorMemoryAllocation;
  uint8_t* base = static_cast<uint8_t*>(op.scratch);

  Params p{};
  uint32_t run_at = 0, slot_at = 0;
  for (int k = 0; k < KVGC_CLASS_COUNT; ++k) {
    p.L[k] = op.layout[k];
    p.unit_cost[k] = op.unit_cost[k];
    p.position_of[k] = -1;
    p.run_first[k] = run_at;
    p.class_runs[k] = op.n_demote_dst[k];
    run_at += op.n_demote_dst[k];
    p.slot_base[k] = slot_at;
    for (uint32_t i = 0; i < op.n_demote_dst[k]; ++i) slot_at += op.demote_dst[k][i].count;
    p.slot_count[k] = slot_at - p.slot_base[k];
  }
  p.n_ladder = op.n_ladder;
  for (int i = 0; i < 3; ++i) {
    p.ladder[i] = op.ladder[i];
    p.slope[i] = op.slope[i];
  }
  for (uint32_t i = 0; i < op.n_ladder; ++i) p.position_of[op.ladder[i]] = int8_t(i);
  p.pages = reinterpret_cast<const SegPage*>(base + c.pages);
  p.runs = reinterpret_cast<const AppendRun*>(base + c.runs);
  p.n_pages = op.n_pages;
  p.pt = pt;
  p.n_runs = n_runs;
  p.n_slots = slots;
  p.tenure_before = op.tenure_before;
  p.candidates = op.candidates;
  p.key = op.key;
  p.noise = op.noise;
  p.seed = op.seed;
  p.salt = op.segment_salt;
  p.epoch = op.epoch;
  p.reclaim = op.reclaim;
  p.budget_bytes = op.budget_bytes;
  p.promote = op.promote;
  p.promote_age = op.promote_age;
  p.retier = op.retier;
  p.retier_top = op.retier_top;
  p.age_intermediate = op.age_intermediate;
  p.keys = reinterpret_cast<uint64_t*>(base + c.keys0);
  p.vals = reinterpret_cast<uint32_t*>(base + c.vals0);
  p.fate = base + c.fate;
  p.weight = reinterpret_cast<double*>(base + c.weight);
  p.at = base + c.at;
  p.from = base + c.from;
  p.dem = reinterpret_cast<Demotion*>(base + c.dem);
  p.slot_run = reinterpret_cast<uint32_t*>(base + c.slot_run);
  p.slot_in = reinterpret_cast<uint16_t*>(base + c.slot_in);
  p.page_live = reinterpret_cast<uint16_t*>(base + c.page_live);
  p.st = reinterpret_cast<State*>(base + c.state);

#define KVGC_STEP(call)                                  \
  do {                                                   \
    if (cudaError_t e_ = (call); e_ != cudaSuccess) return e_; \
  } while (0)
#define KVGC_LAUNCHED() KVGC_STEP(cudaGetLastError())
  KVGC_STEP(cudaMemcpyAsync(base + c.pages, op.pages, op.n_pages * sizeof(SegPage),
                            cudaMemcpyHostToDevice, stream));
  // The runs of every class, one after the other (they are contiguous in the op's block).
  for (int k = 0, at = 0; k < KVGC_CLASS_COUNT; at += op.n_demote_dst[k++])
    if (op.n_demote_dst[k])
      KVGC_STEP(cudaMemcpyAsync(base + c.runs + at * sizeof(AppendRun), op.demote_dst[k],
                                op.n_demote_dst[k] * sizeof(AppendRun), cudaMemcpyHostToDevice, stream));
  KVGC_STEP(cudaMemsetAsync(p.st, 0, sizeof(State), stream));
  if (n_runs) {
    fresh_kernel<<<n_runs, 256, 0, stream>>>(p);
    KVGC_LAUNCHED();
    slots_kernel<<<n_runs, 128, 0, stream>>>(p);
    KVGC_LAUNCHED();
  }
  keys_kernel<<<op.n_pages, 128, 0, stream>>>(p);
  KVGC_LAUNCHED();
  const bool ordered = op.reclaim > 0 || op.budget_bytes > 0 || op.retier || op.promote > 0;
  cub::DoubleBuffer<uint64_t> keys(p.keys, reinterpret_cast<uint64_t*>(base + c.keys1));
  cub::DoubleBuffer<uint32_t> vals(p.vals, reinterpret_cast<uint32_t*>(base + c.vals1));
  if (ordered) {
    size_t bytes = cub_bytes;
    KVGC_STEP(cub::DeviceRadixSort::SortPairs(base + c.cub, bytes, keys, vals, int64_t(slots), 0,
                                              64, stream));
  }
  p.skeys = keys.Current();
  p.svals = vals.Current();
  if (ordered) {
    prep_kernel<<<uint32_t(std::min<uint64_t>((slots + 255) / 256, 1024)), 256, 0, stream>>>(p);
    KVGC_LAUNCHED();
  }
  KVGC_STEP(launch_decide(p, stream));
  apply_kernel<<<op.n_pages, 128, 0, stream>>>(p);
  KVGC_LAUNCHED();
  if (dem > 0) {
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
