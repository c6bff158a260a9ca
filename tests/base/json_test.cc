#include "common/base/json.h"

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace hmoe::json {
namespace {

using ::testing::HasSubstr;

absl::Status ParseError(std::string_view text, const ParseOptions& options = {}) {
  absl::StatusOr<Value> v = Parse(text, options);
  if (v.ok()) return absl::OkStatus();
  return v.status();
}

TEST(JsonParseTest, Scalars) {
  EXPECT_TRUE(Parse("null")->is_null());
  EXPECT_TRUE(Parse("true")->as_bool());
  EXPECT_FALSE(Parse("false")->as_bool());
  EXPECT_EQ(Parse("\"hi\"")->as_string(), "hi");
  EXPECT_EQ(Parse(" \t\r\n42 \n")->as_int(), 42);
}

TEST(JsonParseTest, IntegersAreExactAndFlagged) {
  EXPECT_TRUE(Parse("0")->is_integer());
  EXPECT_EQ(Parse("-0")->as_int(), 0);
  EXPECT_EQ(Parse("-17")->as_int(), -17);
  EXPECT_EQ(Parse("9223372036854775807")->as_int(), std::numeric_limits<int64_t>::max());
  EXPECT_EQ(Parse("-9223372036854775808")->as_int(), std::numeric_limits<int64_t>::min());
  // Exact where a double would not be: 2^53 + 1.
  EXPECT_EQ(Parse("9007199254740993")->as_int(), int64_t{9007199254740993});
  // Beyond int64: still a number, no longer an integer.
  absl::StatusOr<Value> big = Parse("9223372036854775808");
  ASSERT_TRUE(big.ok());
  EXPECT_TRUE(big->is_number());
  EXPECT_FALSE(big->is_integer());
  EXPECT_DOUBLE_EQ(big->as_double(), 9223372036854775808.0);
}

TEST(JsonParseTest, FractionsAndExponentsAreNotIntegers) {
  for (const char* text : {"1.0", "1e2", "1E2", "-2.5", "0.5e-3", "1e+2"}) {
    absl::StatusOr<Value> v = Parse(text);
    ASSERT_TRUE(v.ok()) << text;
    EXPECT_TRUE(v->is_number()) << text;
    EXPECT_FALSE(v->is_integer()) << text;
  }
  EXPECT_DOUBLE_EQ(Parse("1e2")->as_double(), 100.0);
  EXPECT_DOUBLE_EQ(Parse("-2.5")->as_double(), -2.5);
  EXPECT_DOUBLE_EQ(Parse("0.5e-3")->as_double(), 0.0005);
  EXPECT_EQ(Parse("1e-400")->as_double(), 0.0);  // underflow is harmless
}

TEST(JsonParseTest, RejectsMalformedNumbers) {
  for (const char* text : {"01", "-", "1.", ".5", "+1", "1e", "1e+", "0x10", "NaN", "Infinity",
                           "-Infinity", "1.e5", "--1", "- 1"}) {
    EXPECT_TRUE(absl::IsInvalidArgument(ParseError(text))) << text;
  }
}

TEST(JsonParseTest, RejectsNumbersOutOfDoubleRange) {
  EXPECT_THAT(ParseError("1e400").message(), HasSubstr("out of range"));
  EXPECT_THAT(ParseError("[-1e400]").message(), HasSubstr("out of range"));
}

TEST(JsonParseTest, StringEscapes) {
  EXPECT_EQ(Parse(R"("\"\\\/\b\f\n\r\t")")->as_string(), "\"\\/\b\f\n\r\t");
  EXPECT_EQ(Parse(R"("\u0041\u00e9\u20AC")")->as_string(), "A\xC3\xA9\xE2\x82\xAC");
  EXPECT_EQ(Parse(R"("\u0000")")->as_string(), std::string(1, '\0'));
}

TEST(JsonParseTest, SurrogatePairsBecomeOneUtf8CodePoint) {
  // U+1F600 and U+10FFFF (the largest code point).
  EXPECT_EQ(Parse(R"("\uD83D\uDE00")")->as_string(), "\xF0\x9F\x98\x80");
  EXPECT_EQ(Parse(R"("\udbff\udfff")")->as_string(), "\xF4\x8F\xBF\xBF");
  EXPECT_EQ(Parse(R"("\uD800\uDC00")")->as_string(), "\xF0\x90\x80\x80");
}

TEST(JsonParseTest, RejectsUnpairedSurrogates) {
  EXPECT_THAT(ParseError(R"("\uD800")").message(), HasSubstr("unpaired high surrogate"));
  EXPECT_THAT(ParseError(R"("\uD800x")").message(), HasSubstr("unpaired high surrogate"));
  EXPECT_THAT(ParseError(R"("\uDC00")").message(), HasSubstr("unpaired low surrogate"));
  EXPECT_THAT(ParseError(R"("\uD800\u0041")").message(), HasSubstr("not followed by a low"));
  EXPECT_THAT(ParseError(R"("\uD800\uD800")").message(), HasSubstr("not followed by a low"));
}

TEST(JsonParseTest, RejectsBadEscapes) {
  EXPECT_THAT(ParseError(R"("\x41")").message(), HasSubstr("invalid escape"));
  EXPECT_THAT(ParseError(R"("\u12G4")").message(), HasSubstr("invalid hex digit"));
  EXPECT_THAT(ParseError(R"("\u12")").message(), HasSubstr("\\u escape"));
  EXPECT_THAT(ParseError("\"abc\\").message(), HasSubstr("unterminated string"));
}

TEST(JsonParseTest, RejectsRawControlCharacters) {
  EXPECT_THAT(ParseError("\"a\nb\"").message(), HasSubstr("control character"));
  EXPECT_THAT(ParseError(std::string("\"a\0b\"", 5)).message(), HasSubstr("control character"));
}

TEST(JsonParseTest, Utf8PassesThroughAndIsValidated) {
  EXPECT_EQ(Parse("\"caf\xC3\xA9 \xF0\x9F\x98\x80\"")->as_string(), "caf\xC3\xA9 \xF0\x9F\x98\x80");
  EXPECT_THAT(ParseError("\"\xFF\"").message(), HasSubstr("invalid UTF-8"));
  EXPECT_THAT(ParseError("\"\xC0\x80\"").message(), HasSubstr("invalid UTF-8"));  // overlong
  EXPECT_THAT(ParseError("\"\xE0\x80\x80\"").message(), HasSubstr("overlong"));   // overlong
  EXPECT_THAT(ParseError("\"\xED\xA0\x80\"").message(), HasSubstr("surrogate"));  // U+D800
  EXPECT_THAT(ParseError("\"\xF4\x90\x80\x80\"").message(), HasSubstr("out-of-range"));
  EXPECT_THAT(ParseError("\"\xE2\x82\"").message(), HasSubstr("UTF-8"));  // truncated
  EXPECT_THAT(ParseError("\"\xE2\x28\xA1\"").message(), HasSubstr("invalid UTF-8"));
}

TEST(JsonParseTest, ObjectsKeepOrderAndFindKeys) {
  absl::StatusOr<Value> v = Parse(R"({"b": 1, "a": [true, null], "c": {"d": "e"}})");
  ASSERT_TRUE(v.ok()) << v.status();
  ASSERT_EQ(v->members().size(), 3u);
  EXPECT_EQ(v->members()[0].first, "b");
  EXPECT_EQ(v->members()[1].first, "a");
  EXPECT_EQ(v->members()[2].first, "c");
  EXPECT_EQ(v->Find("b")->as_int(), 1);
  EXPECT_EQ(v->Find("a")->items().size(), 2u);
  EXPECT_EQ(v->Find("c")->Find("d")->as_string(), "e");
  EXPECT_EQ(v->Find("zz"), nullptr);
  EXPECT_EQ(v->Find("b")->Find("b"), nullptr);  // not an object
  EXPECT_TRUE(Parse("{}")->members().empty());
  EXPECT_TRUE(Parse("[ ]")->items().empty());
}

TEST(JsonParseTest, RejectsDuplicateKeysWithOffset) {
  const absl::Status s = ParseError(R"({"a": 1, "a": 2})");
  EXPECT_TRUE(absl::IsInvalidArgument(s));
  EXPECT_THAT(s.message(), HasSubstr("duplicate key \"a\""));
  EXPECT_THAT(s.message(), HasSubstr("at byte 9"));
}

TEST(JsonParseTest, RejectsDuplicateKeysInLargeObjects) {
  std::string text = "{";
  for (int i = 0; i < 100; ++i)
    text += "\"k" + std::to_string(i) + "\": " + std::to_string(i) + ",";
  std::string ok = text + "\"last\": 0}";
  EXPECT_TRUE(Parse(ok).ok());
  EXPECT_THAT(ParseError(text + "\"k7\": 0}").message(), HasSubstr("duplicate key \"k7\""));
  // Keys equal after unescaping are duplicates too.
  EXPECT_THAT(ParseError(R"({"a": 1, "\u0061": 2})").message(), HasSubstr("duplicate key"));
}

TEST(JsonParseTest, ErrorsNameTheByteOffset) {
  EXPECT_THAT(ParseError(R"({"a": tru})").message(), HasSubstr("at byte 6"));
  EXPECT_THAT(ParseError("[1, 2,, 3]").message(), HasSubstr("at byte 6"));
  EXPECT_THAT(ParseError("[1 2]").message(), HasSubstr("at byte 3"));
}

TEST(JsonParseTest, RejectsStructuralErrors) {
  for (const char* text : {"", "   ", "[1,]", "{\"a\":1,}", "{\"a\" 1}", "{a: 1}", "[1", "{\"a\":1",
                           "}", "]", "1 2", "nul", "truex", "[1]]", "{'a': 1}", "\"abc"}) {
    EXPECT_TRUE(absl::IsInvalidArgument(ParseError(text))) << "'" << text << "'";
  }
  EXPECT_THAT(ParseError("1 2").message(), HasSubstr("after the JSON value"));
}

TEST(JsonParseTest, DepthLimit) {
  auto nested = [](int depth) { return std::string(depth, '[') + std::string(depth, ']'); };
  EXPECT_TRUE(Parse(nested(64)).ok());
  EXPECT_THAT(ParseError(nested(65)).message(), HasSubstr("nesting too deep"));
  ParseOptions options;
  options.max_depth = 3;
  EXPECT_TRUE(Parse(R"({"a": {"b": [1]}})", options).ok());
  EXPECT_THAT(ParseError(R"({"a": {"b": [[1]]}})", options).message(), HasSubstr("too deep"));
  // Deep input far beyond the limit fails cleanly (no stack overflow).
  EXPECT_THAT(ParseError(std::string(1000000, '[')).message(), HasSubstr("nesting too deep"));
}

TEST(JsonParseTest, SizeLimit) {
  ParseOptions options;
  options.max_bytes = 8;
  EXPECT_TRUE(Parse("[1,2,3]", options).ok());
  EXPECT_THAT(ParseError("[1,2,3,4]", options).message(), HasSubstr("exceeds the limit"));
}

TEST(JsonParseTest, RandomCorruptionNeverCrashes) {
  const std::string valid =
      R"({"a": [1, -2.5e3, true, null, "x\u00e9\ud83d\ude00"], "b": {"c": {"d": []}}, "e": "f"})";
  ASSERT_TRUE(Parse(valid).ok());
  std::mt19937 rng(5);
  for (int iter = 0; iter < 20000; ++iter) {
    std::string text = valid;
    const int flips = 1 + static_cast<int>(rng() % 3);
    for (int k = 0; k < flips; ++k) text[rng() % text.size()] = static_cast<char>(rng() & 0xff);
    if (rng() % 4 == 0) text.resize(rng() % text.size());
    const absl::StatusOr<Value> v = Parse(text);
    if (!v.ok()) {
      ASSERT_TRUE(absl::IsInvalidArgument(v.status()));
      continue;
    }
    // Whatever parses re-serializes to something that parses to the same text again.
    const std::string out = Serialize(*v);
    ASSERT_EQ(Serialize(*Parse(out)), out);
  }
}

TEST(JsonSerializeTest, CompactAndPretty) {
  Value v = Value::Object();
  v.Set("a", Value::Integer(1));
  v.Set("b", Value::Array({Value::Bool(true), Value::Null(), Value::String("x")}));
  v.Set("c", Value::Object());
  v.Set("d", Value::Array());
  EXPECT_EQ(Serialize(v), R"({"a":1,"b":[true,null,"x"],"c":{},"d":[]})");
  EXPECT_EQ(Serialize(v, 2),
            "{\n  \"a\": 1,\n  \"b\": [\n    true,\n    null,\n    \"x\"\n  ],\n  \"c\": {},\n"
            "  \"d\": []\n}");
  // Set() replaces in place, keeping the position.
  v.Set("a", Value::String("y"));
  EXPECT_EQ(Serialize(v), R"({"a":"y","b":[true,null,"x"],"c":{},"d":[]})");
}

TEST(JsonSerializeTest, DoublesStayDoublesAndRoundTrip) {
  EXPECT_EQ(Serialize(Value::Number(2.0)), "2.0");
  EXPECT_EQ(Serialize(Value::Number(0.1)), "0.1");
  EXPECT_EQ(Serialize(Value::Number(1e-06)), "1e-06");
  EXPECT_EQ(Serialize(Value::Number(-0.0)), "-0.0");
  EXPECT_EQ(Serialize(Value::Number(std::numeric_limits<double>::infinity())), "null");
  std::mt19937_64 rng(7);
  for (int i = 0; i < 20000; ++i) {
    const double d = std::bit_cast<double>(rng());
    if (!std::isfinite(d)) continue;
    const std::string text = Serialize(Value::Number(d));
    absl::StatusOr<Value> back = Parse(text);
    ASSERT_TRUE(back.ok()) << text << ": " << back.status();
    EXPECT_EQ(std::bit_cast<uint64_t>(back->as_double()), std::bit_cast<uint64_t>(d)) << text;
  }
}

TEST(JsonSerializeTest, IntegersRoundTripExactly) {
  for (int64_t i : {int64_t{0}, int64_t{-1}, int64_t{9007199254740993},
                    std::numeric_limits<int64_t>::max(), std::numeric_limits<int64_t>::min()}) {
    const std::string text = Serialize(Value::Integer(i));
    EXPECT_EQ(text, std::to_string(i));
    EXPECT_EQ(Parse(text)->as_int(), i);
  }
}

TEST(JsonSerializeTest, StringsAreEscapedAndRoundTrip) {
  EXPECT_EQ(Serialize(Value::String("a\"b\\c\n\x01")), R"("a\"b\\c\n\u0001")");
  std::string all;
  for (int c = 1; c < 128; ++c) all.push_back(static_cast<char>(c));
  all += "\xC3\xA9\xF0\x9F\x98\x80";
  all.push_back('\0');
  EXPECT_EQ(Parse(Serialize(Value::String(all)))->as_string(), all);
}

TEST(JsonSerializeTest, DocumentRoundTrip) {
  const std::string text =
      R"({"name":"x","dims":[1,2,3],"eps":1e-06,"nested":{"ok":true,"none":null},"neg":-5})";
  absl::StatusOr<Value> v = Parse(text);
  ASSERT_TRUE(v.ok());
  EXPECT_EQ(Serialize(*v), text);
  EXPECT_EQ(Serialize(*Parse(Serialize(*v, 4))), text);
}

TEST(JsonValueTest, TypeNames) {
  EXPECT_STREQ(TypeName(Type::kNull), "null");
  EXPECT_STREQ(TypeName(Type::kBool), "bool");
  EXPECT_STREQ(TypeName(Type::kNumber), "number");
  EXPECT_STREQ(TypeName(Type::kString), "string");
  EXPECT_STREQ(TypeName(Type::kArray), "array");
  EXPECT_STREQ(TypeName(Type::kObject), "object");
}

TEST(JsonValueTest, AppendBuildsArrays) {
  Value a = Value::Array();
  a.Append(Value::Integer(1));
  a.Append(Value::Number(1.5));
  EXPECT_EQ(Serialize(a), "[1,1.5]");
}

TEST(JsonValueDeathTest, WrongAccessorAborts) {
  EXPECT_DEATH(Value::String("x").as_int(), "check failed");
}

}  // namespace
}  // namespace hmoe::json
