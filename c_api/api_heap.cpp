// C entry points: the library (version, status names, the error message), model and
// option structs, heaps, sequences, tenants and the decode path (append, observe, step,
// attend). The argument checks, the lock and the exception wall are in checks.hpp.
#include <cstring>

#include "../runtime/heap.hpp"
#include "../runtime/model.hpp"
#include "../runtime/options.hpp"
#include "checks.hpp"
#include "internal.hpp"
#include "kvgc.h"

using kvgc::fail;
using kvgc::Status;
using namespace kvgc::capi;

namespace {

// The sizes of kvgc_heap_options that earlier versions compiled against.
bool older_options_size(size_t size) {
  return size == KVGC_HEAP_OPTIONS_0_2_SIZE || size == KVGC_HEAP_OPTIONS_0_3_SIZE ||
         size == KVGC_HEAP_OPTIONS_0_4_SIZE || size == KVGC_HEAP_OPTIONS_0_6_SIZE ||
         size == KVGC_HEAP_OPTIONS_0_13_SIZE;
}

}  // namespace

extern "C" {

const char* kvgc_version(void) { return KVGC_VERSION_STRING; }
int kvgc_version_number(void) { return KVGC_VERSION_NUMBER; }

const char* kvgc_status_str(int status) {
  switch (status) {
    case KVGC_OK: return "KVGC_OK";
    case KVGC_EINVAL: return "KVGC_EINVAL";
    case KVGC_ENOMEM: return "KVGC_ENOMEM";
    case KVGC_EBUDGET: return "KVGC_EBUDGET";
    case KVGC_ENOTFOUND: return "KVGC_ENOTFOUND";
    case KVGC_EDEVICE: return "KVGC_EDEVICE";
    case KVGC_EUNSUPPORTED: return "KVGC_EUNSUPPORTED";
    case KVGC_EINTERNAL: return "KVGC_EINTERNAL";
    default: return "KVGC_E?";
  }
}

const char* kvgc_errmsg(const kvgc_heap* heap) {
  if (!heap || tl_error.heap == heap) return tl_error.msg;
  return "";
}

kvgc_status kvgc_model_desc_init(kvgc_model_desc* desc) {
  return guarded(nullptr, [&]() -> Status {
    if (!desc) return fail(KVGC_EINVAL, "kvgc_model_desc_init: desc is NULL");
    std::memset(desc, 0, sizeof *desc);
    desc->struct_size = sizeof *desc;
    return Status::Ok();
  });
}

kvgc_status kvgc_heap_options_init(kvgc_heap_options* opts) {
  return guarded(nullptr, [&]() -> Status {
    if (!opts) return fail(KVGC_EINVAL, "kvgc_heap_options_init: opts is NULL");
    kvgc::options_defaults(opts);
    return Status::Ok();
  });
}

kvgc_status kvgc_kv_bytes(const kvgc_model_desc* model, uint64_t tokens, kvgc_storage_class cls,
                          uint32_t page_tokens, uint64_t* bytes_out) {
  return guarded(nullptr, [&]() -> Status {
    if (!model) return fail(KVGC_EINVAL, "kvgc_kv_bytes: model is NULL");
    if (!bytes_out) return fail(KVGC_EINVAL, "kvgc_kv_bytes: bytes_out is NULL");
    KVGC_TRY(kvgc::model_validate(*model, "kvgc_kv_bytes: model"));
    if (kvgc::raw_enum(cls) < 0 || kvgc::raw_enum(cls) >= KVGC_CLASS_COUNT)
      return fail(KVGC_EINVAL, "kvgc_kv_bytes: cls must be KVGC_CLASS_FP16, _INT4 or _INT8");
    if (page_tokens > kvgc::kMaxPageTokens)
      return fail(KVGC_EINVAL, "kvgc_kv_bytes: page_tokens must be 0 (raw) or 1..256");
    if (tokens > (uint64_t(1) << 40))
      return fail(KVGC_EINVAL, "kvgc_kv_bytes: tokens must be <= 2^40");
    *bytes_out = kvgc::kv_bytes(*model, tokens, cls, page_tokens);
    return Status::Ok();
  });
}

kvgc_status kvgc_heap_create(const kvgc_model_desc* model, const kvgc_heap_options* opts,
                             kvgc_heap** heap_out) {
  if (!heap_out)
    return record(nullptr, KVGC_EINVAL, "kvgc_heap_create: heap_out is NULL");
  *heap_out = nullptr;  // on any failure (kvgc.h): destroying it is then a no-op
  return guarded(nullptr, [&]() -> Status {
    if (!model) return fail(KVGC_EINVAL, "model is NULL");
    kvgc_heap_options o;
    kvgc::options_defaults(&o);
    if (opts) {
      // 0.2, 0.3 and 0.4 callers (a smaller struct) keep the defaults of the fields they lack.
      if (!older_options_size(opts->struct_size))
        KVGC_TRY(check_struct_size(opts->struct_size, sizeof o, "opts"));
      std::memcpy(&o, opts, opts->struct_size);
      o.struct_size = sizeof o;
    }
    std::unique_ptr<kvgc_heap> h(new kvgc_heap());
    KVGC_TRY(kvgc::ManagedHeap::create(*model, o, &h->impl));
    *heap_out = h.release();
    return Status::Ok();
  }, "kvgc_heap_create: ");
}

void kvgc_heap_destroy(kvgc_heap* heap) {
  if (!heap || heap->magic != kvgc_heap::kMagic) return;
  heap->magic = 0;
  delete heap;
}

kvgc_status kvgc_heap_get_options(const kvgc_heap* heap, kvgc_heap_options* out) {
  return with_heap(const_cast<kvgc_heap*>(heap), "kvgc_heap_get_options",
                   [&](kvgc::ManagedHeap& h) -> Status {
                     if (!out) return fail(KVGC_EINVAL, "kvgc_heap_get_options: out is NULL");
                     const size_t size = out->struct_size;
                     if (!older_options_size(size))
                       KVGC_TRY(check_struct_size(size, sizeof *out,
                                                  "kvgc_heap_get_options: out"));
                     kvgc_heap_options full = h.options();
                     full.struct_size = size;
                     std::memcpy(out, &full, size);
                     return Status::Ok();
                   });
}

kvgc_status kvgc_heap_check(kvgc_heap* heap) {
  return with_heap(heap, "kvgc_heap_check", [&](kvgc::ManagedHeap& h) { return h.check(); });
}

kvgc_status kvgc_seq_create(kvgc_heap* heap, uint32_t tenant, kvgc_seq* seq_out) {
  return with_heap(heap, "kvgc_seq_create", [&](kvgc::ManagedHeap& h) -> Status {
    if (!seq_out) return fail(KVGC_EINVAL, "kvgc_seq_create: seq_out is NULL");
    return h.seq_create(tenant, seq_out);
  }, Mutates::Yes);
}

kvgc_status kvgc_seq_destroy(kvgc_heap* heap, kvgc_seq seq) {
  return with_heap(heap, "kvgc_seq_destroy", [&](kvgc::ManagedHeap& h) { return h.seq_destroy(seq); },
                   Mutates::Yes);
}

kvgc_status kvgc_seq_fork(kvgc_heap* heap, kvgc_seq seq, uint32_t tenant, kvgc_seq* seq_out,
                          void* stream) {
  return with_heap(heap, "kvgc_seq_fork", [&](kvgc::ManagedHeap& h) -> Status {
    if (!seq_out) return fail(KVGC_EINVAL, "kvgc_seq_fork: seq_out is NULL");
    return h.seq_fork(seq, tenant, seq_out, stream);
  }, Mutates::Yes);
}

kvgc_status kvgc_append(kvgc_heap* heap, kvgc_seq seq, uint32_t layer, const void* k,
                        const void* v, uint32_t n_tokens, void* stream) {
  return with_heap(heap, "kvgc_append", [&](kvgc::ManagedHeap& h) {
    return h.append(seq, layer, k, v, n_tokens, stream);
  }, Mutates::Yes);
}

kvgc_status kvgc_tenant_set_limit(kvgc_heap* heap, uint32_t tenant, uint64_t max_bytes) {
  return with_heap(heap, "kvgc_tenant_set_limit",
                   [&](kvgc::ManagedHeap& h) { return h.tenant_set_limit(tenant, max_bytes); },
                   Mutates::Yes);
}

kvgc_status kvgc_tenant_usage(kvgc_heap* heap, uint32_t tenant, uint64_t* bytes_out,
                              uint64_t* limit_out) {
  return with_heap(heap, "kvgc_tenant_usage", [&](kvgc::ManagedHeap& h) -> Status {
    if (!bytes_out && !limit_out)
      return fail(KVGC_EINVAL, "kvgc_tenant_usage: bytes_out and limit_out are both NULL");
    return h.tenant_usage(tenant, bytes_out, limit_out);
  });
}

kvgc_status kvgc_observe(kvgc_heap* heap, kvgc_seq seq, uint32_t layer, const float* mass,
                         uint64_t n, void* stream) {
  return with_heap(heap, "kvgc_observe", [&](kvgc::ManagedHeap& h) {
    return h.observe(seq, layer, mass, n, stream);
  }, Mutates::Yes);
}

kvgc_status kvgc_step(kvgc_heap* heap, kvgc_seq seq, void* stream) {
  return with_heap(heap, "kvgc_step", [&](kvgc::ManagedHeap& h) { return h.step(seq, stream); },
                   Mutates::Yes);
}

kvgc_status kvgc_attend_params_init(kvgc_attend_params* params) {
  return guarded(nullptr, [&]() -> Status {
    if (!params) return fail(KVGC_EINVAL, "kvgc_attend_params_init: params is NULL");
    std::memset(params, 0, sizeof *params);
    params->struct_size = sizeof *params;
    return Status::Ok();
  });
}

kvgc_status kvgc_attend(kvgc_heap* heap, kvgc_seq seq, uint32_t layer, const void* q,
                        uint32_t n_q, void* out, const kvgc_attend_params* params,
                        void* stream) {
  return with_heap(heap, "kvgc_attend", [&](kvgc::ManagedHeap& h) -> Status {
    float scale;
    bool scores;
    KVGC_TRY(attend_options(h, params, "kvgc_attend", &scale, &scores));
    return h.attend(seq, layer, q, n_q, out, scale, scores, stream);
  }, Mutates::Yes);
}

}  // extern "C"

kvgc::ManagedHeap* kvgc::internal_heap(kvgc_heap* heap) {
  return heap && heap->magic == kvgc_heap::kMagic ? heap->impl.get() : nullptr;
}
