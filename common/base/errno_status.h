#pragma once

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace hmoe {

// The status of a failed system call: "<what>: <strerror(err)>" with a code that says what the
// caller can do about it: NotFound (ENOENT, EIDRM), AlreadyExists (EEXIST), PermissionDenied
// (EACCES, EPERM), ResourceExhausted (ENOMEM, ENOSPC), InvalidArgument (EINVAL), else Internal.
absl::Status ErrnoStatus(int err, absl::string_view what);

}  // namespace hmoe
