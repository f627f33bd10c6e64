// StagingRing (runtime/staging_ring.hpp) on a fake device whose events complete only when
// waited for (a host running arbitrarily far ahead): no bytes an unfinished use may still
// read are handed out again, waits happen only when the ring is full, it grows on demand.
#include <doctest/doctest.h>

#include <cstring>
#include <map>
#include <random>
#include <vector>

#include "../runtime/staging_ring.hpp"

using namespace kvgc;

namespace {

// Only the calls a StagingRing makes do anything; events are ids whose completion the
// device reports only when waited for.
class FakeDevice final : public Backend {
 public:
  std::map<uintptr_t, bool> recorded;  // event -> recorded and not yet waited for
  uint64_t waits = 0, blocking_waits = 0, allocs = 0, live_bytes = 0;
  uintptr_t next_event = 1;

  kvgc_device kind() const override { return KVGC_DEVICE_CUDA; }
  std::string describe() const override { return "fake"; }
  Status free_memory(uint64_t* b) override { *b = 0; return Status::Ok(); }
  Status reserve(size_t, void**) override { return Status::Ok(); }
  void release(void*) override {}
  Status copy(void*, const void*, size_t, CopyKind, void*) override { return Status::Ok(); }
  Status fill(void*, int, size_t, void*) override { return Status::Ok(); }
  Status synchronize(void*) override { return Status::Ok(); }
  Status check_pointer(const void*, const char*) override { return Status::Ok(); }
  Status append(const AppendOp&, void*) override { return Status::Ok(); }
  Status gather(const GatherOp&, void*) override { return Status::Ok(); }
  Status observe(const ObserveOp&, void*) override { return Status::Ok(); }
  Status select(const SelectOp&, void*) override { return Status::Ok(); }
  Status compact(const CompactOp&, void*) override { return Status::Ok(); }
  Status attend(const AttendOp&, void*) override { return Status::Ok(); }
  size_t attend_scratch_bytes(uint64_t, const kvgc_model_desc&, uint32_t) const override { return 0; }
  size_t gc_scratch_bytes(uint64_t, const kvgc_model_desc&, uint32_t) const override { return 0; }

  Status event_create(void** e) override {
    *e = reinterpret_cast<void*>(next_event++);
    recorded[uintptr_t(*e)] = false;
    return Status::Ok();
  }
  void event_destroy(void* e) override { recorded.erase(uintptr_t(e)); }
  Status event_record(void* e, void*) override {
    REQUIRE(recorded.count(uintptr_t(e)));
    recorded[uintptr_t(e)] = true;
    return Status::Ok();
  }
  Status event_wait(void* e) override {
    ++waits;
    blocking_waits += recorded[uintptr_t(e)];
    recorded[uintptr_t(e)] = false;  // the device has caught up to it
    return Status::Ok();
  }
  Status result_alloc(size_t bytes, void** p) override {
    ++allocs;
    live_bytes += bytes;
    *p = new uint8_t[bytes];
    return Status::Ok();
  }
  void result_free(void* p, size_t bytes) override {
    if (!p) return;
    live_bytes -= bytes;
    delete[] static_cast<uint8_t*>(p);
  }
};

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
