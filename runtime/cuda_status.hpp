// The CUDA executor's op-specific errors as kvgc statuses, shared by the CUDA backend and
// its host emulation (tests/cuda_emu), so both report them alike. Ok for any other code:
// the caller turns that into KVGC_EDEVICE with the device's own message.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "../kernels/ops.hpp"
#include "status.hpp"

namespace kvgc {

inline Status select_status(cudaError_t e, const SelectOp& op) {
  if (e == cudaErrorMemoryAllocation)
    return fail(KVGC_ENOMEM, "kvgc_step: the heap's scratch (" + std::to_string(op.scratch_bytes) +
                                 " bytes) is too small for a segment of " +
                                 std::to_string(op.n_pages) + " pages");
  if (e == cudaErrorNotSupported)
    return fail(KVGC_EUNSUPPORTED, "kvgc_step: a segment of " + std::to_string(op.n_pages) +
                                       " pages has 2^32 slots or more");
  return Status::Ok();
}

inline Status compact_status(cudaError_t e) {
  if (e == cudaErrorInvalidValue)
    return fail(KVGC_EINVAL, "compaction: malformed moves (a null or repeated page, a count "
                             "past page_tokens, or a page both source and destination)");
  return Status::Ok();
}

inline Status requant_status(cudaError_t e) {
  if (e == cudaErrorInvalidValue)
    return fail(KVGC_EINVAL, "requant: malformed pages (a null page, a destination not 16-byte "
                             "aligned, a used count past page_tokens, or layouts of different shapes)");
  return Status::Ok();
}

inline Status attend_status(cudaError_t e, const AttendOp& op) {
  if (e == cudaErrorNotSupported)
    return fail(KVGC_EUNSUPPORTED, "kvgc_attend: head_dim " + std::to_string(op.layout[0].head_dim) +
                                       " > 256 is not supported on the CUDA backend");
  if (e == cudaErrorMemoryAllocation)
    return fail(KVGC_ENOMEM, op.n_seqs ? "kvgc_batch_attend: the heap's attention scratch is too small "
                                         "for a query of the batch's longest sequence"
                                       : "kvgc_attend: the heap's attention scratch is too small for " +
                                             std::to_string(op.n_live) + " live tokens");
  if (e == cudaErrorInvalidValue)
    return fail(KVGC_EINVAL, "kvgc_batch_attend: a sequence's pages lie past the batch's " +
                                 std::to_string(op.n_pages) + "-page list");
  return Status::Ok();
}

}  // namespace kvgc
