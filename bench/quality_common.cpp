#include "quality_common.hpp"

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <thread>

extern char** environ;

namespace quality {

// The full cache ranks nothing, so its engine pools nothing: its observe prefill is the
// snapshot every row replays, and each row pools the scores at its own radius (replay()).
Config full_config() { return {.name = "full", .policy = KVGC_POLICY_FULL, .pool_radius = 0}; }

engine::EngineOptions engine_options(const Bench& bench, const Config& config) {
  engine::EngineOptions o;
  if (config.pool_radius >= 0) o.pool_radius = uint32_t(config.pool_radius);
  o.key_prior = config.key_prior;
  o.reconstruct = config.reconstruct;
  o.reconstruct_across_layers = config.reconstruct_across_layers;
  o.reconstruct_head_peak = config.reconstruct_head_peak;
  if (config.reconstruct > 0)
    o.reconstruct_prompt = bench.tokenizer->encode(engine::kReconstructPrompt, false);
  return o;
}

// Rows both tables have. The pooling-radius rows (0.10.1's measurement): the library's
// defaults with the observe prefill's scores pooled over 3, 5 or 8 positions either side,
// and the key-prior rows, placed after default@bytes. And the sweep's row, env@bytes, last.
static void add_shared_rows(std::vector<Config>* rows) {
#if QUALITY_HAVE_LADDER
  rows->push_back({.name = "env@bytes", .policy = KVGC_POLICY_GENERATIONAL, .budget = Budget::Bytes,
                   .library_defaults = true, .from_env = true});
  auto at = std::find_if(rows->begin(), rows->end(),
                         [](const Config& c) { return c.name == "default@bytes"; });
  if (at != rows->end()) ++at;
  std::vector<Config> pool;
  for (const int radius : {3, 5, 8})
    pool.push_back({.name = "default+pool" + std::to_string(radius) + "@bytes",
                    .policy = KVGC_POLICY_GENERATIONAL, .budget = Budget::Bytes,
                    .library_defaults = true, .pool_radius = radius});
  // The key-diversity prior (EngineOptions::key_prior) at three weights.
  for (const char* weight : {"0.5", "1", "2"})
    pool.push_back({.name = std::string("default+keyprior") + weight + "@bytes",
                    .policy = KVGC_POLICY_GENERATIONAL, .budget = Budget::Bytes,
                    .library_defaults = true, .key_prior = std::stof(weight)});
  // The reconstruction signal (EngineOptions::reconstruct) at three weights, every layer
  // ranking by the layers' mean share (the engine's default), and at 8 by its own share.
  for (const char* weight : {"2", "8", "32"})
    pool.push_back({.name = std::string("default+recon") + weight + "@bytes",
                    .policy = KVGC_POLICY_GENERATIONAL, .budget = Budget::Bytes,
                    .library_defaults = true, .reconstruct = std::stof(weight)});
  pool.push_back({.name = "default+recon8-per-layer@bytes", .policy = KVGC_POLICY_GENERATIONAL,
                  .budget = Budget::Bytes, .library_defaults = true, .reconstruct = 8,
                  .reconstruct_across_layers = false});
  // The same with each query head's own peak (EngineOptions::reconstruct_head_peak).
  for (const char* weight : {"8", "32"})
    pool.push_back({.name = std::string("default+reconpeak") + weight + "@bytes",
                    .policy = KVGC_POLICY_GENERATIONAL, .budget = Budget::Bytes,
                    .library_defaults = true, .reconstruct = std::stof(weight),
                    .reconstruct_head_peak = true});
  pool.push_back({.name = "default+reconpeak8-per-layer@bytes", .policy = KVGC_POLICY_GENERATIONAL,
                  .budget = Budget::Bytes, .library_defaults = true, .reconstruct = 8,
                  .reconstruct_across_layers = false, .reconstruct_head_peak = true});
  rows->insert(at, pool.begin(), pool.end());
#else
  (void)rows;
#endif
}

// The configuration tables: one line each. "@bytes" rows get a byte budget (the same
// fraction of the f16 full cache's bytes) instead of a token budget: the equal-bytes rows.
std::vector<Config> retrieval_configs() {
  std::vector<Config> rows = {
      {.name = "default", .policy = KVGC_POLICY_GENERATIONAL, .library_defaults = true},
#if QUALITY_HAVE_LADDER
      {.name = "default@bytes", .policy = KVGC_POLICY_GENERATIONAL, .budget = Budget::Bytes,
       .library_defaults = true},
      {.name = "default+window32@bytes", .policy = KVGC_POLICY_GENERATIONAL,
       .budget = Budget::Bytes, .library_defaults = true, .window_override = 32},
      {.name = "default+window16@bytes", .policy = KVGC_POLICY_GENERATIONAL,
       .budget = Budget::Bytes, .library_defaults = true, .window_override = 16},
      {.name = "default+window8@bytes", .policy = KVGC_POLICY_GENERATIONAL,
       .budget = Budget::Bytes, .library_defaults = true, .window_override = 8},
#endif
#if KVGC_STATS_VERSION >= 6
      {.name = "default+int2@bytes", .policy = KVGC_POLICY_GENERATIONAL, .budget = Budget::Bytes,
       .library_defaults = true, .demote_override = KVGC_DEMOTE_LADDER_INT2},
#endif
      {.name = "generational", .policy = KVGC_POLICY_GENERATIONAL},
      {.name = "h2o", .policy = KVGC_POLICY_H2O},
      {.name = "streaming", .policy = KVGC_POLICY_STREAMING},
      {.name = "random", .policy = KVGC_POLICY_RANDOM},
      {.name = "generational+int4", .policy = KVGC_POLICY_GENERATIONAL,
       .demote = KVGC_DEMOTE_INT4},
#if QUALITY_HAVE_LADDER
      {.name = "generational+int8", .policy = KVGC_POLICY_GENERATIONAL,
       .demote = KVGC_DEMOTE_INT8},
      {.name = "generational+ladder", .policy = KVGC_POLICY_GENERATIONAL,
       .demote = KVGC_DEMOTE_LADDER},
      {.name = "generational@bytes", .policy = KVGC_POLICY_GENERATIONAL,
       .budget = Budget::Bytes},
      {.name = "h2o@bytes", .policy = KVGC_POLICY_H2O, .budget = Budget::Bytes},
      {.name = "streaming@bytes", .policy = KVGC_POLICY_STREAMING, .budget = Budget::Bytes},
      {.name = "generational+int4@bytes", .policy = KVGC_POLICY_GENERATIONAL,
       .demote = KVGC_DEMOTE_INT4, .budget = Budget::Bytes},
      {.name = "generational+int8@bytes", .policy = KVGC_POLICY_GENERATIONAL,
       .demote = KVGC_DEMOTE_INT8, .budget = Budget::Bytes},
      {.name = "generational+ladder@bytes", .policy = KVGC_POLICY_GENERATIONAL,
       .demote = KVGC_DEMOTE_LADDER, .budget = Budget::Bytes},
      {.name = "generational+recent0.99@bytes", .policy = KVGC_POLICY_GENERATIONAL,
       .budget = Budget::Bytes, .recent_decay = 0.99},
      {.name = "generational+ladder+recent0.99@bytes", .policy = KVGC_POLICY_GENERATIONAL,
       .demote = KVGC_DEMOTE_LADDER, .budget = Budget::Bytes, .recent_decay = 0.99},
      {.name = "generational+ladder+recent0.95@bytes", .policy = KVGC_POLICY_GENERATIONAL,
       .demote = KVGC_DEMOTE_LADDER, .budget = Budget::Bytes, .recent_decay = 0.95},
#endif
  };
  add_shared_rows(&rows);
  return rows;
}

std::vector<Config> perplexity_configs() {
  std::vector<Config> rows = {
      // StreamingLLM's baseline: a plain sliding window, no attention sinks.
      {.name = "default", .policy = KVGC_POLICY_GENERATIONAL, .library_defaults = true},
#if QUALITY_HAVE_LADDER
      {.name = "default@bytes", .policy = KVGC_POLICY_GENERATIONAL, .budget = Budget::Bytes,
       .library_defaults = true},
#endif
      {.name = "window(no sinks)", .policy = KVGC_POLICY_STREAMING, .sinks = 0},
      {.name = "streaming", .policy = KVGC_POLICY_STREAMING},
      {.name = "h2o", .policy = KVGC_POLICY_H2O},
      {.name = "random", .policy = KVGC_POLICY_RANDOM},
      // Uniform is the default split: this row is generational+uniform.
      {.name = "generational", .policy = KVGC_POLICY_GENERATIONAL},
      {.name = "generational+int4", .policy = KVGC_POLICY_GENERATIONAL,
       .demote = KVGC_DEMOTE_INT4},
      {.name = "generational+pyramid", .policy = KVGC_POLICY_GENERATIONAL,
       .split = KVGC_LAYER_BUDGET_PYRAMID},
      {.name = "generational+entropy", .policy = KVGC_POLICY_GENERATIONAL,
       .split = KVGC_LAYER_BUDGET_ENTROPY},
#if QUALITY_HAVE_LADDER
      {.name = "generational+int8", .policy = KVGC_POLICY_GENERATIONAL,
       .demote = KVGC_DEMOTE_INT8},
      {.name = "generational+ladder", .policy = KVGC_POLICY_GENERATIONAL,
       .demote = KVGC_DEMOTE_LADDER},
      {.name = "generational+recent0.99", .policy = KVGC_POLICY_GENERATIONAL,
       .recent_decay = 0.99},
      {.name = "generational+recent0.95", .policy = KVGC_POLICY_GENERATIONAL,
       .recent_decay = 0.95},
      {.name = "generational+recent0.9", .policy = KVGC_POLICY_GENERATIONAL,
       .recent_decay = 0.9},
      {.name = "streaming@bytes", .policy = KVGC_POLICY_STREAMING, .budget = Budget::Bytes},
      {.name = "generational@bytes", .policy = KVGC_POLICY_GENERATIONAL,
       .budget = Budget::Bytes},
      {.name = "generational+ladder@bytes", .policy = KVGC_POLICY_GENERATIONAL,
       .demote = KVGC_DEMOTE_LADDER, .budget = Budget::Bytes},
      {.name = "generational+ladder+recent0.95@bytes", .policy = KVGC_POLICY_GENERATIONAL,
       .demote = KVGC_DEMOTE_LADDER, .budget = Budget::Bytes, .recent_decay = 0.95},
      {.name = "h2o+ladder@bytes", .policy = KVGC_POLICY_H2O, .demote = KVGC_DEMOTE_LADDER,
       .budget = Budget::Bytes},
      {.name = "streaming+ladder@bytes", .policy = KVGC_POLICY_STREAMING,
       .demote = KVGC_DEMOTE_LADDER, .budget = Budget::Bytes},
#endif
  };
  add_shared_rows(&rows);
  return rows;
}

std::vector<std::string> all_config_names() {
  std::vector<std::string> names;
  for (const auto& table : {retrieval_configs(), perplexity_configs()})
    for (const Config& c : table)
      if (std::find(names.begin(), names.end(), c.name) == names.end()) names.push_back(c.name);
  return names;
}

// The KVGC_* variables an `env@bytes` row runs under, sorted ("KVGC_A=1,KVGC_B=x"), or
// an error naming one the bench must set itself: the budgets are the row's fraction, and
// the bench reads the bytes a step leaves (immediate harvest) on a CPU heap of its size.
static bool sweep_environment(std::string* summary, std::string* err) {
  static const char* const kBenchOwned[] = {"KVGC_BUDGET", "KVGC_TOKEN_BUDGET", "KVGC_BYTE_BUDGET",
                                            "KVGC_HARVEST", "KVGC_DEVICE"};
  std::vector<std::string> vars;
  for (char** e = environ; e && *e; ++e) {
    const std::string kv = *e;
    const std::string name = kv.substr(0, kv.find('='));
    if (name.rfind("KVGC_", 0) != 0 || name == "KVGC_MODEL") continue;
    for (const char* owned : kBenchOwned)
      if (name == owned) {
        *err = "--configs env@bytes: " + name + " is set; the bench sets the budget, the "
               "device and the harvest of every row itself (unset it)";
        return false;
      }
    vars.push_back(kv);
  }
  std::sort(vars.begin(), vars.end());
  summary->clear();
  for (const std::string& v : vars) *summary += (summary->empty() ? "" : ",") + v;
  return true;
}

bool select_configs(const std::vector<std::string>& names, std::vector<Config>* configs,
                    std::string* err) {
  if (names.empty()) {  // every row but the sweep's, which is the defaults unless asked for
    std::erase_if(*configs, [](const Config& c) { return c.from_env; });
    return true;
  }
  const std::vector<std::string> known = all_config_names();
  for (const std::string& n : names) {
    if (n == "full") continue;  // always measured: the baseline
    if (std::find(known.begin(), known.end(), n) == known.end()) {
      *err = "--configs: unknown configuration '" + n + "'; known:";
      for (const std::string& k : known) *err += " " + k;
      return false;
    }
  }
  std::vector<Config> kept;
  for (const Config& c : *configs)
    if (std::find(names.begin(), names.end(), c.name) != names.end()) kept.push_back(c);
  for (Config& c : kept) {
    if (!c.from_env) continue;
    std::string summary;
    if (!sweep_environment(&summary, err)) return false;
    c.name = "env(" + (summary.empty() ? std::string("defaults") : summary) + ")@bytes";
  }
  *configs = kept;
  return true;
}

uint64_t f16_payload_bytes(const kvgc_model_desc& kv, uint64_t tokens) {
  kvgc_model_desc f16 = kv;
  f16.dtype = KVGC_DTYPE_F16;
  uint64_t bytes = 0;
  kvgc_kv_bytes(&f16, tokens, KVGC_CLASS_FP16, 0, &bytes);
  return bytes;
}

namespace {

kvgc_heap_options base_options(const Bench& bench, const Config& config, uint64_t max_tokens) {
  kvgc_heap_options options;
  kvgc_heap_options_init(&options);
  options.flags = config.from_env ? 0 : KVGC_OPT_IGNORE_ENV;
  options.device = KVGC_DEVICE_CPU;
  options.page_tokens = kPageTokens;
  if (!config.library_defaults) {
    options.policy = config.policy;
    options.sinks = config.sinks;
    options.window = kWindow;
    options.demote = kvgc_demote(config.demote);
#if QUALITY_HAVE_LADDER
    options.recent_decay = config.recent_decay;
#endif
  } else if (config.window_override != 0) {  // a fixed window (0.8's default: 32)
    options.window = config.window_override;
#if KVGC_VERSION_NUMBER >= 900
    options.window_min = config.window_override;
#endif
  }
  if (config.library_defaults && config.demote_override) options.demote = kvgc_demote(config.demote_override);
  options.layer_budget = config.split;
  options.score_noise = config.score_noise;
  // Page-level results applied within each kvgc_step (which tokens die is the same either
  // way): the bytes read right after a step are what that step left.
  options.harvest = KVGC_HARVEST_IMMEDIATE;
  if (config.split == KVGC_LAYER_BUDGET_ENTROPY) {
    options.layer_weights = bench.layer_weights.data();
    options.n_layer_weights = uint32_t(bench.layer_weights.size());
  }
  // Room for the whole sequence uncompressed, twice over (compaction copies), instead
  // of a fraction of host memory.
  uint64_t bytes = 0;
  kvgc_kv_bytes(&bench.kv, max_tokens, KVGC_CLASS_FP16, kPageTokens, &bytes);
  options.budget_bytes = 2 * bytes + (32u << 20);
  return options;
}

#if QUALITY_HAVE_LADDER
// Bytes per segment (layer) of `tokens` tokens' raw f16 payload.
uint64_t f16_bytes_per_layer(const Bench& bench, double tokens) {
  return uint64_t(std::llround(double(f16_payload_bytes(bench.kv, 1)) * tokens /
                               double(bench.kv.n_layers)));
}
#endif

}  // namespace

kvgc_heap_options make_options(const Bench& bench, const Config& config, double fraction,
                               uint64_t prompt_tokens, uint64_t max_tokens) {
  kvgc_heap_options options = base_options(bench, config, max_tokens);
  if (config.policy == KVGC_POLICY_FULL) return options;
  if (config.budget == Budget::Tokens) {
    options.token_budget = uint64_t(std::lround(fraction * double(prompt_tokens)));
  } else {
#if QUALITY_HAVE_LADDER
    options.byte_budget = f16_bytes_per_layer(bench, fraction * double(prompt_tokens));
#endif
  }
  return options;
}

kvgc_heap_options make_options_tokens(const Bench& bench, const Config& config,
                                      uint64_t token_budget, uint64_t max_tokens) {
  kvgc_heap_options options = base_options(bench, config, max_tokens);
  if (config.policy == KVGC_POLICY_FULL) return options;
  if (config.budget == Budget::Tokens) {
    options.token_budget = token_budget;
  } else {
#if QUALITY_HAVE_LADDER
    options.byte_budget = f16_bytes_per_layer(bench, double(token_budget));
#endif
  }
  return options;
}

bool kv_held(const engine::Engine& engine, uint32_t n_layers, uint64_t length, KvHeld* out,
             std::string* err) {
  kvgc_stats stats;
  kvgc_stats_init(&stats);
  if (kvgc_get_stats(engine.heap(), &stats) != KVGC_OK) {
    *err = std::string("kvgc statistics: ") + kvgc_errmsg(engine.heap());
    return false;
  }
  out->f16_full_bytes = f16_payload_bytes(engine.kv_model(), length);
  out->live_tokens = double(stats.live_tokens) / n_layers;
  out->class_bytes[0] = stats.cls[KVGC_CLASS_FP16].used_bytes;
  out->class_bytes[1] = stats.cls[KVGC_CLASS_INT4].used_bytes;
#if QUALITY_HAVE_LADDER
  out->class_bytes[2] = stats.cls_int8.used_bytes;
#endif
#if KVGC_STATS_VERSION >= 6
  out->class_bytes[3] = stats.cls_int2.used_bytes;
#endif
  out->bytes = out->class_bytes[0] + out->class_bytes[1] + out->class_bytes[2] + out->class_bytes[3];
  return true;
}

bool run_jobs(size_t n, unsigned jobs, const std::function<bool(size_t, std::string*)>& job,
              std::string* err) {
  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  std::mutex mutex;
  auto worker = [&] {
    for (size_t i; !failed && (i = next++) < n;) {
      std::string e;
      if (!job(i, &e)) {
        std::lock_guard lock(mutex);
        if (!failed.exchange(true)) *err = e;
      }
    }
  };
  std::vector<std::thread> threads;
  for (unsigned t = 1; t < std::max(1u, jobs); ++t) threads.emplace_back(worker);
  worker();
  for (std::thread& t : threads) t.join();
  return !failed;
}

void progress(const char* format, ...) {
  static std::mutex mutex;
  char line[768];
  va_list args;
  va_start(args, format);
  std::vsnprintf(line, sizeof line, format, args);
  va_end(args);
  std::lock_guard lock(mutex);
  std::fprintf(stderr, "%s\n", line);
}

bool Results::open(const std::string& path, std::string* err) {
  file_ = std::fopen(path.c_str(), "w");
  if (file_ == nullptr) {
    *err = "--results: cannot write " + path;
    return false;
  }
  return true;
}

void Results::write(const std::string& fields) {
  if (file_ == nullptr) return;
  std::lock_guard lock(mutex_);
  std::fprintf(file_, "{\"side\":\"kvgc\",%s}\n", fields.c_str());
  std::fflush(file_);
}

Results::~Results() {
  if (file_ != nullptr) std::fclose(file_);
}

Results& results() {
  static Results r;
  return r;
}

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (const char c : s) {
    const unsigned char u = static_cast<unsigned char>(c);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (u < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", u);
      out += buf;
    } else {
      out += c;
    }
  }
  return out + "\"";
}

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

bool read_text(const std::string& path, std::string* text, std::string* err) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    *err = "cannot read " + path;
    return false;
  }
  std::stringstream buffer;
  buffer << in.rdbuf();
  *text = buffer.str();
  return true;
}

bool write_text(const std::string& path, const std::string& text, std::string* err) {
  std::ofstream out(path, std::ios::binary);
  out << text;
  if (!out) {
    *err = "cannot write " + path;
    return false;
  }
  return true;
}

std::string key_name(const std::string& name) {
  std::string out;
  for (const char c : name) {
    if (std::isalnum(static_cast<unsigned char>(c))) out += c;
    else if (!out.empty() && out.back() != '_') out += '_';
  }
  while (!out.empty() && out.back() == '_') out.pop_back();
  return out;
}

std::string column_name(const std::string& name) {
  std::string out;
  for (const char c : name) {
    if (c == ' ') continue;
    out += c == '(' || c == ')' ? '-' : c;
  }
  while (!out.empty() && out.back() == '-') out.pop_back();
  return out;
}

std::string lower(std::string s) {
  for (char& c : s) c = char(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

}  // namespace quality
