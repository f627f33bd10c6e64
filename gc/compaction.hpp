// Compaction planning: which live slots move where so that tail pages empty and go back
// to their slab. Pure arithmetic over the host's per-page (used, live) counts; the move
// op (kernels/) picks the actual slots: the first holes of each destination, the last
// live slots of each source. In place, without scratch memory: a full arena must still
// be able to compact.
#pragma once

#include <cstdint>

#include "../allocator/host_memory.hpp"

namespace kvgc {

struct PageCounts {
  uint32_t used = 0;  // slots filled since the page was allocated
  uint32_t live = 0;
};

struct Move {
  uint32_t dst = 0, src = 0;  // indices into the page list
  uint32_t count = 0;         // live slots moved from src into holes of dst
};

struct CompactionPlan {
  host::vector<Move> moves;
  host::vector<uint32_t> freed;  // pages left with no live slot (ascending indices)
  uint64_t slots_moved = 0;
};

// Destinations are pages that are fully used (every dead slot is a hole), taken from the
// front; sources are taken from the back. Stops when they meet. `pages` is updated to
// the counts after the moves.
CompactionPlan plan_compaction(host::vector<PageCounts>& pages, uint32_t page_tokens);

}  // namespace kvgc
