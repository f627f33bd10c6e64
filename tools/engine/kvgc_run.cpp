// kvgc-run: a small reference engine. Runs a llama GGUF (SmolLM2-135M-Instruct by
// default) on the CPU with its whole KV cache in a kvgc heap, streams the generated text,
// and reports what the cache policy (KVGC_POLICY, KVGC_TOKEN_BUDGET, ...) did.
#include <algorithm>
#include <chrono>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <new>
#include <random>
#include <string>
#include <vector>

#include <unistd.h>

#include "engine/forward.hpp"
#include "engine/model.hpp"
#include "engine/prompt_file.hpp"
#include "engine/tokenizer.hpp"
#include "gguf.hpp"

namespace {

using Clock = std::chrono::steady_clock;

struct Args {
  std::string model;
  std::string prompt = "What is the capital of France?";
  bool chat = false;
  uint32_t max_tokens = 128;
  float temperature = 0.0f;
  uint64_t seed = 42;
  std::string profile;  // --profile FILE: per-layer attention entropy over the prompt
  engine::Engine::PrefillMode prefill = engine::Engine::PrefillMode::Observe;
  engine::EngineOptions engine;
  bool ignore_eos = false;        // benchmarks: always generate max_tokens
  bool print_prompt_ids = false;  // print the prompt's token ids and stop
  uint32_t perplexity = 0;        // > 0: perplexity of the prompt's first N + 1 tokens
};

void usage(FILE* out) {
  std::fprintf(out,
               "usage: kvgc-run [--model PATH] [--prompt TEXT | --prompt-file FILE] [--chat]\n"
               "                [--max-tokens N] [--temperature T] [--seed S]\n"
               "                [--prefill observe|stream] [--profile FILE] [--threads N]\n"
               "                [--kv-dtype f16|f32] [--matmul q8|exact] [--ignore-eos]\n"
               "                [--pool-radius N] [--key-prior W] [--reconstruct W]\n"
               "                [--reconstruct-signal mass|head-peak]\n"
               "                [--print-prompt-ids] [--perplexity N]\n"
               "  --model PATH     GGUF file (default: $KVGC_MODEL, else\n"
               "                   ~/.cache/kvgc/%s)\n"
               "  --prompt TEXT    the prompt (default: \"What is the capital of France?\")\n"
               "  --prompt-file F  the prompt, read from file F (at most 64 MiB)\n"
               "  --chat           wrap the prompt in the model's ChatML template\n"
               "  --max-tokens N   tokens to generate at most (default 128)\n"
               "  --temperature T  0 (default) is greedy; above 0 samples\n"
               "  --seed S         sampling seed (default 42)\n"
               "  --prefill MODE   observe (default): cache the whole prompt, let only its last\n"
               "                   %u tokens score, evict once at its end (SnapKV-style: what\n"
               "                   the question attends to survives); stream: evict after every\n"
               "                   %u-token chunk, every token scores (the cache never exceeds\n"
               "                   its budget, but facts are judged before the question is read)\n"
               "  --pool-radius N  the observe prefill's score pooling: a token ranks as the best\n"
               "                   within N positions either side, so a fact kept keeps its\n"
               "                   neighbours (default %u; 0: none; at most %u)\n"
               "  --key-prior W    add to the observe prefill's scores each key's diversity\n"
               "                   (1 - cosine to its head's mean key), W times the observed\n"
               "                   mass in all: for prompts whose question comes later\n"
               "                   (default 0: off)\n"
               "  --reconstruct W  after the prompt, the model reads it again on forks of its\n"
               "                   cache, and each token gains its largest attention from that\n"
               "                   repeat, W times the observed mass in all: what a later\n"
               "                   question is likely to need (default 0: off; about doubles\n"
               "                   the prefill's time)\n"
               "  --reconstruct-signal S  what the repeat gives a token: mass (default), the\n"
               "                   attention kvgc's kernel fused into the fork's scores, a\n"
               "                   query's heads summed; head-peak, the largest probability any\n"
               "                   one query head gave it (KVzip's signal, computed by the engine)\n"
               "  --profile FILE   after the prompt, write each layer's attention entropy to FILE\n"
               "                   for KVGC_LAYER_BUDGET=entropy:FILE (run with KVGC_POLICY=full)\n"
               "  --threads N      matmul threads, this one included (default: the CPUs this\n"
               "                   process may run on, %u here). kvgc's attention uses\n"
               "                   KVGC_THREADS (default 1); the matmul threads sleep while it\n"
               "                   runs, so N and KVGC_THREADS up to the CPU count never\n"
               "                   oversubscribe them\n"
               "  --kv-dtype D     f16 (default) or f32: the dtype of the K/V kvgc holds\n"
               "  --matmul M       q8 (default): activations quantised to 8 bits per block of\n"
               "                   32 against the Q4_1/Q8_0 weights, as llama.cpp does; exact:\n"
               "                   weight rows dequantised to f32 (slower; no activation\n"
               "                   rounding)\n"
               "  --ignore-eos     generate --max-tokens tokens even past an end token\n"
               "  --print-prompt-ids  print the prompt's token ids (comma-separated) and exit\n"
               "  --perplexity N   instead of generating: the perplexity of the prompt's tokens\n"
               "                   1..N, each predicted from those before it (teacher forcing;\n"
               "                   KVGC_POLICY=full for the full cache)\n"
               "The KV cache policy comes from KVGC_* variables (e.g. KVGC_POLICY=generational\n"
               "KVGC_TOKEN_BUDGET=25%%).\n",
               engine::kDefaultModelFile, engine::Engine::kObserveTokens,
               engine::Engine::kChunkTokens, engine::kDefaultPoolRadius, engine::kMaxPoolRadius,
               engine::ThreadPool::available_cpus());
}

// A whole decimal number in [lo, hi], or false.
bool parse_uint(const char* text, uint64_t lo, uint64_t hi, uint64_t* out) {
  if (text == nullptr || *text < '0' || *text > '9') return false;
  char* end = nullptr;
  errno = 0;
  const unsigned long long v = std::strtoull(text, &end, 10);
  if (errno != 0 || *end != '\0' || v < lo || v > hi) return false;
  *out = v;
  return true;
}

// A weight: a finite number >= 0.
bool parse_weight(const char* text, float* out) {
  char* end = nullptr;
  *out = std::strtof(text, &end);
  return *end == '\0' && end != text && std::isfinite(*out) && *out >= 0;
}

bool parse_args(int argc, char** argv, Args* args) {
  args->engine.threads = engine::ThreadPool::available_cpus();
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&]() -> const char* { return i + 1 < argc ? argv[++i] : nullptr; };
    auto bad = [&](const char* what) {
      std::fprintf(stderr, "kvgc-run: %s must be %s, not '%s'\n", arg.c_str(), what,
                   argv[i]);
      return false;
    };
    const char* v = nullptr;
    uint64_t n = 0;
    if (arg == "--help" || arg == "-h") {
      usage(stdout);
      std::exit(0);
    } else if (arg == "--chat") {
      args->chat = true;
    } else if (arg == "--ignore-eos") {
      args->ignore_eos = true;
    } else if (arg == "--print-prompt-ids") {
      args->print_prompt_ids = true;
    } else if (arg == "--model" && (v = value())) {
      args->model = v;
    } else if (arg == "--prompt" && (v = value())) {
      args->prompt = v;
    } else if (arg == "--prompt-file" && (v = value())) {
      std::string why;  // bounded, as kvgc-serve's FILE
      if (!engine::read_prompt_file(v, &args->prompt, &why)) {
        std::fprintf(stderr, "kvgc-run: --prompt-file %s\n", why.c_str());
        return false;
      }
    } else if (arg == "--max-tokens" && (v = value())) {
      if (!parse_uint(v, 0, UINT32_MAX, &n)) return bad("a count of tokens");
      args->max_tokens = uint32_t(n);
    } else if (arg == "--perplexity" && (v = value())) {
      if (!parse_uint(v, 1, UINT32_MAX - 1, &n)) return bad("a count of tokens >= 1");
      args->perplexity = uint32_t(n);
    } else if (arg == "--pool-radius" && (v = value())) {
      if (!parse_uint(v, 0, engine::kMaxPoolRadius, &n))
        return bad("a radius in 0..4096");
      static_assert(engine::kMaxPoolRadius == 4096, "the message above names the bound");
      args->engine.pool_radius = uint32_t(n);
    } else if (arg == "--key-prior" && (v = value())) {
      if (!parse_weight(v, &args->engine.key_prior)) return bad("a finite weight >= 0");
    } else if (arg == "--reconstruct" && (v = value())) {
      if (!parse_weight(v, &args->engine.reconstruct)) return bad("a finite weight >= 0");
    } else if (arg == "--reconstruct-signal" && (v = value())) {
      const std::string signal = v;
      if (signal != "mass" && signal != "head-peak") return bad("mass or head-peak");
      args->engine.reconstruct_head_peak = signal == "head-peak";
    } else if (arg == "--threads" && (v = value())) {
      if (!parse_uint(v, 1, 1024, &n)) return bad("a thread count in 1..1024");
      args->engine.threads = uint32_t(n);
    } else if (arg == "--temperature" && (v = value())) {
      char* end = nullptr;
      args->temperature = std::strtof(v, &end);
      if (*end != '\0' || !std::isfinite(args->temperature) || args->temperature < 0)
        return bad("a temperature >= 0");
    } else if (arg == "--seed" && (v = value())) {
      if (!parse_uint(v, 0, UINT64_MAX, &n)) return bad("a whole number");
      args->seed = n;
    } else if (arg == "--profile" && (v = value())) {
      args->profile = v;
    } else if (arg == "--kv-dtype" && (v = value())) {
      const std::string dtype = v;
      if (dtype != "f16" && dtype != "f32") return bad("f16 or f32");
      args->engine.kv_dtype = dtype == "f16" ? KVGC_DTYPE_F16 : KVGC_DTYPE_F32;
    } else if (arg == "--matmul" && (v = value())) {
      const std::string mode = v;
      if (mode != "q8" && mode != "exact") return bad("q8 or exact");
      args->engine.matmul =
          mode == "q8" ? engine::MatmulMode::Quantized : engine::MatmulMode::Exact;
    } else if (arg == "--prefill" && (v = value())) {
      const std::string mode = v;
      if (mode == "observe") {
        args->prefill = engine::Engine::PrefillMode::Observe;
      } else if (mode == "stream") {
        args->prefill = engine::Engine::PrefillMode::Stream;
      } else {
        return bad("observe or stream");
      }
    } else {
      std::fprintf(stderr, "kvgc-run: unknown or incomplete argument '%s'\n", arg.c_str());
      usage(stderr);
      return false;
    }
  }
  if (args->model.empty()) args->model = engine::default_model_path();
  return true;
}

int32_t sample(const std::vector<float>& logits, float temperature, std::mt19937_64* rng) {
  const size_t best = size_t(engine::argmax(logits.data(), uint32_t(logits.size())));
  if (temperature <= 0.0f) return int32_t(best);
  std::vector<double> weights(logits.size());
  for (size_t i = 0; i < logits.size(); ++i) {
    weights[i] = std::exp(double(logits[i] - logits[best]) / temperature);
  }
  std::discrete_distribution<size_t> pick(weights.begin(), weights.end());
  return int32_t(pick(*rng));
}

// Each layer's attention entropy over the prompt, from what kvgc accumulated: a token's
// score is the mass it received from every query that saw it; divided by how many could
// (causality favours early tokens), normalised, its entropy in nats says how broadly the
// layer attends. High-entropy layers get more of the budget under entropy:FILE.
bool write_profile(kvgc_heap* heap, kvgc_seq seq, uint32_t layers, uint64_t prompt_tokens,
                   const std::string& path, std::string* err) {
  std::FILE* f = std::fopen(path.c_str(), "w");
  if (!f) {
    *err = "cannot write the profile '" + path + "'";
    return false;
  }
  std::fprintf(f, "# kvgc layer-budget profile: attention entropy per layer (nats) over a\n"
                  "# %llu-token prompt; use with KVGC_LAYER_BUDGET=entropy:%s\n",
               (unsigned long long)prompt_tokens, path.c_str());
  bool ok = true;
  for (uint32_t l = 0; l < layers && ok; ++l) {
    uint64_t n = 0;
    ok = kvgc_read_scores(heap, seq, l, nullptr, nullptr, 0, &n, nullptr) == KVGC_OK;
    std::vector<float> scores(n);
    std::vector<int32_t> pos(n);
    ok = ok && kvgc_read_scores(heap, seq, l, scores.data(), nullptr, n, &n, nullptr) == KVGC_OK &&
         kvgc_read(heap, seq, l, nullptr, nullptr, pos.data(), n, &n, nullptr) == KVGC_OK;
    if (!ok) {
      *err = std::string("kvgc: ") + kvgc_errmsg(heap);
      break;
    }
    double total = 0;
    std::vector<double> p(n);
    for (uint64_t i = 0; i < n; ++i) {
      const double seen_by = double(prompt_tokens) - double(pos[i]);
      p[i] = seen_by > 0 ? std::max(0.0, double(scores[i])) / seen_by : 0.0;
      total += p[i];
    }
    double h = 0;
    for (double x : p)
      if (x > 0 && total > 0) h -= (x / total) * std::log(x / total);
    std::fprintf(f, "%.6f  # layer %u\n", std::max(h, 1e-6), l);
  }
  std::fclose(f);
  return ok;
}

// Teacher-forced perplexity of tokens[1..n] (each predicted from those before it), in
// chunks so the logits held stay one chunk's.
bool perplexity(engine::Engine* engine, uint32_t n_vocab, const std::vector<int32_t>& tokens,
                uint32_t n, std::string* err) {
  if (tokens.size() < size_t(n) + 1) {
    *err = "--perplexity " + std::to_string(n) + " needs " + std::to_string(n + 1) +
           " prompt tokens; the prompt has " + std::to_string(tokens.size());
    return false;
  }
  constexpr uint32_t kPiece = engine::Engine::kChunkTokens;
  std::vector<float> logits(size_t(kPiece) * n_vocab);
  engine::Engine::Pass pass;
  pass.all_logits = logits.data();
  double nll = 0;
  const auto start = Clock::now();
  for (uint32_t done = 0; done < n; done += kPiece) {
    const uint32_t piece = std::min(kPiece, n - done);
    if (!engine->forward(&tokens[done], piece, nullptr, err, pass)) return false;
    for (uint32_t j = 0; j < piece; ++j) {
      nll -= engine::log_prob(&logits[size_t(j) * n_vocab], n_vocab, tokens[done + j + 1]);
    }
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  std::printf("perplexity %.4f over %u tokens (%.1f tok/s)\n", std::exp(nll / n), n,
              seconds > 0 ? n / seconds : 0.0);
  return true;
}

// Prints the longest complete UTF-8 prefix of `pending`, keeping a split character.
void flush_utf8(std::string* pending) {
  size_t end = pending->size();
  for (size_t back = 1; back <= 3 && back <= pending->size(); ++back) {
    const uint8_t c = uint8_t((*pending)[pending->size() - back]);
    if ((c & 0xc0) == 0x80) continue;  // a continuation byte: look further back
    const size_t need = c >= 0xf0 ? 4 : c >= 0xe0 ? 3 : c >= 0xc0 ? 2 : 1;
    if (need > back) end = pending->size() - back;
    break;
  }
  std::fwrite(pending->data(), 1, end, stdout);
  std::fflush(stdout);
  pending->erase(0, end);
}

}  // namespace

static int run(int argc, char** argv) {
  Args args;
  if (!parse_args(argc, argv, &args)) return 2;
  if (!std::filesystem::exists(args.model)) {
    std::fprintf(stderr,
                 "kvgc-run: model file %s not found.\n"
                 "Fetch SmolLM2-135M-Instruct with:  tools/fetch-model.sh\n"
                 "(or pass --model PATH, or set KVGC_MODEL)\n",
                 args.model.c_str());
    return 1;
  }
  std::string err;
  gguf::File file;
  engine::Model model;
  engine::Tokenizer tokenizer;
  if (!file.open(args.model, &err) || !engine::load_model(file, &model, &err) ||
      !tokenizer.load(file, &err)) {
    std::fprintf(stderr, "kvgc-run: %s\n", err.c_str());
    return 1;
  }
  const engine::Config& config = model.config;
  const std::string text =
      args.chat ? engine::apply_chat_template({{"user", args.prompt}}, true) : args.prompt;
  const std::vector<int32_t> prompt = tokenizer.encode(text);
  if (prompt.empty()) {
    std::fprintf(stderr, "kvgc-run: the prompt is empty\n");
    return 2;
  }
  if (args.print_prompt_ids) {
    for (size_t i = 0; i < prompt.size(); ++i) std::printf("%s%d", i ? "," : "", prompt[i]);
    std::printf("\n");
    return 0;
  }
  args.engine.reconstruct_prompt = tokenizer.encode(engine::kReconstructPrompt, false);
  engine::Engine engine;
  if (!engine.init(model, nullptr, &err, args.engine)) {
    std::fprintf(stderr, "kvgc-run: %s\n", err.c_str());
    return 1;
  }
  if (args.perplexity > 0) {
    if (!perplexity(&engine, config.n_vocab, prompt, args.perplexity, &err)) {
      std::fprintf(stderr, "kvgc-run: %s\n", err.c_str());
      return 1;
    }
    return 0;
  }

  // The profile needs every query's mass (write_profile divides by how many saw a token).
  const auto mode = args.profile.empty() ? args.prefill : engine::Engine::PrefillMode::Stream;
  std::vector<float> logits(config.n_vocab);
  const auto prefill_start = Clock::now();
  // Progress on a terminal only: one line that updates, with its rate and what is left
  // (a log gets the summary below, not a run of carriage returns).
  const bool tty = isatty(fileno(stderr));
  auto progress = [&](uint32_t done) {
    const double s = std::chrono::duration<double>(Clock::now() - prefill_start).count();
    const double rate = s > 0 ? done / s : 0;
    std::fprintf(stderr, "\rprefill %u/%zu tokens, %.0f tok/s, %.0f s left   ", done, prompt.size(),
                 rate, rate > 0 ? double(prompt.size() - done) / rate : 0.0);
  };
  if (!engine.prefill(prompt.data(), uint32_t(prompt.size()), logits.data(), &err, mode,
                      tty ? std::function<void(uint32_t)>(progress) : nullptr)) {
    std::fprintf(stderr, "%skvgc-run: %s\n", tty ? "\n" : "", err.c_str());
    return 1;
  }
  if (tty) std::fprintf(stderr, "\n");
  const double prefill_s =
      std::chrono::duration<double>(Clock::now() - prefill_start).count();
  if (!args.profile.empty()) {
    if (!write_profile(engine.heap(), engine.sequence(), model.config.n_layers, prompt.size(),
                       args.profile, &err)) {
      std::fprintf(stderr, "kvgc-run: %s\n", err.c_str());
      return 1;
    }
    std::fprintf(stderr, "\nkvgc-run: layer-budget profile written to %s "
                         "(use KVGC_LAYER_BUDGET=entropy:%s)\n",
                 args.profile.c_str(), args.profile.c_str());
  }

  // Decode, streaming each token's text as soon as its UTF-8 is complete.
  std::mt19937_64 rng(args.seed);
  const int32_t end_of_text = tokenizer.find("<|endoftext|>");
  const int32_t im_end = tokenizer.find("<|im_end|>");
  std::string pending;
  uint32_t generated = 0;
  const auto decode_start = Clock::now();
  while (generated < args.max_tokens) {
    const int32_t token = sample(logits, args.temperature, &rng);
    if (!args.ignore_eos && (token == tokenizer.eos() || token == end_of_text || token == im_end))
      break;
    ++generated;
    pending += tokenizer.token_bytes(token);
    flush_utf8(&pending);
    if (generated == args.max_tokens) break;
    if (!engine.forward(&token, 1, logits.data(), &err)) {
      std::fprintf(stderr, "\nkvgc-run: %s\n", err.c_str());
      return 1;
    }
  }
  std::fwrite(pending.data(), 1, pending.size(), stdout);
  std::printf("\n");
  std::fflush(stdout);
  const double decode_s = std::chrono::duration<double>(Clock::now() - decode_start).count();
  // The last sampled token is printed but never run through the model.
  const uint64_t decode_steps = generated > 0 ? generated - (generated == args.max_tokens) : 0;

  kvgc_stats stats;
  kvgc_stats_init(&stats);
  kvgc_heap_options options;
  kvgc_heap_options_init(&options);
  uint64_t full_bytes = 0, raw_bytes = 0;
  if (kvgc_get_stats(engine.heap(), &stats) != KVGC_OK ||
      kvgc_heap_get_options(engine.heap(), &options) != KVGC_OK ||
      kvgc_kv_bytes(&engine.kv_model(), engine.position(), KVGC_CLASS_FP16, options.page_tokens,
                    &full_bytes) != KVGC_OK ||
      kvgc_kv_bytes(&engine.kv_model(), engine.position(), KVGC_CLASS_FP16, 0, &raw_bytes) != KVGC_OK) {
    std::fprintf(stderr, "kvgc-run: reading kvgc statistics: %s\n", kvgc_errmsg(engine.heap()));
    return 1;
  }
  static const char* kPolicies[] = {"generational", "full", "streaming", "h2o", "random"};
  // Every page class: fp16, int4, int8 and int2 (cls_int8, cls_int2: the struct grew)
  // and header pages.
  const uint64_t held = stats.cls[KVGC_CLASS_FP16].used_bytes +
                        stats.cls[KVGC_CLASS_INT4].used_bytes + stats.cls_int8.used_bytes +
                        stats.cls_int2.used_bytes + stats.cls_header.used_bytes;
  const double total_s = prefill_s + decode_s;
  const double mib = 1024.0 * 1024.0;
  std::fprintf(stderr, "\n");
  std::fprintf(stderr, "  policy               %s\n",
               unsigned(options.policy) < 5 ? kPolicies[options.policy] : "?");
  std::fprintf(stderr, "  prompt tokens        %zu\n", prompt.size());
  std::fprintf(stderr, "  prefill mode         %s\n",
               mode == engine::Engine::PrefillMode::Observe
                   ? "observe (whole prompt cached, evicted once at its end)"
                   : "stream (kvgc_step after every chunk)");
  std::fprintf(stderr, "  generated tokens     %u\n", generated);
  std::fprintf(stderr, "  live KV tokens       %.1f of %llu (per layer)\n",
               double(stats.live_tokens) / config.n_layers,
               (unsigned long long)engine.position());
  // Both ratios: to the full cache's pages, and to its raw K/V bytes (what a
  // KVGC_BYTE_BUDGET fraction is of).
  std::fprintf(stderr, "  KV bytes held        %.2f MiB of %.2f MiB full cache (%.1f%%; %.1f%% of its "
               "raw K/V)\n", held / mib, full_bytes / mib,
               full_bytes ? 100.0 * held / full_bytes : 0.0, raw_bytes ? 100.0 * held / raw_bytes : 0.0);
  std::fprintf(stderr, "  tokens evicted       %llu\n",
               (unsigned long long)stats.tokens_evicted);
  std::fprintf(stderr, "  tokens demoted       %llu\n",
               (unsigned long long)stats.tokens_demoted);
  std::fprintf(stderr, "  compactions          %llu\n", (unsigned long long)stats.compactions);
  std::fprintf(stderr, "  engine               %u matmul thread%s (%s kernels, %s), "
                       "%u attention thread%s, K/V %s\n",
               engine.options().threads, engine.options().threads == 1 ? "" : "s",
               engine::kernels().name,
               args.engine.matmul == engine::MatmulMode::Quantized ? "q8 activations" : "exact",
               engine.kvgc_threads(), engine.kvgc_threads() == 1 ? "" : "s",
               args.engine.kv_dtype == KVGC_DTYPE_F16 ? "f16" : "f32");
  std::fprintf(stderr, "  time in kvgc         %.1f%%\n",
               total_s > 0 ? 100.0 * engine.kvgc_seconds() / total_s : 0.0);
  std::fprintf(stderr, "  prefill              %.1f tok/s (%.2f s)\n",
               prefill_s > 0 ? prompt.size() / prefill_s : 0.0, prefill_s);
  std::fprintf(stderr, "  decode               %.1f tok/s (%.2f s)\n",
               decode_s > 0 ? decode_steps / decode_s : 0.0, decode_s);
  return 0;
}

// Every failure ends with a message and a non-zero exit, exceptions included (an
// allocation the system refuses, say): never an abort.
int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "\nkvgc-run: out of memory\n");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "\nkvgc-run: %s\n", e.what());
  } catch (...) {
    std::fprintf(stderr, "\nkvgc-run: unexpected error\n");
  }
  return 1;
}
