#pragma once

// Read-only memory-mapped files and an owning file descriptor.

#include <cstddef>
#include <span>
#include <string>

#include "absl/status/statusor.h"

namespace hmoe {

// Owns a file descriptor; closes it on destruction. Move-only.
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  UniqueFd(UniqueFd&& other) noexcept : fd_(other.release()) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept;
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  ~UniqueFd();

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int release() {
    const int fd = fd_;
    fd_ = -1;
    return fd;
  }
  void reset(int fd = -1);

 private:
  int fd_ = -1;
};

// A whole file mapped PROT_READ, MAP_SHARED (page cache, zero copies). The mapping lives as long
// as the object. Thread-safe for concurrent reads. Empty files map to an empty span.
class MappedFile {
 public:
  // NotFound if `path` does not exist, PermissionDenied if it cannot be read, InvalidArgument if
  // it is not a regular file.
  static absl::StatusOr<MappedFile> Open(const std::string& path);

  MappedFile(MappedFile&& other) noexcept;
  MappedFile& operator=(MappedFile&& other) noexcept;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  ~MappedFile();

  const std::string& path() const { return path_; }
  std::span<const std::byte> bytes() const { return {data_, size_}; }
  size_t size() const { return size_; }

 private:
  MappedFile(std::string path, const std::byte* data, size_t size)
      : path_(std::move(path)), data_(data), size_(size) {}

  std::string path_;
  const std::byte* data_ = nullptr;
  size_t size_ = 0;
};

// Reads a whole (small) file into a string: config.json, index files.
absl::StatusOr<std::string> ReadFileToString(const std::string& path);

// Writes `contents` to `path` atomically (write to a temp file in the same directory, fsync,
// rename). Used by tools that write checkpoints and configs.
absl::Status WriteFileAtomically(const std::string& path, std::string_view contents);

}  // namespace hmoe
