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

#include "../ladder_walk.hpp"
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

float& recent_at(uint8_t* page, const PageLayout& L, uint32_t slot) {
  return reinterpret_cast<float*>(page + L.recent_off)[slot];
}

double key_of(const SelectOp& op, uint8_t* page, const PageLayout& L, uint32_t slot) {
  const int32_t pos = pos_at(page, L, slot);
  switch (op.key) {
    case KeyKind::Position: return double(pos);
    case KeyKind::Random:
      return double(splitmix(op.seed ^ splitmix(op.segment_salt ^ uint64_t(uint32_t(pos)))) >> 11);
    case KeyKind::Score:
    case KeyKind::Recent:
    default: {
      double k = op.key == KeyKind::Recent ? recent_at(page, L, slot) : score_at(page, L, slot);
      if (op.noise > 0)
        k += laplace(op.noise, splitmix(op.seed ^ splitmix(op.segment_salt ^ splitmix(op.epoch ^ (uint64_t(uint32_t(pos)) << 20)))));
      return rankable(k);
    }
  }
}

// Re-stores slot s of segment page `src` (layout Ls) into slot d of page `dst` (layout
// Ld, a cheaper class): K and V of every head through the model dtype, read where the
// source keeps them (payload_of: a shared page's are elsewhere), metadata copied from its
// header. dst is a destination run's page: private, whole.
void move_slot(const PageLayout& Ls, const SegPage& src, uint32_t s, const PageLayout& Ld,
               uint8_t* dst, uint32_t d, host::vector<uint8_t>& row) {
  row.resize(size_t(Ls.head_dim) * dtype_bytes(Ls.dtype));
  for (uint32_t h = 0; h < Ls.n_kv_heads; ++h)
    for (bool v : {false, true}) {
      load_row(Ls, payload_of(src), h, s, v, row.data());
      store_row(Ld, dst, h, d, v, row.data());
    }
  pos_at(dst, Ld, d) = pos_at(src.page, Ls, s);
  score_at(dst, Ld, d) = score_at(src.page, Ls, s);
  recent_at(dst, Ld, d) = recent_at(src.page, Ls, s);
  gen_at(dst, Ld, d) = make_gen(gen_of(gen_at(src.page, Ls, s)), age_of(gen_at(src.page, Ls, s)));
}

// The walk's rules (kernels/ladder_walk.hpp) for an op.
WalkRules walk_rules(const SelectOp& op) {
  WalkRules w{op.n_ladder, op.ladder, op.slope, op.unit_cost, op.reclaim, op.budget_bytes,
              op.layout[KVGC_CLASS_FP16].page_tokens, {}};
  for (int c = 0; c < KVGC_CLASS_COUNT; ++c) w.page_bytes[c] = op.layout[c].bytes;
  return w;
}

}  // namespace

void observe(const ObserveOp& op) {
  for (uint32_t p = 0; p < op.n_pages; ++p) {
    const SegPage& sp = op.pages[p];
    const PageLayout& L = op.layout[sp.cls];
    uint64_t row = sp.out_row;
    const uint64_t page_row = uint64_t(p) * L.page_tokens;
    for_live(sp.page, L, [&](uint32_t s) {
      const float m = op.by_slot ? op.mass[page_row + s] : op.mass[row++];  // NaN, inf, < 0 add nothing (kernels/score.hpp)
      float& score = score_at(sp.page, L, s);
      score = accumulate_score(score, m);
      float& recent = recent_at(sp.page, L, s);
      recent = accumulate_score(recent * op.decay, m);
    });
  }
}

void select(const SelectOp& op) {
  SelectResult r;
  struct Cand {
    double key;
    uint32_t page_index, slot;
    uint32_t cls;  // the class it counts at (counted_class)
    bool in_place;  // a shared page's slot under charge_shared: demotion only charges it
  };
  struct Dest {
    uint8_t* page;
    uint32_t slot;
  };
  // Scrubbing: fresh destination pages (runs from slot 0) are in the segment's page list
  // from now until the results are applied, used or not (an unused one goes back to the
  // pool only then: runtime/harvest.cpp), so the op that takes them zeroes them whole,
  // first: no byte of a previous owner is in them at any time, and nothing reads their
  // live masks before they are clear (the count below read a previous owner's bits, or
  // never-written bytes: valgrind's finding, issue 22). Idempotent, so it may come before
  // the containers: if one of them cannot be had, the pages go back zeroed, nothing else
  // changed.
  for (int c = 0; c < KVGC_CLASS_COUNT; ++c)
    for (uint32_t i = 0; i < op.n_demote_dst[c]; ++i)
      if (op.demote_dst[c][i].first_slot == 0)
        std::memset(op.demote_dst[c][i].page, 0, op.layout[c].bytes);
  // Every container is sized before the first metadata write of a live slot, so running
  // out of host memory (an exception) can only happen before the op has changed anything
  // but the fresh pages, which it zeroed.
  uint64_t n_live = 0;
  for (uint32_t p = 0; p < op.n_pages; ++p) {
    const SegPage& sp = op.pages[p];
    const PageLayout& L = op.layout[sp.cls];
    for (uint32_t w = 0; w < PageLayout::live_words(L.page_tokens); ++w)
      n_live += std::popcount(reinterpret_cast<const uint32_t*>(sp.page + L.live_off)[w]);
  }
  host::vector<Cand> cands, rest, eligible;
  host::vector<uint8_t> victim, at, from;
  host::vector<double> weight;
  host::vector<Dest> dest, slots[KVGC_CLASS_COUNT];
  host::vector<uint8_t> row;
  for (auto* v : {&cands, &rest, &eligible}) v->reserve(n_live);
  for (auto* v : {&victim, &at, &from}) v->reserve(n_live);
  weight.reserve(n_live);
  dest.reserve(n_live);
  for (int c = 0; c < KVGC_CLASS_COUNT; ++c) {
    size_t room = 0;
    for (uint32_t i = 0; i < op.n_demote_dst[c]; ++i) room += op.demote_dst[c][i].count;
    slots[c].reserve(room);
    for (uint32_t i = 0; i < op.n_demote_dst[c]; ++i)
      for (uint32_t k = 0; k < op.demote_dst[c][i].count; ++k) {
        const uint32_t slot = op.demote_dst[c][i].first_slot + k;
        slots[c].push_back({op.demote_dst[c][i].page, slot});
      }
  }
  row.resize(size_t(op.layout[0].head_dim) * dtype_bytes(op.layout[0].dtype));
  uint64_t live_cls[KVGC_CLASS_COUNT] = {};
  int position_of[KVGC_CLASS_COUNT];  // a class's place on the ladder, -1 off it
  std::fill_n(position_of, KVGC_CLASS_COUNT, -1);
  for (uint32_t i = 0; i < op.n_ladder; ++i) position_of[op.ladder[i]] = int(i);
  // 1. Tenure tokens that left the young window; collect the ranked tiers.
  for (uint32_t p = 0; p < op.n_pages; ++p) {
    const SegPage& sp = op.pages[p];
    const PageLayout& L = op.layout[sp.cls];
    const bool in_place = op.charge_shared && sp.kv;
    for_live(sp.page, L, [&](uint32_t s) {
      uint8_t& g = gen_at(sp.page, L, s);
      const uint32_t cls = counted_class(g, sp.cls);
      ++live_cls[cls];
      if (gen_of(g) == kGenYoung && pos_at(sp.page, L, s) < op.tenure_before) {
        g = make_gen(kGenIntermediate, 0, g);
        ++r.tenured;
      }
      if (op.candidates & gen_bit(gen_of(g))) cands.push_back({key_of(op, sp.page, L, s), p, s, cls, in_place});
    });
  }
  r.ranked = cands.size();
  auto by_key = [](const Cand& a, const Cand& b) {
    return a.key < b.key || (a.key == b.key && (a.page_index < b.page_index ||
                                                (a.page_index == b.page_index && a.slot < b.slot)));
  };
  const size_t n = cands.size();
  victim.assign(n, 0);
  // Only a collection that gives something back decides classes: then every candidate's
  // rung is set (and the ladder made monotone) by this one decision.
  const WalkRules rules = walk_rules(op);
  const bool reclaims =
      op.reclaim > 0 || (op.budget_bytes > 0 && walk_held_bytes(rules, live_cls) > op.budget_bytes);
  if (reclaims && n > 0) {
    // 2. Order, then the ladder walk. Without a ladder or a byte budget, and with every
    //    candidate fp16 (as a heap without a ladder holds), only the lowest need an
    //    order: each eviction gives back a whole fp16 token. A class off the ladder
    //    (which no heap holds: its ladder is fixed) is left as it is.
    size_t order = n;
    const bool all_fp16 = std::all_of(cands.begin(), cands.end(), [&](const Cand& c) {
      return c.cls == KVGC_CLASS_FP16;
    });
    if (op.n_ladder == 1 && op.budget_bytes == 0 && all_fp16) {
      const uint64_t per = op.unit_cost[KVGC_CLASS_FP16];
      const uint64_t need = (op.reclaim + per - 1) / per + 1;
      order = need >= n ? n : size_t(need);
      std::nth_element(cands.begin(), cands.begin() + (order - 1), cands.end(), by_key);
    }
    std::sort(cands.begin(), cands.begin() + order, by_key);
    weight.resize(order);
    at.resize(order);
    from.resize(order);
    for (size_t i = 0; i < order; ++i) {
      weight[i] = key_is_score(op.key) ? std::max(cands[i].key, 0.0) : 1.0;
      const int pos = position_of[cands[i].cls];
      from[i] = at[i] = uint8_t(pos < 0 ? op.n_ladder : pos);  // off the ladder: untouched
    }
    uint64_t walked[KVGC_CLASS_COUNT];  // the walk's own view; the assignment recounts
    std::copy(std::begin(live_cls), std::end(live_cls), walked);
    ladder_walk(rules, weight.data(), from.data(), at.data(), order, walked);
    // 3. Assignment from the top: no candidate may be dearer than one ranked above it
    //    (floor), nor take a slot its class has no room for (then the next rung down;
    //    eviction always has room; a token demoted in place takes no slot).
    const uint32_t evicted = op.n_ladder;
    size_t taken[KVGC_CLASS_COUNT] = {};
    uint32_t floor = 0;
    for (size_t i = order; i-- > 0;) {
      uint32_t to = std::max<uint32_t>(at[i], floor);
      const bool moves = !cands[i].in_place;
      while (moves && to < evicted && to != from[i] && taken[op.ladder[to]] == slots[op.ladder[to]].size()) ++to;
      if (moves && to < evicted && to != from[i]) ++taken[op.ladder[to]];
      at[i] = uint8_t(floor = to);
      --live_cls[cands[i].cls];
      if (to < evicted) ++live_cls[op.ladder[to]];
    }
    // 4. The byte budget: while the pages the segment would keep after compaction exceed
    //    it, the lowest-ranked survivor goes (from the bottom, so the ladder stays
    //    monotone), and a slot it would have taken stays free.
    for (size_t i = 0; op.budget_bytes > 0 && i < order && walk_held_bytes(rules, live_cls) > op.budget_bytes; ++i) {
      if (at[i] == evicted) continue;
      const int cls = op.ladder[at[i]];
      if (at[i] != from[i] && !cands[i].in_place) --taken[cls];
      --live_cls[cls];
      at[i] = uint8_t(evicted);
    }
    // 5. Destinations, from the top: each class's slots in order (fresh pages were zeroed
    //    whole when the op began).
    dest.assign(order, Dest{nullptr, 0});
    size_t next_slot[KVGC_CLASS_COUNT] = {};
    for (size_t i = order; i-- > 0;)
      if (at[i] != from[i] && at[i] != evicted && !cands[i].in_place)
        dest[i] = slots[op.ladder[at[i]]][next_slot[op.ladder[at[i]]]++];
    // 6. Apply: evictions clear live bits; demotions re-store the token one or more rungs
    //    down (through the model dtype) and move its metadata, or, in place, record the
    //    class it is charged at.
    for (size_t i = 0; i < order; ++i) {
      if (at[i] == from[i]) continue;
      const SegPage& sp = op.pages[cands[i].page_index];
      const uint32_t s = cands[i].slot;
      if (at[i] == evicted) {
        set_live(sp.page, op.layout[sp.cls], s, false);
        uint8_t& g = gen_at(sp.page, op.layout[sp.cls], s);
        g = make_gen(gen_of(g), age_of(g));
        r.reclaimed += op.unit_cost[cands[i].cls];
        ++r.evicted;
        victim[i] = 1;
        continue;
      }
      const int cls = op.ladder[at[i]];
      if (cands[i].in_place) {
        uint8_t& g = gen_at(sp.page, op.layout[sp.cls], s);
        g = with_charged(g, uint32_t(cls));
      } else {
        move_slot(op.layout[sp.cls], sp, s, op.layout[cls], dest[i].page, dest[i].slot, row);
        set_live(dest[i].page, op.layout[cls], dest[i].slot, true);
        set_live(sp.page, op.layout[sp.cls], s, false);
      }
      r.reclaimed += op.unit_cost[cands[i].cls] - op.unit_cost[cls];
      ++r.demoted;
      victim[i] = 2;
    }
    for (int c = 0; c < KVGC_CLASS_COUNT; ++c) r.demoted_to[c] = taken[c];
  }
  // 7. Survivors: promotion (minor GC) or a re-split of the tiers (major GC), then aging.
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
      g = make_gen(lt ? kGenLongTerm : kGenIntermediate, age_of(g), g);
    }
  } else if (op.promote > 0 || op.age_intermediate) {
    for (const Cand& c : rest) {
      const uint8_t g = gen_ref(c);
      if (gen_of(g) == kGenIntermediate && age_of(g) >= op.promote_age) eligible.push_back(c);
    }
    const size_t k = std::min<size_t>(eligible.size(), op.promote);
    if (k < eligible.size()) std::nth_element(eligible.begin(), eligible.begin() + k, eligible.end(), desc);
    for (size_t i = 0; i < k; ++i) gen_ref(eligible[i]) = make_gen(kGenLongTerm, 0, gen_ref(eligible[i]));
    r.promoted = k;
    r.promote_eligible = eligible.size() - k;
  }
  if (op.age_intermediate)
    for (const Cand& c : rest) {
      uint8_t& g = gen_ref(c);
      if (gen_of(g) == kGenIntermediate) g = make_gen(kGenIntermediate, uint8_t(age_of(g) + 1), g);
    }
  // 8. Page-granular results.
  for (uint32_t p = 0; p < op.n_pages; ++p) {
    const SegPage& sp = op.pages[p];
    const PageLayout& L = op.layout[sp.cls];
    uint32_t k = 0, classes = 0;
    for_live(sp.page, L, [&](uint32_t s) {
      ++k;
      const uint8_t g = gen_at(sp.page, L, s);
      ++r.tier[gen_of(g)];
      if (charged_of(g)) ++r.shift[charged_of(g)], --r.shift[sp.cls];
      classes |= 1u << counted_class(g, sp.cls);
    });
    op.page_live[p] = uint16_t(k);
    if (op.page_classes) op.page_classes[p] = uint8_t(classes);
    r.live[sp.cls] += k;
  }
  *op.result = r;
}

void requant(const RequantOp& op) {
  const PageLayout &Ls = op.src_layout, &Ld = op.dst_layout;
  host::vector<uint8_t> row(size_t(Ls.head_dim) * dtype_bytes(Ls.dtype));
  for (uint32_t p = 0; p < op.n_pages; ++p) {
    const RequantPage& rp = op.pages[p];
    std::memset(rp.dst, 0, Ld.bytes);
    for (uint32_t s = 0; s < rp.used; ++s)
      for (uint32_t h = 0; h < Ls.n_kv_heads; ++h)
        for (bool v : {false, true}) {
          load_row(Ls, rp.src, h, s, v, row.data());
          store_row(Ld, rp.dst, h, s, v, row.data());
        }
  }
}

void compact(const CompactOp& op) {
  const PageLayout& L = op.layout;
  const size_t qp_bytes = size_t(L.qwords) * 2;  // quantisation words of one (head, slot)
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
      recent_at(mv.dst, L, d) = recent_at(mv.src, L, s);
      gen_at(mv.dst, L, d) = gen_at(mv.src, L, s);
      set_live(mv.dst, L, d, true);
      set_live(mv.src, L, s, false);
    }
  }
}

}  // namespace kvgc::cpu
