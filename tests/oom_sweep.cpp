// kvgc-oom-sweep: out of memory as an outside caller meets it. The process's malloc is
// replaced (tests/malloc_hook.cpp), so *any* allocation can fail: kvgc's containers,
// its error messages, the invariant walker, std::thread's start-up state, the C++
// runtime's. For each scripted workload, with cpu_threads 1 and 4, transient (attempt N
// fails once) and persistent (every attempt from N on fails), N = 1, 2, ... until a run
// injects no fault. Each N runs in a child process under a hang alarm, so an abort, a
// crash or a deadlock is a failure naming its N.
//
// In the child only the C API calls run armed; between calls (disarmed) every outcome
// must be KVGC_OK or KVGC_ENOMEM (KVGC_EBUDGET from a step is advisory), kvgc_heap_check
// must pass, every live token must read back intact, and once the heap is destroyed no
// byte may be left allocated, by malloc's count and by kvgc's own.
//
// Usage: kvgc-oom-sweep [WORKLOAD|all [THREADS [MODE]]]   (MODE: transient|persistent)
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "../allocator/host_memory.hpp"
#include "../kernels/cpu/attend_internal.hpp"
#include "../kernels/cpu/convert.hpp"
#include "malloc_hook.hpp"
#include "util.hpp"

using namespace kvgc_test;

namespace {

constexpr unsigned kHangSeconds = 30;  // one run takes milliseconds

struct Workload {
  const char* name;
  kvgc_policy policy;
  kvgc_demote demote;
  bool bytes;  // a byte budget instead of a token budget
  bool batch = false;  // the steps go through kvgc_batch_* instead of the per-sequence calls
  bool prefix = false;  // the prefix cache's workload (run_prefix) instead of the rounds
  kvgc_prefix_charge charge = KVGC_PREFIX_CHARGE_CACHE;  // who pays for attached tokens
};
const Workload kWorkloads[] = {
    {"h2o-int4", KVGC_POLICY_H2O, KVGC_DEMOTE_INT4, false},
    // The full ladder under a byte budget (compaction whenever a page frees).
    {"generational-ladder", KVGC_POLICY_GENERATIONAL, KVGC_DEMOTE_LADDER, true},
    // The same through the batch API: plan, append and attend per layer, batched step.
    {"batch-ladder", KVGC_POLICY_GENERATIONAL, KVGC_DEMOTE_LADDER, true, true},
    // The prefix cache (0.7): keep (salted, pinned), attach (full, partial, misses),
    // copy-on-write tails, the ladder beside shared pages, a fork, a drop, and eviction of
    // cached prefixes for room (run_prefix). The cache pays for attached pages
    // (KVGC_PREFIX_CHARGE_CACHE: the sequences' GC leaves them whole) ...
    {"prefix", KVGC_POLICY_GENERATIONAL, KVGC_DEMOTE_LADDER, true, false, true},
    // ... or each sequence does (VIEW): its GC evicts and demotes shared tokens too.
    {"prefix-view", KVGC_POLICY_GENERATIONAL, KVGC_DEMOTE_LADDER, true, false, true,
     KVGC_PREFIX_CHARGE_VIEW},
    // ... or each decides as VIEW, demotes shared tokens in place, and shared pages every
    // holder demoted are re-stored at int8 (SHRINK, 0.13; the default since 0.15, which
    // retired PRUNE into it).
    {"prefix-shrink", KVGC_POLICY_GENERATIONAL, KVGC_DEMOTE_LADDER, true, false, true,
     KVGC_PREFIX_CHARGE_SHRINK},
};

// What a child reports through its pipe.
struct Report {
  uint64_t attempts = 0, faults = 0, calls = 0, enomem = 0;
  char failure[512] = {};  // empty: every check held
};

// Which key made each position's K/V, per layer: first position -> key (uniform_kv's
// `key`). An attached sequence holds the prompt's tokens, then its own; a fork its
// source's, then its own.
using KeyMap = std::vector<std::map<int64_t, uint64_t>>;

// K/V of positions [first, first + n) made with `key`: uniform in [-1, 1) from the tag
// hash (gaussian()'s log and cos took most of a run's time; int4 keeps this within its
// error bound as well).
std::vector<uint8_t> uniform_kv(const kvgc_model_desc& m, uint64_t key, uint32_t layer, int64_t first,
                                uint32_t n, bool is_v) {
  return generate(m, first, n, [&](uint8_t* dst, int64_t pos, uint32_t h, uint32_t d) {
    kvgc::cpu::store(dst, m.dtype, float(int32_t(tag(key, layer, pos, h, d, is_v))) * (1.f / 2147483648.f));
  });
}

// verify_gaussian for a sequence whose rows come from several keys (uniform_kv's data).
std::string verify_keyed(kvgc_heap* h, const kvgc_model_desc& m, kvgc_seq s, const KeyMap& keys,
                         double int4_tol) {
  const size_t tb = token_bytes(m), eb = elem_bytes(m), row = m.head_dim * eb;
  std::vector<uint8_t> k, v, expect(row);
  std::vector<int32_t> pos;
  for (uint32_t layer = 0; layer < m.n_layers; ++layer) {
    uint64_t n = 0;
    if (kvgc_read(h, s, layer, nullptr, nullptr, nullptr, 0, &n, nullptr) != KVGC_OK)
      return std::string("kvgc_read: ") + kvgc_errmsg(h);
    k.assign(n * tb + 1, 0);
    v.assign(n * tb + 1, 0);
    pos.assign(n + 1, 0);
    if (kvgc_read(h, s, layer, k.data(), v.data(), pos.data(), n, &n, nullptr) != KVGC_OK)
      return std::string("kvgc_read: ") + kvgc_errmsg(h);
    for (uint64_t r = 0; r < n; ++r) {
      auto it = keys[layer].upper_bound(pos[r]);
      if (it == keys[layer].begin())
        return "seq " + std::to_string(s) + " layer " + std::to_string(layer) + ": position " +
               std::to_string(pos[r]) + " was never written";
      const uint64_t key = std::prev(it)->second;
      for (int is_v = 0; is_v < 2; ++is_v) {
        const uint8_t* got = (is_v ? v.data() : k.data()) + r * tb;
        for (uint32_t hd = 0; hd < m.n_kv_heads; ++hd) {
          for (uint32_t d = 0; d < m.head_dim; ++d)  // uniform_kv's element, in place
            kvgc::cpu::store(&expect[d * eb], m.dtype,
                             float(int32_t(tag(key, layer, pos[r], hd, d, is_v))) * (1.f / 2147483648.f));
          if (std::memcmp(got + hd * row, expect.data(), row) == 0) continue;
          double err = 0, ref = 0;
          for (uint32_t d = 0; d < m.head_dim; ++d) {
            const double x = kvgc::cpu::load(&expect[d * eb], m.dtype);
            const double y = kvgc::cpu::load(got + hd * row + d * eb, m.dtype);
            err += (x - y) * (x - y);
            ref += x * x;
          }
          const double rel = std::sqrt(err / ref);
          if (!(rel <= int4_tol))
            return "seq " + std::to_string(s) + " layer " + std::to_string(layer) + ": " +
                   (is_v ? "V" : "K") + " of position " + std::to_string(pos[r]) + " (key " +
                   std::to_string(key) + ") head " + std::to_string(hd) +
                   " differs (relative RMSE " + std::to_string(rel) + ")";
        }
      }
    }
  }
  return "";
}

using StatusFn = std::function<kvgc_status(const char*, const std::function<kvgc_status()>&)>;

// The prefix cache (0.7) as an engine drives it, on a heap `run` made (2 layers, 8 tokens a
// page, generational with the ladder under a byte budget, a 1 MiB arena):
//   a keeper appends a 30-token prompt A (3 full pages and a partly filled one) to every
//   layer and keeps it twice: pinned for its tenant, and unpinned under a salt;
//   sequences attach: A and more (all 30: its first append copies the shared partly filled
//   tail), A's first 20 ids and others (16: two whole pages), another tenant without the
//   salt and with a wrong one (misses), another tenant with the salt (all 30), and a
//   tenant whose quota cannot pay the header pages (KVGC_EBUDGET);
//   four rounds of append, attend, observe and step over the sequences (demotion and
//   eviction of shared tokens, each holder its own: the keeper's and the fork's always,
//   an attached sequence's under KVGC_PREFIX_CHARGE_VIEW), with a fork of an attached sequence,
//   the salted prefix dropped (a later salted lookup misses), sequences destroyed (the
//   keeper too: the cached prefix keeps the pages), the pinned prefix unpinned and pinned
//   again, a late attach after the keeper is gone (its first write copies the tail);
//   three more prompts cached and their sequences destroyed (one touched by an attach),
//   then a sequence that appends until the arena is full: the unpinned cached prefixes go
//   for room, least recently used first, the pinned one stays (a late attach still hits);
//   the heap destroyed with a cached prefix and sequences holding shared pages.
// Every attach that returns KVGC_OK must attach what the prefixes cached so far promise
// (nothing evicts before the fill: the arena has room), one that fails must leave its
// sequence empty, and every live token of every sequence must read back as made (the
// prompt's key for attached positions, then the sequence's own; a fork its source's).
// Without an injected fault the counters must show every path taken.
void run_prefix(kvgc_heap* h, const kvgc_model_desc& m, const StatusFn& status, Report* rep) {
  auto failed = [&](const std::string& why) {
    if (!rep->failure[0]) std::snprintf(rep->failure, sizeof rep->failure, "%s", why.c_str());
  };
  auto api = [&](const char* what, const std::function<kvgc_status()>& call) {
    return status(what, call) == KVGC_OK;
  };
  const uint32_t L = m.n_layers;
  constexpr uint64_t kKeyA = uint64_t(1) << 20, kKeyB = kKeyA + 16, kSalt = 0x5a17, kAny = UINT64_MAX;
  struct Seq {
    kvgc_seq s = 0;
    KeyMap keys;
  };
  auto verify = [&](const Seq& q) {
    if (!q.s || rep->failure[0]) return;
    const std::string bad = verify_keyed(h, m, q.s, q.keys, 0.12);
    if (!bad.empty()) failed("data: " + bad);
  };
  auto length = [&](kvgc_seq s, uint32_t layer) {
    uint64_t len = 0;
    kvgc_seq_tokens(h, s, layer, nullptr, &len);
    return len;
  };
  auto create = [&](Seq& q, uint32_t tenant) {
    q = Seq{};
    q.keys.resize(L);
    if (!api("seq_create", [&] { return kvgc_seq_create(h, tenant, &q.s); })) q.s = 0;
    return q.s != 0;
  };
  auto destroy = [&](Seq& q) {
    if (q.s && api("seq_destroy", [&] { return kvgc_seq_destroy(h, q.s); })) q.s = 0;
  };
  // n tokens made with `key` appended to one layer at its length; then attended (a
  // prefill chunk or a decode step: the new tokens are the queries).
  auto append_layer = [&](Seq& q, uint32_t layer, uint32_t n, uint64_t key, bool attend) {
    const uint64_t len = length(q.s, layer);
    const auto k = uniform_kv(m, key, layer, int64_t(len), n, false);
    const auto v = uniform_kv(m, key, layer, int64_t(len), n, true);
    const kvgc_status st =
        status("append", [&] { return kvgc_append(h, q.s, layer, k.data(), v.data(), n, nullptr); });
    if (st != KVGC_OK) return st;
    q.keys[layer][int64_t(len)] = key;
    if (attend) {
      std::vector<uint8_t> qv(size_t(n) * m.n_q_heads * m.head_dim * 2, 0x3c), out(qv.size());
      status("attend", [&] { return kvgc_attend(h, q.s, layer, qv.data(), n, out.data(), nullptr, nullptr); });
    }
    return KVGC_OK;
  };
  // A prompt into every layer (one retry a layer: a transient fault passes).
  auto append_prompt = [&](Seq& q, uint32_t n, uint64_t key) {
    bool whole = q.s != 0;
    for (uint32_t layer = 0; layer < L && whole; ++layer) {
      if (append_layer(q, layer, n, key, true) != KVGC_OK && append_layer(q, layer, n, key, true) != KVGC_OK)
        whole = false;
      whole = whole && length(q.s, layer) == n;
    }
    return whole;
  };
  // One engine step of a sequence: its own tokens, attention, mass, the GC; then its data.
  auto step_round = [&](Seq& q, uint32_t n) {
    if (!q.s) return;
    for (uint32_t layer = 0; layer < L; ++layer) {
      if (append_layer(q, layer, n, q.s, true) != KVGC_OK) continue;
      uint64_t live = 0;
      kvgc_seq_tokens(h, q.s, layer, &live, nullptr);
      std::vector<float> mass(live, 0.25f);
      status("observe", [&] { return kvgc_observe(h, q.s, layer, mass.data(), live, nullptr); });
    }
    status("step", [&] { return kvgc_step(h, q.s, nullptr); });
    verify(q);
  };
  // Attaches ids under salt to q (empty); `expect`: the tokens a KVGC_OK must attach
  // (kAny: none, or every one of `ids`' tokens that a cached prefix may still hold).
  auto attach = [&](Seq& q, const std::vector<int32_t>& ids, uint64_t salt, uint64_t key, uint64_t expect,
                    const char* what) -> kvgc_status {
    if (!q.s) return KVGC_ENOTFOUND;
    uint64_t got = 0;
    const kvgc_status st = status(what, [&] {
      return kvgc_prefix_attach(h, q.s, ids.data(), ids.size(), salt, &got, nullptr);
    });
    if (rep->failure[0]) return st;
    if (st != KVGC_OK) got = 0;
    else if (expect == kAny ? got != 0 && got != ids.size() : got != expect)
      failed(std::string(what) + " attached " + std::to_string(got) + " tokens, expected " + std::to_string(expect));
    for (uint32_t layer = 0; layer < L; ++layer) {
      uint64_t live = 0, len = 0;
      kvgc_seq_tokens(h, q.s, layer, &live, &len);
      if (live != got || len != got)
        failed(std::string(what) + " returned " + kvgc_status_str(st) + " with " + std::to_string(got) +
               " tokens attached, but layer " + std::to_string(layer) + " holds " + std::to_string(live) +
               " live of " + std::to_string(len));
    }
    if (got)
      for (auto& k : q.keys) k[0] = key;
    verify(q);
    return st;
  };
  auto keep = [&](Seq& q, const std::vector<int32_t>& ids, uint64_t salt, uint32_t flags, const char* what) {
    kvgc_prefix p = 0;
    const kvgc_status st = status(what, [&] {
      return kvgc_prefix_keep(h, q.s, ids.data(), ids.size(), salt, flags, &p, nullptr);
    });
    if (st != KVGC_OK && p != 0) failed(std::string(what) + " failed yet wrote *prefix_out");
    if (st == KVGC_OK && p == 0) failed(std::string(what) + " returned KVGC_OK and prefix 0");
    verify(q);
    return st == KVGC_OK ? p : kvgc_prefix(0);
  };

  // The prompt, kept twice.
  std::vector<int32_t> A(30);
  for (size_t i = 0; i < A.size(); ++i) A[i] = int32_t(100 + i);
  Seq keeper, s_full, s_part, s_miss, s_salt, s_fork, s_late, s_end;
  kvgc_prefix pA = 0, pAs = 0;
  bool pinned = false, kept_salted = false;
  if (create(keeper, 0) && append_prompt(keeper, uint32_t(A.size()), kKeyA)) {
    pA = keep(keeper, A, 0, KVGC_PREFIX_PIN, "prefix_keep (pinned)");
    pinned = pA != 0;
    pAs = keep(keeper, A, kSalt, 0, "prefix_keep (salted)");
    kept_salted = pAs != 0;
    // The same ids with the same visibility: the same prefix.
    const kvgc_prefix again = keep(keeper, A, 0, 0, "prefix_keep (again)");
    if (pA && again && again != pA)
      failed("keeping the same ids again made prefix " + std::to_string(again) + ", not " + std::to_string(pA));
    if (!pA) pA = again;  // the first failed: this one is the tenant's (unpinned)
  }
  {
    std::vector<int32_t> longer = A;
    for (int32_t x : {1, 2, 3, 4, 5}) longer.push_back(x);
    if (create(s_full, 0)) {
      const uint64_t got = attach(s_full, longer, 0, kKeyA, pA ? 30 : 0, "prefix_attach (full)") == KVGC_OK && pA ? 30 : 0;
      // The rest of its prompt: the first write into the shared partly filled tail copies it.
      for (uint32_t layer = 0; layer < L; ++layer) append_layer(s_full, layer, uint32_t(longer.size() - got), s_full.s, true);
      verify(s_full);
    }
    std::vector<int32_t> partial(A.begin(), A.begin() + 20);
    for (int32_t x = 0; x < 10; ++x) partial.push_back(-1 - x);
    if (create(s_part, 0)) {
      const uint64_t got = attach(s_part, partial, 0, kKeyA, pA ? 16 : 0, "prefix_attach (partial)") == KVGC_OK && pA ? 16 : 0;
      for (uint32_t layer = 0; layer < L; ++layer) append_layer(s_part, layer, uint32_t(partial.size() - got), s_part.s, true);
      verify(s_part);
    }
    if (create(s_miss, 1)) {  // another tenant: without the salt, with another salt
      attach(s_miss, A, 0, kKeyA, 0, "prefix_attach (other tenant)");
      attach(s_miss, A, kSalt + 1, kKeyA, 0, "prefix_attach (other salt)");
      for (uint32_t layer = 0; layer < L; ++layer) append_layer(s_miss, layer, uint32_t(A.size()), s_miss.s, true);
      verify(s_miss);  // the rest of its life is any sequence's (the rounds skip it)
    }
    if (create(s_salt, 2)) attach(s_salt, A, kSalt, kKeyA, pAs ? 30 : 0, "prefix_attach (salted)");
  }
  Seq* all[] = {&keeper, &s_full, &s_part, &s_salt, &s_fork, &s_late};
  kvgc_status quota_status = KVGC_OK;
  for (int round = 0; round < 4 && !rep->failure[0]; ++round) {
    for (Seq* q : all) step_round(*q, round % 2 ? 1 : 11);
    if (round == 1 && s_full.s) {  // a fork of an attached sequence: shared pages again
      kvgc_seq f = 0;
      if (api("seq_fork", [&] { return kvgc_seq_fork(h, s_full.s, 0, &f, nullptr); })) {
        s_fork.s = f;
        s_fork.keys = s_full.keys;
        verify(s_fork);
      } else if (f != 0) {
        failed("a failed kvgc_seq_fork wrote *seq_out");
      }
    }
    if (round == 1) {  // a tenant whose quota cannot pay for one page's headers per layer
      kvgc_stats st;
      kvgc_stats_init(&st);
      kvgc_get_stats(h, &st);
      Seq poor;
      if (api("tenant_set_limit", [&] { return kvgc_tenant_set_limit(h, 3, st.cls_header.page_bytes); }) &&
          create(poor, 3)) {
        quota_status = attach(poor, A, kSalt, kKeyA, 0, "prefix_attach (over quota)");
        destroy(poor);
      }
    }
    if (round == 2) {
      if (pAs && api("prefix_drop", [&] { return kvgc_prefix_drop(h, pAs); })) {
        // Dropping it again is KVGC_ENOTFOUND whatever allocation fails: an error path
        // that allocated its message said KVGC_ENOMEM.
        malloc_hook::rearm();
        const kvgc_status again = kvgc_prefix_drop(h, pAs);
        malloc_hook::disarm();
        if (again != KVGC_ENOTFOUND)
          failed(std::string("prefix_drop of a dropped prefix returned ") + kvgc_status_str(again));
        pAs = 0;
        Seq after;  // the salted prefix is gone; its holder keeps its pages
        if (create(after, 2)) {
          attach(after, A, kSalt, kKeyA, 0, "prefix_attach (after drop)");
          destroy(after);
        }
      }
      destroy(s_part);
      destroy(keeper);  // the cached prefix keeps its pages
      if (pA && api("prefix_pin", [&] { return kvgc_prefix_pin(h, pA, 0); })) pinned = false;
      if (pA && api("prefix_pin", [&] { return kvgc_prefix_pin(h, pA, 1); })) pinned = true;
      if (create(s_late, 0)) attach(s_late, A, 0, kKeyA, pA ? 30 : 0, "prefix_attach (late)");
    }
  }

  // Cached prompts no sequence holds, then an arena filled: they go for room.
  std::vector<kvgc_prefix> cached;
  for (uint32_t i = 0; i < 3 && !rep->failure[0]; ++i) {
    std::vector<int32_t> B(24);
    for (size_t j = 0; j < B.size(); ++j) B[j] = int32_t(1000 * (i + 1) + j);
    Seq b;
    if (create(b, 0) && append_prompt(b, uint32_t(B.size()), kKeyB + i)) {
      const kvgc_prefix p = keep(b, B, 0, 0, "prefix_keep (to be evicted)");
      cached.push_back(p);
      if (i == 0) {  // looked up again: the most recently used of the three
        destroy(b);
        if (create(b, 0)) attach(b, B, 0, kKeyB, p ? 24 : 0, "prefix_attach (touch)");
      }
    }
    destroy(b);
  }
  Seq fill;
  if (create(fill, 5)) {
    for (int i = 0, misses = 0; i < 400 && misses < 2 && !rep->failure[0]; ++i) {
      bool any = false;
      for (uint32_t layer = 0; layer < L; ++layer) any |= append_layer(fill, layer, 128, fill.s, false) == KVGC_OK;
      misses = any ? 0 : misses + 1;
    }
    verify(fill);
    destroy(fill);
  }
  // The pinned prefix survived the fill.
  if (create(s_end, 0)) attach(s_end, A, 0, kKeyA, !pA ? 0 : pinned ? 30 : kAny, "prefix_attach (after the fill)");
  for (Seq* q : all) verify(*q);
  verify(s_miss);
  verify(s_end);
  destroy(s_miss);

  if (!rep->failure[0] && malloc_hook::faults() == 0) {  // every path taken
    kvgc_stats st;
    kvgc_stats_init(&st);
    kvgc_get_stats(h, &st);
    std::string missing;
    if (!pA || !kept_salted) missing += " keep";
    if (st.prefix_hits < 6) missing += " hits (" + std::to_string(st.prefix_hits) + ")";
    if (st.cow_copies == 0) missing += " copy-on-write";
    if (st.tokens_demoted == 0) missing += " demotion";
    if (st.prefix_evictions < cached.size() || cached.size() != 3)
      missing += " evictions (" + std::to_string(st.prefix_evictions) + ")";
    if (st.prefixes != 1 || st.prefixes_pinned != 1) missing += " the pinned prefix";
    if (!s_fork.s) missing += " fork";
    if (quota_status != KVGC_EBUDGET) missing += std::string(" quota (") + kvgc_status_str(quota_status) + ")";
    if (st.shared_pages == 0 || st.shared_refs <= st.shared_pages) missing += " shared pages";
    if (!missing.empty()) failed("the run without faults missed:" + missing);
  }
  malloc_hook::rearm();
  kvgc_heap_destroy(h);  // a cached prefix and holders of shared pages still in it
  malloc_hook::disarm();
}

// One run of a workload; the allocation plan is already set (and disarmed).
void run(const Workload& w, unsigned threads, Report* rep) {
  auto failed = [&](const std::string& why) {
    if (!rep->failure[0]) std::snprintf(rep->failure, sizeof rep->failure, "%s", why.c_str());
  };
  const kvgc_model_desc m = model(2, 2, 32, KVGC_DTYPE_F16, 2);
  kvgc_heap_options o = cpu_options(1 << 20, 8);
  o.policy = w.policy;
  o.sinks = 2;
  o.window = 4;
  (w.bytes ? o.byte_budget_fraction : o.token_budget_fraction) = 0.4;
  o.compact_threshold = 0.2;
  o.demote = w.demote;
  o.cpu_threads = threads;
  o.prefix_charge = w.charge;
  kvgc_heap* h = nullptr;
  const int64_t host_baseline = kvgc::host::outstanding_bytes();

  // A C API call, armed; then its outcome and the heap are checked, disarmed. `status`
  // returns what the call returned (KVGC_EINTERNAL once a check has failed).
  auto status = [&](const char* what, const std::function<kvgc_status()>& call) {
    if (rep->failure[0]) return KVGC_EINTERNAL;
    malloc_hook::rearm();
    const kvgc_status st = call();
    malloc_hook::disarm();
    ++rep->calls;
    // Freeing never fails for want of memory: that is how an engine gets memory back.
    if (st == KVGC_ENOMEM && (!std::strcmp(what, "seq_destroy") || !std::strcmp(what, "prefix_drop")))
      failed(std::string(what) + " returned KVGC_ENOMEM: freeing must never need memory");
    if (st == KVGC_ENOMEM) ++rep->enomem;
    else if (st != KVGC_OK && st != KVGC_EBUDGET)
      failed(std::string(what) + " returned " + kvgc_status_str(st) + ": " + kvgc_errmsg(h));
    if (!rep->failure[0] && h && kvgc_heap_check(h) != KVGC_OK)
      failed(std::string("after ") + what + ": " + kvgc_errmsg(h));
    return rep->failure[0] ? KVGC_EINTERNAL : st;
  };
  auto api = [&](const char* what, const std::function<kvgc_status()>& call) {
    return status(what, call) == KVGC_OK;
  };
  // Checks seq's data, made for `tag` (a fork holds its source's tokens).
  auto verify = [&](kvgc_seq s, kvgc_seq tag) {
    for (uint32_t layer = 0; layer < m.n_layers && !rep->failure[0]; ++layer) {
      const std::string bad = verify_gaussian(h, m, s, tag, layer, 0.12);
      if (!bad.empty()) failed("data: " + bad);
    }
  };

  if (w.prefix) {
    if (api("heap_create", [&] { return kvgc_heap_create(&m, &o, &h); })) run_prefix(h, m, status, rep);
  } else if (api("heap_create", [&] { return kvgc_heap_create(&m, &o, &h); })) {
    kvgc_seq seqs[3] = {0, 0, 0}, fork = 0, fork_of = 0;
    kvgc_batch* batch = nullptr;
    if (w.batch && !api("batch_create", [&] { return kvgc_batch_create(h, &batch); })) batch = nullptr;
    for (int round = 0; round < 6 && !rep->failure[0]; ++round) {
      if (w.batch) {  // one engine step over every live sequence
        for (kvgc_seq& s : seqs)
          if (!s && !api("seq_create", [&] { return kvgc_seq_create(h, uint32_t(round), &s); })) s = 0;
        if (!batch && !api("batch_create", [&] { return kvgc_batch_create(h, &batch); })) batch = nullptr;
        std::vector<kvgc_seq> live_seqs;
        for (kvgc_seq s : seqs)
          if (s) live_seqs.push_back(s);
        const uint32_t n = round % 2 ? 1 : 11;
        std::vector<uint32_t> n_new(live_seqs.size(), n);
        uint32_t failed_at = 0;
        if (batch && api("batch_plan", [&] {
              return kvgc_batch_plan(batch, live_seqs.data(), n_new.data(), uint32_t(live_seqs.size()), &failed_at, nullptr);
            })) {
          for (uint32_t layer = 0; layer < m.n_layers; ++layer) {
            std::vector<uint8_t> k, v;
            for (kvgc_seq s : live_seqs) {
              uint64_t length = 0;
              kvgc_seq_tokens(h, s, layer, nullptr, &length);
              const auto ks = gaussian(m, s, layer, int64_t(length), n, false);
              const auto vs = gaussian(m, s, layer, int64_t(length), n, true);
              k.insert(k.end(), ks.begin(), ks.end());
              v.insert(v.end(), vs.begin(), vs.end());
            }
            if (!api("batch_append", [&] { return kvgc_batch_append(batch, layer, k.data(), v.data(), nullptr); }))
              continue;
            std::vector<uint8_t> q(live_seqs.size() * n * m.n_q_heads * m.head_dim * 2, 0x3c), out(q.size());
            api("batch_attend", [&] { return kvgc_batch_attend(batch, layer, q.data(), out.data(), nullptr, nullptr); });
          }
          api("batch_step", [&] { return kvgc_batch_step(batch, nullptr); });
        }
        for (kvgc_seq s : live_seqs) verify(s, s);
        if (round == 3 && seqs[1] && api("seq_destroy", [&] { return kvgc_seq_destroy(h, seqs[1]); })) seqs[1] = 0;
        continue;
      }
      for (kvgc_seq& s : seqs) {
        if (!s && !api("seq_create", [&] { return kvgc_seq_create(h, uint32_t(round), &s); })) {
          s = 0;
          continue;
        }
        for (uint32_t layer = 0; layer < m.n_layers; ++layer) {
          uint64_t length = 0;
          kvgc_seq_tokens(h, s, layer, nullptr, &length);
          const uint32_t n = round % 2 ? 1 : 11;
          const auto k = gaussian(m, s, layer, int64_t(length), n, false);
          const auto v = gaussian(m, s, layer, int64_t(length), n, true);
          if (!api("append", [&] { return kvgc_append(h, s, layer, k.data(), v.data(), n, nullptr); }))
            continue;
          std::vector<uint8_t> q(size_t(n) * m.n_q_heads * m.head_dim * 2, 0x3c), out(q.size());
          api("attend", [&] { return kvgc_attend(h, s, layer, q.data(), n, out.data(), nullptr, nullptr); });
          uint64_t live = 0;
          kvgc_seq_tokens(h, s, layer, &live, nullptr);
          std::vector<float> mass(live, 0.25f);
          api("observe", [&] { return kvgc_observe(h, s, layer, mass.data(), live, nullptr); });
          std::vector<float> scores(live);
          uint64_t got = 0;
          api("read_scores", [&] {
            return kvgc_read_scores(h, s, layer, scores.data(), nullptr, live, &got, nullptr);
          });
        }
        api("step", [&] { return kvgc_step(h, s, nullptr); });
        kvgc_stats st;
        kvgc_stats_init(&st);
        api("get_stats", [&] { return kvgc_get_stats(h, &st); });
        verify(s, s);
      }
      if (round == 2 && seqs[0]) {  // a fork of a sequence, kept as it was
        if (api("seq_fork", [&] { return kvgc_seq_fork(h, seqs[0], 9, &fork, nullptr); }))
          fork_of = seqs[0];
        else
          fork = 0;
      }
      if (fork) verify(fork, fork_of);
      if (round == 4 && fork && api("seq_destroy", [&] { return kvgc_seq_destroy(h, fork); }))
        fork = 0;
      if (round == 3 && seqs[1]) {  // a request ends
        if (api("seq_destroy", [&] { return kvgc_seq_destroy(h, seqs[1]); })) seqs[1] = 0;
      }
      if (round == 4)
        api("tenant_set_limit", [&] { return kvgc_tenant_set_limit(h, 4, 1 << 20); });
    }
    // The failure window is over (the heap is checked disarmed after every call): every
    // sequence left must still read back intact, and destruction must free everything.
    for (kvgc_seq s : seqs)
      if (s) verify(s, s);
    if (fork) verify(fork, fork_of);
    malloc_hook::rearm();
    kvgc_batch_destroy(batch);
    kvgc_heap_destroy(h);
    malloc_hook::disarm();
  }
  if (kvgc::host::outstanding_bytes() != host_baseline)
    failed("kvgc's host::allocate has " +
           std::to_string(kvgc::host::outstanding_bytes() - host_baseline) +
           " bytes outstanding after kvgc_heap_destroy");
}

// Forks a child that runs the workload with attempt `n` failing; false if it crashed,
// hung or failed a check (with *why).
bool child_run(const Workload& w, unsigned threads, bool persistent, uint64_t n, Report* rep,
               std::string* why) {
  int fds[2];
  if (pipe(fds) != 0) {
    *why = "pipe failed";
    return false;
  }
  std::fflush(nullptr);
  const pid_t pid = fork();
  if (pid == 0) {
    close(fds[0]);
    alarm(kHangSeconds);
    Report r;
    const int64_t live_before = malloc_hook::live_bytes();
    malloc_hook::arm(n, persistent);
    malloc_hook::disarm();
    run(w, threads, &r);
    r.attempts = malloc_hook::attempts();
    r.faults = malloc_hook::faults();
    const int64_t leaked = malloc_hook::live_bytes() - live_before;
    if (!r.failure[0] && leaked != 0)
      std::snprintf(r.failure, sizeof r.failure, "%lld bytes of malloc still held after destroy",
                    (long long)leaked);
    if (write(fds[1], &r, sizeof r) != ssize_t(sizeof r)) _exit(3);
    _exit(0);
  }
  close(fds[1]);
  if (pid < 0) {
    close(fds[0]);
    *why = "fork failed";
    return false;
  }
  size_t got = 0;
  while (got < sizeof *rep) {
    const ssize_t k = read(fds[0], reinterpret_cast<char*>(rep) + got, sizeof *rep - got);
    if (k <= 0) break;
    got += size_t(k);
  }
  close(fds[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    *why = sig == SIGALRM ? "hung (no progress in " + std::to_string(kHangSeconds) + " s)"
                          : std::string("killed by signal ") + strsignal(sig) +
                                (sig == SIGABRT ? " (std::terminate or abort)" : "");
    return false;
  }
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0 || got != sizeof *rep) {
    *why = "exited with status " + std::to_string(WEXITSTATUS(status));
    return false;
  }
  if (rep->failure[0]) {
    *why = rep->failure;
    return false;
  }
  return true;
}

bool sweep(const Workload& w, unsigned threads, bool persistent) {
  const char* mode = persistent ? "persistent" : "transient";
  Report clean;
  std::string why;
  if (!child_run(w, threads, persistent, 0, &clean, &why)) {
    std::printf("FAIL %s threads=%u: the run without faults failed: %s\n", w.name, threads,
                why.c_str());
    return false;
  }
  uint64_t runs = 0, saw_enomem = 0;
  for (uint64_t n = 1;; ++n) {
    Report r;
    if (!child_run(w, threads, persistent, n, &r, &why)) {
      std::printf("FAIL %s threads=%u %s: allocation %llu of %llu failing: %s\n", w.name,
                  threads, mode, (unsigned long long)n, (unsigned long long)clean.attempts,
                  why.c_str());
      return false;
    }
    ++runs;
    saw_enomem += r.enomem > clean.enomem;  // the prefix workload's fill meets it anyway
    if (r.faults == 0) break;  // past the last attempt: the sweep is complete
  }
  std::printf("ok   %s threads=%u %s: %llu allocations per run, %llu faulted runs, %llu saw "
              "KVGC_ENOMEM\n",
              w.name, threads, mode, (unsigned long long)clean.attempts,
              (unsigned long long)runs - 1, (unsigned long long)saw_enomem);
  if (saw_enomem == 0) {
    std::printf("FAIL %s: no run saw KVGC_ENOMEM: the hook does not reach the library\n", w.name);
    return false;
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string only = argc > 1 ? argv[1] : "all";
  const unsigned only_threads = argc > 2 ? unsigned(std::atoi(argv[2])) : 0;
  const std::string only_mode = argc > 3 ? argv[3] : "";
  kvgc::cpu::set_split_min_slots(16);  // short segments: split attention over the pool anyway
  {
    // Warm-up outside the sweep, so lazily built statics (of the C++ runtime, glibc) exist
    // in every child before its baseline is taken.
    Report r;
    run(kWorkloads[0], 4, &r);
  }
  bool ok = true;
  int swept = 0;
  for (const Workload& w : kWorkloads) {
    if (only != "all" && only != w.name) continue;
    for (unsigned threads : {1u, 4u}) {
      if (only_threads && threads != only_threads) continue;
      for (bool persistent : {false, true}) {
        if (!only_mode.empty() && only_mode != (persistent ? "persistent" : "transient")) continue;
        ok = sweep(w, threads, persistent) && ok;
        ++swept;
      }
    }
  }
  if (swept == 0) {
    std::fprintf(stderr, "usage: kvgc-oom-sweep [h2o-int4|generational-ladder|batch-ladder|prefix|prefix-view|all [1|4 [transient|persistent]]]\n");
    return 2;
  }
  std::printf("%s\n", ok ? "kvgc-oom-sweep: every run OK" : "kvgc-oom-sweep: FAILED");
  return ok ? 0 : 1;
}
