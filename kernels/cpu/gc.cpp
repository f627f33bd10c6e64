// CPU executor for the GC's data-plane ops: the specification the CUDA versions will be
// tested against, and a real backend. Host decisions (how much, which tiers) arrive in
// the op; these functions decide which tokens, over the metadata stored in the pages.
#include "gc.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <vector>

#include "../../allocator/host_memory.hpp"
#include "../score.hpp"

#include "quant.hpp"

namespace kvgc::cpu {
namespace {

bool is_live(const uint8_t* page, const PageLayout& L, uint32_t slot) {
  return reinterpret_cast<const uint32_t*>(page + L.live_off)[slot / 32] >> (slot % 32) & 1u;
}
void set_live(uint8_t* page, const PageLayout& L, uint32_t slot, bool on) {
  uint32_t& w = reinterpret_cast<uint32_t*>(page + L.live_off)[slot / 32];
  w = on ? (w | 1u << (slot % 32)) : (w & ~(1u << (slot % 32)));
}
int32_t& pos_at(uint8_t* page, const PageLayout& L, uint32_t slot) {
  return reinterpret_cast<int32_t*>(page + L.pos_off)[slot];
}
float& score_at(uint8_t* page, const PageLayout& L, uint32_t slot) {
  return reinterpret_cast<float*>(page + L.score_off)[slot];
}
uint8_t& gen_at(uint8_t* page, const PageLayout& L, uint32_t slot) { return page[L.gen_off + slot]; }

// Calls f(slot) for each live slot of a page, in slot order.
template <class F>
void for_live(const uint8_t* page, const PageLayout& L, F&& f) {
  const auto* words = reinterpret_cast<const uint32_t*>(page + L.live_off);
  for (uint32_t w = 0; w < PageLayout::live_words(L.page_tokens); ++w)
    for (uint32_t bits = words[w]; bits; bits &= bits - 1) f(w * 32 + uint32_t(std::countr_zero(bits)));
}

uint64_t splitmix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Laplace(0, b) from a counter-based uniform: reproducible from (seed, salt, epoch, pos).
double laplace(double b, uint64_t h) {
  const double u = (double(h >> 11) + 0.5) / 9007199254740992.0 - 0.5;  // (-0.5, 0.5)
  return -b * (u < 0 ? -1.0 : 1.0) * std::log(1.0 - 2.0 * std::fabs(u));
}

// A NaN key (NaN mass handed in, or attention over NaN data) ranks lowest: a total order
// is what the selection needs, and a token with no usable score is the first to go.
double rankable(double k) { return std::isnan(k) ? -INFINITY : k; }

double key_of(const SelectOp& op, uint8_t* page, const PageLayout& L, uint32_t slot) {
  const int32_t pos = pos_at(page, L, slot);
  switch (op.key) {
    case KeyKind::Position: return double(pos);
    case KeyKind::Random:
      return double(splitmix(op.seed ^ splitmix(op.segment_salt ^ uint64_t(uint32_t(pos)))) >> 11);
    case KeyKind::Score:
    default: {
      double k = score_at(page, L, slot);
      if (op.noise > 0)
        k += laplace(op.noise, splitmix(op.seed ^ splitmix(op.segment_salt ^ splitmix(op.epoch ^ (uint64_t(uint32_t(pos)) << 20)))));
      return rankable(k);
    }
  }
}

// Re-stores an fp16 slot into an int4 slot: K and V quantised per head, metadata copied.
void demote_slot(const PageLayout& Lf, uint8_t* src, uint32_t s, const PageLayout& Lq,
                 uint8_t* dst, uint32_t d) {
  for (uint32_t h = 0; h < Lf.n_kv_heads; ++h) {
    const size_t from = h * Lf.head_stride + s * Lf.slot_stride;
    const size_t to = h * Lq.head_stride + d * Lq.slot_stride;
    const size_t qp = (size_t(h) * Lq.page_tokens + d) * (Lq.head_dim / Lq.group) * 2;
    quantize_row(src + Lf.k_off + from, Lf.dtype, Lf.head_dim, dst + Lq.k_off + to,
                 reinterpret_cast<uint16_t*>(dst + Lq.kq_off) + qp);
    quantize_row(src + Lf.v_off + from, Lf.dtype, Lf.head_dim, dst + Lq.v_off + to,
                 reinterpret_cast<uint16_t*>(dst + Lq.vq_off) + qp);
  }
  pos_at(dst, Lq, d) = pos_at(src, Lf, s);
  score_at(dst, Lq, d) = score_at(src, Lf, s);
  gen_at(dst, Lq, d) = gen_at(src, Lf, s);
}

}  // namespace

void observe(const ObserveOp& op) {
  for (uint32_t p = 0; p < op.n_pages; ++p) {
    const SegPage& sp = op.pages[p];
    const PageLayout& L = op.layout[sp.cls];
    uint64_t row = sp.out_row;
    for_live(sp.page, L, [&](uint32_t s) {
      float& score = score_at(sp.page, L, s);
      score = accumulate_score(score, op.mass[row++]);  // NaN, inf, < 0 add nothing
    });
  }
}

void select(const SelectOp& op) {
  SelectResult r;
  // Demotion targets starting at slot 0 are fresh pages: the op owns their live masks
  // (a recycled page must not show its previous owner's bits), as append does.
  // Fresh pages are scrubbed whole (they are small): no byte of a previous owner stays.
  for (uint32_t i = 0; i < op.n_demote_dst; ++i)
    if (op.demote_dst[i].first_slot == 0)
      std::memset(op.demote_dst[i].page, 0, op.layout[KVGC_CLASS_INT4].bytes);
  struct Cand {
    double key;
    uint32_t page_index, slot;
  };
  // Every container is sized before the first metadata write, so running out of host
  // memory (an exception) can only happen before the op has changed anything.
  uint64_t n_live = 0;
  for (uint32_t p = 0; p < op.n_pages; ++p) {
    const SegPage& sp = op.pages[p];
    const PageLayout& L = op.layout[sp.cls];
    for (uint32_t w = 0; w < PageLayout::live_words(L.page_tokens); ++w)
      n_live += std::popcount(reinterpret_cast<const uint32_t*>(sp.page + L.live_off)[w]);
  }
  host::vector<Cand> cands, rest, eligible;
  host::vector<uint8_t> victim;
  cands.reserve(n_live);
  rest.reserve(n_live);
  eligible.reserve(n_live);
  victim.reserve(n_live);
  double key_sum = 0;
  // 1. Tenure tokens that left the young window; collect the ranked tiers.
  for (uint32_t p = 0; p < op.n_pages; ++p) {
    const SegPage& sp = op.pages[p];
    const PageLayout& L = op.layout[sp.cls];
    for_live(sp.page, L, [&](uint32_t s) {
      uint8_t& g = gen_at(sp.page, L, s);
      if (gen_of(g) == kGenYoung && pos_at(sp.page, L, s) < op.tenure_before) {
        g = make_gen(kGenIntermediate, 0);
        ++r.tenured;
      }
      if (op.candidates & gen_bit(gen_of(g))) {
        const double k = key_of(op, sp.page, L, s);
        cands.push_back({k, p, s});
        if (std::isfinite(k)) key_sum += k;
      }
    });
  }
  r.ranked = cands.size();
  auto by_key = [](const Cand& a, const Cand& b) {
    return a.key < b.key || (a.key == b.key && (a.page_index < b.page_index ||
                                                (a.page_index == b.page_index && a.slot < b.slot)));
  };
  // 2. Victims, until `reclaim` fp16-token units are given back. With demotion, first
  //    (before any eviction) fp16 tokens ranked at or above the threshold are re-stored
  //    as int4, lowest first, while int4 slots last; then the lowest-ranked are evicted.
  //    Without demotion each victim saves at least min(1, int4_cost), which bounds how
  //    many must be ordered.
  victim.assign(cands.size(), 0);
  if (op.reclaim > 0 && !cands.empty()) {
    const bool demote_on = op.demote_ratio >= 0 && op.n_demote_dst > 0;
    size_t order = cands.size();
    if (!demote_on) {
      const double need = std::ceil(op.reclaim / std::min(op.int4_cost, 1.0)) + 1;
      order = need >= double(cands.size()) ? cands.size() : size_t(need);
      std::nth_element(cands.begin(), cands.begin() + (order - 1), cands.end(), by_key);
    }
    std::sort(cands.begin(), cands.begin() + order, by_key);
    if (demote_on) {
      const double threshold = op.demote_ratio * key_sum / double(cands.size());
      uint32_t run = 0, in_run = 0;
      const size_t first = size_t(std::lower_bound(cands.begin(), cands.end(), threshold,
                                                   [](const Cand& c, double t) { return c.key < t; }) -
                                  cands.begin());
      for (size_t j = first; j < order && r.reclaimed < op.reclaim && run < op.n_demote_dst; ++j) {
        const SegPage& sp = op.pages[cands[j].page_index];
        if (sp.cls != KVGC_CLASS_FP16) continue;
        const AppendRun& dst = op.demote_dst[run];
        const uint32_t d = dst.first_slot + in_run;
        demote_slot(op.layout[KVGC_CLASS_FP16], sp.page, cands[j].slot,
                    op.layout[KVGC_CLASS_INT4], dst.page, d);
        set_live(dst.page, op.layout[KVGC_CLASS_INT4], d, true);
        set_live(sp.page, op.layout[KVGC_CLASS_FP16], cands[j].slot, false);
        if (++in_run == dst.count) ++run, in_run = 0;
        ++r.demoted;
        r.reclaimed += 1.0 - op.int4_cost;
        victim[j] = 2;
      }
    }
    for (size_t i = 0; i < order && r.reclaimed < op.reclaim; ++i) {
      if (victim[i]) continue;
      const SegPage& sp = op.pages[cands[i].page_index];
      set_live(sp.page, op.layout[sp.cls], cands[i].slot, false);
      r.reclaimed += sp.cls == KVGC_CLASS_FP16 ? 1.0 : op.int4_cost;
      ++r.evicted;
      victim[i] = 1;
    }
  }
  // 3. Survivors: promotion (minor GC) or a re-split of the tiers (major GC), then aging.
  for (size_t i = 0; i < cands.size(); ++i)
    if (!victim[i]) rest.push_back(cands[i]);
  auto desc = [&](const Cand& a, const Cand& b) { return by_key(b, a); };
  auto gen_ref = [&](const Cand& c) -> uint8_t& {
    const SegPage& sp = op.pages[c.page_index];
    return gen_at(sp.page, op.layout[sp.cls], c.slot);
  };
  if (op.retier) {
    const size_t top = std::min<size_t>(rest.size(), op.retier_top);
    if (top < rest.size()) std::nth_element(rest.begin(), rest.begin() + top, rest.end(), desc);
    for (size_t i = 0; i < rest.size(); ++i) {
      uint8_t& g = gen_ref(rest[i]);
      const bool lt = i < top;
      if (lt && gen_of(g) != kGenLongTerm) ++r.promoted;
      g = lt ? make_gen(kGenLongTerm, age_of(g)) : make_gen(kGenIntermediate, age_of(g));
    }
  } else if (op.promote > 0 || op.age_intermediate) {
    for (const Cand& c : rest) {
      const uint8_t g = gen_ref(c);
      if (gen_of(g) == kGenIntermediate && age_of(g) >= op.promote_age) eligible.push_back(c);
    }
    const size_t n = std::min<size_t>(eligible.size(), op.promote);
    if (n < eligible.size()) std::nth_element(eligible.begin(), eligible.begin() + n, eligible.end(), desc);
    for (size_t i = 0; i < n; ++i) gen_ref(eligible[i]) = make_gen(kGenLongTerm, 0);
    r.promoted = n;
    r.promote_eligible = eligible.size() - n;
  }
  if (op.age_intermediate)
    for (const Cand& c : rest) {
      uint8_t& g = gen_ref(c);
      if (gen_of(g) == kGenIntermediate) g = make_gen(kGenIntermediate, uint8_t(age_of(g) + 1));
    }
  // 4. Page-granular results.
  for (uint32_t p = 0; p < op.n_pages; ++p) {
    const SegPage& sp = op.pages[p];
    const PageLayout& L = op.layout[sp.cls];
    uint32_t n = 0;
    for_live(sp.page, L, [&](uint32_t s) {
      ++n;
      ++r.tier[gen_of(gen_at(sp.page, L, s))];
    });
    op.page_live[p] = uint16_t(n);
    r.live[sp.cls] += n;
  }
  *op.result = r;
}

void compact(const CompactOp& op) {
  const PageLayout& L = op.layout;
  const size_t qp_bytes = L.cls == KVGC_CLASS_INT4 ? (L.head_dim / L.group) * 4 : 0;
  host::vector<std::pair<uint32_t, uint32_t>> pairs;  // (hole in dst, live slot of src)
  pairs.reserve(L.page_tokens);  // before any move: a move never pairs more slots than this
  for (uint32_t m = 0; m < op.n_moves; ++m) {
    const CompactMove& mv = op.moves[m];
    // Pair the first holes of dst with the last live slots of src (the plan guarantees
    // enough of both), then copy head by head: one head's rows of a page are contiguous,
    // so each head's copies walk one region in order (bench/gc: slot-major order, which
    // touches every head's region per slot, ran at 0.45x memcpy).
    pairs.clear();
    uint32_t hole = 0, src = L.page_tokens;
    for (uint32_t i = 0; i < mv.count; ++i) {
      while (is_live(mv.dst, L, hole)) ++hole;
      do --src; while (!is_live(mv.src, L, src));
      pairs.push_back({hole++, src});
    }
    for (uint32_t h = 0; h < L.n_kv_heads; ++h) {
      for (size_t off : {L.k_off, L.v_off})
        for (const auto& [d, s] : pairs)
          std::memcpy(mv.dst + off + h * L.head_stride + d * L.slot_stride,
                      mv.src + off + h * L.head_stride + s * L.slot_stride, L.slot_stride);
      if (qp_bytes)
        for (size_t off : {L.kq_off, L.vq_off})
          for (const auto& [d, s] : pairs)
            std::memcpy(mv.dst + off + (size_t(h) * L.page_tokens + d) * qp_bytes,
                        mv.src + off + (size_t(h) * L.page_tokens + s) * qp_bytes, qp_bytes);
    }
    for (const auto& [d, s] : pairs) {
      pos_at(mv.dst, L, d) = pos_at(mv.src, L, s);
      score_at(mv.dst, L, d) = score_at(mv.src, L, s);
      gen_at(mv.dst, L, d) = gen_at(mv.src, L, s);
      set_live(mv.dst, L, d, true);
      set_live(mv.src, L, s, false);
    }
  }
}

}  // namespace kvgc::cpu
