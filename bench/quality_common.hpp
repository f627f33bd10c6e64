// Shared pieces of kvgc-bench-quality (bench/quality*.cpp): the cache configurations under
// test, heap options, the KV bytes a heap holds against an f16 full cache, a small job
// pool, the per-run results file, and what the parts report back to main.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "engine/forward.hpp"
#include "engine/model.hpp"
#include "engine/tokenizer.hpp"
#include "kvgc.h"

// The 0.4 C API (storage ladder, byte budget, recent-attention decay): configurations that
// need it are compiled in when the header has it.
#ifdef KVGC_HEAP_OPTIONS_0_3_SIZE
#define QUALITY_HAVE_LADDER 1
#else
#define QUALITY_HAVE_LADDER 0
#endif

namespace quality {

using Clock = std::chrono::steady_clock;
constexpr uint32_t kPageTokens = 16;
constexpr uint32_t kSinks = 4;
constexpr uint32_t kWindow = 32;
// The default --text (in KVGC_QUALITY_DATA_DIR, with ".txt"): its ppl-prefix ids carry no
// text name, another text's do.
inline const std::string kDefaultText = "jargon-intro";

// How a configuration's budget fraction becomes a heap budget.
enum class Budget : uint8_t {
  Tokens,  // token_budget = fraction x prompt tokens (live tokens per layer)
  Bytes,   // byte_budget = fraction x the f16 raw payload of the prompt, per layer (0.4)
};

// One cache configuration under test: one line of a table in quality_common.cpp.
struct Config {
  std::string name;
  kvgc_policy policy;
  uint32_t sinks = kSinks;
  int demote = KVGC_DEMOTE_OFF;  // kvgc_demote (int: 0.4 adds rungs)
  kvgc_layer_budget split = KVGC_LAYER_BUDGET_UNIFORM;
  Budget budget = Budget::Tokens;
  double recent_decay = 1.0;  // 0.4: generational's intermediate tier (1 = h2o's score)
  double score_noise = 0.0;   // Laplace scale on ranking scores
  // What a user gets: policy, sinks, young window, ladder and recent decay as
  // kvgc_heap_options_init sets them (the fields above are ignored but the budget's kind).
  bool library_defaults = false;
  // Issue 23 part 2's measurement: a library-defaults row with a fixed young window of
  // this many tokens (0: the library's, scaled to a byte budget since 0.9). Every other
  // row uses kWindow.
  uint32_t window_override = 0;
  // Issue 23 part 1's measurement: a library-defaults row with this ladder instead of the
  // library's (0: the library's).
  int demote_override = 0;
  // The observe prefill's pooling radius (engine::EngineOptions::pool_radius) of this
  // row's engines; -1: the engine's default.
  int pool_radius = -1;
  // EngineOptions::key_prior of this row's engines (a query-agnostic prior; 0: off).
  float key_prior = 0.0f;
  // EngineOptions::reconstruct of this row's engines (the reconstruction signal; 0: off).
  float reconstruct = 0.0f;
  bool reconstruct_across_layers = true;  // EngineOptions::reconstruct_across_layers
  bool reconstruct_head_peak = false;     // EngineOptions::reconstruct_head_peak
  // A sweep row (`env@bytes`): the library's defaults, then the KVGC_* variables of the
  // bench's own environment, as an operator's would apply; the budget stays the bench's.
  // Selected by name only, and named after the variables it ran under.
  bool from_env = false;
};

Config full_config();
// The engine options of a configuration's engines (its pooling radius).
struct Bench;
// The engine options a row's engines get (the reconstruction's prompt in the bench's
// tokenizer).
engine::EngineOptions engine_options(const Bench& bench, const Config& config);
// Every bounded configuration, in table order; retrieval and perplexity parts measure
// those whose `parts` include them (see quality_common.cpp).
std::vector<Config> retrieval_configs();
std::vector<Config> perplexity_configs();
// --configs NAME,NAME: keeps only the named ones (in the table's order); false with *err
// naming an unknown name and listing the known ones.
bool select_configs(const std::vector<std::string>& names, std::vector<Config>* configs,
                    std::string* err);
std::vector<std::string> all_config_names();

// What every part needs: the model, its tokenizer and kvgc's view of its shape.
struct Bench {
  const engine::Model* model = nullptr;
  const engine::Tokenizer* tokenizer = nullptr;
  kvgc_model_desc kv{};         // dtype: the engine's K/V dtype
  uint64_t n_ctx = 0;           // trained context length
  bool n_ctx_from_gguf = false; // read from the GGUF metadata (else the engine's default)
  unsigned jobs = 2;            // engines run side by side
  bool full = false;            // --full
  bool observe_only = false;    // --observe-only: no stream-prefill rows
  bool check_replay = false;    // --check-replay: every replay against a fresh prefill
  std::vector<uint32_t> contexts;  // --contexts: replaces the retrieval parts' lengths
  std::vector<double> depths;      // --depths: replaces the retrieval parts' depths
  std::vector<uint32_t> offsets;   // --offsets: where ppl-prefix's prefixes start (tokens)
  std::vector<double> fractions;   // --fractions: replaces the budgets
  size_t prompts_per_cell = 0;     // --prompts: the kinds task's prompts a cell (0: the mode's)
  std::vector<std::string> config_names;  // --configs (empty: all)
  std::string text_path;        // prose: needle haystack, perplexity, entropy profile
  std::string text2_path;       // the second haystack (needle2)
  std::string out_dir;          // data files, profile, plots
  std::string prefix;           // out_dir + "/quick" or "/full"
  std::vector<float> layer_weights;  // entropy profile (filled by the perplexity part)
};

// Explicit options for one heap (the KVGC_* environment must not change what is
// measured). `fraction` of a `prompt_tokens`-token prompt, as config.budget says; ignored
// by the full policy. max_tokens sizes the arena.
kvgc_heap_options make_options(const Bench& bench, const Config& config, double fraction,
                               uint64_t prompt_tokens, uint64_t max_tokens);
// The same with an absolute per-layer token budget (the streaming perplexity bounds);
// Budget::Bytes configurations get the bytes of that many f16 tokens instead.
kvgc_heap_options make_options_tokens(const Bench& bench, const Config& config,
                                      uint64_t token_budget, uint64_t max_tokens);

// KV memory a heap holds now: live tokens per layer and bytes of pages in use (every
// class), against the raw f16 payload of `length` tokens (kvgc_kv_bytes, F16, page_tokens
// 0): what an engine keeping every token in f16 holds. So 1.0 is an f16 full cache and an
// f32 engine's full cache reads about 2.
struct KvHeld {
  double live_tokens = 0;  // per layer
  uint64_t bytes = 0;
  uint64_t f16_full_bytes = 0;
  uint64_t class_bytes[4] = {0, 0, 0, 0};  // FP16 (model dtype), INT4, INT8, INT2
  double fraction() const { return f16_full_bytes ? double(bytes) / double(f16_full_bytes) : 0.0; }
};
bool kv_held(const engine::Engine& engine, uint32_t n_layers, uint64_t length, KvHeld* out,
             std::string* err);
uint64_t f16_payload_bytes(const kvgc_model_desc& kv, uint64_t tokens);

// Runs job(i, &err) for i in [0, n) on `jobs` threads; false with the first error.
bool run_jobs(size_t n, unsigned jobs, const std::function<bool(size_t, std::string*)>& job,
              std::string* err);

// One line to stderr, whole, from any thread.
void progress(const char* format, ...) __attribute__((format(printf, 1, 2)));

// The per-run results file (--results FILE, JSON lines), read by bench/anchors/report.py
// beside the anchors' files of the same format. Thread-safe; a no-op when not opened.
class Results {
 public:
  bool open(const std::string& path, std::string* err);
  // One record: fields already formatted as JSON ("\"task\":\"passkey\",...").
  void write(const std::string& fields);
  bool is_open() const { return file_ != nullptr; }
  ~Results();

 private:
  std::mutex mutex_;
  FILE* file_ = nullptr;
};
Results& results();
std::string json_string(const std::string& s);

double seconds_since(Clock::time_point start);
using engine::argmax;
using engine::log_prob;
bool read_text(const std::string& path, std::string* text, std::string* err);
bool write_text(const std::string& path, const std::string& text, std::string* err);
// "generational+int4" -> "generational_int4": RESULT keys are single words.
std::string key_name(const std::string& name);
// Names for data-file headers (gnuplot column headers: no spaces).
std::string column_name(const std::string& name);
std::string lower(std::string s);

// ---- the parts ----------------------------------------------------------------------

// A retrieval cell: correct answers (and KV held) per configuration and budget.
struct Cell {
  int correct = 0;
  int total = 0;
  int kept = 0;  // correct where the full cache was correct too (the full row: its correct)
  double kv_fraction_sum = 0;  // KV bytes held / f16 full cache, summed over the runs
  double accuracy() const { return total ? double(correct) / total : 0.0; }
  double kv_fraction() const { return total ? kv_fraction_sum / total : 0.0; }
};
using CellTable = std::vector<std::vector<std::vector<Cell>>>;  // [mode][config][fraction]
struct RetrievalResult {
  std::string task;                       // "passkey", "passkey-word", ...
  std::vector<double> fractions;          // budgets
  std::vector<std::string> modes;         // "observe", "stream"
  std::vector<std::string> policies;      // row 0 is full
  std::vector<std::string> budget_kinds;  // per row: "tokens" or "bytes"
  std::vector<uint32_t> contexts;         // prompt lengths asked for
  // All prompts together; full (row 0) is the same run in every column and mode.
  CellTable cells;
  std::vector<CellTable> by_context;      // [context] -> the same, for that length only
  std::vector<std::string> cell_names;    // tasks with cells (kinds): "TEXT/FORMAT"
  std::vector<std::vector<CellTable>> by_cell;  // [cell][context] -> the same
  size_t replays_checked = 0, replay_mismatches = 0, answer_mismatches = 0;
  double seconds = 0;
};

// The retrieval tasks: passkey (digits, stream mode too), passkey-word, multikey, needle
// (Jargon File), needle2 (the second haystack), kinds (texts x key formats).
std::vector<std::string> retrieval_task_names();
bool run_retrieval(const Bench& bench, const std::string& task, RetrievalResult* out,
                   std::string* err);
// Writes every retrieval prompt and the perplexity texts as token ids (JSON lines) for the
// anchors (bench/anchors/*.py), without running anything.
bool export_tasks(const Bench& bench, const std::vector<std::string>& tasks, bool perplexity,
                  const std::string& path, std::string* err);

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

// Prefix perplexity (the anchors' protocol): a prefix of the prose compressed by one
// observe prefill to each budget, then the continuation scored teacher-forced.
struct PrefixPplResult {
  std::vector<double> fractions;
  std::vector<std::string> policies;   // row 0 is full
  std::vector<std::string> budget_kinds;
  // [config][fraction]: perplexity over all prefixes' continuations, KV held
  std::vector<std::vector<double>> perplexity, kv_fraction;
  size_t prefixes = 0, scored_tokens = 0;
  double seconds = 0;
};
bool run_prefix_perplexity(const Bench& bench, PrefixPplResult* out, std::string* err);

// Score noise against an attacker who sees which tokens stay cached (item 6 of issue 12).
struct PrivacyRow {
  double noise = 0;
  double advantage = 0;     // TPR - FPR of "cached => heavy hitter", mean over prompts
  double accuracy = 0;      // passkey accuracy
  int correct = 0, total = 0;
};
struct PrivacyResult {
  std::string config;
  double fraction = 0;
  std::vector<PrivacyRow> rows;
  double seconds = 0;
};
bool run_privacy(const Bench& bench, PrivacyResult* out, std::string* err);

}  // namespace quality
