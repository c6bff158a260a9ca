#include "common/chat/jinja.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <utility>
#include <vector>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

#include "common/base/status_macros.h"

namespace hmoe::jinja {
namespace {

constexpr char kRaisedPayload[] = "hmoe.jinja/raise_exception";

absl::Status LineError(int line, const std::string& message) {
  return absl::InvalidArgumentError(absl::StrCat("chat template line ", line, ": ", message));
}

// ----------------------------------------------------------------------------- UTF-8

std::vector<char32_t> Decode(std::string_view s) {
  std::vector<char32_t> out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    int n = c < 0x80 ? 1 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4;
    if (i + n > s.size()) n = 1;
    char32_t cp = n == 1 ? c : n == 2 ? (c & 0x1F) : n == 3 ? (c & 0x0F) : (c & 0x07);
    for (int k = 1; k < n; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
    out.push_back(cp);
    i += n;
  }
  return out;
}

void AppendUtf8(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

std::string Encode(const std::vector<char32_t>& cps, size_t begin, size_t end) {
  std::string out;
  for (size_t i = begin; i < end; ++i) AppendUtf8(out, cps[i]);
  return out;
}

bool ValidUtf8(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    int n;
    if (c < 0x80) {
      n = 1;
    } else if (c >= 0xC2 && c < 0xE0) {
      n = 2;
    } else if (c >= 0xE0 && c < 0xF0) {
      n = 3;
    } else if (c >= 0xF0 && c < 0xF5) {
      n = 4;
    } else {
      return false;
    }
    if (i + n > s.size()) return false;
    for (int k = 1; k < n; ++k) {
      if ((static_cast<unsigned char>(s[i + k]) & 0xC0) != 0x80) return false;
    }
    i += n;
  }
  return true;
}

// Python's str.isspace().
bool IsPySpace(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 ||
         c == 0x1680 || (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F ||
         c == 0x205F || c == 0x3000;
}

// Python's str.rstrip() / lstrip() with no argument, on UTF-8.
std::string PyRstrip(std::string_view s) {
  std::vector<char32_t> cps = Decode(s);
  size_t end = cps.size();
  while (end > 0 && IsPySpace(cps[end - 1])) --end;
  return Encode(cps, 0, end);
}
std::string PyLstrip(std::string_view s) {
  std::vector<char32_t> cps = Decode(s);
  size_t begin = 0;
  while (begin < cps.size() && IsPySpace(cps[begin])) ++begin;
  return Encode(cps, begin, cps.size());
}

// ----------------------------------------------------------------------------- values

struct Value;
using Args = std::vector<Value>;
using KwArgs = std::vector<std::pair<std::string, Value>>;
using Func = std::function<absl::StatusOr<Value>(const Args&, const KwArgs&)>;

enum class Kind { kUndefined, kNone, kBool, kInt, kFloat, kString, kList, kDict, kObject, kFunc };

struct Dict {
  std::vector<std::pair<std::string, Value>> items;
  Value* Find(std::string_view key);
  void Set(const std::string& key, Value v);
};

struct Value {
  Kind kind = Kind::kUndefined;
  bool b = false;
  int64_t i = 0;
  double f = 0;
  // kString: the text; kUndefined: what was undefined; kObject: its type; kList: the repr of a
  // range() (empty for other lists).
  std::string s;
  std::shared_ptr<std::vector<Value>> list;
  bool tuple = false;
  std::shared_ptr<Dict> dict;  // kDict, kObject (namespace, loop).
  std::shared_ptr<Func> func;

  static Value Undefined(std::string hint) {
    Value v;
    v.s = std::move(hint);
    return v;
  }
  static Value None() {
    Value v;
    v.kind = Kind::kNone;
    return v;
  }
  static Value Bool(bool x) {
    Value v;
    v.kind = Kind::kBool;
    v.b = x;
    return v;
  }
  static Value Int(int64_t x) {
    Value v;
    v.kind = Kind::kInt;
    v.i = x;
    return v;
  }
  static Value Float(double x) {
    Value v;
    v.kind = Kind::kFloat;
    v.f = x;
    return v;
  }
  static Value Str(std::string x) {
    Value v;
    v.kind = Kind::kString;
    v.s = std::move(x);
    return v;
  }
  static Value List(std::vector<Value> items, bool tuple = false) {
    Value v;
    v.kind = Kind::kList;
    v.list = std::make_shared<std::vector<Value>>(std::move(items));
    v.tuple = tuple;
    return v;
  }
  static Value NewDict() {
    Value v;
    v.kind = Kind::kDict;
    v.dict = std::make_shared<Dict>();
    return v;
  }
  static Value Object(std::string type) {
    Value v;
    v.kind = Kind::kObject;
    v.s = std::move(type);
    v.dict = std::make_shared<Dict>();
    return v;
  }
  static Value Function(Func fn) {
    Value v;
    v.kind = Kind::kFunc;
    v.func = std::make_shared<Func>(std::move(fn));
    return v;
  }
  bool IsNumber() const {
    return kind == Kind::kInt || kind == Kind::kFloat || kind == Kind::kBool;
  }
  double AsDouble() const {
    return kind == Kind::kFloat ? f : kind == Kind::kBool ? (b ? 1 : 0) : static_cast<double>(i);
  }
};

Value* Dict::Find(std::string_view key) {
  for (auto& [k, v] : items) {
    if (k == key) return &v;
  }
  return nullptr;
}
void Dict::Set(const std::string& key, Value v) {
  if (Value* old = Find(key)) {
    *old = std::move(v);
  } else {
    items.emplace_back(key, std::move(v));
  }
}

std::string TypeName(const Value& v) {
  switch (v.kind) {
    case Kind::kUndefined:
      return "undefined";
    case Kind::kNone:
      return "NoneType";
    case Kind::kBool:
      return "bool";
    case Kind::kInt:
      return "int";
    case Kind::kFloat:
      return "float";
    case Kind::kString:
      return "str";
    case Kind::kList:
      return v.tuple ? "tuple" : "list";
    case Kind::kDict:
      return "dict";
    case Kind::kObject:
      return v.s;
    case Kind::kFunc:
      return "function";
  }
  return "?";
}

// Values nest at most this deep (JSON input, literals): recursion stays far from the stack's end.
constexpr int kMaxDepth = 200;

absl::StatusOr<Value> FromJson(const nlohmann::ordered_json& j, int depth = 0) {
  if (depth > kMaxDepth) {
    return absl::InvalidArgumentError(
        absl::StrCat("JSON value nested deeper than ", kMaxDepth, " levels"));
  }
  switch (j.type()) {
    case nlohmann::ordered_json::value_t::null:
      return Value::None();
    case nlohmann::ordered_json::value_t::boolean:
      return Value::Bool(j.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer:
      return Value::Int(j.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_unsigned: {
      const auto u = j.get<uint64_t>();
      if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        return absl::InvalidArgumentError(absl::StrCat("integer ", u, " is out of range"));
      }
      return Value::Int(static_cast<int64_t>(u));
    }
    case nlohmann::ordered_json::value_t::number_float:
      return Value::Float(j.get<double>());
    case nlohmann::ordered_json::value_t::string:
      return Value::Str(j.get<std::string>());
    case nlohmann::ordered_json::value_t::array: {
      std::vector<Value> items;
      for (const auto& e : j) {
        HMOE_ASSIGN_OR_RETURN(Value v, FromJson(e, depth + 1));
        items.push_back(std::move(v));
      }
      return Value::List(std::move(items));
    }
    case nlohmann::ordered_json::value_t::object: {
      Value d = Value::NewDict();
      for (const auto& [k, e] : j.items()) {
        HMOE_ASSIGN_OR_RETURN(Value v, FromJson(e, depth + 1));
        d.dict->items.emplace_back(k, std::move(v));
      }
      return d;
    }
    default:
      return absl::InvalidArgumentError("unsupported JSON value (binary or discarded)");
  }
}

// Python's float repr (shortest round-trip digits, exponent form below 1e-4 and from 1e16).
std::string PyFloatRepr(double x) {
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof(buf), x, std::chars_format::scientific);
  std::string sci(buf, r.ptr);  // e.g. "-1.2345e+17"
  bool neg = false;
  if (sci[0] == '-') {
    neg = true;
    sci = sci.substr(1);
  }
  const size_t epos = sci.find('e');
  const int exp = std::stoi(sci.substr(epos + 1));
  std::string digits;
  for (size_t k = 0; k < epos; ++k) {
    if (sci[k] != '.') digits += sci[k];
  }
  std::string out = neg ? "-" : "";
  const int decpt = exp + 1;
  if (decpt <= -4 || decpt > 16) {
    out += digits[0];
    if (digits.size() > 1) out += "." + digits.substr(1);
    out += absl::StrFormat("e%c%02d", exp < 0 ? '-' : '+', exp < 0 ? -exp : exp);
  } else if (decpt <= 0) {
    out += "0." + std::string(-decpt, '0') + digits;
  } else if (static_cast<size_t>(decpt) >= digits.size()) {
    out += digits + std::string(decpt - digits.size(), '0') + ".0";
  } else {
    out += digits.substr(0, decpt) + "." + digits.substr(decpt);
  }
  return out;
}

struct JsonStyle {
  bool ensure_ascii = false;
  std::optional<std::string> indent;
  std::string item_sep = ", ";
  std::string key_sep = ": ";
  bool sort_keys = false;
};

void JsonString(std::string& out, std::string_view s, bool ensure_ascii) {
  out += '"';
  for (char32_t c : Decode(s)) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\f':
        out += "\\f";
        break;
      default:
        if (c < 0x20 || (ensure_ascii && c >= 0x7F)) {
          if (c >= 0x10000) {
            const char32_t v = c - 0x10000;
            out += absl::StrFormat("\\u%04x\\u%04x", 0xD800 + (v >> 10), 0xDC00 + (v & 0x3FF));
          } else {
            out += absl::StrFormat("\\u%04x", static_cast<uint32_t>(c));
          }
        } else {
          AppendUtf8(out, c);
        }
    }
  }
  out += '"';
}

absl::Status JsonDump(std::string& out, const Value& v, const JsonStyle& style, int level) {
  const auto newline = [&](int lvl) {
    out += '\n';
    for (int k = 0; k < lvl; ++k) out += *style.indent;
  };
  switch (v.kind) {
    case Kind::kNone:
      out += "null";
      return absl::OkStatus();
    case Kind::kBool:
      out += v.b ? "true" : "false";
      return absl::OkStatus();
    case Kind::kInt:
      out += std::to_string(v.i);
      return absl::OkStatus();
    case Kind::kFloat:
      out += std::isnan(v.f)   ? "NaN"
             : std::isinf(v.f) ? (v.f > 0 ? "Infinity" : "-Infinity")
                               : PyFloatRepr(v.f);
      return absl::OkStatus();
    case Kind::kString:
      JsonString(out, v.s, style.ensure_ascii);
      return absl::OkStatus();
    case Kind::kList: {
      if (!v.s.empty()) {
        return absl::InvalidArgumentError("tojson: object of type range is not JSON serializable");
      }
      if (v.list->empty()) {
        out += "[]";
        return absl::OkStatus();
      }
      out += '[';
      if (style.indent) newline(level + 1);
      bool first = true;
      for (const Value& e : *v.list) {
        if (!first) {
          out += style.item_sep;
          if (style.indent) newline(level + 1);
        }
        first = false;
        HMOE_RETURN_IF_ERROR(JsonDump(out, e, style, level + 1));
      }
      if (style.indent) newline(level);
      out += ']';
      return absl::OkStatus();
    }
    case Kind::kDict: {
      if (v.dict->items.empty()) {
        out += "{}";
        return absl::OkStatus();
      }
      std::vector<const std::pair<std::string, Value>*> items;
      for (const auto& kv : v.dict->items) items.push_back(&kv);
      if (style.sort_keys) {
        std::stable_sort(items.begin(), items.end(),
                         [](auto* a, auto* b) { return a->first < b->first; });
      }
      out += '{';
      if (style.indent) newline(level + 1);
      bool first = true;
      for (const auto* kv : items) {
        if (!first) {
          out += style.item_sep;
          if (style.indent) newline(level + 1);
        }
        first = false;
        JsonString(out, kv->first, style.ensure_ascii);
        out += style.key_sep;
        HMOE_RETURN_IF_ERROR(JsonDump(out, kv->second, style, level + 1));
      }
      if (style.indent) newline(level);
      out += '}';
      return absl::OkStatus();
    }
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("tojson: object of type ", TypeName(v), " is not JSON serializable"));
  }
}

// Python repr of a str. Non-ASCII text is refused rather than approximated: Python escapes the
// code points it deems unprintable, a table this engine does not carry.
absl::StatusOr<std::string> PyStrRepr(std::string_view s) {
  const bool has_single = s.find('\'') != std::string_view::npos;
  const bool has_double = s.find('"') != std::string_view::npos;
  const char quote = has_single && !has_double ? '"' : '\'';
  std::string out(1, quote);
  for (char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    if (c >= 0x80) {
      return absl::InvalidArgumentError(
          "printing a list or dict that holds non-ASCII text (Python repr) is not supported");
    }
    if (ch == quote || ch == '\\') {
      out += '\\';
      out += ch;
    } else if (ch == '\n') {
      out += "\\n";
    } else if (ch == '\r') {
      out += "\\r";
    } else if (ch == '\t') {
      out += "\\t";
    } else if (c < 0x20 || c == 0x7F) {
      out += absl::StrFormat("\\x%02x", c);
    } else {
      out += ch;
    }
  }
  out += quote;
  return out;
}

absl::StatusOr<std::string> PyStr(const Value& v);

absl::StatusOr<std::string> PyRepr(const Value& v) {
  if (v.kind == Kind::kString) return PyStrRepr(v.s);
  if (v.kind == Kind::kList && !v.s.empty()) return v.s;  // A range.
  if (v.kind == Kind::kList) {
    std::string out = v.tuple ? "(" : "[";
    for (size_t k = 0; k < v.list->size(); ++k) {
      if (k) out += ", ";
      HMOE_ASSIGN_OR_RETURN(std::string e, PyRepr((*v.list)[k]));
      out += e;
    }
    if (v.tuple && v.list->size() == 1) out += ",";
    out += v.tuple ? ")" : "]";
    return out;
  }
  if (v.kind == Kind::kDict) {
    std::string out = "{";
    bool first = true;
    for (const auto& [k, e] : v.dict->items) {
      if (!first) out += ", ";
      first = false;
      HMOE_ASSIGN_OR_RETURN(std::string ks, PyStrRepr(k));
      HMOE_ASSIGN_OR_RETURN(std::string es, PyRepr(e));
      out += ks + ": " + es;
    }
    return out + "}";
  }
  return PyStr(v);
}

// Python's str(v), what {{ v }} prints.
absl::StatusOr<std::string> PyStr(const Value& v) {
  switch (v.kind) {
    case Kind::kUndefined:
      return std::string();
    case Kind::kNone:
      return std::string("None");
    case Kind::kBool:
      return std::string(v.b ? "True" : "False");
    case Kind::kInt:
      return std::to_string(v.i);
    case Kind::kFloat:
      return PyFloatRepr(v.f);
    case Kind::kString:
      return v.s;
    case Kind::kList:
    case Kind::kDict:
      return PyRepr(v);
    default:
      return absl::InvalidArgumentError(absl::StrCat("cannot print a ", TypeName(v)));
  }
}

bool Truthy(const Value& v) {
  switch (v.kind) {
    case Kind::kUndefined:
    case Kind::kNone:
      return false;
    case Kind::kBool:
      return v.b;
    case Kind::kInt:
      return v.i != 0;
    case Kind::kFloat:
      return v.f != 0;
    case Kind::kString:
      return !v.s.empty();
    case Kind::kList:
      return !v.list->empty();
    case Kind::kDict:
      return !v.dict->items.empty();
    default:
      return true;
  }
}

bool Equal(const Value& a, const Value& b) {
  if (a.IsNumber() && b.IsNumber()) {
    if (a.kind == Kind::kFloat || b.kind == Kind::kFloat) return a.AsDouble() == b.AsDouble();
    return (a.kind == Kind::kBool ? a.b : a.i) == (b.kind == Kind::kBool ? b.b : b.i);
  }
  if (a.kind != b.kind) return false;
  switch (a.kind) {
    case Kind::kUndefined:
    case Kind::kNone:
      return true;
    case Kind::kString:
      return a.s == b.s;
    case Kind::kList:
      if (a.tuple != b.tuple || a.list->size() != b.list->size()) return false;
      for (size_t k = 0; k < a.list->size(); ++k) {
        if (!Equal((*a.list)[k], (*b.list)[k])) return false;
      }
      return true;
    case Kind::kDict:
      if (a.dict->items.size() != b.dict->items.size()) return false;
      for (const auto& [k, v] : a.dict->items) {
        const Value* o = b.dict->Find(k);
        if (o == nullptr || !Equal(v, *o)) return false;
      }
      return true;
    default:
      return a.dict == b.dict && a.func == b.func;
  }
}

// -1, 0, 1 for <, ==, > between numbers, strings or lists (Python's ordering).
absl::StatusOr<int> Order(const Value& a, const Value& b) {
  if (a.IsNumber() && b.IsNumber()) {
    const double x = a.AsDouble(), y = b.AsDouble();
    if (a.kind != Kind::kFloat && b.kind != Kind::kFloat) {
      const int64_t p = a.kind == Kind::kBool ? a.b : a.i, q = b.kind == Kind::kBool ? b.b : b.i;
      return p < q ? -1 : p > q ? 1 : 0;
    }
    return x < y ? -1 : x > y ? 1 : 0;
  }
  if (a.kind == Kind::kString && b.kind == Kind::kString) {
    const int c = a.s.compare(b.s);  // UTF-8 byte order is code point order.
    return c < 0 ? -1 : c > 0 ? 1 : 0;
  }
  if (a.kind == Kind::kList && b.kind == Kind::kList && a.tuple == b.tuple) {
    for (size_t k = 0; k < std::min(a.list->size(), b.list->size()); ++k) {
      if (Equal((*a.list)[k], (*b.list)[k])) continue;
      return Order((*a.list)[k], (*b.list)[k]);
    }
    return a.list->size() < b.list->size() ? -1 : a.list->size() > b.list->size() ? 1 : 0;
  }
  return absl::InvalidArgumentError(absl::StrCat("'<' not supported between instances of '",
                                                 TypeName(a), "' and '", TypeName(b), "'"));
}

absl::Status UndefinedError(const Value& v) {
  return absl::InvalidArgumentError(absl::StrCat(v.s.empty() ? "value" : v.s, " is undefined"));
}

// Items of a for loop / `in` / list(): a dict yields its keys, a str its characters, an
// undefined value nothing (as jinja2's Undefined does).
absl::StatusOr<std::vector<Value>> Iterate(const Value& v) {
  std::vector<Value> out;
  switch (v.kind) {
    case Kind::kUndefined:
      return out;
    case Kind::kList:
      return *v.list;
    case Kind::kDict:
      for (const auto& kv : v.dict->items) out.push_back(Value::Str(kv.first));
      return out;
    case Kind::kString:
      for (char32_t c : Decode(v.s)) {
        std::string ch;
        AppendUtf8(ch, c);
        out.push_back(Value::Str(std::move(ch)));
      }
      return out;
    default:
      return absl::InvalidArgumentError(absl::StrCat("'", TypeName(v), "' object is not iterable"));
  }
}

absl::StatusOr<int64_t> Length(const Value& v) {
  switch (v.kind) {
    case Kind::kUndefined:
      return 0;
    case Kind::kString:
      return static_cast<int64_t>(Decode(v.s).size());
    case Kind::kList:
      return static_cast<int64_t>(v.list->size());
    case Kind::kDict:
      return static_cast<int64_t>(v.dict->items.size());
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("object of type '", TypeName(v), "' has no len()"));
  }
}

absl::StatusOr<bool> Contains(const Value& container, const Value& item) {
  switch (container.kind) {
    case Kind::kString:
      if (item.kind != Kind::kString) {
        return absl::InvalidArgumentError(
            absl::StrCat("'in <string>' requires string as left operand, not ", TypeName(item)));
      }
      return container.s.find(item.s) != std::string::npos;
    case Kind::kDict:
      return item.kind == Kind::kString && container.dict->Find(item.s) != nullptr;
    case Kind::kList:
      for (const Value& e : *container.list) {
        if (Equal(e, item)) return true;
      }
      return false;
    case Kind::kUndefined:
      return false;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("argument of type '", TypeName(container), "' is not iterable"));
  }
}

// Python's normalization of an index against a length; nullopt when out of range.
std::optional<size_t> NormIndex(int64_t idx, size_t n) {
  if (idx < 0) idx += static_cast<int64_t>(n);
  if (idx < 0 || idx >= static_cast<int64_t>(n)) return std::nullopt;
  return static_cast<size_t>(idx);
}

// Python slice indices for seq[start:stop:step] over n items.
absl::StatusOr<std::vector<size_t>> SliceIndices(const Value& start, const Value& stop,
                                                 const Value& step, size_t n) {
  const auto as_int = [](const Value& v,
                         const char* what) -> absl::StatusOr<std::optional<int64_t>> {
    if (v.kind == Kind::kUndefined || v.kind == Kind::kNone) return std::optional<int64_t>();
    if (v.kind == Kind::kInt) return std::optional<int64_t>(v.i);
    if (v.kind == Kind::kBool) return std::optional<int64_t>(v.b ? 1 : 0);
    return absl::InvalidArgumentError(absl::StrCat("slice ", what, " must be an integer"));
  };
  HMOE_ASSIGN_OR_RETURN(std::optional<int64_t> a, as_int(start, "start"));
  HMOE_ASSIGN_OR_RETURN(std::optional<int64_t> b, as_int(stop, "stop"));
  HMOE_ASSIGN_OR_RETURN(std::optional<int64_t> c, as_int(step, "step"));
  const int64_t st = c.value_or(1);
  if (st == 0) return absl::InvalidArgumentError("slice step cannot be zero");
  const int64_t len = static_cast<int64_t>(n);
  const auto clamp = [&](std::optional<int64_t> x, int64_t dflt, int64_t lo, int64_t hi) {
    if (!x) return dflt;
    int64_t v = *x;
    if (v < 0) v += len;
    return std::clamp(v, lo, hi);
  };
  std::vector<size_t> out;
  if (st > 0) {
    const int64_t from = clamp(a, 0, 0, len), to = clamp(b, len, 0, len);
    for (int64_t k = from; k < to; k += st) out.push_back(static_cast<size_t>(k));
  } else {
    const int64_t from = clamp(a, len - 1, -1, len - 1), to = clamp(b, -1, -1, len - 1);
    for (int64_t k = from; k > to; k += st) out.push_back(static_cast<size_t>(k));
  }
  return out;
}

// ----------------------------------------------------------------------------- string methods

absl::StatusOr<std::string> PyCase(const std::string& s, bool upper) {
  std::string out = s;
  for (char& ch : out) {
    if (static_cast<unsigned char>(ch) >= 0x80) {
      return absl::InvalidArgumentError(
          absl::StrCat(upper ? "upper" : "lower", "() of non-ASCII text is not supported"));
    }
    ch = static_cast<char>(upper ? std::toupper(static_cast<unsigned char>(ch))
                                 : std::tolower(static_cast<unsigned char>(ch)));
  }
  return out;
}

absl::StatusOr<std::string> PyStrip(const std::string& s, const Value& chars, bool left,
                                    bool right) {
  std::vector<char32_t> set;
  const bool whitespace = chars.kind == Kind::kUndefined || chars.kind == Kind::kNone;
  if (!whitespace) {
    if (chars.kind != Kind::kString) {
      return absl::InvalidArgumentError("strip arg must be None or str");
    }
    set = Decode(chars.s);
  }
  const auto strip_it = [&](char32_t c) {
    return whitespace ? IsPySpace(c) : std::find(set.begin(), set.end(), c) != set.end();
  };
  std::vector<char32_t> cps = Decode(s);
  size_t b = 0, e = cps.size();
  if (left) {
    while (b < e && strip_it(cps[b])) ++b;
  }
  if (right) {
    while (e > b && strip_it(cps[e - 1])) --e;
  }
  return Encode(cps, b, e);
}

absl::StatusOr<Value> PySplit(const std::string& s, const Value& sep, const Value& maxsplit_v) {
  int64_t maxsplit = -1;
  if (maxsplit_v.kind == Kind::kInt) {
    maxsplit = maxsplit_v.i;
  } else if (maxsplit_v.kind != Kind::kUndefined) {
    return absl::InvalidArgumentError("split: maxsplit must be an integer");
  }
  std::vector<Value> parts;
  if (sep.kind == Kind::kUndefined || sep.kind == Kind::kNone) {
    std::vector<char32_t> cps = Decode(s);
    size_t k = 0;
    while (true) {
      while (k < cps.size() && IsPySpace(cps[k])) ++k;
      if (k == cps.size()) break;
      if (maxsplit >= 0 && static_cast<int64_t>(parts.size()) == maxsplit) {
        parts.push_back(Value::Str(Encode(cps, k, cps.size())));  // Trailing space stays.
        break;
      }
      size_t e = k;
      while (e < cps.size() && !IsPySpace(cps[e])) ++e;
      parts.push_back(Value::Str(Encode(cps, k, e)));
      k = e;
    }
    return Value::List(std::move(parts));
  }
  if (sep.kind != Kind::kString) return absl::InvalidArgumentError("split: sep must be a str");
  if (sep.s.empty()) return absl::InvalidArgumentError("split: empty separator");
  size_t pos = 0;
  while (true) {
    if (maxsplit >= 0 && static_cast<int64_t>(parts.size()) == maxsplit) break;
    const size_t hit = s.find(sep.s, pos);
    if (hit == std::string::npos) break;
    parts.push_back(Value::Str(s.substr(pos, hit - pos)));
    pos = hit + sep.s.size();
  }
  parts.push_back(Value::Str(s.substr(pos)));
  return Value::List(std::move(parts));
}

const std::set<std::string>& StrMethods() {
  static const auto* m = new std::set<std::string>{
      "split", "strip", "lstrip", "rstrip", "startswith", "endswith", "replace", "lower", "upper"};
  return *m;
}
const std::set<std::string>& DictMethods() {
  static const auto* m = new std::set<std::string>{"get", "items", "keys", "values"};
  return *m;
}
// Every attribute name Python's str and dict have: on these, `x.name` is the method, not a key
// lookup (jinja2 tries getattr first), so unsupported ones must fail rather than look up a key.
const std::set<std::string>& PyStrAttrs() {
  static const auto* m = new std::set<std::string>{
      "capitalize",   "casefold",    "center",    "count",      "encode",       "endswith",
      "expandtabs",   "find",        "format",    "format_map", "index",        "isalnum",
      "isalpha",      "isascii",     "isdecimal", "isdigit",    "isidentifier", "islower",
      "isnumeric",    "isprintable", "isspace",   "istitle",    "isupper",      "join",
      "ljust",        "lower",       "lstrip",    "maketrans",  "partition",    "removeprefix",
      "removesuffix", "replace",     "rfind",     "rindex",     "rjust",        "rpartition",
      "rsplit",       "rstrip",      "split",     "splitlines", "startswith",   "strip",
      "swapcase",     "title",       "translate", "upper",      "zfill"};
  return *m;
}
const std::set<std::string>& PyDictAttrs() {
  static const auto* m =
      new std::set<std::string>{"clear", "copy",    "fromkeys",   "get",    "items", "keys",
                                "pop",   "popitem", "setdefault", "update", "values"};
  return *m;
}

absl::Status WantArgs(const std::string& name, const Args& args, const KwArgs& kwargs, size_t lo,
                      size_t hi) {
  if (!kwargs.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(name, "() takes no keyword arguments"));
  }
  if (args.size() < lo || args.size() > hi) {
    return absl::InvalidArgumentError(absl::StrCat(name, "() takes ", lo,
                                                   lo == hi ? "" : absl::StrCat(" to ", hi),
                                                   " arguments (", args.size(), " given)"));
  }
  return absl::OkStatus();
}

Value ArgOr(const Args& args, size_t k) { return k < args.size() ? args[k] : Value::Undefined(""); }

absl::StatusOr<Value> CallStrMethod(const std::string& s, const std::string& name, const Args& args,
                                    const KwArgs& kwargs) {
  if (name == "split") {
    HMOE_RETURN_IF_ERROR(WantArgs(name, args, {}, 0, 2));
    Value sep = ArgOr(args, 0), maxsplit = ArgOr(args, 1);
    for (const auto& [k, v] : kwargs) {
      if (k == "sep") {
        sep = v;
      } else if (k == "maxsplit") {
        maxsplit = v;
      } else {
        return absl::InvalidArgumentError(absl::StrCat("split() got an unexpected keyword ", k));
      }
    }
    return PySplit(s, sep, maxsplit);
  }
  if (name == "strip" || name == "lstrip" || name == "rstrip") {
    HMOE_RETURN_IF_ERROR(WantArgs(name, args, kwargs, 0, 1));
    HMOE_ASSIGN_OR_RETURN(std::string r,
                          PyStrip(s, ArgOr(args, 0), name != "rstrip", name != "lstrip"));
    return Value::Str(std::move(r));
  }
  if (name == "startswith" || name == "endswith") {
    HMOE_RETURN_IF_ERROR(WantArgs(name, args, kwargs, 1, 1));
    std::vector<Value> cands;
    if (args[0].kind == Kind::kList && args[0].tuple) {
      cands = *args[0].list;
    } else {
      cands.push_back(args[0]);
    }
    for (const Value& c : cands) {
      if (c.kind != Kind::kString) {
        return absl::InvalidArgumentError(absl::StrCat(name, " arg must be str or a tuple of str"));
      }
      const bool hit =
          name == "startswith"
              ? s.compare(0, c.s.size(), c.s) == 0
              : s.size() >= c.s.size() && s.compare(s.size() - c.s.size(), c.s.size(), c.s) == 0;
      if (hit) return Value::Bool(true);
    }
    return Value::Bool(false);
  }
  if (name == "replace") {
    HMOE_RETURN_IF_ERROR(WantArgs(name, args, kwargs, 2, 3));
    if (args[0].kind != Kind::kString || args[1].kind != Kind::kString) {
      return absl::InvalidArgumentError("replace() arguments must be str");
    }
    int64_t count = -1;
    if (args.size() == 3) {
      if (args[2].kind != Kind::kInt) return absl::InvalidArgumentError("replace() count: int");
      count = args[2].i;
    }
    if (args[0].s.empty()) {
      return absl::InvalidArgumentError("replace() with an empty old string is not supported");
    }
    std::string out;
    size_t pos = 0;
    for (int64_t n = 0; count < 0 || n < count; ++n) {
      const size_t hit = s.find(args[0].s, pos);
      if (hit == std::string::npos) break;
      out += s.substr(pos, hit - pos) + args[1].s;
      pos = hit + args[0].s.size();
    }
    return Value::Str(out + s.substr(pos));
  }
  if (name == "lower" || name == "upper") {
    HMOE_RETURN_IF_ERROR(WantArgs(name, args, kwargs, 0, 0));
    HMOE_ASSIGN_OR_RETURN(std::string r, PyCase(s, name == "upper"));
    return Value::Str(std::move(r));
  }
  return absl::InvalidArgumentError(absl::StrCat("str.", name, "() is not supported"));
}

absl::StatusOr<Value> CallDictMethod(const Value& d, const std::string& name, const Args& args,
                                     const KwArgs& kwargs) {
  if (name == "get") {
    HMOE_RETURN_IF_ERROR(WantArgs(name, args, kwargs, 1, 2));
    if (args[0].kind == Kind::kString) {
      if (const Value* v = d.dict->Find(args[0].s)) return *v;
    }
    return args.size() == 2 ? args[1] : Value::None();
  }
  HMOE_RETURN_IF_ERROR(WantArgs(name, args, kwargs, 0, 0));
  std::vector<Value> out;
  for (const auto& [k, v] : d.dict->items) {
    if (name == "items") {
      out.push_back(Value::List({Value::Str(k), v}, /*tuple=*/true));
    } else if (name == "keys") {
      out.push_back(Value::Str(k));
    } else if (name == "values") {
      out.push_back(v);
    } else {
      return absl::InvalidArgumentError(absl::StrCat("dict.", name, "() is not supported"));
    }
  }
  return Value::List(std::move(out));
}

// jinja2's getattr: the Python attribute first (a method), then the item.
Value GetAttr(const Value& obj, const std::string& name) {
  if (obj.kind == Kind::kString && PyStrAttrs().count(name)) {
    const std::string s = obj.s;
    return Value::Function(
        [s, name](const Args& a, const KwArgs& kw) { return CallStrMethod(s, name, a, kw); });
  }
  if (obj.kind == Kind::kDict && PyDictAttrs().count(name)) {
    return Value::Function(
        [obj, name](const Args& a, const KwArgs& kw) { return CallDictMethod(obj, name, a, kw); });
  }
  if ((obj.kind == Kind::kDict || obj.kind == Kind::kObject)) {
    if (const Value* v = obj.dict->Find(name)) return *v;
  }
  return Value::Undefined(
      absl::StrCat("'", TypeName(obj), "' object has no attribute '", name, "'"));
}

// jinja2's getitem: the item first, then (for a string key) the attribute.
absl::StatusOr<Value> GetItem(const Value& obj, const Value& key) {
  switch (obj.kind) {
    case Kind::kUndefined:
      return UndefinedError(obj);
    case Kind::kDict:
    case Kind::kObject:
      if (key.kind == Kind::kString) {
        if (const Value* v = obj.dict->Find(key.s)) return *v;
        return GetAttr(obj, key.s);
      }
      return Value::Undefined(absl::StrCat("'", TypeName(obj), "' object has no such key"));
    case Kind::kList:
      if (key.kind == Kind::kInt || key.kind == Kind::kBool) {
        if (auto idx = NormIndex(key.kind == Kind::kBool ? key.b : key.i, obj.list->size())) {
          return (*obj.list)[*idx];
        }
        return Value::Undefined(absl::StrCat(TypeName(obj), " index out of range"));
      }
      break;
    case Kind::kString:
      if (key.kind == Kind::kInt) {
        std::vector<char32_t> cps = Decode(obj.s);
        if (auto idx = NormIndex(key.i, cps.size())) return Value::Str(Encode(cps, *idx, *idx + 1));
        return Value::Undefined("string index out of range");
      }
      break;
    default:
      break;
  }
  if (key.kind == Kind::kString) return GetAttr(obj, key.s);
  return Value::Undefined(absl::StrCat("'", TypeName(obj), "' object has no item"));
}

// Python's ints are unbounded; ours are 64-bit and refuse to wrap.
absl::Status IntOverflow() {
  return absl::InvalidArgumentError("integer overflow (beyond 64-bit integers)");
}

absl::StatusOr<Value> Arith(const std::string& op, const Value& a, const Value& b) {
  if (a.kind == Kind::kUndefined) return UndefinedError(a);
  if (b.kind == Kind::kUndefined) return UndefinedError(b);
  if (op == "+") {
    if (a.kind == Kind::kString && b.kind == Kind::kString) return Value::Str(a.s + b.s);
    if (a.kind == Kind::kList && b.kind == Kind::kList && a.tuple == b.tuple) {
      std::vector<Value> items = *a.list;
      items.insert(items.end(), b.list->begin(), b.list->end());
      return Value::List(std::move(items), a.tuple);
    }
  }
  if (op == "*") {
    const Value* seq = a.kind == Kind::kString || a.kind == Kind::kList ? &a : &b;
    const Value* times = seq == &a ? &b : &a;
    if ((seq->kind == Kind::kString || seq->kind == Kind::kList) &&
        (times->kind == Kind::kInt || times->kind == Kind::kBool)) {
      const int64_t n = times->kind == Kind::kBool ? times->b : times->i;
      const size_t unit = seq->kind == Kind::kString ? seq->s.size() : seq->list->size();
      if (n > 0 && unit > 0 && static_cast<uint64_t>(n) > (size_t{1} << 26) / unit) {
        return absl::InvalidArgumentError("sequence repetition result too large");
      }
      if (seq->kind == Kind::kString) {
        std::string out;
        for (int64_t k = 0; k < n; ++k) out += seq->s;
        return Value::Str(out);
      }
      std::vector<Value> items;
      for (int64_t k = 0; k < n; ++k)
        items.insert(items.end(), seq->list->begin(), seq->list->end());
      return Value::List(std::move(items), seq->tuple);
    }
  }
  if (!a.IsNumber() || !b.IsNumber()) {
    return absl::InvalidArgumentError(absl::StrCat("unsupported operand type(s) for ", op, ": '",
                                                   TypeName(a), "' and '", TypeName(b), "'"));
  }
  const bool floats = a.kind == Kind::kFloat || b.kind == Kind::kFloat;
  const int64_t x = a.kind == Kind::kBool ? a.b : a.i, y = b.kind == Kind::kBool ? b.b : b.i;
  const double fx = a.AsDouble(), fy = b.AsDouble();
  if (op == "/") {
    if (fy == 0) return absl::InvalidArgumentError("division by zero");
    return Value::Float(fx / fy);
  }
  if (op == "//" || op == "%") {
    if (fy == 0) return absl::InvalidArgumentError("integer division or modulo by zero");
    if (floats) {
      const double q = std::floor(fx / fy);
      return Value::Float(op == "//" ? q : fx - q * fy);
    }
    if (x == std::numeric_limits<int64_t>::min() && y == -1) return IntOverflow();
    int64_t q = x / y;
    if ((x % y != 0) && ((x < 0) != (y < 0))) --q;
    return Value::Int(op == "//" ? q : x - q * y);
  }
  if (op == "**") {
    if (!floats && y >= 0) {
      int64_t r = 1;
      for (int64_t k = 0; k < y; ++k) {
        if (__builtin_mul_overflow(r, x, &r)) return IntOverflow();
        if (r == 0 || r == 1) break;  // 0 and 1 stay; -1 alternates below.
      }
      if (x == -1) r = (y % 2 == 0) ? 1 : -1;
      return Value::Int(r);
    }
    return Value::Float(std::pow(fx, fy));
  }
  if (floats) {
    return Value::Float(op == "+" ? fx + fy : op == "-" ? fx - fy : fx * fy);
  }
  int64_t r;
  const bool overflow = op == "+"   ? __builtin_add_overflow(x, y, &r)
                        : op == "-" ? __builtin_sub_overflow(x, y, &r)
                                    : __builtin_mul_overflow(x, y, &r);
  if (overflow) return IntOverflow();
  return Value::Int(r);
}

// ----------------------------------------------------------------------------- lexer

struct Token {
  enum Type { kName, kInt, kFloat, kString, kOp, kEnd } type = kEnd;
  std::string text;
  int64_t i = 0;
  double f = 0;
  int line = 0;
};

// One piece of the template: literal text, a {{ }} output or a {% %} statement.
struct Segment {
  enum Type { kText, kOutput, kStatement } type = kText;
  std::string text;
  std::vector<Token> tokens;
  int line = 0;
};

bool IsNameStart(char c) { return std::isalpha(static_cast<unsigned char>(c)) || c == '_'; }
bool IsNameChar(char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; }

// Decodes the escapes of a Jinja string literal the way jinja2 does (Python's unicode-escape:
// unknown escapes stay as written).
absl::StatusOr<std::string> Unescape(std::string_view body, int line) {
  std::string out;
  for (size_t k = 0; k < body.size(); ++k) {
    if (body[k] != '\\' || k + 1 == body.size()) {
      out += body[k];
      continue;
    }
    const char e = body[++k];
    const auto hex = [&](int n) -> absl::StatusOr<char32_t> {
      if (k + n >= body.size() + 1) return LineError(line, "truncated escape in a string literal");
      char32_t v = 0;
      for (int d = 1; d <= n; ++d) {
        const char h = body[k + d];
        if (!std::isxdigit(static_cast<unsigned char>(h))) {
          return LineError(line, "bad escape in a string literal");
        }
        v = v * 16 +
            (std::isdigit(static_cast<unsigned char>(h)) ? h - '0' : (std::tolower(h) - 'a' + 10));
      }
      k += n;
      return v;
    };
    switch (e) {
      case 'n':
        out += '\n';
        break;
      case 't':
        out += '\t';
        break;
      case 'r':
        out += '\r';
        break;
      case '\\':
        out += '\\';
        break;
      case '\'':
        out += '\'';
        break;
      case '"':
        out += '"';
        break;
      case '\n':
        break;
      case 'a':
        out += '\a';
        break;
      case 'b':
        out += '\b';
        break;
      case 'f':
        out += '\f';
        break;
      case 'v':
        out += '\v';
        break;
      case 'x': {
        HMOE_ASSIGN_OR_RETURN(char32_t v, hex(2));
        AppendUtf8(out, v);
        break;
      }
      case 'u': {
        HMOE_ASSIGN_OR_RETURN(char32_t v, hex(4));
        AppendUtf8(out, v);
        break;
      }
      case 'U': {
        HMOE_ASSIGN_OR_RETURN(char32_t v, hex(8));
        if (v > 0x10FFFF) return LineError(line, "bad \\U escape in a string literal");
        AppendUtf8(out, v);
        break;
      }
      default:
        if (e >= '0' && e <= '7') return LineError(line, "octal escapes are not supported");
        out += '\\';
        out += e;
    }
  }
  return out;
}

class Lexer {
 public:
  explicit Lexer(std::string src) : src_(std::move(src)) {
    for (size_t k = 0; k < src_.size(); ++k) {
      if (src_[k] == '\n') newlines_.push_back(k);
    }
  }

  absl::StatusOr<std::vector<Segment>> Run() {
    std::vector<Segment> segs;
    size_t pos = 0;
    bool line_starting = true;
    bool trim_next = false;     // the previous tag ended with '-': strip leading whitespace.
    bool newline_next = false;  // trim_blocks: drop one leading '\n'.
    while (pos <= src_.size()) {
      size_t open = src_.find('{', pos);
      while (open != std::string::npos && open + 1 < src_.size() && src_[open + 1] != '{' &&
             src_[open + 1] != '%' && src_[open + 1] != '#') {
        open = src_.find('{', open + 1);
      }
      if (open != std::string::npos && open + 1 >= src_.size()) open = std::string::npos;
      std::string text =
          src_.substr(pos, open == std::string::npos ? std::string::npos : open - pos);
      if (trim_next) {
        text = PyLstrip(text);
      } else if (newline_next && !text.empty() && text[0] == '\n') {
        text = text.substr(1);
      }
      if (open == std::string::npos) {
        AddText(segs, text);
        break;
      }
      const char kind = src_[open + 1];
      size_t p = open + 2;
      char sign = 0;
      if (p < src_.size() && (src_[p] == '-' || src_[p] == '+')) sign = src_[p++];
      // Whitespace before the tag.
      if (sign == '-') {
        text = PyRstrip(text);
      } else if (sign != '+' && kind != '{') {
        const size_t nl = text.rfind('\n');
        const size_t l_pos = nl == std::string::npos ? 0 : nl + 1;
        if (l_pos > 0 || line_starting) {
          const std::string tail = text.substr(l_pos);
          if (!tail.empty() && PyLstrip(tail).empty()) text = text.substr(0, l_pos);
        }
      }
      AddText(segs, text);
      const int line = LineAt(open);
      if (kind == '#') {
        const size_t close = src_.find("#}", p);
        if (close == std::string::npos) return LineError(line, "missing end of comment tag");
        const bool strip = close > 0 && src_[close - 1] == '-' && close - 1 >= p;
        const bool keep = close > 0 && src_[close - 1] == '+' && close - 1 >= p;
        pos = close + 2;
        trim_next = strip;
        newline_next = !strip && !keep;
        line_starting = false;
        if (newline_next && pos < src_.size() && src_[pos] == '\n') line_starting = true;
        if (strip) line_starting = EndsWithNewlineAfterWs(pos);
        continue;
      }
      Segment seg;
      seg.type = kind == '{' ? Segment::kOutput : Segment::kStatement;
      seg.line = line;
      HMOE_ASSIGN_OR_RETURN(size_t end, Tokens(p, kind == '{' ? '}' : '%', seg.tokens, sign));
      // `end` is at the closing tag; it may carry '-' or '+'.
      char end_sign = 0;
      if (src_[end] == '-' || src_[end] == '+') end_sign = src_[end++];
      pos = end + 2;
      trim_next = end_sign == '-';
      newline_next = kind == '%' && end_sign == 0;
      line_starting = false;
      if (newline_next && pos < src_.size() && src_[pos] == '\n') line_starting = true;
      if (trim_next) line_starting = EndsWithNewlineAfterWs(pos);
      segs.push_back(std::move(seg));
    }
    return segs;
  }

 private:
  // Whether the whitespace run at `pos` (consumed by a '-' tag end) ends with '\n'.
  bool EndsWithNewlineAfterWs(size_t pos) const {
    std::string rest = src_.substr(pos);
    const std::string stripped = PyLstrip(rest);
    const size_t consumed = rest.size() - stripped.size();
    return consumed > 0 && rest[consumed - 1] == '\n';
  }

  int LineAt(size_t pos) const {
    return 1 + static_cast<int>(std::lower_bound(newlines_.begin(), newlines_.end(), pos) -
                                newlines_.begin());
  }

  static void AddText(std::vector<Segment>& segs, const std::string& text) {
    if (text.empty()) return;
    Segment s;
    s.type = Segment::kText;
    s.text = text;
    segs.push_back(std::move(s));
  }

  // Tokenizes a tag's inside from `p`; returns the position of the closing "}}" / "%}" (or of
  // its '-' / '+').
  absl::StatusOr<size_t> Tokens(size_t p, char close, std::vector<Token>& out, char) {
    std::vector<char> balance;
    while (true) {
      while (p < src_.size() && std::isspace(static_cast<unsigned char>(src_[p]))) ++p;
      const int line = LineAt(p);
      if (p >= src_.size()) return LineError(line, "unexpected end of template inside a tag");
      if (balance.empty()) {
        if (src_.compare(p, 2, std::string{close, '}'}) == 0) return p;
        if ((src_[p] == '-' || src_[p] == '+') &&
            src_.compare(p + 1, 2, std::string{close, '}'}) == 0) {
          return p;
        }
      }
      Token t;
      t.line = line;
      const char c = src_[p];
      if (IsNameStart(c)) {
        size_t e = p;
        while (e < src_.size() && IsNameChar(src_[e])) ++e;
        t.type = Token::kName;
        t.text = src_.substr(p, e - p);
        p = e;
      } else if (std::isdigit(static_cast<unsigned char>(c))) {
        size_t e = p;
        while (e < src_.size() &&
               (std::isdigit(static_cast<unsigned char>(src_[e])) || src_[e] == '_'))
          ++e;
        bool is_float = false;
        if (e + 1 < src_.size() && src_[e] == '.' &&
            std::isdigit(static_cast<unsigned char>(src_[e + 1]))) {
          is_float = true;
          ++e;
          while (e < src_.size() && std::isdigit(static_cast<unsigned char>(src_[e]))) ++e;
        }
        if (e < src_.size() && (src_[e] == 'e' || src_[e] == 'E')) {
          size_t q = e + 1;
          if (q < src_.size() && (src_[q] == '+' || src_[q] == '-')) ++q;
          if (q < src_.size() && std::isdigit(static_cast<unsigned char>(src_[q]))) {
            is_float = true;
            e = q;
            while (e < src_.size() && std::isdigit(static_cast<unsigned char>(src_[e]))) ++e;
          }
        }
        std::string num;
        for (size_t k = p; k < e; ++k) {
          if (src_[k] != '_') num += src_[k];
        }
        if (is_float) {
          t.type = Token::kFloat;
          t.f = std::strtod(num.c_str(), nullptr);
        } else {
          t.type = Token::kInt;
          auto r = std::from_chars(num.data(), num.data() + num.size(), t.i);
          if (r.ec != std::errc()) return LineError(line, "integer literal out of range");
        }
        t.text = num;
        p = e;
      } else if (c == '\'' || c == '"') {
        size_t e = p + 1;
        while (e < src_.size() && src_[e] != c) {
          if (src_[e] == '\\') ++e;
          ++e;
        }
        if (e >= src_.size()) return LineError(line, "unterminated string literal");
        t.type = Token::kString;
        HMOE_ASSIGN_OR_RETURN(t.text,
                              Unescape(std::string_view(src_).substr(p + 1, e - p - 1), line));
        p = e + 1;
      } else {
        static const char* kOps[] = {"//", "**", "==", "!=", "<=", ">=", "+", "-", "*",
                                     "/",  "%",  "~",  "<",  ">",  "=",  "|", ".", ",",
                                     ":",  "(",  ")",  "[",  "]",  "{",  "}"};
        bool found = false;
        for (const char* op : kOps) {
          const size_t n = std::char_traits<char>::length(op);
          if (src_.compare(p, n, op) == 0) {
            t.type = Token::kOp;
            t.text = op;
            p += n;
            found = true;
            break;
          }
        }
        if (!found)
          return LineError(line, absl::StrCat("unexpected character '", std::string(1, c), "'"));
        if (t.text == "(" || t.text == "[" || t.text == "{") {
          balance.push_back(t.text == "(" ? ')' : t.text == "[" ? ']' : '}');
        } else if (t.text == ")" || t.text == "]" || t.text == "}") {
          if (balance.empty() || balance.back() != t.text[0]) {
            return LineError(line, absl::StrCat("unexpected '", t.text, "'"));
          }
          balance.pop_back();
        }
      }
      out.push_back(std::move(t));
    }
  }

  std::string src_;
  std::vector<size_t> newlines_;  // Positions of '\n', for line numbers.
};

// ----------------------------------------------------------------------------- AST

struct Expr {
  enum Type {
    kLiteral,
    kName,
    kAttr,
    kItem,
    kSlice,
    kCall,
    kFilter,
    kTest,
    kNeg,
    kPos,
    kNot,
    kAnd,
    kOr,
    kCompare,
    kBinary,
    kConcat,
    kCond,
    kList,
    kTuple,
    kDict
  } type = kLiteral;
  int line = 0;
  std::string name;  // kName, kAttr, kFilter, kTest, kBinary (operator).
  Value literal;     // kLiteral.
  std::vector<std::unique_ptr<Expr>> kids;
  std::vector<std::string> kwnames;  // kCall/kFilter/kTest: names of the last kids.
  std::vector<std::string> ops;      // kCompare.
  bool negate = false;               // kTest: `is not`.
};
using ExprPtr = std::unique_ptr<Expr>;

struct Stmt;
using Body = std::vector<Stmt>;

struct Stmt {
  enum Type {
    kText,
    kOutput,
    kIf,
    kFor,
    kSet,
    kSetAttr,
    kSetBlock,
    kBreak,
    kContinue,
    kBlock,
    kMacro
  } type = kText;
  int line = 0;
  std::string text;
  ExprPtr expr;                                    // kOutput, kFor (iterable), kSet value.
  ExprPtr filter;                                  // kFor's `if`.
  std::vector<std::string> targets;                // kFor, kSet, kSetBlock; kSetAttr: {ns, attr}.
  std::vector<std::pair<ExprPtr, Body>> branches;  // kIf (null condition = else).
  Body body, else_body;                            // kFor, kSetBlock, kBlock, kMacro.
  std::vector<ExprPtr> defaults;  // kMacro: per parameter (targets), null when none.
};

}  // namespace

namespace internal {
struct Program {
  Body body;
};
}  // namespace internal

namespace {

const std::set<std::string>& Filters() {
  static const auto* f =
      new std::set<std::string>{"tojson", "length", "count",  "trim",  "default", "d",    "join",
                                "first",  "last",   "string", "lower", "upper",   "list", "items"};
  return *f;
}
const std::set<std::string>& Tests() {
  static const auto* t = new std::set<std::string>{
      "defined",  "undefined", "none", "string", "mapping", "iterable", "number",
      "sequence", "boolean",   "true", "false",  "integer", "float"};
  return *t;
}
const std::set<std::string>& Globals() {
  static const auto* g = new std::set<std::string>{"raise_exception", "namespace", "range"};
  return *g;
}

class Parser {
 public:
  explicit Parser(std::vector<Segment> segs) : segs_(std::move(segs)) {
    // The template's macros may be called before their definition in the source (from another
    // macro), so calls are checked against all of them.
    for (const Segment& s : segs_) {
      if (s.type == Segment::kStatement && s.tokens.size() >= 2 &&
          s.tokens[0].type == Token::kName && s.tokens[0].text == "macro" &&
          s.tokens[1].type == Token::kName) {
        macros_.insert(s.tokens[1].text);
      }
    }
  }

  absl::StatusOr<Body> ParseAll() {
    Body body;
    HMOE_ASSIGN_OR_RETURN(std::string end, ParseBody(body, {}));
    (void)end;
    return body;
  }

 private:
  // Parses statements until one of `ends` (a statement keyword) and returns which one ended it
  // ("" at the end of the template, allowed only when `ends` is empty).
  absl::StatusOr<std::string> ParseBody(Body& body, const std::set<std::string>& ends) {
    DepthGuard guard(depth_);
    HMOE_RETURN_IF_ERROR(CheckDepth());
    while (seg_ < segs_.size()) {
      Segment& s = segs_[seg_];
      if (s.type == Segment::kText) {
        Stmt st;
        st.type = Stmt::kText;
        st.text = s.text;
        body.push_back(std::move(st));
        ++seg_;
        continue;
      }
      toks_ = &s.tokens;
      tok_ = 0;
      line_ = s.line;
      if (s.type == Segment::kOutput) {
        Stmt st;
        st.type = Stmt::kOutput;
        st.line = s.line;
        HMOE_ASSIGN_OR_RETURN(st.expr, ParseExpr());
        HMOE_RETURN_IF_ERROR(ExpectEnd());
        body.push_back(std::move(st));
        ++seg_;
        continue;
      }
      if (toks_->empty() || (*toks_)[0].type != Token::kName) {
        return LineError(line_, "expected a statement name after '{%'");
      }
      const std::string kw = (*toks_)[0].text;
      if (ends.count(kw)) return kw;
      tok_ = 1;
      ++seg_;
      Stmt st;
      st.line = line_;
      if (kw == "if") {
        HMOE_RETURN_IF_ERROR(ParseIf(st));
      } else if (kw == "for") {
        HMOE_RETURN_IF_ERROR(ParseFor(st));
      } else if (kw == "set") {
        HMOE_RETURN_IF_ERROR(ParseSet(st));
      } else if (kw == "break" || kw == "continue") {
        st.type = kw == "break" ? Stmt::kBreak : Stmt::kContinue;
        HMOE_RETURN_IF_ERROR(ExpectEnd());
      } else if (kw == "macro") {
        HMOE_RETURN_IF_ERROR(ParseMacro(st));
      } else if (kw == "generation") {
        // transformers' AssistantTracker extension: marks assistant text, renders its body.
        st.type = Stmt::kBlock;
        HMOE_RETURN_IF_ERROR(ExpectEnd());
        HMOE_ASSIGN_OR_RETURN(std::string e, ParseBody(st.body, {"endgeneration"}));
        HMOE_RETURN_IF_ERROR(CloseTag(e, "endgeneration", st.line));
      } else if (kw == "elif" || kw == "else" || kw.rfind("end", 0) == 0) {
        return LineError(line_, absl::StrCat("unexpected '{% ", kw, " %}'"));
      } else {
        return LineError(line_, absl::StrCat("unsupported statement '{% ", kw,
                                             " %}' (outside the chat-template Jinja subset)"));
      }
      body.push_back(std::move(st));
    }
    if (!ends.empty()) {
      return LineError(
          line_, absl::StrCat("unexpected end of template: missing '{% ", *ends.rbegin(), " %}'"));
    }
    return std::string();
  }

  // After ParseBody stopped at `got`, consumes that end tag.
  absl::Status CloseTag(const std::string& got, const std::string& want, int open_line) {
    if (got != want) {
      return LineError(line_, absl::StrCat("expected '{% ", want, " %}' closing the tag of line ",
                                           open_line, ", got '{% ", got, " %}'"));
    }
    tok_ = 1;
    HMOE_RETURN_IF_ERROR(ExpectEnd());
    ++seg_;
    return absl::OkStatus();
  }

  absl::Status ParseIf(Stmt& st) {
    st.type = Stmt::kIf;
    HMOE_ASSIGN_OR_RETURN(ExprPtr cond, ParseExpr());
    HMOE_RETURN_IF_ERROR(ExpectEnd());
    while (true) {
      Body body;
      HMOE_ASSIGN_OR_RETURN(std::string e, ParseBody(body, {"elif", "else", "endif"}));
      st.branches.emplace_back(std::move(cond), std::move(body));
      tok_ = 1;
      if (e == "elif") {
        ++seg_;
        HMOE_ASSIGN_OR_RETURN(cond, ParseExpr());
        HMOE_RETURN_IF_ERROR(ExpectEnd());
        continue;
      }
      if (e == "else") {
        HMOE_RETURN_IF_ERROR(ExpectEnd());
        ++seg_;
        Body else_body;
        HMOE_ASSIGN_OR_RETURN(std::string e2, ParseBody(else_body, {"endif", "elif", "else"}));
        st.branches.emplace_back(nullptr, std::move(else_body));
        return CloseTag(e2, "endif", st.line);
      }
      return CloseTag(e, "endif", st.line);
    }
  }

  absl::Status ParseFor(Stmt& st) {
    st.type = Stmt::kFor;
    HMOE_ASSIGN_OR_RETURN(st.targets, ParseTargets());
    if (!AcceptName("in")) return LineError(line_, "expected 'in' in a for statement");
    HMOE_ASSIGN_OR_RETURN(st.expr, ParseTernaryFree());
    if (AcceptName("if")) {
      HMOE_ASSIGN_OR_RETURN(st.filter, ParseTernaryFree());
    }
    if (PeekName("recursive")) return LineError(line_, "recursive for loops are not supported");
    HMOE_RETURN_IF_ERROR(ExpectEnd());
    HMOE_ASSIGN_OR_RETURN(std::string e, ParseBody(st.body, {"else", "endfor"}));
    if (e == "else") {
      tok_ = 1;
      HMOE_RETURN_IF_ERROR(ExpectEnd());
      ++seg_;
      HMOE_ASSIGN_OR_RETURN(e, ParseBody(st.else_body, {"endfor", "else"}));
    }
    return CloseTag(e, "endfor", st.line);
  }

  // {% macro name(a, b=default) %}body{% endmacro %}: no varargs, kwargs or caller.
  absl::Status ParseMacro(Stmt& st) {
    st.type = Stmt::kMacro;
    const Token* name = Next();
    if (name == nullptr || name->type != Token::kName) {
      return LineError(line_, "expected a macro name");
    }
    st.text = name->text;
    HMOE_RETURN_IF_ERROR(ExpectOp("("));
    while (!AcceptOp(")")) {
      if (!st.targets.empty()) HMOE_RETURN_IF_ERROR(ExpectOp(","));
      const Token* p = Next();
      if (p == nullptr || p->type != Token::kName) {
        return LineError(line_, "expected a macro parameter name");
      }
      st.targets.push_back(p->text);
      ExprPtr dflt;
      if (AcceptOp("=")) {
        HMOE_ASSIGN_OR_RETURN(dflt, ParseExpr());
      } else if (!st.defaults.empty() && st.defaults.back()) {
        return LineError(line_, "a macro parameter without a default follows one with a default");
      }
      st.defaults.push_back(std::move(dflt));
    }
    HMOE_RETURN_IF_ERROR(ExpectEnd());
    HMOE_ASSIGN_OR_RETURN(std::string e, ParseBody(st.body, {"endmacro"}));
    return CloseTag(e, "endmacro", st.line);
  }

  absl::Status ParseSet(Stmt& st) {
    HMOE_ASSIGN_OR_RETURN(std::vector<std::string> targets, ParseTargets());
    if (targets.size() == 1 && AcceptOp(".")) {
      const Token* attr = Next();
      if (attr == nullptr || attr->type != Token::kName) {
        return LineError(line_, "expected an attribute name after '.' in set");
      }
      st.type = Stmt::kSetAttr;
      st.targets = {targets[0], attr->text};
    } else {
      st.type = Stmt::kSet;
      st.targets = std::move(targets);
    }
    if (AcceptOp("=")) {
      HMOE_ASSIGN_OR_RETURN(st.expr, ParseTuple());
      return ExpectEnd();
    }
    if (st.type != Stmt::kSet || st.targets.size() != 1) {
      return LineError(line_, "expected '=' in set");
    }
    if (PeekOp("|")) return LineError(line_, "filtered block set is not supported");
    HMOE_RETURN_IF_ERROR(ExpectEnd());
    st.type = Stmt::kSetBlock;
    HMOE_ASSIGN_OR_RETURN(std::string e, ParseBody(st.body, {"endset"}));
    return CloseTag(e, "endset", st.line);
  }

  absl::StatusOr<std::vector<std::string>> ParseTargets() {
    std::vector<std::string> names;
    const bool paren = AcceptOp("(");
    do {
      const Token* t = Next();
      if (t == nullptr || t->type != Token::kName) return LineError(line_, "expected a name");
      names.push_back(t->text);
    } while (AcceptOp(","));
    if (paren && !AcceptOp(")")) return LineError(line_, "expected ')'");
    return names;
  }

  // ------------------------------------------------------------------- expressions

  const Token* Peek() const { return tok_ < toks_->size() ? &(*toks_)[tok_] : nullptr; }
  const Token* Next() { return tok_ < toks_->size() ? &(*toks_)[tok_++] : nullptr; }
  bool PeekOp(std::string_view op) const {
    const Token* t = Peek();
    return t != nullptr && t->type == Token::kOp && t->text == op;
  }
  bool PeekName(std::string_view n) const {
    const Token* t = Peek();
    return t != nullptr && t->type == Token::kName && t->text == n;
  }
  bool AcceptOp(std::string_view op) {
    if (!PeekOp(op)) return false;
    ++tok_;
    return true;
  }
  bool AcceptName(std::string_view n) {
    if (!PeekName(n)) return false;
    ++tok_;
    return true;
  }
  absl::Status ExpectOp(std::string_view op) {
    if (AcceptOp(op)) return absl::OkStatus();
    return LineError(line_, absl::StrCat("expected '", std::string(op), "', got ", Describe()));
  }
  absl::Status ExpectEnd() {
    if (Peek() == nullptr) return absl::OkStatus();
    return LineError(line_, absl::StrCat("unexpected ", Describe(), " (expected end of tag)"));
  }
  std::string Describe() const {
    const Token* t = Peek();
    if (t == nullptr) return "end of tag";
    return absl::StrCat("'", t->text, "'");
  }
  ExprPtr Make(Expr::Type type) {
    auto e = std::make_unique<Expr>();
    e->type = type;
    e->line = line_;
    return e;
  }

  // A comma-separated list without brackets is a tuple (as in `set a = 1, 2`).
  absl::StatusOr<ExprPtr> ParseTuple() {
    HMOE_ASSIGN_OR_RETURN(ExprPtr first, ParseExpr());
    if (!PeekOp(",")) return first;
    ExprPtr t = Make(Expr::kTuple);
    t->kids.push_back(std::move(first));
    while (AcceptOp(",")) {
      if (Peek() == nullptr) break;
      HMOE_ASSIGN_OR_RETURN(ExprPtr e, ParseExpr());
      t->kids.push_back(std::move(e));
    }
    return t;
  }

  absl::StatusOr<ExprPtr> ParseExpr() {
    HMOE_ASSIGN_OR_RETURN(ExprPtr e, ParseOr());
    while (AcceptName("if")) {
      ExprPtr c = Make(Expr::kCond);
      HMOE_ASSIGN_OR_RETURN(ExprPtr cond, ParseOr());
      c->kids.push_back(std::move(e));
      c->kids.push_back(std::move(cond));
      if (AcceptName("else")) {
        HMOE_ASSIGN_OR_RETURN(ExprPtr other, ParseExpr());
        c->kids.push_back(std::move(other));
      }
      e = std::move(c);
    }
    return e;
  }
  // The iterable of a for loop: no conditional expression (its `if` filters the loop).
  absl::StatusOr<ExprPtr> ParseTernaryFree() { return ParseOr(); }

  absl::StatusOr<ExprPtr> ParseOr() {
    HMOE_ASSIGN_OR_RETURN(ExprPtr e, ParseAnd());
    while (AcceptName("or")) {
      ExprPtr n = Make(Expr::kOr);
      HMOE_ASSIGN_OR_RETURN(ExprPtr r, ParseAnd());
      n->kids.push_back(std::move(e));
      n->kids.push_back(std::move(r));
      e = std::move(n);
    }
    return e;
  }
  absl::StatusOr<ExprPtr> ParseAnd() {
    HMOE_ASSIGN_OR_RETURN(ExprPtr e, ParseNot());
    while (AcceptName("and")) {
      ExprPtr n = Make(Expr::kAnd);
      HMOE_ASSIGN_OR_RETURN(ExprPtr r, ParseNot());
      n->kids.push_back(std::move(e));
      n->kids.push_back(std::move(r));
      e = std::move(n);
    }
    return e;
  }
  absl::StatusOr<ExprPtr> ParseNot() {
    if (AcceptName("not")) {
      ExprPtr n = Make(Expr::kNot);
      HMOE_ASSIGN_OR_RETURN(ExprPtr e, ParseNot());
      n->kids.push_back(std::move(e));
      return n;
    }
    return ParseCompare();
  }
  absl::StatusOr<ExprPtr> ParseCompare() {
    HMOE_ASSIGN_OR_RETURN(ExprPtr e, ParseMath1());
    ExprPtr cmp;
    while (true) {
      std::string op;
      const Token* t = Peek();
      if (t == nullptr) break;
      if (t->type == Token::kOp && (t->text == "==" || t->text == "!=" || t->text == "<" ||
                                    t->text == ">" || t->text == "<=" || t->text == ">=")) {
        op = t->text;
        ++tok_;
      } else if (AcceptName("in")) {
        op = "in";
      } else if (PeekName("not") && tok_ + 1 < toks_->size() &&
                 (*toks_)[tok_ + 1].type == Token::kName && (*toks_)[tok_ + 1].text == "in") {
        tok_ += 2;
        op = "notin";
      } else {
        break;
      }
      if (!cmp) {
        cmp = Make(Expr::kCompare);
        cmp->kids.push_back(std::move(e));
      }
      HMOE_ASSIGN_OR_RETURN(ExprPtr r, ParseMath1());
      cmp->ops.push_back(op);
      cmp->kids.push_back(std::move(r));
    }
    if (cmp) return cmp;
    return e;
  }
  absl::StatusOr<ExprPtr> ParseMath1() {
    HMOE_ASSIGN_OR_RETURN(ExprPtr e, ParseConcat());
    while (PeekOp("+") || PeekOp("-")) {
      ExprPtr n = Make(Expr::kBinary);
      n->name = Next()->text;
      HMOE_ASSIGN_OR_RETURN(ExprPtr r, ParseConcat());
      n->kids.push_back(std::move(e));
      n->kids.push_back(std::move(r));
      e = std::move(n);
    }
    return e;
  }
  absl::StatusOr<ExprPtr> ParseConcat() {
    HMOE_ASSIGN_OR_RETURN(ExprPtr e, ParseMath2());
    if (!PeekOp("~")) return e;
    ExprPtr n = Make(Expr::kConcat);
    n->kids.push_back(std::move(e));
    while (AcceptOp("~")) {
      HMOE_ASSIGN_OR_RETURN(ExprPtr r, ParseMath2());
      n->kids.push_back(std::move(r));
    }
    return n;
  }
  absl::StatusOr<ExprPtr> ParseMath2() {
    HMOE_ASSIGN_OR_RETURN(ExprPtr e, ParsePow());
    while (PeekOp("*") || PeekOp("/") || PeekOp("//") || PeekOp("%")) {
      ExprPtr n = Make(Expr::kBinary);
      n->name = Next()->text;
      HMOE_ASSIGN_OR_RETURN(ExprPtr r, ParsePow());
      n->kids.push_back(std::move(e));
      n->kids.push_back(std::move(r));
      e = std::move(n);
    }
    return e;
  }
  absl::StatusOr<ExprPtr> ParsePow() {
    HMOE_ASSIGN_OR_RETURN(ExprPtr e, ParseUnary(true));
    while (AcceptOp("**")) {
      ExprPtr n = Make(Expr::kBinary);
      n->name = "**";
      HMOE_ASSIGN_OR_RETURN(ExprPtr r, ParseUnary(true));
      n->kids.push_back(std::move(e));
      n->kids.push_back(std::move(r));
      e = std::move(n);
    }
    return e;
  }
  // Counts nesting (expressions, blocks) so that a hostile template cannot overflow the stack.
  struct DepthGuard {
    explicit DepthGuard(int& d) : depth(d) { ++depth; }
    ~DepthGuard() { --depth; }
    int& depth;
  };
  absl::Status CheckDepth() const {
    if (depth_ > kMaxDepth) {
      return LineError(line_, absl::StrCat("nested deeper than ", kMaxDepth, " levels"));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<ExprPtr> ParseUnary(bool with_filter) {
    DepthGuard guard(depth_);
    HMOE_RETURN_IF_ERROR(CheckDepth());
    ExprPtr e;
    if (PeekOp("-") || PeekOp("+")) {
      ExprPtr n = Make(Next()->text == "-" ? Expr::kNeg : Expr::kPos);
      HMOE_ASSIGN_OR_RETURN(ExprPtr k, ParseUnary(false));
      n->kids.push_back(std::move(k));
      e = std::move(n);
    } else {
      HMOE_ASSIGN_OR_RETURN(e, ParsePrimary());
    }
    HMOE_ASSIGN_OR_RETURN(e, ParsePostfix(std::move(e)));
    if (with_filter) {
      HMOE_ASSIGN_OR_RETURN(e, ParseFilterExpr(std::move(e)));
    }
    return e;
  }

  absl::StatusOr<ExprPtr> ParsePrimary() {
    const Token* t = Next();
    if (t == nullptr) return LineError(line_, "unexpected end of expression");
    if (t->type == Token::kName) {
      if (t->text == "true" || t->text == "True") return Lit(Value::Bool(true));
      if (t->text == "false" || t->text == "False") return Lit(Value::Bool(false));
      if (t->text == "none" || t->text == "None") return Lit(Value::None());
      ExprPtr n = Make(Expr::kName);
      n->name = t->text;
      return n;
    }
    if (t->type == Token::kString) {
      std::string s = t->text;
      while (Peek() != nullptr && Peek()->type == Token::kString) s += Next()->text;
      return Lit(Value::Str(std::move(s)));
    }
    if (t->type == Token::kInt) return Lit(Value::Int(t->i));
    if (t->type == Token::kFloat) return Lit(Value::Float(t->f));
    if (t->text == "(") {
      if (AcceptOp(")")) return Make(Expr::kTuple);
      HMOE_ASSIGN_OR_RETURN(ExprPtr e, ParseExpr());
      if (AcceptOp(")")) return e;
      ExprPtr tup = Make(Expr::kTuple);
      tup->kids.push_back(std::move(e));
      while (AcceptOp(",")) {
        if (PeekOp(")")) break;
        HMOE_ASSIGN_OR_RETURN(ExprPtr k, ParseExpr());
        tup->kids.push_back(std::move(k));
      }
      HMOE_RETURN_IF_ERROR(ExpectOp(")"));
      return tup;
    }
    if (t->text == "[") {
      ExprPtr list = Make(Expr::kList);
      while (!AcceptOp("]")) {
        if (!list->kids.empty()) HMOE_RETURN_IF_ERROR(ExpectOp(","));
        if (AcceptOp("]")) break;
        HMOE_ASSIGN_OR_RETURN(ExprPtr k, ParseExpr());
        list->kids.push_back(std::move(k));
      }
      return list;
    }
    if (t->text == "{") {
      ExprPtr dict = Make(Expr::kDict);
      while (!AcceptOp("}")) {
        if (!dict->kids.empty()) HMOE_RETURN_IF_ERROR(ExpectOp(","));
        if (AcceptOp("}")) break;
        HMOE_ASSIGN_OR_RETURN(ExprPtr k, ParseExpr());
        HMOE_RETURN_IF_ERROR(ExpectOp(":"));
        HMOE_ASSIGN_OR_RETURN(ExprPtr v, ParseExpr());
        dict->kids.push_back(std::move(k));
        dict->kids.push_back(std::move(v));
      }
      return dict;
    }
    return LineError(line_, absl::StrCat("unexpected '", t->text, "'"));
  }

  ExprPtr Lit(Value v) {
    ExprPtr e = Make(Expr::kLiteral);
    e->literal = std::move(v);
    return e;
  }

  absl::StatusOr<ExprPtr> ParsePostfix(ExprPtr e) {
    while (true) {
      if (AcceptOp(".")) {
        const Token* t = Next();
        if (t == nullptr) return LineError(line_, "expected an attribute name after '.'");
        if (t->type == Token::kInt) {
          ExprPtr n = Make(Expr::kItem);
          n->kids.push_back(std::move(e));
          n->kids.push_back(Lit(Value::Int(t->i)));
          e = std::move(n);
          continue;
        }
        if (t->type != Token::kName)
          return LineError(line_, "expected an attribute name after '.'");
        ExprPtr n = Make(Expr::kAttr);
        n->name = t->text;
        n->kids.push_back(std::move(e));
        e = std::move(n);
      } else if (AcceptOp("[")) {
        HMOE_ASSIGN_OR_RETURN(e, ParseSubscript(std::move(e)));
      } else if (PeekOp("(")) {
        HMOE_ASSIGN_OR_RETURN(e, ParseCall(std::move(e)));
      } else {
        return e;
      }
    }
  }

  absl::StatusOr<ExprPtr> ParseSubscript(ExprPtr obj) {
    ExprPtr parts[3];
    int n = 0;
    bool slice = false;
    while (true) {
      if (PeekOp(":")) {
        ++tok_;
        slice = true;
        ++n;
        if (n > 2) return LineError(line_, "too many ':' in a slice");
        continue;
      }
      if (PeekOp("]")) {
        ++tok_;
        break;
      }
      if (parts[n]) return LineError(line_, "expected ':' or ']' in a subscript");
      HMOE_ASSIGN_OR_RETURN(parts[n], ParseExpr());
    }
    if (!slice) {
      if (!parts[0]) return LineError(line_, "empty subscript");
      ExprPtr e = Make(Expr::kItem);
      e->kids.push_back(std::move(obj));
      e->kids.push_back(std::move(parts[0]));
      return e;
    }
    ExprPtr e = Make(Expr::kSlice);
    e->kids.push_back(std::move(obj));
    for (auto& p : parts) e->kids.push_back(std::move(p));
    return e;
  }

  // Parses "(args)" into `call` after its existing kids.
  absl::Status ParseArgs(Expr& call) {
    HMOE_RETURN_IF_ERROR(ExpectOp("("));
    bool first = true;
    while (!AcceptOp(")")) {
      if (!first) HMOE_RETURN_IF_ERROR(ExpectOp(","));
      first = false;
      if (AcceptOp(")")) break;
      if (PeekOp("*") || PeekOp("**")) {
        return LineError(line_, "*args / **kwargs in a call are not supported");
      }
      const Token* t = Peek();
      if (t != nullptr && t->type == Token::kName && tok_ + 1 < toks_->size() &&
          (*toks_)[tok_ + 1].type == Token::kOp && (*toks_)[tok_ + 1].text == "=") {
        tok_ += 2;
        call.kwnames.push_back(t->text);
      } else if (!call.kwnames.empty()) {
        return LineError(line_, "positional argument after a keyword argument");
      }
      HMOE_ASSIGN_OR_RETURN(ExprPtr a, ParseExpr());
      call.kids.push_back(std::move(a));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<ExprPtr> ParseCall(ExprPtr callee) {
    // Only known callables: the globals and the supported methods of str and dict.
    if (callee->type == Expr::kName) {
      if (!Globals().count(callee->name) && !macros_.count(callee->name)) {
        return LineError(line_, absl::StrCat("unsupported function '", callee->name, "()'"));
      }
    } else if (callee->type == Expr::kAttr) {
      if (!StrMethods().count(callee->name) && !DictMethods().count(callee->name)) {
        return LineError(line_, absl::StrCat("unsupported method '.", callee->name, "()'"));
      }
    } else {
      return LineError(line_, "only functions and methods can be called");
    }
    ExprPtr call = Make(Expr::kCall);
    call->kids.push_back(std::move(callee));
    HMOE_RETURN_IF_ERROR(ParseArgs(*call));
    return call;
  }

  absl::StatusOr<ExprPtr> ParseFilterExpr(ExprPtr e) {
    while (true) {
      if (AcceptOp("|")) {
        const Token* t = Next();
        if (t == nullptr || t->type != Token::kName) {
          return LineError(line_, "expected a filter name after '|'");
        }
        if (!Filters().count(t->text)) {
          return LineError(line_, absl::StrCat("unsupported filter '", t->text, "'"));
        }
        ExprPtr f = Make(Expr::kFilter);
        f->name = t->text;
        f->kids.push_back(std::move(e));
        if (PeekOp("(")) HMOE_RETURN_IF_ERROR(ParseArgs(*f));
        e = std::move(f);
      } else if (AcceptName("is")) {
        ExprPtr test = Make(Expr::kTest);
        test->negate = AcceptName("not");
        const Token* t = Next();
        if (t == nullptr || t->type != Token::kName) {
          return LineError(line_, "expected a test name after 'is'");
        }
        if (!Tests().count(t->text)) {
          return LineError(line_, absl::StrCat("unsupported test '", t->text, "'"));
        }
        test->name = t->text;
        test->kids.push_back(std::move(e));
        if (PeekOp("(")) return LineError(line_, "tests with arguments are not supported");
        e = std::move(test);
      } else {
        return e;
      }
    }
  }

  std::vector<Segment> segs_;
  size_t seg_ = 0;
  const std::vector<Token>* toks_ = nullptr;
  size_t tok_ = 0;
  int line_ = 1;
  int depth_ = 0;
  std::set<std::string> macros_;
};

// ----------------------------------------------------------------------------- renderer

enum class Flow { kNormal, kBreak, kContinue };

class Renderer {
 public:
  // Far above what any real template needs for a request the router accepts (a few statements
  // per message), far below what would stall a server.
  static constexpr int64_t kMaxRenderSteps = 2'000'000;
  static constexpr size_t kMaxRenderBytes = size_t{256} << 20;

  explicit Renderer(std::string& out) : out_(out) { frames_.emplace_back(); }

  // `set ns.a = ns` makes a reference cycle; emptying every namespace at the end breaks it.
  ~Renderer() {
    for (const auto& d : namespaces_) d->items.clear();
  }
  Renderer(const Renderer&) = delete;
  Renderer& operator=(const Renderer&) = delete;

  void SetGlobal(const std::string& name, Value v) { frames_[0][name] = std::move(v); }

  absl::StatusOr<Flow> Exec(const Body& body) {
    for (const Stmt& st : body) {
      // The budget: every statement (a loop's body counts once per iteration) and the output
      // so far. Loops over the request's messages nested in one another grow with the square of
      // the request; the budget turns that into an error instead of minutes of CPU or memory.
      if (++steps_ > kMaxRenderSteps) {
        return LineError(st.line, absl::StrCat("rendering took more than ", kMaxRenderSteps,
                                               " steps (loops nested over a large input?)"));
      }
      if (out_.size() > kMaxRenderBytes) {
        return LineError(st.line,
                         absl::StrCat("the rendered text exceeds ", kMaxRenderBytes, " bytes"));
      }
      HMOE_ASSIGN_OR_RETURN(Flow f, ExecOne(st));
      if (f != Flow::kNormal) return f;
    }
    return Flow::kNormal;
  }

 private:
  absl::StatusOr<Flow> ExecOne(const Stmt& st) {
    switch (st.type) {
      case Stmt::kText:
        out_ += st.text;
        return Flow::kNormal;
      case Stmt::kOutput: {
        HMOE_ASSIGN_OR_RETURN(Value v, Eval(*st.expr));
        auto s = PyStr(v);
        if (!s.ok()) return Located(st.line, s.status());
        out_ += *s;
        return Flow::kNormal;
      }
      case Stmt::kIf:
        for (const auto& [cond, body] : st.branches) {
          bool take = true;
          if (cond) {
            HMOE_ASSIGN_OR_RETURN(Value c, Eval(*cond));
            take = Truthy(c);
          }
          if (take) return Exec(body);
        }
        return Flow::kNormal;
      case Stmt::kFor:
        return ExecFor(st);
      case Stmt::kSet: {
        HMOE_ASSIGN_OR_RETURN(Value v, Eval(*st.expr));
        return Assign(st, st.targets, std::move(v));
      }
      case Stmt::kSetAttr: {
        HMOE_ASSIGN_OR_RETURN(Value v, Eval(*st.expr));
        const Value ns = Lookup(st.targets[0]);
        if (ns.kind != Kind::kObject || ns.s != "namespace") {
          return LineError(st.line, "cannot assign attribute on non-namespace object");
        }
        ns.dict->Set(st.targets[1], std::move(v));
        return Flow::kNormal;
      }
      case Stmt::kSetBlock: {
        std::string saved;
        std::swap(saved, out_);
        auto f = Exec(st.body);
        std::swap(saved, out_);
        if (!f.ok()) return f.status();
        frames_.back()[st.targets[0]] = Value::Str(std::move(saved));
        return Flow::kNormal;
      }
      case Stmt::kBreak:
        return Flow::kBreak;
      case Stmt::kContinue:
        return Flow::kContinue;
      case Stmt::kBlock:
        return Exec(st.body);
      case Stmt::kMacro: {
        // A macro value: called, it renders its body in a scope of the template's top level
        // and its parameters (not the caller's locals), and returns the text.
        const Stmt* macro = &st;
        frames_.back()[st.text] = Value::Function(
            [this, macro](const Args& args, const KwArgs& kwargs) -> absl::StatusOr<Value> {
              return CallMacro(*macro, args, kwargs);
            });
        return Flow::kNormal;
      }
    }
    return Flow::kNormal;
  }

  absl::StatusOr<Flow> Assign(const Stmt& st, const std::vector<std::string>& targets, Value v) {
    if (targets.size() == 1) {
      frames_.back()[targets[0]] = std::move(v);
      return Flow::kNormal;
    }
    auto items = Iterate(v);
    if (!items.ok()) return Located(st.line, items.status());
    if (items->size() != targets.size()) {
      return LineError(st.line, absl::StrCat("cannot unpack ", items->size(), " values into ",
                                             targets.size(), " names"));
    }
    for (size_t k = 0; k < targets.size(); ++k) frames_.back()[targets[k]] = (*items)[k];
    return Flow::kNormal;
  }

  absl::StatusOr<Flow> ExecFor(const Stmt& st) {
    HMOE_ASSIGN_OR_RETURN(Value seq, Eval(*st.expr));
    auto items_or = Iterate(seq);
    if (!items_or.ok()) return Located(st.line, items_or.status());
    std::vector<Value> items = *std::move(items_or);
    if (st.filter) {
      std::vector<Value> kept;
      for (Value& item : items) {
        frames_.emplace_back();
        auto a = Assign(st, st.targets, item);
        auto c = a.ok() ? Eval(*st.filter) : absl::StatusOr<Value>(a.status());
        frames_.pop_back();
        if (!c.ok()) return c.status();
        if (Truthy(*c)) kept.push_back(std::move(item));
      }
      items = std::move(kept);
    }
    if (items.empty()) return Exec(st.else_body);
    const int64_t n = static_cast<int64_t>(items.size());
    for (int64_t k = 0; k < n; ++k) {
      if (++steps_ > kMaxRenderSteps) {  // an iteration is a step too, even with an empty body
        return LineError(st.line, absl::StrCat("rendering took more than ", kMaxRenderSteps,
                                               " steps (loops nested over a large input?)"));
      }
      Value loop = Value::Object("loop");
      Dict& d = *loop.dict;
      d.Set("index0", Value::Int(k));
      d.Set("index", Value::Int(k + 1));
      d.Set("revindex0", Value::Int(n - k - 1));
      d.Set("revindex", Value::Int(n - k));
      d.Set("first", Value::Bool(k == 0));
      d.Set("last", Value::Bool(k == n - 1));
      d.Set("length", Value::Int(n));
      d.Set("depth", Value::Int(1));
      d.Set("depth0", Value::Int(0));
      if (k > 0) d.Set("previtem", items[k - 1]);
      if (k + 1 < n) d.Set("nextitem", items[k + 1]);
      frames_.emplace_back();
      frames_.back()["loop"] = loop;
      auto a = Assign(st, st.targets, items[k]);
      absl::StatusOr<Flow> f = a.ok() ? Exec(st.body) : a;
      frames_.pop_back();
      if (!f.ok()) return f.status();
      if (*f == Flow::kBreak) break;
    }
    return Flow::kNormal;
  }

  static absl::Status Located(int line, const absl::Status& s) {
    if (s.message().rfind("chat template line", 0) == 0 || IsRaisedByTemplate(s)) return s;
    return LineError(line, std::string(s.message()));
  }

  Value Lookup(const std::string& name) const {
    for (auto it = frames_.rbegin(); it != frames_.rend(); ++it) {
      auto f = it->find(name);
      if (f != it->end()) return f->second;
    }
    return Value::Undefined(absl::StrCat("'", name, "'"));
  }

  absl::StatusOr<Value> Eval(const Expr& e) {
    auto v = EvalInner(e);
    if (!v.ok()) return Located(e.line, v.status());
    return v;
  }

  absl::StatusOr<Value> EvalInner(const Expr& e) {
    switch (e.type) {
      case Expr::kLiteral:
        return e.literal;
      case Expr::kName:
        return Lookup(e.name);
      case Expr::kAttr: {
        HMOE_ASSIGN_OR_RETURN(Value obj, Eval(*e.kids[0]));
        if (obj.kind == Kind::kUndefined) return UndefinedError(obj);
        return GetAttr(obj, e.name);
      }
      case Expr::kItem: {
        HMOE_ASSIGN_OR_RETURN(Value obj, Eval(*e.kids[0]));
        HMOE_ASSIGN_OR_RETURN(Value key, Eval(*e.kids[1]));
        return GetItem(obj, key);
      }
      case Expr::kSlice: {
        HMOE_ASSIGN_OR_RETURN(Value obj, Eval(*e.kids[0]));
        Value bounds[3];
        for (int k = 0; k < 3; ++k) {
          if (e.kids[k + 1]) {
            HMOE_ASSIGN_OR_RETURN(bounds[k], Eval(*e.kids[k + 1]));
          }
        }
        if (obj.kind == Kind::kUndefined) return UndefinedError(obj);
        if (obj.kind == Kind::kString) {
          std::vector<char32_t> cps = Decode(obj.s);
          HMOE_ASSIGN_OR_RETURN(auto idx,
                                SliceIndices(bounds[0], bounds[1], bounds[2], cps.size()));
          std::string out;
          for (size_t k : idx) AppendUtf8(out, cps[k]);
          return Value::Str(std::move(out));
        }
        if (obj.kind == Kind::kList) {
          HMOE_ASSIGN_OR_RETURN(auto idx,
                                SliceIndices(bounds[0], bounds[1], bounds[2], obj.list->size()));
          std::vector<Value> out;
          for (size_t k : idx) out.push_back((*obj.list)[k]);
          return Value::List(std::move(out), obj.tuple);
        }
        return absl::InvalidArgumentError(
            absl::StrCat("'", TypeName(obj), "' object is not subscriptable"));
      }
      case Expr::kCall:
        return EvalCall(e);
      case Expr::kFilter:
        return EvalFilter(e);
      case Expr::kTest: {
        HMOE_ASSIGN_OR_RETURN(Value v, Eval(*e.kids[0]));
        const bool r = RunTest(e.name, v);
        return Value::Bool(e.negate ? !r : r);
      }
      case Expr::kNeg:
      case Expr::kPos: {
        HMOE_ASSIGN_OR_RETURN(Value v, Eval(*e.kids[0]));
        if (v.kind == Kind::kUndefined) return UndefinedError(v);
        if (!v.IsNumber()) {
          return absl::InvalidArgumentError(absl::StrCat("bad operand type for unary ",
                                                         e.type == Expr::kNeg ? "-" : "+", ": '",
                                                         TypeName(v), "'"));
        }
        if (e.type == Expr::kPos) return v.kind == Kind::kBool ? Value::Int(v.b) : v;
        if (v.kind == Kind::kFloat) return Value::Float(-v.f);
        if (v.kind == Kind::kInt && v.i == std::numeric_limits<int64_t>::min()) {
          return IntOverflow();
        }
        return Value::Int(-(v.kind == Kind::kBool ? v.b : v.i));
      }
      case Expr::kNot: {
        HMOE_ASSIGN_OR_RETURN(Value v, Eval(*e.kids[0]));
        return Value::Bool(!Truthy(v));
      }
      case Expr::kAnd: {
        HMOE_ASSIGN_OR_RETURN(Value a, Eval(*e.kids[0]));
        if (!Truthy(a)) return a;
        return Eval(*e.kids[1]);
      }
      case Expr::kOr: {
        HMOE_ASSIGN_OR_RETURN(Value a, Eval(*e.kids[0]));
        if (Truthy(a)) return a;
        return Eval(*e.kids[1]);
      }
      case Expr::kCompare: {
        HMOE_ASSIGN_OR_RETURN(Value left, Eval(*e.kids[0]));
        for (size_t k = 0; k < e.ops.size(); ++k) {
          HMOE_ASSIGN_OR_RETURN(Value right, Eval(*e.kids[k + 1]));
          const std::string& op = e.ops[k];
          bool r;
          if (op == "==" || op == "!=") {
            r = Equal(left, right) == (op == "==");
          } else if (op == "in" || op == "notin") {
            HMOE_ASSIGN_OR_RETURN(bool c, Contains(right, left));
            r = c == (op == "in");
          } else {
            if (left.kind == Kind::kUndefined) return UndefinedError(left);
            if (right.kind == Kind::kUndefined) return UndefinedError(right);
            HMOE_ASSIGN_OR_RETURN(int o, Order(left, right));
            r = op == "<" ? o < 0 : op == ">" ? o > 0 : op == "<=" ? o <= 0 : o >= 0;
          }
          if (!r) return Value::Bool(false);
          left = std::move(right);
        }
        return Value::Bool(true);
      }
      case Expr::kBinary: {
        HMOE_ASSIGN_OR_RETURN(Value a, Eval(*e.kids[0]));
        HMOE_ASSIGN_OR_RETURN(Value b, Eval(*e.kids[1]));
        return Arith(e.name, a, b);
      }
      case Expr::kConcat: {
        std::string out;
        for (const auto& k : e.kids) {
          HMOE_ASSIGN_OR_RETURN(Value v, Eval(*k));
          HMOE_ASSIGN_OR_RETURN(std::string s, PyStr(v));
          out += s;
        }
        return Value::Str(std::move(out));
      }
      case Expr::kCond: {
        HMOE_ASSIGN_OR_RETURN(Value c, Eval(*e.kids[1]));
        if (Truthy(c)) return Eval(*e.kids[0]);
        if (e.kids.size() == 3) return Eval(*e.kids[2]);
        return Value::Undefined("the else branch of a conditional expression");
      }
      case Expr::kList:
      case Expr::kTuple: {
        std::vector<Value> items;
        for (const auto& k : e.kids) {
          HMOE_ASSIGN_OR_RETURN(Value v, Eval(*k));
          items.push_back(std::move(v));
        }
        return Value::List(std::move(items), e.type == Expr::kTuple);
      }
      case Expr::kDict: {
        Value d = Value::NewDict();
        for (size_t k = 0; k + 1 < e.kids.size(); k += 2) {
          HMOE_ASSIGN_OR_RETURN(Value key, Eval(*e.kids[k]));
          HMOE_ASSIGN_OR_RETURN(Value v, Eval(*e.kids[k + 1]));
          if (key.kind != Kind::kString) {
            return absl::InvalidArgumentError("dict literal keys must be strings");
          }
          d.dict->Set(key.s, std::move(v));
        }
        return d;
      }
    }
    return absl::InternalError("unknown expression");
  }

  absl::Status EvalArgs(const Expr& e, size_t first, Args& args, KwArgs& kwargs) {
    const size_t nkw = e.kwnames.size();
    for (size_t k = first; k < e.kids.size(); ++k) {
      HMOE_ASSIGN_OR_RETURN(Value v, Eval(*e.kids[k]));
      if (k + nkw >= e.kids.size()) {
        kwargs.emplace_back(e.kwnames[k + nkw - e.kids.size()], std::move(v));
      } else {
        args.push_back(std::move(v));
      }
    }
    return absl::OkStatus();
  }

  absl::StatusOr<Value> CallMacro(const Stmt& m, const Args& args, const KwArgs& kwargs) {
    if (args.size() > m.targets.size()) {
      return absl::InvalidArgumentError(absl::StrCat("macro '", m.text, "' takes not more than ",
                                                     m.targets.size(), " argument(s)"));
    }
    if (macro_depth_ >= 64) {
      return absl::InvalidArgumentError(
          absl::StrCat("macro '", m.text, "': calls nested deeper than 64"));
    }
    std::map<std::string, Value> scope;
    std::vector<bool> bound(m.targets.size(), false);
    for (size_t k = 0; k < args.size(); ++k) {
      scope[m.targets[k]] = args[k];
      bound[k] = true;
    }
    for (const auto& [name, v] : kwargs) {
      auto it = std::find(m.targets.begin(), m.targets.end(), name);
      if (it == m.targets.end()) {
        return absl::InvalidArgumentError(
            absl::StrCat("macro '", m.text, "' takes no keyword argument '", name, "'"));
      }
      if (bound[it - m.targets.begin()]) {
        return absl::InvalidArgumentError(
            absl::StrCat("macro '", m.text, "' got multiple values for argument '", name, "'"));
      }
      scope[name] = v;
      bound[it - m.targets.begin()] = true;
    }
    std::vector<std::map<std::string, Value>> saved_frames;
    saved_frames.push_back(frames_[0]);
    std::swap(saved_frames, frames_);  // frames_ = {top level}; saved_frames = the caller's.
    // Defaults are evaluated in the macro's scope, left to right.
    absl::Status status;
    frames_.emplace_back();
    for (size_t k = 0; k < m.targets.size() && status.ok(); ++k) {
      if (bound[k]) {
        frames_.back()[m.targets[k]] = scope[m.targets[k]];
      } else if (m.defaults[k]) {
        auto v = Eval(*m.defaults[k]);
        if (v.ok()) {
          frames_.back()[m.targets[k]] = *std::move(v);
        } else {
          status = v.status();
        }
      } else {
        frames_.back()[m.targets[k]] = Value::Undefined(absl::StrCat("'", m.targets[k], "'"));
      }
    }
    std::string text;
    if (status.ok()) {
      std::swap(text, out_);
      ++macro_depth_;
      auto f = Exec(m.body);
      --macro_depth_;
      std::swap(text, out_);
      if (!f.ok()) status = f.status();
    }
    // The top level may have changed inside (a namespace is shared; a set inside a macro is
    // local): keep the caller's frames, with the top level as it was.
    std::swap(saved_frames, frames_);
    if (!status.ok()) return status;
    return Value::Str(std::move(text));
  }

  absl::StatusOr<Value> EvalCall(const Expr& e) {
    Args args;
    KwArgs kwargs;
    const Expr& callee = *e.kids[0];
    if (callee.type == Expr::kName) {
      HMOE_RETURN_IF_ERROR(EvalArgs(e, 1, args, kwargs));
      const Value shadow = Lookup(callee.name);
      if (shadow.kind == Kind::kFunc) return (*shadow.func)(args, kwargs);  // A macro.
      if (shadow.kind != Kind::kUndefined) {
        return absl::InvalidArgumentError(absl::StrCat("'", callee.name, "' is not callable"));
      }
      if (!Globals().count(callee.name)) {
        return absl::InvalidArgumentError(absl::StrCat("'", callee.name, "' is undefined"));
      }
      if (callee.name == "raise_exception") {
        HMOE_RETURN_IF_ERROR(WantArgs(callee.name, args, kwargs, 1, 1));
        HMOE_ASSIGN_OR_RETURN(std::string msg, PyStr(args[0]));
        absl::Status s = absl::InvalidArgumentError(msg);
        s.SetPayload(kRaisedPayload, absl::Cord("1"));
        return s;
      }
      if (callee.name == "namespace") {
        Value ns = Value::Object("namespace");
        namespaces_.push_back(ns.dict);
        for (const Value& a : args) {
          if (a.kind != Kind::kDict) {
            return absl::InvalidArgumentError("namespace() takes a dict or keyword arguments");
          }
          for (const auto& [k, v] : a.dict->items) ns.dict->Set(k, v);
        }
        for (const auto& [k, v] : kwargs) ns.dict->Set(k, v);
        return ns;
      }
      // range
      HMOE_RETURN_IF_ERROR(WantArgs(callee.name, args, kwargs, 1, 3));
      for (const Value& a : args) {
        if (a.kind != Kind::kInt) return absl::InvalidArgumentError("range() takes integers");
      }
      int64_t start = 0, stop, step = 1;
      if (args.size() == 1) {
        stop = args[0].i;
      } else {
        start = args[0].i;
        stop = args[1].i;
        if (args.size() == 3) step = args[2].i;
      }
      if (step == 0) return absl::InvalidArgumentError("range() arg 3 must not be zero");
      std::vector<Value> items;
      for (int64_t k = start; step > 0 ? k < stop : k > stop; k += step) {
        items.push_back(Value::Int(k));
        if (items.size() > 1000000) return absl::InvalidArgumentError("range() too long");
      }
      Value range = Value::List(std::move(items));
      // Python prints a range as range(start, stop[, step]), and json.dumps refuses it.
      range.s = step == 1 ? absl::StrCat("range(", start, ", ", stop, ")")
                          : absl::StrCat("range(", start, ", ", stop, ", ", step, ")");
      return range;
    }
    HMOE_ASSIGN_OR_RETURN(Value obj, Eval(*callee.kids[0]));
    if (obj.kind == Kind::kUndefined) return UndefinedError(obj);
    Value fn = GetAttr(obj, callee.name);
    HMOE_RETURN_IF_ERROR(EvalArgs(e, 1, args, kwargs));
    if (fn.kind != Kind::kFunc) {
      return absl::InvalidArgumentError(
          absl::StrCat("'", TypeName(obj), "' object has no method '", callee.name, "'"));
    }
    return (*fn.func)(args, kwargs);
  }

  static bool RunTest(const std::string& name, const Value& v) {
    if (name == "defined") return v.kind != Kind::kUndefined;
    if (name == "undefined") return v.kind == Kind::kUndefined;
    if (name == "none") return v.kind == Kind::kNone;
    if (name == "string") return v.kind == Kind::kString;
    if (name == "mapping") return v.kind == Kind::kDict;
    if (name == "iterable" || name == "sequence") {
      return v.kind == Kind::kUndefined || v.kind == Kind::kString || v.kind == Kind::kList ||
             v.kind == Kind::kDict;
    }
    if (name == "number") return v.IsNumber();
    if (name == "boolean") return v.kind == Kind::kBool;
    if (name == "true") return v.kind == Kind::kBool && v.b;
    if (name == "false") return v.kind == Kind::kBool && !v.b;
    if (name == "integer") return v.kind == Kind::kInt;
    if (name == "float") return v.kind == Kind::kFloat;
    return false;
  }

  absl::StatusOr<Value> EvalFilter(const Expr& e) {
    HMOE_ASSIGN_OR_RETURN(Value v, Eval(*e.kids[0]));
    Args args;
    KwArgs kwargs;
    HMOE_RETURN_IF_ERROR(EvalArgs(e, 1, args, kwargs));
    const std::string& f = e.name;
    // Binds positional and keyword arguments to the parameter names `params`.
    const auto bind = [&](std::vector<std::string> params) -> absl::StatusOr<std::vector<Value>> {
      std::vector<Value> out(params.size(), Value::Undefined(""));
      if (args.size() > params.size()) {
        return absl::InvalidArgumentError(absl::StrCat("filter ", f, ": too many arguments"));
      }
      for (size_t k = 0; k < args.size(); ++k) out[k] = args[k];
      for (const auto& [name, val] : kwargs) {
        auto it = std::find(params.begin(), params.end(), name);
        if (it == params.end()) {
          return absl::InvalidArgumentError(
              absl::StrCat("filter ", f, ": unexpected keyword argument '", name, "'"));
        }
        out[it - params.begin()] = val;
      }
      return out;
    };
    if (f == "tojson") {
      HMOE_ASSIGN_OR_RETURN(auto p, bind({"ensure_ascii", "indent", "separators", "sort_keys"}));
      JsonStyle style;
      style.ensure_ascii = Truthy(p[0]);
      style.sort_keys = Truthy(p[3]);
      if (p[1].kind == Kind::kInt) {
        style.indent = std::string(std::max<int64_t>(p[1].i, 0), ' ');
      } else if (p[1].kind == Kind::kString) {
        style.indent = p[1].s;
      } else if (p[1].kind != Kind::kUndefined && p[1].kind != Kind::kNone) {
        return absl::InvalidArgumentError("tojson: indent must be an int or a str");
      }
      if (style.indent) style.item_sep = ",";
      if (p[2].kind == Kind::kList && p[2].list->size() == 2 &&
          (*p[2].list)[0].kind == Kind::kString && (*p[2].list)[1].kind == Kind::kString) {
        style.item_sep = (*p[2].list)[0].s;
        style.key_sep = (*p[2].list)[1].s;
      } else if (p[2].kind != Kind::kUndefined && p[2].kind != Kind::kNone) {
        return absl::InvalidArgumentError("tojson: separators must be a pair of strings");
      }
      std::string out;
      HMOE_RETURN_IF_ERROR(JsonDump(out, v, style, 0));
      return Value::Str(std::move(out));
    }
    if (f == "length" || f == "count") {
      HMOE_RETURN_IF_ERROR(WantArgs(f, args, kwargs, 0, 0));
      HMOE_ASSIGN_OR_RETURN(int64_t n, Length(v));
      return Value::Int(n);
    }
    if (f == "trim") {
      HMOE_ASSIGN_OR_RETURN(auto p, bind({"chars"}));
      HMOE_ASSIGN_OR_RETURN(std::string s, PyStr(v));
      HMOE_ASSIGN_OR_RETURN(std::string r, PyStrip(s, p[0], true, true));
      return Value::Str(std::move(r));
    }
    if (f == "default" || f == "d") {
      HMOE_ASSIGN_OR_RETURN(auto p, bind({"default_value", "boolean"}));
      const bool use = v.kind == Kind::kUndefined || (Truthy(p[1]) && !Truthy(v));
      if (!use) return v;
      return p[0].kind == Kind::kUndefined && args.empty() &&
                     std::none_of(kwargs.begin(), kwargs.end(),
                                  [](auto& kv) { return kv.first == "default_value"; })
                 ? Value::Str("")
                 : p[0];
    }
    if (f == "join") {
      HMOE_ASSIGN_OR_RETURN(auto p, bind({"d", "attribute"}));
      if (p[1].kind != Kind::kUndefined) {
        return absl::InvalidArgumentError("join: the attribute argument is not supported");
      }
      std::string sep;
      if (p[0].kind != Kind::kUndefined) {
        HMOE_ASSIGN_OR_RETURN(sep, PyStr(p[0]));
      }
      HMOE_ASSIGN_OR_RETURN(std::vector<Value> items, Iterate(v));
      std::string out;
      for (size_t k = 0; k < items.size(); ++k) {
        if (k) out += sep;
        HMOE_ASSIGN_OR_RETURN(std::string s, PyStr(items[k]));
        out += s;
      }
      return Value::Str(std::move(out));
    }
    if (f == "first" || f == "last") {
      HMOE_RETURN_IF_ERROR(WantArgs(f, args, kwargs, 0, 0));
      HMOE_ASSIGN_OR_RETURN(std::vector<Value> items, Iterate(v));
      if (items.empty())
        return Value::Undefined(absl::StrCat("the ", f, " item of an empty sequence"));
      return f == "first" ? items.front() : items.back();
    }
    if (f == "string") {
      HMOE_RETURN_IF_ERROR(WantArgs(f, args, kwargs, 0, 0));
      HMOE_ASSIGN_OR_RETURN(std::string s, PyStr(v));
      return Value::Str(std::move(s));
    }
    if (f == "lower" || f == "upper") {
      HMOE_RETURN_IF_ERROR(WantArgs(f, args, kwargs, 0, 0));
      HMOE_ASSIGN_OR_RETURN(std::string s, PyStr(v));
      HMOE_ASSIGN_OR_RETURN(std::string r, PyCase(s, f == "upper"));
      return Value::Str(std::move(r));
    }
    if (f == "list") {
      HMOE_RETURN_IF_ERROR(WantArgs(f, args, kwargs, 0, 0));
      HMOE_ASSIGN_OR_RETURN(std::vector<Value> items, Iterate(v));
      return Value::List(std::move(items));
    }
    // items
    HMOE_RETURN_IF_ERROR(WantArgs(f, args, kwargs, 0, 0));
    if (v.kind == Kind::kUndefined) return Value::List({});
    if (v.kind != Kind::kDict)
      return absl::InvalidArgumentError("items: can only be used on a dict");
    return CallDictMethod(v, "items", {}, {});
  }

  std::string& out_;
  std::vector<std::map<std::string, Value>> frames_;
  int macro_depth_ = 0;
  int64_t steps_ = 0;  // statements executed (the budget)
  std::vector<std::shared_ptr<Dict>> namespaces_;
};

}  // namespace

absl::StatusOr<Template> Template::Parse(std::string_view source) {
  if (!ValidUtf8(source)) return absl::InvalidArgumentError("chat template is not valid UTF-8");
  // jinja2 normalizes \r\n and \r to \n, and (keep_trailing_newline=False) drops one final \n.
  std::string src;
  src.reserve(source.size());
  for (size_t k = 0; k < source.size(); ++k) {
    if (source[k] == '\r') {
      src += '\n';
      if (k + 1 < source.size() && source[k + 1] == '\n') ++k;
    } else {
      src += source[k];
    }
  }
  if (!src.empty() && src.back() == '\n') src.pop_back();
  Lexer lexer(std::move(src));
  HMOE_ASSIGN_OR_RETURN(std::vector<Segment> segs, lexer.Run());
  Parser parser(std::move(segs));
  auto program = std::make_shared<internal::Program>();
  HMOE_ASSIGN_OR_RETURN(program->body, parser.ParseAll());
  return Template(std::move(program));
}

absl::StatusOr<std::string> Template::Render(const nlohmann::ordered_json& context) const {
  if (!context.is_object()) {
    return absl::InvalidArgumentError("the template context must be a JSON object");
  }
  std::string out;
  Renderer r(out);
  for (const auto& [k, v] : context.items()) {
    auto value = FromJson(v);
    if (!value.ok()) return Annotate(value.status(), absl::StrCat("context variable '", k, "'"));
    r.SetGlobal(k, *std::move(value));
  }
  HMOE_ASSIGN_OR_RETURN(Flow f, r.Exec(program_->body));
  if (f != Flow::kNormal) {
    return absl::InvalidArgumentError("chat template: break or continue outside a for loop");
  }
  return out;
}

bool IsRaisedByTemplate(const absl::Status& status) {
  return status.GetPayload(kRaisedPayload).has_value();
}

std::string PyJsonDumps(const nlohmann::ordered_json& value, bool ensure_ascii, bool sort_keys) {
  auto v = FromJson(value);
  if (!v.ok()) return std::string();
  JsonStyle style;
  style.ensure_ascii = ensure_ascii;
  style.sort_keys = sort_keys;
  std::string out;
  (void)JsonDump(out, *v, style, 0);
  return out;
}

}  // namespace hmoe::jinja
