#include "layer_budget.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace kvgc {

host::vector<uint64_t> split_by_weights(const float* weights, uint32_t n_layers,
                                        uint64_t mean_budget, uint64_t min_per_layer) {
  host::vector<uint64_t> out(n_layers, mean_budget);
  if (n_layers < 2) return out;
  // A floor above the mean cannot hold for every layer: the total wins.
  min_per_layer = std::min(min_per_layer, mean_budget);
  const double total = double(mean_budget) * n_layers;
  // Every layer gets the floor; what is left is shared in proportion to the weights, so
  // the shape follows them and the total stays exact.
  // Every path that takes weights rejects the unusable ones (read_layer_profile, heap
  // creation for opts->layer_weights); should one arrive anyway, it counts as 0 rather
  // than turn the sum into inf or NaN (a NaN cast to an integer is undefined, and a
  // layer would keep everything while another kept almost nothing).
  auto usable = [&](uint32_t l) {
    return std::isfinite(weights[l]) && weights[l] > 0 ? double(weights[l]) : 0.0;
  };
  double wsum = 0;
  for (uint32_t l = 0; l < n_layers; ++l) wsum += usable(l);
  const double extra = total - double(min_per_layer) * n_layers;
  host::vector<double> want(n_layers);
  for (uint32_t l = 0; l < n_layers; ++l)
    want[l] = double(min_per_layer) + (wsum > 0 ? extra * usable(l) / wsum : extra / n_layers);
  // Largest remainders: floors first, then +1 to the biggest fractional parts.
  uint64_t assigned = 0;
  host::vector<std::pair<double, uint32_t>> frac(n_layers);
  for (uint32_t l = 0; l < n_layers; ++l) {
    out[l] = uint64_t(std::floor(want[l]));
    assigned += out[l];
    frac[l] = {want[l] - std::floor(want[l]), l};
  }
  const uint64_t target = mean_budget * n_layers;
  std::stable_sort(frac.begin(), frac.end(), [](auto& a, auto& b) { return a.first > b.first; });
  for (uint32_t i = 0; assigned < target && i < n_layers; ++i, ++assigned) ++out[frac[i].second];
  return out;
}

host::vector<uint64_t> split_layer_budget(kvgc_layer_budget kind, uint32_t n_layers,
                                          uint64_t mean_budget, uint64_t min_per_layer) {
  if (kind != KVGC_LAYER_BUDGET_PYRAMID || n_layers < 2)
    return host::vector<uint64_t>(n_layers, mean_budget);
  // PyramidKV: linear from the bottom (hi) to the top (lo); what rises above the floor is
  // what the weights share, so pass the rise as the weights.
  const double lo = double(mean_budget) / kPyramidBeta, hi = 2.0 * double(mean_budget) - lo;
  const double floor = double(std::min(min_per_layer, mean_budget));
  host::vector<float> rise(n_layers);
  for (uint32_t l = 0; l < n_layers; ++l)
    rise[l] = float(std::max(0.0, hi - (hi - lo) * l / (n_layers - 1) - floor));
  return split_by_weights(rise.data(), n_layers, mean_budget, min_per_layer);
}

}  // namespace kvgc
