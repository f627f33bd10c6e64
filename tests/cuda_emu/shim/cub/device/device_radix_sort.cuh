// Host emulation of cub::DeviceRadixSort::SortPairs (tests/cuda_emu): a stable sort of
// whole keys, the same order CUB's stable radix sort gives over all key bits. Temp
// storage is sized, checked and scribbled on, and the input buffers are clobbered, as
// the real call may do.
// Also cub::DeviceSegmentedRadixSort::SortPairs (here, not in its own header: the
// kernels include it only off the emulation): each segment [begin[i], end[i]) sorted so,
// items outside every segment left unwritten in the output, as CUB leaves them.
#pragma once
#include <cuda_runtime.h>
#include <algorithm>
#include <cstring>
#include <numeric>
#include <vector>
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
struct DeviceSegmentedRadixSort {
  template <class K, class V, class B, class E>
  static cudaError_t SortPairs(void* temp, size_t& bytes, DoubleBuffer<K>& k, DoubleBuffer<V>& v, int n,
                               int segs, B begin, E end, int = 0, int = 64, cudaStream_t = nullptr) {
    const size_t need = 4096 + size_t(n) / 16 + size_t(segs) * 8;
    if (!temp) { bytes = need; return cudaSuccess; }
    if (bytes < need) return cudaErrorInvalidValue;
    std::memset(temp, 0x5c, need);
    K* kc = k.Current(); V* vc = v.Current();
    K* ka = k.Alternate(); V* va = v.Alternate();
    std::vector<size_t> idx;
    for (int s = 0; s < segs; ++s) {
      const size_t b = size_t(begin[s]), e = size_t(end[s]);
      if (e <= b) continue;
      idx.resize(e - b);
      std::iota(idx.begin(), idx.end(), b);
      std::stable_sort(idx.begin(), idx.end(), [&](size_t x, size_t y) { return kc[x] < kc[y]; });
      for (size_t i = b; i < e; ++i) { ka[i] = kc[idx[i - b]]; va[i] = vc[idx[i - b]]; }
    }
    std::memset(kc, 0x77, size_t(n) * sizeof(K));  // the input is not preserved
    k.selector ^= 1; v.selector ^= 1;
    return cudaSuccess;
  }
};
}  // namespace cub
