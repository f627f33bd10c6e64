// kvgc-stress [THREADS [SCALE [ITER [CPU_THREADS]]]]: threads sharing one heap, in the
// spirit of mimalloc's test-stress. Each thread keeps SCALE sequences of its own; each of
// ITER rounds it appends to one (prefill chunks or decode tokens, every layer), attends
// with the new tokens as queries (on the heap's CPU_THREADS workers, split-K even over
// short segments: the split minimum is lowered), hands in attention mass, steps the GC (generational or h2o, int4 demotion, compaction), verifies
// every live token of that sequence against its (sequence, layer, position) tag, checks
// that every token read back is one it holds, once, with its exact accumulated score
// (scores must survive compaction and demotion), that no protected token went missing,
// and that every page it holds is scrubbed (padding and unwritten slots zero), and now
// and then destroys it or hands it to whichever thread comes next. Ends with the
// invariant walker, the token balance (appended - evicted = held at destruction) and a
// check that every page went back. Defaults are small for CI; a
// long configuration is recorded in docs/RELIABILITY.md.
#include <malloc.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <cstdlib>
#include <random>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "../c_api/internal.hpp"
#include "../kernels/cpu/attend_internal.hpp"
#include "page_scan.hpp"
#include "util.hpp"

using namespace kvgc_test;

namespace {

// What a sequence must hold, per layer: position -> score, kept by whichever thread
// holds the sequence (the map is shared; each model is touched only by its holder).
struct Model {
  std::vector<std::map<int32_t, float>> layers;
};

struct Shared {
  kvgc_heap* heap;
  kvgc_model_desc model;
  uint32_t sinks, window;
  std::atomic<kvgc_seq> handoff{0};
  std::atomic<uint64_t> steps{0}, verified{0}, handed{0}, errors{0}, destroyed_live{0};
  std::mutex models_mutex;
  std::unordered_map<kvgc_seq, Model> models;

  Model& model_of(kvgc_seq s) {
    std::lock_guard<std::mutex> lock(models_mutex);
    Model& m = models[s];
    m.layers.resize(model.n_layers);
    return m;
  }
  void forget(kvgc_seq s) {
    std::lock_guard<std::mutex> lock(models_mutex);
    models.erase(s);
  }
};

bool fail(kvgc_seq s, uint32_t layer, const std::string& what) {
  std::fprintf(stderr, "kvgc-stress: seq %llu layer %u: %s\n", (unsigned long long)s, layer,
               what.c_str());
  return false;
}

// The segment's live positions and scores in read order.
bool read_rows(kvgc_heap* h, kvgc_seq s, uint32_t layer, std::vector<int32_t>* pos,
               std::vector<float>* scores) {
  uint64_t n = 0;
  if (kvgc_read(h, s, layer, nullptr, nullptr, nullptr, 0, &n, nullptr) != KVGC_OK) return false;
  pos->assign(n + 1, 0);
  if (kvgc_read(h, s, layer, nullptr, nullptr, pos->data(), n, &n, nullptr) != KVGC_OK) return false;
  pos->resize(n);
  if (!scores) return true;
  scores->assign(n + 1, 0.f);
  uint64_t m = 0;
  if (kvgc_read_scores(h, s, layer, scores->data(), nullptr, n, &m, nullptr) != KVGC_OK || m != n)
    return false;
  scores->resize(n);
  return true;
}

// After a step: every token read back is one the model holds, once, with its exact
// accumulated score (through compaction, demotion and harvests); the tokens gone were
// evictable (no sink, nothing of the young window). Then the model follows the heap.
bool check_tokens(Shared& sh, kvgc_seq s, uint32_t layer, std::map<int32_t, float>& expect) {
  std::vector<int32_t> pos;
  std::vector<float> scores;
  if (!read_rows(sh.heap, s, layer, &pos, &scores)) return fail(s, layer, "read failed");
  uint64_t length = 0;
  kvgc_seq_tokens(sh.heap, s, layer, nullptr, &length);
  std::map<int32_t, float> now;
  for (size_t i = 0; i < pos.size(); ++i) {
    const auto it = expect.find(pos[i]);
    if (it == expect.end())
      return fail(s, layer, "position " + std::to_string(pos[i]) + " read back but never live");
    if (!now.emplace(pos[i], scores[i]).second)
      return fail(s, layer, "position " + std::to_string(pos[i]) + " read back twice");
    if (std::memcmp(&scores[i], &it->second, sizeof(float)) != 0)
      return fail(s, layer, "position " + std::to_string(pos[i]) + " has score " +
                                std::to_string(scores[i]) + ", expected " + std::to_string(it->second));
  }
  for (const auto& [p, score] : expect)
    if (!now.count(p) && (uint64_t(p) < sh.sinks || uint64_t(p) + sh.window >= length))
      return fail(s, layer, "protected position " + std::to_string(p) + " was lost");
  expect.swap(now);
  return true;
}

// Every page the sequence holds, byte by byte (tests/page_scan.hpp): padding and
// never-written slots must be zero, whatever another tenant left in that memory.
bool check_scrubbed(Shared& sh, kvgc_seq s) {
  kvgc::ManagedHeap* impl = kvgc::internal_heap(sh.heap);
  std::lock_guard<std::mutex> lock(impl->mutex());
  std::string bad;
  const kvgc::Status st = impl->for_each_page(s, [&](const uint8_t* page, size_t, int cls, uint32_t used) {
    if (bad.empty()) bad = scan_page(impl->layout(cls), page, used);
  });
  if (!st.ok()) return fail(s, 0, "for_each_page: " + st.msg);
  return bad.empty() ? true : fail(s, 0, "a page is not scrubbed: " + bad);
}

bool step_and_verify(Shared& sh, kvgc_seq s, std::mt19937& rng) {
  const kvgc_model_desc& m = sh.model;
  Model& model = sh.model_of(s);
  const uint32_t n = rng() % 5 == 0 ? 1 + rng() % 40 : 1;
  kvgc_attend_params params;
  kvgc_attend_params_init(&params);
  params.flags = KVGC_ATTEND_NO_SCORES;  // scores come from observe alone: the model tracks them
  for (uint32_t layer = 0; layer < m.n_layers; ++layer) {
    auto& expect = model.layers[layer];
    uint64_t len = 0, live = 0;
    if (kvgc_seq_tokens(sh.heap, s, layer, &live, &len) != KVGC_OK) return false;
    const auto k = gaussian(m, s, layer, int64_t(len), n, false), v = gaussian(m, s, layer, int64_t(len), n, true);
    const kvgc_status st = kvgc_append(sh.heap, s, layer, k.data(), v.data(), n, nullptr);
    if (st == KVGC_ENOMEM) return true;  // the arena is full for now: other threads will free
    if (st != KVGC_OK) return false;
    for (uint32_t i = 0; i < n; ++i) expect[int32_t(len + i)] = 0.f;
    std::vector<float> q(size_t(n) * m.n_q_heads * m.head_dim / 2), out(q.size());  // f16 pairs
    for (auto& x : q) x = 0.f;  // zero queries: uniform attention over what each query sees
    if (kvgc_attend(sh.heap, s, layer, q.data(), n, out.data(), &params, nullptr) != KVGC_OK)
      return false;
    std::vector<int32_t> pos;
    if (!read_rows(sh.heap, s, layer, &pos, nullptr)) return fail(s, layer, "read failed");
    if (pos.size() != expect.size())
      return fail(s, layer, std::to_string(pos.size()) + " live tokens, expected " +
                                std::to_string(expect.size()));
    std::vector<float> mass(pos.size());
    for (size_t i = 0; i < pos.size(); ++i) {
      mass[i] = float(rng() % 1000) / 1000.f;
      const auto it = expect.find(pos[i]);
      if (it == expect.end()) return fail(s, layer, "unknown position " + std::to_string(pos[i]));
      it->second += mass[i];
    }
    if (kvgc_observe(sh.heap, s, layer, mass.data(), mass.size(), nullptr) != KVGC_OK) return false;
  }
  const kvgc_status st = kvgc_step(sh.heap, s, nullptr);
  if (st != KVGC_OK && st != KVGC_EBUDGET) return false;
  sh.steps++;
  // Half the time one more token goes in while the step's results are still pending
  // (the deferred harvest must count what appends add to the tail meanwhile).
  if (rng() % 2) {
    for (uint32_t layer = 0; layer < m.n_layers; ++layer) {
      // The length from the model (kvgc_seq_tokens would apply the pending results):
      // the newest token is young, so it is always live.
      auto& expect = model.layers[layer];
      if (expect.empty()) continue;
      const uint64_t len = uint64_t(expect.rbegin()->first) + 1;
      const auto k = gaussian(m, s, layer, int64_t(len), 1, false), v = gaussian(m, s, layer, int64_t(len), 1, true);
      const kvgc_status a = kvgc_append(sh.heap, s, layer, k.data(), v.data(), 1, nullptr);
      if (a == KVGC_ENOMEM) continue;
      if (a != KVGC_OK) return fail(s, layer, "append with a GC pending failed");
      expect[int32_t(len)] = 0.f;
    }
  }
  // Now and then the whole heap's invariants (page counts against the device's bits);
  // debug builds (assert level 2) run the walker after every call already.
  if (KVGC_ASSERT_LEVEL < 2 && rng() % 8 == 0 && kvgc_heap_check(sh.heap) != KVGC_OK)
    return fail(s, 0, std::string("kvgc_heap_check: ") + kvgc_errmsg(sh.heap));
  for (uint32_t layer = 0; layer < m.n_layers; ++layer) {
    // 0.15: the int4 worst case for a single 32-element group (0.12 bounds the typical vector).
    const std::string bad = verify_gaussian(sh.heap, m, s, layer, 0.15);
    if (!bad.empty()) return fail(s, layer, bad);
    if (!check_tokens(sh, s, layer, model.layers[layer])) return false;
  }
  if (!check_scrubbed(sh, s)) return false;
  sh.verified++;
  return true;
}

// Ends a sequence, counting the tokens it still held (for the final balance).
bool destroy(Shared& sh, kvgc_seq s) {
  uint64_t total = 0;
  for (uint32_t layer = 0; layer < sh.model.n_layers; ++layer) {
    uint64_t live = 0;
    if (kvgc_seq_tokens(sh.heap, s, layer, &live, nullptr) != KVGC_OK) return false;
    total += live;
  }
  sh.destroyed_live += total;
  sh.forget(s);
  return kvgc_seq_destroy(sh.heap, s) == KVGC_OK;
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
      if (!destroy(sh, s)) sh.errors++;
      s = 0;
    } else if (r < 14) {  // hand it to another thread, take whatever was left
      s = sh.handoff.exchange(s);
      sh.handed++;
    }
  }
  for (kvgc_seq s : mine)
    if (s && !destroy(sh, s)) sh.errors++;
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
  // The arena starts as 0xA5 everywhere (glibc fills new allocations with the
  // complement of the perturb byte), like memory another tenant or process left: any
  // page byte its taker does not write shows in the scrub scan at once. (A no-op under
  // the sanitizers' allocators.)
  mallopt(M_PERTURB, 0x5a);
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
  sh.sinks = o.sinks;
  sh.window = o.window;
  if (kvgc_heap_create(&sh.model, &o, &sh.heap) != KVGC_OK) {
    std::fprintf(stderr, "kvgc-stress: %s\n", kvgc_errmsg(nullptr));
    return 1;
  }
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) pool.emplace_back(worker, std::ref(sh), t, scale, iters);
  for (auto& t : pool) t.join();
  if (kvgc_seq last = sh.handoff.exchange(0))
    if (!destroy(sh, last)) sh.errors++;
  int rc = sh.errors ? 1 : 0;
  if (kvgc_heap_check(sh.heap) != KVGC_OK) {
    std::fprintf(stderr, "kvgc-stress: %s\n", kvgc_errmsg(sh.heap));
    rc = 1;
  }
  kvgc_stats st;
  kvgc_stats_init(&st);
  kvgc_get_stats(sh.heap, &st);
  // No token lost or made up overall: what was appended and not evicted is what the
  // destroyed sequences still held.
  if (st.tokens_appended - st.tokens_evicted != sh.destroyed_live.load()) {
    std::fprintf(stderr, "kvgc-stress: %llu tokens appended - %llu evicted != %llu held at destruction\n",
                 (unsigned long long)st.tokens_appended, (unsigned long long)st.tokens_evicted,
                 (unsigned long long)sh.destroyed_live.load());
    rc = 1;
  }
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
