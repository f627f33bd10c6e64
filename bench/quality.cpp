// kvgc-bench-quality: how much each kvgc cache configuration costs in model quality per
// byte of KV memory, measured on the real model (SmolLM2-135M-Instruct through the
// reference engine), on the same token ids the anchors (bench/anchors/) read.
//
//   Retrieval (bench/quality_retrieval.cpp, prompts in bench/quality_tasks.cpp): passkey
//   (5 digits; also with stream prefill), passkey-word, multikey (three keys, one asked),
//   needle (Jargon File), needle2 (Debian Policy Manual), kinds (three texts x three key
//   formats, bench/quality_kinds.cpp), kinds-after (the same prompts, the question read
//   after the context is compressed). One observe prefill per prompt (of the context),
//   replayed into every configuration's heap (bench/quality_replay.hpp).
//   Perplexity (bench/quality_perplexity.cpp): streaming, cache bounded to 256 / 512
//   tokens; and prefix perplexity (a compressed prefix, then its continuation scored), the
//   protocol the anchors share.
//   Privacy (bench/quality_privacy.cpp): score noise against a cache-timing attacker.
//
// Every configuration gets its own heap, created with explicit options (ignoring the
// KVGC_* environment) on the CPU. Tables go to stdout, per-run lines to stderr, every run
// as a JSON line to --results, data files and plots to --out.

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "gguf.hpp"
#include "quality_common.hpp"
#include "quality_report.hpp"
#include "quality_tasks.hpp"

namespace {

using namespace quality;

struct Args {
  std::string model;
  std::string text = std::string(KVGC_QUALITY_DATA_DIR) + "/" + kDefaultText + ".txt";
  std::string text2 = std::string(KVGC_QUALITY_DATA_DIR) + "/debian-policy.txt";
  std::string out = KVGC_QUALITY_OUT_DIR;
  std::string results, export_path;
  bool full = false, plots = true, observe_only = false, check_replay = false;
  unsigned jobs = 2;
  size_t prompts = 0;
  std::vector<uint32_t> contexts;
  std::vector<double> depths, fractions;
  std::vector<uint32_t> offsets;
  std::vector<std::string> configs;
  std::vector<std::string> parts;  // retrieval task names, perplexity, ppl-prefix, privacy
};

const std::vector<std::string>& known_parts() {
  static const std::vector<std::string> parts = [] {
    std::vector<std::string> p = retrieval_task_names();
    for (const char* x : {"perplexity", "ppl-prefix", "privacy"}) p.push_back(x);
    return p;
  }();
  return parts;
}

void usage(FILE* out) {
  std::string parts;
  for (const std::string& p : known_parts()) parts += " " + p;
  std::fprintf(out,
      "usage: kvgc-bench-quality [--quick|--full] [--only PART]... [--configs NAME,...]\n"
      "         [--fractions F,F] [--contexts N,N] [--depths D,D] [--offsets N,N]\n"
      "         [--prompts N]\n"
      "         [--observe-only]\n"
      "         [--check-replay] [--export FILE] [--results FILE] [--model PATH]\n"
      "         [--text FILE] [--text2 FILE] [--out DIR] [--jobs N] [--no-plots]\n"
      "  --quick        (default) ~1K-token prompts at 3 depths, 1K scored tokens\n"
      "  --full         1K/2K/4K prompts x 9 depths for every retrieval task, 4K scored\n"
      "                 tokens, 1K/2K/4K prefixes\n"
      "  --only PART    run only this part (repeatable; 'retrieval' = every retrieval task):\n"
      "                %s\n"
      "  --configs N,N  only these configurations (full is always measured); names as in\n"
      "                 the tables, e.g. h2o,generational+int4; env@bytes: the library's\n"
      "                 defaults with this process's KVGC_* variables (a sweep)\n"
      "  --fractions F  budgets as fractions (default 0.1,0.2,0.5): of the prompt's tokens\n"
      "                 for [tokens] rows, of its f16 full-cache bytes for [bytes] rows\n"
      "  --contexts N,N retrieval prompt / ppl-prefix prefix lengths (replace the mode's;\n"
      "                 the streaming perplexity part ignores it)\n"
      "  --depths D,D   retrieval depths in 0..1 (replace the mode's; kinds spreads its own\n"
      "                 over 0.05..0.95)\n"
      "  --prompts N    kinds, kinds-after: prompts per cell (text x key format) and\n"
      "                 length (default 3, --full 20; quick ~1K tokens, full ~4K and ~8K)\n"
      "  --offsets N,N  ppl-prefix: where in the text each prefix starts, in tokens\n"
      "                 (default 0,6144)\n"
      "  --observe-only no stream-prefill rows (the passkey's; each costs a prefill)\n"
      "  --check-replay also prefill every configuration afresh and compare its cache and\n"
      "                 answer with the replayed one (exit 1 on a difference)\n"
      "  --export FILE  write the selected tasks' prompts as token ids (JSON lines, for\n"
      "                 bench/anchors/) and exit\n"
      "  --results FILE every run as a JSON line (default OUT/MODE-results.jsonl)\n"
      "  --model PATH   GGUF file (default: $KVGC_MODEL, else ~/.cache/kvgc/%s)\n"
      "  --text FILE    prose for the needle and perplexity parts (default jargon-intro.txt)\n"
      "  --text2 FILE   the second haystack, needle2 (default debian-policy.txt)\n"
      "  --out DIR      data files, plots (default %s); names start with quick- or full-\n"
      "  --jobs N       engines side by side, one matmul thread each (default 2)\n"
      "  --no-plots     do not run gnuplot\n",
      parts.c_str(), engine::kDefaultModelFile, KVGC_QUALITY_OUT_DIR);
}

template <typename T>
bool parse_list(const char* v, std::vector<T>* out) {
  std::string list = v;
  for (char& c : list) c = c == ',' ? ' ' : c;
  std::istringstream in(list);
  out->clear();
  for (std::string word; in >> word;) {
    char* end = nullptr;
    const double x = std::strtod(word.c_str(), &end);
    if (*end != '\0' || !std::isfinite(x) || x < 0) return false;
    out->push_back(T(x));
  }
  return !out->empty();
}

bool parse_args(int argc, char** argv, Args* args) {
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&]() -> const char* { return i + 1 < argc ? argv[++i] : nullptr; };
    const char* v = nullptr;
    bool ok = true;
    if (arg == "--help" || arg == "-h") {
      usage(stdout);
      std::exit(0);
    } else if (arg == "--full" || arg == "--quick") {
      args->full = arg == "--full";
    } else if (arg == "--no-plots") {
      args->plots = false;
    } else if (arg == "--observe-only") {
      args->observe_only = true;
    } else if (arg == "--check-replay") {
      args->check_replay = true;
    } else if (arg == "--model" && (v = value())) {
      args->model = v;
    } else if (arg == "--text" && (v = value())) {
      args->text = v;
    } else if (arg == "--text2" && (v = value())) {
      args->text2 = v;
    } else if (arg == "--out" && (v = value())) {
      args->out = v;
    } else if (arg == "--results" && (v = value())) {
      args->results = v;
    } else if (arg == "--export" && (v = value())) {
      args->export_path = v;
    } else if (arg == "--jobs" && (v = value())) {
      ok = std::atoi(v) > 0;
      args->jobs = unsigned(std::atoi(v));
    } else if (arg == "--contexts" && (v = value())) {
      ok = parse_list(v, &args->contexts);
      for (const uint32_t c : args->contexts) ok = ok && c >= 64;
    } else if (arg == "--depths" && (v = value())) {
      ok = parse_list(v, &args->depths);
      for (const double d : args->depths) ok = ok && d <= 1;
    } else if (arg == "--prompts" && (v = value())) {
      ok = std::atoi(v) > 0;
      args->prompts = size_t(std::max(0, std::atoi(v)));
    } else if (arg == "--offsets" && (v = value())) {
      ok = parse_list(v, &args->offsets);
    } else if (arg == "--fractions" && (v = value())) {
      ok = parse_list(v, &args->fractions);
      for (const double f : args->fractions) ok = ok && f > 0 && f <= 1;
    } else if (arg == "--configs" && (v = value())) {
      std::string list = v;
      for (char& c : list) c = c == ',' ? ' ' : c;
      std::istringstream in(list);
      for (std::string name; in >> name;) args->configs.push_back(name);
      ok = !args->configs.empty();
    } else if (arg == "--only" && (v = value())) {
      const std::string part = v;
      if (part == "retrieval") {
        for (const std::string& t : retrieval_task_names()) args->parts.push_back(t);
      } else {
        ok = std::find(known_parts().begin(), known_parts().end(), part) != known_parts().end();
        args->parts.push_back(part);
      }
    } else {
      v = nullptr;
      ok = false;
    }
    if (!ok) {
      std::fprintf(stderr, "kvgc-bench-quality: bad or incomplete argument '%s%s%s'\n",
                   arg.c_str(), v ? " " : "", v ? v : "");
      usage(stderr);
      return false;
    }
  }
  if (args->parts.empty()) args->parts = known_parts();
  if (args->model.empty()) args->model = engine::default_model_path();
  return true;
}

bool wants(const Args& args, const std::string& part) {
  return std::find(args.parts.begin(), args.parts.end(), part) != args.parts.end();
}

// Runs bench/quality_plots.gp over the data files, if gnuplot is installed.
void plot(const Args& args, const Bench& bench) {
  if (std::system("command -v gnuplot >/dev/null 2>&1") != 0) {
    std::printf("plots: gnuplot not found (apt-get install gnuplot-nox); the data files are in "
                "%s, plot them with %s\n\n", args.out.c_str(), KVGC_QUALITY_PLOTS);
    return;
  }
  std::string parts;
  for (const std::string& p : args.parts) parts += " " + p;
  const std::string command = "gnuplot -e \"prefix='" + bench.prefix + "'; mode='" +
                              (args.full ? "full" : "quick") + "'; parts='" + parts + "'\" '" +
                              KVGC_QUALITY_PLOTS + "'";
  const int rc = std::system(command.c_str());
  std::printf("plots: %s (%s)\n\n", rc == 0 ? "written" : "gnuplot FAILED", command.c_str());
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
  // Engines side by side, one matmul thread each (kvgc's CPU attention is single-threaded,
  // so two engines keep both cores busier than one engine with two matmul threads).
  engine::set_default_threads(args.jobs > 1 ? 1 : 2);
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
  std::error_code ec;
  std::filesystem::create_directories(args.out, ec);
  if (ec) {
    std::fprintf(stderr, "kvgc-bench-quality: cannot create %s: %s\n", args.out.c_str(),
                 ec.message().c_str());
    return 1;
  }

  Bench bench;
  bench.model = &model;
  bench.tokenizer = &tokenizer;
  {
    // kvgc's view of the engine's cache (its dtype included) from an engine itself.
    engine::Engine probe;
    kvgc_heap_options o;
    kvgc_heap_options_init(&o);
    o.flags = KVGC_OPT_IGNORE_ENV;
    o.device = KVGC_DEVICE_CPU;
    o.budget_bytes = 64u << 20;
    if (!probe.init(model, &o, &err)) {
      std::fprintf(stderr, "kvgc-bench-quality: %s\n", err.c_str());
      return 1;
    }
    bench.kv = probe.kv_model();
  }
  bench.n_ctx = model.config.n_ctx;
  const std::optional<std::string> arch = file.get_string("general.architecture");
  bench.n_ctx_from_gguf = arch && file.get_uint(*arch + ".context_length").has_value();
  bench.jobs = args.jobs;
  bench.full = args.full;
  bench.observe_only = args.observe_only;
  bench.check_replay = args.check_replay;
  bench.contexts = args.contexts;
  bench.depths = args.depths;
  bench.offsets = args.offsets;
  bench.fractions = args.fractions;
  bench.prompts_per_cell = args.prompts;
  bench.config_names = args.configs;
  bench.text_path = args.text;
  bench.text2_path = args.text2;
  bench.out_dir = args.out;
  bench.prefix = args.out + "/" + (args.full ? "full" : "quick");
  {
    std::vector<Config> all = retrieval_configs();
    for (const Config& c : perplexity_configs()) all.push_back(c);
    if (!select_configs(args.configs, &all, &err)) {
      std::fprintf(stderr, "kvgc-bench-quality: %s\n", err.c_str());
      return 2;
    }
  }

  if (!args.export_path.empty()) {
    std::vector<std::string> tasks;
    for (const std::string& t : retrieval_task_names())
      if (wants(args, t)) tasks.push_back(t);
    const bool ppl = wants(args, "perplexity") || wants(args, "ppl-prefix");
    if (!export_tasks(bench, tasks, ppl, args.export_path, &err)) {
      std::fprintf(stderr, "kvgc-bench-quality: %s\n", err.c_str());
      return 1;
    }
    return 0;
  }
  if (!results().open(args.results.empty() ? bench.prefix + "-results.jsonl" : args.results, &err)) {
    std::fprintf(stderr, "kvgc-bench-quality: %s\n", err.c_str());
    return 1;
  }

  const char* dtype = bench.kv.dtype == KVGC_DTYPE_F32 ? "f32" : bench.kv.dtype == KVGC_DTYPE_F16 ? "f16" : "bf16";
  std::printf("kvgc-bench-quality (%s mode), model %s (trained context %llu tokens), engine "
              "K/V %s, %u engine%s side by side; KV bytes are the pages a heap holds (every "
              "class) / the raw f16 payload of the same tokens (an f16 full cache = 100%%)\n\n",
              args.full ? "full" : "quick", std::filesystem::path(args.model).filename().c_str(),
              (unsigned long long)bench.n_ctx, dtype, args.jobs, args.jobs > 1 ? "s" : "");
  std::fflush(stdout);

  std::vector<RetrievalResult> retrieval;
  PerplexityResult ppl;
  PrefixPplResult prefix;
  PrivacyResult privacy;
  bool ok = true;
  size_t mismatches = 0;
  for (const std::string& task : retrieval_task_names()) {
    if (!ok || !wants(args, task)) continue;
    RetrievalResult r;
    ok = run_retrieval(bench, task, &r, &err) && report_retrieval(bench, r, &err);
    mismatches += r.replay_mismatches;
    retrieval.push_back(std::move(r));
    std::fflush(stdout);
  }
  // Streaming perplexity first among the rest: it measures the entropy profile.
  ok = ok && (!wants(args, "perplexity") ||
              (run_perplexity(&bench, &ppl, &err) && report_perplexity(bench, ppl, &err)));
  ok = ok && (!wants(args, "ppl-prefix") ||
              (run_prefix_perplexity(bench, &prefix, &err) && report_prefix_ppl(bench, prefix, &err)));
  ok = ok && (!wants(args, "privacy") ||
              (run_privacy(bench, &privacy, &err) && report_privacy(bench, privacy, &err)));
  if (!ok) {
    std::fprintf(stderr, "kvgc-bench-quality: %s\n", err.c_str());
    return 1;
  }
  if (args.plots) plot(args, bench);
  std::printf("%s\n", result_line(retrieval, ppl, prefix, privacy, seconds_since(start)).c_str());
  if (mismatches > 0) {
    std::fprintf(stderr, "kvgc-bench-quality: --check-replay: %zu replayed caches differ from "
                         "a fresh prefill\n", mismatches);
    return 1;
  }
  return 0;
}
