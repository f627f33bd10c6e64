// Allocator vocabulary (host logic only: no device code, no CUDA, testable on fake
// addresses the way RMM tests its arenas).
//
//   arena     [base, base + slabs * slab_bytes): the one reservation, as plain numbers.
//   slab      slab_bytes of the arena, carved into pages of one storage class, or free.
//   page      page_bytes[class] of a slab; owned by one segment or free.
//   PageId    (slab << index_bits) | page index: address = base + slab * slab_bytes +
//             index * page_bytes[class of slab]. Dense, stable while the page lives.
//   segment   an owner id (the runtime's (sequence, layer)); the allocator only records
//             it, so that heap_check can prove every page has exactly one owner (a
//             shared page's owner is kSharedOwner: the runtime counts its holders).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

// Assert levels (meson -Dassert_level): 0 none; 1 cheap O(1) checks (default); 2 also
// runs the invariant walker after every mutating API call (debug builds).
#ifndef KVGC_ASSERT_LEVEL
#define KVGC_ASSERT_LEVEL 1
#endif
#if KVGC_ASSERT_LEVEL >= 1
#define KVGC_ASSERT(cond)                                                              \
  do {                                                                                 \
    if (!(cond)) {                                                                     \
      std::fprintf(stderr, "kvgc: assertion failed: %s (%s:%d)\n", #cond, __FILE__, __LINE__); \
      std::abort();                                                                    \
    }                                                                                  \
  } while (0)
#else
#define KVGC_ASSERT(cond) ((void)0)
#endif

namespace kvgc {

using PageId = uint32_t;
using SegmentId = uint32_t;
constexpr PageId kNoPage = UINT32_MAX;
// Segment ids use 31 bits: a page descriptor's owner word with the top bit set means
// "free", its low bits then link the slab's free list (see slab.hpp).
constexpr SegmentId kNoSegment = UINT32_MAX;
constexpr SegmentId kMaxSegments = 0x7fffffffu;
// The storage classes (KVGC_CLASS_COUNT, without pulling in the C header), then the
// header class: a shared page's per-holder slot metadata (runtime/shared.cpp), a page's
// bytes before its K/V. A pool may leave it out (page_bytes 0).
constexpr int kNumStorageClasses = 4;
constexpr int kHeaderClass = 4;
constexpr int kNumClasses = 5;
// The owner of a shared page: its holders are the segments whose header pages name it.
constexpr SegmentId kSharedOwner = kMaxSegments - 1;

}  // namespace kvgc
