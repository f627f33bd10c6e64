// cpu::ThreadPool: every task runs exactly once per run, runs follow each other (awake
// and after the workers fell asleep), a task's exception reaches the caller, and a pool
// destroyed at once (its threads not yet started) still joins. TSan runs these
// (`threads*` in the sanitize target's filter).
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <stdexcept>
#include <thread>
#include <vector>

#include "../kernels/cpu/thread_pool.hpp"

using kvgc::cpu::ThreadPool;

TEST_CASE("threads: a pool runs every task exactly once, run after run") {
  for (unsigned n : {1u, 2u, 3u, 8u}) {
    ThreadPool pool(n);
    CHECK(pool.size() == n);
    for (unsigned tasks : {0u, 1u, 2u, 5u, 64u}) {
      std::vector<std::atomic<int>> hits(tasks);
      for (int round = 0; round < 50; ++round) pool.run(tasks, [&](unsigned t) { hits[t]++; });
      for (unsigned t = 0; t < tasks; ++t) CHECK(hits[t].load() == 50);
    }
  }
}

TEST_CASE("threads: tasks' writes are visible to the caller after run, also after sleeping") {
  ThreadPool pool(4);
  std::vector<int> out(4, 0);  // plain ints: run() must order them (TSan checks)
  for (int round = 1; round <= 20; ++round) {
    if (round % 5 == 0) std::this_thread::sleep_for(std::chrono::milliseconds(2));  // sleepers
    pool.run(4, [&](unsigned t) { out[t] += int(t) + round; });
    for (unsigned t = 0; t < 4; ++t) CHECK(out[t] == int(t) * round + round * (round + 1) / 2);
  }
}

TEST_CASE("threads: a task's exception reaches the caller, and the pool still works") {
  ThreadPool pool(3);
  std::atomic<int> ran{0};
  CHECK_THROWS_AS(pool.run(6,
                           [&](unsigned t) {
                             ran++;
                             if (t == 4) throw std::runtime_error("task 4");
                           }),
                  std::runtime_error);
  CHECK(ran.load() == 6);  // every task still ran: the caller waits for all
  ran = 0;
  pool.run(6, [&](unsigned) { ran++; });
  CHECK(ran.load() == 6);
}

TEST_CASE("threads: pools created and destroyed at once, or after one run, join") {
  for (int i = 0; i < 50; ++i) {
    ThreadPool idle(4);  // its workers may not have started when it is destroyed
  }
  for (int i = 0; i < 50; ++i) {
    ThreadPool pool(3);
    int x = 0;
    pool.run(1, [&](unsigned) { x = 1; });
    CHECK(x == 1);
  }
  ThreadPool clamped(100000);
  CHECK(clamped.size() <= ThreadPool::kMaxThreads);
}
