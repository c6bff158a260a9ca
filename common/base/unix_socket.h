#pragma once

// Taking over a unix socket path safely. A server about to bind a unix socket finds a file at its
// path either because a previous server did not clean up (stale: nothing accepts on it) or
// because a server is running there now. gRPC unlinks whatever is at the path before it binds, so
// without a check a second process on the same path silently steals it from the first (whose
// clients then reach the newcomer, and whose exit later unlinks the newcomer's socket).

#include <string>

#include "absl/status/status.h"

namespace hmoe {

// Prepares `path` for a server to bind: OK when nothing is there, or when a socket file is there
// that refuses connections (stale; it is removed). FailedPrecondition, naming the path, when a
// server accepts connections on it (connect() succeeds): the caller must not start. InvalidArgument
// when the path is something other than a socket; the errno status of a failed probe otherwise.
// `flag` names the flag the path came from in messages (e.g. "--socket").
absl::Status ClaimUnixSocketPath(const std::string& path, const std::string& flag);

}  // namespace hmoe
