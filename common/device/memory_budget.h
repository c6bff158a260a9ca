#pragma once

// Byte accounting with a budget, shared by every Device implementation (CpuDevice, CudaDevice):
// Reserve fails past the budget, ReserveBlocking waits (FIFO) until releases make room. The
// device reserves before it allocates and releases after it frees.

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"

namespace hmoe {

// Thread-safe.
class MemoryBudget {
 public:
  // budget_bytes == SIZE_MAX: unlimited.
  explicit MemoryBudget(size_t budget_bytes) : budget_(budget_bytes) {}
  MemoryBudget(const MemoryBudget&) = delete;
  MemoryBudget& operator=(const MemoryBudget&) = delete;

  // Counts `bytes` as in use, or ResourceExhausted (naming `what`) when they do not fit now.
  // Does not jump ahead of blocked ReserveBlocking callers.
  absl::Status Reserve(size_t bytes, const char* what);
  // Waits until `bytes` fit and every earlier blocked request was served. ResourceExhausted at
  // once when bytes > budget (it could never fit); DeadlineExceeded at `deadline`.
  absl::Status ReserveBlocking(size_t bytes, absl::Time deadline, const char* what);
  // Returns bytes previously reserved.
  void Release(size_t bytes);

  size_t budget_bytes() const { return budget_; }
  size_t bytes_in_use() const;
  size_t peak_bytes_in_use() const;
  void ResetPeak();

 private:
  // The *Locked methods need mu_ held.
  bool FitsLocked(size_t bytes) const { return bytes <= budget_ - in_use_; }

  // Advances served_ past abandoned (timed-out) tickets at the head of the line.
  void SkipAbandonedLocked();

  const size_t budget_;
  // std::mutex, not absl::Mutex: see common/device/sync_internal.h. Guards everything below.
  mutable std::mutex mu_;
  std::condition_variable cv_;
  size_t in_use_ = 0;
  size_t peak_ = 0;
  // FIFO tickets of blocked requests: a request may proceed when its ticket is served_.
  uint64_t next_ticket_ = 0;
  uint64_t served_ = 0;
  std::vector<uint64_t> abandoned_;
};

}  // namespace hmoe
