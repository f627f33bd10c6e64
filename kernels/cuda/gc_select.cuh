// Internal to the CUDA select (gc_select.cu, gc_decide.cu): the kernels' shared
// parameter block, the device-side state and small device helpers.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../ops.hpp"

namespace kvgc::cuda::select_detail {

constexpr uint64_t kNotRanked = ~0ull;  // sort key of slots that are not candidates
// kCharged + c: demoted in place (charge_shared), charged at class c; no copy to make.
enum Fate : uint8_t { kSurvivor = 0, kEvicted = 1, kDemoted = 2, kTop = 3, kCharged = 4, kNone = 0xff };
constexpr uint8_t kInPlace = 0x80;  // Params::counted: a demotion only charges it
constexpr int kChunk = 1024;  // decide: entries loaded per round (one per thread)

struct State {
  SelectResult r;  // accumulated on the device, copied back as the op's result
  unsigned long long n_cand;
  unsigned long long live_cls[KVGC_CLASS_COUNT];  // live slots per counted class before the op
  unsigned long long n_dem;                        // demotions listed in dem[] (moves only)
};

// One demotion: the candidate's slot g, and its destination: flat slot `flat` of class
// `cls`'s reserved slots (slot_run / slot_in give the run and the page slot).
struct Demotion {
  uint32_t g, flat;
  uint8_t cls;
};

struct Params {
  PageLayout L[KVGC_CLASS_COUNT];
  const SegPage* pages;  // device copies (scratch)
  const AppendRun* runs;  // every class's destination runs, class 0's first
  uint32_t n_pages, pt, n_runs;
  uint32_t run_first[KVGC_CLASS_COUNT], class_runs[KVGC_CLASS_COUNT];
  uint32_t slot_base[KVGC_CLASS_COUNT], slot_count[KVGC_CLASS_COUNT];  // flat reserved slots
  uint64_t n_slots;
  int64_t tenure_before;
  uint8_t candidates;
  KeyKind key;
  double noise;
  uint64_t seed, salt, epoch;
  uint64_t reclaim, budget_bytes;
  uint64_t unit_cost[KVGC_CLASS_COUNT];
  uint8_t n_ladder, ladder[KVGC_CLASS_COUNT];
  int8_t position_of[KVGC_CLASS_COUNT];  // a class's place on the ladder, -1 off it
  double slope[KVGC_CLASS_COUNT];
  uint32_t promote;
  uint8_t promote_age;
  bool retier, age_intermediate;
  bool charge_shared;  // SelectOp::charge_shared: shared pages' demotions only charge
  uint64_t retier_top;
  uint64_t* keys;         // read order (g), before the sort
  uint32_t* vals;
  uint8_t* fate;          // by g
  double* weight;         // by sorted index: the ladder walk's weight
  uint8_t* at;            // by sorted index: ladder position (n_ladder: evicted)
  uint8_t* from;          // by sorted index: ladder position before the op
  uint8_t* counted;       // by sorted index: the class it counts at, | kInPlace (charge_shared)
  Demotion* dem;          // demotions, at most sum(slot_count)
  uint32_t* slot_run;     // flat reserved slot -> run index
  uint16_t* slot_in;      // flat reserved slot -> slot in that run's page
  uint16_t* page_live;
  uint8_t* page_classes;  // SelectOp::page_classes (or its scratch copy); null: not asked
  State* st;
  // A batch (select_batch): the segment's place in the flat index spaces of the batch's
  // pages, runs, slots and demotions; its sort's other buffers (the sorted arrays are
  // in one or the other, the same for all segments: Batch::sorted_alt); where its
  // result goes when results_mapped (host memory the device writes).
  uint32_t page_base, run_base;
  uint64_t slot_base_flat, dem_base;
  uint64_t* keys_alt;
  uint32_t* vals_alt;
  SelectResult* result_out;  // null: copied back with cudaMemcpyAsync
  bool ordered;
};

// One select_batch launch set: a device array of every segment's Params (their
// pointers already offset into the batch's flat arrays) and the maps from a flat index
// (page, run, demotion) to its segment. Kernels take it by value.
struct Batch {
  const Params* ps;
  const uint32_t* page_seg;  // flat page -> segment
  const uint32_t* run_seg;   // flat run -> segment
  const uint64_t* dem_end;   // per segment: the end of its demotions in the flat space
  uint32_t n_segs, pt;
  uint64_t n_slots, n_dem;
  bool sorted_alt;           // the sort's output is in keys_alt/vals_alt
};

__device__ __forceinline__ const uint32_t* sorted_vals(const Batch& b, const Params& p) {
  return b.sorted_alt ? p.vals_alt : p.vals;
}
__device__ __forceinline__ const uint64_t* sorted_keys(const Batch& b, const Params& p) {
  return b.sorted_alt ? p.keys_alt : p.keys;
}

__device__ __forceinline__ unsigned long long* u64(uint64_t* p) {
  return reinterpret_cast<unsigned long long*>(p);
}

__device__ __forceinline__ uint64_t splitmix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// gc.cpp's laplace, every operation rounded on its own. log() is CUDA's (within 1 ulp
// of the exact value, as glibc's): the noise can differ from the CPU's in its last bit.
__device__ __forceinline__ double laplace(double b, uint64_t h) {
  const double u = __dsub_rn(__ddiv_rn(__dadd_rn(double(h >> 11), 0.5), 9007199254740992.0), 0.5);
  return __dmul_rn(__dmul_rn(-b, u < 0 ? -1.0 : 1.0), log(__dsub_rn(1.0, __dmul_rn(2.0, fabs(u)))));
}

__device__ __forceinline__ double key_of(const Params& p, int32_t pos, float score, float recent) {
  switch (p.key) {
    case KeyKind::Position: return double(pos);
    case KeyKind::Random:
      return double(splitmix(p.seed ^ splitmix(p.salt ^ uint64_t(uint32_t(pos)))) >> 11);
    case KeyKind::Score:
    case KeyKind::Recent:
    default: {
      double k = p.key == KeyKind::Recent ? recent : score;
      if (p.noise > 0)
        k = __dadd_rn(k, laplace(p.noise, splitmix(p.seed ^ splitmix(p.salt ^ splitmix(
                                                      p.epoch ^ (uint64_t(uint32_t(pos)) << 20))))));
      return isnan(k) ? -INFINITY : k;  // rankable()
    }
  }
}

// Order-preserving integer image of a non-NaN double; -0 and +0 map alike (they
// compare equal on the CPU, so the tie goes to (page, slot) there too).
__device__ __forceinline__ uint64_t sort_key(double k) {
  const uint64_t b = uint64_t(__double_as_longlong(k == 0 ? 0.0 : k));
  return b >> 63 ? ~b : b | (1ull << 63);
}
__device__ __forceinline__ double key_value(uint64_t s) {
  return __longlong_as_double(static_cast<long long>(s >> 63 ? s & ~(1ull << 63) : ~s));
}

// Slot g's page header (live bits, metadata) and where its K/V are (payload_of: a
// shared page's are on another page).
__device__ __forceinline__ uint8_t* slot_page(const Params& p, uint32_t g) {
  return p.pages[g / p.pt].page;
}
__device__ __forceinline__ const uint8_t* slot_payload(const Params& p, uint32_t g) {
  return payload_of(p.pages[g / p.pt]);
}
__device__ __forceinline__ uint32_t slot_cls(const Params& p, uint32_t g) {
  return p.pages[g / p.pt].cls;
}
// The class slot g counts at (counted_class: a charged class, else its page's), and
// whether a demotion of it only charges it (gc.cpp's Cand::in_place): Params::counted.
__device__ __forceinline__ uint8_t slot_counted(const Params& p, uint32_t g) {
  const SegPage& sp = p.pages[g / p.pt];
  const uint32_t c = counted_class(sp.page[p.L[sp.cls].gen_off + g % p.pt], sp.cls);
  return uint8_t(c | (p.charge_shared && sp.kv ? kInPlace : 0));
}

// Steps 5 and 6 of select (gc_decide.cu): the ladder walk and the assignment (one
// thread: the CPU's sequential loops), then the top survivors (one block).
// Over a batch: a block per segment for each.
cudaError_t launch_decide(const Batch& b, cudaStream_t stream);

}  // namespace kvgc::cuda::select_detail
