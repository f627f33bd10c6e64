// kvgc-valgrind-ladder: a small workload over the storage ladder for valgrind's memcheck
// (tests/valgrind.sh runs it with --error-exitcode=1). Through kvgc.h alone, on the CPU:
// a generational heap with the ladder (FP16 > INT8 > INT4 > evicted) under a byte budget
// and the deferred harvest, and an h2o heap with INT4 demotion, the immediate harvest
// and 2 attention threads; per-sequence prefill, then decode through the batch API
// (plan, append, attend, export, observe, step), reads of K/V, scores and classes, a
// fork, a stale plan, destruction. It must demote to both classes, or it proves nothing.
// Issue 22: kvgc::cpu::select counted the live bits of fresh demotion pages before it
// cleared them (uninitialised, or a previous owner's, bytes) whenever demotion was on.
//
// Not linked with tcmalloc (memcheck follows glibc's allocator). Exit 0: the workload ran
// and its checks passed; 1: a check failed (valgrind's own findings: its exit code).
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "kvgc.h"

namespace {

int failures = 0;

#define CHECK_OK(call)                                                                   \
  do {                                                                                   \
    const kvgc_status st_ = (call);                                                      \
    if (st_ != KVGC_OK && st_ != KVGC_EBUDGET) {                                         \
      std::fprintf(stderr, "valgrind-ladder: %s: %s (%s)\n", #call, kvgc_status_str(st_), \
                   kvgc_errmsg(nullptr));                                                \
      ++failures;                                                                        \
    }                                                                                    \
  } while (0)

uint16_t to_f16(float x) {  // small normal values only (the workload's range)
  if (x == 0.f) return 0;
  uint32_t b;
  std::memcpy(&b, &x, 4);
  const uint32_t sign = (b >> 16) & 0x8000u;
  int32_t e = int32_t((b >> 23) & 0xff) - 127 + 15;
  if (e <= 0) return uint16_t(sign);
  if (e >= 31) e = 30;
  return uint16_t(sign | uint32_t(e) << 10 | ((b >> 13) & 0x3ffu));
}

struct Run {
  kvgc_model_desc m;
  kvgc_heap* h = nullptr;
  std::mt19937 rng{7};
  size_t kv_row, q_row;

  std::vector<uint16_t> rows(size_t n, size_t width) {
    std::normal_distribution<float> d(0.f, 1.f);
    std::vector<uint16_t> v(n * width + 1);
    for (uint16_t& x : v) x = to_f16(d(rng));
    return v;
  }

  void prefill(kvgc_seq s, uint32_t n) {
    for (uint32_t l = 0; l < m.n_layers; ++l) {
      const std::vector<uint16_t> k = rows(n, kv_row), v = rows(n, kv_row), q = rows(n, q_row);
      std::vector<uint16_t> out(n * q_row + 1);
      CHECK_OK(kvgc_append(h, s, l, k.data(), v.data(), n, nullptr));
      CHECK_OK(kvgc_attend(h, s, l, q.data(), n, out.data(), nullptr, nullptr));
    }
    CHECK_OK(kvgc_step(h, s, nullptr));
  }

  // Every layer's live K/V, positions, scores, generations and classes, read whole.
  void read_all(kvgc_seq s) {
    for (uint32_t l = 0; l < m.n_layers; ++l) {
      uint64_t live = 0, n = 0;
      CHECK_OK(kvgc_seq_tokens(h, s, l, &live, nullptr));
      std::vector<uint16_t> k(live * kv_row + 1), v(live * kv_row + 1);
      std::vector<int32_t> pos(live + 1);
      std::vector<float> score(live + 1);
      std::vector<uint8_t> gen(live + 1), cls(live + 1);
      CHECK_OK(kvgc_read(h, s, l, k.data(), v.data(), pos.data(), live + 1, &n, nullptr));
      CHECK_OK(kvgc_read_scores(h, s, l, score.data(), gen.data(), live + 1, &n, nullptr));
      CHECK_OK(kvgc_read_classes(h, s, l, cls.data(), live + 1, &n, nullptr));
      uint64_t sum = 0;  // makes memcheck judge every byte read back
      for (uint64_t i = 0; i < n; ++i)
        sum += k[i * kv_row] + v[i * kv_row] + uint32_t(pos[i]) + gen[i] + cls[i] +
               (std::isfinite(score[i]) ? 1 : 0);
      if (sum == 0 && n > 0) std::fprintf(stderr, "valgrind-ladder: an all-zero read\n");
    }
  }

  // Decode steps through the batch API for every sequence of `seqs`.
  void decode(kvgc_batch* b, std::vector<kvgc_seq>& seqs, int steps) {
    const uint32_t B = uint32_t(seqs.size());
    std::vector<uint32_t> n_new(B, 1);
    for (int t = 0; t < steps; ++t) {
      uint32_t failed = 0;
      CHECK_OK(kvgc_batch_plan(b, seqs.data(), n_new.data(), B, &failed, nullptr));
      for (uint32_t l = 0; l < m.n_layers; ++l) {
        const std::vector<uint16_t> k = rows(B, kv_row), v = rows(B, kv_row), q = rows(B, q_row);
        std::vector<uint16_t> out(B * q_row + 1);
        CHECK_OK(kvgc_batch_append(b, l, k.data(), v.data(), nullptr));
        if (t % 4 == 3) {  // an engine's own attention: the export, then its mass
          kvgc_batch_view view;
          std::memset(&view, 0, sizeof view);
          view.struct_size = sizeof view;
          CHECK_OK(kvgc_batch_export(b, l, &view));
          std::vector<float> mass(size_t(view.n_pages) * view.page_tokens + 1, 0.01f);
          CHECK_OK(kvgc_batch_observe(b, l, mass.data(), nullptr));
        } else {
          CHECK_OK(kvgc_batch_attend(b, l, q.data(), out.data(), nullptr, nullptr));
        }
      }
      CHECK_OK(kvgc_batch_step(b, nullptr));
    }
  }
};

void run(kvgc_policy policy, kvgc_demote demote, kvgc_harvest harvest, uint32_t threads,
         double byte_budget, uint64_t* demoted_to) {
  Run r;
  kvgc_model_desc_init(&r.m);
  r.m.n_layers = 2;
  r.m.n_kv_heads = 2;
  r.m.n_q_heads = 4;
  r.m.head_dim = 64;
  r.m.dtype = KVGC_DTYPE_F16;
  r.kv_row = size_t(r.m.n_kv_heads) * r.m.head_dim;
  r.q_row = size_t(r.m.n_q_heads) * r.m.head_dim;
  kvgc_heap_options o;
  kvgc_heap_options_init(&o);
  o.flags = KVGC_OPT_IGNORE_ENV;
  o.device = KVGC_DEVICE_CPU;
  o.budget_bytes = 8u << 20;
  o.slab_bytes = 256u << 10;
  o.policy = policy;
  o.demote = demote;
  o.harvest = harvest;
  o.byte_budget_fraction = byte_budget;
  o.sinks = 2;
  o.window = 16;
  o.page_tokens = 16;
  o.cpu_threads = threads;
  if (kvgc_heap_create(&r.m, &o, &r.h) != KVGC_OK) {
    std::fprintf(stderr, "valgrind-ladder: kvgc_heap_create: %s\n", kvgc_errmsg(nullptr));
    ++failures;
    return;
  }
  kvgc_heap* h = r.h;
  CHECK_OK(kvgc_tenant_set_limit(h, 2, 4u << 20));
  std::vector<kvgc_seq> seqs(3);
  for (size_t i = 0; i < seqs.size(); ++i) {
    CHECK_OK(kvgc_seq_create(h, uint32_t(1 + i % 2), &seqs[i]));
    r.prefill(seqs[i], 100 + 90 * uint32_t(i));
  }
  kvgc_batch* b = nullptr;
  CHECK_OK(kvgc_batch_create(h, &b));
  r.decode(b, seqs, 24);
  // A fork joins the batch; a stale plan is refused.
  kvgc_seq child = 0;
  CHECK_OK(kvgc_seq_fork(h, seqs[1], 1, &child, nullptr));
  seqs.push_back(child);
  r.decode(b, seqs, 24);
  {
    std::vector<uint32_t> n_new(seqs.size(), 1);
    uint32_t failed = 0;
    CHECK_OK(kvgc_batch_plan(b, seqs.data(), n_new.data(), uint32_t(seqs.size()), &failed, nullptr));
    const std::vector<uint16_t> k = r.rows(1, r.kv_row);
    CHECK_OK(kvgc_append(h, seqs[0], 1, k.data(), k.data(), 1, nullptr));
    if (kvgc_batch_append(b, 0, k.data(), k.data(), nullptr) != KVGC_EINVAL) {
      std::fprintf(stderr, "valgrind-ladder: a stale plan was not refused\n");
      ++failures;
    }
  }
  for (kvgc_seq s : seqs) r.read_all(s);
  CHECK_OK(kvgc_seq_destroy(h, seqs[0]));
  seqs.erase(seqs.begin());
  r.decode(b, seqs, 16);
  for (kvgc_seq s : seqs) r.read_all(s);
  if (kvgc_heap_check(h) != KVGC_OK) {
    std::fprintf(stderr, "valgrind-ladder: kvgc_heap_check: %s\n", kvgc_errmsg(h));
    ++failures;
  }
  kvgc_stats st;
  kvgc_stats_init(&st);
  CHECK_OK(kvgc_get_stats(h, &st));
  for (int c = 0; c < 3; ++c) demoted_to[c] += st.tokens_demoted_to[c];
  demoted_to[KVGC_CLASS_INT2] += st.tokens_demoted_to_int2;
  kvgc_batch_destroy(b);
  kvgc_heap_destroy(h);
}

}  // namespace

int main() {
  uint64_t demoted_to[KVGC_CLASS_COUNT] = {};
  run(KVGC_POLICY_GENERATIONAL, KVGC_DEMOTE_LADDER, KVGC_HARVEST_DEFERRED, 1, 0.5, demoted_to);
  run(KVGC_POLICY_H2O, KVGC_DEMOTE_INT4, KVGC_HARVEST_IMMEDIATE, 2, 0.25, demoted_to);
  std::printf("valgrind-ladder: demoted to int8 %llu, to int4 %llu tokens\n",
              (unsigned long long)demoted_to[KVGC_CLASS_INT8],
              (unsigned long long)demoted_to[KVGC_CLASS_INT4]);
  if (demoted_to[KVGC_CLASS_INT8] == 0 || demoted_to[KVGC_CLASS_INT4] == 0) {
    std::fprintf(stderr, "valgrind-ladder: the workload did not demote to both classes\n");
    ++failures;
  }
  return failures ? 1 : 0;
}
