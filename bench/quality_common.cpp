#include "quality_common.hpp"

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <fstream>
#include <mutex>
#include <sstream>
#include <thread>

namespace quality {

Config full_config() { return {"full", KVGC_POLICY_FULL}; }

std::vector<Config> retrieval_configs() {
  return {
      {"generational", KVGC_POLICY_GENERATIONAL},
      {"h2o", KVGC_POLICY_H2O},
      {"streaming", KVGC_POLICY_STREAMING},
      {"random", KVGC_POLICY_RANDOM},
      {"generational+int4", KVGC_POLICY_GENERATIONAL, kSinks, KVGC_DEMOTE_INT4},
  };
}

std::vector<Config> perplexity_configs() {
  return {
      // StreamingLLM's baseline: a plain sliding window, no attention sinks.
      {"window(no sinks)", KVGC_POLICY_STREAMING, 0},
      {"streaming", KVGC_POLICY_STREAMING},
      {"h2o", KVGC_POLICY_H2O},
      {"random", KVGC_POLICY_RANDOM},
      // Uniform is the default split: this row is generational+uniform.
      {"generational", KVGC_POLICY_GENERATIONAL},
      {"generational+int4", KVGC_POLICY_GENERATIONAL, kSinks, KVGC_DEMOTE_INT4},
      {"generational+pyramid", KVGC_POLICY_GENERATIONAL, kSinks, KVGC_DEMOTE_OFF,
       KVGC_LAYER_BUDGET_PYRAMID},
      {"generational+entropy", KVGC_POLICY_GENERATIONAL, kSinks, KVGC_DEMOTE_OFF,
       KVGC_LAYER_BUDGET_ENTROPY},
  };
}

kvgc_heap_options make_options(const Bench& bench, const Config& config, uint64_t token_budget,
                               uint64_t max_tokens) {
  kvgc_heap_options options;
  kvgc_heap_options_init(&options);
  options.flags = KVGC_OPT_IGNORE_ENV;
  options.device = KVGC_DEVICE_CPU;
  options.policy = config.policy;
  options.token_budget = config.policy == KVGC_POLICY_FULL ? 0 : token_budget;
  options.sinks = config.sinks;
  options.window = kWindow;
  options.page_tokens = kPageTokens;
  options.demote = config.demote;
  options.layer_budget = config.split;
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

bool kv_held(const engine::Engine& engine, uint32_t n_layers, uint64_t length, KvHeld* out,
             std::string* err) {
  kvgc_stats stats;
  kvgc_stats_init(&stats);
  if (kvgc_get_stats(engine.heap(), &stats) != KVGC_OK ||
      kvgc_kv_bytes(&engine.kv_model(), length, KVGC_CLASS_FP16, kPageTokens,
                    &out->full_bytes) != KVGC_OK) {
    *err = std::string("kvgc statistics: ") + kvgc_errmsg(engine.heap());
    return false;
  }
  out->live_tokens = double(stats.live_tokens) / n_layers;
  out->bytes = stats.cls[KVGC_CLASS_FP16].used_bytes + stats.cls[KVGC_CLASS_INT4].used_bytes;
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
  char line[512];
  va_list args;
  va_start(args, format);
  std::vsnprintf(line, sizeof line, format, args);
  va_end(args);
  std::lock_guard lock(mutex);
  std::fprintf(stderr, "%s\n", line);
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

}  // namespace quality
