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

uint64_t class_bytes(const PlanParams& p, uint64_t tokens, kvgc_storage_class cls) {
  uint64_t bytes = 0;
  return kvgc_kv_bytes(&p.model, tokens, cls, p.page_tokens, &bytes) == KVGC_OK ? bytes
                                                                                : UINT64_MAX;
}

bool fail(std::string* err, std::string msg) {
  if (err) *err = std::move(msg);
  return false;
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
  if (mode != FitMode::kEvictInt4) return 0;
  const uint64_t kept = kept_tokens(p, mode, context);
  return std::min<uint64_t>(uint64_t(std::floor(p.demote * double(kept) + kRoundingSlack)), kept);
}

uint64_t sequence_bytes(const PlanParams& p, FitMode mode, uint64_t context) {
  const uint64_t kept = kept_tokens(p, mode, context);
  const uint64_t int4 = int4_tokens(p, mode, context);
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
  // kvgc_kv_bytes checks the model and page_tokens and names what is wrong.
  if (kvgc_kv_bytes(&p.model, 1, KVGC_CLASS_FP16, 0, &c.raw_model) != KVGC_OK ||
      kvgc_kv_bytes(&p.model, 1, KVGC_CLASS_INT4, 0, &c.raw_int4) != KVGC_OK ||
      kvgc_kv_bytes(&p.model, p.page_tokens, KVGC_CLASS_FP16, p.page_tokens, &c.page_model) !=
          KVGC_OK ||
      kvgc_kv_bytes(&p.model, p.page_tokens, KVGC_CLASS_INT4, p.page_tokens, &c.page_int4) !=
          KVGC_OK)
    return fail(err, kvgc_errmsg(nullptr));
  if (p.budget_bytes == 0 || p.budget_bytes > kMaxBudgetBytes)
    return fail(err, "budget must be between 1 byte and 1024 TiB");
  if (!(p.keep > 0 && p.keep <= 1)) return fail(err, "keep must be in (0, 1]");
  if (!(p.demote >= 0 && p.demote <= 1)) return fail(err, "demote must be in [0, 1]");
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
