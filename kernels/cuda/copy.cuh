// CUDA executor for append and gather (kernels/cpu/copy.hpp is the specification).
// Thin host wrappers: they enqueue on `stream`, never synchronise, and return the
// launch's cudaError_t for the backend to turn into KVGC_EDEVICE. Gather copies FP16
// pages and dequantises INT4 pages (after demotion) exactly as the CPU does.
#pragma once

#include <cuda_runtime.h>

#include "../ops.hpp"

namespace kvgc::cuda {

// With op.dev_runs one launch reads every run from device memory; otherwise the runs
// travel as kernel parameters (a launch per 1024 runs).
cudaError_t append(const AppendOp& op, cudaStream_t stream);
cudaError_t gather(const GatherOp& op, cudaStream_t stream);

}  // namespace kvgc::cuda
