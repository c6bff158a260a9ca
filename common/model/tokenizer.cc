#include "common/model/tokenizer.h"

#include <algorithm>
#include <array>
#include <queue>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

#include "common/base/json.h"
#include "common/base/mapped_file.h"
#include "common/base/status_macros.h"

namespace hmoe {
namespace internal {
namespace {

// ---------------------------------------------------------------------------------- byte level

struct ByteMap {
  std::array<uint32_t, 256> byte_to_cp{};
  std::array<int16_t, 324> cp_to_byte{};  // code points < 324 cover the whole map
};

const ByteMap& GetByteMap() {
  static const ByteMap map = [] {
    ByteMap m;
    m.cp_to_byte.fill(-1);
    uint32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174);
      m.byte_to_cp[b] = printable ? static_cast<uint32_t>(b) : next++;
      m.cp_to_byte[m.byte_to_cp[b]] = static_cast<int16_t>(b);
    }
    return m;
  }();
  return map;
}

// ---------------------------------------------------------------------------------- UTF-8

// Length of the well-formed UTF-8 sequence at the start of `s`, or 0 when ill-formed. `*prefix`
// receives the length of the maximal well-formed prefix (>= 1 when ill-formed: a lone bad byte
// counts as a subpart of length 1), and `*truncated` whether the sequence was cut by the end of
// `s`.
size_t Utf8SequenceLength(std::string_view s, uint32_t* cp, size_t* prefix, bool* truncated) {
  *truncated = false;
  const auto at = [&](size_t i) { return static_cast<uint8_t>(s[i]); };
  const uint8_t b0 = at(0);
  if (b0 < 0x80) {
    *cp = b0;
    return 1;
  }
  size_t need;
  uint8_t lo = 0x80, hi = 0xBF;  // allowed range of the second byte
  uint32_t value;
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    need = 2;
    value = b0 & 0x1Fu;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    need = 3;
    value = b0 & 0x0Fu;
    if (b0 == 0xE0) lo = 0xA0;
    if (b0 == 0xED) hi = 0x9F;
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    need = 4;
    value = b0 & 0x07u;
    if (b0 == 0xF0) lo = 0x90;
    if (b0 == 0xF4) hi = 0x8F;
  } else {
    *prefix = 1;
    return 0;
  }
  for (size_t i = 1; i < need; ++i) {
    if (i >= s.size()) {
      *truncated = true;
      *prefix = i;
      return 0;
    }
    const uint8_t b = at(i);
    const uint8_t min = i == 1 ? lo : 0x80, max = i == 1 ? hi : 0xBF;
    if (b < min || b > max) {
      *prefix = i;
      return 0;
    }
    value = (value << 6) | (b & 0x3Fu);
  }
  *cp = value;
  return need;
}

// ---------------------------------------------------------------------------------- scanners

// One character of the text being pre-tokenized. Ill-formed UTF-8 bytes are single characters
// of class kOther with cp = 0xFFFFFFFF.
struct Unit {
  uint32_t cp;
  uint32_t offset;  // byte offset in the text
  CharClass cls;
  uint8_t props;  // CodePointProps(cp) (0 for an ill-formed byte)
};

constexpr uint32_t kNoCodePoint = 0xFFFFFFFFu;

std::vector<Unit> DecodeUnits(std::string_view text) {
  std::vector<Unit> units;
  units.reserve(text.size());
  size_t pos = 0;
  while (pos < text.size()) {
    uint32_t cp = 0;
    size_t prefix = 0;
    bool truncated = false;
    const size_t n = Utf8SequenceLength(text.substr(pos), &cp, &prefix, &truncated);
    if (n == 0) {
      units.push_back({kNoCodePoint, static_cast<uint32_t>(pos), CharClass::kOther, 0});
      ++pos;
      continue;
    }
    const uint8_t props = CodePointProps(cp);
    units.push_back({cp, static_cast<uint32_t>(pos), PropsClass(props), props});
    pos += n;
  }
  return units;
}

bool IsCrLf(const Unit& u) { return u.cp == '\r' || u.cp == '\n'; }
bool IsLetterOrMark(const Unit& u) {
  return u.cls == CharClass::kLetter || u.cls == CharClass::kMark;
}
bool IsPunctOrSymbol(const Unit& u) {
  return u.cls == CharClass::kPunct || u.cls == CharClass::kSymbol;
}
bool IsAsciiLetter(const Unit& u) {
  return (u.cp >= 'a' && u.cp <= 'z') || (u.cp >= 'A' && u.cp <= 'Z');
}
// The 32 characters of [!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~].
bool IsAsciiPunct(const Unit& u) {
  return (u.cp >= 0x21 && u.cp <= 0x2F) || (u.cp >= 0x3A && u.cp <= 0x40) ||
         (u.cp >= 0x5B && u.cp <= 0x60) || (u.cp >= 0x7B && u.cp <= 0x7E);
}
bool IsCjkKana(const Unit& u) {
  return (u.cp >= 0x4E00 && u.cp <= 0x9FA5) || (u.cp >= 0x3040 && u.cp <= 0x30FF);
}

// The length of the run of units satisfying `pred` from `pos`, looking at no more than `max` of
// them (plus the one that ends the run). Every scanner below is built from this and consumes
// what it looks at, so that pre-tokenizing is linear in the text (see ThreadTokenizerWork).
template <typename Pred>
size_t RunLength(const std::vector<Unit>& u, size_t pos, size_t end, Pred pred,
                 size_t max = SIZE_MAX) {
  const size_t limit = end - pos < max ? end : pos + max;
  size_t i = pos;
  while (i < limit && pred(u[i])) ++i;
  ThreadTokenizerWork().scan_steps += i - pos + 1;
  return i - pos;
}

// Whitespace alternatives shared by the DeepSeek-V3 and GPT-2 rules, at a whitespace unit:
// (with_newline_rule: \s*[\r\n]+ first) then \s+(?!\S) then \s+.
size_t MatchWhitespace(const std::vector<Unit>& u, size_t pos, size_t end, bool with_newline_rule) {
  const size_t run =
      RunLength(u, pos, end, [](const Unit& x) { return x.cls == CharClass::kSpace; });
  if (with_newline_rule) {
    // \s* backtracks to the last CR/LF of the run; [\r\n]+ takes it.
    // Linear: the match (up to the last CR/LF) or, without one, all but at most one unit of the
    // run is consumed.
    for (size_t i = pos + run; i > pos; --i) {
      ++ThreadTokenizerWork().scan_steps;
      if (IsCrLf(u[i - 1])) return i - pos;
    }
  }
  if (pos + run == end) return run;  // \s+(?!\S) at the end of the piece
  if (run >= 2) return run - 1;      // give one back so that the lookahead sees whitespace
  return run;                        // \s+
}

size_t MatchDigits3(const std::vector<Unit>& u, size_t pos, size_t end) {
  // Looks at 3 units at most: scanning the whole digit run at every match made a run of n digits
  // cost n^2/6 steps (issue 16: 1 MB of digits took 98 s).
  return RunLength(
      u, pos, end, [](const Unit& x) { return x.cls == CharClass::kNumber; }, 3);
}

size_t MatchCjkKana(const std::vector<Unit>& u, size_t pos, size_t end) {
  return RunLength(u, pos, end, IsCjkKana);
}

size_t MatchDeepSeekV3(const std::vector<Unit>& u, size_t pos, size_t end) {
  const Unit& c = u[pos];
  const bool has_next = pos + 1 < end;
  // [!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+
  if (IsAsciiPunct(c) && has_next && IsAsciiLetter(u[pos + 1])) {
    return 1 + RunLength(u, pos + 1, end, IsAsciiLetter);
  }
  // [^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+
  if (IsLetterOrMark(c)) return RunLength(u, pos, end, IsLetterOrMark);
  if (!IsCrLf(c) && !IsPunctOrSymbol(c) && has_next && IsLetterOrMark(u[pos + 1])) {
    return 1 + RunLength(u, pos + 1, end, IsLetterOrMark);
  }
  //  ?[\p{P}\p{S}]+[\r\n]*
  size_t start = pos;
  if (c.cp == ' ' && has_next && IsPunctOrSymbol(u[pos + 1])) start = pos + 1;
  if (IsPunctOrSymbol(u[start])) {
    size_t i = start + RunLength(u, start, end, IsPunctOrSymbol);
    i += RunLength(u, i, end, IsCrLf);
    return i - pos;
  }
  // \s*[\r\n]+|\s+(?!\S)|\s+
  if (c.cls == CharClass::kSpace) return MatchWhitespace(u, pos, end, /*with_newline_rule=*/true);
  return 0;
}

size_t MatchGpt2(const std::vector<Unit>& u, size_t pos, size_t end) {
  const Unit& c = u[pos];
  const bool has_next = pos + 1 < end;
  // 's|'t|'re|'ve|'m|'ll|'d
  if (c.cp == '\'' && has_next) {
    const uint32_t a = u[pos + 1].cp;
    if (a == 's' || a == 't' || a == 'm' || a == 'd') return 2;
    if (pos + 2 < end) {
      const uint32_t b = u[pos + 2].cp;
      if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return 3;
    }
  }
  const auto is_letter = [](const Unit& x) { return x.cls == CharClass::kLetter; };
  const auto is_number = [](const Unit& x) { return x.cls == CharClass::kNumber; };
  const auto is_other = [](const Unit& x) {
    return x.cls != CharClass::kSpace && x.cls != CharClass::kLetter && x.cls != CharClass::kNumber;
  };
  // " ?X+" for the three classes, in order.
  const size_t start = (c.cp == ' ' && has_next) ? pos + 1 : pos;
  if (is_letter(u[start])) return start - pos + RunLength(u, start, end, is_letter);
  if (is_letter(c)) return RunLength(u, pos, end, is_letter);
  if (is_number(u[start])) return start - pos + RunLength(u, start, end, is_number);
  if (is_number(c)) return RunLength(u, pos, end, is_number);
  if (is_other(u[start])) return start - pos + RunLength(u, start, end, is_other);
  if (is_other(c)) return RunLength(u, pos, end, is_other);
  if (c.cls == CharClass::kSpace) return MatchWhitespace(u, pos, end, /*with_newline_rule=*/false);
  return 0;
}

// ------------------------------------------------------------------ Kimi-K2 (tiktoken pat_str)

bool IsHan(const Unit& u) { return PropsHan(u.props); }
// [\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]
bool IsKimiUpper(const Unit& u) {
  const LetterKind k = PropsLetterKind(u.props);
  return !IsHan(u) &&
         (k == LetterKind::kUpper || k == LetterKind::kOther || u.cls == CharClass::kMark);
}
// [\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]
bool IsKimiLower(const Unit& u) {
  const LetterKind k = PropsLetterKind(u.props);
  return !IsHan(u) &&
         (k == LetterKind::kLower || k == LetterKind::kOther || u.cls == CharClass::kMark);
}
// In both classes above: Lm, Lo, M (not Han).
bool IsKimiShared(const Unit& u) {
  return !IsHan(u) && (PropsLetterKind(u.props) == LetterKind::kOther || u.cls == CharClass::kMark);
}
// [^\r\n\p{L}\p{N}]
bool IsKimiPrefix(const Unit& u) {
  return !IsCrLf(u) && u.cls != CharClass::kLetter && u.cls != CharClass::kNumber;
}
// [^\s\p{L}\p{N}]
bool IsKimiOther(const Unit& u) {
  return u.cls != CharClass::kSpace && u.cls != CharClass::kLetter && u.cls != CharClass::kNumber;
}

// (?i:'s|'t|'re|'ve|'m|'ll|'d)? at `pos`: its length (0 when absent). Case-insensitive as Rust
// regex's simple case folding: the only non-ASCII character that folds to one of these letters is
// U+017F (long s -> s).
size_t MatchKimiContraction(const std::vector<Unit>& u, size_t pos, size_t end) {
  if (pos + 1 >= end || u[pos].cp != '\'') return 0;
  const auto fold = [](uint32_t cp) -> uint32_t {
    if (cp >= 'A' && cp <= 'Z') return cp + 32;
    return cp == 0x17F ? 's' : cp;
  };
  ThreadTokenizerWork().scan_steps += 3;
  const uint32_t a = fold(u[pos + 1].cp);
  if (a == 's' || a == 't' || a == 'm' || a == 'd') return 2;
  if (pos + 2 >= end) return 0;
  const uint32_t b = fold(u[pos + 2].cp);
  if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return 3;
  return 0;
}

constexpr size_t kNoMatch = SIZE_MAX;

// [UPPER]*[LOWER]+(?i:...)? at `q`: the end of the match or kNoMatch. The greedy [UPPER]* takes
// the whole run of UPPER units; if the unit after it is LOWER (then an Ll), [LOWER]+ continues
// from there; otherwise [UPPER]* gives back units until [LOWER]+ can start, i.e. to the last
// unit of the run that is in both classes (Lm, Lo, M), and [LOWER]+ ends right after it (the
// units after it are Lu/Lt). One pass over the run.
size_t MatchKimiLowerTail(const std::vector<Unit>& u, size_t q, size_t end) {
  if (q >= end) return kNoMatch;
  size_t last_shared = kNoMatch;
  size_t i = q;
  while (i < end && IsKimiUpper(u[i])) {
    if (IsKimiShared(u[i])) last_shared = i;
    ++i;
  }
  ThreadTokenizerWork().scan_steps += i - q + 1;
  size_t e;
  if (i < end && IsKimiLower(u[i])) {
    e = i + RunLength(u, i, end, IsKimiLower);
  } else if (last_shared != kNoMatch) {
    e = last_shared + 1;
  } else {
    return kNoMatch;
  }
  return e + MatchKimiContraction(u, e, end);
}

// [UPPER]+[LOWER]*(?i:...)? at `q` (tried only where the alternative above failed).
size_t MatchKimiUpperRun(const std::vector<Unit>& u, size_t q, size_t end) {
  if (q >= end) return kNoMatch;
  const size_t run = RunLength(u, q, end, IsKimiUpper);
  if (run == 0) return kNoMatch;
  const size_t e = q + run + RunLength(u, q + run, end, IsKimiLower);
  return e + MatchKimiContraction(u, e, end);
}

size_t MatchKimi(const std::vector<Unit>& u, size_t pos, size_t end) {
  const Unit& c = u[pos];
  // [\p{Han}]+
  if (IsHan(c)) return RunLength(u, pos, end, IsHan);
  // The two letter alternatives, each first with the optional prefix unit, then without.
  const bool prefix = IsKimiPrefix(c) && pos + 1 < end;
  size_t e = prefix ? MatchKimiLowerTail(u, pos + 1, end) : kNoMatch;
  if (e == kNoMatch) e = MatchKimiLowerTail(u, pos, end);
  if (e == kNoMatch && prefix) e = MatchKimiUpperRun(u, pos + 1, end);
  if (e == kNoMatch) e = MatchKimiUpperRun(u, pos, end);
  if (e != kNoMatch) return e - pos;
  // \p{N}{1,3}
  if (c.cls == CharClass::kNumber) return MatchDigits3(u, pos, end);
  //  ?[^\s\p{L}\p{N}]+[\r\n]*
  const size_t start = (c.cp == ' ' && pos + 1 < end && IsKimiOther(u[pos + 1])) ? pos + 1 : pos;
  if (IsKimiOther(u[start])) {
    size_t i = start + RunLength(u, start, end, IsKimiOther);
    i += RunLength(u, i, end, IsCrLf);
    return i - pos;
  }
  // \s*[\r\n]+|\s+(?!\S)|\s+
  if (c.cls == CharClass::kSpace) return MatchWhitespace(u, pos, end, /*with_newline_rule=*/true);
  return 0;
}

size_t MatchRule(SplitRule rule, const std::vector<Unit>& u, size_t pos, size_t end) {
  switch (rule) {
    case SplitRule::kDigits3:
      return MatchDigits3(u, pos, end);
    case SplitRule::kCjkKana:
      return MatchCjkKana(u, pos, end);
    case SplitRule::kDeepSeekV3:
      return MatchDeepSeekV3(u, pos, end);
    case SplitRule::kGpt2:
      return MatchGpt2(u, pos, end);
    case SplitRule::kKimi:
      return MatchKimi(u, pos, end);
  }
  return 0;
}

}  // namespace

TokenizerWork& ThreadTokenizerWork() {
  thread_local TokenizerWork work;
  return work;
}

uint32_t ByteToCodePoint(uint8_t b) { return GetByteMap().byte_to_cp[b]; }

int CodePointToByte(uint32_t cp) {
  const ByteMap& m = GetByteMap();
  return cp < m.cp_to_byte.size() ? m.cp_to_byte[cp] : -1;
}

void AppendUtf8(uint32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

std::string BytesToByteLevel(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size() * 2);
  for (char c : bytes) AppendUtf8(ByteToCodePoint(static_cast<uint8_t>(c)), &out);
  return out;
}

bool ByteLevelToBytes(std::string_view text, std::string* bytes) {
  bytes->clear();
  size_t pos = 0;
  while (pos < text.size()) {
    uint32_t cp = 0;
    size_t prefix = 0;
    bool truncated = false;
    const size_t n = Utf8SequenceLength(text.substr(pos), &cp, &prefix, &truncated);
    if (n == 0) return false;
    const int b = CodePointToByte(cp);
    if (b < 0) return false;
    bytes->push_back(static_cast<char>(b));
    pos += n;
  }
  return true;
}

std::string_view SplitRuleRegex(SplitRule rule) {
  switch (rule) {
    case SplitRule::kDigits3:
      return "\\p{N}{1,3}";
    case SplitRule::kCjkKana:
      return "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+";
    case SplitRule::kDeepSeekV3:
      return "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|"
             "[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|"
             "\\s+(?!\\S)|\\s+";
    case SplitRule::kGpt2:
      return "";
    case SplitRule::kKimi:
      return KimiPattern();
  }
  return "";
}

std::string_view KimiPattern() {
  return "[\\p{Han}]+|"
         "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}&&[^\\p{Han}]]*"
         "[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}&&[^\\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
         "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}&&[^\\p{Han}]]+"
         "[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}&&[^\\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
         "\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
}

const std::vector<SplitRule>& KimiRules() {
  static const std::vector<SplitRule> rules = {SplitRule::kKimi};
  return rules;
}

const std::vector<SplitRule>& DeepSeekV3Rules() {
  static const std::vector<SplitRule> rules = {SplitRule::kDigits3, SplitRule::kCjkKana,
                                               SplitRule::kDeepSeekV3};
  return rules;
}

std::vector<std::string_view> PreTokenize(std::string_view text,
                                          const std::vector<SplitRule>& rules) {
  std::vector<std::string_view> result;
  if (text.empty()) return result;
  const std::vector<Unit> units = DecodeUnits(text);
  // Pieces as unit ranges [begin, end).
  std::vector<std::pair<size_t, size_t>> pieces = {{0, units.size()}};
  std::vector<std::pair<size_t, size_t>> next;
  for (SplitRule rule : rules) {
    next.clear();
    for (const auto& [begin, end] : pieces) {
      size_t gap = begin;
      size_t pos = begin;
      while (pos < end) {
        const size_t n = MatchRule(rule, units, pos, end);
        if (n == 0) {
          ++pos;
          continue;
        }
        if (gap < pos) next.emplace_back(gap, pos);
        next.emplace_back(pos, pos + n);
        pos += n;
        gap = pos;
      }
      if (gap < end) next.emplace_back(gap, end);
    }
    pieces.swap(next);
  }
  result.reserve(pieces.size());
  for (const auto& [begin, end] : pieces) {
    const size_t b = units[begin].offset;
    const size_t e = end < units.size() ? units[end].offset : text.size();
    result.push_back(text.substr(b, e - b));
  }
  return result;
}

size_t AppendRepairedUtf8(std::string_view bytes, bool hold_incomplete_tail, std::string* out) {
  size_t pos = 0;
  while (pos < bytes.size()) {
    uint32_t cp = 0;
    size_t prefix = 0;
    bool truncated = false;
    const std::string_view rest = bytes.substr(pos);
    const size_t n = Utf8SequenceLength(rest, &cp, &prefix, &truncated);
    if (n > 0) {
      out->append(rest.data(), n);
      pos += n;
      continue;
    }
    if (truncated && hold_incomplete_tail) return rest.size();
    out->append("\xEF\xBF\xBD");  // U+FFFD
    pos += prefix;
  }
  return 0;
}

}  // namespace internal

// ------------------------------------------------------------------------------------ loading

namespace {

// Debian's abseil: absl::string_view is not std::string_view.
absl::string_view Av(std::string_view s) { return absl::string_view(s.data(), s.size()); }

absl::Status Invalid(std::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("tokenizer.json: ", Av(what)));
}

bool GetBool(const json::Value& obj, std::string_view key, bool fallback) {
  const json::Value* v = obj.Find(key);
  return v != nullptr && v->is_bool() ? v->as_bool() : fallback;
}

// A special token field of tokenizer_config.json: a string, an AddedToken object with
// "content", or null/absent (returns "").
absl::StatusOr<std::string> TokenField(const json::Value& config, std::string_view key) {
  const json::Value* v = config.Find(key);
  if (v == nullptr || v->is_null()) return std::string();
  if (v->is_string()) return v->as_string();
  if (v->is_object()) {
    const json::Value* content = v->Find("content");
    if (content != nullptr && content->is_string()) return content->as_string();
  }
  return absl::InvalidArgumentError(absl::StrCat("tokenizer_config.json: field \"", Av(key),
                                                 "\": expected a string or {\"content\": ...}"));
}

// Decodes the character at `pos` (1 byte for ill-formed UTF-8, with cp = 0xFFFFFFFF).
size_t DecodeOne(std::string_view text, size_t pos, uint32_t* cp) {
  size_t prefix = 0;
  bool truncated = false;
  const size_t n = internal::Utf8SequenceLength(text.substr(pos), cp, &prefix, &truncated);
  if (n == 0) *cp = internal::kNoCodePoint;
  return n == 0 ? 1 : n;
}

bool IsWhiteSpace(uint32_t cp) {
  return cp != internal::kNoCodePoint &&
         internal::ClassifyCodePoint(cp) == internal::CharClass::kSpace;
}

constexpr int64_t kMaxTokenId = int64_t{1} << 24;

}  // namespace

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::Load(const std::string& model_dir) {
  absl::StatusOr<std::string> tokenizer_json = ReadFileToString(model_dir + "/tokenizer.json");
  std::string tiktoken_model;
  if (!tokenizer_json.ok()) {
    if (!absl::IsNotFound(tokenizer_json.status())) return tokenizer_json.status();
    // Kimi-K2's form: tiktoken.model beside tokenizer_config.json.
    absl::StatusOr<std::string> tiktoken = ReadFileToString(model_dir + "/tiktoken.model");
    if (!tiktoken.ok()) {
      if (!absl::IsNotFound(tiktoken.status())) return tiktoken.status();
      return absl::NotFoundError(
          absl::StrCat(model_dir, ": no tokenizer (neither tokenizer.json nor tiktoken.model)"));
    }
    tiktoken_model = *std::move(tiktoken);
  }
  std::string config_json;
  {
    absl::StatusOr<std::string> config = ReadFileToString(model_dir + "/tokenizer_config.json");
    if (config.ok()) {
      config_json = *std::move(config);
    } else if (!absl::IsNotFound(config.status())) {
      return config.status();
    }
  }
  absl::StatusOr<std::unique_ptr<Tokenizer>> tokenizer =
      tokenizer_json.ok() ? FromJson(*tokenizer_json, config_json)
                          : FromTiktoken(tiktoken_model, config_json);
  if (!tokenizer.ok()) return Annotate(tokenizer.status(), model_dir);
  return tokenizer;
}

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromJson(
    std::string_view tokenizer_json, std::string_view tokenizer_config_json) {
  std::unique_ptr<Tokenizer> t(new Tokenizer());
  HMOE_RETURN_IF_ERROR(t->ParseTokenizerJson(tokenizer_json));
  if (!tokenizer_config_json.empty())
    HMOE_RETURN_IF_ERROR(t->ParseConfigJson(tokenizer_config_json));
  return t;
}

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromTiktoken(
    std::string_view tiktoken_model, std::string_view tokenizer_config_json) {
  std::unique_ptr<Tokenizer> t(new Tokenizer());
  HMOE_RETURN_IF_ERROR(t->ParseTiktoken(tiktoken_model, tokenizer_config_json));
  if (!tokenizer_config_json.empty())
    HMOE_RETURN_IF_ERROR(t->ParseConfigJson(tokenizer_config_json));
  return t;
}

namespace {

// tokenization_kimi.py's num_reserved_special_tokens: the special ids that follow the ranks.
constexpr int64_t kTiktokenReservedSpecials = 256;
// How far past the reserved ids a special token named by added_tokens_decoder may lie. The id
// tables are dense, so an id is memory: without a bound a 60-byte tokenizer_config.json could make
// the tokenizer allocate 2^24 entries (the fuzzer found the same through sparse ranks).
constexpr int64_t kTiktokenMaxExtraSpecials = 65536;

absl::Status InvalidTiktoken(size_t line, std::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("tiktoken.model line ", line, ": ", Av(what)));
}

}  // namespace

absl::Status Tokenizer::ParseTiktoken(std::string_view model, std::string_view config_text) {
  tiktoken_ = true;
  ignore_merges_ = true;  // tiktoken: a piece that is a token is that token
  rules_ = internal::KimiRules();
  const auto grow = [this](size_t size) {
    if (size > id_to_token_.size()) {
      id_to_token_.resize(size);
      id_to_bytes_.resize(size);
      is_special_.resize(size, 0);
    }
  };
  // Lines "<base64 bytes> <rank>"; empty lines are skipped (as tiktoken's load_tiktoken_bpe).
  std::vector<uint8_t> ranked;  // ranked[id]: a rank of tiktoken.model uses the id
  // Ranks are the ids 0 .. N-1 of the N tokens: Kimi's tokenizer numbers its special tokens from
  // N (len(mergeable_ranks)), so a gap would give a special token a rank's id. Counting the lines
  // first lets a rank past them be refused before anything is allocated for it.
  int64_t num_lines = 0;
  for (size_t pos = 0; pos < model.size();) {
    size_t eol = model.find('\n', pos);
    if (eol == std::string_view::npos) eol = model.size();
    std::string_view line = model.substr(pos, eol - pos);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    num_lines += line.empty() ? 0 : 1;
    pos = eol + 1;
  }
  size_t line_no = 0;
  std::string bytes;
  for (size_t pos = 0; pos < model.size();) {
    size_t eol = model.find('\n', pos);
    if (eol == std::string_view::npos) eol = model.size();
    std::string_view line = model.substr(pos, eol - pos);
    pos = eol + 1;
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty()) continue;
    const size_t space = line.find(' ');
    if (space == std::string_view::npos || line.find(' ', space + 1) != std::string_view::npos) {
      return InvalidTiktoken(line_no, "expected \"<base64 token> <rank>\"");
    }
    const std::string_view b64 = line.substr(0, space), rank_text = line.substr(space + 1);
    int64_t rank = 0;
    if (rank_text.empty() || rank_text.size() > 9 ||
        rank_text.find_first_not_of("0123456789") != std::string_view::npos) {
      return InvalidTiktoken(line_no, absl::StrCat("rank \"", Av(rank_text),
                                                   "\" is not a non-negative integer below 2^24"));
    }
    for (char c : rank_text) rank = rank * 10 + (c - '0');
    if (rank >= kMaxTokenId) {
      return InvalidTiktoken(line_no, absl::StrCat("rank ", rank, " is not below 2^24"));
    }
    if (rank >= num_lines) {
      return InvalidTiktoken(
          line_no, absl::StrCat("rank ", rank, " is not below the number of tokens (", num_lines,
                                "): the ranks must be 0 .. ", num_lines - 1));
    }
    if (b64.find_first_not_of(
            "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/=") !=
            std::string_view::npos ||
        !absl::Base64Unescape(Av(b64), &bytes) || bytes.empty()) {
      return InvalidTiktoken(line_no,
                             absl::StrCat("token \"", Av(b64), "\" is not non-empty base64"));
    }
    const size_t id = static_cast<size_t>(rank);
    grow(id + 1);
    if (id >= ranked.size()) ranked.resize(id + 1, 0);
    if (ranked[id]) return InvalidTiktoken(line_no, absl::StrCat("rank ", rank, " appears twice"));
    ranked[id] = 1;
    if (!piece_to_id_.emplace(bytes, static_cast<int32_t>(id)).second) {
      return InvalidTiktoken(line_no, absl::StrCat("token \"", Av(b64), "\" appears twice"));
    }
    id_to_bytes_[id] = bytes;
    id_to_token_[id] = internal::BytesToByteLevel(bytes);
    token_to_id_.emplace(id_to_token_[id], static_cast<int32_t>(id));
  }
  if (piece_to_id_.empty()) return absl::InvalidArgumentError("tiktoken.model: no tokens");

  for (int b = 0; b < 256; ++b) {
    const auto it = piece_to_id_.find(std::string_view(reinterpret_cast<const char*>(&b), 1));
    byte_ids_[b] = it == piece_to_id_.end() ? -1 : it->second;
  }
  // tiktoken merges the adjacent pair whose concatenation has the lowest rank: every split of a
  // token into two tokens is a merge of that token's rank.
  merges_.reserve(piece_to_id_.size() * 2);
  for (const auto& [token, id] : piece_to_id_) {
    const std::string_view whole = token;
    for (size_t split = 1; split < whole.size(); ++split) {
      const auto l = piece_to_id_.find(whole.substr(0, split));
      if (l == piece_to_id_.end()) continue;
      const auto r = piece_to_id_.find(whole.substr(split));
      if (r == piece_to_id_.end()) continue;
      const uint64_t key = (static_cast<uint64_t>(static_cast<uint32_t>(l->second)) << 32) |
                           static_cast<uint32_t>(r->second);
      merges_.emplace(key, Merge{id, id});
    }
  }

  // Special tokens: tokenizer_config.json's added_tokens_decoder ({"<id>": {"content": ...}}),
  // and "<|reserved_token_<id>|>" for the reserved ids after the ranks that it does not name.
  std::unordered_map<int64_t, std::string> named;
  if (!config_text.empty()) {
    absl::StatusOr<json::Value> parsed = json::Parse(config_text);
    if (!parsed.ok()) return Annotate(parsed.status(), "tokenizer_config.json");
    const json::Value* decoder =
        parsed->is_object() ? parsed->Find("added_tokens_decoder") : nullptr;
    if (decoder != nullptr && !decoder->is_null()) {
      if (!decoder->is_object()) {
        return absl::InvalidArgumentError(
            "tokenizer_config.json: added_tokens_decoder is not an object");
      }
      for (const auto& [key, entry] : decoder->members()) {
        int64_t id = -1;
        const json::Value* content = entry.is_object() ? entry.Find("content") : nullptr;
        if (!absl::SimpleAtoi(Av(key), &id) || id < 0 || id >= kMaxTokenId || content == nullptr ||
            !content->is_string() || content->as_string().empty()) {
          return absl::InvalidArgumentError(
              absl::StrCat("tokenizer_config.json: added_tokens_decoder entry \"", key,
                           "\" needs an id below 2^24 as its key and a non-empty \"content\""));
        }
        named[id] = content->as_string();
      }
    }
  }
  const int64_t num_base = static_cast<int64_t>(piece_to_id_.size());
  std::vector<std::pair<int64_t, std::string>> specials;
  for (int64_t id = num_base; id < num_base + kTiktokenReservedSpecials; ++id) {
    const auto it = named.find(id);
    specials.emplace_back(
        id, it != named.end() ? it->second : absl::StrCat("<|reserved_token_", id, "|>"));
  }
  for (const auto& [id, content] : named) {
    if (id >= num_base + kTiktokenReservedSpecials + kTiktokenMaxExtraSpecials) {
      return absl::InvalidArgumentError(
          absl::StrCat("tokenizer_config.json: special token \"", content, "\" has id ", id,
                       ", more than ", kTiktokenMaxExtraSpecials, " past the reserved ids (",
                       num_base, " .. ", num_base + kTiktokenReservedSpecials - 1, ")"));
    }
    if (id < num_base || id >= num_base + kTiktokenReservedSpecials)
      specials.emplace_back(id, content);
  }
  std::sort(specials.begin(), specials.end());
  std::unordered_map<std::string, int32_t> special_ids;
  for (auto& [id, content] : specials) {
    const size_t index = static_cast<size_t>(id);
    if (index < ranked.size() && ranked[index]) {
      return absl::InvalidArgumentError(absl::StrCat("tokenizer_config.json: special token \"",
                                                     content, "\" has id ", id,
                                                     ", a rank of tiktoken.model"));
    }
    if (!special_ids.emplace(content, static_cast<int32_t>(id)).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("tokenizer_config.json: special token \"", content, "\" appears twice"));
    }
    grow(index + 1);
    id_to_token_[index] = content;
    id_to_bytes_[index] = content;
    is_special_[index] = 1;
    token_to_id_[content] = static_cast<int32_t>(id);  // over a ranked token of the same text
    AddedToken token;
    token.content = content;
    token.id = static_cast<int32_t>(id);
    token.special = true;
    added_.push_back(std::move(token));
  }
  BuildAddedTrie();

  all_bytes_have_tokens_ = true;
  for (int b = 0; b < 256; ++b)
    all_bytes_have_tokens_ = all_bytes_have_tokens_ && byte_ids_[b] >= 0;
  for (const std::string& token : id_to_bytes_)
    max_token_bytes_ = std::max(max_token_bytes_, token.size());
  return absl::OkStatus();
}

void Tokenizer::BuildAddedTrie() {
  added_trie_next_.clear();
  added_trie_token_.assign(1, -1);
  for (size_t i = 0; i < added_.size(); ++i) {
    int32_t node = 0;
    for (char c : added_[i].content) {
      const uint64_t key = (static_cast<uint64_t>(node) << 8) | static_cast<uint8_t>(c);
      const auto [it, inserted] =
          added_trie_next_.emplace(key, static_cast<int32_t>(added_trie_token_.size()));
      if (inserted) added_trie_token_.push_back(-1);
      node = it->second;
    }
    // The same content twice (same id: checked when loading): the first entry wins.
    if (added_trie_token_[node] < 0) added_trie_token_[node] = static_cast<int32_t>(i);
  }
}

absl::Status Tokenizer::ParseTokenizerJson(std::string_view text) {
  absl::StatusOr<json::Value> parsed = json::Parse(text);
  if (!parsed.ok()) return Annotate(parsed.status(), "tokenizer.json");
  const json::Value& root = *parsed;
  if (!root.is_object()) return Invalid("top level is not an object");

  // normalizer
  if (const json::Value* norm = root.Find("normalizer"); norm != nullptr && !norm->is_null()) {
    const json::Value* type = norm->Find("type");
    const json::Value* list = norm->Find("normalizers");
    const bool empty_sequence = type != nullptr && type->is_string() &&
                                type->as_string() == "Sequence" && list != nullptr &&
                                list->is_array() && list->items().empty();
    if (!empty_sequence) return Invalid("unsupported normalizer (only null or an empty Sequence)");
  }

  // pre_tokenizer
  bool byte_level = false;
  if (const json::Value* pre = root.Find("pre_tokenizer"); pre != nullptr && !pre->is_null()) {
    std::vector<const json::Value*> steps;
    const json::Value* type = pre->Find("type");
    if (type == nullptr || !type->is_string()) return Invalid("pre_tokenizer without a type");
    if (type->as_string() == "Sequence") {
      const json::Value* list = pre->Find("pretokenizers");
      if (list == nullptr || !list->is_array())
        return Invalid("pre_tokenizer Sequence without list");
      for (const json::Value& step : list->items()) steps.push_back(&step);
    } else {
      steps.push_back(pre);
    }
    for (const json::Value* step : steps) {
      const json::Value* step_type = step->Find("type");
      if (step_type == nullptr || !step_type->is_string()) {
        return Invalid("pre_tokenizer step without a type");
      }
      const std::string& name = step_type->as_string();
      if (name == "ByteLevel") {
        if (GetBool(*step, "add_prefix_space", false)) {
          return Invalid("unsupported pre_tokenizer ByteLevel with add_prefix_space true");
        }
        if (GetBool(*step, "use_regex", true)) rules_.push_back(internal::SplitRule::kGpt2);
        byte_level = true;
      } else if (name == "Split") {
        const json::Value* pattern = step->Find("pattern");
        const json::Value* regex = pattern != nullptr ? pattern->Find("Regex") : nullptr;
        if (regex == nullptr || !regex->is_string()) {
          return Invalid("unsupported Split pre_tokenizer (pattern must be {\"Regex\": ...})");
        }
        const json::Value* behavior = step->Find("behavior");
        if (behavior == nullptr || !behavior->is_string() || behavior->as_string() != "Isolated" ||
            GetBool(*step, "invert", false)) {
          return Invalid("unsupported Split pre_tokenizer (behavior must be Isolated, no invert)");
        }
        bool known = false;
        for (internal::SplitRule rule :
             {internal::SplitRule::kDigits3, internal::SplitRule::kCjkKana,
              internal::SplitRule::kDeepSeekV3}) {
          if (regex->as_string() == internal::SplitRuleRegex(rule)) {
            rules_.push_back(rule);
            known = true;
          }
        }
        if (!known) {
          return Invalid(
              absl::StrCat("unsupported Split pre_tokenizer regex \"", regex->as_string(), "\""));
        }
      } else {
        return Invalid(absl::StrCat("unsupported pre_tokenizer \"", name, "\""));
      }
    }
  }
  if (const json::Value* dec = root.Find("decoder"); dec != nullptr && !dec->is_null()) {
    const json::Value* type = dec->Find("type");
    if (type == nullptr || !type->is_string() || type->as_string() != "ByteLevel") {
      return Invalid("unsupported decoder (only ByteLevel)");
    }
    byte_level = true;
  }
  if (!byte_level)
    return Invalid("not a byte-level tokenizer (no ByteLevel pre_tokenizer/decoder)");

  // model
  const json::Value* model = root.Find("model");
  if (model == nullptr || !model->is_object()) return Invalid("missing \"model\" object");
  const json::Value* model_type = model->Find("type");
  if (model_type != nullptr && (!model_type->is_string() || model_type->as_string() != "BPE")) {
    return Invalid(absl::StrCat(
        "unsupported model type ",
        model_type->is_string() ? "\"" + model_type->as_string() + "\"" : "(not a string)",
        " (only \"BPE\")"));
  }
  if (const json::Value* dropout = model->Find("dropout");
      dropout != nullptr && !dropout->is_null() &&
      !(dropout->is_number() && dropout->as_double() == 0.0)) {
    return Invalid("BPE dropout is not supported");
  }
  ignore_merges_ = GetBool(*model, "ignore_merges", false);
  const json::Value* vocab = model->Find("vocab");
  if (vocab == nullptr || !vocab->is_object()) return Invalid("model.vocab is not an object");

  const auto set_token = [this](const std::string& token, int64_t id) -> absl::Status {
    if (id < 0 || id >= kMaxTokenId) {
      return Invalid(absl::StrCat("token \"", token, "\" has id ", id, " out of range"));
    }
    const size_t index = static_cast<size_t>(id);
    if (index >= id_to_token_.size()) {
      id_to_token_.resize(index + 1);
      id_to_bytes_.resize(index + 1);
      is_special_.resize(index + 1, 0);
    }
    if (!id_to_token_[index].empty() && id_to_token_[index] != token) {
      return Invalid(absl::StrCat("id ", id, " is used by both \"", id_to_token_[index],
                                  "\" and \"", token, "\""));
    }
    id_to_token_[index] = token;
    return absl::OkStatus();
  };

  token_to_id_.reserve(vocab->members().size() * 2);
  for (const auto& [token, id] : vocab->members()) {
    if (!id.is_integer()) return Invalid(absl::StrCat("vocab entry \"", token, "\" is not an int"));
    if (token.empty()) return Invalid("empty token in vocab");
    HMOE_RETURN_IF_ERROR(set_token(token, id.as_int()));
    if (!token_to_id_.emplace(token, static_cast<int32_t>(id.as_int())).second) {
      return Invalid(absl::StrCat("duplicate vocab token \"", token, "\""));
    }
  }

  // added_tokens
  if (const json::Value* added = root.Find("added_tokens"); added != nullptr && !added->is_null()) {
    if (!added->is_array()) return Invalid("added_tokens is not an array");
    for (const json::Value& entry : added->items()) {
      const json::Value* id = entry.Find("id");
      const json::Value* content = entry.Find("content");
      if (id == nullptr || !id->is_integer() || content == nullptr || !content->is_string() ||
          content->as_string().empty()) {
        return Invalid("added_tokens entry needs an integer \"id\" and a non-empty \"content\"");
      }
      AddedToken token;
      token.content = content->as_string();
      token.special = GetBool(entry, "special", false);
      token.lstrip = GetBool(entry, "lstrip", false);
      token.rstrip = GetBool(entry, "rstrip", false);
      HMOE_RETURN_IF_ERROR(set_token(token.content, id->as_int()));
      token.id = static_cast<int32_t>(id->as_int());
      const auto [it, inserted] = token_to_id_.emplace(token.content, token.id);
      if (!inserted && it->second != token.id) {
        return Invalid(absl::StrCat("added token \"", token.content, "\" has id ", token.id,
                                    " but the vocab says ", it->second));
      }
      is_special_[token.id] = token.special ? 1 : 0;
      added_.push_back(std::move(token));
    }
  }
  BuildAddedTrie();

  // Bytes of every token, as Hugging Face's ByteLevel decoder computes them: through the byte map
  // when every character is in it, else the token's own text (e.g. "<｜begin▁of▁sentence｜>").
  for (size_t id = 0; id < id_to_token_.size(); ++id) {
    if (id_to_token_[id].empty()) continue;
    if (!internal::ByteLevelToBytes(id_to_token_[id], &id_to_bytes_[id])) {
      id_to_bytes_[id] = id_to_token_[id];
    }
  }

  for (const std::string& bytes : id_to_bytes_)
    max_token_bytes_ = std::max(max_token_bytes_, bytes.size());

  all_bytes_have_tokens_ = true;
  for (int b = 0; b < 256; ++b) {
    std::string ch;
    internal::AppendUtf8(internal::ByteToCodePoint(static_cast<uint8_t>(b)), &ch);
    const auto it = token_to_id_.find(ch);
    byte_ids_[b] = it == token_to_id_.end() ? -1 : it->second;
    if (byte_ids_[b] < 0) all_bytes_have_tokens_ = false;
  }

  // merges
  const json::Value* merges = model->Find("merges");
  if (merges != nullptr && !merges->is_null()) {
    if (!merges->is_array()) return Invalid("model.merges is not an array");
    merges_.reserve(merges->items().size() * 2);
    std::string joined;
    int32_t rank = 0;
    for (const json::Value& m : merges->items()) {
      std::string_view left, right;
      if (m.is_string()) {
        const std::string& s = m.as_string();
        const size_t space = s.find(' ');
        if (space == std::string::npos || space == 0 || space + 1 >= s.size() ||
            s.find(' ', space + 1) != std::string::npos) {
          return Invalid(absl::StrCat("merge ", rank, " \"", s, "\" is not \"a b\""));
        }
        left = std::string_view(s).substr(0, space);
        right = std::string_view(s).substr(space + 1);
      } else if (m.is_array() && m.items().size() == 2 && m.items()[0].is_string() &&
                 m.items()[1].is_string()) {
        left = m.items()[0].as_string();
        right = m.items()[1].as_string();
      } else {
        return Invalid(absl::StrCat("merge ", rank, " is neither \"a b\" nor [\"a\", \"b\"]"));
      }
      joined.assign(left);
      joined.append(right);
      const auto l = token_to_id_.find(left);
      const auto r = token_to_id_.find(right);
      const auto j = token_to_id_.find(joined);
      if (l == token_to_id_.end() || r == token_to_id_.end() || j == token_to_id_.end()) {
        const std::string_view missing = l == token_to_id_.end()   ? left
                                         : r == token_to_id_.end() ? right
                                                                   : std::string_view(joined);
        return Invalid(absl::StrCat("merge ", rank, " (\"", Av(left), "\" \"", Av(right),
                                    "\") references unknown token \"", Av(missing), "\""));
      }
      const uint64_t key = (static_cast<uint64_t>(static_cast<uint32_t>(l->second)) << 32) |
                           static_cast<uint32_t>(r->second);
      merges_.emplace(key, Merge{rank, j->second});  // the first (lowest-rank) duplicate wins
      ++rank;
    }
  }
  return absl::OkStatus();
}

absl::Status Tokenizer::ParseConfigJson(std::string_view text) {
  absl::StatusOr<json::Value> parsed = json::Parse(text);
  if (!parsed.ok()) return Annotate(parsed.status(), "tokenizer_config.json");
  const json::Value& config = *parsed;
  if (!config.is_object()) {
    return absl::InvalidArgumentError("tokenizer_config.json: top level is not an object");
  }
  const auto resolve = [&](std::string_view key, int32_t* id) -> absl::Status {
    HMOE_ASSIGN_OR_RETURN(std::string token, TokenField(config, key));
    if (token.empty()) return absl::OkStatus();
    const std::optional<int32_t> found = TokenToId(token);
    if (!found.has_value()) {
      return absl::InvalidArgumentError(absl::StrCat("tokenizer_config.json: ", Av(key), " \"",
                                                     token, "\" is not in the vocabulary"));
    }
    *id = *found;
    return absl::OkStatus();
  };
  HMOE_RETURN_IF_ERROR(resolve("bos_token", &bos_id_));
  HMOE_RETURN_IF_ERROR(resolve("eos_token", &eos_id_));
  HMOE_RETURN_IF_ERROR(resolve("pad_token", &pad_id_));
  add_bos_token_ = GetBool(config, "add_bos_token", false);
  if (const json::Value* tmpl = config.Find("chat_template"); tmpl != nullptr) {
    if (tmpl->is_string()) {
      chat_template_ = tmpl->as_string();
    } else if (tmpl->is_array()) {  // [{"name": ..., "template": ...}]: take "default"
      for (const json::Value& entry : tmpl->items()) {
        const json::Value* name = entry.Find("name");
        const json::Value* body = entry.Find("template");
        if (name != nullptr && name->is_string() && name->as_string() == "default" &&
            body != nullptr && body->is_string()) {
          chat_template_ = body->as_string();
        }
      }
    }
  }
  if (const json::Value* max_len = config.Find("model_max_length");
      max_len != nullptr && max_len->is_number()) {
    const double d = max_len->as_double();
    model_max_length_ = max_len->is_integer() ? max_len->as_int()
                        : d >= 9.0e18         ? INT64_MAX
                                              : static_cast<int64_t>(d);
  }
  return absl::OkStatus();
}

// ------------------------------------------------------------------------------------ encoding

const Tokenizer::AddedToken* Tokenizer::MatchAddedAt(std::string_view text, size_t pos) const {
  const AddedToken* longest = nullptr;
  int32_t node = 0;
  size_t i = pos;
  for (; i < text.size(); ++i) {
    const auto it =
        added_trie_next_.find((static_cast<uint64_t>(node) << 8) | static_cast<uint8_t>(text[i]));
    if (it == added_trie_next_.end()) break;
    node = it->second;
    if (added_trie_token_[node] >= 0) longest = &added_[added_trie_token_[node]];
  }
  internal::ThreadTokenizerWork().added_steps += i - pos + 1;
  return longest;
}

std::vector<Tokenizer::AddedMatch> Tokenizer::FindAddedTokens(std::string_view text) const {
  std::vector<AddedMatch> matches;
  size_t last_end = 0;
  for (size_t pos = 0; pos < text.size(); ++pos) {
    const AddedToken* token = MatchAddedAt(text, pos);
    if (token == nullptr) continue;
    AddedMatch m{pos, pos + token->content.size(), token->id};
    if (token->lstrip) {
      // Absorb the whitespace run that ends at the token (not past the previous match).
      size_t p = last_end, run_start = pos;
      bool in_run = false;
      while (p < pos) {
        uint32_t cp = 0;
        const size_t n = DecodeOne(text, p, &cp);
        const bool space = IsWhiteSpace(cp);
        if (space && !in_run) run_start = p;
        in_run = space;
        p += n;
      }
      if (in_run) m.begin = run_start;
    }
    if (token->rstrip) {
      uint32_t cp = 0;
      size_t n = 0;
      while (m.end < text.size() && (n = DecodeOne(text, m.end, &cp), IsWhiteSpace(cp))) m.end += n;
    }
    matches.push_back(m);
    last_end = m.end;
    pos = m.end - 1;
  }
  return matches;
}

void Tokenizer::EncodePiece(std::string_view piece, std::vector<int32_t>* ids) const {
  if (ignore_merges_ && tiktoken_) {
    const auto it = piece_to_id_.find(piece);
    if (it != piece_to_id_.end()) {
      ids->push_back(it->second);
      return;
    }
  } else if (ignore_merges_) {
    const auto it = token_to_id_.find(internal::BytesToByteLevel(piece));
    if (it != token_to_id_.end()) {
      ids->push_back(it->second);
      return;
    }
  }
  struct Symbol {
    int32_t id;
    int32_t prev;
    int32_t next;
  };
  std::vector<Symbol> symbols;
  symbols.reserve(piece.size());
  for (char c : piece) {
    const int32_t id = byte_ids_[static_cast<uint8_t>(c)];
    if (id < 0) continue;  // no token for this byte and no unk_token: dropped, like HF
    const int32_t index = static_cast<int32_t>(symbols.size());
    symbols.push_back({id, index - 1, index + 1});
  }
  if (symbols.empty()) return;
  symbols.back().next = -1;

  // Candidate merges ordered by (rank, position of the left symbol): lowest first.
  struct Candidate {
    int32_t rank;
    int32_t pos;
    int32_t left_id;
    int32_t right_id;
    int32_t new_id;
    bool operator>(const Candidate& o) const {
      return rank != o.rank ? rank > o.rank : pos > o.pos;
    }
  };
  // Each symbol is merged away at most once and each merge queues at most two candidates, so the
  // queue sees O(n) pushes and pops: O(n log n) for a piece of n bytes, however long.
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<>> queue;
  uint64_t heap_ops = 0;
  const auto consider = [&](int32_t left) {
    if (left < 0) return;
    const int32_t right = symbols[left].next;
    if (right < 0) return;
    const uint64_t key = (static_cast<uint64_t>(static_cast<uint32_t>(symbols[left].id)) << 32) |
                         static_cast<uint32_t>(symbols[right].id);
    const auto it = merges_.find(key);
    if (it == merges_.end()) return;
    queue.push({it->second.rank, left, symbols[left].id, symbols[right].id, it->second.new_id});
    ++heap_ops;
  };
  for (int32_t i = 0; i + 1 < static_cast<int32_t>(symbols.size()); ++i) consider(i);
  while (!queue.empty()) {
    const Candidate c = queue.top();
    queue.pop();
    ++heap_ops;
    Symbol& left = symbols[c.pos];
    // Stale entries: the left symbol was merged away or changed, or its neighbour changed.
    if (left.id != c.left_id || left.next < 0 || symbols[left.next].id != c.right_id) continue;
    const int32_t right_index = left.next;
    Symbol& right = symbols[right_index];
    left.id = c.new_id;
    left.next = right.next;
    if (right.next >= 0) symbols[right.next].prev = c.pos;
    right.id = -1;
    right.next = -1;
    consider(left.prev);
    consider(c.pos);
  }
  internal::ThreadTokenizerWork().bpe_heap_ops += heap_ops;
  for (int32_t i = 0; i >= 0; i = symbols[i].next) ids->push_back(symbols[i].id);
}

bool Tokenizer::EncodeText(std::string_view text, size_t max_tokens,
                           std::vector<int32_t>* ids) const {
  for (std::string_view piece : internal::PreTokenize(text, rules_)) {
    // A lower bound on the piece's tokens, before spending BPE on it.
    if (all_bytes_have_tokens_ &&
        ids->size() + (piece.size() + max_token_bytes_ - 1) / max_token_bytes_ > max_tokens) {
      return false;
    }
    EncodePiece(piece, ids);
    if (ids->size() > max_tokens) return false;
  }
  return true;
}

bool Tokenizer::EncodeLimited(std::string_view text, bool add_bos, bool parse_special,
                              size_t max_tokens, std::vector<int32_t>* ids) const {
  ids->reserve(std::min(text.size() / 3, max_tokens) + 2);
  if (add_bos && bos_id_ >= 0) ids->push_back(bos_id_);
  if (ids->size() > max_tokens) return false;
  if (!parse_special || added_.empty()) return EncodeText(text, max_tokens, ids);
  size_t pos = 0;
  for (const AddedMatch& m : FindAddedTokens(text)) {
    if (!EncodeText(text.substr(pos, m.begin - pos), max_tokens, ids)) return false;
    ids->push_back(m.id);
    if (ids->size() > max_tokens) return false;
    pos = m.end;
  }
  return EncodeText(text.substr(pos), max_tokens, ids);
}

std::vector<int32_t> Tokenizer::Encode(std::string_view text, bool add_bos,
                                       bool parse_special) const {
  std::vector<int32_t> ids;
  EncodeLimited(text, add_bos, parse_special, SIZE_MAX, &ids);
  return ids;
}

std::optional<std::vector<int32_t>> Tokenizer::EncodeWithin(std::string_view text, bool add_bos,
                                                            bool parse_special,
                                                            size_t max_tokens) const {
  std::vector<int32_t> ids;
  if (!EncodeLimited(text, add_bos, parse_special, max_tokens, &ids)) return std::nullopt;
  return ids;
}

// ------------------------------------------------------------------------------------ decoding

std::string_view Tokenizer::IdToToken(int32_t id) const {
  if (id < 0 || id >= vocab_size()) return {};
  return id_to_token_[id];
}

std::string_view Tokenizer::IdToBytes(int32_t id) const {
  if (id < 0 || id >= vocab_size()) return {};
  return id_to_bytes_[id];
}

std::optional<int32_t> Tokenizer::TokenToId(std::string_view token) const {
  const auto it = token_to_id_.find(token);
  if (it == token_to_id_.end()) return std::nullopt;
  return it->second;
}

bool Tokenizer::IsSpecial(int32_t id) const {
  return id >= 0 && id < vocab_size() && is_special_[id] != 0;
}

std::string Tokenizer::Decode(std::span<const int32_t> ids, bool skip_special_tokens) const {
  std::string bytes;
  for (int32_t id : ids) {
    if (skip_special_tokens && IsSpecial(id)) continue;
    bytes.append(IdToBytes(id));
  }
  std::string out;
  out.reserve(bytes.size());
  internal::AppendRepairedUtf8(bytes, /*hold_incomplete_tail=*/false, &out);
  return out;
}

std::string Tokenizer::StreamDecoder::Push(int32_t id) {
  if (skip_special_tokens_ && tokenizer_->IsSpecial(id)) return {};
  pending_.append(tokenizer_->IdToBytes(id));
  std::string out;
  const size_t held = internal::AppendRepairedUtf8(pending_, /*hold_incomplete_tail=*/true, &out);
  pending_.erase(0, pending_.size() - held);
  return out;
}

std::string Tokenizer::StreamDecoder::Flush() {
  std::string out;
  internal::AppendRepairedUtf8(pending_, /*hold_incomplete_tail=*/false, &out);
  pending_.clear();
  return out;
}

}  // namespace hmoe
