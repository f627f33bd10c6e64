// CPU attention with fused scores: the specification the CUDA kernel is tested against,
// and a real backend.
//
// Portable path (this file, the specification): per KV head, every live slot's K row is
// converted to f32 once and dotted with all the queries that read it (the GQA group
// times a block of queries); each query's logits get an exact fp32 softmax (max, exp,
// sum); then every V row, converted once, is accumulated into those queries' outputs
// while the slot's mass (its probabilities summed over the rows) is added to its score.
// Queries go in blocks so the logits buffer stays bounded for long prefill chunks.
//
// When the CPU has AVX2/FMA/F16C and head_dim % 16 == 0 (AVX-512: % 32), the vector path
// (attend_simd.inc) computes the same thing organised for memory bandwidth, split among a
// ThreadPool's workers when one is given; set_simd(false) forces the portable path
// (tests compare the two), which stays single-threaded: it is the specification.
#include "attend.hpp"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <vector>

#include "../../allocator/host_memory.hpp"
#include "thread_pool.hpp"

#include "attend_internal.hpp"
#include "../score.hpp"
#include "convert.hpp"
#include "quant.hpp"

namespace kvgc::cpu {
namespace {

// 2: AVX-512, 1: AVX2, 0: portable. The best the CPU has, unless a test lowers it.
int best_level() { return avx512::available() ? 2 : avx2::available() ? 1 : 0; }
std::atomic<int> g_level{best_level()};

void to_f32(const uint8_t* src, kvgc_dtype t, uint32_t n, float* dst) {
  const uint32_t eb = dtype_bytes(t);
  for (uint32_t i = 0; i < n; ++i) dst[i] = load(src + i * eb, t);
}
float dot(const float* a, const float* b, uint32_t n) {
  float s = 0;
  for (uint32_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}
void axpy(float a, const float* x, float* y, uint32_t n) {
  for (uint32_t i = 0; i < n; ++i) y[i] += a * x[i];
}

// One head's K or V row of a slot as f32 (int8 and int4 rows dequantised through the
// model dtype, exactly as kvgc_read returns them).
void row_f32(const AttendOp& op, const LiveSlot& s, uint32_t h, bool v, float* dst,
             host::vector<uint8_t>& tmp) {
  const PageLayout& L = op.layout[s.cls];
  tmp.resize(size_t(L.head_dim) * dtype_bytes(L.dtype));
  load_row(L, s.kv, h, s.slot, v, tmp.data());
  to_f32(tmp.data(), L.dtype, L.head_dim, dst);
}

// The portable path for one KV head and one block of R rows (q: [R][hd]): unnormalised
// outputs in acc ([R][hd]), 1 / sum in inv_sum, each slot's mass added to mass[j].
void head_block(const AttendOp& op, const LiveSlot* slots, size_t n, uint32_t h,
                const float* q, uint32_t R, const int64_t* row_pos, float* logits, float* acc,
                float* mass, float* inv_sum) {
  const uint32_t hd = op.layout[0].head_dim;
  host::vector<float> row(hd);
  host::vector<uint8_t> tmp;
  host::vector<float> m(R, -INFINITY);
  for (size_t j = 0; j < n; ++j) {
    row_f32(op, slots[j], h, false, row.data(), tmp);
    for (uint32_t r = 0; r < R; ++r) {
      const float l = int64_t(slots[j].pos) <= row_pos[r] ? dot(q + size_t(r) * hd, row.data(), hd)
                                                          : -INFINITY;
      logits[j * R + r] = l;
      m[r] = std::max(m[r], l);
    }
  }
  host::vector<float> sum(R, 0.f);
  for (size_t j = 0; j < n; ++j)
    for (uint32_t r = 0; r < R; ++r) {
      float& x = logits[j * R + r];
      x = std::isfinite(m[r]) ? std::exp(x - m[r]) : 0.f;  // sees nothing: zeros
      sum[r] += x;
    }
  for (uint32_t r = 0; r < R; ++r) inv_sum[r] = sum[r] > 0 ? 1.f / sum[r] : 0.f;
  std::fill(acc, acc + size_t(R) * hd, 0.f);
  for (size_t j = 0; j < n; ++j) {
    row_f32(op, slots[j], h, true, row.data(), tmp);
    float s = 0;
    for (uint32_t r = 0; r < R; ++r) {
      const float p = logits[j * R + r];
      if (p != 0.f) axpy(p, row.data(), acc + size_t(r) * hd, hd);
      s += p * inv_sum[r];
    }
    if (mass) mass[j] += s;
  }
}

}  // namespace

void set_simd(bool on) { g_level = on ? best_level() : 0; }
void set_simd_level(int level) { g_level = std::clamp(level, 0, best_level()); }
bool simd_enabled() { return g_level > 0; }
const char* simd_name() {
  const int l = g_level;
  return l == 2 ? "AVX-512" : l == 1 ? "AVX2/F16C" : "portable";
}

namespace {
void attend_one(const AttendOp& op, ThreadPool* pool) {
  const PageLayout& L0 = op.layout[0];
  const uint32_t hd = L0.head_dim, kv_heads = L0.n_kv_heads, group = op.q_heads / kv_heads;
  const kvgc_dtype dt = L0.dtype;
  const uint32_t eb = dtype_bytes(dt);
  const int level = g_level;
  const bool use512 = level >= 2 && hd % 32 == 0, use256 = !use512 && level >= 1 && hd % 16 == 0;
  const bool simd = use512 || use256;

  host::vector<LiveSlot> slots;
  slots.reserve(op.n_live);
  // trim_future (no scores): the slots no query can see are left out, as if not appended.
  const int64_t last = op.trim_future && !op.add_scores ? op.q_pos0 + int64_t(op.n_q) - 1 : INT64_MAX;
  for (uint32_t p = 0; p < op.n_pages; ++p) {
    const SegPage& sp = op.pages[p];
    const PageLayout& L = op.layout[sp.cls];
    const auto* words = reinterpret_cast<const uint32_t*>(sp.page + L.live_off);
    const auto* pos = reinterpret_cast<const int32_t*>(sp.page + L.pos_off);
    for (uint32_t s = 0; s < L.page_tokens; ++s)
      if ((words[s / 32] >> (s % 32) & 1u) && int64_t(pos[s]) <= last)
        slots.push_back({sp.page, sp.cls, s, pos[s], payload_of(sp)});
  }
  const size_t n = slots.size();
  const auto* q = static_cast<const uint8_t*>(op.q);
  auto* out = static_cast<uint8_t*>(op.out);
  // Queries per block: keep the logits buffer (every head's, on the vector path) near
  // 16 MiB.
  const size_t heads_per_pass = simd ? kv_heads : 1;
  const uint32_t block = uint32_t(std::clamp<size_t>(
      (size_t(4) << 20) / std::max<size_t>(1, n * group * heads_per_pass), 1, op.n_q));
  const size_t rows_max = size_t(block) * group, rows_padded = (rows_max + 7) / 8 * 8;
  host::vector<float> logits(heads_per_pass * rows_max * n), acc(heads_per_pass * rows_max * hd);
  host::vector<float> qf(heads_per_pass * rows_padded * hd, 0.f), inv_sum(heads_per_pass * rows_max);
  host::vector<float> mass(op.add_scores ? n : 0, 0.f);
  host::vector<int64_t> row_pos(rows_max);
  float* m = op.add_scores ? mass.data() : nullptr;

  // Heads [h0, h0 + heads_per_pass) at a time: all of them on the vector path.
  for (uint32_t h0 = 0; h0 < kv_heads; h0 += uint32_t(heads_per_pass)) {
    for (uint32_t q0 = 0; q0 < op.n_q; q0 += block) {
      const uint32_t nb = std::min(block, op.n_q - q0), R = nb * group;
      std::fill(qf.begin(), qf.end(), 0.f);  // padding rows stay zero
      for (uint32_t hh = 0; hh < heads_per_pass; ++hh)
        for (uint32_t r = 0; r < R; ++r) {
          const uint32_t i = q0 + r / group, j = (h0 + hh) * group + r % group;
          float* dst = &qf[(hh * rows_padded + r) * hd];
          to_f32(q + (size_t(i) * op.q_heads + j) * hd * eb, dt, hd, dst);
          for (uint32_t d = 0; d < hd; ++d) dst[d] *= op.scale;
          row_pos[r] = op.q_pos0 + i;
        }
      if (use512)
        avx512::all_heads(op, slots.data(), n, qf.data(), rows_padded * hd, R, row_pos.data(),
                          logits.data(), acc.data(), m, inv_sum.data(), pool);
      else if (use256)
        avx2::all_heads(op, slots.data(), n, qf.data(), rows_padded * hd, R, row_pos.data(),
                        logits.data(), acc.data(), m, inv_sum.data(), pool);
      else
        head_block(op, slots.data(), n, h0, qf.data(), R, row_pos.data(), logits.data(),
                   acc.data(), m, inv_sum.data());
      for (uint32_t hh = 0; hh < heads_per_pass; ++hh)
        for (uint32_t r = 0; r < R; ++r) {
          const uint32_t i = q0 + r / group, j = (h0 + hh) * group + r % group;
          uint8_t* dst = out + (size_t(i) * op.q_heads + j) * hd * eb;
          const float* a = &acc[(hh * R + r) * hd];
          const float inv = inv_sum[hh * R + r];
          for (uint32_t d = 0; d < hd; ++d) store(dst + d * eb, dt, a[d] * inv);
        }
    }
  }
  if (op.add_scores && op.mass_out) {  // the slots were gathered in this order
    size_t j = 0;
    for (uint32_t p = 0; p < op.n_pages; ++p) {
      const SegPage& sp = op.pages[p];
      const PageLayout& L = op.layout[sp.cls];
      const auto* words = reinterpret_cast<const uint32_t*>(sp.page + L.live_off);
      for (uint32_t s = 0; s < L.page_tokens; ++s)
        if (words[s / 32] >> (s % 32) & 1u) op.mass_out[size_t(p) * L.page_tokens + s] += mass[j++];
    }
  } else if (op.add_scores)
    for (size_t j = 0; j < n; ++j) {
      const PageLayout& L = op.layout[slots[j].cls];
      float& score = reinterpret_cast<float*>(slots[j].page + L.score_off)[slots[j].slot];
      score = accumulate_score(score, mass[j]);  // as kvgc_observe: NaN (from NaN K/V) adds nothing
      float& recent = reinterpret_cast<float*>(slots[j].page + L.recent_off)[slots[j].slot];
      recent = accumulate_score(recent * op.recent_decay, mass[j]);
    }
}

// A sequence of a batch with no queries: nothing attends, but with scores on its recent
// scores still take the op's decay (recent_decay^0 = 1 for the runtime's batches), as
// the CUDA executor does.
void decay_only(const AttendOp& one) {
  if (!one.add_scores || one.mass_out || one.recent_decay == 1.0f) return;
  for (uint32_t p = 0; p < one.n_pages; ++p) {
    const SegPage& sp = one.pages[p];
    const PageLayout& L = one.layout[sp.cls];
    const auto* words = reinterpret_cast<const uint32_t*>(sp.page + L.live_off);
    auto* recent = reinterpret_cast<float*>(sp.page + L.recent_off);
    for (uint32_t s = 0; s < L.page_tokens; ++s)
      if (words[s / 32] >> (s % 32) & 1u) recent[s] = accumulate_score(recent[s] * one.recent_decay, 0.f);
  }
}

// Sequence i of a batch: its one or two one-segment ops (attend_seq_ops: the first rows
// unscored when only its last rows score), or only its decay when it has no queries.
void attend_seq(const AttendOp& op, uint32_t i, ThreadPool* pool) {
  AttendOp parts[2];
  if (!op.seqs[i].n_q) return decay_only(attend_seq_op(op, i));
  const uint32_t n = attend_seq_ops(op, i, parts);
  for (uint32_t k = 0; k < n; ++k) attend_one(parts[k], pool);
}

}  // namespace

// A batch: sequences one after the other on one thread (exactly the per-sequence calls).
// With a pool, a sequence long enough to split (at least two workers' minimum of slots,
// and more than a worker's share of the whole batch) runs alone, split-K across the
// pool as a single call would; the rest are spread over the workers, a whole sequence
// per task (longest first), each computed exactly as a one-thread call computes it.
void attend(const AttendOp& op, ThreadPool* pool) {
  if (op.n_seqs == 0) return attend_one(op, pool);
  if (!pool || pool->size() < 2 || op.n_seqs == 1) {
    for (uint32_t i = 0; i < op.n_seqs; ++i) attend_seq(op, i, pool);
    return;
  }
  uint64_t total = 0;
  for (uint32_t i = 0; i < op.n_seqs; ++i) total += op.seqs[i].n_live * op.seqs[i].n_q;
  const uint64_t share = total / pool->size();
  host::vector<uint32_t> rest;
  rest.reserve(op.n_seqs);
  for (uint32_t i = 0; i < op.n_seqs; ++i) {
    const AttendSeq& s = op.seqs[i];
    if (!s.n_q) {  // no new rows: nothing attends
      decay_only(attend_seq_op(op, i));
      continue;
    }
    if (s.n_live >= 2 * split_min_slots() && s.n_live * s.n_q > share)
      attend_seq(op, i, pool);
    else
      rest.push_back(i);
  }
  std::stable_sort(rest.begin(), rest.end(), [&](uint32_t a, uint32_t b) {
    return op.seqs[a].n_live * op.seqs[a].n_q > op.seqs[b].n_live * op.seqs[b].n_q;
  });
  // Tasks are claimed in order; at most 65535 per run.
  for (size_t base = 0; base < rest.size(); base += 65535) {
    const unsigned n = unsigned(std::min<size_t>(65535, rest.size() - base));
    pool->run(n, [&](unsigned t) { attend_seq(op, rest[base + t], nullptr); });
  }
}

}  // namespace kvgc::cpu
