// The engine's matmul threads: the calling thread plus size() - 1 workers. A job runs
// once on every thread (index 0 on the caller) and run() returns when all are done.
// Between jobs a worker spins for up to kSpinMicros (a decode step runs a matmul every
// few tens of microseconds, and waking a sleeping thread costs about as much as the
// matmul), then sleeps on a futex (std::atomic::wait). rest() sends the workers to sleep
// at once: the engine calls it before kvgc runs its own attention threads
// (KVGC_THREADS > 1), so the two pools never compete for the same cores.
#pragma once

#include <atomic>
#include <cstdint>
#include <thread>
#include <vector>

namespace engine {

class ThreadPool {
 public:
  static constexpr uint32_t kSpinMicros = 1000;

  // `threads` >= 1 (0 is taken as 1). If the system refuses a thread, the pool runs
  // with the ones it got (size() says how many).
  explicit ThreadPool(uint32_t threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  uint32_t size() const { return uint32_t(workers_.size()) + 1; }

  // Runs job(index) for every index in [0, size()) and waits for all of them.
  template <class Job>
  void run(Job& job) {
    run_erased([](void* context, uint32_t index) { (*static_cast<Job*>(context))(index); },
               &job);
  }

  // Workers stop spinning and sleep until the next run().
  void rest() { resting_.store(true, std::memory_order_relaxed); }

  // How many threads the process may run on: the CPUs in its affinity mask (at least 1).
  static uint32_t available_cpus();

 private:
  void run_erased(void (*fn)(void*, uint32_t), void* context);
  void work(uint32_t index);

  std::vector<std::thread> workers_;
  void (*fn_)(void*, uint32_t) = nullptr;
  void* context_ = nullptr;
  std::atomic<uint32_t> generation_{0};  // bumped for each job (and to stop)
  std::atomic<uint32_t> pending_{0};     // workers still running the current job
  std::atomic<uint32_t> sleepers_{0};    // workers blocked in generation_.wait
  std::atomic<bool> resting_{false};
  std::atomic<bool> stop_{false};
};

}  // namespace engine
