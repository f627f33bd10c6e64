// The CUDA executor's batch ops against the CPU specification, at the executor level
// (the ops of kernels/ops.hpp on pages built by hand): batched attention over random
// batches (decode rows and prefill chunks, empty sequences, evicted slots, FP16/INT8/INT4
// pages, GQA 1/4/8, with and without device-side tables, scratch tight enough for many
// passes, chunks that score only their last rows), append with per-run position deltas and device-side runs (pages byte for
// byte), observe by slot; attention, gather and select over shared pages (SegPage::kv:
// a header alone, the K/V on another page). Fresh random inputs (seeds printed), CUDA
// outputs poisoned.
#include <cuda_runtime.h>
#include <doctest/doctest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>

#include "../gc/ladder.hpp"
#include "../kernels/cpu/attend.hpp"
#include "../kernels/cpu/copy.hpp"
#include "../kernels/cpu/gc.hpp"
#include "../kernels/cpu/quant.hpp"
#include "../kernels/cuda/attend.cuh"
#include "../kernels/cuda/copy.cuh"
#include "../kernels/cuda/gc.cuh"
#include "cuda_util.hpp"

using namespace kvgc_test;
using kvgc::AttendSeq;
using kvgc::PageLayout;
using kvgc::SegPage;

namespace {

// Random f16 K, V and Q rows (standard normal) on the host, and copies on the device.
struct F16Rows {
  std::vector<uint16_t> k, v, q;
  DeviceBuffer dk, dv, dq;
  F16Rows(std::mt19937& rng, size_t kv_elems, size_t q_elems)
      : k(kv_elems), v(kv_elems), q(q_elems), dk(kv_elems * 2), dv(kv_elems * 2), dq(q_elems * 2) {
    std::normal_distribution<float> g(0.f, 1.f);
    for (auto* a : {&k, &v, &q})
      for (auto& x : *a) kvgc::cpu::store(reinterpret_cast<uint8_t*>(&x), KVGC_DTYPE_F16, g(rng));
    REQUIRE(cudaMemcpy(dk.p, k.data(), k.size() * 2, cudaMemcpyHostToDevice) == cudaSuccess);
    REQUIRE(cudaMemcpy(dv.p, v.data(), v.size() * 2, cudaMemcpyHostToDevice) == cudaSuccess);
    REQUIRE(cudaMemcpy(dq.p, q.data(), q.size() * 2, cudaMemcpyHostToDevice) == cudaSuccess);
  }
};

// An arena of pages mirrored on the host and the device: the CPU runs on the host copy,
// CUDA on the device copy, and the two are compared after.
struct Arena {
  PageLayout L[KVGC_CLASS_COUNT];
  size_t page_bytes = 0;  // a slot's size: the largest class
  uint32_t n = 0;
  std::vector<uint8_t> host;
  DeviceBuffer dev;
  Arena(const PageLayout (&layouts)[KVGC_CLASS_COUNT], uint32_t pages)
      : page_bytes(std::max({layouts[0].bytes, layouts[1].bytes, layouts[2].bytes})), n(pages),
        host(page_bytes * pages), dev(page_bytes * pages) {
    for (int c = 0; c < KVGC_CLASS_COUNT; ++c) L[c] = layouts[c];
  }
  uint8_t* h(uint32_t i) { return host.data() + size_t(i) * page_bytes; }
  uint8_t* d(uint32_t i) { return dev.get(size_t(i) * page_bytes); }
  void upload() { REQUIRE(cudaMemcpy(dev.p, host.data(), host.size(), cudaMemcpyHostToDevice) == cudaSuccess); }
  std::vector<uint8_t> download() {
    std::vector<uint8_t> out(host.size());
    REQUIRE(cudaMemcpy(out.data(), dev.p, out.size(), cudaMemcpyDeviceToHost) == cudaSuccess);
    return out;
  }
};

void layouts(uint32_t pt, uint32_t kv, uint32_t hd, kvgc_dtype dt, PageLayout (&L)[KVGC_CLASS_COUNT]) {
  for (int c = 0; c < KVGC_CLASS_COUNT; ++c) L[c] = PageLayout::make(pt, kv, hd, dt, kvgc_storage_class(c));
}

// Fills page `i` of class cls with `live` random live slots (the rest evicted), positions
// from *pos on, random scores; returns the live count.
uint32_t fill_page(Arena& a, uint32_t i, uint32_t cls, double evict, int32_t* pos, std::mt19937& rng) {
  const PageLayout& L = a.L[cls];
  uint8_t* page = a.h(i);
  std::memset(page, 0, a.page_bytes);
  std::normal_distribution<float> gauss(0.f, 1.f);
  std::uniform_real_distribution<float> uni(0.f, 2.f);
  const size_t eb = kvgc::dtype_bytes(L.dtype);
  std::vector<uint8_t> row(L.head_dim * eb);
  auto* live = reinterpret_cast<uint32_t*>(page + L.live_off);
  uint32_t n = 0;
  for (uint32_t s = 0; s < L.page_tokens; ++s) {
    const int32_t p = (*pos)++;
    if (std::uniform_real_distribution<double>(0, 1)(rng) < evict) continue;
    live[s / 32] |= 1u << (s % 32);
    reinterpret_cast<int32_t*>(page + L.pos_off)[s] = p;
    reinterpret_cast<float*>(page + L.score_off)[s] = uni(rng);
    reinterpret_cast<float*>(page + L.recent_off)[s] = uni(rng);
    page[L.gen_off + s] = kvgc::kGenYoung;
    for (uint32_t h = 0; h < L.n_kv_heads; ++h)
      for (int v = 0; v < 2; ++v) {
        for (uint32_t d = 0; d < L.head_dim; ++d) kvgc::cpu::store(&row[d * eb], L.dtype, 1.5f * gauss(rng));
        kvgc::cpu::store_row(L, page, h, s, v, row.data());
      }
    ++n;
  }
  return n;
}

struct Batch {
  std::vector<SegPage> host_pages, dev_pages;  // the same pages, host and device addresses
  std::vector<AttendSeq> seqs;
  uint32_t rows = 0;  // query rows of the batch
};

// A random batch: per sequence a length (1 to max_len tokens, or none), decode (one
// query) or a prefill chunk (its last n_q positions), or no queries at all.
Batch random_batch(Arena& a, uint32_t n_seqs, uint32_t max_len, std::mt19937& rng) {
  Batch b;
  const uint32_t pt = a.L[0].page_tokens;
  uint32_t next_page = 0;
  for (uint32_t i = 0; i < n_seqs; ++i) {
    const uint32_t kind = rng() % 8;
    uint32_t len = kind == 0 ? 0 : 1 + rng() % max_len;
    uint32_t pages = (len + pt - 1) / pt;
    if (next_page + pages > a.n) pages = a.n - next_page, len = pages * pt;
    AttendSeq s{};
    s.first_page = uint32_t(b.host_pages.size());
    s.n_pages = pages;
    int32_t pos = 0;
    const double evict = rng() % 3 == 0 ? 0.0 : 0.3;
    for (uint32_t p = 0; p < pages; ++p) {
      // FP16, then INT8, INT4 and INT2 pages (a demoted sequence's).
      const uint32_t cls = p < pages / 2           ? KVGC_CLASS_FP16
                           : p < 5 * pages / 8 ? KVGC_CLASS_INT8
                           : p < 7 * pages / 8 ? KVGC_CLASS_INT4
                                               : KVGC_CLASS_INT2;
      const uint32_t c = rng() % 4 ? cls : uint32_t(KVGC_CLASS_FP16);
      const uint32_t live = fill_page(a, next_page, c, evict, &pos, rng);
      b.host_pages.push_back({a.h(next_page), c, s.n_live});
      b.dev_pages.push_back({a.d(next_page), c, s.n_live});
      s.n_live += live;
      ++next_page;
    }
    s.n_q = kind == 1 ? 0 : kind <= 4 ? 1 : 1 + rng() % 24;
    s.q_pos0 = int64_t(pos) - s.n_q + (rng() % 3 == 0 ? int64_t(rng() % 5) - 2 : 0);
    s.q_row = b.rows;
    s.recent_decay = rng() % 2 ? 1.0f : 0.5f + 0.4f * float(rng() % 100) / 100.f;
    // kvgc_batch_plan_ex's scored rows: only queries from score_from on add mass (and the
    // decay), the earlier ones attend as KVGC_ATTEND_NO_SCORES; n_q: none scores.
    if (s.n_q > 1 && rng() % 3 == 0) s.score_from = 1 + rng() % s.n_q;
    b.rows += s.n_q;
    b.seqs.push_back(s);
  }
  return b;
}

}  // namespace

TEST_CASE("batched attention on CUDA equals the CPU per sequence (random batches, classes, GQA, tables, passes)") {
  std::mt19937 rng(kvgc_test::fresh_seed("test_cuda_batch attend"));
  struct Shape { uint32_t kv_heads, gqa, head_dim, page_tokens; kvgc_dtype dtype; uint32_t seqs, max_len; };
  const Shape shapes[] = {{2, 4, 64, 16, KVGC_DTYPE_F16, 12, 700},  {1, 1, 128, 32, KVGC_DTYPE_F32, 9, 300},
                          {2, 8, 64, 16, KVGC_DTYPE_BF16, 7, 400},  {4, 1, 32, 48, KVGC_DTYPE_F16, 20, 120},
                          {1, 4, 64, 16, KVGC_DTYPE_F16, 3, 3000}, {2, 4, 64, 32, KVGC_DTYPE_F16, 2, 20000}};
  cudaStream_t stream;
  REQUIRE(cudaStreamCreate(&stream) == cudaSuccess);
  int round = 0;
  for (const Shape& sh : shapes) {
    CAPTURE(sh.head_dim);
    CAPTURE(sh.gqa);
    CAPTURE(sh.dtype);
    PageLayout L[KVGC_CLASS_COUNT];
    layouts(sh.page_tokens, sh.kv_heads, sh.head_dim, sh.dtype, L);
    const uint32_t max_pages = sh.seqs * ((sh.max_len + sh.page_tokens - 1) / sh.page_tokens);
    Arena a(L, max_pages);
    for (int rep = 0; rep < 2; ++rep, ++round) {
      Batch b = random_batch(a, sh.seqs, sh.max_len, rng);
      a.upload();
      const uint32_t q_heads = sh.kv_heads * sh.gqa;
      const size_t eb = kvgc::dtype_bytes(sh.dtype), qn = size_t(b.rows) * q_heads * sh.head_dim;
      std::vector<uint8_t> q(qn * eb), out_cpu(qn * eb, 0xCD);
      std::normal_distribution<float> gauss(0.f, 1.f);
      for (size_t i = 0; i < qn; ++i) kvgc::cpu::store(&q[i * eb], sh.dtype, 2.f * gauss(rng));
      kvgc::AttendOp op{};
      for (int c = 0; c < KVGC_CLASS_COUNT; ++c) op.layout[c] = L[c];
      op.pages = b.host_pages.data();
      op.n_pages = uint32_t(b.host_pages.size());
      op.q = q.data();
      op.q_heads = q_heads;
      op.scale = 1.f / std::sqrt(float(sh.head_dim));
      op.out = out_cpu.data();
      op.add_scores = true;
      op.seqs = b.seqs.data();
      op.n_seqs = uint32_t(b.seqs.size());
      kvgc::cpu::attend(op);

      DeviceBuffer dq(q.size()), dout(q.size()), dpages(b.dev_pages.size() * sizeof(SegPage)),
          dseqs(b.seqs.size() * sizeof(AttendSeq));
      REQUIRE(cudaMemcpy(dq.p, q.data(), q.size(), cudaMemcpyHostToDevice) == cudaSuccess);
      REQUIRE(cudaMemset(dout.p, 0xA5, q.size()) == cudaSuccess);  // poison
      kvgc::AttendOp gop = op;
      gop.pages = b.dev_pages.data();
      gop.q = dq.p;
      gop.out = dout.p;
      const bool tables = round % 2 == 1;
      CAPTURE(tables);
      if (tables) {  // the plan's device-side copies
        REQUIRE(cudaMemcpy(dpages.p, b.dev_pages.data(), b.dev_pages.size() * sizeof(SegPage), cudaMemcpyHostToDevice) == cudaSuccess);
        REQUIRE(cudaMemcpy(dseqs.p, b.seqs.data(), b.seqs.size() * sizeof(AttendSeq), cudaMemcpyHostToDevice) == cudaSuccess);
        gop.dev_pages = dpages.get<SegPage>();
        gop.dev_seqs = dseqs.get<AttendSeq>();
      }
      // The heap's scratch, or one just big enough for one query at a time (many passes).
      size_t scratch = kvgc::cuda::attend_scratch_bytes(uint64_t(max_pages) * sh.page_tokens, q_heads,
                                                         sh.head_dim, sh.page_tokens);
      const int mode = round % 3;
      CAPTURE(mode);
      if (mode == 1) scratch = kvgc::cuda::attend_min_scratch_bytes(gop, 1 + rng() % 8);
      DeviceBuffer ds(scratch);
      const int n_sm = mode == 2 ? 1 : 132;
      REQUIRE(kvgc::cuda::attend(gop, ds.p, scratch, n_sm, stream) == cudaSuccess);
      REQUIRE(cudaStreamSynchronize(stream) == cudaSuccess);
      std::vector<uint8_t> out_gpu(q.size());
      REQUIRE(cudaMemcpy(out_gpu.data(), dout.p, q.size(), cudaMemcpyDeviceToHost) == cudaSuccess);
      const double bound = kvgc_test::output_bound(sh.dtype);
      // Sequence by sequence: each is what the op over it alone computes.
      for (uint32_t i = 0; i < op.n_seqs; ++i) {
        const AttendSeq& s = b.seqs[i];
        CAPTURE(i);
        CAPTURE(s.n_pages);
        CAPTURE(s.n_q);
        const size_t off = size_t(s.q_row) * q_heads * sh.head_dim * eb, len = size_t(s.n_q) * q_heads * sh.head_dim;
        const std::vector<uint8_t> c(out_cpu.begin() + off, out_cpu.begin() + off + len * eb),
            g(out_gpu.begin() + off, out_gpu.begin() + off + len * eb);
        const double e = rel_rms(c, g, len, sh.dtype);
        if (std::isnan(e)) CHECK(c == g);  // all zeros (sees nothing): exactly zeros
        else CHECK(e <= bound);
      }
      // Scores and recent scores, slot by slot (the evicted ones untouched).
      const std::vector<uint8_t> dev = a.download();
      double se = 0, sr = 0;
      size_t mismatched_meta = 0;
      for (uint32_t pi = 0; pi < op.n_pages; ++pi) {
        const uint32_t cls = b.host_pages[pi].cls;
        const PageLayout& Lc = L[cls];
        const uint8_t* hp = b.host_pages[pi].page;
        const uint8_t* gp = dev.data() + (hp - a.host.data());
        for (uint32_t s = 0; s < Lc.page_tokens; ++s)
          for (size_t off : {Lc.score_off, Lc.recent_off}) {
            const float x = reinterpret_cast<const float*>(hp + off)[s], y = reinterpret_cast<const float*>(gp + off)[s];
            se += double(x - y) * (x - y);
            sr += double(x) * x;
          }
        // Nothing but scores changes.
        if (std::memcmp(hp, gp, Lc.score_off) || std::memcmp(hp + Lc.gen_off, gp + Lc.gen_off, Lc.bytes - Lc.gen_off))
          ++mismatched_meta;
      }
      CHECK(mismatched_meta == 0);
      // bf16: the CPU reads INT8/INT4 rows through the model dtype's rounding, CUDA in f32.
      CHECK(std::sqrt(se / std::max(sr, 1e-30)) <= (sh.dtype == KVGC_DTYPE_BF16 ? 2e-3 : 1e-4));
    }
  }
  cudaStreamDestroy(stream);
}

TEST_CASE("append on CUDA with per-run position deltas and device-side runs equals the CPU byte for byte") {
  std::mt19937 rng(kvgc_test::fresh_seed("test_cuda_batch append"));
  struct Shape { uint32_t kv_heads, head_dim, page_tokens; kvgc_dtype dtype; uint32_t segs, max_len; };
  const Shape shapes[] = {{2, 64, 16, KVGC_DTYPE_F16, 40, 90}, {1, 6, 3, KVGC_DTYPE_BF16, 400, 12},
                          {3, 32, 33, KVGC_DTYPE_F32, 9, 200}};
  cudaStream_t stream;
  REQUIRE(cudaStreamCreate(&stream) == cudaSuccess);
  for (const Shape& sh : shapes) {
    CAPTURE(sh.page_tokens);
    PageLayout L[KVGC_CLASS_COUNT];
    layouts(sh.page_tokens, sh.kv_heads, sh.head_dim, sh.dtype, L);
    const uint32_t per_seg = (sh.max_len + sh.page_tokens - 1) / sh.page_tokens + 1;
    Arena a(L, 2 * sh.segs * per_seg);
    for (auto& x : a.host) x = uint8_t(rng());  // a recycled arena's bytes: scrubbed by fresh runs
    a.upload();
    const size_t tb = size_t(sh.kv_heads) * sh.head_dim * kvgc::dtype_bytes(sh.dtype);
    // Per segment: its last page and the slots it has filled (for op 2's continuing runs).
    std::vector<uint32_t> last_page(sh.segs), filled(sh.segs, 0);
    std::vector<int64_t> next_pos(sh.segs, 0);
    uint32_t next_page = 0;
    for (int step = 0; step < 2; ++step) {
      CAPTURE(step);
      std::vector<kvgc::AppendRun> hr, dr;
      uint32_t rows = 0;
      for (uint32_t j = 0; j < sh.segs; ++j) {
        uint32_t n = 1 + rng() % sh.max_len;
        if (rng() % 5 == 0) n = 1;  // decode rows
        const uint32_t first_row = rows;
        // Positions: the segment's next position for batch row first_row.
        if (step == 0) next_pos[j] = int64_t(rng() % 100000) - 50;
        const int32_t delta = int32_t(next_pos[j] - first_row);
        for (uint32_t t = 0; t < n;) {
          uint32_t page, slot;
          if (step == 1 && t == 0 && filled[j] % sh.page_tokens != 0) {
            page = last_page[j], slot = filled[j] % sh.page_tokens;  // continues its page
          } else {
            page = next_page++, slot = 0;
          }
          const uint32_t c = std::min(n - t, sh.page_tokens - slot);
          hr.push_back({a.h(page), slot, c, rows + t, delta});
          dr.push_back({a.d(page), slot, c, rows + t, delta});
          last_page[j] = page;
          filled[j] = slot + c;
          t += c;
        }
        next_pos[j] += n;
        rows += n;
      }
      std::vector<uint8_t> k(rows * tb), v(rows * tb);
      for (auto& x : k) x = uint8_t(rng());
      for (auto& x : v) x = uint8_t(rng());
      DeviceBuffer dk(k.size()), dv(v.size()), druns(dr.size() * sizeof(kvgc::AppendRun));
      REQUIRE(cudaMemcpy(dk.p, k.data(), k.size(), cudaMemcpyHostToDevice) == cudaSuccess);
      REQUIRE(cudaMemcpy(dv.p, v.data(), v.size(), cudaMemcpyHostToDevice) == cudaSuccess);
      kvgc::AppendOp op{L[0], k.data(), v.data(), 0, 4, hr.data(), uint32_t(hr.size())};
      kvgc::cpu::append(op);
      kvgc::AppendOp gop{L[0], dk.p, dv.p, 0, 4, dr.data(), uint32_t(dr.size())};
      const int mode = int(rng() % 3);  // 0: runs as parameters; 1, 2: device runs (2: no host copy)
      CAPTURE(mode);
      CAPTURE(dr.size());
      if (mode) {
        REQUIRE(cudaMemcpy(druns.p, dr.data(), dr.size() * sizeof(kvgc::AppendRun), cudaMemcpyHostToDevice) == cudaSuccess);
        gop.dev_runs = druns.get<kvgc::AppendRun>();
        if (mode == 2) gop.runs = nullptr;
      }
#ifdef KVGC_CUDA_EMU
      const uint64_t before = emu::launches;
#endif
      REQUIRE(kvgc::cuda::append(gop, stream) == cudaSuccess);
#ifdef KVGC_CUDA_EMU
      if (mode) CHECK(emu::launches - before == 1);  // one launch for any number of runs
#endif
      REQUIRE(cudaStreamSynchronize(stream) == cudaSuccess);
      const std::vector<uint8_t> dev = a.download();
      CHECK(dev == a.host);
      // The positions themselves (a delta ignored would still agree if both ignored it).
      const kvgc::AppendRun& r = hr[hr.size() / 2];
      CHECK(reinterpret_cast<const int32_t*>(r.page + L[0].pos_off)[r.first_slot] ==
            int32_t(int64_t(r.src_token) + r.pos_delta));
    }
  }
  cudaStreamDestroy(stream);
}

TEST_CASE("observe on CUDA by slot and with device-side pages equals the CPU bit for bit") {
  std::mt19937 rng(kvgc_test::fresh_seed("test_cuda_batch observe"));
  PageLayout L[KVGC_CLASS_COUNT];
  layouts(16, 2, 64, KVGC_DTYPE_F16, L);
  cudaStream_t stream;
  REQUIRE(cudaStreamCreate(&stream) == cudaSuccess);
  for (uint32_t n_pages : {1u, 15u, 40u, 1100u}) {
    for (int mode = 0; mode < 4; ++mode) {  // bit 0: by slot; bit 1: device-side pages
      CAPTURE(n_pages);
      CAPTURE(mode);
      Arena a(L, n_pages);
      std::vector<SegPage> hp, dp;
      uint64_t rows = 0;
      int32_t pos = 0;
      for (uint32_t i = 0; i < n_pages; ++i) {
        const uint32_t cls = rng() % KVGC_CLASS_COUNT;
        const uint32_t live = fill_page(a, i, cls, 0.4, &pos, rng);
        hp.push_back({a.h(i), cls, rows});
        dp.push_back({a.d(i), cls, rows});
        rows += live;
      }
      a.upload();
      const bool by_slot = mode & 1;
      std::vector<float> mass(by_slot ? size_t(n_pages) * 16 : rows + 1);
      for (float& x : mass) {
        const uint32_t r = rng() % 50;
        x = r == 0 ? NAN : r == 1 ? -1.f : r == 2 ? INFINITY : float(rng() % 100000) / 1000.f;
      }
      DeviceBuffer dm(mass.size() * 4), dpages(dp.size() * sizeof(SegPage));
      REQUIRE(cudaMemcpy(dm.p, mass.data(), mass.size() * 4, cudaMemcpyHostToDevice) == cudaSuccess);
      REQUIRE(cudaMemcpy(dpages.p, dp.data(), dp.size() * sizeof(SegPage), cudaMemcpyHostToDevice) == cudaSuccess);
      kvgc::ObserveOp op{};
      for (int c = 0; c < KVGC_CLASS_COUNT; ++c) op.layout[c] = L[c];
      op.pages = hp.data();
      op.n_pages = n_pages;
      op.mass = mass.data();
      op.decay = 0.75f;
      op.by_slot = by_slot;
      kvgc::cpu::observe(op);
      kvgc::ObserveOp gop = op;
      gop.pages = dp.data();
      gop.mass = dm.get<float>();
      if (mode & 2) gop.dev_pages = dpages.get<SegPage>();
#ifdef KVGC_CUDA_EMU
      const uint64_t before = emu::launches;
#endif
      REQUIRE(kvgc::cuda::observe(gop, stream) == cudaSuccess);
#ifdef KVGC_CUDA_EMU
      if (mode & 2) CHECK(emu::launches - before == 1);
#endif
      REQUIRE(cudaStreamSynchronize(stream) == cudaSuccess);
      CHECK(a.download() == a.host);
    }
  }
  cudaStreamDestroy(stream);
}

#ifdef KVGC_CUDA_EMU
// The emulation counts kernel launches: a decode batch's attention is the same few
// launches for 1 sequence as for 64 (and the single segment the same as a batch of one).
TEST_CASE("batched decode attention on CUDA: launches do not grow with the batch") {
  std::mt19937 rng(kvgc_test::fresh_seed("test_cuda_batch launches"));
  PageLayout L[KVGC_CLASS_COUNT];
  layouts(16, 2, 64, KVGC_DTYPE_F16, L);
  Arena a(L, 64 * 6);
  auto launches_for = [&](uint32_t B, bool scores) {
    Batch b;
    for (uint32_t i = 0; i < B; ++i) {
      AttendSeq s{};
      s.first_page = uint32_t(b.host_pages.size());
      s.n_pages = 1 + rng() % 6;
      int32_t pos = 0;
      for (uint32_t p = 0; p < s.n_pages; ++p) {
        const uint32_t idx = uint32_t(b.host_pages.size());
        const uint32_t live = fill_page(a, idx, KVGC_CLASS_FP16, 0.2, &pos, rng);
        b.dev_pages.push_back({a.d(idx), KVGC_CLASS_FP16, s.n_live});
        s.n_live += live;
      }
      s.n_q = 1, s.q_row = i, s.q_pos0 = pos - 1, s.recent_decay = 1.f;
      b.seqs.push_back(s);
    }
    a.upload();
    DeviceBuffer dq(size_t(B) * 8 * 64 * 2), dout(size_t(B) * 8 * 64 * 2);
    kvgc::AttendOp op{};
    for (int c = 0; c < KVGC_CLASS_COUNT; ++c) op.layout[c] = L[c];
    op.pages = b.dev_pages.data();
    op.n_pages = uint32_t(b.dev_pages.size());
    op.q = dq.p, op.out = dout.p, op.q_heads = 8, op.scale = 0.125f, op.add_scores = scores;
    op.seqs = b.seqs.data(), op.n_seqs = B;
    const size_t bytes = kvgc::cuda::attend_scratch_bytes(64 * 6 * 16, 8, 64, 16);
    DeviceBuffer ds(bytes);
    std::vector<uint8_t> q(size_t(B) * 8 * 64 * 2);
    for (size_t i = 0; i < q.size(); i += 2) kvgc::cpu::store(&q[i], KVGC_DTYPE_F16, float(int(rng() % 200) - 100) / 50.f);
    REQUIRE(cudaMemcpy(dq.p, q.data(), q.size(), cudaMemcpyHostToDevice) == cudaSuccess);
    const uint64_t before = emu::launches;
    REQUIRE(kvgc::cuda::attend(op, ds.p, bytes, 132, nullptr) == cudaSuccess);
    return emu::launches - before;
  };
  for (bool scores : {false, true}) {
    CAPTURE(scores);
    const uint64_t one = launches_for(1, scores), many = launches_for(64, scores);
    CHECK(one >= 1);
    CHECK(many <= (scores ? 3u : 2u));
    CHECK(many <= std::max<uint64_t>(one, scores ? 2 : 1) + 1);  // a combine at most appears
  }
}

TEST_CASE("kvgc_batch_step on CUDA: the GC's launches do not grow with the batch") {
  // Two CUDA heaps, one stepping a batch of 1 and one of 64 sequences, every sequence
  // fed the same rows (so that every segment collects at the same steps, with the same
  // plan shapes): generational with a token budget (minors, promotions, majors,
  // evictions) and the ladder. Compaction stays off (compact_threshold 1): it is still
  // one op per fragmented segment, outside the select this measures.
  const kvgc_model_desc m = model(2, 2, 64, KVGC_DTYPE_F16, 4);
  for (kvgc_demote demote : {KVGC_DEMOTE_OFF, KVGC_DEMOTE_LADDER}) {
    CAPTURE(demote);
    kvgc_heap_options o = cpu_options(64 << 20, 8);
    o.policy = KVGC_POLICY_GENERATIONAL;
    o.token_budget = 40;
    o.sinks = 2;
    o.window = 8;
    o.demote = demote;
    o.compact_threshold = 1.0;
    constexpr uint32_t kB[2] = {1, 64};
    kvgc_heap* h[2];
    kvgc_batch* b[2];
    std::vector<kvgc_seq> seqs[2];
    for (int k = 0; k < 2; ++k) {
      h[k] = make_heap(m, KVGC_DEVICE_CUDA, 8, 64 << 20, &o);
      REQUIRE(kvgc_batch_create(h[k], &b[k]) == KVGC_OK);
      seqs[k].resize(kB[k]);
      for (auto& s : seqs[k]) REQUIRE(kvgc_seq_create(h[k], 0, &s) == KVGC_OK);
    }
    std::mt19937 rng(17);
    const size_t kv_row = 2 * 64;
    uint64_t total[2] = {0, 0}, collecting_steps = 0;
    for (int step = 0; step < 40; ++step) {
      CAPTURE(step);
      const uint32_t n = step == 0 ? 30 : 1 + (step % 7 == 0 ? 5 : 0);
      std::vector<uint16_t> k(n * kv_row), v(n * kv_row);
      std::normal_distribution<float> g(0.f, 1.f);
      for (auto* a : {&k, &v})
        for (auto& x : *a) kvgc::cpu::store(reinterpret_cast<uint8_t*>(&x), KVGC_DTYPE_F16, g(rng));
      uint64_t launches[2];
      for (int i = 0; i < 2; ++i) {
        const uint32_t B = kB[i];
        std::vector<uint32_t> n_new(B, n);
        uint32_t failed = 0;
        REQUIRE(kvgc_batch_plan(b[i], seqs[i].data(), n_new.data(), B, &failed, nullptr) == KVGC_OK);
        // The same rows for every sequence.
        std::vector<uint16_t> kb(size_t(B) * k.size()), vb(size_t(B) * v.size());
        for (uint32_t j = 0; j < B; ++j) {
          std::copy(k.begin(), k.end(), kb.begin() + size_t(j) * k.size());
          std::copy(v.begin(), v.end(), vb.begin() + size_t(j) * v.size());
        }
        DeviceBuffer dk(kb.size() * 2), dv(vb.size() * 2);
        REQUIRE(cudaMemcpy(dk.p, kb.data(), kb.size() * 2, cudaMemcpyHostToDevice) == cudaSuccess);
        REQUIRE(cudaMemcpy(dv.p, vb.data(), vb.size() * 2, cudaMemcpyHostToDevice) == cudaSuccess);
        for (uint32_t layer = 0; layer < m.n_layers; ++layer)
          REQUIRE(kvgc_batch_append(b[i], layer, dk.p, dv.p, nullptr) == KVGC_OK);
        const uint64_t at = emu::launches;
        const kvgc_status st = kvgc_batch_step(b[i], nullptr);
        launches[i] = emu::launches - at;
        REQUIRE((st == KVGC_OK || st == KVGC_EBUDGET));
        require_check(h[i]);
        total[i] += launches[i];
      }
      CHECK(launches[0] == launches[1]);
      collecting_steps += launches[1] > 0;
      if (step == 39 || launches[0] != launches[1])
        std::printf("batch step launches (demote %d, step %d): B=1 %llu, B=64 %llu\n", int(demote), step,
                    (unsigned long long)launches[0], (unsigned long long)launches[1]);
    }
    std::printf("batch step launches over 40 steps (demote %d): B=1 %llu, B=64 %llu; %llu steps collected\n",
                int(demote), (unsigned long long)total[0], (unsigned long long)total[1],
                (unsigned long long)collecting_steps);
    CHECK(collecting_steps >= 5);  // the GC ran: minors every page of tokens at least
    // The work was the batch's: 64 times the GCs, in the same launches.
    kvgc_stats s1, s64;
    kvgc_stats_init(&s1);
    kvgc_stats_init(&s64);
    REQUIRE(kvgc_get_stats(h[0], &s1) == KVGC_OK);
    REQUIRE(kvgc_get_stats(h[1], &s64) == KVGC_OK);
    CHECK(s1.gcs > 0);
    CHECK(s64.gcs == 64 * s1.gcs);
    CHECK(s64.tokens_evicted == 64 * s1.tokens_evicted);
    for (int k = 0; k < 2; ++k) {
      kvgc_batch_destroy(b[k]);
      kvgc_heap_destroy(h[k]);
    }
  }
}
#endif

TEST_CASE("the batch API on a CUDA heap equals a CPU heap (plan, append, attend, export, observe, step)") {
  // End to end through kvgc.h: one plan uploads every layer's tables, one append and one
  // attention per layer; the CPU heap runs the same batch (some steps through
  // kvgc_batch_plan_ex: rows unscored, GC deferred). Full cache for the outputs
  // (no GC decision can diverge on rounding), then h2o with the ladder for the GC path.
  std::mt19937 rng(fresh_seed("c-api batch"));
  const kvgc_model_desc m = model(2, 2, 64, KVGC_DTYPE_F16, 4);
  cudaStream_t stream;
  REQUIRE(cudaStreamCreate(&stream) == cudaSuccess);
  for (kvgc_policy policy : {KVGC_POLICY_FULL, KVGC_POLICY_H2O}) {
    CAPTURE(policy);
    kvgc_heap_options o = cpu_options(64 << 20, 16);
    o.policy = policy;
    o.byte_budget_fraction = policy == KVGC_POLICY_FULL ? 0 : 0.3;
    o.sinks = 2;
    o.window = 8;
    kvgc_heap* cpu = make_heap(m, KVGC_DEVICE_CPU, 16, 64 << 20, &o);
    kvgc_heap* gpu = make_heap(m, KVGC_DEVICE_CUDA, 16, 64 << 20, &o);
    kvgc_batch *bc, *bg;
    REQUIRE(kvgc_batch_create(cpu, &bc) == KVGC_OK);
    REQUIRE(kvgc_batch_create(gpu, &bg) == KVGC_OK);
    constexpr uint32_t B = 5;
    kvgc_seq sc[B], sg[B];
    for (uint32_t i = 0; i < B; ++i) {
      REQUIRE(kvgc_seq_create(cpu, i % 2, &sc[i]) == KVGC_OK);
      REQUIRE(kvgc_seq_create(gpu, i % 2, &sg[i]) == KVGC_OK);
    }
    const size_t kv_row = 2 * 64, q_row = 8 * 64;
    for (int step = 0; step < 12; ++step) {
      uint32_t n_new[B];
      uint32_t rows = 0;
      for (uint32_t i = 0; i < B; ++i) rows += n_new[i] = step == 0 ? 1 + rng() % 300 : (i == 3 && step % 4 ? 0 : 1);
      uint32_t failed = 99;
      // kvgc_batch_plan_ex on some steps: sequence 2's first chunk scores its last third
      // and 4's first three are unscored, both with their GC deferred.
      uint32_t scored[B], flags[B];
      for (uint32_t i = 0; i < B; ++i) {
        const bool observe = (i == 2 && step == 0) || (i == 4 && step < 3);
        scored[i] = !observe ? UINT32_MAX : i == 2 ? n_new[i] / 3 : 0;
        flags[i] = observe ? KVGC_BATCH_SEQ_DEFER_STEP : 0;
      }
      kvgc_batch_plan_options po;
      REQUIRE(kvgc_batch_plan_options_init(&po) == KVGC_OK);
      po.scored_rows = scored;
      po.seq_flags = flags;
      if (step < 3) {
        REQUIRE(kvgc_batch_plan_ex(bc, sc, n_new, B, &po, &failed, nullptr) == KVGC_OK);
        REQUIRE(kvgc_batch_plan_ex(bg, sg, n_new, B, &po, &failed, stream) == KVGC_OK);
      } else {
        REQUIRE(kvgc_batch_plan(bc, sc, n_new, B, &failed, nullptr) == KVGC_OK);
        REQUIRE(kvgc_batch_plan(bg, sg, n_new, B, &failed, stream) == KVGC_OK);
      }
      for (uint32_t layer = 0; layer < m.n_layers; ++layer) {
        const F16Rows r(rng, rows * kv_row, rows * q_row);
        const std::vector<uint16_t>&k = r.k, &v = r.v, &q = r.q;
        const DeviceBuffer &dk = r.dk, &dv = r.dv, &dq = r.dq;
        DeviceBuffer dout(q.size() * 2);
        REQUIRE(cudaMemset(dout.p, 0xA5, q.size() * 2) == cudaSuccess);  // poison
        std::vector<uint16_t> out_c(q.size());
        REQUIRE(kvgc_batch_append(bc, layer, k.data(), v.data(), nullptr) == KVGC_OK);
        REQUIRE(kvgc_batch_append(bg, layer, dk.p, dv.p, stream) == KVGC_OK);
        REQUIRE(kvgc_batch_attend(bc, layer, q.data(), out_c.data(), nullptr, nullptr) == KVGC_OK);
        REQUIRE(kvgc_batch_attend(bg, layer, dq.p, dout.p, nullptr, stream) == KVGC_OK);
        REQUIRE(cudaStreamSynchronize(stream) == cudaSuccess);
        std::vector<uint16_t> out_g(q.size());
        REQUIRE(cudaMemcpy(out_g.data(), dout.p, q.size() * 2, cudaMemcpyDeviceToHost) == cudaSuccess);
        std::vector<uint8_t> bc8(out_c.size() * 2), bg8(out_g.size() * 2);
        std::memcpy(bc8.data(), out_c.data(), bc8.size());
        std::memcpy(bg8.data(), out_g.data(), bg8.size());
        CHECK(rel_rms(bc8, bg8, out_c.size(), KVGC_DTYPE_F16) <= 2e-3);
        // The exported page table: the device's arrays say what the CPU's say.
        kvgc_batch_view vc, vg;
        std::memset(&vc, 0, sizeof vc);
        std::memset(&vg, 0, sizeof vg);
        vc.struct_size = vg.struct_size = sizeof vc;
        REQUIRE(kvgc_batch_export(bc, layer, &vc) == KVGC_OK);
        REQUIRE(kvgc_batch_export(bg, layer, &vg) == KVGC_OK);
        REQUIRE(vg.n_pages == vc.n_pages);
        std::vector<uint32_t> indptr(B + 1);
        std::vector<uint8_t> cls(vg.n_pages + 1);
        REQUIRE(cudaMemcpy(indptr.data(), vg.page_indptr, (B + 1) * 4, cudaMemcpyDeviceToHost) == cudaSuccess);
        REQUIRE(cudaMemcpy(cls.data(), vg.page_class, vg.n_pages, cudaMemcpyDeviceToHost) == cudaSuccess);
        CHECK(std::equal(indptr.begin(), indptr.end(), vc.page_indptr));
        CHECK(std::equal(cls.begin(), cls.begin() + vg.n_pages, vc.page_class));
        // A slot-indexed observe on the device, as an engine's own kernel would hand it.
        DeviceBuffer dmass(size_t(vg.n_pages) * vg.page_tokens * 4 + 4);
        REQUIRE(cudaMemset(dmass.p, 0, size_t(vg.n_pages) * vg.page_tokens * 4 + 4) == cudaSuccess);
        REQUIRE(kvgc_batch_observe(bg, layer, dmass.get<float>(), stream) == KVGC_OK);
      }
      const kvgc_status a = kvgc_batch_step(bc, nullptr), b = kvgc_batch_step(bg, stream);
      REQUIRE((a == KVGC_OK || a == KVGC_EBUDGET));
      REQUIRE((b == KVGC_OK || b == KVGC_EBUDGET));
      require_check(gpu);
    }
    for (uint32_t i = 0; i < B; ++i)
      for (uint32_t layer = 0; layer < m.n_layers; ++layer) {
        uint64_t lc = 0, lg = 0, nc = 0, ng = 0;
        REQUIRE(kvgc_seq_tokens(cpu, sc[i], layer, &lc, &nc) == KVGC_OK);
        REQUIRE(kvgc_seq_tokens(gpu, sg[i], layer, &lg, &ng) == KVGC_OK);
        CHECK(nc == ng);
        if (policy != KVGC_POLICY_FULL) continue;
        CHECK(lc == lg);
        // The scores (the rows that did not score added nothing on either heap).
        std::vector<float> a(lc + 1), g(lg + 1);
        uint64_t n = 0;
        REQUIRE(kvgc_read_scores(cpu, sc[i], layer, a.data(), nullptr, lc + 1, &n, nullptr) == KVGC_OK);
        DeviceBuffer dsc(g.size() * 4);
        REQUIRE(kvgc_read_scores(gpu, sg[i], layer, dsc.get<float>(), nullptr, lg + 1, &n, stream) == KVGC_OK);
        REQUIRE(cudaStreamSynchronize(stream) == cudaSuccess);
        REQUIRE(cudaMemcpy(g.data(), dsc.p, n * 4, cudaMemcpyDeviceToHost) == cudaSuccess);
        double se = 0, sr = 0;
        for (uint64_t j = 0; j < n; ++j) se += double(a[j] - g[j]) * (a[j] - g[j]), sr += double(a[j]) * a[j];
        CHECK(std::sqrt(se / std::max(sr, 1e-30)) <= 1e-3);
      }
    kvgc_batch_destroy(bc);
    kvgc_batch_destroy(bg);
    kvgc_heap_destroy(cpu);
    kvgc_heap_destroy(gpu);
  }
  cudaStreamDestroy(stream);
}

namespace {

// A segment for the shared-page test: arena pages [0, n), classes cycling FP16, INT8,
// FP16, INT4, a fifth of the slots evicted, every generation (sinks below position 4);
// returns the whole pages' SegPages (read-order rows) and the positions used.
std::vector<SegPage> shared_segment(Arena& a, uint32_t n, int32_t* length, std::mt19937& rng) {
  const uint32_t cycle[4] = {KVGC_CLASS_FP16, KVGC_CLASS_INT8, KVGC_CLASS_FP16, KVGC_CLASS_INT4};
  std::vector<SegPage> seg;
  int32_t pos = 0;
  uint64_t rows = 0;
  for (uint32_t i = 0; i < n; ++i) {
    const uint32_t cls = cycle[i % 4];
    const PageLayout& L = a.L[cls];
    const int32_t first = pos;
    const uint32_t live = fill_page(a, i, cls, 0.2, &pos, rng);
    for (uint32_t s = 0; s < L.page_tokens; ++s)
      a.h(i)[L.gen_off + s] = first + int32_t(s) < 4 ? uint8_t(kvgc::kGenSink)
                                                      : kvgc::make_gen(uint8_t(1 + rng() % 3), uint8_t(rng() % 5));
    seg.push_back({a.h(i), cls, rows});
    rows += live;
  }
  *length = pos;
  return seg;
}

// The pages of `whole` (host addresses in an Arena, as the CPU reference sees them) as a
// shared page's holders see them on the device: where shared[j], header j alone (its
// k_off bytes, then garbage to the arena's page size: K/V read past a header are
// garbage) in `hdr` and page j, its own header garbage (metadata read there is garbage),
// in `kv` (SegPage::kv); otherwise page j whole in `kv`. Host images of both as uploaded.
struct SplitPages {
  size_t stride;
  std::vector<uint8_t> hdr, kv;
  DeviceBuffer dhdr, dkv;
  std::vector<SegPage> dev;  // `whole`'s entries on the device, in its order
  std::vector<bool> shared;

  SplitPages(Arena& a, const std::vector<SegPage>& whole, const std::vector<bool>& share, std::mt19937& rng)
      : stride(a.page_bytes), hdr(a.host.size()), kv(a.host), dhdr(hdr.size()), dkv(kv.size()), shared(share) {
    for (auto& b : hdr) b = uint8_t(rng());
    for (size_t j = 0; j < whole.size(); ++j) {
      const SegPage& sp = whole[j];
      const size_t at = at_of(a, sp), k_off = a.L[sp.cls].k_off;
      if (!shared[j]) {
        dev.push_back({dkv.get(at), sp.cls, sp.out_row});
        continue;
      }
      std::memcpy(&hdr[at], &kv[at], k_off);
      for (size_t b = 0; b < k_off; ++b) kv[at + b] = uint8_t(rng());
      dev.push_back({dhdr.get(at), sp.cls, sp.out_row, dkv.get(at)});
    }
    REQUIRE(cudaMemcpy(dhdr.p, hdr.data(), hdr.size(), cudaMemcpyHostToDevice) == cudaSuccess);
    REQUIRE(cudaMemcpy(dkv.p, kv.data(), kv.size(), cudaMemcpyHostToDevice) == cudaSuccess);
  }
  size_t at_of(const Arena& a, const SegPage& sp) const { return size_t(sp.page - a.host.data()); }
  uint8_t* kv_dev(const Arena& a, const uint8_t* host_page) const {
    return dkv.get(size_t(host_page - a.host.data()));
  }

  // Empty when the device's pages hold what the CPU's whole pages do: headers (scores
  // and recent scores within *score_err's tally unless exact) and private pages' payloads
  // equal, shared pages and the headers' slack exactly as uploaded.
  std::string compare(const Arena& a, const std::vector<SegPage>& whole, bool exact, double* score_err) {
    std::vector<uint8_t> hdr_back(hdr.size()), kv_back(kv.size());
    REQUIRE(cudaMemcpy(hdr_back.data(), dhdr.p, hdr.size(), cudaMemcpyDeviceToHost) == cudaSuccess);
    REQUIRE(cudaMemcpy(kv_back.data(), dkv.p, kv.size(), cudaMemcpyDeviceToHost) == cudaSuccess);
    double se = 0, sr = 0;
    for (size_t j = 0; j < whole.size(); ++j) {
      const PageLayout& L = a.L[whole[j].cls];
      const size_t at = at_of(a, whole[j]);
      const uint8_t* ref = whole[j].page;
      const uint8_t* got = shared[j] ? &hdr_back[at] : &kv_back[at];
      const std::string where = "page " + std::to_string(j) + (shared[j] ? " (shared)" : " (private)");
      const size_t meta_end = exact ? L.k_off : L.score_off;
      if (std::memcmp(ref, got, meta_end) || std::memcmp(ref + L.gen_off, got + L.gen_off, L.k_off - L.gen_off))
        return where + ": the header differs";
      for (uint32_t s = 0; !exact && s < L.page_tokens; ++s)
        for (size_t off : {L.score_off, L.recent_off}) {
          const float x = reinterpret_cast<const float*>(ref + off)[s], y = reinterpret_cast<const float*>(got + off)[s];
          se += double(x - y) * (x - y);
          sr += double(x) * x;
        }
      if (shared[j]) {
        if (std::memcmp(&hdr_back[at + L.k_off], &hdr[at + L.k_off], stride - L.k_off))
          return where + ": written past its header";
        if (std::memcmp(&kv_back[at], &kv[at], stride)) return where + ": the shared page was written";
      }
      if (std::memcmp(ref + L.k_off, &kv_back[at + L.k_off], L.bytes - L.k_off)) return where + ": the payload differs";
    }
    if (score_err) *score_err = std::sqrt(se / std::max(sr, 1e-30));
    return "";
  }
};

}  // namespace

TEST_CASE("shared pages on CUDA (SegPage::kv): attention, gather and select equal the CPU over the pages whole") {
  // The CPU runs on the pages whole; CUDA on the split pages (tests/test_shared_kernels.cpp
  // holds the CPU's split runs to its whole ones, bit for bit).
  std::mt19937 rng(fresh_seed("shared pages"));
  struct Shape { uint32_t kv_heads, gqa, head_dim, page_tokens; kvgc_dtype dtype; uint32_t pages; };
  const Shape shapes[] = {{2, 4, 64, 16, KVGC_DTYPE_F16, 14}, {1, 1, 128, 8, KVGC_DTYPE_F32, 10},
                          {3, 2, 32, 33, KVGC_DTYPE_BF16, 7}};
  cudaStream_t stream;
  REQUIRE(cudaStreamCreate(&stream) == cudaSuccess);
  kvgc::SelectResult total;
  for (const Shape& sh : shapes) {
    CAPTURE(sh.head_dim);
    CAPTURE(sh.dtype);
    PageLayout L[KVGC_CLASS_COUNT];
    layouts(sh.page_tokens, sh.kv_heads, sh.head_dim, sh.dtype, L);
    constexpr uint32_t kDest = 4;  // select's fresh destination pages: two INT8, two INT4
    Arena a(L, sh.pages + kDest);
    std::vector<bool> share(sh.pages);
    for (uint32_t i = 0; i < sh.pages; ++i) share[i] = i % 5 != 4;  // every fifth private
    const uint32_t q_heads = sh.kv_heads * sh.gqa, eb = kvgc::dtype_bytes(sh.dtype);
    const double bound = kvgc_test::output_bound(sh.dtype);
    const double score_bound = sh.dtype == KVGC_DTYPE_BF16 ? 2e-3 : 1e-4;

    // Attention: decode and a chunk with scores, a chunk without, a batch of two with the
    // plan's device-side tables.
    for (int variant = 0; variant < 4; ++variant) {
      CAPTURE(variant);
      int32_t length = 0;
      const std::vector<SegPage> seg = shared_segment(a, sh.pages, &length, rng);
      SplitPages sp(a, seg, share, rng);
      const uint32_t n_q = variant == 0 ? 1 : 3;
      const size_t qn = size_t(variant == 3 ? 2 * n_q : n_q) * q_heads * sh.head_dim;
      std::vector<uint8_t> q(qn * eb), out_cpu(qn * eb, 0xCD);
      std::normal_distribution<float> gauss(0.f, 1.f);
      for (size_t i = 0; i < qn; ++i) kvgc::cpu::store(&q[i * eb], sh.dtype, 2.f * gauss(rng));
      kvgc::AttendOp op{};
      for (int c = 0; c < KVGC_CLASS_COUNT; ++c) op.layout[c] = L[c];
      op.pages = seg.data();
      op.n_pages = sh.pages;
      op.n_live = seg.back().out_row + sh.page_tokens;  // an upper bound
      op.q = q.data();
      op.n_q = n_q;
      op.q_heads = q_heads;
      op.q_pos0 = length - n_q;
      op.scale = 1.f / std::sqrt(float(sh.head_dim));
      op.out = out_cpu.data();
      op.add_scores = variant != 2;
      op.recent_decay = 0.8f;
      const uint32_t half = sh.pages / 2;
      std::vector<AttendSeq> seqs;
      if (variant == 3) {  // the pages' rows are relative to their sequence
        seqs = {{0, half, seg[half].out_row, 0, n_q, length - n_q, 0.8f},
                {half, sh.pages - half, op.n_live - seg[half].out_row, n_q, n_q, length - n_q, 0.6f}};
        op.seqs = seqs.data();
        op.n_seqs = 2;
      }
      std::vector<SegPage> host_pages = seg, dev_pages = sp.dev;
      for (uint32_t i = half; variant == 3 && i < sh.pages; ++i) {
        host_pages[i].out_row -= seg[half].out_row;
        dev_pages[i].out_row -= seg[half].out_row;
      }
      op.pages = host_pages.data();
      kvgc::cpu::attend(op);

      DeviceBuffer dq(q.size()), dout(q.size()), dpages(dev_pages.size() * sizeof(SegPage));
      REQUIRE(cudaMemcpy(dq.p, q.data(), q.size(), cudaMemcpyHostToDevice) == cudaSuccess);
      REQUIRE(cudaMemset(dout.p, 0xA5, q.size()) == cudaSuccess);  // poison
      REQUIRE(cudaMemcpy(dpages.p, dev_pages.data(), dev_pages.size() * sizeof(SegPage), cudaMemcpyHostToDevice) == cudaSuccess);
      kvgc::AttendOp gop = op;
      gop.pages = dev_pages.data();
      gop.q = dq.p;
      gop.out = dout.p;
      if (variant == 3) gop.dev_pages = dpages.get<SegPage>();
      const size_t scratch = kvgc::cuda::attend_scratch_bytes(uint64_t(sh.pages) * sh.page_tokens, q_heads,
                                                               sh.head_dim, sh.page_tokens);
      DeviceBuffer ds(scratch);
      REQUIRE(kvgc::cuda::attend(gop, ds.p, scratch, variant == 1 ? 132 : 1, stream) == cudaSuccess);
      REQUIRE(cudaStreamSynchronize(stream) == cudaSuccess);
      std::vector<uint8_t> out_gpu(q.size());
      REQUIRE(cudaMemcpy(out_gpu.data(), dout.p, q.size(), cudaMemcpyDeviceToHost) == cudaSuccess);
      CHECK(rel_rms(out_cpu, out_gpu, qn, sh.dtype) <= bound);
      double score_err = 0;
      const std::string diff = sp.compare(a, seg, false, &score_err);
      INFO(diff);
      CHECK(diff.empty());
      CHECK(score_err <= score_bound);
    }

    // Gather: K and V (FP16 copied, INT8 and INT4 dequantised), positions, scores and
    // generations, bit for bit.
    {
      int32_t length = 0;
      const std::vector<SegPage> seg = shared_segment(a, sh.pages, &length, rng);
      SplitPages sp(a, seg, share, rng);
      uint64_t rows = 0;
      for (const SegPage& p : seg) {
        const PageLayout& Lc = L[p.cls];
        for (uint32_t w = 0; w < PageLayout::live_words(Lc.page_tokens); ++w)
          rows += std::popcount(reinterpret_cast<const uint32_t*>(p.page + Lc.live_off)[w]);
      }
      const size_t tb = size_t(sh.kv_heads) * sh.head_dim * eb;
      std::vector<uint8_t> k(rows * tb), v(rows * tb), gen(rows);
      std::vector<int32_t> pos(rows);
      std::vector<float> score(rows);
      kvgc::GatherOp op{};
      for (int c = 0; c < KVGC_CLASS_COUNT; ++c) op.layout[c] = L[c];
      op.pages = seg.data();
      op.n_pages = sh.pages;
      op.k_out = k.data(), op.v_out = v.data(), op.pos_out = pos.data(), op.score_out = score.data();
      op.gen_out = gen.data();
      kvgc::cpu::gather(op);
      DeviceBuffer dk(k.size()), dv(v.size()), dpos(rows * 4), dscore(rows * 4), dgen(rows);
      REQUIRE(cudaMemset(dk.p, 0xA5, k.size()) == cudaSuccess);  // poison
      REQUIRE(cudaMemset(dv.p, 0x5A, v.size()) == cudaSuccess);
      REQUIRE(cudaMemset(dpos.p, 0xFF, rows * 4) == cudaSuccess);
      REQUIRE(cudaMemset(dscore.p, 0xFF, rows * 4) == cudaSuccess);
      REQUIRE(cudaMemset(dgen.p, 0xEE, rows) == cudaSuccess);
      kvgc::GatherOp gop = op;
      gop.pages = sp.dev.data();
      gop.k_out = dk.p, gop.v_out = dv.p, gop.pos_out = dpos.get<int32_t>(), gop.score_out = dscore.get<float>();
      gop.gen_out = dgen.get();
      REQUIRE(kvgc::cuda::gather(gop, stream) == cudaSuccess);
      REQUIRE(cudaStreamSynchronize(stream) == cudaSuccess);
      std::vector<uint8_t> gk(k.size()), gv(v.size()), ggen(rows);
      std::vector<int32_t> gpos(rows);
      std::vector<float> gscore(rows);
      REQUIRE(cudaMemcpy(gk.data(), dk.p, k.size(), cudaMemcpyDeviceToHost) == cudaSuccess);
      REQUIRE(cudaMemcpy(gv.data(), dv.p, v.size(), cudaMemcpyDeviceToHost) == cudaSuccess);
      REQUIRE(cudaMemcpy(gpos.data(), dpos.p, rows * 4, cudaMemcpyDeviceToHost) == cudaSuccess);
      REQUIRE(cudaMemcpy(gscore.data(), dscore.p, rows * 4, cudaMemcpyDeviceToHost) == cudaSuccess);
      REQUIRE(cudaMemcpy(ggen.data(), dgen.p, rows, cudaMemcpyDeviceToHost) == cudaSuccess);
      CHECK(gk == k);
      CHECK(gv == v);
      CHECK(gpos == pos);
      CHECK(std::memcmp(gscore.data(), score.data(), rows * 4) == 0);
      CHECK(ggen == gen);
      const std::string diff = sp.compare(a, seg, true, nullptr);
      INFO(diff);
      CHECK(diff.empty());
    }

    // Select with the full ladder: sources demoted from the shared pages' K/V into fresh
    // private pages, evictions and generations at the headers, bit for bit.
    uint64_t bytes[KVGC_CLASS_COUNT];
    for (int c = 0; c < KVGC_CLASS_COUNT; ++c) bytes[c] = L[c].bytes;
    std::string note;
    const kvgc::Ladder ladder = kvgc::make_ladder(KVGC_DEMOTE_LADDER, bytes, &note);
    REQUIRE(ladder.n == 3);
    for (int iter = 0; iter < 4; ++iter) {
      CAPTURE(iter);
      int32_t length = 0;
      std::vector<SegPage> pages = shared_segment(a, sh.pages, &length, rng);
      std::vector<kvgc::AppendRun> runs[KVGC_CLASS_COUNT];
      std::vector<bool> share_all = share;
      for (uint32_t d = 0; d < kDest; ++d) {
        const uint32_t i = sh.pages + d, cls = d < 2 ? KVGC_CLASS_INT8 : KVGC_CLASS_INT4;
        for (size_t b = 0; b < a.page_bytes; ++b) a.h(i)[b] = uint8_t(rng());  // the op zeroes them
        runs[cls].push_back({a.h(i), 0, 1 + uint32_t(rng() % sh.page_tokens), 0});
        pages.push_back({a.h(i), cls, 0});
        share_all.push_back(false);  // destinations are always private
      }
      SplitPages sp(a, pages, share_all, rng);
      std::vector<kvgc::AppendRun> druns[KVGC_CLASS_COUNT];
      for (int c = 0; c < KVGC_CLASS_COUNT; ++c)
        for (const kvgc::AppendRun& r : runs[c]) druns[c].push_back({sp.kv_dev(a, r.page), r.first_slot, r.count, 0});
      kvgc::SelectOp op{};
      for (int c = 0; c < KVGC_CLASS_COUNT; ++c) {
        op.layout[c] = L[c];
        op.unit_cost[c] = bytes[c];
        op.n_demote_dst[c] = uint32_t(runs[c].size());
      }
      op.n_ladder = ladder.n;
      for (int r = 0; r < KVGC_CLASS_COUNT; ++r) op.ladder[r] = ladder.cls[r], op.slope[r] = ladder.slope[r];
      op.n_pages = uint32_t(pages.size());
      op.tenure_before = rng() % (length + 1);
      op.candidates = uint8_t(kvgc::gen_bit(kvgc::kGenIntermediate) | kvgc::gen_bit(kvgc::kGenLongTerm));
      op.key = iter % 2 ? kvgc::KeyKind::Score : kvgc::KeyKind(rng() % 4);
      op.seed = rng();
      op.segment_salt = rng();
      op.reclaim = bytes[KVGC_CLASS_FP16] * uint64_t(length) / (iter % 2 ? 2 : 5);
      op.budget_bytes = iter == 3 ? uint64_t(sh.pages / 2) * bytes[KVGC_CLASS_FP16] : 0;
      op.promote = iter % 2 ? 5 : 0;
      op.promote_age = 2;
      op.age_intermediate = iter % 2;
      kvgc::SelectOp gop = op;
      std::vector<uint16_t> live_cpu(pages.size(), 0xFFFF), live_gpu(pages.size(), 0xEEEE);
      kvgc::SelectResult r_cpu, r_gpu;
      std::memset(static_cast<void*>(&r_gpu), 0xAB, sizeof r_gpu);  // poison
      op.pages = pages.data();
      gop.pages = sp.dev.data();
      for (int c = 0; c < KVGC_CLASS_COUNT; ++c) {
        op.demote_dst[c] = runs[c].data();
        gop.demote_dst[c] = druns[c].data();
      }
      op.page_live = live_cpu.data();
      op.result = &r_cpu;
      gop.page_live = live_gpu.data();
      gop.result = &r_gpu;
      const size_t scratch = kvgc::cuda::gc_scratch_bytes(pages.size() * sh.page_tokens, sh.page_tokens);
      DeviceBuffer sb(scratch);
      gop.scratch = sb.p;
      gop.scratch_bytes = scratch;
      kvgc::cpu::select(op);
      REQUIRE(kvgc::cuda::select(gop, stream) == cudaSuccess);
      REQUIRE(cudaStreamSynchronize(stream) == cudaSuccess);
      CHECK(std::memcmp(&r_gpu, &r_cpu, sizeof r_cpu) == 0);
      CHECK(live_gpu == live_cpu);
      const std::string diff = sp.compare(a, pages, true, nullptr);
      INFO(diff);
      CHECK(diff.empty());
      total.evicted += r_cpu.evicted;
      for (int c = 0; c < KVGC_CLASS_COUNT; ++c) total.demoted_to[c] += r_cpu.demoted_to[c];
    }
  }
  CHECK(total.evicted > 0);  // every path was taken
  CHECK(total.demoted_to[KVGC_CLASS_INT8] > 0);
  CHECK(total.demoted_to[KVGC_CLASS_INT4] > 0);
  cudaStreamDestroy(stream);
}

TEST_CASE("the prefix cache and fork on a CUDA heap equal a CPU heap (attach, copy-on-write, batch, export)") {
  // The runtime's shared-page paths on the device: attach composes its headers in pinned
  // staging and uploads them, the first write copies a shared partly filled tail, fork
  // shares, and the batch exports kv_offset. The same calls on a CPU heap are the
  // reference: K/V and positions read back identical, attention within the usual bound.
  std::mt19937 rng(fresh_seed("prefix cache"));
  const kvgc_model_desc m = model(2, 2, 64, KVGC_DTYPE_F16, 4);
  cudaStream_t stream;
  REQUIRE(cudaStreamCreate(&stream) == cudaSuccess);
  kvgc_heap_options o = cpu_options(64 << 20, 16);
  o.policy = KVGC_POLICY_FULL;
  kvgc_heap* cpu = make_heap(m, KVGC_DEVICE_CPU, 16, 64 << 20, &o);
  kvgc_heap* gpu = make_heap(m, KVGC_DEVICE_CUDA, 16, 64 << 20, &o);
  const size_t kv_row = 2 * 64, q_row = 8 * 64;
  std::normal_distribution<float> g(0.f, 1.f);
  auto random_f16 = [&](size_t n) {
    std::vector<uint16_t> x(n);
    for (auto& e : x) kvgc::cpu::store(reinterpret_cast<uint8_t*>(&e), KVGC_DTYPE_F16, g(rng));
    return x;
  };
  auto append_both = [&](kvgc_seq c, kvgc_seq d, uint32_t layer, const std::vector<uint16_t>& k,
                         const std::vector<uint16_t>& v, uint32_t n) {
    DeviceBuffer dk(k.size() * 2), dv(v.size() * 2);
    REQUIRE(cudaMemcpy(dk.p, k.data(), k.size() * 2, cudaMemcpyHostToDevice) == cudaSuccess);
    REQUIRE(cudaMemcpy(dv.p, v.data(), v.size() * 2, cudaMemcpyHostToDevice) == cudaSuccess);
    REQUIRE(kvgc_append(cpu, c, layer, k.data(), v.data(), n, nullptr) == KVGC_OK);
    REQUIRE(kvgc_append(gpu, d, layer, dk.p, dv.p, n, stream) == KVGC_OK);
    REQUIRE(cudaStreamSynchronize(stream) == cudaSuccess);
  };
  // The keeper: a 75-token prompt (4 full pages and a partly filled one), kept.
  const uint32_t P = 75;
  std::vector<int32_t> ids(P);
  for (uint32_t i = 0; i < P; ++i) ids[i] = int32_t(rng() % 50000);
  kvgc_seq kc, kg;
  REQUIRE(kvgc_seq_create(cpu, 0, &kc) == KVGC_OK);
  REQUIRE(kvgc_seq_create(gpu, 0, &kg) == KVGC_OK);
  for (uint32_t l = 0; l < m.n_layers; ++l) append_both(kc, kg, l, random_f16(P * kv_row), random_f16(P * kv_row), P);
  REQUIRE(kvgc_prefix_keep(cpu, kc, ids.data(), P, 0, 0, nullptr, nullptr) == KVGC_OK);
  REQUIRE(kvgc_prefix_keep(gpu, kg, ids.data(), P, 0, 0, nullptr, stream) == KVGC_OK);
  // Two attach (one the whole prompt, one its first 40 ids: two pages), one forks.
  kvgc_seq ac[3], ag[3];
  const uint64_t want[2] = {P, 32};
  for (int i = 0; i < 2; ++i) {
    REQUIRE(kvgc_seq_create(cpu, 0, &ac[i]) == KVGC_OK);
    REQUIRE(kvgc_seq_create(gpu, 0, &ag[i]) == KVGC_OK);
    uint64_t nc = 0, ng = 0;
    const uint64_t n = i == 0 ? P : 40;
    REQUIRE(kvgc_prefix_attach(cpu, ac[i], ids.data(), n, 0, &nc, nullptr) == KVGC_OK);
    REQUIRE(kvgc_prefix_attach(gpu, ag[i], ids.data(), n, 0, &ng, stream) == KVGC_OK);
    CHECK(nc == want[i]);
    CHECK(ng == want[i]);
  }
  REQUIRE(kvgc_seq_fork(cpu, kc, 0, &ac[2], nullptr) == KVGC_OK);
  REQUIRE(kvgc_seq_fork(gpu, kg, 0, &ag[2], stream) == KVGC_OK);
  REQUIRE(cudaStreamSynchronize(stream) == cudaSuccess);
  require_check(gpu);
  // Each appends its own tokens per sequence (the first write into the shared tail copies
  // it), then a batch step of one row each, whose export names the shared pages.
  for (int i = 0; i < 3; ++i)
    for (uint32_t l = 0; l < m.n_layers; ++l) append_both(ac[i], ag[i], l, random_f16(9 * kv_row), random_f16(9 * kv_row), 9);
  kvgc_batch *bc, *bg;
  REQUIRE(kvgc_batch_create(cpu, &bc) == KVGC_OK);
  REQUIRE(kvgc_batch_create(gpu, &bg) == KVGC_OK);
  const uint32_t n_new[3] = {1, 1, 1};
  REQUIRE(kvgc_batch_plan(bc, ac, n_new, 3, nullptr, nullptr) == KVGC_OK);
  REQUIRE(kvgc_batch_plan(bg, ag, n_new, 3, nullptr, stream) == KVGC_OK);
  for (uint32_t layer = 0; layer < m.n_layers; ++layer) {
    const auto k = random_f16(3 * kv_row), v = random_f16(3 * kv_row), q = random_f16(3 * q_row);
    DeviceBuffer dk(k.size() * 2), dv(v.size() * 2), dq(q.size() * 2), dout(q.size() * 2);
    REQUIRE(cudaMemcpy(dk.p, k.data(), k.size() * 2, cudaMemcpyHostToDevice) == cudaSuccess);
    REQUIRE(cudaMemcpy(dv.p, v.data(), v.size() * 2, cudaMemcpyHostToDevice) == cudaSuccess);
    REQUIRE(cudaMemcpy(dq.p, q.data(), q.size() * 2, cudaMemcpyHostToDevice) == cudaSuccess);
    REQUIRE(cudaMemset(dout.p, 0xA5, q.size() * 2) == cudaSuccess);  // poison
    std::vector<uint16_t> out_c(q.size()), out_g(q.size());
    REQUIRE(kvgc_batch_append(bc, layer, k.data(), v.data(), nullptr) == KVGC_OK);
    REQUIRE(kvgc_batch_append(bg, layer, dk.p, dv.p, stream) == KVGC_OK);
    REQUIRE(kvgc_batch_attend(bc, layer, q.data(), out_c.data(), nullptr, nullptr) == KVGC_OK);
    REQUIRE(kvgc_batch_attend(bg, layer, dq.p, dout.p, nullptr, stream) == KVGC_OK);
    REQUIRE(cudaStreamSynchronize(stream) == cudaSuccess);
    REQUIRE(cudaMemcpy(out_g.data(), dout.p, q.size() * 2, cudaMemcpyDeviceToHost) == cudaSuccess);
    std::vector<uint8_t> c8(out_c.size() * 2), g8(out_g.size() * 2);
    std::memcpy(c8.data(), out_c.data(), c8.size());
    std::memcpy(g8.data(), out_g.data(), g8.size());
    CHECK(rel_rms(c8, g8, out_c.size(), KVGC_DTYPE_F16) <= 2e-3);
    kvgc_batch_view vc, vg;
    std::memset(&vc, 0, sizeof vc);
    std::memset(&vg, 0, sizeof vg);
    vc.struct_size = vg.struct_size = sizeof vc;
    REQUIRE(kvgc_batch_export(bc, layer, &vc) == KVGC_OK);
    REQUIRE(kvgc_batch_export(bg, layer, &vg) == KVGC_OK);
    REQUIRE(vg.n_pages == vc.n_pages);
    std::vector<uint64_t> po(vg.n_pages), ko(vg.n_pages);
    REQUIRE(cudaMemcpy(po.data(), vg.page_offset, vg.n_pages * 8, cudaMemcpyDeviceToHost) == cudaSuccess);
    REQUIRE(cudaMemcpy(ko.data(), vg.kv_offset, vg.n_pages * 8, cudaMemcpyDeviceToHost) == cudaSuccess);
    uint32_t shared_c = 0, shared_g = 0;
    for (uint32_t p = 0; p < vg.n_pages; ++p) {
      shared_c += vc.kv_offset[p] != vc.page_offset[p];
      shared_g += ko[p] != po[p];
    }
    CHECK(shared_c == shared_g);
    CHECK(shared_g == 4 + 2 + 4);  // the full prompt pages each holds
  }
  REQUIRE(kvgc_batch_step(bc, nullptr) == KVGC_OK);
  REQUIRE(kvgc_batch_step(bg, stream) == KVGC_OK);
  kvgc_batch_destroy(bc);
  kvgc_batch_destroy(bg);
  // Every sequence reads back the same K/V and positions on both heaps.
  for (int i = 0; i < 3; ++i)
    for (uint32_t layer = 0; layer < m.n_layers; ++layer) {
      uint64_t nc = 0, ng = 0;
      REQUIRE(kvgc_read(cpu, ac[i], layer, nullptr, nullptr, nullptr, 0, &nc, nullptr) == KVGC_OK);
      REQUIRE(kvgc_read(gpu, ag[i], layer, nullptr, nullptr, nullptr, 0, &ng, nullptr) == KVGC_OK);
      REQUIRE(nc == ng);
      std::vector<uint16_t> kc2(nc * kv_row), kg2(nc * kv_row);
      std::vector<int32_t> pc(nc), pg(nc);
      DeviceBuffer dk(kg2.size() * 2), dp(nc * 4);
      REQUIRE(kvgc_read(cpu, ac[i], layer, kc2.data(), nullptr, pc.data(), nc, &nc, nullptr) == KVGC_OK);
      REQUIRE(kvgc_read(gpu, ag[i], layer, dk.p, nullptr, dp.get<int32_t>(), ng, &ng, stream) == KVGC_OK);
      REQUIRE(cudaStreamSynchronize(stream) == cudaSuccess);
      REQUIRE(cudaMemcpy(kg2.data(), dk.p, kg2.size() * 2, cudaMemcpyDeviceToHost) == cudaSuccess);
      REQUIRE(cudaMemcpy(pg.data(), dp.p, nc * 4, cudaMemcpyDeviceToHost) == cudaSuccess);
      CHECK(kc2 == kg2);
      CHECK(pc == pg);
    }
  kvgc_stats sc, sg;
  kvgc_stats_init(&sc);
  kvgc_stats_init(&sg);
  REQUIRE(kvgc_get_stats(cpu, &sc) == KVGC_OK);
  REQUIRE(kvgc_get_stats(gpu, &sg) == KVGC_OK);
  CHECK(sc.cow_copies == sg.cow_copies);
  CHECK(sc.shared_pages == sg.shared_pages);
  CHECK(sg.cow_copies == 2 * 2);  // per layer: the whole-prompt attach and the fork write into a shared tail
  require_check(gpu);
  kvgc_heap_destroy(cpu);
  kvgc_heap_destroy(gpu);
  cudaStreamDestroy(stream);
}

TEST_CASE("kvgc_batch_attend's mass_out on CUDA equals the CPU's, and leaves the scores alone") {
  // Sequences long enough to split, decode rows, a sequence without rows, a chunk that
  // scores only its last rows: the mass written out per page slot (the device's buffer
  // poisoned) against the CPU heap's; the scores unchanged until the mass is observed.
  std::mt19937 rng(fresh_seed("mass_out"));
  const kvgc_model_desc m = model(1, 2, 64, KVGC_DTYPE_F16, 4);
  kvgc_heap_options o = cpu_options(64 << 20, 16);
  o.policy = KVGC_POLICY_FULL;
  kvgc_heap* cpu = make_heap(m, KVGC_DEVICE_CPU, 16, 64 << 20, &o);
  kvgc_heap* gpu = make_heap(m, KVGC_DEVICE_CUDA, 16, 64 << 20, &o);
  cudaStream_t stream;
  REQUIRE(cudaStreamCreate(&stream) == cudaSuccess);
  kvgc_batch *bc, *bg;
  REQUIRE(kvgc_batch_create(cpu, &bc) == KVGC_OK);
  REQUIRE(kvgc_batch_create(gpu, &bg) == KVGC_OK);
  constexpr uint32_t B = 4;
  kvgc_seq sc[B], sg[B];
  for (uint32_t i = 0; i < B; ++i) {
    REQUIRE(kvgc_seq_create(cpu, 0, &sc[i]) == KVGC_OK);
    REQUIRE(kvgc_seq_create(gpu, 0, &sg[i]) == KVGC_OK);
  }
  const size_t kv_row = 2 * 64, q_row = 8 * 64;
  for (int step = 0; step < 3; ++step) {
    CAPTURE(step);
    uint32_t n_new[B] = {step ? 1u : 900u + uint32_t(rng() % 300), step ? 1u : 1 + uint32_t(rng() % 200),
                         step == 1 ? 0u : 1u, step ? 1u : 90u};
    uint32_t scored[B] = {step ? UINT32_MAX : 1u, UINT32_MAX, UINT32_MAX, step ? UINT32_MAX : 7u}, flags[B] = {};
    uint32_t rows = 0, failed = 0;
    for (uint32_t n : n_new) rows += n;
    kvgc_batch_plan_options po;
    REQUIRE(kvgc_batch_plan_options_init(&po) == KVGC_OK);
    po.scored_rows = scored;
    po.seq_flags = flags;
    REQUIRE(kvgc_batch_plan_ex(bc, sc, n_new, B, &po, &failed, nullptr) == KVGC_OK);
    REQUIRE(kvgc_batch_plan_ex(bg, sg, n_new, B, &po, &failed, stream) == KVGC_OK);
    const F16Rows r(rng, rows * kv_row, rows * q_row);
    std::vector<uint16_t> out(r.q.size());
    DeviceBuffer dout(r.q.size() * 2);
    REQUIRE(kvgc_batch_append(bc, 0, r.k.data(), r.v.data(), nullptr) == KVGC_OK);
    REQUIRE(kvgc_batch_append(bg, 0, r.dk.p, r.dv.p, stream) == KVGC_OK);
    kvgc_batch_view view;
    std::memset(&view, 0, sizeof view);
    view.struct_size = sizeof view;
    REQUIRE(kvgc_batch_export(bc, 0, &view) == KVGC_OK);
    const size_t n = size_t(view.n_pages) * view.page_tokens;
    std::vector<float> mc(n, NAN), mg(n);
    DeviceBuffer dm(n * 4);
    REQUIRE(cudaMemset(dm.p, 0xFF, n * 4) == cudaSuccess);  // NaN: every entry must be written
    std::vector<float> before(1 << 13), after(1 << 13);
    uint64_t nb = 0, na = 0;
    DeviceBuffer ds(before.size() * 4);
    REQUIRE(kvgc_read_scores(gpu, sg[0], 0, ds.get<float>(), nullptr, before.size(), &nb, stream) == KVGC_OK);
    REQUIRE(cudaMemcpyAsync(before.data(), ds.p, nb * 4, cudaMemcpyDeviceToHost, stream) == cudaSuccess);
    kvgc_attend_params p;
    REQUIRE(kvgc_attend_params_init(&p) == KVGC_OK);
    p.mass_out = mc.data();
    REQUIRE(kvgc_batch_attend(bc, 0, r.q.data(), out.data(), &p, nullptr) == KVGC_OK);
    p.mass_out = dm.get<float>();
    REQUIRE(kvgc_batch_attend(bg, 0, r.dq.p, dout.p, &p, stream) == KVGC_OK);
    REQUIRE(kvgc_read_scores(gpu, sg[0], 0, ds.get<float>(), nullptr, after.size(), &na, stream) == KVGC_OK);
    REQUIRE(cudaMemcpyAsync(after.data(), ds.p, na * 4, cudaMemcpyDeviceToHost, stream) == cudaSuccess);
    REQUIRE(cudaMemcpyAsync(mg.data(), dm.p, n * 4, cudaMemcpyDeviceToHost, stream) == cudaSuccess);
    REQUIRE(cudaStreamSynchronize(stream) == cudaSuccess);
    CHECK(std::memcmp(before.data(), after.data(), nb * 4) == 0);  // the scores untouched
    double total = 0;
    for (size_t i = 0; i < n; ++i) {
      REQUIRE(!std::isnan(mg[i]));
      CHECK(mg[i] == doctest::Approx(mc[i]).epsilon(2e-3).scale(1e-6));
      total += mg[i];
    }
    uint32_t scoring_rows = 0;
    for (uint32_t i = 0; i < B; ++i) scoring_rows += std::min(scored[i], n_new[i]);
    CHECK(total == doctest::Approx(double(scoring_rows) * m.n_q_heads).epsilon(1e-3));
    REQUIRE(kvgc_batch_observe(bc, 0, mc.data(), nullptr) == KVGC_OK);
    REQUIRE(kvgc_batch_observe(bg, 0, dm.get<float>(), stream) == KVGC_OK);
    REQUIRE(kvgc_batch_step(bc, nullptr) == KVGC_OK);
    REQUIRE(kvgc_batch_step(bg, stream) == KVGC_OK);
    require_check(gpu);
  }
  kvgc_batch_destroy(bc);
  kvgc_batch_destroy(bg);
  kvgc_heap_destroy(cpu);
  kvgc_heap_destroy(gpu);
  REQUIRE(cudaStreamDestroy(stream) == cudaSuccess);
}
