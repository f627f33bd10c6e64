// The batched forward (tools/engine/batch_forward.hpp) against the single-sequence one, on
// the real model: three sequences at different positions run in mixed steps (one brings
// prompt chunks while another decodes) must get the logits each gets alone, bit for bit.
// Exact because every kernel on the way is row-independent: the Q4_1/Q8_0 tiles keep one
// accumulator per (weight row, activation row) and sum the blocks in the same order
// whatever the batch, the activations are quantised per row, and kvgc's batch calls
// compute what its per-sequence calls compute (bit for bit with one attention thread).
// Under a token budget, so the GC evicts during the run and its decisions must match too.
// One sequence enters SnapKV-style (observe items: its chunks in the plan through
// kvgc_batch_plan_ex, unscored but the last 32 tokens, its GC deferred; pooled scores and
// one step at the prompt's end), as Engine::prefill's default does alone, bit for bit.
// Then the plan's all-or-nothing refusal: an arena too small for the batch gives NoRoom
// naming the first sequence that does not fit, and changes nothing. Then the server:
// preemption and recomputation, admission against the heap's own room (a projection that
// undercounts does not make it admit and preempt the same head step after step), and the
// prefix cache.
//
// Needs the downloaded model (tools/fetch-model.sh): skipped (77) without it, unless
// KVGC_REQUIRE_MODEL=1 (CI) makes a missing model a failure.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "engine/batch_forward.hpp"
#include "engine/forward.hpp"
#include "engine/model.hpp"
#include "engine/serve.hpp"
#include "engine/tokenizer.hpp"
#include "gguf.hpp"
#include "model_missing.hpp"

namespace {

int g_failures = 0;

void check(bool ok, const std::string& what) {
  std::printf("%s  %s\n", ok ? "ok  " : "FAIL", what.c_str());
  if (!ok) ++g_failures;
}

kvgc_heap_options heap_options(uint64_t arena_bytes) {
  kvgc_heap_options o;
  kvgc_heap_options_init(&o);
  o.flags = KVGC_OPT_IGNORE_ENV;
  o.device = KVGC_DEVICE_CPU;
  o.budget_bytes = arena_bytes;
  o.policy = KVGC_POLICY_GENERATIONAL;
  o.token_budget = 48;  // the 70- and 150-token prompts are evicted while they run
  o.min_length = 0;     // (short sequences: budgets from the first token)
  o.cpu_threads = 1;
  return o;
}

// A sequence's script: its prompt in engine-sized chunks, then `decode` greedy tokens.
struct Script {
  std::vector<int32_t> prompt;
  uint32_t decode = 3;
  uint32_t start_step = 0;  // the batch step it joins at
  bool observe = false;     // SnapKV-style prefill (Engine::PrefillMode::Observe)
};

// What one sequence computes alone: the logits after its prompt and after each decode
// token (each chunk stepped, every query scoring, as the batch runs it).
std::vector<std::vector<float>> run_alone(const engine::Model& model, const Script& s,
                                          std::string* err) {
  std::vector<std::vector<float>> out;
  engine::Engine eng;
  engine::EngineOptions eo;
  eo.threads = 1;
  const kvgc_heap_options o = heap_options(64ull << 20);
  if (!eng.init(model, &o, err, eo)) return out;
  const uint32_t n_vocab = model.config.n_vocab;
  std::vector<float> logits(n_vocab);
  if (s.observe && !eng.prefill(s.prompt.data(), uint32_t(s.prompt.size()), logits.data(), err,
                                engine::Engine::PrefillMode::Observe))
    return {};
  for (size_t done = s.observe ? s.prompt.size() : 0; done < s.prompt.size();) {
    const uint32_t n = std::min<uint32_t>(engine::Engine::kChunkTokens,
                                          uint32_t(s.prompt.size() - done));
    const bool last = done + n == s.prompt.size();
    if (!eng.forward(s.prompt.data() + done, n, last ? logits.data() : nullptr, err))
      return {};
    done += n;
  }
  out.push_back(logits);
  for (uint32_t i = 0; i < s.decode; ++i) {
    const int32_t next = engine::argmax(logits.data(), n_vocab);
    if (!eng.forward(&next, 1, logits.data(), err)) return {};
    out.push_back(logits);
  }
  return out;
}

// Serves every request to the end (at most 2000 steps) and returns the server's counts.
bool serve_all(engine::BatchEngine* eng, const engine::ServeOptions& so,
               std::vector<engine::ServeRequest>* reqs, engine::ServeStats* stats, std::string* err) {
  engine::Server server(eng, so);
  for (engine::ServeRequest& r : *reqs)
    if (!server.submit(&r, err)) return false;
  for (int steps = 0; !server.idle(); ++steps)
    if (steps > 2000 || !server.step(0.0, err)) return false;
  *stats = server.stats();
  return true;
}

}  // namespace

int main() {
  const std::string path = engine::default_model_path();
  if (const int missing = model_missing(path, "the batched-engine test")) return missing;
  std::string err;
  gguf::File file;
  engine::Model model;
  engine::Tokenizer tok;
  if (!file.open(path, &err) || !engine::load_model(file, &model, &err) || !tok.load(file, &err)) {
    std::printf("FAIL  loading %s: %s\n", path.c_str(), err.c_str());
    return 1;
  }
  const uint32_t n_vocab = model.config.n_vocab;
  const std::string text =
      "The lighthouse stood at the end of the long stone pier, and every night its keeper "
      "climbed the spiral stairs to light the great lamp. Ships far out at sea watched for "
      "its beam, and sailors told stories of the keeper who never missed a night in forty "
      "years of storms, fog and calm. One winter a young apprentice came to learn the trade, "
      "and the old keeper taught him how to trim the wick, polish the lens and read the "
      "weather in the colour of the evening sky. In spring the apprentice rowed out to the "
      "rocks beyond the harbour to count the seals, and in summer he painted the tower white "
      "again, one band at a time, while the keeper sat below and mended the nets of the "
      "fishermen who brought them bread, salt and the news from the town across the bay.";
  const std::vector<int32_t> all = tok.encode(text);
  std::vector<Script> scripts(4);
  scripts[0].prompt.assign(all.begin(), all.begin() + std::min<size_t>(all.size(), 150));
  scripts[1].prompt.assign(all.begin() + 3, all.begin() + 8);  // 5 tokens: decodes early
  scripts[1].decode = 5;
  scripts[2].prompt.assign(all.begin() + 10, all.begin() + 80);
  scripts[2].start_step = 1;  // joins while the others run
  scripts[3].prompt.assign(all.begin() + 20, all.begin() + 120);
  scripts[3].observe = true;  // its chunks in the plan, unscored but the last 32, unstepped
  scripts[3].start_step = 1;
  check(scripts[0].prompt.size() > 128, "the long prompt spans three chunks");

  std::vector<std::vector<std::vector<float>>> alone;
  for (const Script& s : scripts) {
    alone.push_back(run_alone(model, s, &err));
    if (alone.back().empty()) {
      std::printf("FAIL  single-sequence engine: %s\n", err.c_str());
      return 1;
    }
  }

  // The same sequences in one batch: each step every active sequence brings its next
  // prompt chunk or its next decode token.
  {
    engine::BatchEngine batch;
    engine::EngineOptions eo;
    eo.threads = 1;
    const kvgc_heap_options o = heap_options(64ull << 20);
    if (!batch.init(model, &o, &err, eo)) {
      std::printf("FAIL  BatchEngine::init: %s\n", err.c_str());
      return 1;
    }
    struct State {
      kvgc_seq seq = 0;
      size_t done = 0;  // prompt tokens run
      uint32_t decoded = 0;
      int32_t next = 0;
      std::vector<std::vector<float>> logits;
    };
    std::vector<State> st(scripts.size());
    std::vector<std::vector<float>> buffers(scripts.size(), std::vector<float>(n_vocab));
    bool mixed = false;  // a step held a prompt chunk and a decode row
    bool ok = true;
    for (uint32_t step = 0; ok && step < 64; ++step) {
      std::vector<engine::BatchItem> items;
      std::vector<size_t> who;
      bool chunk = false, decode = false;
      for (size_t i = 0; i < scripts.size(); ++i) {
        const Script& s = scripts[i];
        State& x = st[i];
        if (step < s.start_step || x.decoded == s.decode) continue;
        if (x.seq == 0 && kvgc_seq_create(batch.heap(), 0, &x.seq) != KVGC_OK) ok = false;
        engine::BatchItem item;
        item.seq = x.seq;
        if (x.done < s.prompt.size()) {
          item.n = std::min<uint32_t>(engine::Engine::kChunkTokens,
                                      uint32_t(s.prompt.size() - x.done));
          item.tokens = s.prompt.data() + x.done;
          item.position = x.done;
          if (s.observe) {  // split where the observation window starts, as Engine::prefill
            const size_t from = s.prompt.size() - engine::Engine::kObserveTokens;
            if (x.done < from) item.n = uint32_t(std::min<size_t>(item.n, from - x.done));
            item.observe = true;
            item.scores = x.done >= from;
          }
          item.logits = x.done + item.n == s.prompt.size() ? buffers[i].data() : nullptr;
          chunk = true;
        } else {
          item.n = 1;
          item.tokens = &x.next;
          item.position = s.prompt.size() + x.decoded;
          item.logits = buffers[i].data();
          decode = true;
        }
        items.push_back(item);
        who.push_back(i);
      }
      if (items.empty()) break;
      mixed |= chunk && decode;
      uint32_t failed = 0;
      if (batch.step(items, &failed, &err) != engine::BatchEngine::Outcome::Ok) {
        std::printf("FAIL  batch step %u: %s\n", step, err.c_str());
        return 1;
      }
      for (size_t j = 0; j < items.size(); ++j) {
        State& x = st[who[j]];
        if (x.done < scripts[who[j]].prompt.size()) {
          x.done += items[j].n;
          if (items[j].observe && x.done == scripts[who[j]].prompt.size() &&
              !batch.end_observe(x.seq, &err)) {
            std::printf("FAIL  end_observe: %s\n", err.c_str());
            return 1;
          }
        } else {
          ++x.decoded;
        }
        if (items[j].logits != nullptr) {
          x.logits.push_back(buffers[who[j]]);
          x.next = engine::argmax(buffers[who[j]].data(), n_vocab);
        }
      }
    }
    check(ok, "sequences created");
    check(mixed, "some step mixed prompt chunks with decode rows");
    for (size_t i = 0; i < scripts.size(); ++i) {
      const auto& a = alone[i];
      const auto& b = st[i].logits;
      bool same = a.size() == b.size();
      float worst = 0.0f;
      for (size_t k = 0; same && k < a.size(); ++k) {
        for (uint32_t v = 0; v < n_vocab; ++v) worst = std::max(worst, std::abs(a[k][v] - b[k][v]));
        same = std::memcmp(a[k].data(), b[k].data(), n_vocab * sizeof(float)) == 0;
      }
      check(same, "sequence " + std::to_string(i) + " (" +
                      std::to_string(scripts[i].prompt.size()) + "-token prompt, " +
                      std::to_string(a.size()) + " logit rows): batched logits equal the "
                      "single-sequence ones bit for bit (max diff " +
                      std::to_string(worst) + ")");
    }
    uint64_t live = 0, length = 0;
    kvgc_seq_tokens(batch.heap(), st[0].seq, 0, &live, &length);
    check(live < length, "the GC evicted during the batched run (live " + std::to_string(live) +
                             " of " + std::to_string(length) + ")");
  }

  // All or nothing: two 150-token chunks into an arena with room for about one.
  {
    engine::BatchEngine batch;
    engine::EngineOptions eo;
    eo.threads = 1;
    kvgc_heap_options o = heap_options(0);
    o.token_budget = 0;
    o.slab_bytes = 64 << 10;
    uint64_t one = 0;
    const kvgc_model_desc desc = engine::kv_desc(model.config, KVGC_DTYPE_F16);
    kvgc_kv_bytes(&desc, 150, KVGC_CLASS_FP16, o.page_tokens, &one);
    o.budget_bytes = one + one / 2;
    if (!batch.init(model, &o, &err, eo)) {
      std::printf("FAIL  BatchEngine::init (small arena): %s\n", err.c_str());
      return 1;
    }
    kvgc_seq a = 0, b = 0;
    kvgc_seq_create(batch.heap(), 0, &a);
    kvgc_seq_create(batch.heap(), 0, &b);
    const std::vector<int32_t>& p = scripts[0].prompt;
    std::vector<float> logits(n_vocab);
    std::vector<engine::BatchItem> items(2);
    items[0] = {a, p.data(), 150, 0, nullptr};
    items[1] = {b, p.data(), 150, 0, logits.data()};
    uint32_t failed = 99;
    const auto outcome = batch.step(items, &failed, &err);
    check(outcome == engine::BatchEngine::Outcome::NoRoom && failed == 1,
          "a batch that does not fit: NoRoom at index 1 (got outcome " +
              std::to_string(int(outcome)) + ", index " + std::to_string(failed) + ")");
    uint64_t live = 1, length = 1;
    kvgc_seq_tokens(batch.heap(), a, 0, &live, &length);
    check(length == 0, "the refused plan appended nothing");
    kvgc_seq_destroy(batch.heap(), b);  // preempt the one that did not fit
    items.resize(1);
    items[0].logits = logits.data();
    check(batch.step(items, &failed, &err) == engine::BatchEngine::Outcome::Ok,
          "after preempting it the rest runs: " + err);
  }
  // The server: three requests that outgrow a small arena (full cache) are preempted and
  // recomputed, and still answer exactly what they answer in a roomy one (every row is
  // computed as alone, so recomputing a context reproduces its cache); a request larger
  // than the arena is refused with a message.
  {
    const kvgc_model_desc desc = engine::kv_desc(model.config, KVGC_DTYPE_F16);
    auto serve = [&](uint64_t arena, std::vector<engine::ServeRequest>* reqs,
                     engine::ServeStats* stats) {
      engine::BatchEngine eng;
      engine::EngineOptions eo;
      eo.threads = 1;
      kvgc_heap_options o = heap_options(arena);
      o.policy = KVGC_POLICY_FULL;
      o.token_budget = 0;
      o.slab_bytes = 64 << 10;
      if (!eng.init(model, &o, &err, eo)) return false;
      engine::ServeOptions so;
      so.chunk_tokens = 32;
      return serve_all(&eng, so, reqs, stats, &err);
    };
    auto make = [&](bool huge) {
      std::vector<engine::ServeRequest> reqs(3);
      for (size_t i = 0; i < reqs.size(); ++i) {
        reqs[i].prompt.assign(all.begin() + 7 * i, all.begin() + 7 * i + 60);
        reqs[i].max_new = 24;
        reqs[i].stop_at_eos = false;
      }
      if (huge) {
        reqs.emplace_back();
        reqs.back().prompt = all;  // 180 tokens: more than the small arena holds
        reqs.back().max_new = 1;
      }
      return reqs;
    };
    uint64_t one = 0;
    kvgc_kv_bytes(&desc, 61, KVGC_CLASS_FP16, 16, &one);
    std::vector<engine::ServeRequest> roomy = make(false), tight = make(true);
    engine::ServeStats roomy_stats, tight_stats;
    const bool ran = serve(64ull << 20, &roomy, &roomy_stats) &&
                     serve(one * 2 + one * 5 / 8, &tight, &tight_stats);
    check(ran, "served in both arenas: " + err);
    if (ran) {
      check(roomy_stats.preemptions == 0 && tight_stats.preemptions > 0,
            "the small arena preempts (" + std::to_string(tight_stats.preemptions) +
                " preemptions; roomy " + std::to_string(roomy_stats.preemptions) + ")");
      // Untouched neighbours answer exactly as in the roomy arena. A preempted request
      // runs its 24 tokens and agrees up to where it was preempted; after that its
      // recomputed context went through chunk attention, whose sums kvgc orders by the
      // chunk's rows (kernels/cpu/attend_simd.inc), so greedy may drift from decode's.
      bool neighbours = true, preempted_ok = true;
      uint32_t preempted = 0;
      for (size_t i = 0; i < roomy.size(); ++i) {
        size_t k = 0;
        while (k < roomy[i].output.size() && k < tight[i].output.size() &&
               roomy[i].output[k] == tight[i].output[k])
          ++k;
        if (tight[i].preemptions == 0) {
          neighbours = neighbours && roomy[i].output == tight[i].output;
        } else {
          ++preempted;
          preempted_ok = preempted_ok && tight[i].output.size() == 24 && k >= 8;
        }
      }
      check(neighbours && preempted > 0 && preempted < roomy.size(),
            "requests never preempted answer exactly what they answer in a roomy arena");
      check(preempted_ok, "a preempted request is recomputed and completes, agreeing up to "
                          "its preemption");
      check(!tight.back().error.empty() && tight.back().done && tight.back().output.empty(),
            "a request larger than the arena is refused: " + tight.back().error);
      check(tight_stats.max_running >= 2, "two sequences ran at once in the small arena");
    }
  }
  // Admission checks the heap's own room beside the projection: with a footprint that
  // counts decoding sequences as nothing (a projection that trusts pruning too much), the
  // projection admits every head, and only the heap's count keeps a head from being
  // admitted, preempted at its first plan and admitted again, step after step.
  {
    const kvgc_model_desc desc = engine::kv_desc(model.config, KVGC_DTYPE_F16);
    uint64_t one = 0;
    kvgc_kv_bytes(&desc, 61, KVGC_CLASS_FP16, 16, &one);
    engine::BatchEngine eng;
    engine::EngineOptions eo;
    eo.threads = 1;
    kvgc_heap_options o = heap_options(one * 2 + one * 5 / 8);
    o.policy = KVGC_POLICY_FULL;
    o.token_budget = 0;
    o.slab_bytes = 64 << 10;
    if (!eng.init(model, &o, &err, eo)) {
      check(false, "engine: " + err);
    } else {
      engine::ServeOptions so;
      so.chunk_tokens = 32;
      so.footprint = [&desc](uint64_t n, uint64_t cached, bool prefilling) {
        uint64_t bytes = 0;
        if (prefilling) kvgc_kv_bytes(&desc, n - cached, KVGC_CLASS_FP16, 16, &bytes);
        return bytes;
      };
      std::vector<engine::ServeRequest> reqs(4);
      for (size_t i = 0; i < reqs.size(); ++i) {
        reqs[i].prompt.assign(all.begin() + 7 * i, all.begin() + 7 * i + 60);
        reqs[i].max_new = 24;
        reqs[i].stop_at_eos = false;
      }
      engine::ServeStats st;
      const bool ran = serve_all(&eng, so, &reqs, &st, &err);
      check(ran, "served with an undercounting footprint: " + err);
      bool all_done = ran;
      for (const engine::ServeRequest& r : reqs) all_done = all_done && r.output.size() == 24;
      check(all_done, "every request completes");
      check(st.preemptions <= 4, "admission waits for the heap's room: " +
                                     std::to_string(st.preemptions) + " preemptions for 4 requests");
    }
  }
  // The server's prefix cache (ServeOptions::prefix_cache): refused with a stream prefill;
  // with the observe prefill, requests sharing a 100-token prefix served one at a time
  // attach it from the first one's kept prompt (whole pages), prefill only the rest, and
  // answer as without the cache (the full cache: the attached K/V are the bytes the
  // first request's prefill wrote; greedy may drift only where chunk sums reorder).
  {
    auto serve = [&](bool cache, std::vector<engine::ServeRequest>* reqs,
                     engine::ServeStats* stats) {
      engine::BatchEngine eng;
      engine::EngineOptions eo;
      eo.threads = 1;
      kvgc_heap_options o = heap_options(64ull << 20);
      o.policy = KVGC_POLICY_FULL;
      o.token_budget = 0;
      if (!eng.init(model, &o, &err, eo)) return false;
      engine::ServeOptions so;
      so.chunk_tokens = 32;
      so.max_running = 1;  // one at a time: each later request finds the earlier prompts
      so.prefix_cache = cache;
      so.prefill = engine::Engine::PrefillMode::Observe;
      return serve_all(&eng, so, reqs, stats, &err);
    };
    auto make = [&] {
      std::vector<engine::ServeRequest> reqs(3);
      for (size_t i = 0; i < reqs.size(); ++i) {
        reqs[i].prompt.assign(all.begin(), all.begin() + 100);  // the shared prefix
        reqs[i].prompt.insert(reqs[i].prompt.end(), all.begin() + 100 + 20 * i,
                              all.begin() + 130 + 20 * i);
        reqs[i].max_new = 16;
        reqs[i].stop_at_eos = false;
      }
      return reqs;
    };
    {
      engine::BatchEngine eng;
      engine::EngineOptions eo;
      eo.threads = 1;
      const kvgc_heap_options o = heap_options(64ull << 20);
      std::string why;
      engine::ServeOptions so;
      so.prefix_cache = true;
      so.prefill = engine::Engine::PrefillMode::Stream;
      engine::ServeRequest r;
      r.prompt.assign(all.begin(), all.begin() + 10);
      r.max_new = 1;
      check(eng.init(model, &o, &err, eo), "a heap for the refusal: " + err);
      engine::Server server(&eng, so);
      const bool refused = !server.submit(&r, &why);
      check(refused && why.find("observe") != std::string::npos,
            "prefix_cache with a stream prefill is refused: " + why);
    }
    std::vector<engine::ServeRequest> plain = make(), cached = make();
    engine::ServeStats plain_stats, cached_stats;
    const bool ran = serve(false, &plain, &plain_stats) && serve(true, &cached, &cached_stats);
    check(ran, "served with and without the prefix cache: " + err);
    if (ran) {
      check(plain_stats.prefix_hits == 0 && cached_stats.prefix_lookups == 3 &&
                cached_stats.prefix_hits == 2 && cached_stats.prefix_keeps == 3 &&
                cached_stats.prefix_keep_failed == 0,
            "the later two requests attach, every prompt is kept (hits " +
                std::to_string(cached_stats.prefix_hits) + ", keeps " +
                std::to_string(cached_stats.prefix_keeps) + ")");
      check(cached_stats.prefix_tokens_attached >= 2 * 64 &&
                cached_stats.prompt_tokens + cached_stats.prefix_tokens_attached ==
                    plain_stats.prompt_tokens,
            "attached tokens are prompt rows not run (" +
                std::to_string(cached_stats.prefix_tokens_attached) + " attached, " +
                std::to_string(cached_stats.prompt_tokens) + " of " +
                std::to_string(plain_stats.prompt_tokens) + " rows run)");
      bool agree = true;
      for (size_t i = 0; i < plain.size(); ++i) {
        size_t k = 0;
        while (k < plain[i].output.size() && k < cached[i].output.size() &&
               plain[i].output[k] == cached[i].output[k])
          ++k;
        agree = agree && cached[i].output.size() == 16 && (i == 0 ? k == 16 : k >= 8);
      }
      check(agree, "requests that attached answer as without the cache");
    }
    // Under a pruning policy a prompt keeps only the whole pages it shares with another
    // prompt seen: the first keeps the common 100 tokens' whole pages (the others wait
    // behind it), the later two attach them and keep nothing; no request's own part is
    // cached, so its GC's pruning frees its pages. The same under both charges that
    // prune with sharing (cache; shrink, the default since 0.15).
    for (const kvgc_prefix_charge charge : {KVGC_PREFIX_CHARGE_CACHE, KVGC_PREFIX_CHARGE_SHRINK}) {
      engine::BatchEngine eng;
      engine::EngineOptions eo;
      eo.threads = 1;
      kvgc_heap_options o = heap_options(64ull << 20);
      o.token_budget = 0;
      o.byte_budget_fraction = 0.3;
      o.prefix_charge = charge;
      std::vector<engine::ServeRequest> reqs = make();
      engine::ServeOptions so;
      so.chunk_tokens = 32;
      so.max_running = 1;
      so.prefix_cache = true;
      so.prefill = engine::Engine::PrefillMode::Observe;
      bool ok = eng.init(model, &o, &err, eo);
      kvgc_stats st;
      kvgc_stats_init(&st);
      engine::ServeStats ss;
      ok = ok && serve_all(&eng, so, &reqs, &ss, &err) && kvgc_get_stats(eng.heap(), &st) == KVGC_OK;
      const std::string mode = charge == KVGC_PREFIX_CHARGE_SHRINK ? " (shrink)" : " (cache)";
      check(ok && kvgc_heap_check(eng.heap()) == KVGC_OK,
            "served under a pruning policy with the prefix cache" + mode + ": " + err);
      const uint64_t common_pages = 100 / o.page_tokens;
      check(ss.prefix_keeps == 1 && ss.prefix_hits == 2 &&
                ss.prefix_tokens_attached == 2 * common_pages * o.page_tokens &&
                st.prefixes == 1 && st.shared_pages == uint64_t(eng.kv_model().n_layers) * common_pages,
            "the shared whole pages are kept once, no own part" + mode + " (keeps " + std::to_string(ss.prefix_keeps) +
                ", hits " + std::to_string(ss.prefix_hits) + ", attached " +
                std::to_string(ss.prefix_tokens_attached) + ", prefixes " + std::to_string(st.prefixes) +
                ", shared pages " + std::to_string(st.shared_pages) + ")");
    }
  }
  // ServeOptions::max_prefilling: with 1, requests arriving together enter their prompts
  // one at a time (the next is admitted once the previous is in); without a limit, side
  // by side. Every request completes either way.
  for (const uint32_t limit : {0u, 1u}) {
    engine::BatchEngine eng;
    engine::EngineOptions eo;
    eo.threads = 1;
    kvgc_heap_options o = heap_options(64ull << 20);
    o.token_budget = 0;
    o.byte_budget_fraction = 0.3;
    std::vector<engine::ServeRequest> reqs(3);
    for (size_t i = 0; i < reqs.size(); ++i) {
      reqs[i].prompt.assign(all.begin() + 40 * i, all.begin() + 40 * i + 96);
      reqs[i].max_new = 8;
      reqs[i].stop_at_eos = false;
    }
    engine::ServeOptions so;
    so.chunk_tokens = 32;
    so.max_prefilling = limit;
    so.prefill = engine::Engine::PrefillMode::Observe;
    bool ok = eng.init(model, &o, &err, eo);
    engine::ServeStats ss;
    ok = ok && serve_all(&eng, so, &reqs, &ss, &err);
    bool complete = ok;
    for (const engine::ServeRequest& r : reqs) complete = complete && r.done && r.output.size() == 8;
    check(complete, "every request completes with max_prefilling " + std::to_string(limit) + ": " + err);
    check(limit ? ss.max_in_prompt == 1 : ss.max_in_prompt == 3,
          "max_prefilling " + std::to_string(limit) + ": at most " + std::to_string(ss.max_in_prompt) +
              " sequences were in their prompt at once");
  }
  if (g_failures) std::printf("%d check(s) failed\n", g_failures);
  return g_failures ? 1 : 0;
}
