#include "engine/tokenizer.hpp"

#include <algorithm>
#include <climits>
#include <queue>

namespace engine {
namespace {

constexpr int32_t kTokenControl = 3;
constexpr int32_t kTokenUserDefined = 4;

struct CodePoint {
  uint32_t value;
  size_t offset;  // of its first byte in the text
  size_t length;  // in bytes
};

// Decodes UTF-8; a malformed byte becomes a code point of its own so no byte is lost.
std::vector<CodePoint> decode_utf8(std::string_view text) {
  std::vector<CodePoint> out;
  size_t i = 0;
  while (i < text.size()) {
    const uint8_t lead = uint8_t(text[i]);
    size_t length = lead < 0x80 ? 1 : (lead >> 5) == 6 ? 2 : (lead >> 4) == 14 ? 3
                  : (lead >> 3) == 30 ? 4 : 0;
    uint32_t value = length == 1 ? lead : length == 2 ? lead & 0x1f
                   : length == 3 ? lead & 0x0f : lead & 0x07;
    if (length == 0 || i + length > text.size()) length = 0;
    for (size_t k = 1; k < length; ++k) {
      const uint8_t cont = uint8_t(text[i + k]);
      if ((cont >> 6) != 2) {
        length = 0;
        break;
      }
      value = (value << 6) | (cont & 0x3f);
    }
    if (length == 0) {
      out.push_back({0xFFFD0000u | lead, i, 1});  // outside Unicode: classified as "other"
      ++i;
      continue;
    }
    out.push_back({value, i, length});
    i += length;
  }
  return out;
}

std::string encode_utf8(uint32_t cp) {
  std::string s;
  if (cp < 0x80) {
    s += char(cp);
  } else if (cp < 0x800) {
    s += char(0xc0 | (cp >> 6));
    s += char(0x80 | (cp & 0x3f));
  } else if (cp < 0x10000) {
    s += char(0xe0 | (cp >> 12));
    s += char(0x80 | ((cp >> 6) & 0x3f));
    s += char(0x80 | (cp & 0x3f));
  } else {
    s += char(0xf0 | (cp >> 18));
    s += char(0x80 | ((cp >> 12) & 0x3f));
    s += char(0x80 | ((cp >> 6) & 0x3f));
    s += char(0x80 | (cp & 0x3f));
  }
  return s;
}

enum class CharClass { kLetter, kNumber, kSpace, kOther };

bool in(uint32_t cp, uint32_t lo, uint32_t hi) { return cp >= lo && cp <= hi; }

CharClass classify(uint32_t cp) {
  if (cp < 0x80) {
    if ((cp >= 'a' && cp <= 'z') || (cp >= 'A' && cp <= 'Z')) return CharClass::kLetter;
    if (cp >= '0' && cp <= '9') return CharClass::kNumber;
    if (cp == ' ' || in(cp, 0x09, 0x0d)) return CharClass::kSpace;
    return CharClass::kOther;
  }
  if (cp > 0x10FFFF) return CharClass::kOther;  // a malformed byte
  if (cp == 0x85 || cp == 0xa0 || cp == 0x1680 || in(cp, 0x2000, 0x200a) || cp == 0x2028 ||
      cp == 0x2029 || cp == 0x202f || cp == 0x205f || cp == 0x3000) {
    return CharClass::kSpace;
  }
  if (cp == 0xb2 || cp == 0xb3 || cp == 0xb9 || in(cp, 0xbc, 0xbe) || in(cp, 0x660, 0x669) ||
      in(cp, 0x6f0, 0x6f9) || in(cp, 0x966, 0x96f) || in(cp, 0x2070, 0x2079) ||
      in(cp, 0x2080, 0x2089) || in(cp, 0x2150, 0x2189) || in(cp, 0x2460, 0x249b) ||
      in(cp, 0xff10, 0xff19)) {
    return CharClass::kNumber;
  }
  if (cp == 0xaa || cp == 0xb5 || cp == 0xba) return CharClass::kLetter;
  if (in(cp, 0x80, 0xbf) || cp == 0xd7 || cp == 0xf7 || in(cp, 0x2000, 0x2bff) ||
      in(cp, 0x3001, 0x303f) || in(cp, 0xfe30, 0xfe4f) || in(cp, 0xff00, 0xff0f) ||
      in(cp, 0xff1a, 0xff20) || in(cp, 0xff3b, 0xff40) || in(cp, 0xff5b, 0xff65) ||
      in(cp, 0x1f000, 0x1faff) || in(cp, 0xe000, 0xf8ff) || in(cp, 0x300, 0x36f)) {
    return CharClass::kOther;
  }
  return CharClass::kLetter;
}

bool is_contraction_at(const std::vector<CodePoint>& cps, size_t i, size_t end, size_t* len) {
  if (cps[i].value != '\'' || i + 1 >= end) return false;
  const uint32_t a = cps[i + 1].value;
  if (a == 's' || a == 't' || a == 'm' || a == 'd') {
    *len = 2;
    return true;
  }
  if (i + 2 < end) {
    const uint32_t b = cps[i + 2].value;
    if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) {
      *len = 3;
      return true;
    }
  }
  return false;
}

// The GPT-2 regex over code points [begin, end), appending [first, last) ranges.
void split_gpt2(const std::vector<CodePoint>& cps, size_t begin, size_t end,
                std::vector<std::pair<size_t, size_t>>* pieces) {
  auto cls = [&](size_t k) { return classify(cps[k].value); };
  size_t i = begin;
  while (i < end) {
    size_t len = 0;
    if (is_contraction_at(cps, i, end, &len)) {
      pieces->push_back({i, i + len});
      i += len;
      continue;
    }
    // " ?\p{L}+", " ?\p{N}+", " ?[^\s\p{L}\p{N}]+": an optional space, then one class.
    size_t j = i;
    if (cps[j].value == ' ' && j + 1 < end && cls(j + 1) != CharClass::kSpace) ++j;
    const CharClass run = cls(j);
    if (run != CharClass::kSpace) {
      size_t k = j + 1;
      while (k < end && cls(k) == run) ++k;
      pieces->push_back({i, k});
      i = k;
      continue;
    }
    // "\s+(?!\S)|\s+": a whitespace run leaves its last char to the word that follows.
    size_t k = i;
    while (k < end && cls(k) == CharClass::kSpace) ++k;
    if (k < end && k - i > 1) --k;
    pieces->push_back({i, k});
    i = k;
  }
}

std::string bytes_of(std::string_view text, const std::vector<CodePoint>& cps, size_t first,
                     size_t last) {
  const size_t from = cps[first].offset;
  const size_t to = cps[last - 1].offset + cps[last - 1].length;
  return std::string(text.substr(from, to - from));
}

}  // namespace

std::vector<std::string> pre_tokenize(std::string_view text, bool split_digits) {
  const std::vector<CodePoint> cps = decode_utf8(text);
  std::vector<std::pair<size_t, size_t>> pieces;
  size_t i = 0;
  while (i < cps.size()) {
    if (split_digits && classify(cps[i].value) == CharClass::kNumber) {
      pieces.push_back({i, i + 1});
      ++i;
      continue;
    }
    size_t k = i;
    while (k < cps.size() && !(split_digits && classify(cps[k].value) == CharClass::kNumber)) {
      ++k;
    }
    split_gpt2(cps, i, k, &pieces);
    i = k;
  }
  std::vector<std::string> out;
  out.reserve(pieces.size());
  for (auto [first, last] : pieces) out.push_back(bytes_of(text, cps, first, last));
  return out;
}

bool Tokenizer::load(const gguf::File& file, std::string* err) {
  auto fail = [&](const std::string& message) {
    if (err) *err = message;
    return false;
  };
  const std::string model = file.get_string("tokenizer.ggml.model").value_or("");
  if (model != "gpt2") {
    return fail("tokenizer.ggml.model is '" + model + "'; only byte-level BPE (gpt2) is supported");
  }
  const auto tokens_array = file.get_array("tokenizer.ggml.tokens");
  const auto merges_array = file.get_array("tokenizer.ggml.merges");
  if (!tokens_array || !merges_array) return fail("missing tokenizer.ggml.tokens or merges");
  auto tokens = file.strings(*tokens_array);
  auto merges = file.strings(*merges_array);
  if (!tokens || !merges) return fail("tokenizer.ggml.tokens/merges are not string arrays");
  tokens_ = std::move(*tokens);
  types_.assign(tokens_.size(), 1);
  if (const auto types_array = file.get_array("tokenizer.ggml.token_type")) {
    const auto types = file.ints(*types_array);
    if (!types || types->size() != tokens_.size()) {
      return fail("tokenizer.ggml.token_type does not match the tokens");
    }
    for (size_t i = 0; i < types->size(); ++i) types_[i] = int32_t((*types)[i]);
  }
  symbol_ids_.clear();
  symbol_text_.clear();
  symbol_token_.clear();
  for (auto& bucket : specials_) bucket.clear();
  std::vector<int32_t> specials;
  for (size_t i = 0; i < tokens_.size(); ++i) {
    const int32_t symbol = intern(tokens_[i]);
    if (symbol_token_[size_t(symbol)] < 0) symbol_token_[size_t(symbol)] = int32_t(i);
    if ((types_[i] == kTokenControl || types_[i] == kTokenUserDefined) && !tokens_[i].empty()) {
      specials.push_back(int32_t(i));
    }
  }
  std::stable_sort(specials.begin(), specials.end(), [&](int32_t a, int32_t b) {
    return tokens_[size_t(a)].size() > tokens_[size_t(b)].size();
  });
  for (int32_t id : specials) specials_[uint8_t(tokens_[size_t(id)][0])].push_back(id);

  // GPT-2's bytes_to_unicode: printable Latin-1 bytes stand for themselves, the rest are
  // moved to U+0100 onwards in byte order.
  uint32_t next = 256;
  unicode_to_byte_.clear();
  for (uint32_t b = 0; b < 256; ++b) {
    const bool printable = in(b, '!', '~') || in(b, 0xa1, 0xac) || in(b, 0xae, 0xff);
    const uint32_t cp = printable ? b : next++;
    byte_to_unicode_[b] = encode_utf8(cp);
    unicode_to_byte_[cp] = uint8_t(b);
    byte_symbol_[b] = intern(byte_to_unicode_[b]);
  }
  if (find(byte_to_unicode_[uint8_t('a')]) < 0 || find(byte_to_unicode_[uint8_t(' ')]) < 0) {
    return fail("the vocabulary has no byte tokens; not a byte-level BPE vocabulary");
  }
  // A merge "left right" applies to adjacent symbols spelling left and right. Symbols
  // are concatenations of byte stand-ins, none of which is a space, so only merges with
  // exactly one space and two non-empty sides can ever apply; the first of duplicates
  // wins.
  merge_shift_ = 64 - 4;  // at least 16 slots, at most half full
  while ((uint64_t(1) << (64 - merge_shift_)) < 2 * uint64_t(merges->size())) --merge_shift_;
  merges_.assign(size_t(1) << (64 - merge_shift_), MergeSlot{kEmptyKey, {}});
  for (size_t i = 0; i < merges->size(); ++i) {
    const std::string& m = (*merges)[i];
    const size_t space = m.find(' ');
    if (space == std::string::npos || space == 0 || space + 1 == m.size() ||
        m.find(' ', space + 1) != std::string::npos) {
      continue;
    }
    const int32_t left = intern(m.substr(0, space));
    const int32_t right = intern(m.substr(space + 1));
    const int32_t result = intern(m.substr(0, space) + m.substr(space + 1));
    const uint64_t key = uint64_t(uint32_t(left)) << 32 | uint32_t(right);
    const size_t mask = merges_.size() - 1;
    size_t slot = size_t((key * 0x9e3779b97f4a7c15ull) >> merge_shift_);
    while (merges_[slot].key != kEmptyKey && merges_[slot].key != key) slot = (slot + 1) & mask;
    if (merges_[slot].key == kEmptyKey) merges_[slot] = {key, {int32_t(i), result}};
  }
  const std::string pre = file.get_string("tokenizer.ggml.pre").value_or("default");
  split_digits_ = pre == "smollm" || pre == "starcoder" || pre == "refact";
  bos_ = int32_t(file.get_uint("tokenizer.ggml.bos_token_id").value_or(uint64_t(-1)));
  eos_ = int32_t(file.get_uint("tokenizer.ggml.eos_token_id").value_or(uint64_t(-1)));
  return true;
}

int32_t Tokenizer::intern(const std::string& text) {
  const auto [it, added] = symbol_ids_.emplace(text, int32_t(symbol_text_.size()));
  if (added) {
    symbol_text_.push_back(&it->first);
    symbol_token_.push_back(-1);
  }
  return it->second;
}

const Tokenizer::Merge* Tokenizer::find_merge(int32_t left, int32_t right) const {
  if (merges_.empty()) return nullptr;
  const uint64_t key = uint64_t(uint32_t(left)) << 32 | uint32_t(right);
  const size_t mask = merges_.size() - 1;
  for (size_t slot = size_t((key * 0x9e3779b97f4a7c15ull) >> merge_shift_);;
       slot = (slot + 1) & mask) {
    if (merges_[slot].key == key) return &merges_[slot].merge;
    if (merges_[slot].key == kEmptyKey) return nullptr;
  }
}

// BPE over one piece: repeatedly merge the adjacent pair of lowest rank, the leftmost of
// equals. The symbols form a linked list over the piece's byte positions and every
// adjacent pair that has a merge waits in a min-heap keyed (rank, position); a popped
// pair whose symbols have changed since it was pushed is stale and skipped. An n-byte
// piece starts with n - 1 pairs and each merge pushes at most 2, so it costs at most 3n
// heap operations: O(n log n) (the rescanning merge it replaced was O(n^2)).
void Tokenizer::encode_piece(std::string_view piece, std::vector<int32_t>* out) const {
  struct Symbol {
    int32_t id;          // -1 once merged into its left neighbour
    int32_t prev, next;  // positions of the neighbours, -1 / n at the ends
  };
  struct Pair {
    int32_t rank, left, right;
    bool operator>(const Pair& o) const {
      return rank != o.rank ? rank > o.rank : left > o.left;
    }
  };
  const int32_t n = int32_t(piece.size());
  std::vector<Symbol> symbols(static_cast<size_t>(n));
  for (int32_t i = 0; i < n; ++i) symbols[size_t(i)] = {byte_symbol_[uint8_t(piece[size_t(i)])], i - 1, i + 1};
  std::vector<Pair> heap_storage;
  heap_storage.reserve(size_t(n));
  std::priority_queue<Pair, std::vector<Pair>, std::greater<Pair>> pairs(
      std::greater<Pair>(), std::move(heap_storage));
  auto push = [&](int32_t left, int32_t right) {
    if (left < 0 || right >= n) return;
    if (const Merge* m = find_merge(symbols[size_t(left)].id, symbols[size_t(right)].id)) {
      pairs.push({m->rank, left, right});
    }
  };
  for (int32_t i = 0; i + 1 < n; ++i) push(i, i + 1);
  while (!pairs.empty()) {
    const Pair p = pairs.top();
    pairs.pop();
    Symbol& left = symbols[size_t(p.left)];
    Symbol& right = symbols[size_t(p.right)];
    if (left.id < 0 || right.id < 0 || left.next != p.right) continue;  // stale
    const Merge* m = find_merge(left.id, right.id);
    if (m == nullptr || m->rank != p.rank) continue;  // a symbol changed: stale
    left.id = m->result;
    right.id = -1;
    left.next = right.next;
    if (right.next < n) symbols[size_t(right.next)].prev = p.left;
    push(left.prev, p.left);
    push(p.left, left.next);
  }
  for (int32_t i = 0; i < n; i = symbols[size_t(i)].next) {
    const int32_t symbol = symbols[size_t(i)].id;
    if (const int32_t token = symbol_token_[size_t(symbol)]; token >= 0) {
      out->push_back(token);
      continue;
    }
    // A merge whose result is not in the vocabulary: fall back to its bytes. Bytes with
    // no token of their own (SmolLM has none for 0xC0, which UTF-8 never uses, or for a
    // few control characters) are dropped, as the reference tokenizer drops them.
    for (const CodePoint& cp : decode_utf8(*symbol_text_[size_t(symbol)])) {
      const auto byte = unicode_to_byte_.find(cp.value);
      if (byte == unicode_to_byte_.end()) continue;
      const int32_t id = symbol_token_[size_t(byte_symbol_[byte->second])];
      if (id >= 0) out->push_back(id);
    }
  }
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool parse_special) const {
  std::vector<int32_t> ids;
  auto encode_plain = [&](std::string_view plain) {
    for (const std::string& piece : pre_tokenize(plain, split_digits_)) {
      encode_piece(piece, &ids);
    }
  };
  size_t start = 0, i = 0;
  while (i < text.size()) {
    int32_t special = -1;
    if (parse_special) {
      for (int32_t id : specials_[uint8_t(text[i])]) {
        if (text.substr(i).starts_with(tokens_[size_t(id)])) {
          special = id;
          break;
        }
      }
    }
    if (special < 0) {
      ++i;
      continue;
    }
    encode_plain(text.substr(start, i - start));
    ids.push_back(special);
    i += tokens_[size_t(special)].size();
    start = i;
  }
  encode_plain(text.substr(start));
  return ids;
}

bool Tokenizer::is_control(int32_t id) const {
  return id >= 0 && size_t(id) < types_.size() && types_[size_t(id)] == kTokenControl;
}

std::string Tokenizer::token_bytes(int32_t id) const {
  if (id < 0 || size_t(id) >= tokens_.size()) return {};
  const std::string& token = tokens_[size_t(id)];
  const int32_t type = types_[size_t(id)];
  if (type == kTokenControl || type == kTokenUserDefined) return token;
  std::string bytes;
  for (const CodePoint& cp : decode_utf8(token)) {
    const auto it = unicode_to_byte_.find(cp.value);
    if (it != unicode_to_byte_.end()) {
      bytes += char(it->second);
    } else {
      bytes.append(token, cp.offset, cp.length);
    }
  }
  return bytes;
}

std::string Tokenizer::decode(const std::vector<int32_t>& ids) const {
  std::string text;
  for (int32_t id : ids) text += token_bytes(id);
  return text;
}

int32_t Tokenizer::find(std::string_view token) const {
  const auto it = symbol_ids_.find(std::string(token));
  return it == symbol_ids_.end() ? -1 : symbol_token_[size_t(it->second)];
}

std::string apply_chat_template(const std::vector<ChatMessage>& messages,
                                bool add_generation_prompt) {
  std::string out;
  if (messages.empty() || messages.front().role != "system") {
    out += "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
           "Hugging Face<|im_end|>\n";
  }
  for (const ChatMessage& m : messages) {
    out += "<|im_start|>" + m.role + "\n" + m.content + "<|im_end|>\n";
  }
  if (add_generation_prompt) out += "<|im_start|>assistant\n";
  return out;
}

}  // namespace engine
