#include "json.hpp"

#include <charconv>
#include <cmath>
#include <fstream>

namespace json {
namespace {

constexpr int kMaxDepth = 256;                  // deeper input is hostile, not a config
// config.json files are a few KiB; the cap bounds the tree a hostile file can build.
constexpr std::streamoff kMaxFileBytes = 8 << 20;

class Parser {
 public:
  explicit Parser(std::string_view text) : s_(text) {}

  bool document(Value* out, std::string* err) {
    skip_space();
    if (!value(out, 0)) return report(err);
    skip_space();
    if (pos_ != s_.size()) {
      fail("unexpected text after the JSON value");
      return report(err);
    }
    return true;
  }

 private:
  bool fail(std::string msg) {
    if (error_.empty()) error_ = std::move(msg);
    return false;
  }

  bool report(std::string* err) {
    size_t line = 1, col = 1;
    for (size_t i = 0; i < pos_ && i < s_.size(); ++i) {
      col = s_[i] == '\n' ? 1 : col + 1;
      line += s_[i] == '\n';
    }
    if (err) *err = "line " + std::to_string(line) + ", column " + std::to_string(col) + ": " +
                    error_;
    return false;
  }

  bool at_end() const { return pos_ >= s_.size(); }
  char peek() const { return at_end() ? '\0' : s_[pos_]; }

  void skip_space() {
    while (!at_end() && (s_[pos_] == ' ' || s_[pos_] == '\t' || s_[pos_] == '\n' ||
                         s_[pos_] == '\r'))
      ++pos_;
  }

  bool literal(std::string_view word) {
    if (s_.substr(pos_, word.size()) != word)
      return fail("invalid literal; expected a value (string, number, object, array, "
                  "true, false or null)");
    pos_ += word.size();
    return true;
  }

  bool value(Value* out, int depth) {
    if (depth > kMaxDepth) return fail("nested deeper than " + std::to_string(kMaxDepth));
    if (at_end()) return fail("unexpected end of input; expected a value");
    switch (peek()) {
      case '{': return object(out, depth);
      case '[': return array(out, depth);
      case '"': {
        std::string s;
        if (!string(&s)) return false;
        *out = Value::string(std::move(s));
        return true;
      }
      case 't': *out = Value::boolean(true); return literal("true");
      case 'f': *out = Value::boolean(false); return literal("false");
      case 'n': *out = Value::null(); return literal("null");
      default: return number(out);
    }
  }

  bool object(Value* out, int depth) {
    ++pos_;  // '{'
    Value::Members members;
    skip_space();
    if (peek() == '}') {
      ++pos_;
      *out = Value::object(std::move(members));
      return true;
    }
    for (;;) {
      skip_space();
      if (peek() != '"') return fail("expected a string key in the object");
      std::string key;
      if (!string(&key)) return false;
      skip_space();
      if (peek() != ':') return fail("expected ':' after the object key");
      ++pos_;
      skip_space();
      Value v;
      if (!value(&v, depth + 1)) return false;
      members.emplace_back(std::move(key), std::move(v));
      skip_space();
      if (peek() == ',') {
        ++pos_;
        continue;
      }
      if (peek() == '}') {
        ++pos_;
        *out = Value::object(std::move(members));
        return true;
      }
      return fail("expected ',' or '}' in the object");
    }
  }

  bool array(Value* out, int depth) {
    ++pos_;  // '['
    std::vector<Value> items;
    skip_space();
    if (peek() == ']') {
      ++pos_;
      *out = Value::array(std::move(items));
      return true;
    }
    for (;;) {
      skip_space();
      Value v;
      if (!value(&v, depth + 1)) return false;
      items.push_back(std::move(v));
      skip_space();
      if (peek() == ',') {
        ++pos_;
        continue;
      }
      if (peek() == ']') {
        ++pos_;
        *out = Value::array(std::move(items));
        return true;
      }
      return fail("expected ',' or ']' in the array");
    }
  }

  bool hex4(uint32_t* out) {
    if (s_.size() - pos_ < 4) return fail("\\u needs four hex digits");
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) {
      const char c = s_[pos_++];
      v <<= 4;
      if (c >= '0' && c <= '9') v |= uint32_t(c - '0');
      else if (c >= 'a' && c <= 'f') v |= uint32_t(c - 'a' + 10);
      else if (c >= 'A' && c <= 'F') v |= uint32_t(c - 'A' + 10);
      else return fail("\\u needs four hex digits");
    }
    *out = v;
    return true;
  }

  static void append_utf8(std::string* s, uint32_t cp) {
    if (cp < 0x80) {
      s->push_back(char(cp));
    } else if (cp < 0x800) {
      s->push_back(char(0xC0 | (cp >> 6)));
      s->push_back(char(0x80 | (cp & 0x3F)));
    } else if (cp < 0x10000) {
      s->push_back(char(0xE0 | (cp >> 12)));
      s->push_back(char(0x80 | ((cp >> 6) & 0x3F)));
      s->push_back(char(0x80 | (cp & 0x3F)));
    } else {
      s->push_back(char(0xF0 | (cp >> 18)));
      s->push_back(char(0x80 | ((cp >> 12) & 0x3F)));
      s->push_back(char(0x80 | ((cp >> 6) & 0x3F)));
      s->push_back(char(0x80 | (cp & 0x3F)));
    }
  }

  // A \uXXXX escape (the 'u' already consumed), joining UTF-16 surrogate pairs.
  bool unicode_escape(std::string* out) {
    uint32_t cp;
    if (!hex4(&cp)) return false;
    if (cp >= 0xDC00 && cp <= 0xDFFF) return fail("\\u escape is a lone low surrogate");
    if (cp >= 0xD800 && cp <= 0xDBFF) {
      uint32_t low;
      if (s_.substr(pos_, 2) != "\\u") return fail("\\u high surrogate without its low half");
      pos_ += 2;
      if (!hex4(&low)) return false;
      if (low < 0xDC00 || low > 0xDFFF) return fail("\\u high surrogate without its low half");
      cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
    }
    append_utf8(out, cp);
    return true;
  }

  bool string(std::string* out) {
    ++pos_;  // opening quote
    for (;;) {
      if (at_end()) return fail("unterminated string");
      const char c = s_[pos_++];
      if (c == '"') return true;
      if (static_cast<unsigned char>(c) < 0x20) {
        --pos_;
        return fail("control character in a string; it must be escaped");
      }
      if (c != '\\') {
        out->push_back(c);
        continue;
      }
      if (at_end()) return fail("unterminated string");
      switch (const char e = s_[pos_++]) {
        case '"': case '\\': case '/': out->push_back(e); break;
        case 'b': out->push_back('\b'); break;
        case 'f': out->push_back('\f'); break;
        case 'n': out->push_back('\n'); break;
        case 'r': out->push_back('\r'); break;
        case 't': out->push_back('\t'); break;
        case 'u':
          if (!unicode_escape(out)) return false;
          break;
        default:
          --pos_;
          return fail(std::string("invalid escape \\") + e);
      }
    }
  }

  bool digits() {
    const size_t start = pos_;
    while (!at_end() && s_[pos_] >= '0' && s_[pos_] <= '9') ++pos_;
    return pos_ > start;
  }

  // -?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?
  bool number(Value* out) {
    const size_t start = pos_;
    const auto bad = [&] {
      pos_ = start;
      return fail("invalid number; expected a value (string, number, object, array, true, "
                  "false or null)");
    };
    if (peek() == '-') ++pos_;
    if (peek() == '0') {
      ++pos_;
    } else if (!digits()) {
      return bad();
    }
    bool integral = true;
    if (peek() == '.') {
      ++pos_;
      integral = false;
      if (!digits()) return bad();
    }
    if (peek() == 'e' || peek() == 'E') {
      ++pos_;
      integral = false;
      if (peek() == '+' || peek() == '-') ++pos_;
      if (!digits()) return bad();
    }
    if (peek() >= '0' && peek() <= '9') return bad();  // "01"
    const char* first = s_.data() + start;
    const char* last = s_.data() + pos_;
    double d = 0;
    const auto r = std::from_chars(first, last, d);
    if (r.ec != std::errc() || r.ptr != last || !std::isfinite(d)) {
      pos_ = start;
      return fail("number out of range");
    }
    std::optional<int64_t> exact;
    int64_t i;
    if (integral && std::from_chars(first, last, i).ec == std::errc()) exact = i;
    *out = Value::number(d, exact);
    return true;
  }

  std::string_view s_;
  size_t pos_ = 0;
  std::string error_;
};

}  // namespace

std::optional<bool> Value::as_bool() const {
  return kind_ == Kind::kBool ? std::optional(bool_) : std::nullopt;
}

std::optional<double> Value::as_number() const {
  return kind_ == Kind::kNumber ? std::optional(number_) : std::nullopt;
}

std::optional<int64_t> Value::as_int() const {
  if (kind_ != Kind::kNumber) return std::nullopt;
  if (int_) return int_;
  constexpr double kExact = 9007199254740992.0;  // 2^53: every whole double below is exact
  if (std::trunc(number_) == number_ && std::fabs(number_) <= kExact) return int64_t(number_);
  return std::nullopt;
}

const std::string* Value::as_string() const {
  return kind_ == Kind::kString ? &string_ : nullptr;
}

const std::vector<Value>* Value::as_array() const {
  return kind_ == Kind::kArray ? &items_ : nullptr;
}

const Value::Members* Value::as_object() const {
  return kind_ == Kind::kObject ? &members_ : nullptr;
}

const Value* Value::find(std::string_view key) const {
  if (kind_ != Kind::kObject) return nullptr;
  for (auto it = members_.rbegin(); it != members_.rend(); ++it)
    if (it->first == key) return &it->second;
  return nullptr;
}

Value Value::boolean(bool b) {
  Value v;
  v.kind_ = Kind::kBool;
  v.bool_ = b;
  return v;
}

Value Value::number(double d, std::optional<int64_t> exact_int) {
  Value v;
  v.kind_ = Kind::kNumber;
  v.number_ = d;
  v.int_ = exact_int;
  return v;
}

Value Value::string(std::string s) {
  Value v;
  v.kind_ = Kind::kString;
  v.string_ = std::move(s);
  return v;
}

Value Value::array(std::vector<Value> items) {
  Value v;
  v.kind_ = Kind::kArray;
  v.items_ = std::move(items);
  return v;
}

Value Value::object(Members members) {
  Value v;
  v.kind_ = Kind::kObject;
  v.members_ = std::move(members);
  return v;
}

bool parse(std::string_view text, Value* out, std::string* err) {
  return Parser(text).document(out, err);
}

bool parse_file(const std::string& path, Value* out, std::string* err) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    if (err) *err = path + ": cannot open for reading";
    return false;
  }
  in.seekg(0, std::ios::end);
  const std::streamoff size = in.tellg();
  if (size < 0 || size > kMaxFileBytes) {
    if (err) *err = path + ": not a readable file of at most 8 MiB";
    return false;
  }
  in.seekg(0);
  std::string text(size_t(size), '\0');
  if (!in.read(text.data(), size)) {
    if (err) *err = path + ": read failed";
    return false;
  }
  std::string msg;
  if (parse(text, out, &msg)) return true;
  if (err) *err = path + ": " + msg;
  return false;
}

}  // namespace json
