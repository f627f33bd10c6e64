#include "thread_pool.hpp"

#include <algorithm>
#include <chrono>
#include <utility>

namespace kvgc::cpu {
namespace {

// How long an idle worker (or the caller waiting for the last task) spins before it
// sleeps. The phases of one attention call follow each other within a microsecond or
// two, so inside a call nobody sleeps; between calls an engine runs its matmuls, often
// on BLAS threads of its own, and a spinning worker would steal their core. Waking a
// sleeper costs the caller a futex call (about 8 us on the 2-core VM), and the caller
// never waits for the wake: it claims the tasks a sleeping worker has not taken.
// Engine decode with 10, 30 and 100 us spins was the same within the noise (+-10%).
constexpr auto kSpin = std::chrono::microseconds(10);

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Spins until done() or kSpin has passed; true if done.
template <class Done>
bool spin_until(Done done) {
  const auto deadline = std::chrono::steady_clock::now() + kSpin;
  for (unsigned i = 1;; ++i) {
    if (done()) return true;
    cpu_relax();
    if (i % 64 == 0 && std::chrono::steady_clock::now() > deadline) return done();
  }
}

constexpr uint64_t ticket(uint32_t gen, unsigned n_tasks, unsigned next) {
  return uint64_t(gen) << 32 | uint64_t(n_tasks) << 16 | next;
}

}  // namespace

ThreadPool::ThreadPool(unsigned n) {
  const unsigned want = std::clamp(n, 1u, kMaxThreads) - 1;
  threads_.reserve(want);  // may throw: no thread runs yet, nothing to undo
  for (unsigned i = 0; i < want; ++i) {
    // A refused thread (std::system_error) or no memory for its start-up state
    // (std::bad_alloc, from std::thread's own allocation) makes the pool smaller. Letting
    // either escape would destroy joinable threads (std::terminate), or the condition
    // variables under a waiting worker (pthread_cond_destroy then blocks: a deadlock).
    try {
      threads_.emplace_back([this] { worker_loop(); });
    } catch (...) {
      break;
    }
  }
}

ThreadPool::~ThreadPool() {
  stop_.store(true);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    generation_.fetch_add(1);
  }
  wake_.notify_all();
  for (std::thread& t : threads_) t.join();
}

void ThreadPool::worker_loop() {
  // Not generation_.load(): a thread may start after the pool has run (or is being
  // destroyed), and must still see that generation as new. Nothing runs before the
  // constructor returns, so every worker starts from generation 0.
  uint32_t seen = 0;
  for (;;) {
    uint32_t g = generation_.load();
    if (g == seen && !spin_until([&] { return (g = generation_.load()) != seen; })) {
      std::unique_lock<std::mutex> lock(mutex_);
      sleepers_.fetch_add(1);
      wake_.wait(lock, [&] { return generation_.load() != seen || stop_.load(); });
      sleepers_.fetch_sub(1);
      continue;
    }
    if (stop_.load()) return;  // before the generation it bumped: no task is pending
    seen = g;
    work(g);
  }
}

void ThreadPool::work(uint32_t gen) {
  uint64_t t = ticket_.load();
  for (;;) {
    const unsigned n = unsigned(t >> 16) & 0xffffu, next = unsigned(t) & 0xffffu;
    if (uint32_t(t >> 32) != gen || next >= n) return;
    if (ticket_.compare_exchange_weak(t, t + 1)) {
      run_task(next);
      t = ticket_.load();
    }
  }
}

void ThreadPool::run_task(unsigned task) {
  try {
    call_(ctx_, task);
  } catch (...) {
    if (!failed_.exchange(true)) error_ = std::current_exception();
  }
  // The last task wakes the caller if it went to sleep (the same handshake as the workers').
  if (remaining_.fetch_sub(1) == 1 && caller_sleeping_.load()) {
    std::lock_guard<std::mutex> lock(mutex_);
    done_.notify_all();
  }
}

void ThreadPool::run_erased(unsigned n_tasks, Call call, void* ctx) {
  if (n_tasks == 0) return;
  if (threads_.empty() || n_tasks == 1) {
    for (unsigned t = 0; t < n_tasks; ++t) call(ctx, t);
    return;
  }
  n_tasks = std::min(n_tasks, 0xffffu);
  call_ = call;
  ctx_ = ctx;
  remaining_.store(n_tasks);
  const uint32_t gen = generation_.load() + 1;
  ticket_.store(ticket(gen, n_tasks, 0));  // before the generation: a woken worker finds it
  generation_.store(gen);
  if (sleepers_.load()) {
    std::lock_guard<std::mutex> lock(mutex_);
    wake_.notify_all();
  }
  work(gen);
  if (!spin_until([&] { return remaining_.load() == 0; })) {
    std::unique_lock<std::mutex> lock(mutex_);
    caller_sleeping_.store(true);
    done_.wait(lock, [&] { return remaining_.load() == 0; });
    caller_sleeping_.store(false);
  }
  if (failed_.load()) {
    failed_.store(false);
    std::rethrow_exception(std::exchange(error_, nullptr));
  }
}

}  // namespace kvgc::cpu
