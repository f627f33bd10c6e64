// CPU executor for the GC's data-plane ops (observe, select, compact, requant): the
// specification, and a real backend.
#pragma once

#include "../ops.hpp"

namespace kvgc::cpu {

void observe(const ObserveOp& op);
void select(const SelectOp& op);
void compact(const CompactOp& op);
void requant(const RequantOp& op);

}  // namespace kvgc::cpu
