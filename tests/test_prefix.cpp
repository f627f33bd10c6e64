// The prefix cache and shared pages (kvgc_prefix_*, runtime/prefix.cpp, shared.cpp) on
// the CPU backend, through the C API: attach shares pages and copies no K/V byte; an
// attached sequence is the sequence that appended the same tokens itself (the same GC
// decisions and outputs, bit for bit); tenants never see each other's prefixes (a foreign
// lookup reads no byte: the arena is unreadable while it runs); room is made by evicting
// cached prefixes in LRU order, pinned ones never; reference counts balance (the walker
// after every call in the debug tree, here at each step's end).
#include <doctest/doctest.h>

#include <sys/mman.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <algorithm>
#include <numeric>
#include <random>

#include "../c_api/kvgc.hpp"
#include "../kernels/cpu/quant.hpp"
#include "../kernels/page_layout.hpp"
#include "attend_reference.hpp"
#include "gc_util.hpp"

using namespace kvgc_test;

namespace {

constexpr uint64_t kPromptKey = 1000;  // the K/V of every prompt token comes from this key

std::vector<int32_t> prompt_ids(uint32_t n, int32_t first = 7) {
  std::vector<int32_t> ids(n);
  std::iota(ids.begin(), ids.end(), first);
  return ids;
}

// Appends the prompt's K/V (the same bytes for every sequence) to every layer.
void append_prompt(Heap& H, kvgc_seq s, int64_t from, uint32_t n) {
  for (uint32_t l = 0; l < H.m.n_layers; ++l) {
    const auto k = gaussian(H.m, kPromptKey, l, from, n, false), v = gaussian(H.m, kPromptKey, l, from, n, true);
    REQUIRE(kvgc_append(H.h, s, l, k.data(), v.data(), n, nullptr) == KVGC_OK);
  }
}

kvgc_prefix keep(Heap& H, kvgc_seq s, const std::vector<int32_t>& ids, uint64_t salt = 0, uint32_t flags = 0) {
  kvgc_prefix p = 0;
  const kvgc_status st = kvgc_prefix_keep(H.h, s, ids.data(), ids.size(), salt, flags, &p, nullptr);
  INFO(std::string(kvgc_errmsg(H.h)));
  REQUIRE(st == KVGC_OK);
  return p;
}

uint64_t attach(Heap& H, kvgc_seq s, const std::vector<int32_t>& ids, uint64_t salt = 0) {
  uint64_t n = UINT64_MAX;
  const kvgc_status st = kvgc_prefix_attach(H.h, s, ids.data(), ids.size(), salt, &n, nullptr);
  INFO(std::string(kvgc_errmsg(H.h)));
  REQUIRE(st == KVGC_OK);
  return n;
}

// A prompt appended by a sequence of `tenant`, kept, and the keeper let go: only the
// cache holds its pages.
void keep_prompt(Heap& H, uint32_t tenant, const std::vector<int32_t>& ids, uint64_t salt = 0) {
  kvgc_seq keeper;
  REQUIRE(kvgc_seq_create(H.h, tenant, &keeper) == KVGC_OK);
  append_prompt(H, keeper, 0, uint32_t(ids.size()));
  keep(H, keeper, ids, salt);
  REQUIRE(kvgc_seq_destroy(H.h, keeper) == KVGC_OK);
}

using Image = Heap::Image;
Image image(Heap& H, kvgc_seq s, uint32_t layer) { return H.image(s, layer); }

// An image's rows in position order (read order differs where pages do).
std::vector<size_t> by_position(const Image& im) {
  std::vector<size_t> rows(im.pos.size());
  std::iota(rows.begin(), rows.end(), 0);
  std::sort(rows.begin(), rows.end(), [&](size_t x, size_t y) { return im.pos[x] < im.pos[y]; });
  return rows;
}

// Attention of n_q queries (the segment's last positions) with scores; returns the output.
std::vector<uint8_t> attend(Heap& H, kvgc_seq s, uint32_t layer, uint64_t qkey, int64_t at, uint32_t n_q) {
  kvgc_model_desc qm = H.m;
  qm.n_kv_heads = H.m.n_q_heads;
  const auto q = gaussian(qm, qkey, layer, at, n_q, false);
  std::vector<uint8_t> out(q.size(), 0xEE);
  REQUIRE(kvgc_attend(H.h, s, layer, q.data(), n_q, out.data(), nullptr, nullptr) == KVGC_OK);
  return out;
}


// The same attention mass for the same position in any sequence, whatever its rows'
// order (kvgc_observe): sequences fed this decide alike whatever their attention reads.
// `im` is what the sequence read; the mass goes in its rows' order.
std::vector<float> mass_by_position(const Image& im, uint32_t l, int round) {
  std::vector<float> mass(im.pos.size());
  for (size_t j = 0; j < mass.size(); ++j) {
    uint64_t h = uint64_t(im.pos[j]) * 0x9e3779b97f4a7c15ull ^ (uint64_t(round) * 7919 + l);
    h = (h ^ (h >> 29)) * 0xbf58476d1ce4e5b9ull;
    h ^= h >> 32;
    mass[j] = float(double(h >> 40) / double(1 << 24)) * (im.pos[j] % 13 == 0 ? 4.0f : 1.0f);
  }
  return mass;
}
void observe_by_position(Heap& H, kvgc_seq s, uint32_t l, int round) {
  const std::vector<float> mass = mass_by_position(image(H, s, l), l, round);
  REQUIRE(kvgc_observe(H.h, s, l, mass.data(), mass.size(), nullptr) == KVGC_OK);
}

// One random query's attention on every layer of s against a float64 reference over what
// kvgc_read returns.
void check_attention_reads(Heap& H, kvgc_seq s, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> gauss(0.f, 1.f);
  const size_t eb = elem_bytes(H.m);
  for (uint32_t l = 0; l < H.m.n_layers; ++l) {
    std::vector<uint8_t> q(size_t(H.m.n_q_heads) * H.m.head_dim * eb);
    for (size_t e = 0; e < q.size() / eb; ++e) kvgc::cpu::store(&q[e * eb], H.m.dtype, 2.0f * gauss(rng));
    const Reference ref = reference(H.h, H.m, s, l, q, 1, 1.0 / std::sqrt(double(H.m.head_dim)));
    std::vector<uint8_t> out(q.size(), 0xA5);  // poisoned
    REQUIRE(kvgc_attend(H.h, s, l, q.data(), 1, out.data(), nullptr, nullptr) == KVGC_OK);
    CHECK(rel_err(ref.out, to_float(out, H.m.dtype)) < output_bound(H.m.dtype));
  }
}


// The prune and shrink scenario: a P-token prompt kept by tenant 3 (salt 42) and let go;
// N holders (tenant 1) attach it and N unshared copies (tenant 2) append it; then
// `rounds` rounds of tokens of their own (20, then 1 to 3), each fed the same mass by
// position, and a step of each, whose statuses must agree.
struct Holders {
  static constexpr int N = 3;
  kvgc_seq shared[N], own[N];
  int64_t len = 0;
  uint64_t cache_bytes = 0;  // tenant 3's bytes once the prompt is kept: the shared pages
};
Holders run_holders(Heap& H, uint32_t P, int rounds) {
  Holders x;
  const auto ids = prompt_ids(P);
  keep_prompt(H, 3, ids, /*salt=*/42);
  uint64_t limit = 0;
  REQUIRE(kvgc_tenant_usage(H.h, 3, &x.cache_bytes, &limit) == KVGC_OK);
  for (int i = 0; i < Holders::N; ++i) {
    REQUIRE(kvgc_seq_create(H.h, 1, &x.shared[i]) == KVGC_OK);
    REQUIRE(kvgc_seq_create(H.h, 2, &x.own[i]) == KVGC_OK);
    CHECK(attach(H, x.shared[i], ids, 42) == P);
    append_prompt(H, x.own[i], 0, P);
  }
  x.len = P;
  for (int round = 0; round < rounds; ++round) {
    const uint32_t n = round == 0 ? 20 : 1 + round % 3;  // a private prompt part, then decode
    for (int i = 0; i < Holders::N; ++i) {
      const uint64_t key = 77 + uint64_t(i);
      for (kvgc_seq s : {x.shared[i], x.own[i]})
        for (uint32_t l = 0; l < H.m.n_layers; ++l) {
          const auto k = gaussian(H.m, key, l, x.len, n, false), v = gaussian(H.m, key, l, x.len, n, true);
          REQUIRE(kvgc_append(H.h, s, l, k.data(), v.data(), n, nullptr) == KVGC_OK);
          observe_by_position(H, s, l, round);
        }
      const kvgc_status a = H.step(x.shared[i]), b = H.step(x.own[i]);
      CHECK(a == b);
    }
    x.len += n;
    if (round % 10 == 0) H.check();
  }
  return x;
}

}  // namespace

TEST_CASE("prefix cache: attach shares the pages, copies no K/V byte, and reads back as the prompt") {
  Heap H(gc_options(KVGC_POLICY_FULL, 0), model(2, 2, 32));
  const uint32_t pt = 8;
  const auto ids = prompt_ids(100);  // 12 full pages and a partly filled 13th
  kvgc_seq keeper;
  REQUIRE(kvgc_seq_create(H.h, 0, &keeper) == KVGC_OK);
  append_prompt(H, keeper, 0, 100);
  const kvgc_stats before = H.stats();
  const kvgc_prefix p = keep(H, keeper, ids);
  CHECK(p != 0);
  H.check();
  kvgc_stats st = H.stats();
  CHECK(st.prefixes == 1);
  CHECK(st.shared_pages == 2 * 13);
  CHECK(st.shared_refs == 2 * 2 * 13);  // the keeper's header pages and the prefix
  CHECK(st.cls[0].pages_used == before.cls[0].pages_used);  // nothing copied
  // Keeping the same ids again: the same prefix.
  CHECK(keep(H, keeper, ids) == p);
  CHECK(H.stats().prefixes == 1);

  // The whole prompt, a longer request, a shorter one, one that differs mid-way.
  struct Case {
    std::vector<int32_t> ids;
    uint64_t want;
  };
  std::vector<int32_t> longer = ids;
  longer.insert(longer.end(), {1, 2, 3, 4, 5});
  std::vector<int32_t> shorter(ids.begin(), ids.begin() + 50);
  std::vector<int32_t> differs = ids;
  differs[42] = -5;  // page 5
  std::vector<int32_t> tail_differs = ids;
  tail_differs[99] = -1;  // the partly filled page: all of it must match
  for (const Case& c : {Case{ids, 100}, Case{longer, 100}, Case{shorter, 48}, Case{differs, 40},
                        Case{tail_differs, 96}, Case{prompt_ids(100, 8), 0}}) {
    kvgc_seq s;
    REQUIRE(kvgc_seq_create(H.h, 0, &s) == KVGC_OK);
    const kvgc_stats pre = H.stats();
    const uint64_t got = attach(H, s, c.ids);
    CHECK(got == c.want);
    const kvgc_stats post = H.stats();
    CHECK(post.cls[0].pages_used == pre.cls[0].pages_used);
    CHECK(post.cls_header.pages_used == pre.cls_header.pages_used + 2 * ((got + pt - 1) / pt));
    for (uint32_t l = 0; l < 2; ++l) {
      uint64_t live = 0, len = 0;
      REQUIRE(kvgc_seq_tokens(H.h, s, l, &live, &len) == KVGC_OK);
      CHECK(live == got);
      CHECK(len == got);
      if (!got) continue;
      // What appending the prompt's first `got` tokens gives.
      const Image im = image(H, s, l);
      const auto k = gaussian(H.m, kPromptKey, l, 0, uint32_t(got), false);
      CHECK(im.k == k);
      for (uint64_t i = 0; i < got; ++i) {
        CHECK(im.pos[i] == int32_t(i));
        CHECK(im.score[i] == 0.f);
        CHECK(im.gen[i] == (i < 4 ? KVGC_GEN_SINK : KVGC_GEN_YOUNG));
      }
    }
    H.check();
    REQUIRE(kvgc_seq_destroy(H.h, s) == KVGC_OK);
  }
  st = H.stats();
  CHECK(st.prefix_lookups == 6);
  CHECK(st.prefix_hits == 5);
  CHECK(st.prefix_tokens_attached == 100 + 100 + 48 + 40 + 96);
  // The keeper goes on writing: its partly filled last page is copied first; the
  // prefix's pages stay as they were.
  const Image cached0 = image(H, keeper, 0);
  append_prompt(H, keeper, 100, 3);
  CHECK(H.stats().cow_copies == 2);  // one per layer
  kvgc_seq late;
  REQUIRE(kvgc_seq_create(H.h, 0, &late) == KVGC_OK);
  CHECK(attach(H, late, ids) == 100);
  CHECK(image(H, late, 0).k == cached0.k);
  H.check();
  // Dropping the keeper and the prefix gives every page back once the last holder goes.
  REQUIRE(kvgc_seq_destroy(H.h, keeper) == KVGC_OK);
  REQUIRE(kvgc_prefix_drop(H.h, p) == KVGC_OK);
  CHECK(H.stats().prefixes == 0);
  CHECK(H.stats().shared_pages == 2 * 13);  // `late` holds them
  H.check();
  REQUIRE(kvgc_seq_destroy(H.h, late) == KVGC_OK);
  st = H.stats();
  CHECK(st.shared_pages == 0);
  CHECK(st.cls[0].pages_used + st.cls_header.pages_used == 0);
  H.check();
}

TEST_CASE("prefix cache, charged to the view: N attached sequences decide and answer as N that appended the prompt themselves") {
  // KVGC_PREFIX_CHARGE=view. Eviction (h2o) and the ladder (generational, int8 and int4),
  // under token budgets.
  // Without compaction, bit for bit: every attention output, score and decision. With it,
  // the private copies compact their prompt pages (a shared page is never moved), which
  // reorders rows: the same decisions, the same tokens, classes and generations, and
  // scores equal up to the order of float sums.
  for (int config = 0; config < 4; ++config) {
    const bool ladder = config & 1, compaction = config & 2;
    CAPTURE(ladder);
    CAPTURE(compaction);
    kvgc_heap_options o = ladder ? gc_options(KVGC_POLICY_GENERATIONAL, 70) : gc_options(KVGC_POLICY_H2O, 60);
    o.budget_bytes = 32 << 20;
    o.demote = ladder ? KVGC_DEMOTE_LADDER : KVGC_DEMOTE_OFF;
    o.compact_threshold = compaction ? 0.25 : 1.0;
    o.prefix_charge = KVGC_PREFIX_CHARGE_VIEW;
    Heap H(o, model(2, 2, 32));
    const auto ids = prompt_ids(150);
    kvgc_seq keeper;
    REQUIRE(kvgc_seq_create(H.h, 0, &keeper) == KVGC_OK);
    append_prompt(H, keeper, 0, 150);
    keep(H, keeper, ids);
    constexpr int N = 3;
    kvgc_seq shared[N], own[N];
    for (int i = 0; i < N; ++i) {
      REQUIRE(kvgc_seq_create(H.h, 0, &shared[i]) == KVGC_OK);
      REQUIRE(kvgc_seq_create(H.h, 0, &own[i]) == KVGC_OK);
      CHECK(attach(H, shared[i], ids) == 150);
      append_prompt(H, own[i], 0, 150);
    }
    H.check();
    int64_t len = 150;
    double worst = 0, worst_out = 0;  // relative score and output (RMS) differences
    for (int round = 0; round < 40; ++round) {
      const uint32_t n = round == 0 ? 20 : 1 + round % 3;  // a private prompt part, then decode
      for (int i = 0; i < N; ++i) {
        const uint64_t key = 77 + uint64_t(i);  // each request its own tokens
        for (kvgc_seq s : {shared[i], own[i]})
          for (uint32_t l = 0; l < 2; ++l) {
            const auto k = gaussian(H.m, key, l, len, n, false), v = gaussian(H.m, key, l, len, n, true);
            REQUIRE(kvgc_append(H.h, s, l, k.data(), v.data(), n, nullptr) == KVGC_OK);
          }
        for (uint32_t l = 0; l < 2; ++l) {
          const auto a = attend(H, shared[i], l, key, len, n), b = attend(H, own[i], l, key, len, n);
          if (!compaction) {
            CHECK(a == b);
          } else {  // the same tokens in another order: outputs within the dtype's rounding
            const auto fa = to_float(a, H.m.dtype), fb = to_float(b, H.m.dtype);
            worst_out = std::max(worst_out, rel_err(std::vector<double>(fb.begin(), fb.end()), fa));
          }
        }
        const kvgc_status a = H.step(shared[i]), b = H.step(own[i]);
        CHECK(a == b);
      }
      len += n;
    }
    for (int i = 0; i < N; ++i)
      for (uint32_t l = 0; l < 2; ++l) {
        const Image a = image(H, shared[i], l), b = image(H, own[i], l);
        CHECK(a.pos.size() < size_t(len));  // the GC pruned
        if (!compaction) {
          CHECK(a == b);
          continue;
        }
        const std::vector<size_t> ra = by_position(a), rb = by_position(b);
        REQUIRE(ra.size() == rb.size());
        for (size_t j = 0; j < ra.size(); ++j) {
          CHECK(a.pos[ra[j]] == b.pos[rb[j]]);
          CHECK(a.cls[ra[j]] == b.cls[rb[j]]);
          CHECK(a.gen[ra[j]] == b.gen[rb[j]]);
          const double x = a.score[ra[j]], y = b.score[rb[j]];
          worst = std::max(worst, std::abs(x - y) / std::max(1e-6, std::abs(y)));
        }
      }
    CHECK(worst < 1e-5);
    CHECK(worst_out < 1e-3);  // f16 outputs: 2 unit roundoffs
    const kvgc_stats st = H.stats();
    if (ladder) CHECK(st.tokens_demoted > 0);
    if (compaction) CHECK(st.compactions > 0);
    CHECK(st.shared_pages > 0);
    H.check();
  }
}

TEST_CASE("prefix cache: a holder left alone takes the pages back as its own, unless the cache pins them") {
  // The keeper destroyed and the prefix dropped: the attached sequence is the pages' last
  // holder. At its next step they become its own (pages_unshared), its header pages go
  // back, and it reads what it read. Under KVGC_PREFIX_CHARGE=cache the attached pages are
  // pinned at its table's front, outside its budget: they stay header pages.
  for (const kvgc_prefix_charge charge : {KVGC_PREFIX_CHARGE_VIEW, KVGC_PREFIX_CHARGE_CACHE}) {
    CAPTURE(charge);
    kvgc_heap_options o = gc_options(KVGC_POLICY_H2O, 1000);
    o.prefix_charge = charge;
    Heap H(o, model(2, 2, 32));
    const auto ids = prompt_ids(100);
    kvgc_seq keeper, s;
    REQUIRE(kvgc_seq_create(H.h, 0, &keeper) == KVGC_OK);
    append_prompt(H, keeper, 0, 100);
    const kvgc_prefix p = keep(H, keeper, ids);
    REQUIRE(kvgc_seq_create(H.h, 0, &s) == KVGC_OK);
    REQUIRE(attach(H, s, ids) == 100);
    const Heap::Image before = H.image(s, 1);
    const uint64_t pages = H.stats().shared_pages;
    REQUIRE(kvgc_seq_destroy(H.h, keeper) == KVGC_OK);
    REQUIRE(kvgc_prefix_drop(H.h, p) == KVGC_OK);
    CHECK(H.stats().shared_pages == pages);  // s still reads them
    REQUIRE(H.step(s) == KVGC_OK);
    H.check();
    const kvgc_stats st = H.stats();
    if (charge == KVGC_PREFIX_CHARGE_VIEW) {
      CHECK(st.pages_unshared == pages);
      CHECK(st.shared_pages == 0);
      CHECK(st.cls_header.pages_used == 0);
    } else {  // the whole pages are pinned; each layer's partly filled last page is not
      const uint64_t whole = 2 * (100 / o.page_tokens);
      REQUIRE(whole < pages);
      CHECK(st.pages_unshared == pages - whole);
      CHECK(st.shared_pages == whole);
    }
    CHECK(H.image(s, 1) == before);
    append_prompt(H, s, 100, 10);  // the tail, its own now, is written in place
    H.check();
    REQUIRE(kvgc_seq_destroy(H.h, s) == KVGC_OK);
    CHECK(H.stats().shared_pages == 0);
    CHECK(H.stats().cls[0].pages_used + H.stats().cls_header.pages_used == 0);
  }
}

TEST_CASE("prefix cache: another tenant never hits, and its lookup reads no byte of the arena") {
  Heap H(gc_options(KVGC_POLICY_FULL, 0), model(1, 2, 32));
  const auto ids = prompt_ids(64);
  kvgc_seq a;
  REQUIRE(kvgc_seq_create(H.h, 1, &a) == KVGC_OK);
  append_prompt(H, a, 0, 64);
  keep(H, a, ids);                 // tenant 1 only
  keep(H, a, ids, /*salt=*/0xabc);  // anyone with the salt
  CHECK(H.stats().prefixes == 2);
  kvgc_seq b;
  REQUIRE(kvgc_seq_create(H.h, 2, &b) == KVGC_OK);
  // The arena unreadable while tenant 2 looks up (the CPU arena is host memory): a lookup
  // that read a byte of a page would fault here.
  const kvgc_stats st = H.stats();
  const long os_page = sysconf(_SC_PAGESIZE);
  // The arena's extent: from the page layout export's base and the stats' size.
  kvgc_batch* batch = nullptr;
  REQUIRE(kvgc_batch_create(H.h, &batch) == KVGC_OK);
  const uint32_t one = 1;
  REQUIRE(kvgc_batch_plan(batch, &a, &one, 1, nullptr, nullptr) == KVGC_OK);
  const auto k = gaussian(H.m, kPromptKey, 0, 64, 1, false), v = gaussian(H.m, kPromptKey, 0, 64, 1, true);
  REQUIRE(kvgc_batch_append(batch, 0, k.data(), v.data(), nullptr) == KVGC_OK);
  kvgc_batch_view view;
  view.struct_size = sizeof view;
  REQUIRE(kvgc_batch_export(batch, 0, &view) == KVGC_OK);
  const uintptr_t base = reinterpret_cast<uintptr_t>(view.arena_base);
  uint8_t* lo = reinterpret_cast<uint8_t*>((base + os_page - 1) / os_page * os_page);
  const size_t span = (base + st.arena_bytes) / os_page * os_page - uintptr_t(lo);
  kvgc_batch_destroy(batch);
  REQUIRE(mprotect(lo, span, PROT_NONE) == 0);
  uint64_t n_same = 1, n_wrong_salt = 1;
  const kvgc_status s1 = kvgc_prefix_attach(H.h, b, ids.data(), ids.size(), 0, &n_same, nullptr);
  const kvgc_status s2 = kvgc_prefix_attach(H.h, b, ids.data(), ids.size(), 0xabd, &n_wrong_salt, nullptr);
  REQUIRE(mprotect(lo, span, PROT_READ | PROT_WRITE) == 0);
  CHECK(s1 == KVGC_OK);
  CHECK(n_same == 0);
  CHECK(s2 == KVGC_OK);
  CHECK(n_wrong_salt == 0);
  CHECK(H.stats().prefix_hits == 0);
  // With the salt, tenant 2 shares the pages; the pages stay charged to tenant 1.
  CHECK(attach(H, b, ids, 0xabc) == 64);
  CHECK(image(H, b, 0).k == gaussian(H.m, kPromptKey, 0, 0, 64, false));
  REQUIRE(kvgc_tenant_set_limit(H.h, 2, 1 << 20) == KVGC_OK);
  uint64_t bytes2 = 0;
  REQUIRE(kvgc_tenant_usage(H.h, 2, &bytes2, nullptr) == KVGC_OK);
  CHECK(bytes2 == H.stats().cls_header.page_bytes * ((64 + 7) / 8));
  H.check();
}

TEST_CASE("prefix cache: room comes from cached prefixes in LRU order; pinned ones stay") {
  kvgc_heap_options o = gc_options(KVGC_POLICY_FULL, 0);
  o.budget_bytes = 1 << 20;
  o.slab_bytes = 64 << 10;
  Heap H(o, model(1, 2, 32));
  // Cached prompts no sequence holds (the first pinned), until the arena is full: the
  // append that finds no room evicts the least recently used unpinned prefix, the second.
  std::vector<kvgc_prefix> kept;
  std::vector<std::vector<int32_t>> prompts;
  auto cache_one = [&](int i) {
    kvgc_seq s;
    REQUIRE(kvgc_seq_create(H.h, 0, &s) == KVGC_OK);
    H.append(s, 0, 0, 64);
    prompts.push_back(prompt_ids(64, 1000 * i));
    kept.push_back(keep(H, s, prompts.back(), 0, i == 0 ? KVGC_PREFIX_PIN : 0));
    REQUIRE(kvgc_seq_destroy(H.h, s) == KVGC_OK);
  };
  for (int i = 0; H.stats().prefix_evictions == 0; ++i) {
    REQUIRE(i < 10000);
    cache_one(i);
  }
  // Room moves between classes a slab at a time, so one call may evict several; always
  // the oldest: the prefixes left are the newest ones, and the pinned one.
  auto alive = [&](size_t j) { return kvgc_prefix_pin(H.h, kept[j], j == 0) == KVGC_OK; };
  auto evicted_in_order = [&] {
    size_t first_alive = 1;
    while (first_alive < kept.size() && !alive(first_alive)) ++first_alive;
    for (size_t j = first_alive; j < kept.size(); ++j)
      if (!alive(j)) return false;
    return alive(0) && first_alive > 1;
  };
  const size_t n = kept.size();
  REQUIRE(n >= 5);
  CHECK(evicted_in_order());
  CHECK(H.stats().prefixes == n - H.stats().prefix_evictions);
  H.check();
  // An attach makes the oldest survivor the most recently used: it goes last.
  size_t oldest = 1;
  while (!alive(oldest)) ++oldest;
  {
    kvgc_seq t;
    REQUIRE(kvgc_seq_create(H.h, 0, &t) == KVGC_OK);
    CHECK(attach(H, t, prompts[oldest]) == 64);
    REQUIRE(kvgc_seq_destroy(H.h, t) == KVGC_OK);
  }
  const uint64_t evictions = H.stats().prefix_evictions;
  for (int i = int(n); H.stats().prefix_evictions == evictions; ++i) cache_one(i);
  CHECK(!alive(oldest + 1));  // the next oldest went first
  if (!alive(oldest))         // and the touched one only after every older-used one
    for (size_t j = 1; j < n; ++j) CHECK(!alive(j));
  H.check();
  kvgc_seq big;
  REQUIRE(kvgc_seq_create(H.h, 0, &big) == KVGC_OK);
  H.append(big, 0, 0, 64);
  kvgc_stats st;
  // Everything but the pinned prefix can go; then KVGC_ENOMEM, with nothing lost.
  int64_t at = 64;
  kvgc_status last = KVGC_OK;
  for (int i = 0; i < 10000 && last == KVGC_OK; ++i, at += 8) {
    const auto k = gaussian(H.m, kPromptKey, 0, at, 8, false), v = gaussian(H.m, kPromptKey, 0, at, 8, true);
    last = kvgc_append(H.h, big, 0, k.data(), v.data(), 8, nullptr);
  }
  CHECK(last == KVGC_ENOMEM);
  st = H.stats();
  CHECK(st.prefixes == 1);
  CHECK(st.prefixes_pinned == 1);
  CHECK(kvgc_prefix_pin(H.h, kept[0], 0) == KVGC_OK);
  H.check();
}

TEST_CASE("prefix cache: a prefix whose pages sequences hold is not evicted for room") {
  // Evicting it would free no byte and make the next request prefill it again.
  kvgc_heap_options o = gc_options(KVGC_POLICY_FULL, 0);
  o.budget_bytes = 1 << 20;
  o.slab_bytes = 64 << 10;
  Heap H(o, model(1, 2, 32));
  const auto held_ids = prompt_ids(64, 500000);
  kvgc_seq keeper, reader;
  REQUIRE(kvgc_seq_create(H.h, 0, &keeper) == KVGC_OK);
  H.append(keeper, 0, 0, 64);
  const kvgc_prefix held = keep(H, keeper, held_ids);
  REQUIRE(kvgc_seq_create(H.h, 0, &reader) == KVGC_OK);
  REQUIRE(attach(H, reader, held_ids) == 64);
  REQUIRE(kvgc_seq_destroy(H.h, keeper) == KVGC_OK);  // the reader alone holds its pages now
  // Unheld prefixes, until the arena is short and some are evicted, then an append that
  // runs out: the held prefix, the least recently used of all, stays throughout.
  std::vector<kvgc_prefix> unheld;
  for (int i = 1; H.stats().prefix_evictions < 3; ++i) {
    REQUIRE(i < 10000);
    kvgc_seq s;
    REQUIRE(kvgc_seq_create(H.h, 0, &s) == KVGC_OK);
    H.append(s, 0, 0, 64);
    unheld.push_back(keep(H, s, prompt_ids(64, 1000 * i)));
    REQUIRE(kvgc_seq_destroy(H.h, s) == KVGC_OK);
    CHECK(kvgc_prefix_pin(H.h, held, 0) == KVGC_OK);
  }
  CHECK(kvgc_prefix_pin(H.h, unheld.front(), 0) == KVGC_ENOTFOUND);
  kvgc_seq big;
  REQUIRE(kvgc_seq_create(H.h, 0, &big) == KVGC_OK);
  kvgc_status last = KVGC_OK;
  for (int64_t at = 0; at < 100000 && last == KVGC_OK; at += 8) {
    const auto k = gaussian(H.m, kPromptKey, 0, at, 8, false), v = gaussian(H.m, kPromptKey, 0, at, 8, true);
    last = kvgc_append(H.h, big, 0, k.data(), v.data(), 8, nullptr);
  }
  CHECK(last == KVGC_ENOMEM);
  kvgc_stats st = H.stats();
  CHECK(st.prefixes == 1);  // every unheld one went; the held one is still found
  CHECK(st.cached_only_bytes == 0);
  {
    kvgc_seq t;
    REQUIRE(kvgc_seq_create(H.h, 0, &t) == KVGC_OK);
    CHECK(attach(H, t, held_ids) == 64);
    REQUIRE(kvgc_seq_destroy(H.h, t) == KVGC_OK);
  }
  H.check();
  // Once no sequence holds its pages, it goes for room as any other.
  REQUIRE(kvgc_seq_destroy(H.h, reader) == KVGC_OK);
  CHECK(H.stats().cached_only_bytes > 0);
  const auto k = gaussian(H.m, kPromptKey, 0, 0, 8, false), v = gaussian(H.m, kPromptKey, 0, 0, 8, true);
  for (int i = 0; i < 1000 && kvgc_prefix_pin(H.h, held, 0) == KVGC_OK; ++i)
    REQUIRE(kvgc_append(H.h, big, 0, k.data(), v.data(), 8, nullptr) == KVGC_OK);
  CHECK(kvgc_prefix_pin(H.h, held, 0) == KVGC_ENOTFOUND);
  CHECK(H.stats().prefixes == 0);
  H.check();
}

TEST_CASE("prefix cache: bad arguments get a clear error and change nothing") {
  Heap H(gc_options(KVGC_POLICY_H2O, 40), model(2, 2, 32));
  const auto ids = prompt_ids(50);
  kvgc_seq s;
  REQUIRE(kvgc_seq_create(H.h, 0, &s) == KVGC_OK);
  append_prompt(H, s, 0, 50);
  kvgc_prefix p = 0;
  auto err = [&] { return std::string(kvgc_errmsg(H.h)); };
  CHECK(kvgc_prefix_keep(H.h, s, ids.data(), 49, 0, 0, &p, nullptr) == KVGC_EINVAL);
  CHECK(err().find("length") != std::string::npos);
  CHECK(kvgc_prefix_keep(H.h, s, ids.data(), 0, 0, 0, &p, nullptr) == KVGC_EINVAL);
  CHECK(kvgc_prefix_keep(H.h, s, nullptr, 50, 0, 0, &p, nullptr) == KVGC_EINVAL);
  CHECK(err().find("token_ids") != std::string::npos);
  CHECK(kvgc_prefix_keep(H.h, s, ids.data(), 50, 0, 0x10, &p, nullptr) == KVGC_EINVAL);
  CHECK(err().find("flags") != std::string::npos);
  CHECK(kvgc_prefix_keep(H.h, 999, ids.data(), 50, 0, 0, &p, nullptr) == KVGC_ENOTFOUND);
  CHECK(kvgc_prefix_keep(nullptr, s, ids.data(), 50, 0, 0, &p, nullptr) == KVGC_EINVAL);
  CHECK(p == 0);
  CHECK(H.stats().prefixes == 0);
  CHECK(H.stats().shared_pages == 0);
  // Ranked by a step: too late to keep.
  REQUIRE(H.step(s) == KVGC_OK);
  CHECK(kvgc_prefix_keep(H.h, s, ids.data(), 50, 0, 0, &p, nullptr) == KVGC_EINVAL);
  CHECK(err().find("step") != std::string::npos);
  // Attach: to a sequence that holds tokens; NULL arguments.
  uint64_t n = 5;
  CHECK(kvgc_prefix_attach(H.h, s, ids.data(), 50, 0, &n, nullptr) == KVGC_EINVAL);
  CHECK(err().find("already holds") != std::string::npos);
  CHECK(n == 5);
  kvgc_seq t;
  REQUIRE(kvgc_seq_create(H.h, 0, &t) == KVGC_OK);
  CHECK(kvgc_prefix_attach(H.h, t, ids.data(), 50, 0, nullptr, nullptr) == KVGC_EINVAL);
  CHECK(kvgc_prefix_attach(H.h, t, nullptr, 50, 0, &n, nullptr) == KVGC_EINVAL);
  CHECK(kvgc_prefix_attach(H.h, t, ids.data(), 0, 0, &n, nullptr) == KVGC_OK);
  CHECK(n == 0);
  CHECK(kvgc_prefix_pin(H.h, 12345, 1) == KVGC_ENOTFOUND);
  CHECK(kvgc_prefix_drop(H.h, 12345) == KVGC_ENOTFOUND);
  CHECK(err().find("12345") != std::string::npos);
  H.check();
}

TEST_CASE("prefix cache: attached sequences in one batch plan, pages exported with kv_offset") {
  Heap H(gc_options(KVGC_POLICY_H2O, 48), model(2, 2, 32));
  const auto ids = prompt_ids(30);  // 3 full pages and a partly filled one
  kvgc_seq keeper;
  REQUIRE(kvgc_seq_create(H.h, 0, &keeper) == KVGC_OK);
  append_prompt(H, keeper, 0, 30);
  keep(H, keeper, ids);
  kvgc_seq s[2];
  for (auto& x : s) {
    REQUIRE(kvgc_seq_create(H.h, 0, &x) == KVGC_OK);
    CHECK(attach(H, x, ids) == 30);
  }
  kvgc_batch* b = nullptr;
  REQUIRE(kvgc_batch_create(H.h, &b) == KVGC_OK);
  const uint32_t n_new[2] = {3, 3};
  REQUIRE(kvgc_batch_plan(b, s, n_new, 2, nullptr, nullptr) == KVGC_OK);
  CHECK(H.stats().cow_copies == 4);  // each sequence's shared partly filled tail, per layer
  const auto k = gaussian(H.m, 5, 0, 30, 6, false), v = gaussian(H.m, 5, 0, 30, 6, true);
  for (uint32_t l = 0; l < 2; ++l) REQUIRE(kvgc_batch_append(b, l, k.data(), v.data(), nullptr) == KVGC_OK);
  kvgc_batch_view view;
  view.struct_size = sizeof view;
  REQUIRE(kvgc_batch_export(b, 0, &view) == KVGC_OK);
  REQUIRE(view.n_pages == 2 * 5);  // 33 tokens each
  uint32_t shared = 0;
  for (uint32_t p = 0; p < view.n_pages; ++p) shared += view.kv_offset[p] != view.page_offset[p];
  CHECK(shared == 2 * 3);  // the three full prompt pages of each
  CHECK(view.kv_offset[0] == view.kv_offset[5]);  // the same shared page, two headers
  CHECK(view.page_offset[0] != view.page_offset[5]);
  // A 0.6 caller: no kv_offset, so a layer with shared pages is refused.
  kvgc_batch_view old;
  old.struct_size = KVGC_BATCH_VIEW_V1_SIZE;
  CHECK(kvgc_batch_export(b, 0, &old) == KVGC_EUNSUPPORTED);
  CHECK(std::string(kvgc_errmsg(H.h)).find("kv_offset") != std::string::npos);
  REQUIRE(kvgc_batch_step(b, nullptr) == KVGC_OK);
  kvgc_batch_destroy(b);
  H.check();
}

TEST_CASE("prefix cache, charged to the cache: attached pages stay whole and out of every holder's budget") {
  // KVGC_PREFIX_CHARGE=cache (the default before 0.15): the prompt's whole pages are kept in each
  // holder's view and held once; each holder's byte budget (a fraction of its whole
  // length, as unshared) is spent on its own tokens alone. The same requests without sharing prune the
  // prompt too, and hold it N times.
  for (const bool ladder : {false, true}) {
    CAPTURE(ladder);
    kvgc_heap_options o = gc_options(KVGC_POLICY_GENERATIONAL, 0);
    o.budget_bytes = 32 << 20;
    o.byte_budget_fraction = 0.3;
    o.demote = ladder ? KVGC_DEMOTE_LADDER : KVGC_DEMOTE_OFF;
    o.prefix_charge = KVGC_PREFIX_CHARGE_CACHE;
    Heap H(o, model(2, 2, 32));
    const uint32_t P = 203;  // 25 whole pages and 3 tokens
    const auto ids = prompt_ids(P);
    keep_prompt(H, 0, ids);
    constexpr int N = 4;
    kvgc_seq s[N];
    for (int i = 0; i < N; ++i) {
      REQUIRE(kvgc_seq_create(H.h, 0, &s[i]) == KVGC_OK);
      CHECK(attach(H, s[i], ids) == P);
    }
    int64_t len = P;
    for (int round = 0; round < 60; ++round) {
      const uint32_t n = round == 0 ? 40 : 2;
      for (int i = 0; i < N; ++i) {
        for (uint32_t l = 0; l < 2; ++l) {
          const auto k = gaussian(H.m, 9 + i, l, len, n, false), v = gaussian(H.m, 9 + i, l, len, n, true);
          REQUIRE(kvgc_append(H.h, s[i], l, k.data(), v.data(), n, nullptr) == KVGC_OK);
          attend(H, s[i], l, 9 + i, len, n);
        }
        const kvgc_status st = H.step(s[i]);
        CHECK((st == KVGC_OK || st == KVGC_EBUDGET));
      }
      len += n;
      if (round % 10 == 0) H.check();
    }
    const kvgc_stats st = H.stats();
    CHECK(st.tokens_evicted + st.tokens_demoted > 0);  // each pruned its own tokens
    for (int i = 0; i < N; ++i)
      for (uint32_t l = 0; l < 2; ++l) {
        const Image im = image(H, s[i], l);
        // The whole pages of the prompt, every token, fp16, in every view.
        std::vector<bool> seen(len, false);
        for (size_t j = 0; j < im.pos.size(); ++j) {
          seen[size_t(im.pos[j])] = true;
          if (im.pos[j] < 200) CHECK(im.cls[j] == KVGC_CLASS_FP16);
        }
        for (int32_t p = 0; p < 200; ++p) CHECK(seen[size_t(p)]);
        // Its own tokens pruned (evicted, or demoted on the ladder) to fit 30% of what the
        // whole sequence would cost unshared, spent on its own tokens alone.
        size_t own = 0, own_below_fp16 = 0;
        for (size_t j = 0; j < im.pos.size(); ++j)
          if (im.pos[j] >= 200) {
            ++own;
            own_below_fp16 += im.cls[j] != KVGC_CLASS_FP16;
          }
        CHECK((own < size_t(len - 200) || own_below_fp16 > 0));
      }
    // The prompt's pages are held once: 2 layers x 25 whole pages shared, plus the
    // partly filled 26th (copied by each holder's first append).
    CHECK(st.shared_pages == 2 * 26);
    CHECK(st.cow_copies == 2 * N);
    H.check();
  }
}

TEST_CASE("prefix cache: keeping a prompt's first whole pages leaves the rest the keeper's own") {
  Heap H(gc_options(KVGC_POLICY_H2O, 40), model(2, 2, 32));  // 8 tokens a page
  const auto ids = prompt_ids(50);
  kvgc_seq keeper;
  REQUIRE(kvgc_seq_create(H.h, 0, &keeper) == KVGC_OK);
  append_prompt(H, keeper, 0, 50);
  kvgc_prefix p = 0;
  // Not a page boundary, or past the length: refused, nothing kept.
  CHECK(kvgc_prefix_keep(H.h, keeper, ids.data(), 36, 0, 0, &p, nullptr) == KVGC_EINVAL);
  CHECK(std::string(kvgc_errmsg(H.h)).find("page_tokens") != std::string::npos);
  const auto longer = prompt_ids(56);
  CHECK(kvgc_prefix_keep(H.h, keeper, longer.data(), 56, 0, 0, &p, nullptr) == KVGC_EINVAL);
  CHECK(H.stats().shared_pages == 0);
  // The first 4 pages: shared; the keeper's other 3 pages (2 full, 1 partly) stay private.
  const std::vector<int32_t> head(ids.begin(), ids.begin() + 32);
  const kvgc_prefix first = keep(H, keeper, head);
  CHECK(H.stats().shared_pages == 2 * 4);
  CHECK(H.stats().cls_header.pages_used == 2 * 4);
  // Another prompt with the same first 32 ids attaches them, and nothing after.
  std::vector<int32_t> other = prompt_ids(45);
  other[40] = -1;
  kvgc_seq t;
  REQUIRE(kvgc_seq_create(H.h, 0, &t) == KVGC_OK);
  CHECK(attach(H, t, other) == 32);
  // The keeper may still keep its whole prompt: the kept pages are reused, not copied.
  const kvgc_prefix whole = keep(H, keeper, ids);
  CHECK(whole != first);
  CHECK(H.stats().shared_pages == 2 * 7);
  CHECK(H.stats().prefixes == 2);
  H.check();
  CHECK(H.stats().cached_only_bytes == 0);  // the keeper holds every kept page
  REQUIRE(kvgc_seq_destroy(H.h, keeper) == KVGC_OK);
  const Image im = image(H, t, 1);
  REQUIRE(im.pos.size() == 32);
  for (int32_t i = 0; i < 32; ++i) CHECK(im.pos[size_t(i)] == i);
  // Pages only the cache holds are what evicting it gives back: t holds the first 4.
  const uint64_t page = H.stats().cls[KVGC_CLASS_FP16].page_bytes;
  CHECK(H.stats().cached_only_bytes == 2 * 3 * page);
  REQUIRE(kvgc_seq_destroy(H.h, t) == KVGC_OK);
  CHECK(H.stats().cached_only_bytes == 2 * 7 * page);
  CHECK(H.stats().cached_only_bytes == H.stats().shared_bytes);
  REQUIRE(kvgc_prefix_drop(H.h, first) == KVGC_OK);
  REQUIRE(kvgc_prefix_drop(H.h, whole) == KVGC_OK);
  CHECK(H.stats().cached_only_bytes == 0);
  CHECK(H.stats().shared_bytes == 0);
  H.check();
}

TEST_CASE("prefix cache: prompts prefilled side by side keep one copy of the pages they share") {
  // Requests admitted together each prefill the common prefix before any of it is cached.
  // When the second keeps, its pages that the first's cached prefix already holds (the
  // same ids at the same place) are not kept twice: it reads the cached page and its copy
  // goes back to the pool. Whole-prompt keeps of the same ids do the same.
  Heap H(gc_options(KVGC_POLICY_H2O, 40), model(2, 2, 32));  // 8 tokens a page
  const auto ids = prompt_ids(50);
  std::vector<int32_t> other = prompt_ids(50);
  other[44] = -1;  // the same first 5 pages, then its own
  kvgc_seq a, b, c, d;
  for (kvgc_seq* s : {&a, &b, &c, &d}) REQUIRE(kvgc_seq_create(H.h, 0, s) == KVGC_OK);
  for (kvgc_seq s : {a, b, c, d}) append_prompt(H, s, 0, 50);
  const Image before_b = image(H, b, 1), before_c = image(H, c, 1);
  const uint64_t fp16_pages = H.stats().cls[KVGC_CLASS_FP16].pages_used;
  CHECK(fp16_pages == 4 * 2 * 7);
  const std::vector<int32_t> head(ids.begin(), ids.begin() + 40);
  const kvgc_prefix first = keep(H, a, head);  // 5 pages of a's become shared
  CHECK(H.stats().shared_pages == 2 * 5);
  // b keeps its first 6 pages: 5 are a's twins (rebound, freed), the 6th becomes shared.
  const std::vector<int32_t> b_head(ids.begin(), ids.begin() + 48);
  const kvgc_prefix second = keep(H, b, b_head);
  CHECK(second != first);
  CHECK(H.stats().shared_pages == 2 * 6);
  CHECK(H.stats().cls[KVGC_CLASS_FP16].pages_used == fp16_pages - 2 * 5);
  // c keeps the same ids as a's prefix: a's handle, and c reads a's pages.
  CHECK(keep(H, c, head) == first);
  CHECK(H.stats().shared_pages == 2 * 6);
  CHECK(H.stats().cls[KVGC_CLASS_FP16].pages_used == fp16_pages - 2 * 10);
  // d's prompt differs inside page 5: only pages 0-4 have twins.
  std::vector<int32_t> d_ids = ids;
  d_ids[41] = -7;
  const std::vector<int32_t> d_head(d_ids.begin(), d_ids.begin() + 48);
  keep(H, d, d_head);
  CHECK(H.stats().shared_pages == 2 * 7);
  CHECK(H.stats().cls[KVGC_CLASS_FP16].pages_used == fp16_pages - 2 * 15);
  H.check();
  // Each sequence reads what it appended, with its own metadata.
  CHECK(image(H, b, 1) == before_b);
  CHECK(image(H, c, 1) == before_c);
  // Freed in any order: the walker balances the references, nothing leaks.
  REQUIRE(kvgc_seq_destroy(H.h, a) == KVGC_OK);
  REQUIRE(kvgc_prefix_drop(H.h, first) == KVGC_OK);
  H.check();
  CHECK(image(H, c, 1) == before_c);
  for (kvgc_seq s : {b, c, d}) REQUIRE(kvgc_seq_destroy(H.h, s) == KVGC_OK);
  REQUIRE(kvgc_prefix_drop(H.h, second) == KVGC_OK);
  H.check();
  CHECK(H.stats().prefixes == 1);  // d's
  CHECK(H.stats().cached_only_bytes == H.stats().shared_bytes);
}

TEST_CASE("prefix cache: another tenant's keep of the same ids never reads the first tenant's pages") {
  Heap H(gc_options(KVGC_POLICY_H2O, 40), model(1, 2, 32));
  const auto ids = prompt_ids(32);
  kvgc_seq a, b;
  REQUIRE(kvgc_seq_create(H.h, 1, &a) == KVGC_OK);
  REQUIRE(kvgc_seq_create(H.h, 2, &b) == KVGC_OK);
  append_prompt(H, a, 0, 32);
  append_prompt(H, b, 0, 32);
  const uint64_t fp16_pages = H.stats().cls[KVGC_CLASS_FP16].pages_used;
  const kvgc_prefix pa = keep(H, a, ids), pb = keep(H, b, ids);
  CHECK(pa != pb);
  CHECK(H.stats().shared_pages == 2 * 4);  // two copies: no twin across tenants
  CHECK(H.stats().cls[KVGC_CLASS_FP16].pages_used == fp16_pages);
  // With one salt they are one audience, and the second keep reads the first's pages.
  kvgc_seq c, d;
  REQUIRE(kvgc_seq_create(H.h, 1, &c) == KVGC_OK);
  REQUIRE(kvgc_seq_create(H.h, 2, &d) == KVGC_OK);
  append_prompt(H, c, 0, 32);
  append_prompt(H, d, 0, 32);
  const kvgc_prefix pc = keep(H, c, ids, 99);
  CHECK(keep(H, d, ids, 99) == pc);
  CHECK(H.stats().shared_pages == 3 * 4);
  H.check();
}

TEST_CASE("prefix cache, charged to the cache: a holder spends its whole length's budget on its own tokens") {
  // A budget fraction is of the holder's whole length, as unshared, and its own tokens
  // (after the P pinned ones) are what it is spent on: they keep that many tokens once
  // more than that many are their own. The unshared sequence of the same length keeps
  // the same number of tokens over its whole length.
  kvgc_heap_options o = gc_options(KVGC_POLICY_H2O, 0, 4, 32, 8);
  o.budget_bytes = 32 << 20;
  o.token_budget_fraction = 0.3;
  o.demote = KVGC_DEMOTE_OFF;
  o.layer_budget = KVGC_LAYER_BUDGET_UNIFORM;
  o.prefix_charge = KVGC_PREFIX_CHARGE_CACHE;
  Heap H(o, model(2, 2, 32));
  const uint32_t P = 200;  // 25 whole pages
  const auto ids = prompt_ids(P);
  kvgc_seq keeper, shared, alone;
  REQUIRE(kvgc_seq_create(H.h, 0, &keeper) == KVGC_OK);
  append_prompt(H, keeper, 0, P);
  keep(H, keeper, ids);
  REQUIRE(kvgc_seq_destroy(H.h, keeper) == KVGC_OK);
  REQUIRE(kvgc_seq_create(H.h, 0, &shared) == KVGC_OK);
  REQUIRE(kvgc_seq_create(H.h, 0, &alone) == KVGC_OK);
  CHECK(attach(H, shared, ids) == P);
  append_prompt(H, alone, 0, P);
  int64_t len = P;
  for (int round = 0; round < 150; ++round) {
    const uint32_t n = 2;
    for (kvgc_seq s : {shared, alone}) {
      for (uint32_t l = 0; l < 2; ++l) {
        const auto k = gaussian(H.m, 9, l, len, n, false), v = gaussian(H.m, 9, l, len, n, true);
        REQUIRE(kvgc_append(H.h, s, l, k.data(), v.data(), n, nullptr) == KVGC_OK);
        attend(H, s, l, 9, len, n);
      }
      const kvgc_status st = H.step(s);
      INFO(std::string(kvgc_errmsg(H.h)), " seq ", s, " len ", len);
      REQUIRE(st == KVGC_OK);  // the protected tokens are the window's: never short
    }
    len += n;
    const double B = std::ceil(0.3 * double(len)), own = double(len - P);
    for (uint32_t l = 0; l < 2; ++l) {
      CAPTURE(len);
      const double alone_n = double(image(H, alone, l).pos.size());
      CHECK(alone_n <= B);
      CHECK(alone_n >= B - 2);
      const double own_n = double(image(H, shared, l).pos.size()) - P;
      CHECK(own_n <= std::max(B, 32.0 + n));  // a window's worth may stay before the GC runs
      CHECK(own_n >= std::min(own, B) - 2);
    }
  }
  H.check();
}

TEST_CASE("prefix cache, charged as prune (shrink since 0.15): holders decide as unshared, hold only their own tokens, and read the prefix at fp16 or its shrunk class") {
  // KVGC_PREFIX_CHARGE=prune, which 0.15 retired into shrink: the heap reports shrink.
  // Each holder's GC decides over its whole prompt as a sequence
  // that appended it: the same positions kept, the same classes (a shared token's charged
  // class), generations and scores, when both see the same attention mass per token (fed
  // by kvgc_observe, by position: attention itself reads a demoted shared token at fp16,
  // so its mass would differ by the quantisation error). Its demoted shared tokens stay
  // in the shared pages, read at fp16, or at int8 once every holder demoted the page's
  // (shrink); its tenant holds only headers and its own tokens.
  for (int config = 0; config < 3; ++config) {
    CAPTURE(config);
    kvgc_heap_options o = config == 0 ? gc_options(KVGC_POLICY_H2O, 60) : gc_options(KVGC_POLICY_GENERATIONAL, config == 1 ? 70 : 0);
    o.budget_bytes = 32 << 20;
    o.demote = config == 0 ? KVGC_DEMOTE_OFF : KVGC_DEMOTE_LADDER;
    if (config == 2) o.byte_budget_fraction = 0.3;
    o.compact_threshold = 0.25;
    o.prefix_charge = KVGC_PREFIX_CHARGE_PRUNE;
    Heap H(o, model(2, 2, 32));
    kvgc_heap_options got;
    kvgc_heap_options_init(&got);
    REQUIRE(kvgc_heap_get_options(H.h, &got) == KVGC_OK);
    CHECK(got.prefix_charge == KVGC_PREFIX_CHARGE_SHRINK);
    const uint32_t P = 150;
    const Holders hs = run_holders(H, P, 40);
    constexpr int N = Holders::N;
    const kvgc_seq *shared = hs.shared, *own = hs.own;
    const int64_t len = hs.len;
    const size_t tok = token_bytes(H.m);
    size_t charged_prompt = 0;  // prompt tokens the holders' ladders demoted in place
    size_t read_shrunk = 0;     // prompt tokens read from a page shrunk to int8
    for (int i = 0; i < N; ++i)
      for (uint32_t l = 0; l < 2; ++l) {
        const Image a = image(H, shared[i], l), b = image(H, own[i], l);
        CHECK(a.pos.size() < size_t(len));  // the GC pruned
        const std::vector<size_t> ra = by_position(a), rb = by_position(b);
        REQUIRE(ra.size() == rb.size());
        const auto src_k = gaussian(H.m, kPromptKey, l, 0, P, false);
        for (size_t j = 0; j < ra.size(); ++j) {
          CHECK(a.pos[ra[j]] == b.pos[rb[j]]);
          CHECK(a.cls[ra[j]] == b.cls[rb[j]]);  // the charged class is the unshared class
          CHECK(a.gen[ra[j]] == b.gen[rb[j]]);
          CHECK(a.score[ra[j]] == b.score[rb[j]]);
          // A prompt token reads as appended (fp16), whatever it is charged at, or from a
          // page shrunk to int8: within int8's rounding of it.
          charged_prompt += a.pos[ra[j]] < 144 && a.cls[ra[j]] != KVGC_CLASS_FP16;
          if (a.pos[ra[j]] < 144) {
            const uint8_t* got_k = a.k.data() + ra[j] * tok;
            const uint8_t* want_k = src_k.data() + size_t(a.pos[ra[j]]) * tok;
            if (std::memcmp(got_k, want_k, tok) != 0) {
              ++read_shrunk;
              CHECK(a.cls[ra[j]] != KVGC_CLASS_FP16);  // only a token every holder demoted
              const auto x = to_float(std::vector<uint8_t>(got_k, got_k + tok), H.m.dtype);
              const auto y = to_float(std::vector<uint8_t>(want_k, want_k + tok), H.m.dtype);
              for (uint32_t h = 0; h < H.m.n_kv_heads; ++h) {  // int8 rows: a scale per head
                float worst = 0, top = 0;
                for (uint32_t d = 0; d < H.m.head_dim; ++d) {
                  const size_t e = size_t(h) * H.m.head_dim + d;
                  worst = std::max(worst, std::abs(x[e] - y[e]));
                  top = std::max(top, std::abs(y[e]));
                }
                CHECK(worst <= top / 127.0f + 1e-3f);
              }
            }
          } else {  // a token of its own: the same bytes at the same rung as unshared
            CHECK(std::memcmp(a.k.data() + ra[j] * tok, b.k.data() + rb[j] * tok, tok) == 0);
            CHECK(std::memcmp(a.v.data() + ra[j] * tok, b.v.data() + rb[j] * tok, tok) == 0);
          }
        }
      }
    const kvgc_stats st = H.stats();
    if (config) CHECK(st.tokens_demoted > 0);
    CHECK((config == 0) == (charged_prompt == 0));
    CHECK((read_shrunk > 0) == (st.pages_shrunk > 0));
    if (config == 0) CHECK(st.pages_shrunk == 0);  // no rung below fp16: shrink is prune
    // Attention reads what kvgc_read reads: every live token once, a demoted shared one at
    // its page's precision, a demoted private one dequantised.
    for (int i = 0; i < N; ++i) check_attention_reads(H, shared[i], uint32_t(config) + 5);
    // The holders' tenant: header pages and their own tokens; the unshared tenant holds
    // its prompt too, at its rungs.
    uint64_t used_shared = 0, used_own = 0, limit = 0;
    REQUIRE(kvgc_tenant_usage(H.h, 1, &used_shared, &limit) == KVGC_OK);
    REQUIRE(kvgc_tenant_usage(H.h, 2, &used_own, &limit) == KVGC_OK);
    MESSAGE("config " << config << ": holders " << used_shared << " B, unshared " << used_own << " B");
    CHECK(used_shared < used_own);
    H.check();
  }
}

TEST_CASE("prefix cache, charged as shrink: pages every holder demoted are re-stored at int8, read there, and attached and kept as such") {
  // KVGC_PREFIX_CHARGE=shrink (runtime/shrink.cpp): prune's decisions (the same positions,
  // charged classes, generations and scores as unshared sequences fed the same mass), and
  // a shared page whose every holder counts each live slot at int8 or below is re-stored
  // at int8: its holders then read exactly the int8 rendering of the prompt there (what an
  // unshared sequence reads of a token it demoted to int8), the pages' tenant holds fewer
  // bytes, and a later sequence attaches the shrunk pages, keeps a prompt past them, and
  // forks, with the walker green throughout. Without a ladder nothing shrinks.
  for (int config = 0; config < 2; ++config) {
    CAPTURE(config);
    kvgc_heap_options o = config == 0 ? gc_options(KVGC_POLICY_H2O, 60) : gc_options(KVGC_POLICY_GENERATIONAL, 0);
    o.budget_bytes = 32 << 20;
    o.demote = config == 0 ? KVGC_DEMOTE_OFF : KVGC_DEMOTE_LADDER;
    if (config == 1) o.byte_budget_fraction = 0.3;
    o.prefix_charge = KVGC_PREFIX_CHARGE_SHRINK;
    Heap H(o, model(2, 2, 32));
    const uint32_t P = 150, pt = o.page_tokens;
    const auto ids = prompt_ids(P);
    const Holders hs = run_holders(H, P, 30);
    constexpr int N = Holders::N;
    const kvgc_seq *shared = hs.shared, *own = hs.own;
    const uint64_t cache_bytes0 = hs.cache_bytes;
    uint64_t limit = 0;
    const kvgc_stats st = H.stats();
    MESSAGE("config " << config << ": " << st.pages_shrunk << " pages shrunk, " << st.bytes_shrunk << " B");
    CHECK((st.pages_shrunk > 0) == (config == 1));
    CHECK((st.bytes_shrunk > 0) == (config == 1));
    // The int8 rendering of a prompt token (K or V, every head): fp16 re-stored, read back.
    const kvgc::PageLayout L8 = kvgc::PageLayout::make(pt, H.m.n_kv_heads, H.m.head_dim, H.m.dtype, KVGC_CLASS_INT8);
    const size_t tok = token_bytes(H.m), row = tok / H.m.n_kv_heads;
    auto rendered = [&](const uint8_t* src) {
      std::vector<uint8_t> page(L8.bytes), out(tok);
      for (uint32_t h = 0; h < H.m.n_kv_heads; ++h) {
        kvgc::cpu::store_row(L8, page.data(), h, 0, false, src + h * row);
        kvgc::cpu::load_row(L8, page.data(), h, 0, false, out.data() + h * row);
      }
      return out;
    };
    // Reads of prompt tokens: the source where the page is still fp16, else its rendering.
    auto check_prompt_reads = [&](const Image& a, uint32_t l, const Image* unshared) {
      size_t at_int8 = 0;
      const std::vector<size_t> ra = by_position(a);
      const std::vector<size_t> rb = unshared ? by_position(*unshared) : std::vector<size_t>{};
      const int64_t prompt_end = int64_t(P / pt * pt);  // whole shared pages
      const auto src_k = gaussian(H.m, kPromptKey, l, 0, uint32_t(prompt_end), false);
      const auto src_v = gaussian(H.m, kPromptKey, l, 0, uint32_t(prompt_end), true);
      for (size_t j = 0; j < ra.size(); ++j) {
        const int64_t p = a.pos[ra[j]];
        if (p >= prompt_end) continue;
        const uint8_t* k = a.k.data() + ra[j] * tok;
        const uint8_t* v = a.v.data() + ra[j] * tok;
        if (std::memcmp(k, src_k.data() + size_t(p) * tok, tok) == 0) {
          CHECK(std::memcmp(v, src_v.data() + size_t(p) * tok, tok) == 0);
          continue;
        }
        ++at_int8;
        CHECK(a.cls[ra[j]] != KVGC_CLASS_FP16);  // only pages no holder counts at fp16 shrink
        CHECK(std::memcmp(k, rendered(src_k.data() + size_t(p) * tok).data(), tok) == 0);
        CHECK(std::memcmp(v, rendered(src_v.data() + size_t(p) * tok).data(), tok) == 0);
        if (unshared && a.cls[ra[j]] == KVGC_CLASS_INT8)  // what the unshared copy demoted reads
          CHECK(std::memcmp(k, unshared->k.data() + rb[j] * tok, tok) == 0);
      }
      return at_int8;
    };
    size_t read_at_int8 = 0;
    for (int i = 0; i < N; ++i)
      for (uint32_t l = 0; l < 2; ++l) {
        const Image a = image(H, shared[i], l), b = image(H, own[i], l);
        const std::vector<size_t> ra = by_position(a), rb = by_position(b);
        REQUIRE(ra.size() == rb.size());
        for (size_t j = 0; j < ra.size(); ++j) {  // prune's decisions
          CHECK(a.pos[ra[j]] == b.pos[rb[j]]);
          CHECK(a.cls[ra[j]] == b.cls[rb[j]]);
          CHECK(a.gen[ra[j]] == b.gen[rb[j]]);
          CHECK(a.score[ra[j]] == b.score[rb[j]]);
        }
        read_at_int8 += check_prompt_reads(a, l, &b);
      }
    CHECK((read_at_int8 > 0) == (config == 1));
    // Attention reads what kvgc_read reads.
    for (int i = 0; i < N; ++i) check_attention_reads(H, shared[i], uint32_t(config) + 11);
    // The shared pages' tenant holds fewer bytes once they shrink.
    uint64_t cache_bytes = 0;
    REQUIRE(kvgc_tenant_usage(H.h, 3, &cache_bytes, &limit) == KVGC_OK);
    CHECK((cache_bytes < cache_bytes0) == (config == 1));
    CHECK(cache_bytes0 - cache_bytes == st.bytes_shrunk);
    H.check();

    // A later sequence attaches the shrunk pages (each header in its page's class table),
    // reads them at int8 from the start, appends, keeps a longer prompt past them, and a
    // third attaches that whole; a fork of a holder reads as the holder.
    kvgc_seq late, later, fork;
    REQUIRE(kvgc_seq_create(H.h, 1, &late) == KVGC_OK);
    CHECK(attach(H, late, ids, 42) == P);
    H.check();
    const uint32_t more = 5 * pt - P % pt;  // to a page boundary, then whole pages
    append_prompt(H, late, P, more);
    const auto ids2 = prompt_ids(P + more);
    keep(H, late, ids2, 42);
    H.check();
    REQUIRE(kvgc_seq_create(H.h, 1, &later) == KVGC_OK);
    CHECK(attach(H, later, ids2, 42) == P + more);
    for (uint32_t l = 0; l < 2; ++l) {
      const Image a = image(H, late, l), c = image(H, later, l);
      CHECK(a.pos.size() == P + more);
      CHECK((check_prompt_reads(a, l, nullptr) > 0) == (config == 1));
      const std::vector<size_t> ra = by_position(a), rc = by_position(c);
      for (size_t j = 0; j < rc.size(); ++j) {  // the same bytes at the same positions
        CHECK(c.pos[rc[j]] == a.pos[ra[j]]);
        CHECK(std::memcmp(c.k.data() + rc[j] * tok, a.k.data() + ra[j] * tok, tok) == 0);
      }
    }
    REQUIRE(kvgc_seq_fork(H.h, shared[0], 1, &fork, nullptr) == KVGC_OK);
    for (uint32_t l = 0; l < 2; ++l) CHECK(image(H, fork, l) == image(H, shared[0], l));
    H.check();
    for (kvgc_seq s : {late, later, fork}) REQUIRE(kvgc_seq_destroy(H.h, s) == KVGC_OK);
    for (int i = 0; i < N; ++i) REQUIRE(kvgc_seq_destroy(H.h, shared[i]) == KVGC_OK);
    H.check();
  }
}

TEST_CASE("prefix cache, charged as shrink: a holder's read order holds while other holders step") {
  // kvgc_observe's mass is in the order kvgc_read returned. Under shrink, another
  // sequence's step re-stores shared pages and moves every holder's header to the
  // shrunk class's table: a holder that had read (and not yet observed) would put its
  // mass on other tokens (kvgc-stress 4 8 300 2 failed 1-3 runs in 20 with wrong scores).
  // The interleaving forced here: every holder reads, then each in turn observes from
  // that read and steps, so holder 0's step runs while holders 1 and 2 hold their reads.
  // Their scores, positions, classes and generations must stay those of the unshared
  // copies fed the same mass by position, and pages must still shrink.
  kvgc_heap_options o = gc_options(KVGC_POLICY_GENERATIONAL, 0);
  o.budget_bytes = 32 << 20;
  o.demote = KVGC_DEMOTE_LADDER;
  o.byte_budget_fraction = 0.3;
  o.min_length = 0;
  o.prefix_charge = KVGC_PREFIX_CHARGE_SHRINK;
  Heap H(o, model(2, 2, 32));
  const uint32_t P = 150;
  const auto ids = prompt_ids(P);
  keep_prompt(H, 3, ids, /*salt=*/42);
  constexpr int N = 3;
  kvgc_seq shared[N], own[N];
  for (int i = 0; i < N; ++i) {
    REQUIRE(kvgc_seq_create(H.h, 1, &shared[i]) == KVGC_OK);
    REQUIRE(kvgc_seq_create(H.h, 2, &own[i]) == KVGC_OK);
    CHECK(attach(H, shared[i], ids, 42) == P);
    append_prompt(H, own[i], 0, P);
  }
  int64_t len = P;
  uint64_t shrunk_while_lent = 0;
  for (int round = 0; round < 30; ++round) {
    const uint32_t n = round == 0 ? 20 : 1 + round % 3;
    for (int i = 0; i < N; ++i)
      for (kvgc_seq s : {shared[i], own[i]})
        for (uint32_t l = 0; l < 2; ++l) {
          const auto k = gaussian(H.m, 77 + uint64_t(i), l, len, n, false), v = gaussian(H.m, 77 + uint64_t(i), l, len, n, true);
          REQUIRE(kvgc_append(H.h, s, l, k.data(), v.data(), n, nullptr) == KVGC_OK);
        }
    std::vector<Image> read[N];
    for (int i = 0; i < N; ++i)
      for (uint32_t l = 0; l < 2; ++l) read[i].push_back(image(H, shared[i], l));
    for (int i = 0; i < N; ++i) {
      for (uint32_t l = 0; l < 2; ++l) {
        const std::vector<float> mass = mass_by_position(read[i][l], l, round);
        REQUIRE(kvgc_observe(H.h, shared[i], l, mass.data(), mass.size(), nullptr) == KVGC_OK);
        observe_by_position(H, own[i], l, round);
      }
      const uint64_t before = H.stats().pages_shrunk;
      const kvgc_status a = H.step(shared[i]), b = H.step(own[i]);
      CHECK(a == b);
      if (i + 1 < N) shrunk_while_lent += H.stats().pages_shrunk - before;
    }
    len += n;
    H.check();
  }
  for (int i = 0; i < N; ++i)
    for (uint32_t l = 0; l < 2; ++l) {
      const Image a = image(H, shared[i], l), b = image(H, own[i], l);
      const std::vector<size_t> ra = by_position(a), rb = by_position(b);
      REQUIRE(ra.size() == rb.size());
      for (size_t j = 0; j < ra.size(); ++j) {
        CAPTURE(a.pos[ra[j]]);
        CHECK(a.pos[ra[j]] == b.pos[rb[j]]);
        CHECK(a.score[ra[j]] == b.score[rb[j]]);
        CHECK(a.cls[ra[j]] == b.cls[rb[j]]);
        CHECK(a.gen[ra[j]] == b.gen[rb[j]]);
      }
    }
  const kvgc_stats st = H.stats();
  MESSAGE(st.pages_shrunk << " pages shrunk, " << shrunk_while_lent << " while another holder's read was lent");
  CHECK(st.pages_shrunk > 0);
  CHECK(shrunk_while_lent == 0);  // every page here has a holder that was still reading
  for (int i = 0; i < N; ++i) {
    REQUIRE(kvgc_seq_destroy(H.h, shared[i]) == KVGC_OK);
    REQUIRE(kvgc_seq_destroy(H.h, own[i]) == KVGC_OK);
  }
  H.check();
}

TEST_CASE("prefix cache, charged as shrink: a batched decode loop shrinks shared pages at its plans") {
  // The shrink pass also runs at kvgc_batch_plan (after the previous plan is spent): a
  // decode loop that only plans, appends, attends (scores from real attention) and steps
  // re-stores the pages its holders demoted, the exported pages name the shrunk copies,
  // and the walker holds after every step.
  kvgc_heap_options o = gc_options(KVGC_POLICY_GENERATIONAL, 0);
  o.budget_bytes = 32 << 20;
  o.byte_budget_fraction = 0.3;
  o.demote = KVGC_DEMOTE_LADDER;
  o.prefix_charge = KVGC_PREFIX_CHARGE_SHRINK;
  Heap H(o, model(2, 2, 32));
  const uint32_t P = 150;
  const auto ids = prompt_ids(P);
  keep_prompt(H, 0, ids);
  constexpr uint32_t N = 3;
  kvgc_seq s[N];
  for (auto& x : s) {
    REQUIRE(kvgc_seq_create(H.h, 0, &x) == KVGC_OK);
    CHECK(attach(H, x, ids) == P);
  }
  kvgc_batch* b = nullptr;
  REQUIRE(kvgc_batch_create(H.h, &b) == KVGC_OK);
  kvgc_model_desc qm = H.m;
  qm.n_kv_heads = H.m.n_q_heads;
  int64_t len = P;
  for (int round = 0; round < 40; ++round) {
    const uint32_t n = round == 0 ? 16 : 1;
    const uint32_t n_new[N] = {n, n, n};
    REQUIRE(kvgc_batch_plan(b, s, n_new, N, nullptr, nullptr) == KVGC_OK);
    // The holders see the same tokens and queries (each row repeated per sequence), so
    // they agree on what to demote: the pages they all demoted shrink.
    auto per_seq = [&](const std::vector<uint8_t>& x) {
      std::vector<uint8_t> all;
      for (uint32_t i = 0; i < N; ++i) all.insert(all.end(), x.begin(), x.end());
      return all;
    };
    for (uint32_t l = 0; l < 2; ++l) {
      const auto k = per_seq(gaussian(H.m, 500 + uint64_t(round), l, len, n, false));
      const auto v = per_seq(gaussian(H.m, 500 + uint64_t(round), l, len, n, true));
      REQUIRE(kvgc_batch_append(b, l, k.data(), v.data(), nullptr) == KVGC_OK);
      const auto q = per_seq(gaussian(qm, 900 + uint64_t(round), l, len, n, false));
      std::vector<uint8_t> out(q.size());
      REQUIRE(kvgc_batch_attend(b, l, q.data(), out.data(), nullptr, nullptr) == KVGC_OK);
    }
    REQUIRE(kvgc_batch_step(b, nullptr) == KVGC_OK);
    len += n;
    H.check();
  }
  const kvgc_stats st = H.stats();
  MESSAGE(st.pages_shrunk << " pages shrunk by the batched loop; " << st.tokens_demoted << " demoted, " << st.tokens_evicted << " evicted, " << st.gcs << " gcs");
  CHECK(st.pages_shrunk > 0);
  // The next plan's export names each holder's pages where they are now: some K/V pages
  // are shrunk shared ones (INT8), read through a header of the holder's own.
  const uint32_t one[N] = {1, 1, 1};
  REQUIRE(kvgc_batch_plan(b, s, one, N, nullptr, nullptr) == KVGC_OK);
  const auto k = gaussian(H.m, 7, 0, len, N, false), v = gaussian(H.m, 7, 0, len, N, true);
  REQUIRE(kvgc_batch_append(b, 0, k.data(), v.data(), nullptr) == KVGC_OK);
  kvgc_batch_view view;
  view.struct_size = sizeof view;
  REQUIRE(kvgc_batch_export(b, 0, &view) == KVGC_OK);
  uint32_t shrunk_pages = 0;
  for (uint32_t p = 0; p < view.n_pages; ++p)
    shrunk_pages += view.kv_offset[p] != view.page_offset[p] && view.page_class[p] == KVGC_CLASS_INT8;
  CHECK(shrunk_pages > 0);
  kvgc_batch_destroy(b);
  H.check();
}
