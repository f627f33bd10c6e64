#include "engine/thread_pool.hpp"

#include <sched.h>

#include <chrono>
#include <system_error>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace engine {
namespace {

inline void cpu_relax() {
#if defined(__x86_64__)
  _mm_pause();
#endif
}

}  // namespace

uint32_t ThreadPool::available_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0) {
    const int n = CPU_COUNT(&set);
    if (n > 0) return uint32_t(n);
  }
  const unsigned n = std::thread::hardware_concurrency();
  return n > 0 ? n : 1;
}

ThreadPool::ThreadPool(uint32_t threads) {
  const uint32_t wanted = threads > 1 ? threads - 1 : 0;
  workers_.reserve(wanted);
  for (uint32_t i = 0; i < wanted; ++i) {
    try {
      workers_.emplace_back([this, i] { work(i + 1); });
    } catch (const std::system_error&) {
      break;  // run with the threads there are
    }
  }
}

ThreadPool::~ThreadPool() {
  stop_.store(true, std::memory_order_relaxed);
  generation_.fetch_add(1, std::memory_order_seq_cst);
  generation_.notify_all();
  for (std::thread& t : workers_) t.join();
}

void ThreadPool::run_erased(void (*fn)(void*, uint32_t), void* context) {
  if (workers_.empty()) {
    fn(context, 0);
    return;
  }
  fn_ = fn;
  context_ = context;
  resting_.store(false, std::memory_order_relaxed);
  pending_.store(uint32_t(workers_.size()), std::memory_order_relaxed);
  // seq_cst on both sides: either this sees a worker's sleepers_ increment and wakes it,
  // or that worker's wait() sees the new generation and does not block.
  generation_.fetch_add(1, std::memory_order_seq_cst);
  if (sleepers_.load(std::memory_order_seq_cst) > 0) generation_.notify_all();
  fn(context, 0);
  while (pending_.load(std::memory_order_acquire) != 0) cpu_relax();
}

void ThreadPool::work(uint32_t index) {
  using Clock = std::chrono::steady_clock;
  uint32_t seen = 0;
  for (;;) {
    uint32_t now = generation_.load(std::memory_order_acquire);
    const Clock::time_point spin_start = Clock::now();
    for (uint32_t i = 1; now == seen; ++i) {
      cpu_relax();
      // Check the clock and the rest flag every 64 spins, not every one.
      if (i % 64 == 0 &&
          (resting_.load(std::memory_order_relaxed) ||
           Clock::now() - spin_start > std::chrono::microseconds(kSpinMicros))) {
        sleepers_.fetch_add(1, std::memory_order_seq_cst);
        generation_.wait(seen, std::memory_order_seq_cst);
        sleepers_.fetch_sub(1, std::memory_order_relaxed);
      }
      now = generation_.load(std::memory_order_acquire);
    }
    seen = now;
    if (stop_.load(std::memory_order_relaxed)) return;
    fn_(context_, index);
    pending_.fetch_sub(1, std::memory_order_acq_rel);
  }
}

}  // namespace engine
