// kvgc-parser-peak: the peak heap memory of every parser a user's file reaches, measured
// with the process's malloc replaced (tests/malloc_hook.cpp), on hostile inputs built to
// amplify: an 8 MiB JSON array of zeros, a million empty objects under one key, a
// million distinct keys, deep nesting, one huge wanted string; GGUF headers whose key is
// as long as the file, the most metadata pairs and tensors the reader allows, a huge
// string value, a huge string array; an entropy profile far larger than any model's.
// Each must stay within a small multiple of its input plus a fixed allowance (the GGUF
// reader's per-pair bookkeeping at its caps), or the test fails naming the case.
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "../runtime/options.hpp"
#include "gguf.hpp"
#include "malloc_hook.hpp"
#include "model_shape.hpp"

namespace {

// Bounds on peak / input: the config reader holds the text and nlohmann's token buffer
// (which doubles as it grows); the GGUF reader copies each string once and keeps ~150
// bytes of bookkeeping per pair or tensor (capped at 65,536 each); the profile reader
// holds at most a profile's worth.
struct Bound {
  double ratio;
  int64_t allowance;
};
constexpr Bound kJson{5.0, int64_t(1) << 20};
constexpr Bound kGguf{2.0, int64_t(16) << 20};
constexpr Bound kProfile{1.0, int64_t(1) << 20};

std::string temp_path(const char* name) {
  return "/tmp/kvgc-parser-peak-" + std::to_string(::getpid()) + "-" + name;
}

void write_file(const std::string& path, const std::string& bytes) {
  FILE* f = std::fopen(path.c_str(), "wb");
  if (!f || std::fwrite(bytes.data(), 1, bytes.size(), f) != bytes.size()) {
    std::perror(path.c_str());
    std::exit(2);
  }
  std::fclose(f);
}

int failures = 0;

// Runs `parse` on a file holding `bytes` and checks its peak heap use.
void measure(const char* name, const std::string& bytes, Bound bound,
             const std::function<void(const std::string&)>& parse) {
  const std::string path = temp_path(name);
  write_file(path, bytes);
  const int64_t before = malloc_hook::live_bytes();
  malloc_hook::reset_peak();
  parse(path);
  const int64_t peak = malloc_hook::peak_bytes() - before;
  std::remove(path.c_str());
  const double ratio = double(peak) / double(bytes.size());
  const bool ok = peak <= int64_t(bound.ratio * double(bytes.size())) + bound.allowance;
  std::printf("%s %-34s input %9zu bytes, peak %10lld bytes (%.2fx; bound %.0fx + %lld MiB)\n",
              ok ? "ok  " : "FAIL", name, bytes.size(), (long long)peak, ratio, bound.ratio,
              (long long)(bound.allowance >> 20));
  failures += !ok;
}

void config(const std::string& path) {
  kvgc_tools::ModelShape s;
  std::string err;
  kvgc_tools::load_config_shape(path, &s, &err);
}

void gguf_open(const std::string& path) {
  gguf::File f;
  std::string err;
  if (f.open(path, &err)) {
    kvgc_tools::ModelShape s;
    kvgc_tools::shape_from_gguf(f, "x", &s, &err);
  }
}

void profile(const std::string& path) {
  std::vector<float> w;
  (void)kvgc::read_layer_profile(path, 32, "KVGC_LAYER_BUDGET", &w);
}

// GGUF pieces (little-endian).
template <class T>
void put(std::string& out, T v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof v);
}
void put_str(std::string& out, const std::string& s) {
  put(out, uint64_t(s.size()));
  out += s;
}
std::string gguf_header(uint64_t tensors, uint64_t kvs) {
  std::string out = "GGUF";
  put(out, uint32_t(3));
  put(out, tensors);
  put(out, kvs);
  return out;
}

}  // namespace

int main() {
  const size_t mib8 = 8 << 20;
  const size_t json_max = mib8 - 1024;  // the config reader reads files up to 8 MiB
  // ---- config.json ---------------------------------------------------------------
  {
    std::string zeros = "[";
    while (zeros.size() < json_max - 2) zeros += "0,";
    zeros += "0]";
    measure("json: 8 MiB array of zeros", zeros, kJson, config);
  }
  {
    std::string objs = "{";
    while (objs.size() < json_max - 8) objs += "\"\":{},";
    objs += "\"\":{}}";
    measure("json: {\"\":{},...} 8 MiB", objs, kJson, config);
  }
  {
    std::string keys = "{";
    for (int i = 0; keys.size() < json_max - 32; ++i) keys += "\"k" + std::to_string(i) + "\":0,";
    keys += "\"num_hidden_layers\":2}";
    measure("json: a million distinct keys", keys, kJson, config);
  }
  measure("json: nesting 8 MiB deep", std::string(json_max, '['), kJson, config);
  {
    std::string big = "{\"_name_or_path\": \"" + std::string(json_max - 128, 'n') +
                      "\", \"num_hidden_layers\": 2, \"num_attention_heads\": 2, \"head_dim\": 8}";
    measure("json: one 8 MiB wanted string", big, kJson, config);
  }
  // ---- GGUF --------------------------------------------------------------------------
  {
    std::string g = gguf_header(0, 1);
    put(g, uint64_t(4 * mib8));  // a key as long as the file (32 MiB)
    g += std::string(4 * mib8, 'k');
    measure("gguf: key as long as the file", g, kGguf, gguf_open);
  }
  {
    std::string g = gguf_header(0, 65536);
    for (uint32_t i = 0; i < 65536; ++i) {
      put_str(g, "k" + std::to_string(i));
      put(g, uint32_t(0));  // UINT8
      put(g, uint8_t(1));
    }
    measure("gguf: 65,536 metadata pairs", g, kGguf, gguf_open);
  }
  {
    std::string g = gguf_header(65536, 0);
    for (uint32_t i = 0; i < 65536; ++i) {
      put_str(g, "t" + std::to_string(i));
      put(g, uint32_t(4));  // dims
      for (int d = 0; d < 4; ++d) put(g, uint64_t(1));
      put(g, uint32_t(0));  // F32
      put(g, uint64_t(0));  // offset
    }
    g += std::string(64, '\0');
    measure("gguf: 65,536 tensors", g, kGguf, gguf_open);
  }
  {
    std::string g = gguf_header(0, 2);
    put_str(g, "general.architecture");
    put(g, uint32_t(8));
    put_str(g, "llama");
    put_str(g, "general.name");
    put(g, uint32_t(8));
    put_str(g, std::string(mib8, 'n'));
    measure("gguf: an 8 MiB string value", g, kGguf, gguf_open);
  }
  {
    std::string g = gguf_header(0, 1);
    put_str(g, "tokenizer.ggml.tokens");
    put(g, uint32_t(9));  // ARRAY
    put(g, uint32_t(8));  // of STRING
    const uint64_t n = mib8 / 9;
    put(g, n);
    for (uint64_t i = 0; i < n; ++i) put_str(g, "x");
    measure("gguf: a million-string array", g, kGguf, gguf_open);
  }
  // ---- entropy profile -----------------------------------------------------------------
  {
    std::string p;
    while (p.size() < mib8) p += "1.0\n";
    measure("profile: 8 MiB of weights", p, kProfile, profile);
    measure("profile: one 8 MiB line", std::string(mib8, '7'), kProfile, profile);
  }
  std::printf("kvgc-parser-peak: %s\n", failures ? "FAILED" : "every parser within its bound");
  return failures ? 1 : 0;
}
