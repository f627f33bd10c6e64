// CPU executor for the GC's data-plane ops (observe, select, compact): the
// specification, and a real backend.
#pragma once

#include "../ops.hpp"

namespace kvgc::cpu {

void observe(const ObserveOp& op);
void select(const SelectOp& op);
void compact(const CompactOp& op);

}  // namespace kvgc::cpu
