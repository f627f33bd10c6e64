// CUDA executor for the GC's data-plane ops (kernels/cpu/gc.cpp is the specification,
// reproduced bit for bit): gc.cu holds observe and compact, gc_select.cu and
// gc_decide.cu the decision op. Thin host wrappers that return the first cudaError_t
// for the backend to turn into KVGC_EDEVICE. Host arrays in the ops (pages, runs,
// moves) may be reused as soon as a wrapper returns.
//
// Streams:
//   - observe and compact are enqueued on `stream` and never synchronise: pages and
//     moves travel as kernel parameters (no host-to-device copy, no scratch).
//   - select enqueues its kernels and then copies its page-level results (page_live and
//     the SelectResult: a few bytes per page) into the op's host pointers with
//     cudaMemcpyAsync (pinned memory: the copy does not wait); they are complete once
//     an event recorded after the op has passed (runtime/harvest.cpp).
#pragma once

#include <cuda_runtime.h>

#include "../ops.hpp"

namespace kvgc::cuda {

// Adds mass[row] to each live slot's score (row = SegPage::out_row + the slot's rank
// among its page's live slots; by_slot: row = page index * page_tokens + slot). The page
// list must match the live bits. With dev_pages (a batch's table, already on the
// device) one launch covers every page; otherwise pages travel as kernel parameters.
cudaError_t observe(const ObserveOp& op, cudaStream_t stream);

// Pairs the first holes of each move's dst with the last live slots of its src (moves
// in order; a later move may reuse a page), copies K/V (+ int4 scale/zero) and metadata,
// flips live bits. A page may not be both a destination and a source in one op (the
// planner never does that): such an op, a null page or a count above page_tokens is
// cudaErrorInvalidValue before anything is enqueued.
cudaError_t compact(const CompactOp& op, cudaStream_t stream);

// The GC's decision op over one segment, with the scratch in op.scratch. Errors before
// anything is enqueued: cudaErrorMemoryAllocation (scratch too small for the segment),
// cudaErrorNotSupported (a segment of 2^32 slots or more).
cudaError_t select(const SelectOp& op, cudaStream_t stream);

// Scratch select needs for a segment of up to max_slots slots (pages x page_tokens, of
// either class): per slot a 64-bit sort key and a 32-bit index (twice: the radix sort
// ping-pongs), a fate byte and a demotion index, plus the page list, the demotion runs
// and CUB's temporary storage. Asks CUB for its part, so it needs a current device.
size_t gc_scratch_bytes(uint64_t max_slots, uint32_t page_tokens);

}  // namespace kvgc::cuda
