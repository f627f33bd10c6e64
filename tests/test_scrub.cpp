// Scrubbing over a grid of page geometries: tenant A fills the arena with a marker and
// leaves; tenant B takes the same memory through every path that takes pages (append's
// fresh pages, demotion's), with slabs re-carved between the classes; every byte of
// every page B holds is scanned (tests/page_scan.hpp): the bytes no slot owns (the
// alignment padding between its regions, after K, after V, at its end) and those of
// slots never written must be zero, and A's marker must appear nowhere. One geometry happening to be clean proved nothing: the padding moves
// with page_tokens, heads, head_dim and dtype. Under the deferred harvest the scan also
// runs in the window between a kvgc_step and its harvest, when B's page tables still
// hold the demotion pages the GC reserved and did not use (issue 22: they held A's bytes
// there, their live masks only cleared).
#include <doctest/doctest.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "../c_api/internal.hpp"
#include "../kernels/cpu/convert.hpp"
#include "../kernels/page_layout.hpp"
#include "../gc/ladder.hpp"
#include "page_scan.hpp"
#include "util.hpp"

using namespace kvgc_test;

namespace {

constexpr char kMarker[9] = "SECRET!!";

// How tenant pages of class `cls` come to exist: every class the heap has must be
// reachable here, or the scan would silently skip it.
kvgc_demote demote_reaching(int cls) {
  switch (cls) {
    case KVGC_CLASS_FP16: return KVGC_DEMOTE_OFF;   // append
    case KVGC_CLASS_INT4: return KVGC_DEMOTE_INT4;  // demotion
    case KVGC_CLASS_INT8: return KVGC_DEMOTE_INT8;
    case KVGC_CLASS_INT2: return KVGC_DEMOTE_LADDER_INT2;  // the ladder's last rung
  }
  FAIL("storage class " << cls << " has no path in this test: add how its pages are taken");
  return KVGC_DEMOTE_OFF;
}

struct Geometry {
  uint32_t page_tokens, heads, head_dim;
  kvgc_dtype dtype;
};

struct ScanResult {
  size_t pages[KVGC_CLASS_COUNT] = {};
  size_t dirty_padding = 0, markers = 0;  // pages with a dirty byte; marker hits
  size_t window_scans = 0;   // scans made with a GC's results pending (deferred harvest)
  size_t window_empty = 0;   // pages below FP16 with no live slot seen in those scans
  std::string first;  // where the first finding was
};

// Appends n tokens of `data`'s rows (or as many as fit); true if all went in.
bool append_rows(kvgc_heap* h, kvgc_seq s, const std::vector<uint8_t>& data, uint32_t n) {
  return kvgc_append(h, s, 0, data.data(), data.data(), n, nullptr) == KVGC_OK;
}

// Fills the arena through `seq` in chunks (appends until the arena refuses), observing
// uniform mass and stepping, so that demotion (when on) takes int4 pages as it goes.
void fill(kvgc_heap* h, kvgc_seq s, const std::vector<uint8_t>& rows, uint32_t chunk) {
  for (int i = 0; i < 10; ++i) {
    if (!append_rows(h, s, rows, chunk)) {
      REQUIRE(kvgc_step(h, s, nullptr) != KVGC_EINTERNAL);
      if (!append_rows(h, s, rows, std::max(1u, chunk / 4))) break;
    }
    uint64_t live = 0;
    REQUIRE(kvgc_seq_tokens(h, s, 0, &live, nullptr) == KVGC_OK);
    std::vector<float> mass(live, 1.f);
    REQUIRE(kvgc_observe(h, s, 0, mass.data(), live, nullptr) == KVGC_OK);
    const kvgc_status st = kvgc_step(h, s, nullptr);
    REQUIRE((st == KVGC_OK || st == KVGC_EBUDGET));
  }
}

// One heap of geometry g with demotion `demote` (FP16 pages come from appends in every
// run). With the deferred harvest, B's pages are scanned first in the window the last
// step left open (its results pending), then again once they are applied.
ScanResult scan_geometry(const Geometry& g, kvgc_demote demote,
                         kvgc_harvest harvest = KVGC_HARVEST_IMMEDIATE) {
  ScanResult res;
  const kvgc_model_desc m = model(1, g.heads, g.head_dim, g.dtype);
  const kvgc::PageLayout fp16 =
      kvgc::PageLayout::make(g.page_tokens, g.heads, g.head_dim, g.dtype, KVGC_CLASS_FP16);
  const size_t slab = std::max<size_t>(64 << 10, fp16.bytes);
  kvgc_heap_options o = cpu_options(6 * slab, g.page_tokens);
  o.policy = KVGC_POLICY_H2O;
  o.sinks = 1;
  o.window = 1;
  // Uniform mass takes the rungs in ladder order: at half the tokens' units the walk stops
  // at int4; the int2 rung needs a budget below what int4 alone can meet (int4 pages are
  // about 0.3 of fp16's, 0.14 of f32's).
  o.token_budget_fraction = demote != KVGC_DEMOTE_LADDER_INT2 ? 0.5 : g.dtype == KVGC_DTYPE_F32 ? 0.1 : 0.15;
  o.harvest = harvest;
  bool need[KVGC_CLASS_COUNT] = {};
  need[KVGC_CLASS_FP16] = true;
  o.demote = demote;
  kvgc_heap* h = nullptr;
  REQUIRE(kvgc_heap_create(&m, &o, &h) == KVGC_OK);
  kvgc::ManagedHeap* impl = kvgc::internal_heap(h);
  // A class off the ladder (it saves too little for tiny heads, or is dominated) is not
  // reached.
  uint64_t page_bytes[KVGC_CLASS_COUNT];
  for (int c = 0; c < KVGC_CLASS_COUNT; ++c) page_bytes[c] = impl->layout(c).bytes;
  std::string note;
  const kvgc::Ladder ladder = kvgc::make_ladder(o.demote, page_bytes, &note);
  for (int c = 1; c < KVGC_CLASS_COUNT; ++c)
    need[c] = std::find(ladder.cls, ladder.cls + ladder.n, uint8_t(c)) != ladder.cls + ladder.n;

  const size_t tb = token_bytes(m);
  // A slab's worth of tokens per chunk (plus one: chunks end mid-page): the arena's six
  // slabs change hands, and classes, within a few calls.
  const uint32_t chunk = uint32_t(slab / fp16.bytes) * g.page_tokens + 1;
  std::vector<uint8_t> secret(size_t(chunk) * tb);
  for (size_t i = 0; i < secret.size(); ++i) secret[i] = uint8_t(kMarker[i % 8]);
  // B's own data: small multiples of 1/4 in the model dtype (cheap to make, and no byte
  // pattern of the marker's).
  std::vector<uint8_t> mine(secret.size());
  const size_t eb = elem_bytes(m);
  for (size_t i = 0; i < mine.size() / eb; ++i)
    kvgc::cpu::store(&mine[i * eb], m.dtype, float(int(i % 13) - 6) * 0.25f);
  // Every byte of one of B's pages: padding and never-written slots zero, A's marker
  // nowhere.
  auto scan = [&](const uint8_t* page, int cls, uint32_t used) {
    const kvgc::PageLayout& L = impl->layout(cls);
    const size_t bytes = L.bytes;
    const std::string bad = scan_page(L, page, used);
    if (!bad.empty()) {
      if (res.first.empty()) res.first = bad;
      ++res.dirty_padding;
    }
    for (const uint8_t* p = page; (p = static_cast<const uint8_t*>(
                                       std::memchr(p, kMarker[0], size_t(page + bytes - p))));
         ++p)
      if (p + 8 <= page + bytes && std::memcmp(p, kMarker, 8) == 0) {
        if (res.first.empty()) res.first = "marker at byte " + std::to_string(p - page);
        ++res.markers;
      }
  };
  for (int round = 0; round < 2; ++round) {
    kvgc_seq a, b;
    REQUIRE(kvgc_seq_create(h, 7, &a) == KVGC_OK);
    fill(h, a, secret, chunk);
    REQUIRE(kvgc_seq_destroy(h, a) == KVGC_OK);
    // B: a fresh page with one token first (its other slots never written), then more.
    REQUIRE(kvgc_seq_create(h, 8, &b) == KVGC_OK);
    REQUIRE(kvgc_append(h, b, 0, mine.data(), mine.data(), 1, nullptr) == KVGC_OK);
    fill(h, b, mine, chunk);
    // The deferred harvest's window: nothing has applied the last step's results yet
    // (for_each_page does not settle; kvgc_seq_tokens below does).
    const bool window = harvest == KVGC_HARVEST_DEFERRED && impl->pending_gcs() > 0;
    if (window) {
      ++res.window_scans;
      REQUIRE(impl->for_each_page(b, [&](const uint8_t* page, size_t, int cls, uint32_t used) {
        const kvgc::PageLayout& L = impl->layout(cls);
        bool any = false;
        for (uint32_t w = 0; w < kvgc::PageLayout::live_words(L.page_tokens); ++w)
          any |= reinterpret_cast<const uint32_t*>(page + L.live_off)[w] != 0;
        res.window_empty += cls != KVGC_CLASS_FP16 && !any;
        ++res.pages[cls];
        scan(page, cls, used);
      }).ok());
      CHECK(impl->pending_gcs() > 0);  // the scan itself applied nothing
    }
    uint64_t live = 0;
    REQUIRE(kvgc_seq_tokens(h, b, 0, &live, nullptr) == KVGC_OK);
    CHECK(live > 0);
    REQUIRE(impl->for_each_page(b, [&](const uint8_t* page, size_t, int cls, uint32_t used) {
      ++res.pages[cls];
      scan(page, cls, used);
    }).ok());
    REQUIRE(kvgc_seq_destroy(h, b) == KVGC_OK);
  }
  // Every class the ladder holds was reached (a ladder of several rungs may push one
  // class's tokens all further down by the end: one of them, and FP16, will do).
  const bool ladder_of_rungs = ladder.n > 2;
  for (int c = 0; c < KVGC_CLASS_COUNT; ++c)
    if (need[c] && !(ladder_of_rungs && c != KVGC_CLASS_FP16)) {
      INFO("class " << c << " pages were never taken by B");
      CHECK(res.pages[c] > 0);
    }
  if (ladder_of_rungs) {
    INFO("no page below fp16 was ever taken by B");
    CHECK(res.pages[KVGC_CLASS_INT4] + res.pages[KVGC_CLASS_INT8] + res.pages[KVGC_CLASS_INT2] > 0);
  }
  if (need[KVGC_CLASS_INT2]) {  // int2 is the last rung: uniform mass reaches it
    INFO("int2 pages were never taken by B");
    CHECK(res.pages[KVGC_CLASS_INT2] > 0);
  }
  CHECK(kvgc_heap_check(h) == KVGC_OK);
  kvgc_heap_destroy(h);
  return res;
}

}  // namespace

TEST_CASE("scrubbing: no byte of a destroyed tenant survives in another's pages, over a grid of geometries") {
  // page_tokens 1..256, heads 1..8, head_dim 8..256 (non-powers of two included), every
  // dtype; each (page_tokens, head_dim, dtype) once, heads cycling through 1..8. The
  // first three are geometries the outside scan found dirty before the fix.
  std::vector<Geometry> grid = {{16, 2, 32, KVGC_DTYPE_F16},
                                {3, 5, 64, KVGC_DTYPE_F16},
                                {100, 1, 40, KVGC_DTYPE_F16}};
  const uint32_t pts[] = {1, 2, 3, 7, 16, 33, 100, 256};
  const uint32_t hds[] = {8, 24, 40, 64, 72, 128, 200, 256};
  const kvgc_dtype dts[] = {KVGC_DTYPE_F16, KVGC_DTYPE_BF16, KVGC_DTYPE_F32};
  // Sanitizer builds (-O0, the walker after every call) take every fourth geometry: the
  // release build runs them all.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__) || KVGC_ASSERT_LEVEL >= 2
  const uint32_t stride = 4;
#else
  const uint32_t stride = 1;
#endif
  uint32_t i = 0;
  for (kvgc_dtype dt : dts)
    for (uint32_t pt : pts)
      for (uint32_t hd : hds) {
        const uint32_t heads = 1 + (i % 8);
        if (i++ % stride) continue;
        // Keep each heap small: the largest pages would need tens of MiB per arena.
        if (size_t(pt) * heads * hd * (dt == KVGC_DTYPE_F32 ? 4 : 2) > (1u << 20)) continue;
        grid.push_back({pt, heads, hd, dt});
      }
  size_t pages[KVGC_CLASS_COUNT] = {}, dirty = 0;
  for (const Geometry& g : grid) {
    CAPTURE(g.page_tokens);
    CAPTURE(g.heads);
    CAPTURE(g.head_dim);
    CAPTURE(int(g.dtype));
    for (int target = 1; target < KVGC_CLASS_COUNT; ++target) {  // every class below fp16
      CAPTURE(target);
      const ScanResult r = scan_geometry(g, demote_reaching(target));
      INFO(r.first);
      CHECK(r.dirty_padding == 0);
      CHECK(r.markers == 0);
      dirty += r.dirty_padding + r.markers != 0;
      for (int c = 0; c < KVGC_CLASS_COUNT; ++c) pages[c] += r.pages[c];
    }
  }
  std::string per_class;
  for (int c = 0; c < KVGC_CLASS_COUNT; ++c) per_class += " " + std::to_string(pages[c]);
  MESSAGE(grid.size() << " geometries, " << dirty << " with a finding; pages scanned per class:"
                      << per_class);
  CHECK(grid.size() > 150 / stride);
}

// Issue 22: between a kvgc_step and its harvest (KVGC_HARVEST=deferred, the default), B's
// page tables hold the demotion pages the GC reserved; those it did not use had only
// their live masks cleared and showed A's bytes (443 findings from outside over the int8
// and ladder geometries; 0 once the harvest was forced). The select op now zeroes every
// fresh destination page whole before anything else, so the window is as clean as after.
TEST_CASE("scrubbing: no byte of a destroyed tenant survives in the deferred harvest's window, int8 and ladder") {
  std::vector<Geometry> grid = {{16, 2, 32, KVGC_DTYPE_F16},
                                {3, 5, 64, KVGC_DTYPE_F16},
                                {100, 1, 40, KVGC_DTYPE_F16}};
  const uint32_t pts[] = {1, 2, 3, 7, 16, 33, 100, 256};
  const uint32_t hds[] = {8, 24, 40, 64, 72, 128, 200, 256};
  const kvgc_dtype dts[] = {KVGC_DTYPE_F16, KVGC_DTYPE_BF16, KVGC_DTYPE_F32};
  // Every geometry in every build (26 s under ASan at assert level 2): the sanitizer
  // builds' every-fourth grid of the test above saw no reserved page left empty in the
  // window, so it would prove nothing here.
  const uint32_t stride = 1;
  uint32_t i = 0;
  for (kvgc_dtype dt : dts)
    for (uint32_t pt : pts)
      for (uint32_t hd : hds) {
        const uint32_t heads = 1 + (i % 8);
        if (i++ % stride) continue;
        if (size_t(pt) * heads * hd * (dt == KVGC_DTYPE_F32 ? 4 : 2) > (1u << 20)) continue;
        grid.push_back({pt, heads, hd, dt});
      }
  size_t dirty = 0, scans = 0, empty = 0;
  for (const Geometry& g : grid) {
    CAPTURE(g.page_tokens);
    CAPTURE(g.heads);
    CAPTURE(g.head_dim);
    CAPTURE(int(g.dtype));
    for (kvgc_demote d : {KVGC_DEMOTE_INT8, KVGC_DEMOTE_LADDER}) {
      CAPTURE(int(d));
      const ScanResult r = scan_geometry(g, d, KVGC_HARVEST_DEFERRED);
      INFO(r.first);
      CHECK(r.dirty_padding == 0);
      CHECK(r.markers == 0);
      dirty += r.dirty_padding + r.markers != 0;
      scans += r.window_scans;
      empty += r.window_empty;
    }
  }
  MESSAGE(grid.size() << " geometries x {int8, ladder}, " << dirty << " with a finding; " << scans
                      << " scans in the window, " << empty
                      << " pages below fp16 with no live slot seen there");
  // The window was really scanned, with reserved pages in it.
  CHECK(scans > grid.size());
  CHECK(empty > 0);
}

// Shared pages (0.7): a header page is written whole when it is taken (a copy of its
// source's, or composed by an attach), a copy-on-write copy is whole, and a shared page
// was scrubbed when its creator took it fresh. Tenant A fills the arena with a marker
// and leaves; tenant B keeps a prompt, attaches it twice (one of them writes on, copying
// the shared partly filled tail), forks the keeper and steps under a budget; every page of
// every B sequence, as it sees it (its header, then the shared K/V), and every header
// page's own bytes are scanned.
TEST_CASE("scrubbing: header pages, shared pages and copy-on-write copies never show a previous owner's bytes") {
  const Geometry grid[] = {{16, 2, 32, KVGC_DTYPE_F16}, {3, 5, 64, KVGC_DTYPE_F16},
                           {7, 1, 40, KVGC_DTYPE_BF16}, {100, 1, 40, KVGC_DTYPE_F16},
                           {33, 3, 24, KVGC_DTYPE_F32}};
  for (const Geometry& g : grid) {
    CAPTURE(g.page_tokens);
    CAPTURE(g.heads);
    const kvgc_model_desc m = model(1, g.heads, g.head_dim, g.dtype);
    const kvgc::PageLayout fp16 =
        kvgc::PageLayout::make(g.page_tokens, g.heads, g.head_dim, g.dtype, KVGC_CLASS_FP16);
    const size_t slab = std::max<size_t>(64 << 10, fp16.bytes);
    kvgc_heap_options o = cpu_options(8 * slab, g.page_tokens);
    o.policy = KVGC_POLICY_H2O;
    o.sinks = 1;
    o.window = 1;
    o.token_budget_fraction = 0.5;
    o.harvest = KVGC_HARVEST_IMMEDIATE;
    kvgc_heap* h = nullptr;
    REQUIRE(kvgc_heap_create(&m, &o, &h) == KVGC_OK);
    kvgc::ManagedHeap* impl = kvgc::internal_heap(h);
    const size_t tb = token_bytes(m);
    const uint32_t chunk = uint32_t(slab / fp16.bytes) * g.page_tokens + 1;
    std::vector<uint8_t> secret(size_t(chunk) * tb);
    for (size_t i = 0; i < secret.size(); ++i) secret[i] = uint8_t(kMarker[i % 8]);
    kvgc_seq a;
    REQUIRE(kvgc_seq_create(h, 7, &a) == KVGC_OK);
    fill(h, a, secret, chunk);
    REQUIRE(kvgc_seq_destroy(h, a) == KVGC_OK);
    const uint32_t P = 3 * g.page_tokens + 2;  // whole pages and a partly filled one
    std::vector<uint8_t> mine(size_t(P + 8) * tb);
    const size_t eb = elem_bytes(m);
    for (size_t i = 0; i < mine.size() / eb; ++i)
      kvgc::cpu::store(&mine[i * eb], m.dtype, float(int(i % 13) - 6) * 0.25f);
    std::vector<int32_t> ids(P);
    for (uint32_t i = 0; i < P; ++i) ids[i] = int32_t(i + 1);
    kvgc_seq keeper, x, y, f;
    REQUIRE(kvgc_seq_create(h, 8, &keeper) == KVGC_OK);
    REQUIRE(append_rows(h, keeper, mine, P));
    REQUIRE(kvgc_prefix_keep(h, keeper, ids.data(), P, 0, 0, nullptr, nullptr) == KVGC_OK);
    uint64_t got = 0;
    REQUIRE(kvgc_seq_create(h, 8, &x) == KVGC_OK);
    REQUIRE(kvgc_seq_create(h, 8, &y) == KVGC_OK);
    REQUIRE(kvgc_prefix_attach(h, x, ids.data(), P, 0, &got, nullptr) == KVGC_OK);
    CHECK(got == P);
    REQUIRE(kvgc_prefix_attach(h, y, ids.data(), P, 0, &got, nullptr) == KVGC_OK);
    REQUIRE(append_rows(h, y, mine, 5));  // copies the shared tail, then writes on
    REQUIRE(kvgc_seq_fork(h, keeper, 8, &f, nullptr) == KVGC_OK);
    REQUIRE(append_rows(h, f, mine, 2));
    for (kvgc_seq s : {y, f}) REQUIRE(kvgc_step(h, s, nullptr) != KVGC_EINTERNAL);
    size_t pages = 0, dirty = 0, markers = 0;
    std::string first;
    auto scan = [&](const uint8_t* page, size_t bytes, const kvgc::PageLayout* L, uint32_t used) {
      ++pages;
      if (L) {
        const std::string bad = scan_page(*L, page, used);
        if (!bad.empty()) {
          ++dirty;
          if (first.empty()) first = bad;
        }
      }
      for (size_t i = 0; i + 8 <= bytes; ++i)
        if (std::memcmp(page + i, kMarker, 8) == 0) {
          ++markers;
          if (first.empty()) (first = "marker at byte ") += std::to_string(i);
        }
    };
    {
      std::lock_guard<std::mutex> lock(impl->mutex());
      for (kvgc_seq s : {keeper, x, y, f})
        REQUIRE(impl->for_each_page(s, [&](const uint8_t* page, size_t bytes, int cls, uint32_t used) {
          scan(page, bytes, &impl->layout(cls), used);
        }).ok());
    }
    kvgc_stats st;
    kvgc_stats_init(&st);
    REQUIRE(kvgc_get_stats(h, &st) == KVGC_OK);
    INFO(first);
    CHECK(dirty == 0);
    CHECK(markers == 0);
    CHECK(pages > 0);
    CHECK(st.cow_copies >= 2);
    CHECK(st.cls_header.pages_used > 0);
    CHECK(kvgc_heap_check(h) == KVGC_OK);
    kvgc_heap_destroy(h);
  }
}
