// Every public entry point with bad arguments: each returns its documented status,
// the message names the argument, and the heap is unchanged (check passes, stats equal).
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <functional>

#include "util.hpp"

using namespace kvgc_test;

namespace {

struct Case {
  const char* what;
  kvgc_status expect;
  const char* names;  // substring the error message must contain
  std::function<kvgc_status(kvgc_heap*, kvgc_seq)> call;
};

kvgc_stats snapshot(kvgc_heap* h) {
  kvgc_stats s;
  kvgc_stats_init(&s);
  REQUIRE(kvgc_get_stats(h, &s) == KVGC_OK);
  return s;
}

}  // namespace

TEST_CASE("bad input: documented status, a message naming the argument, nothing changed") {
  const kvgc_model_desc m = model(2, 2, 64);
  const kvgc_heap_options o = cpu_options(4 << 20);
  kvgc_heap* heap = nullptr;
  REQUIRE(kvgc_heap_create(&m, &o, &heap) == KVGC_OK);
  kvgc_seq seq, dead;
  REQUIRE(kvgc_seq_create(heap, 0, &seq) == KVGC_OK);
  REQUIRE(kvgc_seq_create(heap, 0, &dead) == KVGC_OK);
  REQUIRE(kvgc_seq_destroy(heap, dead) == KVGC_OK);
  const auto k = tagged(m, seq, 0, 0, 20, false), v = tagged(m, seq, 0, 0, 20, true);
  REQUIRE(kvgc_append(heap, seq, 0, k.data(), v.data(), 20, nullptr) == KVGC_OK);

  // A foreign handle: memory that is not a heap.
  alignas(16) static unsigned char foreign_bytes[256];
  std::memset(foreign_bytes, 0x5a, sizeof foreign_bytes);
  kvgc_heap* foreign = reinterpret_cast<kvgc_heap*>(foreign_bytes);
  std::vector<uint8_t> out(64 * token_bytes(m));
  std::vector<int32_t> pos(64);
  uint64_t n = 0;
  kvgc_model_desc bad_model = m;
  kvgc_heap_options bad_opts = o;
  kvgc_stats small_stats;
  kvgc_stats_init(&small_stats);
  small_stats.struct_size = 8;

  const Case cases[] = {
      {"append NULL heap", KVGC_EINVAL, "heap is NULL",
       [&](kvgc_heap*, kvgc_seq s) { return kvgc_append(nullptr, s, 0, k.data(), v.data(), 1, nullptr); }},
      {"append foreign heap", KVGC_EINVAL, "not a live kvgc_heap",
       [&](kvgc_heap*, kvgc_seq s) { return kvgc_append(foreign, s, 0, k.data(), v.data(), 1, nullptr); }},
      {"append unknown seq", KVGC_ENOTFOUND, "seq 999",
       [&](kvgc_heap* h, kvgc_seq) { return kvgc_append(h, 999, 0, k.data(), v.data(), 1, nullptr); }},
      {"append destroyed seq", KVGC_ENOTFOUND, "not a live sequence",
       [&](kvgc_heap* h, kvgc_seq) { return kvgc_append(h, dead, 0, k.data(), v.data(), 1, nullptr); }},
      {"append seq 0", KVGC_ENOTFOUND, "seq 0",
       [&](kvgc_heap* h, kvgc_seq) { return kvgc_append(h, 0, 0, k.data(), v.data(), 1, nullptr); }},
      {"append layer out of range", KVGC_EINVAL, "layer 2",
       [&](kvgc_heap* h, kvgc_seq s) { return kvgc_append(h, s, 2, k.data(), v.data(), 1, nullptr); }},
      {"append huge layer", KVGC_EINVAL, "layer 4294967295",
       [&](kvgc_heap* h, kvgc_seq s) { return kvgc_append(h, s, UINT32_MAX, k.data(), v.data(), 1, nullptr); }},
      {"append NULL k", KVGC_EINVAL, "k is NULL",
       [&](kvgc_heap* h, kvgc_seq s) { return kvgc_append(h, s, 0, nullptr, v.data(), 1, nullptr); }},
      {"append NULL v", KVGC_EINVAL, "v is NULL",
       [&](kvgc_heap* h, kvgc_seq s) { return kvgc_append(h, s, 0, k.data(), nullptr, 1, nullptr); }},
      {"append misaligned k", KVGC_EINVAL, "aligned",
       [&](kvgc_heap* h, kvgc_seq s) { return kvgc_append(h, s, 0, k.data() + 1, v.data(), 1, nullptr); }},
      {"append huge n (arena)", KVGC_ENOMEM, "kvgc_append",
       [&](kvgc_heap* h, kvgc_seq s) { return kvgc_append(h, s, 0, k.data(), v.data(), 1u << 30, nullptr); }},
      {"read NULL n_out", KVGC_EINVAL, "n_out is NULL",
       [&](kvgc_heap* h, kvgc_seq s) { return kvgc_read(h, s, 0, out.data(), out.data(), pos.data(), 64, nullptr, nullptr); }},
      {"read small capacity", KVGC_EINVAL, "capacity 19",
       [&](kvgc_heap* h, kvgc_seq s) { return kvgc_read(h, s, 0, out.data(), nullptr, nullptr, 19, &n, nullptr); }},
      {"read misaligned pos", KVGC_EINVAL, "pos_out",
       [&](kvgc_heap* h, kvgc_seq s) {
         return kvgc_read(h, s, 0, nullptr, nullptr, reinterpret_cast<int32_t*>(reinterpret_cast<char*>(pos.data()) + 2), 64, &n, nullptr);
       }},
      {"read bad layer", KVGC_EINVAL, "layer 7",
       [&](kvgc_heap* h, kvgc_seq s) { return kvgc_read(h, s, 7, nullptr, nullptr, nullptr, 0, &n, nullptr); }},
      {"read destroyed seq", KVGC_ENOTFOUND, "kvgc_read",
       [&](kvgc_heap* h, kvgc_seq) { return kvgc_read(h, dead, 0, nullptr, nullptr, nullptr, 0, &n, nullptr); }},
      {"seq_tokens both NULL", KVGC_EINVAL, "live_out and length_out",
       [&](kvgc_heap* h, kvgc_seq s) { return kvgc_seq_tokens(h, s, 0, nullptr, nullptr); }},
      {"seq_tokens bad layer", KVGC_EINVAL, "layer 2",
       [&](kvgc_heap* h, kvgc_seq s) { uint64_t x; return kvgc_seq_tokens(h, s, 2, &x, nullptr); }},
      {"seq_create NULL out", KVGC_EINVAL, "seq_out is NULL",
       [&](kvgc_heap* h, kvgc_seq) { return kvgc_seq_create(h, 0, nullptr); }},
      {"seq_create NULL heap", KVGC_EINVAL, "heap is NULL",
       [&](kvgc_heap*, kvgc_seq) { kvgc_seq x; return kvgc_seq_create(nullptr, 0, &x); }},
      {"seq_destroy unknown", KVGC_ENOTFOUND, "seq 12345",
       [&](kvgc_heap* h, kvgc_seq) { return kvgc_seq_destroy(h, 12345); }},
      {"seq_destroy foreign heap", KVGC_EINVAL, "not a live kvgc_heap",
       [&](kvgc_heap*, kvgc_seq s) { return kvgc_seq_destroy(foreign, s); }},
      {"get_stats NULL out", KVGC_EINVAL, "out is NULL",
       [&](kvgc_heap* h, kvgc_seq) { return kvgc_get_stats(h, nullptr); }},
      {"get_stats bad struct_size", KVGC_EINVAL, "struct_size is 8",
       [&](kvgc_heap* h, kvgc_seq) { return kvgc_get_stats(h, &small_stats); }},
      {"get_options NULL out", KVGC_EINVAL, "out is NULL",
       [&](kvgc_heap* h, kvgc_seq) { return kvgc_heap_get_options(h, nullptr); }},
      {"heap_check NULL", KVGC_EINVAL, "heap is NULL",
       [&](kvgc_heap*, kvgc_seq) { return kvgc_heap_check(nullptr); }},
      {"heap_create NULL model", KVGC_EINVAL, "model is NULL",
       [&](kvgc_heap*, kvgc_seq) { kvgc_heap* x; return kvgc_heap_create(nullptr, &o, &x); }},
      {"heap_create NULL out", KVGC_EINVAL, "heap_out is NULL",
       [&](kvgc_heap*, kvgc_seq) { return kvgc_heap_create(&m, &o, nullptr); }},
      {"heap_create odd head_dim", KVGC_EINVAL, "model->head_dim",
       [&](kvgc_heap*, kvgc_seq) {
         kvgc_heap* x;
         bad_model = m;
         bad_model.head_dim = 63;
         return kvgc_heap_create(&bad_model, &o, &x);
       }},
      {"heap_create GQA mismatch", KVGC_EINVAL, "model->n_q_heads",
       [&](kvgc_heap*, kvgc_seq) {
         kvgc_heap* x;
         bad_model = m;
         bad_model.n_q_heads = 3;
         return kvgc_heap_create(&bad_model, &o, &x);
       }},
      {"heap_create zero layers", KVGC_EINVAL, "model->n_layers",
       [&](kvgc_heap*, kvgc_seq) {
         kvgc_heap* x;
         bad_model = m;
         bad_model.n_layers = 0;
         return kvgc_heap_create(&bad_model, &o, &x);
       }},
      {"heap_create bad dtype", KVGC_EINVAL, "model->dtype",
       [&](kvgc_heap*, kvgc_seq) {
         kvgc_heap* x;
         bad_model = m;
         poke_enum(bad_model.dtype, 7);
         return kvgc_heap_create(&bad_model, &o, &x);
       }},
      {"heap_create model struct_size", KVGC_EINVAL, "model->struct_size",
       [&](kvgc_heap*, kvgc_seq) {
         kvgc_heap* x;
         bad_model = m;
         bad_model.struct_size = 4;
         return kvgc_heap_create(&bad_model, &o, &x);
       }},
      {"heap_create opts struct_size", KVGC_EINVAL, "opts->struct_size",
       [&](kvgc_heap*, kvgc_seq) {
         kvgc_heap* x;
         bad_opts = o;
         bad_opts.struct_size = sizeof bad_opts + 8;
         return kvgc_heap_create(&m, &bad_opts, &x);
       }},
      {"heap_create budget below a slab", KVGC_EINVAL, "budget",
       [&](kvgc_heap*, kvgc_seq) {
         kvgc_heap* x;
         bad_opts = o;
         bad_opts.budget_bytes = 1000;
         return kvgc_heap_create(&m, &bad_opts, &x);
       }},
      {"heap_create bad device", KVGC_EINVAL, "opts->device",
       [&](kvgc_heap*, kvgc_seq) {
         kvgc_heap* x;
         bad_opts = o;
         poke_enum(bad_opts.device, 9);
         return kvgc_heap_create(&m, &bad_opts, &x);
       }},
      {"kv_bytes NULL model", KVGC_EINVAL, "model is NULL",
       [&](kvgc_heap*, kvgc_seq) { uint64_t b; return kvgc_kv_bytes(nullptr, 1, KVGC_CLASS_FP16, 0, &b); }},
      {"kv_bytes NULL out", KVGC_EINVAL, "bytes_out is NULL",
       [&](kvgc_heap*, kvgc_seq) { return kvgc_kv_bytes(&m, 1, KVGC_CLASS_FP16, 0, nullptr); }},
      {"kv_bytes page_tokens", KVGC_EINVAL, "page_tokens",
       [&](kvgc_heap*, kvgc_seq) { uint64_t b; return kvgc_kv_bytes(&m, 1, KVGC_CLASS_FP16, 999, &b); }},
      {"observe NULL heap", KVGC_EINVAL, "heap is NULL",
       [&](kvgc_heap*, kvgc_seq s) { float x = 0; return kvgc_observe(nullptr, s, 0, &x, 1, nullptr); }},
      {"observe NULL mass", KVGC_EINVAL, "mass is NULL",
       [&](kvgc_heap* h, kvgc_seq s) { return kvgc_observe(h, s, 0, nullptr, 20, nullptr); }},
      {"observe wrong n", KVGC_EINVAL, "live count 20",
       [&](kvgc_heap* h, kvgc_seq s) { std::vector<float> x(30); return kvgc_observe(h, s, 0, x.data(), 30, nullptr); }},
      {"observe destroyed seq", KVGC_ENOTFOUND, "kvgc_observe",
       [&](kvgc_heap* h, kvgc_seq) { float x = 0; return kvgc_observe(h, dead, 0, &x, 1, nullptr); }},
      {"step NULL heap", KVGC_EINVAL, "heap is NULL",
       [&](kvgc_heap*, kvgc_seq s) { return kvgc_step(nullptr, s, nullptr); }},
      {"step foreign heap", KVGC_EINVAL, "not a live kvgc_heap",
       [&](kvgc_heap*, kvgc_seq s) { return kvgc_step(foreign, s, nullptr); }},
      {"step destroyed seq", KVGC_ENOTFOUND, "kvgc_step",
       [&](kvgc_heap* h, kvgc_seq) { return kvgc_step(h, dead, nullptr); }},
      {"attend NULL q", KVGC_EINVAL, "q is NULL",
       [&](kvgc_heap* h, kvgc_seq s) { return kvgc_attend(h, s, 0, nullptr, 1, out.data(), nullptr, nullptr); }},
      {"attend NULL out", KVGC_EINVAL, "out is NULL",
       [&](kvgc_heap* h, kvgc_seq s) { return kvgc_attend(h, s, 0, out.data(), 1, nullptr, nullptr, nullptr); }},
      {"attend n_q past length", KVGC_EINVAL, "n_q 21",
       [&](kvgc_heap* h, kvgc_seq s) { return kvgc_attend(h, s, 0, out.data(), 21, out.data(), nullptr, nullptr); }},
      {"attend empty layer", KVGC_EINVAL, "n_q 1",
       [&](kvgc_heap* h, kvgc_seq s) { return kvgc_attend(h, s, 1, out.data(), 1, out.data(), nullptr, nullptr); }},
      {"attend bad params size", KVGC_EINVAL, "params->struct_size",
       [&](kvgc_heap* h, kvgc_seq s) {
         kvgc_attend_params p;
         kvgc_attend_params_init(&p);
         p.struct_size = 1;
         return kvgc_attend(h, s, 0, out.data(), 1, out.data(), &p, nullptr);
       }},
      {"attend NaN scale", KVGC_EINVAL, "params->scale",
       [&](kvgc_heap* h, kvgc_seq s) {
         kvgc_attend_params p;
         kvgc_attend_params_init(&p);
         p.scale = NAN;
         return kvgc_attend(h, s, 0, out.data(), 1, out.data(), &p, nullptr);
       }},
      {"attend unknown flags", KVGC_EINVAL, "params->flags",
       [&](kvgc_heap* h, kvgc_seq s) {
         kvgc_attend_params p;
         kvgc_attend_params_init(&p);
         p.flags = 0x80;
         return kvgc_attend(h, s, 0, out.data(), 1, out.data(), &p, nullptr);
       }},
      {"read_scores NULL n_out", KVGC_EINVAL, "n_out is NULL",
       [&](kvgc_heap* h, kvgc_seq s) { return kvgc_read_scores(h, s, 0, nullptr, nullptr, 0, nullptr, nullptr); }},
      {"read_scores small capacity", KVGC_EINVAL, "capacity 3",
       [&](kvgc_heap* h, kvgc_seq s) { std::vector<float> x(3); return kvgc_read_scores(h, s, 0, x.data(), nullptr, 3, &n, nullptr); }},
      {"tenant_usage both NULL", KVGC_EINVAL, "bytes_out and limit_out",
       [&](kvgc_heap* h, kvgc_seq) { return kvgc_tenant_usage(h, 0, nullptr, nullptr); }},
      {"tenant_set_limit NULL heap", KVGC_EINVAL, "heap is NULL",
       [&](kvgc_heap*, kvgc_seq) { return kvgc_tenant_set_limit(nullptr, 0, 1); }},
      {"attend_params_init NULL", KVGC_EINVAL, "params is NULL",
       [&](kvgc_heap*, kvgc_seq) { return kvgc_attend_params_init(nullptr); }},
      {"options_init NULL", KVGC_EINVAL, "opts is NULL",
       [&](kvgc_heap*, kvgc_seq) { return kvgc_heap_options_init(nullptr); }},
      {"model_desc_init NULL", KVGC_EINVAL, "desc is NULL",
       [&](kvgc_heap*, kvgc_seq) { return kvgc_model_desc_init(nullptr); }},
      {"stats_init NULL", KVGC_EINVAL, "out is NULL",
       [&](kvgc_heap*, kvgc_seq) { return kvgc_stats_init(nullptr); }},
  };

  const kvgc_stats before = snapshot(heap);
  for (const Case& c : cases) {
    CAPTURE(c.what);
    const kvgc_status st = c.call(heap, seq);
    CHECK(st == c.expect);
    // The heap-less calls' message is found with a NULL heap; heap calls with theirs.
    const std::string msg = kvgc_errmsg(nullptr);
    CAPTURE(msg);
    CHECK(msg.find(c.names) != std::string::npos);
    CHECK(kvgc_heap_check(heap) == KVGC_OK);
    kvgc_stats now = snapshot(heap);
    now.enomem = before.enomem;  // the one counter a refused append may move
    CHECK(std::memcmp(&now, &before, sizeof now) == 0);
  }
  // Success clears the calling thread's message.
  CHECK(kvgc_heap_check(heap) == KVGC_OK);
  CHECK(std::string(kvgc_errmsg(heap)).empty());
  // n_tokens == 0 is a documented no-op, NULL data allowed.
  CHECK(kvgc_append(heap, seq, 0, nullptr, nullptr, 0, nullptr) == KVGC_OK);
  kvgc_heap_destroy(nullptr);  // no-op
  kvgc_heap_destroy(heap);
}
