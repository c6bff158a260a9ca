#pragma once

// Start-up helpers shared by the worker processes (hmoe-prefill-worker, hmoe-decode-worker):
// the --device flag, on/off flags, dashed flag names, and the owner-only unix socket directory.

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#include "common/device/device.h"

namespace hmoe::rpc {

struct DeviceSpec {
  DeviceKind kind = DeviceKind::kCpu;
  int ordinal = 0;  // kCuda
};

// "cpu" or "cuda:N" (N >= 0). InvalidArgument naming the flag otherwise.
absl::StatusOr<DeviceSpec> ParseDeviceFlag(const std::string& value);

// "on"/"off" (also true/false, 1/0). InvalidArgument naming `flag` otherwise.
absl::StatusOr<bool> ParseOnOff(const std::string& flag, const std::string& value);

// absl flags are spelled with underscores; returns argv with "--batch-size" style names turned
// into "--batch_size" (values and everything after "--" untouched). `storage` owns the strings.
std::vector<char*> NormalizeFlagNames(int argc, char** argv, std::vector<std::string>& storage);

// Makes sure the unix socket `path` can be served safely: absolute, short enough for
// sockaddr_un, its parent directory created 0700 when missing and otherwise owned by this user
// and not accessible to group/others (PermissionDenied: another user could swap the socket).
// Removes a stale socket file at `path`. InvalidArgument for a bad path.
absl::Status PrepareSocketPath(const std::string& path);

}  // namespace hmoe::rpc
