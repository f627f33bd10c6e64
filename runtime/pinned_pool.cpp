#include "pinned_pool.hpp"

namespace kvgc {

int PinnedPool::class_of(size_t bytes) {
  int c = 0;
  while ((kMinBlock << c) < bytes) ++c;
  return c;
}

Status PinnedPool::alloc(Backend& b, size_t bytes, void** out, size_t* size) {
  if (bytes > kChunk) {  // rare and large: the backend's own
    KVGC_TRY(b.result_alloc(bytes, out));
    *size = bytes;
    return Status::Ok();
  }
  const int c = class_of(bytes);
  const size_t n = kMinBlock << c;
  if (FreeBlock* f = free_[c]) {
    free_[c] = f->next;
    *out = f;
    *size = n;
    return Status::Ok();
  }
  if (carve_left_ < n) {
    chunks_.reserve(chunks_.size() + 1);  // may throw: nothing taken yet
    void* chunk = nullptr;
    KVGC_TRY(b.result_alloc(kChunk, &chunk));
    // The old chunk's tail goes to the free lists, largest pieces first.
    for (int k = kClasses - 1; k >= 0; --k)
      while (carve_left_ >= (kMinBlock << k)) {
        auto* f = reinterpret_cast<FreeBlock*>(carve_);
        f->next = free_[k];
        free_[k] = f;
        carve_ += kMinBlock << k;
        carve_left_ -= kMinBlock << k;
      }
    chunks_.push_back(chunk);
    carve_ = static_cast<uint8_t*>(chunk);
    carve_left_ = kChunk;
  }
  *out = carve_;
  *size = n;
  carve_ += n;
  carve_left_ -= n;
  return Status::Ok();
}

void PinnedPool::free(Backend& b, void* p, size_t size) {
  if (!p) return;
  if (size > kChunk) {
    b.result_free(p, size);
    return;
  }
  const int c = class_of(size);
  auto* f = static_cast<FreeBlock*>(p);
  f->next = free_[c];
  free_[c] = f;
}

void PinnedPool::release(Backend& b) {
  for (void* c : chunks_) b.result_free(c, kChunk);
  chunks_.clear();
  chunks_.shrink_to_fit();
  for (FreeBlock*& f : free_) f = nullptr;
  carve_ = nullptr;
  carve_left_ = 0;
}

}  // namespace kvgc
