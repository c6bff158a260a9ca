#pragma once

// StreamArena: the fixed device budget that stream-loading prefill (SLP, paper §3.1) stages its
// non-expert modules in (attention blocks, dense MLPs, shared experts, the head). One device
// allocation of capacity_bytes made at creation, so streaming never calls the device allocator
// per module (docs/style.md §4: hot-path memory comes from pools sized at startup).
//
// Allocation is first-in first-out over a circular byte range: a block is placed right after the
// most recent live block, wrapping to offset 0 when the end of the arena is too short; space is
// reclaimed from the oldest live block on, so a block freed out of order only becomes reusable
// once every older block is freed as well. SLP's loader allocates in module order and the
// unloader frees in (nearly) the same order, which makes this both simple and tight. Liveness: a
// request of at most capacity_bytes always fits once every older block is freed (the arena is
// then empty and restarts at offset 0), so a loader blocked here is released by the unloader
// freeing what the model thread has finished with.
//
// Thread-safe: typically the loader allocates and the unloader frees.

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

#include "common/device/device.h"

namespace hmoe {

class StreamArena {
 public:
  // Block offsets and sizes are multiples of this.
  static constexpr size_t kAlignment = 256;

  struct Block {
    uint64_t id = 0;        // unique per arena (never 0 for a live block)
    size_t offset = 0;      // from the start of the arena
    size_t size_bytes = 0;  // rounded up to kAlignment
    void* data = nullptr;   // device pointer
  };

  // Allocates `capacity_bytes` (rounded up to kAlignment, > 0) from `device` (which must outlive
  // the arena) without waiting. InvalidArgument for 0; the device's ResourceExhausted otherwise.
  static absl::StatusOr<std::unique_ptr<StreamArena>> Create(Device& device, size_t capacity_bytes);

  // A block of `size_bytes` (> 0), waiting until it fits. ResourceExhausted at once when the
  // rounded size exceeds capacity_bytes() (it could never fit); DeadlineExceeded at `deadline`
  // (nothing is allocated then). InvalidArgument for 0 bytes.
  absl::StatusOr<Block> Allocate(size_t size_bytes, absl::Time deadline);
  // Returns `block` to the arena. FailedPrecondition when it is not live.
  absl::Status Free(const Block& block);
  // Forgets every live block (their users must be done with them).
  void Reset();

  size_t capacity_bytes() const { return capacity_; }
  // Bytes of live blocks (not counting space skipped at a wrap).
  size_t bytes_in_use() const;
  // Highest bytes_in_use() since creation or the last ResetPeak().
  size_t peak_bytes_in_use() const;
  void ResetPeak();
  int64_t num_live_blocks() const;

 private:
  struct Live {
    uint64_t id;
    size_t offset;
    size_t size;
    bool freed;
  };
  StreamArena(DeviceBuffer memory, size_t capacity);
  // Where a block of `size` (rounded) would go now, or SIZE_MAX when it does not fit. mu_ held.
  size_t PlaceLocked(size_t size) const;

  DeviceBuffer memory_;
  const size_t capacity_;
  // std::mutex, not absl::Mutex: see common/device/sync_internal.h. Guards everything below.
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Live> live_;  // allocation order, oldest first
  uint64_t next_id_ = 1;
  size_t in_use_ = 0;
  size_t peak_ = 0;
};

}  // namespace hmoe
