// kvgc-plan: how much KV-cache memory a model needs, how many tokens a byte budget
// holds with a full cache, with eviction, and with eviction plus int4 demotion, and
// (--shared-prefix) what sharing a prompt prefix over many requests saves.
// Exit status: 0 ok, 1 unreadable or malformed model file, 2 bad command line.
#include <algorithm>
#include <cmath>
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
  --shared-prefix N      also show what sharing an N-token prompt prefix saves
                         (kvgc's prefix cache); k = 1024
  --requests N           requests sharing it (default: the largest --batch)
  --own N                each request's own tokens after the prefix (the rest of its
                         prompt and its output); k = 1024 (default: 512)
  --prefix-charge shrink|cache
                         who pays for the shared prefix, as KVGC_PREFIX_CHARGE (default:
                         shrink, kvgc's default; prune is planned as shrink)
  --help                 print this help and exit

The last output line is machine-readable:
  RESULT model=NAME kv_bytes_per_token=N full_ctx_fit=N evict_ctx_fit=N evict_int4_ctx_fit=N
with --shared-prefix, followed by the savings of sharing (unshared bytes / shared bytes):
  prefix_charge=shrink|cache shared_prefix=N requests=N own=N full_shared_x=X
  evict_shared_x=X evict_int4_shared_x=X
  evict_int4_shared_vs_full_x=X (the last: the full cache unshared against eviction + int4
  shared)
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
  std::optional<uint64_t> shared_prefix, requests, own;
  std::optional<kvgc_prefix_charge> charge;
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
      {"--shared-prefix", "a token count, e.g. 2048 or 2k (k = 1024), in 1..4294967296",
       [o](const std::string& v) {
         o->shared_prefix = kvgc_tools::parse_count(v, kvgc_tools::kMaxContext);
         return o->shared_prefix.has_value();
       }},
      {"--requests", "a number of requests in 1..1048576", [o](const std::string& v) {
         o->requests = kvgc_tools::parse_count(v, kvgc_tools::kMaxRequests);
         return o->requests.has_value();
       }},
      {"--own", "a token count, e.g. 512 or 1k (k = 1024), in 1..4294967296",
       [o](const std::string& v) {
         o->own = kvgc_tools::parse_count(v, kvgc_tools::kMaxContext);
         return o->own.has_value();
       }},
      {"--prefix-charge", "shrink, prune or cache (view is not planned)",
       [o](const std::string& v) {
         if (v == "shrink" || v == "prune") o->charge = KVGC_PREFIX_CHARGE_SHRINK;
         else if (v == "cache") o->charge = KVGC_PREFIX_CHARGE_CACHE;
         return o->charge.has_value();
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

// "1 request", "32 requests".
std::string count_of(uint64_t n, const std::string& noun) {
  return format_count(n) + " " + noun + (n == 1 ? "" : "s");
}

std::string ratio(double x) {
  if (!(x > 0) || !std::isfinite(x)) return "-";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2fx", x);
  return buf;
}

// Prints `text` as lines of at most 89 columns, each indented by two spaces. A \x01 is a
// space no line breaks at.
void print_wrapped(const std::string& text) {
  constexpr size_t kWidth = 87;  // after the indent
  std::string line;
  size_t pos = 0;
  while (pos < text.size()) {
    const size_t space = text.find(' ', pos);
    std::string word = text.substr(pos, space == std::string::npos ? space : space - pos);
    pos = space == std::string::npos ? text.size() : space + 1;
    if (word.empty()) continue;
    std::replace(word.begin(), word.end(), '\x01', ' ');
    if (!line.empty() && line.size() + 1 + word.size() > kWidth) {
      std::printf("  %s\n", line.c_str());
      line.clear();
    }
    line += (line.empty() ? "" : " ") + word;
  }
  if (!line.empty()) std::printf("  %s\n", line.c_str());
}

// The sharing table (--shared-prefix). `header_err` says why header pages are not
// counted, when s.header_bytes is 0.
void print_sharing(const kvgc_tools::PlanParams& p, const kvgc_tools::ShareParams& s,
                   const kvgc_tools::SharePlan& sp, const std::string& header_err) {
  const std::string dtype = kvgc_tools::dtype_name(p.model.dtype);
  std::printf("\nSharing a %s-token prefix over %s, each with %s of its own\n",
              format_count(s.prefix_tokens).c_str(), count_of(s.requests, "request").c_str(),
              count_of(s.own_tokens, "token").c_str());
  std::vector<std::vector<std::string>> rows = {
      {"mode", "prefix", "per request", count_of(s.requests, "request"), "saving", "vs full",
       "requests in " + format_bytes(p.budget_bytes)}};
  for (const kvgc_tools::ShareRow& r : sp.rows)
    rows.push_back({mode_label(r.mode, p), r.shared ? "shared" : "unshared",
                    format_bytes(r.per_request), format_bytes(r.total_bytes),
                    r.shared ? ratio(r.vs_unshared) : "-", ratio(r.vs_full),
                    format_count(r.requests_fit)});
  print_table(rows, 2);
  std::printf("  saving: the same mode unshared / shared; vs full: the full cache unshared / this\n"
              "  row (bytes for the %s).\n",
              count_of(s.requests, "request").c_str());
  if (sp.shared_pages == 0) {
    std::printf("  shared: the prefix is shorter than a page: nothing is shared (pages are shared\n"
                "  whole), every request holds it.\n");
    return;
  }
  // Rows: full, evict, evict + int4, each unshared then shared. The unshared eviction row
  // keeps keep x (P+U) tokens (its budget); the shared one the lesser of that and its own
  // (under shrink, at most).
  const bool cache = s.charge == KVGC_PREFIX_CHARGE_CACHE;
  const kvgc_tools::ShareRow &budget = sp.rows[2], &evict = sp.rows[3], &int4 = sp.rows[5];
  std::string note = "shared (KVGC_PREFIX_CHARGE=" + std::string(cache ? "cache" : "shrink") +
                     "): the prefix cache holds the prefix's " +
                     count_of(sp.shared_pages, "page") + " once (" +
                     format_bytes(sp.rows[1].once_bytes) + " in " + dtype + ")";
  if (!cache)
    note += "; under eviction + int4, once its requests have ranked it, the pages none keeps "
            "at " + dtype + " (1\x01-\x01keep\x01x\x01(1\x01-\x01" "demote) of them, if they agree on "
            "them: one prompt, its heavy hitters) are re-stored at int4: " +
            format_bytes(int4.once_bytes) + " (" + format_bytes(int4.once_whole) + " before)";
  note += ". Each request holds ";
  if (s.header_bytes)
    note += "a " + format_bytes(s.header_bytes) +
            " header page per shared page per layer (its live bits, positions and scores; " +
            format_bytes(sp.rows[1].header_bytes) + " a request) and ";
  note += "its own tokens";
  if (sp.tail_tokens)
    note += ": the prefix's last " + format_count(sp.tail_tokens) +
            " past its whole pages and its U (own\x01=\x01" + format_count(evict.tokens) + ").";
  else
    note += " (own\x01=\x01U\x01=\x01" + format_count(evict.tokens) + ").";
  if (!s.header_bytes)
    note += " Not counted: its header page per shared page per layer, whose size kvgc did "
            "not give (" + header_err + ").";
  note += " Under eviction a request's budget is --keep of its whole length, as unshared, ";
  if (cache)
    note += "spent on its own tokens (the prefix is never pruned): it keeps "
            "min(own,\x01keep\x01x\x01(P+U)); sharing never leaves it fewer of its own tokens.";
  else
    note += "spent on the prefix's tokens and its own alike (it decides as unshared; the prefix "
            "tokens it keeps cost it only the headers): it keeps at most "
            "min(own,\x01keep\x01x\x01(P+U)) of its own, as counted here, and at least "
            "keep\x01x\x01own\x01=\x01" + format_count(evict.kept_min) + " (served, a request "
            "kept mostly its own tokens: docs/PLAN.md).";
  note += " Here it keeps min(" + format_count(evict.tokens) + ",\x01" + format_count(budget.kept) +
          ")\x01=\x01" + format_count(evict.kept) + " (the int4 row: " + format_count(int4.int4) +
          " of them int4).";
  print_wrapped(note);
}

void print_report(const kvgc_tools::ModelShape& shape, const kvgc_tools::PlanParams& p,
                  const kvgc_tools::Plan& plan, const kvgc_tools::ShareParams* share,
                  const kvgc_tools::SharePlan* share_plan, const std::string& header_err) {
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

  if (share) print_sharing(p, *share, *share_plan, header_err);

  std::string name = shape.name;
  std::replace_if(name.begin(), name.end(), [](char ch) { return ch == ' ' || ch == '\t'; }, '_');
  std::printf("\nRESULT model=%s kv_bytes_per_token=%llu full_ctx_fit=%llu evict_ctx_fit=%llu "
              "evict_int4_ctx_fit=%llu",
              name.c_str(), (unsigned long long)c.raw_model,
              (unsigned long long)plan.fits[0].max_context_batch1,
              (unsigned long long)plan.fits[1].max_context_batch1,
              (unsigned long long)plan.fits[2].max_context_batch1);
  if (share) {
    std::printf(" prefix_charge=%s", share->charge == KVGC_PREFIX_CHARGE_CACHE ? "cache" : "shrink");
    // Rows: full, evict, evict + int4, each unshared then shared.
    const auto& rows = share_plan->rows;
    const auto x = [](double v) { return v > 0 && std::isfinite(v) ? v : 0.0; };
    std::printf(" shared_prefix=%llu requests=%llu own=%llu full_shared_x=%.3f "
                "evict_shared_x=%.3f evict_int4_shared_x=%.3f evict_int4_shared_vs_full_x=%.3f",
                (unsigned long long)share->prefix_tokens, (unsigned long long)share->requests,
                (unsigned long long)share->own_tokens, x(rows[1].vs_unshared),
                x(rows[3].vs_unshared), x(rows[5].vs_unshared), x(rows[5].vs_full));
  }
  std::printf("\n");
}

int run(int argc, char** argv) {
  Options o;
  if (const auto msg = parse_args(argc, argv, &o)) return usage_error(*msg);
  if (o.help) {
    std::fputs(kUsage, stdout);
    return 0;
  }

  if ((o.requests || o.own || o.charge) && !o.shared_prefix)
    return usage_error(std::string(o.requests ? "--requests" : o.own ? "--own" : "--prefix-charge") +
                       " describes the requests sharing a prefix: give --shared-prefix too");

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

  std::optional<kvgc_tools::ShareParams> share;
  kvgc_tools::SharePlan share_plan;
  std::string header_err;
  if (o.shared_prefix) {
    share.emplace();
    share->prefix_tokens = *o.shared_prefix;
    share->own_tokens = o.own.value_or(512);
    share->requests = o.requests.value_or(p.batches.back());  // sorted: the largest
    share->header_bytes = kvgc_tools::header_page_bytes(p.model, p.page_tokens, &header_err);
    share->charge = o.charge.value_or(KVGC_PREFIX_CHARGE_SHRINK);
    if (!kvgc_tools::make_share_plan(p, *share, &share_plan, &err)) return usage_error(err);
  }
  print_report(shape, p, plan, share ? &*share : nullptr, &share_plan, header_err);
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
