// The prefix cache: kvgc_prefix_keep / attach / pin / drop (kvgc.h).
//
// A cached prefix holds the shared pages (shared.cpp) of a finished prefill, all layers,
// and is found by a chain of hashes of its token ids, one per page: page i's hash covers
// page i's ids and page i-1's hash, seeded by who may see it (a salt, else the tenant).
// An attach walks the request's pages through prefix_index_ and stops at the first page
// no visible cached prefix has; a match is checked against the ids themselves, so a hash
// collision can cost a miss, never a wrong page. A partly filled last page is indexed too
// (its hash also covers its length) and matches only when all its tokens do.
//
// Lookups are host arithmetic over ids and hashes: a miss reads no page. Every attach
// composes its headers afresh (what kvgc_append writes: positions, sinks, no score), so
// an attached sequence is the sequence that appended those tokens itself, K/V included.
#include <algorithm>
#include <cstring>

#include "heap.hpp"

namespace kvgc {
namespace {

uint64_t mix(uint64_t x) {  // splitmix64's finaliser
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

uint64_t chain_seed(uint32_t tenant, uint64_t salt) {
  return salt ? mix(mix(0x73616c74ull) ^ salt) : mix(mix(0x74656e61ull) ^ tenant);
}

// Page hash: the previous page's, then this page's ids and their count.
uint64_t page_hash(uint64_t prev, const int32_t* ids, uint32_t n) {
  uint64_t h = mix(prev ^ (uint64_t(n) << 32));
  for (uint32_t i = 0; i < n; ++i) h = mix(h ^ uint32_t(ids[i]));
  return h;
}

bool visible(const PrefixEntry& e, uint32_t tenant, uint64_t salt) {
  return salt ? e.salt == salt : e.salt == 0 && e.tenant == tenant;
}

}  // namespace

// Only a prefix holding a page that no sequence holds is evicted: one whose every page
// some sequence still reads would free nothing, and losing it would make the next request
// prefill those tokens again (into a copy of its own) instead of attaching them. Twin
// prefixes over the same unheld pages both qualify, so their pages still go back.
bool ManagedHeap::evict_one_prefix() {
  auto frees_a_page = [&](const PrefixEntry& e) {
    return std::any_of(e.pages.begin(), e.pages.end(),
                       [&](PageId p) { return shared_.find(p)->second.cached_only(); });
  };
  PrefixEntry* lru = nullptr;
  for (auto& [id, e] : prefixes_)
    if (!e.pinned && !e.busy && (!lru || e.last_use < lru->last_use) && frees_a_page(e)) lru = &e;
  if (!lru) return false;
  drop_prefix(*lru);
  prefixes_.erase(lru->id);
  ++counters_.prefix_evictions;
  return true;
}

void ManagedHeap::unindex_prefix(const PrefixEntry& e) {
  for (uint64_t h : e.hashes)
    for (auto [a, b] = prefix_index_.equal_range(h); a != b; ++a)
      if (a->second == e.id) {
        prefix_index_.erase(a);
        break;
      }
}

void ManagedHeap::drop_prefix(PrefixEntry& e) {
  unindex_prefix(e);
  for (PageId p : e.pages) {
    --shared_.find(p)->second.prefix_refs;
    unref_shared(p);
  }
  e.pages.clear();
  e.hashes.clear();
}

Status ManagedHeap::prefix_keep(kvgc_seq seq, const int32_t* ids, uint64_t n, uint64_t salt,
                                bool pin, kvgc_prefix* out, void* stream) {
  SequenceState* s;
  KVGC_TRY(find(seq, 0, "kvgc_prefix_keep", &s));
  if (n == 0) return fail(KVGC_EINVAL, "kvgc_prefix_keep: n_tokens is 0");
  const uint32_t pt = opts_.page_tokens, L = model_.n_layers;
  for (uint32_t l = 0; l < L; ++l) {
    Segment& seg = s->layers[l];
    KVGC_TRY(settle(s->tenant, seg));
    // All of it, or its first whole pages (those others can match: a shared prefix of
    // prompts), never part of a page the sequence goes on filling.
    if (seg.length != n && (n > seg.length || n % pt))
      return fail(KVGC_EINVAL, "kvgc_prefix_keep: n_tokens " + std::to_string(n) + " is neither seq " +
                                   std::to_string(seq) + "'s length " + std::to_string(seg.length) +
                                   " at layer " + std::to_string(l) + " nor a multiple of page_tokens (" +
                                   std::to_string(pt) + ") below it (keep a prompt, or its first "
                                   "whole pages, right after appending it)");
    // Untouched by the GC: every token live, in append order, none ranked; fp16 but for
    // the shrunk pages an attach took (shrink.cpp), which are in their classes' tables.
    bool untouched = seg.live() == seg.length && !seg.tier[kGenIntermediate] && !seg.tier[kGenLongTerm];
    for (int c = 0; c < KVGC_CLASS_COUNT; ++c)
      if (c != KVGC_CLASS_FP16) {
        uint64_t attached = 0;
        for (uint32_t j = 0; j < s->attached_pages; ++j) attached += s->attached_cls[size_t(l) * s->attached_pages + j] == c;
        untouched &= seg.table[c].pages.size() == attached;
      }
    if (!untouched)
      return fail(KVGC_EINVAL, "kvgc_prefix_keep: a kvgc_step already ranked seq " + std::to_string(seq) +
                                   "'s tokens at layer " + std::to_string(l) +
                                   " (keep a prompt right after appending it, before its first step)");
  }
  const uint32_t n_pages = uint32_t((n + pt - 1) / pt);
  // Page i of layer l's prompt: its class and its index in that class's table. Pages an
  // attach took come first, each in its class's table; the sequence's own follow in its
  // FP16 table.
  host::vector<std::pair<uint8_t, uint32_t>> where(size_t(L) * n_pages);
  for (uint32_t l = 0; l < L; ++l) {
    uint32_t next[KVGC_CLASS_COUNT] = {};
    for (uint32_t i = 0; i < n_pages; ++i) {
      const uint8_t c = i < s->attached_pages ? s->attached_cls[size_t(l) * s->attached_pages + i]
                                              : uint8_t(KVGC_CLASS_FP16);
      where[size_t(l) * n_pages + i] = {c, next[c]++};
    }
  }
  auto page_at = [&](uint32_t l, uint32_t i) -> PageId& {
    const auto [c, k] = where[size_t(l) * n_pages + i];
    return s->layers[l].table[c].pages[k];
  };
  host::vector<uint64_t> hashes(n_pages);
  uint64_t prev = chain_seed(s->tenant, salt);
  for (uint32_t i = 0; i < n_pages; ++i)
    prev = hashes[i] = page_hash(prev, ids + uint64_t(i) * pt, uint32_t(std::min<uint64_t>(pt, n - uint64_t(i) * pt)));
  // Per page, a visible cached prefix holding the same ids at the same place (prompts
  // prefilled side by side each computed their own copy): the page it keeps serves, and
  // the sequence's copy goes back to the pool (vLLM's block-hash deduplication).
  host::vector<const PrefixEntry*> twin(n_pages, nullptr);
  for (uint32_t i = 0; i < n_pages; ++i) {
    const uint64_t first = uint64_t(i) * pt, count = std::min<uint64_t>(pt, n - first);
    for (auto [a, b] = prefix_index_.equal_range(hashes[i]); a != b && !twin[i]; ++a) {
      const PrefixEntry& e = prefixes_.find(a->second)->second;
      if (visible(e, s->tenant, salt) && i < e.n_pages && e.hashes[i] == hashes[i] &&
          std::min<uint64_t>(pt, e.ids.size() - first) == count &&
          std::equal(ids + first, ids + first + count, e.ids.begin() + first))
        twin[i] = &e;
    }
  }
  uint64_t need = 0, twins = 0;  // header pages: one per kept page still held privately
  // A twin's page serves where it is still FP16 (a shrunk one holds other bytes).
  auto twin_page = [&](uint32_t l, uint32_t i) {
    const PageId p = twin[i] ? twin[i]->pages[size_t(l) * twin[i]->n_pages + i] : kNoPage;
    return p != kNoPage && pool_.class_of(p) == KVGC_CLASS_FP16 ? p : kNoPage;
  };
  for (uint32_t l = 0; l < L; ++l)
    for (uint32_t i = 0; i < n_pages; ++i) {
      const bool own = !is_header(page_at(l, i));
      need += own;
      twins += own && twin_page(l, i) != kNoPage;
    }
  auto rebind_twins = [&]() -> Status {
    for (uint32_t l = 0; l < L; ++l)
      for (uint32_t i = 0; i < n_pages; ++i)
        if (const PageId p = twin_page(l, i); p != kNoPage && !is_header(page_at(l, i)))
          KVGC_TRY(rebind_to_shared(*s, l, where[size_t(l) * n_pages + i].second, p, stream));
    return Status::Ok();
  };
  // The same ids, seen by the same sequences: that prefix serves, and the sequence reads
  // its pages (when the header pages fit: else it keeps its copy, as before 0.10.2).
  for (auto [a, b] = prefix_index_.equal_range(hashes.back()); a != b; ++a) {
    PrefixEntry& e = prefixes_.find(a->second)->second;
    if (e.salt == salt && (salt || e.tenant == s->tenant) && e.ids.size() == n &&
        std::equal(e.ids.begin(), e.ids.end(), ids)) {
      if (twins && pool_.can_alloc(kHeaderClass, twins) &&
          tenant_room(s->tenant) >= twins * pool_.page_bytes(kHeaderClass))
        KVGC_TRY(rebind_twins());
      e.last_use = ++lru_clock_;
      e.pinned |= pin;
      if (out) *out = e.id;
      return Status::Ok();
    }
  }
  auto room = [&] { return pool_.can_alloc(kHeaderClass, need); };
  if (!room()) {
    KVGC_TRY(settle_all());
    KVGC_TRY(evacuate(kHeaderClass, need, kNoSegment, stream));  // other classes' sparse slabs
    while (!room() && evict_one_prefix())
      std::fill(twin.begin(), twin.end(), nullptr);  // an evicted twin's pages may be gone
    if (!room()) {
      ++counters_.enomem;
      return fail(KVGC_ENOMEM, "kvgc_prefix_keep: sharing seq " + std::to_string(seq) + "'s pages needs " +
                                   std::to_string(need) + " header pages; the arena has no room for them");
    }
  }
  if (tenant_room(s->tenant) < need * pool_.page_bytes(kHeaderClass))
    return fail(KVGC_EBUDGET, "kvgc_prefix_keep: tenant " + std::to_string(s->tenant) +
                                  " would pass its quota (" + std::to_string(need) + " header pages)");
  // Host memory first: a bad_alloc below this changes nothing.
  PrefixEntry e;
  e.id = next_prefix_;
  e.tenant = s->tenant;
  e.salt = salt;
  e.seed = chain_seed(s->tenant, salt);
  e.ids.assign(ids, ids + n);
  e.n_pages = n_pages;
  e.pages.resize(size_t(L) * n_pages);
  e.hashes = std::move(hashes);
  e.pinned = pin;
  e.last_use = ++lru_clock_;
  prefixes_.reserve(prefixes_.size() + 1);
  prefix_index_.reserve(prefix_index_.size() + n_pages);
  KVGC_TRY(rebind_twins());
  for (uint32_t l = 0; l < L; ++l)
    for (uint32_t i = 0; i < n_pages; ++i) {
      // Pages made shared stay so if a later one fails: the same tokens, read the same way.
      const auto [c, k] = where[size_t(l) * n_pages + i];
      KVGC_TRY(share(*s, l, c, k, stream));
      e.pages[size_t(l) * n_pages + i] = backing_.find(page_at(l, i))->second.page;
    }
  const kvgc_prefix id = e.id;
  PrefixEntry& kept = prefixes_.emplace(id, std::move(e)).first->second;  // may throw: nothing counted yet
  try {
    for (uint64_t h : kept.hashes) prefix_index_.emplace(h, id);
  } catch (...) {
    unindex_prefix(kept);
    prefixes_.erase(id);
    throw;
  }
  for (PageId p : kept.pages) {
    SharedPage& sp = shared_.find(p)->second;
    ++sp.refs;
    ++sp.prefix_refs;
  }
  ++next_prefix_;
  if (out) *out = id;
  return Status::Ok();
}

Status ManagedHeap::prefix_attach(kvgc_seq seq, const int32_t* ids, uint64_t n, uint64_t salt,
                                  uint64_t* n_attached, void* stream) {
  SequenceState* s;
  KVGC_TRY(find(seq, 0, "kvgc_prefix_attach", &s));
  for (const Segment& seg : s->layers)
    if (seg.length)
      return fail(KVGC_EINVAL, "kvgc_prefix_attach: seq " + std::to_string(seq) +
                                   " already holds tokens (attach to a new sequence, before its first append)");
  *n_attached = 0;
  ++counters_.prefix_lookups;
  const uint32_t pt = opts_.page_tokens, L = model_.n_layers;
  // The walk: whole pages while some visible prefix has the same page at the same place.
  struct Match {
    PrefixEntry* e;
    uint32_t used;
  };
  host::vector<Match> match;
  uint64_t prev = chain_seed(s->tenant, salt);
  auto find_page = [&](uint32_t i, const int32_t* page_ids, uint32_t count, uint64_t h) -> PrefixEntry* {
    for (auto [a, b] = prefix_index_.equal_range(h); a != b; ++a) {
      PrefixEntry& e = prefixes_.find(a->second)->second;
      if (!visible(e, s->tenant, salt) || i >= e.n_pages || e.hashes[i] != h) continue;
      const uint64_t first = uint64_t(i) * pt;
      if (std::min<uint64_t>(pt, e.ids.size() - first) != count) continue;
      if (std::equal(page_ids, page_ids + count, e.ids.begin() + first)) return &e;
    }
    return nullptr;
  };
  for (uint32_t i = 0; uint64_t(i + 1) * pt <= n; ++i) {
    const int32_t* page_ids = ids + uint64_t(i) * pt;
    const uint64_t h = page_hash(prev, page_ids, pt);
    PrefixEntry* e = find_page(i, page_ids, pt, h);
    if (!e) break;
    match.push_back({e, pt});
    prev = h;
  }
  // A cached prefix's partly filled last page, when all of its tokens match.
  const uint32_t k = uint32_t(match.size());
  const uint64_t rest = n - uint64_t(k) * pt;
  for (uint32_t r = uint32_t(std::min<uint64_t>(rest, pt - 1)); r > 0; --r) {
    const int32_t* page_ids = ids + uint64_t(k) * pt;
    if (PrefixEntry* e = find_page(k, page_ids, r, page_hash(prev, page_ids, r))) {
      match.push_back({e, r});
      break;
    }
  }
  if (match.empty()) return Status::Ok();
  const uint64_t m = match.size(), tokens = uint64_t(k) * pt + (m > k ? match.back().used : 0);
  const uint64_t need = m * L, hb = pool_.page_bytes(kHeaderClass);
  for (Match& x : match) ++x.e->busy;  // not evicted for this attach's own room
  auto unbusy = [&] {
    for (Match& x : match) --x.e->busy;
  };
  auto room = [&] { return pool_.can_alloc(kHeaderClass, need); };
  if (!room()) {
    Status st = settle_all();
    if (st.ok()) st = evacuate(kHeaderClass, need, kNoSegment, stream);  // other classes' sparse slabs
    if (!st.ok()) {
      unbusy();
      return st;
    }
    while (!room() && evict_one_prefix()) {}
    if (!room()) {
      unbusy();
      ++counters_.enomem;
      return fail(KVGC_ENOMEM, "kvgc_prefix_attach: " + std::to_string(tokens) + " cached tokens need " +
                                   std::to_string(need) + " header pages; the arena has no room for them");
    }
  }
  if (tenant_room(s->tenant) < need * hb) {
    unbusy();
    return fail(KVGC_EBUDGET, "kvgc_prefix_attach: tenant " + std::to_string(s->tenant) +
                                  " would pass its quota (" + std::to_string(need) + " header pages of " +
                                  std::to_string(hb) + " bytes)");
  }
  // The headers appending these tokens would have written: one per page, the same for
  // every layer. On a device they travel from pinned staging memory.
  const PageLayout& F = layout_[KVGC_CLASS_FP16];
  const size_t hbytes = header_bytes_;
  host::vector<uint8_t> local;
  uint8_t* tmpl = nullptr;
  Status st;
  if (backend_->kind() == KVGC_DEVICE_CPU) {
    local.resize(m * hbytes);
    tmpl = local.data();
  } else {
    void* staged = nullptr;
    st = staging_.take(*backend_, m * hbytes, &staged);
    tmpl = static_cast<uint8_t*>(staged);
  }
  if (!st.ok()) {
    unbusy();
    return st;
  }
  std::memset(tmpl, 0, m * hbytes);
  for (uint64_t j = 0; j < m; ++j) {
    uint8_t* hdr = tmpl + j * hbytes;
    auto* live = reinterpret_cast<uint32_t*>(hdr + F.live_off);
    auto* pos = reinterpret_cast<int32_t*>(hdr + F.pos_off);
    for (uint32_t slot = 0; slot < match[j].used; ++slot) {
      const int64_t p = int64_t(j) * pt + slot;
      pos[slot] = int32_t(p);
      hdr[F.gen_off + slot] = p < int64_t(opts_.sinks) ? kGenSink : kGenYoung;
      live[slot / 32] |= 1u << (slot % 32);
    }
  }
  // Each header goes to the table of its page's class: a shrunk page (shrink.cpp) is
  // read at its class from the start. The classes are recorded for kvgc_prefix_keep.
  auto page_of = [&](uint32_t l, uint64_t j) {
    const PrefixEntry& e = *match[j].e;
    return e.pages[size_t(l) * e.n_pages + j];
  };
  bool shrunk = false;
  for (uint32_t l = 0; l < L && !shrunk; ++l)
    for (uint64_t j = 0; j < m && !shrunk; ++j) shrunk = pool_.class_of(page_of(l, j)) != KVGC_CLASS_FP16;
  try {
    s->attached_pages = 0;
    s->attached_cls.clear();
    if (shrunk) s->attached_cls.resize(size_t(L) * m);
    for (uint32_t l = 0; l < L && st.ok(); ++l) {
      for (PageTable& t : s->layers[l].table) t.pages.reserve(m);
      for (uint64_t j = 0; j < m && st.ok(); ++j) {
        const PageId shared = page_of(l, j);
        const int cls = pool_.class_of(shared);
        PageId h;
        st = add_header(*s, l, shared, tmpl + j * hbytes, CopyKind::HostToDevice, stream, &h);
        if (!st.ok()) break;
        pool_.desc(h).used = pool_.desc(h).live = uint16_t(match[j].used);
        PageTable& t = s->layers[l].table[cls];
        t.pages.push_back(h);
        t.used += match[j].used;
        t.live += match[j].used;
        if (shrunk) s->attached_cls[size_t(l) * m + j] = uint8_t(cls);
      }
    }
    if (shrunk) s->attached_pages = uint32_t(m);
  } catch (...) {  // the sequence holds nothing again
    unbusy();
    for (Segment& seg : s->layers) free_pages(s->tenant, seg);
    s->attached_cls.clear();
    throw;
  }
  if (st.ok() && backend_->kind() != KVGC_DEVICE_CPU) st = staging_.enqueued(*backend_, stream);
  unbusy();
  if (!st.ok()) {  // undo: the sequence holds nothing again
    for (Segment& seg : s->layers) free_pages(s->tenant, seg);
    s->attached_pages = 0;
    s->attached_cls.clear();
    return fail(st.code, "kvgc_prefix_attach: " + std::string(st.text()));
  }
  const uint64_t sinks = std::min<uint64_t>(opts_.sinks, tokens);
  // KVGC_PREFIX_CHARGE=cache: the whole pages are the cache's, out of this sequence's GC.
  const bool pin = opts_.prefix_charge == KVGC_PREFIX_CHARGE_CACHE;
  const uint64_t pinned = pin ? uint64_t(k) * pt : 0, pinned_sinks = std::min<uint64_t>(opts_.sinks, pinned);
  for (Segment& seg : s->layers) {
    seg.length = tokens;
    seg.tier[kGenSink] = sinks;
    seg.tier[kGenYoung] = tokens - sinks;
    seg.since_minor = uint32_t(std::min<uint64_t>(tokens - pinned, UINT32_MAX));
    seg.evictable_below = 0;  // every attached position is live
    seg.pinned_pages = pin ? k : 0;
    seg.pinned_live = pinned;
    seg.pinned_tier[kGenSink] = pinned_sinks;
    seg.pinned_tier[kGenYoung] = pinned - pinned_sinks;
    touch(seg);
  }
  for (Match& x : match) x.e->last_use = ++lru_clock_;
  ++counters_.prefix_hits;
  counters_.prefix_tokens_attached += tokens;
  *n_attached = tokens;
  return Status::Ok();
}

Status ManagedHeap::prefix_pin(kvgc_prefix prefix, bool pinned) {
  auto it = prefixes_.find(prefix);
  if (it == prefixes_.end())
    return fail_fixed(KVGC_ENOTFOUND, "kvgc_prefix_pin: prefix %llu is not a cached prefix of this heap (dropped, or evicted)",
                      (unsigned long long)prefix);
  it->second.pinned = pinned;
  return Status::Ok();
}

Status ManagedHeap::prefix_drop(kvgc_prefix prefix) {
  auto it = prefixes_.find(prefix);
  if (it == prefixes_.end())
    return fail_fixed(KVGC_ENOTFOUND, "kvgc_prefix_drop: prefix %llu is not a cached prefix of this heap (dropped, or evicted)",
                      (unsigned long long)prefix);
  drop_prefix(it->second);
  prefixes_.erase(it);
  return Status::Ok();
}

}  // namespace kvgc
