#include "common/kv_handoff/kv_handoff.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

#include "common/base/errno_status.h"
#include "common/base/logging.h"
#include "common/base/status_macros.h"

namespace hmoe {
namespace {

std::string ShmPath(std::string_view name) { return absl::StrCat("/", std::string(name)); }

absl::Status Mismatch(absl::string_view field, uint64_t got, uint64_t want) {
  return absl::InvalidArgumentError(
      absl::StrCat("kv hand-off header: ", field, " ", got, ", expected ", want));
}

// A read-only mapping of a hand-off segment.
class ShmImportSource final : public KvImportSource {
 public:
  ShmImportSource(std::string name, const void* base, size_t size_bytes)
      : name_(std::move(name)), base_(base), size_bytes_(size_bytes) {}
  ~ShmImportSource() override { ::munmap(const_cast<void*>(base_), size_bytes_); }

  const KvHandoffHeader& header() const override {
    return *static_cast<const KvHandoffHeader*>(base_);
  }
  std::span<const std::byte> payload() const override {
    const KvHandoffHeader& h = header();
    return {static_cast<const std::byte*>(base_) + h.header_bytes,
            static_cast<size_t>(h.payload_bytes)};
  }
  bool payload_on_device() const override { return false; }
  std::string description() const override { return absl::StrCat("shm:", name_); }

 private:
  std::string name_;
  const void* base_;
  size_t size_bytes_;
};

class ShmKvImporter final : public KvImporter {
 public:
  absl::StatusOr<std::unique_ptr<KvImportSource>> Open(const KvHandleSpec& handle,
                                                       const KvHandoffShape& expected) override {
    if (handle.kind == KvHandleSpec::Kind::kCudaIpc) {
      return absl::UnavailableError(
          "kv_handle.cuda_ipc_handle: this worker imports shared-memory hand-offs only (no CUDA "
          "attention device)");
    }
    HMOE_RETURN_IF_ERROR(ValidateKvHandleSpec(handle, expected));
    const std::string path = ShmPath(handle.shm_name);
    const int fd = ::shm_open(path.c_str(), O_RDONLY | O_CLOEXEC, 0);
    if (fd < 0) return ErrnoStatus(errno, absl::StrCat("open kv hand-off segment ", path));
    struct stat st {};
    if (::fstat(fd, &st) != 0) {
      const int err = errno;
      ::close(fd);
      return ErrnoStatus(err, absl::StrCat("stat kv hand-off segment ", path));
    }
    if (st.st_uid != ::geteuid() || (st.st_mode & 077) != 0) {
      ::close(fd);
      return absl::PermissionDeniedError(
          absl::StrCat("kv hand-off segment ", path, " must be owned by uid ", ::geteuid(),
                       " and not accessible to group/others (uid ", st.st_uid, ", mode ",
                       absl::StrFormat("%04o", st.st_mode & 0777), ")"));
    }
    const auto size = static_cast<size_t>(st.st_size);
    if (size < sizeof(KvHandoffHeader)) {
      ::close(fd);
      return absl::InvalidArgumentError(absl::StrCat("kv hand-off segment ", path, " has ", size,
                                                     " bytes, less than its header"));
    }
    void* base = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
    const int map_err = errno;
    ::close(fd);  // The mapping keeps the object alive.
    if (base == MAP_FAILED) {
      return ErrnoStatus(map_err, absl::StrCat("map kv hand-off segment ", path));
    }
    auto source = std::make_unique<ShmImportSource>(handle.shm_name, base, size);
    HMOE_RETURN_IF_ERROR(
        ValidateKvHandoffHeader(source->header(), expected, handle.num_tokens, size));
    return source;
  }
};

}  // namespace

uint64_t KvHandoffShape::PayloadBytes(int64_t num_tokens) const {
  return static_cast<uint64_t>(num_tokens) * num_layers * (uint64_t{kv_lora_rank} + rope_dim) *
         sizeof(float);
}

KvHandoffHeader MakeKvHandoffHeader(const KvHandoffShape& shape, int64_t num_tokens) {
  KvHandoffHeader h;
  h.layout_version = shape.layout_version;
  h.num_layers = shape.num_layers;
  h.kv_lora_rank = shape.kv_lora_rank;
  h.rope_dim = shape.rope_dim;
  h.dtype = shape.dtype;
  h.num_tokens = static_cast<uint64_t>(num_tokens);
  h.header_bytes = sizeof(KvHandoffHeader);
  h.payload_bytes = shape.PayloadBytes(num_tokens);
  return h;
}

absl::Status ValidateKvHandoffHeader(const KvHandoffHeader& h, const KvHandoffShape& expected,
                                     int64_t expected_num_tokens, uint64_t buffer_bytes) {
  if (h.magic != kKvHandoffMagic) {
    return absl::InvalidArgumentError("kv hand-off header: bad magic (not a kv hand-off buffer)");
  }
  if (h.header_version != kKvHandoffHeaderVersion) {
    return Mismatch("header_version", h.header_version, kKvHandoffHeaderVersion);
  }
  if (h.layout_version != expected.layout_version) {
    return Mismatch("layout_version", h.layout_version, expected.layout_version);
  }
  if (h.num_layers != expected.num_layers) {
    return Mismatch("num_layers", h.num_layers, expected.num_layers);
  }
  if (h.kv_lora_rank != expected.kv_lora_rank) {
    return Mismatch("kv_lora_rank", h.kv_lora_rank, expected.kv_lora_rank);
  }
  if (h.rope_dim != expected.rope_dim) return Mismatch("rope_dim", h.rope_dim, expected.rope_dim);
  if (h.dtype != expected.dtype) return Mismatch("dtype", h.dtype, expected.dtype);
  if (h.num_tokens != static_cast<uint64_t>(expected_num_tokens)) {
    return Mismatch("num_tokens", h.num_tokens, static_cast<uint64_t>(expected_num_tokens));
  }
  if (h.header_bytes < sizeof(KvHandoffHeader) || h.header_bytes % 64 != 0) {
    return Mismatch("header_bytes", h.header_bytes, sizeof(KvHandoffHeader));
  }
  const uint64_t want_payload = expected.PayloadBytes(expected_num_tokens);
  if (h.payload_bytes != want_payload) {
    return Mismatch("payload_bytes", h.payload_bytes, want_payload);
  }
  if (h.header_bytes > buffer_bytes || buffer_bytes - h.header_bytes < h.payload_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("kv hand-off buffer of ", buffer_bytes,
                                                   " bytes is shorter than its header says (",
                                                   h.header_bytes + h.payload_bytes, ")"));
  }
  return absl::OkStatus();
}

absl::Status ValidateKvHandoffName(std::string_view name) {
  if (name.empty() || name.size() > 200) {
    return absl::InvalidArgumentError(
        absl::StrCat("kv_handle.shm_name: must be 1..200 characters, got ", name.size()));
  }
  for (char c : name) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '_' || c == '-' || c == '.';
    if (!ok) {
      return absl::InvalidArgumentError(absl::StrCat("kv_handle.shm_name: \"", std::string(name),
                                                     "\" has characters outside [A-Za-z0-9_.-]"));
    }
  }
  if (name == "." || name == "..") {
    return absl::InvalidArgumentError("kv_handle.shm_name: must not be . or ..");
  }
  return absl::OkStatus();
}

absl::Status ValidateKvHandleSpec(const KvHandleSpec& handle, const KvHandoffShape& expected) {
  if (handle.kind == KvHandleSpec::Kind::kShm) {
    HMOE_RETURN_IF_ERROR(ValidateKvHandoffName(handle.shm_name));
  } else {
    if (handle.cuda_ipc_handle.size() != kKvCudaIpcHandleBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("kv_handle.cuda_ipc_handle: ", handle.cuda_ipc_handle.size(),
                       " bytes, expected ", kKvCudaIpcHandleBytes));
    }
    const std::string& bus = handle.cuda_device;
    const bool bus_ok = !bus.empty() && bus.size() <= 64 &&
                        bus.find_first_not_of("0123456789abcdefABCDEF:.") == std::string::npos;
    if (!bus_ok) {
      return absl::InvalidArgumentError(
          absl::StrCat("kv_handle.cuda_device: \"", bus,
                       "\" is not a PCI bus id (like 0000:65:00.0) of the exporting GPU"));
    }
  }
  if (handle.num_tokens < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("kv_handle.num_tokens: ", handle.num_tokens, " must be >= 1"));
  }
  if (handle.layout_version != expected.layout_version) {
    return absl::InvalidArgumentError(
        absl::StrCat("kv_handle.layout_version: ", handle.layout_version, ", this worker reads ",
                     expected.layout_version));
  }
  return absl::OkStatus();
}

// ------------------------------------------------------------------------ KvHandoffSegment

absl::StatusOr<KvHandoffSegment> KvHandoffSegment::Create(std::string_view name,
                                                          const KvHandoffShape& shape,
                                                          int64_t num_tokens) {
  HMOE_RETURN_IF_ERROR(ValidateKvHandoffName(name));
  if (num_tokens < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("kv hand-off: num_tokens ", num_tokens, " must be >= 1"));
  }
  const KvHandoffHeader header = MakeKvHandoffHeader(shape, num_tokens);
  const size_t size = header.header_bytes + header.payload_bytes;
  const std::string path = ShmPath(name);
  const int fd = ::shm_open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) return ErrnoStatus(errno, absl::StrCat("create kv hand-off segment ", path));
  if (::ftruncate(fd, static_cast<off_t>(size)) != 0) {
    const int err = errno;
    ::close(fd);
    ::shm_unlink(path.c_str());
    return ErrnoStatus(err, absl::StrCat("size kv hand-off segment ", path));
  }
  void* base = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int map_err = errno;
  ::close(fd);
  if (base == MAP_FAILED) {
    ::shm_unlink(path.c_str());
    return ErrnoStatus(map_err, absl::StrCat("map kv hand-off segment ", path));
  }
  std::memcpy(base, &header, sizeof(header));
  return KvHandoffSegment(std::string(name), base, size);
}

absl::Status KvHandoffSegment::Remove(std::string_view name) {
  HMOE_RETURN_IF_ERROR(ValidateKvHandoffName(name));
  const std::string path = ShmPath(name);
  if (::shm_unlink(path.c_str()) != 0) {
    return ErrnoStatus(errno, absl::StrCat("remove kv hand-off segment ", path));
  }
  return absl::OkStatus();
}

KvHandoffSegment::KvHandoffSegment(KvHandoffSegment&& other) noexcept
    : name_(std::move(other.name_)),
      base_(std::exchange(other.base_, nullptr)),
      size_bytes_(std::exchange(other.size_bytes_, 0)) {}

KvHandoffSegment& KvHandoffSegment::operator=(KvHandoffSegment&& other) noexcept {
  if (this != &other) {
    Unmap();
    name_ = std::move(other.name_);
    base_ = std::exchange(other.base_, nullptr);
    size_bytes_ = std::exchange(other.size_bytes_, 0);
  }
  return *this;
}

KvHandoffSegment::~KvHandoffSegment() { Unmap(); }

void KvHandoffSegment::Unmap() {
  if (base_ != nullptr && ::munmap(base_, size_bytes_) != 0) {
    HMOE_LOG(WARNING) << "munmap kv hand-off segment " << name_ << ": " << std::strerror(errno);
  }
  base_ = nullptr;
  size_bytes_ = 0;
}

const KvHandoffHeader& KvHandoffSegment::header() const {
  return *static_cast<const KvHandoffHeader*>(base_);
}

std::span<std::byte> KvHandoffSegment::payload() {
  const KvHandoffHeader& h = header();
  return {static_cast<std::byte*>(base_) + h.header_bytes, static_cast<size_t>(h.payload_bytes)};
}

std::unique_ptr<KvImporter> NewShmKvImporter() { return std::make_unique<ShmKvImporter>(); }

}  // namespace hmoe
