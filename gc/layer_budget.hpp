// Splitting a per-segment token budget across layers. The GC enforces the result per
// segment; kvgc-plan prints it. Pure arithmetic, exact totals.
#pragma once

#include <cstdint>

#include "../allocator/host_memory.hpp"
#include "kvgc.h"

namespace kvgc {

// PyramidKV's ratio between the bottom and the top layer's budget is (2*beta - 1);
// with beta = 20 the top layer keeps 1/20 of the mean, the bottom 39/20.
constexpr double kPyramidBeta = 20.0;

// Budgets for layers 0..n_layers-1 whose sum is exactly n_layers * mean_budget:
// uniform gives each layer the mean; pyramid decreases linearly from the bottom
// (layer 0) to the top, as PyramidKV does. Rounding keeps the total exact (largest
// remainders); a layer never gets less than min_per_layer (sinks + window, say), the
// difference being taken from the layers above it in the pyramid.
host::vector<uint64_t> split_layer_budget(kvgc_layer_budget kind, uint32_t n_layers,
                                         uint64_t mean_budget, uint64_t min_per_layer = 0);

// Budgets in proportion to `weights` (one per layer, finite and > 0: callers check;
// any other counts as 0), summing exactly to n_layers * mean_budget, each at least
// min(min_per_layer, mean_budget). Pyramid
// is this with linearly decreasing weights; entropy with measured ones.
host::vector<uint64_t> split_by_weights(const float* weights, uint32_t n_layers,
                                        uint64_t mean_budget, uint64_t min_per_layer = 0);

}  // namespace kvgc
