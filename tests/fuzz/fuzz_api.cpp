// libFuzzer harness over the C API: the input is decoded into a heap (shape and options
// from its first bytes) and then a sequence of calls with arbitrary arguments: unknown
// and destroyed sequences, NULL and foreign handles, out-of-range layers and counts,
// misaligned pointers, NaN/Inf data and mass. After every call the invariant walker must
// pass; any status is acceptable, a crash or a broken invariant is not.
// The prefix cache (0.7): op bytes 0xC0 and up keep a sequence's cache as a prefix (its
// token ids are the harness's record of what it appended: sequences of one tenant that
// appended as much hold the same ids), attach one to a new or a used sequence (the kept
// ids whole, cut, extended or changed, another salt, another tenant), pin and drop them,
// and plan one sequence's many tokens so that the arena runs short (cached prefixes are
// evicted for room); kvgc_seq_fork shares pages (op 0 with the tenant byte's high bit). A keep that succeeds
// is looked up at once by a new sequence of its tenant: all of it must attach (or the
// header pages not fit), and an attached sequence must hold what it attached, positions
// 0 .. n-1.
// KVGC_FUZZ_TRACE=1 prints each call's op before it runs (to diagnose a finding).
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <vector>

#include "../../kernels/cpu/attend_internal.hpp"  // the split minimum, lowered below
#include "kvgc.h"

namespace {

struct Input {
  const uint8_t* p;
  size_t n;
  uint8_t byte() { return n ? (--n, *p++) : 0; }
  uint32_t u32() { return byte() | uint32_t(byte()) << 8 | uint32_t(byte()) << 16 | uint32_t(byte()) << 24; }
  bool done() const { return n == 0; }
  // A buffer of `bytes`: input bytes first, then a pattern; sometimes NaN/Inf floats.
  std::vector<uint8_t> data(size_t bytes) {
    std::vector<uint8_t> b(bytes + 8);
    for (size_t i = 0; i < bytes; ++i) b[i] = n ? byte() : uint8_t(i * 37);
    return b;
  }
};

void check(kvgc_heap* h) {
  if (kvgc_heap_check(h) != KVGC_OK) {
    std::fprintf(stderr, "invariant broken: %s\n", kvgc_errmsg(h));
    std::abort();
  }
}

[[noreturn]] void broken(const char* what, kvgc_heap* h) {
  std::fprintf(stderr, "contract broken: %s (last error: %s)\n", what, kvgc_errmsg(h));
  std::abort();
}

// The token ids a sequence holds, as the engine would know them: the ids of the prefix it
// attached (head), then ids made from the position and the tenant that created it (sel),
// so that sequences of one tenant that appended as much hold the same ids.
struct Ids {
  std::vector<int32_t> head;
  uint32_t sel = 0;
  std::vector<int32_t> first(uint64_t n) const {
    std::vector<int32_t> ids(n + 1);  // + 1: never empty (data() is not NULL)
    for (uint64_t i = 0; i < n; ++i) ids[i] = i < head.size() ? head[i] : int32_t(i) ^ int32_t(sel << 16);
    return ids;
  }
};

struct Kept {
  kvgc_prefix p;
  std::vector<int32_t> ids;
  uint64_t salt;
  uint32_t tenant;
};

// kvgc_prefix_attach of ids under salt to s; on KVGC_OK, checks that s holds exactly what
// it attached in every layer, at positions 0 .. n-1. Returns the tokens attached.
uint64_t attach_checked(kvgc_heap* h, uint32_t n_layers, kvgc_seq s, const int32_t* ids, uint64_t n,
                        uint64_t salt, kvgc_status* st_out) {
  uint64_t got = UINT64_MAX;
  const kvgc_status st = kvgc_prefix_attach(h, s, ids, n, salt, &got, nullptr);
  if (st_out) *st_out = st;
  if (st != KVGC_OK) return 0;
  if (got > n) broken("kvgc_prefix_attach attached more tokens than it was given", h);
  for (uint32_t l = 0; l < n_layers; ++l) {
    uint64_t live = 0, len = 0;
    if (kvgc_seq_tokens(h, s, l, &live, &len) != KVGC_OK || live != got || len != got)
      broken("a sequence after kvgc_prefix_attach does not hold what it attached", h);
  }
  if (got) {
    std::vector<int32_t> pos(got + 1);
    uint64_t rows = 0;
    if (kvgc_read(h, s, 0, nullptr, nullptr, pos.data(), got, &rows, nullptr) != KVGC_OK || rows != got)
      broken("kvgc_read of an attached sequence failed", h);
    for (uint64_t i = 0; i < got; ++i)
      if (pos[i] != int32_t(i)) broken("an attached sequence's positions are not 0 .. n-1", h);
  }
  return got;
}

}  // namespace

// Fuzzed segments are short: let split-K attention (cpu_threads > 1) cut them anyway.
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  kvgc::cpu::set_split_min_slots(4);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Input in{data, size};
  kvgc_model_desc m;
  kvgc_model_desc_init(&m);
  static const uint32_t dims[] = {2, 4, 6, 8, 16, 32, 64};
  m.n_layers = 1 + in.byte() % 3;
  m.n_kv_heads = 1 + in.byte() % 3;
  m.n_q_heads = m.n_kv_heads * (1 + in.byte() % 3);
  m.head_dim = dims[in.byte() % 7];
  m.dtype = kvgc_dtype(in.byte() % 3);
  kvgc_heap_options o;
  kvgc_heap_options_init(&o);
  o.flags = KVGC_OPT_IGNORE_ENV;
  o.device = KVGC_DEVICE_CPU;
  o.budget_bytes = (64u << 10) * (1 + in.byte() % 16);
  o.slab_bytes = 64u << 10;
  o.page_tokens = 1 + in.byte() % 32;
  o.policy = kvgc_policy(in.byte() % 5);
  o.sinks = in.byte() % 6;
  const uint8_t window = in.byte();
  o.window = window % 12;
  o.window_min = window / 12 % 12;  // 0.9: the window scales under a byte budget (same byte)
  // Bytes keep their places (the corpus keeps its meaning): high values of the token
  // budget's byte ask for a byte budget instead, the demote byte's bit 6 for recent scores,
  // its bit 7 for attached tokens charged to their sequences (the prefix cache, 0.7; how:
  // below).
  const uint8_t budget = in.byte();
  o.token_budget = budget < 200 ? budget % 40 : 0;
  o.byte_budget_fraction = budget < 200 ? 0.0 : 0.1 + (budget - 200) / 100.0;
  const uint8_t demote = in.byte();
  o.demote = kvgc_demote(demote % 4);  // off, int4, int8, the ladder
  if (demote % 4 == 3 && (demote & 0x20)) o.demote = KVGC_DEMOTE_LADDER_INT2;  // bit 5 (0.10)
  o.recent_decay = demote & 0x40 ? 0.9 : 1.0;
  o.compact_threshold = 0.05 + (in.byte() % 20) / 20.0;
  const uint8_t noise_harvest = in.byte();  // one byte for all three: the corpus keeps its layout
  o.score_noise = noise_harvest % 4 == 0 ? 0.1 : 0.0;
  o.harvest = noise_harvest & 4 ? KVGC_HARVEST_IMMEDIATE : KVGC_HARVEST_DEFERRED;
  // Charged to the sequences: as VIEW, or (its bit 3, 0.8) PRUNE's demotion in place, and
  // with bit 5 (0.13) SHRINK's re-stored shared pages.
  o.prefix_charge = !(demote & 0x80)     ? KVGC_PREFIX_CHARGE_CACHE
                    : !(noise_harvest & 8) ? KVGC_PREFIX_CHARGE_VIEW
                    : noise_harvest & 0x20 ? KVGC_PREFIX_CHARGE_SHRINK
                                           : KVGC_PREFIX_CHARGE_PRUNE;
  o.cpu_threads = 1 + (noise_harvest >> 3) % 3;  // split-K attention (bits 3-4: same layout)
  kvgc_heap* h = nullptr;
  if (kvgc_heap_create(&m, &o, &h) != KVGC_OK) return 0;

  const size_t eb = m.dtype == KVGC_DTYPE_F32 ? 4 : 2;
  const size_t token = size_t(m.n_kv_heads) * m.head_dim * eb;
  const size_t qrow = size_t(m.n_q_heads) * m.head_dim * eb;
  std::vector<kvgc_seq> seqs;
  kvgc_batch* batch = nullptr;
  kvgc_batch_create(h, &batch);
  uint32_t batch_rows = 0;  // the rows of the batch's last successful plan
  alignas(16) static unsigned char foreign[128];
  std::map<kvgc_seq, Ids> ids_of;  // live sequences (the harness's view)
  std::map<kvgc_seq, uint32_t> tenant_of;
  std::vector<Kept> kept;  // prefixes kept (evicted ones stay listed: their handles go stale)
  auto made = [&](kvgc_seq s, uint32_t tenant, const Ids& ids) {
    seqs.push_back(s);
    ids_of[s] = ids;
    tenant_of[s] = tenant;
  };
  static const bool trace = std::getenv("KVGC_FUZZ_TRACE") != nullptr;  // to diagnose a finding
  for (int calls = 0; calls < 64 && !in.done(); ++calls) {
    const uint8_t op = in.byte();
    if (trace) std::fprintf(stderr, "call %d: op 0x%02x (case %d)\n", calls, op, op < 0xC0 ? op % 12 : 12 + (op - 0xC0) % 5);
    // A sequence id: usually a live one, sometimes destroyed or made up.
    auto pick = [&]() -> kvgc_seq {
      const uint8_t b = in.byte();
      if (seqs.empty() || b >= 240) return kvgc_seq(b) * 977u;
      return seqs[b % seqs.size()];
    };
    const uint32_t layer = in.byte() % 8 == 7 ? in.u32() : in.byte() % m.n_layers;
    // Op bytes below 0xC0 keep their meaning from before the prefix cache (the corpus).
    switch (op < 0xC0 ? op % 12 : 12 + (op - 0xC0) % 5) {
      case 0: {  // a new sequence, or (the tenant byte's high bit) a copy of one
        kvgc_seq s = 0;
        const uint8_t t = in.byte();
        if (t & 0x80) {
          const kvgc_seq from = pick();
          const kvgc_status st = kvgc_seq_fork(h, from, t % 4, &s, nullptr);
          if (st == KVGC_OK) made(s, t % 4, ids_of[from]);
          else if (s != 0) broken("a failed kvgc_seq_fork wrote *seq_out", h);
        } else if (kvgc_seq_create(h, t % 4, &s) == KVGC_OK) {
          made(s, t % 4, Ids{{}, t % 4u});
        }
        break;
      }
      case 1: {
        const kvgc_seq s = pick();
        if (kvgc_seq_destroy(h, s) == KVGC_OK) {
          ids_of.erase(s);
          tenant_of.erase(s);
        }
        break;
      }
      case 2: {
        const kvgc_seq s = pick();
        const uint32_t n = in.byte() % 48;
        auto k = in.data(n * token), v = in.data(n * token);
        const size_t off = in.byte() % 5 == 0 ? 1 : 0;  // sometimes misaligned
        kvgc_append(h, s, layer, k.data() + off, v.data(), n, nullptr);
        break;
      }
      case 3: {
        const uint64_t cap = in.byte();
        std::vector<uint8_t> k(cap * token + 8), v(k.size());
        std::vector<int32_t> pos(cap + 1);
        uint64_t n = 0;
        kvgc_read(h, pick(), layer, cap % 3 ? k.data() : nullptr, v.data(), pos.data(), cap, &n, nullptr);
        break;
      }
      case 4: {
        const kvgc_seq s = pick();
        uint64_t live = 0;
        kvgc_seq_tokens(h, s, layer % m.n_layers, &live, nullptr);
        const uint64_t n = in.byte() % 8 == 0 ? live + 1 : live;
        std::vector<float> mass(n + 1);
        for (auto& x : mass) {
          const uint8_t b = in.byte();
          x = b == 255 ? NAN : b == 254 ? INFINITY : b == 253 ? -1.f : float(b) / 64.f;
        }
        kvgc_observe(h, s, layer, mass.data(), n, nullptr);
        break;
      }
      case 5: kvgc_step(h, pick(), nullptr); break;
      case 6: {
        const kvgc_seq s = pick();
        const uint32_t n_q = in.byte() % 6;
        auto q = in.data(n_q * qrow);
        std::vector<uint8_t> out(n_q * qrow + 8);
        kvgc_attend_params p;
        kvgc_attend_params_init(&p);
        p.scale = in.byte() % 3 == 0 ? float(in.byte()) / 16.f : 0.f;
        p.flags = in.byte() % 4 == 0 ? KVGC_ATTEND_NO_SCORES : 0;
        kvgc_attend(h, s, layer, q.data(), n_q, out.data(), in.byte() % 2 ? &p : nullptr, nullptr);
        break;
      }
      case 7: {
        const uint64_t cap = in.byte();
        std::vector<float> sc(cap + 1);
        std::vector<uint8_t> gen(cap + 1);
        uint64_t n = 0;
        if (cap % 2) kvgc_read_classes(h, pick(), layer, gen.data(), cap, &n, nullptr);
        else kvgc_read_scores(h, pick(), layer, sc.data(), gen.data(), cap, &n, nullptr);
        break;
      }
      case 8: kvgc_tenant_set_limit(h, in.byte() % 4, uint64_t(in.byte()) * 4096); break;
      case 9: {
        kvgc_stats st;
        kvgc_stats_init(&st);
        kvgc_get_stats(h, &st);
        uint64_t b = 0;
        kvgc_tenant_usage(h, in.byte() % 4, &b, nullptr);
        kvgc_kv_bytes(&m, in.u32(), kvgc_storage_class(in.byte() % KVGC_CLASS_COUNT), in.byte(), &b);
        break;
      }
      case 10: {  // handles that are not heaps
        kvgc_heap* bad = in.byte() % 2 ? nullptr : reinterpret_cast<kvgc_heap*>(foreign);
        kvgc_seq s;
        kvgc_seq_create(bad, 0, &s);
        kvgc_step(bad, 1, nullptr);
        kvgc_heap_check(bad);
        break;
      }
      case 12: {  // kvgc_prefix_keep: the ids it holds (or their first whole pages), sometimes a wrong count or a bad argument
        const kvgc_seq s = pick();
        uint64_t len = 0;
        kvgc_seq_tokens(h, s, 0, nullptr, &len);
        const uint8_t mode = in.byte(), f = in.byte();
        kvgc_heap_options ho;
        kvgc_heap_options_init(&ho);
        kvgc_heap_get_options(h, &ho);
        const uint64_t pt = ho.page_tokens ? ho.page_tokens : 1;  // mode 3: its first whole pages
        const uint64_t n = mode % 8 == 0 ? len + 1 : mode % 8 == 1 ? (len ? len - 1 : 0) : mode % 8 == 2 ? in.byte()
                           : mode % 8 == 3 ? len / pt * pt : len;
        const uint64_t salt = (mode >> 3) % 4;  // 0: the tenant's
        const uint32_t flags = f % 8 == 6 ? 0x12u : f & 1 ? KVGC_PREFIX_PIN : 0u;
        const auto it = ids_of.find(s);
        const std::vector<int32_t> ids = it != ids_of.end() ? it->second.first(n) : Ids{}.first(n);
        kvgc_prefix p = 0;
        const kvgc_status st = kvgc_prefix_keep(h, s, f % 16 == 15 ? nullptr : ids.data(), n, salt, flags,
                                                f % 8 == 5 ? nullptr : &p, nullptr);
        if (st != KVGC_OK) {
          if (p != 0) broken("a failed kvgc_prefix_keep wrote *prefix_out", h);
          break;
        }
        if (f % 8 != 5 && p == 0) broken("kvgc_prefix_keep returned KVGC_OK and prefix 0", h);
        const uint32_t tenant = tenant_of.count(s) ? tenant_of[s] : 0;
        if (p) {
          bool known = false;
          for (const Kept& k : kept) known |= k.p == p;
          if (!known) kept.push_back({p, std::vector<int32_t>(ids.begin(), ids.begin() + n), salt, tenant});
        }
        check(h);
        // Looked up at once by a new sequence of its tenant: every token attaches.
        kvgc_seq probe = 0;
        if (kvgc_seq_create(h, tenant, &probe) != KVGC_OK) break;
        kvgc_status ast = KVGC_OK;
        const uint64_t got = attach_checked(h, m.n_layers, probe, ids.data(), n, salt, &ast);
        if (ast == KVGC_OK && got != n) {
          std::fprintf(stderr, "kept %llu tokens (salt %llu), attached %llu\n", (unsigned long long)n,
                       (unsigned long long)salt, (unsigned long long)got);
          broken("a prefix just kept does not attach whole", h);
        }
        if (ast != KVGC_OK && ast != KVGC_ENOMEM && ast != KVGC_EBUDGET)
          broken("kvgc_prefix_attach of a prefix just kept failed", h);
        check(h);
        if (kvgc_seq_destroy(h, probe) != KVGC_OK) broken("kvgc_seq_destroy of a probe failed", h);
        break;
      }
      case 13: {  // kvgc_prefix_attach: to a new sequence (any tenant) or a used one
        const uint8_t sub = in.byte();
        kvgc_seq s = 0;
        if (sub & 1) {
          const uint32_t t = (sub >> 1) % 4;
          if (kvgc_seq_create(h, t, &s) != KVGC_OK) break;
          made(s, t, Ids{{}, t});
        } else {
          s = pick();
        }
        std::vector<int32_t> ids;
        uint64_t salt = 0;
        if (!kept.empty() && (sub >> 3) % 4 != 3) {
          const Kept& k = kept[in.byte() % kept.size()];
          ids = k.ids;
          salt = k.salt;
          switch (sub >> 5) {
            case 2: ids.resize(in.byte() % (ids.size() + 1)); break;  // a shorter request
            case 3:  // a longer one
              for (uint32_t i = 0, extra = in.byte() % 20; i < extra; ++i) ids.push_back(int32_t(in.byte()) - 300);
              break;
            case 4:  // one id differs
              if (!ids.empty()) ids[in.byte() % ids.size()] ^= 0x5555;
              break;
            case 5: salt = salt ? salt + 1 : 1; break;  // another salt (or none for a salted one)
            case 6: salt = 0; break;
            case 7:
              ids.resize(in.byte() % (ids.size() + 1));
              salt = (salt + 1) % 4;
              break;
            default: break;  // the kept ids whole
          }
        } else {  // another sequence's ids
          const kvgc_seq from = pick();
          const auto it = ids_of.find(from);
          ids = (it != ids_of.end() ? it->second : Ids{}).first(in.byte());
          ids.pop_back();
          salt = in.byte() % 4;
        }
        const uint64_t n = ids.size();
        ids.push_back(0);  // data() never NULL
        kvgc_status st = KVGC_OK;
        const uint64_t got = attach_checked(h, m.n_layers, s, ids.data(), n, salt, &st);
        if (st == KVGC_OK && got) {
          ids_of[s].head.assign(ids.begin(), ids.begin() + got);
        }
        break;
      }
      case 14: {  // kvgc_prefix_pin
        const uint8_t b = in.byte();
        const kvgc_prefix p = kept.empty() || b >= 240 ? kvgc_prefix(b) * 131u : kept[b % kept.size()].p;
        kvgc_prefix_pin(h, p, in.byte() % 2);
        break;
      }
      case 15: {  // kvgc_prefix_drop; a dropped prefix is gone
        const uint8_t b = in.byte();
        const kvgc_prefix p = kept.empty() || b >= 240 ? kvgc_prefix(b) * 131u : kept[b % kept.size()].p;
        if (kvgc_prefix_drop(h, p) == KVGC_OK && kvgc_prefix_pin(h, p, 1) != KVGC_ENOTFOUND)
          broken("a dropped prefix can still be pinned", h);
        break;
      }
      case 16: {  // room: a plan of many tokens for one sequence (it needs no data): the arena
                  // runs short, so cached prefixes go (least recently used first, pinned ones
                  // stay) or the plan fails; its pages come back at the next plan or step
        const kvgc_seq s = pick();
        const uint32_t n_new = 32u * (1 + in.byte() % 16);
        uint32_t failed = 0;
        if (batch && kvgc_batch_plan(batch, &s, &n_new, 1, &failed, nullptr) == KVGC_OK) batch_rows = n_new;
        break;
      }
      default: {  // the batch API (0.5), or a token count
        const uint8_t sub = in.byte();
        if (!batch || sub % 8 == 7) {
          uint64_t live = 0, len = 0;
          kvgc_seq_tokens(h, pick(), layer, &live, &len);
        } else if (sub % 8 == 0) {  // plan a few sequences (repeats and unknown ids included)
          const uint32_t n = in.byte() % 6;
          std::vector<kvgc_seq> ids(n);
          std::vector<uint32_t> n_new(n), scored(n), flags(n);
          uint32_t rows = 0, failed = 0;
          for (uint32_t i = 0; i < n; ++i) {
            ids[i] = pick();
            n_new[i] = in.byte() % 20;
            rows += n_new[i];
            scored[i] = in.byte() % 24;  // kvgc_batch_plan_ex: past n_new: every row
            flags[i] = in.byte() % 3;    // 2: an unknown bit (KVGC_EINVAL)
          }
          kvgc_batch_plan_options po;
          kvgc_batch_plan_options_init(&po);
          po.scored_rows = scored.data();
          po.seq_flags = flags.data();
          const kvgc_status planned =
              in.byte() % 2 ? kvgc_batch_plan_ex(batch, ids.data(), n_new.data(), n, &po, &failed, nullptr)
                            : kvgc_batch_plan(batch, ids.data(), n_new.data(), n, &failed, nullptr);
          if (planned == KVGC_OK) batch_rows = rows;
        } else if (sub % 8 <= 2) {  // append, then attend
          auto k = in.data(batch_rows * token), v = in.data(batch_rows * token);
          kvgc_batch_append(batch, layer, k.data(), v.data(), nullptr);
          auto q = in.data(batch_rows * qrow);
          std::vector<uint8_t> out(batch_rows * qrow + 8);
          if (sub % 8 == 2) kvgc_batch_attend(batch, layer, q.data(), out.data(), nullptr, nullptr);
        } else if (sub % 8 <= 4) {  // an engine's own attention: export, then observe
          kvgc_batch_view view;
          std::memset(&view, 0, sizeof view);
          view.struct_size = sizeof view;
          if (kvgc_batch_export(batch, layer, &view) == KVGC_OK && sub % 8 == 4) {
            std::vector<float> mass(size_t(view.n_pages) * view.page_tokens + 1);
            for (auto& x : mass) {
              const uint8_t b = in.byte();
              x = b == 255 ? NAN : b == 254 ? INFINITY : float(b) / 64.f;
            }
            kvgc_batch_observe(batch, layer, mass.data(), nullptr);
          }
        } else if (sub % 8 == 5) {
          kvgc_batch_step(batch, nullptr);
        } else {  // a second batch's plan makes the first stale; destroy and recreate
          kvgc_batch_destroy(batch);
          batch = nullptr;
          kvgc_batch_create(h, &batch);
        }
        break;
      }
    }
    check(h);
  }
  kvgc_batch_destroy(batch);
  check(h);
  kvgc_heap_destroy(h);
  return 0;
}
