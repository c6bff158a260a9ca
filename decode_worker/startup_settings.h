#pragma once

// Start-up helpers of hmoe-decode-worker that main.cc uses and tests check without a process:
// flag values to typed settings (the helpers both workers share live in common/process,
// common/device/device_flag.h and common/base/flags.h).

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#include "common/base/flags.h"
#include "common/device/device.h"
#include "common/device/device_flag.h"

namespace hmoe::decode {

// --dual-batch: "on", "off", or "auto" = on exactly when the attention device is a GPU. On a
// CPU-only node attention and experts share the same cores, so the two micro-batches cannot
// overlap, and each reads its own experts: measured slower (docs/PERFORMANCE.md).
absl::StatusOr<bool> ResolveDualBatch(const std::string& value, DeviceKind attention_device);

// The KV pool size in blocks: `kv_blocks` when > 0, else as many blocks of `block_bytes` as fit
// in `kv_memory_mb` MiB. InvalidArgument when both are given, when neither is, or when the
// memory holds no block.
absl::StatusOr<int64_t> ResolveKvBlocks(int64_t kv_blocks, int64_t kv_memory_mb,
                                        size_t block_bytes);

// The prefix cache's budget in blocks of `block_bytes` (--prefix-cache-mb): -1 the whole pool of
// `pool_blocks`, 0 off, else as many blocks as fit in prefix_cache_mb MiB, at most the pool.
// InvalidArgument below -1 or for a budget that holds no block.
absl::StatusOr<int64_t> ResolvePrefixCacheBlocks(int64_t prefix_cache_mb, int64_t pool_blocks,
                                                 size_t block_bytes);

}  // namespace hmoe::decode
