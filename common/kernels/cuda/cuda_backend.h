#pragma once

// What the CUDA backend of this build can see. Portable header (no CUDA includes): callers never
// need an #ifdef. Built from cuda_backend.cc with the CUDA option, else from cuda_backend_stub.cc.

#include <string>

#include "absl/status/statusor.h"

namespace hmoe::cuda {

// True when this binary was built with the CUDA backend.
bool BuiltWithCuda();

// Number of usable CUDA devices; 0 without CUDA, without a driver, or without a GPU.
int DeviceCount();

// Versions of the CUDA runtime, cuBLAS and NCCL this binary links, e.g.
// "cudart 13000, cublas 130100, nccl 22809". Works without a GPU or driver.
// Unavailable when built without CUDA.
absl::StatusOr<std::string> LibraryVersions();

// Why no device is usable (e.g. "CUDA driver version is insufficient..."), or "" when one is.
std::string NoDeviceReason();

}  // namespace hmoe::cuda
