// Small GGUF files written by tests and the tokenizer fuzzer: a little-endian GGUF v3
// writer, GPT-2's byte stand-ins, and a random byte-level BPE vocabulary whose merges
// apply often (a few letters merged into words, some results outside the vocabulary,
// duplicate and malformed merges), so the merge order is exercised on short inputs.
#pragma once

#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gguf.hpp"
#include "utf8_of.hpp"

namespace kvgc_test {

// Little-endian GGUF v3 bytes, section by section.
struct TinyGgufWriter {
  std::string meta;   // key/value pairs
  std::string infos;  // tensor infos
  std::string data;   // tensor data, each tensor aligned
  uint64_t n_kv = 0, n_tensors = 0;

  template <class T>
  static void put(std::string* out, T v) {
    char b[sizeof(T)];
    std::memcpy(b, &v, sizeof(T));
    out->append(b, sizeof(T));
  }
  static void put_string(std::string* out, const std::string& s) {
    put<uint64_t>(out, s.size());
    *out += s;
  }
  void key(const std::string& k, gguf::ValueType type) {
    put_string(&meta, k);
    put(&meta, uint32_t(type));
    ++n_kv;
  }
  void u32(const std::string& k, uint32_t v) {
    key(k, gguf::ValueType::kUInt32);
    put(&meta, v);
  }
  void u64(const std::string& k, uint64_t v) {
    key(k, gguf::ValueType::kUInt64);
    put(&meta, v);
  }
  void f32(const std::string& k, float v) {
    key(k, gguf::ValueType::kFloat32);
    put(&meta, v);
  }
  void str(const std::string& k, const std::string& v) {
    key(k, gguf::ValueType::kString);
    put_string(&meta, v);
  }
  void strings(const std::string& k, const std::vector<std::string>& values) {
    key(k, gguf::ValueType::kArray);
    put(&meta, uint32_t(gguf::ValueType::kString));
    put<uint64_t>(&meta, values.size());
    for (const std::string& v : values) put_string(&meta, v);
  }
  void ints(const std::string& k, const std::vector<int32_t>& values) {
    key(k, gguf::ValueType::kArray);
    put(&meta, uint32_t(gguf::ValueType::kInt32));
    put<uint64_t>(&meta, values.size());
    for (int32_t v : values) put(&meta, v);
  }
  void tensor(const std::string& name, std::vector<uint64_t> dims, uint32_t type,
              const std::string& bytes) {
    data.append((32 - data.size() % 32) % 32, '\0');
    put_string(&infos, name);
    put(&infos, uint32_t(dims.size()));
    for (uint64_t d : dims) put(&infos, d);
    put(&infos, type);
    put<uint64_t>(&infos, data.size());
    data += bytes;
    ++n_tensors;
  }
  std::string finish() const {
    std::string out = "GGUF";
    put(&out, uint32_t(3));
    put(&out, n_tensors);
    put(&out, n_kv);
    out += meta + infos;
    out.append((32 - out.size() % 32) % 32, '\0');
    return out + data;
  }
};

// GPT-2's byte-to-unicode stand-ins (all below U+0800, so two UTF-8 bytes at most).
inline std::vector<std::string> byte_tokens() {
  std::vector<std::string> out(256);
  uint32_t next = 256;
  for (uint32_t b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xa1 && b <= 0xac) || b >= 0xae;
    out[b] = utf8_of(printable ? b : next++);
  }
  return out;
}

// A vocabulary: tokens, their types, merges.
struct Vocab {
  std::vector<std::string> tokens;
  std::vector<int32_t> types;
  std::vector<std::string> merges;

  void write(TinyGgufWriter* w, const std::string& pre) const {
    w->str("tokenizer.ggml.model", "gpt2");
    w->str("tokenizer.ggml.pre", pre);
    w->strings("tokenizer.ggml.tokens", tokens);
    w->ints("tokenizer.ggml.token_type", types);
    w->strings("tokenizer.ggml.merges", merges);
  }
};

// Three control tokens, every byte but a few (dropped bytes exercise the fallback), and
// `n_merges` random merges over symbols spelled from "abcde", space and digits, so random
// text over that alphabet merges deeply. About one merge result in six is left out of the
// vocabulary; a few merges are duplicates (the first wins) or malformed (never apply).
inline Vocab random_vocab(uint32_t seed, size_t n_merges) {
  std::mt19937 rng(seed);
  Vocab v;
  v.tokens = {"<|endoftext|>", "<|im_start|>", "<|im_end|>"};
  v.types = {3, 3, 3};
  const std::vector<std::string> bytes = byte_tokens();
  for (uint32_t b = 0; b < 256; ++b) {
    if (b == 0xc0 || b == 0x07) continue;  // bytes with no token, as in SmolLM
    v.tokens.push_back(bytes[b]);
    v.types.push_back(1);
  }
  std::vector<std::string> pool;
  for (char c : std::string("abcde 01")) pool.push_back(bytes[uint8_t(c)]);
  for (size_t i = 0; i < n_merges; ++i) {
    const std::string& left = pool[rng() % pool.size()];
    const std::string& right = pool[rng() % pool.size()];
    switch (rng() % 40) {
      case 0: v.merges.push_back(left + "  " + right); continue;  // two spaces
      case 1: v.merges.push_back(left + right); continue;         // no space
      case 2: if (!v.merges.empty()) v.merges.push_back(v.merges[rng() % v.merges.size()]);
              continue;
      default: break;
    }
    v.merges.push_back(left + " " + right);
    const std::string merged = left + right;
    if (merged.size() < 24) pool.push_back(merged);
    if (rng() % 6 != 0) {
      v.tokens.push_back(merged);
      v.types.push_back(1);
    }
  }
  return v;
}

// A GGUF holding only `vocab` (what engine::Tokenizer::load reads).
inline std::string vocab_gguf(const Vocab& vocab, const std::string& pre = "smollm") {
  TinyGgufWriter w;
  w.str("general.architecture", "llama");
  vocab.write(&w, pre);
  w.u32("tokenizer.ggml.bos_token_id", 1);
  w.u32("tokenizer.ggml.eos_token_id", 2);
  return w.finish();
}

}  // namespace kvgc_test
