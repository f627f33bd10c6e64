// kvgc-bench-quality: how much each kvgc eviction policy costs in model quality, measured
// on the real model (SmolLM2-135M-Instruct through the reference engine).
//
//   1. Passkey retrieval: a 5-digit key hidden at several depths in filler text; the
//      model must repeat it after the cache was squeezed to 10/20/50% of the context.
//   2. Streaming perplexity: teacher-forced log-likelihood of English prose with the
//      cache bounded to 256 tokens (StreamingLLM's setting: window with/without sinks).
//
// Every configuration gets its own heap, created with explicit options (ignoring the
// KVGC_* environment) on the CPU. Quick mode (default) finishes in a few minutes on two
// cores; --full runs longer contexts and more depths.
#include <cblas.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "engine/forward.hpp"
#include "engine/model.hpp"
#include "engine/tokenizer.hpp"
#include "gguf.hpp"

namespace {

using Clock = std::chrono::steady_clock;
constexpr uint32_t kPageTokens = 16;
constexpr uint32_t kSinks = 4;
constexpr uint32_t kWindow = 32;

struct Args {
  std::string model;
  std::string text = std::string(KVGC_QUALITY_DATA_DIR) + "/gpl-3.txt";
  bool full = false;
  bool passkey = true;
  bool perplexity = true;
};

// One cache configuration under test.
struct Config {
  const char* name;
  kvgc_policy policy;
  uint32_t sinks;
  kvgc_demote demote;
};

constexpr Config kFull{"full", KVGC_POLICY_FULL, kSinks, KVGC_DEMOTE_OFF};
constexpr Config kBounded[] = {
    {"generational", KVGC_POLICY_GENERATIONAL, kSinks, KVGC_DEMOTE_OFF},
    {"h2o", KVGC_POLICY_H2O, kSinks, KVGC_DEMOTE_OFF},
    {"streaming", KVGC_POLICY_STREAMING, kSinks, KVGC_DEMOTE_OFF},
    {"random", KVGC_POLICY_RANDOM, kSinks, KVGC_DEMOTE_OFF},
    {"generational+int4", KVGC_POLICY_GENERATIONAL, kSinks, KVGC_DEMOTE_INT4},
};
// StreamingLLM's baseline: a plain sliding window, no attention sinks.
constexpr Config kWindowNoSinks{"window(no sinks)", KVGC_POLICY_STREAMING, 0, KVGC_DEMOTE_OFF};

void usage(FILE* out) {
  std::fprintf(out,
               "usage: kvgc-bench-quality [--model PATH] [--text FILE] [--full]\n"
               "                          [--passkey-only | --perplexity-only]\n"
               "  --model PATH   GGUF file (default: $KVGC_MODEL, else ~/.cache/kvgc/%s)\n"
               "  --text FILE    prose for the perplexity part (default: %s/gpl-3.txt)\n"
               "  --full         longer contexts, more depths (slow; default is quick)\n",
               engine::kDefaultModelFile, KVGC_QUALITY_DATA_DIR);
}

bool parse_args(int argc, char** argv, Args* args) {
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      usage(stdout);
      std::exit(0);
    } else if (arg == "--full") {
      args->full = true;
    } else if (arg == "--passkey-only") {
      args->perplexity = false;
    } else if (arg == "--perplexity-only") {
      args->passkey = false;
    } else if (arg == "--model" && i + 1 < argc) {
      args->model = argv[++i];
    } else if (arg == "--text" && i + 1 < argc) {
      args->text = argv[++i];
    } else {
      std::fprintf(stderr, "kvgc-bench-quality: unknown or incomplete argument '%s'\n",
                   arg.c_str());
      usage(stderr);
      return false;
    }
  }
  if (args->model.empty()) args->model = engine::default_model_path();
  return true;
}

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Explicit options for one heap: the environment must not change what is measured.
kvgc_heap_options make_options(const Config& config, uint64_t token_budget,
                               const kvgc_model_desc& kv_model, uint64_t max_tokens) {
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
  // Room for the whole sequence uncompressed, twice over (compaction copies), instead
  // of a fraction of host memory.
  uint64_t bytes = 0;
  kvgc_kv_bytes(&kv_model, max_tokens, KVGC_CLASS_FP16, kPageTokens, &bytes);
  options.budget_bytes = 2 * bytes + (32u << 20);
  return options;
}

// log p(target) from raw logits, via a stable log-sum-exp.
double log_prob(const std::vector<float>& logits, int32_t target) {
  const float max = *std::max_element(logits.begin(), logits.end());
  double sum = 0.0;
  for (const float l : logits) sum += std::exp(double(l - max));
  return double(logits[size_t(target)] - max) - std::log(sum);
}

int32_t argmax(const std::vector<float>& logits) {
  return int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin());
}

// ---- part 1: passkey retrieval ---------------------------------------------------------

constexpr const char* kPasskey = "71432";
constexpr const char* kIntro =
    "There is an important info hidden inside a lot of irrelevant text. Find it and "
    "memorize it. I will quiz you about the important information there.\n";
constexpr const char* kFiller =
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back "
    "again. ";
constexpr const char* kNeedle = "The pass key is 71432. Remember it. 71432 is the pass key. ";
constexpr const char* kQuestion = "\nWhat is the pass key? The pass key is";
constexpr uint32_t kAnswerTokens = 8;

// The passkey prompt of about `target_tokens` tokens with the key at `depth` (0..1).
std::vector<int32_t> passkey_prompt(const engine::Tokenizer& tokenizer, uint32_t target_tokens,
                                    double depth) {
  const size_t fixed = tokenizer.encode(std::string(kIntro) + kNeedle + kQuestion).size();
  const size_t per_filler = tokenizer.encode(kFiller).size();
  const size_t n_filler = target_tokens > fixed ? (target_tokens - fixed) / per_filler : 1;
  const size_t before = size_t(std::lround(depth * double(n_filler)));
  std::string text = kIntro;
  for (size_t i = 0; i < n_filler; ++i) {
    if (i == before) text += kNeedle;
    text += kFiller;
  }
  if (before >= n_filler) text += kNeedle;
  text += kQuestion;
  return tokenizer.encode(text);
}

// Prefills the prompt, greedily decodes a few tokens, returns the decoded answer.
bool passkey_answer(const engine::Model& model, const engine::Tokenizer& tokenizer,
                    const kvgc_heap_options& options, const std::vector<int32_t>& prompt,
                    std::string* answer, std::string* err) {
  engine::Engine engine;
  if (!engine.init(model, &options, err)) return false;
  std::vector<float> logits(model.config.n_vocab);
  if (!engine.forward(prompt.data(), uint32_t(prompt.size()), logits.data(), err)) return false;
  std::vector<int32_t> generated;
  for (uint32_t i = 0; i < kAnswerTokens; ++i) {
    const int32_t token = argmax(logits);
    generated.push_back(token);
    if (i + 1 < kAnswerTokens && !engine.forward(&token, 1, logits.data(), err)) return false;
  }
  *answer = tokenizer.decode(generated);
  return true;
}

struct PasskeyRow {
  std::string name;
  std::vector<int> correct;  // per budget fraction: depths answered correctly
};

bool run_passkey(const engine::Model& model, const engine::Tokenizer& tokenizer,
                 const kvgc_model_desc& kv_model, bool full, std::vector<PasskeyRow>* rows,
                 const std::vector<double>& fractions, size_t* n_depths, std::string* err) {
  const uint32_t context = full ? 4096 : 1024;
  const std::vector<double> depths =
      full ? std::vector<double>{0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9}
           : std::vector<double>{0.1, 0.5, 0.9};
  *n_depths = depths.size();
  std::printf("== passkey retrieval: ~%u-token context, key %s at depths", context, kPasskey);
  for (const double d : depths) std::printf(" %.1f", d);
  std::printf("; sinks %u, window %u, page %u ==\n", kSinks, kWindow, kPageTokens);
  std::fflush(stdout);

  std::vector<std::vector<int32_t>> prompts;
  for (const double d : depths) prompts.push_back(passkey_prompt(tokenizer, context, d));
  const uint64_t max_tokens = prompts.front().size() + kAnswerTokens + 64;

  auto score = [&](const Config& config, double fraction, int* correct) {
    *correct = 0;
    for (size_t i = 0; i < depths.size(); ++i) {
      const uint64_t budget = uint64_t(std::lround(fraction * double(prompts[i].size())));
      const kvgc_heap_options options = make_options(config, budget, kv_model, max_tokens);
      std::string answer;
      if (!passkey_answer(model, tokenizer, options, prompts[i], &answer, err)) return false;
      const bool ok = answer.find(kPasskey) != std::string::npos;
      *correct += ok;
      for (char& c : answer) c = c == '\n' ? ' ' : c;
      std::fprintf(stderr, "  %-18s budget %3.0f%% depth %.1f: %s \"%s\"\n", config.name,
                   100.0 * fraction, depths[i], ok ? "ok  " : "MISS", answer.c_str());
    }
    return true;
  };

  // The full cache ignores the budget: one run serves as every column's baseline.
  PasskeyRow baseline{kFull.name, {}};
  int full_correct = 0;
  if (!score(kFull, 1.0, &full_correct)) return false;
  baseline.correct.assign(fractions.size(), full_correct);
  rows->push_back(baseline);
  for (const Config& config : kBounded) {
    PasskeyRow row{config.name, {}};
    for (const double fraction : fractions) {
      int correct = 0;
      if (!score(config, fraction, &correct)) return false;
      row.correct.push_back(correct);
    }
    rows->push_back(row);
  }

  std::printf("prompt tokens: %zu..%zu\n\n", prompts.front().size(), prompts.back().size());
  std::printf("%-20s", "policy \\ budget");
  for (const double f : fractions) std::printf("  %8.0f%%", 100.0 * f);
  std::printf("\n");
  for (const PasskeyRow& row : *rows) {
    std::printf("%-20s", row.name.c_str());
    for (const int c : row.correct) std::printf("  %5d/%zu ", c, depths.size());
    std::printf("\n");
  }
  std::printf("\n");
  return true;
}

// ---- part 2: streaming perplexity ------------------------------------------------------

// Teacher-forced mean negative log-likelihood of tokens[1..]. The engine returns only the
// last position's logits, so the text goes in one token at a time (kvgc_step runs after
// each, as in decode).
// *live_tokens: tokens per layer still held at the end (fp16 + int4), to show what a
// policy actually kept under the same budget.
bool mean_nll(const engine::Model& model, const kvgc_heap_options& options,
              const std::vector<int32_t>& tokens, double* nll, double* live_tokens,
              std::string* err) {
  engine::Engine engine;
  if (!engine.init(model, &options, err)) return false;
  std::vector<float> logits(model.config.n_vocab);
  double sum = 0.0;
  for (size_t i = 0; i + 1 < tokens.size(); ++i) {
    if (!engine.forward(&tokens[i], 1, logits.data(), err)) return false;
    sum -= log_prob(logits, tokens[i + 1]);
  }
  *nll = sum / double(tokens.size() - 1);
  kvgc_stats stats;
  kvgc_stats_init(&stats);
  if (kvgc_get_stats(engine.heap(), &stats) != KVGC_OK) {
    *err = std::string("kvgc_get_stats: ") + kvgc_errmsg(engine.heap());
    return false;
  }
  *live_tokens = double(stats.live_tokens) / model.config.n_layers;
  return true;
}

struct PerplexityRow {
  std::string name;
  double perplexity;
  double live_tokens;  // per layer, at the end
  double seconds;
};

bool run_perplexity(const engine::Model& model, const engine::Tokenizer& tokenizer,
                    const kvgc_model_desc& kv_model, const Args& args, bool full,
                    std::vector<PerplexityRow>* rows, std::string* err) {
  std::ifstream in(args.text);
  if (!in) {
    *err = "cannot read " + args.text;
    return false;
  }
  std::stringstream buffer;
  buffer << in.rdbuf();
  std::vector<int32_t> tokens = tokenizer.encode(buffer.str(), false);
  const size_t n_tokens = full ? 3000 : 896;  // quick: 7 token-by-token passes
  if (tokens.size() > n_tokens) tokens.resize(n_tokens);
  constexpr uint64_t kCacheTokens = 256;
  std::printf("== streaming perplexity: %zu tokens of %s, cache bounded to %llu tokens ==\n",
              tokens.size(), std::filesystem::path(args.text).filename().c_str(),
              (unsigned long long)kCacheTokens);
  std::fflush(stdout);

  std::vector<Config> configs = {kFull, kWindowNoSinks};
  configs.insert(configs.end(), std::begin(kBounded), std::end(kBounded));
  for (const Config& config : configs) {
    const auto start = Clock::now();
    double nll = 0.0;
    double live_tokens = 0.0;
    const kvgc_heap_options options =
        make_options(config, kCacheTokens, kv_model, tokens.size() + 64);
    if (!mean_nll(model, options, tokens, &nll, &live_tokens, err)) return false;
    rows->push_back({config.name, std::exp(nll), live_tokens, seconds_since(start)});
    std::fprintf(stderr, "  %-18s ppl %.3f (%.1f s)\n", config.name, rows->back().perplexity,
                 rows->back().seconds);
  }

  const double base = rows->front().perplexity;
  std::printf("\n%-20s  %10s  %8s  %11s\n", "policy", "perplexity", "vs full",
              "live tokens");
  for (const PerplexityRow& row : *rows) {
    std::printf("%-20s  %10.3f  %7.3fx  %11.0f\n", row.name.c_str(), row.perplexity,
                row.perplexity / base, row.live_tokens);
  }
  std::printf("\n");
  return true;
}

// "generational+int4" -> "generational_int4": RESULT keys are single words.
std::string key_name(std::string name) {
  std::string out;
  for (const char c : name) {
    if (std::isalnum(static_cast<unsigned char>(c))) out += c;
    else if (!out.empty() && out.back() != '_') out += '_';
  }
  while (!out.empty() && out.back() == '_') out.pop_back();
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  if (!parse_args(argc, argv, &args)) return 2;
  if (!std::filesystem::exists(args.model)) {
    std::fprintf(stderr,
                 "kvgc-bench-quality: model file %s not found.\n"
                 "Fetch SmolLM2-135M-Instruct with:  tools/fetch-model.sh\n",
                 args.model.c_str());
    return 1;
  }
  openblas_set_num_threads(2);
  const auto start = Clock::now();

  std::string err;
  gguf::File file;
  engine::Model model;
  engine::Tokenizer tokenizer;
  if (!file.open(args.model, &err) || !engine::load_model(file, &model, &err) ||
      !tokenizer.load(file, &err)) {
    std::fprintf(stderr, "kvgc-bench-quality: %s\n", err.c_str());
    return 1;
  }
  // The model shape kvgc sizes its heaps by, as the engine describes it.
  kvgc_model_desc kv_model;
  kvgc_model_desc_init(&kv_model);
  kv_model.n_layers = model.config.n_layers;
  kv_model.n_q_heads = model.config.n_heads;
  kv_model.n_kv_heads = model.config.n_kv_heads;
  kv_model.head_dim = model.config.head_dim;
  kv_model.dtype = KVGC_DTYPE_F32;
  std::printf("kvgc-bench-quality (%s mode), model %s\n\n", args.full ? "full" : "quick",
              std::filesystem::path(args.model).filename().c_str());

  const std::vector<double> fractions = {0.10, 0.20, 0.50};
  std::vector<PasskeyRow> passkey;
  std::vector<PerplexityRow> perplexity;
  size_t n_depths = 0;
  if (args.passkey &&
      !run_passkey(model, tokenizer, kv_model, args.full, &passkey, fractions, &n_depths, &err)) {
    std::fprintf(stderr, "kvgc-bench-quality: %s\n", err.c_str());
    return 1;
  }
  if (args.perplexity &&
      !run_perplexity(model, tokenizer, kv_model, args, args.full, &perplexity, &err)) {
    std::fprintf(stderr, "kvgc-bench-quality: %s\n", err.c_str());
    return 1;
  }

  // Ratios first: passkey accuracy at 20% vs full, perplexity vs full; raw values after.
  std::string result = "RESULT";
  char buf[128];
  if (!passkey.empty()) {
    const double base = double(passkey.front().correct[1]);
    for (size_t r = 1; r < passkey.size(); ++r) {
      std::snprintf(buf, sizeof buf, " passkey20_ratio_%s=%.2f",
                    key_name(passkey[r].name).c_str(),
                    base > 0 ? passkey[r].correct[1] / base : 0.0);
      result += buf;
    }
  }
  if (!perplexity.empty()) {
    for (size_t r = 1; r < perplexity.size(); ++r) {
      std::snprintf(buf, sizeof buf, " ppl_ratio_%s=%.3f",
                    key_name(perplexity[r].name).c_str(),
                    perplexity[r].perplexity / perplexity.front().perplexity);
      result += buf;
    }
  }
  for (const PasskeyRow& row : passkey) {
    for (size_t f = 0; f < fractions.size(); ++f) {
      std::snprintf(buf, sizeof buf, " passkey%.0f_%s=%d/%zu", 100.0 * fractions[f],
                    key_name(row.name).c_str(), row.correct[f], n_depths);
      result += buf;
    }
  }
  for (const PerplexityRow& row : perplexity) {
    std::snprintf(buf, sizeof buf, " ppl_%s=%.3f", key_name(row.name).c_str(), row.perplexity);
    result += buf;
  }
  std::snprintf(buf, sizeof buf, " seconds=%.0f", seconds_since(start));
  result += buf;
  std::printf("%s\n", result.c_str());
  return 0;
}
