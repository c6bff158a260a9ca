// libFuzzer target: arbitrary text through Encode/EncodeWithin/Decode/StreamDecoder of a fixed
// DeepSeek-V3-style tokenizer. Checks: with parse_special false, Decode(Encode(text)) is the text
// with ill-formed UTF-8 repaired (every byte has a token, so nothing is lost); EncodeWithin agrees
// with Encode; streaming decode equals Decode.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "tests/fuzz/fuzz_tokenizer.h"

namespace {

const hmoe::Tokenizer& Fixed() {
  static const hmoe::Tokenizer* const t =
      hmoe::Tokenizer::FromJson(hmoe::fuzz::FuzzTokenizerJson(),
                                hmoe::fuzz::FuzzTokenizerConfigJson())
          ->release();
  return *t;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const hmoe::Tokenizer& t = Fixed();
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  const std::vector<int32_t> plain = t.Encode(text, /*add_bos=*/false, /*parse_special=*/false);
  std::string repaired;
  hmoe::internal::AppendRepairedUtf8(text, /*hold_incomplete_tail=*/false, &repaired);
  if (t.Decode(plain) != repaired) __builtin_trap();

  const std::vector<int32_t> special = t.Encode(text, /*add_bos=*/true, /*parse_special=*/true);
  const auto within = t.EncodeWithin(text, true, true, special.size());
  if (!within.has_value() || *within != special) __builtin_trap();
  if (!special.empty() && t.EncodeWithin(text, true, true, special.size() - 1).has_value()) {
    __builtin_trap();
  }
  hmoe::Tokenizer::StreamDecoder stream = t.NewStreamDecoder();
  std::string streamed;
  for (int32_t id : special) streamed += stream.Push(id);
  streamed += stream.Flush();
  if (streamed != t.Decode(special)) __builtin_trap();
  return 0;
}
