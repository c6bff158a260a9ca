#pragma once

// Names and paths of one weightd instance. Everything an instance owns is derived from its name:
//   control segment  /dev/shm/hmoe.<instance>.control   (POSIX shm, Boost.Interprocess, 0600)
//   data segments    SysV shm ids recorded in the control segment (0600 while loading, 0400 sealed)
//   lock file        <runtime dir>/weightd.<instance>.lock  (flock; holds the owner's pid)
//   gRPC socket      <runtime dir>/weightd.<instance>.sock
// The runtime dir is $HMOE_RUNTIME_DIR, else /tmp/hmoe-<uid>; it is created 0700 and must be owned
// by the caller (anything else is PermissionDenied: another user could swap the socket).

#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace hmoe::shm {

// Instance names match [A-Za-z0-9_-]{1,48}. InvalidArgument naming the problem otherwise.
absl::Status ValidateInstanceName(std::string_view instance);

// "hmoe.<instance>.control" (a POSIX shm name; the file lives in /dev/shm).
std::string ControlSegmentName(std::string_view instance);

// $HMOE_RUNTIME_DIR or /tmp/hmoe-<euid>. Pure: does not touch the file system.
std::string RuntimeDir();

// Creates RuntimeDir() with mode 0700 when missing; PermissionDenied when it exists but is owned
// by another user or is accessible to group/others.
absl::StatusOr<std::string> EnsureRuntimeDir();

std::string LockFilePath(std::string_view instance);
std::string DefaultSocketPath(std::string_view instance);

}  // namespace hmoe::shm
