// Internal access from a C handle to the heap behind it, for kvgc's own tests and tools
// that link the core library (never installed).
#pragma once

#include "../runtime/heap.hpp"
#include "kvgc.h"

namespace kvgc {
ManagedHeap* internal_heap(kvgc_heap* heap);
}
