// bench/gc: what the GC costs per token appended, generational against h2o's full
// ranking at the same token budget, side by side in one run, in the two regimes users
// run: eviction only (KVGC_DEMOTE=off) and the default storage ladder (int8, int4, then
// eviction); and compaction's throughput against memcpy of the same bytes.
//
// GC cost: one segment (Llama-3-8B's per-layer KV: 8 KV heads x 128, f16, pages of 16)
// with a token budget of B (B = 4K; --full adds 32K), decoded from empty to R x B tokens (R = 4):
// each step appends one token, hands in attention mass for every live token (untimed:
// that is the engine's attention) and calls kvgc_step (timed: with the default deferred
// harvest it also applies the previous collection's results and compacts). Both
// policies' work is bursty (generational: a minor GC per page, a refresh major per 8
// minors; h2o: nothing until the budget, then under the ladder one collection gives back
// a band of demotions and the next waits until appends have used it up),
// so nothing is sampled in a short window: the cost is the total step time of the run
// divided by the tokens appended, every burst included. It is split into the filling
// part (tokens 1..B: no segment can be over its budget, nothing is given back) and the
// rest (past the budget), and reported with the tokens ranked per token appended.
// Repetitions alternate the policies (generational, h2o, generational, ...); median and
// min over them.
//
// --census (untimed, no ratios): what generational's collections did, per part and regime:
// minors that gave something back, minors that only promoted, minors that did neither, and
// majors, with the tokens each kind ranked (what generational does under budget:
// docs/records/perf-2026-12-02-gc-cost.md).
//
// Compaction: 32K tokens of the same shape in pages with half the slots dead at random,
// compacted by the CPU op (restored from a pristine copy before each repetition), against
// one memcpy of as many bytes as the op moves.
#include <algorithm>
#include <bit>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "../gc/compaction.hpp"
#include "../kernels/cpu/gc.hpp"
#include "bench_util.hpp"
#include "kvgc.h"

using namespace kvgc;
using namespace kvgc::bench;

namespace {

constexpr uint32_t kKvHeads = 8, kHeadDim = 128, kPageTokens = 16;

#define CHECK_OK(heap, call)                                                        \
  do {                                                                              \
    kvgc_status s_ = (call);                                                        \
    if (s_ != KVGC_OK) {                                                            \
      std::fprintf(stderr, "%s: %s: %s\n", #call, kvgc_status_str(s_), kvgc_errmsg(heap)); \
      std::exit(1);                                                                 \
    }                                                                               \
  } while (0)

// One run's totals, per part: [0] filling (tokens 1..B), [1] past the budget.
struct Part {
  double step_ns = 0;
  uint64_t tokens = 0, ranked = 0, gcs = 0, minors = 0, majors = 0, evicted = 0, demoted = 0;
};
struct RunCost {
  Part part[2];
  uint64_t live_end = 0, long_term_end = 0;
  double us_per_token(int p) const { return part[p].step_ns / 1e3 / double(part[p].tokens); }
  double ranked_per_token(int p) const { return double(part[p].ranked) / double(part[p].tokens); }
  double us_per_token_all() const {
    return (part[0].step_ns + part[1].step_ns) / 1e3 / double(part[0].tokens + part[1].tokens);
  }
  double ranked_per_token_all() const {
    return double(part[0].ranked + part[1].ranked) / double(part[0].tokens + part[1].tokens);
  }
};

RunCost decode_run(kvgc_policy policy, kvgc_demote demote, uint32_t budget, uint32_t length,
                   const std::vector<uint16_t>& kv, const std::vector<float>& mass) {
  kvgc_model_desc m;
  kvgc_model_desc_init(&m);
  m.n_layers = 1;
  m.n_q_heads = 32;
  m.n_kv_heads = kKvHeads;
  m.head_dim = kHeadDim;
  m.dtype = KVGC_DTYPE_F16;
  kvgc_heap_options o;
  kvgc_heap_options_init(&o);
  o.flags = KVGC_OPT_IGNORE_ENV;
  o.device = KVGC_DEVICE_CPU;
  o.policy = policy;
  o.demote = demote;
  o.token_budget = budget;
  o.page_tokens = kPageTokens;
  uint64_t bytes = 0;
  kvgc_kv_bytes(&m, 2ull * budget + 4096, KVGC_CLASS_FP16, kPageTokens, &bytes);
  o.budget_bytes = bytes + (64ull << 20);
  kvgc_heap* h = nullptr;
  CHECK_OK(nullptr, kvgc_heap_create(&m, &o, &h));
  kvgc_seq s;
  CHECK_OK(h, kvgc_seq_create(h, 0, &s));
  RunCost rc;
  kvgc_stats st0, st1;
  kvgc_stats_init(&st0);
  kvgc_stats_init(&st1);
  for (int p = 0; p < 2; ++p) {
    Part& part = rc.part[p];
    CHECK_OK(h, kvgc_get_stats(h, &st0));  // applies the last step's results: exact counts
    const uint32_t end = p == 0 ? budget : length;
    for (uint32_t at = p == 0 ? 0 : budget; at < end; ++at) {
      CHECK_OK(h, kvgc_append(h, s, 0, kv.data(), kv.data(), 1, nullptr));
      uint64_t n = 0;
      CHECK_OK(h, kvgc_seq_tokens(h, s, 0, &n, nullptr));
      CHECK_OK(h, kvgc_observe(h, s, 0, mass.data(), n, nullptr));
      const Timer t;
      const kvgc_status status = kvgc_step(h, s, nullptr);
      part.step_ns += t.elapsed_ns();
      CHECK_OK(h, status);
      ++part.tokens;
    }
    CHECK_OK(h, kvgc_get_stats(h, &st1));
    part.ranked = st1.tokens_ranked - st0.tokens_ranked;
    part.gcs = st1.gcs - st0.gcs;
    part.minors = st1.minor_gcs - st0.minor_gcs;
    part.majors = st1.major_gcs - st0.major_gcs;
    part.evicted = st1.tokens_evicted - st0.tokens_evicted;
    part.demoted = st1.tokens_demoted - st0.tokens_demoted;
  }
  rc.live_end = st1.live_tokens;
  rc.long_term_end = st1.tier_tokens[KVGC_GEN_LONG_TERM];
  CHECK_OK(h, kvgc_heap_check(h));
  kvgc_heap_destroy(h);
  return rc;
}

// The census (--census, untimed): generational's collections classified by what they did,
// read from the stats after every step (which applies each step's results at once, so it
// is kept out of the timed runs): minors that gave something back (evicted or demoted),
// minors that only promoted, minors that did neither, and majors; with the tokens each
// kind ranked (the stats' tokens_ranked: candidates whose key the op computed).
struct Census {
  uint64_t n[4] = {0, 0, 0, 0}, ranked[4] = {0, 0, 0, 0}, majors_giving = 0;
  std::vector<double> ns[4];  // kvgc_step times (the results are applied outside it, by the stats)
};
enum { kMinorGiving, kMinorPromoting, kMinorIdle, kMajor };

void census_run(kvgc_demote demote, uint32_t budget, uint32_t length, const std::vector<uint16_t>& kv,
                const std::vector<float>& mass, Census out[2]) {
  kvgc_model_desc m;
  kvgc_model_desc_init(&m);
  m.n_layers = 1;
  m.n_q_heads = 32;
  m.n_kv_heads = kKvHeads;
  m.head_dim = kHeadDim;
  m.dtype = KVGC_DTYPE_F16;
  kvgc_heap_options o;
  kvgc_heap_options_init(&o);
  o.flags = KVGC_OPT_IGNORE_ENV;
  o.device = KVGC_DEVICE_CPU;
  o.policy = KVGC_POLICY_GENERATIONAL;
  o.demote = demote;
  o.token_budget = budget;
  o.page_tokens = kPageTokens;
  uint64_t bytes = 0;
  kvgc_kv_bytes(&m, 2ull * budget + 4096, KVGC_CLASS_FP16, kPageTokens, &bytes);
  o.budget_bytes = bytes + (64ull << 20);
  kvgc_heap* h = nullptr;
  CHECK_OK(nullptr, kvgc_heap_create(&m, &o, &h));
  kvgc_seq s;
  CHECK_OK(h, kvgc_seq_create(h, 0, &s));
  kvgc_stats a, b;
  kvgc_stats_init(&a);
  kvgc_stats_init(&b);
  CHECK_OK(h, kvgc_get_stats(h, &a));
  for (uint32_t t = 0; t < length; ++t) {
    CHECK_OK(h, kvgc_append(h, s, 0, kv.data(), kv.data(), 1, nullptr));
    uint64_t n = 0;
    CHECK_OK(h, kvgc_seq_tokens(h, s, 0, &n, nullptr));
    CHECK_OK(h, kvgc_observe(h, s, 0, mass.data(), n, nullptr));
    const Timer timer;
    CHECK_OK(h, kvgc_step(h, s, nullptr));
    const double ns = timer.elapsed_ns();
    CHECK_OK(h, kvgc_get_stats(h, &b));
    Census& c = out[t < budget ? 0 : 1];
    const uint64_t given = (b.tokens_evicted - a.tokens_evicted) + (b.tokens_demoted - a.tokens_demoted);
    int kind = -1;
    if (b.major_gcs > a.major_gcs) {
      kind = kMajor;
      c.majors_giving += given > 0;
    } else if (b.minor_gcs > a.minor_gcs) {
      kind = given ? kMinorGiving : b.tokens_promoted > a.tokens_promoted ? kMinorPromoting : kMinorIdle;
    }
    if (kind >= 0) {
      ++c.n[kind];
      c.ranked[kind] += b.tokens_ranked - a.tokens_ranked;
      c.ns[kind].push_back(ns);
    }
    a = b;
  }
  CHECK_OK(h, kvgc_heap_check(h));
  kvgc_heap_destroy(h);
}

struct CompactCost {
  double compact_ns = NAN, memcpy_ns = NAN;
  uint64_t bytes = 0, slots = 0;
};

CompactCost compaction_vs_memcpy(uint32_t tokens, int reps) {
  const PageLayout L = PageLayout::make(kPageTokens, kKvHeads, kHeadDim, KVGC_DTYPE_F16, KVGC_CLASS_FP16);
  const uint32_t pages = tokens / kPageTokens;
  const size_t arena = size_t(pages) * L.bytes;
  auto* pristine = static_cast<uint8_t*>(std::aligned_alloc(4096, arena));
  auto* work = static_cast<uint8_t*>(std::aligned_alloc(4096, arena));
  std::mt19937 rng(9);
  for (size_t i = 0; i < arena; i += 4) {
    const uint32_t x = rng();
    std::memcpy(pristine + i, &x, 4);
  }
  host::vector<PageCounts> counts(pages);
  for (uint32_t p = 0; p < pages; ++p) {
    uint8_t* page = pristine + size_t(p) * L.bytes;
    auto* live = reinterpret_cast<uint32_t*>(page + L.live_off);
    live[0] = 0;
    for (uint32_t s = 0; s < kPageTokens; ++s) {
      reinterpret_cast<int32_t*>(page + L.pos_off)[s] = int32_t(p * kPageTokens + s);
      page[L.gen_off + s] = kGenIntermediate;
      if (rng() % 2) live[0] |= 1u << s;  // half the slots dead, scattered
    }
    counts[p] = {kPageTokens, uint32_t(std::popcount(live[0]))};
  }
  const CompactionPlan plan = plan_compaction(counts, kPageTokens);
  std::vector<CompactMove> moves;
  for (const Move& m : plan.moves)
    moves.push_back({work + size_t(m.dst) * L.bytes, work + size_t(m.src) * L.bytes, m.count});
  const CompactOp op{L, moves.data(), uint32_t(moves.size())};
  CompactCost c;
  c.slots = plan.slots_moved;
  // K and V rows of every head plus the slot's position, score and generation.
  c.bytes = plan.slots_moved * (2 * kKvHeads * L.slot_stride + 4 + 4 + 1);
  c.compact_ns = median_of(reps, [&] {
    std::memcpy(work, pristine, arena);  // restore, untimed
    const Timer t;
    cpu::compact(op);
    const double ns = t.elapsed_ns();
    do_not_optimize(work[0]);
    return ns;
  }).median;
  auto* src = static_cast<uint8_t*>(std::aligned_alloc(4096, c.bytes + 4096));
  auto* dst = static_cast<uint8_t*>(std::aligned_alloc(4096, c.bytes + 4096));
  std::memcpy(src, pristine, std::min<size_t>(c.bytes, arena));
  std::memset(dst, 1, c.bytes);
  c.memcpy_ns = median_of(reps, [&] {
    std::memcpy(work, pristine, arena);  // the same cache disturbance as above
    const Timer t;
    std::memcpy(dst, src, c.bytes);
    const double ns = t.elapsed_ns();
    do_not_optimize(dst[0]);
    return ns;
  }).median;
  // The op must have kept every live token: count live bits after one more run.
  std::memcpy(work, pristine, arena);
  cpu::compact(op);
  uint64_t live_after = 0, live_before = 0;
  for (uint32_t p = 0; p < pages; ++p) {
    live_before += counts[p].live;
    live_after += std::popcount(*reinterpret_cast<uint32_t*>(work + size_t(p) * L.bytes + L.live_off));
  }
  if (live_after != live_before) {
    std::fprintf(stderr, "compaction lost tokens: %llu -> %llu\n", (unsigned long long)live_before,
                 (unsigned long long)live_after);
    std::exit(1);
  }
  std::free(pristine);
  std::free(work);
  std::free(src);
  std::free(dst);
  return c;
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false, census = false;
  // The default takes under a minute (B = 4K); --full adds B = 32K, PERF.md's grid (about an
  // hour on a 2-core VM: every step hands in mass for every live token).
  std::vector<uint32_t> budgets = {4096};
  uint32_t runs = 4;  // a run decodes from empty to runs x budget tokens
  int reps = 3;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--quick") {  // wins over --full and --budgets, wherever it stands
      quick = true;
    } else if (a == "--full") {
      budgets = {4096, 32768};
    } else if (a == "--census") {
      census = true;
    } else if (a.rfind("--budgets=", 0) == 0) {
      budgets.clear();
      for (size_t at = 10; at < a.size();) {
        const size_t comma = std::min(a.find(',', at), a.size());
        budgets.push_back(uint32_t(std::stoul(a.substr(at, comma - at))));
        at = comma + 1;
      }
    } else if (a.rfind("--runs=", 0) == 0) {
      runs = uint32_t(std::stoul(a.substr(7)));
    } else if (a.rfind("--reps=", 0) == 0) {
      reps = std::stoi(a.substr(7));
    } else {  // --help: the usage on stdout, status 0; anything else: on stderr, status 2
      const bool help = a == "--help";
      std::fprintf(help ? stdout : stderr,
                   "usage: %s [--quick | --full] [--census] [--budgets=4096,32768] [--runs=4] [--reps=3]\n"
                   "  default: B = 4096 (under a minute); --full: B = 4096 and 32768 (docs/PERF.md's grid,\n"
                   "  about an hour); --quick: B = 1024, one repetition (seconds)\n",
                   argv[0]);
      return help ? 0 : 2;
    }
  }
  if (quick) {
    budgets = {1024};
    reps = 1;
  }
  std::printf("kvgc-bench-gc: one segment, 8 KV heads x 128 dims f16, page 16 tokens, CPU backend\n");
  if (!census)
    std::printf("decode from empty to %u x the token budget B: per token, append 1, observe mass for\n"
                "every live token (untimed), kvgc_step (timed). Cost = total step time / tokens appended,\n"
                "every burst included; 'fill' = tokens 1..B (under budget), 'past' = tokens B+1..%uB.\n"
                "%d repetition(s) alternating the policies: median (min) of us per token appended;\n"
                "ratios are h2o / generational, per repetition pair, median (min).\n\n",
                runs, runs, reps);
  const uint32_t max_len = runs * *std::max_element(budgets.begin(), budgets.end());
  std::vector<uint16_t> kv(size_t(kKvHeads) * kHeadDim);
  std::mt19937 rng(5);
  for (auto& x : kv) x = uint16_t(rng() & 0x3bff);  // finite halves in (-1, 1)
  // Attention mass: a fixed heavy-tailed draw per row (in kvgc_read order), over B.
  std::vector<float> mass_draw(max_len + 1);
  std::exponential_distribution<float> expo(1.0f);
  for (auto& x : mass_draw) x = expo(rng) * expo(rng);

  if (census) {  // what generational's collections did, fill and past the budget; untimed
    ResultLine result;
    std::printf("census: generational's collections by what they did (untimed; decode from empty to %u x B)\n\n", runs);
    std::printf("| budget | regime | part | minors giving back (ranked) | minors only promoting (ranked) | "
                "minors doing neither (ranked) | majors (ranked; giving back) | share of ranking in minors doing neither "
                "| median us per kvgc_step: giving / promoting / neither / major |\n");
    std::printf("|---|---|---|---|---|---|---|---|---|\n");
    for (uint32_t budget : budgets) {
      std::vector<float> mass(mass_draw);
      for (auto& x : mass) x /= float(budget);
      for (kvgc_demote d : {KVGC_DEMOTE_OFF, KVGC_DEMOTE_LADDER}) {
        Census c[2];
        census_run(d, budget, runs * budget, kv, mass, c);
        for (int part = 0; part < 2; ++part) {
          const Census& x = c[part];
          auto us = [&](int k) {  // median: a busy machine's preemptions would swamp a mean
            if (x.ns[k].empty()) return double(NAN);
            return median_of(int(x.ns[k].size()), [&, i = size_t(0)]() mutable { return x.ns[k][i++]; }).median / 1e3;
          };
          const uint64_t all = x.ranked[0] + x.ranked[1] + x.ranked[2] + x.ranked[3];
          const double idle = all ? double(x.ranked[kMinorIdle]) / double(all) : NAN;
          std::printf("| %u | %s | %s | %llu (%llu) | %llu (%llu) | %llu (%llu) | %llu (%llu; %llu) | %.2f | %.0f / %.0f / %.0f / %.0f |\n", budget,
                      d == KVGC_DEMOTE_OFF ? "evict" : "ladder", part ? "past" : "fill",
                      (unsigned long long)x.n[kMinorGiving], (unsigned long long)x.ranked[kMinorGiving],
                      (unsigned long long)x.n[kMinorPromoting], (unsigned long long)x.ranked[kMinorPromoting],
                      (unsigned long long)x.n[kMinorIdle], (unsigned long long)x.ranked[kMinorIdle],
                      (unsigned long long)x.n[kMajor], (unsigned long long)x.ranked[kMajor],
                      (unsigned long long)x.majors_giving, idle, us(0), us(1), us(2), us(3));
          std::fflush(stdout);
          result.add(std::string("idle_minor_share_") + (part ? "past_" : "fill_") +
                         (d == KVGC_DEMOTE_OFF ? "evict_" : "ladder_") + std::to_string(budget / 1024) + "k",
                     idle);
        }
      }
    }
    result.print();
    return 0;
  }
  ResultLine result;
  // Ratios first in the RESULT line, the largest budget's first.
  std::map<uint32_t, std::vector<std::pair<std::string, double>>, std::greater<>> ratios;
  std::vector<std::pair<std::string, double>> extra;
  const struct {
    const char* name;
    kvgc_demote demote;
  } regimes[] = {{"evict", KVGC_DEMOTE_OFF}, {"ladder", KVGC_DEMOTE_LADDER}};
  const struct {
    const char* name;
    kvgc_policy policy;
  } policies[] = {{"generational", KVGC_POLICY_GENERATIONAL}, {"h2o", KVGC_POLICY_H2O}};
  for (uint32_t budget : budgets) {
    std::vector<float> mass(mass_draw);
    for (auto& x : mass) x /= float(budget);
    const std::string k = std::to_string(budget / 1024) + "k";
    for (const auto& regime : regimes) {
      std::printf("### budget %u tokens, %s (KVGC_DEMOTE=%s), decode to %u tokens\n\n", budget,
                  regime.name, regime.demote == KVGC_DEMOTE_OFF ? "off" : "int8,int4 (default)",
                  runs * budget);
      std::printf("| policy | us/token all | us/token fill | us/token past | ranked/token all | "
                  "ranked/token fill | ranked/token past | collections fill | collections past | "
                  "evicted | demoted | live at end (long-term) |\n");
      std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|\n");
      std::fflush(stdout);
      std::vector<RunCost> by[2];
      for (int r = 0; r < reps; ++r)
        for (int p = 0; p < 2; ++p)
          by[p].push_back(decode_run(policies[p].policy, regime.demote, budget, runs * budget, kv, mass));
      Summary all[2], fill[2], past[2];
      for (int p = 0; p < 2; ++p) {
        const auto& v = by[p];
        all[p] = median_of(reps, [&, i = 0]() mutable { return v[i++].us_per_token_all(); });
        fill[p] = median_of(reps, [&, i = 0]() mutable { return v[i++].us_per_token(0); });
        past[p] = median_of(reps, [&, i = 0]() mutable { return v[i++].us_per_token(1); });
        const RunCost& c = v[0];  // counts are deterministic: the same in every repetition
        auto gcs = [&](const Part& x) {  // generational: minor + major
          return p == 0 ? std::to_string(x.minors) + " + " + std::to_string(x.majors) : std::to_string(x.gcs);
        };
        std::printf("| %s | %.2f (%.2f) | %.2f (%.2f) | %.2f (%.2f) | %.0f | %.0f | %.0f | "
                    "%s | %s | %llu | %llu | %llu (%llu) |\n",
                    policies[p].name, all[p].median, all[p].min, fill[p].median, fill[p].min,
                    past[p].median, past[p].min, c.ranked_per_token_all(), c.ranked_per_token(0),
                    c.ranked_per_token(1), gcs(c.part[0]).c_str(), gcs(c.part[1]).c_str(),
                    (unsigned long long)(c.part[0].evicted + c.part[1].evicted),
                    (unsigned long long)(c.part[0].demoted + c.part[1].demoted),
                    (unsigned long long)c.live_end, (unsigned long long)c.long_term_end);
      }
      const Summary tr = median_of(reps, [&, i = 0]() mutable {
        const double x = ratio(by[1][i].us_per_token_all(), by[0][i].us_per_token_all());
        ++i;
        return x;
      });
      const Summary tr_past = median_of(reps, [&, i = 0]() mutable {
        const double x = ratio(by[1][i].us_per_token(1), by[0][i].us_per_token(1));
        ++i;
        return x;
      });
      const double rr = ratio(by[1][0].ranked_per_token_all(), by[0][0].ranked_per_token_all());
      const double rr_past = ratio(by[1][0].ranked_per_token(1), by[0][0].ranked_per_token(1));
      std::printf("\nh2o / generational: time per token %.2fx (min %.2fx) over the run, %.2fx (min %.2fx) "
                  "past the budget; ranked per token %.2fx over the run, %.2fx past the budget\n\n",
                  tr.median, tr.min, tr_past.median, tr_past.min, rr, rr_past);
      std::fflush(stdout);
      const std::string sfx = std::string("_") + regime.name + "_" + k;
      auto& rs = ratios[budget];
      rs.push_back({"time_ratio" + sfx, tr.median});
      rs.push_back({"ranked_ratio" + sfx, rr});
      rs.push_back({"time_ratio_past" + sfx, tr_past.median});
      rs.push_back({"ranked_ratio_past" + sfx, rr_past});
      extra.push_back({"gen_us_tok" + sfx, all[0].median});
      extra.push_back({"h2o_us_tok" + sfx, all[1].median});
      extra.push_back({"gen_ranked_tok" + sfx, by[0][0].ranked_per_token_all()});
      extra.push_back({"h2o_ranked_tok" + sfx, by[1][0].ranked_per_token_all()});
    }
  }
  const CompactCost c = compaction_vs_memcpy(32768, quick ? 3 : 9);
  const double throughput_ratio = ratio(c.memcpy_ns, c.compact_ns);
  std::printf("compaction: %llu slots moved (%.1f MiB incl. metadata) in %.2f ms; memcpy of the same "
              "bytes %.2f ms; throughput ratio %.2f\n",
              (unsigned long long)c.slots, double(c.bytes) / (1 << 20), c.compact_ns / 1e6,
              c.memcpy_ns / 1e6, throughput_ratio);
  for (const auto& [budget, rs] : ratios)
    for (const auto& [key, v] : rs) result.add(key, v);
  result.add("compact_vs_memcpy", throughput_ratio);
  for (const auto& [key, v] : extra) result.add(key, v, 2);
  result.add("compact_GBps", double(c.bytes) / c.compact_ns, 2);
  result.print();
  return 0;
}
