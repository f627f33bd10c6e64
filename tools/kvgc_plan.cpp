// kvgc-plan: how much KV-cache memory a model needs, and how many tokens a byte budget
// holds with a full cache, with eviction, and with eviction plus int4 demotion.
// Exit status: 0 ok, 1 unreadable or malformed model file, 2 bad command line.
#include <algorithm>
#include <cstdio>
#include <exception>
#include <functional>
#include <new>
#include <optional>
#include <string>
#include <vector>

#include "kvgc.h"
#include "model_shape.hpp"
#include "plan.hpp"

namespace {

using kvgc_tools::format_bytes;
using kvgc_tools::format_count;

constexpr char kUsage[] =
    R"(usage: kvgc-plan MODEL [options]

MODEL, exactly one of:
  --config FILE.json     a Hugging Face config.json
  --gguf FILE.gguf       a GGUF model file (only its metadata is read)
  --layers N --heads N [--kv-heads N] --head-dim N
                         the shape by hand (--kv-heads defaults to --heads)

options:
  --dtype f16|bf16|f32   KV dtype (default: the config's torch_dtype, else f16)
  --context N[,N...]     contexts for the full-cache table; k = 1024 (default:
                         1024,4096,32768 and the model's own maximum context)
  --batch N[,N...]       batch sizes (default: 1,8,32)
  --budget BYTES         KV memory budget, K/M/G/T binary suffixes (default: 80G)
  --page-tokens N        tokens per kvgc page, 1..256 (default: 16)
  --keep FRACTION        share of each sequence kept under eviction (default: 0.25)
  --demote FRACTION      share of the kept tokens stored int4 (default: 0.5)
  --help                 print this help and exit

The last output line is machine-readable:
  RESULT model=NAME kv_bytes_per_token=N full_ctx_fit=N evict_ctx_fit=N evict_int4_ctx_fit=N
)";

struct Options {
  std::string config, gguf;
  std::optional<uint64_t> layers, heads, kv_heads, head_dim;
  std::optional<kvgc_dtype> dtype;
  std::optional<std::vector<uint64_t>> contexts;
  std::vector<uint64_t> batches = {1, 8, 32};
  uint64_t budget = uint64_t(80) << 30;
  uint32_t page_tokens = 16;
  double keep = 0.25;
  double demote = 0.5;
  bool help = false;
};

int usage_error(const std::string& msg) {
  std::fprintf(stderr, "kvgc-plan: %s\n\n%s", msg.c_str(), kUsage);
  return 2;
}

struct Flag {
  const char* name;
  const char* form;  // the accepted form, quoted in error messages
  std::function<bool(const std::string&)> set;
};

std::vector<Flag> flags(Options* o) {
  const auto count = [](std::optional<uint64_t>* out) {
    return [out](const std::string& v) {
      *out = kvgc_tools::parse_count(v, UINT32_MAX);
      return out->has_value();
    };
  };
  return {
      {"--config", "a path to a config.json", [o](const std::string& v) {
         o->config = v;
         return !v.empty();
       }},
      {"--gguf", "a path to a .gguf file", [o](const std::string& v) {
         o->gguf = v;
         return !v.empty();
       }},
      {"--layers", "a positive integer", count(&o->layers)},
      {"--heads", "a positive integer", count(&o->heads)},
      {"--kv-heads", "a positive integer", count(&o->kv_heads)},
      {"--head-dim", "a positive even integer", count(&o->head_dim)},
      {"--dtype", "f16, bf16 or f32", [o](const std::string& v) {
         if (v == "f16") o->dtype = KVGC_DTYPE_F16;
         else if (v == "bf16") o->dtype = KVGC_DTYPE_BF16;
         else if (v == "f32") o->dtype = KVGC_DTYPE_F32;
         else return false;
         return true;
       }},
      {"--context", "token counts separated by commas, e.g. 1024,4096,32k (k = 1024), each "
                    "at most 4294967296",
       [o](const std::string& v) {
         o->contexts = kvgc_tools::parse_count_list(v, kvgc_tools::kMaxContext);
         return o->contexts.has_value();
       }},
      {"--batch", "batch sizes separated by commas, e.g. 1,8,32, each at most 1048576",
       [o](const std::string& v) {
         const auto b = kvgc_tools::parse_count_list(v, kvgc_tools::kMaxBatch);
         if (b) o->batches = *b;
         return b.has_value();
       }},
      {"--budget", "bytes with an optional binary K/M/G/T suffix, e.g. 24G, 80GiB, 1.5T; at "
                   "most 1024T",
       [o](const std::string& v) {
         const auto b = kvgc_tools::parse_byte_size(v);
         if (b) o->budget = *b;
         return b && *b <= kvgc_tools::kMaxBudgetBytes;
       }},
      {"--page-tokens", "an integer in 1..256", [o](const std::string& v) {
         const auto n = kvgc_tools::parse_count(v, 256);
         if (n) o->page_tokens = uint32_t(*n);
         return n.has_value();
       }},
      {"--keep", "a fraction in (0, 1], e.g. 0.25 or 25%", [o](const std::string& v) {
         const auto f = kvgc_tools::parse_fraction(v);
         if (f) o->keep = *f;
         return f && *f > 0;
       }},
      {"--demote", "a fraction in [0, 1], e.g. 0.5 or 50%", [o](const std::string& v) {
         const auto f = kvgc_tools::parse_fraction(v);
         if (f) o->demote = *f;
         return f.has_value();
       }},
  };
}

// Fills *o from argv; on a bad command line returns the message to print.
std::optional<std::string> parse_args(int argc, char** argv, Options* o) {
  const std::vector<Flag> table = flags(o);
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i], value;
    if (arg == "--help" || arg == "-h") {
      o->help = true;
      continue;
    }
    const size_t eq = arg.find('=');
    const bool inline_value = arg.rfind("--", 0) == 0 && eq != std::string::npos;
    if (inline_value) {
      value = arg.substr(eq + 1);
      arg.resize(eq);
    }
    const auto flag = std::find_if(table.begin(), table.end(),
                                   [&](const Flag& f) { return arg == f.name; });
    if (flag == table.end()) return "unknown argument '" + arg + "'";
    if (!inline_value) {
      if (i + 1 >= argc) return arg + " needs a value: " + flag->form;
      value = argv[++i];
    }
    if (!flag->set(value))
      return arg + ": invalid value '" + value + "'; expected " + flag->form;
  }
  return std::nullopt;
}

// kvgc's message names the model_desc field at fault ("model->head_dim must be ...");
// point at the flag that set it.
std::string flag_for_kvgc_message(const std::string& msg) {
  const size_t arrow = msg.find("->");
  const std::string field = arrow == std::string::npos ? "" : msg.substr(arrow + 2);
  const std::pair<const char*, const char*> fields[] = {{"n_layers", "--layers"},
                                                        {"n_q_heads", "--heads"},
                                                        {"n_kv_heads", "--kv-heads"},
                                                        {"head_dim", "--head-dim"},
                                                        {"dtype", "--dtype"}};
  for (const auto& [prefix, flag] : fields)
    if (field.rfind(prefix, 0) == 0) return flag;
  return "model shape";
}

// Prints rows indented by two spaces: the first `left_columns` columns (labels)
// left-aligned, the rest (numbers) right-aligned.
void print_table(const std::vector<std::vector<std::string>>& rows, size_t left_columns) {
  std::vector<size_t> width;
  for (const auto& row : rows)
    for (size_t c = 0; c < row.size(); ++c) {
      if (width.size() <= c) width.push_back(0);
      width[c] = std::max(width[c], row[c].size());
    }
  for (const auto& row : rows) {
    std::string line;
    for (size_t c = 0; c < row.size(); ++c) {
      const std::string pad(width[c] - row[c].size(), ' ');
      line += (c == 0 ? "  " : "   ") + (c < left_columns ? row[c] + pad : pad + row[c]);
    }
    line.erase(line.find_last_not_of(' ') + 1);
    std::printf("%s\n", line.c_str());
  }
}

std::string percent(double fraction) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g%%", fraction * 100);
  return buf;
}

std::string mode_label(kvgc_tools::FitMode mode, const kvgc_tools::PlanParams& p) {
  switch (mode) {
    case kvgc_tools::FitMode::kFull: return "full cache";
    case kvgc_tools::FitMode::kEvict: return "eviction, keep " + percent(p.keep);
    case kvgc_tools::FitMode::kEvictInt4:
      return "eviction + int4 (" + percent(p.demote) + " of kept)";
  }
  return "";
}

void print_report(const kvgc_tools::ModelShape& shape, const kvgc_tools::PlanParams& p,
                  const kvgc_tools::Plan& plan) {
  const kvgc_model_desc& m = shape.desc;
  const std::string dtype = kvgc_tools::dtype_name(m.dtype);
  const kvgc_tools::TokenCost& c = plan.cost;

  std::printf("Model     %s%s\n", shape.name.c_str(),
              shape.architecture.empty() ? "" : (" (" + shape.architecture + ")").c_str());
  std::printf("Source    %s\n", shape.source.c_str());
  std::printf("Shape     %u layers, %u query heads, %u KV heads, head_dim %u", m.n_layers,
              m.n_q_heads, m.n_kv_heads, m.head_dim);
  if (shape.hidden_size) std::printf(", hidden %u", shape.hidden_size);
  std::printf("\nKV dtype  %s\n", dtype.c_str());
  if (shape.context_length)
    std::printf("Context   %s tokens (the model's maximum)\n",
                format_count(shape.context_length).c_str());
  std::printf("Budget    %s, pages of %u tokens\n\n", format_bytes(p.budget_bytes).c_str(),
              p.page_tokens);

  std::printf("KV bytes per token (K and V, all %u layers)\n", m.n_layers);
  const auto overhead = [](double paged, uint64_t raw) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "+%.1f%%", (paged / double(raw) - 1) * 100);
    return std::string(buf);
  };
  print_table({{"class", "raw", "in kvgc pages", "page overhead"},
               {dtype, format_bytes(c.raw_model), format_bytes(c.paged_model),
                overhead(c.paged_model, c.raw_model)},
               {"int4", format_bytes(c.raw_int4), format_bytes(c.paged_int4),
                overhead(c.paged_int4, c.raw_int4)}},
              1);
  std::printf("  raw: the K/V payload any engine stores (int4 adds a scale and zero per group);\n"
              "  kvgc pages add per-slot metadata and alignment.\n\n");

  std::printf("Full cache in kvgc pages (%s, every token kept)\n", dtype.c_str());
  std::vector<std::vector<std::string>> rows(1, {"context"});
  for (uint64_t b : p.batches) rows[0].push_back("batch " + format_count(b));
  bool over_budget = false;
  for (const auto& row : plan.full_cache_bytes)
    for (uint64_t bytes : row) over_budget |= bytes > p.budget_bytes;
  for (size_t i = 0; i < p.contexts.size(); ++i) {
    rows.push_back({format_count(p.contexts[i])});
    for (uint64_t bytes : plan.full_cache_bytes[i]) {
      const char* mark = !over_budget ? "" : bytes > p.budget_bytes ? " !" : "  ";
      rows.back().push_back(format_bytes(bytes) + mark);
    }
  }
  print_table(rows, 0);
  if (over_budget)
    std::printf("  ! more than the %s budget\n", format_bytes(p.budget_bytes).c_str());

  std::printf("\nTokens that fit in %s: in total, and the longest context per sequence\n",
              format_bytes(p.budget_bytes).c_str());
  const bool has_batch1 = std::find(p.batches.begin(), p.batches.end(), 1) != p.batches.end();
  rows.assign(1, {"mode", "total tokens"});
  if (!has_batch1) rows[0].push_back("batch 1");
  for (uint64_t b : p.batches) rows[0].push_back("batch " + format_count(b));
  for (const kvgc_tools::Fit& fit : plan.fits) {
    rows.push_back({mode_label(fit.mode, p), format_count(fit.total_tokens)});
    if (!has_batch1) rows.back().push_back(format_count(fit.max_context_batch1));
    for (uint64_t ctx : fit.max_context) rows.back().push_back(format_count(ctx));
  }
  print_table(rows, 1);
  if (shape.context_length && plan.fits[0].max_context_batch1 > shape.context_length)
    std::printf("  Contexts past the model's %s tokens fit in memory; the model may not use "
                "them.\n",
                format_count(shape.context_length).c_str());

  std::string name = shape.name;
  std::replace_if(name.begin(), name.end(), [](char ch) { return ch == ' ' || ch == '\t'; }, '_');
  std::printf("\nRESULT model=%s kv_bytes_per_token=%llu full_ctx_fit=%llu evict_ctx_fit=%llu "
              "evict_int4_ctx_fit=%llu\n",
              name.c_str(), (unsigned long long)c.raw_model,
              (unsigned long long)plan.fits[0].max_context_batch1,
              (unsigned long long)plan.fits[1].max_context_batch1,
              (unsigned long long)plan.fits[2].max_context_batch1);
}

int run(int argc, char** argv) {
  Options o;
  if (const auto msg = parse_args(argc, argv, &o)) return usage_error(*msg);
  if (o.help) {
    std::fputs(kUsage, stdout);
    return 0;
  }

  const bool manual = o.layers || o.heads || o.kv_heads || o.head_dim;
  const int sources = !o.config.empty() + !o.gguf.empty() + manual;
  if (sources == 0) return usage_error("no model given: use --config, --gguf or --layers ...");
  if (sources > 1) return usage_error("give only one model: --config, --gguf or --layers ...");

  kvgc_tools::ModelShape shape;
  std::string err;
  if (manual) {
    const std::pair<const char*, bool> required[] = {
        {"--layers", o.layers.has_value()},
        {"--heads", o.heads.has_value()},
        {"--head-dim", o.head_dim.has_value()}};
    for (const auto& [flag, given] : required)
      if (!given) return usage_error(std::string(flag) + " is required with a shape by hand");
    if (!kvgc_tools::shape_from_dims(uint32_t(*o.layers), uint32_t(*o.heads),
                                     uint32_t(o.kv_heads.value_or(*o.heads)),
                                     uint32_t(*o.head_dim), o.dtype.value_or(KVGC_DTYPE_F16),
                                     &shape, &err))
      return usage_error(flag_for_kvgc_message(err) + ": " + err);
  } else if (!(o.config.empty() ? kvgc_tools::load_gguf_shape(o.gguf, &shape, &err)
                                : kvgc_tools::load_config_shape(o.config, &shape, &err))) {
    std::fprintf(stderr, "kvgc-plan: %s\n", err.c_str());
    return 1;
  }
  if (o.dtype) shape.desc.dtype = *o.dtype;

  kvgc_tools::PlanParams p;
  p.model = shape.desc;
  p.page_tokens = o.page_tokens;
  p.budget_bytes = o.budget;
  p.keep = o.keep;
  p.demote = o.demote;
  p.batches = o.batches;
  p.contexts = o.contexts.value_or(std::vector<uint64_t>{1024, 4096, 32768});
  if (!o.contexts && shape.context_length && shape.context_length <= kvgc_tools::kMaxContext)
    p.contexts.push_back(shape.context_length);
  for (auto* list : {&p.contexts, &p.batches}) {
    std::sort(list->begin(), list->end());
    list->erase(std::unique(list->begin(), list->end()), list->end());
  }

  kvgc_tools::Plan plan;
  if (!kvgc_tools::make_plan(p, &plan, &err)) return usage_error(err);
  print_report(shape, p, plan);
  return 0;
}

}  // namespace

// Whatever escapes (out of memory, a library exception) is a message and exit status 1,
// never an abort.
int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::bad_alloc&) {
    std::fputs("kvgc-plan: out of memory\n", stderr);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kvgc-plan: %s\n", e.what());
  }
  return 1;
}
