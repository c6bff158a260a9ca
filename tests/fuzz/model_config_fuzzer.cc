// libFuzzer target: config.json text through ModelConfig::FromJson (which validates).
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "common/model/model_config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto config =
      hmoe::ModelConfig::FromJson(std::string_view(reinterpret_cast<const char*>(data), size));
  if (config.ok() && !config->Validate().ok()) __builtin_trap();  // FromJson validated it
  return 0;
}
