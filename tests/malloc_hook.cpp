// The replacement: each entry point counts (when armed), may fail, and forwards to
// glibc's own allocator (__libc_*), so memory from any glibc function that this file
// does not replace is still freed correctly.
#include "malloc_hook.hpp"

#include <malloc.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <new>

extern "C" {
void* __libc_malloc(size_t);
void* __libc_calloc(size_t, size_t);
void* __libc_realloc(void*, size_t);
void* __libc_memalign(size_t, size_t);
void __libc_free(void*);
}

namespace malloc_hook {
namespace {

std::atomic<bool> g_armed{false}, g_persistent{false};
std::atomic<uint64_t> g_fail_at{0}, g_attempts{0}, g_faults{0};
std::atomic<int64_t> g_live{0}, g_peak{0};

// True when this attempt must fail.
bool attempt_fails() noexcept {
  if (!g_armed.load(std::memory_order_relaxed)) return false;
  const uint64_t n = g_attempts.fetch_add(1, std::memory_order_relaxed) + 1;
  const uint64_t at = g_fail_at.load(std::memory_order_relaxed);
  const bool fail = at && (g_persistent.load(std::memory_order_relaxed) ? n >= at : n == at);
  if (fail) g_faults.fetch_add(1, std::memory_order_relaxed);
  return fail;
}

void* track(void* p) noexcept {
  if (p) {
    const int64_t now =
        g_live.fetch_add(int64_t(malloc_usable_size(p)), std::memory_order_relaxed) +
        int64_t(malloc_usable_size(p));
    int64_t peak = g_peak.load(std::memory_order_relaxed);
    while (now > peak && !g_peak.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
    }
  }
  return p;
}

void untrack(void* p) noexcept {
  if (p) g_live.fetch_sub(int64_t(malloc_usable_size(p)), std::memory_order_relaxed);
}

}  // namespace

void arm(uint64_t fail_at, bool persistent) noexcept {
  g_persistent = persistent;
  g_fail_at = fail_at;
  g_attempts = 0;
  g_faults = 0;
  g_armed = true;
}
void disarm() noexcept { g_armed = false; }
void rearm() noexcept { g_armed = true; }
uint64_t attempts() noexcept { return g_attempts; }
uint64_t faults() noexcept { return g_faults; }
int64_t live_bytes() noexcept { return g_live; }
int64_t peak_bytes() noexcept { return g_peak; }
void reset_peak() noexcept { g_peak = g_live.load(); }

}  // namespace malloc_hook

using malloc_hook::attempt_fails;
using malloc_hook::track;
using malloc_hook::untrack;

extern "C" {

void* malloc(size_t n) {
  if (attempt_fails()) {
    errno = ENOMEM;
    return nullptr;
  }
  return track(__libc_malloc(n));
}

void* calloc(size_t n, size_t size) {
  if (attempt_fails()) {
    errno = ENOMEM;
    return nullptr;
  }
  return track(__libc_calloc(n, size));
}

void* realloc(void* p, size_t n) {
  if (p && n == 0) {  // glibc frees here
    untrack(p);
    __libc_free(p);
    return nullptr;
  }
  if (attempt_fails()) {
    errno = ENOMEM;
    return nullptr;  // p stays valid, as realloc promises
  }
  const size_t old = p ? malloc_usable_size(p) : 0;
  void* q = __libc_realloc(p, n);
  if (q) {
    malloc_hook::g_live.fetch_sub(int64_t(old), std::memory_order_relaxed);
    track(q);
  }
  return q;
}

void free(void* p) {
  untrack(p);
  __libc_free(p);
}

void* memalign(size_t align, size_t n) {
  if (attempt_fails()) {
    errno = ENOMEM;
    return nullptr;
  }
  return track(__libc_memalign(align, n));
}

void* aligned_alloc(size_t align, size_t n) { return memalign(align, n); }

int posix_memalign(void** out, size_t align, size_t n) {
  if (align < sizeof(void*) || (align & (align - 1))) return EINVAL;
  if (attempt_fails()) return ENOMEM;
  void* p = track(__libc_memalign(align, n));
  if (!p) return ENOMEM;
  *out = p;
  return 0;
}

}  // extern "C"

// operator new and delete too: a binary that also links tcmalloc (kvgc's executables
// do) would otherwise get tcmalloc's, which never calls malloc. The executable's
// definitions win over any shared library's.
namespace {
void* new_or_throw(size_t n, size_t align = 0) {
  void* p = align > alignof(std::max_align_t) ? memalign(align, n ? n : 1) : malloc(n ? n : 1);
  if (!p) throw std::bad_alloc();
  return p;
}
}  // namespace

void* operator new(size_t n) { return new_or_throw(n); }
void* operator new[](size_t n) { return new_or_throw(n); }
void* operator new(size_t n, std::align_val_t a) { return new_or_throw(n, size_t(a)); }
void* operator new[](size_t n, std::align_val_t a) { return new_or_throw(n, size_t(a)); }
void* operator new(size_t n, const std::nothrow_t&) noexcept { return malloc(n ? n : 1); }
void* operator new[](size_t n, const std::nothrow_t&) noexcept { return malloc(n ? n : 1); }
void operator delete(void* p) noexcept { free(p); }
void operator delete[](void* p) noexcept { free(p); }
void operator delete(void* p, size_t) noexcept { free(p); }
void operator delete[](void* p, size_t) noexcept { free(p); }
void operator delete(void* p, std::align_val_t) noexcept { free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { free(p); }
void operator delete(void* p, size_t, std::align_val_t) noexcept { free(p); }
void operator delete[](void* p, size_t, std::align_val_t) noexcept { free(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { free(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { free(p); }
