// What sharing costs: kvgc_prefix_attach and kvgc_seq_fork against copying the prefix's
// pages (what kvgc_seq_fork did before 0.7, and what an engine without prefix sharing
// pays at least: writing the same K/V again), at 1K, 16K and 128K tokens, side by side
// in one run on the CPU backend.
//
//   kvgc-bench-prefix [--quick]
//
// Attach and fork write a header page per (layer, page) and copy no K/V byte, so their
// time per page stays flat in the prefix's length while the copy grows with its bytes.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "bench_util.hpp"
#include "kvgc.h"

using namespace kvgc::bench;

namespace {

bool ok(kvgc_status st, kvgc_heap* h, const char* what) {
  if (st == KVGC_OK) return true;
  std::fprintf(stderr, "%s: %s: %s\n", what, kvgc_status_str(st), kvgc_errmsg(h));
  return false;
}

// The serving question, in bytes: N requests that each begin with one P-token prefix, then
// their own R tokens and D decode steps (attention with scores every step, kvgc_step after
// each; prompts scored by their last 32 queries, then one step, as kvgc-run's observe
// prefill). Returns the arena bytes in use once all N are in, or 0 on a failure.
struct Workload {
  uint32_t prefix, own, decode, requests;
};

uint64_t serve_bytes(const kvgc_model_desc& m, uint32_t pt, const Workload& w, bool share,
                     double byte_fraction, bool ladder, bool view, uint64_t* demoted) {
  kvgc_heap_options o;
  kvgc_heap_options_init(&o);
  o.flags |= KVGC_OPT_IGNORE_ENV;
  o.device = KVGC_DEVICE_CPU;
  o.page_tokens = pt;
  o.budget_bytes = 1ull << 30;
  o.policy = byte_fraction > 0 ? KVGC_POLICY_GENERATIONAL : KVGC_POLICY_FULL;
  o.byte_budget_fraction = byte_fraction;
  if (!ladder) o.demote = KVGC_DEMOTE_OFF;  // else the default ladder decides the rungs
  // Each holder pays for what it keeps (view), or the cache for the prefix (docs/PERF.md
  // names the rule; the default since 0.15 is shrink, measured by kvgc-bench-serve).
  o.prefix_charge = view ? KVGC_PREFIX_CHARGE_VIEW : KVGC_PREFIX_CHARGE_CACHE;
  kvgc_heap* h = nullptr;
  if (!ok(kvgc_heap_create(&m, &o, &h), nullptr, "kvgc_heap_create")) return 0;
  const size_t row = size_t(m.n_kv_heads) * m.head_dim, qrow = size_t(m.n_q_heads) * m.head_dim;
  auto values = [](size_t n, uint64_t salt) {  // f16 in [-1, 1), deterministic
    std::vector<uint16_t> x(n);
    uint64_t z = salt * 0x9e3779b97f4a7c15ull + 1;
    for (auto& e : x) {
      z ^= z >> 12, z ^= z << 25, z ^= z >> 27;
      const uint64_t r = z * 0x2545f4914f6cdd1dull;
      e = uint16_t(((r >> 63) << 15) | (0x3800 + (r >> 40) % 0x0400));  // +-[0.5, 1)
    }
    return x;
  };
  std::vector<int32_t> ids(w.prefix);
  std::iota(ids.begin(), ids.end(), 1);
  const auto pk = values(size_t(w.prefix) * row, 1), pv = values(size_t(w.prefix) * row, 2);
  std::vector<kvgc_seq> seqs;
  bool good = true;
  for (uint32_t r = 0; r < w.requests && good; ++r) {
    kvgc_seq s;
    good &= ok(kvgc_seq_create(h, 0, &s), h, "kvgc_seq_create");
    seqs.push_back(s);
    uint64_t got = 0;
    if (share) good &= ok(kvgc_prefix_attach(h, s, ids.data(), w.prefix, 0, &got, nullptr), h, "attach");
    for (uint32_t l = 0; l < m.n_layers && got < w.prefix; ++l)
      good &= ok(kvgc_append(h, s, l, pk.data(), pv.data(), w.prefix, nullptr), h, "kvgc_append");
    if (share && got < w.prefix)
      good &= ok(kvgc_prefix_keep(h, s, ids.data(), w.prefix, 0, 0, nullptr, nullptr), h, "keep");
    int64_t len = w.prefix;
    auto run = [&](uint32_t n, uint32_t scored) {
      const auto k = values(size_t(n) * row, 100 + r * 7 + uint64_t(len)), v = values(size_t(n) * row, 200 + r * 7 + uint64_t(len));
      const auto q = values(size_t(scored) * qrow, 300 + r * 7 + uint64_t(len));
      std::vector<uint16_t> out(q.size());
      for (uint32_t l = 0; l < m.n_layers; ++l) {
        good &= ok(kvgc_append(h, s, l, k.data(), v.data(), n, nullptr), h, "kvgc_append");
        good &= ok(kvgc_attend(h, s, l, q.data(), scored, out.data(), nullptr, nullptr), h, "kvgc_attend");
      }
      len += n;
      const kvgc_status st = kvgc_step(h, s, nullptr);
      good &= st == KVGC_OK || st == KVGC_EBUDGET;
    };
    run(w.own, 32);
    for (uint32_t d = 0; d < w.decode && good; ++d) run(1, 1);
  }
  kvgc_stats st;
  kvgc_stats_init(&st);
  good &= ok(kvgc_get_stats(h, &st), h, "kvgc_get_stats");
  *demoted = st.tokens_demoted;
  kvgc_heap_destroy(h);
  return good ? st.arena_bytes - st.scratch_bytes - st.free_bytes : 0;
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false;
  if (const int status = quick_only_args(argc, argv, &quick); status >= 0) return status;
  kvgc_model_desc m;
  kvgc_model_desc_init(&m);
  m.n_layers = 4;
  m.n_kv_heads = 4;
  m.n_q_heads = 16;
  m.head_dim = 64;
  m.dtype = KVGC_DTYPE_F16;
  const uint32_t pt = 16;
  const std::vector<uint32_t> lengths = quick ? std::vector<uint32_t>{1024, 4096}
                                              : std::vector<uint32_t>{1024, 16384, 131072};
  const int reps = quick ? 3 : 7;
  std::printf("kvgc %s: attach and fork vs copying the prefix (CPU, %u layers x %u kv heads x %u, f16, "
              "page %u tokens; median of %d)\n\n",
              kvgc_version(), m.n_layers, m.n_kv_heads, m.head_dim, pt, reps);
  std::printf("%8s %8s %12s %12s %12s %12s %16s\n", "tokens", "pages", "attach us", "fork us",
              "copy us", "append us", "attach ns/page");
  ResultLine result;
  std::vector<double> per_page;
  double attach_last = NAN, copy_last = NAN, fork_last = NAN;
  for (const uint32_t n : lengths) {
    kvgc_heap_options o;
    kvgc_heap_options_init(&o);
    o.flags |= KVGC_OPT_IGNORE_ENV;
    o.device = KVGC_DEVICE_CPU;
    o.page_tokens = pt;
    o.policy = KVGC_POLICY_FULL;
    uint64_t prefix_bytes = 0;
    kvgc_kv_bytes(&m, n, KVGC_CLASS_FP16, pt, &prefix_bytes);
    o.budget_bytes = prefix_bytes * 2 + (64u << 20);  // the prefix, its copy, headers, slack
    kvgc_heap* h = nullptr;
    if (!ok(kvgc_heap_create(&m, &o, &h), nullptr, "kvgc_heap_create")) return 1;
    kvgc_seq keeper;
    if (!ok(kvgc_seq_create(h, 0, &keeper), h, "kvgc_seq_create")) return 1;
    const size_t token_bytes = size_t(m.n_kv_heads) * m.head_dim * 2;
    std::vector<uint16_t> kv(size_t(n) * token_bytes / 2);
    for (size_t i = 0; i < kv.size(); ++i) kv[i] = uint16_t(0x3000 + (i * 7919) % 0x0800);
    Timer t;
    for (uint32_t l = 0; l < m.n_layers; ++l)
      if (!ok(kvgc_append(h, keeper, l, kv.data(), kv.data(), n, nullptr), h, "kvgc_append")) return 1;
    const double append_us = t.elapsed_ns() / 1e3;
    std::vector<int32_t> ids(n);
    std::iota(ids.begin(), ids.end(), 1);
    if (!ok(kvgc_prefix_keep(h, keeper, ids.data(), n, 0, 0, nullptr, nullptr), h, "kvgc_prefix_keep")) return 1;
    bool good = true;
    const Summary attach = median_of(reps, [&] {
      kvgc_seq s;
      good &= ok(kvgc_seq_create(h, 0, &s), h, "kvgc_seq_create");
      uint64_t got = 0;
      const Timer a;
      good &= ok(kvgc_prefix_attach(h, s, ids.data(), n, 0, &got, nullptr), h, "kvgc_prefix_attach");
      const double ns = a.elapsed_ns();
      good &= got == n;
      kvgc_seq_destroy(h, s);
      return ns / 1e3;
    });
    const Summary fork = median_of(reps, [&] {
      kvgc_seq s = 0;
      const Timer a;
      good &= ok(kvgc_seq_fork(h, keeper, 0, &s, nullptr), h, "kvgc_seq_fork");
      const double ns = a.elapsed_ns();
      kvgc_seq_destroy(h, s);
      return ns / 1e3;
    });
    // The copy 0.6's fork made: every page's bytes, once (a memcpy of the prefix's bytes
    // into memory already touched, so page faults do not count against it).
    std::vector<uint8_t> from(prefix_bytes, 1), to(from.size(), 0);
    const Summary copy = median_of(reps, [&] {
      const Timer a;
      std::memcpy(to.data(), from.data(), from.size());
      do_not_optimize(to[to.size() / 2]);
      return a.elapsed_ns() / 1e3;
    });
    kvgc_heap_destroy(h);
    if (!good) return 1;
    const uint64_t pages = uint64_t(m.n_layers) * ((n + pt - 1) / pt);
    const double ns_page = attach.median * 1e3 / double(pages);
    per_page.push_back(ns_page);
    std::printf("%8u %8llu %12.1f %12.1f %12.1f %12.1f %14.1f\n", n, (unsigned long long)pages,
                attach.median, fork.median, copy.median, append_us, ns_page);
    attach_last = attach.median;
    fork_last = fork.median;
    copy_last = copy.median;
  }
  // Bytes: full cache and the default ladder at 20% of the bytes, with and without sharing.
  const Workload w = quick ? Workload{512, 128, 16, 4} : Workload{2048, 256, 128, 16};
  std::printf("\n%u requests: a shared %u-token prefix, %u tokens of their own, %u decode steps; "
              "arena bytes once all are in\n",
              w.requests, w.prefix, w.own, w.decode);
  std::printf("%-30s %14s %14s %12s\n", "configuration", "bytes", "per request", "demoted");
  double bytes[7] = {};
  const char* names[7] = {"full cache", "full cache + sharing", "ladder 20%", "ladder 20% + sharing",
                          "eviction 20%", "eviction 20% + sharing", "ladder 20% + sharing, view"};
  for (int c = 0; c < 7; ++c) {
    uint64_t demoted = 0;
    const bool share = c == 6 || (c & 1);
    bytes[c] = double(serve_bytes(m, pt, w, share, c >= 2 ? 0.2 : 0.0, c < 4 || c == 6, c == 6, &demoted));
    if (bytes[c] == 0) return 1;
    std::printf("%-30s %14.0f %14.0f %12llu\n", names[c], bytes[c], bytes[c] / w.requests,
                (unsigned long long)demoted);
  }
  const double best_alone = std::min(bytes[1], bytes[2]);
  const double best_evict_alone = std::min(bytes[1], bytes[4]);
  std::printf("requests per arena against the better of sharing alone and pruning alone: "
              "ladder + sharing %.2fx, eviction + sharing %.2fx\n",
              best_alone / bytes[3], best_evict_alone / bytes[5]);
  const std::string last = quick ? "4k" : "128k";
  std::printf("\nattach per page, longest / shortest prefix: %.2f (flat = 1); copy / attach at %s: %.1f\n",
              per_page.back() / per_page.front(), last.c_str(), copy_last / attach_last);
  result.add("share_ladder_vs_best_alone", ratio(best_alone, bytes[3]));
  result.add("share_evict_vs_best_alone", ratio(best_evict_alone, bytes[5]));
  result.add("share_ladder_view_vs_ladder", ratio(bytes[2], bytes[6]));
  result.add("share_vs_full", ratio(bytes[0], bytes[1]));
  result.add("prune_vs_full", ratio(bytes[0], bytes[2]));
  result.add("copy_vs_attach_" + last, ratio(copy_last, attach_last), 1);
  result.add("copy_vs_fork_" + last, ratio(copy_last, fork_last), 1);
  result.add("attach_per_page_" + last + "_vs_1k", per_page.back() / per_page.front());
  result.add("attach_us_" + last, attach_last, 1);
  result.add("fork_us_" + last, fork_last, 1);
  result.print();
  return 0;
}
