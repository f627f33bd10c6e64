// CUDA backend: one cudaMalloc for the arena (never managed memory; besides it only
// compaction's staging ring, a MiB or so: gc.cuh), every op enqueued on the engine's
// stream, every CUDA error turned into KVGC_EDEVICE with its message.
// Compiled only when kvgc is built with CUDA; see no_cuda_backend.cpp otherwise.
#include <cuda_runtime.h>

#include "../kernels/cuda/attend.cuh"
#include "../kernels/cuda/copy.cuh"
#include "../kernels/cuda/gc.cuh"
#include "backend.hpp"
#include "cuda_status.hpp"

namespace kvgc {
namespace {

Status cuda_fail(cudaError_t e, const std::string& what) {
  return fail(KVGC_EDEVICE, what + ": " + cudaGetErrorName(e) + ": " + cudaGetErrorString(e));
}

#define KVGC_CUDA(call, what)                                       \
  do {                                                              \
    cudaError_t e_ = (call);                                        \
    if (e_ != cudaSuccess) return cuda_fail(e_, what);              \
  } while (0)

// Makes the heap's device current for the duration of a call and restores the
// engine's own choice afterwards: kvgc must not change the calling thread's device.
class DeviceGuard {
 public:
  explicit DeviceGuard(int ordinal) {
    if (cudaGetDevice(&prev_) == cudaSuccess && prev_ != ordinal) {
      if (cudaSetDevice(ordinal) == cudaSuccess) switched_ = true;
    }
  }
  ~DeviceGuard() {
    if (switched_) cudaSetDevice(prev_);
  }

 private:
  int prev_ = -1;
  bool switched_ = false;
};

cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }

class CudaBackend final : public Backend {
 public:
  CudaBackend(int ordinal, std::string name, int n_sm)
      : ordinal_(ordinal), name_(std::move(name)), n_sm_(n_sm) {}
  ~CudaBackend() override {
    DeviceGuard g(ordinal_);
    compact_stage_.release();
  }
  kvgc_device kind() const override { return KVGC_DEVICE_CUDA; }
  std::string describe() const override { return name_; }

  Status free_memory(uint64_t* bytes) override {
    DeviceGuard g(ordinal_);
    size_t free = 0, total = 0;
    KVGC_CUDA(cudaMemGetInfo(&free, &total), "cudaMemGetInfo");
    *bytes = free;
    return Status::Ok();
  }
  Status reserve(size_t bytes, void** base) override {
    DeviceGuard g(ordinal_);
    if (host::fault_point())
      return fail(KVGC_ENOMEM, "cudaMalloc of a " + std::to_string(bytes) +
                                   "-byte arena failed (injected fault)");
    const cudaError_t e = cudaMalloc(base, bytes);
    if (e == cudaErrorMemoryAllocation) {
      cudaGetLastError();  // clear it: an allocation failure is not sticky
      return fail(KVGC_ENOMEM, "cudaMalloc of a " + std::to_string(bytes) +
                                   "-byte arena failed: out of device memory");
    }
    if (e != cudaSuccess) return cuda_fail(e, "cudaMalloc (arena)");
    return Status::Ok();
  }
  void release(void* base) override {
    DeviceGuard g(ordinal_);
    cudaFree(base);
  }
  Status copy(void* dst, const void* src, size_t bytes, CopyKind kind, void* stream) override {
    DeviceGuard g(ordinal_);
    const cudaMemcpyKind k = kind == CopyKind::HostToDevice   ? cudaMemcpyHostToDevice
                             : kind == CopyKind::DeviceToHost ? cudaMemcpyDeviceToHost
                                                              : cudaMemcpyDeviceToDevice;
    KVGC_CUDA(cudaMemcpyAsync(dst, src, bytes, k, as_stream(stream)), "cudaMemcpyAsync");
    return Status::Ok();
  }
  Status fill(void* dst, int byte, size_t bytes, void* stream) override {
    DeviceGuard g(ordinal_);
    KVGC_CUDA(cudaMemsetAsync(dst, byte, bytes, as_stream(stream)), "cudaMemsetAsync");
    return Status::Ok();
  }
  Status synchronize(void* stream) override {
    DeviceGuard g(ordinal_);
    KVGC_CUDA(cudaStreamSynchronize(as_stream(stream)), "cudaStreamSynchronize");
    return Status::Ok();
  }
  Status event_create(void** event) override {
    DeviceGuard g(ordinal_);
    cudaEvent_t e = nullptr;
    KVGC_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate");
    *event = e;
    return Status::Ok();
  }
  void event_destroy(void* event) override {
    if (event) cudaEventDestroy(static_cast<cudaEvent_t>(event));
  }
  Status event_record(void* event, void* stream) override {
    DeviceGuard g(ordinal_);
    KVGC_CUDA(cudaEventRecord(static_cast<cudaEvent_t>(event), as_stream(stream)),
              "cudaEventRecord");
    return Status::Ok();
  }
  // A kernel fault of the GC surfaces here, where its results are awaited.
  Status event_wait(void* event) override {
    KVGC_CUDA(cudaEventSynchronize(static_cast<cudaEvent_t>(event)),
              "GC results (cudaEventSynchronize)");
    return Status::Ok();
  }
  Status result_alloc(size_t bytes, void** p) override {
    DeviceGuard g(ordinal_);
    if (host::fault_point())
      return fail(KVGC_ENOMEM, "cudaHostAlloc of " + std::to_string(bytes) +
                                   " bytes failed (injected fault)");
    const cudaError_t e = cudaHostAlloc(p, bytes, cudaHostAllocPortable);
    if (e == cudaErrorMemoryAllocation) {
      cudaGetLastError();
      return fail(KVGC_ENOMEM, "cudaHostAlloc of " + std::to_string(bytes) +
                                   " bytes for GC results failed: out of pinned host memory");
    }
    KVGC_CUDA(e, "cudaHostAlloc (GC results)");
    return Status::Ok();
  }
  void result_free(void* p, size_t) override {
    if (p) cudaFreeHost(p);
  }
  Status check_pointer(const void* p, const char* what) override {
    if (!p) return fail(KVGC_EINVAL, std::string(what) + " is NULL");
    cudaPointerAttributes a{};
    if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
      cudaGetLastError();
      return fail(KVGC_EINVAL, std::string(what) + " is not a CUDA pointer");
    }
    if (a.type != cudaMemoryTypeDevice && a.type != cudaMemoryTypeManaged)
      return fail(KVGC_EINVAL, std::string(what) + " is host memory; the heap is on " + name_ +
                                   " and needs a device pointer");
    if (a.device != ordinal_)
      return fail(KVGC_EINVAL, std::string(what) + " is on CUDA device " +
                                   std::to_string(a.device) + ", the heap on " +
                                   std::to_string(ordinal_));
    return Status::Ok();
  }
  Status append(const AppendOp& op, void* stream) override {
    DeviceGuard g(ordinal_);
    KVGC_CUDA(cuda::append(op, as_stream(stream)), "append kernel launch");
    return Status::Ok();
  }
  Status gather(const GatherOp& op, void* stream) override {
    DeviceGuard g(ordinal_);
    KVGC_CUDA(cuda::gather(op, as_stream(stream)), "gather kernel launch");
    return Status::Ok();
  }
  Status observe(const ObserveOp& op, void* stream) override {
    DeviceGuard g(ordinal_);
    KVGC_CUDA(cuda::observe(op, as_stream(stream)), "observe kernel launch");
    return Status::Ok();
  }
  // Only enqueues: page_live and the result arrive in result_alloc() memory, read after
  // an event (backend.hpp).
  Status select(const SelectOp& op, void* stream) override {
    uint32_t launched = 0;
    return select_batch(&op, 1, stream, &launched);
  }
  // Every collecting segment of a step at once: a constant number of launches (gc.cuh).
  // The uploads are staged in a pinned block of the backend's, reused once the previous
  // batch's copy has run (an event).
  Status select_batch(const SelectOp* ops, uint32_t n, void* stream, uint32_t* launched) override {
    DeviceGuard g(ordinal_);
    const cudaError_t e = cuda::select_batch(ops, n, stage_, as_stream(stream), launched);
    if (*launched < n) KVGC_TRY(select_status(e, ops[*launched]));
    KVGC_CUDA(e, "GC select launch");
    return Status::Ok();
  }
  // One copy of the move list (staged in the backend's pinned ring) and one launch.
  Status compact(const CompactOp& op, void* stream) override {
    DeviceGuard g(ordinal_);
    const cudaError_t e = cuda::compact(op, compact_stage_, as_stream(stream));
    if (e == cudaErrorMemoryAllocation)
      return fail(KVGC_ENOMEM, "compaction: no room for its staging ring (" + std::to_string(op.n_moves) +
                                   " moves): out of device or pinned host memory");
    KVGC_TRY(compact_status(e));
    KVGC_CUDA(e, "compaction kernel launch");
    return Status::Ok();
  }
  Status requant(const RequantOp& op, void* stream) override {
    DeviceGuard g(ordinal_);
    const cudaError_t e = cuda::requant(op, as_stream(stream));
    KVGC_TRY(requant_status(e));
    KVGC_CUDA(e, "requant kernel launch");
    return Status::Ok();
  }
  Status attend(const AttendOp& op, void* stream) override {
    DeviceGuard g(ordinal_);
    const cudaError_t e = cuda::attend(op, op.scratch, op.scratch_bytes, n_sm_, as_stream(stream));
    KVGC_TRY(attend_status(e, op));
    KVGC_CUDA(e, "attention kernel launch");
    return Status::Ok();
  }
  size_t attend_scratch_bytes(uint64_t max_tokens, const kvgc_model_desc& m,
                              uint32_t page_tokens) const override {
    return cuda::attend_scratch_bytes(max_tokens, m.n_q_heads, m.head_dim, page_tokens);
  }
  size_t gc_scratch_bytes(uint64_t max_tokens, const kvgc_model_desc&,
                          uint32_t page_tokens) const override {
    DeviceGuard g(ordinal_);  // CUB sizes its sort for the current device
    return cuda::gc_scratch_bytes(max_tokens, page_tokens);
  }

 private:
  int ordinal_;
  std::string name_;
  int n_sm_;
  cuda::SelectStaging stage_{true};
  cuda::CompactStaging compact_stage_;  // compaction's uploads: pinned host and device rings
};

}  // namespace

Status make_cuda_backend(int ordinal, std::unique_ptr<Backend>* out) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return cuda_fail(e, "no CUDA device answered (cudaGetDeviceCount)");
  }
  if (ordinal >= n)
    return fail(KVGC_EDEVICE, "CUDA device " + std::to_string(ordinal) + " requested but " +
                                  std::to_string(n) + " present");
  cudaDeviceProp prop{};
  KVGC_CUDA(cudaGetDeviceProperties(&prop, ordinal), "cudaGetDeviceProperties");
  char name[320];
  std::snprintf(name, sizeof name, "cuda:%d %s (sm_%d%d, %.1f GiB)", ordinal, prop.name,
                prop.major, prop.minor, double(prop.totalGlobalMem) / double(1ull << 30));
  *out = std::unique_ptr<Backend>(new CudaBackend(ordinal, name, prop.multiProcessorCount));
  return Status::Ok();
}

}  // namespace kvgc
