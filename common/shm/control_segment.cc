#include "common/shm/control_segment.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include <boost/interprocess/mapped_region.hpp>
#include <boost/interprocess/shared_memory_object.hpp>

#include "common/base/logging.h"
#include "common/base/status_macros.h"
#include "common/shm/data_segment.h"
#include "common/shm/model_identity.h"
#include "common/shm/shm_names.h"

namespace hmoe::shm {
namespace {

namespace bip = boost::interprocess;

// Boost.Interprocess reports failure by throwing; every call into it is wrapped and converted here.
absl::Status ToStatus(const bip::interprocess_exception& e, std::string_view what) {
  const std::string message = absl::StrCat(std::string(what), ": ", e.what());
  switch (e.get_error_code()) {
    case bip::already_exists_error:
      return absl::AlreadyExistsError(message);
    case bip::not_found_error:
    case bip::not_such_file_or_directory:
      return absl::NotFoundError(message);
    case bip::security_error:
      return absl::PermissionDeniedError(message);
    case bip::out_of_space_error:
    case bip::out_of_memory_error:
    case bip::out_of_resource_error:
      return absl::ResourceExhaustedError(message);
    default:
      if (e.get_native_error() == EACCES || e.get_native_error() == EPERM) {
        return absl::PermissionDeniedError(message);
      }
      if (e.get_native_error() == ENOENT) return absl::NotFoundError(message);
      return absl::InternalError(message);
  }
}

int64_t NowUnixNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// The control segment must be ours and private: anything else could redirect workers to weights
// another user controls.
absl::Status CheckOwnership(int fd, const std::string& name) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    return absl::InternalError(absl::StrCat("stat /dev/shm/", name, ": ", std::strerror(errno)));
  }
  if (st.st_uid != ::geteuid()) {
    return absl::PermissionDeniedError(absl::StrCat("control segment /dev/shm/", name,
                                                    " belongs to uid ", st.st_uid,
                                                    ", not to us (uid ", ::geteuid(), ")"));
  }
  if ((st.st_mode & 077) != 0) {
    return absl::PermissionDeniedError(absl::StrFormat(
        "control segment /dev/shm/%s has mode %04o; expected 0600", name, st.st_mode & 07777));
  }
  return absl::OkStatus();
}

}  // namespace

ControlSegment::ControlSegment(std::string instance, bool writable,
                               std::unique_ptr<bip::mapped_region> region)
    : instance_(std::move(instance)), writable_(writable), region_(std::move(region)) {}
ControlSegment::ControlSegment(ControlSegment&&) noexcept = default;
ControlSegment& ControlSegment::operator=(ControlSegment&&) noexcept = default;
ControlSegment::~ControlSegment() = default;

absl::StatusOr<ControlSegment> ControlSegment::Create(std::string_view instance,
                                                      uint64_t manifest_capacity_bytes) {
  HMOE_RETURN_IF_ERROR(ValidateInstanceName(instance));
  const std::string name = ControlSegmentName(instance);
  const uint64_t size = sizeof(ControlHeader) + manifest_capacity_bytes;
  try {
    bip::permissions perm;
    perm.set_permissions(0600);
    bip::shared_memory_object shm(bip::create_only, name.c_str(), bip::read_write, perm);
    shm.truncate(static_cast<bip::offset_t>(size));
    auto region = std::make_unique<bip::mapped_region>(shm, bip::read_write);
    ControlHeader header{};
    header.magic = kControlMagic;
    header.layout_version = kControlLayoutVersion;
    header.header_bytes = sizeof(ControlHeader);
    header.state = static_cast<uint32_t>(StoreState::kEmpty);
    header.created_unix_ns = NowUnixNs();
    header.creator_pid = ::getpid();
    for (SegmentSlot& slot : header.segments) slot = SegmentSlot{};
    std::memcpy(region->get_address(), &header, sizeof(header));
    return ControlSegment(std::string(instance), /*writable=*/true, std::move(region));
  } catch (const bip::interprocess_exception& e) {
    return ToStatus(e, absl::StrCat("create control segment /dev/shm/", name));
  }
}

absl::StatusOr<ControlSegment> ControlSegment::Open(std::string_view instance, bool writable) {
  HMOE_RETURN_IF_ERROR(ValidateInstanceName(instance));
  const std::string name = ControlSegmentName(instance);
  std::unique_ptr<bip::mapped_region> region;
  try {
    bip::shared_memory_object shm(bip::open_only, name.c_str(),
                                  writable ? bip::read_write : bip::read_only);
    HMOE_RETURN_IF_ERROR(CheckOwnership(shm.get_mapping_handle().handle, name));
    bip::offset_t size = 0;
    if (!shm.get_size(size) || size < static_cast<bip::offset_t>(sizeof(ControlHeader))) {
      return absl::UnavailableError(absl::StrCat("control segment /dev/shm/", name,
                                                 " is still being created (", size, " bytes)"));
    }
    region = std::make_unique<bip::mapped_region>(shm, writable ? bip::read_write : bip::read_only);
  } catch (const bip::interprocess_exception& e) {
    return ToStatus(e, absl::StrCat("open control segment /dev/shm/", name));
  }
  ControlSegment segment(std::string(instance), writable, std::move(region));
  const ControlHeader& h = segment.header();
  if (h.magic == 0) {
    return absl::UnavailableError(
        absl::StrCat("control segment /dev/shm/", name, " is still being created"));
  }
  if (h.magic != kControlMagic) {
    return absl::DataLossError(absl::StrCat("control segment /dev/shm/", name, ": bad magic"));
  }
  if (h.layout_version != kControlLayoutVersion || h.header_bytes != sizeof(ControlHeader)) {
    return absl::DataLossError(absl::StrCat(
        "control segment /dev/shm/", name, ": layout version ", h.layout_version, " (",
        h.header_bytes, "-byte header); this build reads version ", kControlLayoutVersion));
  }
  if (h.num_segments > kMaxSegments) {
    return absl::DataLossError(
        absl::StrCat("control segment /dev/shm/", name, ": ", h.num_segments, " segments"));
  }
  return segment;
}

absl::StatusOr<ControlSegment> ControlSegment::OpenReadOnly(std::string_view instance) {
  return Open(instance, /*writable=*/false);
}

absl::StatusOr<ControlSegment> ControlSegment::OpenReadWrite(std::string_view instance) {
  return Open(instance, /*writable=*/true);
}

absl::Status ControlSegment::Remove(std::string_view instance) {
  HMOE_RETURN_IF_ERROR(ValidateInstanceName(instance));
  const std::string name = ControlSegmentName(instance);
  try {
    if (!bip::shared_memory_object::remove(name.c_str())) {
      return absl::NotFoundError(
          absl::StrCat("remove control segment /dev/shm/", name, ": not found"));
    }
  } catch (const bip::interprocess_exception& e) {
    return ToStatus(e, absl::StrCat("remove control segment /dev/shm/", name));
  }
  return absl::OkStatus();
}

const ControlHeader& ControlSegment::header() const {
  return *static_cast<const ControlHeader*>(region_->get_address());
}

ControlHeader& ControlSegment::mutable_header() {
  HMOE_CHECK(writable_) << "control segment of " << instance_ << " is read-only";
  return *static_cast<ControlHeader*>(region_->get_address());
}

StoreState ControlSegment::LoadState() const {
  // Acquire pairs with the release in StoreStateRelease: a reader that sees kReady sees the
  // header and manifest written before it.
  auto& state = const_cast<uint32_t&>(header().state);
  return static_cast<StoreState>(std::atomic_ref<uint32_t>(state).load(std::memory_order_acquire));
}

void ControlSegment::StoreStateRelease(StoreState state) {
  std::atomic_ref<uint32_t>(mutable_header().state)
      .store(static_cast<uint32_t>(state), std::memory_order_release);
}

int32_t ControlSegment::LoadOwnerPid() const {
  auto& pid = const_cast<int32_t&>(header().owner_pid);
  // Relaxed: informational (who serves the store); nothing else is published through it.
  return std::atomic_ref<int32_t>(pid).load(std::memory_order_relaxed);
}

void ControlSegment::StoreOwnerPid(int32_t pid) {
  std::atomic_ref<int32_t>(mutable_header().owner_pid).store(pid, std::memory_order_relaxed);
}

absl::Status ControlSegment::WriteManifest(std::string_view bytes) {
  HMOE_CHECK(writable_) << "control segment of " << instance_ << " is read-only";
  const uint64_t capacity = region_->get_size() - sizeof(ControlHeader);
  if (bytes.size() > capacity) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "manifest of ", bytes.size(), " bytes exceeds the control segment's ", capacity));
  }
  auto* base = static_cast<char*>(region_->get_address());
  std::memcpy(base + sizeof(ControlHeader), bytes.data(), bytes.size());
  ControlHeader& h = mutable_header();
  h.manifest_offset = sizeof(ControlHeader);
  h.manifest_bytes = bytes.size();
  h.manifest_checksum = Checksum64(std::as_bytes(std::span(bytes.data(), bytes.size())));
  return absl::OkStatus();
}

absl::StatusOr<Manifest> ControlSegment::ReadManifest() const {
  const StoreState state = LoadState();
  if (state != StoreState::kReady) {
    return absl::FailedPreconditionError(absl::StrCat("weight store \"", instance_, "\" is ",
                                                      StoreStateName(static_cast<uint32_t>(state)),
                                                      ", not ready"));
  }
  const ControlHeader& h = header();
  const uint64_t size = region_->get_size();
  if (h.manifest_offset < sizeof(ControlHeader) || h.manifest_offset > size ||
      h.manifest_bytes > size - h.manifest_offset) {
    return absl::DataLossError(
        absl::StrCat("control segment of \"", instance_, "\": manifest outside the segment"));
  }
  const auto* base = static_cast<const std::byte*>(region_->get_address());
  std::span<const std::byte> bytes(base + h.manifest_offset, h.manifest_bytes);
  if (Checksum64(bytes) != h.manifest_checksum) {
    return absl::DataLossError(
        absl::StrCat("control segment of \"", instance_, "\": manifest checksum mismatch"));
  }
  absl::StatusOr<Manifest> manifest = Manifest::Parse(bytes);
  if (!manifest.ok()) {
    return Annotate(manifest.status(), absl::StrCat("control segment of \"", instance_, "\""));
  }
  if (manifest->identity.hi != h.identity_hi || manifest->identity.lo != h.identity_lo) {
    return absl::DataLossError(absl::StrCat("control segment of \"", instance_,
                                            "\": manifest identity differs from the header"));
  }
  return manifest;
}

SegmentHandle HandleOf(const SegmentSlot& slot) {
  SegmentHandle h;
  h.kind = static_cast<SegmentKind>(slot.kind);
  h.shm_id = slot.shm_id;
  h.file_name = std::string(slot.file_name, strnlen(slot.file_name, sizeof(slot.file_name)));
  return h;
}

void SetHandle(const SegmentHandle& handle, SegmentSlot& slot) {
  slot.kind = static_cast<uint32_t>(handle.kind);
  slot.shm_id = handle.shm_id;
  std::memset(slot.file_name, 0, sizeof(slot.file_name));
  std::memcpy(slot.file_name, handle.file_name.data(),
              std::min(handle.file_name.size(), sizeof(slot.file_name) - 1));
}

std::string DataSegmentFileName(std::string_view instance, uint64_t generation, uint32_t index) {
  return absl::StrCat("hmoe.", std::string(instance), ".g", generation, ".s", index);
}

absl::Status RemoveInstance(std::string_view instance) {
  {
    HMOE_ASSIGN_OR_RETURN(ControlSegment control, ControlSegment::OpenReadOnly(instance));
    const ControlHeader& h = control.header();
    for (uint32_t i = 0; i < h.num_segments; ++i) {
      const SegmentSlot& slot = h.segments[i];
      const SegmentHandle handle = HandleOf(slot);
      if (handle.kind == SegmentKind::kSysvHugetlb ? handle.shm_id < 0 : handle.file_name.empty()) {
        continue;
      }
      absl::StatusOr<DataSegment::Stat> st = DataSegment::StatSegment(handle);
      if (!st.ok()) continue;  // Already gone.
      if (st->uid != ::geteuid() || st->instance_id != slot.instance_id ||
          st->size_bytes != slot.size_bytes) {
        HMOE_LOG(WARNING) << "not removing " << handle.ToString() << ": it is no longer segment "
                          << i << " of instance " << std::string(instance);
        continue;
      }
      if (absl::Status s = DataSegment::Remove(handle); !s.ok() && !absl::IsNotFound(s)) {
        return s;
      }
    }
  }
  return ControlSegment::Remove(instance);
}

}  // namespace hmoe::shm
