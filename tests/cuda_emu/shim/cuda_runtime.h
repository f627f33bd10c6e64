// Host emulation of the bits of the CUDA runtime kvgc's kernels and tests use.
//
// Blocks run one after another; a block's threads are fibers (a few lines of x86-64
// assembly switch stacks; ucontext elsewhere) that run until they wait at a barrier:
//   - __syncthreads: a block barrier over the block's threads that have not exited (as
//     on Volta and later, exited threads do not hold a barrier up);
//   - warp operations (__shfl*_sync, __syncwarp, __ballot/__any/__all_sync): a barrier
//     over the warp's 32 lanes (lane = linear thread index % 32). Every lane deposits its
//     value in the warp's exchange buffer (two buffers, alternating per operation, so a
//     fast lane cannot overwrite a value a slow one has yet to read), waits for the
//     warp, then reads its source lane's value. All lanes of the warp must be at the
//     same kind of operation; masks must name every lane of the warp (partial masks,
//     i.e. divergent warps, are not emulated: the emulation stops with a message);
//     reading from a lane that has exited stops it too (undefined on the GPU).
// The scheduler sweeps a block's threads in ascending order on even blocks and in
// descending order on odd ones, so that a missing barrier shows up as a stale read in
// one order or the other. A block whose threads all wait but cannot go on (a barrier
// some threads never reach) stops the emulation with a deadlock report.
// __shared__ is static storage, poisoned at the start of every block (transform.py). Launch
// configurations are checked against CUDA's limits (an invalid one sets the error that
// cudaGetLastError returns). Device memory is host memory.
#pragma once
#include <ucontext.h>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <type_traits>
#include <vector>
#include <algorithm>
#include <limits>

// Tests that read the emulation's counters (emu::launches) test for this.
#define KVGC_CUDA_EMU 1
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __grid_constant__
#define __shared__ static
#define __launch_bounds__(...)

using std::isfinite;
using std::isnan;
using std::isinf;

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};
struct uint4 { unsigned x, y, z, w; };
struct uint2 { unsigned x, y; };
struct alignas(16) float4 { float x, y, z, w; };
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }

inline dim3 threadIdx, blockIdx, blockDim, gridDim;
constexpr int warpSize = 32;

typedef enum cudaError { cudaSuccess = 0, cudaErrorInvalidValue = 1, cudaErrorMemoryAllocation = 2,
  cudaErrorInvalidConfiguration = 9, cudaErrorNotSupported = 801, cudaErrorInvalidDevice = 101 } cudaError_t;
typedef struct CUstream_st* cudaStream_t;
enum cudaMemcpyKind { cudaMemcpyHostToHost, cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost, cudaMemcpyDeviceToDevice };
inline const char* cudaGetErrorString(cudaError_t e) { return e == cudaSuccess ? "no error" : "emulated error"; }
inline const char* cudaGetErrorName(cudaError_t e) {
  return e == cudaErrorInvalidConfiguration ? "cudaErrorInvalidConfiguration" : "cudaErrorEmu";
}

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
inline cudaError_t last_error = cudaSuccess;  // what cudaGetLastError returns (and clears)

[[noreturn]] inline void fatal(const char* what) {
  std::fprintf(stderr, "cuda-emu: %s (block %u,%u,%u of %u,%u,%u; thread %u,%u,%u of %u,%u,%u)\n", what,
               blockIdx.x, blockIdx.y, blockIdx.z, gridDim.x, gridDim.y, gridDim.z, threadIdx.x,
               threadIdx.y, threadIdx.z, blockDim.x, blockDim.y, blockDim.z);
  std::abort();
}

// ---- fibers ---------------------------------------------------------------------------
#if defined(__x86_64__) && !defined(KVGC_EMU_UCONTEXT)  // -DKVGC_EMU_UCONTEXT: swapcontext instead
// kvgc_emu_switch(save, to): saves the callee-saved registers, MXCSR and the x87 control
// word on the current stack, stores the stack pointer in *save and resumes the stack
// `to` (weak: every file that includes the shim defines it). No signal mask, no system
// call: ucontext's swapcontext made a rt_sigprocmask call per switch.
extern "C" void kvgc_emu_switch(void** save, void* to);
asm(R"(
  .pushsection .text
  .weak kvgc_emu_switch
  .type kvgc_emu_switch, @function
kvgc_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size kvgc_emu_switch, .-kvgc_emu_switch
  .popsection
)");
struct Ctx { void* sp = nullptr; };
inline void ctx_switch(Ctx& save, Ctx& to) { kvgc_emu_switch(&save.sp, to.sp); }
inline void ctx_make(Ctx& c, char* stack, size_t size, void (*fn)()) {
  auto* top = reinterpret_cast<uint64_t*>((uintptr_t(stack) + size) & ~uintptr_t(15));
  top[-1] = 0;                      // fn's return address: it never returns
  top[-2] = uint64_t(uintptr_t(fn));  // where kvgc_emu_switch's ret goes
  for (int i = 3; i <= 8; ++i) top[-i] = 0;  // rbp rbx r12 r13 r14 r15
  top[-9] = 0x1f80u | (uint64_t(0x037fu) << 32);  // MXCSR, x87 control word: defaults
  c.sp = &top[-9];
}
#else
struct Ctx { ucontext_t uc; };
inline void ctx_switch(Ctx& save, Ctx& to) { swapcontext(&save.uc, &to.uc); }
inline void ctx_make(Ctx& c, char* stack, size_t size, void (*fn)()) {
  getcontext(&c.uc);
  c.uc.uc_stack.ss_sp = stack;
  c.uc.uc_stack.ss_size = size;
  c.uc.uc_link = nullptr;
  makecontext(&c.uc, fn, 0);
}
#endif

enum : uint8_t { kReady, kWaitBlock, kWaitWarp, kDone };
enum WarpOp : int { kNone, kShflXor, kShflIdx, kShflUp, kShflDown, kSyncWarp, kVote };
inline const char* op_name(int k) {
  static const char* n[] = {"none", "__shfl_xor_sync", "__shfl_sync", "__shfl_up_sync",
                            "__shfl_down_sync", "__syncwarp", "__ballot/__any/__all_sync"};
  return n[k];
}
struct Fiber { Ctx ctx; std::unique_ptr<char[]> stack; uint8_t state = kDone, phase = 0; };
struct Warp {
  unsigned exists = 0, live = 0;  // lane masks: lanes of the block, lanes not exited
  unsigned arrived = 0;
  int op = kNone;
  struct Round { uint64_t v[32]; unsigned deposited; } round[2];  // alternate operations
};
inline Ctx sched;
inline std::vector<Fiber> pool;
inline std::vector<Warp> warps;
inline unsigned cur = 0, alive = 0, block_arrived = 0;
inline std::function<void()>* body = nullptr;
inline uint64_t launches = 0, blocks = 0;
// Set by tests: every other select_batch of more than one segment gets a scratch just
// big enough for its largest segment, so that the batch runs in several launch sets.
inline bool tight_select_scratch = false;
inline uint64_t select_sets = 0;  // launch sets select_batch ran (kernels/cuda/gc_select.cu)

// __shared__ variables (transform.py): 0xff bytes (NaN floats, all-ones integers, true
// bools) once per block, by the first thread that reaches the declaration.
inline std::map<const void*, uint64_t>& poisoned() { static std::map<const void*, uint64_t> m; return m; }
template <class T> void shared_poison(T& x) {
  auto [it, fresh] = poisoned().try_emplace(&x, blocks);
  if (!fresh && it->second == blocks) return;
  it->second = blocks;
  std::memset(static_cast<void*>(&x), std::is_same_v<std::remove_all_extents_t<T>, bool> ? 0x01 : 0xff, sizeof x);
}

inline void set_thread_idx(unsigned i) {
  threadIdx = dim3(i % blockDim.x, (i / blockDim.x) % blockDim.y, i / (blockDim.x * blockDim.y));
}
inline void wait(uint8_t st) {
  Fiber& f = pool[cur];
  f.state = st;
  ctx_switch(f.ctx, sched);
}
inline void release_block() {
  for (Fiber& f : pool)
    if (f.state == kWaitBlock) f.state = kReady;
  block_arrived = 0;
}
inline void release_warp(unsigned w) {
  Warp& W = warps[w];
  for (unsigned l = 0; l < 32; ++l)
    if (W.exists >> l & 1u && pool[w * 32 + l].state == kWaitWarp) pool[w * 32 + l].state = kReady;
  W.arrived = 0;
  W.op = kNone;
}
inline void finish() {
  Fiber& f = pool[cur];
  f.state = kDone;
  --alive;
  Warp& W = warps[cur / 32];
  W.live &= ~(1u << (cur % 32));
  if (block_arrived && block_arrived == alive) release_block();
  if (W.arrived && W.arrived == unsigned(std::popcount(W.live))) release_warp(cur / 32);
}
inline void fiber_main() {
  (*body)();
  finish();
  ctx_switch(pool[cur].ctx, sched);
  std::abort();  // a finished fiber is never resumed
}

// A warp barrier that exchanges one 64-bit value per lane; returns the warp's deposits.
inline const Warp::Round* warp_exchange(int op, unsigned mask, uint64_t deposit) {
  const unsigned w = cur / 32, lane = cur % 32;
  Warp& W = warps[w];
  Fiber& f = pool[cur];
  if ((mask & W.exists) != W.exists || !(mask >> lane & 1u)) {
    char m[160];
    std::snprintf(m, sizeof m, "%s with mask %#x: partial-warp masks are not emulated", op_name(op), mask);
    fatal(m);
  }
  if (W.arrived == 0) W.op = op;
  else if (W.op != op) {
    char m[160];
    std::snprintf(m, sizeof m, "lane %u is at %s while other lanes of its warp are at %s", lane,
                  op_name(op), op_name(W.op));
    fatal(m);
  }
  Warp::Round& r = W.round[f.phase];
  f.phase ^= 1;
  if (W.arrived == 0) r.deposited = 0;
  r.v[lane] = deposit;
  r.deposited |= 1u << lane;
  if (++W.arrived == unsigned(std::popcount(W.live))) release_warp(w);
  else wait(kWaitWarp);
  return &r;
}
inline unsigned lane_id() { return cur % 32; }
// The value lane `src` deposited (src within the warp).
template <class T> T lane_value(const Warp::Round* r, unsigned src, int op) {
  const Warp& W = warps[cur / 32];
  if (!(r->deposited >> src & 1u)) {
    char m[160];
    std::snprintf(m, sizeof m, "%s reads lane %u, which %s", op_name(op), src,
                  W.exists >> src & 1u ? "has exited (undefined value)" : "does not exist in this block");
    fatal(m);
  }
  T v;
  std::memcpy(&v, &r->v[src], sizeof(T));
  return v;
}
template <class T> uint64_t bits_of(T v) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>, "shuffles move up to 8 bytes");
  uint64_t b = 0;
  std::memcpy(&b, &v, sizeof(T));
  return b;
}
inline void check_width(int width) {
  if (width < 1 || width > 32 || (width & (width - 1))) fatal("shuffle width must be a power of 2 <= 32");
}

inline bool deadlocked_report() {
  std::fprintf(stderr, "cuda-emu: deadlock in block %u,%u,%u: %u threads alive, %u at __syncthreads\n",
               blockIdx.x, blockIdx.y, blockIdx.z, alive, block_arrived);
  for (size_t w = 0; w < warps.size(); ++w)
    if (warps[w].arrived)
      std::fprintf(stderr, "  warp %zu: %u of %d live lanes at %s\n", w, warps[w].arrived,
                   std::popcount(warps[w].live), op_name(warps[w].op));
  return true;
}

template <class F>
void launch(dim3 grid, dim3 block, F&& f) {
  ++launches;
  // CUDA's limits (compute capability 9.0): an invalid configuration launches nothing.
  const uint64_t n64 = uint64_t(block.x) * block.y * block.z;
  if (!grid.x || !grid.y || !grid.z || !n64 || n64 > 1024 || block.x > 1024 || block.y > 1024 ||
      block.z > 64 || grid.x > 0x7fffffffu || grid.y > 65535 || grid.z > 65535) {
    last_error = cudaErrorInvalidConfiguration;
    return;
  }
  std::function<void()> fn = f;
  body = &fn;
  gridDim = grid;
  blockDim = block;
  const unsigned n = unsigned(n64), nw = (n + 31) / 32;
  if (pool.size() < n) pool.resize(n);
  warps.assign(nw, Warp{});
  constexpr size_t kStack = 512 << 10;
  uint64_t b = 0;
  for (unsigned bz = 0; bz < grid.z; ++bz)
    for (unsigned by = 0; by < grid.y; ++by)
      for (unsigned bx = 0; bx < grid.x; ++bx, ++b) {
        blockIdx = dim3(bx, by, bz);
        ++blocks;
        for (unsigned i = 0; i < n; ++i) {
          Fiber& fb = pool[i];
          if (!fb.stack) fb.stack.reset(new char[kStack]);
          ctx_make(fb.ctx, fb.stack.get(), kStack, fiber_main);
          fb.state = kReady;
          fb.phase = 0;
        }
        for (unsigned w = 0; w < nw; ++w) {
          const unsigned lanes = std::min(32u, n - 32 * w);
          warps[w].exists = warps[w].live = lanes == 32 ? ~0u : (1u << lanes) - 1;
          warps[w].arrived = 0;
          warps[w].op = kNone;
        }
        alive = n;
        block_arrived = 0;
        const bool down = (b + launches) & 1;
        while (alive) {
          bool ran = false;
          for (unsigned k = 0; k < n; ++k) {
            const unsigned i = down ? n - 1 - k : k;
            if (pool[i].state != kReady) continue;
            ran = true;
            cur = i;
            set_thread_idx(i);
            ctx_switch(sched, pool[i].ctx);
          }
          if (!ran && deadlocked_report()) std::abort();
        }
      }
  body = nullptr;
}
}  // namespace emu

inline cudaError_t cudaGetLastError() { const cudaError_t e = emu::last_error; emu::last_error = cudaSuccess; return e; }
inline cudaError_t cudaPeekAtLastError() { return emu::last_error; }

inline void __syncthreads() {
  if (++emu::block_arrived == emu::alive) emu::release_block();
  else emu::wait(emu::kWaitBlock);
}
inline void __syncwarp(unsigned mask = 0xffffffffu) { emu::warp_exchange(emu::kSyncWarp, mask, 0); }
template <class T> T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = 32) {
  emu::check_width(width);
  const emu::Warp::Round* b = emu::warp_exchange(emu::kShflXor, mask, emu::bits_of(var));
  const unsigned lane = emu::lane_id(), src = lane ^ unsigned(lane_mask & 31);
  // a later group of `width` lanes is out of reach: the caller's own value
  if ((src & ~unsigned(width - 1)) > (lane & ~unsigned(width - 1))) return var;
  return emu::lane_value<T>(b, src, emu::kShflXor);
}
template <class T> T __shfl_sync(unsigned mask, T var, int src_lane, int width = 32) {
  emu::check_width(width);
  const emu::Warp::Round* b = emu::warp_exchange(emu::kShflIdx, mask, emu::bits_of(var));
  const unsigned lane = emu::lane_id();
  return emu::lane_value<T>(b, (lane & ~unsigned(width - 1)) + (unsigned(src_lane) & unsigned(width - 1)), emu::kShflIdx);
}
template <class T> T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = 32) {
  emu::check_width(width);
  const emu::Warp::Round* b = emu::warp_exchange(emu::kShflUp, mask, emu::bits_of(var));
  const unsigned lane = emu::lane_id();
  if ((lane & unsigned(width - 1)) < delta) return var;
  return emu::lane_value<T>(b, lane - delta, emu::kShflUp);
}
template <class T> T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = 32) {
  emu::check_width(width);
  const emu::Warp::Round* b = emu::warp_exchange(emu::kShflDown, mask, emu::bits_of(var));
  const unsigned lane = emu::lane_id();
  if ((lane & unsigned(width - 1)) + delta >= unsigned(width)) return var;
  return emu::lane_value<T>(b, lane + delta, emu::kShflDown);
}
inline unsigned __ballot_sync(unsigned mask, int pred) {  // over the lanes that took part
  const emu::Warp::Round* r = emu::warp_exchange(emu::kVote, mask, pred != 0);
  unsigned b = 0;
  for (unsigned l = 0; l < 32; ++l)
    if ((mask & r->deposited) >> l & 1u && r->v[l]) b |= 1u << l;
  return b;
}
inline int __any_sync(unsigned mask, int pred) { return __ballot_sync(mask, pred) != 0; }
inline int __all_sync(unsigned mask, int pred) {
  const emu::Warp::Round* r = emu::warp_exchange(emu::kVote, mask, pred != 0);
  for (unsigned l = 0; l < 32; ++l)
    if ((mask & r->deposited) >> l & 1u && !r->v[l]) return 0;
  return 1;
}
inline unsigned __activemask() { return emu::warps[emu::cur / 32].live; }

// Math intrinsics. The host's libm is correctly rounded (or nearly) where CUDA's fast
// intrinsics are approximations (__expf: ex2.approx of x * log2(e), about 2 ulp plus the
// product's rounding; __fdividef: x * rcp.approx(y)); the emulation follows their
// structure but not their exact bits. expf/fmaxf etc. are the host's.
inline float __expf(float x) { return std::exp2(x * 1.4426950408889634f); }
inline float __exp10f(float x) { return std::exp2(x * 3.3219280948873622f); }
inline float __logf(float x) { return std::log2(x) * 0.6931471805599453f; }
inline float __log2f(float x) { return std::log2(x); }
inline float __powf(float x, float y) { return std::exp2(y * std::log2(x)); }
inline float __fdividef(float x, float y) {
  const float a = std::fabs(y);
  if (a > 8.507059173e37f && std::isfinite(a)) return std::isinf(x) ? NAN : 0.f * x;  // 2^126 < |y| < 2^128
  return x * (1.f / y);
}
inline float __frcp_rn(float x) { return 1.f / x; }
inline float __fsqrt_rn(float x) { return std::sqrt(x); }
inline float __saturatef(float x) { return std::isnan(x) ? 0.f : std::clamp(x, 0.f, 1.f); }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline float rsqrtf(float x) { return 1.f / std::sqrt(x); }

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
// Pinned host memory: plain host memory here (not device memory for the copy checks).
template <class T> cudaError_t cudaMallocHost(T** p, size_t n) {
  *p = static_cast<T*>(std::aligned_alloc(256, (n + 255) / 256 * 256));
  return *p ? cudaSuccess : cudaErrorMemoryAllocation;
}
inline cudaError_t cudaFreeHost(void* p) { std::free(p); return cudaSuccess; }
namespace emu {
// The device side of a copy or fill must lie in one device allocation: on a GPU a host
// pointer there is an illegal address.
inline void check_device(const void* p, size_t n, const char* call, const char* side) {
  if (!n) return;
  auto& m = allocs();
  auto it = m.upper_bound(uintptr_t(p));
  if (it != m.begin() && (--it, uintptr_t(p) - it->first <= it->second && n <= it->second - (uintptr_t(p) - it->first)))
    return;
  std::fprintf(stderr, "cuda-emu: %s: the %s (%p, %zu bytes) is not device memory\n", call, side, p, n);
  std::abort();
}
inline void check_copy(void* d, const void* s, size_t n, cudaMemcpyKind k, const char* call) {
  if (k == cudaMemcpyHostToDevice || k == cudaMemcpyDeviceToDevice) check_device(d, n, call, "destination");
  if (k == cudaMemcpyDeviceToHost || k == cudaMemcpyDeviceToDevice) check_device(s, n, call, "source");
}
}  // namespace emu
inline cudaError_t cudaMemcpy(void* d, const void* s, size_t n, cudaMemcpyKind k) {
  emu::check_copy(d, s, n, k, "cudaMemcpy");
  std::memmove(d, s, n);
  return cudaSuccess;
}
inline cudaError_t cudaMemcpyAsync(void* d, const void* s, size_t n, cudaMemcpyKind k, cudaStream_t = nullptr) {
  emu::check_copy(d, s, n, k, "cudaMemcpyAsync");
  std::memmove(d, s, n);
  return cudaSuccess;
}
inline cudaError_t cudaMemsetAsync(void* d, int b, size_t n, cudaStream_t = nullptr) {
  emu::check_device(d, n, "cudaMemsetAsync", "destination");
  std::memset(d, b, n);
  return cudaSuccess;
}
inline cudaError_t cudaMemset(void* d, int b, size_t n) { return cudaMemsetAsync(d, b, n); }
inline cudaError_t cudaStreamCreate(cudaStream_t* s) { *s = reinterpret_cast<cudaStream_t>(0x1234); return cudaSuccess; }
inline cudaError_t cudaStreamDestroy(cudaStream_t) { return cudaSuccess; }
inline cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }
inline cudaError_t cudaDeviceSynchronize() { return cudaSuccess; }
inline cudaError_t cudaGetDeviceCount(int* n) { *n = 1; return cudaSuccess; }
// for the benchmarks
// A host function on a stream: run at once, as every emulated launch is.
typedef void (*cudaHostFn_t)(void*);
inline cudaError_t cudaLaunchHostFunc(cudaStream_t, cudaHostFn_t fn, void* data) { fn(data); return cudaSuccess; }
typedef struct CUevent_st* cudaEvent_t;
inline cudaError_t cudaEventCreate(cudaEvent_t* e) { *e = reinterpret_cast<cudaEvent_t>(new double(0)); return cudaSuccess; }
constexpr unsigned cudaEventDisableTiming = 2;
inline cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned) { return cudaEventCreate(e); }
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
