#pragma once

// The unix-socket path checks every daemon shares: the path fits sockaddr_un, and the folder it
// lives in is private to this user (another user could otherwise swap the socket).

#include <string>
#include <string_view>

#include "absl/status/status.h"

namespace hmoe::process {

// sockaddr_un.sun_path holds 108 bytes including the terminating NUL.
inline constexpr size_t kMaxSocketPathBytes = 107;

// Makes sure `dir` (`what` names it in messages: "socket directory", "runtime dir") is a
// directory private to this user: created 0700 when missing; otherwise it must be a directory
// (not a link to one) owned by this user and not accessible to group or others. PermissionDenied
// naming the problem otherwise.
absl::Status EnsurePrivateDirectory(std::string_view what, const std::string& dir);

// Checks the syntax of the socket path given by `flag` (e.g. "--socket"): not empty, absolute,
// at most kMaxSocketPathBytes, not ending in '/'. InvalidArgument naming the flag otherwise
// (a FlagError: daemons exit 2).
absl::Status CheckSocketPath(std::string_view flag, const std::string& path);

// Makes sure the unix socket `path` (given by `flag`) can be served safely: CheckSocketPath, its
// parent directory private (EnsurePrivateDirectory: another user could swap the socket). Removes a
// stale socket file at `path`; FailedPrecondition when a running server accepts connections on it
// (ClaimUnixSocketPath: a second process never takes the path over); InvalidArgument, a FlagError,
// when `path` exists and is not a socket.
absl::Status PrepareSocketPath(std::string_view flag, const std::string& path);

}  // namespace hmoe::process
