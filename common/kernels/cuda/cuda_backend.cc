#include "common/kernels/cuda/cuda_backend.h"

#include <cstdint>
#include <cstring>

#include "absl/strings/str_cat.h"
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cublas_v2.h>

namespace hmoe::cuda {

static_assert(sizeof(cudaIpcMemHandle_t) == kIpcMemHandleBytes);

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

// ---------------------------------------------------------------------- CUDA IPC import

namespace {

bool IsUnavailable(cudaError_t err) {
  return err == cudaErrorNoDevice || err == cudaErrorInsufficientDriver ||
         err == cudaErrorInitializationError || err == cudaErrorSystemDriverMismatch ||
         err == cudaErrorCompatNotSupportedOnDevice || err == cudaErrorDevicesUnavailable ||
         err == cudaErrorStubLibrary;
}

std::string ErrorText(const char* what, cudaError_t err) {
  cudaGetLastError();  // none of the errors handled here is sticky; leave the runtime clean
  return absl::StrCat(what, ": ", cudaGetErrorName(err), " (", cudaGetErrorString(err), ")");
}

// Runs `f` (returning cudaError_t) with `device` current for the calling thread, then makes the
// thread's previous device current again (CudaDevice re-enters its own device before every call,
// but other code on the thread may rely on the current device).
template <typename F>
cudaError_t OnDevice(int device, F&& f) {
  int previous = -1;
  if (cudaGetDevice(&previous) != cudaSuccess) {
    cudaGetLastError();
    previous = -1;
  }
  if (const cudaError_t err = cudaSetDevice(device); err != cudaSuccess) return err;
  const cudaError_t err = f();
  if (previous >= 0 && previous != device && cudaSetDevice(previous) != cudaSuccess) {
    cudaGetLastError();
  }
  return err;
}

absl::Status IpcOpenError(cudaError_t err) {
  const std::string message = ErrorText("cudaIpcOpenMemHandle", err);
  if (IsUnavailable(err)) return absl::UnavailableError(message);
  switch (err) {
    case cudaErrorInvalidValue:
    case cudaErrorInvalidResourceHandle:
    case cudaErrorMapBufferObjectFailed:
      return absl::NotFoundError(
          absl::StrCat(message,
                       ": no live allocation behind this handle (the exporting process exited or "
                       "freed the buffer, or the bytes are not a CUDA IPC handle)"));
    case cudaErrorDeviceUninitialized:
      return absl::FailedPreconditionError(
          absl::StrCat(message, " (a process cannot open a handle it exported itself)"));
    case cudaErrorInvalidDevice:
    case cudaErrorPeerAccessUnsupported:
    case cudaErrorNotSupported:
    case cudaErrorAlreadyMapped:
      return absl::FailedPreconditionError(
          absl::StrCat(message, " (this GPU cannot map the exporting GPU's memory)"));
    case cudaErrorTooManyPeers:
    case cudaErrorMemoryAllocation:
      return absl::ResourceExhaustedError(message);
    default:
      return absl::InternalError(message);
  }
}

// cuMemGetAddressRange from the driver the runtime loaded (null when it offers none).
PFN_cuMemGetAddressRange_v3020 AddressRangeFunction() {
  static const PFN_cuMemGetAddressRange_v3020 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &f, 12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      return static_cast<PFN_cuMemGetAddressRange_v3020>(nullptr);
    }
    return reinterpret_cast<PFN_cuMemGetAddressRange_v3020>(f);
  }();
  return fn;
}

}  // namespace

absl::StatusOr<std::string> PciBusIdOf(const void* device_ptr) {
  if (device_ptr == nullptr) return absl::InvalidArgumentError("cuda pci bus id: null pointer");
  cudaPointerAttributes attributes{};
  if (const cudaError_t err = cudaPointerGetAttributes(&attributes, device_ptr);
      err != cudaSuccess) {
    return RegisterError("cudaPointerGetAttributes", err);
  }
  if (attributes.type != cudaMemoryTypeDevice) {
    return absl::InvalidArgumentError("cuda pci bus id: the pointer is not device memory");
  }
  char bus_id[64] = {};
  if (const cudaError_t err = cudaDeviceGetPCIBusId(bus_id, sizeof(bus_id), attributes.device);
      err != cudaSuccess) {
    return RegisterError("cudaDeviceGetPCIBusId", err);
  }
  return std::string(bus_id);
}

absl::StatusOr<int> DeviceByPciBusId(const std::string& pci_bus_id) {
  int device = -1;
  if (const cudaError_t err = cudaDeviceGetByPCIBusId(&device, pci_bus_id.c_str());
      err != cudaSuccess) {
    const std::string message = ErrorText("cudaDeviceGetByPCIBusId", err);
    if (IsUnavailable(err)) return absl::UnavailableError(message);
    return absl::NotFoundError(
        absl::StrCat("no visible GPU has pci bus id ", pci_bus_id, " (", message, ")"));
  }
  return device;
}

bool CanAccessPeer(int device, int peer) {
  if (device == peer) return false;
  int can = 0;
  if (cudaDeviceCanAccessPeer(&can, device, peer) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return can != 0;
}

absl::StatusOr<void*> IpcOpenMemHandle(std::string_view handle, int device) {
  if (handle.size() != sizeof(cudaIpcMemHandle_t)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cuda ipc handle of ", handle.size(), " bytes, expected ", sizeof(cudaIpcMemHandle_t)));
  }
  cudaIpcMemHandle_t h;
  std::memcpy(&h, handle.data(), sizeof(h));
  void* ptr = nullptr;
  if (const cudaError_t err = OnDevice(
          device, [&] { return cudaIpcOpenMemHandle(&ptr, h, cudaIpcMemLazyEnablePeerAccess); });
      err != cudaSuccess) {
    return IpcOpenError(err);
  }
  return ptr;
}

absl::Status IpcCloseMemHandle(void* device_ptr, int device) {
  if (const cudaError_t err = OnDevice(device, [&] { return cudaIpcCloseMemHandle(device_ptr); });
      err != cudaSuccess) {
    return absl::InternalError(ErrorText("cudaIpcCloseMemHandle", err));
  }
  return absl::OkStatus();
}

absl::StatusOr<size_t> AllocationBytes(const void* device_ptr, int device) {
  const PFN_cuMemGetAddressRange_v3020 range = AddressRangeFunction();
  if (range == nullptr) {
    return absl::UnimplementedError("cuMemGetAddressRange: not offered by this driver");
  }
  CUdeviceptr base = 0;
  size_t size = 0;
  CUresult result = CUDA_SUCCESS;
  const auto ptr = static_cast<CUdeviceptr>(reinterpret_cast<uintptr_t>(device_ptr));
  // The driver call needs the device's context current; cudaSetDevice makes it so.
  if (const cudaError_t err = OnDevice(device,
                                       [&] {
                                         result = range(&base, &size, ptr);
                                         return cudaSuccess;
                                       });
      err != cudaSuccess) {
    return RegisterError("cudaSetDevice", err);
  }
  if (result != CUDA_SUCCESS) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuMemGetAddressRange: CUresult ", static_cast<int>(result)));
  }
  if (base != ptr) {
    return absl::InvalidArgumentError("cuMemGetAddressRange: not the start of an allocation");
  }
  return size;
}

absl::Status CopyToHostSync(void* host_dst, const void* device_src, size_t bytes, int device) {
  if (bytes == 0) return absl::OkStatus();
  if (host_dst == nullptr || device_src == nullptr) {
    return absl::InvalidArgumentError("cuda copy to host: null pointer");
  }
  if (const cudaError_t err = OnDevice(
          device, [&] { return cudaMemcpy(host_dst, device_src, bytes, cudaMemcpyDeviceToHost); });
      err != cudaSuccess) {
    return RegisterError("cudaMemcpy device to host", err);
  }
  return absl::OkStatus();
}

absl::Status CopyToDeviceSync(void* device_dst, const void* host_src, size_t bytes, int device) {
  if (bytes == 0) return absl::OkStatus();
  if (host_src == nullptr || device_dst == nullptr) {
    return absl::InvalidArgumentError("cuda copy to device: null pointer");
  }
  if (const cudaError_t err = OnDevice(
          device, [&] { return cudaMemcpy(device_dst, host_src, bytes, cudaMemcpyHostToDevice); });
      err != cudaSuccess) {
    return RegisterError("cudaMemcpy host to device", err);
  }
  return absl::OkStatus();
}

absl::StatusOr<int> DeviceOf(const void* device_ptr) {
  cudaPointerAttributes attr{};
  if (const cudaError_t err = cudaPointerGetAttributes(&attr, device_ptr); err != cudaSuccess) {
    return RegisterError("cudaPointerGetAttributes", err);
  }
  if (attr.type != cudaMemoryTypeDevice) {
    return absl::InvalidArgumentError("cuda device of a pointer: not device memory");
  }
  return attr.device;
}

}  // namespace hmoe::cuda
