// A Backend for host-only tests of the runtime's device plumbing (StagingRing,
// PinnedPool): only events and result memory do anything. Events complete only when
// waited for (a host running arbitrarily far ahead of its device); result memory is
// counted so that leaks show.
#pragma once

#include <doctest/doctest.h>

#include <map>

#include "../runtime/backend.hpp"

namespace kvgc_test {

using namespace kvgc;

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
  Status requant(const RequantOp&, void*) override { return Status::Ok(); }
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

}  // namespace kvgc_test
