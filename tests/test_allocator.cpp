// The page allocator on fake addresses: no memory is touched, as RMM tests its arena.
#include <doctest/doctest.h>

#include <algorithm>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "../allocator/page_table.hpp"

using namespace kvgc;

namespace {

constexpr uintptr_t kFakeBase = uintptr_t(1) << 40;

PoolConfig config(uint32_t slabs, size_t slab = 64 << 10, size_t fp16 = 4096, size_t int4 = 1280,
                  size_t int8 = 2304, size_t int2 = 768) {
  PoolConfig c;
  c.base = kFakeBase;
  c.slab_bytes = slab;
  c.arena_bytes = slabs * slab;
  c.page_bytes[0] = fp16;
  c.page_bytes[1] = int4;
  c.page_bytes[2] = int8;
  c.page_bytes[3] = int2;
  return c;
}

void require_ok(const PagePool& p) {
  std::string err;
  const bool ok = p.check(&err);
  INFO(err);
  REQUIRE(ok);
}

}  // namespace

TEST_CASE("geometry is validated") {
  PagePool p;
  std::string err;
  PoolConfig c = config(4);
  c.page_bytes[0] = c.slab_bytes + 256;
  CHECK_FALSE(p.init(c, &err));
  CHECK(err.find("does not fit a slab") != std::string::npos);
  PagePool q;
  c = config(4);
  c.arena_bytes = c.slab_bytes - 1;
  CHECK_FALSE(q.init(c, &err));
  CHECK(err.find("smaller than one slab") != std::string::npos);
  PagePool r;
  c = config(4);
  c.slab_bytes = 1000;
  CHECK_FALSE(r.init(c, &err));
}

TEST_CASE("an empty pool is consistent and allocates nothing it does not have") {
  PagePool p;
  std::string err;
  REQUIRE(p.init(config(2), &err));
  require_ok(p);
  CHECK(p.arena().free_slabs() == 2);
  CHECK(p.can_alloc(0, 32));   // 2 slabs x 16 fp16 pages
  CHECK_FALSE(p.can_alloc(0, 33));
  CHECK(p.can_alloc(1, 102));  // 2 x 51 int4 pages
  CHECK_FALSE(p.can_alloc(1, 103));
  CHECK(p.page_at(kFakeBase) == kNoPage);
  CHECK_FALSE(p.allocated(0));
}

TEST_CASE("one page: address arithmetic round-trips and the slab returns when freed") {
  PagePool p;
  std::string err;
  REQUIRE(p.init(config(3), &err));
  const PageId id = p.alloc(0, 7);
  REQUIRE(id != kNoPage);
  CHECK(p.allocated(id));
  CHECK(p.desc(id).owner == 7);
  CHECK(p.class_of(id) == 0);
  CHECK(p.address(id) == kFakeBase);  // the first slab, first page
  CHECK(p.page_at(p.address(id)) == id);
  CHECK(p.page_at(p.address(id) + 1) == kNoPage);  // not a page start
  CHECK(p.counts(0).slabs == 1);
  CHECK(p.counts(0).pages_used == 1);
  CHECK(p.counts(0).pages_free == 15);
  require_ok(p);
  p.free(id);
  CHECK_FALSE(p.allocated(id));
  CHECK(p.arena().free_slabs() == 3);
  CHECK(p.counts(0).slabs == 0);
  CHECK(p.slabs_released() == 1);
  require_ok(p);
}

TEST_CASE("full arena: allocation fails cleanly, and every page freed returns every slab") {
  PagePool p;
  std::string err;
  REQUIRE(p.init(config(4), &err));
  std::vector<PageId> ids;
  std::set<uintptr_t> addrs;
  for (;;) {
    const PageId id = p.alloc(0, 1);
    if (id == kNoPage) break;
    ids.push_back(id);
    addrs.insert(p.address(id));
  }
  CHECK(ids.size() == 64);
  CHECK(addrs.size() == 64);  // distinct pages
  for (uintptr_t a : addrs) {  // inside the arena, page aligned within their slab
    CHECK(a >= kFakeBase);
    CHECK(a + 4096 <= kFakeBase + 4 * (64 << 10));
    CHECK((a - kFakeBase) % 4096 == 0);
  }
  CHECK_FALSE(p.can_alloc(0, 1));
  CHECK_FALSE(p.can_alloc(1, 1));
  CHECK(p.alloc(1, 1) == kNoPage);  // no free slab for another class either
  require_ok(p);
  std::mt19937 rng(1);
  std::shuffle(ids.begin(), ids.end(), rng);
  for (PageId id : ids) p.free(id);
  CHECK(p.arena().free_slabs() == 4);
  CHECK(p.counts(0).pages_used == 0);
  require_ok(p);
}

TEST_CASE("memory flows between classes through returned slabs") {
  PagePool p;
  std::string err;
  REQUIRE(p.init(config(2), &err));
  std::vector<PageId> fp16;
  while (p.can_alloc(0, 1)) fp16.push_back(p.alloc(0, 1));
  CHECK(p.alloc(1, 2) == kNoPage);
  // Free one whole slab's worth: exactly the pages of slab 0.
  std::vector<PageId> keep;
  for (PageId id : fp16) {
    if (p.address(id) < kFakeBase + (64 << 10)) p.free(id);
    else keep.push_back(id);
  }
  CHECK(p.arena().free_slabs() == 1);
  const PageId q = p.alloc(1, 2);
  REQUIRE(q != kNoPage);
  CHECK(p.class_of(q) == 1);
  CHECK(p.address(q) == kFakeBase);  // the returned slab, now int4
  CHECK(p.page_at(kFakeBase + 1280) == kNoPage);  // int4 page 1 not allocated yet
  require_ok(p);
  for (PageId id : keep) p.free(id);
  p.free(q);
  require_ok(p);
}

TEST_CASE("a partial slab serves before a new one is carved") {
  PagePool p;
  std::string err;
  REQUIRE(p.init(config(4), &err));
  std::vector<PageId> a;
  for (int i = 0; i < 16; ++i) a.push_back(p.alloc(0, 1));  // fills slab 0
  const PageId b = p.alloc(0, 1);                         // slab 1
  CHECK(p.counts(0).slabs == 2);
  p.free(a[5]);  // slab 0 becomes partial again
  const PageId c = p.alloc(0, 1);
  CHECK(c == a[5]);  // LIFO reuse of the freed page, no third slab
  CHECK(p.counts(0).slabs == 2);
  require_ok(p);
  (void)b;
}

TEST_CASE("randomised alloc/free against a model keeps every invariant") {
  PagePool p;
  std::string err;
  REQUIRE(p.init(config(8), &err));
  std::mt19937_64 rng(42);
  std::vector<PageId> live[2];
  std::set<uintptr_t> addrs;
  for (int step = 0; step < 20000; ++step) {
    const int cls = int(rng() % 2);
    if (rng() % 100 < 55) {
      const bool fits = p.can_alloc(cls, 1);
      const PageId id = p.alloc(cls, SegmentId(step));
      CHECK((id != kNoPage) == fits);
      if (id != kNoPage) {
        live[cls].push_back(id);
        CHECK(addrs.insert(p.address(id)).second);  // never handed out twice
      }
    } else if (!live[cls].empty()) {
      const size_t i = rng() % live[cls].size();
      addrs.erase(p.address(live[cls][i]));
      p.free(live[cls][i]);
      live[cls][i] = live[cls].back();
      live[cls].pop_back();
    }
    if (step % 997 == 0) require_ok(p);
  }
  require_ok(p);
  CHECK(p.counts(0).pages_used == live[0].size());
  CHECK(p.counts(1).pages_used == live[1].size());
  size_t visited = 0;
  p.for_each_allocated([&](PageId, const PageDesc&) { ++visited; });
  CHECK(visited == live[0].size() + live[1].size());
}

TEST_CASE("check() catches a corrupted free list and counters") {
  PagePool p;
  std::string err;
  REQUIRE(p.init(config(2), &err));
  const PageId a = p.alloc(0, 3);
  p.alloc(0, 3);
  require_ok(p);
  p.desc(a).owner = kNoSegment;  // a page that is neither owned nor on a free list
  CHECK_FALSE(p.check(&err));
  CHECK(err.find("allocator:") == 0);
}

TEST_CASE("page tables: tail room, pages needed and fragmentation") {
  PagePool p;
  std::string err;
  REQUIRE(p.init(config(2), &err));
  PageTable t;
  CHECK(t.pages_needed(p, 16, 0) == 0);
  CHECK(t.pages_needed(p, 16, 1) == 1);
  CHECK(t.pages_needed(p, 16, 33) == 3);
  CHECK(t.fragmentation(16) == 0.0);
  t.pages.push_back(p.alloc(0, 0));
  p.desc(t.pages[0]).used = 10;
  p.desc(t.pages[0]).live = 6;
  t.used = 10;
  t.live = 6;
  CHECK(t.tail_room(p, 16) == 6);
  CHECK(t.pages_needed(p, 16, 6) == 0);
  CHECK(t.pages_needed(p, 16, 7) == 1);
  CHECK(t.fragmentation(16) == doctest::Approx(4.0 / 16.0));
}

TEST_CASE("drain: a slab being evacuated takes no page, its free pages stop counting, its last page returns it") {
  // Three fp16 slabs of 16 pages: slab 0 a quarter used, slab 1 full, slab 2 half used.
  PagePool p;
  std::string err;
  REQUIRE(p.init(config(4), &err));
  const uint32_t per = p.pages_per_slab(0);
  REQUIRE(per == 16);
  std::vector<PageId> pages;
  for (uint32_t i = 0; i < 3 * per; ++i) pages.push_back(p.alloc(0, i));
  for (uint32_t i = 0; i < 3 * per; ++i) {
    const uint32_t slab = p.slab_of_page(pages[i]), index = i % per;
    REQUIRE(slab == i / per);
    if ((slab == 0 && index >= 4) || (slab == 2 && index >= 8)) p.free(pages[i]);
  }
  require_ok(p);
  REQUIRE(p.counts(0).pages_free == 12 + 8);
  // The sparsest slab whose pages fit elsewhere: slab 0 (4 pages; 8 free in slab 2).
  CHECK(p.sparsest_evacuable(0, [](uint32_t) { return true; }) == 0);
  CHECK(p.sparsest_evacuable(0, [](uint32_t s) { return s != 0; }) == 2);  // 8 fit in 12
  CHECK(p.sparsest_evacuable(1, [](uint32_t) { return true; }) == UINT32_MAX);  // no int4 slab
  p.drain(0);
  CHECK(p.counts(0).pages_free == 8);  // slab 0's free pages no longer count
  CHECK_FALSE(p.can_alloc(0, 8 + p.arena().free_slabs() * per + 1));
  std::string why;
  CHECK_FALSE(p.check(&why));  // a drained slab must not outlive the call that drains it
  CHECK(why.find("draining") != std::string::npos);
  // Its pages move into slab 2 (alloc never picks the drained slab), then go.
  for (uint32_t i = 0; i < 4; ++i) {
    const PageId to = p.alloc(0, 100 + i);
    CHECK(p.slab_of_page(to) == 2);
    p.free(pages[i]);
  }
  require_ok(p);  // slab 0 went back to the arena with its last page
  CHECK(p.arena().slab(0).cls == Slab::kFree);
  CHECK(p.counts(0).slabs == 2);
  CHECK(p.counts(0).pages_free == 4);
  // undrain puts back a slab that did not empty, its free pages counted again.
  p.free(pages[per]);  // slab 1: 15 used
  p.drain(1);
  CHECK(p.counts(0).pages_free == 4);
  p.undrain(1);
  CHECK(p.counts(0).pages_free == 5);
  require_ok(p);
  CHECK(p.slab_of_page(p.alloc(0, 7)) != 0);
  require_ok(p);
}
