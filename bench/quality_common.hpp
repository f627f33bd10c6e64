// Shared pieces of kvgc-bench-quality (bench/quality*.cpp): the cache configurations under
// test, heap options, a small job pool, and what the parts report back to main.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "engine/forward.hpp"
#include "engine/model.hpp"
#include "engine/tokenizer.hpp"
#include "kvgc.h"

namespace quality {

using Clock = std::chrono::steady_clock;
constexpr uint32_t kPageTokens = 16;
constexpr uint32_t kSinks = 4;
constexpr uint32_t kWindow = 32;

// One cache configuration under test.
struct Config {
  std::string name;
  kvgc_policy policy;
  uint32_t sinks = kSinks;
  kvgc_demote demote = KVGC_DEMOTE_OFF;
  kvgc_layer_budget split = KVGC_LAYER_BUDGET_UNIFORM;
};

Config full_config();
// The bounded policies of the retrieval parts (passkey, needle), in table order.
std::vector<Config> retrieval_configs();
// The bounded configurations of the perplexity part, in table order.
std::vector<Config> perplexity_configs();

// What every part needs: the model, its tokenizer and kvgc's view of its shape.
struct Bench {
  const engine::Model* model = nullptr;
  const engine::Tokenizer* tokenizer = nullptr;
  kvgc_model_desc kv{};
  uint64_t n_ctx = 0;           // trained context length
  bool n_ctx_from_gguf = false; // read from the GGUF metadata (else the engine's default)
  unsigned jobs = 2;            // engines run side by side
  bool full = false;            // --full
  std::vector<uint32_t> contexts;  // --contexts: replaces the retrieval parts' lengths
  std::vector<double> depths;      // --depths: replaces the retrieval parts' depths
  std::string text_path;        // prose: needle haystack, perplexity, entropy profile
  std::string out_dir;          // data files, profile, plots
  std::string prefix;           // out_dir + "/quick" or "/full"
  std::vector<float> layer_weights;  // entropy profile (filled by the perplexity part)
};

// Explicit options for one heap (the KVGC_* environment must not change what is
// measured). token_budget: live tokens per segment; ignored by the full policy.
kvgc_heap_options make_options(const Bench& bench, const Config& config, uint64_t token_budget,
                               uint64_t max_tokens);

// KV memory a heap holds now: live tokens per layer and bytes of pages in use (both
// classes), against what a full fp16-class cache of `length` tokens would take.
struct KvHeld {
  double live_tokens = 0;  // per layer
  uint64_t bytes = 0;
  uint64_t full_bytes = 0;
  double fraction() const { return full_bytes ? double(bytes) / double(full_bytes) : 0.0; }
};
bool kv_held(const engine::Engine& engine, uint32_t n_layers, uint64_t length, KvHeld* out,
             std::string* err);

// Runs job(i, &err) for i in [0, n) on `jobs` threads; false with the first error.
bool run_jobs(size_t n, unsigned jobs, const std::function<bool(size_t, std::string*)>& job,
              std::string* err);

// One line to stderr, whole, from any thread.
void progress(const char* format, ...) __attribute__((format(printf, 1, 2)));

double seconds_since(Clock::time_point start);
using engine::argmax;
using engine::log_prob;
bool read_text(const std::string& path, std::string* text, std::string* err);
bool write_text(const std::string& path, const std::string& text, std::string* err);
// "generational+int4" -> "generational_int4": RESULT keys are single words.
std::string key_name(const std::string& name);
// Names for data-file headers (gnuplot column headers: no spaces).
std::string column_name(const std::string& name);

// ---- the parts ----------------------------------------------------------------------

// Passkey or needle: correct answers (and KV held) per policy, budget and prefill mode.
struct Cell {
  int correct = 0;
  int total = 0;
  double kv_fraction_sum = 0;  // KV bytes held / full cache, summed over the runs
  double accuracy() const { return total ? double(correct) / total : 0.0; }
  double kv_fraction() const { return total ? kv_fraction_sum / total : 0.0; }
};
using CellTable = std::vector<std::vector<std::vector<Cell>>>;  // [mode][policy][fraction]
struct RetrievalResult {
  std::vector<double> fractions;          // budgets, fraction of the prompt
  std::vector<std::string> modes;         // "observe", "stream"
  std::vector<std::string> policies;      // row 0 is full
  std::vector<uint32_t> contexts;         // prompt lengths asked for
  // All prompts together; full (row 0) is the same run in every column and mode.
  CellTable cells;
  std::vector<CellTable> by_context;      // [context] -> the same, for that length only
  double seconds = 0;
};

bool run_passkey(const Bench& bench, RetrievalResult* out, std::string* err);
bool run_needle(const Bench& bench, RetrievalResult* out, std::string* err);

struct PerplexityRow {
  std::string name;
  double perplexity = 0;
  KvHeld held;
  std::vector<double> window_ppl;  // per kPplWindow scored tokens
  double seconds = 0;
};
struct PerplexityResult {
  size_t scored_tokens = 0;
  uint32_t window = 0;  // scored tokens per window_ppl entry
  std::vector<uint64_t> cache_tokens;               // the bounds, e.g. 256, 512
  PerplexityRow full;
  std::vector<std::vector<PerplexityRow>> bounded;  // [bound][config]
  std::vector<float> profile;                       // entropy weights used
  double seconds = 0;
};
// Also fills bench->layer_weights (the entropy profile) first.
bool run_perplexity(Bench* bench, PerplexityResult* out, std::string* err);

}  // namespace quality
