// libFuzzer target: tokenizer.json and tokenizer_config.json through Tokenizer::FromJson. The input
// is tokenizer.json, or tokenizer.json + "\n---\n" + tokenizer_config.json. A loaded tokenizer
// encodes and decodes a fixed text.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "common/model/tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view input(reinterpret_cast<const char*>(data), size);
  std::string_view config;
  if (const size_t sep = input.find("\n---\n"); sep != std::string_view::npos) {
    config = input.substr(sep + 5);
    input = input.substr(0, sep);
  }
  auto tokenizer = hmoe::Tokenizer::FromJson(input, config);
  if (!tokenizer.ok()) return 0;
  const std::vector<int32_t> ids =
      (*tokenizer)->Encode("Hello, world! 12345 <｜User｜> 你好 e\u0301", /*add_bos=*/true);
  (void)(*tokenizer)->Decode(ids);
  return 0;
}
