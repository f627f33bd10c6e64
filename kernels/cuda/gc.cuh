// CUDA executor for the GC's data-plane ops (kernels/cpu/gc.cpp is the specification,
// reproduced bit for bit): gc.cu holds observe, compact and requant, gc_select.cu and
// gc_decide.cu the decision op. Thin host wrappers that return the first cudaError_t
// for the backend to turn into KVGC_EDEVICE. Host arrays in the ops (pages, runs,
// moves) may be reused as soon as a wrapper returns.
//
// Streams:
//   - observe and requant are enqueued on `stream` and never synchronise: pages travel as
//     kernel parameters (no host-to-device copy, no scratch).
//   - compact is enqueued on `stream` as one host-to-device copy of its move list (from a
//     CompactStaging ring, pinned) and one kernel launch, whatever its number of moves; it
//     waits only when the host runs a whole ring ahead of the device (CompactStaging).
//   - select enqueues its kernels; its page-level results (page_live, page_classes and
//     the SelectResult: a few bytes per page) reach the op's host pointers through the
//     kernels themselves (results_mapped: the runtime's pinned result blocks) or
//     cudaMemcpyAsync; they are complete once an event recorded after the op has passed
//     (runtime/harvest.cpp).
#pragma once

#include <cuda_runtime.h>

#include "../../allocator/host_memory.hpp"
#include "../ops.hpp"

namespace kvgc::cuda {

// Adds mass[row] to each live slot's score (row = SegPage::out_row + the slot's rank
// among its page's live slots; by_slot: row = page index * page_tokens + slot). The page
// list must match the live bits. With dev_pages (a batch's table, already on the
// device) one launch covers every page; otherwise pages travel as kernel parameters.
cudaError_t observe(const ObserveOp& op, cudaStream_t stream);

// compact's table of an op's pages on the host (gc.cu): an open-addressing hash of page
// pointers to their index in the upload, reused from op to op (entries of earlier ops
// carry older stamps), so an op costs no allocation once it has grown.
struct CompactPageIndex {
  struct Slot {
    const uint8_t* page;
    uint32_t index, stamp;
  };
  void reset(size_t pages);  // room for `pages` at most half full; empty (a new stamp)
  Slot& find(const uint8_t* page);  // page's slot (stamp current) or where it goes
  host::vector<Slot> slots;
  size_t used = 0;
  uint32_t stamp = 0, shift = 0;
};

// Where compact stages its uploads: a ring of pinned host memory and a ring of device
// memory of the same size, used alike (an op's upload lies at the same offset of both).
// Each op takes the next bytes of the ring; an event recorded after its kernel marks
// them free again (by then the copy has read the host bytes and the kernel the device
// ones), so the op's host array may be reused at once and no upload overwrites one an
// unfinished op still reads. Taking bytes that an unfinished op reads waits for that op,
// which happens only when the host runs a whole ring ahead of the device (kSlots ops, or
// the ring's bytes). The ring grows (after waiting for every op in flight) when an op
// could take more than an eighth of it (an op reserves 52 bytes a move: its moves and two
// pages each at most): a cudaMalloc of its own on the current device, outside the heap's
// arena (1 MiB at first; past that, 8 to 16 times the largest op's reservation: about
// 0.4 to 0.8 KiB a move of it), and a cudaMallocHost of the same size. Use it on one
// device, under one thread at a time (the backend's: under the heap's lock).
struct CompactStaging {
  static constexpr uint32_t kSlots = 64;  // ops in flight before the oldest is waited for
  CompactStaging() = default;
  ~CompactStaging() { release(); }
  void release();  // waits for the ops still in flight, frees both rings and the index
  CompactStaging(const CompactStaging&) = delete;
  CompactStaging& operator=(const CompactStaging&) = delete;
  // [*at, *at + want) of both rings, which no unfinished op reads. Errors:
  // cudaErrorMemoryAllocation (growing failed; the ring is as it was).
  cudaError_t take(size_t want, size_t* at);
  // Marks [at, at + used) as read by the work enqueued on `stream` so far.
  cudaError_t commit(size_t at, size_t used, cudaStream_t stream);
  uint8_t* host = nullptr;  // pinned
  uint8_t* dev = nullptr;
  size_t bytes = 0;
  uint64_t uploads = 0;  // host-to-device copies enqueued, one per non-empty op (tests)
  CompactPageIndex index;

 private:
  struct Use {
    size_t begin = 0, end = 0;
  };
  cudaError_t wait_oldest();
  size_t fit(size_t n) const;  // where n bytes fit beside the uses in flight, or SIZE_MAX
  Use uses_[kSlots];
  cudaEvent_t events_[kSlots] = {};
  uint32_t first_ = 0, count_ = 0;  // uses in flight, oldest first
};

// Pairs the first holes of each move's dst with the last live slots of its src (moves
// in order; a later move may reuse a page), copies K/V (+ int4 scale/zero) and metadata,
// flips live bits. One copy (the moves and the op's page table, 20 bytes a move and 16
// a page, from `stage`) and one launch: blocks per move, each pairing its slots from the
// masks as they were before the op; the last block to read a page's mask writes the
// page's final mask. A page may not be both a destination and a source in one op
// (the planner never does that): such an op, a null page or a count above page_tokens
// is cudaErrorInvalidValue before anything is enqueued; cudaErrorMemoryAllocation: the
// staging ring could not grow (nothing enqueued). An op of no moves enqueues nothing.
cudaError_t compact(const CompactOp& op, CompactStaging& stage, cudaStream_t stream);
// The same with a staging ring of the calling thread's (tests and benchmarks).
cudaError_t compact(const CompactOp& op, cudaStream_t stream);

// Re-stores K and V of slots [0, used) of each src page into the same slots of its dst
// (dst_layout: any class, through the model dtype, bit for bit as cpu::requant and as
// select's demotions store a token) after zeroing every dst page whole. Chunks of pages
// travel as kernel parameters (two launches a chunk: zero, then a block per page and
// slot). Layouts that disagree on anything but the class (or a head_dim past
// kMaxHeadDim), a null page, a dst not 16-byte aligned or a used count past page_tokens
// is cudaErrorInvalidValue before anything is enqueued.
cudaError_t requant(const RequantOp& op, cudaStream_t stream);

// Host memory select_batch stages its uploads in (every segment's parameters, pages and
// runs: one host-to-device copy per launch set). Pinned (the backend's: the copy never
// waits; an event guards its reuse by the next batch) or pageable (the copy returns once
// it has staged the bytes).
struct SelectStaging {
  explicit SelectStaging(bool pinned_memory = true) : pinned(pinned_memory) {}
  ~SelectStaging();
  SelectStaging(const SelectStaging&) = delete;
  SelectStaging& operator=(const SelectStaging&) = delete;
  cudaError_t reserve(size_t bytes);          // waits for the previous batch's upload
  cudaError_t recorded(cudaStream_t stream);  // marks the uploads just enqueued
  void* host = nullptr;
  size_t bytes = 0;
  bool pinned;
  bool in_flight = false;
  cudaEvent_t ready = nullptr;
};

// The GC's decision op over one segment, with the scratch in op.scratch. Errors before
// anything is enqueued: cudaErrorMemoryAllocation (scratch too small for the segment),
// cudaErrorNotSupported (a segment of 2^32 slots or more). select_batch with n = 1 and a
// pageable staging block.
cudaError_t select(const SelectOp& op, cudaStream_t stream);

// select over ops[0, n) (every op's scratch the same: ops[0]'s), with the same decisions
// as n selects in order, in a constant number of launches whatever n is: a flat index
// space over every segment's pages, runs, slots and demotions, each segment's parameters
// in a device array, one segmented sort (DeviceSegmentedRadixSort; one segment keeps
// DeviceRadixSort), the decisions a block per segment. Results: ops with results_mapped
// are written by the kernels where the host reads them; the others are copied back, two
// copies each. If the scratch cannot hold the batch (it is sized for kScratchSegs = 1024
// segments over the longest segment the arena holds), consecutive segments go in as many
// launch sets as needed. *launched: the ops enqueued; on cudaErrorMemoryAllocation (one
// segment alone exceeds the scratch) those before it were.
cudaError_t select_batch(const SelectOp* ops, uint32_t n, SelectStaging& stage, cudaStream_t stream,
                         uint32_t* launched);
// The scratch select_batch needs for `op` alone (tests: a scratch that forces launch sets).
size_t select_scratch_bytes(const SelectOp& op);

// Scratch select needs for a segment of up to max_slots slots (pages x page_tokens, of
// either class): per slot a 64-bit sort key and a 32-bit index (twice: the radix sort
// ping-pongs), a fate byte and a demotion index, plus the page list, the demotion runs
// and CUB's temporary storage. Asks CUB for its part, so it needs a current device.
size_t gc_scratch_bytes(uint64_t max_slots, uint32_t page_tokens);

}  // namespace kvgc::cuda
