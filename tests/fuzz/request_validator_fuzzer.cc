// libFuzzer target: a serialized hmoe.v1.GenerateRequest (as the router receives it) through
// ValidateGenerateRequest and ResolvePrompt, with and without a tokenizer. An accepted prompt fits
// the context and holds only ids in the vocabulary. The first input bytes also drive the pure
// flag checks (ValidateListenAddress, ResolveHeartbeatIntervalMs).
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>

#include "proto/hmoe_v1.pb.h"
#include "router/validation.h"
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
  if (size >= 8) {
    int32_t a = 0, b = 0;
    std::memcpy(&a, data, 4);
    std::memcpy(&b, data + 4, 4);
    auto interval = hmoe::router::ResolveHeartbeatIntervalMs(a, b);
    if (interval.ok() && (*interval < 1 || *interval > a)) __builtin_trap();
  }
  (void)hmoe::router::ValidateListenAddress(std::string(reinterpret_cast<const char*>(data), size));

  hmoe::v1::GenerateRequest request;
  if (!request.ParseFromArray(data, static_cast<int>(size))) return 0;
  const hmoe::Tokenizer& t = Fixed();
  const hmoe::router::ModelLimits limits{
      .vocab_size = t.vocab_size(), .context_length = 64, .max_request_bytes = 1 << 16};
  for (const hmoe::Tokenizer* tokenizer : {static_cast<const hmoe::Tokenizer*>(nullptr), &t}) {
    if (!hmoe::router::ValidateGenerateRequest(request, limits, tokenizer).ok()) continue;
    auto prompt = hmoe::router::ResolvePrompt(request, limits, tokenizer);
    if (!prompt.ok()) continue;
    if (prompt->empty() ||
        static_cast<int64_t>(prompt->size()) + request.max_new_tokens() > limits.context_length) {
      __builtin_trap();
    }
    for (int32_t id : *prompt) {
      if (id < 0 || id >= limits.vocab_size) __builtin_trap();
    }
  }
  return 0;
}
