// Reads chosen members of a JSON document (a Hugging Face config.json) without building
// its tree: nlohmann's SAX parser (Debian's nlohmann-json3-dev, strict RFC 8259, UTF-8
// checked) streams the document and only the members at the paths asked for are kept.
// So peak memory is the text plus its longest string, whatever the document holds: an
// 8 MiB array of zeros or a million keys cost what the text costs (1.00x the input for
// arrays, objects, keys and nesting; 4.8x for one 8 MiB wanted string, whose token buffer
// doubles as it grows). The hand-written tree parser this replaced (381 lines) took 934 MB
// for the first and 510 MB for `{"":{},...}`. nlohmann rather than Debian's simdjson: both
// are strict and check UTF-8, but simdjson's parsers keep a structural index of about 4
// bytes per input byte and need a padded copy of the input, where the SAX parser keeps
// nothing; speed does not matter for a file of a few KiB.
// Errors name the line and column.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace json {

// A member's value as kept: scalars in full; an object or an array only as its kind.
struct Value {
  enum class Kind { kNull, kBool, kNumber, kString, kArray, kObject };
  Kind kind = Kind::kNull;
  bool boolean = false;
  double number = 0;
  // The number as an exact integer: a literal without fraction or exponent that fits
  // int64, or any number whose double value is a whole number within +-2^53.
  std::optional<int64_t> integer;
  std::string string;

  bool is_null() const { return kind == Kind::kNull; }
  bool is_object() const { return kind == Kind::kObject; }
  std::optional<int64_t> as_int() const { return kind == Kind::kNumber ? integer : std::nullopt; }
  std::optional<double> as_number() const {
    return kind == Kind::kNumber ? std::optional(number) : std::nullopt;
  }
  std::optional<bool> as_bool() const {
    return kind == Kind::kBool ? std::optional(boolean) : std::nullopt;
  }
  const std::string* as_string() const { return kind == Kind::kString ? &string : nullptr; }
};

// A member path: the keys from the root object down ({"text_config", "head_dim"}).
using Path = std::vector<std::string>;

struct Document {
  Value::Kind root = Value::Kind::kNull;  // the kind of the top-level value
  std::vector<std::pair<Path, Value>> members;  // the wanted members found (last one wins)

  // The member at `path`, or null if the document has none there.
  const Value* find(const Path& path) const;
};

// Nesting deeper than this is refused (a config nests two or three levels), and so is a
// wanted string member over 64 KiB (config values are names and dtypes).
constexpr int kMaxDepth = 512;

// Parses a whole document (one value, surrounded only by whitespace), keeping the
// members at `wanted`.
bool parse(std::string_view text, const std::vector<Path>& wanted, Document* out,
           std::string* err);
// Reads and parses a regular file of at most 8 MiB; errors are prefixed with the path.
bool parse_file(const std::string& path, const std::vector<Path>& wanted, Document* out,
                std::string* err);

}  // namespace json
