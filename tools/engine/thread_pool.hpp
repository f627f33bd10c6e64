// The engine's matmul threads: the calling thread plus size() - 1 workers share the
// chunks of a job. The caller never waits for a worker to start: it claims chunks itself
// from the first moment, workers join as they wake, and run() returns when every chunk is
// done. So a worker the OS has not scheduled (a shared machine) slows a job by at most the
// chunk it holds, never by a whole time slice. Between jobs a worker spins for up to
// kSpinMicros (a decode step runs a matmul every few tens of microseconds), then sleeps on
// a condition variable. rest() sends the workers to sleep at once: the engine calls
// it before kvgc runs its own attention threads (KVGC_THREADS > 1), so the two pools never
// compete for the same cores.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace engine {

class ThreadPool {
 public:
  static constexpr uint32_t kSpinMicros = 100;
  static constexpr uint32_t kMaxChunks = (1u << 24) - 1;

  // `threads` >= 1 (0 is taken as 1). If the system refuses a thread, the pool runs
  // with the ones it got (size() says how many).
  explicit ThreadPool(uint32_t threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  uint32_t size() const { return uint32_t(workers_.size()) + 1; }

  // Runs job(chunk, thread) once for every chunk in [0, n_chunks) (at most kMaxChunks),
  // each on some thread (0 is the caller, 1.. the workers), and returns when all are done.
  template <class Job>
  void run(uint32_t n_chunks, Job& job) {
    run_erased(n_chunks,
               [](void* context, uint32_t chunk, uint32_t thread) {
                 (*static_cast<Job*>(context))(chunk, thread);
               },
               &job);
  }

  // Workers stop spinning and sleep until the next run().
  void rest() { resting_.store(true, std::memory_order_relaxed); }

  // How many threads the process may run on: the CPUs in its affinity mask (at least 1).
  static uint32_t available_cpus();

 private:
  using Fn = void (*)(void*, uint32_t, uint32_t);
  void run_erased(uint32_t n_chunks, Fn fn, void* context);
  // Claims and runs chunks of the current job until none is left; false if none was.
  bool work_on_job(uint32_t thread);
  void work(uint32_t thread);

  std::vector<std::thread> workers_;
  Fn fn_ = nullptr;
  void* context_ = nullptr;
  // The current job's chunks: job serial (16 bits) | chunk count (24) | next chunk (24).
  // A worker claims a chunk by a CAS on this word, so it runs only chunks of the job it
  // saw, and the job's fn_/context_ stay valid until its claimed chunk is done.
  std::atomic<uint64_t> claim_{0};
  std::atomic<uint32_t> done_{0};        // chunks of the current job finished
  std::atomic<uint32_t> wake_{0};        // bumped for each job (and to stop)
  std::atomic<uint32_t> sleepers_{0};    // workers asleep on sleep_ (changed under mutex_)
  std::mutex mutex_;
  std::condition_variable sleep_;
  std::atomic<bool> resting_{false};
  std::atomic<bool> stop_{false};
  uint32_t serial_ = 0;
};

}  // namespace engine
