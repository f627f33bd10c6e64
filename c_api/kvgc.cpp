// C glue: argument checks, the heap lock, the per-thread error message, and the wall
// no C++ exception crosses. Everything else lives in runtime/.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <new>
#include <string_view>

#include "../runtime/heap.hpp"
#include "../runtime/model.hpp"
#include "../runtime/options.hpp"
#include "internal.hpp"
#include "kvgc.h"

using kvgc::fail;
using kvgc::Status;

struct kvgc_heap : kvgc::host::HostAllocated {
  static constexpr uint64_t kMagic = 0x6b7667632d686561ull;  // "kvgc-hea"
  uint64_t magic = kMagic;
  std::unique_ptr<kvgc::ManagedHeap> impl;
};

struct kvgc_batch : kvgc::host::HostAllocated {
  static constexpr uint64_t kMagic = 0x6b7667632d626174ull;  // "kvgc-bat"
  uint64_t magic = kMagic;
  kvgc_heap* heap = nullptr;
  kvgc::BatchPlan plan;
};

namespace {

// The calling thread's last error, in storage of its own: recording an error never
// allocates, so a failure to allocate can always be reported (a std::string here made
// "out of host memory" itself throw inside the noexcept wall, and terminate).
constexpr size_t kErrBytes = 1024;
struct LastError {
  const void* heap = nullptr;
  char msg[kErrBytes] = {};
};
thread_local LastError tl_error;

// msg = a + b, cut to the slot (a long message keeps its start: the argument it names).
kvgc_status record(const void* heap, kvgc_status code, std::string_view a,
                   std::string_view b = {}) noexcept {
  tl_error.heap = heap;
  const size_t na = std::min(a.size(), kErrBytes - 1);
  const size_t nb = std::min(b.size(), kErrBytes - 1 - na);
  if (na) std::memcpy(tl_error.msg, a.data(), na);  // (an empty view's data() may be null)
  if (nb) std::memcpy(tl_error.msg + na, b.data(), nb);
  tl_error.msg[na + nb] = '\0';
  return code;
}

kvgc_status finish(const void* heap, const Status& st, std::string_view prefix = {}) noexcept {
  return record(heap, st.code, st.ok() ? std::string_view() : prefix, st.text());
}

// Runs f() -> Status, turning any escaping C++ exception into a status. Nothing in the
// handlers allocates: std::bad_alloc (from anywhere, building a message included) is
// KVGC_ENOMEM with a static message.
template <class F>
kvgc_status guarded(const void* heap, F&& f, std::string_view prefix = {}) noexcept {
  try {
    return finish(heap, f(), prefix);
  } catch (const std::bad_alloc&) {
    return record(heap, KVGC_ENOMEM, prefix, "out of host memory");
  } catch (const std::exception& e) {
    return record(heap, KVGC_EINTERNAL, "internal error: ", e.what());
  } catch (...) {
    return record(heap, KVGC_EINTERNAL, "internal error: unknown exception");
  }
}

Status check_heap(const kvgc_heap* h, const char* fn) {
  if (!h) return fail(KVGC_EINVAL, std::string(fn) + ": heap is NULL");
  if (h->magic != kvgc_heap::kMagic || !h->impl)
    return fail(KVGC_EINVAL, std::string(fn) + ": heap is not a live kvgc_heap");
  return Status::Ok();
}

// The sizes of kvgc_heap_options that earlier versions compiled against.
bool older_options_size(size_t size) {
  return size == KVGC_HEAP_OPTIONS_0_2_SIZE || size == KVGC_HEAP_OPTIONS_0_3_SIZE ||
         size == KVGC_HEAP_OPTIONS_0_4_SIZE || size == KVGC_HEAP_OPTIONS_0_6_SIZE ||
         size == KVGC_HEAP_OPTIONS_0_13_SIZE;
}

// Structs that only grow: the caller's struct_size must name a size this library knows.
Status check_struct_size(size_t given, size_t ours, const char* what) {
  if (given == ours) return Status::Ok();
  return fail(KVGC_EINVAL,
              std::string(what) + "->struct_size is " + std::to_string(given) + ", expected " +
                  std::to_string(ours) +
                  (given > ours ? " (the header is newer than this library)"
                                : " (set it to sizeof the struct, or call its _init function)"));
}

enum class Mutates { No, Yes };

// Level 2 (debug builds): the invariant walker after every mutating call, so a broken
// invariant is reported by the call that broke it.
// A walker that runs out of memory proves nothing either way: only a broken invariant aborts.
void debug_check(kvgc::ManagedHeap& h, const char* fn) {
#if KVGC_ASSERT_LEVEL >= 2
  Status st;
  try {
    st = h.check();
  } catch (const std::bad_alloc&) {
    return;
  }
  if (!st.ok() && st.code != KVGC_ENOMEM) {
    std::fprintf(stderr, "kvgc: invariant broken after %s: %.*s\n", fn, int(st.text().size()), st.text().data());
    std::abort();
  }
#else
  (void)h;
  (void)fn;
#endif
}

template <class F>
kvgc_status with_heap(kvgc_heap* h, const char* fn, F&& f, Mutates m = Mutates::No) noexcept {
  return guarded(h, [&]() -> Status {
    KVGC_TRY(check_heap(h, fn));
    std::lock_guard<std::mutex> lock(h->impl->mutex());
    Status st = f(*h->impl);
    if (m == Mutates::Yes) debug_check(*h->impl, fn);
    return st;
  });
}

Status attend_options(const kvgc::ManagedHeap& h, const kvgc_attend_params* params, const char* fn,
                      float* scale, bool* scores) {
  *scale = 1.0f / std::sqrt(float(h.model().head_dim));
  *scores = true;
  if (!params) return Status::Ok();
  KVGC_TRY(check_struct_size(params->struct_size, sizeof *params, (std::string(fn) + ": params").c_str()));
  if (!(params->scale >= 0 && std::isfinite(params->scale)))
    return fail(KVGC_EINVAL, std::string(fn) + ": params->scale must be finite and >= 0 (0 = default)");
  if (params->flags & ~KVGC_ATTEND_NO_SCORES)
    return fail(KVGC_EINVAL, std::string(fn) + ": params->flags has unknown bits");
  if (params->scale > 0) *scale = params->scale;
  *scores = !(params->flags & KVGC_ATTEND_NO_SCORES);
  return Status::Ok();
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

kvgc_status kvgc_stats_init(kvgc_stats* out) {
  return guarded(nullptr, [&]() -> Status {
    if (!out) return fail(KVGC_EINVAL, "kvgc_stats_init: out is NULL");
    std::memset(out, 0, sizeof *out);
    out->struct_size = sizeof *out;
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

kvgc_status kvgc_prefix_keep(kvgc_heap* heap, kvgc_seq seq, const int32_t* token_ids,
                             uint64_t n_tokens, uint64_t salt, uint32_t flags,
                             kvgc_prefix* prefix_out, void* stream) {
  return with_heap(heap, "kvgc_prefix_keep", [&](kvgc::ManagedHeap& h) -> Status {
    if (flags & ~KVGC_PREFIX_PIN)
      return fail(KVGC_EINVAL, "kvgc_prefix_keep: flags " + std::to_string(flags) + " has unknown bits");
    if (n_tokens && !token_ids) return fail(KVGC_EINVAL, "kvgc_prefix_keep: token_ids is NULL");
    return h.prefix_keep(seq, token_ids, n_tokens, salt, flags & KVGC_PREFIX_PIN, prefix_out, stream);
  }, Mutates::Yes);
}

kvgc_status kvgc_prefix_attach(kvgc_heap* heap, kvgc_seq seq, const int32_t* token_ids,
                               uint64_t n_tokens, uint64_t salt, uint64_t* n_attached_out,
                               void* stream) {
  return with_heap(heap, "kvgc_prefix_attach", [&](kvgc::ManagedHeap& h) -> Status {
    if (!n_attached_out) return fail(KVGC_EINVAL, "kvgc_prefix_attach: n_attached_out is NULL");
    if (n_tokens && !token_ids) return fail(KVGC_EINVAL, "kvgc_prefix_attach: token_ids is NULL");
    const Status st = h.prefix_attach(seq, token_ids, n_tokens, salt, n_attached_out, stream);
    // The walker only after a hit: a miss changes no page and must read none (tenants).
    if (st.ok() && *n_attached_out) debug_check(h, "kvgc_prefix_attach");
    return st;
  });
}

kvgc_status kvgc_prefix_pin(kvgc_heap* heap, kvgc_prefix prefix, int pinned) {
  return with_heap(heap, "kvgc_prefix_pin", [&](kvgc::ManagedHeap& h) {
    return h.prefix_pin(prefix, pinned != 0);
  }, Mutates::Yes);
}

kvgc_status kvgc_prefix_drop(kvgc_heap* heap, kvgc_prefix prefix) {
  return with_heap(heap, "kvgc_prefix_drop", [&](kvgc::ManagedHeap& h) {
    return h.prefix_drop(prefix);
  }, Mutates::Yes);
}

kvgc_status kvgc_append(kvgc_heap* heap, kvgc_seq seq, uint32_t layer, const void* k,
                        const void* v, uint32_t n_tokens, void* stream) {
  return with_heap(heap, "kvgc_append", [&](kvgc::ManagedHeap& h) {
    return h.append(seq, layer, k, v, n_tokens, stream);
  }, Mutates::Yes);
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

kvgc_status kvgc_get_stats(kvgc_heap* heap, kvgc_stats* out) {
  return with_heap(heap, "kvgc_get_stats", [&](kvgc::ManagedHeap& h) -> Status {
    if (!out) return fail(KVGC_EINVAL, "kvgc_get_stats: out is NULL");
    // Callers of versions 1 to 4 (a smaller struct) get the fields they know.
    const size_t size = out->struct_size;
    if (size != KVGC_STATS_V1_SIZE && size != KVGC_STATS_V2_SIZE && size != KVGC_STATS_V3_SIZE &&
        size != KVGC_STATS_V4_SIZE && size != KVGC_STATS_V5_SIZE && size != KVGC_STATS_V6_SIZE &&
        size != KVGC_STATS_V7_SIZE && size != KVGC_STATS_V8_SIZE)
      KVGC_TRY(check_struct_size(size, sizeof *out, "kvgc_get_stats: out"));
    kvgc_stats full;
    KVGC_TRY(h.stats(&full));
    full.struct_size = size;
    std::memcpy(out, &full, size);
    return Status::Ok();
  });
}

}  // extern "C"

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
    KVGC_TRY(attend_options(h, params, "kvgc_batch_attend", &scale, &scores));
    return h.batch_attend(p, layer, q, out, scale, scores, stream);
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

kvgc::ManagedHeap* kvgc::internal_heap(kvgc_heap* heap) {
  return heap && heap->magic == kvgc_heap::kMagic ? heap->impl.get() : nullptr;
}
