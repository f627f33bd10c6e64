// kvgc-bench-quality: how much each kvgc cache policy costs in model quality, measured
// on the real model (SmolLM2-135M-Instruct through the reference engine).
//
//   1. Passkey retrieval (bench/quality_retrieval.cpp): a 5-digit key hidden at several
//      depths in filler; the model must repeat it after the cache was squeezed to
//      10/20/50% of the prompt, under both prefill modes (observe: SnapKV-style, the
//      engine's default; stream: eviction after every chunk).
//   2. Needle in prose (same file): a sentence hidden in the Jargon File, asked for in a
//      chat prompt.
//   3. Streaming perplexity (bench/quality_perplexity.cpp): teacher-forced perplexity of
//      the same prose with the cache bounded to 256 and 512 tokens: window with and
//      without sinks, h2o, random, generational (+int4, + pyramid / entropy layer splits).
//
// Every configuration gets its own heap, created with explicit options (ignoring the
// KVGC_* environment) on the CPU. Quick mode (default) fits in a few minutes on two
// cores; --full runs 1K/2K/4K contexts and 4K scored tokens (docs/QUALITY.md has the
// grids and records). Tables go to stdout, per-run lines to stderr, data files and plots
// (gnuplot, bench/quality_plots.gp) to --out.

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

namespace {

using namespace quality;

struct Args {
  std::string model;
  std::string text = std::string(KVGC_QUALITY_DATA_DIR) + "/jargon-intro.txt";
  std::string out = KVGC_QUALITY_OUT_DIR;
  bool full = false;
  unsigned jobs = 2;
  bool plots = true;
  std::vector<uint32_t> contexts;
  std::vector<double> depths;
  bool passkey = true, needle = true, perplexity = true;
};

void usage(FILE* out) {
  std::fprintf(out,
               "usage: kvgc-bench-quality [--full] [--model PATH] [--text FILE] [--out DIR]\n"
               "                          [--jobs N] [--only passkey|needle|perplexity]...\n"
               "                          [--contexts N,N...] [--depths D,D...] [--no-plots]\n"
               "  --full         passkey at 1K/2K/4K tokens (9/5/3 depths), needle at 1K/4K,\n"
               "                 4096 scored tokens (~45 minutes on two cores; the default\n"
               "                 quick mode takes ~4)\n"
               "  --model PATH   GGUF file (default: $KVGC_MODEL, else ~/.cache/kvgc/%s)\n"
               "  --text FILE    prose for the needle and perplexity parts\n"
               "                 (default: %s/jargon-intro.txt)\n"
               "  --out DIR      data files, entropy profile and PNG plots (default:\n"
               "                 %s); names start with quick- or full-\n"
               "  --jobs N       engines run side by side, one BLAS thread each (default 2;\n"
               "                 1 = one engine with two BLAS threads)\n"
               "  --contexts N,N passkey/needle prompt lengths in tokens (replace the mode's)\n"
               "  --depths D,D   passkey/needle depths in 0..1 (replace the mode's)\n"
               "  --only PART    run only this part (repeatable)\n"
               "  --no-plots     do not run gnuplot\n",
               engine::kDefaultModelFile, KVGC_QUALITY_DATA_DIR, KVGC_QUALITY_OUT_DIR);
}

bool parse_args(int argc, char** argv, Args* args) {
  bool only = false;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&]() -> const char* { return i + 1 < argc ? argv[++i] : nullptr; };
    const char* v = nullptr;
    if (arg == "--help" || arg == "-h") {
      usage(stdout);
      std::exit(0);
    } else if (arg == "--full") {
      args->full = true;
    } else if (arg == "--no-plots") {
      args->plots = false;
    } else if (arg == "--model" && (v = value())) {
      args->model = v;
    } else if (arg == "--text" && (v = value())) {
      args->text = v;
    } else if (arg == "--out" && (v = value())) {
      args->out = v;
    } else if (arg == "--jobs" && (v = value()) && std::atoi(v) > 0) {
      args->jobs = unsigned(std::atoi(v));
    } else if ((arg == "--contexts" || arg == "--depths") && (v = value())) {
      std::string list = v;
      for (char& c : list) c = c == ',' ? ' ' : c;
      std::istringstream in(list);
      for (double x; in >> x;) {
        if (arg == "--contexts") args->contexts.push_back(uint32_t(x));
        else args->depths.push_back(x);
      }
    } else if (arg == "--only" && (v = value()) &&
               (std::string(v) == "passkey" || std::string(v) == "needle" ||
                std::string(v) == "perplexity")) {
      if (!only) args->passkey = args->needle = args->perplexity = false;
      only = true;
      const std::string part = v;
      (part == "passkey" ? args->passkey : part == "needle" ? args->needle : args->perplexity) =
          true;
    } else {
      std::fprintf(stderr, "kvgc-bench-quality: unknown or incomplete argument '%s'\n",
                   arg.c_str());
      usage(stderr);
      return false;
    }
  }
  if (args->model.empty()) args->model = engine::default_model_path();
  return true;
}

// Runs bench/quality_plots.gp over the data files, if gnuplot is installed.
void plot(const Args& args, const Bench& bench) {
  if (std::system("command -v gnuplot >/dev/null 2>&1") != 0) {
    std::printf("plots: gnuplot not found (apt-get install gnuplot-nox); the data files are in "
                "%s, plot them with %s\n\n", args.out.c_str(), KVGC_QUALITY_PLOTS);
    return;
  }
  std::string parts;
  if (args.passkey) parts += " passkey";
  if (args.needle) parts += " needle";
  if (args.perplexity) parts += " ppl";
  const std::string command = "gnuplot -e \"prefix='" + bench.prefix + "'; mode='" +
                              (args.full ? "full" : "quick") + "'; parts='" + parts + "'\" '" +
                              KVGC_QUALITY_PLOTS + "'";
  const int rc = std::system(command.c_str());
  std::printf("plots: %s (%s)\n\n", rc == 0 ? "written" : "gnuplot FAILED", command.c_str());
}

// "RESULT key=value ...": ratios first, then the raw figures.
std::string result_line(const RetrievalResult& passkey, const RetrievalResult& needle,
                        const PerplexityResult& ppl, double seconds) {
  std::string out = "RESULT";
  char buf[160];
  auto add = [&](const char* format, auto... values) {
    std::snprintf(buf, sizeof buf, format, values...);
    out += buf;
  };
  // Row index of a policy, -1 if absent.
  auto row = [](const RetrievalResult& r, const char* name) {
    for (size_t i = 0; i < r.policies.size(); ++i)
      if (r.policies[i] == name) return int(i);
    return -1;
  };
  // The 20% column (the goals' budget).
  auto col20 = [](const RetrievalResult& r) {
    for (size_t f = 0; f < r.fractions.size(); ++f)
      if (std::abs(r.fractions[f] - 0.2) < 1e-9) return f;
    return size_t(0);
  };
  auto ratio = [&](const RetrievalResult& r, size_t mode, const char* name) {
    const size_t f = col20(r);
    const double base = r.cells[mode][0][f].accuracy();
    const int i = row(r, name);
    return base > 0 && i >= 0 ? r.cells[mode][size_t(i)][f].accuracy() / base : 0.0;
  };
  struct Short {
    const char* key;
    const char* name;
  };
  const Short shorts[] = {{"gen", "generational"}, {"h2o", "h2o"}, {"streaming", "streaming"},
                          {"random", "random"}, {"gen_int4_", "generational+int4"}};
  if (!passkey.cells.empty()) {
    for (size_t m = 0; m < passkey.modes.size(); ++m) {
      const std::string mode = m == 0 ? "" : "_" + passkey.modes[m];
      for (const Short& s : shorts)
        add(" passkey_%s20%s_vs_full=%.2f", s.key, mode.c_str(), ratio(passkey, m, s.name));
    }
  }
  if (!needle.cells.empty()) {
    for (const Short& s : shorts)
      add(" needle_%s20_vs_full=%.2f", s.key, ratio(needle, 0, s.name));
  }
  const Short ppl_shorts[] = {
      {"nosinks", "window(no sinks)"}, {"sinks", "streaming"},
      {"h2o", "h2o"},                  {"random", "random"},
      {"gen", "generational"},         {"gen_int4", "generational+int4"},
      {"pyramid", "generational+pyramid"}, {"entropy", "generational+entropy"}};
  const double base = ppl.full.perplexity;
  for (size_t b = 0; b < ppl.bounded.size(); ++b) {
    const std::string bound = b == 0 ? "" : std::to_string(ppl.cache_tokens[b]);
    for (const Short& s : ppl_shorts)
      for (const PerplexityRow& r : ppl.bounded[b])
        if (r.name == s.name)
          add(" ppl%s_%s_vs_full=%.3f", bound.c_str(), s.key, r.perplexity / base);
  }
  // KV bytes held by int4 demotion against plain generational at the same token budget.
  if (!passkey.cells.empty()) {
    const int g = row(passkey, "generational"), q = row(passkey, "generational+int4");
    const size_t f = col20(passkey);
    const double gb = passkey.cells[0][size_t(g)][f].kv_fraction();
    add(" passkey_kv_gen_int4_vs_gen20=%.2f",
        gb > 0 ? passkey.cells[0][size_t(q)][f].kv_fraction() / gb : 0.0);
  }
  for (size_t b = 0; b < ppl.bounded.size(); ++b) {
    const PerplexityRow *g = nullptr, *q = nullptr;
    for (const PerplexityRow& r : ppl.bounded[b]) {
      if (r.name == "generational") g = &r;
      if (r.name == "generational+int4") q = &r;
    }
    if (g && q && g->held.bytes > 0) {
      const std::string bound = b == 0 ? "" : std::to_string(ppl.cache_tokens[b]);
      add(" ppl%s_kv_gen_int4_vs_gen=%.2f", bound.c_str(),
          double(q->held.bytes) / double(g->held.bytes));
    }
  }
  // Raw figures.
  auto cells = [&](const char* part, const RetrievalResult& r) {
    for (size_t m = 0; m < r.modes.size(); ++m)
      for (size_t p = 0; p < r.policies.size(); ++p)
        for (size_t f = 0; f < r.fractions.size(); ++f) {
          if (p == 0 && (m > 0 || f > 0)) continue;  // full: one figure
          const Cell& c = r.cells[m][p][f];
          if (p == 0) {
            add(" %s_full=%d/%d", part, c.correct, c.total);
          } else {
            add(" %s_%s_%s_%.0f=%d/%d", part, r.modes[m].c_str(), key_name(r.policies[p]).c_str(),
                100.0 * r.fractions[f], c.correct, c.total);
          }
        }
  };
  if (!passkey.cells.empty()) cells("passkey", passkey);
  if (!needle.cells.empty()) cells("needle", needle);
  if (ppl.full.perplexity > 0) {
    add(" ppl_full=%.3f", ppl.full.perplexity);
    for (size_t b = 0; b < ppl.bounded.size(); ++b)
      for (const PerplexityRow& r : ppl.bounded[b])
        add(" ppl%llu_%s=%.3f", (unsigned long long)ppl.cache_tokens[b], key_name(r.name).c_str(),
            r.perplexity);
    add(" ppl_tokens=%zu", ppl.scored_tokens);
  }
  if (!passkey.cells.empty()) add(" passkey_seconds=%.0f", passkey.seconds);
  if (!needle.cells.empty()) add(" needle_seconds=%.0f", needle.seconds);
  if (ppl.full.perplexity > 0) add(" ppl_seconds=%.0f", ppl.seconds);
  add(" seconds=%.0f", seconds);
  return out;
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
  kvgc_model_desc_init(&bench.kv);
  bench.kv.n_layers = model.config.n_layers;
  bench.kv.n_q_heads = model.config.n_heads;
  bench.kv.n_kv_heads = model.config.n_kv_heads;
  bench.kv.head_dim = model.config.head_dim;
  bench.kv.dtype = KVGC_DTYPE_F32;
  bench.n_ctx = model.config.n_ctx;
  const std::optional<std::string> arch = file.get_string("general.architecture");
  bench.n_ctx_from_gguf = arch && file.get_uint(*arch + ".context_length").has_value();
  bench.jobs = args.jobs;
  bench.full = args.full;
  bench.contexts = args.contexts;
  bench.depths = args.depths;
  bench.text_path = args.text;
  bench.out_dir = args.out;
  bench.prefix = args.out + "/" + (args.full ? "full" : "quick");

  std::printf("kvgc-bench-quality (%s mode), model %s (trained context %llu tokens), %u "
              "engine%s side by side\n\n",
              args.full ? "full" : "quick", std::filesystem::path(args.model).filename().c_str(),
              (unsigned long long)bench.n_ctx, args.jobs, args.jobs > 1 ? "s" : "");
  std::fflush(stdout);

  RetrievalResult passkey, needle;
  PerplexityResult ppl;
  if ((args.passkey && !run_passkey(bench, &passkey, &err)) ||
      (args.needle && !run_needle(bench, &needle, &err)) ||
      (args.perplexity && !run_perplexity(&bench, &ppl, &err))) {
    std::fprintf(stderr, "kvgc-bench-quality: %s\n", err.c_str());
    return 1;
  }
  if (args.plots) plot(args, bench);
  std::printf("%s\n", result_line(passkey, needle, ppl, seconds_since(start)).c_str());
  return 0;
}
