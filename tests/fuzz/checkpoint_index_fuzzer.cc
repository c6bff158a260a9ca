// libFuzzer target: model.safetensors.index.json text through ParseCheckpointIndex. Accepted
// indexes name only plain file names, sorted and unique, and every tensor's shard is one of them.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "common/model/checkpoint.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto index =
      hmoe::ParseCheckpointIndex(std::string_view(reinterpret_cast<const char*>(data), size));
  if (!index.ok()) return 0;
  const auto& names = index->shard_names;
  if (!std::is_sorted(names.begin(), names.end()) ||
      std::adjacent_find(names.begin(), names.end()) != names.end()) {
    __builtin_trap();
  }
  for (const auto& name : names) {
    if (name.empty() || name == "." || name == ".." || name.find('/') != std::string::npos) {
      __builtin_trap();
    }
  }
  for (const auto& [tensor, shard] : index->shard_of) {
    if (shard >= names.size()) __builtin_trap();
  }
  return 0;
}
