// Self-test of the host emulation's shim (tests/cuda_emu/run.sh runs it before the
// CUDA-vs-CPU tests): warp shuffles and votes against their CUDA definitions, warp and
// block barriers, shared-memory poisoning, launch limits, the emulation's refusals
// (deadlock, lanes at different warp operations, partial masks), and the fp16/bf16
// conversions against the CPU executor's (kernels/cpu/convert.hpp), bit for bit.
// Written as CUDA and rewritten by transform.py like the kernels.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <random>
#include <vector>

#include "kernels/cpu/convert.hpp"

namespace {

int failures = 0;
#define EXPECT(c)                                                           \
  do {                                                                      \
    if (!(c)) {                                                             \
      std::fprintf(stderr, "shim_test: %s:%d: %s\n", __FILE__, __LINE__, #c); \
      ++failures;                                                           \
    }                                                                       \
  } while (0)

constexpr int kOut = 10;

__global__ void warp_ops(int* out) {
  const unsigned t = threadIdx.x, lane = t % 32;
  const int v = int(t) * 7 + int(blockIdx.x) * 1000;
  int* o = out + (blockIdx.x * blockDim.x + t) * kOut;
  o[0] = __shfl_xor_sync(0xffffffffu, v, 5);
  o[1] = __shfl_sync(0xffffffffu, v, 35);          // lane 35 % 32
  o[2] = __shfl_up_sync(0xffffffffu, v, 2, 8);
  o[3] = __shfl_down_sync(0xffffffffu, v, 3, 16);
  o[4] = __shfl_xor_sync(0xffffffffu, v, 8, 8);    // a later group of 8: own value
  float s = float(lane);
  for (int k = 16; k; k >>= 1) s += __shfl_xor_sync(0xffffffffu, s, k);
  o[5] = int(s);
  o[6] = int(__ballot_sync(0xffffffffu, lane % 3 == 0));
  o[7] = __all_sync(0xffffffffu, lane < 40) * 2 + __any_sync(0xffffffffu, lane == 31);
  __shared__ int sh[128];
  sh[t] = v;
  __syncwarp();
  o[8] = sh[t ^ 1];
  __syncthreads();
  o[9] = sh[(t + 32) % blockDim.x];
  const double d = __shfl_xor_sync(0xffffffffu, double(v) + 0.5, 1);  // 8-byte values
  if (d != double(int(t ^ 1) * 7 + int(blockIdx.x) * 1000) + 0.5) o[9] = -1;
}

// Threads that exit early do not hold a block barrier up.
__global__ void early_exit(int* out) {
  __shared__ int x;
  if (threadIdx.x >= 40) return;
  if (threadIdx.x == 0) x = 42;
  __syncthreads();
  out[threadIdx.x] = x;
}

// Block 0 writes, every block reads: blocks past the first read the poison.
__global__ void stale(float* out) {
  __shared__ float s[64];
  if (blockIdx.x == 0) s[threadIdx.x] = 1.f;
  __syncthreads();
  out[blockIdx.x * 64 + threadIdx.x] = s[threadIdx.x];
}

// A missing barrier: thread t reads what thread t + 1 writes.
__global__ void racy(float* out) {
  __shared__ float s[64];
  s[threadIdx.x] = 2.f;
  out[blockIdx.x * 64 + threadIdx.x] = s[(threadIdx.x + 1) % 64];
}

__global__ void three_d(int* out) {
  const unsigned b = (blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
  const unsigned t = (threadIdx.z * blockDim.y + threadIdx.y) * blockDim.x + threadIdx.x;
  out[b * blockDim.x * blockDim.y * blockDim.z + t] = int(b * 1000 + t);
}

__global__ void deadlock() {
  if (threadIdx.x == 0) __syncwarp();
  else __syncthreads();
}
__global__ void mismatched() {
  if (threadIdx.x == 0) (void)__shfl_xor_sync(0xffffffffu, 1, 1);
  else __syncwarp();
}
__global__ void partial_mask() { (void)__shfl_xor_sync(0xffffu, 1, 1); }
__global__ void reads_exited() {
  if (threadIdx.x % 32 == 3) return;
  (void)__shfl_xor_sync(0xffffffffu, 1, 1);
}

// Runs f in a child process and expects the emulation to stop it (SIGABRT).
template <class F> bool aborts(F f) {
  std::fflush(stderr);
  const pid_t pid = fork();
  if (pid == 0) {
    f();
    cudaDeviceSynchronize();
    _exit(0);
  }
  int st = 0;
  waitpid(pid, &st, 0);
  return WIFSIGNALED(st) && WTERMSIG(st) == SIGABRT;
}

int expected_shfl(unsigned b, unsigned t, int k) {
  const unsigned lane = t % 32, base = t - lane;
  auto val = [&](unsigned tt) { return int(tt) * 7 + int(b) * 1000; };
  switch (k) {
    case 0: return val(base + (lane ^ 5));
    case 1: return val(base + 3);
    case 2: return lane % 8 < 2 ? val(t) : val(t - 2);
    case 3: return lane % 16 + 3 >= 16 ? val(t) : val(t + 3);
    case 4: return lane % 16 < 8 ? val(t) : val(t ^ 8);
    case 5: return 496;
    case 6: { unsigned m = 0; for (unsigned l = 0; l < 32; l += 3) m |= 1u << l; return int(m); }
    case 7: return 3;
    case 8: return val(t ^ 1);
    default: return val((t + 32) % 96);
  }
}

}  // namespace

int main() {
  // Warp operations, on 3 warps x 3 blocks (both sweep orders).
  {
    const unsigned blocks = 3, threads = 96;
    int* d;
    cudaMalloc(&d, blocks * threads * kOut * sizeof(int));
    warp_ops<<<blocks, threads>>>(d);
    EXPECT(cudaGetLastError() == cudaSuccess);
    for (unsigned b = 0; b < blocks; ++b)
      for (unsigned t = 0; t < threads; ++t)
        for (int k = 0; k < kOut; ++k) {
          const int got = d[(b * threads + t) * kOut + k], want = expected_shfl(b, t, k);
          if (got != want) {
            std::fprintf(stderr, "shim_test: warp_ops block %u thread %u out[%d] = %d, want %d\n", b, t, k, got, want);
            ++failures;
          }
        }
    cudaFree(d);
  }
  {
    int* d;
    cudaMalloc(&d, 40 * sizeof(int));
    early_exit<<<2, 100>>>(d);
    for (int i = 0; i < 40; ++i) EXPECT(d[i] == 42);
    cudaFree(d);
  }
  {
    float* d;
    cudaMalloc(&d, 3 * 64 * sizeof(float));
    stale<<<3, 64>>>(d);
    for (int i = 0; i < 64; ++i) EXPECT(d[i] == 1.f && std::isnan(d[64 + i]) && std::isnan(d[128 + i]));
    racy<<<2, 64>>>(d);
    int stale_reads = 0;
    for (int i = 0; i < 128; ++i) stale_reads += std::isnan(d[i]);
    EXPECT(stale_reads >= 63);  // one of the two sweep orders reads before the write
    cudaFree(d);
  }
  {
    int* d;
    const dim3 grid(3, 2, 2), block(4, 2, 3);
    cudaMalloc(&d, 12 * 24 * sizeof(int));
    three_d<<<grid, block>>>(d);
    for (int i = 0; i < 12 * 24; ++i) EXPECT(d[i] == (i / 24) * 1000 + i % 24);
    cudaFree(d);
  }
  // Launch limits.
  three_d<<<1, 1025>>>(nullptr);
  EXPECT(cudaGetLastError() == cudaErrorInvalidConfiguration);
  EXPECT(cudaGetLastError() == cudaSuccess);
  three_d<<<0, 32>>>(nullptr);
  EXPECT(cudaGetLastError() == cudaErrorInvalidConfiguration);
  three_d<<<dim3(1, 65536), 32>>>(nullptr);
  EXPECT(cudaGetLastError() == cudaErrorInvalidConfiguration);
  // What the emulation refuses (each prints why).
  std::fprintf(stderr, "shim_test: four deliberate misuses follow; each must stop the emulation:\n");
  EXPECT(aborts([] { deadlock<<<1, 64>>>(); }));
  EXPECT(aborts([] { mismatched<<<1, 32>>>(); }));
  EXPECT(aborts([] { partial_mask<<<1, 32>>>(); }));
  EXPECT(aborts([] { reads_exited<<<1, 32>>>(); }));
  // fp16 / bf16 against the CPU executor's conversions.
  for (uint32_t h = 0; h < 65536; ++h) {
    const float a = __half2float(__ushort_as_half(uint16_t(h))), b = kvgc::cpu::f16_to_f32(uint16_t(h));
    EXPECT(std::bit_cast<uint32_t>(a) == std::bit_cast<uint32_t>(b));
    const float c = __bfloat162float(__ushort_as_bfloat16(uint16_t(h))), e = kvgc::cpu::bf16_to_f32(uint16_t(h));
    EXPECT(std::bit_cast<uint32_t>(c) == std::bit_cast<uint32_t>(e));
  }
  std::mt19937 rng(7);
  int conv_bad = 0;
  for (uint64_t i = 0; i < (1u << 22); ++i) {
    // every exponent, random mantissas; plus values next to the f16 rounding edges
    const uint32_t u = i < (1u << 21) ? uint32_t(rng()) : (uint32_t(i) * 0x1000u + uint32_t(rng() % 3) - 1u);
    const float f = std::bit_cast<float>(u);
    if (std::isnan(f)) {
      conv_bad += __half_as_ushort(__float2half_rn(f)) != 0x7fff;
      conv_bad += __bfloat16_as_ushort(__float2bfloat16_rn(f)) != 0x7fff;
      continue;
    }
    conv_bad += __half_as_ushort(__float2half_rn(f)) != kvgc::cpu::f32_to_f16(f);
    conv_bad += __bfloat16_as_ushort(__float2bfloat16_rn(f)) != kvgc::cpu::f32_to_bf16(f);
  }
  EXPECT(conv_bad == 0);
  if (failures) {
    std::fprintf(stderr, "shim_test: %d failures\n", failures);
    return 1;
  }
  std::printf("shim_test: the emulation's shim passes its self-test\n");
  return 0;
}
