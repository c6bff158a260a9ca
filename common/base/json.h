#pragma once

// A small JSON document model and parser for the JSON we read: config.json, safetensors headers,
// model.safetensors.index.json, tokenizer.json. All of it can be untrusted input, so parsing
// never throws or crashes: malformed text yields InvalidArgument naming the byte offset, and
// nesting depth and document size are bounded. Numbers keep both an exact int64 (when the
// literal is an integer that fits) and a double. Objects keep key order and reject duplicate keys.

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

namespace hmoe::json {

enum class Type { kNull, kBool, kNumber, kString, kArray, kObject };

// Returns "null", "bool", "number", "string", "array" or "object".
const char* TypeName(Type t);

class Value {
 public:
  Value() = default;  // null
  static Value Null() { return Value(); }
  static Value Bool(bool b);
  static Value Number(double d);
  static Value Integer(int64_t i);
  static Value String(std::string s);
  static Value Array(std::vector<Value> items = {});
  static Value Object(std::vector<std::pair<std::string, Value>> members = {});

  Type type() const { return type_; }
  bool is_null() const { return type_ == Type::kNull; }
  bool is_bool() const { return type_ == Type::kBool; }
  bool is_number() const { return type_ == Type::kNumber; }
  // True for a number written as an integer literal (no fraction/exponent) that fits in int64.
  bool is_integer() const { return type_ == Type::kNumber && is_integer_; }
  bool is_string() const { return type_ == Type::kString; }
  bool is_array() const { return type_ == Type::kArray; }
  bool is_object() const { return type_ == Type::kObject; }

  // Accessors require the matching type (HMOE_CHECK); use the is_*() predicates first.
  bool as_bool() const;
  double as_double() const;
  int64_t as_int() const;  // requires is_integer()
  const std::string& as_string() const;
  const std::vector<Value>& items() const;                            // array
  const std::vector<std::pair<std::string, Value>>& members() const;  // object, in document order

  // Object lookup; nullptr when absent or when this is not an object.
  const Value* Find(std::string_view key) const;

  // Builders for writers (tools that emit config.json / tokenizer.json / safetensors headers).
  void Append(Value v);                // array
  void Set(std::string key, Value v);  // object; replaces an existing key

 private:
  Type type_ = Type::kNull;
  bool bool_ = false;
  bool is_integer_ = false;
  double number_ = 0;
  int64_t integer_ = 0;
  std::string string_;
  std::vector<Value> items_;
  std::vector<std::pair<std::string, Value>> members_;
};

struct ParseOptions {
  size_t max_depth = 64;
  size_t max_bytes = size_t{1} << 30;
};

// Parses one JSON value; trailing whitespace is allowed, anything else after it is an error.
absl::StatusOr<Value> Parse(std::string_view text, const ParseOptions& options = {});

// Serializes compactly (no spaces) or, with indent > 0, pretty-printed. Doubles are written with
// enough digits to round-trip; integers exactly. Strings are escaped as JSON requires (UTF-8
// passes through unchanged).
std::string Serialize(const Value& v, int indent = 0);

}  // namespace hmoe::json
