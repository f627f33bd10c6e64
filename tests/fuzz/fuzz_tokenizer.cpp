// libFuzzer harness over kvgc-run's tokenizer on arbitrary bytes. The vocabulary is the
// real model's when its file exists ($KVGC_MODEL, else ~/.cache/kvgc/...), else a random
// byte-level BPE vocabulary the harness writes (tests/fuzz/tiny_gguf.hpp). The first
// input byte chooses special-token parsing; the rest is the text. Checked on every input:
// - every id is inside the vocabulary;
// - decoding gives the text back, byte for byte, unless it holds a byte the vocabulary
//   has no token for (those are dropped, as llama.cpp drops them);
// - up to 1 KB, the ids equal the rescanning reference merge's (tokenizer_reference.hpp);
// - encoding twice gives the same ids.
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>
#include <vector>

#include "engine/model.hpp"
#include "engine/tokenizer.hpp"
#include "tiny_gguf.hpp"
#include "tokenizer_reference.hpp"

namespace {

constexpr size_t kReferenceLimit = 1024;  // the reference is quadratic per piece

// engine::default_model_path()'s rule, without linking the model loader.
std::string model_path() {
  if (const char* env = std::getenv("KVGC_MODEL"); env && *env) return env;
  const char* home = std::getenv("HOME");
  return std::string(home ? home : ".") + "/.cache/kvgc/" + engine::kDefaultModelFile;
}

struct Harness {
  gguf::File file;
  engine::Tokenizer tok;
  kvgc_test::ReferenceTokenizer ref;
  bool has_byte[256] = {};

  Harness() {
    std::string path = model_path();
    std::string err;
    if (!std::filesystem::exists(path)) {
      path = std::filesystem::temp_directory_path() /
             ("kvgc_fuzz_tokenizer_" + std::to_string(getpid()) + ".gguf");
      const std::string bytes = kvgc_test::vocab_gguf(kvgc_test::random_vocab(7, 800));
      std::ofstream(path, std::ios::binary).write(bytes.data(), std::streamsize(bytes.size()));
    }
    if (!file.open(path, &err) || !tok.load(file, &err) || !ref.load(file)) {
      std::fprintf(stderr, "fuzz_tokenizer: cannot load a vocabulary: %s\n", err.c_str());
      std::abort();
    }
    std::fprintf(stderr, "fuzz_tokenizer: vocabulary of %zu tokens from %s\n", tok.size(),
                 path.c_str());
    const std::vector<std::string> stand_ins = kvgc_test::byte_tokens();
    for (int b = 0; b < 256; ++b) has_byte[b] = tok.find(stand_ins[size_t(b)]) >= 0;
  }
};

void fail(const char* what, std::string_view text) {
  std::fprintf(stderr, "fuzz_tokenizer: %s (input of %zu bytes)\n", what, text.size());
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static Harness h;
  if (size == 0) return 0;
  const bool special = data[0] & 1;
  const std::string_view text(reinterpret_cast<const char*>(data + 1), size - 1);
  const std::vector<int32_t> ids = h.tok.encode(text, special);
  for (int32_t id : ids) {
    if (id < 0 || size_t(id) >= h.tok.size()) fail("id outside the vocabulary", text);
  }
  bool droppable = false;
  for (char c : text) droppable |= !h.has_byte[uint8_t(c)];
  if (!droppable && h.tok.decode(ids) != text) fail("decode(encode(text)) != text", text);
  if (text.size() <= kReferenceLimit && ids != h.ref.encode(text, special)) {
    fail("ids differ from the reference merge", text);
  }
  if (h.tok.encode(text, special) != ids) fail("encoding is not deterministic", text);
  return 0;
}
