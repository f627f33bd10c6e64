// kvgc-bench-serve: continuous batching (tools/engine/serve.hpp) into ONE fixed KV arena,
// the full cache against the bounded policies. A seeded stream of requests (prompts of
// prose, outputs of a drawn length, arriving at a fixed rate; every k-th a passkey buried
// in filler and asked back) is served once per configuration at the same arena bytes.
// Reported per configuration: max and mean concurrent sequences, tokens/s, queueing delay
// (mean, p95), passkey accuracy, preemptions. Ends with RESULT (ratios to the full cache
// first). Needs the downloaded model (tools/fetch-model.sh).
// --shared-prefix N: every request is one common N-token prefix (filler with passkey A)
// plus its own part (filler with its own passkey B) and asks for A (even requests) or B
// (odd); each configuration also runs as NAME+share (ServeOptions::prefix_cache: attach
// the cached prefix, prefill the rest), and RESULT leads with what pruning adds to sharing.
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "engine/batch_forward.hpp"
#include "engine/model.hpp"
#include "engine/serve.hpp"
#include "engine/tokenizer.hpp"
#include "gguf.hpp"
#include "quality_common.hpp"
#include "quality_tasks.hpp"

namespace {

using Clock = std::chrono::steady_clock;

struct Args {
  std::string model;
  uint32_t requests = 64;
  uint32_t prompt_min = 256, prompt_max = 4096;
  uint32_t output_min = 64, output_max = 512;
  double rate = 1.0;            // requests per second
  uint32_t passkey_every = 4;   // every k-th request is a passkey (0: none)
  uint64_t arena = 1ull << 30;  // bytes
  double fraction = 0.15;       // byte budget of the bounded configurations
  std::vector<std::string> configs = {"full", "default", "h2o", "streaming"};
  uint32_t threads = 2;
  uint32_t step_tokens = 256, chunk = 64, max_running = 256, max_prefilling = 0;
  uint64_t seed = 1;
  bool observe = true;          // --prefill observe (default) or stream
  uint32_t shared_prefix = 0;   // tokens of the common prefix (0: the mixed stream)
  uint32_t private_min = 128, private_max = 512;
  int prefix_charge = -1;       // --prefix-charge (-1: the heap's default)
  bool configs_given = false;
  std::string answers;          // --answers FILE: one line per request and configuration
};

void usage(FILE* out) {
  std::fprintf(out,
      "usage: kvgc-bench-serve [--model PATH] [--requests N] [--prompt-min N] [--prompt-max N]\n"
      "                        [--output-min N] [--output-max N] [--rate R] [--passkey-every K]\n"
      "                        [--arena BYTES] [--fraction F] [--configs LIST] [--threads N]\n"
      "                        [--step-tokens N] [--chunk N] [--max-running N] [--seed S]\n"
      "                        [--max-prefilling N]\n"
      "                        [--prefill observe|stream] [--shared-prefix N]\n"
      "                        [--private-min N] [--private-max N] [--prefix-charge C]\n"
      "                        [--answers FILE]\n"
      "  --requests N       requests in the stream (default 64)\n"
      "  --prompt-min/max   prompt tokens, drawn uniformly (default 256..4096)\n"
      "  --output-min/max   generated tokens, drawn uniformly (default 64..512)\n"
      "  --rate R           arrivals per second, fixed interval (default 1)\n"
      "  --passkey-every K  every K-th request is a passkey, 8 tokens answered (default 4; 0 none)\n"
      "  --arena BYTES      the KV arena of every configuration (K/M/G suffixes; default 1G)\n"
      "  --fraction F       byte budget of the bounded configurations, of the full cache's f16\n"
      "                     payload for the sequence's length, in (0, 1] (default 0.15)\n"
      "  --configs LIST     of full, default, h2o, streaming, generational, each optionally\n"
      "                     NAME+share (the prefix cache on) (default: the first four; with\n"
      "                     --shared-prefix: full, full+share, default, default+share)\n"
      "  --threads N        matmul threads (and kvgc attention threads) (default 2)\n"
      "  --step-tokens N    rows per engine step (default 256); --chunk N prompt tokens a\n"
      "                     sequence brings per step (default 64); --max-running N (default 256)\n"
      "  --max-prefilling N sequences in their prompt at once (0: no limit, the default)\n"
      "  --seed S           the stream's seed (default 1)\n"
      "  --prefill MODE     observe (default): prompt chunks unscored but their last 32 tokens,\n"
      "                     no GC until the prompt's end, then pooled scores and one step (as\n"
      "                     kvgc-run); stream: prompt chunks are scored batch rows, GC every step\n"
      "  --shared-prefix N  every request = one common prefix of about N tokens (filler, pass\n"
      "                     key A inside) + its own part (filler, its own pass key B), asking\n"
      "                     for A (even requests) or B (odd); outputs of the drawn length.\n"
      "                     Passkey accuracy is reported for A and B apart (+share needs observe)\n"
      "  --private-min/max  tokens of each request's own part (default 128..512)\n"
      "  --prefix-charge C  cache, view, prune or shrink: who pays for attached tokens in the\n"
      "                     bounded +share configurations (default: the heap's, cache)\n"
      "  --answers FILE     write each request's outcome, a tab-separated line per request\n"
      "                     and configuration: config, request, key (A, B or -), expected,\n"
      "                     correct, prompt tokens, attached, preemptions, the answer's start\n");
}

bool fail_flag(const std::string& flag, const std::string& value, const char* want) {
  std::fprintf(stderr, "kvgc-bench-serve: %s '%s': %s\n", flag.c_str(), value.c_str(), want);
  return false;
}

bool parse_u64(const std::string& s, uint64_t* out) {
  if (s.empty() || s[0] == '-') return false;
  char* end = nullptr;
  errno = 0;
  const unsigned long long v = std::strtoull(s.c_str(), &end, 10);
  if (errno != 0 || *end != '\0') return false;
  *out = v;
  return true;
}

bool parse_u32(const std::string& flag, const std::string& s, uint32_t min, uint32_t* out) {
  uint64_t v = 0;
  if (!parse_u64(s, &v) || v < min || v > 1000000000ull) {
    const std::string want = "expected an integer >= " + std::to_string(min);
    return fail_flag(flag, s, want.c_str());
  }
  *out = uint32_t(v);
  return true;
}

bool parse_double(const std::string& flag, const std::string& s, double lo, double hi,
                  bool lo_open, double* out) {
  char* end = nullptr;
  errno = 0;
  const double v = std::strtod(s.c_str(), &end);
  if (s.empty() || errno != 0 || *end != '\0' || !std::isfinite(v) || v > hi ||
      (lo_open ? v <= lo : v < lo)) {
    const std::string want = "expected a number in " + std::string(lo_open ? "(" : "[") +
                             std::to_string(lo) + ", " + std::to_string(hi) + "]";
    return fail_flag(flag, s, want.c_str());
  }
  *out = v;
  return true;
}

bool parse_bytes(const std::string& flag, const std::string& s, uint64_t* out) {
  std::string digits = s;
  uint64_t scale = 1;
  if (!digits.empty()) {
    const char c = char(std::toupper(static_cast<unsigned char>(digits.back())));
    if (c == 'K' || c == 'M' || c == 'G') {
      scale = c == 'K' ? 1ull << 10 : c == 'M' ? 1ull << 20 : 1ull << 30;
      digits.pop_back();
    }
  }
  uint64_t v = 0;
  if (!parse_u64(digits, &v) || v == 0 || v > (1ull << 44) / scale)
    return fail_flag(flag, s, "expected a size in bytes > 0 (suffix K, M or G allowed)");
  *out = v * scale;
  return true;
}

bool parse_args(int argc, char** argv, Args* a) {
  for (int i = 1; i < argc; ++i) {
    const std::string f = argv[i];
    if (f == "--help" || f == "-h") {
      usage(stdout);
      std::exit(0);
    }
    if (i + 1 >= argc) {
      std::fprintf(stderr, "kvgc-bench-serve: %s needs a value (or is unknown; see --help)\n",
                   f.c_str());
      return false;
    }
    const std::string v = argv[++i];
    bool ok = true;
    if (f == "--model") a->model = v;
    else if (f == "--requests") ok = parse_u32(f, v, 1, &a->requests);
    else if (f == "--prompt-min") ok = parse_u32(f, v, 1, &a->prompt_min);
    else if (f == "--prompt-max") ok = parse_u32(f, v, 1, &a->prompt_max);
    else if (f == "--output-min") ok = parse_u32(f, v, 1, &a->output_min);
    else if (f == "--output-max") ok = parse_u32(f, v, 1, &a->output_max);
    else if (f == "--rate") ok = parse_double(f, v, 0.0, 1e6, true, &a->rate);
    else if (f == "--passkey-every") ok = parse_u32(f, v, 0, &a->passkey_every);
    else if (f == "--arena") ok = parse_bytes(f, v, &a->arena);
    else if (f == "--fraction") ok = parse_double(f, v, 0.0, 1.0, true, &a->fraction);
    else if (f == "--prefix-charge") {
      a->prefix_charge = v == "cache" ? KVGC_PREFIX_CHARGE_CACHE : v == "view" ? KVGC_PREFIX_CHARGE_VIEW
                         : v == "prune" ? KVGC_PREFIX_CHARGE_PRUNE
                         : v == "shrink" ? KVGC_PREFIX_CHARGE_SHRINK : -1;
      ok = a->prefix_charge >= 0 || fail_flag(f, v, "cache, view, prune or shrink");
    }
    else if (f == "--threads") ok = parse_u32(f, v, 1, &a->threads) &&
                                    (a->threads <= 256 || fail_flag(f, v, "at most 256"));
    else if (f == "--step-tokens") ok = parse_u32(f, v, 1, &a->step_tokens);
    else if (f == "--chunk") ok = parse_u32(f, v, 1, &a->chunk);
    else if (f == "--max-running") ok = parse_u32(f, v, 1, &a->max_running);
    else if (f == "--max-prefilling") ok = parse_u32(f, v, 0, &a->max_prefilling);
    else if (f == "--shared-prefix") ok = parse_u32(f, v, 64, &a->shared_prefix);
    else if (f == "--private-min") ok = parse_u32(f, v, 32, &a->private_min);
    else if (f == "--private-max") ok = parse_u32(f, v, 32, &a->private_max);
    else if (f == "--answers") a->answers = v;
    else if (f == "--prefill") {
      if (v != "observe" && v != "stream") return fail_flag(f, v, "expected observe or stream");
      a->observe = v == "observe";
    } else if (f == "--seed") ok = parse_u64(v, &a->seed) || fail_flag(f, v, "expected an integer >= 0");
    else if (f == "--configs") {
      a->configs.clear();
      a->configs_given = true;
      size_t at = 0;
      while (at <= v.size()) {
        size_t end = v.find(',', at);
        if (end == std::string::npos) end = v.size();
        const std::string entry = v.substr(at, end - at);
        const bool share = entry.size() > 6 && entry.compare(entry.size() - 6, 6, "+share") == 0;
        const std::string name = share ? entry.substr(0, entry.size() - 6) : entry;
        if (name != "full" && name != "default" && name != "h2o" && name != "streaming" &&
            name != "generational")
          return fail_flag(f, v, ("unknown configuration '" + name +
                                  "' (known: full, default, h2o, streaming, generational)").c_str());
        a->configs.push_back(entry);
        at = end + 1;
      }
    } else {
      std::fprintf(stderr, "kvgc-bench-serve: unknown flag %s (see --help)\n", f.c_str());
      return false;
    }
    if (!ok) return false;
  }
  if (a->prompt_min > a->prompt_max)
    return fail_flag("--prompt-min", std::to_string(a->prompt_min), "is above --prompt-max");
  if (a->output_min > a->output_max)
    return fail_flag("--output-min", std::to_string(a->output_min), "is above --output-max");
  if (a->private_min > a->private_max)
    return fail_flag("--private-min", std::to_string(a->private_min), "is above --private-max");
  if (a->shared_prefix && !a->configs_given)
    a->configs = {"full", "full+share", "default", "default+share"};
  for (const std::string& c : a->configs)
    if (!a->observe && c.find("+share") != std::string::npos)
      return fail_flag("--configs", c, "+share (the prefix cache) needs --prefill observe");
  if (a->prompt_min < 64)
    return fail_flag("--prompt-min", std::to_string(a->prompt_min),
                     "a passkey prompt needs at least 64 tokens");
  return true;
}

// One configuration's heap options at the arena's bytes.
bool is_share(const std::string& config) {
  return config.size() > 6 && config.compare(config.size() - 6, 6, "+share") == 0;
}
std::string base_name(const std::string& config) {
  return is_share(config) ? config.substr(0, config.size() - 6) : config;
}

kvgc_heap_options heap_options(const std::string& config, const Args& a) {
  const std::string name = base_name(config);
  kvgc_heap_options o;
  kvgc_heap_options_init(&o);  // "default": what a user gets, plus the byte budget
  o.flags = KVGC_OPT_IGNORE_ENV;
  o.device = KVGC_DEVICE_CPU;
  o.budget_bytes = a.arena;
  o.cpu_threads = a.threads;
  if (name == "full") {
    o.policy = KVGC_POLICY_FULL;
    return o;
  }
  o.byte_budget_fraction = a.fraction;
  if (a.prefix_charge >= 0) o.prefix_charge = kvgc_prefix_charge(a.prefix_charge);
  if (name == "h2o" || name == "streaming" || name == "generational") {  // eviction only
    o.policy = name == "h2o" ? KVGC_POLICY_H2O
               : name == "streaming" ? KVGC_POLICY_STREAMING : KVGC_POLICY_GENERATIONAL;
    o.demote = KVGC_DEMOTE_OFF;
  }
  return o;
}

struct Stream {
  std::vector<engine::ServeRequest> requests;
  std::vector<std::string> expect;  // per request: the passkey, or "" for prose
  std::vector<int> key_kind;        // --shared-prefix: 0 the prefix's key, 1 the request's own
};

// The passkey filler of quality_tasks (Landmark Attention's), and its labelled keys.
constexpr const char* kIntro = quality::kPasskeyIntro;
constexpr const char* kFiller = quality::kPasskeyFiller;
constexpr const char* kPrefixKey = "38514";  // the red pass key, in the shared prefix

std::string key_sentence(const char* colour, const std::string& key) {
  return std::string("The ") + colour + " pass key is " + key + ". Remember it. " + key +
         " is the " + colour + " pass key. ";
}

// About `target` tokens (whole fillers) of filler with `sentence` at `depth`.
std::string filler_text(const engine::Tokenizer& tok, uint32_t target, const std::string& head,
                        const std::string& sentence, double depth) {
  const size_t fixed = tok.encode(head + sentence, false).size();
  const size_t per = tok.encode(kFiller, false).size();
  const size_t n = target > fixed ? std::max<size_t>(1, (target - fixed) / per) : 1;
  const size_t at = size_t(std::lround(depth * double(n)));
  std::string text = head;
  for (size_t i = 0; i <= n; ++i) {
    if (i == at) text += sentence;
    if (i < n) text += kFiller;
  }
  return text;
}

// --shared-prefix: one common prefix (the red key A inside), then per request its own
// filler with its own blue key B, and the question for A (even) or B (odd).
Stream make_shared_stream(const Args& a, const engine::Tokenizer& tok) {
  Stream s;
  std::mt19937_64 rng(a.seed);
  auto draw = [&](uint32_t lo, uint32_t hi) {
    return lo + uint32_t(rng() % (uint64_t(hi) - lo + 1));
  };
  const double prefix_depth = 0.2 + 0.6 * double(rng() % 1001) / 1000.0;
  const std::vector<int32_t> prefix = tok.encode(
      filler_text(tok, a.shared_prefix, kIntro, key_sentence("red", kPrefixKey), prefix_depth));
  for (uint32_t i = 0; i < a.requests; ++i) {
    engine::ServeRequest r;
    r.id = i;
    r.arrival = double(i) / a.rate;
    const uint32_t length = draw(a.private_min, a.private_max);
    const uint32_t output = draw(a.output_min, a.output_max);
    std::string key;
    do key = std::to_string(draw(10000, 99999)); while (key == kPrefixKey);
    const double depth = 0.1 + 0.8 * double(rng() % 1001) / 1000.0;
    const bool ask_prefix = i % 2 == 0;
    const char* colour = ask_prefix ? "red" : "blue";
    const std::string question = std::string("\nWhat is the ") + colour + " pass key? The " +
                                 colour + " pass key is";
    r.prompt = prefix;
    const std::vector<int32_t> own =
        tok.encode(filler_text(tok, length, "", key_sentence("blue", key), depth) + question, false);
    r.prompt.insert(r.prompt.end(), own.begin(), own.end());
    r.max_new = output;
    r.stop_at_eos = false;  // outputs of the drawn length; the key is looked for in them
    s.requests.push_back(std::move(r));
    s.expect.push_back(ask_prefix ? std::string(kPrefixKey) : key);
    s.key_kind.push_back(ask_prefix ? 0 : 1);
  }
  return s;
}

// The seeded request stream: the same for every configuration.
Stream make_stream(const Args& a, const engine::Tokenizer& tok, const std::vector<int32_t>& prose) {
  Stream s;
  std::mt19937_64 rng(a.seed);
  auto draw = [&](uint32_t lo, uint32_t hi) {
    return lo + uint32_t(rng() % (uint64_t(hi) - lo + 1));
  };
  for (uint32_t i = 0; i < a.requests; ++i) {
    engine::ServeRequest r;
    r.id = i;
    r.arrival = double(i) / a.rate;
    const uint32_t length = draw(a.prompt_min, a.prompt_max);
    const uint32_t output = draw(a.output_min, a.output_max);
    std::string expect;
    if (a.passkey_every != 0 && i % a.passkey_every == a.passkey_every - 1) {
      const double depth = 0.1 + 0.8 * double(rng() % 1001) / 1000.0;
      r.prompt = quality::passkey_prompt(tok, length, depth, &expect);
      r.max_new = 8;
      r.stop_at_eos = true;
    } else {
      const size_t offset = rng() % (prose.size() - 1);
      for (uint32_t t = 0; t < length; ++t) r.prompt.push_back(prose[(offset + t) % prose.size()]);
      r.max_new = output;
      r.stop_at_eos = false;  // outputs of the drawn length
    }
    s.requests.push_back(std::move(r));
    s.expect.push_back(expect);
  }
  return s;
}

struct Row {
  std::string name;
  uint32_t max_running = 0;
  double mean_running = 0;
  double loaded_running = 0;  // mean over the steps at which an arrived request waited
  double tokens_per_s = 0;      // generated tokens / s
  double rows_per_s = 0;        // all rows (prompt + decode) / s
  double queue_mean = 0, queue_p95 = 0;
  int passkey_correct = 0, passkey_total = 0;
  uint64_t preemptions = 0;
  uint32_t rejected = 0;
  double seconds = 0;
  double held_sum = 0, used_max = 0;  // bytes per running sequence (summed), peak bytes used
  double own_sum = 0;                 // the same less shared pages (each held once)
  uint64_t slabs_evacuated = 0, pages_migrated = 0;  // the heap's, over the run
  uint64_t pages_shrunk = 0, bytes_shrunk = 0;       // (KVGC_PREFIX_CHARGE=shrink)
  uint64_t held_samples = 0;
  double footprint_sum = 0;           // admission's estimate for each request's prompt
  int kind_correct[2] = {0, 0}, kind_total[2] = {0, 0};  // --shared-prefix: A, B
  uint64_t prefix_hits = 0, prefix_tokens = 0, prefix_keeps = 0, prefix_keep_failed = 0;
  uint64_t prompt_rows = 0;
  engine::ServeStats serve;           // the server's own counts (what admission waited on)
  double passkey() const { return passkey_total ? double(passkey_correct) / passkey_total : 0; }
  double kind(int k) const { return kind_total[k] ? double(kind_correct[k]) / kind_total[k] : 0; }
};

bool run_config(const std::string& config, const Args& a, const engine::Model& model,
                const engine::Tokenizer& tok, const std::vector<int32_t>& prose, FILE* answers,
                Row* row, std::string* err) {
  const std::string name = base_name(config);
  const kvgc_heap_options o = heap_options(config, a);
  engine::BatchEngine eng;
  engine::EngineOptions eo;
  eo.threads = a.threads;
  if (!eng.init(model, &o, err, eo)) return false;
  const kvgc_model_desc& kv = eng.kv_model();
  kvgc_heap_options eff;
  kvgc_heap_options_init(&eff);
  kvgc_heap_get_options(eng.heap(), &eff);
  engine::ServeOptions so;
  so.chunk_tokens = a.chunk;
  so.max_step_tokens = a.step_tokens;
  so.max_running = a.max_running;
  so.max_prefilling = a.max_prefilling;
  so.stop = quality::stop_tokens(tok);
  so.prefix_cache = is_share(config);
  // What a sequence of n tokens holds, the first `cached` paid by the prefix cache: the
  // full cache every page of the rest; a byte budget its share of the f16 payload for its
  // whole length (kvgc.h, kvgc_prefix_charge: spent on its own tokens; under prune, where
  // the budget is spent over the whole prompt and the attached part costs no byte, its
  // own tokens' share of it: the rate that budget gives them), or the tokens no GC removes
  // (sinks past the cached part, young window) if more, plus, while a stream prefill
  // brings its prompt, a step's chunk appended before the GC runs, in whole f16 pages;
  // never more than every page of its own.
  const bool bounded = name != "full";
  so.prefill = a.observe ? engine::Engine::PrefillMode::Observe
                         : engine::Engine::PrefillMode::Stream;
  // An observe prefill holds the whole prompt until its end.
  so.footprint = [&kv, &eff, bounded, &a](uint64_t n, uint64_t cached, bool prefilling) {
    const uint64_t own = n - cached, pt = eff.page_tokens;
    uint64_t full = 0, raw = 0, kept = 0, chunk = 0;
    kvgc_kv_bytes(&kv, own, KVGC_CLASS_FP16, pt, &full);
    if (!bounded || (prefilling && a.observe)) return full;
    kvgc_kv_bytes(&kv, (eff.prefix_charge == KVGC_PREFIX_CHARGE_PRUNE || eff.prefix_charge == KVGC_PREFIX_CHARGE_SHRINK) ? own : n, KVGC_CLASS_FP16, 0, &raw);
    const uint64_t protect =
        std::min<uint64_t>(own, eff.window + (eff.sinks > cached ? eff.sinks - cached : 0));
    kvgc_kv_bytes(&kv, protect, KVGC_CLASS_FP16, pt, &kept);
    // A stream prefill's chunk goes in before its GC runs; a decoding sequence adds a
    // token a step, which the server's page of headroom per sequence covers.
    if (prefilling) kvgc_kv_bytes(&kv, a.chunk, KVGC_CLASS_FP16, pt, &chunk);
    return std::min(full, std::max(uint64_t(a.fraction * double(raw)), kept) + chunk);
  };
  Stream stream = a.shared_prefix ? make_shared_stream(a, tok) : make_stream(a, tok, prose);
  engine::Server server(&eng, so);
  for (engine::ServeRequest& r : stream.requests)
    if (!server.submit(&r, err)) return false;
  // Wall clock, except that an idle server skips ahead to the next arrival.
  const Clock::time_point start = Clock::now();
  double skipped = 0;
  size_t next_arrival = 0;
  while (!server.idle()) {
    double now = std::chrono::duration<double>(Clock::now() - start).count() + skipped;
    while (next_arrival < stream.requests.size() && stream.requests[next_arrival].arrival <= now)
      ++next_arrival;
    if (server.running() == 0 && next_arrival < stream.requests.size() &&
        server.waiting() == stream.requests.size() - next_arrival) {
      skipped += stream.requests[next_arrival].arrival - now;
      now = stream.requests[next_arrival].arrival;
    }
    if (!server.step(now, err)) return false;
    // What the running sequences hold, against the footprint admission assumed.
    kvgc_stats hs;
    kvgc_stats_init(&hs);
    if (server.running() > 0 && kvgc_get_stats(eng.heap(), &hs) == KVGC_OK) {
      const double used = double(hs.arena_bytes - hs.scratch_bytes - hs.free_bytes);
      row->held_sum += used / double(server.running());
      row->own_sum += (used - double(hs.shared_bytes)) / double(server.running());
      row->used_max = std::max(row->used_max, used);
      ++row->held_samples;
    }
  }
  row->seconds = std::chrono::duration<double>(Clock::now() - start).count();
  {
    kvgc_stats hs;
    kvgc_stats_init(&hs);
    if (kvgc_get_stats(eng.heap(), &hs) == KVGC_OK) {
      row->slabs_evacuated = hs.slabs_evacuated;
      row->pages_migrated = hs.pages_migrated;
      row->pages_shrunk = hs.pages_shrunk;
      row->bytes_shrunk = hs.bytes_shrunk;
    }
  }
  const engine::ServeStats& st = server.stats();
  row->name = config;
  row->max_running = st.max_running;
  row->mean_running = st.mean_running();
  row->loaded_running = st.mean_running_loaded();
  row->tokens_per_s = double(st.generated_tokens) / row->seconds;
  row->rows_per_s = double(st.generated_tokens + st.prompt_tokens) / row->seconds;
  row->preemptions = st.preemptions;
  row->prefix_hits = st.prefix_hits;
  row->prefix_tokens = st.prefix_tokens_attached;
  row->prefix_keeps = st.prefix_keeps;
  row->prefix_keep_failed = st.prefix_keep_failed;
  row->prompt_rows = st.prompt_tokens;
  row->serve = st;
  std::vector<double> delays;
  for (size_t i = 0; i < stream.requests.size(); ++i) {
    const engine::ServeRequest& r = stream.requests[i];
    row->footprint_sum += double(so.footprint(r.prompt.size() + 1, 0, false));
    if (!r.error.empty()) {
      ++row->rejected;
      std::fprintf(stderr, "  %s: request %zu refused: %s\n", config.c_str(), i, r.error.c_str());
      continue;
    }
    delays.push_back(r.admitted - r.arrival);
    const std::string answer = quality::lower(tok.decode(r.output));
    const bool correct = !stream.expect[i].empty() && answer.find(stream.expect[i]) != std::string::npos;
    if (answers) {
      std::string start = answer.substr(0, 48);
      for (char& c : start)
        if (c == '\t' || c == '\n' || c == '\r') c = ' ';
      const char* key = stream.key_kind.empty() ? (stream.expect[i].empty() ? "-" : "K")
                                                : stream.key_kind[i] == 0 ? "A" : "B";
      std::fprintf(answers, "%s\t%zu\t%s\t%s\t%d\t%zu\t%llu\t%u\t%s\n", config.c_str(), i, key,
                   stream.expect[i].empty() ? "-" : stream.expect[i].c_str(), int(correct),
                   r.prompt.size(), (unsigned long long)r.attached, r.preemptions, start.c_str());
    }
    if (!stream.expect[i].empty()) {
      ++row->passkey_total;
      row->passkey_correct += correct;
      if (!stream.key_kind.empty()) {
        ++row->kind_total[stream.key_kind[i]];
        row->kind_correct[stream.key_kind[i]] += correct;
      }
    }
  }
  std::sort(delays.begin(), delays.end());
  if (!delays.empty()) {
    double sum = 0;
    for (const double d : delays) sum += d;
    row->queue_mean = sum / double(delays.size());
    row->queue_p95 = delays[std::min(delays.size() - 1, size_t(std::ceil(0.95 * delays.size())) - 1)];
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  if (!parse_args(argc, argv, &a)) return 2;
  if (a.model.empty()) a.model = engine::default_model_path();
  std::string err;
  gguf::File file;
  engine::Model model;
  engine::Tokenizer tok;
  if (!file.open(a.model, &err) || !engine::load_model(file, &model, &err) ||
      !tok.load(file, &err)) {
    std::fprintf(stderr, "kvgc-bench-serve: --model %s: %s (tools/fetch-model.sh fetches it)\n",
                 a.model.c_str(), err.c_str());
    return 1;
  }
  std::vector<int32_t> prose;
  for (const char* f : {"/jargon-intro.txt", "/debian-policy.txt"}) {
    std::string text;
    if (!quality::read_text(std::string(KVGC_QUALITY_DATA_DIR) + f, &text, &err)) {
      std::fprintf(stderr, "kvgc-bench-serve: %s\n", err.c_str());
      return 1;
    }
    const std::vector<int32_t> ids = tok.encode(text, false);
    prose.insert(prose.end(), ids.begin(), ids.end());
  }
  std::printf("kvgc-bench-serve: %u requests, prompts %u..%u, outputs %u..%u, %.3g/s, passkey "
              "every %u, arena %.1f MiB, bounded configs at %.3g of the f16 bytes, %u threads, "
              "step %u rows, chunk %u, seed %llu, %s prefill\n",
              a.requests, a.prompt_min, a.prompt_max, a.output_min, a.output_max, a.rate,
              a.passkey_every, double(a.arena) / (1 << 20), a.fraction, a.threads,
              a.step_tokens, a.chunk, (unsigned long long)a.seed, a.observe ? "observe" : "stream");
  if (a.shared_prefix)
    std::printf("  shared prefix of %u tokens (pass key A inside), own parts %u..%u tokens (pass "
                "key B), A asked by even requests, B by odd; outputs %u..%u\n",
                a.shared_prefix, a.private_min, a.private_max, a.output_min, a.output_max);
  FILE* answers = nullptr;
  if (!a.answers.empty()) {
    answers = std::fopen(a.answers.c_str(), "w");
    if (!answers) {
      std::fprintf(stderr, "kvgc-bench-serve: --answers %s: %s\n", a.answers.c_str(),
                   std::strerror(errno));
      return 2;
    }
    std::fprintf(answers, "config\trequest\tkey\texpected\tcorrect\tprompt\tattached\tpreemptions\tanswer\n");
  }
  std::vector<Row> rows;
  for (const std::string& name : a.configs) {
    Row row;
    const bool ran = run_config(name, a, model, tok, prose, answers, &row, &err);
    if (answers) std::fflush(answers);  // a run stopped later keeps the configurations done
    if (!ran) {
      if (answers) std::fclose(answers);
      std::fprintf(stderr, "kvgc-bench-serve: %s: %s\n", name.c_str(), err.c_str());
      return 1;
    }
    // Its figures at once (stderr is unbuffered): a run stopped before the table below
    // keeps the configurations it finished.
    std::fprintf(stderr,
                 "  %s done in %.1f s: max_seq %u, mean_seq %.2f, load_seq %.2f, passkey %d/%d, preempt %llu, "
                 "MiB/seq %.2f, peak MiB %.1f, gen_tok/s %.1f, slabs evacuated %llu (%llu pages), "
                 "shared pages shrunk %llu (%.1f MiB)\n",
                 name.c_str(), row.seconds, row.max_running, row.mean_running, row.loaded_running,
                 row.passkey_correct,
                 row.passkey_total, (unsigned long long)row.preemptions,
                 row.held_samples ? row.held_sum / double(row.held_samples) / (1 << 20) : 0.0,
                 row.used_max / (1 << 20), row.tokens_per_s,
                 (unsigned long long)row.slabs_evacuated, (unsigned long long)row.pages_migrated,
                 (unsigned long long)row.pages_shrunk, double(row.bytes_shrunk) / (1 << 20));
    rows.push_back(row);
  }
  std::printf("\n%-12s %8s %9s %9s %9s %10s %9s %9s %8s %8s %9s %9s %9s %8s\n", "config",
              "max_seq", "mean_seq", "gen_tok/s", "rows/s", "queue_s", "queue_p95", "passkey",
              "preempt", "refused", "MiB/seq", "own/seq", "est/seq", "peakMiB");
  for (const Row& r : rows) {
    std::printf("%-12s %8u %9.2f %9.1f %9.1f %10.2f %9.2f %5d/%-3d %8llu %8u %9.2f %9.2f %9.2f %8.1f\n",
                r.name.c_str(), r.max_running, r.mean_running, r.tokens_per_s, r.rows_per_s,
                r.queue_mean, r.queue_p95, r.passkey_correct, r.passkey_total,
                (unsigned long long)r.preemptions, r.rejected,
                r.held_samples ? r.held_sum / double(r.held_samples) / (1 << 20) : 0.0,
                r.held_samples ? r.own_sum / double(r.held_samples) / (1 << 20) : 0.0,
                r.footprint_sum / double(a.requests) / (1 << 20), r.used_max / (1 << 20));
  }
  std::printf("(max_seq, mean_seq: sequences in the heap per engine step; gen_tok/s: generated "
              "tokens per second, rows/s with the prompt rows; queue: arrival to first "
              "admission; MiB/seq: pages held per running sequence, mean over steps; own/seq: "
              "the same less the shared pages (held once, by the cache and holders); est/seq: "
              "admission's estimate for a prompt, mean over requests)\n");
  // What bounds concurrency: at the steps where the queue's head waited for room, what the
  // arena was projected to hold.
  std::printf("\nWhen the queue's head waited for room (mean over those steps, MiB of %.1f):\n",
              double(a.arena) / (1 << 20));
  std::printf("%-16s %8s %14s %14s %12s\n", "config", "waits", "mid-prompt", "decoding",
              "head needs");
  for (const Row& r : rows) {
    const engine::ServeStats& s = r.serve;
    const double n = s.waits_for_room ? double(s.waits_for_room) * (1 << 20) : 1.0;
    std::printf("%-16s %8llu %14.2f %14.2f %12.2f\n", r.name.c_str(),
                (unsigned long long)s.waits_for_room, s.wait_prefill_bytes / n,
                s.wait_decode_bytes / n, s.wait_head_bytes / n);
  }
  std::printf("(mid-prompt: sequences still in their prompt, held whole until its end under the "
              "observe prefill; decoding: the others, at their projected bytes)\n");
  // RESULT: ratios of "default" to "full" first, then every row's figures.
  const Row* full = nullptr;
  const Row* def = nullptr;
  const Row* full_share = nullptr;
  const Row* def_share = nullptr;
  for (const Row& r : rows) {
    if (r.name == "full") full = &r;
    if (r.name == "default") def = &r;
    if (r.name == "full+share") full_share = &r;
    if (r.name == "default+share") def_share = &r;
  }
  std::string result = "RESULT";
  char buf[512];
  if (a.shared_prefix) {
    std::printf("\n%-16s %8s %9s %9s %9s %11s %11s %6s %10s %10s\n", "config", "max_seq",
                "mean_seq", "load_seq", "gen_tok/s", "prompt_rows", "attached", "keeps",
                "passkey_A", "passkey_B");
    for (const Row& r : rows)
      std::printf("%-16s %8u %9.2f %9.2f %9.1f %11llu %11llu %6llu %6d/%-3d %6d/%-3d\n", r.name.c_str(),
                  r.max_running, r.mean_running, r.loaded_running, r.tokens_per_s,
                  (unsigned long long)r.prompt_rows, (unsigned long long)r.prefix_tokens,
                  (unsigned long long)r.prefix_keeps, r.kind_correct[0], r.kind_total[0],
                  r.kind_correct[1], r.kind_total[1]);
    std::printf("(load_seq: mean_seq over the steps at which an arrived request waited, what "
                "the arena sustains under load; prompt_rows: prompt rows prefilled, recomputation "
                "included; attached: prompt tokens attached from the prefix cache instead; "
                "passkey_A: the shared prefix's key, passkey_B: each request's own)\n");
    auto ratio = [](double x, double y, char* out, size_t n) {
      if (y > 0) std::snprintf(out, n, "%.3f", x / y);
      else std::snprintf(out, n, "na");
    };
    if (def_share && (full_share || def)) {
      // What pruning adds to sharing: default+share against the better of the two alone.
      const double best_mean = std::max(full_share ? full_share->mean_running : 0.0,
                                        def ? def->mean_running : 0.0);
      const double best_max = std::max(full_share ? double(full_share->max_running) : 0.0,
                                       def ? double(def->max_running) : 0.0);
      const double best_loaded = std::max(full_share ? full_share->loaded_running : 0.0,
                                          def ? def->loaded_running : 0.0);
      char mean_r[32], max_r[32], loaded_r[32];
      ratio(def_share->mean_running, best_mean, mean_r, sizeof mean_r);
      ratio(double(def_share->max_running), best_max, max_r, sizeof max_r);
      ratio(def_share->loaded_running, best_loaded, loaded_r, sizeof loaded_r);
      std::snprintf(buf, sizeof buf,
                    " share_prune_vs_best_alone=%s share_prune_max_vs_best_alone=%s"
                    " share_prune_loaded_vs_best_alone=%s",
                    mean_r, max_r, loaded_r);
      result += buf;
    }
    if (full) {  // passkey accuracy per key kind, against the full cache
      for (const Row& r : rows) {
        if (&r == full) continue;
        char ra[32], rb[32];
        ratio(r.kind(0), full->kind(0), ra, sizeof ra);
        ratio(r.kind(1), full->kind(1), rb, sizeof rb);
        const std::string k = quality::key_name(r.name);
        std::snprintf(buf, sizeof buf, " %s_prefix_key_ratio=%s %s_private_key_ratio=%s",
                      k.c_str(), ra, k.c_str(), rb);
        result += buf;
      }
    }
    for (const Row& r : rows) {
      const std::string k = quality::key_name(r.name);
      std::snprintf(buf, sizeof buf, " %s_passkey_a=%d/%d %s_passkey_b=%d/%d %s_attached=%llu",
                    k.c_str(), r.kind_correct[0], r.kind_total[0], k.c_str(), r.kind_correct[1],
                    r.kind_total[1], k.c_str(), (unsigned long long)r.prefix_tokens);
      result += buf;
    }
  }
  if (full && def) {
    char passkey_ratio[32] = "na";  // when the full cache got none right (or none ran)
    if (full->passkey() > 0)
      std::snprintf(passkey_ratio, sizeof passkey_ratio, "%.3f", def->passkey() / full->passkey());
    std::snprintf(buf, sizeof buf,
                  " concurrency_ratio=%.3f mean_concurrency_ratio=%.3f passkey_ratio=%s "
                  "tokens_per_s_ratio=%.3f",
                  full->max_running ? double(def->max_running) / full->max_running : 0.0,
                  full->mean_running > 0 ? def->mean_running / full->mean_running : 0.0,
                  passkey_ratio,
                  full->tokens_per_s > 0 ? def->tokens_per_s / full->tokens_per_s : 0.0);
    result += buf;
  }
  for (const Row& r : rows) {
    const std::string k = quality::key_name(r.name);
    std::snprintf(buf, sizeof buf,
                  " %s_max_seqs=%u %s_mean_seqs=%.2f %s_loaded_seqs=%.2f %s_tok_s=%.1f "
                  "%s_queue_mean_s=%.2f %s_queue_p95_s=%.2f %s_passkey=%d/%d %s_preemptions=%llu",
                  k.c_str(), r.max_running, k.c_str(), r.mean_running, k.c_str(), r.loaded_running,
                  k.c_str(), r.tokens_per_s,
                  k.c_str(), r.queue_mean, k.c_str(), r.queue_p95, k.c_str(), r.passkey_correct,
                  r.passkey_total, k.c_str(), (unsigned long long)r.preemptions);
    result += buf;
  }
  std::printf("%s\n", result.c_str());
  if (answers && std::fclose(answers) != 0) {
    std::fprintf(stderr, "kvgc-bench-serve: --answers %s: %s\n", a.answers.c_str(), std::strerror(errno));
    return 1;
  }
  return 0;
}
