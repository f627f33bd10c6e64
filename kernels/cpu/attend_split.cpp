// How the vector attention path divides a call's live slots among a pool's workers
// (split-K, attend_simd_phases.inc): contiguous ranges, cut at page boundaries so that no
// page's K or V block is read by two workers, balanced by slot count.
#include <algorithm>
#include <atomic>

#include "attend_internal.hpp"

namespace kvgc::cpu {
namespace {

// Fewer slots than this per worker and the split does not pay: the phases add about
// four pool dispatches (a few microseconds each when the workers are awake, tens when a
// sleeping one must be woken), and 256 slots are only about 10-50 microseconds of K/V
// streaming for one core (hd 64-128, 2-8 KV heads). Measured on 2 Zen 4 cores: see
// docs/PERF.md, "CPU decode attention" (its threads: KVGC_THREADS=2).
constexpr size_t kSplitMinSlots = 256;
std::atomic<size_t> g_min{kSplitMinSlots};

}  // namespace

size_t split_min_slots() { return g_min.load(std::memory_order_relaxed); }
void set_split_min_slots(size_t n) { g_min.store(n ? n : kSplitMinSlots, std::memory_order_relaxed); }

unsigned split_slots(const LiveSlot* slots, size_t n, unsigned max_workers, size_t* bounds) {
  const size_t want = std::clamp<size_t>(n / split_min_slots(), 1, std::max(max_workers, 1u));
  unsigned T = 0;
  bounds[0] = 0;
  for (size_t w = 1; w <= want; ++w) {
    // The first page start at or after the balanced cut (the end for the last range).
    size_t cut = w == want ? n : std::max(n * w / want, bounds[T]);
    while (cut < n && cut > 0 && slots[cut].page == slots[cut - 1].page) ++cut;
    if (cut > bounds[T]) bounds[++T] = cut;  // never an empty range
  }
  if (T == 0) bounds[++T] = n;  // no live slot: one empty range
  return T;
}

}  // namespace kvgc::cpu
