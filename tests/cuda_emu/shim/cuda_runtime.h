// Host emulation of the bits of the CUDA runtime kvgc's kernels and tests use.
// Blocks run one after another; a block's threads are ucontext fibers switched at
// __syncthreads, so __shared__ (static) is per block. Device memory is host memory.
#pragma once
#include <ucontext.h>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <vector>
#include <algorithm>
#include <limits>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __grid_constant__
#define __shared__ static
#define __launch_bounds__(...)

using std::isfinite;
using std::isnan;

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};
struct uint4 { unsigned x, y, z, w; };
struct uint2 { unsigned x, y; };
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }

inline dim3 threadIdx, blockIdx, blockDim, gridDim;

typedef enum cudaError { cudaSuccess = 0, cudaErrorInvalidValue = 1, cudaErrorMemoryAllocation = 2,
  cudaErrorNotSupported = 801, cudaErrorInvalidDevice = 101 } cudaError_t;
typedef struct CUstream_st* cudaStream_t;
enum cudaMemcpyKind { cudaMemcpyHostToHost, cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost, cudaMemcpyDeviceToDevice };
inline const char* cudaGetErrorString(cudaError_t e) { return e == cudaSuccess ? "no error" : "emulated error"; }
inline const char* cudaGetErrorName(cudaError_t) { return "cudaErrorEmu"; }
inline cudaError_t cudaGetLastError() { return cudaSuccess; }

namespace emu {
// device allocations, for check_pointer
inline std::map<uintptr_t, size_t>& allocs() { static std::map<uintptr_t, size_t> m; return m; }
inline bool is_device(const void* p) {
  auto& m = allocs();
  auto it = m.upper_bound(uintptr_t(p));
  if (it == m.begin()) return false;
  --it;
  return uintptr_t(p) < it->first + it->second;
}
struct Fiber { ucontext_t ctx; std::unique_ptr<char[]> stack; bool done = false; };
inline ucontext_t sched;
inline std::vector<Fiber> pool;
inline int cur = 0;
inline std::function<void()>* body = nullptr;
inline void entry() {
  (*body)();
  pool[cur].done = true;
  swapcontext(&pool[cur].ctx, &sched);
}
inline uint64_t launches = 0;
template <class F>
void launch(dim3 grid, dim3 block, F&& f) {
  ++launches;
  std::function<void()> fn = f;
  body = &fn;
  gridDim = grid;
  blockDim = block;
  const unsigned n = block.x * block.y * block.z;
  if (pool.size() < n) pool.resize(n);
  constexpr size_t kStack = 512 << 10;
  for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
      for (unsigned bx = 0; bx < grid.x; ++bx) {
        blockIdx = dim3(bx, by, bz);
        for (unsigned i = 0; i < n; ++i) {
          Fiber& fb = pool[i];
          if (!fb.stack) fb.stack.reset(new char[kStack]);
          getcontext(&fb.ctx);
          fb.ctx.uc_stack.ss_sp = fb.stack.get();
          fb.ctx.uc_stack.ss_size = kStack;
          fb.ctx.uc_link = nullptr;
          makecontext(&fb.ctx, entry, 0);
          fb.done = false;
        }
        for (bool any = true; any;) {
          any = false;
          for (unsigned i = 0; i < n; ++i) {
            if (pool[i].done) continue;
            cur = int(i);
            threadIdx = dim3(i % block.x, (i / block.x) % block.y, i / (block.x * block.y));
            swapcontext(&sched, &pool[i].ctx);
            if (!pool[i].done) any = true;
          }
        }
      }
}
}  // namespace emu

inline void __syncthreads() { swapcontext(&emu::pool[emu::cur].ctx, &emu::sched); }
inline void __syncwarp() {}

inline int __popc(unsigned x) { return std::popcount(x); }
inline int __clz(unsigned x) { return x ? std::countl_zero(x) : 32; }
inline unsigned __float_as_uint(float f) { return std::bit_cast<unsigned>(f); }
inline float __uint_as_float(unsigned u) { return std::bit_cast<float>(u); }
inline long long __double_as_longlong(double d) { return std::bit_cast<long long>(d); }
inline double __longlong_as_double(long long x) { return std::bit_cast<double>(x); }
inline float __fmul_rn(float a, float b) { volatile float r = a * b; return r; }
inline float __fadd_rn(float a, float b) { volatile float r = a + b; return r; }
inline float __fsub_rn(float a, float b) { volatile float r = a - b; return r; }
inline float __fdiv_rn(float a, float b) { volatile float r = a / b; return r; }
inline double __dmul_rn(double a, double b) { volatile double r = a * b; return r; }
inline double __dadd_rn(double a, double b) { volatile double r = a + b; return r; }
inline double __dsub_rn(double a, double b) { volatile double r = a - b; return r; }
inline double __ddiv_rn(double a, double b) { volatile double r = a / b; return r; }
inline float rintf(float x) { return std::nearbyint(x); }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline int min(int a, int b) { return a < b ? a : b; }

template <class T> T atomicAdd(T* p, T v) { T o = *p; *p = o + v; return o; }
inline unsigned long long atomicAdd(unsigned long long* p, unsigned v) { auto o = *p; *p = o + v; return o; }
inline unsigned atomicAnd(unsigned* p, unsigned v) { unsigned o = *p; *p = o & v; return o; }
inline unsigned atomicOr(unsigned* p, unsigned v) { unsigned o = *p; *p = o | v; return o; }

inline cudaError_t cudaMalloc(void** p, size_t n) {
  if (n > (size_t(64) << 30)) return cudaErrorMemoryAllocation;
  *p = std::aligned_alloc(256, (n + 255) / 256 * 256);
  if (!*p) return cudaErrorMemoryAllocation;
  std::memset(*p, 0x6b, n);  // garbage, as fresh device memory may hold
  emu::allocs()[uintptr_t(*p)] = n;
  return cudaSuccess;
}
template <class T> cudaError_t cudaMalloc(T** p, size_t n) { return cudaMalloc(reinterpret_cast<void**>(p), n); }
inline cudaError_t cudaFree(void* p) { emu::allocs().erase(uintptr_t(p)); std::free(p); return cudaSuccess; }
inline cudaError_t cudaMemcpy(void* d, const void* s, size_t n, cudaMemcpyKind) { std::memmove(d, s, n); return cudaSuccess; }
inline cudaError_t cudaMemcpyAsync(void* d, const void* s, size_t n, cudaMemcpyKind, cudaStream_t = nullptr) { std::memmove(d, s, n); return cudaSuccess; }
inline cudaError_t cudaMemsetAsync(void* d, int b, size_t n, cudaStream_t = nullptr) { std::memset(d, b, n); return cudaSuccess; }
inline cudaError_t cudaMemset(void* d, int b, size_t n) { std::memset(d, b, n); return cudaSuccess; }
inline cudaError_t cudaStreamCreate(cudaStream_t* s) { *s = reinterpret_cast<cudaStream_t>(0x1234); return cudaSuccess; }
inline cudaError_t cudaStreamDestroy(cudaStream_t) { return cudaSuccess; }
inline cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }
inline cudaError_t cudaDeviceSynchronize() { return cudaSuccess; }
inline cudaError_t cudaGetDeviceCount(int* n) { *n = 1; return cudaSuccess; }
// for the benchmarks
typedef struct CUevent_st* cudaEvent_t;
inline cudaError_t cudaEventCreate(cudaEvent_t* e) { *e = reinterpret_cast<cudaEvent_t>(new double(0)); return cudaSuccess; }
inline cudaError_t cudaEventDestroy(cudaEvent_t e) { delete reinterpret_cast<double*>(e); return cudaSuccess; }
#include <chrono>
inline cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t = nullptr) {
  *reinterpret_cast<double*>(e) = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
  return cudaSuccess;
}
inline cudaError_t cudaEventSynchronize(cudaEvent_t) { return cudaSuccess; }
inline cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t a, cudaEvent_t b) { *ms = float(*reinterpret_cast<double*>(b) - *reinterpret_cast<double*>(a)); return cudaSuccess; }
inline cudaError_t cudaMemcpy2DAsync(void* d, size_t dp, const void* s, size_t sp, size_t w, size_t h, cudaMemcpyKind, cudaStream_t = nullptr) {
  for (size_t i = 0; i < h; ++i) std::memmove(static_cast<char*>(d) + i * dp, static_cast<const char*>(s) + i * sp, w);
  return cudaSuccess;
}
inline cudaError_t cudaMemcpy2D(void* d, size_t dp, const void* s, size_t sp, size_t w, size_t h, cudaMemcpyKind k) { return cudaMemcpy2DAsync(d, dp, s, sp, w, h, k); }
struct cudaDeviceProp { char name[256] = "emulated"; int multiProcessorCount = 1; int major = 9, minor = 0; size_t totalGlobalMem = 1ull << 34; };
inline cudaError_t cudaGetDeviceProperties(cudaDeviceProp* p, int) { *p = cudaDeviceProp{}; return cudaSuccess; }
