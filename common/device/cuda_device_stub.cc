// Linked instead of cuda_device.cc when the build has no CUDA (HMOE_WITH_CUDA off), so callers
// and headers never need an #ifdef.

#include "common/device/device.h"
#include "common/device/native_stream.h"

namespace hmoe {

int CudaDeviceCount() { return 0; }

void* NativeCudaStream(Stream& /*stream*/) { return nullptr; }

absl::StatusOr<std::unique_ptr<Device>> NewCudaDevice(int /*ordinal*/, size_t /*budget_bytes*/) {
  return absl::UnavailableError("built without CUDA (HMOE_CUDA=OFF or no nvcc)");
}

absl::StatusOr<std::unique_ptr<Device>> NewCudaDevice(int ordinal,
                                                      const CudaDeviceOptions& options) {
  return NewCudaDevice(ordinal, options.budget_bytes);
}

}  // namespace hmoe
