#include "staging_ring.hpp"

#include <algorithm>

namespace kvgc {

size_t StagingRing::fit(size_t n) const {
  if (count_ == 0) return n <= capacity_ ? 0 : SIZE_MAX;
  const Use& oldest = uses_[first_];
  const Use& newest = uses_[(first_ + count_ - 1) % kSlots];
  if (newest.begin >= oldest.begin) {  // in flight: [oldest.begin, newest.end)
    if (newest.end + n <= capacity_) return newest.end;
    if (n <= oldest.begin) return 0;  // wrap around
    return SIZE_MAX;
  }
  // Wrapped: in flight [oldest.begin, capacity) and [0, newest.end).
  return newest.end + n <= oldest.begin ? newest.end : SIZE_MAX;
}

Status StagingRing::wait_oldest(Backend& b) {
  KVGC_TRY(b.event_wait(events_[first_]));
  first_ = (first_ + 1) % kSlots;
  --count_;
  return Status::Ok();
}

Status StagingRing::take(Backend& b, size_t bytes, void** out) {
  const size_t n = std::max<size_t>(16, (bytes + 15) / 16 * 16);
  if (n > capacity_) {  // grow: nothing in flight may still read the old ring
    while (count_) KVGC_TRY(wait_oldest(b));
    const size_t cap = std::max({n, 2 * capacity_, size_t(64) << 10});
    void* p = nullptr;
    KVGC_TRY(b.result_alloc(cap, &p));
    b.result_free(base_, capacity_);
    base_ = static_cast<uint8_t*>(p);
    capacity_ = cap;
  }
  size_t at;
  while (count_ == kSlots || (at = fit(n)) == SIZE_MAX) KVGC_TRY(wait_oldest(b));
  const uint32_t slot = (first_ + count_) % kSlots;
  if (!made_[slot]) {
    KVGC_TRY(b.event_create(&events_[slot]));
    made_[slot] = true;
  }
  uses_[slot] = {at, at + n};
  ++count_;
  *out = base_ + at;
  return Status::Ok();
}

Status StagingRing::enqueued(Backend& b, void* stream) {
  if (count_ == 0) return Status::Ok();
  const uint32_t newest = (first_ + count_ - 1) % kSlots;
  if (b.event_record(events_[newest], stream).ok()) return Status::Ok();
  // Without its event the use cannot be tracked: wait for the stream instead.
  KVGC_TRY(b.synchronize(stream));
  return Status::Ok();
}

void StagingRing::release(Backend& b) {
  while (count_ && wait_oldest(b).ok()) {
  }
  for (uint32_t i = 0; i < kSlots; ++i)
    if (made_[i]) b.event_destroy(events_[i]);
  b.result_free(base_, capacity_);
  *this = StagingRing();
}

}  // namespace kvgc
