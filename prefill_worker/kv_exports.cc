#include "prefill_worker/kv_exports.h"

#include <utility>

#include "absl/strings/str_cat.h"

#include "common/base/logging.h"
#include "common/base/status_macros.h"
#include "common/kernels/cuda/cuda_backend.h"

namespace hmoe::prefill {
namespace {

class DeviceExport final : public KvExport {
 public:
  DeviceExport(DeviceBuffer buffer, KvHandleSpec spec, std::string device)
      : buffer_(std::move(buffer)), spec_(std::move(spec)), device_(std::move(device)) {}
  // Clears the magic before the buffer is freed: the driver may still open this handle after
  // cudaFree (seen on an H100), and a late importer must see "freed", not a valid hand-off.
  ~DeviceExport() override {
    if (buffer_.data() == nullptr) return;
    absl::StatusOr<int> ordinal = cuda::DeviceOf(buffer_.data());
    absl::Status s = ordinal.status();
    if (ordinal.ok()) {
      s = cuda::CopyToDeviceSync(buffer_.data(), &kKvHandoffFreedMagic,
                                 sizeof(kKvHandoffFreedMagic), *ordinal);
    }
    if (!s.ok()) HMOE_LOG(WARNING) << "kv export " << description() << ": clear magic: " << s;
  }
  const KvHandleSpec& handle() const override { return spec_; }
  size_t size_bytes() const override { return buffer_.size_bytes(); }
  std::string description() const override { return absl::StrCat("cuda-ipc:", device_); }

 private:
  DeviceBuffer buffer_;
  KvHandleSpec spec_;
  std::string device_;
};

}  // namespace

KvHandoffShape HandoffShapeOf(const KvCacheConfig& config) {
  KvHandoffShape shape;
  shape.num_layers = static_cast<uint32_t>(config.num_layers);
  shape.kv_lora_rank = static_cast<uint32_t>(config.kv_lora_rank);
  shape.rope_dim = static_cast<uint32_t>(config.rope_dim);
  return shape;
}

absl::StatusOr<std::unique_ptr<KvExport>> ExportToShm(KvCache& cache, const KvSequence& seq,
                                                      Stream& stream, const std::string& name) {
  const int64_t n = seq.num_tokens();
  HMOE_ASSIGN_OR_RETURN(KvHandoffSegment segment,
                        KvHandoffSegment::Create(name, HandoffShapeOf(cache.config()), n));
  KvHandleSpec spec;
  spec.kind = KvHandleSpec::Kind::kShm;
  spec.shm_name = name;
  spec.num_tokens = n;
  spec.layout_version = kKvHandoffLayoutVersion;
  std::byte* payload = segment.payload().data();
  // Owned from here on: a failed copy unlinks the segment.
  std::unique_ptr<KvExport> out = NewShmExport(std::move(segment), std::move(spec));
  HMOE_RETURN_IF_ERROR(cache.Export(seq, stream, payload, MemorySpace::kHost));
  HMOE_RETURN_IF_ERROR(stream.Synchronize());
  return out;
}

absl::StatusOr<std::unique_ptr<KvExport>> ExportToCudaIpc(KvCache& cache, const KvSequence& seq,
                                                          Stream& stream) {
  Device& device = cache.device();
  if (device.kind() != DeviceKind::kCuda) {
    return absl::UnavailableError(
        absl::StrCat("cuda ipc kv export needs a CUDA device, not ", device.name()));
  }
  const int64_t n = seq.num_tokens();
  if (n < 1) return absl::InvalidArgumentError("kv export of an empty sequence");
  const KvHandoffHeader header = MakeKvHandoffHeader(HandoffShapeOf(cache.config()), n);
  HMOE_ASSIGN_OR_RETURN(DeviceBuffer buffer,
                        device.Allocate(header.header_bytes + header.payload_bytes));
  HMOE_RETURN_IF_ERROR(device.CopyToDevice(stream, buffer.data(), &header, sizeof(header)));
  HMOE_RETURN_IF_ERROR(cache.Export(seq, stream, buffer.as<std::byte>() + header.header_bytes,
                                    MemorySpace::kDevice));
  HMOE_RETURN_IF_ERROR(stream.Synchronize());  // `header` is a host local
  KvHandleSpec spec;
  spec.kind = KvHandleSpec::Kind::kCudaIpc;
  HMOE_ASSIGN_OR_RETURN(spec.cuda_ipc_handle, cuda::IpcMemHandle(buffer.data()));
  HMOE_ASSIGN_OR_RETURN(spec.cuda_device, cuda::PciBusIdOf(buffer.data()));
  spec.num_tokens = n;
  spec.layout_version = kKvHandoffLayoutVersion;
  return std::unique_ptr<KvExport>(
      std::make_unique<DeviceExport>(std::move(buffer), std::move(spec), device.name()));
}

std::string ExportPrefix(const std::string& worker_id) {
  return KvExportNamePrefix("kv", worker_id);
}

}  // namespace hmoe::prefill
