// kvgc-plan's building blocks: the GGUF reader (on files written here, valid and
// hostile), the JSON reader, model shapes from config.json and GGUF, the plan
// arithmetic against kvgc_kv_bytes (sharing a prefix included), and kvgc-plan itself on
// the command line.
#include <doctest/doctest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "gguf.hpp"
#include "json.hpp"
#include "model_shape.hpp"
#include "plan.hpp"

namespace fs = std::filesystem;
using gguf::ValueType;

namespace {

// A scratch directory, removed with everything in it at scope exit.
struct TempDir {
  fs::path path;
  TempDir() {
    path = fs::temp_directory_path() / ("kvgc_test_plan_" + std::to_string(getpid()));
    fs::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  std::string write(const std::string& name, const std::string& bytes) const {
    const std::string file = (path / name).string();
    std::ofstream(file, std::ios::binary).write(bytes.data(), std::streamsize(bytes.size()));
    return file;
  }
};

// Emits GGUF bytes field by field, little-endian, so tests can also emit broken files.
struct GgufWriter {
  std::string out;

  template <class T>
  GgufWriter& raw(T v) {
    char b[sizeof(T)];
    std::memcpy(b, &v, sizeof(T));
    out.append(b, sizeof(T));
    return *this;
  }
  GgufWriter& str(const std::string& s) {
    raw<uint64_t>(s.size());
    out += s;
    return *this;
  }
  GgufWriter& header(uint32_t version, uint64_t n_tensors, uint64_t n_kv) {
    out += "GGUF";
    return raw(version).raw(n_tensors).raw(n_kv);
  }
  GgufWriter& key(const std::string& k, ValueType t) {
    return str(k).raw(uint32_t(t));
  }
  template <class T>
  GgufWriter& kv(const std::string& k, ValueType t, T v) {
    return key(k, t).raw(v);
  }
  GgufWriter& kv_string(const std::string& k, const std::string& v) {
    return key(k, ValueType::kString).str(v);
  }
  GgufWriter& array_header(ValueType elem, uint64_t count) {
    return raw(uint32_t(elem)).raw(count);
  }
  GgufWriter& tensor(const std::string& name, std::vector<uint64_t> dims, uint32_t type,
                     uint64_t offset) {
    str(name).raw(uint32_t(dims.size()));
    for (uint64_t d : dims) raw(d);
    return raw(type).raw(offset);
  }
  GgufWriter& pad_to(size_t alignment) {
    out.append((alignment - out.size() % alignment) % alignment, '\0');
    return *this;
  }
};

constexpr uint32_t kGgmlF32 = 0, kGgmlF16 = 1;

// Offsets inside the valid file, to truncate it at interesting places.
struct Landmarks {
  size_t after_header, in_tokens_array, after_metadata, after_tensor_infos, data_start;
};

// A small llama-shaped GGUF with every scalar kind, a string array, a nested array and
// two tensors with their data.
std::string valid_gguf(Landmarks* marks = nullptr) {
  GgufWriter w;
  w.header(3, 2, 23);
  Landmarks m{};
  m.after_header = w.out.size();
  w.kv_string("general.architecture", "llama");
  w.kv_string("general.name", "tiny llama");
  w.kv("general.alignment", ValueType::kUInt32, uint32_t(64));
  w.kv("llama.block_count", ValueType::kUInt32, uint32_t(4));
  w.kv("llama.context_length", ValueType::kUInt32, uint32_t(2048));
  w.kv("llama.embedding_length", ValueType::kUInt32, uint32_t(256));
  w.kv("llama.attention.head_count", ValueType::kUInt32, uint32_t(8));
  w.kv("llama.attention.head_count_kv", ValueType::kUInt32, uint32_t(2));
  w.kv("test.u8", ValueType::kUInt8, uint8_t(200));
  w.kv("test.i8", ValueType::kInt8, int8_t(-100));
  w.kv("test.u16", ValueType::kUInt16, uint16_t(60000));
  w.kv("test.i16", ValueType::kInt16, int16_t(-30000));
  w.kv("test.i32", ValueType::kInt32, int32_t(-2000000000));
  w.kv("test.f32", ValueType::kFloat32, 0.5f);
  w.kv("test.bool", ValueType::kBool, uint8_t(1));
  w.kv("test.u64", ValueType::kUInt64, uint64_t(1) << 63);
  w.kv("test.i64", ValueType::kInt64, int64_t(-(int64_t(1) << 40)));
  w.kv("test.f64", ValueType::kFloat64, 1e300);
  w.kv_string("test.empty", "");
  w.key("tokenizer.ggml.tokens", ValueType::kArray).array_header(ValueType::kString, 4);
  w.str("<s>").str("hello");
  m.in_tokens_array = w.out.size();
  w.str("").str("\xE2\x96\x81world");
  w.key("test.nested", ValueType::kArray).array_header(ValueType::kArray, 2);
  w.array_header(ValueType::kInt32, 2).raw(int32_t(1)).raw(int32_t(-2));
  w.array_header(ValueType::kInt32, 1).raw(int32_t(3));
  w.key("test.floats", ValueType::kArray).array_header(ValueType::kFloat32, 2);
  w.raw(1.5f).raw(-2.25f);
  w.key("test.u16s", ValueType::kArray).array_header(ValueType::kUInt16, 3);
  w.raw(uint16_t(1)).raw(uint16_t(2)).raw(uint16_t(65535));
  m.after_metadata = w.out.size();
  w.tensor("token_embd.weight", {32, 4}, kGgmlF32, 0);   // 512 bytes at 0
  w.tensor("blk.0.attn_k.weight", {32, 2}, kGgmlF16, 512);  // 128 bytes at 512
  m.after_tensor_infos = w.out.size();
  w.pad_to(64);
  m.data_start = w.out.size();
  for (int i = 0; i < 512 + 128; ++i) w.out.push_back(char(i & 0x7f));
  if (marks) *marks = m;
  return w.out;
}

// Opens `bytes` as a GGUF file; returns the error ("" on success).
std::string open_error(const TempDir& dir, const std::string& bytes) {
  gguf::File f;
  std::string err;
  const bool ok = f.open(dir.write("case.gguf", bytes), &err);
  CHECK(ok == err.empty());
  CHECK(ok == f.is_open());
  return ok ? "" : err;
}

std::string samples_dir() {
#ifdef KVGC_PLAN_SAMPLES_DIR
  if (fs::is_directory(KVGC_PLAN_SAMPLES_DIR)) return KVGC_PLAN_SAMPLES_DIR;
#endif
  const fs::path here = fs::path(__FILE__).parent_path();
  for (const fs::path& p : {here / ".." / "tools" / "samples", fs::path("tools/samples"),
                            fs::path("../tools/samples")})
    if (fs::is_directory(p)) return p.string();
  return "tools/samples";
}

// kvgc-plan: $KVGC_PLAN_EXE, else the one built beside this test (build/tools/), else "".
std::string plan_exe() {
  if (const char* env = std::getenv("KVGC_PLAN_EXE")) return env;
  std::error_code ec;
  const fs::path self = fs::read_symlink("/proc/self/exe", ec);
  if (ec) return "";
  const fs::path exe = self.parent_path().parent_path() / "tools" / "kvgc-plan";
  return fs::exists(exe, ec) ? exe.string() : "";
}

// kvgc-plan run with `args`: its exit status, its stdout and stderr in *output.
int run_plan(const std::string& exe, const std::string& args, std::string* output) {
  output->clear();
  FILE* pipe = popen(("'" + exe + "' " + args + " 2>&1").c_str(), "r");
  REQUIRE(pipe != nullptr);
  char buffer[4096];
  size_t got = 0;
  while ((got = fread(buffer, 1, sizeof buffer, pipe)) > 0) output->append(buffer, got);
  const int status = pclose(pipe);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

kvgc_tools::ModelShape load_sample(const std::string& file) {
  kvgc_tools::ModelShape s;
  std::string err;
  INFO(err);
  REQUIRE(kvgc_tools::load_config_shape(samples_dir() + "/" + file, &s, &err));
  return s;
}

}  // namespace

TEST_CASE("gguf: reads back every metadata kind, arrays and tensor infos") {
  TempDir dir;
  Landmarks m;
  const std::string bytes = valid_gguf(&m);
  gguf::File f;
  std::string err;
  REQUIRE_MESSAGE(f.open(dir.write("tiny.gguf", bytes), &err), err);

  CHECK(f.version() == 3);
  CHECK(f.file_size() == bytes.size());
  CHECK(f.alignment() == 64);
  CHECK(f.data_offset() == m.data_start);
  CHECK(f.metadata().size() == 23);
  CHECK(f.metadata()[0].key == "general.architecture");

  CHECK(f.get_string("general.architecture") == "llama");
  CHECK(f.get_string("general.name") == "tiny llama");
  CHECK(f.get_string("test.empty") == "");
  CHECK(f.get_uint("llama.block_count") == 4u);
  CHECK(f.get_uint("test.u8") == 200u);
  CHECK(f.get_int("test.i8") == -100);
  CHECK(f.get_uint("test.u16") == 60000u);
  CHECK(f.get_int("test.i16") == -30000);
  CHECK(f.get_int("test.i32") == -2000000000);
  CHECK(f.get_float("test.f32") == 0.5);
  CHECK(f.get_bool("test.bool") == true);
  CHECK(f.get_uint("test.u64") == uint64_t(1) << 63);
  CHECK(f.get_int("test.i64") == -(int64_t(1) << 40));
  CHECK(f.get_float("test.f64") == 1e300);
  CHECK(f.find("test.i32")->type == ValueType::kInt32);

  // Wrong-kind and out-of-range conversions are refused, missing keys are nullopt.
  CHECK_FALSE(f.get_uint("test.i8"));
  CHECK_FALSE(f.get_int("test.u64"));
  CHECK_FALSE(f.get_string("llama.block_count"));
  CHECK_FALSE(f.get_bool("test.u8"));
  CHECK_FALSE(f.get_uint("no.such.key"));
  CHECK(f.find("no.such.key") == nullptr);

  const auto tokens = f.get_array("tokenizer.ggml.tokens");
  REQUIRE(tokens);
  CHECK(tokens->elem_type == ValueType::kString);
  CHECK(tokens->count == 4);
  CHECK(f.strings(*tokens) == std::vector<std::string>{"<s>", "hello", "", "\xE2\x96\x81world"});
  CHECK_FALSE(f.ints(*tokens));

  const auto nested = f.get_array("test.nested");
  REQUIRE(nested);
  const auto inner = f.arrays(*nested);
  REQUIRE(inner);
  REQUIRE(inner->size() == 2);
  CHECK(f.ints((*inner)[0]) == std::vector<int64_t>{1, -2});
  CHECK(f.ints((*inner)[1]) == std::vector<int64_t>{3});

  CHECK(f.floats(*f.get_array("test.floats")) == std::vector<double>{1.5, -2.25});
  CHECK(f.ints(*f.get_array("test.u16s")) == std::vector<int64_t>{1, 2, 65535});
  CHECK_FALSE(f.strings(*f.get_array("test.floats")));

  REQUIRE(f.tensors().size() == 2);
  const gguf::TensorInfo& embd = f.tensors()[0];
  CHECK(embd.name == "token_embd.weight");
  CHECK(embd.dims == std::vector<uint64_t>{32, 4});
  CHECK(embd.ggml_type == kGgmlF32);
  CHECK(embd.offset == 0);
  CHECK(embd.n_elements == 128);
  CHECK(embd.n_bytes == 512u);
  const gguf::TensorInfo* k = f.find_tensor("blk.0.attn_k.weight");
  REQUIRE(k);
  CHECK(k->ggml_type == kGgmlF16);
  CHECK(gguf::ggml_type_name(k->ggml_type) == "F16");
  CHECK(k->offset == 512);
  CHECK(k->n_bytes == 128u);
  CHECK(f.tensor_data(*k) == f.tensor_data(embd) + 512);
  CHECK(f.tensor_data(embd)[5] == 5);
  CHECK(f.find_tensor("missing") == nullptr);

  // Moving keeps the mapping alive; the moved-from file is closed.
  gguf::File moved = std::move(f);
  CHECK(moved.is_open());
  CHECK_FALSE(f.is_open());
  CHECK(moved.get_string("general.name") == "tiny llama");
}

TEST_CASE("gguf: version 2 files and files without tensors are accepted") {
  TempDir dir;
  GgufWriter w;
  w.header(2, 0, 1).kv_string("general.architecture", "llama");
  gguf::File f;
  std::string err;
  REQUIRE_MESSAGE(f.open(dir.write("v2.gguf", w.out), &err), err);
  CHECK(f.version() == 2);
  CHECK(f.tensors().empty());
  CHECK(f.data_offset() % 32 == 0);
}

TEST_CASE("gguf: malformed files are rejected with a message") {
  TempDir dir;
  Landmarks m;
  const std::string good = valid_gguf(&m);

  SUBCASE("missing file") {
    gguf::File f;
    std::string err;
    CHECK_FALSE(f.open((dir.path / "absent.gguf").string(), &err));
    CHECK(err.find("absent.gguf") != std::string::npos);
  }
  SUBCASE("bad magic") {
    std::string bad = good;
    bad[3] = 'X';
    CHECK(open_error(dir, bad).find("bad magic") != std::string::npos);
    CHECK(open_error(dir, "{\"not\": \"gguf\"}").find("bad magic") != std::string::npos);
  }
  SUBCASE("version 1 and unknown versions") {
    GgufWriter w;
    w.header(1, 0, 0);
    CHECK(open_error(dir, w.out).find("version 1") != std::string::npos);
    GgufWriter v4;
    v4.header(4, 0, 0);
    CHECK(open_error(dir, v4.out).find("version 4") != std::string::npos);
    GgufWriter big_endian;
    big_endian.header(0x03000000, 0, 0);
    CHECK(open_error(dir, big_endian.out).find("big-endian") != std::string::npos);
  }
  SUBCASE("truncated at landmarks") {
    for (size_t cut : {size_t(0), size_t(3), size_t(10), m.after_header, m.after_header + 5,
                       m.in_tokens_array, m.after_metadata, m.after_metadata + 9,
                       m.after_tensor_infos, m.data_start, good.size() - 1}) {
      CAPTURE(cut);
      const std::string err = open_error(dir, good.substr(0, cut));
      CHECK_FALSE(err.empty());
    }
    CHECK(open_error(dir, good.substr(0, good.size() - 1)).find("extends past the end") !=
          std::string::npos);
    CHECK(open_error(dir, good.substr(0, 10)).find("truncated") != std::string::npos);
    CHECK(open_error(dir, good.substr(0, m.after_header + 5)).find("metadata pairs") !=
          std::string::npos);
  }
  SUBCASE("every truncation fails, none crashes") {
    for (size_t cut = 0; cut < good.size(); ++cut) {
      CAPTURE(cut);
      CHECK_FALSE(open_error(dir, good.substr(0, cut)).empty());
    }
  }
  SUBCASE("huge string length") {
    GgufWriter w;
    w.header(3, 0, 1).raw(uint64_t(1) << 62).out += "general.name";
    CHECK(open_error(dir, w.out).find("more than the 65535 bytes allowed") != std::string::npos);
    // A key as long as the file: refused before it is copied, and never quoted whole.
    GgufWriter k;
    k.header(3, 0, 1).raw(uint64_t(1) << 20).out += std::string(1 << 20, 'k');
    const std::string kerr = open_error(dir, k.out);
    CHECK(kerr.find("metadata key at byte 24 has length 1048576, more than") != std::string::npos);
    CHECK(kerr.size() < 300);
    GgufWriter d;  // a duplicate 60 KiB key: quoted cut
    d.header(3, 0, 2).key(std::string(60000, 'a'), ValueType::kUInt8).raw(uint8_t(1));
    d.key(std::string(60000, 'a'), ValueType::kUInt8).raw(uint8_t(1));
    const std::string derr = open_error(dir, d.out);
    CHECK(derr.find("duplicate metadata key \"aaaa") != std::string::npos);
    CHECK(derr.size() < 300);
    GgufWriter v;
    v.header(3, 0, 1).key("general.name", ValueType::kString).raw(~uint64_t(0));
    CHECK(open_error(dir, v.out).find("length") != std::string::npos);
  }
  SUBCASE("huge array counts") {
    GgufWriter w;
    w.header(3, 0, 1).key("tokenizer.ggml.tokens", ValueType::kArray);
    w.array_header(ValueType::kString, uint64_t(1) << 60).str("a");
    CHECK(open_error(dir, w.out).find("array count") != std::string::npos);
    GgufWriter u;
    u.header(3, 0, 1).key("x", ValueType::kArray).array_header(ValueType::kUInt64, ~uint64_t(0));
    CHECK(open_error(dir, u.out).find("array count") != std::string::npos);
  }
  SUBCASE("huge header counts") {
    GgufWriter w;
    w.header(3, 0, uint64_t(1) << 40).kv_string("a", "b");
    CHECK(open_error(dir, w.out).find("metadata pairs") != std::string::npos);
    GgufWriter t;
    t.header(3, uint64_t(1) << 40, 0).tensor("x", {1}, kGgmlF32, 0);
    CHECK(open_error(dir, t.out).find("tensors") != std::string::npos);
  }
  SUBCASE("arrays nested too deep") {
    GgufWriter w;
    w.header(3, 0, 1).key("deep", ValueType::kArray);
    for (int i = 0; i < 100; ++i) w.array_header(ValueType::kArray, 1);
    w.array_header(ValueType::kUInt8, 0);
    CHECK(open_error(dir, w.out).find("nested deeper") != std::string::npos);
  }
  SUBCASE("unknown value type, duplicate key, bad alignment") {
    GgufWriter w;
    w.header(3, 0, 1).key("x", ValueType(13)).raw(uint32_t(0));
    CHECK(open_error(dir, w.out).find("unknown value type 13") != std::string::npos);
    GgufWriter d;
    d.header(3, 0, 2).kv_string("a", "1").kv_string("a", "2");
    CHECK(open_error(dir, d.out).find("duplicate metadata key") != std::string::npos);
    GgufWriter a;
    a.header(3, 0, 1).kv("general.alignment", ValueType::kUInt32, uint32_t(48));
    CHECK(open_error(dir, a.out).find("general.alignment") != std::string::npos);
  }
  SUBCASE("bad tensor infos") {
    GgufWriter dims;
    dims.header(3, 1, 0).tensor("t", {1, 1, 1, 1, 1}, kGgmlF32, 0);
    CHECK(open_error(dir, dims.out).find("dimensions") != std::string::npos);
    GgufWriter offset;
    offset.header(3, 1, 0).tensor("t", {1}, kGgmlF32, 4).pad_to(32).out += std::string(64, 0);
    CHECK(open_error(dir, offset.out).find("alignment") != std::string::npos);
    GgufWriter overflow;
    overflow.header(3, 1, 0).tensor("t", {uint64_t(1) << 40, uint64_t(1) << 40}, kGgmlF32, 0);
    CHECK(open_error(dir, overflow.out).find("overflows") != std::string::npos);
    GgufWriter dup;
    dup.header(3, 2, 0).tensor("t", {1}, kGgmlF32, 0).tensor("t", {1}, kGgmlF32, 32);
    dup.pad_to(32).out += std::string(64, 0);
    CHECK(open_error(dir, dup.out).find("duplicate tensor") != std::string::npos);
  }
  SUBCASE("random corruption never crashes") {
    std::mt19937 rng(12345);
    for (int trial = 0; trial < 300; ++trial) {
      std::string bad = good;
      for (int flips = 0; flips < 4; ++flips)
        bad[rng() % m.data_start] = char(rng());  // corrupt header, metadata, tensor infos
      gguf::File f;
      std::string err;
      if (!f.open(dir.write("fuzz.gguf", bad), &err)) CHECK_FALSE(err.empty());
    }
  }
}

TEST_CASE("json: the wanted members are read, values, escapes and numbers") {
  json::Document d;
  std::string err;
  const char* doc = R"( {"a": {"b": [1, {"x": 5}], "n": -2.5, "e": 3e2, "z": -0.0},
      "s": "q\"\\\/\b\f\n\r\t\u00e9\u20ac\ud83d\ude00",
      "t": true, "f": false, "n": null, "empty": {}, "list": [{"s": 1}],
      "big": 12345678901234567890, "dup": 1, "dup": 2} )";
  const std::vector<json::Path> want = {{"a"},   {"a", "n"}, {"a", "e"}, {"a", "z"}, {"a", "b"},
                                        {"s"},   {"t"},      {"f"},      {"n"},      {"empty"},
                                        {"list"}, {"big"},   {"dup"},    {"missing"}, {"x"}};
  REQUIRE_MESSAGE(json::parse(doc, want, &d, &err), err);
  CHECK(d.root == json::Value::Kind::kObject);
  CHECK(d.members.size() == 13);  // "dup" once; "missing" and "x" (nested deeper) absent
  CHECK(d.find({"a"})->is_object());
  CHECK(d.find({"a", "b"})->kind == json::Value::Kind::kArray);
  CHECK(d.find({"a", "n"})->as_number() == -2.5);
  CHECK_FALSE(d.find({"a", "n"})->as_int());
  CHECK(d.find({"a", "e"})->as_int() == 300);  // whole number written with an exponent
  CHECK(std::signbit(*d.find({"a", "z"})->as_number()));
  CHECK(*d.find({"s"})->as_string() == "q\"\\/\b\f\n\r\t\xC3\xA9\xE2\x82\xAC\xF0\x9F\x98\x80");
  CHECK(d.find({"t"})->as_bool() == true);
  CHECK(d.find({"f"})->as_bool() == false);
  CHECK(d.find({"n"})->is_null());
  CHECK(d.find({"empty"})->is_object());
  CHECK(d.find({"big"})->as_number() == doctest::Approx(1.2345678901234567e19));
  CHECK_FALSE(d.find({"big"})->as_int());  // beyond int64: a double only
  CHECK(d.find({"dup"})->as_int() == 2);   // the last one wins, as in Python
  CHECK(d.find({"missing"}) == nullptr);
  CHECK(d.find({"x"}) == nullptr);  // {"x": 5} sits in an array, not under the root
  CHECK_FALSE(d.find({"s"})->as_number());

  REQUIRE(json::parse("  \"top\"\n", want, &d, &err));
  CHECK(d.root == json::Value::Kind::kString);
  CHECK(d.members.empty());
}

TEST_CASE("json: malformed input is rejected with a position") {
  const char* bad[] = {
      "",       "{",         "{\"a\" 1}",   "{\"a\": 1,}",   "[1, 2",     "[1 2]",
      "01",     "1.",        ".5",          "1e",            "-",         "+1",
      "nul",    "True",      "\"abc",       "\"\\x\"",       "\"\\u12\"", "\"\\ud800\"",
      "\"\\udc00\"", "\"a\nb\"", "{1: 2}",  "[1] [2]",       "NaN",       "1e999",
      "{\"a\": }", "\"\xff\"", "// c\n{}", "[1,]",
  };
  for (const char* text : bad) {
    CAPTURE(text);
    json::Document d;
    std::string err;
    CHECK_FALSE(json::parse(text, {{"a"}}, &d, &err));
    CHECK(err.find("line ") == 0);
  }
  std::string err;
  json::Document d;
  CHECK_FALSE(json::parse("{\n  \"a\": [1,\n  oops]}", {{"a"}}, &d, &err));
  CHECK(err.find("line 3, column 3") == 0);
  CHECK_FALSE(json::parse(std::string(100000, '['), {{"a"}}, &d, &err));
  CHECK(err.find("nested deeper") != std::string::npos);
  CHECK(err.find("line 1, column 51") == 0);
}

TEST_CASE("model_shape: the sample config.json files") {
  const kvgc_tools::ModelShape smol = load_sample("SmolLM2-135M-Instruct.json");
  CHECK(smol.name == "SmolLM2-135M-Instruct");
  CHECK(smol.architecture == "llama");
  CHECK(smol.desc.n_layers == 30);
  CHECK(smol.desc.n_q_heads == 9);
  CHECK(smol.desc.n_kv_heads == 3);
  CHECK(smol.desc.head_dim == 64);
  CHECK(smol.desc.dtype == KVGC_DTYPE_BF16);
  CHECK(smol.hidden_size == 576);
  CHECK(smol.context_length == 8192);

  const kvgc_tools::ModelShape llama = load_sample("Llama-3.1-8B.json");
  CHECK(llama.desc.n_layers == 32);
  CHECK(llama.desc.n_q_heads == 32);
  CHECK(llama.desc.n_kv_heads == 8);
  CHECK(llama.desc.head_dim == 128);  // hidden_size / heads: no head_dim key
  CHECK(llama.context_length == 131072);

  const kvgc_tools::ModelShape qwen = load_sample("Qwen2.5-7B.json");
  CHECK(qwen.architecture == "qwen2");
  CHECK(qwen.desc.n_layers == 28);
  CHECK(qwen.desc.n_kv_heads == 4);
  CHECK(qwen.desc.head_dim == 128);
  CHECK(qwen.desc.dtype == KVGC_DTYPE_BF16);
  CHECK(qwen.context_length == 32768);
}

TEST_CASE("model_shape: config.json defaults, names and errors") {
  const auto shape = [](const char* text, kvgc_tools::ModelShape* s, std::string* err) {
    return kvgc_tools::shape_from_config_text(text, "fallback", s, err);
  };
  kvgc_tools::ModelShape s;
  std::string err;
  REQUIRE(shape(R"({"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64,
                    "num_key_value_heads": null, "torch_dtype": "float32",
                    "_name_or_path": "org/model"})", &s, &err));
  CHECK(s.desc.n_kv_heads == 4);
  CHECK(s.desc.head_dim == 16);
  CHECK(s.desc.dtype == KVGC_DTYPE_F32);
  CHECK(s.name == "org/model");
  CHECK(s.context_length == 0);

  REQUIRE(shape(R"({"text_config": {"num_hidden_layers": 3, "num_attention_heads": 2,
                    "head_dim": 8, "dtype": "float16"}})", &s, &err));
  CHECK(s.desc.n_layers == 3);
  CHECK(s.desc.dtype == KVGC_DTYPE_F16);
  CHECK(s.name == "fallback");

  CHECK_FALSE(shape(R"({"num_attention_heads": 4, "hidden_size": 64})", &s, &err));
  CHECK(err.find("num_hidden_layers") != std::string::npos);
  CHECK_FALSE(shape(R"({"num_hidden_layers": 2, "num_attention_heads": 4})", &s, &err));
  CHECK(err.find("hidden_size") != std::string::npos);
  CHECK_FALSE(shape(R"({"num_hidden_layers": "2", "num_attention_heads": 4, "head_dim": 8})",
                    &s, &err));
  CHECK(err.find("must be an integer") != std::string::npos);
  CHECK_FALSE(shape(R"({"num_hidden_layers": -1, "num_attention_heads": 4, "head_dim": 8})",
                    &s, &err));
  CHECK(err.find("positive") != std::string::npos);
  // kvgc's own limits: q heads must be a multiple of kv heads, head_dim even.
  CHECK_FALSE(shape(R"({"num_hidden_layers": 2, "num_attention_heads": 6,
                        "num_key_value_heads": 4, "head_dim": 8})", &s, &err));
  CHECK(err.find("n_q_heads") != std::string::npos);
  CHECK_FALSE(shape(R"({"num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 7})",
                    &s, &err));
  CHECK(err.find("head_dim") != std::string::npos);
  CHECK_FALSE(shape("[]", &s, &err));
  // A negative context length was accepted silently (and reported as unknown).
  CHECK_FALSE(shape(R"({"num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 8,
                        "max_position_embeddings": -5})", &s, &err));
  CHECK(err.find("\"max_position_embeddings\" is -5") != std::string::npos);
  REQUIRE(shape(R"({"num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 8,
                    "max_position_embeddings": null})", &s, &err));
  CHECK(s.context_length == 0);

  CHECK(kvgc_tools::name_from_path("/models/Llama-3.1-8B/config.json") == "Llama-3.1-8B");
  CHECK(kvgc_tools::name_from_path("samples/Qwen2.5-7B.json") == "Qwen2.5-7B");

  TempDir dir;
  CHECK_FALSE(kvgc_tools::load_config_shape(dir.write("bad.json", "{\"a\": tru}"), &s, &err));
  CHECK(err.find("bad.json: line 1") != std::string::npos);
  // Not a regular file: said so, not "unexpected end of input" (which /dev/zero's zero
  // size gave).
  CHECK_FALSE(kvgc_tools::load_config_shape("/dev/zero", &s, &err));
  CHECK(err == "/dev/zero: not a regular file (a config.json must be one: devices and pipes "
               "are not read)");
  CHECK_FALSE(kvgc_tools::load_config_shape(dir.write("empty.json", ""), &s, &err));
  CHECK(err.find("empty file") != std::string::npos);
  CHECK_FALSE(kvgc_tools::load_config_shape(dir.write("nul.json", std::string(64, '\0')), &s, &err));
  CHECK(err.find("nul.json: line 1, column 1: ") != std::string::npos);
}

TEST_CASE("model_shape: GGUF llama metadata") {
  TempDir dir;
  kvgc_tools::ModelShape s;
  std::string err;
  REQUIRE_MESSAGE(kvgc_tools::load_gguf_shape(dir.write("tiny.gguf", valid_gguf()), &s, &err),
                  err);
  CHECK(s.name == "tiny llama");
  CHECK(s.architecture == "llama");
  CHECK(s.desc.n_layers == 4);
  CHECK(s.desc.n_q_heads == 8);
  CHECK(s.desc.n_kv_heads == 2);
  CHECK(s.desc.head_dim == 32);  // embedding_length / head_count
  CHECK(s.desc.dtype == KVGC_DTYPE_F16);
  CHECK(s.hidden_size == 256);
  CHECK(s.context_length == 2048);

  // key_length wins over embedding / heads; head_count_kv defaults to head_count.
  GgufWriter w;
  w.header(3, 0, 4).kv_string("general.architecture", "qwen3");
  w.kv("qwen3.block_count", ValueType::kUInt32, uint32_t(36));
  w.kv("qwen3.attention.head_count", ValueType::kUInt32, uint32_t(32));
  w.kv("qwen3.attention.key_length", ValueType::kUInt32, uint32_t(128));
  REQUIRE_MESSAGE(kvgc_tools::load_gguf_shape(dir.write("Qwen3-8B.gguf", w.out), &s, &err), err);
  CHECK(s.name == "Qwen3-8B");
  CHECK(s.desc.n_kv_heads == 32);
  CHECK(s.desc.head_dim == 128);
  CHECK(s.context_length == 0);

  GgufWriter missing;
  missing.header(3, 0, 1).kv_string("general.architecture", "llama");
  CHECK_FALSE(kvgc_tools::load_gguf_shape(dir.write("m.gguf", missing.out), &s, &err));
  CHECK(err.find("llama.block_count") != std::string::npos);

  GgufWriter mla;
  mla.header(3, 0, 5).kv_string("general.architecture", "deepseek2");
  mla.kv("deepseek2.block_count", ValueType::kUInt32, uint32_t(2));
  mla.kv("deepseek2.attention.head_count", ValueType::kUInt32, uint32_t(16));
  mla.kv("deepseek2.attention.key_length", ValueType::kUInt32, uint32_t(192));
  mla.kv("deepseek2.attention.value_length", ValueType::kUInt32, uint32_t(128));
  CHECK_FALSE(kvgc_tools::load_gguf_shape(dir.write("mla.gguf", mla.out), &s, &err));
  CHECK(err.find("differ") != std::string::npos);

  CHECK_FALSE(kvgc_tools::load_gguf_shape((dir.path / "none.gguf").string(), &s, &err));
  CHECK(err.find("none.gguf") != std::string::npos);
}

TEST_CASE("plan: bytes per token and the full-cache table match kvgc_kv_bytes") {
  kvgc_tools::PlanParams p;
  p.model = load_sample("SmolLM2-135M-Instruct.json").desc;
  p.contexts = {1, 1024, 8192};
  p.batches = {1, 8};
  kvgc_tools::Plan plan;
  std::string err;
  REQUIRE_MESSAGE(kvgc_tools::make_plan(p, &plan, &err), err);

  CHECK(plan.cost.raw_model == 2u * 30 * 3 * 64 * 2);  // 23040
  CHECK(plan.cost.raw_model == 23040u);
  // int4: 32 bytes of nibbles + a half2 scale/zero per 32-element group, per head.
  CHECK(plan.cost.raw_int4 == 2u * 30 * 3 * (32 + 4 * 2));
  CHECK(plan.cost.paged_model >= plan.cost.raw_model);
  CHECK(plan.cost.paged_int4 >= plan.cost.raw_int4);
  CHECK(plan.cost.paged_int4 < plan.cost.paged_model);

  uint64_t page = 0;
  REQUIRE(kvgc_kv_bytes(&p.model, 16, KVGC_CLASS_FP16, 16, &page) == KVGC_OK);
  CHECK(plan.cost.page_model == page);
  CHECK(plan.cost.paged_model == doctest::Approx(double(page) / 16));

  // One token still takes a whole page in every layer.
  CHECK(plan.full_cache_bytes[0][0] == page);
  CHECK(plan.full_cache_bytes[1][0] == page * 1024 / 16);
  CHECK(plan.full_cache_bytes[2][1] == 8 * page * 8192 / 16);
}

TEST_CASE("plan: fits are consistent across modes and batches") {
  kvgc_tools::PlanParams p;
  p.model = load_sample("Llama-3.1-8B.json").desc;
  p.budget_bytes = uint64_t(24) << 30;
  p.contexts = {4096};
  p.batches = {1, 8, 32};
  kvgc_tools::Plan plan;
  std::string err;
  REQUIRE_MESSAGE(kvgc_tools::make_plan(p, &plan, &err), err);
  REQUIRE(plan.fits.size() == 3);
  const kvgc_tools::Fit& full = plan.fits[0];
  const kvgc_tools::Fit& evict = plan.fits[1];
  const kvgc_tools::Fit& int4 = plan.fits[2];

  // Llama-3.1-8B: 128 KiB of bf16 K/V per token; 24 GiB holds ~190K tokens in pages.
  CHECK(plan.cost.raw_model == 131072u);
  CHECK(full.total_tokens == p.budget_bytes / plan.cost.page_model * p.page_tokens);
  CHECK(full.total_tokens == 195840);
  CHECK(full.max_context_batch1 == full.max_context[0]);
  CHECK(full.max_context_batch1 == full.total_tokens);  // whole pages, every token kept

  // Keeping a quarter covers four times the context; demoting half of it to int4 more.
  CHECK(evict.total_tokens == uint64_t(full.total_tokens / p.keep));
  CHECK(double(evict.max_context_batch1) ==
        doctest::Approx(full.max_context_batch1 / p.keep).epsilon(1e-3));
  const double int4_gain =
      plan.cost.paged_model /
      ((1 - p.demote) * plan.cost.paged_model + p.demote * plan.cost.paged_int4);
  CHECK(int4_gain > 1.4);
  CHECK(double(int4.total_tokens) ==
        doctest::Approx(evict.total_tokens * int4_gain).epsilon(1e-4));
  CHECK(double(int4.max_context_batch1) ==
        doctest::Approx(evict.max_context_batch1 * int4_gain).epsilon(1e-3));

  for (const kvgc_tools::Fit& fit : plan.fits) {
    const kvgc_tools::FitMode mode = fit.mode;
    for (size_t j = 0; j < p.batches.size(); ++j) {
      const uint64_t batch = p.batches[j], ctx = fit.max_context[j];
      CAPTURE(batch);
      // The fit is exact: it fits, one more token does not.
      CHECK(batch * kvgc_tools::sequence_bytes(p, mode, ctx) <= p.budget_bytes);
      CHECK(batch * kvgc_tools::sequence_bytes(p, mode, ctx + 1) > p.budget_bytes);
      // A batch of b sequences gets 1/b of the single-sequence context, less what each
      // sequence's partly filled tail pages (one per storage class) cost.
      const double kept_share = mode == kvgc_tools::FitMode::kFull ? 1 : p.keep;
      const double tail_pages = 2.0 * p.page_tokens / kept_share;
      CHECK(ctx * batch <= fit.max_context_batch1);
      CHECK(double(fit.max_context_batch1 - ctx * batch) <= batch * tail_pages);
    }
  }

  CHECK(kvgc_tools::kept_tokens(p, kvgc_tools::FitMode::kEvict, 1000) == 250);
  CHECK(kvgc_tools::kept_tokens(p, kvgc_tools::FitMode::kEvict, 1) == 1);
  CHECK(kvgc_tools::int4_tokens(p, kvgc_tools::FitMode::kEvictInt4, 1000) == 125);
  CHECK(kvgc_tools::int4_tokens(p, kvgc_tools::FitMode::kEvict, 1000) == 0);

  // sequence_bytes is kept_bytes of the kept and int4 counts; kept_bytes is whole pages
  // of each class, by kvgc_kv_bytes.
  const auto class_bytes = [&](uint64_t tokens, kvgc_storage_class cls) {
    uint64_t b = 0;
    REQUIRE(kvgc_kv_bytes(&p.model, tokens, cls, p.page_tokens, &b) == KVGC_OK);
    return b;
  };
  for (kvgc_tools::FitMode mode : kvgc_tools::kFitModes)
    for (uint64_t ctx : {1, 17, 1000, 4099}) {
      CAPTURE(ctx);
      CHECK(kvgc_tools::sequence_bytes(p, mode, ctx) ==
            kvgc_tools::kept_bytes(p, kvgc_tools::kept_tokens(p, mode, ctx),
                                   kvgc_tools::int4_tokens(p, mode, ctx)));
    }
  CHECK(kvgc_tools::kept_bytes(p, 0, 0) == 0);
  CHECK(kvgc_tools::kept_bytes(p, 505, 0) == class_bytes(505, KVGC_CLASS_FP16));
  CHECK(kvgc_tools::kept_bytes(p, 505, 252) ==
        class_bytes(253, KVGC_CLASS_FP16) + class_bytes(252, KVGC_CLASS_INT4));
  CHECK(kvgc_tools::kept_bytes(p, 505, 505) == class_bytes(505, KVGC_CLASS_INT4));
  CHECK(kvgc_tools::kept_bytes(p, 505, 600) == class_bytes(505, KVGC_CLASS_INT4));
  // Past kvgc_kv_bytes' 2^40 tokens: too big.
  CHECK(kvgc_tools::kept_bytes(p, (uint64_t(1) << 40) + 1, 0) == UINT64_MAX);
  CHECK(kvgc_tools::kept_bytes(p, UINT64_MAX, UINT64_MAX) == UINT64_MAX);

  // A budget below one page (in every layer) of either class fits nothing.
  p.budget_bytes = plan.cost.page_int4 - 1;
  REQUIRE(kvgc_tools::make_plan(p, &plan, &err));
  for (const kvgc_tools::Fit& fit : plan.fits) {
    CHECK(fit.total_tokens == 0);
    CHECK(fit.max_context_batch1 == 0);
  }
}

TEST_CASE("plan: bad parameters are refused with a message") {
  kvgc_tools::PlanParams p;
  p.model = load_sample("Qwen2.5-7B.json").desc;
  p.contexts = {1024};
  p.batches = {1};
  kvgc_tools::Plan plan;
  std::string err;
  REQUIRE(kvgc_tools::make_plan(p, &plan, &err));

  kvgc_tools::PlanParams bad = p;
  bad.page_tokens = 257;
  CHECK_FALSE(kvgc_tools::make_plan(bad, &plan, &err));
  CHECK(err.find("page_tokens") != std::string::npos);
  bad = p;
  bad.keep = 0;
  CHECK_FALSE(kvgc_tools::make_plan(bad, &plan, &err));
  CHECK(err.find("keep") != std::string::npos);
  bad = p;
  bad.demote = 1.5;
  CHECK_FALSE(kvgc_tools::make_plan(bad, &plan, &err));
  bad = p;
  bad.budget_bytes = kvgc_tools::kMaxBudgetBytes + 1;
  CHECK_FALSE(kvgc_tools::make_plan(bad, &plan, &err));
  bad = p;
  bad.batches = {};
  CHECK_FALSE(kvgc_tools::make_plan(bad, &plan, &err));
  bad = p;
  bad.page_tokens = 0;  // kvgc_kv_bytes' "raw" is no page size
  CHECK_FALSE(kvgc_tools::make_plan(bad, &plan, &err));
  CHECK(err.find("page_tokens") != std::string::npos);
  bad = p;
  bad.model.head_dim = 3;
  CHECK_FALSE(kvgc_tools::make_plan(bad, &plan, &err));
  CHECK(err.find("head_dim") != std::string::npos);
}

TEST_CASE("plan: command-line value forms and formatting") {
  using kvgc_tools::parse_byte_size;
  CHECK(parse_byte_size("80G") == uint64_t(80) << 30);
  CHECK(parse_byte_size("24gib") == uint64_t(24) << 30);
  CHECK(parse_byte_size("512MB") == uint64_t(512) << 20);
  CHECK(parse_byte_size("1.5T") == uint64_t(3) << 39);
  CHECK(parse_byte_size("4k") == 4096u);
  CHECK(parse_byte_size("1048576") == 1048576u);
  for (const std::string bad : {"", "G", "0", "-1G", "1.5", "12X", "0.1", "nanG", "inf", " 1G"})
    CHECK_MESSAGE(!parse_byte_size(bad), bad);

  CHECK(kvgc_tools::parse_count_list("1,8,32", 100) == std::vector<uint64_t>{1, 8, 32});
  CHECK(kvgc_tools::parse_count_list("4k,32K", 1 << 20) == std::vector<uint64_t>{4096, 32768});
  for (const std::string bad : {"", "1,", ",1", "0", "1,,2", "a", "101", "1.5", "-1"})
    CHECK_MESSAGE(!kvgc_tools::parse_count_list(bad, 100), bad);

  CHECK(kvgc_tools::parse_fraction("0.25") == 0.25);
  CHECK(kvgc_tools::parse_fraction("25%") == 0.25);
  CHECK(kvgc_tools::parse_fraction("1") == 1.0);
  for (const std::string bad : {"", "%", "1.5", "-0.1", "150%", "x", "nan"})
    CHECK_MESSAGE(!kvgc_tools::parse_fraction(bad), bad);

  CHECK(kvgc_tools::format_bytes(uint64_t(512)) == "512 B");
  CHECK(kvgc_tools::format_bytes(uint64_t(23040)) == "22.50 KiB");
  CHECK(kvgc_tools::format_bytes(uint64_t(80) << 30) == "80.00 GiB");
  CHECK(kvgc_tools::format_bytes(UINT64_MAX) == "overflow");
  CHECK(kvgc_tools::format_count(0) == "0");
  CHECK(kvgc_tools::format_count(999) == "999");
  CHECK(kvgc_tools::format_count(3578480) == "3,578,480");
}

TEST_CASE("plan: a header page is the bytes of a page before its K/V") {
  const kvgc_model_desc smol = load_sample("SmolLM2-135M-Instruct.json").desc;
  std::string err;
  // kvgc.h's layout: live uint32[ceil(pt/32)], then pos, score, recent (4 bytes a slot)
  // and gen (1 byte a slot), each array on 16 bytes, K on 128.
  CHECK(kvgc_tools::header_page_bytes(smol, 16, &err) == 256);   // 16+64+64+64+16 -> 256
  CHECK(kvgc_tools::header_page_bytes(smol, 1, &err) == 128);    // 16+16+16+16+1 -> 128
  CHECK(kvgc_tools::header_page_bytes(smol, 256, &err) == 3456); // 32+3*1024+256 -> 3456
  CHECK(kvgc_tools::header_page_bytes(smol, 100, &err) == 1408); // 16+3*400+100 -> 1408

  // The same as the page layout's K offset, for any class, and the model's shape does not
  // matter (a page of 2 GiB per layer included).
  kvgc_model_desc big = smol;
  big.n_layers = 4096;
  big.n_q_heads = big.n_kv_heads = 1024;
  big.head_dim = 1024;
  big.dtype = KVGC_DTYPE_F32;
  CHECK(kvgc_tools::header_page_bytes(big, 256, &err) == 3456);
  for (uint32_t pt : {1u, 16u, 33u, 256u}) {
    CAPTURE(pt);
    kvgc_heap_options opts;
    kvgc_heap_options_init(&opts);
    opts.flags |= KVGC_OPT_IGNORE_ENV;
    opts.device = KVGC_DEVICE_CPU;
    opts.page_tokens = pt;
    opts.budget_bytes = 8u << 20;
    kvgc_heap* heap = nullptr;
    REQUIRE_MESSAGE(kvgc_heap_create(&smol, &opts, &heap) == KVGC_OK, kvgc_errmsg(nullptr));
    for (kvgc_storage_class cls : {KVGC_CLASS_FP16, KVGC_CLASS_INT8, KVGC_CLASS_INT4}) {
      kvgc_page_layout layout{};
      layout.struct_size = sizeof layout;
      REQUIRE(kvgc_page_layout_get(heap, cls, &layout) == KVGC_OK);
      CHECK(kvgc_tools::header_page_bytes(smol, pt, &err) == layout.k_offset);
    }
    kvgc_heap_destroy(heap);
  }
  // A shape kvgc refuses has no header size.
  kvgc_model_desc bad = smol;
  bad.head_dim = 3;
  CHECK(kvgc_tools::header_page_bytes(bad, 16, &err) == 0);
  CHECK(err.find("head_dim") != std::string::npos);
}

// The sharing tests' plan: SmolLM2 in 1 GiB, and one page of each class in every layer.
struct SmolShare {
  kvgc_tools::PlanParams p;
  uint64_t page = 0, page4 = 0;
  SmolShare() {
    p.model = load_sample("SmolLM2-135M-Instruct.json").desc;
    p.budget_bytes = uint64_t(1) << 30;
    REQUIRE(kvgc_kv_bytes(&p.model, 16, KVGC_CLASS_FP16, 16, &page) == KVGC_OK);
    REQUIRE(kvgc_kv_bytes(&p.model, 16, KVGC_CLASS_INT4, 16, &page4) == KVGC_OK);
  }
};

TEST_CASE("plan: sharing a prefix, against kvgc_kv_bytes by hand") {
  using kvgc_tools::FitMode;
  SmolShare share;
  kvgc_tools::PlanParams& p = share.p;
  const uint64_t page = share.page, page4 = share.page4;  // one page in each of the 30 layers
  CHECK(page == 30u * 12544);  // 256 B of header, K and V of 16 x 3 x 64 bf16: 6144 B each
  CHECK(page4 == 30u * 4096);   // 256 + 1536 + 1536 + 2 x 384 (scale/zero pairs)
  const auto kv = [&](uint64_t tokens) {
    uint64_t b = 0;
    REQUIRE(kvgc_kv_bytes(&p.model, tokens, KVGC_CLASS_FP16, 16, &b) == KVGC_OK);
    return b;
  };

  // 8 requests on a prefix of 128 whole pages and 5 tokens, 500 tokens each of their own.
  kvgc_tools::ShareParams s;
  s.prefix_tokens = 2053;
  s.own_tokens = 500;
  s.requests = 8;
  s.header_bytes = 256;
  s.charge = KVGC_PREFIX_CHARGE_CACHE;  // shrink: the next test
  kvgc_tools::SharePlan sp;
  std::string err;
  REQUIRE_MESSAGE(kvgc_tools::make_share_plan(p, s, &sp, &err), err);
  CHECK(sp.shared_pages == 128);
  CHECK(sp.tail_tokens == 5);
  REQUIRE(sp.rows.size() == 6);
  const uint64_t headers = 128u * 30 * 256;  // a header page per shared page per layer
  const uint64_t once = 128 * page;          // the prefix's whole pages
  CHECK(once == kv(2048));

  struct Want {
    FitMode mode;
    bool shared;
    uint64_t tokens, kept, int4;  // held by each request, kept of those, int4 of the kept
    uint64_t once, per_request;
  };
  // The rows of 8 requests: check them against `want`, the full cache unshared first.
  const auto check_rows = [&](const Want(&want)[6]) {
    for (size_t i = 0; i < 6; ++i) {
      CAPTURE(i);
      const kvgc_tools::ShareRow& r = sp.rows[i];
      CHECK(r.mode == want[i].mode);
      CHECK(r.shared == want[i].shared);
      CHECK(r.tokens == want[i].tokens);
      CHECK(r.kept == want[i].kept);
      CHECK(r.int4 == want[i].int4);
      CHECK(r.once_bytes == want[i].once);
      CHECK(r.header_bytes == (r.shared ? headers : 0));
      CHECK(r.per_request == want[i].per_request);
      CHECK(r.total_bytes == want[i].once + 8 * want[i].per_request);
      CHECK(r.requests_fit == (p.budget_bytes - want[i].once) / want[i].per_request);
      const double unshared = double(8 * want[i & ~size_t(1)].per_request);
      CHECK(r.vs_unshared == doctest::Approx(r.shared ? unshared / double(r.total_bytes) : 1));
      CHECK(r.vs_full == doctest::Approx(double(8 * want[0].per_request) / double(r.total_bytes)));
    }
  };
  // P + U = 2553; own = 5 + 500 = 505. keep 25% of the whole length: ceil(638.25) = 639
  // tokens, more than its own 505, so a shared request keeps all of its own.
  const Want short_own[] = {
      // 2553 tokens: 160 pages.
      {FitMode::kFull, false, 2553, 2553, 0, 0, 160 * page},
      // 5 + 500 own tokens: 32 pages, and the headers.
      {FitMode::kFull, true, 505, 505, 0, once, 32 * page + headers},
      // 639 tokens kept: 40 pages.
      {FitMode::kEvict, false, 2553, 639, 0, 0, 40 * page},
      // min(505, 639) = 505 own tokens kept: 32 pages, as the full cache; the prefix
      // stays whole.
      {FitMode::kEvict, true, 505, 505, 0, once, 32 * page + headers},
      // 639 kept, floor(319.5) = 319 int4: 320 + 319 tokens, 20 pages of each class.
      {FitMode::kEvictInt4, false, 2553, 639, 319, 0, 20 * page + 20 * page4},
      // 505 kept, floor(252.5) = 252 int4: 253 + 252 tokens, 16 pages of each class.
      {FitMode::kEvictInt4, true, 505, 505, 252, once, 16 * page + 16 * page4 + headers},
  };
  check_rows(short_own);
  CHECK(sp.rows[0].per_request == kv(2553));
  CHECK(sp.rows[1].per_request == kv(505) + headers);
  CHECK(sp.rows[3].per_request == sp.rows[1].per_request);
  // By hand: 8 x 160 pages unshared, 128 + 8 x 32 pages and 8 x 960 KiB of headers
  // shared (full cache and eviction alike); eviction unshared 8 x 40 pages; eviction +
  // int4 shared: 128 + 8 x 16 pages of each class and the headers. Eviction shared holds
  // more than eviction unshared here: the prefix, whole, outweighs the 134 tokens a
  // request keeps fewer.
  CHECK(sp.rows[1].vs_unshared == doctest::Approx(481689600.0 / 152371200).epsilon(1e-12));
  CHECK(sp.rows[3].vs_unshared == doctest::Approx(120422400.0 / 152371200).epsilon(1e-12));
  CHECK(sp.rows[3].vs_full == doctest::Approx(481689600.0 / 152371200).epsilon(1e-12));
  CHECK(sp.rows[5].vs_full == doctest::Approx(481689600.0 / 119930880).epsilon(1e-12));

  // 4000 tokens each of their own: P + U = 6053, own = 4005, more than keep 25% of the
  // whole length, ceil(1513.25) = 1514: a shared request keeps 1514 of its own tokens,
  // as many as it keeps unshared.
  s.own_tokens = 4000;
  REQUIRE_MESSAGE(kvgc_tools::make_share_plan(p, s, &sp, &err), err);
  const Want long_own[] = {
      // 6053 tokens: 379 pages (378 x 16 = 6048).
      {FitMode::kFull, false, 6053, 6053, 0, 0, 379 * page},
      // 4005 own tokens: 251 pages (250 x 16 = 4000), and the headers.
      {FitMode::kFull, true, 4005, 4005, 0, once, 251 * page + headers},
      // 1514 kept: 95 pages (94 x 16 = 1504).
      {FitMode::kEvict, false, 6053, 1514, 0, 0, 95 * page},
      // min(4005, 1514) = 1514 of its own: the same 95 pages, and the headers.
      {FitMode::kEvict, true, 4005, 1514, 0, once, 95 * page + headers},
      // 1514 kept, 757 int4: 757 + 757 tokens, 48 pages of each class (47 x 16 = 752).
      {FitMode::kEvictInt4, false, 6053, 1514, 757, 0, 48 * page + 48 * page4},
      {FitMode::kEvictInt4, true, 4005, 1514, 757, once, 48 * page + 48 * page4 + headers},
  };
  check_rows(long_own);
  CHECK(sp.rows[0].per_request == kv(6053));
  CHECK(sp.rows[1].per_request == kv(4005) + headers);
  CHECK(sp.rows[3].per_request == kv(1514) + headers);
  // By hand: eviction unshared 8 x 95 pages = 286003200 B; shared 128 pages once and
  // 8 x (95 pages + 960 KiB of headers) = 48168960 + 293867520 B.
  CHECK(sp.rows[3].vs_unshared == doctest::Approx(286003200.0 / 342036480).epsilon(1e-12));
  s.own_tokens = 500;

  // A prefix of whole pages: the requests hold none of it. Without a header size,
  // headers count 0.
  s.prefix_tokens = 2048;
  s.header_bytes = 0;
  REQUIRE(kvgc_tools::make_share_plan(p, s, &sp, &err));
  CHECK(sp.tail_tokens == 0);
  CHECK(sp.rows[1].once_bytes == 128 * page);
  CHECK(sp.rows[1].per_request == kv(500));
  CHECK(sp.rows[1].header_bytes == 0);

  // A prefix shorter than a page shares nothing (pages are shared whole).
  s.prefix_tokens = 5;
  s.header_bytes = 256;
  REQUIRE(kvgc_tools::make_share_plan(p, s, &sp, &err));
  CHECK(sp.shared_pages == 0);
  for (size_t i = 0; i < 6; i += 2) {
    CHECK(sp.rows[i + 1].once_bytes == 0);
    CHECK(sp.rows[i + 1].per_request == sp.rows[i].per_request);
    CHECK(sp.rows[i + 1].total_bytes == sp.rows[i].total_bytes);
    CHECK(sp.rows[i + 1].vs_unshared == 1);
  }

  // A budget below the prefix holds no shared request.
  s.prefix_tokens = 2053;
  p.budget_bytes = once - 1;
  REQUIRE(kvgc_tools::make_share_plan(p, s, &sp, &err));
  CHECK(sp.rows[0].requests_fit == (once - 1) / (160 * page));
  for (size_t i = 1; i < 6; i += 2) CHECK(sp.rows[i].requests_fit == 0);

  // The largest of everything: byte counts saturate, ratios are not numbers, nothing fits.
  kvgc_tools::PlanParams big = p;
  big.model.n_layers = 4096;
  big.model.n_q_heads = big.model.n_kv_heads = 1024;
  big.model.head_dim = 1024;
  big.model.dtype = KVGC_DTYPE_F32;
  big.page_tokens = 256;
  big.budget_bytes = kvgc_tools::kMaxBudgetBytes;
  s.prefix_tokens = s.own_tokens = kvgc_tools::kMaxContext;
  s.requests = kvgc_tools::kMaxRequests;
  s.header_bytes = 3456;
  REQUIRE_MESSAGE(kvgc_tools::make_share_plan(big, s, &sp, &err), err);
  for (const kvgc_tools::ShareRow& r : sp.rows) {
    CHECK(r.total_bytes == UINT64_MAX);
    CHECK(r.requests_fit == 0);
    CHECK(std::isnan(r.vs_full));
  }
  CHECK(sp.rows[1].header_bytes == (uint64_t(1) << 24) * 4096 * 3456);
}

TEST_CASE("plan: bad sharing parameters are refused with a message") {
  kvgc_tools::PlanParams p;
  p.model = load_sample("Qwen2.5-7B.json").desc;
  kvgc_tools::ShareParams s;
  s.prefix_tokens = 1024;
  s.requests = 4;
  s.header_bytes = 256;
  kvgc_tools::SharePlan sp;
  std::string err;
  REQUIRE(kvgc_tools::make_share_plan(p, s, &sp, &err));

  const auto refused = [&](const kvgc_tools::PlanParams& bp, const kvgc_tools::ShareParams& bs,
                           const char* word) {
    err.clear();
    CHECK_FALSE(kvgc_tools::make_share_plan(bp, bs, &sp, &err));
    CAPTURE(err);
    CHECK(err.find(word) != std::string::npos);
  };
  kvgc_tools::ShareParams bad = s;
  bad.prefix_tokens = 0;
  refused(p, bad, "shared prefix");
  bad.prefix_tokens = kvgc_tools::kMaxContext + 1;
  refused(p, bad, "shared prefix");
  bad = s;
  bad.own_tokens = 0;
  refused(p, bad, "own tokens");
  bad.own_tokens = kvgc_tools::kMaxContext + 1;
  refused(p, bad, "own tokens");
  bad = s;
  bad.requests = 0;
  refused(p, bad, "requests");
  bad.requests = kvgc_tools::kMaxRequests + 1;
  refused(p, bad, "requests");
  bad = s;
  bad.header_bytes = 1 << 20;
  refused(p, bad, "header");
  kvgc_tools::PlanParams bp = p;
  bp.keep = 0;
  refused(bp, s, "keep");
  bp = p;
  bp.budget_bytes = 0;
  refused(bp, s, "budget");
  bp = p;
  bp.page_tokens = 0;
  refused(bp, s, "page_tokens");
}

TEST_CASE("plan: sharing a prefix under shrink, the default: the prefix's unkept pages at int4, a request's own tokens bounded") {
  using kvgc_tools::FitMode;
  SmolShare share;
  kvgc_tools::PlanParams& p = share.p;
  const uint64_t page = share.page, page4 = share.page4;  // one page in each of the 30 layers
  kvgc_tools::ShareParams s;
  CHECK(s.charge == KVGC_PREFIX_CHARGE_SHRINK);
  s.prefix_tokens = 2053;
  s.own_tokens = 500;
  s.requests = 8;
  s.header_bytes = 256;
  kvgc_tools::SharePlan sp;
  std::string err;
  REQUIRE_MESSAGE(kvgc_tools::make_share_plan(p, s, &sp, &err), err);
  const uint64_t once = 128 * page;
  // Against cache: the same requests (their own tokens at most as many), the prefix
  // re-stored only under eviction + int4.
  kvgc_tools::ShareParams c = s;
  c.charge = KVGC_PREFIX_CHARGE_CACHE;
  kvgc_tools::SharePlan cp;
  REQUIRE(kvgc_tools::make_share_plan(p, c, &cp, &err));
  for (size_t i = 0; i < 6; ++i) {
    CAPTURE(i);
    CHECK(sp.rows[i].per_request == cp.rows[i].per_request);
    CHECK(sp.rows[i].kept == cp.rows[i].kept);
    CHECK(sp.rows[i].once_whole == cp.rows[i].once_bytes);
    if (i != 5) CHECK(sp.rows[i].once_bytes == cp.rows[i].once_bytes);
    CHECK(cp.rows[i].kept_min == cp.rows[i].kept);
  }
  // own = 505: at most min(505, 639) = 505 kept, at least keep x own = ceil(126.25) = 127.
  const kvgc_tools::ShareRow &evict = sp.rows[3], &int4 = sp.rows[5];
  CHECK(evict.kept == 505);
  CHECK(evict.kept_min == 127);
  CHECK(int4.kept_min == 127);
  CHECK(evict.once_bytes == once);  // no ladder: nothing re-stored
  // The prefix's share no request keeps at fp16: 1 - 0.25 x 0.5 of 128 pages; 16 stay.
  CHECK(int4.once_whole == once);
  CHECK(int4.once_bytes == 16 * page + 112 * page4);
  CHECK(int4.total_bytes == int4.once_bytes + 8 * int4.per_request);
  CHECK(int4.vs_unshared > cp.rows[5].vs_unshared);
  // View is not planned.
  s.charge = KVGC_PREFIX_CHARGE_VIEW;
  CHECK_FALSE(kvgc_tools::make_share_plan(p, s, &sp, &err));
  CHECK(err.find("view") != std::string::npos);
}

TEST_CASE("plan: kvgc-plan --shared-prefix prints the sharing table, refuses bad values") {
  const std::string exe = plan_exe();
  if (exe.empty()) {
    MESSAGE("kvgc-plan not built beside this test and KVGC_PLAN_EXE not set: skipped");
    return;
  }
  const std::string smol = "--config '" + samples_dir() + "/SmolLM2-135M-Instruct.json'";
  std::string out;
  REQUIRE(run_plan(exe, smol + " --budget 2G --shared-prefix 2053 --requests 8 --own 500 --prefix-charge cache",
                   &out) == 0);
  CAPTURE(out);
  CHECK(out.find("Sharing a 2,053-token prefix over 8 requests, each with 500 tokens of its "
                 "own") != std::string::npos);
  CHECK(out.find("256 B header page") != std::string::npos);
  // The note under the table, its line breaks undone (it is wrapped to the terminal).
  const size_t note_at = out.find("  shared (KVGC_PREFIX_CHARGE=cache): the prefix cache");
  REQUIRE(note_at != std::string::npos);
  std::string note;
  for (size_t i = note_at; i < out.size(); ++i) {
    if (out.compare(i, 3, "\n  ") == 0) i += 2;
    note.push_back(out[i] == '\n' ? ' ' : out[i]);
  }
  CHECK(note.find("prefix's 128 pages once (45.94 MiB in bf16)") != std::string::npos);
  CHECK(note.find("the prefix's last 5 past its whole pages and its U (own = 505)") !=
        std::string::npos);
  CHECK(note.find("Under eviction a request's budget is --keep of its whole length, as "
                  "unshared, spent on its own tokens (the prefix is never pruned): it keeps "
                  "min(own, keep x (P+U)); sharing never leaves it fewer of its own tokens.") !=
        std::string::npos);
  CHECK(note.find("Here it keeps min(505, 639) = 505 (the int4 row: 252 of them int4).") !=
        std::string::npos);
  // The figures of make_share_plan (checked by hand above), printed.
  kvgc_tools::PlanParams p;
  p.model = load_sample("SmolLM2-135M-Instruct.json").desc;
  p.budget_bytes = uint64_t(2) << 30;
  kvgc_tools::ShareParams s;
  s.prefix_tokens = 2053;
  s.own_tokens = 500;
  s.requests = 8;
  s.header_bytes = 256;
  s.charge = KVGC_PREFIX_CHARGE_CACHE;
  kvgc_tools::SharePlan sp;
  std::string err;
  REQUIRE(kvgc_tools::make_share_plan(p, s, &sp, &err));
  char tail[256];
  std::snprintf(tail, sizeof tail,
                " prefix_charge=cache shared_prefix=2053 requests=8 own=500 full_shared_x=%.3f evict_shared_x=%.3f "
                "evict_int4_shared_x=%.3f evict_int4_shared_vs_full_x=%.3f\n",
                sp.rows[1].vs_unshared, sp.rows[3].vs_unshared, sp.rows[5].vs_unshared,
                sp.rows[5].vs_full);
  CHECK(out.size() > std::strlen(tail));
  CHECK(out.substr(out.size() - std::strlen(tail)) == tail);
  CHECK(out.find(kvgc_tools::format_count(sp.rows[1].requests_fit)) != std::string::npos);
  CHECK(out.find(kvgc_tools::format_bytes(sp.rows[1].total_bytes)) != std::string::npos);

  // The default charge, shrink: a request keeps keep x own of its own tokens.
  REQUIRE(run_plan(exe, smol + " --budget 2G --shared-prefix 2053 --requests 8 --own 500", &out) == 0);
  {
    std::string flat;  // the note's line breaks undone
    for (size_t i = 0; i < out.size(); ++i) {
      if (out.compare(i, 3, "\n  ") == 0) i += 2;
      flat.push_back(out[i] == '\n' ? ' ' : out[i]);
    }
    CAPTURE(flat);
    CHECK(flat.find("shared (KVGC_PREFIX_CHARGE=shrink)") != std::string::npos);
    CHECK(flat.find("it keeps at most min(own, keep x (P+U)) of its own, as counted here, and at "
                    "least keep x own = 127") != std::string::npos);
    CHECK(flat.find("are re-stored at int4: ") != std::string::npos);
    CHECK(out.find(" prefix_charge=shrink shared_prefix=2053 ") != std::string::npos);
  }

  // --requests defaults to the largest batch; --own to 512. Without --shared-prefix
  // there is no table and the RESULT line is as before.
  REQUIRE(run_plan(exe, smol + " --batch 4,2 --shared-prefix 1k", &out) == 0);
  CHECK(out.find(" shared_prefix=1024 requests=4 own=512 ") != std::string::npos);
  REQUIRE(run_plan(exe, smol, &out) == 0);
  CHECK(out.find("Sharing") == std::string::npos);
  CHECK(out.find("shared_prefix=") == std::string::npos);

  const std::pair<const char*, const char*> bad[] = {
      {"--shared-prefix 0", "--shared-prefix: invalid value '0'"},
      {"--shared-prefix 4194305k", "--shared-prefix: invalid value '4194305k'"},
      {"--shared-prefix 1.5k", "--shared-prefix: invalid value '1.5k'"},
      {"--shared-prefix", "--shared-prefix needs a value"},
      {"--shared-prefix 2k --own 0", "--own: invalid value '0'"},
      {"--shared-prefix 2k --own=4294967297", "--own: invalid value '4294967297'"},
      {"--shared-prefix 2k --requests 0", "--requests: invalid value '0'"},
      {"--shared-prefix 2k --requests 1048577", "--requests: invalid value '1048577'"},
      {"--own 100", "--own describes the requests sharing a prefix: give --shared-prefix"},
      {"--requests 8", "--requests describes the requests sharing a prefix"},
      {"--prefix-charge cache", "--prefix-charge describes the requests sharing a prefix"},
      {"--shared-prefix 2k --prefix-charge view", "--prefix-charge: invalid value 'view'"},
  };
  for (const auto& [args, message] : bad) {
    CAPTURE(args);
    CHECK(run_plan(exe, smol + " " + args, &out) == 2);
    CAPTURE(out);
    CHECK(out.rfind(std::string("kvgc-plan: ") + message, 0) == 0);
  }
}
