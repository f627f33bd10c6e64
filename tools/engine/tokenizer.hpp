// The byte-level BPE tokenizer of GPT-2-style GGUF vocabularies (tokenizer.ggml.model
// "gpt2"): text is split by the GPT-2 pre-tokenizer, each piece's bytes are mapped to the
// printable stand-ins GPT-2 uses, and merges are applied lowest rank first (leftmost on
// ties) through a priority queue of adjacent pairs: O(n log n) for an n-byte piece.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "gguf.hpp"

namespace engine {

// Splits text the way the GPT-2 regex does ('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+|
// ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+). With split_digits (SmolLM's "smollm" pre-tokenizer),
// every digit is first cut out on its own. Unicode classes are approximated for
// non-ASCII text: known whitespace, digits and punctuation ranges, letters otherwise.
std::vector<std::string> pre_tokenize(std::string_view text, bool split_digits);

class Tokenizer {
 public:
  // Reads tokens, token types, merges and special ids. False with *err if the vocabulary
  // is missing or not byte-level BPE.
  bool load(const gguf::File& file, std::string* err);

  // Token ids of `text`. With parse_special, control tokens written in the text
  // (<|im_start|>, <|im_end|>, <|endoftext|>, ...) become their ids.
  std::vector<int32_t> encode(std::string_view text, bool parse_special = true) const;
  // The bytes a token stands for (a control token: its text).
  std::string token_bytes(int32_t id) const;
  std::string decode(const std::vector<int32_t>& ids) const;

  int32_t find(std::string_view token) const;  // -1 if absent
  size_t size() const { return tokens_.size(); }
  int32_t bos() const { return bos_; }
  int32_t eos() const { return eos_; }
  bool is_control(int32_t id) const;

 private:
  // What merging two adjacent symbols gives, and the merge's rank (lower merges first).
  struct Merge {
    int32_t rank;
    int32_t result;  // a symbol
  };
  void encode_piece(std::string_view piece, std::vector<int32_t>* out) const;
  int32_t intern(const std::string& text);  // the symbol spelling `text`, added if new
  const Merge* find_merge(int32_t left, int32_t right) const;

  std::vector<std::string> tokens_;   // in GPT-2's byte-to-unicode form
  std::vector<int32_t> types_;        // 1 normal, 3 control, 4 user defined, ...
  // Symbols: every token and every string a piece's merging can produce (the byte
  // stand-ins, each merge's parts and result), numbered; a merge is a pair of symbols.
  std::unordered_map<std::string, int32_t> symbol_ids_;
  std::vector<const std::string*> symbol_text_;  // keys of symbol_ids_
  std::vector<int32_t> symbol_token_;  // its (first) token id, -1 if not in the vocabulary
  // (left << 32 | right) -> merge, open addressing with linear probing (one cache miss
  // a lookup where a node-based map took two or three); kEmptyKey marks a free slot.
  struct MergeSlot {
    uint64_t key;
    Merge merge;
  };
  static constexpr uint64_t kEmptyKey = ~uint64_t(0);
  std::vector<MergeSlot> merges_;
  uint32_t merge_shift_ = 64;  // slot = hash(key) >> merge_shift_
  int32_t byte_symbol_[256] = {};
  std::vector<int32_t> specials_[256];  // control/user-defined ids by first byte, longest first
  std::string byte_to_unicode_[256];    // UTF-8 of each byte's stand-in
  std::unordered_map<uint32_t, uint8_t> unicode_to_byte_;
  bool split_digits_ = false;
  int32_t bos_ = -1;
  int32_t eos_ = -1;
};

struct ChatMessage {
  std::string role;  // "system", "user", "assistant"
  std::string content;
};

// ChatML, as SmolLM2's template writes it: a default system message when none is given,
// then "<|im_start|>role\ncontent<|im_end|>\n" per message and, with add_generation_prompt,
// "<|im_start|>assistant\n".
std::string apply_chat_template(const std::vector<ChatMessage>& messages,
                                bool add_generation_prompt);

}  // namespace engine
