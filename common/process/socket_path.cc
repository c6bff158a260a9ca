#include "common/process/socket_path.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

#include "common/base/status_macros.h"
#include "common/base/unix_socket.h"
#include "common/process/daemon.h"

namespace hmoe::process {

absl::Status EnsurePrivateDirectory(std::string_view what_name, const std::string& dir) {
  const absl::string_view what(what_name.data(), what_name.size());
  if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) {
    return absl::PermissionDeniedError(
        absl::StrCat("create ", what, " ", dir, ": ", std::strerror(errno)));
  }
  struct stat st {};
  if (::lstat(dir.c_str(), &st) != 0) {
    return absl::PermissionDeniedError(
        absl::StrCat("stat ", what, " ", dir, ": ", std::strerror(errno)));
  }
  if (!S_ISDIR(st.st_mode)) {
    return absl::PermissionDeniedError(absl::StrCat(what, " ", dir, " is not a directory"));
  }
  if (st.st_uid != ::geteuid() || (st.st_mode & 077) != 0) {
    return absl::PermissionDeniedError(absl::StrFormat(
        "%s %s must be owned by uid %d with mode 0700, not accessible to group or others (it is "
        "uid %d, mode %04o)",
        what, dir, ::geteuid(), st.st_uid, st.st_mode & 07777));
  }
  return absl::OkStatus();
}

absl::Status CheckSocketPath(std::string_view flag_name, const std::string& path) {
  const absl::string_view flag(flag_name.data(), flag_name.size());
  if (path.empty())
    return FlagError(absl::InvalidArgumentError(absl::StrCat(flag, " PATH is required")));
  if (path[0] != '/') {
    return FlagError(absl::InvalidArgumentError(
        absl::StrCat(flag, ": \"", path, "\" must be an absolute path")));
  }
  if (path.size() > kMaxSocketPathBytes) {
    return FlagError(absl::InvalidArgumentError(absl::StrCat(flag, ": ", path, " is ", path.size(),
                                                             " bytes; unix sockets allow at most ",
                                                             kMaxSocketPathBytes)));
  }
  if (path.back() == '/') {
    return FlagError(
        absl::InvalidArgumentError(absl::StrCat(flag, ": ", path, " names a directory")));
  }
  return absl::OkStatus();
}

absl::Status PrepareSocketPath(std::string_view flag_name, const std::string& path) {
  if (absl::Status s = CheckSocketPath(flag_name, path); !s.ok()) return s;
  const size_t slash = path.rfind('/');
  HMOE_RETURN_IF_ERROR(
      EnsurePrivateDirectory("socket directory", slash == 0 ? "/" : path.substr(0, slash)));
  // A stale socket (a previous process that did not clean up) is removed; one a running server
  // accepts on is refused (FailedPrecondition), so a second process cannot take the path over.
  absl::Status claimed = ClaimUnixSocketPath(path, std::string(flag_name));
  if (absl::IsInvalidArgument(claimed)) return FlagError(claimed);
  return claimed;
}

}  // namespace hmoe::process
