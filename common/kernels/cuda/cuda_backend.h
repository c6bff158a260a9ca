#pragma once

// What the CUDA backend of this build can see. Portable header (no CUDA includes): callers never
// need an #ifdef. Built from cuda_backend.cc with the CUDA option, else from cuda_backend_stub.cc.

#include <cstddef>
#include <string>

#include "absl/status/status.h"
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

// Page-locks the host range [data, data + size_bytes) for all devices (cudaHostRegister with
// cudaHostRegisterPortable, plus cudaHostRegisterReadOnly when `read_only`: required for a
// read-only mapping such as weightd's, whose pages the driver must not write), so that
// cudaMemcpyAsync from it is truly asynchronous. Page-aligned ranges are safest. Errors:
// Unavailable without a usable device/driver or without CUDA, InvalidArgument for a bad range,
// AlreadyExists when (part of) the range is registered, FailedPrecondition when the device cannot
// register read-only memory, Internal otherwise.
absl::Status HostRegister(const void* data, size_t size_bytes, bool read_only);
// Undoes HostRegister(data, ...).
absl::Status HostUnregister(const void* data);

// The CUDA IPC handle (the raw bytes of a cudaIpcMemHandle_t) of the device allocation that
// starts at `device_ptr` (a cudaMalloc'ed base pointer, e.g. a CudaDevice DeviceBuffer), which
// another process opens with cudaIpcOpenMemHandle: the GPU form of a KV hand-off. The memory
// must stay allocated until the other process has closed the handle. Unavailable without CUDA or
// a usable device, InvalidArgument for a pointer that is not a device allocation, Internal
// otherwise.
absl::StatusOr<std::string> IpcMemHandle(const void* device_ptr);

// Why no device is usable (e.g. "CUDA driver version is insufficient..."), or "" when one is.
std::string NoDeviceReason();

}  // namespace hmoe::cuda
