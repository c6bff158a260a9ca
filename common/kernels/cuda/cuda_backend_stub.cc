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

absl::StatusOr<std::string> PciBusIdOf(const void*) {
  return absl::UnavailableError("cuda pci bus id: built without CUDA (HMOE_CUDA=OFF)");
}
absl::StatusOr<int> DeviceByPciBusId(const std::string&) {
  return absl::UnavailableError("cuda device by pci bus id: built without CUDA (HMOE_CUDA=OFF)");
}
bool CanAccessPeer(int, int) { return false; }
absl::StatusOr<void*> IpcOpenMemHandle(std::string_view, int) {
  return absl::UnavailableError("open cuda ipc handle: built without CUDA (HMOE_CUDA=OFF)");
}
absl::Status IpcCloseMemHandle(void*, int) {
  return absl::UnavailableError("close cuda ipc handle: built without CUDA (HMOE_CUDA=OFF)");
}
absl::StatusOr<size_t> AllocationBytes(const void*, int) {
  return absl::UnavailableError("cuda allocation size: built without CUDA (HMOE_CUDA=OFF)");
}
absl::Status CopyToHostSync(void*, const void*, size_t, int) {
  return absl::UnavailableError("cuda copy to host: built without CUDA (HMOE_CUDA=OFF)");
}

absl::Status CopyToDeviceSync(void*, const void*, size_t, int) {
  return absl::UnavailableError("cuda copy to device: built without CUDA (HMOE_CUDA=OFF)");
}

absl::StatusOr<int> DeviceOf(const void*) {
  return absl::UnavailableError("cuda device of a pointer: built without CUDA (HMOE_CUDA=OFF)");
}

}  // namespace hmoe::cuda
