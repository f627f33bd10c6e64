#include "compaction.hpp"

#include <algorithm>

namespace kvgc {

CompactionPlan plan_compaction(host::vector<PageCounts>& pages, uint32_t page_tokens) {
  CompactionPlan plan;
  if (pages.empty()) return plan;
  auto holes = [&](uint32_t i) {
    return pages[i].used == page_tokens ? page_tokens - pages[i].live : 0u;
  };
  uint32_t dst = 0, src = uint32_t(pages.size() - 1);
  while (true) {
    while (dst < src && holes(dst) == 0) ++dst;
    while (src > dst && pages[src].live == 0) --src;
    if (dst >= src) break;
    const uint32_t n = std::min(holes(dst), pages[src].live);
    plan.moves.push_back({dst, src, n});
    pages[dst].live += n;
    pages[src].live -= n;
    plan.slots_moved += n;
  }
  for (uint32_t i = 0; i < pages.size(); ++i)
    if (pages[i].live == 0) plan.freed.push_back(i);
  return plan;
}

}  // namespace kvgc
