#include "engine/thread_pool.hpp"

#include <sched.h>

#include <chrono>
#include <system_error>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace engine {
namespace {

using Clock = std::chrono::steady_clock;

inline void cpu_relax() {
#if defined(__x86_64__)
  _mm_pause();
#endif
}

constexpr uint64_t kChunkBits = 24;
constexpr uint64_t kChunkMask = (uint64_t(1) << kChunkBits) - 1;

uint64_t claim_word(uint32_t serial, uint32_t n_chunks, uint32_t next) {
  return uint64_t(serial & 0xffff) << (2 * kChunkBits) | uint64_t(n_chunks) << kChunkBits | next;
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
  stop_.store(true, std::memory_order_seq_cst);
  wake_.fetch_add(1, std::memory_order_seq_cst);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    sleep_.notify_all();
  }
  for (std::thread& t : workers_) t.join();
}

bool ThreadPool::work_on_job(uint32_t thread) {
  bool any = false;
  uint64_t word = claim_.load(std::memory_order_acquire);
  for (;;) {
    const uint32_t next = uint32_t(word & kChunkMask);
    const uint32_t n = uint32_t((word >> kChunkBits) & kChunkMask);
    if (next >= n) return any;
    // Success means the chunk belongs to the job this word describes; that job cannot
    // end (nor fn_/context_ change) before this chunk is counted done.
    if (claim_.compare_exchange_weak(word, word + 1, std::memory_order_acq_rel,
                                     std::memory_order_acquire)) {
      fn_(context_, next, thread);
      done_.fetch_add(1, std::memory_order_acq_rel);
      any = true;
      word = claim_.load(std::memory_order_acquire);
    }
  }
}

void ThreadPool::run_erased(uint32_t n_chunks, Fn fn, void* context) {
  if (n_chunks == 0) return;
  if (workers_.empty() || n_chunks == 1) {
    for (uint32_t c = 0; c < n_chunks; ++c) fn(context, c, 0);
    return;
  }
  // The previous job is over (every chunk done): no worker holds a claim on it, so its
  // fields may be replaced before the new claim word is published.
  fn_ = fn;
  context_ = context;
  done_.store(0, std::memory_order_relaxed);
  resting_.store(false, std::memory_order_relaxed);
  claim_.store(claim_word(++serial_, n_chunks, 0), std::memory_order_release);
  // seq_cst on both sides: either this sees a worker's sleepers_ increment and wakes it,
  // or that worker's predicate sees the new wake_ value and it does not sleep.
  wake_.fetch_add(1, std::memory_order_seq_cst);
  if (sleepers_.load(std::memory_order_seq_cst) > 0) {
    std::lock_guard<std::mutex> lock(mutex_);
    sleep_.notify_all();
  }
  work_on_job(0);
  // Chunks other threads still hold: spin, then yield the CPU (a preempted worker may
  // need this core to finish).
  for (uint32_t spins = 0; done_.load(std::memory_order_acquire) != n_chunks; ++spins) {
    if (spins < 4096) {
      cpu_relax();
    } else {
      sched_yield();
    }
  }
}

void ThreadPool::work(uint32_t thread) {
  // wake_ as the pool was built: a thread that starts late still sees every bump since,
  // the destructor's included.
  uint32_t seen = 0;
  for (;;) {
    uint32_t now = wake_.load(std::memory_order_acquire);
    const Clock::time_point spin_start = Clock::now();
    for (uint32_t i = 1; now == seen; ++i) {
      cpu_relax();
      // Check the clock and the rest flag every 64 spins, not every one.
      if (i % 64 == 0 &&
          (resting_.load(std::memory_order_relaxed) ||
           Clock::now() - spin_start > std::chrono::microseconds(kSpinMicros))) {
        std::unique_lock<std::mutex> lock(mutex_);
        sleepers_.fetch_add(1, std::memory_order_seq_cst);
        sleep_.wait(lock, [&] { return wake_.load(std::memory_order_seq_cst) != seen; });
        sleepers_.fetch_sub(1, std::memory_order_relaxed);
      }
      now = wake_.load(std::memory_order_acquire);
    }
    seen = now;
    if (stop_.load(std::memory_order_seq_cst)) return;
    work_on_job(thread);
  }
}

}  // namespace engine
