// The options table: every KVGC_* variable, good and bad, through an injected getenv,
// plus the end-to-end path through the real environment and kvgc_heap_create.
#include <doctest/doctest.h>

#include <sched.h>

#include <cstdlib>
#include <cstring>
#include <map>
#include <string>

#include "../runtime/options.hpp"
#include "util.hpp"

using namespace kvgc;

namespace {

std::map<std::string, std::string> g_env;
const char* fake_getenv(const char* name) {
  auto it = g_env.find(name);
  return it == g_env.end() ? nullptr : it->second.c_str();
}

kvgc_heap_options apply(std::map<std::string, std::string> env, Status* st) {
  g_env = std::move(env);
  kvgc_heap_options o;
  options_defaults(&o);
  *st = options_from_env(&o, &fake_getenv);
  return o;
}

}  // namespace

TEST_CASE("defaults are documented and valid") {
  kvgc_heap_options o;
  options_defaults(&o);
  CHECK(o.struct_size == sizeof o);
  CHECK(options_validate(o).ok());
  CHECK(o.policy == KVGC_POLICY_GENERATIONAL);
  CHECK(o.page_tokens == 16);
  CHECK(o.sinks == 4);
  CHECK(o.window == 32);
  CHECK(o.harvest == KVGC_HARVEST_DEFERRED);
  CHECK(o.cpu_threads == 1);
  CHECK(o.recent_decay == doctest::Approx(0.95));
  CHECK(o.byte_budget == 0);
  CHECK(o.byte_budget_fraction == 0);
  CHECK(o.demote == KVGC_DEMOTE_LADDER);  // the full ladder by default (0.4)
  CHECK(o.prefix_charge == KVGC_PREFIX_CHARGE_SHRINK);
  CHECK(o.min_length == 256);  // a short chat is never pruned (0.14)
  CHECK(option_docs().size() == 20);
  for (const OptionDoc& d : option_docs()) {
    CHECK(std::string(d.env).rfind("KVGC_", 0) == 0);
    CHECK(std::string(d.doc).size() > 10);
  }
}

TEST_CASE("every variable accepts its documented forms") {
  Status st;
  auto o = apply({{"KVGC_DEVICE", "cpu"},
                  {"KVGC_POLICY", "h2o"},
                  {"KVGC_BUDGET", "512M"},
                  {"KVGC_TOKEN_BUDGET", "4096"},
                  {"KVGC_SINKS", "8"},
                  {"KVGC_WINDOW", " 128 "},
                  {"KVGC_PAGE_TOKENS", "32"},
                  {"KVGC_COMPACT_THRESHOLD", "0.4"},
                  {"KVGC_DEMOTE", "int4"},
                  {"KVGC_LAYER_BUDGET", "pyramid"},
                  {"KVGC_HARVEST", "immediate"},
                  {"KVGC_PREFIX_CHARGE", "view"},
                  {"KVGC_THREADS", "8"},
                  {"KVGC_SCORE_NOISE", "0.01"},
                  {"KVGC_SEED", "0x1234"},
                  {"KVGC_VERBOSE", "1"}},
                 &st);
  REQUIRE(st.ok());
  CHECK(o.device == KVGC_DEVICE_CPU);
  CHECK(o.policy == KVGC_POLICY_H2O);
  CHECK(o.budget_bytes == 512ull << 20);
  CHECK(o.token_budget == 4096);
  CHECK(o.sinks == 8);
  CHECK(o.window == 128);
  CHECK(o.page_tokens == 32);
  CHECK(o.compact_threshold == doctest::Approx(0.4));
  CHECK(o.demote == KVGC_DEMOTE_INT4);
  CHECK(o.layer_budget == KVGC_LAYER_BUDGET_PYRAMID);
  CHECK(o.harvest == KVGC_HARVEST_IMMEDIATE);
  CHECK(o.prefix_charge == KVGC_PREFIX_CHARGE_VIEW);
  CHECK(o.cpu_threads == 8);
  CHECK(o.score_noise == doctest::Approx(0.01));
  CHECK(o.seed == 0x1234);
  CHECK(o.verbose == 1);
  CHECK(options_validate(o).ok());
  auto p = apply({{"KVGC_PREFIX_CHARGE", "prune"}}, &st);  // 0.8
  REQUIRE(st.ok());
  CHECK(p.prefix_charge == KVGC_PREFIX_CHARGE_PRUNE);

  for (auto [v, p] : std::map<std::string, kvgc_policy>{{"generational", KVGC_POLICY_GENERATIONAL},
                                                         {"full", KVGC_POLICY_FULL},
                                                         {"streaming", KVGC_POLICY_STREAMING},
                                                         {"random", KVGC_POLICY_RANDOM}}) {
    o = apply({{"KVGC_POLICY", v}}, &st);
    CHECK(st.ok());
    CHECK(o.policy == p);
  }
  for (auto [v, d] : std::map<std::string, kvgc_demote>{{"off", KVGC_DEMOTE_OFF},
                                                        {"int8", KVGC_DEMOTE_INT8},
                                                        {"int8,int4", KVGC_DEMOTE_LADDER},
                                                        {"int8,int4,int2", KVGC_DEMOTE_LADDER_INT2}}) {
    o = apply({{"KVGC_DEMOTE", v}}, &st);
    CHECK(st.ok());
    CHECK(o.demote == d);
  }
  o = apply({{"KVGC_BYTE_BUDGET", "64K"}, {"KVGC_RECENT_DECAY", "0.9"}}, &st);
  CHECK(st.ok());
  CHECK(o.byte_budget == 64u << 10);
  CHECK(o.byte_budget_fraction == 0);
  CHECK(o.demote == KVGC_DEMOTE_LADDER);  // the full ladder by default (0.4)
  CHECK(o.recent_decay == doctest::Approx(0.9));
  o = apply({{"KVGC_BYTE_BUDGET", "0.125"}}, &st);
  CHECK(st.ok());
  CHECK(o.byte_budget == 0);
  CHECK(o.byte_budget_fraction == doctest::Approx(0.125));
  o = apply({{"KVGC_BYTE_BUDGET", "20%"}}, &st);
  CHECK(st.ok());
  CHECK(o.byte_budget_fraction == doctest::Approx(0.2));
  o = apply({{"KVGC_BYTE_BUDGET", "1000000"}}, &st);
  CHECK(st.ok());
  CHECK(o.byte_budget == 1000000);
  o = apply({{"KVGC_BUDGET", "40%"}}, &st);
  CHECK(st.ok());
  CHECK(o.budget_bytes == 0);
  CHECK(o.budget_fraction == doctest::Approx(0.4));
  o = apply({{"KVGC_BUDGET", "1.5GiB"}}, &st);
  CHECK(o.budget_bytes == 3ull << 29);
  o = apply({{"KVGC_TOKEN_BUDGET", "25%"}}, &st);
  CHECK(o.token_budget_fraction == doctest::Approx(0.25));
  o = apply({{"KVGC_TOKEN_BUDGET", "0.1"}}, &st);
  CHECK(o.token_budget_fraction == doctest::Approx(0.1));
  CHECK(o.token_budget == 0);
  o = apply({{"KVGC_SEED", "18446744073709551615"}}, &st);
  CHECK(st.ok());
  CHECK(o.seed == UINT64_MAX);
  o = apply({{"KVGC_THREADS", "1"}}, &st);
  CHECK(st.ok());
  CHECK(o.cpu_threads == 1);
  o = apply({{"KVGC_THREADS", "256"}}, &st);
  CHECK(o.cpu_threads == 256);
  o = apply({{"KVGC_THREADS", "auto"}}, &st);  // the affinity mask, whatever the host
  CHECK(st.ok());
  cpu_set_t set;
  CPU_ZERO(&set);
  REQUIRE(sched_getaffinity(0, sizeof set, &set) == 0);
  CHECK(o.cpu_threads == uint32_t(std::min(CPU_COUNT(&set), 256)));
}

TEST_CASE("a malformed variable fails, names itself and its forms, and changes nothing") {
  const std::map<std::string, std::string> bad = {
      {"KVGC_DEVICE", "gpu"},          {"KVGC_POLICY", "bogus"},
      {"KVGC_BUDGET", "12Q"},          {"KVGC_BUDGET", "0"},
      {"KVGC_BUDGET", "150%"},         {"KVGC_BUDGET", "-5G"},
      {"KVGC_TOKEN_BUDGET", "1.5"},    {"KVGC_TOKEN_BUDGET", "abc"},
      {"KVGC_TOKEN_BUDGET", "0"},      {"KVGC_SINKS", "-1"},
      {"KVGC_WINDOW", "99999999999"},  {"KVGC_PAGE_TOKENS", "abc"},
      {"KVGC_PAGE_TOKENS", "0"},       {"KVGC_PAGE_TOKENS", "257"},
      {"KVGC_COMPACT_THRESHOLD", "0"}, {"KVGC_COMPACT_THRESHOLD", "nan"},
      {"KVGC_DEMOTE", "int2"},         {"KVGC_LAYER_BUDGET", "triangle"},
      {"KVGC_BYTE_BUDGET", "1.5"},     {"KVGC_RECENT_DECAY", "0"},
      {"KVGC_HARVEST", "later"},       {"KVGC_PREFIX_CHARGE", "tenant"},
      {"KVGC_SCORE_NOISE", "-0.1"},    {"KVGC_SCORE_NOISE", "inf"},
      {"KVGC_SEED", "0xZZ"},           {"KVGC_VERBOSE", "yes"},
      {"KVGC_THREADS", "0"},
  };
  // std::map keeps one value per key: list the extra bad values explicitly too.
  const std::pair<const char*, const char*> more[] = {
      {"KVGC_BUDGET", "0"}, {"KVGC_BUDGET", "150%"}, {"KVGC_PAGE_TOKENS", "257"},
      {"KVGC_TOKEN_BUDGET", "0"}, {"KVGC_SCORE_NOISE", "inf"}, {"KVGC_BUDGET", "1.5"},
      {"KVGC_THREADS", "257"}, {"KVGC_THREADS", "x"}, {"KVGC_THREADS", ""},
      {"KVGC_THREADS", "-1"}, {"KVGC_THREADS", "Auto"},
      {"KVGC_DEMOTE", "int4,int8"}, {"KVGC_DEMOTE", "int8, int4"}, {"KVGC_DEMOTE", ""},
      {"KVGC_BYTE_BUDGET", "0"}, {"KVGC_BYTE_BUDGET", "0%"}, {"KVGC_BYTE_BUDGET", "150%"},
      {"KVGC_BYTE_BUDGET", "-64K"}, {"KVGC_BYTE_BUDGET", "abc"}, {"KVGC_BYTE_BUDGET", "0.0"},
      {"KVGC_RECENT_DECAY", "1.5"}, {"KVGC_RECENT_DECAY", "-0.5"}, {"KVGC_RECENT_DECAY", "nan"}};
  auto expect_bad = [](const std::string& var, const std::string& val) {
    Status st;
    // A good variable applied alongside must not survive the failure either.
    const std::string good = var == "KVGC_SINKS" ? "KVGC_WINDOW" : "KVGC_SINKS";
    kvgc_heap_options o = apply({{good, "7"}, {var, val}}, &st);
    INFO(var << "=" << val);
    CHECK(st.code == KVGC_EINVAL);
    CHECK(st.msg.find(var) != std::string::npos);
    CHECK(st.msg.find("accepted:") != std::string::npos);
    if (var == "KVGC_THREADS") CHECK(st.msg.find("1..256, or auto") != std::string::npos);
    kvgc_heap_options d;
    options_defaults(&d);
    CHECK(o.sinks == d.sinks);
    CHECK(o.window == d.window);
    CHECK(o.cpu_threads == d.cpu_threads);
  };
  for (const auto& [var, val] : bad) expect_bad(var, val);
  for (const auto& [var, val] : more) expect_bad(var, val);
}

TEST_CASE("validate names the field of a bad options struct") {
  kvgc_heap_options o;
  options_defaults(&o);
  o.page_tokens = 0;
  Status st = options_validate(o);
  CHECK(st.code == KVGC_EINVAL);
  CHECK(st.msg.find("opts->page_tokens") != std::string::npos);
  options_defaults(&o);
  kvgc_test::poke_enum(o.policy, 99);
  CHECK(options_validate(o).msg.find("opts->policy") != std::string::npos);
  options_defaults(&o);
  o.token_budget = 10;
  o.token_budget_fraction = 0.5;
  CHECK(options_validate(o).msg.find("token_budget") != std::string::npos);
  options_defaults(&o);
  o.slab_bytes = 1000;
  CHECK(options_validate(o).msg.find("opts->slab_bytes") != std::string::npos);
  o.slab_bytes = 32u << 10;  // below 64 KiB; 0 is the model-sized default
  CHECK(options_validate(o).msg.find("opts->slab_bytes") != std::string::npos);
  o.slab_bytes = 0;
  CHECK(options_validate(o).ok());
  options_defaults(&o);
  kvgc_test::poke_enum(o.harvest, 2);
  CHECK(options_validate(o).msg.find("opts->harvest") != std::string::npos);
  for (uint32_t bad : {0u, 257u}) {
    options_defaults(&o);
    o.cpu_threads = bad;
    CHECK(options_validate(o).code == KVGC_EINVAL);
    CHECK(options_validate(o).msg.find("opts->cpu_threads") != std::string::npos);
  }
}

TEST_CASE("cpu_threads: the field and KVGC_THREADS reach get_options; a 0.2-size struct works") {
  const kvgc_model_desc m = kvgc_test::model(1, 2, 64);
  kvgc_heap_options o = kvgc_test::cpu_options(8 << 20);
  o.cpu_threads = 5;
  kvgc_heap* h = nullptr;
  REQUIRE(kvgc_heap_create(&m, &o, &h) == KVGC_OK);
  kvgc_heap_options got;
  kvgc_heap_options_init(&got);
  REQUIRE(kvgc_heap_get_options(h, &got) == KVGC_OK);
  CHECK(got.cpu_threads == 5);
  kvgc_heap_destroy(h);
  o.flags = 0;  // the environment overrides the field
  setenv("KVGC_THREADS", "3", 1);
  REQUIRE(kvgc_heap_create(&m, &o, &h) == KVGC_OK);
  REQUIRE(kvgc_heap_get_options(h, &got) == KVGC_OK);
  CHECK(got.cpu_threads == 3);
  kvgc_heap_destroy(h);
  setenv("KVGC_THREADS", "", 1);
  CHECK(kvgc_heap_create(&m, &o, &h) == KVGC_EINVAL);
  CHECK(std::string(kvgc_errmsg(nullptr)).find("KVGC_THREADS") != std::string::npos);
  unsetenv("KVGC_THREADS");
  o.cpu_threads = 0;
  CHECK(kvgc_heap_create(&m, &o, &h) == KVGC_EINVAL);
  CHECK(std::string(kvgc_errmsg(nullptr)).find("opts->cpu_threads") != std::string::npos);

  // A caller compiled against 0.2: its struct ends before cpu_threads; the default (1)
  // applies, and get_options writes no byte past the struct it was given.
  static_assert(KVGC_HEAP_OPTIONS_0_2_SIZE < sizeof(kvgc_heap_options));
  o = kvgc_test::cpu_options(8 << 20);
  o.cpu_threads = 77;  // past the old size: must not be read
  o.struct_size = KVGC_HEAP_OPTIONS_0_2_SIZE;
  REQUIRE(kvgc_heap_create(&m, &o, &h) == KVGC_OK);
  kvgc_heap_options old;
  std::memset(&old, 0xAB, sizeof old);
  old.struct_size = KVGC_HEAP_OPTIONS_0_2_SIZE;
  REQUIRE(kvgc_heap_get_options(h, &old) == KVGC_OK);
  CHECK(old.struct_size == KVGC_HEAP_OPTIONS_0_2_SIZE);
  CHECK(old.page_tokens == 16);
  uint32_t untouched;
  std::memcpy(&untouched, &old.cpu_threads, 4);
  CHECK(untouched == 0xABABABABu);
  kvgc_heap_options_init(&got);
  REQUIRE(kvgc_heap_get_options(h, &got) == KVGC_OK);
  CHECK(got.cpu_threads == 1);
  kvgc_heap_destroy(h);
  o.struct_size = KVGC_HEAP_OPTIONS_0_2_SIZE + 4;  // neither size: refused
  CHECK(kvgc_heap_create(&m, &o, &h) == KVGC_EINVAL);
}

TEST_CASE("the real environment reaches kvgc_heap_create, and a bad value fails it") {
  const kvgc_model_desc m = kvgc_test::model(2, 2, 64);
  kvgc_heap_options o;
  kvgc_heap_options_init(&o);
  o.device = KVGC_DEVICE_CPU;
  o.budget_bytes = 8 << 20;
  setenv("KVGC_PAGE_TOKENS", "abc", 1);
  kvgc_heap* h = reinterpret_cast<kvgc_heap*>(0x1);
  CHECK(kvgc_heap_create(&m, &o, &h) == KVGC_EINVAL);
  CHECK(h == nullptr);
  CHECK(std::string(kvgc_errmsg(nullptr)).find("KVGC_PAGE_TOKENS") != std::string::npos);
  // KVGC_OPT_IGNORE_ENV makes the struct final.
  o.flags = KVGC_OPT_IGNORE_ENV;
  REQUIRE(kvgc_heap_create(&m, &o, &h) == KVGC_OK);
  kvgc_heap_destroy(h);
  setenv("KVGC_PAGE_TOKENS", "8", 1);
  setenv("KVGC_POLICY", "streaming", 1);
  o.flags = 0;
  REQUIRE(kvgc_heap_create(&m, &o, &h) == KVGC_OK);
  kvgc_heap_options got;
  kvgc_heap_options_init(&got);
  REQUIRE(kvgc_heap_get_options(h, &got) == KVGC_OK);
  CHECK(got.page_tokens == 8);
  CHECK(got.policy == KVGC_POLICY_STREAMING);
  CHECK(got.device == KVGC_DEVICE_CPU);
  kvgc_heap_destroy(h);
  unsetenv("KVGC_PAGE_TOKENS");
  unsetenv("KVGC_POLICY");
}

TEST_CASE("describe prints every variable") {
  kvgc_heap_options o;
  options_defaults(&o);
  const std::string d = options_describe(o);
  for (const OptionDoc& doc : option_docs()) {
    INFO(doc.env);
    CHECK(d.find(std::string(doc.env) + "=") != std::string::npos);
  }
}
