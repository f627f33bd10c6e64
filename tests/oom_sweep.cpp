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
#include <string>
#include <vector>

#include "../allocator/host_memory.hpp"
#include "../kernels/cpu/attend_internal.hpp"
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
};
const Workload kWorkloads[] = {
    {"h2o-int4", KVGC_POLICY_H2O, KVGC_DEMOTE_INT4, false},
    // The full ladder under a byte budget (compaction whenever a page frees).
    {"generational-ladder", KVGC_POLICY_GENERATIONAL, KVGC_DEMOTE_LADDER, true},
    // The same through the batch API: plan, append and attend per layer, batched step.
    {"batch-ladder", KVGC_POLICY_GENERATIONAL, KVGC_DEMOTE_LADDER, true, true},
};

// What a child reports through its pipe.
struct Report {
  uint64_t attempts = 0, faults = 0, calls = 0, enomem = 0;
  char failure[512] = {};  // empty: every check held
};

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
  kvgc_heap* h = nullptr;
  const int64_t host_baseline = kvgc::host::outstanding_bytes();

  // A C API call, armed; then its outcome and the heap are checked, disarmed.
  auto api = [&](const char* what, const std::function<kvgc_status()>& call) {
    if (rep->failure[0]) return false;
    malloc_hook::rearm();
    const kvgc_status st = call();
    malloc_hook::disarm();
    ++rep->calls;
    if (st == KVGC_ENOMEM) ++rep->enomem;
    else if (st != KVGC_OK && st != KVGC_EBUDGET)
      failed(std::string(what) + " returned " + kvgc_status_str(st) + ": " + kvgc_errmsg(h));
    if (!rep->failure[0] && h && kvgc_heap_check(h) != KVGC_OK)
      failed(std::string("after ") + what + ": " + kvgc_errmsg(h));
    return st == KVGC_OK && !rep->failure[0];
  };
  // Checks seq's data, made for `tag` (a fork holds its source's tokens).
  auto verify = [&](kvgc_seq s, kvgc_seq tag) {
    for (uint32_t layer = 0; layer < m.n_layers && !rep->failure[0]; ++layer) {
      const std::string bad = verify_gaussian(h, m, s, tag, layer, 0.12);
      if (!bad.empty()) failed("data: " + bad);
    }
  };

  if (api("heap_create", [&] { return kvgc_heap_create(&m, &o, &h); })) {
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
    saw_enomem += r.enomem > 0;
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
    std::fprintf(stderr, "usage: kvgc-oom-sweep [h2o-int4|generational-ladder|batch-ladder|all [1|4 [transient|persistent]]]\n");
    return 2;
  }
  std::printf("%s\n", ok ? "kvgc-oom-sweep: every run OK" : "kvgc-oom-sweep: FAILED");
  return ok ? 0 : 1;
}
