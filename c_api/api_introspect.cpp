// C entry points that look inside a heap: stats, a sequence's tokens, reads of its
// K/V, scores and classes, and the page layout.
#include <cstring>

#include "../runtime/heap.hpp"
#include "checks.hpp"
#include "kvgc.h"

using kvgc::fail;
using kvgc::Status;
using namespace kvgc::capi;

extern "C" {

kvgc_status kvgc_stats_init(kvgc_stats* out) {
  return guarded(nullptr, [&]() -> Status {
    if (!out) return fail(KVGC_EINVAL, "kvgc_stats_init: out is NULL");
    std::memset(out, 0, sizeof *out);
    out->struct_size = sizeof *out;
    return Status::Ok();
  });
}

kvgc_status kvgc_get_stats(kvgc_heap* heap, kvgc_stats* out) {
  return with_heap(heap, "kvgc_get_stats", [&](kvgc::ManagedHeap& h) -> Status {
    if (!out) return fail(KVGC_EINVAL, "kvgc_get_stats: out is NULL");
    // Callers of versions 1 to 4 (a smaller struct) get the fields they know.
    const size_t size = out->struct_size;
    if (size != KVGC_STATS_V1_SIZE && size != KVGC_STATS_V2_SIZE && size != KVGC_STATS_V3_SIZE &&
        size != KVGC_STATS_V4_SIZE && size != KVGC_STATS_V5_SIZE && size != KVGC_STATS_V6_SIZE &&
        size != KVGC_STATS_V7_SIZE && size != KVGC_STATS_V8_SIZE &&
        size != KVGC_STATS_V9_SIZE)
      KVGC_TRY(check_struct_size(size, sizeof *out, "kvgc_get_stats: out"));
    kvgc_stats full;
    KVGC_TRY(h.stats(&full));
    full.struct_size = size;
    std::memcpy(out, &full, size);
    return Status::Ok();
  });
}

kvgc_status kvgc_seq_tokens(kvgc_heap* heap, kvgc_seq seq, uint32_t layer, uint64_t* live_out,
                            uint64_t* length_out) {
  return with_heap(heap, "kvgc_seq_tokens", [&](kvgc::ManagedHeap& h) -> Status {
    if (!live_out && !length_out)
      return fail(KVGC_EINVAL, "kvgc_seq_tokens: live_out and length_out are both NULL");
    return h.tokens(seq, layer, live_out, length_out);
  });
}

kvgc_status kvgc_read(kvgc_heap* heap, kvgc_seq seq, uint32_t layer, void* k_out, void* v_out,
                      int32_t* pos_out, uint64_t capacity, uint64_t* n_out, void* stream) {
  return with_heap(heap, "kvgc_read", [&](kvgc::ManagedHeap& h) -> Status {
    if (!n_out) return fail(KVGC_EINVAL, "kvgc_read: n_out is NULL");
    return h.read(seq, layer, k_out, v_out, pos_out, capacity, n_out, stream);
  });
}

kvgc_status kvgc_read_classes(kvgc_heap* heap, kvgc_seq seq, uint32_t layer, uint8_t* cls_out,
                              uint64_t capacity, uint64_t* n_out, void* stream) {
  return with_heap(heap, "kvgc_read_classes", [&](kvgc::ManagedHeap& h) -> Status {
    if (!n_out) return fail(KVGC_EINVAL, "kvgc_read_classes: n_out is NULL");
    return h.read_classes(seq, layer, cls_out, capacity, n_out, stream);
  });
}

kvgc_status kvgc_read_scores(kvgc_heap* heap, kvgc_seq seq, uint32_t layer, float* scores_out,
                             uint8_t* gen_out, uint64_t capacity, uint64_t* n_out,
                             void* stream) {
  return with_heap(heap, "kvgc_read_scores", [&](kvgc::ManagedHeap& h) -> Status {
    if (!n_out) return fail(KVGC_EINVAL, "kvgc_read_scores: n_out is NULL");
    return h.read_scores(seq, layer, scores_out, gen_out, capacity, n_out, stream);
  });
}

kvgc_status kvgc_page_layout_get(const kvgc_heap* heap, kvgc_storage_class cls, kvgc_page_layout* out) {
  return with_heap(const_cast<kvgc_heap*>(heap), "kvgc_page_layout_get", [&](kvgc::ManagedHeap& h) -> Status {
    if (!out) return fail(KVGC_EINVAL, "kvgc_page_layout_get: out is NULL");
    KVGC_TRY(check_struct_size(out->struct_size, sizeof *out, "kvgc_page_layout_get: out"));
    if (kvgc::raw_enum(cls) < 0 || kvgc::raw_enum(cls) >= KVGC_CLASS_COUNT)
      return fail(KVGC_EINVAL, "kvgc_page_layout_get: cls must be KVGC_CLASS_FP16, _INT4 or _INT8");
    kvgc_page_layout l{};
    l.struct_size = sizeof l;
    h.page_layout(kvgc::raw_enum(cls), &l);
    *out = l;
    return Status::Ok();
  });
}

}  // extern "C"
