#include "common/base/json.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstring>
#include <string>
#include <unordered_set>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

#include "common/base/logging.h"

namespace hmoe::json {

const char* TypeName(Type t) {
  switch (t) {
    case Type::kNull:
      return "null";
    case Type::kBool:
      return "bool";
    case Type::kNumber:
      return "number";
    case Type::kString:
      return "string";
    case Type::kArray:
      return "array";
    case Type::kObject:
      return "object";
  }
  return "?";
}

Value Value::Bool(bool b) {
  Value v;
  v.type_ = Type::kBool;
  v.bool_ = b;
  return v;
}

Value Value::Number(double d) {
  Value v;
  v.type_ = Type::kNumber;
  v.number_ = d;
  return v;
}

Value Value::Integer(int64_t i) {
  Value v;
  v.type_ = Type::kNumber;
  v.is_integer_ = true;
  v.integer_ = i;
  v.number_ = static_cast<double>(i);
  return v;
}

Value Value::String(std::string s) {
  Value v;
  v.type_ = Type::kString;
  v.string_ = std::move(s);
  return v;
}

Value Value::Array(std::vector<Value> items) {
  Value v;
  v.type_ = Type::kArray;
  v.items_ = std::move(items);
  return v;
}

Value Value::Object(std::vector<std::pair<std::string, Value>> members) {
  Value v;
  v.type_ = Type::kObject;
  v.members_ = std::move(members);
  return v;
}

bool Value::as_bool() const {
  HMOE_CHECK(is_bool()) << "json value is " << TypeName(type_);
  return bool_;
}

double Value::as_double() const {
  HMOE_CHECK(is_number()) << "json value is " << TypeName(type_);
  return number_;
}

int64_t Value::as_int() const {
  HMOE_CHECK(is_integer()) << "json value is " << TypeName(type_) << " (not an integer)";
  return integer_;
}

const std::string& Value::as_string() const {
  HMOE_CHECK(is_string()) << "json value is " << TypeName(type_);
  return string_;
}

const std::vector<Value>& Value::items() const {
  HMOE_CHECK(is_array()) << "json value is " << TypeName(type_);
  return items_;
}

const std::vector<std::pair<std::string, Value>>& Value::members() const {
  HMOE_CHECK(is_object()) << "json value is " << TypeName(type_);
  return members_;
}

const Value* Value::Find(std::string_view key) const {
  if (!is_object()) return nullptr;
  for (const auto& [k, v] : members_) {
    if (k == key) return &v;
  }
  return nullptr;
}

void Value::Append(Value v) {
  HMOE_CHECK(is_array()) << "json Append on " << TypeName(type_);
  items_.push_back(std::move(v));
}

void Value::Set(std::string key, Value v) {
  HMOE_CHECK(is_object()) << "json Set on " << TypeName(type_);
  for (auto& [k, existing] : members_) {
    if (k == key) {
      existing = std::move(v);
      return;
    }
  }
  members_.emplace_back(std::move(key), std::move(v));
}

// ---------------------------------------------------------------------------------- parser

namespace {

// Objects with more members than this check duplicates with a hash set instead of a scan.
constexpr size_t kLinearDuplicateScan = 16;

class Parser {
 public:
  Parser(std::string_view text, const ParseOptions& options) : text_(text), options_(options) {}

  absl::StatusOr<Value> ParseDocument() {
    if (text_.size() > options_.max_bytes) {
      return absl::InvalidArgumentError(
          absl::StrFormat("json: document of %d bytes exceeds the limit of %d bytes", text_.size(),
                          options_.max_bytes));
    }
    SkipWhitespace();
    Value v;
    if (absl::Status s = ParseValue(0, &v); !s.ok()) return s;
    SkipWhitespace();
    if (pos_ != text_.size()) return Error("unexpected data after the JSON value");
    return v;
  }

 private:
  absl::Status Error(std::string_view what) const { return ErrorAt(pos_, what); }
  absl::Status ErrorAt(size_t pos, std::string_view what) const {
    return absl::InvalidArgumentError(
        absl::StrFormat("json: %s at byte %d", absl::string_view(what.data(), what.size()), pos));
  }

  bool AtEnd() const { return pos_ >= text_.size(); }
  char Peek() const { return text_[pos_]; }

  void SkipWhitespace() {
    while (pos_ < text_.size()) {
      const char c = text_[pos_];
      if (c != ' ' && c != '\t' && c != '\n' && c != '\r') break;
      ++pos_;
    }
  }

  absl::Status ParseValue(size_t depth, Value* out) {
    if (AtEnd()) return Error("unexpected end of input, expected a value");
    switch (Peek()) {
      case '{':
        return ParseObject(depth + 1, out);
      case '[':
        return ParseArray(depth + 1, out);
      case '"': {
        std::string s;
        if (absl::Status st = ParseString(&s); !st.ok()) return st;
        *out = Value::String(std::move(s));
        return absl::OkStatus();
      }
      case 't':
        return ParseLiteral("true", Value::Bool(true), out);
      case 'f':
        return ParseLiteral("false", Value::Bool(false), out);
      case 'n':
        return ParseLiteral("null", Value::Null(), out);
      default:
        if (Peek() == '-' || (Peek() >= '0' && Peek() <= '9')) return ParseNumber(out);
        return Error(absl::StrFormat("unexpected character '%s'", Printable(Peek())));
    }
  }

  static std::string Printable(char c) {
    const auto u = static_cast<unsigned char>(c);
    if (u >= 0x20 && u < 0x7f) return std::string(1, c);
    return absl::StrFormat("\\x%02x", u);
  }

  absl::Status ParseLiteral(std::string_view word, Value value, Value* out) {
    if (text_.substr(pos_, word.size()) != word) return Error("invalid literal");
    pos_ += word.size();
    *out = std::move(value);
    return absl::OkStatus();
  }

  absl::Status ParseNumber(Value* out) {
    const size_t start = pos_;
    bool integral = true;
    if (Peek() == '-') ++pos_;
    if (AtEnd()) return ErrorAt(start, "invalid number: missing digits");
    if (Peek() == '0') {
      ++pos_;
    } else if (Peek() >= '1' && Peek() <= '9') {
      while (!AtEnd() && Peek() >= '0' && Peek() <= '9') ++pos_;
    } else {
      return ErrorAt(start, "invalid number: missing digits");
    }
    if (!AtEnd() && Peek() == '.') {
      integral = false;
      ++pos_;
      if (AtEnd() || Peek() < '0' || Peek() > '9') {
        return ErrorAt(start, "invalid number: missing digits after '.'");
      }
      while (!AtEnd() && Peek() >= '0' && Peek() <= '9') ++pos_;
    }
    if (!AtEnd() && (Peek() == 'e' || Peek() == 'E')) {
      integral = false;
      ++pos_;
      if (!AtEnd() && (Peek() == '+' || Peek() == '-')) ++pos_;
      if (AtEnd() || Peek() < '0' || Peek() > '9') {
        return ErrorAt(start, "invalid number: missing exponent digits");
      }
      while (!AtEnd() && Peek() >= '0' && Peek() <= '9') ++pos_;
    }
    const char* first = text_.data() + start;
    const char* last = text_.data() + pos_;
    double d = 0;
    const auto [dptr, derr] = std::from_chars(first, last, d);
    if (derr == std::errc::result_out_of_range) {
      // Underflow to zero is harmless; overflow would be infinity, which JSON cannot express.
      bool nonzero_mantissa = false;
      for (const char* p = first; p < last && *p != 'e' && *p != 'E'; ++p) {
        if (*p >= '1' && *p <= '9') nonzero_mantissa = true;
      }
      const char* e = std::find_if(first, last, [](char c) { return c == 'e' || c == 'E'; });
      const bool negative_exponent = e != last && e + 1 < last && e[1] == '-';
      if (nonzero_mantissa && !negative_exponent) {
        return ErrorAt(start, "number out of range");
      }
      d = 0;
    } else if (derr != std::errc() || dptr != last || !std::isfinite(d)) {
      return ErrorAt(start, "invalid number");
    }
    Value v = Value::Number(d);
    if (integral) {
      int64_t i = 0;
      const auto [iptr, ierr] = std::from_chars(first, last, i);
      if (ierr == std::errc() && iptr == last) v = Value::Integer(i);
      // Otherwise (beyond int64) the number stays a double only.
    }
    *out = std::move(v);
    return absl::OkStatus();
  }

  static int HexValue(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  }

  // Reads the 4 hex digits after "\u" at pos_ (pos_ points at the first digit).
  absl::Status ParseHex4(uint32_t* out) {
    if (text_.size() - pos_ < 4) return Error("truncated \\u escape");
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) {
      const int h = HexValue(text_[pos_ + i]);
      if (h < 0) return Error("invalid hex digit in \\u escape");
      v = (v << 4) | static_cast<uint32_t>(h);
    }
    pos_ += 4;
    *out = v;
    return absl::OkStatus();
  }

  static void AppendUtf8(uint32_t cp, std::string* out) {
    if (cp < 0x80) {
      out->push_back(static_cast<char>(cp));
    } else if (cp < 0x800) {
      out->push_back(static_cast<char>(0xc0 | (cp >> 6)));
      out->push_back(static_cast<char>(0x80 | (cp & 0x3f)));
    } else if (cp < 0x10000) {
      out->push_back(static_cast<char>(0xe0 | (cp >> 12)));
      out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3f)));
      out->push_back(static_cast<char>(0x80 | (cp & 0x3f)));
    } else {
      out->push_back(static_cast<char>(0xf0 | (cp >> 18)));
      out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3f)));
      out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3f)));
      out->push_back(static_cast<char>(0x80 | (cp & 0x3f)));
    }
  }

  // Validates one UTF-8 sequence starting at pos_ (a byte >= 0x80) and advances past it.
  absl::Status ConsumeUtf8Sequence() {
    const auto b0 = static_cast<unsigned char>(text_[pos_]);
    int len;
    uint32_t cp;
    if (b0 >= 0xc2 && b0 <= 0xdf) {
      len = 2;
      cp = b0 & 0x1f;
    } else if (b0 >= 0xe0 && b0 <= 0xef) {
      len = 3;
      cp = b0 & 0x0f;
    } else if (b0 >= 0xf0 && b0 <= 0xf4) {
      len = 4;
      cp = b0 & 0x07;
    } else {
      return Error("invalid UTF-8 in string");
    }
    if (text_.size() - pos_ < static_cast<size_t>(len)) return Error("truncated UTF-8 in string");
    for (int i = 1; i < len; ++i) {
      const auto b = static_cast<unsigned char>(text_[pos_ + i]);
      if ((b & 0xc0) != 0x80) return Error("invalid UTF-8 in string");
      cp = (cp << 6) | (b & 0x3f);
    }
    if ((len == 3 && cp < 0x800) || (len == 4 && (cp < 0x10000 || cp > 0x10ffff))) {
      return Error("overlong or out-of-range UTF-8 in string");
    }
    if (cp >= 0xd800 && cp <= 0xdfff) return Error("UTF-8 encoded surrogate in string");
    pos_ += len;
    return absl::OkStatus();
  }

  // pos_ points at the opening quote.
  absl::Status ParseString(std::string* out) {
    ++pos_;
    while (true) {
      // Copy a run of plain characters at once.
      const size_t run_start = pos_;
      while (pos_ < text_.size()) {
        const auto c = static_cast<unsigned char>(text_[pos_]);
        if (c == '"' || c == '\\' || c < 0x20) break;
        if (c >= 0x80) {
          if (absl::Status s = ConsumeUtf8Sequence(); !s.ok()) return s;
        } else {
          ++pos_;
        }
      }
      out->append(text_.data() + run_start, pos_ - run_start);
      if (AtEnd()) return Error("unterminated string");
      const char c = Peek();
      if (c == '"') {
        ++pos_;
        return absl::OkStatus();
      }
      if (c != '\\') return Error("unescaped control character in string");
      const size_t escape_pos = pos_;
      ++pos_;
      if (AtEnd()) return Error("unterminated string");
      const char e = Peek();
      ++pos_;
      switch (e) {
        case '"':
          out->push_back('"');
          break;
        case '\\':
          out->push_back('\\');
          break;
        case '/':
          out->push_back('/');
          break;
        case 'b':
          out->push_back('\b');
          break;
        case 'f':
          out->push_back('\f');
          break;
        case 'n':
          out->push_back('\n');
          break;
        case 'r':
          out->push_back('\r');
          break;
        case 't':
          out->push_back('\t');
          break;
        case 'u': {
          uint32_t cp = 0;
          if (absl::Status s = ParseHex4(&cp); !s.ok()) return s;
          if (cp >= 0xdc00 && cp <= 0xdfff) {
            return ErrorAt(escape_pos, "unpaired low surrogate in \\u escape");
          }
          if (cp >= 0xd800 && cp <= 0xdbff) {
            if (text_.size() - pos_ < 2 || text_[pos_] != '\\' || text_[pos_ + 1] != 'u') {
              return ErrorAt(escape_pos, "unpaired high surrogate in \\u escape");
            }
            pos_ += 2;
            uint32_t low = 0;
            if (absl::Status s = ParseHex4(&low); !s.ok()) return s;
            if (low < 0xdc00 || low > 0xdfff) {
              return ErrorAt(escape_pos, "high surrogate not followed by a low surrogate");
            }
            cp = 0x10000 + ((cp - 0xd800) << 10) + (low - 0xdc00);
          }
          AppendUtf8(cp, out);
          break;
        }
        default:
          return ErrorAt(escape_pos, "invalid escape in string");
      }
    }
  }

  absl::Status ParseArray(size_t depth, Value* out) {
    if (depth > options_.max_depth) return Error("nesting too deep");
    ++pos_;  // '['
    std::vector<Value> items;
    SkipWhitespace();
    if (!AtEnd() && Peek() == ']') {
      ++pos_;
      *out = Value::Array(std::move(items));
      return absl::OkStatus();
    }
    while (true) {
      SkipWhitespace();
      Value item;
      if (absl::Status s = ParseValue(depth, &item); !s.ok()) return s;
      items.push_back(std::move(item));
      SkipWhitespace();
      if (AtEnd()) return Error("unterminated array");
      if (Peek() == ',') {
        ++pos_;
        continue;
      }
      if (Peek() == ']') {
        ++pos_;
        break;
      }
      return Error("expected ',' or ']' in array");
    }
    *out = Value::Array(std::move(items));
    return absl::OkStatus();
  }

  absl::Status ParseObject(size_t depth, Value* out) {
    if (depth > options_.max_depth) return Error("nesting too deep");
    ++pos_;  // '{'
    std::vector<std::pair<std::string, Value>> members;
    std::unordered_set<std::string> seen;  // used once the object is large
    SkipWhitespace();
    if (!AtEnd() && Peek() == '}') {
      ++pos_;
      *out = Value::Object(std::move(members));
      return absl::OkStatus();
    }
    while (true) {
      SkipWhitespace();
      if (AtEnd()) return Error("unterminated object");
      if (Peek() != '"') return Error("expected a string key in object");
      const size_t key_pos = pos_;
      std::string key;
      if (absl::Status s = ParseString(&key); !s.ok()) return s;
      bool duplicate = false;
      if (members.size() < kLinearDuplicateScan) {
        for (const auto& m : members) {
          if (m.first == key) duplicate = true;
        }
      } else {
        if (seen.empty()) {
          for (const auto& m : members) seen.insert(m.first);
        }
        duplicate = !seen.insert(key).second;
      }
      if (duplicate) {
        return ErrorAt(key_pos, absl::StrCat("duplicate key \"", key, "\""));
      }
      SkipWhitespace();
      if (AtEnd() || Peek() != ':') return Error("expected ':' after object key");
      ++pos_;
      SkipWhitespace();
      Value v;
      if (absl::Status s = ParseValue(depth, &v); !s.ok()) return s;
      members.emplace_back(std::move(key), std::move(v));
      SkipWhitespace();
      if (AtEnd()) return Error("unterminated object");
      if (Peek() == ',') {
        ++pos_;
        continue;
      }
      if (Peek() == '}') {
        ++pos_;
        break;
      }
      return Error("expected ',' or '}' in object");
    }
    *out = Value::Object(std::move(members));
    return absl::OkStatus();
  }

  std::string_view text_;
  const ParseOptions& options_;
  size_t pos_ = 0;
};

// ------------------------------------------------------------------------------ serializer

void AppendEscaped(const std::string& s, std::string* out) {
  out->push_back('"');
  for (const char c : s) {
    switch (c) {
      case '"':
        out->append("\\\"");
        break;
      case '\\':
        out->append("\\\\");
        break;
      case '\b':
        out->append("\\b");
        break;
      case '\f':
        out->append("\\f");
        break;
      case '\n':
        out->append("\\n");
        break;
      case '\r':
        out->append("\\r");
        break;
      case '\t':
        out->append("\\t");
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          absl::StrAppendFormat(out, "\\u%04x", static_cast<unsigned char>(c));
        } else {
          out->push_back(c);
        }
    }
  }
  out->push_back('"');
}

void AppendDouble(double d, std::string* out) {
  if (!std::isfinite(d)) {
    out->append("null");  // JSON cannot represent inf/NaN.
    return;
  }
  char buf[64];
  // Shortest representation that parses back to exactly `d`.
  const auto [ptr, ec] = std::to_chars(buf, buf + sizeof(buf), d);
  HMOE_CHECK(ec == std::errc());
  std::string_view s(buf, static_cast<size_t>(ptr - buf));
  out->append(s);
  // Keep it visibly a floating-point number (Python reads "2.0" as float, "2" as int).
  if (s.find_first_of(".eE") == std::string_view::npos) out->append(".0");
}

void AppendNewline(int indent, int level, std::string* out) {
  out->push_back('\n');
  out->append(static_cast<size_t>(indent) * static_cast<size_t>(level), ' ');
}

void SerializeTo(const Value& v, int indent, int level, std::string* out) {
  switch (v.type()) {
    case Type::kNull:
      out->append("null");
      return;
    case Type::kBool:
      out->append(v.as_bool() ? "true" : "false");
      return;
    case Type::kNumber:
      if (v.is_integer()) {
        absl::StrAppend(out, v.as_int());
      } else {
        AppendDouble(v.as_double(), out);
      }
      return;
    case Type::kString:
      AppendEscaped(v.as_string(), out);
      return;
    case Type::kArray: {
      const auto& items = v.items();
      if (items.empty()) {
        out->append("[]");
        return;
      }
      out->push_back('[');
      for (size_t i = 0; i < items.size(); ++i) {
        if (i > 0) out->push_back(',');
        if (indent > 0) AppendNewline(indent, level + 1, out);
        SerializeTo(items[i], indent, level + 1, out);
      }
      if (indent > 0) AppendNewline(indent, level, out);
      out->push_back(']');
      return;
    }
    case Type::kObject: {
      const auto& members = v.members();
      if (members.empty()) {
        out->append("{}");
        return;
      }
      out->push_back('{');
      for (size_t i = 0; i < members.size(); ++i) {
        if (i > 0) out->push_back(',');
        if (indent > 0) AppendNewline(indent, level + 1, out);
        AppendEscaped(members[i].first, out);
        out->append(indent > 0 ? ": " : ":");
        SerializeTo(members[i].second, indent, level + 1, out);
      }
      if (indent > 0) AppendNewline(indent, level, out);
      out->push_back('}');
      return;
    }
  }
}

}  // namespace

absl::StatusOr<Value> Parse(std::string_view text, const ParseOptions& options) {
  return Parser(text, options).ParseDocument();
}

std::string Serialize(const Value& v, int indent) {
  std::string out;
  SerializeTo(v, indent, 0, &out);
  return out;
}

}  // namespace hmoe::json
