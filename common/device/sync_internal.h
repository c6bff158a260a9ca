#pragma once

// Synchronization helpers for common/device and common/engine.
//
// These libraries use std::mutex / std::condition_variable, with the guarded members named in
// comments (ABSL_GUARDED_BY needs a capability-annotated mutex type). The choice dates from when
// TSan could not see absl::Mutex (Debian's abseil 20220623 is not TSan-instrumented); since
// tests/support/tsan_absl_annotations.cc is linked into every TSan test binary, both work under
// TSan, and new code may use absl::Mutex with the thread-safety annotations (docs/style.md §6).

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
