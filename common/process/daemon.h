#pragma once

// The process skeleton of the four daemons (hmoe-weightd, hmoe-router, hmoe-prefill-worker,
// hmoe-decode-worker). Each main() is
//
//   int main(int argc, char** argv) {
//     return hmoe::process::RunDaemon(argc, argv, {.usage = "..."}, &hmoe::xyz::Run);
//   }
//
// where Run(StopSignalWatcher&) checks its flags, starts its services, waits for the stop
// signal, drains and returns a Status. RunDaemon maps that Status to the exit code every daemon
// documents: 0 after SIGTERM/SIGINT (drained), 1 on a start-up or runtime error, 2 on bad flags
// (a FlagError). No gRPC here: gRPC-specific start-up lives in common/rpc.

#include <signal.h>

#include <atomic>
#include <string_view>
#include <thread>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"

namespace hmoe::process {

inline constexpr int kExitOk = 0;        // stopped by SIGTERM/SIGINT (drained), or --help
inline constexpr int kExitError = 1;     // a start-up or runtime error
inline constexpr int kExitBadFlags = 2;  // bad flags or arguments

// Marks `s` (not OK) as a flag error: RunDaemon exits kExitBadFlags for it.
absl::Status FlagError(absl::Status s);
// InvalidArgument(`message`) marked as a flag error.
absl::Status FlagError(std::string_view message);
bool IsFlagError(const absl::Status& s);
// The exit code for what Run returned: kExitOk, kExitBadFlags for a FlagError, else kExitError.
int ExitCode(const absl::Status& s);

// Takes the stop signals (SIGTERM and SIGINT, plus SIGHUP with `with_sighup`) for the process:
// the constructor blocks them in the calling thread (and so in every thread started from it
// afterwards: create it in main before any other thread) and ignores SIGPIPE; its own thread
// waits for them with sigtimedwait, logs "received signal ..., stopping" and requests the stop.
// The destructor stops that thread (within 100 ms). Thread-safe.
class StopSignalWatcher {
 public:
  explicit StopSignalWatcher(bool with_sighup = false);
  ~StopSignalWatcher();
  StopSignalWatcher(const StopSignalWatcher&) = delete;
  StopSignalWatcher& operator=(const StopSignalWatcher&) = delete;

  // Whether a stop signal arrived.
  bool StopRequested() const { return stop_.HasBeenNotified(); }
  // Blocks until a stop signal arrives.
  void WaitForStop() const { stop_.WaitForNotification(); }
  // Set once a stop signal arrived, for loops that poll a flag (relaxed loads suffice).
  const std::atomic<bool>* stop_flag() const { return &stop_flag_; }

 private:
  sigset_t signals_;
  std::atomic<bool> stop_flag_{false};
  absl::Notification stop_;
  std::jthread thread_;  // last: starts after everything above exists
};

struct DaemonSpec {
  std::string_view usage;       // the --help synopsis
  bool stop_on_sighup = false;  // SIGHUP stops the daemon as SIGTERM does (weightd)
};

// The skeleton of a daemon's main(): parses the flags (dashed or underscored names; --help lists
// the binary's own flags; a positional argument is a flag error), takes the stop signals
// (StopSignalWatcher, before any other thread exists), runs `run`, logs its error (if any) and
// returns the exit code (ExitCode).
// Once per process (absl allows one usage message).
int RunDaemon(int argc, char** argv, const DaemonSpec& spec,
              absl::FunctionRef<absl::Status(StopSignalWatcher&)> run);
// RunDaemon after the flags: takes the stop signals, runs `run`, logs its error, returns the exit
// code.
int RunWithStopSignals(bool with_sighup, absl::FunctionRef<absl::Status(StopSignalWatcher&)> run);

// Polls `done` every 20 ms until it returns true or `deadline` passes (a drain: in-flight work
// finishing after the stop signal). Whether `done` returned true.
bool WaitUntil(absl::Time deadline, absl::FunctionRef<bool()> done);

}  // namespace hmoe::process
