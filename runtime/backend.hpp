// The device backend: where the arena lives and who executes the data-plane ops.
//
// Lifetime and stream rules (RMM-style, stated once here):
//   - reserve() is called once per heap; release() once, at heap destruction, after
//     the engine has finished every stream that used the arena.
//   - copy/fill/append/gather/observe/select/compact/attend are enqueued on `stream`
//     (the engine's cudaStream_t on CUDA; ignored on CPU, where they complete before
//     returning). None synchronises, except synchronize() and event_wait().
//   - select's page-level results (page_live and the SelectResult, a few bytes per
//     page) are host memory from result_alloc() that the device writes asynchronously;
//     the runtime records an event after the op and reads them once event_wait() says
//     they are complete: at the next step (the deferred harvest) or at once
//     (KVGC_HARVEST=immediate).
//   - Every device error comes back as KVGC_EDEVICE with the device's own message.
#pragma once

#include <memory>
#include <string>

#include "../allocator/host_memory.hpp"
#include "../kernels/ops.hpp"
#include "status.hpp"

namespace kvgc {

enum class CopyKind { HostToDevice, DeviceToHost, DeviceToDevice };

class Backend : public host::HostAllocated {
 public:
  virtual ~Backend() = default;
  virtual kvgc_device kind() const = 0;
  virtual std::string describe() const = 0;  // "cpu" or "cuda:0 NVIDIA H200 (...)"

  // Bytes a budget fraction is taken of: free device memory (CUDA) or available host
  // memory (CPU).
  virtual Status free_memory(uint64_t* bytes) = 0;
  virtual Status reserve(size_t bytes, void** base) = 0;
  virtual void release(void* base) = 0;

  virtual Status copy(void* dst, const void* src, size_t bytes, CopyKind kind, void* stream) = 0;
  virtual Status fill(void* dst, int byte, size_t bytes, void* stream) = 0;
  virtual Status synchronize(void* stream) = 0;

  // Completion markers for results read later. event_record marks the work enqueued
  // on `stream` so far; event_wait blocks until that work is done. The defaults are the
  // CPU's: every op is complete when it returns, so an event is null and free.
  virtual Status event_create(void** event) {
    *event = nullptr;
    return Status::Ok();
  }
  virtual void event_destroy(void* /*event*/) {}
  virtual Status event_record(void* /*event*/, void* /*stream*/) { return Status::Ok(); }
  virtual Status event_wait(void* /*event*/) { return Status::Ok(); }
  // Host memory the device writes (and reads) asynchronously: page-locked on CUDA, so
  // copies to and from it never wait; plain host memory by default. 16-byte aligned.
  virtual Status result_alloc(size_t bytes, void** p);
  virtual void result_free(void* p, size_t bytes);

  // KVGC_EINVAL naming `what` if `p` is not memory this backend's ops can read.
  virtual Status check_pointer(const void* p, const char* what) = 0;

  virtual Status append(const AppendOp& op, void* stream) = 0;
  virtual Status gather(const GatherOp& op, void* stream) = 0;
  // The GC's ops. select's page-level outputs (SelectOp::page_live, result) are
  // result_alloc() memory, complete once an event recorded after the op has passed.
  virtual Status observe(const ObserveOp& op, void* stream) = 0;
  virtual Status select(const SelectOp& op, void* stream) = 0;
  // select over n segments at once (kvgc_step's layers, kvgc_batch_step's sequences):
  // the same decisions as n selects in order. *launched says how many ops were enqueued
  // (all n on success; on a failure the first *launched ran and the rest changed
  // nothing), and is kept current while it runs, so it holds if an op throws. The
  // default loops over select (the CPU: the specification); CUDA's runs every phase over
  // all segments in a constant number of launches.
  virtual Status select_batch(const SelectOp* ops, uint32_t n, void* stream, uint32_t* launched) {
    *launched = 0;
    for (uint32_t i = 0; i < n; ++i) {
      KVGC_TRY(select(ops[i], stream));
      *launched = i + 1;
    }
    return Status::Ok();
  }
  virtual Status compact(const CompactOp& op, void* stream) = 0;
  virtual Status requant(const RequantOp& op, void* stream) = 0;
  virtual Status attend(const AttendOp& op, void* stream) = 0;
  // Device scratch the heap must reserve (carved from its arena) so that attention can
  // run over a segment of up to max_tokens live tokens; 0 when the executor needs none.
  virtual size_t attend_scratch_bytes(uint64_t max_tokens, const kvgc_model_desc& m,
                                      uint32_t page_tokens) const = 0;
  // Device scratch select needs over a segment of up to max_tokens slots (pages of
  // either class x page_tokens); 0 when the executor needs none. The heap carves one
  // scratch of the larger of this and attend_scratch_bytes: attention and the GC never
  // run concurrently on one heap's stream, so they share it.
  virtual size_t gc_scratch_bytes(uint64_t max_tokens, const kvgc_model_desc& m,
                                  uint32_t page_tokens) const = 0;
};

// `threads`: attention's workers (opts->cpu_threads), the calling thread included.
std::unique_ptr<Backend> make_cpu_backend(uint32_t threads = 1);
// KVGC_EUNSUPPORTED when built without CUDA; KVGC_EDEVICE when no device answers.
Status make_cuda_backend(int ordinal, std::unique_ptr<Backend>* out);
// Resolves KVGC_DEVICE_AUTO: CUDA when a device answers, else CPU; *why says which
// and why (printed under KVGC_VERBOSE=1). cpu_threads applies to the CPU backend only.
Status make_backend(kvgc_device want, int ordinal, uint32_t cpu_threads,
                    std::unique_ptr<Backend>* out, std::string* why);

}  // namespace kvgc
