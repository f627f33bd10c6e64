// The arithmetic behind kvgc-plan: what a model's KV cache costs per token, how large
// the full cache is at each context and batch, and how many tokens a byte budget holds
// with and without eviction and int4 demotion. Every byte count comes from the public
// kvgc_kv_bytes(), so the planner agrees with what a kvgc heap actually allocates
// (whole pages, slot metadata included; slab tails and arena rounding are not counted).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "kvgc.h"

namespace kvgc_tools {

// Budgets above this are refused so that no byte count in a plan can overflow.
constexpr uint64_t kMaxBudgetBytes = uint64_t(1) << 50;  // 1024 TiB
constexpr uint64_t kMaxContext = uint64_t(1) << 32;
constexpr uint64_t kMaxBatch = uint64_t(1) << 20;
// Fits are reported up to this many context tokens (reached only with a tiny `keep`).
constexpr uint64_t kMaxFitTokens = uint64_t(1) << 62;

struct PlanParams {
  kvgc_model_desc model{};
  uint32_t page_tokens = 16;
  uint64_t budget_bytes = uint64_t(80) << 30;
  double keep = 0.25;   // fraction of each sequence's tokens kept under eviction, (0, 1]
  double demote = 0.5;  // fraction of the kept tokens stored int4, [0, 1]
  std::vector<uint64_t> contexts;  // rows of the full-cache table
  std::vector<uint64_t> batches;   // columns of both tables
};

enum class FitMode {
  kFull,       // every token kept in the model dtype
  kEvict,      // `keep` of each sequence's tokens kept, in the model dtype
  kEvictInt4,  // `keep` kept, `demote` of those stored int4
};
constexpr FitMode kFitModes[] = {FitMode::kFull, FitMode::kEvict, FitMode::kEvictInt4};

struct TokenCost {
  uint64_t raw_model = 0;        // K+V payload of one token, all layers, model dtype
  uint64_t raw_int4 = 0;         // the same in int4 (nibbles + per-group scale/zero)
  uint64_t page_model = 0;       // one kvgc page in every layer, model-dtype class
  uint64_t page_int4 = 0;        // one kvgc page in every layer, int4 class
  double paged_model = 0;        // page_model / page_tokens
  double paged_int4 = 0;         // page_int4 / page_tokens
};

struct Fit {
  FitMode mode = FitMode::kFull;
  // Context tokens the budget covers in whole pages, summed over any number of sequences
  // (no per-sequence tail pages, hence a little above batch 1's max_context).
  uint64_t total_tokens = 0;
  uint64_t max_context_batch1 = 0;    // the longest single sequence
  std::vector<uint64_t> max_context;  // per PlanParams::batches[i]: per-sequence context
};

struct Plan {
  TokenCost cost;
  // [context i][batch j]: bytes kvgc holds for batches[j] sequences of contexts[i] tokens
  // each, every token kept; UINT64_MAX if that overflows 64 bits.
  std::vector<std::vector<uint64_t>> full_cache_bytes;
  std::vector<Fit> fits;  // one per kFitModes entry, in that order
};

// Checks `p` (model via kvgc, page_tokens, budget, fractions, lists) and computes the plan.
bool make_plan(const PlanParams& p, Plan* out, std::string* err);

// Tokens of a `context`-token sequence that stay after eviction (all of them for kFull),
// and how many of those are int4 (0 unless kEvictInt4).
uint64_t kept_tokens(const PlanParams& p, FitMode mode, uint64_t context);
uint64_t int4_tokens(const PlanParams& p, FitMode mode, uint64_t context);

// Bytes kvgc holds for one sequence of `context` tokens under `mode`; UINT64_MAX when
// it keeps more than 2^40 tokens (kvgc_kv_bytes' limit) or needs more than 2^62 bytes.
// `p` must have passed make_plan's checks.
uint64_t sequence_bytes(const PlanParams& p, FitMode mode, uint64_t context);

// The longest context each of `batch` sequences can have within the budget (0 if not
// even one token fits), capped at kMaxFitTokens.
uint64_t max_context(const PlanParams& p, FitMode mode, uint64_t batch);

// Command-line value forms, shared with the tests.
// Bytes: "80G", "24GiB", "1.5T", "512M", "1048576" (K/M/G/T are binary, case-insensitive,
// optionally followed by B or iB; a plain number must be whole). Zero is refused.
std::optional<uint64_t> parse_byte_size(std::string_view s);
// "1,8,32" or "4k,32K" (k = 1024): positive integers, each at most `max`.
std::optional<std::vector<uint64_t>> parse_count_list(std::string_view s, uint64_t max);
// A positive integer up to `max`.
std::optional<uint64_t> parse_count(std::string_view s, uint64_t max);
// "0.25" or "25%": a finite number in [0, 1].
std::optional<double> parse_fraction(std::string_view s);

// "512 B", "22.50 KiB", "1.17 GiB"; "overflow" for UINT64_MAX.
std::string format_bytes(uint64_t bytes);
std::string format_bytes(double bytes);
// 3578480 -> "3,578,480".
std::string format_count(uint64_t n);

}  // namespace kvgc_tools
