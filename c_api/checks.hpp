// C glue: argument checks, the heap lock, the per-thread error message, and the wall
// no C++ exception crosses. Everything else lives in runtime/.
//
// This header holds what every entry point shares; the entry points themselves are in
// api_heap.cpp (the library, heaps, sequences, decode), api_batch.cpp (kvgc_batch_*),
// api_prefix.cpp (kvgc_prefix_*) and api_introspect.cpp (stats, reads, page layout).
// Internal to the library (never installed).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <new>
#include <string_view>

#include "../runtime/heap.hpp"
#include "../runtime/model.hpp"
#include "kvgc.h"

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

namespace kvgc::capi {

// The calling thread's last error, in storage of its own: recording an error never
// allocates, so a failure to allocate can always be reported (a std::string here made
// "out of host memory" itself throw inside the noexcept wall, and terminate).
inline constexpr size_t kErrBytes = 1024;
struct LastError {
  const void* heap = nullptr;
  char msg[kErrBytes] = {};
};
inline thread_local LastError tl_error;  // one slot per thread, shared by every api_*.cpp

// msg = a + b, cut to the slot (a long message keeps its start: the argument it names).
inline kvgc_status record(const void* heap, kvgc_status code, std::string_view a,
                          std::string_view b = {}) noexcept {
  tl_error.heap = heap;
  const size_t na = std::min(a.size(), kErrBytes - 1);
  const size_t nb = std::min(b.size(), kErrBytes - 1 - na);
  if (na) std::memcpy(tl_error.msg, a.data(), na);  // (an empty view's data() may be null)
  if (nb) std::memcpy(tl_error.msg + na, b.data(), nb);
  tl_error.msg[na + nb] = '\0';
  return code;
}

inline kvgc_status finish(const void* heap, const Status& st, std::string_view prefix = {}) noexcept {
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

inline Status check_heap(const kvgc_heap* h, const char* fn) {
  if (!h) return fail(KVGC_EINVAL, std::string(fn) + ": heap is NULL");
  if (h->magic != kvgc_heap::kMagic || !h->impl)
    return fail(KVGC_EINVAL, std::string(fn) + ": heap is not a live kvgc_heap");
  return Status::Ok();
}

// Structs that only grow: the caller's struct_size must name a size this library knows.
inline Status check_struct_size(size_t given, size_t ours, const char* what) {
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
inline void debug_check(kvgc::ManagedHeap& h, const char* fn) {
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

// The options of kvgc_attend and kvgc_batch_attend; mass_out (kvgc_batch_attend's only:
// null for kvgc_attend, which refuses one) is params->mass_out where the caller's struct
// has the field.
inline Status attend_options(const kvgc::ManagedHeap& h, const kvgc_attend_params* params, const char* fn,
                             float* scale, bool* scores, float** mass_out = nullptr) {
  *scale = 1.0f / std::sqrt(float(h.model().head_dim));
  *scores = true;
  if (mass_out) *mass_out = nullptr;
  if (!params) return Status::Ok();
  const bool v1 = params->struct_size == KVGC_ATTEND_PARAMS_V1_SIZE;
  if (!v1)
    KVGC_TRY(check_struct_size(params->struct_size, sizeof *params, (std::string(fn) + ": params").c_str()));
  float* const mass = v1 ? nullptr : params->mass_out;
  if (mass && !mass_out)
    return fail(KVGC_EINVAL, std::string(fn) + ": params->mass_out is for kvgc_batch_attend only (set it to NULL)");
  if (mass && (params->flags & KVGC_ATTEND_NO_SCORES))
    return fail(KVGC_EINVAL, std::string(fn) + ": params->mass_out with KVGC_ATTEND_NO_SCORES (no mass to write)");
  if (mass_out) *mass_out = mass;
  if (!(params->scale >= 0 && std::isfinite(params->scale)))
    return fail(KVGC_EINVAL, std::string(fn) + ": params->scale must be finite and >= 0 (0 = default)");
  if (params->flags & ~KVGC_ATTEND_NO_SCORES)
    return fail(KVGC_EINVAL, std::string(fn) + ": params->flags has unknown bits");
  if (params->scale > 0) *scale = params->scale;
  *scores = !(params->flags & KVGC_ATTEND_NO_SCORES);
  return Status::Ok();
}

}  // namespace kvgc::capi
