// A small persistent pool of worker threads for the CPU kernels (multi-threaded decode
// attention). The calling thread is worker 0: a pool of n runs n - 1 threads of its own.
//
// Dispatch is built for short calls (a decode attention is a few hundred microseconds,
// made of several phases): between runs an idle worker spins for a short while, then
// sleeps on a condition variable (which TSan models exactly); run() takes the lock to
// wake sleepers only when there are any.
// Tasks are claimed one by one from a (generation, next task) ticket, so a worker that
// is late for one run can never take a task of the next.
//
// Not reentrant and not for concurrent callers: one run at a time (the heap's lock
// serialises the calls that use it). A task that throws does not reach its thread: the
// first exception is rethrown by run() once every task has finished.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <type_traits>

#include "../../allocator/host_memory.hpp"

namespace kvgc::cpu {

class ThreadPool : public host::HostAllocated {
 public:
  static constexpr unsigned kMaxThreads = 256;

  // Starts min(n, kMaxThreads) - 1 workers. When the system refuses a thread, or host
  // memory for its start-up runs out, the pool keeps the ones it got (size() says how
  // many): fewer threads, never a failure. std::bad_alloc only if the thread array
  // itself cannot be had (no thread started; the C API's KVGC_ENOMEM).
  explicit ThreadPool(unsigned n);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  // Workers, the caller included.
  unsigned size() const { return unsigned(threads_.size()) + 1; }

  // fn(task) for every task in [0, n_tasks), on the caller and the workers; returns when
  // all are done. n_tasks <= 65535.
  template <class F>
  void run(unsigned n_tasks, F&& fn) {
    using Fn = std::remove_reference_t<F>;
    run_erased(n_tasks, [](void* ctx, unsigned task) { (*static_cast<Fn*>(ctx))(task); },
               const_cast<void*>(static_cast<const void*>(&fn)));
  }

 private:
  using Call = void (*)(void* ctx, unsigned task);
  void run_erased(unsigned n_tasks, Call call, void* ctx);
  void worker_loop();
  // Claims and runs tasks of generation `gen` until none is left.
  void work(uint32_t gen);
  void run_task(unsigned task);

  host::vector<std::thread> threads_;
  // (generation << 32) | (n_tasks << 16) | next task: claimed by compare-and-swap.
  std::atomic<uint64_t> ticket_{0};
  std::atomic<uint32_t> generation_{0};  // what idle workers wait for a change of
  std::atomic<uint32_t> sleepers_{0};    // workers asleep (or about to be) on wake_
  std::atomic<uint32_t> remaining_{0};   // tasks of the current run not yet finished
  std::atomic<bool> caller_sleeping_{false};
  // Sleeping only: a sleeper announces itself (sleepers_, caller_sleeping_) and checks
  // its condition under mutex_; the other side changes the value, then reads the
  // announcement (all seq_cst) and, if set, notifies under mutex_. No wakeup is lost.
  std::mutex mutex_;
  std::condition_variable wake_, done_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> failed_{false};
  std::exception_ptr error_;  // written by the task that set failed_, read by run()
  // Written by run() before the ticket is published, read by workers after they claim.
  Call call_ = nullptr;
  void* ctx_ = nullptr;
};

}  // namespace kvgc::cpu
