// Host emulation of cub::DeviceRadixSort::SortPairs (tests/cuda_emu): a stable sort of
// whole keys, the same order CUB's stable radix sort gives over all key bits. Temp
// storage is sized, checked and scribbled on, and the input buffers are clobbered, as
// the real call may do.
#pragma once
#include <cuda_runtime.h>
#include <numeric>
namespace cub {
template <class T> struct DoubleBuffer {
  T* d_buffers[2];
  int selector = 0;
  DoubleBuffer(T* a, T* b) { d_buffers[0] = a; d_buffers[1] = b; }
  T* Current() { return d_buffers[selector]; }
  T* Alternate() { return d_buffers[selector ^ 1]; }
};
struct DeviceRadixSort {
  template <class K, class V, class N>
  static cudaError_t SortPairs(void* temp, size_t& bytes, DoubleBuffer<K>& k, DoubleBuffer<V>& v, N n,
                               int = 0, int = 64, cudaStream_t = nullptr) {
    const size_t need = 4096 + size_t(n) / 16;
    if (!temp) { bytes = need; return cudaSuccess; }
    if (bytes < need) return cudaErrorInvalidValue;
    std::memset(temp, 0x5c, need);
    std::vector<size_t> idx(n);
    std::iota(idx.begin(), idx.end(), 0);
    K* kc = k.Current(); V* vc = v.Current();
    std::stable_sort(idx.begin(), idx.end(), [&](size_t a, size_t b) { return kc[a] < kc[b]; });
    K* ka = k.Alternate(); V* va = v.Alternate();
    for (size_t i = 0; i < size_t(n); ++i) { ka[i] = kc[idx[i]]; va[i] = vc[idx[i]]; }
    std::memset(kc, 0x77, size_t(n) * sizeof(K));  // the input is not preserved
    k.selector ^= 1; v.selector ^= 1;
    return cudaSuccess;
  }
};
}  // namespace cub
