// The emulated CUDA backend (tests/cuda_emu/run.sh): the CUDA executor's kernels,
// rewritten into host code, over host memory that the shim's cudaMalloc tracks (so
// pointer checks still tell device from host). Every op, attention included, runs the
// CUDA kernels (kernels/cuda/*.cu, transformed): copy, observe/select/compact/requant,
// and the split-K attention (partial, combine, mass) with its warp shuffles emulated by
// the shim's fibers. Errors map to statuses as in runtime/cuda_backend.cpp.
//
// Attention varies what a GPU would fix, so that the tests reach more of the kernel:
// successive calls cycle the SM count the split heuristic sees (132 as on an H200, 1:
// a single split whose warps walk many pages, 20: in between), and every other call
// hands the kernel a scratch just big enough for one query of the longest sequence at the
// most splits (256) rather than the heap's whole scratch, so that multi-query ops and
// batches go in several passes.
#include <cuda_runtime.h>
#include <algorithm>
#include <atomic>
#include <vector>
#include "kernels/cuda/attend.cuh"
#include "kernels/cuda/copy.cuh"
#include "kernels/cuda/gc.cuh"
#include "runtime/backend.hpp"
#include "runtime/cuda_status.hpp"
namespace kvgc {
namespace {
Status cuda_fail(cudaError_t e, const std::string& what) {
  return fail(KVGC_EDEVICE, what + ": " + cudaGetErrorName(e) + ": " + cudaGetErrorString(e));
}
class EmuBackend final : public Backend {
 public:
  kvgc_device kind() const override { return KVGC_DEVICE_CUDA; }
  std::string describe() const override { return "cuda:emu"; }
  Status free_memory(uint64_t* b) override { *b = 8ull << 30; return Status::Ok(); }
  Status reserve(size_t bytes, void** base) override {
    if (cudaMalloc(base, bytes) != cudaSuccess)
      return fail(KVGC_ENOMEM, "cudaMalloc of a " + std::to_string(bytes) + "-byte arena failed: out of device memory");
    return Status::Ok();
  }
  void release(void* base) override { cudaFree(base); }
  Status copy(void* d, const void* s, size_t n, CopyKind, void*) override { if (n) std::memmove(d, s, n); return Status::Ok(); }
  Status fill(void* d, int b, size_t n, void*) override { if (n) std::memset(d, b, n); return Status::Ok(); }
  Status synchronize(void*) override { return Status::Ok(); }
  Status check_pointer(const void* p, const char* what) override {
    if (!p) return fail(KVGC_EINVAL, std::string(what) + " is NULL");
    if (!emu::is_device(p)) return fail(KVGC_EINVAL, std::string(what) + " is host memory; the heap is on cuda:emu and needs a device pointer");
    return Status::Ok();
  }
  Status append(const AppendOp& op, void* s) override { if (auto e = cuda::append(op, cudaStream_t(s))) return cuda_fail(e, "append"); return Status::Ok(); }
  Status gather(const GatherOp& op, void* s) override { if (auto e = cuda::gather(op, cudaStream_t(s))) return cuda_fail(e, "gather"); return Status::Ok(); }
  Status observe(const ObserveOp& op, void* s) override { if (auto e = cuda::observe(op, cudaStream_t(s))) return cuda_fail(e, "observe"); return Status::Ok(); }
  Status select(const SelectOp& op, void* s) override {
    uint32_t launched = 0;
    return select_batch(&op, 1, s, &launched);
  }
  Status select_batch(const SelectOp* ops, uint32_t n, void* s, uint32_t* launched) override {
    std::vector<SelectOp> tight;
    if (emu::tight_select_scratch && n > 1 && tight_calls_++ % 2) {  // several launch sets
      size_t most = 0;
      for (uint32_t i = 0; i < n; ++i) most = std::max(most, cuda::select_scratch_bytes(ops[i]));
      tight.assign(ops, ops + n);
      for (SelectOp& op : tight) op.scratch_bytes = std::min(op.scratch_bytes, most);
      ops = tight.data();
    }
    const cudaError_t e = cuda::select_batch(ops, n, stage_, cudaStream_t(s), launched);
    if (*launched < n) KVGC_TRY(select_status(e, ops[*launched]));
    if (e) return cuda_fail(e, "select");
    return Status::Ok();
  }
  Status compact(const CompactOp& op, void* s) override {
    const cudaError_t e = cuda::compact(op, compact_stage_, cudaStream_t(s));
    if (e == cudaErrorMemoryAllocation)
      return fail(KVGC_ENOMEM, "compaction: no room for its staging ring (" + std::to_string(op.n_moves) +
                                   " moves): out of device or pinned host memory");
    KVGC_TRY(compact_status(e));
    if (e) return cuda_fail(e, "compact");
    return Status::Ok();
  }
  Status requant(const RequantOp& op, void* s) override {
    const cudaError_t e = cuda::requant(op, cudaStream_t(s));
    KVGC_TRY(requant_status(e));
    if (e) return cuda_fail(e, "requant");
    return Status::Ok();
  }
  Status attend(const AttendOp& op, void* s) override {
    static std::atomic<uint32_t> calls{0};
    const uint32_t k = calls++;
    static const int kSms[] = {132, 1, 20};
    size_t bytes = op.scratch_bytes;
    if (k % 2)  // the tables and one query of the longest sequence at the most splits
      bytes = std::min(bytes, cuda::attend_min_scratch_bytes(op, 256));
    const cudaError_t e = cuda::attend(op, op.scratch, bytes, kSms[k % 3], cudaStream_t(s));
    KVGC_TRY(attend_status(e, op));
    if (e) return cuda_fail(e, "attention kernel launch");
    return Status::Ok();
  }
  size_t attend_scratch_bytes(uint64_t max_tokens, const kvgc_model_desc& m, uint32_t pt) const override {
    return cuda::attend_scratch_bytes(max_tokens, m.n_q_heads, m.head_dim, pt);
  }
  size_t gc_scratch_bytes(uint64_t max_tokens, const kvgc_model_desc&, uint32_t pt) const override {
    return cuda::gc_scratch_bytes(max_tokens, pt);
  }
 private:
  cuda::SelectStaging stage_{true};
  cuda::CompactStaging compact_stage_;
  uint64_t tight_calls_ = 0;
};
}  // namespace
Status make_cuda_backend(int, std::unique_ptr<Backend>* out) {
  *out = std::unique_ptr<Backend>(new EmuBackend());
  return Status::Ok();
}
}  // namespace kvgc
