// The one place kvgc obtains host memory (SQLite's sqlite3_malloc, in spirit): every
// container and descriptor array of the library allocates through host::allocate, and
// every arena reservation passes host::fault_point first. So one test hook can fail
// allocation number N, once or from N on, and a counter of outstanding bytes proves
// that a destroyed heap leaves nothing behind.
//
// This header is the one the other host layers (gc/, kernels/cpu/, runtime/) include
// from allocator/: host memory is the allocator layer's concept.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <new>
#include <unordered_map>
#include <vector>

namespace kvgc::host {

// Counts one attempt to obtain memory (host or device); true if the fault plan says it
// must fail.
bool fault_point() noexcept;

// Host memory, or std::bad_alloc (the C API turns it into KVGC_ENOMEM).
void* allocate(size_t bytes, size_t align = alignof(std::max_align_t));
void deallocate(void* p, size_t bytes, size_t align = alignof(std::max_align_t)) noexcept;

// Test hooks. fail_at = N: attempt N (1-based, counted from this call) fails, and with
// `persistent` every later one too; 0 disables injection. Process-wide.
void set_faults(uint64_t fail_at, bool persistent) noexcept;
// While paused, attempts are neither counted nor failed (tests verify data between
// faulted calls without moving the count).
void pause_faults(bool paused) noexcept;
uint64_t attempts() noexcept;          // since the last set_faults
uint64_t faults_injected() noexcept;   // since the last set_faults
int64_t outstanding_bytes() noexcept;  // allocated and not yet freed, process-wide

template <class T>
struct Allocator {
  using value_type = T;
  Allocator() = default;
  template <class U>
  Allocator(const Allocator<U>&) noexcept {}
  T* allocate(size_t n) {
    if (n > SIZE_MAX / sizeof(T)) throw std::bad_alloc();
    return static_cast<T*>(host::allocate(n * sizeof(T), alignof(T) > alignof(std::max_align_t)
                                                             ? alignof(T)
                                                             : alignof(std::max_align_t)));
  }
  void deallocate(T* p, size_t n) noexcept {
    host::deallocate(p, n * sizeof(T), alignof(T) > alignof(std::max_align_t)
                                           ? alignof(T)
                                           : alignof(std::max_align_t));
  }
  template <class U>
  bool operator==(const Allocator<U>&) const noexcept { return true; }
};

template <class T>
using vector = std::vector<T, Allocator<T>>;
template <class K, class V>
using unordered_map =
    std::unordered_map<K, V, std::hash<K>, std::equal_to<K>, Allocator<std::pair<const K, V>>>;
template <class K, class V>
using unordered_multimap =
    std::unordered_multimap<K, V, std::hash<K>, std::equal_to<K>, Allocator<std::pair<const K, V>>>;

// For classes allocated one at a time (the heap, its C handle): derive to allocate
// through host::allocate.
struct HostAllocated {
  static void* operator new(size_t n) { return allocate(n); }
  static void operator delete(void* p, size_t n) noexcept { deallocate(p, n); }
};

}  // namespace kvgc::host
