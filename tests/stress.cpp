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
//
// The prefix cache (0.7): a third of the new sequences start with one of four prompts
// (two private to the thread's tenant, two under a salt every thread shares; each pair
// shares its first pages, so one's cache serves part of the other): they attach the
// longest cached prefix (kvgc_prefix_attach), append the rest of the prompt (the first
// write copies a shared partly filled tail), and keep it (kvgc_prefix_keep) if the cache
// did not hold all of it; some sequences are forked (kvgc_seq_fork: pages shared) and
// cached prefixes are dropped now and then, while the arena's room comes from evicting
// them. With CPU_THREADS odd the cache pays for attached pages (the default,
// KVGC_PREFIX_CHARGE_CACHE: a sequence's GC leaves them whole); with CPU_THREADS even,
// each sequence does (SHRINK: its GC evicts them as its own and demotes them in place,
// and shared pages every holder demoted are re-stored at int4;
// VIEW's private copies run in the fuzzer, the OOM sweep and the unit tests), so that
// CI's two configurations run both. An attached or forked sequence must read back the prompt's
// (or its source's) tokens with the K/V their appends would have given, score 0 for the
// attached ones, and the token balance counts what attaches and forks hold without an
// append. At the end every cached prefix is dropped: no shared page may be left.
#include <malloc.h>

#include <algorithm>
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
#include "../kernels/cpu/convert.hpp"
#include "page_scan.hpp"
#include "util.hpp"

using namespace kvgc_test;

namespace {

// What a sequence must hold, per layer: position -> score, kept by whichever thread
// holds the sequence (the map is shared; each model is touched only by its holder), and
// which key made each position's K/V (first position -> gaussian()'s `seq`): a prompt's
// keys, a fork's source, then the sequence's own.
struct Model {
  std::vector<std::map<int32_t, float>> layers;
  std::vector<std::map<int32_t, uint64_t>> keys;
};

// A prompt: its ids, and the key of its K/V at each position: stem_key before `stem`
// (the ids it shares with another prompt: the same tokens, the same K/V), key after.
struct Prompt {
  std::vector<int32_t> ids;
  uint32_t stem;
  uint64_t stem_key, key, salt;
  uint64_t key_at(int64_t pos) const { return pos < int64_t(stem) ? stem_key : key; }
};

struct Shared {
  kvgc_heap* heap;
  kvgc_model_desc model;
  uint32_t sinks, window;
  std::atomic<kvgc_seq> handoff{0};
  std::atomic<uint64_t> steps{0}, verified{0}, handed{0}, errors{0}, destroyed_live{0};
  // The prefix cache: tokens sequences hold without appending them (attached, forked).
  std::atomic<uint64_t> attached{0}, forked{0}, prompts_started{0}, keeps{0}, forks{0}, drops{0};
  std::vector<Prompt> prompts;
  std::mutex prefixes_mutex;
  std::vector<kvgc_prefix> prefixes;  // every handle kept (some evicted or dropped since)
  std::mutex models_mutex;
  std::unordered_map<kvgc_seq, Model> models;

  Model& model_of(kvgc_seq s) {
    std::lock_guard<std::mutex> lock(models_mutex);
    Model& m = models[s];
    m.layers.resize(model.n_layers);
    m.keys.resize(model.n_layers);
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

// verify_gaussian with the model's keys: every live row's K/V bit for bit, or (an int4
// token) within int4_tol.
bool verify_keyed(Shared& sh, kvgc_seq s, uint32_t layer, const std::map<int32_t, uint64_t>& keys,
                  double int4_tol) {
  const kvgc_model_desc& m = sh.model;
  uint64_t n = 0;
  if (kvgc_read(sh.heap, s, layer, nullptr, nullptr, nullptr, 0, &n, nullptr) != KVGC_OK)
    return fail(s, layer, std::string("kvgc_read: ") + kvgc_errmsg(sh.heap));
  const size_t tb = token_bytes(m);
  std::vector<uint8_t> k(n * tb + 1), v(n * tb + 1);
  std::vector<int32_t> pos(n + 1);
  std::vector<uint8_t> cls(n + 1);
  if (kvgc_read(sh.heap, s, layer, k.data(), v.data(), pos.data(), n, &n, nullptr) != KVGC_OK ||
      kvgc_read_classes(sh.heap, s, layer, cls.data(), n, &n, nullptr) != KVGC_OK)
    return fail(s, layer, std::string("kvgc_read: ") + kvgc_errmsg(sh.heap));
  for (uint64_t r = 0; r < n; ++r) {
    const auto it = keys.upper_bound(pos[r]);
    if (it == keys.begin()) return fail(s, layer, "position " + std::to_string(pos[r]) + " was never written");
    const uint64_t key = std::prev(it)->second;
    // A token counted at fp16 reads exactly as appended; a cheaper one (demoted, or in a
    // shared page re-stored at int4 under SHRINK) within the int4 bound.
    const double tol = cls[r] == KVGC_CLASS_FP16 ? 0.0 : int4_tol;
    for (int is_v = 0; is_v < 2; ++is_v) {
      const uint8_t* got = (is_v ? v.data() : k.data()) + r * tb;
      if (std::string bad = compare_gaussian_row(m, key, layer, pos[r], got, is_v, tol); !bad.empty())
        return fail(s, layer, bad + " (key " + std::to_string(key) + ")");
    }
  }
  return true;
}

// A new sequence starts with a prompt: the longest cached prefix attached, the rest
// appended (prefill chunks, unscored attention), then kept if the cache lacked some of
// it. False when the sequence could not get its prompt (the arena full): it is destroyed.
bool start_with_prompt(Shared& sh, kvgc_seq s, std::mt19937& rng, bool* ok) {
  const kvgc_model_desc& m = sh.model;
  const Prompt& P = sh.prompts[rng() % sh.prompts.size()];
  const uint64_t n = P.ids.size();
  Model& model = sh.model_of(s);
  uint64_t got = UINT64_MAX;
  kvgc_status st = kvgc_prefix_attach(sh.heap, s, P.ids.data(), n, P.salt, &got, nullptr);
  if (st != KVGC_OK && st != KVGC_ENOMEM && st != KVGC_EBUDGET) {
    *ok = fail(s, 0, std::string("kvgc_prefix_attach: ") + kvgc_errmsg(sh.heap));
    return false;
  }
  if (st != KVGC_OK) got = 0;
  if (got > n) {
    *ok = fail(s, 0, "attached " + std::to_string(got) + " of " + std::to_string(n) + " tokens");
    return false;
  }
  sh.prompts_started++;
  sh.attached += got * m.n_layers;
  kvgc_attend_params params;
  kvgc_attend_params_init(&params);
  params.flags = KVGC_ATTEND_NO_SCORES;
  bool whole = true;
  for (uint32_t layer = 0; layer < m.n_layers; ++layer) {
    for (int64_t p = 0; p < int64_t(got); ++p) model.layers[layer][int32_t(p)] = 0.f;
    model.keys[layer].clear();
    if (got) model.keys[layer][0] = P.key_at(0);
    if (got > P.stem) model.keys[layer][int32_t(P.stem)] = P.key;
    // The rest in at most two chunks, one per key (the stem's, the prompt's own).
    for (uint64_t at = got; at < n && whole;) {
      const uint64_t end = at < P.stem ? std::min<uint64_t>(P.stem, n) : n;
      const uint32_t c = uint32_t(end - at);
      const uint64_t key = P.key_at(int64_t(at));
      const auto k = gaussian(m, key, layer, int64_t(at), c, false), v = gaussian(m, key, layer, int64_t(at), c, true);
      st = kvgc_append(sh.heap, s, layer, k.data(), v.data(), c, nullptr);
      if (st == KVGC_ENOMEM) {
        whole = false;
        break;
      }
      if (st != KVGC_OK) {
        *ok = fail(s, layer, std::string("appending a prompt: ") + kvgc_errmsg(sh.heap));
        return false;
      }
      model.keys[layer][int32_t(at)] = key;
      for (uint64_t p = at; p < end; ++p) model.layers[layer][int32_t(p)] = 0.f;
      std::vector<float> q(size_t(c) * m.n_q_heads * m.head_dim / 2, 0.f), out(q.size());
      if (kvgc_attend(sh.heap, s, layer, q.data(), c, out.data(), &params, nullptr) != KVGC_OK) {
        *ok = fail(s, layer, std::string("attending a prompt: ") + kvgc_errmsg(sh.heap));
        return false;
      }
      at = end;
    }
  }
  if (!whole) return false;  // preempted: the caller destroys it
  for (uint32_t layer = 0; layer < m.n_layers; ++layer) {
    if (!verify_keyed(sh, s, layer, model.keys[layer], 0.15)) return *ok = false;  // fp16 rows exact
    std::vector<int32_t> pos;
    std::vector<float> scores;
    if (!read_rows(sh.heap, s, layer, &pos, &scores)) return *ok = fail(s, layer, "read failed");
    if (pos.size() != n) return *ok = fail(s, layer, std::to_string(pos.size()) + " tokens after the prompt, not " + std::to_string(n));
    for (size_t i = 0; i < pos.size(); ++i)
      if (scores[i] != 0.f) return *ok = fail(s, layer, "a prompt token has score " + std::to_string(scores[i]));
  }
  if (got < n) {  // the cache lacked some of it: keep it (the first prompt pinned)
    kvgc_prefix p = 0;
    const uint32_t flags = &P == &sh.prompts[0] ? KVGC_PREFIX_PIN : 0;
    st = kvgc_prefix_keep(sh.heap, s, P.ids.data(), n, P.salt, flags, &p, nullptr);
    if (st == KVGC_OK) {
      sh.keeps++;
      std::lock_guard<std::mutex> lock(sh.prefixes_mutex);
      if (std::find(sh.prefixes.begin(), sh.prefixes.end(), p) == sh.prefixes.end()) sh.prefixes.push_back(p);
    } else if (st != KVGC_ENOMEM && st != KVGC_EBUDGET) {
      return *ok = fail(s, 0, std::string("kvgc_prefix_keep: ") + kvgc_errmsg(sh.heap));
    }
  }
  return true;
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
    model.keys[layer][int32_t(len)] = s;
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
      model.keys[layer][int32_t(len)] = s;
      expect[int32_t(len)] = 0.f;
    }
  }
  // Now and then the whole heap's invariants (page counts against the device's bits);
  // debug builds (assert level 2) run the walker after every call already.
  if (KVGC_ASSERT_LEVEL < 2 && rng() % 8 == 0 && kvgc_heap_check(sh.heap) != KVGC_OK)
    return fail(s, 0, std::string("kvgc_heap_check: ") + kvgc_errmsg(sh.heap));
  for (uint32_t layer = 0; layer < m.n_layers; ++layer) {
    // 0.15: the int4 worst case for a single 32-element group (0.12 bounds the typical vector).
    if (!verify_keyed(sh, s, layer, model.keys[layer], 0.15)) return false;
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

// A copy of s sharing its pages, in an empty slot of this thread's; its model is s's.
bool fork_into(Shared& sh, int id, kvgc_seq s, std::vector<kvgc_seq>& mine) {
  const auto slot = std::find(mine.begin(), mine.end(), kvgc_seq(0));
  if (slot == mine.end()) return true;
  kvgc_seq f = 0;
  const kvgc_status st = kvgc_seq_fork(sh.heap, s, uint32_t(id), &f, nullptr);
  if (st == KVGC_ENOMEM || st == KVGC_EBUDGET) return true;
  if (st != KVGC_OK) return fail(s, 0, std::string("kvgc_seq_fork: ") + kvgc_errmsg(sh.heap));
  const Model copy = sh.model_of(s);
  Model& model = sh.model_of(f);
  model = copy;
  uint64_t held = 0;
  for (uint32_t layer = 0; layer < sh.model.n_layers; ++layer) {
    uint64_t live = 0;
    if (kvgc_seq_tokens(sh.heap, f, layer, &live, nullptr) != KVGC_OK) return fail(f, layer, "seq_tokens failed");
    if (live != model.layers[layer].size())
      return fail(f, layer, "a fork holds " + std::to_string(live) + " tokens, its source " +
                                std::to_string(model.layers[layer].size()));
    held += live;
    if (!verify_keyed(sh, f, layer, model.keys[layer], 0.15) || !check_tokens(sh, f, layer, model.layers[layer]))
      return false;
  }
  sh.forked += held;
  sh.forks++;
  *slot = f;
  return true;
}

void worker(Shared& sh, int id, int scale, int iters) {
  std::mt19937 rng(unsigned(id) * 7919u + 1);
  std::vector<kvgc_seq> mine(size_t(scale), 0);
  for (int it = 0; it < iters; ++it) {
    kvgc_seq& s = mine[rng() % mine.size()];
    if (!s) {
      if (kvgc_seq_create(sh.heap, uint32_t(id), &s) != KVGC_OK) {
        s = 0;
        continue;
      }
      bool ok = true;
      if (rng() % 3 == 0 && !start_with_prompt(sh, s, rng, &ok)) {
        if (!ok || !destroy(sh, s)) {
          sh.errors++;
          return;
        }
        s = 0;
        continue;
      }
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
    } else if (r < 17) {  // parallel sampling: a copy that shares its pages
      if (!fork_into(sh, id, s, mine)) {
        sh.errors++;
        return;
      }
    } else if (r < 18) {  // a cached prefix dropped (it may be gone already: evicted)
      kvgc_prefix p = 0;
      {
        std::lock_guard<std::mutex> lock(sh.prefixes_mutex);
        if (!sh.prefixes.empty()) p = sh.prefixes[rng() % sh.prefixes.size()];
      }
      const kvgc_status st = p ? kvgc_prefix_drop(sh.heap, p) : KVGC_ENOTFOUND;
      if (st == KVGC_OK) sh.drops++;
      else if (st != KVGC_ENOTFOUND) {
        fail(s, 0, std::string("kvgc_prefix_drop: ") + kvgc_errmsg(sh.heap));
        sh.errors++;
        return;
      }
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
  // (SHRINK is PRUNE plus shared pages re-stored at the ladder's int4 rung.)
  o.prefix_charge = cpu_threads % 2 ? KVGC_PREFIX_CHARGE_CACHE : KVGC_PREFIX_CHARGE_SHRINK;
  sh.sinks = o.sinks;
  sh.window = o.window;
  if (kvgc_heap_create(&sh.model, &o, &sh.heap) != KVGC_OK) {
    std::fprintf(stderr, "kvgc-stress: %s\n", kvgc_errmsg(nullptr));
    return 1;
  }
  // Two pairs of prompts; each pair shares its first pages (ids, and so K/V). The first
  // pair is private to each thread's tenant, the second salted (every thread's).
  {
    constexpr uint64_t kKey = uint64_t(1) << 40;  // far from any sequence id
    Prompt a{{}, 37, kKey, kKey, 0}, b{{}, 24, kKey, kKey + 1, 0};
    for (int32_t i = 0; i < 37; ++i) a.ids.push_back(10000 + i);
    b.ids.assign(a.ids.begin(), a.ids.begin() + 24);
    for (int32_t i = 0; i < 12; ++i) b.ids.push_back(-1 - i);
    Prompt c{{}, 20, kKey + 2, kKey + 2, 0x5a1f}, d{{}, 16, kKey + 2, kKey + 3, 0x5a1f};
    for (int32_t i = 0; i < 20; ++i) c.ids.push_back(20000 + i);
    d.ids.assign(c.ids.begin(), c.ids.begin() + 16);
    for (int32_t i = 0; i < 30; ++i) d.ids.push_back(30000 + i);
    sh.prompts = {a, b, c, d};
  }
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) pool.emplace_back(worker, std::ref(sh), t, scale, iters);
  for (auto& t : pool) t.join();
  if (kvgc_seq last = sh.handoff.exchange(0))
    if (!destroy(sh, last)) sh.errors++;
  // Every cached prefix dropped (evicted ones are gone already): nothing holds a page.
  uint64_t cached = 0;
  {
    kvgc_stats st;
    kvgc_stats_init(&st);
    kvgc_get_stats(sh.heap, &st);
    cached = st.prefixes;
  }
  uint64_t dropped_at_end = 0;
  for (kvgc_prefix p : sh.prefixes) {
    const kvgc_status st = kvgc_prefix_drop(sh.heap, p);
    if (st == KVGC_OK) ++dropped_at_end;
    else if (st != KVGC_ENOTFOUND) {
      std::fprintf(stderr, "kvgc-stress: kvgc_prefix_drop(%llu): %s\n", (unsigned long long)p, kvgc_errmsg(sh.heap));
      sh.errors++;
    }
  }
  if (dropped_at_end != cached) {
    std::fprintf(stderr, "kvgc-stress: %llu cached prefixes, %llu of the kept handles dropped\n",
                 (unsigned long long)cached, (unsigned long long)dropped_at_end);
    sh.errors++;
  }
  int rc = sh.errors ? 1 : 0;
  if (kvgc_heap_check(sh.heap) != KVGC_OK) {
    std::fprintf(stderr, "kvgc-stress: %s\n", kvgc_errmsg(sh.heap));
    rc = 1;
  }
  kvgc_stats st;
  kvgc_stats_init(&st);
  kvgc_get_stats(sh.heap, &st);
  // No token lost or made up overall: what was appended (or attached, or copied by a
  // fork) and not evicted is what the destroyed sequences still held.
  if (st.tokens_appended + sh.attached.load() + sh.forked.load() - st.tokens_evicted != sh.destroyed_live.load()) {
    std::fprintf(stderr, "kvgc-stress: %llu tokens appended + %llu attached + %llu forked - %llu evicted != %llu held at destruction\n",
                 (unsigned long long)st.tokens_appended, (unsigned long long)sh.attached.load(),
                 (unsigned long long)sh.forked.load(), (unsigned long long)st.tokens_evicted,
                 (unsigned long long)sh.destroyed_live.load());
    rc = 1;
  }
  if (st.prefix_tokens_attached * sh.model.n_layers != sh.attached.load() ||
      st.prefix_lookups != sh.prompts_started.load()) {
    std::fprintf(stderr, "kvgc-stress: the stats count %llu lookups attaching %llu tokens a layer; the threads %llu, %llu\n",
                 (unsigned long long)st.prefix_lookups, (unsigned long long)st.prefix_tokens_attached,
                 (unsigned long long)sh.prompts_started.load(), (unsigned long long)sh.attached.load());
    rc = 1;
  }
  if (st.prefixes != 0 || st.shared_pages != 0 || st.shared_refs != 0 || st.cls_header.pages_used != 0) {
    std::fprintf(stderr, "kvgc-stress: %llu prefixes, %llu shared pages, %llu references, %llu header pages left\n",
                 (unsigned long long)st.prefixes, (unsigned long long)st.shared_pages,
                 (unsigned long long)st.shared_refs, (unsigned long long)st.cls_header.pages_used);
    rc = 1;
  }
  if (st.sequences != 0 || st.slabs_free != st.slabs_total) {
    std::fprintf(stderr, "kvgc-stress: %llu sequences / %llu of %llu slabs still held\n",
                 (unsigned long long)st.sequences, (unsigned long long)(st.slabs_total - st.slabs_free),
                 (unsigned long long)st.slabs_total);
    rc = 1;
  }
  std::printf("kvgc-stress prefix cache (charged to the %s): %llu prompts started, %llu hits, %llu tokens attached, %llu kept, "
              "%llu evicted, %llu dropped, %llu forks, %llu copy-on-write, %llu pages shrunk\n",
              cpu_threads % 2 ? "cache" : "sequences", (unsigned long long)sh.prompts_started.load(), (unsigned long long)st.prefix_hits,
              (unsigned long long)st.prefix_tokens_attached, (unsigned long long)sh.keeps.load(),
              (unsigned long long)st.prefix_evictions, (unsigned long long)(sh.drops.load() + dropped_at_end),
              (unsigned long long)sh.forks.load(), (unsigned long long)st.cow_copies,
              (unsigned long long)st.pages_shrunk);
  std::printf("kvgc-stress %d x %d x %d (%d attention threads): %llu steps verified, %llu hand-offs, %llu evicted, %llu demoted, "
              "%llu compactions, %llu errors: %s\n",
              threads, scale, iters, cpu_threads, (unsigned long long)sh.verified.load(),
              (unsigned long long)sh.handed.load(), (unsigned long long)st.tokens_evicted,
              (unsigned long long)st.tokens_demoted, (unsigned long long)st.compactions,
              (unsigned long long)sh.errors.load(), rc ? "FAILED" : "ok");
  kvgc_heap_destroy(sh.heap);
  return rc;
}
