// Streaming perplexity part of kvgc-bench-quality: teacher-forced log-likelihood of real
// prose with the cache bounded to a few hundred tokens (StreamingLLM's setting), for each
// policy, with and without sinks, int4 demotion, and the three per-layer budget splits.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "quality_common.hpp"
#include "quality_replay.hpp"
#include "quality_tasks.hpp"

namespace quality {
namespace {

// Tokens per forward() call: every position's logits come back (Pass::all_logits) and
// kvgc_step runs after each piece, so between steps the cache can exceed its bound by at
// most this many tokens.
constexpr uint32_t kPiece = 16;
// Scored tokens per point of the perplexity-vs-position curves.
constexpr uint32_t kPplWindow = 256;
// Length of the prompt the entropy layer profile is measured on.
constexpr uint32_t kProfileTokens = 512;

// Per-layer attention entropy of `prompt` under the full cache, computed as kvgc-run
// --profile does (tools/engine/kvgc_run.cpp, write_profile): every query adds to the
// scores; a token's score over the number of queries that could see it, normalised, and
// the entropy of that distribution in nats. Also written to `path` in kvgc-run's format.
bool entropy_profile(const Bench& bench, const std::vector<int32_t>& prompt,
                     const std::string& path, std::vector<float>* weights, std::string* err) {
  const uint32_t layers = bench.model->config.n_layers;
  const kvgc_heap_options options =
      make_options(bench, full_config(), 1.0, prompt.size(), prompt.size() + 64);
  engine::Engine engine;
  if (!engine.init(*bench.model, &options, err) ||
      !engine.forward(prompt.data(), uint32_t(prompt.size()), nullptr, err)) {
    return false;
  }
  std::string file = "# kvgc layer-budget profile: attention entropy per layer (nats) over a\n"
                     "# " + std::to_string(prompt.size()) +
                     "-token prompt (kvgc-bench-quality); use with KVGC_LAYER_BUDGET=entropy:" +
                     std::filesystem::path(path).filename().string() + "\n";
  weights->clear();
  for (uint32_t l = 0; l < layers; ++l) {
    uint64_t n = 0;
    kvgc_heap* heap = engine.heap();
    bool ok = kvgc_read_scores(heap, engine.sequence(), l, nullptr, nullptr, 0, &n, nullptr) ==
              KVGC_OK;
    std::vector<float> scores(n);
    std::vector<int32_t> pos(n);
    ok = ok &&
         kvgc_read_scores(heap, engine.sequence(), l, scores.data(), nullptr, n, &n, nullptr) ==
             KVGC_OK &&
         kvgc_read(heap, engine.sequence(), l, nullptr, nullptr, pos.data(), n, &n, nullptr) ==
             KVGC_OK;
    if (!ok) {
      *err = std::string("kvgc: ") + kvgc_errmsg(heap);
      return false;
    }
    double total = 0;
    std::vector<double> p(n);
    for (uint64_t i = 0; i < n; ++i) {
      const double seen_by = double(prompt.size()) - double(pos[i]);
      p[i] = seen_by > 0 ? std::max(0.0, double(scores[i])) / seen_by : 0.0;
      total += p[i];
    }
    double h = 0;
    for (const double x : p)
      if (x > 0 && total > 0) h -= (x / total) * std::log(x / total);
    h = std::max(h, 1e-6);
    weights->push_back(float(h));
    char line[64];
    std::snprintf(line, sizeof line, "%.6f  # layer %u\n", h, l);
    file += line;
  }
  return write_text(path, file, err);
}

// Teacher-forced NLL of tokens[1..] in kPiece-token forward() calls.
bool perplexity_run(const Bench& bench, const kvgc_heap_options& options,
                    const std::vector<int32_t>& tokens, PerplexityRow* row, std::string* err) {
  const auto start = Clock::now();
  const uint32_t n_vocab = bench.model->config.n_vocab;
  engine::Engine engine;
  if (!engine.init(*bench.model, &options, err)) return false;
  std::vector<float> all_logits(size_t(kPiece) * n_vocab);
  engine::Engine::Pass pass;
  pass.step = true;
  pass.all_logits = all_logits.data();
  const size_t scored = tokens.size() - 1;
  std::vector<double> nll(scored);
  for (size_t i = 0; i < scored; i += kPiece) {
    const uint32_t n = uint32_t(std::min<size_t>(kPiece, scored - i));
    if (!engine.forward(&tokens[i], n, nullptr, err, pass)) return false;
    for (uint32_t j = 0; j < n; ++j) {
      nll[i + j] = -log_prob(&all_logits[size_t(j) * n_vocab], n_vocab, tokens[i + j + 1]);
    }
  }
  double sum = 0;
  for (const double x : nll) sum += x;
  row->perplexity = std::exp(sum / double(scored));
  row->window_ppl.clear();
  for (size_t w = 0; w < scored; w += kPplWindow) {
    const size_t end = std::min(scored, w + kPplWindow);
    double s = 0;
    for (size_t i = w; i < end; ++i) s += nll[i];
    row->window_ppl.push_back(std::exp(s / double(end - w)));
  }
  if (!kv_held(engine, bench.model->config.n_layers, engine.position(), &row->held, err)) {
    return false;
  }
  row->seconds = seconds_since(start);
  return true;
}

}  // namespace

bool run_perplexity(Bench* bench, PerplexityResult* out, std::string* err) {
  const auto start = Clock::now();
  std::string text;
  std::vector<int32_t> tokens;
  if (!read_text(bench->text_path, &text, err) || !stream_ppl_tokens(*bench, &tokens, err))
    return false;
  const std::vector<int32_t> all = bench->tokenizer->encode(text, false);
  const size_t want = tokens.size();
  // The profile's prompt: the text that follows the scored part (or its start if short).
  const size_t from = all.size() >= want + kProfileTokens ? want : 0;
  const std::vector<int32_t> profile_prompt(all.begin() + long(from),
                                            all.begin() + long(from + kProfileTokens));
  const std::string profile_path = bench->prefix + "-entropy-profile.txt";
  if (!entropy_profile(*bench, profile_prompt, profile_path, &bench->layer_weights, err)) {
    return false;
  }
  out->profile = bench->layer_weights;
  out->scored_tokens = tokens.size() - 1;
  out->window = kPplWindow;
  out->cache_tokens = {256, 512};

  const std::string name = std::filesystem::path(bench->text_path).filename().string();
  (void)want;
  std::printf("== streaming perplexity: %zu scored tokens of %s, %u tokens per forward() "
              "call (all positions' logits; kvgc_step after each call, so the cache may "
              "exceed its bound by up to %u tokens between steps), cache bounded to",
              out->scored_tokens, name.c_str(), kPiece, kPiece);
  for (const uint64_t c : out->cache_tokens) std::printf(" %llu", (unsigned long long)c);
  std::printf(" tokens per layer ==\n");
  std::printf("entropy profile (tokens %zu..%zu of the same text, full cache): %s\n  ", from,
              from + kProfileTokens, profile_path.c_str());
  for (const float w : out->profile) std::printf(" %.2f", w);
  std::printf("\n");
  std::fflush(stdout);

  std::vector<Config> configs = perplexity_configs();
  if (!select_configs(bench->config_names, &configs, err)) return false;
  out->bounded.assign(out->cache_tokens.size(), std::vector<PerplexityRow>(configs.size()));
  const size_t n_jobs = 1 + out->cache_tokens.size() * configs.size();
  const bool done = run_jobs(n_jobs, bench->jobs, [&](size_t i, std::string* e) {
    const bool is_full = i == 0;
    const size_t b = is_full ? 0 : (i - 1) / configs.size();
    const Config config = is_full ? full_config() : configs[(i - 1) % configs.size()];
    PerplexityRow* row = is_full ? &out->full : &out->bounded[b][(i - 1) % configs.size()];
    row->name = config.name;
    const kvgc_heap_options options =
        make_options_tokens(*bench, config, out->cache_tokens[b], tokens.size() + 64);
    if (!perplexity_run(*bench, options, tokens, row, e)) return false;
    char buf[256];
    std::snprintf(buf, sizeof buf,
                  "\"task\":\"ppl-stream\",\"id\":\"ppl-stream/%zu\",\"config\":%s,"
                  "\"budget\":\"%s\",\"fraction\":%.5f,\"cache_tokens\":%llu,\"perplexity\":%.5f,"
                  "\"nll_sum\":%.6f,\"scored\":%zu,\"kv_fraction\":%.5f",
                  tokens.size() - 1, json_string(config.name).c_str(),
                  is_full ? "none" : config.budget == Budget::Bytes ? "bytes" : "tokens",
                  is_full ? 1.0 : double(out->cache_tokens[b]) / double(tokens.size() - 1),
                  is_full ? 0ull : (unsigned long long)out->cache_tokens[b], row->perplexity,
                  std::log(row->perplexity) * double(tokens.size() - 1), tokens.size() - 1,
                  row->held.fraction());
    results().write(buf);
    progress("  perplexity %-22s cache %4s: %8.3f  live %5.0f  (%.0f s)", config.name.c_str(),
             is_full ? "-" : std::to_string(out->cache_tokens[b]).c_str(), row->perplexity,
             row->held.live_tokens, row->seconds);
    return true;
  }, err);
  if (!done) return false;

  const double base = out->full.perplexity;
  for (size_t b = 0; b < out->cache_tokens.size(); ++b) {
    std::printf("\ncache bounded to %llu tokens per layer (full cache: all %zu):\n",
                (unsigned long long)out->cache_tokens[b], tokens.size() - 1);
    std::printf("%-22s  %10s  %8s  %11s  %20s\n", "policy", "perplexity", "vs full",
                "live tokens", "KV held (/ f16 full)");
    std::vector<const PerplexityRow*> rows = {&out->full};
    for (const PerplexityRow& r : out->bounded[b]) rows.push_back(&r);
    for (const PerplexityRow* r : rows) {
      std::printf("%-22s  %10.3f  %7.3fx  %11.0f  %6.2f MiB %3.0f%%\n", r->name.c_str(),
                  r->perplexity, r->perplexity / base, r->held.live_tokens,
                  double(r->held.bytes) / (1024.0 * 1024.0), 100.0 * r->held.fraction());
    }
    // gnuplot data: scored position (window end), then each row's window perplexity.
    std::string data = "position";
    for (const PerplexityRow* r : rows) data.append(" ").append(column_name(r->name));
    data += "\n";
    for (size_t w = 0; w < out->full.window_ppl.size(); ++w) {
      char buf[32];
      std::snprintf(buf, sizeof buf, "%zu",
                    std::min<size_t>((w + 1) * kPplWindow, out->scored_tokens));
      data += buf;
      for (const PerplexityRow* r : rows) {
        std::snprintf(buf, sizeof buf, " %.4f", r->window_ppl[w]);
        data += buf;
      }
      data += "\n";
    }
    if (!write_text(bench->prefix + "-ppl-" + std::to_string(out->cache_tokens[b]) + ".dat",
                    data, err)) {
      return false;
    }
  }
  out->seconds = seconds_since(start);
  std::printf("(%.0f s)\n\n", out->seconds);
  return true;
}

}  // namespace quality

namespace quality {
namespace {

// NLL of tokens[score_from..] fed teacher-forced after the cache holds tokens[0, prefix):
// one forward of the continuation, no kvgc_step (the cache grows, as a press's does).
bool continuation_nll(const Bench& bench, engine::Engine* engine, const PplPrompt& p,
                      double* nll, size_t* scored, std::string* err) {
  const uint32_t n_vocab = bench.model->config.n_vocab;
  const uint32_t n = uint32_t(p.tokens.size()) - p.prefix - 1;
  std::vector<float> all_logits(size_t(n) * n_vocab);
  engine::Engine::Pass pass;
  pass.step = false;
  pass.all_logits = all_logits.data();
  if (!engine->forward(&p.tokens[p.prefix], n, nullptr, err, pass)) return false;
  *nll = 0;
  for (uint32_t j = 0; j < n; ++j)
    *nll -= log_prob(&all_logits[size_t(j) * n_vocab], n_vocab, p.tokens[p.prefix + j + 1]);
  *scored = n;
  return true;
}

}  // namespace

bool run_prefix_perplexity(const Bench& bench, PrefixPplResult* out, std::string* err) {
  const auto start = Clock::now();
  std::vector<PplPrompt> prompts;
  if (!build_prefix_ppl(bench, &prompts, err)) return false;
  std::vector<Config> configs = retrieval_configs();
  if (!select_configs(bench.config_names, &configs, err)) return false;
  out->fractions = bench.fractions.empty() ? std::vector<double>{0.10, 0.20, 0.50} : bench.fractions;
  const size_t C = configs.size(), F = out->fractions.size();
  out->policies = {"full"};
  out->budget_kinds = {"none"};
  for (const Config& c : configs) {
    out->policies.push_back(c.name);
    out->budget_kinds.push_back(c.budget == Budget::Bytes ? "bytes" : "tokens");
  }
  std::printf("== prefix perplexity (the anchors' protocol): %zu prefixes of %s (", prompts.size(),
              std::filesystem::path(bench.text_path).filename().c_str());
  for (size_t i = 0; i < prompts.size(); ++i)
    std::printf("%s%s", i ? ", " : "", prompts[i].id.c_str());
  std::printf("), each compressed by one observe prefill to the budget, then its next %zu "
              "tokens teacher-forced (no further eviction) ==\n",
              prompts.front().tokens.size() - prompts.front().prefix);
  std::fflush(stdout);
  // [prompt][config + 1][fraction]
  struct Run {
    double nll = 0, kv = 0;
    size_t scored = 0;
  };
  std::vector<std::vector<std::vector<Run>>> runs(
      prompts.size(), std::vector<std::vector<Run>>(C + 1, std::vector<Run>(F)));
  const bool done = run_jobs(prompts.size(), bench.jobs, [&](size_t i, std::string* e) {
    const PplPrompt& p = prompts[i];
    const std::vector<int32_t> prefix(p.tokens.begin(), p.tokens.begin() + p.prefix);
    const uint64_t max_tokens = p.tokens.size() + 64;
    const kvgc_heap_options full_options =
        make_options(bench, full_config(), 1.0, p.prefix, max_tokens);
    engine::Engine full;
    Snapshot snap;
    KvHeld held;
    const auto t0 = Clock::now();
    if (!full.init(*bench.model, &full_options, e, engine_options(bench, full_config())) ||
        !take_snapshot(bench, &full, prefix, &snap, e) ||
        !kv_held(full, bench.kv.n_layers, p.prefix, &held, e))
      return false;
    auto write = [&](const Config& c, double fraction, const Run& r) {
      char buf[320];
      std::snprintf(buf, sizeof buf,
                    "\"task\":\"ppl-prefix\",\"id\":%s,\"context\":%u,\"mode\":\"observe\","
                    "\"config\":%s,\"budget\":\"%s\",\"fraction\":%.4f,\"nll_sum\":%.6f,"
                    "\"scored\":%zu,\"perplexity\":%.5f,\"kv_fraction\":%.5f",
                    json_string(p.id).c_str(), p.prefix, json_string(c.name).c_str(),
                    c.policy == KVGC_POLICY_FULL ? "none"
                    : c.budget == Budget::Bytes  ? "bytes"
                                                 : "tokens",
                    fraction, r.nll, r.scored, std::exp(r.nll / double(r.scored)), r.kv);
      results().write(buf);
    };
    for (size_t c = 0; c < C; ++c) {
      for (size_t f = 0; f < F; ++f) {
        const kvgc_heap_options options =
            make_options(bench, configs[c], out->fractions[f], p.prefix, max_tokens);
        engine::Engine engine;
        uint64_t offset = 0;
        KvHeld h;
        Run& r = runs[i][c + 1][f];
        if (!engine.init(*bench.model, &options, e, engine_options(bench, configs[c])) ||
            !prefill_or_replay(bench, configs[c], snap, prefix, &engine, &offset, e) ||
            !kv_held(engine, bench.kv.n_layers, p.prefix, &h, e) ||
            !continuation_nll(bench, &engine, p, &r.nll, &r.scored, e))
          return false;
        r.kv = h.fraction();
        write(configs[c], out->fractions[f], r);
        progress("  ppl-prefix %-24s %3.0f%% %s: %8.3f kv %5.1f%%", configs[c].name.c_str(),
                 100 * out->fractions[f], p.id.c_str(), std::exp(r.nll / double(r.scored)),
                 100 * r.kv);
      }
    }
    Run& r = runs[i][0][0];
    if (!continuation_nll(bench, &full, p, &r.nll, &r.scored, e)) return false;
    r.kv = held.fraction();
    for (size_t f = 1; f < F; ++f) runs[i][0][f] = r;
    write(full_config(), 1.0, r);
    progress("  ppl-prefix full %s: %8.3f (%.1f s)", p.id.c_str(),
             std::exp(r.nll / double(r.scored)), seconds_since(t0));
    return true;
  }, err);
  if (!done) return false;
  out->perplexity.assign(C + 1, std::vector<double>(F));
  out->kv_fraction.assign(C + 1, std::vector<double>(F));
  out->prefixes = prompts.size();
  for (size_t c = 0; c <= C; ++c) {
    for (size_t f = 0; f < F; ++f) {
      double nll = 0, kv = 0;
      size_t scored = 0;
      for (size_t i = 0; i < prompts.size(); ++i) {
        nll += runs[i][c][f].nll;
        scored += runs[i][c][f].scored;
        kv += runs[i][c][f].kv;
      }
      out->perplexity[c][f] = std::exp(nll / double(scored));
      out->kv_fraction[c][f] = kv / double(prompts.size());
      out->scored_tokens = scored;
    }
  }
  out->seconds = seconds_since(start);
  return true;
}

}  // namespace quality
