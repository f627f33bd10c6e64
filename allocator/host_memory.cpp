#include "host_memory.hpp"

#include <atomic>
#include <cstdlib>

namespace kvgc::host {
namespace {

std::atomic<uint64_t> g_fail_at{0}, g_attempts{0}, g_faults{0};
std::atomic<bool> g_persistent{false}, g_paused{false};
std::atomic<int64_t> g_outstanding{0};

}  // namespace

bool fault_point() noexcept {
  if (g_paused.load(std::memory_order_relaxed)) return false;
  const uint64_t fail_at = g_fail_at.load(std::memory_order_relaxed);
  const uint64_t n = g_attempts.fetch_add(1, std::memory_order_relaxed) + 1;
  if (fail_at == 0) return false;
  const bool fail = g_persistent.load(std::memory_order_relaxed) ? n >= fail_at : n == fail_at;
  if (fail) g_faults.fetch_add(1, std::memory_order_relaxed);
  return fail;
}

void* allocate(size_t bytes, size_t align) {
  if (fault_point()) throw std::bad_alloc();
  void* p = nullptr;
  if (align <= alignof(std::max_align_t)) {
    p = std::malloc(bytes ? bytes : 1);
  } else if (posix_memalign(&p, align, bytes ? bytes : 1) != 0) {
    p = nullptr;
  }
  if (!p) throw std::bad_alloc();
  g_outstanding.fetch_add(int64_t(bytes), std::memory_order_relaxed);
  return p;
}

void deallocate(void* p, size_t bytes, size_t) noexcept {
  if (!p) return;
  g_outstanding.fetch_sub(int64_t(bytes), std::memory_order_relaxed);
  std::free(p);
}

void set_faults(uint64_t fail_at, bool persistent) noexcept {
  g_persistent = persistent;
  g_attempts = 0;
  g_faults = 0;
  g_fail_at = fail_at;
}
void pause_faults(bool paused) noexcept { g_paused = paused; }
uint64_t attempts() noexcept { return g_attempts; }
uint64_t faults_injected() noexcept { return g_faults; }
int64_t outstanding_bytes() noexcept { return g_outstanding; }

}  // namespace kvgc::host
