// libFuzzer target: weightd's binary shm manifest through Manifest::Parse. An accepted manifest
// must serialize back to bytes that parse to the same manifest.
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "common/shm/manifest.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using hmoe::shm::Manifest;
  auto m =
      Manifest::Parse(std::span<const std::byte>(reinterpret_cast<const std::byte*>(data), size));
  if (!m.ok()) return 0;
  const std::string again = m->Serialize();
  auto m2 = Manifest::Parse(
      std::span<const std::byte>(reinterpret_cast<const std::byte*>(again.data()), again.size()));
  if (!m2.ok() || !(*m2 == *m)) __builtin_trap();
  for (const auto& t : m->tensors) {
    if (m->Find(t.name) == nullptr) __builtin_trap();
  }
  return 0;
}
