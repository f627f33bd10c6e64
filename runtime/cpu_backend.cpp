// CPU backend: the arena is aligned host memory; ops run inline on the calling thread,
// except attention with cpu_threads > 1, which also uses the heap's worker pool.
#include <sys/mman.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <fstream>

#include "../kernels/cpu/attend.hpp"
#include "../kernels/cpu/copy.hpp"
#include "../kernels/cpu/gc.hpp"
#include "../kernels/cpu/thread_pool.hpp"
#include "backend.hpp"

namespace kvgc {
namespace {

constexpr size_t kArenaAlign = 2u << 20;  // slab-aligned: lets the OS back it with huge pages

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(uint32_t threads) : threads_(threads) {}
  kvgc_device kind() const override { return KVGC_DEVICE_CPU; }
  std::string describe() const override { return "cpu"; }

  Status free_memory(uint64_t* bytes) override {
    // MemAvailable is what the kernel can hand out without swapping.
    std::ifstream f("/proc/meminfo");
    std::string key;
    uint64_t kib;
    std::string unit;
    while (f >> key >> kib) {
      std::getline(f, unit);
      if (key == "MemAvailable:") {
        *bytes = kib * 1024;
        return Status::Ok();
      }
    }
    const long pages = sysconf(_SC_AVPHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    if (pages <= 0 || page <= 0) return fail(KVGC_EDEVICE, "cannot read available host memory");
    *bytes = uint64_t(pages) * uint64_t(page);
    return Status::Ok();
  }

  Status reserve(size_t bytes, void** base) override {
    void* p = nullptr;
    if (host::fault_point())
      return fail(KVGC_ENOMEM, "cannot reserve a host arena of " + std::to_string(bytes) +
                                   " bytes (injected fault)");
    if (posix_memalign(&p, kArenaAlign, bytes) != 0 || !p)
      return fail(KVGC_ENOMEM, "cannot reserve a host arena of " + std::to_string(bytes) + " bytes");
#if defined(MADV_HUGEPAGE)
    // Attention walks each page's K and V blocks, a few KiB each, scattered over the
    // arena: with 4 KiB pages nearly every block is a TLB miss (and the hardware
    // prefetchers stop at 4 KiB boundaries). Where THP is "madvise" (Debian's default)
    // only this asks for 2 MiB pages; a refusal is harmless.
    madvise(p, bytes, MADV_HUGEPAGE);
#endif
    *base = p;
    return Status::Ok();
  }
  void release(void* base) override { std::free(base); }

  Status copy(void* dst, const void* src, size_t bytes, CopyKind, void*) override {
    if (bytes) std::memmove(dst, src, bytes);
    return Status::Ok();
  }
  Status fill(void* dst, int byte, size_t bytes, void*) override {
    if (bytes) std::memset(dst, byte, bytes);
    return Status::Ok();
  }
  Status synchronize(void*) override { return Status::Ok(); }
  Status check_pointer(const void* p, const char* what) override {
    if (!p) return fail(KVGC_EINVAL, std::string(what) + " is NULL");
    return Status::Ok();
  }
  Status append(const AppendOp& op, void*) override {
    cpu::append(op);
    return Status::Ok();
  }
  Status gather(const GatherOp& op, void*) override {
    cpu::gather(op);
    return Status::Ok();
  }
  Status observe(const ObserveOp& op, void*) override {
    cpu::observe(op);
    return Status::Ok();
  }
  Status select(const SelectOp& op, void*) override {
    cpu::select(op);
    return Status::Ok();
  }
  Status compact(const CompactOp& op, void*) override {
    cpu::compact(op);
    return Status::Ok();
  }
  Status requant(const RequantOp& op, void*) override {
    cpu::requant(op);
    return Status::Ok();
  }
  Status attend(const AttendOp& op, void*) override {
    // The pool starts with the first attention that can use it (heap calls are
    // serialised by the heap's lock). bad_alloc here is the C API's KVGC_ENOMEM, with
    // nothing changed; a refused thread only makes the pool smaller.
    if (threads_ > 1 && !pool_) pool_.reset(new cpu::ThreadPool(threads_));
    cpu::attend(op, pool_.get());
    return Status::Ok();
  }
  size_t attend_scratch_bytes(uint64_t, const kvgc_model_desc&, uint32_t) const override {
    return 0;  // host vectors, per call
  }
  size_t gc_scratch_bytes(uint64_t, const kvgc_model_desc&, uint32_t) const override {
    return 0;  // host vectors, per call
  }

 private:
  const uint32_t threads_;  // opts->cpu_threads: attention's workers, the caller included
  std::unique_ptr<cpu::ThreadPool> pool_;
};

}  // namespace

Status Backend::result_alloc(size_t bytes, void** p) {
  try {
    *p = host::allocate(bytes, 16);
  } catch (const std::bad_alloc&) {
    return fail(KVGC_ENOMEM, "out of host memory for " + std::to_string(bytes) +
                                 " bytes of GC results");
  }
  return Status::Ok();
}

void Backend::result_free(void* p, size_t bytes) {
  if (p) host::deallocate(p, bytes, 16);
}

std::unique_ptr<Backend> make_cpu_backend(uint32_t threads) {
  return std::unique_ptr<Backend>(new CpuBackend(threads));
}

Status make_backend(kvgc_device want, int ordinal, uint32_t cpu_threads,
                    std::unique_ptr<Backend>* out, std::string* why) {
  if (want == KVGC_DEVICE_CPU) {
    *out = make_cpu_backend(cpu_threads);
    *why = "cpu (requested)";
    return Status::Ok();
  }
  Status st = make_cuda_backend(ordinal, out);
  if (st.ok()) {
    *why = (*out)->describe() + (want == KVGC_DEVICE_AUTO ? " (auto: a CUDA device answered)"
                                                          : " (requested)");
    return st;
  }
  if (want == KVGC_DEVICE_CUDA) return st;
  *out = make_cpu_backend(cpu_threads);
  *why = "cpu (auto: " + std::string(st.text()) + ")";
  return Status::Ok();
}

}  // namespace kvgc
