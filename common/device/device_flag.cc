#include "common/device/device_flag.h"

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace hmoe {

absl::StatusOr<DeviceSpec> ParseDeviceFlag(const std::string& value) {
  if (value == "cpu") return DeviceSpec{DeviceKind::kCpu, 0};
  int ordinal = -1;
  if (absl::StartsWith(value, "cuda:") && absl::SimpleAtoi(value.substr(5), &ordinal) &&
      ordinal >= 0) {
    return DeviceSpec{DeviceKind::kCuda, ordinal};
  }
  return absl::InvalidArgumentError(absl::StrCat("--device: \"", value, "\" is not cpu or cuda:N"));
}

absl::StatusOr<std::unique_ptr<Device>> NewDeviceFromSpec(const DeviceSpec& spec,
                                                          const CpuDeviceOptions& cpu,
                                                          size_t cuda_budget_bytes) {
  if (spec.kind == DeviceKind::kCpu) return NewCpuDevice(cpu);
  absl::StatusOr<std::unique_ptr<Device>> cuda = NewCudaDevice(spec.ordinal, cuda_budget_bytes);
  if (!cuda.ok()) {
    return absl::Status(cuda.status().code(),
                        absl::StrCat("--device cuda:", spec.ordinal, ": ", cuda.status().message(),
                                     " (use --device cpu on a machine without a usable GPU)"));
  }
  return cuda;
}

}  // namespace hmoe
