// Fault injection, as SQLite tests its malloc failures: a scripted workload runs with
// "the Nth attempt to obtain memory fails" (once: transient; or from N on: persistent)
// for N = 1, 2, ... until a run hits no fault. Every call must return KVGC_OK or
// KVGC_ENOMEM; after each, kvgc_heap_check passes and every still-live token reads back
// intact; when the heap is destroyed, no host byte remains allocated (LeakSanitizer
// checks the same in the sanitizer build).
#include <doctest/doctest.h>

#include <functional>
#include <string>

#include "../allocator/host_memory.hpp"
#include "util.hpp"

using namespace kvgc_test;
namespace host = kvgc::host;

namespace {

struct Paused {  // verification must neither count attempts nor fail
  Paused() { host::pause_faults(true); }
  ~Paused() { host::pause_faults(false); }
};

struct Run {
  int calls = 0, enomem = 0;
  std::string failure;  // empty: every invariant held
};

// The scripted workload. `ok` records a call's status and verifies the heap after it.
Run workload(kvgc_policy policy, bool demote) {
  Run run;
  const kvgc_model_desc m = model(2, 2, 32, KVGC_DTYPE_F16, 2);
  kvgc_heap_options o = cpu_options(1 << 20, 8);
  o.policy = policy;
  o.sinks = 2;
  o.window = 4;
  o.token_budget_fraction = 0.4;
  o.compact_threshold = 0.2;
  o.demote = demote ? KVGC_DEMOTE_INT4 : KVGC_DEMOTE_OFF;
  kvgc_heap* h = nullptr;
  auto ok = [&](kvgc_status st, const char* what) {
    ++run.calls;
    if (!run.failure.empty()) return false;
    if (st == KVGC_ENOMEM) ++run.enomem;
    else if (st != KVGC_OK && st != KVGC_EBUDGET)
      run.failure = std::string(what) + " returned " + kvgc_status_str(st) + ": " + kvgc_errmsg(h);
    if (run.failure.empty() && h) {
      Paused p;
      if (kvgc_heap_check(h) != KVGC_OK) run.failure = std::string("after ") + what + ": " + kvgc_errmsg(h);
    }
    return st == KVGC_OK && run.failure.empty();
  };
  auto verify = [&](kvgc_seq s) {
    Paused p;
    for (uint32_t layer = 0; layer < m.n_layers && run.failure.empty(); ++layer) {
      const std::string bad = verify_gaussian(h, m, s, layer, 0.12);
      if (!bad.empty()) run.failure = "data: " + bad;
    }
  };
  if (!ok(kvgc_heap_create(&m, &o, &h), "heap_create")) {
    kvgc_heap_destroy(h);
    return run;
  }
  kvgc_seq seqs[3] = {0, 0, 0};
  for (int round = 0; round < 6 && run.failure.empty(); ++round) {
    for (kvgc_seq& s : seqs) {
      if (!s && !ok(kvgc_seq_create(h, uint32_t(round), &s), "seq_create")) {
        s = 0;
        continue;
      }
      for (uint32_t layer = 0; layer < m.n_layers; ++layer) {
        uint64_t length = 0;
        {
          Paused p;
          kvgc_seq_tokens(h, s, layer, nullptr, &length);
        }
        const uint32_t n = round % 2 ? 1 : 11;
        std::vector<uint8_t> k, v;
        {
          Paused p;
          k = gaussian(m, s, layer, int64_t(length), n, false);
          v = gaussian(m, s, layer, int64_t(length), n, true);
        }
        if (!ok(kvgc_append(h, s, layer, k.data(), v.data(), n, nullptr), "append")) continue;
        std::vector<uint8_t> q(2 * 2 * 32 * 2, 0x3c), out(q.size());
        ok(kvgc_attend(h, s, layer, q.data(), 1, out.data(), nullptr, nullptr), "attend");
        uint64_t live = 0;
        {
          Paused p;
          kvgc_seq_tokens(h, s, layer, &live, nullptr);
        }
        std::vector<float> mass(live, 0.25f);
        ok(kvgc_observe(h, s, layer, mass.data(), live, nullptr), "observe");
      }
      ok(kvgc_step(h, s, nullptr), "step");
      verify(s);
    }
    if (round == 3 && seqs[1]) {  // a request ends
      ok(kvgc_seq_destroy(h, seqs[1]), "seq_destroy");
      seqs[1] = 0;
    }
  }
  kvgc_heap_destroy(h);
  return run;
}

void sweep(kvgc_policy policy, bool demote, bool persistent) {
  CAPTURE(policy);
  CAPTURE(demote);
  CAPTURE(persistent);
  const int64_t baseline = host::outstanding_bytes();
  host::set_faults(0, false);
  const Run clean = workload(policy, demote);
  const uint64_t total = host::attempts();
  REQUIRE(clean.failure.empty());
  REQUIRE(clean.enomem == 0);
  REQUIRE(host::outstanding_bytes() == baseline);
  uint64_t runs = 0, saw_enomem = 0;
  for (uint64_t n = 1;; ++n) {
    host::set_faults(n, persistent);
    const Run r = workload(policy, demote);
    const uint64_t injected = host::faults_injected();
    host::set_faults(0, false);
    INFO("fault at attempt " << n << " of " << total);
    REQUIRE(r.failure.empty());
    REQUIRE(host::outstanding_bytes() == baseline);  // nothing leaked, whatever failed
    ++runs;
    saw_enomem += r.enomem > 0;
    if (injected == 0) break;  // past the last attempt: the sweep is complete
  }
  MESSAGE("policy " << int(policy) << std::string(demote ? " +int4" : "")
                    << std::string(persistent ? " persistent" : " transient") << ": " << total << " memory attempts per run, " << runs << " faulted runs, "
                    << saw_enomem << " of them saw KVGC_ENOMEM");
  CHECK(runs >= total);
  CHECK(saw_enomem > 0);
}

}  // namespace

TEST_CASE("fault injection: every allocation failure is KVGC_ENOMEM, leaves a valid heap, loses nothing") {
  for (bool persistent : {false, true}) {
    sweep(KVGC_POLICY_H2O, true, persistent);
    sweep(KVGC_POLICY_GENERATIONAL, false, persistent);
  }
}
