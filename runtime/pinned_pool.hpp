// Blocks of host memory the device writes asynchronously (Backend::result_alloc: pinned
// on CUDA), for the GC's per-segment result blocks. cudaHostAlloc costs tens of
// microseconds and cudaFreeHost may synchronise the device, so neither belongs on the
// decode path (a segment's first GC, its block growing, a sequence ending): blocks come
// from 1 MiB chunks in power-of-two size classes and go back to a free list; chunks are
// returned to the backend only by release(), at heap destruction. Requests above the
// largest class go to the backend directly (segments of tens of thousands of pages).
//
// Used under the heap's lock. Blocks are 16-byte aligned.
#pragma once

#include <cstddef>
#include <cstdint>

#include "../allocator/host_memory.hpp"
#include "backend.hpp"

namespace kvgc {

class PinnedPool {
 public:
  static constexpr size_t kMinBlock = 1u << 10;    // 1 KiB
  static constexpr size_t kChunk = 1u << 20;       // 1 MiB: also the largest class
  static constexpr int kClasses = 11;              // 1 KiB .. 1 MiB

  // A block of at least `bytes`; *size receives what it holds (pass it back to free).
  Status alloc(Backend& b, size_t bytes, void** out, size_t* size);
  void free(Backend& b, void* p, size_t size);
  // Every chunk back to the backend. Blocks still handed out become invalid.
  void release(Backend& b);

  uint64_t chunks() const { return chunks_.size(); }

 private:
  struct FreeBlock {
    FreeBlock* next;
  };
  static int class_of(size_t bytes);

  FreeBlock* free_[kClasses] = {};
  host::vector<void*> chunks_;
  uint8_t* carve_ = nullptr;  // the newest chunk's unused tail
  size_t carve_left_ = 0;
};

}  // namespace kvgc
