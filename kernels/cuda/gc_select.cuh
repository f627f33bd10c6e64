// Internal to the CUDA select (gc_select.cu, gc_decide.cu): the kernels' shared
// parameter block, the device-side state and small device helpers.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../ops.hpp"

namespace kvgc::cuda::select_detail {

constexpr uint64_t kNotRanked = ~0ull;  // sort key of slots that are not candidates
enum Fate : uint8_t { kSurvivor = 0, kEvicted = 1, kDemoted = 2, kTop = 3, kNone = 0xff };
constexpr int kChunk = 1024;  // decide/sum: entries loaded per round (one per thread)

struct State {
  SelectResult r;  // accumulated on the device, copied back as the op's result
  double key_sum;
  unsigned long long n_cand;
};

struct Params {
  PageLayout L[KVGC_CLASS_COUNT];
  const SegPage* pages;  // device copies (scratch)
  const AppendRun* runs;
  uint32_t n_pages, pt, n_runs;
  uint64_t n_slots;
  int64_t tenure_before;
  uint8_t candidates;
  KeyKind key;
  double noise;
  uint64_t seed, salt, epoch;
  double reclaim, int4_cost, demote_ratio;
  uint32_t promote;
  uint8_t promote_age;
  bool retier, age_intermediate, demote_on;
  uint64_t retier_top;
  uint64_t* keys;         // read order (g), before the sort
  uint32_t* vals;
  const uint64_t* skeys;  // sorted
  const uint32_t* svals;
  uint8_t* fate;          // by g
  uint32_t* dem_src;      // g of the i-th demotion
  uint64_t* dem_dst;      // (run << 16) | int4 slot of the i-th demotion
  uint16_t* page_live;
  State* st;
};

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

__device__ __forceinline__ double key_of(const Params& p, int32_t pos, float score) {
  switch (p.key) {
    case KeyKind::Position: return double(pos);
    case KeyKind::Random:
      return double(splitmix(p.seed ^ splitmix(p.salt ^ uint64_t(uint32_t(pos)))) >> 11);
    case KeyKind::Score:
    default: {
      double k = score;
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

__device__ __forceinline__ uint8_t* slot_page(const Params& p, uint32_t g) {
  return p.pages[g / p.pt].page;
}
__device__ __forceinline__ uint32_t slot_cls(const Params& p, uint32_t g) {
  return p.pages[g / p.pt].cls;
}

// Step 5 of select (gc_decide.cu): one block, the CPU's sequential loops.
cudaError_t launch_decide(const Params& p, cudaStream_t stream);

}  // namespace kvgc::cuda::select_detail
