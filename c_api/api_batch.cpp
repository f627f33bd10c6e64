// C entry points of batches: kvgc_batch_*, one plan for many sequences' decode step.
#include <cstring>

#include "../runtime/heap.hpp"
#include "checks.hpp"
#include "kvgc.h"

using kvgc::fail;
using kvgc::Status;
using namespace kvgc::capi;

// ---- batches --------------------------------------------------------------------

namespace {
template <class F>
kvgc_status with_batch(kvgc_batch* b, const char* fn, F&& f, Mutates m = Mutates::Yes) noexcept {
  if (!b || b->magic != kvgc_batch::kMagic)
    return record(nullptr, KVGC_EINVAL, fn, !b ? ": batch is NULL" : ": batch is not a live kvgc_batch");
  return with_heap(b->heap, fn, [&](kvgc::ManagedHeap& h) { return f(h, b->plan); }, m);
}

}  // namespace

extern "C" {

kvgc_status kvgc_batch_create(kvgc_heap* heap, kvgc_batch** batch_out) {
  if (!batch_out) return record(heap, KVGC_EINVAL, "kvgc_batch_create: batch_out is NULL");
  *batch_out = nullptr;
  return with_heap(heap, "kvgc_batch_create", [&](kvgc::ManagedHeap&) -> Status {
    auto* b = new kvgc_batch();  // bad_alloc: KVGC_ENOMEM
    b->heap = heap;
    *batch_out = b;
    return Status::Ok();
  });
}

void kvgc_batch_destroy(kvgc_batch* batch) {
  if (!batch || batch->magic != kvgc_batch::kMagic) return;
  (void)with_batch(batch, "kvgc_batch_destroy", [&](kvgc::ManagedHeap& h, kvgc::BatchPlan& p) {
    h.batch_destroy(p);
    return Status::Ok();
  });
  batch->magic = 0;
  delete batch;
}

kvgc_status kvgc_batch_plan(kvgc_batch* batch, const kvgc_seq* seqs, const uint32_t* n_new,
                            uint32_t n_seqs, uint32_t* failed_out, void* stream) {
  return with_batch(batch, "kvgc_batch_plan", [&](kvgc::ManagedHeap& h, kvgc::BatchPlan& p) {
    return h.batch_plan(p, seqs, n_new, n_seqs, nullptr, nullptr, failed_out, stream);
  });
}

kvgc_status kvgc_batch_plan_options_init(kvgc_batch_plan_options* opts) {
  return guarded(nullptr, [&]() -> Status {
    if (!opts) return fail(KVGC_EINVAL, "kvgc_batch_plan_options_init: opts is NULL");
    std::memset(opts, 0, sizeof *opts);
    opts->struct_size = sizeof *opts;
    return Status::Ok();
  });
}

kvgc_status kvgc_batch_plan_ex(kvgc_batch* batch, const kvgc_seq* seqs, const uint32_t* n_new,
                               uint32_t n_seqs, const kvgc_batch_plan_options* opts,
                               uint32_t* failed_out, void* stream) {
  return with_batch(batch, "kvgc_batch_plan_ex", [&](kvgc::ManagedHeap& h, kvgc::BatchPlan& p) -> Status {
    const uint32_t *scored = nullptr, *flags = nullptr;
    if (opts) {
      KVGC_TRY(check_struct_size(opts->struct_size, sizeof *opts, "kvgc_batch_plan_ex: opts"));
      scored = opts->scored_rows;
      flags = opts->seq_flags;
    }
    return h.batch_plan(p, seqs, n_new, n_seqs, scored, flags, failed_out, stream);
  });
}

kvgc_status kvgc_batch_append(kvgc_batch* batch, uint32_t layer, const void* k, const void* v,
                              void* stream) {
  return with_batch(batch, "kvgc_batch_append", [&](kvgc::ManagedHeap& h, kvgc::BatchPlan& p) {
    return h.batch_append(p, layer, k, v, stream);
  });
}

kvgc_status kvgc_batch_attend(kvgc_batch* batch, uint32_t layer, const void* q, void* out,
                              const kvgc_attend_params* params, void* stream) {
  return with_batch(batch, "kvgc_batch_attend", [&](kvgc::ManagedHeap& h, kvgc::BatchPlan& p) -> Status {
    float scale;
    bool scores;
    float* mass_out;
    KVGC_TRY(attend_options(h, params, "kvgc_batch_attend", &scale, &scores, &mass_out));
    return h.batch_attend(p, layer, q, out, scale, scores, mass_out, stream);
  });
}

kvgc_status kvgc_batch_observe(kvgc_batch* batch, uint32_t layer, const float* mass, void* stream) {
  return with_batch(batch, "kvgc_batch_observe", [&](kvgc::ManagedHeap& h, kvgc::BatchPlan& p) {
    return h.batch_observe(p, layer, mass, stream);
  });
}

kvgc_status kvgc_batch_step(kvgc_batch* batch, void* stream) {
  return with_batch(batch, "kvgc_batch_step", [&](kvgc::ManagedHeap& h, kvgc::BatchPlan& p) {
    return h.batch_step(p, stream);
  });
}

kvgc_status kvgc_batch_export(kvgc_batch* batch, uint32_t layer, kvgc_batch_view* out) {
  return with_batch(batch, "kvgc_batch_export", [&](kvgc::ManagedHeap& h, kvgc::BatchPlan& p) -> Status {
    if (!out) return fail(KVGC_EINVAL, "kvgc_batch_export: out is NULL");
    const size_t size = out->struct_size;  // 0.6 callers get the fields they know
    if (size != KVGC_BATCH_VIEW_V1_SIZE)
      KVGC_TRY(check_struct_size(size, sizeof *out, "kvgc_batch_export: out"));
    kvgc_batch_view v{};
    v.struct_size = size;
    KVGC_TRY(h.batch_export(p, layer, &v));
    std::memcpy(out, &v, size);
    return Status::Ok();
  }, Mutates::No);
}

}  // extern "C"
