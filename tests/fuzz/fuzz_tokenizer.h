#pragma once

// A small DeepSeek-V3-style tokenizer.json for the fuzz targets (not the builder's: fuzz targets
// link only the parsers): the 256 byte tokens, a few merges, DeepSeek-V3's pre-tokenizer and three
// added tokens, one of them with lstrip/rstrip.

#include <string>

#include "common/model/tokenizer.h"
#include "common/model/tokenizer_internal.h"

namespace hmoe::fuzz {

inline std::string JsonString(std::string_view s) {
  std::string out = "\"";
  for (char c : s) {
    const auto b = static_cast<unsigned char>(c);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (b < 0x20) {
      static const char kHex[] = "0123456789abcdef";
      out += "\\u00";
      out += kHex[b >> 4];
      out += kHex[b & 15];
    } else {
      out += c;
    }
  }
  return out + "\"";
}

inline std::string FuzzTokenizerJson() {
  std::string vocab;
  int id = 0;
  for (int b = 0; b < 256; ++b) {
    std::string ch;
    internal::AppendUtf8(internal::ByteToCodePoint(static_cast<uint8_t>(b)), &ch);
    vocab += (b > 0 ? "," : "") + JsonString(ch) + ":" + std::to_string(id);
    ++id;
  }
  const char* const merges[][2] = {{"t", "h"},  {"th", "e"}, {"Ġ", "the"}, {"1", "2"},
                                   {"12", "3"}, {"Ġ", "Ġ"},  {"ĠĠ", "ĠĠ"}, {"e", "r"}};
  std::string merges_json;
  for (const auto& m : merges) {
    vocab += "," + JsonString(std::string(m[0]) + m[1]) + ":" + std::to_string(id);
    ++id;
    merges_json += (merges_json.empty() ? "" : ",") + JsonString(std::string(m[0]) + " " + m[1]);
  }
  std::string split_steps;
  for (internal::SplitRule rule : internal::DeepSeekV3Rules()) {
    split_steps += R"({"type":"Split","pattern":{"Regex":)" +
                   JsonString(internal::SplitRuleRegex(rule)) +
                   R"(},"behavior":"Isolated","invert":false},)";
  }
  const std::string added =
      R"([{"id":)" + std::to_string(id) +
      R"(,"content":"<｜begin▁of▁sentence｜>","special":true},)" + R"({"id":)" +
      std::to_string(id + 1) +
      R"(,"content":"<｜User｜>","special":true,"lstrip":true,"rstrip":true},)" + R"({"id":)" +
      std::to_string(id + 2) + R"(,"content":"<｜Us","special":false}])";
  return R"({"version":"1.0","added_tokens":)" + added +
         R"(,"normalizer":null,"pre_tokenizer":{"type":"Sequence","pretokenizers":[)" +
         split_steps +
         R"({"type":"ByteLevel","add_prefix_space":false,"trim_offsets":false,"use_regex":false}]},)" +
         R"("decoder":{"type":"ByteLevel"},"model":{"type":"BPE","vocab":{)" + vocab +
         R"(},"merges":[)" + merges_json + "]}}";
}

inline std::string FuzzTokenizerConfigJson() {
  return R"({"add_bos_token":true,"bos_token":"<｜begin▁of▁sentence｜>","model_max_length":64})";
}

}  // namespace hmoe::fuzz
