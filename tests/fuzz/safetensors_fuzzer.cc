// libFuzzer target: a safetensors file image (8-byte header length, JSON header, data) through
// SafetensorsFile::FromBytes. Every accepted tensor's view must lie inside the image: its first and
// last bytes are read (ASan reports an out-of-bounds view).
#include <cstddef>
#include <cstdint>
#include <span>

#include "common/model/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
  auto file = hmoe::SafetensorsFile::FromBytes("fuzz.safetensors", bytes);
  if (!file.ok()) return 0;
  volatile uint8_t sink = 0;
  for (const auto& [name, entry] : (*file)->entries()) {
    const auto* p = reinterpret_cast<const uint8_t*>(entry.view.data);
    if (entry.view.size_bytes > 0) sink = sink ^ p[0] ^ p[entry.view.size_bytes - 1];
    if (entry.file_offset + entry.view.size_bytes > size) __builtin_trap();
  }
  (void)sink;
  return 0;
}
