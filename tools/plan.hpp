// The arithmetic behind kvgc-plan: what a model's KV cache costs per token, how large
// the full cache is at each context and batch, how many tokens a byte budget holds
// with and without eviction and int4 demotion, and what sharing a prompt prefix saves. Every byte count comes from the public
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
constexpr uint64_t kMaxRequests = kMaxBatch;  // requests sharing one prefix
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

// Bytes kvgc holds for `kept` tokens of one sequence, `int4` of them (at most `kept`;
// more counts as `kept`) in int4 and the rest in the model dtype: whole pages of each
// class. UINT64_MAX when it keeps more than 2^40 tokens (kvgc_kv_bytes' limit) or needs
// more than 2^62 bytes. `p` must have passed make_plan's checks.
uint64_t kept_bytes(const PlanParams& p, uint64_t kept, uint64_t int4);

// Bytes kvgc holds for one sequence of `context` tokens under `mode`: kept_bytes of its
// kept_tokens and int4_tokens, with the same limits.
uint64_t sequence_bytes(const PlanParams& p, FitMode mode, uint64_t context);

// The longest context each of `batch` sequences can have within the budget (0 if not
// even one token fits), capped at kMaxFitTokens.
uint64_t max_context(const PlanParams& p, FitMode mode, uint64_t batch);

// ---- sharing a prefix (the prefix cache: kvgc_prefix_keep, kvgc_prefix_attach) ----
// N requests whose first P tokens are one prompt prefix, each followed by U tokens of
// its own (the rest of its prompt and its output). Unshared, each request holds all of
// its P + U tokens. Shared, the prefix cache holds the prefix's whole pages once (what
// kvgc_prefix_keep keeps of a longer prompt: pages are shared whole), in the model dtype,
// and each request holds:
//   - a header page (its own live bits, positions, scores, generations) per shared page
//     per layer;
//   - the tokens it appends itself (its own): the prefix's last P % page_tokens tokens
//     and its U tokens. Under eviction its budget is `keep` of its whole length P + U,
//     as unshared (kept_tokens(P + U)), `demote` of the kept int4 (rounded as int4_tokens
//     rounds). It keeps min(own, kept_tokens(P + U)) of its own: under cache exactly (the
//     prefix is never pruned; never fewer than unshared), under shrink (the default;
//     prune the same) at most, since its budget is spent on the prefix's tokens and its
//     own alike (down to kept_tokens(own): kept_min), the prefix tokens it keeps costing
//     it only the headers. Under shrink with eviction + int4, the prefix's pages no
//     holder keeps at fp16 (1 - keep x (1 - demote) of them, if the holders agree) are
//     re-stored at int4 once ranked: once_bytes counts them so.
// (A cached prefix that ends in a partly filled page, a prompt kept whole, would cost
// that page once more and save nothing: each request copies it on its first append.)
struct ShareParams {
  uint64_t prefix_tokens = 0;  // P, 1..kMaxContext
  uint64_t own_tokens = 512;   // U, 1..kMaxContext
  uint64_t requests = 0;       // N, 1..kMaxRequests
  // One header page (one layer), from header_page_bytes(); 0 when unknown: header pages
  // are then not counted.
  uint64_t header_bytes = 0;
  // Who pays for the attached prefix (kvgc_prefix_charge): SHRINK (the default; PRUNE is
  // the same) or CACHE. VIEW is not planned (its demoted shared tokens are copies whose
  // number depends on what the GC ranks).
  kvgc_prefix_charge charge = KVGC_PREFIX_CHARGE_SHRINK;
};

struct ShareRow {
  FitMode mode = FitMode::kFull;
  bool shared = false;
  uint64_t tokens = 0;        // tokens each request holds itself: P + U unshared, own shared
  uint64_t kept = 0;          // of those, kept (all of them in the full cache)
  uint64_t int4 = 0;          // of the kept, stored int4 (0 unless kEvictInt4)
  uint64_t once_bytes = 0;    // the prefix, held once (0 unshared)
  // The prefix whole, in the model dtype: once_bytes but under shrink with eviction + int4,
  // where once_bytes is the prefix once its holders ranked it (its pages none keeps at
  // fp16 re-stored at int4, if they agree on them) and this what it costs before.
  uint64_t once_whole = 0;
  // Shrink: the fewest of its own tokens a request keeps (kept_tokens(own): its GC
  // keeping the prefix's tokens and its own alike); `kept` is the most (its own first).
  uint64_t kept_min = 0;
  uint64_t per_request = 0;   // bytes each request holds itself, header pages included
  uint64_t header_bytes = 0;  // of per_request: its header pages, all layers
  uint64_t total_bytes = 0;   // once_bytes + requests * per_request; UINT64_MAX: overflow
  uint64_t requests_fit = 0;  // requests of this shape the budget holds
  double vs_unshared = 1;     // the same mode unshared, total / this total
  double vs_full = 1;         // the full cache unshared, total / this total
};

struct SharePlan {
  uint64_t shared_pages = 0;  // P / page_tokens: the prefix's pages (per layer), shared
  uint64_t tail_tokens = 0;   // P % page_tokens: the prefix's tokens each request holds
  std::vector<ShareRow> rows; // per kFitModes entry: unshared, then shared
};

// Checks `s` (and `p` as make_plan does) and computes the sharing table.
bool make_share_plan(const PlanParams& p, const ShareParams& s, SharePlan* out,
                     std::string* err);

// The bytes of one header page for `model` at `page_tokens` tokens a page (a page's bytes
// before its K/V), as kvgc reports it: kvgc_get_stats()'s cls_header.page_bytes of a
// small CPU heap made for the purpose (one layer of the model, one slab). 0, with the
// reason in *err, when no such heap can be made.
uint64_t header_page_bytes(const kvgc_model_desc& model, uint32_t page_tokens, std::string* err);

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
