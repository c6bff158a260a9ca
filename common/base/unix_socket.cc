#include "common/base/unix_socket.h"

#include <errno.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>

#include "absl/strings/str_cat.h"

#include "common/base/errno_status.h"

namespace hmoe {

absl::Status ClaimUnixSocketPath(const std::string& path, const std::string& flag) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return absl::OkStatus();
    return ErrnoStatus(errno, absl::StrCat(flag, ": stat ", path));
  }
  if (!S_ISSOCK(st.st_mode)) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": ", path, " exists and is not a socket"));
  }
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat(flag, ": ", path, " is ", path.size(),
                                                   " bytes; unix sockets allow at most ",
                                                   sizeof(addr.sun_path) - 1));
  }
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return ErrnoStatus(errno, "socket(AF_UNIX)");
  const int rc = ::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr));
  const int err = errno;
  ::close(fd);
  if (rc == 0 || err == EAGAIN) {  // EAGAIN: a listener whose backlog is full is still a listener.
    return absl::FailedPreconditionError(
        absl::StrCat(flag, ": ", path,
                     " is in use: a running server accepts connections on it; stop it or choose "
                     "another ",
                     flag));
  }
  if (err != ECONNREFUSED) {
    return ErrnoStatus(err, absl::StrCat(flag, ": probe the existing socket ", path));
  }
  // Stale: nothing listens. Remove it so that the server can bind.
  if (::unlink(path.c_str()) != 0 && errno != ENOENT) {
    return ErrnoStatus(errno, absl::StrCat(flag, ": remove the stale socket ", path));
  }
  return absl::OkStatus();
}

}  // namespace hmoe
