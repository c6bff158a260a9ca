#include "common/device/ring_buffer.h"

#include <cstdint>
#include <utility>

#include "absl/strings/str_cat.h"

#include "common/base/logging.h"
#include "common/base/status_macros.h"
#include "common/device/sync_internal.h"

namespace hmoe {
namespace {

constexpr size_t kSlotAlignment = DeviceRingBuffer::kSlotAlignment;
// What Device::Allocate guarantees (device.h); the ring adds the difference to reach a boundary.
constexpr size_t kDeviceAlignment = 64;
constexpr size_t kAlignmentMargin = DeviceRingBuffer::kAlignmentMargin;
static_assert(kAlignmentMargin == kSlotAlignment - kDeviceAlignment);

std::byte* AlignUp(void* p) {
  const auto address = reinterpret_cast<uintptr_t>(p);
  const uintptr_t aligned = (address + kSlotAlignment - 1) / kSlotAlignment * kSlotAlignment;
  return static_cast<std::byte*>(p) + (aligned - address);
}

}  // namespace

DeviceRingBuffer::DeviceRingBuffer(DeviceBuffer memory, size_t slot_bytes, int64_t num_slots)
    : memory_(std::move(memory)),
      base_(AlignUp(memory_.data())),
      slot_bytes_(slot_bytes),
      num_slots_(num_slots),
      busy_(num_slots, false) {
  HMOE_CHECK(base_ + slot_bytes_ * static_cast<size_t>(num_slots_) <=
             static_cast<std::byte*>(memory_.data()) + memory_.size_bytes())
      << "ring buffer: device allocation less than " << kDeviceAlignment << "-byte aligned";
}

absl::StatusOr<std::unique_ptr<DeviceRingBuffer>> DeviceRingBuffer::Create(Device& device,
                                                                           size_t slot_bytes,
                                                                           int64_t num_slots,
                                                                           absl::Time deadline) {
  if (slot_bytes == 0 || num_slots <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("ring buffer: ", num_slots, " slots of ", slot_bytes, " bytes"));
  }
  const size_t rounded = (slot_bytes + kSlotAlignment - 1) / kSlotAlignment * kSlotAlignment;
  HMOE_ASSIGN_OR_RETURN(DeviceBuffer memory,
                        device.AllocateBlocking(
                            rounded * static_cast<size_t>(num_slots) + kAlignmentMargin, deadline));
  return std::unique_ptr<DeviceRingBuffer>(
      new DeviceRingBuffer(std::move(memory), rounded, num_slots));
}

absl::StatusOr<DeviceRingBuffer::Slot> DeviceRingBuffer::Acquire(absl::Time deadline) {
  std::unique_lock<std::mutex> lock(mu_);
  // The next slot in ring order must be free. A timed-out Acquire does not use up its turn.
  auto ready = [this] { return !busy_[next_ % static_cast<uint64_t>(num_slots_)]; };
  if (!internal::WaitUntil(cv_, lock, deadline, ready)) {
    return absl::DeadlineExceededError(absl::StrCat("ring buffer: slot ",
                                                    next_ % static_cast<uint64_t>(num_slots_),
                                                    " not released before the deadline"));
  }
  Slot slot;
  slot.sequence = next_++;
  slot.index = static_cast<int64_t>(slot.sequence % static_cast<uint64_t>(num_slots_));
  slot.data = base_ + static_cast<size_t>(slot.index) * slot_bytes_;
  busy_[slot.index] = true;
  ++acquired_;
  return slot;
}

absl::Status DeviceRingBuffer::Release(const Slot& slot) {
  std::unique_lock<std::mutex> lock(mu_);
  if (slot.index < 0 || slot.index >= num_slots_ || !busy_[slot.index]) {
    return absl::FailedPreconditionError(
        absl::StrCat("ring buffer: release of slot ", slot.index, " which is not acquired"));
  }
  busy_[slot.index] = false;
  --acquired_;
  lock.unlock();
  cv_.notify_all();
  return absl::OkStatus();
}

int64_t DeviceRingBuffer::num_acquired() const {
  std::unique_lock<std::mutex> lock(mu_);
  return acquired_;
}

}  // namespace hmoe
