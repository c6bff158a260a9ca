#pragma once

// First-come-first-served admission of long prompts to prefill workers (paper §3.3.2). A prefill
// worker runs one prompt at a time, so the router hands out workers: the oldest waiting request
// (the head of the queue) takes the workers it needs as soon as they are free; requests behind it
// wait even when a worker they could use is free, so a DSLP request that needs every worker is not
// starved by a stream of SLP requests. The queue is bounded (ResourceExhausted beyond), so
// overload never grows memory. Thread-safe.

#include <cstdint>
#include <deque>
#include <functional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace hmoe::router {

class PrefillQueue {
 public:
  struct Options {
    // Requests that may wait; ResourceExhausted beyond.
    int32_t max_waiting = 64;
    // How often a waiter re-checks cancellation and worker liveness (Poke() wakes it sooner).
    absl::Duration poll = absl::Milliseconds(20);
  };
  enum class Need {
    kAny,  // the first free candidate, in candidate order (SLP)
    kAll,  // every candidate at once (DSLP)
  };

  explicit PrefillQueue(Options options) : options_(options) {}

  // Joins the queue and blocks until this request is at its head and the workers it needs are
  // free; marks them busy and returns them (in candidate order). The caller must Release() them.
  // Errors (the request leaves the queue):
  //   ResourceExhausted  max_waiting requests already wait (nothing waited): the smaller of
  //                      Options::max_waiting and the `max_waiting` argument when >= 0 (the
  //                      waiting room the prefill workers advertise now);
  //   Cancelled          `cancelled()` returned true;
  //   DeadlineExceeded   `deadline` (absl::Now() time) passed;
  //   Unavailable        a needed candidate is no longer usable (`usable(id)` false: for kAll any
  //                      candidate, for kAny all of them): route again;
  //   InvalidArgument    no candidates.
  // `cancelled` and `usable` are called with the queue's lock held; they must not call back into
  // the queue.
  absl::StatusOr<std::vector<std::string>> Acquire(
      const std::vector<std::string>& candidates, Need need, absl::Time deadline,
      const std::function<bool()>& cancelled, const std::function<bool(const std::string&)>& usable,
      int32_t max_waiting = -1) ABSL_LOCKS_EXCLUDED(mu_);

  // Frees workers acquired before.
  void Release(const std::vector<std::string>& workers) ABSL_LOCKS_EXCLUDED(mu_);

  // Makes every waiter re-check cancellation and liveness now.
  void Poke() ABSL_LOCKS_EXCLUDED(mu_);

  int32_t waiting() const ABSL_LOCKS_EXCLUDED(mu_);
  int32_t max_waiting() const { return options_.max_waiting; }
  bool busy(const std::string& worker) const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  // The workers `need` would take now (empty: not possible yet).
  std::vector<std::string> GrantableLocked(const std::vector<std::string>& candidates,
                                           Need need) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Options options_;
  mutable absl::Mutex mu_;
  // Tickets of waiting requests, oldest first.
  std::deque<int64_t> queue_ ABSL_GUARDED_BY(mu_);
  int64_t next_ticket_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_set<std::string> busy_ ABSL_GUARDED_BY(mu_);
  // Bumped by Poke() and Release(): waiters re-evaluate.
  int64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace hmoe::router
