#include "common/shm/shm_names.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace hmoe::shm {

absl::Status ValidateInstanceName(std::string_view instance) {
  if (instance.empty() || instance.size() > 48) {
    return absl::InvalidArgumentError(
        absl::StrCat("instance name \"", std::string(instance), "\": must be 1 to 48 characters"));
  }
  for (char c : instance) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '_' || c == '-';
    if (!ok) {
      return absl::InvalidArgumentError(absl::StrCat("instance name \"", std::string(instance),
                                                     "\": only [A-Za-z0-9_-] are allowed"));
    }
  }
  return absl::OkStatus();
}

std::string ControlSegmentName(std::string_view instance) {
  return absl::StrCat("hmoe.", std::string(instance), ".control");
}

std::string RuntimeDir() {
  const char* env = std::getenv("HMOE_RUNTIME_DIR");
  if (env != nullptr && *env != '\0') return env;
  return absl::StrCat("/tmp/hmoe-", ::geteuid());
}

absl::StatusOr<std::string> EnsureRuntimeDir() {
  const std::string dir = RuntimeDir();
  if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) {
    return absl::PermissionDeniedError(
        absl::StrCat("create runtime dir ", dir, ": ", std::strerror(errno)));
  }
  struct stat st {};
  if (::lstat(dir.c_str(), &st) != 0) {
    return absl::PermissionDeniedError(
        absl::StrCat("stat runtime dir ", dir, ": ", std::strerror(errno)));
  }
  if (!S_ISDIR(st.st_mode)) {
    return absl::PermissionDeniedError(absl::StrCat("runtime dir ", dir, " is not a directory"));
  }
  if (st.st_uid != ::geteuid()) {
    return absl::PermissionDeniedError(absl::StrCat("runtime dir ", dir, " is owned by uid ",
                                                    st.st_uid, ", not by us (uid ", ::geteuid(),
                                                    ")"));
  }
  if ((st.st_mode & 077) != 0) {
    return absl::PermissionDeniedError(absl::StrFormat(
        "runtime dir %s has mode %04o; it must not be accessible to group or others (chmod 700)",
        dir, st.st_mode & 07777));
  }
  return dir;
}

std::string LockFilePath(std::string_view instance) {
  return absl::StrCat(RuntimeDir(), "/weightd.", std::string(instance), ".lock");
}

std::string DefaultSocketPath(std::string_view instance) {
  return absl::StrCat(RuntimeDir(), "/weightd.", std::string(instance), ".sock");
}

}  // namespace hmoe::shm
