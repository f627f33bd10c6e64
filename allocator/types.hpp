// Allocator vocabulary (host logic only: no device code, no CUDA, testable on fake
// addresses the way RMM tests its arenas).
//
//   arena     [base, base + slabs * slab_bytes): the one reservation, as plain numbers.
//   slab      slab_bytes of the arena, carved into pages of one storage class, or free.
//   page      page_bytes[class] of a slab; owned by one segment or free.
//   PageId    (slab << index_bits) | page index: address = base + slab * slab_bytes +
//             index * page_bytes[class of slab]. Dense, stable while the page lives.
//   segment   an owner id (the runtime's (sequence, layer)); the allocator only records
//             it, so that heap_check can prove every page has exactly one owner.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvgc {

using PageId = uint32_t;
using SegmentId = uint32_t;
constexpr PageId kNoPage = UINT32_MAX;
constexpr SegmentId kNoSegment = UINT32_MAX;
constexpr int kNumClasses = 2;  // KVGC_CLASS_COUNT, without pulling in the C header

}  // namespace kvgc
