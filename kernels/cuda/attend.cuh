// CUDA paged attention with fused scores (see attend.cu). Enqueues on `stream`, never
// synchronises; `scratch` is device memory the heap reserves at creation (the page list,
// logits, split partials), stream-ordered: attention calls on one heap must not overlap
// on different streams.
#pragma once

#include <cuda_runtime.h>

#include "../ops.hpp"

namespace kvgc::cuda {

// cudaErrorNotSupported for head_dim > 256; cudaErrorMemoryAllocation if even one query's
// logits do not fit the scratch.
cudaError_t attend(const AttendOp& op, void* scratch, size_t scratch_bytes, int n_sm,
                   cudaStream_t stream);

// Scratch that lets one query attend over max_tokens live tokens (the heap sizes it for
// a segment as long as the whole arena).
size_t attend_scratch_bytes(uint64_t max_tokens, uint32_t q_heads, uint32_t head_dim,
                            uint32_t page_tokens);

}  // namespace kvgc::cuda
