// CPU executor for append and gather: the specification the CUDA versions are tested
// against, and a real backend.
#pragma once

#include "../ops.hpp"

namespace kvgc::cpu {

void append(const AppendOp& op);
void gather(const GatherOp& op);

}  // namespace kvgc::cpu
