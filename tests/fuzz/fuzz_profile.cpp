// libFuzzer harness over the entropy-profile reader and the budget split it feeds: the
// first bytes pick the layer count, the budget and its floor, the rest is the profile's
// text. A profile that parses must give weights a float holds as normal, finite and
// positive values, and the split must then be exact (sum = layers x mean) with every
// layer at or above its floor. Anything else aborts.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <numeric>
#include <string_view>
#include <vector>

#include "../../gc/layer_budget.hpp"
#include "../../runtime/options.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 4) return 0;
  const uint32_t layers = 1 + data[0] % 128;
  const uint64_t mean = uint64_t(data[1]) * 37 + data[2];
  const uint64_t floor = data[3] * 3u;
  const std::string_view text(reinterpret_cast<const char*>(data + 4), size - 4);
  std::vector<float> w;
  const kvgc::Status st = kvgc::parse_layer_profile(text, "fuzz.txt", layers, "KVGC_LAYER_BUDGET", &w);
  if (!st.ok()) {
    if (st.code != KVGC_EINVAL || st.msg.find("fuzz.txt") == std::string::npos) std::abort();
    return 0;
  }
  if (w.size() != layers) std::abort();
  for (float x : w)
    if (!(std::isfinite(x) && x >= std::numeric_limits<float>::min())) std::abort();
  const auto b = kvgc::split_by_weights(w.data(), layers, mean, floor);
  if (std::accumulate(b.begin(), b.end(), uint64_t(0)) != mean * layers) {
    std::fprintf(stderr, "split total differs\n");
    std::abort();
  }
  for (uint64_t x : b)
    if (layers > 1 && x < std::min(floor, mean)) std::abort();
  return 0;
}
