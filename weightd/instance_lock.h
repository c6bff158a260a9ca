#pragma once

// One weightd per instance: an exclusive flock on <runtime dir>/weightd.<instance>.lock, held for
// the life of the process (the kernel drops it when the process dies, kill -9 included). The file
// holds the owner's pid so that a refused second weightd can say who holds the instance.

#include <string>
#include <string_view>

#include "absl/status/statusor.h"

#include "common/base/mapped_file.h"

namespace hmoe::weightd {

class InstanceLock {
 public:
  // FailedPrecondition "instance ... is already served by weightd pid N" when another process
  // holds it; PermissionDenied when the runtime dir or lock file is not ours.
  static absl::StatusOr<InstanceLock> Acquire(std::string_view instance);

  InstanceLock(InstanceLock&&) noexcept = default;
  InstanceLock& operator=(InstanceLock&&) noexcept = default;
  ~InstanceLock() = default;  // Closing the fd releases the lock; the file stays (no unlink race).

  const std::string& path() const { return path_; }

 private:
  InstanceLock(std::string path, UniqueFd fd) : path_(std::move(path)), fd_(std::move(fd)) {}

  std::string path_;
  UniqueFd fd_;
};

}  // namespace hmoe::weightd
