// Retrieval parts of kvgc-bench-quality: a passkey in synthetic filler, and a needle
// sentence in real prose (the Jargon File). Each prompt is prefilled through
// Engine::prefill under a policy, a budget and a prefill mode, then answered greedily.
#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "quality_common.hpp"

namespace quality {
namespace {

using PrefillMode = engine::Engine::PrefillMode;

struct Prompt {
  std::vector<int32_t> tokens;
  size_t context = 0;  // index into Task::contexts
  double depth = 0;
};

// A retrieval task: prompts, the answer to find in the greedy continuation, the budgets
// and the prefill modes to compare.
struct Task {
  const char* name;
  std::string expect;  // lowercase; the answer must contain it
  uint32_t answer_tokens;
  std::vector<PrefillMode> modes;
  std::vector<double> fractions;
  std::vector<uint32_t> contexts;
  std::vector<Prompt> prompts;
};

// Prompt lengths and the depths measured at each.
struct Grid {
  uint32_t context;
  std::vector<double> depths;
};

const char* mode_name(PrefillMode mode) {
  return mode == PrefillMode::Observe ? "observe" : "stream";
}

// The mode's grid, or --contexts / --depths; lengths capped so prompt + answer stays
// inside the trained context.
std::vector<Grid> grid(const Bench& bench, const std::vector<Grid>& wanted,
                       uint32_t answer_tokens, const char* part) {
  std::vector<Grid> g = wanted;
  if (!bench.contexts.empty()) {
    g.clear();
    for (const uint32_t c : bench.contexts) g.push_back({c, wanted.front().depths});
  }
  if (!bench.depths.empty())
    for (Grid& x : g) x.depths = bench.depths;
  const uint64_t cap = bench.n_ctx > answer_tokens + 16 ? bench.n_ctx - answer_tokens - 16 : 0;
  for (Grid& x : g) {
    const uint32_t capped = uint32_t(std::min<uint64_t>(x.context, cap));
    if (capped != x.context) {
      std::printf("(%s: %u-token context capped at %u: the model's trained context is %llu "
                  "tokens%s)\n", part, x.context, capped, (unsigned long long)bench.n_ctx,
                  bench.n_ctx_from_gguf ? ", from the GGUF metadata" : ", assumed");
      x.context = capped;
    }
  }
  return g;
}

void print_grid(const std::vector<Grid>& g) {
  for (size_t i = 0; i < g.size(); ++i) {
    std::printf("%s~%u tokens at depths", i ? "; " : "", g[i].context);
    for (const double d : g[i].depths) std::printf(" %.1f", d);
  }
}

std::string lower(std::string s) {
  for (char& c : s) c = char(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

// Prefills under `mode`, decodes greedily (stopping at an end-of-turn token); the answer
// text and the KV held at the end.
bool answer(const Bench& bench, const kvgc_heap_options& options, const Prompt& prompt,
            PrefillMode mode, uint32_t answer_tokens, std::string* text, KvHeld* held,
            std::string* err) {
  const uint32_t n_vocab = bench.model->config.n_vocab;
  engine::Engine engine;
  if (!engine.init(*bench.model, &options, err)) return false;
  std::vector<float> logits(n_vocab);
  if (!engine.prefill(prompt.tokens.data(), uint32_t(prompt.tokens.size()), logits.data(), err,
                      mode)) {
    return false;
  }
  const engine::Tokenizer& tokenizer = *bench.tokenizer;
  const int32_t im_end = tokenizer.find("<|im_end|>");
  const int32_t end_of_text = tokenizer.find("<|endoftext|>");
  std::vector<int32_t> generated;
  for (uint32_t i = 0; i < answer_tokens; ++i) {
    const int32_t token = argmax(logits.data(), n_vocab);
    if (token == im_end || token == end_of_text || token == tokenizer.eos()) break;
    generated.push_back(token);
    if (i + 1 < answer_tokens && !engine.forward(&token, 1, logits.data(), err)) return false;
  }
  *text = tokenizer.decode(generated);
  return kv_held(engine, bench.model->config.n_layers, engine.position(), held, err);
}

bool run_task(const Bench& bench, const Task& task, RetrievalResult* out, std::string* err) {
  const auto start = Clock::now();
  const std::vector<Config> bounded = retrieval_configs();
  const std::vector<double>& fractions = task.fractions;
  out->fractions = fractions;
  out->contexts = task.contexts;
  out->modes.clear();
  for (const PrefillMode m : task.modes) out->modes.push_back(mode_name(m));
  out->policies = {full_config().name};
  for (const Config& c : bounded) out->policies.push_back(c.name);
  const CellTable empty(task.modes.size(),
                        std::vector<std::vector<Cell>>(out->policies.size(),
                                                       std::vector<Cell>(fractions.size())));
  out->cells = empty;
  out->by_context.assign(task.contexts.size(), empty);

  // One job per (prompt, mode, policy, budget). The full cache never evicts, so one run
  // per prompt (observe mode) serves every budget and mode.
  struct Job {
    size_t prompt, mode, policy, fraction;
  };
  std::vector<Job> jobs;
  for (size_t p = 0; p < task.prompts.size(); ++p) {
    jobs.push_back({p, 0, 0, 0});
    for (size_t m = 0; m < task.modes.size(); ++m)
      for (size_t c = 0; c < bounded.size(); ++c)
        for (size_t f = 0; f < fractions.size(); ++f) jobs.push_back({p, m, c + 1, f});
  }
  // Longest prompts first, so the pool ends evenly.
  std::stable_sort(jobs.begin(), jobs.end(), [&](const Job& a, const Job& b) {
    return task.prompts[a.prompt].tokens.size() > task.prompts[b.prompt].tokens.size();
  });
  struct Outcome {
    bool ok = false;
    double kv_fraction = 0;
  };
  std::vector<Outcome> outcomes(jobs.size());
  const bool done = run_jobs(jobs.size(), bench.jobs, [&](size_t i, std::string* e) {
    const Job& job = jobs[i];
    const Prompt& prompt = task.prompts[job.prompt];
    const Config config = job.policy == 0 ? full_config() : bounded[job.policy - 1];
    const double fraction = job.policy == 0 ? 1.0 : fractions[job.fraction];
    const uint64_t budget = uint64_t(std::lround(fraction * double(prompt.tokens.size())));
    const kvgc_heap_options options =
        make_options(bench, config, budget, prompt.tokens.size() + task.answer_tokens + 64);
    const auto run_start = Clock::now();
    std::string text;
    KvHeld held;
    if (!answer(bench, options, prompt, task.modes[job.mode], task.answer_tokens, &text, &held,
                e)) {
      return false;
    }
    outcomes[i].ok = lower(text).find(task.expect) != std::string::npos;
    outcomes[i].kv_fraction = held.fraction();
    for (char& c : text) c = c == '\n' ? ' ' : c;
    progress("  %s %-7s %-18s budget %3.0f%% ctx %5zu depth %.1f: %s kv %3.0f%% %4.1f s \"%s\"",
             task.name, job.policy == 0 ? "-" : mode_name(task.modes[job.mode]),
             config.name.c_str(), 100.0 * fraction, prompt.tokens.size(), prompt.depth,
             outcomes[i].ok ? "ok  " : "MISS", 100.0 * held.fraction(), seconds_since(run_start),
             text.c_str());
    return true;
  }, err);
  if (!done) return false;

  for (size_t i = 0; i < jobs.size(); ++i) {
    const Job& job = jobs[i];
    auto add = [&](CellTable& table) {
      auto add_cell = [&](Cell& cell) {
        cell.correct += outcomes[i].ok;
        cell.total += 1;
        cell.kv_fraction_sum += outcomes[i].kv_fraction;
      };
      if (job.policy == 0) {
        for (auto& mode : table)
          for (Cell& cell : mode[0]) add_cell(cell);
      } else {
        add_cell(table[job.mode][job.policy][job.fraction]);
      }
    };
    add(out->cells);
    add(out->by_context[task.prompts[job.prompt].context]);
  }
  out->seconds = seconds_since(start);
  return true;
}

// Tables per mode ("correct/total kv%" per policy and budget, then by context), and the
// data files.
bool report(const Bench& bench, const char* part, const RetrievalResult& r, std::string* err) {
  for (size_t m = 0; m < r.modes.size(); ++m) {
    std::printf("prefill mode %s%s: correct/total, and KV bytes held at the end as %% of "
                "the full cache\n",
                r.modes[m].c_str(), m == 0 ? " (the engine's default)" : "");
    std::printf("%-20s", "policy \\ budget");
    for (const double f : r.fractions) std::printf("  %12.0f%%", 100.0 * f);
    std::printf("\n");
    for (size_t p = 0; p < r.policies.size(); ++p) {
      std::printf("%-20s", r.policies[p].c_str());
      for (const Cell& cell : r.cells[m][p]) {
        char buf[32];
        std::snprintf(buf, sizeof buf, "%d/%d", cell.correct, cell.total);
        std::printf("  %7s %4.0f%%", buf, 100.0 * cell.kv_fraction());
      }
      std::printf("\n");
    }
    if (r.contexts.size() > 1) {
      std::printf("by context (correct/total at each budget):\n%-20s", "");
      for (const uint32_t c : r.contexts) {
        char head[64];
        int at = std::snprintf(head, sizeof head, "~%u:", c);
        for (const double f : r.fractions)
          at += std::snprintf(head + at, sizeof head - size_t(at), " %.0f%%", 100.0 * f);
        std::printf("  %-18s", head);
      }
      std::printf("\n");
      for (size_t p = 0; p < r.policies.size(); ++p) {
        std::printf("%-20s", r.policies[p].c_str());
        for (size_t c = 0; c < r.contexts.size(); ++c) {
          char cells[64];
          int at = 0;
          for (const Cell& cell : r.by_context[c][m][p]) {
            at += std::snprintf(cells + at, sizeof cells - size_t(at), "%s%d/%d", at ? " " : "",
                                cell.correct, cell.total);
          }
          std::printf("  %-18s", cells);
        }
        std::printf("\n");
      }
    }
    std::printf("\n");
    // gnuplot data: budget %, then accuracy per policy (header line = column titles).
    std::string data = "budget";
    for (const std::string& p : r.policies) data.append(" ").append(column_name(p));
    data += "\n";
    for (size_t f = 0; f < r.fractions.size(); ++f) {
      char buf[32];
      std::snprintf(buf, sizeof buf, "%.0f", 100.0 * r.fractions[f]);
      data += buf;
      for (size_t p = 0; p < r.policies.size(); ++p) {
        std::snprintf(buf, sizeof buf, " %.4f", r.cells[m][p][f].accuracy());
        data += buf;
      }
      data += "\n";
    }
    if (!write_text(bench.prefix + "-" + part + "-" + r.modes[m] + ".dat", data, err)) {
      return false;
    }
  }
  std::printf("(%.0f s)\n\n", r.seconds);
  return true;
}

// ---- passkey -------------------------------------------------------------------------

constexpr const char* kIntro =
    "There is an important info hidden inside a lot of irrelevant text. Find it and "
    "memorize it. I will quiz you about the important information there.\n";
constexpr const char* kFiller =
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back "
    "again. ";
constexpr const char* kPasskey = "71432";
constexpr const char* kKeySentence =
    "The pass key is 71432. Remember it. 71432 is the pass key. ";
constexpr const char* kKeyQuestion = "\nWhat is the pass key? The pass key is";

// The passkey prompt of about `target` tokens with the key at `depth` (0..1).
Prompt passkey_prompt(const engine::Tokenizer& tokenizer, uint32_t target, double depth,
                      size_t context) {
  const size_t fixed = tokenizer.encode(std::string(kIntro) + kKeySentence + kKeyQuestion).size();
  const size_t per_filler = tokenizer.encode(kFiller).size();
  const size_t n_filler = target > fixed ? (target - fixed) / per_filler : 1;
  const size_t before = size_t(std::lround(depth * double(n_filler)));
  std::string text = kIntro;
  for (size_t i = 0; i < n_filler; ++i) {
    if (i == before) text += kKeySentence;
    text += kFiller;
  }
  if (before >= n_filler) text += kKeySentence;
  text += kKeyQuestion;
  return {tokenizer.encode(text), context, depth};
}

// ---- needle in prose -----------------------------------------------------------------

constexpr const char* kNeedle = "The secret ingredient of the porridge is cardamom.";
constexpr const char* kNeedleAnswer = "cardamom";
constexpr const char* kNeedleTask =
    "Below is an excerpt from the Jargon File. Read it carefully, then answer the question "
    "that follows it.\n\n";
constexpr const char* kNeedleQuestion =
    "\n\nQuestion: What is the secret ingredient of the porridge?";

std::vector<std::string> paragraphs(const std::string& text) {
  std::vector<std::string> out;
  size_t at = 0;
  while (at < text.size()) {
    size_t end = text.find("\n\n", at);
    if (end == std::string::npos) end = text.size();
    std::string p = text.substr(at, end - at);
    while (!p.empty() && (p.back() == '\n' || p.back() == ' ')) p.pop_back();
    if (!p.empty()) out.push_back(p);
    at = end + 2;
  }
  return out;
}

// A chat prompt of about `target` tokens: the first paragraphs of the prose with the
// needle sentence as a paragraph of its own at the boundary nearest `depth`, then the
// question. The assistant's turn starts empty: the answer's words (not only its first
// token, which the prefill computes before any eviction) come from the evicted cache.
Prompt needle_prompt(const engine::Tokenizer& tokenizer, const std::vector<std::string>& paras,
                     uint32_t target, double depth, size_t context) {
  auto wrap = [](const std::string& prose) {
    return engine::apply_chat_template(
        {{"user", std::string(kNeedleTask) + prose + kNeedleQuestion}}, true);
  };
  const size_t fixed = tokenizer.encode(wrap(std::string(kNeedle) + "\n\n")).size();
  std::vector<size_t> lengths;
  size_t total = 0;
  for (const std::string& p : paras) {
    // +1: inside the prose the blank line before the next paragraph is two tokens ("\n",
    // "\n"), not the one it is when the paragraph is encoded alone.
    const size_t n = tokenizer.encode(p + "\n\n", false).size() + 1;
    if (fixed + total + n > target && !lengths.empty()) break;
    lengths.push_back(n);
    total += n;
  }
  // Insert before paragraph `at`: the boundary whose token offset is nearest depth.
  const long long want = std::llround(depth * double(total));
  size_t at = 0;
  long long best = -1;
  for (size_t i = 0, offset = 0; i <= lengths.size(); ++i) {
    const long long gap = std::llabs((long long)offset - want);
    if (best < 0 || gap < best) best = gap, at = i;
    if (i < lengths.size()) offset += lengths[i];
  }
  std::string prose;
  for (size_t i = 0; i <= lengths.size(); ++i) {
    if (i == at) prose += std::string(kNeedle) + "\n\n";
    if (i < lengths.size()) prose += paras[i] + "\n\n";
  }
  while (!prose.empty() && prose.back() == '\n') prose.pop_back();
  return {tokenizer.encode(wrap(prose)), context, depth};
}

}  // namespace

bool run_passkey(const Bench& bench, RetrievalResult* out, std::string* err) {
  Task task{"passkey", kPasskey, 8, {PrefillMode::Observe, PrefillMode::Stream},
            {0.10, 0.20, 0.50}, {}, {}};
  // Full mode: the 9 depths at 1K; fewer at 2K and 4K, where a run costs 2-5x
  // more, so the mode stays within an hour on two cores (--contexts/--depths for more).
  const std::vector<Grid> g = grid(
      bench,
      bench.full ? std::vector<Grid>{{1024, {0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9}},
                                     {2048, {0.1, 0.3, 0.5, 0.7, 0.9}},
                                     {4096, {0.1, 0.5, 0.9}}}
                 : std::vector<Grid>{{1024, {0.1, 0.5, 0.9}}},
      task.answer_tokens, "passkey");
  for (size_t c = 0; c < g.size(); ++c) {
    task.contexts.push_back(g[c].context);
    for (const double d : g[c].depths)
      task.prompts.push_back(passkey_prompt(*bench.tokenizer, g[c].context, d, c));
  }
  std::printf("== passkey retrieval: key %s in filler, ", kPasskey);
  print_grid(g);
  std::printf(" (%zu prompts, %zu..%zu tokens); sinks %u, window %u, page %u; budget = "
              "fraction of each prompt, per layer ==\n",
              task.prompts.size(), task.prompts.front().tokens.size(),
              task.prompts.back().tokens.size(), kSinks, kWindow, kPageTokens);
  std::fflush(stdout);
  return run_task(bench, task, out, err) && report(bench, "passkey", *out, err);
}

bool run_needle(const Bench& bench, RetrievalResult* out, std::string* err) {
  std::string text;
  if (!read_text(bench.text_path, &text, err)) return false;
  const std::vector<std::string> paras = paragraphs(text);
  // Quick mode: the 20% budget only (the goal's), to stay within five minutes.
  Task task{"needle", kNeedleAnswer, 16, {PrefillMode::Observe},
            bench.full ? std::vector<double>{0.10, 0.20, 0.50} : std::vector<double>{0.20},
            {}, {}};
  const std::vector<Grid> g = grid(
      bench,
      bench.full ? std::vector<Grid>{{1024, {0.1, 0.5, 0.9}}, {4096, {0.1, 0.5, 0.9}}}
                 : std::vector<Grid>{{1024, {0.1, 0.5, 0.9}}},
      task.answer_tokens, "needle");
  for (size_t c = 0; c < g.size(); ++c) {
    task.contexts.push_back(g[c].context);
    for (const double d : g[c].depths)
      task.prompts.push_back(needle_prompt(*bench.tokenizer, paras, g[c].context, d, c));
  }
  std::printf("== needle in prose: \"%s\" in the Jargon File excerpt, asked for in a chat "
              "prompt; ", kNeedle);
  print_grid(g);
  std::printf(" (%zu prompts, %zu..%zu tokens); correct when the greedy answer (up to %u "
              "tokens) contains \"%s\" ==\n",
              task.prompts.size(), task.prompts.front().tokens.size(),
              task.prompts.back().tokens.size(), task.answer_tokens, kNeedleAnswer);
  std::fflush(stdout);
  return run_task(bench, task, out, err) && report(bench, "needle", *out, err);
}

}  // namespace quality
