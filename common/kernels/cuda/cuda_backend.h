#pragma once

// What the CUDA backend of this build can see. Portable header (no CUDA includes): callers never
// need an #ifdef. Built from cuda_backend.cc with the CUDA option, else from cuda_backend_stub.cc.

#include <cstddef>
#include <string>
#include <string_view>

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

// Bytes of a CUDA IPC memory handle (cudaIpcMemHandle_t, CUDA_IPC_HANDLE_SIZE).
inline constexpr size_t kIpcMemHandleBytes = 64;

// The PCI bus id ("0000:65:00.0", cudaDeviceGetPCIBusId) of the GPU that holds the device
// allocation `device_ptr`. It names a GPU across processes whatever their CUDA_VISIBLE_DEVICES
// (ordinals do not). Unavailable without CUDA or a usable device, InvalidArgument for a pointer
// that is not device memory, Internal otherwise.
absl::StatusOr<std::string> PciBusIdOf(const void* device_ptr);

// The ordinal, in this process, of the GPU with PCI bus id `pci_bus_id`. NotFound when no GPU
// visible to this process has it; Unavailable without CUDA or a usable device.
absl::StatusOr<int> DeviceByPciBusId(const std::string& pci_bus_id);

// Whether GPU `device` can map memory of GPU `peer` (cudaDeviceCanAccessPeer; false on any error
// and for device == peer).
bool CanAccessPeer(int device, int peer);

// The other side of IpcMemHandle: maps the allocation named by `handle` (kIpcMemHandleBytes raw
// bytes, exported by another process) into GPU `device`'s context (cudaIpcOpenMemHandle with
// cudaIpcMemLazyEnablePeerAccess) and returns the device pointer of its first byte. Open it on
// the GPU that holds the memory, or on a GPU with peer access to it. The mapping must be closed
// with IpcCloseMemHandle(ptr, device) before the exporter frees the memory. The calling thread's
// current device is restored. Errors: InvalidArgument (handle size), NotFound (the handle names
// no live allocation: the exporting process exited or freed it, or the bytes are no handle),
// FailedPrecondition (the handle comes from this same process, or `device` cannot map that GPU's
// memory), ResourceExhausted, Unavailable (no CUDA or no usable device), Internal.
absl::StatusOr<void*> IpcOpenMemHandle(std::string_view handle, int device);
// Unmaps what IpcOpenMemHandle(…, device) returned. Internal on failure.
absl::Status IpcCloseMemHandle(void* device_ptr, int device);

// Bytes of the device allocation (or IPC mapping) that starts at `device_ptr` on GPU `device`
// (cuMemGetAddressRange, found through the runtime: the driver library is not linked).
// Unimplemented when the driver does not offer that call; InvalidArgument when `device_ptr` is
// not the first byte of an allocation; Unavailable without CUDA.
absl::StatusOr<size_t> AllocationBytes(const void* device_ptr, int device);

// Blocking copy of `bytes` from device memory readable on GPU `device` to host memory (any host
// memory; pageable memory is staged by the runtime). Unavailable without CUDA; Internal on a
// device error.
absl::Status CopyToHostSync(void* host_dst, const void* device_src, size_t bytes, int device);

// Blocking copy of `bytes` from host memory to device memory writable on GPU `device`.
// Unavailable without CUDA; InvalidArgument for a null pointer; Internal on a device error.
absl::Status CopyToDeviceSync(void* device_dst, const void* host_src, size_t bytes, int device);

// The ordinal of the GPU that holds the device allocation `device_ptr` (cudaPointerGetAttributes).
// Unavailable without CUDA, InvalidArgument for a pointer that is not device memory.
absl::StatusOr<int> DeviceOf(const void* device_ptr);

// Why no device is usable (e.g. "CUDA driver version is insufficient..."), or "" when one is.
std::string NoDeviceReason();

}  // namespace hmoe::cuda
