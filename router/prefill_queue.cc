#include "router/prefill_queue.h"

#include <algorithm>

#include "absl/cleanup/cleanup.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace hmoe::router {

std::vector<std::string> PrefillQueue::GrantableLocked(const std::vector<std::string>& candidates,
                                                       Need need) const {
  if (need == Need::kAll) {
    for (const std::string& c : candidates) {
      if (busy_.contains(c)) return {};
    }
    return candidates;
  }
  for (const std::string& c : candidates) {
    if (!busy_.contains(c)) return {c};
  }
  return {};
}

absl::StatusOr<std::vector<std::string>> PrefillQueue::Acquire(
    const std::vector<std::string>& candidates, Need need, absl::Time deadline,
    const std::function<bool()>& cancelled, const std::function<bool(const std::string&)>& usable,
    int32_t max_waiting) {
  if (candidates.empty()) return absl::InvalidArgumentError("prefill queue: no candidate workers");
  const bool advertised = max_waiting >= 0 && max_waiting < options_.max_waiting;
  const int32_t limit = advertised ? max_waiting : options_.max_waiting;
  absl::MutexLock lock(&mu_);
  if (static_cast<int32_t>(queue_.size()) >= limit) {
    return absl::ResourceExhaustedError(
        absl::StrCat("router: ", limit, " long prompts wait for a prefill worker",
                     advertised ? " (the waiting room the live prefill workers advertise)" : "",
                     "; retry later"));
  }
  const int64_t ticket = next_ticket_++;
  queue_.push_back(ticket);
  absl::Cleanup leave = [this, ticket]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    queue_.erase(std::find(queue_.begin(), queue_.end(), ticket));
    ++generation_;  // the next request may be at the head now
  };

  while (true) {
    if (queue_.front() == ticket) {
      std::vector<std::string> granted = GrantableLocked(candidates, need);
      if (!granted.empty()) {
        for (const std::string& w : granted) busy_.insert(w);
        return granted;
      }
    }
    if (cancelled()) return absl::CancelledError("cancelled while waiting for a prefill worker");
    const absl::Time now = absl::Now();
    if (now >= deadline) {
      return absl::DeadlineExceededError("deadline exceeded while waiting for a prefill worker");
    }
    int usable_count = 0;
    for (const std::string& c : candidates) {
      if (usable(c)) {
        ++usable_count;
      } else if (need == Need::kAll) {
        return absl::UnavailableError(absl::StrCat("prefill worker ", c, " is gone"));
      }
    }
    if (usable_count == 0) {
      return absl::UnavailableError("every candidate prefill worker is gone");
    }
    const int64_t seen = generation_;
    auto changed = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return generation_ != seen ||
             (queue_.front() == ticket && !GrantableLocked(candidates, need).empty());
    };
    mu_.AwaitWithDeadline(absl::Condition(&changed), std::min(deadline, now + options_.poll));
  }
}

void PrefillQueue::Release(const std::vector<std::string>& workers) {
  absl::MutexLock lock(&mu_);
  for (const std::string& w : workers) busy_.erase(w);
  ++generation_;
}

void PrefillQueue::Poke() {
  absl::MutexLock lock(&mu_);
  ++generation_;
}

int32_t PrefillQueue::waiting() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int32_t>(queue_.size());
}

bool PrefillQueue::busy(const std::string& worker) const {
  absl::MutexLock lock(&mu_);
  return busy_.contains(worker);
}

}  // namespace hmoe::router
