#include "common/kernels/cuda/cuda_backend.h"

namespace hmoe::cuda {

bool BuiltWithCuda() { return false; }
int DeviceCount() { return 0; }
std::string NoDeviceReason() { return "built without CUDA (HMOE_CUDA=OFF)"; }
absl::StatusOr<std::string> LibraryVersions() {
  return absl::UnavailableError("built without CUDA (HMOE_CUDA=OFF)");
}

absl::Status HostRegister(const void*, size_t, bool) {
  return absl::UnavailableError("host register: built without CUDA (HMOE_CUDA=OFF)");
}
absl::Status HostUnregister(const void*) {
  return absl::UnavailableError("host unregister: built without CUDA (HMOE_CUDA=OFF)");
}

absl::StatusOr<std::string> IpcMemHandle(const void*) {
  return absl::UnavailableError("cuda ipc handle: built without CUDA (HMOE_CUDA=OFF)");
}

}  // namespace hmoe::cuda
