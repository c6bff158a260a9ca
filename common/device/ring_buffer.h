#pragma once

// A ring of equal-sized device memory slots, for SLP's experts ring buffer (paper §3.1): one
// allocation of num_slots * slot_bytes made at creation, so streaming 10^4 expert tensors does
// not allocate per tensor. Slots are handed out strictly in ring order (slot 0, 1, ..., n-1, 0,
// ...): Acquire waits until the next slot in order has been released. Release may come in any
// order (a slot becomes acquirable again when released). Thread-safe: typically the loader
// acquires and the unloader releases.
//
// Slots start at 256-byte boundaries (what a cudaMalloc'ed tensor gets, and what vector loads and
// DMA like best). Device::Allocate promises only 64-byte alignment (CpuDevice gives no more), so
// the ring takes up to 192 bytes more than num_slots * slot_bytes and starts at the first 256-byte
// boundary of its allocation.

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

#include "common/device/device.h"

namespace hmoe {

class DeviceRingBuffer {
 public:
  // Slot alignment, and the most the ring adds to num_slots * slot_bytes to reach it.
  static constexpr size_t kSlotAlignment = 256;
  static constexpr size_t kAlignmentMargin = kSlotAlignment - 64;

  struct Slot {
    int64_t index = -1;     // 0 .. num_slots - 1
    uint64_t sequence = 0;  // how many slots were acquired before this one
    void* data = nullptr;   // device pointer, slot_bytes long, 256-byte aligned
  };

  // slot_bytes() is `slot_bytes` rounded up to a multiple of 256.
  // Allocates footprint_bytes() from `device` (which must outlive it) with
  // AllocateBlocking(deadline).
  // InvalidArgument for zero sizes; the device's allocation errors otherwise.
  static absl::StatusOr<std::unique_ptr<DeviceRingBuffer>> Create(
      Device& device, size_t slot_bytes, int64_t num_slots,
      absl::Time deadline = absl::InfinitePast());

  // The next slot in ring order, waiting until it is free. DeadlineExceeded at `deadline` (the
  // turn is kept: the next Acquire waits for the same slot). Concurrent acquirers take
  // consecutive slots in an unspecified order.
  absl::StatusOr<Slot> Acquire(absl::Time deadline = absl::InfiniteFuture());
  // Returns `slot` to the ring. FailedPrecondition when it is not currently acquired.
  absl::Status Release(const Slot& slot);

  size_t slot_bytes() const { return slot_bytes_; }
  int64_t num_slots() const { return num_slots_; }
  // Device bytes the ring holds: num_slots() * slot_bytes() plus the alignment margin (< 256).
  size_t footprint_bytes() const { return memory_.size_bytes(); }
  int64_t num_acquired() const;

 private:
  DeviceRingBuffer(DeviceBuffer memory, size_t slot_bytes, int64_t num_slots);

  DeviceBuffer memory_;
  std::byte* base_;          // the first 256-byte boundary in memory_: slot 0
  const size_t slot_bytes_;  // rounded up to 256
  const int64_t num_slots_;
  // std::mutex, not absl::Mutex: see common/device/sync_internal.h. Guards everything below.
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<bool> busy_;
  uint64_t next_ = 0;  // sequence number of the next Acquire
  int64_t acquired_ = 0;
};

}  // namespace hmoe
