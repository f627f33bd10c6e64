// Evacuation (runtime/evacuate.cpp): when the arena is short of one storage class's
// pages, sparse slabs of other classes are emptied into their classes' other slabs and
// given back, before anything returns KVGC_ENOMEM or a cached prefix is evicted. What
// moved reads back as before: private pages, header pages, shared pages and the cached
// prefixes holding them; the walker balances. Under host memory faults (kvgc's own hook)
// every call is OK or ENOMEM, nothing is lost and nothing leaks.
#include <doctest/doctest.h>

#include <numeric>

#include "../allocator/host_memory.hpp"
#include "gc_util.hpp"

using namespace kvgc_test;

namespace {

// Free fp16 pages the arena can give without evacuation: the class's free pages and
// every free slab carved into it.
uint64_t fp16_room(const kvgc_stats& s) {
  return s.cls[KVGC_CLASS_FP16].pages_free +
         s.slabs_free * (s.slab_bytes / s.cls[KVGC_CLASS_FP16].page_bytes);
}

kvgc_heap_options options(uint64_t arena_bytes) {
  kvgc_heap_options o = cpu_options(arena_bytes, 16);
  o.policy = KVGC_POLICY_FULL;
  return o;
}

}  // namespace

TEST_CASE("evacuation: an append that free slabs cannot hold takes sparse header slabs' memory") {
  // Forks of one sequence fill several slabs with header pages; destroying three forks in
  // four leaves each of those slabs a quarter used. An fp16 append that needs more than
  // the free slabs then gets them by evacuation, and everything else reads back as before.
  Heap H(options(1 << 20), model(2, 2, 32));
  kvgc_seq a;
  REQUIRE(kvgc_seq_create(H.h, 0, &a) == KVGC_OK);
  for (uint32_t l = 0; l < 2; ++l) H.append(a, l, 0, 64);
  std::vector<kvgc_seq> forks;
  while (H.stats().cls_header.slabs < 4) {
    kvgc_seq f;
    REQUIRE(kvgc_seq_fork(H.h, a, 0, &f, nullptr) == KVGC_OK);
    forks.push_back(f);
  }
  std::vector<kvgc_seq> kept;
  for (size_t i = 0; i < forks.size(); ++i) {
    if (i % 4 == 0) kept.push_back(forks[i]);
    else REQUIRE(kvgc_seq_destroy(H.h, forks[i]) == KVGC_OK);
  }
  H.check();
  const kvgc_stats before = H.stats();
  REQUIRE(before.cls_header.slabs >= 3);  // stranded: a quarter of each used
  REQUIRE(before.slabs_evacuated == 0);
  std::vector<Heap::Image> images;
  for (kvgc_seq s : kept)
    for (uint32_t l = 0; l < 2; ++l) images.push_back(H.image(s, l));
  // b takes every fp16 page it can, 16 tokens (a page) at a time per layer.
  kvgc_seq b;
  REQUIRE(kvgc_seq_create(H.h, 0, &b) == KVGC_OK);
  uint64_t pages = 0;
  int64_t length[2] = {0, 0};
  kvgc_status last = KVGC_OK;
  for (uint32_t l = 0; last == KVGC_OK; l ^= 1) {
    const auto k = gaussian(H.m, b, l, length[l], 16, false), v = gaussian(H.m, b, l, length[l], 16, true);
    last = kvgc_append(H.h, b, l, k.data(), v.data(), 16, nullptr);
    if (last == KVGC_OK) ++pages, length[l] += 16;
  }
  CHECK(last == KVGC_ENOMEM);  // the arena is full in the end
  H.check();
  const kvgc_stats after = H.stats();
  CHECK(pages > fp16_room(before));  // more than the free slabs held
  CHECK(after.slabs_evacuated >= 2);
  CHECK(after.pages_migrated > 0);
  CHECK(after.cls_header.slabs < before.cls_header.slabs);
  CHECK(after.cls_header.pages_used == before.cls_header.pages_used);  // moved, none lost
  size_t i = 0;
  for (kvgc_seq s : kept)
    for (uint32_t l = 0; l < 2; ++l) {
      CAPTURE(s);
      CHECK(H.image(s, l) == images[i++]);
      CHECK(verify_gaussian(H.h, H.m, s, a, l, 0.0) == "");
    }
  for (uint32_t l = 0; l < 2; ++l) CHECK(verify_gaussian(H.h, H.m, b, l, 0.0) == "");
}

TEST_CASE("evacuation: shared pages and the cached prefixes holding them move before a prefix is evicted") {
  // Twelve sequences each keep a prompt as a cached prefix and go: the prefixes' shared
  // pages are all that is left in the fp16 slabs. Forks of another sequence then need
  // header pages beyond the free slabs: fp16 slabs are evacuated (their shared pages
  // moved, the prefixes pointed at the copies) before any prefix is evicted, and each
  // prefix attaches and reads back its prompt's K/V.
  Heap H(options(1 << 20), model(2, 2, 32));
  std::vector<std::vector<int32_t>> prompts;
  std::vector<kvgc_seq> keepers, fillers;
  for (int i = 0; i < 12; ++i) {
    kvgc_seq s;
    REQUIRE(kvgc_seq_create(H.h, 0, &s) == KVGC_OK);
    std::vector<int32_t> ids(40);
    std::iota(ids.begin(), ids.end(), 1000 * (i + 1));
    for (uint32_t l = 0; l < 2; ++l) H.append(s, l, 0, 40);
    kvgc_prefix p;
    REQUIRE(kvgc_prefix_keep(H.h, s, ids.data(), ids.size(), 0, 0, &p, nullptr) == KVGC_OK);
    prompts.push_back(ids);
    keepers.push_back(s);
    // A filler between prompts: its pages, gone below, leave holes in the fp16 slabs.
    kvgc_seq f;
    REQUIRE(kvgc_seq_create(H.h, 0, &f) == KVGC_OK);
    for (uint32_t l = 0; l < 2; ++l) H.append(f, l, 0, 48);
    fillers.push_back(f);
  }
  for (kvgc_seq s : fillers) REQUIRE(kvgc_seq_destroy(H.h, s) == KVGC_OK);
  for (kvgc_seq s : keepers) REQUIRE(kvgc_seq_destroy(H.h, s) == KVGC_OK);
  H.check();
  const kvgc_stats before = H.stats();
  REQUIRE(before.prefixes == 12);
  REQUIRE(before.cls[KVGC_CLASS_FP16].pages_free > 0);
  // Forks of a long sequence until the first evacuation.
  kvgc_seq a;
  REQUIRE(kvgc_seq_create(H.h, 0, &a) == KVGC_OK);
  for (uint32_t l = 0; l < 2; ++l) H.append(a, l, 0, 16);
  kvgc_stats st = H.stats();
  int forks = 0;
  while (st.slabs_evacuated == 0) {
    kvgc_seq f;
    const kvgc_status rc = kvgc_seq_fork(H.h, a, 0, &f, nullptr);
    INFO(std::string(kvgc_errmsg(H.h)));
    REQUIRE(rc == KVGC_OK);
    REQUIRE(++forks < 100000);
    st = H.stats();
  }
  H.check();
  CHECK(st.prefix_evictions == 0);  // evacuation came first
  CHECK(st.prefixes == 12);
  CHECK(st.pages_migrated > 0);
  // Every prefix attaches and reads back its keeper's K/V and positions.
  for (size_t i = 0; i < prompts.size(); ++i) {
    CAPTURE(i);
    kvgc_seq t;
    REQUIRE(kvgc_seq_create(H.h, 0, &t) == KVGC_OK);
    uint64_t n = 0;
    REQUIRE(kvgc_prefix_attach(H.h, t, prompts[i].data(), prompts[i].size(), 0, &n, nullptr) == KVGC_OK);
    CHECK(n == 40);
    for (uint32_t l = 0; l < 2; ++l) CHECK(verify_gaussian(H.h, H.m, t, keepers[i], l, 0.0) == "");
    REQUIRE(kvgc_seq_destroy(H.h, t) == KVGC_OK);
  }
  H.check();
}

namespace {

// Forks strand header pages in quarter-used slabs, then b appends until the arena is
// full, which evacuates them. With fail_at > 0 the host's fail_at-th memory attempt in
// b's append number `armed` fails (once, or from then on within that call): every call
// must return KVGC_OK or KVGC_ENOMEM, the walker must pass after each, every kept fork
// and b must read back intact, and no host byte may remain once the heap is gone.
// *evacuating: the first of b's appends that evacuated a slab. Returns what failed ("":
// all held). (Sweeping every attempt of b's whole phase took 730 runs under ASan.)
std::string evacuation_under_faults(uint64_t fail_at, bool persistent, int armed, uint64_t* injected,
                                    int* evacuating = nullptr, kvgc_stats* out = nullptr) {
  namespace host = kvgc::host;
  const kvgc_model_desc m = model(2, 2, 32);
  kvgc_heap_options o = options(1 << 20);
  kvgc_heap* h = nullptr;
  if (kvgc_heap_create(&m, &o, &h) != KVGC_OK) return "heap_create";
  std::string failure;
  auto checked = [&](kvgc_status st, const char* what) {
    host::pause_faults(true);
    if (st != KVGC_OK && st != KVGC_ENOMEM && failure.empty())
      failure = std::string(what) + ": " + kvgc_status_str(st) + ": " + kvgc_errmsg(h);
    if (failure.empty() && kvgc_heap_check(h) != KVGC_OK)
      failure = std::string("after ") + what + ": " + kvgc_errmsg(h);
    host::pause_faults(false);
    return st == KVGC_OK;
  };
  kvgc_seq a = 0, b = 0;
  std::vector<kvgc_seq> kept;
  kvgc_seq_create(h, 0, &a);
  for (uint32_t l = 0; l < 2; ++l) {
    const auto k = gaussian(m, a, l, 0, 128, false), v = gaussian(m, a, l, 0, 128, true);
    kvgc_append(h, a, l, k.data(), v.data(), 128, nullptr);
  }
  std::vector<kvgc_seq> forks;
  for (int i = 0; i < 40; ++i) {
    kvgc_seq f = 0;
    if (kvgc_seq_fork(h, a, 0, &f, nullptr) != KVGC_OK) break;
    forks.push_back(f);
  }
  for (size_t i = 0; i < forks.size(); ++i) {
    if (i % 4 == 0) kept.push_back(forks[i]);
    else kvgc_seq_destroy(h, forks[i]);
  }
  *injected = 0;
  if (checked(kvgc_seq_create(h, 0, &b), "seq_create")) {
    int64_t length[2] = {0, 0};
    for (int i = 0, misses = 0; i < 400 && misses < 2 && failure.empty(); ++i) {
      const uint32_t l = uint32_t(i) % 2;
      const auto k = gaussian(m, b, l, length[l], 64, false), v = gaussian(m, b, l, length[l], 64, true);
      if (fail_at && i == armed) host::set_faults(fail_at, persistent);
      const kvgc_status st = kvgc_append(h, b, l, k.data(), v.data(), 64, nullptr);
      if (fail_at && i == armed) {
        *injected = host::faults_injected();
        host::set_faults(0, false);
      }
      const bool ok = checked(st, "append");
      if (ok) length[l] += 64;
      misses = ok ? 0 : misses + 1;
      if (evacuating && *evacuating < 0) {
        kvgc_stats st_now;
        kvgc_stats_init(&st_now);
        kvgc_get_stats(h, &st_now);
        if (st_now.slabs_evacuated > 0) *evacuating = i;
      }
    }
  }
  for (kvgc_seq f : kept)
    for (uint32_t l = 0; l < 2 && failure.empty(); ++l)
      if (const std::string bad = verify_gaussian(h, m, f, a, l, 0.0); !bad.empty()) failure = "fork: " + bad;
  for (uint32_t l = 0; l < 2 && b && failure.empty(); ++l)
    if (const std::string bad = verify_gaussian(h, m, b, l, 0.0); !bad.empty()) failure = "b: " + bad;
  if (out) {
    kvgc_stats_init(out);
    kvgc_get_stats(h, out);
  }
  kvgc_heap_destroy(h);
  return failure;
}

}  // namespace

TEST_CASE("evacuation under host memory faults: KVGC_OK or KVGC_ENOMEM, a valid heap, nothing lost or leaked") {
  namespace host = kvgc::host;
  const int64_t baseline = host::outstanding_bytes();
  kvgc_stats clean;
  uint64_t injected = 0;
  int evacuating = -1;
  REQUIRE(evacuation_under_faults(0, false, -1, &injected, &evacuating, &clean) == "");
  REQUIRE(clean.slabs_evacuated > 0);
  REQUIRE(evacuating >= 0);  // the append the faults go into evacuates
  REQUIRE(host::outstanding_bytes() == baseline);
  for (bool persistent : {false, true}) {
    uint64_t runs = 0;
    for (uint64_t n = 1;; ++n) {
      CAPTURE(n);
      CAPTURE(persistent);
      const std::string failure = evacuation_under_faults(n, persistent, evacuating, &injected);
      CHECK(failure == "");
      REQUIRE(host::outstanding_bytes() == baseline);
      ++runs;
      if (injected == 0 || !failure.empty()) break;  // past the call's last attempt
    }
    CHECK(runs > 1);
    MESSAGE(std::string(persistent ? "persistent: " : "transient: ") << runs << " faulted runs");
  }
}
