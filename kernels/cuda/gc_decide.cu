// Step 5 of the CUDA select: the decisions gc.cpp's select takes in sequential loops,
// taken in the same order by one thread so that every floating-point sum (reclaimed)
// and every stopping point are the CPU's. One block of kChunk threads: each round, all
// threads load a chunk of the sorted candidates (index, class, what the loop needs) into
// shared memory, then thread 0 walks it.
//
//   demotion:  from the first key >= threshold (ratio x key_sum / candidates) upward,
//              fp16 slots only, while reclaimed < reclaim and int4 slots remain
//   eviction:  from the lowest upward, skipping the demoted, while reclaimed < reclaim
//              (and within `order` candidates when not demoting, as the CPU's partial
//              sort)
//   top:       from the highest downward among survivors: a major GC's top retier_top
//              (long-term), or a minor GC's first `promote` eligible (intermediate, age
//              >= promote_age) — the sets gc.cpp's nth_element calls pick
// Decisions land in fate[] (by slot) and the demotion list; apply/demote kernels act.
#include <cstdint>

#include "gc_select.cuh"

namespace kvgc::cuda::select_detail {
namespace {

__global__ void __launch_bounds__(kChunk) decide_kernel(const Params p) {
  __shared__ uint32_t g_of[kChunk];
  __shared__ uint8_t info[kChunk];
  __shared__ bool done;
  __shared__ uint64_t first, need;
  const bool lead = threadIdx.x == 0;
  const uint64_t n = p.st->n_cand;
  double reclaimed = 0;  // thread 0's, as are the counts
  uint64_t demoted = 0, evicted = 0;
  constexpr uint8_t kFp16 = 1, kVictim = 2;

  if (p.reclaim > 0 && n > 0) {
    uint64_t order = n;  // the CPU sorts only the `order` lowest when not demoting
    if (!p.demote_on) {
      const double floor_cost = 1.0 < p.int4_cost ? 1.0 : p.int4_cost;  // std::min
      const double want = ceil(p.reclaim / floor_cost) + 1;
      order = want >= double(n) ? n : uint64_t(want);
    }
    if (p.demote_on) {
      if (lead) {
        const double threshold = p.demote_ratio * p.st->key_sum / double(n);
        uint64_t lo = 0, hi = n;  // std::lower_bound with key < threshold
        while (lo < hi) {
          const uint64_t mid = lo + (hi - lo) / 2;
          if (key_value(p.skeys[mid]) < threshold) lo = mid + 1;
          else hi = mid;
        }
        first = lo;
        done = false;
      }
      __syncthreads();
      uint32_t run = 0, in_run = 0, run_count = p.n_runs ? p.runs[0].count : 0;
      for (uint64_t base = first; base < order; base += kChunk) {
        const uint64_t i = base + threadIdx.x;
        if (i < order) {
          const uint32_t g = p.svals[i];
          g_of[threadIdx.x] = g;
          info[threadIdx.x] = slot_cls(p, g) == KVGC_CLASS_FP16 ? kFp16 : 0;
        }
        __syncthreads();
        if (lead) {
          const uint64_t len = order - base < kChunk ? order - base : kChunk;
          for (uint64_t j = 0; j < len; ++j) {
            if (!(reclaimed < p.reclaim && run < p.n_runs)) {
              done = true;
              break;
            }
            if (!(info[j] & kFp16)) continue;
            const uint32_t g = g_of[j];
            p.dem_src[demoted] = g;
            p.dem_dst[demoted] = uint64_t(run) << 16 | (p.runs[run].first_slot + in_run);
            p.fate[g] = kDemoted;
            if (++in_run == run_count) {
              ++run;
              in_run = 0;
              run_count = run < p.n_runs ? p.runs[run].count : 0;
            }
            ++demoted;
            reclaimed += 1.0 - p.int4_cost;
          }
        }
        __syncthreads();
        if (done) break;
      }
      __syncthreads();
    }
    if (lead) done = false;
    __syncthreads();
    for (uint64_t base = 0; base < order; base += kChunk) {
      const uint64_t i = base + threadIdx.x;
      if (i < order) {
        const uint32_t g = p.svals[i];
        g_of[threadIdx.x] = g;
        info[threadIdx.x] = uint8_t((slot_cls(p, g) == KVGC_CLASS_FP16 ? kFp16 : 0) |
                                    (p.fate[g] == kSurvivor ? 0 : kVictim));
      }
      __syncthreads();
      if (lead) {
        const uint64_t len = order - base < kChunk ? order - base : kChunk;
        for (uint64_t j = 0; j < len; ++j) {
          if (!(reclaimed < p.reclaim)) {
            done = true;
            break;
          }
          if (info[j] & kVictim) continue;
          p.fate[g_of[j]] = kEvicted;
          reclaimed += (info[j] & kFp16) ? 1.0 : p.int4_cost;
          ++evicted;
        }
      }
      __syncthreads();
      if (done) break;
    }
    __syncthreads();
  }

  // Survivors ranked from the top: a major GC re-splits, a minor GC promotes.
  if (lead) {
    need = 0;
    if (p.retier) {
      const uint64_t rest = n - demoted - evicted;
      need = rest < p.retier_top ? rest : p.retier_top;
    } else if (p.promote > 0) {
      need = p.promote;
    }
    done = false;
  }
  __syncthreads();
  uint64_t marked = 0;
  for (uint64_t top = n; need > 0 && top > 0;) {
    const uint64_t lo = top > kChunk ? top - kChunk : 0, len = top - lo;
    if (threadIdx.x < len) {
      const uint32_t g = p.svals[lo + threadIdx.x];
      g_of[threadIdx.x] = g;
      bool pick = p.fate[g] == kSurvivor;
      if (pick && !p.retier) {
        const SegPage& sp = p.pages[g / p.pt];
        const uint8_t b = sp.page[p.L[sp.cls].gen_off + g % p.pt];
        pick = gen_of(b) == kGenIntermediate && age_of(b) >= p.promote_age;
      }
      info[threadIdx.x] = pick;
    }
    __syncthreads();
    if (lead)
      for (uint64_t j = len; j-- > 0;) {
        if (!info[j]) continue;
        p.fate[g_of[j]] = kTop;
        if (++marked == need) {
          done = true;
          break;
        }
      }
    __syncthreads();
    if (done) break;
    top = lo;
  }
  if (lead) {
    p.st->r.ranked = n;
    p.st->r.demoted = demoted;
    p.st->r.evicted = evicted;
    p.st->r.reclaimed = reclaimed;
  }
}

}  // namespace

cudaError_t launch_decide(const Params& p, cudaStream_t stream) {
  decide_kernel<<<1, kChunk, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace kvgc::cuda::select_detail
