// Shared pages (SegPage::kv set) through the CPU executor. A segment of random pages of
// every class is run twice: whole (the reference) and split, where a page is its
// holder's header alone (exactly k_off bytes, a heap block of its own) plus the page
// whose K/V it reads, that page's own header overwritten with garbage (and poisoned
// under ASan). Attention (scores or not, decode and chunks, GQA, every vector level,
// split-K, a batch), gather (K, V, positions, scores, generations) and select (eviction,
// int8/int4 demotion) must give bit for bit the reference's outputs, headers and live
// counts, and leave every shared page exactly as it was.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#define KVGC_TEST_POISON(p, n) ASAN_POISON_MEMORY_REGION(p, n)
#define KVGC_TEST_UNPOISON(p, n) ASAN_UNPOISON_MEMORY_REGION(p, n)
#else
#define KVGC_TEST_POISON(p, n) ((void)(p), (void)(n))
#define KVGC_TEST_UNPOISON(p, n) ((void)(p), (void)(n))
#endif

#include "../gc/ladder.hpp"
#include "../kernels/cpu/attend.hpp"
#include "../kernels/cpu/attend_internal.hpp"
#include "../kernels/cpu/convert.hpp"
#include "../kernels/cpu/copy.hpp"
#include "../kernels/cpu/gc.hpp"
#include "../kernels/cpu/quant.hpp"
#include "../kernels/cpu/thread_pool.hpp"
#include "util.hpp"

using namespace kvgc;

namespace {

using Bytes = std::vector<uint8_t>;

struct Geometry {
  uint32_t page_tokens, kv_heads, head_dim, gqa;
  kvgc_dtype dtype;
  uint32_t pages;
};

// head_dim 64: AVX-512 and AVX2; 48: AVX2 only; 40: the portable path only. 33 slots: two
// live words a page.
const Geometry kGeometries[] = {
    {16, 2, 64, 1, KVGC_DTYPE_F16, 24},  {8, 2, 128, 4, KVGC_DTYPE_BF16, 30},
    {16, 1, 48, 3, KVGC_DTYPE_F32, 20},  {33, 3, 32, 2, KVGC_DTYPE_F16, 12},
    {8, 1, 40, 2, KVGC_DTYPE_F16, 16},
};

// A segment's pages whole, each a heap block of exactly its layout's bytes. Classes
// cycle FP16, INT8, FP16, INT4; FP16 pages are written by the append op, INT8 and INT4
// ones quantised by store_row; a fifth of the slots evicted, the last page partly used,
// scores with ties, every generation.
struct Proto {
  PageLayout L[KVGC_CLASS_COUNT];
  std::vector<Bytes> pages;
  std::vector<uint32_t> cls;
  int64_t length = 0;
};

Proto build(const Geometry& g, std::mt19937& rng) {
  Proto s;
  for (int c = 0; c < KVGC_CLASS_COUNT; ++c)
    s.L[c] = PageLayout::make(g.page_tokens, g.kv_heads, g.head_dim, g.dtype, kvgc_storage_class(c));
  std::normal_distribution<float> gauss(0.f, 1.f);
  const uint32_t eb = dtype_bytes(g.dtype);
  const size_t row = size_t(g.head_dim) * eb, token = row * g.kv_heads;
  const uint32_t cycle[4] = {KVGC_CLASS_FP16, KVGC_CLASS_INT8, KVGC_CLASS_FP16, KVGC_CLASS_INT4};
  int32_t pos = 0;
  for (uint32_t p = 0; p < g.pages; ++p) {
    const uint32_t cls = cycle[p % 4];
    const PageLayout& L = s.L[cls];
    const uint32_t used = p + 1 == g.pages ? 1 + rng() % g.page_tokens : g.page_tokens;
    Bytes page(L.bytes);
    for (auto& b : page) b = uint8_t(rng());  // a recycled page: the writers scrub it
    Bytes k(used * token), v(used * token);
    for (Bytes* x : {&k, &v})
      for (size_t i = 0; i < x->size() / eb; ++i) cpu::store(&(*x)[i * eb], g.dtype, 1.5f * gauss(rng));
    if (cls == KVGC_CLASS_FP16) {
      const AppendRun run{page.data(), 0, used, 0};
      cpu::append({L, k.data(), v.data(), pos, 4, &run, 1});
    } else {
      std::memset(page.data(), 0, page.size());
      for (uint32_t t = 0; t < used; ++t) {
        reinterpret_cast<int32_t*>(page.data() + L.pos_off)[t] = pos + int32_t(t);
        reinterpret_cast<uint32_t*>(page.data() + L.live_off)[t / 32] |= 1u << (t % 32);
        for (uint32_t h = 0; h < g.kv_heads; ++h) {
          cpu::store_row(L, page.data(), h, t, false, &k[t * token + h * row]);
          cpu::store_row(L, page.data(), h, t, true, &v[t * token + h * row]);
        }
      }
    }
    auto* live = reinterpret_cast<uint32_t*>(page.data() + L.live_off);
    for (uint32_t t = 0; t < used; ++t) {
      if (rng() % 5 == 0) live[t / 32] &= ~(1u << (t % 32));
      reinterpret_cast<float*>(page.data() + L.score_off)[t] = float(rng() % 64) / 16.f;
      reinterpret_cast<float*>(page.data() + L.recent_off)[t] = float(rng() % 64) / 16.f;
      const uint8_t gen = pos + int32_t(t) < 4 ? uint8_t(kGenSink) : uint8_t(1 + rng() % 3);
      page[L.gen_off + t] = make_gen(gen, uint8_t(rng() % 5));
    }
    pos += int32_t(g.page_tokens);
    s.pages.push_back(std::move(page));
    s.cls.push_back(cls);
  }
  s.length = pos;
  return s;
}

uint32_t live_count(const PageLayout& L, const uint8_t* header) {
  uint32_t n = 0;
  for (uint32_t w = 0; w < PageLayout::live_words(L.page_tokens); ++w)
    n += uint32_t(__builtin_popcount(reinterpret_cast<const uint32_t*>(header + L.live_off)[w]));
  return n;
}

// Live slots of pages [first, last) of the segment.
uint64_t live_rows(const Proto& s, uint32_t first, uint32_t last) {
  uint64_t n = 0;
  for (uint32_t i = first; i < last; ++i) n += live_count(s.L[s.cls[i]], s.pages[i].data());
  return n;
}

// The segment twice. whole: private copies of the pages (the reference's SegPages in
// ref). Split (every page but each fifth, which stays private): own[i] is the header
// alone, exactly k_off bytes, and shared[i] the page, its header garbage; split's
// SegPages point at both.
struct Twin {
  const Proto& proto;
  std::vector<Bytes> whole, own, shared, shared_before;
  std::vector<SegPage> ref, split;
  uint64_t live = 0;

  explicit Twin(const Proto& p, std::mt19937& rng) : proto(p), whole(p.pages), own(p.pages.size()),
                                                    shared(p.pages.size()), shared_before(p.pages.size()) {
    for (size_t i = 0; i < whole.size(); ++i) {
      const PageLayout& L = p.L[p.cls[i]];
      ref.push_back({whole[i].data(), p.cls[i], live});
      if (i % 5 == 4) {  // private
        own[i] = p.pages[i];
        split.push_back({own[i].data(), p.cls[i], live});
      } else {
        own[i].assign(p.pages[i].begin(), p.pages[i].begin() + ptrdiff_t(L.k_off));
        shared[i] = p.pages[i];
        for (size_t b = 0; b < L.k_off; ++b) shared[i][b] = uint8_t(rng());
        shared_before[i] = shared[i];
        KVGC_TEST_POISON(shared[i].data(), L.k_off);  // no kernel reads a shared page's header
        split.push_back({own[i].data(), p.cls[i], live, shared[i].data()});
      }
      live += live_count(L, p.pages[i].data());
    }
  }
  ~Twin() { unpoison(); }
  Twin(const Twin&) = delete;

  void unpoison() {
    for (size_t i = 0; i < shared.size(); ++i)
      if (!shared[i].empty()) KVGC_TEST_UNPOISON(shared[i].data(), proto.L[proto.cls[i]].k_off);
  }
  // Empty when the split segment holds what the whole one does: headers equal to the
  // reference pages', private pages equal whole, shared pages untouched (header garbage
  // and payload alike).
  std::string differences() {
    unpoison();
    for (size_t i = 0; i < whole.size(); ++i) {
      const std::string at = "page " + std::to_string(i) + " (" + class_name(proto.cls[i]) + ")";
      if (shared[i].empty()) {
        if (own[i] != whole[i]) return at + ": the private page differs";
        continue;
      }
      const size_t k_off = proto.L[proto.cls[i]].k_off;
      if (std::memcmp(own[i].data(), whole[i].data(), k_off) != 0) return at + ": the header differs";
      if (shared[i] != shared_before[i]) return at + ": the shared page was written";
      if (std::memcmp(shared[i].data() + k_off, whole[i].data() + k_off, whole[i].size() - k_off) != 0)
        return at + ": the shared payload differs from the whole page's";
    }
    return "";
  }
};

Bytes random_q(const Geometry& g, uint32_t rows, std::mt19937& rng) {
  std::normal_distribution<float> gauss(0.f, 1.f);
  const uint32_t eb = dtype_bytes(g.dtype);
  Bytes q(size_t(rows) * g.kv_heads * g.gqa * g.head_dim * eb);
  for (size_t i = 0; i < q.size() / eb; ++i) cpu::store(&q[i * eb], g.dtype, 2.f * gauss(rng));
  return q;
}

// The op over `pages` (the twin's ref or split list), out poisoned; returns out.
Bytes attend(const Proto& s, const Geometry& g, const std::vector<SegPage>& pages, uint64_t live,
             const Bytes& q, uint32_t n_q, bool scores, const std::vector<AttendSeq>& seqs,
             cpu::ThreadPool* pool) {
  Bytes out(q.size(), 0xA5);
  AttendOp op{};
  for (int c = 0; c < KVGC_CLASS_COUNT; ++c) op.layout[c] = s.L[c];
  op.pages = pages.data();
  op.n_pages = uint32_t(pages.size());
  op.n_live = live;
  op.q = q.data();
  op.n_q = n_q;
  op.q_heads = g.kv_heads * g.gqa;
  op.q_pos0 = s.length - n_q;
  op.scale = 1.f / std::sqrt(float(g.head_dim));
  op.out = out.data();
  op.add_scores = scores;
  op.recent_decay = 0.75f;
  op.seqs = seqs.empty() ? nullptr : seqs.data();
  op.n_seqs = uint32_t(seqs.size());
  cpu::attend(op, pool);
  return out;
}

}  // namespace

TEST_CASE("shared pages: attention reads K/V at kv, scores at the header, bit for bit as whole pages") {
  const uint32_t seed = kvgc_test::fresh_seed("test_shared_kernels attend");
  std::mt19937 rng(seed);
  cpu::ThreadPool pool(2);
  cpu::set_split_min_slots(16);  // split-K cuts even these short segments
  for (const Geometry& g : kGeometries) {
    CAPTURE(g.head_dim);
    CAPTURE(g.gqa);
    CAPTURE(g.dtype);
    const Proto s = build(g, rng);
    for (uint32_t n_q : {1u, 4u}) {
      const Bytes q = random_q(g, n_q, rng);
      for (bool scores : {true, false})
        for (int level : {2, 1, 0})
          for (cpu::ThreadPool* p : {static_cast<cpu::ThreadPool*>(nullptr), &pool}) {
            if (level == 0 && p) continue;  // the portable path is single-threaded
            cpu::set_simd_level(level);
            CAPTURE(n_q);
            CAPTURE(scores);
            CAPTURE(std::string(cpu::simd_name()));
            CAPTURE(p != nullptr);
            Twin t(s, rng);
            const Bytes ref = attend(s, g, t.ref, t.live, q, n_q, scores, {}, p);
            const Bytes got = attend(s, g, t.split, t.live, q, n_q, scores, {}, p);
            CHECK(ref == got);
            const std::string diff = t.differences();
            INFO(diff);
            CHECK(diff.empty());
          }
    }
    // A batch: two sequences (the first scoring only its last rows), with and without a pool.
    const uint32_t half = g.pages / 2;
    const std::vector<AttendSeq> seqs = {
        {0, half, live_rows(s, 0, half), 0, 3, s.length - 3, 0.5f, 1},
        {half, g.pages - half, live_rows(s, half, g.pages), 3, 2, s.length - 2, 0.9f}};
    const Bytes q = random_q(g, 5, rng);
    cpu::set_simd(true);
    for (cpu::ThreadPool* p : {static_cast<cpu::ThreadPool*>(nullptr), &pool}) {
      Twin t(s, rng);
      CHECK(attend(s, g, t.ref, t.live, q, 0, true, seqs, p) == attend(s, g, t.split, t.live, q, 0, true, seqs, p));
      const std::string diff = t.differences();
      INFO(diff);
      CHECK(diff.empty());
    }
  }
  cpu::set_split_min_slots(0);
  cpu::set_simd(true);
}

TEST_CASE("shared pages: gather reads K/V at kv and the rest at the header, bit for bit as whole pages") {
  const uint32_t seed = kvgc_test::fresh_seed("test_shared_kernels gather");
  std::mt19937 rng(seed);
  for (const Geometry& g : kGeometries) {
    CAPTURE(g.head_dim);
    CAPTURE(g.dtype);
    const Proto s = build(g, rng);
    Twin t(s, rng);
    const size_t token = size_t(g.kv_heads) * g.head_dim * dtype_bytes(g.dtype);
    struct Out {
      Bytes k, v, gen;
      std::vector<int32_t> pos;
      std::vector<float> score;
    };
    auto gather = [&](const std::vector<SegPage>& pages) {
      Out o{Bytes(t.live * token, 0xA5), Bytes(t.live * token, 0x5A), Bytes(t.live, 0xEE),
            std::vector<int32_t>(t.live, -7), std::vector<float>(t.live, NAN)};
      GatherOp op{};
      for (int c = 0; c < KVGC_CLASS_COUNT; ++c) op.layout[c] = s.L[c];
      op.pages = pages.data();
      op.n_pages = uint32_t(pages.size());
      op.k_out = o.k.data();
      op.v_out = o.v.data();
      op.pos_out = o.pos.data();
      op.score_out = o.score.data();
      op.gen_out = o.gen.data();
      cpu::gather(op);
      return o;
    };
    const Out ref = gather(t.ref), got = gather(t.split);
    CHECK(ref.k == got.k);
    CHECK(ref.v == got.v);
    CHECK(ref.pos == got.pos);
    CHECK(std::memcmp(ref.score.data(), got.score.data(), ref.score.size() * 4) == 0);
    CHECK(ref.gen == got.gen);
    const std::string diff = t.differences();
    INFO(diff);
    CHECK(diff.empty());
  }
}

TEST_CASE("shared pages: select demotes from kv into private pages and evicts at the header, as whole pages") {
  const uint32_t seed = kvgc_test::fresh_seed("test_shared_kernels select");
  std::mt19937 rng(seed);
  SelectResult total;
  for (int iter = 0; iter < 60; ++iter) {
    CAPTURE(iter);
    const Geometry& g = kGeometries[iter % std::size(kGeometries)];
    const Proto s = build(g, rng);
    Twin t(s, rng);
    const kvgc_demote demote = iter % 4 == 3 ? kvgc_demote(rng() % 3) : KVGC_DEMOTE_LADDER;
    CAPTURE(int(demote));
    SelectOp op{};
    uint64_t bytes[KVGC_CLASS_COUNT];
    for (int c = 0; c < KVGC_CLASS_COUNT; ++c) op.layout[c] = s.L[c], op.unit_cost[c] = bytes[c] = s.L[c].bytes;
    std::string note;
    const Ladder ladder = make_ladder(demote, bytes, &note);
    op.n_ladder = ladder.n;
    for (int r = 0; r < 3; ++r) op.ladder[r] = ladder.cls[r], op.slope[r] = ladder.slope[r];
    // Destinations: fresh private pages of the ladder's cheaper classes (garbage: the op
    // zeroes them), one set for each run. (A page's buffer stays put as the list grows.)
    std::vector<Bytes> dst_ref, dst_split;
    std::vector<AppendRun> runs_ref[KVGC_CLASS_COUNT], runs_split[KVGC_CLASS_COUNT];
    for (uint32_t r = 1; r < ladder.n; ++r) {
      const uint32_t c = ladder.cls[r];
      for (uint32_t f = 0, n = 1 + rng() % 2; f < n; ++f) {
        Bytes page(s.L[c].bytes);
        for (auto& b : page) b = uint8_t(rng());
        dst_ref.push_back(page);
        dst_split.push_back(page);
        const uint32_t count = 1 + rng() % g.page_tokens;
        runs_ref[c].push_back({dst_ref.back().data(), 0, count, 0});
        runs_split[c].push_back({dst_split.back().data(), 0, count, 0});
      }
    }
    std::vector<SegPage> pages_ref = t.ref, pages_split = t.split;
    for (int c = 0; c < KVGC_CLASS_COUNT; ++c)
      for (size_t i = 0; i < runs_ref[c].size(); ++i) {
        pages_ref.push_back({runs_ref[c][i].page, uint32_t(c), 0});
        pages_split.push_back({runs_split[c][i].page, uint32_t(c), 0});
      }
    op.n_pages = uint32_t(pages_ref.size());
    op.tenure_before = int64_t(rng() % uint64_t(s.length + 1));
    op.candidates = uint8_t(gen_bit(kGenIntermediate) | (rng() % 2 ? gen_bit(kGenLongTerm) : 0));
    op.key = KeyKind(rng() % 4);
    op.noise = key_is_score(op.key) && rng() % 3 == 0 ? 0.05 : 0.0;
    op.seed = rng();
    op.segment_salt = rng();
    op.epoch = rng() % 100;
    const uint64_t fp16 = bytes[KVGC_CLASS_FP16];
    const uint64_t reclaims[] = {0, 1, fp16 * 5 + fp16 / 2, fp16 * uint64_t(s.length) / 3};
    op.reclaim = reclaims[rng() % 4];
    op.budget_bytes = rng() % 3 == 0 ? 1 + rng() % (op.n_pages * fp16) : 0;
    op.promote = rng() % 2 ? 0 : rng() % 20;
    op.promote_age = 2;
    op.retier = rng() % 4 == 0;
    op.retier_top = rng() % uint64_t(s.length + 1);
    op.age_intermediate = rng() % 2;
    CAPTURE(op.reclaim);
    CAPTURE(op.budget_bytes);
    CAPTURE(int(op.key));
    SelectOp sop = op;
    std::vector<uint16_t> live_ref(op.n_pages, 0xFFFF), live_split(op.n_pages, 0xEEEE);
    SelectResult r_ref, r_split;
    std::memset(static_cast<void*>(&r_split), 0xAB, sizeof r_split);
    op.pages = pages_ref.data();
    sop.pages = pages_split.data();
    for (int c = 0; c < KVGC_CLASS_COUNT; ++c) {
      op.demote_dst[c] = runs_ref[c].data();
      sop.demote_dst[c] = runs_split[c].data();
      op.n_demote_dst[c] = sop.n_demote_dst[c] = uint32_t(runs_ref[c].size());
    }
    op.page_live = live_ref.data();
    op.result = &r_ref;
    sop.page_live = live_split.data();
    sop.result = &r_split;
    cpu::select(op);
    cpu::select(sop);
    CHECK(std::memcmp(&r_ref, &r_split, sizeof r_ref) == 0);
    CHECK(live_ref == live_split);
    CHECK(dst_ref == dst_split);
    const std::string diff = t.differences();
    INFO(diff);
    CHECK(diff.empty());
    total.evicted += r_ref.evicted;
    for (int c = 0; c < KVGC_CLASS_COUNT; ++c) total.demoted_to[c] += r_ref.demoted_to[c];
  }
  CHECK(total.evicted > 0);  // both kinds of demotion and eviction were taken
  CHECK(total.demoted_to[KVGC_CLASS_INT8] > 0);
  CHECK(total.demoted_to[KVGC_CLASS_INT4] > 0);
}
