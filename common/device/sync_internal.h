#pragma once

// Synchronization helpers for common/device and common/engine.
//
// Why std::mutex here and not absl::Mutex (STYLE.md §6): Debian's abseil (20220623) is built
// without ThreadSanitizer annotations, so TSan cannot see absl::Mutex's happens-before edges and
// reports every structure it protects as racing (checked with a two-thread counter). The event
// tuples, memory budget, ring buffer and KV block pool are exactly what the `threads`-labelled
// tests exercise under TSan, so they use the pthread-based std::mutex / std::condition_variable,
// which TSan understands. Guarded members are documented in comments instead of
// ABSL_GUARDED_BY (which needs a capability-annotated mutex type).

#include <chrono>
#include <condition_variable>
#include <mutex>

#include "absl/time/time.h"

namespace hmoe::internal {

// Waits on `cv` (with `lock` held) until pred() is true or `deadline` passes; returns pred().
template <typename Pred>
bool WaitUntil(std::condition_variable& cv, std::unique_lock<std::mutex>& lock, absl::Time deadline,
               Pred pred) {
  if (deadline == absl::InfiniteFuture()) {
    cv.wait(lock, pred);
    return true;
  }
  return cv.wait_until(lock, absl::ToChronoTime(deadline), pred);
}

}  // namespace hmoe::internal
