// The real-model test: SmolLM2-135M-Instruct through the reference engine, its KV cache
// in a kvgc heap (CPU). First, its tokenizer equals the rescanning reference merge on the
// real vocabulary; then four checks a user of kvgc would ask for first:
//   1. full cache: perplexity of a fixed English passage stays under a recorded bound,
//      with the default engine and the exact one;
//   2. full cache: greedy answers to factual chat prompts a 135M model gets right;
//   3. generational at a 25% budget: a 5-digit passkey hidden in ~1K tokens of filler, at
//      three depths, is repeated correctly (the engine's default SnapKV-style prefill);
//   4. generational at 25% of the bytes: short chats answer as the full cache does.
// Needs the downloaded model (tools/fetch-model.sh): without it the test is skipped
// (exit 77), unless KVGC_REQUIRE_MODEL=1 (CI) makes a missing model a failure.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "engine/forward.hpp"
#include "engine/model.hpp"
#include "engine/tokenizer.hpp"
#include "fuzz/tokenizer_reference.hpp"
#include "gguf.hpp"
#include "model_missing.hpp"

namespace {

// Perplexity of this passage (the first 2,600 bytes of GPL-3, 577 tokens), measured
// 2026-12-01: 19.219 with the default engine (q8 activations, f16 K/V; 19.234 with the
// portable kernels, which round the float sums differently), 19.196 with the exact one
// (as OpenBLAS f32 gave before). The bounds leave 3% and 1%: a broken forward pass or
// cache (a wrong RoPE position, a lost token, a mixed-up head) lands far above them.
constexpr double kPerplexityBound = 19.80;
constexpr double kExactPerplexityBound = 19.40;
// Mean |log p(next token)| between prefill-chunk and decode logits with q8 activations:
// measured 0.048 nats (0.095 before the AVX2 Q4_1 offsets became explicit fmas).
constexpr double kLogProbGapBound = 0.2;

int failures = 0;

void check(bool ok, const std::string& what) {
  std::printf("%s  %s\n", ok ? "ok  " : "FAIL", what.c_str());
  if (!ok) ++failures;
}

kvgc_heap_options options(kvgc_policy policy, double budget_fraction) {
  kvgc_heap_options o;
  kvgc_heap_options_init(&o);
  o.flags |= KVGC_OPT_IGNORE_ENV;  // what is tested must not depend on the caller's KVGC_*
  o.device = KVGC_DEVICE_CPU;
  o.policy = policy;
  o.token_budget_fraction = budget_fraction;
  return o;
}

// Prefills `prompt` and greedily decodes up to `max_tokens`.
std::string generate(const engine::Model& model, const engine::Tokenizer& tok,
                     const kvgc_heap_options& o, const std::vector<int32_t>& prompt,
                     uint32_t max_tokens, std::string* err,
                     const engine::EngineOptions& engine_options = {}) {
  engine::Engine e;
  std::vector<float> logits(model.config.n_vocab);
  if (!e.init(model, &o, err, engine_options) ||
      !e.prefill(prompt.data(), uint32_t(prompt.size()), logits.data(), err))
    return {};
  std::vector<int32_t> out;
  for (uint32_t i = 0; i < max_tokens; ++i) {
    const int32_t t = engine::argmax(logits.data(), uint32_t(logits.size()));
    if (t == tok.eos()) break;
    out.push_back(t);
    if (i + 1 < max_tokens && !e.forward(&t, 1, logits.data(), err)) return {};
  }
  return tok.decode(out);
}

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

}  // namespace

int main() {
  const std::string path = engine::default_model_path();
  if (const int missing = model_missing(path, "the real-model test")) return missing;
  engine::set_default_threads(2);
  std::string err;
  gguf::File file;
  engine::Model model;
  engine::Tokenizer tok;
  if (!file.open(path, &err) || !engine::load_model(file, &model, &err) || !tok.load(file, &err)) {
    std::printf("FAIL  loading %s: %s\n", path.c_str(), err.c_str());
    return 1;
  }

  // 0. The priority-queue merge gives the reference's ids on the vendored texts, random
  // bytes and long single pieces.
  {
    std::vector<std::string> inputs = {read_file(KVGC_QUALITY_DATA_DIR "/jargon-intro.txt"),
                                       read_file(KVGC_QUALITY_DATA_DIR "/gpl-3.txt"),
                                       read_file(KVGC_TEST_DATA_DIR "/passage.txt"),
                                       std::string(3000, 'a'), std::string(3000, ' ')};
    std::mt19937 rng(5);
    for (int i = 0; i < 200; ++i) {
      std::string bytes(rng() % 400, '\0');
      for (char& c : bytes) c = char(rng() & 0xff);
      inputs.push_back(bytes);
    }
    std::string letters(3000, 'a');
    for (char& c : letters) c = char('a' + rng() % 26);
    inputs.push_back(letters);
    kvgc_test::ReferenceTokenizer ref;
    size_t differ = 0, tokens = 0;
    const bool loaded = ref.load(file);
    for (const std::string& text : inputs) {
      for (const bool special : {false, true}) {
        const std::vector<int32_t> ids = tok.encode(text, special);
        tokens += ids.size();
        differ += !loaded || ids != ref.encode(text, special);
      }
    }
    check(loaded && differ == 0 && inputs[0].size() > 60000,
          "tokenizer equals the reference merge: " + std::to_string(2 * inputs.size()) +
              " encodings, " + std::to_string(tokens) + " tokens, " + std::to_string(differ) +
              " differ");
  }

  // 1. Perplexity of the fixed passage, full cache, all positions from prefill chunks,
  // with the default engine (q8 activations, f16 K/V) and the exact one (f32 matmuls of
  // the dequantised weights, f32 K/V).
  const std::string passage = read_file(KVGC_TEST_DATA_DIR "/passage.txt");
  const std::vector<int32_t> tokens = tok.encode(passage, false);
  const uint32_t n_vocab = model.config.n_vocab;
  engine::EngineOptions exact;
  exact.matmul = engine::MatmulMode::Exact;
  exact.kv_dtype = KVGC_DTYPE_F32;
  struct Mode {
    const char* name;
    engine::EngineOptions options;
    double bound;
  } modes[] = {{"default", {}, kPerplexityBound}, {"exact", exact, kExactPerplexityBound}};
  for (const Mode& mode : modes) {
    engine::Engine e;
    const kvgc_heap_options o = options(KVGC_POLICY_FULL, 0);
    std::vector<float> all(tokens.size() * n_vocab);
    engine::Engine::Pass pass;
    pass.all_logits = all.data();
    double nll = 0;
    const bool ran = !passage.empty() && e.init(model, &o, &err, mode.options) &&
                     e.forward(tokens.data(), uint32_t(tokens.size()), nullptr, &err, pass);
    for (size_t i = 0; ran && i + 1 < tokens.size(); ++i)
      nll -= engine::log_prob(&all[i * n_vocab], n_vocab, tokens[i + 1]);
    // The chunked logits must be what decoding one token at a time gives. Exactly (but for
    // summation order: a max relative error of 2.7e-6 measured) with exact matmuls and f32
    // K/V. With quantised activations the two differ by more: an activation that lands on a
    // rounding boundary in one run and not in the other moves a whole 8-bit step, and such
    // flips compound over 30 layers into independent draws of the quantisation noise
    // (measured: 0.095 nats mean |log p| difference at the next token, 9% of the largest
    // logit; a wrong decode kernel or position is off by nats).
    const uint32_t n_check = std::min<uint32_t>(80, uint32_t(tokens.size()) - 1);
    engine::Engine d;
    std::vector<float> one(n_vocab);
    double worst = ran ? 0 : INFINITY, log_prob_gap = 0;
    const bool decoded = ran && d.init(model, &o, &err, mode.options);
    for (uint32_t i = 0; decoded && i < n_check; ++i) {
      if (!d.forward(&tokens[i], 1, one.data(), &err)) {
        worst = log_prob_gap = INFINITY;
        break;
      }
      double scale = 0, diff = 0;
      for (uint32_t v = 0; v < n_vocab; ++v) {
        scale = std::max(scale, std::fabs(double(one[v])));
        diff = std::max(diff, std::fabs(double(one[v]) - all[size_t(i) * n_vocab + v]));
      }
      worst = std::max(worst, diff / std::max(scale, 1e-30));
      log_prob_gap += std::fabs(engine::log_prob(one.data(), n_vocab, tokens[i + 1]) -
                                engine::log_prob(&all[size_t(i) * n_vocab], n_vocab,
                                                 tokens[i + 1])) / n_check;
    }
    char same[200];
    if (mode.options.matmul == engine::MatmulMode::Exact) {
      std::snprintf(same, sizeof same,
                    "%s: prefill-chunk logits equal decode logits over %u positions (max rel. "
                    "error %.2e)", mode.name, n_check, worst);
      check(worst < 1e-4, same);
    } else {
      std::snprintf(same, sizeof same,
                    "%s: prefill-chunk and decode log-probs agree over %u positions (mean "
                    "|difference| %.3f nats, bound %.2f)", mode.name, n_check, log_prob_gap,
                    kLogProbGapBound);
      check(log_prob_gap < kLogProbGapBound, same);
    }
    const double ppl = ran ? std::exp(nll / double(tokens.size() - 1)) : INFINITY;
    char what[200];
    std::snprintf(what, sizeof what, "%s: full-cache perplexity %.3f over %zu tokens (bound %.2f)%s",
                  mode.name, ppl, tokens.size(), mode.bound, ran ? "" : (" " + err).c_str());
    check(ran && ppl < mode.bound && ppl > 1.0, what);
  }

  // 2. Factual answers, full cache, default engine. "What is the capital of France?" is a
  // near-tie at its first token ("The" 25.33 against "L" 25.24 with exact matmuls): q8
  // activations flip it to "L'Étoile, ...", so it is asked of the exact engine.
  const struct {
    const char* question;
    const char* answer;
    bool exact;
  } facts[] = {{"What is the capital of France?", "Paris", true},
               {"What is the capital of Japan?", "Tokyo", false},
               {"How many days are in a week?", "7", false},
               {"What is the chemical symbol for gold?", "Au", false}};
  for (const auto& f : facts) {
    const std::vector<int32_t> prompt =
        tok.encode(engine::apply_chat_template({{"user", f.question}}, true));
    const std::string a = generate(model, tok, options(KVGC_POLICY_FULL, 0), prompt, 16, &err,
                                   f.exact ? exact : engine::EngineOptions{});
    check(a.find(f.answer) != std::string::npos,
          std::string("full cache") + (f.exact ? " (exact)" : "") + ": \"" + f.question +
              "\" -> \"" + a + "\" (wants " + f.answer + ")");
  }

  // 3. Passkey under generational at 25%: the budget is a quarter of the ~1.2K prompt.
  const std::string filler =
      "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back "
      "again. ";
  for (const int before : {5, 25, 45}) {
    std::string text =
        "There is important info hidden inside a lot of irrelevant text. Find it and memorize "
        "it. I will quiz you about the important information there. ";
    for (int i = 0; i < 50; ++i) {
      if (i == before) text += "The pass key is 71432. Remember it. 71432 is the pass key. ";
      text += filler;
    }
    text += "What is the pass key? The pass key is";
    const std::vector<int32_t> prompt = tok.encode(text);
    const std::string a =
        generate(model, tok, options(KVGC_POLICY_GENERATIONAL, 0.25), prompt, 6, &err);
    check(a.find("71432") != std::string::npos,
          "generational 25%: passkey at filler " + std::to_string(before) + "/50 of " +
              std::to_string(prompt.size()) + " tokens -> \"" + a + "\"" +
              (a.empty() ? " " + err : ""));
  }
  // 4. Short chats keep their meaning under a budget (KVGC_MIN_LENGTH, 0.14): at 25% of
  // the bytes, the default's greedy answer to each is the full cache's for its first 32
  // tokens (prompt and answer stay under min_length: nothing is pruned). The README's
  // prompts and six others, 37 to 86 tokens. With the rule off, the same budget must
  // change some answer: otherwise this check could not fail.
  {
    const char* chats[] = {
        "Write a short story about a lighthouse keeper.",
        "Write a short story about a lighthouse keeper who finds a message in a bottle.",
        "What is the capital of France?",
        "Explain in two sentences why the sky is blue.",
        "Give me three tips for a good night's sleep.",
        "Write a haiku about autumn leaves.",
        "Translate 'good morning' and 'thank you' into French and Spanish.",
        "I am planning a week in Italy in May. I like museums, food and long walks, but not "
        "crowds, and my budget is moderate. Which two cities would you suggest, what should "
        "I see in each, and how should I travel between them? Please keep it short."};
    kvgc_heap_options budget = options(KVGC_POLICY_GENERATIONAL, 0);
    budget.byte_budget_fraction = 0.25;
    kvgc_heap_options no_rule = budget;
    no_rule.min_length = 0;
    int changed_without_rule = 0;
    for (const char* chat : chats) {
      const std::vector<int32_t> prompt = tok.encode(engine::apply_chat_template({{"user", chat}}, true));
      const std::string full = generate(model, tok, options(KVGC_POLICY_FULL, 0), prompt, 32, &err);
      const std::string kept = generate(model, tok, budget, prompt, 32, &err);
      changed_without_rule += generate(model, tok, no_rule, prompt, 32, &err) != full;
      check(!full.empty() && kept == full,
            "generational at 25% of the bytes, a " + std::to_string(prompt.size()) +
                "-token chat: the full cache's first 32 tokens (\"" + kept.substr(0, 60) + "...\")");
    }
    check(changed_without_rule > 0, "with KVGC_MIN_LENGTH=0 the same budget changes " +
                                        std::to_string(changed_without_rule) + " of the " +
                                        std::to_string(std::size(chats)) + " answers");
  }
  std::printf("%d failure(s)\n", failures);
  return failures ? 1 : 0;
}
