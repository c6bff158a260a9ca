#pragma once

// Internals of the byte-level BPE tokenizer, exposed for tests and for tokenizer_builder:
// code point classification, the GPT-2 byte <-> code point map, the hand-written pre-tokenizer
// scanners and a UTF-8 repairer. Not a stable API.

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace hmoe::internal {

// Unicode general category major class (L, M, N, P, S), White_Space (what \s matches; takes
// precedence over the category), or anything else (controls, format, unassigned, private use,
// surrogates). Exact for every code point of Unicode 14.0 (the table is generated from
// unicodedata by scripts/gen_unicode_classes.py); code points assigned after 14.0 are kOther.
enum class CharClass : uint8_t {
  kOther = 0,
  kLetter = 1,
  kMark = 2,
  kNumber = 3,
  kPunct = 4,
  kSymbol = 5,
  kSpace = 6,
};

CharClass ClassifyCodePoint(uint32_t cp);

// GPT-2's bytes_to_unicode: bytes 33..126, 161..172 and 174..255 map to themselves, the other 68
// bytes to U+0100, U+0101, ... in increasing byte order (space -> U+0120 'Ġ', '\n' -> U+010A).
uint32_t ByteToCodePoint(uint8_t b);
// Inverse of ByteToCodePoint; -1 for a code point that is not in the map.
int CodePointToByte(uint32_t cp);
// `bytes` with every byte replaced by the UTF-8 encoding of ByteToCodePoint(byte).
std::string BytesToByteLevel(std::string_view bytes);
// Inverse of BytesToByteLevel; false when `text` holds a character outside the map (or is not
// valid UTF-8).
bool ByteLevelToBytes(std::string_view text, std::string* bytes);

// Appends the UTF-8 encoding of `cp` (< 0x110000) to `out`.
void AppendUtf8(uint32_t cp, std::string* out);

// One step of a pre-tokenizer Sequence: a Split(behavior Isolated) whose regex we implement by
// hand. Each step splits every piece from the previous step independently, as Hugging Face
// tokenizers does: a match and each gap between matches become separate pieces.
enum class SplitRule : uint8_t {
  // \p{N}{1,3}
  kDigits3,
  // [一-龥぀-ゟ゠-ヿ]+  (U+4E00..U+9FA5, U+3040..U+309F, U+30A0..U+30FF)
  kCjkKana,
  // DeepSeek-V3's main rule:
  // [!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+|
  //  ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
  kDeepSeekV3,
  // GPT-2's ByteLevel(use_regex=true) rule:
  // 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
  kGpt2,
};

// The exact regex strings (as they appear, unescaped, in tokenizer.json) of the rules above that
// come from Split pre-tokenizers; kGpt2 comes from ByteLevel(use_regex=true) and has none.
std::string_view SplitRuleRegex(SplitRule rule);

// The DeepSeek-V3 pre-tokenizer: kDigits3, kCjkKana, kDeepSeekV3.
const std::vector<SplitRule>& DeepSeekV3Rules();

// Splits `text` (arbitrary bytes; invalid UTF-8 bytes are single "other" characters) by `rules`
// applied in sequence. The pieces are non-empty, in order, and concatenate to `text`.
std::vector<std::string_view> PreTokenize(std::string_view text,
                                          const std::vector<SplitRule>& rules);

// Work done by this thread's encodes since the last reset, in steps that each cost O(1) (the heap
// operations O(log n)): tests check that every part of Encode is linear in its input with these
// counts instead of with timings. Reset by assigning {}.
struct TokenizerWork {
  uint64_t scan_steps = 0;    // units looked at by the pre-tokenizer's scanners
  uint64_t bpe_heap_ops = 0;  // pushes and pops of BPE's merge queue
  uint64_t added_steps = 0;   // trie steps matching added tokens
};
TokenizerWork& ThreadTokenizerWork();

// Replaces ill-formed UTF-8 in `bytes` with U+FFFD, one per maximal ill-formed subpart (the
// Unicode/WHATWG practice, as Rust's from_utf8_lossy does), appending to `out`. With
// `hold_incomplete_tail`, a truncated but so-far valid sequence at the end is not converted:
// its length is returned so the caller can keep it for more bytes. Otherwise returns 0.
size_t AppendRepairedUtf8(std::string_view bytes, bool hold_incomplete_tail, std::string* out);

}  // namespace hmoe::internal
