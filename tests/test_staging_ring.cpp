// StagingRing (runtime/staging_ring.hpp) on a fake device whose events complete only when
// waited for (a host running arbitrarily far ahead): no bytes an unfinished use may still
// read are handed out again, waits happen only when the ring is full, it grows on demand.
#include <doctest/doctest.h>

#include <cstring>
#include <map>
#include <random>
#include <vector>

#include "../runtime/staging_ring.hpp"
#include "fake_device.hpp"

using namespace kvgc;
using kvgc_test::FakeDevice;

namespace {

struct Use {
  uint8_t* p;
  size_t n;
  uint8_t tag;
};

}  // namespace

TEST_CASE("staging ring: bytes in flight are never handed out again; waits only when full; grows") {
  FakeDevice dev;
  StagingRing ring;
  std::mt19937 rng(7);
  std::vector<Use> flight;  // uses not yet known complete, oldest first
  for (int i = 0; i < 3000; ++i) {
    CAPTURE(i);
    // Mostly small lists, now and then one larger than the ring so far.
    const size_t n = rng() % 50 == 0 ? 1 + rng() % (200 << 10) : 1 + rng() % 6000;
    const uint64_t waits_before = dev.blocking_waits;
    void* p = nullptr;
    REQUIRE(ring.take(dev, n, &p).ok());
    REQUIRE(p != nullptr);
    CHECK(reinterpret_cast<uintptr_t>(p) % 16 == 0);
    // Uses the ring waited for are complete: drop them from what must stay intact.
    const uint64_t waited = dev.blocking_waits - waits_before;
    if (waited) {
      // The ring waits oldest first; a grow waits for everything.
      flight.erase(flight.begin(), flight.begin() + std::min<size_t>(waited, flight.size()));
    }
    for (const Use& u : flight)
      for (size_t j = 0; j < u.n; j += 97) REQUIRE(u.p[j] == u.tag);  // still as written
    const uint8_t tag = uint8_t(1 + i % 251);
    std::memset(p, tag, n);
    flight.push_back({static_cast<uint8_t*>(p), n, tag});
    REQUIRE(ring.enqueued(dev, nullptr).ok());
    // Nothing in flight overlaps.
    for (size_t a = 0; a + 1 < flight.size(); ++a) {
      const Use& u = flight[a];
      const Use& w = flight.back();
      CHECK((w.p + w.n <= u.p || u.p + u.n <= w.p));
    }
  }
  // The host ran ahead of a device that never finishes on its own: the ring waited.
  CHECK(dev.blocking_waits > 0);
  CHECK(ring.capacity() >= (200u << 10) / 2);
  CHECK(dev.allocs >= 2);  // it grew
  ring.release(dev);
  CHECK(dev.live_bytes == 0);
  CHECK(dev.recorded.empty());  // every event destroyed
}

TEST_CASE("staging ring: no wait until the ring or its 64 slots are full; then the oldest") {
  for (const size_t n : {size_t(16), size_t(1) << 10}) {  // 64 x 1 KiB fill 64 KiB exactly
    CAPTURE(n);
    FakeDevice dev;
    StagingRing ring;
    void* p;
    for (uint32_t i = 0; i < StagingRing::kSlots; ++i) {
      REQUIRE(ring.take(dev, n, &p).ok());
      REQUIRE(ring.enqueued(dev, nullptr).ok());
    }
    CHECK(ring.capacity() == (64u << 10));
    CHECK(dev.blocking_waits == 0);
    REQUIRE(ring.take(dev, n, &p).ok());
    CHECK(dev.blocking_waits == 1);
    ring.release(dev);
    CHECK(dev.live_bytes == 0);
  }
}
