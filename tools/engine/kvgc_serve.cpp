// kvgc-serve: kvgc-run's sibling for many prompts at once. Reads FILE (one prompt a line;
// empty lines skipped), serves every prompt through continuous batching over one kvgc
// heap (tools/engine/serve.hpp: chunked prefill mixed with decode rows, one batch plan
// per step, preemption when the arena is full), and prints each answer, in the file's
// order, then what the scheduler did. The cache policy and the arena come from KVGC_*
// (KVGC_POLICY, KVGC_BUDGET, KVGC_BYTE_BUDGET, ...), as for kvgc-run.
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "engine/batch_forward.hpp"
#include "engine/model.hpp"
#include "engine/prompt_file.hpp"
#include "engine/serve.hpp"
#include "engine/thread_pool.hpp"
#include "engine/tokenizer.hpp"
#include "gguf.hpp"

namespace {

void usage(FILE* out) {
  std::fprintf(out,
      "usage: kvgc-serve FILE [--model PATH] [--chat] [--max-tokens N] [--ignore-eos]\n"
      "                  [--threads N] [--step-tokens N] [--chunk N] [--max-running N]\n"
      "                  [--max-prefilling N] [--prefill observe|stream] [--prefix-cache]\n"
      "                  [--pool-radius N] [--key-prior W]\n"
      "  FILE            prompts, one a line (empty lines skipped); at most 64 MiB\n"
      "  --model PATH    GGUF file (default: $KVGC_MODEL, else ~/.cache/kvgc/%s)\n"
      "  --chat          wrap each prompt in the model's ChatML template\n"
      "  --max-tokens N  tokens to generate per prompt at most (default 64)\n"
      "  --ignore-eos    generate --max-tokens tokens even past an end token\n"
      "  --threads N     matmul threads (default: the CPUs this process may run on)\n"
      "  --step-tokens N rows per engine step (default 256)\n"
      "  --chunk N       prompt tokens a sequence brings per step (default 64)\n"
      "  --max-running N sequences in the heap at most (default 256)\n"
      "  --max-prefilling N  sequences in their prompt at once (default 0: no limit)\n"
      "  --prefill MODE  observe (default, as kvgc-run): a prompt's chunks unscored but its\n"
      "                  last 32 tokens, one GC at its end; stream: chunks are scored batch\n"
      "                  rows, GC every step\n"
      "  --pool-radius N the observe prefill's score pooling, as kvgc-run's (default %u)\n"
      "  --key-prior W   the observe prefill's key-diversity prior, as kvgc-run's (default 0)\n"
      "  --prefix-cache  the prefix cache (observe prefill only): a prompt attaches the longest\n"
      "                  cached prefix of an earlier one and prefills the rest; every prompt is\n"
      "                  kept once in (who pays: KVGC_PREFIX_CHARGE, default cache)\n"
      "Greedy decoding. The KV cache policy and arena come from KVGC_* variables.\n",
      engine::kDefaultModelFile, engine::kDefaultPoolRadius);
}

bool parse_count(const std::string& flag, const char* v, uint64_t lo, uint64_t hi, uint32_t* out) {
  char* end = nullptr;
  errno = 0;
  const unsigned long long n = v && *v >= '0' && *v <= '9' ? std::strtoull(v, &end, 10) : 0;
  if (!v || !end || *end != '\0' || errno != 0 || n < lo || n > hi) {
    std::fprintf(stderr, "kvgc-serve: %s must be a whole number in %llu..%llu, not '%s'\n",
                 flag.c_str(), (unsigned long long)lo, (unsigned long long)hi, v ? v : "");
    return false;
  }
  *out = uint32_t(n);
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  std::string file_path, model_path;
  bool chat = false, ignore_eos = false;
  uint32_t max_tokens = 64, threads = engine::ThreadPool::available_cpus();
  uint32_t pool_radius = engine::kDefaultPoolRadius;
  float key_prior = 0.0f;
  engine::ServeOptions so;
  so.prefill = engine::Engine::PrefillMode::Observe;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const char* v = i + 1 < argc ? argv[i + 1] : nullptr;
    bool ok = true;
    if (a == "--help" || a == "-h") {
      usage(stdout);
      return 0;
    } else if (a == "--chat") {
      chat = true;
      continue;
    } else if (a == "--ignore-eos") {
      ignore_eos = true;
      continue;
    } else if (a == "--prefix-cache") {
      so.prefix_cache = true;
      continue;
    } else if (a == "--prefill" && v && (std::string(v) == "observe" || std::string(v) == "stream")) {
      so.prefill = std::string(v) == "observe" ? engine::Engine::PrefillMode::Observe
                                               : engine::Engine::PrefillMode::Stream;
    } else if (a == "--prefill") {
      std::fprintf(stderr, "kvgc-serve: --prefill must be observe or stream, not '%s'\n",
                   v ? v : "");
      return 2;
    } else if (a == "--model" && v) {
      model_path = v;
    } else if (a == "--max-tokens") {
      ok = parse_count(a, v, 1, UINT32_MAX, &max_tokens);
    } else if (a == "--threads") {
      ok = parse_count(a, v, 1, 1024, &threads);
    } else if (a == "--step-tokens") {
      ok = parse_count(a, v, 1, 1u << 20, &so.max_step_tokens);
    } else if (a == "--chunk") {
      ok = parse_count(a, v, 1, 1u << 20, &so.chunk_tokens);
    } else if (a == "--max-running") {
      ok = parse_count(a, v, 1, 1u << 20, &so.max_running);
    } else if (a == "--max-prefilling") {
      ok = parse_count(a, v, 0, 1u << 20, &so.max_prefilling);
    } else if (a == "--pool-radius") {
      ok = parse_count(a, v, 0, engine::kMaxPoolRadius, &pool_radius);
    } else if (a == "--key-prior") {
      char* end = nullptr;
      key_prior = v ? std::strtof(v, &end) : -1.0f;
      ok = v && end != v && *end == '\0' && std::isfinite(key_prior) && key_prior >= 0;
      if (!ok)
        std::fprintf(stderr, "kvgc-serve: --key-prior must be a finite weight >= 0, not '%s'\n",
                     v ? v : "");
    } else if (a.rfind("--", 0) != 0 && file_path.empty()) {
      file_path = a;
      continue;
    } else {
      std::fprintf(stderr, "kvgc-serve: unknown or incomplete argument '%s'\n", a.c_str());
      usage(stderr);
      return 2;
    }
    if (!ok) return 2;
    ++i;
  }
  if (so.prefix_cache && so.prefill != engine::Engine::PrefillMode::Observe) {
    std::fprintf(stderr, "kvgc-serve: --prefix-cache needs --prefill observe (a stream "
                         "prefill's GC ranks a prompt before it is in, so it cannot be kept)\n");
    return 2;
  }
  if (file_path.empty()) {
    std::fprintf(stderr, "kvgc-serve: FILE (prompts, one a line) is missing\n");
    usage(stderr);
    return 2;
  }
  std::string text, why;
  if (!engine::read_prompt_file(file_path, &text, &why)) {  // bounded: kvgc-serve /dev/zero
    std::fprintf(stderr, "kvgc-serve: FILE %s\n", why.c_str());
    return 2;
  }
  std::vector<std::string> prompts;
  for (size_t at = 0; at < text.size();) {
    size_t end = text.find('\n', at);
    if (end == std::string::npos) end = text.size();
    if (end > at) prompts.emplace_back(text, at, end - at);
    at = end + 1;
  }
  text.clear();
  text.shrink_to_fit();
  if (prompts.empty()) {
    std::fprintf(stderr, "kvgc-serve: FILE '%s' holds no prompt\n", file_path.c_str());
    return 2;
  }
  if (model_path.empty()) model_path = engine::default_model_path();
  std::string err;
  gguf::File file;
  engine::Model model;
  engine::Tokenizer tok;
  if (!file.open(model_path, &err) || !engine::load_model(file, &model, &err) ||
      !tok.load(file, &err)) {
    std::fprintf(stderr, "kvgc-serve: --model %s: %s\n", model_path.c_str(), err.c_str());
    return 1;
  }
  engine::BatchEngine eng;
  engine::EngineOptions eo;
  eo.threads = threads;
  eo.pool_radius = pool_radius;
  eo.key_prior = key_prior;
  if (!eng.init(model, nullptr, &err, eo)) {  // kvgc's defaults, then KVGC_*
    std::fprintf(stderr, "kvgc-serve: %s\n", err.c_str());
    return 1;
  }
  for (const char* stop : {"<|im_end|>", "<|endoftext|>"})
    if (tok.find(stop) >= 0) so.stop.push_back(tok.find(stop));
  if (tok.eos() >= 0) so.stop.push_back(tok.eos());
  std::vector<engine::ServeRequest> requests(prompts.size());
  engine::Server server(&eng, so);
  for (size_t i = 0; i < prompts.size(); ++i) {
    requests[i].id = i;
    requests[i].prompt = tok.encode(
        chat ? engine::apply_chat_template({{"user", prompts[i]}}, true) : prompts[i]);
    requests[i].max_new = max_tokens;
    requests[i].stop_at_eos = !ignore_eos;
    if (!server.submit(&requests[i], &err)) {
      std::fprintf(stderr, "kvgc-serve: FILE line %zu: %s\n", i + 1, err.c_str());
      return 1;
    }
  }
  const auto start = std::chrono::steady_clock::now();
  auto now = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  while (!server.idle()) {
    if (!server.step(now(), &err)) {
      std::fprintf(stderr, "kvgc-serve: %s\n", err.c_str());
      return 1;
    }
  }
  const double seconds = now();
  int refused = 0;
  for (const engine::ServeRequest& r : requests) {
    if (!r.error.empty()) {
      ++refused;
      std::printf("[%llu] refused: %s\n", (unsigned long long)r.id, r.error.c_str());
      continue;
    }
    std::string text = tok.decode(r.output);
    for (char& c : text)
      if (c == '\n') c = ' ';
    std::printf("[%llu] %s\n", (unsigned long long)r.id, text.c_str());
  }
  const engine::ServeStats& st = server.stats();
  std::fprintf(stderr,
               "kvgc-serve: %zu prompts in %.2f s: %llu steps, %u sequences at most (%.2f mean), "
               "%llu prompt rows, %llu generated tokens (%.1f tok/s), %llu preemptions, %d "
               "refused\n",
               prompts.size(), seconds, (unsigned long long)st.steps, st.max_running,
               st.mean_running(), (unsigned long long)st.prompt_tokens,
               (unsigned long long)st.generated_tokens, double(st.generated_tokens) / seconds,
               (unsigned long long)st.preemptions, refused);
  if (so.prefix_cache)
    std::fprintf(stderr,
                 "kvgc-serve: prefix cache: %llu of %llu admissions attached (%llu prompt rows "
                 "skipped), %llu prompts kept, %llu keeps refused\n",
                 (unsigned long long)st.prefix_hits, (unsigned long long)st.prefix_lookups,
                 (unsigned long long)st.prefix_tokens_attached,
                 (unsigned long long)st.prefix_keeps, (unsigned long long)st.prefix_keep_failed);
  return refused ? 1 : 0;
}
