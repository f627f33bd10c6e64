#include "ladder.hpp"

#include <cstdio>

#include "../kernels/page_layout.hpp"

namespace kvgc {
namespace {

double error_of(int cls) {
  return cls == KVGC_CLASS_INT8   ? kInt8Error
         : cls == KVGC_CLASS_INT4 ? kInt4Error
         : cls == KVGC_CLASS_INT2 ? kInt2Error
                                  : 0.0;
}

}  // namespace

Ladder make_ladder(kvgc_demote demote, const uint64_t page_bytes[KVGC_CLASS_COUNT],
                   std::string* note) {
  note->clear();
  int chain[KVGC_CLASS_COUNT] = {KVGC_CLASS_FP16};
  int n = 1;
  auto want = [&](int cls) {
    const double cost = double(page_bytes[cls]) / double(page_bytes[KVGC_CLASS_FP16]);
    if (cost > kMaxDemoteCost) {
      char buf[160];
      std::snprintf(buf, sizeof buf, "%s left out: its pages are %.0f%% of fp16 pages (a rung "
                    "needs <= %.0f%%); ", class_name(cls), 100 * cost, 100 * kMaxDemoteCost);
      *note += buf;
      return;
    }
    chain[n++] = cls;
  };
  const bool ladder = demote == KVGC_DEMOTE_LADDER || demote == KVGC_DEMOTE_LADDER_INT2;
  if (demote == KVGC_DEMOTE_INT8 || ladder) want(KVGC_CLASS_INT8);
  if (demote == KVGC_DEMOTE_INT4 || ladder) want(KVGC_CLASS_INT4);
  if (demote == KVGC_DEMOTE_LADDER_INT2) want(KVGC_CLASS_INT2);
  // Slopes must increase down the ladder; a class whose rung in is steeper than its rung
  // out is dominated (storing its tokens one rung lower is cheaper for the same loss).
  auto cost = [&](int i) {  // position i of the chain, n = evicted
    return i < n ? double(page_bytes[chain[i]]) / double(page_bytes[KVGC_CLASS_FP16]) : 0.0;
  };
  auto err = [&](int i) { return i < n ? error_of(chain[i]) : 1.0; };
  // For SmolLM2's shape (3 KV heads, head_dim 64, f16, 16-token pages: INT8 pages cost
  // 0.53 and INT4 0.33 of an FP16 page) the default ladder's slopes are 0.014, 0.35 and
  // 2.8: at one exchange rate INT8's band spans weights 25x apart, INT4's 8x, and
  // eviction takes what is 8x lighter still.
  auto slope = [&](int i) { return (err(i + 1) - err(i)) / (cost(i) - cost(i + 1)); };
  for (bool changed = true; changed;) {
    changed = false;
    for (int i = 0; i + 1 < n; ++i)
      if (!(slope(i) < slope(i + 1))) {
        *note += std::string(class_name(chain[i + 1])) + " left out: dominated by the rung below it; ";
        for (int j = i + 1; j + 1 < n; ++j) chain[j] = chain[j + 1];
        --n;
        changed = true;
        break;
      }
  }
  Ladder L;
  L.n = uint8_t(n);
  for (int i = 0; i < n; ++i) {
    L.cls[i] = uint8_t(chain[i]);
    L.slope[i] = slope(i);
  }
  if (!note->empty()) note->resize(note->size() - 2);  // the last "; "
  return L;
}

}  // namespace kvgc
