// kvgc-bench-tokenizer: what one long pre-token piece costs the tokenizer. A BPE merge
// that rescans the piece after every merge is quadratic in the piece's length; the
// priority-queue merge is O(n log n). Each input is encoded at 1 KB and at --max-kb KB
// (default 32), and the cost per KB is compared: a ratio near 1 is linear, near 32 is
// quadratic. Inputs: one word of random letters, one run of spaces, and English text
// (the Jargon File, many short pieces). Needs the model's vocabulary
// (tools/fetch-model.sh or --model). Costs are this thread's CPU time.
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "engine/model.hpp"
#include "engine/tokenizer.hpp"
#include "gguf.hpp"

namespace {

// This thread's CPU time: on a shared machine, other processes' load inflates wall time.
double cpu_seconds() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}

// CPU microseconds per KB of encoding `text`, repeated for at least `min_seconds`.
double us_per_kb(const engine::Tokenizer& tok, const std::string& text, double min_seconds,
                 size_t* n_tokens) {
  size_t runs = 0;
  const double start = cpu_seconds();
  double elapsed = 0;
  do {
    *n_tokens = tok.encode(text, false).size();
    ++runs;
    elapsed = cpu_seconds() - start;
  } while (elapsed < min_seconds);
  return elapsed / double(runs) * 1e6 / (double(text.size()) / 1024.0);
}

std::string repeat_to(const std::string& unit, size_t bytes) {
  std::string out;
  while (out.size() < bytes) out += unit;
  out.resize(bytes);
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  std::string model_path = engine::default_model_path();
  size_t max_kb = 32;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--model" && i + 1 < argc) {
      model_path = argv[++i];
    } else if (arg == "--max-kb" && i + 1 < argc && std::atoi(argv[i + 1]) > 1) {
      max_kb = size_t(std::atoi(argv[++i]));
    } else {
      std::fprintf(stderr, "usage: kvgc-bench-tokenizer [--model PATH] [--max-kb N (> 1)]\n");
      return 2;
    }
  }
  if (!std::filesystem::exists(model_path)) {
    std::fprintf(stderr, "kvgc-bench-tokenizer: model file %s not found (tools/fetch-model.sh)\n",
                 model_path.c_str());
    return 1;
  }
  std::string err;
  gguf::File file;
  engine::Tokenizer tok;
  if (!file.open(model_path, &err) || !tok.load(file, &err)) {
    std::fprintf(stderr, "kvgc-bench-tokenizer: %s\n", err.c_str());
    return 1;
  }
  std::ifstream in(KVGC_BENCH_TEXT);
  std::stringstream text;
  text << in.rdbuf();
  if (text.str().empty()) {
    std::fprintf(stderr, "kvgc-bench-tokenizer: cannot read %s\n", KVGC_BENCH_TEXT);
    return 1;
  }
  std::mt19937 rng(7);
  std::string letters(max_kb * 1024, 'a');
  for (char& c : letters) c = char('a' + rng() % 26);

  struct Input {
    const char* name;
    std::string big;
  } inputs[] = {{"letters", letters},
                {"spaces", std::string(max_kb * 1024, ' ')},
                {"text", repeat_to(text.str(), max_kb * 1024)}};
  std::printf("kvgc-bench-tokenizer: encode CPU cost per KB at 1 KB and %zu KB\n", max_kb);
  std::printf("%-8s %12s %12s %8s %10s\n", "input", "us/KB 1K", "us/KB big", "ratio",
              "tokens big");
  std::string ratios = "RESULT", costs;
  for (const Input& input : inputs) {
    size_t small_tokens = 0, big_tokens = 0;
    const double small = us_per_kb(tok, input.big.substr(0, 1024), 0.3, &small_tokens);
    const double big = us_per_kb(tok, input.big, 0.3, &big_tokens);
    std::printf("%-8s %12.1f %12.1f %8.2f %10zu\n", input.name, small, big, big / small,
                big_tokens);
    char field[160];
    std::snprintf(field, sizeof field, " %s_ratio=%.2f", input.name, big / small);
    ratios += field;
    std::snprintf(field, sizeof field, " %s_us_per_kb_1k=%.1f %s_us_per_kb_%zuk=%.1f",
                  input.name, small, input.name, max_kb, big);
    costs += field;
  }
  std::printf("%s%s\n", ratios.c_str(), costs.c_str());
  return 0;
}
