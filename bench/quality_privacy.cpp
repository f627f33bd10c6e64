// Score noise, its privacy measured (issue 12, item 6). Which tokens stay cached is what a
// timing side channel reveals (attention over fewer pages is faster, a page freed shows in
// the allocator). The attacker knows the prompt, picks one of its evictable tokens and
// guesses whether it was a heavy hitter, i.e. whether the noise-free policy keeps it at
// this budget, from whether it is cached. The attacker's advantage is TPR - FPR of that
// guess (0: no better than guessing from the base rate, 1: always right), per layer,
// averaged over layers and prompts; "cached => heavy hitter" is the natural attacker, so
// the figure is a lower bound on the best attacker's. Beside it, passkey accuracy at the
// same noise: the memory-versus-privacy curve.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <set>

#include "quality_common.hpp"
#include "quality_replay.hpp"
#include "quality_tasks.hpp"

namespace quality {
namespace {

bool live_positions(const engine::Engine& e, uint32_t layer, std::vector<int32_t>* pos,
                    std::string* err) {
  uint64_t n = 0;
  kvgc_heap* heap = e.heap();
  if (kvgc_read(heap, e.sequence(), layer, nullptr, nullptr, nullptr, 0, &n, nullptr) != KVGC_OK)
    return *err = std::string("kvgc_read: ") + kvgc_errmsg(heap), false;
  pos->resize(n);
  if (kvgc_read(heap, e.sequence(), layer, nullptr, nullptr, pos->data(), n, &n, nullptr) != KVGC_OK)
    return *err = std::string("kvgc_read: ") + kvgc_errmsg(heap), false;
  std::sort(pos->begin(), pos->end());
  return true;
}

}  // namespace

bool run_privacy(const Bench& bench, PrivacyResult* out, std::string* err) {
  const auto start = Clock::now();
  RetrievalTask task;
  if (!build_retrieval_task(bench, "passkey", &task, err)) return false;
  std::vector<Config> configs = retrieval_configs();
  if (!select_configs(bench.config_names, &configs, err)) return false;
  // The default policy, or the first --configs name.
  Config config = configs.empty() ? retrieval_configs().front() : configs.front();
  out->config = config.name;
  out->fraction = bench.fractions.empty() ? 0.20 : bench.fractions.front();
  const std::vector<double> noises = {0, 0.01, 0.03, 0.1, 0.3, 1, 3, 10};
  std::printf("== score noise vs a cache-timing attacker: %s at %.0f%% on the %zu passkey "
              "prompts; Laplace scale on ranking scores (opts.score_noise, KVGC_SCORE_NOISE) ==\n",
              config.name.c_str(), 100 * out->fraction, task.prompts.size());
  std::fflush(stdout);
  const size_t P = task.prompts.size(), N = noises.size();
  struct Run {
    double advantage = 0;
    bool ok = false;
  };
  std::vector<std::vector<Run>> runs(P, std::vector<Run>(N));
  const uint32_t layers = bench.kv.n_layers;
  const bool done = run_jobs(P, bench.jobs, [&](size_t i, std::string* e) {
    const Prompt& prompt = task.prompts[i];
    const uint64_t n = prompt.tokens.size();
    const uint64_t max_tokens = n + task.answer_tokens + 64;
    engine::Engine full;
    Snapshot snap;
    const kvgc_heap_options full_options = make_options(bench, full_config(), 1.0, n, max_tokens);
    if (!full.init(*bench.model, &full_options, e, engine_options(bench, full_config())) ||
        !take_snapshot(bench, &full, prompt.tokens, &snap, e))
      return false;
    std::vector<std::vector<int32_t>> heavy(layers);  // noise 0's kept set per layer
    for (size_t k = 0; k < N; ++k) {
      Config c = config;
      c.score_noise = noises[k];
      const kvgc_heap_options options = make_options(bench, c, out->fraction, n, max_tokens);
      engine::Engine engine;
      uint64_t offset = 0;
      if (!engine.init(*bench.model, &options, e, engine_options(bench, c)) ||
          !prefill_or_replay(bench, c, snap, prompt.tokens, &engine, &offset, e))
        return false;
      double adv_sum = 0;
      for (uint32_t l = 0; l < layers; ++l) {
        std::vector<int32_t> kept;
        if (!live_positions(engine, l, &kept, e)) return false;
        if (k == 0) heavy[l] = kept;
        // Evictable candidates: neither sinks nor the young window.
        const std::set<int32_t> hh(heavy[l].begin(), heavy[l].end());
        const std::set<int32_t> cached(kept.begin(), kept.end());
        size_t pos_n = 0, neg_n = 0, tp = 0, fp = 0;
        for (int32_t t = int32_t(c.sinks); t < int32_t(n) - int32_t(kWindow); ++t) {
          const bool y = hh.count(t) > 0, g = cached.count(t) > 0;
          (y ? pos_n : neg_n) += 1;
          if (g) (y ? tp : fp) += 1;
        }
        const double tpr = pos_n ? double(tp) / double(pos_n) : 0.0;
        const double fpr = neg_n ? double(fp) / double(neg_n) : 0.0;
        adv_sum += tpr - fpr;
      }
      runs[i][k].advantage = adv_sum / layers;
      std::string text;
      // Decoding goes on under the same noise (each decode step may collect).
      std::vector<float> logits = snap.logits;
      std::vector<int32_t> generated;
      const std::vector<int32_t> stops = stop_tokens(*bench.tokenizer);
      for (uint32_t t = 0; t < task.answer_tokens; ++t) {
        const int32_t token = argmax(logits.data(), bench.model->config.n_vocab);
        if (std::find(stops.begin(), stops.end(), token) != stops.end()) break;
        generated.push_back(token);
        text = bench.tokenizer->decode(generated);
        if (lower(text).find(prompt.expect) != std::string::npos) break;
        if (!engine.forward(&token, 1, logits.data(), e)) return false;
      }
      runs[i][k].ok = lower(text).find(prompt.expect) != std::string::npos;
      char buf[256];
      std::snprintf(buf, sizeof buf,
                    "\"task\":\"privacy\",\"id\":%s,\"config\":%s,\"fraction\":%.4f,"
                    "\"noise\":%g,\"advantage\":%.5f,\"correct\":%s",
                    json_string(prompt.id).c_str(), json_string(config.name).c_str(),
                    out->fraction, noises[k], runs[i][k].advantage,
                    runs[i][k].ok ? "true" : "false");
      results().write(buf);
      progress("  privacy %s noise %-5g: advantage %.3f %s", prompt.id.c_str(), noises[k],
               runs[i][k].advantage, runs[i][k].ok ? "ok" : "MISS");
    }
    return true;
  }, err);
  if (!done) return false;
  for (size_t k = 0; k < N; ++k) {
    PrivacyRow row;
    row.noise = noises[k];
    for (size_t i = 0; i < P; ++i) {
      row.advantage += runs[i][k].advantage / double(P);
      row.correct += runs[i][k].ok;
      row.total += 1;
    }
    row.accuracy = double(row.correct) / row.total;
    out->rows.push_back(row);
  }
  out->seconds = seconds_since(start);
  return true;
}

}  // namespace quality
