// Steps 5 and 6 of the CUDA select: the decisions gc.cpp's select takes in sequential
// loops, taken in the same order so that every stopping point is the CPU's (the sums
// are integers: units and counts).
//
// A batch runs a block per segment for each (walk: one thread each), every segment's
// Params read from the batch's device array.
//
//   walk (one thread): over the sorted candidates (prep_kernel's weights, ladder
//     positions and counted classes), the rungs in increasing (weight x slope, rung,
//     rank) until the reclaim is met and the pages kept fit the byte budget; then from
//     the top, each candidate's final rung (no dearer than any above it, within its
//     class's reserved slots unless it is demoted in place); then from the bottom,
//     evictions while the pages kept after compaction exceed the byte budget; then from
//     the top again, each mover's destination slot, listed in dem[] and its fate set (in
//     place: kCharged + class). Every count is at the slot's counted class (charged,
//     else its page's).
//   top (one block): from the highest downward among survivors: a major GC's top
//     retier_top (long-term), or a minor GC's first `promote` eligible (intermediate, age
//     >= promote_age): the sets gc.cpp's nth_element calls pick. Chunks of the sorted
//     candidates are loaded by all threads, the decisions taken by thread 0.
// Decisions land in fate[] (by slot) and the demotion list; apply/demote kernels act.
// Known cost: the walk is one thread per segment, O(candidates): fine for generational
// minors and budgets of a few thousand tokens, slow for h2o over 100K tokens a step.
#include <cstdint>

#include "../ladder_walk.hpp"
#include "gc_select.cuh"

namespace kvgc::cuda::select_detail {
namespace {

__global__ void walk_kernel(const Batch b) {
  const Params& p = b.ps[blockIdx.x];
  const uint32_t* svals = sorted_vals(b, p);
  State& st = *p.st;
  const uint64_t n = st.n_cand;
  unsigned long long live[KVGC_CLASS_COUNT];
  for (int c = 0; c < KVGC_CLASS_COUNT; ++c) live[c] = st.live_cls[c];
  WalkRules w{p.n_ladder, p.ladder, p.slope, p.unit_cost, p.reclaim, p.budget_bytes, p.pt, {}};
  for (int c = 0; c < KVGC_CLASS_COUNT; ++c) w.page_bytes[c] = p.L[c].bytes;
  const bool reclaims = p.reclaim > 0 || (p.budget_bytes > 0 && walk_held_bytes(w, live) > p.budget_bytes);
  if (!reclaims || n == 0) return;
  const uint32_t evicted = p.n_ladder;
  // The ladder walk and its refill (kernels/ladder_walk.hpp), with its own view of the
  // live counts.
  unsigned long long walked[KVGC_CLASS_COUNT];
  for (int c = 0; c < KVGC_CLASS_COUNT; ++c) walked[c] = live[c];
  ladder_walk(w, p.weight, p.from, p.at, n, walked);
  // Assignment from the top: monotone, within capacity.
  uint64_t taken[KVGC_CLASS_COUNT] = {};
  uint32_t floor = 0;
  for (uint64_t i = n; i-- > 0;) {
    const uint32_t from = p.from[i];
    const bool moves = !(p.counted[i] & kInPlace);  // in place: takes no slot
    uint32_t to = p.at[i] > floor ? p.at[i] : floor;
    while (moves && to < evicted && to != from && taken[p.ladder[to]] == p.slot_count[p.ladder[to]]) ++to;
    if (moves && to < evicted && to != from) ++taken[p.ladder[to]];
    p.at[i] = uint8_t(floor = to);
    --live[p.counted[i] & 3];
    if (to < evicted) ++live[p.ladder[to]];
  }
  // The byte budget, from the bottom.
  for (uint64_t i = 0; p.budget_bytes > 0 && i < n && walk_held_bytes(w, live) > p.budget_bytes; ++i) {
    if (p.at[i] == evicted) continue;
    const int cls = p.ladder[p.at[i]];
    if (p.at[i] != p.from[i] && !(p.counted[i] & kInPlace)) --taken[cls];
    --live[cls];
    p.at[i] = uint8_t(evicted);
  }
  // Destinations from the top, fates, counts.
  uint64_t next_slot[KVGC_CLASS_COUNT] = {}, n_dem = 0, n_charged = 0, n_evicted = 0, got = 0;
  for (uint64_t i = n; i-- > 0;) {
    if (p.at[i] == p.from[i]) continue;
    const uint32_t g = svals[i];
    const uint32_t c0 = p.counted[i] & 3;
    if (p.at[i] == evicted) {
      p.fate[g] = kEvicted;
      got += p.unit_cost[c0];
      ++n_evicted;
      continue;
    }
    const uint8_t cls = p.ladder[p.at[i]];
    if (p.counted[i] & kInPlace) {
      p.fate[g] = uint8_t(kCharged + cls);
      ++n_charged;
    } else {
      p.dem[n_dem++] = Demotion{g, uint32_t(p.slot_base[cls] + next_slot[cls]++), cls};
      p.fate[g] = kDemoted;
    }
    got += p.unit_cost[c0] - p.unit_cost[cls];
  }
  st.n_dem = n_dem;
  st.r.demoted = n_dem + n_charged;
  st.r.evicted = n_evicted;
  st.r.reclaimed = got;
  for (int c = 0; c < KVGC_CLASS_COUNT; ++c) st.r.demoted_to[c] = taken[c];
}

__global__ void __launch_bounds__(kChunk) top_kernel(const Batch b) {
  const Params& p = b.ps[blockIdx.x];
  const uint32_t* svals = sorted_vals(b, p);
  __shared__ uint32_t g_of[kChunk];
  __shared__ uint8_t info[kChunk];
  __shared__ bool done;
  __shared__ uint64_t need;
  const bool lead = threadIdx.x == 0;
  const uint64_t n = p.st->n_cand;
  // Survivors ranked from the top: a major GC re-splits, a minor GC promotes.
  if (lead) {
    need = 0;
    if (p.retier) {
      const uint64_t rest = n - p.st->r.demoted - p.st->r.evicted;
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
      const uint32_t g = svals[lo + threadIdx.x];
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
  if (lead) p.st->r.ranked = n;
}

}  // namespace

cudaError_t launch_decide(const Batch& b, cudaStream_t stream) {
  walk_kernel<<<b.n_segs, 1, 0, stream>>>(b);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  top_kernel<<<b.n_segs, kChunk, 0, stream>>>(b);
  return cudaGetLastError();
}

}  // namespace kvgc::cuda::select_detail
