#include "common/kv_handoff/cuda_ipc_import.h"

#include <atomic>
#include <cstring>
#include <new>
#include <utility>

#include "absl/strings/str_cat.h"

#include "common/base/logging.h"
#include "common/base/status_macros.h"
#include "common/kernels/cuda/cuda_backend.h"

namespace hmoe {
namespace {

static_assert(kKvCudaIpcHandleBytes == cuda::kIpcMemHandleBytes);

class RealCudaIpcRuntime final : public CudaIpcRuntime {
 public:
  absl::StatusOr<int> DeviceByPciBusId(const std::string& pci_bus_id) override {
    return cuda::DeviceByPciBusId(pci_bus_id);
  }
  bool CanAccessPeer(int device, int peer) override { return cuda::CanAccessPeer(device, peer); }
  absl::StatusOr<void*> OpenMemHandle(std::string_view handle, int device) override {
    return cuda::IpcOpenMemHandle(handle, device);
  }
  absl::Status CloseMemHandle(void* device_ptr, int device) override {
    return cuda::IpcCloseMemHandle(device_ptr, device);
  }
  absl::StatusOr<size_t> AllocationBytes(const void* device_ptr, int device) override {
    return cuda::AllocationBytes(device_ptr, device);
  }
  absl::Status CopyToHost(void* host_dst, const void* device_src, size_t bytes,
                          int device) override {
    return cuda::CopyToHostSync(host_dst, device_src, bytes, device);
  }
};

// An open IPC mapping, closed when destroyed (logged on failure: nothing else can be done).
// Shares the runtime: a source may outlive the importer that opened it.
class IpcMapping {
 public:
  IpcMapping(std::shared_ptr<CudaIpcRuntime> runtime, void* ptr, int device)
      : runtime_(std::move(runtime)), ptr_(ptr), device_(device) {}
  IpcMapping(const IpcMapping&) = delete;
  IpcMapping& operator=(const IpcMapping&) = delete;
  ~IpcMapping() { (void)Close(); }

  const std::byte* data() const { return static_cast<const std::byte*>(ptr_); }
  int device() const { return device_; }
  absl::Status Close() {
    if (ptr_ == nullptr) return absl::OkStatus();
    absl::Status s = runtime_->CloseMemHandle(std::exchange(ptr_, nullptr), device_);
    if (!s.ok()) HMOE_LOG(WARNING) << "close kv hand-off cuda ipc mapping: " << s;
    return s;
  }

 private:
  std::shared_ptr<CudaIpcRuntime> runtime_;
  void* ptr_;
  int device_;
};

// The payload stays in the mapped device buffer (kSameDevice, kPeer).
class DeviceImportSource final : public KvImportSource {
 public:
  DeviceImportSource(std::unique_ptr<IpcMapping> mapping, const KvHandoffHeader& header,
                     std::string description)
      : mapping_(std::move(mapping)), header_(header), description_(std::move(description)) {}

  const KvHandoffHeader& header() const override { return header_; }
  std::span<const std::byte> payload() const override {
    return {mapping_->data() + header_.header_bytes, static_cast<size_t>(header_.payload_bytes)};
  }
  bool payload_on_device() const override { return true; }
  std::string description() const override { return description_; }

 private:
  std::unique_ptr<IpcMapping> mapping_;  // closed with the source
  KvHandoffHeader header_;
  std::string description_;
};

// The payload copied to host memory (kViaHost); the mapping is already closed.
class HostImportSource final : public KvImportSource {
 public:
  HostImportSource(std::unique_ptr<std::byte[]> payload, const KvHandoffHeader& header,
                   std::string description)
      : payload_(std::move(payload)), header_(header), description_(std::move(description)) {}

  const KvHandoffHeader& header() const override { return header_; }
  std::span<const std::byte> payload() const override {
    return {payload_.get(), static_cast<size_t>(header_.payload_bytes)};
  }
  bool payload_on_device() const override { return false; }
  std::string description() const override { return description_; }

 private:
  std::unique_ptr<std::byte[]> payload_;
  KvHandoffHeader header_;
  std::string description_;
};

// Prefixes a status message with what failed, keeping the code.
absl::Status Annotate(const absl::Status& s, absl::string_view what) {
  if (s.ok()) return s;
  return absl::Status(s.code(), absl::StrCat(what, ": ", s.message()));
}

class CudaIpcKvImporter final : public KvImporter {
 public:
  CudaIpcKvImporter(const KvImportTarget& target, std::unique_ptr<CudaIpcRuntime> runtime)
      : target_(target), runtime_(std::move(runtime)) {
    HMOE_CHECK(runtime_ != nullptr) << "cuda ipc kv importer without a runtime";
  }

  absl::StatusOr<std::unique_ptr<KvImportSource>> Open(const KvHandleSpec& handle,
                                                       const KvHandoffShape& expected) override {
    if (handle.kind != KvHandleSpec::Kind::kCudaIpc) {
      return absl::InvalidArgumentError("kv_handle: not a cuda ipc handle");
    }
    HMOE_RETURN_IF_ERROR(ValidateKvHandleSpec(handle, expected));
    const std::string where = absl::StrCat("kv hand-off cuda-ipc:", handle.cuda_device);
    absl::StatusOr<int> exporter = runtime_->DeviceByPciBusId(handle.cuda_device);
    if (absl::IsNotFound(exporter.status())) {
      return absl::FailedPreconditionError(absl::StrCat(
          "kv_handle.cuda_device: the GPU holding the kv cache (pci bus id ", handle.cuda_device,
          ") is not visible to this worker; give it that GPU too (CUDA_VISIBLE_DEVICES) or have "
          "the prefill worker export to shared memory (--kv-export shm): ",
          exporter.status().message()));
    }
    if (!exporter.ok()) return Annotate(exporter.status(), where);
    const bool peer = target_.cuda_device >= 0 && target_.cuda_device != *exporter &&
                      runtime_->CanAccessPeer(target_.cuda_device, *exporter);
    const CudaIpcPlan plan = PlanCudaIpcImport(target_.cuda_device, *exporter, peer);

    absl::StatusOr<void*> ptr = runtime_->OpenMemHandle(handle.cuda_ipc_handle, plan.open_device);
    if (!ptr.ok()) {
      return Annotate(ptr.status(), absl::StrCat("kv_handle.cuda_ipc_handle: open ", where,
                                                 " on cuda:", plan.open_device));
    }
    // From here on the mapping is closed on every path (IpcMapping's destructor).
    auto mapping = std::make_unique<IpcMapping>(runtime_, *ptr, plan.open_device);

    absl::StatusOr<size_t> allocation = runtime_->AllocationBytes(*ptr, plan.open_device);
    if (allocation.ok() && *allocation < sizeof(KvHandoffHeader)) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": buffer of ", *allocation, " bytes, less than its header"));
    }
    KvHandoffHeader header;
    HMOE_RETURN_IF_ERROR(
        Annotate(runtime_->CopyToHost(&header, mapping->data(), sizeof(header), plan.open_device),
                 absl::StrCat(where, ": read header")));
    if (header.magic != kKvHandoffMagic) {
      // A handle the driver still opens after the exporter freed the buffer (found on an H100:
      // an expired export opened fine): freed (the exporter cleared the magic) or reused.
      return absl::NotFoundError(absl::StrCat(
          "kv_handle.cuda_ipc_handle: ", where,
          header.magic == kKvHandoffFreedMagic
              ? ": the exporter freed this hand-off (it expired or was released)"
              : ": no live hand-off behind this handle (the buffer was freed and reused)"));
    }
    uint64_t buffer_bytes = 0;
    if (allocation.ok()) {
      buffer_bytes = *allocation;
    } else {
      // Best effort: without the driver's answer the header (checked against the expected shape
      // and token count below) is all there is. The exporter allocates exactly its size.
      if (!warned_.exchange(true)) {
        HMOE_LOG(WARNING) << "kv hand-off: cannot query the size of cuda ipc buffers ("
                          << allocation.status() << "); trusting their headers";
      }
      buffer_bytes = header.header_bytes + header.payload_bytes;
    }
    HMOE_RETURN_IF_ERROR(
        ValidateKvHandoffHeader(header, expected, handle.num_tokens, buffer_bytes));

    const std::string description =
        absl::StrCat("cuda-ipc:", handle.cuda_device, " (", CudaIpcRouteName(plan.route), ")");
    if (plan.route != CudaIpcRoute::kViaHost) {
      return std::unique_ptr<KvImportSource>(
          std::make_unique<DeviceImportSource>(std::move(mapping), header, description));
    }
    std::unique_ptr<std::byte[]> payload(new (std::nothrow) std::byte[header.payload_bytes]);
    if (payload == nullptr) {
      return absl::ResourceExhaustedError(absl::StrCat(where, ": no host memory for a payload of ",
                                                       header.payload_bytes, " bytes"));
    }
    HMOE_RETURN_IF_ERROR(
        Annotate(runtime_->CopyToHost(payload.get(), mapping->data() + header.header_bytes,
                                      header.payload_bytes, plan.open_device),
                 absl::StrCat(where, ": copy payload to host")));
    HMOE_RETURN_IF_ERROR(mapping->Close());
    return std::unique_ptr<KvImportSource>(
        std::make_unique<HostImportSource>(std::move(payload), header, description));
  }

 private:
  const KvImportTarget target_;
  // Shared with the mappings of the sources it returned (they may outlive the importer).
  const std::shared_ptr<CudaIpcRuntime> runtime_;
  std::atomic<bool> warned_{false};
};

// Shared-memory handles to one importer, CUDA IPC handles to the other.
class DispatchingKvImporter final : public KvImporter {
 public:
  explicit DispatchingKvImporter(const KvImportTarget& target)
      : shm_(NewShmKvImporter()), cuda_(NewCudaIpcKvImporter(target, NewCudaIpcRuntime())) {}

  absl::StatusOr<std::unique_ptr<KvImportSource>> Open(const KvHandleSpec& handle,
                                                       const KvHandoffShape& expected) override {
    return handle.kind == KvHandleSpec::Kind::kCudaIpc ? cuda_->Open(handle, expected)
                                                       : shm_->Open(handle, expected);
  }

 private:
  std::unique_ptr<KvImporter> shm_;
  std::unique_ptr<KvImporter> cuda_;
};

}  // namespace

std::unique_ptr<CudaIpcRuntime> NewCudaIpcRuntime() {
  return std::make_unique<RealCudaIpcRuntime>();
}

const char* CudaIpcRouteName(CudaIpcRoute route) {
  switch (route) {
    case CudaIpcRoute::kSameDevice:
      return "same device";
    case CudaIpcRoute::kPeer:
      return "peer";
    case CudaIpcRoute::kViaHost:
      return "via host";
  }
  return "?";
}

CudaIpcPlan PlanCudaIpcImport(int importer_device, int exporter_device, bool can_access_peer) {
  if (importer_device == exporter_device) return {CudaIpcRoute::kSameDevice, importer_device};
  if (importer_device >= 0 && can_access_peer) return {CudaIpcRoute::kPeer, importer_device};
  return {CudaIpcRoute::kViaHost, exporter_device};
}

std::unique_ptr<KvImporter> NewCudaIpcKvImporter(const KvImportTarget& target,
                                                 std::unique_ptr<CudaIpcRuntime> runtime) {
  return std::make_unique<CudaIpcKvImporter>(target, std::move(runtime));
}

std::unique_ptr<KvImporter> NewKvImporter(const KvImportTarget& target) {
  return std::make_unique<DispatchingKvImporter>(target);
}

}  // namespace hmoe
