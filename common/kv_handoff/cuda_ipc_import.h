#pragma once

// The GPU form of the KV hand-off (kv_handoff.h): the prefill worker's buffer is a device
// allocation (header then payload, the same bytes as a shared-memory hand-off) exported with
// cudaIpcGetMemHandle; the handle names the GPU that holds it by PCI bus id
// (KvHandleSpec::cuda_device). The decode worker:
//   1. finds that GPU among its visible ones (FailedPrecondition when it is not visible),
//   2. plans where to open the handle (PlanCudaIpcImport): on its own attention GPU when that is
//      the buffer's GPU or can map it through peer access, else on the buffer's GPU,
//   3. opens it (cudaIpcOpenMemHandle), learns the allocation's size (cuMemGetAddressRange), copies
//      the header's 64 bytes to the host and validates them (ValidateKvHandoffHeader) — closing
//      the handle on every failure,
//   4. on its own GPU: returns a source whose payload is the device pointer (KvCache::Import copies
//      it device-to-device into the paged pool, then the source closes the handle); otherwise
//      (attention on the CPU, or another GPU without peer access) copies the payload to host
//      memory, closes the handle at once and returns a host source (KvCache::Import copies it in).
// The caller then acknowledges as for shared memory, and the prefill worker frees the buffer.
//
// The CUDA calls go through CudaIpcRuntime so that everything above is compiled and tested on
// machines without a GPU (tests/decode_worker/cuda_ipc_import_test.cc uses a fake); the real
// runtime is a thin layer over common/kernels/cuda/cuda_backend.h (Unavailable without CUDA).

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#include "common/kv_handoff/kv_handoff.h"

namespace hmoe {

// The CUDA runtime calls of an import (see cuda_backend.h for each call's errors). Thread-safe.
class CudaIpcRuntime {
 public:
  virtual ~CudaIpcRuntime() = default;
  // This process's ordinal of the GPU with `pci_bus_id`; NotFound when none is visible.
  virtual absl::StatusOr<int> DeviceByPciBusId(const std::string& pci_bus_id) = 0;
  // Whether GPU `device` can map memory of GPU `peer`.
  virtual bool CanAccessPeer(int device, int peer) = 0;
  // Maps `handle` in GPU `device`'s context; the pointer to the allocation's first byte.
  virtual absl::StatusOr<void*> OpenMemHandle(std::string_view handle, int device) = 0;
  virtual absl::Status CloseMemHandle(void* device_ptr, int device) = 0;
  // Bytes of the allocation starting at `device_ptr` (Unimplemented when the driver cannot say).
  virtual absl::StatusOr<size_t> AllocationBytes(const void* device_ptr, int device) = 0;
  // Blocking device-to-host copy.
  virtual absl::Status CopyToHost(void* host_dst, const void* device_src, size_t bytes,
                                  int device) = 0;
};

// The real runtime (common/kernels/cuda/cuda_backend.h): every call Unavailable without CUDA.
std::unique_ptr<CudaIpcRuntime> NewCudaIpcRuntime();

// Where an import opens the handle and where the payload goes.
enum class CudaIpcRoute {
  kSameDevice,  // the buffer is on the importer's GPU: device-to-device into the pool
  kPeer,        // another GPU the importer's GPU can map (peer access): device-to-device over P2P
  kViaHost,     // importer on the CPU, or no peer access: device-to-host copy, then the pool
};
const char* CudaIpcRouteName(CudaIpcRoute route);

struct CudaIpcPlan {
  CudaIpcRoute route = CudaIpcRoute::kViaHost;
  int open_device = 0;  // the GPU whose context opens the handle
};

// `importer_device`: the importer's attention GPU (KvImportTarget::cuda_device; -1 for the CPU);
// `exporter_device`: this process's ordinal of the buffer's GPU; `can_access_peer`: whether the
// importer's GPU can map the exporter's (ignored when they are the same or the importer is -1).
CudaIpcPlan PlanCudaIpcImport(int importer_device, int exporter_device, bool can_access_peer);

// A KvImporter of CUDA IPC handles only (shared-memory handles are InvalidArgument). `runtime`
// must not be null; the importer and the sources it returns share it (a source may outlive the
// importer).
std::unique_ptr<KvImporter> NewCudaIpcKvImporter(const KvImportTarget& target,
                                                 std::unique_ptr<CudaIpcRuntime> runtime);

}  // namespace hmoe
