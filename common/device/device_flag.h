#pragma once

// The --device flag of the worker processes ("cpu" or "cuda:N") and the device it names.

#include <cstddef>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

#include "common/device/cpu_device.h"
#include "common/device/device.h"

namespace hmoe {

struct DeviceSpec {
  DeviceKind kind = DeviceKind::kCpu;
  int ordinal = 0;  // kCuda
};

// "cpu" or "cuda:N" (N >= 0). InvalidArgument naming the flag otherwise.
absl::StatusOr<DeviceSpec> ParseDeviceFlag(const std::string& value);

// The device `spec` names: a CpuDevice with `cpu` options, or the CUDA device with a budget of
// `cuda_budget_bytes` (0: none). The CUDA error names the --device flag and suggests
// --device cpu.
absl::StatusOr<std::unique_ptr<Device>> NewDeviceFromSpec(const DeviceSpec& spec,
                                                          const CpuDeviceOptions& cpu,
                                                          size_t cuda_budget_bytes);

}  // namespace hmoe
