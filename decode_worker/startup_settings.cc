#include "decode_worker/startup_settings.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace hmoe::decode {

absl::StatusOr<bool> ResolveDualBatch(const std::string& value, DeviceKind attention_device) {
  if (value == "auto") return attention_device == DeviceKind::kCuda;
  absl::StatusOr<bool> on = ParseOnOff("dual-batch", value);
  if (!on.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--dual-batch: \"", value, "\" is not on, off or auto"));
  }
  return on;
}

absl::StatusOr<int64_t> ResolveKvBlocks(int64_t kv_blocks, int64_t kv_memory_mb,
                                        size_t block_bytes) {
  if (kv_blocks < 0 || kv_memory_mb < 0) {
    return absl::InvalidArgumentError("--kv-blocks and --kv-memory-mb must not be negative");
  }
  if (kv_blocks > 0 && kv_memory_mb > 0) {
    return absl::InvalidArgumentError("give --kv-blocks or --kv-memory-mb, not both");
  }
  if (kv_blocks > 0) return kv_blocks;
  if (kv_memory_mb == 0) {
    return absl::InvalidArgumentError("--kv-blocks or --kv-memory-mb must be > 0");
  }
  const auto blocks = static_cast<int64_t>((static_cast<uint64_t>(kv_memory_mb) << 20) /
                                           std::max<size_t>(block_bytes, 1));
  if (blocks < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--kv-memory-mb ", kv_memory_mb, " holds no KV block of ", block_bytes, " bytes"));
  }
  return blocks;
}

absl::StatusOr<int64_t> ResolvePrefixCacheBlocks(int64_t prefix_cache_mb, int64_t pool_blocks,
                                                 size_t block_bytes) {
  if (prefix_cache_mb < -1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--prefix-cache-mb ", prefix_cache_mb, " must be -1 (the whole KV pool), 0 (off) or > 0"));
  }
  if (prefix_cache_mb == -1) return pool_blocks;
  if (prefix_cache_mb == 0) return 0;
  const auto blocks = static_cast<int64_t>((static_cast<uint64_t>(prefix_cache_mb) << 20) /
                                           std::max<size_t>(block_bytes, 1));
  if (blocks < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--prefix-cache-mb ", prefix_cache_mb, " holds no KV block of ", block_bytes, " bytes"));
  }
  return std::min(blocks, pool_blocks);
}

}  // namespace hmoe::decode
