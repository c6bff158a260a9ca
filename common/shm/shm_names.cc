#include "common/shm/shm_names.h"

#include <unistd.h>

#include <cstdlib>

#include "absl/strings/str_cat.h"

#include "common/base/status_macros.h"
#include "common/process/socket_path.h"

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
  HMOE_RETURN_IF_ERROR(process::EnsurePrivateDirectory("runtime dir", dir));
  return dir;
}

std::string LockFilePath(std::string_view instance) {
  return absl::StrCat(RuntimeDir(), "/weightd.", std::string(instance), ".lock");
}

std::string DefaultSocketPath(std::string_view instance) {
  return absl::StrCat(RuntimeDir(), "/weightd.", std::string(instance), ".sock");
}

}  // namespace hmoe::shm
