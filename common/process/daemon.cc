#include "common/process/daemon.h"

#include <cstring>
#include <string>
#include <vector>

#include "absl/flags/parse.h"
#include "absl/strings/cord.h"
#include "absl/time/clock.h"

#include "common/base/flags.h"
#include "common/base/logging.h"

namespace hmoe::process {
namespace {

constexpr char kFlagErrorPayload[] = "type.hmoe/process.FlagError";

}  // namespace

absl::Status FlagError(absl::Status s) {
  if (!s.ok()) s.SetPayload(kFlagErrorPayload, absl::Cord("1"));
  return s;
}

absl::Status FlagError(std::string_view message) {
  return FlagError(absl::InvalidArgumentError(absl::string_view(message.data(), message.size())));
}

bool IsFlagError(const absl::Status& s) {
  return !s.ok() && s.GetPayload(kFlagErrorPayload).has_value();
}

int ExitCode(const absl::Status& s) {
  if (s.ok()) return kExitOk;
  return IsFlagError(s) ? kExitBadFlags : kExitError;
}

StopSignalWatcher::StopSignalWatcher(bool with_sighup) {
  sigemptyset(&signals_);
  sigaddset(&signals_, SIGTERM);
  sigaddset(&signals_, SIGINT);
  if (with_sighup) sigaddset(&signals_, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &signals_, nullptr);
  ::signal(SIGPIPE, SIG_IGN);
  thread_ = std::jthread([this](std::stop_token token) {
    const timespec tick{0, 100'000'000};
    while (!token.stop_requested()) {
      const int sig = ::sigtimedwait(&signals_, nullptr, &tick);
      if (sig > 0) {
        HMOE_LOG(INFO) << "received signal " << sig << " (" << strsignal(sig) << "), stopping";
        // Relaxed: pollers only read it; the Notification orders everything else.
        stop_flag_.store(true, std::memory_order_relaxed);
        if (!stop_.HasBeenNotified()) stop_.Notify();
      }
    }
  });
}

StopSignalWatcher::~StopSignalWatcher() {
  thread_.request_stop();
  if (thread_.joinable()) thread_.join();
}

int RunDaemon(int argc, char** argv, const DaemonSpec& spec,
              absl::FunctionRef<absl::Status(StopSignalWatcher&)> run) {
  std::vector<std::string> storage;
  std::vector<char*> args = NormalizeFlagNames(argc, argv, storage);
  SetUsage(spec.usage);
  std::vector<char*> positional =
      absl::ParseCommandLine(static_cast<int>(args.size()), args.data());
  if (positional.size() > 1) {
    HMOE_LOG(ERROR) << "unexpected argument \"" << positional[1] << "\"";
    return kExitBadFlags;
  }
  return RunWithStopSignals(spec.stop_on_sighup, run);
}

int RunWithStopSignals(bool with_sighup, absl::FunctionRef<absl::Status(StopSignalWatcher&)> run) {
  StopSignalWatcher signals(with_sighup);
  const absl::Status status = run(signals);
  if (!status.ok()) HMOE_LOG(ERROR) << status.message();
  return ExitCode(status);
}

bool WaitUntil(absl::Time deadline, absl::FunctionRef<bool()> done) {
  while (!done()) {
    if (absl::Now() >= deadline) return false;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return true;
}

}  // namespace hmoe::process
