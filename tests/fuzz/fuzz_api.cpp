// libFuzzer harness over the C API: the input is decoded into a heap (shape and options
// from its first bytes) and then a sequence of calls with arbitrary arguments: unknown
// and destroyed sequences, NULL and foreign handles, out-of-range layers and counts,
// misaligned pointers, NaN/Inf data and mass. After every call the invariant walker must
// pass; any status is acceptable, a crash or a broken invariant is not.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "../../kernels/cpu/attend_internal.hpp"  // the split minimum, lowered below
#include "kvgc.h"

namespace {

struct Input {
  const uint8_t* p;
  size_t n;
  uint8_t byte() { return n ? (--n, *p++) : 0; }
  uint32_t u32() { return byte() | uint32_t(byte()) << 8 | uint32_t(byte()) << 16 | uint32_t(byte()) << 24; }
  bool done() const { return n == 0; }
  // A buffer of `bytes`: input bytes first, then a pattern; sometimes NaN/Inf floats.
  std::vector<uint8_t> data(size_t bytes) {
    std::vector<uint8_t> b(bytes + 8);
    for (size_t i = 0; i < bytes; ++i) b[i] = n ? byte() : uint8_t(i * 37);
    return b;
  }
};

void check(kvgc_heap* h) {
  if (kvgc_heap_check(h) != KVGC_OK) {
    std::fprintf(stderr, "invariant broken: %s\n", kvgc_errmsg(h));
    std::abort();
  }
}

}  // namespace

// Fuzzed segments are short: let split-K attention (cpu_threads > 1) cut them anyway.
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  kvgc::cpu::set_split_min_slots(4);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Input in{data, size};
  kvgc_model_desc m;
  kvgc_model_desc_init(&m);
  static const uint32_t dims[] = {2, 4, 6, 8, 16, 32, 64};
  m.n_layers = 1 + in.byte() % 3;
  m.n_kv_heads = 1 + in.byte() % 3;
  m.n_q_heads = m.n_kv_heads * (1 + in.byte() % 3);
  m.head_dim = dims[in.byte() % 7];
  m.dtype = kvgc_dtype(in.byte() % 3);
  kvgc_heap_options o;
  kvgc_heap_options_init(&o);
  o.flags = KVGC_OPT_IGNORE_ENV;
  o.device = KVGC_DEVICE_CPU;
  o.budget_bytes = (64u << 10) * (1 + in.byte() % 16);
  o.slab_bytes = 64u << 10;
  o.page_tokens = 1 + in.byte() % 32;
  o.policy = kvgc_policy(in.byte() % 5);
  o.sinks = in.byte() % 6;
  o.window = in.byte() % 12;
  // Bytes keep their places (the corpus keeps its meaning): high values of the token
  // budget's byte ask for a byte budget instead, the demote byte's bit 6 for recent scores.
  const uint8_t budget = in.byte();
  o.token_budget = budget < 200 ? budget % 40 : 0;
  o.byte_budget_fraction = budget < 200 ? 0.0 : 0.1 + (budget - 200) / 100.0;
  const uint8_t demote = in.byte();
  o.demote = kvgc_demote(demote % 4);  // off, int4, int8, the ladder
  o.recent_decay = demote & 0x40 ? 0.9 : 1.0;
  o.compact_threshold = 0.05 + (in.byte() % 20) / 20.0;
  const uint8_t noise_harvest = in.byte();  // one byte for both: the corpus keeps its layout
  o.score_noise = noise_harvest % 4 == 0 ? 0.1 : 0.0;
  o.harvest = noise_harvest & 4 ? KVGC_HARVEST_IMMEDIATE : KVGC_HARVEST_DEFERRED;
  o.cpu_threads = 1 + (noise_harvest >> 3) % 3;  // split-K attention (bits 3-4: same layout)
  kvgc_heap* h = nullptr;
  if (kvgc_heap_create(&m, &o, &h) != KVGC_OK) return 0;

  const size_t eb = m.dtype == KVGC_DTYPE_F32 ? 4 : 2;
  const size_t token = size_t(m.n_kv_heads) * m.head_dim * eb;
  const size_t qrow = size_t(m.n_q_heads) * m.head_dim * eb;
  std::vector<kvgc_seq> seqs;
  kvgc_batch* batch = nullptr;
  kvgc_batch_create(h, &batch);
  uint32_t batch_rows = 0;  // the rows of the batch's last successful plan
  alignas(16) static unsigned char foreign[128];
  for (int calls = 0; calls < 64 && !in.done(); ++calls) {
    const uint8_t op = in.byte();
    // A sequence id: usually a live one, sometimes destroyed or made up.
    auto pick = [&]() -> kvgc_seq {
      const uint8_t b = in.byte();
      if (seqs.empty() || b >= 240) return kvgc_seq(b) * 977u;
      return seqs[b % seqs.size()];
    };
    const uint32_t layer = in.byte() % 8 == 7 ? in.u32() : in.byte() % m.n_layers;
    switch (op % 12) {
      case 0: {  // a new sequence, or (the tenant byte's high bit) a copy of one
        kvgc_seq s;
        const uint8_t t = in.byte();
        const kvgc_status st = t & 0x80 ? kvgc_seq_fork(h, pick(), t % 4, &s, nullptr)
                                        : kvgc_seq_create(h, t % 4, &s);
        if (st == KVGC_OK) seqs.push_back(s);
        break;
      }
      case 1: kvgc_seq_destroy(h, pick()); break;
      case 2: {
        const kvgc_seq s = pick();
        const uint32_t n = in.byte() % 48;
        auto k = in.data(n * token), v = in.data(n * token);
        const size_t off = in.byte() % 5 == 0 ? 1 : 0;  // sometimes misaligned
        kvgc_append(h, s, layer, k.data() + off, v.data(), n, nullptr);
        break;
      }
      case 3: {
        const uint64_t cap = in.byte();
        std::vector<uint8_t> k(cap * token + 8), v(k.size());
        std::vector<int32_t> pos(cap + 1);
        uint64_t n = 0;
        kvgc_read(h, pick(), layer, cap % 3 ? k.data() : nullptr, v.data(), pos.data(), cap, &n, nullptr);
        break;
      }
      case 4: {
        const kvgc_seq s = pick();
        uint64_t live = 0;
        kvgc_seq_tokens(h, s, layer % m.n_layers, &live, nullptr);
        const uint64_t n = in.byte() % 8 == 0 ? live + 1 : live;
        std::vector<float> mass(n + 1);
        for (auto& x : mass) {
          const uint8_t b = in.byte();
          x = b == 255 ? NAN : b == 254 ? INFINITY : b == 253 ? -1.f : float(b) / 64.f;
        }
        kvgc_observe(h, s, layer, mass.data(), n, nullptr);
        break;
      }
      case 5: kvgc_step(h, pick(), nullptr); break;
      case 6: {
        const kvgc_seq s = pick();
        const uint32_t n_q = in.byte() % 6;
        auto q = in.data(n_q * qrow);
        std::vector<uint8_t> out(n_q * qrow + 8);
        kvgc_attend_params p;
        kvgc_attend_params_init(&p);
        p.scale = in.byte() % 3 == 0 ? float(in.byte()) / 16.f : 0.f;
        p.flags = in.byte() % 4 == 0 ? KVGC_ATTEND_NO_SCORES : 0;
        kvgc_attend(h, s, layer, q.data(), n_q, out.data(), in.byte() % 2 ? &p : nullptr, nullptr);
        break;
      }
      case 7: {
        const uint64_t cap = in.byte();
        std::vector<float> sc(cap + 1);
        std::vector<uint8_t> gen(cap + 1);
        uint64_t n = 0;
        if (cap % 2) kvgc_read_classes(h, pick(), layer, gen.data(), cap, &n, nullptr);
        else kvgc_read_scores(h, pick(), layer, sc.data(), gen.data(), cap, &n, nullptr);
        break;
      }
      case 8: kvgc_tenant_set_limit(h, in.byte() % 4, uint64_t(in.byte()) * 4096); break;
      case 9: {
        kvgc_stats st;
        kvgc_stats_init(&st);
        kvgc_get_stats(h, &st);
        uint64_t b = 0;
        kvgc_tenant_usage(h, in.byte() % 4, &b, nullptr);
        kvgc_kv_bytes(&m, in.u32(), kvgc_storage_class(in.byte() % KVGC_CLASS_COUNT), in.byte(), &b);
        break;
      }
      case 10: {  // handles that are not heaps
        kvgc_heap* bad = in.byte() % 2 ? nullptr : reinterpret_cast<kvgc_heap*>(foreign);
        kvgc_seq s;
        kvgc_seq_create(bad, 0, &s);
        kvgc_step(bad, 1, nullptr);
        kvgc_heap_check(bad);
        break;
      }
      default: {  // the batch API (0.5), or a token count
        const uint8_t sub = in.byte();
        if (!batch || sub % 8 == 7) {
          uint64_t live = 0, len = 0;
          kvgc_seq_tokens(h, pick(), layer, &live, &len);
        } else if (sub % 8 == 0) {  // plan a few sequences (repeats and unknown ids included)
          const uint32_t n = in.byte() % 6;
          std::vector<kvgc_seq> ids(n);
          std::vector<uint32_t> n_new(n), scored(n), flags(n);
          uint32_t rows = 0, failed = 0;
          for (uint32_t i = 0; i < n; ++i) {
            ids[i] = pick();
            n_new[i] = in.byte() % 20;
            rows += n_new[i];
            scored[i] = in.byte() % 24;  // kvgc_batch_plan_ex: past n_new: every row
            flags[i] = in.byte() % 3;    // 2: an unknown bit (KVGC_EINVAL)
          }
          kvgc_batch_plan_options po;
          kvgc_batch_plan_options_init(&po);
          po.scored_rows = scored.data();
          po.seq_flags = flags.data();
          const kvgc_status planned =
              in.byte() % 2 ? kvgc_batch_plan_ex(batch, ids.data(), n_new.data(), n, &po, &failed, nullptr)
                            : kvgc_batch_plan(batch, ids.data(), n_new.data(), n, &failed, nullptr);
          if (planned == KVGC_OK) batch_rows = rows;
        } else if (sub % 8 <= 2) {  // append, then attend
          auto k = in.data(batch_rows * token), v = in.data(batch_rows * token);
          kvgc_batch_append(batch, layer, k.data(), v.data(), nullptr);
          auto q = in.data(batch_rows * qrow);
          std::vector<uint8_t> out(batch_rows * qrow + 8);
          if (sub % 8 == 2) kvgc_batch_attend(batch, layer, q.data(), out.data(), nullptr, nullptr);
        } else if (sub % 8 <= 4) {  // an engine's own attention: export, then observe
          kvgc_batch_view view;
          std::memset(&view, 0, sizeof view);
          view.struct_size = sizeof view;
          if (kvgc_batch_export(batch, layer, &view) == KVGC_OK && sub % 8 == 4) {
            std::vector<float> mass(size_t(view.n_pages) * view.page_tokens + 1);
            for (auto& x : mass) {
              const uint8_t b = in.byte();
              x = b == 255 ? NAN : b == 254 ? INFINITY : float(b) / 64.f;
            }
            kvgc_batch_observe(batch, layer, mass.data(), nullptr);
          }
        } else if (sub % 8 == 5) {
          kvgc_batch_step(batch, nullptr);
        } else {  // a second batch's plan makes the first stale; destroy and recreate
          kvgc_batch_destroy(batch);
          batch = nullptr;
          kvgc_batch_create(h, &batch);
        }
        break;
      }
    }
    check(h);
  }
  kvgc_batch_destroy(batch);
  check(h);
  kvgc_heap_destroy(h);
  return 0;
}
