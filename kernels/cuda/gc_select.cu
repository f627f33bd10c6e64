// CUDA select: the GC's decision op (kernels/cpu/gc.cpp's select is the specification,
// reproduced bit for bit). Over the segment's slots g = page_index * page_tokens + slot
// (read order, dead slots included), on the engine's stream:
//   1. fresh: fresh destination pages (runs from slot 0) are zeroed whole, used or not
//      (they stay in the segment's page tables until the results are applied: scrubbed
//      when taken, as the CPU's select does).
//   2. keys: a block per page tenures young slots that left the window, counts live slots
//      per counted class (a charged class, else the page's), and writes each candidate's
//      key as an order-preserving 64-bit integer (dead slots and other tiers: all ones,
//      so they sort last), its index g, and its fate (survivor / not ranked).
//   3. CUB's stable radix sort of (key, g): the CPU's total order (key, page, slot).
//   4. prep: per sorted candidate, the ladder walk's weight and ladder position; per
//      reserved destination slot, its run and page slot.
//   5. decide (gc_decide.cu): one thread walks the ladder, assigns rungs from the top
//      (monotone, within capacity), meets the byte budget from the bottom and lists the
//      demotions; one block picks the top survivors for promotion or a re-split.
//   6. apply: per slot, clears evicted live bits (and charges), records in-place
//      demotions' charged classes, and sets generations and ages.
//   7. demote: a block per demotion re-stores K and V (through the model dtype) into its
//      slot one or more rungs down, and moves the metadata and the live bit.
//   8. count: per page, live slots, tiers, charge shifts and (when asked) the classes its
//      live slots count at; then page_live, page_classes and the result are copied into
//      the op's host memory (or written there: results_mapped).
// Nothing here waits: the runtime reads the results after an event (runtime/harvest.cpp).
#include <cub/device/device_radix_sort.cuh>
#ifndef KVGC_CUDA_EMU  // the emulation's shim has both sorts in device_radix_sort.cuh
#include <cub/device/device_segmented_radix_sort.cuh>
#endif

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <vector>

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
__global__ void fresh_kernel(const Batch b) {
  const Params& p = b.ps[b.run_seg[blockIdx.x]];
  const uint32_t run = blockIdx.x - p.run_base;
  const AppendRun& r = p.runs[run];
  if (r.first_slot != 0) return;
  uint4* w = reinterpret_cast<uint4*>(r.page);
  for (size_t i = threadIdx.x; i < p.L[run_class(p, run)].bytes / 16; i += blockDim.x)
    w[i] = make_uint4(0, 0, 0, 0);
}

__global__ void keys_kernel(const Batch b) {
  const Params& p = b.ps[b.page_seg[blockIdx.x]];
  const uint32_t page = blockIdx.x - p.page_base;
  const SegPage sp = p.pages[page];
  const PageLayout& L = p.L[sp.cls];
  const uint32_t* live = reinterpret_cast<const uint32_t*>(sp.page + L.live_off);
  const int32_t* pos = reinterpret_cast<const int32_t*>(sp.page + L.pos_off);
  const float* score = reinterpret_cast<const float*>(sp.page + L.score_off);
  const float* recent = reinterpret_cast<const float*>(sp.page + L.recent_off);
  uint8_t* gen = sp.page + L.gen_off;
  __shared__ unsigned int tenured, cands, n_live[KVGC_CLASS_COUNT];
  if (threadIdx.x == 0) {
    tenured = cands = 0;
    for (int c = 0; c < KVGC_CLASS_COUNT; ++c) n_live[c] = 0;
  }
  __syncthreads();
  for (uint32_t s = threadIdx.x; s < p.pt; s += blockDim.x) {
    const uint32_t g = page * p.pt + s;
    uint64_t key = kNotRanked;
    uint8_t fate = kNone;
    if (live[s / 32] >> (s % 32) & 1u) {
      uint8_t b = gen[s];
      atomicAdd(&n_live[counted_class(b, sp.cls)], 1u);
      if (gen_of(b) == kGenYoung && pos[s] < p.tenure_before) {
        b = make_gen(kGenIntermediate, 0, b);
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
    for (int c = 0; c < KVGC_CLASS_COUNT; ++c)
      if (n_live[c]) atomicAdd(&p.st->live_cls[c], n_live[c]);
  }
}

// Per sorted candidate: the walk's weight (the key for score keys, at least 0; 1 for
// position and random keys), its counted class (and whether it is demoted in place) and
// that class's ladder position; a class off the ladder reads as evicted (gc.cpp's step 2).
// Over the batch's flat slots: a segment's candidates are the first n_cand of its range.
__global__ void prep_kernel(const Batch b) {
  for (uint64_t f = blockIdx.x * uint64_t(blockDim.x) + threadIdx.x; f < b.n_slots;
       f += uint64_t(gridDim.x) * blockDim.x) {
    const Params& p = b.ps[b.page_seg[f / b.pt]];
    const uint64_t i = f - p.slot_base_flat;
    if (i >= p.st->n_cand) continue;
    const double key = key_value(sorted_keys(b, p)[i]);
    p.weight[i] = (p.key == KeyKind::Score || p.key == KeyKind::Recent) ? (key < 0.0 ? 0.0 : key) : 1.0;
    const uint8_t counted = slot_counted(p, sorted_vals(b, p)[i]);
    const int pos = p.position_of[counted & 3];
    p.at[i] = p.from[i] = uint8_t(pos < 0 ? p.n_ladder : pos);
    p.counted[i] = counted;  // the walk's single thread reads it in sorted order
  }
}

// Per destination run: its slots' places in the class's flat slot list.
__global__ void slots_kernel(const Batch b) {
  const Params& p = b.ps[b.run_seg[blockIdx.x]];
  const uint32_t r = blockIdx.x - p.run_base;
  const int c = run_class(p, r);
  uint32_t flat = p.slot_base[c];
  for (uint32_t q = p.run_first[c]; q < r; ++q) flat += p.runs[q].count;
  for (uint32_t k = threadIdx.x; k < p.runs[r].count; k += blockDim.x) {
    p.slot_run[flat + k] = r;
    p.slot_in[flat + k] = uint16_t(p.runs[r].first_slot + k);
  }
}

// Per slot, after decide: evictions clear live bits and charges; in-place demotions
// record their charged class; survivors get their new generation (promotion or
// re-split) and age, keeping their charge, as gc.cpp's steps 6 and 7.
__global__ void apply_kernel(const Batch b) {
  const Params& p = b.ps[b.page_seg[blockIdx.x]];
  const uint32_t page = blockIdx.x - p.page_base;
  const SegPage sp = p.pages[page];
  const PageLayout& L = p.L[sp.cls];
  uint32_t* live = reinterpret_cast<uint32_t*>(sp.page + L.live_off);
  uint8_t* gen = sp.page + L.gen_off;
  __shared__ unsigned int promoted, eligible;
  if (threadIdx.x == 0) promoted = eligible = 0;
  __syncthreads();
  for (uint32_t s = threadIdx.x; s < p.pt; s += blockDim.x) {
    const uint8_t f = p.fate[page * p.pt + s];
    if (f == kNone || f == kDemoted) continue;  // demote_kernel moves the demoted
    if (f == kEvicted) {
      atomicAnd(&live[s / 32], ~(1u << (s % 32)));
      gen[s] = make_gen(gen_of(gen[s]), age_of(gen[s]));
      continue;
    }
    if (f >= kCharged) {
      gen[s] = with_charged(gen[s], uint32_t(f - kCharged));
      continue;
    }
    uint8_t b = gen[s];
    if (p.retier) {
      const bool lt = f == kTop;
      if (lt && gen_of(b) != kGenLongTerm) atomicAdd(&promoted, 1u);
      b = make_gen(lt ? kGenLongTerm : kGenIntermediate, age_of(b), b);
    } else if (p.promote > 0 || p.age_intermediate) {
      if (f == kTop) {
        b = make_gen(kGenLongTerm, 0, b);
        atomicAdd(&promoted, 1u);
      } else if (gen_of(b) == kGenIntermediate && age_of(b) >= p.promote_age) {
        atomicAdd(&eligible, 1u);
      }
    }
    if (p.age_intermediate && gen_of(b) == kGenIntermediate)
      b = make_gen(kGenIntermediate, uint8_t(age_of(b) + 1), b);
    gen[s] = b;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    if (promoted) atomicAdd(u64(&p.st->r.promoted), promoted);
    if (eligible) atomicAdd(u64(&p.st->r.promote_eligible), eligible);
  }
}

// A block per possible demotion (those past the decided count return): each K and V row
// of every head re-stored by dev::restore_row (staged in shared memory as the model dtype
// holds it, the CPU's load_row, then quantised into the destination class: int8 the
// row's scale, then a thread per element; int4 and int2 a thread per group; gc.cu's
// requant shares it), metadata copied, the live bits moved.
// Over the batch's flat demotion space (each segment's at most its reserved slots).
__global__ void demote_kernel(const Batch b) {
  uint32_t lo = 0, hi = b.n_segs - 1;  // the segment whose range holds this block
  while (lo < hi) {
    const uint32_t mid = (lo + hi) / 2;
    if (b.dem_end[mid] <= blockIdx.x) lo = mid + 1;
    else hi = mid;
  }
  const Params& p = b.ps[lo];
  const uint64_t i = blockIdx.x - p.dem_base;
  if (i >= p.st->n_dem) return;
  const Demotion dm = p.dem[i];
  const uint32_t g = dm.g, s = g % p.pt;
  uint8_t* src = slot_page(p, g);                 // header: metadata and the live bit
  const uint8_t* src_kv = slot_payload(p, g);     // K/V read from here
  const PageLayout& Ls = p.L[slot_cls(p, g)];
  const PageLayout& Ld = p.L[dm.cls];
  uint8_t* dst = p.runs[p.slot_run[dm.flat]].page;
  const uint32_t d = p.slot_in[dm.flat];
  __shared__ float row[kMaxHeadDim];
  __shared__ uint16_t scale;
  for (uint32_t t = 0; t < 2 * Ls.n_kv_heads; ++t)
    dev::restore_row(src_kv, Ls, s, dst, Ld, d, t % Ls.n_kv_heads, t >= Ls.n_kv_heads, row, &scale);
  if (threadIdx.x == 0) {
    reinterpret_cast<int32_t*>(dst + Ld.pos_off)[d] = reinterpret_cast<const int32_t*>(src + Ls.pos_off)[s];
    reinterpret_cast<float*>(dst + Ld.score_off)[d] = reinterpret_cast<const float*>(src + Ls.score_off)[s];
    reinterpret_cast<float*>(dst + Ld.recent_off)[d] = reinterpret_cast<const float*>(src + Ls.recent_off)[s];
    const uint8_t g0 = src[Ls.gen_off + s];
    dst[Ld.gen_off + d] = make_gen(gen_of(g0), age_of(g0));  // a copy counts at its own class
    atomicOr(reinterpret_cast<uint32_t*>(dst + Ld.live_off) + d / 32, 1u << (d % 32));
    atomicAnd(reinterpret_cast<uint32_t*>(src + Ls.live_off) + s / 32, ~(1u << (s % 32)));
  }
}

// Per page: live slots (page_live), the classes its live tokens count at (page_classes,
// when asked for: bit counted_class), the tiers and classes of the live tokens, and the
// net shift of the charged ones (+1 their charged class, -1 the page's).
__global__ void count_kernel(const Batch b) {
  const Params& p = b.ps[b.page_seg[blockIdx.x]];
  const uint32_t page = blockIdx.x - p.page_base;
  const SegPage sp = p.pages[page];
  const PageLayout& L = p.L[sp.cls];
  const uint32_t* live = reinterpret_cast<const uint32_t*>(sp.page + L.live_off);
  __shared__ unsigned int tier[4], charged[4], classes;
  if (threadIdx.x < 4) tier[threadIdx.x] = charged[threadIdx.x] = 0;
  if (threadIdx.x == 0) classes = 0;
  __syncthreads();
  for (uint32_t s = threadIdx.x; s < p.pt; s += blockDim.x)
    if (live[s / 32] >> (s % 32) & 1u) {
      const uint8_t g = sp.page[L.gen_off + s];
      atomicAdd(&tier[gen_of(g)], 1u);
      if (charged_of(g)) atomicAdd(&charged[charged_of(g)], 1u);
      atomicOr(&classes, 1u << counted_class(g, sp.cls));
    }
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned int n = tier[0] + tier[1] + tier[2] + tier[3];
    p.page_live[page] = uint16_t(n);
    if (p.page_classes) p.page_classes[page] = uint8_t(classes);
    if (n) atomicAdd(u64(&p.st->r.live[sp.cls]), n);
    for (int t = 0; t < 4; ++t)
      if (tier[t]) atomicAdd(u64(&p.st->r.tier[t]), tier[t]);
    for (int c = 1; c < KVGC_CLASS_COUNT; ++c)  // two's complement: an unsigned add of -k subtracts k
      if (charged[c]) {
        atomicAdd(reinterpret_cast<unsigned long long*>(&p.st->r.shift[c]), charged[c]);
        atomicAdd(reinterpret_cast<unsigned long long*>(&p.st->r.shift[sp.cls]), 0ull - charged[c]);
      }
  }
}

// Per segment whose results the device writes directly (SelectOp::results_mapped): the
// SelectResult, once every count block has added to it.
__global__ void result_kernel(const Batch b) {
  const uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= b.n_segs) return;
  const Params& p = b.ps[i];
  if (p.result_out) *p.result_out = p.st->r;
}

// Scratch carving for a batch of segments, in the order select uses it; every piece
// 256-byte aligned. The first pieces (Params through runs) are what the host uploads, in
// one copy from the staging block, which is laid out the same way.
struct Totals {
  uint64_t segs = 0, pages = 0, runs = 0, slots = 0, dem = 0;
};
struct Layout {
  size_t params, page_seg, run_seg, dem_end, seg_begin, seg_end, pages, runs, upload_end;
  size_t state, page_live, page_classes, keys0, keys1, vals0, vals1, fate, weight, at, from, counted, dem,
      slot_run, slot_in, cub, end;
};
Layout carve(const Totals& t, size_t cub_bytes) {
  Layout c{};
  size_t off = 0;
  auto take = [&](size_t bytes) {
    const size_t at = off;
    off = align_up(off + bytes, 256);
    return at;
  };
  c.params = take(t.segs * sizeof(Params));
  c.page_seg = take(t.pages * 4);
  c.run_seg = take(t.runs * 4);
  c.dem_end = take(t.segs * 8);
  c.seg_begin = take(t.segs * 4);
  c.seg_end = take(t.segs * 4);
  c.pages = take(t.pages * sizeof(SegPage));
  c.runs = take(t.runs * sizeof(AppendRun));
  c.upload_end = off;
  c.state = take(t.segs * sizeof(State));
  c.page_live = take(t.pages * sizeof(uint16_t));
  c.page_classes = take(t.pages);
  c.keys0 = take(t.slots * 8);
  c.keys1 = take(t.slots * 8);
  c.vals0 = take(t.slots * 4);
  c.vals1 = take(t.slots * 4);
  c.fate = take(t.slots);
  c.weight = take(t.slots * 8);
  c.at = take(t.slots);
  c.from = take(t.slots);
  c.counted = take(t.slots);
  c.dem = take(t.dem * sizeof(Demotion));
  c.slot_run = take(t.dem * 4);
  c.slot_in = take(t.dem * 2);
  c.cub = take(cub_bytes);
  c.end = off;
  return c;
}

// CUB's temporary storage: one segment sorts with DeviceRadixSort (today's single
// select, the fastest for one long segment), several with DeviceSegmentedRadixSort (a
// constant number of launches whatever their number; stable, as the CPU's order needs).
cudaError_t sort_bytes(uint64_t slots, uint64_t segs, size_t* bytes) {
  cub::DoubleBuffer<uint64_t> k(nullptr, nullptr);
  cub::DoubleBuffer<uint32_t> v(nullptr, nullptr);
  *bytes = 0;
  if (segs <= 1) return cub::DeviceRadixSort::SortPairs(nullptr, *bytes, k, v, int64_t(slots), 0, 64);
  const int* none = nullptr;
  return cub::DeviceSegmentedRadixSort::SortPairs(nullptr, *bytes, k, v, int(slots), int(segs), none,
                                                  none, 0, 64);
}

// Segments the batch sizes its scratch for (gc_scratch_bytes): more than that in one step
// run in several launch sets (select_batch's chunks).
constexpr uint64_t kScratchSegs = 1024;

// One op's sizes.
struct OpSize {
  uint64_t pages, runs, slots, dem;
};
OpSize size_of(const SelectOp& op) {
  OpSize z{op.n_pages, 0, uint64_t(op.n_pages) * op.layout[KVGC_CLASS_FP16].page_tokens, 0};
  for (int c = 0; c < KVGC_CLASS_COUNT; ++c) {
    z.runs += op.n_demote_dst[c];
    for (uint32_t i = 0; i < op.n_demote_dst[c]; ++i) z.dem += op.demote_dst[c][i].count;
  }
  return z;
}
bool ordered_op(const SelectOp& op) {
  return op.reclaim > 0 || op.budget_bytes > 0 || op.retier || op.promote > 0;
}

Params params_of(const SelectOp& op, const OpSize& z) {
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
  for (int i = 0; i < KVGC_CLASS_COUNT; ++i) {
    p.ladder[i] = op.ladder[i];
    p.slope[i] = op.slope[i];
  }
  for (uint32_t i = 0; i < op.n_ladder; ++i) p.position_of[op.ladder[i]] = int8_t(i);
  p.n_pages = op.n_pages;
  p.pt = op.layout[KVGC_CLASS_FP16].page_tokens;
  p.n_runs = uint32_t(z.runs);
  p.n_slots = z.slots;
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
  p.charge_shared = op.charge_shared;
  p.ordered = ordered_op(op);
  return p;
}

// Enqueues ops[0, n) (none of them empty) as one launch set over `base`, the scratch;
// `stage` is host memory of at least the layout's upload_end bytes that stays untouched
// until the upload has run (pinned: the copy never waits; pageable: the copy returns
// once it has staged the bytes).
cudaError_t launch_set(const SelectOp* ops, const OpSize* sizes, uint32_t n, const Totals& t,
                       const Layout& c, size_t cub_bytes, uint8_t* base, uint8_t* stage,
                       cudaStream_t stream) {
#define KVGC_STEP(call)                                        \
  do {                                                         \
    if (cudaError_t e_ = (call); e_ != cudaSuccess) return e_; \
  } while (0)
#define KVGC_LAUNCHED() KVGC_STEP(cudaGetLastError())
  const uint32_t pt = ops[0].layout[KVGC_CLASS_FP16].page_tokens;
  Params* ps = reinterpret_cast<Params*>(stage + c.params);
  uint32_t* page_seg = reinterpret_cast<uint32_t*>(stage + c.page_seg);
  uint32_t* run_seg = reinterpret_cast<uint32_t*>(stage + c.run_seg);
  uint64_t* dem_end = reinterpret_cast<uint64_t*>(stage + c.dem_end);
  int* seg_begin = reinterpret_cast<int*>(stage + c.seg_begin);
  int* seg_end = reinterpret_cast<int*>(stage + c.seg_end);
  SegPage* pages = reinterpret_cast<SegPage*>(stage + c.pages);
  AppendRun* runs = reinterpret_cast<AppendRun*>(stage + c.runs);
  bool ordered = false, copies = false;
  uint64_t page_at = 0, run_at = 0, slot_at = 0, dem_at = 0;
  for (uint32_t s = 0; s < n; ++s) {
    const SelectOp& op = ops[s];
    const OpSize& z = sizes[s];
    Params p = params_of(op, z);
    ordered |= p.ordered;
    p.page_base = uint32_t(page_at);
    p.run_base = uint32_t(run_at);
    p.slot_base_flat = slot_at;
    p.dem_base = dem_at;
    p.pages = reinterpret_cast<const SegPage*>(base + c.pages) + page_at;
    p.runs = reinterpret_cast<const AppendRun*>(base + c.runs) + run_at;
    p.st = reinterpret_cast<State*>(base + c.state) + s;
    p.keys = reinterpret_cast<uint64_t*>(base + c.keys0) + slot_at;
    p.keys_alt = reinterpret_cast<uint64_t*>(base + c.keys1) + slot_at;
    p.vals = reinterpret_cast<uint32_t*>(base + c.vals0) + slot_at;
    p.vals_alt = reinterpret_cast<uint32_t*>(base + c.vals1) + slot_at;
    p.fate = base + c.fate + slot_at;
    p.weight = reinterpret_cast<double*>(base + c.weight) + slot_at;
    p.at = base + c.at + slot_at;
    p.from = base + c.from + slot_at;
    p.counted = base + c.counted + slot_at;
    p.dem = reinterpret_cast<Demotion*>(base + c.dem) + dem_at;
    p.slot_run = reinterpret_cast<uint32_t*>(base + c.slot_run) + dem_at;
    p.slot_in = reinterpret_cast<uint16_t*>(base + c.slot_in) + dem_at;
    // Mapped results are written where the runtime reads them; others land in the
    // scratch and are copied back below.
    p.page_live = op.results_mapped ? op.page_live : reinterpret_cast<uint16_t*>(base + c.page_live) + page_at;
    p.page_classes = !op.page_classes    ? nullptr
                     : op.results_mapped ? op.page_classes
                                         : base + c.page_classes + page_at;
    p.result_out = op.results_mapped ? op.result : nullptr;
    copies |= !op.results_mapped;
    ps[s] = p;
    std::copy(op.pages, op.pages + op.n_pages, pages + page_at);
    std::fill(page_seg + page_at, page_seg + page_at + z.pages, s);
    for (int k = 0; k < KVGC_CLASS_COUNT; ++k)  // every class's runs, one after the other
      if (op.n_demote_dst[k]) {
        std::copy(op.demote_dst[k], op.demote_dst[k] + op.n_demote_dst[k], runs + run_at);
        std::fill(run_seg + run_at, run_seg + run_at + op.n_demote_dst[k], s);
        run_at += op.n_demote_dst[k];
      }
    seg_begin[s] = int(slot_at);
    seg_end[s] = int(slot_at + z.slots);
    page_at += z.pages;
    slot_at += z.slots;
    dem_at += z.dem;
    dem_end[s] = dem_at;
  }
  Batch b{};
  b.ps = reinterpret_cast<const Params*>(base + c.params);
  b.page_seg = reinterpret_cast<const uint32_t*>(base + c.page_seg);
  b.run_seg = reinterpret_cast<const uint32_t*>(base + c.run_seg);
  b.dem_end = reinterpret_cast<const uint64_t*>(base + c.dem_end);
  b.n_segs = n;
  b.pt = pt;
  b.n_slots = t.slots;
  b.n_dem = t.dem;

  KVGC_STEP(cudaMemcpyAsync(base, stage, c.upload_end, cudaMemcpyHostToDevice, stream));
  KVGC_STEP(cudaMemsetAsync(base + c.state, 0, n * sizeof(State), stream));
  if (t.runs) {
    fresh_kernel<<<uint32_t(t.runs), 256, 0, stream>>>(b);
    KVGC_LAUNCHED();
    slots_kernel<<<uint32_t(t.runs), 128, 0, stream>>>(b);
    KVGC_LAUNCHED();
  }
  keys_kernel<<<uint32_t(t.pages), 128, 0, stream>>>(b);
  KVGC_LAUNCHED();
  if (ordered) {  // sorts every segment (unordered ones are never read in sorted order)
    cub::DoubleBuffer<uint64_t> keys(reinterpret_cast<uint64_t*>(base + c.keys0),
                                     reinterpret_cast<uint64_t*>(base + c.keys1));
    cub::DoubleBuffer<uint32_t> vals(reinterpret_cast<uint32_t*>(base + c.vals0),
                                     reinterpret_cast<uint32_t*>(base + c.vals1));
    size_t bytes = cub_bytes;
    if (n == 1)
      KVGC_STEP(cub::DeviceRadixSort::SortPairs(base + c.cub, bytes, keys, vals, int64_t(t.slots), 0,
                                                64, stream));
    else
      KVGC_STEP(cub::DeviceSegmentedRadixSort::SortPairs(
          base + c.cub, bytes, keys, vals, int(t.slots), int(n),
          reinterpret_cast<const int*>(base + c.seg_begin), reinterpret_cast<const int*>(base + c.seg_end),
          0, 64, stream));
    b.sorted_alt = keys.selector != 0;
    prep_kernel<<<uint32_t(std::min<uint64_t>((t.slots + 255) / 256, 1024)), 256, 0, stream>>>(b);
    KVGC_LAUNCHED();
  }
  KVGC_STEP(launch_decide(b, stream));
  apply_kernel<<<uint32_t(t.pages), 128, 0, stream>>>(b);
  KVGC_LAUNCHED();
  if (t.dem > 0) {
    demote_kernel<<<uint32_t(t.dem), 128, 0, stream>>>(b);
    KVGC_LAUNCHED();
  }
  count_kernel<<<uint32_t(t.pages), 128, 0, stream>>>(b);
  KVGC_LAUNCHED();
  if (copies < n) {  // at least one mapped result
    result_kernel<<<(n + 127) / 128, 128, 0, stream>>>(b);
    KVGC_LAUNCHED();
  }
  if (copies) {  // ops whose results are not device-writable: a copy each
    uint64_t at = 0;
    for (uint32_t s = 0; s < n; ++s) {
      const SelectOp& op = ops[s];
      if (!op.results_mapped) {
        KVGC_STEP(cudaMemcpyAsync(op.page_live, base + c.page_live + at * sizeof(uint16_t),
                                  op.n_pages * sizeof(uint16_t), cudaMemcpyDeviceToHost, stream));
        if (op.page_classes)
          KVGC_STEP(cudaMemcpyAsync(op.page_classes, base + c.page_classes + at, op.n_pages,
                                    cudaMemcpyDeviceToHost, stream));
        KVGC_STEP(cudaMemcpyAsync(op.result, &(reinterpret_cast<State*>(base + c.state) + s)->r,
                                  sizeof(SelectResult), cudaMemcpyDeviceToHost, stream));
      }
      at += op.n_pages;
    }
  }
#undef KVGC_LAUNCHED
#undef KVGC_STEP
  return cudaSuccess;
}

}  // namespace

size_t gc_scratch_bytes(uint64_t max_slots, uint32_t page_tokens) {
  // A batch of up to kScratchSegs segments (at most one per page) holding max_slots
  // slots in all: the per-slot arrays as for one segment (with the sort's storage, about
  // 55 bytes a slot), plus each segment's Params and State (about 600 bytes) and a 4-byte
  // segment index a page, plus the larger of the two sorts' temporary storage.
  const uint64_t pages = max_slots / std::max(page_tokens, 1u) + 2;
  const uint64_t segs = std::min<uint64_t>(kScratchSegs, pages);
  size_t one = 0, many = 0;
  if (sort_bytes(max_slots, 1, &one) != cudaSuccess || sort_bytes(max_slots, segs, &many) != cudaSuccess) {
    cudaGetLastError();
    one = max_slots * 16 + (4u << 20);  // a generous stand-in; select re-checks
  }
  Totals t{segs, pages, pages, max_slots, max_slots};
  return carve(t, std::max(one, many)).end + (64u << 10);
}

cudaError_t select_batch(const SelectOp* ops, uint32_t n, SelectStaging& stage, cudaStream_t stream,
                         uint32_t* launched) {
  *launched = 0;
  if (n == 0) return cudaSuccess;
  struct Set {
    uint32_t begin, end;
    Totals t;
    size_t cub;
    Layout c;
  };
  thread_local std::vector<OpSize> sizes;
  thread_local std::vector<Set> sets;
  sizes.resize(n);
  sets.clear();
  for (uint32_t i = 0; i < n; ++i) {
    sizes[i] = size_of(ops[i]);
    if (sizes[i].slots > UINT32_MAX) return cudaErrorNotSupported;
  }
  const size_t scratch_bytes = ops[0].scratch ? ops[0].scratch_bytes : 0;
  // Whether ops[i, j) fit one launch set; its totals and carving if so.
  auto fits = [&](uint32_t i, uint32_t j, Set* s) -> cudaError_t {
    Totals t;
    for (uint32_t k = i; k < j; ++k) {
      t.segs += 1;
      t.pages += sizes[k].pages;
      t.runs += sizes[k].runs;
      t.slots += sizes[k].slots;
      t.dem += sizes[k].dem;
    }
    s->begin = i;
    s->end = i;  // not yet: end = j once it fits
    if (t.slots > INT32_MAX || t.pages > INT32_MAX || t.dem > INT32_MAX) return cudaSuccess;
    size_t cub = 0;
    if (cudaError_t e = sort_bytes(t.slots, t.segs, &cub); e != cudaSuccess) return e;
    const Layout c = carve(t, cub);
    if (c.end > scratch_bytes) return cudaSuccess;
    *s = Set{i, j, t, cub, c};
    return cudaSuccess;
  };
  // The launch sets: the whole batch when the scratch holds it (the configuration the
  // heap sizes its scratch for), else as many consecutive segments as fit, in order.
  uint32_t failed = n;  // the first op no scratch can hold alone
  for (uint32_t i = 0; i < n;) {
    Set s{};
    if (cudaError_t e = fits(i, n, &s); e != cudaSuccess) return e;
    if (s.end == s.begin)  // not all: the longest run from i that fits
      for (uint32_t j = i + 1; j < n; ++j) {
        Set next{};
        if (cudaError_t e = fits(i, j, &next); e != cudaSuccess) return e;
        if (next.end == next.begin) break;
        s = next;
      }
    if (s.end == s.begin) {
      failed = i;
      break;
    }
    sets.push_back(s);
    i = s.end;
  }
#ifdef KVGC_CUDA_EMU
  emu::select_sets += sets.size();  // the emulation's tests check that batches split
#endif
  size_t staging = 0;  // the sets' uploads, one after the other
  for (const Set& s : sets) staging += s.c.upload_end;
  if (cudaError_t e = stage.reserve(staging); e != cudaSuccess) return e;
  uint8_t* host = static_cast<uint8_t*>(stage.host);
  for (const Set& s : sets) {
    if (s.t.pages == 0) {  // nothing to select: empty results, as select gives
      for (uint32_t k = s.begin; k < s.end; ++k) *ops[k].result = SelectResult{};
    } else {
      const cudaError_t e = launch_set(ops + s.begin, sizes.data() + s.begin, s.end - s.begin, s.t,
                                       s.c, s.cub, static_cast<uint8_t*>(ops[0].scratch), host, stream);
      if (e != cudaSuccess) {
        (void)stage.recorded(stream);
        return e;
      }
      host += s.c.upload_end;
    }
    *launched = s.end;
  }
  if (cudaError_t e = stage.recorded(stream); e != cudaSuccess) return e;
  return failed < n ? cudaErrorMemoryAllocation : cudaSuccess;
}

// The staging block of select_batch's uploads (gc.cuh).
SelectStaging::~SelectStaging() {
  if (ready) cudaEventDestroy(ready);
  if (host) pinned ? (void)cudaFreeHost(host) : std::free(host);
}

cudaError_t SelectStaging::reserve(size_t want) {
  if (pinned && in_flight) {  // the previous batch's upload reads it: long done, usually
    if (cudaError_t e = cudaEventSynchronize(ready); e != cudaSuccess) return e;
    in_flight = false;
  }
  if (want <= bytes) return cudaSuccess;
  want = std::max(want, 2 * bytes);
  if (host) pinned ? (void)cudaFreeHost(host) : std::free(host);
  host = nullptr;
  bytes = 0;
  if (pinned) {
    if (cudaError_t e = cudaMallocHost(&host, want); e != cudaSuccess) return e;
  } else if (!(host = std::malloc(want))) {
    return cudaErrorMemoryAllocation;
  }
  bytes = want;
  return cudaSuccess;
}

cudaError_t SelectStaging::recorded(cudaStream_t stream) {
  if (!pinned) return cudaSuccess;  // pageable: each copy staged its bytes before returning
  if (!ready)
    if (cudaError_t e = cudaEventCreateWithFlags(&ready, cudaEventDisableTiming); e != cudaSuccess) return e;
  if (cudaError_t e = cudaEventRecord(ready, stream); e != cudaSuccess) return e;
  in_flight = true;
  return cudaSuccess;
}

size_t select_scratch_bytes(const SelectOp& op) {
  const OpSize z = size_of(op);
  const Totals t{1, z.pages, z.runs, z.slots, z.dem};
  size_t cub = 0;
  if (sort_bytes(z.slots, 1, &cub) != cudaSuccess) return SIZE_MAX;
  return carve(t, cub).end;
}

cudaError_t select(const SelectOp& op, cudaStream_t stream) {
  thread_local SelectStaging stage(false);  // pageable: tests call this directly
  uint32_t launched = 0;
  return select_batch(&op, 1, stage, stream, &launched);
}

}  // namespace kvgc::cuda
