// The options table: every KVGC_* variable with its default, accepted forms, parser
// and doc line, in one place (mimalloc's options.c is the model). Read once, when a
// heap is created; a malformed value is an error naming the variable, never a default.
#pragma once

#include <cstdio>
#include <string>
#include <string_view>
#include <vector>

#include "status.hpp"

namespace kvgc {

struct OptionDoc {
  const char* env;      // "KVGC_POLICY"
  const char* forms;    // accepted forms, as printed in errors
  const char* deflt;    // default, as text
  const char* doc;      // one line
};

// The table, in the order the README and KVGC_VERBOSE print it.
const std::vector<OptionDoc>& option_docs();

// Fills `o` from the defaults (what kvgc_heap_options_init sets).
void options_defaults(kvgc_heap_options* o);

// Checks every field of a caller's struct: ranges and enum values; the message names
// the field ("opts->page_tokens").
Status options_validate(const kvgc_heap_options& o);

// Applies KVGC_* over `o`. `getenv_fn` is injectable so tests need not touch the
// process environment. The message names the variable and its accepted forms.
// KVGC_LAYER_BUDGET=entropy:FILE sets layer_budget to ENTROPY and *layer_profile to FILE
// (the heap reads it: it knows the layer count).
using GetEnv = const char* (*)(const char*);
Status options_from_env(kvgc_heap_options* o, GetEnv getenv_fn,
                        std::string* layer_profile = nullptr);

// Reads a layer-budget profile: one positive weight per layer ('#' starts a comment),
// each a number a float holds as a normal, finite, positive value. The message names
// `what` (the variable or field), the file and the line.
Status read_layer_profile(const std::string& path, uint32_t n_layers, const char* what,
                          std::vector<float>* weights);
// The same over a profile's text (`path` only names it in messages): what the file
// reader and the fuzzer call. Memory: the weights, at most n_layers of them.
Status parse_layer_profile(std::string_view text, const std::string& path, uint32_t n_layers,
                           const char* what, std::vector<float>* weights);

// The effective configuration, one "KVGC_X=value" per line (for KVGC_VERBOSE=1).
std::string options_describe(const kvgc_heap_options& o);

// Parsers, exposed for tests and tools (kvgc-plan reads budgets the same way).
// "512M", "2G", "1.5G", "1048576", "64K" -> bytes (binary units). "40%" -> fraction.
bool parse_bytes_or_percent(const std::string& s, uint64_t* bytes, double* fraction);
// "4096" -> count; "0.25" or "25%" -> fraction of the sequence length.
bool parse_count_or_fraction(const std::string& s, uint64_t* count, double* fraction);

const char* policy_name(kvgc_policy p);
const char* device_name(kvgc_device d);
const char* dtype_name(kvgc_dtype d);
const char* demote_name(kvgc_demote d);

}  // namespace kvgc
