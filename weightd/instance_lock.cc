#include "weightd/instance_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

#include "common/base/status_macros.h"
#include "common/shm/shm_names.h"

namespace hmoe::weightd {

absl::StatusOr<InstanceLock> InstanceLock::Acquire(std::string_view instance) {
  HMOE_RETURN_IF_ERROR(shm::ValidateInstanceName(instance));
  HMOE_RETURN_IF_ERROR(shm::EnsureRuntimeDir().status());
  const std::string path = shm::LockFilePath(instance);
  UniqueFd fd(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600));
  if (!fd.valid()) {
    const int err = errno;
    const std::string message = absl::StrCat("open lock file ", path, ": ", std::strerror(err));
    return err == EACCES || err == EPERM || err == ELOOP ? absl::PermissionDeniedError(message)
                                                         : absl::InternalError(message);
  }
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0 || st.st_uid != ::geteuid()) {
    return absl::PermissionDeniedError(absl::StrCat("lock file ", path, " is not ours"));
  }
  if (::flock(fd.get(), LOCK_EX | LOCK_NB) != 0) {
    if (errno != EWOULDBLOCK) {
      return absl::InternalError(absl::StrCat("flock ", path, ": ", std::strerror(errno)));
    }
    char buf[32] = {};
    const ssize_t n = ::pread(fd.get(), buf, sizeof(buf) - 1, 0);
    std::string holder = n > 0 ? std::string(buf, static_cast<size_t>(n)) : "";
    int pid = 0;
    const bool known = absl::SimpleAtoi(absl::StripAsciiWhitespace(holder), &pid);
    return absl::FailedPreconditionError(
        absl::StrCat("instance \"", std::string(instance), "\" is already served by weightd",
                     known ? absl::StrCat(" pid ", pid) : std::string(), " (lock file ", path,
                     "); stop it first or choose another --instance"));
  }
  const std::string pid = absl::StrCat(::getpid(), "\n");
  if (::ftruncate(fd.get(), 0) != 0 ||
      ::pwrite(fd.get(), pid.data(), pid.size(), 0) != static_cast<ssize_t>(pid.size())) {
    return absl::InternalError(absl::StrCat("write pid to ", path, ": ", std::strerror(errno)));
  }
  return InstanceLock(path, std::move(fd));
}

}  // namespace hmoe::weightd
