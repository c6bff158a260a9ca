#include "common/model/tokenizer.h"

#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <iterator>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "common/base/json.h"
#include "common/base/mapped_file.h"
#include "common/model/tokenizer_internal.h"
#include "tools/tokenizer_builder.h"

namespace hmoe {
namespace {

using internal::CharClass;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

// Independent UTF-8 validity check (RFC 3629), not the code under test.
bool IsValidUtf8(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto b = static_cast<uint8_t>(s[i]);
    size_t n = 0;
    uint32_t cp = 0;
    if (b < 0x80) {
      n = 1;
      cp = b;
    } else if ((b & 0xE0) == 0xC0) {
      n = 2;
      cp = b & 0x1F;
    } else if ((b & 0xF0) == 0xE0) {
      n = 3;
      cp = b & 0x0F;
    } else if ((b & 0xF8) == 0xF0) {
      n = 4;
      cp = b & 0x07;
    } else {
      return false;
    }
    if (i + n > s.size()) return false;
    for (size_t k = 1; k < n; ++k) {
      const auto c = static_cast<uint8_t>(s[i + k]);
      if ((c & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (c & 0x3F);
    }
    const uint32_t min[] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < min[n] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
    i += n;
  }
  return true;
}

std::vector<std::string> Pieces(std::string_view text) {
  std::vector<std::string> out;
  for (std::string_view p : internal::PreTokenize(text, internal::DeepSeekV3Rules())) {
    out.emplace_back(p);
  }
  return out;
}

// A tokenizer built by tokenizer_builder (the same one hmoe-make-model writes), shared by tests.
const Tokenizer& BuiltTokenizer1024() {
  static const Tokenizer* const tokenizer = [] {
    absl::StatusOr<BuiltTokenizer> built = BuildTokenizer(1024, 4096);
    EXPECT_TRUE(built.ok()) << built.status();
    absl::StatusOr<std::unique_ptr<Tokenizer>> t =
        Tokenizer::FromJson(built->tokenizer_json, built->tokenizer_config_json);
    EXPECT_TRUE(t.ok()) << t.status();
    return t->release();
  }();
  return *tokenizer;
}

// A minimal byte-level BPE tokenizer.json: single-character tokens for `chars` (ASCII), the
// given extra tokens, merges in rank order, and optional added tokens.
std::string TinyTokenizerJson(std::string_view chars, const std::vector<std::string>& extra,
                              const std::vector<std::string>& merges,
                              const std::string& added_tokens = "[]",
                              const std::string& pre_tokenizer = "null") {
  std::string vocab;
  int id = 0;
  for (char c : chars) {
    vocab += (id > 0 ? "," : "") + std::string("\"") + c + "\":" + std::to_string(id);
    ++id;
  }
  for (const std::string& t : extra) vocab += ",\"" + t + "\":" + std::to_string(id++);
  std::string merges_json;
  for (size_t i = 0; i < merges.size(); ++i) {
    merges_json += (i > 0 ? "," : "") + std::string("\"") + merges[i] + "\"";
  }
  return R"({"version":"1.0","added_tokens":)" + added_tokens +
         R"(,"normalizer":null,"pre_tokenizer":)" + pre_tokenizer +
         R"(,"decoder":{"type":"ByteLevel"},"model":{"type":"BPE","vocab":{)" + vocab +
         R"(},"merges":[)" + merges_json + "]}}";
}

std::unique_ptr<Tokenizer> MustLoad(const std::string& tokenizer_json,
                                    const std::string& config_json = "") {
  absl::StatusOr<std::unique_ptr<Tokenizer>> t = Tokenizer::FromJson(tokenizer_json, config_json);
  EXPECT_TRUE(t.ok()) << t.status();
  return t.ok() ? *std::move(t) : nullptr;
}

// ---------------------------------------------------------------------------------- byte level

TEST(ByteLevelTest, AllBytesMapToDistinctCodePointsAndBack) {
  std::vector<bool> seen(512, false);
  for (int b = 0; b < 256; ++b) {
    const uint32_t cp = internal::ByteToCodePoint(static_cast<uint8_t>(b));
    ASSERT_LT(cp, 512u) << b;
    EXPECT_FALSE(seen[cp]) << "byte " << b << " collides";
    seen[cp] = true;
    EXPECT_EQ(internal::CodePointToByte(cp), b);
    const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || b >= 174;
    if (printable) {
      EXPECT_EQ(cp, static_cast<uint32_t>(b));
    } else {
      EXPECT_GE(cp, 256u);
    }
  }
  EXPECT_EQ(internal::ByteToCodePoint(' '), 0x120u);   // 'Ġ'
  EXPECT_EQ(internal::ByteToCodePoint('\n'), 0x10Au);  // 'Ċ'
  EXPECT_EQ(internal::ByteToCodePoint(0), 0x100u);
  EXPECT_EQ(internal::ByteToCodePoint(0xAD), 0x143u);  // the last of the 68 remapped bytes
  EXPECT_EQ(internal::CodePointToByte('a' + 0x1000), -1);
}

TEST(ByteLevelTest, StringRoundTripOfAllBytes) {
  std::string all;
  for (int b = 0; b < 256; ++b) all.push_back(static_cast<char>(b));
  const std::string mapped = internal::BytesToByteLevel(all);
  EXPECT_TRUE(IsValidUtf8(mapped));
  std::string back;
  ASSERT_TRUE(internal::ByteLevelToBytes(mapped, &back));
  EXPECT_EQ(back, all);
  EXPECT_EQ(internal::BytesToByteLevel(" the\n"), "\xC4\xA0the\xC4\x8A");  // "Ġthe" "Ċ"
  EXPECT_FALSE(internal::ByteLevelToBytes("\xE4\xB8\xAD", &back));  // '中' is not in the map
}

TEST(ByteLevelTest, EveryByteEncodesToItsByteToken) {
  const Tokenizer& t = BuiltTokenizer1024();
  for (int b = 0; b < 256; ++b) {
    const std::string text(1, static_cast<char>(b));
    std::vector<int32_t> ids = t.Encode(text, /*add_bos=*/false);
    ASSERT_EQ(ids.size(), 1u) << b;
    EXPECT_EQ(ids[0], kBuiltFirstByteId + b);
    EXPECT_EQ(t.IdToBytes(ids[0]), text);
  }
}

TEST(CharClassTest, ClassifiesAsciiExactlyAndCommonScripts) {
  for (uint32_t c = 'a'; c <= 'z'; ++c)
    EXPECT_EQ(internal::ClassifyCodePoint(c), CharClass::kLetter);
  for (uint32_t c = '0'; c <= '9'; ++c)
    EXPECT_EQ(internal::ClassifyCodePoint(c), CharClass::kNumber);
  for (char c : std::string_view("!\"#%&'()*,-./:;?@[\\]_{}")) {
    EXPECT_EQ(internal::ClassifyCodePoint(static_cast<uint8_t>(c)), CharClass::kPunct) << c;
  }
  for (char c : std::string_view("$+<=>^`|~")) {
    EXPECT_EQ(internal::ClassifyCodePoint(static_cast<uint8_t>(c)), CharClass::kSymbol) << c;
  }
  for (uint32_t c : {0x09u, 0x0Au, 0x0Bu, 0x0Cu, 0x0Du, 0x20u, 0x85u, 0xA0u, 0x2003u, 0x3000u}) {
    EXPECT_EQ(internal::ClassifyCodePoint(c), CharClass::kSpace) << c;
  }
  EXPECT_EQ(internal::ClassifyCodePoint(0x00), CharClass::kOther);
  EXPECT_EQ(internal::ClassifyCodePoint(0x7F), CharClass::kOther);
  EXPECT_EQ(internal::ClassifyCodePoint(0xE9), CharClass::kLetter);     // é
  EXPECT_EQ(internal::ClassifyCodePoint(0x301), CharClass::kMark);      // combining acute
  EXPECT_EQ(internal::ClassifyCodePoint(0x4E2D), CharClass::kLetter);   // 中
  EXPECT_EQ(internal::ClassifyCodePoint(0x3002), CharClass::kPunct);    // 。
  EXPECT_EQ(internal::ClassifyCodePoint(0xFF5C), CharClass::kSymbol);   // ｜ (fullwidth bar)
  EXPECT_EQ(internal::ClassifyCodePoint(0x2581), CharClass::kSymbol);   // ▁
  EXPECT_EQ(internal::ClassifyCodePoint(0x1F600), CharClass::kSymbol);  // 😀
  EXPECT_EQ(internal::ClassifyCodePoint(0x200D), CharClass::kOther);    // zero-width joiner
  EXPECT_EQ(internal::ClassifyCodePoint(0x661), CharClass::kNumber);    // Arabic-Indic one
  EXPECT_EQ(internal::ClassifyCodePoint(0xB2), CharClass::kNumber);     // ²
  EXPECT_EQ(internal::ClassifyCodePoint(0xD55C), CharClass::kLetter);   // 한
  EXPECT_EQ(internal::ClassifyCodePoint(0x110000), CharClass::kOther);
}

// ---------------------------------------------------------------------------------- pre-tokenizer

TEST(PreTokenizerTest, DigitsSplitInGroupsOfThree) {
  EXPECT_THAT(Pieces("1234567"), ElementsAre("123", "456", "7"));
  EXPECT_THAT(Pieces("12345"), ElementsAre("123", "45"));
  EXPECT_THAT(Pieces("abc 1234 def"), ElementsAre("abc", " ", "123", "4", " def"));
  EXPECT_THAT(Pieces("x٣٤٥٦"), ElementsAre("x", "٣٤٥", "٦"));  // \p{N} is not only ASCII
}

TEST(PreTokenizerTest, PunctuationAndApostrophes) {
  EXPECT_THAT(Pieces("Hello, world!"), ElementsAre("Hello", ",", " world", "!"));
  EXPECT_THAT(Pieces("don't"), ElementsAre("don", "'t"));
  EXPECT_THAT(Pieces("ab,cd"), ElementsAre("ab", ",cd"));  // ASCII punct + letters
  EXPECT_THAT(Pieces("a ... b"), ElementsAre("a", " ...", " b"));
  EXPECT_THAT(Pieces("end.\n"), ElementsAre("end", ".\n"));  // punctuation keeps its newlines
  EXPECT_THAT(Pieces("x=$y"), ElementsAre("x", "=$", "y"));
}

TEST(PreTokenizerTest, SpacesAndNewlines) {
  EXPECT_THAT(Pieces("a  b"), ElementsAre("a", " ", " b"));  // \s+(?!\S) leaves one space
  EXPECT_THAT(Pieces("hi   "), ElementsAre("hi", "   "));    // trailing run stays whole
  EXPECT_THAT(Pieces("x\n\ny"), ElementsAre("x", "\n\n", "y"));
  EXPECT_THAT(Pieces("  \n  x"), ElementsAre("  \n", " ", " x"));
  EXPECT_THAT(Pieces("\tfoo"), ElementsAre("\tfoo"));  // one non-newline space joins letters
  EXPECT_THAT(Pieces("\nfoo"), ElementsAre("\n", "foo"));
  EXPECT_THAT(Pieces("a\r\n"), ElementsAre("a", "\r\n"));
}

TEST(PreTokenizerTest, CjkKanaAndMarks) {
  EXPECT_THAT(Pieces("你好world"), ElementsAre("你好", "world"));
  EXPECT_THAT(Pieces("日本語とカナ"), ElementsAre("日本語とカナ"));
  EXPECT_THAT(Pieces("中文，标点"), ElementsAre("中文", "，", "标点"));
  EXPECT_THAT(Pieces("한국어 단어"), ElementsAre("한국어", " 단어"));    // Hangul: plain letters
  EXPECT_THAT(Pieces("e\u0301t\u00e9"), ElementsAre("e\u0301t\u00e9"));  // marks join letters
  EXPECT_THAT(Pieces("a 😀😀 b"), ElementsAre("a", " 😀😀", " b"));
}

// Characters of Unicode 15.0-16.0 (the tables were 14.0 before, where all of these were "other"):
// the expected splits are Hugging Face tokenizers 0.23.3's (pre_tokenize_str on the tokenizer
// hmoe-make-model writes, DeepSeek-V3's pre-tokenizer).
TEST(PreTokenizerTest, Unicode15And16Characters) {
  // U+1FAE8 shaking face (15.0, So).
  EXPECT_THAT(Pieces("a\U0001FAE8b"), ElementsAre("a", "\U0001FAE8", "b"));
  // Garay capital/small letters (16.0, Lu/Ll).
  EXPECT_THAT(Pieces(" \U00010D50\U00010D70 \U00010D50x"),
              ElementsAre(" \U00010D50\U00010D70", " \U00010D50x"));
  // CJK extension I (15.1) and H (15.0), Lo: letters, outside the CJK/kana rule's range.
  EXPECT_THAT(Pieces("x\U0002EBF0\U00031350y"), ElementsAre("x\U0002EBF0\U00031350y"));
  // Kirat Rai digits (16.0, Nd): groups of three.
  EXPECT_THAT(Pieces("1\U00016D70\U00016D71\U00016D72 2"),
              ElementsAre("1\U00016D70\U00016D71", "\U00016D72", " ", "2"));
  // Tulu-Tigalari letter + vowel sign (16.0, Lo + Mc).
  EXPECT_THAT(Pieces("\U00011380\U000113B8!"), ElementsAre("\U00011380\U000113B8", "!"));
  // U+1FA89 (16.0, So), U+1CC00 (16.0, So), Ol Onal U+1E5D0 (16.0, Lo).
  EXPECT_THAT(Pieces("\U0001FA89\U0001FA89 ok"), ElementsAre("\U0001FA89\U0001FA89", " ok"));
  EXPECT_THAT(Pieces("A\U0001CC00,\U0001E5D0"), ElementsAre("A", "\U0001CC00,", "\U0001E5D0"));
  EXPECT_EQ(internal::PropsLetterKind(internal::CodePointProps(0x10D50)),
            internal::LetterKind::kUpper);
  EXPECT_EQ(internal::PropsLetterKind(internal::CodePointProps(0x10D70)),
            internal::LetterKind::kLower);
  EXPECT_TRUE(internal::PropsHan(internal::CodePointProps(0x2EBF0)));
  EXPECT_TRUE(internal::PropsHan(internal::CodePointProps(0x3007)));    // 〇, Nl
  EXPECT_FALSE(internal::PropsHan(internal::CodePointProps(0x3001)));   // 、 Common
  EXPECT_FALSE(internal::PropsHan(internal::CodePointProps(0x323B0)));  // unassigned in 16.0
}

TEST(PreTokenizerTest, PiecesConcatenateToTheInput) {
  std::mt19937 rng(123);
  const std::vector<std::string> alphabet = {
      "a", "Z",      "7",  " ",  "  ", "\n",   "\r",       "\t",     ",",      "'", "$",
      "é", "\u0301", "中", "カ", "😀",  "\x80", "\xE4\xB8", "\u00a0", "\u200d", "—"};
  for (int iter = 0; iter < 500; ++iter) {
    std::string text;
    const int n = static_cast<int>(rng() % 30);
    for (int i = 0; i < n; ++i) text += alphabet[rng() % alphabet.size()];
    for (const auto& rules : {internal::DeepSeekV3Rules(),
                              std::vector<internal::SplitRule>{internal::SplitRule::kGpt2}}) {
      std::string joined;
      for (std::string_view p : internal::PreTokenize(text, rules)) {
        EXPECT_FALSE(p.empty());
        joined += p;
      }
      EXPECT_EQ(joined, text);
    }
  }
}

TEST(PreTokenizerTest, Gpt2RuleWorkedExample) {
  std::vector<std::string> pieces;
  for (std::string_view p :
       internal::PreTokenize("I'll pay $100 now!!  ok", {internal::SplitRule::kGpt2})) {
    pieces.emplace_back(p);
  }
  EXPECT_THAT(pieces, ElementsAre("I", "'ll", " pay", " $", "100", " now", "!!", " ", " ok"));
}

// ---------------------------------------------------------------------------------- BPE

TEST(BpeTest, MergesApplyInRankOrderNotLeftToRight) {
  // Ranks: "c d" 0, "a b" 1, "b c" 2, "ab cd" 3.
  std::unique_ptr<Tokenizer> t = MustLoad(
      TinyTokenizerJson("abcd", {"cd", "ab", "bc", "abcd"}, {"c d", "a b", "b c", "ab cd"}));
  ASSERT_NE(t, nullptr);
  const int32_t a = 0, b = 1, c = 2, cd = 4, ab = 5, abcd = 7;
  // "abcd": (c,d) rank 0 first -> a b cd; (a,b) rank 1 -> ab cd; (ab,cd) rank 3 -> abcd.
  EXPECT_THAT(t->Encode("abcd", false), ElementsAre(abcd));
  // "bcd": (c,d) rank 0 beats (b,c) rank 2 -> b cd; no merge for (b,cd).
  EXPECT_THAT(t->Encode("bcd", false), ElementsAre(b, cd));
  // "abc": (a,b) rank 1 beats (b,c) rank 2 -> ab c.
  EXPECT_THAT(t->Encode("abc", false), ElementsAre(ab, c));
  EXPECT_THAT(t->Encode("ca", false), ElementsAre(c, a));
}

TEST(BpeTest, SwappingTwoRanksChangesTheResult) {
  std::unique_ptr<Tokenizer> bc_first =
      MustLoad(TinyTokenizerJson("abc", {"bc", "ab"}, {"b c", "a b"}));
  std::unique_ptr<Tokenizer> ab_first =
      MustLoad(TinyTokenizerJson("abc", {"bc", "ab"}, {"a b", "b c"}));
  ASSERT_NE(bc_first, nullptr);
  ASSERT_NE(ab_first, nullptr);
  EXPECT_THAT(bc_first->Encode("abc", false), ElementsAre(0, 3));  // a bc
  EXPECT_THAT(ab_first->Encode("abc", false), ElementsAre(4, 2));  // ab c
}

TEST(BpeTest, EqualRanksMergeLeftmostFirst) {
  std::unique_ptr<Tokenizer> t = MustLoad(TinyTokenizerJson("a", {"aa"}, {"a a"}));
  ASSERT_NE(t, nullptr);
  EXPECT_THAT(t->Encode("aaa", false), ElementsAre(1, 0));
  EXPECT_THAT(t->Encode("aaaa", false), ElementsAre(1, 1));
  EXPECT_THAT(t->Encode("aaaaa", false), ElementsAre(1, 1, 0));
}

TEST(BpeTest, MergesAsPairsAreAccepted) {
  std::string json = TinyTokenizerJson("ab", {"ab"}, {});
  const std::string marker = R"("merges":[])";
  json.replace(json.find(marker), marker.size(), R"("merges":[["a","b"]])");
  std::unique_ptr<Tokenizer> t = MustLoad(json);
  ASSERT_NE(t, nullptr);
  EXPECT_THAT(t->Encode("ab", false), ElementsAre(2));
  EXPECT_EQ(t->num_merges(), 1u);
}

TEST(BpeTest, BuiltTokenizerMergesCommonWords) {
  const Tokenizer& t = BuiltTokenizer1024();
  // " the" is among the most frequent pieces of the training text: one token.
  const std::vector<int32_t> ids = t.Encode(" the", false);
  ASSERT_EQ(ids.size(), 1u);
  EXPECT_EQ(t.IdToToken(ids[0]), "\xC4\xA0the");  // "Ġthe"
}

// ---------------------------------------------------------------------------------- round trip

TEST(TokenizerTest, EncodeDecodeRoundTripIsIdentity) {
  const Tokenizer& t = BuiltTokenizer1024();
  const std::vector<std::string> texts = {
      "",
      "Hello world",
      "The quick brown fox jumps over the lazy dog.\n",
      "  multiple   spaces\tand\ttabs \n\n\nnewlines\r\n",
      "Numbers 1 12 123 1234 12345 3.14159",
      "Ça va très bien, merci. Größe über Straße.",
      "你好，世界！今天天气很好。",
      "こんにちは、カタカナ。",
      "안녕하세요",
      "Emoji 😀👍🏽 👨‍👩‍👧 ❤️ 🇫🇷",
      "def f(x):\n    return x * 2\n",
      "\x01\x02\x7f control",
  };
  for (const std::string& text : texts) {
    const std::vector<int32_t> ids = t.Encode(text, false);
    EXPECT_EQ(t.Decode(ids), text);
  }
  std::mt19937 rng(7);
  const std::vector<std::string> alphabet = {"a", "b",  "e", "the", " ", "\n", "1", ".",
                                             "é", "中", "😀", "\t",  "ß", "’",  "<", "｜"};
  for (int iter = 0; iter < 300; ++iter) {
    std::string text;
    const int n = static_cast<int>(rng() % 40);
    for (int i = 0; i < n; ++i) text += alphabet[rng() % alphabet.size()];
    EXPECT_EQ(t.Decode(t.Encode(text, false)), text);
  }
}

TEST(TokenizerTest, AddBosPrependsBos) {
  const Tokenizer& t = BuiltTokenizer1024();
  EXPECT_EQ(t.bos_id(), kBuiltBosId);
  EXPECT_EQ(t.eos_id(), kBuiltEosId);
  EXPECT_EQ(t.pad_id(), kBuiltPadId);
  EXPECT_TRUE(t.add_bos_token());
  const std::vector<int32_t> with = t.Encode("hi", true);
  const std::vector<int32_t> without = t.Encode("hi", false);
  ASSERT_EQ(with.size(), without.size() + 1);
  EXPECT_EQ(with[0], kBuiltBosId);
  EXPECT_EQ(t.Decode(with), std::string(kBosTokenText) + "hi");
  EXPECT_EQ(t.Decode(with, /*skip_special_tokens=*/true), "hi");
}

TEST(TokenizerTest, SpecialTokensAreMatchedExactly) {
  const Tokenizer& t = BuiltTokenizer1024();
  const int32_t user = t.vocab_size() - 2, assistant = t.vocab_size() - 1;
  EXPECT_EQ(t.TokenToId(kUserTokenText), user);
  EXPECT_EQ(t.TokenToId(kAssistantTokenText), assistant);
  EXPECT_TRUE(t.IsSpecial(user));
  EXPECT_FALSE(t.IsSpecial(kBuiltFirstByteId + 'a'));

  const std::string prompt = std::string(kBosTokenText) + "Be brief." +
                             std::string(kUserTokenText) + "Hi" + std::string(kAssistantTokenText);
  const std::vector<int32_t> ids = t.Encode(prompt, /*add_bos=*/false);
  ASSERT_GE(ids.size(), 4u);
  EXPECT_EQ(ids.front(), kBuiltBosId);
  EXPECT_EQ(ids.back(), assistant);
  const std::vector<int32_t> hi = t.Encode("Hi", false);
  ASSERT_GE(ids.size(), hi.size() + 2);
  EXPECT_EQ(ids[ids.size() - hi.size() - 2], user);
  EXPECT_EQ(t.Decode(ids), prompt);

  // Not parsed: the same text is plain bytes, no special ids.
  const std::vector<int32_t> plain = t.Encode(prompt, false, /*parse_special=*/false);
  for (int32_t id : plain) EXPECT_FALSE(t.IsSpecial(id)) << id;
  EXPECT_EQ(t.Decode(plain), prompt);
  // A prefix of a special token is plain text.
  for (int32_t id : t.Encode("<｜User", false)) EXPECT_FALSE(t.IsSpecial(id));
}

TEST(TokenizerTest, AddedTokensMatchLeftmostLongestAndStrip) {
  const std::string added =
      R"([{"id":3,"content":"<x>","special":true},{"id":4,"content":"<x>y","special":false},)"
      R"({"id":5,"content":"[S]","special":true,"lstrip":true,"rstrip":true}])";
  std::unique_ptr<Tokenizer> t = MustLoad(TinyTokenizerJson("xy ", {}, {}, added));
  ASSERT_NE(t, nullptr);
  EXPECT_THAT(t->Encode("<x>y", false), ElementsAre(4));
  EXPECT_THAT(t->Encode("<x>x", false), ElementsAre(3, 0));
  EXPECT_THAT(t->Encode("y<x>", false), ElementsAre(1, 3));
  EXPECT_THAT(t->Encode("x  [S]  y", false), ElementsAre(0, 5, 1));
  EXPECT_TRUE(t->IsSpecial(3));
  EXPECT_FALSE(t->IsSpecial(4));
}

TEST(TokenizerTest, DecodeIgnoresIdsWithoutTokensAndRepairsUtf8) {
  const Tokenizer& t = BuiltTokenizer1024();
  const int32_t e2 = kBuiltFirstByteId + 0xE2;
  const int32_t a = kBuiltFirstByteId + 'a';
  const std::vector<int32_t> ids = {a, -1, t.vocab_size(), t.vocab_size() + 100, a};
  EXPECT_EQ(t.Decode(ids), "aa");
  // A lone lead byte followed by ASCII: one U+FFFD, then the ASCII.
  const std::vector<int32_t> broken = {e2, a};
  EXPECT_EQ(t.Decode(broken),
            "\xEF\xBF\xBD"
            "a");
  const std::vector<int32_t> continuation = {kBuiltFirstByteId + 0x80};
  EXPECT_EQ(t.Decode(continuation), "\xEF\xBF\xBD");
}

// ---------------------------------------------------------------------------------- streaming

TEST(StreamDecoderTest, HoldsIncompleteCharactersUntilComplete) {
  const Tokenizer& t = BuiltTokenizer1024();
  Tokenizer::StreamDecoder d = t.NewStreamDecoder();
  // "€" = E2 82 AC, pushed one byte token at a time.
  EXPECT_EQ(d.Push(kBuiltFirstByteId + 0xE2), "");
  EXPECT_EQ(d.Push(kBuiltFirstByteId + 0x82), "");
  EXPECT_EQ(d.Push(kBuiltFirstByteId + 0xAC), "€");
  EXPECT_EQ(d.Push(kBuiltFirstByteId + 'x'), "x");
  EXPECT_EQ(d.Flush(), "");
  // Truncated at the end: Flush emits U+FFFD.
  EXPECT_EQ(d.Push(kBuiltFirstByteId + 0xF0), "");
  EXPECT_EQ(d.Push(kBuiltFirstByteId + 0x9F), "");
  EXPECT_EQ(d.Flush(), "\xEF\xBF\xBD");
  // Broken by an ASCII byte: U+FFFD then the byte.
  EXPECT_EQ(d.Push(kBuiltFirstByteId + 0xE4), "");
  EXPECT_EQ(d.Push(kBuiltFirstByteId + 'y'),
            "\xEF\xBF\xBD"
            "y");
}

TEST(StreamDecoderTest, NeverEmitsBrokenUtf8AndMatchesDecode) {
  const Tokenizer& t = BuiltTokenizer1024();
  std::mt19937 rng(99);
  const std::vector<std::string> alphabet = {"a", " the", "中文", "😀", "é", "\n", "ß", "カ"};
  for (int iter = 0; iter < 200; ++iter) {
    std::vector<int32_t> ids;
    if (iter % 2 == 0) {
      std::string text;
      for (int i = 0; i < 12; ++i) text += alphabet[rng() % alphabet.size()];
      ids = t.Encode(text, false);
    } else {
      // Random ids, including byte tokens that form ill-formed UTF-8 and unused ids.
      for (int i = 0; i < 20; ++i)
        ids.push_back(static_cast<int32_t>(rng() % (t.vocab_size() + 8)));
    }
    Tokenizer::StreamDecoder d = t.NewStreamDecoder();
    std::string streamed;
    for (int32_t id : ids) {
      const std::string piece = d.Push(id);
      EXPECT_TRUE(IsValidUtf8(piece));
      streamed += piece;
    }
    const std::string tail = d.Flush();
    EXPECT_TRUE(IsValidUtf8(tail));
    streamed += tail;
    EXPECT_EQ(streamed, t.Decode(ids));
  }
}

// ---------------------------------------------------------------------------------- errors

void ExpectInvalid(const std::string& json, std::string_view message_part) {
  absl::StatusOr<std::unique_ptr<Tokenizer>> t = Tokenizer::FromJson(json, "");
  ASSERT_FALSE(t.ok()) << json;
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument) << t.status();
  EXPECT_THAT(std::string(t.status().message()), HasSubstr(std::string(message_part)));
}

TEST(TokenizerErrorsTest, MalformedTokenizerJsonIsInvalidArgument) {
  ExpectInvalid("{not json", "tokenizer.json");
  ExpectInvalid("[1, 2]", "not an object");
  ExpectInvalid(R"({"decoder":{"type":"ByteLevel"}})", "missing \"model\"");
  ExpectInvalid(R"({"decoder":{"type":"ByteLevel"},"model":{"type":"WordPiece","vocab":{}}})",
                "unsupported model type \"WordPiece\"");
  ExpectInvalid(R"({"decoder":{"type":"ByteLevel"},"model":{"type":"BPE","vocab":[]}})",
                "vocab is not an object");
  ExpectInvalid(TinyTokenizerJson("ab", {}, {"a c"}), "references unknown token \"c\"");
  ExpectInvalid(TinyTokenizerJson("ab", {}, {"a b"}), "references unknown token \"ab\"");
  ExpectInvalid(TinyTokenizerJson("ab", {"ab"}, {"ab"}), "is not \"a b\"");
  ExpectInvalid(R"({"decoder":{"type":"ByteLevel"},"model":{"type":"BPE","vocab":{"a":0,"b":0}}})",
                "id 0 is used by both");
  ExpectInvalid(R"({"decoder":{"type":"ByteLevel"},"model":{"type":"BPE","vocab":{"a":-1}}})",
                "out of range");
  ExpectInvalid(R"({"model":{"type":"BPE","vocab":{"a":0}}})", "not a byte-level tokenizer");
  ExpectInvalid(
      TinyTokenizerJson("a", {}, {}, "[]",
                        R"({"type":"Split","pattern":{"Regex":"\\w+"},"behavior":"Isolated"})"),
      "unsupported Split pre_tokenizer regex");
  ExpectInvalid(TinyTokenizerJson("a", {}, {}, "[]", R"({"type":"Whitespace"})"),
                "unsupported pre_tokenizer \"Whitespace\"");
  ExpectInvalid(TinyTokenizerJson("a", {}, {}, R"([{"id":0,"content":"b"}])"),
                "id 0 is used by both");
}

TEST(TokenizerErrorsTest, BadTokenizerConfigIsInvalidArgument) {
  const std::string json = TinyTokenizerJson("ab", {}, {});
  absl::StatusOr<std::unique_ptr<Tokenizer>> t =
      Tokenizer::FromJson(json, R"({"bos_token": "<s>"})");
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(t.status().message()), HasSubstr("bos_token \"<s>\" is not in"));
  t = Tokenizer::FromJson(json, R"({"eos_token": 5})");
  ASSERT_FALSE(t.ok());
  EXPECT_THAT(std::string(t.status().message()), HasSubstr("eos_token"));
  t = Tokenizer::FromJson(json, R"({"bos_token": {"content": "a"}, "eos_token": "b"})");
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ((*t)->bos_id(), 0);
  EXPECT_EQ((*t)->eos_id(), 1);
  EXPECT_FALSE((*t)->add_bos_token());
}

TEST(TokenizerErrorsTest, MissingDirectoryIsNotFound) {
  absl::StatusOr<std::unique_ptr<Tokenizer>> t = Tokenizer::Load("/nonexistent/hmoe/tokenizer");
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), absl::StatusCode::kNotFound);
}

// ---------------------------------------------------------------------------------- builder

TEST(TokenizerBuilderTest, VocabularyHasExactlyTheRequestedSizeAndLayout) {
  for (int32_t size : {kMinBuiltVocabSize, 300, 1024}) {
    absl::StatusOr<BuiltTokenizer> built = BuildTokenizer(size, 2048);
    ASSERT_TRUE(built.ok()) << built.status();
    std::unique_ptr<Tokenizer> t = MustLoad(built->tokenizer_json, built->tokenizer_config_json);
    ASSERT_NE(t, nullptr);
    EXPECT_EQ(t->vocab_size(), size);
    EXPECT_EQ(t->num_merges(), static_cast<size_t>(size - kMinBuiltVocabSize));
    for (int32_t id = 0; id < size; ++id) EXPECT_FALSE(t->IdToToken(id).empty()) << id;
    EXPECT_EQ(t->IdToToken(0), kBosTokenText);
    EXPECT_EQ(t->IdToToken(1), kEosTokenText);
    EXPECT_EQ(t->IdToToken(2), kPadTokenText);
    EXPECT_EQ(t->IdToToken(size - 2), kUserTokenText);
    EXPECT_EQ(t->IdToToken(size - 1), kAssistantTokenText);
    EXPECT_EQ(t->IdToToken(kBuiltFirstByteId + ' '), "\xC4\xA0");
    EXPECT_EQ(t->model_max_length(), 2048);
    EXPECT_THAT(t->chat_template(), HasSubstr("add_generation_prompt"));
  }
}

TEST(TokenizerBuilderTest, IsDeterministicAndRejectsBadSizes) {
  absl::StatusOr<BuiltTokenizer> a = BuildTokenizer(600, 1024);
  absl::StatusOr<BuiltTokenizer> b = BuildTokenizer(600, 1024);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->tokenizer_json, b->tokenizer_json);
  EXPECT_EQ(a->tokenizer_config_json, b->tokenizer_config_json);
  EXPECT_EQ(BuildTokenizer(kMinBuiltVocabSize - 1, 1024).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(BuildTokenizer(kMaxBuiltVocabSize + 1, 1024).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(TokenizerBuilderTest, WritesHuggingFaceLayout) {
  absl::StatusOr<BuiltTokenizer> built = BuildTokenizer(400, 1024);
  ASSERT_TRUE(built.ok());
  absl::StatusOr<json::Value> root = json::Parse(built->tokenizer_json);
  ASSERT_TRUE(root.ok()) << root.status();
  std::vector<std::string> keys;
  for (const auto& [key, value] : root->members()) keys.push_back(key);
  EXPECT_THAT(keys, ElementsAre("version", "truncation", "padding", "added_tokens", "normalizer",
                                "pre_tokenizer", "post_processor", "decoder", "model"));
  const json::Value* model = root->Find("model");
  ASSERT_NE(model, nullptr);
  std::vector<std::string> model_keys;
  for (const auto& [key, value] : model->members()) model_keys.push_back(key);
  EXPECT_THAT(model_keys,
              ElementsAre("type", "dropout", "unk_token", "continuing_subword_prefix",
                          "end_of_word_suffix", "fuse_unk", "byte_fallback", "vocab", "merges"));
  EXPECT_EQ(model->Find("type")->as_string(), "BPE");
  EXPECT_EQ(model->Find("vocab")->members().size(), 398u);  // all but User/Assistant
  const json::Value* pre = root->Find("pre_tokenizer")->Find("pretokenizers");
  ASSERT_NE(pre, nullptr);
  ASSERT_EQ(pre->items().size(), 4u);
  EXPECT_EQ(pre->items()[2].Find("pattern")->Find("Regex")->as_string(),
            internal::SplitRuleRegex(internal::SplitRule::kDeepSeekV3));
  absl::StatusOr<json::Value> config = json::Parse(built->tokenizer_config_json);
  ASSERT_TRUE(config.ok());
  EXPECT_TRUE(config->Find("add_bos_token")->as_bool());
  EXPECT_FALSE(config->Find("add_eos_token")->as_bool());
  EXPECT_EQ(config->Find("tokenizer_class")->as_string(), "LlamaTokenizerFast");
}

TEST(TokenizerBuilderTest, WriteThenLoadFromDirectory) {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("hmoe_tokenizer_test_" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  ASSERT_TRUE(WriteTokenizerFiles(dir.string(), 512, 1024).ok());
  absl::StatusOr<std::unique_ptr<Tokenizer>> t = Tokenizer::Load(dir.string());
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ((*t)->vocab_size(), 512);
  EXPECT_EQ((*t)->Decode((*t)->Encode("round trip ✓", true), true), "round trip ✓");
  std::filesystem::remove_all(dir);
}

// ---------------------------------------------------------------------------------- tiktoken

std::vector<std::string> KimiPieces(std::string_view text) {
  std::vector<std::string> out;
  for (std::string_view p : internal::PreTokenize(text, internal::KimiRules())) out.emplace_back(p);
  return out;
}

// The expected pieces are tiktoken 0.14.0's with Kimi-K2's pat_str (a vocabulary holding every
// substring of the text, so that each piece is one token: tests/tokenizer/tiktoken_conformance_test
// checks the same on generated text).
TEST(KimiPreTokenizerTest, MatchesTiktokenOnWorkedExamples) {
  EXPECT_THAT(KimiPieces("Hello World"), ElementsAre("Hello", " World"));
  EXPECT_THAT(KimiPieces("HTTPServer"), ElementsAre("HTTPServer"));
  EXPECT_THAT(KimiPieces("don't DON'T"), ElementsAre("don't", " DON'T"));
  EXPECT_THAT(KimiPieces("I'M ſ'ſ"), ElementsAre("I'M", " ſ'ſ"));  // long s
  // Han script, not only ideographs: 々 (Lm), 〇 (Nl), ⺀ (So) continue the run.
  EXPECT_THAT(KimiPieces("中文abc々〇⺀x"), ElementsAre("中文", "abc", "々〇⺀", "x"));
  EXPECT_THAT(KimiPieces("123456"), ElementsAre("123", "456"));
  EXPECT_THAT(KimiPieces("ab  cd"), ElementsAre("ab", " ", " cd"));
  EXPECT_THAT(KimiPieces("x!!\n\ny"), ElementsAre("x", "!!\n\n", "y"));
  // Garay (Unicode 16.0): a capital and a small letter are one word.
  EXPECT_THAT(KimiPieces("\U00010D50\U00010D70 \U00010D50"),
              ElementsAre("\U00010D50\U00010D70", " \U00010D50"));
  // Marks are in both letter classes and in the optional prefix class.
  EXPECT_THAT(KimiPieces("\u0301ABC"), ElementsAre("\u0301", "ABC"));
  EXPECT_THAT(KimiPieces("\u00aa\u0301AB"), ElementsAre("\u00aa\u0301", "AB"));
  EXPECT_THAT(KimiPieces(" \u0301x"), ElementsAre(" \u0301x"));
  EXPECT_THAT(KimiPieces("!!\u0301"), ElementsAre("!!\u0301"));
  EXPECT_THAT(KimiPieces("A\u00aaB"), ElementsAre("A\u00aa", "B"));
  EXPECT_THAT(KimiPieces("\u01c5emal"), ElementsAre("\u01c5emal"));  // Lt
  EXPECT_THAT(KimiPieces("a\u3000\u3000b"), ElementsAre("a", "\u3000", "\u3000b"));
  EXPECT_THAT(KimiPieces("\u302a\u302a"), ElementsAre("\u302a\u302a"));  // Han marks
}

std::string TiktokenLine(std::string_view bytes, int rank) {
  return absl::StrCat(absl::Base64Escape(absl::string_view(bytes.data(), bytes.size())), " ", rank,
                      "\n");
}

// tiktoken.model with the 256 bytes (rank = byte) and `extra` tokens after them.
std::string TiktokenModel(const std::vector<std::string>& extra) {
  std::string out;
  for (int b = 0; b < 256; ++b) out += TiktokenLine(std::string(1, static_cast<char>(b)), b);
  for (size_t i = 0; i < extra.size(); ++i)
    out += TiktokenLine(extra[i], 256 + static_cast<int>(i));
  return out;
}

std::unique_ptr<Tokenizer> MustLoadTiktoken(const std::string& model, const std::string& config) {
  absl::StatusOr<std::unique_ptr<Tokenizer>> t = Tokenizer::FromTiktoken(model, config);
  EXPECT_TRUE(t.ok()) << t.status();
  return t.ok() ? *std::move(t) : nullptr;
}

TEST(TiktokenTest, MergesByRankOfTheConcatenationAndTakesWholePieces) {
  // "ab" (256) ranks before "bc" (257): a+b merge first. With the ranks swapped, b+c first.
  std::unique_ptr<Tokenizer> t = MustLoadTiktoken(TiktokenModel({"ab", "bc", "abc!"}), "");
  ASSERT_NE(t, nullptr);
  EXPECT_THAT(t->Encode("abc", false), ElementsAre(256, 'c'));
  t = MustLoadTiktoken(TiktokenModel({"bc", "ab"}), "");
  ASSERT_NE(t, nullptr);
  EXPECT_THAT(t->Encode("abc", false), ElementsAre('a', 256));
  // "xyz" is a token no pair of tokens makes: a piece that is a token is that token.
  t = MustLoadTiktoken(TiktokenModel({"xyz"}), "");
  ASSERT_NE(t, nullptr);
  EXPECT_THAT(t->Encode("xyz", false), ElementsAre(256));
  EXPECT_THAT(t->Encode("xyzz", false), ElementsAre('x', 'y', 'z', 'z'));
  EXPECT_EQ(t->vocab_size(), 257 + 256);  // the 256 reserved specials follow the ranks
  EXPECT_EQ(t->IdToToken(257), "<|reserved_token_257|>");
  EXPECT_TRUE(t->IsSpecial(512));
  EXPECT_THAT(t->Encode("<|reserved_token_300|>", false), ElementsAre(300));
  EXPECT_EQ(t->Encode("<|reserved_token_300|>", false, /*parse_special=*/false).size(), 22u);
  EXPECT_EQ(t->Decode(std::vector<int32_t>{256, 300, 0xE4}), "xyz<|reserved_token_300|>\uFFFD");
}

TEST(TiktokenTest, SpecialTokensComeFromAddedTokensDecoder) {
  const std::string config = R"({"added_tokens_decoder": {
      "256": {"content": "[BOS]", "special": true}, "257": {"content": "<|im_end|>"},
      "600": {"content": "[FAR]"}}, "bos_token": "[BOS]", "eos_token": "<|im_end|>",
      "add_bos_token": true})";
  std::unique_ptr<Tokenizer> t = MustLoadTiktoken(TiktokenModel({}), config);
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->bos_id(), 256);
  EXPECT_EQ(t->eos_id(), 257);
  EXPECT_EQ(t->vocab_size(), 601);  // a named id beyond the reserved slots counts too
  EXPECT_THAT(t->Encode("a<|im_end|>[FAR]", true), ElementsAre(256, 'a', 257, 600));
  EXPECT_EQ(t->IdToToken(258), "<|reserved_token_258|>");
  EXPECT_EQ(t->Decode(std::vector<int32_t>{256, 'h', 'i', 257}, /*skip_special_tokens=*/true),
            "hi");
}

TEST(TiktokenTest, MalformedFilesAreInvalidArgumentNamingTheLine) {
  const auto expect_invalid = [](const std::string& model, const std::string& config,
                                 std::string_view part) {
    absl::StatusOr<std::unique_ptr<Tokenizer>> t = Tokenizer::FromTiktoken(model, config);
    ASSERT_FALSE(t.ok()) << part;
    EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument) << t.status();
    EXPECT_THAT(std::string(t.status().message()), HasSubstr(part));
  };
  expect_invalid("", "", "no tokens");
  expect_invalid("YQ== 0\nYg==\n", "", "line 2: expected");
  expect_invalid("YQ== 0\n\nYg== x1\n", "", "line 3: rank \"x1\"");
  expect_invalid("YQ== 0\nYg== 0\n", "", "line 2: rank 0 appears twice");
  expect_invalid("YQ== 0\nYQ== 1\n", "", "line 2: token \"YQ==\" appears twice");
  expect_invalid("Y*== 0\n", "", "line 1: token");
  expect_invalid("YQ== 99999999\n", "", "not below 2^24");
  // Found by the tiktoken fuzzer: a sparse rank made a 248-byte file allocate 11 M ids.
  expect_invalid("YQ== 0\nYg== 11111124\n", "",
                 "line 2: rank 11111124 is not below the number "
                 "of tokens (2): the ranks must be 0 .. 1");
  expect_invalid("YQ== 1\n", "", "line 1: rank 1 is not below the number of tokens (1)");
  expect_invalid("YQ== 0\n", R"({"added_tokens_decoder": {"16000000": {"content": "[X]"}}})",
                 "special token \"[X]\" has id 16000000, more than 65536 past the reserved ids "
                 "(1 .. 256)");
  expect_invalid("YQ== 0\n", R"({"added_tokens_decoder": {"0": {"content": "[X]"}}})",
                 "a rank of tiktoken.model");
  expect_invalid("YQ== 0\n", R"({"added_tokens_decoder": {"x": {"content": "[X]"}}})",
                 "added_tokens_decoder entry \"x\"");
  expect_invalid("YQ== 0\n", R"({"added_tokens_decoder": [1]})", "not an object");
  expect_invalid("YQ== 0\n",
                 R"({"added_tokens_decoder": {"1": {"content": "[X]"},)"
                 R"( "2": {"content": "[X]"}}})",
                 "appears twice");
  expect_invalid("YQ== 0\n", R"({"bos_token": "[NOPE]"})", "not in the vocabulary");
}

TEST(TiktokenTest, LoadPrefersTokenizerJsonAndElseReadsTiktokenModel) {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("hmoe_tiktoken_test_" + std::to_string(getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  ASSERT_TRUE(WriteTokenizerFiles(dir.string(), 1024, 4096, TokenizerStyle::kKimi).ok());
  EXPECT_FALSE(std::filesystem::exists(dir / "tokenizer.json"));
  absl::StatusOr<std::unique_ptr<Tokenizer>> t = Tokenizer::Load(dir.string());
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ((*t)->vocab_size(), 1024);
  EXPECT_EQ((*t)->bos_id(), 768);  // [BOS]: the first id after the 768 ranks
  EXPECT_EQ((*t)->eos_id(), 769);
  EXPECT_EQ((*t)->pad_id(), 1023);
  EXPECT_EQ((*t)->IdToToken(773), "<|reserved_token_773|>");
  EXPECT_EQ((*t)->TokenToId("<|im_middle|>"), 768 + 17);
  EXPECT_THAT((*t)->chat_template(), HasSubstr("<|im_assistant|>"));
  const std::string text = "<|im_user|>user<|im_middle|>你好, World! 123 \U0001FAE8<|im_end|>";
  const std::vector<int32_t> ids = (*t)->Encode(text, false);
  EXPECT_EQ(ids.front(), 768 + 3);
  EXPECT_EQ(ids.back(), 768 + 2);
  EXPECT_EQ((*t)->Decode(ids), text);
  EXPECT_LT(ids.size(), text.size() / 2);  // the trained ranks merge

  // With a tokenizer.json beside it, that one is loaded.
  ASSERT_TRUE(WriteTokenizerFiles(dir.string(), 600, 4096).ok());
  t = Tokenizer::Load(dir.string());
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ((*t)->vocab_size(), 600);
  EXPECT_EQ((*t)->bos_id(), kBuiltBosId);

  std::filesystem::remove(dir / "tokenizer.json");
  std::filesystem::remove(dir / "tiktoken.model");
  t = Tokenizer::Load(dir.string());
  EXPECT_EQ(t.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(t.status().message()), HasSubstr("neither tokenizer.json nor tiktoken"));
  std::filesystem::remove_all(dir);
}

TEST(TiktokenTest, KimiBuilderIsDeterministicAndRejectsBadSizes) {
  absl::StatusOr<BuiltTokenizer> a = BuildKimiTokenizer(600, 1024);
  absl::StatusOr<BuiltTokenizer> b = BuildKimiTokenizer(600, 1024);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->tiktoken_model, b->tiktoken_model);
  EXPECT_EQ(a->tokenizer_config_json, b->tokenizer_config_json);
  EXPECT_TRUE(a->tokenizer_json.empty());
  EXPECT_EQ(BuildKimiTokenizer(kMinKimiVocabSize - 1, 1024).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// ---------------------------------------------------------------------------------- linearity

// Issue 16, finding 8: every part of Encode is linear in its input (BPE: n log n), checked on
// 1 MiB adversarial inputs with the deterministic work counters of internal::TokenizerWork, not
// with timings (no timed assertions; the times are printed for the record). The bounds per input
// byte follow from the code:
//  - scan steps <= 12: each scanner call looks at the units it consumes plus at most 2 more (the
//    ones that end its runs), one match consumes >= 1 unit, and the whitespace rule looks back
//    once over a run it then consumes: <= 4 per unit and rule, 3 rules (DeepSeek-V3; GPT-2 has 1).
//    The old \p{N}{1,3} scanner took n^2/6 steps on a run of n digits (1.8e11 for 1 MiB).
//  - BPE heap operations <= 6: n - 1 initial candidates, at most 2 more per merge (n - 1 merges at
//    most), each popped at most once.
//  - added-token trie steps <= 1 + the longest added token (27 bytes here) per byte: the walk at a
//    position stops at the first byte that no added token continues.
constexpr size_t kMiB = size_t{1} << 20;

std::string RepeatTo(std::string_view unit, size_t bytes) {
  std::string out;
  out.reserve(bytes + unit.size());
  while (out.size() + unit.size() <= bytes) out.append(unit);
  return out;
}

// Deterministic English-like text: words, spaces, punctuation, digits and newlines.
std::string PlainText(size_t bytes) {
  static const char* const kWords[] = {
      "the",  "model",  "of",    "a",     "tokenizer", "splits", "text",   "into", "pieces",
      "and",  "merges", "bytes", "by",    "rank",      "while",  "people", "read", "numbers",
      "like", "2024",   "or",    "3.14,", "then",      "write",  "again.", "It's", "fine"};
  std::mt19937 rng(7);
  std::string out;
  out.reserve(bytes + 16);
  while (out.size() < bytes) {
    out += kWords[rng() % std::size(kWords)];
    out += rng() % 12 == 0 ? "\n" : " ";
  }
  out.resize(bytes);
  return out;
}

struct Work {
  internal::TokenizerWork counts;
  double seconds = 0;
  size_t tokens = 0;
};

Work MeasureEncode(const Tokenizer& t, std::string_view text, bool parse_special) {
  internal::ThreadTokenizerWork() = {};
  const auto start = std::chrono::steady_clock::now();
  const std::vector<int32_t> ids = t.Encode(text, /*add_bos=*/false, parse_special);
  Work w;
  w.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  w.counts = internal::ThreadTokenizerWork();
  w.tokens = ids.size();
  return w;
}

TEST(TokenizerLinearityTest, AdversarialMegabyteInputsDoLinearWork) {
  const Tokenizer& t = BuiltTokenizer1024();
  const std::string plain = PlainText(kMiB);
  std::string long_word;  // the plain text's letters alone: one 1 MiB pre-token
  for (char c : plain) {
    if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) long_word += c;
  }
  while (long_word.size() < kMiB) long_word += long_word;
  long_word.resize(kMiB);
  const struct {
    const char* name;
    std::string text;
  } inputs[] = {
      {"plain text", plain},
      {"digits", RepeatTo("1234567890", kMiB)},
      {"arabic-indic digits", RepeatTo("\u0663\u0664", kMiB)},
      {"spaces", RepeatTo(" ", kMiB)},
      {"spaces then a letter", RepeatTo(" ", kMiB - 1) + "x"},
      {"mixed whitespace", RepeatTo(" \t\u00a0\u3000", kMiB)},
      {"newlines and spaces", RepeatTo(" \n ", kMiB)},
      {"combining marks", "e" + RepeatTo("\u0301", kMiB - 1)},
      {"marks alone", RepeatTo("\u0301\u0302", kMiB)},
      {"one long word", long_word},
      {"punctuation", RepeatTo("!", kMiB)},
      {"punctuation and newlines", RepeatTo("?\n", kMiB)},
      {"ascii punct letter", RepeatTo(",a", kMiB)},
      {"apostrophes", RepeatTo("'s", kMiB)},
      {"cjk", RepeatTo("中文", kMiB)},
      {"emoji", RepeatTo("\U0001F600", kMiB)},
      {"invalid utf-8", RepeatTo("\xff", kMiB)},
      {"added token prefixes", RepeatTo("<", kMiB)},
      {"long added token prefixes", RepeatTo("<｜begin▁of▁sentence", kMiB)},
  };
  const Work base = MeasureEncode(t, plain, /*parse_special=*/true);
  for (const auto& input : inputs) {
    SCOPED_TRACE(input.name);
    const double bytes = static_cast<double>(input.text.size());
    ASSERT_GE(bytes, kMiB - 64);
    const Work w = MeasureEncode(t, input.text, /*parse_special=*/true);
    EXPECT_LE(w.counts.scan_steps, 12 * bytes);
    EXPECT_LE(w.counts.bpe_heap_ops, 6 * bytes);
    EXPECT_LE(w.counts.added_steps, 28 * bytes);
    internal::ThreadTokenizerWork() = {};
    internal::PreTokenize(input.text, {internal::SplitRule::kGpt2});
    const uint64_t gpt2_steps = internal::ThreadTokenizerWork().scan_steps;
    EXPECT_LE(gpt2_steps, 4 * bytes);
    std::printf(
        "%-26s %8zu tokens  scan %5.2f/B  gpt2 %4.2f/B  heap %4.2f/B  added %5.2f/B  "
        "%7.3f s = %5.2f x plain text\n",
        input.name, w.tokens, w.counts.scan_steps / bytes, gpt2_steps / bytes,
        w.counts.bpe_heap_ops / bytes, w.counts.added_steps / bytes, w.seconds,
        w.seconds / base.seconds);
  }
}

// Kimi-K2's tiktoken pre-tokenizer (one rule, internal::SplitRule::kKimi) on the same inputs and
// on inputs aimed at its letter-case alternatives. Bounds per input byte:
//  - scan steps <= 12: at a position the rule tries [\p{Han}]+, then the two letter alternatives,
//    each with and without the prefix unit (4 scans of the letter run that follows, one pass
//    each, plus 1 unit ending each run and 3 for the contraction), then \p{N}{1,3}, the
//    punctuation run and the whitespace rule (a run and one look back over it). A failed letter
//    alternative leaves the run to the next one, which consumes it (the upper-case alternative
//    takes the whole run), and a shortened match (a run that ends in Lu/Lt after its last Lm/Lo/M)
//    leaves only Lu/Lt units, which the next position's upper-case alternative consumes: each
//    unit is scanned by at most 2 positions' attempts, < 12 steps per unit in all.
//  - heap <= 6 and added-token steps <= 1 + the longest special ("<|reserved_token_NNNN|>", 24
//    bytes) as above.
TEST(TokenizerLinearityTest, KimiPreTokenizerDoesLinearWork) {
  absl::StatusOr<BuiltTokenizer> built = BuildKimiTokenizer(1024, 4096);
  ASSERT_TRUE(built.ok()) << built.status();
  std::unique_ptr<Tokenizer> t =
      MustLoadTiktoken(built->tiktoken_model, built->tokenizer_config_json);
  ASSERT_NE(t, nullptr);
  const std::string plain = PlainText(kMiB);
  const struct {
    const char* name;
    std::string text;
  } inputs[] = {
      {"plain text", plain},
      {"digits", RepeatTo("1234567890", kMiB)},
      {"spaces", RepeatTo(" ", kMiB)},
      {"spaces then a letter", RepeatTo(" ", kMiB - 1) + "x"},
      {"newlines and spaces", RepeatTo(" \n ", kMiB)},
      {"upper case", RepeatTo("A", kMiB)},
      {"lower case", RepeatTo("a", kMiB)},
      {"alternating case", RepeatTo("aA", kMiB)},
      {"mark then upper case", "\u0301" + RepeatTo("A", kMiB - 2)},
      {"marks and upper case", RepeatTo("\u0301A", kMiB)},
      {"space mark upper", RepeatTo(" \u0301AB", kMiB)},
      {"upper then Lo", RepeatTo("AAAAAAA\u00aa", kMiB)},
      {"Lo then upper", RepeatTo("\u00aaAAAAAAA", kMiB)},
      {"Lt and Lm", RepeatTo("\u01c5\u02b0", kMiB)},
      {"marks alone", RepeatTo("\u0301\u0302", kMiB)},
      {"combining marks", "e" + RepeatTo("\u0301", kMiB - 1)},
      {"contractions", RepeatTo("A'S", kMiB)},
      {"apostrophes", RepeatTo("'", kMiB)},
      {"punctuation and marks", RepeatTo("!\u0301", kMiB)},
      {"han", RepeatTo("中々〇⺀", kMiB)},
      {"han and latin", RepeatTo("中a", kMiB)},
      {"hangul", RepeatTo("가", kMiB)},
      {"emoji", RepeatTo("\U0001F600", kMiB)},
      {"unicode 16 garay", RepeatTo("\U00010D50\U00010D70", kMiB)},
      {"invalid utf-8", RepeatTo("\xff", kMiB)},
      {"special token prefixes", RepeatTo("<|reserved_token_", kMiB)},
  };
  const Work base = MeasureEncode(*t, plain, /*parse_special=*/true);
  for (const auto& input : inputs) {
    SCOPED_TRACE(input.name);
    const double bytes = static_cast<double>(input.text.size());
    ASSERT_GE(bytes, kMiB - 64);
    const Work w = MeasureEncode(*t, input.text, /*parse_special=*/true);
    EXPECT_LE(w.counts.scan_steps, 12 * bytes);
    EXPECT_LE(w.counts.bpe_heap_ops, 6 * bytes);
    EXPECT_LE(w.counts.added_steps, 25 * bytes);
    std::printf(
        "kimi %-24s %8zu tokens  scan %5.2f/B  heap %4.2f/B  added %5.2f/B  %7.3f s = "
        "%5.2f x plain text\n",
        input.name, w.tokens, w.counts.scan_steps / bytes, w.counts.bpe_heap_ops / bytes,
        w.counts.added_steps / bytes, w.seconds, w.seconds / base.seconds);
  }
}

TEST(TokenizerLinearityTest, LongDigitRunsEncodeAsTheirGroupsOfThree) {
  const Tokenizer& t = BuiltTokenizer1024();
  // 30 digits are 10 whole groups of 3, so the encoding of the repeated run is the encoding of one
  // period repeated.
  const std::string period = "123456789012345678901234567890";
  const std::vector<int32_t> one = t.Encode(period, false);
  const std::string run = RepeatTo(period, kMiB);
  const std::vector<int32_t> ids = t.Encode(run, false);
  ASSERT_EQ(ids.size(), one.size() * (run.size() / period.size()));
  for (size_t i = 0; i < ids.size(); ++i) ASSERT_EQ(ids[i], one[i % one.size()]) << i;
  const std::vector<std::string> pieces = Pieces(RepeatTo("9", 3002));
  ASSERT_EQ(pieces.size(), 1001u);
  EXPECT_EQ(pieces.back(), "99");
}

TEST(TokenizerLinearityTest, EncodeWithinStopsAtTheLimit) {
  const Tokenizer& t = BuiltTokenizer1024();
  const std::string text = PlainText(4096);
  const std::vector<int32_t> all = t.Encode(text, /*add_bos=*/true);
  ASSERT_GT(all.size(), 100u);
  std::optional<std::vector<int32_t>> within = t.EncodeWithin(text, true, true, all.size());
  ASSERT_TRUE(within.has_value());
  EXPECT_EQ(*within, all);
  EXPECT_FALSE(t.EncodeWithin(text, true, true, all.size() - 1).has_value());
  EXPECT_FALSE(t.EncodeWithin("a", /*add_bos=*/true, true, 0).has_value());  // BOS counts
  EXPECT_EQ(t.EncodeWithin("", false, true, 0), std::vector<int32_t>());
  // Over-long inputs stop early: plain text after the piece that passes the limit; one huge piece
  // before its BPE (its bytes alone imply too many tokens).
  for (const std::string& big : {PlainText(kMiB), RepeatTo("abcdefgh", kMiB)}) {
    internal::ThreadTokenizerWork() = {};
    EXPECT_FALSE(t.EncodeWithin(big, true, false, 100).has_value());
    EXPECT_LT(internal::ThreadTokenizerWork().bpe_heap_ops, 100u * 6 * 16);
  }
}

}  // namespace
}  // namespace hmoe
