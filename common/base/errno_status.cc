#include "common/base/errno_status.h"

#include <cerrno>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"

namespace hmoe {

absl::Status ErrnoStatus(int err, absl::string_view what) {
  const std::string message = absl::StrCat(what, ": ", std::strerror(err));
  switch (err) {
    case ENOENT:
    case EIDRM:
      return absl::NotFoundError(message);
    case EEXIST:
      return absl::AlreadyExistsError(message);
    case EACCES:
    case EPERM:
      return absl::PermissionDeniedError(message);
    case ENOMEM:
    case ENOSPC:
      return absl::ResourceExhaustedError(message);
    case EINVAL:
      return absl::InvalidArgumentError(message);
    default:
      return absl::InternalError(message);
  }
}

}  // namespace hmoe
