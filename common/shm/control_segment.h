#pragma once

// The named control segment of a weightd instance, managed with Boost.Interprocess (a POSIX shm
// object "hmoe.<instance>.control", mode 0600): a ControlHeader followed by the serialized
// manifest. weightd creates and updates it; workers open it read-only. Boost stays out of this
// header; its exceptions stop in the .cc and become Status values.

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#include "common/shm/control_block.h"
#include "common/shm/data_segment.h"
#include "common/shm/manifest.h"

namespace boost::interprocess {
class mapped_region;
}  // namespace boost::interprocess

namespace hmoe::shm {

class ControlSegment {
 public:
  // Creates the segment with room for the header plus `manifest_capacity_bytes`, zeroed except
  // magic/version/header_bytes (state kEmpty). AlreadyExists when it exists.
  static absl::StatusOr<ControlSegment> Create(std::string_view instance,
                                               uint64_t manifest_capacity_bytes);
  // NotFound when no weightd has created it; PermissionDenied when it belongs to another user or
  // is readable by group/others; Unavailable when it is still being created; DataLoss on a bad
  // magic, version or size.
  static absl::StatusOr<ControlSegment> OpenReadOnly(std::string_view instance);
  // Same checks, mapped read-write (weightd adopting or cleaning up).
  static absl::StatusOr<ControlSegment> OpenReadWrite(std::string_view instance);
  // Unlinks the name; mappings stay valid. NotFound when absent.
  static absl::Status Remove(std::string_view instance);

  ControlSegment(ControlSegment&&) noexcept;
  ControlSegment& operator=(ControlSegment&&) noexcept;
  ControlSegment(const ControlSegment&) = delete;
  ControlSegment& operator=(const ControlSegment&) = delete;
  ~ControlSegment();

  const std::string& instance() const { return instance_; }
  const ControlHeader& header() const;
  // Only for read-write segments (HMOE_CHECKed).
  ControlHeader& mutable_header();

  StoreState LoadState() const;              // acquire
  void StoreStateRelease(StoreState state);  // release; read-write only
  int32_t LoadOwnerPid() const;
  void StoreOwnerPid(int32_t pid);

  // Copies `bytes` after the header and records offset/size/checksum. ResourceExhausted when they
  // exceed the capacity given at Create. Read-write only, before the state becomes kReady.
  absl::Status WriteManifest(std::string_view bytes);
  // The manifest of a ready store: FailedPrecondition unless state is kReady; DataLoss on a bad
  // checksum or unparsable bytes; the manifest's identity must equal the header's.
  absl::StatusOr<Manifest> ReadManifest() const;

 private:
  ControlSegment(std::string instance, bool writable,
                 std::unique_ptr<boost::interprocess::mapped_region> region);
  static absl::StatusOr<ControlSegment> Open(std::string_view instance, bool writable);

  std::string instance_;
  bool writable_ = false;
  std::unique_ptr<boost::interprocess::mapped_region> region_;
};

// The handle recorded in a slot, and the slot fields for a handle.
SegmentHandle HandleOf(const SegmentSlot& slot);
void SetHandle(const SegmentHandle& handle, SegmentSlot& slot);

// "hmoe.<instance>.g<generation>.s<index>": the /dev/shm name of a file-backed data segment.
std::string DataSegmentFileName(std::string_view instance, uint64_t generation, uint32_t index);

// Removes everything an instance left in shared memory: the data segments recorded in its control
// segment (only those that still belong to us and are the recorded instance) and the control
// segment itself. NotFound when the instance has no control segment. Existing mappings stay valid.
absl::Status RemoveInstance(std::string_view instance);

}  // namespace hmoe::shm
