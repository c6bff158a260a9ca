// libFuzzer target: Kimi-K2's tokenizer form (tiktoken.model + tokenizer_config.json) through
// Tokenizer::FromTiktoken. The input is tiktoken.model, or tiktoken.model + "\n---\n" +
// tokenizer_config.json. A loaded tokenizer encodes (Kimi's pre-tokenizer, rank merges, special
// tokens) and decodes a fixed text.
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
  auto tokenizer = hmoe::Tokenizer::FromTiktoken(input, config);
  if (!tokenizer.ok()) return 0;
  const std::vector<int32_t> ids =
      (*tokenizer)
          ->Encode("Hello, WORLD'S don't 12345 [BOS] <|im_end|> 你好々 e\u0301 \U0001FAE8",
                   /*add_bos=*/true);
  (void)(*tokenizer)->Decode(ids);
  return 0;
}
