// Retrieval parts of kvgc-bench-quality: each prompt is prefilled once in observe mode
// (quality_replay.hpp) and replayed into every configuration's heap at every budget, then
// answered greedily; stream-prefill rows (passkey only, unless --observe-only) prefill per
// configuration, since their eviction starts with the first chunk.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "quality_common.hpp"
#include "quality_replay.hpp"
#include "quality_tasks.hpp"

namespace quality {
namespace {

using PrefillMode = engine::Engine::PrefillMode;

struct Outcome {
  bool ok = false;
  double kv_fraction = 0;  // after the prefill's eviction, vs the prompt's f16 payload
  std::string text;
};

// Greedy answer from the prefill's last logits: stops at an end-of-turn token, at
// answer_tokens, or as soon as the answer holds the prompt's key (a correct answer stays
// correct with more tokens: containment).
bool decode(const Bench& bench, engine::Engine* engine, const std::vector<float>& first,
            uint32_t answer_tokens, const Prompt& prompt, std::string* text,
            std::string* err) {
  const uint32_t n_vocab = bench.model->config.n_vocab;
  const std::vector<int32_t> stops = stop_tokens(*bench.tokenizer);
  std::vector<float> logits = first;
  std::vector<int32_t> generated;
  text->clear();
  for (uint32_t i = 0; i < answer_tokens; ++i) {
    const int32_t token = argmax(logits.data(), n_vocab);
    if (std::find(stops.begin(), stops.end(), token) != stops.end()) break;
    generated.push_back(token);
    *text = bench.tokenizer->decode(generated);
    if (answer_has_key(*text, prompt)) break;
    if (i + 1 < answer_tokens && !engine->forward(&token, 1, logits.data(), err)) return false;
  }
  return true;
}

void record(const RetrievalTask& task, const Prompt& p, const char* mode, const Config& c,
            double fraction, const Outcome& o) {
  char buf[256];
  std::snprintf(buf, sizeof buf,
                "\"task\":%s,\"id\":%s,\"context\":%u,\"depth\":%.2f,\"mode\":\"%s\","
                "\"config\":%s,\"budget\":\"%s\",\"fraction\":%.4f,",
                json_string(task.name).c_str(), json_string(p.id).c_str(),
                task.contexts[p.context], p.depth, mode, json_string(c.name).c_str(),
                c.policy == KVGC_POLICY_FULL ? "none"
                : c.budget == Budget::Bytes  ? "bytes"
                                             : "tokens",
                fraction);
  char tail[96];
  std::snprintf(tail, sizeof tail, "\"correct\":%s,\"kv_fraction\":%.5f,\"answer\":",
                o.ok ? "true" : "false", o.kv_fraction);
  results().write(std::string(buf) + tail + json_string(o.text));
}

std::string one_line(std::string s) {
  for (char& c : s) c = c == '\n' ? ' ' : c;
  return s;
}

}  // namespace

bool run_retrieval(const Bench& bench, const std::string& name, RetrievalResult* out,
                   std::string* err) {
  const auto start = Clock::now();
  RetrievalTask task;
  if (!build_retrieval_task(bench, name, &task, err)) return false;
  std::vector<Config> configs = retrieval_configs();
  if (!select_configs(bench.config_names, &configs, err)) return false;
  const std::vector<double> fractions =
      bench.fractions.empty() ? std::vector<double>{0.10, 0.20, 0.50} : bench.fractions;
  std::vector<PrefillMode> modes = {PrefillMode::Observe};
  if (task.stream_rows && !bench.observe_only) modes.push_back(PrefillMode::Stream);

  std::printf("== %s: %s; ", name.c_str(), task.description.c_str());
  for (size_t c = 0; c < task.contexts.size(); ++c) {
    size_t n = 0, lo = SIZE_MAX, hi = 0;
    for (const Prompt& p : task.prompts)
      if (p.context == c) ++n, lo = std::min(lo, p.tokens.size()), hi = std::max(hi, p.tokens.size());
    std::printf("%s~%u tokens: %zu prompts (%zu..%zu)", c ? ", " : "", task.contexts[c], n, lo, hi);
  }
  std::printf("; answer: up to %u greedy tokens, correct when it contains the key; sinks %u, "
              "window %u, page %u ==\n", task.answer_tokens, kSinks, kWindow, kPageTokens);
  std::fflush(stdout);

  out->task = name;
  out->fractions = fractions;
  out->contexts = task.contexts;
  out->modes.clear();
  for (const PrefillMode m : modes) out->modes.push_back(m == PrefillMode::Observe ? "observe" : "stream");
  out->policies = {"full"};
  out->budget_kinds = {"none"};
  for (const Config& c : configs) {
    out->policies.push_back(c.name);
    out->budget_kinds.push_back(c.budget == Budget::Bytes ? "bytes" : "tokens");
  }
  const size_t P = task.prompts.size(), C = configs.size(), F = fractions.size();
  // outcomes[prompt][mode][config + 1][fraction]; config 0 = full (fraction 0 only).
  std::vector<std::vector<std::vector<std::vector<Outcome>>>> outcomes(
      P, std::vector<std::vector<std::vector<Outcome>>>(
             modes.size(), std::vector<std::vector<Outcome>>(C + 1, std::vector<Outcome>(F))));

  // Jobs: one per prompt (its shared observe prefill, every replay, the full row), then
  // one per (prompt, config, fraction) in stream mode. Longest prompts first.
  struct Job {
    size_t prompt;
    bool stream;
    size_t config, fraction;
  };
  std::vector<Job> jobs;
  for (size_t p = 0; p < P; ++p) {
    jobs.push_back({p, false, 0, 0});
    if (modes.size() > 1)
      for (size_t c = 0; c < C; ++c)
        for (size_t f = 0; f < F; ++f) jobs.push_back({p, true, c, f});
  }
  std::stable_sort(jobs.begin(), jobs.end(), [&](const Job& a, const Job& b) {
    return task.prompts[a.prompt].tokens.size() > task.prompts[b.prompt].tokens.size();
  });
  std::atomic<size_t> checked{0}, mismatched{0}, answers_differ{0};
  const uint32_t layers = bench.kv.n_layers;

  const bool done = run_jobs(jobs.size(), bench.jobs, [&](size_t i, std::string* e) {
    const Job& job = jobs[i];
    const Prompt& prompt = task.prompts[job.prompt];
    const uint64_t n = prompt.tokens.size();
    const uint64_t max_tokens = n + task.answer_tokens + 64;
    const auto t0 = Clock::now();
    if (job.stream) {
      const Config& config = configs[job.config];
      const double fraction = fractions[job.fraction];
      const kvgc_heap_options options = make_options(bench, config, fraction, n, max_tokens);
      engine::Engine engine;
      std::vector<float> logits(bench.model->config.n_vocab);
      KvHeld held;
      Outcome& o = outcomes[job.prompt][1][job.config + 1][job.fraction];
      if (!engine.init(*bench.model, &options, e, engine_options(bench, config)) ||
          !engine.prefill(prompt.tokens.data(), uint32_t(n), logits.data(), e,
                          PrefillMode::Stream) ||
          !kv_held(engine, layers, n, &held, e) ||
          !decode(bench, &engine, logits, task.answer_tokens, prompt, &o.text, e))
        return false;
      o.ok = answer_has_key(o.text, prompt);
      o.kv_fraction = held.fraction();
      record(task, prompt, "stream", config, fraction, o);
      progress("  %s stream %-24s %3.0f%% %s: %s kv %5.1f%% (%.1f s) \"%s\"", name.c_str(),
               config.name.c_str(), 100 * fraction, prompt.id.c_str(), o.ok ? "ok  " : "MISS",
               100 * o.kv_fraction, seconds_since(t0), one_line(o.text).c_str());
      return true;
    }
    // The shared observe prefill: of the whole prompt, or of its context when the question
    // comes after it (the budget is then the context's share, as a press's ratio is).
    const std::vector<int32_t> context(prompt.tokens.begin(),
                                       prompt.tokens.begin() + (prompt.question_at
                                                                    ? prompt.question_at
                                                                    : n));
    const std::vector<int32_t> question(prompt.tokens.begin() + context.size(),
                                        prompt.tokens.end());
    const uint64_t compressed = context.size();
    const kvgc_heap_options full_options =
        make_options(bench, full_config(), 1.0, compressed, max_tokens);
    engine::Engine full;
    Snapshot snap;
    KvHeld held;
    if (!full.init(*bench.model, &full_options, e, engine_options(bench, full_config())) ||
        !take_snapshot(bench, &full, context, &snap, e) ||
        !kv_held(full, layers, compressed, &held, e))
      return false;
    // An engine's greedy answer, from the prompt's own last logits (`own`), or from the
    // question's, read after the context was compressed (no GC until the answer's first
    // step).
    std::vector<float> asked(question.empty() ? 0 : bench.model->config.n_vocab);
    auto answer = [&](engine::Engine* eng, const std::vector<float>& own, std::string* text,
                      std::string* e2) {
      if (!question.empty()) {
        engine::Engine::Pass pass;
        pass.step = false;
        if (!eng->forward(question.data(), uint32_t(question.size()), asked.data(), e2, pass))
          return false;
      }
      return decode(bench, eng, question.empty() ? own : asked, task.answer_tokens, prompt,
                    text, e2);
    };
    const double prefill_s = seconds_since(t0);
    for (size_t c = 0; c < C; ++c) {
      const Config& config = configs[c];
      for (size_t f = 0; f < F; ++f) {
        const auto t1 = Clock::now();
        const double fraction = fractions[f];
        const kvgc_heap_options options =
            make_options(bench, config, fraction, compressed, max_tokens);
        auto engine = std::make_unique<engine::Engine>();
        uint64_t offset = 0;
        KvHeld h;
        Outcome& o = outcomes[job.prompt][0][c + 1][f];
        if (!engine->init(*bench.model, &options, e, engine_options(bench, config)) ||
            !prefill_or_replay(bench, config, snap, context, engine.get(), &offset, e) ||
            !kv_held(*engine, layers, compressed, &h, e))
          return false;
        std::string fresh_text;
        if (bench.check_replay) {
          // The same configuration prefilled afresh: same cache (compared before either
          // answers), same answer.
          engine::Engine fresh;
          std::vector<float> logits(bench.model->config.n_vocab);
          bool same = false;
          std::string what;
          if (!fresh.init(*bench.model, &options, e, engine_options(bench, config)) ||
              !fresh.prefill(context.data(), uint32_t(compressed), logits.data(), e,
                             PrefillMode::Observe) ||
              !compare_replay(bench, *engine, offset, fresh,
                              config.demote != KVGC_DEMOTE_OFF || config.library_defaults,
                              &same, &what, e) ||
              !answer(&fresh, logits, &fresh_text, e))
            return false;
          ++checked;
          if (!same) {
            ++mismatched;
            progress("  REPLAY MISMATCH %s %s %.0f%%: %s", prompt.id.c_str(),
                     config.name.c_str(), 100 * fraction, what.c_str());
          }
        }
        if (!answer(engine.get(), snap.logits, &o.text, e)) return false;
        if (bench.check_replay && o.text != fresh_text) {
          ++answers_differ;
          progress("  REPLAY ANSWER DIFFERS %s %s %.0f%%: \"%s\" vs fresh \"%s\"",
                   prompt.id.c_str(), config.name.c_str(), 100 * fraction,
                   one_line(o.text).c_str(), one_line(fresh_text).c_str());
        }
        o.ok = answer_has_key(o.text, prompt);
        o.kv_fraction = h.fraction();
        record(task, prompt, "observe", config, fraction, o);
        progress("  %s observe %-24s %3.0f%% %s: %s kv %5.1f%% (%.2f s) \"%s\"", name.c_str(),
                 config.name.c_str(), 100 * fraction, prompt.id.c_str(),
                 o.ok ? "ok  " : "MISS", 100 * o.kv_fraction, seconds_since(t1),
                 one_line(o.text).c_str());
      }
    }
    // The full row, from the prefill engine itself.
    Outcome& o = outcomes[job.prompt][0][0][0];
    if (!answer(&full, snap.logits, &o.text, e)) return false;
    o.ok = answer_has_key(o.text, prompt);
    o.kv_fraction = held.fraction();
    record(task, prompt, "observe", full_config(), 1.0, o);
    progress("  %s full %s: %s kv %5.1f%% (prefill %.1f s, all %.1f s) \"%s\"", name.c_str(),
             prompt.id.c_str(), o.ok ? "ok  " : "MISS", 100 * o.kv_fraction, prefill_s,
             seconds_since(t0), one_line(o.text).c_str());
    return true;
  }, err);
  if (!done) return false;

  const CellTable empty(modes.size(), std::vector<std::vector<Cell>>(C + 1, std::vector<Cell>(F)));
  out->cells = empty;
  out->by_context.assign(task.contexts.size(), empty);
  out->cell_names = task.cells;
  out->by_cell.assign(task.cells.size(), std::vector<CellTable>(task.contexts.size(), empty));
  for (size_t p = 0; p < P; ++p) {
    const Prompt& prompt = task.prompts[p];
    const bool full_ok = outcomes[p][0][0][0].ok;
    std::vector<CellTable*> tables = {&out->cells, &out->by_context[prompt.context]};
    if (!task.cells.empty()) tables.push_back(&out->by_cell[prompt.cell][prompt.context]);
    for (size_t m = 0; m < modes.size(); ++m) {
      for (size_t c = 0; c <= C; ++c) {
        for (size_t f = 0; f < F; ++f) {
          // The full cache never evicts: its one run is every column's and mode's baseline.
          const Outcome& o = c == 0 ? outcomes[p][0][0][0] : outcomes[p][m][c][f];
          for (CellTable* t : tables) {
            Cell& cell = (*t)[m][c][f];
            cell.correct += o.ok;
            cell.kept += o.ok && full_ok;
            cell.total += 1;
            cell.kv_fraction_sum += o.kv_fraction;
          }
        }
      }
    }
  }
  out->replays_checked = checked;
  out->replay_mismatches = mismatched;
  out->answer_mismatches = answers_differ;
  out->seconds = seconds_since(start);
  return true;
}

}  // namespace quality
