// The tokenizer's first merge, kept as the reference its fast replacement must equal
// token for token (tests/test_engine.cpp, tests/test_model.cpp, the tokenizer fuzzer):
// after every merge it rescans the whole piece for the lowest-ranked adjacent pair,
// leftmost on ties, so it costs O(n^2) string concatenations for an n-byte piece. Only
// for short inputs. It reads the vocabulary from the GGUF file itself and shares
// nothing with engine::Tokenizer but the pre-tokenizer.
#pragma once

#include <algorithm>
#include <climits>
#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "engine/tokenizer.hpp"
#include "gguf.hpp"
#include "utf8_of.hpp"

namespace kvgc_test {

class ReferenceTokenizer {
 public:
  // False if the file has no byte-level BPE vocabulary (engine::Tokenizer::load says why).
  bool load(const gguf::File& file) {
    const auto tokens_array = file.get_array("tokenizer.ggml.tokens");
    const auto merges_array = file.get_array("tokenizer.ggml.merges");
    if (!tokens_array || !merges_array) return false;
    auto tokens = file.strings(*tokens_array);
    auto merges = file.strings(*merges_array);
    if (!tokens || !merges) return false;
    tokens_ = std::move(*tokens);
    std::vector<int64_t> types(tokens_.size(), 1);
    if (const auto types_array = file.get_array("tokenizer.ggml.token_type")) {
      const auto t = file.ints(*types_array);
      if (!t || t->size() != tokens_.size()) return false;
      types = *t;
    }
    for (size_t i = 0; i < tokens_.size(); ++i) {
      ids_.emplace(tokens_[i], int32_t(i));
      if ((types[i] == 3 || types[i] == 4) && !tokens_[i].empty()) specials_.push_back(int32_t(i));
    }
    std::stable_sort(specials_.begin(), specials_.end(), [&](int32_t a, int32_t b) {
      return tokens_[size_t(a)].size() > tokens_[size_t(b)].size();
    });
    for (size_t i = 0; i < merges->size(); ++i) ranks_.emplace((*merges)[i], int32_t(i));
    uint32_t next = 256;
    for (uint32_t b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xa1 && b <= 0xac) || b >= 0xae;
      const uint32_t cp = printable ? b : next++;
      byte_to_unicode_[b] = utf8_of(cp);
      unicode_to_byte_[byte_to_unicode_[b]] = uint8_t(b);
    }
    const std::string pre = file.get_string("tokenizer.ggml.pre").value_or("default");
    split_digits_ = pre == "smollm" || pre == "starcoder" || pre == "refact";
    return true;
  }

  std::vector<int32_t> encode(std::string_view text, bool parse_special) const {
    std::vector<int32_t> ids;
    auto plain = [&](std::string_view part) {
      for (const std::string& piece : engine::pre_tokenize(part, split_digits_))
        encode_piece(piece, &ids);
    };
    size_t start = 0, i = 0;
    while (i < text.size()) {
      int32_t special = -1;
      for (int32_t id : specials_) {
        if (parse_special && text.substr(i).starts_with(tokens_[size_t(id)])) {
          special = id;
          break;
        }
      }
      if (special < 0) {
        ++i;
        continue;
      }
      plain(text.substr(start, i - start));
      ids.push_back(special);
      i += tokens_[size_t(special)].size();
      start = i;
    }
    plain(text.substr(start));
    return ids;
  }

 private:
  void encode_piece(const std::string& piece, std::vector<int32_t>* out) const {
    std::vector<std::string> symbols;
    for (char c : piece) symbols.push_back(byte_to_unicode_[uint8_t(c)]);
    while (symbols.size() > 1) {
      int32_t best_rank = INT32_MAX;
      size_t best = 0;
      for (size_t i = 0; i + 1 < symbols.size(); ++i) {
        const auto it = ranks_.find(symbols[i] + " " + symbols[i + 1]);
        if (it != ranks_.end() && it->second < best_rank) {
          best_rank = it->second;
          best = i;
        }
      }
      if (best_rank == INT32_MAX) break;
      symbols[best] += symbols[best + 1];
      symbols.erase(symbols.begin() + std::ptrdiff_t(best) + 1);
    }
    for (const std::string& symbol : symbols) {
      const auto it = ids_.find(symbol);
      if (it != ids_.end()) {
        out->push_back(it->second);
        continue;
      }
      // Not a token: its bytes, each as its own token where it has one. Every stand-in
      // is one or two UTF-8 bytes; anything else in a symbol is skipped byte by byte.
      for (size_t k = 0; k < symbol.size();) {
        const size_t len = (uint8_t(symbol[k]) >= 0xc0 && k + 1 < symbol.size()) ? 2 : 1;
        const auto byte = unicode_to_byte_.find(symbol.substr(k, len));
        k += len;
        if (byte == unicode_to_byte_.end()) continue;
        const auto id = ids_.find(byte_to_unicode_[byte->second]);
        if (id != ids_.end()) out->push_back(id->second);
      }
    }
  }

  std::vector<std::string> tokens_;
  std::unordered_map<std::string, int32_t> ids_;
  std::unordered_map<std::string, int32_t> ranks_;
  std::vector<int32_t> specials_;
  std::string byte_to_unicode_[256];
  std::unordered_map<std::string, uint8_t> unicode_to_byte_;
  bool split_digits_ = false;
};

}  // namespace kvgc_test
