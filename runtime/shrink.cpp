// Shrinking shared pages (KVGC_PREFIX_CHARGE=shrink, 0.13).
//
// Under prune every holder of a shared page decides over its slots as an unshared
// sequence does, but a slot its ladder demotes stays in the shared FP16 page and is only
// charged at its rung: the page stays whole at FP16 while anything holds it. Measured on
// kvgc-bench-serve --shared-prefix (docs/PERF.md, "Ninth run"), once every holder had
// ranked the prefix, about 2% of its pages had a holder counting a slot at FP16; the rest
// every holder counted at int8 or int4 or had evicted, and the prefix was 23.5 MiB of an
// 80 MiB arena.
//
// So a shared page is re-stored once at the shrink class (the ladder's first rung below
// FP16) when every holder counts each of its live slots at that class or below, and some
// holder has said so (a page whose every holder evicted its slots, which only cached
// prefixes keep, qualifies once judged). Nothing reads it above its holders' charges
// then, except a later attach, which reads it at its new class from the start.
//
// How the host knows: the GC's select reports per page the classes its live slots count
// at (SelectOp::page_classes), and settle records, per header page, whether none is
// dearer than the shrink class (Backing::cheap; a slot's class never rises, so a cheap
// header stays cheap) and per shared page how many of its headers are (SharedPage::cheap).
//
// When: at the start of a batch plan and of kvgc_step, the points where nothing in
// flight names a page (no live plan, no queued GC; pending GCs are settled first), and
// only when some page became shrinkable since the last pass. The pass re-stores pages
// with one requant op per source class (K/V through the model dtype, as a demotion
// stores a token), then points everything naming a page at its copy: shared_, its
// holders' backing_ entries, the cached prefixes. Each holder's header moves from its
// old class's table to the front of the new class's (a full page: every page but the
// tail stays full), with its counts; its slots keep their charges (a slot charged at
// the page's new class counts as the page's) so the charged bytes do not change:
// table[c].live + shift[c] per class is what it was.
#include <algorithm>

#include "heap.hpp"

namespace kvgc {

void ManagedHeap::mark_cheap(PageId header) {
  Backing& b = backing_.find(header)->second;
  if (b.cheap) return;
  b.cheap = true;
  SharedPage& sp = shared_.find(b.page)->second;
  ++sp.cheap;
  sp.judged = true;
  if (shrinkable(b.page, sp)) ++shrink_ready_;
}

void ManagedHeap::note_classes(PageId header, int page_cls, uint8_t classes) {
  Backing& b = backing_.find(header)->second;
  const bool was = b.charged;
  b.charged = (classes & ~(1u << page_cls)) != 0;
  if (was && !b.charged) {  // the charged slots went: a last holder may take it back now
    const SharedPage& sp = shared_.find(b.page)->second;
    if (sp.sole_holder()) ++sole_ready_;
  }
  if (shrink_class_ < 0) return;
  for (int c = 0; c < KVGC_CLASS_COUNT; ++c)
    if (classes >> c & 1 && class_rank(uint32_t(c)) < class_rank(uint32_t(shrink_class_))) return;
  mark_cheap(header);  // no live slot counts above the shrink class (or none is live)
}

bool ManagedHeap::shrinkable(PageId shared, const SharedPage& sp) const {
  return sp.judged && sp.cheap == sp.holders() && pool_.desc(shared).used == opts_.page_tokens &&
         class_rank(uint32_t(pool_.class_of(shared))) < class_rank(uint32_t(shrink_class_));
}

Status ManagedHeap::shrink_shared(void* stream) {
  if (shrink_class_ < 0 || shrink_ready_ == 0 || planned_ || !gc_ops_.empty()) return Status::Ok();
  KVGC_TRY(settle_all());  // holders' GCs in flight name the pages; their results may add votes
  shrink_ready_ = 0;
  const int to = shrink_class_;
  // Everything that may allocate first: a failure here changes nothing.
  struct Move {
    PageId from, to;
  };
  constexpr PageId kWaits = kNoPage - 1;  // a `to` for a page a holder's lent order holds back
  host::vector<Move> moves;
  for (const auto& [p, sp] : shared_)
    if (shrinkable(p, sp)) moves.push_back({p, kNoPage});
  if (moves.empty()) return Status::Ok();
  // By source class (an op per class below), then page id: find_move's binary search.
  auto before = [&](PageId a, PageId b) {
    const int ca = pool_.class_of(a), cb = pool_.class_of(b);
    return ca != cb ? ca < cb : a < b;
  };
  std::sort(moves.begin(), moves.end(), [&](const Move& a, const Move& b) { return before(a.from, b.from); });
  auto find_move = [&](PageId p) -> Move* {
    auto it = std::lower_bound(moves.begin(), moves.end(), p,
                               [&](const Move& m, PageId q) { return before(m.from, q); });
    return it != moves.end() && it->from == p ? &*it : nullptr;
  };
  // The holders' headers, by segment, so that each table grows once.
  struct Holder {
    SegmentId seg;
    PageId header;
    Move* move;
  };
  host::vector<Holder> holders;
  // A holder with a read order lent out (kvgc_read, then an observe to come) must find
  // its rows where it read them: moving its header to another class's table would put
  // the observe's mass on other tokens (the stress test's wrong scores, issue 43). Its
  // pages wait for a pass after its next append, observe or step (shrink_ready_ keeps
  // them due).
  size_t waiting = 0;
  for (const auto& [h, b] : backing_)
    if (Move* m = find_move(b.page); m && m->to == kNoPage && segment_of(pool_.desc(h).owner).order_lent) {
      m->to = kWaits;
      ++waiting;
    }
  if (waiting) {
    shrink_ready_ = waiting;
    std::erase_if(moves, [](const Move& m) { return m.to == kWaits; });
    if (moves.empty()) return Status::Ok();
  }
  for (const auto& [h, b] : backing_)
    if (Move* m = find_move(b.page)) holders.push_back({pool_.desc(h).owner, h, m});
  std::sort(holders.begin(), holders.end(),
            [](const Holder& a, const Holder& b) { return a.seg != b.seg ? a.seg < b.seg : a.header < b.header; });
  for (size_t i = 0; i < holders.size();) {
    size_t j = i;
    while (j < holders.size() && holders[j].seg == holders[i].seg) ++j;
    PageTable& t = segment_of(holders[i].seg).table[to];
    t.pages.reserve(t.pages.size() + (j - i));
    i = j;
  }
  host::vector<RequantPage> ops;
  ops.reserve(moves.size());

  // The new pages, as many as the arena gives (a class's free pages, or a free slab).
  size_t taken = 0;
  for (; taken < moves.size(); ++taken) {
    const PageId q = pool_.alloc(to, kSharedOwner);
    if (q == kNoPage) break;
    moves[taken].to = q;
  }
  auto give_back = [&] {
    for (size_t i = 0; i < taken; ++i) pool_.free(moves[i].to);
  };
  // One op per source class (FP16; INT8 too when the shrink class is INT4).
  for (size_t i = 0; i < taken;) {
    const int from_cls = pool_.class_of(moves[i].from);
    ops.clear();
    size_t j = i;
    for (; j < taken && pool_.class_of(moves[j].from) == from_cls; ++j)
      ops.push_back({page_ptr(moves[j].from), page_ptr(moves[j].to), uint32_t(pool_.desc(moves[j].from).used)});
    RequantOp op;
    op.src_layout = layout_[from_cls];
    op.dst_layout = layout_[to];
    op.pages = ops.data();
    op.n_pages = uint32_t(ops.size());
    Status st;
    try {
      st = backend_->requant(op, stream);  // the CPU's allocates a row: may throw
    } catch (...) {
      give_back();
      throw;
    }
    if (!st.ok()) {
      give_back();
      return st;
    }
    i = j;
  }

  // The rewrite: nothing below allocates (node handles move within shared_).
  for (const Holder& x : holders) {
    if (x.move->to == kNoPage) continue;  // the arena had no page for it
    const int from_cls = pool_.class_of(x.move->from);
    Segment& seg = segment_of(x.seg);
    PageTable& ft = seg.table[from_cls];
    PageTable& tt = seg.table[to];
    const PageDesc d = pool_.desc(x.header);
    auto at = std::find(ft.pages.begin(), ft.pages.end(), x.header);
    KVGC_ASSERT(at != ft.pages.end());
    ft.pages.erase(at);
    tt.pages.insert(tt.pages.begin(), x.header);  // capacity reserved above
    ft.live -= d.live;
    ft.used -= d.used;
    tt.live += d.live;
    tt.used += d.used;
    // Every live slot is charged at `to` or below: it moves from counting against the old
    // class's table to the new one's, and what it is charged at stays.
    seg.shift[from_cls] += d.live;
    seg.shift[to] -= d.live;
    backing_.find(x.header)->second.page = x.move->to;
    touch(seg);
  }
  for (auto& [id, e] : prefixes_)
    for (PageId& p : e.pages)
      if (const Move* m = find_move(p); m && m->to != kNoPage) p = m->to;
  for (size_t i = 0; i < taken; ++i) {
    const Move& m = moves[i];
    auto node = shared_.extract(m.from);
    const uint64_t freed = pool_.page_bytes(pool_.class_of(m.from)) - pool_.page_bytes(to);
    if (auto t = tenants_.find(node.mapped().tenant); t != tenants_.end()) t->second.bytes -= freed;
    node.key() = m.to;
    shared_.insert(std::move(node));
    pool_.desc(m.to).used = pool_.desc(m.from).used;
    pool_.desc(m.to).live = pool_.desc(m.from).live;
    pool_.free(m.from);
    ++counters_.pages_freed;
    ++counters_.pages_allocated;
    ++counters_.pages_shrunk;
    counters_.bytes_shrunk += freed;
  }
  return Status::Ok();
}

}  // namespace kvgc
