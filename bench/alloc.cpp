// Allocator benchmark: kvgc's PagePool against tcmalloc and glibc malloc, side by side.
//
// For each heap size N (pages already live) three workloads run on every allocator:
//   LIFO pairs     alloc a page, free that page.
//   random pairs   alloc a page, free a uniformly random live page (the heap stays at N).
//   random ops     RMM-style: each op allocates with p = 0.73, else frees a uniformly
//                  random live allocation. Rounds of N/4 ops each start from N live pages
//                  (an untimed restore in between), so the heap stays within ~N..1.12 N.
// Every random decision is drawn up front, outside the timed region, and depends only on
// the live count, so all allocators replay exactly the same sequence.
//
// kvgc runs on fake addresses (it never touches the memory it manages). The mallocs get
// 4096-byte requests (kvgc's fp16 page) and the bench never touches that memory either:
// what is timed is allocator metadata work (the mallocs still write their own headers
// and free-list links into the blocks, so their heaps do become resident).
//
// glibc is measured through the libc.so.6 handle: libtcmalloc_minimal also exports
// __libc_malloc/__libc_free, so a plain extern "C" reference would bind to tcmalloc.
#include <dlfcn.h>
#include <malloc.h>
#include <sys/resource.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#if KVGC_HAVE_TCMALLOC
#include <gperftools/malloc_extension.h>
#include <gperftools/tcmalloc.h>
#endif

#include "../allocator/page_pool.hpp"
#include "bench_util.hpp"

namespace {

using namespace kvgc;
using namespace kvgc::bench;

constexpr size_t kPageBytes = 4096;  // kvgc fp16 page; also the malloc request size
constexpr size_t kInt4PageBytes = 1280;
constexpr size_t kSlabBytes = size_t(2) << 20;
constexpr uintptr_t kFakeBase = uintptr_t(1) << 40;  // slab aligned, never dereferenced
constexpr int kFp16Class = 0;
constexpr int kInt4Class = 1;
constexpr int kInt8Class = 2;  // unused by the benchmark, but every class needs a size
constexpr size_t kInt8PageBytes = 2304;
constexpr int kInt2Class = 3;  // likewise (0.10)
constexpr size_t kInt2PageBytes = 768;
constexpr SegmentId kOwner = 7;
constexpr double kAllocProbability = 0.73;  // RMM's random_allocations benchmark
constexpr uint32_t kAllocOp = UINT32_MAX;   // in a random-ops sequence: allocate

[[noreturn]] void die(const std::string& what) {
  std::fprintf(stderr, "kvgc-bench-alloc: %s\n", what.c_str());
  std::exit(1);
}

// --- what to run ----------------------------------------------------------------------

struct Plan {
  std::vector<uint32_t> heap_pages;
  uint64_t pair_ops = 0;    // per repetition, for each kind of pair
  uint64_t random_ops = 0;  // per repetition
  int reps = 0;             // below kLargeHeap
  int reps_large = 0;       // at kLargeHeap and above, where a repetition costs the most
  uint32_t malloc_max_pages = 0;  // largest heap the mallocs run at (their setup faults in
                                  // 4 KiB per page: ~4 GiB and seconds at 1M pages)
};
constexpr uint32_t kLargeHeap = uint32_t(1) << 20;

Plan full_plan() {
  return {{1u << 10, 1u << 16, 1u << 20}, 1u << 20, 1u << 20, 7, 3, UINT32_MAX};
}
// The smoke test: every path at every size for kvgc, the mallocs only up to 64K pages.
Plan quick_plan() { return {{1u << 10, 1u << 16, 1u << 20}, 1u << 14, 1u << 14, 1, 1, 1u << 16}; }

// The pre-drawn decisions for one heap size, shared by every allocator.
struct Workload {
  uint32_t heap_pages = 0;
  int reps = 0;
  uint64_t lifo_pairs = 0;
  std::vector<uint32_t> pair_victims;  // slot freed after each pair's alloc, in [0, N)
  uint32_t round_ops = 0;              // random ops per round; each round starts at N live
  std::vector<uint32_t> random_ops;    // rounds back to back: kAllocOp or the slot to free
  uint32_t peak_pages = 0;             // most pages live at once, for sizing

  uint32_t rounds() const { return uint32_t(random_ops.size() / round_ops); }
};

Workload make_workload(uint32_t heap_pages, const Plan& plan) {
  Workload w;
  w.heap_pages = heap_pages;
  w.reps = heap_pages >= kLargeHeap ? plan.reps_large : plan.reps;
  w.lifo_pairs = plan.pair_ops;
  std::mt19937_64 rng(0x6b7667635f616c6cull ^ heap_pages);

  std::uniform_int_distribution<uint32_t> any_live(0, heap_pages - 1);
  w.pair_victims.resize(plan.pair_ops);
  for (uint32_t& v : w.pair_victims) v = any_live(rng);

  w.round_ops = uint32_t(std::clamp<uint64_t>(heap_pages / 4, 1, plan.random_ops));
  const uint64_t rounds = std::max<uint64_t>(plan.random_ops / w.round_ops, 1);
  std::bernoulli_distribution alloc_coin(kAllocProbability);
  w.random_ops.reserve(rounds * w.round_ops);
  w.peak_pages = heap_pages + 1;  // a pair holds N + 1 for a moment
  for (uint64_t r = 0; r < rounds; ++r) {
    uint32_t live = heap_pages;
    for (uint32_t i = 0; i < w.round_ops; ++i) {
      if (live == 0 || alloc_coin(rng)) {
        w.random_ops.push_back(kAllocOp);
        w.peak_pages = std::max(w.peak_pages, ++live);
      } else {
        w.random_ops.push_back(std::uniform_int_distribution<uint32_t>(0, live - 1)(rng));
        --live;
      }
    }
  }
  return w;
}

// --- the allocators, behind one small interface -------------------------------------------

class KvgcPool {
 public:
  using Handle = PageId;
  static constexpr const char* kName = "kvgc";

  explicit KvgcPool(uint32_t peak_pages) {
    // Room for the peak plus a few slabs: alloc only takes a new slab when every slab
    // of the class is full, so ceil(peak / pages per slab) + 1 always suffices.
    const uint64_t slabs = peak_pages / (kSlabBytes / kPageBytes) + 4;
    PoolConfig cfg;
    cfg.base = kFakeBase;
    cfg.arena_bytes = slabs * kSlabBytes;
    cfg.slab_bytes = kSlabBytes;
    cfg.page_bytes[kFp16Class] = kPageBytes;
    cfg.page_bytes[kInt4Class] = kInt4PageBytes;
    cfg.page_bytes[kInt8Class] = kInt8PageBytes;
    cfg.page_bytes[kInt2Class] = kInt2PageBytes;
    std::string err;
    if (!pool_.init(cfg, &err)) die("PagePool::init: " + err);
  }

  Handle alloc() { return pool_.alloc(kFp16Class, kOwner); }
  void free(Handle id) { pool_.free(id); }
  static bool valid(Handle id) { return id != kNoPage; }
  uint64_t slab_acquisitions() const { return pool_.slabs_acquired(); }
  void release() {}

  // The full invariant walk plus: exactly the live ids are allocated, to our owner, and
  // their addresses map back to them.
  void verify(const std::vector<Handle>& live, const char* phase) const {
    auto fail = [&](const std::string& m) { die(std::string("kvgc after ") + phase + ": " + m); };
    std::string err;
    if (!pool_.check(&err)) fail(err);
    const ClassCounts& fp16 = pool_.counts(kFp16Class);
    if (fp16.pages_used != live.size())
      fail("pool counts " + std::to_string(fp16.pages_used) + " pages, bench holds " +
           std::to_string(live.size()));
    if (pool_.counts(kInt4Class).pages_used != 0 || pool_.counts(kInt4Class).slabs != 0)
      fail("the int4 class holds pages nobody asked for");
    if (live.empty() && fp16.slabs != 0) fail("an empty heap still holds slabs");
    for (const PageId id : live) {
      if (!pool_.allocated(id) || pool_.class_of(id) != kFp16Class ||
          pool_.desc(id).owner != kOwner)
        fail("page " + std::to_string(id) + " is not a live fp16 page of the bench");
      if (pool_.page_at(pool_.address(id)) != id)
        fail("page " + std::to_string(id) + " does not map back from its address");
    }
  }

 private:
  PagePool pool_;
};

#if KVGC_HAVE_TCMALLOC
class TcMalloc {
 public:
  using Handle = void*;
  static constexpr const char* kName = "tcmalloc";

  // Keep freed spans instead of handing them back to the OS bit by bit, so that no page
  // fault lands in a timed region (kvgc on fake addresses never faults either).
  TcMalloc() { MallocExtension::instance()->SetMemoryReleaseRate(0.0); }
  Handle alloc() { return tc_malloc(kPageBytes); }
  void free(Handle p) { tc_free(p); }
  static bool valid(Handle p) { return p != nullptr; }
  void release() { MallocExtension::instance()->ReleaseFreeMemory(); }
  void verify(const std::vector<Handle>&, const char*) const {}
};
#endif

// glibc's own entry points, looked up in libc.so.6 itself.
struct GlibcApi {
  void* (*malloc)(size_t) = nullptr;
  void (*free)(void*) = nullptr;
  int (*trim)(size_t) = nullptr;
  int (*mallopt)(int, int) = nullptr;
  std::string measured_from;  // the object our __libc_malloc lives in
  std::string plain_binding;  // where an unqualified __libc_malloc reference would bind
};

std::string object_of(void* symbol) {
  Dl_info info;
  return symbol && dladdr(symbol, &info) && info.dli_fname ? info.dli_fname : "(none)";
}

template <class Fn>
Fn libc_symbol(void* libc, const char* name) {
  void* p = dlsym(libc, name);
  if (!p) die(std::string("libc.so.6 has no ") + name);
  return reinterpret_cast<Fn>(p);
}

GlibcApi resolve_glibc() {
  void* libc = dlopen("libc.so.6", RTLD_NOW | RTLD_NOLOAD);
  if (!libc) die("libc.so.6 is not loaded?");
  GlibcApi api;
  api.malloc = libc_symbol<void* (*)(size_t)>(libc, "__libc_malloc");
  api.free = libc_symbol<void (*)(void*)>(libc, "__libc_free");
  api.trim = libc_symbol<int (*)(size_t)>(libc, "malloc_trim");
  api.mallopt = libc_symbol<int (*)(int, int)>(libc, "mallopt");
  api.measured_from = object_of(reinterpret_cast<void*>(api.malloc));
  api.plain_binding = object_of(dlsym(RTLD_DEFAULT, "__libc_malloc"));
  return api;
}

class GlibcMalloc {
 public:
  using Handle = void*;
  static constexpr const char* kName = "glibc";

  // Same reason as tcmalloc's release rate: keep the heap top instead of trimming it.
  explicit GlibcMalloc(const GlibcApi& api) : api_(api) { api_.mallopt(M_TRIM_THRESHOLD, INT_MAX); }
  Handle alloc() { return api_.malloc(kPageBytes); }
  void free(Handle p) { api_.free(p); }
  static bool valid(Handle p) { return p != nullptr; }
  void release() { api_.trim(0); }
  void verify(const std::vector<Handle>&, const char*) const {}

 private:
  const GlibcApi& api_;
};

// No allocator at all: what the bench loop and its live-slot bookkeeping cost by
// themselves. 8-byte handles, like the mallocs (kvgc's page ids are 4 bytes).
class LoopOnly {
 public:
  using Handle = uintptr_t;
  static constexpr const char* kName = "loop only";

  Handle alloc() {
    do_not_optimize(next_);
    return ++next_;
  }
  void free(Handle h) { do_not_optimize(h); }
  static bool valid(Handle h) { return h != 0; }
  void release() {}
  void verify(const std::vector<Handle>&, const char*) const {}

 private:
  Handle next_ = 0;
};

// --- the timed loops ------------------------------------------------------------------

template <class Alloc>
typename Alloc::Handle checked_alloc(Alloc& a) {
  const typename Alloc::Handle h = a.alloc();
  if (!Alloc::valid(h)) [[unlikely]]
    die(std::string(Alloc::kName) + ": allocation failed");
  return h;
}

// Untimed: brings the live set back to n allocations, freeing the newest first.
template <class Alloc>
void resize_live(Alloc& a, std::vector<typename Alloc::Handle>& live, uint32_t n) {
  while (live.size() > n) {
    a.free(live.back());
    live.pop_back();
  }
  while (live.size() < n) live.push_back(checked_alloc(a));
}

template <class Alloc>
double time_lifo_pairs(Alloc& a, uint64_t pairs) {
  const Timer timer;
  for (uint64_t i = 0; i < pairs; ++i) a.free(checked_alloc(a));
  return timer.elapsed_ns() / double(pairs);
}

template <class Alloc>
double time_random_pairs(Alloc& a, std::vector<typename Alloc::Handle>& live,
                         const std::vector<uint32_t>& victims) {
  const Timer timer;
  for (const uint32_t slot : victims) {
    const typename Alloc::Handle fresh = checked_alloc(a);
    a.free(live[slot]);
    live[slot] = fresh;
  }
  return timer.elapsed_ns() / double(victims.size());
}

template <class Alloc>
void replay_round(Alloc& a, std::vector<typename Alloc::Handle>& live, const uint32_t* ops,
                  uint32_t n) {
  for (uint32_t i = 0; i < n; ++i) {
    const uint32_t op = ops[i];
    if (op == kAllocOp) {
      live.push_back(checked_alloc(a));  // capacity reserved: never reallocates here
    } else {
      a.free(live[op]);
      live[op] = live.back();
      live.pop_back();
    }
  }
}

template <class Alloc>
double time_random_ops(Alloc& a, std::vector<typename Alloc::Handle>& live, const Workload& w,
                       double timer_overhead_ns) {
  double ns = 0;
  for (uint32_t r = 0; r < w.rounds(); ++r) {
    const Timer timer;
    replay_round(a, live, w.random_ops.data() + size_t(r) * w.round_ops, w.round_ops);
    ns += timer.elapsed_ns() - timer_overhead_ns;
    resize_live(a, live, w.heap_pages);
  }
  return ns / double(w.random_ops.size());
}

// Distinct handles; for memory blocks, also at least a page apart (no overlap).
template <class Handle>
void check_disjoint(std::vector<Handle> handles, const char* name) {
  std::sort(handles.begin(), handles.end());
  for (size_t i = 1; i < handles.size(); ++i) {
    bool overlap = handles[i] == handles[i - 1];
    if constexpr (std::is_pointer_v<Handle>)
      overlap = size_t(static_cast<char*>(handles[i]) - static_cast<char*>(handles[i - 1])) <
                kPageBytes;
    if (overlap) die(std::string(name) + ": two live allocations overlap");
  }
}

struct Figures {
  Summary lifo_pairs, random_pairs, random_ops;
  // kvgc only: slabs taken from the arena per op, by phase (churn at a slab boundary).
  double slabs_per_lifo_pair = NAN, slabs_per_random_pair = NAN, slabs_per_random_op = NAN;
};

template <class Alloc>
Figures run_session(Alloc& a, const Workload& w, double timer_overhead_ns) {
  using Handle = typename Alloc::Handle;
  constexpr bool kCountsSlabs = requires(const Alloc& c) { c.slab_acquisitions(); };
  auto slabs = [&] {
    if constexpr (kCountsSlabs) return double(a.slab_acquisitions());
    return 0.0;
  };
  auto expect_heap = [&](const std::vector<Handle>& live, const char* phase) {
    if (live.size() != w.heap_pages)
      die(std::string(Alloc::kName) + " after " + phase + ": heap size drifted");
    a.verify(live, phase);
  };

  std::vector<Handle> live;
  live.reserve(w.peak_pages);
  resize_live(a, live, w.heap_pages);
  expect_heap(live, "setup");

  Figures f;
  double before = slabs();
  f.lifo_pairs = median_of(w.reps, [&] { return time_lifo_pairs(a, w.lifo_pairs); });
  f.slabs_per_lifo_pair = (slabs() - before) / double(w.lifo_pairs * uint64_t(w.reps));
  expect_heap(live, "LIFO pairs");

  before = slabs();
  f.random_pairs = median_of(w.reps, [&] { return time_random_pairs(a, live, w.pair_victims); });
  f.slabs_per_random_pair = (slabs() - before) / double(w.pair_victims.size() * size_t(w.reps));
  expect_heap(live, "random pairs");

  // One untimed round first: it grows the heap to its peak, so the first-touch page
  // faults of the mallocs stay out of the timed rounds.
  replay_round(a, live, w.random_ops.data(), w.round_ops);
  resize_live(a, live, w.heap_pages);
  before = slabs();
  f.random_ops = median_of(w.reps, [&] { return time_random_ops(a, live, w, timer_overhead_ns); });
  f.slabs_per_random_op = (slabs() - before) / double(w.random_ops.size() * size_t(w.reps));
  expect_heap(live, "random ops");

  check_disjoint(live, Alloc::kName);
  resize_live(a, live, 0);
  a.verify(live, "teardown");
  a.release();
  if constexpr (!kCountsSlabs)
    f.slabs_per_lifo_pair = f.slabs_per_random_pair = f.slabs_per_random_op = NAN;
  return f;
}

// --- reporting ------------------------------------------------------------------------

enum Column { kKvgc, kTcmalloc, kGlibc, kLoopOnly, kColumns };

struct HeapFigures {
  uint32_t heap_pages = 0;
  Figures by[kColumns];
};

std::string pages_label(uint32_t n) {
  if (n >= (1u << 20) && n % (1u << 20) == 0) return std::to_string(n >> 20) + "M";
  if (n >= (1u << 10) && n % (1u << 10) == 0) return std::to_string(n >> 10) + "K";
  return std::to_string(n);
}

std::string cell(const Summary& s) {
  if (!std::isfinite(s.median)) return "n/a";
  char text[48];
  std::snprintf(text, sizeof text, "%.1f (%.1f)", s.median, s.min);
  return text;
}

std::string ratio_cell(double r) {
  if (!std::isfinite(r)) return "n/a";
  char text[24];
  std::snprintf(text, sizeof text, "%.2fx", r);
  return text;
}

void print_table(const std::vector<HeapFigures>& heaps) {
  std::printf("\nns per op: median (min) of the repetitions; ratios are other / kvgc medians\n\n");
  std::printf("| %-12s | %5s | %-13s | %-13s | %-13s | %-13s | %8s | %8s |\n", "workload", "pages",
              "kvgc", "tcmalloc", "glibc", "loop only", "tc/kvgc", "gl/kvgc");
  std::printf("|%s|%s|%s|%s|%s|%s|%s|%s|\n", std::string(14, '-').c_str(),
              std::string(7, '-').c_str(), std::string(15, '-').c_str(),
              std::string(15, '-').c_str(), std::string(15, '-').c_str(),
              std::string(15, '-').c_str(), std::string(10, '-').c_str(),
              std::string(10, '-').c_str());
  struct Row {
    const char* name;
    Summary Figures::*field;
  };
  const Row rows[] = {{"LIFO pairs", &Figures::lifo_pairs},
                      {"random pairs", &Figures::random_pairs},
                      {"random ops", &Figures::random_ops}};
  for (const Row& row : rows) {
    for (const HeapFigures& h : heaps) {
      auto median = [&](Column c) { return (h.by[c].*row.field).median; };
      std::printf("| %-12s | %5s | %-13s | %-13s | %-13s | %-13s | %8s | %8s |\n", row.name,
                  pages_label(h.heap_pages).c_str(), cell(h.by[kKvgc].*row.field).c_str(),
                  cell(h.by[kTcmalloc].*row.field).c_str(), cell(h.by[kGlibc].*row.field).c_str(),
                  cell(h.by[kLoopOnly].*row.field).c_str(),
                  ratio_cell(ratio(median(kTcmalloc), median(kKvgc))).c_str(),
                  ratio_cell(ratio(median(kGlibc), median(kKvgc))).c_str());
    }
  }
  std::printf("\nkvgc slabs taken from the arena per op "
              "(LIFO pairs / random pairs / random ops):\n");
  for (const HeapFigures& h : heaps) {
    const Figures& k = h.by[kKvgc];
    std::printf("  %5s pages: %.3f / %.3f / %.3f\n", pages_label(h.heap_pages).c_str(),
                k.slabs_per_lifo_pair, k.slabs_per_random_pair, k.slabs_per_random_op);
  }
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) {
      quick = true;
    } else {
      std::fprintf(stderr, "usage: %s [--quick]\n", argv[0]);
      return 2;
    }
  }
  const Timer total;
  const Plan plan = quick ? quick_plan() : full_plan();
  const GlibcApi glibc = resolve_glibc();
  const double timer_overhead_ns = Timer::overhead_ns();

  std::printf("kvgc-bench-alloc%s: page %zu bytes (kvgc fp16 class; malloc request size), "
              "slab %zu KiB, int4 page %zu bytes\n",
              quick ? " --quick" : "", kPageBytes, kSlabBytes >> 10, kInt4PageBytes);
  std::printf("kvgc on fake addresses from 0x%llx; malloc'd memory is never touched by the "
              "bench\n", static_cast<unsigned long long>(kFakeBase));
  std::printf("per repetition: %llu LIFO pairs, %llu random pairs, %llu random ops "
              "(p(alloc) = %.2f, rounds of N/4 from N live); repetitions %d, %d at >= %s\n",
              static_cast<unsigned long long>(plan.pair_ops),
              static_cast<unsigned long long>(plan.pair_ops),
              static_cast<unsigned long long>(plan.random_ops), kAllocProbability, plan.reps,
              plan.reps_large, pages_label(kLargeHeap).c_str());
  if (plan.malloc_max_pages < plan.heap_pages.back())
    std::printf("mallocs only up to %s pages in this mode\n",
                pages_label(plan.malloc_max_pages).c_str());
  std::printf("glibc malloc measured from %s (a plain __libc_malloc binds to %s)\n",
              glibc.measured_from.c_str(), glibc.plain_binding.c_str());
#if KVGC_HAVE_TCMALLOC
  std::printf("tcmalloc: gperftools tc_malloc/tc_free from %s\n",
              object_of(reinterpret_cast<void*>(&tc_malloc)).c_str());
#else
  std::printf("tcmalloc: unavailable in this build (gperftools not found)\n");
#endif
  std::printf("timer overhead %.1f ns per interval (subtracted from random-op rounds)\n",
              timer_overhead_ns);
  std::fflush(stdout);

  std::vector<HeapFigures> heaps;
  for (const uint32_t n : plan.heap_pages) {
    const Workload w = make_workload(n, plan);
    HeapFigures h;
    h.heap_pages = n;
    {
      KvgcPool pool(w.peak_pages);
      h.by[kKvgc] = run_session(pool, w, timer_overhead_ns);
    }
    if (n <= plan.malloc_max_pages) {
#if KVGC_HAVE_TCMALLOC
      TcMalloc tc;
      h.by[kTcmalloc] = run_session(tc, w, timer_overhead_ns);
#endif
      GlibcMalloc gl(glibc);
      h.by[kGlibc] = run_session(gl, w, timer_overhead_ns);
    }
    {
      LoopOnly loop;
      h.by[kLoopOnly] = run_session(loop, w, timer_overhead_ns);
    }
    std::printf("  heap %s pages done (%.1f s)\n", pages_label(n).c_str(), total.elapsed_s());
    std::fflush(stdout);
    heaps.push_back(h);
  }

  print_table(heaps);
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  std::printf("\npeak RSS %.2f GiB, total %.1f s\n", double(usage.ru_maxrss) / (1 << 20),
              total.elapsed_s());
  std::printf("pair = random pairs; vs-ratios at the largest heap (>1: kvgc faster); "
              "1M_vs_1K = kvgc cost ratio (1.0 = flat)\n\n");

  const HeapFigures& small = heaps.front();
  const HeapFigures& large = heaps.back();
  auto ns = [](const HeapFigures& h, Column c, Summary Figures::*field) {
    return (h.by[c].*field).median;
  };
  ResultLine result;
  result.add("kvgc_vs_tcmalloc_pair", ratio(ns(large, kTcmalloc, &Figures::random_pairs),
                                            ns(large, kKvgc, &Figures::random_pairs)));
  result.add("kvgc_vs_glibc_pair", ratio(ns(large, kGlibc, &Figures::random_pairs),
                                         ns(large, kKvgc, &Figures::random_pairs)));
  result.add("kvgc_1M_vs_1K_pair", ratio(ns(large, kKvgc, &Figures::random_pairs),
                                         ns(small, kKvgc, &Figures::random_pairs)));
  result.add("kvgc_vs_tcmalloc_random", ratio(ns(large, kTcmalloc, &Figures::random_ops),
                                              ns(large, kKvgc, &Figures::random_ops)));
  result.add("kvgc_1M_vs_1K_random", ratio(ns(large, kKvgc, &Figures::random_ops),
                                           ns(small, kKvgc, &Figures::random_ops)));
  result.add("kvgc_pair_ns_1K", ns(small, kKvgc, &Figures::random_pairs), 1);
  result.add("kvgc_pair_ns_1M", ns(large, kKvgc, &Figures::random_pairs), 1);
  result.add("tcmalloc_pair_ns_1M", ns(large, kTcmalloc, &Figures::random_pairs), 1);
  result.add("glibc_pair_ns_1M", ns(large, kGlibc, &Figures::random_pairs), 1);
  result.print();
  return 0;
}
