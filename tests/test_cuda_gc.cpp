// CUDA backend vs the CPU specification, the GC: observe, select (tenure, ranking,
// eviction, int4 demotion, promotion, charge_shared's in-place demotions, page_classes),
// compaction, requant and the dequantising read, through the API (twin heaps under every
// policy) and op by op on random page images (select alone and in batches).
#include <cuda_runtime.h>
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <utility>
#include <vector>

#include "../gc/compaction.hpp"
#include "../gc/ladder.hpp"
#include "../kernels/cpu/convert.hpp"
#include "../kernels/cpu/gc.hpp"
#include "../kernels/cuda/gc.cuh"
#include "../runtime/backend.hpp"
#include "cuda_util.hpp"

using namespace kvgc_test;

namespace {

// Model-dtype values for K/V: Gaussian, with (if `specials`) rare infinities, NaN,
// signed zeros, f16 subnormals and values near the dtype's limits, which int4 demotion
// must treat as the CPU does.
std::vector<uint8_t> random_kv(const kvgc_model_desc& m, uint32_t n, std::mt19937& rng,
                               bool specials = true) {
  std::normal_distribution<float> gauss(0.f, 1.f);
  const size_t eb = elem_bytes(m), count = size_t(n) * m.n_kv_heads * m.head_dim;
  std::vector<uint8_t> out(count * eb);
  const float big = m.dtype == KVGC_DTYPE_F16 ? 60000.f : 3e38f;
  const float special[] = {INFINITY, -INFINITY, NAN, 0.f, -0.f, 3e-6f, -1e-7f, big, -big};
  for (size_t i = 0; i < count; ++i) {
    const float x = specials && rng() % 499 == 0 ? special[rng() % 9] : 3.f * gauss(rng);
    kvgc::cpu::store(&out[i * eb], m.dtype, x);
  }
  return out;
}

// Attention masses: uniform, with exact ties (a 0.25 grid), zeros of both signs,
// negatives and NaN (which ranks lowest).
std::vector<float> random_mass(uint64_t n, std::mt19937& rng) {
  std::vector<float> w(n);
  for (float& x : w) {
    const uint32_t r = rng() % 200;
    x = r < 25 ? 0.25f * float(rng() % 4) : r < 28 ? (r % 2 ? 0.f : -0.f) : r < 30 ? -0.5f
        : r == 30 ? NAN : float(rng() % 100000) / 100000.f;
  }
  return w;
}

struct Rows {
  uint64_t n = 0;
  std::vector<uint8_t> k, v, gen;
  std::vector<int32_t> pos;
  std::vector<float> score;
};

Rows read_cpu(kvgc_heap* h, kvgc_seq s, uint32_t layer, const kvgc_model_desc& m) {
  Rows r;
  REQUIRE(kvgc_read(h, s, layer, nullptr, nullptr, nullptr, 0, &r.n, nullptr) == KVGC_OK);
  const size_t tb = token_bytes(m);
  r.k.resize(r.n * tb);
  r.v.resize(r.n * tb);
  r.pos.resize(r.n);
  r.score.resize(r.n);
  r.gen.resize(r.n);
  uint64_t n = 0;
  REQUIRE(kvgc_read(h, s, layer, r.k.data(), r.v.data(), r.pos.data(), r.n, &n, nullptr) == KVGC_OK);
  REQUIRE(kvgc_read_scores(h, s, layer, r.score.data(), r.gen.data(), r.n, &n, nullptr) == KVGC_OK);
  return r;
}

// Reads into poisoned device buffers one row longer than needed; the spare row must
// still hold the poison afterwards.
Rows read_gpu(kvgc_heap* h, kvgc_seq s, uint32_t layer, const kvgc_model_desc& m, cudaStream_t st) {
  Rows r;
  REQUIRE(kvgc_read(h, s, layer, nullptr, nullptr, nullptr, 0, &r.n, st) == KVGC_OK);
  const size_t tb = token_bytes(m), rows = r.n + 1;
  DeviceBuffer k(rows * tb), v(rows * tb), pos(rows * 4), score(rows * 4), gen(rows);
  REQUIRE(cudaMemsetAsync(k.p, 0xA5, rows * tb, st) == cudaSuccess);
  REQUIRE(cudaMemsetAsync(v.p, 0x5A, rows * tb, st) == cudaSuccess);
  REQUIRE(cudaMemsetAsync(pos.p, 0xFF, rows * 4, st) == cudaSuccess);
  REQUIRE(cudaMemsetAsync(score.p, 0xEE, rows * 4, st) == cudaSuccess);
  REQUIRE(cudaMemsetAsync(gen.p, 0xCC, rows, st) == cudaSuccess);
  uint64_t n = 0;
  REQUIRE(kvgc_read(h, s, layer, k.p, v.p, pos.get<int32_t>(), rows, &n, st) == KVGC_OK);
  REQUIRE(kvgc_read_scores(h, s, layer, score.get<float>(), gen.get(), rows, &n, st) == KVGC_OK);
  REQUIRE(cudaStreamSynchronize(st) == cudaSuccess);
  std::vector<uint8_t> kb(rows * tb), vb(rows * tb), gb(rows);
  std::vector<int32_t> pb(rows);
  std::vector<float> sb(rows);
  REQUIRE(cudaMemcpy(kb.data(), k.p, rows * tb, cudaMemcpyDeviceToHost) == cudaSuccess);
  REQUIRE(cudaMemcpy(vb.data(), v.p, rows * tb, cudaMemcpyDeviceToHost) == cudaSuccess);
  REQUIRE(cudaMemcpy(pb.data(), pos.p, rows * 4, cudaMemcpyDeviceToHost) == cudaSuccess);
  REQUIRE(cudaMemcpy(sb.data(), score.p, rows * 4, cudaMemcpyDeviceToHost) == cudaSuccess);
  REQUIRE(cudaMemcpy(gb.data(), gen.p, rows, cudaMemcpyDeviceToHost) == cudaSuccess);
  for (size_t i = r.n * tb; i < rows * tb; ++i) REQUIRE((kb[i] == 0xA5 && vb[i] == 0x5A));
  CHECK(pb[r.n] == -1);
  CHECK(gb[r.n] == 0xCC);
  r.k.assign(kb.begin(), kb.begin() + r.n * tb);
  r.v.assign(vb.begin(), vb.begin() + r.n * tb);
  r.pos.assign(pb.begin(), pb.begin() + r.n);
  r.score.assign(sb.begin(), sb.begin() + r.n);
  r.gen.assign(gb.begin(), gb.begin() + r.n);
  return r;
}

bool same_float(float a, float b) {  // bitwise; any NaN matches any NaN (payloads may differ)
  return std::memcmp(&a, &b, 4) == 0 || (std::isnan(a) && std::isnan(b));
}

// Empty when the CUDA rows equal the CPU's: positions, scores, generations and fp16
// K/V bit for bit; int4 tokens (dequantised on each side) within 1e-6 relative.
std::string compare_rows(const Rows& c, const Rows& g, const kvgc_model_desc& m) {
  if (c.n != g.n) return "live " + std::to_string(c.n) + " (cpu) vs " + std::to_string(g.n);
  if (c.pos != g.pos) return "positions differ";
  if (c.gen != g.gen) return "generations differ";
  for (uint64_t i = 0; i < c.n; ++i)
    if (!same_float(c.score[i], g.score[i]))
      return "score of row " + std::to_string(i) + ": " + std::to_string(c.score[i]) + " vs " +
             std::to_string(g.score[i]);
  const size_t eb = elem_bytes(m);
  for (int kv = 0; kv < 2; ++kv) {
    const auto& a = kv ? c.v : c.k;
    const auto& b = kv ? g.v : g.k;
    if (a == b) continue;
    for (size_t i = 0; i < a.size() / eb; ++i) {
      const float x = kvgc::cpu::load(&a[i * eb], m.dtype), y = kvgc::cpu::load(&b[i * eb], m.dtype);
      if (std::memcmp(&a[i * eb], &b[i * eb], eb) == 0 || (std::isnan(x) && std::isnan(y))) continue;
      if (!(std::fabs(x - y) <= 1e-6 * std::max(std::fabs(x), std::fabs(y))))
        return std::string(kv ? "V" : "K") + " element " + std::to_string(i) + " (row " +
               std::to_string(i / (m.n_kv_heads * m.head_dim)) + "): " + std::to_string(x) +
               " vs " + std::to_string(y);
    }
  }
  return "";
}

std::string compare_stats(const kvgc_stats& c, const kvgc_stats& g) {
  std::string out;
#define KVGC_SAME(f) \
  if (c.f != g.f) out += std::string(" " #f ": ") + std::to_string(c.f) + " vs " + std::to_string(g.f);
  KVGC_SAME(live_tokens) KVGC_SAME(slots_held) KVGC_SAME(dead_slots) KVGC_SAME(steps)
  KVGC_SAME(observes) KVGC_SAME(gcs) KVGC_SAME(minor_gcs) KVGC_SAME(major_gcs)
  KVGC_SAME(tokens_ranked) KVGC_SAME(tokens_evicted) KVGC_SAME(tokens_demoted)
  KVGC_SAME(tokens_promoted) KVGC_SAME(tokens_tenured) KVGC_SAME(compactions)
  KVGC_SAME(slots_moved) KVGC_SAME(bytes_moved) KVGC_SAME(ebudget) KVGC_SAME(pages_allocated)
  KVGC_SAME(pages_freed) KVGC_SAME(cls[0].pages_used) KVGC_SAME(cls[1].pages_used)
  for (int t = 0; t < KVGC_GEN_COUNT; ++t) KVGC_SAME(tier_tokens[t])
#undef KVGC_SAME
  return out;
}

kvgc_stats get_stats(kvgc_heap* h) {
  kvgc_stats st;
  kvgc_stats_init(&st);
  REQUIRE(kvgc_get_stats(h, &st) == KVGC_OK);
  return st;
}

// The twin heaps' stats are equal (every field compare_stats compares).
void require_same_stats(const kvgc_stats& c, const kvgc_stats& g) {
  const std::string stats = compare_stats(c, g);
  INFO("stats (cpu vs cuda):" << stats);
  REQUIRE(stats.empty());
}

// A step on the CPU heap ended OK or EBUDGET, and the same step on the CUDA heap `gpu` alike.
void require_same_status(kvgc_status st_cpu, kvgc_status st_gpu, kvgc_heap* gpu) {
  INFO("cpu: " << kvgc_status_str(st_cpu) << ", cuda: " << kvgc_status_str(st_gpu) << " " << kvgc_errmsg(gpu));
  REQUIRE((st_cpu == KVGC_OK || st_cpu == KVGC_EBUDGET));
  REQUIRE(st_gpu == st_cpu);
}

// The twin prefix-cache tests' heap options: generational with the ladder, the prefix
// cache charged as `charge`, 4 sinks and a window of 8; budgets are the test's.
kvgc_heap_options prefix_options(uint32_t pt, kvgc_prefix_charge charge) {
  kvgc_heap_options o = cpu_options(32 << 20, pt);
  o.policy = KVGC_POLICY_GENERATIONAL;
  o.demote = KVGC_DEMOTE_LADDER;
  o.prefix_charge = charge;
  o.sinks = 4;
  o.window = 8;
  return o;
}

// A test's random source, freshly seeded under `name` (kvgc_test::fresh_seed), and its
// stream, destroyed with it.
struct SeededStream {
  uint32_t seed;
  std::mt19937 rng;
  cudaStream_t stream = nullptr;
  explicit SeededStream(const char* name) : seed(kvgc_test::fresh_seed(name)), rng(seed) {
    REQUIRE(cudaStreamCreate(&stream) == cudaSuccess);
  }
  ~SeededStream() { cudaStreamDestroy(stream); }
  SeededStream(const SeededStream&) = delete;
  SeededStream& operator=(const SeededStream&) = delete;
};

// A sequence's classes by row in read order, read on the host or (`device`, on `stream`)
// into a device buffer; either way one byte longer than needed, which must keep its 0xCC.
std::vector<uint8_t> read_classes(kvgc_heap* h, kvgc_seq s, uint32_t layer, bool device, cudaStream_t stream) {
  uint64_t n = 0;
  REQUIRE(kvgc_read_classes(h, s, layer, nullptr, 0, &n, device ? stream : nullptr) == KVGC_OK);
  std::vector<uint8_t> cls(n + 1, 0xCC);
  DeviceBuffer d(n + 1);
  REQUIRE(cudaMemset(d.p, 0xCC, n + 1) == cudaSuccess);
  REQUIRE(kvgc_read_classes(h, s, layer, device ? d.get() : cls.data(), n + 1, &n, device ? stream : nullptr) == KVGC_OK);
  if (device) REQUIRE(cudaMemcpy(cls.data(), d.p, n + 1, cudaMemcpyDeviceToHost) == cudaSuccess);
  CHECK(cls[n] == 0xCC);
  cls.resize(n);
  return cls;
}

// The CPU heap's classes (cc) and the CUDA heap's (cg) for the same rows are equal.
void require_same_classes(const std::vector<uint8_t>& cc, const std::vector<uint8_t>& cg) {
  REQUIRE(cc.size() == cg.size());
  const size_t at = size_t(std::mismatch(cc.begin(), cc.end(), cg.begin()).first - cc.begin());
  INFO("classes differ first at row " << at);
  REQUIRE(at == cc.size());
}

// One query over layer 0 on both heaps agrees within the attention test's bounds; f16
// is looser after demotion (the CPU rounds dequantised values to f16, the CUDA kernel
// keeps them in f32).
void check_attention(kvgc_heap* cpu, kvgc_seq sc, kvgc_heap* gpu, kvgc_seq sg,
                     const kvgc_model_desc& m, std::mt19937& rng, uint32_t flags,
                     cudaStream_t stream) {
  const size_t eb = elem_bytes(m), qn = size_t(m.n_q_heads) * m.head_dim;
  std::vector<uint8_t> q(qn * eb), out_cpu(q.size()), out_gpu(q.size());
  std::normal_distribution<float> gauss(0.f, 1.f);
  for (size_t j = 0; j < qn; ++j) kvgc::cpu::store(&q[j * eb], m.dtype, gauss(rng));
  DeviceBuffer dq(q.size()), dout(q.size());
  REQUIRE(cudaMemcpy(dq.p, q.data(), q.size(), cudaMemcpyHostToDevice) == cudaSuccess);
  kvgc_attend_params params;
  kvgc_attend_params_init(&params);
  params.flags = flags;
  REQUIRE(kvgc_attend(cpu, sc, 0, q.data(), 1, out_cpu.data(), &params, nullptr) == KVGC_OK);
  REQUIRE(kvgc_attend(gpu, sg, 0, dq.p, 1, dout.p, &params, stream) == KVGC_OK);
  REQUIRE(cudaStreamSynchronize(stream) == cudaSuccess);
  REQUIRE(cudaMemcpy(out_gpu.data(), dout.p, q.size(), cudaMemcpyDeviceToHost) == cudaSuccess);
  const double err = rel_rms(out_cpu, out_gpu, qn, m.dtype);
  CHECK(std::isfinite(err));
  CHECK(err <= (m.dtype == KVGC_DTYPE_F32 ? 1e-5 : 5e-3));
}

struct GcCase {
  kvgc_model_desc m;
  uint32_t page_tokens;
  kvgc_policy policy;
  kvgc_demote demote;
  double noise;
  uint64_t budget;    // tokens per segment, or 0: a fraction of the length
  double fraction;
  double byte_fraction = 0;  // a byte budget instead (a fraction of the full cache)
  double recent_decay = 1;
};

// One workload on a CPU heap and a CUDA heap: random appends, random masses, a step
// after every append, both heaps checked and compared after every step. Returns the
// CPU heap's final stats.
kvgc_stats run_twin(const GcCase& c, uint32_t seed, cudaStream_t stream) {
  std::mt19937 rng(seed);
  kvgc_heap_options o = cpu_options(32 << 20, c.page_tokens);
  o.policy = c.policy;
  o.token_budget = c.byte_fraction > 0 ? 0 : c.budget;
  o.token_budget_fraction = c.byte_fraction > 0 ? 0 : c.fraction;
  o.byte_budget_fraction = c.byte_fraction;
  o.recent_decay = c.recent_decay;
  o.sinks = 4;
  o.window = 8;
  o.demote = c.demote;
  o.compact_threshold = 0.2;
  o.score_noise = c.noise;
  o.seed = seed;
  kvgc_heap* cpu = make_heap(c.m, KVGC_DEVICE_CPU, c.page_tokens, 0, &o);
  kvgc_heap* gpu = make_heap(c.m, KVGC_DEVICE_CUDA, c.page_tokens, 0, &o);
  kvgc_seq sc[2], sg[2];
  for (int i = 0; i < 2; ++i) {
    REQUIRE(kvgc_seq_create(cpu, 0, &sc[i]) == KVGC_OK);
    REQUIRE(kvgc_seq_create(gpu, 0, &sg[i]) == KVGC_OK);
  }
  for (int step = 0; step < 50; ++step) {
    CAPTURE(step);
    const int i = int(rng() % 2);
    const uint32_t n = rng() % 4 == 0 ? 1 + rng() % 40 : 1 + rng() % 3;
    for (uint32_t layer = 0; layer < c.m.n_layers; ++layer) {
      // Specials in layer 1 only: layer 0 is what attention is compared over at the end.
      const auto k = random_kv(c.m, n, rng, layer == 1), v = random_kv(c.m, n, rng, layer == 1);
      DeviceBuffer dk(k.size()), dv(v.size());
      REQUIRE(cudaMemcpy(dk.p, k.data(), k.size(), cudaMemcpyHostToDevice) == cudaSuccess);
      REQUIRE(cudaMemcpy(dv.p, v.data(), v.size(), cudaMemcpyHostToDevice) == cudaSuccess);
      REQUIRE(kvgc_append(cpu, sc[i], layer, k.data(), v.data(), n, nullptr) == KVGC_OK);
      REQUIRE(kvgc_append(gpu, sg[i], layer, dk.p, dv.p, n, stream) == KVGC_OK);
      REQUIRE(cudaStreamSynchronize(stream) == cudaSuccess);  // before dk/dv go
    }
    for (uint32_t layer = 0; layer < c.m.n_layers; ++layer) {
      uint64_t live = 0;
      REQUIRE(kvgc_seq_tokens(cpu, sc[i], layer, &live, nullptr) == KVGC_OK);
      const auto w = random_mass(live, rng);
      DeviceBuffer dw(live * 4);
      REQUIRE(cudaMemcpy(dw.p, w.data(), live * 4, cudaMemcpyHostToDevice) == cudaSuccess);
      REQUIRE(kvgc_observe(cpu, sc[i], layer, w.data(), live, nullptr) == KVGC_OK);
      REQUIRE(kvgc_observe(gpu, sg[i], layer, dw.get<float>(), live, stream) == KVGC_OK);
      REQUIRE(cudaStreamSynchronize(stream) == cudaSuccess);
    }
    const kvgc_status st_cpu = kvgc_step(cpu, sc[i], nullptr);
    const kvgc_status st_gpu = kvgc_step(gpu, sg[i], stream);
    INFO("cpu: " << kvgc_status_str(st_cpu) << ", cuda: " << kvgc_status_str(st_gpu) << " "
                 << kvgc_errmsg(gpu));
    REQUIRE((st_cpu == KVGC_OK || st_cpu == KVGC_EBUDGET));
    REQUIRE(st_gpu == st_cpu);
    require_check(cpu);  // both walk their pending state: results are applied below
    require_check(gpu);
    // Attention while the step's results are pending (rows numbered by upper bounds on
    // the device); without scores, so that the heaps' scores stay bit-identical.
    check_attention(cpu, sc[i], gpu, sg[i], c.m, rng, KVGC_ATTEND_NO_SCORES, stream);
    require_same_stats(get_stats(cpu), get_stats(gpu));
    for (uint32_t layer = 0; layer < c.m.n_layers; ++layer) {
      CAPTURE(layer);
      const std::string diff =
          compare_rows(read_cpu(cpu, sc[i], layer, c.m), read_gpu(gpu, sg[i], layer, c.m, stream), c.m);
      INFO(diff);
      REQUIRE(diff.empty());
    }
  }
  // Attention over what the GC left of layer 0 (int4 pages included, no special values)
  // agrees within the attention test's bounds.
  const kvgc_stats result = get_stats(cpu);
  check_attention(cpu, sc[0], gpu, sg[0], c.m, rng, 0, stream);
  // A fork on each reads back as its source does (device-to-device page copies on CUDA).
  kvgc_seq fc = 0, fg = 0;
  REQUIRE(kvgc_seq_fork(cpu, sc[1], 0, &fc, nullptr) == KVGC_OK);
  REQUIRE(kvgc_seq_fork(gpu, sg[1], 0, &fg, stream) == KVGC_OK);
  for (uint32_t layer = 0; layer < c.m.n_layers; ++layer) {
    CAPTURE(layer);
    const std::string diff =
        compare_rows(read_cpu(cpu, fc, layer, c.m), read_gpu(gpu, fg, layer, c.m, stream), c.m);
    INFO(diff);
    CHECK(diff.empty());
  }
  require_check(gpu);
  kvgc_heap_destroy(cpu);
  kvgc_heap_destroy(gpu);
  return result;
}

}  // namespace

TEST_CASE("kvgc_step on CUDA equals the CPU: every policy, every ladder, byte budgets, noise, compaction") {
  const uint32_t seed = kvgc_test::fresh_seed("test_cuda gc");
  cudaStream_t stream;
  REQUIRE(cudaStreamCreate(&stream) == cudaSuccess);
  // f16: head_dim 64 (two int4 groups of 32); f32: head_dim 48 (one group: the head).
  const kvgc_model_desc models[] = {model(2, 2, 64, KVGC_DTYPE_F16), model(2, 1, 48, KVGC_DTYPE_F32)};
  kvgc_stats total;
  std::memset(&total, 0, sizeof total);
  uint32_t run = 0;
  for (int mi = 0; mi < 2; ++mi)
    for (kvgc_policy policy : {KVGC_POLICY_H2O, KVGC_POLICY_GENERATIONAL, KVGC_POLICY_STREAMING,
                               KVGC_POLICY_RANDOM})
      for (kvgc_demote demote : {KVGC_DEMOTE_OFF, KVGC_DEMOTE_INT4, KVGC_DEMOTE_INT8, KVGC_DEMOTE_LADDER,
                                 KVGC_DEMOTE_LADDER_INT2})
        for (double noise : {0.0, 0.05}) {
          const bool by_score = policy == KVGC_POLICY_H2O || policy == KVGC_POLICY_GENERATIONAL;
          if (noise > 0 && !by_score) continue;  // noise only perturbs score keys
          if (demote == KVGC_DEMOTE_INT8 && (mi == 1 || noise > 0)) continue;  // the ladder covers it
          if (demote == KVGC_DEMOTE_LADDER_INT2 && noise > 0) continue;
          GcCase c{models[mi], mi == 0 ? 8u : 16u, policy, demote, noise,
                   mi == 0 ? 40u : 0u, mi == 0 ? 0.0 : 0.35};
          // The full ladder under a byte budget; generational with recent scores.
          if (demote == KVGC_DEMOTE_LADDER) c.byte_fraction = 0.25;
          if (demote == KVGC_DEMOTE_LADDER_INT2) {
            // int2 is dominated for these two shapes (their pages' slot metadata weighs more):
            // SmolLM2's KV shape, where it is on the ladder, at a budget int4 cannot meet.
            if (mi == 1) continue;
            c.m = model(2, 3, 64, KVGC_DTYPE_F16);
            c.page_tokens = 16;
            c.byte_fraction = 0.12;
          }
          if (policy == KVGC_POLICY_GENERATIONAL && demote != KVGC_DEMOTE_OFF) c.recent_decay = 0.9;
          CAPTURE(mi);
          CAPTURE(policy);
          CAPTURE(demote);
          CAPTURE(noise);
          const kvgc_stats st = run_twin(c, seed + 7919 * run++, stream);
          CHECK(st.gcs > 0);
          total.tokens_evicted += st.tokens_evicted;
          total.tokens_demoted += st.tokens_demoted;
          for (int k = 0; k < 3; ++k) total.tokens_demoted_to[k] += st.tokens_demoted_to[k];
          total.tokens_demoted_to_int2 += st.tokens_demoted_to_int2;
          total.tokens_promoted += st.tokens_promoted;
          total.compactions += st.compactions;
          total.major_gcs += st.major_gcs;
        }
  // The workloads reached every path the comparison is meant to cover.
  CHECK(total.tokens_evicted > 0);
  CHECK(total.tokens_demoted > 0);
  CHECK(total.tokens_demoted_to[KVGC_CLASS_INT8] > 0);
  CHECK(total.tokens_demoted_to[KVGC_CLASS_INT4] > 0);
  CHECK(total.tokens_demoted_to_int2 > 0);
  CHECK(total.tokens_promoted > 0);
  CHECK(total.compactions > 0);
  CHECK(total.major_gcs > 0);
  cudaStreamDestroy(stream);
}

TEST_CASE("kvgc_batch_step on CUDA equals the CPU on random batches (h2o, generational, ladder on and off)") {
  // Random batches (B in 1..64, random prompt lengths, sequences joining and leaving)
  // planned, appended and observed identically on a CPU heap and a CUDA heap; the CUDA
  // step launches every collecting segment's select at once (select_batch). Masses go in
  // through kvgc_batch_observe (bit-identical on both), so the decisions must be too:
  // statuses, stats, and every token read back (positions, scores, generations, K/V).
  SeededStream fixture("test_cuda batch gc");
  std::mt19937& rng = fixture.rng;
  const cudaStream_t stream = fixture.stream;
  const kvgc_model_desc m = model(2, 2, 64, KVGC_DTYPE_F16);
  kvgc_stats total;
  std::memset(&total, 0, sizeof total);
  uint64_t split_steps = 0;  // steps whose GC ran in several launch sets (emulation)
  for (kvgc_policy policy : {KVGC_POLICY_H2O, KVGC_POLICY_GENERATIONAL})
    for (kvgc_demote demote : {KVGC_DEMOTE_OFF, KVGC_DEMOTE_LADDER}) {
      CAPTURE(policy);
      CAPTURE(demote);
      kvgc_heap_options o = cpu_options(64 << 20, 8);
      o.policy = policy;
      // Generational's long-term tier holds budget - sinks - window - max(2 * 8, (budget -
      // sinks - window) / 2) tokens: at least 6 from a budget of 32, so minors can promote
      // (a budget of 24..26 left it none, and seed 196961123 drew one: no promotion).
      o.token_budget = 32 + rng() % 16;
      o.sinks = 2;
      o.window = 8;
      o.demote = demote;
      o.compact_threshold = 0.3;
      o.seed = rng();
      kvgc_heap* cpu = make_heap(m, KVGC_DEVICE_CPU, 8, 0, &o);
      kvgc_heap* gpu = make_heap(m, KVGC_DEVICE_CUDA, 8, 0, &o);
#ifdef KVGC_CUDA_EMU
      // With the ladder, every other step's GC runs in several launch sets (a scratch
      // that holds one segment at a time), as a batch larger than the scratch does.
      emu::tight_select_scratch = demote == KVGC_DEMOTE_LADDER;
#endif
      kvgc_batch *bc, *bg;
      REQUIRE(kvgc_batch_create(cpu, &bc) == KVGC_OK);
      REQUIRE(kvgc_batch_create(gpu, &bg) == KVGC_OK);
      std::vector<kvgc_seq> sc, sg;
      const size_t kv_row = size_t(m.n_kv_heads) * m.head_dim;
      for (int step = 0; step < 16; ++step) {
        CAPTURE(step);
        // Sequences join (with a prompt of random length) and leave; B stays in 1..64.
        const uint32_t want = step == 0 ? 1 + rng() % 64 : uint32_t(sc.size());
        while (sc.size() > 1 && rng() % 6 == 0) {
          const size_t i = rng() % sc.size();
          REQUIRE(kvgc_seq_destroy(cpu, sc[i]) == KVGC_OK);
          REQUIRE(kvgc_seq_destroy(gpu, sg[i]) == KVGC_OK);
          sc.erase(sc.begin() + long(i));
          sg.erase(sg.begin() + long(i));
        }
        std::vector<uint32_t> n_new(sc.size(), 1);
        while (sc.size() < 64 && (sc.size() < want || rng() % 4 == 0)) {
          sc.push_back(0), sg.push_back(0);
          REQUIRE(kvgc_seq_create(cpu, 0, &sc.back()) == KVGC_OK);
          REQUIRE(kvgc_seq_create(gpu, 0, &sg.back()) == KVGC_OK);
          n_new.push_back(1 + rng() % 60);
        }
        for (uint32_t& x : n_new)
          if (x == 1 && rng() % 8 == 0) x = rng() % 12;  // chunks, and sequences without rows
        // The first sequence takes a page of rows every step: a minor GC each step, so its
        // intermediate tokens reach the age (2 minors) at which they are promoted.
        if (step > 0) n_new[0] = 8;
        const uint32_t B = uint32_t(sc.size());
        uint32_t rows = 0;
        for (uint32_t x : n_new) rows += x;
        if (rows == 0) rows = n_new[0] = 1;
        uint32_t failed = 0;
        REQUIRE(kvgc_batch_plan(bc, sc.data(), n_new.data(), B, &failed, nullptr) == KVGC_OK);
        REQUIRE(kvgc_batch_plan(bg, sg.data(), n_new.data(), B, &failed, stream) == KVGC_OK);
        for (uint32_t layer = 0; layer < m.n_layers; ++layer) {
          std::vector<uint8_t> k = random_kv(m, rows, rng), v = random_kv(m, rows, rng);
          REQUIRE(k.size() >= size_t(rows) * kv_row * 2);
          DeviceBuffer dk(k.size() + 1), dv(v.size() + 1);
          REQUIRE(cudaMemcpy(dk.p, k.data(), k.size(), cudaMemcpyHostToDevice) == cudaSuccess);
          REQUIRE(cudaMemcpy(dv.p, v.data(), v.size(), cudaMemcpyHostToDevice) == cudaSuccess);
          REQUIRE(kvgc_batch_append(bc, layer, k.data(), v.data(), nullptr) == KVGC_OK);
          REQUIRE(kvgc_batch_append(bg, layer, dk.p, dv.p, stream) == KVGC_OK);
          // Masses by slot of the batch's exported pages (the same pages on both heaps).
          kvgc_batch_view vc;
          std::memset(&vc, 0, sizeof vc);
          vc.struct_size = sizeof vc;
          REQUIRE(kvgc_batch_export(bc, layer, &vc) == KVGC_OK);
          const uint64_t slots = uint64_t(vc.n_pages) * vc.page_tokens;
          const std::vector<float> w = random_mass(slots + 1, rng);
          DeviceBuffer dw(w.size() * 4);
          REQUIRE(cudaMemcpy(dw.p, w.data(), w.size() * 4, cudaMemcpyHostToDevice) == cudaSuccess);
          REQUIRE(kvgc_batch_observe(bc, layer, w.data(), nullptr) == KVGC_OK);
          REQUIRE(kvgc_batch_observe(bg, layer, dw.get<float>(), stream) == KVGC_OK);
          REQUIRE(cudaStreamSynchronize(stream) == cudaSuccess);  // before dk, dv, dw go
        }
#ifdef KVGC_CUDA_EMU
        const uint64_t sets_before = emu::select_sets;
#endif
        const kvgc_status st_cpu = kvgc_batch_step(bc, nullptr), st_gpu = kvgc_batch_step(bg, stream);
#ifdef KVGC_CUDA_EMU
        split_steps += emu::select_sets - sets_before > 1;
#endif
        INFO("cpu: " << kvgc_status_str(st_cpu) << ", cuda: " << kvgc_status_str(st_gpu) << " " << kvgc_errmsg(gpu));
        REQUIRE((st_cpu == KVGC_OK || st_cpu == KVGC_EBUDGET));
        REQUIRE(st_gpu == st_cpu);
        require_check(cpu);
        require_check(gpu);
        require_same_stats(get_stats(cpu), get_stats(gpu));
        if (step % 5 != 4 && step != 15) continue;
        for (uint32_t i = 0; i < B; ++i)
          for (uint32_t layer = 0; layer < m.n_layers; ++layer) {
            CAPTURE(i);
            CAPTURE(layer);
            const std::string diff =
                compare_rows(read_cpu(cpu, sc[i], layer, m), read_gpu(gpu, sg[i], layer, m, stream), m);
            INFO(diff);
            REQUIRE(diff.empty());
          }
      }
      const kvgc_stats st = get_stats(cpu);
      CHECK(st.gcs > 0);
      if (policy == KVGC_POLICY_GENERATIONAL) CHECK(st.tokens_promoted > 0);  // by construction
      total.tokens_evicted += st.tokens_evicted;
      total.tokens_demoted += st.tokens_demoted;
      total.tokens_promoted += st.tokens_promoted;
      total.major_gcs += st.major_gcs;
      kvgc_batch_destroy(bc);
      kvgc_batch_destroy(bg);
      kvgc_heap_destroy(cpu);
      kvgc_heap_destroy(gpu);
    }
#ifdef KVGC_CUDA_EMU
  emu::tight_select_scratch = false;
  CHECK(split_steps > 0);
#endif
  (void)split_steps;
  CHECK(total.tokens_evicted > 0);  // the paths the comparison is meant to cover
  CHECK(total.tokens_demoted > 0);
  CHECK(total.tokens_promoted > 0);
}

TEST_CASE("the prefix cache charged as prune on a CUDA heap equals a CPU heap (generational, ladder, token and byte budgets, batch)") {
  // KVGC_PREFIX_CHARGE_PRUNE through kvgc.h (retired in 0.15: both heaps run shrink, so
  // a page every holder demoted may be re-stored at int8, alike on both): a keeper's 150-token prompt (18 whole pages
  // and a partly filled tail) kept, three sequences attach it, one is forked; rounds of
  // appends, masses and steps (some rounds through the batch API), under budgets that
  // demote and evict prompt tokens. Masses go in through kvgc_observe and
  // kvgc_batch_observe (the same bits on both heaps) and attention runs without scores
  // (its outputs within check_attention's bound), so the decisions must match: statuses,
  // stats, every row (positions, scores, generations, K/V) and every class (a shared
  // token's charged class). Prompt tokens the ladder demoted read back the prompt's bytes.
  SeededStream fixture("test_cuda prune");
  const uint32_t seed = fixture.seed;
  std::mt19937& rng = fixture.rng;
  const cudaStream_t stream = fixture.stream;
  const kvgc_model_desc m = model(2, 2, 64, KVGC_DTYPE_F16, 2);
  constexpr uint32_t pt = 8, P = 150, whole = P / pt * pt;  // 144 tokens in whole shared pages
  const size_t tb = token_bytes(m), q_bytes = size_t(m.n_q_heads) * m.head_dim * elem_bytes(m);
  auto classes = [&](kvgc_heap* h, kvgc_seq s, uint32_t layer, bool device) {
    return read_classes(h, s, layer, device, stream);
  };
  for (int config = 0; config < 2; ++config) {  // a token budget, then a byte budget
    CAPTURE(config);
    kvgc_heap_options o = prefix_options(pt, KVGC_PREFIX_CHARGE_PRUNE);
    o.token_budget = config == 0 ? 60 : 0;
    o.byte_budget_fraction = config == 0 ? 0 : 0.3;
    o.recent_decay = 0.9;
    o.compact_threshold = 0.25;
    o.seed = seed;
    kvgc_heap* cpu = make_heap(m, KVGC_DEVICE_CPU, pt, 0, &o);
    kvgc_heap* gpu = make_heap(m, KVGC_DEVICE_CUDA, pt, 0, &o);
#ifdef KVGC_CUDA_EMU
    emu::tight_select_scratch = config == 1;  // batch steps' selects in several launch sets
#endif
    std::vector<kvgc_seq> sc, sg;  // [0] the keeper, [1, 4) attached, [4] a fork of [1]
    auto create = [&] {
      sc.push_back(0), sg.push_back(0);
      REQUIRE(kvgc_seq_create(cpu, 0, &sc.back()) == KVGC_OK);
      REQUIRE(kvgc_seq_create(gpu, 0, &sg.back()) == KVGC_OK);
    };
    auto append = [&](size_t i, uint32_t layer, const std::vector<uint8_t>& k, const std::vector<uint8_t>& v, uint32_t n) {
      DeviceBuffer dk(k.size()), dv(v.size());
      REQUIRE(cudaMemcpy(dk.p, k.data(), k.size(), cudaMemcpyHostToDevice) == cudaSuccess);
      REQUIRE(cudaMemcpy(dv.p, v.data(), v.size(), cudaMemcpyHostToDevice) == cudaSuccess);
      REQUIRE(kvgc_append(cpu, sc[i], layer, k.data(), v.data(), n, nullptr) == KVGC_OK);
      REQUIRE(kvgc_append(gpu, sg[i], layer, dk.p, dv.p, n, stream) == KVGC_OK);
      REQUIRE(cudaStreamSynchronize(stream) == cudaSuccess);
    };
    create();
    std::vector<uint8_t> prompt_k[2];
    for (uint32_t layer = 0; layer < m.n_layers; ++layer) {  // specials in layer 1 only, as run_twin
      prompt_k[layer] = random_kv(m, P, rng, layer == 1);
      append(0, layer, prompt_k[layer], random_kv(m, P, rng, layer == 1), P);
    }
    std::vector<int32_t> ids(P);
    for (auto& id : ids) id = int32_t(rng() % 50000);
    REQUIRE(kvgc_prefix_keep(cpu, sc[0], ids.data(), P, 0, 0, nullptr, nullptr) == KVGC_OK);
    REQUIRE(kvgc_prefix_keep(gpu, sg[0], ids.data(), P, 0, 0, nullptr, stream) == KVGC_OK);
    for (int i = 0; i < 3; ++i) {
      create();
      uint64_t nc = 0, ng = 0;
      REQUIRE(kvgc_prefix_attach(cpu, sc.back(), ids.data(), P, 0, &nc, nullptr) == KVGC_OK);
      REQUIRE(kvgc_prefix_attach(gpu, sg.back(), ids.data(), P, 0, &ng, stream) == KVGC_OK);
      CHECK(nc == P);
      CHECK(ng == P);
    }
    kvgc_batch *bc, *bg;
    REQUIRE(kvgc_batch_create(cpu, &bc) == KVGC_OK);
    REQUIRE(kvgc_batch_create(gpu, &bg) == KVGC_OK);
    for (int round = 0; round < 24; ++round) {
      CAPTURE(round);
      if (round == 10) {
        sc.push_back(0), sg.push_back(0);
        REQUIRE(kvgc_seq_fork(cpu, sc[1], 0, &sc.back(), nullptr) == KVGC_OK);
        REQUIRE(kvgc_seq_fork(gpu, sg[1], 0, &sg.back(), stream) == KVGC_OK);
      }
      const uint32_t B = uint32_t(sc.size());
      if (round % 6 == 5) {  // the batch API: plan, append, attend, export, observe, step
        std::vector<uint32_t> n_new(B);
        uint32_t rows = 0;
        for (auto& x : n_new) rows += x = 1 + rng() % 2;
        uint32_t failed = 0;
        REQUIRE(kvgc_batch_plan(bc, sc.data(), n_new.data(), B, &failed, nullptr) == KVGC_OK);
        REQUIRE(kvgc_batch_plan(bg, sg.data(), n_new.data(), B, &failed, stream) == KVGC_OK);
        kvgc_attend_params params;
        kvgc_attend_params_init(&params);
        params.flags = KVGC_ATTEND_NO_SCORES;
        for (uint32_t layer = 0; layer < m.n_layers; ++layer) {
          const auto k = random_kv(m, rows, rng, layer == 1), v = random_kv(m, rows, rng, layer == 1);
          std::vector<uint8_t> q(rows * q_bytes), out_c(q.size()), out_g(q.size());
          std::normal_distribution<float> gauss(0.f, 1.f);
          for (size_t j = 0; j < q.size() / 2; ++j) kvgc::cpu::store(&q[j * 2], m.dtype, gauss(rng));
          DeviceBuffer dk(k.size()), dv(v.size()), dq(q.size()), dout(q.size());
          REQUIRE(cudaMemcpy(dk.p, k.data(), k.size(), cudaMemcpyHostToDevice) == cudaSuccess);
          REQUIRE(cudaMemcpy(dv.p, v.data(), v.size(), cudaMemcpyHostToDevice) == cudaSuccess);
          REQUIRE(cudaMemcpy(dq.p, q.data(), q.size(), cudaMemcpyHostToDevice) == cudaSuccess);
          REQUIRE(cudaMemset(dout.p, 0xA5, q.size()) == cudaSuccess);  // poison
          REQUIRE(kvgc_batch_append(bc, layer, k.data(), v.data(), nullptr) == KVGC_OK);
          REQUIRE(kvgc_batch_append(bg, layer, dk.p, dv.p, stream) == KVGC_OK);
          REQUIRE(kvgc_batch_attend(bc, layer, q.data(), out_c.data(), &params, nullptr) == KVGC_OK);
          REQUIRE(kvgc_batch_attend(bg, layer, dq.p, dout.p, &params, stream) == KVGC_OK);
          REQUIRE(cudaStreamSynchronize(stream) == cudaSuccess);
          REQUIRE(cudaMemcpy(out_g.data(), dout.p, q.size(), cudaMemcpyDeviceToHost) == cudaSuccess);
          if (layer == 0) CHECK(rel_rms(out_c, out_g, q.size() / 2, m.dtype) <= 5e-3);  // check_attention's bound
          // Masses by slot of the exported pages, which must be the same pages on both.
          kvgc_batch_view vc, vg;
          std::memset(&vc, 0, sizeof vc);
          std::memset(&vg, 0, sizeof vg);
          vc.struct_size = vg.struct_size = sizeof vc;
          REQUIRE(kvgc_batch_export(bc, layer, &vc) == KVGC_OK);
          REQUIRE(kvgc_batch_export(bg, layer, &vg) == KVGC_OK);
          REQUIRE(vg.n_pages == vc.n_pages);
          std::vector<uint8_t> cls(vg.n_pages);
          REQUIRE(cudaMemcpy(cls.data(), vg.page_class, vg.n_pages, cudaMemcpyDeviceToHost) == cudaSuccess);
          CHECK(std::equal(cls.begin(), cls.end(), vc.page_class));
          const std::vector<float> w = random_mass(uint64_t(vc.n_pages) * vc.page_tokens + 1, rng);
          DeviceBuffer dw(w.size() * 4);
          REQUIRE(cudaMemcpy(dw.p, w.data(), w.size() * 4, cudaMemcpyHostToDevice) == cudaSuccess);
          REQUIRE(kvgc_batch_observe(bc, layer, w.data(), nullptr) == KVGC_OK);
          REQUIRE(kvgc_batch_observe(bg, layer, dw.get<float>(), stream) == KVGC_OK);
          REQUIRE(cudaStreamSynchronize(stream) == cudaSuccess);  // before dk, dv, dq, dw go
        }
        const kvgc_status st_cpu = kvgc_batch_step(bc, nullptr), st_gpu = kvgc_batch_step(bg, stream);
        require_same_status(st_cpu, st_gpu, gpu);
      } else {  // each sequence: append (a private prompt part first), observe, step
        for (uint32_t i = 0; i < B; ++i) {
          CAPTURE(i);
          const uint32_t n = round == 0 ? 20 : 1 + rng() % 3;
          for (uint32_t layer = 0; layer < m.n_layers; ++layer)
            append(i, layer, random_kv(m, n, rng, layer == 1), random_kv(m, n, rng, layer == 1), n);
          for (uint32_t layer = 0; layer < m.n_layers; ++layer) {
            uint64_t live = 0;
            REQUIRE(kvgc_seq_tokens(cpu, sc[i], layer, &live, nullptr) == KVGC_OK);
            const auto w = random_mass(live, rng);
            DeviceBuffer dw(live * 4);
            REQUIRE(cudaMemcpy(dw.p, w.data(), live * 4, cudaMemcpyHostToDevice) == cudaSuccess);
            REQUIRE(kvgc_observe(cpu, sc[i], layer, w.data(), live, nullptr) == KVGC_OK);
            REQUIRE(kvgc_observe(gpu, sg[i], layer, dw.get<float>(), live, stream) == KVGC_OK);
            REQUIRE(cudaStreamSynchronize(stream) == cudaSuccess);
          }
          const kvgc_status st_cpu = kvgc_step(cpu, sc[i], nullptr), st_gpu = kvgc_step(gpu, sg[i], stream);
          require_same_status(st_cpu, st_gpu, gpu);
        }
        const uint32_t i = rng() % B;
        check_attention(cpu, sc[i], gpu, sg[i], m, rng, KVGC_ATTEND_NO_SCORES, stream);
      }
      require_check(cpu);
      require_check(gpu);
      require_same_stats(get_stats(cpu), get_stats(gpu));
      for (uint32_t i = 0; i < B; ++i)
        for (uint32_t layer = 0; layer < m.n_layers; ++layer) {
          CAPTURE(i);
          CAPTURE(layer);
          const std::string diff =
              compare_rows(read_cpu(cpu, sc[i], layer, m), read_gpu(gpu, sg[i], layer, m, stream), m);
          INFO(diff);
          REQUIRE(diff.empty());
          require_same_classes(classes(cpu, sc[i], layer, false), classes(gpu, sg[i], layer, true));
        }
    }
    // Demoted in place: the attached sequences' and the fork's prompt tokens in whole
    // pages read back the prompt's bytes whatever class they are charged at (unless their
    // page was re-stored at int8: then they are charged below fp16); the GC demoted some
    // of them and evicted others.
    uint64_t charged = 0, evicted = 0, shrunk_reads = 0;
    for (size_t i = 1; i < sg.size(); ++i)
      for (uint32_t layer = 0; layer < m.n_layers; ++layer) {
        CAPTURE(i);
        CAPTURE(layer);
        const Rows r = read_gpu(gpu, sg[i], layer, m, stream);
        const std::vector<uint8_t> cls = classes(gpu, sg[i], layer, true);
        REQUIRE(cls.size() == r.n);
        uint64_t prompt_live = 0;
        for (uint64_t j = 0; j < r.n; ++j) {
          if (r.pos[j] >= int32_t(whole)) continue;
          ++prompt_live;
          charged += cls[j] != KVGC_CLASS_FP16;
          if (std::memcmp(&r.k[j * tb], &prompt_k[layer][size_t(r.pos[j]) * tb], tb) != 0) {
            ++shrunk_reads;
            CHECK(cls[j] != KVGC_CLASS_FP16);
          }
        }
        evicted += whole - prompt_live;
      }
    MESSAGE("config " << config << ": " << charged << " prompt tokens charged below fp16, " << evicted << " evicted");
    CHECK(charged > 0);
    CHECK(evicted > 0);
    const kvgc_stats st = get_stats(gpu);
    CHECK(st.tokens_demoted > 0);
    CHECK(st.tokens_evicted > 0);
    CHECK((shrunk_reads > 0) <= (st.pages_shrunk > 0));
#ifdef KVGC_CUDA_EMU
    emu::tight_select_scratch = false;
#endif
    kvgc_batch_destroy(bc);
    kvgc_batch_destroy(bg);
    require_check(cpu);
    require_check(gpu);
    kvgc_heap_destroy(cpu);
    kvgc_heap_destroy(gpu);
  }
}

TEST_CASE("the prefix cache charged as shrink on a CUDA heap equals a CPU heap (shared pages re-stored at int8 alike; attach and fork read them alike)") {
  // KVGC_PREFIX_CHARGE_SHRINK through kvgc.h (runtime/shrink.cpp), the scenario of
  // test_prefix.cpp's "charged as shrink" on twin heaps: a keeper's 150-token prompt (18
  // whole pages and a tail) kept, three sequences attach it, then rounds of appends of
  // their own, masses by position (kvgc_observe: the same bits on both heaps) and steps,
  // under the ladder and a byte budget. Shared pages whose every holder counts its slots
  // at int8 or below are re-stored at int8 (the CUDA requant, its select's page_classes
  // deciding which), once per heap at a step's start, so the heaps must agree after every
  // round: statuses, stats (pages_shrunk and bytes_shrunk too), every row (positions,
  // scores, generations, K/V bytewise) and every class. Some prompt tokens then read
  // their int8 rendering. A later sequence attaches the shrunk pages and reads alike on
  // both heaps (and what the holders read at the same positions); a fork of a holder
  // reads as the holder. Under deferred harvest (the default) and immediate.
  cudaStream_t stream;
  REQUIRE(cudaStreamCreate(&stream) == cudaSuccess);
  const kvgc_model_desc m = model(2, 2, 32, KVGC_DTYPE_F16);
  constexpr uint32_t pt = 8, P = 150, whole = P / pt * pt;  // 144 tokens in whole shared pages
  constexpr uint64_t kPrompt = 1000, kSalt = 42;
  constexpr int N = 3;
  const size_t tb = token_bytes(m);
  auto classes = [&](kvgc_heap* h, kvgc_seq s, uint32_t layer, bool device) {
    return read_classes(h, s, layer, device, stream);
  };
  std::vector<int32_t> ids(P);
  for (uint32_t j = 0; j < P; ++j) ids[j] = int32_t(7 + j);
  for (kvgc_harvest harvest : {KVGC_HARVEST_DEFERRED, KVGC_HARVEST_IMMEDIATE}) {
    CAPTURE(harvest);
    kvgc_heap_options o = prefix_options(pt, KVGC_PREFIX_CHARGE_SHRINK);
    o.byte_budget_fraction = 0.3;
    o.harvest = harvest;
    kvgc_heap* h[2] = {make_heap(m, KVGC_DEVICE_CPU, pt, 0, &o), make_heap(m, KVGC_DEVICE_CUDA, pt, 0, &o)};
    auto sync = [&](int d) { return d ? stream : nullptr; };
    auto append = [&](int d, kvgc_seq s, uint32_t l, uint64_t tag, int64_t at, uint32_t n) {
      const auto k = gaussian(m, tag, l, at, n, false), v = gaussian(m, tag, l, at, n, true);
      if (d == 0) {
        REQUIRE(kvgc_append(h[0], s, l, k.data(), v.data(), n, nullptr) == KVGC_OK);
        return;
      }
      DeviceBuffer dk(k.size()), dv(v.size());
      REQUIRE(cudaMemcpy(dk.p, k.data(), k.size(), cudaMemcpyHostToDevice) == cudaSuccess);
      REQUIRE(cudaMemcpy(dv.p, v.data(), v.size(), cudaMemcpyHostToDevice) == cudaSuccess);
      REQUIRE(kvgc_append(h[1], s, l, dk.p, dv.p, n, stream) == KVGC_OK);
      REQUIRE(cudaStreamSynchronize(stream) == cudaSuccess);  // before dk/dv go
    };
    auto rows = [&](int d, kvgc_seq s, uint32_t l) { return d == 0 ? read_cpu(h[0], s, l, m) : read_gpu(h[1], s, l, m, stream); };
    // Each heap's masses from its own read order: the same mass for the same position.
    auto observe = [&](int d, kvgc_seq s, uint32_t l, int round) {
      const Rows r = rows(d, s, l);
      std::vector<float> mass(r.n);
      for (size_t j = 0; j < mass.size(); ++j) {
        uint64_t x = uint64_t(r.pos[j]) * 0x9e3779b97f4a7c15ull ^ (uint64_t(round) * 7919 + l);
        x = (x ^ (x >> 29)) * 0xbf58476d1ce4e5b9ull;
        x ^= x >> 32;
        mass[j] = float(double(x >> 40) / double(1 << 24)) * (r.pos[j] % 13 == 0 ? 4.0f : 1.0f);
      }
      if (d == 0) {
        REQUIRE(kvgc_observe(h[0], s, l, mass.data(), mass.size(), nullptr) == KVGC_OK);
        return;
      }
      DeviceBuffer dw(mass.size() * 4);
      REQUIRE(cudaMemcpy(dw.p, mass.data(), mass.size() * 4, cudaMemcpyHostToDevice) == cudaSuccess);
      REQUIRE(kvgc_observe(h[1], s, l, dw.get<float>(), mass.size(), stream) == KVGC_OK);
      REQUIRE(cudaStreamSynchronize(stream) == cudaSuccess);
    };
    // Sequence s[0] of the CPU heap against s[1] of the CUDA heap, every layer: rows in read
    // order (K/V bytewise) and classes.
    auto same = [&](const kvgc_seq* s) {
      for (uint32_t l = 0; l < m.n_layers; ++l) {
        CAPTURE(l);
        const Rows c = rows(0, s[0], l), g = rows(1, s[1], l);
        const std::string diff = compare_rows(c, g, m);
        INFO(diff);
        REQUIRE(diff.empty());
        CHECK(c.k == g.k);  // bytewise, int8 and int4 renderings included
        CHECK(c.v == g.v);
        const std::vector<uint8_t> cc = classes(h[0], s[0], l, false);
        REQUIRE(cc.size() == c.n);
        require_same_classes(cc, classes(h[1], s[1], l, true));  // and so cg.size() == c.n
      }
    };
    kvgc_seq keeper[2], shared[N][2];
    for (int d = 0; d < 2; ++d) {
      REQUIRE(kvgc_seq_create(h[d], 0, &keeper[d]) == KVGC_OK);
      for (uint32_t l = 0; l < m.n_layers; ++l) append(d, keeper[d], l, kPrompt, 0, P);
      REQUIRE(kvgc_prefix_keep(h[d], keeper[d], ids.data(), P, kSalt, 0, nullptr, sync(d)) == KVGC_OK);
      REQUIRE(kvgc_seq_destroy(h[d], keeper[d]) == KVGC_OK);
      for (int i = 0; i < N; ++i) {
        uint64_t n = 0;
        REQUIRE(kvgc_seq_create(h[d], 0, &shared[i][d]) == KVGC_OK);
        REQUIRE(kvgc_prefix_attach(h[d], shared[i][d], ids.data(), P, kSalt, &n, sync(d)) == KVGC_OK);
        CHECK(n == P);
      }
    }
    int64_t len = P;
    int first_shrunk = -1;  // the first round after which pages_shrunk was not 0
    for (int round = 0; round < 20; ++round) {
      CAPTURE(round);
      const uint32_t n = round == 0 ? 20 : 1 + round % 3;
      for (int i = 0; i < N; ++i) {
        CAPTURE(i);
        kvgc_status st[2];
        for (int d = 0; d < 2; ++d) {
          for (uint32_t l = 0; l < m.n_layers; ++l) append(d, shared[i][d], l, 77 + uint64_t(i), len, n);
          for (uint32_t l = 0; l < m.n_layers; ++l) observe(d, shared[i][d], l, round);
          st[d] = kvgc_step(h[d], shared[i][d], sync(d));
        }
        require_same_status(st[0], st[1], h[1]);
      }
      len += n;
      require_check(h[0]);
      require_check(h[1]);
      const kvgc_stats sc = get_stats(h[0]), sg = get_stats(h[1]);
      require_same_stats(sc, sg);
      REQUIRE(sc.pages_shrunk == sg.pages_shrunk);
      REQUIRE(sc.bytes_shrunk == sg.bytes_shrunk);
      if (sc.pages_shrunk > 0 && first_shrunk < 0) first_shrunk = round;
      for (int i = 0; i < N; ++i) {
        CAPTURE(i);
        same(shared[i]);
      }
    }
    const kvgc_stats sc = get_stats(h[0]), sg = get_stats(h[1]);
    MESSAGE("harvest " << harvest << ": " << sg.pages_shrunk << " pages shrunk (" << sg.bytes_shrunk
                       << " B; first after round " << first_shrunk << " of 0..19), cpu " << sc.pages_shrunk << ", "
                       << sg.tokens_demoted << " tokens demoted, " << sg.tokens_evicted << " evicted");
    CHECK(sc.pages_shrunk > 0);
    CHECK(sg.pages_shrunk == sc.pages_shrunk);
    CHECK(sg.bytes_shrunk == sc.bytes_shrunk);
    // Holders read some prompt tokens (in whole pages) at their int8 rendering now, not the
    // prompt's bytes; the same ones on both heaps (compared above), counted on the CUDA one.
    auto prompt_rows_changed = [&](const Rows& r, uint32_t l) {
      const auto k = gaussian(m, kPrompt, l, 0, whole, false);
      uint64_t changed = 0;
      for (uint64_t j = 0; j < r.n; ++j)
        if (r.pos[j] < int32_t(whole))
          changed += std::memcmp(&r.k[j * tb], &k[size_t(r.pos[j]) * tb], tb) != 0;
      return changed;
    };
    uint64_t changed = 0;
    for (int i = 0; i < N; ++i)
      for (uint32_t l = 0; l < m.n_layers; ++l) changed += prompt_rows_changed(rows(1, shared[i][1], l), l);
    MESSAGE("holders read " << changed << " prompt tokens at a shrunk page's rendering");
    CHECK(changed > 0);

    // A later sequence attaches the shrunk pages on both heaps: the same rows and classes,
    // and at every whole-page prompt position a holder still holds, the holder's bytes.
    kvgc_seq late[2], fork[2];
    for (int d = 0; d < 2; ++d) {
      uint64_t n = 0;
      REQUIRE(kvgc_seq_create(h[d], 0, &late[d]) == KVGC_OK);
      REQUIRE(kvgc_prefix_attach(h[d], late[d], ids.data(), P, kSalt, &n, sync(d)) == KVGC_OK);
      CHECK(n == P);
      require_check(h[d]);
    }
    same(late);
    uint64_t late_changed = 0;
    for (uint32_t l = 0; l < m.n_layers; ++l) {
      const Rows a = rows(1, late[1], l);
      CHECK(a.n == P);
      late_changed += prompt_rows_changed(a, l);
      std::vector<const uint8_t*> at(whole, nullptr);  // the late sequence's K row by position
      for (uint64_t j = 0; j < a.n; ++j)
        if (a.pos[j] < int32_t(whole)) at[size_t(a.pos[j])] = &a.k[j * tb];
      for (int i = 0; i < N; ++i) {
        const Rows b = rows(1, shared[i][1], l);
        for (uint64_t j = 0; j < b.n; ++j)
          if (b.pos[j] < int32_t(whole)) {
            REQUIRE(at[size_t(b.pos[j])] != nullptr);
            CHECK(std::memcmp(at[size_t(b.pos[j])], &b.k[j * tb], tb) == 0);
          }
      }
    }
    CHECK(late_changed > 0);
    // A fork of a holder reads as the holder (rows, scores, generations, classes), on both.
    for (int d = 0; d < 2; ++d) {
      REQUIRE(kvgc_seq_fork(h[d], shared[0][d], 0, &fork[d], sync(d)) == KVGC_OK);
      for (uint32_t l = 0; l < m.n_layers; ++l) {
        CAPTURE(d);
        CAPTURE(l);
        const Rows a = rows(d, shared[0][d], l), b = rows(d, fork[d], l);
        CHECK(compare_rows(a, b, m) == "");
        CHECK(a.k == b.k);
        CHECK(a.v == b.v);
        CHECK(classes(h[d], shared[0][d], l, d == 1) == classes(h[d], fork[d], l, d == 1));
      }
      require_check(h[d]);
    }
    same(fork);
    for (int d = 0; d < 2; ++d) {
      for (kvgc_seq s : {late[d], fork[d]}) REQUIRE(kvgc_seq_destroy(h[d], s) == KVGC_OK);
      for (int i = 0; i < N; ++i) REQUIRE(kvgc_seq_destroy(h[d], shared[i][d]) == KVGC_OK);
      require_check(h[d]);
      kvgc_heap_destroy(h[d]);
    }
  }
  cudaStreamDestroy(stream);
}

namespace {

// Page images for the op-level tests: pages_ of both classes in one host buffer (each
// at a multiple of the fp16 page size) and the same bytes on the device.
struct Images {
  kvgc::PageLayout L[KVGC_CLASS_COUNT];
  size_t stride = 0;
  std::vector<uint8_t> host;
  DeviceBuffer* dev = nullptr;
  Images(const kvgc_model_desc& m, uint32_t pt, size_t n_pages) {
    for (int c = 0; c < KVGC_CLASS_COUNT; ++c)
      L[c] = kvgc::PageLayout::make(pt, m.n_kv_heads, m.head_dim, m.dtype, kvgc_storage_class(c));
    stride = L[KVGC_CLASS_FP16].bytes;
    host.resize(stride * n_pages);
    dev = new DeviceBuffer(host.size());
  }
  ~Images() { delete dev; }
  uint8_t* h(size_t i) { return host.data() + i * stride; }
  uint8_t* d(size_t i) { return dev->get(i * stride); }
  void upload() { REQUIRE(cudaMemcpy(dev->p, host.data(), host.size(), cudaMemcpyHostToDevice) == cudaSuccess); }
  // Live slots of page i (host bytes) as class cls.
  uint32_t live_count(size_t i, int cls) {
    const auto* live = reinterpret_cast<const uint32_t*>(h(i) + L[cls].live_off);
    uint32_t n = 0;
    for (uint32_t w = 0; w < kvgc::PageLayout::live_words(L[cls].page_tokens); ++w) n += std::popcount(live[w]);
    return n;
  }
  // A compaction move of n slots from page s to page d, on the host (hm) and the device (dm).
  void add_move(std::vector<kvgc::CompactMove>& hm, std::vector<kvgc::CompactMove>& dm, size_t dst, size_t src,
                uint32_t n) {
    hm.push_back({h(dst), h(src), n});
    dm.push_back({d(dst), d(src), n});
  }
  // Once the stream's work is done, the device's bytes equal the host's.
  void require_same(cudaStream_t stream) {
    REQUIRE(cudaStreamSynchronize(stream) == cudaSuccess);
    const std::string diff = compare();
    INFO(diff);
    REQUIRE(diff.empty());
  }
  // Empty when every page's bytes on the device equal the host's.
  std::string compare() {
    std::vector<uint8_t> back(host.size());
    REQUIRE(cudaMemcpy(back.data(), dev->p, back.size(), cudaMemcpyDeviceToHost) == cudaSuccess);
    for (size_t i = 0; i < host.size(); ++i)
      if (back[i] != host[i])
        return "page " + std::to_string(i / stride) + " byte " + std::to_string(i % stride) +
               " (live/pos/score/gen offsets " + std::to_string(L[0].pos_off) + "/" +
               std::to_string(L[0].score_off) + "/" + std::to_string(L[0].gen_off) + ", K " +
               std::to_string(L[0].k_off) + ")";
    return "";
  }
};

// Fills page i of class cls: random payload, live bits (density in 0..1, only slots <
// used), positions from first_pos, generations that fit them, scores with specials.
void fill_page(Images& im, size_t i, int cls, uint32_t used, double density, int32_t first_pos,
               const kvgc_model_desc& m, std::mt19937& rng) {
  const kvgc::PageLayout& L = im.L[cls];
  uint8_t* p = im.h(i);
  for (size_t b = 0; b < L.bytes; ++b) p[b] = uint8_t(rng());
  if (cls == KVGC_CLASS_FP16) {  // real model-dtype values for demotion to quantise
    const auto kv = random_kv(m, L.page_tokens, rng);
    for (uint32_t t = 0; t < L.page_tokens; ++t)
      for (uint32_t h = 0; h < L.n_kv_heads; ++h)
        for (size_t off : {L.k_off, L.v_off})
          std::memcpy(p + off + h * L.head_stride + t * L.slot_stride,
                      kv.data() + (size_t(t) * L.n_kv_heads + h) * L.slot_stride, L.slot_stride);
  }
  auto* live = reinterpret_cast<uint32_t*>(p + L.live_off);
  std::memset(live, 0, 4 * kvgc::PageLayout::live_words(L.page_tokens));
  const float special[] = {NAN, INFINITY, -INFINITY, 0.f, -0.f, 0.5f, 0.5f, 1e30f};
  for (uint32_t s = 0; s < L.page_tokens; ++s) {
    const bool on = s < used && double(rng() % 1000) < density * 1000;
    if (on) live[s / 32] |= 1u << (s % 32);
    reinterpret_cast<int32_t*>(p + L.pos_off)[s] = first_pos + int32_t(s);
    reinterpret_cast<float*>(p + L.score_off)[s] =
        rng() % 10 == 0 ? special[rng() % 8] : float(rng() % 64) / 16.f;  // ties on a grid
    reinterpret_cast<float*>(p + L.recent_off)[s] =
        rng() % 10 == 0 ? special[rng() % 8] : float(rng() % 64) / 16.f;
    const uint32_t g = int64_t(first_pos) + s < 4 ? uint32_t(kvgc::kGenSink) : 1 + rng() % 3;
    const uint32_t age = rng() % 8 == 0 ? 14 + rng() % 2 : rng() % 5;  // aging saturates at 15
    p[L.gen_off + s] = kvgc::make_gen(uint8_t(g), uint8_t(age));
  }
}

// One random select op over its own page images: the CPU's op on the host images, the
// CUDA op (gop) on the device copies, each with poisoned outputs. Some pages are shared
// (SegPage::kv: their K/V on a page of their own, outside the op), some slots charged at
// a cheaper ladder class (gen bits 6-7), and some ops charge_shared (demotions of shared
// pages' tokens only charge them). The CUDA op asks for page_classes most of the time
// (the CPU's always), and half the CUDA ops have their results written by the kernels
// into pinned host memory (results_mapped, as the runtime's result blocks) rather than
// copied back. Not movable: the ops point into it.
struct RandomSelect {
  std::unique_ptr<Images> im;
  std::vector<kvgc::SegPage> hp, dp;
  std::vector<kvgc::AppendRun> hr[KVGC_CLASS_COUNT], dr[KVGC_CLASS_COUNT];
  kvgc::SelectOp op{}, gop{};
  std::vector<uint16_t> live_cpu, live_gpu;
  std::vector<uint8_t> classes_cpu, classes_gpu;
  kvgc::SelectResult r_cpu, r_gpu;
  std::vector<std::pair<size_t, uint32_t>> charged;  // (page, slot): live and charged before
  uint32_t pt = 0;
  bool mapped = false;
  uint8_t* pinned = nullptr;  // mapped: gop's page_live, page_classes and result, poisoned
  size_t classes_at = 0, result_at = 0;
  static constexpr uint8_t kClassesPoison = 0xDD;

  RandomSelect(const kvgc_model_desc& m, uint32_t page_tokens, std::mt19937& rng) : pt(page_tokens) {
    // The ladder first: a heap holds pages of its ladder's classes only. Pages per class
    // (read order FP16, INT4, INT8) and fresh destination pages per class.
    kvgc_demote demote = kvgc_demote(rng() % 5);
    if (demote == KVGC_DEMOTE_LADDER_INT2) {  // int2 is nearly dominated for some shapes:
      uint64_t b[KVGC_CLASS_COUNT];           // then this op is the three-rung ladder's
      for (int k = 0; k < KVGC_CLASS_COUNT; ++k)
        b[k] = kvgc::PageLayout::make(page_tokens, m.n_kv_heads, m.head_dim, m.dtype, kvgc_storage_class(k)).bytes;
      std::string why;
      if (kvgc::make_ladder(demote, b, &why).n < 4) demote = KVGC_DEMOTE_LADDER;
    }
    const bool has2 = demote == KVGC_DEMOTE_LADDER_INT2;
    const bool has8 = demote == KVGC_DEMOTE_INT8 || demote == KVGC_DEMOTE_LADDER || has2;
    const bool has4 = demote == KVGC_DEMOTE_INT4 || demote == KVGC_DEMOTE_LADDER || has2;
    const uint32_t n_cls[KVGC_CLASS_COUNT] = {uint32_t(1 + rng() % 24), uint32_t(has4 ? rng() % 4 : 0),
                                              uint32_t(has8 ? rng() % 4 : 0), uint32_t(has2 ? rng() % 4 : 0)};
    const uint32_t n_fresh[KVGC_CLASS_COUNT] = {0, uint32_t(has4 ? rng() % 3 : 0), uint32_t(has8 ? rng() % 3 : 0),
                                                uint32_t(has2 ? rng() % 3 : 0)};
    size_t n_pages = 0;
    for (int k = 0; k < KVGC_CLASS_COUNT; ++k) n_pages += n_cls[k] + n_fresh[k];
    // Shared pages: never a destination (fresh, or a tail with room), as the runtime's.
    const bool sharing = rng() % 2;
    std::vector<bool> shared(n_pages, false);
    size_t n_shared = 0;
    for (size_t i = 0, k = 0; k < KVGC_CLASS_COUNT; ++k)
      for (uint32_t j = 0; j < n_cls[k] + n_fresh[k]; ++j, ++i)
        if (sharing && (k == KVGC_CLASS_FP16 || j + 1 < n_cls[k]) && rng() % 2) shared[i] = true, ++n_shared;
    im = std::make_unique<Images>(m, pt, n_pages + n_shared);
    uint64_t bytes[KVGC_CLASS_COUNT];
    for (int k = 0; k < KVGC_CLASS_COUNT; ++k) bytes[k] = im->L[k].bytes;
    std::string note;
    const kvgc::Ladder ladder = kvgc::make_ladder(demote, bytes, &note);
    REQUIRE(note.empty());  // these head dims keep every rung
    int position_of[KVGC_CLASS_COUNT] = {-1, -1, -1, -1};
    for (uint32_t r = 0; r < ladder.n; ++r) position_of[ladder.cls[r]] = int(r);
    const uint32_t charge_permille = rng() % 3 == 0 ? 0 : 100 + rng() % 400;
    hp.resize(n_pages);
    dp.resize(n_pages);
    int32_t pos = 0;
    size_t i = 0, kv_page = n_pages;
    for (int k = 0; k < KVGC_CLASS_COUNT; ++k) {
      const size_t first = i;
      uint32_t tail_used = pt;
      for (uint32_t j = 0; j < n_cls[k] + n_fresh[k]; ++j, ++i) {
        const bool fresh = j >= n_cls[k];
        const bool tail = j + 1 == n_cls[k] && k != KVGC_CLASS_FP16;
        const uint32_t used = tail ? (tail_used = 1 + rng() % pt) : pt;
        fill_page(*im, i, k, fresh ? pt : used, 0.2 + 0.8 * double(rng() % 100) / 100, pos, m, rng);
        pos += int32_t(pt);
        hp[i] = {im->h(i), uint32_t(k), 0};
        dp[i] = {im->d(i), uint32_t(k), 0};
        if (shared[i]) {  // its K/V on a page of the same class (its header part unused)
          fill_page(*im, kv_page, k, pt, 1.0, 0, m, rng);
          hp[i].kv = im->h(kv_page);
          dp[i].kv = im->d(kv_page++);
        }
        if (fresh) continue;
        // Charges: live slots counted at a ladder class below their page's, more often
        // in shared pages (a private page holds them as a copied shared tail).
        const kvgc::PageLayout& L = im->L[k];
        uint8_t* p = im->h(i);
        const auto* live = reinterpret_cast<const uint32_t*>(p + L.live_off);
        const int below = int(ladder.n) - 1 - position_of[k];
        for (uint32_t s = 0; below > 0 && s < pt; ++s)
          if ((live[s / 32] >> (s % 32) & 1u) &&
              rng() % 1000 < (shared[i] ? charge_permille : charge_permille / 4)) {
            const uint8_t c = ladder.cls[position_of[k] + 1 + int(rng() % uint32_t(below))];
            p[L.gen_off + s] = kvgc::with_charged(p[L.gen_off + s], c);
            charged.push_back({i, s});
          }
      }
      // Destination slots: the class's tail room, then its fresh pages (garbage, live
      // bits included: the op clears them, and scrubs what it uses).
      if (n_cls[k] && tail_used < pt && k != KVGC_CLASS_FP16) {
        const size_t t = first + n_cls[k] - 1;
        hr[k].push_back({im->h(t), tail_used, pt - tail_used, 0});
        dr[k].push_back({im->d(t), tail_used, pt - tail_used, 0});
      }
      for (uint32_t f = 0; f < n_fresh[k]; ++f) {
        const size_t t = first + n_cls[k] + f;
        const uint32_t count = f + 1 == n_fresh[k] ? 1 + rng() % pt : pt;
        hr[k].push_back({im->h(t), 0, count, 0});
        dr[k].push_back({im->d(t), 0, count, 0});
      }
    }
    im->upload();
    for (int k = 0; k < KVGC_CLASS_COUNT; ++k) {
      op.layout[k] = im->L[k];
      op.unit_cost[k] = bytes[k];
      op.n_demote_dst[k] = uint32_t(hr[k].size());
    }
    op.n_ladder = ladder.n;
    for (int r = 0; r < KVGC_CLASS_COUNT; ++r) {
      op.ladder[r] = ladder.cls[r];
      op.slope[r] = ladder.slope[r];
    }
    op.n_pages = uint32_t(n_pages);
    op.tenure_before = rng() % (pos + 1);
    op.candidates = uint8_t(kvgc::gen_bit(kvgc::kGenIntermediate) |
                            (rng() % 2 ? kvgc::gen_bit(kvgc::kGenLongTerm) : 0));
    op.key = kvgc::KeyKind(rng() % 4);
    op.noise = kvgc::key_is_score(op.key) && rng() % 3 == 0 ? 0.05 : 0.0;
    op.seed = rng();
    op.segment_salt = rng();
    op.epoch = rng() % 100;
    const uint64_t fp16 = bytes[KVGC_CLASS_FP16];
    const uint64_t reclaims[] = {0, 1, fp16 * 7 + fp16 / 2, fp16 * uint64_t(pos) / 3, fp16 * uint64_t(pos) * 2};
    op.reclaim = reclaims[rng() % 5];
    op.budget_bytes = rng() % 3 == 0 ? 1 + rng() % (n_pages * fp16) : 0;
    op.promote = rng() % 2 ? 0 : rng() % 40;
    op.promote_age = 2;
    op.retier = rng() % 4 == 0;
    op.retier_top = rng() % (pos + 1);
    op.age_intermediate = rng() % 2;
    op.charge_shared = sharing ? rng() % 4 != 0 : rng() % 4 == 0;
    gop = op;
    live_cpu.assign(n_pages, 0xFFFF);
    live_gpu.assign(n_pages, 0xEEEE);
    classes_cpu.assign(n_pages, 0xCC);
    classes_gpu.assign(n_pages, kClassesPoison);
    std::memset(static_cast<void*>(&r_gpu), 0xAB, sizeof r_gpu);  // poison
    op.pages = hp.data();
    gop.pages = dp.data();
    for (int k = 0; k < KVGC_CLASS_COUNT; ++k) {
      op.demote_dst[k] = hr[k].data();
      gop.demote_dst[k] = dr[k].data();
    }
    op.page_live = live_cpu.data();
    op.page_classes = classes_cpu.data();
    op.result = &r_cpu;
    const bool classes = rng() % 8 != 0;  // else null: the CUDA op must not write them
    mapped = rng() % 2;
    if (mapped) {
      classes_at = kvgc::align_up(n_pages * sizeof(uint16_t), 16);
      result_at = kvgc::align_up(classes_at + n_pages, 16);
      REQUIRE(cudaMallocHost(&pinned, result_at + sizeof(kvgc::SelectResult)) == cudaSuccess);
      std::memset(pinned, 0xEE, classes_at);
      std::memset(pinned + classes_at, kClassesPoison, n_pages);
      std::memset(pinned + result_at, 0xAB, sizeof(kvgc::SelectResult));
      gop.page_live = reinterpret_cast<uint16_t*>(pinned);
      gop.page_classes = classes ? pinned + classes_at : nullptr;
      gop.result = reinterpret_cast<kvgc::SelectResult*>(pinned + result_at);
      gop.results_mapped = true;
    } else {
      gop.page_live = live_gpu.data();
      gop.page_classes = classes ? classes_gpu.data() : nullptr;
      gop.result = &r_gpu;
    }
  }
  ~RandomSelect() {
    if (pinned) cudaFreeHost(pinned);
  }
  RandomSelect(const RandomSelect&) = delete;
  RandomSelect& operator=(const RandomSelect&) = delete;

  // The CUDA op's results and page bytes (every page: the K/V pages of shared ones too)
  // equal the CPU op's; after both ran (and the stream was synchronised).
  void check() {
    if (mapped) {  // where the kernels wrote them
      std::memcpy(live_gpu.data(), pinned, live_gpu.size() * sizeof(uint16_t));
      std::memcpy(classes_gpu.data(), pinned + classes_at, classes_gpu.size());
      std::memcpy(static_cast<void*>(&r_gpu), pinned + result_at, sizeof r_gpu);
    }
    CAPTURE(mapped);
    CAPTURE(op.budget_bytes);
    CAPTURE(int(op.n_ladder));
    CAPTURE(op.reclaim);
    CAPTURE(int(op.key));
    CAPTURE(op.retier);
    CAPTURE(op.charge_shared);
    CHECK(r_gpu.ranked == r_cpu.ranked);
    CHECK(r_gpu.tenured == r_cpu.tenured);
    CHECK(r_gpu.evicted == r_cpu.evicted);
    CHECK(r_gpu.demoted == r_cpu.demoted);
    CHECK(r_gpu.promoted == r_cpu.promoted);
    CHECK(r_gpu.promote_eligible == r_cpu.promote_eligible);
    CHECK(r_gpu.reclaimed == r_cpu.reclaimed);
    for (int k = 0; k < KVGC_CLASS_COUNT; ++k) CHECK(r_gpu.demoted_to[k] == r_cpu.demoted_to[k]);
    for (int t = 0; t < 4; ++t) CHECK(r_gpu.tier[t] == r_cpu.tier[t]);
    for (int c = 0; c < KVGC_CLASS_COUNT; ++c) CHECK(r_gpu.live[c] == r_cpu.live[c]);
    for (int c = 0; c < KVGC_CLASS_COUNT; ++c) CHECK(r_gpu.shift[c] == r_cpu.shift[c]);
    CHECK(std::memcmp(&r_gpu, &r_cpu, sizeof r_cpu) == 0);  // every field, none missed
    CHECK(live_gpu == live_cpu);
    for (size_t p = 0; p < live_cpu.size(); ++p)  // the specification's own consistency
      CHECK((live_cpu[p] == 0) == (classes_cpu[p] == 0));
    if (gop.page_classes)
      CHECK(classes_gpu == classes_cpu);
    else  // not asked for: not written
      CHECK(std::count(classes_gpu.begin(), classes_gpu.end(), kClassesPoison) == ptrdiff_t(classes_gpu.size()));
    const std::string diff = im->compare();
    INFO(diff);
    REQUIRE(diff.empty());
  }
  // Demotions that only charged a token (charge_shared), by the CPU.
  uint64_t in_place() const {
    uint64_t moved = 0;
    for (int k = 0; k < KVGC_CLASS_COUNT; ++k) moved += r_cpu.demoted_to[k];
    return r_cpu.demoted - moved;
  }
  // Slots charged before the op that the CPU's op evicted.
  uint64_t charged_evicted() {
    uint64_t n = 0;
    for (const auto& [i, s] : charged) {
      const kvgc::PageLayout& L = im->L[hp[i].cls];
      n += !(reinterpret_cast<const uint32_t*>(im->h(i) + L.live_off)[s / 32] >> (s % 32) & 1u);
    }
    return n;
  }
};

// Sums over the random ops, so that the tests cannot pass without reaching each path.
struct SelectTotals {
  kvgc::SelectResult r;
  uint64_t in_place = 0, charged_evicted = 0, shifted = 0;
  // page_classes (CUDA ops that asked): pages with no live slot, pages counting below
  // their class (a charged slot survived), shared such pages; asked with results mapped
  // and copied; not asked.
  uint64_t classes_empty = 0, classes_below = 0, classes_shared_below = 0;
  uint64_t asked_mapped = 0, asked_copied = 0, not_asked = 0;
  void add(RandomSelect& s) {
    if (s.gop.page_classes) {
      ++(s.mapped ? asked_mapped : asked_copied);
      for (size_t p = 0; p < s.classes_cpu.size(); ++p) {
        classes_empty += s.classes_cpu[p] == 0;
        const bool below = (s.classes_cpu[p] & ~(1u << s.hp[p].cls)) != 0;
        classes_below += below;
        classes_shared_below += below && s.hp[p].kv;
      }
    } else {
      ++not_asked;
    }
    r.tenured += s.r_cpu.tenured;
    r.evicted += s.r_cpu.evicted;
    r.demoted += s.r_cpu.demoted;
    for (int k = 0; k < KVGC_CLASS_COUNT; ++k) r.demoted_to[k] += s.r_cpu.demoted_to[k];
    r.promoted += s.r_cpu.promoted;
    r.promote_eligible += s.r_cpu.promote_eligible;
    in_place += s.in_place();
    charged_evicted += s.charged_evicted();
    shifted += s.r_cpu.shift[KVGC_CLASS_FP16] != 0;
  }
  void check() const {
    CHECK(r.tenured > 0);  // every decision path was taken
    CHECK(r.evicted > 0);
    CHECK(r.demoted > 0);
    CHECK(r.demoted_to[KVGC_CLASS_INT8] > 0);
    CHECK(r.demoted_to[KVGC_CLASS_INT4] > 0);
    CHECK(r.demoted_to[KVGC_CLASS_INT2] > 0);
    CHECK(r.promoted > 0);
    CHECK(r.promote_eligible > 0);
    CHECK(in_place > 0);  // charge_shared's demotions in place
    CHECK(charged_evicted > 0);
    CHECK(shifted > 0);
    CHECK(classes_empty > 0);  // page_classes: every case met
    CHECK(classes_below > 0);
    CHECK(classes_shared_below > 0);
    CHECK(asked_mapped > 0);
    CHECK(asked_copied > 0);
    CHECK(not_asked > 0);
  }
};

}  // namespace

TEST_CASE("select on CUDA equals the CPU op on random page images (ties, NaN, infinities, every plan shape)") {
  SeededStream fixture("test_cuda select");
  std::mt19937& rng = fixture.rng;
  const cudaStream_t stream = fixture.stream;
  const kvgc_model_desc models[] = {model(1, 3, 64, KVGC_DTYPE_F16), model(1, 3, 32, KVGC_DTYPE_BF16),
                                    model(1, 1, 48, KVGC_DTYPE_F32)};
  SelectTotals total;
  for (int iter = 0; iter < 160; ++iter) {
    CAPTURE(iter);
    const uint32_t pt = std::array<uint32_t, 4>{8, 16, 33, 64}[rng() % 4];
    RandomSelect s(models[iter % 3], pt, rng);
    const size_t scratch = kvgc::cuda::gc_scratch_bytes(s.op.n_pages * pt, pt);
    DeviceBuffer sb(scratch);
    s.gop.scratch = sb.p;
    s.gop.scratch_bytes = scratch;
    kvgc::cpu::select(s.op);
    REQUIRE(kvgc::cuda::select(s.gop, stream) == cudaSuccess);
    REQUIRE(cudaStreamSynchronize(stream) == cudaSuccess);
    s.check();
    total.add(s);
  }
  total.check();
}

TEST_CASE("select_batch on CUDA equals the CPU op per segment on random batches (one launch set, or several)") {
  // Segments of one page size, each its own random op (charge_shared or not, shared
  // pages, charged slots): the batch's per-segment parameters carry every op's mode.
  SeededStream fixture("test_cuda select_batch");
  std::mt19937& rng = fixture.rng;
  const cudaStream_t stream = fixture.stream;
  const kvgc_model_desc models[] = {model(1, 3, 64, KVGC_DTYPE_F16), model(1, 3, 32, KVGC_DTYPE_BF16),
                                    model(1, 1, 48, KVGC_DTYPE_F32)};
  kvgc::cuda::SelectStaging stage(false);
  SelectTotals total;
  uint32_t split = 0;
  for (int iter = 0; iter < 40; ++iter) {
    CAPTURE(iter);
    const uint32_t pt = std::array<uint32_t, 4>{8, 16, 33, 64}[rng() % 4];
    const uint32_t n = 2 + rng() % 7;
    std::vector<std::unique_ptr<RandomSelect>> segs;
    std::vector<kvgc::SelectOp> gops;
    uint64_t slots = 0;
    size_t most = 0;  // the scratch of the largest segment alone
    for (uint32_t k = 0; k < n; ++k) {
      segs.push_back(std::make_unique<RandomSelect>(models[iter % 3], pt, rng));
      slots += uint64_t(segs.back()->op.n_pages) * pt;
      most = std::max(most, kvgc::cuda::select_scratch_bytes(segs.back()->gop));
    }
    // Every other batch in a scratch that holds one segment at a time: several launch sets.
    const bool tight = iter % 2;
    const size_t scratch = tight ? most : kvgc::cuda::gc_scratch_bytes(slots, pt);
    DeviceBuffer sb(scratch);
    for (auto& s : segs) {
      s->gop.scratch = sb.p;
      s->gop.scratch_bytes = scratch;
      gops.push_back(s->gop);
      kvgc::cpu::select(s->op);
    }
#ifdef KVGC_CUDA_EMU
    const uint64_t sets_before = emu::select_sets;
#endif
    uint32_t launched = 0;
    REQUIRE(kvgc::cuda::select_batch(gops.data(), n, stage, stream, &launched) == cudaSuccess);
    REQUIRE(launched == n);
    REQUIRE(cudaStreamSynchronize(stream) == cudaSuccess);
#ifdef KVGC_CUDA_EMU
    split += emu::select_sets - sets_before > 1;
#endif
    for (uint32_t k = 0; k < n; ++k) {
      CAPTURE(k);
      segs[k]->check();
      total.add(*segs[k]);
    }
  }
#ifdef KVGC_CUDA_EMU
  CHECK(split > 0);
#endif
  (void)split;
  total.check();
}

TEST_CASE("compact on CUDA equals the CPU op on random page images (every class, planner moves)") {
  SeededStream fixture("test_cuda compact");
  std::mt19937& rng = fixture.rng;
  const cudaStream_t stream = fixture.stream;
  const kvgc_model_desc models[] = {model(1, 2, 64, KVGC_DTYPE_F16), model(1, 3, 6, KVGC_DTYPE_BF16),
                                    model(1, 1, 48, KVGC_DTYPE_F32)};
  for (int iter = 0; iter < 120; ++iter) {
    CAPTURE(iter);
    const kvgc_model_desc& m = models[iter % 3];
    const uint32_t pt = std::array<uint32_t, 4>{1, 8, 37, 256}[rng() % 4];
    const int cls = int(rng() % KVGC_CLASS_COUNT);
    const size_t n_pages = 2 + rng() % 40;
    Images im(m, pt, n_pages);
    kvgc::host::vector<kvgc::PageCounts> counts(n_pages);
    for (size_t i = 0; i < n_pages; ++i) {
      const uint32_t used = i + 1 == n_pages ? 1 + rng() % pt : pt;
      fill_page(im, i, cls, used, double(rng() % 100) / 100, int32_t(i * pt), m, rng);
      counts[i] = {used, im.live_count(i, cls)};
    }
    im.upload();
    const kvgc::CompactionPlan plan = kvgc::plan_compaction(counts, pt);
    std::vector<kvgc::CompactMove> hm, dm;
    for (const auto& mv : plan.moves) {
      im.add_move(hm, dm, mv.dst, mv.src, mv.count);
    }
    kvgc::cpu::compact({im.L[cls], hm.data(), uint32_t(hm.size())});
#ifdef KVGC_CUDA_EMU
    const uint64_t before = emu::launches;
#endif
    REQUIRE(kvgc::cuda::compact({im.L[cls], dm.data(), uint32_t(dm.size())}, stream) == cudaSuccess);
#ifdef KVGC_CUDA_EMU
    CHECK(emu::launches - before == (dm.empty() ? 0u : 1u));  // one launch an op
#endif
    im.require_same(stream);
  }
}

namespace {

// Moves in any order (not the planner's): each picks a destination with holes left and
// a source with live slots left among disjoint random sets, so pages recur in moves far
// apart, with any count up to what both have left (at most `cap`).
std::vector<std::array<uint32_t, 3>> random_moves(const std::vector<uint32_t>& holes,
                                                  const std::vector<uint32_t>& live, uint32_t n_dst,
                                                  uint32_t max_moves, uint32_t cap, std::mt19937& rng) {
  std::vector<uint32_t> dst, src;  // pages with room left (dst: [0, n_dst), src: the rest)
  std::vector<uint32_t> h = holes, l = live;
  for (uint32_t i = 0; i < holes.size(); ++i)
    if (i < n_dst ? h[i] > 0 : l[i] > 0) (i < n_dst ? dst : src).push_back(i);
  std::vector<std::array<uint32_t, 3>> moves;
  while (moves.size() < max_moves && !dst.empty() && !src.empty()) {
    const size_t a = rng() % dst.size(), b = rng() % src.size();
    const uint32_t d = dst[a], s = src[b];
    const uint32_t n = 1 + rng() % std::min({h[d], l[s], cap});
    moves.push_back({d, s, n});
    h[d] -= n;
    l[s] -= n;
    if (h[d] == 0) dst[a] = dst.back(), dst.pop_back();
    if (l[s] == 0) src[b] = src.back(), src.pop_back();
  }
  return moves;
}

}  // namespace

// The op goes to the device in one copy (its moves and page table, staged) and runs in
// one launch whatever its number of moves: thousands of them here, over thousands of
// pages, each page in several moves (the planner's consecutive ones, and any order),
// blocks per move from one to several; ops of every size through one staging ring (it
// grows, wraps and is reused); an op of no moves enqueues nothing.
TEST_CASE("compact on CUDA: one copy and one launch an op, thousands of moves in any order, or none") {
  SeededStream fixture("test_cuda compact staged");
  std::mt19937& rng = fixture.rng;
  const cudaStream_t stream = fixture.stream;
  kvgc::cuda::CompactStaging stage;
  struct Shape {
    kvgc_model_desc m;
    uint32_t pt;
    size_t pages;
  };
  // Llama-like rows in pages of 16 (one block a move); wider rows in pages of 64 (two to
  // eight blocks a move, which must all read a mask before it changes).
  const Shape shapes[] = {{model(1, 2, 64, KVGC_DTYPE_F16), 16, 4000},
                          {model(1, 4, 128, KVGC_DTYPE_F16), 64, 500},
                          {model(1, 3, 6, KVGC_DTYPE_BF16), 37, 1500}};
  uint64_t total_moves = 0, most_moves = 0, multi_pages = 0, far_pages = 0;
  bool blocks_shared = false;  // moves in any order with two blocks a move or more
  for (int iter = 0; iter < 9; ++iter) {
    CAPTURE(iter);
    const Shape& sh = shapes[iter % 3];
    const kvgc_model_desc& m = sh.m;
    const uint32_t pt = sh.pt;
    const int cls = iter < 3 ? KVGC_CLASS_FP16 : int(rng() % KVGC_CLASS_COUNT);
    CAPTURE(cls);
    const bool planner = iter % 2 == 0;
    CAPTURE(planner);
    const size_t n_pages = sh.pages;
    Images im(m, pt, n_pages);
    kvgc::host::vector<kvgc::PageCounts> counts(n_pages);
    std::vector<uint32_t> holes(n_pages), live(n_pages);
    for (size_t i = 0; i < n_pages; ++i) {
      fill_page(im, i, cls, pt, double(rng() % 100) / 100, int32_t(i * pt), m, rng);
      const uint32_t n = im.live_count(i, cls);
      counts[i] = {pt, n};
      live[i] = n;
      holes[i] = pt - n;
    }
    im.upload();
    std::vector<kvgc::CompactMove> hm, dm;
    if (planner) {
      for (const auto& mv : kvgc::plan_compaction(counts, pt).moves) {
        im.add_move(hm, dm, mv.dst, mv.src, mv.count);
      }
    } else {  // the first half destinations, the rest sources, moves in random order
      // Short moves (thousands of them) in pages of 16 and 37; up to whole pages of 64,
      // so that the op has several blocks a move (the emulation runs a launch's blocks
      // in order: only then does a block of an earlier move read a mask after a block
      // of a later move, as on a GPU).
      const uint32_t cap = pt == 64 ? pt : 1 + rng() % 8;
      for (const auto& [d, s, n] : random_moves(holes, live, uint32_t(n_pages / 2), 6000, cap, rng)) {
        im.add_move(hm, dm, d, s, n);
      }
    }
    REQUIRE(dm.size() >= 200);
    uint32_t longest = 0;
    for (const auto& mv : dm) longest = std::max(longest, mv.count);
    blocks_shared |= !planner && 2ull * m.n_kv_heads * longest * im.L[cls].slot_stride >= 32768;
    // Pages in more than one move, and pages back after moves without them.
    std::vector<uint32_t> uses(n_pages, 0);
    std::vector<size_t> last(n_pages, SIZE_MAX);
    std::vector<bool> far(n_pages, false);
    for (size_t k = 0; k < hm.size(); ++k)
      for (const uint8_t* page : {hm[k].dst, hm[k].src}) {
        const size_t i = size_t(page - im.h(0)) / im.stride;
        ++uses[i];
        if (last[i] != SIZE_MAX && last[i] + 1 < k) far[i] = true;
        last[i] = k;
      }
    multi_pages += size_t(std::count_if(uses.begin(), uses.end(), [](uint32_t u) { return u > 1; }));
    far_pages += size_t(std::count(far.begin(), far.end(), true));
    total_moves += dm.size();
    most_moves = std::max<uint64_t>(most_moves, dm.size());
    kvgc::cpu::compact({im.L[cls], hm.data(), uint32_t(hm.size())});
    const uint64_t uploads = stage.uploads;
#ifdef KVGC_CUDA_EMU
    const uint64_t before = emu::launches;
#endif
    REQUIRE(kvgc::cuda::compact({im.L[cls], dm.data(), uint32_t(dm.size())}, stage, stream) == cudaSuccess);
    CHECK(stage.uploads - uploads == 1);  // one copy
#ifdef KVGC_CUDA_EMU
    CHECK(emu::launches - before == 1);  // one launch
#endif
    // The host array may be reused at once: scribbled over before the op has run.
    std::memset(static_cast<void*>(dm.data()), 0xA7, dm.size() * sizeof(dm[0]));
    im.require_same(stream);

    // No moves: nothing enqueued, nothing changed.
#ifdef KVGC_CUDA_EMU
    const uint64_t at = emu::launches;
#endif
    CHECK(kvgc::cuda::compact({im.L[cls], dm.data(), 0}, stage, stream) == cudaSuccess);
    CHECK(kvgc::cuda::compact({im.L[cls], nullptr, 0}, stage, stream) == cudaSuccess);
    CHECK(stage.uploads - uploads == 1);
#ifdef KVGC_CUDA_EMU
    CHECK(emu::launches == at);
#endif
    REQUIRE(cudaStreamSynchronize(stream) == cudaSuccess);
    CHECK(im.compare().empty());
  }
  CHECK(most_moves >= 2000);  // thousands of moves in one op
  CHECK(multi_pages > 2000);
  CHECK(far_pages > 1000);
  CHECK(blocks_shared);
  MESSAGE("compaction ops of up to " << most_moves << " moves, " << total_moves << " in all; "
          << multi_pages << " pages in several moves of an op, " << far_pages << " of them in moves apart");

  // Ops of every size, back to back through a ring of their own, each checked: later
  // ops take the ring's next bytes, wrap around (in bytes and in slots) and make it grow
  // (a large op after small ones). Pages are refilled every fifth op.
  kvgc::cuda::CompactStaging ring;
  const kvgc_model_desc m = model(1, 2, 32, KVGC_DTYPE_F16);
  const uint32_t pt = 16;
  const size_t n_pages = 1200;
  Images im(m, pt, n_pages);
  int cls = KVGC_CLASS_FP16;
  size_t first_bytes = 0;
  for (int op = 0; op < 160; ++op) {
    CAPTURE(op);
    if (op % 5 == 0) {
      cls = int(rng() % KVGC_CLASS_COUNT);
      for (size_t i = 0; i < n_pages; ++i)
        fill_page(im, i, cls, pt, double(rng() % 100) / 100, int32_t(i * pt), m, rng);
      im.upload();
    }
    std::vector<uint32_t> holes(n_pages), live(n_pages);
    for (size_t i = 0; i < n_pages; ++i) {
      const auto* lw = reinterpret_cast<const uint32_t*>(im.h(i) + im.L[cls].live_off);
      live[i] = uint32_t(std::popcount(lw[0] & 0xffffu));
      holes[i] = pt - live[i];
    }
    // Mostly small ops; every fifth (just refilled) up to 1,500 moves, op 150 3,000 of
    // one slot each.
    const uint32_t want = op == 150 ? 3000 : op % 5 == 0 ? 1500 : 1 + rng() % 40;
    const uint32_t cap = op == 150 ? 1 : 1 + rng() % pt;
    std::vector<kvgc::CompactMove> hm, dm;
    const bool flip = rng() % 2;  // destinations the first or the second half
    std::vector<uint32_t> h2 = holes, l2 = live;
    if (flip) {
      std::rotate(h2.begin(), h2.begin() + n_pages / 2, h2.end());
      std::rotate(l2.begin(), l2.begin() + n_pages / 2, l2.end());
    }
    for (auto [d, s, n] : random_moves(h2, l2, uint32_t(n_pages / 2), want, cap, rng)) {
      if (flip) d = uint32_t((d + n_pages / 2) % n_pages), s = uint32_t((s + n_pages / 2) % n_pages);
      im.add_move(hm, dm, d, s, n);
    }
    kvgc::cpu::compact({im.L[cls], hm.data(), uint32_t(hm.size())});
    REQUIRE(kvgc::cuda::compact({im.L[cls], dm.data(), uint32_t(dm.size())}, ring, stream) == cudaSuccess);
    if (op == 0) first_bytes = ring.bytes;
    if (op == 150) {
      CHECK(dm.size() == 3000);
      CHECK(ring.bytes > first_bytes);  // grew
    }
    im.require_same(stream);
  }
}

namespace {

// One random requant op over its own page images: n src pages of class `from` (random
// bytes; fp16 ones hold real model-dtype K/V with specials), then n dst pages poisoned
// with 0xAB; each page's used count full, partial or 0. The CPU's op on the host images,
// the CUDA op on the device copies; every byte of every page (src untouched, dst whole,
// the bytes of a dst stride past its class's page too) must agree.
std::string random_requant(const kvgc_model_desc& m, uint32_t pt, int from, int to, uint32_t n,
                           std::mt19937& rng, cudaStream_t stream, uint32_t used_counts[3]) {
  Images im(m, pt, 2 * size_t(n));
  std::vector<kvgc::RequantPage> hp(n), dp(n);
  const kvgc::PageLayout& Ls = im.L[from];
  const size_t eb = elem_bytes(m);
  for (uint32_t i = 0; i < n; ++i) {
    fill_page(im, i, from, pt, 1.0, int32_t(i * pt), m, rng);
    // fp16 pages: a few NaNs with payloads (quiet and signalling, both signs), which an
    // fp16 destination keeps bit for bit (the CPU copies the row) and quantisation ignores.
    for (uint32_t k = 0; from == KVGC_CLASS_FP16 && k < 4; ++k) {
      const size_t at = (rng() % 2 ? Ls.v_off : Ls.k_off) + rng() % Ls.n_kv_heads * Ls.head_stride +
                        rng() % pt * Ls.slot_stride + rng() % Ls.head_dim * eb;
      const uint32_t sign = rng() % 2, bits = uint32_t(rng());
      if (m.dtype == KVGC_DTYPE_F32) {
        const uint32_t x = sign << 31 | 0x7f800000u | (1 + bits % 0x7fffffu);
        std::memcpy(im.h(i) + at, &x, 4);
      } else {
        const uint16_t x = m.dtype == KVGC_DTYPE_F16 ? uint16_t(sign << 15 | 0x7c00u | (1 + bits % 0x3ffu))
                                                     : uint16_t(sign << 15 | 0x7f80u | (1 + bits % 0x7fu));
        std::memcpy(im.h(i) + at, &x, 2);
      }
    }
    std::memset(im.h(n + i), 0xAB, im.stride);
    const uint32_t kind = rng() % 3;
    const uint32_t used = kind == 0 ? pt : kind == 1 ? 1 + rng() % pt : 0;
    ++used_counts[used == pt ? 0 : used ? 1 : 2];
    hp[i] = {im.h(i), im.h(n + i), used};
    dp[i] = {im.d(i), im.d(n + i), used};
  }
  im.upload();
  kvgc::cpu::requant({im.L[from], im.L[to], hp.data(), n});
  REQUIRE(kvgc::cuda::requant({im.L[from], im.L[to], dp.data(), n}, stream) == cudaSuccess);
  REQUIRE(cudaStreamSynchronize(stream) == cudaSuccess);
  return im.compare();
}

}  // namespace

TEST_CASE("requant on CUDA equals the CPU op on random page images (fp16, int8, int4 to every cheaper class; full, partial and empty pages; several launch chunks)") {
  SeededStream fixture("test_cuda requant");
  std::mt19937& rng = fixture.rng;
  const cudaStream_t stream = fixture.stream;
  // head_dim 48 and 6: one int4/int2 group of the whole row (6: int4 rows of 3 bytes,
  // int2 rows of 2 with a padded last byte).
  const kvgc_model_desc models[] = {model(1, 2, 64, KVGC_DTYPE_F16), model(1, 2, 128, KVGC_DTYPE_BF16),
                                    model(1, 3, 48, KVGC_DTYPE_F32), model(1, 3, 6, KVGC_DTYPE_F16),
                                    model(1, 1, 32, KVGC_DTYPE_BF16)};
  uint32_t used_counts[3] = {};  // pages full, partial, empty
  uint32_t pairs[KVGC_CLASS_COUNT][KVGC_CLASS_COUNT] = {};
  for (int iter = 0; iter < 96; ++iter) {
    CAPTURE(iter);
    const kvgc_model_desc& m = models[iter % 5];
    const uint32_t pt = std::array<uint32_t, 3>{16, 37, 8}[rng() % 3];
    // Sources: fp16, int8, int4; destinations: the source's class or any cheaper one
    // (fp16 -> fp16 copies bits; a quantised source is never re-stored as fp16).
    const int from = std::array<int, 3>{KVGC_CLASS_FP16, KVGC_CLASS_INT8, KVGC_CLASS_INT4}[iter / 5 % 3];
    int to = 0;
    do to = int(rng() % KVGC_CLASS_COUNT);
    while (kvgc::class_rank(uint32_t(to)) < kvgc::class_rank(uint32_t(from)));
    const uint32_t n = rng() % 4 == 0 ? 17 + rng() % 24 : 1 + rng() % 16;  // both parameter blocks
    CAPTURE(m.head_dim);
    CAPTURE(pt);
    CAPTURE(from);
    CAPTURE(to);
    CAPTURE(n);
    const std::string diff = random_requant(m, pt, from, to, n, rng, stream, used_counts);
    INFO(diff);
    REQUIRE(diff.empty());
    ++pairs[from][to];
  }
  for (int from : {KVGC_CLASS_FP16, KVGC_CLASS_INT8})
    for (int to : {KVGC_CLASS_INT8, KVGC_CLASS_INT4, KVGC_CLASS_INT2}) {
      CAPTURE(from);
      CAPTURE(to);
      CHECK(pairs[from][to] > 0);
    }
  CHECK(pairs[KVGC_CLASS_FP16][KVGC_CLASS_FP16] > 0);
  CHECK(used_counts[0] > 0);
  CHECK(used_counts[1] > 0);
  CHECK(used_counts[2] > 0);
  // More pages than one launch's parameters hold (1024): several chunks, each zeroed and
  // re-stored in its own pair of launches.
  for (int to : {KVGC_CLASS_INT4, KVGC_CLASS_INT2}) {
    const uint32_t n = 1025 + rng() % 600;
    const std::string diff =
        random_requant(model(1, 1, 32, KVGC_DTYPE_F16), 8, KVGC_CLASS_FP16, to, n, rng, stream, used_counts);
    INFO(diff);
    REQUIRE(diff.empty());
  }
}

TEST_CASE("requant on CUDA: malformed ops are refused before anything is enqueued; the backends agree with the CPU") {
  const kvgc_model_desc m = model(1, 2, 64);
  Images im(m, 16, 4);
  const kvgc::PageLayout &L16 = im.L[KVGC_CLASS_FP16], &L4 = im.L[KVGC_CLASS_INT4];
  const kvgc::PageLayout L4b = kvgc::PageLayout::make(8, 2, 64, KVGC_DTYPE_F16, KVGC_CLASS_INT4);
  std::mt19937 rng(kvgc_test::fresh_seed("test_cuda requant refusals"));
  fill_page(im, 0, KVGC_CLASS_FP16, 16, 1.0, 0, m, rng);
  fill_page(im, 1, KVGC_CLASS_FP16, 16, 1.0, 16, m, rng);
  std::memset(im.h(2), 0xAB, 2 * im.stride);
  im.upload();
  auto requant = [&](const kvgc::PageLayout& Ld, std::vector<kvgc::RequantPage> pages) {
    return kvgc::cuda::requant({L16, Ld, pages.data(), uint32_t(pages.size())}, nullptr);
  };
  CHECK(requant(L4, {}) == cudaSuccess);
  CHECK(requant(L4, {{nullptr, im.d(2), 1}}) == cudaErrorInvalidValue);
  CHECK(requant(L4, {{im.d(0), nullptr, 1}}) == cudaErrorInvalidValue);
  CHECK(requant(L4, {{im.d(0), im.d(2), 17}}) == cudaErrorInvalidValue);
  CHECK(requant(L4, {{im.d(0), im.d(2) + 8, 1}}) == cudaErrorInvalidValue);  // dst misaligned
  CHECK(requant(L4b, {{im.d(0), im.d(2), 1}}) == cudaErrorInvalidValue);     // page_tokens differ
  CHECK(requant(L4, {{im.d(0), im.d(2), 16}, {im.d(1), im.d(3), 17}}) == cudaErrorInvalidValue);
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  CHECK(im.compare().empty());  // nothing was written

  // Through the backend: the refusal as KVGC_EINVAL, then a real op equal to the CPU's.
  std::unique_ptr<kvgc::Backend> backend;
  REQUIRE(kvgc::make_cuda_backend(0, &backend).ok());
  const kvgc::RequantPage bad{im.d(0), im.d(2), 17};
  const kvgc::Status st = backend->requant({L16, L4, &bad, 1}, nullptr);
  CHECK(st.code == KVGC_EINVAL);
  CHECK(st.msg.find("requant") != std::string::npos);
  const kvgc::RequantPage hp[] = {{im.h(0), im.h(2), 16}, {im.h(1), im.h(3), 5}};
  const kvgc::RequantPage dp[] = {{im.d(0), im.d(2), 16}, {im.d(1), im.d(3), 5}};
  kvgc::cpu::requant({L16, L4, hp, 2});
  REQUIRE(backend->requant({L16, L4, dp, 2}, nullptr).ok());
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  const std::string diff = im.compare();
  INFO(diff);
  CHECK(diff.empty());
}

TEST_CASE("observe and compact on CUDA: bad input fails cleanly as on the CPU; the device stays usable") {
  const kvgc_model_desc m = model(1, 2, 64);
  kvgc_heap_options o = cpu_options(8 << 20);
  o.policy = KVGC_POLICY_H2O;
  o.token_budget = 16;
  o.sinks = 4;
  o.window = 8;
  kvgc_heap* h = make_heap(m, KVGC_DEVICE_CUDA, 16, 0, &o);
  kvgc_seq s;
  REQUIRE(kvgc_seq_create(h, 0, &s) == KVGC_OK);
  DeviceBuffer d(40 * token_bytes(m)), mass(64 * 4);
  REQUIRE(cudaMemset(d.p, 0, 40 * token_bytes(m)) == cudaSuccess);
  REQUIRE(cudaMemset(mass.p, 0, 64 * 4) == cudaSuccess);
  REQUIRE(kvgc_append(h, s, 0, d.p, d.p, 10, nullptr) == KVGC_OK);
  const kvgc_stats before = get_stats(h);
  std::vector<float> host_mass(10, 1.f);
  CHECK(kvgc_observe(h, s, 0, mass.get<float>(), 9, nullptr) == KVGC_EINVAL);
  CHECK(std::string(kvgc_errmsg(h)).find("live count 10") != std::string::npos);
  CHECK(kvgc_observe(h, s, 0, nullptr, 10, nullptr) == KVGC_EINVAL);
  CHECK(kvgc_observe(h, s, 0, host_mass.data(), 10, nullptr) == KVGC_EINVAL);
  CHECK(std::string(kvgc_errmsg(h)).find("host memory") != std::string::npos);
  CHECK(kvgc_observe(h, s, 0, reinterpret_cast<const float*>(mass.get(2)), 10, nullptr) == KVGC_EINVAL);
  CHECK(std::string(kvgc_errmsg(h)).find("aligned") != std::string::npos);
  CHECK(kvgc_observe(h, s, 3, mass.get<float>(), 10, nullptr) == KVGC_EINVAL);
  CHECK(kvgc_observe(h, s + 1, 0, mass.get<float>(), 10, nullptr) == KVGC_ENOTFOUND);
  const kvgc_stats after = get_stats(h);
  CHECK(std::memcmp(&before, &after, sizeof before) == 0);  // nothing changed

  // Malformed compaction ops are refused before anything is enqueued.
  const kvgc::PageLayout L = kvgc::PageLayout::make(16, 2, 64, KVGC_DTYPE_F16, KVGC_CLASS_FP16);
  DeviceBuffer pages(3 * L.bytes);
  uint8_t* p0 = pages.get();
  uint8_t* p1 = pages.get(L.bytes);
  uint8_t* p2 = pages.get(2 * L.bytes);
  auto compact = [&](std::vector<kvgc::CompactMove> mv) {
    return kvgc::cuda::compact({L, mv.data(), uint32_t(mv.size())}, nullptr);
  };
  CHECK(compact({}) == cudaSuccess);
  CHECK(compact({{nullptr, p1, 1}}) == cudaErrorInvalidValue);
  CHECK(compact({{p0, p0, 1}}) == cudaErrorInvalidValue);
  CHECK(compact({{p0, p1, 17}}) == cudaErrorInvalidValue);
  CHECK(compact({{p0, p1, 0}}) == cudaErrorInvalidValue);
  CHECK(compact({{p0, p1, 1}, {p1, p2, 1}}) == cudaErrorInvalidValue);  // p1 both roles
  CHECK(compact({{p0, p2, 9}, {p1, p2, 8}}) == cudaErrorInvalidValue);  // 17 slots out of p2
  std::unique_ptr<kvgc::Backend> backend;
  REQUIRE(kvgc::make_cuda_backend(0, &backend).ok());
  const kvgc::CompactMove bad{p0, p0, 1};
  const kvgc::Status st = backend->compact({L, &bad, 1}, nullptr);
  CHECK(st.code == KVGC_EINVAL);
  CHECK(st.msg.find("compaction") != std::string::npos);

  // The device and the heap are fine: a real observe, GC step and compaction.
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  REQUIRE(kvgc_append(h, s, 0, d.p, d.p, 30, nullptr) == KVGC_OK);
  REQUIRE(kvgc_observe(h, s, 0, mass.get<float>(), 40, nullptr) == KVGC_OK);
  CHECK(kvgc_step(h, s, nullptr) == KVGC_OK);
  uint64_t live = 0;
  REQUIRE(kvgc_seq_tokens(h, s, 0, &live, nullptr) == KVGC_OK);
  CHECK(live == 16);
  CHECK(get_stats(h).tokens_evicted == 24);
  REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
  require_check(h);
  kvgc_heap_destroy(h);
}

TEST_CASE("evacuation on a CUDA heap moves pages as on a CPU heap (header slabs emptied for fp16, shared pages and prefixes for headers)") {
  // The same ops on a CPU heap and a CUDA heap of the same geometry: forks strand header
  // pages in a quarter-used slab each, cached prefixes leave shared fp16 pages among holes;
  // then appends need fp16 slabs (header slabs are evacuated) and forks need header pages
  // (fp16 slabs with the prefixes' shared pages are). Both heaps evacuate; every
  // sequence's rows, and every prefix attached afresh, read back alike and as before.
  cudaStream_t stream;
  REQUIRE(cudaStreamCreate(&stream) == cudaSuccess);
  const kvgc_model_desc m = model(2, 2, 32, KVGC_DTYPE_F16);
  kvgc_heap_options o = cpu_options(1 << 20, 16);
  o.policy = KVGC_POLICY_FULL;
  kvgc_heap* h[2] = {make_heap(m, KVGC_DEVICE_CPU, 16, 0, &o), nullptr};
  // The CUDA heap's arena ends in its scratch and batch tables: a budget that leaves
  // it at least the CPU heap's pages (the ops below go by counts, not by geometry).
  for (uint64_t budget = o.budget_bytes; !h[1];) {
    kvgc_heap_options g = o;
    g.device = KVGC_DEVICE_CUDA;
    g.budget_bytes = budget;
    if (kvgc_heap_create(&m, &g, &h[1]) != KVGC_OK) {
      REQUIRE(budget < (uint64_t(1) << 32));
      budget *= 2;
      continue;
    }
    const kvgc_stats st = get_stats(h[1]);
    if (st.arena_bytes - st.scratch_bytes < o.budget_bytes) {
      kvgc_heap_destroy(h[1]);
      h[1] = nullptr;
      budget += o.budget_bytes - (st.arena_bytes - st.scratch_bytes);
    }
  }
  auto append = [&](int d, kvgc_seq s, uint32_t l, int64_t at, uint32_t n, uint64_t tag) {
    const auto k = gaussian(m, tag, l, at, n, false), v = gaussian(m, tag, l, at, n, true);
    if (d == 0) return kvgc_append(h[0], s, l, k.data(), v.data(), n, nullptr);
    DeviceBuffer dk(k.size()), dv(v.size());
    REQUIRE(cudaMemcpy(dk.p, k.data(), k.size(), cudaMemcpyHostToDevice) == cudaSuccess);
    REQUIRE(cudaMemcpy(dv.p, v.data(), v.size(), cudaMemcpyHostToDevice) == cudaSuccess);
    const kvgc_status st = kvgc_append(h[1], s, l, dk.p, dv.p, n, stream);
    REQUIRE(cudaStreamSynchronize(stream) == cudaSuccess);
    return st;
  };
  auto rows = [&](int d, kvgc_seq s, uint32_t l) {
    return d == 0 ? read_cpu(h[0], s, l, m) : read_gpu(h[1], s, l, m, stream);
  };
  std::vector<kvgc_seq> kept[2], keepers[2];
  std::vector<std::vector<int32_t>> prompts;
  std::vector<Rows> before;  // the CPU heap's, before any evacuation
  for (int d = 0; d < 2; ++d) {
    CAPTURE(d);
    kvgc_heap* H = h[d];
    // Prefixes among holes in the fp16 slabs.
    std::vector<kvgc_seq> fillers;
    for (int i = 0; i < 8; ++i) {
      kvgc_seq s, f;
      REQUIRE(kvgc_seq_create(H, 0, &s) == KVGC_OK);
      for (uint32_t l = 0; l < 2; ++l) REQUIRE(append(d, s, l, 0, 40, 100 + i) == KVGC_OK);
      std::vector<int32_t> ids(40);
      for (int j = 0; j < 40; ++j) ids[j] = 1000 * (i + 1) + j;
      kvgc_prefix p;
      REQUIRE(kvgc_prefix_keep(H, s, ids.data(), ids.size(), 0, 0, &p, d ? stream : nullptr) == KVGC_OK);
      if (d == 0) prompts.push_back(ids);
      keepers[d].push_back(s);
      REQUIRE(kvgc_seq_create(H, 0, &f) == KVGC_OK);
      for (uint32_t l = 0; l < 2; ++l) REQUIRE(append(d, f, l, 0, 48, 200 + i) == KVGC_OK);
      fillers.push_back(f);
    }
    for (kvgc_seq f : fillers) REQUIRE(kvgc_seq_destroy(H, f) == KVGC_OK);
    for (kvgc_seq s : keepers[d]) REQUIRE(kvgc_seq_destroy(H, s) == KVGC_OK);
    // Forks of a: header slabs a quarter used.
    kvgc_seq a;
    REQUIRE(kvgc_seq_create(H, 0, &a) == KVGC_OK);
    for (uint32_t l = 0; l < 2; ++l) REQUIRE(append(d, a, l, 0, 64, 7) == KVGC_OK);
    std::vector<kvgc_seq> forks;
    while (get_stats(H).cls_header.slabs < 3) {
      kvgc_seq f;
      REQUIRE(kvgc_seq_fork(H, a, 0, &f, d ? stream : nullptr) == KVGC_OK);
      forks.push_back(f);
    }
    kept[d].push_back(a);
    for (size_t i = 0; i < forks.size(); ++i) {
      if (i % 4 == 0) kept[d].push_back(forks[i]);
      else REQUIRE(kvgc_seq_destroy(H, forks[i]) == KVGC_OK);
    }
    require_check(H);
    REQUIRE(get_stats(H).slabs_evacuated == 0);
    if (d == 0)
      for (kvgc_seq s : kept[0])
        for (uint32_t l = 0; l < 2; ++l) before.push_back(rows(0, s, l));
    // b appends fp16 pages past the free slabs: header slabs are evacuated (before any
    // prefix is evicted).
    kvgc_seq b;
    REQUIRE(kvgc_seq_create(H, 0, &b) == KVGC_OK);
    int64_t length[2] = {0, 0};
    for (uint32_t l = 0; get_stats(H).slabs_evacuated == 0; l ^= 1) {
      REQUIRE(append(d, b, l, length[l], 16, 9) == KVGC_OK);
      length[l] += 16;
    }
    const uint64_t after_appends = get_stats(H).slabs_evacuated;
    CHECK(get_stats(H).prefix_evictions == 0);
    REQUIRE(kvgc_seq_destroy(H, b) == KVGC_OK);
    // Forks until one evacuates fp16 slabs (the prefixes' shared pages move).
    kvgc_stats st = get_stats(H);
    for (int n = 0; st.slabs_evacuated == after_appends; ++n) {
      kvgc_seq f;
      REQUIRE(n < 100000);
      REQUIRE(kvgc_seq_fork(H, a, 0, &f, d ? stream : nullptr) == KVGC_OK);
      st = get_stats(H);
    }
    CHECK(st.prefix_evictions == 0);
    require_check(H);
  }
  // Every kept sequence reads back alike on both heaps, and as before.
  size_t i = 0;
  for (size_t j = 0; j < kept[0].size(); ++j)
    for (uint32_t l = 0; l < 2; ++l) {
      CAPTURE(j);
      const Rows c = rows(0, kept[0][j], l), g = rows(1, kept[1][j], l);
      CHECK(compare_rows(c, g, m) == "");
      CHECK(compare_rows(before[i++], c, m) == "");
    }
  // Every prefix attaches afresh and reads back its keeper's K/V.
  for (size_t p = 0; p < prompts.size(); ++p) {
    CAPTURE(p);
    Rows got[2];
    for (int d = 0; d < 2; ++d) {
      kvgc_seq t;
      REQUIRE(kvgc_seq_create(h[d], 0, &t) == KVGC_OK);
      uint64_t n = 0;
      REQUIRE(kvgc_prefix_attach(h[d], t, prompts[p].data(), prompts[p].size(), 0, &n,
                                 d ? stream : nullptr) == KVGC_OK);
      CHECK(n == 40);
      got[d] = rows(d, t, 1);
      REQUIRE(kvgc_seq_destroy(h[d], t) == KVGC_OK);
    }
    CHECK(compare_rows(got[0], got[1], m) == "");
    const auto k = gaussian(m, 100 + p, 1, 0, 40, false);
    CHECK(got[0].k == k);
  }
  kvgc_heap_destroy(h[0]);
  kvgc_heap_destroy(h[1]);
  cudaStreamDestroy(stream);
}
