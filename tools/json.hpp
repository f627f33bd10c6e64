// A small strict JSON (RFC 8259) reader: enough for Hugging Face config.json files.
// Parses into a tree of json::Value; errors name the line and column.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace json {

class Value {
 public:
  enum class Kind { kNull, kBool, kNumber, kString, kArray, kObject };
  using Members = std::vector<std::pair<std::string, Value>>;

  Kind kind() const { return kind_; }
  bool is_null() const { return kind_ == Kind::kNull; }
  bool is_bool() const { return kind_ == Kind::kBool; }
  bool is_number() const { return kind_ == Kind::kNumber; }
  bool is_string() const { return kind_ == Kind::kString; }
  bool is_array() const { return kind_ == Kind::kArray; }
  bool is_object() const { return kind_ == Kind::kObject; }

  // Typed views: nullopt (or null) when the value is of another kind.
  std::optional<bool> as_bool() const;
  std::optional<double> as_number() const;
  // The number as an exact integer: a literal without fraction or exponent that fits
  // int64, or any number whose double value is a whole number within +-2^53.
  std::optional<int64_t> as_int() const;
  const std::string* as_string() const;
  const std::vector<Value>* as_array() const;
  const Members* as_object() const;

  // Member `key` of an object (the last one if repeated, as Python's json does);
  // null if this is not an object or has no such member.
  const Value* find(std::string_view key) const;

  static Value null() { return Value(); }
  static Value boolean(bool b);
  static Value number(double d, std::optional<int64_t> exact_int);
  static Value string(std::string s);
  static Value array(std::vector<Value> items);
  static Value object(Members members);

 private:
  Kind kind_ = Kind::kNull;
  bool bool_ = false;
  double number_ = 0;
  std::optional<int64_t> int_;
  std::string string_;
  std::vector<Value> items_;
  Members members_;
};

// Parses a whole document (one value, surrounded only by whitespace).
bool parse(std::string_view text, Value* out, std::string* err);
// Reads and parses a file; errors are prefixed with the path.
bool parse_file(const std::string& path, Value* out, std::string* err);

}  // namespace json
