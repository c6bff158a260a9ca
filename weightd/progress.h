#pragma once

// Load progress for humans: on a terminal, one progress bar line redrawn in place on stderr; in
// logs (supervisord, tests), an INFO line every `log_interval`. Runs its own thread from Start()
// until Stop() or destruction. Thread-safe.

#include <atomic>
#include <cstdint>
#include <string>
#include <thread>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace hmoe::weightd {

// "12.3 GiB", "512.0 MiB", "17 B".
std::string FormatBytes(uint64_t bytes);
// One status text: "37% 1.2 GiB / 3.3 GiB, 1.5 GiB/s, ETA 1.4 s".
std::string FormatProgress(uint64_t done, uint64_t total, double seconds);

class ProgressReporter {
 public:
  // `done` must outlive the reporter.
  ProgressReporter(const std::atomic<uint64_t>* done, uint64_t total, bool tty,
                   absl::Duration log_interval = absl::Seconds(5));
  ProgressReporter(const ProgressReporter&) = delete;
  ProgressReporter& operator=(const ProgressReporter&) = delete;
  ~ProgressReporter();

  void Start();
  // Prints the final state and joins the thread. Idempotent.
  void Stop();

 private:
  void Loop();
  void Report(bool final);

  const std::atomic<uint64_t>* done_;
  uint64_t total_;
  bool tty_;
  absl::Duration log_interval_;
  absl::Time start_;
  absl::Notification stop_;
  std::jthread thread_;
};

}  // namespace hmoe::weightd
