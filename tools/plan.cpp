#include "plan.hpp"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdio>

namespace kvgc_tools {
namespace {

// Absorbs the rounding of keep * context (0.1 * 30 is 3.0000000000000004 in binary).
constexpr double kRoundingSlack = 1e-9;
constexpr uint64_t kMaxSequenceTokens = uint64_t(1) << 40;  // kvgc_kv_bytes' limit

uint64_t saturating_mul(uint64_t a, uint64_t b) {
  uint64_t r;
  return __builtin_mul_overflow(a, b, &r) ? UINT64_MAX : r;
}

uint64_t saturating_add(uint64_t a, uint64_t b) {
  uint64_t r;
  return __builtin_add_overflow(a, b, &r) ? UINT64_MAX : r;
}

uint64_t class_bytes(const PlanParams& p, uint64_t tokens, kvgc_storage_class cls) {
  uint64_t bytes = 0;
  return kvgc_kv_bytes(&p.model, tokens, cls, p.page_tokens, &bytes) == KVGC_OK ? bytes
                                                                                : UINT64_MAX;
}

bool fail(std::string* err, std::string msg) {
  if (err) *err = std::move(msg);
  return false;
}

// The model (kvgc_kv_bytes checks it and names what is wrong), page_tokens, the budget
// and the fractions; fills the per-page costs of `c`.
bool check_common(const PlanParams& p, TokenCost* c, std::string* err) {
  if (kvgc_kv_bytes(&p.model, 1, KVGC_CLASS_FP16, 0, &c->raw_model) != KVGC_OK ||
      kvgc_kv_bytes(&p.model, 1, KVGC_CLASS_INT4, 0, &c->raw_int4) != KVGC_OK ||
      kvgc_kv_bytes(&p.model, p.page_tokens, KVGC_CLASS_FP16, p.page_tokens, &c->page_model) !=
          KVGC_OK ||
      kvgc_kv_bytes(&p.model, p.page_tokens, KVGC_CLASS_INT4, p.page_tokens, &c->page_int4) !=
          KVGC_OK)
    return fail(err, kvgc_errmsg(nullptr));
  if (p.page_tokens == 0) return fail(err, "page_tokens must be in 1..256");  // 0: raw bytes
  if (p.budget_bytes == 0 || p.budget_bytes > kMaxBudgetBytes)
    return fail(err, "budget must be between 1 byte and 1024 TiB");
  if (!(p.keep > 0 && p.keep <= 1)) return fail(err, "keep must be in (0, 1]");
  if (!(p.demote >= 0 && p.demote <= 1)) return fail(err, "demote must be in [0, 1]");
  return true;
}

// Of `kept` tokens, how many `mode` stores int4: `demote` of them, rounded down.
uint64_t demoted_tokens(const PlanParams& p, FitMode mode, uint64_t kept) {
  if (mode != FitMode::kEvictInt4) return 0;
  return std::min<uint64_t>(uint64_t(std::floor(p.demote * double(kept) + kRoundingSlack)), kept);
}

std::optional<double> parse_number(std::string_view s) {
  double v = 0;
  const char* end = s.data() + s.size();
  const auto r = std::from_chars(s.data(), end, v);
  if (s.empty() || r.ec != std::errc() || r.ptr != end || !std::isfinite(v)) return std::nullopt;
  return v;
}

}  // namespace

uint64_t kept_tokens(const PlanParams& p, FitMode mode, uint64_t context) {
  if (mode == FitMode::kFull || context == 0) return context;
  const double kept = std::ceil(p.keep * double(context) - kRoundingSlack);
  return std::clamp<uint64_t>(uint64_t(std::max(kept, 1.0)), 1, context);
}

uint64_t int4_tokens(const PlanParams& p, FitMode mode, uint64_t context) {
  return demoted_tokens(p, mode, kept_tokens(p, mode, context));
}

uint64_t kept_bytes(const PlanParams& p, uint64_t kept, uint64_t int4) {
  int4 = std::min(int4, kept);
  // kvgc_kv_bytes takes at most 2^40 tokens, and past 2^62 / (page bytes) tokens the
  // result would pass 2^62 bytes, far above kMaxBudgetBytes: either way, "too big".
  uint64_t page_model = 0, page_int4 = 0;
  kvgc_kv_bytes(&p.model, p.page_tokens, KVGC_CLASS_FP16, p.page_tokens, &page_model);
  kvgc_kv_bytes(&p.model, p.page_tokens, KVGC_CLASS_INT4, p.page_tokens, &page_int4);
  const uint64_t largest_page = std::max({page_model, page_int4, uint64_t(1)});
  if (kept > kMaxSequenceTokens || kept > (uint64_t(1) << 62) / largest_page) return UINT64_MAX;
  const uint64_t model_bytes = class_bytes(p, kept - int4, KVGC_CLASS_FP16);
  const uint64_t int4_bytes = int4 ? class_bytes(p, int4, KVGC_CLASS_INT4) : 0;
  if (model_bytes == UINT64_MAX || int4_bytes == UINT64_MAX) return UINT64_MAX;
  return model_bytes + int4_bytes;
}

uint64_t sequence_bytes(const PlanParams& p, FitMode mode, uint64_t context) {
  return kept_bytes(p, kept_tokens(p, mode, context), int4_tokens(p, mode, context));
}

uint64_t max_context(const PlanParams& p, FitMode mode, uint64_t batch) {
  const uint64_t per_sequence = p.budget_bytes / std::max<uint64_t>(batch, 1);
  const auto fits = [&](uint64_t context) {
    return sequence_bytes(p, mode, context) <= per_sequence;
  };
  // sequence_bytes never decreases with context, so: double until it no longer fits,
  // then bisect. `lo` always fits (0 tokens cost nothing); `hi` never does.
  uint64_t lo = 0, hi = 1;
  while (fits(hi)) {
    lo = hi;
    if (hi >= kMaxFitTokens) return kMaxFitTokens;
    hi *= 2;
  }
  while (hi - lo > 1) {
    const uint64_t mid = lo + (hi - lo) / 2;
    (fits(mid) ? lo : hi) = mid;
  }
  return lo;
}

bool make_plan(const PlanParams& p, Plan* out, std::string* err) {
  Plan plan;
  TokenCost& c = plan.cost;
  if (!check_common(p, &c, err)) return false;
  if (p.contexts.empty() || p.batches.empty())
    return fail(err, "contexts and batches must not be empty");
  for (uint64_t x : p.contexts)
    if (x == 0 || x > kMaxContext) return fail(err, "contexts must be in 1..2^32");
  for (uint64_t x : p.batches)
    if (x == 0 || x > kMaxBatch) return fail(err, "batches must be in 1..2^20");

  // One page in every layer holds page_tokens tokens, so this is the exact per-token
  // rate of a full page; partial tail pages are what sequence_bytes adds on top.
  c.paged_model = double(c.page_model) / p.page_tokens;
  c.paged_int4 = double(c.page_int4) / p.page_tokens;

  for (uint64_t context : p.contexts) {
    const uint64_t one = sequence_bytes(p, FitMode::kFull, context);
    std::vector<uint64_t> row;
    for (uint64_t batch : p.batches) row.push_back(saturating_mul(one, batch));
    plan.full_cache_bytes.push_back(std::move(row));
  }

  for (FitMode mode : kFitModes) {
    Fit fit;
    fit.mode = mode;
    // Kept tokens the budget holds in whole pages (for int4, pages of both classes in
    // the demoted proportion), then the context they stand for.
    const double page_cost = mode == FitMode::kEvictInt4
                                 ? (1 - p.demote) * double(c.page_model) +
                                       p.demote * double(c.page_int4)
                                 : double(c.page_model);
    const double kept = std::floor(double(p.budget_bytes) / page_cost) * p.page_tokens;
    const double context = mode == FitMode::kFull ? kept : std::floor(kept / p.keep);
    fit.total_tokens = uint64_t(std::min(context, double(kMaxFitTokens)));
    fit.max_context_batch1 = max_context(p, mode, 1);
    for (uint64_t batch : p.batches) fit.max_context.push_back(max_context(p, mode, batch));
    plan.fits.push_back(std::move(fit));
  }
  *out = std::move(plan);
  return true;
}

bool make_share_plan(const PlanParams& p, const ShareParams& s, SharePlan* out,
                     std::string* err) {
  TokenCost c;
  if (!check_common(p, &c, err)) return false;
  if (s.prefix_tokens == 0 || s.prefix_tokens > kMaxContext)
    return fail(err, "shared prefix must be 1..2^32 tokens");
  if (s.own_tokens == 0 || s.own_tokens > kMaxContext)
    return fail(err, "own tokens must be 1..2^32 tokens");
  if (s.requests == 0 || s.requests > kMaxRequests)
    return fail(err, "requests must be in 1..2^20");
  // A header is the part of a page before its K/V: less than one page of one layer.
  if (s.header_bytes >= c.page_model / p.model.n_layers)
    return fail(err, "header bytes must be less than one page");

  SharePlan plan;
  plan.shared_pages = s.prefix_tokens / p.page_tokens;
  plan.tail_tokens = s.prefix_tokens % p.page_tokens;
  if (s.charge != KVGC_PREFIX_CHARGE_SHRINK && s.charge != KVGC_PREFIX_CHARGE_PRUNE &&
      s.charge != KVGC_PREFIX_CHARGE_CACHE)
    return fail(err, "prefix charge must be shrink (prune) or cache: view is not planned");
  const bool cache = s.charge == KVGC_PREFIX_CHARGE_CACHE;
  const uint64_t headers =
      saturating_mul(plan.shared_pages * p.model.n_layers, s.header_bytes);  // 2^44 x ...
  const uint64_t prefix_once =
      sequence_bytes(p, FitMode::kFull, plan.shared_pages * p.page_tokens);
  const auto total = [&](const ShareRow& r) -> double {  // no overflow: for the ratios
    if (r.once_bytes == UINT64_MAX || r.per_request == UINT64_MAX) return std::nan("");
    return double(r.once_bytes) + double(s.requests) * double(r.per_request);
  };
  for (FitMode mode : kFitModes) {
    for (bool shared : {false, true}) {
      ShareRow r;
      r.mode = mode;
      r.shared = shared;
      // Unshared, a request holds every token; shared, what it appends itself (the
      // prefix's tokens past its whole pages, and its own) plus its header pages. Its
      // budget is that of its whole length either way, spent (cache) on the tokens it
      // holds, or (shrink) on the prefix's and its own alike: it keeps all of its own if
      // the budget covers them (shrink: at most), as few as kept_tokens(own) (shrink).
      const uint64_t whole = s.prefix_tokens + s.own_tokens;  // <= 2^33 tokens
      r.tokens = shared ? plan.tail_tokens + s.own_tokens : whole;
      r.kept = std::min(r.tokens, kept_tokens(p, mode, whole));
      r.kept_min = shared && !cache ? std::min(r.kept, kept_tokens(p, mode, r.tokens)) : r.kept;
      r.int4 = demoted_tokens(p, mode, r.kept);
      r.once_whole = r.once_bytes = shared ? prefix_once : 0;
      if (shared && !cache && mode == FitMode::kEvictInt4) {
        // Holders of one prompt mostly agree on its heavy hitters: the prefix's share
        // that none keeps at fp16, 1 - keep x (1 - demote), in whole pages, at int4.
        const double fp16 = std::min(1.0, p.keep * (1 - p.demote));
        const uint64_t fp16_pages = std::min<uint64_t>(
            plan.shared_pages, uint64_t(std::ceil(fp16 * double(plan.shared_pages) - kRoundingSlack)));
        r.once_bytes = saturating_add(saturating_mul(fp16_pages, c.page_model),
                                      saturating_mul(plan.shared_pages - fp16_pages, c.page_int4));
      }
      r.header_bytes = shared ? headers : 0;
      r.per_request = saturating_add(kept_bytes(p, r.kept, r.int4), r.header_bytes);
      r.total_bytes =
          saturating_add(r.once_bytes, saturating_mul(r.per_request, s.requests));
      // per_request > 0: every request holds at least one page of its own.
      r.requests_fit = r.per_request == UINT64_MAX || r.once_bytes > p.budget_bytes
                           ? 0
                           : (p.budget_bytes - r.once_bytes) / r.per_request;
      r.vs_unshared = shared ? total(plan.rows.back()) / total(r) : 1;
      r.vs_full = total(plan.rows.empty() ? r : plan.rows.front()) / total(r);
      plan.rows.push_back(r);
    }
  }
  *out = std::move(plan);
  return true;
}

uint64_t header_page_bytes(const kvgc_model_desc& model, uint32_t page_tokens,
                           std::string* err) {
  // One layer of the model, on the CPU, the arena one slab (64 KiB, or one page when larger):
  // the layout of a page does not depend on the number of layers, and nothing is stored.
  kvgc_model_desc one = model;
  one.n_layers = 1;
  uint64_t page = 0;
  if (kvgc_kv_bytes(&one, page_tokens, KVGC_CLASS_FP16, page_tokens, &page) != KVGC_OK) {
    fail(err, kvgc_errmsg(nullptr));
    return 0;
  }
  kvgc_heap_options opts;
  kvgc_heap_options_init(&opts);
  opts.flags |= KVGC_OPT_IGNORE_ENV;
  opts.device = KVGC_DEVICE_CPU;
  opts.policy = KVGC_POLICY_FULL;
  opts.demote = KVGC_DEMOTE_OFF;
  opts.page_tokens = page_tokens;
  opts.slab_bytes = 64u << 10;  // the least; the heap grows it to hold one page
  opts.budget_bytes = std::max<uint64_t>(page, opts.slab_bytes);
  kvgc_heap* heap = nullptr;
  uint64_t bytes = 0;
  kvgc_stats stats;
  kvgc_stats_init(&stats);
  if (kvgc_heap_create(&one, &opts, &heap) != KVGC_OK ||
      kvgc_get_stats(heap, &stats) != KVGC_OK)
    fail(err, kvgc_errmsg(heap));
  else if (stats.version < 4)
    fail(err, "kvgc's statistics have no header pages (version " +
                  std::to_string(stats.version) + ", before 0.7)");
  else
    bytes = stats.cls_header.page_bytes;
  kvgc_heap_destroy(heap);
  return bytes;
}

std::optional<uint64_t> parse_byte_size(std::string_view s) {
  std::string num(s);
  const auto strip = [&](std::string_view suffix) {
    if (num.size() <= suffix.size()) return false;
    for (size_t i = 0; i < suffix.size(); ++i)
      if (std::tolower(static_cast<unsigned char>(num[num.size() - suffix.size() + i])) !=
          suffix[i])
        return false;
    num.resize(num.size() - suffix.size());
    return true;
  };
  if (!strip("ib")) strip("b");
  double multiplier = 1;
  const std::string_view units = "kmgt";
  if (!num.empty()) {
    const size_t unit = units.find(char(std::tolower(static_cast<unsigned char>(num.back()))));
    if (unit != std::string_view::npos) {
      num.pop_back();
      multiplier = std::ldexp(1.0, 10 * int(unit + 1));
    }
  }
  if (num.empty() || !std::isdigit(static_cast<unsigned char>(num[0]))) return std::nullopt;
  const std::optional<double> v = parse_number(num);
  if (!v || *v <= 0 || (multiplier == 1 && *v != std::floor(*v))) return std::nullopt;
  const double bytes = std::floor(*v * multiplier);
  if (bytes < 1 || bytes >= 18446744073709551616.0) return std::nullopt;
  return uint64_t(bytes);
}

std::optional<uint64_t> parse_count(std::string_view s, uint64_t max) {
  uint64_t multiplier = 1;
  if (!s.empty() && (s.back() == 'k' || s.back() == 'K')) {
    multiplier = 1024;
    s.remove_suffix(1);
  }
  uint64_t v = 0;
  const char* end = s.data() + s.size();
  const auto r = std::from_chars(s.data(), end, v);
  if (s.empty() || r.ec != std::errc() || r.ptr != end || v == 0) return std::nullopt;
  if (v > max / multiplier) return std::nullopt;
  return v * multiplier;
}

std::optional<std::vector<uint64_t>> parse_count_list(std::string_view s, uint64_t max) {
  std::vector<uint64_t> out;
  for (;;) {
    const size_t comma = s.find(',');
    const std::optional<uint64_t> v = parse_count(s.substr(0, comma), max);
    if (!v) return std::nullopt;
    out.push_back(*v);
    if (comma == std::string_view::npos) return out;
    s.remove_prefix(comma + 1);
  }
}

std::optional<double> parse_fraction(std::string_view s) {
  const bool percent = !s.empty() && s.back() == '%';
  if (percent) s.remove_suffix(1);
  if (s.empty() || !(std::isdigit(static_cast<unsigned char>(s[0])) || s[0] == '.'))
    return std::nullopt;
  std::optional<double> v = parse_number(s);
  if (!v) return std::nullopt;
  if (percent) *v /= 100;
  if (*v < 0 || *v > 1) return std::nullopt;
  return v;
}

std::string format_bytes(double bytes) {
  static const char* const kUnits[] = {"KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  char buf[48];
  if (bytes < 1024) {
    std::snprintf(buf, sizeof buf, "%.0f B", bytes);
    return buf;
  }
  int unit = -1;
  while (bytes >= 1024 && unit + 1 < int(std::size(kUnits))) {
    bytes /= 1024;
    ++unit;
  }
  std::snprintf(buf, sizeof buf, "%.2f %s", bytes, kUnits[unit]);
  return buf;
}

std::string format_bytes(uint64_t bytes) {
  return bytes == UINT64_MAX ? "overflow" : format_bytes(double(bytes));
}

std::string format_count(uint64_t n) {
  std::string digits = std::to_string(n), out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out.push_back(',');
    out.push_back(digits[i]);
  }
  return out;
}

}  // namespace kvgc_tools
