#include "common/device/ring_buffer.h"

#include <utility>

#include "absl/strings/str_cat.h"

#include "common/base/status_macros.h"

namespace hmoe {
namespace {

constexpr size_t kSlotAlignment = 256;

}  // namespace

DeviceRingBuffer::DeviceRingBuffer(DeviceBuffer memory, size_t slot_bytes, int64_t num_slots)
    : memory_(std::move(memory)),
      slot_bytes_(slot_bytes),
      num_slots_(num_slots),
      busy_(num_slots, false) {}

absl::StatusOr<std::unique_ptr<DeviceRingBuffer>> DeviceRingBuffer::Create(Device& device,
                                                                           size_t slot_bytes,
                                                                           int64_t num_slots,
                                                                           absl::Time deadline) {
  if (slot_bytes == 0 || num_slots <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("ring buffer: ", num_slots, " slots of ",
                                                   slot_bytes, " bytes"));
  }
  const size_t rounded = (slot_bytes + kSlotAlignment - 1) / kSlotAlignment * kSlotAlignment;
  HMOE_ASSIGN_OR_RETURN(DeviceBuffer memory,
                        device.AllocateBlocking(rounded * static_cast<size_t>(num_slots), deadline));
  return std::unique_ptr<DeviceRingBuffer>(
      new DeviceRingBuffer(std::move(memory), rounded, num_slots));
}

absl::StatusOr<DeviceRingBuffer::Slot> DeviceRingBuffer::Acquire(absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  const uint64_t sequence = next_++;
  const int64_t index = static_cast<int64_t>(sequence % static_cast<uint64_t>(num_slots_));
  // Wait for our turn (earlier acquirers took their slots) and for our slot to be free.
  auto ready = [this, sequence, index]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return granted_ == sequence && !busy_[index];
  };
  if (!mu_.AwaitWithDeadline(absl::Condition(&ready), deadline)) {
    // Nobody can take slots past ours until we do; hand our turn to the next acquirer by
    // pretending we took and released the slot: we never touched it.
    cancelled_.push_back(sequence);
    AdvanceLocked();
    return absl::DeadlineExceededError(
        absl::StrCat("ring buffer: slot ", index, " not released before the deadline"));
  }
  busy_[index] = true;
  ++acquired_;
  ++granted_;
  AdvanceLocked();
  Slot slot;
  slot.index = index;
  slot.sequence = sequence;
  slot.data = static_cast<std::byte*>(memory_.data()) + static_cast<size_t>(index) * slot_bytes_;
  return slot;
}

void DeviceRingBuffer::AdvanceLocked() {
  bool progressed = true;
  while (progressed) {
    progressed = false;
    for (auto it = cancelled_.begin(); it != cancelled_.end(); ++it) {
      if (*it == granted_) {
        cancelled_.erase(it);
        ++granted_;
        progressed = true;
        break;
      }
    }
  }
}

absl::Status DeviceRingBuffer::Release(const Slot& slot) {
  absl::MutexLock lock(&mu_);
  if (slot.index < 0 || slot.index >= num_slots_ || !busy_[slot.index]) {
    return absl::FailedPreconditionError(
        absl::StrCat("ring buffer: release of slot ", slot.index, " which is not acquired"));
  }
  busy_[slot.index] = false;
  --acquired_;
  return absl::OkStatus();
}

int64_t DeviceRingBuffer::num_acquired() const {
  absl::MutexLock lock(&mu_);
  return acquired_;
}

}  // namespace hmoe
