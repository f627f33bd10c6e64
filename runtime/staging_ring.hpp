// A ring of host memory that ops read asynchronously (pinned on CUDA, through
// Backend::result_alloc): the attention op's page list travels through it, so that its
// upload to the device never waits for pageable memory to be staged (which may
// synchronise the stream). Each use takes the next bytes; an event recorded after the
// op that reads them marks when they are free again. Taking bytes an unfinished op still
// reads waits for that op's event, which happens only when the host runs a whole ring
// ahead of the device.
//
// Lifetime: one per heap, used under the heap's lock. release() waits for everything
// still in flight; the destructor does nothing, so call release() first.
#pragma once

#include <cstddef>
#include <cstdint>

#include "backend.hpp"

namespace kvgc {

class StagingRing {
 public:
  static constexpr uint32_t kSlots = 64;  // uses in flight before the oldest is waited for

  // Space for `bytes` (16-byte aligned) that no unfinished use reads; grows the ring when
  // it is too small (after waiting for everything in flight).
  Status take(Backend& b, size_t bytes, void** out);
  // Marks the last take as read by the work enqueued on `stream` so far.
  Status enqueued(Backend& b, void* stream);
  void release(Backend& b);

  size_t capacity() const { return capacity_; }

 private:
  struct Use {
    size_t begin = 0, end = 0;
  };
  Status wait_oldest(Backend& b);
  // Where n bytes fit beside the uses in flight, or SIZE_MAX.
  size_t fit(size_t n) const;

  uint8_t* base_ = nullptr;
  size_t capacity_ = 0;
  Use uses_[kSlots];
  void* events_[kSlots] = {};       // one per slot, created on first use
  bool made_[kSlots] = {};
  uint32_t first_ = 0, count_ = 0;  // uses in flight, oldest first (the newest may not be
                                    // enqueued yet: its event is then unrecorded, done)
};

}  // namespace kvgc
