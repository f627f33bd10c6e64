// kvgc-demo: the page allocator at work through the public C++ header only.
//
// Serves a stream of requests with a small model's KV shape (SmolLM2-135M: 30 layers,
// 3 KV heads, head_dim 64, bf16) on the CPU backend: prefill in chunks, decode token by
// token, admit requests until the arena is full (KVGC_ENOMEM, never a crash), finish
// some, and watch their slabs return and new requests fit again. Every token's K/V is
// tagged and verified when read back. KVGC_* variables apply (try KVGC_VERBOSE=1,
// KVGC_BUDGET=16M, KVGC_PAGE_TOKENS=32).
#include <cstdio>
#include <cstring>
#include <list>
#include <random>
#include <vector>

#include "kvgc.hpp"

namespace {

constexpr uint32_t kLayers = 30, kKvHeads = 3, kHeadDim = 64, kRow = kKvHeads * kHeadDim;

// bf16 bit patterns that encode (request, position, element): reads must return them.
uint16_t tag(uint64_t seq, uint64_t pos, uint32_t i, bool v) {
  uint64_t x = (seq * 0x9e3779b97f4a7c15ull) ^ (pos << 20) ^ (uint64_t(i) << 1) ^ v;
  x ^= x >> 29;
  x *= 0xbf58476d1ce4e5b9ull;
  return uint16_t(x >> 40);
}

struct Request {
  kvgc::Sequence seq;
  uint32_t prompt, decode, done = 0;
};

void fill(std::vector<uint16_t>& k, std::vector<uint16_t>& v, uint64_t seq, uint64_t first,
          uint32_t n) {
  k.resize(size_t(n) * kRow);
  v.resize(k.size());
  for (uint32_t t = 0; t < n; ++t)
    for (uint32_t i = 0; i < kRow; ++i) {
      k[t * kRow + i] = tag(seq, first + t, i, false);
      v[t * kRow + i] = tag(seq, first + t, i, true);
    }
}

// Appends n tokens to every layer. False on KVGC_ENOMEM: the layers may then disagree
// in length, so the caller preempts the request (destroys it), as vLLM preempts a
// request that runs out of blocks.
bool append_all_layers(Request& r, uint64_t first, uint32_t n) {
  std::vector<uint16_t> k, v;
  fill(k, v, r.seq.id(), first, n);
  for (uint32_t layer = 0; layer < kLayers; ++layer) {
    try {
      r.seq.append(layer, k.data(), v.data(), n);
    } catch (const kvgc::Error& e) {
      if (e.status() != KVGC_ENOMEM) throw;
      return false;
    }
  }
  return true;
}

bool verify(Request& r) {
  const uint64_t n = r.seq.live(kLayers - 1);
  std::vector<uint16_t> k(n * kRow), v(n * kRow), ek, ev;
  std::vector<int32_t> pos(n);
  r.seq.read(kLayers - 1, k.data(), v.data(), pos.data(), n);
  fill(ek, ev, r.seq.id(), 0, uint32_t(n));
  return k == ek && v == ev;
}

void print_stats(const char* when, const kvgc::Heap& heap) {
  const kvgc_stats s = heap.stats();
  const kvgc_class_stats& c = s.cls[KVGC_CLASS_FP16];
  std::printf("  %-24s %3llu seqs %6llu tokens/layer  %5llu pages  %3llu/%3llu slabs used  "
              "%6.1f MiB used  %6.1f MiB free\n",
              when, (unsigned long long)s.sequences, (unsigned long long)(s.live_tokens / kLayers),
              (unsigned long long)c.pages_used,
              (unsigned long long)(s.slabs_total - s.slabs_free),
              (unsigned long long)s.slabs_total, double(c.used_bytes) / (1 << 20),
              double(s.free_bytes) / (1 << 20));
}

}  // namespace

int main() {
  try {
    const kvgc_model_desc model = kvgc::model_desc(kLayers, 9, kKvHeads, kHeadDim, KVGC_DTYPE_BF16);
    kvgc_heap_options opts = kvgc::default_options();
    opts.device = KVGC_DEVICE_CPU;
    opts.budget_bytes = 48ull << 20;  // KVGC_BUDGET overrides
    kvgc::Heap heap(model, opts);
    const kvgc_heap_options eff = heap.options();
    uint64_t per_token = 0;
    kvgc::check(kvgc_kv_bytes(&model, 1, KVGC_CLASS_FP16, 0, &per_token));
    const kvgc_stats s0 = heap.stats();
    std::printf("kvgc-demo (kvgc %s): SmolLM2-135M KV shape, %llu bytes/token raw; arena %.1f "
                "MiB in %llu slabs of %llu KiB; %u tokens/page, %llu-byte pages\n\n",
                kvgc_version(), (unsigned long long)per_token,
                double(s0.arena_bytes) / (1 << 20), (unsigned long long)s0.slabs_total,
                (unsigned long long)(s0.slab_bytes >> 10), eff.page_tokens,
                (unsigned long long)s0.cls[0].page_bytes);

    std::mt19937 rng(7);
    std::list<Request> active;
    auto admit = [&](uint32_t prompt, uint32_t decode) {
      active.push_back(Request{kvgc::Sequence(heap, uint32_t(active.size() % 2)), prompt, decode});
      Request& r = active.back();
      for (uint32_t at = 0; at < prompt; at += 128)  // prefill in chunks of 128
        if (!append_all_layers(r, at, std::min(128u, prompt - at))) {
          std::printf("  admit %4u-token prompt: KVGC_ENOMEM after %u tokens (%s)\n", prompt,
                      at, "arena full: the engine would queue or evict");
          active.pop_back();  // the sequence frees what it had
          return false;
        }
      return true;
    };

    std::printf("1. admit requests (prefill) until the arena says no\n");
    int admitted = 0;
    while (admit(200 + rng() % 900, 32 + rng() % 64)) ++admitted;
    std::printf("  %d requests admitted\n", admitted);
    print_stats("after prefill:", heap);

    std::printf("2. decode: one token per request per step, across all layers\n");
    int steps = 0, preempted = 0;
    for (bool any = true; any; ++steps) {
      any = false;
      for (auto it = active.begin(); it != active.end();) {
        if (it->done < it->decode) {
          if (!append_all_layers(*it, it->prompt + it->done, 1)) {
            ++preempted;  // KVGC_ENOMEM: give its memory to the others
            it = active.erase(it);
            continue;
          }
          ++it->done;
          any = true;
        }
        ++it;
      }
    }
    std::printf("  %d steps; %d requests preempted on KVGC_ENOMEM\n", steps, preempted);
    print_stats("after decode:", heap);

    std::printf("3. verify every request's tagged K/V, then finish the first half\n");
    int ok = 0;
    const int verified = int(active.size());
    for (Request& r : active) ok += verify(r);
    std::printf("  %d/%zu requests read back intact\n", ok, active.size());
    const size_t finish = active.size() / 2;
    for (size_t i = 0; i < finish; ++i) active.pop_front();
    print_stats("after finishing half:", heap);

    std::printf("4. admit again into the returned slabs\n");
    int again = 0;
    while (again < 64 && admit(200 + rng() % 900, 0)) ++again;
    std::printf("  %d more requests admitted\n", again);
    print_stats("final:", heap);
    heap.check_invariants();
    const kvgc_stats s = heap.stats();
    std::printf("\nheap_check: OK; pages allocated %llu, freed %llu; slabs acquired %llu, "
                "released %llu; ENOMEM refusals %llu\n",
                (unsigned long long)s.pages_allocated, (unsigned long long)s.pages_freed,
                (unsigned long long)s.slabs_acquired, (unsigned long long)s.slabs_released,
                (unsigned long long)s.enomem);
    return ok == verified ? 0 : 1;
  } catch (const kvgc::Error& e) {
    std::fprintf(stderr, "kvgc-demo: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {  // out of memory in the demo itself: a message, not an abort
    std::fprintf(stderr, "kvgc-demo: %s\n", e.what());
    return 1;
  }
}
