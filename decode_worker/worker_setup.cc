#include "decode_worker/worker_setup.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace hmoe::decode {
namespace {

// sockaddr_un.sun_path holds 108 bytes including the terminating NUL.
constexpr size_t kMaxSocketPathBytes = 107;

}  // namespace

absl::StatusOr<DeviceSpec> ParseDeviceFlag(const std::string& value) {
  if (value == "cpu") return DeviceSpec{DeviceKind::kCpu, 0};
  int ordinal = -1;
  if (absl::StartsWith(value, "cuda:") && absl::SimpleAtoi(value.substr(5), &ordinal) &&
      ordinal >= 0) {
    return DeviceSpec{DeviceKind::kCuda, ordinal};
  }
  return absl::InvalidArgumentError(absl::StrCat("--device: \"", value, "\" is not cpu or cuda:N"));
}

absl::StatusOr<bool> ParseOnOff(const std::string& flag, const std::string& value) {
  if (value == "on" || value == "true" || value == "1") return true;
  if (value == "off" || value == "false" || value == "0") return false;
  return absl::InvalidArgumentError(absl::StrCat("--", flag, ": \"", value, "\" is not on or off"));
}

absl::StatusOr<bool> ResolveDualBatch(const std::string& value, DeviceKind attention_device) {
  if (value == "auto") return attention_device == DeviceKind::kCuda;
  absl::StatusOr<bool> on = ParseOnOff("dual-batch", value);
  if (!on.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--dual-batch: \"", value, "\" is not on, off or auto"));
  }
  return on;
}

absl::StatusOr<int64_t> ResolveKvBlocks(int64_t kv_blocks, int64_t kv_memory_mb,
                                        size_t block_bytes) {
  if (kv_blocks < 0 || kv_memory_mb < 0) {
    return absl::InvalidArgumentError("--kv-blocks and --kv-memory-mb must not be negative");
  }
  if (kv_blocks > 0 && kv_memory_mb > 0) {
    return absl::InvalidArgumentError("give --kv-blocks or --kv-memory-mb, not both");
  }
  if (kv_blocks > 0) return kv_blocks;
  if (kv_memory_mb == 0) {
    return absl::InvalidArgumentError("--kv-blocks or --kv-memory-mb must be > 0");
  }
  const auto blocks = static_cast<int64_t>((static_cast<uint64_t>(kv_memory_mb) << 20) /
                                           std::max<size_t>(block_bytes, 1));
  if (blocks < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--kv-memory-mb ", kv_memory_mb, " holds no KV block of ", block_bytes, " bytes"));
  }
  return blocks;
}

absl::Status PrepareSocketPath(const std::string& path) {
  if (path.empty() || path[0] != '/') {
    return absl::InvalidArgumentError(
        absl::StrCat("--socket: \"", path, "\" must be an absolute path"));
  }
  if (path.size() > kMaxSocketPathBytes) {
    return absl::InvalidArgumentError(absl::StrCat("--socket: ", path, " is ", path.size(),
                                                   " bytes; unix sockets allow at most ",
                                                   kMaxSocketPathBytes));
  }
  const size_t slash = path.rfind('/');
  const std::string dir = slash == 0 ? "/" : path.substr(0, slash);
  if (slash + 1 == path.size()) {
    return absl::InvalidArgumentError(absl::StrCat("--socket: ", path, " names a directory"));
  }
  if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) {
    return absl::PermissionDeniedError(
        absl::StrCat("create socket directory ", dir, ": ", std::strerror(errno)));
  }
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0) {
    return absl::PermissionDeniedError(
        absl::StrCat("stat socket directory ", dir, ": ", std::strerror(errno)));
  }
  if (!S_ISDIR(st.st_mode)) {
    return absl::InvalidArgumentError(
        absl::StrCat("socket directory ", dir, " is not a directory"));
  }
  if (st.st_uid != ::geteuid() || (st.st_mode & 077) != 0) {
    return absl::PermissionDeniedError(
        absl::StrCat("socket directory ", dir, " must be owned by uid ", ::geteuid(),
                     " with mode 0700 (it is uid ", st.st_uid, ", mode ",
                     absl::StrFormat("%04o", st.st_mode & 0777), ")"));
  }
  struct stat sock {};
  if (::lstat(path.c_str(), &sock) == 0) {
    if (!S_ISSOCK(sock.st_mode)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--socket: ", path, " exists and is not a socket"));
    }
    ::unlink(path.c_str());  // Stale: a previous worker that did not clean up.
  }
  return absl::OkStatus();
}

}  // namespace hmoe::decode
