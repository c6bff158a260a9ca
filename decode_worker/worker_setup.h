#pragma once

// Start-up helpers of hmoe-decode-worker that main.cc uses and tests check without a process:
// flag values to typed settings, and the owner-only socket directory.

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#include "common/device/device.h"

namespace hmoe::decode {

struct DeviceSpec {
  DeviceKind kind = DeviceKind::kCpu;
  int ordinal = 0;  // kCuda
};

// "cpu" or "cuda:N" (N >= 0). InvalidArgument naming the flag otherwise.
absl::StatusOr<DeviceSpec> ParseDeviceFlag(const std::string& value);

// "on"/"off" (also true/false, 1/0). InvalidArgument naming `flag` otherwise.
absl::StatusOr<bool> ParseOnOff(const std::string& flag, const std::string& value);

// --dual-batch: "on", "off", or "auto" = on exactly when the attention device is a GPU. On a
// CPU-only node attention and experts share the same cores, so the two micro-batches cannot
// overlap, and each reads its own experts: measured slower (docs/PERFORMANCE.md).
absl::StatusOr<bool> ResolveDualBatch(const std::string& value, DeviceKind attention_device);

// The KV pool size in blocks: `kv_blocks` when > 0, else as many blocks of `block_bytes` as fit
// in `kv_memory_mb` MiB. InvalidArgument when both are given, when neither is, or when the
// memory holds no block.
absl::StatusOr<int64_t> ResolveKvBlocks(int64_t kv_blocks, int64_t kv_memory_mb,
                                        size_t block_bytes);

// Makes sure the unix socket `path` can be served safely: absolute, short enough for
// sockaddr_un, its parent directory created 0700 when missing and otherwise owned by this user
// and not accessible to group/others (PermissionDenied: another user could swap the socket).
// Removes a stale socket file at `path`. InvalidArgument for a bad path.
absl::Status PrepareSocketPath(const std::string& path);

}  // namespace hmoe::decode
