// kvgc_seq_fork on the CPU backend: the copy reads back exactly as its source (K/V,
// positions, scores, generations, int4 tokens included), both continue independently
// and make the same GC decisions on the same input, and a fork that cannot fit changes
// nothing. Since 0.7 the copy shares the pages: a header page per page and holder, no
// K/V page more.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstring>

#include "../c_api/kvgc.hpp"
#include "gc_util.hpp"

using namespace kvgc_test;

namespace {

// Everything a segment holds, in read order.
using Image = Heap::Image;
// The image with its tokens in position order.
Image by_position(const Image& im, size_t tb) {
  std::vector<size_t> order(im.pos.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t x, size_t y) { return im.pos[x] < im.pos[y]; });
  Image out = im;
  for (size_t j = 0; j < order.size(); ++j) {
    const size_t i = order[j];
    out.pos[j] = im.pos[i];
    out.score[j] = im.score[i];
    out.gen[j] = im.gen[i];
    out.cls[j] = im.cls[i];
    std::memcpy(&out.k[j * tb], &im.k[i * tb], tb);
    std::memcpy(&out.v[j * tb], &im.v[i * tb], tb);
  }
  return out;
}
std::vector<int32_t> sorted(std::vector<int32_t> v) {
  std::sort(v.begin(), v.end());
  return v;
}
Image image(Heap& H, kvgc_seq s, uint32_t layer) { return H.image(s, layer); }

}  // namespace

TEST_CASE("fork: an exact copy that continues on its own, with the same GC decisions") {
  for (const kvgc_demote demote : {KVGC_DEMOTE_OFF, KVGC_DEMOTE_INT4}) {
    CAPTURE(demote);
    kvgc_heap_options o = gc_options(KVGC_POLICY_GENERATIONAL, 40, 4, 8, 8);
    o.demote = demote;
    Heap H(o, model(2, 2, 32));
    kvgc_seq a;
    REQUIRE(kvgc_seq_create(H.h, 0, &a) == KVGC_OK);
    for (int round = 0; round < 6; ++round)
      for (uint32_t layer = 0; layer < 2; ++layer) {
        H.append(a, layer, round * 20, 20);
        H.observe(a, layer, [&](int32_t p) { return weight(p * 3 + round); });
        if (layer == 1) REQUIRE(H.step(a) == KVGC_OK);
      }
    // Results of the last step are still pending (the fork applies them first), and 5
    // tokens since the last minor GC count towards the next one (in both, after).
    for (uint32_t layer = 0; layer < 2; ++layer) H.append(a, layer, 120, 5);
    const kvgc_stats before = H.stats();
    kvgc_seq b = 0;
    REQUIRE(kvgc_seq_fork(H.h, a, 0, &b, nullptr) == KVGC_OK);
    CHECK(b != a);
    H.check();
    const kvgc_stats after = H.stats();
    CHECK(after.sequences == before.sequences + 1);
    CHECK(after.live_tokens == 2 * before.live_tokens);
    // Shared, not copied: the same K/V pages, and a header page per page for each holder.
    const uint64_t pages = before.cls[0].pages_used + before.cls[1].pages_used + before.cls_int8.pages_used;
    CHECK(after.cls[0].pages_used == before.cls[0].pages_used);
    CHECK(after.cls[1].pages_used == before.cls[1].pages_used);
    CHECK(after.cls_header.pages_used == 2 * pages);
    CHECK(after.shared_pages == pages);
    CHECK(after.shared_refs == 2 * pages);
    if (demote == KVGC_DEMOTE_INT4) CHECK(before.cls[1].pages_used > 0);  // int4 pages shared too
    for (uint32_t layer = 0; layer < 2; ++layer) {
      CHECK(image(H, a, layer) == image(H, b, layer));
      uint64_t la = 0, lb = 0;
      REQUIRE(kvgc_seq_tokens(H.h, a, layer, nullptr, &la) == KVGC_OK);
      REQUIRE(kvgc_seq_tokens(H.h, b, layer, nullptr, &lb) == KVGC_OK);
      CHECK(la == lb);
    }
    // The same input from here on: the same decisions (the GC state was copied too).
    // Small appends: a minor GC runs every page (8 tokens), so the copied count matters.
    for (int round = 0; round < 12; ++round)
      for (kvgc_seq s : {a, b})
        for (uint32_t layer = 0; layer < 2; ++layer) {
          const int64_t at = 125 + round * 3;
          const auto k = gaussian(H.m, a, layer, at, 3, false);  // a's values for both
          const auto v = gaussian(H.m, a, layer, at, 3, true);
          REQUIRE(kvgc_append(H.h, s, layer, k.data(), v.data(), 3, nullptr) == KVGC_OK);
          H.observe(s, layer, [&](int32_t p) { return weight(p * 5 + round); });
          if (layer == 1) REQUIRE(H.step(s) == KVGC_OK);
        }
    // The same tokens, scores, generations and classes. Without the ladder, in the same
    // read order too; with it, a page that the demotions left to one holder becomes that
    // holder's own (kvgc_stats.pages_unshared) and may be compacted a step before the
    // other's copy would have been: the same tokens, read in another order.
    for (uint32_t layer = 0; layer < 2; ++layer)
      if (demote == KVGC_DEMOTE_OFF)
        CHECK(image(H, a, layer) == image(H, b, layer));
      else
        CHECK(by_position(image(H, a, layer), token_bytes(H.m)) == by_position(image(H, b, layer), token_bytes(H.m)));
    H.check();
    // Then they diverge: what one appends, the other never sees.
    const Image a0 = image(H, a, 0);
    H.append(b, 0, 161, 5);
    CHECK(image(H, a, 0) == a0);
    // Destroying the source leaves the copy whole.
    const Image b1 = image(H, b, 1);
    REQUIRE(kvgc_seq_destroy(H.h, a) == KVGC_OK);
    CHECK(image(H, b, 1) == b1);
    H.check();
    REQUIRE(kvgc_seq_destroy(H.h, b) == KVGC_OK);
    const kvgc_stats end = H.stats();
    CHECK(end.cls[0].pages_used + end.cls[1].pages_used + end.cls_header.pages_used == 0);
    CHECK(end.shared_pages == 0);
  }
}

TEST_CASE("fork: when the last fork goes, its source takes its pages back and the header pages return") {
  // A sequence forked twice, then both forks destroyed: at its next step every page it
  // shares with nobody becomes its own again. Beside it, a twin that was never forked
  // and gets the same input: the same tokens, read the same way, and the same bytes.
  // Under prune and shrink, a header whose holder charged a slot below the page's class
  // stays one (Backing::charged): those runs check the bytes go down and the heap holds.
  struct Config {
    kvgc_demote demote;
    kvgc_prefix_charge charge;
  };
  for (const Config cfg : {Config{KVGC_DEMOTE_OFF, KVGC_PREFIX_CHARGE_CACHE},
                           Config{KVGC_DEMOTE_LADDER, KVGC_PREFIX_CHARGE_VIEW},
                           Config{KVGC_DEMOTE_LADDER, KVGC_PREFIX_CHARGE_SHRINK}}) {
    CAPTURE(cfg.demote);
    CAPTURE(cfg.charge);
    kvgc_heap_options o = gc_options(KVGC_POLICY_GENERATIONAL, 60, 4, 8, 8);
    o.demote = cfg.demote;
    o.prefix_charge = cfg.charge;
    o.compact_threshold = 1.0;  // the twin's pages stay where the source's are
    Heap H(o, model(2, 2, 32));
    kvgc_seq a, twin;
    REQUIRE(kvgc_seq_create(H.h, 0, &a) == KVGC_OK);
    REQUIRE(kvgc_seq_create(H.h, 0, &twin) == KVGC_OK);
    int64_t len = 0;
    auto feed = [&](kvgc_seq s, int64_t at, uint32_t n, int round) {
      for (uint32_t layer = 0; layer < 2; ++layer) {
        const auto k = gaussian(H.m, a, layer, at, n, false), v = gaussian(H.m, a, layer, at, n, true);
        REQUIRE(kvgc_append(H.h, s, layer, k.data(), v.data(), n, nullptr) == KVGC_OK);
        H.observe(s, layer, [&](int32_t p) { return weight(p * 3 + round); });
      }
      REQUIRE(H.step(s) == KVGC_OK);
    };
    for (int round = 0; round < 6; ++round, len += 20)
      for (kvgc_seq s : {a, twin}) feed(s, len, 20, round);
    const uint64_t headers_before = H.stats().cls_header.pages_used;
    CHECK(headers_before == 0);
    kvgc_seq b, c;
    REQUIRE(kvgc_seq_fork(H.h, a, 0, &b, nullptr) == KVGC_OK);
    REQUIRE(kvgc_seq_fork(H.h, a, 0, &c, nullptr) == KVGC_OK);
    // While the forks live (and step), nothing is taken back.
    for (int round = 6; round < 10; ++round, len += 3)
      for (kvgc_seq s : {a, twin, b, c}) feed(s, len, 3, round);
    const kvgc_stats forked = H.stats();
    for (uint32_t layer = 0; layer < 2; ++layer) CHECK(sorted(H.positions(a, layer)) == sorted(H.positions(twin, layer)));
    CHECK(forked.shared_pages > 0);
    REQUIRE(forked.cls_header.pages_used > 0);
    H.check();
    REQUIRE(kvgc_seq_destroy(H.h, b) == KVGC_OK);
    REQUIRE(kvgc_seq_destroy(H.h, c) == KVGC_OK);
    H.check();
    for (int round = 10; round < 14; ++round, len += 3)
      for (kvgc_seq s : {a, twin}) feed(s, len, 3, round);
    H.check();
    const kvgc_stats after = H.stats();
    CHECK(after.pages_unshared > forked.pages_unshared);  // (a page every other holder let go of is taken back earlier)
    CHECK(after.cls_header.pages_used < forked.cls_header.pages_used / 2);
    for (uint32_t layer = 0; layer < 2; ++layer) CHECK(sorted(H.positions(a, layer)) == sorted(H.positions(twin, layer)));
    if (cfg.charge != KVGC_PREFIX_CHARGE_SHRINK) {
      // Every page is the source's own again: no header page, no shared page, and the
      // source reads and holds what its twin does.
      CHECK(after.cls_header.pages_used == 0);
      CHECK(after.shared_pages == 0);
      for (uint32_t layer = 0; layer < 2; ++layer) CHECK(H.image(a, layer) == H.image(twin, layer));
      REQUIRE(kvgc_seq_destroy(H.h, twin) == KVGC_OK);
      const kvgc_stats alone = H.stats();  // a's pages: the twin's were as many, class by class
      for (int k = 0; k < 2; ++k) CHECK(2 * alone.cls[k].pages_used == after.cls[k].pages_used);
      CHECK(2 * alone.cls_int8.pages_used == after.cls_int8.pages_used);
    }
    REQUIRE(kvgc_seq_destroy(H.h, a) == KVGC_OK);
    const kvgc_stats end = H.stats();
    CHECK(end.shared_pages == 0);
    CHECK(end.cls_header.pages_used == 0);
    H.check();
  }
}

TEST_CASE("fork: no room, a quota, bad arguments: a clear error and nothing changed") {
  kvgc_heap_options o = gc_options(KVGC_POLICY_FULL, 0, 4, 8, 16);
  o.budget_bytes = 256 << 10;
  Heap H(o, model(1, 4, 64));
  kvgc_seq a;
  REQUIRE(kvgc_seq_create(H.h, 0, &a) == KVGC_OK);
  // Fill the arena: not even the copy's header pages fit.
  int64_t len = 0;
  for (;;) {
    const auto k = gaussian(H.m, a, 0, len, 16, false), v = gaussian(H.m, a, 0, len, 16, true);
    if (kvgc_append(H.h, a, 0, k.data(), v.data(), 16, nullptr) != KVGC_OK) break;
    len += 16;
  }
  const kvgc_stats before = H.stats();
  kvgc_seq b = 77;
  CHECK(kvgc_seq_fork(H.h, a, 0, &b, nullptr) == KVGC_ENOMEM);
  CHECK(std::string(kvgc_errmsg(H.h)).find("kvgc_seq_fork") != std::string::npos);
  CHECK(b == 77);  // not written
  kvgc_stats after = H.stats();
  after.enomem = before.enomem;
  CHECK(std::memcmp(&before, &after, sizeof before) == 0);
  H.check();
  // A quota: the same, with KVGC_EBUDGET.
  Heap Q(gc_options(KVGC_POLICY_FULL, 0), model(1, 2, 32));
  kvgc_seq q;
  REQUIRE(kvgc_seq_create(Q.h, 5, &q) == KVGC_OK);
  Q.append(q, 0, 0, 40);
  uint64_t used = 0;
  REQUIRE(kvgc_tenant_usage(Q.h, 5, &used, nullptr) == KVGC_OK);
  const uint64_t header = Q.stats().cls_header.page_bytes, pages = Q.stats().cls[0].pages_used;
  REQUIRE(pages > 1);
  // The fork needs a header page per page for each of the two holders.
  REQUIRE(kvgc_tenant_set_limit(Q.h, 5, used + header) == KVGC_OK);
  const kvgc_stats qb = Q.stats();
  CHECK(kvgc_seq_fork(Q.h, q, 5, &b, nullptr) == KVGC_EBUDGET);
  CHECK(std::string(kvgc_errmsg(Q.h)).find("quota") != std::string::npos);
  const kvgc_stats qa = Q.stats();
  CHECK(std::memcmp(&qb, &qa, sizeof qb) == 0);
  // Into another tenant: tenant 5 pays the header pages of the pages it shares, 6 its own.
  REQUIRE(kvgc_tenant_set_limit(Q.h, 5, used + pages * header) == KVGC_OK);
  kvgc_seq other = 0;
  CHECK(kvgc_seq_fork(Q.h, q, 6, &other, nullptr) == KVGC_OK);
  uint64_t used6 = 0;
  REQUIRE(kvgc_tenant_usage(Q.h, 6, &used6, nullptr) == KVGC_OK);
  CHECK(used6 == pages * header);  // its headers; the shared pages stay charged to tenant 5
  uint64_t used5 = 0;
  REQUIRE(kvgc_tenant_usage(Q.h, 5, &used5, nullptr) == KVGC_OK);
  CHECK(used5 == used + pages * header);
  // Bad arguments.
  CHECK(kvgc_seq_fork(Q.h, 12345, 0, &b, nullptr) == KVGC_ENOTFOUND);
  CHECK(kvgc_seq_fork(Q.h, q, 0, nullptr, nullptr) == KVGC_EINVAL);
  CHECK(std::string(kvgc_errmsg(Q.h)).find("seq_out") != std::string::npos);
  CHECK(kvgc_seq_fork(nullptr, q, 0, &b, nullptr) == KVGC_EINVAL);
  Q.check();
}

TEST_CASE("fork through the C++ header") {
  kvgc::Heap heap(model(1, 2, 32), gc_options(KVGC_POLICY_H2O, 30));
  kvgc::Sequence s(heap, 0);
  const kvgc_model_desc m = model(1, 2, 32);
  const auto k = gaussian(m, s.id(), 0, 0, 50, false), v = gaussian(m, s.id(), 0, 0, 50, true);
  s.append(0, k.data(), v.data(), 50);
  kvgc::Sequence t = s.fork(0);
  CHECK(t.id() != s.id());
  CHECK(t.live(0) == 50);
  CHECK(t.length(0) == 50);
  CHECK(verify_gaussian(heap.get(), m, s.id(), 0, 0.0).empty());
}
