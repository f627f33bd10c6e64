// kvgc-stress [THREADS [SCALE [ITER [CPU_THREADS]]]]: threads sharing one heap, in the
// spirit of mimalloc's test-stress. Each thread keeps SCALE sequences of its own; each of
// ITER rounds it appends to one (prefill chunks or decode tokens, every layer), attends
// with the new tokens as queries (on the heap's CPU_THREADS workers, split-K even over
// short segments: the split minimum is lowered), hands in attention mass, steps the GC (generational or h2o, int4 demotion, compaction), verifies
// every live token of that sequence against its (sequence, layer, position) tag, and now
// and then destroys it or hands it to whichever thread comes next. Ends with the
// invariant walker and a check that every page went back. Defaults are small for CI; a
// long configuration is recorded in docs/RELIABILITY.md.
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "../kernels/cpu/attend_internal.hpp"
#include "util.hpp"

using namespace kvgc_test;

namespace {

struct Shared {
  kvgc_heap* heap;
  kvgc_model_desc model;
  std::atomic<kvgc_seq> handoff{0};
  std::atomic<uint64_t> steps{0}, verified{0}, handed{0}, errors{0};
};

bool step_and_verify(Shared& sh, kvgc_seq s, std::mt19937& rng) {
  const kvgc_model_desc& m = sh.model;
  const uint32_t n = rng() % 5 == 0 ? 1 + rng() % 40 : 1;
  for (uint32_t layer = 0; layer < m.n_layers; ++layer) {
    uint64_t len = 0, live = 0;
    if (kvgc_seq_tokens(sh.heap, s, layer, &live, &len) != KVGC_OK) return false;
    const auto k = gaussian(m, s, layer, int64_t(len), n, false), v = gaussian(m, s, layer, int64_t(len), n, true);
    const kvgc_status st = kvgc_append(sh.heap, s, layer, k.data(), v.data(), n, nullptr);
    if (st == KVGC_ENOMEM) return true;  // the arena is full for now: other threads will free
    if (st != KVGC_OK) return false;
    std::vector<float> q(size_t(n) * m.n_q_heads * m.head_dim / 2), out(q.size());  // f16 pairs
    for (auto& x : q) x = 0.f;  // zero queries: uniform attention over what each query sees
    if (kvgc_attend(sh.heap, s, layer, q.data(), n, out.data(), nullptr, nullptr) != KVGC_OK)
      return false;
    kvgc_seq_tokens(sh.heap, s, layer, &live, nullptr);
    std::vector<float> mass(live);
    for (auto& x : mass) x = float(rng() % 1000) / 1000.f;
    if (kvgc_observe(sh.heap, s, layer, mass.data(), live, nullptr) != KVGC_OK) return false;
  }
  const kvgc_status st = kvgc_step(sh.heap, s, nullptr);
  if (st != KVGC_OK && st != KVGC_EBUDGET) return false;
  sh.steps++;
  for (uint32_t layer = 0; layer < m.n_layers; ++layer) {
    // 0.15: the int4 worst case for a single 32-element group (0.12 bounds the typical vector).
    const std::string bad = verify_gaussian(sh.heap, m, s, layer, 0.15);
    if (!bad.empty()) {
      std::fprintf(stderr, "kvgc-stress: seq %llu layer %u: %s\n", (unsigned long long)s, layer, bad.c_str());
      return false;
    }
  }
  sh.verified++;
  return true;
}

void worker(Shared& sh, int id, int scale, int iters) {
  std::mt19937 rng(unsigned(id) * 7919u + 1);
  std::vector<kvgc_seq> mine(size_t(scale), 0);
  for (int it = 0; it < iters; ++it) {
    kvgc_seq& s = mine[rng() % mine.size()];
    if (!s && kvgc_seq_create(sh.heap, uint32_t(id), &s) != KVGC_OK) {
      s = 0;
      continue;
    }
    if (!step_and_verify(sh, s, rng)) {
      sh.errors++;
      return;
    }
    const uint32_t r = rng() % 100;
    if (r < 8) {  // the request ends
      if (kvgc_seq_destroy(sh.heap, s) != KVGC_OK) sh.errors++;
      s = 0;
    } else if (r < 14) {  // hand it to another thread, take whatever was left
      s = sh.handoff.exchange(s);
      sh.handed++;
    }
  }
  for (kvgc_seq s : mine)
    if (s && kvgc_seq_destroy(sh.heap, s) != KVGC_OK) sh.errors++;
}

}  // namespace

int main(int argc, char** argv) {
  const int threads = argc > 1 ? std::atoi(argv[1]) : 4;
  const int scale = argc > 2 ? std::atoi(argv[2]) : 4;
  const int iters = argc > 3 ? std::atoi(argv[3]) : 60;
  const int cpu_threads = argc > 4 ? std::atoi(argv[4]) : 1;
  if (threads < 1 || scale < 1 || iters < 0 || cpu_threads < 1 || cpu_threads > 256) {
    std::fprintf(stderr, "usage: kvgc-stress [THREADS>=1 [SCALE>=1 [ITER>=0 [CPU_THREADS 1..256]]]]\n");
    return 2;
  }
  kvgc::cpu::set_split_min_slots(16);  // the segments here are short: split them anyway
  Shared sh;
  sh.model = model(3, 2, 32, KVGC_DTYPE_F16, 2);
  kvgc_heap_options o = cpu_options(8 << 20, 8);
  o.policy = KVGC_POLICY_GENERATIONAL;
  o.token_budget_fraction = 0.5;
  o.sinks = 2;
  o.window = 8;
  o.demote = KVGC_DEMOTE_INT4;
  o.compact_threshold = 0.2;
  o.cpu_threads = uint32_t(cpu_threads);
  if (kvgc_heap_create(&sh.model, &o, &sh.heap) != KVGC_OK) {
    std::fprintf(stderr, "kvgc-stress: %s\n", kvgc_errmsg(nullptr));
    return 1;
  }
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) pool.emplace_back(worker, std::ref(sh), t, scale, iters);
  for (auto& t : pool) t.join();
  if (kvgc_seq last = sh.handoff.exchange(0)) kvgc_seq_destroy(sh.heap, last);
  int rc = sh.errors ? 1 : 0;
  if (kvgc_heap_check(sh.heap) != KVGC_OK) {
    std::fprintf(stderr, "kvgc-stress: %s\n", kvgc_errmsg(sh.heap));
    rc = 1;
  }
  kvgc_stats st;
  kvgc_stats_init(&st);
  kvgc_get_stats(sh.heap, &st);
  if (st.sequences != 0 || st.slabs_free != st.slabs_total) {
    std::fprintf(stderr, "kvgc-stress: %llu sequences / %llu of %llu slabs still held\n",
                 (unsigned long long)st.sequences, (unsigned long long)(st.slabs_total - st.slabs_free),
                 (unsigned long long)st.slabs_total);
    rc = 1;
  }
  std::printf("kvgc-stress %d x %d x %d (%d attention threads): %llu steps verified, %llu hand-offs, %llu evicted, %llu demoted, "
              "%llu compactions, %llu errors: %s\n",
              threads, scale, iters, cpu_threads, (unsigned long long)sh.verified.load(),
              (unsigned long long)sh.handed.load(), (unsigned long long)st.tokens_evicted,
              (unsigned long long)st.tokens_demoted, (unsigned long long)st.compactions,
              (unsigned long long)sh.errors.load(), rc ? "FAILED" : "ok");
  kvgc_heap_destroy(sh.heap);
  return rc;
}
