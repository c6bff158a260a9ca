#include "prefill_worker/kv_exports.h"

#include <dirent.h>

#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

#include "common/base/logging.h"
#include "common/base/status_macros.h"
#include "common/kernels/cuda/cuda_backend.h"

namespace hmoe::prefill {
namespace {

// Late Release calls of expired exports get a precise NotFound for this many ids.
constexpr size_t kExpiredIdsKept = 1024;

class ShmExport final : public KvExport {
 public:
  ShmExport(KvHandoffSegment segment, KvHandleSpec spec)
      : segment_(std::move(segment)), spec_(std::move(spec)) {}
  ~ShmExport() override {
    // Unlink the name; a consumer that mapped the segment keeps its mapping. Our own mapping goes
    // with segment_.
    if (absl::Status s = KvHandoffSegment::Remove(spec_.shm_name); !s.ok()) {
      HMOE_LOG(WARNING) << "remove kv hand-off segment " << spec_.shm_name << ": " << s;
    }
  }
  const KvHandleSpec& handle() const override { return spec_; }
  size_t size_bytes() const override {
    return segment_.header().header_bytes + segment_.header().payload_bytes;
  }
  std::string description() const override { return absl::StrCat("shm:", spec_.shm_name); }
  KvHandoffSegment& segment() { return segment_; }

 private:
  KvHandoffSegment segment_;
  KvHandleSpec spec_;
};

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
  // Owned from here on: a failed copy unlinks the segment.
  auto out = std::make_unique<ShmExport>(std::move(segment), std::move(spec));
  HMOE_RETURN_IF_ERROR(
      cache.Export(seq, stream, out->segment().payload().data(), MemorySpace::kHost));
  HMOE_RETURN_IF_ERROR(stream.Synchronize());
  return std::unique_ptr<KvExport>(std::move(out));
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
  std::string id = worker_id;
  for (char& c : id) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '_' || c == '-' || c == '.';
    if (!ok) c = '_';
  }
  return absl::StrCat("hmoe-kv-", id.substr(0, 150), "-");
}

absl::StatusOr<int> RemoveStaleShmExports(std::string_view prefix) {
  HMOE_RETURN_IF_ERROR(ValidateKvHandoffName(prefix));
  if (prefix.size() < 8) {
    return absl::InvalidArgumentError(absl::StrCat("stale kv export prefix \"", std::string(prefix),
                                                   "\" is shorter than 8 characters"));
  }
  DIR* dir = ::opendir("/dev/shm");
  if (dir == nullptr) return 0;  // no POSIX shared memory mounted: nothing can be stale
  std::vector<std::string> names;
  while (const dirent* e = ::readdir(dir)) {
    if (std::string_view(e->d_name).starts_with(prefix)) names.emplace_back(e->d_name);
  }
  ::closedir(dir);
  int removed = 0;
  for (const std::string& name : names) {
    if (absl::Status s = KvHandoffSegment::Remove(name); s.ok()) {
      ++removed;
    } else if (!absl::IsNotFound(s)) {
      HMOE_LOG(WARNING) << "remove stale kv export " << name << ": " << s;
    }
  }
  return removed;
}

// ---------------------------------------------------------------------------------- ExportTable

ExportTable::ExportTable(absl::Duration timeout)
    : timeout_(timeout), reaper_([this] { ReaperLoop(); }) {}

ExportTable::~ExportTable() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (reaper_.joinable()) reaper_.join();
  std::map<std::string, Entry> left;
  {
    absl::MutexLock lock(&mu_);
    left.swap(exports_);
  }
  if (!left.empty()) {
    HMOE_LOG(INFO) << "freeing " << left.size() << " kv export(s) not released";
  }
}

absl::Status ExportTable::Add(const std::string& request_id, std::unique_ptr<KvExport> kv) {
  absl::MutexLock lock(&mu_);
  if (exports_.contains(request_id)) {
    return absl::AlreadyExistsError(
        absl::StrCat("request ", request_id, " already holds a kv export"));
  }
  bytes_ += static_cast<int64_t>(kv->size_bytes());
  exports_[request_id] = Entry{std::move(kv), absl::Now() + timeout_};
  expired_ids_.erase(request_id);
  return absl::OkStatus();
}

absl::Status ExportTable::Release(const std::string& request_id) {
  std::unique_ptr<KvExport> freed;  // destroyed (unlinked) after the lock is dropped
  {
    absl::MutexLock lock(&mu_);
    auto it = exports_.find(request_id);
    if (it == exports_.end()) {
      if (expired_ids_.contains(request_id)) {
        return absl::NotFoundError(absl::StrCat("request ", request_id,
                                                ": its kv export was freed by the timeout of ",
                                                absl::FormatDuration(timeout_)));
      }
      return absl::NotFoundError(absl::StrCat("request ", request_id, " holds no kv export"));
    }
    freed = std::move(it->second.kv);
    bytes_ -= static_cast<int64_t>(freed->size_bytes());
    exports_.erase(it);
  }
  HMOE_VLOG(1) << "req=" << request_id << " released " << freed->description();
  return absl::OkStatus();
}

bool ExportTable::Contains(const std::string& request_id) const {
  absl::MutexLock lock(&mu_);
  return exports_.contains(request_id);
}

int64_t ExportTable::count() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(exports_.size());
}

int64_t ExportTable::bytes() const {
  absl::MutexLock lock(&mu_);
  return bytes_;
}

int64_t ExportTable::expired() const {
  absl::MutexLock lock(&mu_);
  return expired_;
}

bool ExportTable::StopOrDue() const {
  if (stop_) return true;
  const absl::Time now = absl::Now();
  for (const auto& [id, e] : exports_) {
    if (e.deadline <= now) return true;
  }
  return false;
}

void ExportTable::ReaperLoop() {
  // Exports expire within about a tenth of the timeout of their deadline.
  const absl::Duration poll =
      std::clamp(timeout_ / 10, absl::Milliseconds(5), absl::Milliseconds(500));
  while (true) {
    std::vector<std::pair<std::string, std::unique_ptr<KvExport>>> due;
    {
      absl::MutexLock lock(&mu_);
      mu_.AwaitWithTimeout(absl::Condition(this, &ExportTable::StopOrDue), poll);
      if (stop_) return;
      const absl::Time now = absl::Now();
      for (auto it = exports_.begin(); it != exports_.end();) {
        if (it->second.deadline > now) {
          ++it;
          continue;
        }
        bytes_ -= static_cast<int64_t>(it->second.kv->size_bytes());
        ++expired_;
        if (expired_ids_.size() >= kExpiredIdsKept) expired_ids_.erase(expired_ids_.begin());
        expired_ids_[it->first] = now;
        due.emplace_back(it->first, std::move(it->second.kv));
        it = exports_.erase(it);
      }
    }
    for (auto& [id, kv] : due) {
      HMOE_LOG(WARNING) << "req=" << id << " kv export " << kv->description()
                        << " not released within " << absl::FormatDuration(timeout_)
                        << "; freeing it";
      kv.reset();
    }
  }
}

}  // namespace hmoe::prefill
