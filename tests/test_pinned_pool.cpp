// PinnedPool (runtime/pinned_pool.hpp): blocks from 1 MiB chunks, reused through free
// lists, never handed out twice, chunks back to the backend only at release; requests
// above the largest class go straight to the backend.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <vector>

#include "../runtime/pinned_pool.hpp"
#include "fake_device.hpp"

using namespace kvgc;
using kvgc_test::FakeDevice;

TEST_CASE("pinned pool: blocks never overlap, are reused, and chunks go back only at release") {
  FakeDevice dev;
  PinnedPool pool;
  std::mt19937 rng(11);
  struct Block {
    uint8_t* p;
    size_t size, asked;
    uint8_t tag;
  };
  std::vector<Block> live;
  uint64_t allocs_after_warmup = 0;
  for (int i = 0; i < 20000; ++i) {
    CAPTURE(i);
    if (i == 10000) allocs_after_warmup = dev.allocs;
    if (!live.empty() && rng() % 2) {  // free a random block, after checking its bytes
      const size_t j = rng() % live.size();
      const Block b = live[j];
      for (size_t k = 0; k < b.asked; k += 61) REQUIRE(b.p[k] == b.tag);
      pool.free(dev, b.p, b.size);
      live[j] = live.back();
      live.pop_back();
      continue;
    }
    // Mostly result blocks of a few KiB, sometimes up to 1 MiB, rarely beyond.
    const size_t asked = rng() % 400 == 0 ? (1u << 20) + 1 + rng() % (1u << 20)
                         : rng() % 20 == 0 ? 1 + rng() % (1u << 20)
                                           : 1 + rng() % 8000;
    void* p = nullptr;
    size_t size = 0;
    REQUIRE(pool.alloc(dev, asked, &p, &size).ok());
    REQUIRE(size >= asked);
    CHECK(reinterpret_cast<uintptr_t>(p) % 16 == 0);
    const uint8_t tag = uint8_t(1 + i % 251);
    std::memset(p, tag, asked);
    live.push_back({static_cast<uint8_t*>(p), size, asked, tag});
    if (live.size() > 64) {  // keep the working set bounded: free the oldest
      const Block b = live.front();
      for (size_t k = 0; k < b.asked; k += 61) REQUIRE(b.p[k] == b.tag);
      pool.free(dev, b.p, b.size);
      live.erase(live.begin());
    }
  }
  // Every live block intact and disjoint from the others.
  std::sort(live.begin(), live.end(), [](const Block& a, const Block& b) { return a.p < b.p; });
  for (size_t j = 0; j + 1 < live.size(); ++j) CHECK(live[j].p + live[j].size <= live[j + 1].p);
  for (const Block& b : live)
    for (size_t k = 0; k < b.asked; k += 61) REQUIRE(b.p[k] == b.tag);
  // In steady state blocks come back from the free lists: few new chunks after warm-up
  // (beyond the large requests, which the backend serves one by one).
  CHECK(pool.chunks() > 0);
  CHECK(dev.allocs - allocs_after_warmup < 200);
  for (const Block& b : live) pool.free(dev, b.p, b.size);
  const uint64_t before_release = dev.live_bytes;
  CHECK(before_release == pool.chunks() * PinnedPool::kChunk);  // only chunks remain
  pool.release(dev);
  CHECK(dev.live_bytes == 0);
}

TEST_CASE("pinned pool: a freed block is the next one of its class; no backend call for it") {
  FakeDevice dev;
  PinnedPool pool;
  void *a, *b, *c;
  size_t sa, sb, sc;
  REQUIRE(pool.alloc(dev, 3000, &a, &sa).ok());
  CHECK(sa == 4096);
  REQUIRE(pool.alloc(dev, 4096, &b, &sb).ok());
  CHECK(dev.allocs == 1);  // one chunk serves both
  pool.free(dev, a, sa);
  REQUIRE(pool.alloc(dev, 2049, &c, &sc).ok());
  CHECK(c == a);
  CHECK(dev.allocs == 1);
  pool.free(dev, b, sb);
  pool.free(dev, c, sc);
  pool.release(dev);
  CHECK(dev.live_bytes == 0);
}
