// libFuzzer harness over the KVGC_* option parsers: the input is lines "I VALUE" (the
// first byte of a line picks a variable of the table, the rest of the line is its
// value), served through options_from_env's injectable getenv; the byte and count
// parsers also see each value alone. A set of variables the table accepts must give
// options that options_validate accepts; a refusal must name its variable. Anything
// else (a crash, a sanitizer report, an accepted-but-invalid struct) aborts.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "../../runtime/options.hpp"

namespace {

std::vector<std::pair<std::string, std::string>> g_env;

const char* fake_getenv(const char* name) {
  const char* found = nullptr;  // the last one wins, as with setenv
  for (const auto& [k, v] : g_env)
    if (k == name) found = v.c_str();
  return found;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto& docs = kvgc::option_docs();
  g_env.clear();
  for (size_t at = 0; at < size;) {
    const size_t nl = std::min<size_t>(size, size_t(std::find(data + at, data + size, '\n') - data));
    if (nl > at) {
      const std::string value(reinterpret_cast<const char*>(data + at + 1), nl - at - 1);
      g_env.emplace_back(docs[data[at] % docs.size()].env, value);
      uint64_t bytes, count;
      double fraction;
      (void)kvgc::parse_bytes_or_percent(value, &bytes, &fraction);
      (void)kvgc::parse_count_or_fraction(value, &count, &fraction);
    }
    at = nl + 1;
  }
  kvgc_heap_options o;
  kvgc::options_defaults(&o);
  std::string profile;
  const kvgc::Status st = kvgc::options_from_env(&o, fake_getenv, &profile);
  if (!st.ok()) {
    bool named = false;
    for (const auto& d : docs) named |= st.msg.rfind(d.env, 0) == 0;
    if (st.code != KVGC_EINVAL || !named) {
      std::fprintf(stderr, "refusal without its variable: %s\n", st.msg.c_str());
      std::abort();
    }
    return 0;
  }
  const kvgc::Status valid = kvgc::options_validate(o);
  if (!valid.ok()) {
    std::fprintf(stderr, "accepted from the environment, then invalid: %s\n", valid.msg.c_str());
    std::abort();
  }
  (void)kvgc::options_describe(o);
  return 0;
}
