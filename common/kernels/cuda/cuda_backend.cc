#include "common/kernels/cuda/cuda_backend.h"

#include "absl/strings/str_cat.h"
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cublas_v2.h>

namespace hmoe::cuda {

bool BuiltWithCuda() { return true; }

int DeviceCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // Clear the non-sticky error so later calls start clean.
    return 0;
  }
  return count;
}

std::string NoDeviceReason() {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return absl::StrCat(cudaGetErrorName(err), ": ", cudaGetErrorString(err));
  }
  return count > 0 ? "" : "no CUDA device visible";
}

absl::StatusOr<std::string> LibraryVersions() {
  int runtime = 0;
  if (const cudaError_t err = cudaRuntimeGetVersion(&runtime); err != cudaSuccess) {
    return absl::InternalError(absl::StrCat("cudaRuntimeGetVersion: ", cudaGetErrorString(err)));
  }
  int major = 0, minor = 0, patch = 0;
  if (cublasGetProperty(MAJOR_VERSION, &major) != CUBLAS_STATUS_SUCCESS ||
      cublasGetProperty(MINOR_VERSION, &minor) != CUBLAS_STATUS_SUCCESS ||
      cublasGetProperty(PATCH_LEVEL, &patch) != CUBLAS_STATUS_SUCCESS) {
    return absl::InternalError("cublasGetProperty failed");
  }
  int nccl = 0;
  if (const ncclResult_t r = ncclGetVersion(&nccl); r != ncclSuccess) {
    return absl::InternalError(absl::StrCat("ncclGetVersion: ", ncclGetErrorString(r)));
  }
  return absl::StrCat("cudart ", runtime, ", cublas ", major, ".", minor, ".", patch, ", nccl ",
                      nccl);
}

namespace {

absl::Status RegisterError(const char* what, cudaError_t err) {
  cudaGetLastError();  // none of these errors is sticky; leave the runtime clean
  const std::string message =
      absl::StrCat(what, ": ", cudaGetErrorName(err), " (", cudaGetErrorString(err), ")");
  switch (err) {
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorInitializationError:
    case cudaErrorSystemDriverMismatch:
    case cudaErrorCompatNotSupportedOnDevice:
      return absl::UnavailableError(message);
    case cudaErrorInvalidValue:
      return absl::InvalidArgumentError(message);
    case cudaErrorHostMemoryAlreadyRegistered:
      return absl::AlreadyExistsError(message);
    case cudaErrorNotSupported:
      return absl::FailedPreconditionError(message);
    default:
      return absl::InternalError(message);
  }
}

}  // namespace

absl::Status HostRegister(const void* data, size_t size_bytes, bool read_only) {
  if (data == nullptr || size_bytes == 0) {
    return absl::InvalidArgumentError("host register: empty range");
  }
  unsigned int flags = cudaHostRegisterPortable;
  if (read_only) flags |= cudaHostRegisterReadOnly;
  // cudaHostRegister takes a non-const pointer; with cudaHostRegisterReadOnly the driver only
  // reads the pages.
  if (const cudaError_t err = cudaHostRegister(const_cast<void*>(data), size_bytes, flags);
      err != cudaSuccess) {
    return RegisterError("cudaHostRegister", err);
  }
  return absl::OkStatus();
}

absl::Status HostUnregister(const void* data) {
  if (const cudaError_t err = cudaHostUnregister(const_cast<void*>(data)); err != cudaSuccess) {
    return RegisterError("cudaHostUnregister", err);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> IpcMemHandle(const void* device_ptr) {
  if (device_ptr == nullptr) return absl::InvalidArgumentError("ipc mem handle: null pointer");
  cudaIpcMemHandle_t handle;
  if (const cudaError_t err = cudaIpcGetMemHandle(&handle, const_cast<void*>(device_ptr));
      err != cudaSuccess) {
    return RegisterError("cudaIpcGetMemHandle", err);
  }
  return std::string(reinterpret_cast<const char*>(&handle), sizeof(handle));
}

}  // namespace hmoe::cuda
