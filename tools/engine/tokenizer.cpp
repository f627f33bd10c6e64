#include "engine/tokenizer.hpp"

#include <algorithm>
#include <climits>

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
  ids_.clear();
  specials_.clear();
  for (size_t i = 0; i < tokens_.size(); ++i) {
    ids_.emplace(tokens_[i], int32_t(i));
    if ((types_[i] == kTokenControl || types_[i] == kTokenUserDefined) && !tokens_[i].empty()) {
      specials_.push_back(int32_t(i));
    }
  }
  std::stable_sort(specials_.begin(), specials_.end(), [&](int32_t a, int32_t b) {
    return tokens_[size_t(a)].size() > tokens_[size_t(b)].size();
  });
  merge_ranks_.clear();
  for (size_t i = 0; i < merges->size(); ++i) merge_ranks_.emplace((*merges)[i], int32_t(i));

  // GPT-2's bytes_to_unicode: printable Latin-1 bytes stand for themselves, the rest are
  // moved to U+0100 onwards in byte order.
  uint32_t next = 256;
  unicode_to_byte_.clear();
  for (uint32_t b = 0; b < 256; ++b) {
    const bool printable = in(b, '!', '~') || in(b, 0xa1, 0xac) || in(b, 0xae, 0xff);
    const uint32_t cp = printable ? b : next++;
    byte_to_unicode_[b] = encode_utf8(cp);
    unicode_to_byte_[cp] = uint8_t(b);
  }
  const bool has_bytes = ids_.count(byte_to_unicode_[uint8_t('a')]) &&
                         ids_.count(byte_to_unicode_[uint8_t(' ')]);
  if (!has_bytes) {
    return fail("the vocabulary has no byte tokens; not a byte-level BPE vocabulary");
  }
  const std::string pre = file.get_string("tokenizer.ggml.pre").value_or("default");
  split_digits_ = pre == "smollm" || pre == "starcoder" || pre == "refact";
  bos_ = int32_t(file.get_uint("tokenizer.ggml.bos_token_id").value_or(uint64_t(-1)));
  eos_ = int32_t(file.get_uint("tokenizer.ggml.eos_token_id").value_or(uint64_t(-1)));
  return true;
}

void Tokenizer::encode_piece(const std::string& piece, std::vector<int32_t>* out) const {
  std::vector<std::string> symbols;
  symbols.reserve(piece.size());
  for (char c : piece) symbols.push_back(byte_to_unicode_[uint8_t(c)]);
  while (symbols.size() > 1) {
    int32_t best_rank = INT32_MAX;
    size_t best = 0;
    for (size_t i = 0; i + 1 < symbols.size(); ++i) {
      const auto it = merge_ranks_.find(symbols[i] + " " + symbols[i + 1]);
      if (it != merge_ranks_.end() && it->second < best_rank) {
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
    // A merge whose result is not in the vocabulary: fall back to its bytes. Bytes with
    // no token of their own (SmolLM has none for 0xC0, which UTF-8 never uses, or for a
    // few control characters) are dropped, as the reference tokenizer drops them.
    for (const CodePoint& cp : decode_utf8(symbol)) {
      const auto byte = unicode_to_byte_.find(cp.value);
      if (byte == unicode_to_byte_.end()) continue;
      const auto id = ids_.find(byte_to_unicode_[byte->second]);
      if (id != ids_.end()) out->push_back(id->second);
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
      for (int32_t id : specials_) {
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
  const auto it = ids_.find(std::string(token));
  return it == ids_.end() ? -1 : it->second;
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
