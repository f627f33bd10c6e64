#include "layer_budget.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace kvgc {

host::vector<uint64_t> split_layer_budget(kvgc_layer_budget kind, uint32_t n_layers,
                                         uint64_t mean_budget, uint64_t min_per_layer) {
  host::vector<uint64_t> out(n_layers, mean_budget);
  if (kind == KVGC_LAYER_BUDGET_UNIFORM || n_layers < 2) return out;

  // A floor above the mean cannot hold for every layer: the total wins.
  min_per_layer = std::min(min_per_layer, mean_budget);
  const double total = double(mean_budget) * n_layers;
  const double lo = double(mean_budget) / kPyramidBeta;  // top layer
  const double hi = 2.0 * double(mean_budget) - lo;      // bottom layer
  // Every layer gets the floor; what is left is shared in proportion to how far the
  // pyramid rises above the floor, so the shape stays monotone and the total exact.
  host::vector<double> want(n_layers), rise(n_layers);
  double rise_sum = 0;
  for (uint32_t l = 0; l < n_layers; ++l) {
    const double p = hi - (hi - lo) * l / (n_layers - 1);
    rise[l] = std::max(0.0, p - double(min_per_layer));
    rise_sum += rise[l];
  }
  const double extra = total - double(min_per_layer) * n_layers;
  for (uint32_t l = 0; l < n_layers; ++l)
    want[l] = double(min_per_layer) +
              (rise_sum > 0 ? extra * rise[l] / rise_sum : extra / n_layers);
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

}  // namespace kvgc
