// libFuzzer target: a GGUF file image through GgufFile::Parse and GgufModel::FromFiles. Every
// accepted tensor's data must lie inside the image (its first and last bytes are read: ASan reports
// an out-of-bounds view); each tensor of at most kMaxDequantElements is dequantized (an accepted
// one gives exactly num_elements values). Then the deepseek2 mapping: ModelConfigFromGguf (and,
// when it succeeds, ValidateGgufTensors), GgufUsesSplitKvB, TokenizerFromGguf (a loaded tokenizer
// encodes and decodes a fixed text) and GgufChatTemplate.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "common/model/gguf.h"
#include "common/model/gguf_model.h"

namespace {

// The dequantization budget per tensor (floats): 4 MiB of output at most.
constexpr int64_t kMaxDequantElements = int64_t{1} << 20;

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
  auto file = hmoe::GgufFile::Parse(bytes, "fuzz.gguf");
  if (!file.ok()) return 0;
  volatile uint8_t sink = 0;
  for (const hmoe::GgufTensorInfo& t : (*file)->tensors()) {
    if (t.size_bytes == 0) continue;
    const auto* p = reinterpret_cast<const uint8_t*>(t.data);
    if (p < data || p + t.size_bytes > data + size) __builtin_trap();
    sink = sink ^ p[0] ^ p[t.size_bytes - 1];
  }
  (void)sink;

  std::vector<std::unique_ptr<hmoe::GgufFile>> files;
  files.push_back(std::move(*file));
  auto model = hmoe::GgufModel::FromFiles(std::move(files));
  if (!model.ok()) return 0;
  for (const hmoe::GgufTensorInfo* t : (*model)->Tensors()) {
    if (t->num_elements > kMaxDequantElements) continue;
    auto values = (*model)->Dequantize(t->name);
    if (values.ok() && static_cast<int64_t>(values->size()) != t->num_elements) __builtin_trap();
  }

  auto config = hmoe::ModelConfigFromGguf(**model);
  if (config.ok()) (void)hmoe::ValidateGgufTensors(*config, **model);
  (void)hmoe::GgufUsesSplitKvB(**model);
  auto tokenizer = hmoe::TokenizerFromGguf(**model);
  if (tokenizer.ok()) {
    const std::vector<int32_t> ids = (*tokenizer)->Encode("Hello, world! 12345 你好", true);
    (void)(*tokenizer)->Decode(ids);
  }
  (void)hmoe::GgufChatTemplate(**model);
  return 0;
}
