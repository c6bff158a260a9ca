#pragma once

// ScopedHostRegister: page-locks a host range (typically weightd's read-only weight mapping) for
// the lifetime of the object, so that CopyToDevice from it on a CudaDevice is an asynchronous DMA
// rather than a staged, host-synchronous copy. SLP's loader registers the mapping once at startup.
// Portable header (no CUDA includes): in a build without CUDA, Create returns Unavailable.

#include <cstddef>
#include <utility>

#include "absl/status/statusor.h"

namespace hmoe {

// Move-only. Thread-compatible.
class ScopedHostRegister {
 public:
  // Registers [data, data + size_bytes) for all devices; `read_only` for memory mapped without
  // write access (cudaHostRegisterReadOnly). The range must stay mapped while the object lives.
  // Errors: see cuda::HostRegister (Unavailable without a GPU/driver or without CUDA).
  static absl::StatusOr<ScopedHostRegister> Create(const void* data, size_t size_bytes,
                                                   bool read_only = true);

  ScopedHostRegister() = default;
  ~ScopedHostRegister() { Reset(); }
  ScopedHostRegister(ScopedHostRegister&& other) noexcept { *this = std::move(other); }
  ScopedHostRegister& operator=(ScopedHostRegister&& other) noexcept;
  ScopedHostRegister(const ScopedHostRegister&) = delete;
  ScopedHostRegister& operator=(const ScopedHostRegister&) = delete;

  // Unregisters now (logs a failure); no-op when empty.
  void Reset();

  const void* data() const { return data_; }
  size_t size_bytes() const { return size_bytes_; }
  bool empty() const { return data_ == nullptr; }

 private:
  ScopedHostRegister(const void* data, size_t size_bytes) : data_(data), size_bytes_(size_bytes) {}

  const void* data_ = nullptr;
  size_t size_bytes_ = 0;
};

}  // namespace hmoe
