// CUDA paged attention with fused scores (see attend.cu), for one segment or a batch of
// sequences (AttendOp::seqs) in a constant number of launches. Enqueues on `stream`,
// never synchronises; `scratch` is device memory the heap reserves at creation (the page
// list, the sequence table, the work list, logits, split partials), stream-ordered:
// attention calls on one heap must not overlap on different streams. Host arrays of the
// op (pages, seqs) are read by copies enqueued on the stream: pinned memory must stay
// untouched until the stream passes them, as for every op.
#pragma once

#include <cuda_runtime.h>

#include "../ops.hpp"

namespace kvgc::cuda {

// Errors before anything is enqueued: cudaErrorNotSupported for head_dim > 256;
// cudaErrorInvalidValue for a sequence whose pages lie past the op's page list;
// cudaErrorMemoryAllocation if even one query of the longest sequence does not fit the
// scratch.
cudaError_t attend(const AttendOp& op, void* scratch, size_t scratch_bytes, int n_sm,
                   cudaStream_t stream);

// Scratch that lets one query attend over max_tokens live tokens, and a decode batch
// (one query a sequence, every sequence at least a page) over the whole arena in one
// pass (the heap sizes it for an arena of max_tokens tokens).
size_t attend_scratch_bytes(uint64_t max_tokens, uint32_t q_heads, uint32_t head_dim,
                            uint32_t page_tokens);

// The least scratch `op` runs in: its tables and one query of its longest sequence in
// `splits` splits (1 to 256), one pass per query. For tests that force many passes.
size_t attend_min_scratch_bytes(const AttendOp& op, uint32_t splits = 1);

}  // namespace kvgc::cuda
