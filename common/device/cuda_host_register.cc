#include "common/device/cuda_host_register.h"

#include <utility>

#include "common/base/logging.h"
#include "common/base/status_macros.h"
#include "common/kernels/cuda/cuda_backend.h"

namespace hmoe {

absl::StatusOr<ScopedHostRegister> ScopedHostRegister::Create(const void* data, size_t size_bytes,
                                                              bool read_only) {
  HMOE_RETURN_IF_ERROR(cuda::HostRegister(data, size_bytes, read_only));
  return ScopedHostRegister(data, size_bytes);
}

ScopedHostRegister& ScopedHostRegister::operator=(ScopedHostRegister&& other) noexcept {
  if (this != &other) {
    Reset();
    data_ = std::exchange(other.data_, nullptr);
    size_bytes_ = std::exchange(other.size_bytes_, 0);
  }
  return *this;
}

void ScopedHostRegister::Reset() {
  if (data_ == nullptr) return;
  if (absl::Status s = cuda::HostUnregister(data_); !s.ok()) {
    HMOE_LOG(ERROR) << "unregister host range of " << size_bytes_ << " bytes: " << s;
  }
  data_ = nullptr;
  size_bytes_ = 0;
}

}  // namespace hmoe
