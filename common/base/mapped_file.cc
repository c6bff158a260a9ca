#include "common/base/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"

#include "common/base/errno_status.h"

namespace hmoe {

UniqueFd& UniqueFd::operator=(UniqueFd&& other) noexcept {
  if (this != &other) reset(other.release());
  return *this;
}

UniqueFd::~UniqueFd() { reset(); }

void UniqueFd::reset(int fd) {
  if (fd_ >= 0) ::close(fd_);
  fd_ = fd;
}

absl::StatusOr<MappedFile> MappedFile::Open(const std::string& path) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd.valid()) return ErrnoStatus(errno, absl::StrCat("open ", path));
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) return ErrnoStatus(errno, absl::StrCat("stat ", path));
  if (!S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat(path, " is not a regular file"));
  }
  const size_t size = static_cast<size_t>(st.st_size);
  if (size == 0) return MappedFile(path, nullptr, 0);
  void* p = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd.get(), 0);
  if (p == MAP_FAILED) return ErrnoStatus(errno, absl::StrCat("mmap ", path));
  return MappedFile(path, static_cast<const std::byte*>(p), size);
}

MappedFile::MappedFile(MappedFile&& other) noexcept
    : path_(std::move(other.path_)),
      data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)) {}

MappedFile& MappedFile::operator=(MappedFile&& other) noexcept {
  if (this != &other) {
    if (data_ != nullptr) ::munmap(const_cast<std::byte*>(data_), size_);
    path_ = std::move(other.path_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

MappedFile::~MappedFile() {
  if (data_ != nullptr) ::munmap(const_cast<std::byte*>(data_), size_);
}

absl::StatusOr<std::string> ReadFileToString(const std::string& path) {
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd.valid()) return ErrnoStatus(errno, absl::StrCat("open ", path));
  std::string out;
  char buf[1 << 16];
  while (true) {
    const ssize_t n = ::read(fd.get(), buf, sizeof(buf));
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus(errno, absl::StrCat("read ", path));
    }
    if (n == 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  return out;
}

absl::Status WriteFileAtomically(const std::string& path, std::string_view contents) {
  const std::string tmp = absl::StrCat(path, ".tmp.", ::getpid());
  UniqueFd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (!fd.valid()) return ErrnoStatus(errno, absl::StrCat("create ", tmp));
  size_t done = 0;
  while (done < contents.size()) {
    const ssize_t n = ::write(fd.get(), contents.data() + done, contents.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      const int err = errno;
      ::unlink(tmp.c_str());
      return ErrnoStatus(err, absl::StrCat("write ", tmp));
    }
    done += static_cast<size_t>(n);
  }
  if (::fsync(fd.get()) != 0 || ::close(fd.release()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    return ErrnoStatus(err, absl::StrCat("flush ", tmp));
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    return ErrnoStatus(err, absl::StrCat("rename ", tmp, " to ", path));
  }
  return absl::OkStatus();
}

}  // namespace hmoe
