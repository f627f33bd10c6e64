#include "json.hpp"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>

namespace json {
namespace {

// config.json files are a few KiB: a larger file is not one (and is not read).
constexpr uint64_t kMaxFileBytes = 8 << 20;
// A wanted string member (a name, a dtype) longer than this is refused rather than kept.
constexpr size_t kMaxStringBytes = 64 << 10;

// An input iterator over the text that tells how far the parser has read, so that
// errors this reader raises itself (depth, number range) get a line and column too.
class TrackedIterator {
 public:
  using iterator_category = std::input_iterator_tag;
  using value_type = char;
  using difference_type = std::ptrdiff_t;
  using pointer = const char*;
  using reference = const char&;

  TrackedIterator(const char* p, const char** read_to) : p_(p), read_to_(read_to) {}
  reference operator*() const { return *p_; }
  TrackedIterator& operator++() {
    *read_to_ = ++p_;
    return *this;
  }
  TrackedIterator operator++(int) {
    TrackedIterator t = *this;
    ++*this;
    return t;
  }
  bool operator==(const TrackedIterator& o) const { return p_ == o.p_; }
  bool operator!=(const TrackedIterator& o) const { return p_ != o.p_; }

 private:
  const char* p_;
  const char** read_to_;
};

using Sax = nlohmann::json_sax<nlohmann::json>;

// Keeps the wanted members, nothing else. Memory: one key per open object up to the
// deepest wanted path, a bit per nesting level, and the wanted values.
class Handler final : public Sax {
 public:
  Handler(const std::vector<Path>& wanted, Document* out) : wanted_(wanted), out_(out) {
    for (const Path& p : wanted) max_path_ = std::max(max_path_, p.size());
  }

  std::string error;       // set when this handler stops the parse
  size_t error_at = 0;     // with the byte offset nlohmann gave (parse errors)
  bool error_has_at = false;

  bool null() override { return value(Value{}); }
  bool boolean(bool b) override {
    Value v;
    v.kind = Value::Kind::kBool;
    v.boolean = b;
    return value(std::move(v));
  }
  bool number_integer(number_integer_t i) override {
    return value(number(double(i), int64_t(i)));
  }
  bool number_unsigned(number_unsigned_t u) override {
    return value(number(double(u), u <= uint64_t(INT64_MAX) ? std::optional<int64_t>(int64_t(u))
                                                            : std::nullopt));
  }
  bool number_float(number_float_t d, const string_t&) override {
    if (!std::isfinite(d)) return stop("number out of range");
    std::optional<int64_t> exact;
    if (d == std::floor(d) && std::fabs(d) <= 9007199254740992.0) exact = int64_t(d);
    return value(number(d, exact));
  }
  bool string(string_t& s) override {
    Value v;
    v.kind = Value::Kind::kString;
    if (matches() && s.size() > kMaxStringBytes)
      return stop("a string of " + std::to_string(s.size()) + " bytes where at most " +
                  std::to_string(kMaxStringBytes) + " are read");
    if (matches()) v.string = std::move(s);
    return value(std::move(v));
  }
  bool binary(binary_t&) override { return stop("binary values are not JSON"); }
  bool start_object(std::size_t) override { return open(Value::Kind::kObject); }
  bool key(string_t& k) override {
    if (depth_ <= max_path_) keys_[depth_ - 1] = std::move(k);
    return true;
  }
  bool end_object() override { return close(); }
  bool start_array(std::size_t) override { return open(Value::Kind::kArray); }
  bool end_array() override { return close(); }
  bool parse_error(std::size_t position, const std::string&,
                   const nlohmann::detail::exception& ex) override {
    // "[json.exception.parse_error.101] parse error at line 1, column 2: syntax error
    // ..." -> the part after the position (ours is computed the same way for all errors).
    std::string what = ex.what();
    const size_t col = what.find("column ");
    const size_t colon = col == std::string::npos ? std::string::npos : what.find(": ", col);
    error = colon == std::string::npos ? what : what.substr(colon + 2);
    error_at = position > 0 ? position - 1 : 0;
    error_has_at = true;
    return false;
  }

 private:
  static Value number(double d, std::optional<int64_t> exact) {
    Value v;
    v.kind = Value::Kind::kNumber;
    v.number = d;
    v.integer = exact;
    return v;
  }

  bool stop(std::string msg) {
    error = std::move(msg);
    return false;
  }

  // Whether the value now arriving sits at a wanted path: every enclosing container an
  // object, and the keys down to it one of the paths.
  bool matches() const {
    if (depth_ == 0 || depth_ > max_path_ || !all_objects()) return false;
    for (const Path& p : wanted_) {
      if (p.size() != depth_) continue;
      if (std::equal(p.begin(), p.end(), keys_)) return true;
    }
    return false;
  }
  bool all_objects() const {
    for (size_t d = 0; d < depth_ && d < max_path_; ++d)
      if (!is_object_[d]) return false;
    return true;
  }

  bool value(Value v) {
    if (depth_ == 0) out_->root = v.kind;
    if (!matches()) return true;
    Path path(keys_, keys_ + depth_);
    for (auto& [p, old] : out_->members)
      if (p == path) {  // a repeated key: the last one wins, as in Python
        old = std::move(v);
        return true;
      }
    out_->members.emplace_back(std::move(path), std::move(v));
    return true;
  }

  bool open(Value::Kind kind) {
    Value v;
    v.kind = kind;
    if (!value(std::move(v))) return false;
    if (depth_ == size_t(kMaxDepth))
      return stop("nested deeper than " + std::to_string(kMaxDepth) + " levels");
    if (depth_ < max_path_) is_object_[depth_] = kind == Value::Kind::kObject;
    ++depth_;
    return true;
  }
  bool close() {
    --depth_;
    return true;
  }

  static constexpr size_t kMaxPath = 4;
  const std::vector<Path>& wanted_;
  Document* out_;
  size_t max_path_ = 0;
  size_t depth_ = 0;
  std::string keys_[kMaxPath];  // the key being read at each depth (up to max_path_)
  bool is_object_[kMaxPath] = {};
};

std::string position(std::string_view text, size_t at) {
  size_t line = 1, col = 1;
  for (size_t i = 0; i < at && i < text.size(); ++i) {
    col = text[i] == '\n' ? 1 : col + 1;
    line += text[i] == '\n';
  }
  return "line " + std::to_string(line) + ", column " + std::to_string(col);
}

}  // namespace

const Value* Document::find(const Path& path) const {
  for (const auto& [p, v] : members)
    if (p == path) return &v;
  return nullptr;
}

bool parse(std::string_view text, const std::vector<Path>& wanted, Document* out,
           std::string* err) {
  for (const Path& p : wanted)
    if (p.empty() || p.size() > 4) {
      if (err) *err = "internal: member paths have 1 to 4 keys";
      return false;
    }
  Document doc;
  Handler h(wanted, &doc);
  const char* read_to = text.data();
  const bool ok = nlohmann::json::sax_parse(TrackedIterator(text.data(), &read_to),
                                            TrackedIterator(text.data() + text.size(), &read_to),
                                            &h, nlohmann::json::input_format_t::json,
                                            /*strict=*/true);
  if (ok) {
    *out = std::move(doc);
    return true;
  }
  const size_t at = h.error_has_at ? h.error_at : size_t(read_to - text.data());
  if (err) *err = position(text, at) + ": " + (h.error.empty() ? "malformed JSON" : h.error);
  return false;
}

bool parse_file(const std::string& path, const std::vector<Path>& wanted, Document* out,
                std::string* err) {
  auto failed = [&](const std::string& why) {
    if (err) *err = path + ": " + why;
    return false;
  };
  struct stat st {};
  if (stat(path.c_str(), &st) != 0) return failed(std::strerror(errno));
  if (!S_ISREG(st.st_mode))
    return failed("not a regular file (a config.json must be one: devices and pipes are not "
                  "read)");
  if (uint64_t(st.st_size) > kMaxFileBytes)
    return failed(std::to_string(st.st_size) + " bytes; a config.json has at most 8 MiB");
  if (st.st_size == 0) return failed("empty file; expected a JSON object");
  std::ifstream in(path, std::ios::binary);
  if (!in) return failed("cannot open for reading");
  std::string text(size_t(st.st_size), '\0');
  if (!in.read(text.data(), std::streamsize(text.size()))) return failed("read failed");
  std::string msg;
  if (parse(text, wanted, out, &msg)) return true;
  return failed(msg);
}

}  // namespace json
