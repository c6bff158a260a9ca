#pragma once

// Byte accounting with a budget, shared by every Device implementation (CpuDevice, CudaDevice):
// Reserve fails past the budget, ReserveBlocking waits (FIFO) until releases make room. The
// device reserves before it allocates and releases after it frees.

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
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
  absl::Status Reserve(size_t bytes, const char* what) ABSL_LOCKS_EXCLUDED(mu_);
  // Waits until `bytes` fit and every earlier blocked request was served. ResourceExhausted at
  // once when bytes > budget (it could never fit); DeadlineExceeded at `deadline`.
  absl::Status ReserveBlocking(size_t bytes, absl::Time deadline, const char* what)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Returns bytes previously reserved.
  void Release(size_t bytes) ABSL_LOCKS_EXCLUDED(mu_);

  size_t budget_bytes() const { return budget_; }
  size_t bytes_in_use() const ABSL_LOCKS_EXCLUDED(mu_);
  size_t peak_bytes_in_use() const ABSL_LOCKS_EXCLUDED(mu_);
  void ResetPeak() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  bool FitsLocked(size_t bytes) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return bytes <= budget_ - in_use_;
  }

  // Advances served_ past abandoned (timed-out) tickets at the head of the line.
  void SkipAbandonedLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const size_t budget_;
  mutable absl::Mutex mu_;
  size_t in_use_ ABSL_GUARDED_BY(mu_) = 0;
  size_t peak_ ABSL_GUARDED_BY(mu_) = 0;
  // FIFO tickets of blocked requests: a request may proceed when its ticket is served_.
  uint64_t next_ticket_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t served_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<uint64_t> abandoned_ ABSL_GUARDED_BY(mu_);
};

}  // namespace hmoe
