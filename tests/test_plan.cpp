// kvgc-plan's building blocks: the GGUF reader (on files written here, valid and
// hostile), the JSON reader, model shapes from config.json and GGUF, and the plan
// arithmetic against kvgc_kv_bytes.
#include <doctest/doctest.h>
#include <unistd.h>

#include <cmath>
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
