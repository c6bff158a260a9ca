#include "common/device/memory_budget.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

#include "common/device/sync_internal.h"

namespace hmoe {

absl::Status MemoryBudget::Reserve(size_t bytes, const char* what) {
  std::unique_lock<std::mutex> lock(mu_);
  // Blocked requests (tickets not yet served) go first.
  if (next_ticket_ != served_ || !FitsLocked(bytes)) {
    return absl::ResourceExhaustedError(absl::StrCat(
        what, ": ", bytes, " bytes do not fit (", in_use_, " of ",
        budget_ == SIZE_MAX ? std::string("unlimited") : absl::StrCat(budget_), " bytes in use",
        next_ticket_ != served_ ? ", blocked requests waiting" : "", ")"));
  }
  in_use_ += bytes;
  peak_ = std::max(peak_, in_use_);
  return absl::OkStatus();
}

absl::Status MemoryBudget::ReserveBlocking(size_t bytes, absl::Time deadline, const char* what) {
  if (bytes > budget_) {
    return absl::ResourceExhaustedError(
        absl::StrCat(what, ": ", bytes, " bytes exceed the whole budget of ", budget_, " bytes"));
  }
  std::unique_lock<std::mutex> lock(mu_);
  const uint64_t ticket = next_ticket_++;
  auto ready = [this, ticket, bytes] { return served_ == ticket && FitsLocked(bytes); };
  if (!internal::WaitUntil(cv_, lock, deadline, ready)) {
    // Give up our place in the line. Later tickets wait for `served_` to reach them, so a
    // cancelled ticket must not block them: tickets are served in order, and a timed-out one
    // is marked by advancing past it once it is at the head.
    abandoned_.push_back(ticket);
    SkipAbandonedLocked();
    cv_.notify_all();  // the next ticket may be at the head now
    return absl::DeadlineExceededError(absl::StrCat(what, ": ", bytes,
                                                    " bytes did not fit before the deadline (",
                                                    in_use_, " of ", budget_, " bytes in use)"));
  }
  ++served_;
  SkipAbandonedLocked();
  in_use_ += bytes;
  peak_ = std::max(peak_, in_use_);
  cv_.notify_all();  // the next ticket may fit as well
  return absl::OkStatus();
}

void MemoryBudget::SkipAbandonedLocked() {
  bool progressed = true;
  while (progressed) {
    progressed = false;
    for (auto it = abandoned_.begin(); it != abandoned_.end(); ++it) {
      if (*it == served_) {
        abandoned_.erase(it);
        ++served_;
        progressed = true;
        break;
      }
    }
  }
}

void MemoryBudget::Release(size_t bytes) {
  {
    std::unique_lock<std::mutex> lock(mu_);
    in_use_ -= std::min(bytes, in_use_);
  }
  cv_.notify_all();
}

size_t MemoryBudget::bytes_in_use() const {
  std::unique_lock<std::mutex> lock(mu_);
  return in_use_;
}

size_t MemoryBudget::peak_bytes_in_use() const {
  std::unique_lock<std::mutex> lock(mu_);
  return peak_;
}

void MemoryBudget::ResetPeak() {
  std::unique_lock<std::mutex> lock(mu_);
  peak_ = in_use_;
}

}  // namespace hmoe
