#include "options.hpp"

#include <sched.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <string_view>

#include "../kernels/page_layout.hpp"

namespace kvgc {
namespace {

constexpr uint64_t kDefaultSeed = 0x6b766763;  // "kvgc"
constexpr uint32_t kDefaultSlab = 0;  // sized from the model's pages (heap.cpp)
constexpr uint32_t kMaxSinks = 1u << 20;
constexpr uint32_t kMaxWindow = 1u << 24;
constexpr uint32_t kMaxMinLength = 1u << 31;
constexpr uint32_t kMaxThreads = 256;  // cpu::ThreadPool::kMaxThreads
// Generational's minor GCs rank by recent attention: streaming perplexity (2K tokens of
// the Jargon File, 256-token cache) 1.059x the full cache at 0.97, 1.061x at 0.9, 1.060x
// at 0.7, 1.066x at 0.99, against 1.132x by the accumulated score (1) and streaming's
// 1.104x; passkey retrieval unchanged (docs/QUALITY.md).
constexpr double kDefaultRecentDecay = 0.95;

struct Choice {
  const char* name;
  int value;
};
constexpr Choice kDevices[] = {{"auto", KVGC_DEVICE_AUTO}, {"cpu", KVGC_DEVICE_CPU},
                               {"cuda", KVGC_DEVICE_CUDA}};
constexpr Choice kPolicies[] = {{"generational", KVGC_POLICY_GENERATIONAL},
                                {"full", KVGC_POLICY_FULL},
                                {"streaming", KVGC_POLICY_STREAMING},
                                {"h2o", KVGC_POLICY_H2O},
                                {"random", KVGC_POLICY_RANDOM}};
constexpr Choice kDemotes[] = {{"off", KVGC_DEMOTE_OFF},
                               {"int4", KVGC_DEMOTE_INT4},
                               {"int8", KVGC_DEMOTE_INT8},
                               {"int8,int4", KVGC_DEMOTE_LADDER},
                               {"int8,int4,int2", KVGC_DEMOTE_LADDER_INT2}};
constexpr Choice kHarvests[] = {{"deferred", KVGC_HARVEST_DEFERRED},
                                {"immediate", KVGC_HARVEST_IMMEDIATE}};
constexpr Choice kPrefixCharges[] = {{"cache", KVGC_PREFIX_CHARGE_CACHE},
                                     {"view", KVGC_PREFIX_CHARGE_VIEW},
                                     {"prune", KVGC_PREFIX_CHARGE_PRUNE},
                                     {"shrink", KVGC_PREFIX_CHARGE_SHRINK}};
constexpr Choice kLayerBudgets[] = {{"uniform", KVGC_LAYER_BUDGET_UNIFORM},
                                    {"pyramid", KVGC_LAYER_BUDGET_PYRAMID},
                                    {"entropy", KVGC_LAYER_BUDGET_ENTROPY}};

template <size_t N>
const char* choice_name(const Choice (&c)[N], int v) {
  for (const Choice& x : c)
    if (x.value == v) return x.name;
  return "?";
}
template <size_t N>
bool parse_choice(const Choice (&c)[N], const std::string& s, int* out) {
  for (const Choice& x : c)
    if (s == x.name) {
      *out = x.value;
      return true;
    }
  return false;
}

std::string trim(const char* s) {
  std::string t(s);
  const auto b = t.find_first_not_of(" \t");
  const auto e = t.find_last_not_of(" \t");
  return b == std::string::npos ? std::string() : t.substr(b, e - b + 1);
}

bool parse_double(const std::string& s, double* out) {
  if (s.empty()) return false;
  errno = 0;
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  if (errno || end != s.c_str() + s.size() || !std::isfinite(v)) return false;
  *out = v;
  return true;
}

// "25%" -> 0.25; (0, 100] only.
bool parse_percent(const std::string& s, double* fraction) {
  double p;
  if (!parse_double(s.substr(0, s.size() - 1), &p) || p <= 0 || p > 100) return false;
  *fraction = p / 100;
  return true;
}

bool parse_u64(const std::string& s, uint64_t* out) {
  if (s.empty() || s[0] == '-' || s[0] == '+') return false;
  errno = 0;
  char* end = nullptr;
  const bool hex = s.size() > 2 && s[0] == '0' && (s[1] == 'x' || s[1] == 'X');
  const unsigned long long v = std::strtoull(s.c_str(), &end, hex ? 16 : 10);
  if (errno || end != s.c_str() + s.size()) return false;
  *out = v;
  return true;
}

bool parse_u32_range(const std::string& s, uint32_t lo, uint32_t hi, uint32_t* out) {
  uint64_t v;
  if (!parse_u64(s, &v) || v < lo || v > hi) return false;
  *out = uint32_t(v);
  return true;
}

// The CPUs this process may run on (its affinity mask, which taskset, cgroups' cpusets
// and container runtimes narrow), at most kMaxThreads; 1 if the mask cannot be read.
uint32_t affinity_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) != 0) return 1;
  return std::clamp<uint32_t>(uint32_t(CPU_COUNT(&set)), 1, kMaxThreads);
}

// One row per variable: documentation plus how to apply a value.
struct Row {
  OptionDoc doc;
  bool (*apply)(const std::string& value, kvgc_heap_options* o);
};

const Row kRows[] = {
    {{"KVGC_DEVICE", "auto|cpu|cuda", "auto",
      "backend: cuda when a device answers (auto), else cpu"},
     [](const std::string& s, kvgc_heap_options* o) {
       int v;
       return parse_choice(kDevices, s, &v) && (o->device = kvgc_device(v), true);
     }},
    {{"KVGC_POLICY", "generational|full|streaming|h2o|random", "generational",
      "eviction policy (one GC mechanism, different priority keys)"},
     [](const std::string& s, kvgc_heap_options* o) {
       int v;
       return parse_choice(kPolicies, s, &v) && (o->policy = kvgc_policy(v), true);
     }},
    {{"KVGC_BUDGET", "bytes with optional K|M|G|T suffix (binary), or N% of free memory",
      "50%", "heap (arena) size, reserved once at creation"},
     [](const std::string& s, kvgc_heap_options* o) {
       uint64_t b = 0;
       double f = 0;
       if (!parse_bytes_or_percent(s, &b, &f)) return false;
       if (b == 0 && (f <= 0 || f > 1)) return false;
       o->budget_bytes = b;
       o->budget_fraction = b ? o->budget_fraction : f;
       return true;
     }},
    {{"KVGC_TOKEN_BUDGET", "a token count (4096), a fraction (0.25) or a percentage (25%)",
      "none", "live tokens each segment keeps: absolute, or relative to the sequence length"},
     [](const std::string& s, kvgc_heap_options* o) {
       uint64_t c = 0;
       double f = 0;
       if (!parse_count_or_fraction(s, &c, &f)) return false;
       o->token_budget = c;
       o->token_budget_fraction = f;
       return true;
     }},
    {{"KVGC_SINKS", "integer 0..1048576", "4", "first tokens of a sequence never evicted"},
     [](const std::string& s, kvgc_heap_options* o) {
       return parse_u32_range(s, 0, kMaxSinks, &o->sinks);
     }},
    {{"KVGC_WINDOW", "integer 0..16777216", "32", "young window: newest tokens never evicted"},
     [](const std::string& s, kvgc_heap_options* o) {
       return parse_u32_range(s, 0, kMaxWindow, &o->window);
     }},
    {{"KVGC_WINDOW_MIN", "integer 0..16777216", "8",
      "under a byte budget the young window is 1/8 of a segment's budget in fp16 tokens, "
      "within window_min..KVGC_WINDOW (>= KVGC_WINDOW: fixed)"},
     [](const std::string& s, kvgc_heap_options* o) {
       return parse_u32_range(s, 0, kMaxWindow, &o->window_min);
     }},
    {{"KVGC_MIN_LENGTH", "integer 0..2147483648", "256",
      "sequences shorter than this many tokens are never pruned (no budget applies); 0: off"},
     [](const std::string& s, kvgc_heap_options* o) {
       return parse_u32_range(s, 0, kMaxMinLength, &o->min_length);
     }},
    {{"KVGC_PAGE_TOKENS", "integer 1..256", "16", "token slots per page"},
     [](const std::string& s, kvgc_heap_options* o) {
       return parse_u32_range(s, 1, kMaxPageTokens, &o->page_tokens);
     }},
    {{"KVGC_COMPACT_THRESHOLD", "a fraction in (0, 1]", "0.25",
      "segment fragmentation (dead/held slots) that triggers compaction"},
     [](const std::string& s, kvgc_heap_options* o) {
       double v;
       return parse_double(s, &v) && v > 0 && v <= 1 && (o->compact_threshold = v, true);
     }},
    {{"KVGC_BYTE_BUDGET",
      "bytes with optional K|M|G suffix (65536, 64K), or a fraction (0.1) or percentage "
      "(10%) of the full cache's raw K/V bytes for the sequence's length",
      "none",
      "bytes of pages each segment keeps, every class at what its pages really hold"},
     [](const std::string& s, kvgc_heap_options* o) {
       uint64_t b = 0;
       double f = 0;
       if (s.empty()) return false;
       if (s.back() == '%') {
         if (!parse_percent(s, &f)) return false;
       } else if (s.find_first_not_of("0123456789.eE-+") == std::string::npos &&
                  s.find_first_of(".eE") != std::string::npos) {
         if (!parse_double(s, &f) || !(f > 0 && f <= 1)) return false;
       } else if (!parse_bytes_or_percent(s, &b, &f) || b == 0) {
         return false;
       }
       o->byte_budget = b;
       o->byte_budget_fraction = f;
       return true;
     }},
    {{"KVGC_DEMOTE", "off|int4|int8|int8,int4|int8,int4,int2", "int8,int4",
      "storage ladder: re-store low-ranked tokens as int8, int4 and (opt-in) int2 before evicting"},
     [](const std::string& s, kvgc_heap_options* o) {
       int v;
       return parse_choice(kDemotes, s, &v) && (o->demote = kvgc_demote(v), true);
     }},
    {{"KVGC_LAYER_BUDGET", "uniform|pyramid|entropy:FILE (FILE from kvgc-run --profile)",
      "uniform",
      "split of the token budget across layers (pyramid: more for lower layers; entropy: "
      "in proportion to a measured per-layer profile)"},
     [](const std::string& s, kvgc_heap_options* o) {
       if (s.rfind("entropy:", 0) == 0)  // the file is read by the heap: it knows the layers
         return s.size() > 8 && (o->layer_budget = KVGC_LAYER_BUDGET_ENTROPY, true);
       int v;
       return parse_choice(kLayerBudgets, s, &v) && v != KVGC_LAYER_BUDGET_ENTROPY &&
              (o->layer_budget = kvgc_layer_budget(v), true);
     }},
    {{"KVGC_HARVEST", "deferred|immediate", "deferred",
      "when a GC's results are applied: at the next step (a step never waits for the "
      "device) or within the step (synchronises on CUDA)"},
     [](const std::string& s, kvgc_heap_options* o) {
       int v;
       return parse_choice(kHarvests, s, &v) && (o->harvest = kvgc_harvest(v), true);
     }},
    {{"KVGC_PREFIX_CHARGE", "shrink|cache|view (prune: shrink)", "shrink",
      "who pays for tokens attached from the prefix cache. shrink: each holder prunes them "
      "as its own tokens and is charged for those it keeps, a demoted shared token charged "
      "at its rung but read from the shared page (no copy), and a shared page every holder "
      "counts at the ladder's first rung below fp16 or cheaper is re-stored there; cache: "
      "kept whole in every holder's view, charged once (a prefix never pruned); view: as "
      "appending the prompt (a demoted shared token copied; for equivalence tests)"},
     [](const std::string& s, kvgc_heap_options* o) {
       int v;
       return parse_choice(kPrefixCharges, s, &v) && (o->prefix_charge = kvgc_prefix_charge(v), true);
     }},
    {{"KVGC_THREADS", "integer 1..256, or auto (the CPUs of the process's affinity mask)",
      "1",
      "threads for the CPU backend's attention, the caller included (ignored on CUDA)"},
     [](const std::string& s, kvgc_heap_options* o) {
       if (s == "auto") return (o->cpu_threads = affinity_cpus(), true);
       return parse_u32_range(s, 1, kMaxThreads, &o->cpu_threads);
     }},
    {{"KVGC_RECENT_DECAY", "a number in (0, 1]", "0.95",
      "per-query decay of the recent-attention score generational ranks its intermediate "
      "tier by (1: the accumulated score)"},
     [](const std::string& s, kvgc_heap_options* o) {
       double v;
       return parse_double(s, &v) && v > 0 && v <= 1 && (o->recent_decay = v, true);
     }},
    {{"KVGC_SCORE_NOISE", "a number >= 0 (0 = off)", "0",
      "Laplace noise scale on scores before ranking"},
     [](const std::string& s, kvgc_heap_options* o) {
       double v;
       return parse_double(s, &v) && v >= 0 && (o->score_noise = v, true);
     }},
    {{"KVGC_SEED", "unsigned integer (decimal or 0x hex)", "0x6b766763",
      "seed for random eviction and score noise"},
     [](const std::string& s, kvgc_heap_options* o) { return parse_u64(s, &o->seed); }},
    {{"KVGC_VERBOSE", "0|1", "0", "1 prints the effective configuration to stderr"},
     [](const std::string& s, kvgc_heap_options* o) {
       return (s == "0" || s == "1") && (o->verbose = s == "1", true);
     }},
};

}  // namespace

const std::vector<OptionDoc>& option_docs() {
  static const std::vector<OptionDoc> docs = [] {
    std::vector<OptionDoc> d;
    for (const Row& r : kRows) d.push_back(r.doc);
    return d;
  }();
  return docs;
}

void options_defaults(kvgc_heap_options* o) {
  std::memset(o, 0, sizeof *o);
  o->struct_size = sizeof *o;
  o->device = KVGC_DEVICE_AUTO;
  o->budget_fraction = 0.5;
  o->policy = KVGC_POLICY_GENERATIONAL;
  o->sinks = 4;
  // 0.4 (64 before): at a 10% byte budget of a 1K-token prompt a 64-token window left too
  // little for the pillars (docs/QUALITY.md).
  o->window = 32;
  // 0.9: at 5% of a 1K-token prompt's bytes a 32-token window took most of the budget;
  // an 8-token one kept the word key in 19 prompts of 20 against 0 (docs/QUALITY.md).
  o->window_min = 8;
  // 0.14: a short chat is never pruned (a 39-token prompt at 25% lost its question).
  // 256 covers a chat prompt of up to 200 tokens and its first 32 answer tokens
  // unchanged; kvgc's quality results start at 1K tokens, where nothing changes.
  o->min_length = 256;
  o->page_tokens = 16;
  o->compact_threshold = 0.25;
  // The full ladder: at equal bytes it measured best (docs/QUALITY.md); without a budget
  // it does nothing.
  o->demote = KVGC_DEMOTE_LADDER;
  o->layer_budget = KVGC_LAYER_BUDGET_UNIFORM;
  o->harvest = KVGC_HARVEST_DEFERRED;
  // 0.15 (cache before): pruning with sharing served 1.61-1.65x the mean concurrency of
  // pruning alone on a shared 1K-token prefix, every key the full cache answers kept
  // (docs/PERF.md, "serving with the prefix cache").
  o->prefix_charge = KVGC_PREFIX_CHARGE_SHRINK;
  // One: an engine usually owns its cores and runs its own (BLAS) threads between
  // attention calls, and more threads than cores cost more than the split saves
  // (kvgc-run, whose OpenBLAS uses both cores of a 2-core VM, decoded slower with 2:
  // docs/PERF.md). The CUDA backend ignores it.
  o->cpu_threads = 1;
  o->recent_decay = kDefaultRecentDecay;
  o->seed = kDefaultSeed;
  o->slab_bytes = kDefaultSlab;
}

Status options_validate(const kvgc_heap_options& o) {
  auto bad = [](const char* field, const std::string& why) {
    return fail(KVGC_EINVAL, std::string("opts->") + field + ": " + why);
  };
  if (o.flags & ~KVGC_OPT_IGNORE_ENV) return bad("flags", "unknown bits set");
  if (raw_enum(o.device) < KVGC_DEVICE_AUTO || raw_enum(o.device) > KVGC_DEVICE_CUDA)
    return bad("device", "must be KVGC_DEVICE_AUTO, _CPU or _CUDA");
  if (o.cuda_device < 0) return bad("cuda_device", "must be >= 0");
  if (o.budget_bytes == 0 && !(o.budget_fraction > 0 && o.budget_fraction <= 1))
    return bad("budget_fraction", "must be in (0, 1] when budget_bytes is 0");
  if (raw_enum(o.policy) < KVGC_POLICY_GENERATIONAL || raw_enum(o.policy) > KVGC_POLICY_RANDOM)
    return bad("policy", "unknown policy");
  if (!(o.token_budget_fraction >= 0 && o.token_budget_fraction <= 1))
    return bad("token_budget_fraction", "must be in [0, 1]");
  if (o.token_budget && o.token_budget_fraction > 0)
    return bad("token_budget", "set token_budget or token_budget_fraction, not both");
  if (o.sinks > kMaxSinks) return bad("sinks", "must be <= 1048576");
  if (o.window > kMaxWindow) return bad("window", "must be <= 16777216");
  if (o.window_min > kMaxWindow) return bad("window_min", "must be <= 16777216");
  if (o.min_length > kMaxMinLength) return bad("min_length", "must be <= 2147483648");
  if (o.page_tokens < 1 || o.page_tokens > kMaxPageTokens)
    return bad("page_tokens", "must be in 1..256");
  if (!(o.compact_threshold > 0 && o.compact_threshold <= 1))
    return bad("compact_threshold", "must be in (0, 1]");
  if (raw_enum(o.demote) < KVGC_DEMOTE_OFF || raw_enum(o.demote) > KVGC_DEMOTE_LADDER_INT2)
    return bad("demote", "must be KVGC_DEMOTE_OFF, _INT4, _INT8, _LADDER or _LADDER_INT2");
  if (!(o.byte_budget_fraction >= 0 && o.byte_budget_fraction <= 1))
    return bad("byte_budget_fraction", "must be in [0, 1]");
  if (o.byte_budget && o.byte_budget_fraction > 0)
    return bad("byte_budget", "set byte_budget or byte_budget_fraction, not both");
  if (!(o.recent_decay > 0 && o.recent_decay <= 1))
    return bad("recent_decay", "must be in (0, 1]");
  if (raw_enum(o.layer_budget) < KVGC_LAYER_BUDGET_UNIFORM ||
      raw_enum(o.layer_budget) > KVGC_LAYER_BUDGET_ENTROPY)
    return bad("layer_budget", "must be KVGC_LAYER_BUDGET_UNIFORM, _PYRAMID or _ENTROPY");
  if (raw_enum(o.harvest) != KVGC_HARVEST_DEFERRED && raw_enum(o.harvest) != KVGC_HARVEST_IMMEDIATE)
    return bad("harvest", "must be KVGC_HARVEST_DEFERRED or _IMMEDIATE");
  if (raw_enum(o.prefix_charge) != KVGC_PREFIX_CHARGE_CACHE && raw_enum(o.prefix_charge) != KVGC_PREFIX_CHARGE_VIEW &&
      raw_enum(o.prefix_charge) != KVGC_PREFIX_CHARGE_PRUNE && raw_enum(o.prefix_charge) != KVGC_PREFIX_CHARGE_SHRINK)
    return bad("prefix_charge", "must be KVGC_PREFIX_CHARGE_CACHE, _VIEW, _PRUNE or _SHRINK");
  if (o.cpu_threads < 1 || o.cpu_threads > kMaxThreads)
    return bad("cpu_threads", "must be in 1..256 (KVGC_THREADS=auto counts the CPUs of the "
                              "affinity mask)");
  if (!(o.score_noise >= 0 && std::isfinite(o.score_noise)))
    return bad("score_noise", "must be a finite number >= 0");
  if (o.slab_bytes != 0 &&
      (o.slab_bytes < (64u << 10) || o.slab_bytes > (1u << 30) || o.slab_bytes % kPageAlign))
    return bad("slab_bytes", "must be 0 (sized from the model) or a multiple of 256 in 64 KiB..1 GiB");
  return Status::Ok();
}

Status options_from_env(kvgc_heap_options* o, GetEnv getenv_fn, std::string* layer_profile) {
  kvgc_heap_options next = *o;  // all or nothing: a bad variable changes nothing
  for (const Row& r : kRows) {
    const char* raw = getenv_fn(r.doc.env);
    if (!raw) continue;
    const std::string v = trim(raw);
    if (!r.apply(v, &next))
      return fail(KVGC_EINVAL, std::string(r.doc.env) + "='" + raw +
                                   "' is malformed; accepted: " + r.doc.forms);
  }
  if (const char* lb = getenv_fn("KVGC_LAYER_BUDGET"); lb && layer_profile &&
      next.layer_budget == KVGC_LAYER_BUDGET_ENTROPY)
    *layer_profile = trim(lb).substr(8);
  *o = next;
  return Status::Ok();
}

Status parse_layer_profile(std::string_view text, const std::string& path, uint32_t n_layers,
                           const char* what, std::vector<float>* weights) {
  auto where = [&](int lineno) {
    return std::string(what) + ": " + path + ":" + std::to_string(lineno) + ": ";
  };
  std::vector<float> w;
  w.reserve(std::min<size_t>(n_layers, 1u << 16));
  int lineno = 0;
  for (size_t at = 0; at < text.size();) {
    ++lineno;
    const size_t nl = std::min(text.find('\n', at), text.size());
    std::string_view line = text.substr(at, nl - at);
    at = nl + 1;
    line = line.substr(0, line.find('#'));
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    const std::string t = trim(std::string(line).c_str());
    if (t.empty()) continue;
    const std::string shown = t.substr(0, 40) + (t.size() > 40 ? "..." : "");
    double v;
    if (!parse_double(t, &v))
      return fail(KVGC_EINVAL, where(lineno) + "'" + shown + "' is not a number");
    // The weight is stored as a float: a value that is not finite, not positive, or that
    // a float cannot hold (1e39 becomes inf, 1e-50 becomes 0) would make the budget split
    // divide inf by inf or give a layer nothing. Rejected here, with its line.
    // (The range is checked on the double: converting one beyond a float's range is
    // itself undefined.)
    if (!(v >= double(std::numeric_limits<float>::min()) &&
          v <= double(std::numeric_limits<float>::max())))
      return fail(KVGC_EINVAL, where(lineno) + "'" + shown +
                                   "' is not a positive number a float can hold (about "
                                   "1.2e-38 to 3.4e38)");
    if (w.size() == n_layers)
      return fail(KVGC_EINVAL, std::string(what) + ": " + path + " has more than " +
                                   std::to_string(n_layers) +
                                   " layer weights; the model has " + std::to_string(n_layers) +
                                   " layers");
    w.push_back(float(v));
  }
  if (w.size() != n_layers)
    return fail(KVGC_EINVAL, std::string(what) + ": " + path + " has " + std::to_string(w.size()) +
                                 " layer weights; the model has " + std::to_string(n_layers) +
                                 " layers");
  *weights = std::move(w);
  return Status::Ok();
}

Status read_layer_profile(const std::string& path, uint32_t n_layers, const char* what,
                          std::vector<float>* weights) {
  // A profile has one short line per layer; a file far larger is not one (and is not
  // read into memory).
  const uint64_t max_bytes = 4096 + uint64_t(n_layers) * 256;
  std::ifstream f(path, std::ios::binary);
  std::string text;
  if (f) {
    text.resize(size_t(std::min<uint64_t>(max_bytes + 1, 1u << 24)));
    f.read(text.data(), std::streamsize(text.size()));
    text.resize(size_t(f.gcount()));
  }
  if (!f && !f.eof())
    return fail(KVGC_EINVAL, std::string(what) + ": cannot read the layer profile '" + path +
                                 "' (write one with kvgc-run --profile FILE)");
  if (text.size() > max_bytes)
    return fail(KVGC_EINVAL, std::string(what) + ": " + path + " is larger than a " +
                                 std::to_string(n_layers) + "-layer profile can be (" +
                                 std::to_string(max_bytes) + " bytes)");
  return parse_layer_profile(text, path, n_layers, what, weights);
}

std::string options_describe(const kvgc_heap_options& o) {
  char buf[1024];
  std::string budget = o.budget_bytes ? std::to_string(o.budget_bytes) + " bytes"
                                      : std::to_string(o.budget_fraction * 100) + "% of free";
  std::string tokens = o.token_budget ? std::to_string(o.token_budget)
                       : o.token_budget_fraction > 0
                           ? std::to_string(o.token_budget_fraction) + " of length"
                           : "none";
  std::string bytes = o.byte_budget ? std::to_string(o.byte_budget)
                      : o.byte_budget_fraction > 0
                          ? std::to_string(o.byte_budget_fraction) + " of the full cache"
                          : "none";
  std::snprintf(buf, sizeof buf,
                "KVGC_DEVICE=%s\nKVGC_POLICY=%s\nKVGC_BUDGET=%s\nKVGC_TOKEN_BUDGET=%s\n"
                "KVGC_BYTE_BUDGET=%s\nKVGC_SINKS=%u\nKVGC_WINDOW=%u\nKVGC_WINDOW_MIN=%u\nKVGC_MIN_LENGTH=%u\nKVGC_PAGE_TOKENS=%u\n"
                "KVGC_COMPACT_THRESHOLD=%g\nKVGC_DEMOTE=%s\nKVGC_LAYER_BUDGET=%s\n"
                "KVGC_HARVEST=%s\nKVGC_PREFIX_CHARGE=%s\nKVGC_THREADS=%u%s\nKVGC_RECENT_DECAY=%g\n"
                "KVGC_SCORE_NOISE=%g\n"
                "KVGC_SEED=0x%llx\nKVGC_VERBOSE=%d\nslab_bytes=%u\n",
                device_name(o.device), policy_name(o.policy), budget.c_str(), tokens.c_str(),
                bytes.c_str(), o.sinks, o.window, o.window_min, o.min_length, o.page_tokens, o.compact_threshold,
                choice_name(kDemotes, o.demote), choice_name(kLayerBudgets, o.layer_budget),
                choice_name(kHarvests, o.harvest), choice_name(kPrefixCharges, o.prefix_charge),
                o.cpu_threads,
                o.device == KVGC_DEVICE_CUDA ? " (ignored: cuda backend)" : "", o.recent_decay,
                o.score_noise, (unsigned long long)o.seed, o.verbose, o.slab_bytes);
  return buf;
}

bool parse_bytes_or_percent(const std::string& s, uint64_t* bytes, double* fraction) {
  *bytes = 0;
  *fraction = 0;
  if (s.empty()) return false;
  if (s.back() == '%') return parse_percent(s, fraction);
  std::string num = s;
  double mult = 1;
  // Accept 2G, 2GB, 2GiB (all binary), case-insensitive suffix.
  auto ends = [&](const char* suf) {
    const size_t n = std::strlen(suf);
    if (num.size() <= n) return false;
    for (size_t i = 0; i < n; ++i)
      if (std::tolower(num[num.size() - n + i]) != suf[i]) return false;
    num.resize(num.size() - n);
    return true;
  };
  if (!ends("ib")) ends("b");
  const char units[] = "kmgt";
  for (int i = 0; i < 4; ++i)
    if (!num.empty() && std::tolower(num.back()) == units[i]) {
      num.pop_back();
      mult = std::ldexp(1.0, 10 * (i + 1));
      break;
    }
  double v;
  if (!parse_double(num, &v) || v <= 0 || num[0] == '+') return false;
  const double b = v * mult;
  if (b >= 18446744073709551615.0 || (mult == 1 && v != std::floor(v))) return false;
  *bytes = uint64_t(b);
  return *bytes > 0;
}

bool parse_count_or_fraction(const std::string& s, uint64_t* count, double* fraction) {
  *count = 0;
  *fraction = 0;
  if (s.empty()) return false;
  if (s.back() == '%') return parse_percent(s, fraction);
  if (s.find_first_of(".eE") != std::string::npos) {
    double f;
    if (!parse_double(s, &f) || f <= 0 || f > 1) return false;
    *fraction = f;
    return true;
  }
  return parse_u64(s, count) && *count > 0 && s[0] != '0';
}

const char* policy_name(kvgc_policy p) { return choice_name(kPolicies, p); }
const char* demote_name(kvgc_demote d) { return choice_name(kDemotes, d); }
const char* device_name(kvgc_device d) { return choice_name(kDevices, d); }
const char* dtype_name(kvgc_dtype d) {
  return d == KVGC_DTYPE_F16 ? "f16" : d == KVGC_DTYPE_BF16 ? "bf16" : d == KVGC_DTYPE_F32 ? "f32" : "?";
}

}  // namespace kvgc
